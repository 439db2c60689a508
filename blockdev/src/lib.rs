//! Block devices for nvmfd: the per-reactor trait, and the io_uring file/block-device,
//! `malloc` (RAM) and `null` backends.
//!
//! Not written yet: this crate holds nothing, and no namespace is opened today.
//! See `docs/ARCHITECTURE.md` for what it will own.
