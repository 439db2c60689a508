#!/usr/bin/env bash
# nvmfd beside the kernel's NVMe-oF target (nvmet-rdma) on rxe0 in the VM lab (../shared/lab),
# in one guest: the kernel host runs fio (io_uring, direct, pinned to vCPU 1) against each in
# turn (nvmfd, kernel, nvmfd, kernel), then nvmf bench over ibverbs (4 KiB randread QD 32 and 1)
# against the same, nvmfd with one reactor on vCPU 0, both over a null
# backend of the same size and block size: 4 KiB randread and randwrite at QD 1 and 32, 128 KiB
# sequential write at QD 16. Prints IOPS and completion latency (mean, p99, max) of every run,
# then the means over the rounds with the ratios nvmfd/kernel. A benchmark, not a test: rxe runs
# under QEMU's software emulation, so only the ratios mean something, never absolute figures.
#   scripts/bench-lab.sh          Knobs: RUNTIME (s per job, default 10), ROUNDS (default 2),
#     ONLY (regex of job names to run, e.g. 'qd1$'), IDLE (nvmfd idle_sleep_after values, each its own target),
#     FIO_WAIT (poll, the default: fio reaps completions without blocking, vCPU 1 never halts;
#     sleep: fio blocks until one is in), FIO_EXTRA (more fio options for every fio job against
#     both targets), INLINE (in-capsule data bytes for both targets)
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
. "$top/scripts/lib/lab-env.sh"
LAB=${LAB:-$top/../shared/lab}
RUNTIME=${RUNTIME:-10}; ROUNDS=${ROUNDS:-2}
[[ $RUNTIME =~ ^[1-9][0-9]*$ && $ROUNDS =~ ^[1-9][0-9]*$ ]] \
  || { echo "bench-lab: RUNTIME and ROUNDS must be positive integers" >&2; exit 2; }
[ -x "$LAB/run-in-vm.sh" ] || { echo "bench-lab: no VM lab at $LAB" >&2; exit 1; }
"$LAB/build.sh" --if-needed
cd "$top"
tree=$(git rev-parse --short HEAD)
[ -z "$(git status --porcelain --untracked-files=no -- '*.rs' '*.toml' Cargo.lock)" ] \
  || tree="$tree with uncommitted changes to the code"
cargo build --release --locked --bins 2>&1 | tail -1
echo "bench-lab: nvmfd built from $tree"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
set +e
"$LAB/run-in-vm.sh" "RUNTIME=$RUNTIME ROUNDS=$ROUNDS ONLY='${ONLY:-.}' IDLE='${IDLE:-}' FIO_WAIT='${FIO_WAIT:-poll}' FIO_EXTRA='${FIO_EXTRA:-}' INLINE='${INLINE:-}' bash $top/scripts/lab/bench-guest.sh $top/target/release" \
  2>&1 | tee "$log" | grep -vE "^\[ *[0-9.]+\]"
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" -ne 0 ] || ! grep -q "BENCH LAB: DONE" "$log"; then
  echo "bench-lab: FAILED (rc=$rc)" >&2; exit 1
fi
