//! The fence between a host's associations: no new controller of a host on a subsystem
//! while an ended one of it there may still have commands at a backend.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::target::{Controller, Target};

impl Target {
    /// Keeps `c`, which ended and leaves the map, for [`Target::io_left_behind`] while I/O
    /// queues of it are alive.
    ///
    /// Called with the controllers' map locked, in the same step that takes `c` out of it:
    /// a Connect checking meanwhile finds it in one or the other. (An I/O queue binding to it
    /// after it ended counts as alive later: kept whatever the count now, dropped once it is
    /// 0.)
    pub(crate) fn retire(&self, c: &Arc<Controller>) {
        let mut r = self.inner.retired.lock().unwrap_or_else(|e| e.into_inner());
        r.retain(|w| {
            w.upgrade()
                .is_some_and(|c| c.io_queues_unsettled.load(Ordering::Acquire) > 0)
        });
        r.push(Arc::downgrade(c));
    }

    /// Whether an ended controller of host `hostnqn` on subsystem `subnqn` still has I/O
    /// queues that may have commands at a backend (`map` is the controllers' map, locked). Their commands may still be at a
    /// backend (a write a store has not finished): a new association of the same host must
    /// not start before they are done, or an old write could land over a new one the host
    /// was told is done. Its Connect is answered Controller Busy, which a host retries.
    pub(crate) fn io_left_behind(
        &self,
        map: &HashMap<u16, Arc<Controller>>,
        hostnqn: &str,
        subnqn: &str,
    ) -> bool {
        // Ended, or being reset or shut down (its I/O queues cut off, their commands maybe
        // still at a backend): a host that gave up waiting for the reset to finish may come
        // back with a new association before the old one is seen to end. (The controllers'
        // map, then a controller's state: the lock order everywhere.)
        let left = |c: &Controller| {
            c.hostnqn == hostnqn
                && c.subnqn == subnqn
                && c.io_queues_unsettled.load(Ordering::Acquire) > 0
                && (c.is_dead() || {
                    let st = c.lock();
                    st.resetting || st.shutdown_pending
                })
        };
        if map.values().any(|c| left(c)) {
            self.note_fenced(hostnqn, subnqn);
            return true;
        }
        let mut r = self.inner.retired.lock().unwrap_or_else(|e| e.into_inner());
        r.retain(|w| {
            w.upgrade()
                .is_some_and(|c| c.io_queues_unsettled.load(Ordering::Acquire) > 0)
        });
        let fenced = r
            .iter()
            .filter_map(std::sync::Weak::upgrade)
            .any(|c| left(&c));
        drop(r);
        if fenced {
            self.note_fenced(hostnqn, subnqn);
        }
        fenced
    }

    fn note_fenced(&self, hostnqn: &str, subnqn: &str) {
        let mut f = self.inner.fenced.lock().unwrap_or_else(|e| e.into_inner());
        f.0 += 1;
        f.1 = Some((hostnqn.to_owned(), subnqn.to_owned()));
    }

    /// Admin Connects answered Controller Busy because the host's ended controller on the
    /// subsystem still had I/O queues ([`Target::io_left_behind`]), and the host and
    /// subsystem of the last: the control thread logs them.
    pub fn fenced_connects(&self) -> (u64, Option<(String, String)>) {
        self.inner
            .fenced
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}
