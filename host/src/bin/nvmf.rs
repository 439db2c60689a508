//! `nvmf`: nvmfd's NVMe over Fabrics host tool (RDMA: the `soft` provider over TCP, or
//! `ibverbs`).
//!
//!     nvmf discover --addr 127.0.0.1:4420
//!     nvmf identify --addr 127.0.0.1:4420 --nqn nqn.2024-01.io.nvmfd:ram0
//!     nvmf verify   --addr 127.0.0.1:4420 --nqn nqn.2024-01.io.nvmfd:ram0 --nsid 1
//!     nvmf bench    --addr 127.0.0.1:4420 --nqn nqn.2024-01.io.nvmfd:ram0 -q 32 -o 4k -w randread -t 10

// Pattern bytes are masked to 8 bits before the cast.
#![allow(clippy::cast_possible_truncation)]

use std::net::SocketAddr;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use nvmf_host::bench::{self, Pattern};
use nvmf_host::{PipelinedQueue, RdmaQueue};
use nvmfd_nvme::host::{discovery_entry_text, AdminQueue, HostError, HostId, IoQueue};
use nvmfd_nvme::{wire, DISCOVERY_NQN};
use nvmfd_rdma::any::cm::CmChannel;

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Provider {
    /// nvmfd's user-space provider over TCP.
    Soft,
    /// An RDMA device through rdma-core.
    Ibverbs,
}

/// nvmfd's NVMe over Fabrics host tool.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Cli {
    /// The target's address and port.
    #[arg(long, global = true, default_value = "127.0.0.1:4420")]
    addr: SocketAddr,
    /// RDMA provider.
    #[arg(long, global = true, value_enum, default_value = "soft")]
    provider: Provider,
    /// This host's NQN.
    #[arg(
        long,
        global = true,
        default_value = "nqn.2014-08.org.nvmexpress:uuid:6e766d66-0000-4000-8000-000000000001"
    )]
    hostnqn: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// List the subsystems the target offers this host.
    Discover,
    /// Show a subsystem's controller and namespaces.
    Identify {
        /// Subsystem NQN.
        #[arg(long)]
        nqn: String,
    },
    /// Write patterns of sizes doubling from one block to the largest transfer (128 KiB at
    /// most), read them back and compare (destroys the data where it writes: the first
    /// 256 KiB of the namespace at most).
    Verify {
        /// Subsystem NQN.
        #[arg(long)]
        nqn: String,
        /// Namespace.
        #[arg(long, default_value_t = 1)]
        nsid: u32,
    },
    /// Measure IOPS, bandwidth and latency: each I/O queue kept at its depth with reads or
    /// writes of one size (writes destroy the namespace's data).
    Bench(BenchArgs),
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Workload {
    /// Sequential reads (each queue in its own part of the namespace).
    Read,
    /// Sequential writes.
    Write,
    /// Random reads.
    Randread,
    /// Random writes.
    Randwrite,
    /// Random reads and writes, `-M` percent reads.
    Randrw,
}

#[derive(clap::Args, Debug)]
struct BenchArgs {
    /// Subsystem NQN.
    #[arg(long)]
    nqn: String,
    /// Namespace.
    #[arg(long, default_value_t = 1)]
    nsid: u32,
    /// Commands each queue keeps outstanding.
    #[arg(short = 'q', long = "depth", default_value_t = 32, value_parser = clap::value_parser!(u16).range(1..=1024))]
    depth: u16,
    /// Bytes per I/O: a number of bytes, or with k/KiB or m/MiB (powers of two, as fio).
    #[arg(short = 'o', long = "size", default_value = "4k", value_parser = io_size)]
    size: u32,
    /// Access pattern.
    #[arg(short = 'w', long = "workload", value_enum, default_value = "randread")]
    workload: Workload,
    /// Percentage of reads in `randrw` (default 50).
    #[arg(short = 'M', long = "read-pct", value_parser = clap::value_parser!(u32).range(0..=100))]
    read_pct: Option<u32>,
    /// I/O queues.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=1024))]
    queues: u16,
    /// Threads driving the queues (default: one per queue; fewer puts several queues on a
    /// thread).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=1024))]
    threads: Option<u16>,
    /// Measured seconds.
    #[arg(short = 't', long = "time", default_value_t = 10.0)]
    time: f64,
    /// Seconds run first and not measured.
    #[arg(long, default_value_t = 2.0)]
    warmup: f64,
    /// Print the figures as JSON.
    #[arg(long)]
    json: bool,
    /// Write every block with its LBA, its write's stamp and a checkable pattern, and check
    /// every block read: intact, in its place, and, once a write to it was acknowledged in
    /// this run, from that write or a later one (a lost write or a stale block is found). A
    /// block not written in the run may hold zeroes or an earlier run's data. Each thread
    /// works in its own part of the namespace, and keeps about 50 bytes for each place it
    /// writes. The first bad block ends the run with an error.
    #[arg(long)]
    verify: bool,
}

fn channel(p: Provider) -> Result<CmChannel, String> {
    match p {
        Provider::Soft => {
            let f = nvmfd_rdma::soft::Fabric::networked();
            f.add_device("0.0.0.0".parse().map_err(|_| "address")?)
                .map_err(|e| e.to_string())?;
            Ok(CmChannel::Soft(
                nvmfd_rdma::soft::cm::CmChannel::new(&f).map_err(|e| e.to_string())?,
            ))
        }
        Provider::Ibverbs => Ok(CmChannel::Verbs(
            nvmfd_rdma::ibverbs::cm::CmChannel::new().map_err(|e| e.to_string())?,
        )),
    }
}

fn queue(cli: &Cli, qid: u16, sqsize: u16, in_capsule: u32) -> Result<RdmaQueue, String> {
    RdmaQueue::connect(
        channel(cli.provider)?,
        cli.addr,
        qid,
        sqsize,
        in_capsule,
        128 * 1024,
    )
    .map_err(|e| e.to_string())
}

/// The bytes of data an I/O queue's capsule may carry: what the controller reports (IOCCSZ,
/// in 16-byte units with the 64-byte command), up to 4 KiB. An admin queue's capsules carry
/// none (the kernel target's receives for it hold the command alone).
fn in_capsule(id: &wire::IdentifyController) -> u32 {
    id.ioccsz
        .get()
        .saturating_mul(16)
        .saturating_sub(64)
        .min(4096)
}

/// The keep-alive timeout the admin queue asks for, in milliseconds.
const KEEP_ALIVE_MS: u64 = 30_000;

/// A namespace's block size, from the LBA format FLBAS selects (bits 3:0, and 6:5 above
/// them); 0 for one below 512 bytes (LBADS under 9), which no host can use.
fn block_size(ns: &wire::IdentifyNamespace) -> u32 {
    let index = usize::from(ns.flbas & 0xf) | usize::from((ns.flbas >> 5) & 0x3) << 4;
    let Some(lbads) = ns.lbaf.get(index).map(|f| f.lbads) else {
        return 0;
    };
    if lbads < 9 {
        return 0;
    }
    1u32.checked_shl(u32::from(lbads)).unwrap_or(0)
}

/// The admin queue of a new controller of `nqn`, enabled; the controller is shut down when
/// it goes, on every way out of the command.
fn admin(
    cli: &Cli,
    nqn: &str,
    host: &HostId,
) -> Result<nvmf_host::ShutdownOnDrop<RdmaQueue>, String> {
    let a = AdminQueue::connect(queue(cli, 0, 31, 0)?, host, nqn, 31, KEEP_ALIVE_MS as u32)
        .map_err(|e: HostError| {
            // Connect's Invalid Parameters says which field (dw0: IATTR, IPO); 0x84 is
            // Connect Invalid Host.
            let hint = match &e {
                HostError::Status {
                    dw0: 0x0001_0100, ..
                } => " (no such subsystem there)",
                HostError::Status {
                    dw0: 0x0001_0200, ..
                } => " (the host NQN is refused)",
                HostError::Status { status, .. } if status.sct() == 1 && status.sc() == 0x84 => {
                    " (this host is not allowed)"
                }
                _ => "",
            };
            format!("connecting to {nqn} at {}: {e}{hint}", cli.addr)
        })?;
    let mut a = nvmf_host::ShutdownOnDrop::new(a);
    a.enable().map_err(|e| e.to_string())?;
    Ok(a)
}

/// `4096`, `4k`, `4KiB`, `128k`, `1m`, `1MiB`: bytes, k and m in powers of two.
fn io_size(s: &str) -> Result<u32, String> {
    let t = s.trim();
    let at = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (n, unit) = t.split_at(at);
    let n: u32 = n.parse().map_err(|_| format!("`{s}` is not a size"))?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kib" | "kb" => 10,
        "m" | "mib" | "mb" => 20,
        _ => return Err(format!("`{s}`: the unit is k, KiB, m or MiB")),
    };
    n.checked_mul(1 << shift)
        .filter(|&v| v > 0)
        .ok_or_else(|| format!("`{s}` is not a size from 1 byte to 4 GiB"))
}

/// The most entries an I/O queue of the target may have (CAP.MQES + 1).
fn max_queue_entries(a: &mut AdminQueue<RdmaQueue>) -> Result<u32, String> {
    let cap = a
        .property_get(wire::property::CAP, true)
        .map_err(|e| format!("reading the target's capabilities: {e}"))?;
    Ok((cap & 0xFFFF) as u32 + 1)
}

/// The target's largest transfer in bytes (MDTS, a power of two of 4 KiB pages; `None`: no
/// limit).
fn max_transfer(id: &wire::IdentifyController) -> Option<u64> {
    // 4 KiB pages: 2^(12 + MDTS) bytes; 52 or more is past any transfer (no limit).
    1u64.checked_shl(12 + u32::from(id.mdts))
        .filter(|_| id.mdts != 0)
}

/// The longest `-t` or `--warmup` taken: ten years (a run's end is computed from now, and a
/// time past what the clock can hold would panic there).
const LONGEST_RUN: std::time::Duration = std::time::Duration::from_secs(10 * 365 * 24 * 3600);

fn seconds(what: &str, s: f64) -> Result<std::time::Duration, String> {
    std::time::Duration::try_from_secs_f64(s)
        .ok()
        .filter(|d| *d <= LONGEST_RUN)
        .ok_or_else(|| format!("{what}: {s} is not a duration in seconds of at most ten years"))
}

/// What of `b` can be checked before connecting: the run's times, the threads against the
/// queues. A read percentage with a workload that does not mix is said to be ignored.
fn check_bench_args(b: &BenchArgs) -> Result<(std::time::Duration, std::time::Duration), String> {
    let time = seconds("-t", b.time)?;
    if time.is_zero() {
        return Err("-t: the measured time must be above 0 seconds".into());
    }
    let warmup = seconds("--warmup", b.warmup)?;
    if let Some(t) = b.threads.filter(|&t| t > b.queues) {
        return Err(format!(
            "--threads {t} is more than --queues {}: each thread drives at least one queue",
            b.queues
        ));
    }
    if b.read_pct.is_some() && !matches!(b.workload, Workload::Randrw) {
        eprintln!("nvmf bench: -M (read percentage) applies to -w randrw only; ignored");
    }
    Ok((time, warmup))
}

fn run_bench(cli: &Cli, host: &HostId, b: &BenchArgs) -> Result<(), String> {
    let (time, warmup) = check_bench_args(b)?;
    let mut a = admin(cli, &b.nqn, host)?;
    let ns = a
        .identify_namespace(b.nsid)
        .map_err(|e| format!("namespace {} of {}: {e}", b.nsid, b.nqn))?;
    if ns.nsze.get() == 0 {
        return Err(format!("namespace {} is not active in {}", b.nsid, b.nqn));
    }
    let id = a.identify_controller().map_err(|e| e.to_string())?;
    let icd = in_capsule(&id);
    // MDTS: a power of two of 4 KiB pages (the minimum memory page size); 0 is no limit.
    if let Some(mdts) = max_transfer(&id) {
        if u64::from(b.size) > mdts {
            return Err(format!(
                "the I/O size ({} bytes) is above the target's maximum transfer ({mdts} bytes)",
                b.size
            ));
        }
    }
    // A queue has at least two entries (SQSIZE 1).
    let entries = max_queue_entries(&mut a)?;
    if u32::from(b.depth.max(2)) > entries {
        return Err(format!(
            "the queue depth (-q {}) is above the target's largest queue ({entries} entries)",
            b.depth
        ));
    }
    let granted = a.set_queue_count(b.queues).map_err(|e| e.to_string())?;
    if granted < b.queues {
        return Err(format!(
            "the target grants {granted} I/O queues, {} were asked for",
            b.queues
        ));
    }
    if block_size(&ns) == 0 {
        return Err(format!(
            "namespace {}: its block size is not one a host can use (LBADS below 9)",
            b.nsid
        ));
    }
    let io_size = b.size;
    let job = bench::Job {
        nsid: b.nsid,
        block_size: block_size(&ns),
        blocks: ns.nsze.get(),
        io_size,
        depth: b.depth,
        pattern: match b.workload {
            Workload::Read => Pattern::Read,
            Workload::Write => Pattern::Write,
            Workload::Randread => Pattern::RandRead,
            Workload::Randwrite => Pattern::RandWrite,
            Workload::Randrw => Pattern::RandRw,
        },
        read_pct: b.read_pct.unwrap_or(50),
        queues: b.queues,
        threads: b.threads.unwrap_or(b.queues),
        time,
        warmup,
        verify: b.verify,
    };
    let cntlid = a.cntlid;
    let connect = |qid: u16| {
        let ch = channel(cli.provider).map_err(HostError::Transport)?;
        // A queue has at least two entries (SQSIZE 1): depth 1 keeps one of them out.
        let slots = b.depth.max(2);
        let q = PipelinedQueue::connect(ch, cli.addr, qid, slots, icd, io_size.max(4096))?;
        IoQueue::connect(q, host, &b.nqn, cntlid, qid, slots - 1)
    };
    let bar = if b.json {
        indicatif::ProgressBar::hidden()
    } else {
        indicatif::ProgressBar::new_spinner()
    };
    let mut last = (0u64, std::time::Duration::ZERO);
    // The admin queue asked for a keep-alive timeout (KEEP_ALIVE_MS) and carries nothing else
    // during the run: a Keep Alive every third of it, whether or not the target counts the
    // I/O queues' commands as traffic.
    let mut kept_alive = std::time::Duration::ZERO;
    let mut keep_alive_failed = false;
    let mut tick = |ios: u64, at: std::time::Duration| {
        if at.saturating_sub(kept_alive) >= std::time::Duration::from_millis(KEEP_ALIVE_MS / 3) {
            kept_alive = at;
            // A controller gone shows as its I/O failing; said once.
            if let Err(e) = a.keep_alive() {
                if !keep_alive_failed {
                    keep_alive_failed = true;
                    bar.suspend(|| eprintln!("nvmf bench: a Keep Alive failed: {e}"));
                }
            }
        }
        let dt = (at - last.1).as_secs_f64();
        if dt >= 0.5 {
            let iops = (ios - last.0) as f64 / dt;
            bar.set_message(format!(
                "{:>4.0}s {:>10.0} IOPS {:>9.1} MiB/s",
                at.as_secs_f64(),
                iops,
                iops * f64::from(io_size) / f64::from(1u32 << 20)
            ));
            bar.tick();
            last = (ios, at);
        }
    };
    // SIGINT or SIGTERM ends the run early with the figures so far, as fio does; another one
    // while the bench waits for commands still out quits at once (exit status 130).
    let interrupt = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register_conditional_shutdown(
            sig,
            130,
            std::sync::Arc::clone(&interrupt),
        )
        .and_then(|_| signal_hook::flag::register(sig, std::sync::Arc::clone(&interrupt)))
        .map_err(|e| format!("cannot catch signal {sig}: {e}"))?;
    }
    let flag = std::sync::Arc::clone(&interrupt);
    let bar_waiting = bar.clone();
    let mut waiting = move || {
        // From now on the first SIGINT or SIGTERM quits.
        flag.store(true, std::sync::atomic::Ordering::Relaxed);
        bar_waiting.suspend(|| {
            eprintln!(
                "nvmf bench: the run is over; waiting up to {} s for the commands still out \
                 (SIGINT quits at once)",
                bench::UNANSWERED_AFTER_RUN.as_secs()
            );
        });
    };
    let measured = bench::run(&job, &connect, &mut tick, &interrupt, &mut waiting);
    bar.finish_and_clear();
    // The figures of a run whose shutdown failed are printed, and the run fails.
    let wrote = match b.workload {
        Workload::Read | Workload::Randread => false,
        Workload::Randrw => job.read_pct < 100,
        Workload::Write | Workload::Randwrite => true,
    };
    let shut = finish(a, &b.nqn, wrote);
    let measured = measured?;
    // Interrupted in the warm-up, or before a millisecond was measured (as the run began):
    // no figures to stand on, which is not a run that went well.
    let ios: u64 = measured.figures.iter().map(|f| f.ios).sum();
    if measured.interrupted && (ios == 0 || measured.time < MEASURED_AT_LEAST) {
        shut?;
        return Err(format!(
            "interrupted after {:.3} s of measured time: too little to report figures",
            measured.time.as_secs_f64()
        ));
    }
    print_bench(b, &job, &measured, &bench::report(&job, &measured));
    shut
}

/// The least measured time an interrupted bench reports figures of.
const MEASURED_AT_LEAST: std::time::Duration = std::time::Duration::from_millis(1);

/// Shuts controller `a` (of `nqn`) down at the end of a command. After writes (`wrote`), a
/// shutdown that fails fails the command: what was written may not be durable. Else it is
/// said, and the command stands.
fn finish(a: nvmf_host::ShutdownOnDrop<RdmaQueue>, nqn: &str, wrote: bool) -> Result<(), String> {
    match a.finish() {
        Ok(()) => Ok(()),
        Err(e) if wrote => Err(format!(
            "the shutdown of the controller of {nqn} failed: {e}; what was written may not be durable"
        )),
        Err(e) => {
            eprintln!("nvmf: the shutdown of the controller of {nqn} failed: {e}");
            Ok(())
        }
    }
}

/// The figures of a bench run, as JSON or as lines.
fn print_bench(b: &BenchArgs, job: &bench::Job, m: &bench::Measured, report: &serde_json::Value) {
    if b.json {
        println!("{report:#}");
        return;
    }
    println!(
        "{} {} B, depth {}, {} queue(s) on {} thread(s), {:.1} s after {:.1} s of warm-up{}",
        format!("{:?}", b.workload).to_lowercase(),
        job.io_size,
        b.depth,
        b.queues,
        job.threads.min(b.queues),
        m.time.as_secs_f64(),
        b.warmup,
        if m.interrupted { " (interrupted)" } else { "" }
    );
    if let Some(qs) = report["queues"].as_array() {
        if qs.len() > 1 {
            for q in qs {
                println!(
                    "queue {:>4}: {}",
                    q["qid"].as_u64().unwrap_or(0),
                    bench::line(q)
                );
            }
        }
    }
    println!("total     : {}", bench::line(&report["total"]));
    if matches!(b.workload, Workload::Randrw) {
        for dir in ["read", "write"] {
            let v = &report["total"][dir];
            if v["ios"].as_u64().unwrap_or(0) > 0 {
                println!("{dir:<10}: {}", bench::line(v));
            }
        }
    }
    if let Some(n) = report["verified_blocks"].as_u64() {
        let reads = match b.workload {
            Workload::Read | Workload::Randread => true,
            Workload::Write | Workload::Randwrite => false,
            Workload::Randrw => job.read_pct > 0,
        };
        if reads {
            println!("verified  : {n} blocks read back intact");
        } else {
            // Nothing is checked by a run without reads: it says so, rather than "0 intact".
            println!(
                "verified  : nothing read back (no reads in this workload); the blocks written \
                 carry stamps that a later --verify run with reads checks"
            );
        }
    }
}

/// A discovery log entry as `nvmf discover` prints it: the subsystem's NQN, its transport
/// and address (an IPv6 one in brackets), and what kind of subsystem it is unless an NVM one
/// (a referral to another discovery controller, this discovery controller itself).
fn discovery_line(e: &wire::DiscoveryLogEntry) -> String {
    let (nqn, addr, port) = discovery_entry_text(e);
    let transport = match e.trtype {
        1 => "rdma".to_owned(),
        2 => "fc".to_owned(),
        3 => "tcp".to_owned(),
        254 => "loop".to_owned(),
        t => format!("transport {t}"),
    };
    let addr = if e.adrfam == 2 {
        format!("[{addr}]")
    } else {
        addr
    };
    let kind = match e.subtype {
        2 => "",
        1 => "  (discovery referral)",
        3 => "  (this discovery controller)",
        _ => "  (subsystem type unknown)",
    };
    format!("{nqn}  {transport} {addr}:{port}{kind}")
}

fn run(cli: &Cli) -> Result<(), String> {
    let host = HostId {
        nqn: cli.hostnqn.clone(),
        id: [0x6e; 16],
    };
    match &cli.command {
        Command::Bench(b) => run_bench(cli, &host, b)?,
        Command::Discover => {
            let mut d = admin(cli, DISCOVERY_NQN, &host)?;
            for e in d.discover().map_err(|e| e.to_string())? {
                println!("{}", discovery_line(&e));
            }
            finish(d, DISCOVERY_NQN, false)?;
        }
        Command::Identify { nqn } => {
            let mut a = admin(cli, nqn, &host)?;
            let id = a.identify_controller().map_err(|e| e.to_string())?;
            let s = |b: &[u8]| wire::get_str(b).unwrap_or("?").to_owned();
            println!(
                "controller {}  serial {}  model {}  firmware {}  largest transfer {}",
                id.cntlid.get(),
                s(&id.sn),
                s(&id.mn),
                s(&id.fr),
                max_transfer(&id).map_or("unlimited".to_owned(), |m| format!("{} KiB", m / 1024))
            );
            // A page lists at most 1,024: the next starts after the last.
            let mut nsids: Vec<u32> = Vec::new();
            loop {
                let after = nsids.last().copied().unwrap_or(0);
                let page = a.active_namespaces(after).map_err(|e| e.to_string())?;
                // A target that ignores where the page starts would list the same for ever.
                if page.first().is_some_and(|&n| n <= after) {
                    return Err(format!(
                        "{nqn}: the active namespace list after {after} starts at {}",
                        page[0]
                    ));
                }
                let full = page.len() >= 1024;
                nsids.extend(page);
                if !full || nsids.last().is_some_and(|&n| n >= 0xFFFF_FFFE) {
                    break;
                }
            }
            for nsid in nsids {
                let ns = a.identify_namespace(nsid).map_err(|e| e.to_string())?;
                let bs = u64::from(block_size(&ns));
                println!(
                    "namespace {nsid}: {} blocks of {bs} bytes ({} MiB){}",
                    ns.nsze.get(),
                    ns.nsze.get().saturating_mul(bs) >> 20,
                    if ns.nsattr & 1 == 1 {
                        ", read-only"
                    } else {
                        ""
                    }
                );
                // Its identifiers (Identify CNS 03h): EUI-64, NGUID, UUID.
                for (kind, id) in a.namespace_ids(nsid).map_err(|e| e.to_string())? {
                    let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
                    match (kind, uuid::Uuid::from_slice(&id)) {
                        (1, _) => println!("  eui64 {hex}"),
                        (2, _) => println!("  nguid {hex}"),
                        (3, Ok(u)) => println!("  uuid {u}"),
                        _ => {}
                    }
                }
            }
            finish(a, nqn, false)?;
        }
        Command::Verify { nqn, nsid } => {
            let mut a = admin(cli, nqn, &host)?;
            let ns = a
                .identify_namespace(*nsid)
                .map_err(|e| format!("namespace {nsid} of {nqn}: {e}"))?;
            if ns.nsze.get() == 0 {
                return Err(format!("namespace {nsid} is not active in {nqn}"));
            }
            let bs = block_size(&ns) as usize;
            let id = a.identify_controller().map_err(|e| e.to_string())?;
            // Writes of one block doubling up to 128 KiB, or the target's largest transfer.
            let largest = max_transfer(&id).map_or(128 * 1024, |m| m.min(128 * 1024)) as usize;
            if bs == 0 || bs > largest {
                return Err(format!(
                    "namespace {nsid}: a block size of {bs} bytes (the target transfers at most {largest})"
                ));
            }
            // One command at a time: the smallest queue a target takes.
            let sqsize = u16::try_from(max_queue_entries(&mut a)?.clamp(2, 64) - 1).unwrap_or(1);
            a.set_queue_count(1).map_err(|e| e.to_string())?;
            let icd = in_capsule(&id);
            let mut io =
                IoQueue::connect(queue(cli, 1, sqsize, icd)?, &host, nqn, a.cntlid, 1, sqsize)
                    .map_err(|e| e.to_string())?;
            // A pattern of this run: a block an earlier run left (a write the target lost)
            // does not pass.
            let v = nvmf_host::verify::verify(
                &mut io,
                *nsid,
                (bs, ns.nsze.get()),
                largest,
                fastrand::u64(..),
            )?;
            println!(
                "verified: {} writes read back intact at once and again after all were written, {bs} B to {} KiB, namespace {nsid} of {nqn}",
                v.writes,
                v.largest / 1024
            );
            // The I/O queue goes before the controller is shut down.
            drop(io);
            finish(a, nqn, true)?;
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(&cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nvmf: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each entry says its own transport, address family and kind: every one was printed as
    /// an RDMA NVM subsystem.
    #[test]
    fn discovery_entries_are_printed_as_they_are() {
        let entry = |trtype, adrfam, subtype, addr: &str| {
            let mut e: wire::DiscoveryLogEntry = wire::zeroed();
            (e.trtype, e.adrfam, e.subtype) = (trtype, adrfam, subtype);
            wire::put_str(&mut e.subnqn, "nqn.2024-01.io.example:a", 0);
            wire::put_str(&mut e.traddr, addr, b' ');
            wire::put_str(&mut e.trsvcid, "4420", b' ');
            e
        };
        assert_eq!(
            discovery_line(&entry(1, 1, 2, "10.0.0.1")),
            "nqn.2024-01.io.example:a  rdma 10.0.0.1:4420"
        );
        assert_eq!(
            discovery_line(&entry(3, 2, 2, "fe80::1")),
            "nqn.2024-01.io.example:a  tcp [fe80::1]:4420"
        );
        assert_eq!(
            discovery_line(&entry(1, 1, 3, "10.0.0.1")),
            "nqn.2024-01.io.example:a  rdma 10.0.0.1:4420  (this discovery controller)"
        );
        assert!(discovery_line(&entry(1, 1, 1, "10.0.0.2")).ends_with("(discovery referral)"));
    }

    /// The LBA format FLBAS selects, its index's high bits (6:5) included; a block size below
    /// 512 bytes is refused (0) rather than taken (a 16-byte block broke `--verify`'s stamps);
    /// MDTS past any transfer is no limit, not a wrapped 0.
    #[test]
    fn block_size_and_largest_transfer_are_read_as_the_specification_lays_them_out() {
        let mut ns: wire::IdentifyNamespace = wire::zeroed();
        ns.lbaf[0].lbads = 9;
        ns.lbaf[1].lbads = 12;
        ns.lbaf[17].lbads = 12;
        assert_eq!(block_size(&ns), 512);
        ns.flbas = 1;
        assert_eq!(block_size(&ns), 4096);
        // Index 17: bits 3:0 = 1, bits 6:5 = 1.
        ns.flbas = 0x21;
        ns.lbaf[1].lbads = 9;
        assert_eq!(block_size(&ns), 4096, "FLBAS bits 6:5 ignored");
        ns.flbas = 0;
        ns.lbaf[0].lbads = 4;
        assert_eq!(block_size(&ns), 0, "a 16-byte block taken");
        let mut id: wire::IdentifyController = wire::zeroed();
        assert_eq!(max_transfer(&id), None);
        id.mdts = 5;
        assert_eq!(max_transfer(&id), Some(128 * 1024));
        id.mdts = 52;
        assert_eq!(max_transfer(&id), None, "wrapped to 0");
    }

    /// Threads past the queues were clamped, 0 threads taken as 1, and a bad -t or --warmup
    /// found only once connected: each is refused before connecting.
    #[test]
    fn bench_arguments_are_checked_before_connecting() {
        let parse = |args: &[&str]| {
            let mut all = vec!["nvmf", "--addr", "127.0.0.1:4420", "bench", "--nqn", "n"];
            all.extend_from_slice(args);
            Cli::try_parse_from(all)
        };
        let bench = |cli: Cli| match cli.command {
            Command::Bench(b) => b,
            _ => unreachable!(),
        };
        assert!(parse(&["--threads", "0"]).is_err());
        let b = bench(parse(&["--queues", "2", "--threads", "3"]).unwrap());
        assert!(check_bench_args(&b).unwrap_err().contains("--threads 3"));
        let b = bench(parse(&["--queues", "4", "--threads", "2"]).unwrap());
        assert!(check_bench_args(&b).is_ok());
        let b = bench(parse(&["--warmup=-1"]).unwrap());
        assert!(check_bench_args(&b).unwrap_err().contains("--warmup"));
        let b = bench(parse(&["-t", "0"]).unwrap());
        assert!(check_bench_args(&b).is_err());
        let b = bench(parse(&["-w", "randrw"]).unwrap());
        assert_eq!(b.read_pct, None);
    }

    /// A run's time past what the clock holds is refused, not a panic at the run's start.
    #[test]
    fn an_absurd_run_time_is_refused() {
        assert_eq!(seconds("-t", 1.5).unwrap().as_millis(), 1500);
        assert!(seconds("-t", -1.0).is_err());
        assert!(seconds("-t", 1e18).is_err());
        let now = std::time::Instant::now();
        let longest = seconds("-t", LONGEST_RUN.as_secs_f64()).unwrap();
        assert!(now.checked_add(longest + longest).is_some());
    }
}
