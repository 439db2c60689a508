//! The provider conformance suite, on the soft provider. (The ibverbs provider joins it, with
//! the same tests, when it lands; where rxe differs, the differences are recorded here.)

// Sizes and counters in this file are small and known: casts cannot truncate.
#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

use std::net::SocketAddr;

use nvmfd_rdma::soft::cm::{CmChannel, CmEvent, CmId, Listener};
use nvmfd_rdma::soft::{Cq, Device, Fabric, Faults, Mr, Pd, Qp, Srq};
use nvmfd_rdma::*;

const CAPS: QpCaps = QpCaps {
    max_send_wr: 16,
    max_send_sge: 4,
    max_recv_wr: 0,
    max_inline_data: 64,
};
const RW: Access = Access(Access::LOCAL_WRITE.0 | Access::REMOTE_WRITE.0 | Access::REMOTE_READ.0);

/// One side: device, PD, one CQ, one SRQ, memory.
struct Side {
    dev: Device,
    pd: Pd,
    cq: Cq,
    srq: Srq,
    mr: Mr,
    cm: CmChannel,
}

fn side(f: &Fabric) -> Side {
    let dev = f.open_device().unwrap();
    let pd = dev.alloc_pd();
    let cq = dev.create_cq(256).unwrap();
    let srq = pd.create_srq(64, 4).unwrap();
    let mr = pd.alloc_mr(1 << 16, RW);
    let cm = f.cm_channel().unwrap();
    Side {
        dev,
        pd,
        cq,
        srq,
        mr,
        cm,
    }
}

/// Two sides with `n` connected QP pairs, all QPs of a side on its one SRQ and CQ.
struct World {
    fabric: Fabric,
    t: Side,
    h: Side,
    tq: Vec<Qp>,
    hq: Vec<Qp>,
    _ids: Vec<CmId>,
    _listener: Listener,
}

fn addr() -> SocketAddr {
    "127.0.0.1:4420".parse().unwrap()
}

fn world(n: usize) -> World {
    let fabric = Fabric::new();
    let t = side(&fabric);
    let h = side(&fabric);
    let listener = t.cm.listen(addr()).unwrap();
    let mut tq = Vec::new();
    let mut hq = Vec::new();
    let mut ids = Vec::new();
    for i in 0..n {
        let q = h.pd.create_qp(&h.cq, &h.cq, &h.srq, CAPS).unwrap();
        ids.push(h.cm.connect(addr(), &q, &[i as u8; 32]).unwrap());
        let Some(CmEvent::ConnectRequest { id, private_data }) = t.cm.next_event() else {
            panic!("no request")
        };
        assert_eq!(private_data, vec![i as u8; 32]);
        let tqp = t.pd.create_qp(&t.cq, &t.cq, &t.srq, CAPS).unwrap();
        id.accept(&tqp, b"accepted").unwrap();
        assert!(matches!(
            t.cm.next_event(),
            Some(CmEvent::Established { .. })
        ));
        match h.cm.next_event() {
            Some(CmEvent::Established { private_data, .. }) => {
                assert_eq!(private_data, b"accepted")
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(tqp.state(), QpState::Rts);
        ids.push(id);
        tq.push(tqp);
        hq.push(q);
    }
    World {
        fabric,
        t,
        h,
        tq,
        hq,
        _ids: ids,
        _listener: listener,
    }
}

fn poll_all(cq: &Cq) -> Vec<Wc> {
    let mut out = [Wc::default(); 64];
    let n = cq.poll(&mut out).unwrap();
    out[..n].to_vec()
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

fn readable(fd: i32) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, no timeout.
    unsafe { libc::poll(&mut p, 1, 0) == 1 }
}

#[test]
fn send_into_an_srq_scatters_over_several_sges() {
    let w = world(1);
    // The receive: a 64-byte "command" SGE, then two 4 KiB "data" SGEs.
    let sg = [
        w.t.mr.sge(0, 64),
        w.t.mr.sge(4096, 4096),
        w.t.mr.sge(8192, 4096),
    ];
    w.t.srq
        .post_recv(&[RecvWr {
            wr_id: 7,
            sges: &sg,
        }])
        .unwrap();
    let data: Vec<u8> = (0..64 + 5000).map(|i| (i % 251) as u8).collect();
    w.h.mr.write(0, &data);
    w.hq[0]
        .post_send(&[send(1, &[w.h.mr.sge(0, data.len() as u32)], true)])
        .unwrap();
    let wc = poll_all(&w.t.cq);
    assert_eq!(wc.len(), 1);
    assert_eq!(
        (
            wc[0].wr_id,
            wc[0].status,
            wc[0].opcode,
            wc[0].byte_len,
            wc[0].qp_num
        ),
        (
            7,
            WcStatus::Success,
            WcOpcode::Recv,
            data.len() as u32,
            w.tq[0].qpn()
        )
    );
    let mut got = vec![0u8; 64];
    w.t.mr.read(0, &mut got);
    assert_eq!(got, data[..64]);
    let mut got = vec![0u8; 4096];
    w.t.mr.read(4096, &mut got);
    assert_eq!(got, data[64..64 + 4096]);
    let mut got = vec![0u8; 5000 - 4096];
    w.t.mr.read(8192, &mut got);
    assert_eq!(got, data[64 + 4096..]);
    assert_eq!(poll_all(&w.h.cq)[0].status, WcStatus::Success);
}

#[test]
fn rdma_write_and_read_move_the_data() {
    let w = world(1);
    let data = b"hello through RDMA WRITE, back through RDMA READ".to_vec();
    w.t.mr.write(100, &data);
    let wr = SendWr {
        wr_id: 1,
        op: SendOp::RdmaWrite {
            remote_addr: w.h.mr.addr() + 1000,
            rkey: w.h.mr.rkey(),
        },
        sges: &[w.t.mr.sge(100, data.len() as u32)],
        signaled: true,
        inline: false,
    };
    w.tq[0].post_send(&[wr]).unwrap();
    let mut got = vec![0u8; data.len()];
    w.h.mr.read(1000, &mut got);
    assert_eq!(got, data);
    let rd = SendWr {
        wr_id: 2,
        op: SendOp::RdmaRead {
            remote_addr: w.h.mr.addr() + 1000,
            rkey: w.h.mr.rkey(),
        },
        sges: &[w.t.mr.sge(30000, data.len() as u32)],
        signaled: true,
        inline: false,
    };
    w.tq[0].post_send(&[rd]).unwrap();
    let wc = poll_all(&w.t.cq);
    assert_eq!(
        wc.iter()
            .map(|c| (c.wr_id, c.status, c.opcode))
            .collect::<Vec<_>>(),
        [
            (1, WcStatus::Success, WcOpcode::RdmaWrite),
            (2, WcStatus::Success, WcOpcode::RdmaRead)
        ]
    );
    w.t.mr.read(30000, &mut got);
    assert_eq!(got, data);
}

#[test]
fn a_bad_rkey_or_an_out_of_bounds_access_is_a_remote_access_error_and_the_qp_fails() {
    for (addr_off, key_xor, len) in [(0u64, 1u32, 16u32), (65536 - 8, 0, 16)] {
        let w = world(1);
        let wr = SendWr {
            wr_id: 9,
            op: SendOp::RdmaWrite {
                remote_addr: w.h.mr.addr() + addr_off,
                rkey: w.h.mr.rkey() ^ key_xor,
            },
            sges: &[w.t.mr.sge(0, len)],
            signaled: true,
            inline: false,
        };
        w.tq[0].post_send(&[wr]).unwrap();
        let wc = poll_all(&w.t.cq);
        assert_eq!((wc[0].wr_id, wc[0].status), (9, WcStatus::RemAccessErr));
        assert_eq!(w.tq[0].state(), QpState::Err);
        // Later work requests are flushed.
        w.tq[0]
            .post_send(&[send(10, &[w.t.mr.sge(0, 8)], false)])
            .unwrap();
        let wc = poll_all(&w.t.cq);
        assert_eq!(
            (wc[0].wr_id, wc[0].status),
            (10, WcStatus::WrFlushErr),
            "flushed even when unsignaled"
        );
    }
}

#[test]
fn a_bad_lkey_is_a_local_protection_error() {
    let w = world(1);
    let bad = Sge {
        lkey: w.t.mr.lkey() ^ 1,
        ..w.t.mr.sge(0, 8)
    };
    w.t.srq
        .post_recv(&[RecvWr {
            wr_id: 1,
            sges: &[w.t.mr.sge(0, 64)],
        }])
        .unwrap();
    w.hq[0].post_send(&[send(3, &[bad], true)]).unwrap();
    assert_eq!(poll_all(&w.h.cq)[0].status, WcStatus::LocProtErr);
}

#[test]
fn inline_sends_up_to_the_limit_and_not_one_byte_more() {
    let w = world(1);
    w.t.srq
        .post_recv(&[RecvWr {
            wr_id: 1,
            sges: &[w.t.mr.sge(0, 128)],
        }])
        .unwrap();
    let msg = [0x5au8; 64];
    let sge = Sge {
        addr: msg.as_ptr() as u64,
        length: 64,
        lkey: 0,
    };
    w.hq[0]
        .post_send(&[SendWr {
            wr_id: 1,
            op: SendOp::Send,
            sges: &[sge],
            signaled: true,
            inline: true,
        }])
        .unwrap();
    assert_eq!(poll_all(&w.t.cq)[0].byte_len, 64);
    let big = [0u8; 65];
    let sge = Sge {
        addr: big.as_ptr() as u64,
        length: 65,
        lkey: 0,
    };
    let e = w.hq[0]
        .post_send(&[SendWr {
            wr_id: 2,
            op: SendOp::Send,
            sges: &[sge],
            signaled: true,
            inline: true,
        }])
        .unwrap_err();
    assert_eq!(e.errno(), Some(libc::EINVAL));
}

#[test]
fn unsignaled_requests_complete_with_the_next_signaled_one_and_hold_sq_slots() {
    let w = world(1);
    let sge = [w.t.mr.sge(0, 8)];
    let write = |id, signaled| SendWr {
        wr_id: id,
        op: SendOp::RdmaWrite {
            remote_addr: w.h.mr.addr(),
            rkey: w.h.mr.rkey(),
        },
        sges: &sge,
        signaled,
        inline: false,
    };
    // A chain: two unsignaled WRITEs and a signaled one: one completion.
    w.tq[0]
        .post_send(&[write(1, false), write(2, false), write(3, true)])
        .unwrap();
    let wc = poll_all(&w.t.cq);
    assert_eq!(wc.iter().map(|c| c.wr_id).collect::<Vec<_>>(), [3]);
    // Unsignaled WRs never retired fill the SQ (16 deep): the 17th post is refused.
    for i in 0..16 {
        w.tq[0].post_send(&[write(100 + i, false)]).unwrap();
    }
    let e = w.tq[0].post_send(&[write(200, false)]).unwrap_err();
    assert_eq!(e.errno(), Some(libc::ENOMEM));
}

#[test]
fn the_srq_limit_fires_once_reads_zero_and_fires_again_after_rearming() {
    let w = world(1);
    let recvs: Vec<[Sge; 1]> = (0..16).map(|i| [w.t.mr.sge(i * 64, 64)]).collect();
    let wrs: Vec<RecvWr<'_>> = recvs
        .iter()
        .enumerate()
        .map(|(i, s)| RecvWr {
            wr_id: i as u64,
            sges: s,
        })
        .collect();
    w.t.srq.post_recv(&wrs).unwrap();
    w.t.srq.arm_limit(8).unwrap();
    assert_eq!(w.t.srq.query().unwrap().srq_limit, 8);
    let sge = [w.h.mr.sge(0, 16)];
    let mut fired_after = None;
    for i in 0..12 {
        w.hq[0].post_send(&[send(i, &sge, false)]).unwrap();
        if let Some(e) = w.t.dev.next_event() {
            assert_eq!(e, AsyncEvent::SrqLimitReached(w.t.srq.id()));
            assert!(fired_after.is_none(), "fired twice for one arming");
            fired_after = Some(i + 1);
        }
    }
    assert_eq!(
        fired_after,
        Some(9),
        "when 7 of 16 remain, below the limit of 8"
    );
    assert_eq!(
        w.t.srq.query().unwrap().srq_limit,
        0,
        "one-shot: reads 0 until re-armed"
    );
    w.t.srq.post_recv(&wrs).unwrap();
    w.t.srq.arm_limit(20).unwrap(); // 4 left + 16 posted = 20: the next receive consumed fires it
    w.hq[0].post_send(&[send(99, &sge, true)]).unwrap();
    assert_eq!(
        w.t.dev.next_event(),
        Some(AsyncEvent::SrqLimitReached(w.t.srq.id()))
    );
}

#[test]
fn rnr_waits_for_a_receive_with_rnr_retry_7_and_fails_the_qp_otherwise() {
    let w = world(1);
    let sge = [w.h.mr.sge(0, 32)];
    w.hq[0].post_send(&[send(1, &sge, true)]).unwrap();
    assert!(
        poll_all(&w.h.cq).is_empty(),
        "the SEND waits: no receive posted"
    );
    w.t.srq
        .post_recv(&[RecvWr {
            wr_id: 5,
            sges: &[w.t.mr.sge(0, 64)],
        }])
        .unwrap();
    assert_eq!(poll_all(&w.t.cq)[0].wr_id, 5);
    assert_eq!(poll_all(&w.h.cq)[0].status, WcStatus::Success);
    w.hq[0].set_rnr_retry(3);
    w.hq[0].post_send(&[send(2, &sge, true)]).unwrap();
    assert_eq!(poll_all(&w.h.cq)[0].status, WcStatus::RnrRetryExcErr);
    assert_eq!(w.hq[0].state(), QpState::Err);
}

#[test]
fn a_qp_moved_to_error_flushes_then_reports_last_wqe_reached() {
    let w = world(1);
    let sge = [w.h.mr.sge(0, 32)];
    // Two SENDs wait for receives at the target (RNR, retried forever).
    w.hq[0]
        .post_send(&[send(1, &sge, true), send(2, &sge, false)])
        .unwrap();
    w.hq[0].to_error();
    let wc = poll_all(&w.h.cq);
    assert_eq!(
        wc.iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(),
        [(1, WcStatus::WrFlushErr), (2, WcStatus::WrFlushErr)]
    );
    assert_eq!(
        w.h.dev.next_event(),
        Some(AsyncEvent::QpLastWqeReached(w.hq[0].qpn()))
    );
    assert!(
        !readable(w.h.dev.async_fd()),
        "the async fd is drained with its queue"
    );
}

#[test]
fn last_wqe_can_be_suppressed_as_on_rxe() {
    let w = world(1);
    w.fabric.set_faults(Faults {
        suppress_last_wqe: true,
    });
    w.tq[0].to_error();
    assert_eq!(w.t.dev.next_event(), None);
}

#[test]
fn cm_reject_carries_private_data_and_nobody_listening_is_a_reject() {
    let f = Fabric::new();
    let t = side(&f);
    let h = side(&f);
    let _l = t.cm.listen(addr()).unwrap();
    assert_eq!(
        t.cm.listen(addr()).unwrap_err().errno(),
        Some(libc::EADDRINUSE)
    );
    let q = h.pd.create_qp(&h.cq, &h.cq, &h.srq, CAPS).unwrap();
    let cid = h.cm.connect(addr(), &q, b"hello").unwrap();
    assert!(readable(t.cm.fd()));
    let Some(CmEvent::ConnectRequest { id, .. }) = t.cm.next_event() else {
        panic!()
    };
    id.reject(&[0, 0, 3, 0]).unwrap();
    match h.cm.next_event() {
        Some(CmEvent::Rejected { id, private_data }) => {
            assert_eq!(id, cid.id());
            assert_eq!(private_data, [0, 0, 3, 0]);
        }
        other => panic!("{other:?}"),
    }
    let _c2 =
        h.cm.connect("127.0.0.1:9".parse().unwrap(), &q, b"")
            .unwrap();
    assert!(matches!(h.cm.next_event(), Some(CmEvent::Rejected { .. })));
}

#[test]
fn disconnect_is_seen_on_both_sides_and_flushes() {
    let w = world(1);
    let sge = [w.h.mr.sge(0, 32)];
    w.hq[0].post_send(&[send(1, &sge, true)]).unwrap();
    w._ids[0].disconnect().unwrap();
    for cm in [&w.h.cm, &w.t.cm] {
        assert!(matches!(
            cm.next_event(),
            Some(CmEvent::Disconnected { .. })
        ));
        assert!(matches!(
            cm.next_event(),
            Some(CmEvent::TimewaitExit { .. })
        ));
    }
    assert_eq!(w.hq[0].state(), QpState::Err);
    assert_eq!(w.tq[0].state(), QpState::Err);
    assert_eq!(poll_all(&w.h.cq)[0].status, WcStatus::WrFlushErr);
}

#[test]
fn many_qps_share_one_srq_and_one_cq() {
    let w = world(16);
    let bufs: Vec<[Sge; 1]> = (0..32).map(|i| [w.t.mr.sge(i * 128, 128)]).collect();
    let wrs: Vec<RecvWr<'_>> = bufs
        .iter()
        .enumerate()
        .map(|(i, s)| RecvWr {
            wr_id: i as u64,
            sges: s,
        })
        .collect();
    w.t.srq.post_recv(&wrs).unwrap();
    for (i, q) in w.hq.iter().enumerate() {
        w.h.mr.write(i * 16, &[i as u8; 16]);
        q.post_send(&[send(i as u64, &[w.h.mr.sge(i * 16, 16)], true)])
            .unwrap();
    }
    let wc = poll_all(&w.t.cq);
    assert_eq!(wc.len(), 16);
    let mut qpns: Vec<u32> = wc.iter().map(|c| c.qp_num).collect();
    qpns.sort_unstable();
    let mut want: Vec<u32> = w.tq.iter().map(Qp::qpn).collect();
    want.sort_unstable();
    assert_eq!(qpns, want, "one completion per QP, each naming its QP");
    assert_eq!(w.t.srq.posted(), 16);
}

#[test]
fn send_with_invalidate_invalidates_the_peer_key() {
    let w = world(1);
    let host_buf = w.h.pd.alloc_mr(4096, RW);
    w.h.srq
        .post_recv(&[RecvWr {
            wr_id: 4,
            sges: &[w.h.mr.sge(0, 64)],
        }])
        .unwrap();
    let wr = SendWr {
        wr_id: 1,
        op: SendOp::SendWithInvalidate {
            rkey: host_buf.rkey(),
        },
        sges: &[w.t.mr.sge(0, 16)],
        signaled: true,
        inline: false,
    };
    w.tq[0].post_send(&[wr]).unwrap();
    let wc = poll_all(&w.h.cq);
    assert_eq!(wc[0].invalidated_rkey, Some(host_buf.rkey()));
    assert!(!host_buf.is_valid());
    let wr = SendWr {
        wr_id: 2,
        op: SendOp::RdmaWrite {
            remote_addr: host_buf.addr(),
            rkey: host_buf.rkey(),
        },
        sges: &[w.t.mr.sge(0, 16)],
        signaled: true,
        inline: false,
    };
    w.tq[0].post_send(&[wr]).unwrap();
    let wc = poll_all(&w.t.cq);
    assert_eq!(
        wc.last().unwrap().status,
        WcStatus::RemAccessErr,
        "an invalidated key no longer works"
    );
}

#[test]
fn a_cq_overflow_is_reported_as_on_hardware() {
    let f = Fabric::new();
    let s = side(&f);
    let h = side(&f);
    let small = s.dev.create_cq(2).unwrap();
    let q = s.pd.create_qp(&small, &small, &s.srq, CAPS).unwrap();
    let _l = h.cm.listen(addr()).unwrap();
    let _c = s.cm.connect(addr(), &q, b"").unwrap();
    let Some(CmEvent::ConnectRequest { id, .. }) = h.cm.next_event() else {
        panic!()
    };
    let hq = h.pd.create_qp(&h.cq, &h.cq, &h.srq, CAPS).unwrap();
    id.accept(&hq, b"").unwrap();
    let sge = [s.mr.sge(0, 8)];
    let write = |i| SendWr {
        wr_id: i,
        op: SendOp::RdmaWrite {
            remote_addr: h.mr.addr(),
            rkey: h.mr.rkey(),
        },
        sges: &sge,
        signaled: true,
        inline: false,
    };
    q.post_send(&[write(1), write(2), write(3)]).unwrap();
    assert!(readable(s.dev.async_fd()));
    assert_eq!(s.dev.next_event(), Some(AsyncEvent::CqErr(small.id())));
    let mut out = [Wc::default(); 4];
    assert_eq!(
        small.poll(&mut out).unwrap_err().errno(),
        Some(libc::EOVERFLOW)
    );
}

#[test]
fn objects_check_their_limits_and_protection_domains() {
    let f = Fabric::new();
    let s = side(&f);
    assert!(s.dev.create_cq(0).is_err());
    assert!(s.pd.create_srq(0, 1).is_err());
    assert!(
        s.pd.create_srq(16, 28).is_err(),
        "max_srq_sge is 27, as on rxe"
    );
    let other_pd = s.dev.alloc_pd();
    assert!(
        other_pd.create_qp(&s.cq, &s.cq, &s.srq, CAPS).is_err(),
        "SRQ of another PD"
    );
    let too_many = [s.mr.sge(0, 1); 5];
    assert_eq!(
        s.srq
            .post_recv(&[RecvWr {
                wr_id: 0,
                sges: &too_many
            }])
            .unwrap_err()
            .errno(),
        Some(libc::EINVAL)
    );
    let one = [s.mr.sge(0, 1)];
    let wrs: Vec<RecvWr<'_>> = (0..65)
        .map(|i| RecvWr {
            wr_id: i,
            sges: &one,
        })
        .collect();
    assert_eq!(
        s.srq.post_recv(&wrs).unwrap_err().errno(),
        Some(libc::ENOMEM),
        "more than max_wr"
    );
    let q = s.pd.create_qp(&s.cq, &s.cq, &s.srq, CAPS).unwrap();
    assert_eq!(q.state(), QpState::Reset);
    assert_eq!(
        q.post_send(&[send(1, &one, true)]).unwrap_err().errno(),
        Some(libc::EINVAL),
        "not connected"
    );
}
