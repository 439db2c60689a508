//! Lock-free counters written by the reactors and read by the control thread.
//!
//! Every counter is a relaxed atomic owned by one writer; readers take a snapshot that is
//! consistent per counter, not across counters, which is what monitoring needs.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

use serde::{Deserialize, Serialize};

/// Counters of one reactor, written only by its thread.
#[derive(Debug, Default)]
pub struct ReactorCounters {
    /// Poll-loop turns: the heartbeat the watchdog watches.
    pub turns: AtomicU64,
    /// Turns that found work.
    pub busy_turns: AtomicU64,
    /// Times the reactor slept on its wake-up source after being idle.
    pub sleeps: AtomicU64,
    /// Times the poll after arming found work that arrived before the arming (a sleep that
    /// would have waited for `max_sleep`).
    pub caught_before_sleep: AtomicU64,
    /// Set by the control thread while the heartbeat has not moved for `stall_timeout`.
    pub stalled: AtomicBool,
}

impl ReactorCounters {
    /// Adds one to a counter this thread owns.
    #[inline]
    pub fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Relaxed);
    }

    /// A snapshot for the admin socket.
    pub fn snapshot(&self, id: usize, core: usize) -> ReactorStats {
        ReactorStats {
            id,
            core,
            turns_total: self.turns.load(Relaxed),
            busy_turns_total: self.busy_turns.load(Relaxed),
            sleeps_total: self.sleeps.load(Relaxed),
            caught_before_sleep_total: self.caught_before_sleep.load(Relaxed),
            stalled: self.stalled.load(Relaxed),
        }
    }
}

/// One reactor in `stats`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct ReactorStats {
    /// Reactor index, in the order of `daemon.reactor_cores`.
    pub id: usize,
    /// The core it is pinned to.
    pub core: usize,
    /// Poll-loop turns (the heartbeat).
    pub turns_total: u64,
    /// Turns that found work.
    pub busy_turns_total: u64,
    /// Idle sleeps (adaptive polling).
    pub sleeps_total: u64,
    /// Work found by the poll right after arming, before sleeping.
    #[serde(default)]
    pub caught_before_sleep_total: u64,
    /// Whether the heartbeat has stopped for longer than `daemon.stall_timeout`.
    pub stalled: bool,
}

/// Counters of the admin socket, written only by the control thread.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct AdminStats {
    /// Clients connected now.
    pub clients: u64,
    /// Clients accepted since start.
    pub connections_total: u64,
    /// Requests answered (including error answers).
    pub requests_total: u64,
    /// Requests answered with an error.
    pub errors_total: u64,
    /// Clients dropped by the daemon: too many, line too long, idle, not reading.
    pub dropped_total: u64,
}

/// Counters of a reactor's data path (all its devices), written only by the reactor.
#[derive(Debug, Default)]
pub struct DataPathCounters {
    /// Commands received.
    pub commands: AtomicU64,
    /// Commands completed with an error status.
    pub command_errors: AtomicU64,
    /// Commands that waited in the incoming queue for a request slot or buffer.
    pub commands_queued: AtomicU64,
    /// Bytes read by hosts.
    pub read_bytes: AtomicU64,
    /// Bytes written by hosts.
    pub write_bytes: AtomicU64,
    /// RDMA READs of host data issued.
    pub rdma_reads: AtomicU64,
    /// Receives currently posted to the SRQs.
    pub receives_posted: AtomicU64,
    /// Receives registered to the SRQs now (posted or not).
    pub srq_receives_registered: AtomicU64,
    /// `IBV_EVENT_SRQ_LIMIT_REACHED` events taken.
    pub srq_limit_events: AtomicU64,
    /// Times an SRQ grew by a chunk.
    pub srq_grows: AtomicU64,
    /// Chunks given back after the load stayed low.
    pub srq_shrinks: AtomicU64,
    /// Limit events at `srq_max`, where the SRQ could not grow.
    pub srq_at_max: AtomicU64,
    /// Times the last posted receive was consumed: hosts then RNR-retry until one is posted.
    pub srq_empty: AtomicU64,
    /// Failures to post, arm or register receives.
    pub srq_errors: AtomicU64,
    /// Receive completions for QPs no longer known (re-posted).
    pub late_receives: AtomicU64,
    /// Commands past the queue size of their QP (more without a response than the host's
    /// queue holds): the queue ended.
    pub commands_over_queue_size: AtomicU64,
    /// Connections whose posted work had no completion within `RESPONSE_TIMEOUT` (a host
    /// that takes none of its responses): the queue ended.
    pub responses_not_taken: AtomicU64,
    /// Send or block completions that named no command in flight (dropped, never applied).
    pub stale_completions: AtomicU64,
    /// Asynchronous Event Requests completed (an event reported to a host).
    pub async_events: AtomicU64,
    /// In-capsule writes that went to the disk from the receive they arrived in.
    pub writes_from_receive: AtomicU64,
    /// Send work requests the provider refused to post.
    pub post_errors: AtomicU64,
    /// Connections (QPs) served now.
    pub connections: AtomicU64,
    /// Connections accepted since start.
    pub connections_accepted: AtomicU64,
    /// Connect requests handed to the data path that it could not accept (no data path for
    /// the listener, the SRQ failed or could not be reserved, the QP or `rdma_accept` failed,
    /// the host went away first); each is rejected and everything it took is released.
    pub connects_failed_accept: AtomicU64,
    /// Accepted connections whose host went away before the connection was established:
    /// rdma_cm reported `REJECTED` (a REJ from the host).
    pub connects_failed_rejected: AtomicU64,
    /// Accepted connections that rdma_cm reported `UNREACHABLE` (the host stopped answering
    /// during the CM exchange).
    pub connects_failed_unreachable: AtomicU64,
    /// Accepted connections that rdma_cm reported `CONNECT_ERROR`.
    pub connects_failed_connect_error: AtomicU64,
    /// Accepted connections whose host sent no Fabrics Connect within
    /// `transport.connect_timeout`.
    pub connects_failed_no_connect: AtomicU64,
    /// Accepted connections without a Fabrics Connect yet, ended as the oldest when more than
    /// a data path keeps (a quarter of its QPs) were waiting for theirs while its QPs ran
    /// short.
    pub connects_failed_crowded_out: AtomicU64,
    /// Receives reserved in the SRQs for the connected queues (the sum of their depths, with
    /// `srq_cover_queues`); given back when a queue's QP is destroyed.
    pub srq_receives_reserved: AtomicU64,
    /// Set by a reactor (on its own counters) while it builds a data path at run time (a
    /// listener added, a device back, a failed CQ replaced): pools mapped and registered
    /// with the NIC and io_uring, which takes seconds for large pools on some NICs. Its
    /// heartbeat does not move meanwhile; the control thread excuses it as it does the
    /// build at start, up to the same bound.
    pub building_path: AtomicBool,
    /// Gauges, stored at the end of every poll: commands admitted and not finished.
    pub requests_active: AtomicU64,
    /// Commands waiting in the incoming queue.
    pub requests_waiting: AtomicU64,
    /// Request slots free (of `requests_total_slots`).
    pub request_slots_free: AtomicU64,
    /// Request slots in all.
    pub request_slots: AtomicU64,
    /// Data buffers free (of `buffers`).
    pub buffers_free: AtomicU64,
    /// Data buffers in all.
    pub buffers: AtomicU64,
    /// Block operations submitted and not reaped.
    pub block_ops_in_flight: AtomicU64,
    /// Signaled send work requests (SEND, RDMA READ) posted and not completed.
    pub sends_in_flight: AtomicU64,
    /// QPs torn down because the host disconnected.
    pub teardowns_disconnect: AtomicU64,
    /// QPs torn down for a QP error (async event or completion in error).
    pub teardowns_qp_error: AtomicU64,
    /// QPs torn down because their controller ended or their host broke the protocol.
    pub teardowns_controller: AtomicU64,
    /// QPs torn down because their device, SRQ or CQ failed.
    pub teardowns_device: AtomicU64,
    /// QPs torn down because the daemon stopped.
    pub teardowns_shutdown: AtomicU64,
    /// Torn-down QPs destroyed after `DRAIN_TIMEOUT` with work still outstanding.
    pub drain_timeouts: AtomicU64,
    /// QP async events (fatal, request and access errors).
    pub qp_events: AtomicU64,
    /// LAST_WQE_REACHED events.
    pub last_wqe_events: AtomicU64,
    /// Connections the CM was told are established by their first command
    /// (`IBV_EVENT_COMM_EST`: the host's RTU did not arrive).
    pub comm_est_events: AtomicU64,
    /// Device, port, SRQ and CQ events.
    pub device_events: AtomicU64,
    /// QPs torn down and still draining.
    pub qps_draining: AtomicU64,
    /// Namespaces waiting for a handle on their RBD image, opened off the reactor (their
    /// commands answer Namespace Not Ready meanwhile).
    pub namespaces_awaiting: AtomicU64,
    /// SRQs rebuilt after an SRQ error.
    pub srq_rebuilds: AtomicU64,
}

/// Adds `n` to a counter that only its data path's reactor writes: a plain load and store,
/// no locked read-modify-write on the I/O path; the stats side reads it whenever it likes.
#[inline]
pub fn bump(c: &AtomicU64, n: u64) {
    c.store(c.load(Relaxed).wrapping_add(n), Relaxed);
}

/// Takes `n` from a counter that only its data path's reactor writes (see [`bump`]).
#[inline]
pub fn unbump(c: &AtomicU64, n: u64) {
    c.store(c.load(Relaxed).wrapping_sub(n), Relaxed);
}

impl DataPathCounters {
    /// A snapshot for the admin socket.
    pub fn snapshot(&self, id: usize) -> DataPathStats {
        let g = |a: &AtomicU64| a.load(Relaxed);
        DataPathStats {
            reactor: id,
            commands_total: g(&self.commands),
            command_errors_total: g(&self.command_errors),
            commands_queued_total: g(&self.commands_queued),
            read_bytes_total: g(&self.read_bytes),
            write_bytes_total: g(&self.write_bytes),
            rdma_reads_total: g(&self.rdma_reads),
            srq_receives_posted: g(&self.receives_posted),
            srq_receives_registered: g(&self.srq_receives_registered),
            srq_limit_events_total: g(&self.srq_limit_events),
            srq_grows_total: g(&self.srq_grows),
            srq_shrinks_total: g(&self.srq_shrinks),
            srq_at_max_total: g(&self.srq_at_max),
            srq_empty_total: g(&self.srq_empty),
            srq_errors_total: g(&self.srq_errors),
            late_receives_total: g(&self.late_receives),
            commands_over_queue_size_total: g(&self.commands_over_queue_size),
            responses_not_taken_total: g(&self.responses_not_taken),
            stale_completions_total: g(&self.stale_completions),
            async_events_total: g(&self.async_events),
            writes_from_receive_total: g(&self.writes_from_receive),
            post_errors_total: g(&self.post_errors),
            qps: g(&self.connections),
            qps_accepted_total: g(&self.connections_accepted),
            connects_failed_accept_total: g(&self.connects_failed_accept),
            connects_failed_rejected_total: g(&self.connects_failed_rejected),
            connects_failed_unreachable_total: g(&self.connects_failed_unreachable),
            connects_failed_connect_error_total: g(&self.connects_failed_connect_error),
            connects_failed_no_connect_total: g(&self.connects_failed_no_connect),
            connects_failed_crowded_out_total: g(&self.connects_failed_crowded_out),
            srq_receives_reserved: g(&self.srq_receives_reserved),
            requests_active: g(&self.requests_active),
            requests_waiting: g(&self.requests_waiting),
            request_slots_free: g(&self.request_slots_free),
            request_slots: g(&self.request_slots),
            buffers_free: g(&self.buffers_free),
            buffers: g(&self.buffers),
            block_ops_in_flight: g(&self.block_ops_in_flight),
            sends_in_flight: g(&self.sends_in_flight),
            teardowns_disconnect_total: g(&self.teardowns_disconnect),
            teardowns_qp_error_total: g(&self.teardowns_qp_error),
            teardowns_controller_total: g(&self.teardowns_controller),
            teardowns_device_total: g(&self.teardowns_device),
            teardowns_shutdown_total: g(&self.teardowns_shutdown),
            drain_timeouts_total: g(&self.drain_timeouts),
            qp_events_total: g(&self.qp_events),
            last_wqe_events_total: g(&self.last_wqe_events),
            comm_est_events_total: g(&self.comm_est_events),
            device_events_total: g(&self.device_events),
            qps_draining: g(&self.qps_draining),
            namespaces_awaiting: g(&self.namespaces_awaiting),
            srq_rebuilds_total: g(&self.srq_rebuilds),
        }
    }
}

/// The levels (gauges) of [`DataPathCounters`], summed over a reactor's data paths.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Gauges {
    connections: u64,
    srq_receives_reserved: u64,
    receives_posted: u64,
    srq_receives_registered: u64,
    requests_active: u64,
    requests_waiting: u64,
    request_slots_free: u64,
    request_slots: u64,
    buffers_free: u64,
    buffers: u64,
    block_ops_in_flight: u64,
    sends_in_flight: u64,
    qps_draining: u64,
    namespaces_awaiting: u64,
}

impl Gauges {
    /// Adds the levels of one data path's counters.
    pub fn add(&mut self, c: &DataPathCounters) {
        let g = |a: &AtomicU64| a.load(Relaxed);
        self.connections += g(&c.connections);
        self.srq_receives_reserved += g(&c.srq_receives_reserved);
        self.receives_posted += g(&c.receives_posted);
        self.srq_receives_registered += g(&c.srq_receives_registered);
        self.requests_active += g(&c.requests_active);
        self.requests_waiting += g(&c.requests_waiting);
        self.request_slots_free += g(&c.request_slots_free);
        self.request_slots += g(&c.request_slots);
        self.buffers_free += g(&c.buffers_free);
        self.buffers += g(&c.buffers);
        self.block_ops_in_flight += g(&c.block_ops_in_flight);
        self.sends_in_flight += g(&c.sends_in_flight);
        self.qps_draining += g(&c.qps_draining);
        self.namespaces_awaiting += g(&c.namespaces_awaiting);
    }

    /// Block operations in flight at the engines.
    pub fn block_ops_in_flight(&self) -> u64 {
        self.block_ops_in_flight
    }

    /// Whether nothing is outstanding: no connection, command, block operation, send or
    /// drain, and every request slot and buffer free.
    pub fn idle(&self) -> bool {
        self.connections == 0
            && self.requests_active == 0
            && self.requests_waiting == 0
            && self.request_slots_free == self.request_slots
            && self.buffers_free == self.buffers
            && self.block_ops_in_flight == 0
            && self.sends_in_flight == 0
            && self.qps_draining == 0
    }

    /// Stores these levels into `c`.
    pub fn store(&self, c: &DataPathCounters) {
        let s = |a: &AtomicU64, v: u64| a.store(v, Relaxed);
        s(&c.connections, self.connections);
        s(&c.srq_receives_reserved, self.srq_receives_reserved);
        s(&c.receives_posted, self.receives_posted);
        s(&c.srq_receives_registered, self.srq_receives_registered);
        s(&c.requests_active, self.requests_active);
        s(&c.requests_waiting, self.requests_waiting);
        s(&c.request_slots_free, self.request_slots_free);
        s(&c.request_slots, self.request_slots);
        s(&c.buffers_free, self.buffers_free);
        s(&c.buffers, self.buffers);
        s(&c.block_ops_in_flight, self.block_ops_in_flight);
        s(&c.sends_in_flight, self.sends_in_flight);
        s(&c.qps_draining, self.qps_draining);
        s(&c.namespaces_awaiting, self.namespaces_awaiting);
    }
}

impl DataPathCounters {
    /// Moves this data path's totals (the counters that only grow) into `to`, a reactor's
    /// counters, and zeroes them here; the levels stay (see [`Gauges`]). Only the thread that
    /// writes both may call it: the moves are plain loads and stores, no atomic
    /// read-modify-write, as it runs every reactor turn.
    pub fn move_totals_into(&self, to: &DataPathCounters) {
        // Destructured without `..`: a counter added to the struct must be placed here, as a
        // total below or as a level in `Gauges`.
        let DataPathCounters {
            commands,
            command_errors,
            commands_queued,
            read_bytes,
            write_bytes,
            rdma_reads,
            receives_posted: _,
            srq_receives_registered: _,
            srq_limit_events,
            srq_grows,
            srq_shrinks,
            srq_at_max,
            srq_empty,
            srq_errors,
            late_receives,
            commands_over_queue_size,
            responses_not_taken,
            stale_completions,
            async_events,
            writes_from_receive,
            post_errors,
            connections: _,
            connections_accepted,
            connects_failed_accept,
            connects_failed_rejected,
            connects_failed_unreachable,
            connects_failed_connect_error,
            connects_failed_no_connect,
            connects_failed_crowded_out,
            srq_receives_reserved: _,
            // A reactor's own flag, not a data path's.
            building_path: _,
            requests_active: _,
            requests_waiting: _,
            request_slots_free: _,
            request_slots: _,
            buffers_free: _,
            buffers: _,
            block_ops_in_flight: _,
            sends_in_flight: _,
            teardowns_disconnect,
            teardowns_qp_error,
            teardowns_controller,
            teardowns_device,
            teardowns_shutdown,
            drain_timeouts,
            qp_events,
            last_wqe_events,
            comm_est_events,
            device_events,
            qps_draining: _,
            namespaces_awaiting: _,
            srq_rebuilds,
        } = self;
        let mv = |from: &AtomicU64, to: &AtomicU64| {
            let v = from.load(Relaxed);
            if v != 0 {
                from.store(0, Relaxed);
                to.store(to.load(Relaxed).wrapping_add(v), Relaxed);
            }
        };
        mv(commands, &to.commands);
        mv(command_errors, &to.command_errors);
        mv(commands_queued, &to.commands_queued);
        mv(read_bytes, &to.read_bytes);
        mv(write_bytes, &to.write_bytes);
        mv(rdma_reads, &to.rdma_reads);
        mv(srq_limit_events, &to.srq_limit_events);
        mv(srq_grows, &to.srq_grows);
        mv(srq_shrinks, &to.srq_shrinks);
        mv(srq_at_max, &to.srq_at_max);
        mv(srq_empty, &to.srq_empty);
        mv(srq_errors, &to.srq_errors);
        mv(late_receives, &to.late_receives);
        mv(commands_over_queue_size, &to.commands_over_queue_size);
        mv(responses_not_taken, &to.responses_not_taken);
        mv(stale_completions, &to.stale_completions);
        mv(async_events, &to.async_events);
        mv(writes_from_receive, &to.writes_from_receive);
        mv(post_errors, &to.post_errors);
        mv(connections_accepted, &to.connections_accepted);
        mv(connects_failed_accept, &to.connects_failed_accept);
        mv(connects_failed_rejected, &to.connects_failed_rejected);
        mv(connects_failed_unreachable, &to.connects_failed_unreachable);
        mv(
            connects_failed_connect_error,
            &to.connects_failed_connect_error,
        );
        mv(connects_failed_no_connect, &to.connects_failed_no_connect);
        mv(connects_failed_crowded_out, &to.connects_failed_crowded_out);
        mv(teardowns_disconnect, &to.teardowns_disconnect);
        mv(teardowns_qp_error, &to.teardowns_qp_error);
        mv(teardowns_controller, &to.teardowns_controller);
        mv(teardowns_device, &to.teardowns_device);
        mv(teardowns_shutdown, &to.teardowns_shutdown);
        mv(drain_timeouts, &to.drain_timeouts);
        mv(qp_events, &to.qp_events);
        mv(last_wqe_events, &to.last_wqe_events);
        mv(comm_est_events, &to.comm_est_events);
        mv(device_events, &to.device_events);
        mv(srq_rebuilds, &to.srq_rebuilds);
    }
}

/// One listener in `stats`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct ListenerStats {
    /// Listener index, in the order of the configuration's `[[listener]]` tables.
    pub id: usize,
    /// `address:port` (`[address]:port` for IPv6).
    pub address: String,
    /// Verbs provider.
    pub provider: String,
    /// Whether it accepts connections now.
    pub serving: bool,
    /// Times its device was removed (or failed fatally) while it served.
    pub device_removals_total: u64,
    /// Times it served again after its device returned.
    pub returns_total: u64,
    /// Times its address moved to another port (`RDMA_CM_EVENT_ADDR_CHANGE`, a bond's
    /// failover), after which it listened again.
    #[serde(default)]
    pub address_changes_total: u64,
}

/// One reactor's data path in `stats`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct DataPathStats {
    /// Reactor index.
    pub reactor: usize,
    /// NVMe commands received.
    pub commands_total: u64,
    /// Commands completed with an error status.
    pub command_errors_total: u64,
    /// Commands that waited for a request slot or buffer.
    pub commands_queued_total: u64,
    /// Bytes read by hosts.
    pub read_bytes_total: u64,
    /// Bytes written by hosts.
    pub write_bytes_total: u64,
    /// RDMA READs of host data.
    pub rdma_reads_total: u64,
    /// Receives posted to the SRQs now.
    pub srq_receives_posted: u64,
    /// Receives registered to the SRQs now.
    pub srq_receives_registered: u64,
    /// SRQ limit events.
    pub srq_limit_events_total: u64,
    /// Chunks the SRQs grew by.
    pub srq_grows_total: u64,
    /// Chunks given back.
    pub srq_shrinks_total: u64,
    /// Limit events at `srq_max`.
    pub srq_at_max_total: u64,
    /// Times an SRQ ran out of posted receives (hosts RNR-retried).
    pub srq_empty_total: u64,
    /// Failures to post, arm or register receives.
    pub srq_errors_total: u64,
    /// Receive completions for QPs no longer known.
    pub late_receives_total: u64,
    /// Commands past their queue's size; the queue ended.
    #[serde(default)]
    pub commands_over_queue_size_total: u64,
    /// Connections whose posted work had no completion in time; the queue ended.
    #[serde(default)]
    pub responses_not_taken_total: u64,
    /// Send or block completions that named no command in flight, dropped.
    #[serde(default)]
    pub stale_completions_total: u64,
    /// Asynchronous Event Requests completed (events reported to hosts).
    #[serde(default)]
    pub async_events_total: u64,
    /// In-capsule writes that went to the disk from the receive they arrived in (no copy).
    #[serde(default)]
    pub writes_from_receive_total: u64,
    /// Send work requests the provider refused to post.
    pub post_errors_total: u64,
    /// Queue pairs served now.
    pub qps: u64,
    /// Queue pairs accepted since start.
    pub qps_accepted_total: u64,
    /// Connect requests the data path could not accept (rejected, nothing kept).
    #[serde(default)]
    pub connects_failed_accept_total: u64,
    /// Accepted connections that failed before they were established: `REJECTED`.
    #[serde(default)]
    pub connects_failed_rejected_total: u64,
    /// Accepted connections that failed before they were established: `UNREACHABLE`.
    #[serde(default)]
    pub connects_failed_unreachable_total: u64,
    /// Accepted connections that failed before they were established: `CONNECT_ERROR`.
    #[serde(default)]
    pub connects_failed_connect_error_total: u64,
    /// Accepted connections whose host sent no Fabrics Connect in time.
    #[serde(default)]
    pub connects_failed_no_connect_total: u64,
    /// Accepted connections without a Fabrics Connect ended to make room for a newer one.
    #[serde(default)]
    pub connects_failed_crowded_out_total: u64,
    /// Receives reserved in the SRQs for the connected queues.
    #[serde(default)]
    pub srq_receives_reserved: u64,
    /// Commands admitted and not finished.
    pub requests_active: u64,
    /// Commands waiting for a request slot or buffer.
    pub requests_waiting: u64,
    /// Request slots free now.
    pub request_slots_free: u64,
    /// Request slots in all.
    pub request_slots: u64,
    /// Data buffers free now.
    pub buffers_free: u64,
    /// Data buffers in all.
    pub buffers: u64,
    /// Block operations in flight.
    pub block_ops_in_flight: u64,
    /// Signaled send work requests not completed.
    pub sends_in_flight: u64,
    /// QPs torn down: the host disconnected.
    pub teardowns_disconnect_total: u64,
    /// QPs torn down: QP error.
    pub teardowns_qp_error_total: u64,
    /// QPs torn down: controller ended or protocol error.
    pub teardowns_controller_total: u64,
    /// QPs torn down: device, SRQ or CQ failure.
    pub teardowns_device_total: u64,
    /// QPs torn down: daemon stopping.
    pub teardowns_shutdown_total: u64,
    /// Drains that timed out.
    pub drain_timeouts_total: u64,
    /// QP async events.
    pub qp_events_total: u64,
    /// LAST_WQE_REACHED events.
    pub last_wqe_events_total: u64,
    /// Connections established by their first command (COMM_EST: the host's RTU was lost).
    pub comm_est_events_total: u64,
    /// Device, port, SRQ and CQ events.
    pub device_events_total: u64,
    /// QPs torn down and still draining.
    pub qps_draining: u64,
    /// Namespaces waiting for a handle on their RBD image (their commands answer Namespace
    /// Not Ready meanwhile).
    #[serde(default)]
    pub namespaces_awaiting: u64,
    /// SRQs rebuilt after an SRQ error.
    pub srq_rebuilds_total: u64,
}

/// The answer to `stats`: the tree that the data path's counters extend.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Stats {
    /// Seconds since the daemon started.
    pub uptime_seconds: u64,
    /// One entry per reactor.
    pub reactors: Vec<ReactorStats>,
    /// One entry per reactor: its data path.
    pub datapath: Vec<DataPathStats>,
    /// One entry per listener.
    #[serde(default)]
    pub listeners: Vec<ListenerStats>,
    /// The admin socket.
    pub admin: AdminStats,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reactors_counters_sum_its_data_paths_and_keep_totals_of_those_gone() {
        let reactor = DataPathCounters::default();
        let (a, b) = (DataPathCounters::default(), DataPathCounters::default());
        for (c, n) in [(&a, 3), (&b, 5)] {
            c.commands.store(n, Relaxed);
            c.teardowns_device.store(n, Relaxed);
            c.buffers.store(16, Relaxed);
            c.buffers_free.store(16 - n, Relaxed);
            c.receives_posted.store(64, Relaxed);
        }
        let fold = |paths: &[&DataPathCounters]| {
            let mut g = Gauges::default();
            for p in paths {
                p.move_totals_into(&reactor);
                g.add(p);
            }
            g.store(&reactor);
            g
        };
        let g = fold(&[&a, &b]);
        assert!(!g.idle());
        let s = reactor.snapshot(0);
        assert_eq!((s.commands_total, s.teardowns_device_total), (8, 8));
        assert_eq!(
            (s.buffers, s.buffers_free, s.srq_receives_posted),
            (32, 24, 128)
        );
        assert_eq!(a.commands.load(Relaxed), 0, "moved, not copied");
        // A second turn counts nothing twice; path `a` goes (its device was removed): its
        // totals stay, its levels leave the sum.
        b.commands.fetch_add(1, Relaxed);
        b.buffers_free.store(16, Relaxed);
        let g = fold(&[&b]);
        let s = reactor.snapshot(0);
        assert_eq!((s.commands_total, s.teardowns_device_total), (9, 8));
        assert_eq!(
            (s.buffers, s.buffers_free, s.srq_receives_posted),
            (16, 16, 64)
        );
        assert!(g.idle(), "{g:?}");
    }
}
