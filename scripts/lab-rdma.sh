#!/usr/bin/env bash
# Runs the ibverbs provider's conformance test on real verbs: rxe0 in the VM lab
# (../shared/lab). Builds the test binary on the host and runs it in a fresh guest. Fails,
# loudly, when the lab cannot be built or the test does not pass there.
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
. "$top/scripts/lib/lab-env.sh"
LAB=${LAB:-$top/../shared/lab}
[ -x "$LAB/run-in-vm.sh" ] || { echo "lab-rdma: no VM lab at $LAB" >&2; exit 1; }
"$LAB/build.sh" --if-needed
cd "$top"
bin=$(cargo test -p nvmfd-rdma --test conformance --no-run --locked --message-format=json 2>/dev/null \
  | python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["name"]=="conformance": print(m["executable"])' | tail -1)
[ -n "$bin" ] || { echo "lab-rdma: the test binary did not build" >&2; exit 1; }
log=$(mktemp)
set +e
"$LAB/run-in-vm.sh" "$bin ibverbs --nocapture --test-threads=1" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" -ne 0 ] || grep -q "SKIPPED" "$log" || ! grep -qE "test result: ok\. [1-9][0-9]* passed" "$log"; then
  echo "lab-rdma: FAILED on rxe (rc=$rc)" >&2; rm -f "$log"; exit 1
fi
rm -f "$log"
echo "lab-rdma: the ibverbs conformance test passed on rxe0"
