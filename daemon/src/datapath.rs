//! The target's RDMA data path on one reactor: capsules arrive in receives of the reactor's
//! SRQ (a 64-byte command SGE, then page SGEs for in-capsule data), the NVMe core says what
//! they mean, and this moves the data (RDMA READ of host data, RDMA WRITE of read data),
//! runs the block operations on the reactor's io_uring engine, and sends the responses.
//!
//! One request slot per command in flight, taken from a preallocated table; data buffers come
//! from the reactor's registered pool, which is both the RDMA memory region and the io_uring
//! fixed buffer. Written against `nvmfd_rdma::any`, so it runs on either provider.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use nvmfd_blockdev::{BufPool, Completion, DevId, Device as BlockDevice, DmaBuf, Engine};
use nvmfd_nvme::rdma_cm::{accept_private_data, CmRequest};
use nvmfd_nvme::wire::Cqe;
use nvmfd_nvme::{Action, Command, DataRef, IoOp, IoRequest, Queue, Target};
use nvmfd_rdma::any::cm::CmId;
use nvmfd_rdma::any::{Cq, Device, Mr, Pd};
use nvmfd_rdma::*;
use zerocopy::IntoBytes;

use crate::srq::{Change, ElasticSrq, Registrar, SrqConfig};

/// Sizes of one reactor's data path.
#[derive(Clone, Copy, Debug)]
pub struct DataPathConfig {
    /// The elastic SRQ's sizes.
    pub srq: SrqConfig,
    /// In-capsule data per receive (a multiple of 4 KiB pages is used).
    pub in_capsule: u32,
    /// Data buffers, each `max_io` bytes.
    pub buffers: u32,
    /// Largest transfer.
    pub max_io: u32,
    /// Commands in flight at once.
    pub requests: u32,
    /// How long an accepted connection may go without a Fabrics Connect from its host before
    /// it is ended (`transport.connect_timeout`).
    pub connect_timeout: std::time::Duration,
}

/// Work request IDs below this name receives; send work requests carry a kind above it.
const REQ_BASE: u64 = crate::srq::WR_ID_END;
/// The RNR NAK timer QPs advertise: 0.16 ms (InfiniBand encoding 8).
const MIN_RNR_TIMER: u8 = 8;
/// The longest a torn-down QP waits for its work to drain before it is destroyed anyway.
pub const DRAIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Why a queue pair was torn down; `stats` counts each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cause {
    /// The host disconnected (CM DISCONNECTED), or rdma_cm reported that the connection failed
    /// before it was established ([`ConnectFailure`], also counted by its cause).
    Disconnect,
    /// `QP_FATAL`, `QP_REQ_ERR`, `QP_ACCESS_ERR`, or a completion in error on a live QP.
    QpError,
    /// Its controller ended (keep-alive expiry, admin queue lost, reset) or the host broke the
    /// protocol.
    Controller,
    /// The device, its SRQ or its CQ failed, or the device was removed.
    Device,
    /// The daemon is stopping.
    Shutdown,
}

/// How rdma_cm reported that an accepted connection failed before it was established (the
/// host went away between its connect request and its RTU); `stats` counts each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConnectFailure {
    /// `RDMA_CM_EVENT_REJECTED`: the host's CM sent a REJ (its ID was destroyed).
    Rejected,
    /// `RDMA_CM_EVENT_UNREACHABLE`: the host stopped answering (the REP's retries ran out).
    Unreachable,
    /// `RDMA_CM_EVENT_CONNECT_ERROR`: the connection could not be set up.
    ConnectError,
}

/// A QP torn down and not yet destroyed: its work drains first.
struct Drain {
    /// Kept alive (and so the QP) until the drain ends.
    id: CmId,
    /// Its NVMe queue, dropped only once no request of it is left: its controller counts
    /// it until then, so a reset or shutdown is not reported done while a block operation
    /// of it may still write.
    queue: Queue,
    depth: u32,
    since: Instant,
    cause: Cause,
    /// `IBV_EVENT_QP_LAST_WQE_REACHED` arrived: no receive completion of it is still to come.
    last_wqe: bool,
    /// The drain marker completed (or could not be posted): every send of it has completed.
    flushed: bool,
    /// Its signaled send WRs not completed yet.
    signaled_out: u32,
    /// Everything it waited for had come by the CQ poll that was the `n`th to find the CQ
    /// empty (`cq_empty_polls`); the next one to find it empty ends the drain.
    quiet_at: Option<u64>,
}

/// Host memory pieces one command's data may come from or go to.
const MAX_SEGS: usize = 16;
const _: () = assert!(MAX_SEGS == nvmfd_nvme::MAX_SGL_DESCRIPTORS as usize);
/// The most RDMA READs a QP has in flight, whatever the host offers.
const MAX_READ_DEPTH: u32 = 16;
/// Work requests handed to the provider in one call (a stack array: posting allocates
/// nothing), the longest chain a provider takes; a QP's work of one turn goes in as few
/// calls as that allows, usually one.
const POST_BATCH: usize = MAX_SEND_CHAIN;
/// Send work request IDs: the kind in the top byte, then the low 24 bits of the request
/// slot's generation, then the slot (or, for a drain marker, the QP number).
const KIND_SHIFT: u32 = 56;
const KIND_SEND: u64 = 1;
const KIND_READ: u64 = 2;
const KIND_WRITE: u64 = 3;
const KIND_DRAIN: u64 = 4;
const GEN_SHIFT: u32 = 32;
const GEN_MASK: u64 = (1 << 24) - 1;
const SLOT_MASK: u64 = (1 << 32) - 1;

fn wr_id(kind: u64, generation: u32, n: u64) -> u64 {
    (kind << KIND_SHIFT) | ((u64::from(generation) & GEN_MASK) << GEN_SHIFT) | (n & SLOT_MASK)
}

/// The request slot and the low 24 bits of its generation a send work request ID names.
fn wr_slot(wr_id: u64) -> (usize, u32) {
    (
        (wr_id & SLOT_MASK) as usize,
        ((wr_id >> GEN_SHIFT) & GEN_MASK) as u32,
    )
}

/// A block operation's tag: the request slot and its whole generation, so that a completion
/// can only finish the command that submitted it.
fn block_tag(slot: usize, generation: u32) -> u64 {
    (u64::from(generation) << 32) | (slot as u64 & SLOT_MASK)
}

/// The most bytes one deallocate operation on `dev` covers: what the backend takes at once,
/// and under the engine's 4 GiB per operation.
fn dealloc_piece(engine: &Engine, dev: DevId) -> u64 {
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

/// Takes `n` from a count of outstanding things. A count that would go below zero means a
/// completion was counted twice or a release was lost: a bug that a saturating count would
/// hide, so debug builds (and every test) stop on it; release builds keep serving at zero.
#[track_caller]
fn release(count: &mut u32, n: u32) {
    debug_assert!(*count >= n, "released {n} of {count}: counted twice");
    *count = count.saturating_sub(n);
}

/// [`release`] for a `usize` count.
#[track_caller]
fn release_usize(count: &mut usize, n: usize) {
    debug_assert!(*count >= n, "released {n} of {count}: counted twice");
    *count = count.saturating_sub(n);
}

/// Where a command in flight is. [`DataPath::process`] moves a request from state to state
/// until it must wait for something outside it: a budget, the network or the disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
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
enum Work {
    /// A core command (Connect data, DSM ranges) that waits for its data.
    Core(Command),
    /// A block operation.
    Io(IoRequest),
    /// Only the response.
    Respond,
}

/// One piece of host memory, and where it lies in the request's buffer.
#[derive(Clone, Copy, Debug, Default)]
struct Seg {
    addr: u64,
    len: u32,
    key: u32,
    /// Offset in the request's buffer.
    off: u32,
}

/// A command in flight: one slot of the preallocated table.
#[derive(Debug)]
struct Req {
    qpn: u32,
    state: State,
    work: Work,
    segs: [Seg; MAX_SEGS],
    nsegs: u32,
    /// The next piece to READ.
    next_seg: u32,
    /// READs posted and not completed.
    reads_left: u32,
    /// Bytes moved to or from the host.
    data_len: u32,
    /// The key the response SEND invalidates, when the host asked for it.
    invalidate: Option<u32>,
    buf: Option<DmaBuf>,
    /// The slot's generation when this command took it: every work request ID and block
    /// operation tag of the command carries it, and a completion that names another
    /// generation is stale and dropped.
    generation: u32,
    /// Block operations submitted and not completed.
    ops_left: u32,
    /// The next block operation to submit: a namespace of a flush of every namespace, a
    /// range of a Dataset Management command; `op_off` is how much of that range (bytes)
    /// is already submitted, as a range the backend cannot take whole goes in pieces.
    next_op: u32,
    op_off: u64,
    /// Submitting stopped: every operation is submitted, or one was refused (`failed`).
    ops_done: bool,
    failed: Option<nvmfd_blockdev::BlockError>,
    cqe: Cqe,
    /// Send-queue entries its response holds (its WRITEs and SEND), freed by the SEND's
    /// completion.
    sq_held: u32,
    /// The receive its in-capsule write data is written to the disk from, kept off the SRQ
    /// until that write completes, and where in it the data starts.
    recv: Option<(u64, std::ptr::NonNull<u8>)>,
}

/// A send work request of this turn, posted with the QP's others at the end of the turn.
#[derive(Clone, Copy, Debug)]
struct Staged {
    wr_id: u64,
    op: SendOp,
    /// Local data; for an inline response, `cqe` is sent instead.
    sge: Sge,
    cqe: [u8; 16],
    inline: bool,
    signaled: bool,
}

struct Conn {
    id: CmId,
    queue: Queue,
    token: usize,
    /// Receives reserved for it in the SRQ (its queue depth).
    depth: u32,
    /// Send-queue entries it may use (one more is kept for the drain marker), and in use.
    sq_budget: u32,
    sq_used: u32,
    /// RDMA READs it may have in flight (the initiator depth granted at accept), and in
    /// flight.
    read_budget: u32,
    reads_used: u32,
    /// Requests waiting for READ budget, and for send-queue room, in arrival order.
    pending_reads: VecDeque<usize>,
    pending_sends: VecDeque<usize>,
    /// Work requests of this turn, posted together by `flush`.
    staged: Vec<Staged>,
    /// Signaled work requests posted (or staged) and not completed.
    signaled_out: u32,
}

/// One reactor's RDMA target.
pub struct DataPath {
    target: Target,
    cq: Cq,
    /// The device's async fd: events arriving on it name this data path's objects.
    async_fd: std::os::fd::RawFd,
    // Field order is drop order: the engine waits for its operations before the SRQ's
    // receive buffers (which in-capsule writes are written from) and the pool go; the MR
    // over the pool goes before the pool's memory.
    engine: Engine,
    srq: ElasticSrq,
    data_mr: Mr,
    pool: BufPool,
    pd: Pd,
    /// Devices by (subsystem index in the target, NSID): no key to build per I/O.
    devs: HashMap<(usize, u32), DevId>,
    conns: HashMap<u32, Conn>,
    reqs: Vec<Option<Req>>,
    /// Each slot's generation, moved on every time the slot is taken.
    generations: Vec<u32>,
    free: Vec<usize>,
    /// Requests whose next block operation the engine had no room for (`QueueFull`), in
    /// order: they go on as operations complete.
    blocked: VecDeque<usize>,
    /// The capsule being started (kept, so that no command allocates).
    capsule: Vec<u8>,
    counters: Arc<crate::stats::DataPathCounters>,
    /// Commands admitted at once: each holds one request slot and at most one buffer, so
    /// admitting a command only while fewer than `limit` slots are taken means none ever
    /// finds them all taken. This is the data-buffer budget.
    limit: usize,
    /// Commands that arrived while `limit` were active: (QP, receive, length). Their receives
    /// stay off the SRQ until they start, in order, as commands finish (the SRQ grows if
    /// that makes it run low). Bounded by the receives the SRQ can hold.
    incoming: VecDeque<(u32, u64, u32)>,
    /// QPs with work staged this turn.
    dirty: Vec<u32>,
    /// The receive of the command being started, until a request keeps it or it goes back.
    current_recv: Option<u64>,
    /// Receives kept by requests (in-capsule writes in flight): the SRQ is not rebuilt while
    /// any is, as their memory is being written from.
    held_receives: usize,
    /// Device limits: RDMA READ depth and send queue size.
    max_read_depth: u32,
    max_qp_wr: u32,
    /// Signaled send WRs posted and not completed.
    sends_in_flight: usize,
    /// QPs torn down, draining before they are destroyed.
    draining: HashMap<u32, Drain>,
    /// NVMe queues of QPs destroyed after their drain timed out, kept until their block
    /// operations complete.
    lingering: Vec<(u32, Queue)>,
    /// Times a poll of the CQ found it empty.
    cq_empty_polls: u64,
    /// Drains waiting only for a poll that finds the CQ empty: the CQ is polled until it is.
    settling: usize,
    /// The SRQ failed: connections are refused until every QP on it is gone and it is rebuilt.
    srq_broken: bool,
    /// Accepted connections whose host has not sent a Fabrics Connect yet, by deadline
    /// (adoption order, so deadlines only grow): (deadline, QP number, CM token).
    unconnected: VecDeque<(Instant, u32, usize)>,
    /// How long a connection may go without a Fabrics Connect (`DataPathConfig`).
    connect_timeout: std::time::Duration,
    /// Block completions of one turn (kept, so that no turn allocates).
    reaped: Vec<Completion>,
    /// QP numbers of one turn's ended connections (kept likewise).
    scratch_qpns: Vec<u32>,
    /// Whether the device sends LAST_WQE_REACHED (rxe and iWARP do not: the drain marker
    /// alone ends a drain there).
    wait_last_wqe: bool,
    /// Whether the device can post SEND_WITH_INVALIDATE; where it cannot, responses go as
    /// plain SENDs and the host invalidates its key itself.
    send_invalidate: bool,
    log: slog::Logger,
}

impl std::fmt::Debug for DataPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataPath")
            .field("connections", &self.conns.len())
            .finish()
    }
}

fn verr(e: VerbsError) -> std::io::Error {
    std::io::Error::other(e.to_string())
}

/// Posts `staged` on `id` in batches; on failure, the index of the first WR not posted (every
/// one before it was posted).
fn post_staged(id: &CmId, staged: &[Staged]) -> Result<(), (usize, VerbsError)> {
    const EMPTY: SendWr<'static> = SendWr {
        wr_id: 0,
        op: SendOp::Send,
        sges: &[],
        signaled: false,
        inline: false,
    };
    for (n, chunk) in staged.chunks(POST_BATCH).enumerate() {
        let mut sges = [Sge::default(); POST_BATCH];
        for (s, w) in sges.iter_mut().zip(chunk) {
            *s = if w.inline {
                Sge {
                    addr: w.cqe.as_ptr() as u64,
                    length: 16,
                    lkey: 0,
                }
            } else {
                w.sge
            };
        }
        let mut wrs: [SendWr<'_>; POST_BATCH] = [EMPTY; POST_BATCH];
        for ((wr, w), s) in wrs.iter_mut().zip(chunk).zip(&sges) {
            *wr = SendWr {
                wr_id: w.wr_id,
                op: w.op,
                sges: if w.sge.length == 0 && !w.inline {
                    &[]
                } else {
                    std::slice::from_ref(s)
                },
                signaled: w.signaled,
                inline: w.inline,
            };
        }
        // Those before the refused one were posted: they complete (or flush) as usual.
        id.post_send(&wrs[..chunk.len()])
            .map_err(|e| (n * POST_BATCH + e.posted().min(chunk.len()), e))?;
    }
    Ok(())
}

impl DataPath {
    /// Sets up the reactor's CQ, SRQ, receive buffers, data pool and engine on `dev`, with
    /// `namespaces` (subsystem NQN, NSID, device) attached.
    pub fn new(
        dev: &Device,
        target: Target,
        namespaces: &[(String, u32, Arc<BlockDevice>)],
        cfg: DataPathConfig,
        registrar: Registrar,
        counters: Arc<crate::stats::DataPathCounters>,
    ) -> std::io::Result<DataPath> {
        let pd = dev.alloc_pd().map_err(verr)?;
        let attr = dev.attr().map_err(verr)?;
        let cq = dev
            .create_cq(attr.max_cqe.min(cfg.srq.max.saturating_mul(2).max(4096)))
            .map_err(verr)?;
        let srq = ElasticSrq::new(
            &pd,
            attr.max_srq_wr,
            cfg.srq,
            cfg.in_capsule,
            registrar,
            Arc::clone(&counters),
            Instant::now(),
        )
        .map_err(verr)?;
        let pool = BufPool::new(cfg.buffers, cfg.max_io as usize, false)?;
        let iov = pool.iovec();
        // SAFETY: the pool's region stays mapped while `pool` lives, and `data_mr` is dropped
        // before `pool` (field order); the NIC's accesses are to buffers owned by requests.
        let data_mr = unsafe {
            pd.reg_mr(
                iov.iov_base.cast(),
                iov.iov_len,
                Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
            )
        }
        .map_err(verr)?;
        let mut engine = Engine::new(
            cfg.requests,
            u32::try_from(namespaces.len().max(1)).unwrap_or(1),
            std::slice::from_ref(&pool),
        )?;
        let mut devs = HashMap::new();
        for (nqn, nsid, d) in namespaces {
            let dev = engine.attach(d)?;
            if let Some(sub) = target.subsystems().iter().position(|s| s.nqn == *nqn) {
                devs.insert((sub, *nsid), dev);
            }
        }
        let dp = DataPath {
            target,
            cq,
            async_fd: dev.async_fd(),
            srq,
            data_mr,
            engine,
            pool,
            pd,
            devs,
            conns: HashMap::new(),
            reqs: (0..cfg.requests).map(|_| None).collect(),
            generations: vec![0; cfg.requests as usize],
            free: (0..cfg.requests as usize).rev().collect(),
            blocked: VecDeque::with_capacity(cfg.requests as usize),
            capsule: Vec::with_capacity(64 + cfg.in_capsule as usize),
            counters,
            limit: cfg.requests.min(cfg.buffers) as usize,
            incoming: VecDeque::with_capacity(cfg.srq.max as usize),
            dirty: Vec::with_capacity(256),
            current_recv: None,
            held_receives: 0,
            max_read_depth: attr.max_qp_init_rd_atom.clamp(1, MAX_READ_DEPTH),
            max_qp_wr: attr.max_qp_wr.max(8),
            sends_in_flight: 0,
            draining: HashMap::new(),
            lingering: Vec::new(),
            cq_empty_polls: 0,
            settling: 0,
            srq_broken: false,
            unconnected: VecDeque::new(),
            connect_timeout: cfg.connect_timeout,
            reaped: Vec::with_capacity(2 * cfg.requests as usize),
            scratch_qpns: Vec::with_capacity(64),
            wait_last_wqe: dev.sends_last_wqe(),
            send_invalidate: dev.supports_send_with_invalidate(),
            log: slog::Logger::root(slog::Discard, slog::o!()),
        };
        Ok(dp)
    }

    /// Where teardowns and drains are logged.
    pub fn set_log(&mut self, log: slog::Logger) {
        self.log = log;
    }

    /// The device's async event fd, which the control thread watches.
    pub fn async_fd(&self) -> std::os::fd::RawFd {
        self.async_fd
    }

    /// An async event of this data path's device (`async_fd`); events for objects of
    /// another data path on the same device are ignored.
    pub fn on_event(&mut self, ev: &AsyncEvent, now: Instant) -> Change {
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
                slog::error!(self.log, "CQ error: every QP on it is torn down"; "cq" => id);
                self.teardown_all(Cause::Device, now);
            }
            AsyncEvent::DeviceFatal => {
                c.device_events.fetch_add(1, Ordering::Relaxed);
                self.teardown_all(Cause::Device, now);
            }
            AsyncEvent::PortErr(_) | AsyncEvent::PortActive(_) => {
                // rdma_cm reports the connections a port loss breaks; nothing to do here.
                c.device_events.fetch_add(1, Ordering::Relaxed);
            }
            _ => {}
        }
        Change::None
    }

    /// The SRQ's ID, as async events name it.
    pub fn srq_id(&self) -> u32 {
        self.srq.srq().id()
    }

    /// Takes a connection the control thread accepted the request of: its QP goes on this
    /// reactor's CQ and SRQ, and it is accepted with the granted queue size and READ depth.
    pub fn adopt(&mut self, mut id: CmId, req: CmRequest) -> Result<Change, VerbsError> {
        let depth = u32::from(req.crqsize());
        if self.srq_broken {
            self.counters
                .connects_failed_accept
                .fetch_add(1, Ordering::Relaxed);
            let _ = id.reject(&nvmfd_nvme::rdma_cm::reject_private_data(
                nvmfd_nvme::wire::rdma_cm_status::NO_RESOURCES,
            ));
            return Err(VerbsError::Invalid {
                op: "accept",
                why: "the SRQ failed and is being rebuilt",
            });
        }
        let change = match self.srq.reserve(depth, Instant::now()) {
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
        if let Err(e) = id.accept_with(&accept_private_data(req.crqsize()), granted) {
            // Usually the host went away first (its REJ came before the accept).
            slog::debug!(self.log, "cannot accept a connection"; "error" => %e);
            self.refuse(&id, depth);
            return Err(e);
        }
        // A host whose SEND meets an empty SRQ retries after this timer; rdma_cm's default is
        // 655 ms, which starves a queue (a keep-alive) while the SRQ grows.
        if id.set_min_rnr_timer(MIN_RNR_TIMER).is_err() {
            self.counters.srq_errors.fetch_add(1, Ordering::Relaxed);
        }
        let token = id.token();
        let queue = Queue::new(&self.target, Some(req.params));
        let d = depth as usize;
        self.conns.insert(
            qpn,
            Conn {
                id,
                queue,
                token,
                depth,
                sq_budget,
                sq_used: 0,
                read_budget,
                reads_used: 0,
                pending_reads: VecDeque::with_capacity(d),
                pending_sends: VecDeque::with_capacity(d),
                staged: Vec::with_capacity(sq_budget as usize),
                signaled_out: 0,
            },
        );
        self.counters
            .connections
            .store(self.conns.len() as u64, Ordering::Relaxed);
        self.counters
            .connections_accepted
            .fetch_add(1, Ordering::Relaxed);
        self.unconnected
            .push_back((Instant::now() + self.connect_timeout, qpn, token));
        Ok(change)
    }

    /// A connection `adopt` reserved `depth` receives for cannot be accepted: the reservation
    /// returns, it is counted and rejected (when its host is still there to hear it); the
    /// caller drops `id`, which destroys it and any QP made on it.
    fn refuse(&mut self, id: &CmId, depth: u32) {
        self.srq.unreserve(depth);
        self.counters
            .connects_failed_accept
            .fetch_add(1, Ordering::Relaxed);
        let _ = id.reject(&nvmfd_nvme::rdma_cm::reject_private_data(
            nvmfd_nvme::wire::rdma_cm_status::NO_RESOURCES,
        ));
    }

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

    /// Ends the connections whose host sent no Fabrics Connect within `connect_timeout` of
    /// their accept (counted, torn down as a host breaking the protocol). Cheap when nothing
    /// is due: deadlines are kept in order.
    fn expire_unconnected(&mut self, now: Instant) {
        while let Some(&(deadline, qpn, token)) = self.unconnected.front() {
            if deadline > now {
                break;
            }
            self.unconnected.pop_front();
            // The same connection (a QP number may have been reused since), still without a
            // controller.
            let silent = self
                .conns
                .get(&qpn)
                .is_some_and(|c| c.token == token && c.queue.controller().is_none());
            if !silent {
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
        let marker = [SendWr {
            wr_id: wr_id(KIND_DRAIN, 0, u64::from(qpn)),
            op: SendOp::Send,
            sges: &[],
            signaled: true,
            inline: false,
        }];
        let flushed = c.id.post_send(&marker).is_err();
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
        for i in 0..self.reqs.len() {
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
        self.incoming.retain(|&(q, wr, _)| {
            if q == qpn {
                srq.completed(wr, now);
            }
            q != qpn
        });
        self.draining.insert(
            qpn,
            Drain {
                id: c.id,
                queue: c.queue,
                depth: c.depth,
                since: now,
                cause,
                last_wqe: false,
                flushed,
                signaled_out: c.signaled_out,
                quiet_at: None,
            },
        );
        self.counters
            .connections
            .store(self.conns.len() as u64, Ordering::Relaxed);
    }

    /// Staged work requests of torn-down (or about to be) connection `c` that were not
    /// posted: their counts return, and a request ends only once nothing it posted can still
    /// touch its buffer. A READ not posted leaves its request waiting for those that were; a
    /// SEND not posted behind WRITEs that were leaves its request until the QP's drain
    /// marker completes (`end_waiting_on_network`).
    fn unstage(&mut self, c: &mut Conn, lost: &[Staged]) {
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

    /// Tears down every QP (the SRQ, CQ or device failed, or the daemon stops).
    pub fn teardown_all(&mut self, cause: Cause, now: Instant) {
        let qpns: Vec<u32> = self.conns.keys().copied().collect();
        for q in qpns {
            self.teardown(q, cause, now);
        }
    }

    /// The daemon stops: every QP is torn down. The SRQ goes with the data path, and async
    /// events are no longer routed, so the drains do not wait for LAST_WQE.
    pub fn shutdown(&mut self, now: Instant) {
        self.wait_last_wqe = false;
        self.teardown_all(Cause::Shutdown, now);
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
    fn reap_drained(&mut self, now: Instant) {
        if !self.lingering.is_empty() {
            let reqs = &self.reqs;
            self.lingering
                .retain(|&(qpn, _)| reqs.iter().flatten().any(|r| r.qpn == qpn));
        }
        if self.draining.is_empty() {
            return;
        }
        let requests_of =
            |reqs: &[Option<Req>], qpn: u32| reqs.iter().flatten().filter(|r| r.qpn == qpn).count();
        // The reused scratch vector: a turn with QPs draining allocates nothing either.
        let mut gone = std::mem::take(&mut self.scratch_qpns);
        let empty_polls = self.cq_empty_polls;
        for (&qpn, d) in &mut self.draining {
            let quiet = requests_of(&self.reqs, qpn) == 0
                && d.flushed
                && (d.last_wqe || !self.wait_last_wqe);
            let expired = now.duration_since(d.since) >= DRAIN_TIMEOUT;
            if (quiet || expired) && d.quiet_at.is_none() {
                // The next poll that finds the CQ empty has reaped everything of it that is
                // there (even at the bound: what a destroy would drop is taken first).
                d.quiet_at = Some(empty_polls);
                self.settling += 1;
            }
            if d.quiet_at.is_some_and(|at| empty_polls > at) {
                gone.push(qpn);
            }
        }
        for qpn in gone.drain(..) {
            let Some(d) = self.draining.remove(&qpn) else {
                continue;
            };
            if d.quiet_at.is_some() {
                self.settling -= 1;
            }
            let requests = requests_of(&self.reqs, qpn);
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
            self.srq.unreserve(d.depth);
            drop(d.id);
            if requests_of(&self.reqs, qpn) > 0 {
                // Block operations of it are still in flight: its queue stays counted by
                // its controller until they complete.
                self.lingering.push((qpn, d.queue));
            }
        }
        self.scratch_qpns = gone;
    }

    /// The connection with CM token `token` went away.
    pub fn disconnected(&mut self, token: usize) {
        let qpns: Vec<u32> = self
            .conns
            .iter()
            .filter(|(_, c)| c.token == token)
            .map(|(q, _)| *q)
            .collect();
        let now = Instant::now();
        for q in qpns {
            self.teardown(q, Cause::Disconnect, now);
        }
    }

    /// Connections served.
    pub fn connections(&self) -> usize {
        self.conns.len()
    }

    /// The completion channel's fd (readable after `arm` and a completion).
    pub fn wake_fd(&self) -> std::os::fd::RawFd {
        self.cq.channel_fd()
    }

    /// Arms the completion channel when the reactor is about to sleep (never on a busy
    /// turn: it costs a read of the channel and a request for notification); false when it
    /// must not sleep. The reactor polls once more after arming, as a completion that
    /// arrived before the arming raises no event.
    pub fn arm(&mut self) -> bool {
        // Block operations complete only by polling; drains end (or time out) only by polling.
        if self.engine.in_flight() > 0
            || self.srq.busy()
            || !self.draining.is_empty()
            || (!self.incoming.is_empty() && self.in_use() < self.limit)
        {
            return false;
        }
        // Events of earlier sleeps are acknowledged before arming again.
        while self.cq.ack_event() {}
        self.cq.req_notify().is_ok()
    }

    /// One turn: waiting commands admitted, completions, block completions; then the turn's
    /// send work posted (one call per QP) and its block operations submitted (one call).
    /// True when there was work.
    pub fn poll(&mut self, now: Instant) -> bool {
        let mut worked = false;
        while self.in_use() < self.limit {
            let Some((qpn, wr, len)) = self.incoming.pop_front() else {
                break;
            };
            self.start_command(qpn, wr, len, now);
            worked = true;
        }
        let mut wc = [Wc::default(); 32];
        let mut n = 0;
        // One batch a turn; while a drain waits for the CQ to be empty, until it is.
        for _ in 0..64 {
            let got = self.cq.poll(&mut wc).unwrap_or(0);
            let receives = wc[..got].iter().filter(|c| c.wr_id < REQ_BASE).count();
            self.srq
                .consumed(u32::try_from(receives).unwrap_or(u32::MAX));
            for c in &wc[..got] {
                self.on_completion(c, now);
            }
            n += got;
            if got < wc.len() {
                self.cq_empty_polls += 1;
                break;
            }
            if self.settling == 0 {
                break;
            }
        }
        // Reused vectors (taken and put back): nothing is allocated per turn.
        let mut done = std::mem::take(&mut self.reaped);
        self.engine.reap(|c| done.push(c));
        worked |= n > 0 || !done.is_empty();
        for c in done.drain(..) {
            self.on_block_done(c, now);
        }
        self.reaped = done;
        // Room came free in the engine: requests waiting for it go on.
        if !self.blocked.is_empty() {
            self.unblock(now);
        }
        self.expire_unconnected(now);
        // Connections whose controller ended are closed.
        let mut dead = std::mem::take(&mut self.scratch_qpns);
        dead.extend(
            self.conns
                .iter()
                .filter(|(_, c)| c.queue.must_disconnect())
                .map(|(q, _)| *q),
        );
        for q in dead.drain(..) {
            self.teardown(q, Cause::Controller, now);
        }
        self.scratch_qpns = dead;
        self.flush(now);
        let _ = self.engine.submit();
        self.srq.tick(now);
        self.reap_drained(now);
        if self.srq_broken
            && self.draining.is_empty()
            && self.conns.is_empty()
            && self.held_receives == 0
        {
            self.rebuild_srq(now);
        }
        self.gauges();
        worked
    }

    /// Posts the turn's staged work requests: one call per QP (more only past `POST_BATCH`).
    fn flush(&mut self, now: Instant) {
        let mut dirty = std::mem::take(&mut self.dirty);
        for qpn in dirty.drain(..) {
            self.flush_qp(qpn, now);
        }
        self.dirty = dirty;
    }

    fn flush_qp(&mut self, qpn: u32, now: Instant) {
        let Some(c) = self.conns.get_mut(&qpn) else {
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
            if let Some(mut c) = self.conns.remove(&qpn) {
                self.unstage(&mut c, &staged[first..]);
                self.conns.insert(qpn, c);
            }
            staged.clear();
            if let Some(c) = self.conns.get_mut(&qpn) {
                c.staged = staged;
            }
            self.teardown(qpn, Cause::QpError, now);
            return;
        }
        staged.clear();
        if let Some(c) = self.conns.get_mut(&qpn) {
            c.staged = staged;
        }
    }

    /// Replaces the broken SRQ by a new one of the next generation (receives of the old one
    /// completing late name no chunk of the new one).
    fn rebuild_srq(&mut self, now: Instant) {
        match self.srq.rebuild(now) {
            Ok(srq) => {
                self.srq = srq;
                self.srq_broken = false;
                self.counters.srq_rebuilds.fetch_add(1, Ordering::Relaxed);
                slog::info!(self.log, "SRQ rebuilt"; "srq" => self.srq.srq().id());
            }
            Err(e) => {
                // Tried again next turn; connections are refused meanwhile.
                self.counters.srq_errors.fetch_add(1, Ordering::Relaxed);
                slog::warn!(self.log, "cannot rebuild the SRQ"; "error" => %e);
            }
        }
    }

    /// Stores the pools' levels for `stats` (relaxed stores, no syscall).
    fn gauges(&self) {
        let c = &self.counters;
        let set = |a: &std::sync::atomic::AtomicU64, v: usize| a.store(v as u64, Ordering::Relaxed);
        set(&c.requests_active, self.in_use());
        set(&c.requests_waiting, self.incoming.len());
        set(&c.request_slots_free, self.free.len());
        set(&c.request_slots, self.reqs.len());
        set(&c.buffers_free, self.pool.free_count());
        set(&c.buffers, self.pool.count());
        set(&c.block_ops_in_flight, self.engine.in_flight());
        set(&c.sends_in_flight, self.sends_in_flight);
        set(&c.qps_draining, self.draining.len());
        set(&c.srq_receives_reserved, self.srq.reserved() as usize);
    }

    fn end_req(&mut self, i: usize) {
        if let Some(r) = self.reqs.get_mut(i).and_then(Option::take) {
            self.free.push(i);
            if let Some((wr, _)) = r.recv {
                self.give_back(wr);
            }
        }
    }

    /// A receive a request kept goes back to the SRQ.
    fn give_back(&mut self, wr: u64) {
        release_usize(&mut self.held_receives, 1);
        self.srq.completed(wr, Instant::now());
    }

    fn buffer(&self, len: u32) -> Option<DmaBuf> {
        let mut b = self.pool.take()?;
        b.set_len(len as usize).then_some(b)
    }

    /// Request slots taken: the commands in flight.
    fn in_use(&self) -> usize {
        self.reqs.len() - self.free.len()
    }

    fn on_completion(&mut self, c: &Wc, now: Instant) {
        // The ID tells receives from sends: an error completion's opcode is undefined.
        if c.wr_id < REQ_BASE {
            return self.on_receive(c, now);
        }
        let kind = c.wr_id >> KIND_SHIFT;
        let ok = c.status == WcStatus::Success;
        if kind == KIND_WRITE {
            // Unsignaled: only a flush or an error completes it; its SEND's completion frees
            // its send-queue entry.
            if !ok && self.conns.contains_key(&c.qp_num) {
                self.teardown(c.qp_num, Cause::QpError, now);
            }
            return;
        }
        // Every other send WR is signaled: one completion each, counted out of its QP's.
        if let Some(conn) = self.conns.get_mut(&c.qp_num) {
            release(&mut conn.signaled_out, 1);
        } else if let Some(d) = self.draining.get_mut(&c.qp_num) {
            release(&mut d.signaled_out, 1);
        } else {
            // Its QP was destroyed after its drain timed out, which counted it out then.
            return self.stale(c.qp_num, "send of a destroyed QP");
        }
        release_usize(&mut self.sends_in_flight, 1);
        if !ok && self.conns.contains_key(&c.qp_num) {
            // A live QP's work failed (remote access error, retries exhausted, or flushed
            // because the QP went to ERR before any event said so): it is torn down.
            slog::warn!(self.log, "completion in error; tearing the QP down";
                "qpn" => c.qp_num, "status" => ?c.status);
            self.teardown(c.qp_num, Cause::QpError, now);
        }
        if kind == KIND_DRAIN {
            let qpn = (c.wr_id & SLOT_MASK) as u32;
            if let Some(d) = self.draining.get_mut(&qpn) {
                d.flushed = true;
                // Every work request posted before the marker has completed: the requests
                // still waiting on this QP's network (a response whose SEND was never posted
                // behind WRITEs that were) hold nothing the NIC can touch any more.
                self.end_waiting_on_network(qpn);
            }
            return;
        }
        let (i, generation) = wr_slot(c.wr_id);
        // A completion for a slot since given to another command is stale. (Every posted
        // work request is counted out once, so this is a bug if it happens.)
        let Some(r) = self
            .reqs
            .get_mut(i)
            .and_then(Option::as_mut)
            .filter(|r| u64::from(r.generation) & GEN_MASK == u64::from(generation))
        else {
            self.stale(c.qp_num, "send");
            return;
        };
        let qpn = r.qpn;
        let live = self.conns.contains_key(&qpn);
        if kind == KIND_READ {
            release(&mut r.reads_left, 1);
            if let Some(conn) = self.conns.get_mut(&qpn) {
                release(&mut conn.reads_used, 1);
                release(&mut conn.sq_used, 1);
            }
            if r.reads_left == 0 {
                if ok && live && r.state == State::Reading {
                    r.state = State::Ready;
                    self.process(i, now);
                } else if !live {
                    // Its QP is gone (or this READ failed and took it down): no READ of it is
                    // out any more, so its buffer can go back.
                    self.end_req(i);
                }
            }
        } else {
            let held = r.sq_held;
            if let Some(conn) = self.conns.get_mut(&qpn) {
                release(&mut conn.sq_used, held);
            }
            self.end_req(i);
        }
        // Room came free: requests waiting for it go on.
        self.pump_sends(qpn);
        self.pump_reads(qpn);
    }

    /// A completion that names no command in flight: dropped, counted and logged.
    fn stale(&self, qpn: u32, what: &'static str) {
        self.counters
            .stale_completions
            .fetch_add(1, Ordering::Relaxed);
        slog::warn!(self.log, "stale completion dropped"; "qpn" => qpn, "kind" => what);
    }

    /// Ends the requests of torn-down QP `qpn` that wait for nothing but its network (every
    /// state but `Executing`, whose block operations hold the buffer until they complete).
    fn end_waiting_on_network(&mut self, qpn: u32) {
        for i in 0..self.reqs.len() {
            let waits = self.reqs[i]
                .as_ref()
                .is_some_and(|r| r.qpn == qpn && r.state != State::Executing);
            if waits {
                self.end_req(i);
            }
        }
    }

    fn on_receive(&mut self, c: &Wc, now: Instant) {
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
        if !self.conns.contains_key(&c.qp_num) {
            self.srq.completed(c.wr_id, now);
            self.counters.late_receives.fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.counters.commands.fetch_add(1, Ordering::Relaxed);
        if self.in_use() >= self.limit || !self.incoming.is_empty() {
            // Every slot or buffer may be in use: the command waits its turn, in its receive.
            self.counters
                .commands_queued
                .fetch_add(1, Ordering::Relaxed);
            self.incoming.push_back((c.qp_num, c.wr_id, c.byte_len));
            return;
        }
        self.start_command(c.qp_num, c.wr_id, c.byte_len, now);
    }

    /// Admits the command in receive `wr` (its capsule is copied out and the receive goes
    /// back to the SRQ first) and lets the core decide what it means.
    fn start_command(&mut self, qpn: u32, wr: u64, len: u32, now: Instant) {
        let mut capsule = std::mem::take(&mut self.capsule);
        self.srq.capsule(wr, len as usize, &mut capsule);
        // An in-capsule write keeps its receive (`begin`); any other goes back right after
        // the core has seen the command, before any response is posted.
        self.current_recv = Some(wr);
        if let Some(i) = self.free.pop() {
            self.generations[i] = self.generations[i].wrapping_add(1);
            self.reqs[i] = Some(Req {
                qpn,
                state: State::Ready,
                work: Work::Respond,
                segs: [Seg::default(); MAX_SEGS],
                nsegs: 0,
                next_seg: 0,
                reads_left: 0,
                data_len: 0,
                invalidate: None,
                buf: None,
                generation: self.generations[i],
                ops_left: 0,
                next_op: 0,
                op_off: 0,
                ops_done: false,
                failed: None,
                cqe: nvmfd_nvme::wire::zeroed(),
                sq_held: 0,
                recv: None,
            });
            if let Some(conn) = self.conns.get_mut(&qpn) {
                let a = conn.queue.handle(&capsule, now);
                self.begin(i, a, &capsule, now);
            } else {
                self.end_req(i);
            }
        } else {
            // Admission keeps a slot for every command it starts.
            slog::error!(self.log, "no request slot for an admitted command; it is dropped"; "qpn" => qpn);
        }
        if let Some(wr) = self.current_recv.take() {
            self.srq.completed(wr, now);
        }
        self.capsule = capsule;
    }

    /// Sets request `i`'s host memory pieces from `dref` (a list is read from `capsule`).
    fn set_segs(&mut self, i: usize, dref: DataRef, capsule: &[u8]) -> bool {
        let Some(r) = self.reqs[i].as_mut() else {
            return false;
        };
        let len = dref.len();
        r.data_len = len;
        r.nsegs = 0;
        r.invalidate = dref.invalidate_key();
        let mut put = |addr: u64, l: u32, key: u32, off: &mut u32| {
            let n = l.min(len - *off);
            if n > 0 && (r.nsegs as usize) < MAX_SEGS {
                r.segs[r.nsegs as usize] = Seg {
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
                let icd = capsule.get(64..).unwrap_or(&[]);
                for (addr, l, key) in nvmfd_nvme::keyed_segments(icd, offset, count) {
                    put(addr, l, key, &mut off);
                }
            }
            DataRef::InCapsule { .. } => return false,
        }
        off == len
    }

    /// Starts request `i` on what the core said its command needs (`capsule` is the
    /// command's, or empty once it is gone).
    fn begin(&mut self, i: usize, mut a: Action, capsule: &[u8], now: Instant) {
        let Some(qpn) = self.reqs[i].as_ref().map(|r| r.qpn) else {
            return;
        };
        loop {
            match a {
                Action::Fetch {
                    cmd,
                    from: DataRef::InCapsule { offset, len },
                } => {
                    let s = 64 + offset as usize;
                    let data = capsule.get(s..s + len as usize).unwrap_or(&[]);
                    let Some(conn) = self.conns.get_mut(&qpn) else {
                        return self.end_req(i);
                    };
                    a = conn.queue.data_arrived(cmd, data, now);
                }
                Action::Fetch { cmd, from } => {
                    let buf = self.buffer(from.len());
                    if buf.is_none() || !self.set_segs(i, from, capsule) {
                        return self.protocol_error(i, qpn, now);
                    }
                    if let Some(r) = self.reqs[i].as_mut() {
                        r.buf = buf;
                        r.work = Work::Core(cmd);
                    }
                    return self.wait_read(i);
                }
                Action::Io(io) => {
                    let write = matches!(io.op, IoOp::Write { .. });
                    match io.data {
                        Some(DataRef::InCapsule { offset, len }) if write => {
                            // Written from the receive it arrived in (page-aligned, so direct
                            // I/O takes it) when it lies whole there; else from a copy.
                            let from =
                                self.current_recv
                                    .filter(|_| offset % 4096 == 0)
                                    .and_then(|wr| {
                                        let (base, cap) = self.srq.icd(wr)?;
                                        let end = offset as usize + len as usize;
                                        // SAFETY: offset + len <= cap, inside the receive's pages.
                                        (end <= cap)
                                            .then(|| (wr, unsafe { base.add(offset as usize) }))
                                    });
                            let buf = match from {
                                Some(_) => None,
                                None => {
                                    let s = 64 + offset as usize;
                                    let Some(mut buf) = self.buffer(len) else {
                                        return self.protocol_error(i, qpn, now);
                                    };
                                    buf.as_mut_slice().copy_from_slice(
                                        capsule.get(s..s + len as usize).unwrap_or(&[]),
                                    );
                                    Some(buf)
                                }
                            };
                            if from.is_some() {
                                self.current_recv = None;
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
                            let buf = if write { self.buffer(d.len()) } else { None };
                            if (write && buf.is_none()) || !self.set_segs(i, d, capsule) {
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
                    return self.process(i, now);
                }
                Action::Respond { cqe, data } => {
                    if let Some((bytes, dest)) = data {
                        let n = dest
                            .len()
                            .min(u32::try_from(bytes.len()).unwrap_or(u32::MAX));
                        let Some(mut b) = self.buffer(n.max(1)) else {
                            return self.protocol_error(i, qpn, now);
                        };
                        b.set_len(n as usize);
                        b.as_mut_slice().copy_from_slice(&bytes[..n as usize]);
                        if !self.set_segs(i, dest, capsule) {
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
                    return self.wait_send(i);
                }
                // An AER holds nothing while it waits.
                Action::Hold => return self.end_req(i),
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

    /// A command whose data cannot be placed (the core checked it, so the host broke the
    /// protocol or the pools are wrong): the QP goes.
    fn protocol_error(&mut self, i: usize, qpn: u32, now: Instant) {
        slog::warn!(self.log, "a command's data cannot be placed; tearing the QP down"; "qpn" => qpn);
        self.end_req(i);
        self.teardown(qpn, Cause::Controller, now);
    }

    /// Moves request `i` as far as it goes without waiting (see [`State`]).
    fn process(&mut self, i: usize, now: Instant) {
        let Some(r) = self.reqs[i].as_mut() else {
            return;
        };
        let qpn = r.qpn;
        let live = self.conns.contains_key(&qpn);
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
            State::Ready => match std::mem::replace(&mut r.work, Work::Respond) {
                Work::Core(cmd) => {
                    let buf = r.buf.take();
                    let data = buf.as_ref().map_or(&[][..], |b| b.as_slice());
                    let Some(conn) = self.conns.get_mut(&qpn) else {
                        return self.end_req(i);
                    };
                    let a = conn.queue.data_arrived(cmd, data, now);
                    drop(buf);
                    self.begin(i, a, &[], now);
                }
                Work::Io(io) => self.submit_block(i, io, now),
                Work::Respond => self.wait_send(i),
            },
        }
    }

    /// Request `i` needs RDMA READs: it queues for its QP's READ budget.
    fn wait_read(&mut self, i: usize) {
        let Some(r) = self.reqs[i].as_mut() else {
            return;
        };
        r.state = State::NeedRead;
        let qpn = r.qpn;
        match self.conns.get_mut(&qpn) {
            Some(c) => c.pending_reads.push_back(i),
            None => return self.end_req(i),
        }
        self.pump_reads(qpn);
    }

    /// Request `i`'s response is ready: it queues for its QP's send queue.
    fn wait_send(&mut self, i: usize) {
        let Some(r) = self.reqs[i].as_mut() else {
            return;
        };
        r.state = State::NeedSend;
        let qpn = r.qpn;
        match self.conns.get_mut(&qpn) {
            Some(c) => c.pending_sends.push_back(i),
            None => return self.end_req(i),
        }
        self.pump_sends(qpn);
    }

    /// Stages READs for the requests waiting on QP `qpn`, oldest first, as far as its READ
    /// budget and send queue allow.
    fn pump_reads(&mut self, qpn: u32) {
        let Some(c) = self.conns.get_mut(&qpn) else {
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
            let lkey = self.data_mr.lkey();
            let base = r.buf.as_mut().map_or(0, |b| b.as_mut_ptr() as u64);
            let n = room.min(r.nsegs - r.next_seg);
            for k in r.next_seg..r.next_seg + n {
                let s = r.segs[k as usize];
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
            self.counters
                .rdma_reads
                .fetch_add(u64::from(n), Ordering::Relaxed);
            if r.next_seg == r.nsegs {
                r.state = State::Reading;
                c.pending_reads.pop_front();
            }
        }
        if was_clean && !c.staged.is_empty() {
            self.dirty.push(qpn);
        }
    }

    /// Stages the responses waiting on QP `qpn` (RDMA WRITEs of their data chained with the
    /// SEND, only the SEND signaled), oldest first, as far as its send queue allows.
    fn pump_sends(&mut self, qpn: u32) {
        let Some(c) = self.conns.get_mut(&qpn) else {
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
            let data_len = if r.buf.is_some() { r.data_len } else { 0 };
            let writes = r.segs[..r.nsegs as usize]
                .iter()
                .take_while(|s| s.off < data_len)
                .fold(0u32, |n, _| n + 1);
            if c.sq_budget - c.sq_used.min(c.sq_budget) < writes + 1 {
                break;
            }
            let lkey = self.data_mr.lkey();
            let base = r.buf.as_mut().map_or(0, |b| b.as_mut_ptr() as u64);
            for s in &r.segs[..writes as usize] {
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
            self.sends_in_flight += 1;
            c.pending_sends.pop_front();
        }
        if was_clean && !c.staged.is_empty() {
            self.dirty.push(qpn);
        }
    }

    /// Starts the block operations of `io` for request slot `i` (queued now, submitted at
    /// the end of the turn).
    fn submit_block(&mut self, i: usize, io: IoRequest, now: Instant) {
        let Some(r) = self.reqs[i].as_mut() else {
            return;
        };
        r.work = Work::Io(io);
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
    fn issue(&mut self, i: usize, now: Instant) {
        use nvmfd_blockdev::{BlockError, Rejected};
        let Some(r) = self.reqs[i].as_mut() else {
            return;
        };
        let Work::Io(io) = &r.work else {
            return;
        };
        let qpn = r.qpn;
        let tag = block_tag(i, r.generation);
        let subsystem = self
            .conns
            .get(&qpn)
            .and_then(|c| c.queue.controller()?.subsystem);
        // A request of a QP torn down submits nothing more: what it submitted completes, and
        // then it ends.
        let Some(sub) = subsystem else {
            r.ops_done = true;
            r.failed.get_or_insert(BlockError::UnknownDevice);
            if r.ops_left == 0 {
                self.finish_io(i);
                self.process(i, now);
            }
            return;
        };
        while !r.ops_done {
            let nsid = match &io.op {
                IoOp::FlushAll { nsids } => match nsids.get(r.next_op as usize) {
                    Some(&n) => n,
                    None => break,
                },
                _ => io.nsid,
            };
            let Some(&dev) = self.devs.get(&(sub, nsid)) else {
                r.failed = Some(BlockError::UnknownDevice);
                break;
            };
            let engine = &mut self.engine;
            // One operation, and where the request's place moves once it is queued.
            let (result, next_op, op_off) = match &io.op {
                IoOp::Read { offset, len } => {
                    let buf = self.pool.take().and_then(|mut b| {
                        let fits = b.set_len(*len as usize);
                        fits.then_some(b)
                    });
                    let result = match buf {
                        Some(b) => engine.read(dev, *offset, b, tag),
                        // Admission keeps a buffer for every command it starts.
                        None => Err(Rejected {
                            error: BlockError::QueueFull,
                            buf: None,
                        }),
                    };
                    (result, 1, 0)
                }
                IoOp::Write { offset, len, fua } => {
                    let result = match (r.buf.take(), r.recv) {
                        (Some(b), _) => engine.write(dev, *offset, b, *fua, tag),
                        (None, Some((_, from))) => {
                            self.counters
                                .writes_from_receive
                                .fetch_add(1, Ordering::Relaxed);
                            // SAFETY: `from..from + len` lies in the receive the request keeps
                            // off the SRQ until this write's completion is reaped (`finish_io`,
                            // `end_req` give it back only then, and the SRQ is not rebuilt
                            // while a receive is kept); the engine is dropped before the SRQ.
                            unsafe { engine.write_from(dev, *offset, from, *len, *fua, tag) }
                        }
                        (None, None) => Err(Rejected {
                            error: BlockError::QueueFull,
                            buf: None,
                        }),
                    };
                    (result, 1, 0)
                }
                IoOp::Flush => (engine.flush(dev, tag), 1, 0),
                IoOp::FlushAll { .. } => (engine.flush(dev, tag), r.next_op + 1, 0),
                IoOp::WriteZeroes { offset, len } => {
                    (engine.write_zeroes(dev, *offset, *len, tag), 1, 0)
                }
                IoOp::Deallocate { ranges } => {
                    let Some(&(o, l)) = ranges.get(r.next_op as usize) else {
                        break;
                    };
                    // A range longer than the backend takes at once goes in pieces.
                    let piece = (l - r.op_off).min(dealloc_piece(engine, dev));
                    let result = engine.deallocate(dev, o + r.op_off, piece, tag);
                    if r.op_off + piece < l {
                        (result, r.next_op, r.op_off + piece)
                    } else {
                        (result, r.next_op + 1, 0)
                    }
                }
            };
            match result {
                Ok(()) => {
                    r.ops_left += 1;
                    r.next_op = next_op;
                    r.op_off = op_off;
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
        r.ops_done = true;
        if r.ops_left == 0 {
            self.finish_io(i);
            self.process(i, now);
        }
    }

    /// Requests waiting for room in the engine go on, oldest first, while it has room.
    fn unblock(&mut self, now: Instant) {
        while self.engine.capacity_left() > 0 {
            let Some(i) = self.blocked.pop_front() else {
                break;
            };
            self.issue(i, now);
        }
    }

    fn on_block_done(&mut self, c: Completion, now: Instant) {
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
    fn finish_io(&mut self, i: usize) {
        let Some(r) = self.reqs[i].as_mut() else {
            return;
        };
        let qpn = r.qpn;
        let Work::Io(io) = std::mem::replace(&mut r.work, Work::Respond) else {
            return;
        };
        // The write from its receive is done: the receive goes back before the response.
        if let Some((wr, _)) = r.recv.take() {
            self.give_back(wr);
        }
        let Some(r) = self.reqs[i].as_mut() else {
            return;
        };
        let Some(conn) = self.conns.get_mut(&qpn) else {
            return self.end_req(i);
        };
        let cqe = conn.queue.io_done(&io, r.failed.take().map_or(Ok(0), Err));
        let ok = cqe.status().is_success();
        r.cqe = cqe;
        match (ok, &io.op) {
            (true, IoOp::Read { len, .. }) => {
                self.counters
                    .read_bytes
                    .fetch_add(u64::from(*len), Ordering::Relaxed);
            }
            (true, IoOp::Write { len, .. }) => {
                self.counters
                    .write_bytes
                    .fetch_add(u64::from(*len), Ordering::Relaxed);
            }
            _ => {}
        }
        // Only a successful read sends data; any other buffer goes back now.
        if !(ok && matches!(io.op, IoOp::Read { .. })) {
            r.buf = None;
            r.data_len = 0;
        }
        r.state = State::NeedSend;
        // The core reuses the operation's lists (DSM ranges) for the next one.
        if let Some(conn) = self.conns.get_mut(&qpn) {
            conn.queue.give_back_op(io.op);
        }
        self.wait_send(i);
    }

    /// The device was removed: every QP is torn down (`Device`). Its async events are no
    /// longer routed, so the drains do not wait for LAST_WQE.
    pub fn device_removed(&mut self, now: Instant) {
        self.wait_last_wqe = false;
        self.teardown_all(Cause::Device, now);
    }
}
