//! The configuration schema: every table and key of `nvmfd.toml`, with its default.
//!
//! Unknown keys are errors everywhere (`deny_unknown_fields`), so a typo never silently falls
//! back to a default.

use std::net::IpAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::units::{ByteSize, HumanDuration};

/// The whole configuration file.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// `[daemon]`: threads, admin socket and logging.
    #[serde(default)]
    pub daemon: DaemonConfig,
    /// `[[listener]]`: the addresses the target listens on.
    #[serde(default, rename = "listener")]
    pub listeners: Vec<Listener>,
    /// `[transport]`: queue, capsule, I/O size, SRQ and keep-alive limits of the RDMA transport.
    #[serde(default)]
    pub transport: TransportConfig,
    /// `[[subsystem]]`: the NVM subsystems exported, each with its namespaces.
    #[serde(default, rename = "subsystem")]
    pub subsystems: Vec<Subsystem>,
}

/// `[daemon]`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DaemonConfig {
    /// CPU cores to run one pinned poll-mode reactor thread on, each. Default: `[0]`.
    /// Every core must exist and be allowed to this process (its CPU affinity mask).
    #[serde(default = "defaults::reactor_cores")]
    pub reactor_cores: Vec<usize>,
    /// Path of the admin Unix socket (mode 0660). Must be absolute. Default:
    /// `/run/nvmfd/nvmfd.sock`; its directory is created if missing.
    #[serde(default = "defaults::admin_socket")]
    pub admin_socket: PathBuf,
    /// Least severe level logged: `error`, `warn`, `info`, `debug` or `trace`. Default `info`.
    /// The environment variable `NVMFD_LOG` overrides it.
    #[serde(default)]
    pub log_level: LogLevel,
    /// `auto` (human-readable on a terminal, one JSON object per line otherwise), `human` or
    /// `json`. Default `auto`.
    #[serde(default)]
    pub log_format: LogFormat,
    /// A reactor whose heartbeat has not moved for this long is stalled: it is logged and the
    /// systemd watchdog is no longer fed. Default `"2s"`.
    #[serde(default = "defaults::stall_timeout")]
    pub stall_timeout: HumanDuration,
    /// A reactor that found no work for this long sleeps until woken (adaptive polling) instead
    /// of spinning; `"0s"` never sleeps. Default `"1ms"`.
    #[serde(default = "defaults::idle_sleep_after")]
    pub idle_sleep_after: HumanDuration,
    /// An admin-socket client that sends nothing for this long is disconnected. Default `"30s"`.
    #[serde(default = "defaults::admin_client_timeout")]
    pub admin_client_timeout: HumanDuration,
}

impl Default for DaemonConfig {
    fn default() -> Self {
        Self {
            reactor_cores: defaults::reactor_cores(),
            admin_socket: defaults::admin_socket(),
            log_level: LogLevel::default(),
            log_format: LogFormat::default(),
            stall_timeout: defaults::stall_timeout(),
            idle_sleep_after: defaults::idle_sleep_after(),
            admin_client_timeout: defaults::admin_client_timeout(),
        }
    }
}

/// Log severity threshold.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq, PartialOrd, Ord)]
#[serde(rename_all = "lowercase")]
pub enum LogLevel {
    /// Only errors.
    Error,
    /// Errors and warnings.
    Warn,
    /// The default: lifecycle events, connections, and everything above.
    #[default]
    Info,
    /// Per-request detail that helps debugging; verbose.
    Debug,
    /// Everything.
    Trace,
}

impl std::str::FromStr for LogLevel {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "error" => Ok(Self::Error),
            "warn" | "warning" => Ok(Self::Warn),
            "info" => Ok(Self::Info),
            "debug" => Ok(Self::Debug),
            "trace" => Ok(Self::Trace),
            other => Err(format!(
                "unknown log level `{other}`: expected error, warn, info, debug or trace"
            )),
        }
    }
}

/// Log output format.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// `human` when standard error is a terminal, `json` otherwise (journald, files).
    #[default]
    Auto,
    /// Human-readable, aligned, with colours on a terminal.
    Human,
    /// One JSON object per line and per event.
    Json,
}

/// `[[listener]]`: one address the target accepts connections on.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Listener {
    /// IPv4 or IPv6 address to listen on (an RDMA device's IP address for `ibverbs`).
    pub address: IpAddr,
    /// Port (NVMe-oF `trsvcid`). Default 4420, the NVMe-oF port.
    #[serde(default = "defaults::port")]
    pub port: u16,
    /// Verbs provider: `ibverbs` (an RDMA NIC or Soft-RoCE through rdma-core) or `soft`
    /// (nvmfd's user-space RDMA provider over TCP, for machines without RDMA). Default `ibverbs`.
    #[serde(default)]
    pub provider: Provider,
}

/// Which verbs provider serves a listener.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq, Hash)]
#[serde(rename_all = "lowercase")]
pub enum Provider {
    /// rdma-core's libibverbs and librdmacm.
    #[default]
    Ibverbs,
    /// nvmfd's user-space provider.
    Soft,
}

impl std::fmt::Display for Provider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Provider::Ibverbs => "ibverbs",
            Provider::Soft => "soft",
        })
    }
}

/// `[transport]`: limits of the RDMA transport, advertised to hosts.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TransportConfig {
    /// Largest queue size (entries) granted to a host's admin or I/O queue; 32 to 1024.
    /// Default 128.
    #[serde(default = "defaults::max_queue_depth")]
    pub max_queue_depth: u32,
    /// Largest number of I/O queues one controller may have; 1 to 1024. Default 64.
    #[serde(default = "defaults::max_io_queues")]
    pub max_io_queues: u32,
    /// The largest namespace ID a subsystem may have, 1 to 4294967294: what Identify
    /// Controller reports as NN, so that every NSID up to it is valid (an inactive one has a
    /// zeroed Identify Namespace) and namespaces can be added under new NSIDs while hosts
    /// are connected. Default 1024.
    #[serde(default = "defaults::max_nsid")]
    pub max_nsid: u32,
    /// In-capsule data accepted with a command (IOCCSZ); a multiple of 16 bytes, at most 16KiB
    /// and at most `max_io_size`; 0 turns in-capsule data off. Default `"4KiB"`.
    #[serde(default = "defaults::in_capsule_data_size")]
    pub in_capsule_data_size: ByteSize,
    /// Largest transfer of one command (MDTS); a power of two from 8KiB to 8MiB.
    /// Default `"128KiB"`.
    #[serde(default = "defaults::max_io_size")]
    pub max_io_size: ByteSize,
    /// Back each reactor's data buffers with 2 MiB huge pages (fewer TLB misses, and fewer
    /// pages for the NIC to translate); where none are reserved (`vm.nr_hugepages`), normal
    /// pages are used and the log says so. Default false.
    #[serde(default)]
    pub huge_pages: bool,
    /// Receives posted to each shared receive queue at start. Default 256.
    #[serde(default = "defaults::srq_initial")]
    pub srq_initial: u32,
    /// Most receives a shared receive queue may grow to. Default 4096.
    #[serde(default = "defaults::srq_max")]
    pub srq_max: u32,
    /// When fewer receives than this remain posted, the SRQ limit event fires and the SRQ
    /// grows; below `srq_initial`. Default 64.
    #[serde(default = "defaults::srq_low_watermark")]
    pub srq_low_watermark: u32,
    /// Receives added (and registered) per growth step; 1 to `srq_max`. Default 256.
    #[serde(default = "defaults::srq_grow_chunk")]
    pub srq_grow_chunk: u32,
    /// How long the SRQ must have stayed at least a chunk above the low watermark before a
    /// grown chunk is given back; 10ms to 1h. Default `"30s"`.
    #[serde(default = "defaults::srq_shrink_delay")]
    pub srq_shrink_delay: HumanDuration,
    /// Keep at least as many receives registered and posted as the connected queues can have
    /// commands outstanding (each queue's depth, up to `srq_max`), grown before a connection
    /// is accepted, so that a host never meets an empty SRQ. `false` sizes the SRQ by load
    /// alone and relies on the hosts' RNR retries while it grows. Default `true`.
    #[serde(default = "defaults::srq_cover_queues")]
    pub srq_cover_queues: bool,
    /// Shortest keep-alive timeout granted: a host asking for less gets this. Default `"1s"`.
    #[serde(default = "defaults::keep_alive_timeout_min")]
    pub keep_alive_timeout_min: HumanDuration,
    /// Longest keep-alive timeout granted; also a discovery controller's when its host asks
    /// for none (an I/O controller whose host asks for none has no keep-alive, as the
    /// specification says). Default `"120s"`.
    #[serde(default = "defaults::keep_alive_timeout_max")]
    pub keep_alive_timeout_max: HumanDuration,
    /// How long an accepted connection may go without a Fabrics Connect command from its host
    /// before it is ended and everything it holds is released (its QP, CM ID and SRQ
    /// reservation); 10ms to 1h. Default `"60s"`: the Linux host gives up on its own Connect
    /// sooner (its admin and I/O command timeouts, 60 s and 30 s by default), so a live host is
    /// never cut off.
    #[serde(default = "defaults::connect_timeout")]
    pub connect_timeout: HumanDuration,
}

impl Default for TransportConfig {
    fn default() -> Self {
        Self {
            max_queue_depth: defaults::max_queue_depth(),
            max_io_queues: defaults::max_io_queues(),
            max_nsid: defaults::max_nsid(),
            in_capsule_data_size: defaults::in_capsule_data_size(),
            max_io_size: defaults::max_io_size(),
            huge_pages: false,
            srq_initial: defaults::srq_initial(),
            srq_max: defaults::srq_max(),
            srq_low_watermark: defaults::srq_low_watermark(),
            srq_grow_chunk: defaults::srq_grow_chunk(),
            srq_shrink_delay: defaults::srq_shrink_delay(),
            srq_cover_queues: defaults::srq_cover_queues(),
            keep_alive_timeout_min: defaults::keep_alive_timeout_min(),
            keep_alive_timeout_max: defaults::keep_alive_timeout_max(),
            connect_timeout: defaults::connect_timeout(),
        }
    }
}

/// `[[subsystem]]`: one NVM subsystem.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Subsystem {
    /// NVMe Qualified Name, e.g. `nqn.2024-01.com.example:ram0` (at most 223 bytes).
    pub nqn: String,
    /// Serial number reported in Identify Controller: printable ASCII, at most 20 characters.
    /// Default: derived from the NQN, stable across restarts.
    #[serde(default)]
    pub serial: Option<String>,
    /// Model number reported in Identify Controller: printable ASCII, at most 40 characters.
    /// Default `"nvmfd"`.
    #[serde(default = "defaults::model")]
    pub model: String,
    /// The lowest controller ID its controllers take, 1 to 65519. Default 1.
    #[serde(default = "defaults::cntlid_min")]
    pub cntlid_min: u16,
    /// The highest controller ID its controllers take, `cntlid_min` to 65519 (FFEFh). Default
    /// 65519. Gateways serving one NQN (two daemons exporting one RBD image) give each a
    /// range of its own: a host refuses a second path to a subsystem whose controller has the
    /// ID of one it already has (the Linux host: "Duplicate cntlid").
    #[serde(default = "defaults::cntlid_max")]
    pub cntlid_max: u16,
    /// Let any host NQN connect. Default `false`: only the NQNs of `hosts` may.
    #[serde(default)]
    pub allow_any_host: bool,
    /// Host NQNs allowed to connect when `allow_any_host` is false.
    #[serde(default)]
    pub hosts: Vec<String>,
    /// `[[subsystem.namespace]]`: the namespaces of this subsystem.
    #[serde(default, rename = "namespace")]
    pub namespaces: Vec<Namespace>,
}

/// `[[subsystem.namespace]]`: one namespace and the storage behind it.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Namespace {
    /// Namespace ID, 1 to 4294967294, unique in its subsystem.
    pub nsid: u32,
    /// What stores the data: `file`, `bdev` (a block device), `rbd` (a Ceph RBD image),
    /// `malloc` (RAM) or `null` (discards writes, reads zeroes; for transport benchmarks).
    pub backend: Backend,
    /// Path of the file or block device (`file` and `bdev` only).
    #[serde(default)]
    pub path: Option<PathBuf>,
    /// Capacity (`malloc` and `null`; `rbd` with `create`, the size of a new image; a file,
    /// a block device or an existing image has its own size).
    #[serde(default)]
    pub size: Option<ByteSize>,
    /// Logical block size, 512 or 4096 bytes (`malloc`, `null`, `file` and `rbd`; a block
    /// device reports its own). Default 512.
    #[serde(default = "defaults::block_size")]
    pub block_size: ByteSize,
    /// Refuse writes to this namespace. Default `false`.
    #[serde(default)]
    pub read_only: bool,
    /// Namespace UUID reported to hosts (`"xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"`). Default,
    /// when `nguid` is not set either: one derived from the subsystem's NQN, the NSID and the
    /// store (docs/CONFIGURATION.md).
    #[serde(default)]
    pub uuid: Option<Uuid>,
    /// Namespace Globally Unique Identifier, 32 hex digits. Default: none reported.
    #[serde(default)]
    pub nguid: Option<String>,
    /// The RADOS pool of the image (`rbd` only, required).
    #[serde(default)]
    pub pool: Option<String>,
    /// The RBD image (`rbd` only, required).
    #[serde(default)]
    pub image: Option<String>,
    /// The RADOS namespace in the pool (`rbd` only). Default: the pool's default namespace.
    #[serde(default)]
    pub namespace: Option<String>,
    /// The Ceph configuration file (`rbd` only). Default `/etc/ceph/ceph.conf`.
    #[serde(default)]
    pub ceph_conf: Option<PathBuf>,
    /// The cephx user without `client.` (`rbd` only); its keyring is found where Ceph looks
    /// (the `keyring` option of `ceph_conf`, /etc/ceph/ceph.client.ID.keyring, ...). Default
    /// `admin`.
    #[serde(default)]
    pub client_id: Option<String>,
    /// Create the image with `size` when it does not exist (`rbd` only). Default `false`.
    #[serde(default)]
    pub create: bool,
}

impl Namespace {
    /// `ceph_conf`, or its default.
    pub fn ceph_conf(&self) -> PathBuf {
        self.ceph_conf
            .clone()
            .unwrap_or_else(|| PathBuf::from("/etc/ceph/ceph.conf"))
    }

    /// `client_id`, or its default.
    pub fn client_id(&self) -> String {
        self.client_id.clone().unwrap_or_else(|| "admin".into())
    }
}

/// Namespace storage backend.
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// A regular file, through io_uring.
    File,
    /// A block device, through io_uring.
    Bdev,
    /// A Ceph RBD image, through librbd.
    Rbd,
    /// RAM.
    Malloc,
    /// No storage: writes are discarded, reads return zeroes.
    Null,
}

impl Backend {
    /// Whether this backend stores data in a file or device named by `path`.
    pub fn has_path(self) -> bool {
        matches!(self, Backend::File | Backend::Bdev)
    }
}

/// Default values, one function per key (serde needs functions).
pub mod defaults {
    use super::*;

    /// `daemon.reactor_cores`
    pub fn reactor_cores() -> Vec<usize> {
        vec![0]
    }
    /// `daemon.admin_socket`
    pub fn admin_socket() -> PathBuf {
        PathBuf::from("/run/nvmfd/nvmfd.sock")
    }
    /// `daemon.stall_timeout`
    pub fn stall_timeout() -> HumanDuration {
        HumanDuration::secs(2)
    }
    /// `daemon.idle_sleep_after`
    pub fn idle_sleep_after() -> HumanDuration {
        HumanDuration::millis(1)
    }
    /// `daemon.admin_client_timeout`
    pub fn admin_client_timeout() -> HumanDuration {
        HumanDuration::secs(30)
    }
    /// `listener.port`
    pub fn port() -> u16 {
        4420
    }
    /// `transport.max_queue_depth`
    pub fn max_queue_depth() -> u32 {
        128
    }
    /// `transport.max_nsid`
    pub fn max_nsid() -> u32 {
        1024
    }
    /// `transport.max_io_queues`
    pub fn max_io_queues() -> u32 {
        64
    }
    /// `subsystem.cntlid_min`
    pub fn cntlid_min() -> u16 {
        1
    }
    /// `subsystem.cntlid_max`: the highest controller ID the specification allows (FFEFh).
    pub fn cntlid_max() -> u16 {
        0xFFEF
    }
    /// `transport.in_capsule_data_size`
    pub fn in_capsule_data_size() -> ByteSize {
        ByteSize::kib(4)
    }
    /// `transport.max_io_size`
    pub fn max_io_size() -> ByteSize {
        ByteSize::kib(128)
    }
    /// `transport.srq_initial`
    pub fn srq_initial() -> u32 {
        256
    }
    /// `transport.srq_max`
    pub fn srq_max() -> u32 {
        4096
    }
    /// `transport.srq_low_watermark`
    pub fn srq_low_watermark() -> u32 {
        64
    }
    /// `transport.srq_grow_chunk`
    pub fn srq_grow_chunk() -> u32 {
        256
    }
    /// `transport.srq_shrink_delay`
    pub fn srq_shrink_delay() -> HumanDuration {
        HumanDuration::secs(30)
    }
    /// `transport.srq_cover_queues`
    pub fn srq_cover_queues() -> bool {
        true
    }
    /// `transport.keep_alive_timeout_min`
    pub fn keep_alive_timeout_min() -> HumanDuration {
        HumanDuration::secs(1)
    }
    /// `transport.keep_alive_timeout_max`
    pub fn keep_alive_timeout_max() -> HumanDuration {
        HumanDuration::secs(120)
    }
    /// `transport.connect_timeout`
    pub fn connect_timeout() -> HumanDuration {
        HumanDuration::secs(60)
    }
    /// `subsystem.model`
    pub fn model() -> String {
        "nvmfd".to_owned()
    }
    /// `subsystem.namespace.block_size`
    pub fn block_size() -> ByteSize {
        ByteSize(512)
    }
}
