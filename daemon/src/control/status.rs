//! What the control thread answers `status`, `controllers` and `stats` with.

use serde::{Deserialize, Serialize};

use super::*;
use crate::stats::{AdminStats, Stats};

/// One queue of a controller, in `controllers`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct QueueStatus {
    /// Queue ID (0: admin).
    pub qid: u16,
    /// Entries.
    pub depth: u32,
    /// Commands received on it.
    pub commands: u64,
}

/// A live controller, in `controllers`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ControllerStatus {
    /// Controller ID.
    pub cntlid: u16,
    /// Its subsystem's NQN.
    pub subsystem: String,
    /// The host's NQN.
    pub host: String,
    /// The host's address (of its admin queue's connection).
    pub host_address: Option<String>,
    /// Keep-alive timeout in force, milliseconds (0: none).
    pub keep_alive_ms: u64,
    /// Commands received on all its queues.
    pub commands: u64,
    /// Its queues.
    pub queues: Vec<QueueStatus>,
}

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
    /// devices could not be synced (at stop, or when let go of): writes completed on them
    /// may not be durable
    #[error(
        "{0} namespace devices could not be synced: writes completed on them may not be durable"
    )]
    NotSynced(usize),
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
    /// Number of namespaces served (see `Status::namespaces` for any that are not).
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
    /// Every configured namespace: served, or why not.
    #[serde(default)]
    pub namespaces: Vec<crate::serve::NamespaceStatus>,
    /// Devices let go of (a namespace removed or reopened) whose sync has not ended yet.
    #[serde(default)]
    pub releases_syncing: usize,
    /// Devices let go of whose sync failed: writes hosts completed on them may be lost (the
    /// daemon exits with an error at stop).
    #[serde(default)]
    pub release_sync_failures: usize,
}

impl Daemon {
    /// Listener `i`'s status as hosts find it: one that a reactor could not set up a data
    /// path for is not serving (that reactor refuses the connections handed to it).
    pub(super) fn listener_status(&self, i: usize) -> ListenerStatus {
        let mut st = self.listeners[i].clone();
        if st.serving {
            for (r, u) in self.unserved.iter().enumerate() {
                if let Some(why) = u.lock().unwrap_or_else(|e| e.into_inner()).get(&i) {
                    st.serving = false;
                    st.reason = Some(format!(
                        "reactor {r} could not set up a data path on its device: {why}"
                    ));
                    break;
                }
            }
        }
        st
    }

    pub(super) fn status_line(&self) -> String {
        let namespaces: usize = self.cfg.subsystems.iter().map(|s| s.namespaces.len()).sum();
        let live: Vec<usize> = (0..self.listeners.len())
            .filter(|&i| self.listener_slots.get(i).is_some_and(Option::is_some))
            .collect();
        let serving = live
            .iter()
            .filter(|&&i| self.listener_status(i).serving)
            .count();
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
            live.len(),
            self.reactors.len()
        );
        if stalled > 0 {
            s.push_str(&format!(", {stalled} STALLED"));
        }
        s
    }

    /// Live controllers, for `nvmfctl controllers`.
    pub(super) fn controllers(&self) -> Vec<ControllerStatus> {
        let Some(t) = &self.target else {
            return Vec::new();
        };
        let mut out: Vec<ControllerStatus> = t
            .controllers()
            .iter()
            .filter(|c| !c.is_dead())
            .map(|c| {
                let q = c.queues();
                ControllerStatus {
                    cntlid: c.cntlid,
                    subsystem: c.subnqn.clone(),
                    host: c.hostnqn.clone(),
                    host_address: q.first().and_then(|q| q.peer.clone()),
                    keep_alive_ms: u64::try_from(c.kato().as_millis()).unwrap_or(u64::MAX),
                    queues: q
                        .iter()
                        .map(|q| QueueStatus {
                            qid: q.qid,
                            depth: q.depth,
                            commands: q.commands,
                        })
                        .collect(),
                    commands: q.iter().map(|q| q.commands).sum(),
                }
            })
            .collect();
        out.sort_by_key(|c| c.cntlid);
        out
    }

    pub(super) fn status(&self) -> Status {
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
            listeners: (0..self.listeners.len())
                .filter(|&i| self.listener_slots.get(i).is_some_and(Option::is_some))
                .map(|i| self.listener_status(i))
                .collect(),
            subsystems: self
                .cfg
                .subsystems
                .iter()
                .map(|s| SubsystemStatus {
                    nqn: s.nqn.clone(),
                    namespaces: self
                        .namespaces
                        .iter()
                        .filter(|n| n.serving && n.subsystem == s.nqn)
                        .count(),
                    allow_any_host: s.allow_any_host,
                    hosts: s.hosts.clone(),
                })
                .collect(),
            namespaces: self
                .namespaces
                .iter()
                .cloned()
                .map(|mut n| {
                    let dev = self.devices.get(&(n.subsystem.clone(), n.nsid));
                    n.backend_size = dev.and_then(|d| d.backend_size());
                    n.sync_failed = dev.is_some_and(|d| d.sync_failed());
                    n
                })
                .collect(),
            releases_syncing: self.leaving.len() + self.release_syncs.len(),
            release_sync_failures: self.release_sync_failures,
        }
    }

    pub(super) fn stats(&self, admin: &AdminStats) -> Stats {
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
                .filter(|(i, _)| self.listener_slots.get(*i).is_some_and(Option::is_some))
                .map(|(i, (st, c))| ListenerStats {
                    id: i,
                    address: address_and_port(&st.address, st.port),
                    provider: st.provider.clone(),
                    serving: st.serving && self.listener_status(i).serving,
                    device_removals_total: c.device_removals,
                    returns_total: c.returns,
                    address_changes_total: c.address_changes,
                })
                .collect(),
            admin: admin.clone(),
        }
    }
}

/// `address:port`, an IPv6 address in brackets so that its port is not read as a group.
pub(super) fn address_and_port(address: &str, port: u16) -> String {
    match address.parse::<std::net::IpAddr>() {
        Ok(ip) => std::net::SocketAddr::new(ip, port).to_string(),
        Err(_) => format!("{address}:{port}"),
    }
}

#[cfg(test)]
mod address_tests {
    #[test]
    fn an_ipv6_listener_address_is_bracketed_before_its_port() {
        assert_eq!(super::address_and_port("fe80::1", 4420), "[fe80::1]:4420");
        assert_eq!(super::address_and_port("10.0.0.1", 4420), "10.0.0.1:4420");
    }
}
