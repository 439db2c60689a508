//! The ibverbs provider on a real device: in the VM lab on rxe0 (`scripts/lab-rdma.sh`), and
//! skipped, visibly, where there is no RDMA device (set `RDMA_IP` to the device's address).

#![cfg(feature = "ibverbs")]
// Sizes and counters in this file are small and known: casts cannot truncate.
#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use nvmfd_rdma::ibverbs::cm::{CmChannel, CmEvent, CmId};
use nvmfd_rdma::ibverbs::{self, Cq, Device, Mr, Pd, Srq};
use nvmfd_rdma::*;

const RW: Access = Access(Access::LOCAL_WRITE.0 | Access::REMOTE_WRITE.0 | Access::REMOTE_READ.0);
const CAPS: QpCaps = QpCaps {
    max_send_wr: 64,
    max_send_sge: 4,
    max_recv_wr: 0,
    max_inline_data: 64,
};

fn skip(why: &str) {
    use std::io::Write;
    eprintln!("SKIPPED ibverbs conformance: {why}");
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("skipped-tests.txt");
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        let _ = writeln!(f, "SKIPPED ibverbs conformance: {why}");
    }
}

fn wait<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::yield_now();
    }
}

struct Side {
    dev: Device,
    pd: Pd,
    cq: Cq,
    srq: Srq,
    mr: Mr,
}

fn side(dev: Device) -> Side {
    let pd = dev.alloc_pd().unwrap();
    let cq = dev.create_cq(256).unwrap();
    let srq = pd.create_srq(64, 4).unwrap();
    let mr = pd.alloc_mr(1 << 16, RW).unwrap();
    Side {
        dev,
        pd,
        cq,
        srq,
        mr,
    }
}

fn poll_one(cq: &Cq) -> Wc {
    wait("a completion", || {
        let mut w = [Wc::default(); 1];
        (cq.poll(&mut w).unwrap() == 1).then_some(w[0])
    })
}

fn send(wr_id: u64, sges: &[Sge], signaled: bool) -> SendWr<'_> {
    SendWr {
        wr_id,
        op: SendOp::Send,
        sges,
        signaled,
        inline: false,
    }
}

struct Conn {
    sch: CmChannel,
    cch: CmChannel,
    _listener: CmId,
    t: Side,
    h: Side,
    tid: CmId,
    hid: CmId,
}

fn connect(addr: SocketAddr) -> Conn {
    let sch = CmChannel::new().unwrap();
    let listener = sch.listen(addr, 16).unwrap();
    let t = side(listener.device().unwrap());
    let cch = CmChannel::new().unwrap();
    let mut hid = cch.resolve(addr, Duration::from_secs(3)).unwrap();
    let h = side(hid.device().unwrap());
    hid.create_qp(&h.pd, &h.cq, &h.srq, CAPS).unwrap();
    hid.connect(b"nvme-rdma private data").unwrap();
    let (mut tid, pd) = wait("CONNECT_REQUEST", || match sch.next_event() {
        Some(CmEvent::ConnectRequest {
            id, private_data, ..
        }) => Some((id, private_data)),
        Some(other) => panic!("{other:?}"),
        None => None,
    });
    assert_eq!(pd.get(..22), Some(&b"nvme-rdma private data"[..]));
    tid.create_qp(&t.pd, &t.cq, &t.srq, CAPS).unwrap();
    tid.accept(b"accepted").unwrap();
    let got = wait("ESTABLISHED on the connecting side", || {
        match cch.next_event() {
            Some(CmEvent::Established { private_data, .. }) => Some(private_data),
            Some(other) => panic!("{other:?}"),
            None => None,
        }
    });
    assert_eq!(got.get(..8), Some(&b"accepted"[..]));
    wait("ESTABLISHED on the accepting side", || {
        match sch.next_event() {
            Some(CmEvent::Established { .. }) => Some(()),
            Some(other) => panic!("{other:?}"),
            None => None,
        }
    });
    Conn {
        sch,
        cch,
        _listener: listener,
        t,
        h,
        tid,
        hid,
    }
}

#[test]
fn conformance_on_a_real_device() {
    let names = ibverbs::device_names();
    if names.is_empty() {
        return skip("no RDMA device on this machine (run scripts/lab-rdma.sh for rxe)");
    }
    let Ok(ip) = std::env::var("RDMA_IP") else {
        return skip("RDMA_IP is not set to the RDMA device's address");
    };
    let addr: SocketAddr = format!("{ip}:4791")
        .parse()
        .unwrap_or_else(|_| format!("{ip}:4420").parse().unwrap());
    let addr = SocketAddr::new(addr.ip(), 4420);
    println!("devices: {names:?}, address {addr}");
    let c = connect(addr);
    println!("ok: CM connect/accept with private data both ways");
    let attr = c.t.dev.attr().unwrap();
    println!("device: {attr:?}");

    // SEND into the SRQ, scattered over a command SGE and two data SGEs.
    let sg = [
        c.t.mr.sge(0, 64),
        c.t.mr.sge(4096, 4096),
        c.t.mr.sge(8192, 4096),
    ];
    c.t.srq
        .post_recv(&[RecvWr {
            wr_id: 7,
            sges: &sg,
        }])
        .unwrap();
    let data: Vec<u8> = (0..64 + 5000).map(|i| (i % 251) as u8).collect();
    c.h.mr.write(0, &data);
    c.hid
        .post_send(&[send(1, &[c.h.mr.sge(0, data.len() as u32)], true)])
        .unwrap();
    let wc = poll_one(&c.t.cq);
    assert_eq!(
        (wc.wr_id, wc.status, wc.byte_len),
        (7, WcStatus::Success, data.len() as u32)
    );
    let mut got = vec![0u8; 4096];
    c.t.mr.read(4096, &mut got);
    assert_eq!(got, data[64..64 + 4096]);
    assert_eq!(poll_one(&c.h.cq).status, WcStatus::Success);
    println!("ok: SEND into an SRQ over 3 SGEs");

    // RDMA WRITE then READ, only the last signaled.
    let msg = b"hello through RDMA WRITE".to_vec();
    c.t.mr.write(100, &msg);
    let wr = SendWr {
        wr_id: 2,
        op: SendOp::RdmaWrite {
            remote_addr: c.h.mr.addr() + 1000,
            rkey: c.h.mr.rkey(),
        },
        sges: &[c.t.mr.sge(100, msg.len() as u32)],
        signaled: false,
        inline: false,
    };
    let rd = SendWr {
        wr_id: 3,
        op: SendOp::RdmaRead {
            remote_addr: c.h.mr.addr() + 1000,
            rkey: c.h.mr.rkey(),
        },
        sges: &[c.t.mr.sge(30000, msg.len() as u32)],
        signaled: true,
        inline: false,
    };
    c.tid.post_send(&[wr, rd]).unwrap();
    let wc = poll_one(&c.t.cq);
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode),
        (3, WcStatus::Success, WcOpcode::RdmaRead)
    );
    let mut back = vec![0u8; msg.len()];
    c.t.mr.read(30000, &mut back);
    assert_eq!(back, msg);
    println!("ok: RDMA WRITE + READ chain, only the last signaled");

    // Inline up to the limit.
    c.t.srq
        .post_recv(&[RecvWr {
            wr_id: 8,
            sges: &[c.t.mr.sge(0, 128)],
        }])
        .unwrap();
    let small = [0x5au8; 64];
    let sge = Sge {
        addr: small.as_ptr() as u64,
        length: 64,
        lkey: 0,
    };
    c.hid
        .post_send(&[SendWr {
            wr_id: 4,
            op: SendOp::Send,
            sges: &[sge],
            signaled: true,
            inline: true,
        }])
        .unwrap();
    assert_eq!(poll_one(&c.t.cq).byte_len, 64);
    assert_eq!(poll_one(&c.h.cq).status, WcStatus::Success);
    println!("ok: inline SEND of 64 bytes");

    // SRQ limit: fires once, reads 0, fires again after re-arming.
    let bufs: Vec<[Sge; 1]> = (0..16).map(|i| [c.t.mr.sge(i * 64, 64)]).collect();
    let wrs: Vec<RecvWr<'_>> = bufs
        .iter()
        .enumerate()
        .map(|(i, s)| RecvWr {
            wr_id: 100 + i as u64,
            sges: s,
        })
        .collect();
    c.t.srq.post_recv(&wrs).unwrap();
    c.t.srq.arm_limit(8).unwrap();
    for i in 0..9 {
        c.hid
            .post_send(&[send(10 + i, &[c.h.mr.sge(0, 16)], true)])
            .unwrap();
        poll_one(&c.h.cq);
        poll_one(&c.t.cq);
    }
    // Port events arrive in the first second after rxe0 appears: they are not what we wait for.
    let ev = wait("SRQ_LIMIT_REACHED", || match c.t.dev.next_event() {
        Some(e @ AsyncEvent::SrqLimitReached(_)) => Some(e),
        Some(other) => {
            println!("(other async event: {other:?})");
            None
        }
        None => None,
    });
    assert_eq!(ev, AsyncEvent::SrqLimitReached(c.t.srq.id()));
    assert_eq!(c.t.srq.query().unwrap().srq_limit, 0);
    println!("ok: SRQ limit fired once and reads 0");

    // A bad rkey: remote access error, and the QP is in error after.
    let bad = SendWr {
        wr_id: 5,
        op: SendOp::RdmaWrite {
            remote_addr: c.h.mr.addr(),
            rkey: c.h.mr.rkey() ^ 0x100,
        },
        sges: &[c.t.mr.sge(0, 16)],
        signaled: true,
        inline: false,
    };
    c.tid.post_send(&[bad]).unwrap();
    let wc = poll_one(&c.t.cq);
    assert_eq!((wc.wr_id, wc.status), (5, WcStatus::RemAccessErr));
    println!("ok: bad rkey -> remote access error");

    // LAST_WQE after ERR: recorded, not required (rxe never sends it).
    c.tid.to_error().unwrap();
    let end = Instant::now() + Duration::from_millis(500);
    let mut last_wqe = false;
    while Instant::now() < end && !last_wqe {
        last_wqe = matches!(c.t.dev.next_event(), Some(AsyncEvent::QpLastWqeReached(_)));
    }
    println!(
        "recorded: LAST_WQE_REACHED after ERR on an SRQ QP: {}",
        if last_wqe { "yes" } else { "no (as rxe)" }
    );

    // Disconnect is seen on both sides; the passive side answers with its own disconnect
    // (rdma_cm sends the DREP then), as the daemon's teardown does.
    c.hid.disconnect().unwrap();
    wait("DISCONNECTED on the accepting side", || {
        match c.sch.next_event() {
            Some(CmEvent::Disconnected { .. }) => Some(()),
            _ => None,
        }
    });
    c.tid.disconnect().unwrap();
    wait("DISCONNECTED on the connecting side", || {
        match c.cch.next_event() {
            Some(CmEvent::Disconnected { .. }) => Some(()),
            _ => None,
        }
    });
    println!("ok: disconnect seen on both sides");
}
