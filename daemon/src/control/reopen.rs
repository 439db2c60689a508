//! Namespaces of the configuration whose device could not be opened at start (only RBD ones
//! are left out then: a cluster that does not answer yet, an image not made yet) are tried
//! again, off the control thread, after a wait that doubles from [`REOPEN_FIRST`] to
//! [`REOPEN_MAX`]. One that opens is attached on every reactor and published, as a namespace
//! added while serving is: hosts connected meanwhile are told by a Namespace Attribute
//! Changed event.

use std::sync::mpsc;

use nvmfd_blockdev::Device as BlockDevice;

use super::off_thread::spawn_counted;
use super::*;

/// The first wait before a namespace's device is opened again.
pub(super) const REOPEN_FIRST: Duration = Duration::from_secs(1);
/// The longest wait between two tries.
pub(super) const REOPEN_MAX: Duration = Duration::from_secs(60);

/// A configured namespace without a device, and its next try.
pub(super) struct Reopen {
    nqn: String,
    ns: nvmfd_config::Namespace,
    at: Instant,
    wait: Duration,
    /// Tries since it failed at start (or was configured so that it could not open).
    tries: u32,
    /// The try under way, on a thread of its own.
    pending: Option<mpsc::Receiver<Result<Arc<BlockDevice>, String>>>,
}

impl Daemon {
    /// Brings the namespaces to open again up to date with the configuration: each configured
    /// one without a device is tried again (from `REOPEN_FIRST`), one no longer configured
    /// as it was (removed, or changed) is not (a try under way is left to finish alone, and
    /// its device is dropped).
    pub(super) fn schedule_reopens(&mut self, now: Instant) {
        let wanted: Vec<(String, nvmfd_config::Namespace)> = self
            .cfg
            .subsystems
            .iter()
            .flat_map(|s| s.namespaces.iter().map(|ns| (s.nqn.clone(), ns.clone())))
            .filter(|(nqn, ns)| !self.devices.contains_key(&(nqn.clone(), ns.nsid)))
            .collect();
        self.reopens
            .retain(|r| wanted.iter().any(|(nqn, ns)| *nqn == r.nqn && *ns == r.ns));
        for (nqn, ns) in wanted {
            if !self.reopens.iter().any(|r| r.nqn == nqn && r.ns == ns) {
                self.reopens.push(Reopen {
                    nqn,
                    ns,
                    at: now + REOPEN_FIRST,
                    wait: REOPEN_FIRST,
                    tries: 0,
                    pending: None,
                });
            }
        }
    }

    /// Starts the tries that are due and takes the results of those that ended: a device
    /// that opened is served; a failure is tried again after twice the wait.
    pub(super) fn reopen_namespaces(&mut self, now: Instant) {
        if self.reopens.is_empty() {
            return;
        }
        // An RBD image's engine handles are opened with it, one for each data path a reactor
        // may have, so that no reactor waits on the cluster when it attaches the image.
        let engines = self.engines();
        let mut ended = Vec::new();
        for (k, r) in self.reopens.iter_mut().enumerate() {
            match &r.pending {
                Some(rx) => match rx.try_recv() {
                    Ok(result) => ended.push((k, result)),
                    Err(mpsc::TryRecvError::Empty) => {}
                    Err(mpsc::TryRecvError::Disconnected) => {
                        ended.push((k, Err("the open ended without an answer".into())))
                    }
                },
                None if now >= r.at => {
                    let spec = crate::serve::device_spec(&r.ns);
                    match spawn_counted(move || {
                        let dev = BlockDevice::open(&spec).map_err(|e| e.to_string())?;
                        // Not all need open: an engine that finds none waits for one
                        // opened off its reactor.
                        dev.prepare_handles(engines);
                        Ok(dev)
                    }) {
                        Ok(rx) => r.pending = Some(rx),
                        Err(e) => ended.push((k, Err(e))),
                    }
                }
                None => {}
            }
        }
        // From the last: each removal moves only an entry after it.
        for (k, result) in ended.into_iter().rev() {
            let mut r = self.reopens.swap_remove(k);
            r.pending = None;
            r.tries += 1;
            match result.and_then(|dev| self.serve_reopened(&r, dev)) {
                Ok(()) => {
                    info!(self.log, "namespace served: its device opened on a later try";
                        "subsystem" => &r.nqn, "nsid" => r.ns.nsid, "tries" => r.tries);
                }
                Err(e) => {
                    r.wait = (r.wait * 2).min(REOPEN_MAX);
                    r.at = now + r.wait;
                    warn!(self.log, "namespace still not served; its device is tried again later";
                        "subsystem" => &r.nqn, "nsid" => r.ns.nsid, "tries" => r.tries,
                        "error" => &e, "retry_in" => ?r.wait);
                    if let Some(st) = self
                        .namespaces
                        .iter_mut()
                        .find(|n| n.subsystem == r.nqn && n.nsid == r.ns.nsid)
                    {
                        st.reason = Some(format!(
                            "{e} (tried again {} times; next in {} s)",
                            r.tries,
                            r.wait.as_secs()
                        ));
                    }
                    self.reopens.push(r);
                }
            }
        }
    }

    /// Serves namespace `r`, whose device opened: attached on every reactor, then published
    /// in its subsystem (hosts are told).
    fn serve_reopened(&mut self, r: &Reopen, dev: Arc<BlockDevice>) -> Result<(), String> {
        let target = self.target.clone().ok_or("the daemon is not serving yet")?;
        let s = self
            .cfg
            .subsystems
            .iter()
            .find(|s| s.nqn == r.nqn)
            .cloned()
            .ok_or("its subsystem is no longer configured")?;
        let sub = target
            .subsystem(&r.nqn)
            .map(|x| x.id)
            .ok_or("its subsystem is not served")?;
        // Not a store another namespace has (an image reached through another
        // configuration file or user, opened meanwhile).
        if let Some(id) = dev.identity() {
            if let Some(((n, i), _)) = self
                .devices
                .iter()
                .find(|(_, d)| d.identity().as_ref() == Some(&id))
            {
                return Err(crate::serve::one_store((n, *i), (&r.nqn, r.ns.nsid)));
            }
        }
        self.attach_everywhere(sub, r.ns.nsid, &dev)?;
        if let Some(w) = dev.warning() {
            warn!(self.log, "namespace served with a warning";
                "subsystem" => &r.nqn, "nsid" => r.ns.nsid, "warning" => w);
        }
        let key = (r.nqn.clone(), r.ns.nsid);
        self.devices.insert(key.clone(), dev);
        if let Err(e) =
            target.replace_subsystem(crate::serve::subsystem(&s, self.served_namespaces(&s)))
        {
            // Not published: not served, and tried again.
            self.devices.remove(&key);
            self.tell_reactors(|| ReactorCmd::DetachNamespace {
                sub,
                nsid: r.ns.nsid,
            });
            return Err(format!("cannot publish it: {e}"));
        }
        self.refresh_namespace_status();
        // Held AERs complete with the event raised.
        self.tell_reactors(|| ReactorCmd::PollEvents);
        self.notifier.status(&self.status_line());
        Ok(())
    }
}
