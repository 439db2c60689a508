//! The seeded stress of the real daemon (`nvmfd_tests::stress`) in the test command: a few
//! seeds, each for a short while, with every kind of fault on both sides of the wire. The
//! long runs are `scripts/stress.sh`. `NVMFD_STRESS_SEED` replays one seed;
//! `NVMFD_STRESS_SECONDS` sets how long each runs (default 12).

use std::time::Duration;

use nvmfd_tests::stress::{self, Config, Report};

fn seconds() -> u64 {
    std::env::var("NVMFD_STRESS_SECONDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(12)
}

fn fault(m: &std::collections::BTreeMap<String, u64>, k: &str) -> u64 {
    m.get(k).copied().unwrap_or(0)
}

#[test]
fn seeded_stress_of_the_real_daemon_breaks_no_acknowledged_write() {
    let seeds: Vec<u64> = match std::env::var("NVMFD_STRESS_SEED") {
        Ok(v) => vec![v.parse().expect("NVMFD_STRESS_SEED is a number")],
        Err(_) => vec![1, 2],
    };
    let mut all: Vec<Report> = Vec::new();
    for &seed in &seeds {
        let mut cfg = Config::new(seed, Duration::from_secs(seconds()));
        // A short run: the rarest faults a little more often than by default, so that every
        // kind reaches both sides in a few seconds whatever the seed.
        cfg.host_faults.qp_fatal = 200;
        cfg.host_faults.srq_error = 150;
        cfg.host_faults.drop = 200;
        cfg.target_faults.srq_error = 80;
        cfg.target_faults.post_failure = 300;
        let r = stress::run(&cfg);
        eprintln!("{r}");
        assert!(
            r.mismatches.is_empty(),
            "seed {seed}: {} mismatches (replay with NVMFD_STRESS_SEED={seed}):\n{r}",
            r.mismatches.len()
        );
        all.push(r);
    }
    // The run proved something: the operations went through, every kind of fault hit both
    // sides, controllers were reset and reconnected, and quiet points settled blocks.
    let sum = |f: &dyn Fn(&Report) -> u64| all.iter().map(f).sum::<u64>();
    assert!(sum(&|r| r.total_ops()) > 2_000, "too few operations");
    assert!(sum(&|r| r.total_failed()) > 0, "no operation failed");
    for k in ["drops", "delays", "qp_fatals", "srq_errors"] {
        assert!(
            sum(&|r| fault(&r.target_faults, k)) > 0,
            "no {k} on the target's side"
        );
        assert!(
            sum(&|r| fault(&r.host_faults, k)) > 0,
            "no {k} on the host's side"
        );
    }
    assert!(sum(&|r| fault(&r.target_faults, "post_failures")) > 0);
    assert!(sum(&|r| r.resets) > 0, "no controller reset");
    assert!(
        sum(&|r| r.settled_blocks) > 0,
        "no quiet point settled a block"
    );
    assert!(sum(&|r| r.final_blocks) > 0);
    for k in [
        "write",
        "write_fua",
        "flush",
        "write_zeroes",
        "deallocate",
        "keep_alive",
    ] {
        assert!(
            all.iter().any(|r| r.ops.get(k).copied().unwrap_or(0) > 0),
            "no {k} was answered"
        );
    }
}

#[test]
fn the_stress_reports_a_block_changed_behind_the_targets_back() {
    let mut cfg = Config::new(7, Duration::from_secs(3));
    cfg.sabotage = true;
    let r = stress::run(&cfg);
    assert!(
        !r.mismatches.is_empty(),
        "the first MiB of the file namespace was overwritten, yet nothing was reported:\n{r}"
    );
    assert!(
        r.mismatches.iter().all(|m| m.starts_with("NSID 2 LBA ")),
        "only the overwritten blocks mismatch:\n{r}"
    );
}
