#!/usr/bin/env bash
# Runs nvmfd under the seeded stress for as long as asked: the real daemon (two reactors, a
# RAM and a file namespace, the soft provider's seeded faults on both sides of the wire)
# against a model of its namespaces. Prints progress, then the operations, the faults
# injected by kind and the mismatches; exits 1 on any mismatch. The seed it prints replays
# the same operations and fault streams.
#
#   scripts/stress.sh                          60 s, a seed drawn from the clock
#   scripts/stress.sh --seconds 1800 --seed 42
#   scripts/stress.sh --no-faults --controllers 4
#
# Built with the `stress` profile (optimized, debug assertions and overflow checks on).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --locked --profile stress --bin nvmfd --bin nvmfd-stress >&2
exec target/stress/nvmfd-stress "$@"
