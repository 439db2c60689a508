//! A device's syncs: what makes completed writes durable, and what a failed one (a writeback
//! error, reported once) means for every later Flush.

use std::io;

use super::{Backing, Device};
use crate::BlockError;

/// The syncs of a device's file in flight on every engine (and [`Device::sync`]'s),
/// numbered in the order they began; [`Device::sync`] waits on `ended` for those begun
/// before it ended.
#[derive(Debug, Default)]
pub(crate) struct Syncs {
    in_flight: std::sync::Mutex<SyncsInFlight>,
    ended: std::sync::Condvar,
    /// [`Device::sync`]s waiting for others' syncs to end (tests look).
    waiting: std::sync::atomic::AtomicU32,
    /// Syncs of the device that failed so far ([`Device::note_sync_failure`]).
    failures: std::sync::atomic::AtomicU64,
}

#[derive(Debug, Default)]
struct SyncsInFlight {
    next: u64,
    in_flight: std::collections::BTreeSet<u64>,
}

/// How long [`Device::sync`] waits for the syncs of other engines begun before it ended: a
/// sync that takes longer is of a device that does not answer.
const OTHERS_SYNCS_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

impl Device {
    /// Makes every write completed on the device durable (`fdatasync` of a file or block
    /// device): for a device nvmfd lets go of, whose hosts can no longer flush it. Returns
    /// whether there was anything to sync: `false` for RAM, null and read-only devices, and
    /// for RBD images, whose engine handles flush their cache when they close.
    pub fn sync(&self) -> io::Result<bool> {
        match &self.backing {
            Backing::File(f) if !self.info.read_only => {
                // Numbered as an engine's sync: a Flush of an engine ending meanwhile waits
                // for it (it may take a writeback error's report).
                let n = self.sync_begin();
                // Synced even after a failure: what was written since is made durable.
                let synced = f
                    .sync_data()
                    .and_then(|()| match self.take_injected_failure() {
                        Some(errno) => Err(io::Error::from_raw_os_error(errno)),
                        None => Ok(()),
                    });
                if let Err(e) = synced {
                    self.note_sync_failure();
                    self.sync_end(n);
                    return Err(e);
                }
                self.sync_end(n);
                // Another engine's sync begun before this one ended (a FUA write on a
                // reactor still serving the device) may have taken the report: its failure
                // is noted before it ends.
                if let Some(until) = self.syncs_to_wait_for() {
                    self.wait_syncs_ended_before(until)?;
                }
                if self.sync_failed() {
                    return Err(io::Error::other(
                        "an earlier sync of this device failed: writes it covered may be lost",
                    ));
                }
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// A sync of the file begins (a Flush's fdatasync, a FUA write, a FUA zeroing's
    /// fdatasync, on any engine): its number, for [`Device::sync_end`].
    pub(crate) fn sync_begin(&self) -> u64 {
        let mut s = self
            .syncs
            .in_flight
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let n = s.next;
        s.next += 1;
        s.in_flight.insert(n);
        n
    }

    /// Sync `n` ended (settled first: a writeback error it took is noted before a Flush
    /// waiting for it looks).
    pub(crate) fn sync_end(&self, n: u64) {
        let mut s = self
            .syncs
            .in_flight
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        s.in_flight.remove(&n);
        // A waiter counts itself under this lock before it waits: read under it, the count
        // misses none, and a FUA write or Flush makes no wake-up call when nobody waits.
        let waiters = self
            .syncs
            .waiting
            .load(std::sync::atomic::Ordering::Acquire);
        drop(s);
        if waiters > 0 {
            self.syncs.ended.notify_all();
        }
    }

    /// For a Flush that succeeded now: `Some(until)` when syncs begun before now are still
    /// in flight (one may take the report of a writeback error this Flush's sync did not
    /// see); it is settled once every sync numbered below `until` has ended.
    pub(crate) fn syncs_to_wait_for(&self) -> Option<u64> {
        let s = self
            .syncs
            .in_flight
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        (!s.in_flight.is_empty()).then_some(s.next)
    }

    /// Waits until every sync numbered below `until` has ended (at most
    /// [`OTHERS_SYNCS_WAIT`]).
    fn wait_syncs_ended_before(&self, until: u64) -> io::Result<()> {
        use std::sync::atomic::Ordering::AcqRel;
        let s = self
            .syncs
            .in_flight
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.syncs.waiting.fetch_add(1, AcqRel);
        let (s, timeout) = self
            .syncs
            .ended
            .wait_timeout_while(s, OTHERS_SYNCS_WAIT, |s| {
                s.in_flight.first().is_some_and(|&low| low < until)
            })
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        drop(s);
        self.syncs.waiting.fetch_sub(1, AcqRel);
        if timeout.timed_out() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "a sync of the device on a reactor did not end: whether writes it covered are durable is unknown",
            ));
        }
        Ok(())
    }

    /// Test hook: how many [`Device::sync`]s wait for the syncs of engines to end.
    #[doc(hidden)]
    pub fn syncs_waiting(&self) -> u32 {
        self.syncs
            .waiting
            .load(std::sync::atomic::Ordering::Acquire)
    }

    /// Whether every sync numbered below `until` has ended.
    pub(crate) fn syncs_ended_before(&self, until: u64) -> bool {
        let s = self
            .syncs
            .in_flight
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        s.in_flight.first().is_none_or(|&low| low >= until)
    }

    /// True once, at the first call after a sync of this device failed: that failure is to
    /// be reported (logged) now.
    pub fn first_sync_failure(&self) -> bool {
        self.sync_failed()
            && !self
                .sync_failure_reported
                .swap(true, std::sync::atomic::Ordering::AcqRel)
    }

    /// Whether a sync of this device ever failed ([`Device::sync_failed`] field).
    pub fn sync_failed(&self) -> bool {
        self.sync_failed.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Completes `result` of an operation `op` an engine ran on this device, as to syncs
    /// (`synced`: the step that ended it synced the file: a Flush's fdatasync, a FUA write's
    /// RWF_DSYNC, a FUA zeroing's fdatasync after its fallocate). Files and block devices
    /// only: Linux reports a writeback error once per open file description, to the first
    /// sync that asks, with the errno of the failed writeback (EIO, ENOSPC, but also
    /// ENODATA, ETIMEDOUT or ENOLINK from a network block device or file system). Such an
    /// error makes every later Flush of the device fail, once it has run, and is never
    /// answered as one to retry (a retry's sync would succeed, the lost data forgotten). An
    /// O_DIRECT FUA write's own ENOSPC is its own failure; its EIO is taken as a lost
    /// writeback too (its sync may have taken the report, and cannot be told from it).
    pub(crate) fn settle_sync(
        &self,
        op: crate::OpKind,
        synced: bool,
        result: &mut Result<u32, BlockError>,
    ) {
        use crate::OpKind;
        if !matches!(self.backing, Backing::File(_)) {
            return;
        }
        if synced {
            if let Some(errno) = self.take_injected_failure() {
                *result = Err(BlockError::from_errno(errno));
            }
            let report = match result {
                Ok(_) => false,
                // A FUA write's refusals of the call itself (a read-only block device's
                // EPERM, an immutable file's, an interrupted or would-block write) come
                // before any I/O, never from a writeback; its own ENOSPC under direct I/O
                // is its own failure.
                Err(e) if op == OpKind::WriteFua => match e {
                    BlockError::Io(e) => ![
                        libc::EBADF,
                        libc::EINVAL,
                        libc::ECANCELED,
                        libc::EAGAIN,
                        libc::EINTR,
                        libc::EPERM,
                        libc::ETXTBSY,
                        libc::EFBIG,
                        libc::EFAULT,
                    ]
                    .contains(e),
                    BlockError::NoSpace => !self.info.direct,
                    _ => false,
                },
                // A sync's own failure (a Flush's fdatasync, a FUA zeroing's): Linux hands
                // the writeback error's report to the sync that asks whatever that sync
                // returns, so an ENOMEM from writing pages back, or EROFS from a file
                // system that aborted, hides an EIO; only a call that never ran (refused
                // for its descriptor, or never started by io_uring) took nothing.
                Err(BlockError::Io(e)) => ![libc::EBADF, libc::EINVAL, libc::ECANCELED].contains(e),
                Err(_) => true,
            };
            if report {
                self.note_sync_failure();
                // Answered as lost data, not as a device to retry later nor as a refusal.
                if !matches!(result, Err(BlockError::Io(libc::EIO) | BlockError::NoSpace)) {
                    *result = Err(BlockError::Io(libc::EIO));
                }
            }
        }
        if op == OpKind::Flush && result.is_ok() && self.sync_failed() {
            *result = Err(BlockError::Io(libc::EIO));
        }
    }

    /// The errno of a sync failure injected by [`Device::fail_sync`], when this sync is the
    /// one to fail.
    fn take_injected_failure(&self) -> Option<i32> {
        use std::sync::atomic::Ordering::{AcqRel, Acquire};
        (self.faults.sync_failure.load(Acquire)
            && !super::Faults::take_one(&self.faults.sync_skip)
            && self.faults.sync_failure.swap(false, AcqRel))
        .then(|| self.faults.sync_errno.load(Acquire))
    }

    /// A sync failed: every later Flush of the device fails too.
    pub(crate) fn note_sync_failure(&self) {
        self.syncs
            .failures
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        self.sync_failed
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// How many syncs of the device have failed so far.
    pub(crate) fn sync_failures(&self) -> u64 {
        self.syncs
            .failures
            .load(std::sync::atomic::Ordering::Acquire)
    }

    /// Whether a FUA operation `op` whose own sync succeeded may still have lost its data:
    /// its pages went through the page cache (a FUA write without direct I/O; a FUA
    /// zeroing, whose partial blocks are zeroed there), so their writeback may have failed
    /// with another sync taking the report (Linux reports it once, to the first sync of the
    /// file that asks). Such an operation waits, as a Flush does, for the syncs begun before
    /// it ended, and fails if one of the syncs of the device failed since it started.
    pub(crate) fn fua_waits_for_others(&self, op: crate::OpKind) -> bool {
        matches!(self.backing, Backing::File(_))
            && match op {
                crate::OpKind::WriteZeroesFua => true,
                crate::OpKind::WriteFua => !self.info.direct,
                _ => false,
            }
    }

    /// Test hook: the next Flush an engine starts on this file or block device races
    /// another engine's sync of the file (a FUA write on another reactor) begun with it: that
    /// sync takes the report of a writeback error (the Flush's own fdatasync succeeds) and
    /// ends after the Flush's result was settled, before the Flush looks for syncs still
    /// in flight.
    #[doc(hidden)]
    pub fn race_next_flush(&self) {
        self.faults
            .flush_race
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// [`Device::race_next_flush`]: begins the racing sync as the Flush starts.
    pub(crate) fn flush_race_begins(&self) {
        use std::sync::atomic::Ordering::AcqRel;
        if self.faults.flush_race.swap(false, AcqRel) {
            let n = self.sync_begin();
            self.faults
                .flush_race_sync
                .store(n + 1, std::sync::atomic::Ordering::Release);
        }
    }

    /// [`Device::race_next_flush`]: the racing sync takes the error and ends (its failure
    /// noted first, as an engine settles before it ends a sync).
    pub(crate) fn flush_race_ends(&self) {
        let n = self
            .faults
            .flush_race_sync
            .swap(0, std::sync::atomic::Ordering::AcqRel);
        if n != 0 {
            self.note_sync_failure();
            self.sync_end(n - 1);
        }
    }

    /// Test hook: the next sync an engine completes on this file or block device (a Flush;
    /// a FUA write on the buffered fallback) fails with EIO, as a writeback error reported
    /// once would.
    #[doc(hidden)]
    pub fn fail_next_sync(&self) {
        self.fail_sync(0, libc::EIO);
    }

    /// Test hook: after `skip` syncs of this file or block device (those engines complete,
    /// and [`Device::sync`]'s), the next fails with `errno`, as a writeback error reported
    /// once (with the failed bio's errno) would.
    #[doc(hidden)]
    pub fn fail_sync(&self, skip: u32, errno: i32) {
        use std::sync::atomic::Ordering::Release;
        self.faults.sync_skip.store(skip, Release);
        self.faults.sync_errno.store(errno, Release);
        self.faults.sync_failure.store(true, Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{DeviceSpec, Kind};

    /// A writable file is synced; RAM, null and a read-only file have nothing to sync.
    #[test]
    fn only_a_writable_file_or_block_device_has_something_to_sync() {
        let dir = std::env::temp_dir().join(format!("nvmfd-sync-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("a.img");
        std::fs::write(&path, vec![0u8; 1 << 20]).unwrap();
        let open = |read_only| {
            let mut spec = DeviceSpec::new(Kind::File);
            spec.path = Some(path.clone());
            spec.read_only = read_only;
            Device::open(&spec).unwrap()
        };
        assert!(open(false).sync().unwrap());
        assert!(!open(true).sync().unwrap());
        for kind in [Kind::Malloc, Kind::Null] {
            let mut spec = DeviceSpec::new(kind);
            spec.size = 1 << 20;
            assert!(!Device::open(&spec).unwrap().sync().unwrap(), "{kind:?}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A device's sync while an engine's sync, begun before it ended, is in flight (a FUA
    /// write on a reactor still serving it) waits for that one: it may have taken the
    /// report of a writeback error. It answered at once that all was durable.
    #[test]
    fn a_device_sync_waits_for_an_engines_sync_that_may_take_the_error() {
        let dir = std::env::temp_dir().join(format!("nvmfd-sync-race-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("a.img");
        std::fs::write(&path, vec![0u8; 1 << 20]).unwrap();
        let mut spec = DeviceSpec::new(Kind::File);
        spec.path = Some(path);
        let d = std::sync::Arc::new(Device::open(&spec).unwrap());
        let fua = d.sync_begin();
        let syncing = {
            let d = std::sync::Arc::clone(&d);
            std::thread::spawn(move || d.sync())
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while !syncing.is_finished() && d.syncs_waiting() == 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "the sync neither ended nor waited"
            );
            std::thread::yield_now();
        }
        // The engine's sync took the report (noted), then ends.
        d.note_sync_failure();
        d.sync_end(fua);
        assert!(
            syncing.join().unwrap().is_err(),
            "the device's sync said all was durable"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A Flush that succeeded waits for the syncs begun before it ended (one may have taken
    /// a writeback error's report), not for those begun after: under a steady stream of FUA
    /// writes it waited for a moment with none in flight, which may never come.
    #[test]
    fn a_flush_waits_only_for_the_syncs_begun_before_it_ended() {
        let mut spec = DeviceSpec::new(Kind::Malloc);
        spec.size = 1 << 20;
        let d = Device::open(&spec).unwrap();
        assert_eq!(d.syncs_to_wait_for(), None, "nothing in flight");
        let before = d.sync_begin();
        let until = d.syncs_to_wait_for().expect("a sync begun before");
        let after = d.sync_begin();
        assert!(!d.syncs_ended_before(until));
        d.sync_end(before);
        assert!(
            d.syncs_ended_before(until),
            "held by a sync begun after the Flush ended"
        );
        d.sync_end(after);
        assert_eq!(d.syncs_to_wait_for(), None);
    }
}
