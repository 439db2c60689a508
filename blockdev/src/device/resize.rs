//! Changing a device's capacity while reactors serve it: checked first, a shrink fenced
//! against the writes let through before it.

use std::io;
use std::os::unix::io::AsRawFd;

use super::{Backing, Device, Kind, BLKGETSIZE64};

impl Device {
    /// Whether [`Device::resize`] with `size` can be made, as far as can be told without
    /// making it (the size's form, the device's kind and, for RAM, what it was created with):
    /// what is refused here changes nothing, so several resizes can all be checked first.
    pub fn check_resize(&self, size: Option<u64>) -> io::Result<()> {
        let bad = |msg: String| io::Error::new(io::ErrorKind::InvalidInput, msg);
        let bs = u64::from(self.info.logical_block_size);
        if let Some(n) = size {
            if n == 0 || !n.is_multiple_of(bs) {
                return Err(bad(format!(
                    "size {n} is not a non-zero number of {bs}-byte blocks"
                )));
            }
            if self.info.read_only {
                return Err(bad("the namespace is read-only".into()));
            }
        }
        match (&self.backing, size) {
            (Backing::File(_), Some(_)) if self.info.kind != Kind::File => Err(bad(
                "a block device's size is its own: resize the device, then resize the \
                 namespace without a size"
                    .into(),
            )),
            (Backing::Malloc(ram), Some(n)) if n > ram.len() as u64 => Err(bad(format!(
                "a RAM namespace cannot grow past the {} bytes it was created with",
                ram.len()
            ))),
            (Backing::Malloc(_) | Backing::Null, None) => {
                Err(bad("a RAM or null namespace needs the new size".into()))
            }
            _ => Ok(()),
        }
    }

    /// Changes the capacity: to `size` bytes (a file is truncated or extended, an RBD image
    /// resized, a null device takes it, RAM within what was allocated at open), or, with
    /// `None`, to what the backend reports now (a file, block device or RBD image resized
    /// outside nvmfd). Returns the new capacity, a whole number of logical blocks.
    pub fn resize(&self, size: Option<u64>) -> io::Result<u64> {
        self.resize_fenced(size, || Ok(()))
    }

    /// [`Device::resize`]; a shrink to `size` first stores the new capacity (every engine
    /// refuses an operation past it from then on), then runs `fence`, which must return once
    /// no read or write past it queued before is left at any engine (a reactor's turn, then
    /// its operations past the end completed: `Engine::io_past`), and only then cuts the
    /// backend. Cut first, a write already let through could extend a file (or recreate an
    /// image's objects) past the new end, where a later grow would read its old data and a
    /// restart would find the larger size; and a read could return the tail being deleted
    /// as zeroes. The tail of a RAM device is zeroed then, as a file's
    /// truncated tail reads back zeroes. A failed fence or cut puts the capacity back, but
    /// for an RBD image whose cut failed: librbd deletes the objects past the new end before
    /// it updates the image's size, so the tail may be partly gone (it would read zeroes as
    /// if they were the data); the capacity stays the new one, the error says so, and the
    /// next resize of any kind (a grow, a size read again) completes that cut first.
    pub fn resize_fenced(
        &self,
        size: Option<u64>,
        fence: impl FnOnce() -> io::Result<()>,
    ) -> io::Result<u64> {
        self.check_resize(size)?;
        self.finish_cut()?;
        let before = self.size();
        if let Some(n) = size.filter(|&n| n < before) {
            self.size.store(n, std::sync::atomic::Ordering::Release);
            let put_back = || {
                self.size
                    .store(before, std::sync::atomic::Ordering::Release);
            };
            if let Err(e) = fence() {
                put_back();
                return Err(e);
            }
            if let Err(e) = self.cut(n, before) {
                if !matches!(self.info.kind, Kind::Rbd) {
                    put_back();
                    return Err(e);
                }
                self.pending_cut
                    .store(n, std::sync::atomic::Ordering::Release);
                return Err(io::Error::new(
                    e.kind(),
                    format!(
                        "{e}; the image may be cut part-way past {n} bytes (librbd deletes \
                         what lies past the new end before it changes the size), so its \
                         capacity stays {n} bytes and I/O past it is refused until a resize \
                         completes the cut (make it again, or resize without a size); a \
                         restart before that would serve the image's old size, its tail \
                         partly zeroes"
                    ),
                ));
            }
            return Ok(n);
        }
        self.resize_now(size)
    }

    /// Completes the cut of an RBD image's shrink that failed part-way
    /// ([`Device::resize_fenced`]), before any other resize: grown, or its size read again,
    /// the image would serve the partly deleted tail.
    fn finish_cut(&self) -> io::Result<()> {
        let n = self.pending_cut.load(std::sync::atomic::Ordering::Acquire);
        if n == u64::MAX {
            return Ok(());
        }
        self.cut(n, n)?;
        self.pending_cut
            .store(u64::MAX, std::sync::atomic::Ordering::Release);
        Ok(())
    }

    /// A count that moves while a resize of the backend works (an RBD image's progress
    /// reports; 0 for the others, whose resizes do not take long).
    pub fn resize_progress(&self) -> u64 {
        match &self.backing {
            #[cfg(feature = "rbd")]
            Backing::Rbd(image) => image.progress(),
            _ => 0,
        }
    }

    /// Cuts the backend of a shrink from `before` to `n` bytes (the capacity stored already).
    fn cut(&self, n: u64, before: u64) -> io::Result<()> {
        if self
            .faults
            .cut_failure
            .swap(false, std::sync::atomic::Ordering::AcqRel)
        {
            #[cfg(feature = "rbd")]
            if let Backing::Rbd(image) = &self.backing {
                // As librbd's resize failing part-way: the tail deleted, the size the old one.
                image.resize(n)?;
                image.resize(before)?;
            }
            return Err(io::Error::other(
                "the backend's cut failed (fail_next_cut test hook)",
            ));
        }
        match &self.backing {
            Backing::File(f) => f.set_len(n),
            Backing::Malloc(ram) => {
                let (start, end) = (
                    usize::try_from(n).unwrap_or(usize::MAX),
                    usize::try_from(before).unwrap_or(usize::MAX).min(ram.len()),
                );
                if start < end {
                    // SAFETY: `start..end` lies within the mapping (`end` is at most its
                    // length); each piece is written under its chunk's lock, with raw pointers.
                    unsafe {
                        ram.each_chunk(start, end - start, |at, _, len| {
                            std::ptr::write_bytes(at, 0, len);
                        });
                    }
                }
                Ok(())
            }
            Backing::Null => Ok(()),
            #[cfg(feature = "rbd")]
            Backing::Rbd(image) => image.resize(n),
        }
    }

    fn resize_now(&self, size: Option<u64>) -> io::Result<u64> {
        let bad = |msg: String| io::Error::new(io::ErrorKind::InvalidInput, msg);
        let bs = u64::from(self.info.logical_block_size);
        let new = match (&self.backing, size) {
            (Backing::File(f), Some(n)) if self.info.kind == Kind::File => {
                f.set_len(n)?;
                n
            }
            (Backing::File(_), Some(_)) => {
                return Err(bad(
                    "a block device's size is its own: resize the device, then resize the \
                     namespace without a size"
                        .into(),
                ))
            }
            (Backing::File(f), None) if self.info.kind == Kind::File => f.metadata()?.len(),
            (Backing::File(f), None) => {
                let mut n: u64 = 0;
                // SAFETY: the ioctl writes one u64 into the pointed-to local.
                if unsafe { libc::ioctl(f.as_raw_fd(), BLKGETSIZE64 as _, &mut n) } < 0 {
                    return Err(io::Error::last_os_error());
                }
                n
            }
            (Backing::Malloc(ram), Some(n)) => {
                if n > ram.len() as u64 {
                    return Err(bad(format!(
                        "a RAM namespace cannot grow past the {} bytes it was created with",
                        ram.len()
                    )));
                }
                n
            }
            (Backing::Null, Some(n)) => n,
            (Backing::Malloc(_) | Backing::Null, None) => {
                return Err(bad("a RAM or null namespace needs the new size".into()))
            }
            #[cfg(feature = "rbd")]
            (Backing::Rbd(image), n) => {
                if let Some(n) = n {
                    image.resize(n)?;
                }
                image.size()?
            }
        } / bs
            * bs;
        if new == 0 {
            return Err(bad("the backend is smaller than one block".into()));
        }
        self.size.store(new, std::sync::atomic::Ordering::Release);
        Ok(new)
    }
}
