//! Controllers coming and going (connects, resets, disconnects), admin commands, and the
//! reads of quiet points and of the end.

use std::time::{Duration, Instant};

use nvmf_host::PipelinedQueue;
use nvmfd_nvme::host::{AdminQueue, HostError, IoQueue};
use nvmfd_nvme::wire::property;

use super::{Host, IN_CAPSULE, MAX_IO};
use crate::stress::{Report, SUBSYSTEM};

/// How long a reset may take before the target is taken as stuck.
const RESET_LIMIT: Duration = Duration::from_secs(30);

impl Host {
    /// `n` I/O queues of random depths for the controller of `admin`.
    pub(super) fn connect_ios(
        &mut self,
        admin: &AdminQueue<nvmf_host::RdmaQueue>,
        n: u16,
    ) -> Result<(Vec<IoQueue<PipelinedQueue>>, Vec<usize>), HostError> {
        let mut ios = Vec::new();
        let mut depth = Vec::new();
        for qid in 1..=n {
            let d = [1u16, 2, 4, 8, 16, 32][self.rng.usize(0..6)];
            // The queue has a slot more than the commands kept out: Connect needs none then.
            let slots = d.max(2);
            let q =
                PipelinedQueue::connect(self.channel(), self.addr, qid, slots, IN_CAPSULE, MAX_IO)?;
            let mut io = IoQueue::connect(q, &self.id, SUBSYSTEM, admin.cntlid, qid, slots - 1)?;
            io.transport().set_timeout(Duration::from_secs(15));
            ios.push(io);
            depth.push(usize::from(d));
        }
        Ok((ios, depth))
    }

    /// Every command outstanding on controller `c`'s I/O queues ends as failed (they may
    /// still land), and the queues disconnect.
    fn abandon(&mut self, c: usize, report: &mut Report) {
        let n = self.ctrls[c].as_ref().map_or(0, |x| x.ios.len());
        for q in 0..n {
            if let Some(ctrl) = self.ctrls[c].as_mut() {
                let io = ctrl.ios[q].transport();
                io.abandon("the host gave the queue up");
                io.disconnect();
            }
        }
        self.poll_ctrl(c, report);
    }

    /// Controller `c` goes (its commands outstanding end as failed) and a new one connects.
    pub(super) fn reconnect(&mut self, c: usize, report: &mut Report) {
        self.abandon(c, report);
        if let Some(mut ctrl) = self.ctrls[c].take() {
            ctrl.admin.transport().disconnect();
        }
        self.connect(c, report);
    }

    /// A controller reset: CC.EN to 0, waiting for CSTS.RDY 0 while the target ends the I/O
    /// queues (their commands answered or failed), then enabled again with new I/O queues.
    pub(super) fn reset(&mut self, c: usize, report: &mut Report) {
        match self.try_reset(c, report) {
            Ok(true) => report.resets += 1,
            Ok(false) => {}
            Err(_) => self.reconnect(c, report),
        }
    }

    fn try_reset(&mut self, c: usize, report: &mut Report) -> Result<bool, HostError> {
        let Some(ctrl) = self.ctrls[c].as_mut() else {
            return Ok(false);
        };
        let cc = ctrl.admin.property_get(property::CC, false)?;
        ctrl.admin
            .property_set(property::CC, u32::try_from(cc).unwrap_or(0) & !1)?;
        let end = Instant::now() + RESET_LIMIT;
        loop {
            self.poll_ctrl(c, report);
            let ctrl = self.ctrls[c].as_mut().expect("present above");
            if ctrl.admin.property_get(property::CSTS, false)? & 1 == 0 {
                break;
            }
            if Instant::now() > end {
                report.mismatches.push(format!(
                    "CSTS.RDY still 1 {RESET_LIMIT:?} after CC.EN was cleared"
                ));
                return Err(HostError::Timeout("CSTS.RDY"));
            }
        }
        // The old association's queues are gone: whatever is still out ended with them.
        self.abandon(c, report);
        let mut ctrl = self.ctrls[c].take().expect("present above");
        ctrl.ios.clear();
        ctrl.admin.enable()?;
        let n = self.rng.u16(1..=3);
        ctrl.admin.set_queue_count(n)?;
        let (ios, depth) = self.connect_ios(&ctrl.admin, n)?;
        ctrl.ios = ios;
        ctrl.depth = depth;
        self.ctrls[c] = Some(ctrl);
        Ok(true)
    }

    /// A random admin command on controller `c` (Identify, a log page, a feature,
    /// keep-alive); a failed one breaks the controller, which connects again.
    pub(super) fn admin_op(&mut self, c: usize, report: &mut Report) {
        let which = self.rng.u32(0..5);
        let nsi = self.rng.usize(0..self.ns.len().max(1));
        let Some(ctrl) = self.ctrls[c].as_mut() else {
            return;
        };
        let a = &mut ctrl.admin;
        let (name, result) = match which {
            0 => ("identify_controller", a.identify_controller().map(drop)),
            1 => {
                let expect = self.ns.get(nsi).map(|m| (m.nsid, m.blocks));
                let r = match expect {
                    Some((nsid, blocks)) => a.identify_namespace(nsid).map(|id| {
                        if id.nsze.get() != blocks {
                            report.mismatches.push(format!(
                                "Identify Namespace {nsid}: {} blocks, {blocks} before",
                                id.nsze.get()
                            ));
                        }
                    }),
                    None => Ok(()),
                };
                ("identify_namespace", r)
            }
            2 => ("get_log_page", a.get_log_page(0x02, 0, 512).map(drop)),
            3 => ("get_features", a.get_feature(0x07).map(drop)),
            _ => ("keep_alive", a.keep_alive()),
        };
        ctrl.keep_alive = Instant::now();
        match result {
            Ok(()) => *report.ops.entry(name).or_default() += 1,
            Err(e) => {
                *report.failed.entry(name).or_default() += 1;
                match e.status() {
                    Some(st) => *report.statuses.entry(format!("{st:?}")).or_default() += 1,
                    None => self.reconnect(c, report),
                }
            }
        }
    }

    /// Keep-alives for the controllers that said nothing on their admin queue for a while.
    pub(super) fn keep_alives(&mut self, report: &mut Report) {
        for c in 0..self.ctrls.len() {
            let due = self.ctrls[c]
                .as_ref()
                .is_some_and(|x| x.keep_alive.elapsed() > Duration::from_secs(2));
            if due {
                let Some(ctrl) = self.ctrls[c].as_mut() else {
                    continue;
                };
                ctrl.keep_alive = Instant::now();
                match ctrl.admin.keep_alive() {
                    Ok(()) => *report.ops.entry("keep_alive").or_default() += 1,
                    Err(_) => {
                        *report.failed.entry("keep_alive").or_default() += 1;
                        self.reconnect(c, report);
                    }
                }
            }
        }
    }

    /// Every command outstanding answered or failed.
    pub(in crate::stress) fn drain(&mut self, report: &mut Report) {
        let end = Instant::now() + Duration::from_secs(60);
        loop {
            self.poll_all(report);
            let out: usize = self
                .ctrls
                .iter_mut()
                .flatten()
                .flat_map(|c| c.ios.iter_mut())
                .map(|io| io.transport().outstanding())
                .sum();
            if out == 0 {
                return;
            }
            if Instant::now() > end {
                report
                    .mismatches
                    .push(format!("{out} commands still unanswered after 60 s"));
                return;
            }
            std::thread::yield_now();
        }
    }

    /// Reads `nlb` blocks at `lba` of namespace `ns` on the first controller's first queue.
    fn read_sync(&mut self, ns: usize, lba: u64, nlb: u32) -> Result<Vec<u8>, HostError> {
        let len = nlb as usize * self.ns[ns].block_size;
        let nsid = self.ns[ns].nsid;
        let ctrl = self
            .ctrls
            .iter_mut()
            .flatten()
            .find(|c| !c.ios.is_empty())
            .ok_or(HostError::Timeout("a connected controller"))?;
        let mut buf = vec![0u8; len];
        ctrl.ios[0].read(nsid, lba, nlb, &mut buf)?;
        Ok(buf)
    }

    /// At a quiet point: each tainted block read back, checked and known again.
    pub(in crate::stress) fn settle(&mut self, report: &mut Report) {
        for ns in 0..self.ns.len() {
            let max = MAX_IO / self.ns[ns].block_size as u32;
            let mut from = 0;
            while let Some((lba, nlb)) = self.ns[ns].next_tainted(from, max) {
                match self.read_sync(ns, lba, nlb) {
                    Ok(data) => {
                        let bad = self.ns[ns].check_read(lba, &data, true);
                        report.mismatches.extend(bad.into_iter().map(|m| m.0));
                        report.settled_blocks += u64::from(nlb);
                        from = lba + u64::from(nlb);
                    }
                    Err(_) => {
                        // A fault: the blocks stay tainted until the next quiet point.
                        for c in 0..self.ctrls.len() {
                            self.reconnect(c, report);
                        }
                        return;
                    }
                }
            }
        }
    }

    /// With the faults off: every block of every namespace read back and checked.
    pub(in crate::stress) fn final_check(&mut self, report: &mut Report) {
        for ns in 0..self.ns.len() {
            let max = u64::from(MAX_IO / self.ns[ns].block_size as u32);
            let mut lba = 0;
            while lba < self.ns[ns].blocks {
                let nlb = max.min(self.ns[ns].blocks - lba) as u32;
                let mut tries = 0;
                let data = loop {
                    match self.read_sync(ns, lba, nlb) {
                        Ok(d) => break Some(d),
                        Err(e) if tries >= 3 => {
                            report.mismatches.push(format!(
                                "the final read of NSID {} LBA {lba} failed without faults: {e}",
                                self.ns[ns].nsid
                            ));
                            break None;
                        }
                        Err(_) => {
                            tries += 1;
                            for c in 0..self.ctrls.len() {
                                self.reconnect(c, report);
                            }
                        }
                    }
                };
                if let Some(data) = data {
                    let bad = self.ns[ns].check_read(lba, &data, false);
                    report.mismatches.extend(bad.into_iter().map(|m| m.0));
                    report.final_blocks += u64::from(nlb);
                }
                lba += u64::from(nlb);
            }
        }
    }

    /// Every controller disconnects.
    pub(in crate::stress) fn disconnect_all(&mut self, report: &mut Report) {
        for c in 0..self.ctrls.len() {
            self.abandon(c, report);
            if let Some(mut ctrl) = self.ctrls[c].take() {
                ctrl.admin.transport().disconnect();
            }
        }
    }
}
