//! The in-process wire: a send work request executes when posted (SEND, RDMA READ and
//! WRITE between two QPs of the fabric), and messages wait for receives.

use super::*;

impl State {
    pub(super) fn complete_send(
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
        // Errors always complete; a signaled success retires the unsignaled run before it
        // (`push_wc`).
        if status != WcStatus::Success || signaled {
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
    pub(super) fn deliver(&mut self, dst: u32, m: &Pending) -> Option<Result<(), ()>> {
        self.deliver_from(dst, Payload::Bytes(&m.data), m.invalidate)
    }

    /// [`State::deliver`] of a message whose bytes are `data` (a SEND's own SGEs, copied
    /// straight into the receive, when it is delivered as it is posted).
    pub(super) fn deliver_from(
        &mut self,
        dst: u32,
        data: Payload<'_>,
        invalidate: Option<u32>,
    ) -> Option<Result<(), ()>> {
        let q = self.qps.get(&dst)?;
        if !matches!(q.state, QpState::Rtr | QpState::Rts) {
            return Some(Err(()));
        }
        let (dev, pd, recv_cq) = (q.dev, q.pd, q.recv_cq);
        let srq_id = q.srq?;
        let srq = self.srqs.get_mut(&srq_id)?;
        let r = srq.recvs.pop_front()?;
        // SEND with Invalidate may invalidate only a key of the receiver's PD that was given
        // out for remote access; any other key fails the message (and both QPs), leaving the
        // region as it was.
        let bad_invalidate = invalidate.is_some_and(|k| {
            !self.mrs.get(&k).is_some_and(|mr| {
                mr.dev == dev
                    && mr.pd == pd
                    && mr
                        .access
                        .intersects(Access::REMOTE_READ | Access::REMOTE_WRITE)
            })
        });
        let remaining = u32::try_from(srq.recvs.len()).unwrap_or(u32::MAX);
        if srq.limit > 0 && remaining < srq.limit {
            srq.limit = 0; // one-shot: re-armed by modify
            let sdev = srq.dev;
            self.event(sdev, AsyncEvent::SrqLimitReached(srq_id));
        }
        let room = self.check_local(dev, pd, &r.sges, Access::LOCAL_WRITE);
        let len = data.len();
        let fits = room.is_some_and(|room| room >= len as u64);
        if !fits || bad_invalidate {
            let status = if bad_invalidate {
                WcStatus::RemInvReqErr
            } else if room.is_none() {
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
        match data {
            Payload::Bytes(b) => scatter(&r.sges, b),
            Payload::Sges(s) => copy_sges(s, &r.sges),
        }
        if let Some(k) = invalidate {
            if let Some(mr) = self.mrs.get_mut(&k) {
                mr.valid = false;
            }
        }
        let wc = Wc {
            wr_id: r.wr_id,
            status: WcStatus::Success,
            opcode: WcOpcode::Recv,
            byte_len: u32::try_from(len).unwrap_or(u32::MAX),
            qp_num: dst,
            invalidated_rkey: invalidate,
        };
        self.push_wc(recv_cq, wc);
        if let Some(q) = self.qps.get_mut(&dst).filter(|q| q.comm_est_pending) {
            // The first message of a connection whose accepting side missed the RTU.
            q.comm_est_pending = false;
            self.event(dev, AsyncEvent::CommEst(dst));
        }
        Some(Ok(()))
    }

    /// Delivers what waits for receives on the QPs of SRQ `srq` (after a post).
    pub(super) fn drain_inbound(&mut self, srq: u32) {
        if !self.inbound_any {
            return;
        }
        if self.qps.values().all(|q| q.inbound.is_empty()) {
            self.inbound_any = false;
            return;
        }
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
                            src.rnr_blocked = src.rnr_blocked.saturating_sub(1);
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

/// A message's bytes: gathered, or still in the sender's SGEs (checked, or inline data the
/// poster keeps readable for the call).
#[derive(Clone, Copy)]
pub(super) enum Payload<'a> {
    Bytes(&'a [u8]),
    Sges(&'a [Sge]),
}

impl Payload<'_> {
    fn len(&self) -> usize {
        match self {
            Payload::Bytes(b) => b.len(),
            Payload::Sges(s) => s.iter().map(|g| g.length as usize).sum(),
        }
    }
}

/// Copies `data` into the regions of `sges`, in order.
pub(super) fn scatter(sges: &[Sge], data: &[u8]) {
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
pub(super) fn gather(sges: &[Sge]) -> Vec<u8> {
    let mut out = Vec::new();
    gather_into(sges, &mut out);
    out
}

/// Reads the bytes of `sges`, in order, into `out` (emptied first).
pub(super) fn gather_into(sges: &[Sge], out: &mut Vec<u8>) {
    out.clear();
    out.reserve(sges.iter().map(|s| s.length as usize).sum());
    for s in sges {
        // SAFETY: as in `scatter` (the caller checked the SGEs or they are inline data that
        // the poster guarantees readable).
        let src = unsafe { std::slice::from_raw_parts(s.addr as *const u8, s.length as usize) };
        out.extend_from_slice(src);
    }
}

/// Copies the bytes of `from`, in order, into `to`, in order, as far as both go, with no copy
/// in between (a NIC's DMA from one region to the other).
fn copy_sges(from: &[Sge], to: &[Sge]) {
    let (mut fi, mut fo, mut ti, mut to_off) = (0, 0usize, 0, 0usize);
    while let (Some(f), Some(t)) = (from.get(fi), to.get(ti)) {
        let n = (f.length as usize - fo).min(t.length as usize - to_off);
        if n > 0 {
            // SAFETY: as in `scatter` and `gather`: the caller checked both lists against
            // registered regions (or `from` is inline data the poster keeps readable); the
            // copy is raw, as a NIC's DMA, and `copy` allows the two to overlap.
            unsafe {
                std::ptr::copy(
                    (f.addr as *const u8).add(fo),
                    (t.addr as *mut u8).add(to_off),
                    n,
                );
            }
        }
        fo += n;
        to_off += n;
        if fo == f.length as usize {
            fi += 1;
            fo = 0;
        }
        if to_off == t.length as usize {
            ti += 1;
            to_off = 0;
        }
    }
}

/// What running a send WR needs of its QP, read once per work request.
#[derive(Clone, Copy)]
pub(super) struct Sender {
    dev: u32,
    pd: u32,
    peer: Option<u32>,
    rnr_retry: u8,
    /// Work of the QP is held up by an injected delay, or behind a SEND waiting at the peer
    /// for a receive (this one waits behind it).
    held: bool,
    remote: Option<u32>,
}

impl Sender {
    pub(super) fn of(q: &QpState_) -> Sender {
        Sender {
            dev: q.dev,
            pd: q.pd,
            peer: q.peer,
            rnr_retry: q.rnr_retry,
            held: !q.delayed.is_empty() || q.rnr_blocked > 0,
            remote: q.remote,
        }
    }
}

/// Runs one send WR on the in-process wire.
pub(super) fn execute(s: &mut State, qpn: u32, w: &SendWr<'_>, opcode: WcOpcode) {
    if let Some(q) = s.qps.get(&qpn) {
        let from = Sender::of(q);
        execute_as(s, qpn, from, w, opcode);
    }
}

/// Runs one send WR of QP `qpn`, read as `from`, on the in-process wire.
pub(super) fn execute_as(s: &mut State, qpn: u32, from: Sender, w: &SendWr<'_>, opcode: WcOpcode) {
    let Sender {
        dev,
        pd,
        peer,
        rnr_retry,
        held,
        remote,
    } = from;
    // The QP's earlier work still out (SENDs waiting at the peer, requests waiting for the
    // peer's answer) is flushed first: completions come in posting order, as on a NIC.
    let fail = |s: &mut State, st: WcStatus| {
        s.qp_error(qpn);
        s.complete_send(qpn, w.wr_id, w.signaled, st, opcode);
    };
    // The local side: gather (SEND/WRITE) needs readable regions, READ needs writable ones.
    let local_ok = w.inline.is_some() || {
        let need = if matches!(w.op, SendOp::RdmaRead { .. }) {
            Access::LOCAL_WRITE
        } else {
            Access::empty()
        };
        s.check_local(dev, pd, w.sges, need).is_some()
    };
    if !local_ok {
        return fail(s, WcStatus::LocProtErr);
    }
    // (The seeded faults are drawn only where some are set.)
    let seeded = s.seeded;
    let delay = seeded
        && !s.releasing
        && !held
        && s.faults.delay_per_million > 0
        && s.draw() < u64::from(s.faults.delay_per_million);
    s.injected.delays += u64::from(delay);
    if !s.releasing && (held || delay) {
        let inline = w.inline.map(<[u8]>::to_vec);
        s.delayed_any
            .store(true, std::sync::atomic::Ordering::Release);
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
    if seeded {
        if let Err(st) = seeded_faults(s, qpn, dev, peer, w) {
            return fail(s, st);
        }
    }
    if let Some(link) = remote {
        return send_remote(s, qpn, w, opcode, link);
    }
    run_local(s, qpn, w, opcode, (peer, rnr_retry));
}

/// The seeded faults a send WR may meet ([`Faults`]): `Err` with the status it fails with.
fn seeded_faults(
    s: &mut State,
    qpn: u32,
    dev: u32,
    peer: Option<u32>,
    w: &SendWr<'_>,
) -> Result<(), WcStatus> {
    if s.faults.qp_fatal_per_million > 0 && s.draw() < u64::from(s.faults.qp_fatal_per_million) {
        s.injected.qp_fatals += 1;
        s.event(dev, AsyncEvent::QpFatal(qpn));
        return Err(WcStatus::WrFlushErr);
    }
    if s.faults.srq_error_per_million > 0
        && matches!(w.op, SendOp::Send | SendOp::SendWithInvalidate { .. })
        && s.draw() < u64::from(s.faults.srq_error_per_million)
    {
        if let Some(srq) = peer.and_then(|p| s.qps.get(&p)).and_then(|q| q.srq) {
            s.injected.srq_errors += 1;
            s.srq_error(srq);
        }
    }
    if s.faults.drop_per_million > 0 && s.draw() < u64::from(s.faults.drop_per_million) {
        s.injected.drops += 1;
        return Err(WcStatus::RetryExcErr);
    }
    Ok(())
}

/// Sends one send WR of QP `qpn` over the TCP wire (`link`): its completion comes with the
/// peer's answer.
fn send_remote(s: &mut State, qpn: u32, w: &SendWr<'_>, opcode: WcOpcode, link: u32) {
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
}

/// Runs one send WR of QP `qpn` on the in-process wire, against its peer's memory and receives.
fn run_local(
    s: &mut State,
    qpn: u32,
    w: &SendWr<'_>,
    opcode: WcOpcode,
    (peer, rnr_retry): (Option<u32>, u8),
) {
    // The QP's earlier work still out (a SEND waiting at the peer) is flushed first:
    // completions come in posting order, as on a NIC.
    let fail = |s: &mut State, st: WcStatus| {
        s.qp_error(qpn);
        s.complete_send(qpn, w.wr_id, w.signaled, st, opcode);
    };
    let Some((peer, pdev, ppd, waiting)) = peer.and_then(|p| {
        s.qps
            .get(&p)
            .filter(|q| matches!(q.state, QpState::Rtr | QpState::Rts))
            .map(|q| (p, q.dev, q.pd, !q.inbound.is_empty()))
    }) else {
        return fail(s, WcStatus::RetryExcErr);
    };
    match w.op {
        SendOp::RdmaWrite { remote_addr, rkey } => {
            let len: u64 = w.sges.iter().map(|g| u64::from(g.length)).sum();
            if !s.check_remote(pdev, ppd, remote_addr, len, rkey, Access::REMOTE_WRITE) {
                return fail(s, WcStatus::RemAccessErr);
            }
            let dst = [Sge {
                addr: remote_addr,
                length: u32::try_from(len).unwrap_or(u32::MAX),
                lkey: 0,
            }];
            copy_sges(w.sges, &dst);
            s.complete_send(qpn, w.wr_id, w.signaled, WcStatus::Success, opcode);
        }
        SendOp::RdmaRead { remote_addr, rkey } => {
            let len: u64 = w.sges.iter().map(|g| u64::from(g.length)).sum();
            if !s.check_remote(pdev, ppd, remote_addr, len, rkey, Access::REMOTE_READ) {
                return fail(s, WcStatus::RemAccessErr);
            }
            let src = [Sge {
                addr: remote_addr,
                length: u32::try_from(len).unwrap_or(u32::MAX),
                lkey: 0,
            }];
            copy_sges(&src, w.sges);
            s.complete_send(qpn, w.wr_id, w.signaled, WcStatus::Success, opcode);
        }
        SendOp::Send | SendOp::SendWithInvalidate { .. } => {
            send_local(s, qpn, w, opcode, (peer, rnr_retry, waiting));
        }
    }
}

/// A SEND of QP `qpn` to its in-process `peer`: delivered into a receive, or (RNR, retried
/// forever) waiting for one; `waiting` when messages wait at the peer already (this one goes
/// after them).
fn send_local(
    s: &mut State,
    qpn: u32,
    w: &SendWr<'_>,
    opcode: WcOpcode,
    (peer, rnr_retry, waiting): (u32, u8, bool),
) {
    // The QP's earlier work still out (a SEND waiting at the peer) is flushed first:
    // completions come in posting order, as on a NIC.
    let fail = |s: &mut State, st: WcStatus| {
        s.qp_error(qpn);
        s.complete_send(qpn, w.wr_id, w.signaled, st, opcode);
    };
    let invalidate = match w.op {
        SendOp::SendWithInvalidate { rkey } => Some(rkey),
        _ => None,
    };
    // Delivered as it is posted, the bytes go from the SEND's regions straight into the
    // receive's; only a message that waits for a receive is gathered.
    let r = if waiting {
        None
    } else {
        s.deliver_from(peer, Payload::Sges(w.sges), invalidate)
    };
    match r {
        Some(Ok(())) => s.complete_send(qpn, w.wr_id, w.signaled, WcStatus::Success, opcode),
        Some(Err(())) => fail(s, WcStatus::RemInvReqErr),
        None if rnr_retry >= 7 => {
            // Receiver Not Ready, retried forever: the message waits for a receive.
            let m = Pending {
                from_qpn: qpn,
                wr_id: w.wr_id,
                signaled: w.signaled,
                data: gather(w.sges),
                invalidate,
                remote: None,
            };
            if let Some(q) = s.qps.get_mut(&qpn) {
                q.deferred += 1;
                q.rnr_blocked += 1;
            }
            if let Some(p) = s.qps.get_mut(&peer) {
                p.inbound.push_back(m);
                s.inbound_any = true;
            }
        }
        None => fail(s, WcStatus::RnrRetryExcErr),
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
