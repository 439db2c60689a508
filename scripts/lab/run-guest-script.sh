#!/usr/bin/env bash
# Shared by the lab scripts that run nvmfd in the VM lab (../shared/lab): builds the lab if
# needed and the release binaries, runs a guest script of scripts/lab/ with them in a fresh
# guest, and fails unless the guest exited 0 and printed the script's pass line.
#   run-guest-script.sh NAME GUEST-SCRIPT PASS-LINE SUCCESS-MESSAGE
set -euo pipefail
name=$1 guest=$2 pass=$3 success=$4
top=$(cd "$(dirname "$0")/../.." && pwd)
. "$top/scripts/lib/lab-env.sh"
LAB=${LAB:-$top/../shared/lab}
[ -x "$LAB/run-in-vm.sh" ] || { echo "$name: no VM lab at $LAB" >&2; exit 1; }
"$LAB/build.sh" --if-needed
cd "$top"
cargo build --release --locked --bins 2>&1 | tail -1
log=$(mktemp)
set +e
"$LAB/run-in-vm.sh" "bash $top/scripts/lab/$guest $top/target/release" 2>&1 | tee "$log" | grep -vE "^\[ *[0-9.]+\]"
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" -ne 0 ] || ! grep -q "$pass" "$log"; then
  echo "$name: FAILED (rc=$rc)" >&2; rm -f "$log"; exit 1
fi
rm -f "$log"
echo "$name: $success"
