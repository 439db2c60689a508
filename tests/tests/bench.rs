//! `nvmf bench` against the real nvmfd over the soft provider's TCP wire: figures per queue
//! and in total, in text and JSON, and clear errors with a non-zero exit.

use std::process::Command;

use nvmfd_tests::{bin, Daemon, Options};
use serde_json::Value;

const SUB: &str = "nqn.2024-01.io.nvmfd.test:ram0";

fn addr(d: &Daemon) -> String {
    let cfg = std::fs::read_to_string(d.dir.path().join("nvmfd.toml")).unwrap();
    let port = cfg
        .lines()
        .find_map(|l| l.strip_prefix("port = "))
        .unwrap()
        .trim()
        .to_string();
    format!("127.0.0.1:{port}")
}

fn nvmf(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(bin("nvmf"))
        .args(args)
        .output()
        .expect("run nvmf");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn f(v: &Value, k: &str) -> f64 {
    v["latency_us"][k]
        .as_f64()
        .unwrap_or_else(|| panic!("{k} in {v}"))
}

#[test]
fn bench_reports_every_queue_and_the_total_in_json() {
    let d = Daemon::start(Options::default());
    let a = addr(&d);
    let (ok, out, err) = nvmf(&[
        "bench",
        "--addr",
        &a,
        "--nqn",
        SUB,
        "-q",
        "4",
        "-o",
        "8k",
        "-w",
        "randrw",
        "-M",
        "70",
        "--queues",
        "3",
        "--threads",
        "2",
        "-t",
        "1",
        "--warmup",
        "0.2",
        "--json",
    ]);
    assert!(ok, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    let queues = v["queues"].as_array().unwrap();
    assert_eq!(queues.len(), 3, "{v}");
    let total = &v["total"];
    let sum: u64 = queues.iter().map(|q| q["ios"].as_u64().unwrap()).sum();
    assert_eq!(total["ios"].as_u64().unwrap(), sum);
    assert!(sum > 0, "{v}");
    for q in queues.iter().chain([total]) {
        assert!(q["ios"].as_u64().unwrap() > 0, "{q}");
        assert!(f(q, "min") > 0.0);
        assert!(
            f(q, "min") <= f(q, "p50") && f(q, "p50") <= f(q, "p90"),
            "{q}"
        );
        assert!(
            f(q, "p90") <= f(q, "p99") && f(q, "p99") <= f(q, "p99_9"),
            "{q}"
        );
        assert!(f(q, "p99_9") <= f(q, "max"), "{q}");
        // 8 KiB per I/O over one measured second.
        let mib = q["mib_per_s"].as_f64().unwrap();
        let iops = q["iops"].as_f64().unwrap();
        assert!(
            (mib - iops * 8192.0 / 1048576.0).abs() < 1e-6 * (1.0 + mib),
            "{q}"
        );
    }
    // The mix's reads and writes apart, as fio reports them: their counts add up to the
    // total, the reads about 70% of it, each with its own latencies; and the job is named.
    let (r, w) = (&total["read"], &total["write"]);
    let (reads, writes) = (r["ios"].as_u64().unwrap(), w["ios"].as_u64().unwrap());
    assert_eq!(reads + writes, sum, "{total}");
    let share = reads as f64 / sum as f64;
    assert!(
        (0.6..0.8).contains(&share),
        "reads {share:.2} of the I/Os: {total}"
    );
    for dir in [r, w] {
        assert!(
            f(dir, "min") > 0.0 && f(dir, "min") <= f(dir, "max"),
            "{dir}"
        );
        assert!(f(dir, "max") <= f(total, "max"), "{dir}");
    }
    let job = &v["job"];
    assert_eq!(
        (
            job["workload"].as_str(),
            job["read_pct"].as_u64(),
            job["io_size"].as_u64()
        ),
        (Some("randrw"), Some(70), Some(8192)),
        "{job}"
    );
    assert_eq!(
        (job["queues"].as_u64(), job["depth"].as_u64()),
        (Some(3), Some(4)),
        "{job}"
    );
    // The target served the reads and the writes of the mix.
    let stats = d.data("stats");
    let dp = &stats["datapath"][0];
    assert!(dp["read_bytes_total"].as_u64().unwrap() > 0, "{dp}");
    assert!(dp["write_bytes_total"].as_u64().unwrap() > 0, "{dp}");
}

#[test]
fn bench_prints_a_line_per_queue_and_a_total() {
    let d = Daemon::start(Options::default());
    let a = addr(&d);
    let (ok, out, err) = nvmf(&[
        "bench", "--addr", &a, "--nqn", SUB, "-q", "2", "-o", "128k", "-w", "write", "--queues",
        "2", "-t", "0.5", "--warmup", "0",
    ]);
    assert!(ok, "{err}");
    assert!(
        out.starts_with("write 131072 B, depth 2, 2 queue(s)"),
        "{out}"
    );
    assert!(
        out.contains("queue    1:") && out.contains("queue    2:"),
        "{out}"
    );
    assert!(
        out.contains("total     :") && out.contains("IOPS") && out.contains("p99.9"),
        "{out}"
    );
}

#[test]
fn bench_at_depth_one_keeps_one_command_out_on_a_queue_of_two_entries() {
    let d = Daemon::start(Options::default());
    let a = addr(&d);
    let (ok, out, err) = nvmf(&[
        "bench", "--addr", &a, "--nqn", SUB, "-q", "1", "-o", "4k", "-w", "randread", "-t", "0.3",
        "--warmup", "0", "--json",
    ]);
    assert!(ok, "depth 1 must connect (SQSIZE is at least 1): {err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert!(v["total"]["ios"].as_u64().unwrap() > 0, "{v}");
}

/// A target that stops answering during the run: the commands still out when it ends are
/// waited for (10 s), and then the run fails, instead of printing lower figures and exiting 0.
/// Waits until the daemon has served more than 100 commands (a bench's I/O flows), then
/// stalls its reactor for 20 s (the `debug_stall_reactor` test hook).
fn stall_once_io_flows(d: &Daemon) {
    nvmfd_tests::wait_for("the bench's I/O to flow", || {
        let s = d.data("stats");
        let n: u64 = s["datapath"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["commands_total"].as_u64().unwrap_or(0))
            .sum();
        (n > 100).then_some(())
    });
    let v = d.request(r#"{"request":"debug_stall_reactor","reactor":0,"ms":20000}"#);
    assert_eq!(v["ok"], true, "{v}");
}

#[test]
fn bench_fails_when_commands_are_left_unanswered_at_the_end() {
    let d = Daemon::start(Options {
        test_hooks: true,
        ..Options::default()
    });
    let a = addr(&d);
    let bench = Command::new(bin("nvmf"))
        .args([
            "bench", "--addr", &a, "--nqn", SUB, "-q", "8", "-o", "4k", "-w", "randread", "-t",
            "5", "--warmup", "0",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The reactor stops answering for longer than the run and the bench's wait after it.
    stall_once_io_flows(&d);
    let out = bench.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "bench exited 0: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(err.contains("unanswered"), "{err}");
}

#[test]
fn bench_writes_through_a_target_that_takes_no_data_in_its_capsules() {
    let d = Daemon::start(Options {
        replace: vec![(
            "[[listener]]".into(),
            "[transport]\nin_capsule_data_size = \"0\"\n\n[[listener]]".into(),
        )],
        ..Options::default()
    });
    let a = addr(&d);
    for args in [
        &[
            "bench",
            "-w",
            "randwrite",
            "-q",
            "4",
            "-o",
            "4k",
            "--verify",
        ][..],
        &["verify"][..],
    ] {
        let mut args = args.to_vec();
        args.extend_from_slice(&["--addr", &a, "--nqn", SUB]);
        if args[0] == "bench" {
            args.extend_from_slice(&["-t", "0.3", "--warmup", "0"]);
        }
        let (ok, out, err) = nvmf(&args);
        assert!(ok, "{args:?}: {err}{out}");
        if args[0] == "bench" {
            // Writes alone check nothing, and the tool says so (it said "0 blocks read back
            // intact").
            assert!(out.contains("nothing read back"), "{out}");
        }
    }
}

/// `nvmf verify` wrote up to 128 KiB on a queue of 64 entries whatever the target took:
/// against a target of 64 KiB transfers or 32-entry queues (both valid settings) it failed.
/// It keeps within both now, and says so of a namespace that is not active.
#[test]
fn verify_keeps_within_the_targets_transfer_and_queue_size() {
    let d = Daemon::start(Options {
        replace: vec![(
            "[[listener]]".into(),
            "[transport]\nmax_io_size = \"64KiB\"\nmax_queue_depth = 32\n\n[[listener]]".into(),
        )],
        ..Options::default()
    });
    let a = addr(&d);
    let (ok, out, err) = nvmf(&["verify", "--addr", &a, "--nqn", SUB]);
    assert!(ok, "{err}{out}");
    assert!(out.contains("to 64 KiB"), "{out}");
    let (ok, _, err) = nvmf(&["verify", "--addr", &a, "--nqn", SUB, "--nsid", "9"]);
    assert!(!ok, "an inactive namespace verified");
    assert!(err.contains("namespace 9 is not active in"), "{err}");
}

#[test]
fn bench_errors_are_clear_and_exit_non_zero() {
    let d = Daemon::start(Options::default());
    let a = addr(&d);
    let cases: [(&[&str], &str); 8] = [
        // Within NN (transport.max_nsid) but not configured: inactive.
        (&["--nsid", "9"], "namespace 9 is not active in"),
        // Past NN: Identify fails with Invalid Namespace.
        (&["--nsid", "4096"], "namespace 4096 of"),
        (&["-o", "1000"], "whole number of 512-byte blocks"),
        (&["-o", "4q"], "the unit is k, KiB, m or MiB"),
        // nvmfd's default max_io_size is 128 KiB (MDTS 5).
        (
            &["-o", "256k"],
            "above the target's maximum transfer (131072 bytes)",
        ),
        (&["-o", "64m"], "above the target's maximum transfer"),
        // nvmfd's default max_queue_depth is 128 (CAP.MQES 127): said so, not a refused
        // connection.
        (
            &["-q", "256"],
            "the queue depth (-q 256) is above the target's largest queue (128 entries)",
        ),
        (
            &["--nqn", "nqn.2024-01.io.nvmfd.test:none"],
            "(no such subsystem there)",
        ),
    ];
    for (extra, want) in cases {
        let mut args = vec!["bench", "--addr", &a, "-t", "0.2", "--warmup", "0"];
        if !extra.contains(&"--nqn") {
            args.extend_from_slice(&["--nqn", SUB]);
        }
        args.extend_from_slice(extra);
        let (ok, _, err) = nvmf(&args);
        assert!(!ok, "{extra:?} succeeded");
        assert!(err.contains(want), "{extra:?}: `{want}` not in: {err}");
    }
    // No time to measure: refused (it was divided by a nanosecond, or printed 0 IOPS).
    let (ok, _, err) = nvmf(&["bench", "--addr", &a, "--nqn", SUB, "-t", "0"]);
    assert!(!ok, "-t 0 succeeded");
    assert!(
        err.contains("-t: the measured time must be above 0"),
        "{err}"
    );
    // Nobody listens there.
    let (ok, _, err) = nvmf(&["bench", "--addr", "127.0.0.1:9", "--nqn", SUB, "-t", "0.2"]);
    assert!(!ok);
    assert!(err.starts_with("nvmf: "), "{err}");
}

/// A bench interrupted in its warm-up has measured nothing: it says so and exits non-zero.
/// It printed figures of zero I/Os over zero seconds and exited 0.
#[test]
fn a_bench_interrupted_in_its_warm_up_reports_no_figures() {
    let d = Daemon::start(Options::default());
    let (ok, out, err) = interrupted_once_its_io_flows(
        &d,
        &[
            "-q", "4", "-w", "randread", "-t", "600", "--warmup", "600", "--json",
        ],
    );
    assert!(!ok, "exit 0: {out}{err}");
    assert!(err.contains("too little to report"), "{err}");
    assert!(out.trim().is_empty(), "figures printed: {out}");
}

/// Runs `nvmf bench` against `d` with `args` (after the address and NQN), sends it SIGINT
/// once its I/O flows (the controller has served more than its admin commands), and waits
/// for it to end: (success, stdout, stderr).
fn interrupted_once_its_io_flows(d: &Daemon, args: &[&str]) -> (bool, String, String) {
    use std::io::Read;
    let a = addr(d);
    let mut child = Command::new(bin("nvmf"))
        .args(["bench", "--addr", &a, "--nqn", SUB])
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run nvmf bench");
    nvmfd_tests::wait_for("the bench's I/O", || {
        let ctrls = d.data("controllers");
        ctrls.as_array()?.iter().find(|c| {
            c["queues"].as_array().is_some_and(|q| q.len() == 2)
                && c["commands"].as_u64().unwrap_or(0) > 100
        })?;
        Some(())
    });
    // SAFETY: kill(2) on the child's PID, which has not been reaped yet.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
    let status = nvmfd_tests::wait_for("nvmf bench to end after SIGINT", || {
        child.try_wait().unwrap()
    });
    let (mut out, mut err) = (String::new(), String::new());
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    (status.success(), out, err)
}

#[test]
fn an_interrupted_bench_prints_the_figures_of_the_time_it_ran() {
    let d = Daemon::start(Options::default());
    let (ok, out, err) = interrupted_once_its_io_flows(
        &d,
        &[
            "-q",
            "4",
            "-o",
            "4k",
            "-w",
            "randwrite",
            "-t",
            "600",
            "--warmup",
            "0",
            "--json",
        ],
    );
    assert!(ok, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(v["interrupted"], true, "{v}");
    let secs = v["seconds"].as_f64().unwrap();
    assert!(secs > 0.0 && secs < 600.0, "{v}");
    let ios = v["total"]["ios"].as_u64().unwrap();
    assert!(ios > 0, "{v}");
    // IOPS are over the time it ran, not the 600 s asked for.
    let iops = v["total"]["iops"].as_f64().unwrap();
    assert!(
        (iops * secs - ios as f64).abs() <= 1.0 + ios as f64 * 1e-6,
        "{v}"
    );
}

/// Interrupted while a stalled target holds its commands, the bench waits for them (up to
/// 10 s) and says so; a second SIGINT then quits at once with status 130. It once waited
/// the 10 s out whatever the user did.
#[test]
fn an_interrupted_bench_waiting_for_a_stalled_target_says_so_and_quits_on_a_second_sigint() {
    use std::io::BufRead;
    let d = Daemon::start(Options {
        test_hooks: true,
        ..Options::default()
    });
    let a = addr(&d);
    let mut child = Command::new(bin("nvmf"))
        .args([
            "bench", "--addr", &a, "--nqn", SUB, "-q", "8", "-o", "4k", "-w", "randread", "-t",
            "600", "--warmup", "0",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            let _ = tx.send(line);
        }
    });
    stall_once_io_flows(&d);
    let sigint = |child: &std::process::Child| {
        // SAFETY: kill(2) on the child's PID, which has not been reaped yet.
        assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
    };
    sigint(&child);
    let mut seen = Vec::new();
    nvmfd_tests::wait_for("the bench to say it waits", || {
        seen.extend(rx.try_iter());
        seen.iter()
            .any(|l| l.contains("waiting up to"))
            .then_some(())
    });
    sigint(&child);
    let status = nvmfd_tests::wait_for("nvmf bench to quit", || child.try_wait().unwrap());
    assert_eq!(status.code(), Some(130), "{status}: {seen:?}");
}
