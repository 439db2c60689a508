//! The control thread: one `mio` loop over signals, the admin socket, the listeners' CM
//! channels, the devices' async event fds and timers (the reactor watchdog, keep-alives, admin
//! idle sweeps, listening again after a device removal). It starts the reactors, tells systemd
//! how the daemon is doing, and stops everything in order. It never touches the data path.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mio::{Events, Poll, Registry, Token};
use nvmfd_config::Config;
use serde::{Deserialize, Serialize};
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook_mio::v1_0::Signals;
use slog::{debug, error, info, o, warn, Logger};

use crate::admin::{AdminError, AdminServer, Fault, Request, Response};
use crate::datapath::{ConnectFailure, DataPathConfig};
use crate::notify::Notifier;
use crate::paths::{PathBuilder, ReactorCmd, ReactorPaths};
use crate::reactor::{LoopConfig, ReactorError, ReactorHandle, WorkFactory};
use crate::stats::{AdminStats, ListenerStats, Stats};
use nvmfd_nvme::rdma_cm::{check_request, reject_private_data};
use nvmfd_nvme::Target;
use nvmfd_rdma::any;
use nvmfd_rdma::{AsyncEvent, CmEvent, DeviceRelease};

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

/// Environment variable that enables test-only admin requests (`debug_stall_reactor`,
/// `debug_fault`).
pub const TEST_HOOKS_ENV: &str = "NVMFD_TEST_HOOKS";

/// Exit status when a second termination signal forces the daemon out during a graceful stop.
pub const FORCED_EXIT_STATUS: i32 = 130;

/// Why the daemon could not run.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// the poller or signal handling could not be set up
    #[error("cannot set up the control loop: {0}")]
    Setup(#[source] std::io::Error),
    /// a reactor could not start
    #[error(transparent)]
    Reactor(#[from] ReactorError),
    /// the admin socket could not be set up
    #[error("admin socket {0}")]
    Admin(#[from] AdminError),
    /// a namespace could not be opened
    #[error("{0}")]
    Namespaces(String),
}

/// One listener in `status`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ListenerStatus {
    /// Address.
    pub address: String,
    /// Port.
    pub port: u16,
    /// Verbs provider.
    pub provider: String,
    /// Whether it accepts connections.
    pub serving: bool,
    /// Why not, when it does not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// One subsystem in `status`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct SubsystemStatus {
    /// NQN.
    pub nqn: String,
    /// Number of namespaces.
    pub namespaces: usize,
    /// Whether any host may connect.
    pub allow_any_host: bool,
    /// Allowed host NQNs.
    pub hosts: Vec<String>,
}

/// One reactor in `status`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ReactorStatus {
    /// Index.
    pub id: usize,
    /// Pinned core.
    pub core: usize,
    /// Whether its heartbeat has stopped.
    pub stalled: bool,
}

/// The answer to `status`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Status {
    /// nvmfd's version.
    pub version: String,
    /// Process ID.
    pub pid: u32,
    /// `running` or `stopping`.
    pub state: String,
    /// Seconds since start.
    pub uptime_seconds: u64,
    /// systemd watchdog interval, when enabled.
    pub watchdog_usec: Option<u64>,
    /// Reactors.
    pub reactors: Vec<ReactorStatus>,
    /// Listeners.
    pub listeners: Vec<ListenerStatus>,
    /// Subsystems.
    pub subsystems: Vec<SubsystemStatus>,
}

/// A listener's CM state.
#[derive(Debug, Default)]
struct Listening {
    // Field order is drop order: the IDs go before their channel.
    /// The listening ID, while it serves.
    id: Option<any::cm::CmId>,
    /// Its device, while it serves.
    device: Option<any::Device>,
    /// After its device was removed: the old listening ID, kept until nothing made on the
    /// device is left, then used to let go of the device.
    retiring: Option<Retiring>,
    /// Its CM channel, registered with the control loop. It stays when the device goes: IDs of
    /// its connections may still be draining on the reactors, and a channel must outlive its
    /// IDs (rdma_destroy_event_channel); it listens again on the same channel.
    channel: Option<any::cm::CmChannel>,
    /// While its device is away: when to try listening again.
    relisten_at: Option<Instant>,
    /// Why the last try failed (logged when it changes).
    relisten_error: Option<String>,
    device_removals: u64,
    returns: u64,
}

/// A listener's listening ID on a removed device, until the device is released.
#[derive(Debug)]
struct Retiring {
    id: any::cm::CmId,
    since: Instant,
    /// `RELEASE_TIMEOUT` passed with the device still held (logged once); the listener tries
    /// to listen again meanwhile.
    overdue: bool,
    /// Letting go of the device failed (logged once).
    failed: bool,
}

/// Heartbeat tracking for one reactor.
#[derive(Debug)]
struct Heartbeat {
    last_turns: u64,
    last_move: Instant,
}

struct Daemon {
    cfg: Config,
    log: Logger,
    started: Instant,
    notifier: Notifier,
    reactors: Vec<ReactorHandle>,
    heartbeats: Vec<Heartbeat>,
    listeners: Vec<ListenerStatus>,
    test_hooks: bool,
    stopping: bool,
    target: Option<Target>,
    /// Per listener (in configuration order): its channel, listening ID and device.
    cm: Vec<Listening>,
    /// The listeners' devices, one per async event fd (token `ASYNC_BASE + index`); `None`
    /// where a device was removed.
    async_devs: Vec<Option<any::Device>>,
    inboxes: Vec<std::sync::mpsc::Sender<ReactorCmd>>,
    dp_counters: Vec<Arc<crate::stats::DataPathCounters>>,
    next_reactor: usize,
    soft_fabric: Option<nvmfd_rdma::soft::Fabric>,
}

/// Runs the daemon until a termination signal: the control loop on this thread, one reactor
/// thread per configured core. Returns after a graceful stop.
///
/// A second SIGTERM or SIGINT during the stop exits the process at once with status
/// [`FORCED_EXIT_STATUS`].
pub fn run(cfg: Config, log: Logger) -> Result<(), DaemonError> {
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
        max_sleep: (stall_timeout / 4).max(Duration::from_millis(1)),
    };
    let mut d = Daemon {
        log: log.clone(),
        started: Instant::now(),
        notifier,
        reactors: Vec::new(),
        heartbeats: Vec::new(),
        listeners: Vec::new(),
        test_hooks: std::env::var(TEST_HOOKS_ENV).is_ok_and(|v| v == "1"),
        stopping: false,
        target: None,
        cm: Vec::new(),
        async_devs: Vec::new(),
        inboxes: Vec::new(),
        dp_counters: Vec::new(),
        next_reactor: 0,
        soft_fabric: None,
        cfg,
    };
    if d.test_hooks {
        warn!(
            log,
            "test hooks are enabled ({TEST_HOOKS_ENV}=1): never in production"
        );
    }
    let result = d
        .start(&mut poll, loop_cfg)
        .and_then(|admin| d.serve(&mut poll, &mut signals, admin, &term));
    d.stop_reactors();
    result
}

impl Daemon {
    fn start(&mut self, poll: &mut Poll, loop_cfg: LoopConfig) -> Result<AdminServer, DaemonError> {
        let (target, namespaces) =
            crate::serve::build_target(&self.cfg).map_err(DaemonError::Namespaces)?;
        info!(self.log, "namespaces open"; "count" => namespaces.len());
        // Listeners first: the reactors build a data path on each listener's device.
        for (i, l) in self.cfg.listeners.clone().iter().enumerate() {
            self.cm.push(Listening::default());
            let status = match self.listen(poll.registry(), i) {
                Ok(()) => {
                    info!(self.log, "listening"; "address" => %l.address, "port" => l.port, "provider" => %l.provider);
                    (true, None)
                }
                Err(reason) => {
                    warn!(self.log, "listener not serving"; "address" => %l.address, "port" => l.port,
                          "provider" => %l.provider, "reason" => &reason);
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
            max_io: limits.max_io_size,
            requests: 1024,
            connect_timeout: t.connect_timeout.0,
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
            };
            let factory: WorkFactory =
                Box::new(move || Box::new(ReactorPaths::new(&devs, builder, counters, rx)));
            self.reactors.push(ReactorHandle::spawn(
                id,
                core,
                loop_cfg,
                &self.log,
                Some(factory),
            )?);
            self.inboxes.push(tx);
            self.heartbeats.push(Heartbeat {
                last_turns: 0,
                last_move: Instant::now(),
            });
        }
        self.target = Some(target);
        let admin = AdminServer::bind(
            &self.cfg.daemon.admin_socket,
            poll.registry(),
            ADMIN,
            FIRST_ADMIN_CLIENT,
            self.cfg.daemon.admin_client_timeout.0,
            self.log
                .new(o!("admin" => self.cfg.daemon.admin_socket.display().to_string())),
        )?;
        info!(self.log, "nvmfd ready"; "reactors" => self.reactors.len(),
              "admin_socket" => %self.cfg.daemon.admin_socket.display(),
              "subsystems" => self.cfg.subsystems.len());
        self.notifier.ready(&self.status_line());
        Ok(admin)
    }

    fn status_line(&self) -> String {
        let namespaces: usize = self.cfg.subsystems.iter().map(|s| s.namespaces.len()).sum();
        let serving = self.listeners.iter().filter(|l| l.serving).count();
        let stalled = self
            .heartbeats
            .iter()
            .zip(&self.reactors)
            .filter(|(_, r)| r.shared.counters.stalled.load(Ordering::Relaxed))
            .count();
        let mut s = format!(
            "{} subsystem(s), {} namespace(s); {}/{} listener(s) serving; {} reactor(s)",
            self.cfg.subsystems.len(),
            namespaces,
            serving,
            self.listeners.len(),
            self.reactors.len()
        );
        if stalled > 0 {
            s.push_str(&format!(", {stalled} STALLED"));
        }
        s
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
        loop {
            let now = Instant::now();
            if now >= next_tick {
                self.check_heartbeats(now);
                self.relisten(poll.registry(), now);
                if let Some(t) = &self.target {
                    for c in t.expire_keep_alives(now) {
                        warn!(self.log, "keep-alive timeout: controller ended"; "cntlid" => c.cntlid, "host" => &c.hostnqn);
                    }
                }
                admin.sweep(poll.registry(), now);
                next_tick = now + tick;
            }
            let timeout = next_tick.saturating_duration_since(Instant::now());
            if let Err(e) = poll.poll(&mut events, Some(timeout)) {
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(DaemonError::Setup(e));
            }
            for ev in events.iter() {
                if ev.token() == SIGNALS {
                    for sig in signals.pending() {
                        if sig == SIGHUP {
                            warn!(self.log, "SIGHUP: reloading the configuration is not supported; restart the service to apply changes");
                        } else {
                            info!(self.log, "termination signal"; "signal" => sig);
                        }
                    }
                } else if (LISTENER_BASE..LISTENER_BASE + self.cm.len()).contains(&ev.token().0) {
                    self.cm_events(poll.registry(), ev.token().0 - LISTENER_BASE);
                } else if (ASYNC_BASE..ASYNC_BASE + self.async_devs.len()).contains(&ev.token().0) {
                    self.async_events(poll.registry(), ev.token().0 - ASYNC_BASE);
                } else if admin.owns(ev.token()) {
                    admin.on_event(poll.registry(), ev.token(), &mut |req, stats| {
                        self.answer(req, stats)
                    });
                }
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
        admin.shutdown(poll.registry());
        Ok(())
    }

    /// Opens a CM channel for `provider` (for soft, on the daemon's fabric, with a device at
    /// `addr` unless it has one).
    fn open_channel(
        &mut self,
        provider: nvmfd_config::Provider,
        addr: std::net::SocketAddr,
    ) -> Result<any::cm::CmChannel, String> {
        Ok(match provider {
            nvmfd_config::Provider::Soft => {
                let fabric = self
                    .soft_fabric
                    .get_or_insert_with(nvmfd_rdma::soft::Fabric::networked)
                    .clone();
                if fabric.device_at(addr.ip()).is_none() {
                    fabric.add_device(addr.ip()).map_err(|e| e.to_string())?;
                }
                any::cm::CmChannel::Soft(
                    nvmfd_rdma::soft::cm::CmChannel::new(&fabric).map_err(|e| e.to_string())?,
                )
            }
            nvmfd_config::Provider::Ibverbs => any::cm::CmChannel::Verbs(
                nvmfd_rdma::ibverbs::cm::CmChannel::new()
                    .map_err(|e| format!("{e} (is there an RDMA device?)"))?,
            ),
        })
    }

    /// Listener `i` listens at its address, on its CM channel (opened and watched the first
    /// time), and its device's async events are watched. The error says why not.
    fn listen(&mut self, registry: &Registry, i: usize) -> Result<(), String> {
        let l = self
            .cfg
            .listeners
            .get(i)
            .cloned()
            .ok_or_else(|| format!("no listener {i}"))?;
        let addr = std::net::SocketAddr::new(l.address, l.port);
        if self.cm.get(i).is_some_and(|c| c.channel.is_none()) {
            let ch = self.open_channel(l.provider, addr)?;
            registry
                .register(
                    &mut mio::unix::SourceFd(&ch.fd()),
                    Token(LISTENER_BASE + i),
                    mio::Interest::READABLE,
                )
                .map_err(|e| format!("cannot watch the CM channel: {e}"))?;
            if let Some(c) = self.cm.get_mut(i) {
                c.channel = Some(ch);
            }
        }
        let ch = self
            .cm
            .get(i)
            .and_then(|c| c.channel.as_ref())
            .ok_or_else(|| format!("no listener {i}"))?;
        let id = ch
            .listen(addr, 128)
            .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
        let dev = id.device().map_err(|e| e.to_string())?;
        self.watch_device(registry, &dev)
            .map_err(|e| format!("cannot watch the device's async events: {e}"))?;
        if let Some(c) = self.cm.get_mut(i) {
            c.id = Some(id);
            c.device = Some(dev);
        }
        Ok(())
    }

    /// Watches `dev`'s async event fd (SRQ limit, QP and device errors, port changes), unless
    /// it already is (listeners on one device share it).
    fn watch_device(&mut self, registry: &Registry, dev: &any::Device) -> std::io::Result<()> {
        let fd = dev.async_fd();
        if self.async_devs.iter().flatten().any(|d| d.async_fd() == fd) {
            return Ok(());
        }
        let slot = self
            .async_devs
            .iter()
            .position(Option::is_none)
            .unwrap_or(self.async_devs.len());
        registry.register(
            &mut mio::unix::SourceFd(&fd),
            Token(ASYNC_BASE + slot),
            mio::Interest::READABLE,
        )?;
        match self.async_devs.get_mut(slot) {
            Some(s) => *s = Some(dev.clone()),
            None => self.async_devs.push(Some(dev.clone())),
        }
        Ok(())
    }

    /// Sends every reactor the command `cmd` makes, and wakes it.
    fn tell_reactors(&self, mut cmd: impl FnMut() -> ReactorCmd) {
        for (r, tx) in self.inboxes.iter().enumerate() {
            if tx.send(cmd()).is_ok() {
                if let Some(h) = self.reactors.get(r) {
                    h.shared.wake();
                }
            }
        }
    }

    /// The addresses of the listeners served by the device whose async fd is `fd`.
    fn listeners_on(&self, fd: std::os::fd::RawFd) -> String {
        self.cm
            .iter()
            .zip(&self.listeners)
            .filter(|(c, _)| c.device.as_ref().is_some_and(|d| d.async_fd() == fd))
            .map(|(_, l)| format!("{}:{}", l.address, l.port))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Handles the CM events of listener `i`: connect requests are checked and handed to a
    /// reactor (round robin); the end of a connection is told to every reactor; a device
    /// removal (on the listening ID or on a connection) takes the whole device down.
    fn cm_events(&mut self, registry: &Registry, i: usize) {
        loop {
            let Some(ch) = self.cm.get(i).and_then(|c| c.channel.as_ref()) else {
                return;
            };
            let Some(ev) = ch.next_event() else { return };
            match ev {
                CmEvent::ConnectRequest {
                    id,
                    private_data,
                    initiator_depth,
                    ..
                } => {
                    if self.cm.get(i).is_none_or(|c| c.id.is_none()) {
                        // Queued before the listener stopped serving.
                        let _ = id.reject(&reject_private_data(
                            nvmfd_nvme::wire::rdma_cm_status::NO_RESOURCES,
                        ));
                        continue;
                    }
                    let limits = crate::serve::limits(&self.cfg);
                    match check_request(&private_data, &limits)
                        .map(|r| r.with_read_depth(initiator_depth))
                    {
                        Err(st) => {
                            warn!(self.log, "connect request refused"; "listener" => i, "status" => st);
                            let _ = id.reject(&reject_private_data(st));
                        }
                        Ok(req) => {
                            if self.inboxes.is_empty() {
                                let _ = id.reject(&reject_private_data(
                                    nvmfd_nvme::wire::rdma_cm_status::NO_RESOURCES,
                                ));
                                continue;
                            }
                            let r = self.next_reactor % self.inboxes.len();
                            self.next_reactor += 1;
                            match self.inboxes[r].send(ReactorCmd::Adopt {
                                listener: i,
                                id,
                                req,
                            }) {
                                Ok(()) => self.reactors[r].shared.wake(),
                                // The reactor is gone (it stopped or failed): the host hears
                                // a reject, and the ID is destroyed here.
                                Err(std::sync::mpsc::SendError(cmd)) => {
                                    warn!(self.log, "connect request refused: its reactor is gone"; "listener" => i, "reactor" => r);
                                    if let ReactorCmd::Adopt { id, .. } = cmd {
                                        let _ = id.reject(&reject_private_data(
                                            nvmfd_nvme::wire::rdma_cm_status::NO_RESOURCES,
                                        ));
                                    }
                                }
                            }
                        }
                    }
                }
                CmEvent::DeviceRemoval { id: token } => {
                    let c = self.cm.get(i);
                    let listening = c
                        .and_then(|c| c.id.as_ref())
                        .is_some_and(|l| l.token() == token);
                    let fd = c.and_then(|c| c.device.as_ref()).map(any::Device::async_fd);
                    if let Some(fd) = fd {
                        let cause = if listening {
                            "RDMA_CM_EVENT_DEVICE_REMOVAL on the listening ID"
                        } else {
                            "RDMA_CM_EVENT_DEVICE_REMOVAL on a connection"
                        };
                        self.device_removed(registry, fd, cause);
                    }
                    if !listening {
                        self.tell_reactors(|| ReactorCmd::Disconnected { token });
                    }
                }
                CmEvent::Disconnected { id } => {
                    self.tell_reactors(|| ReactorCmd::Disconnected { token: id });
                }
                // An accepted connection that failed before it was established: the reactor
                // that took it tears it down (its QP, CM ID and SRQ reservation go) and counts
                // it by cause. The reactors get this after the connection's Adopt (one inbox
                // each, in order).
                CmEvent::Rejected { id, .. } => self.tell_reactors(|| ReactorCmd::ConnectFailed {
                    token: id,
                    why: ConnectFailure::Rejected,
                }),
                CmEvent::Unreachable { id } => self.tell_reactors(|| ReactorCmd::ConnectFailed {
                    token: id,
                    why: ConnectFailure::Unreachable,
                }),
                CmEvent::ConnectError { id } => self.tell_reactors(|| ReactorCmd::ConnectFailed {
                    token: id,
                    why: ConnectFailure::ConnectError,
                }),
                CmEvent::Established { .. } | CmEvent::TimewaitExit { .. } => {}
            }
        }
    }

    /// Device `slot`'s async events: each goes to every reactor (the one whose SRQ or QP it
    /// names acts on it); a fatal one takes the whole device down.
    fn async_events(&mut self, registry: &Registry, slot: usize) {
        if self.route_async(slot) {
            let fd = self
                .async_devs
                .get(slot)
                .and_then(Option::as_ref)
                .map(any::Device::async_fd);
            if let Some(fd) = fd {
                self.device_removed(registry, fd, "IBV_EVENT_DEVICE_FATAL");
            }
        }
    }

    /// Reads device `slot`'s async events and hands each to every reactor; true when one was
    /// `DEVICE_FATAL`.
    fn route_async(&self, slot: usize) -> bool {
        let Some(Some(dev)) = self.async_devs.get(slot) else {
            return false;
        };
        let fd = dev.async_fd();
        let mut fatal = false;
        while let Some(event) = dev.next_event() {
            match event {
                AsyncEvent::SrqLimitReached(srq) => {
                    info!(self.log, "SRQ limit reached"; "srq" => srq)
                }
                // The end of a drain: as many as QPs torn down.
                AsyncEvent::QpLastWqeReached(qpn) => {
                    debug!(self.log, "LAST_WQE_REACHED"; "qpn" => qpn)
                }
                AsyncEvent::PortErr(port) => {
                    warn!(self.log, "port down (IBV_EVENT_PORT_ERR): connections through it fail, as rdma_cm reports";
                          "port" => port, "listeners" => self.listeners_on(fd))
                }
                AsyncEvent::PortActive(port) => {
                    info!(self.log, "port active (IBV_EVENT_PORT_ACTIVE)";
                          "port" => port, "listeners" => self.listeners_on(fd))
                }
                AsyncEvent::DeviceFatal => fatal = true,
                _ => warn!(self.log, "async event"; "event" => ?event),
            }
            self.tell_reactors(|| ReactorCmd::DeviceEvent {
                async_fd: fd,
                event,
            });
        }
        fatal
    }

    /// The device whose async fd is `fd` was removed or failed: its listeners stop serving
    /// (their listening IDs are kept until nothing made on the device is left, then let go of
    /// it), every reactor tears its data path there down, its async fd is no longer watched,
    /// and the listeners try to listen again every `RELISTEN_INTERVAL`. A second report of the
    /// same removal finds nothing left to do.
    fn device_removed(&mut self, registry: &Registry, fd: std::os::fd::RawFd, cause: &str) {
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
            let c = &mut self.cm[i];
            if c.device.as_ref().is_none_or(|d| d.async_fd() != fd) {
                continue;
            }
            // The control thread's own handles on the device go now (its async fd above).
            c.device = None;
            if let Some(id) = c.id.take() {
                c.retiring = Some(Retiring {
                    id,
                    since: now,
                    overdue: false,
                    failed: false,
                });
            }
            c.relisten_at = Some(now + RELISTEN_INTERVAL);
            c.relisten_error = None;
            c.device_removals += 1;
            if let Some(st) = self.listeners.get_mut(i) {
                st.serving = false;
                st.reason = Some(DEVICE_REMOVED.to_owned());
                warn!(self.log, "device removed: the listener stops serving and everything on the device is torn down; it listens again when the device returns";
                      "listener" => i, "address" => &st.address, "port" => st.port, "cause" => cause);
            }
            self.tell_reactors(|| ReactorCmd::RemoveDevice { listener: i });
            any = true;
        }
        if any {
            self.notifier.status(&self.status_line());
        }
    }

    /// Every tick: listeners whose device was removed let go of it once nothing made on it is
    /// left, then try to listen again every `RELISTEN_INTERVAL`.
    fn relisten(&mut self, registry: &Registry, now: Instant) {
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
                        info!(self.log, "listener still waiting for its device"; "listener" => i, "error" => &e);
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
    fn release_removed(&mut self, i: usize, now: Instant) {
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
    fn listener_returned(&mut self, i: usize) {
        let Some(c) = self.cm.get_mut(i) else { return };
        c.relisten_at = None;
        c.relisten_error = None;
        c.returns += 1;
        let Some(dev) = c.device.clone() else { return };
        if let Some(st) = self.listeners.get_mut(i) {
            st.serving = true;
            st.reason = None;
            info!(self.log, "device returned: the listener serves again";
                  "listener" => i, "address" => &st.address, "port" => st.port);
        }
        self.tell_reactors(|| ReactorCmd::AddPath {
            listener: i,
            device: dev.clone(),
        });
        self.notifier.status(&self.status_line());
    }

    /// Test hook: removes or restores listener `i`'s soft device.
    fn inject_fault(&self, fault: Fault, i: usize) -> Result<serde_json::Value, String> {
        let l = self
            .cfg
            .listeners
            .get(i)
            .ok_or_else(|| format!("no listener {i}"))?;
        if l.provider != nvmfd_config::Provider::Soft {
            return Err(format!(
                "listener {i} uses the {} provider: faults can be injected on the soft provider only",
                l.provider
            ));
        }
        let (fabric, dev) = self
            .soft_fabric
            .as_ref()
            .and_then(|f| Some((f, f.device_at(l.address)?)))
            .ok_or_else(|| format!("listener {i} has no soft device (it never listened)"))?;
        match fault {
            Fault::RemoveDevice => fabric.remove_device(&dev),
            Fault::RestoreDevice => fabric
                .restore_device(&dev)
                .map_err(|e| format!("listener {i}'s device cannot come back yet: {e}"))?,
        }
        warn!(self.log, "test hook: fault injected"; "fault" => ?fault, "listener" => i,
              "device" => %l.address);
        Ok(serde_json::json!({ "fault": fault, "listener": i, "device": l.address.to_string() }))
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
        let mut changed = false;
        for (hb, r) in self.heartbeats.iter_mut().zip(&self.reactors) {
            let c = &r.shared.counters;
            let turns = c.turns.load(Ordering::Relaxed);
            if turns != hb.last_turns {
                hb.last_turns = turns;
                hb.last_move = now;
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

    fn answer(&self, req: Request, admin: &AdminStats) -> Response {
        let json = |v: Result<serde_json::Value, serde_json::Error>| match v {
            Ok(v) => Response::data(v),
            Err(e) => Response::error(format!("internal error: {e}")),
        };
        match req {
            Request::Status {} => json(serde_json::to_value(self.status())),
            Request::Stats {} => json(serde_json::to_value(self.stats(admin))),
            Request::Config {} => json(serde_json::to_value(&self.cfg)),
            Request::DebugStallReactor { reactor, ms } => {
                if !self.test_hooks {
                    return Response::error(format!("debug requests need {TEST_HOOKS_ENV}=1"));
                }
                match self.reactors.get(reactor) {
                    Some(r) => {
                        r.shared.stall_for(ms);
                        Response::data(serde_json::json!({ "stalled_reactor": reactor, "ms": ms }))
                    }
                    None => Response::error(format!("no reactor {reactor}")),
                }
            }
            Request::DebugFault { fault, listener } => {
                if !self.test_hooks {
                    return Response::error(format!("debug requests need {TEST_HOOKS_ENV}=1"));
                }
                match self.inject_fault(fault, listener) {
                    Ok(v) => Response::data(v),
                    Err(e) => Response::error(e),
                }
            }
        }
    }

    fn status(&self) -> Status {
        Status {
            version: env!("CARGO_PKG_VERSION").to_owned(),
            pid: std::process::id(),
            state: if self.stopping { "stopping" } else { "running" }.to_owned(),
            uptime_seconds: self.started.elapsed().as_secs(),
            watchdog_usec: self
                .notifier
                .watchdog_interval()
                .map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX)),
            reactors: self
                .reactors
                .iter()
                .map(|r| ReactorStatus {
                    id: r.shared.id,
                    core: r.shared.core,
                    stalled: r.shared.counters.stalled.load(Ordering::Relaxed),
                })
                .collect(),
            listeners: self.listeners.clone(),
            subsystems: self
                .cfg
                .subsystems
                .iter()
                .map(|s| SubsystemStatus {
                    nqn: s.nqn.clone(),
                    namespaces: s.namespaces.len(),
                    allow_any_host: s.allow_any_host,
                    hosts: s.hosts.clone(),
                })
                .collect(),
        }
    }

    fn stats(&self, admin: &AdminStats) -> Stats {
        Stats {
            uptime_seconds: self.started.elapsed().as_secs(),
            reactors: self
                .reactors
                .iter()
                .map(|r| r.shared.counters.snapshot(r.shared.id, r.shared.core))
                .collect(),
            datapath: self
                .dp_counters
                .iter()
                .enumerate()
                .map(|(i, c)| c.snapshot(i))
                .collect(),
            listeners: self
                .listeners
                .iter()
                .zip(&self.cm)
                .enumerate()
                .map(|(i, (st, c))| ListenerStats {
                    id: i,
                    address: format!("{}:{}", st.address, st.port),
                    provider: st.provider.clone(),
                    serving: st.serving,
                    device_removals_total: c.device_removals,
                    returns_total: c.returns,
                })
                .collect(),
            admin: admin.clone(),
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
