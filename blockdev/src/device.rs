//! Opening block devices and describing them.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::mem::DmaRegion;
use crate::BlockError;

/// What stores a device's data ([`Device::identity`]).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum StoreIdentity {
    /// A regular file: its filesystem's device number and its inode.
    File(u64, u64),
    /// A block device: its device number.
    BlockDevice(u64),
    /// An RBD image: its cluster's FSID, its pool's ID, its RADOS namespace and its image
    /// ID (which a rename keeps), whatever configuration file, user or pool name reached it.
    Rbd {
        /// The cluster's FSID.
        fsid: String,
        /// The pool's ID.
        pool: i64,
        /// The RADOS namespace ("" for the default one).
        namespace: String,
        /// The image's ID.
        image: String,
    },
}

mod open;
mod resize;
mod sync;

use open::{open_path, open_rbd};
pub(crate) use sync::Syncs;

/// `_IOR(0x12, 114, size_t)`: a block device's size in bytes (not exported by `libc`).
const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;

/// Which backend serves a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A regular file, through io_uring.
    File,
    /// A block device, through io_uring.
    Bdev,
    /// RAM.
    Malloc,
    /// Discards writes, reads zeroes.
    Null,
    /// A Ceph RBD image, through librbd (the `rbd` feature).
    Rbd,
}

/// Where an RBD image is and how to reach it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RbdSpec {
    /// The pool.
    pub pool: String,
    /// The image.
    pub image: String,
    /// The RADOS namespace in the pool, if any.
    pub namespace: Option<String>,
    /// The cluster's configuration file.
    pub ceph_conf: PathBuf,
    /// The cephx user, without `client.` (its keyring from the usual places).
    pub client_id: String,
    /// Create the image (of the device spec's size) when it does not exist.
    pub create: bool,
}

/// What a device is and what it can do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Backend.
    pub kind: Kind,
    /// Path, for files and block devices.
    pub path: Option<PathBuf>,
    /// Capacity in bytes, a whole number of logical blocks.
    pub size: u64,
    /// Logical block size: the unit of every offset and length.
    pub logical_block_size: u32,
    /// Physical block size (for the host's alignment hints).
    pub physical_block_size: u32,
    /// Writes are refused.
    pub read_only: bool,
    /// I/O bypasses the page cache (O_DIRECT). False after a logged fallback to buffered I/O.
    pub direct: bool,
    /// Write zeroes is supported.
    pub write_zeroes: bool,
    /// Deallocate (trim) is supported; deallocated blocks read back as zeroes.
    pub deallocate: bool,
    /// The most logical blocks one deallocate operation of this backend takes (0: no limit).
    /// A longer range takes several operations (the data path cuts it); the NVMe layer
    /// reports the smallest over a subsystem's namespaces to hosts (DMRSL), so that a host
    /// keeping to it sends none.
    pub deallocate_max_blocks: u32,
    /// Flush does something (false for RAM and null, where data is never cached).
    pub volatile_cache: bool,
}

impl DeviceInfo {
    /// Capacity in logical blocks.
    pub fn blocks(&self) -> u64 {
        self.size / u64::from(self.logical_block_size)
    }

    /// Checks that `offset..offset+len` is a non-empty whole number of blocks inside the device.
    pub fn check_range(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        check_range(self.size, self.logical_block_size, offset, len)
    }
}

/// Checks that `offset..offset+len` is a non-empty whole number of `block_size` blocks within
/// `size` bytes.
fn check_range(size: u64, block_size: u32, offset: u64, len: u64) -> Result<(), BlockError> {
    let bs = u64::from(block_size);
    if len == 0 || !offset.is_multiple_of(bs) || !len.is_multiple_of(bs) {
        return Err(BlockError::Misaligned {
            offset,
            len,
            block_size,
        });
    }
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(BlockError::OutOfRange { offset, len, size }),
    }
}

/// How to open a device.
#[derive(Clone, Debug)]
pub struct DeviceSpec {
    /// Backend.
    pub kind: Kind,
    /// Path (file, bdev).
    pub path: Option<PathBuf>,
    /// Size (malloc, null).
    pub size: u64,
    /// Logical block size (file, malloc, null; a block device reports its own).
    pub block_size: u32,
    /// Open read-only.
    pub read_only: bool,
    /// Try O_DIRECT (file, bdev). Default true; a refusal falls back to buffered I/O.
    pub direct: bool,
    /// Back RAM with huge pages when available (malloc).
    pub huge_pages: bool,
    /// The image (rbd); `size` is the size to create it with.
    pub rbd: Option<RbdSpec>,
}

impl DeviceSpec {
    /// A spec with defaults for `kind`.
    pub fn new(kind: Kind) -> DeviceSpec {
        DeviceSpec {
            kind,
            path: None,
            size: 0,
            block_size: 512,
            read_only: false,
            direct: true,
            huge_pages: false,
            rbd: None,
        }
    }
}

pub(crate) enum Backing {
    File(File),
    Malloc(Ram),
    Null,
    /// The device's own handle (engines open theirs from it).
    #[cfg(feature = "rbd")]
    Rbd(crate::rbd::Image),
}

/// How many locks a RAM device's chunks share (a power of two).
const RAM_STRIPES: usize = 256;
/// The bytes each of a RAM device's locks covers at once: a multiple of every block size a
/// RAM device may have, so that no block spans two.
const RAM_CHUNK: usize = 4096;

/// One lock of a RAM device, on its own cache line (reactors copying different chunks do not
/// write the same line): a ticket lock, so that reactors take a chunk in turn. A chunk is held
/// for one copy of at most 4 KiB; a mutex let one reactor writing a block in a loop take it
/// back again and again while another's read of it slept.
#[repr(align(64))]
#[derive(Default)]
struct Stripe {
    next: std::sync::atomic::AtomicU32,
    serving: std::sync::atomic::AtomicU32,
}

impl Stripe {
    fn lock(&self) -> StripeGuard<'_> {
        use std::sync::atomic::Ordering;
        let mine = self.next.fetch_add(1, Ordering::Relaxed);
        let mut spins = 0u32;
        while self.serving.load(Ordering::Acquire) != mine {
            spins = spins.wrapping_add(1);
            // The holder may have lost its CPU: after a while, let it run.
            if spins.is_multiple_of(64) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        StripeGuard(self)
    }
}

/// A held [`Stripe`]; dropping it lets the next ticket in.
struct StripeGuard<'a>(&'a Stripe);

impl Drop for StripeGuard<'_> {
    fn drop(&mut self) {
        self.0
            .serving
            .fetch_add(1, std::sync::atomic::Ordering::Release);
    }
}

/// A RAM device's memory, shared by every reactor that serves it. Each 4 KiB chunk is copied
/// under a lock (one of [`RAM_STRIPES`], by chunk number), so a block is read or written whole
/// with respect to other reactors' commands, as AWUN 0 (one block written atomically)
/// promises; and no two threads ever copy into the same bytes at once.
pub(crate) struct Ram {
    region: DmaRegion,
    stripes: Box<[Stripe]>,
}

impl Ram {
    fn new(region: DmaRegion) -> Ram {
        Ram {
            region,
            stripes: (0..RAM_STRIPES).map(|_| Stripe::default()).collect(),
        }
    }

    /// The bytes mapped (at least the device's size when opened).
    pub(crate) fn len(&self) -> usize {
        self.region.len()
    }

    /// Calls `f(at, done, n)` for each chunk-aligned piece of `off..off + len`, in order, with
    /// that chunk's lock held: `at` points at the piece in the mapping, `done` is how many
    /// bytes of the range came before it, `n` its length. The caller copies with raw pointers
    /// only (no reference to the shared mapping is formed).
    ///
    /// # Safety
    ///
    /// `off + len` must not exceed [`Ram::len`].
    pub(crate) unsafe fn each_chunk(
        &self,
        off: usize,
        len: usize,
        mut f: impl FnMut(*mut u8, usize, usize),
    ) {
        debug_assert!(off + len <= self.region.len());
        let mut pos = off;
        let end = off + len;
        while pos < end {
            let chunk = pos / RAM_CHUNK;
            let n = ((chunk + 1) * RAM_CHUNK).min(end) - pos;
            let held = self.stripes[chunk % RAM_STRIPES].lock();
            // SAFETY: pos + n <= end <= the mapping's length (the caller's contract).
            f(unsafe { self.region.as_ptr().add(pos) }, pos - off, n);
            drop(held);
            pos += n;
        }
    }
}

/// An open device, shared by the reactors that serve it (each attaches it to its own engine).
pub struct Device {
    /// What it is; `info.size` is its capacity when opened (`size` is the capacity now).
    pub(crate) info: DeviceInfo,
    /// Capacity now, in bytes: a resize changes it while reactors serve the device.
    pub(crate) size: std::sync::atomic::AtomicU64,
    pub(crate) backing: Backing,
    /// What to warn of when serving it: why O_DIRECT was not used when it was wanted; an
    /// RBD image's feature that slows it down.
    pub(crate) warning: Option<String>,
    /// A sync (a Flush, a FUA write's) failed once: every later Flush fails too. Linux reports
    /// a writeback error once per open file, and every host, reactor and the stop-time sync
    /// share this one file: after the report, a later sync succeeds though the data it should
    /// have made durable is gone.
    pub(crate) sync_failed: std::sync::atomic::AtomicBool,
    /// `sync_failed` was reported once ([`Device::first_sync_failure`]).
    pub(crate) sync_failure_reported: std::sync::atomic::AtomicBool,
    /// Operations of every engine whose step syncs the device's file, in flight
    /// ([`Device::sync_begin`]): one of them may take a writeback error's report.
    pub(crate) syncs: Syncs,
    /// Drawn when it is opened: tells this device from one opened before or after in its
    /// place (a RAM device's data lasts as long as it does).
    pub(crate) instance: u64,
    /// Failures tests inject.
    pub(crate) faults: Faults,
    /// The size an RBD image's shrink failed to cut it to (`u64::MAX`: none): the image may
    /// be cut part-way, and the next resize of any kind completes that cut first.
    pub(crate) pending_cut: std::sync::atomic::AtomicU64,
}

/// Test hooks: failures injected into a device's operations.
#[derive(Default)]
pub(crate) struct Faults {
    /// [`Device::fail_next_sync`]: the next sync to complete fails.
    pub(crate) sync_failure: std::sync::atomic::AtomicBool,
    /// [`Device::fail_sync`]: syncs let through before the injected failure, and its errno.
    pub(crate) sync_skip: std::sync::atomic::AtomicU32,
    pub(crate) sync_errno: std::sync::atomic::AtomicI32,
    /// [`Device::fail_next_cut`]: the next shrink's cut of the backend fails.
    pub(crate) cut_failure: std::sync::atomic::AtomicBool,
    /// [`Device::fail_next_deallocates`]: how many deallocates to complete with EOPNOTSUPP,
    /// as a driver that turned its write-zeroes off after the device was opened does.
    pub(crate) deallocates_unsupported: std::sync::atomic::AtomicU32,
    /// [`Device::fail_next_attaches`]: how many attaches to an engine to refuse.
    pub(crate) attach_failures: std::sync::atomic::AtomicU32,
    /// [`Device::race_next_flush`]: the next Flush to start begins another engine's sync
    /// alongside (its number plus one here, 0 for none), which takes the writeback error's
    /// report and ends once the Flush has been settled.
    pub(crate) flush_race: std::sync::atomic::AtomicBool,
    pub(crate) flush_race_sync: std::sync::atomic::AtomicU64,
}

impl Faults {
    /// Takes one from a count of injected failures: whether there was one left.
    pub(crate) fn take_one(count: &std::sync::atomic::AtomicU32) -> bool {
        use std::sync::atomic::Ordering::{AcqRel, Acquire};
        count
            .fetch_update(AcqRel, Acquire, |n| n.checked_sub(1))
            .is_ok()
    }
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device").field("info", &self.info).finish()
    }
}

// SAFETY: `Backing::Malloc` holds a raw mapping; the engine copies into and out of it with raw
// copies, each chunk under its lock (`Ram::each_chunk`), so no two threads touch the same
// bytes at once, and the mapping lives as long as the `Device`. Files are thread-safe. No Rust
// reference to the mapping is ever formed.
unsafe impl Send for Device {}
// SAFETY: as for `Send`: shared access goes through raw copies only.
unsafe impl Sync for Device {}

impl Device {
    /// Opens the device described by `spec`.
    pub fn open(spec: &DeviceSpec) -> Result<Arc<Device>, io::Error> {
        Self::open_with(spec, &|path, opts| opts.open(path))
    }

    /// `open`, with the system call that opens a path as a parameter (tests inject refusals).
    pub fn open_with(
        spec: &DeviceSpec,
        opener: &dyn Fn(&Path, &OpenOptions) -> io::Result<File>,
    ) -> Result<Arc<Device>, io::Error> {
        let bad = |msg: String| io::Error::new(io::ErrorKind::InvalidInput, msg);
        if spec.block_size != 512 && spec.block_size != 4096 && spec.kind != Kind::Bdev {
            return Err(bad(format!(
                "block size {} is not 512 or 4096",
                spec.block_size
            )));
        }
        let ram = |kind: Kind| {
            if spec.size == 0 || !spec.size.is_multiple_of(u64::from(spec.block_size)) {
                return Err(bad(format!(
                    "size {} is not a non-zero number of {}-byte blocks",
                    spec.size, spec.block_size
                )));
            }
            Ok(DeviceInfo {
                kind,
                path: None,
                size: spec.size,
                logical_block_size: spec.block_size,
                physical_block_size: spec.block_size,
                read_only: spec.read_only,
                direct: true,
                write_zeroes: true,
                deallocate: true,
                deallocate_max_blocks: 0,
                volatile_cache: false,
            })
        };
        match spec.kind {
            Kind::Malloc => {
                let info = ram(Kind::Malloc)?;
                let len = usize::try_from(spec.size).map_err(|_| bad("size too large".into()))?;
                // Huge pages are reserved as they are mapped: too few free, and nothing is.
                let huge = if spec.huge_pages {
                    DmaRegion::huge(len)?
                } else {
                    None
                };
                let region = match huge {
                    Some(r) => r,
                    None => {
                        // Normal pages are populated as they are mapped: more than the
                        // machine has available (the huge page pool is not) would have the
                        // kernel's OOM killer end a process (likely this one) instead.
                        if let Some(free) = crate::mem::memory_available() {
                            if spec.size > free {
                                let pages = if spec.huge_pages {
                                    " (too few free 2 MiB huge pages for it)"
                                } else {
                                    ""
                                };
                                return Err(io::Error::new(
                                    io::ErrorKind::OutOfMemory,
                                    format!(
                                        "a RAM namespace of {} bytes does not fit in the {free} bytes of memory available{pages}",
                                        spec.size
                                    ),
                                ));
                            }
                        }
                        DmaRegion::new(len, false)?
                    }
                };
                Ok(Arc::new(Device {
                    size: info.size.into(),
                    info,
                    backing: Backing::Malloc(Ram::new(region)),
                    warning: None,
                    sync_failed: Default::default(),
                    sync_failure_reported: Default::default(),
                    instance: fastrand::u64(..),
                    syncs: Default::default(),
                    faults: Default::default(),
                    pending_cut: std::sync::atomic::AtomicU64::new(u64::MAX),
                }))
            }
            Kind::Null => Ok(Arc::new(Device {
                size: spec.size.into(),
                info: ram(Kind::Null)?,
                backing: Backing::Null,
                warning: None,
                sync_failed: Default::default(),
                sync_failure_reported: Default::default(),
                instance: fastrand::u64(..),
                syncs: Default::default(),
                faults: Default::default(),
                pending_cut: std::sync::atomic::AtomicU64::new(u64::MAX),
            })),
            Kind::Rbd => open_rbd(spec),
            Kind::File | Kind::Bdev => {
                let path = spec
                    .path
                    .as_deref()
                    .ok_or_else(|| bad("a path is needed".into()))?;
                open_path(spec, path, opener)
            }
        }
    }

    /// Whether every read gives zeroes and nothing else (a null device): a reader may send
    /// zeroes from memory of its own instead of reading.
    pub fn reads_zeroes(&self) -> bool {
        matches!(self.backing, Backing::Null)
    }

    /// What stores the device's data, whatever path named it (a symlink, a hard link,
    /// `/dev/disk/by-id/...`; for an RBD image, another configuration file or user of the
    /// same cluster): a file's filesystem and inode, a block device's device number, an
    /// image's cluster, pool, namespace and ID. `None` for RAM and null devices. Two
    /// namespaces on one store would overwrite each other's data.
    pub fn identity(&self) -> Option<StoreIdentity> {
        use std::os::unix::fs::MetadataExt;
        let f = match &self.backing {
            Backing::File(f) => f,
            #[cfg(feature = "rbd")]
            Backing::Rbd(image) => return image.identity(),
            _ => return None,
        };
        let m = f.metadata().ok()?;
        Some(if m.file_type().is_block_device() {
            StoreIdentity::BlockDevice(m.rdev())
        } else {
            StoreIdentity::File(m.dev(), m.ino())
        })
    }

    /// A number drawn when the device was opened, the same for as long as it is open.
    pub fn instance(&self) -> u64 {
        self.instance
    }

    /// What the device is, as opened: its capacity now is [`Device::size`].
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// Capacity now, in bytes.
    pub fn size(&self) -> u64 {
        self.size.load(std::sync::atomic::Ordering::Acquire)
    }

    /// What the device is, with its capacity now.
    pub fn current_info(&self) -> DeviceInfo {
        DeviceInfo {
            size: self.size(),
            ..self.info.clone()
        }
    }

    /// Checks that `offset..offset+len` is a non-empty whole number of blocks inside the
    /// device's capacity now.
    pub fn check_range(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        check_range(self.size(), self.info.logical_block_size, offset, len)
    }

    /// Opens `n` handles of an RBD image ahead (in parallel), for the engines that will
    /// attach it, so that their reactors do not wait on the cluster (`rbd_open`): see
    /// [`Engine::attach_ready`](crate::Engine::attach_ready). Returns how many wait. Other backends have nothing to
    /// open.
    pub fn prepare_handles(&self, n: usize) -> usize {
        match &self.backing {
            #[cfg(feature = "rbd")]
            Backing::Rbd(image) => image.prepare(n),
            _ => {
                let _ = n;
                0
            }
        }
    }

    /// The backend's own size now, where it can change behind nvmfd: an RBD image's, as its
    /// handles last saw it (`rbd resize` elsewhere). `None` for the other backends.
    pub fn backend_size(&self) -> Option<u64> {
        match &self.backing {
            #[cfg(feature = "rbd")]
            Backing::Rbd(image) => Some(image.seen_size()),
            _ => None,
        }
    }

    /// Opens one more handle ahead for an engine ([`Engine::attach_ready`] takes it), however
    /// many wait already: for an engine that found none. It waits on the cluster. Nothing
    /// for the other backends.
    ///
    /// [`Engine::attach_ready`]: crate::Engine::attach_ready
    pub fn open_spare_handle(&self) -> std::io::Result<()> {
        match &self.backing {
            #[cfg(feature = "rbd")]
            Backing::Rbd(image) => image.add_spare(),
            _ => Ok(()),
        }
    }

    /// Handles opened ahead ([`Device::prepare_handles`]) that no engine has taken yet.
    pub fn handles_ready(&self) -> usize {
        match &self.backing {
            #[cfg(feature = "rbd")]
            Backing::Rbd(image) => image.spares(),
            _ => 0,
        }
    }

    /// Test hook: the next shrink fails when it cuts the backend. An RBD image is left as
    /// librbd's resize leaves it when it fails part-way (it deletes the objects past the new
    /// end before it updates the image's size): its tail reads zeroes, its size is the old
    /// one. Other backends fail before they cut.
    #[doc(hidden)]
    pub fn fail_next_cut(&self) {
        self.faults
            .cut_failure
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// Test hook: the next `n` deallocates an engine submits on this file or block device
    /// are refused with EOPNOTSUPP, the range untouched, as they are once a block device's
    /// driver has turned its write-zeroes off.
    #[doc(hidden)]
    pub fn fail_next_deallocates(&self, n: u32) {
        self.faults
            .deallocates_unsupported
            .store(n, std::sync::atomic::Ordering::Release);
    }

    /// Test hook: the next `n` attaches of this device to an engine fail with EMFILE, as
    /// registering its file in an engine's table does when the process is out of files.
    #[doc(hidden)]
    pub fn fail_next_attaches(&self, n: u32) {
        self.faults
            .attach_failures
            .store(n, std::sync::atomic::Ordering::Release);
    }

    /// Whether this attach is to fail ([`Device::fail_next_attaches`]).
    pub(crate) fn take_injected_attach_failure(&self) -> bool {
        Faults::take_one(&self.faults.attach_failures)
    }

    /// Whether an engine attaches this device with a handle opened ahead for it (an RBD
    /// image's: [`Device::prepare_handles`], [`Device::open_spare_handle`]).
    pub fn needs_handle(&self) -> bool {
        match &self.backing {
            #[cfg(feature = "rbd")]
            Backing::Rbd(_) => true,
            _ => false,
        }
    }

    /// Whether this deallocate is to fail ([`Device::fail_next_deallocates`]).
    pub(crate) fn take_injected_deallocate_failure(&self) -> bool {
        Faults::take_one(&self.faults.deallocates_unsupported)
    }

    /// What the daemon should warn of when it serves this device: why buffered I/O is used
    /// although O_DIRECT was asked for; an RBD image's exclusive-lock feature.
    pub fn warning(&self) -> Option<&str> {
        self.warning.as_deref()
    }
}

#[cfg(test)]
mod tests {
    /// A RAM namespace larger than the memory available is refused before anything is
    /// mapped (its pages are populated as they are mapped: past what is free, the OOM killer
    /// would end a process instead), with the sizes in the message. Here twice the machine's
    /// memory, which the kernel would refuse too, with ENOMEM alone.
    #[test]
    fn a_ram_device_larger_than_the_memory_available_is_refused() {
        let total_kib: u64 = std::fs::read_to_string("/proc/meminfo")
            .unwrap()
            .lines()
            .find(|l| l.starts_with("MemTotal:"))
            .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
            .unwrap();
        let mut spec = super::DeviceSpec::new(super::Kind::Malloc);
        spec.size = total_kib * 1024 * 2;
        let e = super::Device::open(&spec).expect_err("opened");
        assert_eq!(e.kind(), std::io::ErrorKind::OutOfMemory, "{e}");
        assert!(e.to_string().contains("does not fit"), "{e}");
        // With huge pages asked for and too few free, normal pages are checked against the
        // memory available alone (the free huge pages once counted too).
        spec.huge_pages = true;
        let e = super::Device::open(&spec).expect_err("opened");
        assert_eq!(e.kind(), std::io::ErrorKind::OutOfMemory, "{e}");
        assert!(
            e.to_string().contains("too few free 2 MiB huge pages"),
            "{e}"
        );
        spec.size = 1 << 20;
        assert!(super::Device::open(&spec).is_ok());
        spec.huge_pages = false;
        assert!(super::Device::open(&spec).is_ok());
    }

    use super::open::deallocate_blocks;

    #[test]
    fn a_byte_limit_becomes_whole_blocks_and_none_stays_none() {
        assert_eq!(deallocate_blocks(0, 512), 0, "no limit");
        assert_eq!(deallocate_blocks(1 << 20, 512), 2048);
        assert_eq!(deallocate_blocks(1 << 20, 4096), 256);
        assert_eq!(deallocate_blocks(100, 4096), 1, "a limit is never 0 blocks");
        assert_eq!(deallocate_blocks(u64::MAX, 512), u32::MAX, "saturates");
    }
}
