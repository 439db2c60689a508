//! A reactor's data paths (one per RDMA device, shared by the listeners on it) and the
//! commands the control thread
//! sends them: connections to adopt, ends of connections, device events, and a listener's
//! device leaving and coming back.

use std::sync::Arc;
use std::time::{Duration, Instant};

use nvmfd_nvme::rdma_cm::CmRequest;
use nvmfd_nvme::Target;
use nvmfd_rdma::any::cm::CmId;
use nvmfd_rdma::any::Device;
use nvmfd_rdma::AsyncEvent;

use crate::datapath::{ConnectFailure, DataPath, DataPathConfig, DRAIN_TIMEOUT};
use crate::serve::NamespaceDevices;
use crate::srq::{Change, Registrar};
use crate::stats::{DataPathCounters, Gauges};

/// What the control thread hands a reactor.
#[derive(Debug)]
pub enum ReactorCmd {
    /// Serve this connection (its request was checked) on the data path of listener `listener`.
    Adopt {
        /// Which listener (and so which device's data path).
        listener: usize,
        /// The connection.
        id: CmId,
        /// Its checked request.
        req: CmRequest,
    },
    /// The connection with this CM token went away.
    Disconnected {
        /// Its token.
        token: usize,
    },
    /// The connection with this CM token failed before it was established (rdma_cm's
    /// `REJECTED`, `UNREACHABLE` or `CONNECT_ERROR` on an accepted connection).
    ConnectFailed {
        /// Its token.
        token: usize,
        /// How rdma_cm reported it.
        why: ConnectFailure,
    },
    /// An async event of the device whose async fd is `async_fd`.
    DeviceEvent {
        /// Which device.
        async_fd: std::os::fd::RawFd,
        /// Its number, in the order events were read ([`any::Device::next_numbered_event`]).
        number: u64,
        /// What happened.
        event: AsyncEvent,
    },
    /// Listener `listener`'s device was removed (or failed fatally): its data path tears every
    /// QP down, drains, and is dropped once nothing of it is outstanding (bounded by
    /// `DRAIN_TIMEOUT`), which destroys everything it made on the device.
    RemoveDevice {
        /// Which listener.
        listener: usize,
    },
    /// Listener `listener` listens again, on `device` (its device came back, or the
    /// listener was added): build a data path on it.
    AddPath {
        /// Which listener.
        listener: usize,
        /// Its device.
        device: Device,
    },
    /// Serve namespace `nsid` of subsystem `sub` from `dev` on every data path (a namespace
    /// added at run time, before the target publishes it); the reactor answers on `done`.
    AttachNamespace {
        /// Subsystem ID.
        sub: u64,
        /// NSID.
        nsid: u32,
        /// Its block device.
        dev: Arc<nvmfd_blockdev::Device>,
        /// The reactor's answer: attached everywhere, or why not.
        done: std::sync::mpsc::Sender<Result<(), String>>,
    },
    /// Stop serving namespace `nsid` of subsystem `sub` (removed from the target): its
    /// operations in flight complete, then its device is let go.
    DetachNamespace {
        /// Subsystem ID.
        sub: u64,
        /// NSID.
        nsid: u32,
    },
    /// The target raised asynchronous events (or ended controllers): complete the held
    /// AERs whose events came, and close what ended, now rather than at the next command.
    PollEvents,
    /// `dev` was shrunk to `end` bytes (its capacity stored, so no read or write past it is
    /// let through any more): answer on `done` once none past it is left at an engine here,
    /// after which the control thread cuts the backend.
    FenceWrites {
        /// The device.
        dev: Arc<nvmfd_blockdev::Device>,
        /// Its new capacity.
        end: u64,
        /// Answered when none is left.
        done: std::sync::mpsc::Sender<()>,
    },
}

/// What a reactor needs to build a data path on a device: at start, and when a listener's
/// device comes back.
#[derive(Debug)]
pub struct PathBuilder {
    /// The NVMe target.
    pub target: Target,
    /// The namespaces' block devices.
    pub namespaces: NamespaceDevices,
    /// Sizes.
    pub cfg: DataPathConfig,
    /// Registers the SRQs' receive chunks.
    pub registrar: Registrar,
    /// The reactor's logger.
    pub log: slog::Logger,
    /// Test hook: a pause before each data path built while the daemon serves, as a large
    /// pool's registration takes.
    pub test_build_delay: Option<Duration>,
}

impl PathBuilder {
    /// A data path on `dev`, counting into `counters`.
    pub fn build(
        &self,
        dev: &Device,
        counters: Arc<DataPathCounters>,
    ) -> std::io::Result<DataPath> {
        let mut dp = DataPath::new(
            dev,
            self.target.clone(),
            &self.namespaces,
            self.cfg,
            self.registrar.clone(),
            counters,
        )?;
        dp.set_log(self.log.clone());
        let (small, small_size, large, large_size, huge) = dp.buffers();
        slog::info!(self.log, "data buffers"; "small" => small, "small_size" => small_size,
            "large" => large, "large_size" => large_size, "huge_pages" => huge);
        if self.cfg.huge_pages && !huge {
            slog::warn!(self.log, "transport.huge_pages is on but too few huge pages are reserved; \
                the data buffers use normal pages (reserve more with sysctl vm.nr_hugepages)";
                "needed_2mib_pages" => (small * small_size).div_ceil(2 << 20) + (large * large_size).div_ceil(2 << 20));
        }
        Ok(dp)
    }
}

/// Raises a reactor's `building_path` while it lives (a data path being built), and lowers
/// it when dropped, however the build ends.
struct Building<'a>(&'a std::sync::atomic::AtomicBool);

impl<'a> Building<'a> {
    fn new(flag: &'a std::sync::atomic::AtomicBool) -> Building<'a> {
        flag.store(true, std::sync::atomic::Ordering::Relaxed);
        Building(flag)
    }
}

impl Drop for Building<'_> {
    fn drop(&mut self) {
        self.0.store(false, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Listeners a reactor has no data path for because setting one up on their device failed,
/// with why: shared with the control thread, which reports such a listener as not serving
/// (the reactor refuses the connections handed to it for the listener).
pub type Unserved = Arc<std::sync::Mutex<std::collections::BTreeMap<usize, String>>>;

/// A data path and its own counters, which the reactor's counters sum up.
#[derive(Debug)]
pub struct CountedPath {
    /// The data path.
    pub dp: DataPath,
    /// What it counts; its totals move to the reactor's counters every turn.
    pub counters: Arc<DataPathCounters>,
}

impl CountedPath {
    /// Builds a data path on `dev` with counters of its own; logs and says why when the
    /// device refuses.
    pub fn build(builder: &PathBuilder, dev: &Device) -> Result<CountedPath, String> {
        let counters = Arc::new(DataPathCounters::default());
        match builder.build(dev, Arc::clone(&counters)) {
            Ok(dp) => Ok(CountedPath { dp, counters }),
            Err(e) => {
                slog::error!(builder.log, "cannot set up a data path"; "error" => %e);
                Err(e.to_string())
            }
        }
    }
}

/// A live data path and the listeners it serves: every listener on one device (by its
/// async event fd, which is the device context's) shares its CQ, SRQ and buffer pools.
#[derive(Debug)]
struct Shared {
    path: CountedPath,
    listeners: Vec<usize>,
    /// The device it is on: a data path whose CQ failed is replaced by a new one on it.
    device: Device,
}

/// The replacement of a data path whose CQ failed, which its device refused: tried again at
/// `at`, after `wait` (doubling from [`REBUILD_RETRY_FIRST`] to [`REBUILD_RETRY_MAX`]).
#[derive(Debug)]
struct Rebuild {
    device: Device,
    listeners: Vec<usize>,
    at: Instant,
    wait: Duration,
}

/// The wait before a refused replacement data path is tried again the first time.
const REBUILD_RETRY_FIRST: Duration = Duration::from_secs(1);
/// The longest wait between tries.
const REBUILD_RETRY_MAX: Duration = Duration::from_secs(30);

/// A data path on a removed device, draining before it is dropped.
#[derive(Debug)]
struct Removed {
    path: CountedPath,
    listener: usize,
    since: Instant,
    /// Whether the wait for its block operations has been logged.
    told_stuck: bool,
}

/// A reactor's data paths (one per device its listeners are on) and its inbox.
///
/// Each data path counts into counters of its own; every turn their totals move into the
/// reactor's counters (`counters`, what `stats` shows, continuous while data paths come and
/// go) and their levels are summed there.
#[derive(Debug)]
pub struct ReactorPaths {
    /// One per device with a listener serving on it.
    paths: Vec<Shared>,
    /// Data paths of removed devices, draining.
    removed: Vec<Removed>,
    /// Replacements of failed data paths that their device refused, to try again.
    rebuilds: Vec<Rebuild>,
    /// Connections from the control thread.
    inbox: std::sync::mpsc::Receiver<ReactorCmd>,
    /// The reactor's counters.
    counters: Arc<DataPathCounters>,
    builder: PathBuilder,
    /// A data path was added since the reactor last asked for its wake-up fds.
    fds_changed: bool,
    /// Its data paths of the start are built: it serves.
    serving: bool,
    /// Listeners without a data path here because setting one up failed.
    unserved: Unserved,
    /// Shrinks waiting for reads and writes past their device's new end
    /// (`ReactorCmd::FenceWrites`).
    fences: Vec<(
        Arc<nvmfd_blockdev::Device>,
        u64,
        std::sync::mpsc::Sender<()>,
    )>,
    log: slog::Logger,
}

impl ReactorPaths {
    /// Builds the data paths on `devices` (one per listener; `None` where it is not serving).
    pub fn new(
        devices: &[Option<Device>],
        builder: PathBuilder,
        counters: Arc<DataPathCounters>,
        inbox: std::sync::mpsc::Receiver<ReactorCmd>,
        unserved: Unserved,
    ) -> ReactorPaths {
        let log = builder.log.clone();
        let mut rp = ReactorPaths {
            paths: Vec::new(),
            removed: Vec::new(),
            rebuilds: Vec::new(),
            inbox,
            counters,
            builder,
            fds_changed: false,
            serving: false,
            unserved,
            fences: Vec::new(),
            log,
        };
        for (listener, d) in devices.iter().enumerate() {
            if let Some(d) = d {
                rp.serve_listener(listener, d);
            }
        }
        rp.fds_changed = false;
        rp.serving = true;
        rp.fold();
        rp
    }

    /// A new data path on `device`, the reactor's heartbeat excused meanwhile
    /// (`building_path`, cleared however the build ends, a panic included).
    fn build(&self, device: &Device) -> Result<CountedPath, String> {
        let _building = Building::new(&self.counters.building_path);
        if self.serving {
            if let Some(d) = self.builder.test_build_delay {
                std::thread::sleep(d);
            }
        }
        CountedPath::build(&self.builder, device)
    }

    /// The data path listener `listener` is served by.
    fn path_of(&mut self, listener: usize) -> Option<&mut CountedPath> {
        self.paths
            .iter_mut()
            .find(|s| s.listeners.contains(&listener))
            .map(|s| &mut s.path)
    }

    /// Serves listener `listener` on `device`: on the data path of that device if one
    /// serves, else on a new one. False when the device refuses a new one.
    fn serve_listener(&mut self, listener: usize, device: &Device) -> bool {
        let fd = device.async_fd();
        if let Some(s) = self.paths.iter_mut().find(|s| s.path.dp.async_fd() == fd) {
            s.listeners.push(listener);
            let mut unserved = self.unserved.lock().unwrap_or_else(|e| e.into_inner());
            unserved.remove(&listener);
            drop(unserved);
            slog::info!(self.log, "listener shares its device's data path";
                "listener" => listener, "with" => ?s.listeners);
            return true;
        }
        let path = match self.build(device) {
            Ok(path) => path,
            Err(why) => {
                self.set_unserved(listener, Some(why));
                return false;
            }
        };
        self.set_unserved(listener, None);
        self.paths.push(Shared {
            path,
            listeners: vec![listener],
            device: device.clone(),
        });
        self.fds_changed = true;
        true
    }

    /// Replaces every live data path whose CQ failed by a new one on the same device, for
    /// the same listeners. A CQ that failed loses its completions: the old path has torn its
    /// QPs down and refuses connections; it drains (its drains end by their timeout, their
    /// markers being lost) and goes as a removed device's path does. Without this, the
    /// listeners would refuse every host until the daemon restarts.
    fn replace_broken(&mut self, now: Instant) {
        while let Some(k) = self.paths.iter().position(|s| s.path.dp.cq_broken()) {
            let Shared {
                path,
                listeners,
                device,
            } = self.paths.swap_remove(k);
            slog::warn!(self.log, "data path with a failed CQ replaced by a new one on its device; the old one drains";
                "listeners" => ?listeners, "draining" => path.dp.draining());
            self.removed.push(Removed {
                path,
                listener: listeners.first().copied().unwrap_or_default(),
                since: now,
                told_stuck: false,
            });
            self.fds_changed = true;
            self.rebuild(device, listeners, now, None);
        }
    }

    /// Builds a data path on `device` for `listeners`, replacing one that failed. If the
    /// device refuses (its registrations, say, while the old path still holds its memory),
    /// the listeners are reported not serving and it is tried again after a wait that
    /// doubles from the last one (`last_wait`).
    fn rebuild(
        &mut self,
        device: Device,
        listeners: Vec<usize>,
        now: Instant,
        last_wait: Option<Duration>,
    ) {
        match self.build(&device) {
            Ok(path) => {
                for &l in &listeners {
                    self.set_unserved(l, None);
                }
                if last_wait.is_some() {
                    slog::info!(self.log, "replacement data path built"; "listeners" => ?listeners);
                }
                self.paths.push(Shared {
                    path,
                    listeners,
                    device,
                });
                self.fds_changed = true;
            }
            Err(why) => {
                let wait =
                    last_wait.map_or(REBUILD_RETRY_FIRST, |w| (w * 2).min(REBUILD_RETRY_MAX));
                slog::warn!(self.log, "cannot build the replacement data path; trying again later";
                    "listeners" => ?listeners, "error" => &why, "retry_in" => ?wait);
                for &l in &listeners {
                    self.set_unserved(l, Some(why.clone()));
                }
                self.rebuilds.push(Rebuild {
                    device,
                    listeners,
                    at: now + wait,
                    wait,
                });
            }
        }
    }

    /// Tries again the replacements whose wait is over.
    fn retry_rebuilds(&mut self, now: Instant) {
        let mut i = 0;
        while i < self.rebuilds.len() {
            if self.rebuilds[i].at > now {
                i += 1;
                continue;
            }
            let r = self.rebuilds.swap_remove(i);
            self.rebuild(r.device, r.listeners, now, Some(r.wait));
        }
    }

    /// Listener `listener` no longer waits for a replacement data path (it is gone, or it
    /// gets a data path of its own).
    fn forget_rebuild(&mut self, listener: usize) {
        for r in &mut self.rebuilds {
            r.listeners.retain(|&l| l != listener);
        }
        self.rebuilds.retain(|r| !r.listeners.is_empty());
    }

    /// Every data path, live or draining after its device's removal.
    fn all(&mut self) -> impl Iterator<Item = &mut CountedPath> {
        self.paths
            .iter_mut()
            .map(|s| &mut s.path)
            .chain(self.removed.iter_mut().map(|r| &mut r.path))
    }

    /// Every live data path.
    fn live(&mut self) -> impl Iterator<Item = &mut CountedPath> {
        // Not one whose CQ failed this turn: it serves nothing more, and is replaced (from
        // `builder`) at the end of the turn.
        self.paths
            .iter_mut()
            .map(|s| &mut s.path)
            .filter(|p| !p.dp.cq_broken())
    }

    /// Moves the data paths' totals into the reactor's counters and stores the sum of their
    /// levels there (plain loads and stores: this thread writes both).
    fn fold(&self) {
        let mut g = Gauges::default();
        let paths = self.paths.iter().map(|s| &s.path);
        for p in paths.chain(self.removed.iter().map(|r| &r.path)) {
            p.counters.move_totals_into(&self.counters);
            g.add(&p.counters);
        }
        g.store(&self.counters);
    }

    /// Listener `listener` is gone (removed, or its device went). Its connections are torn
    /// down; when no other listener shares its data path, the data path tears everything
    /// down, drains, and goes.
    fn remove_device(&mut self, listener: usize) {
        self.set_unserved(listener, None);
        self.forget_rebuild(listener);
        let Some(k) = self
            .paths
            .iter()
            .position(|s| s.listeners.contains(&listener))
        else {
            return;
        };
        let now = Instant::now();
        let s = &mut self.paths[k];
        s.listeners.retain(|&l| l != listener);
        if !s.listeners.is_empty() {
            let qps = s.path.dp.connections_of(listener);
            s.path.dp.end_listener(listener, now);
            slog::info!(self.log, "listener gone: its QPs are torn down; its device's data path serves on";
                "listener" => listener, "qps" => qps, "others" => ?s.listeners);
            return;
        }
        let mut path = self.paths.swap_remove(k).path;
        let qps = path.dp.connections();
        path.dp.device_removed(now);
        slog::info!(self.log, "device removed: its data path tears its QPs down and drains";
            "listener" => listener, "qps" => qps, "draining" => path.dp.draining());
        self.removed.push(Removed {
            path,
            listener,
            since: now,
            told_stuck: false,
        });
    }

    /// Drops the data paths of removed devices that have nothing outstanding any more, or
    /// have waited `DRAIN_TIMEOUT` since their drains ended and have no block operation in
    /// flight. Dropping an engine waits for its operations (the kernel or librbd may still
    /// write into their buffers): a path whose operation is stuck (a hung disk, an
    /// unreachable cluster) is kept, and polled, until it ends, so that this reactor's other
    /// paths go on serving meanwhile.
    fn drop_removed(&mut self, now: Instant) {
        let mut i = 0;
        while i < self.removed.len() {
            let r = &mut self.removed[i];
            let mut g = Gauges::default();
            g.add(&r.path.counters);
            let drained = r.path.dp.draining() == 0;
            let waited = now.duration_since(r.since) >= DRAIN_TIMEOUT;
            let block_ops = g.block_ops_in_flight();
            if !(drained && (g.idle() || (waited && block_ops == 0))) {
                if drained && waited && !r.told_stuck {
                    r.told_stuck = true;
                    slog::warn!(self.log, "data path of the removed device kept until its block operations end";
                        "listener" => r.listener, "block_ops_in_flight" => block_ops);
                }
                i += 1;
                continue;
            }
            let Removed {
                path,
                listener,
                since,
                ..
            } = self.removed.swap_remove(i);
            // Its last totals move before it goes; its levels leave the sum.
            path.counters.move_totals_into(&self.counters);
            // Its QPs and CM IDs, CQ, SRQ, receive chunks, data MR and PD are destroyed here.
            drop(path);
            let after = now.duration_since(since);
            if g.idle() {
                slog::info!(self.log, "data path of the removed device released: every request, buffer and send came back";
                    "listener" => listener, "after" => ?after);
            } else {
                slog::warn!(self.log, "data path of the removed device released with work outstanding";
                    "listener" => listener, "after" => ?after, "levels" => ?g);
            }
        }
    }

    /// Serves namespace `nsid` of subsystem `sub` from `dev` on every live data path, and on
    /// those built later; on a failure, on none.
    fn attach(
        &mut self,
        sub: u64,
        nsid: u32,
        dev: &Arc<nvmfd_blockdev::Device>,
    ) -> Result<(), String> {
        let mut failed = None;
        for p in self.live() {
            if let Err(e) = p.dp.attach_namespace(sub, nsid, dev) {
                failed = Some(e.to_string());
                break;
            }
        }
        if let Some(e) = failed {
            for p in self.live() {
                p.dp.detach_namespace(sub, nsid);
            }
            slog::warn!(self.log, "cannot attach a namespace's device"; "subsystem" => sub, "nsid" => nsid, "error" => &e);
            return Err(e);
        }
        self.builder.namespaces.push((sub, nsid, Arc::clone(dev)));
        Ok(())
    }

    /// Records why listener `listener` has no data path here (`None`: it has one, or is gone).
    fn set_unserved(&self, listener: usize, why: Option<String>) {
        let mut unserved = self.unserved.lock().unwrap_or_else(|e| e.into_inner());
        match why {
            Some(why) => unserved.insert(listener, why),
            None => unserved.remove(&listener),
        };
    }

    /// Listener `listener` serves again on `device` (its device came back, or it was added).
    fn add_path(&mut self, listener: usize, device: &Device) {
        self.forget_rebuild(listener);
        if self.path_of(listener).is_some() {
            slog::warn!(self.log, "listener already has a data path; keeping it"; "listener" => listener);
            return;
        }
        let paths = self.paths.len();
        if self.serve_listener(listener, device) && self.paths.len() > paths {
            slog::info!(self.log, "data path built on the listener's device"; "listener" => listener);
        }
    }
}

impl Drop for ReactorPaths {
    /// The daemon is stopping: every QP goes through the teardown path and the reactor waits
    /// (bounded by `DRAIN_TIMEOUT`) for the drains before its data paths are destroyed.
    fn drop(&mut self) {
        let now = Instant::now();
        let mut qps = 0;
        for p in self.all() {
            qps += p.dp.connections();
            p.dp.shutdown(now);
        }
        let draining = |rp: &mut ReactorPaths| rp.all().any(|p| p.dp.draining() > 0);
        if qps == 0 && !draining(self) {
            return;
        }
        while draining(self) && now.elapsed() < DRAIN_TIMEOUT {
            for p in self.all() {
                p.dp.poll(Instant::now());
            }
            std::thread::yield_now();
        }
        self.fold();
        let left: usize = self.all().map(|p| p.dp.draining()).sum();
        slog::info!(self.log, "QPs torn down at shutdown"; "qps" => qps, "not_drained" => left);
    }
}

impl crate::reactor::ReactorWork for ReactorPaths {
    fn poll(&mut self, now: Instant) -> bool {
        let mut worked = false;
        while let Ok(cmd) = self.inbox.try_recv() {
            worked = true;
            match cmd {
                ReactorCmd::Adopt { listener, id, req } => {
                    match self.path_of(listener) {
                        Some(p) => match p.dp.adopt_for(listener, id, req) {
                            Ok(Change::Grew(n)) => {
                                slog::info!(self.log, "SRQ grew to cover the connected queues"; "receives" => n)
                            }
                            Ok(_) => {}
                            // Rejected, counted and logged by the data path, its ID dropped.
                            Err(_) => {}
                        },
                        None => {
                            slog::warn!(self.log, "a connection for a listener without a data path: refused"; "listener" => listener);
                            self.counters
                                .connects_failed_accept
                                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            let _ = id.reject(&nvmfd_nvme::rdma_cm::reject_private_data(
                                nvmfd_nvme::wire::rdma_cm_status::NO_RESOURCES,
                            ));
                        }
                    }
                }
                ReactorCmd::Disconnected { token } => {
                    for p in self.all() {
                        p.dp.disconnected(token);
                    }
                }
                ReactorCmd::ConnectFailed { token, why } => {
                    for p in self.all() {
                        p.dp.connect_failed(token, why);
                    }
                }
                ReactorCmd::DeviceEvent {
                    async_fd,
                    number,
                    event,
                } => {
                    let now = Instant::now();
                    // Live data paths only: a removed device's fd number may since name
                    // another device.
                    for p in self.paths.iter_mut().map(|s| &mut s.path) {
                        if p.dp.async_fd() != async_fd {
                            continue;
                        }
                        match p.dp.on_event(&event, number, now) {
                            Change::Grew(n) => {
                                slog::info!(self.log, "SRQ grew"; "receives" => n)
                            }
                            Change::CannotGrow => {
                                slog::warn!(self.log, "SRQ limit reached and it cannot grow (at srq_max, or registering its next chunk failed); hosts RNR-retry while it is empty")
                            }
                            _ => {}
                        }
                    }
                }
                ReactorCmd::RemoveDevice { listener } => self.remove_device(listener),
                ReactorCmd::AddPath { listener, device } => self.add_path(listener, &device),
                ReactorCmd::AttachNamespace {
                    sub,
                    nsid,
                    dev,
                    done,
                } => {
                    let _ = done.send(self.attach(sub, nsid, &dev));
                }
                ReactorCmd::DetachNamespace { sub, nsid } => {
                    self.builder
                        .namespaces
                        .retain(|(s, n, _)| (*s, *n) != (sub, nsid));
                    for p in self.all() {
                        p.dp.detach_namespace(sub, nsid);
                    }
                }
                ReactorCmd::PollEvents => {
                    for p in self.live() {
                        p.dp.poll_events();
                    }
                }
                ReactorCmd::FenceWrites { dev, end, done } => self.fences.push((dev, end, done)),
            }
        }
        // The turn's clock reading, read again when commands took part of the turn.
        let now = if worked { Instant::now() } else { now };
        for p in self.all() {
            worked |= p.dp.poll(now);
        }
        if !self.fences.is_empty() {
            // After this turn's polls: a write let through before the shrink was stored is in
            // an engine by now.
            let mut fences = std::mem::take(&mut self.fences);
            fences.retain(|(dev, end, done)| {
                let left = self.all().any(|p| p.dp.io_past(dev, *end));
                if !left {
                    let _ = done.send(());
                }
                left
            });
            self.fences = fences;
        }
        self.replace_broken(now);
        if !self.rebuilds.is_empty() {
            self.retry_rebuilds(now);
        }
        if !self.removed.is_empty() {
            self.drop_removed(now);
        }
        self.fold();
        worked
    }

    fn wake_fds(&self) -> Vec<std::os::fd::RawFd> {
        self.paths
            .iter()
            .map(|s| &s.path)
            .chain(self.removed.iter().map(|r| &r.path))
            .map(|p| p.dp.wake_fd())
            .collect()
    }

    fn wake_fds_changed(&mut self) -> bool {
        std::mem::take(&mut self.fds_changed)
    }

    fn prepare_sleep(&mut self) -> bool {
        let mut ok = true;
        for p in self.all() {
            ok &= p.dp.arm();
        }
        ok
    }
}

#[cfg(test)]
mod tests {
    /// A build that panics does not leave the reactor excused from the heartbeat check for
    /// the rest of the bound: the flag is lowered as the panic unwinds.
    #[test]
    fn the_building_flag_is_lowered_when_a_build_panics() {
        let flag = std::sync::atomic::AtomicBool::new(false);
        let r = std::panic::catch_unwind(|| {
            let _b = super::Building::new(&flag);
            assert!(flag.load(std::sync::atomic::Ordering::Relaxed));
            panic!("a build that panics");
        });
        assert!(r.is_err());
        assert!(!flag.load(std::sync::atomic::Ordering::Relaxed));
    }
}
