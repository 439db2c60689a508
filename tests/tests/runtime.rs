//! Changes while nvmfd serves, through its admin socket and SIGHUP: namespaces added, resized
//! and removed are announced to a connected host (Asynchronous Event Requests completed over
//! the soft provider's RDMA, the Changed Namespace List), a subsystem the change does not name
//! keeps serving, the configuration file is written back with its comments, invalid changes
//! are refused with the file's messages and change nothing, and controllers are listed and
//! ended on request.

use std::net::SocketAddr;

use nvmfd_nvme::NS_ATTR_CHANGED_EVENT;
use nvmfd_tests::host::{host, Host};
use nvmfd_tests::{test_port, wait_for, Daemon, Options};

const A: &str = "nqn.2024-01.io.nvmfd.test:a";
const B: &str = "nqn.2024-01.io.nvmfd.test:b";

fn config(dir: &std::path::Path, port: u16) -> String {
    format!(
        r#"# kept: a comment at the top
[daemon]
reactor_cores = [0]
admin_socket = "{}"

[[listener]]
address = "127.0.0.1"
port = {port}
provider = "soft"

# subsystem A: the one that changes
[[subsystem]]
nqn = "{A}"
allow_any_host = true

[[subsystem.namespace]]
nsid = 1
backend = "malloc"
size = "8MiB"

# subsystem B: never named by a change
[[subsystem]]
nqn = "{B}"
allow_any_host = true

[[subsystem.namespace]]
nsid = 1
backend = "malloc"
size = "8MiB"
"#,
        dir.join("admin.sock").display()
    )
}

fn start() -> (Daemon, SocketAddr) {
    let port = test_port();
    let d = Daemon::start(Options {
        config: Some(config(std::path::Path::new("@DIR@"), port)),
        ..Options::default()
    });
    (d, SocketAddr::from(([127, 0, 0, 1], port)))
}

/// `start`, with test hooks on and, with `gate`, the test gate (`NVMFD_TEST_GATE`) there.
fn start_hooked(gate: Option<&std::path::Path>) -> (Daemon, SocketAddr) {
    let port = test_port();
    let d = Daemon::start(Options {
        config: Some(config(std::path::Path::new("@DIR@"), port)),
        test_hooks: true,
        env: gate
            .map(|g| ("NVMFD_TEST_GATE".into(), g.display().to_string()))
            .into_iter()
            .collect(),
        ..Options::default()
    });
    (d, SocketAddr::from(([127, 0, 0, 1], port)))
}

fn change(d: &Daemon, req: serde_json::Value) -> serde_json::Value {
    let a = d.request(&req.to_string());
    assert_eq!(a["ok"], true, "{req}: {a}\nlog:\n{}", d.log());
    a["data"].clone()
}

fn refused(d: &Daemon, req: serde_json::Value) -> String {
    let a = d.request(&req.to_string());
    assert_eq!(a["ok"], false, "{req} was accepted: {a}");
    a["error"].as_str().unwrap_or_default().to_owned()
}

fn config_text(d: &Daemon) -> String {
    std::fs::read_to_string(d.dir.path().join("nvmfd.toml")).unwrap()
}

#[test]
fn namespaces_added_resized_and_removed_are_announced_and_other_subsystems_never_notice() {
    let (d, addr) = start();
    let mut a = Host::connect("127.0.0.31", addr, A, 0x31);
    let mut b = Host::connect("127.0.0.32", addr, B, 0x32);
    b.write_read(1, 0, 0xB0);
    let b_cntlid = b.admin.cntlid;

    // Added: the held AER completes, the list names it, it serves I/O.
    let aer = a.post_aer();
    let done = change(
        &d,
        serde_json::json!({"request": "add_namespace", "subsystem": A,
            "namespace": {"nsid": 2, "backend": "malloc", "size": "4MiB",
                          "uuid": "6f3c1a52-6d7e-4d2a-9a51-0c6f0b1e2d3c"}}),
    );
    assert!(
        done["changes"][0].as_str().unwrap().contains("namespace 2"),
        "{done}"
    );
    assert_eq!(a.wait_aer(aer), NS_ATTR_CHANGED_EVENT);
    assert_eq!(a.changed(), vec![2]);
    assert_eq!(a.blocks(2), 4 << 11);
    a.write_read(2, 8, 0xA2);
    b.write_read(1, 8, 0xB1);

    // Resized: announced again, the new capacity seen, the data kept.
    let aer = a.post_aer();
    change(
        &d,
        serde_json::json!({"request": "resize_namespace", "subsystem": A, "nsid": 2, "size": "2MiB"}),
    );
    assert_eq!(a.wait_aer(aer), NS_ATTR_CHANGED_EVENT);
    assert_eq!(a.changed(), vec![2]);
    assert_eq!(a.blocks(2), 2 << 11);
    let mut back = vec![0u8; 4096];
    a.io.read(2, 8, 8, &mut back).unwrap();
    assert!(
        back.iter().all(|&x| x == 0xA2),
        "data kept across the resize"
    );
    // Past the new end: LBA Out of Range.
    let e = a.io.read(2, 4096, 8, &mut back).unwrap_err();
    assert!(e.to_string().contains("sc 0x80"), "{e}");

    // Removed: announced, inactive (a zeroed Identify), its I/O refused.
    let aer = a.post_aer();
    change(
        &d,
        serde_json::json!({"request": "remove_namespace", "subsystem": A, "nsid": 2}),
    );
    assert_eq!(a.wait_aer(aer), NS_ATTR_CHANGED_EVENT);
    assert_eq!(a.changed(), vec![2]);
    assert_eq!(a.blocks(2), 0);
    let e = a.io.read(2, 0, 8, &mut back).unwrap_err();
    assert!(e.to_string().contains("sc 0x0b"), "Invalid Namespace: {e}");
    a.write_read(1, 0, 0xA1);

    // B's controller is the one it had, and served throughout.
    b.write_read(1, 16, 0xB2);
    let ctrls = d.data("controllers");
    let bc = ctrls
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["subsystem"] == B)
        .unwrap_or_else(|| panic!("B's controller: {ctrls}"));
    assert_eq!(bc["cntlid"], b_cntlid);
    // Where the host connects from: the TCP peer of its soft connection.
    let from: std::net::SocketAddr = bc["host_address"]
        .as_str()
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("host address of {bc}"));
    assert!(from.ip().is_loopback() && from.port() != 0, "{bc}");
    let qids: Vec<u64> = bc["queues"]
        .as_array()
        .unwrap()
        .iter()
        .map(|q| q["qid"].as_u64().unwrap())
        .collect();
    assert_eq!(qids, vec![0, 1], "{bc}");
    assert_eq!(bc["queues"][1]["depth"], 32, "{bc}");
    assert!(bc["commands"].as_u64().unwrap() >= 8, "{bc}");

    // The file: its comments kept, namespace 2 gone again, valid.
    let text = config_text(&d);
    assert!(text.contains("# kept: a comment at the top"), "{text}");
    assert!(
        text.contains("# subsystem B: never named by a change"),
        "{text}"
    );
    assert!(!text.contains("nsid = 2"), "{text}");
    assert!(
        d.log().contains("\"by_uid\""),
        "changes are logged with the peer's uid"
    );
}

#[test]
fn an_invalid_change_is_refused_with_the_files_message_and_changes_nothing() {
    let (d, _) = start();
    let before = config_text(&d);
    let e = refused(
        &d,
        serde_json::json!({"request": "add_namespace", "subsystem": A,
            "namespace": {"nsid": 1, "backend": "malloc", "size": "4MiB"}}),
    );
    assert!(e.contains("subsystem[0].namespace[1].nsid"), "{e}");
    let e = refused(
        &d,
        serde_json::json!({"request": "add_namespace", "subsystem": A,
            "namespace": {"nsid": 3, "backend": "file", "path": "relative.img"}}),
    );
    assert!(e.contains("is not an absolute path"), "{e}");
    // A device that does not open: nothing of the change stays.
    let e = refused(
        &d,
        serde_json::json!({"request": "add_namespace", "subsystem": A,
            "namespace": {"nsid": 3, "backend": "file", "path": "/nonexistent/nvmfd.img"}}),
    );
    assert!(e.contains("/nonexistent/nvmfd.img"), "{e}");
    let e = refused(
        &d,
        serde_json::json!({"request": "remove_subsystem", "nqn": "nqn.2024-01.io.nvmfd.test:none"}),
    );
    assert!(e.contains("no subsystem"), "{e}");
    let e = refused(
        &d,
        serde_json::json!({"request": "resize_namespace", "subsystem": A, "nsid": 1, "size": "1GiB"}),
    );
    assert!(e.contains("cannot grow"), "{e}");
    assert_eq!(config_text(&d), before, "the file is unchanged");
    let st = d.data("status");
    assert_eq!(st["namespaces"].as_array().unwrap().len(), 2, "{st}");
    assert_eq!(st["namespaces"][0]["size"], 8 << 20, "{st}");
}

#[test]
fn sighup_applies_the_files_difference_and_an_invalid_file_changes_nothing() {
    let (d, addr) = start();
    let mut a = Host::connect("127.0.0.33", addr, A, 0x33);
    let text = config_text(&d);
    let path = d.dir.path().join("nvmfd.toml");
    // Invalid: refused, logged, nothing changes.
    std::fs::write(&path, text.replace("size = \"8MiB\"", "size = \"0\"")).unwrap();
    d.signal(libc::SIGHUP);
    wait_for("the refusal in the log", || {
        d.log().contains("configuration not reloaded").then_some(())
    });
    assert_eq!(a.blocks(1), 8 << 11);
    // Valid: a namespace added to A, and B removed.
    let b_start = text.find("# subsystem B").unwrap();
    let new = format!(
        "{}[[subsystem.namespace]]\nnsid = 5\nbackend = \"malloc\"\nsize = \"1MiB\"\n",
        &text[..b_start]
    );
    std::fs::write(&path, new).unwrap();
    let aer = a.post_aer();
    d.signal(libc::SIGHUP);
    assert_eq!(a.wait_aer(aer), NS_ATTR_CHANGED_EVENT);
    assert_eq!(a.changed(), vec![5]);
    assert_eq!(a.blocks(5), 1 << 11);
    let st = d.data("status");
    assert_eq!(st["subsystems"].as_array().unwrap().len(), 1, "{st}");
    a.write_read(5, 0, 0x55);
}

#[test]
fn removing_a_subsystem_or_a_hosts_access_or_disconnecting_ends_those_controllers_only() {
    let (d, addr) = start();
    let mut a = Host::connect("127.0.0.34", addr, A, 0x34);
    let mut b = Host::connect("127.0.0.35", addr, B, 0x35);
    // An operator's disconnect ends A's controller; B serves on.
    let done = change(
        &d,
        serde_json::json!({"request": "disconnect", "cntlid": a.admin.cntlid}),
    );
    assert_eq!(done["disconnected"][0], a.admin.cntlid);
    let mut back = vec![0u8; 4096];
    assert!(a.io.read(1, 0, 8, &mut back).is_err(), "A's queue ended");
    b.write_read(1, 0, 0xB3);
    // Access: B admits only a listed host that is not this one (listing a host turns
    // allow_any_host off).
    change(
        &d,
        serde_json::json!({"request": "add_host", "subsystem": B, "host": host(0x77).nqn}),
    );
    assert!(
        b.io.read(1, 0, 8, &mut back).is_err(),
        "B's host lost access"
    );
    let mut a2 = Host::connect("127.0.0.36", addr, A, 0x36);
    a2.write_read(1, 0, 0xA4);
    // Subsystem A removed: its controller ends.
    change(
        &d,
        serde_json::json!({"request": "remove_subsystem", "nqn": A}),
    );
    assert!(a2.io.read(1, 0, 8, &mut back).is_err(), "A is gone");
    let ctrls = d.data("controllers");
    assert_eq!(ctrls.as_array().unwrap().len(), 0, "{ctrls}");
    let text = config_text(&d);
    assert!(!text.contains(A), "{text}");
    assert!(text.contains(&host(0x77).nqn), "{text}");
}

/// A daemon with test hooks and systemd's notifications (watchdog 200 ms, stall_timeout
/// 300 ms), each data path built while it serves taking `build_ms`, the excuse of a reactor
/// building bounded by `bound_ms`; and a listener added on another device (127.0.0.2).
fn adding_a_listener_built_slowly(build_ms: u64, bound_ms: u64) -> Daemon {
    let (d, _) = building_slowly(build_ms, bound_ms);
    add_a_listener_on_another_device(&d);
    d
}

/// The daemon of `adding_a_listener_built_slowly`, with no listener added yet, and the
/// address it serves.
fn building_slowly(build_ms: u64, bound_ms: u64) -> (Daemon, SocketAddr) {
    let port = test_port();
    let d = Daemon::spawn(Options {
        config: Some(config(std::path::Path::new("@DIR@"), port).replace(
            "reactor_cores = [0]",
            "reactor_cores = [0]\nstall_timeout = \"300ms\"",
        )),
        notify: true,
        watchdog_usec: Some(200_000),
        test_hooks: true,
        env: vec![
            ("NVMFD_TEST_PATH_BUILD_MS".into(), build_ms.to_string()),
            (
                "NVMFD_TEST_REACTOR_SETUP_TIMEOUT_MS".into(),
                bound_ms.to_string(),
            ),
        ],
        ..Options::default()
    });
    d.notifications_until("READY=1");
    d.notifications_until("WATCHDOG=1");
    (d, SocketAddr::from(([127, 0, 0, 1], port)))
}

/// A daemon of `building_slowly(build_ms, bound_ms)` with host `n` (127.0.0.`n`, in hex) connected
/// with a keep-alive timeout of `kato_ms`, having written and read, and then a listener
/// added on another device: the build starts.
fn a_host_then_a_slow_build(build_ms: u64, bound_ms: u64, kato_ms: u32, n: u8) -> (Daemon, Host) {
    let (d, addr) = building_slowly(build_ms, bound_ms);
    let mut h = Host::connect_with_kato(&format!("127.0.0.{n:x}"), addr, A, n, kato_ms);
    h.write_read(1, 0, n);
    add_a_listener_on_another_device(&d);
    (d, h)
}

/// Whether `d`'s log has `what` yet, its notifications read meanwhile (the watchdog's come
/// every 100 ms: a full socket would hold the daemon's control thread up).
fn logged(d: &Daemon, what: &str) -> Option<()> {
    d.notifications_for(std::time::Duration::from_millis(20));
    d.log().contains(what).then_some(())
}

/// Adds a listener on 127.0.0.2 (another device: a data path built while serving).
fn add_a_listener_on_another_device(d: &Daemon) {
    let second = test_port();
    change(
        d,
        serde_json::json!({"request": "add_listener",
            "listener": {"address": "127.0.0.2", "port": second, "provider": "soft"}}),
    );
}

/// A data path built while the daemon serves (a listener added on another device) holds
/// its reactor up while its pools are registered, which takes seconds for large pools on
/// some NICs: the reactor is excused as during its build at start, so the daemon is not
/// reported stalled and systemd's watchdog is fed on (it would kill the daemon).
#[test]
fn a_data_path_built_while_serving_does_not_stall_the_daemon() {
    let mut d = adding_a_listener_built_slowly(1500, 60_000);
    // The build takes 1.5 s, five times stall_timeout (300 ms) and seven watchdog
    // intervals: the watchdog is fed all along.
    let during = d.notifications_for(std::time::Duration::from_millis(1200));
    assert!(
        during.iter().filter(|m| m.contains("WATCHDOG=1")).count() >= 3
            && !during.iter().any(|m| m.contains("STALLED")),
        "{during:?}\n{}",
        d.log()
    );
    wait_for("the new listener's data path", || {
        d.log()
            .contains("data path built on the listener's device")
            .then_some(())
    });
    assert!(!d.log().contains("reactor stalled"), "{}", d.log());
    d.signal(libc::SIGTERM);
    assert!(d.wait_exit().success());
}

/// A reactor building a data path while serving reads none of its queues' commands: their
/// hosts' Keep Alives wait. That time counts against no controller, and the timers run again
/// after it. Before, a controller whose keep-alive timeout was shorter than the build was
/// ended meanwhile.
#[test]
fn a_data_path_built_while_serving_expires_no_controller() {
    // A keep-alive timeout of 2 s: the build takes twice that.
    let (mut d, mut h) = a_host_then_a_slow_build(4000, 60_000, 2000, 0x39);
    wait_for("the new listener's data path", || {
        logged(&d, "data path built on the listener's device")
    });
    h.write_read(1, 0, 0x3A);
    assert!(!d.log().contains("keep-alive timeout"), "{}", d.log());
    // The host says nothing more: its controller's timer runs again, and it ends.
    wait_for("the controller's keep-alive timeout", || {
        logged(&d, "keep-alive timeout: controller ended")
    });
    d.signal(libc::SIGTERM);
    assert!(d.wait_exit().success());
}

/// A build past the bound a reactor is excused for (a stall) holds no keep-alive timer past
/// that bound: a controller whose host sends nothing ends during it. Before, the timers were
/// held for as long as any reactor built.
#[test]
fn a_data_path_build_past_the_setup_bound_holds_keep_alives_no_longer() {
    let (mut d, _h) = a_host_then_a_slow_build(5000, 500, 1000, 0x40);
    wait_for("the controller's keep-alive timeout", || {
        logged(&d, "keep-alive timeout: controller ended")
    });
    let log = d.log();
    assert!(
        !log.contains("data path built on the listener's device"),
        "the controller ended only after the build:\n{log}"
    );
    d.signal(libc::SIGTERM);
    assert!(d.wait_exit().success());
}

/// A build that outlasts the bound (as a reactor's setup at start) is a stall after all:
/// reported, the watchdog starved, and the reactor recovers once the build ends.
#[test]
fn a_data_path_build_past_the_setup_bound_is_a_stall() {
    let mut d = adding_a_listener_built_slowly(2500, 600);
    d.notifications_until_contains("STALLED");
    wait_for("the reactor's stall in the log", || {
        d.log().contains("reactor stalled").then_some(())
    });
    wait_for("the reactor to recover", || {
        d.log()
            .contains("reactor recovered from a stall")
            .then_some(())
    });
    assert!(
        d.log().contains("data path built on the listener's device"),
        "{}",
        d.log()
    );
    d.signal(libc::SIGTERM);
    assert!(d.wait_exit().success());
}

/// Two listeners on one device (127.0.0.1, two ports) share one data path: one CQ, SRQ and
/// set of buffer pools (the request slots of one). Hosts on both are served; removing one
/// listener ends its connections only, and the data path serves the other on; adding it back
/// shares the data path again.
#[test]
fn listeners_on_one_device_share_one_data_path_and_leave_it_one_at_a_time() {
    let (d, addr) = start();
    let second = test_port();
    change(
        &d,
        serde_json::json!({"request": "add_listener",
            "listener": {"address": "127.0.0.1", "port": second, "provider": "soft"}}),
    );
    let addr2 = SocketAddr::from(([127, 0, 0, 1], second));
    let slots = |d: &Daemon| {
        d.data("stats")["datapath"][0]["request_slots"]
            .as_u64()
            .unwrap()
    };
    // The reactor took the new listener (and published its gauges after).
    wait_for("the reactor serves the second listener", || {
        (d.log().contains("listener shares its device's data path")
            || d.log().contains("data path built on the listener's device"))
        .then_some(())
    });
    wait_for("the reactor's gauges", || (slots(&d) > 0).then_some(()));
    assert_eq!(
        slots(&d),
        1024,
        "two data paths for one device:\n{}",
        d.log()
    );
    let mut a = Host::connect("127.0.0.37", addr, A, 0x37);
    let mut b = Host::connect("127.0.0.38", addr2, B, 0x38);
    a.write_read(1, 0, 0xA7);
    b.write_read(1, 8, 0xB8);
    assert_eq!(d.data("stats")["datapath"][0]["qps"], 4);
    change(
        &d,
        serde_json::json!({"request": "remove_listener", "address": "127.0.0.1", "port": second}),
    );
    let mut back = vec![0u8; 4096];
    wait_for("the removed listener's queues end", || {
        b.io.read(1, 8, 8, &mut back).is_err().then_some(())
    });
    // The other listener's host is served on, by the same data path.
    for seed in 0..8 {
        a.write_read(1, 16, seed);
    }
    assert_eq!(slots(&d), 1024);
    assert!(
        d.log().contains("its device's data path serves on"),
        "{}",
        d.log()
    );
    // Back: it shares the data path again.
    change(
        &d,
        serde_json::json!({"request": "add_listener",
            "listener": {"address": "127.0.0.1", "port": second, "provider": "soft"}}),
    );
    let mut b2 = Host::connect("127.0.0.39", addr2, B, 0x39);
    b2.write_read(1, 24, 0xB9);
    a.write_read(1, 32, 0xAA);
    assert_eq!(slots(&d), 1024);
    // Both gone (a listener on another device stays: the daemon keeps one): once its data
    // path has drained, the device is let go (on ibverbs, with the listening ID its handle
    // held); a listener on it then builds a data path anew.
    drop((a, b, b2));
    change(
        &d,
        serde_json::json!({"request": "add_listener",
            "listener": {"address": "127.0.0.2", "port": test_port(), "provider": "soft"}}),
    );
    for port in [addr.port(), second] {
        change(
            &d,
            serde_json::json!({"request": "remove_listener", "address": "127.0.0.1", "port": port}),
        );
    }
    wait_for("the device is let go", || {
        d.log().contains("device let go").then_some(())
    });
    change(
        &d,
        serde_json::json!({"request": "add_listener",
            "listener": {"address": "127.0.0.1", "port": addr.port(), "provider": "soft"}}),
    );
    let mut c = Host::connect("127.0.0.40", addr, A, 0x40);
    c.write_read(1, 40, 0xC0);
    // Two devices now, one data path each.
    wait_for("a data path per device", || {
        (slots(&d) == 2048).then_some(())
    });
}

/// A reload that removes subsystem A and lists an allowed host for B reports B's hosts as
/// changed: the subsystems were once compared by their place in the list, and B had moved to
/// A's.
#[test]
fn a_reload_reports_a_subsystems_hosts_changed_when_another_subsystem_goes() {
    let (d, _addr) = start();
    let text = config_text(&d);
    let (a_start, b_start) = (
        text.find("# subsystem A").unwrap(),
        text.find("# subsystem B").unwrap(),
    );
    let new = format!("{}{}", &text[..a_start], &text[b_start..]).replace(
        "allow_any_host = true",
        &format!("hosts = [\"{}\"]", host(0x79).nqn),
    );
    std::fs::write(d.dir.path().join("nvmfd.toml"), new).unwrap();
    let done = change(&d, serde_json::json!({"request": "reload"}));
    let changes: Vec<&str> = done["changes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|c| c.as_str())
        .collect();
    assert!(
        changes.contains(&format!("allowed hosts of {B} changed").as_str()),
        "{changes:?}"
    );
}

/// A change made through the admin socket writes the file back: edits made to the file and
/// not yet loaded would be lost, so the change is refused until the file is reloaded.
#[test]
fn a_change_is_refused_while_the_file_holds_edits_not_yet_loaded() {
    let (d, _addr) = start();
    let path = d.dir.path().join("nvmfd.toml");
    let edited = format!("{}# an operator's note, not yet loaded\n", config_text(&d));
    std::fs::write(&path, &edited).unwrap();
    let req = serde_json::json!({"request": "add_host", "subsystem": B, "host": host(0x78).nqn});
    let err = refused(&d, req.clone());
    assert!(err.contains("was edited since it was loaded"), "{err}");
    assert_eq!(config_text(&d), edited, "the file was rewritten");
    // Reloaded, the edits are the daemon's: the change goes through and keeps them.
    change(&d, serde_json::json!({"request": "reload"}));
    change(&d, req);
    let text = config_text(&d);
    assert!(text.contains("an operator's note"), "{text}");
    assert!(text.contains(&host(0x78).nqn), "{text}");
}

/// A listener removed while its device is away still lets go of the device once nothing made
/// on it is left (rxe and siw finish their removal only then). The reactor is stalled while
/// the device goes, so that its data path on the device, and with it the old listening ID,
/// is still there when the listener is removed.
#[test]
fn a_listener_removed_while_its_device_is_away_still_releases_the_device() {
    let port = test_port();
    let d = Daemon::start(Options {
        config: Some(config(std::path::Path::new("@DIR@"), port)),
        test_hooks: true,
        ..Options::default()
    });
    let second = test_port();
    change(
        &d,
        serde_json::json!({"request": "add_listener",
            "listener": {"address": "127.0.0.2", "port": second, "provider": "soft"}}),
    );
    wait_for("the reactor serves the second listener", || {
        d.log()
            .contains("data path built on the listener's device")
            .then_some(())
    });
    let v = d.request(r#"{"request":"debug_stall_reactor","reactor":0,"ms":5000}"#);
    assert_eq!(v["ok"], true, "{v}");
    let v = d.request(r#"{"request":"debug_fault","fault":"remove_device","listener":1}"#);
    assert_eq!(v["ok"], true, "{v}");
    wait_for("the control thread to see the device go", || {
        d.log()
            .contains("device removed: the listener stops serving")
            .then_some(())
    });
    let released = "removed device released: nothing nvmfd made on it is left";
    assert!(!d.log().contains(released), "{}", d.log());
    change(
        &d,
        serde_json::json!({"request": "remove_listener", "address": "127.0.0.2", "port": second}),
    );
    // A listener added elsewhere that fails to listen (no RDMA device here) while the old ID
    // waits: refused, and the old ID is kept to let go of its device.
    let third = test_port();
    let v = d.request(
        &serde_json::json!({"request": "add_listener",
            "listener": {"address": "127.0.0.3", "port": third, "provider": "ibverbs"}})
        .to_string(),
    );
    assert_eq!(v["ok"], false, "an ibverbs listener was added: {v}");
    wait_for("the removed device to be released", || {
        d.log().contains(released).then_some(())
    });
    let mut h = Host::connect(
        "127.0.0.43",
        SocketAddr::from(([127, 0, 0, 1], port)),
        A,
        0x43,
    );
    h.write_read(1, 0, 0x43);
}

/// A reactor that cannot set up a data path on a listener's device (its memory cannot be
/// registered, as at the locked-memory limit) refuses every connection handed to it for the
/// listener: the listener is reported not serving, with why, not serving in name only. Once
/// the device can be set up (the listener added again), it serves.
#[test]
fn a_listener_whose_data_path_cannot_be_set_up_is_not_serving() {
    let port = test_port();
    let d = Daemon::start(Options {
        config: Some(config(std::path::Path::new("@DIR@"), port)),
        test_hooks: true,
        ..Options::default()
    });
    let fail = |n: u32| {
        let v = d.request(&format!(
            r#"{{"request":"debug_fault","fault":{{"fail_registrations":{n}}},"listener":0}}"#
        ));
        assert_eq!(v["ok"], true, "{v}");
    };
    fail(1_000_000);
    let second = test_port();
    let add = serde_json::json!({"request": "add_listener",
        "listener": {"address": "127.0.0.2", "port": second, "provider": "soft"}});
    change(&d, add.clone());
    let listener = |d: &Daemon| {
        d.data("status")["listeners"]
            .as_array()
            .unwrap()
            .iter()
            .find(|l| l["port"] == second)
            .cloned()
    };
    let st = wait_for("the listener to be reported not serving", || {
        listener(&d).filter(|l| l["serving"] == false)
    });
    let why = st["reason"].as_str().unwrap_or_default();
    assert!(why.contains("could not set up a data path"), "{st}");
    let stats = d.data("stats");
    let l = stats["listeners"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["address"] == format!("127.0.0.2:{second}"))
        .cloned()
        .unwrap();
    assert_eq!(l["serving"], false, "{stats}");
    // Registrations work again; the listener, added anew, serves.
    fail(0);
    change(
        &d,
        serde_json::json!({"request": "remove_listener", "address": "127.0.0.2", "port": second}),
    );
    change(&d, add);
    wait_for("the listener to serve", || {
        listener(&d).filter(|l| l["serving"] == true)
    });
    let mut h = Host::connect(
        "127.0.0.44",
        SocketAddr::from(([127, 0, 0, 2], second)),
        A,
        0x44,
    );
    h.write_read(1, 0, 0x44);
}

/// The file edited while a change waits for its devices (here a reactor busy for 5 s before
/// it attaches the new namespace's device): the change is refused, the edits stay.
#[test]
fn a_change_is_refused_when_the_file_is_edited_while_it_is_made() {
    let port = test_port();
    let d = Daemon::start(Options {
        config: Some(config(std::path::Path::new("@DIR@"), port)),
        test_hooks: true,
        ..Options::default()
    });
    let v = d.request(r#"{"request":"debug_stall_reactor","reactor":0,"ms":5000}"#);
    assert_eq!(v["ok"], true, "{v}");
    wait_for("the reactor to stall", || {
        d.log()
            .contains("test hook: reactor stalling")
            .then_some(())
    });
    let path = d.dir.path().join("nvmfd.toml");
    let answer = std::thread::scope(|s| {
        let add = s.spawn(|| {
            d.request(
                &serde_json::json!({"request": "add_namespace", "subsystem": A,
                    "namespace": {"nsid": 7, "backend": "malloc", "size": "1MiB"}})
                .to_string(),
            )
        });
        wait_for("the change to open its device", || {
            d.log()
                .contains("opening the device of an added namespace")
                .then_some(())
        });
        let edited = format!("{}# edited during the change\n", config_text(&d));
        std::fs::write(&path, &edited).unwrap();
        (add.join().unwrap(), edited)
    });
    let (answer, edited) = answer;
    assert_eq!(answer["ok"], false, "{answer}");
    let err = answer["error"].as_str().unwrap_or_default();
    assert!(
        err.contains("was edited while the change was made"),
        "{err}"
    );
    assert_eq!(config_text(&d), edited, "the edits were overwritten");
    let status = d.data("status");
    assert!(
        !status["namespaces"]
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n["nsid"] == 7),
        "{status}"
    );
}

/// Listeners added and removed again and again leave nothing open behind them: a removed
/// listener's CM channel (an fd) goes once no ID made on it is left. Its connections' IDs
/// went with its data path's QPs.
#[test]
fn listeners_added_and_removed_again_and_again_leave_no_fd_behind() {
    let (d, addr) = start();
    let fds = |d: &Daemon| {
        std::fs::read_dir(format!("/proc/{}/fd", d.child.id()))
            .unwrap()
            .count()
    };
    let port = test_port();
    let cycle = |d: &Daemon, connect: bool| {
        change(
            d,
            serde_json::json!({"request": "add_listener",
                "listener": {"address": "127.0.0.1", "port": port, "provider": "soft"}}),
        );
        if connect {
            let mut h = Host::connect(
                "127.0.0.41",
                SocketAddr::from(([127, 0, 0, 1], port)),
                A,
                0x41,
            );
            h.write_read(1, 0, 0x41);
        }
        change(
            d,
            serde_json::json!({"request": "remove_listener", "address": "127.0.0.1", "port": port}),
        );
    };
    // Once first: whatever a listener's first use opens for good (the data path is shared
    // with the first listener's, on the same device) is open from here on.
    cycle(&d, true);
    let mut h = Host::connect("127.0.0.42", addr, A, 0x42);
    h.write_read(1, 8, 0x42);
    let before = fds(&d);
    for k in 0..30 {
        cycle(&d, k % 3 == 0);
    }
    // (`before` may count a passing fd, an admin client's, say.)
    wait_for("the removed listeners' channels to close", || {
        (fds(&d) <= before).then_some(())
    });
    h.write_read(1, 16, 0x43);
}

/// A change of several sizes that cannot all be made changes none of them: a reload that
/// shrinks one namespace and grows another past what it can take is refused, and the first
/// keeps its size (the target still says the old one; a shrunk device under it would fail
/// the host's I/O past the new end, or lose its data on a file or image).
#[test]
fn a_reload_whose_second_resize_fails_leaves_the_first_namespace_as_it_was() {
    let (d, addr) = start();
    change(
        &d,
        serde_json::json!({"request": "add_namespace", "subsystem": A,
            "namespace": {"nsid": 2, "backend": "malloc", "size": "8MiB"}}),
    );
    let mut a = Host::connect("127.0.0.41", addr, A, 0x41);
    let text = config_text(&d);
    let b_start = text.find("# subsystem B").unwrap();
    let (a_part, b_part) = text.split_at(b_start);
    // Namespace 1 shrinks to 4 MiB; namespace 2 would grow past the 8 MiB it was made with.
    let ns2 = a_part.find("nsid = 2").unwrap();
    let (ns1_part, ns2_part) = a_part.split_at(ns2);
    let new = format!(
        "{}{}{}",
        ns1_part.replace("size = \"8MiB\"", "size = \"4MiB\""),
        ns2_part.replace("size = \"8MiB\"", "size = \"16MiB\""),
        b_part
    );
    std::fs::write(d.dir.path().join("nvmfd.toml"), new).unwrap();
    let err = refused(&d, serde_json::json!({"request": "reload"}));
    assert!(err.contains("namespace 2"), "{err}");
    assert_eq!(a.blocks(1), 8 << 11);
    // Past 4 MiB on namespace 1: still there.
    a.write_read(1, 6 << 11, 0x61);
    a.write_read(2, 6 << 11, 0x62);
}

/// A change that waits for long (an RBD image resized off the control thread, minutes for a
/// large shrink) no longer holds up what the control thread does for hosts: a new host
/// connects, and a controller whose keep-alive timeout passed is ended, while the resize is
/// held at a test gate. Both waited for the change's end before.
#[test]
fn hosts_connect_and_keep_alives_expire_while_a_long_change_waits() {
    let gate = tempfile::tempdir().unwrap();
    let (d, addr) = start_hooked(Some(gate.path()));
    let silent = Host::connect_with_kato("127.0.0.47", addr, A, 0x47, 1000);
    let silent_cntlid = silent.admin.cntlid;
    std::thread::scope(|scope| {
        let resize = resize_held_at_gate(scope, &d, gate.path());
        // A new host, while the change waits.
        let (tx, rx) = std::sync::mpsc::channel();
        scope.spawn(move || {
            let mut b = Host::connect("127.0.0.48", addr, B, 0x48);
            b.write_read(1, 0, 0x48);
            let _ = tx.send(());
        });
        rx.recv_timeout(std::time::Duration::from_secs(20))
            .expect("a host connects while a change waits");
        // The silent host's controller ends at its keep-alive timeout, while the change waits.
        wait_for(
            "the silent controller to be ended at its keep-alive timeout",
            || {
                log_lines(&d, "keep-alive timeout: controller ended")
                    .iter()
                    .any(|l| l["cntlid"] == silent_cntlid)
                    .then_some(())
            },
        );
        assert!(!resize.is_finished(), "the change did not wait at the gate");
        std::fs::write(gate.path().join("resize-go"), b"").unwrap();
        let a = resize.join().unwrap();
        assert_eq!(a["ok"], true, "{a}");
    });
    drop(silent);
}

/// At the namespace limit (1,024 in all), a change that removes one namespace and adds
/// another attaches the new one before the old one is let go: each reactor's engine has room
/// for both (its device table was exactly the limit, and such a change was refused: "the
/// engine's device table is full").
#[test]
fn a_change_swapping_a_namespace_at_the_namespace_limit_is_taken() {
    let port = test_port();
    // Subsystem A with 1,023 namespaces, B with one: 1,024 in all; the change moves B's to A.
    let config = |a_count: u32, b_has_one: bool| {
        let mut c = format!(
            "[daemon]\nreactor_cores = [0]\nadmin_socket = \"@DIR@/admin.sock\"\n\n\
             [[listener]]\naddress = \"127.0.0.1\"\nport = {port}\nprovider = \"soft\"\n\n\
             [[subsystem]]\nnqn = \"{A}\"\nallow_any_host = true\n"
        );
        let ns = |nsid: u32| {
            format!(
                "\n[[subsystem.namespace]]\nnsid = {nsid}\nbackend = \"null\"\nsize = \"1MiB\"\n"
            )
        };
        for nsid in 1..=a_count {
            c.push_str(&ns(nsid));
        }
        c.push_str(&format!(
            "\n[[subsystem]]\nnqn = \"{B}\"\nallow_any_host = true\n"
        ));
        if b_has_one {
            c.push_str(&ns(1));
        }
        c
    };
    let d = Daemon::start(Options {
        config: Some(config(1023, true)),
        ..Options::default()
    });
    let dir = d.dir.path().display().to_string();
    std::fs::write(
        d.dir.path().join("nvmfd.toml"),
        config(1024, false).replace("@DIR@", &dir),
    )
    .unwrap();
    let done = change(&d, serde_json::json!({"request": "reload"}));
    assert!(done.to_string().contains("1024"), "{done}");
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let mut h = Host::connect("127.0.0.51", addr, A, 0x51);
    assert_eq!(h.blocks(1024), 2048, "the added namespace serves");
    let mut back = vec![0u8; 4096];
    h.io.read(1024, 0, 8, &mut back).unwrap();
}

/// A listener whose device came back takes connection requests only once its reactors have
/// a data path on it. While the control thread opens RBD handles ahead for those data paths
/// (held here at the test gate, taken with no RBD namespace too), a request waits; handed on
/// during that wait, a reactor with no data path yet refused it (a review found it in the
/// change that serves connections while the control thread waits).
#[test]
fn a_connect_to_a_returning_listener_waits_for_its_data_path() {
    use std::time::{Duration, Instant};
    let gate = tempfile::tempdir().unwrap();
    let (d, addr) = start_hooked(Some(gate.path()));
    let v = d.request(r#"{"request":"debug_fault","fault":"remove_device","listener":0}"#);
    assert_eq!(v["ok"], true, "{v}");
    wait_for("the removed device to be released", || {
        d.log()
            .contains("removed device released: nothing nvmfd made on it is left")
            .then_some(())
    });
    let v = d.request(r#"{"request":"debug_fault","fault":"restore_device","listener":0}"#);
    assert_eq!(v["ok"], true, "{v}");
    wait_for("the returning listener's data paths to be prepared", || {
        gate.path().join("prepare-waiting").exists().then_some(())
    });
    let host = std::thread::spawn(move || {
        let mut h = Host::connect("127.0.0.50", addr, A, 0x50);
        h.write_read(1, 0, 0x50);
    });
    // Refused, the connect ended within milliseconds before; now it waits for the gate (a
    // slower machine could only hide the refusal, never fail this).
    let until = Instant::now() + Duration::from_secs(1);
    while !host.is_finished() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        !host.is_finished(),
        "the connect ended while the listener had no data path:\n{}",
        d.log()
    );
    std::fs::write(gate.path().join("prepare-go"), b"").unwrap();
    host.join()
        .expect("the host connects once the listener's data path is built");
}

/// `nvmf bench` fails, saying why, when the controller's shutdown fails: its flush is what
/// makes a run's writes durable, and a failed one (CSTS.CFS) means they may not be. The
/// figures are printed all the same. It exited 0.
#[test]
fn nvmf_bench_fails_when_the_shutdown_flush_fails() {
    let (d, addr) = start_hooked(None);
    add_file_namespace(&d, 2);
    change(
        &d,
        serde_json::json!({"request": "debug_fail_sync", "subsystem": A, "nsid": 2}),
    );
    let out = std::process::Command::new(nvmfd_tests::bin("nvmf"))
        .args([
            "bench",
            "--addr",
            &addr.to_string(),
            "--nqn",
            A,
            "--nsid",
            "2",
        ])
        .args(["-w", "write", "-q", "1", "-t", "0.3", "--warmup", "0"])
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(!out.status.success(), "exit 0: {stdout}{stderr}");
    assert!(
        stderr.contains("shutdown") && stderr.contains("may not be durable"),
        "{stderr}"
    );
    assert!(stdout.contains("total"), "no figures: {stdout}");
}

/// A file namespace whose sync fails (writeback lost data a host was told was written) is
/// logged as an error, once, and shown in the status; every later Flush of it fails too. It
/// was a host's error alone before, with nothing in the log.
#[test]
fn a_failed_sync_is_logged_once_and_shown_in_the_status() {
    let (d, addr) = start_hooked(None);
    add_file_namespace(&d, 2);
    let mut a = Host::connect("127.0.0.49", addr, A, 0x49);
    a.write_read(2, 8, 0x49);
    a.io.flush(2).unwrap();
    const FAILED: &str = "namespace's device failed a sync";
    assert!(log_lines(&d, FAILED).is_empty());
    change(
        &d,
        serde_json::json!({"request": "debug_fail_sync", "subsystem": A, "nsid": 2}),
    );
    a.write_read(2, 16, 0x4a);
    assert!(
        a.io.flush(2).is_err(),
        "the failed sync was answered success"
    );
    let line = wait_for("the failed sync in the log", || {
        log_lines(&d, FAILED).into_iter().next()
    });
    assert_eq!(line["level"], "ERRO", "{line}");
    assert_eq!(line["nsid"], 2, "{line}");
    let status = d.data("status");
    let ns = status["namespaces"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["nsid"] == 2)
        .unwrap()
        .clone();
    assert_eq!(ns["sync_failed"], true, "{status}");
    assert!(a.io.flush(2).is_err(), "a later Flush succeeded");
    assert_eq!(log_lines(&d, FAILED).len(), 1, "{}", d.log());
}

/// The log's JSON lines whose message starts with `msg`.
fn log_lines(d: &Daemon, msg: &str) -> Vec<serde_json::Value> {
    d.log()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["msg"].as_str().is_some_and(|m| m.starts_with(msg)))
        .collect()
}

/// A listener that cannot listen at start (its port taken, its address not up yet) tries
/// again every second and serves once it can: it stayed down until a restart before, and a
/// reload found nothing changed.
#[test]
fn a_listener_that_cannot_listen_at_start_serves_once_it_can() {
    let port = test_port();
    let holder = std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
    let d = Daemon::start(Options {
        config: Some(config(std::path::Path::new("@DIR@"), port)),
        ..Options::default()
    });
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let listener = |d: &Daemon| d.data("status")["listeners"][0].clone();
    assert_eq!(listener(&d)["serving"], false, "{}", d.log());
    drop(holder);
    wait_for("the listener to serve", || {
        (listener(&d)["serving"] == true).then_some(())
    });
    let mut a = Host::connect("127.0.0.55", addr, A, 0x55);
    a.write_read(1, 8, 0x55);
    // Not counted as a device's return.
    let stats = d.data("stats");
    assert_eq!(stats["listeners"][0]["returns_total"], 0, "{stats}");
}

/// A configuration path that is a symlink stays one: an operator who points it at another
/// file and reloads gets that file's configuration, and a change made after is written to the
/// file it names, the link kept. The daemon took the file the link named at start for good:
/// a reload then found nothing changed.
#[test]
fn a_symlinked_configuration_is_read_through_the_link_and_written_to_where_it_points() {
    let port = test_port();
    let d = Daemon::start(Options {
        config: Some(config(std::path::Path::new("@DIR@"), port)),
        config_symlink: true,
        ..Options::default()
    });
    let dir = d.dir.path();
    const C: &str = "nqn.2024-01.io.nvmfd.test:c";
    let v2 = std::fs::read_to_string(dir.join("v1.toml")).unwrap()
        + &format!("\n[[subsystem]]\nnqn = \"{C}\"\nallow_any_host = true\n");
    std::fs::write(dir.join("v2.toml"), v2).unwrap();
    std::os::unix::fs::symlink("v2.toml", dir.join("link.new")).unwrap();
    std::fs::rename(dir.join("link.new"), dir.join("nvmfd.toml")).unwrap();
    change(&d, serde_json::json!({"request": "reload"}));
    let status = d.data("status");
    assert!(
        status["subsystems"]
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s["nqn"] == C),
        "{status}"
    );
    change(
        &d,
        serde_json::json!({"request": "add_host", "subsystem": C,
            "host": "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-0000000000c1"}),
    );
    let link = dir.join("nvmfd.toml");
    assert!(std::fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());
    assert_eq!(
        std::fs::read_link(&link).unwrap(),
        std::path::Path::new("v2.toml")
    );
    let written = std::fs::read_to_string(dir.join("v2.toml")).unwrap();
    assert!(written.contains("0000000000c1"), "{written}");
    assert!(!std::fs::read_to_string(dir.join("v1.toml"))
        .unwrap()
        .contains(C));
}

/// A change whose resize fails after the file was written puts the file back, but not over
/// edits the operator made while the resize waited (held here at the test gate): those were
/// overwritten before.
#[test]
fn a_refused_change_leaves_edits_made_meanwhile_in_the_file() {
    let gate = tempfile::tempdir().unwrap();
    let (d, _addr) = start_hooked(Some(gate.path()));
    let path = d.dir.path().join("nvmfd.toml");
    change(
        &d,
        serde_json::json!({"request": "debug_fail_resize", "subsystem": A, "nsid": 1}),
    );
    std::thread::scope(|scope| {
        let resize = resize_held_at_gate(scope, &d, gate.path());
        let edited = std::fs::read_to_string(&path).unwrap() + "\n# the operator's note\n";
        std::fs::write(&path, &edited).unwrap();
        std::fs::write(gate.path().join("resize-go"), b"").unwrap();
        let a = resize.join().unwrap();
        assert_eq!(a["ok"], false, "{a}");
        let why = a["error"].as_str().unwrap_or_default();
        assert!(why.contains("edited while the change was made"), "{why}");
    });
    assert!(
        config_text(&d).contains("# the operator's note"),
        "{}",
        config_text(&d)
    );
}

/// A stop asked for while a change waits (a resize held here at the test gate; an RBD shrink
/// can take minutes) tells the service manager at once (STOPPING=1) and extends its stop
/// timeout while the change goes on, then stops once it ends. Nothing was said before: the
/// service manager killed the daemon at its stop timeout, in the middle of the change.
#[test]
fn a_stop_during_a_long_change_waits_for_it_and_tells_the_service_manager() {
    use std::io::{BufRead, Write};
    let gate = tempfile::tempdir().unwrap();
    let port = test_port();
    let mut d = Daemon::start(Options {
        config: Some(config(std::path::Path::new("@DIR@"), port)),
        test_hooks: true,
        notify: true,
        env: vec![("NVMFD_TEST_GATE".into(), gate.path().display().to_string())],
        ..Options::default()
    });
    d.notifications_until("READY=1");
    let client = std::os::unix::net::UnixStream::connect(&d.socket).unwrap();
    (&client)
        .write_all(
            format!(
                "{}\n",
                serde_json::json!({"request": "resize_namespace", "subsystem": A,
                    "nsid": 1, "size": "4MiB"})
            )
            .as_bytes(),
        )
        .unwrap();
    wait_for("the resize to wait at the gate", || {
        gate.path().join("resize-waiting").exists().then_some(())
    });
    d.signal(libc::SIGTERM);
    let said = d.notifications_until("EXTEND_TIMEOUT_USEC=");
    assert!(said.iter().any(|n| n.contains("STOPPING=1")), "{said:?}");
    std::fs::write(gate.path().join("resize-go"), b"").unwrap();
    let mut answer = String::new();
    let _ = std::io::BufReader::new(&client).read_line(&mut answer);
    assert!(d.wait_exit().success(), "{}", d.log());
    assert!(answer.contains("\"ok\":true"), "the resize: {answer}");
}

/// Two namespaces whose paths name one file (a symlink, a hard link; a block device by two
/// names likewise) would overwrite each other's data: a configuration with them does not
/// start, and a change adding one is refused. Both were taken before.
#[test]
fn two_namespaces_on_one_file_by_other_paths_are_refused() {
    let images = tempfile::tempdir().unwrap();
    let x = images.path().join("x.img");
    std::fs::write(&x, vec![0u8; 4 << 20]).unwrap();
    std::os::unix::fs::symlink(&x, images.path().join("y.img")).unwrap();
    std::fs::hard_link(&x, images.path().join("z.img")).unwrap();
    let port = test_port();
    let both = format!(
        "{}\n[[subsystem.namespace]]\nnsid = 2\nbackend = \"file\"\npath = \"{}\"\n\n[[subsystem.namespace]]\nnsid = 3\nbackend = \"file\"\npath = \"{}\"\n",
        config(std::path::Path::new("@DIR@"), port),
        x.display(),
        images.path().join("y.img").display()
    );
    let mut d = Daemon::spawn(Options {
        config: Some(both),
        ..Options::default()
    });
    assert!(!d.wait_exit().success(), "{}", d.log());
    assert!(
        d.log().contains("are one file, block device or RBD image"),
        "{}",
        d.log()
    );

    // (The same path is refused by the configuration's checks.)
    let (d, _addr) = start();
    add_file_namespace(&d, 2);
    let link = d.dir.path().join("again.img");
    std::fs::hard_link(d.dir.path().join("ns2.img"), &link).unwrap();
    let why = refused(
        &d,
        serde_json::json!({"request": "add_namespace", "subsystem": A,
            "namespace": {"nsid": 3, "backend": "file", "path": link}}),
    );
    assert!(
        why.contains("are one file, block device or RBD image"),
        "{why}"
    );
    // Nothing of the refused ones is served.
    let status = d.data("status");
    assert_eq!(
        status["namespaces"].as_array().unwrap().len(),
        3,
        "{status}"
    );
}

/// The file edited between the daemon's reading it at start and its serving: a change made
/// then is refused as for any edit not loaded (the configuration in force is the text read,
/// which is no longer the file's). The file was read a second time at start, so the change
/// went ahead against the old configuration with the text of the new one, taking every
/// unrelated edit of it along.
#[test]
fn a_file_edited_while_the_daemon_starts_is_not_taken_along_by_a_change() {
    let gate = tempfile::tempdir().unwrap();
    std::fs::write(gate.path().join("loaded-hold"), b"").unwrap();
    let port = test_port();
    let d = Daemon::spawn(Options {
        config: Some(config(std::path::Path::new("@DIR@"), port)),
        test_hooks: true,
        env: vec![("NVMFD_TEST_GATE".into(), gate.path().display().to_string())],
        ..Options::default()
    });
    wait_for("the start to wait at the gate", || {
        gate.path().join("loaded-waiting").exists().then_some(())
    });
    let text = config_text(&d);
    let (a_start, b_start) = (
        text.find("# subsystem A").unwrap(),
        text.find("# subsystem B").unwrap(),
    );
    // Subsystem B dropped from the file meanwhile.
    std::fs::write(d.dir.path().join("nvmfd.toml"), &text[..b_start]).unwrap();
    assert!(a_start < b_start);
    std::fs::write(gate.path().join("loaded-go"), b"").unwrap();
    wait_for("the admin socket to answer", || {
        d.try_request(r#"{"request":"status"}"#).ok()
    });
    let why = refused(
        &d,
        serde_json::json!({"request": "add_host", "subsystem": A, "host": host(0x31).nqn}),
    );
    assert!(why.contains("edited since it was loaded"), "{why}");
    let status = d.data("status");
    assert_eq!(
        status["subsystems"].as_array().unwrap().len(),
        2,
        "{status}"
    );
}

/// The configuration written back goes through a new file of its own beside it: a symlink
/// planted at a name the daemon would use (it wrote `<file>.toml.new`, following links) does
/// not make it overwrite what the link points at.
#[test]
fn writing_the_configuration_back_follows_no_planted_link() {
    let (d, _addr) = start();
    let victim = d.dir.path().join("victim");
    std::fs::write(&victim, "precious").unwrap();
    let config = d.dir.path().join("nvmfd.toml");
    std::os::unix::fs::symlink(&victim, config.with_extension("toml.new")).unwrap();
    add_file_namespace(&d, 2);
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
    assert!(config_text(&d).contains("nsid = 2"));
    let left: Vec<_> = std::fs::read_dir(d.dir.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".nvmfd-config-"))
        .collect();
    assert!(left.is_empty(), "new files left behind: {left:?}");
}

/// A subsystem renamed in one change (its NQN edited, its namespaces the same) is a
/// subsystem removed and one added with the same files: taken. The store check counted the
/// removed subsystem's namespaces as served and refused it as "one file".
#[test]
fn a_subsystem_renamed_in_one_reload_keeps_its_file_namespace() {
    let (d, _addr) = start();
    add_file_namespace(&d, 2);
    let renamed = format!("{A}-renamed");
    let text = config_text(&d).replace(&format!("\"{A}\""), &format!("\"{renamed}\""));
    std::fs::write(d.dir.path().join("nvmfd.toml"), text).unwrap();
    let done = change(&d, serde_json::json!({"request": "reload"}));
    let changes = done["changes"].to_string();
    assert!(
        changes.contains(&format!("subsystem {A} removed")),
        "{changes}"
    );
    let status = d.data("status");
    let of_renamed = status["namespaces"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|n| n["subsystem"] == renamed.as_str())
        .count();
    assert_eq!(of_renamed, 2, "{status}");
}

/// Resizes namespace 1 of subsystem A to 4 MiB on a thread of `scope`, and returns once the
/// resize waits at the test gate `gate` (its answer comes on the handle once `resize-go` is
/// there).
fn resize_held_at_gate<'s>(
    scope: &'s std::thread::Scope<'s, '_>,
    d: &'s Daemon,
    gate: &std::path::Path,
) -> std::thread::ScopedJoinHandle<'s, serde_json::Value> {
    let resize = scope.spawn(|| {
        d.request(
            &serde_json::json!({"request": "resize_namespace", "subsystem": A,
                "nsid": 1, "size": "4MiB"})
            .to_string(),
        )
    });
    wait_for("the resize to wait at the gate", || {
        gate.join("resize-waiting").exists().then_some(())
    });
    resize
}

/// Adds file namespace `nsid` (4 MiB) to subsystem A.
fn add_file_namespace(d: &Daemon, nsid: u32) {
    let img = d.dir.path().join(format!("ns{nsid}.img"));
    std::fs::write(&img, vec![0u8; 4 << 20]).unwrap();
    change(
        d,
        serde_json::json!({"request": "add_namespace", "subsystem": A,
            "namespace": {"nsid": nsid, "backend": "file", "path": img}}),
    );
}

/// Host `a`'s I/O queue goes, and the target has let it go: a shutdown then flushes at once.
fn drop_io_queue(d: &Daemon, a: &mut Host) {
    a.io.transport().disconnect();
    let cntlid = a.admin.cntlid;
    wait_for("the controller's I/O queue to be gone", || {
        let ctrls = d.data("controllers");
        ctrls
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c["cntlid"] == cntlid && c["queues"].as_array().is_some_and(|q| q.len() == 1))
            .then_some(())
    });
}

/// Sets CC.SHN (normal shutdown) on host `a`'s controller; returns CSTS read after it.
fn shut_down(a: &mut Host) -> u32 {
    use nvmfd_nvme::wire::property;
    let cc = nvmfd_nvme::wire::lo32(a.admin.property_get(property::CC, false).unwrap());
    a.admin
        .property_set(property::CC, (cc & !(0x3 << 14)) | (1 << 14))
        .unwrap();
    nvmfd_nvme::wire::lo32(a.admin.property_get(property::CSTS, false).unwrap())
}

/// Host `a`'s shutdown reads SHST complete, and the log says namespace 2's device was
/// synced when it was let go of.
fn shutdown_completes_once_namespace_2_is_synced(d: &Daemon, a: &mut Host) {
    wait_for("SHST complete once the sync has ended", || {
        let csts = a
            .admin
            .property_get(nvmfd_nvme::wire::property::CSTS, false)
            .unwrap();
        ((csts >> 2) & 0x3 == 2).then_some(())
    });
    assert!(
        log_lines(d, "namespace's device synced")
            .iter()
            .any(|l| l["nsid"] == 2 && l["when"] == "let go"),
        "{}",
        d.log()
    );
}

/// A namespace removed while its host writes is synced once its last operation has
/// completed, on a thread of its own; a shutdown of the host's controller reported SHST
/// complete before that sync ended (the shutdown's flush no longer finds the namespace), so
/// a host could power off with its writes there not yet durable. SHST reads "processing"
/// until the sync has ended now.
#[test]
fn a_shutdown_completes_only_once_a_namespace_removed_meanwhile_is_synced() {
    let gate = tempfile::tempdir().unwrap();
    let (d, addr) = start_hooked(Some(gate.path()));
    add_file_namespace(&d, 2);
    let mut a = Host::connect("127.0.0.51", addr, A, 0x51);
    a.write_read(2, 8, 0x51);
    change(
        &d,
        serde_json::json!({"request": "remove_namespace", "subsystem": A, "nsid": 2}),
    );
    wait_for("the removed namespace's sync to wait at the gate", || {
        gate.path().join("release-waiting").exists().then_some(())
    });
    assert_eq!(d.data("status")["releases_syncing"], 1);
    drop_io_queue(&d, &mut a);
    // The flush of the namespaces served ran in the Property Set (no I/O queue was left).
    let csts = shut_down(&mut a);
    assert_eq!(csts & (1 << 1), 0, "CFS: {csts:#x}");
    assert_eq!(
        (csts >> 2) & 0x3,
        1,
        "SHST before the removed namespace's sync ended: {csts:#x}"
    );
    std::fs::write(gate.path().join("release-go"), b"").unwrap();
    shutdown_completes_once_namespace_2_is_synced(&d, &mut a);
    wait_for("no sync of a device let go of in the status", || {
        (d.data("status")["releases_syncing"] == 0).then_some(())
    });
}

/// A change published the subsystem without a removed namespace before counting its device
/// as released: a shutdown in between flushed the namespaces left, found no release in
/// flight and reported SHST complete, the removed namespace's writes not yet synced. Held
/// here once published (the reactors not yet told), the shutdown reads "processing" until
/// the device is synced.
#[test]
fn a_shutdown_right_after_a_namespace_is_unpublished_waits_for_its_sync() {
    let gate = tempfile::tempdir().unwrap();
    let (d, addr) = start_hooked(Some(gate.path()));
    add_file_namespace(&d, 2);
    let mut a = Host::connect("127.0.0.53", addr, A, 0x53);
    a.write_read(2, 8, 0x53);
    drop_io_queue(&d, &mut a);
    std::fs::write(gate.path().join("published-hold"), b"").unwrap();
    std::thread::scope(|scope| {
        let removal = scope.spawn(|| {
            d.request(
                &serde_json::json!({"request": "remove_namespace", "subsystem": A, "nsid": 2})
                    .to_string(),
            )
        });
        wait_for("the removal to wait once published", || {
            gate.path().join("published-waiting").exists().then_some(())
        });
        let csts = shut_down(&mut a);
        assert_eq!(csts & (1 << 1), 0, "CFS: {csts:#x}");
        assert_eq!(
            (csts >> 2) & 0x3,
            1,
            "SHST before the removed namespace was synced: {csts:#x}"
        );
        std::fs::write(gate.path().join("published-go"), b"").unwrap();
        std::fs::write(gate.path().join("release-go"), b"").unwrap();
        let answer = removal.join().unwrap();
        assert_eq!(answer["ok"], true, "{answer}");
    });
    shutdown_completes_once_namespace_2_is_synced(&d, &mut a);
}

/// A removed namespace's device whose sync fails: writes its host completed there may be
/// lost. That was a log line alone: the host's shutdown completed, `status` showed nothing
/// and the daemon exited 0. Now the shutdown of a controller that was there fails (CFS),
/// `status` counts the failure, and the daemon exits with an error.
#[test]
fn a_failed_sync_of_a_removed_namespace_fails_the_shutdown_and_the_exit() {
    let (mut d, addr) = start_hooked(None);
    add_file_namespace(&d, 2);
    let mut a = Host::connect("127.0.0.52", addr, A, 0x52);
    a.write_read(2, 8, 0x52);
    change(
        &d,
        serde_json::json!({"request": "debug_fail_sync", "subsystem": A, "nsid": 2}),
    );
    change(
        &d,
        serde_json::json!({"request": "remove_namespace", "subsystem": A, "nsid": 2}),
    );
    let line = wait_for("the failed sync in the log", || {
        log_lines(&d, "namespace's device could not be synced")
            .into_iter()
            .next()
    });
    assert_eq!(line["when"], "let go", "{line}");
    assert_eq!(line["nsid"], 2, "{line}");
    wait_for("the failure counted in the status", || {
        (d.data("status")["release_sync_failures"] == 1).then_some(())
    });
    drop_io_queue(&d, &mut a);
    let csts = shut_down(&mut a);
    assert_ne!(csts & (1 << 1), 0, "no CFS: {csts:#x}");
    assert_ne!((csts >> 2) & 0x3, 2, "SHST complete: {csts:#x}");
    // A controller made after the failure never wrote there: its shutdown completes.
    let mut b = Host::connect("127.0.0.53", addr, A, 0x53);
    b.write_read(1, 8, 0x53);
    drop_io_queue(&d, &mut b);
    let csts = shut_down(&mut b);
    assert_eq!(csts & (1 << 1), 0, "CFS: {csts:#x}");
    assert_eq!((csts >> 2) & 0x3, 2, "SHST: {csts:#x}");
    drop((a, b));
    d.signal(libc::SIGTERM);
    assert!(!d.wait_exit().success(), "exited 0: {}", d.log());
}

/// A controller made while a removed namespace's sync runs (held at the test gate) never saw
/// the namespace (it was unpublished first): when that sync fails, the shutdown of a
/// controller made before it fails (CFS), and this one's completes, and does so without
/// waiting for the sync either. It took every failure since it was made as its own.
#[test]
fn a_sync_begun_before_a_controller_was_made_is_none_of_its_shutdowns_business() {
    let gate = tempfile::tempdir().unwrap();
    let (d, addr) = start_hooked(Some(gate.path()));
    add_file_namespace(&d, 2);
    let mut a = Host::connect("127.0.0.56", addr, A, 0x56);
    a.write_read(2, 8, 0x56);
    change(
        &d,
        serde_json::json!({"request": "debug_fail_sync", "subsystem": A, "nsid": 2}),
    );
    change(
        &d,
        serde_json::json!({"request": "remove_namespace", "subsystem": A, "nsid": 2}),
    );
    wait_for("the removed namespace's sync to wait at the gate", || {
        gate.path().join("release-waiting").exists().then_some(())
    });
    let mut b = Host::connect("127.0.0.57", addr, A, 0x57);
    b.write_read(1, 8, 0x57);
    drop_io_queue(&d, &mut b);
    let csts = shut_down(&mut b);
    assert_eq!(
        (csts >> 2) & 0x3,
        2,
        "SHST not complete while a sync begun before the controller runs: {csts:#x}"
    );
    std::fs::write(gate.path().join("release-go"), b"").unwrap();
    wait_for("the failure counted in the status", || {
        (d.data("status")["release_sync_failures"] == 1).then_some(())
    });
    let csts = nvmfd_nvme::wire::lo32(
        b.admin
            .property_get(nvmfd_nvme::wire::property::CSTS, false)
            .unwrap(),
    );
    assert_eq!(csts & (1 << 1), 0, "CFS: {csts:#x}");
    drop_io_queue(&d, &mut a);
    let csts = shut_down(&mut a);
    assert_ne!(
        csts & (1 << 1),
        0,
        "no CFS for the controller made before: {csts:#x}"
    );
    drop((a, b));
}

/// A controller made while a namespace is being let go of but still published (held here
/// between its release and the publication without it) may write there: its shutdown fails
/// (CFS) when that release's sync fails. It was taken as made after the release, and its
/// shutdown completed over a write it may have lost.
#[test]
fn a_controller_made_before_a_namespace_is_unpublished_is_concerned_by_its_sync() {
    let gate = tempfile::tempdir().unwrap();
    let (d, addr) = start_hooked(Some(gate.path()));
    add_file_namespace(&d, 2);
    change(
        &d,
        serde_json::json!({"request": "debug_fail_sync", "subsystem": A, "nsid": 2}),
    );
    std::fs::write(gate.path().join("releasing-hold"), b"").unwrap();
    std::thread::scope(|scope| {
        let mut removal = None;
        let mut b = Host::connect_held("127.0.0.58", addr, A, 0x58, || {
            removal = Some(scope.spawn(|| {
                d.request(
                    &serde_json::json!({"request": "remove_namespace", "subsystem": A, "nsid": 2})
                        .to_string(),
                )
            }));
            wait_for(
                "the removal to wait between release and publication",
                || gate.path().join("releasing-waiting").exists().then_some(()),
            );
        });
        // Namespace 2 is still published: the controller made now writes there.
        b.write_read(2, 8, 0x58);
        std::fs::write(gate.path().join("releasing-go"), b"").unwrap();
        // The removed namespace's sync waits at its own gate (with a gate directory).
        std::fs::write(gate.path().join("release-go"), b"").unwrap();
        let answer = removal.unwrap().join().unwrap();
        assert_eq!(answer["ok"], true, "{answer}");
        wait_for("the failed sync counted in the status", || {
            (d.data("status")["release_sync_failures"] == 1).then_some(())
        });
        drop_io_queue(&d, &mut b);
        let csts = shut_down(&mut b);
        assert_ne!(csts & (1 << 1), 0, "no CFS: {csts:#x}");
    });
}

/// At stop, a removed namespace's sync still running (held here at the test gate) is
/// waited for: the daemon left after 10 s with exit 0 before, its outcome never seen.
#[test]
fn the_stop_waits_for_the_sync_of_a_removed_namespace() {
    let gate = tempfile::tempdir().unwrap();
    let (mut d, addr) = start_hooked(Some(gate.path()));
    add_file_namespace(&d, 2);
    let mut a = Host::connect("127.0.0.54", addr, A, 0x54);
    a.write_read(2, 8, 0x54);
    change(
        &d,
        serde_json::json!({"request": "remove_namespace", "subsystem": A, "nsid": 2}),
    );
    wait_for("the removed namespace's sync to wait at the gate", || {
        gate.path().join("release-waiting").exists().then_some(())
    });
    drop(a);
    d.signal(libc::SIGTERM);
    wait_for("the stop to wait for the sync", || {
        log_lines(&d, "waiting for the syncs of namespace devices let go of")
            .into_iter()
            .next()
    });
    assert!(log_lines(&d, "nvmfd stopped").is_empty(), "{}", d.log());
    std::fs::write(gate.path().join("release-go"), b"").unwrap();
    assert!(d.wait_exit().success(), "{}", d.log());
    let synced = log_lines(&d, "namespace's device synced");
    assert!(
        synced
            .iter()
            .any(|l| l["nsid"] == 2 && l["when"] == "let go"),
        "{}",
        d.log()
    );
}

/// A file namespace's hosts can no longer flush it once it is removed, nor once the daemon
/// stops: its device is synced then (the removed one once its last operation has completed),
/// and a RAM namespace, with nothing to sync, is not.
#[test]
fn a_removed_file_namespace_and_every_file_namespace_at_stop_are_synced() {
    let (mut d, addr) = start();
    const SYNCED: &str = "namespace's device synced";
    for nsid in [2, 3] {
        let img = d.dir.path().join(format!("ns{nsid}.img"));
        std::fs::write(&img, vec![0u8; 4 << 20]).unwrap();
        change(
            &d,
            serde_json::json!({"request": "add_namespace", "subsystem": A,
                "namespace": {"nsid": nsid, "backend": "file", "path": img}}),
        );
    }
    let mut a = Host::connect("127.0.0.43", addr, A, 0x43);
    a.write_read(2, 8, 0x72);
    a.write_read(3, 8, 0x73);
    assert!(log_lines(&d, SYNCED).is_empty(), "{}", d.log());

    change(
        &d,
        serde_json::json!({"request": "remove_namespace", "subsystem": A, "nsid": 2}),
    );
    let synced = wait_for("the removed namespace's device to be synced", || {
        let v = log_lines(&d, SYNCED);
        (!v.is_empty()).then_some(v)
    });
    assert_eq!(synced.len(), 1, "{synced:?}");
    assert_eq!(synced[0]["nsid"], 2, "{synced:?}");
    assert_eq!(synced[0]["when"], "let go", "{synced:?}");
    a.write_read(3, 16, 0x74);

    drop(a);
    d.signal(libc::SIGTERM);
    assert!(d.wait_exit().success(), "{}", d.log());
    let at_stop: Vec<_> = log_lines(&d, SYNCED)
        .into_iter()
        .filter(|v| v["when"] == "stop")
        .collect();
    assert_eq!(
        at_stop.len(),
        1,
        "only the file namespace is synced: {at_stop:?}"
    );
    assert_eq!(at_stop[0]["nsid"], 3);
    assert_eq!(at_stop[0]["subsystem"], A);
    assert!(log_lines(&d, "namespace's device could not be synced").is_empty());
}

/// A namespace configured without `uuid` or `nguid` is named by a UUID all the same
/// (Identify's Namespace Identification Descriptor list; the specification asks for one, and
/// Linux compares them at every rescan to tell another namespace behind the NSID). It was
/// named by nothing: a file swapped behind an NSID looked the same to a host. The UUID follows
/// what stores the data: the same file gives the same one (derived, not drawn), another file
/// another, a RAM namespace made again (its data new) another.
#[test]
fn a_namespace_without_configured_identifiers_has_a_uuid_that_follows_its_store() {
    let dir = tempfile::tempdir().unwrap();
    let (one, two) = (dir.path().join("one.img"), dir.path().join("two.img"));
    for f in [&one, &two] {
        std::fs::File::create(f).unwrap().set_len(4 << 20).unwrap();
    }
    let (d, addr) = start();
    let file_ns = |path: &std::path::Path| {
        serde_json::json!({"request": "add_namespace", "subsystem": A,
            "namespace": {"nsid": 2, "backend": "file", "path": path}})
    };
    let remove = |nsid: u32| serde_json::json!({"request": "remove_namespace", "subsystem": A, "nsid": nsid});
    change(&d, file_ns(&one));
    let mut a = Host::connect("127.0.0.41", addr, A, 0x41);
    let mut b = Host::connect("127.0.0.42", addr, B, 0x42);
    let uuid_of = |h: &mut Host, nsid: u32| -> Vec<u8> {
        let ids = h.admin.namespace_ids(nsid).unwrap();
        let uuid = ids
            .iter()
            .find(|(t, _)| *t == 3)
            .map(|(_, id)| id.clone())
            .unwrap_or_else(|| panic!("no UUID for namespace {nsid}: {ids:?}"));
        assert_eq!(uuid.len(), 16);
        assert!(uuid.iter().any(|&x| x != 0), "a zero UUID");
        uuid
    };
    let ram = uuid_of(&mut a, 1);
    let file = uuid_of(&mut a, 2);
    let other_ram = uuid_of(&mut b, 1);
    assert_ne!(ram, file);
    assert_ne!(ram, other_ram, "two subsystems' RAM namespaces 1");
    assert_eq!(uuid_of(&mut a, 2), file, "asked again");

    // Another file behind NSID 2: another UUID; the first file again: its UUID again.
    change(&d, remove(2));
    change(&d, file_ns(&two));
    assert_ne!(uuid_of(&mut a, 2), file, "another file, the same UUID");
    change(&d, remove(2));
    change(&d, file_ns(&one));
    assert_eq!(uuid_of(&mut a, 2), file, "the first file again");

    // A RAM namespace made again holds new (zeroed) data: a new UUID.
    change(&d, remove(1));
    change(
        &d,
        serde_json::json!({"request": "add_namespace", "subsystem": A,
            "namespace": {"nsid": 1, "backend": "malloc", "size": "8MiB"}}),
    );
    assert_ne!(uuid_of(&mut a, 1), ram, "a RAM namespace made again");
    // A configured one is reported as configured.
    change(&d, remove(2));
    change(
        &d,
        serde_json::json!({"request": "add_namespace", "subsystem": A,
            "namespace": {"nsid": 2, "backend": "file", "path": one,
                          "uuid": "6f3c1a52-6d7e-4d2a-9a51-0c6f0b1e2d3c"}}),
    );
    assert_eq!(
        uuid_of(&mut a, 2),
        uuid::Uuid::parse_str("6f3c1a52-6d7e-4d2a-9a51-0c6f0b1e2d3c")
            .unwrap()
            .as_bytes()
            .to_vec()
    );
}
