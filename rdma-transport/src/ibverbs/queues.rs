//! Protection domains, memory regions, completion queues, shared receive queues and queue
//! pairs of an ibverbs device.

use super::*;

pub(crate) struct PdInner {
    pub(crate) pd: NonNull<ibv_pd>,
    pub(super) _ctx: Arc<Ctx>,
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
    pub(super) mr: NonNull<ibv_mr>,
    pub(super) owned: Option<crate::types::OwnedMem>,
    pub(super) _pd: Arc<PdInner>,
}

// SAFETY: an MR handle may move between threads. (Not Sync: `write` copies into the region
// through `&self`, which two threads must not do at once.)
unsafe impl Send for Mr {}

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
        let flags = i32::try_from(access.bits()).unwrap_or(0);
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
        let mem = crate::types::OwnedMem::zeroed(len + 4096);
        let off = mem.as_mut_ptr().align_offset(4096);
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
        assert!(
            offset
                .checked_add(out.len())
                .is_some_and(|end| end <= self.len()),
            "read past the region"
        );
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
        assert!(
            offset
                .checked_add(data.len())
                .is_some_and(|end| end <= self.len()),
            "write past the region"
        );
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
    pub(super) cq: NonNull<ibv_cq>,
    pub(super) channel: NonNull<ibv_comp_channel>,
    pub(super) _ctx: Arc<Ctx>,
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
    pub(super) channel: NonNull<ibv_comp_channel>,
    pub(crate) owner: Arc<CqOwner>,
    /// Where `poll` has the provider write completions: zeroed once, at creation, since a
    /// provider writes only the fields valid for each completion (an error's opcode and
    /// length are left as they were), and a busy-polling reactor calls `poll` every turn.
    pub(super) scratch: std::cell::UnsafeCell<Box<[ibv_wc; POLL_BATCH]>>,
}

/// A zeroed batch of work completions, for [`Cq::scratch`].
pub(super) fn zeroed_wcs() -> Box<[ibv_wc; POLL_BATCH]> {
    // SAFETY: `ibv_wc` is plain C data (integers, C enums whose zero is a valid value, and a
    // union of integers), for which all-zero bytes are a valid value.
    Box::new(unsafe { std::mem::zeroed() })
}

// SAFETY: a CQ is polled by the thread that owns the handle; the handle may move (with its
// scratch batch, which only `poll`, through `&self` on that thread, touches: `Cq` is not
// `Sync`).
unsafe impl Send for Cq {}

impl std::fmt::Debug for Cq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ibverbs::Cq")
    }
}

/// Most completions one `poll` call reads.
pub const POLL_BATCH: usize = 32;

pub(super) fn wc_status(s: u32) -> WcStatus {
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
        // SAFETY: `Cq` is not `Sync` and `poll` does not re-enter itself, so this is the only
        // reference to the scratch batch while it lives.
        let raw = unsafe { &mut *self.scratch.get() };
        let n = i32::try_from(out.len().min(POLL_BATCH)).unwrap_or(0);
        // SAFETY: live CQ; `raw` has room for n <= POLL_BATCH entries; poll_cq was checked at
        // open.
        let got = unsafe { ibv_poll_cq(self.cq.as_ptr(), n, raw.as_mut_ptr()) };
        if got < 0 {
            // A negative count, not an errno (mlx5 returns CQ_POLL_ERR, -2, for a CQE it
            // cannot parse).
            return Err(VerbsError::Invalid {
                op: "poll_cq",
                why: "the provider failed to poll the CQ",
            });
        }
        let got = usize::try_from(got).unwrap_or(0).min(POLL_BATCH);
        for (o, w) in out.iter_mut().zip(&raw[..got]) {
            // SAFETY: status and opcode are C enums read as integers (every value is
            // initialized: the batch was zeroed, and the provider writes integers).
            let status =
                unsafe { ptr::read((&w.status as *const ibv_wc_status::Type).cast::<u32>()) };
            let status = wc_status(status);
            let ok = status == WcStatus::Success;
            // The opcode and length of a failed completion are not set by every provider:
            // reported as a receive of nothing.
            // SAFETY: as above.
            let opcode =
                unsafe { ptr::read((&w.opcode as *const ibv_wc_opcode::Type).cast::<u32>()) };
            let with_inv = ok && w.wc_flags & 8 != 0; // IBV_WC_WITH_INV
            *o = Wc {
                wr_id: w.wr_id,
                status,
                opcode: match (ok, opcode) {
                    (true, 0) => WcOpcode::Send,
                    (true, 1) => WcOpcode::RdmaWrite,
                    (true, 2) => WcOpcode::RdmaRead,
                    _ => WcOpcode::Recv,
                },
                byte_len: if ok { w.byte_len } else { 0 },
                qp_num: w.qp_num,
                invalidated_rkey: if with_inv {
                    // SAFETY: the union holds the invalidated rkey when WITH_INV is set (and
                    // is read only then).
                    Some(unsafe { w.imm_data_invalidated_rkey_union.invalidated_rkey })
                } else {
                    None
                },
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
    pub(super) srq: NonNull<ibv_srq>,
    pub(super) _pd: Arc<PdInner>,
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
        }
        if n == 0 {
            return Ok(());
        }
        let base = link(&mut raw[..n], |w, next| w.next = next);
        let mut bad = ptr::null_mut();
        // SAFETY: a well-formed chain on the stack, linked through `base` with nothing written
        // to `raw` since; live SRQ; post_srq_recv checked at open.
        let rc = unsafe { ibv_post_srq_recv(self.srq.as_ptr(), base, &mut bad) };
        post_result("post_srq_recv", rc, first_not_posted(&raw[..n], bad), n)
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
pub(super) fn first_not_posted<T>(raw: &[T], bad: *mut T) -> usize {
    raw.iter()
        .position(|r| std::ptr::eq(r, bad))
        .unwrap_or(raw.len())
}

/// Links the work requests of `chain` in order (`set_next(w, next)`; the last one's next is
/// null) and returns a pointer to the first. Every pointer is derived from one raw pointer to
/// the whole slice, taken after the requests were filled in: none is invalidated by a later
/// write through the slice (the provider reads the chain through them), as pointers taken
/// from `&mut chain[i + 1]` while filling in the requests would be.
fn link<W>(chain: &mut [W], set_next: impl Fn(&mut W, *mut W)) -> *mut W {
    let n = chain.len();
    let base = chain.as_mut_ptr();
    for i in 0..n {
        let next = if i + 1 < n {
            // SAFETY: i + 1 < n: within the slice.
            unsafe { base.add(i + 1) }
        } else {
            ptr::null_mut()
        };
        // SAFETY: i < n: within the slice, and no reference to the slice is live.
        set_next(unsafe { &mut *base.add(i) }, next);
    }
    base
}

/// A post's result: `rc` 0 with every work request before `posted` posted (a provider that
/// returns 0 with `bad_wr` at a refused request, as siw can after ringing its doorbell, has
/// posted only those before it), or the errno with how many were posted: positive, or
/// negative (siw returns `-errno`), or -1 with errno set (rxe's doorbell).
pub(super) fn post_result(
    op: &'static str,
    rc: i32,
    posted: usize,
    chain: usize,
) -> Result<(), VerbsError> {
    match rc {
        0 if posted < chain => Err(VerbsError::post(op, libc::EINVAL, posted)),
        0 => Ok(()),
        rc if rc > 0 => Err(VerbsError::post(op, rc, posted)),
        -1 => Err(VerbsError::post(op, errno(), posted)),
        rc => Err(VerbsError::post(op, rc.saturating_neg(), posted)),
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
    // Inline data's one SGE each (the key unused), here for the call.
    let mut inline_sges = [Sge::default(); SEND_BATCH];
    let n = wrs.len();
    for i in 0..n {
        let w = &wrs[i];
        if let Some(data) = w.inline {
            inline_sges[i] = Sge {
                addr: data.as_ptr() as u64,
                length: u32::try_from(data.len()).unwrap_or(u32::MAX),
                lkey: 0,
            };
        }
    }
    for i in 0..n {
        let w = &wrs[i];
        let r = &mut raw[i];
        r.wr_id = w.wr_id;
        let sges: &[Sge] = if w.inline.is_some() {
            std::slice::from_ref(&inline_sges[i])
        } else {
            w.sges
        };
        r.sg_list = sges.as_ptr().cast_mut().cast();
        r.num_sge = i32::try_from(sges.len()).unwrap_or(i32::MAX);
        let mut flags = 0u32;
        if w.signaled {
            flags |= 2; // IBV_SEND_SIGNALED
        }
        if w.inline.is_some() {
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
    let base = link(&mut raw[..n], |w, next| w.next = next);
    let mut bad = ptr::null_mut();
    // SAFETY: a well-formed chain on the stack, linked through `base` with nothing written to
    // `raw` since, whose SGE lists (the callers' and `inline_sges`) outlive the call; inline
    // SGEs point into slices borrowed for the call, copied during it; live QP; post_send
    // checked at open.
    let rc = unsafe { ibv_post_send(qp, base, &mut bad) };
    post_result("post_send", rc, first_not_posted(&raw[..n], bad), n)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A post's outcome from the provider's return code and where its `bad_wr` stopped.
    #[test]
    fn a_post_result_counts_what_was_posted_and_names_the_errno() {
        assert!(post_result("post_send", 0, 3, 3).is_ok());
        // siw: 0 after its doorbell, with bad_wr at the request it refused.
        let e = post_result("post_send", 0, 1, 3).unwrap_err();
        assert_eq!((e.posted(), e.errno()), (1, Some(libc::EINVAL)));
        // A positive errno (mlx5, rxe's checks), a negative one (siw).
        let e = post_result("post_send", libc::ENOMEM, 2, 3).unwrap_err();
        assert_eq!((e.posted(), e.errno()), (2, Some(libc::ENOMEM)));
        let e = post_result("post_srq_recv", -libc::EINVAL, 0, 4).unwrap_err();
        assert_eq!((e.posted(), e.errno()), (0, Some(libc::EINVAL)));
    }

    /// A chain is linked in order through pointers into the slice, the last one's next null.
    #[test]
    fn a_chain_is_linked_in_order() {
        // SAFETY: plain data.
        let mut raw: [ibv_send_wr; 3] = unsafe { std::mem::zeroed() };
        for (i, w) in raw.iter_mut().enumerate() {
            w.wr_id = i as u64;
        }
        let mut at = link(&mut raw, |w, next| w.next = next);
        let mut seen = Vec::new();
        while !at.is_null() {
            // SAFETY: every pointer in the chain points into `raw`, which is alive.
            unsafe {
                seen.push((*at).wr_id);
                at = (*at).next;
            }
        }
        assert_eq!(seen, [0, 1, 2]);
    }
}
