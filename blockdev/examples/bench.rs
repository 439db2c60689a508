//! Drives the io_uring backend the way fio's io_uring engine drives a file, and prints one JSON
//! line with the result. `scripts/bench-blockdev.sh` runs it beside fio and prints the ratios.
//!
//!     blockdev-bench --file /var/tmp/f --mode randread --bs 4096 --qd 32 --runtime 10

// Sizes and counters in this file are small and known: casts cannot truncate.
#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use nvmfd_blockdev::{BufPool, Device, DeviceSpec, Engine, Kind};

/// The bytes of fio's `--buffer_pattern=0x6e766d66`.
const PATTERN: [u8; 4] = [0x6e, 0x76, 0x6d, 0x66];

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq)]
enum Mode {
    Randread,
    Seqwrite,
}

#[derive(Parser, Debug)]
struct Args {
    /// File or block device to run against (it must exist; its whole size is used).
    #[arg(long)]
    file: std::path::PathBuf,
    #[arg(long, value_enum)]
    mode: Mode,
    /// Block size in bytes.
    #[arg(long, default_value_t = 4096)]
    bs: usize,
    /// Operations kept in flight.
    #[arg(long, default_value_t = 32)]
    qd: u32,
    /// Seconds to run.
    #[arg(long, default_value_t = 10)]
    runtime: u64,
    /// When to submit: `each` operation as it is queued (as fio does with its default
    /// iodepth_batch_submit=1), then block for a completion; once per loop `turn` for
    /// everything queued in it, blocking for a completion in the same system call; or once
    /// per turn of a loop that never blocks (`poll`), as a reactor runs the engine: it reaps
    /// without a system call and spins.
    #[arg(long, value_enum, default_value_t = Submit::Each)]
    submit: Submit,
    /// Do not register the buffers with io_uring (plain READ/WRITE instead of the fixed
    /// variants), as fio does by default.
    #[arg(long)]
    no_fixed: bool,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq)]
enum Submit {
    Each,
    Turn,
    Poll,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a = Args::parse();
    let kind = if std::fs::metadata(&a.file)?.file_type().is_file() {
        Kind::File
    } else {
        Kind::Bdev
    };
    let mut spec = DeviceSpec::new(kind);
    spec.path = Some(a.file.clone());
    if kind == Kind::File {
        spec.block_size = 4096;
    }
    let dev = Device::open(&spec)?;
    if let Some(why) = dev.warning() {
        eprintln!("warning: {why}");
    }
    let pool = BufPool::new(a.qd, a.bs, false)?;
    let registered = if a.no_fixed {
        &[][..]
    } else {
        std::slice::from_ref(&pool)
    };
    let mut engine = Engine::new(a.qd, 1, registered)?;
    let id = engine.attach(&dev)?;
    let blocks = dev.info().size / a.bs as u64;
    let mut rng = fastrand::Rng::with_seed(0x2545_f491_4f6c_dd1d);
    let mut next_seq = 0u64;
    let mut done_ops = 0u64;
    let mut errors = 0u64;
    // The same contents as fio writes with `--buffer_pattern=0x6e766d66`: virtual disks and
    // storage arrays treat data differently (zero detection, compression, deduplication), so
    // both sides must write the same bytes.
    let mut spare = Vec::with_capacity(a.qd as usize);
    while let Some(mut b) = pool.take() {
        for chunk in b.as_mut_slice().chunks_mut(4) {
            chunk.copy_from_slice(&PATTERN[..chunk.len()]);
        }
        spare.push(b);
    }
    let start = Instant::now();
    let end = start + Duration::from_secs(a.runtime);
    while Instant::now() < end {
        while engine.in_flight() < a.qd as usize {
            let buf = spare.pop().or_else(|| pool.take()).expect("qd buffers");
            let block = match a.mode {
                Mode::Randread => rng.u64(0..blocks),
                Mode::Seqwrite => {
                    let b = next_seq;
                    next_seq = (next_seq + 1) % blocks;
                    b
                }
            };
            let off = block * a.bs as u64;
            let r = match a.mode {
                Mode::Randread => engine.read(id, off, buf, block),
                Mode::Seqwrite => engine.write(id, off, buf, false, block),
            };
            if let Err(e) = r {
                return Err(format!("queue: {}", e.error).into());
            }
            if a.submit == Submit::Each {
                engine.submit()?;
            }
        }
        if a.submit == Submit::Poll {
            engine.submit()?;
        } else {
            engine.wait(1)?;
        }
        engine.reap(|c| {
            done_ops += 1;
            if c.result.is_err() {
                errors += 1;
            }
            spare.extend(c.buf);
        });
    }
    let secs = start.elapsed().as_secs_f64();
    engine.drain(drop)?;
    let iops = done_ops as f64 / secs;
    println!(
        "{{\"engine\":\"nvmfd\",\"mode\":\"{:?}\",\"bs\":{},\"qd\":{},\"iops\":{:.0},\"mib_s\":{:.1},\"errors\":{},\"direct\":{},\"submit\":\"{:?}\"}}",
        a.mode,
        a.bs,
        a.qd,
        iops,
        iops * a.bs as f64 / (1 << 20) as f64,
        errors,
        dev.info().direct,
        a.submit
    );
    Ok(())
}
