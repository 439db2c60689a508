//! Connections and their end: a connection is adopted (its QP on the reactor's CQ and SRQ,
//! accepted with its budgets) and ends through one teardown path, whatever the cause,
//! draining before its QP is destroyed (IB 10.3.1).

use super::*;

pub(super) struct Conn {
    /// Its QP number.
    pub(super) qpn: u32,
    /// The count of async events read once its QP was made: an event naming its number with a
    /// lower number is of a destroyed QP whose number the device gave to this one.
    pub(super) events_from: u64,
    pub(super) id: CmId,
    /// The listener it came through (listeners on one device share its data path).
    pub(super) listener: usize,
    pub(super) queue: Queue,
    pub(super) token: usize,
    /// Receives reserved for it in the SRQ (its queue depth), and that SRQ's generation (a
    /// reservation in an SRQ since replaced is not the new one's to give back).
    pub(super) depth: u32,
    pub(super) srq_generation: u64,
    /// Send-queue entries it may use (one more is kept for the drain marker), and in use.
    pub(super) sq_budget: u32,
    pub(super) sq_used: u32,
    /// RDMA READs it may have in flight (the initiator depth granted at accept), and in
    /// flight.
    pub(super) read_budget: u32,
    pub(super) reads_used: u32,
    /// Requests waiting for READ budget, and for send-queue room, in arrival order.
    pub(super) pending_reads: VecDeque<usize>,
    pub(super) pending_sends: VecDeque<usize>,
    /// Work requests of this turn, posted together by `flush`.
    pub(super) staged: Vec<Staged>,
    /// Signaled work requests posted (or staged) and not completed.
    pub(super) signaled_out: u32,
    /// Commands received, and responses staged: a host has at most its queue size
    /// (`depth`) of commands without a response. One that sends more is torn down, or it
    /// could take every request slot and empty the SRQ that every host shares.
    pub(super) received: u64,
    pub(super) answered: u64,
    /// Completions of its signaled work requests (wrapping), and, from the last look that
    /// saw work out, the count they reach once that work has completed and when it was seen
    /// ([`DataPath::expire_stalled`]).
    pub(super) sq_progress: u32,
    pub(super) stall: Option<(u32, Instant)>,
}

/// A QP torn down and not yet destroyed: its work drains first.
pub(super) struct Drain {
    /// Kept alive (and so the QP) until the drain ends.
    pub(super) id: CmId,
    /// Its NVMe queue, dropped only once no request of it is left: its controller counts
    /// it until then, so a reset or shutdown is not reported done while a block operation
    /// of it may still write.
    pub(super) queue: Queue,
    pub(super) depth: u32,
    pub(super) srq_generation: u64,
    pub(super) since: Instant,
    pub(super) cause: Cause,
    /// `IBV_EVENT_QP_LAST_WQE_REACHED` arrived: no receive completion of it is still to come.
    pub(super) last_wqe: bool,
    /// The drain marker completed (or could not be posted): every send of it has completed.
    pub(super) flushed: bool,
    /// Its drain marker's number ([`DataPath::markers`] when it was posted).
    pub(super) marker: u32,
    /// As its connection's ([`Conn::events_from`]).
    pub(super) events_from: u64,
    /// Its signaled send WRs not completed yet.
    pub(super) signaled_out: u32,
    /// Everything it waited for had come by the CQ poll that was the `n`th to find the CQ
    /// empty (`cq_empty_polls`); the next one to find it empty ends the drain.
    pub(super) quiet_at: Option<u64>,
}

impl DataPath {
    /// Takes a connection the control thread accepted the request of: its QP goes on this
    /// reactor's CQ and SRQ, and it is accepted with the granted queue size and READ depth.
    pub fn adopt(&mut self, id: CmId, req: CmRequest) -> Result<Change, VerbsError> {
        self.adopt_for(0, id, req)
    }

    /// [`DataPath::adopt`], for a connection that came through listener `listener`.
    pub fn adopt_for(
        &mut self,
        listener: usize,
        mut id: CmId,
        req: CmRequest,
    ) -> Result<Change, VerbsError> {
        let depth = u32::from(req.crqsize());
        if self.srq_broken || self.cq_broken {
            self.counters
                .connects_failed_accept
                .fetch_add(1, Ordering::Relaxed);
            let _ = id.reject(&nvmfd_nvme::rdma_cm::reject_private_data(
                nvmfd_nvme::wire::rdma_cm_status::NO_RESOURCES,
            ));
            return Err(VerbsError::Invalid {
                op: "accept",
                why: if self.cq_broken {
                    "the CQ failed and the data path is being replaced"
                } else {
                    "the SRQ failed and is being rebuilt"
                },
            });
        }
        self.crowd_out_the_oldest_unconnected(Instant::now());
        if self.conns.len() + self.draining.len() >= self.max_qps as usize {
            self.counters
                .connects_failed_accept
                .fetch_add(1, Ordering::Relaxed);
            slog::warn!(self.log, "connection refused: this data path has as many QPs as it serves at once";
                "max_qps" => self.max_qps, "live" => self.conns.len(), "draining" => self.draining.len());
            let _ = id.reject(&nvmfd_nvme::rdma_cm::reject_private_data(
                nvmfd_nvme::wire::rdma_cm_status::NO_RESOURCES,
            ));
            return Err(VerbsError::Invalid {
                op: "accept",
                why: "the data path serves as many QPs as it can at once",
            });
        }
        let was_capped = self.srq.coverage_capped();
        let change = match self.srq.reserve(depth, Instant::now()) {
            Ok(c) if !was_capped && self.srq.coverage_capped() => {
                slog::warn!(self.log, "the connected queues can have more commands outstanding than srq_max receives: the SRQ covers them only up to srq_max, and commands a stalled backend keeps waiting can hold every receive (other hosts then meet RNR NAKs); raise transport.srq_max";
                    "reserved" => self.srq.reserved(), "connections" => self.conns.len() + 1);
                c
            }
            Ok(c) => c,
            Err(e) => {
                self.counters.srq_errors.fetch_add(1, Ordering::Relaxed);
                self.refuse(&id, depth);
                return Err(e);
            }
        };
        // Room for a response of every command (WRITEs and SEND), and for the largest single
        // one; one more entry for the drain marker.
        let sq_budget = (depth * 3)
            .max(nvmfd_nvme::MAX_SGL_DESCRIPTORS + 1)
            .min(self.max_qp_wr - 1);
        let read_budget = u32::from(req.read_depth).clamp(1, self.max_read_depth);
        let caps = QpCaps {
            max_send_wr: sq_budget + 1,
            max_send_sge: 1,
            max_recv_wr: 0,
            max_inline_data: 64,
        };
        let granted = u8::try_from(read_budget).unwrap_or(u8::MAX);
        let qpn = match id.create_qp(&self.pd, &self.cq, self.srq.srq(), caps) {
            Ok(q) => q,
            Err(e) => {
                slog::warn!(self.log, "cannot create a QP for a connection: refused"; "error" => %e);
                self.refuse(&id, depth);
                return Err(e);
            }
        };
        // After the QP is made: a destroyed QP whose number it took (on this reactor's data
        // path or another's on the device) was destroyed before, so its events were read
        // and numbered before this. Before the accept: a QP not yet connected raises none.
        let events_from = self.dev.events_read();
        // A host whose SEND meets an empty SRQ retries after MIN_RNR_TIMER; rdma_cm's default
        // is 655 ms, which starves a queue (a keep-alive) while the SRQ grows.
        let private_data = accept_private_data(req.crqsize());
        if let Err(e) = id.accept_with(&private_data, granted, MIN_RNR_TIMER) {
            // Usually the host went away first (its REJ came before the accept).
            slog::debug!(self.log, "cannot accept a connection"; "error" => %e);
            self.refuse(&id, depth);
            return Err(e);
        }
        let token = id.token();
        let mut queue = Queue::new(&self.target, Some(req.params));
        if let Some(peer) = id.peer_addr() {
            queue.set_peer(peer.to_string());
        }
        let d = depth as usize;
        let _ = self.conns.insert(Conn {
            qpn,
            events_from,
            id,
            listener,
            queue,
            token,
            depth,
            srq_generation: self.srq.generation(),
            sq_budget,
            sq_used: 0,
            read_budget,
            reads_used: 0,
            pending_reads: VecDeque::with_capacity(d),
            pending_sends: VecDeque::with_capacity(d),
            staged: Vec::with_capacity(sq_budget as usize),
            signaled_out: 0,
            received: 0,
            answered: 0,
            sq_progress: 0,
            stall: None,
        });
        self.counters
            .connections
            .store(self.conns.len() as u64, Ordering::Relaxed);
        self.counters
            .connections_accepted
            .fetch_add(1, Ordering::Relaxed);
        self.unconnected.push_back((Instant::now(), qpn, token));
        Ok(change)
    }

    /// A connection `adopt` reserved `depth` receives for cannot be accepted: the reservation
    /// returns, it is counted and rejected (when its host is still there to hear it); the
    /// caller drops `id`, which destroys it and any QP made on it.
    pub(super) fn refuse(&mut self, id: &CmId, depth: u32) {
        self.srq.unreserve(depth);
        self.counters
            .connects_failed_accept
            .fetch_add(1, Ordering::Relaxed);
        let _ = id.reject(&nvmfd_nvme::rdma_cm::reject_private_data(
            nvmfd_nvme::wire::rdma_cm_status::NO_RESOURCES,
        ));
    }

    /// Ends the connections whose posted work has not all completed within `response_timeout`
    /// ([`RESPONSE_TIMEOUT`](super::RESPONSE_TIMEOUT)) of a look that saw it out: counted
    /// and torn down as a host breaking the protocol. Looked at every quarter of the timeout, on a turn that read
    /// the CQ to its end (a completion further back would be missed) or, under a load that
    /// leaves completions at every poll, an eighth of the timeout later (else a host taking
    /// none of its responses would never be ended while other hosts keep the reactor busy),
    /// so one is ended between one and about one and a half timeouts after its work
    /// stopped moving.
    pub(super) fn expire_stalled(&mut self, now: Instant, cq_read_to_end: bool) {
        let step = self.response_timeout / 4;
        if now < self.next_stall_check
            || (!cq_read_to_end && now < self.next_stall_check + step / 2)
        {
            return;
        }
        // Looked at late (the reactor was held up, the machine paused): work may have moved
        // unseen meanwhile, so every connection starts over.
        let late = now.saturating_duration_since(self.next_stall_check) > step;
        self.next_stall_check = now + step;
        let mut stalled = std::mem::take(&mut self.scratch_qpns);
        for c in self.conns.values_mut() {
            if c.signaled_out == 0 {
                c.stall = None;
                continue;
            }
            // The count its completions reach once the work out now has completed.
            let posted = c.sq_progress.wrapping_add(c.signaled_out);
            if late {
                c.stall = Some((posted, now));
                continue;
            }
            // The work out at a look must all complete within the timeout from that look,
            // not merely some of it: a host posting one receive now and then lets one
            // response go at a time, and would hold the rest for ever.
            match c.stall {
                Some((target, since)) if c.sq_progress.wrapping_sub(target) > u32::MAX / 2 => {
                    if now.saturating_duration_since(since) >= self.response_timeout {
                        stalled.push(c.qpn);
                    }
                }
                _ => c.stall = Some((posted, now)),
            }
        }
        for qpn in stalled.drain(..) {
            let out = self.conns.get(&qpn).map_or(0, |c| c.signaled_out);
            self.counters
                .responses_not_taken
                .fetch_add(1, Ordering::Relaxed);
            slog::warn!(self.log, "the connection's posted work did not complete in time \
                (a host that posts no receive, or too few, for its responses?); the queue ends";
                "qpn" => qpn, "work_requests_out" => out, "timeout" => ?self.response_timeout);
            self.teardown(qpn, Cause::Controller, now);
        }
        self.scratch_qpns = stalled;
    }

    /// An async event of this data path's device (`async_fd`), numbered as it was read
    /// ([`any::Device::next_numbered_event`]); events for objects of another data path on
    /// the same device are ignored.
    pub fn on_event(&mut self, ev: &AsyncEvent, number: u64, now: Instant) -> Change {
        if let Some(q) = ev.qp() {
            let from = match self.conns.get(&q) {
                Some(c) => Some(c.events_from),
                None => self.draining.get(&q).map(|d| d.events_from),
            };
            if from.is_some_and(|from| number < from) {
                // Read before its QP was created: it is of a destroyed QP whose number the
                // device gave to this one (one whose drain timed out before it came).
                slog::info!(self.log, "async event of a destroyed QP dropped";
                    "qpn" => q, "event" => ?ev);
                return Change::None;
            }
        }
        let stale = match *ev {
            AsyncEvent::SrqLimitReached(id) | AsyncEvent::SrqErr(id) if self.srq.is(id) => {
                number < self.srq_events_from
            }
            AsyncEvent::CqErr(id) if self.cq.id() == id => number < self.cq_events_from,
            _ => false,
        };
        if stale {
            // Read before the SRQ or CQ it names was made: of a destroyed one whose handle the
            // device gave to this one.
            slog::info!(self.log, "async event of a destroyed SRQ or CQ dropped"; "event" => ?ev);
            return Change::None;
        }
        let c = &self.counters;
        match *ev {
            AsyncEvent::SrqLimitReached(id) if self.srq.is(id) => {
                return self.srq.limit_reached(now)
            }
            AsyncEvent::QpFatal(q) | AsyncEvent::QpReqErr(q) | AsyncEvent::QpAccessErr(q)
                if self.conns.contains_key(&q) || self.draining.contains_key(&q) =>
            {
                c.qp_events.fetch_add(1, Ordering::Relaxed);
                self.teardown(q, Cause::QpError, now);
            }
            AsyncEvent::QpLastWqeReached(q)
                if self.conns.contains_key(&q) || self.draining.contains_key(&q) =>
            {
                c.last_wqe_events.fetch_add(1, Ordering::Relaxed);
                // Only a QP in error sends it: one still thought live is broken.
                self.teardown(q, Cause::QpError, now);
                if let Some(d) = self.draining.get_mut(&q) {
                    d.last_wqe = true;
                }
            }
            AsyncEvent::SrqErr(id) if self.srq.is(id) => {
                c.device_events.fetch_add(1, Ordering::Relaxed);
                self.counters.srq_errors.fetch_add(1, Ordering::Relaxed);
                slog::error!(self.log, "SRQ error: its QPs are torn down and it is rebuilt";
                    "srq" => id, "qps" => self.conns.len());
                self.srq_broken = true;
                self.teardown_all(Cause::Device, now);
            }
            AsyncEvent::CqErr(id) if self.cq.id() == id => {
                c.device_events.fetch_add(1, Ordering::Relaxed);
                self.cq_failed("CQ error event", now);
            }
            AsyncEvent::DeviceFatal => {
                c.device_events.fetch_add(1, Ordering::Relaxed);
                self.teardown_all(Cause::Device, now);
            }
            AsyncEvent::PortErr(_) | AsyncEvent::PortActive(_) => {
                // rdma_cm reports the connections a port loss breaks; nothing to do here.
                c.device_events.fetch_add(1, Ordering::Relaxed);
            }
            AsyncEvent::CommEst(q) => {
                // A command came before the CM saw the host's RTU (lost): the CM is told, or
                // it would wait for a REP retry to be answered, and end the connection
                // (UNREACHABLE) if none is. As the kernel target and SPDK do.
                if let Some(conn) = self.conns.get(&q) {
                    c.comm_est_events.fetch_add(1, Ordering::Relaxed);
                    match conn.id.notify_established() {
                        Ok(()) => {
                            slog::info!(self.log, "connection established by its first command (the host's RTU did not arrive)"; "qpn" => q)
                        }
                        // EISCONN: the RTU came after all.
                        Err(e) => slog::debug!(self.log, "rdma_notify"; "qpn" => q, "error" => %e),
                    }
                }
            }
            _ => {}
        }
        Change::None
    }

    /// The one teardown path, for every cause: work staged for the QP is posted (so that it
    /// completes, flushed, like the rest), the QP goes to ERR (and the host is told, by
    /// rdma_cm), a drain marker is posted behind its sends, and the QP waits in `draining`
    /// until its sends and block operations are done, its flushed receives are back and
    /// (where the device sends it) LAST_WQE_REACHED came; `reap_drained` then destroys it.
    /// Its commands end without a response: those waiting for a budget at once, the others
    /// as their work completes; their slots and buffers return.
    pub fn teardown(&mut self, qpn: u32, cause: Cause, now: Instant) {
        let Some(mut c) = self.conns.remove(&qpn) else {
            return;
        };
        let staged = std::mem::take(&mut c.staged);
        if !staged.is_empty() {
            if let Err((first, _)) = post_staged(&c.id, &staged) {
                self.unstage(&mut c, &staged[first..]);
            }
        }
        let _ = c.id.disconnect();
        // rdma_disconnect moves an InfiniBand or RoCE QP to ERR, an iWARP one only to
        // closing (its work would flush once the TCP connection closes, and the marker below
        // be refused): ERR here, as the kernel's drain does, so the marker flushes now.
        let _ = c.id.to_error();
        c.queue.connection_lost();
        // Numbered, so that a marker of an earlier QP of the same number is told apart.
        self.markers = self.markers.wrapping_add(1);
        let number = self.markers;
        let marker = [SendWr {
            wr_id: wr_id(KIND_DRAIN, number, u64::from(qpn)),
            op: SendOp::Send,
            sges: &[],
            signaled: true,
            inline: None,
        }];
        // Refused, it never completes; posted and then failed (rxe's doorbell), it does.
        let flushed = c.id.post_send(&marker).is_err_and(|e| e.posted() == 0);
        if !flushed {
            c.signaled_out += 1;
            self.sends_in_flight += 1;
        }
        let counter = match cause {
            Cause::Disconnect => &self.counters.teardowns_disconnect,
            Cause::QpError => &self.counters.teardowns_qp_error,
            Cause::Controller => &self.counters.teardowns_controller,
            Cause::Device => &self.counters.teardowns_device,
            Cause::Shutdown => &self.counters.teardowns_shutdown,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        slog::debug!(self.log, "QP torn down"; "qpn" => qpn, "cause" => ?cause);
        // Requests that wait for a budget, or that nothing external holds, end now.
        // Whether any of its commands is at the backend (found on the way).
        let mut executing = false;
        for i in 0..self.reqs.len() {
            executing |= self.reqs[i].as_ref().is_some_and(|r| {
                r.qpn == qpn && has_conn(r.conn) && matches!(r.state, State::Executing)
            });
            let ends = self.reqs[i].as_ref().is_some_and(|r| {
                r.qpn == qpn
                    && match r.state {
                        State::NeedRead => r.reads_left == 0,
                        State::Ready | State::NeedSend => true,
                        _ => false,
                    }
            });
            if ends {
                self.end_req(i);
            }
        }
        // Receives held for its commands go back to the SRQ.
        let srq = &mut self.srq;
        self.incoming.remove_qp(qpn, |w| {
            srq.completed(w.wr, now);
        });
        // Nothing of it at the backend: a new association of its host need not wait for it.
        if !executing {
            c.queue.settled();
        }
        self.draining.insert(
            qpn,
            Drain {
                id: c.id,
                queue: c.queue,
                depth: c.depth,
                srq_generation: c.srq_generation,
                since: now,
                cause,
                last_wqe: false,
                flushed,
                marker: number,
                events_from: c.events_from,
                signaled_out: c.signaled_out,
                quiet_at: None,
            },
        );
        self.counters
            .connections
            .store(self.conns.len() as u64, Ordering::Relaxed);
    }

    /// Tears down every QP (the SRQ, CQ or device failed, or the daemon stops).
    pub fn teardown_all(&mut self, cause: Cause, now: Instant) {
        self.teardown_where(|_| true, cause, now);
    }

    /// Tears down every connection `which` picks.
    fn teardown_where(&mut self, which: impl Fn(&Conn) -> bool, cause: Cause, now: Instant) {
        let qpns: Vec<u32> = self
            .conns
            .iter()
            .filter(|(_, c)| which(c))
            .map(|(q, _)| *q)
            .collect();
        for q in qpns {
            self.teardown(q, cause, now);
        }
    }

    /// Listener `listener` is gone (removed, or its device went) while others on the same
    /// device serve on: its connections are torn down, the others' stay.
    pub fn end_listener(&mut self, listener: usize, now: Instant) {
        self.teardown_where(|c| c.listener == listener, Cause::Device, now);
    }

    /// Connections that came through listener `listener`.
    pub fn connections_of(&self, listener: usize) -> usize {
        self.conns
            .values()
            .filter(|c| c.listener == listener)
            .count()
    }

    /// The daemon stops: every QP is torn down. The SRQ goes with the data path, and async
    /// events are no longer routed, so the drains do not wait for LAST_WQE.
    pub fn shutdown(&mut self, now: Instant) {
        self.wait_last_wqe = false;
        self.teardown_all(Cause::Shutdown, now);
    }

    /// The CQ failed (an error event, or a poll that failed): every QP on it is torn down
    /// and the data path is replaced; its completions are lost, so the drains end by their
    /// timeout.
    pub(super) fn cq_failed(&mut self, why: &str, now: Instant) {
        if self.cq_broken {
            return;
        }
        slog::error!(self.log, "CQ failed: every QP on it is torn down and the data path is replaced";
            "cq" => self.cq.id(), "why" => why, "qps" => self.conns.len());
        self.cq_broken = true;
        self.stop_awaiting();
        self.teardown_all(Cause::Device, now);
    }

    /// Whether the CQ failed: the data path serves nothing more and is to be replaced.
    pub fn cq_broken(&self) -> bool {
        self.cq_broken
    }

    /// The device's count of async events read ([`any::Device::events_read`]).
    pub fn events_read(&self) -> u64 {
        self.dev.events_read()
    }

    /// QPs torn down and not yet destroyed.
    pub fn draining(&self) -> usize {
        self.draining.len()
    }

    /// Destroys the torn-down QPs whose drain is over, or which waited `DRAIN_TIMEOUT` (logged
    /// with what they still waited for; their request slots still waiting for the network are
    /// ended, and a completion that comes later for them is ignored).
    ///
    /// A drain is over when no request of the QP is left, its drain marker has completed
    /// (every send of it is accounted for), LAST_WQE_REACHED came (where the device sends
    /// it), and then the CQ was polled empty: the QP's flushed receives are in the CQ before
    /// LAST_WQE_REACHED is raised, and some providers (mlx5) drop a destroyed QP's
    /// completions, which would leave those receives counted as posted forever (IB 10.3.1).
    pub(super) fn reap_drained(&mut self, now: Instant) {
        if !self.lingering.is_empty() {
            let reqs = &self.reqs;
            let srq = &mut self.srq;
            self.lingering.retain(|l| {
                let left = reqs.iter().flatten().any(|r| r.conn == l.tag);
                if !left {
                    unreserve(srq, l.depth, l.srq_generation);
                }
                left
            });
        }
        if self.draining.is_empty() {
            return;
        }
        // A destroyed QP's requests (no connection) are not a later QP's of the same number.
        let requests_of = |reqs: &[Option<Req>], qpn: u32| {
            reqs.iter()
                .flatten()
                .filter(|r| r.qpn == qpn && has_conn(r.conn))
                .count()
        };
        // Each draining QP's requests, in one pass over the slots (a mass teardown, a host
        // with a thousand queues gone, would otherwise scan every slot for each QP, each turn).
        let mut live = std::mem::take(&mut self.scratch_counts);
        live.clear();
        for r in self.reqs.iter().flatten() {
            if has_conn(r.conn) && self.draining.contains_key(&r.qpn) {
                *live.entry(r.qpn).or_default() += 1;
            }
        }
        // The reused scratch vector: a turn with QPs draining allocates nothing either.
        let mut gone = std::mem::take(&mut self.scratch_qpns);
        let empty_polls = self.cq_empty_polls;
        // A failed CQ is never read empty again (its polls fail): nothing more of it can be
        // reaped, so a drain over (or timed out) ends at once.
        let cq_lost = self.cq_broken;
        for (&qpn, d) in &mut self.draining {
            let quiet = live.get(&qpn).copied().unwrap_or(0) == 0
                && d.flushed
                && (d.last_wqe || !self.wait_last_wqe);
            let expired = now.duration_since(d.since) >= DRAIN_TIMEOUT;
            if (quiet || expired) && d.quiet_at.is_none() {
                // The next poll that finds the CQ empty has reaped everything of it that is
                // there (even at the bound: what a destroy would drop is taken first).
                d.quiet_at = Some(empty_polls);
                self.settling += 1;
            }
            if d.quiet_at.is_some_and(|at| empty_polls > at || cq_lost) {
                gone.push(qpn);
            }
        }
        // A few a turn ([`DESTROYS_PER_TURN`]): the others stay settled, destroyed in the next
        // turns (the reactor does not sleep while any is draining).
        gone.truncate(DESTROYS_PER_TURN);
        for qpn in gone.drain(..) {
            let Some(d) = self.draining.remove(&qpn) else {
                continue;
            };
            if d.quiet_at.is_some() {
                self.settling -= 1;
            }
            let requests = live.get(&qpn).copied().unwrap_or(0);
            let timed_out = requests > 0 || !d.flushed || (!d.last_wqe && self.wait_last_wqe);
            if timed_out {
                self.counters.drain_timeouts.fetch_add(1, Ordering::Relaxed);
                slog::warn!(self.log, "QP drain timed out; destroying it";
                    "qpn" => qpn, "cause" => ?d.cause, "requests" => requests,
                    "sends_flushed" => d.flushed, "last_wqe" => d.last_wqe,
                    "signaled_sends_out" => d.signaled_out,
                    "state" => ?d.id.qp_state());
                // Slots waiting for an RDMA completion end now; those with a block operation
                // in flight end when it completes (the engine holds their buffer until then).
                self.end_waiting_on_network(qpn);
                // Their completions will never come.
                release_usize(&mut self.sends_in_flight, d.signaled_out as usize);
            }
            // Only a timed-out drain can have requests left (those its end above kept): their
            // receives stay reserved until they are done (an in-capsule write still holds
            // its receive at the disk; given back now, the SRQ would not grow to cover the
            // queues connected meanwhile, short by one receive for each).
            let lingers = timed_out && requests_of(&self.reqs, qpn) > 0;
            if !lingers {
                unreserve(&mut self.srq, d.depth, d.srq_generation);
            }
            drop(d.id);
            if lingers {
                // Block operations of it are still in flight: its queue stays counted by
                // its controller until they complete. Its requests lose their connection:
                // the device may give its QP number to a new QP, whose connection may take
                // the same index, and a late completion must never answer on it (a command
                // of the new host with the same ID would be completed, a read without its
                // data).
                let tag = self.lingering_tag();
                for r in self
                    .reqs
                    .iter_mut()
                    .flatten()
                    .filter(|r| r.qpn == qpn && has_conn(r.conn))
                {
                    r.conn = tag;
                }
                self.lingering.push(Lingering {
                    tag,
                    _queue: d.queue,
                    depth: d.depth,
                    srq_generation: d.srq_generation,
                });
            }
        }
        self.scratch_qpns = gone;
        self.scratch_counts = live;
    }

    /// A tag no lingering queue has (see [`ORPHANS`]).
    fn lingering_tag(&mut self) -> u32 {
        loop {
            self.next_lingering = self.next_lingering.wrapping_add(1) % (NO_CONN - ORPHANS);
            let tag = ORPHANS + self.next_lingering;
            if !self.lingering.iter().any(|l| l.tag == tag) {
                return tag;
            }
        }
    }

    /// Ends the requests of torn-down QP `qpn` that wait for nothing but its network (every
    /// state but `Executing`, whose block operations hold the buffer until they complete).
    pub(super) fn end_waiting_on_network(&mut self, qpn: u32) {
        for i in 0..self.reqs.len() {
            let waits = self.reqs[i]
                .as_ref()
                .is_some_and(|r| r.qpn == qpn && r.state != State::Executing);
            if waits {
                self.end_req(i);
            }
        }
    }

    /// The connection with CM token `token` went away.
    pub fn disconnected(&mut self, token: usize) {
        self.teardown_where(|c| c.token == token, Cause::Disconnect, Instant::now());
    }

    /// The device was removed: every QP is torn down (`Device`). Its async events are no
    /// longer routed, so the drains do not wait for LAST_WQE.
    pub fn device_removed(&mut self, now: Instant) {
        self.wait_last_wqe = false;
        self.stop_awaiting();
        self.teardown_all(Cause::Device, now);
    }
}

/// The NVMe queue of a QP destroyed after its drain timed out, kept until its block
/// operations complete, by the tag its requests carry (see [`ORPHANS`]); its receives stay
/// reserved in the SRQ until then.
pub(super) struct Lingering {
    pub(super) tag: u32,
    /// Its controller counts it until it is dropped.
    pub(super) _queue: Queue,
    pub(super) depth: u32,
    pub(super) srq_generation: u64,
}

/// Gives back `depth` receives reserved in the SRQ of generation `generation`: nothing if the
/// SRQ was replaced since (the new one's reservations are its new connections').
pub(super) fn unreserve(srq: &mut ElasticSrq, depth: u32, generation: u64) {
    if srq.generation() == generation {
        srq.unreserve(depth);
    }
}
