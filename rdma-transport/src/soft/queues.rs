//! Completion queues, shared receive queues and queue pairs.

use super::*;

/// A completion queue.
#[derive(Debug)]
pub struct Cq {
    pub(super) fabric: Fabric,
    pub(super) id: u32,
    pub(super) channel: Arc<EventFd>,
    /// The CQ's published state ([`CqState::ready`]).
    pub(super) ready: Arc<std::sync::atomic::AtomicU64>,
    /// The fabric's [`State::delayed_any`].
    pub(super) delayed_any: Arc<std::sync::atomic::AtomicBool>,
}

impl Cq {
    /// Polls up to `out.len()` completions; an overflowed CQ is an error.
    ///
    /// An empty CQ is seen without the fabric's lock, as a NIC's CQ is read from memory: a
    /// poller spinning on it does not hold up the other side's posts.
    pub fn poll(&self, out: &mut [Wc]) -> Result<usize, VerbsError> {
        use std::sync::atomic::Ordering;
        if self.ready.load(Ordering::Acquire) == 0 && !self.delayed_any.load(Ordering::Acquire) {
            return Ok(0);
        }
        let _scope = ProviderScope::enter();
        let mut s = self.fabric.lock();
        s.release_delayed();
        let st = &mut *s;
        let c = st
            .cqs
            .get_mut(&self.id)
            .ok_or(VerbsError::os("poll_cq", libc::EINVAL))?;
        if c.overflowed {
            return Err(VerbsError::os("poll_cq", libc::EOVERFLOW));
        }
        let n = out.len().min(c.entries.len());
        for (slot, (wc, frees)) in out.iter_mut().zip(c.entries.drain(..n)) {
            *slot = wc;
            if wc.opcode == WcOpcode::Recv {
                continue;
            }
            if let Some(q) = st.qps.get_mut(&wc.qp_num) {
                if wc.opcode == WcOpcode::RdmaRead {
                    q.reads_out = q.reads_out.saturating_sub(1);
                }
                // Its send queue slots come free now that it is polled, as mlx5 frees them.
                q.unpolled = q.unpolled.saturating_sub(frees);
            }
        }
        c.publish();
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
        let mut s = self.fabric.lock();
        let id = self.id;
        if let Some(c) = s.cqs.remove(&id) {
            // Nothing names it any more: the QPs still on it complete into no CQ (0 is no
            // ID), its held completions and unread events go, so that a CQ given its ID
            // later gets none of them.
            for q in s.qps.values_mut() {
                if q.send_cq == id {
                    q.send_cq = 0;
                }
                if q.recv_cq == id {
                    q.recv_cq = 0;
                }
            }
            s.held.retain(|(cq, _, _)| *cq != id);
            s.forget_events(c.dev, |e| *e == AsyncEvent::CqErr(id));
        }
    }
}

/// Takes one from a count of injected failures: whether there was one.
fn s_fail(count: &mut u32) -> bool {
    let fail = *count > 0;
    *count = count.saturating_sub(1);
    fail
}

/// A shared receive queue.
#[derive(Debug)]
pub struct Srq {
    pub(super) fabric: Fabric,
    pub(super) id: u32,
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
        let mut stop = None;
        // An injected transient failure: the first receive is posted, the rest are not.
        let fail_at = (s_fail(&mut s.srq_post_failures)).then_some(1.min(wrs.len()));
        let q =
            s.srqs
                .get_mut(&self.id)
                .ok_or(VerbsError::post("post_srq_recv", libc::EINVAL, 0))?;
        for (i, w) in wrs.iter().enumerate() {
            if fail_at == Some(i) {
                stop = Some((i, libc::ENOMEM));
                break;
            }
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
                sges: smallvec::SmallVec::from_slice(w.sges),
            });
        }
        s.drain_inbound(self.id);
        // Work held behind a SEND that has now landed goes on.
        s.release_delayed();
        match stop {
            Some((posted, errno)) => Err(VerbsError::post("post_srq_recv", errno, posted)),
            None => Ok(()),
        }
    }

    /// Arms the limit: `SrqLimitReached` fires once when fewer than `limit` receives remain.
    pub fn arm_limit(&self, limit: u32) -> Result<(), VerbsError> {
        let mut s = self.fabric.lock();
        if s.fail_limit_arms > 0 {
            s.fail_limit_arms -= 1;
            return Err(VerbsError::os("modify_srq", libc::EIO));
        }
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
        let mut s = self.fabric.lock();
        let id = self.id;
        if let Some(q) = s.srqs.remove(&id) {
            // As for a CQ: the QPs still on it take receives from no SRQ (0 is no ID, and
            // they still count as SRQ-attached), and its state and unread events go.
            for qp in s.qps.values_mut() {
                if qp.srq == Some(id) {
                    qp.srq = Some(0);
                }
            }
            s.broken_srqs.remove(&id);
            s.forget_events(
                q.dev,
                |e| matches!(e, AsyncEvent::SrqErr(x) | AsyncEvent::SrqLimitReached(x) if *x == id),
            );
        }
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
        let room = (q.caps.max_send_wr as usize)
            .saturating_sub((q.unsignaled_run + q.deferred + q.unpolled) as usize);
        let (max_sge, max_inline) = (q.caps.max_send_sge.max(1) as usize, q.caps.max_inline_data);
        let invalidate_ok = !s.faults.no_send_with_invalidate;
        let injected = s.injected_post_failure(self.qpn, wrs.len());
        let refused = wrs.iter().enumerate().find_map(|(i, w)| {
            let errno = if i >= room {
                libc::ENOMEM
            } else if w.sges.len() > max_sge
                || w.inline.is_some_and(|d| {
                    d.len() > max_inline as usize || matches!(w.op, SendOp::RdmaRead { .. })
                })
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
            // Inline data goes on as one SGE over the borrowed bytes, read during this call.
            let inline_sge;
            let normalized;
            let w = match w.inline {
                Some(d) => {
                    inline_sge = [Sge {
                        addr: d.as_ptr() as u64,
                        length: u32::try_from(d.len()).unwrap_or(u32::MAX),
                        lkey: 0,
                    }];
                    normalized = SendWr {
                        sges: &inline_sge,
                        ..*w
                    };
                    &normalized
                }
                None => w,
            };
            match s.qps.get(&self.qpn) {
                Some(q) if !flush && q.state != QpState::Err => {
                    let from = Sender::of(q);
                    execute_as(&mut s, self.qpn, from, w, opcode);
                }
                _ => s.complete_send(self.qpn, w.wr_id, w.signaled, WcStatus::WrFlushErr, opcode),
            }
        }
        let delay = s.faults.post_send_delay;
        // (Checked for emptiness first: hashing on every post would cost the emulation.)
        let doorbell = refused.is_none()
            && !s.doorbell_failures.is_empty()
            && s.doorbell_failures.remove(&self.qpn);
        drop(s);
        if !delay.is_zero() {
            std::thread::sleep(delay);
        }
        match refused {
            Some((posted, errno)) => Err(VerbsError::post("post_send", errno, posted)),
            None if doorbell => Err(VerbsError::post("post_send", libc::EIO, wrs.len())),
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
pub(super) struct ProviderScope;

impl ProviderScope {
    pub(super) fn enter() -> ProviderScope {
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

impl Drop for Qp {
    fn drop(&mut self) {
        let mut s = self.fabric.lock();
        s.qp_error(self.qpn);
        s.post_failures.remove(&self.qpn);
        s.doorbell_failures.remove(&self.qpn);
        s.holding.remove(&self.qpn);
        if s.faults.destroy_drops_completions {
            s.drop_completions_of(self.qpn);
        }
        if let Some(p) = s.qps.get(&self.qpn).and_then(|q| q.peer) {
            if let Some(pq) = s.qps.get_mut(&p) {
                pq.peer = None;
            }
        }
        // Its events not yet read go with it, as uverbs removes a destroyed QP's events
        // from the async event queue: none names a QP number the device may give out again.
        // So does its TCP link's memory of it.
        if let Some(q) = s.qps.remove(&self.qpn) {
            let qpn = self.qpn;
            if let Some(l) = q.remote.and_then(|l| s.links.get_mut(&l)) {
                if l.qp == Some(qpn) {
                    l.qp = None;
                }
            }
            s.forget_events(q.dev, |e| e.qp() == Some(qpn));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn polling_an_empty_cq_does_not_wait_for_the_fabrics_lock() {
        let f = Fabric::new();
        let dev = f.add_device([10, 0, 0, 1].into()).unwrap();
        let cq = dev.create_cq(16).unwrap();
        let mut out = [Wc::default(); 4];
        // Another thread (a poster, say) holds the lock all along: the poll answers anyway.
        let held = f.lock();
        let polled = std::thread::scope(|s| {
            let (tx, rx) = std::sync::mpsc::channel();
            let mut mine = [Wc::default(); 4];
            let cq = &cq;
            s.spawn(move || tx.send(cq.poll(&mut mine).map_err(|_| ())));
            // Bounded: a poll that waits for the lock gets it once the lock goes.
            let r = rx.recv_timeout(std::time::Duration::from_secs(10));
            drop(held);
            r
        });
        assert_eq!(polled, Ok(Ok(0)), "the poll waited for the lock");
        // A completion shows, and an overflowed CQ fails, as before.
        f.lock().push_wc(
            cq.id,
            Wc {
                wr_id: 9,
                ..Wc::default()
            },
        );
        assert_eq!(cq.poll(&mut out).unwrap(), 1);
        assert_eq!(out[0].wr_id, 9);
        assert_eq!(cq.poll(&mut out).unwrap(), 0);
        {
            let mut s = f.lock();
            let c = s.cqs.get_mut(&cq.id).unwrap();
            c.overflowed = true;
            c.publish();
        }
        assert!(cq.poll(&mut out).is_err());
    }

    const CAPS: QpCaps = QpCaps {
        max_send_wr: 16,
        max_send_sge: 4,
        max_recv_wr: 0,
        max_inline_data: 64,
    };

    /// Makes and drops objects with `make` until one gets `id` again (a slot gives an ID
    /// again after 256 reuses), and returns it.
    fn made_again<T>(id: u32, make: impl Fn() -> T, id_of: impl Fn(&T) -> u32) -> T {
        for _ in 0..1000 {
            let x = make();
            if id_of(&x) == id {
                return x;
            }
        }
        panic!("{id:#x} never given again");
    }

    fn events(dev: &Device) -> Vec<AsyncEvent> {
        std::iter::from_fn(|| dev.next_event()).collect()
    }

    #[test]
    fn an_srq_given_a_destroyed_ones_id_inherits_nothing_of_it() {
        let f = Fabric::new();
        let dev = f.add_device([10, 0, 0, 1].into()).unwrap();
        let pd = dev.alloc_pd().unwrap();
        let cq = dev.create_cq(16).unwrap();
        let old = pd.create_srq(16, 1).unwrap();
        let id = old.id;
        let qp = pd.create_qp(&cq, &cq, &old, CAPS).unwrap();
        // It breaks (SRQ_ERR, unread) and goes while its QP stays.
        f.lock().srq_error(id);
        drop(old);
        let new = made_again(id, || pd.create_srq(16, 1).unwrap(), |s| s.id);
        let mr = pd.alloc_mr(64, Access::LOCAL_WRITE).unwrap();
        new.post_recv(&[RecvWr {
            wr_id: 1,
            sges: &[mr.sge(0, 64)],
        }])
        .expect("a new SRQ is not broken");
        assert!(
            !events(&dev).contains(&AsyncEvent::SrqErr(id)),
            "the old SRQ's event names the new one"
        );
        assert!(
            f.srq_qps(id).is_empty(),
            "the old SRQ's QP is on the new one"
        );
        drop(qp);
    }

    #[test]
    fn a_cq_given_a_destroyed_ones_id_gets_none_of_its_completions_or_events() {
        let f = Fabric::new();
        let dev = f.add_device([10, 0, 0, 1].into()).unwrap();
        let pd = dev.alloc_pd().unwrap();
        let srq = pd.create_srq(16, 1).unwrap();
        let old = dev.create_cq(16).unwrap();
        let id = old.id;
        let qp = pd.create_qp(&old, &old, &srq, CAPS).unwrap();
        f.lock().event(dev.inner.id, AsyncEvent::CqErr(id));
        drop(old);
        let new = made_again(id, || dev.create_cq(16).unwrap(), |c| c.id);
        assert!(!events(&dev).contains(&AsyncEvent::CqErr(id)));
        // The old CQ's QP completes work (its flush, here): none of it shows in the new CQ.
        f.lock()
            .complete_send(qp.qpn, 7, true, WcStatus::WrFlushErr, WcOpcode::Send);
        let mut out = [Wc::default(); 4];
        assert_eq!(new.poll(&mut out).unwrap(), 0, "{:?}", &out[..1]);
    }

    #[test]
    fn a_destroyed_qps_tcp_link_forgets_it() {
        let f = Fabric::new();
        let dev = f.add_device([10, 0, 0, 1].into()).unwrap();
        let pd = dev.alloc_pd().unwrap();
        let cq = dev.create_cq(16).unwrap();
        let srq = pd.create_srq(16, 1).unwrap();
        let qp = pd.create_qp(&cq, &cq, &srq, CAPS).unwrap();
        let (tx, _rx) = std::sync::mpsc::channel();
        let link = {
            let mut s = f.lock();
            let link = s.alloc_id();
            s.links.insert(link, tcp::LinkState::for_test(tx));
            s.bind_remote(qp.qpn, link);
            link
        };
        assert_eq!(f.lock().links[&link].qp, Some(qp.qpn));
        drop(qp);
        // A QP given its number later is not the link's: the old peer's frames and the
        // link's loss would reach it.
        assert_eq!(f.lock().links[&link].qp, None);
    }

    #[test]
    fn ids_going_round_their_counter_skip_those_alive() {
        let f = Fabric::new();
        let dev = f.add_device([10, 0, 0, 1].into()).unwrap();
        let pd = dev.alloc_pd().unwrap();
        let chan = crate::soft::cm::CmChannel::new(&f).unwrap();
        let listening = chan.listen("10.0.0.1:4420".parse().unwrap(), 8).unwrap();
        let mut s = f.lock();
        let mut alive: Vec<u32> =
            s.cm.ids
                .keys()
                .chain(s.cm.channels.keys())
                .copied()
                .collect();
        alive.extend([dev.inner.id, pd.id]);
        assert_eq!(alive.len(), 4);
        // A peer making and dropping connections has taken the counter round: the next IDs
        // start again from the first ones, which these still hold.
        s.next_object = 0x00ff_fff0;
        let mut given = std::collections::HashSet::new();
        for _ in 0..64 {
            let n = s.alloc_id();
            assert!(!alive.contains(&n), "{n:#x} given again while alive");
            assert_ne!(n, 0);
            assert!(given.insert(n));
        }
        drop(s);
        // A PD let go frees its ID.
        let pd_id = pd.id;
        drop(pd);
        assert!(!f.lock().live_pds.contains(&pd_id));
        drop(listening);
    }
}
