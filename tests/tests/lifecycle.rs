//! The daemon's lifecycle as a process: configuration checks, start, systemd notifications,
//! the watchdog, signals, pinning, logging.

use std::process::Command;
use std::time::Duration;

use nvmfd_tests::{bin, skip, wait_for, Daemon, Options};

#[test]
fn check_config_accepts_a_valid_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ok.toml");
    std::fs::write(&path, nvmfd_tests::test_config(dir.path(), "")).unwrap();
    let out = Command::new(bin("nvmfd"))
        .arg("--check-config")
        .arg(&path)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("valid: 1 listener(s), 1 subsystem(s), 1 namespace(s), 1 reactor(s)"),
        "{stdout}"
    );
}

#[test]
fn check_config_refuses_an_invalid_file_naming_key_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.toml");
    let text =
        nvmfd_tests::test_config(dir.path(), "").replace("size = \"64MiB\"", "size = \"64MB\"");
    std::fs::write(&path, &text).unwrap();
    let line = text.lines().position(|l| l.starts_with("size")).unwrap() + 1;
    let out = Command::new(bin("nvmfd"))
        .arg("--check-config")
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let expected = format!(
        "{}:{line}:8: `subsystem[0].namespace[0].size`: `64MB` uses a decimal unit",
        path.display()
    );
    assert!(
        stderr.starts_with(&expected),
        "{stderr}\nexpected: {expected}"
    );
}

#[test]
fn an_invalid_config_stops_the_daemon_before_it_starts() {
    let dir = tempfile::tempdir().unwrap();
    let mut d = Daemon::spawn(Options {
        config: Some(
            nvmfd_tests::test_config(dir.path(), "")
                .replace("reactor_cores = [0]", "reactor_cores = [0, 4096]"),
        ),
        ..Options::default()
    });
    assert_eq!(d.wait_exit().code(), Some(1));
    assert!(d.log().contains("core 4096 does not exist"), "{}", d.log());
}

#[test]
fn sigterm_stops_gracefully_and_removes_the_socket() {
    let mut d = Daemon::start(Options::default());
    assert!(d.socket.exists());
    d.signal(libc::SIGTERM);
    assert!(d.wait_exit().success(), "log:\n{}", d.log());
    assert!(!d.socket.exists(), "the admin socket is left behind");
    let log = d.log();
    assert!(log.contains("stopping gracefully"), "{log}");
    assert!(log.contains("reactors stopped"), "{log}");
}

#[test]
fn sigint_stops_gracefully() {
    let mut d = Daemon::start(Options::default());
    d.signal(libc::SIGINT);
    assert!(d.wait_exit().success(), "log:\n{}", d.log());
}

#[test]
fn sighup_is_logged_and_does_not_stop_the_daemon() {
    let mut d = Daemon::start(Options::default());
    d.signal(libc::SIGHUP);
    wait_for("the SIGHUP log line", || {
        d.log().contains("SIGHUP").then_some(())
    });
    assert_eq!(d.data("status")["state"], "running");
    d.signal(libc::SIGTERM);
    assert!(d.wait_exit().success());
}

#[test]
fn a_second_signal_forces_exit_when_the_graceful_stop_hangs() {
    let mut d = Daemon::start(Options {
        test_hooks: true,
        ..Options::default()
    });
    // A reactor stuck for a minute makes the graceful stop wait for it.
    let v = d.request(r#"{"request":"debug_stall_reactor","reactor":0,"ms":60000}"#);
    assert_eq!(v["ok"], true, "{v}");
    wait_for("the reactor to stall", || {
        d.log()
            .contains("test hook: reactor stalling")
            .then_some(())
    });
    d.signal(libc::SIGTERM);
    wait_for("the graceful stop to begin", || {
        d.log().contains("stopping gracefully").then_some(())
    });
    assert!(
        d.child.try_wait().unwrap().is_none(),
        "the graceful stop should be waiting for the stalled reactor"
    );
    d.signal(libc::SIGTERM);
    assert_eq!(d.wait_exit().code(), Some(130));
}

/// An admin socket path that names a file other than a socket (a configuration mistake) is
/// refused, and the file is left as it was: only a stale socket is replaced.
#[test]
fn an_admin_socket_path_naming_a_regular_file_is_refused_and_the_file_kept() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("precious");
    std::fs::write(&file, b"not a socket").unwrap();
    let mut d = Daemon::spawn(Options {
        replace: vec![(
            "admin_socket = \"".into(),
            format!("admin_socket = \"{}\"\n# was: ", file.display()),
        )],
        ..Options::default()
    });
    assert_eq!(d.wait_exit().code(), Some(1));
    assert!(d.log().contains("is not a socket"), "{}", d.log());
    assert_eq!(std::fs::read(&file).unwrap(), b"not a socket");
}

/// An admin socket in a directory others may write (not sticky) or another user owns is
/// refused at start: they could replace the socket between its bind and its chmod, or put
/// their own in its place and read what nvmfctl sends. A sticky one (as /tmp) is taken.
#[test]
fn an_admin_socket_in_a_directory_others_may_write_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let open = dir.path().join("open");
    let sticky = dir.path().join("sticky");
    for (d, mode) in [(&open, 0o777), (&sticky, 0o1777)] {
        std::fs::create_dir(d).unwrap();
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(mode)).unwrap();
    }
    let at = |d: &std::path::Path| Options {
        replace: vec![(
            "admin_socket = \"".into(),
            format!(
                "admin_socket = \"{}\"\n# was: ",
                d.join("nvmfd.sock").display()
            ),
        )],
        ..Options::default()
    };
    let mut d = Daemon::spawn(at(&open));
    assert_eq!(d.wait_exit().code(), Some(1));
    assert!(d.log().contains("writable by others"), "{}", d.log());
    assert!(!open.join("nvmfd.sock").exists());
    let mut d = Daemon::spawn(at(&sticky));
    wait_for("the daemon in the sticky directory to answer", || {
        sticky.join("nvmfd.sock").exists().then_some(())
    });
    d.signal(libc::SIGTERM);
    assert_eq!(d.wait_exit().code(), Some(0), "{}", d.log());
}

#[test]
fn a_second_daemon_on_the_same_socket_refuses_to_start() {
    let d = Daemon::start(Options::default());
    let config = std::fs::read_to_string(d.dir.path().join("nvmfd.toml")).unwrap();
    let mut second = Daemon::spawn(Options {
        config: Some(config),
        ..Options::default()
    });
    assert_eq!(second.wait_exit().code(), Some(1));
    assert!(
        second.log().contains("another nvmfd is already serving"),
        "{}",
        second.log()
    );
    assert_eq!(
        d.data("status")["state"],
        "running",
        "the first daemon must keep serving"
    );
}

/// A log line that cannot be written (its reader gone: EPIPE) is lost, and nothing else:
/// the daemon serves on and stops cleanly.
#[test]
fn a_log_that_cannot_be_written_does_not_stop_the_daemon() {
    let mut d = Daemon::start(Options {
        stderr_broken: true,
        extra_daemon: "log_level = \"debug\"\n".into(),
        ..Options::default()
    });
    // Hosts connect and go (logged by the control thread and the reactor).
    let f = nvmfd_rdma::soft::Fabric::networked();
    f.add_device("127.0.0.21".parse().unwrap()).unwrap();
    let host = nvmfd_nvme::host::HostId {
        nqn: "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-0000000000c1".into(),
        id: [0xc1; 16],
    };
    for _ in 0..3 {
        let ch =
            nvmfd_rdma::any::cm::CmChannel::Soft(nvmfd_rdma::soft::cm::CmChannel::new(&f).unwrap());
        let q = nvmf_host::RdmaQueue::connect(ch, d.soft_addr(), 0, 31, 4096, 128 * 1024).unwrap();
        let mut admin = nvmfd_nvme::host::AdminQueue::connect(
            q,
            &host,
            "nqn.2024-01.io.nvmfd.test:ram0",
            31,
            0,
        )
        .unwrap();
        admin.enable().unwrap();
        admin.identify_controller().unwrap();
        assert_eq!(d.data("status")["state"], "running");
    }
    d.signal(libc::SIGTERM);
    assert!(d.wait_exit().success());
}

#[test]
fn a_stale_socket_file_is_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("admin.sock");
    drop(std::os::unix::net::UnixListener::bind(&sock).unwrap()); // the file stays, nobody listens
    assert!(std::os::unix::net::UnixStream::connect(&sock).is_err());
    let mut d = Daemon::spawn(Options {
        config: Some(nvmfd_tests::test_config(dir.path(), "")),
        ..Options::default()
    });
    wait_for("the daemon to answer on the formerly stale socket", || {
        std::os::unix::net::UnixStream::connect(&sock).ok()
    });
    d.signal(libc::SIGTERM);
    assert!(d.wait_exit().success(), "{}", d.log());
}

#[test]
fn systemd_sees_ready_status_watchdog_and_stopping() {
    let mut d = Daemon::spawn(Options {
        notify: true,
        watchdog_usec: Some(200_000),
        ..Options::default()
    });
    let msgs = d.notifications_until("READY=1");
    let ready = msgs.last().unwrap();
    assert!(
        ready
            .lines()
            .any(|l| l.starts_with("STATUS=1 subsystem(s), 1 namespace(s)")),
        "{ready}"
    );
    // READY comes only once the admin socket is up: it answers at once.
    assert!(
        std::os::unix::net::UnixStream::connect(&d.socket).is_ok(),
        "READY=1 before the admin socket"
    );
    assert_eq!(d.data("status")["watchdog_usec"], 200_000);
    // Keep-alives at least every half interval: three in a row.
    for _ in 0..3 {
        d.notifications_until("WATCHDOG=1");
    }
    d.signal(libc::SIGTERM);
    d.notifications_until("STOPPING=1");
    assert!(d.wait_exit().success());
}

#[test]
fn the_watchdog_stops_while_a_reactor_is_stalled_and_resumes_after() {
    let mut d = Daemon::spawn(Options {
        notify: true,
        watchdog_usec: Some(200_000),
        test_hooks: true,
        ..Options::default()
    });
    d.notifications_until("READY=1");
    d.notifications_until("WATCHDOG=1");
    let v = d.request(r#"{"request":"debug_stall_reactor","reactor":0,"ms":3000}"#);
    assert_eq!(v["ok"], true, "{v}");
    // The control thread notices the stall (stall_timeout 300ms) and says so in STATUS.
    d.notifications_until_contains("STALLED");
    assert_eq!(d.data("status")["reactors"][0]["stalled"], true);
    // While it is stalled no keep-alive is sent: watch for three watchdog intervals.
    let during = d.notifications_for(Duration::from_millis(600));
    assert!(
        !during.iter().any(|m| m.contains("WATCHDOG=1")),
        "watchdog fed during a stall: {during:?}"
    );
    assert_eq!(
        d.data("status")["reactors"][0]["stalled"],
        true,
        "the stall ended before the check was done"
    );
    // When the reactor moves again, so does the watchdog.
    d.notifications_until("WATCHDOG=1");
    assert_eq!(d.data("status")["reactors"][0]["stalled"], false);
    assert!(d.log().contains("reactor stalled"), "{}", d.log());
    d.signal(libc::SIGTERM);
    assert!(d.wait_exit().success());
}

#[test]
fn ready_waits_for_a_reactor_slow_to_set_up_and_does_not_report_it_stalled() {
    // Registering a large pool with a slow device (rxe) takes seconds: here 1.5 s, five times
    // the stall timeout (300ms).
    let mut d = Daemon::spawn(Options {
        notify: true,
        watchdog_usec: Some(200_000),
        test_hooks: true,
        env: vec![("NVMFD_TEST_REACTOR_SETUP_MS".into(), "1500".into())],
        ..Options::default()
    });
    d.notifications_until("READY=1");
    // Ready means serving: the reactor runs its loop by then.
    let log = d.log();
    let started = log.find("reactor started");
    let ready = log.find("nvmfd ready");
    assert!(
        matches!((started, ready), (Some(s), Some(r)) if s < r),
        "READY before the reactor ran: {log}"
    );
    // Its heartbeat is watched from then on: fed, and never a stall.
    for _ in 0..3 {
        d.notifications_until("WATCHDOG=1");
    }
    assert_eq!(d.data("status")["reactors"][0]["stalled"], false);
    assert!(!d.log().contains("reactor stalled"), "{}", d.log());
    d.signal(libc::SIGTERM);
    assert!(d.wait_exit().success());
}

#[test]
fn a_reactor_that_cannot_finish_setting_up_fails_the_start_without_waiting_for_it() {
    // A reactor stuck for 60 s building its data paths, allowed 300 ms.
    let mut d = Daemon::spawn(Options {
        notify: true,
        test_hooks: true,
        env: vec![
            ("NVMFD_TEST_REACTOR_SETUP_MS".into(), "60000".into()),
            ("NVMFD_TEST_REACTOR_SETUP_TIMEOUT_MS".into(), "300".into()),
        ],
        ..Options::default()
    });
    let t0 = std::time::Instant::now();
    let status = d.wait_exit();
    assert!(!status.success(), "{status:?}");
    assert!(
        // The reactor is stuck for 60 s (the hook); waiting for the exit gives up at 20 s.
        t0.elapsed() < Duration::from_secs(10),
        "the daemon waited for the stuck reactor: {:?}",
        t0.elapsed()
    );
    let log = d.log();
    assert!(
        log.contains("did not finish setting up its data paths within 300ms"),
        "{log}"
    );
    assert!(!log.contains("nvmfd ready"), "{log}");
}

/// `systemctl stop` while the reactors are still setting up (here for 60 s) stops the daemon
/// then, cleanly and never ready, instead of after the setup, past systemd's stop timeout.
#[test]
fn a_stop_during_the_reactors_setup_is_taken_at_once() {
    let mut d = Daemon::spawn(Options {
        notify: true,
        test_hooks: true,
        env: vec![("NVMFD_TEST_REACTOR_SETUP_MS".into(), "60000".into())],
        ..Options::default()
    });
    wait_for("the listeners", || {
        d.log().contains("listening").then_some(())
    });
    let t0 = std::time::Instant::now();
    d.signal(libc::SIGTERM);
    let status = d.wait_exit();
    assert!(
        // The setup takes 60 s (the hook); waiting for the exit gives up at 20 s.
        t0.elapsed() < Duration::from_secs(10),
        "the stop waited for the setup: {:?}",
        t0.elapsed()
    );
    assert!(status.success(), "{status:?}: {}", d.log());
    let log = d.log();
    assert!(log.contains("stop requested while starting"), "{log}");
    assert!(!log.contains("nvmfd ready"), "{log}");
    // The reactor still setting up is let go, and the process leaves without running the
    // libraries' destructors under it.
    assert!(log.contains("left to the process's end"), "{log}");
    let said = d.notifications_for(Duration::from_millis(100));
    assert!(!said.iter().any(|n| n.contains("READY=1")), "{said:?}");
    assert!(said.iter().any(|n| n.contains("STOPPING=1")), "{said:?}");
}

#[test]
fn reactors_are_pinned_to_their_cores() {
    let cores: Vec<usize> = {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        if n < 2 {
            return nvmfd_tests::skip("needs two cores, to pin two reactors apart");
        }
        (0..2).collect()
    };
    let list = cores
        .iter()
        .map(|c| c.to_string())
        .collect::<Vec<_>>()
        .join(", ");
    let mut d = Daemon::start(Options {
        replace: vec![(
            "reactor_cores = [0]".into(),
            format!("reactor_cores = [{list}]"),
        )],
        ..Options::default()
    });
    let pid = d.child.id();
    for (id, core) in cores.iter().enumerate() {
        let name = format!("nvmfd-r{id}");
        let allowed = wait_for(&format!("thread {name}"), || {
            std::fs::read_dir(format!("/proc/{pid}/task"))
                .ok()?
                .flatten()
                .find_map(|t| {
                    let comm = std::fs::read_to_string(t.path().join("comm")).ok()?;
                    if comm.trim() != name {
                        return None;
                    }
                    let status = std::fs::read_to_string(t.path().join("status")).ok()?;
                    status
                        .lines()
                        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
                        .map(|s| s.trim().to_owned())
                })
        });
        assert_eq!(
            allowed,
            core.to_string(),
            "{name} is not pinned to core {core}"
        );
    }
    d.signal(libc::SIGTERM);
    assert!(d.wait_exit().success());
}

/// Cores isolated from the scheduler (`isolcpus`) are outside PID 1's affinity mask and so
/// a service's, yet they are where poll-mode reactors go: a reactor core outside the
/// process's mask but one it may pin a thread to is taken, by `--check-config` and at start.
#[test]
fn a_reactor_core_outside_the_process_affinity_mask_but_pinnable_is_taken() {
    let cores_0_and_1 = {
        // SAFETY: plain data; this process's affinity is read into it.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let rc =
            unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
        // SAFETY: 0 and 1 are within the set's size.
        rc == 0 && unsafe { libc::CPU_ISSET(0, &set) && libc::CPU_ISSET(1, &set) }
    };
    if !cores_0_and_1 {
        skip("a reactor core outside the affinity mask: cores 0 and 1 are not both ours");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("isolated.toml");
    std::fs::write(
        &path,
        nvmfd_tests::test_config(dir.path(), "")
            .replace("reactor_cores = [0]", "reactor_cores = [1]"),
    )
    .unwrap();
    let mut check = Command::new(bin("nvmfd"));
    check.arg("--check-config").arg(&path);
    nvmfd_tests::start_on_core(&mut check, 0);
    let out = check.output().unwrap();
    assert!(out.status.success(), "{out:?}");
    // The daemon started on core 0 alone pins its reactor to core 1.
    let mut d = Daemon::start(Options {
        replace: vec![("reactor_cores = [0]".into(), "reactor_cores = [1]".into())],
        start_on_core: Some(0),
        ..Options::default()
    });
    let pid = d.child.id();
    let allowed = wait_for("thread nvmfd-r0", || {
        std::fs::read_dir(format!("/proc/{pid}/task"))
            .ok()?
            .flatten()
            .find_map(|t| {
                let comm = std::fs::read_to_string(t.path().join("comm")).ok()?;
                (comm.trim() == "nvmfd-r0").then_some(())?;
                let status = std::fs::read_to_string(t.path().join("status")).ok()?;
                status
                    .lines()
                    .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
                    .map(|s| s.trim().to_owned())
            })
    });
    assert_eq!(allowed, "1");
    d.signal(libc::SIGTERM);
    assert!(d.wait_exit().success());
}

#[test]
fn logs_are_json_lines_off_a_terminal_and_nvmfd_log_overrides_the_level() {
    let mut d = Daemon::start(Options {
        env: vec![("NVMFD_LOG".into(), "debug".into())],
        ..Options::default()
    });
    wait_for("a debug line", || {
        d.log().contains("\"level\":\"DEBG\"").then_some(())
    });
    d.signal(libc::SIGTERM);
    assert!(d.wait_exit().success());
    for line in d.log().lines() {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        assert!(
            v["msg"].is_string() && v["level"].is_string() && v["ts"].is_string(),
            "{line}"
        );
    }
}

/// slog's compile-time level used to strip debug lines from release builds, whatever
/// `NVMFD_LOG` said. The test command builds the release binaries before `cargo test`.
#[test]
fn the_release_build_prints_debug_lines_when_nvmfd_log_says_debug() {
    let nvmfd = match nvmfd_tests::release_bin("nvmfd") {
        Ok(p) => p,
        Err(why) => return skip(&why),
    };
    let mut d = Daemon::start(Options {
        binary: Some(nvmfd),
        env: vec![("NVMFD_LOG".into(), "debug".into())],
        ..Options::default()
    });
    // The logger's own first line is at debug level.
    wait_for("the release build's debug line", || {
        d.log()
            .lines()
            .any(|l| l.contains("\"msg\":\"logging\"") && l.contains("\"level\":\"DEBG\""))
            .then_some(())
    });
    d.signal(libc::SIGTERM);
    assert!(d.wait_exit().success(), "{}", d.log());
}

#[test]
fn the_configured_level_applies_without_the_override() {
    let mut d = Daemon::start(Options {
        extra_daemon: "log_level = \"warn\"".into(),
        test_hooks: true, // which logs a warning
        ..Options::default()
    });
    d.signal(libc::SIGTERM);
    assert!(d.wait_exit().success());
    let log = d.log();
    assert!(
        log.contains("test hooks are enabled"),
        "warnings are logged: {log}"
    );
    assert!(
        !log.contains("\"level\":\"INFO\""),
        "info lines at level warn: {log}"
    );
}

#[test]
fn a_bad_nvmfd_log_is_reported_not_ignored() {
    let mut d = Daemon::start(Options {
        env: vec![("NVMFD_LOG".into(), "chatty".into())],
        ..Options::default()
    });
    d.signal(libc::SIGTERM);
    assert!(d.wait_exit().success());
    assert!(
        d.log()
            .contains("NVMFD_LOG ignored: unknown log level `chatty`"),
        "{}",
        d.log()
    );
}

/// Work the control thread stopped waiting for (RBD handles opened ahead for a listener, past
/// their 2 s) may still be running, inside librbd, when the daemon is told to stop. The daemon
/// waits for it before it exits: `exit` runs librados' and librbd's static destructors, which
/// crash a process with a thread still inside the libraries (as a test process once did).
#[test]
fn the_daemon_waits_for_work_left_off_the_control_thread_before_it_exits() {
    let mut d = Daemon::start(Options {
        test_hooks: true,
        ..Options::default()
    });
    let t = std::time::Instant::now();
    let a = d.request(r#"{"request": "debug_off_thread", "ms": 3000}"#);
    assert_eq!(a["ok"], true, "{a}");
    d.signal(libc::SIGTERM);
    assert!(d.wait_exit().success(), "{}", d.log());
    assert!(
        d.log()
            .contains("waiting for operations off the control thread before exiting"),
        "{}",
        d.log()
    );
    assert!(t.elapsed() >= Duration::from_secs(3), "{:?}", t.elapsed());
}
