//! NVMe and NVMe over Fabrics for nvmfd: byte-exact wire types ([`wire`]), and the
//! transport-agnostic target ([`Target`], [`Queue`]): subsystems, namespaces, discovery,
//! Fabrics Connect and properties, admin and I/O commands. The core is sans-I/O: a transport
//! hands over capsules and carries out the [`Action`]s that come back (move data, run a block
//! operation, send a completion). [`host`] is the other side. Block devices reach the core
//! only as [`NamespaceInfo`] and [`BlockFailure`]: it depends on no block layer. (The tests'
//! loopback transport, in `tests/support/`, connects host and target in one process over
//! real `nvmfd-blockdev` devices.)

mod admin;
mod block;
mod fence;
pub mod host;
#[doc(hidden)]
pub mod host_fake;
mod io;
mod queue;
pub mod rdma_cm;
mod target;
pub mod wire;

pub use admin::{AER_LIMIT, NOT_READY_RETRY_DELAY_100MS, RETRY_DELAY_100MS};
pub use block::{BlockFailure, NamespaceInfo};
pub use io::{block_error_status, DsmLimits, DSM_MAX_RANGES};
pub use queue::{
    keyed_segments, Action, CmParams, Command, DataRef, IoOp, IoRequest, Queue,
    MAX_SGL_DESCRIPTORS, SQE_SIZE,
};
pub use target::{
    ChangeCount, ChangeError, ChangeWaker, ConnectHook, Controller, EndReason, Limits, Namespace,
    Port, QueueInfo, QueueStats, Releases, Subsystem, Subsystems, Target, ALL_CNTLIDS,
    DISCOVERY_CHANGED_EVENT, DISCOVERY_NQN, NS_ATTR_CHANGED_EVENT, NVME_VERSION,
    SHUTDOWN_FLUSH_KEEPS_ALIVE,
};
