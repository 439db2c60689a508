//! Namespaces attached and detached while the data path serves, and attached without waiting
//! on their store: the reactor never opens an RBD image itself (`rbd_open` waits on the
//! cluster, for its timeouts when the cluster does not answer). A data path takes a handle opened ahead for it; a namespace that has none ready
//! when the path is built (or attached) waits here while a thread of its own opens one. Its
//! commands meanwhile complete with Namespace Not Ready, which hosts retry; the path's other
//! namespaces are served. A failed open is tried again after a wait that doubles from 1 s to
//! 30 s. A namespace of any kind whose attach failed when the path was built (the process
//! out of files, say) waits here the same way, attached again after such a wait.

use std::sync::mpsc;
use std::time::Duration;

use super::*;

/// The first wait after a failed open.
const OPEN_RETRY_FIRST: Duration = Duration::from_secs(1);
/// The longest wait between two opens.
const OPEN_RETRY_MAX: Duration = Duration::from_secs(30);

/// A namespace of this data path waiting for a handle.
pub(super) struct Awaiting {
    pub(super) sub: u64,
    pub(super) nsid: u32,
    /// The namespace changes counted when it was attached.
    pub(super) since: u64,
    dev: Arc<BlockDevice>,
    /// The open under way: its result.
    opening: Option<mpsc::Receiver<std::io::Result<()>>>,
    /// When to open again, after a failed open.
    next: Instant,
    /// When to attach again, after a failed attach (a handle that is ready is otherwise
    /// attached whatever `next` says).
    attach_at: Instant,
    wait: Duration,
    /// Why its first attach failed, when it did (logged once the data path has its log).
    pub(super) failure: Option<String>,
}

impl Awaiting {
    /// Waits for a handle on `dev` for namespace `nsid` of subsystem `sub`, one being opened
    /// at once.
    fn new(sub: u64, nsid: u32, since: u64, dev: &Arc<BlockDevice>, now: Instant) -> Awaiting {
        let mut a = Awaiting {
            sub,
            nsid,
            since,
            dev: Arc::clone(dev),
            opening: None,
            next: now,
            attach_at: now,
            wait: OPEN_RETRY_FIRST,
            failure: None,
        };
        a.open(now);
        a
    }

    /// Attaches namespace `nsid` of subsystem `sub` again after its attach failed with
    /// `failure` (out of files, say) when the data path was built: its commands answer
    /// Namespace Not Ready meanwhile, and the path's other namespaces are served.
    pub(super) fn after_failure(
        sub: u64,
        nsid: u32,
        dev: &Arc<BlockDevice>,
        now: Instant,
        failure: String,
    ) -> Awaiting {
        Awaiting {
            sub,
            nsid,
            since: 0,
            dev: Arc::clone(dev),
            opening: None,
            next: now,
            attach_at: now + OPEN_RETRY_FIRST,
            wait: OPEN_RETRY_FIRST * 2,
            failure: Some(failure),
        }
    }

    /// Opens a handle on a thread of its own (counted, so that the daemon waits for it
    /// before it exits). A thread that cannot start is tried again after the wait.
    fn open(&mut self, now: Instant) {
        let dev = Arc::clone(&self.dev);
        self.opening = crate::control::spawn_counted(move || dev.open_spare_handle()).ok();
        if self.opening.is_none() {
            self.next = now + self.wait;
        }
    }
}

impl DataPath {
    /// Serves namespace `nsid` of subsystem `sub` from `dev` (a namespace added while the
    /// daemon serves): attached to the engine before the target publishes it, so a command
    /// for it finds its device (or, for an RBD image with no handle opened ahead ready, waits
    /// for one and answers Namespace Not Ready meanwhile: `handles.rs`).
    pub fn attach_namespace(
        &mut self,
        sub: u64,
        nsid: u32,
        dev: &Arc<BlockDevice>,
    ) -> std::io::Result<()> {
        self.ns_changes += 1;
        self.attach_or_await(sub, nsid, dev, self.ns_changes, Instant::now())
    }

    /// Stops serving namespace `nsid` of subsystem `sub` (removed from the target before):
    /// its operations in flight complete and answer their commands; the device is detached
    /// from the engine once the last has. A command that reaches the disk after this fails
    /// with Invalid Namespace.
    pub fn detach_namespace(&mut self, sub: u64, nsid: u32) {
        self.awaiting.retain(|a| (a.sub, a.nsid) != (sub, nsid));
        if let Some((old, _)) = self.devs.remove(&(sub, nsid)) {
            self.detaching.push(old);
        }
    }

    /// Whether a read or write past `end` bytes of `dev` is queued or in flight at this data
    /// path's engine (a shrink of `dev` waits for none: [`nvmfd_blockdev::Engine::io_past`]).
    pub fn io_past(&self, dev: &Arc<BlockDevice>, end: u64) -> bool {
        self.engine.io_past(dev, end)
    }

    /// Devices of removed namespaces still waiting for their operations to complete.
    pub fn namespaces_detaching(&self) -> usize {
        self.detaching.len()
    }

    /// Attaches namespace `nsid` of subsystem `sub` on the engine without waiting on its
    /// store; one with no handle ready waits in `awaiting`. `since`: the namespace changes
    /// counted when it was attached (commands checked before then do not use it).
    pub(super) fn attach_or_await(
        &mut self,
        sub: u64,
        nsid: u32,
        dev: &Arc<BlockDevice>,
        since: u64,
        now: Instant,
    ) -> std::io::Result<()> {
        self.awaiting.retain(|a| (a.sub, a.nsid) != (sub, nsid));
        match self.engine.attach_ready(dev)? {
            Some(id) => {
                if let Some((old, _)) = self.devs.insert((sub, nsid), (id, since)) {
                    self.detaching.push(old);
                }
            }
            None => {
                if let Some((old, _)) = self.devs.remove(&(sub, nsid)) {
                    self.detaching.push(old);
                }
                slog::info!(self.log, "namespace waits for a handle on its image, opened off the reactor; its commands meanwhile answer Namespace Not Ready";
                    "subsystem" => sub, "nsid" => nsid);
                self.awaiting
                    .push(Awaiting::new(sub, nsid, since, dev, now));
            }
        }
        Ok(())
    }

    /// Attaches the waiting namespaces whose handle is ready; opens again those whose open
    /// failed (or whose handle another engine took), once their wait is over.
    pub(super) fn attach_awaiting(&mut self, now: Instant) {
        let mut k = 0;
        while k < self.awaiting.len() {
            let a = &mut self.awaiting[k];
            // The open under way, if any, first: its result says what comes next.
            match a.opening.as_ref().map(mpsc::Receiver::try_recv) {
                Some(Err(mpsc::TryRecvError::Empty)) | None => {}
                Some(Ok(Ok(()))) => a.opening = None,
                Some(done) => {
                    let why = match done {
                        Ok(Err(e)) => e.to_string(),
                        _ => "the open ended without an answer".to_owned(),
                    };
                    a.opening = None;
                    a.next = now + a.wait;
                    slog::warn!(self.log, "cannot open a handle on a namespace's image; trying again later";
                        "subsystem" => a.sub, "nsid" => a.nsid, "error" => why,
                        "retry_in" => ?a.wait);
                    a.wait = (a.wait * 2).min(OPEN_RETRY_MAX);
                }
            }
            let needs_handle = a.dev.needs_handle();
            if (!needs_handle || a.dev.handles_ready() > 0) && now >= a.attach_at {
                let (sub, nsid, since, dev) = (a.sub, a.nsid, a.since, Arc::clone(&a.dev));
                match self.engine.attach_ready(&dev) {
                    Ok(Some(id)) => {
                        self.awaiting.swap_remove(k);
                        self.devs.insert((sub, nsid), (id, since));
                        slog::info!(self.log, "namespace attached";
                            "subsystem" => sub, "nsid" => nsid);
                        // The entry moved into `k` is looked at next.
                        continue;
                    }
                    // Another engine took it meanwhile: the next look opens another.
                    Ok(None) => {}
                    Err(e) => {
                        let a = &mut self.awaiting[k];
                        a.attach_at = now + a.wait;
                        slog::warn!(self.log, "cannot attach a namespace's device; trying again later";
                            "subsystem" => sub, "nsid" => nsid, "error" => %e,
                            "retry_in" => ?a.wait);
                        a.wait = (a.wait * 2).min(OPEN_RETRY_MAX);
                    }
                }
            } else if needs_handle
                && a.opening.is_none()
                && a.dev.handles_ready() == 0
                && now >= a.next
            {
                a.open(now);
                if a.opening.is_none() {
                    slog::warn!(self.log, "cannot start a thread to open a handle on a namespace's image; trying again later";
                        "subsystem" => a.sub, "nsid" => a.nsid, "retry_in" => ?a.wait);
                    a.wait = (a.wait * 2).min(OPEN_RETRY_MAX);
                }
            }
            k += 1;
        }
    }

    /// Namespaces waiting for a handle no longer wait: the data path is going (its device
    /// removed, its CQ failed), and a handle opened for it would be a spare nobody takes.
    pub(super) fn stop_awaiting(&mut self) {
        self.awaiting.clear();
    }

    /// Namespaces waiting for a handle on their image.
    pub fn namespaces_awaiting(&self) -> usize {
        self.awaiting.len()
    }
}

/// A shutdown's flush reaches namespace `nsid` of subsystem `sub`, which waits here. An
/// RBD image has no cache to flush (librbd's is off), whatever other data paths wrote to
/// it. A file or block device whose attach failed may have one that other data paths
/// wrote into: it is synced off the reactor and counted as a device being let go of
/// (`Target::release_begins`), so that the shutdown completes only once it is synced, and
/// fails (CFS) if the sync fails or cannot start.
pub(super) fn sync_awaiting(
    (awaiting, target, log): (&[Awaiting], &Target, &slog::Logger),
    sub: u64,
    nsid: u32,
    ns_changes: u64,
) {
    let Some(a) = awaiting
        .iter()
        .find(|a| (a.sub, a.nsid) == (sub, nsid) && a.since <= ns_changes)
    else {
        return;
    };
    if a.dev.needs_handle() {
        return;
    }
    let dev = Arc::clone(&a.dev);
    let ends = target.clone();
    let release = target.release_begins(sub);
    let started = crate::control::spawn_counted(move || {
        let durable = dev.sync().is_ok();
        ends.release_ends(sub, release, durable);
    });
    if let Err(e) = started {
        slog::error!(log, "cannot sync a namespace that waits to be attached: the shutdown fails";
            "subsystem" => sub, "nsid" => nsid, "error" => e);
        target.release_ends(sub, release, false);
    }
}
