#!/usr/bin/env bash
# Many I/O queues on one reactor (tests/src/bin/nvmfd-scale.rs): the release nvmfd with one
# reactor, a soft listener on 127.0.0.1 and a null namespace; --queues I/O queues (default
# 1,024 of depth 128, the Linux host's default) from --processes host processes (default 8)
# over the soft provider's TCP wire. Prints the receive memory registered (beside what a
# receive queue per QP of the same depths would register), RSS and threads, the reactor's CPU
# while every queue is connected and idle, the latency of the first I/O after that, and the
# receive memory through a burst on every queue and after it (it must come back).
#   scripts/bench-scale.sh                         both SRQ policies, defaults
#   scripts/bench-scale.sh --queues 256 --depth 32 ...   one run, nvmfd-scale's options
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked --bins 2>&1 | tail -1
ulimit -n 65536 2>/dev/null || true
scale=target/release/nvmfd-scale
if [ $# -gt 0 ]; then exec "$scale" "$@"; fi
echo "== srq_cover_queues = true (the default): a receive for every command the queues may have out, up to srq_max"
"$scale" --cover-queues true
echo
echo "== srq_cover_queues = false: the SRQ sized by load alone, grown on SRQ limit events"
"$scale" --cover-queues false
