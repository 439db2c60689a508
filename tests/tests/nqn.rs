//! Subsystem NQNs outside the specification's form (as blktests names its subsystems) are
//! served, with a warning from `--check-config` and in the daemon's log.

use std::process::Command;

use nvmfd_tests::{bin, Daemon, Options};

const NAME: &str = "blktests-subsystem-1";

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

#[test]
fn check_config_accepts_a_name_outside_the_nqn_form_and_warns() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("blktests.toml");
    let cfg =
        nvmfd_tests::test_config(dir.path(), "").replace("nqn.2024-01.io.nvmfd.test:ram0", NAME);
    std::fs::write(&path, cfg).unwrap();
    let out = Command::new(bin("nvmfd"))
        .arg("--check-config")
        .arg(&path)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(
            "warning: subsystem[0].nqn: `blktests-subsystem-1` does not start with `nqn.`"
        ) && err.contains("accepted"),
        "{err}"
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("valid:"));
}

#[test]
fn a_subsystem_named_outside_the_nqn_form_is_discovered_and_serves_io() {
    let d = Daemon::start(Options {
        replace: vec![("nqn.2024-01.io.nvmfd.test:ram0".into(), NAME.into())],
        ..Options::default()
    });
    assert!(
        d.log().contains("configuration: subsystem[0].nqn"),
        "{}",
        d.log()
    );
    let a = addr(&d);
    let out = Command::new(bin("nvmf"))
        .args(["discover", "--addr", &a])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains(NAME),
        "{out:?}"
    );
    let out = Command::new(bin("nvmf"))
        .args(["verify", "--addr", &a, "--nqn", NAME])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stdout).starts_with("verified:"),
        "{out:?}"
    );
}
