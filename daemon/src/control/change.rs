//! Changes while the daemon serves: admin requests and SIGHUP both end in a new configuration
//! (the file's text, edited with `toml_edit` for a request, re-read for SIGHUP), validated as a
//! configuration file is, and the difference with the one in force applied in two steps:
//! everything that can fail first (devices opened and attached on every reactor, listeners
//! listening, the file written, sizes changed), undone if any step fails, then what cannot
//! fail (the target's subsystems replaced, controllers that lost their subsystem or their
//! access ended, devices of removed namespaces let go, listeners removed). Connections of
//! subsystems and listeners the change does not name are not touched.

use std::collections::BTreeMap;
use std::sync::mpsc;

use nvmfd_blockdev::Device as BlockDevice;
use nvmfd_config::{Edit, Listener, Subsystem as CfgSubsystem};

use super::plan::Plan;
use super::*;
use crate::serve::NamespaceStatus;

/// How long a reactor has to attach a namespace's device before the change is given up.
pub(super) const ATTACH_TIMEOUT: Duration = Duration::from_secs(10);

/// A namespace's size to change, beyond what the configuration says: `None` re-reads the
/// backend's own size (a file or device grown outside nvmfd).
pub(super) type Resize = (String, u32, Option<u64>);

impl Daemon {
    /// Validates configuration text as the file would be, errors joined by "; ": each
    /// `key: message`, and for the file itself (`from_file`: a reload) with where it is
    /// (`path:line:column: `key`: message`, as `nvmfd --check-config` prints it; a syntax
    /// error has no key).
    fn validate(&self, text: &str, from_file: bool) -> Result<Config, String> {
        Config::parse(text, &self.source.facts).map_err(|errs| {
            errs.0
                .iter()
                .map(|e| match &self.source.path {
                    Some(path) if from_file => {
                        let mut e = e.clone();
                        e.file = Some(path.clone());
                        e.to_string()
                    }
                    _ => format!("{}: {}", e.key, e.message),
                })
                .collect::<Vec<_>>()
                .join("; ")
        })
    }

    /// An admin request's change: `edits` applied to the file's text, validated, applied and
    /// written back; `resize`, a namespace's size changed beyond what the file says.
    pub(super) fn change(
        &mut self,
        registry: &Registry,
        edits: &[Edit],
        resize: Option<Resize>,
        uid: Option<u32>,
    ) -> Result<Vec<String>, String> {
        // The file is written back with the change: edits made to it since it was loaded
        // would be lost without a word.
        if let Some(path) = &self.source.path {
            match std::fs::read_to_string(path) {
                Ok(on_disk) if on_disk != self.source.text => {
                    let e = format!(
                        "{} was edited since it was loaded: reload it first (SIGHUP or `nvmfctl reload`), or undo the edits; nothing was changed",
                        path.display()
                    );
                    warn!(self.log, "configuration change refused"; "by_uid" => uid, "error" => &e);
                    return Err(e);
                }
                _ => {}
            }
        }
        let mut doc = nvmfd_config::document(&self.source.text)?;
        for e in edits {
            e.apply(&mut doc)?;
        }
        let text = doc.to_string();
        let new = self.validate(&text, false)?;
        let done = self.apply(registry, new, text, true, resize.into_iter().collect());
        match &done {
            Ok(what) => {
                info!(self.log, "configuration changed"; "by_uid" => uid, "changes" => what.join("; "))
            }
            Err(e) => {
                warn!(self.log, "configuration change refused"; "by_uid" => uid, "error" => e)
            }
        }
        done
    }

    /// SIGHUP (or a `reload` request): the file is read again and its difference with the
    /// configuration in force applied; an invalid file changes nothing.
    pub(super) fn reload(&mut self, registry: &Registry) -> Result<Vec<String>, String> {
        let path = self
            .source
            .path
            .clone()
            .ok_or("the daemon was started without a configuration file")?;
        let text = std::fs::read_to_string(&path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let new = self.validate(&text, true)?;
        self.apply(registry, new, text, false, Vec::new())
    }

    /// Applies the difference between the configuration in force and `new` (whose text is
    /// `text`, written to the file when `persist`). Entirely, or not at all.
    fn apply(
        &mut self,
        registry: &Registry,
        new: Config,
        text: String,
        persist: bool,
        resizes: Vec<Resize>,
    ) -> Result<Vec<String>, String> {
        let target = self.target.clone().ok_or("the daemon is not serving yet")?;
        let mut new = new;
        let (at_restart, warnings) = self.held_for_restart(&mut new);
        // A kept subsystem's identity held for the restart may now be another's: refused, as
        // the file would be (hosts name disks by serial number and model).
        let mut seen = std::collections::HashMap::new();
        for s in &new.subsystems {
            if let Some(first) = seen.insert((s.model.clone(), s.serial_number()), &s.nqn) {
                return Err(format!(
                    "{first} and {} would serve one serial number and model (a served subsystem keeps its own until the restart): hosts name disks by them (/dev/disk/by-id); give one another serial number; nothing was changed",
                    s.nqn
                ));
            }
        }
        let plan = self.plan(&new, resizes)?;
        // A listener the change removes takes no new connection while it waits.
        for &i in &plan.listeners_removed {
            if let Some(c) = self.cm.get_mut(i) {
                c.held = true;
            }
        }
        // 1. Devices of new namespaces, opened and attached on every reactor.
        let mut ids: BTreeMap<String, u64> = BTreeMap::new();
        for s in &plan.subsystems_added {
            ids.insert(s.nqn.clone(), target.reserve_subsystem_id());
        }
        for s in &plan.subsystems_kept {
            let id = target.subsystem(&s.nqn).map_or(0, |x| x.id);
            ids.insert(s.nqn.clone(), id);
        }
        let mut opened: Vec<(String, u32, Arc<BlockDevice>)> = Vec::new();
        let undo_attach = |d: &Daemon, opened: &[(String, u32, Arc<BlockDevice>)]| {
            for (nqn, nsid, _) in opened {
                let sub = ids.get(nqn).copied().unwrap_or(0);
                let nsid = *nsid;
                d.tell_reactors(|| ReactorCmd::DetachNamespace { sub, nsid });
            }
        };
        for (nqn, ns) in &plan.namespaces_added {
            let sub = ids.get(nqn).copied().unwrap_or(0);
            // Opening can wait for a network store (an RBD cluster that does not answer,
            // until its client gives up): off this thread, which keeps the watch meanwhile.
            info!(self.log, "opening the device of an added namespace"; "subsystem" => nqn, "nsid" => ns.nsid);
            let spec = crate::serve::device_spec(ns);
            // An RBD image's engine handles are opened here too, one for each data path a
            // reactor may have (one per listener's device at most), so that no reactor waits
            // on the cluster when it attaches the image.
            let engines = self.engines();
            let attached = self
                .off_thread(move || {
                    let dev = BlockDevice::open(&spec)?;
                    // Not all need open: an engine that finds none waits for one opened off
                    // its reactor.
                    dev.prepare_handles(engines);
                    Ok::<_, std::io::Error>(dev)
                })
                .and_then(|r| r.map_err(|e| e.to_string()))
                .map_err(|e| format!("subsystem {nqn} namespace {}: {e}", ns.nsid))
                .and_then(|dev| {
                    // Not a store another namespace has (one this change removes, alone or
                    // with its subsystem, aside: a subsystem renamed keeps its files).
                    if let Some(id) = dev.identity() {
                        let served = self
                            .devices
                            .iter()
                            .filter(|((n, i), _)| {
                                !plan.namespaces_removed.contains(&(n.clone(), *i))
                                    && !plan.subsystems_removed.contains(n)
                            })
                            .map(|((n, i), d)| (n, *i, d));
                        let added = opened.iter().map(|(n, i, d)| (n, *i, d));
                        if let Some((n, i, _)) = served
                            .chain(added)
                            .find(|(_, _, d)| d.identity().as_ref() == Some(&id))
                        {
                            return Err(crate::serve::one_store((n, i), (nqn, ns.nsid)));
                        }
                    }
                    self.attach_everywhere(sub, ns.nsid, &dev)?;
                    Ok(dev)
                });
            match attached {
                Ok(dev) => {
                    if let Some(w) = dev.warning() {
                        warn!(self.log, "namespace served with a warning"; "subsystem" => nqn, "nsid" => ns.nsid, "warning" => w);
                    }
                    opened.push((nqn.clone(), ns.nsid, dev));
                }
                Err(e) => {
                    // This one attached nowhere (`attach_everywhere` undoes its own).
                    undo_attach(self, &opened);
                    return Err(e);
                }
            }
        }
        // 2. New listeners.
        let mut added_slots = Vec::new();
        let added: Vec<Arc<BlockDevice>> = opened.iter().map(|(_, _, d)| Arc::clone(d)).collect();
        for l in &plan.listeners_added {
            match self.add_listener(registry, l, &added) {
                Ok(i) => added_slots.push(i),
                Err(e) => {
                    for &i in added_slots.iter().rev() {
                        self.remove_listener(registry, i);
                    }
                    undo_attach(self, &opened);
                    return Err(e);
                }
            }
        }
        let undo = |d: &mut Daemon, opened: &[(String, u32, Arc<BlockDevice>)]| {
            for &i in added_slots.iter().rev() {
                d.remove_listener(registry, i);
            }
            undo_attach(d, opened);
        };
        // 3. The file.
        let old_text = std::mem::take(&mut self.source.text);
        if persist {
            // Edited while the devices opened? Writing would lose those edits.
            let edited = self.source.path.as_ref().and_then(|p| {
                std::fs::read_to_string(p)
                    .ok()
                    .filter(|on_disk| *on_disk != old_text)
                    .map(|_| {
                        format!(
                            "{} was edited while the change was made: reload it first (SIGHUP or `nvmfctl reload`), or undo the edits; nothing was changed",
                            p.display()
                        )
                    })
            });
            if let Some(e) = edited {
                self.source.text = old_text;
                undo(self, &opened);
                return Err(e);
            }
            if let Err(e) = self.write_config(&text) {
                self.source.text = old_text;
                undo(self, &opened);
                return Err(e);
            }
        }
        // 4. Sizes: every one checked before any is made; one that still fails undoes those
        // made before it. Growing is undone by shrinking back what no host was told of yet;
        // a shrink is not undone by growing back (a file's or an image's tail is gone, and
        // would read as zeroes): so grows go first and at most one shrink, last.
        let mut failed = None;
        let shrinks = |plan: &Plan| -> Vec<String> {
            plan.resizes
                .iter()
                .filter(|(nqn, nsid, size)| {
                    let now = self.devices.get(&(nqn.clone(), *nsid)).map(|d| d.size());
                    matches!((now, size), (Some(now), Some(size)) if *size < now)
                })
                .map(|(nqn, nsid, _)| format!("{nqn} namespace {nsid}"))
                .collect()
        };
        let shrunk = shrinks(&plan);
        if shrunk.len() > 1 {
            failed = Some(format!(
                "the change shrinks {} namespaces ({}): shrink one per change, as a shrink that \
                 had to be undone would lose the data it cut off",
                shrunk.len(),
                shrunk.join(", ")
            ));
        }
        let mut order: Vec<&(String, u32, Option<u64>)> = plan.resizes.iter().collect();
        order.sort_by_key(|(nqn, nsid, size)| {
            let now = self.devices.get(&(nqn.clone(), *nsid)).map(|d| d.size());
            matches!((now, size), (Some(now), Some(size)) if *size < now)
        });
        for (nqn, nsid, size) in order.iter().copied().filter(|_| failed.is_none()) {
            if let Some(Err(e)) = self
                .devices
                .get(&(nqn.clone(), *nsid))
                .map(|d| d.check_resize(*size))
            {
                failed = Some(format!(
                    "subsystem {nqn} namespace {nsid}: cannot resize: {e}"
                ));
                break;
            }
        }
        let mut made: Vec<(Arc<BlockDevice>, u64, String)> = Vec::new();
        if failed.is_none() {
            for (nqn, nsid, size) in order {
                let Some(d) = self.devices.get(&(nqn.clone(), *nsid)) else {
                    continue;
                };
                let before = d.size();
                let (dev, size) = (Arc::clone(d), *size);
                // The test hook fails it where a resize fails: off this thread, after the
                // test gate.
                let fail = self.fail_resize.as_ref() == Some(&(nqn.clone(), *nsid));
                if fail {
                    self.fail_resize = None;
                }
                let resized = {
                    let fence = self.write_fence();
                    let probe = Arc::clone(&dev);
                    let gate = self.test_gate();
                    // An RBD shrink deletes the image's objects past the new end one by one
                    // (minutes for a large tail): the watch is kept while librbd reports.
                    self.off_thread_progress(
                        move || {
                            if let Some(gate) = gate {
                                super::off_thread::wait_at_gate(&gate, "resize");
                            }
                            if fail {
                                return Err("failed by the debug_fail_resize test hook".to_owned());
                            }
                            let end = size.unwrap_or(0);
                            dev.resize_fenced(size, || fence.wait(&dev, end))
                                .map_err(|e| e.to_string())
                        },
                        move || probe.resize_progress(),
                    )
                    .and_then(|r| r)
                };
                let Some(d) = self.devices.get(&(nqn.clone(), *nsid)) else {
                    continue;
                };
                if let Err(e) = resized {
                    failed = Some(format!(
                        "subsystem {nqn} namespace {nsid}: cannot resize: {e}"
                    ));
                    break;
                }
                made.push((Arc::clone(d), before, format!("{nqn} namespace {nsid}")));
            }
        }
        if let Some(mut e) = failed {
            for (d, before, name) in made.into_iter().rev() {
                // Off this thread, as the resize was: shrinking an RBD image back waits on
                // the cluster (an operation per object).
                let probe = Arc::clone(&d);
                let put_back = self
                    .off_thread_progress(
                        move || d.resize(Some(before)).map_err(|e| e.to_string()),
                        move || probe.resize_progress(),
                    )
                    .and_then(|r| r);
                if let Err(back) = put_back {
                    e.push_str(&format!(
                        "; {name} was resized and could not be put back to {before} bytes: {back}"
                    ));
                }
            }
            if persist {
                // Put back only what this change wrote: edits made meanwhile (a resize can
                // wait for minutes) are the operator's.
                let edited = self.source.path.as_ref().is_some_and(|p| {
                    std::fs::read_to_string(p).is_ok_and(|on_disk| on_disk != text)
                });
                if edited {
                    e.push_str(
                        "; the file was edited while the change was made and is left as it is: it holds the refused change and those edits (a reload would apply both)",
                    );
                } else if let Err(w) = self.write_config(&old_text) {
                    e.push_str(&format!(
                        "; the file could not be put back and holds the refused change (a reload would apply it): {w}"
                    ));
                }
            }
            self.source.text = old_text;
            undo(self, &opened);
            // What is served now: a shrink whose cut failed part-way keeps its new, smaller
            // size (what lay past it is gone), which `status` shows.
            self.refresh_namespace_status();
            return Err(e);
        }
        // Nothing below fails.
        let mut what = Vec::new();
        for (nqn, nsid, dev) in opened {
            what.push(format!(
                "namespace {nsid} of {nqn} added ({} bytes)",
                dev.size()
            ));
            self.devices.insert((nqn, nsid), dev);
        }
        // The devices of namespaces going are counted as released before the subsystems
        // are published without them: a shutdown whose flush no longer finds them waits for
        // their sync (`Target::release_begins`).
        let mut going: Vec<(u64, String, u32)> = Vec::new();
        for nqn in &plan.subsystems_removed {
            if let Some(s) = target.subsystem(nqn) {
                going.extend(s.namespaces.iter().map(|n| (s.id, nqn.clone(), n.nsid)));
            }
        }
        for (nqn, nsid) in &plan.namespaces_removed {
            going.push((ids.get(nqn).copied().unwrap_or(0), nqn.clone(), *nsid));
        }
        for (sub, nqn, nsid) in &going {
            self.release(*sub, nqn, *nsid);
        }
        // Tests: released, not yet published without them.
        if let Some(g) = self.test_gate() {
            super::off_thread::wait_at_gate_if_held(&g, "releasing");
        }
        for nqn in &plan.subsystems_removed {
            if let Ok((_, ended)) = target.remove_subsystem(nqn) {
                what.push(format!(
                    "subsystem {nqn} removed ({} controllers ended)",
                    ended.len()
                ));
            }
        }
        for s in &plan.subsystems_added {
            let sub = crate::serve::subsystem(s, self.served_namespaces(s));
            let id = ids.get(&s.nqn).copied().unwrap_or(0);
            if target.add_subsystem_with_id(sub, id).is_ok() {
                what.push(format!("subsystem {} added", s.nqn));
            }
        }
        for s in &plan.subsystems_kept {
            let sub = crate::serve::subsystem(s, self.served_namespaces(s));
            if let Ok(ended) = target.replace_subsystem(sub) {
                if !ended.is_empty() {
                    what.push(format!(
                        "{} controllers of {} ended: their host is no longer allowed",
                        ended.len(),
                        s.nqn
                    ));
                }
            }
        }
        // Published without the namespaces going: a controller made from now on never saw
        // them (one made before, even meanwhile, waits for their syncs at its shutdown).
        for (sub, _, _) in &going {
            target.releases_unpublished(*sub);
        }
        let old_cfg = std::mem::replace(&mut self.cfg, new);
        // Tests: published, the reactors not yet told.
        if let Some(g) = self.test_gate() {
            super::off_thread::wait_at_gate_if_held(&g, "published");
        }
        // Every reactor lets the devices go once their operations in flight have completed.
        for (sub, _, nsid) in &going {
            let (sub, nsid) = (*sub, *nsid);
            self.tell_reactors(|| ReactorCmd::DetachNamespace { sub, nsid });
        }
        for (nqn, nsid) in &plan.namespaces_removed {
            what.push(format!("namespace {nsid} of {nqn} removed"));
        }
        for (nqn, nsid, _) in &plan.resizes {
            if let Some(d) = self.devices.get(&(nqn.clone(), *nsid)) {
                what.push(format!(
                    "namespace {nsid} of {nqn} resized to {} bytes",
                    d.size()
                ));
            }
        }
        for &i in &plan.listeners_removed {
            if let Some(Some(l)) = self.listener_slots.get(i) {
                what.push(format!(
                    "listener {} removed",
                    nvmfd_config::sockaddr(l.address, l.port)
                ));
            }
            self.remove_listener(registry, i);
        }
        for l in &plan.listeners_added {
            what.push(format!(
                "listener {} added",
                nvmfd_config::sockaddr(l.address, l.port)
            ));
        }
        // By NQN: a subsystem added or removed moves the others in the list.
        for b in &self.cfg.subsystems {
            let was = old_cfg.subsystems.iter().find(|a| a.nqn == b.nqn);
            if was.is_some_and(|a| a.hosts != b.hosts || a.allow_any_host != b.allow_any_host) {
                what.push(format!("allowed hosts of {} changed", b.nqn));
            }
        }
        self.source.text = text;
        self.refresh_ports(&target);
        self.refresh_namespace_status();
        self.schedule_reopens(Instant::now());
        // Held AERs complete with the events raised; ended controllers close now.
        self.tell_reactors(|| ReactorCmd::PollEvents);
        self.notifier.status(&self.status_line());
        for section in at_restart {
            warn!(self.log, "a part of the configuration changed that takes effect only at the next restart"; "part" => &section);
            what.push(format!(
                "the changes to {section} take effect at the next restart"
            ));
        }
        for w in warnings {
            warn!(self.log, "configuration: {}", w);
            what.push(format!("warning: {w}"));
        }
        if what.is_empty() {
            what.push("nothing changed".into());
        }
        Ok(what)
    }

    /// The namespaces of `s` that have a device, as the core sees them now.
    pub(super) fn served_namespaces(&self, s: &CfgSubsystem) -> Vec<nvmfd_nvme::Namespace> {
        s.namespaces
            .iter()
            .filter_map(|ns| {
                let dev = self.devices.get(&(s.nqn.clone(), ns.nsid))?;
                Some(crate::serve::namespace(&s.nqn, ns, dev))
            })
            .collect()
    }

    /// Namespace `nsid` of subsystem `nqn` (ID `sub`) is to be served no longer: its device
    /// is counted as released, before its subsystem is published without it and before any
    /// reactor is told to let it go (a shutdown's flush that no longer finds it waits for
    /// its sync), and is synced once the reactors have let it go (`sync_released_devices`).
    fn release(&mut self, sub: u64, nqn: &str, nsid: u32) {
        if let Some(dev) = self.devices.remove(&(nqn.to_owned(), nsid)) {
            let release = self.target.as_ref().map(|t| t.release_begins(sub));
            self.leaving.push(super::leaving::Leaving {
                sub,
                release,
                nqn: nqn.to_owned(),
                nsid,
                dev,
            });
        }
    }

    /// Attaches `dev` on every reactor, waiting for each; on a failure, detaches it again.
    pub(super) fn attach_everywhere(
        &mut self,
        sub: u64,
        nsid: u32,
        dev: &Arc<BlockDevice>,
    ) -> Result<(), String> {
        let (tx, rx) = mpsc::channel();
        self.tell_reactors(|| ReactorCmd::AttachNamespace {
            sub,
            nsid,
            dev: Arc::clone(dev),
            done: tx.clone(),
        });
        drop(tx);
        let deadline = Instant::now() + ATTACH_TIMEOUT;
        let mut failed = None;
        for _ in 0..self.inboxes.len() {
            match self.wait_keeping_watch(&rx, Some(deadline), None) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => failed = Some(e),
                Err(_) => {
                    failed = Some("a reactor did not attach the device in time".into());
                    break;
                }
            }
        }
        match failed {
            None => Ok(()),
            Some(e) => {
                self.tell_reactors(|| ReactorCmd::DetachNamespace { sub, nsid });
                Err(format!("namespace {nsid}: {e}"))
            }
        }
    }

    /// The discovery log's ports: the listeners in force.
    fn refresh_ports(&self, target: &Target) {
        let ports = self
            .listener_slots
            .iter()
            .enumerate()
            .filter_map(|(i, l)| Some(crate::serve::port(l.as_ref()?, i)))
            .collect();
        target.set_ports(ports);
    }

    /// `status`'s namespaces: those of the configuration in force, served or why not.
    pub(super) fn refresh_namespace_status(&mut self) {
        let mut out = Vec::new();
        for s in &self.cfg.subsystems {
            for ns in &s.namespaces {
                let backend = format!("{:?}", ns.backend).to_ascii_lowercase();
                let dev = self.devices.get(&(s.nqn.clone(), ns.nsid));
                let earlier = self
                    .namespaces
                    .iter()
                    .find(|n| n.subsystem == s.nqn && n.nsid == ns.nsid)
                    .and_then(|n| n.reason.clone());
                out.push(NamespaceStatus {
                    subsystem: s.nqn.clone(),
                    nsid: ns.nsid,
                    backend,
                    size: dev.map_or(0, |d| d.size()),
                    serving: dev.is_some(),
                    reason: if dev.is_some() { None } else { earlier },
                    warning: dev.and_then(|d| d.warning()).map(str::to_owned),
                    backend_size: None,
                    sync_failed: false,
                });
            }
        }
        self.namespaces = out;
    }

    /// Adds a listener in a new slot and listens; the reactors build their data paths on its
    /// device. Returns the slot.
    /// `added`: devices of namespaces added by the same change (attached, not yet in
    /// `devices`), whose handles its data paths need too.
    fn add_listener(
        &mut self,
        registry: &Registry,
        l: &Listener,
        added: &[Arc<BlockDevice>],
    ) -> Result<usize, String> {
        let i = self.cm.len();
        // Its connection requests wait until its reactors have a data path on it.
        self.cm.push(listeners::Listening {
            held: true,
            ..Default::default()
        });
        self.listener_slots.push(Some(l.clone()));
        let mut listened = self.listen(registry, i);
        if listened.is_err() {
            // A removed listener's old listening ID, kept to let go of its removed device,
            // may hold the address (its device came back meanwhile): the new listener goes
            // first; that ID goes without letting go of the device. Only an ID on the same
            // port and a clashing address: the others still let go of theirs.
            let clashes = |a: Option<std::net::SocketAddr>| {
                a.is_some_and(|a| {
                    a.port() == l.port
                        && (a.ip() == l.address
                            || a.ip().is_unspecified()
                            || l.address.is_unspecified())
                })
            };
            let mut dropped = 0;
            for j in 0..i {
                if matches!(self.listener_slots.get(j), Some(None))
                    && self.cm[j]
                        .retiring
                        .as_ref()
                        .is_some_and(|r| clashes(r.addr))
                {
                    self.cm[j].retiring = None;
                    dropped += 1;
                }
            }
            if dropped > 0 {
                warn!(self.log, "old listening IDs of removed listeners dropped to listen again"; "ids" => dropped);
                listened = self.listen(registry, i);
            }
        }
        if let Err(e) = listened {
            if let Some(mut c) = self.cm.pop() {
                if let Some(ch) = c.channel.take() {
                    let _ = registry.deregister(&mut mio::unix::SourceFd(&ch.fd()));
                }
            }
            self.listener_slots.pop();
            return Err(format!(
                "listener {}: {e}",
                nvmfd_config::sockaddr(l.address, l.port)
            ));
        }
        self.listeners.push(ListenerStatus {
            address: l.address.to_string(),
            port: l.port,
            provider: l.provider.to_string(),
            serving: true,
            reason: None,
        });
        if let Some(dev) = self.cm[i].device.clone() {
            self.prepare_rbd_handles(i, added);
            self.tell_reactors(|| ReactorCmd::AddPath {
                listener: i,
                device: dev.clone(),
            });
        }
        info!(self.log, "listening"; "address" => %l.address, "port" => l.port, "provider" => %l.provider);
        Ok(i)
    }

    /// Stops listener `i`: no new connection, and every reactor tears its connections on the
    /// listener down. Its CM channel stays until those connections' IDs are destroyed
    /// (`let_go_of_removed_channels`), and so does the old listening ID of a removed device
    /// until it has let go of the device (`release_removed`); the slot stays empty.
    fn remove_listener(&mut self, _registry: &Registry, i: usize) {
        let Some(slot) = self.listener_slots.get_mut(i) else {
            return;
        };
        let Some(l) = slot.take() else { return };
        self.let_go_of_listening_id(i, l.address);
        if let Some(c) = self.cm.get_mut(i) {
            c.id = None;
            c.device = None;
            c.relisten_at = None;
        }
        if let Some(st) = self.listeners.get_mut(i) {
            st.serving = false;
            st.reason = Some(REMOVED.into());
        }
        self.tell_reactors(|| ReactorCmd::RemoveDevice { listener: i });
        info!(self.log, "listener removed: its connections are torn down"; "address" => %l.address, "port" => l.port);
    }
}

/// A removed listener's `reason` (such slots are left out of `status` and `stats`).
pub(super) const REMOVED: &str = "removed";
