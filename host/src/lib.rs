//! The NVMe-oF host library behind the `nvmf` command: discover, connect, identify, read,
//! write, bench.
//!
//! Not written yet: this crate holds nothing. See `docs/ARCHITECTURE.md` for what it will own.
