//! The target's RDMA data path on one reactor: capsules arrive in receives of the reactor's
//! SRQ (a 64-byte command SGE, then page SGEs for in-capsule data), the NVMe core says what
//! they mean, and this moves the data (RDMA READ of host data, RDMA WRITE of read data),
//! runs the block operations on the reactor's io_uring engine, and sends the responses.
//!
//! One request slot per command in flight, taken from a preallocated table; data buffers come
//! from the reactor's registered pool, which is both the RDMA memory region and the io_uring
//! fixed buffer. Written against `nvmfd_rdma::any`, so it runs on either provider.

use std::collections::HashMap;
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
}

/// Work request IDs at or above this name request slots; below, receive slots.
const REQ_BASE: u64 = crate::srq::WR_ID_END;
/// The RNR NAK timer QPs advertise: 0.16 ms (InfiniBand encoding 8).
const MIN_RNR_TIMER: u8 = 8;
/// A response SEND with no request slot behind it.
const NO_REQ: u64 = u64::MAX;
/// The drain marker of a QP being torn down: `DRAIN_BASE + qpn`, a zero-length SEND posted
/// after the QP went to ERR, so its flush completion comes after every earlier send's.
const DRAIN_BASE: u64 = 1 << 48;
/// The longest a torn-down QP waits for its work to drain before it is destroyed anyway.
pub const DRAIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Why a queue pair was torn down; `stats` counts each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cause {
    /// The host disconnected (CM DISCONNECTED).
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

/// A QP torn down and not yet destroyed: its work drains first.
struct Drain {
    /// Kept alive (and so the QP) until the drain ends.
    id: CmId,
    depth: u32,
    since: Instant,
    cause: Cause,
    /// `IBV_EVENT_QP_LAST_WQE_REACHED` arrived: no receive completion of it is still to come.
    last_wqe: bool,
    /// The drain marker completed (or could not be posted): every send of it has completed.
    flushed: bool,
}

/// What a command in flight waits for.
#[derive(Debug)]
enum Stage {
    /// RDMA READ of host data for a command the core must see (Connect data, DSM ranges).
    FetchForCore(Command),
    /// RDMA READ of host data for a block write.
    FetchForWrite(IoRequest),
    /// Block operations (`left` of them) of a command.
    Io {
        req: IoRequest,
        left: u32,
        failed: Option<nvmfd_blockdev::BlockError>,
    },
    /// The response (and any data before it) is being sent.
    Responding,
}

#[derive(Debug)]
struct Req {
    qpn: u32,
    stage: Stage,
    buf: Option<DmaBuf>,
}

struct Conn {
    id: CmId,
    queue: Queue,
    token: usize,
    /// Receives reserved for it in the SRQ (its queue depth).
    depth: u32,
}

/// One reactor's RDMA target.
pub struct DataPath {
    target: Target,
    cq: Cq,
    /// The device's async fd: events arriving on it name this data path's objects.
    async_fd: std::os::fd::RawFd,
    srq: ElasticSrq,
    // Field order is drop order: the MR over the pool goes before the pool's memory.
    data_mr: Mr,
    engine: Engine,
    pool: BufPool,
    pd: Pd,
    /// Devices by (subsystem index in the target, NSID): no key to build per I/O.
    devs: HashMap<(usize, u32), DevId>,
    conns: HashMap<u32, Conn>,
    reqs: Vec<Option<Req>>,
    free: Vec<usize>,
    capsule: Vec<u8>,
    counters: Arc<crate::stats::DataPathCounters>,
    /// Commands admitted at once: each holds at most one request slot and one buffer between
    /// two events, so admitting a command only while fewer than `limit` slots are taken means
    /// none ever finds them all taken.
    limit: usize,
    /// Capsules that arrived while `limit` commands were active (their receives are already
    /// re-posted), started in order as commands finish. Bounded by the receives posted.
    incoming: std::collections::VecDeque<(u32, Vec<u8>)>,
    /// Signaled send WRs posted and not completed.
    sends_in_flight: usize,
    /// QPs torn down, draining before they are destroyed.
    draining: HashMap<u32, Drain>,
    /// The SRQ failed: connections are refused until every QP on it is gone and it is rebuilt.
    srq_broken: bool,
    /// Block completions of one turn (kept, so that no turn allocates).
    reaped: Vec<Completion>,
    /// QP numbers of one turn's ended connections (kept likewise).
    scratch_qpns: Vec<u32>,
    /// Whether the device sends LAST_WQE_REACHED (rxe and iWARP do not: the drain marker
    /// alone ends a drain there).
    wait_last_wqe: bool,
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
            free: (0..cfg.requests as usize).rev().collect(),
            capsule: Vec::with_capacity(64 + cfg.in_capsule as usize),
            counters,
            limit: cfg.requests.min(cfg.buffers) as usize,
            incoming: std::collections::VecDeque::with_capacity(cfg.srq.max as usize),
            sends_in_flight: 0,
            draining: HashMap::new(),
            srq_broken: false,
            reaped: Vec::with_capacity(2 * cfg.requests as usize),
            scratch_qpns: Vec::with_capacity(64),
            wait_last_wqe: dev.sends_last_wqe(),
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
    /// reactor's CQ and SRQ, and it is accepted with the granted queue size.
    pub fn adopt(&mut self, mut id: CmId, req: CmRequest) -> Result<Change, VerbsError> {
        let depth = u32::from(req.crqsize());
        if self.srq_broken {
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
                self.srq.unreserve(depth);
                self.counters.srq_errors.fetch_add(1, Ordering::Relaxed);
                let _ = id.reject(&nvmfd_nvme::rdma_cm::reject_private_data(
                    nvmfd_nvme::wire::rdma_cm_status::NO_RESOURCES,
                ));
                return Err(e);
            }
        };
        let caps = QpCaps {
            max_send_wr: u32::from(req.crqsize()) * 3,
            max_send_sge: 1,
            max_recv_wr: 0,
            max_inline_data: 64,
        };
        let qpn = match id
            .create_qp(&self.pd, &self.cq, self.srq.srq(), caps)
            .and_then(|q| id.accept(&accept_private_data(req.crqsize())).map(|()| q))
        {
            Ok(q) => q,
            Err(e) => {
                self.srq.unreserve(depth);
                return Err(e);
            }
        };
        // A host whose SEND meets an empty SRQ retries after this timer; rdma_cm's default is
        // 655 ms, which starves a queue (a keep-alive) while the SRQ grows.
        if id.set_min_rnr_timer(MIN_RNR_TIMER).is_err() {
            self.counters.srq_errors.fetch_add(1, Ordering::Relaxed);
        }
        let token = id.token();
        let queue = Queue::new(&self.target, Some(req.params));
        self.conns.insert(
            qpn,
            Conn {
                id,
                queue,
                token,
                depth,
            },
        );
        self.counters
            .connections
            .store(self.conns.len() as u64, Ordering::Relaxed);
        self.counters
            .connections_accepted
            .fetch_add(1, Ordering::Relaxed);
        Ok(change)
    }

    /// The one teardown path, for every cause: the QP goes to ERR (and the host is told, by
    /// rdma_cm), a drain marker is posted behind its sends, and the QP waits in `draining`
    /// until its sends and block operations are done, its flushed receives are back and
    /// (where the device sends it) LAST_WQE_REACHED came; `reap_drained` then destroys it.
    /// Its commands end without a response; their slots and buffers return as they finish.
    pub fn teardown(&mut self, qpn: u32, cause: Cause, now: Instant) {
        let Some(c) = self.conns.remove(&qpn) else {
            return;
        };
        let _ = c.id.disconnect();
        let marker = [SendWr {
            wr_id: DRAIN_BASE + u64::from(qpn),
            op: SendOp::Send,
            sges: &[],
            signaled: true,
            inline: false,
        }];
        let flushed = c.id.post_send(&marker).is_err();
        let counter = match cause {
            Cause::Disconnect => &self.counters.teardowns_disconnect,
            Cause::QpError => &self.counters.teardowns_qp_error,
            Cause::Controller => &self.counters.teardowns_controller,
            Cause::Device => &self.counters.teardowns_device,
            Cause::Shutdown => &self.counters.teardowns_shutdown,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        slog::debug!(self.log, "QP torn down"; "qpn" => qpn, "cause" => ?cause);
        self.draining.insert(
            qpn,
            Drain {
                id: c.id,
                depth: c.depth,
                since: now,
                cause,
                last_wqe: false,
                flushed,
            },
        );
        self.counters
            .connections
            .store(self.conns.len() as u64, Ordering::Relaxed);
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
    fn reap_drained(&mut self, now: Instant) {
        if self.draining.is_empty() {
            return;
        }
        let requests_of =
            |reqs: &[Option<Req>], qpn: u32| reqs.iter().flatten().filter(|r| r.qpn == qpn).count();
        // The reused scratch vector: a turn with QPs draining allocates nothing either.
        let mut gone = std::mem::take(&mut self.scratch_qpns);
        gone.extend(self.draining.iter().filter_map(|(&qpn, d)| {
            let done = requests_of(&self.reqs, qpn) == 0
                && d.flushed
                && (d.last_wqe || !self.wait_last_wqe);
            (done || now.duration_since(d.since) >= DRAIN_TIMEOUT).then_some(qpn)
        }));
        for qpn in gone.drain(..) {
            let Some(d) = self.draining.remove(&qpn) else {
                continue;
            };
            let requests = requests_of(&self.reqs, qpn);
            let timed_out = requests > 0 || !d.flushed || (!d.last_wqe && self.wait_last_wqe);
            if timed_out {
                self.counters.drain_timeouts.fetch_add(1, Ordering::Relaxed);
                slog::warn!(self.log, "QP drain timed out; destroying it";
                    "qpn" => qpn, "cause" => ?d.cause, "requests" => requests,
                    "sends_flushed" => d.flushed, "last_wqe" => d.last_wqe,
                    "state" => ?d.id.qp_state());
                // Slots waiting for an RDMA completion end now; those with a block operation
                // in flight end when it completes (the engine holds their buffer until then).
                for i in 0..self.reqs.len() {
                    let waits_on_network = self.reqs[i]
                        .as_ref()
                        .is_some_and(|r| r.qpn == qpn && !matches!(r.stage, Stage::Io { .. }));
                    if waits_on_network {
                        self.end_req(i);
                    }
                }
            }
            self.srq.unreserve(d.depth);
            drop(d.id);
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

    /// Arms the completion channel before the reactor sleeps; false when it must not sleep
    /// (block operations in flight complete only by polling).
    pub fn arm(&mut self) -> bool {
        while self.cq.ack_event() {}
        // Block operations complete only by polling; drains end (or time out) only by polling.
        if self.engine.in_flight() > 0 || self.srq.busy() || !self.draining.is_empty() {
            return false;
        }
        self.cq.req_notify().is_ok()
    }

    /// One pass: completions, block I/O; true when there was work.
    pub fn poll(&mut self, now: Instant) -> bool {
        while self.in_use() < self.limit {
            let Some((qpn, capsule)) = self.incoming.pop_front() else {
                break;
            };
            self.start_command(qpn, &capsule, now);
        }
        let mut wc = [Wc::default(); 32];
        let n = self.cq.poll(&mut wc).unwrap_or(0);
        let receives = wc[..n].iter().filter(|c| c.wr_id < REQ_BASE).count();
        self.srq
            .consumed(u32::try_from(receives).unwrap_or(u32::MAX));
        for c in &wc[..n] {
            self.on_completion(c, now);
        }
        let _ = self.engine.submit();
        // Reused vectors (taken and put back): nothing is allocated per turn.
        let mut done = std::mem::take(&mut self.reaped);
        self.engine.reap(|c| done.push(c));
        let worked = n > 0 || !done.is_empty();
        for c in done.drain(..) {
            self.on_block_done(c);
        }
        self.reaped = done;
        let _ = self.engine.submit();
        self.srq.tick(now);
        self.gauges();
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
        self.reap_drained(now);
        if self.srq_broken && self.draining.is_empty() && self.conns.is_empty() {
            self.rebuild_srq(now);
        }
        worked
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
    }

    fn take_req(&mut self, qpn: u32, stage: Stage, buf: Option<DmaBuf>) -> Option<usize> {
        let i = self.free.pop()?;
        self.reqs[i] = Some(Req { qpn, stage, buf });
        Some(i)
    }

    fn end_req(&mut self, i: usize) {
        if self.reqs.get_mut(i).and_then(Option::take).is_some() {
            self.free.push(i);
        }
    }

    fn buffer(&self, len: u32) -> Option<DmaBuf> {
        let mut b = self.pool.take()?;
        b.set_len(len as usize).then_some(b)
    }

    fn sge(&self, buf: &mut DmaBuf) -> Sge {
        Sge {
            addr: buf.as_mut_ptr() as u64,
            length: u32::try_from(buf.len()).unwrap_or(0),
            lkey: self.data_mr.lkey(),
        }
    }

    fn on_completion(&mut self, c: &Wc, now: Instant) {
        // The ID tells receives from sends: an error completion's opcode is undefined.
        if c.wr_id < REQ_BASE {
            return self.on_receive(c, now);
        }
        // (A flushed unsignaled WRITE completes too: saturate rather than wrap.)
        self.sends_in_flight = self.sends_in_flight.saturating_sub(1);
        if c.status != WcStatus::Success && self.conns.contains_key(&c.qp_num) {
            // A live QP's work failed (remote access error, retries exhausted, or flushed
            // because the QP went to ERR before any event said so): it is torn down.
            slog::warn!(self.log, "completion in error; tearing the QP down";
                "qpn" => c.qp_num, "status" => ?c.status);
            self.teardown(c.qp_num, Cause::QpError, now);
        }
        if c.wr_id == NO_REQ {
            return;
        }
        if c.wr_id >= DRAIN_BASE {
            let qpn = u32::try_from(c.wr_id - DRAIN_BASE).unwrap_or(u32::MAX);
            if let Some(d) = self.draining.get_mut(&qpn) {
                d.flushed = true;
            }
            return;
        }
        let i = usize::try_from(c.wr_id - REQ_BASE).unwrap_or(usize::MAX);
        // A completion for a slot since given to another QP's command (its QP was destroyed
        // after a drain timed out) is stale.
        if self
            .reqs
            .get(i)
            .and_then(Option::as_ref)
            .is_none_or(|r| r.qpn != c.qp_num)
        {
            return;
        }
        if c.status != WcStatus::Success {
            // The QP is in error: the command ends, its buffer returns.
            return self.end_req(i);
        }
        let Some(req) = self.reqs.get_mut(i).and_then(Option::take) else {
            return;
        };
        match req.stage {
            Stage::FetchForCore(cmd) => {
                let data = req
                    .buf
                    .as_ref()
                    .map(|b| b.as_slice().to_vec())
                    .unwrap_or_default();
                self.free.push(i);
                if let Some(conn) = self.conns.get_mut(&req.qpn) {
                    let a = conn.queue.data_arrived(cmd, &data, now);
                    self.run(req.qpn, a, now);
                }
            }
            Stage::FetchForWrite(io) => {
                self.reqs[i] = Some(Req {
                    qpn: req.qpn,
                    stage: Stage::Responding,
                    buf: None,
                });
                self.submit_write(i, req.qpn, io, req.buf);
            }
            Stage::Responding | Stage::Io { .. } => {
                drop(req.buf);
                self.free.push(i);
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
        self.srq
            .capsule(c.wr_id, c.byte_len as usize, &mut self.capsule);
        // The receive goes back before the response is sent.
        self.srq.completed(c.wr_id, now);
        if !self.conns.contains_key(&c.qp_num) {
            self.counters.late_receives.fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.counters.commands.fetch_add(1, Ordering::Relaxed);
        if self.in_use() >= self.limit || !self.incoming.is_empty() {
            // Every slot or buffer may be in use: the command waits its turn.
            self.counters
                .commands_queued
                .fetch_add(1, Ordering::Relaxed);
            self.incoming.push_back((c.qp_num, self.capsule.clone()));
            return;
        }
        let capsule = std::mem::take(&mut self.capsule);
        self.start_command(c.qp_num, &capsule, now);
        self.capsule = capsule;
    }

    /// Admits one command and lets the core decide what it means.
    fn start_command(&mut self, qpn: u32, capsule: &[u8], now: Instant) {
        let Some(conn) = self.conns.get_mut(&qpn) else {
            return;
        };
        let a = conn.queue.handle(capsule, now);
        self.run_with_capsule(qpn, a, capsule, now);
    }

    /// Request slots taken: the commands in flight.
    fn in_use(&self) -> usize {
        self.reqs.len() - self.free.len()
    }

    fn run_with_capsule(&mut self, qpn: u32, mut a: Action, capsule: &[u8], now: Instant) {
        loop {
            match a {
                Action::Fetch {
                    cmd,
                    from: DataRef::InCapsule { offset, len },
                } => {
                    let s = 64 + offset as usize;
                    let data = capsule.get(s..s + len as usize).unwrap_or(&[]).to_vec();
                    let Some(conn) = self.conns.get_mut(&qpn) else {
                        return;
                    };
                    a = conn.queue.data_arrived(cmd, &data, now);
                }
                Action::Io(io) if matches!(io.data, Some(DataRef::InCapsule { .. })) => {
                    let Some(DataRef::InCapsule { offset, len }) = io.data else {
                        return;
                    };
                    let s = 64 + offset as usize;
                    let Some(mut buf) = self.buffer(len) else {
                        return self.fail(qpn, &io);
                    };
                    buf.as_mut_slice()
                        .copy_from_slice(capsule.get(s..s + len as usize).unwrap_or(&[]));
                    let Some(i) = self.take_req(qpn, Stage::Responding, None) else {
                        return self.fail(qpn, &io);
                    };
                    return self.submit_write(i, qpn, io, Some(buf));
                }
                other => return self.run(qpn, other, now),
            }
        }
    }

    fn run(&mut self, qpn: u32, a: Action, now: Instant) {
        match a {
            Action::Respond { cqe, data } => self.respond(qpn, cqe, data, None),
            Action::Fetch {
                cmd,
                from: DataRef::Keyed { addr, len, key, .. },
            } => {
                self.fetch(qpn, Stage::FetchForCore(cmd), addr, key, len);
            }
            Action::Fetch { .. } => {}
            Action::Io(io) => self.start_io(qpn, io),
            // An AER holds nothing while it waits.
            Action::Hold => {}
            Action::Disconnect { cqe, .. } => {
                if let Some(c) = cqe {
                    self.respond(qpn, c, None, None);
                }
                self.teardown(qpn, Cause::Controller, now);
            }
        }
    }

    /// Reads `len` bytes of host data at `addr`/`key` into a pool buffer held by a new
    /// request in `stage`; false when no buffer or request slot is free.
    fn fetch(&mut self, qpn: u32, stage: Stage, addr: u64, key: u32, len: u32) -> bool {
        let Some(mut buf) = self.buffer(len) else {
            return false;
        };
        let sge = [self.sge(&mut buf)];
        let Some(i) = self.take_req(qpn, stage, None) else {
            return false;
        };
        let posted = self.post(
            qpn,
            &[SendWr {
                wr_id: REQ_BASE + i as u64,
                op: SendOp::RdmaRead {
                    remote_addr: addr,
                    rkey: key,
                },
                sges: &sge,
                signaled: true,
                inline: false,
            }],
        );
        if !posted {
            // The QP is gone or was torn down: the command ends with it.
            self.end_req(i);
            return true;
        }
        self.counters.rdma_reads.fetch_add(1, Ordering::Relaxed);
        if let Some(r) = self.reqs[i].as_mut() {
            r.buf = Some(buf);
        }
        true
    }

    fn fail(&mut self, qpn: u32, io: &IoRequest) {
        let cqe = match self.conns.get_mut(&qpn) {
            Some(c) => c
                .queue
                .io_done(io, Err(nvmfd_blockdev::BlockError::QueueFull)),
            None => return,
        };
        self.respond(qpn, cqe, None, None);
    }

    fn dev_of(&self, qpn: u32, nsid: u32) -> Option<DevId> {
        let conn = self.conns.get(&qpn)?;
        let sub = conn.queue.controller()?.subsystem?;
        self.devs.get(&(sub, nsid)).copied()
    }

    fn start_io(&mut self, qpn: u32, io: IoRequest) {
        match (&io.op, io.data) {
            (IoOp::Write { len, .. }, Some(DataRef::Keyed { addr, key, .. })) => {
                if !self.fetch(qpn, Stage::FetchForWrite(io.clone()), addr, key, *len) {
                    self.fail(qpn, &io);
                }
            }
            _ => {
                let Some(i) = self.take_req(qpn, Stage::Responding, None) else {
                    return self.fail(qpn, &io);
                };
                self.submit_block(i, qpn, io, None);
            }
        }
    }

    fn submit_write(&mut self, i: usize, qpn: u32, io: IoRequest, buf: Option<DmaBuf>) {
        self.submit_block(i, qpn, io, buf);
    }

    /// Queues the block operations of `io` under request slot `i`.
    fn submit_block(&mut self, i: usize, qpn: u32, io: IoRequest, buf: Option<DmaBuf>) {
        let tag = i as u64;
        let one = [io.nsid];
        let nsids: &[u32] = match &io.op {
            IoOp::FlushAll { nsids } => nsids,
            _ => &one,
        };
        let mut left = 0u32;
        let mut failed = None;
        let mut buf = buf;
        for &nsid in nsids {
            let Some(dev) = self.dev_of(qpn, nsid) else {
                failed = Some(nvmfd_blockdev::BlockError::UnknownDevice);
                continue;
            };
            let r = match &io.op {
                IoOp::Read { offset, len } => match self.buffer(*len) {
                    Some(b) => self.engine.read(dev, *offset, b, tag).map(|_| 1),
                    None => Err(nvmfd_blockdev::Rejected {
                        error: nvmfd_blockdev::BlockError::QueueFull,
                        buf: None,
                    }),
                },
                IoOp::Write { offset, fua, .. } => match buf.take() {
                    Some(b) => self.engine.write(dev, *offset, b, *fua, tag).map(|_| 1),
                    None => Err(nvmfd_blockdev::Rejected {
                        error: nvmfd_blockdev::BlockError::QueueFull,
                        buf: None,
                    }),
                },
                IoOp::Flush | IoOp::FlushAll { .. } => self.engine.flush(dev, tag).map(|_| 1),
                IoOp::WriteZeroes { offset, len } => {
                    self.engine.write_zeroes(dev, *offset, *len, tag).map(|_| 1)
                }
                IoOp::Deallocate { ranges } => {
                    let mut n = 0;
                    let mut res = Ok(0);
                    for &(o, l) in ranges {
                        match self.engine.deallocate(dev, o, l, tag) {
                            Ok(()) => n += 1,
                            Err(e) => res = Err(e),
                        }
                    }
                    res.map(|_| n)
                }
            };
            match r {
                Ok(n) => left += n,
                Err(e) => failed = Some(e.error),
            }
        }
        if left == 0 {
            let cqe = match self.conns.get_mut(&qpn) {
                Some(c) => c.queue.io_done(&io, failed.map_or(Ok(0), Err)),
                None => return self.end_req(i),
            };
            self.end_req(i);
            return self.respond(qpn, cqe, None, None);
        }
        self.reqs[i] = Some(Req {
            qpn,
            stage: Stage::Io {
                req: io,
                left,
                failed,
            },
            buf: None,
        });
    }

    fn on_block_done(&mut self, c: Completion) {
        let i = usize::try_from(c.tag).unwrap_or(usize::MAX);
        let Some(Some(req)) = self.reqs.get_mut(i) else {
            return;
        };
        let Stage::Io { left, failed, .. } = &mut req.stage else {
            return;
        };
        *left -= 1;
        if let Err(e) = &c.result {
            *failed = Some(e.clone());
        }
        if c.op == nvmfd_blockdev::OpKind::Read {
            req.buf = c.buf;
        }
        if *left > 0 {
            return;
        }
        let Some(req) = self.reqs[i].take() else {
            return;
        };
        let Stage::Io {
            req: io, failed, ..
        } = req.stage
        else {
            return;
        };
        let qpn = req.qpn;
        let cqe = match self.conns.get_mut(&qpn) {
            Some(conn) => conn.queue.io_done(&io, failed.map_or(Ok(0), Err)),
            None => {
                self.free.push(i);
                return;
            }
        };
        let ok = cqe.status().is_success();
        if ok {
            match io.op {
                IoOp::Read { len, .. } => self
                    .counters
                    .read_bytes
                    .fetch_add(u64::from(len), Ordering::Relaxed),
                IoOp::Write { len, .. } => self
                    .counters
                    .write_bytes
                    .fetch_add(u64::from(len), Ordering::Relaxed),
                _ => 0,
            };
        }
        match (ok, &io.op, io.data, req.buf) {
            (true, IoOp::Read { .. }, Some(dest), Some(buf)) => {
                self.reqs[i] = Some(Req {
                    qpn,
                    stage: Stage::Responding,
                    buf: None,
                });
                self.respond(qpn, cqe, None, Some((i, buf, dest)));
            }
            _ => {
                self.free.push(i);
                self.respond(qpn, cqe, None, None);
            }
        }
    }

    /// Sends `cqe`, after `data` (bytes the core built) or `read` (a block read's buffer) is
    /// written to the host: one chain, only the SEND signaled.
    fn respond(
        &mut self,
        qpn: u32,
        cqe: Cqe,
        data: Option<(Vec<u8>, DataRef)>,
        read: Option<(usize, DmaBuf, DataRef)>,
    ) {
        if !cqe.status().is_success() {
            self.counters.command_errors.fetch_add(1, Ordering::Relaxed);
        }
        let resp = cqe;
        let resp_bytes = resp.as_bytes();
        let inline = [Sge {
            addr: resp_bytes.as_ptr() as u64,
            length: 16,
            lkey: 0,
        }];
        let (slot, mut buf, dest) = match (data, read) {
            (Some((bytes, dest)), _) => {
                let n = dest
                    .len()
                    .min(u32::try_from(bytes.len()).unwrap_or(u32::MAX));
                let Some(mut b) = self.buffer(n.max(1)) else {
                    return;
                };
                b.set_len(n as usize);
                b.as_mut_slice().copy_from_slice(&bytes[..n as usize]);
                let Some(i) = self.take_req(qpn, Stage::Responding, None) else {
                    return;
                };
                (Some(i), Some(b), Some(dest))
            }
            (None, Some((i, b, dest))) => (Some(i), Some(b), Some(dest)),
            (None, None) => (None, None, None),
        };
        let send_op = match dest.and_then(|d| d.invalidate_key()) {
            Some(rkey) => SendOp::SendWithInvalidate { rkey },
            None => SendOp::Send,
        };
        let wr_id = slot.map_or(NO_REQ, |i| REQ_BASE + i as u64);
        let send = SendWr {
            wr_id,
            op: send_op,
            sges: &inline,
            signaled: true,
            inline: true,
        };
        let posted = match (buf.as_mut(), dest) {
            (Some(b), Some(DataRef::Keyed { addr, key, .. })) if !b.is_empty() => {
                let sge = [self.sge(b)];
                let write = SendWr {
                    // Unsignaled: only an error (a flush) completes it, and that must not end
                    // the request slot, which the SEND's completion does.
                    wr_id: NO_REQ,
                    op: SendOp::RdmaWrite {
                        remote_addr: addr,
                        rkey: key,
                    },
                    sges: &sge,
                    signaled: false,
                    inline: false,
                };
                self.post(qpn, &[write, send])
            }
            _ => self.post(qpn, &[send]),
        };
        match (slot, buf) {
            // Not posted (the QP is gone or broken): no completion will end the slot.
            (Some(i), _) if !posted => self.end_req(i),
            (Some(i), Some(b)) => {
                if let Some(r) = self.reqs[i].as_mut() {
                    r.buf = Some(b);
                }
            }
            _ => {}
        }
    }

    /// Posts `wrs` on live connection `qpn`; false when nothing was posted.
    fn post(&mut self, qpn: u32, wrs: &[SendWr<'_>]) -> bool {
        let Some(c) = self.conns.get(&qpn) else {
            return false;
        };
        if let Err(e) = c.id.post_send(wrs) {
            // A send queue that refuses work is broken (or overflowed, which is the same to
            // its host): the QP goes, so that its host reconnects instead of waiting.
            self.counters.post_errors.fetch_add(1, Ordering::Relaxed);
            slog::warn!(self.log, "cannot post a send; tearing the QP down"; "qpn" => qpn, "error" => %e);
            self.teardown(qpn, Cause::QpError, Instant::now());
            return false;
        }
        self.sends_in_flight += wrs.iter().filter(|w| w.signaled).count();
        true
    }

    /// The device was removed: every QP is torn down (`Device`). Its async events are no
    /// longer routed, so the drains do not wait for LAST_WQE.
    pub fn device_removed(&mut self, now: Instant) {
        self.wait_last_wqe = false;
        self.teardown_all(Cause::Device, now);
    }
}
