//! The data path's cost per I/O: the real reactor thread (`nvmfd::inproc`) serving a null
//! namespace, and a host thread in this process over the soft provider's in-process wire.
//! For each case it prints IOPS and the CPU time the reactor thread and the host thread spent
//! per I/O (their schedstat run time over the I/Os completed).
//!
//!     cargo bench -p nvmfd --bench datapath                       every case, 3 s each
//!     cargo bench -p nvmfd --bench datapath -- --seconds 10 --json
//!     cargo bench -p nvmfd --bench datapath -- --case randread-4k-qd32 --ios 20000
//!
//! `--ios` runs for a number of I/Os instead of a time; `--manual` runs the target's work on
//! the host's thread, turn by turn, instead of on a reactor thread, so that nothing spins
//! while the other side runs (what `scripts/bench-datapath.sh` counts instructions over).

use std::sync::Arc;
use std::time::{Duration, Instant};

use nvmf_host::{Payload, PipelinedQueue, RdmaQueue};
use nvmfd::inproc::{InProcOptions, InProcTarget};
use nvmfd::reactor::{LoopConfig, ReactorWork};
use nvmfd::srq::SrqConfig;
use nvmfd_blockdev::{Device, DeviceSpec, Kind};
use nvmfd_nvme::host::{rw_sqe, AdminQueue, HostId, IoQueue};
use nvmfd_nvme::wire::{self, io_opcode};
use nvmfd_rdma::any::cm::CmChannel;
use serde_json::json;

const NQN: &str = "nqn.2024-01.io.nvmfd.bench:null";

/// One measured case.
#[derive(Clone, Copy, Debug)]
struct Case {
    name: &'static str,
    read: bool,
    size: u32,
    depth: u16,
}

const CASES: [Case; 6] = [
    Case {
        name: "randread-4k-qd1",
        read: true,
        size: 4096,
        depth: 1,
    },
    Case {
        name: "randread-4k-qd32",
        read: true,
        size: 4096,
        depth: 32,
    },
    Case {
        name: "randwrite-4k-qd1",
        read: false,
        size: 4096,
        depth: 1,
    },
    Case {
        name: "randwrite-4k-qd32",
        read: false,
        size: 4096,
        depth: 32,
    },
    Case {
        name: "read-128k-qd16",
        read: true,
        size: 128 * 1024,
        depth: 16,
    },
    Case {
        name: "write-128k-qd16",
        read: false,
        size: 128 * 1024,
        depth: 16,
    },
];

/// Nanoseconds thread `tid` of this process has run on a CPU (schedstat), or from its
/// user and system ticks where schedstat is missing.
fn cpu_ns(tid: &str) -> u64 {
    let base = format!("/proc/self/task/{tid}");
    if let Ok(s) = std::fs::read_to_string(format!("{base}/schedstat")) {
        if let Some(ns) = s.split_whitespace().next().and_then(|v| v.parse().ok()) {
            return ns;
        }
    }
    let stat = std::fs::read_to_string(format!("{base}/stat")).unwrap_or_default();
    // Fields after the command's closing parenthesis: utime is the 12th, stime the 13th.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<u64> = rest
        .split_whitespace()
        .filter_map(|v| v.parse().ok())
        .collect();
    // SAFETY: sysconf has no preconditions.
    let hz = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).unwrap_or(100);
    f.get(10)
        .zip(f.get(11))
        .map_or(0, |(u, s)| (u + s) * 1_000_000_000 / hz.max(1))
}

/// The thread ID of the thread named `name`.
fn tid_of(name: &str) -> Option<String> {
    std::fs::read_dir("/proc/self/task")
        .ok()?
        .flatten()
        .find_map(|e| {
            let comm = std::fs::read_to_string(e.path().join("comm")).ok()?;
            (comm.trim() == name).then(|| e.file_name().to_string_lossy().into_owned())
        })
}

/// The calling thread's ID.
fn self_tid() -> String {
    // SAFETY: gettid has no preconditions.
    unsafe { libc::gettid() }.to_string()
}

struct Figures {
    ios: u64,
    secs: f64,
    reactor_ns: u64,
    host_ns: u64,
    /// `--manual`: the time spent in the target's turns.
    target_ns: u64,
}

fn channel(t: &InProcTarget) -> CmChannel {
    CmChannel::Soft(nvmfd_rdma::soft::cm::CmChannel::new(&t.fabric).expect("CM channel"))
}

/// A controller with one I/O queue of `case`'s depth.
fn connect(t: &InProcTarget, case: Case) -> (AdminQueue<RdmaQueue>, IoQueue<PipelinedQueue>) {
    let host = HostId {
        nqn: "nqn.2014-08.org.nvmexpress:uuid:6e766d66-0000-4000-8000-0000000000be".into(),
        id: [0xbe; 16],
    };
    let q = RdmaQueue::connect(channel(t), t.addr, 0, 31, 4096, 4096).expect("admin queue");
    let mut admin = AdminQueue::connect(q, &host, NQN, 31, 0).expect("connect");
    admin.enable().expect("enable");
    admin.set_queue_count(1).expect("queues");
    let q = PipelinedQueue::connect(channel(t), t.addr, 1, case.depth.max(2), 4096, case.size)
        .expect("I/O queue");
    let io = IoQueue::connect(q, &host, NQN, admin.cntlid, 1, case.depth.max(2) - 1)
        .expect("connect I/O queue");
    (admin, io)
}

/// Who runs the target: the reactor thread (by its thread ID), or this thread, polling the
/// reactor's work between its own steps.
enum Runner<'a> {
    Reactor(&'a str),
    Manual(&'a mut dyn ReactorWork),
}

/// Runs `case` for `limit` (a time or a number of I/Os) after a short warm-up.
fn run(t: &InProcTarget, runner: &mut Runner<'_>, case: Case, limit: Limit) -> Figures {
    let (mut admin, mut io) = match runner {
        Runner::Reactor(_) => connect(t, case),
        // The target answers the connect only when polled: this thread polls it while
        // another connects.
        Runner::Manual(work) => std::thread::scope(|s| {
            let h = s.spawn(|| connect(t, case));
            while !h.is_finished() {
                // Not a spin: under an instruction counter the other thread must run.
                if !work.poll(Instant::now()) {
                    std::thread::sleep(Duration::from_micros(100));
                }
            }
            h.join().expect("connect")
        }),
    };
    let q = io.transport();
    let blocks = u64::from(case.size / 512);
    let slots = (1u64 << 30) / u64::from(case.size);
    let data = vec![0x5au8; case.size as usize];
    let mut rng = fastrand::Rng::with_seed(7);
    let mut done = Vec::new();
    // On one thread (`--manual`), the time spent in the target's turns: its CPU per I/O with
    // nothing spinning and no other thread contending for the wire.
    let in_target = std::cell::Cell::new(Duration::ZERO);
    let mut go = |runner: &mut Runner<'_>, until: &dyn Fn(u64, Instant) -> bool| {
        let (start, mut n) = (Instant::now(), 0u64);
        while !until(n, start) {
            while q.outstanding() < usize::from(case.depth) {
                let lba = rng.u64(0..slots) * blocks;
                let op = if case.read {
                    io_opcode::READ
                } else {
                    io_opcode::WRITE
                };
                let s = rw_sqe(op, 1, lba, wire::sat(blocks), false);
                let p = if case.read {
                    Payload::In(case.size as usize)
                } else {
                    Payload::Out(&data)
                };
                q.submit(0, s, p).expect("submit");
            }
            if let Runner::Manual(work) = runner {
                let t = Instant::now();
                work.poll(t);
                in_target.set(in_target.get() + t.elapsed());
            }
            q.poll(&mut done);
            for d in done.drain(..) {
                d.ok().expect("an I/O failed");
                n += 1;
            }
        }
        n
    };
    go(runner, &|n, _| n >= 2_000);
    let host_tid = self_tid();
    let reactor_ns = |r: &Runner<'_>| match r {
        Runner::Reactor(tid) => cpu_ns(tid),
        Runner::Manual(_) => 0,
    };
    let (r0, h0, t0) = (reactor_ns(runner), cpu_ns(&host_tid), Instant::now());
    in_target.set(Duration::ZERO);
    let ios = match limit {
        Limit::Time(d) => go(runner, &|_, s| s.elapsed() >= d),
        Limit::Ios(k) => go(runner, &|n, _| n >= k),
    };
    let secs = t0.elapsed().as_secs_f64();
    let (r1, h1) = (reactor_ns(runner), cpu_ns(&host_tid));
    let target_ns = u64::try_from(in_target.get().as_nanos()).unwrap_or(u64::MAX);
    while q.outstanding() > 0 {
        if let Runner::Manual(work) = runner {
            work.poll(Instant::now());
        }
        q.poll(&mut done);
        done.clear();
    }
    q.disconnect();
    admin.transport().disconnect();
    if let Runner::Manual(work) = runner {
        // The target takes the disconnects in.
        for _ in 0..200 {
            if !work.poll(Instant::now()) {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
    }
    Figures {
        ios,
        secs,
        reactor_ns: r1 - r0,
        host_ns: h1 - h0,
        target_ns,
    }
}

#[derive(Clone, Copy)]
enum Limit {
    Time(Duration),
    Ios(u64),
}

fn arg<T: std::str::FromStr>(args: &[String], name: &str) -> Option<T> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(|v| {
            v.parse()
                .unwrap_or_else(|_| panic!("{name}: bad value {v}"))
        })
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let json_out = args.iter().any(|a| a == "--json");
    let seconds: f64 = arg(&args, "--seconds").unwrap_or(3.0);
    let ios: Option<u64> = arg(&args, "--ios");
    let only: Option<String> = arg(&args, "--case");
    let cases: Vec<Case> = CASES
        .iter()
        .copied()
        .filter(|c| only.as_deref().is_none_or(|n| n == c.name))
        .collect();
    assert!(
        !cases.is_empty(),
        "no case named {only:?}; the cases: {:?}",
        CASES.map(|c| c.name)
    );
    let mut spec = DeviceSpec::new(Kind::Null);
    spec.size = 1 << 30;
    spec.block_size = 512;
    let manual = args.iter().any(|a| a == "--manual");
    let opts = InProcOptions {
        nqn: NQN.into(),
        namespaces: vec![(1, Device::open(&spec).expect("null namespace"))],
        port: 4420,
        srq: SrqConfig {
            initial: 256,
            max: 4096,
            low_watermark: 32,
            chunk: 64,
            shrink_delay: Duration::from_secs(30),
            cover_queues: true,
        },
        buffers: 256,
        small_buffers: 512,
        requests: 512,
        connect_timeout: Duration::from_secs(60),
        loop_cfg: LoopConfig {
            idle_sleep_after: Duration::from_millis(1),
            max_sleep: Duration::from_millis(500),
        },
        counters: Arc::default(),
        core: 0,
    };
    let (t, mut work) = if manual {
        let (t, w) = InProcTarget::start_manual(opts).expect("in-process target");
        (t, Some(w))
    } else {
        (InProcTarget::start(opts).expect("in-process target"), None)
    };
    let reactor = if manual {
        String::new()
    } else {
        tid_of("nvmfd-r0").expect("the reactor thread")
    };
    // The host thread on a core of its own, as fio on its own vCPU in the lab: left to the
    // scheduler, it sometimes shared the reactor's core with the spinning reactor and the
    // figures fell by two thirds.
    if !manual {
        let cores = core_affinity::get_core_ids().unwrap_or_default();
        match cores.iter().find(|c| c.id != 0) {
            Some(&c) if core_affinity::set_for_current(c) => {}
            _ => eprintln!("datapath: the host thread is not pinned off the reactor's core 0"),
        }
    }
    let mut runner = match work.as_deref_mut() {
        Some(w) => Runner::Manual(w),
        None => Runner::Reactor(&reactor),
    };
    let mut rows = Vec::new();
    for c in cases {
        let limit = ios.map_or(Limit::Time(Duration::from_secs_f64(seconds)), Limit::Ios);
        let f = run(&t, &mut runner, c, limit);
        let per = |ns: u64| ns as f64 / f.ios.max(1) as f64;
        let row = json!({
            "case": c.name,
            "ios": f.ios,
            "iops": f.ios as f64 / f.secs,
            "reactor_ns_per_io": per(f.reactor_ns),
            "host_ns_per_io": per(f.host_ns),
            "reactor_busy": f.reactor_ns as f64 / (f.secs * 1e9),
            "target_turns_ns_per_io": per(f.target_ns),
        });
        if !json_out && manual {
            println!(
                "{:<18} {:>9.0} IOPS  host and target on one thread: {:>7.0} ns/IO, \
                 of which in the target's turns {:>6.0} ns/IO",
                c.name,
                row["iops"].as_f64().unwrap_or(0.0),
                per(f.host_ns),
                per(f.target_ns)
            );
        } else if !json_out {
            println!(
                "{:<18} {:>9.0} IOPS  reactor {:>7.0} ns/IO (busy {:>5.1}%)  host {:>7.0} ns/IO",
                c.name,
                row["iops"].as_f64().unwrap_or(0.0),
                per(f.reactor_ns),
                row["reactor_busy"].as_f64().unwrap_or(0.0) * 100.0,
                per(f.host_ns)
            );
        }
        rows.push(row);
    }
    if json_out {
        println!("{}", serde_json::Value::Array(rows));
    }
}
