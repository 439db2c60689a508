//! Receives and the SRQ: a command arrives in a receive of the reactor's SRQ, waits in it
//! for admission when every request slot is taken, and starts in a request slot; its receive
//! goes back to the SRQ once the core has seen the command (or, for an in-capsule write, once
//! the write from it completed). A failed SRQ is rebuilt.

use super::*;

/// The most slots a connection holds (commands without a response but held Asynchronous
/// Event Requests, which hold none, and responses not yet taken) for its admin commands to
/// use the admin queues' reserve: a Linux host's admin queue has a command or two out.
const ADMIN_LANE_HOLD: u64 = 4;

impl DataPath {
    pub(super) fn on_receive(&mut self, c: &Wc, now: Instant) {
        if c.status != WcStatus::Success {
            // Flushed receives of a QP in error come back to the SRQ; the QP, if still live,
            // is torn down.
            self.srq.completed(c.wr_id, now);
            if self.conns.contains_key(&c.qp_num) {
                slog::warn!(self.log, "receive completion in error; tearing the QP down";
                    "qpn" => c.qp_num, "status" => ?c.status);
                self.teardown(c.qp_num, Cause::QpError, now);
            }
            return;
        }
        let Some((ci, conn)) = self.conns.get_mut_at(&c.qp_num) else {
            self.srq.completed(c.wr_id, now);
            self.counters.late_receives.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let outstanding = conn.received.saturating_sub(conn.answered);
        if outstanding >= u64::from(conn.depth) {
            // More commands without a response than the queue holds: the host broke SQ
            // flow control (or posts no receive for the responses, which then never go).
            let depth = conn.depth;
            self.srq.completed(c.wr_id, now);
            self.counters
                .commands_over_queue_size
                .fetch_add(1, Ordering::Relaxed);
            slog::warn!(self.log, "a host sent more commands than its queue holds; the queue ends";
                "qpn" => c.qp_num, "queue_size" => depth, "without_response" => outstanding);
            return self.teardown(c.qp_num, Cause::Controller, now);
        }
        conn.received += 1;
        // An admin queue's commands, and a new queue's Connect, have slots kept for them,
        // while their connection holds few slots (commands without a response, responses
        // not yet taken): a host taking none of its responses cannot hold the reserve that
        // other hosts' Keep Alives need. Any other command of a queue not yet connected (all
        // refused) is an I/O command's equal.
        let held = outstanding + u64::from(conn.signaled_out);
        let admin = match conn.queue.qid() {
            // Held Asynchronous Event Requests hold no slot (looked at only when it
            // matters: a host may hold four).
            Some(0) => {
                held < ADMIN_LANE_HOLD
                    || held.saturating_sub(conn.queue.held_aers() as u64) < ADMIN_LANE_HOLD
            }
            Some(_) => false,
            None => held < ADMIN_LANE_HOLD && self.peek_connect(c.wr_id, c.byte_len),
        };
        bump(&self.counters.commands, 1);
        // While both pools have a buffer for one more command and nothing waits, which class
        // this one is matters only once its capsule is copied out; else its SGL is read where
        // it landed.
        if self.incoming.len() == 0 && self.admits_any(admin) {
            return self.start_command((c.qp_num, Some(ci)), c.wr_id, c.byte_len, None, now);
        }
        let class = self.peek_class(c.wr_id, c.byte_len);
        let lane = Lane::of(admin, class);
        if self.incoming.has(lane)
            || !self.admits(lane, class)
            || self.incoming.next(|l, k| self.admits(l, k)).is_some()
        {
            // Every slot, or every buffer of its class, may be in use: the command waits its
            // turn in its lane, in its receive. Other lanes do not wait for it; and it does
            // not pass an older command of another lane that could start now (a slot came
            // free this turn), which the next turn starts first.
            self.counters
                .commands_queued
                .fetch_add(1, Ordering::Relaxed);
            // A command waiting its turn is traffic of its controller (a Keep Alive behind
            // other hosts' commands must not let the controller expire).
            if let Some(conn) = self.conns.get(&c.qp_num) {
                conn.queue.note_traffic();
            }
            self.incoming
                .push(lane, c.qp_num, c.wr_id, c.byte_len, class);
            return;
        }
        self.start_command((c.qp_num, Some(ci)), c.wr_id, c.byte_len, Some(class), now);
    }

    /// The class of the command in receive `wr` (`len` bytes), from its SGL read where it
    /// landed.
    fn peek_class(&self, wr: u64, len: u32) -> Class {
        let Some((cmd, _)) = self.srq.capsule_at(wr, len as usize) else {
            return Class::Small;
        };
        // SAFETY: the receive's 64-byte command SGE, completed and not given back (see
        // `start_command`); the copy is taken now.
        let sgl: [u8; 16] = unsafe { cmd.as_ptr().add(24).cast::<[u8; 16]>().read_unaligned() };
        Class::of(&sgl, self.small_size)
    }

    /// Whether the command in receive `wr` (`len` bytes) is a Fabrics Connect, read where it
    /// landed.
    fn peek_connect(&self, wr: u64, len: u32) -> bool {
        let Some((cmd, _)) = self.srq.capsule_at(wr, len as usize) else {
            return false;
        };
        // SAFETY: as in `peek_class`: the receive's 64-byte command SGE, completed and not
        // given back; bytes 0 (opcode) and 4 (Fabrics command type) are read now.
        let (opcode, fctype) = unsafe { (cmd.as_ptr().read(), cmd.as_ptr().add(4).read()) };
        opcode == nvmfd_nvme::wire::admin_opcode::FABRICS
            && fctype == nvmfd_nvme::wire::fctype::CONNECT
    }

    /// Admits the command in receive `wr`, a buffer of `class` kept for it (told from the
    /// command when `None`: both pools had room), and lets the core decide what it means,
    /// reading the capsule where it landed in the receive (nothing is copied). The receive
    /// goes back to the SRQ once the core has seen it, unless an in-capsule write keeps it.
    /// `conn` is the command's QP and, when known, its connection's index.
    pub(super) fn start_command(
        &mut self,
        (qpn, ci): (u32, Option<u32>),
        wr: u64,
        len: u32,
        class: Option<Class>,
        now: Instant,
    ) {
        let Some((cmd, icd)) = self.srq.capsule_at(wr, len as usize) else {
            // A receive of no chunk of this SRQ, or shorter than a command: the host broke
            // the protocol.
            self.srq.completed(wr, now);
            slog::warn!(self.log, "a capsule shorter than a command; the queue ends"; "qpn" => qpn, "bytes" => len);
            return self.teardown(qpn, Cause::Controller, now);
        };
        // SAFETY: the receive's command SGE (64 bytes) and data pages (`icd.1` bytes, within
        // what the receive holds) are memory of a chunk of this SRQ. The NIC wrote them before
        // the receive's completion was polled and cannot write them again before the receive
        // is re-posted, which happens only once it is given back (`srq.completed` below, or
        // `end_req`/`give_back` for a receive a request keeps); the chunk stays registered
        // and mapped until then. The slices are not used after that: `Arrived` lives in
        // this call, and a request that keeps the receive takes it out of `arrived` first.
        let (sqe, icd) = unsafe {
            (
                std::slice::from_raw_parts(cmd.as_ptr().cast_const(), 64),
                icd.map_or(&[][..], |(p, n)| {
                    std::slice::from_raw_parts(p.as_ptr().cast_const(), n)
                }),
            )
        };
        let class = class.unwrap_or_else(|| {
            <&[u8; 16]>::try_from(&sqe[24..40])
                .map_or(Class::Small, |d| Class::of(d, self.small_size))
        });
        // An in-capsule write keeps its receive (`begin`); any other goes back right after
        // the core has seen the command, before any response is posted.
        let mut arrived = Arrived {
            icd,
            recv: Some(wr),
        };
        if let Some(i) = self.take_slot((qpn, ci), Some(class)) {
            let ci = self.reqs[i].as_ref().map_or(NO_CONN, |r| r.conn);
            if let Some(conn) = self.conns.at(ci, qpn) {
                let a = conn.queue.handle_parts(sqe, arrived.icd, now);
                // A reset ends its controller's held AERs without completions: answered.
                let ended = conn.queue.take_ended_aers();
                if ended != 0 {
                    conn.answered += u64::from(ended);
                }
                self.begin(i, a, &mut arrived, now);
            } else {
                self.end_req(i);
            }
        } else {
            // Admission keeps a slot for every command it starts.
            slog::error!(self.log, "no request slot for an admitted command; it is dropped"; "qpn" => qpn);
        }
        if let Some(wr) = arrived.recv {
            self.srq.completed(wr, now);
        }
    }

    /// Takes a free request slot for a command of `qpn` (its connection's index, when known,
    /// beside it; the slot's generation moves on), with a buffer of `class` kept for it.
    pub(super) fn take_slot(
        &mut self,
        (qpn, ci): (u32, Option<u32>),
        class: Option<Class>,
    ) -> Option<usize> {
        // A free slot is empty; knowing it lets the request be built in place (no drop of an
        // old value, no copy of a 300-byte request per command). One in use is not free: it
        // leaves the list.
        let i = self.free.pop()?;
        if self.reqs[i].is_some() {
            // Not free (a bug): it leaves the list, logged.
            slog::error!(self.log, "a free request slot was in use"; "slot" => i);
            return None;
        }
        self.generations[i] = self.generations[i].wrapping_add(1);
        if let Some(c) = class {
            self.kept[c as usize] += 1;
        }
        let conn = ci.unwrap_or_else(|| self.conns.index_of(qpn));
        let generation = self.generations[i];
        let ns_changes = self.ns_changes;
        self.reqs[i] = Some(Req {
            qpn,
            conn,
            class,
            state: State::Ready,
            work: Work::Respond,
            nsegs: 0,
            next_seg: 0,
            reads_left: 0,
            data_len: 0,
            invalidate: None,
            buf: None,
            zeros: false,
            generation,
            ns_changes,
            ops_left: 0,
            next_op: 0,
            op_off: 0,
            ops_done: false,
            failed: None,
            cqe: nvmfd_nvme::wire::zeroed(),
            sq_held: 0,
            recv: None,
        });
        Some(i)
    }

    /// Completes the held Asynchronous Event Requests of the admin queue on `qpn` whose
    /// events came ([`Queue::poll_events`]): each completion is a response of its own, in a
    /// request slot that admission counts like a command's. With too few slots left for the
    /// most a queue holds, they wait for the next turn (`events_due`).
    pub(super) fn deliver_events(&mut self, qpn: u32) {
        if self.free.len() < nvmfd_nvme::AER_LIMIT {
            self.events_due = true;
            return;
        }
        let Some(conn) = self.conns.get_mut(&qpn) else {
            return;
        };
        if conn.queue.qid() != Some(0) {
            return;
        }
        let cqes = conn.queue.poll_events();
        let n = cqes.len();
        for (k, cqe) in cqes.into_iter().enumerate() {
            let Some(i) = self.take_slot((qpn, None), None) else {
                // Slots for every AER were checked for above: only a slot list that is
                // wrong (logged) gets here.
                slog::error!(self.log, "no request slot for an event's completion: the host's AERs are lost";
                             "qpn" => qpn, "lost" => n - k);
                break;
            };
            if let Some(r) = self.reqs[i].as_mut() {
                r.cqe = cqe;
            }
            self.counters.async_events.fetch_add(1, Ordering::Relaxed);
            self.wait_send(i);
        }
    }

    /// Completes every admin queue's held AERs whose events came (the control thread says
    /// when the target raised some).
    pub fn poll_events(&mut self) {
        self.events_due = false;
        let mut qpns = std::mem::take(&mut self.scratch_qpns);
        qpns.extend(
            self.conns
                .iter()
                .filter(|(_, c)| c.queue.qid() == Some(0))
                .map(|(q, _)| *q),
        );
        for q in qpns.drain(..) {
            self.deliver_events(q);
        }
        self.scratch_qpns = qpns;
    }

    /// A receive a request kept goes back to the SRQ.
    pub(super) fn give_back(&mut self, wr: u64) {
        release_usize(&mut self.held_receives, 1);
        if self.retired_held > 0 && !self.srq.owns(wr) {
            // One of a replaced SRQ's: the last lets the replaced SRQs go.
            self.retired_held -= 1;
            if self.retired_held == 0 {
                self.retired_srqs.clear();
            }
            return;
        }
        self.srq.completed(wr, Instant::now());
    }

    /// Replaces the broken SRQ by a new one of the next generation (receives of the old one
    /// completing late name no chunk of the new one).
    pub(super) fn rebuild_srq(&mut self, now: Instant) {
        let retired: Vec<u64> = self.retired_srqs.iter().map(|s| s.generation()).collect();
        match self.srq.rebuild(now, &retired) {
            Ok(srq) => {
                self.srq_events_from = self.dev.events_read();
                let old = std::mem::replace(&mut *self.srq, srq);
                if self.held_receives > 0 {
                    // In-capsule writes still write from its receives (at a slow disk: not
                    // waited for, connections would be refused meanwhile): it stays until
                    // they are given back. Every receive held now is a replaced SRQ's.
                    self.retired_srqs.push(old);
                    self.retired_held = self.held_receives;
                }
                self.srq_broken = false;
                self.srq_retry = None;
                self.counters.srq_rebuilds.fetch_add(1, Ordering::Relaxed);
                slog::info!(self.log, "SRQ rebuilt"; "srq" => self.srq.srq().id());
            }
            Err(e) => {
                // Tried again after a wait that doubles (every turn would flood the log);
                // connections are refused meanwhile.
                let wait = self
                    .srq_retry
                    .map_or(SRQ_RETRY_FIRST, |(_, w)| (w * 2).min(SRQ_RETRY_MAX));
                self.srq_retry = Some((now + wait, wait));
                self.counters.srq_errors.fetch_add(1, Ordering::Relaxed);
                slog::warn!(self.log, "cannot rebuild the SRQ"; "error" => %e, "retry_in" => ?wait);
            }
        }
    }
}

/// The wait before the second try at rebuilding a broken SRQ; it doubles with each failure.
const SRQ_RETRY_FIRST: std::time::Duration = std::time::Duration::from_millis(50);
/// The longest wait between tries.
const SRQ_RETRY_MAX: std::time::Duration = std::time::Duration::from_secs(5);
