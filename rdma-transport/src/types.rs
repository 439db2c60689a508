//! Provider-neutral verbs types: what the data path posts, polls and is told.

use std::fmt;

bitflags::bitflags! {
    /// Memory region access rights, with the values of `IBV_ACCESS_*`.
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
    pub struct Access: u32 {
        /// Local write (receives and RDMA READ land here).
        const LOCAL_WRITE = 1;
        /// Remote peers may RDMA WRITE into the region.
        const REMOTE_WRITE = 1 << 1;
        /// Remote peers may RDMA READ from the region.
        const REMOTE_READ = 1 << 2;
    }
}

/// A scatter/gather element: `length` bytes at `addr` in the region of `lkey`. Laid out as
/// `struct ibv_sge`, so the ibverbs provider hands arrays of it to the NIC as they are.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct Sge {
    /// Address.
    pub addr: u64,
    /// Length.
    pub length: u32,
    /// Local key of the region.
    pub lkey: u32,
}

/// What a send work request does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendOp {
    /// SEND into the peer's next receive.
    Send,
    /// SEND, and invalidate `rkey` at the peer.
    SendWithInvalidate {
        /// The remote key to invalidate.
        rkey: u32,
    },
    /// RDMA WRITE to `remote_addr` with `rkey`.
    RdmaWrite {
        /// Remote address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
    },
    /// RDMA READ from `remote_addr` with `rkey`.
    RdmaRead {
        /// Remote address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
    },
}

/// Most work requests one `post_send` chain may hold, on every provider: a longer chain is
/// refused with `EINVAL` (the ibverbs provider builds chains on the stack).
pub const MAX_SEND_CHAIN: usize = 16;

/// A send work request. Chains are slices of these, posted with one call.
#[derive(Clone, Copy, Debug)]
pub struct SendWr<'a> {
    /// Returned in the completion.
    pub wr_id: u64,
    /// The operation.
    pub op: SendOp,
    /// Local data (gathered for SEND/WRITE, scattered for READ).
    pub sges: &'a [Sge],
    /// Generate a completion.
    pub signaled: bool,
    /// The message's data, copied into the work request at post time in place of `sges`
    /// (SEND/WRITE only; up to the QP's `max_inline_data`; no memory region needed). Borrowed
    /// for the call, so the provider reads only memory that is there.
    pub inline: Option<&'a [u8]>,
}

/// A receive work request.
#[derive(Clone, Copy, Debug)]
pub struct RecvWr<'a> {
    /// Returned in the completion.
    pub wr_id: u64,
    /// Where the incoming message is scattered, in order.
    pub sges: &'a [Sge],
}

/// Completion status.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WcStatus {
    /// Success.
    Success,
    /// Local length error (the message did not fit the receive).
    LocLenErr,
    /// Local QP operation error.
    LocQpOpErr,
    /// Local protection error (bad lkey or range).
    LocProtErr,
    /// Flushed: the QP is in the error state.
    WrFlushErr,
    /// Remote invalid request.
    RemInvReqErr,
    /// Remote access error (bad rkey, range or rights).
    RemAccessErr,
    /// Remote operation error.
    RemOpErr,
    /// Transport retry counter exceeded (the peer is gone).
    RetryExcErr,
    /// RNR retry counter exceeded (the peer had no receive).
    RnrRetryExcErr,
    /// Anything else.
    GeneralErr,
}

/// What completed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WcOpcode {
    /// A SEND (or SEND with invalidate).
    Send,
    /// An RDMA WRITE.
    RdmaWrite,
    /// An RDMA READ.
    RdmaRead,
    /// A receive.
    Recv,
}

/// A work completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Wc {
    /// The work request's ID.
    pub wr_id: u64,
    /// Status.
    pub status: WcStatus,
    /// What completed (valid on success; receives always say `Recv`).
    pub opcode: WcOpcode,
    /// Bytes received (receives).
    pub byte_len: u32,
    /// The local QP it belongs to.
    pub qp_num: u32,
    /// The remote key the peer invalidated with its SEND, if it did.
    pub invalidated_rkey: Option<u32>,
}

impl Default for Wc {
    fn default() -> Wc {
        Wc {
            wr_id: 0,
            status: WcStatus::GeneralErr,
            opcode: WcOpcode::Recv,
            byte_len: 0,
            qp_num: 0,
            invalidated_rkey: None,
        }
    }
}

/// Queue pair states (RC).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QpState {
    /// Reset.
    Reset,
    /// Initialized.
    Init,
    /// Ready to receive.
    Rtr,
    /// Ready to send.
    Rts,
    /// Error: work requests are flushed.
    Err,
}

/// Asynchronous events, with the object they concern.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AsyncEvent {
    /// A QP hit an error it cannot recover from.
    QpFatal(u32),
    /// Invalid request on a QP.
    QpReqErr(u32),
    /// Access violation on a QP.
    QpAccessErr(u32),
    /// An SRQ-attached QP in error will take no more receives from its SRQ.
    QpLastWqeReached(u32),
    /// A message reached a QP whose connection the CM has not seen established (the
    /// connecting side's RTU was lost): the CM is told with `CmId::notify_established`.
    CommEst(u32),
    /// The SRQ fell below its armed limit (fires once per arming).
    SrqLimitReached(u32),
    /// The SRQ is broken.
    SrqErr(u32),
    /// A CQ overflowed or failed.
    CqErr(u32),
    /// The port came up.
    PortActive(u8),
    /// The port went down.
    PortErr(u8),
    /// The device failed.
    DeviceFatal,
}

impl AsyncEvent {
    /// The QP the event is about, if it is about one.
    pub fn qp(&self) -> Option<u32> {
        match *self {
            AsyncEvent::QpFatal(q)
            | AsyncEvent::QpReqErr(q)
            | AsyncEvent::QpAccessErr(q)
            | AsyncEvent::QpLastWqeReached(q)
            | AsyncEvent::CommEst(q) => Some(q),
            _ => None,
        }
    }
}

/// How far letting go of a removed device has got (`CmId::release_removed_device`, on the
/// listening ID of the device).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceRelease {
    /// Objects made on the device are still open: this many handles hold it (device handles,
    /// PDs, CQs, and for soft MRs, SRQs and QPs). They must go first.
    InUse(usize),
    /// Nothing made on the device is open, but the device is still there: it was not removed,
    /// or its removal has not got that far yet.
    Present,
    /// Nothing of the device is held any more: its objects are gone and its context is closed,
    /// so the kernel can finish removing it. The ID itself is to be dropped now.
    Released,
}

/// Why a verbs call failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum VerbsError {
    /// the call failed with an errno
    #[error("{op}: {}", std::io::Error::from_raw_os_error(*errno))]
    Os {
        /// The call.
        op: &'static str,
        /// errno.
        errno: i32,
    },
    /// the call is not valid now
    #[error("{op}: {why}")]
    Invalid {
        /// The call.
        op: &'static str,
        /// Why.
        why: &'static str,
    },
    /// posting a chain of work requests failed at one of them
    #[error("{op}: {} (work request {posted} of the chain refused; the {posted} before it were posted)", std::io::Error::from_raw_os_error(*errno))]
    Post {
        /// The call (`post_send`, `post_srq_recv`).
        op: &'static str,
        /// errno.
        errno: i32,
        /// How many work requests of the chain, from its start, were posted: those complete
        /// (or flush) as usual. The one at this index and every one after it were not posted
        /// and will never complete.
        posted: usize,
    },
}

impl VerbsError {
    /// The errno, where there is one.
    pub fn errno(&self) -> Option<i32> {
        match self {
            VerbsError::Os { errno, .. } | VerbsError::Post { errno, .. } => Some(*errno),
            VerbsError::Invalid { .. } => None,
        }
    }

    /// For an error of a post (`post_send`, `post_recv`): how many work requests of the
    /// chain, from its start, were posted. Those complete or flush as usual; the one at this
    /// index and every one after it were not posted and never complete. Every failure of a
    /// post reports it (a chain refused whole, or a post on a QP that cannot take work, says
    /// 0); any other error says 0, as nothing was posted.
    pub fn posted(&self) -> usize {
        match self {
            VerbsError::Post { posted, .. } => *posted,
            VerbsError::Os { .. } | VerbsError::Invalid { .. } => 0,
        }
    }

    pub(crate) fn os(op: &'static str, errno: i32) -> VerbsError {
        VerbsError::Os { op, errno }
    }

    /// A post that failed at work request `posted` of its chain, with `errno`.
    pub(crate) fn post(op: &'static str, errno: i32, posted: usize) -> VerbsError {
        VerbsError::Post { op, errno, posted }
    }
}

/// A connected QP's RDMA READ depths, as its connection set them (`ibv_query_qp`'s
/// `max_rd_atomic` and `max_dest_rd_atomic`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadDepths {
    /// RDMA READs this side may have outstanding at its peer: what the peer accepted or
    /// connected with as its responder resources (0: this side may issue none).
    pub initiator: u32,
    /// RDMA READs the peer may have outstanding at this side (this side's responder
    /// resources).
    pub responder: u32,
}

/// QP creation parameters.
#[derive(Clone, Copy, Debug)]
pub struct QpCaps {
    /// Send queue depth.
    pub max_send_wr: u32,
    /// SGEs per send WR.
    pub max_send_sge: u32,
    /// Receive queue depth (ignored with an SRQ).
    pub max_recv_wr: u32,
    /// Largest inline send.
    pub max_inline_data: u32,
}

impl fmt::Display for QpState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// A port's attributes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortAttr {
    /// Whether the port is active (`IBV_PORT_ACTIVE`).
    pub active: bool,
    /// Active MTU in bytes.
    pub active_mtu: u32,
    /// Entries in the GID table.
    pub gid_tbl_len: u32,
    /// Link layer: 1 InfiniBand, 2 Ethernet (RoCE).
    pub link_layer: u8,
}

/// MTU enum value (1 = 256 B ... 5 = 4096 B) in bytes.
pub fn mtu_bytes(mtu: u32) -> u32 {
    if (1..=5).contains(&mtu) {
        128 << mtu
    } else {
        0
    }
}

/// Device limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceAttr {
    /// Largest QP depth.
    pub max_qp_wr: u32,
    /// Largest SRQ depth.
    pub max_srq_wr: u32,
    /// SGEs per send or receive WR.
    pub max_sge: u32,
    /// SGEs per SRQ receive WR.
    pub max_srq_sge: u32,
    /// Largest CQ.
    pub max_cqe: u32,
    /// RDMA READs a QP may have outstanding as responder.
    pub max_qp_rd_atom: u32,
    /// RDMA READs a QP may have outstanding as initiator.
    pub max_qp_init_rd_atom: u32,
}

/// A connection manager event, the same for every provider (`Id` is the provider's CM ID).
#[derive(Debug)]
pub enum CmEvent<Id> {
    /// A peer asks to connect: create a QP on `id`, then accept or reject.
    ConnectRequest {
        /// The new connection.
        id: Id,
        /// The peer's private data.
        private_data: Vec<u8>,
        /// RDMA READs the peer allows us to have outstanding.
        initiator_depth: u8,
        /// RDMA READs the peer wants to have outstanding at us.
        responder_resources: u8,
    },
    /// Established.
    Established {
        /// Which connection (its token).
        id: usize,
        /// The acceptor's private data (on the connecting side).
        private_data: Vec<u8>,
    },
    /// Rejected by the peer, with its private data (`RDMA_CM_EVENT_REJECTED`; on the
    /// accepting side: the host went away during the CM exchange).
    Rejected {
        /// Which connection.
        id: usize,
        /// The peer's private data.
        private_data: Vec<u8>,
    },
    /// The connection went down.
    Disconnected {
        /// Which connection.
        id: usize,
    },
    /// Time-wait over: the QP may be reused.
    TimewaitExit {
        /// Which connection.
        id: usize,
    },
    /// The device went away.
    DeviceRemoval {
        /// Which connection.
        id: usize,
    },
    /// Address or route resolution failed, nobody listens, or the peer stopped answering
    /// during the CM exchange (`RDMA_CM_EVENT_UNREACHABLE`, `ADDR_ERROR`, `ROUTE_ERROR`; on
    /// the accepting side: the REP's retries ran out, the host vanished).
    Unreachable {
        /// Which connection.
        id: usize,
    },
    /// The CM exchange completed but the connection could not be set up
    /// (`RDMA_CM_EVENT_CONNECT_ERROR`: e.g. the QP could not be moved to RTS).
    ConnectError {
        /// Which connection.
        id: usize,
    },
    /// The ID's address now belongs to another hardware address (`RDMA_CM_EVENT_ADDR_CHANGE`:
    /// a bond's failover to another port): a listening ID must listen again (binding anew),
    /// a connection is over.
    AddrChange {
        /// Which ID (a connection's, or the listening ID's token).
        id: usize,
    },
}

/// SRQ attributes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SrqAttr {
    /// Depth.
    pub max_wr: u32,
    /// SGEs per receive.
    pub max_sge: u32,
    /// Armed limit (0: not armed; reads 0 after the event fired, until re-armed).
    pub srq_limit: u32,
}

/// Zeroed memory a memory region owns, held by a raw pointer: the provider (or the NIC)
/// reaches it through addresses taken when it was registered, and moving a `Box` would
/// invalidate those under Rust's aliasing rules; a raw pointer does not.
#[derive(Debug)]
pub(crate) struct OwnedMem {
    ptr: std::ptr::NonNull<[u8]>,
}

impl OwnedMem {
    /// `len` zeroed bytes.
    pub(crate) fn zeroed(len: usize) -> OwnedMem {
        let raw = Box::into_raw(vec![0u8; len].into_boxed_slice());
        OwnedMem {
            // SAFETY: `Box::into_raw` never returns null.
            ptr: unsafe { std::ptr::NonNull::new_unchecked(raw) },
        }
    }

    /// The first byte: valid for reads and writes of the length asked for while this lives.
    pub(crate) fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr().cast()
    }
}

impl Drop for OwnedMem {
    fn drop(&mut self) {
        // SAFETY: made by `Box::into_raw` in `zeroed` and given back once, here.
        drop(unsafe { Box::from_raw(self.ptr.as_ptr()) });
    }
}

// SAFETY: plain bytes owned by this value alone; the region's handle decides who writes.
unsafe impl Send for OwnedMem {}
