//! NVMe and NVMe over Fabrics: wire types and the transport-agnostic controller (subsystems,
//! namespaces, admin, fabrics, discovery and I/O command handling).
//!
//! Not written yet: this crate holds nothing, and nothing in nvmfd serves NVMe commands today.
//! See `docs/ARCHITECTURE.md` for what it will own.
