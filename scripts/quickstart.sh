#!/usr/bin/env bash
# Installs what nvmfd needs, builds it, and runs it in the foreground on the example
# configuration (a 1 GiB RAM namespace on 127.0.0.1:4420 over the `soft` provider).
# In another terminal: nvmfctl status; nvmf verify --nqn nqn.2024-01.io.nvmfd:ram0
# (Ctrl-C stops the daemon.)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cargo build --release --bins --locked
install -d /usr/local/bin
install -m 0755 target/release/nvmfd target/release/nvmfctl target/release/nvmf /usr/local/bin/
exec /usr/local/bin/nvmfd --config "${1:-config/examples/ram.toml}"
