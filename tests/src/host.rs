//! A host of the end-to-end tests over the soft provider's TCP wire: an admin queue and one
//! I/O queue of depth 31 on a fabric of its own, Asynchronous Event Requests held by the
//! target, the Changed Namespace List, and a write read back.

use std::net::SocketAddr;

use nvmf_host::RdmaQueue;
use nvmfd_nvme::host::{AdminQueue, HostId, IoQueue};
use nvmfd_nvme::wire::{self, Sqe};
use nvmfd_rdma::any::cm::CmChannel;
use nvmfd_rdma::soft::Fabric;
use zerocopy::little_endian::U16;

use crate::wait_for;

/// Host `n`: its NQN and host ID are made from `n`.
pub fn host(n: u8) -> HostId {
    HostId {
        nqn: format!("nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-0000000000{n:02x}"),
        id: [n; 16],
    }
}

fn queue(f: &Fabric, addr: SocketAddr, qid: u16) -> RdmaQueue {
    let ch = CmChannel::Soft(nvmfd_rdma::soft::cm::CmChannel::new(f).unwrap());
    RdmaQueue::connect(ch, addr, qid, 31, 4096, 128 * 1024)
        .unwrap_or_else(|e| panic!("connect queue {qid}: {e}"))
}

/// A connected host: admin queue and I/O queue 1.
#[allow(missing_debug_implementations)]
pub struct Host {
    pub admin: AdminQueue<RdmaQueue>,
    pub io: IoQueue<RdmaQueue>,
    next_aer: u16,
}

impl Host {
    /// Connects host `n` from the soft device `ip` to subsystem `sub` at `addr`, with
    /// Namespace Attribute Notices enabled.
    pub fn connect(ip: &str, addr: SocketAddr, sub: &str, n: u8) -> Host {
        Host::connect_with_kato(ip, addr, sub, n, 0)
    }

    /// `connect`, asking for a keep-alive timeout of `kato_ms` (0: none); the host sends no
    /// Keep Alive of its own.
    pub fn connect_with_kato(ip: &str, addr: SocketAddr, sub: &str, n: u8, kato_ms: u32) -> Host {
        Host::connect_with(ip, addr, sub, (n, kato_ms), || ())
    }

    /// `connect`, its two RDMA connections made first and `between` run before its Fabrics
    /// Connects: what follows needs the reactors alone (the control thread may be held).
    pub fn connect_held(
        ip: &str,
        addr: SocketAddr,
        sub: &str,
        n: u8,
        between: impl FnOnce(),
    ) -> Host {
        Host::connect_with(ip, addr, sub, (n, 0), between)
    }

    fn connect_with(
        ip: &str,
        addr: SocketAddr,
        sub: &str,
        (n, kato_ms): (u8, u32),
        between: impl FnOnce(),
    ) -> Host {
        let f = Fabric::networked();
        f.add_device(ip.parse().unwrap()).unwrap();
        let h = host(n);
        let (aq, iq) = (queue(&f, addr, 0), queue(&f, addr, 1));
        between();
        let mut admin = AdminQueue::connect(aq, &h, sub, 31, kato_ms).unwrap();
        admin.enable().unwrap();
        admin.set_queue_count(1).unwrap();
        // Asynchronous Event Configuration: Namespace Attribute Notices.
        admin.set_feature(0x0B, 1 << 8).unwrap();
        let io = IoQueue::connect(iq, &h, sub, admin.cntlid, 1, 31).unwrap();
        std::mem::forget(f);
        Host {
            admin,
            io,
            next_aer: 0xA000,
        }
    }

    /// Sends an Asynchronous Event Request, which the target holds.
    pub fn post_aer(&mut self) -> u16 {
        let cid = self.next_aer;
        self.next_aer += 1;
        let sqe = Sqe {
            opcode: 0x0C,
            flags: 1 << 6,
            cid: U16::new(cid),
            ..wire::zeroed()
        };
        self.admin.transport().post(sqe).unwrap();
        cid
    }

    /// Waits for the completion of AER `cid` (keep-alives make the host poll); returns dw0.
    pub fn wait_aer(&mut self, cid: u16) -> u32 {
        wait_for("the asynchronous event", || {
            self.admin.ping().unwrap();
            let got = self.admin.transport().take_others();
            got.iter().find(|c| c.cid.get() == cid).map(|c| {
                assert_eq!(c.status.get() >> 1, 0, "AER status");
                c.dw0.get()
            })
        })
    }

    /// The Changed Namespace List (read, so cleared).
    pub fn changed(&mut self) -> Vec<u32> {
        let page = self.admin.get_log_page(0x04, 0, 4096).unwrap();
        page.chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .take_while(|&n| n != 0)
            .collect()
    }

    pub fn blocks(&mut self, nsid: u32) -> u64 {
        self.admin.identify_namespace(nsid).unwrap().nsze.get()
    }

    pub fn write_read(&mut self, nsid: u32, lba: u64, seed: u8) {
        let data = vec![seed; 4096];
        self.io.write(nsid, lba, 8, &data, false).unwrap();
        let mut back = vec![0u8; 4096];
        self.io.read(nsid, lba, 8, &mut back).unwrap();
        assert!(back == data, "read back differs");
    }
}
