//! The target's RDMA data path on one reactor: capsules arrive in receives of the reactor's
//! SRQ (a 64-byte command SGE, then page SGEs for in-capsule data), the NVMe core says what
//! they mean, and this moves the data (RDMA READ of host data, RDMA WRITE of read data),
//! runs the block operations on the reactor's io_uring engine, and sends the responses.
//!
//! One request slot per command in flight, taken from a preallocated table; data buffers come
//! from the reactor's registered pool, which is both the RDMA memory region and the io_uring
//! fixed buffer. Written against `nvmfd_rdma::any`, so it runs on either provider.
//!
//! A request's life, file by file:
//! - `receive.rs`: a command arrives in a receive of the SRQ and starts in a request slot;
//! - `request.rs`: the request state machine, from what the core says the command needs to
//!   its response;
//! - `post.rs`: RDMA READs and responses staged within the QP's budgets, posted once per turn,
//!   and their completions;
//! - `block.rs`: the command's block operations on the engine, and their completions;
//! - `conn.rs`: connections adopted, and ended through the one teardown path;
//! - this file: the data path's state, and one turn of it (`poll`).

use std::collections::VecDeque;

// Completions and requests find their connection by QP number: with a fast hasher.
use rustc_hash::FxHashMap as HashMap;
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
use crate::stats::bump;
use class::Class;

/// Namespace devices one data path's engine can serve at once (its registered file table):
/// twice as many as the configuration allows namespaces, so that a change swapping
/// namespaces at the limit attaches the new ones before the old ones are let go (and devices
/// still finishing operations after their removal keep their slots meanwhile). Bounded by
/// the soft RLIMIT_NOFILE (a larger file table fails with EMFILE; nvmfd raises its soft limit
/// to the hard one at start, `raise_file_limit`), and never below the namespace limit.
pub fn max_attached() -> u32 {
    let want = 2 * nvmfd_config::MAX_NAMESPACES;
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the limits of this process into `lim`, which it owns.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return nvmfd_config::MAX_NAMESPACES;
    }
    let soft = u32::try_from(lim.rlim_cur).unwrap_or(u32::MAX);
    want.min(soft).max(nvmfd_config::MAX_NAMESPACES)
}

/// Raises this process's soft RLIMIT_NOFILE to its hard limit (the usual soft 1024 bounds the
/// engines' file tables, `max_attached`); returns the soft limit now.
pub fn raise_file_limit() -> std::io::Result<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the limits of this process into `lim`, which it owns.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if lim.rlim_cur < lim.rlim_max {
        lim.rlim_cur = lim.rlim_max;
        // SAFETY: setrlimit reads `lim`; raising the soft limit up to the hard one is always
        // allowed.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(lim.rlim_cur)
}

mod block;
mod class;
mod conn;
mod conns;
mod handles;
mod hooks;
mod post;
mod receive;
mod request;
mod unconnected;
mod waiting;

use conn::*;
use conns::*;
use post::*;
use request::*;
use waiting::{Lane, Waiting};

/// Sizes of one reactor's data path.
#[derive(Clone, Copy, Debug)]
pub struct DataPathConfig {
    /// The elastic SRQ's sizes.
    pub srq: SrqConfig,
    /// In-capsule data per receive (a multiple of 4 KiB pages is used).
    pub in_capsule: u32,
    /// Large data buffers, each `max_io` bytes: for commands that move more than
    /// [`SMALL_BUFFER`] bytes.
    pub buffers: u32,
    /// Small data buffers, each [`SMALL_BUFFER`] bytes (or `max_io`, if smaller): for the
    /// commands that move no more than that, so that 4 KiB I/O is not admitted by the count
    /// of 128 KiB buffers.
    pub small_buffers: u32,
    /// Largest transfer.
    pub max_io: u32,
    /// Commands in flight at once.
    pub requests: u32,
    /// Back the data buffers with huge pages where some are reserved.
    pub huge_pages: bool,
    /// How long an accepted connection may go without a Fabrics Connect from its host before
    /// it is ended (`transport.connect_timeout`).
    pub connect_timeout: std::time::Duration,
    /// How long a connection's posted work may take to complete before it is ended
    /// ([`RESPONSE_TIMEOUT`] in the daemon).
    pub response_timeout: std::time::Duration,
    /// QPs at once, live and draining ([`MAX_QPS`] in the daemon): the CQ has room for a
    /// drain marker of each, and a connection beyond it is refused.
    pub max_qps: u32,
}

/// The QPs one data path serves at once, live and draining: 32 hosts of 64 CPUs connected
/// with the Linux host's default of one I/O queue per CPU, and their admin queues, fit
/// (32 × 65 = 2,080), with as many again torn down and draining.
pub const MAX_QPS: u32 = 4096;
/// The fewest QPs a data path serves, whatever its device's CQ size (below that the
/// CQ's bound is not kept).
const MIN_QPS: u32 = 64;

/// Work request IDs below this name receives; send work requests carry a kind above it.
const REQ_BASE: u64 = crate::srq::WR_ID_END;
const _: () = assert!(REQ_BASE <= 1 << post::KIND_SHIFT);
/// The RNR NAK timer QPs advertise: 0.16 ms (InfiniBand encoding 8).
const MIN_RNR_TIMER: u8 = 8;
/// The longest a connection's posted work (a response's SEND, an RDMA READ of a write's
/// data) takes to complete before the connection is ended as a host breaking the protocol.
/// A SEND waits, retried without end (RNR retry 7), for a receive at the host: a host that
/// posts none (or one now and then) would keep the requests of its responses, and with a few queues
/// every request slot of the reactor, while its admin queue keeps its controller alive. The
/// Linux host's I/O timeout is 30 s: other hosts' commands that wait for a slot meanwhile
/// are served well within it.
pub const RESPONSE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// The longest a torn-down QP waits for its work to drain before it is destroyed anyway.
pub const DRAIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);
/// The most drained QPs a turn destroys (with their CM IDs); the rest wait for the next
/// turns. A destroy is a system call into the device's driver (a firmware command on most
/// NICs, a CM ID's teardown besides): a thousand queues gone at once, destroyed in one
/// turn, would stall every other queue of the reactor for that long.
pub const DESTROYS_PER_TURN: usize = 8;

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

/// The size of a small data buffer (SPDK's small buffer is the same).
pub const SMALL_BUFFER: u32 = 8192;

/// Request slots kept for admin queues' commands (at most a sixteenth of the slots): a host
/// has at most a few admin commands out (Keep Alive, AERs hold none), so a handful of hosts'
/// fit while I/O holds every other slot.
const ADMIN_RESERVE: usize = 16;

/// Completions that may be due at once: every receive the SRQ may post; for every command, a
/// WRITE of its data and its SEND (when its QP fails, every posted work request completes,
/// flushed, signaled or not; a small command's data is one keyed piece at most); for every
/// large buffer, a WRITE or READ of each further piece; and a drain marker for every QP
/// (`max_qps`), as all may be torn down at once. A CQ that overruns fails with everything on
/// it.
fn cq_entries(cfg: &DataPathConfig) -> u32 {
    let small = cfg.requests.saturating_mul(2);
    let large = cfg
        .buffers
        .saturating_mul(nvmfd_nvme::MAX_SGL_DESCRIPTORS - 1);
    cfg.srq
        .max
        .saturating_add(small)
        .saturating_add(large)
        .saturating_add(cfg.max_qps)
        .max(4096)
}

/// Host memory pieces one command's data may come from or go to.
const MAX_SEGS: usize = 16;
const _: () = assert!(MAX_SEGS == nvmfd_nvme::MAX_SGL_DESCRIPTORS as usize);
/// The most RDMA READs a QP has in flight, whatever the host offers.
const MAX_READ_DEPTH: u32 = 16;
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

/// One reactor's RDMA target.
pub struct DataPath {
    target: Target,
    cq: Cq,
    /// The device's async fd: events arriving on it name this data path's objects.
    async_fd: std::os::fd::RawFd,
    /// The device, for the number of async events read ([`any::Device::events_read`]).
    dev: any::Device,
    // Field order is drop order: the engine waits for its operations before the SRQ's
    // receive buffers (which in-capsule writes are written from) and the pool go; the MR
    // over the pool goes before the pool's memory. The SRQ is dropped by hand (`Drop`),
    // only once the engine has drained: should the drain fail, operations may still read
    // receive memory, and the SRQ is leaked instead (the pool's buffers of such operations
    // the engine leaks itself). The connections (their QPs) go after the MRs, the pools and
    // the SRQ's chunks: sound because deregistering an MR stops the device's access to it
    // first (`ibv_dereg_mr`; the soft provider removes the key under its lock), so an RDMA
    // operation or receive of a QP still there fails with a protection error instead of
    // reaching freed memory.
    engine: Engine,
    srq: std::mem::ManuallyDrop<ElasticSrq>,
    /// SRQs replaced after an error whose receives in-capsule writes still write from
    /// (`retired_held` of them): each stays until they are given back, dropped as `srq` is.
    retired_srqs: std::mem::ManuallyDrop<Vec<ElasticSrq>>,
    retired_held: usize,
    data_mr: Mr,
    small_mr: Mr,
    /// Zeroes, registered for local reading only: reads of a null namespace send their data
    /// from here, with no buffer and no fill.
    zeros: Mr,
    pool: BufPool,
    small: BufPool,
    pd: Pd,
    /// Devices by (subsystem index in the target, NSID): no key to build per I/O; with the
    /// `ns_changes` count when each was attached.
    devs: HashMap<(u64, u32), (DevId, u64)>,
    /// Namespaces waiting for a handle on their image, opened off the reactor (`handles.rs`).
    awaiting: Vec<handles::Awaiting>,
    /// Namespaces attached while serving, counted: a request remembers the count at its
    /// admission, and one whose namespace was attached after it (its NSID removed and
    /// added again, on another device) submits nothing there.
    ns_changes: u64,
    /// Devices of removed namespaces, detached from the engine once none of their
    /// operations is in flight.
    detaching: Vec<DevId>,
    /// Asynchronous events wait for request slots to complete their AERs.
    events_due: bool,
    conns: Conns,
    reqs: Vec<Option<Req>>,
    /// Each slot's pieces of host memory (its first `nsegs` are the live ones): kept apart
    /// from `reqs`, so that taking and ending a slot neither zeroes nor moves them.
    segs: Vec<[Seg; MAX_SEGS]>,
    /// Each slot's generation, moved on every time the slot is taken.
    generations: Vec<u32>,
    free: Vec<usize>,
    /// Requests whose next block operation the engine had no room for (`QueueFull`), in
    /// order: they go on as operations complete.
    blocked: VecDeque<usize>,
    /// The CQ's batch of work completions, kept for every turn.
    wc: [Wc; 32],
    counters: Arc<crate::stats::DataPathCounters>,
    /// Admission. A command holds one request slot and at most one data buffer, of the
    /// class its SGL says ([`Class::of`]). It is admitted only while a slot is free and fewer
    /// commands of its class are in flight than its pool has buffers (`kept`, by class), so
    /// none ever finds its pool empty. The pools are the data-buffer budget.
    kept: [usize; 2],
    /// Bytes in a small buffer.
    small_size: u32,
    /// Commands that arrived while they could not be admitted, by lane (admin and I/O, each
    /// small or large). Their receives stay off the SRQ until they start, the oldest that can be
    /// admitted first, as commands finish (the SRQ grows if that makes it run low). Bounded
    /// by the receives the SRQ can hold.
    incoming: Waiting,
    /// Request slots only admin queues' commands may take: I/O that fills every other slot
    /// (a backend that stopped answering) leaves Keep Alives and the other admin commands
    /// of every host room to run.
    admin_reserve: usize,
    /// QPs with work staged this turn: (connection index, QP number).
    dirty: Vec<(u32, u32)>,
    /// Receives kept by requests (in-capsule writes in flight), whose memory is being
    /// written from: an SRQ rebuilt meanwhile keeps the old one (`retired_srqs`).
    held_receives: usize,
    /// Device limits: RDMA READ depth and send queue size.
    max_read_depth: u32,
    max_qp_wr: u32,
    /// QPs served at once, live and draining (`DataPathConfig::max_qps`, less what a CQ
    /// smaller than asked for lacks).
    max_qps: u32,
    /// `DataPathConfig::max_qps`.
    cfg_max_qps: u32,
    /// Drain markers posted (wrapping): each marker carries its number, as a request's
    /// work carries its slot's generation.
    markers: u32,
    /// Signaled send WRs posted and not completed.
    sends_in_flight: usize,
    /// QPs torn down, draining before they are destroyed.
    draining: HashMap<u32, Drain>,
    /// NVMe queues of QPs destroyed after their drain timed out, kept until their block
    /// operations complete, by the tag their requests carry (see `conn::ORPHANS`).
    lingering: Vec<conn::Lingering>,
    /// The last lingering queue's tag, less `ORPHANS`.
    next_lingering: u32,
    /// Times a poll of the CQ found it empty.
    cq_empty_polls: u64,
    /// Drains waiting only for a poll that finds the CQ empty: the CQ is polled until it is.
    settling: usize,
    /// The SRQ failed: connections are refused until every QP on it is gone and it is rebuilt.
    srq_broken: bool,
    /// The device's count of async events read when the SRQ, and the CQ, were made: an event
    /// naming one of them read before is of a destroyed object whose handle the device gave
    /// again (kernel handles are reused lowest first, across object kinds).
    srq_events_from: u64,
    cq_events_from: u64,
    /// The CQ failed (an overrun): its completions are lost, so every QP was torn down and
    /// connections are refused; the reactor replaces this data path by a new one.
    cq_broken: bool,
    /// A rebuild of the broken SRQ failed: when to try again, and the wait after this try
    /// (doubling from `SRQ_RETRY_FIRST` to `SRQ_RETRY_MAX`).
    srq_retry: Option<(Instant, std::time::Duration)>,
    /// Accepted connections whose host has not sent a Fabrics Connect yet, in accept order:
    /// (accepted at, QP number, CM token).
    unconnected: VecDeque<(Instant, u32, usize)>,
    /// How long a connection may go without a Fabrics Connect (`DataPathConfig`).
    connect_timeout: std::time::Duration,
    /// How long a connection's posted work may go without a completion (`DataPathConfig`),
    /// and when the connections are next looked at for that.
    response_timeout: std::time::Duration,
    next_stall_check: Instant,
    /// Block completions of one turn (kept, so that no turn allocates).
    reaped: Vec<Completion>,
    /// QP numbers of one turn's ended connections (kept likewise).
    scratch_qpns: Vec<u32>,
    /// A turn's count of live requests per draining QP (kept likewise).
    scratch_counts: HashMap<u32, usize>,
    /// Whether the device sends LAST_WQE_REACHED (rxe and iWARP do not: the drain marker
    /// alone ends a drain there).
    wait_last_wqe: bool,
    /// The target's controller changes at the last look for queues whose controller ended
    /// ([`Target::controller_changes`]). A queue is bound only to a controller not yet
    /// ended, and the count is read after the turn's binds: an end after a bind moves it, so
    /// the next look finds that queue.
    ctrl_changes_seen: u64,
    /// Whether the device can post SEND_WITH_INVALIDATE; where it cannot, responses go as
    /// plain SENDs and the host invalidates its key itself.
    send_invalidate: bool,
    /// Tests: a stalled disk, a faulty target, a CQ that never reads empty.
    hooks: hooks::Hooks,
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

impl Drop for DataPath {
    fn drop(&mut self) {
        match self.engine.drain(drop) {
            Ok(()) => {
                // SAFETY: `srq` and `retired_srqs` are dropped here once and never used
                // after (this is the data path's drop; its other fields follow), and nothing
                // at the engine reads their receives any more.
                unsafe {
                    std::mem::ManuallyDrop::drop(&mut self.srq);
                    std::mem::ManuallyDrop::drop(&mut self.retired_srqs);
                }
            }
            Err(e) => {
                slog::error!(self.log, "the block engine could not wait for its operations; the receive buffers they may read are leaked";
                    "error" => %e);
            }
        }
    }
}

impl DataPath {
    /// Sets up the reactor's CQ, SRQ, receive buffers, data pool and engine on `dev`, with
    /// `namespaces` (subsystem NQN, NSID, device) attached.
    pub fn new(
        dev: &Device,
        target: Target,
        namespaces: &[(u64, u32, Arc<BlockDevice>)],
        cfg: DataPathConfig,
        registrar: Registrar,
        counters: Arc<crate::stats::DataPathCounters>,
    ) -> std::io::Result<DataPath> {
        // Pools registered for remote write would let every host write into every other's.
        if dev.rdma_read_sink_needs_remote_write() {
            return Err(std::io::Error::other("an iWARP device (other than siw): RDMA READ sinks must be remotely writable there, which would let every host write into every other's buffers; not supported"));
        }
        let pd = dev.alloc_pd().map_err(verr)?;
        let attr = dev.attr().map_err(verr)?;
        // The SRQ is as large as the device allows at most (`ElasticSrq::new` caps it too):
        // the CQ is sized for that, not for a larger `srq_max`, which took its excess from
        // the QPs' room below.
        let mut cfg = cfg;
        cfg.srq.max = cfg.srq.max.min(attr.max_srq_wr).max(1);
        // A device whose CQs are smaller than asked for leaves less room for drain markers:
        // fewer QPs are served (logged by `set_log`).
        let wanted = cq_entries(&cfg);
        let entries = attr.max_cqe.min(wanted);
        let max_qps = cfg
            .max_qps
            .saturating_sub(wanted - entries)
            .max(MIN_QPS.min(cfg.max_qps));
        let cq = dev.create_cq(entries).map_err(verr)?;
        let srq = ElasticSrq::new(
            &pd,
            &attr,
            cfg.srq,
            cfg.in_capsule,
            registrar,
            Arc::clone(&counters),
            Instant::now(),
        )?;
        let small_size = SMALL_BUFFER.min(cfg.max_io);
        let pool = BufPool::new(cfg.buffers, cfg.max_io as usize, cfg.huge_pages)?;
        let small = BufPool::new(
            cfg.small_buffers.max(1),
            small_size as usize,
            cfg.huge_pages,
        )?;
        let register = |p: &BufPool| {
            let iov = p.iovec();
            // Local access only: the buffers are the source of the target's RDMA WRITEs and
            // the sink of its RDMA READs. No host may reach them with a key it guessed; their
            // data is other hosts' I/O.
            // SAFETY: the pool's region stays mapped while the pool lives, and the data path
            // drops its MRs before its pools (field order); the NIC's accesses are to buffers
            // owned by requests.
            unsafe { pd.reg_mr(iov.iov_base.cast(), iov.iov_len, Access::LOCAL_WRITE) }
                .map_err(verr)
        };
        let data_mr = register(&pool)?;
        let small_mr = register(&small)?;
        // Nothing writes it (no local write access either): it stays as allocated, zeroes.
        let zeros = pd
            .alloc_mr(cfg.max_io.max(small_size) as usize, Access::empty())
            .map_err(verr)?;
        let engine = Engine::new(cfg.requests, max_attached(), &[pool.clone(), small.clone()])?;
        // After the SRQ and the CQ were made, as for a QP (`adopt`).
        let events_from = dev.events_read();
        let mut dp = DataPath {
            target,
            cq,
            async_fd: dev.async_fd(),
            dev: dev.clone(),
            srq: std::mem::ManuallyDrop::new(srq),
            retired_srqs: std::mem::ManuallyDrop::new(Vec::new()),
            retired_held: 0,
            data_mr,
            small_mr,
            zeros,
            engine,
            pool,
            small,
            small_size,
            kept: [0; 2],
            pd,
            devs: HashMap::default(),
            awaiting: Vec::new(),
            ns_changes: 0,
            detaching: Vec::new(),
            events_due: false,
            conns: Conns::default(),
            reqs: (0..cfg.requests).map(|_| None).collect(),
            segs: vec![[Seg::default(); MAX_SEGS]; cfg.requests as usize],
            generations: vec![0; cfg.requests as usize],
            free: (0..cfg.requests as usize).rev().collect(),
            blocked: VecDeque::with_capacity(cfg.requests as usize),
            wc: [Wc::default(); 32],
            counters,
            incoming: Waiting::with_capacity(cfg.srq.max as usize),
            admin_reserve: (cfg.requests as usize / 16).min(ADMIN_RESERVE),
            dirty: Vec::with_capacity(256),
            held_receives: 0,
            max_read_depth: attr.max_qp_init_rd_atom.clamp(1, MAX_READ_DEPTH),
            max_qp_wr: attr.max_qp_wr.max(8),
            sends_in_flight: 0,
            markers: 0,
            cfg_max_qps: cfg.max_qps,
            draining: HashMap::default(),
            lingering: Vec::new(),
            next_lingering: 0,
            cq_empty_polls: 0,
            settling: 0,
            srq_broken: false,
            srq_events_from: events_from,
            cq_events_from: events_from,
            cq_broken: false,
            srq_retry: None,
            unconnected: VecDeque::new(),
            connect_timeout: cfg.connect_timeout,
            response_timeout: cfg.response_timeout,
            next_stall_check: Instant::now(),
            max_qps,
            reaped: Vec::with_capacity(2 * cfg.requests as usize),
            scratch_qpns: Vec::with_capacity(64),
            scratch_counts: HashMap::default(),
            // No count is this: the first turn looks.
            ctrl_changes_seen: u64::MAX,
            wait_last_wqe: dev.sends_last_wqe(),
            send_invalidate: dev.supports_send_with_invalidate(),
            hooks: hooks::Hooks::default(),
            log: slog::Logger::root(slog::Discard, slog::o!()),
        };
        let now = Instant::now();
        // One namespace's device refused (the engine's file table, the process out of
        // files) is attached again later: the path serves the others meanwhile.
        for (sub, nsid, d) in namespaces {
            if let Err(e) = dp.attach_or_await(*sub, *nsid, d, 0, now) {
                dp.awaiting.push(handles::Awaiting::after_failure(
                    *sub,
                    *nsid,
                    d,
                    now,
                    e.to_string(),
                ));
            }
        }
        // Its levels are right from the start (a namespace waiting for a handle, say).
        dp.gauges();
        Ok(dp)
    }

    /// Where teardowns and drains are logged.
    pub fn set_log(&mut self, log: slog::Logger) {
        self.log = log;
        for a in &self.awaiting {
            match &a.failure {
                Some(e) => {
                    slog::warn!(self.log, "cannot attach a namespace's device; its commands answer Namespace Not Ready until it is, tried again after 1 s";
                        "subsystem" => a.sub, "nsid" => a.nsid, "error" => e)
                }
                None => {
                    slog::info!(self.log, "namespace waits for a handle on its image, opened off the reactor; its commands meanwhile answer Namespace Not Ready";
                        "subsystem" => a.sub, "nsid" => a.nsid)
                }
            }
        }
        if self.max_qps < self.cfg_max_qps {
            slog::warn!(self.log, "the device's CQs are smaller than this data path asks for: it serves fewer QPs at once";
                "max_qps" => self.max_qps, "asked" => self.cfg_max_qps);
        }
    }

    /// The device's async event fd, which the control thread watches.
    pub fn async_fd(&self) -> std::os::fd::RawFd {
        self.async_fd
    }

    /// The SRQ's ID, as async events name it.
    pub fn srq_id(&self) -> u32 {
        self.srq.srq().id()
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
            || self.incoming.next(|l, k| self.admits(l, k)).is_some()
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
        // First, so that the commands of the turn that finds a namespace's handle ready (the
        // one a command woke the reactor for, say) are served with it.
        if !self.awaiting.is_empty() {
            self.attach_awaiting(now);
        }
        while let Some(lane) = self.incoming.next(|l, k| self.admits(l, k)) {
            let Some(w) = self.incoming.pop(lane) else {
                break;
            };
            self.start_command((w.qpn, None), w.wr, w.len, Some(w.class), now);
            worked = true;
        }
        let mut n = 0;
        let mut cq_read_to_end = false;
        // One batch a turn; while a drain waits for the CQ to be empty, until it is. The batch
        // lives in the data path: nothing is zeroed per turn.
        for _ in 0..64 {
            // A failed poll is not an empty CQ (drains end when the CQ reads empty): the CQ
            // is lost, as with a CQ error event.
            let got = match self.cq.poll(&mut self.wc) {
                Ok(got) => got,
                Err(e) => {
                    self.cq_failed(&e.to_string(), now);
                    break;
                }
            };
            let receives = self.wc[..got].iter().filter(|c| c.wr_id < REQ_BASE).count();
            self.srq
                .consumed(u32::try_from(receives).unwrap_or(u32::MAX));
            for i in 0..got {
                let c = self.wc[i];
                self.on_completion(&c, now);
            }
            n += got;
            if got < self.wc.len() {
                self.cq_empty_polls += 1;
                cq_read_to_end = !self.hooks.cq_never_empty;
                break;
            }
            if self.settling == 0 {
                break;
            }
        }
        // Reused vectors (taken and put back): nothing is allocated per turn.
        let mut done = std::mem::take(&mut self.reaped);
        if !self.hooks.hold_block_completions {
            self.engine.reap(|c| done.push(c));
        }
        if self.hooks.hold_namespaces != 0 || !self.hooks.held_completions.is_empty() {
            self.hold_completions_of_namespaces(&mut done);
        }
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
        self.expire_stalled(now, cq_read_to_end);
        if self.events_due {
            self.poll_events();
        }
        if !self.detaching.is_empty() {
            let engine = &mut self.engine;
            self.detaching
                .retain(|&d| engine.detach(d).is_err_and(|e| e.is_backpressure()));
        }
        // Connections whose controller ended are closed. A queue that receives a command
        // finds out itself; idle ones are looked at only when a controller ended or reset
        // since the last look, not on every turn.
        let changes = self.target.controller_changes();
        if changes != self.ctrl_changes_seen {
            self.ctrl_changes_seen = changes;
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
        }
        self.flush(now);
        let _ = self.engine.submit();
        self.srq.tick(now);
        self.reap_drained(now);
        if self.srq_broken
            && self.draining.is_empty()
            && self.conns.is_empty()
            && self.srq_retry.is_none_or(|(at, _)| now >= at)
        {
            self.rebuild_srq(now);
        }
        self.gauges();
        worked
    }

    /// Stores the pools' levels for `stats` (relaxed stores, no syscall).
    fn gauges(&self) {
        let c = &self.counters;
        let set = |a: &std::sync::atomic::AtomicU64, v: usize| a.store(v as u64, Ordering::Relaxed);
        set(&c.requests_active, self.in_use());
        set(&c.requests_waiting, self.incoming.len());
        set(&c.request_slots_free, self.free.len());
        set(&c.request_slots, self.reqs.len());
        set(
            &c.buffers_free,
            self.pool.free_count() + self.small.free_count(),
        );
        set(&c.buffers, self.pool.count() + self.small.count());
        set(&c.block_ops_in_flight, self.engine.in_flight());
        set(&c.sends_in_flight, self.sends_in_flight);
        set(&c.qps_draining, self.draining.len());
        set(&c.namespaces_awaiting, self.awaiting.len());
        set(&c.srq_receives_reserved, self.srq.reserved() as usize);
    }

    /// The data buffers: (small buffers, their size, large buffers, their size, whether both
    /// pools are backed by huge pages).
    pub fn buffers(&self) -> (usize, usize, usize, usize, bool) {
        (
            self.small.count(),
            self.small.buf_size(),
            self.pool.count(),
            self.pool.buf_size(),
            self.small.is_huge() && self.pool.is_huge(),
        )
    }

    /// Request slots taken: the commands in flight.
    fn in_use(&self) -> usize {
        self.reqs.len() - self.free.len()
    }

    /// Whether a command of `lane` and `class` can be admitted now: a slot is free (beyond
    /// the admin queues' reserve, for I/O) and its class's pool has a buffer for every
    /// admitted command of the class, this one included.
    fn admits(&self, lane: Lane, class: Class) -> bool {
        let reserve = if lane.is_admin() {
            0
        } else {
            self.admin_reserve
        };
        self.free.len() > reserve && self.kept[class as usize] < self.pool_of(class).count()
    }

    /// Whether a command of either class can be admitted now on an admin (`admin`) or an
    /// I/O queue.
    fn admits_any(&self, admin: bool) -> bool {
        self.admits(Lane::of(admin, Class::Small), Class::Small)
            && self.admits(Lane::of(admin, Class::Large), Class::Large)
    }

    /// The pool of `class`.
    fn pool_of(&self, class: Class) -> &BufPool {
        match class {
            Class::Small => &self.small,
            Class::Large => &self.pool,
        }
    }
}
