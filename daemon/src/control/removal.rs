//! A listener's device removed or failed, or its address moved: the listener stops serving,
//! its old listening ID lets go of the device once nothing made on it is left, and the
//! listener listens again (when the device returns; at once where the address moved).

use super::*;

impl Daemon {
    /// The device whose async fd is `fd` was removed or failed: its listeners stop serving
    /// (their listening IDs are kept until nothing made on the device is left, then let go of
    /// it), every reactor tears its data path there down, its async fd is no longer watched,
    /// and the listeners try to listen again every `RELISTEN_INTERVAL`. A second report of the
    /// same removal finds nothing left to do. `moved`: not removed, a listening ID's address
    /// moved to another port (`Retiring::moved`).
    pub(super) fn device_removed(
        &mut self,
        registry: &Registry,
        fd: std::os::fd::RawFd,
        cause: &str,
        moved: bool,
    ) {
        // Events already queued (LAST_WQE of the QPs the removal failed) reach the reactors
        // ahead of the removal.
        let slot = self
            .async_devs
            .iter()
            .position(|d| d.as_ref().is_some_and(|d| d.async_fd() == fd));
        if let Some(slot) = slot {
            self.route_async(slot);
            let _ = registry.deregister(&mut mio::unix::SourceFd(&fd));
            self.async_devs[slot] = None;
        }
        let now = Instant::now();
        let mut any = false;
        for i in 0..self.cm.len() {
            let addr = self
                .listener_slots
                .get(i)
                .and_then(Option::as_ref)
                .map(|l| std::net::SocketAddr::new(l.address, l.port));
            let c = &mut self.cm[i];
            if c.device.as_ref().is_none_or(|d| d.async_fd() != fd) {
                continue;
            }
            // The control thread's own handles on the device go now (its async fd above).
            c.device = None;
            if let Some(id) = c.id.take() {
                c.retiring = Some(Retiring {
                    id,
                    addr,
                    since: now,
                    overdue: false,
                    failed: false,
                    moved,
                });
            }
            c.relisten_error = None;
            c.removed = !moved;
            if moved {
                c.relisten_at = Some(now);
                c.address_changes += 1;
            } else {
                c.relisten_at = Some(now + RELISTEN_INTERVAL);
                c.device_removals += 1;
            }
            if let Some(st) = self.listeners.get_mut(i) {
                st.serving = false;
                if moved {
                    st.reason = Some(ADDRESS_MOVED.to_owned());
                    warn!(self.log, "listener's address moved to another port: the listener stops serving, everything on its device is torn down, and it listens again where the address is now";
                          "listener" => i, "address" => &st.address, "port" => st.port, "cause" => cause);
                } else {
                    st.reason = Some(DEVICE_REMOVED.to_owned());
                    warn!(self.log, "device removed: the listener stops serving and everything on the device is torn down; it listens again when the device returns";
                          "listener" => i, "address" => &st.address, "port" => st.port, "cause" => cause);
                }
            }
            self.tell_reactors(|| ReactorCmd::RemoveDevice { listener: i });
            any = true;
        }
        if any {
            self.notifier.status(&self.status_line());
        }
    }

    /// Every tick: listeners whose device was removed let go of it once nothing made on it is
    /// left, then try to listen again every `RELISTEN_INTERVAL`; so do listeners that could
    /// not listen at start.
    pub(super) fn relisten(&mut self, registry: &Registry, now: Instant) {
        for i in 0..self.cm.len() {
            self.release_removed(i, now);
            let c = &mut self.cm[i];
            // Listening again needs the address, which the old ID may hold: after
            // RELEASE_TIMEOUT it is tried anyway.
            if c.retiring.as_ref().is_some_and(|r| !r.overdue)
                || c.relisten_at.is_none_or(|at| now < at)
            {
                continue;
            }
            match self.listen(registry, i) {
                Ok(()) => self.listener_returned(i),
                Err(e) => {
                    let c = &mut self.cm[i];
                    c.relisten_at = Some(now + RELISTEN_INTERVAL);
                    if c.relisten_error.as_deref() != Some(e.as_str()) {
                        info!(self.log, "listener still not serving"; "listener" => i, "error" => &e);
                        c.relisten_error = Some(e);
                    }
                }
            }
        }
    }

    /// Listener `i`'s device was removed: once the reactors' data paths on it are gone (and
    /// with them every QP, CQ, SRQ, memory region and PD made on it), its old listening ID
    /// lets go of the device (with rdma_cm, librdmacm's context for it; see
    /// `release_removed_device`) and is destroyed: the kernel can then finish removing a
    /// device that waits for its users (rxe, siw). Bounded by `RELEASE_TIMEOUT`, after which
    /// what still holds it is logged and the listener tries to listen again anyway.
    pub(super) fn release_removed(&mut self, i: usize, now: Instant) {
        let Some(r) = self.cm.get_mut(i).and_then(|c| c.retiring.as_mut()) else {
            return;
        };
        let waited = now.duration_since(r.since);
        match r.id.release_removed_device() {
            Ok(DeviceRelease::Released) => {
                self.cm[i].retiring = None;
                info!(self.log, "removed device released: nothing nvmfd made on it is left (QPs, CQs, SRQs, memory regions, PDs, CM IDs) and its verbs context is closed, so the kernel can finish removing it";
                      "listener" => i, "after" => ?waited);
            }
            // An address that moved: the device stays, and the listener listens again once
            // nothing made on the device through its old ID is left.
            Ok(DeviceRelease::Present) if r.moved => {
                self.cm[i].retiring = None;
                info!(self.log, "nothing made on the device through the old listening ID is left: it goes, and the listener listens again where its address is now";
                      "listener" => i, "after" => ?waited);
            }
            Ok(DeviceRelease::Present) if waited >= RELEASE_TIMEOUT => {
                self.cm[i].retiring = None;
                warn!(self.log, "nothing nvmfd made on the failed device is left, but the device is still there: its old listening ID goes and the listener tries to listen on it again";
                      "listener" => i, "after" => ?waited);
            }
            Ok(DeviceRelease::InUse(holders)) if waited >= RELEASE_TIMEOUT && !r.overdue => {
                r.overdue = true;
                warn!(self.log, "the removed device is still held: the kernel cannot finish removing it while it is; the listener tries to listen again meanwhile";
                      "listener" => i, "after" => ?waited, "holders" => holders);
            }
            Err(e) if !r.failed => {
                r.failed = true;
                r.overdue = true;
                error!(self.log, "cannot let go of the removed device: the kernel cannot finish removing it";
                       "listener" => i, "error" => %e);
            }
            _ => {}
        }
    }

    /// Listener `i` listens again: every reactor builds a data path on its device.
    pub(super) fn listener_returned(&mut self, i: usize) {
        let Some(c) = self.cm.get_mut(i) else { return };
        c.relisten_at = None;
        c.relisten_error = None;
        // A device that returns; or a listener whose address moved, or that could not listen
        // at start.
        let returned = std::mem::take(&mut c.removed);
        c.returns += u64::from(returned);
        let Some(dev) = c.device.clone() else { return };
        if let Some(st) = self.listeners.get_mut(i) {
            st.serving = true;
            st.reason = None;
            let msg = if returned {
                "device returned: the listener serves again"
            } else {
                "listening"
            };
            info!(self.log, "{}", msg; "listener" => i, "address" => &st.address, "port" => st.port);
        }
        // Its connection requests wait until its reactors have a data path on it.
        if let Some(c) = self.cm.get_mut(i) {
            c.held = true;
        }
        self.prepare_rbd_handles(i, &[]);
        self.tell_reactors(|| ReactorCmd::AddPath {
            listener: i,
            device: dev.clone(),
        });
        self.notifier.status(&self.status_line());
    }
}
