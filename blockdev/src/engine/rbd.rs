//! The engine's RBD half: each engine has its own handle on an image (opened ahead, off the
//! reactor, and taken when it attaches), whose completions
//! raise the engine's eventfd; operations are started at librbd and reaped in `reap`.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use super::{Engine, OpKind};
use crate::mem::DmaBuf;
use crate::rbd::{Image, Op};
use crate::BlockError;

/// What an engine keeps for its RBD images: the eventfd their completions raise, and the
/// operations out at librbd.
#[derive(Default)]
pub(super) struct RbdState {
    pub(super) eventfd: Option<OwnedFd>,
    pub(super) out: usize,
    pub(super) done: Vec<(usize, i64)>,
}

impl Engine {
    /// Blocks until an RBD completion raises the eventfd, or 100 ms (benchmarks and drains;
    /// a reactor polls instead).
    pub(super) fn wait_librbd(&mut self) -> io::Result<()> {
        if let Some(fd) = &self.rbd.eventfd {
            let mut p = libc::pollfd {
                fd: fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd for the duration of the call.
            let rc = unsafe { libc::poll(&mut p, 1, 100) };
            if rc < 0 && io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
                return Err(io::Error::last_os_error());
            }
        }
        Ok(())
    }

    /// A handle of this engine on `image`, notifying the engine's eventfd (made at the first).
    pub(super) fn rbd_handle(&mut self, image: &Image, wait: bool) -> io::Result<Option<Image>> {
        if self.rbd.eventfd.is_none() {
            // SAFETY: eventfd has no preconditions; a new fd is owned here.
            let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: `fd` is a new descriptor nothing else owns.
            self.rbd.eventfd = Some(unsafe { OwnedFd::from_raw_fd(fd) });
        }
        // One opened ahead by the control side if there is one: opening waits on the cluster.
        let h = match image.take_spare() {
            Some(h) => h,
            None if wait => image.reopen()?,
            None => return Ok(None),
        };
        h.notify(self.rbd.eventfd.as_ref().map_or(-1, AsRawFd::as_raw_fd))?;
        Ok(Some(h))
    }

    /// Starts slot `slot`'s operation at librbd; one it refuses finishes at once.
    pub(super) fn start_rbd(&mut self, slot: u32) {
        let s = self.slots[slot as usize].as_mut().expect("queued slot");
        let (op, ptr) = match s.op {
            OpKind::Read => (Op::Read, s.buf.as_mut().map(DmaBuf::as_mut_ptr)),
            OpKind::Write | OpKind::WriteFua => (
                Op::Write,
                match (s.buf.as_mut(), s.from) {
                    (Some(b), _) => Some(b.as_mut_ptr()),
                    (None, from) => from.map(std::ptr::NonNull::as_ptr),
                },
            ),
            OpKind::Flush => (Op::Flush, None),
            // librbd's writes are durable when they complete (no client cache: the device has
            // no volatile cache), so FUA asks nothing more.
            // Deallocated blocks read zeroes (DLFEAT): see `Op::WriteZeroes`.
            OpKind::WriteZeroes | OpKind::WriteZeroesFua | OpKind::Deallocate => {
                (Op::WriteZeroes, None)
            }
        };
        let (off, len) = (s.offset, u64::from(s.len));
        let image = self.devices[s.dev as usize]
            .as_ref()
            .and_then(|a| a.rbd.as_ref())
            .expect("an attached image");
        // SAFETY: a read's or write's buffer is owned by this slot (or `write_from`'s memory,
        // which its caller keeps valid) until the completion is polled in `reap_rbd`; `len`
        // is within it (checked by `queue_from`).
        let started = unsafe {
            image.start(
                op,
                off,
                len,
                ptr.unwrap_or(std::ptr::null_mut()),
                slot as usize,
            )
        };
        match started {
            Ok(()) => self.rbd.out += 1,
            Err(rc) => self.finish(slot, Err(BlockError::from_errno(-rc))),
        }
    }

    /// Test hook: this engine's handle on RBD image `dev` takes the image to be `size`
    /// bytes, as a handle that missed a growth made through another (its header
    /// notification timed out) does; librbd cuts what it is asked past there.
    #[doc(hidden)]
    pub fn rbd_handle_sees_size(&mut self, dev: super::DevId, size: u64) {
        if let Some(image) = self
            .devices
            .get(dev.0 as usize)
            .and_then(Option::as_ref)
            .and_then(|a| a.rbd.as_ref())
        {
            image.set_own_size(size);
        }
    }

    /// Takes in the RBD operations that completed.
    pub(super) fn reap_rbd(&mut self) {
        if self.rbd.out == 0 {
            return;
        }
        if let Some(fd) = &self.rbd.eventfd {
            let mut count = [0u8; 8];
            // SAFETY: reads 8 bytes into a local; a non-blocking eventfd with nothing to read
            // fails with EAGAIN, which is fine: the events are polled below either way.
            unsafe { libc::read(fd.as_raw_fd(), count.as_mut_ptr().cast(), 8) };
        }
        let mut done = std::mem::take(&mut self.rbd.done);
        for a in self.devices.iter().flatten() {
            if let Some(image) = &a.rbd {
                image.poll(&mut done);
            }
        }
        for (arg, rv) in done.drain(..) {
            let Ok(slot) = u32::try_from(arg) else {
                continue;
            };
            let Some(s) = self.slots.get(slot as usize).and_then(Option::as_ref) else {
                continue;
            };
            self.rbd.out -= 1;
            let data = matches!(s.op, OpKind::Read | OpKind::Write | OpKind::WriteFua);
            // librbd answers a read with the bytes read, a write with 0, and cuts either
            // short at the image's end: an image shrunk behind nvmfd's back. A short read's
            // tail would be whatever the buffer held, so it fails. A write cut short says
            // nothing of it, so a write is complete only if the image, as its handles' header
            // callbacks last saw it and as this handle did (`Image::write_limit`), still
            // reaches its end (not `rbd_get_size`: after a header change, a snapshot say, it
            // refreshes the header on this reactor first, waiting on the cluster).
            let short = |done: u32| {
                Err(BlockError::ShortTransfer {
                    expected: s.len,
                    done,
                })
            };
            let written_whole = || {
                let end = s.offset.saturating_add(u64::from(s.len));
                let image = self.devices[s.dev as usize]
                    .as_ref()
                    .and_then(|a| a.rbd.as_ref());
                match image.map(Image::write_limit) {
                    Some(size) if size < end => {
                        short(u32::try_from(size.saturating_sub(s.offset)).unwrap_or(0))
                    }
                    _ => Ok(s.len),
                }
            };
            let result = match i32::try_from(rv) {
                Ok(e) if e < 0 => Err(BlockError::from_errno(-e)),
                Ok(n) if s.op == OpKind::Read => {
                    let n = u32::try_from(n).unwrap_or(0);
                    if n < s.len {
                        short(n)
                    } else {
                        Ok(s.len)
                    }
                }
                _ if data => written_whole(),
                // A zeroing or a discard librbd cut at the handle's end leaves the blocks past
                // it as they were: not done either.
                _ if s.op != OpKind::Flush => written_whole().map(|_| 0),
                _ => Ok(0),
            };
            self.finish(slot, result);
        }
        self.rbd.done = done;
    }
}
