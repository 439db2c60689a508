//! Reactor threads: one per configured core, pinned, each running a poll loop.
//!
//! The loop busy-polls its work sources and, after `idle_sleep_after` without work, sleeps on a
//! `mio::Poll` (adaptive polling) until woken or until a bounded timeout, so its heartbeat keeps
//! moving while it is healthy. The data path adds its sources through `ReactorWork`.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mio::{Events, Poll, Token, Waker};
use slog::{debug, error, info, o, Logger};

use crate::stats::ReactorCounters;

const WAKE: Token = Token(0);

/// What the control thread shares with one reactor.
#[derive(Debug)]
pub struct ReactorShared {
    /// Reactor index.
    pub id: usize,
    /// Core it is pinned to.
    pub core: usize,
    /// Its counters (the heartbeat is `counters.turns`).
    pub counters: ReactorCounters,
    stop: AtomicBool,
    /// Test hook: milliseconds the reactor must stall for at its next turn.
    stall_ms: AtomicU64,
    /// Test hook: ends a stall early.
    stall_release: AtomicBool,
    waker: Waker,
}

impl ReactorShared {
    /// Wakes the reactor if it sleeps (new work in its inbox).
    pub fn wake(&self) {
        let _ = self.waker.wake();
    }

    /// Asks the reactor to stop, and wakes it if it sleeps.
    pub fn request_stop(&self) {
        self.stop.store(true, Ordering::Release);
        let _ = self.waker.wake();
    }

    /// Makes the reactor block for `ms` milliseconds in its next turn, as a stuck data path
    /// would (tests of the watchdog only; the admin socket exposes it only with
    /// `NVMFD_TEST_HOOKS=1`).
    /// `ms = 0` ends a stall in progress.
    pub fn stall_for(&self, ms: u64) {
        if ms == 0 {
            self.stall_release.store(true, Ordering::Relaxed);
        }
        self.stall_ms.store(ms, Ordering::Relaxed);
        let _ = self.waker.wake();
    }
}

/// What a reactor polls: its data path. Built on the reactor's own thread (it owns
/// thread-bound resources such as its io_uring).
pub trait ReactorWork {
    /// One pass over the work sources at `now` (the turn's one reading of the clock); true
    /// when there was work.
    fn poll(&mut self, now: Instant) -> bool;
    /// Fds that turn readable when work arrives (completion channels); the reactor sleeps on
    /// them when idle.
    fn wake_fds(&self) -> Vec<std::os::fd::RawFd>;
    /// Whether `wake_fds` has new fds since the last call (a data path was added); the
    /// reactor then watches them too. Fds that close leave the poller by themselves.
    fn wake_fds_changed(&mut self) -> bool {
        false
    }
    /// Arms the wake-up sources before sleeping; false when the reactor must not sleep
    /// (operations in flight that only polling completes).
    fn prepare_sleep(&mut self) -> bool;
}

/// Builds a reactor's work on its thread.
pub type WorkFactory = Box<dyn FnOnce() -> Box<dyn ReactorWork> + Send>;

/// Tunables of the poll loop.
#[derive(Clone, Copy, Debug)]
pub struct LoopConfig {
    /// Idle time after which the reactor sleeps instead of spinning; zero never sleeps.
    pub idle_sleep_after: Duration,
    /// Longest sleep, so that the heartbeat moves at least this often.
    pub max_sleep: Duration,
}

/// A running reactor thread.
#[derive(Debug)]
pub struct ReactorHandle {
    /// State shared with the thread.
    pub shared: Arc<ReactorShared>,
    thread: Option<JoinHandle<()>>,
    /// Says when the thread has built its work and entered its loop.
    running: Option<std::sync::Mutex<std::sync::mpsc::Receiver<()>>>,
}

/// Why a reactor could not start.
#[derive(Debug, thiserror::Error)]
pub enum ReactorError {
    /// the wake-up source could not be created
    #[error("reactor {id}: cannot create its poller: {source}")]
    Poll {
        /// Reactor index.
        id: usize,
        /// Why.
        source: std::io::Error,
    },
    /// the thread could not be spawned
    #[error("reactor {id}: cannot spawn its thread: {source}")]
    Spawn {
        /// Reactor index.
        id: usize,
        /// Why.
        source: std::io::Error,
    },
    /// the thread did not finish building its data paths in time
    #[error("reactor {id}: did not finish setting up its data paths within {waited:?}")]
    Setup {
        /// Reactor index.
        id: usize,
        /// How long it was given.
        waited: Duration,
    },
    /// the thread ended while it built its data paths
    #[error("reactor {id}: its thread ended while it set up its data paths")]
    SetupEnded {
        /// Reactor index.
        id: usize,
    },
    /// the thread could not be pinned to its core
    #[error("reactor {id}: cannot pin its thread to core {core}")]
    Pin {
        /// Reactor index.
        id: usize,
        /// The core.
        core: usize,
    },
}

impl ReactorHandle {
    /// Starts reactor `id` pinned to `core`, and returns once it is pinned and running.
    pub fn spawn(
        id: usize,
        core: usize,
        cfg: LoopConfig,
        log: &Logger,
        work: Option<WorkFactory>,
    ) -> Result<Self, ReactorError> {
        let poll = Poll::new().map_err(|source| ReactorError::Poll { id, source })?;
        let waker = Waker::new(poll.registry(), WAKE)
            .map_err(|source| ReactorError::Poll { id, source })?;
        let shared = Arc::new(ReactorShared {
            id,
            core,
            counters: ReactorCounters::default(),
            stop: AtomicBool::new(false),
            stall_ms: AtomicU64::new(0),
            stall_release: AtomicBool::new(false),
            waker,
        });
        let log = log.new(o!("reactor" => id, "core" => core));
        let (started_tx, started_rx) = std::sync::mpsc::sync_channel::<bool>(1);
        let (running_tx, running_rx) = std::sync::mpsc::sync_channel::<()>(1);
        let thread_shared = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name(format!("nvmfd-r{id}"))
            .spawn(move || {
                let pinned = core_affinity::set_for_current(core_affinity::CoreId { id: core });
                let _ = started_tx.send(pinned);
                if pinned {
                    // Building the work (registering its pools with the device) can take
                    // seconds on a large pool: the loop, and with it the heartbeat, starts
                    // after it.
                    let work = work.map(|f| f());
                    run(&thread_shared, poll, cfg, &log, work, running_tx);
                }
            })
            .map_err(|source| ReactorError::Spawn { id, source })?;
        let mut handle = ReactorHandle {
            shared,
            thread: Some(thread),
            running: Some(std::sync::Mutex::new(running_rx)),
        };
        if started_rx.recv() != Ok(true) {
            handle.join();
            return Err(ReactorError::Pin { id, core });
        }
        Ok(handle)
    }

    /// Waits until `deadline` for the thread to build its work and enter its loop (at once
    /// once it has).
    pub fn wait_running(&mut self, deadline: Instant) -> Setup {
        let Some(rx) = self.running.as_ref() else {
            return Setup::Running;
        };
        let got = rx
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .recv_timeout(deadline.saturating_duration_since(Instant::now()));
        match got {
            Ok(()) => {
                self.running = None;
                Setup::Running
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Setup::TimedOut,
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Setup::Ended,
        }
    }

    /// Lets go of a thread still building its work (which does not look at the stop flag):
    /// it is not waited for at stop, and the process leaves with `_exit`
    /// ([`reactors_abandoned`]). One that entered its loop or ended meanwhile is stopped and
    /// joined as usual.
    pub fn abandon_if_not_running(&mut self) {
        if self.running.is_some()
            && matches!(self.wait_running(Instant::now()), Setup::TimedOut)
            && self.thread.take().is_some()
        {
            ABANDONED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Waits for the thread to end (after `request_stop`).
    pub fn join(&mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Registers the work's wake-up fds with the reactor's poller (those already registered
/// stay). False when one cannot be: the reactor then polls without sleeping, and tries
/// again (`UNWATCHED_RETRY`), for a completion on it would raise no event.
fn watch(poll: &Poll, work: &dyn ReactorWork, log: &Logger, logged: &mut bool) -> bool {
    let mut all = true;
    for fd in work.wake_fds() {
        let r = poll.registry().register(
            &mut mio::unix::SourceFd(&fd),
            Token(1),
            mio::Interest::READABLE,
        );
        match r {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => {
                all = false;
                if !std::mem::replace(logged, true) {
                    error!(log, "cannot watch a completion channel; polling without sleeping until it can be"; "error" => %e);
                }
            }
        }
    }
    if all && std::mem::take(logged) {
        info!(
            log,
            "completion channels watched again; the reactor sleeps when idle"
        );
    }
    all
}

/// How often a reactor that could not watch a wake-up fd tries again.
const UNWATCHED_RETRY: Duration = Duration::from_secs(1);

/// Reactor threads let go while still building their work ([`ReactorHandle::abandon_if_not_running`]).
static ABANDONED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Reactor threads let go while still building their work (registering memory, say): the
/// process must leave with `_exit`, not run the libraries' destructors under them.
pub fn reactors_abandoned() -> usize {
    ABANDONED.load(std::sync::atomic::Ordering::Relaxed)
}

/// How a reactor's start went ([`ReactorHandle::wait_running`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Setup {
    /// It built its work and runs its loop.
    Running,
    /// Still building its work at the deadline.
    TimedOut,
    /// Its thread ended before it ran its loop.
    Ended,
}

/// The poll loop; `running` says it has started, once it has.
fn run(
    shared: &ReactorShared,
    mut poll: Poll,
    cfg: LoopConfig,
    log: &Logger,
    mut work: Option<Box<dyn ReactorWork>>,
    running: std::sync::mpsc::SyncSender<()>,
) {
    info!(log, "reactor started");
    let _ = running.send(());
    // A wake-up fd the poller does not watch, and when to try again.
    let mut watch_failed = false;
    let mut unwatched: Option<Instant> = None;
    if let Some(w) = &work {
        if !watch(&poll, w.as_ref(), log, &mut watch_failed) {
            unwatched = Some(Instant::now() + UNWATCHED_RETRY);
        }
    }
    let c = &shared.counters;
    let mut events = Events::with_capacity(16);
    // When the current run of idle turns began (none while there is work): the start of the
    // first idle turn after work, so a long busy turn does not count as idle time.
    let mut idle_since: Option<Instant> = None;
    loop {
        ReactorCounters::bump(&c.turns);
        if shared.stop.load(Ordering::Acquire) {
            break;
        }
        let stall = shared.stall_ms.swap(0, Ordering::Relaxed);
        if stall > 0 {
            shared.stall_release.store(false, Ordering::Relaxed);
            error!(log, "test hook: reactor stalling"; "ms" => stall);
            // Bounded at an hour: a clock past its range would panic the reactor.
            let end = Instant::now() + Duration::from_millis(stall.min(3_600_000));
            while Instant::now() < end && !shared.stall_release.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(1));
            }
            info!(log, "test hook: reactor stall over");
            continue;
        }
        // One clock reading a turn: the work's, and the idle time's.
        let now = Instant::now();
        if work.as_mut().is_some_and(|w| w.poll(now)) {
            ReactorCounters::bump(&c.busy_turns);
            idle_since = None;
            continue;
        }
        let since = *idle_since.get_or_insert(now);
        if let Some(w) = work.as_mut() {
            let retry = unwatched.is_some_and(|at| now >= at);
            if w.wake_fds_changed() || retry {
                unwatched = (!watch(&poll, w.as_ref(), log, &mut watch_failed))
                    .then(|| now + UNWATCHED_RETRY);
            }
        }
        // A completion on an fd not watched would raise no event: no sleep.
        if unwatched.is_some() {
            continue;
        }
        // Busy-poll for `idle_sleep_after` after the last work: a host that sends its next
        // command within microseconds finds the reactor awake, and an idle turn makes no
        // system call.
        if cfg.idle_sleep_after.is_zero()
            || now.saturating_duration_since(since) < cfg.idle_sleep_after
        {
            continue;
        }
        // About to sleep: arm the wake-up sources (false: operations in flight that only
        // polling completes).
        if !work.as_mut().is_none_or(|w| w.prepare_sleep()) {
            continue;
        }
        // A completion that landed between the last poll and the arming raised no event:
        // look once more, now that any later one will.
        let now = Instant::now();
        if work.as_mut().is_some_and(|w| w.poll(now)) {
            ReactorCounters::bump(&c.busy_turns);
            ReactorCounters::bump(&c.caught_before_sleep);
            idle_since = None;
            continue;
        }
        ReactorCounters::bump(&c.sleeps);
        if let Err(e) = poll.poll(&mut events, Some(cfg.max_sleep)) {
            if e.kind() != std::io::ErrorKind::Interrupted {
                error!(log, "reactor poller failed; spinning instead"; "error" => %e);
                std::thread::yield_now();
            }
        }
        debug!(log, "reactor woke"; "events" => events.iter().count());
    }
    info!(log, "reactor stopped"; "turns" => c.turns.load(Ordering::Relaxed));
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, AtomicU64};

    /// A reactor running `factory`'s work that sleeps after 1 ms idle, for up to 30 s: a
    /// lost wake-up shows as a wait of that long.
    fn spawn_sleeping_long(factory: WorkFactory) -> ReactorHandle {
        let cfg = LoopConfig {
            idle_sleep_after: Duration::from_millis(1),
            max_sleep: Duration::from_secs(30),
        };
        let log = Logger::root(slog::Discard, o!());
        ReactorHandle::spawn(0, 0, cfg, &log, Some(factory)).unwrap()
    }

    /// Waits (10 s at most) until `served` is set; returns how long that took.
    fn wait_served(served: &AtomicBool) -> Duration {
        let start = Instant::now();
        while !served.load(Ordering::Acquire) && start.elapsed() < Duration::from_secs(10) {
            std::thread::yield_now();
        }
        start.elapsed()
    }

    /// Work whose completion lands at the worst instant: after the reactor's last poll found
    /// nothing and just before it arms the wake-up sources, so no event will ever say so.
    struct LandsWhileArming {
        arms: Arc<AtomicU32>,
        pending: bool,
        served: Arc<AtomicBool>,
    }

    impl ReactorWork for LandsWhileArming {
        fn poll(&mut self, _now: Instant) -> bool {
            if std::mem::take(&mut self.pending) {
                self.served.store(true, Ordering::Release);
                return true;
            }
            false
        }
        fn wake_fds(&self) -> Vec<std::os::fd::RawFd> {
            Vec::new()
        }
        fn prepare_sleep(&mut self) -> bool {
            if self.arms.fetch_add(1, Ordering::Relaxed) == 0 {
                self.pending = true;
            }
            true
        }
    }

    #[test]
    fn a_completion_that_lands_while_the_reactor_arms_is_served_without_waiting_for_the_sleep_bound(
    ) {
        let arms = Arc::new(AtomicU32::new(0));
        let served = Arc::new(AtomicBool::new(false));
        let (a, s) = (Arc::clone(&arms), Arc::clone(&served));
        let factory: WorkFactory = Box::new(move || {
            Box::new(LandsWhileArming {
                arms: a,
                pending: false,
                served: s,
            })
        });
        let mut r = spawn_sleeping_long(factory);
        let waited = wait_served(&served);
        r.shared.request_stop();
        r.join();
        assert!(
            served.load(Ordering::Acquire),
            "the completion that landed while arming was not served in {waited:?}: the reactor slept on it"
        );
        assert_eq!(
            r.shared
                .counters
                .caught_before_sleep
                .load(Ordering::Relaxed),
            1
        );
    }
    /// Work whose wake-up fd the poller cannot watch (a regular file: epoll refuses it) and
    /// whose completion comes from another thread once the reactor is idle: with the fd
    /// unwatched, the reactor slept until `max_sleep` on it.
    struct Unwatchable {
        fd: std::fs::File,
        ready: Arc<AtomicBool>,
        served: Arc<AtomicBool>,
        /// When it was first polled, and how long (ms) it has been polled since.
        first: Option<Instant>,
        idle_ms: Arc<AtomicU64>,
    }

    impl ReactorWork for Unwatchable {
        fn poll(&mut self, now: Instant) -> bool {
            let first = *self.first.get_or_insert(now);
            let idle = now.saturating_duration_since(first).as_millis();
            self.idle_ms
                .store(u64::try_from(idle).unwrap_or(u64::MAX), Ordering::Relaxed);
            if self.ready.swap(false, Ordering::AcqRel) {
                self.served.store(true, Ordering::Release);
                return true;
            }
            false
        }
        fn wake_fds(&self) -> Vec<std::os::fd::RawFd> {
            use std::os::fd::AsRawFd;
            vec![self.fd.as_raw_fd()]
        }
        fn prepare_sleep(&mut self) -> bool {
            true
        }
    }

    #[test]
    fn a_reactor_that_cannot_watch_a_wake_up_fd_polls_instead_of_sleeping_on_it() {
        let ready = Arc::new(AtomicBool::new(false));
        let served = Arc::new(AtomicBool::new(false));
        let file = tempfile::tempfile().unwrap();
        let idle_ms = Arc::new(AtomicU64::new(0));
        let (r2, s2, i2) = (
            Arc::clone(&ready),
            Arc::clone(&served),
            Arc::clone(&idle_ms),
        );
        let factory: WorkFactory = Box::new(move || {
            Box::new(Unwatchable {
                fd: file,
                ready: r2,
                served: s2,
                first: None,
                idle_ms: i2,
            })
        });
        let mut r = spawn_sleeping_long(factory);
        // Idle ten times `idle_sleep_after` (1 ms) by its own polls, or asleep: a reactor
        // that sleeps on the fd is asleep by then.
        let start = Instant::now();
        while idle_ms.load(Ordering::Relaxed) < 10
            && r.shared.counters.sleeps.load(Ordering::Relaxed) == 0
        {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "the reactor never polled"
            );
            std::thread::yield_now();
        }
        ready.store(true, Ordering::Release);
        let waited = wait_served(&served);
        r.shared.request_stop();
        r.join();
        assert!(
            served.load(Ordering::Acquire),
            "not served in {waited:?}: the reactor slept on an fd it does not watch"
        );
        assert_eq!(r.shared.counters.sleeps.load(Ordering::Relaxed), 0);
    }

    /// Work whose first turn is long (200 ms, a rebuild, say), then idle: it counts the idle
    /// turns before the reactor first arms to sleep.
    struct LongTurnThenIdle {
        first: bool,
        idle_polls: u32,
        idle_before_arming: Arc<AtomicU32>,
    }

    impl ReactorWork for LongTurnThenIdle {
        fn poll(&mut self, _now: Instant) -> bool {
            if std::mem::take(&mut self.first) {
                std::thread::sleep(Duration::from_millis(200));
                return true;
            }
            self.idle_polls += 1;
            false
        }
        fn wake_fds(&self) -> Vec<std::os::fd::RawFd> {
            Vec::new()
        }
        fn prepare_sleep(&mut self) -> bool {
            let _ = self.idle_before_arming.compare_exchange(
                u32::MAX,
                self.idle_polls,
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
            true
        }
    }

    #[test]
    fn a_long_busy_turn_is_not_counted_as_idle_time() {
        let seen = Arc::new(AtomicU32::new(u32::MAX));
        let s = Arc::clone(&seen);
        let factory: WorkFactory = Box::new(move || {
            Box::new(LongTurnThenIdle {
                first: true,
                idle_polls: 0,
                idle_before_arming: s,
            })
        });
        let cfg = LoopConfig {
            idle_sleep_after: Duration::from_millis(20),
            max_sleep: Duration::from_millis(50),
        };
        let log = Logger::root(slog::Discard, o!());
        let mut r = ReactorHandle::spawn(0, 0, cfg, &log, Some(factory)).unwrap();
        let start = Instant::now();
        while seen.load(Ordering::Relaxed) == u32::MAX && start.elapsed() < Duration::from_secs(10)
        {
            std::thread::yield_now();
        }
        r.shared.request_stop();
        r.join();
        // 20 ms of idle turns come first (each well under a microsecond of work), where a
        // reactor counting the long turn as idle time armed at the first idle turn.
        let idle = seen.load(Ordering::Relaxed);
        assert!(
            idle != u32::MAX && idle >= 10,
            "armed after {idle} idle turns"
        );
    }
}
