//! Test hooks: a stalled disk (every namespace's, or some namespaces'), and the faults of a
//! broken target that tests of hosts need (responses without their data, writes lost).

use super::*;

impl DataPath {
    /// Tests: while `hold` is set, block operations complete in the engine but the data path
    /// does not take their completions, as if the disk had stalled.
    pub fn hold_block_completions(&mut self, hold: bool) {
        self.hold_block_completions = hold;
    }

    /// Tests: the block completions of the namespaces in `nsids` (bit `nsid`, NSIDs below 64)
    /// wait until their bit clears, as if their disk alone had stalled.
    #[doc(hidden)]
    pub fn hold_block_completions_of(&mut self, nsids: u64) {
        self.hold_namespaces = nsids;
    }

    /// Tests: moves the completions of held namespaces out of `done` into
    /// `held_completions`, and those no longer held back into it.
    pub(super) fn hold_completions_of_namespaces(
        &mut self,
        done: &mut Vec<nvmfd_blockdev::Completion>,
    ) {
        let held = |reqs: &[Option<Req>], mask: u64, c: &nvmfd_blockdev::Completion| {
            let i = (c.tag & post::SLOT_MASK) as usize;
            reqs.get(i)
                .and_then(Option::as_ref)
                .and_then(|r| match &r.work {
                    Work::Io(io) => Some(io.nsid),
                    _ => None,
                })
                .is_some_and(|nsid| nsid < 64 && mask & (1 << nsid) != 0)
        };
        let mask = self.hold_namespaces;
        done.append(&mut self.held_completions);
        let mut k = 0;
        while k < done.len() {
            if held(&self.reqs, mask, &done[k]) {
                self.held_completions.push(done.swap_remove(k));
            } else {
                k += 1;
            }
        }
    }

    /// Tests of hosts: while `omit` is set, responses are sent without the RDMA WRITEs of
    /// their data, as a faulty target would answer a read.
    #[doc(hidden)]
    pub fn omit_read_data(&mut self, omit: bool) {
        self.omit_read_data = omit;
    }

    /// Tests of hosts: while `discard` is set, writes are acknowledged without reaching the
    /// disk (each becomes a flush), as a target that loses acknowledged writes would.
    #[doc(hidden)]
    pub fn discard_writes(&mut self, discard: bool) {
        self.discard_writes = discard;
    }
}
