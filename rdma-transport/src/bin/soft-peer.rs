//! A soft-provider peer in its own process, for the cross-process test of the TCP wire: it
//! listens on 127.0.0.1:PORT, accepts one connection (its accept private data carries the
//! address and rkey of a 64 KiB region the peer may RDMA WRITE and READ), echoes every SEND
//! it receives back as a SEND, and exits 0 when the peer disconnects.
//!
//!     soft-peer PORT

// Counters here are small and known: casts cannot truncate.
#![allow(clippy::cast_possible_truncation)]

use std::time::{Duration, Instant};

use nvmfd_rdma::soft::cm::CmChannel;
use nvmfd_rdma::soft::Fabric;
use nvmfd_rdma::*;

/// A soft-provider peer for the cross-process test of the TCP wire: accepts one connection on
/// 127.0.0.1:PORT and echoes its SENDs until it disconnects.
#[derive(clap::Parser, Debug)]
#[command(version)]
struct Cli {
    /// The port to listen on.
    port: u16,
}

fn main() {
    let port = <Cli as clap::Parser>::parse().port;
    let fabric = Fabric::networked();
    fabric.add_device("127.0.0.1".parse().unwrap()).unwrap();
    let ch = CmChannel::new(&fabric).unwrap();
    let listener = ch
        .listen(format!("127.0.0.1:{port}").parse().unwrap(), 1)
        .unwrap();
    let dev = listener.device().unwrap();
    let pd = dev.alloc_pd().unwrap();
    let cq = dev.create_cq(256).unwrap();
    let srq = pd.create_srq(64, 1).unwrap();
    let rw = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
    let shared = pd.alloc_mr(64 * 1024, rw).unwrap();
    let bufs = pd.alloc_mr(64 * 4096, Access::LOCAL_WRITE).unwrap();
    let slots: Vec<[Sge; 1]> = (0..64).map(|i| [bufs.sge(i * 4096, 4096)]).collect();
    let wrs: Vec<RecvWr<'_>> = slots
        .iter()
        .enumerate()
        .map(|(i, s)| RecvWr {
            wr_id: i as u64,
            sges: s,
        })
        .collect();
    srq.post_recv(&wrs).unwrap();
    println!("listening {port}");
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut id = None;
    let mut wc = [Wc::default(); 16];
    loop {
        assert!(
            Instant::now() < deadline,
            "soft-peer: no disconnect within 30 s"
        );
        match ch.next_event() {
            Some(CmEvent::ConnectRequest { id: mut c, .. }) => {
                c.create_qp(
                    &pd,
                    &cq,
                    &srq,
                    QpCaps {
                        max_send_wr: 64,
                        max_send_sge: 1,
                        max_recv_wr: 0,
                        max_inline_data: 64,
                    },
                )
                .unwrap();
                let mut pdata = shared.addr().to_le_bytes().to_vec();
                pdata.extend_from_slice(&shared.rkey().to_le_bytes());
                c.accept(&pdata).unwrap();
                id = Some(c);
            }
            Some(CmEvent::Disconnected { .. }) => {
                println!("disconnected");
                return;
            }
            _ => {}
        }
        let n = cq.poll(&mut wc).unwrap();
        for c in &wc[..n] {
            if c.opcode == WcOpcode::Recv && c.status == WcStatus::Success {
                let slot = c.wr_id as usize;
                let echo = [bufs.sge(slot * 4096, c.byte_len)];
                if let Some(conn) = &id {
                    conn.post_send(&[SendWr {
                        wr_id: 1000 + c.wr_id,
                        op: SendOp::Send,
                        sges: &echo,
                        signaled: true,
                        inline: None,
                    }])
                    .unwrap();
                }
                srq.post_recv(&[RecvWr {
                    wr_id: c.wr_id,
                    sges: &slots[slot],
                }])
                .unwrap();
            }
        }
        std::thread::yield_now();
    }
}
