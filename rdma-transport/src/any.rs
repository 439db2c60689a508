//! One set of verbs types over both providers, so that the daemon's data path is written once:
//! each type is an enum of the soft and the ibverbs object, and each call goes to whichever it
//! holds (one predictable branch per call). Objects of different providers cannot be mixed:
//! doing so is an error, not a panic.

use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::time::Duration;

#[cfg(feature = "ibverbs")]
use crate::ibverbs;
use crate::soft;
use crate::types::*;

#[cfg(feature = "ibverbs")]
fn mixed(op: &'static str) -> VerbsError {
    VerbsError::Invalid {
        op,
        why: "objects of different providers",
    }
}

/// Forwards a call to whichever provider's object `self` holds.
macro_rules! forward {
    ($self:expr, $x:ident => $e:expr) => {
        match $self {
            Self::Soft($x) => $e,
            #[cfg(feature = "ibverbs")]
            Self::Verbs($x) => $e,
        }
    };
}

/// A device.
#[derive(Debug, Clone)]
pub enum Device {
    /// Soft provider.
    Soft(soft::Device),
    /// ibverbs provider.
    #[cfg(feature = "ibverbs")]
    Verbs(ibverbs::Device),
}

/// A protection domain (clones name the same domain).
#[derive(Debug, Clone)]
pub enum Pd {
    /// Soft provider.
    Soft(soft::Pd),
    /// ibverbs provider.
    #[cfg(feature = "ibverbs")]
    Verbs(ibverbs::Pd),
}

/// A memory region.
#[derive(Debug)]
pub enum Mr {
    /// Soft provider.
    Soft(soft::Mr),
    /// ibverbs provider.
    #[cfg(feature = "ibverbs")]
    Verbs(ibverbs::Mr),
}

/// A completion queue.
#[derive(Debug)]
pub enum Cq {
    /// Soft provider.
    Soft(soft::Cq),
    /// ibverbs provider.
    #[cfg(feature = "ibverbs")]
    Verbs(ibverbs::Cq),
}

/// A shared receive queue.
#[derive(Debug)]
pub enum Srq {
    /// Soft provider.
    Soft(soft::Srq),
    /// ibverbs provider.
    #[cfg(feature = "ibverbs")]
    Verbs(ibverbs::Srq),
}

impl Device {
    /// Limits.
    pub fn attr(&self) -> Result<DeviceAttr, VerbsError> {
        forward!(self, d => d.attr())
    }
    /// Makes this device and every object made on it hold rdma_cm ID `id` instead of the
    /// one it holds, when `id` is of librdmacm's context of this device (ibverbs): the ID it
    /// held (a listener's) can then go, and stop listening, while the objects live on. Soft
    /// devices hold no ID; an ID of another context changes nothing.
    pub fn hold_id(&self, id: &cm::CmId) {
        #[cfg(feature = "ibverbs")]
        if let (Self::Verbs(d), cm::CmId::Verbs(id)) = (self, id) {
            d.hold_id(id);
        }
        #[cfg(not(feature = "ibverbs"))]
        let _ = id;
    }
    /// Whether anything but this one handle holds the device: objects made on it (PDs, CQs,
    /// SRQs, MRs, QPs) or other handles of it.
    pub fn in_use(&self) -> bool {
        forward!(self, d => d.in_use())
    }
    /// The async event fd.
    pub fn async_fd(&self) -> RawFd {
        forward!(self, d => d.async_fd())
    }
    /// Whether the device sends `QpLastWqeReached` for SRQ-attached QPs in error (decided
    /// from its transport and vendor on ibverbs: never on iWARP, rxe or siw).
    pub fn sends_last_wqe(&self) -> bool {
        forward!(self, d => d.sends_last_wqe())
    }
    /// Whether an RDMA READ's sink must be registered for remote write (hardware iWARP;
    /// soft: when its faults say so).
    pub fn rdma_read_sink_needs_remote_write(&self) -> bool {
        forward!(self, d => d.rdma_read_sink_needs_remote_write())
    }
    /// Whether the device can post SEND_WITH_INVALIDATE (`IBV_DEVICE_MEM_MGT_EXTENSIONS`;
    /// soft: yes unless `Faults::no_send_with_invalidate`). Where it cannot, answer with a
    /// plain SEND: the host then invalidates its key itself.
    pub fn supports_send_with_invalidate(&self) -> bool {
        forward!(self, d => d.supports_send_with_invalidate())
    }
    /// The next async event, without blocking.
    pub fn next_event(&self) -> Option<AsyncEvent> {
        forward!(self, d => d.next_event())
    }
    /// The next async event and its number, in the order events are read (from every
    /// device of the process on ibverbs, of the fabric on soft).
    pub fn next_numbered_event(&self) -> Option<(u64, AsyncEvent)> {
        forward!(self, d => d.next_numbered_event())
    }
    /// How many async events have been read so far: every event read from now on is
    /// numbered at least this. Taken before creating a QP, it tells the QP's events from
    /// those of a destroyed QP whose number the device gave to it, read (as a destroyed QP's
    /// unread events are dropped) and numbered before.
    pub fn events_read(&self) -> u64 {
        forward!(self, d => d.events_read())
    }
    /// Port attributes.
    pub fn port_attr(&self, port: u8) -> Result<PortAttr, VerbsError> {
        forward!(self, d => d.port_attr(port))
    }
    /// A GID.
    pub fn gid(&self, port: u8, index: u32) -> Result<[u8; 16], VerbsError> {
        forward!(self, d => d.gid(port, index))
    }
    /// A protection domain.
    pub fn alloc_pd(&self) -> Result<Pd, VerbsError> {
        match self {
            Self::Soft(d) => d.alloc_pd().map(Pd::Soft),
            #[cfg(feature = "ibverbs")]
            Self::Verbs(d) => d.alloc_pd().map(Pd::Verbs),
        }
    }
    /// A CQ with its completion channel.
    pub fn create_cq(&self, cqe: u32) -> Result<Cq, VerbsError> {
        match self {
            Self::Soft(d) => d.create_cq(cqe).map(Cq::Soft),
            #[cfg(feature = "ibverbs")]
            Self::Verbs(d) => d.create_cq(cqe).map(Cq::Verbs),
        }
    }
}

impl Pd {
    /// Registers caller memory.
    ///
    /// # Safety
    ///
    /// As for the providers' `reg_mr`: the memory stays mapped until the `Mr` is dropped and is
    /// treated as shared with the NIC.
    pub unsafe fn reg_mr(
        &self,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<Mr, VerbsError> {
        match self {
            // SAFETY: the caller upholds the contract, which is the same.
            Self::Soft(p) => unsafe { p.reg_mr(addr, len, access) }.map(Mr::Soft),
            #[cfg(feature = "ibverbs")]
            // SAFETY: as above.
            Self::Verbs(p) => unsafe { p.reg_mr(addr, len, access) }.map(Mr::Verbs),
        }
    }
    /// Allocates and registers memory.
    pub fn alloc_mr(&self, len: usize, access: Access) -> Result<Mr, VerbsError> {
        match self {
            Self::Soft(p) => p.alloc_mr(len, access).map(Mr::Soft),
            #[cfg(feature = "ibverbs")]
            Self::Verbs(p) => p.alloc_mr(len, access).map(Mr::Verbs),
        }
    }
    /// A shared receive queue.
    pub fn create_srq(&self, max_wr: u32, max_sge: u32) -> Result<Srq, VerbsError> {
        match self {
            Self::Soft(p) => p.create_srq(max_wr, max_sge).map(Srq::Soft),
            #[cfg(feature = "ibverbs")]
            Self::Verbs(p) => p.create_srq(max_wr, max_sge).map(Srq::Verbs),
        }
    }
}

impl Mr {
    /// Local key.
    pub fn lkey(&self) -> u32 {
        forward!(self, m => m.lkey())
    }
    /// Remote key.
    pub fn rkey(&self) -> u32 {
        forward!(self, m => m.rkey())
    }
    /// Address.
    pub fn addr(&self) -> u64 {
        forward!(self, m => m.addr())
    }
    /// Length.
    pub fn len(&self) -> usize {
        forward!(self, m => m.len())
    }
    /// Whether the length is zero.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// An SGE for `len` bytes at `offset`.
    pub fn sge(&self, offset: usize, len: u32) -> Sge {
        forward!(self, m => m.sge(offset, len))
    }
    /// Copies bytes out of the region.
    pub fn read(&self, offset: usize, out: &mut [u8]) {
        forward!(self, m => m.read(offset, out))
    }
    /// Copies bytes into the region.
    pub fn write(&self, offset: usize, data: &[u8]) {
        forward!(self, m => m.write(offset, data))
    }
}

impl Cq {
    /// Polls completions.
    pub fn poll(&self, out: &mut [Wc]) -> Result<usize, VerbsError> {
        forward!(self, c => c.poll(out))
    }
    /// Arms the completion channel.
    pub fn req_notify(&self) -> Result<(), VerbsError> {
        forward!(self, c => c.req_notify())
    }
    /// Takes the channel's notification.
    pub fn ack_event(&self) -> bool {
        forward!(self, c => c.ack_event())
    }
    /// The completion channel's fd.
    pub fn channel_fd(&self) -> RawFd {
        forward!(self, c => c.channel_fd())
    }
    /// The handle async events name it by.
    pub fn id(&self) -> u32 {
        forward!(self, c => c.id())
    }
}

impl Srq {
    /// Posts receives, in order; on failure [`VerbsError::posted`] says how many were.
    pub fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<(), VerbsError> {
        forward!(self, s => s.post_recv(wrs))
    }
    /// Arms the limit.
    pub fn arm_limit(&self, limit: u32) -> Result<(), VerbsError> {
        forward!(self, s => s.arm_limit(limit))
    }
    /// Attributes.
    pub fn query(&self) -> Result<SrqAttr, VerbsError> {
        forward!(self, s => s.query())
    }
    /// The handle async events name it by.
    pub fn id(&self) -> u32 {
        forward!(self, s => s.id())
    }
}

/// The connection manager over both providers.
pub mod cm {
    use super::*;

    /// A CM event.
    pub type CmEvent = crate::types::CmEvent<CmId>;

    /// An event channel.
    #[derive(Debug)]
    pub enum CmChannel {
        /// Soft provider.
        Soft(soft::cm::CmChannel),
        /// ibverbs provider.
        #[cfg(feature = "ibverbs")]
        Verbs(ibverbs::cm::CmChannel),
    }

    /// A CM ID.
    #[derive(Debug)]
    pub enum CmId {
        /// Soft provider.
        Soft(soft::cm::CmId),
        /// ibverbs provider.
        #[cfg(feature = "ibverbs")]
        Verbs(ibverbs::cm::CmId),
    }

    fn convert<I>(e: crate::types::CmEvent<I>, wrap: impl FnOnce(I) -> CmId) -> CmEvent {
        use crate::types::CmEvent as E;
        match e {
            E::ConnectRequest {
                id,
                private_data,
                initiator_depth,
                responder_resources,
            } => E::ConnectRequest {
                id: wrap(id),
                private_data,
                initiator_depth,
                responder_resources,
            },
            E::Established { id, private_data } => E::Established { id, private_data },
            E::Rejected { id, private_data } => E::Rejected { id, private_data },
            E::Disconnected { id } => E::Disconnected { id },
            E::TimewaitExit { id } => E::TimewaitExit { id },
            E::DeviceRemoval { id } => E::DeviceRemoval { id },
            E::Unreachable { id } => E::Unreachable { id },
            E::ConnectError { id } => E::ConnectError { id },
            E::AddrChange { id } => E::AddrChange { id },
        }
    }

    impl CmChannel {
        /// The channel's fd.
        pub fn fd(&self) -> RawFd {
            forward!(self, c => c.fd())
        }
        /// Whether an ID made on the channel (a listener or a connection) is still open:
        /// until none is, the channel must stay (rdma_cm delivers their events on it).
        pub fn has_ids(&self) -> bool {
            forward!(self, c => c.has_ids())
        }
        /// Listens on `addr`.
        pub fn listen(&self, addr: SocketAddr, backlog: i32) -> Result<CmId, VerbsError> {
            match self {
                Self::Soft(c) => c.listen(addr, backlog).map(CmId::Soft),
                #[cfg(feature = "ibverbs")]
                Self::Verbs(c) => c.listen(addr, backlog).map(CmId::Verbs),
            }
        }
        /// An ID bound to local address `addr` (port 0) and its device, not listening, that
        /// a device handle may hold in place of a listening ID that is to go (`Device::hold_id`);
        /// `None` on the soft provider, whose handles hold no ID.
        pub fn bind_holder(&self, addr: SocketAddr) -> Option<Result<CmId, VerbsError>> {
            match self {
                Self::Soft(_) => {
                    let _ = addr;
                    None
                }
                #[cfg(feature = "ibverbs")]
                Self::Verbs(c) => Some(c.bind(addr).map(CmId::Verbs)),
            }
        }
        /// Resolves `addr` and a route to it.
        pub fn resolve(&self, addr: SocketAddr, timeout: Duration) -> Result<CmId, VerbsError> {
            match self {
                Self::Soft(c) => c.resolve(addr, timeout).map(CmId::Soft),
                #[cfg(feature = "ibverbs")]
                Self::Verbs(c) => c.resolve(addr, timeout).map(CmId::Verbs),
            }
        }
        /// The next event, without blocking.
        pub fn next_event(&self) -> Option<CmEvent> {
            match self {
                Self::Soft(c) => c.next_event().map(|e| convert(e, CmId::Soft)),
                #[cfg(feature = "ibverbs")]
                Self::Verbs(c) => c.next_event().map(|e| convert(e, CmId::Verbs)),
            }
        }
    }

    impl CmId {
        /// The token events name it by.
        pub fn token(&self) -> usize {
            forward!(self, c => c.token())
        }
        /// Its device.
        pub fn device(&self) -> Result<Device, VerbsError> {
            match self {
                Self::Soft(c) => c.device().map(Device::Soft),
                #[cfg(feature = "ibverbs")]
                Self::Verbs(c) => c.device().map(Device::Verbs),
            }
        }
        /// After its device was removed: lets go of the device once nothing made on it is
        /// open (see the providers' `release_removed_device`).
        pub fn release_removed_device(&self) -> Result<DeviceRelease, VerbsError> {
            forward!(self, c => c.release_removed_device())
        }
        /// Creates the connection's QP.
        pub fn create_qp(
            &mut self,
            pd: &Pd,
            cq: &Cq,
            srq: &Srq,
            caps: QpCaps,
        ) -> Result<u32, VerbsError> {
            match (self, pd, cq, srq) {
                (Self::Soft(c), Pd::Soft(p), Cq::Soft(q), Srq::Soft(s)) => {
                    c.create_qp(p, q, s, caps)
                }
                #[cfg(feature = "ibverbs")]
                (Self::Verbs(c), Pd::Verbs(p), Cq::Verbs(q), Srq::Verbs(s)) => {
                    c.create_qp(p, q, s, caps)
                }
                #[cfg(feature = "ibverbs")]
                _ => Err(mixed("create_qp")),
            }
        }
        /// The QP number.
        pub fn qpn(&self) -> Option<u32> {
            forward!(self, c => c.qpn())
        }
        /// Whether rdma_cm holds the ID's QP (tests of who may touch it).
        #[doc(hidden)]
        pub fn rdma_cm_holds_qp(&self) -> bool {
            forward!(self, c => c.rdma_cm_holds_qp())
        }
        /// The address of the other side, where known.
        pub fn peer_addr(&self) -> Option<SocketAddr> {
            forward!(self, c => c.peer_addr())
        }
        /// The QP's state.
        pub fn qp_state(&self) -> Option<QpState> {
            forward!(self, c => c.qp_state())
        }
        /// The QP's real inline limit.
        pub fn max_inline(&self) -> Option<u32> {
            forward!(self, c => c.max_inline())
        }
        /// Connects.
        pub fn connect(&self, private_data: &[u8]) -> Result<(), VerbsError> {
            forward!(self, c => c.connect(private_data))
        }
        /// Accepts.
        pub fn accept(&self, private_data: &[u8]) -> Result<(), VerbsError> {
            forward!(self, c => c.accept(private_data))
        }
        /// Accepts as a target: this side may have `initiator_depth` RDMA READs in flight,
        /// the peer none (responder resources 0); its QP advertises the RNR NAK timer
        /// `min_rnr_timer` (InfiniBand encoding) from the moment it can receive.
        pub fn accept_with(
            &self,
            private_data: &[u8],
            initiator_depth: u8,
            min_rnr_timer: u8,
        ) -> Result<(), VerbsError> {
            forward!(self, c => c.accept_with(private_data, initiator_depth, min_rnr_timer))
        }
        /// The RNR NAK timer the QP advertises (soft: none, it retries a SEND as soon as a
        /// receive is posted).
        pub fn min_rnr_timer(&self) -> Option<u8> {
            forward!(self, c => c.min_rnr_timer())
        }
        /// Sets how many RDMA READs this side takes at once from its peer, before `connect`
        /// (soft only; ibverbs connects with 16).
        pub fn set_responder_resources(&self, n: u8) {
            if let CmId::Soft(c) = self {
                c.set_responder_resources(n);
            }
        }
        /// Rejects.
        pub fn reject(&self, private_data: &[u8]) -> Result<(), VerbsError> {
            forward!(self, c => c.reject(private_data))
        }
        /// Tells the CM that the connection carries messages (on `AsyncEvent::CommEst`).
        pub fn notify_established(&self) -> Result<(), VerbsError> {
            forward!(self, c => c.notify_established())
        }
        /// Disconnects.
        pub fn disconnect(&self) -> Result<(), VerbsError> {
            forward!(self, c => c.disconnect())
        }
        /// Posts a chain of send work requests. On failure [`VerbsError::posted`] is the
        /// index of the first work request not posted: those before it were posted and
        /// complete (or flush) as usual; it and every one after it were not and never
        /// complete.
        pub fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<(), VerbsError> {
            forward!(self, c => c.post_send(wrs))
        }
        /// The QP's RDMA READ depths as its connection set them (soft: once `accept_with`
        /// set them, on both QPs of an in-process connection).
        pub fn read_depths(&self) -> Option<ReadDepths> {
            forward!(self, c => c.read_depths())
        }
        /// Moves the QP to ERR.
        pub fn to_error(&self) -> Result<(), VerbsError> {
            forward!(self, c => c.to_error())
        }
    }
}
