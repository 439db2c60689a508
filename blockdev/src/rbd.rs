//! Ceph RBD images through librbd: a cluster connection per process and configuration, shared
//! by every image opened through it; an image handle per engine, whose asynchronous
//! operations complete into librbd's event queue for that handle and raise the engine's
//! eventfd (`rbd_set_image_notification`), so the reactor that issued them polls them in
//! (`rbd_poll_io_events`) without a callback on librbd's threads and without blocking.
//!
//! librbd's cache is turned off on the connection: a write librbd acknowledges is on the
//! OSDs, so FUA needs nothing more and flush has nothing to write back (the device reports
//! no volatile cache).

use std::ffi::{c_char, c_void, CString};
use std::io;
use std::os::fd::RawFd;
use std::path::{Path, PathBuf};

use crate::device::RbdSpec;
use std::ptr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

/// librados, loaded at the first use.
#[allow(
    non_camel_case_types,
    non_upper_case_globals,
    non_snake_case,
    dead_code,
    missing_debug_implementations,
    unsafe_op_in_unsafe_fn,
    clippy::all,
    clippy::undocumented_unsafe_blocks,
    clippy::missing_safety_doc
)]
mod rados_ffi {
    include!(concat!(env!("OUT_DIR"), "/rados_bindings.rs"));
}

/// librbd, loaded at the first use.
#[allow(
    non_camel_case_types,
    non_upper_case_globals,
    non_snake_case,
    dead_code,
    missing_debug_implementations,
    unsafe_op_in_unsafe_fn,
    clippy::all,
    clippy::undocumented_unsafe_blocks,
    clippy::missing_safety_doc
)]
mod ffi {
    include!(concat!(env!("OUT_DIR"), "/rbd_bindings.rs"));
}

/// The two libraries.
struct Libs {
    rados: rados_ffi::Rados,
    rbd: ffi::Rbd,
}

static LIBS: std::sync::OnceLock<Result<Libs, String>> = std::sync::OnceLock::new();

/// The libraries, once [`libs`] has loaded them: every handle of this module exists only
/// after a successful [`connect`], which loads them first.
fn lib() -> &'static Libs {
    match LIBS.get() {
        Some(Ok(l)) => l,
        _ => unreachable!("librados and librbd are loaded before any handle exists"),
    }
}

/// librados and librbd, loaded once; an error says which is missing.
fn libs() -> io::Result<&'static Libs> {
    let loaded = LIBS.get_or_init(|| {
        let missing = |lib: &str, e: libloading::Error| {
            format!("{lib} cannot be loaded ({e}): install librbd1 (it brings librados2)")
        };
        // SAFETY: loading the system's Ceph client libraries runs their initialisers, which
        // have no preconditions; the symbols are checked against the generated signatures by
        // name only, which is what linking against them would do too.
        unsafe {
            let rados =
                rados_ffi::Rados::new("librados.so.2").map_err(|e| missing("librados.so.2", e))?;
            let rbd = ffi::Rbd::new("librbd.so.1").map_err(|e| missing("librbd.so.1", e))?;
            Ok(Libs { rados, rbd })
        }
    });
    loaded
        .as_ref()
        .map_err(|e| io::Error::new(io::ErrorKind::Unsupported, e.clone()))
}

fn err(op: &str, rc: i32) -> io::Error {
    let e = io::Error::from_raw_os_error(rc.saturating_abs());
    io::Error::new(e.kind(), format!("{op}: {e}"))
}

fn cstr(what: &str, s: &str) -> io::Result<CString> {
    CString::new(s).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{what} `{s}` holds a NUL byte"),
        )
    })
}

/// A connection to a cluster (`rados_t`), shut down when the last user goes.
struct Cluster(rados_ffi::rados_t);

// SAFETY: librados handles are thread-safe (its documentation: "all functions are
// thread-safe" unless noted); the handle is only shut down in `Drop`, once.
unsafe impl Send for Cluster {}
// SAFETY: as for `Send`.
unsafe impl Sync for Cluster {}

impl Drop for Cluster {
    fn drop(&mut self) {
        // SAFETY: the handle was made by `rados_create` (connected, or not if reading the
        // configuration or connecting failed: shutting down an unconnected handle is
        // allowed), and nothing uses it any more (every pool and image holds an `Arc` of it).
        unsafe { lib().rados.rados_shutdown(self.0) };
    }
}

/// A connection's configuration file and user.
type ClusterKey = (PathBuf, String);

/// A connection's slot: the connection (`Weak`, so that the last image closed shuts it
/// down), and the last failure to connect, with when it ended.
#[derive(Default)]
struct ClusterSlot {
    cluster: Weak<Cluster>,
    failed: Option<(std::time::Instant, io::ErrorKind, String)>,
}

/// Connections by configuration file and user: one per process. Each key has its own lock,
/// held while connecting (which can take `client_mount_timeout`): opens on other clusters go
/// on meanwhile, and opens on the same one wait and share the result.
static CLUSTERS: Mutex<Vec<(ClusterKey, Arc<Mutex<ClusterSlot>>)>> = Mutex::new(Vec::new());

/// How long a failure to connect answers the opens that waited for it, instead of each
/// trying (and waiting) again.
const CONNECT_FAILURE_SHARED: std::time::Duration = std::time::Duration::from_secs(2);

fn connect(conf: &Path, client: &str) -> io::Result<Arc<Cluster>> {
    libs()?;
    let key = (conf.to_owned(), client.to_owned());
    let slot = {
        let mut all = CLUSTERS.lock().unwrap_or_else(|e| e.into_inner());
        match all.iter().find(|(k, _)| *k == key) {
            Some((_, s)) => Arc::clone(s),
            None => {
                let s = Arc::new(Mutex::new(ClusterSlot::default()));
                all.push((key, Arc::clone(&s)));
                s
            }
        }
    };
    let mut slot = slot.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(c) = slot.cluster.upgrade() {
        return Ok(c);
    }
    if let Some((at, kind, msg)) = &slot.failed {
        if at.elapsed() < CONNECT_FAILURE_SHARED {
            return Err(io::Error::new(*kind, msg.clone()));
        }
    }
    let connected = connect_new(conf, client);
    match &connected {
        Ok(c) => {
            slot.cluster = Arc::downgrade(c);
            slot.failed = None;
        }
        Err(e) => {
            slot.failed = Some((std::time::Instant::now(), e.kind(), e.to_string()));
        }
    }
    connected
}

/// A new connection to the cluster of `conf`, as `client`.
fn connect_new(conf: &Path, client: &str) -> io::Result<Arc<Cluster>> {
    let id = cstr("client_id", client)?;
    let path = cstr("ceph_conf", &conf.to_string_lossy())?;
    let mut h: rados_ffi::rados_t = ptr::null_mut();
    // SAFETY: `h` receives a new handle; `id` is a NUL-terminated string that outlives the call.
    let rc = unsafe { lib().rados.rados_create(&mut h, id.as_ptr()) };
    if rc < 0 {
        return Err(err("rados_create", rc));
    }
    let cluster = Cluster(h);
    // SAFETY: `h` is a created, unconnected handle; the strings are NUL-terminated.
    let rc = unsafe { lib().rados.rados_conf_read_file(h, path.as_ptr()) };
    if rc < 0 {
        return Err(err(&format!("reading {}", conf.display()), rc));
    }
    // What an acknowledged write means, whatever the file says: no write-back cache.
    conf_set(h, c"rbd_cache", c"false")?;
    // Give up on an unreachable cluster in seconds, at start and per operation, unless the
    // file sets these itself (Ceph's defaults: 300 s, and no timeout). An operation's error
    // must reach the host before the host gives up on the command (Linux's `io_timeout`:
    // 30 s) and resets the controller: librbd may run two OSD operations one after the other
    // for one write (a header refresh, then the write), each with this timeout.
    for (k, ceph_default, v) in [
        (c"client_mount_timeout", "300", c"10"),
        (c"rados_mon_op_timeout", "0", c"10"),
        (c"rados_osd_op_timeout", "0", c"10"),
    ] {
        if conf_get(h, k).is_some_and(|now| now == ceph_default) {
            conf_set(h, k, v)?;
        }
    }
    // SAFETY: a configured handle; blocks until connected or `client_mount_timeout`.
    let rc = unsafe { lib().rados.rados_connect(h) };
    if rc < 0 {
        return Err(err(
            &format!(
                "connecting to the cluster of {} as client.{client}",
                conf.display()
            ),
            rc,
        ));
    }
    Ok(Arc::new(cluster))
}

fn conf_set(h: rados_ffi::rados_t, k: &std::ffi::CStr, v: &std::ffi::CStr) -> io::Result<()> {
    // SAFETY: a created, unconnected handle; NUL-terminated strings; unknown options are
    // refused with an error.
    let rc = unsafe { lib().rados.rados_conf_set(h, k.as_ptr(), v.as_ptr()) };
    if rc < 0 {
        return Err(err(&format!("setting {}", k.to_string_lossy()), rc));
    }
    Ok(())
}

/// An option's value as the handle has it (file read), if it can be read.
fn conf_get(h: rados_ffi::rados_t, k: &std::ffi::CStr) -> Option<String> {
    let mut buf = [0u8; 64];
    // SAFETY: a created handle; `buf` is writable for its length, which is passed.
    let rc = unsafe {
        lib()
            .rados
            .rados_conf_get(h, k.as_ptr(), buf.as_mut_ptr().cast(), buf.len() as _)
    };
    if rc < 0 {
        return None;
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    Some(String::from_utf8_lossy(&buf[..end]).into_owned())
}

/// A pool (and RADOS namespace) of a cluster: an I/O context.
pub(crate) struct Pool {
    ioctx: ffi::rados_ioctx_t,
    /// The RADOS namespace set on it ("" for the default one).
    namespace: String,
    cluster: Arc<Cluster>,
}

// SAFETY: I/O contexts are thread-safe in librados; destroyed once, in `Drop`, after every
// image opened on it (each holds an `Arc` of the pool).
unsafe impl Send for Pool {}
// SAFETY: as for `Send`.
unsafe impl Sync for Pool {}

impl Drop for Pool {
    fn drop(&mut self) {
        // SAFETY: created in `open_pool`; no image of it is open (they hold the pool).
        unsafe { lib().rados.rados_ioctx_destroy(self.ioctx) };
    }
}

fn open_pool(spec: &RbdSpec) -> io::Result<Arc<Pool>> {
    let cluster = connect(&spec.ceph_conf, &spec.client_id)?;
    let name = cstr("pool", &spec.pool)?;
    let mut ioctx: ffi::rados_ioctx_t = ptr::null_mut();
    // SAFETY: a connected cluster; `ioctx` receives the context.
    let rc = unsafe {
        lib()
            .rados
            .rados_ioctx_create(cluster.0, name.as_ptr(), &mut ioctx)
    };
    if rc < 0 {
        return Err(err(&format!("pool `{}`", spec.pool), rc));
    }
    let pool = Arc::new(Pool {
        ioctx,
        namespace: spec.namespace.clone().unwrap_or_default(),
        cluster,
    });
    if let Some(ns) = &spec.namespace {
        let ns = cstr("namespace", ns)?;
        // SAFETY: a live context; the string is copied by librados.
        unsafe {
            lib()
                .rados
                .rados_ioctx_set_namespace(pool.ioctx, ns.as_ptr())
        };
    }
    Ok(pool)
}

/// An open image handle.
pub(crate) struct Image {
    handle: ffi::rbd_image_t,
    pool: Arc<Pool>,
    name: CString,
    read_only: bool,
    /// Handles opened ahead for engines (`prepare`), off the reactors that take them.
    spares: Mutex<Vec<Image>>,
    /// The image's size as its handles last saw it, shared by every handle of the image:
    /// each handle's header-update callback (on librbd's thread) stores it, so the reactors
    /// read it without asking librbd, which would refresh the header there first.
    seen_size: Arc<AtomicU64>,
    /// The image's size as this handle last saw it (its own header-update callback, its own
    /// resizes): what librbd cuts this handle's writes at. Another handle's resize or
    /// callback does not move it, so a handle that missed a growth (a header notification
    /// that timed out) is not taken to have seen it.
    own_size: Arc<AtomicU64>,
    /// This handle's header-update watch: librbd's handle and the callback's context.
    watch: Option<(u64, *mut Watch)>,
    /// Progress reports of this handle's resizes so far (`resize_progress`): a shrink
    /// deletes the image's objects past the new end one by one, which can take minutes.
    progress: AtomicU64,
}

/// What a header-update callback needs: the handle it asks, and where it stores the size
/// (the image's, shared by its handles, and the handle's own).
struct Watch {
    handle: ffi::rbd_image_t,
    size: Arc<AtomicU64>,
    own: Arc<AtomicU64>,
}

/// A header-update callback: the image changed (a resize, a snapshot, a setting), so the
/// handle's size is read again (librbd refreshes the header here, on its own thread).
///
/// # Safety
///
/// `arg` is the `Watch` registered with this callback, which lives until
/// `rbd_update_unwatch` has returned (it waits for callbacks under way).
unsafe extern "C" fn header_updated(arg: *mut c_void) {
    // SAFETY: as the function's contract says.
    let w = unsafe { &*arg.cast::<Watch>() };
    let mut size = 0u64;
    // SAFETY: the handle is open while its watch is registered (unwatched before closing).
    if unsafe { lib().rbd.rbd_get_size(w.handle, &mut size) } == 0 {
        w.own.store(size, Ordering::Release);
        w.size.store(size, Ordering::Release);
    }
}

/// A resize's progress callback: counts the report (its offset and total are not needed).
///
/// # Safety
///
/// `arg` is the `AtomicU64` that `Image::resize` passed, which lives until the resize has
/// returned: librbd calls this only during the call.
unsafe extern "C" fn resize_progress(_offset: u64, _total: u64, arg: *mut c_void) -> i32 {
    // SAFETY: as the function's contract says.
    let n = unsafe { &*arg.cast::<AtomicU64>() };
    n.fetch_add(1, Ordering::Relaxed);
    0
}

// SAFETY: librbd image handles may be used from any thread (librbd serialises internally);
// each engine's handle is used by its reactor only, and closed once, by `Closing`.
unsafe impl Send for Image {}
// SAFETY: as for `Send`: the device's own handle is read (its size) and resized from the
// control side, which librbd's internal locking allows from any thread.
unsafe impl Sync for Image {}

impl Drop for Image {
    /// The handle is closed on the closing thread: `rbd_close` unwatches the image and can
    /// wait on the cluster for as long as an OSD operation may take, and the last handle of a
    /// device often goes on a reactor (a namespace removed, a data path dropped), which must
    /// not stop serving meanwhile. The pool (and the cluster connection, if this was its
    /// last image) goes with it, after the close.
    fn drop(&mut self) {
        closer::close(Closing {
            handle: self.handle,
            watch: self.watch.take(),
            _pool: Arc::clone(&self.pool),
        });
    }
}

/// An image handle to close, and what must outlive the close.
struct Closing {
    handle: ffi::rbd_image_t,
    watch: Option<(u64, *mut Watch)>,
    _pool: Arc<Pool>,
}

// SAFETY: a handle no one else holds any more (its `Image` was dropped), closed once in
// `Drop`, on whichever thread drops it.
unsafe impl Send for Closing {}

impl Drop for Closing {
    fn drop(&mut self) {
        if let Some((h, w)) = self.watch.take() {
            // SAFETY: the watch registered in `open_handle` on this open handle, unwatched
            // once; librbd waits for a callback under way, after which nothing uses `w`,
            // made by `Box::into_raw` and freed here once.
            unsafe {
                lib().rbd.rbd_update_unwatch(self.handle, h);
                drop(Box::from_raw(w));
            }
        }
        // SAFETY: opened in `open_handle` and closed only here, once; no operation of it is in
        // flight (an engine drains before it lets a handle go).
        unsafe { lib().rbd.rbd_close(self.handle) };
    }
}

/// The threads that close image handles, and a count of the closes still to make.
mod closer;

/// What an image's configuration and features mean for how nvmfd may serve it.
mod checks;

pub(crate) use closer::{pending as closes_pending, wait_closed as wait_for_closes};

fn open_handle(
    pool: &Arc<Pool>,
    name: &CString,
    read_only: bool,
    seen_size: &Arc<AtomicU64>,
) -> Result<Image, i32> {
    let mut handle: ffi::rbd_image_t = ptr::null_mut();
    // SAFETY: a live I/O context; the name is NUL-terminated; no snapshot (NULL).
    let rc = unsafe {
        if read_only {
            lib()
                .rbd
                .rbd_open_read_only(pool.ioctx, name.as_ptr(), &mut handle, ptr::null())
        } else {
            lib()
                .rbd
                .rbd_open(pool.ioctx, name.as_ptr(), &mut handle, ptr::null())
        }
    };
    if rc < 0 {
        return Err(rc);
    }
    let mut image = Image {
        handle,
        pool: Arc::clone(pool),
        name: name.clone(),
        read_only,
        spares: Mutex::new(Vec::new()),
        seen_size: Arc::clone(seen_size),
        own_size: Arc::new(AtomicU64::new(u64::MAX)),
        watch: None,
        progress: AtomicU64::new(0),
    };
    let w = Box::into_raw(Box::new(Watch {
        handle,
        size: Arc::clone(seen_size),
        own: Arc::clone(&image.own_size),
    }));
    let mut h = 0u64;
    // SAFETY: an open handle; `w` lives until the watch is unregistered (`Closing`), and
    // `header_updated` only reads it.
    let rc = unsafe {
        lib()
            .rbd
            .rbd_update_watch(handle, &mut h, Some(header_updated), w.cast())
    };
    if rc < 0 {
        // SAFETY: never registered: nothing else has `w`.
        drop(unsafe { Box::from_raw(w) });
        return Err(rc);
    }
    image.watch = Some((h, w));
    // Read after the watch is set: a callback since stored a size as new or newer.
    let mut size = 0u64;
    // SAFETY: an open handle; `size` receives the value.
    let rc = unsafe { lib().rbd.rbd_get_size(handle, &mut size) };
    if rc < 0 {
        return Err(rc);
    }
    let _ = image
        .own_size
        .compare_exchange(u64::MAX, size, Ordering::AcqRel, Ordering::Acquire);
    Ok(image)
}

impl Image {
    /// Opens (and with `spec.create`, creates with `size` bytes first when it does not exist)
    /// the image of `spec`: the device's own handle, which keeps the connection and says the
    /// size.
    pub(crate) fn open(spec: &RbdSpec, size: u64, read_only: bool) -> io::Result<Image> {
        let pool = open_pool(spec)?;
        let name = cstr("image", &spec.image)?;
        let seen = Arc::new(AtomicU64::new(u64::MAX));
        let what = || {
            format!(
                "image `{}/{}{}`",
                spec.pool,
                spec.namespace
                    .as_deref()
                    .map(|n| format!("{n}/"))
                    .unwrap_or_default(),
                spec.image
            )
        };
        let image = match open_handle(&pool, &name, read_only, &seen) {
            Ok(i) => i.writing_through(what),
            Err(rc) if rc == -libc::ENOENT && spec.create => {
                if size == 0 {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!(
                            "{} does not exist and no size is given to create it",
                            what()
                        ),
                    ));
                }
                let mut order: i32 = 0;
                // Layering only, no exclusive lock: the reactors (and other daemons) that
                // open the image each hold a handle, and none should have to wait for a
                // lock the others hold.
                let features = u64::from(ffi::RBD_FEATURE_LAYERING);
                // SAFETY: a live context, a NUL-terminated name; `order` 0 is the default.
                let rc = unsafe {
                    lib()
                        .rbd
                        .rbd_create2(pool.ioctx, name.as_ptr(), size, features, &mut order)
                };
                if rc < 0 && rc != -libc::EEXIST {
                    return Err(err(&format!("creating {}", what()), rc));
                }
                open_handle(&pool, &name, read_only, &seen)
                    .map_err(|rc| err(&what(), rc))?
                    .writing_through(what)
            }
            Err(rc) => Err(err(&what(), rc)),
        }?;
        // A header-update callback may have stored a newer size since this was read.
        let size = image.size()?;
        let _ = seen.compare_exchange(u64::MAX, size, Ordering::AcqRel, Ordering::Acquire);
        Ok(image)
    }

    /// What the image is, whatever configuration file, user or pool name reached it: its
    /// cluster's FSID, pool ID, RADOS namespace and image ID. `None` if librados or librbd
    /// cannot say (then no other namespace is found to be the same image).
    pub(crate) fn identity(&self) -> Option<crate::StoreIdentity> {
        let mut fsid = [0u8; 64];
        // SAFETY: a connected cluster; `fsid` is writable for the length passed.
        let rc = unsafe {
            lib().rados.rados_cluster_fsid(
                self.pool.cluster.0,
                fsid.as_mut_ptr().cast(),
                fsid.len() as _,
            )
        };
        if rc < 0 {
            return None;
        }
        // SAFETY: a live I/O context.
        let pool = unsafe { lib().rados.rados_ioctx_get_id(self.pool.ioctx) };
        let mut id = [0u8; 64];
        // SAFETY: an open handle; `id` is writable for the length passed.
        let rc = unsafe {
            lib()
                .rbd
                .rbd_get_id(self.handle, id.as_mut_ptr().cast(), id.len() as _)
        };
        if rc < 0 {
            return None;
        }
        let text = |b: &[u8]| {
            let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
            String::from_utf8_lossy(&b[..end]).into_owned()
        };
        Some(crate::StoreIdentity::Rbd {
            fsid: text(&fsid),
            pool,
            namespace: self.pool.namespace.clone(),
            image: text(&id),
        })
    }

    /// Another handle on the same image (an engine's own).
    pub(crate) fn reopen(&self) -> io::Result<Image> {
        open_handle(&self.pool, &self.name, self.read_only, &self.seen_size)
            .map_err(|rc| err("opening the image again", rc))?
            .writing_through(|| "the image".to_owned())
    }

    /// Opens handles ahead until `n` wait for engines, in parallel: `rbd_open` waits on the
    /// cluster, which the caller does rather than the reactor that attaches the image. Returns
    /// how many wait; an open that fails leaves its engine without one.
    pub(crate) fn prepare(&self, n: usize) -> usize {
        let have = self.spares();
        let opened: Vec<Image> = std::thread::scope(|s| {
            let opens: Vec<_> = (have..n).map(|_| s.spawn(|| self.reopen())).collect();
            opens
                .into_iter()
                .filter_map(|h| h.join().ok().and_then(Result::ok))
                .collect()
        });
        let mut spares = self.spares.lock().unwrap_or_else(|e| e.into_inner());
        spares.extend(opened);
        spares.len()
    }

    /// Opens one more handle ahead, whatever waits already (`prepare` opens up to a count).
    pub(crate) fn add_spare(&self) -> io::Result<()> {
        let h = self.reopen()?;
        self.spares
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(h);
        Ok(())
    }

    /// Handles opened ahead and not taken.
    pub(crate) fn spares(&self) -> usize {
        self.spares.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// A handle opened ahead, if one waits.
    pub(crate) fn take_spare(&self) -> Option<Image> {
        self.spares.lock().unwrap_or_else(|e| e.into_inner()).pop()
    }

    /// The image's size in bytes.
    pub(crate) fn size(&self) -> io::Result<u64> {
        let mut size = 0u64;
        // SAFETY: an open handle; `size` receives the value.
        let rc = unsafe { lib().rbd.rbd_get_size(self.handle, &mut size) };
        if rc < 0 {
            return Err(err("rbd_get_size", rc));
        }
        Ok(size)
    }

    /// Progress reports of this handle's resizes so far: a count that moves while a resize
    /// works.
    pub(crate) fn progress(&self) -> u64 {
        self.progress.load(Ordering::Relaxed)
    }

    /// The image's size as its handles last saw it (their header-update callbacks): read
    /// without calling librbd, which would refresh a changed header on the caller's thread.
    pub(crate) fn seen_size(&self) -> u64 {
        self.seen_size.load(Ordering::Acquire)
    }

    /// The size a write of this handle is whole within: the smaller of the image's size as
    /// its handles last saw it and as this handle did. librbd cuts a write at the handle's
    /// own idea of the image's end and answers it success; a handle that missed a growth
    /// nvmfd made through another handle (its header notification timed out) still cuts
    /// there, where the image's size alone would call the write whole.
    pub(crate) fn write_limit(&self) -> u64 {
        self.seen_size().min(self.own_size.load(Ordering::Acquire))
    }

    /// [`Engine::rbd_handle_sees_size`](crate::Engine::rbd_handle_sees_size).
    pub(crate) fn set_own_size(&self, size: u64) {
        self.own_size.store(size, Ordering::Release);
    }

    /// Resizes the image to `size` bytes, counting librbd's progress reports meanwhile
    /// ([`Image::progress`]).
    pub(crate) fn resize(&self, size: u64) -> io::Result<()> {
        let arg: *const AtomicU64 = &self.progress;
        // SAFETY: an open handle; `arg` points at a field of `self`, alive through the call,
        // the only time librbd calls `resize_progress` with it.
        let rc = unsafe {
            lib().rbd.rbd_resize_with_progress(
                self.handle,
                size,
                Some(resize_progress),
                arg.cast_mut().cast(),
            )
        };
        if rc < 0 {
            return Err(err("rbd_resize", rc));
        }
        self.own_size.store(size, Ordering::Release);
        self.seen_size.store(size, Ordering::Release);
        Ok(())
    }

    /// Completions of this handle go to its event queue and write to `eventfd`.
    pub(crate) fn notify(&self, eventfd: RawFd) -> io::Result<()> {
        // SAFETY: an open handle and an eventfd the engine keeps open as long as the handle.
        let rc = unsafe {
            lib().rbd.rbd_set_image_notification(
                self.handle,
                eventfd,
                ffi::EVENT_TYPE_EVENTFD as i32,
            )
        };
        if rc < 0 {
            return Err(err("rbd_set_image_notification", rc));
        }
        Ok(())
    }

    fn completion(arg: usize) -> Result<ffi::rbd_completion_t, i32> {
        let mut c: ffi::rbd_completion_t = ptr::null_mut();
        // SAFETY: no callback: the completion is polled from the image's event queue; `arg`
        // is a number carried as a pointer, never dereferenced.
        let rc = unsafe {
            lib()
                .rbd
                .rbd_aio_create_completion(arg as *mut c_void, None, &mut c)
        };
        if rc < 0 {
            return Err(rc);
        }
        Ok(c)
    }

    /// Starts an operation; `arg` comes back with its completion from [`Image::poll`].
    ///
    /// # Safety
    ///
    /// For reads and writes `buf` must point to `len` bytes that stay valid (and, for a read,
    /// unaliased) until the completion has been polled.
    pub(crate) unsafe fn start(
        &self,
        op: Op,
        off: u64,
        len: u64,
        buf: *mut u8,
        arg: usize,
    ) -> Result<(), i32> {
        let c = Self::completion(arg)?;
        let h = self.handle;
        // SAFETY: an open handle and a fresh completion; the caller keeps `buf` valid.
        let rc = unsafe {
            match op {
                Op::Read => lib().rbd.rbd_aio_read(h, off, len, buf.cast::<c_char>(), c),
                Op::Write => {
                    lib()
                        .rbd
                        .rbd_aio_write(h, off, len, buf.cast::<c_char>().cast_const(), c)
                }
                Op::Flush => lib().rbd.rbd_aio_flush(h, c),
                // A deallocate too: librbd discards what it can (whole objects removed or
                // truncated) and zeroes the rest whatever the image's discard settings,
                // which `rbd_aio_discard` follows, an image's own overriding the client's at
                // each refresh (`rbd_skip_partial_discard`, `rbd_discard_granularity_bytes`):
                // a deallocated block would read its old data, where hosts are told zeroes.
                Op::WriteZeroes => lib().rbd.rbd_aio_write_zeroes(h, off, len, c, 0, 0),
            }
        };
        if rc < 0 {
            // SAFETY: the completion was never handed to an operation.
            unsafe { lib().rbd.rbd_aio_release(c) };
            return Err(rc);
        }
        Ok(())
    }

    /// Completed operations of this handle: `(arg, return value)`, into `out`.
    pub(crate) fn poll(&self, out: &mut Vec<(usize, i64)>) {
        let mut comps: [ffi::rbd_completion_t; 32] = [ptr::null_mut(); 32];
        loop {
            // SAFETY: an open handle with notification set; `comps` has room for 32.
            let n = unsafe {
                lib()
                    .rbd
                    .rbd_poll_io_events(self.handle, comps.as_mut_ptr(), 32)
            };
            let Ok(n) = usize::try_from(n) else { return };
            for &c in &comps[..n] {
                // SAFETY: a completion librbd has completed and handed back once.
                let (arg, rv) = unsafe {
                    let arg = lib().rbd.rbd_aio_get_arg(c) as usize;
                    let rv = lib().rbd.rbd_aio_get_return_value(c);
                    lib().rbd.rbd_aio_release(c);
                    (arg, rv)
                };
                out.push((arg, rv));
            }
            if n < comps.len() {
                return;
            }
        }
    }
}

/// An RBD operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    Read,
    Write,
    Flush,
    WriteZeroes,
}
