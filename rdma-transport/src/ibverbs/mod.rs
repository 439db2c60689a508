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
    /// `None`: opened by `ibv_open_device`, closed on drop. `Some`: librdmacm's context for
    /// the device of that rdma_cm ID. librdmacm keeps it open while an ID on the device lives,
    /// so the ID is held here: every object made on the context (each holds this `Ctx`) goes
    /// before the ID, and so before librdmacm may close the context.
    cm_id: Option<Arc<cm::IdHandle>>,
}

// SAFETY: an ibv_context is thread-safe (libibverbs locks internally where it must).
unsafe impl Send for Ctx {}
// SAFETY: as above.
unsafe impl Sync for Ctx {}

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
        if self.cm_id.is_none() {
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
            ctx: Arc::new(Ctx { ctx, cm_id: None }),
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
                cm_id: Some(id),
            }),
        };
        cm_contexts().push((ctx.as_ptr() as usize, Arc::downgrade(&d.ctx)));
        d.set_async_nonblocking()?;
        Ok(d)
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

    /// The next async event, without blocking.
    pub fn next_event(&self) -> Option<AsyncEvent> {
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
        e.or_else(|| self.next_event())
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

/// Whether a device of `transport` and `vendor` (its vendor ID, if it could be read) sends
/// LAST_WQE_REACHED.
fn sends_last_wqe(transport: u32, vendor: Option<u32>) -> bool {
    transport != TRANSPORT_IWARP
        && vendor.is_some_and(|v| !matches!(v, RXE_VENDOR_ID | RXE_VENDOR_ID_OLD | SIW_VENDOR_ID))
}

pub(crate) struct PdInner {
    pub(crate) pd: NonNull<ibv_pd>,
    _ctx: Arc<Ctx>,
}

// SAFETY: verbs objects may be used from any thread.
unsafe impl Send for PdInner {}
// SAFETY: as above.
unsafe impl Sync for PdInner {}

impl Drop for PdInner {
    fn drop(&mut self) {
        // SAFETY: every MR, SRQ and QP holds an Arc<PdInner>: none is alive.
        unsafe { ibv_dealloc_pd(self.pd.as_ptr()) };
    }
}

/// A protection domain.
#[derive(Clone)]
pub struct Pd {
    pub(crate) inner: Arc<PdInner>,
}

impl std::fmt::Debug for Pd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ibverbs::Pd")
    }
}

/// A registered memory region.
pub struct Mr {
    mr: NonNull<ibv_mr>,
    owned: Option<Box<[u8]>>,
    _pd: Arc<PdInner>,
}

// SAFETY: an MR handle may move between threads.
unsafe impl Send for Mr {}
// SAFETY: only its keys and address are read through &self.
unsafe impl Sync for Mr {}

impl std::fmt::Debug for Mr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ibverbs::Mr")
            .field("lkey", &self.lkey())
            .finish()
    }
}

impl Pd {
    /// Registers `len` bytes at `addr`.
    ///
    /// # Safety
    ///
    /// The memory must stay mapped until the `Mr` is dropped; the NIC reads and writes it at
    /// any time (shared memory: no references held across accesses it does not order).
    pub unsafe fn reg_mr(
        &self,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<Mr, VerbsError> {
        let flags = i32::try_from(access.0).unwrap_or(0);
        // SAFETY: the caller keeps the memory mapped; the PD is live.
        let mr = unsafe { ibv_reg_mr(self.inner.pd.as_ptr(), addr.cast(), len, flags) };
        let mr = NonNull::new(mr).ok_or_else(|| VerbsError::os("reg_mr", errno()))?;
        Ok(Mr {
            mr,
            owned: None,
            _pd: Arc::clone(&self.inner),
        })
    }

    /// Allocates `len` zeroed bytes and registers them.
    pub fn alloc_mr(&self, len: usize, access: Access) -> Result<Mr, VerbsError> {
        // Page-aligned: a page-sized receive SGE then never straddles two pages.
        let mut mem = vec![0u8; len + 4096].into_boxed_slice();
        let off = mem.as_ptr().align_offset(4096);
        // SAFETY: `off` < 4096, so `off + len` is within the allocation.
        let ptr = unsafe { mem.as_mut_ptr().add(off) };
        // SAFETY: the memory is owned by the returned Mr, freed after deregistration.
        let mut mr = unsafe { self.reg_mr(ptr, len, access)? };
        mr.owned = Some(mem);
        Ok(mr)
    }

    /// A shared receive queue.
    pub fn create_srq(&self, max_wr: u32, max_sge: u32) -> Result<Srq, VerbsError> {
        // SAFETY: plain data.
        let mut init: ibv_srq_init_attr = unsafe { std::mem::zeroed() };
        init.attr.max_wr = max_wr;
        init.attr.max_sge = max_sge;
        // SAFETY: live PD, valid attributes.
        let srq = unsafe { ibv_create_srq(self.inner.pd.as_ptr(), &mut init) };
        let srq = NonNull::new(srq).ok_or_else(|| VerbsError::os("create_srq", errno()))?;
        Ok(Srq {
            srq,
            owner: Arc::new(SrqOwner {
                srq,
                _pd: Arc::clone(&self.inner),
            }),
        })
    }
}

impl Mr {
    /// Local key.
    pub fn lkey(&self) -> u32 {
        // SAFETY: live MR.
        unsafe { (*self.mr.as_ptr()).lkey }
    }
    /// Remote key.
    pub fn rkey(&self) -> u32 {
        // SAFETY: live MR.
        unsafe { (*self.mr.as_ptr()).rkey }
    }
    /// Address.
    pub fn addr(&self) -> u64 {
        // SAFETY: live MR.
        unsafe { (*self.mr.as_ptr()).addr as u64 }
    }
    /// Length.
    pub fn len(&self) -> usize {
        // SAFETY: live MR.
        unsafe { (*self.mr.as_ptr()).length }
    }
    /// Whether the length is zero.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// An SGE for `len` bytes at `offset`.
    pub fn sge(&self, offset: usize, len: u32) -> Sge {
        Sge {
            addr: self.addr() + offset as u64,
            length: len,
            lkey: self.lkey(),
        }
    }
    /// Copies bytes out of the region.
    pub fn read(&self, offset: usize, out: &mut [u8]) {
        assert!(offset + out.len() <= self.len(), "read past the region");
        // SAFETY: in bounds of registered, mapped memory; raw copy of shared memory.
        unsafe {
            ptr::copy(
                (self.addr() as *const u8).add(offset),
                out.as_mut_ptr(),
                out.len(),
            )
        };
    }
    /// Copies bytes into the region.
    pub fn write(&self, offset: usize, data: &[u8]) {
        assert!(offset + data.len() <= self.len(), "write past the region");
        // SAFETY: as in `read`.
        unsafe {
            ptr::copy(
                data.as_ptr(),
                (self.addr() as *mut u8).add(offset),
                data.len(),
            )
        };
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: live MR, deregistered once; the owned memory is freed after this.
        unsafe { ibv_dereg_mr(self.mr.as_ptr()) };
    }
}

/// Owns a CQ and its channel: destroyed when the last holder (the `Cq`, or a CM ID whose QP
/// uses it) goes.
pub(crate) struct CqOwner {
    cq: NonNull<ibv_cq>,
    channel: NonNull<ibv_comp_channel>,
    _ctx: Arc<Ctx>,
}

// SAFETY: destroyed once, from whichever thread drops the last holder.
unsafe impl Send for CqOwner {}
// SAFETY: holders only keep it alive; nothing is accessed through &CqOwner.
unsafe impl Sync for CqOwner {}

impl Drop for CqOwner {
    fn drop(&mut self) {
        // SAFETY: no QP uses the CQ any more (each holds this owner); then its channel.
        unsafe {
            ibv_destroy_cq(self.cq.as_ptr());
            ibv_destroy_comp_channel(self.channel.as_ptr());
        }
    }
}

/// A completion queue with its completion channel.
pub struct Cq {
    pub(crate) cq: NonNull<ibv_cq>,
    channel: NonNull<ibv_comp_channel>,
    pub(crate) owner: Arc<CqOwner>,
}

// SAFETY: a CQ is polled by the thread that owns the handle; the handle may move.
unsafe impl Send for Cq {}

impl std::fmt::Debug for Cq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ibverbs::Cq")
    }
}

/// Most completions one `poll` call reads.
pub const POLL_BATCH: usize = 32;

fn wc_status(s: u32) -> WcStatus {
    match s {
        0 => WcStatus::Success,
        1 => WcStatus::LocLenErr,
        2 => WcStatus::LocQpOpErr,
        4 => WcStatus::LocProtErr,
        5 => WcStatus::WrFlushErr,
        9 => WcStatus::RemInvReqErr,
        10 => WcStatus::RemAccessErr,
        11 => WcStatus::RemOpErr,
        12 => WcStatus::RetryExcErr,
        13 => WcStatus::RnrRetryExcErr,
        _ => WcStatus::GeneralErr,
    }
}

impl Cq {
    /// Polls up to `out.len()` (at most [`POLL_BATCH`]) completions.
    pub fn poll(&self, out: &mut [Wc]) -> Result<usize, VerbsError> {
        // SAFETY: ibv_wc is plain data (a union of integers included).
        let mut raw: [ibv_wc; POLL_BATCH] = unsafe { std::mem::zeroed() };
        let n = i32::try_from(out.len().min(POLL_BATCH)).unwrap_or(0);
        // SAFETY: live CQ; `raw` holds n entries; poll_cq was checked at open.
        let got = unsafe { ibv_poll_cq(self.cq.as_ptr(), n, raw.as_mut_ptr()) };
        if got < 0 {
            return Err(VerbsError::os("poll_cq", -got));
        }
        let got = usize::try_from(got).unwrap_or(0);
        for (o, w) in out.iter_mut().zip(&raw[..got]) {
            // SAFETY: status and opcode are C enums read as integers.
            let status =
                unsafe { ptr::read((&w.status as *const ibv_wc_status::Type).cast::<u32>()) };
            // SAFETY: as above.
            let opcode =
                unsafe { ptr::read((&w.opcode as *const ibv_wc_opcode::Type).cast::<u32>()) };
            let with_inv = w.wc_flags & 8 != 0; // IBV_WC_WITH_INV
            *o = Wc {
                wr_id: w.wr_id,
                status: wc_status(status),
                opcode: match opcode {
                    0 => WcOpcode::Send,
                    1 => WcOpcode::RdmaWrite,
                    2 => WcOpcode::RdmaRead,
                    _ => WcOpcode::Recv,
                },
                byte_len: w.byte_len,
                qp_num: w.qp_num,
                // SAFETY: the union holds the invalidated rkey when WITH_INV is set.
                invalidated_rkey: with_inv
                    .then_some(unsafe { w.imm_data_invalidated_rkey_union.invalidated_rkey }),
            };
        }
        Ok(got)
    }

    /// Arms the completion channel: its fd turns readable at the next completion (once).
    pub fn req_notify(&self) -> Result<(), VerbsError> {
        // SAFETY: live CQ; req_notify_cq was checked at open.
        check("req_notify_cq", unsafe {
            ibv_req_notify_cq(self.cq.as_ptr(), 0)
        })
    }

    /// Takes the channel's notification, if one came; true when it did.
    pub fn ack_event(&self) -> bool {
        let mut cq = ptr::null_mut();
        let mut ctx = ptr::null_mut();
        // SAFETY: live channel (non-blocking).
        if unsafe { ibv_get_cq_event(self.channel.as_ptr(), &mut cq, &mut ctx) } != 0 {
            return false;
        }
        // SAFETY: every event got is acked (before the CQ is destroyed).
        unsafe { ibv_ack_cq_events(cq, 1) };
        true
    }

    /// The handle async events name the CQ by.
    pub fn id(&self) -> u32 {
        // SAFETY: live CQ.
        unsafe { (*self.cq.as_ptr()).handle }
    }

    /// The completion channel's fd.
    pub fn channel_fd(&self) -> RawFd {
        // SAFETY: live channel.
        unsafe { (*self.channel.as_ptr()).fd }
    }
}

/// Owns an SRQ: destroyed when the last holder (the `Srq`, or a CM ID whose QP uses it) goes.
pub(crate) struct SrqOwner {
    srq: NonNull<ibv_srq>,
    _pd: Arc<PdInner>,
}

// SAFETY: as for CqOwner.
unsafe impl Send for SrqOwner {}
// SAFETY: as for CqOwner.
unsafe impl Sync for SrqOwner {}

impl Drop for SrqOwner {
    fn drop(&mut self) {
        // SAFETY: no QP uses it any more (each holds this owner).
        unsafe { ibv_destroy_srq(self.srq.as_ptr()) };
    }
}

/// A shared receive queue.
pub struct Srq {
    pub(crate) srq: NonNull<ibv_srq>,
    pub(crate) owner: Arc<SrqOwner>,
}

// SAFETY: posting to an SRQ is thread-safe in libibverbs; the handle may move.
unsafe impl Send for Srq {}

impl std::fmt::Debug for Srq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ibverbs::Srq")
    }
}

/// Most receives one `post_recv` call posts, and most SGEs per receive.
pub const RECV_BATCH: usize = 32;

impl Srq {
    /// Posts receives (a chain built on the stack; at most [`RECV_BATCH`]).
    ///
    /// On failure the error's [`VerbsError::posted`] tells how many receives, from the first,
    /// were posted: the provider stops at the first one it refuses.
    pub fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<(), VerbsError> {
        if wrs.len() > RECV_BATCH {
            return Err(VerbsError::post("post_srq_recv", libc::EINVAL, 0));
        }
        // SAFETY: plain data.
        let mut raw: [ibv_recv_wr; RECV_BATCH] = unsafe { std::mem::zeroed() };
        let n = wrs.len();
        for i in 0..n {
            raw[i].wr_id = wrs[i].wr_id;
            // Sge is repr(C) like ibv_sge; the NIC only reads the list during the call.
            raw[i].sg_list = wrs[i].sges.as_ptr().cast_mut().cast();
            raw[i].num_sge = i32::try_from(wrs[i].sges.len()).unwrap_or(i32::MAX);
            raw[i].next = if i + 1 < n {
                &mut raw[i + 1]
            } else {
                ptr::null_mut()
            };
        }
        if n == 0 {
            return Ok(());
        }
        let mut bad = ptr::null_mut();
        // SAFETY: a well-formed chain on the stack, live SRQ; post_srq_recv checked at open.
        let rc = unsafe { ibv_post_srq_recv(self.srq.as_ptr(), raw.as_mut_ptr(), &mut bad) };
        post_result("post_srq_recv", rc, first_not_posted(&raw[..n], bad))
    }

    /// Arms the SRQ limit.
    pub fn arm_limit(&self, limit: u32) -> Result<(), VerbsError> {
        // SAFETY: plain data.
        let mut a: ibv_srq_attr = unsafe { std::mem::zeroed() };
        a.srq_limit = limit;
        // SAFETY: live SRQ; IBV_SRQ_LIMIT = 2.
        check("modify_srq", unsafe {
            ibv_modify_srq(self.srq.as_ptr(), &mut a, 2)
        })
    }

    /// Attributes.
    pub fn query(&self) -> Result<SrqAttr, VerbsError> {
        // SAFETY: plain data.
        let mut a: ibv_srq_attr = unsafe { std::mem::zeroed() };
        // SAFETY: live SRQ.
        check("query_srq", unsafe {
            ibv_query_srq(self.srq.as_ptr(), &mut a)
        })?;
        Ok(SrqAttr {
            max_wr: a.max_wr,
            max_sge: a.max_sge,
            srq_limit: a.srq_limit,
        })
    }

    /// The handle async events name the SRQ by.
    pub fn id(&self) -> u32 {
        // SAFETY: live SRQ.
        unsafe { (*self.srq.as_ptr()).handle }
    }
}

/// Most work requests in one `post_send` chain, and most SGEs per request.
pub const SEND_BATCH: usize = crate::types::MAX_SEND_CHAIN;

/// Where a provider stopped in a chain built in `raw`: the index of the work request `bad`
/// points at (the first one not posted). A failure without `bad` (or pointing elsewhere)
/// leaves nothing known to be unposted: rxe, for one, returns its doorbell's error with every
/// request already in its queue, where the next doorbell will run them. Counting them posted
/// keeps their buffers held until they complete or their QP is destroyed.
fn first_not_posted<T>(raw: &[T], bad: *mut T) -> usize {
    raw.iter()
        .position(|r| std::ptr::eq(r, bad))
        .unwrap_or(raw.len())
}

/// A post's result: `rc` 0, or the errno (positive, or -1 with errno) with how many work
/// requests were posted.
fn post_result(op: &'static str, rc: i32, posted: usize) -> Result<(), VerbsError> {
    match rc {
        0 => Ok(()),
        rc if rc > 0 => Err(VerbsError::post(op, rc, posted)),
        _ => Err(VerbsError::post(op, errno(), posted)),
    }
}

/// Posts a chain of send WRs to `qp` (built on the stack). On failure the error's
/// [`VerbsError::posted`] is the index of the first work request not posted (`bad_wr`): those
/// before it were posted and complete as usual, it and those after it never will.
pub(crate) fn post_send(qp: *mut ibv_qp, wrs: &[SendWr<'_>]) -> Result<(), VerbsError> {
    if wrs.len() > SEND_BATCH {
        return Err(VerbsError::post("post_send", libc::EINVAL, 0));
    }
    if wrs.is_empty() {
        return Ok(());
    }
    // SAFETY: plain data (unions of integers and pointers).
    let mut raw: [ibv_send_wr; SEND_BATCH] = unsafe { std::mem::zeroed() };
    let n = wrs.len();
    for i in 0..n {
        let w = &wrs[i];
        let r = &mut raw[i];
        r.wr_id = w.wr_id;
        r.sg_list = w.sges.as_ptr().cast_mut().cast();
        r.num_sge = i32::try_from(w.sges.len()).unwrap_or(i32::MAX);
        let mut flags = 0u32;
        if w.signaled {
            flags |= 2; // IBV_SEND_SIGNALED
        }
        if w.inline {
            flags |= 8; // IBV_SEND_INLINE
        }
        r.send_flags = flags;
        match w.op {
            SendOp::Send => r.opcode = ibv_wr_opcode::IBV_WR_SEND,
            SendOp::SendWithInvalidate { rkey } => {
                r.opcode = ibv_wr_opcode::IBV_WR_SEND_WITH_INV;
                r.imm_data_invalidated_rkey_union.invalidated_rkey = rkey;
            }
            SendOp::RdmaWrite { remote_addr, rkey } => {
                r.opcode = ibv_wr_opcode::IBV_WR_RDMA_WRITE;
                r.wr.rdma = rdma_t { remote_addr, rkey };
            }
            SendOp::RdmaRead { remote_addr, rkey } => {
                r.opcode = ibv_wr_opcode::IBV_WR_RDMA_READ;
                r.wr.rdma = rdma_t { remote_addr, rkey };
            }
        }
    }
    for i in 0..n - 1 {
        let next: *mut ibv_send_wr = &mut raw[i + 1];
        raw[i].next = next;
    }
    let mut bad = ptr::null_mut();
    // SAFETY: a well-formed chain on the stack whose SGE lists outlive the call (inline data
    // is copied during it); live QP; post_send checked at open.
    let rc = unsafe { ibv_post_send(qp, raw.as_mut_ptr(), &mut bad) };
    post_result("post_send", rc, first_not_posted(&raw[..n], bad))
}
