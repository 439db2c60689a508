//! A reactor's data paths (one per listener's device) and the commands the control thread
//! sends them: connections to adopt, ends of connections, device events.

use std::time::Instant;

use nvmfd_nvme::rdma_cm::CmRequest;
use nvmfd_rdma::any::cm::CmId;
use nvmfd_rdma::AsyncEvent;

use crate::datapath::{DataPath, DRAIN_TIMEOUT};
use crate::srq::Change;

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
    /// An async event of the device whose async fd is `async_fd`.
    DeviceEvent {
        /// Which device.
        async_fd: std::os::fd::RawFd,
        /// What happened.
        event: AsyncEvent,
    },
}

/// A reactor's data paths (one per listener's device) and its inbox.
#[derive(Debug)]
pub struct ReactorPaths {
    /// One per listener, in listener order (`None` where the listener is not serving).
    pub paths: Vec<Option<DataPath>>,
    /// Connections from the control thread.
    pub inbox: std::sync::mpsc::Receiver<ReactorCmd>,
    /// Where to report what the control thread must know (not used yet).
    pub log: slog::Logger,
}

impl Drop for ReactorPaths {
    /// The daemon is stopping: every QP goes through the teardown path and the reactor waits
    /// (bounded by `DRAIN_TIMEOUT`) for the drains before its data paths are destroyed.
    fn drop(&mut self) {
        let now = Instant::now();
        let mut qps = 0;
        for dp in self.paths.iter_mut().flatten() {
            qps += dp.connections();
            dp.shutdown(now);
        }
        if qps == 0 {
            return;
        }
        while self.paths.iter().flatten().any(|dp| dp.draining() > 0)
            && now.elapsed() < DRAIN_TIMEOUT
        {
            for dp in self.paths.iter_mut().flatten() {
                dp.poll(Instant::now());
            }
            std::thread::yield_now();
        }
        let left: usize = self.paths.iter().flatten().map(DataPath::draining).sum();
        slog::info!(self.log, "QPs torn down at shutdown"; "qps" => qps, "not_drained" => left);
    }
}

impl crate::reactor::ReactorWork for ReactorPaths {
    fn poll(&mut self) -> bool {
        let mut worked = false;
        while let Ok(cmd) = self.inbox.try_recv() {
            worked = true;
            match cmd {
                ReactorCmd::Adopt { listener, id, req } => {
                    match self.paths.get_mut(listener).and_then(Option::as_mut) {
                        Some(dp) => match dp.adopt(id, req) {
                            Ok(Change::Grew(n)) => {
                                slog::info!(self.log, "SRQ grew to cover the connected queues"; "receives" => n)
                            }
                            Ok(_) => {}
                            Err(e) => {
                                slog::warn!(self.log, "cannot accept a connection"; "error" => %e)
                            }
                        },
                        None => {
                            slog::warn!(self.log, "a connection for a listener without a data path")
                        }
                    }
                }
                ReactorCmd::Disconnected { token } => {
                    for dp in self.paths.iter_mut().flatten() {
                        dp.disconnected(token);
                    }
                }
                ReactorCmd::DeviceEvent { async_fd, event } => {
                    let now = Instant::now();
                    for dp in self.paths.iter_mut().flatten() {
                        if dp.async_fd() != async_fd {
                            continue;
                        }
                        match dp.on_event(&event, now) {
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
            }
        }
        let now = Instant::now();
        for dp in self.paths.iter_mut().flatten() {
            worked |= dp.poll(now);
        }
        worked
    }

    fn wake_fds(&self) -> Vec<std::os::fd::RawFd> {
        self.paths.iter().flatten().map(DataPath::wake_fd).collect()
    }

    fn prepare_sleep(&mut self) -> bool {
        let mut ok = true;
        for dp in self.paths.iter_mut().flatten() {
            ok &= dp.arm();
        }
        ok
    }
}
