//! Devices nvmfd lets go of: a namespace removed (or its subsystem), or its device replaced.
//! Its hosts can no longer flush it, so once no reactor holds it (its last operation has
//! completed), its completed writes are made durable (`Device::sync`) on a thread of its own
//! before it closes. When the daemon stops, after the reactors, every device still open is
//! synced the same way, on the control thread.

use super::*;

/// A device let go of, waiting for the reactors to release it.
pub(super) struct Leaving {
    /// Its subsystem's ID, whose shutdowns wait for its sync, and the release's number
    /// there ([`Target::release_begins`]; none without a target).
    pub(super) sub: u64,
    pub(super) release: Option<u64>,
    /// Subsystem NQN and NSID, for the log.
    pub(super) nqn: String,
    pub(super) nsid: u32,
    pub(super) dev: Arc<nvmfd_blockdev::Device>,
}

/// The sync of a device let go of, on a thread of its own: whether it succeeded comes on `rx`.
pub(super) struct ReleaseSync {
    nqn: String,
    nsid: u32,
    rx: std::sync::mpsc::Receiver<bool>,
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

/// Syncs `l`'s device let go of ([`sync_logged`]) and tells `target` it ended.
fn sync_released(log: &Logger, target: Option<&Target>, l: &Leaving, when: &str) -> bool {
    let ok = sync_logged(log, &l.nqn, l.nsid, &l.dev, when);
    if let (Some(t), Some(n)) = (target, l.release) {
        t.release_ends(l.sub, n, ok);
    }
    ok
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
    /// thread (an `fdatasync` can take long) and closed there; one whose thread cannot
    /// start is synced here. Syncs that ended are counted (a failure makes the daemon exit
    /// with an error at stop).
    pub(super) fn sync_released_devices(&mut self) {
        let mut i = 0;
        while i < self.leaving.len() {
            if Arc::strong_count(&self.leaving[i].dev) > 1 {
                i += 1;
                continue;
            }
            let l = self.leaving.swap_remove(i);
            let (nqn, nsid) = (l.nqn.clone(), l.nsid);
            // The thread takes the device (it closes there); if the thread cannot start, it
            // is taken back and synced here.
            let handed = Arc::new(std::sync::Mutex::new(Some(l)));
            let (log, target, on_thread) =
                (self.log.clone(), self.target.clone(), Arc::clone(&handed));
            let gate = self.test_gate();
            let started = spawn_counted(move || {
                let l = on_thread.lock().unwrap_or_else(|e| e.into_inner()).take();
                if let Some(g) = gate {
                    super::off_thread::wait_at_gate(&g, "release");
                }
                l.is_none_or(|l| sync_released(&log, target.as_ref(), &l, "let go"))
            });
            match started {
                Ok(rx) => self.release_syncs.push(ReleaseSync { nqn, nsid, rx }),
                Err(e) => {
                    warn!(self.log, "cannot start a thread to sync a namespace's device let go of: synced on the control thread";
                          "subsystem" => &nqn, "nsid" => nsid, "error" => e);
                    let back = handed.lock().unwrap_or_else(|e| e.into_inner()).take();
                    if let Some(l) = back {
                        if !sync_released(&self.log, self.target.as_ref(), &l, "let go") {
                            self.release_sync_failures += 1;
                        }
                    }
                }
            }
        }
        self.collect_release_syncs(false);
    }

    /// Counts the release syncs that ended (all of them, waiting, with `wait`).
    fn collect_release_syncs(&mut self, wait: bool) {
        use std::sync::mpsc::TryRecvError;
        let log = &self.log;
        let failures = &mut self.release_sync_failures;
        self.release_syncs.retain(|r| {
            let ended = if wait {
                r.rx.recv().map_err(|_| TryRecvError::Disconnected)
            } else {
                r.rx.try_recv()
            };
            match ended {
                Ok(ok) => {
                    *failures += usize::from(!ok);
                    false
                }
                Err(TryRecvError::Empty) => true,
                Err(TryRecvError::Disconnected) => {
                    error!(log, "the sync of a namespace's device let go of ended without a result: writes completed on it may not be durable";
                           "subsystem" => &r.nqn, "nsid" => r.nsid);
                    *failures += 1;
                    false
                }
            }
        });
    }

    /// At stop, with the reactors joined: waits for the syncs of devices let go of still
    /// running, and syncs every device still open, served or let go of. Returns how many
    /// could not be synced, those let go of while serving included (the daemon then exits
    /// with an error).
    pub(super) fn sync_devices_at_stop(&mut self) -> usize {
        if !self.release_syncs.is_empty() {
            info!(self.log, "waiting for the syncs of namespace devices let go of";
                  "syncs" => self.release_syncs.len());
        }
        self.collect_release_syncs(true);
        let leaving = std::mem::take(&mut self.leaving);
        let devices = std::mem::take(&mut self.devices);
        let mut failed = self.release_sync_failures;
        for l in &leaving {
            failed += usize::from(!sync_released(&self.log, self.target.as_ref(), l, "stop"));
        }
        for ((nqn, nsid), dev) in devices {
            failed += usize::from(!sync_logged(&self.log, &nqn, nsid, &dev, "stop"));
        }
        failed
    }
}
