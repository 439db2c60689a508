//! DMA memory: page-aligned regions that io_uring registers as fixed buffers (and the RDMA
//! layer as memory regions), and owned buffers cut from them.
//!
//! A [`DmaBuf`] is the only handle to its bytes. An I/O operation takes the `DmaBuf` and gives
//! it back only in its completion, so no one can touch or free memory the kernel is using.

use std::cell::RefCell;
use std::io;
use std::ptr::NonNull;
use std::rc::Rc;

/// Alignment of every region and buffer: one page, which satisfies O_DIRECT on every logical
/// block size nvmfd supports.
pub const DMA_ALIGN: usize = 4096;

/// The memory available for new allocations without swapping (`MemAvailable` of
/// /proc/meminfo: normal pages, not the huge page pool), in bytes; `None` where it cannot be
/// read.
pub(crate) fn memory_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// One mmap'd, page-aligned, zero-filled region.
#[derive(Debug)]
pub struct DmaRegion {
    ptr: NonNull<u8>,
    len: usize,
    huge: bool,
}

impl DmaRegion {
    /// Maps `len` bytes (rounded up to a page). With `huge`, 2 MiB huge pages are tried first
    /// and normal pages used when none are available; [`DmaRegion::is_huge`] tells which.
    pub fn new(len: usize, huge: bool) -> io::Result<DmaRegion> {
        if huge {
            if let Some(r) = DmaRegion::huge(len)? {
                return Ok(r);
            }
        }
        DmaRegion::map(len, false)?.ok_or_else(io::Error::last_os_error)
    }

    /// Maps `len` bytes (rounded up to 2 MiB) of 2 MiB huge pages, whatever the system's
    /// default huge page size; `None` when too few are free (nothing is mapped then).
    pub fn huge(len: usize) -> io::Result<Option<DmaRegion>> {
        DmaRegion::map(len, true)
    }

    fn map(len: usize, huge: bool) -> io::Result<Option<DmaRegion>> {
        if len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a DMA region cannot be empty",
            ));
        }
        let len = len.div_ceil(DMA_ALIGN) * DMA_ALIGN;
        let base = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE;
        let attempt = |flags: i32, len: usize| {
            // SAFETY: an anonymous private mapping with no address hint touches no existing
            // memory; the result is checked against MAP_FAILED.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    flags,
                    -1,
                    0,
                )
            };
            (p != libc::MAP_FAILED).then_some(p)
        };
        // The page size named (MAP_HUGE_2MB), not the default: with 1 GiB default pages the
        // kernel would round the mapping up to 1 GiB, and unmapping the 2 MiB multiple asked
        // for would fail, the region leaked.
        let (flags, len) = if huge {
            (
                base | libc::MAP_HUGETLB | libc::MAP_HUGE_2MB,
                len.div_ceil(2 << 20) * (2 << 20),
            )
        } else {
            (base, len)
        };
        Ok(attempt(flags, len)
            .and_then(|p| NonNull::new(p.cast()))
            .map(|ptr| DmaRegion { ptr, len, huge }))
    }

    /// Start of the region.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: regions are never empty.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Whether the region is backed by huge pages.
    pub fn is_huge(&self) -> bool {
        self.huge
    }

    /// The region as an iovec, for buffer registration.
    pub fn iovec(&self) -> libc::iovec {
        libc::iovec {
            iov_base: self.ptr.as_ptr().cast(),
            iov_len: self.len,
        }
    }
}

impl Drop for DmaRegion {
    fn drop(&mut self) {
        // SAFETY: the mapping was created by `new` with this pointer and length, and every
        // `DmaBuf` holds an `Rc` of its pool, which holds the region: no buffer outlives it.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

struct PoolInner {
    region: DmaRegion,
    free: Vec<u32>,
}

/// A pool of equal, page-aligned buffers cut from one region: the per-reactor arena.
///
/// Taking and returning a buffer is a push or pop on a preallocated free list: no allocation.
/// Single-threaded by construction (`Rc`), like the reactor that owns it.
#[derive(Clone)]
pub struct BufPool {
    inner: Rc<RefCell<PoolInner>>,
    /// Copy of the region's pointer and length, readable without borrowing.
    base: *mut u8,
    len: usize,
    buf_size: usize,
    /// Buffers made: the region may be longer (whole huge pages), never shorter.
    count: usize,
}

impl std::fmt::Debug for BufPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BufPool")
            .field("buf_size", &self.buf_size)
            .field("count", &self.count())
            .field("free", &self.free_count())
            .finish()
    }
}

impl BufPool {
    /// A pool of `count` buffers of `buf_size` bytes (rounded up to a page) in one region.
    pub fn new(count: u32, buf_size: usize, huge: bool) -> io::Result<BufPool> {
        let buf_size = buf_size.max(1).div_ceil(DMA_ALIGN) * DMA_ALIGN;
        let total = (count as usize)
            .checked_mul(buf_size)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "pool too large"))?;
        let region = DmaRegion::new(total, huge)?;
        let base = region.as_ptr();
        let len = region.len();
        let free = (0..count).rev().collect();
        Ok(BufPool {
            inner: Rc::new(RefCell::new(PoolInner { region, free })),
            base,
            len,
            buf_size,
            count: count as usize,
        })
    }

    /// Whether the pool's region is backed by huge pages.
    pub fn is_huge(&self) -> bool {
        self.inner.borrow().region.is_huge()
    }

    /// Takes a free buffer, with its length set to its capacity; `None` when all are in use.
    pub fn take(&self) -> Option<DmaBuf> {
        let index = self.inner.borrow_mut().free.pop()?;
        // SAFETY: index < count, so the offset is inside the region.
        let ptr = unsafe { self.base.add(index as usize * self.buf_size) };
        Some(DmaBuf {
            pool: self.clone(),
            ptr: NonNull::new(ptr)?,
            index,
            len: self.buf_size,
        })
    }

    /// Capacity of each buffer.
    pub fn buf_size(&self) -> usize {
        self.buf_size
    }

    /// Number of buffers.
    pub fn count(&self) -> usize {
        self.count
    }

    /// Buffers not taken.
    pub fn free_count(&self) -> usize {
        self.inner.borrow().free.len()
    }

    /// The pool's region as an iovec, for registration with io_uring or an RDMA device.
    pub fn iovec(&self) -> libc::iovec {
        self.inner.borrow().region.iovec()
    }

    /// Whether `ptr..ptr+len` lies inside this pool's region.
    pub fn contains(&self, ptr: *const u8, len: usize) -> bool {
        let start = self.base as usize;
        let p = ptr as usize;
        p >= start
            && p.checked_add(len)
                .is_some_and(|end| end <= start + self.len)
    }

    fn same(&self, other: &BufPool) -> bool {
        Rc::ptr_eq(&self.inner, &other.inner)
    }
}

/// An owned, page-aligned buffer from a [`BufPool`], returned to the pool when dropped.
///
/// Its length (`len`) is how many bytes an I/O reads or writes; its capacity is the pool's
/// buffer size.
pub struct DmaBuf {
    pool: BufPool,
    ptr: NonNull<u8>,
    index: u32,
    len: usize,
}

impl std::fmt::Debug for DmaBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DmaBuf")
            .field("index", &self.index)
            .field("len", &self.len)
            .finish()
    }
}

impl DmaBuf {
    /// Bytes an I/O will transfer.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether `len` is zero.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Capacity (the pool's buffer size).
    pub fn capacity(&self) -> usize {
        self.pool.buf_size
    }

    /// Sets the transfer length; fails (returning false) above the capacity.
    pub fn set_len(&mut self, len: usize) -> bool {
        if len > self.capacity() {
            return false;
        }
        self.len = len;
        true
    }

    /// The pool it came from.
    pub fn pool(&self) -> &BufPool {
        &self.pool
    }

    /// Whether it came from `pool`.
    pub fn is_from(&self, pool: &BufPool) -> bool {
        self.pool.same(pool)
    }

    /// Start of the buffer (for the kernel or the NIC).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The first `len` bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr..ptr+capacity is inside the live region (the pool is held), `len` is at
        // most the capacity, and this handle is the only one to these bytes; `&self` keeps
        // them from being handed to an I/O meanwhile.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The first `len` bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for DmaBuf {
    fn drop(&mut self) {
        self.pool.inner.borrow_mut().free.push(self.index);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_disjoint_and_returned_on_drop() {
        let pool = BufPool::new(4, 5000, false).unwrap();
        assert_eq!(pool.buf_size(), 8192);
        let mut bufs: Vec<DmaBuf> = (0..4).map(|_| pool.take().unwrap()).collect();
        assert!(pool.take().is_none(), "a fifth buffer from a pool of four");
        let mut starts: Vec<usize> = bufs.iter_mut().map(|b| b.as_mut_ptr() as usize).collect();
        starts.sort_unstable();
        for w in starts.windows(2) {
            assert!(w[1] - w[0] >= 8192);
        }
        assert!(starts.iter().all(|s| s % DMA_ALIGN == 0));
        bufs[0].as_mut_slice().fill(0xab);
        assert!(bufs[0].as_slice().iter().all(|&b| b == 0xab));
        assert!(
            bufs[1].as_slice().iter().all(|&b| b == 0),
            "fresh memory is zeroed"
        );
        assert!(!bufs[0].set_len(8193));
        assert!(bufs[0].set_len(512));
        assert_eq!(bufs[0].as_slice().len(), 512);
        drop(bufs.pop());
        assert_eq!(pool.free_count(), 1);
        assert!(pool.take().is_some());
    }

    #[test]
    fn huge_pages_fall_back_to_normal_pages() {
        let r = DmaRegion::new(4096, true).unwrap();
        assert!(r.len() >= 4096);
        // Whichever backs it, it is usable.
        // SAFETY: the region is at least one page and owned here.
        unsafe { r.as_ptr().write(1) };
    }
}
