//! The per-reactor I/O engine: one io_uring for the files and block devices, and immediate
//! completion for RAM and null devices.

use std::collections::VecDeque;
use std::io;
use std::os::unix::io::AsRawFd;
use std::sync::Arc;

use io_uring::{opcode, squeue, types, IoUring};

use crate::device::{Backing, Device};
use crate::mem::{BufPool, DmaBuf};
use crate::BlockError;

#[cfg(feature = "rbd")]
mod rbd;
mod settle;
mod start;
#[cfg(feature = "rbd")]
use rbd::RbdState;
use settle::Parked;

/// A device attached to one engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DevId(pub u32);

/// What an operation does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpKind {
    /// Read into the buffer.
    Read,
    /// Write the buffer.
    Write,
    /// Write the buffer and make it durable before completing (FUA, `RWF_DSYNC`).
    WriteFua,
    /// Make every completed write durable (fdatasync).
    Flush,
    /// Zero a range.
    WriteZeroes,
    /// Zero a range and make it durable before completing (FUA): on a file or block device,
    /// an fdatasync follows the `fallocate`.
    WriteZeroesFua,
    /// Deallocate (trim) a range; it reads back as zeroes.
    Deallocate,
}

/// A finished operation.
#[derive(Debug)]
pub struct Completion {
    /// The caller's tag.
    pub tag: u64,
    /// What it was.
    pub op: OpKind,
    /// Bytes transferred (reads and writes; 0 otherwise), or why it failed.
    pub result: Result<u32, BlockError>,
    /// The buffer, handed back.
    pub buf: Option<DmaBuf>,
}

/// An operation the engine refused; the buffer comes back with the reason.
#[derive(Debug)]
pub struct Rejected {
    /// Why.
    pub error: BlockError,
    /// The buffer, handed back.
    pub buf: Option<DmaBuf>,
}

struct Attached {
    dev: Arc<Device>,
    /// Index in the ring's registered file table (files and block devices).
    file: Option<u32>,
    in_flight: usize,
    /// Flushes (and FUA operations through the page cache) that succeeded while syncs of
    /// the device's file begun before were in flight (on any engine).
    parked: Vec<Parked>,
    /// This engine's own handle on an RBD image, notifying the engine's eventfd.
    #[cfg(feature = "rbd")]
    rbd: Option<crate::rbd::Image>,
}

struct Slot {
    tag: u64,
    op: OpKind,
    dev: u32,
    offset: u64,
    len: u32,
    done: u32,
    buf: Option<DmaBuf>,
    /// A write's data in memory the engine does not own (`write_from`): its address.
    from: Option<std::ptr::NonNull<u8>>,
    /// Its number among the syncs of its device's file in flight (`Device::sync_begin`).
    sync: Option<u64>,
    /// A FUA operation's: the device's count of failed syncs when it started.
    failures_at_start: u64,
}

/// A deallocate's `done`: its hole was refused, the range is being zeroed instead.
const DEALLOCATE_AS_ZEROES: u32 = 1;
/// A deallocate's `done`: refused by a test hook ([`Device::fail_next_deallocates`]).
const DEALLOCATE_REFUSED: u32 = u32::MAX;

/// The largest region io_uring registers as one fixed buffer.
const MAX_FIXED_BUFFER: usize = 1 << 30;

/// One reactor's I/O engine. Not `Send`: it belongs to its reactor thread.
pub struct Engine {
    ring: IoUring,
    pools: Vec<BufPool>,
    devices: Vec<Option<Attached>>,
    slots: Vec<Option<Slot>>,
    free_slots: Vec<u32>,
    /// Finished operations not yet reaped, with their slots (freed when reaped, so that an
    /// unreaped completion still counts against the depth).
    ready: VecDeque<(u32, Completion)>,
    unsubmitted: usize,
    /// Completions parked in the devices' `parked`.
    parked: usize,
    max_devices: u32,
    /// Test hook ([`Engine::fail_next_wait`]): the errors the next waits in `drain` report
    /// instead of waiting, in order.
    wait_errors: Vec<i32>,
    #[cfg(feature = "rbd")]
    rbd: RbdState,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("depth", &self.slots.len())
            .field("in_flight", &self.in_flight())
            .finish()
    }
}

impl Engine {
    /// An engine with room for `depth` operations in flight (rounded up to a power of two),
    /// `max_devices` attached devices, and `pools` registered as fixed buffers.
    pub fn new(depth: u32, max_devices: u32, pools: &[BufPool]) -> io::Result<Engine> {
        let depth = depth.clamp(1, 4096).next_power_of_two();
        // Twice as many completion entries as operations: the CQ can never overflow.
        // One thread submits, and completions are delivered when it asks (as fio does):
        // task work runs at the engine's own `io_uring_enter`, not as interrupts. Kernels
        // older than 6.1 lack these flags: fall back to a plain ring.
        let ring = IoUring::builder()
            .setup_cqsize(depth * 2)
            .setup_single_issuer()
            .setup_defer_taskrun()
            .setup_coop_taskrun()
            .setup_taskrun_flag()
            .build(depth)
            .or_else(|_| IoUring::builder().setup_cqsize(depth * 2).build(depth))?;
        ring.submitter().register_files_sparse(max_devices.max(1))?;
        // The kernel refuses a fixed buffer over 1 GiB (EFAULT): a larger pool (256 buffers
        // of 8 MiB) is not registered and its I/O goes through plain reads and writes.
        let pools: Vec<BufPool> = pools
            .iter()
            .filter(|p| p.iovec().iov_len <= MAX_FIXED_BUFFER)
            .cloned()
            .collect();
        if !pools.is_empty() {
            let iovecs: Vec<libc::iovec> = pools.iter().map(BufPool::iovec).collect();
            // SAFETY: every iovec is a pool's whole region; this engine keeps a clone of each
            // pool (and so the region) alive until the ring is dropped, which unregisters.
            unsafe { ring.submitter().register_buffers(&iovecs)? };
        }
        let slots = (0..depth).map(|_| None).collect();
        Ok(Engine {
            ring,
            pools,
            devices: Vec::with_capacity(max_devices as usize),
            slots,
            free_slots: (0..depth).rev().collect(),
            ready: VecDeque::with_capacity(depth as usize),
            unsubmitted: 0,
            parked: 0,
            max_devices: max_devices.max(1),
            wait_errors: Vec::new(),
            #[cfg(feature = "rbd")]
            rbd: RbdState::default(),
        })
    }

    /// Attaches a device: files and block devices join the ring's registered file table. An
    /// RBD image takes a handle opened ahead ([`Device::prepare_handles`]) or opens its own,
    /// which waits on the cluster.
    pub fn attach(&mut self, dev: &Arc<Device>) -> io::Result<DevId> {
        self.attach_with(dev, true)?
            .ok_or_else(|| io::Error::other("no handle on the image"))
    }

    /// [`Engine::attach`], without waiting: an RBD image with no handle opened ahead is not
    /// attached (`None`), as opening one waits on the cluster.
    pub fn attach_ready(&mut self, dev: &Arc<Device>) -> io::Result<Option<DevId>> {
        self.attach_with(dev, false)
    }

    fn attach_with(&mut self, dev: &Arc<Device>, wait: bool) -> io::Result<Option<DevId>> {
        #[cfg(not(feature = "rbd"))]
        let _ = wait;
        if dev.take_injected_attach_failure() {
            return Err(io::Error::from_raw_os_error(libc::EMFILE));
        }
        let index = match self.devices.iter().position(Option::is_none) {
            Some(i) => i,
            None if self.devices.len() < self.max_devices as usize => {
                self.devices.push(None);
                self.devices.len() - 1
            }
            None => {
                return Err(io::Error::new(
                    io::ErrorKind::OutOfMemory,
                    "the engine's device table is full",
                ))
            }
        };
        let slot =
            u32::try_from(index).map_err(|_| io::Error::from_raw_os_error(libc::EOVERFLOW))?;
        let file = match &dev.backing {
            Backing::File(f) => {
                self.ring
                    .submitter()
                    .register_files_update(slot, &[f.as_raw_fd()])?;
                Some(slot)
            }
            _ => None,
        };
        #[cfg(feature = "rbd")]
        let rbd = match &dev.backing {
            Backing::Rbd(image) => match self.rbd_handle(image, wait)? {
                Some(h) => Some(h),
                // (The slot found stays free.)
                None => return Ok(None),
            },
            _ => None,
        };
        self.devices[index] = Some(Attached {
            dev: Arc::clone(dev),
            file,
            in_flight: 0,
            parked: Vec::new(),
            #[cfg(feature = "rbd")]
            rbd,
        });
        Ok(Some(DevId(slot)))
    }

    /// Detaches a device with no operation in flight.
    pub fn detach(&mut self, id: DevId) -> Result<(), BlockError> {
        let a = self
            .devices
            .get_mut(id.0 as usize)
            .and_then(Option::as_mut)
            .ok_or(BlockError::UnknownDevice)?;
        if a.in_flight > 0 || !a.parked.is_empty() {
            return Err(BlockError::QueueFull);
        }
        if a.file.is_some() {
            let _ = self.ring.submitter().register_files_update(id.0, &[-1]);
        }
        self.devices[id.0 as usize] = None;
        Ok(())
    }

    /// The attached device `id`.
    pub fn device(&self, id: DevId) -> Option<&Arc<Device>> {
        self.devices.get(id.0 as usize)?.as_ref().map(|a| &a.dev)
    }

    /// Test hook: operations that succeeded and wait for other engines' syncs to end.
    #[doc(hidden)]
    pub fn parked_ops(&self) -> usize {
        self.parked
    }

    /// Operations queued or in flight, reaped or not.
    pub fn in_flight(&self) -> usize {
        self.slots.len() - self.free_slots.len()
    }

    /// Whether an operation that reads or writes past `end` bytes of `dev` is queued or in
    /// flight here (reaped or not): a shrink of `dev` to `end` waits until none is left
    /// anywhere before it cuts the backend (`Device::resize_fenced`): such a write could
    /// extend it again, and such a read, running while the tail is cut (librbd deletes an
    /// image's objects one by one), would return zeroes as data.
    pub fn io_past(&self, dev: &Arc<Device>, end: u64) -> bool {
        self.slots.iter().flatten().any(|s| {
            s.op != OpKind::Flush
                && s.offset.saturating_add(u64::from(s.len)) > end
                && self
                    .devices
                    .get(s.dev as usize)
                    .and_then(Option::as_ref)
                    .is_some_and(|a| Arc::ptr_eq(&a.dev, dev))
        })
    }

    /// Room for this many more operations.
    pub fn capacity_left(&self) -> usize {
        self.free_slots.len()
    }

    /// Queues a read of `buf.len()` bytes at `offset`.
    pub fn read(&mut self, dev: DevId, offset: u64, buf: DmaBuf, tag: u64) -> Result<(), Rejected> {
        self.queue(dev, OpKind::Read, offset, 0, Some(buf), tag)
    }

    /// Queues a write of `buf.len()` bytes at `offset`; with `fua`, durable when it completes.
    pub fn write(
        &mut self,
        dev: DevId,
        offset: u64,
        buf: DmaBuf,
        fua: bool,
        tag: u64,
    ) -> Result<(), Rejected> {
        let op = if fua { OpKind::WriteFua } else { OpKind::Write };
        self.queue(dev, op, offset, 0, Some(buf), tag)
    }

    /// Queues a write of `len` bytes at `offset` from memory that is not a pool buffer (the
    /// receive buffer a host's in-capsule data arrived in); with `fua`, durable when it
    /// completes. The completion carries no buffer.
    ///
    /// # Safety
    ///
    /// `data..data + len` must be readable, and must stay valid and unchanged until this
    /// operation's completion has been reaped (or the engine dropped, which waits for it).
    pub unsafe fn write_from(
        &mut self,
        dev: DevId,
        offset: u64,
        data: std::ptr::NonNull<u8>,
        len: u32,
        fua: bool,
        tag: u64,
    ) -> Result<(), Rejected> {
        let op = if fua { OpKind::WriteFua } else { OpKind::Write };
        self.queue_from(dev, op, offset, u64::from(len), None, Some(data), tag)
    }

    /// Queues a flush: every write completed before it is durable when it completes.
    pub fn flush(&mut self, dev: DevId, tag: u64) -> Result<(), Rejected> {
        self.queue(dev, OpKind::Flush, 0, 0, None, tag)
    }

    /// Queues zeroing `len` bytes at `offset`; with `fua`, they are durable when it completes.
    pub fn write_zeroes(
        &mut self,
        dev: DevId,
        offset: u64,
        len: u64,
        fua: bool,
        tag: u64,
    ) -> Result<(), Rejected> {
        let op = if fua {
            OpKind::WriteZeroesFua
        } else {
            OpKind::WriteZeroes
        };
        self.queue(dev, op, offset, len, None, tag)
    }

    /// Queues deallocating `len` bytes at `offset`.
    pub fn deallocate(
        &mut self,
        dev: DevId,
        offset: u64,
        len: u64,
        tag: u64,
    ) -> Result<(), Rejected> {
        self.queue(dev, OpKind::Deallocate, offset, len, None, tag)
    }

    fn queue(
        &mut self,
        dev: DevId,
        op: OpKind,
        offset: u64,
        len: u64,
        buf: Option<DmaBuf>,
        tag: u64,
    ) -> Result<(), Rejected> {
        self.queue_from(dev, op, offset, len, buf, None, tag)
    }

    #[allow(clippy::too_many_arguments)]
    fn queue_from(
        &mut self,
        dev: DevId,
        op: OpKind,
        offset: u64,
        len: u64,
        buf: Option<DmaBuf>,
        from: Option<std::ptr::NonNull<u8>>,
        tag: u64,
    ) -> Result<(), Rejected> {
        let reject = |error, buf| Err(Rejected { error, buf });
        let Some(a) = self.devices.get(dev.0 as usize).and_then(Option::as_ref) else {
            return reject(BlockError::UnknownDevice, buf);
        };
        let info = &a.dev.info;
        let len = buf.as_ref().map_or(len, |b| b.len() as u64);
        let writes = !matches!(op, OpKind::Read | OpKind::Flush);
        if writes && info.read_only {
            return reject(BlockError::ReadOnly, buf);
        }
        match op {
            OpKind::WriteZeroes | OpKind::WriteZeroesFua if !info.write_zeroes => {
                return reject(BlockError::Unsupported("write zeroes"), buf)
            }
            OpKind::Deallocate if !info.deallocate => {
                return reject(BlockError::Unsupported("deallocate"), buf)
            }
            // (A Flush of a device whose sync failed before still runs, and then fails:
            // `finish`.)
            OpKind::Flush => {}
            _ => {
                if let Err(e) = a.dev.check_range(offset, len) {
                    return reject(e, buf);
                }
            }
        }
        let Ok(len32) = u32::try_from(len) else {
            return reject(BlockError::Unsupported("transfers of 4 GiB or more"), buf);
        };
        let Some(slot) = self.free_slots.pop() else {
            return reject(BlockError::QueueFull, buf);
        };
        let dev_index = dev.0;
        let failures_at_start = match op {
            OpKind::WriteFua | OpKind::WriteZeroesFua => self.devices[dev_index as usize]
                .as_ref()
                .map_or(0, |a| a.dev.sync_failures()),
            _ => 0,
        };
        self.slots[slot as usize] = Some(Slot {
            tag,
            op,
            dev: dev_index,
            offset,
            len: len32,
            done: 0,
            buf,
            from,
            sync: None,
            failures_at_start,
        });
        if let Some(a) = self.devices[dev_index as usize].as_mut() {
            a.in_flight += 1;
        }
        let is_file = self.devices[dev_index as usize]
            .as_ref()
            .is_some_and(|a| a.file.is_some());
        #[cfg(feature = "rbd")]
        let is_rbd = self.devices[dev_index as usize]
            .as_ref()
            .is_some_and(|a| a.rbd.is_some());
        #[cfg(not(feature = "rbd"))]
        let is_rbd = false;
        if is_file {
            self.push_sqe(slot);
        } else if is_rbd {
            #[cfg(feature = "rbd")]
            self.start_rbd(slot);
        } else {
            self.complete_in_memory(slot);
        }
        Ok(())
    }

    /// Submits everything queued since the last call, in one system call. A busy kernel is
    /// back-pressure: the entries stay queued for the next call.
    pub fn submit(&mut self) -> io::Result<usize> {
        // With deferred task work, completions wait for an enter: make one when the kernel
        // says it has some, even with nothing new to submit.
        if self.unsubmitted == 0 && !self.ring.submission().taskrun() {
            return Ok(0);
        }
        match self.ring.submit() {
            Ok(n) => {
                self.unsubmitted = self.unsubmitted.saturating_sub(n);
                Ok(n)
            }
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EBUSY) | Some(libc::EAGAIN) | Some(libc::EINTR)
                ) =>
            {
                Ok(0)
            }
            Err(e) => Err(e),
        }
    }

    /// Hands every finished operation to `f`, without blocking; returns how many.
    ///
    /// A partial read or write is resubmitted for its remainder (and completes later); one
    /// that transferred nothing is reported as [`BlockError::ShortTransfer`].
    ///
    /// It makes no system call: with deferred task work, operations the kernel finished are
    /// posted at the next [`Engine::submit`] (which enters when the kernel has task work),
    /// so that a loop that reaps, queues and submits once per turn enters the kernel at most
    /// once per turn.
    pub fn reap(&mut self, mut f: impl FnMut(Completion)) -> usize {
        #[cfg(feature = "rbd")]
        self.reap_rbd();
        loop {
            let Some(cqe) = self.ring.completion().next() else {
                break;
            };
            let Ok(slot) = u32::try_from(cqe.user_data()) else {
                continue;
            };
            let mut res = cqe.result();
            let Some(s) = self.slots.get_mut(slot as usize).and_then(Option::as_mut) else {
                continue;
            };
            if s.op == OpKind::Deallocate && s.done != DEALLOCATE_AS_ZEROES {
                if s.done == DEALLOCATE_REFUSED {
                    res = -libc::EOPNOTSUPP;
                }
                // A block device whose driver turned its write-zeroes off after it was opened
                // (SCSI's, after the device refused a WRITE SAME) refuses the hole: the
                // range is zeroed (written with zeroes if need be) instead. A host was
                // offered Deallocate and told deallocated blocks read zeroes.
                let zeroes = self.devices[s.dev as usize]
                    .as_ref()
                    .is_some_and(|a| a.dev.info.write_zeroes);
                if res == -libc::EOPNOTSUPP && zeroes {
                    s.done = DEALLOCATE_AS_ZEROES;
                    self.push_sqe(slot);
                    continue;
                }
            }
            if res < 0 {
                self.finish(slot, Err(BlockError::from_errno(-res)));
                continue;
            }
            let data = matches!(s.op, OpKind::Read | OpKind::Write | OpKind::WriteFua);
            if s.op == OpKind::WriteZeroesFua && s.done == 0 {
                // Zeroed: now made durable.
                s.done = 1;
                self.push_sqe(slot);
                continue;
            }
            if !data {
                self.finish(slot, Ok(0));
                continue;
            }
            let n = res.unsigned_abs();
            if n == 0 {
                let (expected, done) = (s.len, s.done);
                self.finish(slot, Err(BlockError::ShortTransfer { expected, done }));
                continue;
            }
            s.done = s.done.saturating_add(n).min(s.len);
            if s.done < s.len {
                self.push_sqe(slot);
            } else {
                let len = s.len;
                self.finish(slot, Ok(len));
            }
        }
        self.release_parked(false);
        let mut n = 0;
        while let Some((slot, c)) = self.ready.pop_front() {
            self.free_slots.push(slot);
            f(c);
            n += 1;
        }
        n
    }

    /// Submits what is queued and blocks until at least `min` operations have finished (or
    /// none is in flight). For benchmarks and shutdown; a reactor polls instead.
    pub fn wait(&mut self, min: usize) -> io::Result<()> {
        let kernel_owned = self.ring_owned();
        if self.ready.is_empty() && kernel_owned == 0 && self.librbd_owned() > 0 {
            return self.wait_librbd();
        }
        if !self.ready.is_empty() || kernel_owned == 0 {
            return self.submit().map(drop);
        }
        match self.ring.submit_and_wait(min.min(kernel_owned)) {
            Ok(_) => {
                self.unsubmitted = 0;
                Ok(())
            }
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EINTR) | Some(libc::EBUSY) | Some(libc::EAGAIN)
                ) =>
            {
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// Test hook: the next wait of [`Engine::drain`] for the kernel fails with `errno` (and
    /// so on, in order, for more calls).
    #[doc(hidden)]
    pub fn fail_next_wait(&mut self, errno: i32) {
        self.wait_errors.push(errno);
    }

    /// Submits and waits until every operation has finished, handing each to `f`. A wait the
    /// kernel cuts short (EINTR), or answers busy (EBUSY, EAGAIN: completions to reap first,
    /// or no memory for now) is tried again, as in [`Engine::wait`]: an error here leaves
    /// operations with the kernel that its caller must then never free the memory of.
    pub fn drain(&mut self, mut f: impl FnMut(Completion)) -> io::Result<()> {
        // A kernel busy for this long (no memory, say) is given up on: the caller then leaks
        // what the operations may still use.
        const BUSY_LIMIT: std::time::Duration = std::time::Duration::from_secs(10);
        let mut busy_since: Option<std::time::Instant> = None;
        while self.in_flight() > 0 || !self.ready.is_empty() {
            self.submit()?;
            let kernel_owned = self.ring_owned();
            if kernel_owned > 0 && self.ready.is_empty() {
                let waited = if self.wait_errors.is_empty() {
                    self.ring.submit_and_wait(1)
                } else {
                    Err(io::Error::from_raw_os_error(self.wait_errors.remove(0)))
                };
                match waited {
                    Ok(_) => {
                        self.unsubmitted = 0;
                        busy_since = None;
                    }
                    Err(e)
                        if matches!(
                            e.raw_os_error(),
                            Some(libc::EINTR) | Some(libc::EBUSY) | Some(libc::EAGAIN)
                        ) =>
                    {
                        let since = *busy_since.get_or_insert_with(std::time::Instant::now);
                        if since.elapsed() >= BUSY_LIMIT {
                            return Err(e);
                        }
                        // A busy kernel is not spun on: it is asked again after a yield.
                        std::thread::yield_now();
                    }
                    Err(e) => return Err(e),
                }
            } else if self.ready.is_empty() && self.librbd_owned() > 0 {
                self.wait_librbd()?;
            } else if self.ready.is_empty() && self.parked > 0 {
                // Only operations waiting for other engines' syncs are left.
                self.release_parked(true);
            }
            self.reap(&mut f);
        }
        Ok(())
    }

    /// Operations the kernel has (in the ring, not yet completed).
    fn ring_owned(&self) -> usize {
        self.in_flight() - self.ready.len() - self.librbd_owned() - self.parked
    }

    /// Without RBD images, nothing waits at librbd.
    #[cfg(not(feature = "rbd"))]
    #[allow(clippy::unused_self, clippy::unnecessary_wraps)]
    fn wait_librbd(&mut self) -> io::Result<()> {
        Ok(())
    }

    /// Operations librbd has.
    fn librbd_owned(&self) -> usize {
        #[cfg(feature = "rbd")]
        return self.rbd.out;
        #[cfg(not(feature = "rbd"))]
        0
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // The kernel may still be using buffers of operations in flight: wait for all of them
        // before the buffers and registrations go away.
        if self.drain(drop).is_err() {
            // The ring is unusable; in-flight buffers are leaked rather than freed under the
            // kernel.
            for s in self.slots.iter_mut() {
                if let Some(slot) = s.take() {
                    // A sync whose end is never seen may have taken a writeback error's
                    // report: every later Flush of its device fails. Its number ends here,
                    // or the Flushes of the device on every engine would wait for it.
                    if let Some(n) = slot.sync {
                        if let Some(a) =
                            self.devices.get(slot.dev as usize).and_then(Option::as_ref)
                        {
                            a.dev.note_sync_failure();
                            a.dev.sync_end(n);
                        }
                    }
                    std::mem::forget(slot.buf);
                }
            }
            // Operations may still be at librbd: their completions write to the eventfd,
            // until the handles' closes (on threads of their own, later) have waited for
            // them. The descriptor is leaked, so that its number is not reused meanwhile.
            #[cfg(feature = "rbd")]
            if let Some(fd) = self.rbd.eventfd.take() {
                std::mem::forget(fd);
            }
        }
    }
}
