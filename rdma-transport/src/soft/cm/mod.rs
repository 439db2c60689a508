//! The soft connection manager, shaped like rdma_cm and like the ibverbs provider's `cm`
//! module: listen, resolve, a QP created on the CM ID, connect or accept with private data,
//! reject with private data, disconnect, typed events on a pollable channel.
//!
//! The exchange follows the InfiniBand CM as rdma_cm and librdmacm run it: the connecting side
//! sends a REQ (`connect`); the accepting side's CONNECT_REQUEST is the REQ, its `accept`
//! sends the REP (its QP goes to RTS, as librdmacm's `rdma_accept` moves it); the connecting
//! side's ESTABLISHED is the REP, and taking that event from its channel sends the RTU (as
//! librdmacm does when it handles the CONNECT_RESPONSE); the accepting side's ESTABLISHED is the
//! RTU. A connection whose exchange does not complete ends as rdma_cm ends it on the accepting
//! side:
//!
//! - an ID destroyed while its exchange is under way sends a REJ (the IB CM's
//!   `cm_destroy_id`), so a host that goes away between its REQ and its RTU is `Rejected` at
//!   the accepting side once it has accepted; a REJ that arrives before the accept is not
//!   reported (the kernel's ucma drops the events of a new connection until userspace accepts
//!   it) and the `accept` fails;
//! - a host that vanishes without a word (`CmId::vanish`: its machine is gone) leaves the REP
//!   unanswered: its retries run out and the accepting side hears `Unreachable`, the
//!   `IB_CM_REP_ERROR` that rdma_cm reports as `RDMA_CM_EVENT_UNREACHABLE` (at once here: the
//!   soft fabric has no timers);
//! - `Fabric::fail_establishments` makes the next RTUs fail to bring the accepting QP to RTS,
//!   which librdmacm reports as `RDMA_CM_EVENT_CONNECT_ERROR` instead of ESTABLISHED;
//! - `Fabric::lose_rtus` loses the next RTUs (and their resends): the accepting QP, in RTS,
//!   raises `CommEst` at its first message, and `CmId::notify_established` (`rdma_notify`)
//!   establishes the ID; one not notified hears `Unreachable` when
//!   `Fabric::expire_rep_timeouts` runs out its REP's retries.
//!
//! Taking a `Rejected` or `ConnectError` event moves the ID's QP to ERR, as librdmacm's
//! `rdma_get_cm_event` does with a QP it holds (the ibverbs provider gives it none of an
//! accepted connection; the data path tears such a connection down, its QP to ERR, either
//! way); `disconnect` moves the QP to ERR whatever the exchange's state, as `rdma_disconnect`
//! does.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::{link, Cq, Device, EventFd, Fabric, Pd, Qp, Srq};
use crate::types::*;

mod exchange;
mod state;

pub(crate) use state::CmState;
use state::*;

static NEXT_TOKEN: AtomicUsize = AtomicUsize::new(1);

/// A connection manager event.
pub type CmEvent = crate::types::CmEvent<CmId>;

pub(crate) enum Ev {
    Request {
        id: u32,
        private_data: Vec<u8>,
    },
    /// `id`: the local ID (the connecting side sends its RTU when the event is taken).
    Established {
        id: u32,
        token: usize,
        private_data: Vec<u8>,
    },
    /// `id`: the local ID, whose QP goes to ERR when the event is taken.
    Rejected {
        id: u32,
        token: usize,
        private_data: Vec<u8>,
    },
    Disconnected {
        token: usize,
    },
    TimewaitExit {
        token: usize,
    },
    Unreachable {
        token: usize,
    },
    /// `id`: the local ID, whose QP goes to ERR when the event is taken.
    ConnectError {
        id: u32,
        token: usize,
    },
    DeviceRemoval {
        token: usize,
    },
    AddrChange {
        token: usize,
    },
}

/// Where a connection's CM exchange stands (the IB CM's states, as rdma_cm runs them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Exchange {
    /// None under way: a listener, a resolved ID, an ID whose exchange ended (established,
    /// rejected or failed).
    Idle,
    /// Connecting side: the REQ is out, no answer yet.
    ReqSent,
    /// Accepting side: the REQ arrived, not accepted yet.
    ReqRcvd,
    /// Accepting side: accepted (the REP is out); ESTABLISHED comes with the RTU.
    RepSent,
    /// Connecting side: the REP arrived (its ESTABLISHED is queued); taking that event sends
    /// the RTU.
    RepRcvd,
}

impl Exchange {
    /// An exchange under way: destroying the ID sends a REJ.
    fn pending(self) -> bool {
        self != Exchange::Idle
    }
}

/// An event channel.
#[derive(Debug)]
pub struct CmChannel {
    fabric: Fabric,
    id: u32,
    fd: Arc<EventFd>,
}

/// A CM ID: a listener or a connection, owning the QP created on it.
#[derive(Debug)]
pub struct CmId {
    fabric: Fabric,
    id: u32,
    token: usize,
    listen_addr: Option<SocketAddr>,
    device: Option<Device>,
    qp: Option<Qp>,
}

impl CmChannel {
    /// A new event channel on `fabric`.
    pub fn new(fabric: &Fabric) -> Result<CmChannel, VerbsError> {
        let fd = Arc::new(
            EventFd::new()
                .map_err(|e| VerbsError::os("eventfd", e.raw_os_error().unwrap_or(libc::EIO)))?,
        );
        let mut s = fabric.lock();
        let id = s.alloc_id();
        s.cm.channels.insert(
            id,
            ChannelState {
                events: VecDeque::new(),
                fd: Arc::clone(&fd),
            },
        );
        Ok(CmChannel {
            fabric: fabric.clone(),
            id,
            fd,
        })
    }

    /// The fd that turns readable when an event is queued.
    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Whether an ID made on the channel is still open.
    pub fn has_ids(&self) -> bool {
        self.fabric
            .lock()
            .cm
            .ids
            .values()
            .any(|i| i.channel == self.id)
    }

    fn new_id(&self, dst: Option<SocketAddr>) -> CmId {
        let mut s = self.fabric.lock();
        let id = s.alloc_id();
        let token = NEXT_TOKEN.fetch_add(1, Ordering::Relaxed);
        s.cm.ids.insert(
            id,
            IdState {
                link: None,
                channel: self.id,
                token,
                dst,
                peer_addr: dst,
                peer: None,
                qp: None,
                connected: false,
                exchange: Exchange::Idle,
                private_data: Vec::new(),
                responder_resources: 16,
            },
        );
        CmId {
            fabric: self.fabric.clone(),
            id,
            token,
            listen_addr: None,
            device: None,
            qp: None,
        }
    }

    /// Listens on `addr`, which must be a device's address; a second listener on it is
    /// refused (EADDRINUSE), and so is a removed device's address (ENODEV, as rdma_bind_addr
    /// finds no device for it).
    pub fn listen(&self, addr: SocketAddr, _backlog: i32) -> Result<CmId, VerbsError> {
        let device = self
            .fabric
            .device_for(addr.ip())
            .ok_or(VerbsError::os("rdma_bind_addr", libc::EADDRNOTAVAIL))?;
        let mut id = self.new_id(None);
        let mut s = self.fabric.lock();
        if s.is_removed(device.inner.id) {
            return Err(VerbsError::os("rdma_bind_addr", libc::ENODEV));
        }
        if s.cm.listeners.contains_key(&addr) {
            return Err(VerbsError::os("rdma_listen", libc::EADDRINUSE));
        }
        s.cm.listeners.insert(addr, id.id);
        let tcp = s.tcp;
        drop(s);
        // Set before the acceptor starts: if it cannot, dropping the ID frees the address.
        id.listen_addr = Some(addr);
        id.device = Some(device);
        if tcp {
            super::tcp::start_acceptor(&self.fabric, addr, id.id).map_err(|e| {
                VerbsError::os("rdma_listen", e.raw_os_error().unwrap_or(libc::EADDRINUSE))
            })?;
        }
        Ok(id)
    }

    /// Resolves `addr` (the route is the fabric): the ID's device is the one a QP is made on.
    pub fn resolve(&self, addr: SocketAddr, _timeout: Duration) -> Result<CmId, VerbsError> {
        let device = self
            .fabric
            .device_for(addr.ip())
            .ok_or(VerbsError::os("rdma_resolve_addr", libc::EHOSTUNREACH))?;
        let mut id = self.new_id(Some(addr));
        id.device = Some(device);
        Ok(id)
    }

    /// The next event, without blocking.
    pub fn next_event(&self) -> Option<CmEvent> {
        let mut s = self.fabric.lock();
        let c = s.cm.channels.get_mut(&self.id)?;
        let ev = c.events.pop_front();
        if c.events.is_empty() {
            c.fd.clear();
        }
        let ev = ev?;
        Some(match ev {
            Ev::Request { id, private_data } => {
                let token = s.cm.ids.get(&id).map_or(0, |i| i.token);
                // The READs this side may have in flight: what the connecting side takes.
                let initiator_depth =
                    s.cm.ids
                        .get(&id)
                        .and_then(|i| i.peer)
                        .and_then(|p| s.cm.ids.get(&p))
                        .map_or(16, |p| p.responder_resources);
                let listen =
                    s.cm.ids
                        .get(&id)
                        .and_then(|i| i.peer)
                        .and_then(|p| s.cm.ids.get(&p))
                        .and_then(|p| p.dst)
                        .or_else(|| {
                            let l = s.cm.remote_listener.get(&id)?;
                            s.cm.listeners
                                .iter()
                                .find(|(_, v)| *v == l)
                                .map(|(a, _)| *a)
                        });
                drop(s);
                let device = listen.and_then(|a| self.fabric.device_for(a.ip()));
                CmEvent::ConnectRequest {
                    id: CmId {
                        fabric: self.fabric.clone(),
                        id,
                        token,
                        listen_addr: None,
                        device,
                        qp: None,
                    },
                    private_data,
                    initiator_depth,
                    responder_resources: 16,
                }
            }
            Ev::Established {
                id,
                token,
                private_data,
            } => {
                // The connecting side handles the REP: the RTU goes out.
                s.cm_send_rtu(id);
                CmEvent::Established {
                    id: token,
                    private_data,
                }
            }
            Ev::Rejected {
                id,
                token,
                private_data,
            } => {
                // As librdmacm does on REJECTED.
                if let Some(q) = s.cm.ids.get(&id).and_then(|i| i.qp) {
                    s.qp_error(q);
                }
                CmEvent::Rejected {
                    id: token,
                    private_data,
                }
            }
            Ev::Disconnected { token } => CmEvent::Disconnected { id: token },
            Ev::TimewaitExit { token } => CmEvent::TimewaitExit { id: token },
            Ev::Unreachable { token } => CmEvent::Unreachable { id: token },
            Ev::ConnectError { id, token } => {
                // Moving the QP to RTS on ESTABLISHED failed (librdmacm).
                if let Some(q) = s.cm.ids.get(&id).and_then(|i| i.qp) {
                    s.qp_error(q);
                }
                CmEvent::ConnectError { id: token }
            }
            Ev::DeviceRemoval { token } => CmEvent::DeviceRemoval { id: token },
            Ev::AddrChange { token } => CmEvent::AddrChange { id: token },
        })
    }
}

impl Drop for CmChannel {
    fn drop(&mut self) {
        self.fabric.lock().cm.channels.remove(&self.id);
    }
}

impl CmId {
    /// The token events name this connection by.
    pub fn token(&self) -> usize {
        self.token
    }

    /// The device the ID is bound to.
    pub fn device(&self) -> Result<Device, VerbsError> {
        self.device.clone().ok_or(VerbsError::Invalid {
            op: "cm_device",
            why: "the CM ID has no device yet",
        })
    }

    /// After the ID's device was removed: whether everything made on it is gone
    /// (`Released`), objects made on it are still open (`InUse`), or the device was not
    /// removed (`Present`). Drop this ID after `Released`.
    pub fn release_removed_device(&self) -> Result<DeviceRelease, VerbsError> {
        let Some(dev) = &self.device else {
            return Ok(DeviceRelease::Released);
        };
        let s = self.fabric.lock();
        let objects = s.objects_on(dev.inner.id);
        Ok(if objects > 0 {
            DeviceRelease::InUse(objects)
        } else if !s.is_removed(dev.inner.id) {
            DeviceRelease::Present
        } else {
            DeviceRelease::Released
        })
    }

    /// Creates the connection's RC QP on `cq`, taking receives from `srq`.
    pub fn create_qp(
        &mut self,
        pd: &Pd,
        cq: &Cq,
        srq: &Srq,
        caps: QpCaps,
    ) -> Result<u32, VerbsError> {
        if self.qp.is_some() {
            return Err(VerbsError::os("rdma_create_qp", libc::EEXIST));
        }
        let qp = pd.create_qp(cq, cq, srq, caps)?;
        let qpn = qp.qpn();
        if let Some(i) = self.fabric.lock().cm.ids.get_mut(&self.id) {
            i.qp = Some(qpn);
        }
        self.qp = Some(qp);
        Ok(qpn)
    }

    /// The QP number.
    pub fn qpn(&self) -> Option<u32> {
        self.qp.as_ref().map(Qp::qpn)
    }

    /// Whether rdma_cm holds this ID's QP (and so may move it to ERR on the thread reading
    /// the channel, as on a REJECTED event): here every ID's, as librdmacm holds a QP made
    /// with `rdma_create_qp` (the fabric's lock orders that move with everything else).
    #[doc(hidden)]
    pub fn rdma_cm_holds_qp(&self) -> bool {
        self.qp.is_some()
    }

    /// The address of the other side, where known: the address connected to, or the TCP
    /// peer of a connect request that came over the wire.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.fabric.lock().cm.ids.get(&self.id)?.peer_addr
    }

    /// The QP's state.
    pub fn qp_state(&self) -> Option<QpState> {
        self.qp.as_ref().map(Qp::state)
    }

    /// The largest inline send the QP takes.
    pub fn max_inline(&self) -> Option<u32> {
        let qpn = self.qpn()?;
        self.fabric
            .lock()
            .qps
            .get(&qpn)
            .map(|q| q.caps.max_inline_data)
    }

    /// Connects to the resolved address (after `create_qp`); the answer comes as an event.
    pub fn connect(&self, private_data: &[u8]) -> Result<(), VerbsError> {
        if private_data.len() > 56 {
            return Err(VerbsError::os("rdma_connect", libc::EINVAL));
        }
        let mut s = self.fabric.lock();
        let Some(me) = s.cm.ids.get(&self.id) else {
            return Err(VerbsError::os("rdma_connect", libc::EINVAL));
        };
        let (dst, chan, token) = (me.dst, me.channel, me.token);
        if me.qp.is_none() {
            return Err(VerbsError::Invalid {
                op: "rdma_connect",
                why: "no QP",
            });
        }
        let listener = dst.and_then(|d| s.cm.listeners.get(&d).copied());
        let Some(lid) = listener else {
            let (Some(dst), true) = (dst, s.tcp) else {
                s.cm.push(chan, Ev::Unreachable { token });
                return Ok(());
            };
            // Another process: connect over TCP; its accept or reject comes back as a frame.
            drop(s);
            let Ok(stream) = std::net::TcpStream::connect_timeout(&dst, Duration::from_secs(3))
            else {
                self.fabric.lock().cm.push(chan, Ev::Unreachable { token });
                return Ok(());
            };
            let link =
                super::tcp::start_link(&self.fabric, stream, Some(self.id)).map_err(|e| {
                    VerbsError::os("rdma_connect", e.raw_os_error().unwrap_or(libc::EIO))
                })?;
            let mut s = self.fabric.lock();
            if let Some(me) = s.cm.ids.get_mut(&self.id) {
                me.link = Some(link);
                me.exchange = Exchange::ReqSent;
            }
            s.send_frame(
                link,
                super::tcp::Frame::Connect {
                    private_data: private_data.to_vec(),
                },
            );
            return Ok(());
        };
        let Some(lchan) = s.cm.ids.get(&lid).map(|l| l.channel) else {
            s.cm.push(chan, Ev::Unreachable { token });
            return Ok(());
        };
        let sid = s.alloc_id();
        let stoken = NEXT_TOKEN.fetch_add(1, Ordering::Relaxed);
        s.cm.ids.insert(
            sid,
            IdState {
                link: None,
                channel: lchan,
                token: stoken,
                dst: None,
                peer_addr: None,
                peer: Some(self.id),
                qp: None,
                connected: false,
                exchange: Exchange::ReqRcvd,
                private_data: Vec::new(),
                responder_resources: 16,
            },
        );
        if let Some(me) = s.cm.ids.get_mut(&self.id) {
            me.peer = Some(sid);
            me.exchange = Exchange::ReqSent;
        }
        s.cm.push(
            lchan,
            Ev::Request {
                id: sid,
                private_data: private_data.to_vec(),
            },
        );
        Ok(())
    }

    /// Accepts a connect request (after `create_qp`): the REP goes out and both QPs go to RTS;
    /// the connecting side sees `Established` (the REP), and this side sees it once the
    /// connecting side has taken that event (its RTU). A request whose host went away with a
    /// REJ cannot be accepted (EINVAL, as the IB CM refuses a REP then); one whose host
    /// vanished without a word is accepted, and its REP, unanswered, ends in `Unreachable`.
    pub fn accept(&self, private_data: &[u8]) -> Result<(), VerbsError> {
        if private_data.len() > 196 {
            return Err(VerbsError::os("rdma_accept", libc::EINVAL));
        }
        let mut s = self.fabric.lock();
        let Some(me) = s.cm.ids.get(&self.id) else {
            return Err(VerbsError::os("rdma_accept", libc::EINVAL));
        };
        let (chan, token, peer, qp, exchange, tcp_link) =
            (me.channel, me.token, me.peer, me.qp, me.exchange, me.link);
        let Some(qp) = qp else {
            return Err(VerbsError::Invalid {
                op: "rdma_accept",
                why: "no QP",
            });
        };
        if exchange != Exchange::ReqRcvd {
            return Err(VerbsError::os("rdma_accept", libc::EINVAL));
        }
        if let Some(i) = s.cm.ids.get_mut(&self.id) {
            i.exchange = Exchange::RepSent;
            i.private_data = private_data.to_vec();
        }
        if let Some(tcp_link) = tcp_link {
            s.bind_remote(qp, tcp_link);
            s.send_frame(
                tcp_link,
                super::tcp::Frame::Accept {
                    private_data: private_data.to_vec(),
                },
            );
            return Ok(());
        }
        let peer = peer.and_then(|p| {
            let i = s.cm.ids.get(&p)?;
            Some((p, i.channel, i.token, i.qp?))
        });
        let Some((peer, pchan, ptoken, pqp)) = peer else {
            // The host vanished: librdmacm moved the QP to RTS and the REP went out, but
            // nobody answers it; its retries run out.
            if let Some(q) = s.qps.get_mut(&qp) {
                q.state = QpState::Rts;
            }
            if let Some(i) = s.cm.ids.get_mut(&self.id) {
                i.exchange = Exchange::Idle;
            }
            s.cm.push(chan, Ev::Unreachable { token });
            return Ok(());
        };
        link(&mut s, qp, pqp);
        if let Some(p) = s.cm.ids.get_mut(&peer) {
            p.exchange = Exchange::RepRcvd;
        }
        s.cm.push(
            pchan,
            Ev::Established {
                id: peer,
                token: ptoken,
                private_data: private_data.to_vec(),
            },
        );
        Ok(())
    }

    /// Accepts, granting this side `initiator_depth` RDMA READs in flight (at most what the
    /// request's event reported) and the peer none (responder resources 0, as a target).
    /// The RNR NAK timer is not kept: the soft provider retries a SEND as soon as a receive
    /// is posted.
    pub fn accept_with(
        &self,
        private_data: &[u8],
        initiator_depth: u8,
        _min_rnr_timer: u8,
    ) -> Result<(), VerbsError> {
        self.accept(private_data)?;
        let qp = self.fabric.lock().cm.ids.get(&self.id).and_then(|i| i.qp);
        if let Some(qp) = qp {
            self.fabric.accepted_with(qp, initiator_depth);
        }
        Ok(())
    }

    /// The QP's RDMA READ depths, once `accept_with` set them ([`Fabric::read_depths`]).
    pub fn read_depths(&self) -> Option<ReadDepths> {
        self.qpn().and_then(|q| self.fabric.read_depths(q))
    }

    /// Sets how many RDMA READs this side takes at once from its peer, before `connect`
    /// (rdma_cm's responder resources; 16 unless set).
    pub fn set_responder_resources(&self, n: u8) {
        if let Some(i) = self.fabric.lock().cm.ids.get_mut(&self.id) {
            i.responder_resources = n;
        }
    }

    /// Rejects a connect request with private data.
    pub fn reject(&self, private_data: &[u8]) -> Result<(), VerbsError> {
        let mut s = self.fabric.lock();
        let Some(me) = s.cm.ids.get_mut(&self.id) else {
            return Ok(());
        };
        me.exchange = Exchange::Idle;
        let (link, peer) = (me.link, me.peer);
        if let Some(link) = link {
            s.send_frame(
                link,
                super::tcp::Frame::Reject {
                    private_data: private_data.to_vec(),
                },
            );
            return Ok(());
        }
        if let Some(p) = peer {
            s.cm_rejected(p, private_data.to_vec());
        }
        Ok(())
    }

    /// Disconnects: the QP goes to ERR (whatever the exchange's state, as with rdma_cm); on a
    /// connection, the peer sees `Disconnected` (and answers with its own disconnect, as with
    /// rdma_cm) and each side sees `Disconnected` then `TimewaitExit`.
    pub fn disconnect(&self) -> Result<(), VerbsError> {
        let mut s = self.fabric.lock();
        let Some(me) = s.cm.ids.get_mut(&self.id) else {
            return Ok(());
        };
        if !me.connected {
            if let Some(q) = me.qp {
                s.qp_error(q);
            }
            return Ok(());
        }
        me.connected = false;
        let (chan, token, qp, peer) = (me.channel, me.token, me.qp, me.peer);
        if let Some(q) = qp {
            s.qp_error(q);
        }
        s.cm.push(chan, Ev::Disconnected { token });
        s.cm.push(chan, Ev::TimewaitExit { token });
        if let Some(link) = s.cm.ids.get(&self.id).and_then(|i| i.link) {
            s.send_frame(link, super::tcp::Frame::Disconnect);
        }
        if let Some(p) = peer
            .and_then(|p| s.cm.ids.get(&p))
            .filter(|p| p.connected)
            .map(|p| (p.channel, p.token))
        {
            s.cm.push(p.0, Ev::Disconnected { token: p.1 });
        }
        Ok(())
    }

    /// The host this ID belongs to vanishes without a word (its machine lost power, its cable
    /// was pulled): the ID and its QP are gone here, and nothing is sent. An accepting side
    /// waiting for its RTU hears `Unreachable` (its REP's retries run out), one that accepts
    /// later likewise; a connection already established hears nothing (its peer finds out by
    /// keep-alive or when its sends fail). On the TCP wire the stream closes, which the other
    /// process sees as a host process that went away: `Rejected` during the exchange,
    /// `Disconnected` once established.
    pub fn vanish(mut self) {
        let mut s = self.fabric.lock();
        let me = s.cm.ids.remove(&self.id);
        let link = me.as_ref().and_then(|m| m.link);
        if let Some(p) = me.as_ref().and_then(|m| m.peer) {
            if let Some(pi) = s.cm.ids.get_mut(&p) {
                if pi.exchange == Exchange::RepSent {
                    pi.exchange = Exchange::Idle;
                    let (chan, token) = (pi.channel, pi.token);
                    s.cm.push(chan, Ev::Unreachable { token });
                }
            }
        }
        if let Some(l) = link {
            if let Some(l) = s.links.get_mut(&l) {
                l.cm_id = None;
            }
            s.links.remove(&l);
        }
        drop(s);
        // The QP is destroyed (its sends waiting at the peer fail as a dead link's would);
        // `Drop` finds no state left to tell anyone about.
        self.qp.take();
    }

    /// `rdma_notify(IBV_EVENT_COMM_EST)`: an accepting ID still waiting for its RTU is
    /// established (it hears `Established`); EISCONN if it is established already.
    pub fn notify_established(&self) -> Result<(), VerbsError> {
        self.fabric.lock().cm_notify_established(self.id)
    }

    /// Posts a chain of send work requests on the connection's QP.
    pub fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<(), VerbsError> {
        self.qp
            .as_ref()
            .ok_or(VerbsError::Invalid {
                op: "post_send",
                why: "no QP",
            })?
            .post_send(wrs)
    }

    /// The RNR NAK timer: none, the soft provider retries a SEND as soon as a receive is
    /// posted.
    pub fn min_rnr_timer(&self) -> Option<u8> {
        None
    }

    /// Moves the QP to ERR.
    pub fn to_error(&self) -> Result<(), VerbsError> {
        self.qp
            .as_ref()
            .ok_or(VerbsError::Invalid {
                op: "modify_qp",
                why: "no QP",
            })?
            .to_error();
        Ok(())
    }

    /// Sets how often a SEND meeting an empty receive queue is retried (7: forever).
    pub fn set_rnr_retry(&self, n: u8) {
        if let Some(q) = &self.qp {
            q.set_rnr_retry(n);
        }
    }
}

impl Drop for CmId {
    fn drop(&mut self) {
        let _ = self.disconnect();
        let mut s = self.fabric.lock();
        if let Some(a) = self.listen_addr {
            s.cm.listeners.remove(&a);
        }
        // An exchange under way ends with a REJ (the IB CM's `cm_destroy_id`).
        if let Some(me) = s.cm.ids.remove(&self.id) {
            if me.exchange.pending() {
                match (me.link, me.peer) {
                    (Some(link), _) => s.send_frame(
                        link,
                        super::tcp::Frame::Reject {
                            private_data: Vec::new(),
                        },
                    ),
                    (None, Some(p)) => s.cm_rejected(p, Vec::new()),
                    (None, None) => {}
                }
            }
        }
        let acceptor = s.cm.acceptors.remove(&self.id);
        drop(s);
        if let Some(l) = acceptor {
            super::tcp::stop_acceptor(l);
        }
        // The QP (if any) is destroyed after the ID's state, as rdma_destroy_qp then
        // rdma_destroy_id would.
        self.qp.take();
    }
}
