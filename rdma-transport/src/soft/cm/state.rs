//! What the CM keeps behind the fabric's lock: IDs, channels and listeners.

use super::*;

pub(crate) struct IdState {
    /// The TCP link, for a connection to another process.
    pub(super) link: Option<u32>,
    pub(super) channel: u32,
    pub(super) token: usize,
    pub(super) dst: Option<SocketAddr>,
    /// Where the other side is: `dst` for a connecting ID, the TCP peer for one made by an
    /// acceptor (nothing for an in-process connection's accepting side).
    pub(super) peer_addr: Option<SocketAddr>,
    pub(super) peer: Option<u32>,
    pub(super) qp: Option<u32>,
    pub(super) connected: bool,
    pub(super) exchange: Exchange,
    pub(super) private_data: Vec<u8>,
    /// RDMA READs this side takes at once from its peer (what rdma_cm calls the responder
    /// resources); the peer's connect request event reports it as its initiator depth.
    pub(super) responder_resources: u8,
}

pub(crate) struct ChannelState {
    pub(super) events: VecDeque<Ev>,
    pub(super) fd: Arc<EventFd>,
}

/// The CM's part of a fabric's state.
#[derive(Default)]
pub(crate) struct CmState {
    pub(super) remote_ids: u32,
    pub(super) remote_listener: HashMap<u32, u32>,
    pub(super) listeners: HashMap<SocketAddr, u32>,
    pub(crate) ids: HashMap<u32, IdState>,
    pub(crate) channels: HashMap<u32, ChannelState>,
    /// Per listening ID on a networked fabric, its TCP listener (a handle to the socket its
    /// acceptor thread waits on), shut down when the ID goes so that the address is free again.
    pub(crate) acceptors: HashMap<u32, std::net::TcpListener>,
    /// RTUs still to fail (`Fabric::fail_establishments`).
    pub(super) fail_establish: u32,
    /// RTUs still to lose (`Fabric::lose_rtus`).
    pub(super) lose_rtu: u32,
}

impl CmState {
    /// Whether listener ID `id` still listens.
    pub(crate) fn listening(&self, id: u32) -> bool {
        self.ids.contains_key(&id) && self.listeners.values().any(|&l| l == id)
    }

    /// A connect request arrived over TCP for listener `listener`: a new ID on its channel.
    pub(crate) fn remote_request(
        &mut self,
        link: u32,
        listener: u32,
        private_data: Vec<u8>,
        from: Option<SocketAddr>,
    ) -> Option<u32> {
        let chan = self.ids.get(&listener)?.channel;
        // Kept apart from the fabric's IDs: the high bit marks IDs made by a TCP acceptor.
        // After 2^31 of them the counter goes round: an ID still held is skipped.
        let id = loop {
            self.remote_ids = self.remote_ids.wrapping_add(1) & 0x7fff_ffff;
            let id = 0x8000_0000 | self.remote_ids;
            if self.remote_ids != 0 && !self.ids.contains_key(&id) {
                break id;
            }
        };
        let token = NEXT_TOKEN.fetch_add(1, Ordering::Relaxed);
        self.ids.insert(
            id,
            IdState {
                link: Some(link),
                channel: chan,
                token,
                dst: None,
                peer_addr: from,
                peer: None,
                qp: None,
                connected: false,
                exchange: Exchange::ReqRcvd,
                private_data: Vec::new(),
                responder_resources: 16,
            },
        );
        self.remote_listener.insert(id, listener);
        self.push(chan, Ev::Request { id, private_data });
        Some(id)
    }

    /// The listening IDs, by the address each listens on.
    pub(crate) fn listening_ids(&self) -> impl Iterator<Item = (SocketAddr, u32)> + '_ {
        self.listeners.iter().map(|(a, l)| (*a, *l))
    }

    /// Tells the IDs whose QP is one of `qpns`, and the IDs `listening`, of what happened to
    /// their device (`DeviceRemoval`, `AddrChange`: `event` makes it from an ID's token).
    pub(crate) fn device_event(
        &mut self,
        qpns: &[u32],
        listening: &[u32],
        event: impl Fn(usize) -> Ev,
    ) {
        let hit: Vec<(u32, usize)> = self
            .ids
            .iter()
            .filter(|(id, i)| i.qp.is_some_and(|q| qpns.contains(&q)) || listening.contains(id))
            .map(|(_, i)| (i.channel, i.token))
            .collect();
        for (chan, token) in hit {
            self.push(chan, event(token));
        }
    }

    pub(super) fn push(&mut self, channel: u32, ev: Ev) {
        if let Some(c) = self.channels.get_mut(&channel) {
            c.events.push_back(ev);
            c.fd.signal();
        }
    }
}
