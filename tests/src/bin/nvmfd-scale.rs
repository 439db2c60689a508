//! `nvmfd-scale`: many I/O queues on one reactor. Starts the release `nvmfd` (one reactor, a
//! soft listener on 127.0.0.1, a null namespace), connects `--queues` I/O queues from several
//! host processes over the soft provider's TCP wire, and prints what the target pays for
//! them: receive memory registered (beside what a receive queue per QP of the same depths
//! would register), the process's RSS and threads, the reactor's CPU while every queue is
//! connected and idle, the latency of the first I/O after the idle time, and the receive
//! memory during a burst on every queue and after it.
//!
//!     nvmfd-scale --queues 1024 --processes 8 --depth 128
//!
//! Each host process is this program again (`nvmfd-scale host ...`), driven over its stdin
//! with one-line requests (`ping`, `burst SECONDS`, `quit`) and answering on its stdout.

// Figures are printed with a few digits: casts of counts to f64 cannot lose what is shown.
#![allow(clippy::cast_precision_loss, clippy::cast_possible_truncation)]

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Child, ChildStdin, ChildStdout, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use nvmf_host::{Payload, PipelinedQueue, RdmaQueue};
use nvmfd_nvme::host::{rw_sqe, AdminQueue, HostError, HostId, IoQueue};
use nvmfd_rdma::any::cm::CmChannel;
use nvmfd_tests::{Daemon, Options};
use serde_json::Value;

const SUBSYSTEM: &str = "nqn.2024-01.io.nvmfd.scale:null0";
/// Bytes of one receive: the command and the in-capsule data the configuration allows.
const RECEIVE_BYTES: u64 = 64 + 4096;
/// I/O queues per controller (the target's `max_io_queues` default).
const QUEUES_PER_CONTROLLER: u32 = 64;
/// Bytes of a read.
const IO: usize = 4096;

#[derive(Parser, Debug)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    role: Option<Role>,
    /// I/O queues in all.
    #[arg(long, default_value_t = 1024)]
    queues: u32,
    /// Host processes they are spread over.
    #[arg(long, default_value_t = 8)]
    processes: u32,
    /// Depth of every I/O queue (the Linux host's default is 128).
    #[arg(long, default_value_t = 128)]
    depth: u16,
    /// Seconds every queue stays idle while the reactor's CPU is measured.
    #[arg(long, default_value_t = 10)]
    idle: u64,
    /// Seconds of the burst, every queue reading at `--burst-depth`.
    #[arg(long, default_value_t = 3)]
    burst: u64,
    /// Reads each queue keeps outstanding in the burst.
    #[arg(long, default_value_t = 8)]
    burst_depth: u16,
    /// The target's `srq_cover_queues`: keep a receive for every command the connected
    /// queues may have outstanding (up to `srq_max`), or size the SRQ by load alone.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    cover_queues: bool,
    /// The target's `srq_shrink_delay`, in seconds.
    #[arg(long, default_value_t = 2)]
    shrink_delay: u64,
    /// The `nvmfd` binary (default: next to this program).
    #[arg(long)]
    nvmfd: Option<std::path::PathBuf>,
}

#[derive(Subcommand, Debug)]
enum Role {
    /// One host process (started by the driver).
    Host {
        #[arg(long)]
        addr: SocketAddr,
        /// Host number: its NQN and host ID.
        #[arg(long)]
        n: u8,
        #[arg(long)]
        queues: u32,
        #[arg(long)]
        depth: u16,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match &cli.role {
        Some(Role::Host {
            addr,
            n,
            queues,
            depth,
        }) => host_main(*addr, *n, *queues, *depth),
        None => drive(&cli),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nvmfd-scale: {e}");
            ExitCode::FAILURE
        }
    }
}

// ---- the host processes ----

fn host_id(n: u8) -> HostId {
    HostId {
        nqn: format!("nqn.2014-08.org.nvmexpress:uuid:5ca1e000-0000-4000-8000-0000000000{n:02x}"),
        id: [n; 16],
    }
}

fn channel() -> Result<CmChannel, HostError> {
    let f = nvmfd_rdma::soft::Fabric::networked();
    f.add_device("0.0.0.0".parse().expect("address"))
        .map_err(|e| HostError::Transport(e.to_string()))?;
    Ok(CmChannel::Soft(
        nvmfd_rdma::soft::cm::CmChannel::new(&f)
            .map_err(|e| HostError::Transport(e.to_string()))?,
    ))
}

struct HostSide {
    admins: Vec<AdminQueue<RdmaQueue>>,
    ios: Vec<IoQueue<PipelinedQueue>>,
    lba: u64,
}

fn host_main(addr: SocketAddr, n: u8, queues: u32, depth: u16) -> Result<(), String> {
    let id = host_id(n);
    fn e(what: &'static str) -> impl Fn(HostError) -> String {
        move |err| format!("{what}: {err}")
    }
    let mut h = HostSide {
        admins: Vec::new(),
        ios: Vec::new(),
        lba: u64::from(n) * 4096,
    };
    let mut left = queues;
    while left > 0 {
        let here = left.min(QUEUES_PER_CONTROLLER);
        let q = RdmaQueue::connect(channel().map_err(e("channel"))?, addr, 0, 31, 4096, 4096)
            .map_err(e("admin queue"))?;
        // No keep-alive: the queues stay idle as long as the driver says.
        let mut admin = AdminQueue::connect(q, &id, SUBSYSTEM, 31, 0).map_err(e("connect"))?;
        admin.enable().map_err(e("enable"))?;
        let granted = admin
            .set_queue_count(u16::try_from(here).unwrap_or(u16::MAX))
            .map_err(e("queue count"))?;
        if u32::from(granted) < here {
            return Err(format!("{granted} I/O queues granted, {here} asked for"));
        }
        for qid in 1..=u16::try_from(here).unwrap_or(u16::MAX) {
            let pq = PipelinedQueue::connect(
                channel().map_err(e("channel"))?,
                addr,
                qid,
                depth,
                4096,
                IO as u32,
            )
            .map_err(e("I/O queue"))?;
            let io = IoQueue::connect(pq, &id, SUBSYSTEM, admin.cntlid, qid, depth - 1)
                .map_err(e("I/O connect"))?;
            h.ios.push(io);
        }
        h.admins.push(admin);
        left -= here;
    }
    let mut out = std::io::stdout().lock();
    writeln!(out, "ready {}", h.ios.len()).map_err(|e| e.to_string())?;
    out.flush().map_err(|e| e.to_string())?;
    for line in std::io::stdin().lock().lines() {
        let line = line.map_err(|e| e.to_string())?;
        let answer = match line.split_whitespace().collect::<Vec<_>>()[..] {
            ["ping"] => h.ping()?,
            ["burst", secs, depth] => h.burst(
                Duration::from_secs(secs.parse().map_err(|_| "burst seconds")?),
                depth.parse().map_err(|_| "burst depth")?,
            )?,
            ["quit"] => break,
            _ => return Err(format!("unknown request {line:?}")),
        };
        writeln!(out, "{answer}").map_err(|e| e.to_string())?;
        out.flush().map_err(|e| e.to_string())?;
    }
    for io in &mut h.ios {
        io.transport().disconnect();
    }
    for a in &mut h.admins {
        a.transport().disconnect();
    }
    Ok(())
}

impl HostSide {
    /// Submits a 4 KiB read on queue `q`.
    fn submit(&mut self, q: usize, tag: u64) -> Result<(), String> {
        self.lba = (self.lba + 1) % 1024;
        let sqe = rw_sqe(0x02, 1, self.lba * 8, 8, false);
        self.ios[q]
            .transport()
            .submit(tag, sqe, Payload::In(IO))
            .map(drop)
            .map_err(|e| format!("queue {q}: {e}"))
    }

    /// Waits for `n` completions on queue `q`.
    fn reap(&mut self, q: usize, n: usize, done: &mut Vec<nvmf_host::Done>) -> Result<(), String> {
        let before = done.len();
        while done.len() - before < n {
            let t = self.ios[q].transport();
            if t.poll(done) == 0 {
                // The soft wire's threads need the CPU this process would spin on.
                std::thread::yield_now();
            }
            if let Some(why) = t.broken() {
                return Err(format!("queue {q}: {why}"));
            }
        }
        for d in &done[before..] {
            d.ok().map_err(|e| format!("queue {q}: {e}"))?;
        }
        Ok(())
    }

    /// One read on each queue in turn: the latency of the first, the median and the longest.
    fn ping(&mut self) -> Result<String, String> {
        let mut lat = Vec::with_capacity(self.ios.len());
        let mut done = Vec::new();
        for q in 0..self.ios.len() {
            let t0 = Instant::now();
            self.submit(q, 0)?;
            self.reap(q, 1, &mut done)?;
            lat.push(t0.elapsed().as_nanos() as u64);
            done.clear();
        }
        let first = lat[0];
        lat.sort_unstable();
        Ok(format!(
            "ping {first} {} {}",
            lat[lat.len() / 2],
            lat[lat.len() - 1]
        ))
    }

    /// Every queue keeps `depth` reads outstanding for `time`; answers the reads done.
    fn burst(&mut self, time: Duration, depth: usize) -> Result<String, String> {
        let end = Instant::now() + time;
        let mut done = Vec::new();
        let mut ios = 0u64;
        for q in 0..self.ios.len() {
            for _ in 0..depth {
                self.submit(q, 0)?;
            }
        }
        while Instant::now() < end {
            let mut any = false;
            for q in 0..self.ios.len() {
                done.clear();
                let t = self.ios[q].transport();
                t.poll(&mut done);
                if let Some(why) = t.broken() {
                    return Err(format!("queue {q}: {why}"));
                }
                for d in &done {
                    d.ok().map_err(|e| format!("queue {q}: {e}"))?;
                }
                ios += done.len() as u64;
                any |= !done.is_empty();
                for _ in 0..done.len() {
                    self.submit(q, 0)?;
                }
            }
            if !any {
                std::thread::yield_now();
            }
        }
        for q in 0..self.ios.len() {
            let n = self.ios[q].transport().outstanding();
            done.clear();
            self.reap(q, n, &mut done)?;
            ios += n as u64;
        }
        Ok(format!("burst {ios}"))
    }
}

// ---- the driver ----

struct Proc {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Proc {
    /// Host process `n` (this program again) connecting `queues` I/O queues of `depth`.
    fn start(addr: SocketAddr, n: u32, queues: u32, depth: u16) -> Result<Proc, String> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut child = Command::new(exe)
            .args(["host", "--addr", &addr.to_string(), "--n"])
            .arg(n.to_string())
            .args(["--queues", &queues.to_string(), "--depth"])
            .arg(depth.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("starting a host process: {e}"))?;
        let stdin = child.stdin.take().expect("piped");
        let stdout = BufReader::new(child.stdout.take().expect("piped"));
        Ok(Proc {
            child,
            stdin,
            stdout,
        })
    }

    /// The number in the next answer, which must start with `prefix`.
    fn number(&mut self, prefix: &str) -> Result<u64, String> {
        let a = self.answer()?;
        a.strip_prefix(prefix)
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| format!("host process said {a:?}"))
    }

    fn ask(&mut self, line: &str) -> Result<(), String> {
        writeln!(self.stdin, "{line}").map_err(|e| format!("host process: {e}"))
    }

    fn answer(&mut self) -> Result<String, String> {
        let mut s = String::new();
        let n = self
            .stdout
            .read_line(&mut s)
            .map_err(|e| format!("host process: {e}"))?;
        if n == 0 {
            let status = self.child.wait().map_err(|e| e.to_string())?;
            return Err(format!(
                "a host process ended ({status}); its errors are above"
            ));
        }
        Ok(s.trim().to_owned())
    }
}

fn config(cli: &Cli) -> String {
    let port = nvmfd_tests::test_port();
    format!(
        r#"[daemon]
reactor_cores = [0]
admin_socket = "@DIR@/admin.sock"

[transport]
max_queue_depth = {depth}
srq_cover_queues = {cover}
srq_shrink_delay = "{shrink}s"

[[listener]]
address = "127.0.0.1"
port = {port}
provider = "soft"

[[subsystem]]
nqn = "{SUBSYSTEM}"
allow_any_host = true

[[subsystem.namespace]]
nsid = 1
backend = "null"
size = "1GiB"
"#,
        depth = cli.depth.max(128),
        cover = cli.cover_queues,
        shrink = cli.shrink_delay,
    )
}

/// The target's data-path figures (one reactor).
fn stats(d: &Daemon) -> Result<Value, String> {
    let v = d
        .try_request(r#"{"request":"stats"}"#)
        .map_err(|e| format!("stats: {e}"))?;
    let dp = &v["data"]["datapath"];
    dp.as_array()
        .and_then(|a| a.first())
        .cloned()
        .ok_or_else(|| format!("no data path in the stats: {v}"))
}

fn gauge(s: &Value, key: &str) -> u64 {
    s[key].as_u64().unwrap_or(0)
}

/// `VmRSS` and `Threads` of process `pid`, in KiB and threads.
fn rss_threads(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("Threads:"))
}

/// CPU ticks (user + system) of thread `tid` of `pid`, or of the whole process.
fn cpu_ticks(pid: u32, tid: Option<u32>) -> u64 {
    let path = match tid {
        Some(t) => format!("/proc/{pid}/task/{t}/stat"),
        None => format!("/proc/{pid}/stat"),
    };
    let s = std::fs::read_to_string(path).unwrap_or_default();
    // Fields after the command name (which may hold spaces): state is field 3; utime 14, stime 15.
    let rest = s.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<u64> = rest
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|x| x.parse().ok())
        .collect();
    f.iter().sum()
}

fn reactor_tid(pid: u32) -> Option<u32> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .ok()?
        .flatten()
        .find(|t| {
            std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim() == "nvmfd-r0")
        })
        .and_then(|t| t.file_name().to_str()?.parse().ok())
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / f64::from(1u32 << 20)
}

/// The target under test, the host processes and the figures taken once all connected.
struct Run<'a> {
    cli: &'a Cli,
    d: Daemon,
    pid: u32,
    procs: Vec<Proc>,
    /// I/O queues connected.
    connected: u64,
    /// Stats with every queue connected, before any I/O.
    connected_stats: Value,
    /// Receives registered then.
    connected_receives: u64,
}

fn drive(cli: &Cli) -> Result<(), String> {
    if cli.processes == 0 || cli.queues < cli.processes || cli.depth < 2 {
        return Err(
            "--queues must be at least --processes (at least 1), --depth at least 2".into(),
        );
    }
    if cli.processes > 250 {
        return Err("at most 250 host processes".into());
    }
    let mut run = Run::connect(cli)?;
    run.idle()?;
    run.first_io()?;
    run.burst()?;
    let back = run.settle();
    for p in &mut run.procs {
        let _ = p.ask("quit");
    }
    for p in &mut run.procs {
        let _ = p.child.wait();
    }
    if !back? {
        return Err("the shared receive queue did not shrink back after the burst".into());
    }
    Ok(())
}

impl Run<'_> {
    /// Starts nvmfd and the host processes, and waits until every queue is connected.
    fn connect(cli: &Cli) -> Result<Run<'_>, String> {
        let nvmfd = match &cli.nvmfd {
            Some(p) => p.clone(),
            None => nvmfd_tests::bin("nvmfd"),
        };
        let d = Daemon::start(Options {
            config: Some(config(cli)),
            binary: Some(nvmfd),
            ..Options::default()
        });
        let pid = d.child.id();
        let s0 = stats(&d)?;
        let (rss0, threads0) = rss_threads(pid);
        let reg0 = gauge(&s0, "srq_receives_registered");
        println!(
            "scale: {} I/O queues of depth {} from {} host processes over soft TCP to one reactor; srq_cover_queues {}, srq_shrink_delay {} s",
            cli.queues, cli.depth, cli.processes, cli.cover_queues, cli.shrink_delay
        );
        println!(
            "before:    {reg0:>6} receives registered ({:>7.1} MiB), RSS {:>7.1} MiB, {threads0} threads",
            mib(reg0 * RECEIVE_BYTES),
            rss0 as f64 / 1024.0
        );
        let t_connect = Instant::now();
        let procs = (0..cli.processes)
            .map(|p| {
                let share = cli.queues / cli.processes + u32::from(p < cli.queues % cli.processes);
                Proc::start(d.soft_addr(), p + 1, share, cli.depth)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut run = Run {
            cli,
            d,
            pid,
            procs,
            connected: 0,
            connected_stats: Value::Null,
            connected_receives: 0,
        };
        for p in &mut run.procs {
            run.connected += p.number("ready ")?;
        }
        run.connected_stats = stats(&run.d)?;
        run.connected_receives = gauge(&run.connected_stats, "srq_receives_registered");
        run.print_connected(t_connect.elapsed());
        Ok(run)
    }

    fn print_connected(&self, connect_time: Duration) {
        let (s1, reg1) = (&self.connected_stats, self.connected_receives);
        let (rss1, threads1) = rss_threads(self.pid);
        let per_qp = self.connected * u64::from(self.cli.depth);
        println!(
            "connected: {} I/O queues ({} QPs with the admin queues) in {:.1} s",
            self.connected,
            gauge(s1, "qps"),
            connect_time.as_secs_f64()
        );
        println!(
            "           {reg1:>6} receives registered ({:>7.1} MiB), {} reserved, {} posted; RSS {:>7.1} MiB, {threads1} threads (the soft provider's TCP wire: two per QP)",
            mib(reg1 * RECEIVE_BYTES),
            gauge(s1, "srq_receives_reserved"),
            gauge(s1, "srq_receives_posted"),
            rss1 as f64 / 1024.0
        );
        println!(
            "per-QP receive queues of the same depths: {per_qp} receives ({:.1} MiB); the shared queue registers {:.4} of that (1/{:.1})",
            mib(per_qp * RECEIVE_BYTES),
            reg1 as f64 / per_qp as f64,
            per_qp as f64 / reg1.max(1) as f64
        );
    }

    /// The reactor's CPU over the idle window, every queue connected and quiet.
    fn idle(&self) -> Result<(), String> {
        let tid = reactor_tid(self.pid).ok_or("no reactor thread nvmfd-r0")?;
        let hz = 100.0; // USER_HZ: the unit of /proc's CPU times on Linux
        let ticks = || (cpu_ticks(self.pid, Some(tid)), cpu_ticks(self.pid, None));
        let ((r0, p0), w0) = (ticks(), Instant::now());
        std::thread::sleep(Duration::from_secs(self.cli.idle));
        let ((r1, p1), wall) = (ticks(), w0.elapsed());
        let s_idle = stats(&self.d)?;
        println!(
            "idle {:.1} s: reactor thread {:.2}% of a core, the whole process {:.2}%; {} commands meanwhile",
            wall.as_secs_f64(),
            100.0 * (r1 - r0) as f64 / hz / wall.as_secs_f64(),
            100.0 * (p1 - p0) as f64 / hz / wall.as_secs_f64(),
            gauge(&s_idle, "commands_total") - gauge(&self.connected_stats, "commands_total")
        );
        Ok(())
    }

    /// The first I/O after the idle time, then one on every queue of that process.
    fn first_io(&mut self) -> Result<(), String> {
        self.procs[0].ask("ping")?;
        let a = self.procs[0].answer()?;
        let v: Vec<u64> = a
            .strip_prefix("ping ")
            .map(|r| r.split(' ').filter_map(|x| x.parse().ok()).collect())
            .unwrap_or_default();
        if v.len() != 3 {
            return Err(format!("host process said {a:?}"));
        }
        println!(
            "first I/O after idling: {:.1} us; then one read on each of that process's queues: median {:.1} us, longest {:.1} us",
            v[0] as f64 / 1e3,
            v[1] as f64 / 1e3,
            v[2] as f64 / 1e3
        );
        Ok(())
    }

    /// A burst on every queue at once, the receives registered sampled meanwhile.
    fn burst(&mut self) -> Result<(), String> {
        let ask = format!("burst {} {}", self.cli.burst, self.cli.burst_depth);
        for p in &mut self.procs {
            p.ask(&ask)?;
        }
        let start = Instant::now();
        let mut peak = 0;
        let (d, procs) = (&self.d, &mut self.procs);
        let reads = std::thread::scope(|scope| {
            let h = scope.spawn(|| {
                let mut total = 0u64;
                for p in procs.iter_mut() {
                    total += p.number("burst ")?;
                }
                Ok::<u64, String>(total)
            });
            while !h.is_finished() {
                if let Ok(s) = stats(d) {
                    peak = peak.max(gauge(&s, "srq_receives_registered"));
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            h.join().map_err(|_| "burst thread".to_owned())
        })??;
        let time = start.elapsed();
        let s2 = stats(&self.d)?;
        peak = peak.max(gauge(&s2, "srq_receives_registered"));
        let grew = |k: &str| gauge(&s2, k) - gauge(&self.connected_stats, k);
        println!(
            "burst {:.1} s, {} reads outstanding per queue: {reads} reads ({:.0} IOPS); receives registered at most {peak} ({:.1} MiB); SRQ grew {} times, limit events {}, at max {}, empty {}",
            time.as_secs_f64(),
            self.cli.burst_depth,
            reads as f64 / time.as_secs_f64(),
            mib(peak * RECEIVE_BYTES),
            grew("srq_grows_total"),
            grew("srq_limit_events_total"),
            grew("srq_at_max_total"),
            grew("srq_empty_total"),
        );
        Ok(())
    }

    /// Back to the connected size? An SRQ cannot withdraw a posted receive: a chunk chosen to
    /// shrink leaves once traffic has consumed its receives. So after the burst every queue
    /// keeps a light load (one read at a time, each process going round its queues) until the
    /// registered receives are back, or the time limit. True when they are.
    fn settle(&mut self) -> Result<bool, String> {
        let reg1 = self.connected_receives;
        let back = Instant::now();
        let limit = Duration::from_secs(self.cli.shrink_delay * 30 + 60);
        let mut trickle = 0u64;
        let reg3 = loop {
            let r = gauge(&stats(&self.d)?, "srq_receives_registered");
            if r <= reg1 || back.elapsed() > limit {
                break r;
            }
            for p in &mut self.procs {
                p.ask("ping")?;
            }
            for p in &mut self.procs {
                let a = p.answer()?;
                if !a.starts_with("ping ") {
                    return Err(format!("host process said {a:?}"));
                }
            }
            trickle += self.connected;
        };
        let (rss3, _) = rss_threads(self.pid);
        println!(
            "after the burst: {reg3} receives registered ({:.1} MiB) {:.1} s after it ended, {trickle} reads of light load later{}; RSS {:.1} MiB",
            mib(reg3 * RECEIVE_BYTES),
            back.elapsed().as_secs_f64(),
            if reg3 <= reg1 {
                " (the connected size again)"
            } else {
                " (NOT back to the connected size)"
            },
            rss3 as f64 / 1024.0
        );
        Ok(reg3 <= reg1)
    }
}
