//! Where a command's data is: its SGL checked against the command's direction and length
//! and against the capsule (in-capsule data, a keyed data block, a last segment of keyed
//! descriptors in the capsule), and the SGL of a command that moves none.

use super::*;

impl Queue {
    /// A command that moves no data (Keep Alive, Flush, Property Get, ...): its SGL must
    /// describe none (the Linux host sends a keyed data block of length 0), as the kernel
    /// target checks (`nvmet_check_transfer_len(req, 0)`): Data SGL Length Invalid for a
    /// descriptor of data, SGL Descriptor Type Invalid for one of no type nvmfd takes.
    pub(crate) fn no_data(&self, sqe: &Sqe) -> Result<(), Status> {
        match sqe.dptr.decode() {
            Sgl::Keyed { len: 0, .. } | Sgl::InCapsule { len: 0, .. } => Ok(()),
            Sgl::Keyed { .. } | Sgl::InCapsule { .. } | Sgl::LastSegment { .. } => {
                Err(status::DATA_SGL_LENGTH_INVALID)
            }
            Sgl::Unsupported { .. } => Err(status::SGL_DESCRIPTOR_TYPE_INVALID),
        }
    }

    /// Where a command's data is, checked against the direction and the capsule: the SGL of
    /// a command that moves `len` bytes (`host_to_target` for writes). It describes exactly
    /// `len` bytes: Identify does not report SGLS bit 18, so an SGL shorter or longer than
    /// the data is Data SGL Length Invalid, as the kernel target answers
    /// (`nvmet_check_transfer_len`).
    pub(crate) fn data_ref(
        &self,
        sqe: &Sqe,
        len: u32,
        host_to_target: bool,
        icd: &[u8],
    ) -> Result<DataRef, Status> {
        self.data_ref_of(sqe, len, host_to_target, icd, false)
    }

    /// [`Queue::data_ref`] for a command whose SGL may describe more than it moves (Dataset
    /// Management: a host sends a buffer of room for every range, as the kernel target takes
    /// it, `nvmet_check_data_len_lte`): its first `len` bytes are moved.
    pub(crate) fn data_ref_at_least(
        &self,
        sqe: &Sqe,
        len: u32,
        host_to_target: bool,
        icd: &[u8],
    ) -> Result<DataRef, Status> {
        self.data_ref_of(sqe, len, host_to_target, icd, true)
    }

    fn data_ref_of(
        &self,
        sqe: &Sqe,
        len: u32,
        host_to_target: bool,
        icd: &[u8],
        longer_ok: bool,
    ) -> Result<DataRef, Status> {
        // What an SGL of `l` bytes must be against the data's `len`.
        let wrong_length = |l: u64| l < u64::from(len) || (!longer_ok && l > u64::from(len));
        let icd_len = u32::try_from(icd.len()).unwrap_or(u32::MAX);
        if sqe.psdt() != 1 {
            return Err(status::INVALID_FIELD);
        }
        match sqe.dptr.decode() {
            Sgl::Keyed {
                addr,
                len: l,
                key,
                invalidate,
            } => {
                if wrong_length(u64::from(l)) {
                    return Err(status::DATA_SGL_LENGTH_INVALID);
                }
                Ok(DataRef::Keyed {
                    addr,
                    len,
                    key,
                    invalidate,
                })
            }
            Sgl::InCapsule { offset, len: l } => {
                // Data for the host cannot go in the capsule: Invalid Field, as the kernel
                // target answers (the descriptor's type is valid, the command's use is not).
                if !host_to_target {
                    return Err(status::INVALID_FIELD);
                }
                // Data described past what the queue's receive holds cannot be in the capsule:
                // SGL Offset Invalid, as the kernel target answers (nvmet_rdma_map_sgl_inline).
                if offset.saturating_add(u64::from(l)) > u64::from(self.in_capsule_limit) {
                    return Err(status::SGL_OFFSET_INVALID);
                }
                let Ok(offset) = u32::try_from(offset) else {
                    return Err(status::SGL_OFFSET_INVALID);
                };
                if offset >= icd_len.max(1) && len > 0 {
                    return Err(status::SGL_OFFSET_INVALID);
                }
                // What it describes must have arrived in the capsule.
                if wrong_length(u64::from(l))
                    || offset.checked_add(l).is_none_or(|end| end > icd_len)
                {
                    return Err(status::DATA_SGL_LENGTH_INVALID);
                }
                Ok(DataRef::InCapsule { offset, len })
            }
            Sgl::LastSegment { offset, len: l } => {
                // The list lies wholly in the capsule, holds whole descriptors, at most
                // MAX_SGL_DESCRIPTORS, all of them keyed data blocks without invalidation
                // (one SEND cannot invalidate several keys), and they hold the data.
                let Ok(offset) = u32::try_from(offset) else {
                    return Err(status::SGL_OFFSET_INVALID);
                };
                if offset % 16 != 0 || offset >= icd_len {
                    return Err(status::SGL_OFFSET_INVALID);
                }
                let count = l / 16;
                if l % 16 != 0 || count == 0 || offset.checked_add(l).is_none_or(|e| e > icd_len) {
                    return Err(status::DATA_SGL_LENGTH_INVALID);
                }
                if count > MAX_SGL_DESCRIPTORS {
                    return Err(status::SGL_DESCRIPTOR_COUNT_INVALID);
                }
                let mut total = 0u64;
                for d in icd[offset as usize..(offset + l) as usize].chunks_exact(16) {
                    match wire::read::<wire::SglDesc>(d).map(|d| d.decode()) {
                        Some(Sgl::Keyed {
                            len: dl,
                            invalidate: false,
                            ..
                        }) => total += u64::from(dl),
                        _ => return Err(status::SGL_DESCRIPTOR_TYPE_INVALID),
                    }
                }
                if wrong_length(total) {
                    return Err(status::DATA_SGL_LENGTH_INVALID);
                }
                Ok(DataRef::KeyedList { offset, count, len })
            }
            Sgl::Unsupported { .. } => Err(status::SGL_DESCRIPTOR_TYPE_INVALID),
        }
    }
}
