//! Block operations: a command's operations go to the reactor's io_uring engine tagged with
//! the request slot and its generation, as far as the engine has room; the command is
//! answered once every one it submitted has completed.

use super::*;

/// A block operation's tag: the request slot and its whole generation, so that a completion
/// can only finish the command that submitted it.
pub(super) fn block_tag(slot: usize, generation: u32) -> u64 {
    (u64::from(generation) << 32) | (slot as u64 & SLOT_MASK)
}

/// The most bytes one deallocate operation on `dev` covers: what the backend takes at once,
/// and under the engine's 4 GiB per operation.
pub(super) fn dealloc_piece(engine: &Engine, dev: DevId) -> u64 {
    const MOST: u64 = 1 << 30;
    engine.device(dev).map_or(MOST, |d| {
        let info = d.info();
        let bs = u64::from(info.logical_block_size);
        let backend = match info.deallocate_max_blocks {
            0 => MOST,
            n => u64::from(n) * bs,
        };
        backend.min(MOST / bs * bs)
    })
}

/// Where a request is in submitting its block operations: the next operation (a namespace
/// of a flush of every namespace, a range of a Dataset Management command) and how much of
/// that range (bytes) is already submitted.
#[derive(Clone, Copy, Debug)]
pub(super) struct Place {
    next_op: u32,
    op_off: u64,
}

/// Queues the operation of `op` at `at` on `engine` (a read takes a buffer of `pool`, a write
/// the request's buffer or receive, `data`), tagged `tag`, on device `dev`: what the engine
/// said and where the next one starts once this one is queued. `None` when `op` has nothing
/// left at `at`.
fn queue_op(
    engine: &mut Engine,
    pool: &BufPool,
    counters: &crate::stats::DataPathCounters,
    op: &IoOp,
    data: (&mut Option<DmaBuf>, Option<(u64, std::ptr::NonNull<u8>)>),
    at: Place,
    (dev, tag): (DevId, u64),
) -> Option<(Result<(), nvmfd_blockdev::Rejected>, Place)> {
    use nvmfd_blockdev::{BlockError, Rejected};
    let one = Place {
        next_op: 1,
        op_off: 0,
    };
    // A buffer or receive that should be there and is not: admission keeps a buffer for
    // every command it starts, so this does not happen.
    let missing = || {
        Err(Rejected {
            error: BlockError::QueueFull,
            buf: None,
        })
    };
    let queued = match op {
        IoOp::Read { offset, len } => {
            let buf = pool.take().and_then(|mut b| {
                let fits = b.set_len(*len as usize);
                fits.then_some(b)
            });
            match buf {
                Some(b) => (engine.read(dev, *offset, b, tag), one),
                None => (missing(), one),
            }
        }
        IoOp::Write { offset, len, fua } => match (data.0.take(), data.1) {
            (Some(b), _) => (engine.write(dev, *offset, b, *fua, tag), one),
            (None, Some((_, from))) => {
                // SAFETY: `from..from + len` lies in the receive the request keeps off the
                // SRQ until this write's completion is reaped (`finish_io`, `end_req` give it
                // back only then; an SRQ rebuilt meanwhile is kept, its memory registered, in
                // `retired_srqs` until its kept receives are given back); the engine is
                // dropped before the SRQs.
                let r = unsafe { engine.write_from(dev, *offset, from, *len, *fua, tag) };
                // Counted once queued: a write the engine refuses (full: it is queued again
                // later) is not, yet.
                if r.is_ok() {
                    bump(&counters.writes_from_receive, 1);
                }
                (r, one)
            }
            (None, None) => (missing(), one),
        },
        IoOp::Flush => (engine.flush(dev, tag), one),
        IoOp::FlushAll { .. } => (
            engine.flush(dev, tag),
            Place {
                next_op: at.next_op + 1,
                op_off: 0,
            },
        ),
        IoOp::WriteZeroes { offset, len, fua } => {
            (engine.write_zeroes(dev, *offset, *len, *fua, tag), one)
        }
        IoOp::Deallocate { ranges } => {
            let &(o, l) = ranges.get(at.next_op as usize)?;
            // A range longer than the backend takes at once goes in pieces.
            let piece = (l - at.op_off).min(dealloc_piece(engine, dev));
            let next = if at.op_off + piece < l {
                Place {
                    next_op: at.next_op,
                    op_off: at.op_off + piece,
                }
            } else {
                Place {
                    next_op: at.next_op + 1,
                    op_off: 0,
                }
            };
            (engine.deallocate(dev, o + at.op_off, piece, tag), next)
        }
    };
    Some(queued)
}

impl DataPath {
    /// Starts the block operations of request slot `i`'s command (its `Work::Io`, left in
    /// place: a 128-byte request is not moved out and back) (queued now, submitted at the
    /// end of the turn).
    pub(super) fn submit_block(&mut self, i: usize, now: Instant) {
        let Some(r) = self.reqs[i].as_mut() else {
            return;
        };
        r.state = State::Executing;
        r.ops_left = 0;
        r.next_op = 0;
        r.op_off = 0;
        r.ops_done = false;
        r.failed = None;
        self.issue(i, now);
    }

    /// Queues request `i`'s block operations from the next one on, as far as the engine has
    /// room. One the engine refuses for lack of room (`QueueFull`) puts the request in
    /// `blocked`, to go on as operations complete; one refused for any other reason stops
    /// the submitting with that error. The command is answered once every operation it
    /// submitted has completed, whatever failed (`on_block_done`), never before: no
    /// completion may outlive its command.
    pub(super) fn issue(&mut self, i: usize, now: Instant) {
        use nvmfd_blockdev::{BlockError, Rejected};
        let Some(r) = self.reqs[i].as_mut() else {
            return;
        };
        let Work::Io(io) = &r.work else {
            return;
        };
        let tag = block_tag(i, r.generation);
        let subsystem = self
            .conns
            .get_at(r.conn, r.qpn)
            .and_then(|c| c.queue.controller()?.subsystem);
        // A request of a QP torn down submits nothing more: what it submitted completes, and
        // then it ends.
        let Some(sub) = subsystem else {
            r.failed.get_or_insert(BlockError::UnknownDevice);
            return self.issued(i, now);
        };
        while !r.ops_done {
            let nsid = match &io.op {
                IoOp::FlushAll { nsids, .. } => match nsids.get(r.next_op as usize) {
                    Some(&n) => n,
                    None => break,
                },
                _ => io.nsid,
            };
            // The namespace the command was checked against, if still attached: not one
            // removed since, nor one added since under the same NSID.
            let dev = match self.devs.get(&(sub, nsid)) {
                Some(&(dev, since)) if since <= r.ns_changes => Some(dev),
                _ => None,
            };
            let Some(dev) = dev else {
                // A namespace removed since the shutdown's flush began is synced when its
                // device is let go of, and the shutdown completes only once it is
                // (`Target::release_begins`). One waiting here is synced off the reactor the
                // same way (`sync_awaiting`).
                if let IoOp::FlushAll { .. } = io.op {
                    let ns_changes = r.ns_changes;
                    r.next_op += 1;
                    handles::sync_awaiting(
                        (&self.awaiting, &self.target, &self.log),
                        sub,
                        nsid,
                        ns_changes,
                    );
                    continue;
                }
                // Only the namespace the command was checked against: not one added since
                // under the same NSID, which a command for the one removed must not reach.
                let awaiting = self
                    .awaiting
                    .iter()
                    .any(|a| (a.sub, a.nsid) == (sub, nsid) && a.since <= r.ns_changes);
                r.failed = Some(if awaiting {
                    // Namespace Not Ready: the host retries.
                    BlockError::Io(libc::ETIMEDOUT)
                } else {
                    BlockError::UnknownDevice
                });
                break;
            };
            // A null namespace's read: no buffer, no fill, no operation; the data is sent
            // from the zero region.
            if let IoOp::Read { offset, len } = io.op {
                if let Some(d) = self.engine.device(dev).filter(|d| d.reads_zeroes()) {
                    if u64::from(len.max(r.data_len)) <= self.zeros.len() as u64 {
                        match d.check_range(offset, u64::from(len)) {
                            Ok(()) => r.zeros = true,
                            Err(e) => r.failed = Some(e),
                        }
                        break;
                    }
                }
            }
            let place = Place {
                next_op: r.next_op,
                op_off: r.op_off,
            };
            let op = match io.op {
                IoOp::Write { .. } if self.hooks.discard_writes => &IoOp::Flush,
                _ => &io.op,
            };
            let Some((result, next)) = queue_op(
                &mut self.engine,
                match r.class {
                    Some(Class::Small) => &self.small,
                    _ => &self.pool,
                },
                &self.counters,
                op,
                (&mut r.buf, r.recv),
                place,
                (dev, tag),
            ) else {
                break;
            };
            match result {
                Ok(()) => {
                    r.ops_left += 1;
                    r.next_op = next.next_op;
                    r.op_off = next.op_off;
                    if !matches!(io.op, IoOp::FlushAll { .. } | IoOp::Deallocate { .. }) {
                        break;
                    }
                }
                // No room: it waits for some (the engine has operations of its own or of
                // other requests that will complete and make room).
                Err(Rejected {
                    error: BlockError::QueueFull,
                    buf,
                }) if self.engine.in_flight() > 0 => {
                    // Back where it was taken from, for the retry.
                    if matches!(io.op, IoOp::Write { .. }) {
                        r.buf = buf;
                    }
                    self.blocked.push_back(i);
                    return;
                }
                Err(e) => {
                    r.failed = Some(e.error);
                    break;
                }
            }
        }
        self.issued(i, now);
    }

    /// Request `i` submits nothing more: once every operation it submitted has completed
    /// (now, if none is out), it is answered.
    fn issued(&mut self, i: usize, now: Instant) {
        let Some(r) = self.reqs[i].as_mut() else {
            return;
        };
        r.ops_done = true;
        if r.ops_left == 0 {
            self.finish_io(i);
            self.process(i, now);
        }
    }

    /// Requests waiting for room in the engine go on, oldest first, while it has room: each
    /// once at most per call, so one that waits again (for something other than room) does
    /// not keep the reactor in this loop.
    pub(super) fn unblock(&mut self, now: Instant) {
        let mut left = self.blocked.len();
        while left > 0 && self.engine.capacity_left() > 0 {
            let Some(i) = self.blocked.pop_front() else {
                break;
            };
            left -= 1;
            self.issue(i, now);
        }
    }

    pub(super) fn on_block_done(&mut self, c: Completion, now: Instant) {
        let i = (c.tag & SLOT_MASK) as usize;
        let generation = (c.tag >> 32) as u32;
        let Some(r) = self
            .reqs
            .get_mut(i)
            .and_then(Option::as_mut)
            .filter(|r| r.generation == generation && r.state == State::Executing)
        else {
            // Never applied to whatever command holds the slot now (a read would be answered
            // without its data). Each operation completes its own command, so this is a bug.
            return self.stale(0, "block");
        };
        release(&mut r.ops_left, 1);
        if let Err(e) = &c.result {
            r.failed.get_or_insert_with(|| e.clone());
        }
        if c.op == nvmfd_blockdev::OpKind::Read {
            r.buf = c.buf;
        }
        // Done once every operation it submitted has completed and nothing is left to submit
        // (a request in `blocked` goes on from there).
        if r.ops_left == 0 && r.ops_done {
            self.finish_io(i);
            self.process(i, now);
        }
    }

    /// Request `i`'s block operations are done: its response (with the data of a read) is
    /// built and queued for sending. A request whose QP is gone ends here.
    pub(super) fn finish_io(&mut self, i: usize) {
        let Some(r) = self.reqs[i].as_mut() else {
            return;
        };
        let (qpn, ci) = (r.qpn, r.conn);
        if !matches!(r.work, Work::Io(_)) {
            return;
        }
        // The write from its receive is done: the receive goes back before the response.
        if let Some((wr, _)) = r.recv.take() {
            self.give_back(wr);
        }
        let Some(r) = self.reqs[i].as_mut() else {
            return;
        };
        let Some(conn) = self.conns.at(ci, qpn) else {
            return self.end_req(i);
        };
        let result = r
            .failed
            .take()
            .map_or(Ok(0), |e| Err(crate::serve::block_failure(&e)));
        // Read where it lies in the slot (a 128-byte request is not moved out).
        let Work::Io(io) = &r.work else {
            return;
        };
        let cqe = conn.queue.io_done(io, result);
        let ok = cqe.status().is_success();
        let read = matches!(io.op, IoOp::Read { .. });
        match (ok, &io.op) {
            (true, IoOp::Read { len, .. }) => {
                bump(&self.counters.read_bytes, u64::from(*len));
            }
            (true, IoOp::Write { len, .. }) => {
                bump(&self.counters.write_bytes, u64::from(*len));
            }
            _ => {}
        }
        // The core reuses the operation's lists (DSM ranges) for the next one; any other
        // request is dropped where it lies.
        let dsm = matches!(&r.work, Work::Io(io) if matches!(io.op, IoOp::Deallocate { .. }));
        if !dsm {
            r.work = Work::Respond;
        } else if let Work::Io(io) = std::mem::replace(&mut r.work, Work::Respond) {
            conn.queue.give_back_op(io.op);
        }
        r.cqe = cqe;
        // Only a successful read sends data; any other buffer goes back now.
        if !(ok && read) {
            r.buf = None;
            r.zeros = false;
            r.data_len = 0;
        }
        r.state = State::NeedSend;
        self.wait_send(i);
    }
}
