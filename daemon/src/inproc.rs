//! A target in this process, for benchmarks and tests: a real reactor thread (the poll loop
//! that arms, sleeps and folds counters) serving the data path of one soft listener, and a
//! thread standing in for the control thread: it sleeps on the CM channel and the device's
//! async fd and hands connections and events to the reactor's inbox, waking it. Hosts connect
//! over the same in-process [`Fabric`].

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use nvmfd_blockdev::Device as BlockDevice;
use nvmfd_nvme::rdma_cm::{check_request, reject_private_data};
use nvmfd_nvme::{Limits, Namespace, Port, Subsystem, Target};
use nvmfd_rdma::any;
use nvmfd_rdma::soft::Fabric;
use nvmfd_rdma::CmEvent;

use crate::datapath::{ConnectFailure, DataPathConfig};
use crate::paths::{PathBuilder, ReactorCmd, ReactorPaths};
use crate::reactor::{LoopConfig, ReactorHandle};
use crate::srq::{Registrar, SrqConfig};
use crate::stats::DataPathCounters;

/// What an in-process target serves and how.
#[derive(Debug)]
pub struct InProcOptions {
    /// The subsystem's NQN (any host is allowed).
    pub nqn: String,
    /// Its namespaces: NSID and device.
    pub namespaces: Vec<(u32, Arc<BlockDevice>)>,
    /// The listener's port on 10.0.0.1.
    pub port: u16,
    /// The SRQ.
    pub srq: SrqConfig,
    /// Large data buffers (`max_io_size` each).
    pub buffers: u32,
    /// Small data buffers ([`crate::datapath::SMALL_BUFFER`] each).
    pub small_buffers: u32,
    /// Request slots.
    pub requests: u32,
    /// Connections without a Fabrics Connect end after this.
    pub connect_timeout: Duration,
    /// The reactor's loop.
    pub loop_cfg: LoopConfig,
    /// The data path's counters.
    pub counters: Arc<DataPathCounters>,
    /// The reactor's core.
    pub core: usize,
}

/// A running in-process target; stopped when dropped.
#[derive(Debug)]
pub struct InProcTarget {
    /// The fabric hosts connect over.
    pub fabric: Fabric,
    /// The listener's address.
    pub addr: SocketAddr,
    /// The reactor.
    pub reactor: Option<ReactorHandle>,
    /// While set, CM events are left in the channel (taken once it clears).
    pub hold_cm: Arc<AtomicBool>,
    /// The listener, when the reactor has no data path for it, with why.
    pub unserved: crate::paths::Unserved,
    stop: Arc<AtomicBool>,
    control: Option<std::thread::JoinHandle<()>>,
}

impl InProcTarget {
    /// Starts the reactor and the control stand-in.
    pub fn start(o: InProcOptions) -> std::io::Result<InProcTarget> {
        Self::build(o, true).map(|(t, _)| t)
    }

    /// Starts the control stand-in only, and returns the reactor's work for the caller to
    /// poll on its own thread (`ReactorWork::poll`): one thread then runs host and target,
    /// turn by turn, and nothing spins (what an instruction count needs).
    pub fn start_manual(
        o: InProcOptions,
    ) -> std::io::Result<(InProcTarget, Box<dyn crate::reactor::ReactorWork>)> {
        let (t, work) = Self::build(o, false)?;
        let work = work.ok_or_else(|| std::io::Error::other("no work was built"))?;
        Ok((t, work()))
    }

    fn build(
        o: InProcOptions,
        spawn: bool,
    ) -> std::io::Result<(InProcTarget, Option<crate::reactor::WorkFactory>)> {
        let err = |e: nvmfd_rdma::VerbsError| std::io::Error::other(e.to_string());
        let fabric = Fabric::new();
        fabric.add_device([10, 0, 0, 1].into()).map_err(err)?;
        let addr = SocketAddr::new([10, 0, 0, 1].into(), o.port);
        let limits = Limits::default();
        let target = target_of(&o, addr, limits);
        let ch =
            any::cm::CmChannel::Soft(nvmfd_rdma::soft::cm::CmChannel::new(&fabric).map_err(err)?);
        let listener = ch.listen(addr, 128).map_err(err)?;
        let dev = listener.device().map_err(err)?;
        let (tx, rx) = std::sync::mpsc::channel();
        let log = slog::Logger::root(slog::Discard, slog::o!());
        let sub = target.subsystem(&o.nqn).map_or(0, |s| s.id);
        let builder = PathBuilder {
            target,
            namespaces: o
                .namespaces
                .iter()
                .map(|(nsid, d)| (sub, *nsid, Arc::clone(d)))
                .collect(),
            cfg: DataPathConfig {
                srq: o.srq,
                in_capsule: limits.in_capsule_data_size,
                buffers: o.buffers,
                small_buffers: o.small_buffers,
                max_io: limits.max_io_size,
                requests: o.requests,
                huge_pages: false,
                connect_timeout: o.connect_timeout,
                response_timeout: crate::datapath::RESPONSE_TIMEOUT,
                max_qps: crate::datapath::MAX_QPS,
            },
            registrar: Registrar::spawn()?,
            log: log.clone(),
            test_build_delay: None,
        };
        let devices = vec![Some(dev.clone())];
        let counters = o.counters;
        let unserved = crate::paths::Unserved::default();
        let theirs = Arc::clone(&unserved);
        let factory: crate::reactor::WorkFactory =
            Box::new(move || Box::new(ReactorPaths::new(&devices, builder, counters, rx, theirs)));
        let (reactor, manual) = if spawn {
            let r = ReactorHandle::spawn(0, o.core, o.loop_cfg, &log, Some(factory))
                .map_err(|e| std::io::Error::other(e.to_string()))?;
            (Some(r), None)
        } else {
            (None, Some(factory))
        };
        let shared = reactor.as_ref().map(|r| Arc::clone(&r.shared));
        let wake = move || {
            if let Some(s) = &shared {
                s.wake();
            }
        };
        let stop = Arc::new(AtomicBool::new(false));
        let hold_cm = Arc::new(AtomicBool::new(false));
        let (st, hcm) = (Arc::clone(&stop), Arc::clone(&hold_cm));
        let control = std::thread::Builder::new()
            .name("inproc-control".into())
            .spawn(move || {
                let cm = Control {
                    ch,
                    dev,
                    tx,
                    limits,
                };
                cm.run(&st, &hcm, &wake);
                drop(listener);
            })?;
        let t = InProcTarget {
            fabric,
            addr,
            reactor,
            hold_cm,
            unserved,
            stop,
            control: Some(control),
        };
        Ok((t, manual))
    }
}

/// The target of `o`: one subsystem, any host allowed, listening at `addr`.
fn target_of(o: &InProcOptions, addr: SocketAddr, limits: Limits) -> Target {
    Target::new(
        vec![Subsystem {
            id: 0,
            nqn: o.nqn.clone(),
            serial: "INPROC".into(),
            model: "nvmfd".into(),
            allow_any_host: true,
            hosts: vec![],
            cntlids: nvmfd_nvme::ALL_CNTLIDS,
            namespaces: o
                .namespaces
                .iter()
                .map(|(nsid, d)| Namespace {
                    nsid: *nsid,
                    info: crate::serve::namespace_info(d.info()),
                    uuid: None,
                    nguid: None,
                })
                .collect(),
        }],
        vec![Port {
            addr: addr.ip(),
            port: addr.port(),
            id: 0,
        }],
        limits,
    )
}

/// The control thread's stand-in: the listener's CM channel and device, and the reactor's
/// inbox.
struct Control {
    ch: any::cm::CmChannel,
    dev: any::Device,
    tx: std::sync::mpsc::Sender<ReactorCmd>,
    limits: Limits,
}

impl Control {
    /// Sleeps on the CM channel and the device's async fd; hands connections and events to
    /// the reactor (and `wake`s it) until `stop`. CM events wait while `hold` is set.
    fn run(&self, stop: &AtomicBool, hold: &AtomicBool, wake: &dyn Fn()) {
        use mio::unix::SourceFd;
        let Ok(mut poll) = mio::Poll::new() else {
            return;
        };
        for (n, fd) in [self.ch.fd(), self.dev.async_fd()].into_iter().enumerate() {
            let _ = poll.registry().register(
                &mut SourceFd(&fd),
                mio::Token(n),
                mio::Interest::READABLE,
            );
        }
        let mut events = mio::Events::with_capacity(8);
        while !stop.load(Ordering::Relaxed) {
            let _ = poll.poll(&mut events, Some(Duration::from_millis(20)));
            while let Some(ev) = (!hold.load(Ordering::Relaxed))
                .then(|| self.ch.next_event())
                .flatten()
            {
                let Some(cmd) = command(ev, &self.limits) else {
                    continue;
                };
                if self.tx.send(cmd).is_err() {
                    return;
                }
                wake();
            }
            while let Some((number, event)) = self.dev.next_numbered_event() {
                let async_fd = self.dev.async_fd();
                if self
                    .tx
                    .send(ReactorCmd::DeviceEvent {
                        async_fd,
                        number,
                        event,
                    })
                    .is_err()
                {
                    return;
                }
                wake();
            }
        }
    }
}

/// What the control thread makes of a CM event of the listener's channel: a command for the
/// reactor, or nothing (a request it rejects itself, an event it has no use for).
fn command(ev: any::cm::CmEvent, limits: &Limits) -> Option<ReactorCmd> {
    Some(match ev {
        CmEvent::ConnectRequest {
            id,
            private_data,
            initiator_depth,
            ..
        } => match check_request(&private_data, limits)
            .and_then(|r| r.with_read_depth(initiator_depth))
        {
            Ok(req) => ReactorCmd::Adopt {
                listener: 0,
                id,
                req,
            },
            Err(status) => {
                let _ = id.reject(&reject_private_data(status));
                return None;
            }
        },
        CmEvent::Disconnected { id } => ReactorCmd::Disconnected { token: id },
        CmEvent::Rejected { id, .. } => ReactorCmd::ConnectFailed {
            token: id,
            why: ConnectFailure::Rejected,
        },
        CmEvent::Unreachable { id } => ReactorCmd::ConnectFailed {
            token: id,
            why: ConnectFailure::Unreachable,
        },
        CmEvent::ConnectError { id } => ReactorCmd::ConnectFailed {
            token: id,
            why: ConnectFailure::ConnectError,
        },
        // A connection's address moved (a listening ID's is not handled here).
        CmEvent::AddrChange { id } => ReactorCmd::Disconnected { token: id },
        _ => return None,
    })
}

impl Drop for InProcTarget {
    fn drop(&mut self) {
        if let Some(mut r) = self.reactor.take() {
            r.shared.request_stop();
            r.join();
        }
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.control.take() {
            let _ = t.join();
        }
    }
}
