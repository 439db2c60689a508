#!/usr/bin/env bash
# Device removal on real verbs, in the VM lab (../shared/lab): rxe0 is deleted under nvmfd while
# the Linux kernel host has written to it, and added back; nvmfd must release the device, report
# its listener down, listen again when the device returns and serve the data written before.
# Fails when any step fails.
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
LAB=${LAB:-$top/../shared/lab}
[ -x "$LAB/run-in-vm.sh" ] || { echo "lab-device-removal: no VM lab at $LAB" >&2; exit 1; }
"$LAB/build.sh" --if-needed
cd "$top"
cargo build --release --locked --bins 2>&1 | tail -1
log=$(mktemp)
set +e
"$LAB/run-in-vm.sh" "bash $top/scripts/lab/device-removal-guest.sh $top/target/release" 2>&1 | tee "$log" | grep -vE "^\[ *[0-9.]+\]"
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" -ne 0 ] || ! grep -q "LAB DEVICE REMOVAL: ALL STEPS PASSED" "$log"; then
  echo "lab-device-removal: FAILED (rc=$rc)" >&2; rm -f "$log"; exit 1
fi
rm -f "$log"
echo "lab-device-removal: rxe0 went and came back; nvmfd let go of it, listened again and served the data written before"
