//! An eventfd: how soft objects make themselves pollable (by mio or epoll), as a device's async
//! fd, a completion channel or a CM event channel is.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// A non-blocking eventfd.
#[derive(Debug)]
pub struct EventFd(OwnedFd);

impl EventFd {
    /// A new eventfd (non-blocking, close-on-exec).
    pub fn new() -> io::Result<EventFd> {
        // SAFETY: eventfd has no memory-safety preconditions; the result is checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a new descriptor owned by nobody else.
        Ok(EventFd(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Makes the fd readable.
    pub fn signal(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to an eventfd we own.
        unsafe { libc::write(self.0.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    /// Consumes the readiness (after handling what it announced).
    pub fn clear(&self) {
        let mut v: u64 = 0;
        // SAFETY: reads at most 8 bytes into a live u64; EAGAIN (nothing pending) is fine.
        unsafe { libc::read(self.0.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
    }
}

impl AsRawFd for EventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}
