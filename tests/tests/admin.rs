//! The admin socket under good and bad clients, and `nvmfctl` against a live daemon.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::process::Command;
use std::time::Duration;

use nvmfd_nvme::wire;
use nvmfd_tests::{bin, wait_for, Daemon, Options, WAIT};
use serde_json::Value;

fn read_line(s: &UnixStream) -> String {
    s.set_read_timeout(Some(WAIT)).unwrap();
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line).unwrap();
    line
}

fn answer(s: &mut UnixStream, request: &str) -> Value {
    s.write_all(request.as_bytes()).unwrap();
    s.write_all(b"\n").unwrap();
    serde_json::from_str(&read_line(s)).unwrap()
}

/// True once the peer has closed the connection (EOF or reset).
fn closed_by_peer(s: &mut UnixStream) -> Option<()> {
    s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
    let mut buf = [0u8; 65536];
    match s.read(&mut buf) {
        Ok(0) => Some(()),
        Ok(_) => None,
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            None
        }
        Err(_) => Some(()),
    }
}

#[test]
fn status_stats_and_config_answer() {
    let d = Daemon::start(Options::default());
    let status = d.data("status");
    assert_eq!(status["state"], "running");
    assert_eq!(status["pid"], d.child.id());
    assert_eq!(status["reactors"][0]["core"], 0);
    assert_eq!(
        status["subsystems"][0]["nqn"],
        "nqn.2024-01.io.nvmfd.test:ram0"
    );
    assert_eq!(status["listeners"][0]["serving"], true, "{status}");
    let config = d.data("config");
    assert_eq!(config["subsystem"][0]["namespace"][0]["size"], "64MiB");
    assert_eq!(
        config["transport"]["max_io_size"], "128KiB",
        "defaults are filled in"
    );
    // The heartbeat moves between two snapshots.
    let t0 = d.data("stats")["reactors"][0]["turns_total"]
        .as_u64()
        .unwrap();
    wait_for("the heartbeat to move", || {
        (d.data("stats")["reactors"][0]["turns_total"]
            .as_u64()
            .unwrap()
            > t0)
            .then_some(())
    });
}

#[test]
fn the_socket_is_mode_0660() {
    let d = Daemon::start(Options::default());
    let mode = std::fs::metadata(&d.socket).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o660);
}

#[test]
fn malformed_json_gets_an_error_and_the_connection_keeps_working() {
    let d = Daemon::start(Options::default());
    let mut s = UnixStream::connect(&d.socket).unwrap();
    let bad = answer(&mut s, "{not json");
    assert_eq!(bad["ok"], false);
    assert!(
        bad["error"].as_str().unwrap().starts_with("bad request:"),
        "{bad}"
    );
    let bad = answer(&mut s, "\u{1}\u{2}\u{ff}");
    assert_eq!(bad["ok"], false);
    let good = answer(&mut s, r#"{"request":"status"}"#);
    assert_eq!(good["ok"], true, "{good}");
    assert_eq!(d.data("stats")["admin"]["errors_total"], 2);
}

#[test]
fn unknown_requests_and_fields_get_an_error() {
    let d = Daemon::start(Options::default());
    let v = d.request(r#"{"request":"reboot"}"#);
    assert_eq!(v["ok"], false);
    assert!(
        v["error"]
            .as_str()
            .unwrap()
            .contains("unknown variant `reboot`"),
        "{v}"
    );
    let v = d.request(r#"{"request":"status","verbose":true}"#);
    assert_eq!(v["ok"], false, "{v}");
    let v = d.request(r#"{"req":"status"}"#);
    assert_eq!(v["ok"], false, "{v}");
}

#[test]
fn test_hooks_are_refused_without_the_environment_variable() {
    let d = Daemon::start(Options::default());
    let v = d.request(r#"{"request":"debug_stall_reactor","reactor":0,"ms":1000}"#);
    assert_eq!(v["ok"], false);
    assert!(
        v["error"].as_str().unwrap().contains("NVMFD_TEST_HOOKS=1"),
        "{v}"
    );
    let d = Daemon::start(Options {
        test_hooks: true,
        ..Options::default()
    });
    let v = d.request(r#"{"request":"debug_stall_reactor","reactor":9,"ms":1}"#);
    assert_eq!(v["error"], "no reactor 9");
}

#[test]
fn the_fault_hook_needs_the_environment_variable_and_a_soft_listener() {
    let remove =
        |l: usize| format!(r#"{{"request":"debug_fault","fault":"remove_device","listener":{l}}}"#);
    let d = Daemon::start(Options::default());
    let v = d.request(&remove(0));
    assert_eq!(v["ok"], false, "{v}");
    assert!(
        v["error"].as_str().unwrap().contains("NVMFD_TEST_HOOKS=1"),
        "{v}"
    );
    assert_eq!(d.data("status")["listeners"][0]["serving"], true);
    // Listener 1 is on ibverbs (not serving on a machine without an RDMA device, but there).
    let d = Daemon::start(Options {
        test_hooks: true,
        replace: vec![(
            "[[subsystem]]".into(),
            "[[listener]]\naddress = \"127.0.0.1\"\nport = 4791\nprovider = \"ibverbs\"\n\n\
             [[subsystem]]"
                .into(),
        )],
        ..Options::default()
    });
    let v = d.request(&remove(1));
    assert_eq!(
        v["error"],
        "listener 1 uses the ibverbs provider: faults can be injected on the soft provider only",
        "{v}"
    );
    let v = d.request(&remove(2));
    assert_eq!(v["error"], "no listener 2", "{v}");
    let v = d.request(r#"{"request":"debug_fault","fault":"unplug","listener":0}"#);
    assert_eq!(v["ok"], false, "an unknown fault: {v}");
    assert_eq!(d.data("status")["listeners"][0]["serving"], true);
}

#[test]
fn an_oversized_line_gets_an_error_then_a_disconnect() {
    let d = Daemon::start(Options::default());
    let mut s = UnixStream::connect(&d.socket).unwrap();
    // No newline at all: the daemon must not buffer without bound. It may answer and close
    // before all of it is written (a broken pipe here is that).
    if let Err(e) = s.write_all(&vec![b'x'; 64 * 1024]) {
        assert_eq!(e.kind(), std::io::ErrorKind::BrokenPipe, "{e}");
    }
    let line = read_line(&s);
    let v: Value = serde_json::from_str(&line).unwrap();
    assert_eq!(v["error"], "request line longer than 4096 bytes");
    wait_for("the daemon to close the connection", || {
        closed_by_peer(&mut s)
    });
    assert_eq!(d.data("status")["state"], "running");
    assert_eq!(d.data("stats")["admin"]["dropped_total"], 1);
}

#[test]
fn a_slow_client_is_dropped_after_the_idle_timeout_while_others_are_served() {
    let d = Daemon::start(Options {
        extra_daemon: "admin_client_timeout = \"300ms\"".into(),
        ..Options::default()
    });
    let mut slow = UnixStream::connect(&d.socket).unwrap();
    slow.write_all(br#"{"request":"sta"#).unwrap(); // half a request, then nothing
                                                    // Others are served meanwhile.
    assert_eq!(d.data("status")["state"], "running");
    wait_for("the slow client to be dropped", || {
        closed_by_peer(&mut slow)
    });
    assert!(d.data("stats")["admin"]["dropped_total"].as_u64().unwrap() >= 1);
}

/// Bytes trickling in keep no client from the idle timeout: one that sends a line that never
/// ends, a byte at a time, and one that sends only blank lines are dropped as a silent one is
/// (64 such clients would otherwise hold every admin connection for as long as they liked).
#[test]
fn clients_trickling_bytes_without_a_request_are_dropped_after_the_idle_timeout() {
    let d = Daemon::start(Options {
        extra_daemon: "admin_client_timeout = \"300ms\"".into(),
        ..Options::default()
    });
    let mut trickling = Vec::new();
    for (first, each) in [(&b"{"[..], &b" "[..]), (&b"\n"[..], &b"\n"[..])] {
        let s = UnixStream::connect(&d.socket).unwrap();
        let mut w = s.try_clone().unwrap();
        w.write_all(first).unwrap();
        let writer = std::thread::spawn(move || {
            // A byte every 100 ms, a third of the timeout, until the daemon lets go.
            for _ in 0..600 {
                std::thread::sleep(Duration::from_millis(100));
                if w.write_all(each).is_err() {
                    return true;
                }
            }
            false
        });
        trickling.push((s, writer));
    }
    for (mut s, writer) in trickling {
        wait_for("the trickling client to be dropped", || {
            closed_by_peer(&mut s)
        });
        drop(s);
        let _ = writer.join();
    }
    assert!(d.data("stats")["admin"]["dropped_total"].as_u64().unwrap() >= 2);
    assert_eq!(d.data("status")["state"], "running");
}

#[test]
fn a_client_that_never_reads_is_dropped() {
    let d = Daemon::start(Options::default());
    let s = UnixStream::connect(&d.socket).unwrap();
    s.set_write_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let requests = r#"{"request":"config"}"#.to_owned() + "\n";
    let mut w = &s;
    // Ask for far more answers than the daemon buffers, reading none of them, until it closes
    // the connection. A write that times out only says the daemon has not read for a while
    // (a busy machine): its answers to what it read may still be under its bound.
    let mut dropped = false;
    let deadline = std::time::Instant::now() + WAIT;
    while std::time::Instant::now() < deadline {
        match w.write_all(requests.as_bytes()) {
            Ok(()) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => {
                dropped = true;
                break;
            }
        }
    }
    assert!(
        dropped,
        "the daemon kept accepting requests from a client that never reads"
    );
    wait_for("the non-reading client to be counted as dropped", || {
        (d.data("stats")["admin"]["dropped_total"].as_u64().unwrap() >= 1).then_some(())
    });
    assert_eq!(d.data("status")["state"], "running");
}

/// One answer larger than the bound on unread answers (2 MiB: a configuration with thousands of
/// allowed hosts here; `controllers` of a big target likewise) reaches a client that reads
/// it: the bound applies to answers left unread when the client asks for more. The client was
/// dropped midway before (a truncated line).
#[test]
fn an_answer_larger_than_the_bound_reaches_a_client_that_reads_it() {
    let hosts: Vec<String> = (0..24_000)
        .map(|i| format!("nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-{i:012}-padding-to-make-the-name-long"))
        .collect();
    let list = hosts
        .iter()
        .map(|h| format!("\"{h}\""))
        .collect::<Vec<_>>()
        .join(", ");
    let d = Daemon::start(Options {
        replace: vec![(
            "allow_any_host = true".into(),
            format!("allow_any_host = false\nhosts = [{list}]"),
        )],
        ..Options::default()
    });
    let s = UnixStream::connect(&d.socket).unwrap();
    (&s).write_all(b"{\"request\":\"config\"}\n").unwrap();
    // Read only once the daemon has answered: it wrote what the socket took, and keeps the
    // rest for when the client reads.
    wait_for("the config request answered", || {
        (d.data("stats")["admin"]["requests_total"].as_u64() >= Some(1)).then_some(())
    });
    let mut line = String::new();
    BufReader::new(&s).read_line(&mut line).unwrap();
    assert!(line.len() > 1 << 20, "the answer is {} bytes", line.len());
    let v: Value = serde_json::from_str(&line).expect("one whole JSON answer");
    assert_eq!(
        v["data"]["subsystem"][0]["hosts"].as_array().map(Vec::len),
        Some(24_000)
    );
    assert_eq!(d.data("stats")["admin"]["dropped_total"], 0);
}

/// An admin client whose request waited in its socket through a long change (held here at
/// the test gate, past the client's idle timeout) is answered: the idle sweep after the
/// change dropped it before its request was read.
#[test]
fn a_client_whose_request_waited_through_a_long_change_is_answered() {
    let gate = tempfile::tempdir().unwrap();
    let d = Daemon::start(Options {
        extra_daemon: "admin_client_timeout = \"300ms\"".into(),
        test_hooks: true,
        env: vec![("NVMFD_TEST_GATE".into(), gate.path().display().to_string())],
        ..Options::default()
    });
    let x = UnixStream::connect(&d.socket).unwrap();
    let mut reader = BufReader::new(&x);
    let mut line = String::new();
    (&x).write_all(b"{\"request\":\"status\"}\n").unwrap();
    reader.read_line(&mut line).unwrap();
    std::thread::scope(|scope| {
        let resize = scope.spawn(|| {
            d.request(
                &serde_json::json!({"request": "resize_namespace",
                    "subsystem": "nqn.2024-01.io.nvmfd.test:ram0", "nsid": 1, "size": "32MiB"})
                .to_string(),
            )
        });
        wait_for("the resize to wait at the gate", || {
            gate.path().join("resize-waiting").exists().then_some(())
        });
        (&x).write_all(b"{\"request\":\"status\"}\n").unwrap();
        // The client's idle timeout passes while the change waits: the time itself is what
        // the test needs.
        std::thread::sleep(Duration::from_millis(600));
        std::fs::write(gate.path().join("resize-go"), b"").unwrap();
        let a = resize.join().unwrap();
        assert_eq!(a["ok"], true, "{a}");
    });
    line.clear();
    reader.read_line(&mut line).unwrap();
    let v: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"));
    assert_eq!(v["ok"], true, "{v}");
}

#[test]
fn a_vanished_client_does_not_disturb_the_daemon() {
    let d = Daemon::start(Options::default());
    for _ in 0..20 {
        let mut s = UnixStream::connect(&d.socket).unwrap();
        s.write_all(b"{\"request\":\"stats\"}\n{\"request\":\"config\"}\n")
            .unwrap();
        drop(s); // gone before the answers
    }
    let s = UnixStream::connect(&d.socket).unwrap();
    s.shutdown(std::net::Shutdown::Both).unwrap();
    drop(s);
    assert_eq!(d.data("status")["state"], "running");
    // Only the client asking is left (it counts itself); one more held open counts too.
    wait_for("vanished clients to be reaped", || {
        (d.data("stats")["admin"]["clients"].as_u64().unwrap() == 1).then_some(())
    });
    let held = UnixStream::connect(&d.socket).unwrap();
    wait_for("the held client to count", || {
        (d.data("stats")["admin"]["clients"].as_u64().unwrap() == 2).then_some(())
    });
    drop(held);
}

#[test]
fn a_hundred_clients_at_once_each_get_an_answer_or_a_clean_refusal() {
    let d = Daemon::start(Options::default());
    let mut clients: Vec<UnixStream> = (0..100)
        .map(|_| UnixStream::connect(&d.socket).unwrap())
        .collect();
    for c in &mut clients {
        // A refused client may already be closed: its refusal is waiting to be read.
        let _ = c.write_all(b"{\"request\":\"status\"}\n");
    }
    let mut ok = 0;
    let mut refused = 0;
    for c in &clients {
        let v: Value = serde_json::from_str(&read_line(c)).unwrap();
        if v["ok"] == true {
            ok += 1;
        } else {
            assert!(
                v["error"]
                    .as_str()
                    .unwrap()
                    .starts_with("too many admin clients (limit 64)"),
                "{v}"
            );
            refused += 1;
        }
    }
    assert_eq!(
        (ok, refused),
        (64, 36),
        "all 100 are held open: the first 64 are served"
    );
    drop(clients);
    wait_for("the clients to be reaped", || {
        (d.data("stats")["admin"]["clients"].as_u64().unwrap() == 1).then_some(())
    });
    // The refused were dropped; none of their requests was read, so none is an error (errors
    // are requests answered with one, never more than the requests).
    let admin = d.data("stats")["admin"].clone();
    assert!(admin["dropped_total"].as_u64().unwrap() >= 36, "{admin}");
    assert_eq!(admin["errors_total"], 0, "{admin}");
    assert_eq!(d.data("status")["state"], "running");
}

fn nvmfctl(d: &Daemon, args: &[&str]) -> (bool, String, String) {
    nvmfctl_with(Command::new(bin("nvmfctl")), d, args)
}

/// [`nvmfctl`] through `cmd` (nvmfctl itself, or a command that runs it).
fn nvmfctl_with(mut cmd: Command, d: &Daemon, args: &[&str]) -> (bool, String, String) {
    let out = cmd
        .arg("--socket")
        .arg(&d.socket)
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A change the daemon takes several seconds to apply (here a reactor busy for 7 s) is waited
/// for: nvmfctl reports what the daemon did, not a timeout for a change applied later.
#[test]
fn nvmfctl_waits_for_a_slow_change() {
    let d = Daemon::start(Options {
        test_hooks: true,
        ..Options::default()
    });
    let v = d.request(r#"{"request":"debug_stall_reactor","reactor":0,"ms":7000}"#);
    assert_eq!(v["ok"], true, "{v}");
    wait_for("the reactor to stall", || {
        d.log()
            .contains("test hook: reactor stalling")
            .then_some(())
    });
    let (ok, out, err) = nvmfctl(
        &d,
        &[
            "namespace",
            "add",
            "nqn.2024-01.io.nvmfd.test:ram0",
            "--nsid",
            "5",
            "--backend",
            "null",
            "--size",
            "1MiB",
        ],
    );
    assert!(ok, "nvmfctl failed: {out}{err}");
    let config = d.data("config");
    let nsids: Vec<u64> = config["subsystem"][0]["namespace"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["nsid"].as_u64().unwrap())
        .collect();
    assert!(nsids.contains(&5), "{config}");
}

#[test]
fn nvmfctl_prints_tables_json_toml_and_prometheus() {
    let d = Daemon::start(Options::default());
    let (ok, out, err) = nvmfctl(&d, &["status"]);
    assert!(ok, "{err}");
    for needle in [
        "nqn.2024-01.io.nvmfd.test:ram0",
        "listeners",
        "reactors",
        "running",
    ] {
        assert!(out.contains(needle), "status lacks {needle}:\n{out}");
    }
    let (ok, out, _) = nvmfctl(&d, &["status", "--json"]);
    assert!(ok);
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["state"], "running");

    let (ok, out, _) = nvmfctl(&d, &["stats"]);
    assert!(ok);
    assert!(out.contains("turns") && out.contains("admin"), "{out}");

    // The reactor is started before its first turn, so wait for the heartbeat to move.
    let out = wait_for("reactor 0 to turn", || {
        let (ok, out, err) = nvmfctl(&d, &["stats", "--prometheus"]);
        assert!(ok, "{err}");
        assert!(
            out.contains("# TYPE nvmfd_reactor_turns_total counter\n") && !out.contains("# EOF"),
            "{out}"
        );
        let turns = out
            .lines()
            .find_map(|l| l.strip_prefix("nvmfd_reactor_turns_total{id=\"0\",core=\"0\"} "))
            .unwrap_or_else(|| panic!("no reactor 0 series:\n{out}"));
        (turns.parse::<u64>().unwrap() > 0).then_some(out)
    });
    for line in out.lines().filter(|l| !l.starts_with('#')) {
        let (name, value) = line.rsplit_once(' ').unwrap();
        assert!(name.starts_with("nvmfd_"), "{line}");
        assert!(value.parse::<f64>().is_ok(), "{line}");
    }

    let (ok, out, _) = nvmfctl(&d, &["config"]);
    assert!(ok);
    let cfg: toml::Table = toml::from_str(&out).unwrap_or_else(|e| panic!("{e}:\n{out}"));
    assert_eq!(
        cfg["subsystem"][0]["nqn"].as_str(),
        Some("nqn.2024-01.io.nvmfd.test:ram0")
    );
    // What nvmfctl prints is itself a valid configuration.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("printed.toml");
    std::fs::write(&path, &out).unwrap();
    let check = Command::new(bin("nvmfd"))
        .arg("--check-config")
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        check.status.success(),
        "{}",
        String::from_utf8_lossy(&check.stderr)
    );
}

/// `nvmfctl --config FILE reload` (the systemd unit's reload) finds the admin socket the file
/// names, and fails, with the daemon's reason, when the reload is refused.
#[test]
fn nvmfctl_reload_with_the_config_file_says_whether_the_reload_was_taken() {
    let d = Daemon::start(Options::default());
    let config = d.dir.path().join("nvmfd.toml");
    let reload = || {
        // The file's socket wins over one in the environment.
        let out = Command::new(bin("nvmfctl"))
            .env("NVMFD_SOCKET", "/nonexistent/other.sock")
            .arg("--config")
            .arg(&config)
            .arg("reload")
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr),
        )
    };
    let (ok, out) = reload();
    assert!(ok, "{out}");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(
        &config,
        text.replace("size = \"64MiB\"", "size = \"64MiB\"\nbogus = 1"),
    )
    .unwrap();
    let (ok, out) = reload();
    assert!(!ok, "a refused reload reported success: {out}");
    assert!(out.contains("bogus"), "{out}");
    // Where, as `nvmfd --check-config` says it: the file, line and column.
    let line = 1
        + text
            .lines()
            .position(|l| l.contains("size = \"64MiB\""))
            .unwrap()
        + 1;
    assert!(
        out.contains(&format!("{}:{line}:", config.display())),
        "no file:line in: {out}"
    );
    assert_eq!(d.data("status")["state"], "running");
}

/// A socket opened to others (a group, for monitoring) lets them read, not change: a change
/// opens files and devices as the daemon and exports them to hosts. Any peer could make any
/// change, a namespace on /etc/shadow for one.
#[test]
fn only_root_changes_anything_through_the_admin_socket() {
    use std::os::unix::fs::PermissionsExt;
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return nvmfd_tests::skip("needs root, to ask as another user");
    }
    if Command::new("setpriv").arg("--version").output().is_err() {
        return nvmfd_tests::skip("setpriv (util-linux) is missing");
    }
    let d = Daemon::start(Options::default());
    for p in [d.dir.path(), d.socket.as_path()] {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o777)).unwrap();
    }
    let as_nobody = |args: &[&str]| {
        let mut setpriv = Command::new("setpriv");
        setpriv
            .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(bin("nvmfctl"));
        let (ok, out, err) = nvmfctl_with(setpriv, &d, args);
        (ok, out + &err)
    };
    let (ok, out) = as_nobody(&["status"]);
    assert!(ok, "{out}");
    let (ok, out) = as_nobody(&["stats"]);
    assert!(ok, "{out}");
    for change in [
        vec!["reload"],
        vec![
            "namespace",
            "add",
            "nqn.2024-01.io.nvmfd.test:ram0",
            "--nsid",
            "2",
            "--backend",
            "file",
            "--path",
            "/etc/shadow",
            "--read-only",
        ],
    ] {
        let (ok, out) = as_nobody(&change);
        assert!(!ok, "{change:?} by uid 65534 was taken: {out}");
        assert!(out.contains("changes need root"), "{out}");
    }
    assert_eq!(
        d.data("status")["namespaces"].as_array().unwrap().len(),
        1,
        "nothing changed"
    );
    // Root still changes.
    assert!(d.request(r#"{"request":"reload"}"#)["ok"] == true);
}

/// Clients that may only look (a monitoring group's) cannot take every admin connection:
/// the last eight are kept for root and the daemon's user, so a reload or a change still
/// gets in while 56 lookers hold theirs.
#[test]
fn clients_that_may_only_look_leave_room_for_root() {
    use std::os::unix::fs::PermissionsExt;
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return nvmfd_tests::skip("needs root, to connect as another user");
    }
    let d = Daemon::start(Options::default());
    for p in [d.dir.path(), d.socket.as_path()] {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o777)).unwrap();
    }
    let socket = d.socket.clone();
    // A thread of its own takes user 65534 (the raw system call changes the calling thread
    // alone), and its connections carry that user.
    let lookers = std::thread::spawn(move || {
        // SAFETY: changes this thread's user IDs only; it does nothing else as root after.
        let rc = unsafe { libc::syscall(libc::SYS_setresuid, 65534, 65534, 65534) };
        assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
        (0..64)
            .map(|_| UnixStream::connect(&socket).unwrap())
            .collect::<Vec<_>>()
    })
    .join()
    .unwrap();
    let mut ok = 0;
    let mut refused = 0;
    for mut c in &lookers {
        let _ = c.write_all(b"{\"request\":\"status\"}\n");
        let v: Value = serde_json::from_str(&read_line(c)).unwrap();
        if v["ok"] == true {
            ok += 1;
        } else {
            let e = v["error"].as_str().unwrap_or_default();
            assert!(e.contains("may only look (limit 56"), "{v}");
            refused += 1;
        }
    }
    assert_eq!((ok, refused), (56, 8));
    // Root gets in, and changes.
    assert_eq!(d.request(r#"{"request":"reload"}"#)["ok"], true);
    drop(lookers);
}

/// The systemd unit's reload after `daemon.admin_socket` was edited (it takes effect at the
/// restart) with other changes: `nvmfctl --config FILE --pid PID` finds the socket the daemon
/// listens on, and the rest of the file applies. It tried the file's new socket, failed to
/// connect, and every later change was refused as the file held edits not loaded.
#[test]
fn nvmfctl_reload_finds_the_daemons_socket_after_the_file_moved_it() {
    let d = Daemon::start(Options::default());
    let config = d.dir.path().join("nvmfd.toml");
    let text = std::fs::read_to_string(&config).unwrap();
    let moved = d.dir.path().join("moved.sock");
    let edited = text
        .replace(
            &format!("admin_socket = \"{}\"", d.socket.display()),
            &format!("admin_socket = \"{}\"", moved.display()),
        )
        .replace(
            "size = \"64MiB\"",
            "size = \"64MiB\"\n\n[[subsystem.namespace]]\nnsid = 2\nbackend = \"null\"\nsize = \"8MiB\"",
        );
    assert!(edited.contains("moved.sock") && edited.contains("nsid = 2"));
    std::fs::write(&config, &edited).unwrap();
    let out = Command::new(bin("nvmfctl"))
        .arg("--config")
        .arg(&config)
        .arg("--pid")
        .arg(d.child.id().to_string())
        .arg("reload")
        .output()
        .unwrap();
    let said =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    assert!(said.contains("next restart"), "{said}");
    let status = d.data("status");
    assert_eq!(
        status["namespaces"].as_array().unwrap().len(),
        2,
        "{status}"
    );
}

/// A reload of a file whose `[daemon]` section was edited was refused whole ("changes only
/// with a restart"), and from then on every change was refused too: the file no longer
/// matched what was loaded ("reload it first"), a loop only a restart or undoing the edit
/// left. The rest of the file applies now, the reply says the section waits for a restart,
/// and later changes are taken (the edit stays in the file for the restart).
#[test]
fn a_reload_applies_the_rest_of_the_file_when_daemon_settings_changed() {
    let d = Daemon::start(Options::default());
    let config = d.dir.path().join("nvmfd.toml");
    let text = std::fs::read_to_string(&config).unwrap();
    let edited = text
        .replace("stall_timeout = \"300ms\"", "stall_timeout = \"400ms\"")
        .replace(
            "size = \"64MiB\"",
            "size = \"64MiB\"\n\n[[subsystem.namespace]]\nnsid = 2\nbackend = \"null\"\nsize = \"8MiB\"",
        );
    assert_ne!(edited, text);
    std::fs::write(&config, &edited).unwrap();
    let a = d.request(r#"{"request": "reload"}"#);
    assert_eq!(a["ok"], true, "{a}");
    let said = a.to_string();
    assert!(said.contains("namespace 2"), "{said}");
    assert!(
        said.contains("the changes to [daemon] take effect at the next restart"),
        "{said}"
    );
    // A later change is taken, and written back with the operator's edit kept.
    let a = d.request(
        &serde_json::json!({"request": "add_host", "subsystem": "nqn.2024-01.io.nvmfd.test:ram0",
            "host": "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-000000000077"})
        .to_string(),
    );
    assert_eq!(a["ok"], true, "{a}");
    let now = std::fs::read_to_string(&config).unwrap();
    assert!(now.contains("stall_timeout = \"400ms\""), "{now}");
    assert!(now.contains("000000000077"), "{now}");
}

/// A subsystem's serial number and model are its identity to hosts (read once per
/// controller; a host's paths to it must agree): a reload that changes them for a served
/// subsystem keeps the old ones until the next restart, and says so. It applied them live,
/// without a word. A subsystem the reload adds with an NQN outside the specification's form
/// is warned about, as at start.
#[test]
fn a_reload_keeps_a_served_subsystems_identity_until_the_restart_and_warns_of_new_nqns() {
    let d = Daemon::start(Options::default());
    let sub = "nqn.2024-01.io.nvmfd.test:ram0";
    let mut h = nvmfd_tests::host::Host::connect("127.0.0.56", d.soft_addr(), sub, 0x56);
    let before = h.admin.identify_controller().unwrap();
    let config = d.dir.path().join("nvmfd.toml");
    let text = std::fs::read_to_string(&config).unwrap();
    let edited = text.replace(
        "allow_any_host = true\n",
        "allow_any_host = true\nserial = \"NEW-SERIAL-1\"\nmodel = \"new model\"\n",
    ) + "\n[[subsystem]]\nnqn = \"outside-the-form\"\nallow_any_host = true\n";
    std::fs::write(&config, &edited).unwrap();
    let a = d.request(r#"{"request": "reload"}"#);
    assert_eq!(a["ok"], true, "{a}");
    let said = a.to_string();
    assert!(
        said.contains(&format!(
            "the changes to the serial number and model of {sub} take effect at the next restart"
        )),
        "{said}"
    );
    assert!(
        said.contains("warning: subsystem[1].nqn: `outside-the-form` does not start with `nqn.`"),
        "{said}"
    );
    let after = h.admin.identify_controller().unwrap();
    assert_eq!(
        (wire::get_str(&after.sn), wire::get_str(&after.mn)),
        (wire::get_str(&before.sn), wire::get_str(&before.mn)),
        "the served subsystem's identity changed under its host"
    );
    // The subsystem added is served (the reload was taken).
    wait_for("the added subsystem in status", || {
        d.data("status")
            .to_string()
            .contains("outside-the-form")
            .then_some(())
    });
    // A subsystem added before it moves its key's index: it is not warned of again.
    let text = std::fs::read_to_string(&config).unwrap();
    let edited = text.replacen(
        "[[subsystem]]",
        "[[subsystem]]\nnqn = \"nqn.2024-01.io.nvmfd.test:first\"\nallow_any_host = true\n\n[[subsystem]]",
        1,
    );
    std::fs::write(&config, &edited).unwrap();
    let a = d.request(r#"{"request": "reload"}"#);
    assert_eq!(a["ok"], true, "{a}");
    assert!(!a.to_string().contains("warning"), "warned again: {a}");
}

#[test]
fn nvmfctl_says_when_the_daemon_is_not_there() {
    let out = Command::new(bin("nvmfctl"))
        .args(["--socket", "/nonexistent/nvmfd.sock", "status"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("cannot connect to /nonexistent/nvmfd.sock")
            && err.contains("is nvmfd running?"),
        "{err}"
    );
}

/// Asks for `status` on a new connection: the answer's length, or why none came within 5 s.
fn status_line_within_5s(d: &Daemon) -> std::io::Result<usize> {
    let mut other = UnixStream::connect(&d.socket).unwrap();
    other
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    other.write_all(b"{\"request\":\"status\"}\n").unwrap();
    let mut line = String::new();
    BufReader::new(&other).read_line(&mut line)
}

/// A client that sends requests as fast as it reads the answers never has its answers pile up
/// past the output bound, yet it must not hold the control thread: another client is answered
/// meanwhile, within a bound.
#[test]
fn a_client_flooding_requests_does_not_hold_the_control_thread() {
    let d = Daemon::start(Options::default());
    let flood = UnixStream::connect(&d.socket).unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut w = flood.try_clone().unwrap();
    let st = std::sync::Arc::clone(&stop);
    let writer = std::thread::spawn(move || {
        let line = b"{\"request\":\"status\"}\n".repeat(64);
        while !st.load(std::sync::atomic::Ordering::Relaxed) {
            if w.write_all(&line).is_err() {
                break;
            }
        }
    });
    let mut r = flood.try_clone().unwrap();
    let st = std::sync::Arc::clone(&stop);
    let received = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let got_bytes = std::sync::Arc::clone(&received);
    let reader = std::thread::spawn(move || {
        let mut buf = vec![0u8; 1 << 16];
        r.set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        while !st.load(std::sync::atomic::Ordering::Relaxed) {
            match r.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    got_bytes.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
                }
                Err(_) => {}
            }
        }
    });
    // The flood is on: its answers are coming (a megabyte of them).
    wait_for("the flood's answers", || {
        (received.load(std::sync::atomic::Ordering::Relaxed) > 1 << 20).then_some(())
    });
    let got = status_line_within_5s(&d);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = flood.shutdown(std::net::Shutdown::Both);
    let _ = writer.join();
    let _ = reader.join();
    assert!(
        matches!(got, Ok(n) if n > 0),
        "no answer within 5 s while another client floods: {got:?}"
    );
}

/// A client that sends nothing but blank lines, as fast as it can, gets no answers, and must
/// not hold the control thread either: another client is answered meanwhile, within a bound.
#[test]
fn a_client_flooding_blank_lines_does_not_hold_the_control_thread() {
    let d = Daemon::start(Options::default());
    let flood = UnixStream::connect(&d.socket).unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let written = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut w = flood.try_clone().unwrap();
    let (st, sent) = (
        std::sync::Arc::clone(&stop),
        std::sync::Arc::clone(&written),
    );
    let writer = std::thread::spawn(move || {
        let lines = vec![b'\n'; 1 << 16];
        while !st.load(std::sync::atomic::Ordering::Relaxed) {
            if w.write_all(&lines).is_err() {
                break;
            }
            sent.fetch_add(lines.len(), std::sync::atomic::Ordering::Relaxed);
        }
    });
    // The flood is on: the daemon has taken some of it (more than a socket buffer holds).
    wait_for("the blank lines to flow", || {
        (written.load(std::sync::atomic::Ordering::Relaxed) > 1 << 20).then_some(())
    });
    let got = status_line_within_5s(&d);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = flood.shutdown(std::net::Shutdown::Both);
    let _ = writer.join();
    assert!(
        matches!(got, Ok(n) if n > 0),
        "no answer within 5 s while another client sends blank lines: {got:?}"
    );
}

/// A ramfs mounted on a directory of its own, unmounted on drop.
struct Ramfs(tempfile::TempDir);

impl Ramfs {
    fn mount() -> Option<Ramfs> {
        let dir = tempfile::tempdir().ok()?;
        let ok = Command::new("mount")
            .args(["-t", "ramfs", "nvmfd-test"])
            .arg(dir.path())
            .status()
            .is_ok_and(|s| s.success());
        ok.then_some(Ramfs(dir))
    }
}

impl Drop for Ramfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.0.path()).status();
    }
}

/// A file namespace on a file system that refuses O_DIRECT (ramfs) is served with buffered
/// I/O, and the daemon says so: a warning in its log and in its status entry.
#[test]
fn a_file_namespace_served_without_o_direct_is_reported() {
    let Some(fs) = Ramfs::mount() else {
        nvmfd_tests::skip("cannot mount a ramfs (needs root) to put a file without O_DIRECT on");
        return;
    };
    let img = fs.0.path().join("ns.img");
    std::fs::File::create(&img)
        .and_then(|f| f.set_len(8 << 20))
        .unwrap();
    let direct = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(&img);
    if direct.is_ok() {
        nvmfd_tests::skip("ramfs takes O_DIRECT on this kernel");
        return;
    }
    let d = Daemon::start(Options {
        replace: vec![(
            "backend = \"malloc\"\nsize = \"64MiB\"\n".into(),
            format!("backend = \"file\"\npath = \"{}\"\n", img.display()),
        )],
        ..Options::default()
    });
    d.assert_served_with_warning(0, &["O_DIRECT", "buffered"]);
}

/// Two gateways serving one NQN, each with a controller ID range of its own (`cntlid_min`,
/// `cntlid_max`): a host's controllers on them never share an ID (the Linux host refuses a
/// second path whose controller has the ID of one it has). Before, there was no range to set,
/// and both daemons gave their first controller the same ID.
#[test]
fn gateways_of_one_nqn_give_controller_ids_from_their_own_ranges() {
    let with_range = |lo: u16, hi: u16| Options {
        replace: vec![(
            "allow_any_host = true\n".into(),
            format!("allow_any_host = true\ncntlid_min = {lo}\ncntlid_max = {hi}\n"),
        )],
        ..Options::default()
    };
    let a = Daemon::start(with_range(1, 32767));
    let b = Daemon::start(with_range(32768, 65519));
    let sub = "nqn.2024-01.io.nvmfd.test:ram0";
    let ha = nvmfd_tests::host::Host::connect("127.0.0.57", a.soft_addr(), sub, 0x57);
    let hb = nvmfd_tests::host::Host::connect("127.0.0.58", b.soft_addr(), sub, 0x57);
    assert!(
        (1..=32767).contains(&ha.admin.cntlid),
        "{}",
        ha.admin.cntlid
    );
    assert!(
        (32768..=65519).contains(&hb.admin.cntlid),
        "{}",
        hb.admin.cntlid
    );
    assert_eq!(
        a.data("config")["subsystem"][0]["cntlid_max"],
        32767,
        "the range is in the configuration in force"
    );
}

/// A reload that changes a served subsystem's serial number (held until the restart) and adds
/// a subsystem with its old one: both would serve one serial number and model, which hosts
/// name disks by, so it is refused. The file alone passed validation, and the two went live.
#[test]
fn a_reload_cannot_give_a_new_subsystem_a_served_ones_serial_number() {
    let d = Daemon::start(Options {
        replace: vec![(
            "allow_any_host = true\n".into(),
            "allow_any_host = true\nserial = \"S1\"\n".into(),
        )],
        ..Options::default()
    });
    let config = d.dir.path().join("nvmfd.toml");
    let text = std::fs::read_to_string(&config).unwrap();
    let edited = text.replace("serial = \"S1\"\n", "serial = \"S3\"\n")
        + "\n[[subsystem]]\nnqn = \"nqn.2024-01.io.nvmfd.test:c\"\nallow_any_host = true\nserial = \"S1\"\n";
    std::fs::write(&config, &edited).unwrap();
    let a = d.request(r#"{"request": "reload"}"#);
    assert_eq!(a["ok"], false, "{a}");
    let why = a["error"].as_str().unwrap_or_default();
    assert!(
        why.contains("would serve one serial number and model"),
        "{a}"
    );
    assert_eq!(
        d.data("status")["subsystems"].as_array().unwrap().len(),
        1,
        "nothing was changed"
    );
}
