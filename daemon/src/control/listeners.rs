//! Listeners on the control thread: their CM channels and devices' async events, connection
//! requests handed to the reactors, failed connects, and a removed device's listeners
//! coming back when it returns.

use nvmfd_blockdev::Device as BlockDevice;

use super::*;

/// A listener's CM state.
#[derive(Debug, Default)]
pub(super) struct Listening {
    // Field order is drop order: the IDs go before their channel.
    /// The listening ID, while it serves.
    pub(super) id: Option<any::cm::CmId>,
    /// Its device, while it serves.
    pub(super) device: Option<any::Device>,
    /// After its device was removed: the old listening ID, kept until nothing made on the
    /// device is left, then used to let go of the device.
    pub(super) retiring: Option<Retiring>,
    /// Its CM channel, registered with the control loop. It stays when the device goes: IDs of
    /// its connections may still be draining on the reactors, and a channel must outlive its
    /// IDs (rdma_destroy_event_channel); it listens again on the same channel.
    pub(super) channel: Option<any::cm::CmChannel>,
    /// While its device is away: when to try listening again.
    pub(super) relisten_at: Option<Instant>,
    /// Why the last try failed (logged when it changes).
    pub(super) relisten_error: Option<String>,
    pub(super) device_removals: u64,
    pub(super) returns: u64,
    /// Times its address moved to another port (`RDMA_CM_EVENT_ADDR_CHANGE`).
    pub(super) address_changes: u64,
    /// It stopped serving because its device went (not because its address moved): the
    /// next time it listens is a return (`returns`).
    pub(super) removed: bool,
    /// Its connection requests wait for the control loop, not served while a change waits
    /// (`serve_meanwhile`): a listener whose reactors have no data path on it yet (added,
    /// or its device back, and RBD handles being opened for it), or one the change removes.
    /// Cleared at the top of every control loop turn.
    pub(super) held: bool,
}

/// A listener's listening ID on a removed device, until the device is released.
#[derive(Debug)]
pub(super) struct Retiring {
    pub(super) id: any::cm::CmId,
    /// The address it listens on.
    pub(super) addr: Option<std::net::SocketAddr>,
    pub(super) since: Instant,
    /// `RELEASE_TIMEOUT` passed with the device still held (logged once); the listener tries
    /// to listen again meanwhile.
    pub(super) overdue: bool,
    /// Letting go of the device failed (logged once).
    pub(super) failed: bool,
    /// Retired because its address moved to another port (`RDMA_CM_EVENT_ADDR_CHANGE`), not
    /// because the device went: the device stays, so the ID goes as soon as nothing made on
    /// the device is left, and the listener listens again (binding where the address is now).
    pub(super) moved: bool,
}

/// How long the control thread waits for RBD handles opened ahead of new data paths; opens
/// still under way then finish as spares, and an engine that finds none waits for one opened
/// off its reactor (its commands answering Namespace Not Ready meanwhile).
const PREPARE_WAIT: Duration = Duration::from_secs(2);

/// A device removal to handle (`Daemon::handle_removal`), seen while a change waited.
#[derive(Debug)]
pub(super) struct DeferredRemoval {
    /// The device (`None`: the listener had no device any more); a handle on it, so that
    /// its async fd names no other device until the removal is handled.
    device: Option<any::Device>,
    cause: &'static str,
    /// The connection whose CM ID reported it.
    disconnected: Option<usize>,
    /// An address change on a listening ID, not a removal: see `Retiring::moved`.
    moved: bool,
}

impl Daemon {
    /// Opens ahead, off this thread, a handle of every RBD namespace (those of `devices`,
    /// and `added`) for each reactor about to build a data path on listener `listener`'s
    /// device (a listener added, or its device back), so that no reactor waits on a cluster
    /// in `rbd_open` meanwhile. Nothing when another listener serving on the same device
    /// has a data path there already (the new listener shares it). Waits at most
    /// [`PREPARE_WAIT`], keeping the watchdog fed.
    pub(super) fn prepare_rbd_handles(&mut self, listener: usize, added: &[Arc<BlockDevice>]) {
        let fd = self
            .cm
            .get(listener)
            .and_then(|c| c.device.as_ref())
            .map(|d| d.async_fd());
        let shared = self.cm.iter().enumerate().any(|(j, c)| {
            j != listener
                && self.listener_slots.get(j).is_some_and(Option::is_some)
                && c.device.as_ref().map(|d| d.async_fd()) == fd
        });
        if fd.is_none() || shared {
            return;
        }
        if let Some(gate) = self.test_gate() {
            let _ = self.off_thread_until(
                move || super::off_thread::wait_at_gate(&gate, "prepare"),
                Some(Instant::now() + PREPARE_WAIT),
            );
        }
        let devs: Vec<Arc<BlockDevice>> = self
            .devices
            .values()
            .chain(added)
            .filter(|d| d.info().kind == nvmfd_blockdev::Kind::Rbd)
            .cloned()
            .collect();
        if devs.is_empty() {
            return;
        }
        let n = self.inboxes.len();
        let log = self.log.clone();
        let opened = self.off_thread_until(
            move || {
                // `n` more for each image, whatever spares wait already: those may be for
                // data paths not built yet (a reactor that has not started).
                let ready = std::thread::scope(|s| {
                    let opens: Vec<_> = devs
                        .iter()
                        .flat_map(|d| std::iter::repeat_n(d, n))
                        .map(|d| s.spawn(move || usize::from(d.open_spare_handle().is_ok())))
                        .collect();
                    opens
                        .into_iter()
                        .filter_map(|h| h.join().ok())
                        .sum::<usize>()
                });
                // Logged here: also when the control thread stopped waiting first.
                info!(log, "RBD handles opened ahead for the reactors' new data paths"; "handles" => ready);
            },
            Some(Instant::now() + PREPARE_WAIT),
        );
        match opened {
            Ok(()) => {}
            Err(e) => {
                warn!(self.log, "RBD handles for the new data paths not ready: their RBD namespaces answer Namespace Not Ready there until a handle is opened for them";
                      "waited_ms" => PREPARE_WAIT.as_millis(), "why" => e);
            }
        }
    }

    /// Opens a CM channel for `provider` (for soft, on the daemon's fabric, with a device at
    /// `addr` unless it has one).
    pub(super) fn open_channel(
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
    pub(super) fn listen(&mut self, registry: &Registry, i: usize) -> Result<(), String> {
        let l = self
            .listener_slots
            .get(i)
            .cloned()
            .flatten()
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
        self.watch_device(registry, &dev, &id)
            .map_err(|e| format!("cannot watch the device's async events: {e}"))?;
        if let Some(c) = self.cm.get_mut(i) {
            c.id = Some(id);
            c.device = Some(dev);
        }
        Ok(())
    }

    /// Watches `dev`'s async event fd (SRQ limit, QP and device errors, port changes), unless
    /// it already is (listeners on one device share it); `id` is the listening ID `dev` was
    /// taken from.
    pub(super) fn watch_device(
        &mut self,
        registry: &Registry,
        dev: &any::Device,
        id: &any::cm::CmId,
    ) -> std::io::Result<()> {
        let fd = dev.async_fd();
        if let Some(watched) = self
            .async_devs
            .iter()
            .flatten()
            .find(|d| d.async_fd() == fd)
        {
            // What was made on the device (through the watched handle) holds this new
            // listener's ID from now on: the ID it held may be a removed listener's, still
            // listening only for it (its last listener removed, its data path draining).
            watched.hold_id(id);
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

    /// Listener `i` goes: what was made on its device must not keep its listening ID, or the
    /// ID would keep listening (and its port taken) while the data path lives on for another
    /// listener of the device. The device watched for async events, on which the reactors'
    /// data paths were made, holds another listener's ID of that device instead, or, with
    /// none, an ID bound to the listener's address and not listening (ibverbs).
    pub(super) fn let_go_of_listening_id(&mut self, i: usize, addr: std::net::IpAddr) {
        let Some(dev) = self.cm.get(i).and_then(|c| c.device.clone()) else {
            return;
        };
        let fd = dev.async_fd();
        // Another listener's own listening ID (not the one its device holds: that may be
        // this listener's, taken when it was added).
        let other_listener = self
            .cm
            .iter()
            .enumerate()
            .filter(|&(j, c)| j != i && c.device.as_ref().is_some_and(|d| d.async_fd() == fd))
            .find_map(|(j, c)| c.id.is_some().then_some(j));
        // The only listener of its device: an ID bound to its address and not listening
        // holds the device instead, until the device is let go of, so that the port is free
        // at once (adding the listener back failed with "Address already in use" until its
        // data paths had drained). A wildcard listener keeps its ID as before.
        let holder = || {
            if addr.is_unspecified() {
                return None;
            }
            let ch = self.cm.get(i)?.channel.as_ref()?;
            match ch.bind_holder(std::net::SocketAddr::new(addr, 0))? {
                Ok(id) => Some(id),
                Err(e) => {
                    warn!(self.log, "no ID to hold a removed listener's device: its port stays taken until the device is let go of"; "error" => %e);
                    None
                }
            }
        };
        let held;
        let other = match other_listener.and_then(|j| self.cm[j].id.as_ref()) {
            Some(id) => id,
            None => match holder() {
                Some(id) => {
                    held = id;
                    &held
                }
                None => return,
            },
        };
        for d in self
            .async_devs
            .iter()
            .flatten()
            .filter(|d| d.async_fd() == fd)
        {
            d.hold_id(other);
        }
        dev.hold_id(other);
    }

    /// Devices no listener serves any more (their last listener was removed) are watched
    /// until nothing made on them is left (the reactors' data paths drain, and may need their
    /// async events meanwhile), then let go of: the handle watched holds the listening ID of
    /// one of their listeners, which only then stops listening.
    pub(super) fn let_go_of_unserved_devices(&mut self, registry: &Registry) {
        for slot in 0..self.async_devs.len() {
            let Some(fd) = self.async_devs[slot]
                .as_ref()
                .filter(|d| !d.in_use())
                .map(any::Device::async_fd)
            else {
                continue;
            };
            let served = self
                .cm
                .iter()
                .any(|c| c.device.as_ref().is_some_and(|d| d.async_fd() == fd));
            if served {
                continue;
            }
            self.route_async(slot);
            let _ = registry.deregister(&mut mio::unix::SourceFd(&fd));
            self.async_devs[slot] = None;
            info!(self.log, "device let go: no listener serves it and nothing made on it is left";
                "async_fd" => fd);
        }
    }

    /// Every tick: a removed listener's CM channel goes once no ID made on it is left (the
    /// reactors have destroyed its connections' IDs, and its old listening ID let go of a
    /// removed device); before, rdma_cm still delivers their events on it.
    pub(super) fn let_go_of_removed_channels(&mut self, registry: &Registry) {
        for i in 0..self.cm.len() {
            let removed = matches!(self.listener_slots.get(i), Some(None));
            let c = &mut self.cm[i];
            if !removed
                || c.id.is_some()
                || c.retiring.is_some()
                || c.channel.as_ref().is_none_or(any::cm::CmChannel::has_ids)
            {
                continue;
            }
            if let Some(ch) = c.channel.take() {
                let _ = registry.deregister(&mut mio::unix::SourceFd(&ch.fd()));
                debug!(self.log, "removed listener's CM channel closed: no ID made on it is left"; "listener" => i);
            }
        }
    }

    /// Sends every reactor the command `cmd` makes, and wakes it.
    pub(super) fn tell_reactors(&self, mut cmd: impl FnMut() -> ReactorCmd) {
        for (r, tx) in self.inboxes.iter().enumerate() {
            if tx.send(cmd()).is_ok() {
                if let Some(h) = self.reactors.get(r) {
                    h.shared.wake();
                }
            }
        }
    }

    /// The addresses of the listeners served by the device whose async fd is `fd`.
    pub(super) fn listeners_on(&self, fd: std::os::fd::RawFd) -> String {
        self.cm
            .iter()
            .zip(&self.listeners)
            .filter(|(c, _)| c.device.as_ref().is_some_and(|d| d.async_fd() == fd))
            .map(|(_, l)| super::status::address_and_port(&l.address, l.port))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Handles the CM events of listener `i`: connect requests are checked and handed to a
    /// reactor (round robin); the end of a connection is told to every reactor; a device
    /// removal (on the listening ID or on a connection) takes the whole device down.
    pub(super) fn cm_events(&mut self, registry: &Registry, i: usize) {
        self.cm_events_of(registry, i, false);
    }

    /// `cm_events`; while a change waits (`meanwhile`), a device removal is only noted, and
    /// handled once the change is done (`handle_deferred_removals`).
    fn cm_events_of(&mut self, registry: &Registry, i: usize, meanwhile: bool) {
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
                        .and_then(|r| r.with_read_depth(initiator_depth))
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
                    let removal = DeferredRemoval {
                        device: c.and_then(|c| c.device.clone()),
                        cause: if listening {
                            "RDMA_CM_EVENT_DEVICE_REMOVAL on the listening ID"
                        } else {
                            "RDMA_CM_EVENT_DEVICE_REMOVAL on a connection"
                        },
                        disconnected: (!listening).then_some(token),
                        moved: false,
                    };
                    self.removal_now_or_later(registry, removal, meanwhile);
                }
                CmEvent::Disconnected { id } => {
                    self.tell_reactors(|| ReactorCmd::Disconnected { token: id });
                }
                // A bond's failover moved an address to another port. A connection on it is
                // over (as the kernel target disconnects its queue). The listening ID is
                // bound where the address was: it listens again (the kernel target repairs
                // its port the same way), after everything made on the device through it is
                // torn down, as for a removal, the device staying.
                CmEvent::AddrChange { id: token } => {
                    let c = self.cm.get(i);
                    let listening = c
                        .and_then(|c| c.id.as_ref())
                        .is_some_and(|l| l.token() == token);
                    if !listening {
                        self.tell_reactors(|| ReactorCmd::Disconnected { token });
                        continue;
                    }
                    let removal = DeferredRemoval {
                        device: c.and_then(|c| c.device.clone()),
                        cause: "RDMA_CM_EVENT_ADDR_CHANGE on the listening ID",
                        disconnected: None,
                        moved: true,
                    };
                    self.removal_now_or_later(registry, removal, meanwhile);
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

    /// Handles a removal (or an address move) now, or, while a change waits (`meanwhile`),
    /// once it is done: its listeners take no new connection on the device until then.
    fn removal_now_or_later(
        &mut self,
        registry: &Registry,
        removal: DeferredRemoval,
        meanwhile: bool,
    ) {
        if meanwhile {
            let fd = removal.device.as_ref().map(any::Device::async_fd);
            self.hold_listeners_on(fd);
            self.deferred_removals.push(removal);
        } else {
            self.handle_removal(registry, removal);
        }
    }

    /// A device removal: the device goes (its listeners listen again once it is back), and
    /// the connection whose CM ID reported it (if not the listening ID's) is told gone.
    fn handle_removal(&mut self, registry: &Registry, r: DeferredRemoval) {
        if let Some(dev) = r.device {
            self.device_removed(registry, dev.async_fd(), r.cause, r.moved);
        }
        if let Some(token) = r.disconnected {
            self.tell_reactors(|| ReactorCmd::Disconnected { token });
        }
    }

    /// The engines an RBD image is attached to: one per reactor and data path, and a reactor
    /// has one data path per RDMA device its listeners serve on (listeners sharing a device
    /// share it), at least one.
    pub(super) fn engines(&self) -> usize {
        let devices: std::collections::BTreeSet<std::os::fd::RawFd> = self
            .cm
            .iter()
            .filter_map(|c| c.device.as_ref().map(any::Device::async_fd))
            .collect();
        self.inboxes.len() * devices.len().max(1)
    }

    /// Listeners on the device whose async fd is `fd` take no connection until the next
    /// control loop turn (`Listening::held`).
    fn hold_listeners_on(&mut self, fd: Option<std::os::fd::RawFd>) {
        let Some(fd) = fd else { return };
        for c in &mut self.cm {
            if c.device.as_ref().is_some_and(|d| d.async_fd() == fd) {
                c.held = true;
            }
        }
    }

    /// The device removals seen while a change waited, now that it is done.
    pub(super) fn handle_deferred_removals(&mut self, registry: &Registry) {
        for r in std::mem::take(&mut self.deferred_removals) {
            self.handle_removal(registry, r);
        }
    }

    /// While a change waits for long (an RBD image opened or resized off this thread, up to
    /// minutes): what must not wait for it. Connection requests and the ends of connections
    /// go to the reactors, the devices' async events are routed (an SRQ's limit, a QP's
    /// fatal error), controllers whose keep-alive expired are ended. A device's removal
    /// changes the listeners the change may be working on: it is handled after the change,
    /// as admin clients are served.
    pub(super) fn serve_meanwhile(&mut self, now: Instant) {
        let Some(registry) = self.registry.take() else {
            return;
        };
        for i in 0..self.cm.len() {
            if !self.cm[i].held {
                self.cm_events_of(&registry, i, true);
            }
        }
        for slot in 0..self.async_devs.len() {
            if self.route_async(slot) {
                let device = self.async_devs[slot].clone();
                self.hold_listeners_on(device.as_ref().map(any::Device::async_fd));
                self.deferred_removals.push(DeferredRemoval {
                    device,
                    cause: "IBV_EVENT_DEVICE_FATAL",
                    disconnected: None,
                    moved: false,
                });
            }
        }
        self.check_controllers(now);
        self.registry = Some(registry);
    }

    /// Device `slot`'s async events: each goes to every reactor (the one whose SRQ or QP it
    /// names acts on it); a fatal one takes the whole device down.
    pub(super) fn async_events(&mut self, registry: &Registry, slot: usize) {
        if self.route_async(slot) {
            let fd = self
                .async_devs
                .get(slot)
                .and_then(Option::as_ref)
                .map(any::Device::async_fd);
            if let Some(fd) = fd {
                self.device_removed(registry, fd, "IBV_EVENT_DEVICE_FATAL", false);
            }
        }
    }

    /// Reads device `slot`'s async events and hands each to every reactor; true when one was
    /// `DEVICE_FATAL`.
    pub(super) fn route_async(&self, slot: usize) -> bool {
        let Some(Some(dev)) = self.async_devs.get(slot) else {
            return false;
        };
        let fd = dev.async_fd();
        let mut fatal = false;
        while let Some((number, event)) = dev.next_numbered_event() {
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
                number,
                event,
            });
        }
        fatal
    }

    /// Test hook: removes or restores listener `i`'s soft device.
    pub(super) fn inject_fault(&self, fault: Fault, i: usize) -> Result<serde_json::Value, String> {
        let l = self
            .listener_slots
            .get(i)
            .and_then(Option::as_ref)
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
            Fault::AddrChange => fabric.change_address(&dev),
            Fault::RestoreDevice => fabric
                .restore_device(&dev)
                .map_err(|e| format!("listener {i}'s device cannot come back yet: {e}"))?,
            Fault::Seeded(f) => fabric.set_faults(nvmfd_rdma::soft::Faults {
                seed: f.seed,
                drop_per_million: f.drop_per_million,
                delay_per_million: f.delay_per_million,
                qp_fatal_per_million: f.qp_fatal_per_million,
                srq_error_per_million: f.srq_error_per_million,
                post_failure_per_million: f.post_failure_per_million,
                ..Default::default()
            }),
            Fault::Count => {}
            Fault::FailRegistrations(n) => fabric.fail_registrations(n),
        }
        if fault != Fault::Count {
            warn!(self.log, "test hook: fault injected"; "fault" => ?fault, "listener" => i,
                  "device" => %l.address);
        }
        let n = fabric.injected();
        Ok(serde_json::json!({
            "fault": fault, "listener": i, "device": l.address.to_string(),
            "injected": {
                "drops": n.drops, "delays": n.delays, "qp_fatals": n.qp_fatals,
                "srq_errors": n.srq_errors, "post_failures": n.post_failures,
            },
        }))
    }
}
