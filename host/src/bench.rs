//! `nvmf bench`: a load generator over [`PipelinedQueue`]s. Each thread connects its own
//! I/O queues and keeps each at its depth: reads and writes of one size, sequential (each
//! queue in its own part of the namespace) or random, mixed by a read percentage. Latency is
//! from submission to the completion's arrival, kept in an HDR histogram per queue; a
//! warm-up is run first and not counted.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use nvmfd_nvme::host::{rw_sqe, HostError, IoQueue};
use nvmfd_nvme::wire::{self, io_opcode};
use serde_json::{json, Value};

use crate::{Done, Payload, PipelinedQueue};

mod tracker;
use tracker::Tracker;

/// The access pattern.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pattern {
    /// Sequential reads.
    Read,
    /// Sequential writes.
    Write,
    /// Random reads.
    RandRead,
    /// Random writes.
    RandWrite,
    /// Random reads and writes, mixed by the read percentage.
    RandRw,
}

impl Pattern {
    /// Its name on the command line (`-w`).
    pub fn name(self) -> &'static str {
        match self {
            Pattern::Read => "read",
            Pattern::Write => "write",
            Pattern::RandRead => "randread",
            Pattern::RandWrite => "randwrite",
            Pattern::RandRw => "randrw",
        }
    }

    fn random(self) -> bool {
        matches!(
            self,
            Pattern::RandRead | Pattern::RandWrite | Pattern::RandRw
        )
    }
}

/// What to run.
#[derive(Clone, Debug)]
pub struct Job {
    /// The namespace.
    pub nsid: u32,
    /// Its block size and blocks.
    pub block_size: u32,
    /// Its capacity in blocks.
    pub blocks: u64,
    /// Bytes per I/O (a whole number of blocks).
    pub io_size: u32,
    /// Commands each queue keeps outstanding.
    pub depth: u16,
    /// The pattern.
    pub pattern: Pattern,
    /// Percentage of reads (`RandRw`; the others imply 100 or 0).
    pub read_pct: u32,
    /// I/O queues.
    pub queues: u16,
    /// Threads (each drives `queues / threads` queues, or one more).
    pub threads: u16,
    /// Measured time.
    pub time: Duration,
    /// Unmeasured time before it.
    pub warmup: Duration,
    /// Stamp every written block with its LBA, a stamp of its write and a pattern, and check
    /// every block read: intact, in its place, and from a write the read may see (once a
    /// write is acknowledged, no older one). Each thread works in its own part of the
    /// namespace, so it knows every write there. A block not written in the run may hold
    /// zeroes or any intact block.
    pub verify: bool,
}

/// One queue's figures.
#[derive(Debug)]
pub struct QueueFigures {
    /// Queue ID.
    pub qid: u16,
    /// I/Os completed in the measured time, and of them reads.
    pub ios: u64,
    pub reads: u64,
    /// Latencies in nanoseconds: of all, of the reads, of the writes.
    pub latency: Histogram<u64>,
    pub read_latency: Histogram<u64>,
    pub write_latency: Histogram<u64>,
    /// Blocks read back and found intact (with `verify`).
    pub verified: u64,
}

/// Counts shared with the progress line.
#[derive(Debug, Default)]
pub struct Progress {
    /// I/Os completed (warm-up included).
    pub ios: AtomicU64,
}

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000_000, 3).expect("valid bounds")
}

/// One queue of a thread: where it is in its part of the namespace, when each of its
/// commands left, and its figures.
struct Lane {
    /// Its index among the thread's lanes.
    index: usize,
    io: IoQueue<PipelinedQueue>,
    next: u64,
    sent_at: Vec<Instant>,
    /// Whether each slot's command is a read.
    is_read: Vec<bool>,
    /// With `verify`: each slot's write, when it is one: (place, stamp).
    writes: Vec<Option<(u64, u64)>>,
    /// With `verify`: a write's data, or a read's.
    scratch: Vec<u8>,
    block_size: u32,
    figures: QueueFigures,
}

/// What every lane of a thread shares.
struct Shape<'a> {
    job: &'a Job,
    /// Blocks per I/O.
    io_blocks: u64,
    /// The places this thread works in: all of them, or with `verify` its own part.
    part: std::ops::Range<u64>,
    data: Vec<u8>,
}

impl Lane {
    /// Submits commands until the queue is at its depth.
    fn fill(
        &mut self,
        sh: &Shape<'_>,
        rng: &mut fastrand::Rng,
        tracker: &mut Tracker,
    ) -> Result<(), String> {
        let job = sh.job;
        let q = self.io.transport();
        while q.outstanding() < usize::from(job.depth) {
            let at = if job.pattern.random() {
                rng.u64(sh.part.clone())
            } else {
                let at = self.next;
                self.next = if at + 1 >= sh.part.end {
                    sh.part.start
                } else {
                    at + 1
                };
                at
            };
            let read = match job.pattern {
                Pattern::Read | Pattern::RandRead => true,
                Pattern::Write | Pattern::RandWrite => false,
                Pattern::RandRw => rng.u32(0..100) < job.read_pct,
            };
            let opcode = if read {
                io_opcode::READ
            } else {
                io_opcode::WRITE
            };
            let nlb = wire::sat(sh.io_blocks);
            let s = rw_sqe(opcode, job.nsid, at * sh.io_blocks, nlb, false);
            let lba = at * sh.io_blocks;
            let mut write = None;
            let payload = if read {
                Payload::In(job.io_size as usize)
            } else if job.verify {
                let stamp = tracker.write_sent(at);
                verify::stamp(&mut self.scratch, lba, job.block_size, stamp);
                write = Some((at, stamp));
                Payload::Out(&self.scratch)
            } else {
                Payload::Out(&sh.data)
            };
            // The clock starts just before the post (`submit_timed`), after the host copied
            // the data in: a write's latency is not the host's copy of it.
            let (slot, sent_at) = q
                .submit_timed(0, s, payload)
                .map_err(|e| format!("I/O queue {}: {e}", self.figures.qid))?;
            self.sent_at[usize::from(slot)] = sent_at;
            self.is_read[usize::from(slot)] = read;
            if job.verify {
                self.writes[usize::from(slot)] = write;
                if read {
                    tracker.read_sent((self.index, slot), at);
                }
            }
        }
        Ok(())
    }

    /// Takes the completions in; counts them (and their latency when `measuring`).
    fn reap(
        &mut self,
        done: &mut Vec<Done>,
        measuring: bool,
        progress: &Progress,
        (tracker, io_blocks): (&mut Tracker, u64),
    ) -> Result<(), String> {
        self.io.transport().poll(done);
        let now = Instant::now();
        for d in done.drain(..) {
            d.ok()
                .map_err(|e| format!("I/O error on queue {}: {e}", self.figures.qid))?;
            if let Some((place, stamp)) = self
                .writes
                .get_mut(usize::from(d.slot))
                .and_then(Option::take)
            {
                tracker.write_done(place, stamp);
            }
            if let Some(r) = tracker.read_done((self.index, d.slot)) {
                let q = self.io.transport();
                q.data(d.slot, &mut self.scratch);
                let allowed = r.known.then_some(&r.allowed[..]);
                let lba = r.place * io_blocks;
                self.figures.verified +=
                    verify::check(&self.scratch, lba, self.block_size, allowed)
                        .map_err(|e| format!("verify, queue {}: {e}", self.figures.qid))?;
            }
            progress.ios.fetch_add(1, Ordering::Relaxed);
            if measuring {
                let ns = now
                    .duration_since(self.sent_at[usize::from(d.slot)])
                    .as_nanos();
                let ns = u64::try_from(ns).unwrap_or(u64::MAX).max(1);
                let f = &mut self.figures;
                f.ios += 1;
                let _ = f.latency.record(ns);
                if self.is_read[usize::from(d.slot)] {
                    f.reads += 1;
                    let _ = f.read_latency.record(ns);
                } else {
                    let _ = f.write_latency.record(ns);
                }
            }
        }
        Ok(())
    }
}

/// The work of one thread: queues `qids`, connected by `connect`.
fn thread_main(
    job: &Job,
    (thread, threads): (u16, u16),
    qids: &[u16],
    connect: &(dyn Fn(u16) -> Result<IoQueue<PipelinedQueue>, HostError> + Sync),
    start: &Barrier,
    stop: &AtomicBool,
    progress: &Progress,
) -> Result<Vec<QueueFigures>, String> {
    let mut queues = Vec::new();
    for &qid in qids {
        let q = connect(qid);
        // Everyone waits for every connection, failed or not.
        queues.push(q.map_err(|e| format!("connecting I/O queue {qid}: {e}")));
    }
    start.wait();
    let mut queues = queues.into_iter().collect::<Result<Vec<_>, _>>()?;
    if job.verify {
        for q in &mut queues {
            q.transport().poison_reads(true);
        }
    }
    let io_blocks = u64::from(job.io_size / job.block_size);
    let places = job.blocks / io_blocks;
    if places == 0 {
        return Err("the namespace is smaller than one I/O".into());
    }
    let part = if job.verify {
        let (t, n) = (u64::from(thread), u64::from(threads));
        let part = t * places / n..(t + 1) * places / n;
        if part.is_empty() {
            return Err(format!(
                "--verify gives each of the {threads} threads its own part of the namespace, \
                 and it holds only {places} I/Os of {} bytes",
                job.io_size
            ));
        }
        part
    } else {
        0..places
    };
    let sh = Shape {
        job,
        io_blocks,
        part,
        data: (0..job.io_size).map(|i| (i % 251) as u8).collect(),
    };
    let mut rng = fastrand::Rng::with_seed(u64::from(qids.first().copied().unwrap_or(0)));
    let mut tracker = Tracker::stamping_from(fastrand::u64(..));
    let lanes_here = qids.len().max(1) as u64;
    let mut lanes: Vec<Lane> = queues
        .into_iter()
        .zip(qids)
        .enumerate()
        .map(|(index, (io, &qid))| Lane {
            index,
            io,
            // Sequential patterns: each queue in its own part of the namespace (of the
            // thread's part, with `verify`).
            next: if job.verify {
                sh.part.start + index as u64 * ((sh.part.end - sh.part.start) / lanes_here)
            } else {
                (u64::from(qid) - 1) * (places / u64::from(job.queues))
            },
            sent_at: vec![Instant::now(); usize::from(job.depth) + 1],
            is_read: vec![false; usize::from(job.depth) + 1],
            writes: vec![None; usize::from(job.depth) + 1],
            scratch: vec![0; job.io_size as usize],
            block_size: job.block_size,
            figures: QueueFigures {
                qid,
                ios: 0,
                reads: 0,
                latency: histogram(),
                read_latency: histogram(),
                write_latency: histogram(),
                verified: 0,
            },
        })
        .collect();
    let began = Instant::now();
    let mut measuring = job.warmup.is_zero();
    let mut done = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        if !measuring && began.elapsed() >= job.warmup {
            measuring = true;
            for l in &mut lanes {
                let f = &mut l.figures;
                (f.ios, f.reads) = (0, 0);
                f.latency.reset();
                f.read_latency.reset();
                f.write_latency.reset();
            }
        }
        for l in &mut lanes {
            l.fill(&sh, &mut rng, &mut tracker)?;
            l.reap(&mut done, measuring, progress, (&mut tracker, io_blocks))?;
        }
    }
    // Every command sent is answered (its read checked) before the figures stand: a target
    // that stopped answering is an error, not lower figures.
    let end = Instant::now() + UNANSWERED_AFTER_RUN;
    for l in &mut lanes {
        while l.io.transport().outstanding() > 0 {
            if Instant::now() >= end {
                return Err(format!(
                    "queue {}: {} command(s) unanswered {UNANSWERED_AFTER_RUN:?} after the run",
                    l.figures.qid,
                    l.io.transport().outstanding()
                ));
            }
            l.reap(&mut done, false, progress, (&mut tracker, io_blocks))?;
            std::thread::yield_now();
        }
    }
    Ok(lanes
        .into_iter()
        .map(|mut l| {
            l.io.transport().disconnect();
            l.figures
        })
        .collect())
}

/// How long the commands still out when the run ends may take to be answered.
pub const UNANSWERED_AFTER_RUN: Duration = Duration::from_secs(10);

/// What a run measured: each queue's figures, and the time they were measured over (the job's
/// time, or less when the run was interrupted).
#[derive(Debug)]
pub struct Measured {
    pub figures: Vec<QueueFigures>,
    pub time: Duration,
    /// `interrupt` was raised before the job's time was up.
    pub interrupted: bool,
}

/// Runs `job`; `connect(qid)` connects I/O queue `qid` (with `job.depth` slots). Calls
/// `tick` with the I/Os so far about every 200 ms (the progress line). The run ends early,
/// with the figures so far, once `interrupt` is raised (SIGINT or SIGTERM in `nvmf bench`).
/// Calls `waiting` once if, 200 ms after the run ended, commands are still out (the threads
/// wait up to `UNANSWERED_AFTER_RUN` for them).
pub fn run(
    job: &Job,
    connect: &(dyn Fn(u16) -> Result<IoQueue<PipelinedQueue>, HostError> + Sync),
    tick: &mut dyn FnMut(u64, Duration),
    interrupt: &AtomicBool,
    waiting: &mut dyn FnMut(),
) -> Result<Measured, String> {
    if job.io_size == 0 || !job.io_size.is_multiple_of(job.block_size) {
        return Err(format!(
            "the I/O size ({} bytes) must be a whole number of {}-byte blocks",
            job.io_size, job.block_size
        ));
    }
    if job.io_size / job.block_size > 65536 {
        return Err(format!(
            "the I/O size ({} bytes) is more than 65,536 {}-byte blocks, the most one command \
             moves",
            job.io_size, job.block_size
        ));
    }
    let threads = job.threads.clamp(1, job.queues.max(1));
    let stop = AtomicBool::new(false);
    let progress = Progress::default();
    let start = Barrier::new(usize::from(threads) + 1);
    let results = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let qids: Vec<u16> = (1..=job.queues)
                    .filter(|q| (q - 1) % threads == t)
                    .collect();
                let (stop, progress, start) = (&stop, &progress, &start);
                scope.spawn(move || {
                    thread_main(job, (t, threads), &qids, connect, start, stop, progress)
                })
            })
            .collect();
        start.wait();
        let began = Instant::now();
        let end = began + job.warmup + job.time;
        let mut interrupted = false;
        while Instant::now() < end && !handles.iter().any(|h| h.is_finished()) {
            if interrupt.load(Ordering::Relaxed) {
                interrupted = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(200).min(end - Instant::now()));
            tick(progress.ios.load(Ordering::Relaxed), began.elapsed());
        }
        stop.store(true, Ordering::Relaxed);
        // The time run, to the moment the workers are told to stop (later than `end` on a
        // busy machine): the I/Os counted were done in it.
        let measured = began.elapsed().saturating_sub(job.warmup);
        let ended = Instant::now();
        let mut told = false;
        while !handles.iter().all(|h| h.is_finished()) {
            if !told && ended.elapsed() >= Duration::from_millis(200) {
                told = true;
                waiting();
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let results = handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a bench thread panicked".into()))
            })
            .collect::<Vec<_>>();
        (results, measured, interrupted)
    });
    let (results, time, interrupted) = results;
    let mut figures = Vec::new();
    for r in results {
        figures.extend(r?);
    }
    figures.sort_by_key(|f| f.qid);
    Ok(Measured {
        figures,
        time,
        interrupted,
    })
}

/// IOPS, MiB/s and latencies (µs) of `ios` I/Os of `io_size` bytes over `time` (latencies
/// `null` without I/Os).
pub fn summary(ios: u64, io_size: u32, time: Duration, h: &Histogram<u64>) -> Value {
    let secs = time.as_secs_f64().max(1e-9);
    let us = |v: u64| (v as f64) / 1000.0;
    json!({
        "ios": ios,
        "iops": (ios as f64) / secs,
        "mib_per_s": (ios as f64) * f64::from(io_size) / secs / f64::from(1u32 << 20),
        "latency_us": if h.is_empty() { Value::Null } else { json!({
            "min": us(h.min()),
            "mean": h.mean() / 1000.0,
            "p50": us(h.value_at_quantile(0.50)),
            "p90": us(h.value_at_quantile(0.90)),
            "p99": us(h.value_at_quantile(0.99)),
            "p99_9": us(h.value_at_quantile(0.999)),
            "max": us(h.max()),
        }) },
    })
}

/// The figures of every queue and their total, over the measured time.
pub fn report(job: &Job, m: &Measured) -> Value {
    let figures = &m.figures;
    let (mut total, mut reads, mut writes) = (histogram(), histogram(), histogram());
    for f in figures {
        let _ = total.add(&f.latency);
        let _ = reads.add(&f.read_latency);
        let _ = writes.add(&f.write_latency);
    }
    let ios: u64 = figures.iter().map(|f| f.ios).sum();
    let read_ios: u64 = figures.iter().map(|f| f.reads).sum();
    let mut total = summary(ios, job.io_size, m.time, &total);
    let mixed = job.pattern == Pattern::RandRw;
    if mixed {
        total["read"] = summary(read_ios, job.io_size, m.time, &reads);
        total["write"] = summary(ios - read_ios, job.io_size, m.time, &writes);
    }
    json!({
        "job": {
            "workload": job.pattern.name(),
            "nsid": job.nsid,
            "io_size": job.io_size,
            "block_size": job.block_size,
            "depth": job.depth,
            "read_pct": mixed.then_some(job.read_pct),
            "queues": job.queues,
            "threads": job.threads.min(job.queues),
            "warmup_seconds": job.warmup.as_secs_f64(),
            "verify": job.verify,
        },
        "queues": figures.iter().map(|f| {
            let mut v = summary(f.ios, job.io_size, m.time, &f.latency);
            v["qid"] = json!(f.qid);
            v
        }).collect::<Vec<_>>(),
        "total": total,
        "seconds": m.time.as_secs_f64(),
        "interrupted": m.interrupted,
        "verified_blocks": job.verify.then(|| figures.iter().map(|f| f.verified).sum::<u64>()),
    })
}

/// One line of `summary`'s figures.
pub fn line(v: &Value) -> String {
    let l = &v["latency_us"];
    let f = |k: &str| l[k].as_f64().unwrap_or(0.0);
    format!(
        "{:>10.0} IOPS {:>9.1} MiB/s  latency µs: min {:.1} mean {:.1} p50 {:.1} p90 {:.1} p99 {:.1} p99.9 {:.1} max {:.1}",
        v["iops"].as_f64().unwrap_or(0.0),
        v["mib_per_s"].as_f64().unwrap_or(0.0),
        f("min"),
        f("mean"),
        f("p50"),
        f("p90"),
        f("p99"),
        f("p99_9"),
        f("max")
    )
}

pub mod verify;

#[cfg(test)]
mod job_tests {
    use super::*;

    #[test]
    fn an_io_larger_than_one_command_moves_is_refused_before_connecting() {
        let job = Job {
            nsid: 1,
            block_size: 512,
            blocks: 1 << 30,
            io_size: 64 << 20,
            depth: 1,
            pattern: Pattern::Read,
            read_pct: 100,
            queues: 1,
            threads: 1,
            time: Duration::from_millis(10),
            warmup: Duration::ZERO,
            verify: false,
        };
        let connect =
            |_qid: u16| -> Result<IoQueue<PipelinedQueue>, HostError> { panic!("connected") };
        let refused = run(
            &job,
            &connect,
            &mut |_, _| {},
            &AtomicBool::new(false),
            &mut || {},
        );
        let Err(err) = refused else {
            panic!("not refused")
        };
        assert!(err.contains("more than 65,536 512-byte blocks"), "{err}");
    }
}
