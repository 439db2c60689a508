//! The threads that close image handles, and a count of the closes still to make.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::Closing;

static PENDING: AtomicUsize = AtomicUsize::new(0);

/// Closes `c` on a thread of its own (closes are rare, and one waiting on a cluster that
/// does not answer must not hold up the others), or here if none can be started.
pub(super) fn close(c: Closing) {
    PENDING.fetch_add(1, Ordering::AcqRel);
    let slot = std::sync::Arc::new(std::sync::Mutex::new(Some(c)));
    let theirs = std::sync::Arc::clone(&slot);
    let started = std::thread::Builder::new()
        .name("nvmfd-rbd-close".into())
        .spawn(move || {
            let c = theirs.lock().unwrap_or_else(|e| e.into_inner()).take();
            drop(c);
            PENDING.fetch_sub(1, Ordering::AcqRel);
        });
    if started.is_err() {
        let c = slot.lock().unwrap_or_else(|e| e.into_inner()).take();
        drop(c);
        PENDING.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Waits until every handle let go so far is closed, or `timeout`: whether they all are.
pub fn wait_closed(timeout: Duration) -> bool {
    let end = Instant::now() + timeout;
    while PENDING.load(Ordering::Acquire) > 0 {
        if Instant::now() >= end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    true
}

/// Handles let go and not closed yet.
pub fn pending() -> usize {
    PENDING.load(Ordering::Acquire)
}
