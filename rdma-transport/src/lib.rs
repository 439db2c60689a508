//! The RDMA transport of nvmfd: verbs providers (`ibverbs` over rdma-sys and rdma_cm, and
//! `soft`, a user-space provider), memory regions, the elastic SRQ, queue pairs and their
//! recovery, and the connection manager.
//!
//! Not written yet: this crate holds nothing, and no listener accepts connections today.
//! See `docs/ARCHITECTURE.md` for what it will own.
