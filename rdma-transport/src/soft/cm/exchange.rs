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

    /// The RTU reached local accepting ID `id`: it is established (`Established`), or, while
    /// `fail_establishments` holds, its QP cannot be moved to RTS (`ConnectError`; taking the
    /// event moves the QP to ERR; the connection ends with a disconnect).
    pub(crate) fn cm_rtu(&mut self, id: u32) {
        let Some(i) = self.cm.ids.get_mut(&id) else {
            return;
        };
        if i.exchange != Exchange::RepSent {
            return;
        }
        i.exchange = Exchange::Idle;
        i.connected = true;
        let (chan, token) = (i.channel, i.token);
        if self.cm.fail_establish > 0 {
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
}
