//! systemd's notification protocol (`sd_notify`): READY, STATUS, WATCHDOG, STOPPING.
//!
//! Without `NOTIFY_SOCKET` every call is a no-op, so the daemon runs the same by hand.

use std::time::Duration;

use sd_notify::NotifyState;
use slog::{warn, Logger};

/// Sends notifications to the service manager, logging (not failing on) delivery errors.
#[derive(Debug)]
pub struct Notifier {
    log: Logger,
    watchdog: Option<Duration>,
}

impl Notifier {
    /// A notifier; reads `WATCHDOG_USEC`/`WATCHDOG_PID` once.
    pub fn new(log: Logger) -> Self {
        Self {
            log,
            watchdog: sd_notify::watchdog_enabled(),
        }
    }

    /// The watchdog interval systemd expects keep-alives within, when it is enabled.
    pub fn watchdog_interval(&self) -> Option<Duration> {
        self.watchdog
    }

    fn send(&self, what: &str, states: &[NotifyState<'_>]) {
        if let Err(e) = sd_notify::notify(states) {
            warn!(self.log, "cannot notify the service manager"; "what" => what, "error" => %e);
        }
    }

    /// READY=1 with a STATUS line.
    pub fn ready(&self, status: &str) {
        self.send("READY", &[NotifyState::Ready, NotifyState::Status(status)]);
    }

    /// STATUS=...
    pub fn status(&self, status: &str) {
        self.send("STATUS", &[NotifyState::Status(status)]);
    }

    /// WATCHDOG=1 (only when the watchdog is enabled).
    pub fn watchdog(&self) {
        if self.watchdog.is_some() {
            self.send("WATCHDOG", &[NotifyState::Watchdog]);
        }
    }

    /// EXTEND_TIMEOUT_USEC: the service manager waits `by` more (for the start, or for the
    /// stop, whichever is under way) before it gives up on the daemon. Sent again before it
    /// passes, as long as the wait goes on.
    pub fn extend_timeout(&self, by: Duration) {
        let usec = u32::try_from(by.as_micros()).unwrap_or(u32::MAX);
        self.send("EXTEND_TIMEOUT", &[NotifyState::ExtendTimeoutUsec(usec)]);
    }

    /// STOPPING=1 with a STATUS line.
    pub fn stopping(&self, status: &str) {
        self.send(
            "STOPPING",
            &[NotifyState::Stopping, NotifyState::Status(status)],
        );
    }
}
