//! What a controller hears of without asking: its keep-alive timer running out, and the
//! asynchronous events raised for it (a namespace changed, the discovery log changed).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Controller, EndReason, Target};

/// The Changed Namespace List's entries (log page 04h).
pub(crate) const CHANGED_LIST_LEN: usize = 1024;

/// How long a shutdown's flush keeps its controller's keep-alive timer from running out.
pub const SHUTDOWN_FLUSH_KEEPS_ALIVE: Duration = Duration::from_secs(120);

/// Asynchronous event: type Notice (2), Namespace Attribute Changed (0), log page 04h.
pub const NS_ATTR_CHANGED_EVENT: u32 = 0x0004_0002;

/// Asynchronous event: type Notice (2), Discovery Log Page Change (F0h), log page 70h.
pub const DISCOVERY_CHANGED_EVENT: u32 = 0x0070_F002;

impl Target {
    /// Ends every controller whose keep-alive timeout has passed; returns them. The control
    /// thread calls this periodically; their queues see it and disconnect.
    pub fn expire_keep_alives(&self, now: Instant) -> Vec<Arc<Controller>> {
        let mut ended = Vec::new();
        let mut map = self.ctrls();
        map.retain(|_, c| {
            // Ended already (its admin queue lost, waiting for the queue's drain): not a
            // keep-alive timeout.
            if c.is_dead() {
                return true;
            }
            let mut st = c.lock();
            // A shutdown's flush of this epoch: one a reset ended keeps nothing alive.
            let epoch = c.epoch.load(Ordering::Acquire);
            let flushing = st.shutdown_flushing.is_some_and(|(t0, e)| {
                e == epoch && now.saturating_duration_since(t0) < SHUTDOWN_FLUSH_KEEPS_ALIVE
            });
            if c.traffic.swap(false, Ordering::Relaxed) || flushing {
                st.last_keep_alive = now;
            }
            let expired =
                !st.kato.is_zero() && now.saturating_duration_since(st.last_keep_alive) > st.kato;
            drop(st);
            if expired {
                c.end(EndReason::KeepAliveExpired);
                ended.push(Arc::clone(c));
            }
            !expired
        });
        for c in &ended {
            self.retire(c);
        }
        drop(map);
        ended
    }

    /// Holds every controller's keep-alive timer for `held` up to `now`: that time counts
    /// against none. For a time when commands wait unread through no fault of their hosts (a
    /// reactor building a data path serves none of its queues).
    pub fn hold_keep_alive_timers(&self, held: Duration, now: Instant) {
        for c in self.ctrls().values() {
            let mut st = c.lock();
            st.last_keep_alive = (st.last_keep_alive + held).min(now);
        }
    }

    /// Records that namespace `nsid` of subsystem `subnqn` changed (its size, say): every
    /// controller of that subsystem gets a Namespace Attribute Changed event.
    pub fn namespace_changed(&self, subnqn: &str, nsid: u32) {
        if let Some(s) = self.subsystem(subnqn) {
            self.raise_namespace_changed(s.id, nsid);
        }
    }

    /// Namespace `nsid` of subsystem `id` changed: it joins each controller's Changed
    /// Namespace List (past 1,024 entries the list reports FFFFFFFFh: more changed than it
    /// holds), and a Namespace Attribute Changed event is raised where it is enabled and not
    /// masked by one the host has not yet answered by reading the list.
    pub(super) fn raise_namespace_changed(&self, id: u64, nsid: u32) {
        self.inner.genctr.fetch_add(1, Ordering::Relaxed);
        for c in self.ctrls().values() {
            if c.subsystem != Some(id) {
                continue;
            }
            let mut st = c.lock();
            // In increasing order, as a Namespace List is.
            if st.changed_nsids.len() <= CHANGED_LIST_LEN {
                if let Err(at) = st.changed_nsids.binary_search(&nsid) {
                    st.changed_nsids.insert(at, nsid);
                }
            }
            // Notice, Namespace Attribute Changed, log page 04h: sent only when enabled.
            if st.aec & (1 << 8) != 0 && !st.ns_event_masked {
                st.ns_event_masked = true;
                st.pending_events.push(NS_ATTR_CHANGED_EVENT);
            }
        }
    }

    /// The discovery log changed (a port, a subsystem, a subsystem's hosts): every
    /// discovery controller that enabled the notice gets a Discovery Log Page Change event,
    /// unless one is raised and the host has not read the log since.
    pub(super) fn raise_discovery_changed(&self) {
        for c in self.ctrls().values() {
            if c.subsystem.is_some() {
                continue;
            }
            let mut st = c.lock();
            if st.aec & (1 << 31) != 0 && !st.disc_event_masked {
                st.disc_event_masked = true;
                st.pending_events.push(DISCOVERY_CHANGED_EVENT);
            }
        }
    }
}
