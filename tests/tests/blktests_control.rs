//! scripts/blktests-target-control, blktests' NVME_TARGET_CONTROL hook, against the real nvmfd
//! over the soft provider: its config answers, setup (a subsystem with namespace 1 of the UUID
//! asked, admitting the host asked and no other, repeatable), cleanup (idempotent), and its
//! errors, with no restart of the daemon: a host of another subsystem stays connected.

use std::path::{Path, PathBuf};
use std::process::Command;

use nvmfd_tests::host::Host;
use nvmfd_tests::{bin, Daemon, Options};
use serde_json::Value;

const RAM: &str = "nqn.2024-01.io.nvmfd.test:ram0";
const SUB: &str = "blktests-subsystem-1";
const UUID: &str = "91fdba0d-f87b-4c25-b80f-db7be1418b9e";
const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:0f01fb42-9f7f-4856-b0b3-51e60b8de349";
const OTHER_HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:6e766d66-0000-4000-8000-000000000009";

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/blktests-target-control")
}

/// Runs the script against `d`: (exit code, stdout, stderr).
fn control(d: &Daemon, backing: &Path, args: &[&str]) -> (i32, String, String) {
    let out = Command::new("bash")
        .arg(script())
        .args(args)
        .env("NVMFCTL", bin("nvmfctl"))
        .env("NVMFD_SOCKET", &d.socket)
        .env("NVMFD_TRADDR", "127.0.0.1")
        .env("NVMFD_BACKING_DIR", backing)
        .env("NVMFD_IMG_SIZE", "8M")
        .env_remove("NVME_IMG_SIZE")
        .env_remove("NVMFD_ALLOW_ANY_HOST")
        .output()
        .expect("run blktests-target-control");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn nvmf(d: &Daemon, hostnqn: &str, args: &[&str]) -> (bool, String) {
    let out = Command::new(bin("nvmf"))
        .arg("--addr")
        .arg(d.soft_addr().to_string())
        .arg("--hostnqn")
        .arg(hostnqn)
        .args(args)
        .output()
        .expect("run nvmf");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

fn namespaces_of(d: &Daemon, nqn: &str) -> Vec<Value> {
    let status = d.data("status");
    status["namespaces"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|n| n["subsystem"] == nqn)
        .cloned()
        .collect()
}

fn has_subsystem(d: &Daemon, nqn: &str) -> bool {
    let status = d.data("status");
    status["subsystems"]
        .as_array()
        .unwrap()
        .iter()
        .any(|s| s["nqn"] == nqn)
}

#[test]
fn config_prints_one_value_per_question_and_nothing_on_stderr() {
    let d = Daemon::start(Options::default());
    let tmp = tempfile::tempdir().unwrap();
    let (rc, out, err) = control(
        &d,
        tmp.path(),
        &[
            "config",
            "--show-trtype",
            "--show-blkdev-type",
            "--show-hostnqn",
            "--show-hostid",
            "--show-traddr",
            "--show-trsvid",
            "--show-subsys-uuid",
            "--show-subsysnqn",
        ],
    );
    assert_eq!((rc, err.as_str()), (0, ""), "{out}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines,
        [
            "rdma",
            "file",
            HOST,
            "0f01fb42-9f7f-4856-b0b3-51e60b8de349",
            "127.0.0.1",
            "4420",
            UUID,
            SUB
        ]
    );
    let (rc, _, err) = control(&d, tmp.path(), &["config", "--show-everything"]);
    assert_eq!(rc, 2, "{err}");
    assert!(err.contains("unknown argument: --show-everything"), "{err}");
}

#[test]
fn setup_serves_one_namespace_to_the_host_asked_and_cleanup_takes_it_away() {
    let d = Daemon::start(Options::default());
    let tmp = tempfile::tempdir().unwrap();
    // A host of another subsystem, connected throughout.
    let mut bystander = Host::connect("127.0.0.41", d.soft_addr(), RAM, 0x41);

    let setup = [
        "setup",
        "--subsysnqn",
        SUB,
        "--subsys-uuid",
        UUID,
        "--hostnqn",
        HOST,
    ];
    for round in 0..2 {
        // Repeatable: the second setup replaces the first.
        let (rc, out, err) = control(&d, tmp.path(), &setup);
        assert_eq!(
            (rc, out.as_str(), err.as_str()),
            (0, "", ""),
            "round {round}"
        );
        let ns = namespaces_of(&d, SUB);
        assert_eq!(ns.len(), 1, "{ns:?}");
        assert_eq!(ns[0]["nsid"], 1);
        assert_eq!(ns[0]["serving"], true, "{ns:?}");
        assert_eq!(ns[0]["size"], 8 << 20, "{ns:?}");
        // The host asked for is admitted, sees namespace 1 with the UUID asked, and reads and
        // writes; another host is refused.
        let (ok, text) = nvmf(&d, HOST, &["identify", "--nqn", SUB]);
        assert!(ok, "round {round}: {text}");
        assert!(
            text.contains("namespace 1: 16384 blocks of 512 bytes") && text.contains(UUID),
            "{text}"
        );
        let (ok, text) = nvmf(&d, HOST, &["verify", "--nqn", SUB]);
        assert!(ok, "round {round}: {text}");
        let (ok, text) = nvmf(&d, OTHER_HOST, &["identify", "--nqn", SUB]);
        assert!(!ok, "round {round}: another host was admitted: {text}");
        bystander.write_read(1, 8 * round, 0x5A);
        assert_eq!(bystander.admin.ping().map_err(|e| e.to_string()), Ok(()));
    }
    assert!(tmp.path().join("blktests-subsystem-1.img").exists());

    for round in 0..2 {
        // Idempotent: a subsystem already gone is no error.
        let (rc, out, err) = control(&d, tmp.path(), &["cleanup", "--subsysnqn", SUB]);
        assert_eq!(
            (rc, out.as_str(), err.as_str()),
            (0, "", ""),
            "round {round}"
        );
        assert!(!has_subsystem(&d, SUB));
        assert!(!tmp.path().join("blktests-subsystem-1.img").exists());
    }
    let (ok, text) = nvmf(&d, HOST, &["identify", "--nqn", SUB]);
    assert!(!ok, "{text}");
    bystander.write_read(1, 32, 0xA5);
    let log = std::fs::read_to_string(tmp.path().join("control.log")).unwrap();
    assert_eq!(log.matches(": done").count(), 4, "{log}");
}

#[test]
fn setup_errors_say_why_and_leave_nothing_behind() {
    let d = Daemon::start(Options::default());
    let tmp = tempfile::tempdir().unwrap();
    // No in-band authentication: keys are refused, not ignored.
    let (rc, _, err) = control(
        &d,
        tmp.path(),
        &[
            "setup",
            "--subsysnqn",
            SUB,
            "--subsys-uuid",
            UUID,
            "--hostnqn",
            HOST,
            "--hostkey",
            "DHHC-1:00:abc:",
        ],
    );
    assert_eq!(rc, 1, "{err}");
    assert!(err.contains("no in-band authentication"), "{err}");
    assert!(!has_subsystem(&d, SUB));
    // A UUID nvmfd refuses: nvmfctl's reason comes through, and the subsystem is taken down.
    let (rc, _, err) = control(
        &d,
        tmp.path(),
        &[
            "setup",
            "--subsysnqn",
            SUB,
            "--subsys-uuid",
            "not-a-uuid",
            "--hostnqn",
            HOST,
        ],
    );
    assert_eq!(rc, 1, "{err}");
    assert!(err.contains("nvmfctl namespace add"), "{err}");
    assert!(!has_subsystem(&d, SUB), "a failed setup left its subsystem");
    assert!(!tmp.path().join("blktests-subsystem-1.img").exists());
    // Bad usage.
    let (rc, _, err) = control(&d, tmp.path(), &["setup", "--subsys-uuid", UUID]);
    assert_eq!(rc, 2, "{err}");
    assert!(err.contains("--subsysnqn is required"), "{err}");
    let (rc, _, err) = control(&d, tmp.path(), &["frobnicate"]);
    assert_eq!(rc, 2, "{err}");
}

/// `nvmf identify` lists every namespace: Identify's active namespace list gives at most
/// 1,024 a page, and the next page starts after the last. nvmfd serves at most 1,024, so a
/// second page is never needed here (the kernel target may have more); a full first page
/// asks for the next, which is empty.
#[test]
fn identify_lists_a_full_page_of_namespaces_and_the_empty_next() {
    let many: String = (2..=1024)
        .map(|n| {
            format!("\n[[subsystem.namespace]]\nnsid = {n}\nbackend = \"null\"\nsize = \"1MiB\"\n")
        })
        .collect();
    let d = Daemon::start(Options {
        replace: vec![(
            "size = \"64MiB\"\n".into(),
            format!("size = \"64MiB\"\n{many}"),
        )],
        ..Options::default()
    });
    let (ok, text) = nvmf(&d, HOST, &["identify", "--nqn", RAM]);
    assert!(ok, "{text}");
    let listed = text.lines().filter(|l| l.starts_with("namespace ")).count();
    assert_eq!(listed, 1024, "{}", text.lines().last().unwrap_or(""));
    assert!(text.contains("namespace 1024: 2048 blocks"), "{text}");
}
