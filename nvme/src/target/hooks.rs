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
