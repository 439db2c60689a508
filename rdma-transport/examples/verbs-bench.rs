//! What the wire costs: SEND message rate (64 B into an SRQ, receives re-posted as they are
//! consumed) and RDMA WRITE bandwidth (64 B, 4 KiB, 128 KiB; chains of 16, the last signaled,
//! 4 chains in flight), on the soft provider's in-process wire and, where `RDMA_IP` names an
//! RDMA device's address, on ibverbs. `scripts/bench-rdma.sh` runs both (ibverbs on rxe0 in
//! the VM lab). One line per figure; a benchmark, not a test.
//!
//!     verbs-bench [soft|ibverbs] [SECONDS]

// Counters and sizes here are small and known: casts cannot truncate.
#![allow(clippy::cast_possible_truncation)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use nvmfd_rdma::*;

/// Every right.
const RW: Access = Access::all();
const CAPS: QpCaps = QpCaps {
    max_send_wr: 128,
    max_send_sge: 1,
    max_recv_wr: 0,
    max_inline_data: 64,
};

macro_rules! bench {
    ($name:ident, $p:ident) => {
        fn $name(
            addr: SocketAddr,
            mk_channel: &dyn Fn() -> nvmfd_rdma::$p::cm::CmChannel,
            secs: f64,
        ) {
            use nvmfd_rdma::$p::cm::CmEvent;
            let sch = mk_channel();
            let listener = sch.listen(addr, 4).unwrap();
            let tdev = listener.device().unwrap();
            let tpd = tdev.alloc_pd().unwrap();
            let tcq = tdev.create_cq(4096).unwrap();
            let tsrq = tpd.create_srq(1024, 1).unwrap();
            let tmr = tpd.alloc_mr(4 << 20, RW).unwrap();
            let cch = mk_channel();
            let mut hid = cch.resolve(addr, Duration::from_secs(3)).unwrap();
            let hdev = hid.device().unwrap();
            let hpd = hdev.alloc_pd().unwrap();
            let hcq = hdev.create_cq(4096).unwrap();
            let hsrq = hpd.create_srq(16, 1).unwrap();
            let hmr = hpd.alloc_mr(4 << 20, RW).unwrap();
            hid.create_qp(&hpd, &hcq, &hsrq, CAPS).unwrap();
            hid.connect(b"bench").unwrap();
            let mut tid = loop {
                if let Some(CmEvent::ConnectRequest { id, .. }) = sch.next_event() {
                    break id;
                }
            };
            tid.create_qp(&tpd, &tcq, &tsrq, CAPS).unwrap();
            tid.accept(b"").unwrap();
            while !matches!(cch.next_event(), Some(CmEvent::Established { .. })) {}
            let provider = stringify!($p);

            // SEND message rate.
            let slots: Vec<[Sge; 1]> = (0..1024).map(|i| [tmr.sge(i * 64, 64)]).collect();
            for chunk in slots.chunks(32).enumerate() {
                let wrs: Vec<RecvWr<'_>> = chunk
                    .1
                    .iter()
                    .enumerate()
                    .map(|(i, s)| RecvWr {
                        wr_id: (chunk.0 * 32 + i) as u64,
                        sges: s,
                    })
                    .collect();
                tsrq.post_recv(&wrs).unwrap();
            }
            let sge = [hmr.sge(0, 64)];
            let chain: Vec<SendWr<'_>> = (0..16)
                .map(|i| SendWr {
                    wr_id: i,
                    op: SendOp::Send,
                    sges: &sge,
                    signaled: i == 15,
                    inline: None,
                })
                .collect();
            let (mut sent, mut inflight) = (0u64, 0u32);
            let mut wc = [Wc::default(); 32];
            let start = Instant::now();
            let end = start + Duration::from_secs_f64(secs);
            while Instant::now() < end {
                while inflight < 4 {
                    hid.post_send(&chain).unwrap();
                    inflight += 1;
                }
                let n = hcq.poll(&mut wc).unwrap();
                inflight -= n as u32;
                sent += 16 * n as u64;
                let m = tcq.poll(&mut wc).unwrap();
                let again: Vec<RecvWr<'_>> = wc[..m]
                    .iter()
                    .map(|c| RecvWr {
                        wr_id: c.wr_id,
                        sges: &slots[c.wr_id as usize],
                    })
                    .collect();
                if !again.is_empty() {
                    tsrq.post_recv(&again).unwrap();
                }
            }
            let el = start.elapsed().as_secs_f64();
            println!(
                "{provider:<8} SEND 64 B into an SRQ      {:>12.0} msg/s",
                sent as f64 / el
            );
            // Drain: the last chains complete, their receives are consumed.
            let drain_end = Instant::now() + Duration::from_secs(5);
            while inflight > 0 && Instant::now() < drain_end {
                inflight -= hcq.poll(&mut wc).unwrap() as u32;
            }
            let quiet = Instant::now() + Duration::from_millis(200);
            while Instant::now() < quiet {
                tcq.poll(&mut wc).unwrap();
            }

            // RDMA WRITE bandwidth.
            for size in [64u32, 4096, 128 * 1024] {
                let sge = [tmr.sge(0, size)];
                let chain: Vec<SendWr<'_>> = (0..16)
                    .map(|i| SendWr {
                        wr_id: i,
                        op: SendOp::RdmaWrite {
                            remote_addr: hmr.addr(),
                            rkey: hmr.rkey(),
                        },
                        sges: &sge,
                        signaled: i == 15,
                        inline: None,
                    })
                    .collect();
                let (mut done, mut inflight) = (0u64, 0u32);
                let start = Instant::now();
                let end = start + Duration::from_secs_f64(secs);
                while Instant::now() < end {
                    while inflight < 4 {
                        tid.post_send(&chain).unwrap();
                        inflight += 1;
                    }
                    let n = tcq.poll(&mut wc).unwrap();
                    let writes = wc[..n]
                        .iter()
                        .filter(|c| c.opcode == WcOpcode::RdmaWrite)
                        .count();
                    for c in &wc[..n] {
                        assert_eq!(c.status, WcStatus::Success, "{c:?}");
                    }
                    inflight -= writes as u32;
                    done += 16 * writes as u64;
                }
                while inflight > 0 {
                    let n = tcq.poll(&mut wc).unwrap();
                    inflight -= wc[..n]
                        .iter()
                        .filter(|c| c.opcode == WcOpcode::RdmaWrite)
                        .count() as u32;
                }
                let el = start.elapsed().as_secs_f64();
                let bytes = done as f64 * f64::from(size);
                println!(
                    "{provider:<8} RDMA WRITE {:>7} B           {:>12.0} ops/s {:>10.1} MiB/s",
                    size,
                    done as f64 / el,
                    bytes / el / f64::from(1 << 20)
                );
            }
        }
    };
}

bench!(soft_bench, soft);
#[cfg(feature = "ibverbs")]
bench!(verbs_bench, ibverbs);

/// Which provider.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum Provider {
    /// The soft provider's in-process wire.
    Soft,
    /// An RDMA device through rdma-core (its address in `RDMA_IP`).
    Ibverbs,
}

/// SEND message rate and RDMA WRITE bandwidth of a verbs provider.
#[derive(clap::Parser, Debug)]
struct Cli {
    /// The provider.
    #[arg(value_enum, default_value = "soft")]
    provider: Provider,
    /// Seconds per figure.
    #[arg(default_value_t = 2.0)]
    seconds: f64,
}

fn main() {
    let cli = <Cli as clap::Parser>::parse();
    let secs = cli.seconds;
    match cli.provider {
        Provider::Soft => {
            let fabric = nvmfd_rdma::soft::Fabric::new();
            fabric.add_device("10.0.0.1".parse().unwrap()).unwrap();
            let f = fabric.clone();
            soft_bench(
                "10.0.0.1:4420".parse().unwrap(),
                &move || nvmfd_rdma::soft::cm::CmChannel::new(&f).unwrap(),
                secs,
            );
        }
        #[cfg(feature = "ibverbs")]
        Provider::Ibverbs => {
            let ip = std::env::var("RDMA_IP").expect("RDMA_IP names the RDMA device's address");
            let addr: SocketAddr = format!("{ip}:4420").parse().expect("an IPv4 RDMA_IP");
            verbs_bench(
                addr,
                &|| nvmfd_rdma::ibverbs::cm::CmChannel::new().unwrap(),
                secs,
            );
        }
        #[cfg(not(feature = "ibverbs"))]
        Provider::Ibverbs => {
            eprintln!("verbs-bench: built without the ibverbs feature");
            std::process::exit(2);
        }
    }
}
