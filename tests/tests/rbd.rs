//! nvmfd with namespaces on Ceph RBD images of the test cluster (`scripts/ceph-dev-cluster.sh`,
//! started by the first test that needs it; the tests skip, and say so, where it cannot
//! start), served over the soft provider's TCP wire: `nvmf verify` and `nvmf bench --verify`,
//! two daemons on one image, an OSD killed during writes, the cluster gone and back, and a
//! namespace whose cluster cannot be reached left out while the others are served.

use std::path::Path;
use std::process::Command;
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use nvmf_host::RdmaQueue;
use nvmfd_nvme::host::{AdminQueue, HostError, HostId, IoQueue};
use nvmfd_rdma::any::cm::CmChannel;
use nvmfd_rdma::soft::Fabric;
use nvmfd_tests::{bin, ceph, skip, Daemon, Options};

const SUB: &str = "nqn.2024-01.io.nvmfd.test:ram0";

/// Tests that stop cluster daemons hold it for writing; the others for reading.
static CLUSTER: RwLock<()> = RwLock::new(());

fn shared() -> RwLockReadGuard<'static, ()> {
    CLUSTER.read().unwrap_or_else(|e| e.into_inner())
}

fn exclusive() -> RwLockWriteGuard<'static, ()> {
    CLUSTER.write().unwrap_or_else(|e| e.into_inner())
}

/// The test cluster's ceph.conf, or `None` after saying the test is skipped.
fn cluster() -> Option<String> {
    match ceph::cluster() {
        Ok(conf) => Some(conf.display().to_string()),
        Err(why) => {
            skip(&why);
            None
        }
    }
}

/// A daemon whose namespace 1 is `keys` (instead of the test configuration's RAM disk).
fn daemon_with(keys: &str) -> Daemon {
    Daemon::start(Options {
        replace: vec![(
            "backend = \"malloc\"\nsize = \"64MiB\"\n".into(),
            format!("{keys}\n"),
        )],
        ..Options::default()
    })
}

/// A daemon serving image `image` of the test cluster as namespace 1 (created with 32 MiB).
fn rbd_daemon(conf: &str, image: &str, extra: &str) -> Daemon {
    daemon_with(&format!(
        "backend = \"rbd\"\npool = \"rbd\"\nimage = \"{image}\"\nceph_conf = \"{conf}\"\n{extra}"
    ))
}

/// The keys that create a 32 MiB image when it does not exist.
const NEW_IMAGE: &str = "create = true\nsize = \"32MiB\"";

/// A daemon serving a new 32 MiB image of the test cluster as namespace 1.
fn new_image_daemon(conf: &str) -> Daemon {
    rbd_daemon(conf, &ceph::image_name(), NEW_IMAGE)
}

/// A ceph.conf whose monitor address has nobody behind it (a client gives up connecting
/// after `mount_timeout` seconds), in a directory kept as long as the first value lives.
fn dead_cluster(mount_timeout: u32) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let conf = dir.path().join("ceph.conf");
    std::fs::write(
        &conf,
        format!(
            "[global]\nmon_host = 127.0.0.1:1\nauth_client_required = none\nclient_mount_timeout = {mount_timeout}\n"
        ),
    )
    .unwrap();
    (dir, conf)
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

fn host() -> HostId {
    HostId {
        nqn: "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-0000000000b1".into(),
        id: [0xb1; 16],
    }
}

/// A controller of the daemon at `d` with one I/O queue, over a soft fabric of its own.
struct Host {
    _fabric: Fabric,
    admin: AdminQueue<RdmaQueue>,
    io: IoQueue<RdmaQueue>,
}

impl Host {
    fn connect(d: &Daemon) -> Host {
        let f = Fabric::networked();
        f.add_device("127.0.0.1".parse().unwrap()).unwrap();
        let queue = |qid: u16| {
            let ch = CmChannel::Soft(nvmfd_rdma::soft::cm::CmChannel::new(&f).unwrap());
            RdmaQueue::connect(ch, d.soft_addr(), qid, 31, 4096, 128 * 1024)
                .unwrap_or_else(|e| panic!("connect queue {qid}: {e}"))
        };
        let h = host();
        let mut admin = AdminQueue::connect(queue(0), &h, SUB, 31, 0).unwrap();
        admin.enable().unwrap();
        admin.set_queue_count(1).unwrap();
        let io = IoQueue::connect(queue(1), &h, SUB, admin.cntlid, 1, 31).unwrap();
        Host {
            _fabric: f,
            admin,
            io,
        }
    }

    fn write(&mut self, lba: u64, data: &[u8]) -> Result<(), HostError> {
        let nlb = u32::try_from(data.len() / 512).unwrap();
        self.io.write(1, lba, nlb, data, false)
    }

    fn read(&mut self, lba: u64, len: usize) -> Vec<u8> {
        let mut buf = vec![0u8; len];
        let nlb = u32::try_from(len / 512).unwrap();
        self.io
            .read(1, lba, nlb, &mut buf)
            .unwrap_or_else(|e| panic!("read at {lba}: {e}"));
        buf
    }

    fn close(mut self) {
        self.io.transport().disconnect();
        self.admin.transport().disconnect();
    }
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fastrand::Rng::with_seed(seed).fill(&mut v);
    v
}

#[test]
fn an_rbd_namespace_passes_nvmf_verify_and_a_verified_bench() {
    let _c = shared();
    let Some(conf) = cluster() else { return };
    let d = new_image_daemon(&conf);
    let addr = d.soft_addr().to_string();
    let (ok, out, err) = nvmf(&["verify", "--addr", &addr, "--nqn", SUB]);
    assert!(ok && out.contains("read back intact"), "{out}{err}");
    let bench = |extra: &[&str]| {
        let mut args = vec![
            "bench", "--addr", &addr, "--nqn", SUB, "--warmup", "0", "--verify", "--json",
        ];
        args.extend_from_slice(extra);
        let (ok, out, err) = nvmf(&args);
        assert!(ok, "{extra:?}: {err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        (
            v["verified_blocks"].as_u64().unwrap(),
            v["total"]["ios"].as_u64().unwrap(),
        )
    };
    // Sequential 128 KiB writes from block 0, then sequential reads of the same blocks.
    let (_, writes) = bench(&["-w", "write", "-o", "128k", "-q", "8", "-t", "1.5"]);
    assert!(writes > 0);
    let (verified, _) = bench(&["-w", "read", "-o", "4k", "-q", "8", "-t", "1"]);
    assert!(verified > 0, "no written block was read back");
    // Mixed at random, each read checked against its write's stamp.
    let (verified, ios) = bench(&["-w", "randrw", "-q", "32", "-t", "2"]);
    assert!(
        ios > 0 && verified > 0,
        "randrw: {ios} I/Os, {verified} blocks verified"
    );
}

/// An image shrunk behind nvmfd's back (`rbd resize --allow-shrink`, the namespace not
/// resized): a read that runs past the new end either fails with a status (a short count
/// from librbd) or reads zeroes there; it never answers with what the data buffer held before
/// (maybe another host's data).
#[test]
fn a_read_past_the_end_of_an_image_shrunk_behind_nvmfds_back_returns_no_stale_data() {
    let _c = shared();
    let Some(conf) = cluster() else { return };
    let image = ceph::image_name();
    let d = rbd_daemon(&conf, &image, NEW_IMAGE);
    let mut h = Host::connect(&d);
    // The buffers hold data first, so that a short read would show it.
    let data = pattern(5, 128 * 1024);
    h.write(0, &data).unwrap();
    assert_eq!(h.read(0, data.len()), data);
    shrink_to_16m(&conf, &image);
    // The handles see the shrink: a read before they do reads zeroes past the end anyway.
    let backend_size = |d: &Daemon| d.data("status")["namespaces"][0]["backend_size"].as_u64();
    nvmfd_tests::wait_for("status to show the image shrunk", || {
        (backend_size(&d) == Some(16 << 20)).then_some(())
    });
    // 64 KiB before the new end and 64 KiB after it.
    let lba = (16 << 20) / 512 - 128;
    let mut buf = vec![0u8; 128 * 1024];
    // The read before this one left the pattern in the target's buffer.
    let r = h.io.read(1, lba, 256, &mut buf);
    assert!(
        r.is_err() || buf.iter().all(|&b| b == 0),
        "a read past the image's end answered with stale data"
    );
    // Within the new end, reads go on.
    assert_eq!(h.read(0, data.len()), data);
    h.close();
}

/// A write that runs past the end of an image shrunk behind nvmfd's back: librbd writes what
/// lies before the end and completes the write without saying it cut it. It fails with a
/// status; it is never acknowledged with its tail lost.
#[test]
fn a_write_past_the_end_of_an_image_shrunk_behind_nvmfds_back_fails() {
    let _c = shared();
    let Some(conf) = cluster() else { return };
    let image = ceph::image_name();
    let d = rbd_daemon(&conf, &image, NEW_IMAGE);
    let mut h = Host::connect(&d);
    let backend_size = |d: &Daemon| d.data("status")["namespaces"][0]["backend_size"].as_u64();
    assert_eq!(backend_size(&d), Some(32 << 20));
    shrink_to_16m(&conf, &image);
    // The handles see the shrink (status says so, beside the namespace's own size).
    nvmfd_tests::wait_for("status to show the image shrunk", || {
        (backend_size(&d) == Some(16 << 20)).then_some(())
    });
    assert_eq!(d.data("status")["namespaces"][0]["size"], 32 << 20);
    // 64 KiB before the new end and 64 KiB after it.
    let lba = (16 << 20) / 512 - 128;
    let e = h
        .write(lba, &pattern(6, 128 * 1024))
        .expect_err("a write cut at the image's end was acknowledged");
    assert!(matches!(e, HostError::Status { .. }), "{e}");
    // Within the new end, writes go on.
    let data = pattern(7, 64 * 1024);
    h.write(lba, &data).unwrap();
    assert_eq!(h.read(lba, data.len()), data);
    h.close();
}

/// A change that shrinks an image and grows another namespace, whose grow fails when it is
/// made: the change is refused and the image keeps what lay past the smaller size. (A shrink
/// undone by growing back would have left zeroes there: librbd deletes the tail.) A change
/// that shrinks two namespaces is refused before either is made.
#[test]
fn a_refused_change_never_loses_what_a_shrink_would_cut_off() {
    let _c = shared();
    let Some(conf) = cluster() else { return };
    let image = ceph::image_name();
    let d = Daemon::start(Options {
        replace: vec![(
            "backend = \"malloc\"\nsize = \"64MiB\"\n".into(),
            format!(
                "backend = \"rbd\"\npool = \"rbd\"\nimage = \"{image}\"\nceph_conf = \"{conf}\"\n\
                 create = true\nsize = \"32MiB\"\n\n[[subsystem.namespace]]\nnsid = 2\n\
                 backend = \"null\"\nsize = \"8MiB\"\n"
            ),
        )],
        test_hooks: true,
        ..Options::default()
    });
    let mut h = Host::connect(&d);
    // 24 MiB in: past the 16 MiB namespace 1 is asked to shrink to.
    let lba = (24 << 20) / 512;
    let data = pattern(9, 64 * 1024);
    h.write(lba, &data).unwrap();
    let path = d.dir.path().join("nvmfd.toml");
    let text = std::fs::read_to_string(&path).unwrap();
    let reload = |new: String| {
        std::fs::write(&path, new).unwrap();
        let a = d.request(r#"{"request": "reload"}"#);
        assert_eq!(a["ok"], false, "the change was made: {a}");
        a["error"].as_str().unwrap_or_default().to_owned()
    };
    let ok = d.request(&format!(
        r#"{{"request": "debug_fail_resize", "subsystem": "{SUB}", "nsid": 2}}"#
    ));
    assert_eq!(ok["ok"], true, "{ok}");
    let err = reload(
        text.replace("size = \"32MiB\"", "size = \"16MiB\"")
            .replace("size = \"8MiB\"", "size = \"16MiB\""),
    );
    assert!(
        err.contains("namespace 2") && err.contains("test hook"),
        "{err}"
    );
    assert!(
        h.read(lba, data.len()) == data,
        "the shrink was undone by growing back: its tail reads otherwise"
    );
    // Two shrinks in one change: refused, and neither is made.
    let err = reload(
        text.replace("size = \"32MiB\"", "size = \"16MiB\"")
            .replace("size = \"8MiB\"", "size = \"4MiB\""),
    );
    assert!(err.contains("shrinks 2 namespaces"), "{err}");
    assert!(
        h.read(lba, data.len()) == data,
        "a refused change shrank the image"
    );
    h.close();
}

/// A shrink whose cut of the image fails part-way (librbd deletes the objects past the new
/// end before it changes the image's size) is refused, and what lay past the new end is not
/// served as if it were still there (it reads zeroes): I/O past it fails until the resize is
/// made again, which completes it.
#[test]
fn a_shrink_that_fails_part_way_through_the_image_never_serves_its_deleted_tail() {
    let _c = shared();
    let Some(conf) = cluster() else { return };
    let image = ceph::image_name();
    let d = Daemon::start(Options {
        replace: vec![(
            "backend = \"malloc\"\nsize = \"64MiB\"\n".into(),
            format!(
                "backend = \"rbd\"\npool = \"rbd\"\nimage = \"{image}\"\nceph_conf = \"{conf}\"\n\
                 create = true\nsize = \"32MiB\"\n"
            ),
        )],
        test_hooks: true,
        ..Options::default()
    });
    let mut h = Host::connect(&d);
    // 24 MiB in: past the 16 MiB the namespace is asked to shrink to.
    let lba = (24 << 20) / 512;
    let data = pattern(11, 64 * 1024);
    h.write(lba, &data).unwrap();
    let armed = d.request(&format!(
        r#"{{"request": "debug_fail_resize", "subsystem": "{SUB}", "nsid": 1, "at_cut": true}}"#
    ));
    assert_eq!(armed["ok"], true, "{armed}");
    let path = d.dir.path().join("nvmfd.toml");
    let text = std::fs::read_to_string(&path).unwrap();
    let smaller = text.replace("size = \"32MiB\"", "size = \"16MiB\"");
    std::fs::write(&path, &smaller).unwrap();
    let a = d.request(r#"{"request": "reload"}"#);
    assert_eq!(a["ok"], false, "{a}");
    // `status` shows the size served now, not the size before the refused change.
    assert_eq!(
        d.data("status")["namespaces"][0]["size"],
        16 << 20,
        "{}",
        d.data("status")
    );
    let mut buf = vec![0u8; data.len()];
    let nlb = u32::try_from(data.len() / 512).unwrap();
    let past = h.io.read(1, lba, nlb, &mut buf);
    assert!(
        past.is_err(),
        "the tail was served after a failed cut ({})",
        if buf == data {
            "its data"
        } else {
            "zeroes for its data"
        }
    );
    assert!(
        a["error"].as_str().unwrap_or_default().contains("part-way"),
        "{a}"
    );
    // Before the new end, I/O goes on. A resize that reads the size again (which would have
    // read the image's old size, and served the tail) completes the cut first.
    h.write(0, &data).unwrap();
    assert_eq!(h.read(0, data.len()), data);
    std::fs::write(&path, &text).unwrap();
    let a = d.request(&format!(
        r#"{{"request": "resize_namespace", "subsystem": "{SUB}", "nsid": 1}}"#
    ));
    assert_eq!(a["ok"], true, "{a}");
    assert_eq!(d.data("status")["namespaces"][0]["size"], 16 << 20);
    assert_eq!(d.data("status")["namespaces"][0]["backend_size"], 16 << 20);
    assert!(h.io.read(1, lba, nlb, &mut buf).is_err());
    h.close();
}

/// A shrink that takes long because it deletes many objects (an image created without an
/// object map: librbd deletes each object past the new end, minutes for a terabyte) keeps the
/// watchdog fed while librbd reports progress: it is not taken for a hang (here after 500 ms
/// without progress, 60 s in service) and the service manager does not restart the daemon.
#[test]
fn a_long_shrink_that_makes_progress_keeps_the_watchdog_fed() {
    let _c = shared();
    let Some(conf) = cluster() else { return };
    let image = ceph::image_name();
    let mut d = Daemon::start(Options {
        replace: vec![(
            "backend = \"malloc\"\nsize = \"64MiB\"\n".into(),
            format!(
                "backend = \"rbd\"\npool = \"rbd\"\nimage = \"{image}\"\nceph_conf = \"{conf}\"\n\
                 create = true\nsize = \"128GiB\"\n"
            ),
        )],
        notify: true,
        watchdog_usec: Some(400_000),
        test_hooks: true,
        env: vec![("NVMFD_TEST_KEEP_WATCH_MS".into(), "500".into())],
        ..Options::default()
    });
    d.notifications_until("WATCHDOG=1");
    let path = d.dir.path().join("nvmfd.toml");
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, text.replace("size = \"128GiB\"", "size = \"16MiB\"")).unwrap();
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (fed, t0, t1) = std::thread::scope(|s| {
        let sock = d.notify.as_ref().unwrap();
        let stop = &stop;
        let watcher = s.spawn(move || {
            sock.set_read_timeout(Some(Duration::from_millis(10)))
                .unwrap();
            let mut fed = Vec::new();
            let mut buf = [0u8; 4096];
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if let Ok(n) = sock.recv(&mut buf) {
                    if String::from_utf8_lossy(&buf[..n]).contains("WATCHDOG=1") {
                        fed.push(Instant::now());
                    }
                }
            }
            fed
        });
        let t0 = Instant::now();
        let a = d.request(r#"{"request": "reload"}"#);
        let t1 = Instant::now();
        assert_eq!(a["ok"], true, "{a}");
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        (watcher.join().unwrap(), t0, t1)
    });
    let took = t1 - t0;
    if took < Duration::from_millis(1500) {
        skip(&format!(
            "the shrink took {took:?} here: too short to tell a fed watchdog from one that is not"
        ));
        return;
    }
    let mut at: Vec<Instant> = fed.into_iter().filter(|&t| t > t0 && t < t1).collect();
    at.insert(0, t0);
    at.push(t1);
    let gap = at.windows(2).map(|w| w[1] - w[0]).max().unwrap();
    assert!(
        gap < Duration::from_millis(1200),
        "the watchdog went unfed for {gap:?} of the {took:?} shrink"
    );
    assert_eq!(d.data("status")["namespaces"][0]["size"], 16 << 20);
    d.signal(libc::SIGTERM);
    assert!(d.wait_exit().success());
}

/// A listener added while serving an RBD namespace: the reactor's new data path needs its
/// own handle on the image, opened ahead by the control side (not by the reactor, which
/// would stop serving while the cluster answers), and serves I/O on it.
#[test]
fn a_listener_added_while_serving_an_image_gets_its_handles_opened_ahead() {
    let _c = shared();
    let Some(conf) = cluster() else { return };
    let d = new_image_daemon(&conf);
    let port = nvmfd_tests::test_port();
    let add_listener = |address: &str, port: u16| {
        let a = d.request(
            &serde_json::json!({"request": "add_listener",
                "listener": {"address": address, "port": port, "provider": "soft"}})
            .to_string(),
        );
        assert_eq!(a["ok"], true, "{a}");
    };
    add_listener("127.0.0.2", port);
    nvmfd_tests::wait_for("the handles opened ahead", || {
        d.log()
            .contains("RBD handles opened ahead for the reactors' new data paths")
            .then_some(())
    });
    // (Handles that come after the data path was built, on a slow cluster, are taken at its
    // next turn.)
    nvmfd_tests::wait_for("the new data path to have its handle", || {
        (d.log().contains("data path built on the listener's device")
            && nvmfd_tests::dp_sum(&d.data("stats"), "namespaces_awaiting") == 0)
            .then_some(())
    });
    let addr = format!("127.0.0.2:{port}");
    let (ok, out, err) = nvmf(&["verify", "--addr", &addr, "--nqn", SUB]);
    assert!(
        ok && out.contains("read back intact"),
        "{out}{err}\n{}",
        d.log()
    );
    // A listener on a device that has a data path already shares it: nothing is opened.
    let port = nvmfd_tests::test_port();
    add_listener("127.0.0.1", port);
    nvmfd_tests::wait_for("the listener to share the data path", || {
        d.log()
            .contains("listener shares its device's data path")
            .then_some(())
    });
    assert_eq!(
        d.log()
            .matches("RBD handles opened ahead for the reactors' new data paths")
            .count(),
        1,
        "{}",
        d.log()
    );
}

/// Shrinks image `image` of pool `rbd` to 16 MiB behind nvmfd's back.
fn shrink_to_16m(conf: &str, image: &str) {
    let spec = format!("rbd/{image}");
    rbd(conf, &["resize", "--allow-shrink", "--size", "16M", &spec]);
}

/// Runs `rbd -c conf ARGS`, which must succeed.
fn rbd(conf: &str, args: &[&str]) {
    let out = Command::new("rbd")
        .args(["-c", conf])
        .args(args)
        .output()
        .expect("run rbd");
    assert!(
        out.status.success(),
        "rbd {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A daemon serving a RAM namespace 1 and image `image` of the test cluster as namespace 2.
fn image_as_namespace_2(conf: &str, image: &str) -> Daemon {
    daemon_with(&format!(
        "backend = \"malloc\"\nsize = \"16MiB\"\n\n[[subsystem.namespace]]\nnsid = 2\nbackend = \"rbd\"\npool = \"rbd\"\nimage = \"{image}\"\nceph_conf = \"{conf}\"\n"
    ))
}

/// nvmfd turns librbd's cache off, but an image's own configuration overrides that when it
/// is opened: such an image would acknowledge writes still in the client's memory. It is not
/// served, and its status says why; with the cache made write-through it is.
#[test]
fn an_image_whose_configuration_turns_write_back_caching_on_is_not_served() {
    refused_for_its_configuration(
        &[["rbd_cache", "true"]],
        "write-back cache",
        &["set", "rbd_cache_max_dirty", "0"],
    );
}

/// librbd's ObjectCacher (`rbd_cache_policy` `writethrough`, or `writeback` with no dirty
/// bytes) writes through but caches reads in each handle, and each reactor has its own: a
/// read through one would return what a write through another replaced. Such an image is not
/// served; with the write-around cache (reads go around it) it is. Before, both were served.
#[test]
fn an_image_whose_configuration_caches_reads_in_each_handle_is_not_served() {
    for policy in ["writethrough", "writeback"] {
        refused_for_its_configuration(
            &[
                ["rbd_cache", "true"],
                ["rbd_cache_max_dirty", "0"],
                ["rbd_cache_policy", policy],
            ],
            "read cache in each handle",
            &["set", "rbd_cache_policy", "writearound"],
        );
    }
}

/// An image whose configuration sets `settings` (name, value) is not served, and its status
/// says why (`words`, in the image's configuration); after `rbd config image <fix...>` it is.
fn refused_for_its_configuration(settings: &[[&str; 2]], words: &str, fix: &[&str]) {
    let _c = shared();
    let Some(conf) = cluster() else { return };
    let image = ceph::image_name();
    let spec = format!("rbd/{image}");
    rbd(&conf, &["create", "--size", "16M", &spec]);
    for [name, value] in settings {
        rbd(&conf, &["config", "image", "set", &spec, name, value]);
    }
    {
        let d = image_as_namespace_2(&conf, &image);
        let status = d.data("status");
        let ns = &status["namespaces"][1];
        assert_eq!(ns["serving"], false, "{status}");
        let reason = ns["reason"].as_str().unwrap_or_default();
        assert!(
            reason.contains(words) && reason.contains("the image's configuration"),
            "{status}"
        );
    }
    let mut args = vec!["config", "image", fix[0], &spec];
    args.extend_from_slice(&fix[1..]);
    rbd(&conf, &args);
    let d = image_as_namespace_2(&conf, &image);
    let status = d.data("status");
    assert_eq!(status["namespaces"][1]["serving"], true, "{status}");
}

/// A deallocated block reads back as zeroes, as hosts are told, whatever the image's discard
/// settings: one that skips partial discards (set before it is served, and again while it
/// is: librbd applies an image's settings at each refresh of its header) is served and its
/// blocks deallocated inside an object read zeroes. Such an image was refused, and one set
/// so while served kept its old data where it was deallocated.
#[test]
fn a_deallocated_block_reads_zeroes_whatever_the_images_discard_settings() {
    let _c = shared();
    let Some(conf) = cluster() else { return };
    let image = ceph::image_name();
    let spec = format!("rbd/{image}");
    rbd(&conf, &["create", "--size", "16M", &spec]);
    let skip = [
        "config",
        "image",
        "set",
        &spec,
        "rbd_skip_partial_discard",
        "true",
    ];
    rbd(&conf, &skip);
    let d = image_as_namespace_2(&conf, &image);
    let status = d.data("status");
    assert_eq!(status["namespaces"][1]["serving"], true, "{status}");
    let mut h = Host::connect(&d);
    // 64 KiB in the middle of the first 4 MiB object; then the same with the settings made
    // (again) while served, and a coarse granularity.
    for (round, lba) in [(0u64, 2048u64), (1, 4096)] {
        let data = pattern(20 + round, 64 * 1024);
        h.io.write(2, lba, 128, &data, false).unwrap();
        if round == 1 {
            rbd(
                &conf,
                &["config", "image", "rm", &spec, "rbd_skip_partial_discard"],
            );
            rbd(&conf, &skip);
            rbd(
                &conf,
                &[
                    "config",
                    "image",
                    "set",
                    &spec,
                    "rbd_discard_granularity_bytes",
                    "4194304",
                ],
            );
            // A grow after them: once nvmfd's handles see it, they have refreshed with the
            // settings too (a refresh reads the image's configuration).
            rbd(&conf, &["resize", "--size", "20M", &spec]);
            nvmfd_tests::wait_for("the handles to see the image grown", || {
                (d.data("status")["namespaces"][1]["backend_size"].as_u64() == Some(20 << 20))
                    .then_some(())
            });
        }
        h.io.deallocate(2, &[(lba + 32, 64)]).unwrap();
        let mut back = vec![0u8; data.len()];
        h.io.read(2, lba, 128, &mut back).unwrap();
        assert!(
            back[..16384] == data[..16384] && back[48 * 1024..] == data[48 * 1024..],
            "round {round}: blocks around the range changed"
        );
        assert!(
            back[16384..48 * 1024].iter().all(|&b| b == 0),
            "round {round}: a deallocated block kept its data"
        );
    }
    h.close();
}

/// An image with the exclusive-lock feature (what a plain `rbd create` makes) is served, with
/// a warning in the log and in status: each reactor's handle takes the lock in turn.
#[test]
fn an_image_with_exclusive_lock_is_served_with_a_warning() {
    let _c = shared();
    let Some(conf) = cluster() else { return };
    let image = ceph::image_name();
    let spec = format!("rbd/{image}");
    rbd(
        &conf,
        &[
            "create",
            "--size",
            "16M",
            "--image-feature",
            "layering,exclusive-lock",
            &spec,
        ],
    );
    let d = image_as_namespace_2(&conf, &image);
    let status = d.assert_served_with_warning(1, &["exclusive-lock"]);
    // Namespace 1, on RAM, has none.
    assert!(status["namespaces"][0].get("warning").is_none(), "{status}");
    let mut h = Host::connect(&d);
    let data = pattern(8, 64 * 1024);
    h.io.write(2, 0, 128, &data, false).unwrap();
    let mut back = vec![0u8; data.len()];
    h.io.read(2, 0, 128, &mut back).unwrap();
    assert_eq!(back, data);
    h.close();
}

/// `systemctl reload` (`nvmfctl --pid`) after `daemon.admin_socket` was edited, with librados
/// in the daemon listening on a socket of its own (ceph.conf's `admin socket`): the daemon's
/// admin socket is found among the two by asking each for its process ID. The first
/// listening socket in /proc was taken, which could be librados', and a reload went to it.
#[test]
fn nvmfctl_pid_finds_the_daemons_socket_beside_librados_admin_socket() {
    let _c = shared();
    let Some(conf) = cluster() else { return };
    let dir = tempfile::tempdir().unwrap();
    let asok = dir.path().join("client.asok");
    let mut text = std::fs::read_to_string(&conf).unwrap();
    text.push_str(&format!("\n[client]\nadmin socket = {}\n", asok.display()));
    let conf2 = dir.path().join("ceph.conf");
    std::fs::write(&conf2, text).unwrap();
    let image = ceph::image_name();
    let d = rbd_daemon(conf2.to_str().unwrap(), &image, NEW_IMAGE);
    nvmfd_tests::wait_for("librados' admin socket", || asok.exists().then_some(()));
    let config = d.dir.path().join("nvmfd.toml");
    let edited = std::fs::read_to_string(&config).unwrap().replace(
        &d.socket.display().to_string(),
        &d.dir.path().join("moved.sock").display().to_string(),
    );
    std::fs::write(&config, edited).unwrap();
    for _ in 0..4 {
        let out = std::process::Command::new(nvmfd_tests::bin("nvmfctl"))
            .arg("--config")
            .arg(&config)
            .arg("--pid")
            .arg(d.child.id().to_string())
            .arg("--json")
            .arg("status")
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{said}");
        assert!(
            said.contains("\"namespaces\""),
            "not nvmfd's answer: {said}"
        );
    }
}

#[test]
fn a_second_daemon_on_the_image_reads_what_the_first_wrote() {
    let _c = shared();
    let Some(conf) = cluster() else { return };
    let image = ceph::image_name();
    let a = rbd_daemon(&conf, &image, NEW_IMAGE);
    let b = rbd_daemon(&conf, &image, "read_only = true");
    let mut ha = Host::connect(&a);
    let mut hb = Host::connect(&b);
    for (i, lba) in [0u64, 8, 4096, 65528].into_iter().enumerate() {
        let data = pattern(i as u64 + 1, 4096);
        ha.write(lba, &data).unwrap();
        ha.io.flush(1).unwrap();
        assert!(
            hb.read(lba, 4096) == data,
            "LBA {lba} differs through the second daemon"
        );
    }
    // The second export is read-only: a write through it is refused with a status.
    let e = hb.write(0, &[0u8; 512]).unwrap_err();
    assert!(matches!(e, HostError::Status { .. }), "{e}");
    ha.close();
    hb.close();
}

#[test]
fn an_osd_killed_during_writes_loses_no_acknowledged_write() {
    let _c = exclusive();
    let Some(conf) = cluster() else { return };
    let d = new_image_daemon(&conf);
    let mut h = Host::connect(&d);
    const WRITES: u64 = 240;
    let mut killed_at = None;
    let restart = ceph::Restart;
    for i in 0..WRITES {
        if i == WRITES / 3 {
            ceph::run(&["osd-kill", "1"]).unwrap();
            killed_at = Some(Instant::now());
        }
        // 8 KiB apart, so every write is its own place in the image.
        h.write(i * 16, &pattern(i, 4096))
            .unwrap_or_else(|e| panic!("write {i} (after the OSD was killed: {killed_at:?}): {e}"));
    }
    eprintln!(
        "{} writes after osd.1 was killed, in {:?}",
        WRITES - WRITES / 3,
        killed_at.unwrap().elapsed()
    );
    let check = |h: &mut Host, when: &str| {
        for i in 0..WRITES {
            assert!(
                h.read(i * 16, 4096) == pattern(i, 4096),
                "write {i} lost {when}"
            );
        }
    };
    check(&mut h, "with osd.1 down");
    let out = ceph::run(&["osd-start", "1"]).unwrap();
    eprint!("{out}");
    check(&mut h, "after osd.1 was back and backfilled");
    drop(restart);
    h.close();
}

#[test]
fn io_fails_with_a_status_while_the_cluster_is_gone_and_works_when_it_returns() {
    let _c = exclusive();
    let Some(conf) = cluster() else { return };
    // The cluster's file without its own `rados_osd_op_timeout`: nvmfd's default applies.
    let dir = tempfile::tempdir().unwrap();
    let own = dir.path().join("ceph.conf");
    let text = std::fs::read_to_string(&conf).unwrap();
    assert!(text.contains("rados_osd_op_timeout"), "{text}");
    let text: String = text
        .lines()
        .filter(|l| !l.trim_start().starts_with("rados_osd_op_timeout"))
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(&own, text).unwrap();
    let d = new_image_daemon(own.to_str().unwrap());
    let mut h = Host::connect(&d);
    h.write(0, &pattern(1, 4096)).unwrap();
    // The monitor alone: connected clients go on with the OSDs.
    let restart = ceph::Restart;
    ceph::run(&["mon-stop"]).unwrap();
    h.write(8, &pattern(4, 4096)).unwrap();
    assert!(h.read(8, 4096) == pattern(4, 4096));
    // And two OSDs of three: below the pool's min_size, nothing can answer.
    ceph::run(&["osd-kill", "1"]).unwrap();
    ceph::run(&["osd-kill", "2"]).unwrap();
    let t0 = Instant::now();
    let e = h.write(0, &pattern(2, 4096)).unwrap_err();
    let took = t0.elapsed();
    // Namespace Not Ready, without Do Not Retry: the host may try again later.
    match &e {
        HostError::Status { status, .. } => {
            assert_eq!(
                (status.sct(), status.sc(), status.dnr()),
                (0, 0x82, false),
                "{e}"
            );
        }
        _ => panic!("{e}"),
    }
    eprintln!("a write with the cluster gone failed in {took:?}: {e}");
    // nvmfd's default rados_osd_op_timeout (10 s): the answer comes well before the host
    // gives up on the command (30 s, Linux's default io_timeout) and resets the controller.
    // (It came after 30 s.)
    assert!(took < Duration::from_secs(25), "{took:?}");
    ceph::run(&["mon-start"]).unwrap();
    ceph::run(&["osd-start", "1"]).unwrap();
    ceph::run(&["osd-start", "2"]).unwrap();
    drop(restart);
    // Same connection, same controller: served again.
    h.write(0, &pattern(3, 4096)).unwrap();
    assert!(h.read(0, 4096) == pattern(3, 4096));
    let status = d.data("status");
    assert_eq!(status["namespaces"][0]["serving"], true, "{status}");
    h.close();
}

#[test]
fn a_namespace_whose_cluster_is_unreachable_is_left_out_and_the_others_are_served() {
    // No cluster needed: this one's monitor address has nobody behind it.
    let (_dir, dead) = dead_cluster(2);
    let d = daemon_with(&format!(
        "backend = \"malloc\"\nsize = \"16MiB\"\n\n[[subsystem.namespace]]\nnsid = 2\nbackend = \"rbd\"\npool = \"rbd\"\nimage = \"gone\"\nceph_conf = \"{}\"\n",
        dead.display()
    ));
    let status = d.data("status");
    let ns = status["namespaces"].as_array().unwrap();
    assert_eq!(
        (ns[0]["nsid"].as_u64(), &ns[0]["serving"]),
        (Some(1), &true.into()),
        "{status}"
    );
    assert_eq!(
        (ns[1]["nsid"].as_u64(), &ns[1]["serving"]),
        (Some(2), &false.into()),
        "{status}"
    );
    let reason = ns[1]["reason"].as_str().unwrap();
    assert!(
        reason.contains("connecting to the cluster") || reason.contains("cannot be loaded"),
        "{reason}"
    );
    assert_eq!(status["subsystems"][0]["namespaces"], 1, "{status}");
    assert!(d.log().contains("namespace not served"), "{}", d.log());
    // Namespace 1 is served; namespace 2 is not active.
    let addr = d.soft_addr().to_string();
    let (ok, out, err) = nvmf(&["verify", "--addr", &addr, "--nqn", SUB, "--nsid", "1"]);
    assert!(ok, "{out}{err}");
    let (ok, _, err) = nvmf(&[
        "bench", "--addr", &addr, "--nqn", SUB, "--nsid", "2", "-t", "0.2",
    ]);
    assert!(!ok && err.contains("namespace 2 is not active"), "{err}");
}

/// A namespace not served (its cluster unreachable at start, tried again) whose keys are
/// edited, its size or where its image is: the reload takes the file, and the next tries use
/// the new keys. Before, a size changed was taken for a resize of a namespace not served
/// ("serves no namespace 2"), any other key for a change "of more than its size", and the
/// reload failed: every admin change was then refused (the file edited since it was loaded)
/// until the edit was undone.
#[test]
fn the_keys_of_a_namespace_not_served_change_in_a_reload() {
    let (_dir, dead) = dead_cluster(2);
    let ns2 = |size: &str, pool: &str| {
        format!(
            "[[subsystem.namespace]]\nnsid = 2\nbackend = \"rbd\"\npool = \"{pool}\"\nimage = \"gone\"\ncreate = true\nsize = \"{size}\"\nceph_conf = \"{}\"\n",
            dead.display()
        )
    };
    let d = daemon_with(&format!(
        "backend = \"malloc\"\nsize = \"16MiB\"\n\n{}",
        ns2("32MiB", "rbd")
    ));
    let serving = |d: &Daemon| d.data("status")["namespaces"][1]["serving"].clone();
    assert_eq!(serving(&d), false);
    let path = d.dir.path().join("nvmfd.toml");
    for (size, pool) in [("64MiB", "rbd"), ("64MiB", "other")] {
        let text = std::fs::read_to_string(&path).unwrap();
        let at = text.find("[[subsystem.namespace]]\nnsid = 2").unwrap();
        let end = text[at..].find("ceph_conf").unwrap();
        let end = at + end + text[at + end..].find('\n').unwrap() + 1;
        let edited = format!("{}{}{}", &text[..at], ns2(size, pool), &text[end..]);
        std::fs::write(&path, edited).unwrap();
        let r = d.request(r#"{"request":"reload"}"#);
        assert_eq!(r["ok"], true, "size {size}, pool {pool}: {r}");
        assert_eq!(serving(&d), false);
        // What the next tries open: the configuration in force.
        let ns = &d.data("config")["subsystem"][0]["namespace"][1];
        assert_eq!(
            (&ns["size"], &ns["pool"]),
            (&size.into(), &pool.into()),
            "{ns}"
        );
    }
    // Changes are taken again.
    let host = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-0000000000a1";
    let add = serde_json::json!({"request": "add_host", "subsystem": SUB, "host": host});
    let r = d.request(&add.to_string());
    assert_eq!(r["ok"], true, "{r}");
}

/// One image reached through two configuration files (one a link to the other, as
/// Proxmox's /etc/ceph/ceph.conf is to /etc/pve/ceph.conf) is one store: two namespaces on
/// it would overwrite each other's data. Validation compares the keys as written, so the
/// daemon tells by the image itself (cluster FSID, pool ID, RADOS namespace, image ID):
/// adding it a second time is refused, at start and while serving.
#[test]
fn one_image_through_two_configuration_files_is_not_served_twice() {
    let _c = shared();
    let Some(conf) = cluster() else { return };
    let dir = tempfile::tempdir().unwrap();
    let link = dir.path().join("ceph.conf");
    std::os::unix::fs::symlink(&conf, &link).unwrap();
    let image = ceph::image_name();
    let d = rbd_daemon(&conf, &image, NEW_IMAGE);
    let add = serde_json::json!({"request": "add_namespace", "subsystem": SUB,
        "namespace": {"nsid": 2, "backend": "rbd", "pool": "rbd", "image": image,
                      "ceph_conf": link.display().to_string()}});
    let a = d.request(&add.to_string());
    assert_eq!(a["ok"], false, "{a}");
    let why = a["error"].to_string();
    assert!(
        why.contains("are one file, block device or RBD image"),
        "{why}"
    );
    drop(d);
    // At start.
    let mut d = Daemon::spawn(Options {
        replace: vec![(
            "backend = \"malloc\"\nsize = \"64MiB\"\n".into(),
            format!(
                "backend = \"rbd\"\npool = \"rbd\"\nimage = \"{image}\"\nceph_conf = \"{conf}\"\n\n[[subsystem.namespace]]\nnsid = 2\nbackend = \"rbd\"\npool = \"rbd\"\nimage = \"{image}\"\nceph_conf = \"{}\"\n",
                link.display()
            ),
        )],
        ..Options::default()
    });
    assert!(!d.wait_exit().success());
    assert!(
        d.log().contains("are one file, block device or RBD image"),
        "{}",
        d.log()
    );
}

/// The same for a namespace left out at start (its image missing) and opened on a later try:
/// the image it then finds is the one namespace 1 serves (renamed to its name meanwhile),
/// reached through another configuration file. It is not served, and says why.
#[test]
fn an_image_opened_on_a_later_try_that_another_namespace_serves_is_not_served() {
    let _c = shared();
    let Some(conf) = cluster() else { return };
    let dir = tempfile::tempdir().unwrap();
    let link = dir.path().join("ceph.conf");
    std::os::unix::fs::symlink(&conf, &link).unwrap();
    let (first, second) = (ceph::image_name(), ceph::image_name());
    let d = daemon_with(&format!(
        "backend = \"rbd\"\npool = \"rbd\"\nimage = \"{first}\"\nceph_conf = \"{conf}\"\n{NEW_IMAGE}\n\n[[subsystem.namespace]]\nnsid = 2\nbackend = \"rbd\"\npool = \"rbd\"\nimage = \"{second}\"\nceph_conf = \"{}\"\n",
        link.display()
    ));
    let ns2 = || d.data("status")["namespaces"][1].clone();
    assert_eq!(ns2()["serving"], false);
    rbd(
        &conf,
        &["rename", &format!("rbd/{first}"), &format!("rbd/{second}")],
    );
    let st = nvmfd_tests::wait_for("namespace 2's later try to be refused", || {
        Some(ns2()).filter(|n| {
            n["reason"]
                .as_str()
                .is_some_and(|r| r.contains("are one file, block device or RBD image"))
        })
    });
    assert_eq!(st["serving"], false, "{st}");
}

#[test]
fn a_missing_image_is_named_in_status() {
    let _c = shared();
    let Some(conf) = cluster() else { return };
    let d = daemon_with(&format!(
        "backend = \"malloc\"\nsize = \"16MiB\"\n\n[[subsystem.namespace]]\nnsid = 2\nbackend = \"rbd\"\npool = \"rbd\"\nimage = \"{}\"\nceph_conf = \"{conf}\"\n",
        ceph::image_name()
    ));
    let status = d.data("status");
    let reason = status["namespaces"][1]["reason"]
        .as_str()
        .unwrap_or_default();
    assert!(
        reason.contains("image `rbd/") && reason.contains("No such file"),
        "{status}"
    );
    assert!(Path::new(&conf).exists());
}

/// Adding a namespace whose cluster does not answer waits until its client gives up (5 s
/// here). Meanwhile the control thread keeps feeding systemd's watchdog (2 s), which would
/// otherwise end a daemon that serves everything else; and the change is refused cleanly.
#[test]
fn the_watchdog_is_fed_while_a_namespace_added_waits_for_its_cluster() {
    let (_dir, dead) = dead_cluster(5);
    let d = Daemon::start(Options {
        notify: true,
        watchdog_usec: Some(2_000_000),
        ..Options::default()
    });
    d.notifications_until("READY=1");
    d.notifications_until("WATCHDOG=1");
    let req = serde_json::json!({"request": "add_namespace", "subsystem": SUB,
        "namespace": {"nsid": 2, "backend": "rbd", "pool": "rbd", "image": "gone",
                      "ceph_conf": dead.display().to_string()}})
    .to_string();
    let started = Instant::now();
    let (answer, pings) = std::thread::scope(|s| {
        let add = s.spawn(|| d.request(&req));
        let mut pings = vec![Instant::now()];
        while !add.is_finished() {
            for m in d.notifications_for(Duration::from_millis(100)) {
                if m.lines().any(|l| l == "WATCHDOG=1") {
                    pings.push(Instant::now());
                }
            }
        }
        // The wait's end bounds the last gap.
        pings.push(Instant::now());
        (add.join().unwrap(), pings)
    });
    assert_eq!(answer["ok"], false, "{answer}");
    let error = answer["error"].as_str().unwrap_or_default();
    if started.elapsed() < Duration::from_secs(4) {
        // librbd is not there, or refused at once: nothing waited.
        return skip(&format!("the add did not wait for the cluster: {error}"));
    }
    let longest = pings
        .windows(2)
        .map(|w| w[1] - w[0])
        .max()
        .unwrap_or_default();
    assert!(
        longest < Duration::from_millis(1500),
        "no WATCHDOG=1 for {longest:?} while the add waited {:?} ({error})",
        started.elapsed()
    );
    assert_eq!(d.data("status")["state"], "running");
}

/// An RBD namespace removed while its cluster is gone: its image handles are closed on a
/// thread of their own. Closing one (`rbd_close`) waits on the cluster for as long as an OSD
/// operation may take (8 s in the test cluster), and the reactors once closed their handles
/// themselves: the reactor stopped serving the other namespaces meanwhile, and its stalled
/// heartbeat stopped the watchdog (systemd would restart the daemon).
#[test]
fn removing_a_namespace_whose_cluster_is_gone_keeps_the_reactors_serving() {
    let _c = exclusive();
    let Some(conf) = cluster() else { return };
    let d = Daemon::start(Options {
        notify: true,
        watchdog_usec: Some(2_000_000),
        ..Options::default()
    });
    d.notifications_until("READY=1");
    let image = ceph::image_name();
    let add = serde_json::json!({"request": "add_namespace", "subsystem": SUB,
        "namespace": {"nsid": 2, "backend": "rbd", "pool": "rbd", "image": image,
                      "ceph_conf": conf, "create": true, "size": "16MiB"}});
    let a = d.request(&add.to_string());
    assert_eq!(a["ok"], true, "{a}");
    let mut h = Host::connect(&d);
    h.io.write(2, 0, 8, &pattern(5, 4096), false).unwrap();
    let restart = ceph::Restart;
    ceph::run(&["mon-stop"]).unwrap();
    ceph::run(&["osd-kill", "1"]).unwrap();
    ceph::run(&["osd-kill", "2"]).unwrap();
    let remove = serde_json::json!({"request": "remove_namespace", "subsystem": SUB, "nsid": 2});
    let removed = d.request(&remove.to_string());
    let since = Instant::now();
    // Longer than a close can wait on the cluster: every reactor turns, and namespace 1
    // serves, all along. The writes run on a thread of their own, so that each watchdog
    // ping is seen when it comes.
    let (pings, (writes, slowest, mut h)) = std::thread::scope(|s| {
        let writer = s.spawn(move || {
            let (mut writes, mut slowest) = (0u32, Duration::ZERO);
            while since.elapsed() < Duration::from_secs(12) {
                let t = Instant::now();
                // 4,096 places of 4 KiB in turn, each always with the same pattern.
                let at = u64::from(writes % 4096);
                h.write(at * 8, &pattern(at, 4096))
                    .unwrap_or_else(|e| panic!("namespace 1, write {writes}: {e}"));
                slowest = slowest.max(t.elapsed());
                writes += 1;
            }
            (writes, slowest, h)
        });
        let mut pings = vec![since];
        while !writer.is_finished() {
            for m in d.notifications_for(Duration::from_millis(100)) {
                if m.lines().any(|l| l == "WATCHDOG=1") {
                    pings.push(Instant::now());
                }
            }
        }
        pings.push(Instant::now());
        (pings, writer.join().unwrap())
    });
    drop(restart);
    assert_eq!(removed["ok"], true, "{removed}");
    let longest = pings
        .windows(2)
        .map(|w| w[1] - w[0])
        .max()
        .unwrap_or_default();
    eprintln!(
        "{writes} writes to namespace 1 after the removal, the slowest {slowest:?}; longest \
         watchdog gap {longest:?}"
    );
    assert!(
        longest < Duration::from_millis(1500),
        "no WATCHDOG=1 for {longest:?}"
    );
    assert!(slowest < Duration::from_secs(2), "a write took {slowest:?}");
    assert!(h.read(0, 4096) == pattern(0, 4096));
    h.close();
}

/// Four namespaces on one cluster that does not answer: their opens at start wait for one
/// connection attempt (5 s here) and share its failure. Each once took the process-wide
/// lock of connections for its own attempt, one after the other: 20 s before the daemon was
/// ready, past systemd's start timeout with enough of them.
#[test]
fn namespaces_on_an_unreachable_cluster_share_one_attempt_to_connect() {
    let (_dir, dead) = dead_cluster(5);
    let mut extra = String::from("backend = \"malloc\"\nsize = \"16MiB\"\n");
    for nsid in 2..=5 {
        extra.push_str(&format!(
            "\n[[subsystem.namespace]]\nnsid = {nsid}\nbackend = \"rbd\"\npool = \"rbd\"\nimage = \"gone{nsid}\"\nceph_conf = \"{}\"\n",
            dead.display()
        ));
    }
    let t0 = Instant::now();
    let d = daemon_with(&extra);
    let took = t0.elapsed();
    let status = d.data("status");
    let ns = status["namespaces"].as_array().unwrap();
    let reasons: Vec<&str> = ns[1..]
        .iter()
        .map(|n| n["reason"].as_str().unwrap_or_default())
        .collect();
    if reasons.iter().any(|r| r.contains("cannot be loaded")) {
        return skip(&format!("librbd is not there: {reasons:?}"));
    }
    assert_eq!(ns.len(), 5, "{status}");
    assert!(
        reasons
            .iter()
            .all(|r| r.contains("connecting to the cluster")),
        "{reasons:?}"
    );
    // One attempt of 5 s, not four in a row.
    assert!(took < Duration::from_secs(12), "ready after {took:?}");
}

/// An RBD namespace whose image does not exist at start is left out, and its device is tried
/// again after a wait that doubles from 1 s: once the image is made it is served, without a
/// restart or a change, and a host connected meanwhile does I/O on it.
#[test]
fn an_image_made_after_the_start_is_served_then() {
    let _c = shared();
    let Some(conf) = cluster() else { return };
    let image = ceph::image_name();
    let d = image_as_namespace_2(&conf, &image);
    let ns2 = || d.data("status")["namespaces"][1].clone();
    assert_eq!(ns2()["serving"], false);
    let mut h = Host::connect(&d);
    assert!(h.io.read(2, 0, 8, &mut [0u8; 4096]).is_err(), "inactive");
    // Tried again while the image is still missing: that fails, and says so.
    let st = nvmfd_tests::wait_for("a try again to fail", || {
        Some(ns2()).filter(|n| {
            n["reason"]
                .as_str()
                .is_some_and(|r| r.contains("tried again"))
        })
    });
    assert!(
        st["reason"].as_str().unwrap().contains("No such file"),
        "{st}"
    );
    rbd(&conf, &["create", "--size", "16M", &format!("rbd/{image}")]);
    let st = nvmfd_tests::wait_for("namespace 2 to be served", || {
        Some(ns2()).filter(|n| n["serving"] == true)
    });
    assert!(st["reason"].is_null(), "{st}");
    h.io.write(2, 0, 8, &pattern(9, 4096), false).unwrap();
    let mut back = vec![0u8; 4096];
    h.io.read(2, 0, 8, &mut back).unwrap();
    assert!(back == pattern(9, 4096));
    assert!(
        d.log().contains("its device opened on a later try"),
        "{}",
        d.log()
    );
    h.close();
}

/// A data path built while the cluster does not answer (a listener added with two OSDs of
/// three down) is not held up by its image: its reactor never opens a handle itself. The new
/// listener serves the RAM namespace at once; the image's commands answer Namespace Not Ready
/// until a handle opened off the reactor is ready, and are served once the cluster is back.
/// Before, the reactor opened its own handle, waited on the cluster and then failed the whole
/// data path: the listener served nothing.
#[test]
fn a_listener_added_while_the_cluster_does_not_answer_serves_its_other_namespaces() {
    let _c = exclusive();
    let Some(conf) = cluster() else { return };
    let image = ceph::image_name();
    rbd(&conf, &["create", "--size", "16M", &format!("rbd/{image}")]);
    let d = image_as_namespace_2(&conf, &image);
    let restart = ceph::Restart;
    ceph::run(&["mon-stop"]).unwrap();
    ceph::run(&["osd-kill", "1"]).unwrap();
    ceph::run(&["osd-kill", "2"]).unwrap();
    let port = nvmfd_tests::test_port();
    let a = d.request(
        &serde_json::json!({"request": "add_listener",
            "listener": {"address": "127.0.0.2", "port": port, "provider": "soft"}})
        .to_string(),
    );
    assert_eq!(a["ok"], true, "{a}");
    let addr = format!("127.0.0.2:{port}");
    let verify = |nsid: &str| nvmf(&["verify", "--addr", &addr, "--nqn", SUB, "--nsid", nsid]);
    let (ok, out, err) = verify("1");
    assert!(
        ok && out.contains("read back intact"),
        "{out}{err}\n{}",
        d.log()
    );
    let (ok, out, err) = verify("2");
    assert!(
        !ok && err.contains("sc 0x82"),
        "not Namespace Not Ready: {out}{err}"
    );
    let stats = d.data("stats");
    assert_eq!(
        nvmfd_tests::dp_sum(&stats, "namespaces_awaiting"),
        1,
        "the new data path's image waits for a handle: {stats}"
    );
    ceph::run(&["mon-start"]).unwrap();
    ceph::run(&["osd-start", "1"]).unwrap();
    ceph::run(&["osd-start", "2"]).unwrap();
    drop(restart);
    // The open under way when the cluster came back may still fail (after the client's 8 s
    // operation timeout); the next one, at most 30 s later, does not.
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let (ok, out, err) = verify("2");
        if ok {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "namespace 2 through the new listener: {out}{err}\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(d.log().contains("namespace attached"), "{}", d.log());
    assert_eq!(
        nvmfd_tests::dp_sum(&d.data("stats"), "namespaces_awaiting"),
        0
    );
}
