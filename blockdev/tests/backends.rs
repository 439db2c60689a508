//! The same tests against every backend: a file on disk, a file on tmpfs, a loop block device,
//! RAM, null, and an RBD image of the test cluster (`scripts/ceph-dev-cluster.sh`, started by
//! the first test that needs it; skipped, and listed, where it cannot start).

// Sizes and counters in this file are small and known: casts cannot truncate.
#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use nvmfd_blockdev::{
    BlockError, BufPool, Completion, DevId, Device, DeviceSpec, DmaBuf, Engine, Kind,
};

const SIZE: u64 = 8 << 20;

/// Says that a test is skipped, on standard error and in `target/tmp/skipped-tests.txt`,
/// which the test script prints at the end (cargo hides a passing test's output).
fn skip(test: &str, why: &str) {
    use std::io::Write;
    let line = format!("SKIPPED {test}: {why}\n");
    eprint!("{line}");
    let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join("skipped-tests.txt");
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        // One write per line: tests run in parallel and append to the same file.
        let _ = f.write_all(line.as_bytes());
    }
}

/// A deterministic byte pattern, different for every seed.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fastrand::Rng::with_seed(seed).fill(&mut v);
    v
}

struct Fixture {
    engine: Engine,
    pool: BufPool,
    dev: DevId,
    device: Arc<Device>,
    /// What the device was opened with.
    spec: DeviceSpec,
    /// Reads return what was written (false for null).
    stores: bool,
    _cleanup: Option<Cleanup>,
}

/// Held for its `Drop`: removes the directory, detaches the loop device.
#[allow(dead_code)]
enum Cleanup {
    Dir(tempfile::TempDir),
    Loop(String, tempfile::TempDir),
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if let Cleanup::Loop(dev, _) = self {
            let _ = Command::new("losetup").arg("-d").arg(&*dev).status();
        }
    }
}

fn make_file(dir: &Path) -> PathBuf {
    let path = dir.join("disk.img");
    let f = std::fs::File::create(&path).unwrap();
    f.set_len(SIZE).unwrap();
    path
}

fn fixture(kind: &str, block_size: u32) -> Option<Fixture> {
    let pool = BufPool::new(16, 256 * 1024, false).unwrap();
    let (spec, cleanup, stores) = match kind {
        "file" => {
            let dir = tempfile::Builder::new()
                .prefix("nvmfd-bdev")
                .tempdir_in("/var/tmp")
                .unwrap();
            let mut s = DeviceSpec::new(Kind::File);
            s.path = Some(make_file(dir.path()));
            s.block_size = block_size;
            (s, Some(Cleanup::Dir(dir)), true)
        }
        "tmpfs" => {
            if !Path::new("/dev/shm").is_dir() {
                skip(
                    &format!("blockdev {kind} {block_size}"),
                    "no tmpfs at /dev/shm",
                );
                return None;
            }
            let dir = tempfile::Builder::new()
                .prefix("nvmfd-bdev")
                .tempdir_in("/dev/shm")
                .unwrap();
            let mut s = DeviceSpec::new(Kind::File);
            s.path = Some(make_file(dir.path()));
            s.block_size = block_size;
            (s, Some(Cleanup::Dir(dir)), true)
        }
        "loop" => {
            let dir = tempfile::Builder::new()
                .prefix("nvmfd-bdev")
                .tempdir_in("/var/tmp")
                .unwrap();
            let file = make_file(dir.path());
            let out = Command::new("losetup")
                .args(["--find", "--show", "--sector-size", &block_size.to_string()])
                .arg(&file)
                .output();
            let dev = match out {
                Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).trim().to_owned(),
                Ok(o) => {
                    let why = format!(
                        "losetup failed: {}",
                        String::from_utf8_lossy(&o.stderr).trim()
                    );
                    skip(&format!("blockdev loop device {block_size}"), &why);
                    return None;
                }
                Err(e) => {
                    skip(
                        &format!("blockdev loop device {block_size}"),
                        &format!("losetup unavailable: {e}"),
                    );
                    return None;
                }
            };
            let mut s = DeviceSpec::new(Kind::Bdev);
            s.path = Some(PathBuf::from(&dev));
            (s, Some(Cleanup::Loop(dev, dir)), true)
        }
        "malloc" => {
            let mut s = DeviceSpec::new(Kind::Malloc);
            s.size = SIZE;
            s.block_size = block_size;
            (s, None, true)
        }
        #[cfg(feature = "rbd")]
        "rbd" => {
            let conf = match ceph_cluster() {
                Ok(c) => c,
                Err(why) => {
                    skip(&format!("blockdev rbd {block_size}"), &why);
                    return None;
                }
            };
            let mut s = DeviceSpec::new(Kind::Rbd);
            s.size = SIZE;
            s.block_size = block_size;
            s.rbd = Some(nvmfd_blockdev::RbdSpec {
                pool: "rbd".into(),
                image: image_name(),
                namespace: None,
                ceph_conf: conf,
                client_id: "admin".into(),
                create: true,
            });
            (s, None, true)
        }
        "null" => {
            let mut s = DeviceSpec::new(Kind::Null);
            s.size = SIZE;
            s.block_size = block_size;
            (s, None, false)
        }
        other => panic!("unknown backend {other}"),
    };
    let device = Device::open(&spec).unwrap_or_else(|e| panic!("{kind}: {e}"));
    assert_eq!(device.info().logical_block_size, block_size, "{kind}");
    assert_eq!(device.info().size, SIZE, "{kind}");
    let mut engine = Engine::new(32, 4, std::slice::from_ref(&pool)).unwrap();
    let dev = engine.attach(&device).unwrap();
    Some(Fixture {
        engine,
        pool,
        dev,
        device,
        spec,
        stores,
        _cleanup: cleanup,
    })
}

impl Fixture {
    fn buf(&self, len: usize) -> DmaBuf {
        let mut b = self.pool.take().expect("a free buffer");
        assert!(b.set_len(len));
        b
    }

    /// Waits for every queued operation and returns the completions.
    fn run(&mut self) -> Vec<Completion> {
        let mut out = Vec::new();
        self.engine.drain(|c| out.push(c)).unwrap();
        out
    }

    fn write(&mut self, offset: u64, data: &[u8], fua: bool) {
        let mut b = self.buf(data.len());
        b.as_mut_slice().copy_from_slice(data);
        self.engine.write(self.dev, offset, b, fua, 1).unwrap();
        let c = self.run();
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].result, Ok(data.len() as u32));
    }

    fn read(&mut self, offset: u64, len: usize) -> Vec<u8> {
        let b = self.buf(len);
        self.engine.read(self.dev, offset, b, 2).unwrap();
        let mut c = self.run();
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].result, Ok(len as u32));
        c.pop().unwrap().buf.unwrap().as_slice().to_vec()
    }

    /// What a Flush answers once a sync of this device failed: EIO for files and block
    /// devices, success for the others (nothing to sync).
    fn flush_after_a_failed_sync(&self) -> Result<u32, BlockError> {
        if matches!(self.device.info().kind, Kind::File | Kind::Bdev) {
            Err(BlockError::Io(libc::EIO))
        } else {
            Ok(0)
        }
    }

    fn expect(&self, got: &[u8], want: &[u8], what: &str) {
        if self.stores {
            assert!(got == want, "{what}: data differs");
        } else {
            assert!(
                got.iter().all(|&b| b == 0),
                "{what}: null reads must be zeroes"
            );
        }
    }
}

/// A test on every backend (`per_backend!(test)`), or on those named where it applies
/// (`per_backend!(test: file_512, loop_bdev_512)`): no variant passes with nothing run.
macro_rules! per_backend {
    ($test:ident) => {
        per_backend!($test: file_512, file_4096, tmpfs_512, loop_bdev_512, loop_bdev_4096,
            malloc_512, malloc_4096, null_512, rbd_512, rbd_4096);
    };
    ($test:ident: $($variant:ident),+ $(,)?) => {
        mod $test {
            $(per_backend!(@variant $test $variant);)+
        }
    };
    (@variant $test:ident file_512) => { per_backend!(@optional $test file_512 "file" 512); };
    (@variant $test:ident file_4096) => { per_backend!(@optional $test file_4096 "file" 4096); };
    (@variant $test:ident tmpfs_512) => { per_backend!(@optional $test tmpfs_512 "tmpfs" 512); };
    (@variant $test:ident loop_bdev_512) => {
        per_backend!(@optional $test loop_bdev_512 "loop" 512);
    };
    (@variant $test:ident loop_bdev_4096) => {
        per_backend!(@optional $test loop_bdev_4096 "loop" 4096);
    };
    (@variant $test:ident malloc_512) => { per_backend!(@always $test malloc_512 "malloc" 512); };
    (@variant $test:ident malloc_4096) => {
        per_backend!(@always $test malloc_4096 "malloc" 4096);
    };
    (@variant $test:ident null_512) => { per_backend!(@always $test null_512 "null" 512); };
    (@variant $test:ident rbd_512) => { per_backend!(@rbd $test rbd_512 512); };
    (@variant $test:ident rbd_4096) => { per_backend!(@rbd $test rbd_4096 4096); };
    // A backend the machine may lack: its fixture says so (a skip) and the test is not run.
    (@optional $test:ident $name:ident $kind:literal $bs:literal) => {
        #[test]
        fn $name() {
            if let Some(f) = super::fixture($kind, $bs) {
                super::$test(f)
            }
        }
    };
    (@always $test:ident $name:ident $kind:literal $bs:literal) => {
        #[test]
        fn $name() {
            super::$test(super::fixture($kind, $bs).unwrap())
        }
    };
    (@rbd $test:ident $name:ident $bs:literal) => {
        #[cfg(feature = "rbd")]
        #[test]
        fn $name() {
            let _closed = super::RbdClosesAwaited;
            if let Some(f) = super::fixture("rbd", $bs) {
                super::$test(f)
            }
        }
    };
}

/// Held first by every test that opens an RBD image, so that it is dropped last: waits until
/// every image handle let go so far is closed. Handles are closed on threads of their own;
/// a test process that returns from `main` while one is inside librbd runs librados' and
/// librbd's static destructors under it and can crash (it did, at the end of a run whose
/// tests had all passed), and an image left unclosed keeps its watch at the cluster.
#[cfg(feature = "rbd")]
struct RbdClosesAwaited;

#[cfg(feature = "rbd")]
impl Drop for RbdClosesAwaited {
    fn drop(&mut self) {
        let closed = nvmfd_blockdev::wait_for_rbd_closes(std::time::Duration::from_secs(60));
        if !std::thread::panicking() {
            assert!(
                closed,
                "{} RBD image handles still closing after 60 s",
                nvmfd_blockdev::rbd_closes_pending()
            );
        }
    }
}

/// The ceph.conf of the test cluster (`scripts/ceph-dev-cluster.sh start`, once per test
/// process), or why there is none.
#[cfg(feature = "rbd")]
fn ceph_cluster() -> Result<PathBuf, String> {
    static CONF: std::sync::OnceLock<Result<PathBuf, String>> = std::sync::OnceLock::new();
    CONF.get_or_init(|| {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/ceph-dev-cluster.sh");
        let out = Command::new(script)
            .arg("start")
            .output()
            .map_err(|e| format!("cannot run scripts/ceph-dev-cluster.sh: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "the test cluster did not start: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        let stdout = String::from_utf8_lossy(&out.stdout);
        let conf = stdout.lines().last().unwrap_or("").trim();
        Ok(PathBuf::from(conf))
    })
    .clone()
}

/// An RBD image name no other test (or run) uses.
#[cfg(feature = "rbd")]
fn image_name() -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!(
        "t{}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed),
        nanos
    )
}

fn data_round_trips_across_block_boundaries(mut f: Fixture) {
    let bs = u64::from(f.device.info().logical_block_size);
    let cases = [(0, 1), (7, 3), (1, 16), (33, 257), (SIZE / bs - 64, 64)];
    for (i, (block, blocks)) in cases.into_iter().enumerate() {
        let len = (blocks * bs).min(256 * 1024) as usize;
        let data = pattern(i as u64 + 1, len);
        f.write(block * bs, &data, i % 2 == 1);
        let got = f.read(block * bs, len);
        f.expect(&got, &data, &format!("case {i}"));
    }
    // An overlapping read sees both writes.
    let a = pattern(100, 2 * bs as usize);
    let b = pattern(101, 2 * bs as usize);
    f.write(10 * bs, &a, false);
    f.write(11 * bs, &b, false);
    let got = f.read(10 * bs, 3 * bs as usize);
    let mut want = a[..bs as usize].to_vec();
    want.extend_from_slice(&b);
    f.expect(&got, &want, "overlap");
    assert_eq!(
        f.pool.free_count(),
        f.pool.count(),
        "every buffer came back"
    );
}
per_backend!(data_round_trips_across_block_boundaries);

fn writes_from_memory_outside_the_pools_land_and_hand_back_no_buffer(mut f: Fixture) {
    // Page-aligned memory that is not a pool buffer, as a receive buffer is.
    let layout = std::alloc::Layout::from_size_align(16384, 4096).unwrap();
    // SAFETY: a non-zero size.
    let mem = unsafe { std::alloc::alloc(layout) };
    let mem = std::ptr::NonNull::new(mem).unwrap();
    let bs = f.device.info().logical_block_size as usize;
    for (i, (block, len)) in [(3u64, 4096usize), (40, 16384), (9, bs)]
        .into_iter()
        .enumerate()
    {
        let data = pattern(50 + i as u64, len);
        // SAFETY: `mem` holds 16 KiB; the data is copied in before the write is queued.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), mem.as_ptr(), len) };
        let offset = block * bs as u64;
        // SAFETY: `mem` lives until the end of this test and is not touched until the
        // completion is reaped by `run`.
        unsafe {
            f.engine
                .write_from(f.dev, offset, mem, len as u32, i == 1, 5)
                .unwrap()
        };
        let c = f.run();
        assert_eq!(c.len(), 1);
        assert_eq!((c[0].tag, &c[0].result), (5, &Ok(len as u32)));
        assert!(c[0].buf.is_none());
        let got = f.read(offset, len);
        f.expect(&got, &data, &format!("write_from {i}"));
    }
    // SAFETY: allocated above with this layout; no operation uses it any more.
    unsafe { std::alloc::dealloc(mem.as_ptr(), layout) };
}
per_backend!(writes_from_memory_outside_the_pools_land_and_hand_back_no_buffer);

fn flush_and_fua_complete(mut f: Fixture) {
    let data = pattern(7, 4096);
    f.write(0, &data, true);
    f.engine.flush(f.dev, 9).unwrap();
    let c = f.run();
    assert_eq!((c[0].tag, &c[0].result), (9, &Ok(0)));
    let got = f.read(0, 4096);
    f.expect(&got, &data, "after flush");
}
per_backend!(flush_and_fua_complete);

/// Linux reports a writeback error once per open file, and every host and reactor share the
/// device's one file: after a sync failed, every later Flush fails too (a sync that succeeded
/// then would say nothing of the writes lost), and so does the stop-time sync.
fn a_failed_sync_fails_every_later_flush_of_a_file(mut f: Fixture) {
    let file = matches!(f.device.info().kind, Kind::File | Kind::Bdev);
    let data = pattern(3, 4096);
    f.write(0, &data, false);
    f.device.fail_next_sync();
    f.engine.flush(f.dev, 1).unwrap();
    let c = f.run();
    let expect = f.flush_after_a_failed_sync();
    assert_eq!(
        c[0].result, expect,
        "the failed sync (files and block devices)"
    );
    // A second engine (another reactor) and a later Flush: it fails too, for files.
    let mut other = Engine::new(8, 1, std::slice::from_ref(&f.pool)).unwrap();
    let d = other.attach(&f.device).unwrap();
    // (It runs, so what was written since is synced, and then fails.)
    other.flush(d, 2).unwrap();
    let mut done = Vec::new();
    other.drain(|c| done.push(c)).unwrap();
    let expect = f.flush_after_a_failed_sync();
    assert_eq!(done[0].result, expect);
    assert_eq!(f.device.sync_failed(), file);
    if file {
        assert!(f.device.sync().is_err(), "the stop-time sync says so too");
    }
}
per_backend!(a_failed_sync_fails_every_later_flush_of_a_file);

/// A Flush whose own sync succeeded while another engine's sync, begun with it, took the
/// writeback error's report and ended between the Flush's settling and its look for syncs
/// in flight: the Flush fails. It was answered success over the lost write.
fn a_flush_racing_a_sync_that_takes_the_writeback_error_fails(mut f: Fixture) {
    f.write(0, &pattern(4, 4096), false);
    f.device.race_next_flush();
    f.engine.flush(f.dev, 1).unwrap();
    let c = f.run();
    let expect = f.flush_after_a_failed_sync();
    assert_eq!(c[0].result, expect);
}
per_backend!(a_flush_racing_a_sync_that_takes_the_writeback_error_fails);

/// A writeback error is reported with the failed write's errno (ENODATA for a media error,
/// ETIMEDOUT from a network block device), not only EIO: any of them makes every later
/// Flush fail, and the Flush is answered as lost data, never as one to retry (ETIMEDOUT was
/// Namespace Not Ready, and the retry's sync succeeded, the lost data forgotten).
fn a_sync_failing_with_any_writeback_errno_fails_every_later_flush(f: Fixture) {
    a_sync_failing_with(f, libc::ETIMEDOUT);
}
per_backend!(a_sync_failing_with_any_writeback_errno_fails_every_later_flush);

/// Linux hands a writeback error's report to the sync that asks whatever that sync returns:
/// an fdatasync failing with ENOMEM (writing pages back), EINTR or EAGAIN, or EROFS (a file
/// system that aborted), has taken it. Such a Flush was answered Namespace Not Ready (or
/// Write Protected), the device not marked, and the host's retry succeeded: the lost data
/// forgotten.
fn a_sync_failing_with_enomem_fails_every_later_flush(f: Fixture) {
    a_sync_failing_with(f, libc::ENOMEM);
}
per_backend!(a_sync_failing_with_enomem_fails_every_later_flush);

fn a_sync_failing_with_eintr_fails_every_later_flush(f: Fixture) {
    a_sync_failing_with(f, libc::EINTR);
}
per_backend!(a_sync_failing_with_eintr_fails_every_later_flush);

fn a_sync_failing_with_erofs_fails_every_later_flush(f: Fixture) {
    a_sync_failing_with(f, libc::EROFS);
}
per_backend!(a_sync_failing_with_erofs_fails_every_later_flush);

/// A sync that never ran (io_uring could not start it) took no report: that Flush fails,
/// and the next one succeeds.
fn a_sync_that_never_ran_leaves_later_flushes_alone(f: Fixture) {
    a_sync_that_never_ran(f, libc::ECANCELED);
}
per_backend!(a_sync_that_never_ran_leaves_later_flushes_alone);

/// A sync refused for its descriptor (EBADF) never ran either. EBADF was taken for a
/// read-only device's (Namespace Write Protected, and a lost writeback for a Flush), so every
/// later Flush failed.
fn a_sync_refused_for_its_descriptor_leaves_later_flushes_alone(f: Fixture) {
    a_sync_that_never_ran(f, libc::EBADF);
}
per_backend!(a_sync_refused_for_its_descriptor_leaves_later_flushes_alone);

fn a_sync_that_never_ran(mut f: Fixture, errno: i32) {
    f.write(0, &pattern(4, 4096), false);
    f.device.fail_sync(0, errno);
    f.engine.flush(f.dev, 1).unwrap();
    let c = f.run();
    let file = matches!(f.device.info().kind, Kind::File | Kind::Bdev);
    if file {
        assert_eq!(c[0].result, Err(BlockError::Io(errno)));
    }
    f.engine.flush(f.dev, 2).unwrap();
    let c = f.run();
    assert_eq!(c[0].result, Ok(0), "a later Flush");
    assert!(!f.device.sync_failed());
}

fn a_sync_failing_with(mut f: Fixture, errno: i32) {
    let file = matches!(f.device.info().kind, Kind::File | Kind::Bdev);
    f.write(0, &pattern(4, 4096), false);
    f.device.fail_sync(0, errno);
    f.engine.flush(f.dev, 1).unwrap();
    let c = f.run();
    let failed = f.flush_after_a_failed_sync();
    assert_eq!(c[0].result, failed, "the failed sync");
    f.engine.flush(f.dev, 2).unwrap();
    let c = f.run();
    assert_eq!(c[0].result, failed, "a later Flush");
    assert_eq!(f.device.sync_failed(), file, "errno {errno}");
}

/// Two Flushes in flight together on one engine: Linux gives a writeback error's report to
/// the first sync that asks, and the other may complete first, successfully. It waits for
/// the one still in flight, and fails with it (it was answered success).
fn a_flush_that_succeeds_beside_one_taking_a_writeback_error_fails_too(mut f: Fixture) {
    f.write(0, &pattern(5, 4096), false);
    // The second sync to complete fails, whichever it is.
    f.device.fail_sync(1, libc::EIO);
    f.engine.flush(f.dev, 1).unwrap();
    f.engine.flush(f.dev, 2).unwrap();
    let c = f.run();
    assert_eq!(c.len(), 2);
    for c in &c {
        let want = f.flush_after_a_failed_sync();
        assert_eq!(c.result, want, "flush {}", c.tag);
    }
}
per_backend!(a_flush_that_succeeds_beside_one_taking_a_writeback_error_fails_too);

/// A FUA zeroing's fdatasync takes writeback errors' reports as a Flush's does, direct I/O
/// or not: its failure makes every later Flush fail (it did not, with O_DIRECT).
fn a_fua_zeroings_failed_sync_fails_every_later_flush(mut f: Fixture) {
    let file = matches!(f.device.info().kind, Kind::File | Kind::Bdev);
    f.write(0, &pattern(6, 4096), false);
    f.device.fail_next_sync();
    if let Err(r) = f.engine.write_zeroes(f.dev, 0, 4096, true, 1) {
        // (A file system without ZERO_RANGE: tmpfs.)
        assert!(matches!(r.error, BlockError::Unsupported(_)), "{r:?}");
        skip(
            "a_fua_zeroings_failed_sync_fails_every_later_flush",
            "the file system takes no FALLOC_FL_ZERO_RANGE (tmpfs)",
        );
        return;
    }
    let c = f.run();
    if file {
        assert!(c[0].result.is_err(), "the zeroing's sync failed");
    }
    f.engine.flush(f.dev, 2).unwrap();
    let c = f.run();
    let want = f.flush_after_a_failed_sync();
    assert_eq!(c[0].result, want, "a later Flush");
}
per_backend!(a_fua_zeroings_failed_sync_fails_every_later_flush);

/// Reaps `e` until `got` holds a completion or one waits parked for other engines' syncs.
fn reap_until_done_or_parked(e: &mut Engine, got: &mut Vec<Completion>) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while got.is_empty() && e.parked_ops() == 0 {
        assert!(std::time::Instant::now() < deadline, "never completed");
        e.wait(0).unwrap();
        e.reap(|c| got.push(c));
    }
}

/// A FUA operation whose pages go through the page cache (a FUA write without direct I/O;
/// a FUA zeroing, whose partial blocks are zeroed there) may lose its data to a failed
/// writeback whose report another engine's sync takes (Linux reports it once, to the first
/// sync of the file that asks) while its own sync succeeds: it was answered success. It
/// waits for the syncs begun before it ended, as a Flush does, and fails when one failed
/// since it started. A direct FUA write's data reaches the device by itself: it succeeds.
fn a_fua_operation_beside_a_sync_taking_the_writeback_error_fails(mut f: Fixture) {
    let file = matches!(f.device.info().kind, Kind::File | Kind::Bdev);
    let direct = f.device.info().direct;
    for zeroing in [false, true] {
        let mut other = Engine::new(8, 1, std::slice::from_ref(&f.pool)).unwrap();
        let d = other.attach(&f.device).unwrap();
        // The other engine's Flush begins first; ours is settled first, the Flush second,
        // and the Flush's sync takes the failure.
        f.device.fail_sync(1, libc::EIO);
        other.flush(d, 2).unwrap();
        other.submit().unwrap();
        let queued = if zeroing {
            f.engine.write_zeroes(f.dev, 0, 4096, true, 1)
        } else {
            let mut b = f.buf(4096);
            b.as_mut_slice().copy_from_slice(&pattern(11, 4096));
            f.engine.write(f.dev, 0, b, true, 1)
        };
        if let Err(r) = queued {
            // (A file system without ZERO_RANGE: tmpfs.)
            assert!(matches!(r.error, BlockError::Unsupported(_)), "{r:?}");
            skip(
                "a_fua_operation_beside_a_sync_taking_the_writeback_error_fails (its zeroing)",
                "the file system takes no FALLOC_FL_ZERO_RANGE (tmpfs)",
            );
            other.drain(drop).unwrap();
            continue;
        }
        let mut mine = Vec::new();
        reap_until_done_or_parked(&mut f.engine, &mut mine);
        let mut theirs = Vec::new();
        while theirs.is_empty() {
            other.wait(1).unwrap();
            other.reap(|c| theirs.push(c));
        }
        while mine.is_empty() {
            f.engine.wait(0).unwrap();
            f.engine.reap(|c| mine.push(c));
        }
        let lost = file && (zeroing || !direct);
        assert_eq!(
            mine[0].result.is_err(),
            lost,
            "zeroing {zeroing}, direct {direct}: {:?}",
            mine[0].result
        );
        if lost {
            assert_eq!(mine[0].result, Err(BlockError::Io(libc::EIO)));
        }
    }
}
per_backend!(a_fua_operation_beside_a_sync_taking_the_writeback_error_fails);

/// An engine drained (its data path let go of: a device removed, the daemon stopping) with
/// a Flush waiting for another engine's sync does not wait for it: that engine may be on the
/// same thread, which cannot reap it until the drain ends (the drain spun for ever). The
/// Flush fails: whether what it covered is durable is not known.
fn a_drain_does_not_wait_for_another_engines_sync(mut f: Fixture) {
    let mut other = Engine::new(8, 1, std::slice::from_ref(&f.pool)).unwrap();
    let d = other.attach(&f.device).unwrap();
    let mut b = f.buf(4096);
    b.as_mut_slice().copy_from_slice(&pattern(12, 4096));
    other.write(d, 4096, b, true, 2).unwrap();
    other.submit().unwrap();
    // The other engine's FUA write is never reaped: its sync stays in flight.
    f.engine.flush(f.dev, 1).unwrap();
    let mut mine = Vec::new();
    reap_until_done_or_parked(&mut f.engine, &mut mine);
    assert!(
        mine.is_empty(),
        "the Flush waits for the other engine's sync"
    );
    f.engine.drain(|c| mine.push(c)).unwrap();
    assert_eq!(mine.len(), 1);
    assert_eq!(mine[0].result, Err(BlockError::Io(libc::EIO)));
    other.drain(drop).unwrap();
}
per_backend!(a_drain_does_not_wait_for_another_engines_sync: file_512, file_4096, tmpfs_512,
    loop_bdev_512, loop_bdev_4096);

/// Linux reports a writeback error once, to the first sync of the file that asks, whichever
/// reactor's engine runs it: a Flush on another engine that succeeded beside the one taking
/// the report, and was settled first, succeeded (data lost). It waits for that one.
fn a_flush_on_another_engine_beside_one_taking_a_writeback_error_fails_too(mut f: Fixture) {
    f.write(0, &pattern(7, 4096), false);
    let mut other = Engine::new(8, 1, std::slice::from_ref(&f.pool)).unwrap();
    let d = other.attach(&f.device).unwrap();
    // The second sync to complete fails, whichever engine's it is.
    f.device.fail_sync(1, libc::EIO);
    f.engine.flush(f.dev, 1).unwrap();
    other.flush(d, 2).unwrap();
    let (mut mine, mut theirs) = (Vec::new(), Vec::new());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while mine.is_empty() || theirs.is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the Flushes never completed"
        );
        f.engine.wait(0).unwrap();
        f.engine.reap(|c| mine.push(c));
        other.wait(0).unwrap();
        other.reap(|c| theirs.push(c));
    }
    let want = f.flush_after_a_failed_sync();
    assert_eq!(mine[0].result, want, "this engine's Flush");
    assert_eq!(theirs[0].result, want, "the other engine's Flush");
}
per_backend!(a_flush_on_another_engine_beside_one_taking_a_writeback_error_fails_too);

/// An engine dropped when its ring fails (its drain cannot wait) with a Flush in flight
/// never sees that sync end: it may have taken a writeback error's report, so every later
/// Flush of the device fails; and it no longer counts as in flight, where every later Flush
/// of the device, on every engine, waited for it for ever.
fn a_flush_lost_with_a_failed_engine_fails_later_flushes_instead_of_holding_them(mut f: Fixture) {
    f.write(0, &pattern(9, 4096), false);
    let mut other = Engine::new(8, 1, std::slice::from_ref(&f.pool)).unwrap();
    let d = other.attach(&f.device).unwrap();
    other.flush(d, 2).unwrap();
    other.fail_next_wait(libc::EIO);
    drop(other);
    f.engine.flush(f.dev, 1).unwrap();
    let mut mine = Vec::new();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while mine.is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the Flush waited for a sync that will never be seen to end"
        );
        f.engine.wait(0).unwrap();
        f.engine.reap(|c| mine.push(c));
    }
    assert_eq!(mine[0].result, f.flush_after_a_failed_sync());
}
per_backend!(a_flush_lost_with_a_failed_engine_fails_later_flushes_instead_of_holding_them);

/// A Flush waits only for the syncs begun before it ended: with FUA writes always in flight
/// (a database writing O_DSYNC), it still completes (it waited for a moment when none was,
/// which may never come).
fn a_flush_completes_while_fua_writes_keep_coming(mut f: Fixture) {
    let data = pattern(8, 4096);
    let mut out = 0usize;
    for k in 0..4u64 {
        let mut b = f.buf(4096);
        b.as_mut_slice().copy_from_slice(&data);
        f.engine.write(f.dev, k * 4096, b, true, 100 + k).unwrap();
        out += 1;
    }
    f.engine.flush(f.dev, 1).unwrap();
    let mut flushed = None;
    let mut writes = 0;
    while flushed.is_none() {
        assert!(
            writes < 20_000,
            "the Flush never completed under FUA writes"
        );
        f.engine.wait(1).unwrap();
        let mut done = Vec::new();
        f.engine.reap(|c| done.push(c));
        for c in done {
            if c.tag == 1 {
                flushed = Some(c.result);
                continue;
            }
            assert_eq!(c.result, Ok(4096));
            writes += 1;
            out -= 1;
        }
        // Another FUA write for each that completed, before the next look.
        while out < 4 {
            let mut b = f.buf(4096);
            b.as_mut_slice().copy_from_slice(&data);
            f.engine
                .write(f.dev, (writes as u64 % 64) * 4096, b, true, 200)
                .unwrap();
            out += 1;
        }
    }
    assert_eq!(flushed, Some(Ok(0)));
    let mut rest = Vec::new();
    f.engine.drain(|c| rest.push(c)).unwrap();
}
per_backend!(a_flush_completes_while_fua_writes_keep_coming);

fn zeroes_and_deallocate_zero_only_their_range(mut f: Fixture) {
    let bs = f.device.info().logical_block_size as usize;
    let len = 64 * 1024;
    for (op, seed) in [("zeroes", 1), ("zeroes fua", 3), ("deallocate", 2)] {
        let supported = if op != "deallocate" {
            f.device.info().write_zeroes
        } else {
            f.device.info().deallocate
        };
        let base = seed * 1024 * 1024;
        let data = pattern(seed, len);
        f.write(base, &data, false);
        let (zo, zl) = (base + 8192, 4 * bs as u64);
        let r = if op != "deallocate" {
            f.engine.write_zeroes(f.dev, zo, zl, op == "zeroes fua", 5)
        } else {
            f.engine.deallocate(f.dev, zo, zl, 5)
        };
        if !supported {
            let e = r.unwrap_err();
            assert!(matches!(e.error, BlockError::Unsupported(_)), "{op}: {e:?}");
            eprintln!(
                "{op} unsupported on {:?}: refused as expected",
                f.device.info().kind
            );
            continue;
        }
        r.unwrap();
        let c = f.run();
        assert_eq!(c[0].result, Ok(0), "{op}");
        let got = f.read(base, len);
        let mut want = data.clone();
        want[8192..8192 + 4 * bs].fill(0);
        f.expect(&got, &want, op);
    }
}
per_backend!(zeroes_and_deallocate_zero_only_their_range);

/// A block device whose driver turned its write-zeroes off after it was opened (SCSI's,
/// once the device refused a WRITE SAME) refuses a punched hole with EOPNOTSUPP: the
/// deallocate zeroes the range instead (a host was told deallocated blocks read zeroes),
/// where it was refused as an unsupported operation (Invalid Opcode) for an opcode the
/// controller offers.
fn a_deallocate_the_device_refuses_zeroes_its_range_instead(mut f: Fixture) {
    let info = f.device.info();
    if !info.deallocate {
        return skip(
            "a_deallocate_the_device_refuses_zeroes_its_range_instead",
            "the file system or device offers no deallocate: nothing to refuse",
        );
    }
    let bs = info.logical_block_size as usize;
    let (base, len) = (1024 * 1024, 64 * 1024);
    let data = pattern(4, len);
    f.write(base, &data, false);
    f.device.fail_next_deallocates(1);
    f.engine
        .deallocate(f.dev, base + 8192, 4 * bs as u64, 5)
        .unwrap();
    let c = f.run();
    if !f.device.info().write_zeroes {
        assert!(
            matches!(c[0].result, Err(BlockError::Unsupported(_))),
            "{:?}",
            c[0]
        );
        return;
    }
    assert_eq!(c[0].result, Ok(0));
    let mut want = data.clone();
    want[8192..8192 + 4 * bs].fill(0);
    let got = f.read(base, len);
    f.expect(&got, &want, "refused deallocate");
}
per_backend!(a_deallocate_the_device_refuses_zeroes_its_range_instead: file_512, file_4096,
    tmpfs_512, loop_bdev_512, loop_bdev_4096);

/// A block device the system uses (mounted, an MD or LVM member) or another program opened
/// exclusively: opening it for writing is refused with the reason (hosts would corrupt its
/// user's data); read-only it is served with a warning. It was opened and served.
fn a_block_device_in_use_is_refused_for_writing(f: Fixture) {
    use std::os::unix::fs::OpenOptionsExt;
    let info = f.device.info();
    let path = info.path.clone().unwrap();
    let mut spec = DeviceSpec::new(Kind::Bdev);
    spec.path = Some(path.clone());
    // As a mount holds it.
    let held = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_EXCL)
        .open(&path)
        .unwrap();
    let e = Device::open(&spec).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::ResourceBusy, "{e}");
    let said = e.to_string();
    assert!(
        said.contains(&path.display().to_string()) && said.contains("in use by the system"),
        "{said}"
    );
    spec.read_only = true;
    let d = Device::open(&spec).unwrap();
    assert!(
        d.warning().is_some_and(|w| w.contains("in use")),
        "{:?}",
        d.warning()
    );
    drop(held);
    spec.read_only = false;
    let d = Device::open(&spec).unwrap();
    assert!(d.warning().is_none(), "{:?}", d.warning());
}
per_backend!(a_block_device_in_use_is_refused_for_writing: loop_bdev_512, loop_bdev_4096);

/// The most blocks one deallocate takes: a block device's write-zeroes limit (deallocate is a
/// hole punched through write zeroes), no limit elsewhere.
fn deallocate_limit_is_the_backends(f: Fixture) {
    let info = f.device.info();
    let want = match info.kind {
        Kind::Bdev if info.deallocate => {
            let path = info.path.as_ref().unwrap();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            let sys = format!("/sys/class/block/{name}/queue/write_zeroes_max_bytes");
            let bytes: u64 = std::fs::read_to_string(&sys)
                .unwrap()
                .trim()
                .parse()
                .unwrap();
            u32::try_from((bytes / u64::from(info.logical_block_size)).max(1)).unwrap_or(u32::MAX)
        }
        _ => 0,
    };
    assert_eq!(info.deallocate_max_blocks, want, "{:?}", info.kind);
}
per_backend!(deallocate_limit_is_the_backends);

fn misaligned_and_out_of_range_are_refused_with_the_buffer_back(mut f: Fixture) {
    let bs = u64::from(f.device.info().logical_block_size);
    let b = f.buf(bs as usize);
    let e = f.engine.read(f.dev, 100, b, 1).unwrap_err();
    assert!(
        matches!(e.error, BlockError::Misaligned { offset: 100, .. }),
        "{e:?}"
    );
    let mut b = e.buf.expect("buffer handed back");
    assert!(b.set_len(bs as usize + 1));
    let e = f.engine.write(f.dev, 0, b, false, 1).unwrap_err();
    assert!(matches!(e.error, BlockError::Misaligned { .. }), "{e:?}");
    let mut b = e.buf.unwrap();
    b.set_len(2 * bs as usize);
    let e = f.engine.read(f.dev, SIZE - bs, b, 1).unwrap_err();
    assert!(matches!(e.error, BlockError::OutOfRange { .. }), "{e:?}");
    let b = e.buf.unwrap();
    let e = f.engine.read(f.dev, u64::MAX - bs + 1, b, 1).unwrap_err();
    assert!(
        matches!(e.error, BlockError::OutOfRange { .. }),
        "overflow: {e:?}"
    );
    drop(e);
    let e = f
        .engine
        .write_zeroes(f.dev, SIZE, bs, false, 1)
        .unwrap_err();
    assert!(
        matches!(
            e.error,
            BlockError::OutOfRange { .. } | BlockError::Unsupported(_)
        ),
        "{e:?}"
    );
    let e = f.engine.read(f.dev, 0, f.buf(0), 1).unwrap_err();
    assert!(
        matches!(e.error, BlockError::Misaligned { len: 0, .. }),
        "zero length: {e:?}"
    );
    let e = f.engine.read(DevId(3), 0, e.buf.unwrap(), 1).unwrap_err();
    assert_eq!(e.error, BlockError::UnknownDevice);
    drop(e);
    assert_eq!(f.engine.in_flight(), 0);
    assert_eq!(f.pool.free_count(), f.pool.count());
}
per_backend!(misaligned_and_out_of_range_are_refused_with_the_buffer_back);

fn a_full_queue_is_backpressure(f: Fixture) {
    let Fixture { pool, device, .. } = f;
    let mut engine = Engine::new(4, 1, std::slice::from_ref(&pool)).unwrap();
    let dev = engine.attach(&device).unwrap();
    let take = || {
        let mut b = pool.take().unwrap();
        b.set_len(4096);
        b
    };
    for i in 0..4 {
        engine.read(dev, i * 4096, take(), i).unwrap();
    }
    let e = engine.read(dev, 0, take(), 99).unwrap_err();
    assert!(e.error.is_backpressure(), "{e:?}");
    assert!(e.buf.is_some());
    drop(e);
    let mut done = Vec::new();
    engine.drain(|c| done.push(c.tag)).unwrap();
    done.sort_unstable();
    assert_eq!(done, [0, 1, 2, 3]);
    engine.read(dev, 0, take(), 5).unwrap();
    engine.drain(drop).unwrap();
    assert_eq!(pool.free_count(), pool.count());
}
per_backend!(a_full_queue_is_backpressure);

/// A new engine on `f`'s device with `n` writes of `len` bytes submitted (tags 0 to n - 1).
fn writes_in_flight(f: &Fixture, n: u64, len: usize) -> Engine {
    let mut engine = Engine::new(32, 1, std::slice::from_ref(&f.pool)).unwrap();
    let dev = engine.attach(&f.device).unwrap();
    for i in 0..n {
        let mut b = f.pool.take().unwrap();
        b.set_len(len);
        engine.write(dev, i * len as u64, b, false, i).unwrap();
    }
    engine.submit().unwrap();
    engine
}

fn dropping_the_engine_waits_for_operations_in_flight(f: Fixture) {
    let engine = writes_in_flight(&f, 16, 128 * 1024);
    let pool = f.pool.clone();
    drop(engine);
    assert_eq!(
        pool.free_count(),
        pool.count(),
        "buffers come back only after their I/O"
    );
}
per_backend!(dropping_the_engine_waits_for_operations_in_flight);

fn a_drain_waits_through_a_busy_kernel(f: Fixture) {
    let mut engine = writes_in_flight(&f, 8, 64 * 1024);
    let pool = f.pool.clone();
    // io_uring_enter answers busy twice: a drain that gave up here left writes with the
    // kernel whose memory its caller would then free.
    engine.fail_next_wait(libc::EAGAIN);
    engine.fail_next_wait(libc::EBUSY);
    let mut done = Vec::new();
    engine.drain(|c| done.push(c)).unwrap();
    assert_eq!(done.len(), 8);
    assert!(done.iter().all(|c| c.result == Ok(64 * 1024)), "{done:?}");
    drop(done);
    assert_eq!(pool.free_count(), pool.count());
}
per_backend!(a_drain_waits_through_a_busy_kernel);

/// Not on the loop device: the fixture opens it read-write (files cover read-only).
fn read_only_devices_refuse_writes(f: Fixture) {
    let mut spec = f.spec.clone();
    spec.read_only = true;
    let ro = Device::open(&spec).unwrap();
    let mut engine = Engine::new(4, 1, std::slice::from_ref(&f.pool)).unwrap();
    let dev = engine.attach(&ro).unwrap();
    let mut b = f.pool.take().unwrap();
    b.set_len(4096);
    let e = engine.write(dev, 0, b, false, 1).unwrap_err();
    assert_eq!(e.error, BlockError::ReadOnly);
    let e = engine.read(dev, 0, e.buf.unwrap(), 1);
    assert!(e.is_ok(), "reads still work");
    engine.drain(drop).unwrap();
}
per_backend!(read_only_devices_refuse_writes: file_512, file_4096, tmpfs_512, malloc_512,
    malloc_4096, null_512, rbd_512, rbd_4096);

#[test]
fn o_direct_refusal_falls_back_to_buffered_io_and_says_why() {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let mut spec = DeviceSpec::new(Kind::File);
    spec.path = Some(make_file(dir.path()));
    let refuse_direct = |path: &Path, opts: &std::fs::OpenOptions| {
        // Stand in for a file system without O_DIRECT: the open with it fails with EINVAL.
        let probe = opts.clone().custom_flags_probe();
        if probe {
            Err(std::io::Error::from_raw_os_error(libc::EINVAL))
        } else {
            opts.open(path)
        }
    };
    let dev = Device::open_with(&spec, &refuse_direct).unwrap();
    assert!(!dev.info().direct);
    assert!(
        dev.warning().unwrap().contains("refuses O_DIRECT"),
        "{:?}",
        dev.warning()
    );
    let d = Device::open(&spec).unwrap();
    assert!(d.info().direct, "ext4 takes O_DIRECT");
    assert!(d.warning().is_none());
}

/// `OpenOptions` does not expose its flags; the test opener marks direct opens itself.
trait ProbeDirect {
    fn custom_flags_probe(self) -> bool;
}
impl ProbeDirect for std::fs::OpenOptions {
    fn custom_flags_probe(self) -> bool {
        format!("{self:?}").contains(&format!("custom_flags: {}", libc::O_DIRECT))
    }
}

/// A shrink's fence waits for the reads past the new end let through before it, as for the
/// writes: cut under one (librbd deletes an image's tail object by object), a read returned
/// zeroes as data, or a file's a short transfer. It was not waited for.
/// Not on a block device (it has its own size) nor null (it stores nothing).
fn a_shrink_waits_for_the_reads_past_its_end_let_through_before_it(mut f: Fixture) {
    let kind = f.device.info().kind;
    let half = SIZE / 2;
    let len = 8192;
    let at = half + 8192;
    let data = pattern(9, len);
    f.write(at, &data, false);
    let b = f.buf(len);
    f.engine.read(f.dev, at, b, 1).unwrap();
    // RAM reads as it queues (done, no longer in flight); the others later.
    assert_eq!(
        f.engine.io_past(&f.device, half),
        kind != Kind::Malloc,
        "a read past the new end in flight"
    );
    let (engine, pool) = (&mut f.engine, &f.pool);
    let mut done = Vec::new();
    f.device
        .resize_fenced(Some(half), || {
            let late = pool.take().unwrap();
            let refused = engine.read(f.dev, at, late, 2).unwrap_err();
            assert!(
                matches!(refused.error, BlockError::OutOfRange { .. }),
                "{refused:?}"
            );
            engine.drain(|c| done.push(c))?;
            assert!(!engine.io_past(&f.device, half));
            Ok(())
        })
        .unwrap();
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].result, Ok(len as u32));
    let got = done.pop().unwrap().buf.unwrap();
    f.expect(&got.as_slice()[..len], &data, "read before the cut");
}
per_backend!(a_shrink_waits_for_the_reads_past_its_end_let_through_before_it: file_512, file_4096,
    tmpfs_512, malloc_512, malloc_4096, rbd_512, rbd_4096);

/// A shrink stores the new capacity first (a write past it is refused from then on), waits in
/// its fence for the writes past it let through before, and only then cuts the backend: a
/// write queued before the shrink, which runs in the fence, cannot extend a file past its new
/// end, and a grow afterwards reads zeroes past the old end (a RAM device's tail is zeroed as
/// a file's is cut).
/// Not on a block device (it has its own size) nor null (it stores nothing).
fn a_shrink_cuts_after_the_writes_let_through_before_it(mut f: Fixture) {
    let kind = f.device.info().kind;
    let half = SIZE / 2;
    let len = 8192;
    let at = half + 8192;
    let data = pattern(7, len);
    let mut b = f.buf(len);
    b.as_mut_slice().copy_from_slice(&data);
    f.engine.write(f.dev, at, b, false, 1).unwrap();
    // RAM writes as it queues (what is done is no longer in flight); the others later.
    assert_eq!(f.engine.io_past(&f.device, half), kind != Kind::Malloc);
    assert!(!f.engine.io_past(&f.device, at + len as u64), "ends there");
    let (engine, pool) = (&mut f.engine, &f.pool);
    let mut done = Vec::new();
    f.device
        .resize_fenced(Some(half), || {
            // Past the new end: refused now, while the write let through before runs.
            let mut late = pool.take().unwrap();
            assert!(late.set_len(len));
            let refused = engine.write(f.dev, at, late, false, 2).unwrap_err();
            assert!(
                matches!(refused.error, BlockError::OutOfRange { .. }),
                "{refused:?}"
            );
            engine.drain(|c| done.push(c))?;
            assert!(!engine.io_past(&f.device, half));
            Ok(())
        })
        .unwrap();
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].result, Ok(len as u32));
    assert_eq!(f.device.size(), half);
    if kind == Kind::File {
        let path = f.spec.path.clone().unwrap();
        assert_eq!(
            std::fs::metadata(&path).unwrap().len(),
            half,
            "cut after the write"
        );
    }
    f.device.resize(Some(SIZE)).unwrap();
    let got = f.read(at, len);
    assert!(got.iter().all(|&x| x == 0), "the regrown tail reads zeroes");
    drop(done);
    assert_eq!(
        f.pool.free_count(),
        f.pool.count(),
        "every buffer came back"
    );
}
per_backend!(a_shrink_cuts_after_the_writes_let_through_before_it: file_512, file_4096,
    tmpfs_512, malloc_512, malloc_4096, rbd_512, rbd_4096);

#[test]
fn a_file_that_shrinks_under_the_engine_gives_a_short_transfer() {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let path = make_file(dir.path());
    let mut spec = DeviceSpec::new(Kind::File);
    spec.path = Some(path.clone());
    let dev = Device::open(&spec).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(4096)
        .unwrap();
    let pool = BufPool::new(1, 8192, false).unwrap();
    let mut engine = Engine::new(4, 1, std::slice::from_ref(&pool)).unwrap();
    let id = engine.attach(&dev).unwrap();
    let b = pool.take().unwrap();
    engine.read(id, 1 << 20, b, 1).unwrap();
    let mut out = Vec::new();
    engine.drain(|c| out.push(c)).unwrap();
    assert_eq!(
        out[0].result,
        Err(BlockError::ShortTransfer {
            expected: 8192,
            done: 0
        })
    );
    // Half of the buffer past the new end: the first half arrives, then the end.
    let b = out.pop().unwrap().buf.unwrap();
    engine.read(id, 0, b, 2).unwrap();
    engine.drain(|c| out.push(c)).unwrap();
    assert_eq!(
        out[0].result,
        Err(BlockError::ShortTransfer {
            expected: 8192,
            done: 4096
        })
    );
}

#[test]
fn opening_checks_kind_and_geometry() {
    let mut s = DeviceSpec::new(Kind::Malloc);
    s.size = 1000;
    assert!(Device::open(&s)
        .unwrap_err()
        .to_string()
        .contains("not a non-zero number of 512-byte blocks"));
    let mut s = DeviceSpec::new(Kind::Bdev);
    s.path = Some("/etc/hostname".into());
    assert!(Device::open(&s)
        .unwrap_err()
        .to_string()
        .contains("not a block device"));
    let mut s = DeviceSpec::new(Kind::File);
    s.path = Some("/nonexistent/disk.img".into());
    assert!(Device::open(&s)
        .unwrap_err()
        .to_string()
        .contains("/nonexistent/disk.img: cannot open"));
    let mut s = DeviceSpec::new(Kind::Null);
    s.size = 4096;
    s.block_size = 1024;
    assert!(Device::open(&s)
        .unwrap_err()
        .to_string()
        .contains("not 512 or 4096"));
}

/// A file whose length is not a whole number of blocks: what lies past its last whole block
/// is not the namespace's, but it is the user's, and opening leaves it as it was (the probe
/// of the file system's fallocate modes once zeroed it and punched it out).
#[test]
fn opening_a_file_leaves_its_bytes_past_the_last_whole_block_alone() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("odd.img");
    std::fs::write(&path, vec![0xFFu8; 1000]).unwrap();
    let mut s = DeviceSpec::new(Kind::File);
    s.path = Some(path.clone());
    s.block_size = 512;
    let d = Device::open(&s).unwrap();
    assert_eq!(d.size(), 512);
    drop(d);
    let after = std::fs::read(&path).unwrap();
    assert_eq!(after.len(), 1000);
    assert!(after.iter().all(|&b| b == 0xFF), "the file's bytes changed");
}

#[cfg(feature = "rbd")]
fn rbd_spec(conf: PathBuf, pool: &str, image: &str, create: bool) -> DeviceSpec {
    let mut s = DeviceSpec::new(Kind::Rbd);
    s.size = SIZE;
    s.rbd = Some(nvmfd_blockdev::RbdSpec {
        pool: pool.into(),
        image: image.into(),
        namespace: None,
        ceph_conf: conf,
        client_id: "admin".into(),
        create,
    });
    s
}

/// A handle that takes its image to end earlier than it does (one that missed a growth made
/// through another handle: librbd cuts what it is asked at that end and answers success)
/// answers a write, a zeroing and a deallocate reaching past that end as cut short, and
/// those before it as done. The zeroing and the deallocate were answered done whatever the
/// handle's end, the blocks past it left as they were.
#[cfg(feature = "rbd")]
#[test]
fn an_rbd_handle_behind_a_growth_answers_what_reaches_past_its_end_as_cut_short() {
    let _closed = RbdClosesAwaited;
    let Some(mut f) = fixture("rbd", 512) else {
        return;
    };
    let end = SIZE - 8192;
    f.engine.rbd_handle_sees_size(f.dev, end);
    let cut = |done| {
        Err(BlockError::ShortTransfer {
            expected: 16384,
            done,
        })
    };
    let b = f.buf(16384);
    f.engine.write(f.dev, end - 8192, b, false, 1).unwrap();
    f.engine
        .write_zeroes(f.dev, end - 8192, 16384, false, 2)
        .unwrap();
    f.engine
        .write_zeroes(f.dev, end - 8192, 16384, true, 3)
        .unwrap();
    f.engine.deallocate(f.dev, end - 8192, 16384, 4).unwrap();
    let mut c = f.run();
    c.sort_by_key(|c| c.tag);
    let got: Vec<_> = c.iter().map(|c| (c.tag, c.result.clone())).collect();
    assert_eq!(
        got,
        [
            (1, cut(8192)),
            (2, cut(8192)),
            (3, cut(8192)),
            (4, cut(8192))
        ]
    );
    // Wholly before the handle's end: done.
    f.engine
        .write_zeroes(f.dev, end - 16384, 16384, false, 5)
        .unwrap();
    f.engine.deallocate(f.dev, end - 16384, 16384, 6).unwrap();
    let c = f.run();
    assert!(c.iter().all(|c| c.result == Ok(0)), "{c:?}");
}

/// A missing image, a missing pool and a cluster nobody answers for are refused at open, each
/// with an error that names it.
#[cfg(feature = "rbd")]
#[test]
fn rbd_open_errors_name_the_image_the_pool_and_the_cluster() {
    let _closed = RbdClosesAwaited;
    let conf = match ceph_cluster() {
        Ok(c) => c,
        Err(why) => return skip("rbd open errors", &why),
    };
    let name = image_name();
    let e = Device::open(&rbd_spec(conf.clone(), "rbd", &name, false)).unwrap_err();
    assert!(
        e.to_string().contains(&format!("image `rbd/{name}`"))
            && e.kind() == std::io::ErrorKind::NotFound,
        "{e}"
    );
    let e = Device::open(&rbd_spec(conf.clone(), "nopool", &name, true)).unwrap_err();
    assert!(e.to_string().contains("pool `nopool`"), "{e}");
    // Created on demand, then opened as it is (its size, not the spec's).
    let d = Device::open(&rbd_spec(conf.clone(), "rbd", &name, true)).unwrap();
    assert_eq!(d.info().size, SIZE);
    let mut again = rbd_spec(conf, "rbd", &name, true);
    again.size = 2 * SIZE;
    assert_eq!(Device::open(&again).unwrap().info().size, SIZE);
    // A cluster whose monitor nobody serves: refused within the mount timeout.
    let dir = tempfile::tempdir().unwrap();
    let dead = dir.path().join("ceph.conf");
    std::fs::write(
        &dead,
        "[global]\nmon_host = 127.0.0.1:9\nauth_client_required = none\n",
    )
    .unwrap();
    let t = std::time::Instant::now();
    let e = Device::open(&rbd_spec(dead, "rbd", &name, false)).unwrap_err();
    assert!(e.to_string().contains("connecting to the cluster"), "{e}");
    assert!(
        t.elapsed() < std::time::Duration::from_secs(30),
        "{:?}",
        t.elapsed()
    );
}

/// Two reactors' engines on one RAM device: every block a read brings back while the other
/// engine writes it is whole, one write's or another's (AWUN 0 promises that one block is
/// written atomically), for each block of a multi-block command, at both block sizes. The
/// engines once copied into the shared mapping without a lock, and a read could see a mix.
#[test]
fn ram_blocks_are_read_and_written_whole_across_engines() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    const BLOCKS: usize = 16;
    const READS: u64 = 20_000;
    for bs in [512usize, 4096] {
        let mut s = DeviceSpec::new(Kind::Malloc);
        s.size = SIZE;
        s.block_size = bs as u32;
        let device = Device::open(&s).unwrap();
        let len = BLOCKS * bs;
        // The writer writes until the reader has read `READS` times.
        let reads = Arc::new(AtomicU64::new(0));
        let done = Arc::new(AtomicBool::new(false));
        let writer = {
            let (device, reads, done) =
                (Arc::clone(&device), Arc::clone(&reads), Arc::clone(&done));
            std::thread::spawn(move || {
                let pool = BufPool::new(4, len, false).unwrap();
                let mut engine = Engine::new(8, 4, std::slice::from_ref(&pool)).unwrap();
                let dev = engine.attach(&device).unwrap();
                let mut writes = 0u64;
                while reads.load(Ordering::Relaxed) < READS {
                    let mut b = pool.take().unwrap();
                    assert!(b.set_len(len));
                    // Each block one byte value, a different one in each block and write.
                    for (k, block) in b.as_mut_slice().chunks_mut(bs).enumerate() {
                        block.fill((writes as usize * BLOCKS + k) as u8 | 1);
                    }
                    engine.write(dev, 0, b, false, 1).unwrap();
                    engine
                        .drain(|c| assert_eq!(c.result, Ok(len as u32)))
                        .unwrap();
                    writes += 1;
                }
                done.store(true, Ordering::Release);
                writes
            })
        };
        let pool = BufPool::new(4, len, false).unwrap();
        let mut engine = Engine::new(8, 4, std::slice::from_ref(&pool)).unwrap();
        let dev = engine.attach(&device).unwrap();
        let mut torn = 0u64;
        let start = std::time::Instant::now();
        while !done.load(Ordering::Acquire) {
            let mut b = pool.take().unwrap();
            assert!(b.set_len(len));
            engine.read(dev, 0, b, 2).unwrap();
            let mut back = None;
            engine.drain(|c| back = Some(c)).unwrap();
            let c = back.unwrap();
            assert_eq!(c.result, Ok(len as u32));
            let b = c.buf.unwrap();
            torn += b
                .as_slice()
                .chunks(bs)
                // Whole when every byte equals the next (a memcmp, quick without optimization).
                .filter(|block| block[1..] != block[..block.len() - 1])
                .count() as u64;
            reads.fetch_add(1, Ordering::Relaxed);
        }
        let writes = writer.join().unwrap();
        let reads = reads.load(Ordering::Relaxed);
        eprintln!(
            "{bs}-byte blocks: {reads} reads during {writes} writes in {:?}, {torn} torn blocks",
            start.elapsed()
        );
        assert_eq!(
            torn, 0,
            "{bs}-byte blocks: {torn} blocks read torn in {reads} reads"
        );
    }
}

/// A FUA Write Zeroes is durable when it completes: on a loop device, whose statistics count
/// the flushes it receives, it sends one after zeroing; one without FUA sends none. The FUA
/// bit was once dropped, and the zeroes stayed in the backing file's page cache.
#[test]
fn write_zeroes_with_fua_flushes_the_device() {
    let Some(mut f) = fixture("loop", 4096) else {
        return;
    };
    let name = f
        .spec
        .path
        .as_ref()
        .and_then(|p| p.file_name())
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap();
    let stat = format!("/sys/block/{name}/stat");
    // Field 16 of the block statistics (kernel 5.5 and later): flush requests completed.
    let flushes = || -> Option<u64> {
        std::fs::read_to_string(&stat)
            .ok()?
            .split_whitespace()
            .nth(15)?
            .parse()
            .ok()
    };
    if flushes().is_none() {
        skip(
            "write_zeroes_with_fua_flushes_the_device",
            &format!("{stat} does not count flushes"),
        );
        return;
    }
    let mut zero = |fua: bool| {
        let before = flushes().unwrap();
        f.engine
            .write_zeroes(f.dev, 64 * 4096, 4 * 4096, fua, 7)
            .unwrap();
        let c = f.run();
        assert_eq!((c[0].tag, &c[0].result), (7, &Ok(0)));
        flushes().unwrap() - before
    };
    assert_eq!(zero(false), 0, "a plain Write Zeroes flushed");
    assert!(
        zero(true) >= 1,
        "a FUA Write Zeroes completed without a flush"
    );
}

/// RBD handles opened ahead (on the control side, off the reactors) are the ones engines take
/// when they attach the image; an engine that finds none opens its own; I/O works through
/// either.
#[cfg(feature = "rbd")]
#[test]
fn rbd_handles_opened_ahead_are_taken_by_the_engines_that_attach() {
    let _closed = RbdClosesAwaited;
    let Some(f) = fixture("rbd", 512) else {
        return;
    };
    assert_eq!(f.device.prepare_handles(2), 2);
    assert_eq!(f.device.handles_ready(), 2);
    let pool = BufPool::new(4, 4096, false).unwrap();
    let mut engines: Vec<(Engine, DevId)> = (0..3)
        .map(|i| {
            let mut e = Engine::new(8, 4, std::slice::from_ref(&pool)).unwrap();
            let id = e.attach(&f.device).unwrap();
            assert_eq!(f.device.handles_ready(), 1usize.saturating_sub(i));
            (e, id)
        })
        .collect();
    for (i, (e, id)) in engines.iter_mut().enumerate() {
        let data = pattern(300 + i as u64, 4096);
        let mut b = pool.take().unwrap();
        assert!(b.set_len(4096));
        b.as_mut_slice().copy_from_slice(&data);
        e.write(*id, 4096 * i as u64, b, false, 1).unwrap();
        e.drain(|c| assert_eq!(c.result, Ok(4096))).unwrap();
        let mut b = pool.take().unwrap();
        assert!(b.set_len(4096));
        e.read(*id, 4096 * i as u64, b, 2).unwrap();
        let mut back = None;
        e.drain(|c| back = c.buf).unwrap();
        assert!(back.unwrap().as_slice() == &data[..], "engine {i}");
    }
}

/// io_uring refuses a fixed buffer over 1 GiB: a pool that large (256 buffers of the largest
/// I/O size, 8 MiB) is left unregistered and still serves I/O.
fn a_pool_too_large_to_register_still_serves_io(f: Fixture) {
    let Fixture {
        pool,
        device,
        stores,
        ..
    } = f;
    let big = BufPool::new(129, 8 << 20, false).unwrap();
    let mut engine =
        Engine::new(8, 1, &[pool.clone(), big.clone()]).expect("an engine with a pool over 1 GiB");
    let dev = engine.attach(&device).unwrap();
    let mut b = big.take().unwrap();
    assert!(b.set_len(8192));
    b.as_mut_slice().fill(0x5a);
    engine.write(dev, 4096, b, false, 1).unwrap();
    let mut done = Vec::new();
    engine.drain(|c| done.push(c)).unwrap();
    let mut b = big.take().unwrap();
    assert!(b.set_len(8192));
    engine.read(dev, 4096, b, 2).unwrap();
    engine.drain(|c| done.push(c)).unwrap();
    assert_eq!(done.len(), 2);
    assert_eq!(done[0].result, Ok(8192));
    assert_eq!(done[1].result, Ok(8192));
    let got = done[1].buf.as_ref().unwrap().as_slice();
    let want = if stores { 0x5a } else { 0 };
    assert!(got.iter().all(|&x| x == want), "read back what was written");
}
per_backend!(a_pool_too_large_to_register_still_serves_io);
