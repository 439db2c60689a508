//! The RDMA layer of nvmfd: provider-neutral verbs types ([`types`]), the `soft` provider
//! ([`soft`]), a user-space RDMA fabric with the semantics the daemon depends on (in-process
//! and TCP wires, seeded fault injection), the `ibverbs` provider over rdma-sys and rdma_cm
//! behind the same API, and [`any`], one set of types over both, which the daemon uses.

pub mod any;
pub mod soft;
pub mod types;

pub use types::*;
#[cfg(feature = "ibverbs")]
pub mod ibverbs;
