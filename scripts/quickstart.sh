#!/usr/bin/env bash
# The quick start, on Debian 12 as root with nothing installed first: installs what building and
# running nvmfd needs from Debian's packages (scripts/install-deps.sh --build-only, Rust
# included), builds nvmfd, installs nvmfd, nvmfctl and nvmf to /usr/local/bin, and runs the
# daemon in the foreground on the example configuration (a 1 GiB RAM namespace on
# 127.0.0.1:4420 over the `soft` provider). Ctrl-C stops it.
# In another terminal: nvmfctl status; nvmf verify --nqn nqn.2024-01.io.nvmfd:ram0
#   scripts/quickstart.sh [CONFIG]    serve CONFIG instead of config/examples/ram.toml
#   scripts/quickstart.sh --no-run    install and build only
set -euo pipefail
cd "$(dirname "$0")/.."
run=1
if [ "${1:-}" = --no-run ]; then run=; shift; fi
scripts/install-deps.sh --build-only
cargo build --release --bins --locked
install -d /usr/local/bin
install -m 0755 target/release/nvmfd target/release/nvmfctl target/release/nvmf /usr/local/bin/
# Where the systemd unit's Documentation= points.
install -D -m 0644 -t /usr/local/share/doc/nvmfd README.md docs/*.md
echo "quickstart: nvmfd, nvmfctl and nvmf installed in /usr/local/bin, their documentation in /usr/local/share/doc/nvmfd"
[ -n "$run" ] || exit 0
exec /usr/local/bin/nvmfd --config "${1:-config/examples/ram.toml}"
