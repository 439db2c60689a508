//! The soft provider's TCP wire between two processes: this test and `examples/soft-peer`.

// Sizes and counters in this file are small and known: casts cannot truncate.
#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nvmfd_rdma::soft::cm::CmChannel;
use nvmfd_rdma::soft::Fabric;
use nvmfd_rdma::*;

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

#[test]
fn a_host_in_one_process_uses_rdma_on_a_peer_in_another() {
    let peer = env!("CARGO_BIN_EXE_soft-peer");
    let port = 26000 + (std::process::id() % 1000) as u16;
    let mut child = Command::new(peer)
        .arg(port.to_string())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), format!("listening {port}"));

    let fabric = Fabric::networked();
    fabric.add_device("127.0.0.2".parse().unwrap()).unwrap();
    let ch = CmChannel::new(&fabric).unwrap();
    let mut c = ch
        .resolve(
            format!("127.0.0.1:{port}").parse().unwrap(),
            Duration::from_secs(3),
        )
        .unwrap();
    let dev = c.device().unwrap();
    let pd = dev.alloc_pd().unwrap();
    let cq = dev.create_cq(64).unwrap();
    let srq = pd.create_srq(16, 1).unwrap();
    let mr = pd.alloc_mr(64 * 1024, Access::LOCAL_WRITE).unwrap();
    c.create_qp(
        &pd,
        &cq,
        &srq,
        QpCaps {
            max_send_wr: 32,
            max_send_sge: 1,
            max_recv_wr: 0,
            max_inline_data: 64,
        },
    )
    .unwrap();
    c.connect(b"hello from another process").unwrap();
    let pdata = wait("ESTABLISHED", || match ch.next_event() {
        Some(CmEvent::Established { private_data, .. }) => Some(private_data),
        Some(other) => panic!("{other:?}"),
        None => None,
    });
    let raddr = u64::from_le_bytes(pdata[..8].try_into().unwrap());
    let rkey = u32::from_le_bytes(pdata[8..12].try_into().unwrap());
    let poll_one = || {
        wait("a completion", || {
            let mut w = [Wc::default(); 1];
            (cq.poll(&mut w).unwrap() == 1).then_some(w[0])
        })
    };

    // RDMA WRITE into the other process, then READ it back.
    let data: Vec<u8> = (0..8192).map(|i| (i * 7 % 251) as u8).collect();
    mr.write(0, &data);
    let wr = SendWr {
        wr_id: 1,
        op: SendOp::RdmaWrite {
            remote_addr: raddr + 4096,
            rkey,
        },
        sges: &[mr.sge(0, 8192)],
        signaled: true,
        inline: None,
    };
    c.post_send(&[wr]).unwrap();
    assert_eq!(poll_one().status, WcStatus::Success);
    let rd = SendWr {
        wr_id: 2,
        op: SendOp::RdmaRead {
            remote_addr: raddr + 4096,
            rkey,
        },
        sges: &[mr.sge(16384, 8192)],
        signaled: true,
        inline: None,
    };
    c.post_send(&[rd]).unwrap();
    let wc = poll_one();
    assert_eq!((wc.wr_id, wc.status), (2, WcStatus::Success));
    let mut back = vec![0u8; 8192];
    mr.read(16384, &mut back);
    assert!(
        back == data,
        "READ returned what WRITE put in the other process"
    );

    // A bad rkey is refused by the other process: remote access error.
    let bad = SendWr {
        wr_id: 3,
        op: SendOp::RdmaRead {
            remote_addr: raddr,
            rkey: rkey ^ 1,
        },
        sges: &[mr.sge(0, 64)],
        signaled: true,
        inline: None,
    };
    // SEND, and the echo comes back into our receive.
    srq.post_recv(&[RecvWr {
        wr_id: 9,
        sges: &[mr.sge(32768, 4096)],
    }])
    .unwrap();
    mr.write(40960, b"ping across processes");
    c.post_send(&[SendWr {
        wr_id: 4,
        op: SendOp::Send,
        sges: &[mr.sge(40960, 21)],
        signaled: true,
        inline: None,
    }])
    .unwrap();
    let mut got = [poll_one(), poll_one()];
    got.sort_by_key(|w| w.wr_id);
    assert_eq!((got[0].wr_id, got[0].status), (4, WcStatus::Success));
    assert_eq!(
        (got[1].wr_id, got[1].status, got[1].byte_len),
        (9, WcStatus::Success, 21)
    );
    let mut echo = [0u8; 21];
    mr.read(32768, &mut echo);
    assert_eq!(&echo, b"ping across processes");
    c.post_send(&[bad]).unwrap();
    assert_eq!(poll_one().status, WcStatus::RemAccessErr);

    // Disconnect: the other process sees it and exits cleanly.
    c.disconnect().unwrap();
    line.clear();
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "disconnected");
    assert!(child.wait().unwrap().success());
}
