//! Work the control thread runs on threads of its own (opening or resizing an RBD image on a
//! cluster that may not answer) while it keeps feeding the watchdog, and the count of such work
//! still running, which the daemon waits for before it exits.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;

use super::*;

/// How long a change may wait for a device (opening, resizing) with no sign of progress while
/// the control thread still feeds the watchdog: longer than the store's own timeouts (an RBD
/// client's 10 s mount and operation timeouts by default), after which the wait is taken for a hang.
/// An operation that reports progress (an RBD shrink deleting the objects past the new end,
/// minutes for a large tail) starts it again with each report.
const KEEP_WATCH_MAX: Duration = Duration::from_secs(60);

/// How long a hosts' connection request waits at most while a change waits.
const MEANWHILE_SLICE: Duration = Duration::from_millis(20);

/// While a stop waits for a change under way: how often the service manager's stop timeout is
/// extended, and by how much each time.
const STOP_EXTEND_EVERY: Duration = Duration::from_secs(1);
const STOP_EXTEND_BY: Duration = Duration::from_secs(5);

/// Test hook (with test hooks on): [`KEEP_WATCH_MAX`] in milliseconds.
pub(super) const TEST_KEEP_WATCH_ENV: &str = "NVMFD_TEST_KEEP_WATCH_MS";

/// Operations started off the control thread (`off_thread`) that have not returned yet: one
/// whose caller stopped waiting at its deadline goes on alone, possibly inside librbd.
static OFF_THREAD_RUNNING: AtomicUsize = AtomicUsize::new(0);

/// Counts an operation off the control thread as running until it is dropped.
struct Running;

impl Running {
    fn start() -> Running {
        OFF_THREAD_RUNNING.fetch_add(1, Ordering::AcqRel);
        Running
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        OFF_THREAD_RUNNING.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Operations started off the control thread and still running.
pub fn off_thread_running() -> usize {
    OFF_THREAD_RUNNING.load(Ordering::Acquire)
}

/// Waits until no operation started off the control thread is still running, or `timeout`:
/// whether none is. The daemon waits for them before it exits: one can be inside librbd,
/// under which the libraries' static destructors, run by `exit`, can crash the process.
pub fn wait_off_thread(timeout: Duration) -> bool {
    let end = Instant::now() + timeout;
    while off_thread_running() > 0 {
        if Instant::now() >= end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    true
}

/// Runs `f` on a thread of its own, counted as running (`off_thread_running`) until it
/// returns; its result comes on the receiver.
pub(crate) fn spawn_counted<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<mpsc::Receiver<T>, String> {
    let (tx, rx) = mpsc::channel();
    let running = Running::start();
    std::thread::Builder::new()
        .name("nvmfd-change".into())
        .spawn(move || {
            let _running = running;
            let _ = tx.send(f());
        })
        .map_err(|e| format!("cannot start a thread: {e}"))?;
    Ok(rx)
}

impl Daemon {
    /// Runs `f` on a thread of its own and waits for it, keeping the watch meanwhile
    /// (`wait_keeping_watch`): for what can block for long (opening or resizing an RBD image
    /// on a cluster that does not answer).
    pub(super) fn off_thread<T: Send + 'static>(
        &mut self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, String> {
        self.off_thread_until(f, None)
    }

    /// `off_thread`, waiting only until `deadline` (if any): `f` then goes on alone, and
    /// its result is dropped.
    pub(super) fn off_thread_until<T: Send + 'static>(
        &mut self,
        f: impl FnOnce() -> T + Send + 'static,
        deadline: Option<Instant>,
    ) -> Result<T, String> {
        let rx = spawn_counted(f)?;
        self.wait_keeping_watch(&rx, deadline, None)
            .map_err(|_| "the operation ended without an answer".to_owned())
    }

    /// `off_thread` for an operation whose progress `progress` reports (a count that moves
    /// while it works): the watch is kept as long as it moves.
    pub(super) fn off_thread_progress<T: Send + 'static>(
        &mut self,
        f: impl FnOnce() -> T + Send + 'static,
        progress: impl Fn() -> u64,
    ) -> Result<T, String> {
        let rx = spawn_counted(f)?;
        self.wait_keeping_watch(&rx, None, Some(&progress))
            .map_err(|_| "the operation ended without an answer".to_owned())
    }

    /// Waits for `rx` (until `deadline`, if any) while checking the reactors' heartbeats
    /// every tick, which feeds systemd's watchdog as long as they move: a change that waits
    /// for a slow device does not make the service manager end a daemon that serves. Hosts'
    /// connections, the devices' events and keep-alives are served meanwhile
    /// (`serve_meanwhile`), every [`MEANWHILE_SLICE`].
    pub(super) fn wait_keeping_watch<T>(
        &mut self,
        rx: &mpsc::Receiver<T>,
        deadline: Option<Instant>,
        progress: Option<&dyn Fn() -> u64>,
    ) -> Result<T, mpsc::RecvTimeoutError> {
        let tick = self.tick_interval().min(MEANWHILE_SLICE);
        let keep_max = self.test_ms(TEST_KEEP_WATCH_ENV).unwrap_or(KEEP_WATCH_MAX);
        let mut began = Instant::now();
        let mut seen = progress.map(|p| p());
        // A stop asked for meanwhile waits for the change to end (a resize cut off half-way
        // is worse); the service manager is told, and given more time while it goes on.
        let (mut stop_told, mut extended_at): (bool, Option<Instant>) = (false, None);
        loop {
            let now = Instant::now();
            let slice = deadline.map_or(tick, |d| tick.min(d.saturating_duration_since(now)));
            match rx.recv_timeout(slice) {
                Err(mpsc::RecvTimeoutError::Timeout)
                    if deadline.is_none_or(|d| Instant::now() < d) =>
                {
                    // A wait past any timeout of the store (a hard NFS mount, an RBD
                    // configuration without op timeouts) with no progress is a hang: the
                    // watchdog is no longer fed, and the service manager restarts the daemon
                    // as it did before.
                    let now_seen = progress.map(|p| p());
                    if now_seen != seen {
                        seen = now_seen;
                        began = Instant::now();
                    }
                    let alive = began.elapsed() < keep_max;
                    if alive {
                        self.check_heartbeats(Instant::now());
                    }
                    if self.term.load(std::sync::atomic::Ordering::Relaxed) {
                        if !stop_told {
                            stop_told = true;
                            info!(self.log, "stopping once the change under way ends");
                            self.notifier
                                .stopping("stopping once the change under way ends");
                        }
                        // While it moves (a hung one is left to the stop timeout).
                        if alive && extended_at.is_none_or(|at| at.elapsed() >= STOP_EXTEND_EVERY) {
                            self.notifier.extend_timeout(STOP_EXTEND_BY);
                            extended_at = Some(Instant::now());
                        }
                    }
                    self.serve_meanwhile(Instant::now());
                }
                other => return other,
            }
        }
    }
}

/// Test hook (with test hooks on): a directory where work the control thread waits for off
/// its thread stops, creating `NAME-waiting` and then waiting (up to a minute) until
/// `NAME-go` is there: each resize (`resize`), and the RBD handles opened ahead of a
/// listener's new data paths (`prepare`, bounded by its 2 s wait; taken with no RBD
/// namespace too). Work held as long as a test needs.
pub const TEST_GATE_ENV: &str = "NVMFD_TEST_GATE";

impl Daemon {
    /// The [`TEST_GATE_ENV`] directory, with test hooks on.
    pub(super) fn test_gate(&self) -> Option<std::path::PathBuf> {
        self.test_hooks
            .then(|| std::env::var_os(TEST_GATE_ENV))
            .flatten()
            .map(std::path::PathBuf::from)
    }
}

/// [`wait_at_gate`] where a test asked for it (`{name}-hold` in the gate's directory): a
/// gate on the way of every change, which other tests pass.
pub(super) fn wait_at_gate_if_held(dir: &std::path::Path, name: &str) {
    if dir.join(format!("{name}-hold")).exists() {
        wait_at_gate(dir, name);
    }
}

pub(super) fn wait_at_gate(dir: &std::path::Path, name: &str) {
    let _ = std::fs::write(dir.join(format!("{name}-waiting")), b"");
    let go = dir.join(format!("{name}-go"));
    let until = Instant::now() + Duration::from_secs(60);
    while !go.exists() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(5));
    }
}
