//! Test hooks: a stalled disk (every namespace's, or some namespaces'), and the faults of a
//! broken target that tests of hosts need (responses without their data, writes lost).

use super::*;

/// The data path's test hooks, all off in the daemon.
#[derive(Default)]
pub(super) struct Hooks {
    /// Block completions stay in the engine while set, as behind a disk that stalls.
    pub(super) hold_block_completions: bool,
    /// Namespaces (bit `nsid`) whose block completions wait in `held_completions`.
    pub(super) hold_namespaces: u64,
    pub(super) held_completions: Vec<nvmfd_blockdev::Completion>,
    /// Responses go without their data (a faulty target).
    pub(super) omit_read_data: bool,
    /// Tests of hosts: writes are acknowledged without reaching the disk.
    pub(super) discard_writes: bool,
    /// No turn reads the CQ to its end, as under a load that leaves a full batch at every
    /// poll.
    pub(super) cq_never_empty: bool,
    /// How long a connection without a Fabrics Connect is safe from being crowded out
    /// (`UNCONNECTED_GRACE` when not set).
    pub(super) unconnected_grace: Option<std::time::Duration>,
}

impl DataPath {
    /// Tests: QPs served at once, live and draining (`DataPathConfig::max_qps`, less what
    /// the device's CQs lack room for).
    #[doc(hidden)]
    pub fn max_qps(&self) -> u32 {
        self.max_qps
    }

    /// Tests: while `hold` is set, block operations complete in the engine but the data path
    /// does not take their completions, as if the disk had stalled.
    pub fn hold_block_completions(&mut self, hold: bool) {
        self.hooks.hold_block_completions = hold;
    }

    /// Tests: the block completions of the namespaces in `nsids` (bit `nsid`, NSIDs below 64)
    /// wait until their bit clears, as if their disk alone had stalled.
    #[doc(hidden)]
    pub fn hold_block_completions_of(&mut self, nsids: u64) {
        self.hooks.hold_namespaces = nsids;
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
        let mask = self.hooks.hold_namespaces;
        done.append(&mut self.hooks.held_completions);
        let mut k = 0;
        while k < done.len() {
            if held(&self.reqs, mask, &done[k]) {
                self.hooks.held_completions.push(done.swap_remove(k));
            } else {
                k += 1;
            }
        }
    }

    /// Tests of hosts: while `omit` is set, responses are sent without the RDMA WRITEs of
    /// their data, as a faulty target would answer a read.
    #[doc(hidden)]
    pub fn omit_read_data(&mut self, omit: bool) {
        self.hooks.omit_read_data = omit;
    }

    /// Tests of hosts: while `discard` is set, writes are acknowledged without reaching the
    /// disk (each becomes a flush), as a target that loses acknowledged writes would.
    #[doc(hidden)]
    pub fn discard_writes(&mut self, discard: bool) {
        self.hooks.discard_writes = discard;
    }

    /// Tests: while `on` is set, no turn reads the CQ to its end (every completion is still
    /// taken), as under a load that leaves a full batch at every poll.
    #[doc(hidden)]
    pub fn cq_never_empty(&mut self, on: bool) {
        self.hooks.cq_never_empty = on;
    }

    /// Tests: connections without a Fabrics Connect are safe from being crowded out by newer
    /// ones for `grace` instead of 5 s.
    #[doc(hidden)]
    pub fn unconnected_grace(&mut self, grace: std::time::Duration) {
        self.hooks.unconnected_grace = Some(grace);
    }

    /// Tests: the target it serves (to run the control thread's keep-alive check).
    #[doc(hidden)]
    pub fn target(&self) -> &Target {
        &self.target
    }
}
