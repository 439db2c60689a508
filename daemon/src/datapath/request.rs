//! The request state machine: one slot of the preallocated table per command in flight, and
//! the steps that move it (see [`State`]) from what the core said the command needs to its
//! response.

use super::*;

/// Where a command in flight is. [`DataPath::process`] moves a request from state to state
/// until it must wait for something outside it: a budget, the network or the disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum State {
    /// Host data must be fetched by RDMA READ. The request waits in its QP's `pending_reads`
    /// until the QP's READ budget and send queue have room for its next READs; a request
    /// with more pieces than the READ depth posts them in several rounds and stays here
    /// until the last is posted.
    NeedRead,
    /// Every READ is posted; `reads_left` have not completed yet.
    Reading,
    /// The data is here (or none was needed): the command's work runs next, the core's for a
    /// Fabrics or admin command that waited for data, block operations for I/O.
    Ready,
    /// Block operations in flight (`ops_left`); the engine owns the buffer until they end.
    Executing,
    /// The response is built. The request waits in its QP's `pending_sends` until the send
    /// queue has room for its RDMA WRITEs and SEND.
    NeedSend,
    /// Its WRITEs and SEND are posted (or staged for this turn's post); the SEND's completion
    /// ends the request.
    Completing,
}

/// What a request's command still has to do once its data is here.
#[derive(Debug)]
pub(super) enum Work {
    /// A core command (Connect data, DSM ranges) that waits for its data.
    Core(Command),
    /// A block operation.
    Io(IoRequest),
    /// Only the response.
    Respond,
}

/// One piece of host memory, and where it lies in the request's buffer.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Seg {
    pub(super) addr: u64,
    pub(super) len: u32,
    pub(super) key: u32,
    /// Offset in the request's buffer.
    pub(super) off: u32,
}

/// A command in flight: one slot of the preallocated table.
#[derive(Debug)]
pub(super) struct Req {
    pub(super) qpn: u32,
    /// Its connection's index in `conns` ([`NO_CONN`] for none), checked against `qpn`.
    pub(super) conn: u32,
    /// The class of the buffer kept for it at admission (none for an AER's completion).
    pub(super) class: Option<Class>,
    pub(super) state: State,
    pub(super) work: Work,
    /// Its pieces of host memory: the first `nsegs` of its row of `DataPath::segs`.
    pub(super) nsegs: u32,
    /// The next piece to READ.
    pub(super) next_seg: u32,
    /// READs posted and not completed.
    pub(super) reads_left: u32,
    /// Bytes moved to or from the host.
    pub(super) data_len: u32,
    /// The key the response SEND invalidates, when the host asked for it.
    pub(super) invalidate: Option<u32>,
    pub(super) buf: Option<DmaBuf>,
    /// A read of a device that reads zeroes: its data goes from the data path's zero region.
    pub(super) zeros: bool,
    /// The slot's generation when this command took it: every work request ID and block
    /// operation tag of the command carries it, and a completion that names another
    /// generation is stale and dropped.
    pub(super) generation: u32,
    /// The data path's count of namespace attachments when the command arrived: a device
    /// attached after that is not the namespace the command was checked against.
    pub(super) ns_changes: u64,
    /// Block operations submitted and not completed.
    pub(super) ops_left: u32,
    /// The next block operation to submit: a namespace of a flush of every namespace, a
    /// range of a Dataset Management command; `op_off` is how much of that range (bytes)
    /// is already submitted, as a range the backend cannot take whole goes in pieces.
    pub(super) next_op: u32,
    pub(super) op_off: u64,
    /// Submitting stopped: every operation is submitted, or one was refused (`failed`).
    pub(super) ops_done: bool,
    pub(super) failed: Option<nvmfd_blockdev::BlockError>,
    pub(super) cqe: Cqe,
    /// Send-queue entries its response holds (its WRITEs and SEND), freed by the SEND's
    /// completion.
    pub(super) sq_held: u32,
    /// The receive its in-capsule write data is written to the disk from, kept off the SRQ
    /// until that write completes, and where in it the data starts.
    pub(super) recv: Option<(u64, std::ptr::NonNull<u8>)>,
}

/// What a command arrived with, while it starts: its capsule (64-byte command, then in-capsule
/// data) and the receive it came in, until a request keeps the receive (an in-capsule write
/// written from it) or it goes back to the SRQ.
pub(super) struct Arrived<'a> {
    /// The in-capsule data, where it landed in the receive (empty once the receive is gone).
    pub(super) icd: &'a [u8],
    pub(super) recv: Option<u64>,
}

impl DataPath {
    pub(super) fn end_req(&mut self, i: usize) {
        let Some(slot) = self.reqs.get_mut(i) else {
            return;
        };
        let Some(r) = slot.as_mut() else {
            return;
        };
        let (class, recv) = (r.class, r.recv.take());
        // Dropped in place (its buffer goes back to its pool), not moved out first.
        *slot = None;
        self.free.push(i);
        if let Some(c) = class {
            release_usize(&mut self.kept[c as usize], 1);
        }
        if let Some((wr, _)) = recv {
            self.give_back(wr);
        }
    }

    /// A buffer of `len` bytes for request `i`, from the pool of the class admission kept
    /// one of for it.
    pub(super) fn buffer(&self, i: usize, len: u32) -> Option<DmaBuf> {
        let class = self.reqs.get(i)?.as_ref()?.class?;
        let mut b = self.pool_of(class).take()?;
        b.set_len(len as usize).then_some(b)
    }

    /// Sets request `i`'s host memory pieces from `dref` (a list is read from the in-capsule
    /// data `icd`).
    pub(super) fn set_segs(&mut self, i: usize, dref: DataRef, icd: &[u8]) -> bool {
        let Some(r) = self.reqs[i].as_mut() else {
            return false;
        };
        let segs = &mut self.segs[i];
        let len = dref.len();
        r.data_len = len;
        r.nsegs = 0;
        r.invalidate = dref.invalidate_key();
        let mut put = |addr: u64, l: u32, key: u32, off: &mut u32| {
            let n = l.min(len - *off);
            if n > 0 && (r.nsegs as usize) < MAX_SEGS {
                segs[r.nsegs as usize] = Seg {
                    addr,
                    len: n,
                    key,
                    off: *off,
                };
                r.nsegs += 1;
                *off += n;
            }
        };
        let mut off = 0;
        match dref {
            DataRef::Keyed { addr, key, .. } => put(addr, len, key, &mut off),
            DataRef::KeyedList { offset, count, .. } => {
                for (addr, l, key) in nvmfd_nvme::keyed_segments(icd, offset, count) {
                    put(addr, l, key, &mut off);
                }
            }
            DataRef::InCapsule { .. } => return false,
        }
        off == len
    }

    /// Starts request `i` on what the core said its command needs. `arrived` is the command's
    /// capsule and receive (an empty capsule and no receive once they are gone); an
    /// in-capsule write takes the receive, to write from it.
    pub(super) fn begin(
        &mut self,
        i: usize,
        mut a: Action,
        arrived: &mut Arrived<'_>,
        now: Instant,
    ) {
        let Some(qpn) = self.reqs[i].as_ref().map(|r| r.qpn) else {
            return;
        };
        loop {
            match a {
                Action::Fetch {
                    cmd,
                    from: DataRef::InCapsule { offset, len },
                } => {
                    let s = offset as usize;
                    let data = arrived.icd.get(s..s + len as usize).unwrap_or(&[]);
                    let Some(conn) = self.conns.get_mut(&qpn) else {
                        return self.end_req(i);
                    };
                    a = conn.queue.data_arrived(cmd, data, now);
                }
                Action::Fetch { cmd, from } => {
                    let buf = self.buffer(i, from.len());
                    if buf.is_none() || !self.set_segs(i, from, arrived.icd) {
                        return self.protocol_error(i, qpn, now);
                    }
                    if let Some(r) = self.reqs[i].as_mut() {
                        r.buf = buf;
                        r.work = Work::Core(cmd);
                    }
                    return self.wait_read(i);
                }
                Action::Io(io) => return self.begin_io(i, io, arrived, now),
                Action::Respond { cqe, data } => {
                    return self.begin_respond(i, cqe, data, arrived.icd, now)
                }
                // An AER holds nothing while it waits; an event already pending completes
                // it at once.
                Action::Hold => {
                    self.end_req(i);
                    return self.deliver_events(qpn);
                }
                Action::Disconnect { cqe, reason } => {
                    slog::info!(self.log, "the host's queue ends"; "qpn" => qpn, "why" => reason);
                    match cqe {
                        Some(c) => {
                            if let Some(r) = self.reqs[i].as_mut() {
                                r.cqe = c;
                            }
                            self.wait_send(i);
                        }
                        None => self.end_req(i),
                    }
                    // The last response goes out before the QP goes to ERR.
                    return self.teardown(qpn, Cause::Controller, now);
                }
            }
        }
    }

    /// Request `i`'s command is a block operation: its data is placed (written from the
    /// receive it arrived in, copied, or fetched by RDMA READ) and it goes on.
    fn begin_io(&mut self, i: usize, io: IoRequest, arrived: &mut Arrived<'_>, now: Instant) {
        let Some(qpn) = self.reqs[i].as_ref().map(|r| r.qpn) else {
            return;
        };
        let write = matches!(io.op, IoOp::Write { .. });
        match io.data {
            Some(DataRef::InCapsule { offset, len }) if write => {
                // Written from the receive it arrived in (page-aligned, so direct I/O takes
                // it) when it lies whole there; else from a copy.
                let from = arrived.recv.filter(|_| offset % 4096 == 0).and_then(|wr| {
                    let (base, cap) = self.srq.icd(wr)?;
                    let end = offset as usize + len as usize;
                    // SAFETY: offset + len <= cap, inside the receive's pages.
                    (end <= cap).then(|| (wr, unsafe { base.add(offset as usize) }))
                });
                let buf = match from {
                    Some(_) => None,
                    None => {
                        let s = offset as usize;
                        let Some(mut buf) = self.buffer(i, len) else {
                            return self.protocol_error(i, qpn, now);
                        };
                        let Some(data) = arrived.icd.get(s..s + len as usize) else {
                            return self.protocol_error(i, qpn, now);
                        };
                        buf.as_mut_slice().copy_from_slice(data);
                        Some(buf)
                    }
                };
                if from.is_some() {
                    // The request keeps the receive until its write completes.
                    arrived.recv = None;
                    self.held_receives += 1;
                }
                if let Some(r) = self.reqs[i].as_mut() {
                    r.buf = buf;
                    r.recv = from;
                    r.work = Work::Io(io);
                    r.state = State::Ready;
                }
            }
            Some(d @ (DataRef::Keyed { .. } | DataRef::KeyedList { .. })) => {
                let buf = if write { self.buffer(i, d.len()) } else { None };
                if (write && buf.is_none()) || !self.set_segs(i, d, arrived.icd) {
                    return self.protocol_error(i, qpn, now);
                }
                if let Some(r) = self.reqs[i].as_mut() {
                    r.buf = buf;
                    r.work = Work::Io(io);
                }
                if write {
                    return self.wait_read(i);
                }
            }
            _ => {
                if let Some(r) = self.reqs[i].as_mut() {
                    r.work = Work::Io(io);
                    r.state = State::Ready;
                }
            }
        }
        self.process(i, now);
    }

    /// Request `i`'s command is answered by the core: its data (if any) goes to a buffer,
    /// to be written to the host's memory before the completion is sent.
    fn begin_respond(
        &mut self,
        i: usize,
        cqe: Cqe,
        data: Option<(Vec<u8>, DataRef)>,
        icd: &[u8],
        now: Instant,
    ) {
        let Some(qpn) = self.reqs[i].as_ref().map(|r| r.qpn) else {
            return;
        };
        if let Some((bytes, dest)) = data {
            let n = dest
                .len()
                .min(u32::try_from(bytes.len()).unwrap_or(u32::MAX));
            let Some(mut b) = self.buffer(i, n.max(1)) else {
                return self.protocol_error(i, qpn, now);
            };
            b.set_len(n as usize);
            b.as_mut_slice().copy_from_slice(&bytes[..n as usize]);
            if !self.set_segs(i, dest, icd) {
                return self.protocol_error(i, qpn, now);
            }
            if let Some(r) = self.reqs[i].as_mut() {
                r.data_len = n;
                r.buf = Some(b);
            }
            // The core reuses its vector for the next answer.
            if let Some(conn) = self.conns.get_mut(&qpn) {
                conn.queue.give_back_bytes(bytes);
            }
        }
        if let Some(r) = self.reqs[i].as_mut() {
            r.cqe = cqe;
        }
        self.wait_send(i);
    }

    /// A command whose data cannot be placed (the core checked it, so the host broke the
    /// protocol or the pools are wrong): the QP goes.
    pub(super) fn protocol_error(&mut self, i: usize, qpn: u32, now: Instant) {
        slog::warn!(self.log, "a command's data cannot be placed; tearing the QP down"; "qpn" => qpn);
        self.end_req(i);
        self.teardown(qpn, Cause::Controller, now);
    }

    /// Moves request `i` as far as it goes without waiting (see [`State`]).
    pub(super) fn process(&mut self, i: usize, now: Instant) {
        let Some(r) = self.reqs[i].as_mut() else {
            return;
        };
        let (qpn, ci) = (r.qpn, r.conn);
        let live = self.conns.get_at(ci, qpn).is_some();
        match r.state {
            // The QP is gone: nothing will send or fetch for it; the request ends once nothing
            // outside it holds its buffer.
            State::NeedRead | State::Ready | State::NeedSend if !live => {
                if r.reads_left == 0 {
                    self.end_req(i);
                }
            }
            // Waiting: for a budget (queued), the network or the disk.
            State::NeedRead
            | State::Reading
            | State::Executing
            | State::NeedSend
            | State::Completing => {}
            State::Ready if matches!(r.work, Work::Io(_)) => self.submit_block(i, now),
            State::Ready => match std::mem::replace(&mut r.work, Work::Respond) {
                Work::Core(cmd) => {
                    let buf = r.buf.take();
                    let data = buf.as_ref().map_or(&[][..], |b| b.as_slice());
                    let Some(conn) = self.conns.at(ci, qpn) else {
                        return self.end_req(i);
                    };
                    let a = conn.queue.data_arrived(cmd, data, now);
                    drop(buf);
                    let mut gone = Arrived {
                        icd: &[],
                        recv: None,
                    };
                    self.begin(i, a, &mut gone, now);
                }
                Work::Respond => self.wait_send(i),
                // Not here: started in place above.
                Work::Io(io) => {
                    r.work = Work::Io(io);
                    self.submit_block(i, now);
                }
            },
        }
    }

    /// Request `i` needs RDMA READs: it queues for its QP's READ budget.
    pub(super) fn wait_read(&mut self, i: usize) {
        let Some(r) = self.reqs[i].as_mut() else {
            return;
        };
        r.state = State::NeedRead;
        let (qpn, ci) = (r.qpn, r.conn);
        match self.conns.at(ci, qpn) {
            Some(c) => c.pending_reads.push_back(i),
            None => return self.end_req(i),
        }
        self.pump_reads(ci, qpn);
    }

    /// Request `i`'s response is ready: it queues for its QP's send queue.
    pub(super) fn wait_send(&mut self, i: usize) {
        let Some(r) = self.reqs[i].as_mut() else {
            return;
        };
        r.state = State::NeedSend;
        let (qpn, ci) = (r.qpn, r.conn);
        match self.conns.at(ci, qpn) {
            Some(c) => c.pending_sends.push_back(i),
            None => return self.end_req(i),
        }
        self.pump_sends(ci, qpn);
    }
}
