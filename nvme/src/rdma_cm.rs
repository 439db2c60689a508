//! The NVMe/RDMA connection handshake: what the host's RDMA CM request private data must say,
//! and what the target answers in its accept or reject.

use zerocopy::little_endian::U16;
use zerocopy::IntoBytes;

use crate::queue::CmParams;
use crate::target::Limits;
use crate::wire::{self, rdma_cm_status as st, RdmaCmAccept, RdmaCmReject, RdmaCmRequest};

/// A checked connect request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CmRequest {
    /// Queue ID and SQ size, to check against the Fabrics Connect that follows.
    pub params: CmParams,
    /// Host receive queue size (how many responses the host can take at once).
    pub hrqsize: u16,
    /// Controller ID (I/O queues; 0 when the host does not send it).
    pub cntlid: u16,
    /// RDMA READs the target may have in flight on this connection: the initiator depth the
    /// CM event reported (the host's responder resources); 16 until the transport sets it.
    pub read_depth: u8,
}

impl CmRequest {
    /// The request with the initiator depth its CM event reported (the host's responder
    /// resources). A host that takes no RDMA READ at all could not send a keyed write: it is
    /// refused at connect (Invalid IRD) rather than torn down at its first one.
    pub fn with_read_depth(mut self, initiator_depth: u8) -> Result<CmRequest, u16> {
        if initiator_depth == 0 {
            return Err(st::INVALID_IRD);
        }
        self.read_depth = initiator_depth;
        Ok(self)
    }

    /// The receive queue the target grants: one receive per SQ entry.
    pub fn crqsize(&self) -> u16 {
        self.params.hsqsize.saturating_add(1)
    }
}

/// Checks a connect request's private data; the error is the NVMe/RDMA reject status to send.
pub fn check_request(private_data: &[u8], limits: &Limits) -> Result<CmRequest, u16> {
    let Some(r) = wire::read::<RdmaCmRequest>(private_data) else {
        return Err(st::INVALID_PRIVATE_DATA_LENGTH);
    };
    if r.recfmt.get() != 0 {
        return Err(st::INVALID_RECFMT);
    }
    let qid = r.qid.get();
    if qid > limits.max_io_queues {
        return Err(st::INVALID_QID);
    }
    // HSQSIZE is 0's based: at least 2 entries, at most the largest queue granted.
    let hsqsize = r.hsqsize.get();
    if hsqsize == 0 || hsqsize >= limits.max_queue_depth {
        return Err(st::INVALID_HSQSIZE);
    }
    // An admin queue: at most the discovery log's ASQSZ.
    if qid == 0 && hsqsize >= crate::queue::ADMIN_QUEUE_ENTRIES {
        return Err(st::INVALID_HSQSIZE);
    }
    let hrqsize = r.hrqsize.get();
    if hrqsize == 0 || hrqsize > limits.max_queue_depth {
        return Err(st::INVALID_HRQSIZE);
    }
    Ok(CmRequest {
        params: CmParams { qid, hsqsize },
        hrqsize,
        cntlid: r.cntlid.get(),
        read_depth: 16,
    })
}

/// The private data of an accept granting `crqsize` receives.
pub fn accept_private_data(crqsize: u16) -> [u8; 32] {
    let a = RdmaCmAccept {
        recfmt: U16::new(0),
        crqsize: U16::new(crqsize),
        rsvd: [0; 28],
    };
    let mut out = [0u8; 32];
    out.copy_from_slice(a.as_bytes());
    out
}

/// The private data of a reject with NVMe/RDMA status `status`.
pub fn reject_private_data(status: u16) -> [u8; 4] {
    let r = RdmaCmReject {
        recfmt: U16::new(0),
        sts: U16::new(status),
    };
    let mut out = [0u8; 4];
    out.copy_from_slice(r.as_bytes());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(recfmt: u16, qid: u16, hrqsize: u16, hsqsize: u16) -> Vec<u8> {
        let r = RdmaCmRequest {
            recfmt: U16::new(recfmt),
            qid: U16::new(qid),
            hrqsize: U16::new(hrqsize),
            hsqsize: U16::new(hsqsize),
            cntlid: U16::new(7),
            rsvd: [0; 22],
        };
        r.as_bytes().to_vec()
    }

    #[test]
    fn what_the_linux_host_sends_is_accepted() {
        let l = Limits::default();
        // Admin queue: NVME_AQ_DEPTH 32 -> hsqsize 31, hrqsize 32.
        let r = check_request(&req(0, 0, 32, 31), &l).unwrap();
        assert_eq!(
            (
                r.params.qid,
                r.params.hsqsize,
                r.hrqsize,
                r.cntlid,
                r.crqsize()
            ),
            (0, 31, 32, 7, 32)
        );
        // I/O queue 3 of 128 entries.
        assert_eq!(
            check_request(&req(0, 3, 128, 127), &l).unwrap().crqsize(),
            128
        );
    }

    #[test]
    fn every_invalid_field_gets_its_reject_status() {
        let l = Limits::default();
        assert_eq!(
            check_request(&req(0, 0, 32, 31)[..31], &l),
            Err(st::INVALID_PRIVATE_DATA_LENGTH)
        );
        assert_eq!(check_request(&[], &l), Err(st::INVALID_PRIVATE_DATA_LENGTH));
        assert_eq!(
            check_request(&req(1, 0, 32, 31), &l),
            Err(st::INVALID_RECFMT)
        );
        assert_eq!(
            check_request(&req(0, 65, 32, 31), &l),
            Err(st::INVALID_QID),
            "64 I/O queues at most"
        );
        assert_eq!(
            check_request(&req(0, 1, 32, 0), &l),
            Err(st::INVALID_HSQSIZE)
        );
        assert_eq!(
            check_request(&req(0, 1, 32, 128), &l),
            Err(st::INVALID_HSQSIZE),
            "128 entries is the limit"
        );
        assert_eq!(
            check_request(&req(0, 0, 33, 32), &l),
            Err(st::INVALID_HSQSIZE),
            "an admin queue has 32 entries at most (ASQSZ)"
        );
        assert_eq!(check_request(&req(0, 1, 33, 32), &l).unwrap().crqsize(), 33);
        assert_eq!(
            check_request(&req(0, 1, 0, 31), &l),
            Err(st::INVALID_HRQSIZE)
        );
        assert_eq!(
            check_request(&req(0, 1, 129, 31), &l),
            Err(st::INVALID_HRQSIZE)
        );
    }

    #[test]
    fn accept_and_reject_private_data_are_laid_out_as_the_binding_says() {
        let a = accept_private_data(128);
        assert_eq!(&a[..4], &[0, 0, 128, 0]);
        assert!(a[4..].iter().all(|&b| b == 0));
        assert_eq!(reject_private_data(st::INVALID_HSQSIZE), [0, 0, 4, 0]);
    }
}
