//! rdma_cm: event channel, listen, resolve and connect with private data, accept or reject
//! with private data, disconnect, typed events. The QP of a connection this side connects is
//! created on its CM ID (`rdma_create_qp`) and destroyed with it. The QP of a connection this
//! side accepts is its own (`ibv_create_qp`), moved through its states here, and librdmacm
//! never holds it: librdmacm moves the QP it holds to ERR while it reads a REJECTED event,
//! on the thread reading the channel, which for an accepted connection is not the thread
//! that owns and destroys its QP.

use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use rdma_sys::*;

use std::sync::Arc;

use super::{check, errno, post_send, Cq, CqOwner, Device, Pd, PdInner, Srq, SrqOwner};

mod own_qp;
use crate::types::*;

/// A connection manager event.
pub type CmEvent = crate::types::CmEvent<CmId>;

static NEXT_TOKEN: AtomicUsize = AtomicUsize::new(1);

fn sockaddr(addr: SocketAddr) -> (libc::sockaddr_storage, usize) {
    // SAFETY: sockaddr_storage is plain data.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::sa_family_t::try_from(libc::AF_INET).unwrap_or(2),
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_in fits in sockaddr_storage.
            unsafe { ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::sa_family_t::try_from(libc::AF_INET6).unwrap_or(10),
                sin6_port: a.port().to_be(),
                sin6_flowinfo: 0,
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: sockaddr_in6 fits in sockaddr_storage.
            unsafe { ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len)
}

/// The address in a `sockaddr` of family AF_INET or AF_INET6, else `None`.
///
/// # Safety
/// `sa` must point to a readable `sockaddr_in` when its family is AF_INET, and to a
/// `sockaddr_in6` when it is AF_INET6.
unsafe fn socket_addr(sa: *const libc::sockaddr) -> Option<SocketAddr> {
    // SAFETY: the caller's promise: at least the family can be read.
    let family = i32::from(unsafe { (*sa).sa_family });
    match family {
        libc::AF_INET => {
            // SAFETY: the caller's promise for AF_INET.
            let sin = unsafe { ptr::read_unaligned(sa.cast::<libc::sockaddr_in>()) };
            let ip = std::net::Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes());
            Some(SocketAddr::from((ip, u16::from_be(sin.sin_port))))
        }
        libc::AF_INET6 => {
            // SAFETY: the caller's promise for AF_INET6.
            let sin6 = unsafe { ptr::read_unaligned(sa.cast::<libc::sockaddr_in6>()) };
            let ip = std::net::Ipv6Addr::from(sin6.sin6_addr.s6_addr);
            let ip = ip
                .to_ipv4_mapped()
                .map_or(std::net::IpAddr::V6(ip), Into::into);
            Some(SocketAddr::from((ip, u16::from_be(sin6.sin6_port))))
        }
        _ => None,
    }
}

/// An event channel's handle: destroyed once neither its `CmChannel` nor any ID on it is
/// left (`rdma_destroy_id` writes to the channel, so the channel must outlive its IDs).
pub(crate) struct ChannelHandle {
    ch: NonNull<rdma_event_channel>,
}

// SAFETY: destroyed once, by whichever thread drops the last holder; the fd is used by the
// thread that owns the `CmChannel`.
unsafe impl Send for ChannelHandle {}
// SAFETY: holders only keep it alive or read its fd.
unsafe impl Sync for ChannelHandle {}

impl Drop for ChannelHandle {
    fn drop(&mut self) {
        // SAFETY: every ID on the channel holds this handle: all are destroyed.
        unsafe { rdma_destroy_event_channel(self.ch.as_ptr()) };
    }
}

/// An event channel.
pub struct CmChannel {
    inner: Arc<ChannelHandle>,
}

// SAFETY: the channel is used from the control thread that owns it; the handle may move.
unsafe impl Send for CmChannel {}

impl std::fmt::Debug for CmChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ibverbs::CmChannel")
    }
}

/// An rdma_cm ID's handle, destroyed (`rdma_destroy_id`) when its last holder goes: its
/// `CmId`, or a `Device` taken from it. librdmacm opens one context per device and keeps it
/// open while an ID on the device lives; the verbs objects made on that context hold its
/// `Device`, so they all go before the ID.
pub(crate) struct IdHandle {
    id: NonNull<rdma_cm_id>,
    channel: Arc<ChannelHandle>,
    /// `release_removed_device` let go of the device's context.
    released: AtomicBool,
}

// SAFETY: destroyed once, by whichever thread drops the last holder; librdmacm locks what it
// shares between IDs.
unsafe impl Send for IdHandle {}
// SAFETY: holders only keep it alive; calls through it are made by the `CmId`'s owner.
unsafe impl Sync for IdHandle {}

impl Drop for IdHandle {
    fn drop(&mut self) {
        // SAFETY: the ID is destroyed once, after its QP (destroyed by its `CmId`) and while its
        // channel lives (held here).
        unsafe { rdma_destroy_id(self.id.as_ptr()) };
    }
}

/// A CM ID: a listener or a connection, with its QP.
pub struct CmId {
    token: usize,
    has_qp: bool,
    /// An ID of a connect request (this side accepts): its QP is `own_qp`, not the ID's.
    passive: bool,
    own_qp: Option<NonNull<ibv_qp>>,
    // Field order is drop order: the QP is destroyed in `drop`, then what it used, then the ID
    // (when no `Device` taken from it holds it any more).
    /// What the QP uses, kept alive until the QP is destroyed.
    _uses: Option<(Arc<PdInner>, Arc<CqOwner>, Arc<SrqOwner>)>,
    handle: Arc<IdHandle>,
}

// SAFETY: as for the channel.
unsafe impl Send for CmId {}

impl std::fmt::Debug for CmId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ibverbs::CmId")
            .field("token", &self.token)
            .finish()
    }
}

/// Lets librdmacm compare its devices with the ones present (`rdma_get_devices`): it marks
/// the devices that are gone, and closes the context of each one no ID uses any more (or when
/// its last ID goes). It does so only while at least one device is present. Returns whether
/// librdmacm still lists the context `ctx` (pointers are only compared).
fn sync_librdmacm_devices(ctx: *mut ibv_context) -> bool {
    let mut n = 0i32;
    // SAFETY: the list is freed below with rdma_free_devices.
    let list = unsafe { rdma_get_devices(&mut n) };
    if list.is_null() {
        return true;
    }
    // SAFETY: a NULL-terminated list of n contexts.
    let listed = (0..usize::try_from(n).unwrap_or(0)).any(|i| unsafe { *list.add(i) } == ctx);
    // SAFETY: the list came from rdma_get_devices and is not used after.
    unsafe { rdma_free_devices(list) };
    listed
}

/// Closes a context's files in the kernel's eyes while leaving librdmacm's bookkeeping whole:
/// its command and async fds are replaced by /dev/null opened read-only, so that the kernel
/// sees them closed, anything librdmacm still does on the context fails (EBADF) instead of
/// reaching a device, and librdmacm's own `ibv_close_device`, whenever it comes, closes fds
/// that are still its own.
///
/// # Safety
///
/// `ctx` is a live context that nothing uses any more and that librdmacm cannot close
/// meanwhile (an ID on its device is alive).
unsafe fn detach_context(ctx: *mut ibv_context) -> Result<(), VerbsError> {
    // SAFETY: a constant NUL-terminated path.
    let null = unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if null < 0 {
        return Err(VerbsError::os("open /dev/null", errno()));
    }
    // SAFETY: reading two fields of the live context.
    let fds = unsafe { [(*ctx).cmd_fd, (*ctx).async_fd] };
    let mut rc = 0;
    for fd in fds {
        // SAFETY: fd is one of the context's own descriptors; dup3 replaces its file at once.
        if unsafe { libc::dup3(null, fd, libc::O_CLOEXEC) } < 0 {
            rc = errno();
        }
    }
    // SAFETY: our own descriptor.
    unsafe { libc::close(null) };
    match rc {
        0 => Ok(()),
        e => Err(VerbsError::os("dup3", e)),
    }
}

impl CmChannel {
    /// A new, non-blocking event channel.
    pub fn new() -> Result<CmChannel, VerbsError> {
        // SAFETY: no preconditions.
        let ch = NonNull::new(unsafe { rdma_create_event_channel() })
            .ok_or_else(|| VerbsError::os("rdma_create_event_channel", errno()))?;
        let c = CmChannel {
            inner: Arc::new(ChannelHandle { ch }),
        };
        let fd = c.fd();
        // SAFETY: fcntl on the channel's own fd.
        let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        // SAFETY: as above.
        let rc = unsafe { libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK) };
        check("fcntl", rc.min(0))?;
        Ok(c)
    }

    /// The channel's fd (poll it with mio).
    pub fn fd(&self) -> RawFd {
        // SAFETY: live channel.
        unsafe { (*self.inner.ch.as_ptr()).fd }
    }

    /// Whether an ID made on the channel is still open (each holds the channel's handle).
    pub fn has_ids(&self) -> bool {
        Arc::strong_count(&self.inner) > 1
    }

    fn create_id(&self) -> Result<CmId, VerbsError> {
        let mut id = ptr::null_mut();
        let token = NEXT_TOKEN.fetch_add(1, Ordering::Relaxed);
        // SAFETY: live channel; the context is an opaque token, never dereferenced.
        check("rdma_create_id", unsafe {
            rdma_create_id(
                self.inner.ch.as_ptr(),
                &mut id,
                token as *mut _,
                rdma_port_space::RDMA_PS_TCP,
            )
        })?;
        let id = NonNull::new(id).ok_or_else(|| VerbsError::os("rdma_create_id", libc::ENOMEM))?;
        Ok(CmId::new(id, token, &self.inner))
    }

    /// Listens on `addr` (an RDMA device's address).
    pub fn listen(&self, addr: SocketAddr, backlog: i32) -> Result<CmId, VerbsError> {
        let id = self.create_id()?;
        let (mut ss, _) = sockaddr(addr);
        // SAFETY: live ID, a valid sockaddr.
        check("rdma_bind_addr", unsafe {
            rdma_bind_addr(id.raw(), (&mut ss as *mut libc::sockaddr_storage).cast())
        })?;
        // SAFETY: live, bound ID.
        check("rdma_listen", unsafe { rdma_listen(id.raw(), backlog) })?;
        Ok(id)
    }

    /// An ID bound to local address `addr` (port 0: any) and so to its device, not listening:
    /// it holds the device's context for handles made through a listening ID that is to go,
    /// without holding the listener's port.
    pub fn bind(&self, addr: SocketAddr) -> Result<CmId, VerbsError> {
        let id = self.create_id()?;
        let (mut ss, _) = sockaddr(addr);
        // SAFETY: live ID, a valid sockaddr.
        check("rdma_bind_addr", unsafe {
            rdma_bind_addr(id.raw(), (&mut ss as *mut libc::sockaddr_storage).cast())
        })?;
        Ok(id)
    }

    /// Resolves `addr` and a route to it (waiting up to `timeout`), on a private channel so
    /// that other connections' events are not consumed, then moves the ID to this channel.
    pub fn resolve(&self, addr: SocketAddr, timeout: Duration) -> Result<CmId, VerbsError> {
        let private = CmChannel::new()?;
        let mut id = private.create_id()?;
        let (mut ss, _) = sockaddr(addr);
        let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
        // SAFETY: live ID, valid destination address.
        check("rdma_resolve_addr", unsafe {
            rdma_resolve_addr(
                id.raw(),
                ptr::null_mut(),
                (&mut ss as *mut libc::sockaddr_storage).cast(),
                ms,
            )
        })?;
        private.wait_for(rdma_cm_event_type::RDMA_CM_EVENT_ADDR_RESOLVED, timeout)?;
        // SAFETY: live ID with a resolved address.
        check("rdma_resolve_route", unsafe {
            rdma_resolve_route(id.raw(), ms)
        })?;
        private.wait_for(rdma_cm_event_type::RDMA_CM_EVENT_ROUTE_RESOLVED, timeout)?;
        // SAFETY: live ID and channels.
        check("rdma_migrate_id", unsafe {
            rdma_migrate_id(id.raw(), self.inner.ch.as_ptr())
        })?;
        // The ID now lives on this channel, which must outlive it. Nothing else holds the
        // handle of an ID just made.
        match Arc::get_mut(&mut id.handle) {
            Some(h) => h.channel = Arc::clone(&self.inner),
            None => {
                return Err(VerbsError::Invalid {
                    op: "rdma_migrate_id",
                    why: "the resolved ID is shared",
                })
            }
        }
        Ok(id)
    }

    fn wait_for(&self, want: u32, timeout: Duration) -> Result<(), VerbsError> {
        let end = Instant::now() + timeout;
        loop {
            let mut ev = ptr::null_mut();
            // SAFETY: live channel (non-blocking).
            if unsafe { rdma_get_cm_event(self.inner.ch.as_ptr(), &mut ev) } == 0 {
                // SAFETY: a valid event until acked.
                let (kind, status) = unsafe { ((*ev).event, (*ev).status) };
                // SAFETY: acked once.
                unsafe { rdma_ack_cm_event(ev) };
                if kind == want {
                    return Ok(());
                }
                return Err(VerbsError::os(
                    "rdma_resolve",
                    if status < 0 {
                        -status
                    } else {
                        libc::EHOSTUNREACH
                    },
                ));
            }
            if Instant::now() >= end {
                return Err(VerbsError::os("rdma_resolve", libc::ETIMEDOUT));
            }
            let mut p = libc::pollfd {
                fd: self.fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            unsafe { libc::poll(&mut p, 1, 10) };
        }
    }

    /// The next event, without blocking (events of kinds nvmfd does not act on are acked and
    /// passed over).
    pub fn next_event(&self) -> Option<CmEvent> {
        loop {
            if let Some(e) = self.one_event()? {
                return Some(e);
            }
        }
    }

    /// One event, acked: `None` when there is none, `Some(None)` for one of a kind nvmfd does
    /// not act on.
    fn one_event(&self) -> Option<Option<CmEvent>> {
        let mut ev = ptr::null_mut();
        // SAFETY: live, non-blocking channel.
        if unsafe { rdma_get_cm_event(self.inner.ch.as_ptr(), &mut ev) } != 0 {
            return None;
        }
        // SAFETY: a valid event until acked; its id lives at least as long.
        let (kind, id, pd) = unsafe {
            let e = &*ev;
            let pd = if e.param.conn.private_data.is_null() {
                Vec::new()
            } else {
                std::slice::from_raw_parts(
                    e.param.conn.private_data.cast::<u8>(),
                    usize::from(e.param.conn.private_data_len),
                )
                .to_vec()
            };
            (e.event, e.id, pd)
        };
        // SAFETY: reading the token we stored as the ID's context.
        let token = |id: *mut rdma_cm_id| unsafe { (*id).context as usize };
        let out = match kind {
            rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_REQUEST => {
                let t = NEXT_TOKEN.fetch_add(1, Ordering::Relaxed);
                // SAFETY: the new ID is ours from this event on; store its token; read the
                // peer's RDMA READ depths.
                let (ir, rr) = unsafe {
                    (*id).context = t as *mut _;
                    (
                        (*ev).param.conn.initiator_depth,
                        (*ev).param.conn.responder_resources,
                    )
                };
                NonNull::new(id).map(|id| CmEvent::ConnectRequest {
                    id: CmId::new(id, t, &self.inner).accepting(),
                    private_data: pd,
                    initiator_depth: ir,
                    responder_resources: rr,
                })
            }
            rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED => Some(CmEvent::Established {
                id: token(id),
                private_data: pd,
            }),
            rdma_cm_event_type::RDMA_CM_EVENT_REJECTED => Some(CmEvent::Rejected {
                id: token(id),
                private_data: pd,
            }),
            rdma_cm_event_type::RDMA_CM_EVENT_DISCONNECTED => {
                Some(CmEvent::Disconnected { id: token(id) })
            }
            rdma_cm_event_type::RDMA_CM_EVENT_TIMEWAIT_EXIT => {
                Some(CmEvent::TimewaitExit { id: token(id) })
            }
            rdma_cm_event_type::RDMA_CM_EVENT_DEVICE_REMOVAL => {
                Some(CmEvent::DeviceRemoval { id: token(id) })
            }
            rdma_cm_event_type::RDMA_CM_EVENT_UNREACHABLE
            | rdma_cm_event_type::RDMA_CM_EVENT_ADDR_ERROR
            | rdma_cm_event_type::RDMA_CM_EVENT_ROUTE_ERROR => {
                Some(CmEvent::Unreachable { id: token(id) })
            }
            rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_ERROR => {
                Some(CmEvent::ConnectError { id: token(id) })
            }
            rdma_cm_event_type::RDMA_CM_EVENT_ADDR_CHANGE => {
                Some(CmEvent::AddrChange { id: token(id) })
            }
            _ => None,
        };
        // SAFETY: acked once, after its data was copied.
        unsafe { rdma_ack_cm_event(ev) };
        Some(out)
    }
}

impl CmId {
    fn new(id: NonNull<rdma_cm_id>, token: usize, channel: &Arc<ChannelHandle>) -> CmId {
        CmId {
            token,
            has_qp: false,
            passive: false,
            own_qp: None,
            _uses: None,
            handle: Arc::new(IdHandle {
                id,
                channel: Arc::clone(channel),
                released: AtomicBool::new(false),
            }),
        }
    }

    fn raw(&self) -> *mut rdma_cm_id {
        self.handle.id.as_ptr()
    }

    /// The token events name this connection by.
    pub fn token(&self) -> usize {
        self.token
    }

    /// The device the ID is bound to (after bind, resolve or a connect request): librdmacm's
    /// context for it. The device holds this ID: the ID lives (a listening ID keeps
    /// listening) until the `CmId`, every device taken from it and every object made on those
    /// are dropped.
    pub fn device(&self) -> Result<Device, VerbsError> {
        // SAFETY: live ID.
        Device::of_cm_id(unsafe { (*self.raw()).verbs }, Arc::clone(&self.handle))
    }

    /// The librdmacm context of the ID's device (null before the ID is bound to one).
    pub(crate) fn context(&self) -> *mut rdma_sys::ibv_context {
        // SAFETY: live ID.
        unsafe { (*self.raw()).verbs }
    }

    /// The ID's handle, which a device of its context may hold ([`Device::hold_id`]).
    pub(crate) fn handle(&self) -> &Arc<IdHandle> {
        &self.handle
    }

    /// After the ID's device was removed (`DEVICE_REMOVAL`, `DEVICE_FATAL`): lets go of the
    /// device once nothing made on it is open, so that the kernel can finish removing it.
    ///
    /// librdmacm keeps a context per device, open even after the device's last ID is
    /// destroyed, and closes that of a removed device only when it next compares its device
    /// list with the kernel's while some device is present. A device without disassociate
    /// support (rxe, siw) cannot finish its removal (`rdma link delete` waits) while a
    /// process has its context open, and with a single device librdmacm never closes it.
    /// So: once no device handle or object of this context is left and libibverbs no longer
    /// lists the device, librdmacm is asked to compare its list; if it still keeps the
    /// context, the context's files are closed here in the kernel's eyes (its fds are
    /// replaced by /dev/null, which librdmacm closes whenever it drops the context itself).
    /// Drop this ID after `Released`.
    pub fn release_removed_device(&self) -> Result<DeviceRelease, VerbsError> {
        if self.handle.released.load(Ordering::Relaxed) {
            return Ok(DeviceRelease::Released);
        }
        // SAFETY: live ID.
        let ctx = unsafe { (*self.raw()).verbs };
        if ctx.is_null() {
            return Ok(DeviceRelease::Released);
        }
        let holders = super::cm_context_holders(ctx);
        if holders > 0 {
            return Ok(DeviceRelease::InUse(holders));
        }
        // SAFETY: librdmacm keeps the context, and so its device, while this ID lives.
        if super::device_listed(unsafe { (*ctx).device }) {
            return Ok(DeviceRelease::Present);
        }
        if sync_librdmacm_devices(ctx) {
            // SAFETY: nothing uses the context (no handle of it is left), and librdmacm cannot
            // close it while this ID lives.
            unsafe { detach_context(ctx) }?;
        }
        self.handle.released.store(true, Ordering::Relaxed);
        Ok(DeviceRelease::Released)
    }

    /// Creates the connection's RC QP on `cq`, taking receives from `srq`.
    pub fn create_qp(
        &mut self,
        pd: &Pd,
        cq: &Cq,
        srq: &Srq,
        caps: QpCaps,
    ) -> Result<u32, VerbsError> {
        // A second QP would replace the first in the ID, which would then never be destroyed
        // (and keep its CQ and SRQ busy).
        if self.has_qp {
            return Err(VerbsError::os("rdma_create_qp", libc::EINVAL));
        }
        // SAFETY: plain data.
        let mut a: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        a.send_cq = cq.cq.as_ptr();
        a.recv_cq = cq.cq.as_ptr();
        a.srq = srq.srq.as_ptr();
        a.cap.max_send_wr = caps.max_send_wr;
        a.cap.max_send_sge = caps.max_send_sge;
        a.cap.max_inline_data = caps.max_inline_data;
        a.qp_type = ibv_qp_type::IBV_QPT_RC;
        if self.passive {
            self.own_qp = Some(self.create_own_qp(pd, &mut a)?);
        } else {
            // SAFETY: live ID, PD, CQ and SRQ of the ID's device.
            check("rdma_create_qp", unsafe {
                rdma_create_qp(self.raw(), pd.inner.pd.as_ptr(), &mut a)
            })?;
        }
        self.has_qp = true;
        self._uses = Some((
            Arc::clone(&pd.inner),
            Arc::clone(&cq.owner),
            Arc::clone(&srq.owner),
        ));
        self.qpn()
            .ok_or(VerbsError::os("rdma_create_qp", libc::EIO))
    }

    /// This ID, of a connect request: its QP will be its own, not the ID's.
    fn accepting(mut self) -> CmId {
        self.passive = true;
        self
    }

    fn qp(&self) -> Option<*mut ibv_qp> {
        if let Some(q) = self.own_qp {
            return Some(q.as_ptr());
        }
        // SAFETY: live ID.
        let qp = unsafe { (*self.raw()).qp };
        (!qp.is_null()).then_some(qp)
    }

    /// Whether librdmacm holds this ID's QP (and so moves it to ERR on the thread reading the
    /// channel when a REJECTED event is read): a connecting ID's, never an accepted one's.
    #[doc(hidden)]
    pub fn rdma_cm_holds_qp(&self) -> bool {
        // SAFETY: live ID.
        !unsafe { (*self.raw()).qp }.is_null()
    }

    /// The QP number.
    pub fn qpn(&self) -> Option<u32> {
        // SAFETY: a live QP.
        self.qp().map(|q| unsafe { (*q).qp_num })
    }

    /// The address of the other side (a connecting host's, for an ID of a connect request).
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        // SAFETY: a live ID; the pointer is to the route's whole destination address union
        // (sockaddr_storage-sized, so an AF_INET6 address read through it stays within it),
        // taken without a reference to its 16-byte `sockaddr` member.
        unsafe {
            let dst = ptr::addr_of!((*self.raw()).route.addr.dst_addr_union);
            socket_addr(dst.cast::<libc::sockaddr>())
        }
    }

    /// Connection parameters carrying `private_data` (at most 255 bytes: longer is refused,
    /// not cut).
    fn conn_param(private_data: &[u8]) -> Result<rdma_conn_param, VerbsError> {
        let len = u8::try_from(private_data.len())
            .map_err(|_| VerbsError::os("rdma_conn_param", libc::EINVAL))?;
        // SAFETY: plain data.
        let mut p: rdma_conn_param = unsafe { std::mem::zeroed() };
        p.private_data = private_data.as_ptr().cast();
        p.private_data_len = len;
        p.responder_resources = 16;
        p.initiator_depth = 16;
        p.retry_count = 7;
        p.rnr_retry_count = 7; // retry forever when the peer's SRQ is empty
        Ok(p)
    }

    /// Connects (after `resolve` and `create_qp`); the answer comes as an event.
    pub fn connect(&self, private_data: &[u8]) -> Result<(), VerbsError> {
        let mut p = Self::conn_param(private_data)?;
        // SAFETY: live ID with a QP; the private data outlives the call (it is copied).
        check("rdma_connect", unsafe { rdma_connect(self.raw(), &mut p) })
    }

    /// Accepts a connect request (after `create_qp`).
    pub fn accept(&self, private_data: &[u8]) -> Result<(), VerbsError> {
        self.accept_own(Self::conn_param(private_data)?, None)
    }

    /// Rejects a connect request.
    pub fn reject(&self, private_data: &[u8]) -> Result<(), VerbsError> {
        let len = u8::try_from(private_data.len())
            .map_err(|_| VerbsError::os("rdma_reject", libc::EINVAL))?;
        // SAFETY: live ID; the data is copied.
        check("rdma_reject", unsafe {
            rdma_reject(self.raw(), private_data.as_ptr().cast(), len)
        })
    }

    /// Tells the CM that the connection carries messages (`IBV_EVENT_COMM_EST` on its QP):
    /// an accepting side whose RTU was lost is established now instead of when a REP
    /// retry is answered, or never if every one is lost (`rdma_notify`).
    pub fn notify_established(&self) -> Result<(), VerbsError> {
        // SAFETY: live ID; the event is a plain enum value.
        check("rdma_notify", unsafe {
            rdma_notify(self.raw(), ibv_event_type::IBV_EVENT_COMM_EST)
        })
    }

    /// Disconnects (the QP goes to ERR, on iWARP to SQD; both sides get DISCONNECTED). This
    /// side's own QP (an accepted connection's) is moved here first, as `rdma_disconnect`
    /// moves a QP librdmacm holds (`ucma_shutdown`); the peer is told even if that move
    /// fails (librdmacm would not tell it), and the failure is returned.
    pub fn disconnect(&self) -> Result<(), VerbsError> {
        let moved = self.own_qp.map_or(Ok(()), |qp| self.shut_own(qp));
        // SAFETY: live ID.
        check("rdma_disconnect", unsafe { rdma_disconnect(self.raw()) })?;
        moved
    }

    /// Posts a chain of send work requests on the connection's QP.
    pub fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<(), VerbsError> {
        let qp = self.qp().ok_or(VerbsError::Invalid {
            op: "post_send",
            why: "no QP",
        })?;
        post_send(qp, wrs)
    }

    fn query(&self) -> Option<(QpState, u32)> {
        let qp = self.qp()?;
        // SAFETY: plain data.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        // SAFETY: plain data.
        let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        // SAFETY: live QP; IBV_QP_STATE | IBV_QP_CAP.
        if unsafe { ibv_query_qp(qp, &mut a, 1 | (1 << 19), &mut init) } != 0 {
            return None;
        }
        // SAFETY: a C enum read as an integer.
        let st = unsafe { ptr::read((&a.qp_state as *const ibv_qp_state::Type).cast::<u32>()) };
        let state = match st {
            0 => QpState::Reset,
            1 => QpState::Init,
            2 => QpState::Rtr,
            3 => QpState::Rts,
            _ => QpState::Err,
        };
        Some((state, a.cap.max_inline_data))
    }

    /// The QP's RDMA READ depths (`max_rd_atomic`, `max_dest_rd_atomic`), as the connection
    /// set them; `None` without a QP. Providers may round a depth up (rxe: to a power of two).
    pub fn read_depths(&self) -> Option<ReadDepths> {
        let qp = self.qp()?;
        // SAFETY: plain data.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        // SAFETY: plain data.
        let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        // SAFETY: live QP; IBV_QP_MAX_QP_RD_ATOMIC (1 << 13) | IBV_QP_MAX_DEST_RD_ATOMIC (1 << 17).
        if unsafe { ibv_query_qp(qp, &mut a, (1 << 13) | (1 << 17), &mut init) } != 0 {
            return None;
        }
        Some(ReadDepths {
            initiator: u32::from(a.max_rd_atomic),
            responder: u32::from(a.max_dest_rd_atomic),
        })
    }

    /// The QP's state.
    pub fn qp_state(&self) -> Option<QpState> {
        self.query().map(|q| q.0)
    }

    /// The largest inline send the QP really takes (providers may round the request up).
    pub fn max_inline(&self) -> Option<u32> {
        self.query().map(|q| q.1)
    }

    /// Moves the QP to ERR.
    pub fn to_error(&self) -> Result<(), VerbsError> {
        let qp = self.qp().ok_or(VerbsError::Invalid {
            op: "modify_qp",
            why: "no QP",
        })?;
        // SAFETY: plain data.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_ERR;
        // SAFETY: live QP; IBV_QP_STATE = 1.
        check("modify_qp", unsafe { ibv_modify_qp(qp, &mut a, 1) })
    }
}

impl Drop for CmId {
    fn drop(&mut self) {
        if let Some(qp) = self.own_qp {
            // SAFETY: this side's own QP, once; librdmacm never held it.
            unsafe { ibv_destroy_qp(qp.as_ptr()) };
        } else if self.has_qp {
            // SAFETY: the QP, once; the ID is destroyed by its handle when its last holder goes.
            unsafe { rdma_destroy_qp(self.raw()) };
        }
    }
}
