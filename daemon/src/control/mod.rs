//! The control thread: one `mio` loop over signals, the admin socket, the listeners' CM
//! channels, the devices' async event fds and timers (the reactor watchdog, keep-alives, admin
//! idle sweeps, listening again after a device removal). It starts the reactors, tells systemd
//! how the daemon is doing, and stops everything in order. It never touches the data path.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mio::{Events, Poll, Registry, Token};
use nvmfd_config::Config;
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook_mio::v1_0::Signals;
use slog::{debug, error, info, o, warn, Logger};

use crate::admin::{AdminError, AdminServer, Fault, Request, Response};
use crate::datapath::{ConnectFailure, DataPathConfig};
use crate::notify::Notifier;
use crate::paths::{PathBuilder, ReactorCmd, ReactorPaths};
use crate::reactor::{LoopConfig, ReactorError, ReactorHandle, Setup, WorkFactory};
use crate::stats::{AdminStats, ListenerStats};
use nvmfd_nvme::rdma_cm::{check_request, reject_private_data};
use nvmfd_nvme::Target;
use nvmfd_rdma::any;
use nvmfd_rdma::{AsyncEvent, CmEvent, DeviceRelease};

mod answer;
mod change;
mod fence;
mod file;
mod leaving;
mod listeners;
mod off_thread;
mod plan;
mod removal;
mod reopen;
mod restart;
mod status;

use listeners::*;
pub(crate) use off_thread::spawn_counted;
pub use off_thread::{off_thread_running, wait_off_thread};
pub use status::*;

const SIGNALS: Token = Token(0);
const ADMIN: Token = Token(1);
/// Listener `i`'s CM channel has token `LISTENER_BASE + i`.
const LISTENER_BASE: usize = 2;
const FIRST_ADMIN_CLIENT: usize = 1 << 20;
/// Device `i`'s async event fd has token `ASYNC_BASE + i`.
const ASYNC_BASE: usize = 1 << 19;

/// How often a listener whose device was removed tries to listen again.
pub const RELISTEN_INTERVAL: Duration = Duration::from_secs(1);

/// How long after a device's removal nvmfd waits for everything it made on the device to be
/// released (its data paths drain within `DRAIN_TIMEOUT`) before it says what still holds the
/// device and tries to listen again regardless.
pub const RELEASE_TIMEOUT: Duration =
    Duration::from_secs(crate::datapath::DRAIN_TIMEOUT.as_secs() + 5);

/// A listener's `reason` in `status` while its device is away.
pub const DEVICE_REMOVED: &str = "device removed, waiting for it to return";

/// A listener's `reason` in `status` while it listens again after its address moved to
/// another port (`RDMA_CM_EVENT_ADDR_CHANGE`: a bond's failover).
pub const ADDRESS_MOVED: &str = "address moved to another port, listening again";

/// Environment variable that enables test-only admin requests (`debug_stall_reactor`,
/// `debug_fault`).
pub const TEST_HOOKS_ENV: &str = "NVMFD_TEST_HOOKS";

/// Test hook (with [`TEST_HOOKS_ENV`]): milliseconds each reactor takes to build its data
/// paths on top of the real work, as registering a large pool with a slow device does.
pub const TEST_SETUP_DELAY_ENV: &str = "NVMFD_TEST_REACTOR_SETUP_MS";

/// Test hook (with [`TEST_HOOKS_ENV`]): milliseconds each reactor pauses before building
/// each data path while the daemon serves.
pub const TEST_BUILD_DELAY_ENV: &str = "NVMFD_TEST_PATH_BUILD_MS";
/// Test hook (with [`TEST_HOOKS_ENV`]): milliseconds in place of [`REACTOR_SETUP_TIMEOUT`].
pub const TEST_SETUP_TIMEOUT_ENV: &str = "NVMFD_TEST_REACTOR_SETUP_TIMEOUT_MS";

/// How long a reactor may take to build its data paths at start (registering its pools)
/// before the daemon gives up starting: within systemd's default start timeout (90 s).
pub const REACTOR_SETUP_TIMEOUT: Duration = Duration::from_secs(60);

/// The longest an idle reactor sleeps (a quarter of `stall_timeout`, at most this): how late
/// its timers may be.
const MAX_REACTOR_SLEEP: Duration = Duration::from_millis(500);

/// Exit status when a second termination signal forces the daemon out during a graceful stop.
pub const FORCED_EXIT_STATUS: i32 = 130;

/// Heartbeat tracking for one reactor.
#[derive(Debug)]
struct Heartbeat {
    last_turns: u64,
    last_move: Instant,
    /// Since when the reactor has been building a data path (`building_path`), as seen here.
    building_since: Option<Instant>,
}

struct Daemon {
    cfg: Config,
    log: Logger,
    started: Instant,
    notifier: Notifier,
    /// Set by SIGTERM and SIGINT: the daemon stops (a change under way first ends).
    term: Arc<AtomicBool>,
    reactors: Vec<ReactorHandle>,
    heartbeats: Vec<Heartbeat>,
    listeners: Vec<ListenerStatus>,
    /// Every configured namespace, served or not.
    namespaces: Vec<crate::serve::NamespaceStatus>,
    test_hooks: bool,
    /// Test hook: the namespace whose next resize fails (`debug_fail_resize`).
    fail_resize: Option<(String, u32)>,
    /// Fenced Connects already logged (`Target::fenced_connects`).
    fenced_seen: u64,
    /// A reactor was building a data path (within the bound it is excused for) at the last
    /// look at the controllers, and when that look was.
    was_building: bool,
    controllers_seen: Instant,
    stopping: bool,
    target: Option<Target>,
    /// Per listener (in configuration order): its channel, listening ID and device.
    cm: Vec<Listening>,
    /// The listeners' devices, one per async event fd (token `ASYNC_BASE + index`); `None`
    /// where a device was removed.
    async_devs: Vec<Option<any::Device>>,
    inboxes: Vec<std::sync::mpsc::Sender<ReactorCmd>>,
    dp_counters: Vec<Arc<crate::stats::DataPathCounters>>,
    /// Per reactor: listeners it could not set up a data path for, and why.
    unserved: Vec<crate::paths::Unserved>,
    next_reactor: usize,
    soft_fabric: Option<nvmfd_rdma::soft::Fabric>,
    /// The configuration file and its text.
    source: file::Source,
    /// The devices of the namespaces served, by subsystem NQN and NSID.
    devices: std::collections::BTreeMap<(String, u32), Arc<nvmfd_blockdev::Device>>,
    /// Listener slots (a listener's index: its CM token, its reactors' data path); a removed
    /// listener leaves its slot empty.
    listener_slots: Vec<Option<nvmfd_config::Listener>>,
    /// Configured namespaces whose device could not be opened, tried again.
    reopens: Vec<reopen::Reopen>,
    /// Devices let go of, synced once the reactors release them.
    leaving: Vec<leaving::Leaving>,
    /// Syncs of devices let go of, running on threads of their own.
    release_syncs: Vec<leaving::ReleaseSync>,
    /// Syncs of devices let go of that failed.
    release_sync_failures: usize,
    /// The control loop's registry, for serving connections while a change waits
    /// (`serve_meanwhile`); `None` before serving, while it is in use, and once stopping.
    registry: Option<mio::Registry>,
    /// Device removals seen while a change waited, handled once it is done (they change the
    /// listeners the change may be working on).
    deferred_removals: Vec<listeners::DeferredRemoval>,
}

/// Runs the daemon until a termination signal: the control loop on this thread, one reactor
/// thread per configured core. Returns after a graceful stop.
///
/// A second SIGTERM or SIGINT during the stop exits the process at once with status
/// [`FORCED_EXIT_STATUS`].
pub fn run(
    cfg: Config,
    source: Option<(std::path::PathBuf, String)>,
    facts: nvmfd_config::SystemFacts,
    log: Logger,
) -> Result<(), DaemonError> {
    // `cfg` is what `source`'s text says: the text edits apply to is the one it was parsed
    // from, not the file read again (it may have changed since).
    let (path, text) = match source {
        Some((path, text)) => (Some(path), text),
        None => (None, toml::to_string(&cfg).unwrap_or_default()),
    };
    // Test hook: the start waits here (`loaded-hold` in the test gate's directory), the
    // configuration read, while a test edits the file.
    if std::env::var(TEST_HOOKS_ENV).is_ok_and(|v| v == "1") {
        if let Some(dir) = std::env::var_os(off_thread::TEST_GATE_ENV) {
            off_thread::wait_at_gate_if_held(std::path::Path::new(&dir), "loaded");
        }
    }
    // Signals first, so that a SIGTERM during start-up is a graceful stop, not a kill.
    let term = Arc::new(AtomicBool::new(false));
    for sig in [SIGTERM, SIGINT] {
        signal_hook::flag::register_conditional_shutdown(
            sig,
            FORCED_EXIT_STATUS,
            Arc::clone(&term),
        )
        .map_err(DaemonError::Setup)?;
        signal_hook::flag::register(sig, Arc::clone(&term)).map_err(DaemonError::Setup)?;
    }
    let mut poll = Poll::new().map_err(DaemonError::Setup)?;
    let mut signals = Signals::new([SIGTERM, SIGINT, SIGHUP]).map_err(DaemonError::Setup)?;
    poll.registry()
        .register(&mut signals, SIGNALS, mio::Interest::READABLE)
        .map_err(DaemonError::Setup)?;

    let notifier = Notifier::new(log.clone());
    let stall_timeout = cfg.daemon.stall_timeout.0;
    let loop_cfg = LoopConfig {
        idle_sleep_after: cfg.daemon.idle_sleep_after.0,
        // Bounded: the reactors' own timers (a connection's Fabrics Connect, drains, stalled
        // sends) are looked at when they wake.
        max_sleep: (stall_timeout / 4).clamp(Duration::from_millis(1), MAX_REACTOR_SLEEP),
    };
    let mut d = Daemon {
        log: log.clone(),
        started: Instant::now(),
        notifier,
        term: Arc::clone(&term),
        reactors: Vec::new(),
        heartbeats: Vec::new(),
        listeners: Vec::new(),
        namespaces: Vec::new(),
        test_hooks: std::env::var(TEST_HOOKS_ENV).is_ok_and(|v| v == "1"),
        fail_resize: None,
        fenced_seen: 0,
        was_building: false,
        controllers_seen: Instant::now(),
        stopping: false,
        target: None,
        cm: Vec::new(),
        async_devs: Vec::new(),
        inboxes: Vec::new(),
        dp_counters: Vec::new(),
        unserved: Vec::new(),
        next_reactor: 0,
        soft_fabric: None,
        source: file::Source { text, path, facts },
        devices: std::collections::BTreeMap::new(),
        listener_slots: cfg.listeners.iter().cloned().map(Some).collect(),
        reopens: Vec::new(),
        leaving: Vec::new(),
        release_syncs: Vec::new(),
        release_sync_failures: 0,
        registry: None,
        deferred_removals: Vec::new(),
        cfg,
    };
    if d.test_hooks {
        warn!(
            log,
            "test hooks are enabled ({TEST_HOOKS_ENV}=1): never in production"
        );
    }
    let result = d
        .start(&mut poll, loop_cfg, &term)
        .and_then(|admin| match admin {
            Some(admin) => d.serve(&mut poll, &mut signals, admin, &term),
            // Stopped while starting: never ready, nothing served.
            None => {
                d.notifier.stopping("stopping before it was ready");
                Ok(())
            }
        });
    d.stop_reactors();
    let not_synced = d.sync_devices_at_stop();
    match result {
        Ok(()) if not_synced > 0 => Err(DaemonError::NotSynced(not_synced)),
        r => r,
    }
}

impl Daemon {
    /// Milliseconds from test hook variable `name`, with test hooks on.
    fn test_ms(&self, name: &str) -> Option<Duration> {
        if !self.test_hooks {
            return None;
        }
        let ms: u64 = std::env::var(name).ok()?.parse().ok()?;
        Some(Duration::from_millis(ms))
    }

    /// Starts: namespaces, listeners, reactors, the admin socket, then READY=1. `None` when a
    /// stop (`term`) came first: it is looked at between the steps and while the reactors
    /// set up (up to [`REACTOR_SETUP_TIMEOUT`]), so `systemctl stop` during a long start is
    /// not held up until READY=1. (Opening a namespace is not interrupted.)
    fn start(
        &mut self,
        poll: &mut Poll,
        loop_cfg: LoopConfig,
        term: &AtomicBool,
    ) -> Result<Option<AdminServer>, DaemonError> {
        let stop_asked = |log: &Logger, during: &str| {
            let asked = term.load(Ordering::Relaxed);
            if asked {
                info!(log, "stop requested while starting: stopping"; "during" => during);
            }
            asked
        };
        let built = crate::serve::build_target(&self.cfg).map_err(DaemonError::Namespaces)?;
        for n in built.status.iter().filter(|n| !n.serving) {
            error!(self.log, "namespace not served: the others are";
                   "subsystem" => &n.subsystem, "nsid" => n.nsid, "backend" => &n.backend,
                   "reason" => n.reason.as_deref().unwrap_or(""));
        }
        for n in &built.status {
            if let Some(w) = &n.warning {
                warn!(self.log, "namespace served with a warning";
                      "subsystem" => &n.subsystem, "nsid" => n.nsid, "warning" => w);
            }
        }
        info!(self.log, "namespaces open"; "count" => built.devices.len(),
              "not served" => built.status.len() - built.devices.len());
        if stop_asked(&self.log, "opening the namespaces") {
            return Ok(None);
        }
        let (target, namespaces) = (built.target, built.devices);
        for (sub, nsid, dev) in &namespaces {
            if let Some(s) = target.subsystem_by_id(*sub) {
                self.devices.insert((s.nqn.clone(), *nsid), Arc::clone(dev));
            }
        }
        self.namespaces = built.status;
        // Listeners first: the reactors build a data path on each listener's device.
        for (i, l) in self.cfg.listeners.clone().iter().enumerate() {
            self.cm.push(Listening::default());
            let status = match self.listen(poll.registry(), i) {
                Ok(()) => {
                    info!(self.log, "listening"; "address" => %l.address, "port" => l.port, "provider" => %l.provider);
                    (true, None)
                }
                Err(reason) => {
                    // Tried again every RELISTEN_INTERVAL (its address may come up later in
                    // the boot, its port be freed).
                    warn!(self.log, "listener not serving: it tries again every second"; "address" => %l.address, "port" => l.port,
                          "provider" => %l.provider, "reason" => &reason);
                    if let Some(c) = self.cm.get_mut(i) {
                        c.relisten_at = Some(Instant::now() + RELISTEN_INTERVAL);
                        c.relisten_error = Some(reason.clone());
                    }
                    (false, Some(reason))
                }
            };
            self.listeners.push(ListenerStatus {
                address: l.address.to_string(),
                port: l.port,
                provider: l.provider.to_string(),
                serving: status.0,
                reason: status.1,
            });
        }
        let devices: Vec<Option<any::Device>> = self.cm.iter().map(|l| l.device.clone()).collect();
        let registrar = crate::srq::Registrar::spawn().map_err(DaemonError::Setup)?;
        let limits = crate::serve::limits(&self.cfg);
        let t = &self.cfg.transport;
        // Commands in flight on one reactor at most; each may hold a small buffer (8 KiB:
        // 8 MiB in all), and as many as there are large buffers may hold a large one.
        const REQUESTS: u32 = 1024;
        let dp_cfg = DataPathConfig {
            srq: crate::srq::SrqConfig {
                initial: t.srq_initial.min(t.srq_max),
                max: t.srq_max,
                low_watermark: t.srq_low_watermark,
                chunk: t.srq_grow_chunk,
                shrink_delay: t.srq_shrink_delay.0,
                cover_queues: t.srq_cover_queues,
            },
            in_capsule: limits.in_capsule_data_size,
            buffers: u32::from(limits.max_queue_depth).clamp(32, 256),
            small_buffers: REQUESTS,
            max_io: limits.max_io_size,
            requests: REQUESTS,
            huge_pages: t.huge_pages,
            connect_timeout: t.connect_timeout.0,
            response_timeout: crate::datapath::RESPONSE_TIMEOUT,
            max_qps: crate::datapath::MAX_QPS,
        };
        for (id, &core) in self.cfg.daemon.reactor_cores.iter().enumerate() {
            let (tx, rx) = std::sync::mpsc::channel();
            let devs = devices.clone();
            let counters = Arc::new(crate::stats::DataPathCounters::default());
            self.dp_counters.push(Arc::clone(&counters));
            let builder = PathBuilder {
                target: target.clone(),
                namespaces: namespaces.clone(),
                cfg: dp_cfg,
                registrar: registrar.clone(),
                log: self.log.new(o!("reactor" => id)),
                test_build_delay: self.test_ms(TEST_BUILD_DELAY_ENV),
            };
            let unserved = crate::paths::Unserved::default();
            self.unserved.push(Arc::clone(&unserved));
            let setup_delay = self.test_ms(TEST_SETUP_DELAY_ENV);
            let factory: WorkFactory = Box::new(move || {
                if let Some(d) = setup_delay {
                    std::thread::sleep(d);
                }
                Box::new(ReactorPaths::new(&devs, builder, counters, rx, unserved))
            });
            self.reactors.push(ReactorHandle::spawn(
                id,
                core,
                loop_cfg,
                &self.log,
                Some(factory),
            )?);
            self.inboxes.push(tx);
        }
        // Ready means serving: each reactor has built its data paths (registering a large
        // pool with an RDMA device takes seconds) and runs its loop before READY=1, and its
        // heartbeat is watched from then on (it was from before, and a reactor still
        // registering was reported stalled).
        // One deadline for all (they set up in parallel).
        let allowed = self
            .test_ms(TEST_SETUP_TIMEOUT_ENV)
            .unwrap_or(REACTOR_SETUP_TIMEOUT);
        let deadline = Instant::now() + allowed;
        for i in 0..self.reactors.len() {
            // Waited for in slices, to see a stop meanwhile.
            let setup = loop {
                let slice = deadline.min(Instant::now() + Duration::from_millis(50));
                match self.reactors[i].wait_running(slice) {
                    Setup::TimedOut if slice < deadline => {}
                    s => break s,
                }
                if stop_asked(&self.log, "the reactors' setup") {
                    for r in &mut self.reactors {
                        r.abandon_if_not_running();
                    }
                    return Ok(None);
                }
            };
            let r = &mut self.reactors[i];
            let failed = match setup {
                Setup::Running => None,
                Setup::TimedOut => Some(ReactorError::Setup {
                    id: r.shared.id,
                    waited: allowed,
                }),
                Setup::Ended => Some(ReactorError::SetupEnded { id: r.shared.id }),
            };
            if let Some(e) = failed {
                // A reactor stuck building its data paths does not look at the stop flag:
                // the daemon exits without waiting for it.
                for r in &mut self.reactors {
                    r.abandon_if_not_running();
                }
                return Err(DaemonError::Reactor(e));
            }
            let r = &self.reactors[i];
            self.heartbeats.push(Heartbeat {
                last_turns: r.shared.counters.turns.load(Ordering::Relaxed),
                last_move: Instant::now(),
                building_since: None,
            });
        }
        // A controller that ends or resets on one reactor wakes the others: their idle queues
        // of it go at once (a reset reports RDY = 0 only once they are gone), not when each
        // next wakes (up to `max_sleep`).
        let shared: Vec<Arc<crate::reactor::ReactorShared>> = self
            .reactors
            .iter()
            .map(|r| Arc::clone(&r.shared))
            .collect();
        target.set_change_waker(Box::new(move || {
            for s in &shared {
                s.wake();
            }
        }));
        self.target = Some(target);
        self.schedule_reopens(Instant::now());
        let admin = AdminServer::bind(
            &self.cfg.daemon.admin_socket,
            poll.registry(),
            ADMIN,
            FIRST_ADMIN_CLIENT,
            self.cfg.daemon.admin_client_timeout.0,
            self.log
                .new(o!("admin" => self.cfg.daemon.admin_socket.display().to_string())),
        )?;
        if stop_asked(&self.log, "binding the admin socket") {
            admin.shutdown(poll.registry());
            return Ok(None);
        }
        info!(self.log, "nvmfd ready"; "reactors" => self.reactors.len(),
              "admin_socket" => %self.cfg.daemon.admin_socket.display(),
              "subsystems" => self.cfg.subsystems.len());
        self.notifier.ready(&self.status_line());
        Ok(Some(admin))
    }

    fn serve(
        &mut self,
        poll: &mut Poll,
        signals: &mut Signals,
        mut admin: AdminServer,
        term: &AtomicBool,
    ) -> Result<(), DaemonError> {
        let tick = self.tick_interval();
        info!(self.log, "control loop running"; "tick" => ?tick,
              "watchdog" => ?self.notifier.watchdog_interval());
        let mut events = Events::with_capacity(64);
        let mut next_tick = Instant::now();
        // Idle admin clients are dropped once this turn's events are handled, idle as of the
        // poll: a client whose request waited in its socket through a long turn (a change
        // that waited) is not idle.
        let mut sweep_due = false;
        self.registry = poll.registry().try_clone().ok();
        loop {
            for c in &mut self.cm {
                c.held = false;
            }
            self.handle_deferred_removals(poll.registry());
            let now = Instant::now();
            if now >= next_tick {
                self.check_heartbeats(now);
                self.relisten(poll.registry(), now);
                self.let_go_of_unserved_devices(poll.registry());
                self.let_go_of_removed_channels(poll.registry());
                self.check_controllers(now);
                self.reopen_namespaces(now);
                self.sync_released_devices();
                self.report_sync_failures();
                sweep_due = true;
                next_tick = now + tick;
            }
            // An admin client with requests left from its last turn is served without waiting.
            // So are device removals seen while a change waited (their fds were drained).
            let timeout = if admin.has_pending() || !self.deferred_removals.is_empty() {
                Duration::ZERO
            } else {
                next_tick.saturating_duration_since(Instant::now())
            };
            if let Err(e) = poll.poll(&mut events, Some(timeout)) {
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(DaemonError::Setup(e));
            }
            let polled_at = Instant::now();
            for ev in events.iter() {
                if ev.token() == SIGNALS {
                    for sig in signals.pending() {
                        if sig == SIGHUP {
                            self.handle_deferred_removals(poll.registry());
                            match self.reload(poll.registry()) {
                                Ok(what) => {
                                    info!(self.log, "SIGHUP: configuration reloaded"; "changes" => what.join("; "))
                                }
                                Err(e) => {
                                    error!(self.log, "SIGHUP: configuration not reloaded, nothing changed"; "error" => e)
                                }
                            }
                        } else {
                            info!(self.log, "termination signal"; "signal" => sig);
                        }
                    }
                } else if (LISTENER_BASE..LISTENER_BASE + self.cm.len()).contains(&ev.token().0) {
                    self.cm_events(poll.registry(), ev.token().0 - LISTENER_BASE);
                } else if (ASYNC_BASE..ASYNC_BASE + self.async_devs.len()).contains(&ev.token().0) {
                    self.async_events(poll.registry(), ev.token().0 - ASYNC_BASE);
                } else if admin.owns(ev.token()) {
                    let registry = poll.registry();
                    admin.on_event(registry, ev.token(), &mut |req, uid, stats| {
                        self.answer(registry, req, uid, stats)
                    });
                }
            }
            if admin.has_pending() {
                let registry = poll.registry();
                admin.serve_pending(registry, &mut |req, uid, stats| {
                    self.answer(registry, req, uid, stats)
                });
            }
            if std::mem::take(&mut sweep_due) {
                admin.sweep(poll.registry(), polled_at);
            }
            // The flag is set by the signal handler itself, possibly before the signal's event
            // is polled: it alone decides.
            if term.load(Ordering::Relaxed) {
                info!(
                    self.log,
                    "stopping gracefully (a second SIGTERM or SIGINT forces exit)"
                );
                self.stopping = true;
                break;
            }
        }
        self.notifier.stopping("stopping: draining reactors");
        // Nothing is served while the daemon stops (`serve_meanwhile`).
        self.registry = None;
        admin.shutdown(poll.registry());
        Ok(())
    }

    /// Ends the controllers whose keep-alive timeout passed, and logs the Connects the fence
    /// refused since the last look (`Target::fenced_connects`).
    fn check_controllers(&mut self, now: Instant) {
        let Some(t) = self.target.clone() else {
            return;
        };
        // A reactor building a data path reads none of its queues' commands: their hosts'
        // Keep Alives wait in the SRQ. That time counts against no controller (which have a
        // queue there is not known here: every timer is held), up to the bound a build is
        // excused for (past it, the reactor is stalled), and up to this look if the build
        // ended since the last (by now the reactor has read what waited).
        let setup_bound = self
            .test_ms(TEST_SETUP_TIMEOUT_ENV)
            .unwrap_or(REACTOR_SETUP_TIMEOUT);
        let building = self.heartbeats.iter().any(|hb| {
            hb.building_since
                .is_some_and(|since| now.saturating_duration_since(since) < setup_bound)
        });
        if building || self.was_building {
            t.hold_keep_alive_timers(now.saturating_duration_since(self.controllers_seen), now);
        }
        self.was_building = building;
        self.controllers_seen = now;
        let ended = t.expire_keep_alives(now);
        for c in &ended {
            warn!(self.log, "keep-alive timeout: controller ended"; "cntlid" => c.cntlid, "host" => &c.hostnqn);
        }
        // Reactors asleep close the ended controllers' queues now, not at the end of their
        // sleep.
        if !ended.is_empty() {
            self.tell_reactors(|| ReactorCmd::PollEvents);
        }
        let (fenced, last) = t.fenced_connects();
        if fenced != self.fenced_seen {
            let (host, sub) = last.unwrap_or_default();
            warn!(self.log, "a host's Connect waits until I/O of its ended controller is done (answered Controller Busy)";
                  "host" => host, "subsystem" => sub, "refused" => fenced - self.fenced_seen);
            self.fenced_seen = fenced;
        }
    }

    /// How often heartbeats are checked: often enough to feed the watchdog twice per interval
    /// and to see a stall soon after `stall_timeout`.
    fn tick_interval(&self) -> Duration {
        let mut t = self.cfg.daemon.stall_timeout.0 / 4;
        if let Some(w) = self.notifier.watchdog_interval() {
            t = t.min(w / 2);
        }
        t.clamp(Duration::from_millis(5), Duration::from_secs(1))
    }

    /// Marks reactors whose heartbeat has not moved for `stall_timeout` as stalled, and feeds
    /// the systemd watchdog only when none is.
    fn check_heartbeats(&mut self, now: Instant) {
        let stall_timeout = self.cfg.daemon.stall_timeout.0;
        let setup_bound = self
            .test_ms(TEST_SETUP_TIMEOUT_ENV)
            .unwrap_or(REACTOR_SETUP_TIMEOUT);
        let mut changed = false;
        for (i, (hb, r)) in self.heartbeats.iter_mut().zip(&self.reactors).enumerate() {
            let c = &r.shared.counters;
            let turns = c.turns.load(Ordering::Relaxed);
            if turns != hb.last_turns {
                hb.last_turns = turns;
                hb.last_move = now;
            }
            // A reactor building a data path at run time is excused as at start, up to the
            // same bound: its I/O waits meanwhile, but the daemon is not reported stalled
            // (and killed by the watchdog) for a listener added or a device come back.
            let building = self
                .dp_counters
                .get(i)
                .is_some_and(|d| d.building_path.load(Ordering::Relaxed));
            match (building, hb.building_since) {
                (false, _) => hb.building_since = None,
                (true, None) => {
                    hb.building_since = Some(now);
                    hb.last_move = now;
                }
                (true, Some(since)) if now.duration_since(since) < setup_bound => {
                    hb.last_move = now;
                }
                (true, Some(_)) => {}
            }
            let stalled = now.duration_since(hb.last_move) > stall_timeout;
            if stalled != c.stalled.swap(stalled, Ordering::Relaxed) {
                changed = true;
                if stalled {
                    error!(self.log, "reactor stalled: its heartbeat has not moved; the watchdog is no longer fed";
                           "reactor" => r.shared.id, "core" => r.shared.core,
                           "for" => ?now.duration_since(hb.last_move));
                } else {
                    info!(self.log, "reactor recovered from a stall"; "reactor" => r.shared.id);
                }
            }
        }
        if changed {
            self.notifier.status(&self.status_line());
        }
        let all_moving = self
            .reactors
            .iter()
            .all(|r| !r.shared.counters.stalled.load(Ordering::Relaxed));
        if all_moving {
            self.notifier.watchdog();
        }
    }

    fn stop_reactors(&mut self) {
        for r in &self.reactors {
            r.shared.request_stop();
        }
        for r in &mut self.reactors {
            r.join();
        }
        if !self.reactors.is_empty() {
            info!(self.log, "reactors stopped"; "count" => self.reactors.len());
        }
    }
}
