//! The provider conformance suite: the same tests on the soft provider (every run) and on the
//! ibverbs provider (where there is an RDMA device and `RDMA_IP` names its address: rxe0 in the
//! VM lab, `scripts/lab-rdma.sh`; elsewhere those tests say they are skipped).
//!
//! Where the providers differ, the test asserts what the provider says of itself: rxe never
//! sends `LAST_WQE_REACHED`, and says so (`sends_last_wqe`). Tests of soft-only knobs (RNR retry counts below 7, CQ overflow, SQ
//! accounting, fault injection) are in the `soft_only` module.

// Sizes and counters in this file are small and known: casts cannot truncate.
#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use nvmfd_rdma::*;

/// Every right.
const RW: Access = Access::all();
const CAPS: QpCaps = QpCaps {
    max_send_wr: 64,
    max_send_sge: 4,
    max_recv_wr: 0,
    max_inline_data: 64,
};

fn skip(why: &str) {
    use std::io::Write;
    let test = std::thread::current().name().unwrap_or("a test").to_owned();
    let line = format!("SKIPPED {test}: {why}\n");
    eprint!("{line}");
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("skipped-tests.txt");
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        // One write per line: tests run in parallel and append to the same file.
        let _ = f.write_all(line.as_bytes());
    }
}

/// Waits (bounded) for `f` to return `Some`.
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

fn send(wr_id: u64, sges: &[Sge], signaled: bool) -> SendWr<'_> {
    SendWr {
        wr_id,
        op: SendOp::Send,
        sges,
        signaled,
        inline: None,
    }
}

macro_rules! suite {
    ($module:ident, $provider:ident, $env:path) => {
        mod $module {
            use super::*;
            use nvmfd_rdma::$provider::cm::{CmChannel, CmEvent, CmId};
            use nvmfd_rdma::$provider::{Cq, Device, Mr, Pd, Srq};

            pub(crate) struct Side {
                pub dev: Device,
                pub pd: Pd,
                pub cq: Cq,
                pub srq: Srq,
                pub mr: Mr,
            }

            pub(crate) fn side(dev: Device) -> Side {
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

            /// `n` connections between a target side and a host side, all QPs of a side on its
            /// one SRQ and CQ.
            pub(crate) struct World {
                pub env: $env,
                pub sch: CmChannel,
                pub cch: CmChannel,
                pub t: Side,
                pub h: Side,
                pub tid: Vec<CmId>,
                pub hid: Vec<CmId>,
                pub _listener: CmId,
            }

            pub(crate) fn world(port: u16, n: usize) -> Option<World> {
                let env = <$env>::new()?;
                let addr = env.addr(port);
                let sch = env.channel();
                let listener = sch.listen(addr, 64).unwrap();
                let t = side(listener.device().unwrap());
                let cch = env.channel();
                let mut h: Option<Side> = None;
                let (mut tid, mut hid) = (Vec::new(), Vec::new());
                for i in 0..n {
                    let mut c = cch.resolve(addr, Duration::from_secs(3)).unwrap();
                    let hs = h.get_or_insert_with(|| side(c.device().unwrap()));
                    c.create_qp(&hs.pd, &hs.cq, &hs.srq, CAPS).unwrap();
                    c.connect(&[i as u8; 32]).unwrap();
                    let (mut s, pd) = wait("CONNECT_REQUEST", || match sch.next_event() {
                        Some(CmEvent::ConnectRequest {
                            id, private_data, ..
                        }) => Some((id, private_data)),
                        Some(other) => panic!("{other:?}"),
                        None => None,
                    });
                    assert_eq!(
                        pd.get(..32),
                        Some(&[i as u8; 32][..]),
                        "private data of the request"
                    );
                    s.create_qp(&t.pd, &t.cq, &t.srq, CAPS).unwrap();
                    s.accept(b"accepted").unwrap();
                    let got = wait("ESTABLISHED (connecting side)", || match cch.next_event() {
                        Some(CmEvent::Established { private_data, .. }) => Some(private_data),
                        Some(other) => panic!("{other:?}"),
                        None => None,
                    });
                    assert_eq!(
                        got.get(..8),
                        Some(&b"accepted"[..]),
                        "private data of the accept"
                    );
                    wait("ESTABLISHED (accepting side)", || match sch.next_event() {
                        Some(CmEvent::Established { .. }) => Some(()),
                        Some(other) => panic!("{other:?}"),
                        None => None,
                    });
                    assert_eq!(s.qp_state(), Some(QpState::Rts));
                    tid.push(s);
                    hid.push(c);
                }
                Some(World {
                    env,
                    sch,
                    cch,
                    t,
                    h: h.expect("n >= 1"),
                    tid,
                    hid,
                    _listener: listener,
                })
            }

            pub(crate) fn poll_one(cq: &Cq) -> Wc {
                wait("a completion", || {
                    let mut w = [Wc::default(); 1];
                    (cq.poll(&mut w).unwrap() == 1).then_some(w[0])
                })
            }

            fn poll_none(cq: &Cq) {
                let mut w = [Wc::default(); 4];
                assert_eq!(
                    cq.poll(&mut w).unwrap(),
                    0,
                    "an unexpected completion: {:?}",
                    w[0]
                );
            }

            #[test]
            fn send_into_an_srq_scatters_over_several_sges() {
                let Some(w) = world(4420, 1) else { return };
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
                w.hid[0]
                    .post_send(&[send(1, &[w.h.mr.sge(0, data.len() as u32)], true)])
                    .unwrap();
                let wc = poll_one(&w.t.cq);
                assert_eq!(
                    (wc.wr_id, wc.status, wc.opcode, wc.byte_len),
                    (7, WcStatus::Success, WcOpcode::Recv, data.len() as u32)
                );
                assert_eq!(Some(wc.qp_num), w.tid[0].qpn());
                for (off, range) in [
                    (0, 0..64),
                    (4096, 64..64 + 4096),
                    (8192, 64 + 4096..data.len()),
                ] {
                    let mut got = vec![0u8; range.len()];
                    w.t.mr.read(off, &mut got);
                    assert_eq!(got, data[range]);
                }
                assert_eq!(poll_one(&w.h.cq).status, WcStatus::Success);
            }

            #[test]
            fn rdma_write_and_read_move_the_data_and_only_the_signaled_completes() {
                let Some(w) = world(4421, 1) else { return };
                let msg = b"hello through RDMA WRITE, back through RDMA READ".to_vec();
                w.t.mr.write(100, &msg);
                let wr = SendWr {
                    wr_id: 1,
                    op: SendOp::RdmaWrite {
                        remote_addr: w.h.mr.addr() + 1000,
                        rkey: w.h.mr.rkey(),
                    },
                    sges: &[w.t.mr.sge(100, msg.len() as u32)],
                    signaled: false,
                    inline: None,
                };
                let wr2 = SendWr { wr_id: 2, ..wr };
                let rd = SendWr {
                    wr_id: 3,
                    op: SendOp::RdmaRead {
                        remote_addr: w.h.mr.addr() + 1000,
                        rkey: w.h.mr.rkey(),
                    },
                    sges: &[w.t.mr.sge(30000, msg.len() as u32)],
                    signaled: true,
                    inline: None,
                };
                w.tid[0].post_send(&[wr, wr2, rd]).unwrap();
                let wc = poll_one(&w.t.cq);
                assert_eq!(
                    (wc.wr_id, wc.status, wc.opcode),
                    (3, WcStatus::Success, WcOpcode::RdmaRead)
                );
                poll_none(&w.t.cq);
                let mut back = vec![0u8; msg.len()];
                w.t.mr.read(30000, &mut back);
                assert_eq!(back, msg);
                w.h.mr.read(1000, &mut back);
                assert_eq!(back, msg);
            }

            #[test]
            fn a_chain_of_the_longest_length_posts_and_a_longer_one_is_refused() {
                let Some(w) = world(4433, 1) else { return };
                w.t.mr.write(0, &[7u8; 64]);
                let sge = [w.t.mr.sge(0, 64)];
                let write = |k: usize, signaled: bool| SendWr {
                    wr_id: k as u64,
                    op: SendOp::RdmaWrite {
                        remote_addr: w.h.mr.addr() + 64 * k as u64,
                        rkey: w.h.mr.rkey(),
                    },
                    sges: &sge,
                    signaled,
                    inline: None,
                };
                let n = nvmfd_rdma::MAX_SEND_CHAIN;
                let chain: Vec<SendWr<'_>> = (0..=n).map(|k| write(k, k + 1 >= n)).collect();
                let e = w.tid[0].post_send(&chain).unwrap_err();
                assert_eq!(e.errno(), Some(libc::EINVAL), "{e}");
                w.tid[0].post_send(&chain[..n]).unwrap();
                let wc = poll_one(&w.t.cq);
                assert_eq!((wc.wr_id, wc.status), (n as u64 - 1, WcStatus::Success));
                let mut got = vec![0u8; 64 * n];
                w.h.mr.read(0, &mut got);
                assert!(got.iter().all(|&b| b == 7), "all {n} WRITEs landed");
            }

            #[test]
            fn a_bad_rkey_or_an_out_of_bounds_access_is_a_remote_access_error() {
                for (port, addr_off, key_xor) in
                    [(4422u16, 0u64, 0x100u32), (4423, (1 << 16) - 8, 0)]
                {
                    let Some(w) = world(port, 1) else { return };
                    let wr = SendWr {
                        wr_id: 9,
                        op: SendOp::RdmaWrite {
                            remote_addr: w.h.mr.addr() + addr_off,
                            rkey: w.h.mr.rkey() ^ key_xor,
                        },
                        sges: &[w.t.mr.sge(0, 16)],
                        signaled: true,
                        inline: None,
                    };
                    w.tid[0].post_send(&[wr]).unwrap();
                    let wc = poll_one(&w.t.cq);
                    assert_eq!((wc.wr_id, wc.status), (9, WcStatus::RemAccessErr));
                    assert_eq!(w.tid[0].qp_state(), Some(QpState::Err));
                    // Work posted after the error is flushed, signaled or not.
                    w.tid[0]
                        .post_send(&[send(10, &[w.t.mr.sge(0, 8)], false)])
                        .unwrap();
                    assert_eq!(poll_one(&w.t.cq).status, WcStatus::WrFlushErr);
                }
            }

            #[test]
            fn inline_sends_up_to_the_limit_and_not_one_byte_more() {
                let Some(w) = world(4424, 1) else { return };
                let limit = w.hid[0].max_inline().unwrap() as usize;
                assert!(limit >= 64, "asked for 64, got {limit}");
                w.t.srq
                    .post_recv(&[RecvWr {
                        wr_id: 1,
                        sges: &[w.t.mr.sge(0, 4096)],
                    }])
                    .unwrap();
                let msg = vec![0x5au8; limit];
                w.hid[0]
                    .post_send(&[SendWr {
                        wr_id: 1,
                        op: SendOp::Send,
                        sges: &[],
                        signaled: true,
                        inline: Some(&msg),
                    }])
                    .unwrap();
                assert_eq!(poll_one(&w.t.cq).byte_len, limit as u32);
                assert_eq!(poll_one(&w.h.cq).status, WcStatus::Success);
                let big = vec![0u8; limit + 1];
                let e = w.hid[0]
                    .post_send(&[SendWr {
                        wr_id: 2,
                        op: SendOp::Send,
                        sges: &[],
                        signaled: true,
                        inline: Some(&big),
                    }])
                    .unwrap_err();
                assert!(
                    matches!(e.errno(), Some(libc::EINVAL) | Some(libc::ENOMEM)),
                    "{e}"
                );
            }

            #[test]
            fn the_srq_limit_fires_once_reads_zero_and_fires_again_after_rearming() {
                let Some(w) = world(4425, 1) else { return };
                let bufs: Vec<[Sge; 1]> = (0..16).map(|i| [w.t.mr.sge(i * 64, 64)]).collect();
                let wrs: Vec<RecvWr<'_>> = bufs
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
                let srq_event = || match w.t.dev.next_event() {
                    Some(e @ AsyncEvent::SrqLimitReached(_)) => Some(e),
                    _ => None, // rxe reports port events in its first second: not ours
                };
                let sge = [w.h.mr.sge(0, 16)];
                for i in 0..9 {
                    w.hid[0].post_send(&[send(i, &sge, true)]).unwrap();
                    poll_one(&w.h.cq);
                    poll_one(&w.t.cq);
                }
                assert_eq!(
                    wait("SRQ_LIMIT_REACHED", srq_event),
                    AsyncEvent::SrqLimitReached(w.t.srq.id())
                );
                assert_eq!(
                    w.t.srq.query().unwrap().srq_limit,
                    0,
                    "one-shot: reads 0 until re-armed"
                );
                w.hid[0].post_send(&[send(20, &sge, true)]).unwrap();
                poll_one(&w.h.cq);
                poll_one(&w.t.cq);
                assert_eq!(srq_event(), None, "fired twice for one arming");
                w.t.srq.post_recv(&wrs).unwrap(); // 6 left + 16 = 22
                w.t.srq.arm_limit(22).unwrap();
                w.hid[0].post_send(&[send(21, &sge, true)]).unwrap();
                poll_one(&w.h.cq);
                poll_one(&w.t.cq);
                assert_eq!(
                    wait("SRQ_LIMIT_REACHED after re-arming", srq_event),
                    AsyncEvent::SrqLimitReached(w.t.srq.id())
                );
            }

            #[test]
            fn rnr_waits_for_a_receive_and_recovers_when_one_is_posted() {
                let Some(w) = world(4426, 1) else { return };
                let sge = [w.h.mr.sge(0, 32)];
                w.hid[0].post_send(&[send(1, &sge, true)]).unwrap();
                poll_none(&w.h.cq);
                w.t.srq
                    .post_recv(&[RecvWr {
                        wr_id: 5,
                        sges: &[w.t.mr.sge(0, 64)],
                    }])
                    .unwrap();
                assert_eq!(poll_one(&w.t.cq).wr_id, 5);
                assert_eq!(
                    poll_one(&w.h.cq).status,
                    WcStatus::Success,
                    "retried until the receive came (rnr_retry 7)"
                );
            }

            /// LAST_WQE_REACHED arrives exactly where the device says it sends it
            /// (`sends_last_wqe`: soft unless suppressed; never on rxe, iWARP or siw).
            #[test]
            fn a_qp_moved_to_error_flushes_its_work_and_last_wqe_is_as_the_device_says() {
                let Some(w) = world(4427, 1) else { return };
                let sge = [w.h.mr.sge(0, 32)];
                // A SEND waits for a receive at the target (RNR, retried forever).
                w.hid[0].post_send(&[send(1, &sge, true)]).unwrap();
                w.hid[0].to_error().unwrap();
                let wc = poll_one(&w.h.cq);
                assert_eq!((wc.wr_id, wc.status), (1, WcStatus::WrFlushErr));
                let qpn = w.hid[0].qpn().unwrap();
                let last_wqe = || match w.h.dev.next_event() {
                    Some(AsyncEvent::QpLastWqeReached(q)) => Some(q),
                    _ => None, // rxe reports port events in its first second: not ours
                };
                let sends = w.h.dev.sends_last_wqe();
                println!(
                    "{}: the device says it sends LAST_WQE_REACHED: {sends}",
                    stringify!($provider)
                );
                if sends {
                    assert_eq!(wait("LAST_WQE_REACHED", last_wqe), qpn);
                } else {
                    // Nothing to wait for: watch long enough for a device that would send it
                    // (soft sends it at once, rxe's async events come within milliseconds).
                    let end = Instant::now() + Duration::from_millis(500);
                    while Instant::now() < end {
                        assert_eq!(
                            last_wqe(),
                            None,
                            "LAST_WQE_REACHED from a device that says it never sends it"
                        );
                        std::thread::yield_now();
                    }
                }
            }

            /// A chain the provider refuses part-way: the requests before the refused one are
            /// posted and complete, it and those after it are not, and the error says where
            /// the chain stopped (`bad_wr` on ibverbs).
            #[test]
            fn a_chain_refused_part_way_posts_exactly_the_requests_before_the_refused_one() {
                let Some(w) = world(4435, 1) else { return };
                let limit = w.tid[0].max_inline().unwrap() as usize;
                let big = vec![9u8; limit + 1];
                let max_sge = w.t.dev.attr().unwrap().max_sge as usize;
                let too_many: Vec<Sge> = (0..=max_sge).map(|_| w.t.mr.sge(0, 1)).collect();
                w.t.mr.write(0, &[7u8; 64]);
                let sge = [w.t.mr.sge(0, 64)];
                let write = |k: u64, signaled: bool, sges| SendWr {
                    wr_id: k,
                    op: SendOp::RdmaWrite {
                        remote_addr: w.h.mr.addr() + 64 * k,
                        rkey: w.h.mr.rkey(),
                    },
                    sges,
                    signaled,
                    inline: None,
                };
                // Inline data one byte over the QP's limit, third of four.
                let chain = [
                    write(0, false, &sge[..]),
                    write(1, true, &sge[..]),
                    SendWr {
                        inline: Some(&big),
                        ..write(2, true, &[])
                    },
                    write(3, true, &sge[..]),
                ];
                let e = w.tid[0].post_send(&chain).unwrap_err();
                assert_eq!(e.posted(), 2, "{e}");
                assert_eq!(e.errno(), Some(libc::EINVAL), "{e}");
                // More SGEs than the device has, second of three.
                let chain = [
                    write(4, true, &sge[..]),
                    write(5, true, &too_many[..]),
                    write(6, true, &sge[..]),
                ];
                let e = w.tid[0].post_send(&chain).unwrap_err();
                assert_eq!(e.posted(), 1, "{e}");
                assert_eq!(e.errno(), Some(libc::EINVAL), "{e}");
                assert_eq!(w.tid[0].qp_state(), Some(QpState::Rts), "a refusal is no error");
                // RC completes a QP's sends in order: once this one has, every request posted
                // before it has too.
                w.tid[0].post_send(&[write(7, true, &sge[..])]).unwrap();
                let mut done = Vec::new();
                while done.last() != Some(&7) {
                    let wc = poll_one(&w.t.cq);
                    assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
                    done.push(wc.wr_id);
                }
                assert_eq!(done, [1, 4, 7], "the signaled requests that were posted");
                poll_none(&w.t.cq);
                for k in 0..8u64 {
                    let mut got = [0u8; 64];
                    w.h.mr.read(64 * k as usize, &mut got);
                    let posted = matches!(k, 0 | 1 | 4 | 7);
                    assert_eq!(got, [if posted { 7 } else { 0 }; 64], "WRITE {k}");
                }
            }

            /// Receives too: the provider stops at the first one it refuses.
            #[test]
            fn receives_refused_part_way_post_exactly_the_ones_before_the_refused_one() {
                let Some(w) = world(4436, 1) else { return };
                let max_sge = w.t.dev.attr().unwrap().max_srq_sge as usize;
                let too_many: Vec<Sge> = (0..=max_sge).map(|_| w.t.mr.sge(0, 1)).collect();
                let wrs = [
                    RecvWr {
                        wr_id: 0,
                        sges: &[w.t.mr.sge(0, 64)],
                    },
                    RecvWr {
                        wr_id: 1,
                        sges: &too_many,
                    },
                    RecvWr {
                        wr_id: 2,
                        sges: &[w.t.mr.sge(128, 64)],
                    },
                ];
                let e = w.t.srq.post_recv(&wrs).unwrap_err();
                assert_eq!((e.posted(), e.errno()), (1, Some(libc::EINVAL)), "{e}");
                w.t.srq
                    .post_recv(&[RecvWr {
                        wr_id: 99,
                        sges: &[w.t.mr.sge(256, 64)],
                    }])
                    .unwrap();
                let sge = [w.h.mr.sge(0, 8)];
                for i in 0..2 {
                    w.hid[0].post_send(&[send(i, &sge, true)]).unwrap();
                    assert_eq!(poll_one(&w.h.cq).status, WcStatus::Success);
                }
                let got: Vec<u64> = (0..2).map(|_| poll_one(&w.t.cq).wr_id).collect();
                assert_eq!(got, [0, 99], "the receive after the refused one was not posted");
            }

            /// A target accepts offering its host no RDMA READs (responder resources 0, as
            /// nvmet-rdma does), keeping the READ depth it grants itself.
            #[test]
            fn accepting_as_a_target_grants_its_read_depth_and_offers_the_host_none() {
                let Some(env) = <$env>::new() else { return };
                let addr = env.addr(4437);
                let sch = env.channel();
                let _l = sch.listen(addr, 4).unwrap();
                let cch = env.channel();
                let mut c = cch.resolve(addr, Duration::from_secs(3)).unwrap();
                let h = side(c.device().unwrap());
                c.create_qp(&h.pd, &h.cq, &h.srq, CAPS).unwrap();
                c.connect(b"hello").unwrap();
                let (mut id, offered) = wait("CONNECT_REQUEST", || match sch.next_event() {
                    Some(CmEvent::ConnectRequest {
                        id,
                        initiator_depth,
                        ..
                    }) => Some((id, initiator_depth)),
                    _ => None,
                });
                assert!(offered >= 8, "the host offers {offered} READs");
                let t = side(id.device().unwrap());
                id.create_qp(&t.pd, &t.cq, &t.srq, CAPS).unwrap();
                id.accept_with(b"", 8, 8).unwrap();
                // Advertised from the move to RTR, before the host can send: rdma_cm's would
                // make a host whose SEND finds no receive wait 655 ms.
                // (iWARP has no RNR NAK: its devices are the ones whose READ sinks need
                // remote write.)
                let iwarp = id.device().unwrap().rdma_read_sink_needs_remote_write();
                match id.min_rnr_timer() {
                    Some(t) if !iwarp => assert_eq!(t, 8, "the accepted QP's RNR NAK timer"),
                    Some(_) => {}
                    None => assert!(!env.has_rnr_timer(), "no RNR NAK timer"),
                }
                // With ibverbs, librdmacm holds no accepted connection's QP: it would move
                // it to ERR while reading a REJECTED event, on the thread reading the channel,
                // while the target's data path may be destroying it.
                assert_eq!(id.rdma_cm_holds_qp(), env.accepted_qp_in_rdma_cm());
                assert!(c.rdma_cm_holds_qp(), "the connecting side's");
                wait("ESTABLISHED (connecting side)", || match cch.next_event() {
                    Some(CmEvent::Established { .. }) => Some(()),
                    Some(other) => panic!("{other:?}"),
                    None => None,
                });
                assert_eq!(
                    id.read_depths(),
                    Some(ReadDepths {
                        initiator: 8,
                        responder: 0
                    }),
                    "the target"
                );
                match c.read_depths() {
                    Some(d) => assert_eq!(
                        d,
                        ReadDepths {
                            initiator: 0,
                            responder: 8
                        },
                        "the host"
                    ),
                    None => assert!(
                        !env.peer_learns_depths(),
                        "the host's QP does not know its depths"
                    ),
                }
            }

            #[test]
            fn cm_reject_carries_private_data() {
                let Some(env) = <$env>::new() else { return };
                let addr = env.addr(4428);
                let sch = env.channel();
                let _l = sch.listen(addr, 4).unwrap();
                let cch = env.channel();
                let mut c = cch.resolve(addr, Duration::from_secs(3)).unwrap();
                let h = side(c.device().unwrap());
                c.create_qp(&h.pd, &h.cq, &h.srq, CAPS).unwrap();
                c.connect(b"hello").unwrap();
                let id = wait("CONNECT_REQUEST", || match sch.next_event() {
                    Some(CmEvent::ConnectRequest { id, .. }) => Some(id),
                    _ => None,
                });
                id.reject(&[0, 0, 3, 0]).unwrap();
                let (tok, pd) = wait("REJECTED", || match cch.next_event() {
                    Some(CmEvent::Rejected { id, private_data }) => Some((id, private_data)),
                    Some(other) => panic!("{other:?}"),
                    None => None,
                });
                assert_eq!(tok, c.token());
                assert_eq!(pd.get(..4), Some(&[0u8, 0, 3, 0][..]));
            }

            /// A host, its connection request taken and its QP made, and the target's.
            pub(crate) struct Pending {
                pub t: Side,
                pub h: Side,
                pub sch: CmChannel,
                pub cch: CmChannel,
                /// The host's ID (connecting).
                pub c: CmId,
                /// The target's ID for it, its QP created, not accepted.
                pub s: CmId,
                pub _listener: CmId,
            }

            pub(crate) fn pending(env: &$env, port: u16) -> Pending {
                let addr = env.addr(port);
                let sch = env.channel();
                let listener = sch.listen(addr, 4).unwrap();
                let t = side(listener.device().unwrap());
                let cch = env.channel();
                let mut c = cch.resolve(addr, Duration::from_secs(3)).unwrap();
                let h = side(c.device().unwrap());
                c.create_qp(&h.pd, &h.cq, &h.srq, CAPS).unwrap();
                c.connect(b"hello").unwrap();
                let mut s = wait("CONNECT_REQUEST", || match sch.next_event() {
                    Some(CmEvent::ConnectRequest { id, .. }) => Some(id),
                    _ => None,
                });
                s.create_qp(&t.pd, &t.cq, &t.srq, CAPS).unwrap();
                Pending {
                    t,
                    h,
                    sch,
                    cch,
                    c,
                    s,
                    _listener: listener,
                }
            }

            /// What the accepting side hears next about its connection, other than
            /// TIMEWAIT_EXIT.
            fn next_about(sch: &CmChannel, what: &str) -> CmEvent {
                wait(what, || match sch.next_event() {
                    Some(CmEvent::TimewaitExit { .. }) | None => None,
                    Some(e) => Some(e),
                })
            }

            #[test]
            fn a_host_gone_after_the_accept_is_rejected_at_the_accepting_side() {
                let Some(env) = <$env>::new() else { return };
                let p = pending(&env, 4438);
                p.s.accept(b"accepted").unwrap();
                // The host goes away before it took its ESTABLISHED, so before its RTU: its
                // ID is destroyed (with rdma_cm, once the objects made on its device are gone
                // too), and the IB CM sends a REJ for it.
                drop((p.c, p.h));
                match next_about(&p.sch, "REJECTED at the accepting side") {
                    CmEvent::Rejected { id, .. } => assert_eq!(id, p.s.token()),
                    other => panic!("{other:?}"),
                }
                // librdmacm moves a QP it holds to ERR as it reads REJECTED; the ibverbs
                // provider gives it no accepted connection's QP, which stays as it was (the
                // data path tears the connection down).
                let want = if env.accepted_qp_in_rdma_cm() {
                    QpState::Err
                } else {
                    QpState::Rts
                };
                assert_eq!(p.s.qp_state(), Some(want), "after REJECTED");
                drop(p.t);
            }

            #[test]
            fn a_host_gone_before_the_accept_fails_the_accept_or_is_rejected() {
                let Some(env) = <$env>::new() else { return };
                let p = pending(&env, 4439);
                drop((p.c, p.h));
                // Its REJ is not reported before the accept (the kernel's ucma drops the
                // events of a connection userspace has not accepted): the accept fails, or,
                // if the REJ is still on its way, the REJ ends the accepted connection.
                if p.s.accept(b"too late").is_ok() {
                    match next_about(&p.sch, "REJECTED after the accept") {
                        CmEvent::Rejected { id, .. } => assert_eq!(id, p.s.token()),
                        other => panic!("{other:?}"),
                    }
                }
                drop((p.t, p.cch));
            }

            #[test]
            fn disconnect_is_seen_on_both_sides() {
                let Some(w) = world(4429, 1) else { return };
                w.hid[0].disconnect().unwrap();
                let tok = wait("DISCONNECTED (accepting side)", || {
                    match w.sch.next_event() {
                        Some(CmEvent::Disconnected { id }) => Some(id),
                        _ => None,
                    }
                });
                assert_eq!(tok, w.tid[0].token());
                w.tid[0].disconnect().unwrap();
                wait("DISCONNECTED (connecting side)", || {
                    match w.cch.next_event() {
                        Some(CmEvent::Disconnected { .. }) => Some(()),
                        _ => None,
                    }
                });
                assert_eq!(w.hid[0].qp_state(), Some(QpState::Err));
            }

            #[test]
            fn the_device_reports_its_port_and_gids() {
                let Some(w) = world(4431, 1) else { return };
                let p = w.t.dev.port_attr(1).unwrap();
                assert!(p.active, "{p:?}");
                assert!(p.active_mtu >= 256, "{p:?}");
                let attr = w.t.dev.attr().unwrap();
                assert!(attr.max_srq_sge >= 4 && attr.max_qp_wr >= 64, "{attr:?}");
                if let std::net::IpAddr::V4(ip) = w.env.ip() {
                    // Where in the table depends on the order the addresses came in (the
                    // IPv6 link-local one may come first).
                    let gids: Vec<[u8; 16]> =
                        (0..16).filter_map(|i| w.t.dev.gid(1, i).ok()).collect();
                    assert!(
                        gids.contains(&ip.to_ipv6_mapped().octets()),
                        "the IPv4-mapped address is a GID: {gids:?}"
                    );
                }
            }

            #[test]
            fn the_completion_channel_fires_once_per_arming() {
                let Some(w) = world(4432, 1) else { return };
                let readable = |fd: i32, ms: i32| {
                    let mut p = libc::pollfd {
                        fd,
                        events: libc::POLLIN,
                        revents: 0,
                    };
                    // SAFETY: one valid pollfd.
                    unsafe { libc::poll(&mut p, 1, ms) == 1 }
                };
                w.t.cq.req_notify().unwrap();
                w.t.srq
                    .post_recv(&[
                        RecvWr {
                            wr_id: 1,
                            sges: &[w.t.mr.sge(0, 64)],
                        },
                        RecvWr {
                            wr_id: 2,
                            sges: &[w.t.mr.sge(64, 64)],
                        },
                    ])
                    .unwrap();
                w.hid[0]
                    .post_send(&[send(1, &[w.h.mr.sge(0, 8)], true)])
                    .unwrap();
                assert!(
                    readable(w.t.cq.channel_fd(), 5000),
                    "armed: the channel fires"
                );
                assert!(w.t.cq.ack_event());
                poll_one(&w.t.cq);
                w.hid[0]
                    .post_send(&[send(2, &[w.h.mr.sge(0, 8)], true)])
                    .unwrap();
                poll_one(&w.t.cq);
                assert!(
                    !readable(w.t.cq.channel_fd(), 50),
                    "not re-armed: no second notification"
                );
                assert!(!w.t.cq.ack_event());
            }

            #[test]
            fn many_qps_share_one_srq_and_one_cq() {
                let Some(w) = world(4430, 16) else { return };
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
                for (i, q) in w.hid.iter().enumerate() {
                    w.h.mr.write(i * 16, &[i as u8; 16]);
                    q.post_send(&[send(i as u64, &[w.h.mr.sge(i * 16, 16)], true)])
                        .unwrap();
                }
                let mut qpns: Vec<u32> = (0..16).map(|_| poll_one(&w.t.cq).qp_num).collect();
                qpns.sort_unstable();
                let mut want: Vec<u32> = w.tid.iter().map(|t| t.qpn().unwrap()).collect();
                want.sort_unstable();
                assert_eq!(qpns, want, "one completion per QP, each naming its QP");
                let _ = &w.env;
            }

            /// Only a removed device whose objects are all gone is let go of. (On ibverbs the
            /// handles counted are those of the device's context in the whole process: the
            /// lab runs this suite one test at a time.)
            #[test]
            fn a_device_in_use_or_still_present_is_not_released() {
                let Some(w) = world(4434, 1) else { return };
                let World {
                    env,
                    sch,
                    cch,
                    t,
                    h,
                    tid,
                    hid,
                    _listener: listener,
                } = w;
                let held = listener.release_removed_device();
                assert!(
                    matches!(held, Ok(DeviceRelease::InUse(n)) if n > 0),
                    "{held:?}"
                );
                drop((tid, hid, t, h));
                assert_eq!(
                    listener.release_removed_device(),
                    Ok(DeviceRelease::Present),
                    "nothing made on it is left, but it was not removed"
                );
                drop((listener, sch, cch, env));
            }
        }
    };
}

/// The soft provider: a fresh fabric with one device per test.
struct SoftEnv {
    fabric: nvmfd_rdma::soft::Fabric,
}

impl SoftEnv {
    fn new() -> Option<SoftEnv> {
        let fabric = nvmfd_rdma::soft::Fabric::new();
        fabric.add_device("10.0.0.1".parse().unwrap()).unwrap();
        Some(SoftEnv { fabric })
    }
    fn ip(&self) -> std::net::IpAddr {
        "10.0.0.1".parse().unwrap()
    }
    fn addr(&self, port: u16) -> SocketAddr {
        SocketAddr::new(self.ip(), port)
    }
    fn channel(&self) -> nvmfd_rdma::soft::cm::CmChannel {
        nvmfd_rdma::soft::cm::CmChannel::new(&self.fabric).unwrap()
    }
    fn peer_learns_depths(&self) -> bool {
        true
    }
    /// Whether rdma_cm holds the QP of a connection this side accepts.
    fn accepted_qp_in_rdma_cm(&self) -> bool {
        true
    }
    /// Whether its QPs advertise an RNR NAK timer.
    fn has_rnr_timer(&self) -> bool {
        false
    }
}

suite!(on_soft, soft, SoftEnv);

/// The soft provider between two fabrics over TCP on loopback, as between two processes: the
/// first channel asked for (the listening side) is on fabric A, the next on fabric B, and so on.
struct SoftTcpEnv {
    a: nvmfd_rdma::soft::Fabric,
    b: nvmfd_rdma::soft::Fabric,
    n: std::cell::Cell<u32>,
}

impl SoftTcpEnv {
    fn new() -> Option<SoftTcpEnv> {
        let a = nvmfd_rdma::soft::Fabric::networked();
        a.add_device("127.0.0.1".parse().unwrap()).unwrap();
        let b = nvmfd_rdma::soft::Fabric::networked();
        b.add_device("127.0.0.2".parse().unwrap()).unwrap();
        Some(SoftTcpEnv {
            a,
            b,
            n: std::cell::Cell::new(0),
        })
    }
    fn ip(&self) -> std::net::IpAddr {
        "127.0.0.1".parse().unwrap()
    }
    /// Ports well away from the others' (these are real TCP ports).
    fn addr(&self, port: u16) -> SocketAddr {
        SocketAddr::new(self.ip(), port + 21000)
    }
    fn channel(&self) -> nvmfd_rdma::soft::cm::CmChannel {
        let n = self.n.get();
        self.n.set(n + 1);
        let f = if n.is_multiple_of(2) {
            &self.a
        } else {
            &self.b
        };
        nvmfd_rdma::soft::cm::CmChannel::new(f).unwrap()
    }
    /// A host in another process is not told the depths its peer accepted with.
    fn peer_learns_depths(&self) -> bool {
        false
    }
    /// Whether rdma_cm holds the QP of a connection this side accepts.
    fn accepted_qp_in_rdma_cm(&self) -> bool {
        true
    }
    /// Whether its QPs advertise an RNR NAK timer.
    fn has_rnr_timer(&self) -> bool {
        false
    }
}

suite!(on_soft_tcp, soft, SoftTcpEnv);

/// The soft provider through the provider-neutral `any` types (what the daemon uses).
struct AnySoftEnv {
    inner: SoftEnv,
}

impl AnySoftEnv {
    fn new() -> Option<AnySoftEnv> {
        SoftEnv::new().map(|inner| AnySoftEnv { inner })
    }
    fn ip(&self) -> std::net::IpAddr {
        self.inner.ip()
    }
    fn addr(&self, port: u16) -> SocketAddr {
        self.inner.addr(port)
    }
    fn channel(&self) -> nvmfd_rdma::any::cm::CmChannel {
        nvmfd_rdma::any::cm::CmChannel::Soft(self.inner.channel())
    }
    fn peer_learns_depths(&self) -> bool {
        true
    }
    /// Whether rdma_cm holds the QP of a connection this side accepts.
    fn accepted_qp_in_rdma_cm(&self) -> bool {
        true
    }
    /// Whether its QPs advertise an RNR NAK timer.
    fn has_rnr_timer(&self) -> bool {
        false
    }
}

suite!(on_any_soft, any, AnySoftEnv);

/// The ibverbs provider through the `any` types.
#[cfg(feature = "ibverbs")]
struct AnyVerbsEnv {
    inner: VerbsEnv,
}

#[cfg(feature = "ibverbs")]
impl AnyVerbsEnv {
    fn new() -> Option<AnyVerbsEnv> {
        VerbsEnv::new().map(|inner| AnyVerbsEnv { inner })
    }
    fn ip(&self) -> std::net::IpAddr {
        self.inner.ip()
    }
    fn addr(&self, port: u16) -> SocketAddr {
        // Apart from the direct suite's ports: both run in the same lab process.
        self.inner.addr(port + 100)
    }
    fn channel(&self) -> nvmfd_rdma::any::cm::CmChannel {
        nvmfd_rdma::any::cm::CmChannel::Verbs(self.inner.channel())
    }
    fn peer_learns_depths(&self) -> bool {
        true
    }
    /// Whether rdma_cm holds the QP of a connection this side accepts.
    fn accepted_qp_in_rdma_cm(&self) -> bool {
        false
    }
    /// Whether its QPs advertise an RNR NAK timer.
    fn has_rnr_timer(&self) -> bool {
        true
    }
}

#[cfg(feature = "ibverbs")]
suite!(on_any_ibverbs, any, AnyVerbsEnv);

/// The ibverbs provider: the device whose address `RDMA_IP` names.
#[cfg(feature = "ibverbs")]
struct VerbsEnv {
    ip: std::net::IpAddr,
}

#[cfg(feature = "ibverbs")]
impl VerbsEnv {
    fn new() -> Option<VerbsEnv> {
        if nvmfd_rdma::ibverbs::device_names().is_empty() {
            skip("no RDMA device on this machine (scripts/lab-rdma.sh runs these tests on rxe)");
            return None;
        }
        let Some(ip) = std::env::var("RDMA_IP").ok().and_then(|s| s.parse().ok()) else {
            skip("RDMA_IP does not name the RDMA device's address");
            return None;
        };
        Some(VerbsEnv { ip })
    }
    fn ip(&self) -> std::net::IpAddr {
        self.ip
    }
    fn addr(&self, port: u16) -> SocketAddr {
        SocketAddr::new(self.ip, port)
    }
    fn channel(&self) -> nvmfd_rdma::ibverbs::cm::CmChannel {
        nvmfd_rdma::ibverbs::cm::CmChannel::new().unwrap()
    }
    fn peer_learns_depths(&self) -> bool {
        true
    }
    /// Whether rdma_cm holds the QP of a connection this side accepts.
    fn accepted_qp_in_rdma_cm(&self) -> bool {
        false
    }
    /// Whether its QPs advertise an RNR NAK timer.
    fn has_rnr_timer(&self) -> bool {
        true
    }
}

#[cfg(feature = "ibverbs")]
suite!(on_ibverbs, ibverbs, VerbsEnv);

/// Knobs and failures only the soft provider has (or can be made to show).
mod soft_only {
    use super::*;
    use nvmfd_rdma::soft::{Fabric, Faults};
    use on_soft::{poll_one, world, World};

    #[test]
    fn rnr_with_fewer_than_7_retries_fails_the_qp() {
        let w = world(5000, 1).unwrap();
        w.hid[0].set_rnr_retry(3);
        w.hid[0]
            .post_send(&[send(2, &[w.h.mr.sge(0, 32)], true)])
            .unwrap();
        assert_eq!(poll_one(&w.h.cq).status, WcStatus::RnrRetryExcErr);
        assert_eq!(w.hid[0].qp_state(), Some(QpState::Err));
    }

    #[test]
    fn unsignaled_requests_hold_sq_slots_until_a_signaled_one_completes() {
        let w = world(5001, 1).unwrap();
        let sge = [w.t.mr.sge(0, 8)];
        let write = |id, signaled| write_to_host(&w, &sge, id, signaled);
        for i in 0..64 {
            w.tid[0].post_send(&[write(100 + i, false)]).unwrap();
        }
        let e = w.tid[0].post_send(&[write(200, false)]).unwrap_err();
        assert_eq!(
            e.errno(),
            Some(libc::ENOMEM),
            "the SQ (64) is full of unretired WRs"
        );
    }

    /// A completion made but not polled still holds its send queue slot (and those of the
    /// unsignaled run it retired), as on mlx5, which frees them in `poll_cq`: a post past
    /// the queue's size fails until the completions are polled. They came free as the
    /// completions were made, so a data path releasing its budget early passed here.
    #[test]
    fn send_queue_slots_come_free_when_their_completions_are_polled() {
        let w = world(5045, 1).unwrap();
        let sge = [w.t.mr.sge(0, 8)];
        let write = |id, signaled| write_to_host(&w, &sge, id, signaled);
        for i in 0..63 {
            w.tid[0].post_send(&[write(100 + i, false)]).unwrap();
        }
        w.tid[0].post_send(&[write(163, true)]).unwrap();
        let e = w.tid[0].post_send(&[write(200, true)]).unwrap_err();
        assert_eq!(
            e.errno(),
            Some(libc::ENOMEM),
            "the SQ (64) is full of WRs whose completion is not polled"
        );
        assert_eq!(poll_one(&w.t.cq).wr_id, 163);
        for i in 0..64 {
            w.tid[0].post_send(&[write(300 + i, true)]).unwrap();
        }
        let e = w.tid[0].post_send(&[write(400, true)]).unwrap_err();
        assert_eq!(e.errno(), Some(libc::ENOMEM));
        for i in 0..64 {
            assert_eq!(poll_one(&w.t.cq).wr_id, 300 + i);
        }
        w.tid[0].post_send(&[write(500, true)]).unwrap();
    }

    /// A SEND waiting for a receive at the peer (RNR, retried) holds back the QP's later
    /// work, as a responder discards what follows the NAK'd packet and the requester resends
    /// from it (IB 9.7.5.2.8): a later RDMA WRITE neither lands nor completes before it, and
    /// completions come in posting order once a receive is posted. The WRITE landed and
    /// completed at once, past the waiting SEND.
    #[test]
    fn work_behind_a_send_waiting_for_a_receive_waits_with_it() {
        let w = world(5046, 1).unwrap();
        w.h.mr.write(0, &[0x5a; 64]);
        w.t.mr.write(256, &[0; 64]);
        let landed = |w: &World| {
            let mut b = [0u8; 64];
            w.t.mr.read(256, &mut b);
            b
        };
        w.hid[0]
            .post_send(&[send(1, &[w.h.mr.sge(0, 64)], true)])
            .unwrap();
        w.hid[0]
            .post_send(&[SendWr {
                wr_id: 2,
                op: SendOp::RdmaWrite {
                    remote_addr: w.t.mr.addr() + 256,
                    rkey: w.t.mr.rkey(),
                },
                sges: &[w.h.mr.sge(0, 64)],
                signaled: true,
                inline: None,
            }])
            .unwrap();
        let mut wc = [Wc::default(); 4];
        assert_eq!(w.h.cq.poll(&mut wc).unwrap(), 0, "{:?}", &wc[..1]);
        assert_eq!(
            landed(&w),
            [0; 64],
            "the WRITE landed before the SEND ahead of it"
        );
        post_target_receive(&w);
        let first = poll_one(&w.h.cq);
        let second = poll_one(&w.h.cq);
        assert_eq!(
            [(first.wr_id, first.status), (second.wr_id, second.status)],
            [(1, WcStatus::Success), (2, WcStatus::Success)]
        );
        assert_eq!(landed(&w), [0x5a; 64]);
    }

    #[test]
    fn last_wqe_can_be_suppressed_as_on_rxe() {
        let w = world(5002, 1).unwrap();
        assert!(w.t.dev.sends_last_wqe());
        w.env.fabric.set_faults(Faults {
            suppress_last_wqe: true,
            ..Faults::default()
        });
        assert!(!w.t.dev.sends_last_wqe(), "the device says what it does");
        w.tid[0].to_error().unwrap();
        assert_eq!(w.t.dev.next_event(), None);
    }

    /// An RDMA WRITE of `sge` from the target side to the start of the host's region.
    fn write_to_host<'a>(w: &World, sge: &'a [Sge], id: u64, signaled: bool) -> SendWr<'a> {
        SendWr {
            wr_id: id,
            op: SendOp::RdmaWrite {
                remote_addr: w.h.mr.addr(),
                rkey: w.h.mr.rkey(),
            },
            sges: sge,
            signaled,
            inline: None,
        }
    }

    /// One receive (wr_id 9, 128 bytes) on the target's SRQ.
    fn post_target_receive(w: &World) {
        w.t.srq
            .post_recv(&[RecvWr {
                wr_id: 9,
                sges: &[w.t.mr.sge(0, 128)],
            }])
            .unwrap();
    }

    /// `n` signaled RDMA WRITEs of 8 bytes from the target side, `first` the first wr_id.
    fn writes<'a>(w: &World, sge: &'a [Sge], first: u64, n: u64) -> Vec<SendWr<'a>> {
        (first..first + n)
            .map(|k| SendWr {
                wr_id: k,
                op: SendOp::RdmaWrite {
                    remote_addr: w.h.mr.addr() + 8 * k,
                    rkey: w.h.mr.rkey(),
                },
                sges: sge,
                signaled: true,
                inline: None,
            })
            .collect()
    }

    /// Every completion waiting on `cq`.
    fn drain(cq: &nvmfd_rdma::soft::Cq) -> Vec<Wc> {
        let mut out = Vec::new();
        let mut w = [Wc::default(); 16];
        loop {
            let n = cq.poll(&mut w).unwrap();
            if n == 0 {
                return out;
            }
            out.extend_from_slice(&w[..n]);
        }
    }

    #[test]
    fn an_injected_post_failure_stops_one_long_enough_chain_at_its_index() {
        let w = world(5030, 1).unwrap();
        let qpn = w.tid[0].qpn().unwrap();
        let sge = [w.t.mr.sge(0, 8)];
        w.env.fabric.inject_post_failure(qpn, 2);
        // Too short to reach index 2: posted whole, the injection stays armed.
        w.tid[0].post_send(&writes(&w, &sge, 0, 2)).unwrap();
        let e = w.tid[0].post_send(&writes(&w, &sge, 10, 5)).unwrap_err();
        assert_eq!((e.posted(), e.errno()), (2, Some(libc::ENOMEM)), "{e}");
        assert_eq!(w.tid[0].qp_state(), Some(QpState::Rts));
        // Disarmed: the next chain posts whole.
        w.tid[0].post_send(&writes(&w, &sge, 20, 5)).unwrap();
        let ids: Vec<u64> = drain(&w.t.cq)
            .iter()
            .inspect(|wc| assert_eq!(wc.status, WcStatus::Success))
            .map(|wc| wc.wr_id)
            .collect();
        assert_eq!(ids, [0, 1, 10, 11, 20, 21, 22, 23, 24]);
    }

    /// The chains a seeded run refused part-way, with where each stopped, and the completions.
    fn refused_with(seed: u64) -> (Vec<(u64, usize)>, Vec<u64>) {
        let w = world(5031, 1).unwrap();
        w.env.fabric.set_faults(Faults {
            seed,
            post_failure_per_million: 250_000,
            ..Faults::default()
        });
        let sge = [w.t.mr.sge(0, 8)];
        let mut refused = Vec::new();
        let mut posted = Vec::new();
        for c in 0..40u64 {
            let chain = writes(&w, &sge, c * 10, 4);
            let n = match w.tid[0].post_send(&chain) {
                Ok(()) => 4,
                Err(e) => {
                    assert_eq!(e.errno(), Some(libc::ENOMEM), "{e}");
                    refused.push((c, e.posted()));
                    e.posted()
                }
            };
            posted.extend(chain[..n].iter().map(|wr| wr.wr_id));
        }
        let done: Vec<u64> = drain(&w.t.cq).iter().map(|wc| wc.wr_id).collect();
        assert_eq!(done, posted, "exactly the posted requests complete");
        (refused, done)
    }

    #[test]
    fn seeded_post_failures_replay_exactly_and_only_the_posted_requests_complete() {
        let a = refused_with(42);
        assert!(a.0.len() > 3, "25% over 40 chains refused {}", a.0.len());
        assert!(
            a.0.iter().any(|&(_, i)| i > 0),
            "some chain was refused part-way"
        );
        assert_eq!(a, refused_with(42), "the same seed replays the same faults");
        assert_ne!(a.0, refused_with(7).0, "another seed gives other faults");
    }

    #[test]
    fn a_full_send_queue_refuses_from_the_first_request_that_finds_no_room() {
        let w = world(5032, 1).unwrap();
        let sge = [w.t.mr.sge(0, 8)];
        let unsignaled = |k| SendWr {
            signaled: false,
            ..writes(&w, &sge, k, 1)[0]
        };
        for k in 0..60 {
            w.tid[0].post_send(&[unsignaled(k)]).unwrap();
        }
        // 4 slots of 64 are left.
        let chain: Vec<SendWr<'_>> = (60..66).map(unsignaled).collect();
        let e = w.tid[0].post_send(&chain).unwrap_err();
        assert_eq!((e.posted(), e.errno()), (4, Some(libc::ENOMEM)), "{e}");
    }

    #[test]
    fn send_with_invalidate_can_be_made_unsupported() {
        let w = world(5033, 1).unwrap();
        assert!(w.t.dev.supports_send_with_invalidate());
        w.env.fabric.set_faults(Faults {
            no_send_with_invalidate: true,
            ..Faults::default()
        });
        assert!(!w.t.dev.supports_send_with_invalidate());
        let sge = [w.t.mr.sge(0, 8)];
        let chain = [
            writes(&w, &sge, 0, 1)[0],
            SendWr {
                wr_id: 1,
                op: SendOp::SendWithInvalidate {
                    rkey: w.h.mr.rkey(),
                },
                sges: &sge,
                signaled: true,
                inline: None,
            },
        ];
        let e = w.tid[0].post_send(&chain).unwrap_err();
        assert_eq!((e.posted(), e.errno()), (1, Some(libc::EINVAL)), "{e}");
        assert!(w.h.mr.is_valid(), "nothing was invalidated");
    }

    #[test]
    fn destroying_a_qp_drops_its_completions_only_in_the_mlx5_mode() {
        for mlx5 in [false, true] {
            let mut w = world(5034 + u16::from(mlx5), 2).unwrap();
            w.env.fabric.set_faults(Faults {
                destroy_drops_completions: mlx5,
                ..Faults::default()
            });
            let bufs: Vec<[Sge; 1]> = (0..41).map(|i| [w.t.mr.sge(i * 64, 64)]).collect();
            let wrs: Vec<RecvWr<'_>> = bufs
                .iter()
                .enumerate()
                .map(|(i, s)| RecvWr {
                    wr_id: 1000 + i as u64,
                    sges: s,
                })
                .collect();
            for chunk in wrs.chunks(16) {
                w.t.srq.post_recv(chunk).unwrap();
            }
            // 40 messages for the first QP (more than one poll batch), then one for the
            // second; a WRITE from each.
            let sge = [w.h.mr.sge(0, 8)];
            for i in 0..41 {
                w.hid[usize::from(i == 40)]
                    .post_send(&[send(i, &sge, true)])
                    .unwrap();
            }
            let tsge = [w.t.mr.sge(0, 8)];
            for (q, t) in w.tid.iter().enumerate() {
                t.post_send(&writes(&w, &tsge, 500 + q as u64, 1)).unwrap();
            }
            let first = w.tid[0].qpn().unwrap();
            drop(w.tid.remove(0));
            let left = drain(&w.t.cq);
            let of_first = left.iter().filter(|wc| wc.qp_num == first).count();
            assert_eq!(left.len() - of_first, 2, "the second QP's: {left:?}");
            let drops = w.env.fabric.destroy_drops();
            if mlx5 {
                assert_eq!(of_first, 0, "destroying the QP dropped its completions");
                assert_eq!(
                    drops,
                    nvmfd_rdma::soft::DestroyDrops {
                        receives: 40,
                        sends: 1
                    }
                );
            } else {
                assert_eq!(of_first, 41, "a destroyed QP's completions stay, as on rxe");
                assert_eq!(drops, nvmfd_rdma::soft::DestroyDrops::default());
            }
            // Either way the 40 receives are consumed: dropped, nothing gives them back.
            assert_eq!(w.t.srq.posted(), 0);
        }
    }

    /// Held send completions (a device writing them late) reach their CQ when released, in
    /// order, flushed ones of a QP destroyed meanwhile included; receives are never held.
    #[test]
    fn held_send_completions_arrive_when_released_even_after_their_qp_is_destroyed() {
        let mut w = world(5037, 2).unwrap();
        let first = w.tid[0].qpn().unwrap();
        w.t.srq
            .post_recv(&[RecvWr {
                wr_id: 7,
                sges: &[w.t.mr.sge(0, 64)],
            }])
            .unwrap();
        w.env.fabric.hold_send_completions(first);
        let tsge = [w.t.mr.sge(0, 8)];
        w.tid[0].post_send(&writes(&w, &tsge, 1, 2)).unwrap();
        w.tid[1].post_send(&writes(&w, &tsge, 3, 1)).unwrap();
        let hsge = [w.h.mr.sge(0, 8)];
        w.hid[0].post_send(&[send(9, &hsge, true)]).unwrap();
        let now: Vec<(u32, u64)> = drain(&w.t.cq).iter().map(|c| (c.qp_num, c.wr_id)).collect();
        assert_eq!(
            now,
            [(w.tid[1].qpn().unwrap(), 3), (first, 7)],
            "only the held QP's sends wait"
        );
        // A SEND the host has no receive for waits; the QP goes, and the SEND's flush is
        // held too.
        w.tid[0].post_send(&[send(5, &tsge, true)]).unwrap();
        w.tid[0].to_error().unwrap();
        drop(w.tid.remove(0));
        assert_eq!(drain(&w.t.cq), []);
        assert_eq!(w.env.fabric.release_held_completions(), 3);
        let late: Vec<(u32, u64, WcStatus)> = drain(&w.t.cq)
            .iter()
            .map(|c| (c.qp_num, c.wr_id, c.status))
            .collect();
        assert_eq!(
            late,
            [
                (first, 1, WcStatus::Success),
                (first, 2, WcStatus::Success),
                (first, 5, WcStatus::WrFlushErr)
            ]
        );
        // Released: nothing is held any more.
        w.tid[0].post_send(&writes(&w, &tsge, 4, 1)).unwrap();
        assert_eq!(drain(&w.t.cq).len(), 1);
    }

    /// As uverbs does, destroying a QP removes its async events not yet read: no event read
    /// later names a QP number the device may have given to a new QP. Other QPs' stay.
    #[test]
    fn destroying_a_qp_removes_its_unread_events() {
        let mut w = world(5038, 2).unwrap();
        let (first, second) = (w.tid[0].qpn().unwrap(), w.tid[1].qpn().unwrap());
        w.env.fabric.inject_qp_fatal(first);
        w.env.fabric.inject_qp_fatal(second);
        drop(w.tid.remove(0));
        let from = w.t.dev.events_read();
        let mut left = Vec::new();
        while let Some((n, e)) = w.t.dev.next_numbered_event() {
            assert_eq!(n, from + left.len() as u64, "numbered in the order read");
            left.push(e);
        }
        assert_eq!(w.t.dev.events_read(), from + 2);
        assert_eq!(
            left,
            [
                AsyncEvent::QpFatal(second),
                AsyncEvent::QpLastWqeReached(second)
            ]
        );
        assert!(left.iter().all(|e| e.qp() != Some(first)));
    }

    /// A SEND over TCP that reaches a QP already in ERR (the peer not yet told) is not
    /// received: no receive is consumed, no receive completion is made, the SEND fails.
    #[test]
    fn a_send_reaching_a_qp_in_error_consumes_no_receive() {
        let w = on_soft_tcp::world(5036, 1).unwrap();
        w.t.srq
            .post_recv(&[RecvWr {
                wr_id: 1,
                sges: &[w.t.mr.sge(0, 64)],
            }])
            .unwrap();
        w.tid[0].to_error().unwrap();
        w.hid[0]
            .post_send(&[send(2, &[w.h.mr.sge(0, 8)], true)])
            .unwrap();
        let wc = on_soft_tcp::poll_one(&w.h.cq);
        assert_eq!(wc.wr_id, 2);
        assert_ne!(wc.status, WcStatus::Success, "{wc:?}");
        assert_eq!(w.t.srq.posted(), 1, "the receive is still posted");
        let mut out = [Wc::default(); 4];
        assert_eq!(w.t.cq.poll(&mut out).unwrap(), 0, "{:?}", out[0]);
    }

    #[test]
    fn an_injected_qp_fatal_is_reported_then_the_qp_flushes() {
        let w = world(5010, 1).unwrap();
        let qpn = w.tid[0].qpn().unwrap();
        w.env.fabric.inject_qp_fatal(qpn);
        assert_eq!(w.t.dev.next_event(), Some(AsyncEvent::QpFatal(qpn)));
        assert_eq!(
            w.t.dev.next_event(),
            Some(AsyncEvent::QpLastWqeReached(qpn))
        );
        w.tid[0]
            .post_send(&[send(1, &[w.t.mr.sge(0, 8)], false)])
            .unwrap();
        assert_eq!(poll_one(&w.t.cq).status, WcStatus::WrFlushErr);
        // The other side's traffic to it now fails as on a dead peer.
        w.hid[0]
            .post_send(&[send(2, &[w.h.mr.sge(0, 8)], true)])
            .unwrap();
        assert_eq!(poll_one(&w.h.cq).status, WcStatus::RetryExcErr);
    }

    #[test]
    fn an_srq_error_takes_down_every_qp_on_it() {
        let w = world(5011, 16).unwrap();
        w.env.fabric.inject_srq_error(w.t.srq.id());
        assert_eq!(w.t.dev.next_event(), Some(AsyncEvent::SrqErr(w.t.srq.id())));
        assert!(w.tid.iter().all(|t| t.qp_state() == Some(QpState::Err)));
        let mut last_wqe = 0;
        while let Some(e) = w.t.dev.next_event() {
            last_wqe += usize::from(matches!(e, AsyncEvent::QpLastWqeReached(_)));
        }
        assert_eq!(last_wqe, 16);
        assert_eq!(
            w.t.srq
                .post_recv(&[RecvWr {
                    wr_id: 0,
                    sges: &[w.t.mr.sge(0, 8)]
                }])
                .unwrap_err()
                .errno(),
            Some(libc::EIO)
        );
    }

    #[test]
    fn device_removal_fails_its_qps_tells_the_cm_and_comes_back() {
        let w = world(5012, 2).unwrap();
        w.env.fabric.remove_device(&w.t.dev);
        assert_eq!(w.t.dev.next_event(), Some(AsyncEvent::DeviceFatal));
        assert!(w.tid.iter().all(|t| t.qp_state() == Some(QpState::Err)));
        let removals = std::iter::from_fn(|| w.sch.next_event())
            .filter(|e| matches!(e, nvmfd_rdma::soft::cm::CmEvent::DeviceRemoval { .. }))
            .count();
        assert!(
            removals >= 2,
            "each connection on the device hears of it ({removals})"
        );
        assert_eq!(w.t.dev.alloc_pd().unwrap_err().errno(), Some(libc::ENODEV));
        // As a device without disassociate support (rxe), it cannot come back while objects
        // made on it are open.
        let open = w.env.fabric.objects_on(&w.t.dev);
        assert!(open > 0);
        assert!(
            w.env.fabric.restore_device(&w.t.dev).is_err(),
            "{open} open"
        );
        let World {
            env,
            t,
            h,
            tid,
            hid,
            _listener,
            ..
        } = w;
        assert_eq!(
            _listener.release_removed_device(),
            Ok(DeviceRelease::InUse(open))
        );
        let dev = t.dev.clone();
        drop((tid, hid, t, h));
        assert_eq!(env.fabric.objects_on(&dev), 0);
        assert_eq!(
            _listener.release_removed_device(),
            Ok(DeviceRelease::Released)
        );
        assert!(
            env.fabric.restore_device(&dev).is_err(),
            "an ID still listens on it"
        );
        drop(_listener);
        env.fabric.restore_device(&dev).unwrap();
        assert!(std::iter::from_fn(|| dev.next_event()).any(|e| e == AsyncEvent::PortActive(1)));
        assert!(dev.alloc_pd().is_ok());
    }

    #[test]
    fn a_removed_devices_listener_hears_of_it_and_listens_again_once_it_returns() {
        // Over TCP, as the daemon listens: the acceptor's port must be free again.
        let f = Fabric::networked();
        let ip: std::net::IpAddr = "127.0.0.1".parse().unwrap();
        let dev = f.add_device(ip).unwrap();
        let addr = SocketAddr::new(ip, 21990);
        let ch = nvmfd_rdma::soft::cm::CmChannel::new(&f).unwrap();
        let l = ch.listen(addr, 8).unwrap();
        f.remove_device(&dev);
        match ch.next_event() {
            Some(nvmfd_rdma::soft::cm::CmEvent::DeviceRemoval { id }) => {
                assert_eq!(id, l.token(), "the listening ID hears of it")
            }
            other => panic!("{other:?}"),
        }
        drop(l);
        let e = ch.listen(addr, 8).unwrap_err();
        assert_eq!(e.errno(), Some(libc::ENODEV), "{e}");
        f.restore_device(&dev).unwrap();
        let l = ch.listen(addr, 8).unwrap();
        // A host in another fabric reaches the new listener on the same port.
        let g = Fabric::networked();
        let gd = g.add_device("127.0.0.2".parse().unwrap()).unwrap();
        let pd = gd.alloc_pd().unwrap();
        let cq = gd.create_cq(16).unwrap();
        let srq = pd.create_srq(16, 1).unwrap();
        let gch = nvmfd_rdma::soft::cm::CmChannel::new(&g).unwrap();
        let mut c = gch.resolve(addr, Duration::from_secs(3)).unwrap();
        c.create_qp(&pd, &cq, &srq, CAPS).unwrap();
        c.connect(&[7; 32]).unwrap();
        wait("the new listener's CONNECT_REQUEST", || {
            match ch.next_event() {
                Some(nvmfd_rdma::soft::cm::CmEvent::ConnectRequest { .. }) => Some(()),
                Some(other) => panic!("{other:?}"),
                None => None,
            }
        });
        drop(l);
    }

    /// The failed work requests of a run with drops, for `seed`.
    fn dropped_with(seed: u64) -> Vec<u64> {
        let w = world(5013, 8).unwrap();
        w.env.fabric.set_faults(Faults {
            seed,
            drop_per_million: 100_000,
            ..Faults::default()
        });
        let sge = [w.t.mr.sge(0, 8)];
        let mut failed = Vec::new();
        for (q, t) in w.tid.iter().enumerate() {
            for i in 0..8u64 {
                let id = q as u64 * 100 + i;
                let wr = SendWr {
                    wr_id: id,
                    op: SendOp::RdmaWrite {
                        remote_addr: w.h.mr.addr(),
                        rkey: w.h.mr.rkey(),
                    },
                    sges: &sge,
                    signaled: true,
                    inline: None,
                };
                t.post_send(&[wr]).unwrap();
                let wc = poll_one(&w.t.cq);
                if wc.status != WcStatus::Success {
                    failed.push(wc.wr_id);
                }
            }
        }
        failed
    }

    #[test]
    fn delayed_packets_arrive_later_and_in_order() {
        let w = world(5014, 1).unwrap();
        w.env.fabric.set_faults(Faults {
            seed: 42,
            delay_per_million: 300_000,
            ..Faults::default()
        });
        let remote = || {
            let mut v = [0u8; 8];
            w.h.mr.read(0, &mut v);
            u64::from_le_bytes(v)
        };
        let mut held_up = 0;
        for i in 1..=64u64 {
            // Inline: the value is captured at post time, as the wire has it.
            let v = i.to_le_bytes();
            let wr = SendWr {
                wr_id: i,
                op: SendOp::RdmaWrite {
                    remote_addr: w.h.mr.addr(),
                    rkey: w.h.mr.rkey(),
                },
                sges: &[],
                signaled: true,
                inline: Some(&v),
            };
            w.tid[0].post_send(&[wr]).unwrap();
            if remote() != i {
                held_up += 1; // on the wire still: it lands at the fabric's next operation
            }
            let wc = poll_one(&w.t.cq);
            assert_eq!((wc.wr_id, wc.status), (i, WcStatus::Success));
            assert_eq!(remote(), i, "landed, in order");
        }
        assert!(held_up > 0, "30% delays held nothing up");
    }

    #[test]
    fn seeded_packet_drops_replay_exactly() {
        let a = dropped_with(42);
        assert!(!a.is_empty(), "10% drops over 64 requests dropped nothing");
        assert_eq!(a, dropped_with(42), "the same seed replays the same faults");
        assert_ne!(a, dropped_with(7), "another seed gives other faults");
    }

    #[test]
    fn garbage_on_the_tcp_wire_is_dropped_and_others_still_connect() {
        use std::io::Write;
        let env = SoftTcpEnv::new().unwrap();
        let addr = env.addr(5020);
        let sch = env.channel();
        let _l = sch.listen(addr, 4).unwrap();
        // A peer that speaks nonsense, then one that claims a 4 GiB frame.
        let mut junk = std::net::TcpStream::connect(addr).unwrap();
        junk.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        let mut huge = std::net::TcpStream::connect(addr).unwrap();
        huge.write_all(&u32::MAX.to_le_bytes()).unwrap();
        drop((junk, huge));
        // A real connection still works.
        let cch = env.channel();
        let mut c = cch.resolve(addr, Duration::from_secs(3)).unwrap();
        let h = on_soft_tcp::side(c.device().unwrap());
        c.create_qp(&h.pd, &h.cq, &h.srq, CAPS).unwrap();
        c.connect(b"hello").unwrap();
        let id = wait("CONNECT_REQUEST after garbage", || match sch.next_event() {
            Some(nvmfd_rdma::soft::cm::CmEvent::ConnectRequest {
                id, private_data, ..
            }) => Some((id, private_data)),
            _ => None,
        });
        assert_eq!(id.1, b"hello");
    }

    /// A frame of the soft TCP wire, as a peer of any kind may send it.
    fn tcp_frame(kind: u8, payload: &[u8]) -> Vec<u8> {
        let mut b = u32::try_from(payload.len() + 1)
            .unwrap()
            .to_le_bytes()
            .to_vec();
        b.push(kind);
        b.extend_from_slice(payload);
        b
    }

    /// A raw TCP peer connected and accepted by a listener of `env` on `port`: the target's
    /// CM ID (with a QP on `t`'s SRQ, which has no receive posted) and the peer's stream, its
    /// RTU sent.
    fn raw_tcp_peer(
        env: &SoftTcpEnv,
        port: u16,
    ) -> (
        nvmfd_rdma::soft::cm::CmChannel,
        nvmfd_rdma::soft::cm::CmId,
        on_soft_tcp::Side,
        nvmfd_rdma::soft::cm::CmId,
        std::net::TcpStream,
    ) {
        use std::io::Write;
        let addr = env.addr(port);
        let sch = env.channel();
        let l = sch.listen(addr, 4).unwrap();
        let t = on_soft_tcp::side(l.device().unwrap());
        let mut raw = std::net::TcpStream::connect(addr).unwrap();
        raw.write_all(&tcp_frame(1, b"raw")).unwrap();
        let mut id = wait("CONNECT_REQUEST", || match sch.next_event() {
            Some(nvmfd_rdma::soft::cm::CmEvent::ConnectRequest { id, .. }) => Some(id),
            _ => None,
        });
        id.create_qp(&t.pd, &t.cq, &t.srq, CAPS).unwrap();
        id.accept(b"").unwrap();
        raw.write_all(&tcp_frame(10, &[])).unwrap();
        wait("ESTABLISHED", || match sch.next_event() {
            Some(nvmfd_rdma::soft::cm::CmEvent::Established { .. }) => Some(()),
            _ => None,
        });
        (sch, l, t, id, raw)
    }

    #[test]
    fn a_tcp_peer_that_sends_nothing_holds_up_no_other_connect() {
        let env = SoftTcpEnv::new().unwrap();
        let addr = env.addr(5049);
        let sch = env.channel();
        let _l = sch.listen(addr, 4).unwrap();
        // Connected, and silent (or a first frame's length and no more), kept open.
        let _silent = std::net::TcpStream::connect(addr).unwrap();
        let mut partial = std::net::TcpStream::connect(addr).unwrap();
        std::io::Write::write_all(&mut partial, &16u32.to_le_bytes()).unwrap();
        let cch = env.channel();
        let mut c = cch.resolve(addr, Duration::from_secs(3)).unwrap();
        let h = on_soft_tcp::side(c.device().unwrap());
        c.create_qp(&h.pd, &h.cq, &h.srq, CAPS).unwrap();
        c.connect(b"hello").unwrap();
        let pd = wait("CONNECT_REQUEST beside silent peers", || {
            match sch.next_event() {
                Some(nvmfd_rdma::soft::cm::CmEvent::ConnectRequest { private_data, .. }) => {
                    Some(private_data)
                }
                _ => None,
            }
        });
        assert_eq!(pd, b"hello");
    }

    /// A peer that sends its connect request a byte now and then (each read's timeout never
    /// runs out) is closed once the handshake's time is up; one that announces a connect
    /// request longer than any is closed at once.
    #[test]
    fn a_tcp_peer_trickling_its_connect_request_is_let_go() {
        use std::io::{Read, Write};
        let env = SoftTcpEnv::new().unwrap();
        let addr = env.addr(5053);
        let sch = env.channel();
        let _l = sch.listen(addr, 4).unwrap();
        let mut huge = std::net::TcpStream::connect(addr).unwrap();
        huge.write_all(&(1u32 << 20).to_le_bytes()).unwrap();
        huge.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let got = huge.read(&mut [0u8; 1]);
        assert!(
            matches!(got, Ok(0))
                || got
                    .as_ref()
                    .is_err_and(|e| e.kind() != std::io::ErrorKind::WouldBlock),
            "a 1 MiB connect request waited for: {got:?}"
        );
        let raw = std::net::TcpStream::connect(addr).unwrap();
        let mut w = raw.try_clone().unwrap();
        let start = std::time::Instant::now();
        let trickle = std::thread::spawn(move || {
            let _ = w.write_all(&64u32.to_le_bytes());
            for _ in 0..30 {
                if w.write_all(&[1]).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_secs(1));
            }
        });
        let mut r = raw;
        r.set_read_timeout(Some(Duration::from_secs(25))).unwrap();
        let got = r.read(&mut [0u8; 1]);
        assert!(
            matches!(got, Ok(0))
                || got
                    .as_ref()
                    .is_err_and(|e| e.kind() != std::io::ErrorKind::WouldBlock),
            "still open after {:?}: {got:?}",
            start.elapsed()
        );
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "{:?}",
            start.elapsed()
        );
        drop(r);
        trickle.join().unwrap();
    }

    #[test]
    fn a_rejected_tcp_peer_that_keeps_its_socket_open_is_let_go() {
        use std::io::{Read, Write};
        let env = SoftTcpEnv::new().unwrap();
        let addr = env.addr(5050);
        let sch = env.channel();
        let _l = sch.listen(addr, 4).unwrap();
        let mut raw = std::net::TcpStream::connect(addr).unwrap();
        raw.write_all(&tcp_frame(1, b"raw")).unwrap();
        let id = wait("CONNECT_REQUEST", || match sch.next_event() {
            Some(nvmfd_rdma::soft::cm::CmEvent::ConnectRequest { id, .. }) => Some(id),
            _ => None,
        });
        assert_eq!(env.a.tcp_links() + env.b.tcp_links(), 1);
        id.reject(b"no").unwrap();
        // The peer reads the REJ and keeps its end open: the link (its threads, its socket)
        // goes anyway.
        let mut got = Vec::new();
        raw.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        raw.read_to_end(&mut got).unwrap();
        assert_eq!(
            got,
            tcp_frame(3, b"no"),
            "the REJ, then the end of the stream"
        );
        wait("the link let go", || {
            (env.a.tcp_links() + env.b.tcp_links() == 0).then_some(())
        });
        drop(raw);
    }

    #[test]
    fn sends_piling_up_at_a_qp_without_receives_fail_it_past_a_bound() {
        use std::io::Write;
        let env = SoftTcpEnv::new().unwrap();
        let (_sch, _l, t, id, mut raw) = raw_tcp_peer(&env, 5051);
        // SENDs for a QP whose SRQ has no receive: they wait, up to a bound, and then the QP
        // fails as if the sender's RNR retries ran out.
        let mut frames = Vec::new();
        for seq in 0u64..5000 {
            let mut p = seq.to_le_bytes().to_vec();
            p.extend_from_slice(&[0, 0, 0, 0, 0]);
            p.extend_from_slice(&[7u8; 64]);
            frames.extend_from_slice(&tcp_frame(5, &p));
        }
        raw.write_all(&frames).unwrap();
        wait("the QP in error", || {
            (id.qp_state() == Some(QpState::Err)).then_some(())
        });
        let (_, waiting) = env
            .a
            .srq_backlog(t.srq.id())
            .or_else(|| env.b.srq_backlog(t.srq.id()))
            .unwrap();
        assert!(waiting <= 4096, "{waiting} SENDs kept");
    }

    #[test]
    fn a_tcp_peer_that_reads_nothing_is_let_go() {
        use std::io::Write;
        let env = SoftTcpEnv::new().unwrap();
        let (_sch, _l, _t, _id, mut raw) = raw_tcp_peer(&env, 5052);
        // RDMA WRITEs to no memory: each is answered (an access error), and the peer never
        // reads the answers. The target stops queueing them and closes the link.
        let mut p = 0u64.to_le_bytes().to_vec();
        p.extend_from_slice(&[0; 12]);
        let batch: Vec<u8> = (0..4096).flat_map(|_| tcp_frame(6, &p)).collect();
        raw.set_write_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut sent = 0usize;
        let closed = loop {
            if raw.write_all(&batch).is_err() {
                break true;
            }
            sent += batch.len();
            if sent > 256 << 20 {
                break false;
            }
        };
        assert!(closed, "{sent} bytes taken in and never pushed back");
        wait("the link let go", || {
            (env.a.tcp_links() + env.b.tcp_links() == 0).then_some(())
        });
    }

    #[test]
    fn a_peer_that_goes_away_fails_the_qp_and_is_a_disconnect() {
        let w = on_soft_tcp::world(5021, 1).unwrap();
        // The host side goes away: its CM IDs and QPs are dropped.
        drop(w.hid);
        wait("DISCONNECTED after the peer vanished", || {
            match w.sch.next_event() {
                Some(nvmfd_rdma::soft::cm::CmEvent::Disconnected { .. }) => Some(()),
                _ => None,
            }
        });
        assert_eq!(w.tid[0].qp_state(), Some(QpState::Err));
    }

    #[test]
    fn a_host_that_vanishes_before_the_accept_leaves_the_rep_unanswered() {
        let env = SoftEnv::new().unwrap();
        let p = on_soft::pending(&env, 5022);
        p.c.vanish();
        // Nothing was sent: the request is accepted, and the REP's retries run out.
        p.s.accept(b"").unwrap();
        assert!(matches!(
            p.sch.next_event(),
            Some(nvmfd_rdma::soft::cm::CmEvent::Unreachable { id }) if id == p.s.token()
        ));
        assert_eq!(p.s.qp_state(), Some(QpState::Rts));
        p.s.disconnect().unwrap();
        assert_eq!(
            p.s.qp_state(),
            Some(QpState::Err),
            "rdma_disconnect moves it"
        );
        assert!(p.sch.next_event().is_none());
    }

    #[test]
    fn a_host_that_vanishes_after_the_accept_is_unreachable() {
        let env = SoftEnv::new().unwrap();
        let p = on_soft::pending(&env, 5023);
        p.s.accept(b"").unwrap();
        assert!(
            p.sch.next_event().is_none(),
            "no ESTABLISHED before the RTU"
        );
        p.c.vanish();
        assert!(matches!(
            p.sch.next_event(),
            Some(nvmfd_rdma::soft::cm::CmEvent::Unreachable { id }) if id == p.s.token()
        ));
    }

    #[test]
    fn a_host_that_vanishes_once_established_is_not_heard_of() {
        let w = world(5024, 1).unwrap();
        let mut hid = w.hid;
        hid.pop().unwrap().vanish();
        assert!(w.sch.next_event().is_none());
        assert_eq!(w.tid[0].qp_state(), Some(QpState::Rts));
    }

    #[test]
    fn a_rej_before_the_accept_is_not_reported_and_the_accept_fails() {
        let env = SoftEnv::new().unwrap();
        // The host goes away before the request is taken, and after.
        for (port, taken_first) in [(5025, false), (5029, true)] {
            let addr = env.addr(port);
            let sch = env.channel();
            let l = sch.listen(addr, 4).unwrap();
            let t = on_soft::side(l.device().unwrap());
            let cch = env.channel();
            let mut c = cch.resolve(addr, Duration::from_secs(1)).unwrap();
            let h = on_soft::side(c.device().unwrap());
            c.create_qp(&h.pd, &h.cq, &h.srq, CAPS).unwrap();
            c.connect(b"").unwrap();
            let take = || match sch.next_event() {
                Some(nvmfd_rdma::soft::cm::CmEvent::ConnectRequest { id, .. }) => id,
                other => panic!("{other:?}"),
            };
            let mut s = if taken_first {
                let s = take();
                drop(c);
                s
            } else {
                drop(c);
                take()
            };
            assert!(
                sch.next_event().is_none(),
                "the kernel's ucma drops the REJECTED"
            );
            s.create_qp(&t.pd, &t.cq, &t.srq, CAPS).unwrap();
            assert_eq!(
                s.accept(b"").unwrap_err().errno(),
                Some(libc::EINVAL),
                "the IB CM refuses a REP once the REJ came"
            );
            assert!(sch.next_event().is_none());
        }
    }

    #[test]
    fn an_rtu_that_cannot_bring_the_qp_to_rts_is_a_connect_error() {
        let env = SoftEnv::new().unwrap();
        env.fabric.fail_establishments(1);
        let p = on_soft::pending(&env, 5026);
        p.s.accept(b"").unwrap();
        // The host takes its ESTABLISHED: the RTU goes out.
        assert!(matches!(
            p.cch.next_event(),
            Some(nvmfd_rdma::soft::cm::CmEvent::Established { .. })
        ));
        assert!(matches!(
            p.sch.next_event(),
            Some(nvmfd_rdma::soft::cm::CmEvent::ConnectError { id }) if id == p.s.token()
        ));
        assert_eq!(p.s.qp_state(), Some(QpState::Err));
        // The exchange itself completed: the connection ends with a disconnect.
        p.s.disconnect().unwrap();
        assert!(matches!(
            p.cch.next_event(),
            Some(nvmfd_rdma::soft::cm::CmEvent::Disconnected { .. })
        ));
        // Only the first one failed.
        let q = on_soft::pending(&env, 5027);
        q.s.accept(b"").unwrap();
        assert!(matches!(
            q.cch.next_event(),
            Some(nvmfd_rdma::soft::cm::CmEvent::Established { .. })
        ));
        assert!(matches!(
            q.sch.next_event(),
            Some(nvmfd_rdma::soft::cm::CmEvent::Established { .. })
        ));
        assert_eq!(q.s.qp_state(), Some(QpState::Rts));
    }

    /// An RTU that never arrives (nor its resends): the accepting side, its QP in RTS, takes
    /// the host's first message and its device raises COMM_EST; `rdma_notify` then
    /// establishes it (EISCONN a second time). One not notified hears UNREACHABLE when its
    /// REP's retries run out.
    #[test]
    fn a_lost_rtu_is_made_up_for_by_comm_est_and_rdma_notify() {
        use nvmfd_rdma::soft::cm::CmEvent;
        let env = SoftEnv::new().unwrap();
        env.fabric.lose_rtus(1);
        let p = on_soft::pending(&env, 5047);
        p.s.accept(b"").unwrap();
        assert!(matches!(
            p.cch.next_event(),
            Some(CmEvent::Established { .. })
        ));
        assert!(p.sch.next_event().is_none(), "the RTU was lost");
        assert_eq!(p.s.qp_state(), Some(QpState::Rts));
        assert_eq!(p.t.dev.next_event(), None);
        let rsge = [p.t.mr.sge(0, 64)];
        p.t.srq
            .post_recv(&[RecvWr {
                wr_id: 9,
                sges: &rsge,
            }])
            .unwrap();
        p.h.mr.write(0, b"first command");
        p.c.post_send(&[send(1, &[p.h.mr.sge(0, 13)], true)])
            .unwrap();
        assert_eq!(on_soft::poll_one(&p.h.cq).status, WcStatus::Success);
        assert_eq!(on_soft::poll_one(&p.t.cq).wr_id, 9);
        let qpn = p.s.qpn().unwrap();
        assert_eq!(p.t.dev.next_event(), Some(AsyncEvent::CommEst(qpn)));
        assert!(
            p.sch.next_event().is_none(),
            "the CM waits until it is told"
        );
        p.s.notify_established().unwrap();
        assert!(matches!(
            p.sch.next_event(),
            Some(CmEvent::Established { id, .. }) if id == p.s.token()
        ));
        assert_eq!(
            p.s.notify_established().unwrap_err().errno(),
            Some(libc::EISCONN)
        );
        assert_eq!(env.fabric.expire_rep_timeouts(), 0);
        // Not told: the REP's retries run out.
        env.fabric.lose_rtus(1);
        let q = on_soft::pending(&env, 5048);
        q.s.accept(b"").unwrap();
        assert!(matches!(
            q.cch.next_event(),
            Some(CmEvent::Established { .. })
        ));
        assert!(q.sch.next_event().is_none());
        assert_eq!(env.fabric.expire_rep_timeouts(), 1);
        assert!(matches!(
            q.sch.next_event(),
            Some(CmEvent::Unreachable { id }) if id == q.s.token()
        ));
    }

    #[test]
    fn a_host_process_gone_during_the_exchange_is_rejected() {
        let env = SoftTcpEnv::new().unwrap();
        let p = on_soft_tcp::pending(&env, 5028);
        p.s.accept(b"").unwrap();
        // Its stream closes without a frame, as when the process dies.
        p.c.vanish();
        let ev = wait("REJECTED after the host process went", || {
            p.sch.next_event()
        });
        assert!(
            matches!(ev, nvmfd_rdma::soft::cm::CmEvent::Rejected { id, .. } if id == p.s.token()),
            "{ev:?}"
        );
        assert_eq!(p.s.qp_state(), Some(QpState::Err));
    }

    #[test]
    fn connecting_where_nobody_listens_is_unreachable() {
        let f = Fabric::new();
        f.add_device("10.0.0.1".parse().unwrap()).unwrap();
        let ch = nvmfd_rdma::soft::cm::CmChannel::new(&f).unwrap();
        let mut c = ch
            .resolve("10.0.0.1:9".parse().unwrap(), Duration::from_secs(1))
            .unwrap();
        let s = on_soft::side(c.device().unwrap());
        c.create_qp(&s.pd, &s.cq, &s.srq, CAPS).unwrap();
        c.connect(b"").unwrap();
        assert!(matches!(
            ch.next_event(),
            Some(nvmfd_rdma::soft::cm::CmEvent::Unreachable { .. })
        ));
    }

    #[test]
    fn send_with_invalidate_invalidates_the_peer_key() {
        let w = world(5003, 1).unwrap();
        let host_buf = w.h.pd.alloc_mr(4096, RW).unwrap();
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
            inline: None,
        };
        w.tid[0].post_send(&[wr]).unwrap();
        assert_eq!(poll_one(&w.h.cq).invalidated_rkey, Some(host_buf.rkey()));
        assert!(!host_buf.is_valid());
        poll_one(&w.t.cq);
        let wr = SendWr {
            wr_id: 2,
            op: SendOp::RdmaWrite {
                remote_addr: host_buf.addr(),
                rkey: host_buf.rkey(),
            },
            sges: &[w.t.mr.sge(0, 16)],
            signaled: true,
            inline: None,
        };
        w.tid[0].post_send(&[wr]).unwrap();
        assert_eq!(
            poll_one(&w.t.cq).status,
            WcStatus::RemAccessErr,
            "an invalidated key no longer works"
        );
    }

    #[test]
    fn a_cq_overflow_is_reported_as_on_hardware() {
        let w = world(5004, 1).unwrap();
        let small = w.t.dev.create_cq(2).unwrap();
        let srq = w.t.pd.create_srq(4, 1).unwrap();
        let ch = w.env.channel();
        let mut c = ch
            .resolve(w.env.addr(5004), Duration::from_secs(1))
            .unwrap();
        c.create_qp(&w.t.pd, &small, &srq, CAPS).unwrap();
        c.connect(b"").unwrap();
        let Some(nvmfd_rdma::soft::cm::CmEvent::ConnectRequest { id: mut s, .. }) =
            w.sch.next_event()
        else {
            panic!()
        };
        s.create_qp(&w.h.pd, &w.h.cq, &w.h.srq, CAPS).unwrap();
        s.accept(b"").unwrap();
        let sge = [w.t.mr.sge(0, 8)];
        let write = |i| SendWr {
            wr_id: i,
            op: SendOp::RdmaWrite {
                remote_addr: w.h.mr.addr(),
                rkey: w.h.mr.rkey(),
            },
            sges: &sge,
            signaled: true,
            inline: None,
        };
        c.post_send(&[write(1), write(2), write(3)]).unwrap();
        assert_eq!(w.t.dev.next_event(), Some(AsyncEvent::CqErr(small.id())));
        let mut out = [Wc::default(); 4];
        assert_eq!(
            small.poll(&mut out).unwrap_err().errno(),
            Some(libc::EOVERFLOW)
        );
    }

    #[test]
    fn objects_check_their_limits_and_protection_domains() {
        let w = world(5005, 1).unwrap();
        assert!(w.t.dev.create_cq(0).is_err());
        assert!(w.t.pd.create_srq(0, 1).is_err());
        assert!(
            w.t.pd.create_srq(16, 28).is_err(),
            "max_srq_sge is 27, as on rxe"
        );
        let too_many = [w.t.mr.sge(0, 1); 5];
        assert_eq!(
            w.t.srq
                .post_recv(&[RecvWr {
                    wr_id: 0,
                    sges: &too_many
                }])
                .unwrap_err()
                .errno(),
            Some(libc::EINVAL)
        );
        let one = [w.t.mr.sge(0, 1)];
        let wrs: Vec<RecvWr<'_>> = (0..65)
            .map(|i| RecvWr {
                wr_id: i,
                sges: &one,
            })
            .collect();
        assert_eq!(
            w.t.srq.post_recv(&wrs).unwrap_err().errno(),
            Some(libc::ENOMEM),
            "more than max_wr"
        );
        let other_pd = w.t.dev.alloc_pd().unwrap();
        let ch = w.env.channel();
        let mut c = ch
            .resolve(w.env.addr(5005), Duration::from_secs(1))
            .unwrap();
        assert!(
            c.create_qp(&other_pd, &w.t.cq, &w.t.srq, CAPS).is_err(),
            "an SRQ of another PD"
        );
        let fresh = ch
            .resolve(w.env.addr(5005), Duration::from_secs(1))
            .unwrap();
        assert!(
            fresh.post_send(&[send(1, &one, true)]).is_err(),
            "no QP yet"
        );
    }

    /// A peer over TCP that answers an RDMA READ with an acknowledgement alone, or with data
    /// one byte short, fails the read (and its QP): the buffer is not reported filled with
    /// data that never came.
    #[test]
    fn a_read_answered_without_all_of_its_data_fails() {
        use nvmfd_rdma::soft::ReadAnswer;
        for (port, answer) in [(5039, ReadAnswer::AckOnly), (5040, ReadAnswer::Short)] {
            let w = on_soft_tcp::world(port, 1).unwrap();
            // The target (fabric A) reads from the host (fabric B), which answers badly.
            w.env.b.set_faults(Faults {
                read_answer: answer,
                ..Faults::default()
            });
            w.h.mr.write(0, &[0x11; 512]);
            w.t.mr.write(4096, &[0xdb; 512]);
            let rd = SendWr {
                wr_id: 9,
                op: SendOp::RdmaRead {
                    remote_addr: w.h.mr.addr(),
                    rkey: w.h.mr.rkey(),
                },
                sges: &[w.t.mr.sge(4096, 512)],
                signaled: true,
                inline: None,
            };
            w.tid[0].post_send(&[rd]).unwrap();
            let wc = on_soft_tcp::poll_one(&w.t.cq);
            assert_eq!((wc.wr_id, wc.status), (9, WcStatus::RemOpErr), "{answer:?}");
            let mut got = [0u8; 512];
            w.t.mr.read(4096, &mut got);
            assert!(
                got.iter().all(|&b| b == 0xdb),
                "{answer:?}: the buffer changed"
            );
            assert_eq!(w.tid[0].qp_state(), Some(QpState::Err), "{answer:?}");
        }
    }

    /// SEND with Invalidate naming a key the receiver gave out for local use only (a
    /// target's data buffers) fails, and the region stays usable, as on a NIC.
    #[test]
    fn send_with_invalidate_of_a_local_only_key_fails_and_leaves_the_region_valid() {
        let w = world(5041, 1).unwrap();
        let local = w.t.pd.alloc_mr(8192, Access::LOCAL_WRITE).unwrap();
        w.t.srq
            .post_recv(&[RecvWr {
                wr_id: 7,
                sges: &[w.t.mr.sge(0, 64)],
            }])
            .unwrap();
        w.hid[0]
            .post_send(&[SendWr {
                wr_id: 1,
                op: SendOp::SendWithInvalidate { rkey: local.rkey() },
                sges: &[w.h.mr.sge(0, 16)],
                signaled: true,
                inline: None,
            }])
            .unwrap();
        assert_eq!(poll_one(&w.h.cq).status, WcStatus::RemInvReqErr);
        assert!(
            w.env
                .fabric
                .memory_regions()
                .iter()
                .any(|&(k, _, _)| k == local.rkey()),
            "the region is still registered"
        );
    }

    /// A work request that fails comes after the QP's earlier work: completions come in
    /// posting order, as on a NIC. Behind a SEND waiting for a receive at the peer, it waits
    /// (`work_behind_a_send_waiting_for_a_receive_waits_with_it`), and fails once the SEND
    /// has landed (it ran past the SEND, and its error came first).
    #[test]
    fn a_failed_post_completes_after_the_earlier_work() {
        let w = world(5043, 1).unwrap();
        write_behind_a_waiting_send(
            &w,
            |w: &World| {
                w.env.fabric.set_faults(Faults {
                    drop_per_million: 1_000_000,
                    ..Faults::default()
                })
            },
            0,
            WcStatus::RetryExcErr,
        );
    }

    /// As above, a request refused by the peer (a bad rkey) as it runs on the wire comes
    /// after the SEND it waited behind. Its error completion came first.
    #[test]
    fn a_request_the_peer_refuses_completes_after_the_earlier_work() {
        let w = world(5044, 1).unwrap();
        write_behind_a_waiting_send(&w, |_: &World| {}, 0x5a5a, WcStatus::RemAccessErr);
    }

    /// A SEND from the host that waits for a receive at the target (none posted: RNR retry
    /// 7), then `between`, then an RDMA WRITE to the target's region (its key changed by
    /// `rkey_xor`): nothing completes until a receive is posted, then the SEND and after it
    /// the WRITE, with `write_status`.
    fn write_behind_a_waiting_send(
        w: &World,
        between: impl Fn(&World),
        rkey_xor: u32,
        write_status: WcStatus,
    ) {
        w.hid[0]
            .post_send(&[send(1, &[w.h.mr.sge(0, 64)], true)])
            .unwrap();
        between(w);
        w.hid[0]
            .post_send(&[SendWr {
                wr_id: 2,
                op: SendOp::RdmaWrite {
                    remote_addr: w.t.mr.addr(),
                    rkey: w.t.mr.rkey() ^ rkey_xor,
                },
                sges: &[w.h.mr.sge(0, 64)],
                signaled: true,
                inline: None,
            }])
            .unwrap();
        let mut wc = [Wc::default(); 2];
        assert_eq!(w.h.cq.poll(&mut wc).unwrap(), 0, "{wc:?}");
        post_target_receive(w);
        let first = poll_one(&w.h.cq);
        let second = poll_one(&w.h.cq);
        assert_eq!(
            [(first.wr_id, first.status), (second.wr_id, second.status)],
            [(1, WcStatus::Success), (2, write_status)]
        );
    }
}

/// Only the ibverbs provider: device handles taken from librdmacm's IDs hold an ID, which keeps
/// librdmacm's context open.
#[cfg(feature = "ibverbs")]
mod ibverbs_only {
    use super::*;

    /// Two listeners on one device; the handle the daemon watches (the first listener's
    /// device) takes the second's ID when it is added, and the first's back when the second
    /// goes: the second's ID is then destroyed, and its port can be listened on again. The
    /// ID to hold was taken from the other listener's device handle before, which was the
    /// watched handle itself, still holding the second's ID: it kept listening for good.
    #[test]
    fn a_device_holding_a_removed_listeners_id_lets_it_go() {
        let Some(env) = VerbsEnv::new() else { return };
        let ch = env.channel();
        let (a1, a2) = (env.addr(24001), env.addr(24002));
        let id1 = ch.listen(a1, 4).unwrap();
        let id2 = ch.listen(a2, 4).unwrap();
        let watched = id1.device().unwrap();
        let d2 = id2.device().unwrap();
        let pd = watched.alloc_pd().unwrap();
        watched.hold_id(&id2);
        // The second listener goes.
        watched.hold_id(&id1);
        d2.hold_id(&id1);
        drop((id2, d2));
        let again = ch
            .listen(a2, 4)
            .expect("the removed listener's port is free again");
        // The device and what was made on it live on.
        let cq = watched.create_cq(16).expect("the device still serves");
        drop((again, cq, pd, watched, id1));
    }
}
