//! What the target tells others of: test hooks run at chosen points of a race, and the count
//! of controller changes with the waker the daemon sets on it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

/// What a test hook runs ([`Target::set_connect_hook`](super::Target::set_connect_hook) and
/// the like).
pub type ConnectHook = Box<dyn Fn() + Send + Sync>;

/// A test hook's place: empty unless a test set one.
#[derive(Default)]
pub(crate) struct Hook(Mutex<Option<ConnectHook>>);

impl Hook {
    pub(crate) fn set(&self, hook: Option<ConnectHook>) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = hook;
    }

    /// Runs the hook, if one is set, on this thread.
    pub(crate) fn run(&self) {
        if let Some(hook) = self.0.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            hook();
        }
    }
}

/// What [`Target::set_change_waker`](super::Target::set_change_waker) runs.
pub type ChangeWaker = Box<dyn Fn() + Send + Sync>;

/// The target's count of controller changes (ends, resets, shutdowns with I/O queues), and
/// who is told of each.
#[derive(Default)]
pub struct ChangeCount {
    pub(crate) count: AtomicU64,
    pub(crate) waker: OnceLock<ChangeWaker>,
}

impl ChangeCount {
    pub(crate) fn bump(&self) {
        self.count.fetch_add(1, Ordering::AcqRel);
        if let Some(w) = self.waker.get() {
            w();
        }
    }
}

impl std::fmt::Debug for ChangeCount {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChangeCount")
            .field("count", &self.count.load(Ordering::Relaxed))
            .field("waker", &self.waker.get().is_some())
            .finish()
    }
}

/// Test hooks of the target: races made certain.
impl super::Target {
    /// Tests of controller IDs handed out again: the next admin Connect of a subsystem with
    /// the whole range (`ALL_CNTLIDS`) gets `cntlid` if no controller in the map has it.
    #[doc(hidden)]
    pub fn set_next_cntlid(&self, cntlid: u16) {
        // `alloc_cntlid` hands out `lo + n % span` for counter value `n`: `n % 0xFFEF + 1`
        // for the whole range.
        self.inner
            .next_cntlid
            .store(u32::from(cntlid.max(1)) - 1, Ordering::Relaxed);
    }

    /// Tests of a race with a lost I/O queue: `hook` runs when an I/O queue whose commands may
    /// be at a backend is lost, before it marks its queue ID lost (a reset of its controller
    /// meanwhile), on the thread that lost it, until it is replaced or cleared.
    #[doc(hidden)]
    pub fn set_lost_hook(&self, hook: Option<ConnectHook>) {
        self.inner.lost_hook.set(hook);
    }

    /// Tests of what happens while a Connect is served: `hook` runs once an admin queue's
    /// Connect has passed its checks, before it makes its controller (its host's access
    /// removed meanwhile), and once an I/O queue's Connect has taken its queue ID, before the
    /// queue is bound (a reset of its controller meanwhile). It runs on the thread serving
    /// the Connect, until it is replaced or cleared.
    #[doc(hidden)]
    pub fn set_connect_hook(&self, hook: Option<ConnectHook>) {
        self.inner.connect_hook.set(hook);
    }

    /// Tests of a reset that lands while an I/O queue connects: `hook` runs once an I/O
    /// queue's Connect has found its controller ready, before it takes its queue ID, on the
    /// thread serving the Connect, until it is replaced or cleared.
    #[doc(hidden)]
    pub fn set_io_connect_hook(&self, hook: Option<ConnectHook>) {
        self.inner.io_connect_hook.set(hook);
    }

    /// Tests of a change that lands while a discovery log is built: `hook` runs once the log
    /// has taken the subsystems, before it takes the ports, on the thread serving the Get Log
    /// Page, until it is replaced or cleared.
    #[doc(hidden)]
    pub fn set_discovery_hook(&self, hook: Option<ConnectHook>) {
        self.inner.discovery_hook.set(hook);
    }

    /// Tests of what a host sees while a subsystem is removed: `hook` runs once the target's
    /// subsystems are published without it, before its controllers end, on the thread
    /// removing it, until it is replaced or cleared.
    #[doc(hidden)]
    pub fn set_removal_hook(&self, hook: Option<ConnectHook>) {
        self.inner.removal_hook.set(hook);
    }

    pub(crate) fn run_discovery_hook(&self) {
        self.inner.discovery_hook.run();
    }
}
