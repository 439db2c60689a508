//! The host side of NVMe over Fabrics: what a host sends and expects, over any transport that
//! implements [`HostTransport`]. nvmfd's `nvmf` tool and the tests use it.

use std::time::{Duration, Instant};

use zerocopy::little_endian::{U16, U32};
use zerocopy::IntoBytes;

use crate::wire::{
    self, admin_opcode, fctype, io_opcode, property, ConnectCmd, ConnectData, Cqe, Sqe, Status,
};

/// Data a command moves.
#[derive(Debug)]
pub enum DataDir<'a> {
    /// None.
    None,
    /// Host to target (writes, Connect data, DSM ranges).
    ToTarget(&'a [u8]),
    /// Target to host (reads, Identify, log pages).
    FromTarget(&'a mut [u8]),
}

/// Why a host operation failed.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    /// the transport failed or the connection closed
    #[error("transport: {0}")]
    Transport(String),
    /// the target completed the command with an error status
    #[error("command failed: {status:?} (dw0 {dw0:#x})")]
    Status {
        /// The status.
        status: Status,
        /// Completion dword 0 (Connect's Invalid Parameters says where).
        dw0: u32,
    },
    /// the target did not reach a state in time
    #[error("timed out waiting for {0}")]
    Timeout(&'static str),
    /// the target answered something a host cannot use
    #[error("protocol: {0}")]
    Protocol(String),
}

impl HostError {
    /// The NVMe status, when the target answered with one.
    pub fn status(&self) -> Option<Status> {
        match self {
            HostError::Status { status, .. } => Some(*status),
            _ => None,
        }
    }
}

/// A transport as the host sees it: send a command with its data, get its completion.
pub trait HostTransport {
    /// Sends `sqe` (the transport fills in the SGL that describes `data`) and waits for the
    /// completion.
    fn execute(&mut self, sqe: Sqe, data: DataDir<'_>) -> Result<Cqe, HostError>;

    /// Whether a command timed out or the transport failed: nothing more is carried on it (a
    /// late answer could be taken for another command's), and a host has nothing more to
    /// tell the target through it.
    fn broken(&self) -> bool {
        false
    }
}

/// The least a host waits for a shutdown to complete (as Linux's default
/// `shutdown_timeout`), whatever CAP.TO says.
pub const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);

/// The host's identity.
#[derive(Clone, Debug)]
pub struct HostId {
    /// Host NQN.
    pub nqn: String,
    /// Host identifier.
    pub id: [u8; 16],
}

fn check(cqe: Cqe) -> Result<Cqe, HostError> {
    let st = cqe.status();
    if st.is_success() {
        Ok(cqe)
    } else {
        Err(HostError::Status {
            status: st,
            dw0: cqe.dw0.get(),
        })
    }
}

/// A command without data: PSDT 01b (SGLs, as over every fabric) and a keyed SGL of no
/// length; a transport that moves data for it writes its own SGL.
fn sqe(opcode: u8, cid: u16) -> Sqe {
    Sqe {
        opcode,
        flags: 1 << 6, // PSDT: SGL
        cid: U16::new(cid),
        dptr: wire::SglDesc::keyed(0, 0, 0, false),
        ..wire::zeroed()
    }
}

/// A command `opcode` without data (command identifier 0): PSDT 01b and a keyed SGL of no
/// length, as every fabric's host sends one; set an SGL where it moves data.
pub fn command(opcode: u8) -> Sqe {
    sqe(opcode, 0)
}

/// A command on `nlb` blocks (at least 1) at `slba` of namespace `nsid`: Read, Write (with
/// `fua`), Write Zeroes and the like; the command identifier and SGL are the transport's.
pub fn rw_sqe(opcode: u8, nsid: u32, slba: u64, nlb: u32, fua: bool) -> Sqe {
    let mut s = sqe(opcode, 0);
    s.nsid = U32::new(nsid);
    s.cdw10 = U32::new(wire::lo32(slba));
    s.cdw11 = U32::new(wire::hi32(slba));
    // (0 for a command on no blocks, such as a Flush.)
    debug_assert!(
        nlb <= 65_536,
        "NLB {nlb}: one command moves at most 65,536 blocks"
    );
    s.cdw12 = U32::new(nlb.saturating_sub(1) | (u32::from(fua) << 30));
    s
}

/// What a Connect asks for.
struct ConnectArgs {
    qid: u16,
    sqsize: u16,
    kato_ms: u32,
    cntlid: u16,
}

fn connect<T: HostTransport>(
    t: &mut T,
    host: &HostId,
    subnqn: &str,
    a: ConnectArgs,
) -> Result<Cqe, HostError> {
    let ConnectArgs {
        qid,
        sqsize,
        kato_ms,
        cntlid,
    } = a;
    let cid = 0;
    let cmd = ConnectCmd {
        opcode: admin_opcode::FABRICS,
        flags: 1 << 6,
        cid: U16::new(cid),
        fctype: fctype::CONNECT,
        qid: U16::new(qid),
        sqsize: U16::new(sqsize),
        kato: U32::new(kato_ms),
        ..wire::zeroed()
    };
    let mut data: ConnectData = wire::zeroed();
    data.hostid = host.id;
    data.cntlid = U16::new(cntlid);
    wire::put_str(&mut data.subnqn, subnqn, 0);
    wire::put_str(&mut data.hostnqn, &host.nqn, 0);
    let sqe = wire::read::<Sqe>(cmd.as_bytes())
        .ok_or_else(|| HostError::Protocol("connect layout".into()))?;
    check(t.execute(sqe, DataDir::ToTarget(data.as_bytes()))?)
}

/// An admin queue, connected.
#[derive(Debug)]
pub struct AdminQueue<T: HostTransport> {
    t: T,
    cid: u16,
    /// The controller ID the target assigned.
    pub cntlid: u16,
}

impl<T: HostTransport> AdminQueue<T> {
    /// Connects the admin queue of a new controller of `subnqn` (`sqsize` 0's based;
    /// `kato_ms` 0 asks for no keep-alive).
    pub fn connect(
        mut t: T,
        host: &HostId,
        subnqn: &str,
        sqsize: u16,
        kato_ms: u32,
    ) -> Result<Self, HostError> {
        let args = ConnectArgs {
            qid: 0,
            sqsize,
            kato_ms,
            cntlid: 0xFFFF,
        };
        let cqe = connect(&mut t, host, subnqn, args)?;
        Ok(AdminQueue {
            t,
            cid: 1,
            cntlid: wire::sat(cqe.dw0.get() & 0xFFFF),
        })
    }

    /// The transport.
    pub fn transport(&mut self) -> &mut T {
        &mut self.t
    }

    fn next_cid(&mut self) -> u16 {
        self.cid = self.cid.wrapping_add(1);
        self.cid
    }

    /// Sends an admin command built by the caller (cid and PSDT filled in here).
    pub fn raw(&mut self, mut s: Sqe, data: DataDir<'_>) -> Result<Cqe, HostError> {
        s.cid = U16::new(self.next_cid());
        s.flags |= 1 << 6;
        check(self.t.execute(s, data)?)
    }

    /// Property Get.
    pub fn property_get(&mut self, offset: u32, eight_bytes: bool) -> Result<u64, HostError> {
        let mut s = sqe(admin_opcode::FABRICS, self.next_cid());
        let b = s.as_mut_bytes();
        b[4] = fctype::PROPERTY_GET;
        b[40] = u8::from(eight_bytes);
        b[44..48].copy_from_slice(&offset.to_le_bytes());
        let c = check(self.t.execute(s, DataDir::None)?)?;
        Ok(u64::from(c.dw0.get()) | u64::from(c.dw1.get()) << 32)
    }

    /// Property Set (4 bytes).
    pub fn property_set(&mut self, offset: u32, value: u32) -> Result<(), HostError> {
        let mut s = sqe(admin_opcode::FABRICS, self.next_cid());
        let b = s.as_mut_bytes();
        b[4] = fctype::PROPERTY_SET;
        b[44..48].copy_from_slice(&offset.to_le_bytes());
        b[48..56].copy_from_slice(&u64::from(value).to_le_bytes());
        check(self.t.execute(s, DataDir::None)?).map(drop)
    }

    /// Enables the controller (CC.EN with 64/16-byte entries) and waits for CSTS.RDY, as
    /// long as CAP.TO says the controller may take.
    pub fn enable(&mut self) -> Result<(), HostError> {
        let limit = self.ready_timeout()?;
        let cc = 1 | (6 << 16) | (4 << 20);
        self.property_set(property::CC, cc)?;
        self.wait_csts(limit, "CSTS.RDY", |csts| {
            if csts & 0x2 != 0 {
                return Err(HostError::Protocol(
                    "controller fatal status (CSTS.CFS)".into(),
                ));
            }
            Ok(csts & 1 == 1)
        })
    }

    /// Shuts the controller down (CC.SHN normal) and waits for CSTS.SHST complete: as long
    /// as CAP.TO allows, and at least [`SHUTDOWN_TIMEOUT`] (a target flushes its volatile
    /// caches meanwhile).
    pub fn shutdown(&mut self) -> Result<(), HostError> {
        let limit = self.ready_timeout()?.max(SHUTDOWN_TIMEOUT);
        let cc = wire::lo32(self.property_get(property::CC, false)?);
        self.property_set(property::CC, (cc & !(0x3 << 14)) | (1 << 14))?;
        self.wait_csts(limit, "CSTS.SHST", |csts| {
            if csts & 0x2 != 0 {
                // (nvmfd's when the shutdown's flush failed: writes may be lost.)
                return Err(HostError::Protocol(
                    "controller fatal status (CSTS.CFS) during the shutdown".into(),
                ));
            }
            Ok((csts >> 2) & 0x3 == 2)
        })
    }

    /// CAP.TO: how long the controller may take to become ready (500 ms units).
    fn ready_timeout(&mut self) -> Result<Duration, HostError> {
        let cap = self.property_get(property::CAP, true)?;
        let to = (cap >> 24) & 0xff;
        Ok(Duration::from_millis(500 * to.max(1)))
    }

    /// Reads CSTS until `done` says so or `limit` has passed, pausing a little longer after
    /// each read (up to 10 ms).
    fn wait_csts(
        &mut self,
        limit: Duration,
        what: &'static str,
        mut done: impl FnMut(u32) -> Result<bool, HostError>,
    ) -> Result<(), HostError> {
        let end = Instant::now() + limit;
        let mut pause = Duration::from_micros(50);
        loop {
            let csts = wire::lo32(self.property_get(property::CSTS, false)?);
            if done(csts)? {
                return Ok(());
            }
            if Instant::now() >= end {
                return Err(HostError::Timeout(what));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(10));
        }
    }

    fn identify(&mut self, cns: u8, nsid: u32) -> Result<Vec<u8>, HostError> {
        let mut s = sqe(admin_opcode::IDENTIFY, self.next_cid());
        s.nsid = U32::new(nsid);
        s.cdw10 = U32::new(u32::from(cns));
        let mut buf = vec![0u8; 4096];
        check(self.t.execute(s, DataDir::FromTarget(&mut buf))?)?;
        Ok(buf)
    }

    /// Identify Controller.
    pub fn identify_controller(&mut self) -> Result<wire::IdentifyController, HostError> {
        let b = self.identify(1, 0)?;
        wire::read(&b).ok_or_else(|| HostError::Protocol("short identify".into()))
    }

    /// The NVM command set's Identify Controller (CNS 06h, CSI 00h): the Dataset Management
    /// limits, among others.
    pub fn identify_controller_nvm(&mut self) -> Result<wire::IdentifyControllerNvm, HostError> {
        // CSI (CDW11 bits 31:24) is 0, the NVM command set.
        let b = self.identify(wire::cns::IO_COMMAND_SET_CONTROLLER, 0)?;
        wire::read(&b).ok_or_else(|| HostError::Protocol("short identify".into()))
    }

    /// Identify Namespace.
    pub fn identify_namespace(&mut self, nsid: u32) -> Result<wire::IdentifyNamespace, HostError> {
        let b = self.identify(0, nsid)?;
        wire::read(&b).ok_or_else(|| HostError::Protocol("short identify".into()))
    }

    /// Active namespace IDs above `after`.
    pub fn active_namespaces(&mut self, after: u32) -> Result<Vec<u32>, HostError> {
        let b = self.identify(2, after)?;
        Ok(b.chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .take_while(|&n| n != 0)
            .collect())
    }

    /// Namespace identification descriptors: (type, identifier).
    pub fn namespace_ids(&mut self, nsid: u32) -> Result<Vec<(u8, Vec<u8>)>, HostError> {
        let b = self.identify(3, nsid)?;
        let mut out = Vec::new();
        let mut at = 0;
        while at + 4 <= b.len() && b[at] != 0 {
            let len = usize::from(b[at + 1]);
            let Some(id) = b.get(at + 4..at + 4 + len) else {
                break;
            };
            out.push((b[at], id.to_vec()));
            at += 4 + len;
        }
        Ok(out)
    }

    /// Set Features, Number of Queues: asks for `n` I/O queues, returns how many are granted.
    pub fn set_queue_count(&mut self, n: u16) -> Result<u16, HostError> {
        let mut s = sqe(admin_opcode::SET_FEATURES, self.next_cid());
        s.cdw10 = U32::new(u32::from(wire::feature::NUMBER_OF_QUEUES));
        let z = u32::from(n.saturating_sub(1));
        s.cdw11 = U32::new(z | z << 16);
        let c = check(self.t.execute(s, DataDir::None)?)?;
        let dw0 = c.dw0.get();
        Ok(wire::sat((dw0 & 0xFFFF).min(dw0 >> 16) + 1))
    }

    /// Get Features: dword 0 of the answer.
    pub fn get_feature(&mut self, fid: u8) -> Result<u32, HostError> {
        let mut s = sqe(admin_opcode::GET_FEATURES, self.next_cid());
        s.cdw10 = U32::new(u32::from(fid));
        Ok(check(self.t.execute(s, DataDir::None)?)?.dw0.get())
    }

    /// Get Features with SEL 011b: the feature's supported capabilities (bit 0 saveable,
    /// bit 1 namespace specific, bit 2 changeable).
    pub fn feature_capabilities(&mut self, fid: u8) -> Result<u32, HostError> {
        self.get_feature_as(fid, 3)
    }

    /// Get Features with Select `sel` (0 current, 1 default, 2 saved, 3 supported
    /// capabilities): dword 0 of the answer.
    pub fn get_feature_as(&mut self, fid: u8, sel: u32) -> Result<u32, HostError> {
        let mut s = sqe(admin_opcode::GET_FEATURES, self.next_cid());
        s.cdw10 = U32::new(u32::from(fid) | (sel & 7) << 8);
        Ok(check(self.t.execute(s, DataDir::None)?)?.dw0.get())
    }

    /// Set Features with dword 11.
    pub fn set_feature(&mut self, fid: u8, cdw11: u32) -> Result<u32, HostError> {
        let mut s = sqe(admin_opcode::SET_FEATURES, self.next_cid());
        s.cdw10 = U32::new(u32::from(fid));
        s.cdw11 = U32::new(cdw11);
        Ok(check(self.t.execute(s, DataDir::None)?)?.dw0.get())
    }

    /// A round trip through the admin queue that changes nothing (Get Features, Keep Alive
    /// Timer): a probe that works whatever the keep-alive timeout (Keep Alive itself is
    /// refused without one).
    pub fn ping(&mut self) -> Result<(), HostError> {
        self.get_feature(wire::feature::KEEP_ALIVE_TIMER).map(drop)
    }

    /// Keep Alive.
    pub fn keep_alive(&mut self) -> Result<(), HostError> {
        let s = sqe(admin_opcode::KEEP_ALIVE, self.next_cid());
        check(self.t.execute(s, DataDir::None)?).map(drop)
    }

    /// Get Log Page `lid`: `len` bytes (a multiple of 4) from byte `offset`.
    pub fn get_log_page(&mut self, lid: u8, offset: u64, len: u32) -> Result<Vec<u8>, HostError> {
        let numd = len / 4 - 1;
        let mut s = sqe(admin_opcode::GET_LOG_PAGE, self.next_cid());
        s.cdw10 = U32::new(u32::from(lid) | (numd & 0xFFFF) << 16);
        s.cdw11 = U32::new(numd >> 16);
        s.cdw12 = U32::new(wire::lo32(offset));
        s.cdw13 = U32::new(wire::hi32(offset));
        let mut buf = vec![0u8; len as usize];
        check(self.t.execute(s, DataDir::FromTarget(&mut buf))?)?;
        Ok(buf)
    }

    /// The discovery log (on a discovery controller): every entry, read consistently (the
    /// generation counter must not change during the read).
    pub fn discover(&mut self) -> Result<Vec<wire::DiscoveryLogEntry>, HostError> {
        // A long log goes in pieces: at most MDTS per Get Log Page, and 64 entries.
        let mdts = self.identify_controller()?.mdts;
        let piece: u64 = match mdts {
            0 => 64 * 1024,
            m => (4096u64 << m.min(16)).min(64 * 1024),
        };
        'again: for _ in 0..10 {
            let head = self.get_log_page(wire::log_page::DISCOVERY, 0, 1024)?;
            let h: wire::DiscoveryLogHeader =
                wire::read(&head).ok_or_else(|| HostError::Protocol("short log".into()))?;
            let n = h.numrec.get();
            if n > 1024 {
                return Err(HostError::Protocol(format!("{n} discovery records")));
            }
            let mut body = Vec::new();
            let end = 1024 + n * 1024;
            let mut at = 1024;
            while at < end {
                let len = piece.min(end - at);
                match self.get_log_page(wire::log_page::DISCOVERY, at, wire::sat(len)) {
                    Ok(piece) => body.extend(piece),
                    // The log shrank since its header was read: read it again.
                    Err(HostError::Status { .. }) => continue 'again,
                    Err(e) => return Err(e),
                }
                at += len;
            }
            let again = self.get_log_page(wire::log_page::DISCOVERY, 0, 1024)?;
            let h2: wire::DiscoveryLogHeader =
                wire::read(&again).ok_or_else(|| HostError::Protocol("short log".into()))?;
            if h2.genctr.get() != h.genctr.get() {
                continue;
            }
            return Ok(body
                .chunks_exact(1024)
                .filter_map(wire::read::<wire::DiscoveryLogEntry>)
                .collect());
        }
        Err(HostError::Timeout("a stable discovery log"))
    }
}

/// An I/O queue, connected.
#[derive(Debug)]
pub struct IoQueue<T: HostTransport> {
    t: T,
    cid: u16,
    /// Queue ID.
    pub qid: u16,
    /// The controller ID the target's Connect response carried.
    pub cntlid: u16,
}

impl<T: HostTransport> IoQueue<T> {
    /// Connects I/O queue `qid` of controller `cntlid`.
    pub fn connect(
        t: T,
        host: &HostId,
        subnqn: &str,
        cntlid: u16,
        qid: u16,
        sqsize: u16,
    ) -> Result<Self, HostError> {
        Self::connect_waiting(t, host, subnqn, (cntlid, qid, sqsize), Duration::ZERO)
    }

    /// [`IoQueue::connect`], sending the Connect again (on the same connection, a little later
    /// each time, for up to `wait`) while the target answers Controller Busy without Do Not
    /// Retry: a queue with this ID, lost, still has commands at the target's backend.
    pub fn connect_waiting(
        mut t: T,
        host: &HostId,
        subnqn: &str,
        (cntlid, qid, sqsize): (u16, u16, u16),
        wait: Duration,
    ) -> Result<Self, HostError> {
        let deadline = Instant::now() + wait;
        let mut pause = Duration::from_millis(1);
        loop {
            let args = ConnectArgs {
                qid,
                sqsize,
                kato_ms: 0,
                cntlid,
            };
            match connect(&mut t, host, subnqn, args) {
                Err(HostError::Status { status, .. })
                    if status.same_code(wire::status::CONNECT_CONTROLLER_BUSY)
                        && !status.dnr()
                        && Instant::now() + pause < deadline =>
                {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(100));
                }
                Err(e) => return Err(e),
                Ok(c) => {
                    return Ok(IoQueue {
                        t,
                        cid: 1,
                        qid,
                        cntlid: u16::try_from(c.dw0.get() & 0xFFFF).unwrap_or(0),
                    })
                }
            }
        }
    }

    /// The transport.
    pub fn transport(&mut self) -> &mut T {
        &mut self.t
    }

    fn next_cid(&mut self) -> u16 {
        self.cid = self.cid.wrapping_add(1);
        self.cid
    }

    fn rw(&mut self, opcode: u8, nsid: u32, slba: u64, nlb: u32, fua: bool) -> Sqe {
        let mut s = rw_sqe(opcode, nsid, slba, nlb, fua);
        s.cid = U16::new(self.next_cid());
        s
    }

    /// Reads `nlb` blocks at `slba` into `buf` (which must be `nlb` blocks long).
    pub fn read(
        &mut self,
        nsid: u32,
        slba: u64,
        nlb: u32,
        buf: &mut [u8],
    ) -> Result<(), HostError> {
        let s = self.rw(io_opcode::READ, nsid, slba, nlb, false);
        check(self.t.execute(s, DataDir::FromTarget(buf))?).map(drop)
    }

    /// Writes `data` (`nlb` blocks) at `slba`.
    pub fn write(
        &mut self,
        nsid: u32,
        slba: u64,
        nlb: u32,
        data: &[u8],
        fua: bool,
    ) -> Result<(), HostError> {
        let s = self.rw(io_opcode::WRITE, nsid, slba, nlb, fua);
        check(self.t.execute(s, DataDir::ToTarget(data))?).map(drop)
    }

    /// Flush.
    pub fn flush(&mut self, nsid: u32) -> Result<(), HostError> {
        let mut s = sqe(io_opcode::FLUSH, self.next_cid());
        s.nsid = U32::new(nsid);
        check(self.t.execute(s, DataDir::None)?).map(drop)
    }

    /// Write Zeroes of `nlb` blocks at `slba`.
    pub fn write_zeroes(&mut self, nsid: u32, slba: u64, nlb: u32) -> Result<(), HostError> {
        let s = self.rw(io_opcode::WRITE_ZEROES, nsid, slba, nlb, false);
        check(self.t.execute(s, DataDir::None)?).map(drop)
    }

    /// Dataset Management, deallocate: (slba, nlb) ranges.
    pub fn deallocate(&mut self, nsid: u32, ranges: &[(u64, u32)]) -> Result<(), HostError> {
        let mut s = sqe(io_opcode::DATASET_MANAGEMENT, self.next_cid());
        s.nsid = U32::new(nsid);
        s.cdw10 = U32::new(wire::sat(ranges.len().saturating_sub(1)));
        s.cdw11 = U32::new(1 << 2);
        let list: Vec<wire::DsmRange> = ranges
            .iter()
            .map(|&(slba, nlb)| wire::DsmRange {
                cattr: U32::ZERO,
                nlb: U32::new(nlb),
                slba: zerocopy::little_endian::U64::new(slba),
            })
            .collect();
        let data = list.as_bytes();
        check(self.t.execute(s, DataDir::ToTarget(data))?).map(drop)
    }

    /// Sends a command built by the caller (cid filled in here).
    pub fn raw(&mut self, mut s: Sqe, data: DataDir<'_>) -> Result<Cqe, HostError> {
        s.cid = U16::new(self.next_cid());
        check(self.t.execute(s, data)?)
    }
}

/// Reads a discovery entry's text fields: (subsystem NQN, address, port).
pub fn discovery_entry_text(e: &wire::DiscoveryLogEntry) -> (String, String, String) {
    let s = |b: &[u8]| wire::get_str(b).unwrap_or("").trim().to_owned();
    (s(&e.subnqn), s(&e.traddr), s(&e.trsvcid))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{AdminQueue, HostError, HostId};
    use crate::host_fake::FakeController;

    fn admin(to: u8, delay: Duration) -> AdminQueue<FakeController> {
        let host = HostId {
            nqn: "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-000000000001".into(),
            id: [1; 16],
        };
        AdminQueue::connect(
            FakeController::new(to, delay),
            &host,
            "nqn.2024-01.io.nvmfd.test:f",
            31,
            0,
        )
        .unwrap()
    }

    /// A controller that takes 50 ms to become ready (or to shut down), well within its
    /// CAP.TO of 1 s, is waited for: the host gave up after 1,000 reads of CSTS made back to
    /// back, a few milliseconds on a fast transport.
    #[test]
    fn enable_and_shutdown_wait_as_long_as_cap_to_allows() {
        let mut a = admin(2, Duration::from_millis(50));
        a.enable().unwrap();
        a.shutdown().unwrap();
        // One whose shutdown fails says so at once (CSTS.CFS), not after the time allowed.
        let mut a = admin(2, Duration::ZERO);
        a.enable().unwrap();
        a.transport().shutdown_fails = true;
        let t = std::time::Instant::now();
        assert!(
            matches!(a.shutdown(), Err(HostError::Protocol(_))),
            "CSTS.CFS"
        );
        assert!(t.elapsed() < Duration::from_secs(1));
        // One that never gets there is given up on, after CAP.TO (500 ms here).
        let mut a = admin(1, Duration::from_secs(3600));
        let t = std::time::Instant::now();
        assert!(matches!(a.enable(), Err(HostError::Timeout("CSTS.RDY"))));
        assert!(t.elapsed() >= Duration::from_millis(500));
    }
}
