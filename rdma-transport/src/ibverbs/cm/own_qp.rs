//! The QP of a connection this side accepts: its own (`ibv_create_qp`), moved through its
//! states here with the attributes rdma_cm gives, as librdmacm moves a QP it holds
//! (`rdma_create_qp`, `rdma_accept`, `rdma_disconnect`), but never held by librdmacm: it moves
//! a QP it holds to ERR while it reads a REJECTED event, on the thread reading the channel,
//! which for an accepted connection is not the thread that owns and destroys its QP. Here too:
//! accepting as a target (`accept_with`) and the RNR NAK timer its QP advertises.

use std::ptr::NonNull;

use rdma_sys::*;

use super::super::{check, errno, Pd};
use super::CmId;
use crate::types::*;

impl CmId {
    /// Accepts a connect request as a target does: granting this side `initiator_depth` RDMA
    /// READs in flight (at most the initiator depth the request's event reported), and
    /// offering the peer no RDMA READs at all (responder resources 0: a target never serves
    /// READs from its host, and the kernel's nvmet-rdma accepts the same way). The peer's QP
    /// then reads `initiator` 0 in [`CmId::read_depths`].
    ///
    /// The QP advertises `min_rnr_timer` (as in the InfiniBand table: 1 = 0.01 ms ... 12 =
    /// 0.64 ms ... 0 = 655.36 ms), how long a peer whose SEND found no receive waits before
    /// retrying, from the moment it can receive: rdma_cm gives 0, the longest, which starves a
    /// queue while a target's SRQ grows. An accepted connection's own QP takes it in its move
    /// to RTR, before the host can send; a QP librdmacm holds, right after the accept.
    pub fn accept_with(
        &self,
        private_data: &[u8],
        initiator_depth: u8,
        min_rnr_timer: u8,
    ) -> Result<(), VerbsError> {
        let mut p = Self::conn_param(private_data)?;
        p.initiator_depth = initiator_depth;
        p.responder_resources = 0;
        self.accept_own(p, Some(min_rnr_timer & 31))?;
        if self.own_qp.is_none() {
            // Accepted already: a device refusing the change leaves rdma_cm's timer, and the
            // connection stands.
            let _ = self.set_min_rnr_timer(min_rnr_timer);
        }
        Ok(())
    }

    /// The RNR NAK timer this side's QP advertises (its encoding, as `accept_with` takes it).
    pub fn min_rnr_timer(&self) -> Option<u8> {
        let qp = self.qp()?;
        // SAFETY: plain data.
        let (mut a, mut init): (ibv_qp_attr, ibv_qp_init_attr) =
            unsafe { (std::mem::zeroed(), std::mem::zeroed()) };
        // SAFETY: live QP; valid out-pointers; IBV_QP_MIN_RNR_TIMER = 1 << 15.
        let rc = unsafe { ibv_query_qp(qp, &mut a, 1 << 15, &mut init) };
        (rc == 0).then_some(a.min_rnr_timer)
    }

    /// Sets the RNR NAK timer of a QP in RTS (RTS to RTS, where it is an optional attribute).
    fn set_min_rnr_timer(&self, code: u8) -> Result<(), VerbsError> {
        let qp = self.qp().ok_or(VerbsError::Invalid {
            op: "modify_qp",
            why: "no QP",
        })?;
        // SAFETY: plain data.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.min_rnr_timer = code & 31;
        // SAFETY: live QP; IBV_QP_MIN_RNR_TIMER = 1 << 15.
        check("modify_qp", unsafe { ibv_modify_qp(qp, &mut a, 1 << 15) })
    }

    /// A QP of an accepted connection, made as `rdma_create_qp` makes one (in INIT, by the
    /// attributes rdma_cm gives), but not given to the ID.
    pub(super) fn create_own_qp(
        &self,
        pd: &Pd,
        a: &mut ibv_qp_init_attr,
    ) -> Result<NonNull<ibv_qp>, VerbsError> {
        // SAFETY: live ID and PD; reading their contexts.
        if unsafe { (*self.raw()).verbs != (*pd.inner.pd.as_ptr()).context } {
            return Err(VerbsError::os("ibv_create_qp", libc::EINVAL));
        }
        // SAFETY: a live PD; CQ and SRQ of its context, which outlive the QP (`_uses`).
        let qp = NonNull::new(unsafe { ibv_create_qp(pd.inner.pd.as_ptr(), a) })
            .ok_or_else(|| VerbsError::os("ibv_create_qp", errno()))?;
        let made = self
            .agree_ece(qp)
            .and_then(|()| self.modify_own(qp, ibv_qp_state::IBV_QPS_INIT, |_| ()))
            .and_then(|()| self.record_ece(qp));
        if let Err(e) = made {
            // SAFETY: the QP just made, used by nothing.
            unsafe { ibv_destroy_qp(qp.as_ptr()) };
            return Err(e);
        }
        Ok(qp)
    }

    /// The peer's ECE (enhanced connection establishment) options, if its request carried
    /// some, and this side's own QP `qp`'s (`None` where the provider has no ECE).
    pub(super) fn ece_of(
        &self,
        qp: NonNull<ibv_qp>,
    ) -> Result<Option<(ibv_ece, Option<ibv_ece>)>, VerbsError> {
        // SAFETY: plain data.
        let mut remote: ibv_ece = unsafe { std::mem::zeroed() };
        // SAFETY: a live ID holding no QP (librdmacm refuses one that does); valid out-pointer.
        check("rdma_get_remote_ece", unsafe {
            rdma_get_remote_ece(self.raw(), &mut remote)
        })?;
        if remote.vendor_id == 0 {
            return Ok(None);
        }
        // SAFETY: plain data.
        let mut ece: ibv_ece = unsafe { std::mem::zeroed() };
        // SAFETY: a live QP; valid out-pointer.
        match unsafe { ibv_query_ece(qp.as_ptr(), &mut ece) } {
            0 => Ok(Some((remote, Some(ece)))),
            libc::EOPNOTSUPP => Ok(Some((remote, None))),
            rc => Err(VerbsError::os("ibv_query_ece", rc)),
        }
    }

    /// The peer's ECE options, when its request carried some: set on this side's own QP `qp`
    /// where the vendor is the same, cleared where not, as `rdma_create_qp` does for a QP of a
    /// connect request (librdmacm's `init_ece`). A provider without ECE takes none.
    pub(super) fn agree_ece(&self, qp: NonNull<ibv_qp>) -> Result<(), VerbsError> {
        let Some((remote, Some(mut ece))) = self.ece_of(qp)? else {
            return Ok(());
        };
        ece.options = if ece.vendor_id == remote.vendor_id {
            remote.options
        } else {
            0
        };
        ece.comp_mask = 0;
        // SAFETY: a live QP in RESET; valid options.
        match unsafe { ibv_set_ece(qp.as_ptr(), &mut ece) } {
            0 | libc::EOPNOTSUPP => Ok(()),
            rc => Err(VerbsError::os("ibv_set_ece", rc)),
        }
    }

    /// The ECE options this side's own QP `qp` took (after INIT), for rdma_cm's REP, as
    /// `rdma_create_qp` records them (librdmacm's `set_local_ece`): only when the peer sent
    /// some.
    pub(super) fn record_ece(&self, qp: NonNull<ibv_qp>) -> Result<(), VerbsError> {
        let Some((_, Some(mut ece))) = self.ece_of(qp)? else {
            return Ok(());
        };
        if ece.vendor_id == 0 {
            return Ok(());
        }
        ece.comp_mask = 0;
        // SAFETY: a live ID holding no QP; valid options with a vendor.
        check("rdma_set_local_ece", unsafe {
            rdma_set_local_ece(self.raw(), &mut ece)
        })
    }

    /// Moves this side's own QP `qp` to `state` with the attributes rdma_cm gives for it (as
    /// librdmacm does for a QP it holds), `adjust` changing them first.
    pub(super) fn modify_own(
        &self,
        qp: NonNull<ibv_qp>,
        state: ibv_qp_state::Type,
        adjust: impl FnOnce(&mut ibv_qp_attr),
    ) -> Result<(), VerbsError> {
        // SAFETY: plain data.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = state;
        let mut mask = 0i32;
        // SAFETY: live ID; valid out-pointers.
        check("rdma_init_qp_attr", unsafe {
            rdma_init_qp_attr(self.raw(), &mut a, &mut mask)
        })?;
        if state == ibv_qp_state::IBV_QPS_RTR && self.link_layer_is_infiniband() {
            // As librdmacm does (it masks bits 21 to 23; 24 is the last of the old RoCE
            // attributes too): an old rdma_ucm sets them, for RoCE only.
            mask &= !0x01e0_0000;
        }
        adjust(&mut a);
        // SAFETY: a live QP of this ID's device; valid attributes.
        check("modify_qp", unsafe {
            ibv_modify_qp(qp.as_ptr(), &mut a, mask)
        })
    }

    /// Whether the ID's port is InfiniBand (not RoCE or iWARP).
    pub(super) fn link_layer_is_infiniband(&self) -> bool {
        // SAFETY: plain data.
        let mut a: ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: a live ID bound to a device and port; valid out-pointer.
        let rc = unsafe {
            let id = self.raw();
            ___ibv_query_port((*id).verbs, (*id).port_num, &mut a)
        };
        // IBV_LINK_LAYER_INFINIBAND.
        rc == 0 && a.link_layer == 1
    }

    /// Accepts with `p`: this side's own QP (an accepted connection's), if it has one, goes
    /// to RTR and RTS first, with the READ depths `p` grants (as `rdma_accept` moves a QP it
    /// holds) and the RNR NAK timer `min_rnr_timer` if given (rdma_cm's otherwise).
    pub(super) fn accept_own(
        &self,
        mut p: rdma_conn_param,
        min_rnr_timer: Option<u8>,
    ) -> Result<(), VerbsError> {
        if let Some(qp) = self.own_qp {
            let (resp, init) = (p.responder_resources, p.initiator_depth);
            // librdmacm's "the device's most" (255) is not taken here: depths are given.
            if resp == u8::MAX || init == u8::MAX {
                return Err(VerbsError::os("rdma_accept", libc::EINVAL));
            }
            self.modify_own(qp, ibv_qp_state::IBV_QPS_RTR, |a| {
                a.max_dest_rd_atomic = resp;
                // In the mask rdma_cm gives for RTR on InfiniBand and RoCE (iWARP has no RNR).
                if let Some(t) = min_rnr_timer {
                    a.min_rnr_timer = t;
                }
            })?;
            self.modify_own(qp, ibv_qp_state::IBV_QPS_RTS, |a| {
                a.max_rd_atomic = init;
            })?;
            // SAFETY: a live QP.
            p.qp_num = unsafe { (*qp.as_ptr()).qp_num };
            p.srq = 1;
        }
        // SAFETY: live ID (with a QP, or this side's own named in `p`); the private data
        // outlives the call (it is copied).
        check("rdma_accept", unsafe { rdma_accept(self.raw(), &mut p) })
    }

    /// Moves this side's own QP `qp` to ERR (SQD on iWARP) before a disconnect, as
    /// `rdma_disconnect` moves a QP librdmacm holds (`ucma_shutdown`).
    pub(super) fn shut_own(&self, qp: NonNull<ibv_qp>) -> Result<(), VerbsError> {
        // SAFETY: plain data.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        // SAFETY: a live ID bound to a device: reading its transport.
        let iwarp = unsafe { (*(*(*self.raw()).verbs).device).transport_type }
            == ibv_transport_type::IBV_TRANSPORT_IWARP;
        a.qp_state = if iwarp {
            ibv_qp_state::IBV_QPS_SQD
        } else {
            ibv_qp_state::IBV_QPS_ERR
        };
        // SAFETY: live QP; IBV_QP_STATE = 1.
        check("modify_qp", unsafe {
            ibv_modify_qp(qp.as_ptr(), &mut a, 1)
        })
    }
}
