//! What the protocol core knows of the block devices under its namespaces: their size and
//! capabilities ([`NamespaceInfo`]) and how an operation on one failed ([`BlockFailure`]).
//! The transport fills both in from its block layer (nvmfd's from `nvmfd-blockdev`); the
//! core depends on no block layer.

/// A namespace's device as the core sees it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NamespaceInfo {
    /// Capacity in bytes, a whole number of logical blocks.
    pub size: u64,
    /// Logical block size: the unit of every LBA.
    pub logical_block_size: u32,
    /// Physical block size (for the host's alignment hints).
    pub physical_block_size: u32,
    /// Writes are refused.
    pub read_only: bool,
    /// Write Zeroes is supported.
    pub write_zeroes: bool,
    /// Deallocate is supported; deallocated blocks read back as zeroes.
    pub deallocate: bool,
    /// The most logical blocks one deallocate operation takes (0: no limit).
    pub deallocate_max_blocks: u32,
    /// Flush does something (a volatile write cache).
    pub volatile_cache: bool,
}

impl NamespaceInfo {
    /// Capacity in logical blocks.
    pub fn blocks(&self) -> u64 {
        self.size / u64::from(self.logical_block_size.max(1))
    }
}

/// How a block operation failed: what the NVMe status of its command depends on
/// ([`crate::block_error_status`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BlockFailure {
    /// Offset or length not a whole number of blocks.
    #[error("misaligned")]
    Misaligned,
    /// The range ends past the device's end.
    #[error("out of range")]
    OutOfRange,
    /// A write to a read-only device.
    #[error("read-only")]
    ReadOnly,
    /// An operation the device does not support.
    #[error("unsupported")]
    Unsupported,
    /// The device is full.
    #[error("no space")]
    NoSpace,
    /// No room for the operation now (back-pressure that escaped the transport).
    #[error("queue full")]
    QueueFull,
    /// No such device.
    #[error("unknown device")]
    UnknownDevice,
    /// The device failed the operation or transferred less than asked.
    #[error("I/O error")]
    Io,
    /// The storage behind the device cannot be reached for now (a network store timed out):
    /// the same command may succeed later.
    #[error("storage unavailable")]
    Unavailable,
}
