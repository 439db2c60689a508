//! The `ibverbs` provider: rdma-core's libibverbs and librdmacm through rdma-sys, behind the
//! same API as the soft provider.
//!
//! Every handle is owned by a type that destroys it (in dependency order: the borrow and
//! `Arc` structure keeps a PD alive while its MRs, SRQs and QPs live, a context while its PDs
//! and CQs live, and the rdma_cm ID a context was taken from, which keeps librdmacm's context
//! open, while that context is used; a CM channel lives while its IDs do). errno becomes
//! [`VerbsError`]. The provider operations that rdma-sys's inline wrappers call through
//! `Option::unwrap` (post_send, post_recv, post_srq_recv, poll_cq, req_notify_cq) are checked
//! once when a device is opened. The hot path (post, poll) builds work requests on the stack:
//! no allocation, no lock.

pub mod cm;
mod queues;

pub use queues::*;

use std::ffi::CStr;
use std::os::fd::RawFd;
use std::ptr::{self, NonNull};
use std::sync::{Arc, Mutex, Weak};

use rdma_sys::*;

use crate::types::*;

fn errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// Turns a C return code (0 or -1/errno) into a result.
fn check(op: &'static str, rc: i32) -> Result<(), VerbsError> {
    match rc {
        0 => Ok(()),
        rc if rc > 0 => Err(VerbsError::os(op, rc)),
        _ => Err(VerbsError::os(op, errno())),
    }
}

/// The names of the RDMA devices present.
pub fn device_names() -> Vec<String> {
    let mut n = 0i32;
    // SAFETY: ibv_get_device_list writes the count and returns a list freed below.
    let list = unsafe { ibv_get_device_list(&mut n) };
    let mut out = Vec::new();
    if list.is_null() {
        return out;
    }
    for i in 0..usize::try_from(n).unwrap_or(0) {
        // SAFETY: i < n entries of the list; each device has a NUL-terminated name.
        let name = unsafe { CStr::from_ptr(ibv_get_device_name(*list.add(i))) };
        out.push(name.to_string_lossy().into_owned());
    }
    // SAFETY: the list came from ibv_get_device_list and is not used after.
    unsafe { ibv_free_device_list(list) };
    out
}

pub(crate) struct Ctx {
    pub(crate) ctx: NonNull<ibv_context>,
    /// False: opened by `ibv_open_device`, closed on drop. True: librdmacm's context for the
    /// device of an rdma_cm ID, held in `cm_id`.
    from_cm: bool,
    /// librdmacm keeps its context open while an ID on the device lives, so an ID is held
    /// here: every object made on the context (each holds this `Ctx`) goes before the ID, and
    /// so before librdmacm may close the context. It is the ID the device was taken from until
    /// [`Device::hold_id`] puts another ID of the same context in its place.
    cm_id: Mutex<Option<Arc<cm::IdHandle>>>,
}

// SAFETY: an ibv_context is thread-safe (libibverbs locks internally where it must).
unsafe impl Send for Ctx {}
// SAFETY: as above.
unsafe impl Sync for Ctx {}

/// Async events read so far, from every device ([`Device::next_numbered_event`]).
static EVENTS_READ: Mutex<u64> = Mutex::new(0);

/// librdmacm's contexts that `Device`s use now, by address: what `release_removed_device`
/// checks before it lets go of one (every verbs object holds its device's `Ctx`).
static CM_CONTEXTS: Mutex<Vec<(usize, Weak<Ctx>)>> = Mutex::new(Vec::new());

fn cm_contexts() -> std::sync::MutexGuard<'static, Vec<(usize, Weak<Ctx>)>> {
    CM_CONTEXTS.lock().unwrap_or_else(|e| e.into_inner())
}

/// How many handles (device handles, PDs, CQs; MRs, SRQs and QPs hold their PD) hold
/// librdmacm's context `ctx`.
pub(crate) fn cm_context_holders(ctx: *mut ibv_context) -> usize {
    cm_contexts()
        .iter()
        .filter(|(c, _)| *c == ctx as usize)
        .map(|(_, w)| w.strong_count())
        .sum()
}

/// Whether libibverbs still lists `dev` (a device being removed leaves the list before the
/// kernel waits for its users to let go). Pointers are only compared.
pub(crate) fn device_listed(dev: *mut ibv_device) -> bool {
    let mut n = 0i32;
    // SAFETY: as in device_names.
    let list = unsafe { ibv_get_device_list(&mut n) };
    if list.is_null() {
        return false;
    }
    // SAFETY: i < n entries of the list.
    let found = (0..usize::try_from(n).unwrap_or(0)).any(|i| unsafe { *list.add(i) } == dev);
    // SAFETY: the list came from ibv_get_device_list and is not used after.
    unsafe { ibv_free_device_list(list) };
    found
}

impl Drop for Ctx {
    fn drop(&mut self) {
        if !self.from_cm {
            // SAFETY: opened by ibv_open_device; every child object holds an Arc<Ctx>, so none
            // is alive now.
            unsafe { ibv_close_device(self.ctx.as_ptr()) };
        } else {
            // This one's weak count is dead now: forget it and any other dead entry.
            cm_contexts().retain(|(_, w)| w.strong_count() > 0);
        }
    }
}

/// An open device.
#[derive(Clone)]
pub struct Device {
    pub(crate) ctx: Arc<Ctx>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ibverbs::Device")
    }
}

/// Checks the provider operations rdma-sys's inline wrappers unwrap.
fn check_ops(ctx: *mut ibv_context) -> Result<(), VerbsError> {
    // SAFETY: ctx is a live context; reading its ops table.
    let ops = unsafe { &(*ctx).ops };
    let missing = [
        ("post_send", ops.post_send.is_none()),
        ("post_recv", ops.post_recv.is_none()),
        ("post_srq_recv", ops.post_srq_recv.is_none()),
        ("poll_cq", ops.poll_cq.is_none()),
        ("req_notify_cq", ops.req_notify_cq.is_none()),
    ];
    match missing.iter().find(|(_, m)| *m) {
        Some((name, _)) => Err(VerbsError::Invalid {
            op: "open_device",
            why: provider_missing(name),
        }),
        None => Ok(()),
    }
}

fn provider_missing(name: &str) -> &'static str {
    match name {
        "post_send" => "the provider has no post_send",
        "post_recv" => "the provider has no post_recv",
        "post_srq_recv" => "the provider has no post_srq_recv (no SRQ support)",
        "poll_cq" => "the provider has no poll_cq",
        _ => "the provider has no req_notify_cq",
    }
}

impl Device {
    /// Opens the device named `name`, or the first one.
    pub fn open(name: Option<&str>) -> Result<Device, VerbsError> {
        let mut n = 0i32;
        // SAFETY: as in device_names.
        let list = unsafe { ibv_get_device_list(&mut n) };
        if list.is_null() || n == 0 {
            return Err(VerbsError::Invalid {
                op: "open_device",
                why: "no RDMA device",
            });
        }
        let mut chosen = ptr::null_mut();
        for i in 0..usize::try_from(n).unwrap_or(0) {
            // SAFETY: i < n.
            let d = unsafe { *list.add(i) };
            // SAFETY: device names are NUL-terminated.
            let dn = unsafe { CStr::from_ptr(ibv_get_device_name(d)) };
            if name.is_none_or(|w| dn.to_bytes() == w.as_bytes()) {
                chosen = d;
                break;
            }
        }
        let ctx = if chosen.is_null() {
            ptr::null_mut()
        } else {
            // SAFETY: a device of the live list.
            unsafe { ibv_open_device(chosen) }
        };
        // SAFETY: the list is not used after this.
        unsafe { ibv_free_device_list(list) };
        let ctx = NonNull::new(ctx).ok_or(VerbsError::Invalid {
            op: "open_device",
            why: "no such device, or it cannot be opened",
        })?;
        let dev = Device {
            ctx: Arc::new(Ctx {
                ctx,
                from_cm: false,
                cm_id: Mutex::new(None),
            }),
        };
        check_ops(ctx.as_ptr())?;
        dev.set_async_nonblocking()?;
        Ok(dev)
    }

    /// A device for librdmacm's context of rdma_cm ID `id`'s device (not closed by this
    /// handle: librdmacm owns it). The handle holds the ID, which keeps the context open.
    pub(crate) fn of_cm_id(
        ctx: *mut ibv_context,
        id: Arc<cm::IdHandle>,
    ) -> Result<Device, VerbsError> {
        let ctx = NonNull::new(ctx).ok_or(VerbsError::Invalid {
            op: "cm_device",
            why: "the CM ID has no device yet",
        })?;
        check_ops(ctx.as_ptr())?;
        let d = Device {
            ctx: Arc::new(Ctx {
                ctx,
                from_cm: true,
                cm_id: Mutex::new(Some(id)),
            }),
        };
        cm_contexts().push((ctx.as_ptr() as usize, Arc::downgrade(&d.ctx)));
        d.set_async_nonblocking()?;
        Ok(d)
    }

    /// Makes this device, and every object made on it, hold rdma_cm ID `id` instead of the
    /// one it holds, when `id` is of librdmacm's context of this device: the ID it held (a
    /// listener's) can then be destroyed, and stop listening, while the objects live on.
    /// Nothing changes when it is not. (The ID a device holds may itself be another's taken
    /// this way: the one to hold is always named by its own `CmId`.)
    pub fn hold_id(&self, id: &cm::CmId) {
        if !self.ctx.from_cm || id.context() != self.ctx.ctx.as_ptr() {
            return;
        }
        let old = self
            .ctx
            .cm_id
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .replace(Arc::clone(id.handle()));
        // The old ID goes (maybe destroyed) outside the lock.
        drop(old);
    }

    /// Whether anything but this one handle holds the device's context: objects made on it,
    /// clones of this handle, or other handles of the context.
    pub fn in_use(&self) -> bool {
        if self.ctx.from_cm {
            cm_context_holders(self.ctx.ctx.as_ptr()) > 1
        } else {
            Arc::strong_count(&self.ctx) > 1
        }
    }

    fn set_async_nonblocking(&self) -> Result<(), VerbsError> {
        let fd = self.async_fd();
        // SAFETY: fcntl on the context's own async fd.
        let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        // SAFETY: as above.
        let rc = unsafe { libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK) };
        check("fcntl", rc.min(0))
    }

    fn query(&self) -> Result<ibv_device_attr, VerbsError> {
        // SAFETY: ibv_device_attr is plain data; zero is a valid value to be overwritten.
        let mut a: ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: live context, valid out-pointer.
        check("query_device", unsafe {
            ibv_query_device(self.ctx.ctx.as_ptr(), &mut a)
        })?;
        Ok(a)
    }

    /// Limits.
    pub fn attr(&self) -> Result<DeviceAttr, VerbsError> {
        let a = self.query()?;
        let u = |v: i32| u32::try_from(v).unwrap_or(0);
        Ok(DeviceAttr {
            max_qp_wr: u(a.max_qp_wr),
            max_srq_wr: u(a.max_srq_wr),
            max_sge: u(a.max_sge),
            max_srq_sge: u(a.max_srq_sge),
            max_cqe: u(a.max_cqe),
            max_qp_rd_atom: u(a.max_qp_rd_atom),
            max_qp_init_rd_atom: u(a.max_qp_init_rd_atom),
        })
    }

    /// The device's transport (`IBV_TRANSPORT_*`, read as an integer) and vendor ID.
    fn identity(&self) -> (u32, Option<u32>) {
        // SAFETY: a live context's device outlives it; the transport type is a C enum read
        // as an integer.
        let transport = unsafe {
            let dev = &*(*self.ctx.ctx.as_ptr()).device;
            ptr::read((&dev.transport_type as *const ibv_transport_type::Type).cast::<u32>())
        };
        (transport, self.query().ok().map(|a| a.vendor_id))
    }

    /// Whether the device sends `IBV_EVENT_QP_LAST_WQE_REACHED` when an SRQ-attached QP goes
    /// to ERR, decided by its transport and driver (never by its name, which an administrator
    /// chooses): iWARP devices never send it, nor do the software drivers rxe (Soft-RoCE,
    /// vendor ID 0xFFFFFF; 0 before Linux 5.9) and siw (soft-iWARP, vendor ID 0x626d74,
    /// "bmt"). SPDK's target decides the same way. A device whose attributes cannot be read
    /// counts as one that does not send it: a drain then ends with its marker.
    pub fn sends_last_wqe(&self) -> bool {
        let (transport, vendor) = self.identity();
        sends_last_wqe(transport, vendor)
    }

    /// Whether an RDMA READ's sink must be registered for remote write: on iWARP the READ
    /// response is placed through the sink's tag, which hardware iWARP checks for remote
    /// write (the kernel's `rdma_rw` registers such sinks so); siw checks local write only.
    pub fn rdma_read_sink_needs_remote_write(&self) -> bool {
        let (transport, vendor) = self.identity();
        read_sink_needs_remote_write(transport, vendor)
    }

    /// Whether the device can post SEND_WITH_INVALIDATE (`IBV_DEVICE_MEM_MGT_EXTENSIONS` in
    /// its capability flags); false when its attributes cannot be read.
    pub fn supports_send_with_invalidate(&self) -> bool {
        self.query()
            .is_ok_and(|a| a.device_cap_flags & IBV_DEVICE_MEM_MGT_EXTENSIONS != 0)
    }

    /// Port `port`'s attributes.
    pub fn port_attr(&self, port: u8) -> Result<PortAttr, VerbsError> {
        // SAFETY: plain data.
        let mut a: ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: live context, valid out-pointer.
        check("query_port", unsafe {
            ___ibv_query_port(self.ctx.ctx.as_ptr(), port, &mut a)
        })?;
        // SAFETY: C enums read as integers.
        let (state, mtu) = unsafe {
            (
                ptr::read((&a.state as *const ibv_port_state::Type).cast::<u32>()),
                ptr::read((&a.active_mtu as *const ibv_mtu::Type).cast::<u32>()),
            )
        };
        Ok(PortAttr {
            active: state == 4,
            active_mtu: mtu_bytes(mtu),
            gid_tbl_len: u32::try_from(a.gid_tbl_len).unwrap_or(0),
            link_layer: a.link_layer,
        })
    }

    /// GID `index` of port `port`.
    pub fn gid(&self, port: u8, index: u32) -> Result<[u8; 16], VerbsError> {
        // SAFETY: plain data.
        let mut g: ibv_gid = unsafe { std::mem::zeroed() };
        let i = i32::try_from(index).map_err(|_| VerbsError::os("query_gid", libc::EINVAL))?;
        // SAFETY: live context, valid out-pointer.
        check("query_gid", unsafe {
            ibv_query_gid(self.ctx.ctx.as_ptr(), port, i, &mut g)
        })?;
        // SAFETY: the raw view of the union.
        Ok(unsafe { g.raw })
    }

    /// The async event fd (non-blocking; poll it with mio).
    pub fn async_fd(&self) -> RawFd {
        // SAFETY: reading a field of the live context.
        unsafe { (*self.ctx.ctx.as_ptr()).async_fd }
    }

    /// The next async event, without blocking (events of kinds nvmfd does not act on are
    /// acked and passed over).
    pub fn next_event(&self) -> Option<AsyncEvent> {
        self.next_numbered_event().map(|(_, e)| e)
    }

    /// The next async event and its number: the events read from every device of the
    /// process are numbered in the order they are read, the read and its number under one
    /// lock (see [`Device::events_read`]).
    pub fn next_numbered_event(&self) -> Option<(u64, AsyncEvent)> {
        let mut read = EVENTS_READ.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(e) = self.one_event()? {
                let n = *read;
                *read += 1;
                return Some((n, e));
            }
        }
    }

    /// How many async events have been read so far: any event read from now on is
    /// numbered at least this. Taken before a QP is created, it tells that QP's events from
    /// those of a destroyed QP whose number the device gave it (uverbs drops a destroyed
    /// QP's events not yet read, so those were read, and numbered, before).
    pub fn events_read(&self) -> u64 {
        *EVENTS_READ.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// One async event, acked: `None` when there is none, `Some(None)` for one of a kind
    /// nvmfd does not act on.
    fn one_event(&self) -> Option<Option<AsyncEvent>> {
        // SAFETY: zeroed is a valid initial value for this plain struct.
        let mut ev: ibv_async_event = unsafe { std::mem::zeroed() };
        // SAFETY: live context; the fd is non-blocking, so this returns at once.
        if unsafe { ibv_get_async_event(self.ctx.ctx.as_ptr(), &mut ev) } != 0 {
            return None;
        }
        // The event type is read as an integer: a value this build does not know must not be
        // turned into a Rust enum.
        // SAFETY: the field is a C enum, 4 bytes.
        let kind = unsafe { ptr::read((&ev.event_type as *const ibv_event_type).cast::<u32>()) };
        // SAFETY: the union member matching the kind is read below; all are pointers or int.
        let el = &ev.element;
        // SAFETY: each arm reads the member the event type says is valid.
        let e = unsafe {
            match kind {
                1 => Some(AsyncEvent::QpFatal((*el.qp).qp_num)),
                2 => Some(AsyncEvent::QpReqErr((*el.qp).qp_num)),
                3 => Some(AsyncEvent::QpAccessErr((*el.qp).qp_num)),
                0 => Some(AsyncEvent::CqErr((*el.cq).handle)),
                16 => Some(AsyncEvent::QpLastWqeReached((*el.qp).qp_num)),
                4 => Some(AsyncEvent::CommEst((*el.qp).qp_num)),
                15 => Some(AsyncEvent::SrqLimitReached((*el.srq).handle)),
                14 => Some(AsyncEvent::SrqErr((*el.srq).handle)),
                9 => Some(AsyncEvent::PortActive(
                    u8::try_from(el.port_num).unwrap_or(0),
                )),
                10 => Some(AsyncEvent::PortErr(u8::try_from(el.port_num).unwrap_or(0))),
                8 => Some(AsyncEvent::DeviceFatal),
                _ => None,
            }
        };
        // SAFETY: every event got is acked once.
        unsafe { ibv_ack_async_event(&mut ev) };
        Some(e)
    }

    /// A protection domain.
    pub fn alloc_pd(&self) -> Result<Pd, VerbsError> {
        // SAFETY: live context.
        let pd = NonNull::new(unsafe { ibv_alloc_pd(self.ctx.ctx.as_ptr()) })
            .ok_or_else(|| VerbsError::os("alloc_pd", errno()))?;
        Ok(Pd {
            inner: Arc::new(PdInner {
                pd,
                _ctx: Arc::clone(&self.ctx),
            }),
        })
    }

    /// A CQ of `cqe` entries with its own completion channel.
    pub fn create_cq(&self, cqe: u32) -> Result<Cq, VerbsError> {
        // SAFETY: live context.
        let ch = NonNull::new(unsafe { ibv_create_comp_channel(self.ctx.ctx.as_ptr()) })
            .ok_or_else(|| VerbsError::os("create_comp_channel", errno()))?;
        let n = i32::try_from(cqe).map_err(|_| VerbsError::os("create_cq", libc::EINVAL))?;
        // SAFETY: live context and channel.
        let cq =
            unsafe { ibv_create_cq(self.ctx.ctx.as_ptr(), n, ptr::null_mut(), ch.as_ptr(), 0) };
        let Some(cq) = NonNull::new(cq) else {
            let e = errno();
            // SAFETY: the channel has no CQ.
            unsafe { ibv_destroy_comp_channel(ch.as_ptr()) };
            return Err(VerbsError::os("create_cq", e));
        };
        // SAFETY: the channel's own fd.
        let fd = unsafe { (*ch.as_ptr()).fd };
        // SAFETY: fcntl on an fd we own.
        let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        // SAFETY: as above.
        let rc = unsafe { libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK) };
        let cq = Cq {
            cq,
            channel: ch,
            scratch: std::cell::UnsafeCell::new(queues::zeroed_wcs()),
            owner: Arc::new(CqOwner {
                cq,
                channel: ch,
                _ctx: Arc::clone(&self.ctx),
            }),
        };
        check("fcntl", rc.min(0))?;
        Ok(cq)
    }
}

/// `IBV_DEVICE_MEM_MGT_EXTENSIONS` in `ibv_device_attr::device_cap_flags`.
const IBV_DEVICE_MEM_MGT_EXTENSIONS: u32 = 1 << 21;
/// `IBV_TRANSPORT_IWARP`.
const TRANSPORT_IWARP: u32 = 1;
/// rxe's vendor ID (`RXE_VENDOR_ID`); before Linux 5.9 it reported 0.
const RXE_VENDOR_ID: u32 = 0xFF_FFFF;
const RXE_VENDOR_ID_OLD: u32 = 0;
/// siw's vendor ID (`SIW_VENDOR_ID`, ASCII "bmt").
const SIW_VENDOR_ID: u32 = 0x62_6d74;

/// Whether a device of `transport` and `vendor` needs remote write on an RDMA READ's sink:
/// iWARP but siw (an iWARP device whose vendor cannot be read counts as one that does).
fn read_sink_needs_remote_write(transport: u32, vendor: Option<u32>) -> bool {
    transport == TRANSPORT_IWARP && vendor != Some(SIW_VENDOR_ID)
}

/// Whether a device of `transport` and `vendor` (its vendor ID, if it could be read) sends
/// LAST_WQE_REACHED.
fn sends_last_wqe(transport: u32, vendor: Option<u32>) -> bool {
    transport != TRANSPORT_IWARP
        && vendor.is_some_and(|v| !matches!(v, RXE_VENDOR_ID | RXE_VENDOR_ID_OLD | SIW_VENDOR_ID))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_hardware_iwarp_needs_remote_write_on_a_read_sink() {
        // Chelsio (cxgb4), and an iWARP device whose vendor could not be read.
        assert!(read_sink_needs_remote_write(TRANSPORT_IWARP, Some(0x1425)));
        assert!(read_sink_needs_remote_write(TRANSPORT_IWARP, None));
        // siw; InfiniBand and RoCE (Mellanox, rxe).
        assert!(!read_sink_needs_remote_write(
            TRANSPORT_IWARP,
            Some(SIW_VENDOR_ID)
        ));
        assert!(!read_sink_needs_remote_write(0, Some(0x02c9)));
        assert!(!read_sink_needs_remote_write(0, Some(RXE_VENDOR_ID)));
    }
}
