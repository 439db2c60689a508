//! The target's model: subsystems with namespaces and allowed hosts, the discovery subsystem,
//! and the controllers that Fabrics Connect creates.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::block::NamespaceInfo;

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
}

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
    /// Largest transfer per command, bytes (a power of two, at least 4 KiB).
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
#[derive(Clone, Debug)]
pub struct Port {
    /// IP address.
    pub addr: IpAddr,
    /// Port (trsvcid).
    pub port: u16,
}

/// Why a controller ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EndReason {
    /// The host stopped sending keep-alives.
    KeepAliveExpired,
    /// The admin queue went away.
    AdminQueueLost,
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
    pub aec: u32,
    pub held_aers: Vec<u16>,
    pub pending_events: Vec<u32>,
    pub changed_nsids: Vec<u32>,
    /// CC.EN went from 1 to 0 and I/O queues of the controller may still exist: CSTS.RDY
    /// reads 1 until the last of them is gone (`io_queues_alive`).
    pub resetting: bool,
    /// CC.SHN was set while I/O queues of the controller still existed: the namespaces are
    /// flushed (and SHST completes) once the last of them is gone.
    pub shutdown_pending: bool,
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
    /// Index of its subsystem in the target, or `None` for the discovery controller.
    pub subsystem: Option<usize>,
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
    /// I/O queues bound to it and not yet dropped. A transport drops a queue only once its
    /// connection is torn down and every block operation of it has completed, so a reset or
    /// shutdown that waits for this to reach 0 has nothing of the old queues left in flight.
    pub(crate) io_queues_alive: AtomicU32,
    /// SMART counters.
    pub(crate) host_reads: AtomicU64,
    pub(crate) host_writes: AtomicU64,
    pub(crate) bytes_read: AtomicU64,
    pub(crate) bytes_written: AtomicU64,
}

impl Controller {
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
    }

    /// The keep-alive timeout in force (zero: none).
    pub fn kato(&self) -> Duration {
        self.lock().kato
    }
}

pub(crate) struct TargetInner {
    pub subsystems: Vec<Subsystem>,
    pub ports: Vec<Port>,
    pub limits: Limits,
    pub controllers: Mutex<HashMap<u16, Arc<Controller>>>,
    pub next_cntlid: AtomicU32,
    pub genctr: AtomicU64,
}

/// The whole target: shared by every queue on every thread.
#[derive(Clone)]
pub struct Target {
    pub(crate) inner: Arc<TargetInner>,
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target")
            .field("subsystems", &self.inner.subsystems.len())
            .field("controllers", &self.controllers().len())
            .finish()
    }
}

impl Target {
    /// A target serving `subsystems` on `ports` with `limits`.
    pub fn new(subsystems: Vec<Subsystem>, ports: Vec<Port>, limits: Limits) -> Target {
        let mut subsystems = subsystems;
        for s in &mut subsystems {
            s.namespaces.sort_by_key(|n| n.nsid);
        }
        Target {
            inner: Arc::new(TargetInner {
                subsystems,
                ports,
                limits,
                controllers: Mutex::new(HashMap::new()),
                next_cntlid: AtomicU32::new(1),
                genctr: AtomicU64::new(1),
            }),
        }
    }

    /// The limits in force.
    pub fn limits(&self) -> &Limits {
        &self.inner.limits
    }

    /// Subsystems, in configuration order.
    pub fn subsystems(&self) -> &[Subsystem] {
        &self.inner.subsystems
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

    /// Allocates a controller ID (1 to 0xFFEF) not in use.
    pub(crate) fn alloc_cntlid(&self, map: &HashMap<u16, Arc<Controller>>) -> Option<u16> {
        for _ in 0..0xFFEF {
            let id = self.inner.next_cntlid.fetch_add(1, Ordering::Relaxed) % 0xFFEF + 1;
            let id = u16::try_from(id).ok()?;
            if !map.contains_key(&id) {
                return Some(id);
            }
        }
        None
    }

    /// Ends every controller whose keep-alive timeout has passed; returns them. The control
    /// thread calls this periodically; their queues see it and disconnect.
    pub fn expire_keep_alives(&self, now: Instant) -> Vec<Arc<Controller>> {
        let mut ended = Vec::new();
        let mut map = self.ctrls();
        map.retain(|_, c| {
            let mut st = c.lock();
            if c.traffic.swap(false, std::sync::atomic::Ordering::Relaxed) {
                st.last_keep_alive = now;
            }
            let expired =
                !st.kato.is_zero() && now.saturating_duration_since(st.last_keep_alive) > st.kato;
            drop(st);
            if expired {
                c.end(EndReason::KeepAliveExpired);
                ended.push(Arc::clone(c));
            }
            !expired
        });
        ended
    }

    /// Records that namespace `nsid` of subsystem `subnqn` changed (its size, say): every
    /// controller of that subsystem gets a Namespace Attribute Changed event.
    pub fn namespace_changed(&self, subnqn: &str, nsid: u32) {
        let Some(idx) = self.inner.subsystems.iter().position(|s| s.nqn == subnqn) else {
            return;
        };
        self.inner.genctr.fetch_add(1, Ordering::Relaxed);
        for c in self.ctrls().values() {
            if c.subsystem == Some(idx) {
                let mut st = c.lock();
                if !st.changed_nsids.contains(&nsid) {
                    st.changed_nsids.push(nsid);
                }
                // Notice, Namespace Attribute Changed, log page 04h: sent only when enabled.
                if st.aec & (1 << 8) != 0 {
                    st.pending_events.push(0x0004_0002);
                }
            }
        }
    }
}
