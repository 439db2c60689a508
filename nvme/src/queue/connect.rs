//! The Fabrics Connect command: a new controller for an admin queue, an I/O queue joining
//! its controller, each checked against the subsystem, the host and the transport's limits.

use super::*;

/// Byte offset of KATO in the Connect command (Connect Invalid Parameters points at it).
const KATO_OFFSET: u32 = 48;
/// Connect Invalid Host points at the host NQN in the Connect data (IATTR 1, IPO 512), as
/// the kernel target answers.
const HOSTNQN_IN_DATA: u32 = 1 << 16 | 512;

impl Queue {
    pub(super) fn connect(&mut self, cmd: Command, data: &[u8], now: Instant) -> Action {
        // Another Connect sent before this one's data arrived bound the queue meanwhile: a
        // second controller here would be left behind when the queue goes.
        if self.qid.is_some() {
            return self.respond(&cmd, status::COMMAND_SEQUENCE_ERROR, 0);
        }
        let Some(c) = wire::read::<ConnectCmd>(cmd.sqe.as_bytes()) else {
            return self.respond(&cmd, status::INTERNAL_ERROR, 0);
        };
        let Some(d) = wire::read::<ConnectData>(data) else {
            return self.respond(&cmd, status::DATA_SGL_LENGTH_INVALID, 0);
        };
        // Invalid Parameters: dw0 says where (IATTR bit 16: 1 = in the data; IPO bits 15:0).
        let invalid = |q: &Queue, in_data: bool, offset: u32| {
            q.respond(
                &cmd,
                status::CONNECT_INVALID_PARAMETERS,
                (u32::from(in_data) << 16) | offset,
            )
        };
        if c.recfmt.get() != 0 {
            return self.respond(&cmd, status::CONNECT_INCOMPATIBLE_FORMAT, 0);
        }
        let qid = c.qid.get();
        let sqsize = c.sqsize.get();
        let limits = *self.target.limits();
        if let Some(cm) = self.cm {
            if cm.qid != qid {
                return invalid(self, false, 42);
            }
            if cm.hsqsize != sqsize {
                return invalid(self, false, 44);
            }
        }
        if sqsize == 0
            || sqsize >= limits.max_queue_depth
            || (qid == 0 && sqsize >= crate::queue::ADMIN_QUEUE_ENTRIES)
        {
            return invalid(self, false, 44);
        }
        let Some(subnqn) = wire::get_nqn(&d.subnqn) else {
            return invalid(self, true, 256);
        };
        let Some(hostnqn) = wire::get_nqn(&d.hostnqn) else {
            return invalid(self, true, 512);
        };
        let discovery = subnqn == DISCOVERY_NQN;
        // The version first: a change after it is seen at the next command.
        let mut version = self.target.version();
        let mut subsystem = if discovery {
            None
        } else {
            match self.target.subsystem(subnqn) {
                Some(s) => Some(s),
                None => return invalid(self, true, 256),
            }
        };
        if let Some(s) = &subsystem {
            if !s.allows(hostnqn) {
                return self.respond(&cmd, status::CONNECT_INVALID_HOST, HOSTNQN_IN_DATA);
            }
        }
        let sub_id = subsystem.as_ref().map(|s| s.id);
        if qid == 0 {
            if d.cntlid.get() != 0xFFFF {
                return invalid(self, true, 16);
            }
            let requested = Duration::from_millis(u64::from(c.kato.get()));
            let kato = if requested.is_zero() {
                if discovery {
                    limits.kato_max
                } else {
                    Duration::ZERO
                }
            } else if requested > limits.kato_max {
                // A shorter timer than asked for would end a host that keeps to its own
                // (sending Keep Alive every KATO / 2): refused, not cut down.
                return invalid(self, false, KATO_OFFSET);
            } else {
                requested.max(limits.kato_min)
            };
            self.run_connect_hook();
            // The controller goes in the map only if the subsystems have not changed since
            // the host was checked: a change publishes them first and then ends, under the
            // map's lock, the controllers it no longer allows, so either it finds this one
            // there or this one sees the change and checks the host again.
            let mut map = loop {
                let map = self.target.ctrls();
                let now_version = self.target.version();
                if now_version == version {
                    break map;
                }
                drop(map);
                version = now_version;
                if !discovery {
                    match self.target.subsystem(subnqn) {
                        Some(s) if s.allows(hostnqn) => subsystem = Some(s),
                        Some(_) => {
                            return self.respond(
                                &cmd,
                                status::CONNECT_INVALID_HOST,
                                HOSTNQN_IN_DATA,
                            )
                        }
                        None => return invalid(self, true, 256),
                    }
                }
            };
            // The host's last association on this subsystem still has commands out (a reset
            // or reconnect while a backend had not finished them): not before they are done.
            if !discovery && self.target.io_left_behind(&map, hostnqn, subnqn) {
                return self.respond(&cmd, status::CONNECT_CONTROLLER_BUSY_RETRY, 0);
            }
            let range = subsystem.as_ref().map_or(crate::ALL_CNTLIDS, |s| s.cntlids);
            let Some(cntlid) = self.target.alloc_cntlid(&map, range) else {
                return self.respond(&cmd, status::CONNECT_CONTROLLER_BUSY, 0);
            };
            let ctrl = Arc::new(Controller {
                cntlid,
                hostnqn: hostnqn.to_owned(),
                hostid: d.hostid,
                // The subsystem the host was last checked against: it may have been
                // replaced (a new ID) while this Connect waited for the map.
                subsystem: subsystem.as_ref().map(|s| s.id),
                subnqn: subnqn.to_owned(),
                state: std::sync::Mutex::new(CtrlState {
                    cc: 0,
                    csts: 0,
                    kato,
                    last_keep_alive: now,
                    queues_granted: None,
                    io_queues: Vec::new(),
                    io_queues_lost: Vec::new(),
                    aec: 0,
                    held_aers: Vec::new(),
                    pending_events: Vec::new(),
                    changed_nsids: Vec::new(),
                    ns_event_masked: false,
                    acre: false,
                    resetting: false,
                    shutdown_pending: false,
                    shutdown_awaits_releases: false,
                    shutdown_flushing: None,
                    disc_event_masked: false,
                }),
                dead: false.into(),
                end_reason: std::sync::Mutex::new(None),
                ready: false.into(),
                traffic: false.into(),
                epoch: 0.into(),
                changes: Arc::clone(&self.target.inner.ctrl_changes),
                io_queues_alive: 0.into(),
                io_queues_unsettled: 0.into(),
                io_gone: IoCounts::default(),
                queue_stats: std::sync::Mutex::new(Vec::new()),
                releases_at_start: subsystem
                    .as_ref()
                    .map_or(0, |s| self.target.releases_unpublished_so_far(s.id)),
            });
            map.insert(cntlid, Arc::clone(&ctrl));
            drop(map);
            let cmd = self.bind(ctrl, (subsystem, version), (0, 0), sqsize, cmd);
            return self.respond(&cmd, Status::SUCCESS, u32::from(cntlid));
        }
        // An I/O queue joins an existing controller of the same subsystem and host.
        if discovery {
            return invalid(self, false, 42);
        }
        let ctrl = self.target.ctrls().get(&d.cntlid.get()).cloned();
        let Some(ctrl) =
            ctrl.filter(|c| c.subsystem == sub_id && c.hostnqn == hostnqn && !c.is_dead())
        else {
            return invalid(self, true, 16);
        };
        // The same host: its Host Identifier too (a host of the same NQN and another
        // identifier is another host, which must not take this controller's queue IDs or
        // keep it alive with its traffic).
        if ctrl.hostid != d.hostid {
            return invalid(self, true, 0);
        }
        if !ctrl.ready.load(Ordering::Acquire) {
            return self.respond(&cmd, status::COMMAND_SEQUENCE_ERROR, 0);
        }
        self.target.inner.io_connect_hook.run();
        // The queue ID is taken and the epoch read under the lock a reset takes to clear the
        // queue IDs and move the epoch: a reset after this makes the queue disconnect.
        let epoch = {
            let mut st = ctrl.lock();
            // Enabled and ready, checked again under the lock: a reset since the check above
            // cleared the queue IDs and moved the epoch, and a queue taking its ID now would
            // join the controller as the reset left it (disabled), outlive the reset and hold
            // it (RDY reads 1 until every I/O queue of before it is gone).
            if st.cc & 1 == 0 || st.csts & 1 == 0 {
                return self.respond(&cmd, status::COMMAND_SEQUENCE_ERROR, 0);
            }
            // Shut down (SHST processing or complete): nothing connects until a reset.
            if (st.csts >> 2) & 0x3 != 0 {
                return self.respond(&cmd, status::COMMAND_SEQUENCE_ERROR, 0);
            }
            // Without Set Features Number of Queues, what Get Features reports is allocated
            // (as the kernel target and SPDK take any queue ID up to their limit).
            let granted = usize::from(
                st.queues_granted
                    .unwrap_or(limits.max_io_queues.saturating_sub(1)),
            ) + 1;
            let slot = usize::from(qid) - 1;
            if slot < granted && st.io_queues_lost.get(slot).copied().unwrap_or(false) {
                return self.respond(&cmd, status::CONNECT_CONTROLLER_BUSY_RETRY, 0);
            }
            if slot >= granted {
                return invalid(self, false, 42);
            }
            // A queue ID the controller already has: Command Sequence Error, as the
            // specification says and the kernel target answers.
            if st.io_queues.get(slot).copied().unwrap_or(false) {
                return self.respond(&cmd, status::COMMAND_SEQUENCE_ERROR, 0);
            }
            if st.io_queues.len() <= slot {
                st.io_queues.resize(slot + 1, false);
            }
            st.io_queues[slot] = true;
            ctrl.epoch.load(Ordering::Acquire)
        };
        self.run_connect_hook();
        let cmd = self.bind(ctrl, (subsystem, version), (qid, epoch), sqsize, cmd);
        // The controller's ID, as for the admin queue (and as the kernel target answers).
        self.respond(&cmd, Status::SUCCESS, u32::from(d.cntlid.get()))
    }

    /// Tests: runs the target's connect hook ([`Target::set_connect_hook`]), if one is set.
    fn run_connect_hook(&self) {
        self.target.inner.connect_hook.run();
    }

    /// Makes this the queue `qid` of `ctrl` in its `epoch` (read when the queue ID was taken),
    /// with `sqsize + 1` entries, created by `connect`:
    /// returns the Connect command with the SQ head its response carries. The Connect was the
    /// new queue's first entry, so once fetched the head is 1, as the kernel target reports.
    /// SQ flow control stays on even when the host asks to disable it (CATTR bit 2), which the
    /// specification allows: the response then says so by carrying the head, not FFFFh (the
    /// kernel target disables it and answers FFFFh).
    fn bind(
        &mut self,
        ctrl: Arc<Controller>,
        (subsystem, version): (Option<Arc<Subsystem>>, u64),
        (qid, epoch): (u16, u32),
        sqsize: u16,
        connect: Command,
    ) -> Command {
        self.qid = Some(qid);
        self.sqsize = sqsize;
        self.sqhd = 1 % sqsize.wrapping_add(1).max(1);
        self.subsystem = subsystem;
        self.seen_version = version;
        self.epoch = epoch;
        if qid > 0 {
            ctrl.io_queues_alive.fetch_add(1, Ordering::AcqRel);
            ctrl.io_queues_unsettled.fetch_add(1, Ordering::AcqRel);
            self.unsettled = true;
            self.holds_qid = true;
        }
        let st = Arc::new(QueueStats::new(
            qid,
            u32::from(sqsize) + 1,
            self.peer.clone(),
        ));
        ctrl.queue_stats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Arc::clone(&st));
        self.stats = Some(st);
        self.ctrl = Some(ctrl);
        Command {
            sqhd: self.sqhd,
            ..connect
        }
    }
}
