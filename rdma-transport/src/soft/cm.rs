//! The soft connection manager: rdma_cm's model (listen, connect with private data, accept or
//! reject with private data, disconnect) with events on a pollable channel.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;

use super::{link, EventFd, Fabric, Qp};
use crate::types::VerbsError;

/// A connection manager event.
#[derive(Debug)]
pub enum CmEvent {
    /// A peer asks to connect: accept or reject `id`.
    ConnectRequest {
        /// The new connection's ID.
        id: CmId,
        /// The peer's private data.
        private_data: Vec<u8>,
    },
    /// The connection is up.
    Established {
        /// Which connection.
        id: u32,
        /// The accepting side's private data (on the connecting side).
        private_data: Vec<u8>,
    },
    /// The peer refused the connection, or nobody listens.
    Rejected {
        /// Which connection.
        id: u32,
        /// The refusing side's private data (empty when nobody listens).
        private_data: Vec<u8>,
    },
    /// The connection went down.
    Disconnected {
        /// Which connection.
        id: u32,
    },
    /// The connection's time-wait is over: its QP may be reused.
    TimewaitExit {
        /// Which connection.
        id: u32,
    },
}

enum Ev {
    Request { id: u32, private_data: Vec<u8> },
    Established { id: u32, private_data: Vec<u8> },
    Rejected { id: u32, private_data: Vec<u8> },
    Disconnected { id: u32 },
    TimewaitExit { id: u32 },
}

struct IdState {
    channel: u32,
    qp: Option<u32>,
    peer: Option<u32>,
    connected: bool,
}

struct ChannelState {
    events: VecDeque<Ev>,
    fd: Arc<EventFd>,
}

/// The CM's part of a fabric's state.
#[derive(Default)]
pub(crate) struct CmState {
    listeners: HashMap<SocketAddr, (u32, u32)>,
    ids: HashMap<u32, IdState>,
    channels: HashMap<u32, ChannelState>,
}

impl CmState {
    fn push(&mut self, channel: u32, ev: Ev) {
        if let Some(c) = self.channels.get_mut(&channel) {
            c.events.push_back(ev);
            c.fd.signal();
        }
    }
}

/// An event channel: the pollable source of CM events.
#[derive(Debug)]
pub struct CmChannel {
    fabric: Fabric,
    id: u32,
    fd: Arc<EventFd>,
}

/// A listening endpoint.
#[derive(Debug)]
pub struct Listener {
    fabric: Fabric,
    addr: SocketAddr,
}

/// One connection (or connection attempt).
#[derive(Debug)]
pub struct CmId {
    fabric: Fabric,
    id: u32,
}

impl Fabric {
    /// A new CM event channel.
    pub fn cm_channel(&self) -> Result<CmChannel, VerbsError> {
        let fd = Arc::new(
            EventFd::new()
                .map_err(|e| VerbsError::os("eventfd", e.raw_os_error().unwrap_or(libc::EIO)))?,
        );
        let mut s = self.lock();
        let id = s.alloc_id();
        s.cm.channels.insert(
            id,
            ChannelState {
                events: VecDeque::new(),
                fd: Arc::clone(&fd),
            },
        );
        Ok(CmChannel {
            fabric: self.clone(),
            id,
            fd,
        })
    }
}

impl CmChannel {
    /// The fd that turns readable when an event is queued.
    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Listens on `addr`; a second listener on the same address is refused (EADDRINUSE).
    pub fn listen(&self, addr: SocketAddr) -> Result<Listener, VerbsError> {
        let mut s = self.fabric.lock();
        if s.cm.listeners.contains_key(&addr) {
            return Err(VerbsError::os("rdma_listen", libc::EADDRINUSE));
        }
        let lid = s.alloc_id();
        s.cm.listeners.insert(addr, (self.id, lid));
        Ok(Listener {
            fabric: self.fabric.clone(),
            addr,
        })
    }

    /// Connects `qp` to whoever listens on `addr`, with `private_data`; the answer comes as
    /// `Established` or `Rejected` on this channel.
    pub fn connect(
        &self,
        addr: SocketAddr,
        qp: &Qp,
        private_data: &[u8],
    ) -> Result<CmId, VerbsError> {
        if private_data.len() > 56 {
            return Err(VerbsError::os("rdma_connect", libc::EINVAL));
        }
        let mut s = self.fabric.lock();
        let cid = s.alloc_id();
        s.cm.ids.insert(
            cid,
            IdState {
                channel: self.id,
                qp: Some(qp.qpn),
                peer: None,
                connected: false,
            },
        );
        match s.cm.listeners.get(&addr).copied() {
            Some((lchan, _)) => {
                let sid = s.alloc_id();
                s.cm.ids.insert(
                    sid,
                    IdState {
                        channel: lchan,
                        qp: None,
                        peer: Some(cid),
                        connected: false,
                    },
                );
                if let Some(c) = s.cm.ids.get_mut(&cid) {
                    c.peer = Some(sid);
                }
                s.cm.push(
                    lchan,
                    Ev::Request {
                        id: sid,
                        private_data: private_data.to_vec(),
                    },
                );
            }
            None => s.cm.push(
                self.id,
                Ev::Rejected {
                    id: cid,
                    private_data: Vec::new(),
                },
            ),
        }
        Ok(CmId {
            fabric: self.fabric.clone(),
            id: cid,
        })
    }

    /// The next event, without blocking.
    pub fn next_event(&self) -> Option<CmEvent> {
        let mut s = self.fabric.lock();
        let c = s.cm.channels.get_mut(&self.id)?;
        let ev = c.events.pop_front();
        if c.events.is_empty() {
            c.fd.clear();
        }
        drop(s);
        Some(match ev? {
            Ev::Request { id, private_data } => CmEvent::ConnectRequest {
                id: CmId {
                    fabric: self.fabric.clone(),
                    id,
                },
                private_data,
            },
            Ev::Established { id, private_data } => CmEvent::Established { id, private_data },
            Ev::Rejected { id, private_data } => CmEvent::Rejected { id, private_data },
            Ev::Disconnected { id } => CmEvent::Disconnected { id },
            Ev::TimewaitExit { id } => CmEvent::TimewaitExit { id },
        })
    }
}

impl Drop for CmChannel {
    fn drop(&mut self) {
        self.fabric.lock().cm.channels.remove(&self.id);
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.fabric.lock().cm.listeners.remove(&self.addr);
    }
}

impl CmId {
    /// The connection's ID, as events name it.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// Accepts a connect request with `qp` and `private_data`: both QPs go to RTS, both sides
    /// see `Established`.
    pub fn accept(&self, qp: &Qp, private_data: &[u8]) -> Result<(), VerbsError> {
        if private_data.len() > 196 {
            return Err(VerbsError::os("rdma_accept", libc::EINVAL));
        }
        let mut s = self.fabric.lock();
        let (chan, peer) = match s.cm.ids.get(&self.id) {
            Some(i) if !i.connected => (i.channel, i.peer),
            _ => return Err(VerbsError::os("rdma_accept", libc::EINVAL)),
        };
        let Some(peer) = peer else {
            return Err(VerbsError::os("rdma_accept", libc::EINVAL));
        };
        let Some((pchan, Some(pqp))) = s.cm.ids.get(&peer).map(|p| (p.channel, p.qp)) else {
            return Err(VerbsError::os("rdma_accept", libc::ECONNREFUSED));
        };
        link(&mut s, qp.qpn, pqp);
        for (id, q) in [(self.id, Some(qp.qpn)), (peer, Some(pqp))] {
            if let Some(i) = s.cm.ids.get_mut(&id) {
                i.connected = true;
                i.qp = q;
            }
        }
        s.cm.push(
            pchan,
            Ev::Established {
                id: peer,
                private_data: private_data.to_vec(),
            },
        );
        s.cm.push(
            chan,
            Ev::Established {
                id: self.id,
                private_data: Vec::new(),
            },
        );
        Ok(())
    }

    /// Refuses a connect request with `private_data`.
    pub fn reject(&self, private_data: &[u8]) -> Result<(), VerbsError> {
        let mut s = self.fabric.lock();
        let peer = s.cm.ids.get(&self.id).and_then(|i| i.peer);
        if let Some(p) = peer {
            if let Some(pchan) = s.cm.ids.get(&p).map(|i| i.channel) {
                s.cm.push(
                    pchan,
                    Ev::Rejected {
                        id: p,
                        private_data: private_data.to_vec(),
                    },
                );
            }
        }
        s.cm.ids.remove(&self.id);
        Ok(())
    }

    /// Disconnects: both QPs go to ERR (their work requests flush), both sides see
    /// `Disconnected` and then `TimewaitExit`.
    pub fn disconnect(&self) -> Result<(), VerbsError> {
        let mut s = self.fabric.lock();
        let Some(i) = s.cm.ids.get(&self.id) else {
            return Ok(());
        };
        if !i.connected {
            return Ok(());
        }
        let peer = i.peer;
        let mut ends = vec![self.id];
        ends.extend(peer);
        for id in &ends {
            let (qp, chan) = match s.cm.ids.get_mut(id) {
                Some(i) if i.connected => {
                    i.connected = false;
                    (i.qp, i.channel)
                }
                _ => continue,
            };
            if let Some(q) = qp {
                s.qp_error(q);
            }
            s.cm.push(chan, Ev::Disconnected { id: *id });
            s.cm.push(chan, Ev::TimewaitExit { id: *id });
        }
        Ok(())
    }
}

impl Drop for CmId {
    fn drop(&mut self) {
        let _ = self.disconnect();
        self.fabric.lock().cm.ids.remove(&self.id);
    }
}
