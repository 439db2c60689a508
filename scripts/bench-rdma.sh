#!/usr/bin/env bash
# What the wire costs: SEND message rate and RDMA WRITE bandwidth on the soft provider's
# in-process wire (here) and on ibverbs over rxe0 in the VM lab (../shared/lab). A benchmark,
# not a test: it prints figures. rxe runs under QEMU's software emulation: compare ratios
# measured in the same guest, never absolute figures.
#   scripts/bench-rdma.sh [seconds per figure, default 2]
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
. "$top/scripts/lib/lab-env.sh"
cd "$top"
SECS=${1:-2}
LAB=${LAB:-$top/../shared/lab}
cargo build --release --locked -p nvmfd-rdma --example verbs-bench 2>&1 | tail -1
bin=$top/target/release/examples/verbs-bench
"$bin" soft "$SECS"
if [ -x "$LAB/run-in-vm.sh" ]; then
  "$LAB/build.sh" --if-needed >/dev/null
  "$LAB/run-in-vm.sh" "$bin ibverbs $SECS" 2>&1 | grep -E "^(ibverbs|thread|error)" || { echo "bench-rdma: the lab run failed" >&2; exit 1; }
else
  echo "bench-rdma: no VM lab at $LAB: rxe figures skipped" >&2
fi
