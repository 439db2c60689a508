//! Ending an operation as to syncs: a Flush that succeeded, and a FUA operation whose pages
//! went through the page cache, wait for the syncs of other engines begun before they ended
//! (one may have taken the report of a writeback error theirs did not see) and are settled
//! again once those have ended.

use super::*;

/// An operation that succeeded, waiting for syncs of other engines that may have taken the
/// report of a writeback error its own sync did not see.
pub(super) struct Parked {
    pub(super) slot: u32,
    pub(super) completion: Completion,
    /// It completes once every sync numbered below this has ended.
    pub(super) until: u64,
    /// `None` for a Flush, which then fails if any sync of the device ever failed
    /// (`Device::settle_sync`); for a FUA operation, the device's count of failed syncs when
    /// it started: it fails if one failed since.
    pub(super) failures_at_start: Option<u64>,
}

impl Parked {
    /// Its result, settled again once the syncs it waited for have ended.
    pub(super) fn settle(&mut self, dev: &Device) {
        match self.failures_at_start {
            None => dev.settle_sync(OpKind::Flush, false, &mut self.completion.result),
            Some(n) => {
                if self.completion.result.is_ok() && dev.sync_failures() != n {
                    self.completion.result = Err(BlockError::Io(libc::EIO));
                }
            }
        }
    }
}

impl Engine {
    /// Queues the slot's completion; the slot is freed when the completion is reaped.
    pub(super) fn finish(&mut self, slot: u32, mut result: Result<u32, BlockError>) {
        let s = self.slots[slot as usize]
            .take()
            .expect("finishing a live slot");
        let c = |result| Completion {
            tag: s.tag,
            op: s.op,
            result,
            buf: s.buf,
        };
        let Some(a) = self.devices[s.dev as usize].as_mut() else {
            self.ready.push_back((slot, c(result)));
            return;
        };
        a.in_flight -= 1;
        let synced = match s.op {
            OpKind::Flush | OpKind::WriteFua => true,
            OpKind::WriteZeroesFua => s.done > 0,
            _ => false,
        };
        a.dev.settle_sync(s.op, synced, &mut result);
        // Settled first, then ended: a Flush waiting for it sees the error it took.
        if let Some(n) = s.sync {
            a.dev.sync_end(n);
        }
        // Linux reports a writeback error once, to the first sync of the file that asks:
        // another sync begun before this Flush ended may have taken it, and end after. A
        // Flush that succeeded waits for those (not for syncs begun after it ended, which
        // cannot have), then is settled again. So does a FUA operation whose pages went
        // through the page cache: their writeback's failure may be the one reported there.
        let fua = s.op != OpKind::Flush && a.dev.fua_waits_for_others(s.op);
        if (s.op == OpKind::Flush || fua) && result.is_ok() && s.sync.is_some() {
            if s.op == OpKind::Flush {
                a.dev.flush_race_ends();
            }
            let mut p = Parked {
                slot,
                completion: c(result),
                until: 0,
                failures_at_start: fua.then_some(s.failures_at_start),
            };
            if let Some(until) = a.dev.syncs_to_wait_for() {
                p.until = until;
                a.parked.push(p);
                self.parked += 1;
                return;
            }
            // None left in flight, but one may have ended (its failure noted, as every sync
            // is settled before it ends) since this one was settled above.
            p.settle(&a.dev);
            self.ready.push_back((slot, p.completion));
            return;
        }
        self.ready.push_back((slot, c(result)));
    }

    /// Parked operations whose syncs to wait for have ended go on, settled again. With
    /// `all` (a drain, whose operations nobody waits for), every one goes on at once: the
    /// syncs it waits for may be another engine's on this same thread, which will not run
    /// until this drain ends; one whose syncs have not ended fails (whether it is durable
    /// is not known).
    pub(super) fn release_parked(&mut self, all: bool) {
        if self.parked == 0 {
            return;
        }
        for a in self.devices.iter_mut().flatten() {
            let mut i = 0;
            while i < a.parked.len() {
                let ended = a.dev.syncs_ended_before(a.parked[i].until);
                if ended || all {
                    let mut p = a.parked.swap_remove(i);
                    if ended {
                        p.settle(&a.dev);
                    } else if p.completion.result.is_ok() {
                        p.completion.result = Err(BlockError::Io(libc::EIO));
                    }
                    self.ready.push_back((p.slot, p.completion));
                    self.parked -= 1;
                } else {
                    i += 1;
                }
            }
        }
    }
}
