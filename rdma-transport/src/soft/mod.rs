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
mod device;
mod event;
mod exec;
mod queues;
mod state;
mod table;
mod tcp;

use std::collections::VecDeque;

// Every work request looks its QP, CQs, SRQ and memory regions up by ID: with a fast hasher.
use rustc_hash::FxHashMap as HashMap;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Mutex, MutexGuard};

use device::*;
pub use device::{Device, Mr, Pd};
pub use event::EventFd;
use exec::*;
pub use queues::{in_provider, Cq, Qp, Srq};
use state::*;
use table::Table;

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
    /// The devices are as an iWARP NIC (not siw): an RDMA READ's sink must be registered for
    /// remote write (`Device::rdma_read_sink_needs_remote_write` says so).
    pub read_sink_needs_remote_write: bool,
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
    /// reported and every QP on that SRQ goes to ERR. Over the TCP wire, the fabric of the
    /// receiving side draws it.
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
    /// Every `post_send` returns this long after its work requests went on the wire, as a
    /// provider that runs the transport in the caller's context (rxe) does. Zero: at once.
    pub post_send_delay: std::time::Duration,
    /// How this fabric answers an RDMA READ from a peer over TCP: with its data, or (a broken
    /// or hostile peer) with an acknowledgement alone or data one byte short.
    pub read_answer: ReadAnswer,
}

/// How a fabric answers an RDMA READ from a peer over TCP ([`Faults::read_answer`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ReadAnswer {
    /// The data read.
    #[default]
    Data,
    /// An acknowledgement with no data.
    AckOnly,
    /// The data read but its last byte.
    Short,
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

/// The seeded faults a fabric has injected since it was made, by kind ([`Fabric::injected`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Injected {
    /// Send work requests lost beyond retries ([`Faults::drop_per_million`]).
    pub drops: u64,
    /// Send work requests held up on the wire ([`Faults::delay_per_million`]).
    pub delays: u64,
    /// QPs failed fatally ([`Faults::qp_fatal_per_million`]).
    pub qp_fatals: u64,
    /// SRQs failed ([`Faults::srq_error_per_million`]).
    pub srq_errors: u64,
    /// `post_send` chains refused part-way ([`Faults::post_failure_per_million`]).
    pub post_failures: u64,
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
        s.rng = fastrand::Rng::with_seed(f.seed);
        s.seeded = f.delay_per_million > 0
            || f.qp_fatal_per_million > 0
            || f.srq_error_per_million > 0
            || f.drop_per_million > 0;
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

    /// Makes the next `post_send` on QP `qpn` post every work request of its chain and then
    /// fail (`EIO`), as rxe does when its doorbell fails with the requests already queued: the
    /// error's [`VerbsError::posted`] is the chain's length, and every request completes.
    pub fn inject_doorbell_failure(&self, qpn: u32) {
        self.lock().doorbell_failures.insert(qpn);
    }

    /// Holds back QP `qpn`'s send completions (successful or flushed, its drain markers
    /// too), as a device that writes them late does, until [`Fabric::release_held_completions`]:
    /// they then go to their CQ, even if the QP was destroyed meanwhile (as on rxe, which
    /// leaves a destroyed QP's completions in its CQ). Receive completions are not held, nor
    /// those of a later QP given the same number.
    pub fn hold_send_completions(&self, qpn: u32) {
        self.lock().holding.insert(qpn);
    }

    /// Stops holding send completions back and delivers those held, in order; how many.
    pub fn release_held_completions(&self) -> usize {
        let mut s = self.lock();
        s.holding.clear();
        let held = std::mem::take(&mut s.held);
        let n = held.len();
        for (cq, wc, frees) in held {
            s.deliver_wc(cq, wc, frees);
        }
        n
    }

    /// Delivers the first `n` send completions held (or as many as there are), in order,
    /// and goes on holding; how many were delivered.
    pub fn release_first_held_completions(&self, n: usize) -> usize {
        let mut s = self.lock();
        let n = n.min(s.held.len());
        let first: Vec<(u32, Wc, u32)> = s.held.drain(..n).collect();
        let holding = std::mem::take(&mut s.holding);
        for (cq, wc, frees) in first {
            s.deliver_wc(cq, wc, frees);
        }
        s.holding = holding;
        n
    }

    /// Delivers every send completion held but the first `keep`, in order, and goes on
    /// holding (those kept stay held: a device that never writes them); how many were
    /// delivered.
    pub fn release_held_completions_but_first(&self, keep: usize) -> usize {
        let mut s = self.lock();
        let keep = keep.min(s.held.len());
        let rest: Vec<(u32, Wc, u32)> = s.held.drain(keep..).collect();
        let holding = std::mem::take(&mut s.holding);
        let n = rest.len();
        for (cq, wc, frees) in rest {
            s.deliver_wc(cq, wc, frees);
        }
        s.holding = holding;
        n
    }

    /// Completions waiting to be polled in QP `qpn`'s send and receive CQs (counted once
    /// when they are one CQ); 0 for an unknown QP.
    pub fn completions_waiting(&self, qpn: u32) -> usize {
        let s = self.lock();
        let Some(q) = s.qps.get(&qpn) else { return 0 };
        let count = |cq: u32| s.cqs.get(&cq).map_or(0, |c| c.entries.len());
        if q.send_cq == q.recv_cq {
            count(q.send_cq)
        } else {
            count(q.send_cq) + count(q.recv_cq)
        }
    }

    /// Completions that destroying their QP dropped so far
    /// ([`Faults::destroy_drops_completions`]).
    pub fn destroy_drops(&self) -> DestroyDrops {
        self.lock().destroy_drops
    }

    /// The seeded faults injected so far, by kind (those injected by a direct call, such as
    /// [`Fabric::inject_qp_fatal`], are not counted).
    pub fn injected(&self) -> Injected {
        self.lock().injected
    }

    /// QP `qpn`'s RDMA READ depths, once its connection was accepted with
    /// `accept_with` (on both QPs of an in-process connection; a peer in another process
    /// does not learn them).
    pub fn read_depths(&self, qpn: u32) -> Option<ReadDepths> {
        self.lock().qps.get(&qpn).and_then(|q| q.depths)
    }

    /// The next `n` posts of receives to any SRQ fail part-way, as a provider out of memory
    /// for the moment does: the first receive of each is posted, the rest are refused with
    /// ENOMEM (the SRQ stays usable).
    pub fn fail_next_srq_posts(&self, n: u32) {
        self.lock().srq_post_failures = n;
    }

    /// Breaks SRQ `srq`: `SrqErr`, every QP on it goes to ERR, and posting to it fails.
    pub fn inject_srq_error(&self, srq: u32) {
        self.lock().srq_error(srq);
    }

    /// The QP connected to QP `qpn` in this process, if any.
    pub fn peer_of(&self, qpn: u32) -> Option<u32> {
        self.lock().qps.get(&qpn).and_then(|q| q.peer)
    }

    /// Breaks the CQ that QP `qpn` completes its receives to, as an overrun does: `CqErr`,
    /// and polling it fails from then on (its completions are lost). Whether one was broken.
    pub fn inject_cq_error(&self, qpn: u32) -> bool {
        let mut s = self.lock();
        let Some((dev, cq)) = s.qps.get(&qpn).map(|q| (q.dev, q.recv_cq)) else {
            return false;
        };
        match s.cqs.get_mut(&cq) {
            Some(c) if !c.overflowed => {
                c.overflowed = true;
                c.publish();
            }
            _ => return false,
        }
        s.event(dev, AsyncEvent::CqErr(cq));
        true
    }

    /// Makes every later poll of the CQ QP `qpn` receives on fail, with no async event (as a
    /// provider's poll fails on a CQE it cannot parse: mlx5's CQ_POLL_ERR). False when there
    /// is no such QP or its CQ failed already.
    pub fn fail_cq_polls(&self, qpn: u32) -> bool {
        let mut s = self.lock();
        let Some(cq) = s.qps.get(&qpn).map(|q| q.recv_cq) else {
            return false;
        };
        match s.cqs.get_mut(&cq) {
            Some(c) if !c.overflowed => {
                c.overflowed = true;
                c.publish();
                true
            }
            _ => false,
        }
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
        let (qpns, listening) = s.ids_on(id);
        for q in &qpns {
            s.qp_error(*q);
        }
        s.cm.device_event(&qpns, &listening, |token| cm::Ev::DeviceRemoval { token });
    }

    /// The device's address moves to another hardware address, as a bond's failover to
    /// another port moves it: the IDs on the device (its connections, and the IDs listening
    /// on it) see `AddrChange`. The device itself stays (a bond over ports of one device).
    pub fn change_address(&self, dev: &Device) {
        let mut s = self.lock();
        let (qpns, listening) = s.ids_on(dev.inner.id);
        s.cm.device_event(&qpns, &listening, |token| cm::Ev::AddrChange { token });
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

    /// The next QPs made take these numbers, in order, each where no live QP has it: as a
    /// device that hands a destroyed QP's number out again (mlx5 can, at once) does.
    pub fn reuse_qp_numbers(&self, qpns: &[u32]) {
        self.lock().reuse_qpns.extend(qpns);
    }

    /// The next `n` memory registrations anywhere on the fabric fail with `ENOMEM`, as when
    /// the locked-memory limit is reached.
    pub fn fail_registrations(&self, n: u32) {
        self.lock().fail_registrations = n;
    }

    /// Refuses the next `n` armings of an SRQ's limit (`ibv_modify_srq` failing, EIO).
    pub fn fail_limit_arms(&self, n: u32) {
        self.lock().fail_limit_arms = n;
    }

    /// Every registered memory region: (rkey, start address, length). What a peer that
    /// guesses keys could aim its RDMA READs and WRITEs at.
    pub fn memory_regions(&self) -> Vec<(u32, u64, u64)> {
        let s = self.lock();
        let mut v: Vec<_> = s
            .mrs
            .iter()
            .filter(|(_, m)| m.valid)
            .map(|(&k, m)| (k, m.addr, m.len))
            .collect();
        v.sort_unstable();
        v
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
        v.sort_unstable_by_key(|id| s.srqs.born(id));
        v
    }

    /// The QPs attached to SRQ `srq`, in creation order.
    pub fn srq_qps(&self, srq: u32) -> Vec<u32> {
        let s = self.lock();
        let mut v: Vec<u32> = s
            .qps
            .iter()
            .filter(|(_, q)| q.srq == Some(srq))
            .map(|(n, _)| *n)
            .collect();
        v.sort_unstable_by_key(|n| s.qps.born(n));
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

    /// TCP connections (links) this fabric holds, each with its reader and writer thread.
    pub fn tcp_links(&self) -> usize {
        self.lock().links.len()
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
