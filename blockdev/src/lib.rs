//! Block devices for nvmfd: how a reactor reaches the disks.
//!
//! - [`BufPool`] / [`DmaBuf`]: page-aligned memory that io_uring registers as fixed buffers and
//!   the RDMA layer as memory regions, so a block goes from disk to wire with no copy.
//! - [`Device`]: an open file, block device, RAM disk (`malloc`), `null` device or Ceph RBD
//!   image (the `rbd` feature), with a [`DeviceInfo`] saying its size, block sizes and
//!   capabilities.
//! - [`Engine`]: one per reactor. It owns one io_uring, queues read, write (optionally FUA),
//!   flush, write-zeroes and deallocate operations, submits them with one system call per loop
//!   turn, and reaps completions without blocking. An operation owns its buffer until its
//!   completion hands it back. RBD operations go through librbd's asynchronous calls on the
//!   engine's own image handle and are polled in from its event queue.

mod device;
mod engine;
mod mem;
#[cfg(feature = "rbd")]
mod rbd;

pub use device::{Device, DeviceInfo, DeviceSpec, Kind, RbdSpec, StoreIdentity};

/// Waits until every RBD image handle let go so far is closed, or `timeout`: whether they all
/// are. Handles are closed on a thread of their own (closing one can wait on the cluster for
/// as long as an OSD operation may take). A process that opened RBD images calls this before
/// it returns from `main`: the cluster would otherwise keep their watches until they time
/// out, and librados' and librbd's static destructors, run by `exit`, would run under a close
/// still inside librbd and can crash the process. If it returns false, leave with
/// `libc::_exit` instead. Without RBD: true at once.
pub fn wait_for_rbd_closes(timeout: std::time::Duration) -> bool {
    #[cfg(feature = "rbd")]
    return rbd::wait_for_closes(timeout);
    #[cfg(not(feature = "rbd"))]
    {
        let _ = timeout;
        true
    }
}

/// RBD image handles let go and not closed yet.
pub fn rbd_closes_pending() -> usize {
    #[cfg(feature = "rbd")]
    return rbd::closes_pending();
    #[cfg(not(feature = "rbd"))]
    0
}
pub use engine::{Completion, DevId, Engine, OpKind, Rejected};
pub use mem::{BufPool, DmaBuf, DmaRegion, DMA_ALIGN};

/// Why a block operation was refused or failed: the small set the NVMe layer maps to status
/// codes.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BlockError {
    /// offset or length not a whole number of logical blocks, or zero length
    #[error("offset {offset} / length {len} are not a non-zero multiple of the {block_size}-byte block size")]
    Misaligned {
        /// Byte offset asked for.
        offset: u64,
        /// Byte length asked for.
        len: u64,
        /// The device's logical block size.
        block_size: u32,
    },
    /// the range ends past the device's end
    #[error("range {offset}+{len} is past the end of the device ({size} bytes)")]
    OutOfRange {
        /// Byte offset asked for.
        offset: u64,
        /// Byte length asked for.
        len: u64,
        /// Device size.
        size: u64,
    },
    /// a write to a read-only device
    #[error("the device is read-only")]
    ReadOnly,
    /// an operation the device does not support
    #[error("the device does not support {0}")]
    Unsupported(&'static str),
    /// the engine has no room for another operation now: retry after reaping
    #[error("the submission queue is full")]
    QueueFull,
    /// no such device on this engine
    #[error("unknown device")]
    UnknownDevice,
    /// the device is full
    #[error("no space left on the device")]
    NoSpace,
    /// the transfer ended early (the file shrank under nvmfd)
    #[error("short transfer: {done} of {expected} bytes")]
    ShortTransfer {
        /// Bytes asked for.
        expected: u32,
        /// Bytes transferred.
        done: u32,
    },
    /// any other error from the kernel (errno)
    #[error("I/O error: {}", std::io::Error::from_raw_os_error(*.0))]
    Io(i32),
}

impl BlockError {
    /// Whether this is back-pressure (retry later) rather than a failure.
    pub fn is_backpressure(&self) -> bool {
        matches!(self, BlockError::QueueFull)
    }

    pub(crate) fn from_errno(errno: i32) -> BlockError {
        match errno {
            // A quota (a file system's, an RBD pool's) is the capacity run out as well.
            libc::ENOSPC | libc::EDQUOT => BlockError::NoSpace,
            libc::EOPNOTSUPP => BlockError::Unsupported("this operation"),
            // (EBADF is not a read-only device's: writes to one are refused before they are
            // made. It is a call refused for its descriptor, which never ran.)
            libc::EROFS => BlockError::ReadOnly,
            e => BlockError::Io(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::BlockError;

    #[test]
    fn a_full_store_or_a_quota_reached_is_no_space_and_the_rest_keep_their_errno() {
        assert!(matches!(
            BlockError::from_errno(libc::ENOSPC),
            BlockError::NoSpace
        ));
        assert!(matches!(
            BlockError::from_errno(libc::EDQUOT),
            BlockError::NoSpace
        ));
        assert!(matches!(
            BlockError::from_errno(libc::EROFS),
            BlockError::ReadOnly
        ));
        assert!(matches!(
            BlockError::from_errno(libc::EIO),
            BlockError::Io(libc::EIO)
        ));
        assert!(matches!(
            BlockError::from_errno(libc::EBADF),
            BlockError::Io(libc::EBADF)
        ));
    }
}
