//! Devices let go of while their subsystem is served (a namespace removed, or its device
//! replaced): counted until synced, so that a shutdown of the subsystem's controllers
//! completes only then, and fails if a sync failed.

use super::*;

/// Devices let go of while their subsystem is served: a shutdown completes once they are
/// synced.
impl Target {
    /// A device of subsystem `sub` is let go of (a namespace removed, or its device
    /// replaced): a shutdown of the subsystem's controllers completes only once it is synced
    /// ([`Target::release_ends`]). Call it before any reactor is told to let the device go.
    pub fn release_begins(&self, sub: u64) {
        let mut r = self
            .inner
            .releases
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        r.entry(sub).or_default().in_flight += 1;
    }

    /// The sync of a device of subsystem `sub` let go of ended; `durable` when it succeeded
    /// (or there was nothing to sync). A failure fails the shutdown of every controller of
    /// the subsystem that existed before it.
    pub fn release_ends(&self, sub: u64, durable: bool) {
        let mut r = self
            .inner
            .releases
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let Some(e) = r.get_mut(&sub) else {
            return;
        };
        e.in_flight = e.in_flight.saturating_sub(1);
        e.failures += u64::from(!durable);
        if *e == Releases::default() {
            r.remove(&sub);
        }
    }

    /// Subsystem `sub`'s devices let go of and not synced yet, and its failed syncs.
    pub fn releases(&self, sub: u64) -> Releases {
        let r = self
            .inner
            .releases
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        r.get(&sub).copied().unwrap_or_default()
    }
}
