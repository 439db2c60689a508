//! The CM exchange between two sides of the fabric (in process or over TCP): accepts,
//! rejects, RTUs and disconnects reaching an ID, and the events they raise.

use super::*;

impl Fabric {
    /// Makes the next `n` RTUs that reach an accepting side on this fabric fail to bring its
    /// QP to RTS: it hears `ConnectError` instead of `Established` (librdmacm's
    /// `RDMA_CM_EVENT_CONNECT_ERROR` when the QP transition on ESTABLISHED fails), and its QP
    /// goes to ERR when that event is taken. The CM exchange itself completed, so the
    /// connection ends with a disconnect.
    pub fn fail_establishments(&self, n: u32) {
        self.lock().cm.fail_establish = n;
    }

    /// Loses the next `n` RTUs on their way to an accepting side, and every resend of them:
    /// the accepting ID stays waiting for its RTU (its QP in RTS, as librdmacm's
    /// `rdma_accept` leaves it, so the connection carries messages); the first message its
    /// QP takes raises `AsyncEvent::CommEst`, and `CmId::notify_established` establishes it
    /// as `rdma_notify` does. [`Fabric::expire_rep_timeouts`] runs the clock.
    pub fn lose_rtus(&self, n: u32) {
        self.lock().cm.lose_rtu = n;
    }

    /// The REP retries of every accepting ID still waiting for its RTU run out (the soft
    /// fabric has no timers: a test says when): each hears `Unreachable`, the
    /// `IB_CM_REP_ERROR` that rdma_cm reports as `RDMA_CM_EVENT_UNREACHABLE`. Returns how many.
    pub fn expire_rep_timeouts(&self) -> usize {
        let mut s = self.lock();
        let mut expired = Vec::new();
        for (&id, i) in s.cm.ids.iter_mut() {
            if i.exchange == Exchange::RepSent {
                i.exchange = Exchange::Idle;
                expired.push((id, i.channel, i.token, i.qp));
            }
        }
        for &(_, chan, token, qp) in &expired {
            if let Some(q) = qp.and_then(|q| s.qps.get_mut(&q)) {
                q.comm_est_pending = false;
            }
            s.cm.push(chan, Ev::Unreachable { token });
        }
        expired.len()
    }
}

impl super::super::State {
    /// Binds local QP `qp` to the TCP `link` and moves it to RTS.
    pub(crate) fn bind_remote(&mut self, qp: u32, link: u32) {
        if let Some(q) = self.qps.get_mut(&qp) {
            q.remote = Some(link);
            q.state = QpState::Rts;
        }
        if let Some(l) = self.links.get_mut(&link) {
            l.qp = Some(qp);
        }
    }

    pub(crate) fn link_id(&self, link: u32) -> Option<u32> {
        self.links.get(&link).and_then(|l| l.cm_id)
    }

    /// The peer process accepted our connect request (its REP): our ESTABLISHED is queued;
    /// taking it sends the RTU.
    pub(crate) fn cm_remote_accepted(&mut self, link: u32, private_data: Vec<u8>) {
        let Some(id) = self.link_id(link) else { return };
        let Some((chan, token, qp)) = self.cm.ids.get(&id).map(|i| (i.channel, i.token, i.qp))
        else {
            return;
        };
        if let Some(q) = qp {
            self.bind_remote(q, link);
        }
        if let Some(i) = self.cm.ids.get_mut(&id) {
            i.exchange = Exchange::RepRcvd;
        }
        self.cm.push(
            chan,
            Ev::Established {
                id,
                token,
                private_data,
            },
        );
    }

    /// The peer process rejected our connect request, or went away during the exchange.
    pub(crate) fn cm_remote_rejected(&mut self, link: u32, private_data: Vec<u8>) {
        if let Some(id) = self.link_id(link) {
            self.cm_rejected(id, private_data);
        }
    }

    /// The peer process's RTU arrived.
    pub(crate) fn cm_remote_rtu(&mut self, link: u32) {
        if let Some(id) = self.link_id(link) {
            self.cm_rtu(id);
        }
    }

    /// The peer process disconnected, or its connection broke: a connection hears
    /// `Disconnected`, an exchange under way `Rejected` (the process is gone, and its kernel
    /// sent a REJ for its IDs).
    pub(crate) fn cm_remote_disconnected(&mut self, link: u32) {
        let Some(id) = self.link_id(link) else { return };
        let Some((connected, pending)) = self
            .cm
            .ids
            .get(&id)
            .map(|i| (i.connected, i.exchange.pending()))
        else {
            return;
        };
        if !connected {
            if pending {
                self.cm_rejected(id, Vec::new());
            }
            return;
        }
        let Some(i) = self.cm.ids.get_mut(&id) else {
            return;
        };
        i.connected = false;
        let (chan, token, qp) = (i.channel, i.token, i.qp);
        if let Some(q) = qp {
            self.qp_error(q);
        }
        self.cm.push(chan, Ev::Disconnected { token });
    }

    /// A REJ reached local ID `id`: its exchange ends, reported as `Rejected` unless it is an
    /// accepting side that has not accepted yet (the kernel's ucma drops the events of a new
    /// connection until userspace accepts it: "the accept will just fail later").
    pub(crate) fn cm_rejected(&mut self, id: u32, private_data: Vec<u8>) {
        let Some(i) = self.cm.ids.get_mut(&id) else {
            return;
        };
        let report = !matches!(i.exchange, Exchange::Idle | Exchange::ReqRcvd);
        i.exchange = Exchange::Idle;
        let (chan, token) = (i.channel, i.token);
        if report {
            self.cm.push(
                chan,
                Ev::Rejected {
                    id,
                    token,
                    private_data,
                },
            );
        }
    }

    /// Local connecting ID `id` handles the REP (its ESTABLISHED was taken): it is connected
    /// and sends the RTU.
    pub(crate) fn cm_send_rtu(&mut self, id: u32) {
        let Some(i) = self.cm.ids.get_mut(&id) else {
            return;
        };
        if i.exchange != Exchange::RepRcvd {
            return;
        }
        i.exchange = Exchange::Idle;
        i.connected = true;
        match (i.link, i.peer) {
            (Some(link), _) => self.send_frame(link, super::super::tcp::Frame::Rtu),
            (None, Some(p)) => self.cm_rtu(p),
            (None, None) => {}
        }
    }

    /// `rdma_notify(IBV_EVENT_COMM_EST)` on accepting ID `id`: established as if its RTU had
    /// come (the IB CM's `cm_establish`); EISCONN if it is established already, EINVAL if it
    /// is not waiting for an RTU.
    pub(crate) fn cm_notify_established(&mut self, id: u32) -> Result<(), VerbsError> {
        let Some(i) = self.cm.ids.get_mut(&id) else {
            return Err(VerbsError::os("rdma_notify", libc::EINVAL));
        };
        if i.exchange != Exchange::RepSent {
            let e = if i.connected {
                libc::EISCONN
            } else {
                libc::EINVAL
            };
            return Err(VerbsError::os("rdma_notify", e));
        }
        if let Some(q) = i.qp.and_then(|q| self.qps.get_mut(&q)) {
            q.comm_est_pending = false;
        }
        self.cm_established(id, false);
        Ok(())
    }

    /// Accepting ID `id` is established: `Established` on its channel, or, with `may_fail`
    /// while `fail_establishments` holds, `ConnectError` (its QP could not be moved to RTS).
    fn cm_established(&mut self, id: u32, may_fail: bool) {
        let Some(i) = self.cm.ids.get_mut(&id) else {
            return;
        };
        i.exchange = Exchange::Idle;
        i.connected = true;
        let (chan, token) = (i.channel, i.token);
        if may_fail && self.cm.fail_establish > 0 {
            self.cm.fail_establish -= 1;
            self.cm.push(chan, Ev::ConnectError { id, token });
            return;
        }
        self.cm.push(
            chan,
            Ev::Established {
                id,
                token,
                private_data: Vec::new(),
            },
        );
    }

    /// The RTU reached local accepting ID `id`: it is established (`Established`), or, while
    /// `lose_rtus` holds, it is lost (the ID keeps waiting for it), or, while
    /// `fail_establishments` holds, its QP cannot be moved to RTS (`ConnectError`; taking the
    /// event moves the QP to ERR; the connection ends with a disconnect).
    pub(crate) fn cm_rtu(&mut self, id: u32) {
        let Some(i) = self.cm.ids.get_mut(&id) else {
            return;
        };
        if i.exchange != Exchange::RepSent {
            return;
        }
        if self.cm.lose_rtu > 0 {
            self.cm.lose_rtu -= 1;
            if let Some(q) = i.qp.and_then(|q| self.qps.get_mut(&q)) {
                q.comm_est_pending = true;
            }
            return;
        }
        self.cm_established(id, true);
    }
}
