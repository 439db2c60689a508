//! The fabric's state behind its one lock: devices, memory regions, queues and their
//! work, and what happens to them (errors, events, completions).

use super::*;

/// A send work request held up by an injected delay (its data captured, as the wire has it).
pub(super) struct DelayedWr {
    pub(super) wr_id: u64,
    pub(super) op: SendOp,
    pub(super) sges: Vec<Sge>,
    pub(super) signaled: bool,
    /// Inline data, copied at post time as inline data is.
    pub(super) inline: Option<Vec<u8>>,
    pub(super) opcode: WcOpcode,
}

pub(super) struct MrEntry {
    pub(super) dev: u32,
    pub(super) pd: u32,
    pub(super) addr: u64,
    pub(super) len: u64,
    pub(super) access: Access,
    pub(super) valid: bool,
}

pub(super) struct CqState {
    pub(super) armed: bool,
    pub(super) dev: u32,
    pub(super) cap: usize,
    /// Completions, each with the send queue slots it frees when polled (0 for a receive).
    pub(super) entries: VecDeque<(Wc, u32)>,
    pub(super) overflowed: bool,
    pub(super) channel: Arc<EventFd>,
    /// What a poll would find, published for polls that take no lock: the number of
    /// entries, with [`OVERFLOWED`] set once overflowed. Stored after every change to
    /// `entries` or `overflowed`, under the fabric's lock.
    pub(super) ready: Arc<std::sync::atomic::AtomicU64>,
}

/// In [`CqState::ready`]: the CQ overflowed (polling it fails).
pub(super) const OVERFLOWED: u64 = 1 << 63;

impl CqState {
    /// Publishes the CQ's state for lock-free polls: after any change to its entries.
    pub(super) fn publish(&self) {
        let v = self.entries.len() as u64 | if self.overflowed { OVERFLOWED } else { 0 };
        self.ready.store(v, std::sync::atomic::Ordering::Release);
    }
}

pub(super) struct PostedRecv {
    pub(super) wr_id: u64,
    /// Inline up to five (a capsule's SGE and the four pages of in-capsule data nvmfd posts
    /// at most): posting a receive allocates nothing.
    pub(super) sges: smallvec::SmallVec<[Sge; 5]>,
}

pub(super) struct SrqState {
    pub(super) dev: u32,
    pub(super) pd: u32,
    pub(super) max_wr: u32,
    pub(super) max_sge: u32,
    pub(super) limit: u32,
    pub(super) recvs: VecDeque<PostedRecv>,
}

/// A SEND waiting for a receive at its destination (RNR, retried forever).
pub(super) struct Pending {
    pub(super) from_qpn: u32,
    pub(super) wr_id: u64,
    pub(super) signaled: bool,
    pub(super) data: Vec<u8>,
    pub(super) invalidate: Option<u32>,
    /// A SEND from a peer over TCP: (link, sequence) to acknowledge when it lands.
    pub(super) remote: Option<(u32, u64)>,
}

/// A work request waiting for the responder's answer over TCP.
pub(super) struct RemoteWr {
    pub(super) wr_id: u64,
    pub(super) signaled: bool,
    pub(super) opcode: WcOpcode,
    /// Where an RDMA READ's data goes.
    pub(super) read_sges: Vec<Sge>,
}

pub(crate) struct QpState_ {
    pub(super) dev: u32,
    pub(super) pd: u32,
    pub(super) state: QpState,
    pub(super) send_cq: u32,
    pub(super) recv_cq: u32,
    pub(super) srq: Option<u32>,
    pub(crate) caps: QpCaps,
    pub(super) peer: Option<u32>,
    pub(super) rnr_retry: u8,
    /// Unsignaled WRs completed since the last signaled completion: they hold SQ slots.
    pub(super) unsignaled_run: u32,
    /// Send WRs whose completion was made (with the unsignaled run it retired) and not yet
    /// polled: they hold SQ slots until it is, as on mlx5 (which frees them in `poll_cq`).
    pub(super) unpolled: u32,

    /// SENDs of this QP waiting at the peer for a receive.
    pub(super) deferred: u32,
    /// Of those, the ones on the in-process wire (RNR, retried): the QP's later work waits
    /// behind them in `delayed`, as a responder discards what follows a NAK'd packet and the
    /// requester resends from it (IB 9.7.5.2.8): nothing after it lands or completes first.
    pub(super) rnr_blocked: u32,
    /// Messages for this QP waiting for a receive.
    pub(super) inbound: VecDeque<Pending>,
    pub(super) last_wqe_sent: bool,
    /// The RTU of its accepting CM ID was lost (`Fabric::lose_rtus`): the first message it
    /// takes raises `CommEst`.
    pub(super) comm_est_pending: bool,
    /// The TCP link to the peer, when the peer is in another process.
    pub(super) remote: Option<u32>,
    /// By sequence number, which grows with each post: flushed in posting order.
    pub(super) remote_pending: std::collections::BTreeMap<u64, RemoteWr>,
    pub(super) next_seq: u64,
    /// Send work requests held up by an injected delay, in order.
    pub(super) delayed: VecDeque<DelayedWr>,
    /// RDMA READs this QP may have outstanding (the initiator depth its connection granted;
    /// 0 when not set). Exceeding it is counted, not refused: hardware queues the excess.
    pub(super) read_depth: u32,
    /// Signaled RDMA READs posted whose completion has not been polled yet.
    pub(super) reads_out: u32,
    /// Its RDMA READ depths, once `accept_with` set them (on both QPs of an in-process
    /// connection).
    pub(super) depths: Option<ReadDepths>,
    /// The most `reads_out` has been.
    pub(super) reads_peak: u32,
}

pub(super) struct DevState {
    pub(super) events: VecDeque<AsyncEvent>,
    pub(super) async_fd: Arc<EventFd>,
    pub(super) addr: std::net::IpAddr,
    /// PDs alive on it (the other objects are in the fabric's maps).
    pub(super) pds: usize,
}

#[derive(Default)]
pub(crate) struct State {
    pub(super) next_id: u32,
    /// The counter of [`State::alloc_id`]'s IDs (24 bits of it are used).
    pub(super) next_object: u32,
    /// The IDs of the protection domains alive (the other objects `alloc_id` numbers are
    /// keys of the maps below).
    pub(super) live_pds: std::collections::HashSet<u32>,
    pub(super) devs: HashMap<u32, DevState>,
    pub(super) mrs: Table<MrEntry>,
    pub(super) cqs: Table<CqState>,
    pub(super) srqs: Table<SrqState>,
    pub(crate) qps: Table<QpState_>,
    pub(crate) cm: cm::CmState,
    pub(super) faults: Faults,
    /// Some seeded fault of `faults` is set (a chance above 0): a send draws them only then.
    pub(super) seeded: bool,
    pub(super) rng: fastrand::Rng,
    /// Set while delayed work runs, so that it is not delayed again.
    pub(super) releasing: bool,
    /// Set when a work request is held up by an injected delay, cleared when none is: a
    /// poll that finds its CQ empty takes the lock anyway while it is set, to run the held
    /// work (shared with each CQ handle).
    pub(super) delayed_any: Arc<std::sync::atomic::AtomicBool>,
    /// Set when a message is put to wait for a receive (`inbound`), cleared when none waits:
    /// a post of receives looks for waiting messages only while it is set.
    pub(super) inbound_any: bool,
    pub(super) tcp: bool,
    pub(super) links: HashMap<u32, tcp::LinkState>,
    pub(super) removed: std::collections::HashSet<u32>,
    pub(super) broken_srqs: std::collections::HashSet<u32>,
    /// Posts of receives still to fail part-way (`Fabric::fail_next_srq_posts`).
    pub(super) srq_post_failures: u32,
    /// Posts that took a QP's outstanding RDMA READs past its read depth.
    pub(super) read_depth_exceeded: u64,
    /// Injected post failures: the next chain posted on QP (key) that is longer than the
    /// index (value) stops there.
    pub(super) post_failures: HashMap<u32, usize>,
    /// QPs whose next `post_send` posts every request and then fails, as rxe's doorbell can.
    pub(super) doorbell_failures: std::collections::HashSet<u32>,
    /// Completions dropped by destroying their QP.
    pub(super) destroy_drops: DestroyDrops,
    /// QP numbers the next QPs made take, in order, where free ([`Fabric::reuse_qp_numbers`]).
    pub(super) reuse_qpns: std::collections::VecDeque<u32>,
    /// Registrations still to refuse ([`Fabric::fail_registrations`]).
    pub(super) fail_registrations: u32,
    /// SRQ limit armings still to refuse ([`Fabric::fail_limit_arms`]).
    pub(super) fail_limit_arms: u32,
    /// Seeded faults injected, by kind.
    pub(super) injected: super::Injected,
    /// Async events read from the fabric's devices ([`super::Device::next_numbered_event`]).
    pub(super) events_read: u64,
    /// QPs whose send completions are held back ([`Fabric::hold_send_completions`]).
    pub(super) holding: std::collections::HashSet<u32>,
    /// The send completions held back, with their CQ, in the order they came.
    pub(super) held: Vec<(u32, Wc, u32)>,
}

impl State {
    /// The ID of the device with address `addr`, or else of the first device.
    /// The QPs on device `dev`, and the IDs listening on it.
    pub(super) fn ids_on(&self, dev: u32) -> (Vec<u32>, Vec<u32>) {
        let qpns = self
            .qps
            .iter()
            .filter(|(_, q)| q.dev == dev)
            .map(|(n, _)| *n)
            .collect();
        let listening = self
            .cm
            .listening_ids()
            .filter(|(addr, _)| self.device_id_for(addr.ip()) == Some(dev))
            .map(|(_, l)| l)
            .collect();
        (qpns, listening)
    }

    pub(super) fn device_id_for(&self, addr: std::net::IpAddr) -> Option<u32> {
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

    /// SRQ `srq` fails: `SRQ_ERR`, and every QP on it goes to ERR.
    pub(super) fn srq_error(&mut self, srq: u32) {
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
    pub(super) fn injected_post_failure(&mut self, qpn: u32, len: usize) -> Option<usize> {
        if self.post_failures.get(&qpn).is_some_and(|&i| i < len) {
            return self.post_failures.remove(&qpn);
        }
        if len == 0
            || self.faults.post_failure_per_million == 0
            || self.draw() >= u64::from(self.faults.post_failure_per_million)
        {
            return None;
        }
        self.injected.post_failures += 1;
        usize::try_from(self.draw()).ok().map(|d| d % len)
    }

    /// The fabric's seeded fault generator: a number below a million.
    pub(super) fn draw(&mut self) -> u64 {
        self.rng.u64(0..1_000_000)
    }

    /// Runs the work held up by injected delays, in order per QP.
    pub(super) fn release_delayed(&mut self) {
        // (Checked first: looking through every QP on each post and poll cost the emulation
        // in proportion to the QPs of the fabric.)
        if self.releasing || !self.delayed_any.load(std::sync::atomic::Ordering::Relaxed) {
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
            while let Some(d) = self
                .qps
                .get_mut(&qpn)
                .filter(|q| q.rnr_blocked == 0)
                .and_then(|q| q.delayed.pop_front())
            {
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
                    inline: d.inline.as_deref(),
                };
                if self.qps.get(&qpn).is_some_and(|q| q.state == QpState::Err) {
                    self.complete_send(qpn, d.wr_id, d.signaled, WcStatus::WrFlushErr, d.opcode);
                } else {
                    execute(self, qpn, &w, d.opcode);
                }
            }
        }
        self.releasing = false;
        if self.qps.values().all(|q| q.delayed.is_empty()) {
            self.delayed_any
                .store(false, std::sync::atomic::Ordering::Release);
        }
    }

    /// A variant for a new QP, CQ, SRQ or memory region's ID ([`Table`]): the low byte of
    /// the counter IDs come from.
    pub(super) fn variant(&mut self) -> u8 {
        self.next_id = self.next_id.wrapping_add(1);
        self.next_id.to_le_bytes()[0]
    }

    /// An ID for a device, PD, CM ID, CM channel or link: `(counter << 8) | 0x5f`, never
    /// zero, and never one of those alive. (QPs, CQs, SRQs and memory regions have IDs of
    /// their own tables, [`Table`].) The counter has 24 bits: a peer making and dropping
    /// connections goes round it in about 16.7 million of them, and an ID still held (a
    /// long-lived connection's link, a PD made at start) is then skipped, not given again.
    pub(super) fn alloc_id(&mut self) -> u32 {
        loop {
            self.next_object = self.next_object.wrapping_add(1) & 0x00ff_ffff;
            if self.next_object == 0 {
                continue;
            }
            let id = (self.next_object << 8) | 0x5f;
            if !self.devs.contains_key(&id)
                && !self.links.contains_key(&id)
                && !self.live_pds.contains(&id)
                && !self.cm.ids.contains_key(&id)
                && !self.cm.channels.contains_key(&id)
            {
                return id;
            }
        }
    }

    /// Removes device `dev`'s unread async events that `about` picks (those of a destroyed
    /// object, whose ID may be given out again).
    pub(super) fn forget_events(&mut self, dev: u32, about: impl Fn(&AsyncEvent) -> bool) {
        if let Some(d) = self.devs.get_mut(&dev) {
            d.events.retain(|e| !about(e));
            if d.events.is_empty() {
                d.async_fd.clear();
            }
        }
    }

    pub(super) fn event(&mut self, dev: u32, e: AsyncEvent) {
        if let Some(d) = self.devs.get_mut(&dev) {
            d.events.push_back(e);
            d.async_fd.signal();
        }
    }

    pub(super) fn push_wc(&mut self, cq: u32, wc: Wc) {
        // A send completion frees its WR's slot, and those of the unsignaled run before it,
        // once it is polled.
        let mut frees = 0;
        if wc.opcode != WcOpcode::Recv {
            if let Some(q) = self.qps.get_mut(&wc.qp_num) {
                frees = 1 + std::mem::take(&mut q.unsignaled_run);
                q.unpolled += frees;
            }
        }
        if !self.holding.is_empty()
            && wc.opcode != WcOpcode::Recv
            && self.holding.contains(&wc.qp_num)
        {
            self.held.push((cq, wc, frees));
            return;
        }
        self.deliver_wc(cq, wc, frees);
    }

    /// Writes completion `wc` (freeing `frees` send queue slots when polled) into CQ `cq`.
    pub(super) fn deliver_wc(&mut self, cq: u32, wc: Wc, frees: u32) {
        let mut overflow_dev = None;
        if let Some(c) = self.cqs.get_mut(&cq) {
            if c.entries.len() >= c.cap {
                if !c.overflowed {
                    c.overflowed = true;
                    c.publish();
                    overflow_dev = Some(c.dev);
                }
            } else {
                c.entries.push_back((wc, frees));
                c.publish();
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
    pub(super) fn check_local(&self, dev: u32, pd: u32, sges: &[Sge], need: Access) -> Option<u64> {
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
    pub(super) fn check_remote(
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
    pub(super) fn qp_error(&mut self, qpn: u32) {
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
            .map(|q| {
                std::mem::take(&mut q.remote_pending)
                    .into_values()
                    .collect()
            })
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
            q.rnr_blocked = 0;
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
    pub(super) fn drop_completions_of(&mut self, qpn: u32) {
        let Some((send_cq, recv_cq)) = self.qps.get(&qpn).map(|q| (q.send_cq, q.recv_cq)) else {
            return;
        };
        let mut dropped = DestroyDrops::default();
        for cq in [send_cq, recv_cq] {
            if let Some(c) = self.cqs.get_mut(&cq) {
                c.entries.retain(|(w, _)| {
                    let ours = w.qp_num == qpn;
                    if ours && w.opcode == WcOpcode::Recv {
                        dropped.receives += 1;
                    } else if ours {
                        dropped.sends += 1;
                    }
                    !ours
                });
                c.publish();
            }
            if send_cq == recv_cq {
                break;
            }
        }
        self.destroy_drops.receives += dropped.receives;
        self.destroy_drops.sends += dropped.sends;
    }
}
