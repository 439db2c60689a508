//! The target's model: subsystems with namespaces and allowed hosts, the discovery subsystem,
//! and the controllers that Fabrics Connect creates.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use crate::block::NamespaceInfo;

mod events;
mod hooks;
mod releases;
pub(crate) use events::CHANGED_LIST_LEN;
pub use events::{DISCOVERY_CHANGED_EVENT, NS_ATTR_CHANGED_EVENT, SHUTDOWN_FLUSH_KEEPS_ALIVE};
pub(crate) use hooks::Hook;
pub use hooks::{ChangeCount, ChangeWaker, ConnectHook};

/// The discovery subsystem's NQN.
pub const DISCOVERY_NQN: &str = "nqn.2014-08.org.nvmexpress.discovery";

/// Firmware revision reported in Identify Controller.
pub const FIRMWARE_REVISION: &str = env!("CARGO_PKG_VERSION");

/// NVMe version reported (VS and Identify VER): 1.3.
pub const NVME_VERSION: u32 = 0x0001_0300;

/// One namespace: its ID, the device behind it, its identifiers.
#[derive(Clone, Debug)]
pub struct Namespace {
    /// Namespace ID.
    pub nsid: u32,
    /// Size, block sizes and capabilities of the device behind it.
    pub info: NamespaceInfo,
    /// UUID, when configured.
    pub uuid: Option<[u8; 16]>,
    /// NGUID, when configured.
    pub nguid: Option<[u8; 16]>,
}

/// One NVM subsystem.
#[derive(Clone, Debug)]
pub struct Subsystem {
    /// The target's own ID for it, given when it is added and never reused (0 until then):
    /// controllers and the data path name it by this, as subsystems come and go.
    pub id: u64,
    /// NQN.
    pub nqn: String,
    /// Serial number.
    pub serial: String,
    /// Model number.
    pub model: String,
    /// Any host may connect.
    pub allow_any_host: bool,
    /// Allowed host NQNs.
    pub hosts: Vec<String>,
    /// Namespaces, by ascending NSID.
    pub namespaces: Vec<Namespace>,
    /// The controller IDs its controllers take, lowest and highest (within 1 to FFEFh;
    /// [`ALL_CNTLIDS`] unless configured).
    pub cntlids: (u16, u16),
}

/// Every controller ID a controller may have (1 to FFEFh).
pub const ALL_CNTLIDS: (u16, u16) = (1, 0xFFEF);

impl Subsystem {
    /// Whether `hostnqn` may connect.
    pub fn allows(&self, hostnqn: &str) -> bool {
        self.allow_any_host || self.hosts.iter().any(|h| h == hostnqn)
    }

    /// Namespace `nsid`.
    pub fn namespace(&self, nsid: u32) -> Option<&Namespace> {
        self.namespaces.iter().find(|n| n.nsid == nsid)
    }
}

/// Limits advertised to hosts (from the `[transport]` configuration).
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Largest queue size granted (entries).
    pub max_queue_depth: u16,
    /// Largest number of I/O queues per controller.
    pub max_io_queues: u16,
    /// Largest NSID of a subsystem (Identify Controller's NN): every NSID up to it is valid.
    pub max_nsid: u32,
    /// In-capsule data bytes accepted per command.
    pub in_capsule_data_size: u32,
    /// Largest transfer per command, bytes (a power of two, at least 8 KiB).
    pub max_io_size: u32,
    /// Shortest keep-alive timeout granted.
    pub kato_min: Duration,
    /// Longest keep-alive timeout granted; also a discovery controller's when the host asks
    /// for none.
    pub kato_max: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_queue_depth: 128,
            max_io_queues: 64,
            max_nsid: 1024,
            in_capsule_data_size: 4096,
            max_io_size: 128 * 1024,
            kato_min: Duration::from_secs(1),
            kato_max: Duration::from_secs(120),
        }
    }
}

/// A transport address, for the discovery log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Port {
    /// IP address.
    pub addr: IpAddr,
    /// Port (trsvcid).
    pub port: u16,
    /// The discovery log's PORTID: stable while the port exists.
    pub id: u16,
}

/// Why a controller ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EndReason {
    /// The host stopped sending keep-alives.
    KeepAliveExpired,
    /// The admin queue went away.
    AdminQueueLost,
    /// Its subsystem was removed.
    SubsystemRemoved,
    /// Its host is no longer allowed to reach the subsystem.
    AccessRevoked,
    /// An operator ended it.
    Disconnected,
}

/// Mutable controller state, behind a mutex (control path only: I/O never takes it).
#[derive(Debug)]
pub(crate) struct CtrlState {
    pub cc: u32,
    pub csts: u32,
    pub kato: Duration,
    pub last_keep_alive: Instant,
    /// Granted I/O queue count (0's based pair), once Number of Queues was set.
    pub queues_granted: Option<u16>,
    pub io_queues: Vec<bool>,
    /// Per I/O queue ID: taken by a queue whose connection was lost while commands of it
    /// may still be at a backend. Its ID is free once they are done; a Connect for it
    /// meanwhile is answered Controller Busy (the host retries), so that a write of the old
    /// queue cannot land after one the host sends through the new queue.
    pub io_queues_lost: Vec<bool>,
    pub aec: u32,
    pub held_aers: Vec<u16>,
    pub pending_events: Vec<u32>,
    pub changed_nsids: Vec<u32>,
    /// A Namespace Attribute Changed event was reported (or is pending) and the host has not
    /// read the Changed Namespace List since: further changes of the kind are masked, as the
    /// specification has it, and only join the list.
    pub ns_event_masked: bool,
    /// The host enabled Advanced Command Retry (Host Behavior Support, ACRE): retryable
    /// statuses carry a Command Retry Delay.
    pub acre: bool,
    /// CC.EN went from 1 to 0 and I/O queues of the controller may still exist: CSTS.RDY
    /// reads 1 until the last of them is gone (`io_queues_alive`).
    pub resetting: bool,
    /// CC.SHN was set while I/O queues of the controller still existed: the namespaces are
    /// flushed (and SHST completes) once the last of them is gone.
    pub shutdown_pending: bool,
    /// The shutdown's flush has run, and devices of the subsystem let go of (a namespace
    /// removed or reopened) are still being synced: SHST completes once they are
    /// ([`Target::release_begins`]).
    pub shutdown_awaits_releases: bool,
    /// A shutdown's flush of every namespace is under way, since then: the host waits for
    /// the command that started it (a Property Set or Get on its admin queue) and sends
    /// nothing else, so its keep-alive timer does not run out meanwhile, for up to
    /// [`SHUTDOWN_FLUSH_KEEPS_ALIVE`] (a flush that hangs does not keep a host that went
    /// away for ever). With the controller's epoch it began in: a reset ends that shutdown,
    /// so the flush then keeps nothing alive, and its end clears no later shutdown's mark.
    pub shutdown_flushing: Option<(Instant, u32)>,
    /// A Discovery Log Page Change event was raised and the host has not read the log since
    /// (without retaining it): no other is raised until it has.
    pub disc_event_masked: bool,
}

/// A controller, shared by its admin and I/O queues.
#[derive(Debug)]
pub struct Controller {
    /// Controller ID.
    pub cntlid: u16,
    /// Host NQN.
    pub hostnqn: String,
    /// Host identifier.
    pub hostid: [u8; 16],
    /// Its subsystem's ID ([`Subsystem::id`]), or `None` for the discovery controller.
    pub subsystem: Option<u64>,
    /// Its subsystem's NQN (the discovery NQN for a discovery controller).
    pub subnqn: String,
    pub(crate) state: Mutex<CtrlState>,
    /// Set when the controller has ended: every queue of it disconnects.
    pub(crate) dead: AtomicBool,
    pub(crate) end_reason: Mutex<Option<EndReason>>,
    /// Fast check for I/O: CC.EN and CSTS.RDY both set.
    pub(crate) ready: AtomicBool,
    /// A command arrived on one of its queues since the last keep-alive check: traffic
    /// counts as keep-alive (TBKAS, advertised in CTRATT), as a busy host may skip them.
    pub(crate) traffic: AtomicBool,
    /// Bumped by a reset: I/O queues connected before it must disconnect.
    pub(crate) epoch: AtomicU32,
    /// The target's count of controller changes ([`Target::controller_changes`]), moved on
    /// when this one ends or resets.
    pub(crate) changes: Arc<ChangeCount>,
    /// I/O queues bound to it and not yet dropped. A transport drops a queue only once its
    /// connection is torn down and every block operation of it has completed, so a reset or
    /// shutdown that waits for this to reach 0 has nothing of the old queues left in flight.
    pub(crate) io_queues_alive: AtomicU32,
    /// I/O queues of it that may still have commands at a backend: bound and not yet torn
    /// down with none of their operations there (`Queue::settled`), or dropped. What the
    /// fence against a new association of the same host waits for
    /// ([`Target::io_left_behind`]).
    pub(crate) io_queues_unsettled: AtomicU32,
    /// Its queues, for the operator's view (`Controller::queues`).
    pub(crate) queue_stats: Mutex<Vec<Arc<QueueStats>>>,
    /// The SMART log's figures of its queues that are gone (those alive keep theirs in
    /// their `QueueStats`).
    pub(crate) io_gone: IoCounts,
    /// Its subsystem's releases whose namespaces were published no more when it was made
    /// ([`Target::releases_unpublished`]): one numbered from this on whose sync fails, and
    /// writes its host completed may be lost (its shutdown fails); those before never
    /// concerned it.
    pub(crate) releases_at_start: u64,
}

/// Reads and writes completed and their bytes: the SMART log's figures.
#[derive(Debug, Default)]
pub(crate) struct IoCounts {
    reads: AtomicU64,
    writes: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
}

impl IoCounts {
    /// Counts a completed read or write of `len` bytes. One queue alone writes its counts: a
    /// plain load and store (`QueueStats::bump`).
    pub(crate) fn count(&self, write: bool, len: u64) {
        let (n, bytes) = if write {
            (&self.writes, &self.bytes_written)
        } else {
            (&self.reads, &self.bytes_read)
        };
        QueueStats::bump(n, 1);
        QueueStats::bump(bytes, len);
    }

    /// Reads, writes, bytes read, bytes written.
    pub(crate) fn get(&self) -> [u64; 4] {
        [
            &self.reads,
            &self.writes,
            &self.bytes_read,
            &self.bytes_written,
        ]
        .map(|a| a.load(Ordering::Relaxed))
    }

    /// Adds figures of [`IoCounts::get`]'s order (from any thread: locked adds).
    pub(crate) fn add(&self, f: [u64; 4]) {
        let all = [
            &self.reads,
            &self.writes,
            &self.bytes_read,
            &self.bytes_written,
        ];
        for (a, v) in all.into_iter().zip(f) {
            a.fetch_add(v, Ordering::Relaxed);
        }
    }
}

/// One queue of a controller as an operator sees it. Its queue alone writes the counters,
/// with a plain load and store (`QueueStats::bump`), never a locked add: no line of memory
/// written per command is shared with another queue's, which may run on another reactor.
#[derive(Debug)]
pub struct QueueStats {
    /// Queue ID (0: admin).
    pub qid: u16,
    /// Entries.
    pub depth: u32,
    /// Where the host connects from, when the transport says.
    pub peer: Option<String>,
    /// Commands received.
    pub commands: AtomicU64,
    /// Reads and writes completed, and their bytes (the SMART log's figures).
    pub(crate) io: IoCounts,
}

impl QueueStats {
    /// A queue's stats, its Connect counted.
    pub(crate) fn new(qid: u16, depth: u32, peer: Option<String>) -> QueueStats {
        QueueStats {
            qid,
            depth,
            peer,
            commands: 1.into(),
            io: IoCounts::default(),
        }
    }

    /// Adds `n` to a counter of this queue's, which only its queue writes.
    pub(crate) fn bump(c: &AtomicU64, n: u64) {
        c.store(c.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
    }
}

/// A snapshot of [`QueueStats`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QueueInfo {
    /// Queue ID (0: admin).
    pub qid: u16,
    /// Entries.
    pub depth: u32,
    /// Where the host connects from, when the transport says.
    pub peer: Option<String>,
    /// Commands received.
    pub commands: u64,
}

impl Controller {
    /// Its queues now, by queue ID.
    pub fn queues(&self) -> Vec<QueueInfo> {
        let mut v: Vec<QueueInfo> = self
            .queue_stats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|q| QueueInfo {
                qid: q.qid,
                depth: q.depth,
                peer: q.peer.clone(),
                commands: q.commands.load(Ordering::Relaxed),
            })
            .collect();
        v.sort_by_key(|q| q.qid);
        v
    }

    /// SMART figures: host reads, host writes, bytes read, bytes written, over its queues
    /// alive and gone.
    pub(crate) fn smart_figures(&self) -> [u64; 4] {
        let mut f = self.io_gone.get();
        for q in self
            .queue_stats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            for (t, v) in f.iter_mut().zip(q.io.get()) {
                *t += v;
            }
        }
        f
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, CtrlState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the controller has ended.
    pub fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }

    /// Why it ended, if it has.
    pub fn end_reason(&self) -> Option<EndReason> {
        *self.end_reason.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn end(&self, why: EndReason) {
        let mut r = self.end_reason.lock().unwrap_or_else(|e| e.into_inner());
        if r.is_none() {
            *r = Some(why);
        }
        self.ready.store(false, Ordering::Release);
        self.dead.store(true, Ordering::Release);
        self.changes.bump();
    }

    /// A reset or a shutdown with I/O queues left: the I/O queues connected before it must
    /// disconnect.
    pub(crate) fn new_epoch(&self) {
        self.epoch.fetch_add(1, Ordering::AcqRel);
        self.changes.bump();
    }

    /// The keep-alive timeout in force (zero: none).
    pub fn kato(&self) -> Duration {
        self.lock().kato
    }
}

/// The subsystems served, as one snapshot: a change publishes a new one.
pub type Subsystems = Arc<Vec<Arc<Subsystem>>>;

pub(crate) struct TargetInner {
    pub subsystems: RwLock<Subsystems>,
    /// Moves on with every change of the subsystems: a queue takes a new snapshot of its
    /// subsystem when it sees it move (one load per command).
    pub version: AtomicU64,
    pub next_subsystem_id: AtomicU64,
    pub ports: RwLock<Vec<Port>>,
    pub limits: Limits,
    pub controllers: Mutex<HashMap<u16, Arc<Controller>>>,
    /// Controllers that ended and left the map while I/O queues of theirs were alive (their
    /// commands may still be at a backend), until those are gone: see
    /// [`Target::io_left_behind`].
    pub retired: Mutex<Vec<std::sync::Weak<Controller>>>,
    /// Connects refused by that check, and the host and subsystem of the last.
    pub fenced: Mutex<(u64, Option<(String, String)>)>,
    pub next_cntlid: AtomicU32,
    pub genctr: AtomicU64,
    /// Moves on whenever a controller ends or resets (`Controller::end`, `new_epoch`).
    pub ctrl_changes: Arc<ChangeCount>,
    /// Per subsystem ID: devices let go of whose sync has not ended, and syncs that failed
    /// ([`Target::release_begins`]).
    pub releases: Mutex<HashMap<u64, ReleaseLog>>,
    /// Tests: run when a Connect has passed its checks: an admin queue's before it makes its
    /// controller, an I/O queue's once it has taken its queue ID, before it is bound.
    pub connect_hook: Hook,
    pub io_connect_hook: Hook,
    /// Tests: run while a discovery log is built, once it has taken the subsystems.
    pub discovery_hook: Hook,
    /// Tests: run when an I/O queue whose commands may be at a backend is lost, before it
    /// marks its queue ID lost.
    pub lost_hook: Hook,
    /// Tests: run when a removed subsystem is published gone, before its controllers end.
    pub removal_hook: Hook,
}

/// The devices of a subsystem let go of while it is served: a namespace removed, or its device
/// replaced. Its controllers' hosts can no longer flush such a device; it is synced once no
/// reactor holds it, and a shutdown of the subsystem's controllers is complete only then.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Releases {
    /// Let go of and not synced yet.
    pub in_flight: u32,
    /// Syncs that failed: writes completed on those devices may be lost.
    pub failures: u64,
}

/// A subsystem's releases, numbered in the order they began: a controller is concerned by
/// those whose namespace was still published when it was made (its host may have written
/// there).
#[derive(Debug, Default)]
pub(crate) struct ReleaseLog {
    /// Releases begun so far (the next one's number).
    pub(crate) begun: u64,
    /// Releases whose namespaces are published no more (numbered below this).
    pub(crate) unpublished: u64,
    /// The numbers of those not synced yet.
    pub(crate) in_flight: Vec<u64>,
    /// Syncs that failed.
    pub(crate) failures: u64,
    /// The highest number of a release whose sync failed.
    pub(crate) last_failed: Option<u64>,
}

/// Why a change of the target's subsystems was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChangeError {
    /// a subsystem with this NQN is already served
    #[error("subsystem {0} already exists")]
    Exists(String),
    /// no subsystem with this NQN is served
    #[error("no subsystem {0}")]
    NoSuchSubsystem(String),
}

/// The whole target: shared by every queue on every thread.
#[derive(Clone)]
pub struct Target {
    pub(crate) inner: Arc<TargetInner>,
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target")
            .field("subsystems", &self.subsystems().len())
            .field("controllers", &self.controllers().len())
            .finish()
    }
}

fn read<T>(l: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(|e| e.into_inner())
}

fn write<T>(l: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(|e| e.into_inner())
}

impl Target {
    /// A target serving `subsystems` on `ports` with `limits`.
    pub fn new(subsystems: Vec<Subsystem>, ports: Vec<Port>, limits: Limits) -> Target {
        let t = Target {
            inner: Arc::new(TargetInner {
                subsystems: RwLock::new(Arc::new(Vec::new())),
                version: AtomicU64::new(1),
                next_subsystem_id: AtomicU64::new(1),
                ports: RwLock::new(ports),
                limits,
                controllers: Mutex::new(HashMap::new()),
                retired: Mutex::new(Vec::new()),
                fenced: Mutex::new((0, None)),
                next_cntlid: AtomicU32::new(1),
                genctr: AtomicU64::new(1),
                ctrl_changes: Arc::default(),
                releases: Mutex::new(HashMap::new()),
                connect_hook: Hook::default(),
                io_connect_hook: Hook::default(),
                lost_hook: Hook::default(),
                discovery_hook: Hook::default(),
                removal_hook: Hook::default(),
            }),
        };
        for s in subsystems {
            // Duplicate NQNs are refused by the configuration's validation: the first wins.
            let _ = t.add_subsystem(s);
        }
        t
    }

    /// The limits in force.
    pub fn limits(&self) -> &Limits {
        &self.inner.limits
    }

    /// The subsystems served now, in the order they were added.
    pub fn subsystems(&self) -> Subsystems {
        Arc::clone(&read(&self.inner.subsystems))
    }

    /// The subsystem with this NQN.
    pub fn subsystem(&self, nqn: &str) -> Option<Arc<Subsystem>> {
        self.subsystems().iter().find(|s| s.nqn == nqn).cloned()
    }

    /// The subsystem with this ID.
    pub fn subsystem_by_id(&self, id: u64) -> Option<Arc<Subsystem>> {
        self.subsystems().iter().find(|s| s.id == id).cloned()
    }

    /// Moves on with every change of the subsystems.
    pub fn version(&self) -> u64 {
        self.inner.version.load(Ordering::Acquire)
    }

    /// Moves on whenever a controller ends or is reset. A transport whose queues sit idle
    /// looks for queues that must disconnect ([`crate::Queue::must_disconnect`]) only when
    /// this moved since its last look (every command checks its own queue anyway).
    pub fn controller_changes(&self) -> u64 {
        self.inner.ctrl_changes.count.load(Ordering::Acquire)
    }

    /// Has `waker` run on every controller change from now on (once; false if one was set
    /// already): the daemon wakes its reactors, so that a reset on one reactor's admin queue
    /// ends the I/O queues sleeping on another at once, not when it next wakes. It runs on
    /// the thread that made the change, with that controller's lock held: it must only
    /// signal.
    pub fn set_change_waker(&self, waker: ChangeWaker) -> bool {
        self.inner.ctrl_changes.waker.set(waker).is_ok()
    }

    /// The ports (listeners) reported in the discovery log.
    pub fn ports(&self) -> Vec<Port> {
        read(&self.inner.ports).clone()
    }

    /// Replaces the ports reported in the discovery log.
    pub fn set_ports(&self, ports: Vec<Port>) {
        let changed = {
            let mut p = write(&self.inner.ports);
            let changed = *p != ports;
            *p = ports;
            changed
        };
        self.inner.genctr.fetch_add(1, Ordering::Release);
        if changed {
            self.raise_discovery_changed();
        }
    }

    fn publish(&self, subs: &mut Subsystems, new: Vec<Arc<Subsystem>>) {
        *subs = Arc::new(new);
        self.inner.version.fetch_add(1, Ordering::AcqRel);
        self.inner.genctr.fetch_add(1, Ordering::Release);
    }

    /// A subsystem ID no subsystem has had: for a subsystem whose namespaces are set up on
    /// the data path before it is added ([`Target::add_subsystem_with_id`]).
    pub fn reserve_subsystem_id(&self) -> u64 {
        self.inner.next_subsystem_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Adds a subsystem; returns its ID.
    pub fn add_subsystem(&self, s: Subsystem) -> Result<u64, ChangeError> {
        let id = self.reserve_subsystem_id();
        self.add_subsystem_with_id(s, id)
    }

    /// Adds a subsystem with ID `id` (from [`Target::reserve_subsystem_id`]); returns it.
    pub fn add_subsystem_with_id(&self, mut s: Subsystem, id: u64) -> Result<u64, ChangeError> {
        let mut subs = write(&self.inner.subsystems);
        if subs.iter().any(|x| x.nqn == s.nqn) {
            return Err(ChangeError::Exists(s.nqn));
        }
        s.id = id;
        s.namespaces.sort_by_key(|n| n.nsid);
        let id = s.id;
        let mut new = subs.as_ref().clone();
        new.push(Arc::new(s));
        self.publish(&mut subs, new);
        drop(subs);
        self.raise_discovery_changed();
        Ok(id)
    }

    /// Removes a subsystem: every controller of it ends (its queues disconnect). Returns
    /// the removed subsystem and the controllers ended.
    pub fn remove_subsystem(
        &self,
        nqn: &str,
    ) -> Result<(Arc<Subsystem>, Vec<Arc<Controller>>), ChangeError> {
        let mut subs = write(&self.inner.subsystems);
        let Some(pos) = subs.iter().position(|x| x.nqn == nqn) else {
            return Err(ChangeError::NoSuchSubsystem(nqn.to_owned()));
        };
        let mut new = subs.as_ref().clone();
        let gone = new.remove(pos);
        self.publish(&mut subs, new);
        drop(subs);
        self.inner.removal_hook.run();
        let ended = self.end_where(EndReason::SubsystemRemoved, |c| {
            c.subsystem == Some(gone.id)
        });
        self.raise_discovery_changed();
        Ok((gone, ended))
    }

    /// Replaces the subsystem of the same NQN (its ID is kept) by `s`: its identity, hosts
    /// and namespaces. Every namespace added, removed or changed (size, identifiers, what it
    /// can do) is reported to the subsystem's controllers (Namespace Attribute Changed), and
    /// controllers of hosts no longer allowed end. Returns those controllers.
    pub fn replace_subsystem(&self, mut s: Subsystem) -> Result<Vec<Arc<Controller>>, ChangeError> {
        let mut subs = write(&self.inner.subsystems);
        let Some(pos) = subs.iter().position(|x| x.nqn == s.nqn) else {
            return Err(ChangeError::NoSuchSubsystem(s.nqn));
        };
        let old = Arc::clone(&subs[pos]);
        s.id = old.id;
        s.namespaces.sort_by_key(|n| n.nsid);
        let mut changed: Vec<u32> = Vec::new();
        for n in &s.namespaces {
            if old.namespace(n.nsid).is_none_or(|o| !same_namespace(o, n)) {
                changed.push(n.nsid);
            }
        }
        for o in &old.namespaces {
            if s.namespace(o.nsid).is_none() {
                changed.push(o.nsid);
            }
        }
        changed.sort_unstable();
        let mut new = subs.as_ref().clone();
        let s = Arc::new(s);
        new[pos] = Arc::clone(&s);
        self.publish(&mut subs, new);
        drop(subs);
        for nsid in changed {
            self.raise_namespace_changed(s.id, nsid);
        }
        // Who may see it in the discovery log.
        if s.allow_any_host != old.allow_any_host || s.hosts != old.hosts {
            self.raise_discovery_changed();
        }
        Ok(self.end_where(EndReason::AccessRevoked, |c| {
            c.subsystem == Some(s.id) && !s.allows(&c.hostnqn)
        }))
    }

    /// Ends the controllers `pick` chooses, for `why`; returns them.
    fn end_where(
        &self,
        why: EndReason,
        pick: impl Fn(&Controller) -> bool,
    ) -> Vec<Arc<Controller>> {
        let ended: Vec<Arc<Controller>> = self
            .ctrls()
            .values()
            .filter(|c| pick(c) && !c.is_dead())
            .cloned()
            .collect();
        for c in &ended {
            c.end(why);
        }
        ended
    }

    /// Ends controller `cntlid` (an operator's disconnect); its queues disconnect.
    pub fn disconnect_controller(&self, cntlid: u16) -> Option<Arc<Controller>> {
        self.end_where(EndReason::Disconnected, |c| c.cntlid == cntlid)
            .pop()
    }

    /// Ends every controller of host `hostnqn`; returns them.
    pub fn disconnect_host(&self, hostnqn: &str) -> Vec<Arc<Controller>> {
        self.end_where(EndReason::Disconnected, |c| c.hostnqn == hostnqn)
    }

    pub(crate) fn ctrls(&self) -> MutexGuard<'_, HashMap<u16, Arc<Controller>>> {
        self.inner
            .controllers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Live controllers.
    pub fn controllers(&self) -> Vec<Arc<Controller>> {
        self.ctrls().values().cloned().collect()
    }

    /// Allocates a controller ID from `lo` to `hi` (within 1 to 0xFFEF) not in use. Called
    /// with the controllers' map locked: successive counter values cover the range.
    pub(crate) fn alloc_cntlid(
        &self,
        map: &HashMap<u16, Arc<Controller>>,
        (lo, hi): (u16, u16),
    ) -> Option<u16> {
        let (lo, hi) = (lo.max(1), hi.min(0xFFEF));
        let span = u32::from(hi.checked_sub(lo)?) + 1;
        for _ in 0..span {
            let n = self.inner.next_cntlid.fetch_add(1, Ordering::Relaxed);
            let id = u16::try_from(u32::from(lo) + n % span).ok()?;
            if !map.contains_key(&id) {
                return Some(id);
            }
        }
        None
    }
}

/// Whether two namespaces of one NSID look the same to a host.
fn same_namespace(a: &Namespace, b: &Namespace) -> bool {
    a.info == b.info && a.uuid == b.uuid && a.nguid == b.nguid
}
