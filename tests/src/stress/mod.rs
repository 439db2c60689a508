//! A seeded stress of the real daemon against a model of its namespaces.
//!
//! nvmfd runs as it does in production (its control thread, two reactors, a RAM namespace of
//! 512-byte blocks and a file namespace of 4 KiB blocks) behind a soft listener, with the
//! soft provider's seeded faults on its side of the wire (losses, delays, fatal QPs, SRQ
//! errors, chains refused part-way) and on the host's. This process is the host: several
//! controllers, each with an admin queue and one to three I/O queues of random depths, send a
//! seeded random mix of reads, writes (some FUA), flushes, write zeroes, multi-range
//! deallocations, admin commands, keep-alives, controller resets, disconnects and
//! reconnects, at random sizes. Every completion is checked against [`model::NsModel`]:
//! what an acknowledged write wrote is what later reads return; a command that failed or was
//! cut off may have landed or not, for its own blocks only.
//!
//! A command cut off by a failure may still land after its host gave up (its block operation
//! was in flight in the target), so a block such a command touched is not written again
//! until a quiet point: every outstanding command answered or failed, the target reporting no
//! block operation in flight and no QP draining; the block is then read back, must hold one
//! of what the model allows, and is known again. At the end the faults stop, every block of
//! both namespaces is read back and checked, and once the host has disconnected every pool
//! of the target must be full again.
//!
//! The same seed gives the same operations and the same fault streams (the threads'
//! timing may still differ); a failing run prints its seed.

// Block counts, ranges and transfer sizes here are small and known: casts cannot truncate.
#![allow(clippy::cast_possible_truncation)]

pub mod model;
mod ops;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::{Daemon, Options};
use model::NsModel;
use ops::Host;

/// Chances, per million work requests, of each seeded fault on one side of the wire.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Rates {
    /// Lost beyond retries.
    pub drop: u32,
    /// Held up on the wire.
    pub delay: u32,
    /// The QP fails fatally.
    pub qp_fatal: u32,
    /// The receiving SRQ fails.
    pub srq_error: u32,
    /// A chain is refused part-way.
    pub post_failure: u32,
}

impl Rates {
    /// The target's default: every kind, a fault every few thousand work requests.
    pub const TARGET: Rates = Rates {
        drop: 150,
        delay: 3_000,
        qp_fatal: 100,
        srq_error: 40,
        post_failure: 150,
    };
    /// The host's default.
    pub const HOST: Rates = Rates {
        drop: 100,
        delay: 3_000,
        qp_fatal: 60,
        srq_error: 40,
        post_failure: 0,
    };
}

/// What to run.
#[derive(Clone, Debug)]
pub struct Config {
    /// Seed of the operations and of both sides' faults.
    pub seed: u64,
    /// How long to send operations (the final check comes after).
    pub duration: Duration,
    /// Controllers connected at once.
    pub controllers: usize,
    /// Faults on the target's side of the wire.
    pub target_faults: Rates,
    /// Faults on the host's side.
    pub host_faults: Rates,
    /// Print a progress line this often.
    pub progress: Option<Duration>,
    /// The `nvmfd` binary, instead of the one next to this program.
    pub binary: Option<PathBuf>,
    /// Before the final read, overwrite the first MiB of the file namespace behind the
    /// target's back: the run must then report mismatches (a test of the checking itself).
    pub sabotage: bool,
}

impl Config {
    /// `seed` for `duration` with the default controllers and faults.
    pub fn new(seed: u64, duration: Duration) -> Config {
        Config {
            seed,
            duration,
            controllers: 2,
            target_faults: Rates::TARGET,
            host_faults: Rates::HOST,
            progress: None,
            binary: None,
            sabotage: false,
        }
    }
}

/// What a run did and found.
#[derive(Debug, Default)]
pub struct Report {
    /// The seed.
    pub seed: u64,
    /// Operations answered with success, by kind.
    pub ops: BTreeMap<&'static str, u64>,
    /// Operations that failed (transport, timeout or status), by kind.
    pub failed: BTreeMap<&'static str, u64>,
    /// Error statuses the target answered, by status.
    pub statuses: BTreeMap<String, u64>,
    /// Seeded faults the target's fabric injected, by kind.
    pub target_faults: BTreeMap<String, u64>,
    /// Seeded faults the host's fabric injected, by kind.
    pub host_faults: BTreeMap<String, u64>,
    /// Controllers connected (the first ones included), resets, and connects that failed.
    pub connects: u64,
    /// Controller resets done.
    pub resets: u64,
    /// Controllers or queues that could not connect (and were tried again).
    pub connect_failures: u64,
    /// Quiet points reached.
    pub quiet_points: u64,
    /// Blocks a quiet point read back and settled.
    pub settled_blocks: u64,
    /// Blocks checked by the final read of both namespaces.
    pub final_blocks: u64,
    /// What a read returned that the model does not allow, and anything else that must not
    /// happen (a target that stops answering, a pool not full at the end).
    pub mismatches: Vec<String>,
    /// The target's counters at the end (teardowns by cause, SRQ rebuilds, drain timeouts).
    pub target: BTreeMap<String, u64>,
    /// How long the operations ran.
    pub elapsed: Duration,
}

impl Report {
    /// Operations answered, all kinds.
    pub fn total_ops(&self) -> u64 {
        self.ops.values().sum()
    }

    /// Operations failed, all kinds.
    pub fn total_failed(&self) -> u64 {
        self.failed.values().sum()
    }

    /// Faults injected, both sides, all kinds.
    pub fn total_faults(&self) -> u64 {
        self.target_faults.values().sum::<u64>() + self.host_faults.values().sum::<u64>()
    }

    /// One line of figures.
    pub fn line(&self) -> String {
        format!(
            "{:.0}s: {} ops ({} failed), faults injected {} (target {}, host {}), quiet points {}, connects {}, resets {}, mismatches {}",
            self.elapsed.as_secs_f64(),
            self.total_ops(),
            self.total_failed(),
            self.total_faults(),
            self.target_faults.values().sum::<u64>(),
            self.host_faults.values().sum::<u64>(),
            self.quiet_points,
            self.connects,
            self.resets,
            self.mismatches.len()
        )
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let map = |m: &BTreeMap<&'static str, u64>| {
            m.iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let smap = |m: &BTreeMap<String, u64>| {
            m.iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        writeln!(
            f,
            "seed {}, {:.1} s of operations",
            self.seed,
            self.elapsed.as_secs_f64()
        )?;
        writeln!(
            f,
            "operations answered: {} ({})",
            self.total_ops(),
            map(&self.ops)
        )?;
        writeln!(
            f,
            "operations failed: {} ({})",
            self.total_failed(),
            map(&self.failed)
        )?;
        writeln!(f, "error statuses: {}", smap(&self.statuses))?;
        writeln!(
            f,
            "faults injected by the target's fabric: {}",
            smap(&self.target_faults)
        )?;
        writeln!(
            f,
            "faults injected by the host's fabric: {}",
            smap(&self.host_faults)
        )?;
        writeln!(
            f,
            "controllers connected {}, resets {}, connects failed {}, quiet points {}, blocks settled {}",
            self.connects, self.resets, self.connect_failures, self.quiet_points, self.settled_blocks
        )?;
        writeln!(f, "target: {}", smap(&self.target))?;
        writeln!(f, "final read: {} blocks checked", self.final_blocks)?;
        write!(f, "mismatches: {}", self.mismatches.len())?;
        for m in self.mismatches.iter().take(20) {
            write!(f, "\n  {m}")?;
        }
        Ok(())
    }
}

/// The subsystem the daemon serves.
pub const SUBSYSTEM: &str = "nqn.2024-01.io.nvmfd.test:stress";

/// The daemon's configuration: two reactors (one where the machine has one core), a RAM
/// namespace of 512-byte blocks (NSID 1) and the file `file` of 4 KiB blocks (NSID 2).
fn daemon_options(cfg: &Config, file: &std::path::Path) -> Options {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let reactors = if cores >= 2 { "[0, 1]" } else { "[0]" };
    Options {
        replace: vec![
            ("reactor_cores = [0]".into(), format!("reactor_cores = {reactors}")),
            (
                "nqn.2024-01.io.nvmfd.test:ram0".into(),
                SUBSYSTEM.into(),
            ),
            (
                "size = \"64MiB\"\n".into(),
                format!(
                    "size = \"16MiB\"\n\n[[subsystem.namespace]]\nnsid = 2\nbackend = \"file\"\npath = \"{}\"\nblock_size = 4096\n",
                    file.display()
                ),
            ),
        ],
        test_hooks: true,
        binary: cfg.binary.clone(),
        ..Options::default()
    }
}

fn listener_addr(d: &Daemon) -> SocketAddr {
    let cfg = std::fs::read_to_string(d.dir.path().join("nvmfd.toml")).unwrap_or_default();
    let port: u16 = cfg
        .lines()
        .find_map(|l| l.strip_prefix("port = "))
        .and_then(|p| p.trim().parse().ok())
        .unwrap_or(0);
    SocketAddr::new([127, 0, 0, 1].into(), port)
}

/// Sets the target's seeded faults; returns what its fabric injected so far.
fn target_faults(d: &Daemon, seed: u64, r: Rates) -> Value {
    let req = json!({
        "request": "debug_fault",
        "listener": 0,
        "fault": {"seeded": {
            "seed": seed,
            "drop_per_million": r.drop,
            "delay_per_million": r.delay,
            "qp_fatal_per_million": r.qp_fatal,
            "srq_error_per_million": r.srq_error,
            "post_failure_per_million": r.post_failure,
        }},
    });
    hook(d, &req)["injected"].clone()
}

/// The data of a successful admin request `req`.
fn hook(d: &Daemon, req: &Value) -> Value {
    let v = d.request(&req.to_string());
    assert_eq!(v["ok"], true, "{req}: {v}");
    v["data"].clone()
}

fn host_faults(seed: u64, r: Rates) -> nvmfd_rdma::soft::Faults {
    nvmfd_rdma::soft::Faults {
        seed,
        drop_per_million: r.drop,
        delay_per_million: r.delay,
        qp_fatal_per_million: r.qp_fatal,
        srq_error_per_million: r.srq_error,
        post_failure_per_million: r.post_failure,
        ..Default::default()
    }
}

/// The sum over the target's data paths of counter `k`.
fn dp_sum(stats: &Value, k: &str) -> u64 {
    stats["datapath"]
        .as_array()
        .map_or(0, |a| a.iter().filter_map(|r| r[k].as_u64()).sum())
}

/// Runs the stress described by `cfg`.
pub fn run(cfg: &Config) -> Report {
    let dir = tempfile::Builder::new()
        .prefix("nvmfd-stress")
        .tempdir()
        .expect("tempdir");
    let file = dir.path().join("ns2.img");
    std::fs::File::create(&file)
        .and_then(|f| f.set_len(16 << 20))
        .expect("namespace file");
    let d = Daemon::start(daemon_options(cfg, &file));
    let addr = listener_addr(&d);
    let mut host = Host::new(cfg, addr);
    let mut report = Report {
        seed: cfg.seed,
        ..Report::default()
    };
    host.setup(&mut report);
    target_faults(&d, cfg.seed, cfg.target_faults);
    host.fabric
        .set_faults(host_faults(cfg.seed ^ 0x005e_ed0f_4057, cfg.host_faults));
    let start = Instant::now();
    let mut last_quiet = start;
    let mut last_print = start;
    while start.elapsed() < cfg.duration && report.mismatches.len() < 20 {
        host.turn(&mut report);
        if last_quiet.elapsed() > Duration::from_secs(2) {
            quiet_point(&d, &mut host, &mut report, true);
            last_quiet = Instant::now();
        }
        if let Some(every) = cfg.progress {
            if last_print.elapsed() >= every {
                report.elapsed = start.elapsed();
                count_faults(&d, &host, &mut report);
                eprintln!("stress: {}", report.line());
                last_print = Instant::now();
            }
        }
    }
    report.elapsed = start.elapsed();
    count_faults(&d, &host, &mut report);
    // Faults off: the model's last word is a read of everything.
    target_faults(&d, 0, Rates::default());
    host.fabric.set_faults(nvmfd_rdma::soft::Faults::default());
    quiet_point(&d, &mut host, &mut report, true);
    if cfg.sabotage {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&file)
            .expect("the namespace file");
        f.write_all_at(&vec![0xa5; 1 << 20], 0).expect("overwrite");
        f.sync_all().expect("sync");
    }
    host.final_check(&mut report);
    host.disconnect_all(&mut report);
    pools_full(&d, &mut report);
    report
}

fn count_faults(d: &Daemon, host: &Host, report: &mut Report) {
    let injected = hook(
        d,
        &json!({"request": "debug_fault", "listener": 0, "fault": "count"}),
    );
    if let Some(m) = injected["injected"].as_object() {
        report.target_faults = m
            .iter()
            .map(|(k, v)| (k.clone(), v.as_u64().unwrap_or(0)))
            .collect();
    }
    let h = host.fabric.injected();
    report.host_faults = [
        ("drops", h.drops),
        ("delays", h.delays),
        ("qp_fatals", h.qp_fatals),
        ("srq_errors", h.srq_errors),
        ("post_failures", h.post_failures),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
}

/// Waits (at most `limit`) until `cond` holds on the target's stats; else records why.
fn wait_stats(
    d: &Daemon,
    report: &mut Report,
    what: &str,
    limit: Duration,
    cond: impl Fn(&Value) -> bool,
) -> bool {
    let end = Instant::now() + limit;
    loop {
        let s = d.data("stats");
        if cond(&s) {
            return true;
        }
        if Instant::now() > end {
            let mut msg = format!("the target never reached {what} within {limit:?}:");
            for k in [
                "qps",
                "qps_draining",
                "block_ops_in_flight",
                "requests_active",
                "buffers_free",
                "buffers",
                "request_slots_free",
                "request_slots",
                "sends_in_flight",
                "srq_receives_posted",
                "srq_receives_registered",
            ] {
                let _ = write!(msg, " {k} {}", dp_sum(&s, k));
            }
            report.mismatches.push(msg);
            return false;
        }
        std::thread::yield_now();
    }
}

/// A quiet point: every outstanding command answered or failed, nothing in flight in the
/// target, and the tainted blocks read back and settled (`settle`).
fn quiet_point(d: &Daemon, host: &mut Host, report: &mut Report, settle: bool) {
    host.drain(report);
    let quiet = wait_stats(
        d,
        report,
        "no block operation in flight and no QP draining",
        Duration::from_secs(30),
        |s| dp_sum(s, "block_ops_in_flight") == 0 && dp_sum(s, "qps_draining") == 0,
    );
    if quiet && settle {
        host.settle(report);
        report.quiet_points += 1;
    }
}

/// Every controller gone: the target's pools are full again and nothing is draining.
fn pools_full(d: &Daemon, report: &mut Report) {
    wait_stats(
        d,
        report,
        "every pool full with no host connected",
        Duration::from_secs(30),
        |s| {
            dp_sum(s, "qps") == 0
                && dp_sum(s, "qps_draining") == 0
                && dp_sum(s, "requests_active") == 0
                && dp_sum(s, "block_ops_in_flight") == 0
                && dp_sum(s, "buffers_free") == dp_sum(s, "buffers")
                && dp_sum(s, "request_slots_free") == dp_sum(s, "request_slots")
                && dp_sum(s, "sends_in_flight") == 0
                && dp_sum(s, "srq_receives_posted") == dp_sum(s, "srq_receives_registered")
        },
    );
    let s = d.data("stats");
    for k in [
        "teardowns_disconnect_total",
        "teardowns_qp_error_total",
        "teardowns_controller_total",
        "qp_events_total",
        "srq_rebuilds_total",
        "drain_timeouts_total",
        "stale_completions_total",
        "commands_total",
    ] {
        report.target.insert(k.to_string(), dp_sum(&s, k));
    }
    if report
        .target
        .get("drain_timeouts_total")
        .copied()
        .unwrap_or(0)
        > 0
    {
        report
            .mismatches
            .push("a QP's drain timed out (something it waited for never came)".into());
    }
}

/// Model namespaces of the daemon's configuration, sized from Identify Namespace.
fn namespaces(sizes: &[(u32, usize, u64, bool)]) -> Vec<NsModel> {
    sizes
        .iter()
        .map(|&(nsid, bs, blocks, zeroes)| NsModel::new(nsid, bs, blocks, zeroes))
        .collect()
}
