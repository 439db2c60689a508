//! One queue (admin or I/O) of one connection: what each command means, as a sans-I/O state
//! machine. The transport hands over capsules and carries out the [`Action`]s the queue asks
//! for (move data, do block I/O, send a completion); it never decides what a command means.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::block::BlockFailure;
use zerocopy::little_endian::{U16, U32};
use zerocopy::IntoBytes;

use crate::target::{
    Controller, CtrlState, EndReason, IoCounts, QueueStats, Subsystem, Target, DISCOVERY_NQN,
};
use crate::wire::{self, status, ConnectCmd, ConnectData, Cqe, Sgl, Sqe, Status};
use crate::{admin, io};

mod connect;
mod sgl;

/// Size of a submission queue entry.
pub const SQE_SIZE: usize = 64;

/// A command the queue accepted, carried through the transport until it completes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Command {
    /// The submission queue entry.
    pub sqe: Sqe,
    /// SQ head after fetching it, reported in its completion.
    pub sqhd: u16,
}

impl Command {
    /// Command identifier.
    pub fn cid(&self) -> u16 {
        self.sqe.cid.get()
    }
}

/// Where a command's data is in host memory or in the capsule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataRef {
    /// In the capsule, `offset` bytes after the SQE.
    InCapsule {
        /// Offset in the in-capsule data.
        offset: u32,
        /// Length.
        len: u32,
    },
    /// Host memory in several pieces, by RDMA: `count` keyed data block descriptors in the
    /// capsule at `offset` (a last segment descriptor pointed there; the list was checked).
    /// The data fills them in order; [`keyed_segments`] lists them.
    KeyedList {
        /// Offset of the descriptor list in the in-capsule data.
        offset: u32,
        /// Descriptors.
        count: u32,
        /// Bytes to move (at most the descriptors' total).
        len: u32,
    },
    /// Host memory, by RDMA.
    Keyed {
        /// Host address.
        addr: u64,
        /// Length.
        len: u32,
        /// Remote key.
        key: u32,
        /// Send the response with invalidate of `key`.
        invalidate: bool,
    },
}

impl DataRef {
    /// Length in bytes.
    pub fn len(&self) -> u32 {
        match *self {
            DataRef::InCapsule { len, .. }
            | DataRef::Keyed { len, .. }
            | DataRef::KeyedList { len, .. } => len,
        }
    }
    /// Whether the length is zero.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The key to invalidate with the response, if the host asked for it.
    pub fn invalidate_key(&self) -> Option<u32> {
        match *self {
            DataRef::Keyed {
                key,
                invalidate: true,
                ..
            } => Some(key),
            _ => None,
        }
    }
}

/// Entries an admin queue may have (ASQSZ in the discovery log; NVMe-oF's minimum, and the
/// kernel target's limit): an admin queue asking for more is refused.
pub const ADMIN_QUEUE_ENTRIES: u16 = 32;

/// Keyed data block descriptors one command may list (MSDBD in Identify Controller).
pub const MAX_SGL_DESCRIPTORS: u32 = 16;

/// The keyed data block descriptors of a [`DataRef::KeyedList`] in `icd` (the capsule's
/// in-capsule data): `(addr, len, key)` each, in order. Checked when the command was taken.
pub fn keyed_segments(
    icd: &[u8],
    offset: u32,
    count: u32,
) -> impl Iterator<Item = (u64, u32, u32)> + '_ {
    let start = offset as usize;
    let end = start + count as usize * 16;
    icd.get(start..end)
        .unwrap_or(&[])
        .chunks_exact(16)
        .filter_map(|d| match wire::read::<wire::SglDesc>(d)?.decode() {
            Sgl::Keyed { addr, len, key, .. } => Some((addr, len, key)),
            _ => None,
        })
}

/// A block-device operation for the transport to run, then report with [`Queue::io_done`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IoRequest {
    /// The command.
    pub cmd: Command,
    /// Namespace.
    pub nsid: u32,
    /// What to do.
    pub op: IoOp,
    /// Host data: where writes come from and reads go to.
    pub data: Option<DataRef>,
}

/// A block operation, in bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IoOp {
    /// Read `len` bytes at `offset`, then push them to the host.
    Read {
        /// Byte offset.
        offset: u64,
        /// Byte length.
        len: u32,
    },
    /// Fetch `len` bytes from the host, then write them at `offset`.
    Write {
        /// Byte offset.
        offset: u64,
        /// Byte length.
        len: u32,
        /// Durable before completion.
        fua: bool,
    },
    /// Flush the namespace.
    Flush,
    /// Zero `len` bytes at `offset`.
    WriteZeroes {
        /// Byte offset.
        offset: u64,
        /// Byte length.
        len: u64,
        /// Durable before completion.
        fua: bool,
    },
    /// Deallocate each (offset, len) range.
    Deallocate {
        /// Byte ranges.
        ranges: Vec<(u64, u64)>,
    },
    /// Flush these namespaces (controller shutdown); no host data.
    FlushAll {
        /// Namespaces.
        nsids: Vec<u32>,
        /// The controller's epoch when the shutdown began: a reset since ends it, and its
        /// end reports nothing to the controller enabled again.
        epoch: u32,
    },
}

/// What the transport must do next for a command.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Send `cqe`. With `data`, first push those bytes to the host at `dest` (only as many as
    /// `dest` holds).
    Respond {
        /// The completion.
        cqe: Cqe,
        /// Bytes for the host, and where they go.
        data: Option<(Vec<u8>, DataRef)>,
    },
    /// Fetch the command's data (RDMA READ for keyed, a copy from the capsule otherwise),
    /// then call [`Queue::data_arrived`].
    Fetch {
        /// The command.
        cmd: Command,
        /// Where the data is.
        from: DataRef,
    },
    /// Run a block operation, then call [`Queue::io_done`].
    Io(IoRequest),
    /// Nothing now: the command (an Asynchronous Event Request) completes later, through
    /// [`Queue::poll_events`].
    Hold,
    /// Close the connection (after sending `cqe`, when there is one).
    Disconnect {
        /// A last completion.
        cqe: Option<Cqe>,
        /// Why, for the log.
        reason: &'static str,
    },
}

/// The NVMe/RDMA connect request parameters the transport saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CmParams {
    /// Queue ID.
    pub qid: u16,
    /// Host SQ size, 0's based.
    pub hsqsize: u16,
}

/// One queue of one connection.
pub struct Queue {
    target: Target,
    cm: Option<CmParams>,
    /// Queue ID and size, once connected.
    qid: Option<u16>,
    sqsize: u16,
    sqhd: u16,
    ctrl: Option<Arc<Controller>>,
    /// A snapshot of its controller's subsystem, taken anew when the target's subsystems
    /// change (`seen_version`).
    subsystem: Option<Arc<Subsystem>>,
    seen_version: u64,
    /// In-capsule data this queue's receives hold: what a capsule may carry and an in-capsule
    /// SGL may describe.
    in_capsule_limit: u32,
    /// The controller's reset epoch when this queue connected.
    epoch: u32,
    /// Counted in its controller's `io_queues_unsettled` (an I/O queue, until `settled`).
    unsettled: bool,
    /// An I/O queue holding its ID in its controller (until `connection_lost` or the drop).
    holds_qid: bool,
    /// Response data and DSM ranges of earlier commands, handed back by the transport
    /// (`give_back_bytes`, `give_back_op`) and refilled for the next: once a queue has
    /// answered one of each, answering more allocates nothing.
    spare_bytes: Vec<u8>,
    spare_ranges: Vec<(u64, u64)>,
    /// Where the host connects from, when the transport said.
    peer: Option<String>,
    /// Its entry in the controller's queues, once connected.
    stats: Option<Arc<QueueStats>>,
    /// Held Asynchronous Event Requests of this admin queue that a reset ended without a
    /// completion, not yet taken by the transport ([`Queue::take_ended_aers`]).
    pub(crate) aers_ended: u32,
}

impl std::fmt::Debug for Queue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queue")
            .field("qid", &self.qid)
            .field("cntlid", &self.ctrl.as_ref().map(|c| c.cntlid))
            .finish()
    }
}

/// A completion for `cmd` with `status` and `dw0`.
pub(crate) fn cqe(cmd: &Command, qid: u16, st: Status, dw0: u32) -> Cqe {
    Cqe {
        dw0: U32::new(dw0),
        dw1: U32::new(0),
        sqhd: U16::new(cmd.sqhd),
        sqid: U16::new(qid),
        cid: cmd.sqe.cid,
        status: U16::new(st.0 << 1),
    }
}

impl Queue {
    /// A new queue on a fresh connection. `cm` carries the RDMA CM request's parameters,
    /// checked against Connect; transports without one pass `None`.
    pub fn new(target: &Target, cm: Option<CmParams>) -> Queue {
        Queue {
            target: target.clone(),
            cm,
            qid: None,
            sqsize: 0,
            sqhd: 0,
            ctrl: None,
            subsystem: None,
            seen_version: 0,
            // The admin queue's too: an RDMA transport's receives are the same for every queue
            // (nvmfd's come from one SRQ per reactor), so an admin capsule can carry no more
            // in-capsule data than an I/O capsule (IOCCSZ).
            in_capsule_limit: target.limits().in_capsule_data_size,
            epoch: 0,
            unsettled: false,
            holds_qid: false,
            spare_bytes: Vec::new(),
            spare_ranges: Vec::new(),
            peer: None,
            stats: None,
            aers_ended: 0,
        }
    }

    /// Records where the host connects from (shown with its controller's queues).
    pub fn set_peer(&mut self, peer: String) {
        self.peer = Some(peer);
    }

    /// A buffer for response data, `len` zeroes long (a spare one when there is).
    pub(crate) fn take_bytes(&mut self, len: usize) -> Vec<u8> {
        let mut v = std::mem::take(&mut self.spare_bytes);
        v.clear();
        v.resize(len, 0);
        v
    }

    /// An empty list for DSM ranges (a spare one when there is).
    pub(crate) fn take_ranges(&mut self) -> Vec<(u64, u64)> {
        let mut v = std::mem::take(&mut self.spare_ranges);
        v.clear();
        v
    }

    /// Hands back the data of an [`Action::Respond`] once the transport has sent (or copied)
    /// it, for the next response to reuse.
    pub fn give_back_bytes(&mut self, v: Vec<u8>) {
        if v.capacity() > self.spare_bytes.capacity() {
            self.spare_bytes = v;
        }
    }

    /// Hands back a finished operation's lists (DSM ranges), for the next one to reuse.
    pub fn give_back_op(&mut self, op: IoOp) {
        if let IoOp::Deallocate { ranges } = op {
            if ranges.capacity() > self.spare_ranges.capacity() {
                self.spare_ranges = ranges;
            }
        }
    }

    /// The queue ID, once connected.
    pub fn qid(&self) -> Option<u16> {
        self.qid
    }

    /// Asynchronous Event Requests its controller holds (an admin queue's commands without
    /// a response that hold no request slot while they wait); 0 without a controller.
    pub fn held_aers(&self) -> usize {
        self.ctrl.as_ref().map_or(0, |c| c.lock().held_aers.len())
    }

    /// How many held Asynchronous Event Requests of this admin queue a controller reset
    /// ended since the last call: the host takes them as aborted and gets no completion for
    /// them, so a transport counting commands without a response counts them answered.
    /// Look after each command the queue handles (only a Property Set resets).
    pub fn take_ended_aers(&mut self) -> u32 {
        std::mem::take(&mut self.aers_ended)
    }

    /// Counts as traffic of the queue's controller (restarts its keep-alive timer), as a
    /// command it processes does: for a command that waits for admission.
    pub fn note_traffic(&self) {
        if let Some(ctrl) = self.ctrl.as_ref() {
            if !ctrl.traffic.load(Ordering::Relaxed) {
                ctrl.traffic.store(true, Ordering::Relaxed);
            }
        }
    }

    /// The controller, once connected.
    pub fn controller(&self) -> Option<&Arc<Controller>> {
        self.ctrl.as_ref()
    }

    /// The transport tore this I/O queue's connection down with none of its commands at a
    /// backend: nothing of it can reach the disk any more (a write whose data was still being
    /// fetched is never submitted), so a new association of its host need not wait for it.
    ///
    /// Its queue ID, kept since its connection was lost, is free now.
    pub fn settled(&mut self) {
        if let (Some(ctrl), true) = (self.ctrl.as_ref(), self.unsettled) {
            self.unsettled = false;
            ctrl.io_queues_unsettled.fetch_sub(1, Ordering::AcqRel);
        }
        self.release_qid();
    }

    /// The transport tore this queue's connection down. An admin queue's controller ends
    /// now, not when the queue is dropped once its connection has drained: a Connect of the
    /// same host meanwhile finds it ended (and fenced while I/O queues of it are alive).
    ///
    /// An I/O queue's ID stays taken while commands of it may be at a backend, until
    /// [`Queue::settled`] (the transport saw none left) or the queue is dropped: a queue the
    /// host connects with that ID meanwhile could have a write of it overtaken by an older
    /// one of this queue. Its Connect is answered Controller Busy, which the host retries.
    pub fn connection_lost(&mut self) {
        match (self.ctrl.as_ref(), self.qid) {
            (Some(ctrl), Some(0)) => ctrl.end(EndReason::AdminQueueLost),
            (Some(ctrl), Some(qid)) if self.unsettled && self.holds_qid => {
                self.target.inner.lost_hook.run();
                // The epoch is compared under the lock a reset moves it under: a reset
                // between the two would leave the ID marked lost in the new epoch.
                let mut st = ctrl.lock();
                if ctrl.epoch.load(Ordering::Acquire) != self.epoch {
                    return;
                }
                let slot = usize::from(qid) - 1;
                if st.io_queues_lost.len() <= slot {
                    st.io_queues_lost.resize(slot + 1, false);
                }
                st.io_queues_lost[slot] = true;
            }
            (Some(_), Some(_)) => self.release_qid(),
            _ => {}
        }
    }

    /// Frees this I/O queue's ID in its controller, once (the slot may be another queue's
    /// afterwards). A queue from before a reset holds no slot: the reset cleared them.
    fn release_qid(&mut self) {
        let (Some(ctrl), Some(qid)) = (self.ctrl.as_ref(), self.qid) else {
            return;
        };
        if !std::mem::take(&mut self.holds_qid) || qid == 0 {
            return;
        }
        // Under the lock a reset moves the epoch under: a reset between the check and the
        // clearing could let this free an ID another queue took since.
        let mut st = ctrl.lock();
        if ctrl.epoch.load(Ordering::Acquire) == self.epoch {
            if let Some(q) = st.io_queues.get_mut(usize::from(qid) - 1) {
                *q = false;
            }
            if let Some(q) = st.io_queues_lost.get_mut(usize::from(qid) - 1) {
                *q = false;
            }
        }
    }

    /// The target.
    pub fn target(&self) -> &Target {
        &self.target
    }

    pub(crate) fn subsystem(&self) -> Option<&Subsystem> {
        self.subsystem.as_deref()
    }

    /// Takes a new snapshot of the subsystem when the target's subsystems changed since the
    /// last (one atomic load otherwise). A removed subsystem leaves none: its controllers
    /// have ended, and their commands find no namespace.
    fn refresh_subsystem(&mut self) {
        let v = self.target.version();
        if v == self.seen_version {
            return;
        }
        self.seen_version = v;
        if let Some(id) = self.ctrl.as_ref().and_then(|c| c.subsystem) {
            self.subsystem = self.target.subsystem_by_id(id);
        }
    }

    pub(crate) fn qid_or_zero(&self) -> u16 {
        self.qid.unwrap_or(0)
    }

    pub(crate) fn respond(&self, cmd: &Command, st: Status, dw0: u32) -> Action {
        Action::Respond {
            cqe: cqe(cmd, self.qid_or_zero(), st, dw0),
            data: None,
        }
    }

    /// Hands over one command capsule: the 64-byte SQE followed by `capsule.len() - 64` bytes
    /// of in-capsule data. A capsule too short for an SQE is a protocol error: disconnect.
    pub fn handle(&mut self, capsule: &[u8], now: Instant) -> Action {
        let (sqe, icd) = capsule.split_at(capsule.len().min(SQE_SIZE));
        self.handle_parts(sqe, icd, now)
    }

    /// [`Queue::handle`] for a capsule whose SQE and in-capsule data lie apart, as they land
    /// in a receive (a command SGE, then data pages): read where they are, not copied.
    pub fn handle_parts(&mut self, sqe: &[u8], icd: &[u8], now: Instant) -> Action {
        let Some(sqe) = wire::read::<Sqe>(sqe) else {
            return Action::Disconnect {
                cqe: None,
                reason: "command capsule shorter than 64 bytes",
            };
        };
        let icd_len = u32::try_from(icd.len()).unwrap_or(u32::MAX);
        let entries = self.sqsize.wrapping_add(1).max(1);
        self.sqhd = (self.sqhd + 1) % entries;
        let cmd = Command {
            sqe,
            sqhd: self.sqhd,
        };
        self.refresh_subsystem();
        if let Some(st) = &self.stats {
            QueueStats::bump(&st.commands, 1);
        }
        if self.must_disconnect() {
            return Action::Disconnect {
                cqe: None,
                reason: "the controller has ended or was reset",
            };
        }
        if let Some(gone) = self.subsystem_gone() {
            return gone;
        }
        if icd_len > self.in_capsule_limit {
            return self.respond(&cmd, status::DATA_SGL_LENGTH_INVALID, 0);
        }
        // No fused commands; and over fabrics every command's PSDT is 01b (SGLs, a
        // contiguous metadata buffer), as the kernel target requires of each.
        if sqe.fuse() != 0 || sqe.psdt() != 1 {
            return self.respond(&cmd, status::INVALID_FIELD, 0);
        }
        // Every command the controller processes restarts its keep-alive timer (TBKAS),
        // Fabrics commands and those refused while it is not ready included. Queues on other
        // reactors share this line: written only when the keep-alive check has cleared it,
        // not per command.
        self.note_traffic();
        if sqe.opcode == wire::admin_opcode::FABRICS {
            return self.fabrics(cmd, icd, now);
        }
        let Some(ctrl) = self.ctrl.as_ref() else {
            return self.respond(&cmd, status::COMMAND_SEQUENCE_ERROR, 0);
        };
        if !ctrl.ready.load(Ordering::Acquire) {
            return self.respond(&cmd, status::COMMAND_SEQUENCE_ERROR, 0);
        }
        if self.qid == Some(0) {
            let ctrl = Arc::clone(ctrl);
            admin::handle(self, &ctrl, cmd, icd, now)
        } else {
            io::handle(self, cmd, icd)
        }
    }

    fn fabrics(&mut self, cmd: Command, icd: &[u8], now: Instant) -> Action {
        let fctype = cmd.sqe.nsid.get().to_le_bytes()[0];
        match fctype {
            wire::fctype::CONNECT => {
                if self.qid.is_some() {
                    return self.respond(&cmd, status::COMMAND_SEQUENCE_ERROR, 0);
                }
                match self.data_ref(&cmd.sqe, 1024, true, icd) {
                    Ok(from) => Action::Fetch { cmd, from },
                    Err(st) => self.respond(&cmd, st, 0),
                }
            }
            wire::fctype::PROPERTY_GET | wire::fctype::PROPERTY_SET => {
                let Some(ctrl) = self.ctrl.clone() else {
                    return self.respond(&cmd, status::COMMAND_SEQUENCE_ERROR, 0);
                };
                if self.qid != Some(0) {
                    return self.respond(&cmd, status::INVALID_OPCODE, 0);
                }
                if let Err(st) = self.no_data(&cmd.sqe) {
                    return self.respond(&cmd, st, 0);
                }
                admin::property(self, &ctrl, cmd, fctype == wire::fctype::PROPERTY_SET, now)
            }
            _ => self.respond(&cmd, status::INVALID_OPCODE, 0),
        }
    }

    /// Hands over the data fetched for `cmd` (after [`Action::Fetch`]).
    pub fn data_arrived(&mut self, mut cmd: Command, data: &[u8], now: Instant) -> Action {
        // Its completion reports the head when it is made: other commands may have completed
        // since it arrived, with a later one.
        cmd.sqhd = self.sqhd;
        if cmd.sqe.opcode == wire::admin_opcode::FABRICS {
            return self.connect(cmd, data, now);
        }
        self.refresh_subsystem();
        if let Some(gone) = self.subsystem_gone() {
            return gone;
        }
        match (&self.ctrl, self.qid) {
            (Some(_), Some(q)) if q > 0 => io::data_arrived(self, cmd, data),
            (Some(ctrl), Some(0)) => {
                let ctrl = Arc::clone(ctrl);
                admin::data_arrived(self, &ctrl, cmd, data)
            }
            _ => self.respond(&cmd, status::INTERNAL_ERROR, 0),
        }
    }

    /// Reports a finished block operation; returns what to send (its data, for reads, is
    /// already in the transport's buffer: push it, then send the completion).
    pub fn io_done(&mut self, req: &IoRequest, result: Result<u32, BlockFailure>) -> Cqe {
        let qid = self.qid_or_zero();
        if let IoOp::FlushAll { epoch, .. } = req.op {
            let mut csts = 0;
            if let Some(ctrl) = &self.ctrl {
                let mut st = ctrl.lock();
                // Its own mark only: a shutdown after a reset has its own flush.
                if st.shutdown_flushing.is_some_and(|(_, e)| e == epoch) {
                    st.shutdown_flushing = None;
                }
                st.csts = if ctrl.epoch.load(Ordering::Acquire) != epoch {
                    // Reset (and maybe enabled again) while it flushed: that shutdown is over.
                    st.csts
                } else if result.is_ok() {
                    // SHST complete, once the devices let go of are synced too.
                    crate::admin::shutdown_flushed(self, ctrl, &mut st);
                    st.csts
                } else {
                    // A namespace could not be made durable: the shutdown never completes,
                    // and Controller Fatal Status says why.
                    st.csts | (1 << 1)
                };
                csts = st.csts;
            }
            let fabrics = req.cmd.sqe.opcode == wire::admin_opcode::FABRICS;
            let property_get = fabrics && cmd_fctype(&req.cmd) == wire::fctype::PROPERTY_GET;
            // A Property Get of CSTS that started the flush answers with the new value; the
            // Property Set that asked for the shutdown fails with the flush.
            let dw0 = if fabrics { csts } else { 0 };
            let st = match &result {
                Err(e) if !property_get => io::block_error_status(e, &req.op),
                _ => Status::SUCCESS,
            };
            return self.cqe_now(&req.cmd, qid, st, dw0);
        }
        let st = match result {
            Ok(_) => {
                if let Some(st) = &self.stats {
                    match &req.op {
                        IoOp::Read { len, .. } => st.io.count(false, u64::from(*len)),
                        IoOp::Write { len, .. } => st.io.count(true, u64::from(*len)),
                        _ => {}
                    }
                }
                Status::SUCCESS
            }
            Err(e) => io::block_error_status(&e, &req.op),
        };
        self.cqe_now(&req.cmd, qid, st, 0)
    }

    /// A completion for `cmd` made now: its SQ Head is the head now, not when `cmd` arrived
    /// (commands complete out of order; a later completion never reports an older head).
    /// A retryable status carries a Command Retry Delay where the host enabled Advanced
    /// Command Retry (see [`retry_delay`]).
    fn cqe_now(&self, cmd: &Command, qid: u16, st: Status, dw0: u32) -> Cqe {
        let retry_later = !st.is_success() && !st.dnr();
        let st = match &self.ctrl {
            Some(c) if retry_later && c.lock().acre => st.with_crd(retry_delay(st)),
            _ => st,
        };
        let mut c = cqe(cmd, qid, st, dw0);
        c.sqhd = U16::new(self.sqhd);
        c
    }

    /// Completions that became due without a new command: Asynchronous Event Requests whose
    /// event arrived. Call it on the admin queue when the control thread signals events.
    pub fn poll_events(&mut self) -> Vec<Cqe> {
        let (Some(ctrl), Some(0)) = (&self.ctrl, self.qid) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        let mut st = ctrl.lock();
        while !st.held_aers.is_empty() && !st.pending_events.is_empty() {
            let cid = st.held_aers.remove(0);
            let dw0 = st.pending_events.remove(0);
            let sqe = Sqe {
                cid: U16::new(cid),
                ..wire::zeroed()
            };
            out.push(cqe(
                &Command {
                    sqe,
                    sqhd: self.sqhd,
                },
                0,
                Status::SUCCESS,
                dw0,
            ));
        }
        out
    }

    /// An I/O controller's subsystem was removed (the target publishes it gone, then ends
    /// its controllers): its queues close as the controller's end would close them, rather
    /// than answer from no subsystem (an Identify Controller as the discovery controller's,
    /// a write's data arriving as an invalid namespace).
    fn subsystem_gone(&self) -> Option<Action> {
        let io_controller = self.ctrl.as_ref().is_some_and(|c| c.subsystem.is_some());
        (io_controller && self.subsystem.is_none()).then_some(Action::Disconnect {
            cqe: None,
            reason: "the subsystem was removed",
        })
    }

    /// Whether the transport must close this queue now (its controller ended).
    pub fn must_disconnect(&self) -> bool {
        self.ctrl.as_ref().is_some_and(|c| {
            c.is_dead() || (self.qid != Some(0) && c.epoch.load(Ordering::Acquire) != self.epoch)
        })
    }
}

impl Drop for Queue {
    /// A closed admin queue ends its controller; a closed I/O queue frees its queue ID.
    fn drop(&mut self) {
        let (Some(ctrl), Some(qid)) = (self.ctrl.take(), self.qid) else {
            return;
        };
        if let Some(st) = self.stats.take() {
            let mut all = ctrl.queue_stats.lock().unwrap_or_else(|e| e.into_inner());
            all.retain(|q| !Arc::ptr_eq(q, &st));
            // Under the lock: a SMART log read meanwhile counts it once.
            ctrl.io_gone.add(st.io.get());
        }
        if qid == 0 {
            ctrl.end(EndReason::AdminQueueLost);
            // Only this controller: one that ended early (keep-alive expiry, a removed host)
            // left the map, and its ID may be another's by now.
            let mut map = self.target.ctrls();
            if map.get(&ctrl.cntlid).is_some_and(|c| Arc::ptr_eq(c, &ctrl)) {
                map.remove(&ctrl.cntlid);
            }
            self.target.retire(&ctrl);
            return;
        }
        ctrl.io_queues_alive.fetch_sub(1, Ordering::AcqRel);
        if self.unsettled {
            ctrl.io_queues_unsettled.fetch_sub(1, Ordering::AcqRel);
        }
        self.ctrl = Some(ctrl);
        self.release_qid();
    }
}

/// The ready/enabled bits of CC and CSTS, for the fast path.
pub(crate) fn refresh_ready(ctrl: &Controller, st: &CtrlState) {
    let ready = st.cc & 1 == 1 && st.csts & 1 == 1;
    ctrl.ready.store(ready, Ordering::Release);
}

/// The Command Retry Delay a retryable status carries: CRDT2 for Namespace Not Ready (see
/// [`admin::NOT_READY_RETRY_DELAY_100MS`]), CRDT1 for the others.
fn retry_delay(st: Status) -> u8 {
    if st.same_code(status::NAMESPACE_NOT_READY) {
        2
    } else {
        1
    }
}

/// The Fabrics command type of `cmd` (a Fabrics command: opcode 7Fh).
fn cmd_fctype(cmd: &Command) -> u8 {
    cmd.sqe.nsid.get().to_le_bytes()[0]
}
