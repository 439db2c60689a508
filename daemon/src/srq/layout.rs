//! How a receive is named and laid out: its work request ID (the SRQ's generation, the chunk,
//! the slot), and where in its chunk its 64-byte command and its in-capsule pages lie.

use super::*;

impl ElasticSrq {
    /// Whether `wr_id` names a receive of this SRQ (not of one it replaced).
    pub fn owns(&self, wr_id: u64) -> bool {
        (wr_id >> GEN_SHIFT) & GEN_MASK == self.generation
    }

    /// This SRQ's generation (in its receives' work request IDs).
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// A receive's chunk and slot; a receive of another generation names no chunk.
    pub(super) fn split(&self, wr_id: u64) -> (usize, u32) {
        if (wr_id >> GEN_SHIFT) & GEN_MASK != self.generation {
            return (usize::MAX, 0);
        }
        (
            usize::try_from((wr_id & ((1 << GEN_SHIFT) - 1)) >> SLOT_BITS).unwrap_or(usize::MAX),
            u32::try_from(wr_id & ((1 << SLOT_BITS) - 1)).unwrap_or(0),
        )
    }

    /// Where completed receive `wr_id`'s in-capsule data lies: its page SGEs, contiguous and
    /// page-aligned, and how many bytes they hold. Valid until the receive is given back with
    /// `completed` (its chunk cannot leave before that) and while this SRQ lives.
    pub fn icd(&self, wr_id: u64) -> Option<(std::ptr::NonNull<u8>, usize)> {
        let (idx, slot) = self.split(wr_id);
        let c = self.chunks.get(idx).and_then(Option::as_ref)?;
        if slot >= c.slots || self.icd_pages == 0 {
            return None;
        }
        let data =
            (c.slots as usize * 64).next_multiple_of(PAGE) + slot as usize * self.icd_pages * PAGE;
        let addr = usize::try_from(c.mr.addr()).ok()?.checked_add(data)?;
        std::ptr::NonNull::new(addr as *mut u8).map(|p| (p, self.icd_pages * PAGE))
    }

    /// Where completed receive `wr_id`'s capsule lies (`len` bytes received): its 64-byte
    /// command SGE, and its in-capsule data with how many bytes of it arrived (no more than
    /// the receive holds). Valid as `icd` is: until the receive is given back with
    /// `completed`, and while this SRQ lives.
    pub fn capsule_at(&self, wr_id: u64, len: usize) -> Option<CapsuleAt> {
        let (idx, slot) = self.split(wr_id);
        let c = self.chunks.get(idx).and_then(Option::as_ref)?;
        if slot >= c.slots || len < 64 {
            return None;
        }
        let base = usize::try_from(c.mr.addr()).ok()?;
        let cmd = std::ptr::NonNull::new(base.checked_add(slot as usize * 64)? as *mut u8)?;
        let icd = self
            .icd(wr_id)
            .map(|(p, room)| (p, (len - 64).min(room)))
            .filter(|&(_, n)| n > 0);
        Some((cmd, icd))
    }
}
