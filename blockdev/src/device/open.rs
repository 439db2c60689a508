//! Opening a file or block device (O_DIRECT where it works, what fallocate can do, whether
//! the system uses the device) and an RBD image.

use super::*;

pub(super) fn open_path(
    spec: &DeviceSpec,
    path: &Path,
    opener: &dyn Fn(&Path, &OpenOptions) -> io::Result<File>,
) -> io::Result<Arc<Device>> {
    let ctx = |what: &str, e: io::Error| {
        io::Error::new(e.kind(), format!("{}: {what}: {e}", path.display()))
    };
    let options = |direct: bool| {
        let mut o = OpenOptions::new();
        o.read(true).write(!spec.read_only);
        if direct {
            o.custom_flags(libc::O_DIRECT);
        }
        o
    };
    let mut fallback_reason = None;
    let mut direct = spec.direct;
    let file = match opener(path, &options(direct)) {
        Ok(f) => f,
        Err(e) if direct && e.raw_os_error() == Some(libc::EINVAL) => {
            fallback_reason = Some(format!(
                "the file system refuses O_DIRECT ({e}): using buffered I/O"
            ));
            direct = false;
            opener(path, &options(false)).map_err(|e| ctx("cannot open", e))?
        }
        Err(e) => return Err(ctx("cannot open", e)),
    };
    let meta = file.metadata().map_err(|e| ctx("cannot stat", e))?;
    let is_bdev = meta.file_type().is_block_device();
    match (spec.kind, is_bdev) {
        (Kind::Bdev, false) => {
            return Err(ctx(
                "not a block device",
                io::Error::from_raw_os_error(libc::ENOTBLK),
            ))
        }
        (Kind::File, true) => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{}: is a block device: use backend `bdev`", path.display()),
            ))
        }
        _ => {}
    }
    if is_bdev {
        in_use_check(path, spec.read_only, opener, &mut fallback_reason)?;
    }
    let fd = file.as_raw_fd();
    let (size, lbs, pbs, write_zeroes, deallocate, deallocate_max_blocks) = if is_bdev {
        let mut size: u64 = 0;
        let mut lbs: libc::c_int = 0;
        let mut pbs: libc::c_uint = 0;
        // SAFETY: each ioctl writes one integer of the type given into the pointed-to local.
        let rc = unsafe {
            (libc::ioctl(fd, BLKGETSIZE64 as _, &mut size) < 0
                || libc::ioctl(fd, libc::BLKSSZGET as _, &mut lbs) < 0
                || libc::ioctl(fd, libc::BLKPBSZGET as _, &mut pbs) < 0) as i32
        };
        if rc != 0 {
            return Err(ctx(
                "cannot read its size and block sizes",
                io::Error::last_os_error(),
            ));
        }
        let zeroes_max = sysfs_queue_value(&meta, "write_zeroes_max_bytes").unwrap_or(0);
        let lbs = u32::try_from(lbs).unwrap_or(512);
        // Write zeroes through fallocate(ZERO_RANGE) always works on a block device (the kernel
        // writes zeroes itself when the device cannot); deallocate through
        // fallocate(PUNCH_HOLE), which guarantees zeroes, needs the device's write-zeroes.
        // The kernel cuts a longer fallocate into device commands of at most
        // write_zeroes_max_bytes: one deallocate operation is kept to one device command.
        (
            size,
            lbs,
            pbs,
            true,
            zeroes_max > 0,
            deallocate_blocks(zeroes_max, lbs),
        )
    } else {
        let bs = u64::from(spec.block_size);
        let size = meta.len() / bs * bs;
        // Probed past the file's end: bytes past the last whole block are the user's too.
        let (z, d) = if spec.read_only {
            (false, false)
        } else {
            probe_fallocate(fd, meta.len().next_multiple_of(bs), bs)
        };
        // A file system punches a hole of any length in one call.
        (size, spec.block_size, spec.block_size.max(4096), z, d, 0)
    };
    if size == 0 {
        return Err(ctx("is empty", io::Error::from_raw_os_error(libc::EINVAL)));
    }
    let mut file = file;
    if direct {
        if let Err(e) = probe_direct(&file, lbs) {
            add_warning(
                &mut fallback_reason,
                format!("O_DIRECT I/O of {lbs}-byte blocks is refused ({e}): using buffered I/O"),
            );
            direct = false;
            file = opener(path, &options(false)).map_err(|e| ctx("cannot reopen", e))?;
        }
    }
    Ok(Arc::new(Device {
        size: size.into(),
        info: DeviceInfo {
            kind: spec.kind,
            path: Some(path.to_owned()),
            size,
            logical_block_size: lbs,
            physical_block_size: pbs.max(lbs),
            read_only: spec.read_only,
            direct,
            write_zeroes,
            deallocate,
            deallocate_max_blocks,
            volatile_cache: true,
        },
        backing: Backing::File(file),
        warning: fallback_reason,
        sync_failed: Default::default(),
        sync_failure_reported: Default::default(),
        instance: fastrand::u64(..),
        syncs: Default::default(),
        faults: Default::default(),
        pending_cut: std::sync::atomic::AtomicU64::new(u64::MAX),
    }))
}

/// Adds `more` to what the daemon warns of for a device.
fn add_warning(w: &mut Option<String>, more: String) {
    match w {
        Some(w) => {
            w.push_str("; ");
            w.push_str(&more);
        }
        None => *w = Some(more),
    }
}

/// A block device the system uses (a file system mounted on it; a member of an MD, LVM or
/// device-mapper device) or another program opened exclusively refuses an exclusive open
/// (O_EXCL without O_CREAT, which Linux defines for block devices alone) with EBUSY: a host
/// writing to it would corrupt that user's data, and its reads would see data changing under
/// them. Refused for writing; served read-only with a warning. The exclusive open is closed
/// at once: nvmfd's own opens are shared, so that a namespace and a device being replaced
/// may hold the device together.
fn in_use_check(
    path: &Path,
    read_only: bool,
    opener: &dyn Fn(&Path, &OpenOptions) -> io::Result<File>,
    warning: &mut Option<String>,
) -> io::Result<()> {
    // One claim at a time: the kernel lets one exclusive claim hold a disk and its
    // partitions, so two namespaces' probes at once (a disk and one of its partitions, opened
    // on threads of their own) would refuse each other.
    static PROBING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = PROBING.lock().unwrap_or_else(|e| e.into_inner());
    let mut o = OpenOptions::new();
    o.read(true).custom_flags(libc::O_EXCL);
    match opener(path, &o) {
        Ok(_) => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
            let what = "is in use by the system (a mounted file system, or part of an MD, LVM or device-mapper device) or opened exclusively by another program";
            if read_only {
                add_warning(
                    warning,
                    format!("{what}: hosts may read data changing under them"),
                );
                return Ok(());
            }
            Err(io::Error::new(
                io::ErrorKind::ResourceBusy,
                format!(
                    "{}: {what}: hosts writing to it would corrupt its user's data; release it first (or serve it with read_only = true)",
                    path.display()
                ),
            ))
        }
        // Not something this check can tell (the shared open succeeded): serve it.
        Err(_) => Ok(()),
    }
}

#[cfg(feature = "rbd")]
pub(super) fn open_rbd(spec: &DeviceSpec) -> io::Result<Arc<Device>> {
    let r = spec.rbd.as_ref().ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            "an rbd device needs its pool and image",
        )
    })?;
    let image = crate::rbd::Image::open(r, spec.size, spec.read_only)?;
    let warning = image.warning();
    let bs = u64::from(spec.block_size);
    let size = image.size()? / bs * bs;
    if size == 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("image `{}` is smaller than one block", r.image),
        ));
    }
    Ok(Arc::new(Device {
        size: size.into(),
        info: DeviceInfo {
            kind: Kind::Rbd,
            path: None,
            size,
            logical_block_size: spec.block_size,
            physical_block_size: spec.block_size.max(4096),
            read_only: spec.read_only,
            direct: true,
            write_zeroes: !spec.read_only,
            deallocate: !spec.read_only,
            deallocate_max_blocks: 0,
            // librbd's cache is off (see `rbd.rs`): an acknowledged write is on the OSDs.
            volatile_cache: false,
        },
        backing: Backing::Rbd(image),
        warning,
        sync_failed: Default::default(),
        sync_failure_reported: Default::default(),
        instance: fastrand::u64(..),
        syncs: Default::default(),
        faults: Default::default(),
        pending_cut: std::sync::atomic::AtomicU64::new(u64::MAX),
    }))
}

#[cfg(not(feature = "rbd"))]
pub(super) fn open_rbd(_: &DeviceSpec) -> io::Result<Arc<Device>> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "this nvmfd was built without RBD support (the `rbd` feature)",
    ))
}

/// Reads one block at offset 0 with O_DIRECT: file systems that accept the open may still
/// refuse the I/O (alignment), and it is better to know at open than at the first command.
fn probe_direct(file: &File, block: u32) -> io::Result<()> {
    use std::os::unix::fs::FileExt;
    let region = DmaRegion::new(block as usize, false)?;
    // SAFETY: the region is at least `block` bytes, owned here, and not otherwise referenced.
    let buf = unsafe { std::slice::from_raw_parts_mut(region.as_ptr(), block as usize) };
    file.read_at(buf, 0).map(|_| ())
}

/// Whether fallocate's ZERO_RANGE and PUNCH_HOLE work on this file, tested past its end with
/// KEEP_SIZE so that no data changes (and undone at once).
fn probe_fallocate(fd: i32, size: u64, bs: u64) -> (bool, bool) {
    let (Ok(off), Ok(len)) = (i64::try_from(size), i64::try_from(bs)) else {
        return (false, false);
    };
    let try_mode = |mode: i32| {
        // SAFETY: fallocate on an owned fd with KEEP_SIZE past the end changes no file data.
        unsafe { libc::fallocate(fd, mode | libc::FALLOC_FL_KEEP_SIZE, off, len) == 0 }
    };
    let zeroes = try_mode(libc::FALLOC_FL_ZERO_RANGE);
    let punch = try_mode(libc::FALLOC_FL_PUNCH_HOLE);
    (zeroes, punch)
}

/// `max_bytes` (a block device's limit for one deallocate) in logical blocks of `lbs` bytes:
/// at least 1 when there is a limit (0: none), at most `u32::MAX`.
pub(super) fn deallocate_blocks(max_bytes: u64, lbs: u32) -> u32 {
    if max_bytes == 0 {
        return 0;
    }
    u32::try_from((max_bytes / u64::from(lbs.max(1))).max(1)).unwrap_or(u32::MAX)
}

fn sysfs_queue_value(meta: &std::fs::Metadata, name: &str) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    let rdev = meta.rdev();
    let (major, minor) = (libc::major(rdev), libc::minor(rdev));
    let base = format!("/sys/dev/block/{major}:{minor}");
    // A partition's queue is its disk's.
    let text = std::fs::read_to_string(format!("{base}/queue/{name}"))
        .or_else(|_| std::fs::read_to_string(format!("{base}/../queue/{name}")))
        .ok()?;
    text.trim().parse().ok()
}
