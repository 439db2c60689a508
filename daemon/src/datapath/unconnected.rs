//! Connections not yet connected: rdma_cm failures before a connection is established, and
//! connections whose host sends no Fabrics Connect (in time, or while too many others wait
//! for theirs).

use super::*;

/// Connections without a Fabrics Connect a data path keeps at once: a quarter of its QPs.
fn unconnected_cap(max_qps: u32) -> usize {
    (max_qps as usize / 4).max(1)
}

/// How long a connection without a Fabrics Connect is safe from being crowded out by newer
/// ones ([`DataPath::crowd_out_the_oldest_unconnected`]).
const UNCONNECTED_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

impl DataPath {
    /// rdma_cm reported that the connection with CM token `token` failed before it was
    /// established: it is counted by `why` and torn down (its QP, CM ID and SRQ reservation
    /// are released once it has drained). One already torn down (the failure moved its QP to
    /// ERR, and LAST_WQE or a flushed completion came first) is only counted. A token this
    /// data path does not serve (another reactor's connection) is ignored.
    pub fn connect_failed(&mut self, token: usize, why: ConnectFailure) {
        let live = self
            .conns
            .iter()
            .find(|(_, c)| c.token == token)
            .map(|(q, _)| *q);
        if live.is_none() && !self.draining.values().any(|d| d.id.token() == token) {
            return;
        }
        let c = &self.counters;
        let counter = match why {
            ConnectFailure::Rejected => &c.connects_failed_rejected,
            ConnectFailure::Unreachable => &c.connects_failed_unreachable,
            ConnectFailure::ConnectError => &c.connects_failed_connect_error,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        if let Some(qpn) = live {
            slog::debug!(self.log, "connection failed before it was established"; "qpn" => qpn, "cm" => ?why);
            self.teardown(qpn, Cause::Disconnect, Instant::now());
        }
    }

    /// Whether connection `qpn` is still the one of CM token `token` (a QP number may have
    /// been reused since) and has no controller.
    fn silent(&self, qpn: u32, token: usize) -> bool {
        self.conns
            .get(&qpn)
            .is_some_and(|c| c.token == token && c.queue.controller().is_none())
    }

    /// A new connection is coming to a data path with fewer than a quarter of its QPs free:
    /// connections without a Fabrics Connect yet keep at most a quarter of `max_qps`
    /// ([`unconnected_cap`]) with it, the oldest beyond that ended (counted, torn down as a
    /// host breaking the protocol) once they have waited [`UNCONNECTED_GRACE`] with no
    /// command under way. Else a peer opening connections and sending nothing would hold
    /// every QP for `connect_timeout`, and hosts that connect meanwhile be refused. With QPs
    /// to spare nothing is ended: hosts connecting all at once after a restart (a Linux host
    /// makes all its queues' connections, then sends their Connects) wait as long as they
    /// need. A connection whose Connect is under way (waiting for admission, its data being
    /// read) is never ended here. Called before the new connection is refused for a full
    /// data path too: the ended ones drain, and the host's next try gets in.
    pub(super) fn crowd_out_the_oldest_unconnected(&mut self, now: Instant) {
        let max = self.max_qps as usize;
        let in_use = self.conns.len() + self.draining.len();
        let cap = unconnected_cap(self.max_qps);
        if (in_use + 1) * 4 <= max * 3 || self.conns.len() < cap {
            return;
        }
        // Counted only when it can matter: an accept is rare, a count over every connection
        // cheap beside it.
        let waiting = self
            .conns
            .values()
            .filter(|c| c.queue.controller().is_none())
            .count();
        let mut over = (waiting + 1).saturating_sub(cap);
        let grace = self.hooks.unconnected_grace.unwrap_or(UNCONNECTED_GRACE);
        let mut k = 0;
        while over > 0 && k < self.unconnected.len() {
            let (accepted, qpn, token) = self.unconnected[k];
            if !self.silent(qpn, token) {
                self.unconnected.remove(k);
                continue;
            }
            // The oldest is young: so are the others.
            if now.saturating_duration_since(accepted) < grace {
                break;
            }
            // A command under way (its Connect): kept, for `expire_unconnected` to judge.
            if self
                .conns
                .get(&qpn)
                .is_some_and(|c| c.received != c.answered || c.signaled_out != 0)
            {
                k += 1;
                continue;
            }
            self.unconnected.remove(k);
            over -= 1;
            self.counters
                .connects_failed_crowded_out
                .fetch_add(1, Ordering::Relaxed);
            slog::info!(self.log, "no Fabrics Connect from the host, and more connections without one than a data path keeps while its QPs run short: the oldest ended";
                "qpn" => qpn, "kept" => cap, "waited" => ?now.saturating_duration_since(accepted));
            self.teardown(qpn, Cause::Controller, now);
        }
    }

    /// Ends the connections whose host sent no Fabrics Connect within `connect_timeout` of
    /// their accept (counted, torn down as a host breaking the protocol). Cheap when nothing
    /// is due: connections are kept in accept order.
    pub(super) fn expire_unconnected(&mut self, now: Instant) {
        while let Some(&(accepted, qpn, token)) = self.unconnected.front() {
            if accepted + self.connect_timeout > now {
                break;
            }
            self.unconnected.pop_front();
            if !self.silent(qpn, token) {
                continue;
            }
            self.counters
                .connects_failed_no_connect
                .fetch_add(1, Ordering::Relaxed);
            slog::info!(self.log, "no Fabrics Connect from the host in time: connection ended";
                "qpn" => qpn, "timeout" => ?self.connect_timeout);
            self.teardown(qpn, Cause::Controller, now);
        }
    }
}
