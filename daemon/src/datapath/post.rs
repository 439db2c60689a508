//! Posting: the RDMA READs of host data and the responses (RDMA WRITEs chained with the
//! SEND) are staged per QP within the QP's budgets and posted once per QP at the end of the
//! turn; send completions give the budgets back and move the requests on.

use super::*;

/// Work requests handed to the provider in one call (a stack array: posting allocates
/// nothing), the longest chain a provider takes; a QP's work of one turn goes in as few
/// calls as that allows, usually one.
pub(super) const POST_BATCH: usize = MAX_SEND_CHAIN;
/// Send work request IDs: the kind in the top byte, then the low 24 bits of the request
/// slot's generation, then the slot (or, for a drain marker, the QP number).
pub(super) const KIND_SHIFT: u32 = 56;
pub(super) const KIND_SEND: u64 = 1;
pub(super) const KIND_READ: u64 = 2;
pub(super) const KIND_WRITE: u64 = 3;
pub(super) const KIND_DRAIN: u64 = 4;
pub(super) const GEN_SHIFT: u32 = 32;
pub(super) const GEN_MASK: u64 = (1 << 24) - 1;
pub(super) const SLOT_MASK: u64 = (1 << 32) - 1;

pub(super) fn wr_id(kind: u64, generation: u32, n: u64) -> u64 {
    (kind << KIND_SHIFT) | ((u64::from(generation) & GEN_MASK) << GEN_SHIFT) | (n & SLOT_MASK)
}

/// The request slot and the low 24 bits of its generation a send work request ID names.
pub(super) fn wr_slot(wr_id: u64) -> (usize, u32) {
    (
        (wr_id & SLOT_MASK) as usize,
        ((wr_id >> GEN_SHIFT) & GEN_MASK) as u32,
    )
}

/// A send work request of this turn, posted with the QP's others at the end of the turn.
#[derive(Clone, Copy, Debug)]
pub(super) struct Staged {
    pub(super) wr_id: u64,
    pub(super) op: SendOp,
    /// Local data; for an inline response, `cqe` is sent instead.
    pub(super) sge: Sge,
    pub(super) cqe: [u8; 16],
    pub(super) inline: bool,
    pub(super) signaled: bool,
}

/// Posts `staged` on `id` in batches; on failure, the index of the first WR not posted (every
/// one before it was posted).
pub(super) fn post_staged(id: &CmId, staged: &[Staged]) -> Result<(), (usize, VerbsError)> {
    const EMPTY: SendWr<'static> = SendWr {
        wr_id: 0,
        op: SendOp::Send,
        sges: &[],
        signaled: false,
        inline: None,
    };
    for (n, chunk) in staged.chunks(POST_BATCH).enumerate() {
        let mut wrs: [SendWr<'_>; POST_BATCH] = [EMPTY; POST_BATCH];
        for (wr, w) in wrs.iter_mut().zip(chunk) {
            *wr = SendWr {
                wr_id: w.wr_id,
                op: w.op,
                sges: if w.sge.length == 0 || w.inline {
                    &[]
                } else {
                    std::slice::from_ref(&w.sge)
                },
                signaled: w.signaled,
                inline: w.inline.then_some(&w.cqe[..]),
            };
        }
        // Those before the refused one were posted: they complete (or flush) as usual.
        id.post_send(&wrs[..chunk.len()])
            .map_err(|e| (n * POST_BATCH + e.posted().min(chunk.len()), e))?;
    }
    Ok(())
}

impl DataPath {
    /// Stages READs for the requests waiting on QP `qpn`, oldest first, as far as its READ
    /// budget and send queue allow.
    pub(super) fn pump_reads(&mut self, ci: u32, qpn: u32) {
        let Some(c) = self.conns.at(ci, qpn) else {
            return;
        };
        // A QP is in `dirty` exactly while it has work staged.
        let was_clean = c.staged.is_empty();
        while let Some(&i) = c.pending_reads.front() {
            let room = (c.read_budget - c.reads_used.min(c.read_budget))
                .min(c.sq_budget - c.sq_used.min(c.sq_budget));
            if room == 0 {
                break;
            }
            let Some(r) = self.reqs[i]
                .as_mut()
                .filter(|r| r.qpn == qpn && r.state == State::NeedRead)
            else {
                c.pending_reads.pop_front();
                continue;
            };
            let lkey = if r.class == Some(Class::Small) {
                self.small_mr.lkey()
            } else {
                self.data_mr.lkey()
            };
            let base = r.buf.as_mut().map_or(0, |b| b.as_mut_ptr() as u64);
            let n = room.min(r.nsegs - r.next_seg);
            for k in r.next_seg..r.next_seg + n {
                let s = self.segs[i][k as usize];
                c.staged.push(Staged {
                    wr_id: wr_id(KIND_READ, r.generation, i as u64),
                    op: SendOp::RdmaRead {
                        remote_addr: s.addr,
                        rkey: s.key,
                    },
                    sge: Sge {
                        addr: base + u64::from(s.off),
                        length: s.len,
                        lkey,
                    },
                    cqe: [0; 16],
                    inline: false,
                    signaled: true,
                });
            }
            r.next_seg += n;
            r.reads_left += n;
            c.reads_used += n;
            c.sq_used += n;
            c.signaled_out += n;
            self.sends_in_flight += n as usize;
            bump(&self.counters.rdma_reads, u64::from(n));
            if r.next_seg == r.nsegs {
                r.state = State::Reading;
                c.pending_reads.pop_front();
            }
        }
        if was_clean && !c.staged.is_empty() {
            self.dirty.push((ci, qpn));
        }
    }

    /// Stages the responses waiting on QP `qpn` (RDMA WRITEs of their data chained with the
    /// SEND, only the SEND signaled), oldest first, as far as its send queue allows.
    pub(super) fn pump_sends(&mut self, ci: u32, qpn: u32) {
        let Some(c) = self.conns.at(ci, qpn) else {
            return;
        };
        // A QP is in `dirty` exactly while it has work staged.
        let was_clean = c.staged.is_empty();
        while let Some(&i) = c.pending_sends.front() {
            let Some(r) = self.reqs[i]
                .as_mut()
                .filter(|r| r.qpn == qpn && r.state == State::NeedSend)
            else {
                c.pending_sends.pop_front();
                continue;
            };
            let (base, lkey, data_len) = match r.buf.as_mut() {
                Some(b) if r.class == Some(Class::Small) => {
                    (b.as_mut_ptr() as u64, self.small_mr.lkey(), r.data_len)
                }
                Some(b) => (b.as_mut_ptr() as u64, self.data_mr.lkey(), r.data_len),
                None if r.zeros => (self.zeros.addr(), self.zeros.lkey(), r.data_len),
                None => (0, 0, 0),
            };
            let writes = if self.hooks.omit_read_data {
                0
            } else {
                self.segs[i][..r.nsegs as usize]
                    .iter()
                    .take_while(|s| s.off < data_len)
                    .fold(0u32, |n, _| n + 1)
            };
            if c.sq_budget - c.sq_used.min(c.sq_budget) < writes + 1 {
                break;
            }
            for s in &self.segs[i][..writes as usize] {
                c.staged.push(Staged {
                    wr_id: wr_id(KIND_WRITE, r.generation, i as u64),
                    op: SendOp::RdmaWrite {
                        remote_addr: s.addr,
                        rkey: s.key,
                    },
                    sge: Sge {
                        addr: base + u64::from(s.off),
                        length: s.len.min(data_len - s.off),
                        lkey,
                    },
                    cqe: [0; 16],
                    inline: false,
                    signaled: false,
                });
            }
            let mut cqe = [0u8; 16];
            cqe.copy_from_slice(r.cqe.as_bytes());
            // One key at most can be invalidated by the SEND, and only when all the data
            // went through it.
            let op = match r.invalidate {
                Some(rkey) if r.nsegs <= 1 && self.send_invalidate => {
                    SendOp::SendWithInvalidate { rkey }
                }
                _ => SendOp::Send,
            };
            c.staged.push(Staged {
                wr_id: wr_id(KIND_SEND, r.generation, i as u64),
                op,
                sge: Sge::default(),
                cqe,
                inline: true,
                signaled: true,
            });
            if !r.cqe.status().is_success() {
                self.counters.command_errors.fetch_add(1, Ordering::Relaxed);
            }
            r.sq_held = writes + 1;
            r.state = State::Completing;
            c.sq_used += writes + 1;
            c.signaled_out += 1;
            c.answered += 1;
            self.sends_in_flight += 1;
            c.pending_sends.pop_front();
        }
        if was_clean && !c.staged.is_empty() {
            self.dirty.push((ci, qpn));
        }
    }

    /// Posts the turn's staged work requests: one call per QP (more only past `POST_BATCH`).
    /// The receives given back this turn go back to the SRQ first, in chains: a host that
    /// has its response may send its next command at once, and the SRQ covers only the
    /// queues' depths (a receive given back after the SRQ's post, by a blocked command that
    /// failed, say, would otherwise still be off it when the host's next command came).
    pub(super) fn flush(&mut self, now: Instant) {
        self.srq.flush();
        let mut dirty = std::mem::take(&mut self.dirty);
        for (ci, qpn) in dirty.drain(..) {
            self.flush_qp(ci, qpn, now);
        }
        // Nothing on this path stages work today; a QP that something here made dirty would
        // otherwise be dropped from the list and its staged work never posted.
        dirty.append(&mut self.dirty);
        self.dirty = dirty;
    }

    pub(super) fn flush_qp(&mut self, ci: u32, qpn: u32, now: Instant) {
        let Some(c) = self.conns.at(ci, qpn) else {
            return;
        };
        if c.staged.is_empty() {
            return;
        }
        let staged = std::mem::take(&mut c.staged);
        let result = post_staged(&c.id, &staged);
        let mut staged = staged;
        if let Err((first, e)) = result {
            // A send queue that refuses work is broken (or overflowed, which is the same to
            // its host): the QP goes, so that its host reconnects instead of waiting.
            self.counters.post_errors.fetch_add(1, Ordering::Relaxed);
            slog::warn!(self.log, "cannot post a send; tearing the QP down"; "qpn" => qpn, "error" => %e);
            if let Some(mut c) = self.conns.take_at(ci) {
                self.unstage(&mut c, &staged[first..]);
                self.conns.put_back(ci, c);
            }
            staged.clear();
            if let Some(c) = self.conns.at(ci, qpn) {
                c.staged = staged;
            }
            self.teardown(qpn, Cause::QpError, now);
            return;
        }
        staged.clear();
        if let Some(c) = self.conns.at(ci, qpn) {
            c.staged = staged;
        }
    }

    pub(super) fn on_completion(&mut self, c: &Wc, now: Instant) {
        // The ID tells receives from sends: an error completion's opcode is undefined.
        if c.wr_id < REQ_BASE {
            return self.on_receive(c, now);
        }
        let kind = c.wr_id >> KIND_SHIFT;
        let ok = c.status == WcStatus::Success;
        // What a completion names is checked before anything is counted: a QP destroyed
        // after its drain timed out may still have completions coming (rxe leaves them in
        // the CQ), and the device may have given its number to a new QP meanwhile.
        if kind == KIND_DRAIN {
            let qpn = (c.wr_id & SLOT_MASK) as u32;
            let (_, marker) = wr_slot(c.wr_id);
            let Some(d) = self
                .draining
                .get_mut(&qpn)
                .filter(|d| u64::from(d.marker) & GEN_MASK == u64::from(marker))
            else {
                return self.stale(c.qp_num, "drain marker of a destroyed QP");
            };
            release(&mut d.signaled_out, 1);
            release_usize(&mut self.sends_in_flight, 1);
            d.flushed = true;
            // Every work request posted before the marker has completed: the requests
            // still waiting on this QP's network (a response whose SEND was never posted
            // behind WRITEs that were) hold nothing the NIC can touch any more.
            self.end_waiting_on_network(qpn);
            return;
        }
        let (i, generation) = wr_slot(c.wr_id);
        // The command it was posted for is still in its slot, on this QP. (A request whose
        // QP was destroyed keeps only its block operations: nothing of it is posted.)
        let Some(r) = self.reqs.get_mut(i).and_then(Option::as_mut).filter(|r| {
            u64::from(r.generation) & GEN_MASK == u64::from(generation)
                && r.qpn == c.qp_num
                && has_conn(r.conn)
        }) else {
            return self.stale(c.qp_num, "send of no command in flight");
        };
        let (qpn, ci) = (r.qpn, r.conn);
        if kind == KIND_WRITE {
            // Unsignaled: only a flush or an error completes it; its SEND's completion frees
            // its send-queue entry.
            if !ok && self.conns.contains_key(&qpn) {
                self.teardown(qpn, Cause::QpError, now);
            }
            return;
        }
        // Every other send WR is signaled: one completion each, counted out of its QP's
        // (found by the request's index while live).
        if let Some(conn) = self.conns.at(ci, qpn) {
            release(&mut conn.signaled_out, 1);
            conn.sq_progress = conn.sq_progress.wrapping_add(1);
        } else if let Some(d) = self.draining.get_mut(&qpn) {
            release(&mut d.signaled_out, 1);
        } else {
            // A live request's QP is live or draining: this is a bug if it happens.
            return self.stale(qpn, "send of a QP neither live nor draining");
        }
        release_usize(&mut self.sends_in_flight, 1);
        if !ok && self.conns.contains_key(&qpn) {
            // A live QP's work failed (remote access error, retries exhausted, or flushed
            // because the QP went to ERR before any event said so): it is torn down.
            slog::warn!(self.log, "completion in error; tearing the QP down";
                "qpn" => qpn, "status" => ?c.status);
            self.teardown(qpn, Cause::QpError, now);
        }
        if kind == KIND_READ {
            self.read_done(i, ok, now);
        } else if let Some(held) = self.reqs[i].as_ref().map(|r| r.sq_held) {
            // (A teardown above leaves a request whose response is posted in its slot.)
            if let Some(conn) = self.conns.at(ci, qpn) {
                release(&mut conn.sq_used, held);
            }
            self.end_req(i);
        }
        // Room came free: requests waiting for it go on.
        self.pump_sends(ci, qpn);
        self.pump_reads(ci, qpn);
    }

    /// One of request `i`'s RDMA READs completed (`ok`, or in error): its budget returns,
    /// and after the last one the request goes on (or ends, its QP gone).
    fn read_done(&mut self, i: usize, ok: bool, now: Instant) {
        let Some(r) = self.reqs[i].as_mut() else {
            return;
        };
        let (qpn, ci) = (r.qpn, r.conn);
        let live = self.conns.get_at(ci, qpn).is_some();
        release(&mut r.reads_left, 1);
        if let Some(conn) = self.conns.at(ci, qpn) {
            release(&mut conn.reads_used, 1);
            release(&mut conn.sq_used, 1);
        }
        if r.reads_left > 0 {
            return;
        }
        if ok && live && r.state == State::Reading {
            r.state = State::Ready;
            self.process(i, now);
        } else if !live {
            // Its QP is gone (or this READ failed and took it down): no READ of it is out
            // any more, so its buffer can go back.
            self.end_req(i);
        }
    }

    /// A completion that names no command in flight: dropped, counted and logged.
    pub(super) fn stale(&self, qpn: u32, what: &'static str) {
        self.counters
            .stale_completions
            .fetch_add(1, Ordering::Relaxed);
        slog::warn!(self.log, "stale completion dropped"; "qpn" => qpn, "kind" => what);
    }

    /// Staged work requests of torn-down (or about to be) connection `c` that were not
    /// posted: their counts return, and a request ends only once nothing it posted can still
    /// touch its buffer. A READ not posted leaves its request waiting for those that were; a
    /// SEND not posted behind WRITEs that were leaves its request until the QP's drain
    /// marker completes (`end_waiting_on_network`).
    pub(super) fn unstage(&mut self, c: &mut Conn, lost: &[Staged]) {
        for w in lost {
            let kind = w.wr_id >> KIND_SHIFT;
            if w.signaled {
                release(&mut c.signaled_out, 1);
                release_usize(&mut self.sends_in_flight, 1);
            }
            let (i, generation) = wr_slot(w.wr_id);
            let Some(r) = self
                .reqs
                .get_mut(i)
                .and_then(Option::as_mut)
                .filter(|r| u64::from(r.generation) & GEN_MASK == u64::from(generation))
            else {
                continue;
            };
            match kind {
                KIND_READ => {
                    release(&mut r.reads_left, 1);
                    release(&mut c.reads_used, 1);
                    release(&mut c.sq_used, 1);
                    if r.reads_left == 0 {
                        self.end_req(i);
                    }
                }
                KIND_WRITE => {
                    release(&mut r.sq_held, 1);
                    release(&mut c.sq_used, 1);
                }
                KIND_SEND => {
                    release(&mut r.sq_held, 1);
                    release(&mut c.sq_used, 1);
                    // Its WRITEs come right before it and were counted out here when not
                    // posted: if none was posted, nothing of it is on the network.
                    if r.sq_held == 0 {
                        self.end_req(i);
                    }
                }
                _ => {}
            }
        }
    }
}
