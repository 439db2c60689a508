//! `soft`: a user-space RDMA provider with the semantics the daemon relies on, so that nvmfd
//! runs and is tested where there is no RDMA device.
//!
//! Everything of one [`Fabric`] (its devices, the memory registered on them, their queues and
//! connections) lives behind one lock, and work requests execute when posted, in the poster's
//! thread: the in-process wire is deterministic. What hardware checks, this checks: keys,
//! bounds, rights and protection domains on every access, QP states, SQ depth including
//! unsignaled work requests, inline limits, SRQ limits that fire once per arming, RNR with
//! `rnr_retry` (7 retries forever: the message waits for a receive), flush of outstanding work
//! requests when a QP enters the error state followed by `LAST_WQE_REACHED` on SRQ-attached
//! QPs, and CQ overflow.

pub mod cm;
mod event;
mod tcp;

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Mutex, MutexGuard};

pub use event::EventFd;

use crate::types::*;

/// The soft provider's limits (rxe's, where they matter).
pub const SOFT_ATTR: DeviceAttr = DeviceAttr {
    max_qp_wr: 16384,
    max_srq_wr: 16384,
    max_sge: 32,
    max_srq_sge: 27,
    max_cqe: 32767,
    max_qp_rd_atom: 128,
    max_qp_init_rd_atom: 128,
};

/// Largest inline send of the soft provider.
pub const SOFT_MAX_INLINE: u32 = 256;

/// What fault injection changes (seeded faults come with the fault-injection work).
#[derive(Clone, Copy, Debug, Default)]
pub struct Faults {
    /// Never send `LAST_WQE_REACHED` (behave as rxe and iWARP do).
    pub suppress_last_wqe: bool,
    /// Seed of the fabric's random faults: the same seed and the same operations give the
    /// same faults, so a failing run replays.
    pub seed: u64,
    /// Chance, per million, that a send work request's packets are lost beyond the
    /// transport's retries: it completes with `RetryExcErr` and its QP goes to ERR, as on a
    /// failed link.
    pub drop_per_million: u32,
    /// Chance, per million, that a send work request is held up on the wire: it and every
    /// later one of its QP (RC keeps order) run only at the fabric's next operation (a post or
    /// a poll anywhere on it).
    pub delay_per_million: u32,
    /// Chance, per million, that a send work request's QP fails fatally as it is posted:
    /// `QP_FATAL` is reported, the QP goes to ERR, the work request flushes.
    pub qp_fatal_per_million: u32,
    /// Chance, per million, that a SEND fails the SRQ of the QP it is for: `SRQ_ERR` is
    /// reported and every QP on that SRQ goes to ERR.
    pub srq_error_per_million: u32,
    /// Chance, per million, that a `post_send` chain is refused part-way, as a provider
    /// refuses the first work request it cannot take (`ENOMEM`, as from a full send queue):
    /// the work request at an index drawn from the seed and every one after it are not
    /// posted, those before it are and complete as usual, and the error's
    /// [`VerbsError::posted`] says where the chain stopped. The QP stays as it was.
    /// [`Fabric::inject_post_failure`] does the same once, at a chosen index.
    pub post_failure_per_million: u32,
    /// Destroying a QP drops its completions still in its CQs, as mlx5 does
    /// (`mlx5_destroy_qp` cleans the QP's entries out of its CQs). A receive completion so
    /// dropped takes its receive with it: the SRQ no longer has it and nobody is told, so a
    /// data path that destroys a QP before reaping its completions miscounts its SRQ.
    /// Counted by [`Fabric::destroy_drops`]. Without it, as on rxe, a destroyed QP's
    /// completions stay in the CQ to be polled.
    pub destroy_drops_completions: bool,
    /// The devices cannot post SEND_WITH_INVALIDATE (as a device without
    /// `IBV_DEVICE_MEM_MGT_EXTENSIONS`): `Device::supports_send_with_invalidate` says no and
    /// posting one is refused (`EINVAL`) at that work request.
    pub no_send_with_invalidate: bool,
}

/// Completions that destroying their QP dropped from a CQ
/// ([`Faults::destroy_drops_completions`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DestroyDrops {
    /// Receive completions (each took a receive of its SRQ with it).
    pub receives: u64,
    /// Send completions (successful or flushed).
    pub sends: u64,
}

/// A send work request held up by an injected delay (its data captured, as the wire has it).
struct DelayedWr {
    wr_id: u64,
    op: SendOp,
    sges: Vec<Sge>,
    signaled: bool,
    /// Inline data, copied at post time as inline data is.
    inline: Option<Vec<u8>>,
    opcode: WcOpcode,
}

struct MrEntry {
    dev: u32,
    pd: u32,
    addr: u64,
    len: u64,
    access: Access,
    valid: bool,
}

struct CqState {
    armed: bool,
    dev: u32,
    cap: usize,
    entries: VecDeque<Wc>,
    overflowed: bool,
    channel: Arc<EventFd>,
}

struct PostedRecv {
    wr_id: u64,
    sges: Vec<Sge>,
}

struct SrqState {
    dev: u32,
    pd: u32,
    max_wr: u32,
    max_sge: u32,
    limit: u32,
    recvs: VecDeque<PostedRecv>,
}

/// A SEND waiting for a receive at its destination (RNR, retried forever).
struct Pending {
    from_qpn: u32,
    wr_id: u64,
    signaled: bool,
    data: Vec<u8>,
    invalidate: Option<u32>,
    /// A SEND from a peer over TCP: (link, sequence) to acknowledge when it lands.
    remote: Option<(u32, u64)>,
}

/// A work request waiting for the responder's answer over TCP.
struct RemoteWr {
    wr_id: u64,
    signaled: bool,
    opcode: WcOpcode,
    /// Where an RDMA READ's data goes.
    read_sges: Vec<Sge>,
}

pub(crate) struct QpState_ {
    dev: u32,
    pd: u32,
    state: QpState,
    send_cq: u32,
    recv_cq: u32,
    srq: Option<u32>,
    pub(crate) caps: QpCaps,
    peer: Option<u32>,
    rnr_retry: u8,
    /// Unsignaled WRs completed since the last signaled completion: they hold SQ slots.
    unsignaled_run: u32,
    /// SENDs of this QP waiting at the peer for a receive.
    deferred: u32,
    /// Messages for this QP waiting for a receive.
    inbound: VecDeque<Pending>,
    last_wqe_sent: bool,
    /// The TCP link to the peer, when the peer is in another process.
    remote: Option<u32>,
    remote_pending: HashMap<u64, RemoteWr>,
    next_seq: u64,
    /// Send work requests held up by an injected delay, in order.
    delayed: VecDeque<DelayedWr>,
    /// RDMA READs this QP may have outstanding (the initiator depth its connection granted;
    /// 0 when not set). Exceeding it is counted, not refused: hardware queues the excess.
    read_depth: u32,
    /// Signaled RDMA READs posted whose completion has not been polled yet.
    reads_out: u32,
    /// Its RDMA READ depths, once `accept_with` set them (on both QPs of an in-process
    /// connection).
    depths: Option<ReadDepths>,
    /// The most `reads_out` has been.
    reads_peak: u32,
}

struct DevState {
    events: VecDeque<AsyncEvent>,
    async_fd: Arc<EventFd>,
    addr: std::net::IpAddr,
    /// PDs alive on it (the other objects are in the fabric's maps).
    pds: usize,
}

#[derive(Default)]
pub(crate) struct State {
    next_id: u32,
    devs: HashMap<u32, DevState>,
    mrs: HashMap<u32, MrEntry>,
    cqs: HashMap<u32, CqState>,
    srqs: HashMap<u32, SrqState>,
    pub(crate) qps: HashMap<u32, QpState_>,
    pub(crate) cm: cm::CmState,
    faults: Faults,
    rng: u64,
    /// Set while delayed work runs, so that it is not delayed again.
    releasing: bool,
    tcp: bool,
    links: HashMap<u32, tcp::LinkState>,
    removed: std::collections::HashSet<u32>,
    broken_srqs: std::collections::HashSet<u32>,
    /// Posts that took a QP's outstanding RDMA READs past its read depth.
    read_depth_exceeded: u64,
    /// Injected post failures: the next chain posted on QP (key) that is longer than the
    /// index (value) stops there.
    post_failures: HashMap<u32, usize>,
    /// Completions dropped by destroying their QP.
    destroy_drops: DestroyDrops,
}

/// One soft RDMA fabric: the devices that can reach each other in this process.
#[derive(Clone, Default)]
pub struct Fabric {
    pub(crate) state: Arc<Mutex<State>>,
}

impl std::fmt::Debug for Fabric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Fabric")
    }
}

impl Fabric {
    /// A new, empty fabric (in-process only).
    pub fn new() -> Fabric {
        Fabric::default()
    }

    /// A new fabric whose listeners also accept TCP connections and whose connections to
    /// addresses not in it go over TCP: the wire between processes.
    pub fn networked() -> Fabric {
        let f = Fabric::default();
        f.lock().tcp = true;
        f
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sets the faults in force (and reseeds the fault generator).
    pub fn set_faults(&self, f: Faults) {
        let mut s = self.lock();
        s.rng = f.seed | 1;
        s.faults = f;
    }

    /// Forces QP `qpn` into a fatal error: `QpFatal`, then the error path (flush,
    /// `LAST_WQE_REACHED`).
    pub fn inject_qp_fatal(&self, qpn: u32) {
        let mut s = self.lock();
        if let Some(dev) = s.qps.get(&qpn).map(|q| q.dev) {
            s.event(dev, AsyncEvent::QpFatal(qpn));
            s.qp_error(qpn);
        }
    }

    /// Makes the next `post_send` chain on QP `qpn` longer than `index` work requests stop
    /// at work request `index`, as a provider refuses the first one it cannot take (`ENOMEM`,
    /// as from a full send queue): the ones before it are posted and complete as usual, it
    /// and the ones after it are not, and the error's [`VerbsError::posted`] is `index`.
    /// Shorter chains post as usual and leave the injection armed.
    pub fn inject_post_failure(&self, qpn: u32, index: usize) {
        self.lock().post_failures.insert(qpn, index);
    }

    /// Completions that destroying their QP dropped so far
    /// ([`Faults::destroy_drops_completions`]).
    pub fn destroy_drops(&self) -> DestroyDrops {
        self.lock().destroy_drops
    }

    /// QP `qpn`'s RDMA READ depths, once its connection was accepted with
    /// `accept_with` (on both QPs of an in-process connection; a peer in another process
    /// does not learn them).
    pub fn read_depths(&self, qpn: u32) -> Option<ReadDepths> {
        self.lock().qps.get(&qpn).and_then(|q| q.depths)
    }

    /// Breaks SRQ `srq`: `SrqErr`, every QP on it goes to ERR, and posting to it fails.
    pub fn inject_srq_error(&self, srq: u32) {
        self.lock().srq_error(srq);
    }

    /// Removes a device as a hot-unplug would: `DeviceFatal`, every QP on it goes to ERR, CM
    /// IDs on it (its connections and, as with rdma_cm, the IDs listening on it) see
    /// `DeviceRemoval`, and nothing new can be created or listened on it until
    /// [`Fabric::restore_device`].
    pub fn remove_device(&self, dev: &Device) {
        let mut s = self.lock();
        let id = dev.inner.id;
        s.removed.insert(id);
        s.event(id, AsyncEvent::DeviceFatal);
        let qpns: Vec<u32> = s
            .qps
            .iter()
            .filter(|(_, q)| q.dev == id)
            .map(|(n, _)| *n)
            .collect();
        for q in &qpns {
            s.qp_error(*q);
        }
        let listening: Vec<u32> =
            s.cm.listening_ids()
                .filter(|(addr, _)| s.device_id_for(addr.ip()) == Some(id))
                .map(|(_, l)| l)
                .collect();
        s.cm.device_removed(&qpns, &listening);
    }

    /// Brings a removed device back (its port turns active again). As with a device that
    /// has no disassociate support (rxe, siw), whose removal waits until every user let go,
    /// it is refused (EBUSY) while objects made on it (PDs, MRs, CQs, SRQs, QPs) or IDs
    /// listening on it are still open.
    pub fn restore_device(&self, dev: &Device) -> Result<(), VerbsError> {
        let mut s = self.lock();
        let id = dev.inner.id;
        let listening =
            s.cm.listening_ids()
                .filter(|(addr, _)| s.device_id_for(addr.ip()) == Some(id))
                .count();
        if s.removed.contains(&id) && s.objects_on(id) + listening > 0 {
            return Err(VerbsError::Invalid {
                op: "restore_device",
                why: "objects made on the removed device or IDs listening on it are still open",
            });
        }
        s.removed.remove(&id);
        s.event(id, AsyncEvent::PortActive(1));
        Ok(())
    }

    /// Objects made on `dev` that are still open: PDs, MRs, CQs, SRQs and QPs.
    pub fn objects_on(&self, dev: &Device) -> usize {
        self.lock().objects_on(dev.inner.id)
    }

    /// QP `qpn`'s RDMA READ figures: (read depth granted, most READs it had outstanding).
    pub fn qp_reads(&self, qpn: u32) -> Option<(u32, u32)> {
        let s = self.lock();
        s.qps.get(&qpn).map(|q| (q.read_depth, q.reads_peak))
    }

    /// How many posts took a QP's outstanding RDMA READs past the depth its connection
    /// granted (hardware would queue them behind the READs in flight).
    pub fn read_depth_exceeded(&self) -> u64 {
        self.lock().read_depth_exceeded
    }

    /// QP `qpn` was accepted as a target accepts: it may have `initiator_depth` RDMA READs
    /// outstanding and serves none (responder resources 0); its in-process peer, the other
    /// way round.
    pub(crate) fn accepted_with(&self, qpn: u32, initiator_depth: u8) {
        let mut s = self.lock();
        let depth = u32::from(initiator_depth);
        let Some(q) = s.qps.get_mut(&qpn) else { return };
        q.read_depth = depth;
        q.depths = Some(ReadDepths {
            initiator: depth,
            responder: 0,
        });
        let peer = q.peer;
        if let Some(p) = peer.and_then(|p| s.qps.get_mut(&p)) {
            p.depths = Some(ReadDepths {
                initiator: 0,
                responder: depth,
            });
        }
    }

    /// The SRQs of the fabric, in creation order.
    pub fn srq_ids(&self) -> Vec<u32> {
        let s = self.lock();
        let mut v: Vec<u32> = s.srqs.keys().copied().collect();
        v.sort_unstable();
        v
    }

    /// The QPs attached to SRQ `srq`, in creation order (QP numbers only grow).
    pub fn srq_qps(&self, srq: u32) -> Vec<u32> {
        let s = self.lock();
        let mut v: Vec<u32> = s
            .qps
            .iter()
            .filter(|(_, q)| q.srq == Some(srq))
            .map(|(n, _)| *n)
            .collect();
        v.sort_unstable();
        v
    }

    /// SRQ `srq` as a test sees it: receives posted, and SENDs to its QPs waiting for one
    /// (RNR); `None` for an unknown SRQ.
    pub fn srq_backlog(&self, srq: u32) -> Option<(usize, usize)> {
        let s = self.lock();
        let posted = s.srqs.get(&srq)?.recvs.len();
        let waiting = s
            .qps
            .values()
            .filter(|q| q.srq == Some(srq))
            .map(|q| q.inbound.len())
            .sum();
        Some((posted, waiting))
    }

    /// Adds a device with IP address `addr` to this fabric (the address CM listeners bind to
    /// and connections resolve).
    pub fn add_device(&self, addr: std::net::IpAddr) -> Result<Device, VerbsError> {
        let fd = Arc::new(
            EventFd::new()
                .map_err(|e| VerbsError::os("eventfd", e.raw_os_error().unwrap_or(libc::EIO)))?,
        );
        let mut s = self.lock();
        let id = s.alloc_id();
        s.devs.insert(
            id,
            DevState {
                events: VecDeque::new(),
                async_fd: Arc::clone(&fd),
                addr,
                pds: 0,
            },
        );
        drop(s);
        Ok(Device {
            inner: Arc::new(DevInner {
                fabric: self.clone(),
                id,
                async_fd: fd,
            }),
        })
    }

    /// The device whose address is `addr` (none falls back to another, unlike the route a
    /// listener or a connection takes).
    pub fn device_at(&self, addr: std::net::IpAddr) -> Option<Device> {
        let found = self.lock().devs.iter().any(|(_, d)| d.addr == addr);
        found.then(|| self.device_for(addr)).flatten()
    }

    /// The device with address `addr`, or else the first device (an in-process fabric routes
    /// everything).
    pub(crate) fn device_for(&self, addr: std::net::IpAddr) -> Option<Device> {
        let s = self.lock();
        let id = s.device_id_for(addr)?;
        let fd = Arc::clone(&s.devs.get(&id)?.async_fd);
        drop(s);
        // Devices stay in their fabric for its life (device removal is a fault to inject).
        Some(Device {
            inner: Arc::new(DevInner {
                fabric: self.clone(),
                id,
                async_fd: fd,
            }),
        })
    }
}

impl State {
    /// The ID of the device with address `addr`, or else of the first device.
    fn device_id_for(&self, addr: std::net::IpAddr) -> Option<u32> {
        self.devs
            .iter()
            .find(|(_, d)| d.addr == addr)
            .or_else(|| self.devs.iter().min_by_key(|(id, _)| **id))
            .map(|(id, _)| *id)
    }

    /// Whether device `dev` was removed (and not restored).
    pub(crate) fn is_removed(&self, dev: u32) -> bool {
        self.removed.contains(&dev)
    }

    /// Objects made on device `dev` that are still open: PDs, MRs, CQs, SRQs and QPs.
    pub(crate) fn objects_on(&self, dev: u32) -> usize {
        self.devs.get(&dev).map_or(0, |d| d.pds)
            + self.mrs.values().filter(|m| m.dev == dev).count()
            + self.cqs.values().filter(|c| c.dev == dev).count()
            + self.srqs.values().filter(|q| q.dev == dev).count()
            + self.qps.values().filter(|q| q.dev == dev).count()
    }

    /// The fabric's seeded fault generator (xorshift64): a number below a million.
    /// SRQ `srq` fails: `SRQ_ERR`, and every QP on it goes to ERR.
    fn srq_error(&mut self, srq: u32) {
        let Some(dev) = self.srqs.get(&srq).map(|q| q.dev) else {
            return;
        };
        self.broken_srqs.insert(srq);
        self.event(dev, AsyncEvent::SrqErr(srq));
        let qpns: Vec<u32> = self
            .qps
            .iter()
            .filter(|(_, q)| q.srq == Some(srq))
            .map(|(n, _)| *n)
            .collect();
        for q in qpns {
            self.qp_error(q);
        }
    }

    /// Where a `post_send` chain of `len` work requests on QP `qpn` is to stop by an injected
    /// failure, if it is: an armed [`Fabric::inject_post_failure`] for a chain long enough
    /// (disarmed by it), else a seeded draw ([`Faults::post_failure_per_million`]).
    fn injected_post_failure(&mut self, qpn: u32, len: usize) -> Option<usize> {
        if self.post_failures.get(&qpn).is_some_and(|&i| i < len) {
            return self.post_failures.remove(&qpn);
        }
        if len == 0
            || self.faults.post_failure_per_million == 0
            || self.draw() >= u64::from(self.faults.post_failure_per_million)
        {
            return None;
        }
        usize::try_from(self.draw()).ok().map(|d| d % len)
    }

    fn draw(&mut self) -> u64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng % 1_000_000
    }

    /// Runs the work held up by injected delays, in order per QP.
    fn release_delayed(&mut self) {
        if self.releasing {
            return;
        }
        let qpns: Vec<u32> = self
            .qps
            .iter()
            .filter(|(_, q)| !q.delayed.is_empty())
            .map(|(n, _)| *n)
            .collect();
        self.releasing = true;
        for qpn in qpns {
            while let Some(d) = self.qps.get_mut(&qpn).and_then(|q| q.delayed.pop_front()) {
                if let Some(q) = self.qps.get_mut(&qpn) {
                    q.deferred = q.deferred.saturating_sub(1);
                }
                let inline_sge;
                let sges: &[Sge] = match &d.inline {
                    Some(data) => {
                        inline_sge = [Sge {
                            addr: data.as_ptr() as u64,
                            length: u32::try_from(data.len()).unwrap_or(u32::MAX),
                            lkey: 0,
                        }];
                        &inline_sge
                    }
                    None => &d.sges,
                };
                let w = SendWr {
                    wr_id: d.wr_id,
                    op: d.op,
                    sges,
                    signaled: d.signaled,
                    inline: d.inline.is_some(),
                };
                if self.qps.get(&qpn).is_some_and(|q| q.state == QpState::Err) {
                    self.complete_send(qpn, d.wr_id, d.signaled, WcStatus::WrFlushErr, d.opcode);
                } else {
                    execute(self, qpn, &w, d.opcode);
                }
            }
        }
        self.releasing = false;
    }

    fn alloc_id(&mut self) -> u32 {
        self.next_id += 1;
        // Keys, QP numbers and IDs share one space: (counter << 8) | 0x5f makes them look
        // like hardware keys and never zero.
        (self.next_id << 8) | 0x5f
    }

    fn event(&mut self, dev: u32, e: AsyncEvent) {
        if let Some(d) = self.devs.get_mut(&dev) {
            d.events.push_back(e);
            d.async_fd.signal();
        }
    }

    fn push_wc(&mut self, cq: u32, wc: Wc) {
        let mut overflow_dev = None;
        if let Some(c) = self.cqs.get_mut(&cq) {
            if c.entries.len() >= c.cap {
                if !c.overflowed {
                    c.overflowed = true;
                    overflow_dev = Some(c.dev);
                }
            } else {
                c.entries.push_back(wc);
                if c.armed {
                    // One notification per arming, as a completion channel gives.
                    c.armed = false;
                    c.channel.signal();
                }
            }
        }
        if let Some(dev) = overflow_dev {
            self.event(dev, AsyncEvent::CqErr(cq));
        }
    }

    /// Checks that `sges` lie in valid regions of `dev`/`pd` with `need` rights; total length.
    fn check_local(&self, dev: u32, pd: u32, sges: &[Sge], need: Access) -> Option<u64> {
        let mut total = 0u64;
        for s in sges {
            let m = self.mrs.get(&s.lkey)?;
            let end = s.addr.checked_add(u64::from(s.length))?;
            if !m.valid
                || m.dev != dev
                || m.pd != pd
                || s.addr < m.addr
                || end > m.addr + m.len
                || !m.access.contains(need)
            {
                return None;
            }
            total += u64::from(s.length);
        }
        Some(total)
    }

    /// Checks a remote access for the responder QP's PD.
    fn check_remote(
        &self,
        dev: u32,
        pd: u32,
        addr: u64,
        len: u64,
        rkey: u32,
        need: Access,
    ) -> bool {
        let Some(m) = self.mrs.get(&rkey) else {
            return false;
        };
        let Some(end) = addr.checked_add(len) else {
            return false;
        };
        m.valid
            && m.dev == dev
            && m.pd == pd
            && addr >= m.addr
            && end <= m.addr + m.len
            && m.access.contains(need)
    }

    /// Moves a QP to ERR: flush what waits, then LAST_WQE_REACHED for SRQ-attached QPs.
    fn qp_error(&mut self, qpn: u32) {
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        if q.state == QpState::Err {
            return;
        }
        q.state = QpState::Err;
        let (dev, srq, send_cq) = (q.dev, q.srq, q.send_cq);
        let inbound: Vec<Pending> = q.inbound.drain(..).collect();
        // Our SENDs waiting at the peer are flushed.
        let peer = q.peer;
        let mut flushed = Vec::new();
        if let Some(p) = peer.and_then(|p| self.qps.get_mut(&p)) {
            let mut keep = VecDeque::new();
            for m in p.inbound.drain(..) {
                if m.from_qpn == qpn {
                    flushed.push(m.wr_id);
                } else {
                    keep.push_back(m);
                }
            }
            p.inbound = keep;
        }
        for wr_id in flushed {
            self.push_wc(
                send_cq,
                Wc {
                    wr_id,
                    status: WcStatus::WrFlushErr,
                    opcode: WcOpcode::Send,
                    qp_num: qpn,
                    ..Wc::default()
                },
            );
        }
        let remote: Vec<RemoteWr> = self
            .qps
            .get_mut(&qpn)
            .map(|q| q.remote_pending.drain().map(|(_, w)| w).collect())
            .unwrap_or_default();
        for w in remote {
            self.push_wc(
                send_cq,
                Wc {
                    wr_id: w.wr_id,
                    status: WcStatus::WrFlushErr,
                    opcode: w.opcode,
                    qp_num: qpn,
                    ..Wc::default()
                },
            );
        }
        let delayed: Vec<DelayedWr> = self
            .qps
            .get_mut(&qpn)
            .map(|q| q.delayed.drain(..).collect())
            .unwrap_or_default();
        for d in delayed {
            self.push_wc(
                send_cq,
                Wc {
                    wr_id: d.wr_id,
                    status: WcStatus::WrFlushErr,
                    opcode: d.opcode,
                    qp_num: qpn,
                    ..Wc::default()
                },
            );
        }
        if let Some(q) = self.qps.get_mut(&qpn) {
            q.deferred = 0;
        }
        // Messages from the peer waiting for our receives: the peer's SENDs fail.
        for m in inbound {
            if let Some((link, seq)) = m.remote {
                self.send_frame(
                    link,
                    tcp::Frame::Ack {
                        seq,
                        status: tcp::status_code(WcStatus::RetryExcErr),
                    },
                );
                continue;
            }
            self.complete_send(
                m.from_qpn,
                m.wr_id,
                m.signaled,
                WcStatus::RetryExcErr,
                WcOpcode::Send,
            );
            self.qp_error(m.from_qpn);
        }
        if srq.is_some() && !self.faults.suppress_last_wqe {
            if let Some(q) = self.qps.get_mut(&qpn) {
                q.last_wqe_sent = true;
            }
            self.event(dev, AsyncEvent::QpLastWqeReached(qpn));
        }
    }

    /// Removes QP `qpn`'s completions from its CQs, as mlx5 does when a QP is destroyed.
    fn drop_completions_of(&mut self, qpn: u32) {
        let Some((send_cq, recv_cq)) = self.qps.get(&qpn).map(|q| (q.send_cq, q.recv_cq)) else {
            return;
        };
        let mut dropped = DestroyDrops::default();
        for cq in [send_cq, recv_cq] {
            if let Some(c) = self.cqs.get_mut(&cq) {
                c.entries.retain(|w| {
                    let ours = w.qp_num == qpn;
                    if ours && w.opcode == WcOpcode::Recv {
                        dropped.receives += 1;
                    } else if ours {
                        dropped.sends += 1;
                    }
                    !ours
                });
            }
            if send_cq == recv_cq {
                break;
            }
        }
        self.destroy_drops.receives += dropped.receives;
        self.destroy_drops.sends += dropped.sends;
    }

    fn complete_send(
        &mut self,
        qpn: u32,
        wr_id: u64,
        signaled: bool,
        status: WcStatus,
        opcode: WcOpcode,
    ) {
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        let cq = q.send_cq;
        // Errors always complete; a signaled success retires the unsignaled run before it.
        if status != WcStatus::Success || signaled {
            q.unsignaled_run = 0;
            self.push_wc(
                cq,
                Wc {
                    wr_id,
                    status,
                    opcode,
                    qp_num: qpn,
                    ..Wc::default()
                },
            );
        } else {
            q.unsignaled_run += 1;
        }
    }

    /// Delivers a message into the next receive of QP `dst`; false when there is none (RNR).
    ///
    /// A QP that is not ready to receive (ERR, or not yet RTR) takes no message: nothing of
    /// its SRQ is consumed and the sender's work request fails. So no receive completion is
    /// ever made for a QP in ERR: its receive completions in a CQ are those of messages that
    /// arrived before it entered ERR.
    fn deliver(&mut self, dst: u32, m: &Pending) -> Option<Result<(), ()>> {
        let q = self.qps.get(&dst)?;
        if !matches!(q.state, QpState::Rtr | QpState::Rts) {
            return Some(Err(()));
        }
        let (dev, pd, recv_cq) = (q.dev, q.pd, q.recv_cq);
        let srq_id = q.srq?;
        let srq = self.srqs.get_mut(&srq_id)?;
        let r = srq.recvs.pop_front()?;
        let remaining = u32::try_from(srq.recvs.len()).unwrap_or(u32::MAX);
        if srq.limit > 0 && remaining < srq.limit {
            srq.limit = 0; // one-shot: re-armed by modify
            let sdev = srq.dev;
            self.event(sdev, AsyncEvent::SrqLimitReached(srq_id));
        }
        let room = self.check_local(dev, pd, &r.sges, Access::LOCAL_WRITE);
        let fits = room.is_some_and(|room| room >= m.data.len() as u64);
        if !fits {
            let status = if room.is_none() {
                WcStatus::LocProtErr
            } else {
                WcStatus::LocLenErr
            };
            self.push_wc(
                recv_cq,
                Wc {
                    wr_id: r.wr_id,
                    status,
                    opcode: WcOpcode::Recv,
                    qp_num: dst,
                    ..Wc::default()
                },
            );
            self.qp_error(dst);
            return Some(Err(()));
        }
        scatter(&r.sges, &m.data);
        if let Some(k) = m.invalidate {
            if let Some(mr) = self.mrs.get_mut(&k) {
                mr.valid = false;
            }
        }
        let wc = Wc {
            wr_id: r.wr_id,
            status: WcStatus::Success,
            opcode: WcOpcode::Recv,
            byte_len: u32::try_from(m.data.len()).unwrap_or(u32::MAX),
            qp_num: dst,
            invalidated_rkey: m.invalidate,
        };
        self.push_wc(recv_cq, wc);
        Some(Ok(()))
    }

    /// Delivers what waits for receives on the QPs of SRQ `srq` (after a post).
    fn drain_inbound(&mut self, srq: u32) {
        let qpns: Vec<u32> = self
            .qps
            .iter()
            .filter(|(_, q)| q.srq == Some(srq) && !q.inbound.is_empty())
            .map(|(n, _)| *n)
            .collect();
        for dst in qpns {
            while let Some(m) = self.qps.get_mut(&dst).and_then(|q| q.inbound.pop_front()) {
                match self.deliver(dst, &m) {
                    None => {
                        if let Some(q) = self.qps.get_mut(&dst) {
                            q.inbound.push_front(m);
                        }
                        break;
                    }
                    Some(r) if m.remote.is_some() => {
                        let (link, seq) = m.remote.unwrap_or_default();
                        let status = if r.is_ok() {
                            0
                        } else {
                            tcp::status_code(WcStatus::RemInvReqErr)
                        };
                        self.send_frame(link, tcp::Frame::Ack { seq, status });
                    }
                    Some(r) => {
                        if let Some(src) = self.qps.get_mut(&m.from_qpn) {
                            src.deferred = src.deferred.saturating_sub(1);
                        }
                        let st = if r.is_ok() {
                            WcStatus::Success
                        } else {
                            WcStatus::RemInvReqErr
                        };
                        self.complete_send(m.from_qpn, m.wr_id, m.signaled, st, WcOpcode::Send);
                        if r.is_err() {
                            self.qp_error(m.from_qpn);
                        }
                    }
                }
            }
        }
    }
}

/// Copies `data` into the regions of `sges`, in order.
fn scatter(sges: &[Sge], data: &[u8]) {
    let mut at = 0;
    for s in sges {
        if at >= data.len() {
            break;
        }
        let n = (s.length as usize).min(data.len() - at);
        // SAFETY: `check_local` verified that addr..addr+length lies in a registered region
        // whose owner keeps it mapped while registered; like a NIC's DMA, the copy is raw.
        unsafe { std::ptr::copy(data[at..].as_ptr(), s.addr as *mut u8, n) };
        at += n;
    }
}

/// Reads the bytes of `sges`, in order.
fn gather(sges: &[Sge]) -> Vec<u8> {
    let mut out = Vec::with_capacity(sges.iter().map(|s| s.length as usize).sum());
    for s in sges {
        // SAFETY: as in `scatter` (the caller checked the SGEs or they are inline data that
        // the poster guarantees readable).
        let src = unsafe { std::slice::from_raw_parts(s.addr as *const u8, s.length as usize) };
        out.extend_from_slice(src);
    }
    out
}

struct DevInner {
    fabric: Fabric,
    id: u32,
    async_fd: Arc<EventFd>,
}

/// A device: the parent of PDs and CQs, with an async event queue. Clones share it.
#[derive(Clone)]
pub struct Device {
    inner: Arc<DevInner>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("soft::Device")
            .field("id", &self.inner.id)
            .finish()
    }
}

impl Device {
    fn fabric(&self) -> &Fabric {
        &self.inner.fabric
    }

    /// Limits.
    pub fn attr(&self) -> Result<DeviceAttr, VerbsError> {
        Ok(SOFT_ATTR)
    }

    /// Whether the device sends `QpLastWqeReached`: yes, unless the fabric's faults suppress
    /// it (as rxe and iWARP devices never send it).
    pub fn sends_last_wqe(&self) -> bool {
        !self.fabric().lock().faults.suppress_last_wqe
    }

    /// Whether the device can post SEND_WITH_INVALIDATE: yes, unless the fabric's faults say
    /// no ([`Faults::no_send_with_invalidate`]).
    pub fn supports_send_with_invalidate(&self) -> bool {
        !self.fabric().lock().faults.no_send_with_invalidate
    }

    /// Port `port`'s attributes (one active RoCE port, MTU 1024 as on rxe).
    pub fn port_attr(&self, port: u8) -> Result<PortAttr, VerbsError> {
        if port != 1 {
            return Err(VerbsError::os("query_port", libc::EINVAL));
        }
        Ok(PortAttr {
            active: true,
            active_mtu: 1024,
            gid_tbl_len: 2,
            link_layer: 2,
        })
    }

    /// GID `index` of port 1: index 1 is the IPv4-mapped address, as RoCE v2 on rxe has it.
    pub fn gid(&self, port: u8, index: u32) -> Result<[u8; 16], VerbsError> {
        let s = self.fabric().lock();
        let d = s
            .devs
            .get(&self.inner.id)
            .ok_or(VerbsError::os("query_gid", libc::ENODEV))?;
        match (port, index, d.addr) {
            (1, 1, std::net::IpAddr::V4(a)) => Ok(a.to_ipv6_mapped().octets()),
            (1, 1, std::net::IpAddr::V6(a)) => Ok(a.octets()),
            (1, 0, _) => Ok([0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]),
            _ => Err(VerbsError::os("query_gid", libc::EINVAL)),
        }
    }

    /// The pollable fd that turns readable when an async event is queued.
    pub fn async_fd(&self) -> RawFd {
        self.inner.async_fd.as_raw_fd()
    }

    /// The next async event, without blocking.
    pub fn next_event(&self) -> Option<AsyncEvent> {
        let mut s = self.fabric().lock();
        let d = s.devs.get_mut(&self.inner.id)?;
        let e = d.events.pop_front();
        if d.events.is_empty() {
            d.async_fd.clear();
        }
        e
    }

    /// A protection domain.
    pub fn alloc_pd(&self) -> Result<Pd, VerbsError> {
        if self.fabric().lock().removed.contains(&self.inner.id) {
            return Err(VerbsError::os("alloc_pd", libc::ENODEV));
        }
        let mut s = self.fabric().lock();
        let id = s.alloc_id();
        if let Some(d) = s.devs.get_mut(&self.inner.id) {
            d.pds += 1;
        }
        drop(s);
        Ok(Pd {
            fabric: self.fabric().clone(),
            dev: self.inner.id,
            id,
            _alive: Arc::new(PdAlive {
                fabric: self.fabric().clone(),
                dev: self.inner.id,
            }),
        })
    }

    /// A completion queue of `cqe` entries, with its completion channel.
    pub fn create_cq(&self, cqe: u32) -> Result<Cq, VerbsError> {
        if cqe == 0 || cqe > SOFT_ATTR.max_cqe {
            return Err(VerbsError::os("create_cq", libc::EINVAL));
        }
        let channel = Arc::new(
            EventFd::new()
                .map_err(|e| VerbsError::os("eventfd", e.raw_os_error().unwrap_or(libc::EIO)))?,
        );
        let mut s = self.fabric().lock();
        if s.removed.contains(&self.inner.id) {
            return Err(VerbsError::os("create_cq", libc::ENODEV));
        }
        let id = s.alloc_id();
        s.cqs.insert(
            id,
            CqState {
                armed: false,
                dev: self.inner.id,
                cap: cqe as usize,
                entries: VecDeque::new(),
                overflowed: false,
                channel: Arc::clone(&channel),
            },
        );
        Ok(Cq {
            fabric: self.fabric().clone(),
            id,
            channel,
        })
    }
}

/// A protection domain (clones name the same domain).
#[derive(Clone, Debug)]
pub struct Pd {
    fabric: Fabric,
    dev: u32,
    id: u32,
    /// Counts the domain on its device while a clone lives.
    _alive: Arc<PdAlive>,
}

/// One PD counted on its device (`State::objects_on`) until its last clone goes.
#[derive(Debug)]
struct PdAlive {
    fabric: Fabric,
    dev: u32,
}

impl Drop for PdAlive {
    fn drop(&mut self) {
        if let Some(d) = self.fabric.lock().devs.get_mut(&self.dev) {
            d.pds = d.pds.saturating_sub(1);
        }
    }
}

/// A registered memory region. [`Pd::alloc_mr`] makes one that owns its memory.
#[derive(Debug)]
pub struct Mr {
    fabric: Fabric,
    key: u32,
    addr: u64,
    len: usize,
    /// Memory the region owns (boxed: its address never moves).
    owned: Option<Box<[u8]>>,
}

impl Pd {
    /// Registers `len` bytes at `addr` with `access`.
    ///
    /// # Safety
    ///
    /// `addr..addr+len` must stay mapped and writable until the returned `Mr` is dropped.
    /// Peers read and write it at any time, as a NIC would by DMA: the owner must treat it as
    /// shared memory (no references held across accesses it does not order).
    pub unsafe fn reg_mr(
        &self,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<Mr, VerbsError> {
        let mut s = self.fabric.lock();
        let key = s.alloc_id();
        s.mrs.insert(
            key,
            MrEntry {
                dev: self.dev,
                pd: self.id,
                addr: addr as u64,
                len: len as u64,
                access,
                valid: true,
            },
        );
        Ok(Mr {
            fabric: self.fabric.clone(),
            key,
            addr: addr as u64,
            len,
            owned: None,
        })
    }

    /// Allocates `len` zeroed bytes and registers them.
    pub fn alloc_mr(&self, len: usize, access: Access) -> Result<Mr, VerbsError> {
        // Page-aligned: a page-sized receive SGE then never straddles two pages.
        let mut mem = vec![0u8; len + 4096].into_boxed_slice();
        let off = mem.as_ptr().align_offset(4096);
        // SAFETY: `off` < 4096, so `off + len` is within the allocation.
        let ptr = unsafe { mem.as_mut_ptr().add(off) };
        // SAFETY: the memory is owned by the returned Mr and freed only after deregistration.
        let mut mr = unsafe { self.reg_mr(ptr, len, access)? };
        mr.owned = Some(mem);
        Ok(mr)
    }

    /// A shared receive queue of `max_wr` receives of up to `max_sge` SGEs each.
    pub fn create_srq(&self, max_wr: u32, max_sge: u32) -> Result<Srq, VerbsError> {
        if max_wr == 0
            || max_wr > SOFT_ATTR.max_srq_wr
            || max_sge == 0
            || max_sge > SOFT_ATTR.max_srq_sge
        {
            return Err(VerbsError::os("create_srq", libc::EINVAL));
        }
        let mut s = self.fabric.lock();
        let id = s.alloc_id();
        s.srqs.insert(
            id,
            SrqState {
                dev: self.dev,
                pd: self.id,
                max_wr,
                max_sge,
                limit: 0,
                recvs: VecDeque::new(),
            },
        );
        Ok(Srq {
            fabric: self.fabric.clone(),
            id,
        })
    }

    /// An RC queue pair on `send_cq`/`recv_cq`, taking its receives from `srq`. (Connections
    /// create theirs on a CM ID: `cm::CmId::create_qp`.)
    pub(crate) fn create_qp(
        &self,
        send_cq: &Cq,
        recv_cq: &Cq,
        srq: &Srq,
        caps: QpCaps,
    ) -> Result<Qp, VerbsError> {
        if self
            .fabric
            .lock()
            .srqs
            .get(&srq.id)
            .is_none_or(|q| q.pd != self.id)
        {
            return Err(VerbsError::Invalid {
                op: "create_qp",
                why: "the SRQ belongs to another protection domain",
            });
        }
        if caps.max_send_wr == 0
            || caps.max_send_wr > SOFT_ATTR.max_qp_wr
            || caps.max_send_sge > SOFT_ATTR.max_sge
            || caps.max_inline_data > SOFT_MAX_INLINE
        {
            return Err(VerbsError::os("create_qp", libc::EINVAL));
        }
        let mut s = self.fabric.lock();
        let qpn = s.alloc_id();
        s.qps.insert(
            qpn,
            QpState_ {
                dev: self.dev,
                pd: self.id,
                state: QpState::Reset,
                send_cq: send_cq.id,
                recv_cq: recv_cq.id,
                srq: Some(srq.id),
                caps,
                peer: None,
                rnr_retry: 7,
                unsignaled_run: 0,
                deferred: 0,
                inbound: VecDeque::new(),
                last_wqe_sent: false,
                remote: None,
                remote_pending: HashMap::new(),
                next_seq: 0,
                delayed: VecDeque::new(),
                read_depth: 0,
                reads_out: 0,
                reads_peak: 0,
                depths: None,
            },
        );
        Ok(Qp {
            fabric: self.fabric.clone(),
            qpn,
        })
    }
}

impl Mr {
    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.key
    }
    /// Remote key.
    pub fn rkey(&self) -> u32 {
        self.key
    }
    /// Start address.
    pub fn addr(&self) -> u64 {
        self.addr
    }
    /// Length.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the length is zero.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// An SGE for `len` bytes at `offset`.
    pub fn sge(&self, offset: usize, len: u32) -> Sge {
        Sge {
            addr: self.addr + offset as u64,
            length: len,
            lkey: self.key,
        }
    }
    /// Copies bytes out of the region.
    pub fn read(&self, offset: usize, out: &mut [u8]) {
        assert!(offset + out.len() <= self.len, "read past the region");
        // SAFETY: in bounds (asserted) of memory kept mapped while registered; raw copy of
        // shared memory.
        unsafe {
            std::ptr::copy(
                (self.addr as *const u8).add(offset),
                out.as_mut_ptr(),
                out.len(),
            )
        };
    }
    /// Copies bytes into the region.
    pub fn write(&self, offset: usize, data: &[u8]) {
        assert!(offset + data.len() <= self.len, "write past the region");
        // SAFETY: as in `read`.
        unsafe {
            std::ptr::copy(
                data.as_ptr(),
                (self.addr as *mut u8).add(offset),
                data.len(),
            )
        };
    }
    /// Whether the key is still valid (a SEND with invalidate may have invalidated it).
    pub fn is_valid(&self) -> bool {
        self.fabric
            .lock()
            .mrs
            .get(&self.key)
            .is_some_and(|m| m.valid)
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        self.fabric.lock().mrs.remove(&self.key);
    }
}

/// A completion queue.
#[derive(Debug)]
pub struct Cq {
    fabric: Fabric,
    id: u32,
    channel: Arc<EventFd>,
}

impl Cq {
    /// Polls up to `out.len()` completions; an overflowed CQ is an error.
    pub fn poll(&self, out: &mut [Wc]) -> Result<usize, VerbsError> {
        let _scope = ProviderScope::enter();
        let mut s = self.fabric.lock();
        s.release_delayed();
        let c = s
            .cqs
            .get_mut(&self.id)
            .ok_or(VerbsError::os("poll_cq", libc::EINVAL))?;
        if c.overflowed {
            return Err(VerbsError::os("poll_cq", libc::EOVERFLOW));
        }
        let n = out.len().min(c.entries.len());
        for (slot, wc) in out.iter_mut().zip(c.entries.drain(..n)) {
            *slot = wc;
        }
        for wc in &out[..n] {
            if wc.opcode == WcOpcode::RdmaRead {
                if let Some(q) = s.qps.get_mut(&wc.qp_num) {
                    q.reads_out = q.reads_out.saturating_sub(1);
                }
            }
        }
        Ok(n)
    }

    /// Arms the completion channel: its fd turns readable at the next completion (once).
    pub fn req_notify(&self) -> Result<(), VerbsError> {
        let mut s = self.fabric.lock();
        let c = s
            .cqs
            .get_mut(&self.id)
            .ok_or(VerbsError::os("req_notify_cq", libc::EINVAL))?;
        c.armed = true;
        Ok(())
    }

    /// Takes the channel's notification, if one came; true when it did.
    pub fn ack_event(&self) -> bool {
        let mut v: u64 = 0;
        // SAFETY: reads at most 8 bytes into a live u64 from our eventfd (non-blocking).
        let n = unsafe { libc::read(self.channel.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
        n == 8
    }

    /// The completion channel's fd: readable once after `req_notify` and a completion.
    pub fn channel_fd(&self) -> RawFd {
        self.channel.as_raw_fd()
    }

    /// An ID, as async events name it.
    pub fn id(&self) -> u32 {
        self.id
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        self.fabric.lock().cqs.remove(&self.id);
    }
}

/// A shared receive queue.
#[derive(Debug)]
pub struct Srq {
    fabric: Fabric,
    id: u32,
}

impl Srq {
    /// Posts receives, in order, as a provider does: it stops at the first one with too many
    /// SGEs (`EINVAL`) or that finds the SRQ full (`ENOMEM`); those before it are posted, and
    /// the error's [`VerbsError::posted`] says how many.
    pub fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<(), VerbsError> {
        let _scope = ProviderScope::enter();
        let mut s = self.fabric.lock();
        if s.broken_srqs.contains(&self.id) {
            return Err(VerbsError::post("post_srq_recv", libc::EIO, 0));
        }
        let q =
            s.srqs
                .get_mut(&self.id)
                .ok_or(VerbsError::post("post_srq_recv", libc::EINVAL, 0))?;
        let mut stop = None;
        for (i, w) in wrs.iter().enumerate() {
            if w.sges.len() > q.max_sge as usize {
                stop = Some((i, libc::EINVAL));
                break;
            }
            if q.recvs.len() >= q.max_wr as usize {
                stop = Some((i, libc::ENOMEM));
                break;
            }
            q.recvs.push_back(PostedRecv {
                wr_id: w.wr_id,
                sges: w.sges.to_vec(),
            });
        }
        s.drain_inbound(self.id);
        match stop {
            Some((posted, errno)) => Err(VerbsError::post("post_srq_recv", errno, posted)),
            None => Ok(()),
        }
    }

    /// Arms the limit: `SrqLimitReached` fires once when fewer than `limit` receives remain.
    pub fn arm_limit(&self, limit: u32) -> Result<(), VerbsError> {
        let mut s = self.fabric.lock();
        let q = s
            .srqs
            .get_mut(&self.id)
            .ok_or(VerbsError::os("modify_srq", libc::EINVAL))?;
        if limit > q.max_wr {
            return Err(VerbsError::os("modify_srq", libc::EINVAL));
        }
        q.limit = limit;
        Ok(())
    }

    /// Attributes.
    pub fn query(&self) -> Result<SrqAttr, VerbsError> {
        let s = self.fabric.lock();
        let q = s
            .srqs
            .get(&self.id)
            .ok_or(VerbsError::os("query_srq", libc::EINVAL))?;
        Ok(SrqAttr {
            max_wr: q.max_wr,
            max_sge: q.max_sge,
            srq_limit: q.limit,
        })
    }

    /// Receives posted and not yet consumed.
    pub fn posted(&self) -> usize {
        self.fabric
            .lock()
            .srqs
            .get(&self.id)
            .map_or(0, |q| q.recvs.len())
    }

    /// An ID, as async events name it.
    pub fn id(&self) -> u32 {
        self.id
    }
}

impl Drop for Srq {
    fn drop(&mut self) {
        self.fabric.lock().srqs.remove(&self.id);
    }
}

/// An RC queue pair.
#[derive(Debug)]
pub struct Qp {
    pub(crate) fabric: Fabric,
    pub(crate) qpn: u32,
}

impl Qp {
    /// QP number.
    pub fn qpn(&self) -> u32 {
        self.qpn
    }

    /// State.
    pub fn state(&self) -> QpState {
        self.fabric
            .lock()
            .qps
            .get(&self.qpn)
            .map_or(QpState::Err, |q| q.state)
    }

    /// Sets how often a SEND meeting an empty receive queue is retried (7: forever).
    pub fn set_rnr_retry(&self, n: u8) {
        if let Some(q) = self.fabric.lock().qps.get_mut(&self.qpn) {
            q.rnr_retry = n.min(7);
        }
    }

    /// Moves the QP to ERR (flushing outstanding work, then LAST_WQE_REACHED).
    pub fn to_error(&self) {
        self.fabric.lock().qp_error(self.qpn);
    }

    /// Posts a chain of send work requests, in order, as a provider does: it stops at the
    /// first one it refuses (too many SGEs, inline data too long or on an RDMA READ,
    /// SEND_WITH_INVALIDATE where the device has none: `EINVAL`; no room left in the send
    /// queue as it was when the call began, counting unsignaled work requests not yet
    /// retired: `ENOMEM`; an injected failure, [`Fabric::inject_post_failure`] and
    /// [`Faults::post_failure_per_million`]: `ENOMEM`). Those before it are posted and
    /// complete as usual; the error's [`VerbsError::posted`] is its index. A chain longer
    /// than [`MAX_SEND_CHAIN`](crate::types::MAX_SEND_CHAIN), or a QP that cannot take work
    /// (before RTS), is refused whole.
    pub fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<(), VerbsError> {
        let _scope = ProviderScope::enter();
        let mut s = self.fabric.lock();
        s.release_delayed();
        let q = s
            .qps
            .get(&self.qpn)
            .ok_or(VerbsError::post("post_send", libc::EINVAL, 0))?;
        let flush = match q.state {
            QpState::Rts => false,
            QpState::Err => true,
            _ => return Err(VerbsError::post("post_send", libc::EINVAL, 0)),
        };
        if wrs.len() > crate::types::MAX_SEND_CHAIN {
            return Err(VerbsError::post("post_send", libc::EINVAL, 0));
        }
        let room =
            (q.caps.max_send_wr as usize).saturating_sub((q.unsignaled_run + q.deferred) as usize);
        let (max_sge, max_inline) = (q.caps.max_send_sge.max(1) as usize, q.caps.max_inline_data);
        let invalidate_ok = !s.faults.no_send_with_invalidate;
        let injected = s.injected_post_failure(self.qpn, wrs.len());
        let refused = wrs.iter().enumerate().find_map(|(i, w)| {
            let len: u64 = w.sges.iter().map(|s| u64::from(s.length)).sum();
            let errno = if i >= room {
                libc::ENOMEM
            } else if w.sges.len() > max_sge
                || (w.inline
                    && (len > u64::from(max_inline) || matches!(w.op, SendOp::RdmaRead { .. })))
                || (!invalidate_ok && matches!(w.op, SendOp::SendWithInvalidate { .. }))
            {
                libc::EINVAL
            } else if injected == Some(i) {
                libc::ENOMEM
            } else {
                return None;
            };
            Some((i, errno))
        });
        let wrs = &wrs[..refused.map_or(wrs.len(), |(i, _)| i)];
        let reads = wrs
            .iter()
            .filter(|w| w.signaled && matches!(w.op, SendOp::RdmaRead { .. }))
            .count();
        if reads > 0 {
            if let Some(q) = s.qps.get_mut(&self.qpn) {
                q.reads_out += u32::try_from(reads).unwrap_or(u32::MAX);
                q.reads_peak = q.reads_peak.max(q.reads_out);
                if q.read_depth > 0 && q.reads_out > q.read_depth {
                    s.read_depth_exceeded += 1;
                }
            }
        }
        for w in wrs {
            let opcode = match w.op {
                SendOp::Send | SendOp::SendWithInvalidate { .. } => WcOpcode::Send,
                SendOp::RdmaWrite { .. } => WcOpcode::RdmaWrite,
                SendOp::RdmaRead { .. } => WcOpcode::RdmaRead,
            };
            if flush || s.qps.get(&self.qpn).is_none_or(|q| q.state == QpState::Err) {
                s.complete_send(self.qpn, w.wr_id, w.signaled, WcStatus::WrFlushErr, opcode);
                continue;
            }
            execute(&mut s, self.qpn, w, opcode);
        }
        match refused {
            Some((posted, errno)) => Err(VerbsError::post("post_send", errno, posted)),
            None => Ok(()),
        }
    }
}

thread_local! {
    static PROVIDER_DEPTH: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Marks this thread as inside the soft provider's posting and polling calls, where the
/// wire's own bookkeeping (copies standing in for a NIC's DMA) allocates. A test counting a
/// data path's allocations leaves those out with [`in_provider`].
struct ProviderScope;

impl ProviderScope {
    fn enter() -> ProviderScope {
        let _ = PROVIDER_DEPTH.try_with(|d| d.set(d.get() + 1));
        ProviderScope
    }
}

impl Drop for ProviderScope {
    fn drop(&mut self) {
        let _ = PROVIDER_DEPTH.try_with(|d| d.set(d.get().saturating_sub(1)));
    }
}

/// Whether this thread is inside a soft provider post or poll call. Safe to call from a
/// global allocator (a const-initialized thread-local, no allocation).
pub fn in_provider() -> bool {
    PROVIDER_DEPTH.try_with(std::cell::Cell::get).unwrap_or(0) > 0
}

/// Runs one send WR on the in-process wire.
fn execute(s: &mut State, qpn: u32, w: &SendWr<'_>, opcode: WcOpcode) {
    let (dev, pd, peer, rnr_retry) = {
        let q = &s.qps[&qpn];
        (q.dev, q.pd, q.peer, q.rnr_retry)
    };
    let fail = |s: &mut State, st: WcStatus| {
        s.complete_send(qpn, w.wr_id, w.signaled, st, opcode);
        s.qp_error(qpn);
    };
    // The local side: gather (SEND/WRITE) needs readable regions, READ needs writable ones.
    let local_ok = w.inline || {
        let need = if matches!(w.op, SendOp::RdmaRead { .. }) {
            Access::LOCAL_WRITE
        } else {
            Access(0)
        };
        s.check_local(dev, pd, w.sges, need).is_some()
    };
    if !local_ok {
        return fail(s, WcStatus::LocProtErr);
    }
    let held = s.qps.get(&qpn).is_some_and(|q| !q.delayed.is_empty());
    if !s.releasing
        && (held
            || (s.faults.delay_per_million > 0 && s.draw() < u64::from(s.faults.delay_per_million)))
    {
        let inline = w.inline.then(|| gather(w.sges));
        if let Some(q) = s.qps.get_mut(&qpn) {
            q.deferred += 1;
            q.delayed.push_back(DelayedWr {
                wr_id: w.wr_id,
                op: w.op,
                sges: w.sges.to_vec(),
                signaled: w.signaled,
                inline,
                opcode,
            });
        }
        return;
    }
    if s.faults.qp_fatal_per_million > 0 && s.draw() < u64::from(s.faults.qp_fatal_per_million) {
        s.event(dev, AsyncEvent::QpFatal(qpn));
        return fail(s, WcStatus::WrFlushErr);
    }
    if s.faults.srq_error_per_million > 0
        && matches!(w.op, SendOp::Send | SendOp::SendWithInvalidate { .. })
        && s.draw() < u64::from(s.faults.srq_error_per_million)
    {
        if let Some(srq) = peer.and_then(|p| s.qps.get(&p)).and_then(|q| q.srq) {
            s.srq_error(srq);
        }
    }
    if s.faults.drop_per_million > 0 && s.draw() < u64::from(s.faults.drop_per_million) {
        return fail(s, WcStatus::RetryExcErr);
    }
    if let Some(link) = s.qps.get(&qpn).and_then(|q| q.remote) {
        let Some(q) = s.qps.get_mut(&qpn) else { return };
        q.next_seq += 1;
        let seq = q.next_seq;
        q.deferred += 1;
        let read_sges = if matches!(w.op, SendOp::RdmaRead { .. }) {
            w.sges.to_vec()
        } else {
            Vec::new()
        };
        q.remote_pending.insert(
            seq,
            RemoteWr {
                wr_id: w.wr_id,
                signaled: w.signaled,
                opcode,
                read_sges,
            },
        );
        let frame = match w.op {
            SendOp::Send => tcp::Frame::Send {
                seq,
                invalidate: None,
                data: gather(w.sges),
            },
            SendOp::SendWithInvalidate { rkey } => tcp::Frame::Send {
                seq,
                invalidate: Some(rkey),
                data: gather(w.sges),
            },
            SendOp::RdmaWrite { remote_addr, rkey } => tcp::Frame::Write {
                seq,
                addr: remote_addr,
                rkey,
                data: gather(w.sges),
            },
            SendOp::RdmaRead { remote_addr, rkey } => {
                let len: u32 = w.sges.iter().map(|g| g.length).sum();
                tcp::Frame::Read {
                    seq,
                    addr: remote_addr,
                    rkey,
                    len,
                }
            }
        };
        s.send_frame(link, frame);
        return;
    }
    let Some(peer) = peer.filter(|p| {
        s.qps
            .get(p)
            .is_some_and(|q| matches!(q.state, QpState::Rtr | QpState::Rts))
    }) else {
        return fail(s, WcStatus::RetryExcErr);
    };
    let (pdev, ppd) = (s.qps[&peer].dev, s.qps[&peer].pd);
    match w.op {
        SendOp::RdmaWrite { remote_addr, rkey } => {
            let data = gather(w.sges);
            if !s.check_remote(
                pdev,
                ppd,
                remote_addr,
                data.len() as u64,
                rkey,
                Access::REMOTE_WRITE,
            ) {
                return fail(s, WcStatus::RemAccessErr);
            }
            scatter(
                &[Sge {
                    addr: remote_addr,
                    length: u32::try_from(data.len()).unwrap_or(u32::MAX),
                    lkey: 0,
                }],
                &data,
            );
            s.complete_send(qpn, w.wr_id, w.signaled, WcStatus::Success, opcode);
        }
        SendOp::RdmaRead { remote_addr, rkey } => {
            let len: u64 = w.sges.iter().map(|g| u64::from(g.length)).sum();
            if !s.check_remote(pdev, ppd, remote_addr, len, rkey, Access::REMOTE_READ) {
                return fail(s, WcStatus::RemAccessErr);
            }
            let data = gather(&[Sge {
                addr: remote_addr,
                length: u32::try_from(len).unwrap_or(u32::MAX),
                lkey: 0,
            }]);
            scatter(w.sges, &data);
            s.complete_send(qpn, w.wr_id, w.signaled, WcStatus::Success, opcode);
        }
        SendOp::Send | SendOp::SendWithInvalidate { .. } => {
            let invalidate = match w.op {
                SendOp::SendWithInvalidate { rkey } => Some(rkey),
                _ => None,
            };
            let m = Pending {
                from_qpn: qpn,
                wr_id: w.wr_id,
                signaled: w.signaled,
                data: gather(w.sges),
                invalidate,
                remote: None,
            };
            let waiting = s.qps.get(&peer).is_some_and(|q| !q.inbound.is_empty());
            let r = if waiting { None } else { s.deliver(peer, &m) };
            match r {
                Some(Ok(())) => {
                    s.complete_send(qpn, w.wr_id, w.signaled, WcStatus::Success, opcode)
                }
                Some(Err(())) => fail(s, WcStatus::RemInvReqErr),
                None if rnr_retry >= 7 => {
                    // Receiver Not Ready, retried forever: the message waits for a receive.
                    if let Some(q) = s.qps.get_mut(&qpn) {
                        q.deferred += 1;
                    }
                    if let Some(p) = s.qps.get_mut(&peer) {
                        p.inbound.push_back(m);
                    }
                }
                None => fail(s, WcStatus::RnrRetryExcErr),
            }
        }
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        let mut s = self.fabric.lock();
        s.qp_error(self.qpn);
        s.post_failures.remove(&self.qpn);
        if s.faults.destroy_drops_completions {
            s.drop_completions_of(self.qpn);
        }
        if let Some(p) = s.qps.get(&self.qpn).and_then(|q| q.peer) {
            if let Some(pq) = s.qps.get_mut(&p) {
                pq.peer = None;
            }
        }
        s.qps.remove(&self.qpn);
    }
}

/// Connects two QPs as RC peers and moves both to RTS (what the CM's accept does).
pub(crate) fn link(s: &mut State, a: u32, b: u32) {
    for (x, y) in [(a, b), (b, a)] {
        if let Some(q) = s.qps.get_mut(&x) {
            q.peer = Some(y);
            q.state = QpState::Rts;
            q.last_wqe_sent = false;
        }
    }
}
