//! The RDMA layer of nvmfd: provider-neutral verbs types ([`types`]) and the `soft` provider
//! ([`soft`]), a user-space RDMA fabric with the semantics the daemon depends on.
//!
//! Still to come: the `ibverbs` provider over rdma-sys and rdma_cm behind the same API, the
//! TCP wire and seeded fault injection of the soft provider, the elastic SRQ and QP recovery.
//! Nothing in the daemon uses this crate yet.

pub mod any;
pub mod soft;
pub mod types;

pub use types::*;
#[cfg(feature = "ibverbs")]
pub mod ibverbs;
