//! Devices nvmfd lets go of: a namespace removed (or its subsystem), or its device replaced.
//! Its hosts can no longer flush it, so once no reactor holds it (its last operation has
//! completed), its completed writes are made durable (`Device::sync`) on a thread of its own
//! before it closes. When the daemon stops, after the reactors, every device still open is
//! synced the same way, on the control thread.

use super::*;

/// A device let go of, waiting for the reactors to release it.
pub(super) struct Leaving {
    /// Subsystem NQN and NSID, for the log.
    pub(super) nqn: String,
    pub(super) nsid: u32,
    pub(super) dev: Arc<nvmfd_blockdev::Device>,
}

/// Syncs `dev` and logs the outcome; `when` says why ("let go", "stop"). Returns whether it
/// synced (or had nothing to sync).
fn sync_logged(
    log: &Logger,
    nqn: &str,
    nsid: u32,
    dev: &nvmfd_blockdev::Device,
    when: &str,
) -> bool {
    let began = Instant::now();
    match dev.sync() {
        Ok(true) => {
            info!(log, "namespace's device synced: its completed writes are durable";
                  "subsystem" => nqn, "nsid" => nsid, "when" => when, "took" => ?began.elapsed());
            true
        }
        Ok(false) => true,
        Err(e) => {
            error!(log, "namespace's device could not be synced: writes completed on it may not be durable";
                   "subsystem" => nqn, "nsid" => nsid, "when" => when, "error" => %e);
            false
        }
    }
}

impl Daemon {
    /// Every tick: a served namespace whose device failed a sync (a host's Flush, a FUA
    /// write on the buffered fallback) is logged, once: writeback lost data hosts were told
    /// was written, and every later Flush of it fails until it is opened again.
    pub(super) fn report_sync_failures(&self) {
        for ((nqn, nsid), dev) in &self.devices {
            if dev.first_sync_failure() {
                error!(self.log, "namespace's device failed a sync: writes hosts completed on it may be lost; every later Flush of it fails until it is opened again (remove and add it, or restart nvmfd)";
                       "subsystem" => nqn, "nsid" => nsid);
            }
        }
    }

    /// Every tick: devices let go of that no reactor holds any more are synced off this
    /// thread (an `fdatasync` can take long) and closed there.
    pub(super) fn sync_released_devices(&mut self) {
        let mut i = 0;
        while i < self.leaving.len() {
            if Arc::strong_count(&self.leaving[i].dev) > 1 {
                i += 1;
                continue;
            }
            let l = self.leaving.swap_remove(i);
            let log = self.log.clone();
            let name = (l.nqn.clone(), l.nsid);
            let started = spawn_counted(move || {
                sync_logged(&log, &l.nqn, l.nsid, &l.dev, "let go");
            });
            if let Err(e) = started {
                error!(self.log, "namespace's device could not be synced: writes completed on it may not be durable";
                       "subsystem" => name.0, "nsid" => name.1, "when" => "let go", "error" => e);
            }
        }
    }

    /// At stop, with the reactors joined: syncs every device still open, served or let go of.
    /// Returns how many could not be synced (the daemon then exits with an error).
    pub(super) fn sync_devices_at_stop(&mut self) -> usize {
        let leaving = std::mem::take(&mut self.leaving);
        let devices = std::mem::take(&mut self.devices);
        let all = devices
            .into_iter()
            .map(|((nqn, nsid), dev)| Leaving { nqn, nsid, dev })
            .chain(leaving);
        all.filter(|l| !sync_logged(&self.log, &l.nqn, l.nsid, &l.dev, "stop"))
            .count()
    }
}
