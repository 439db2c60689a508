#!/usr/bin/env bash
# The Linux kernel's NVMe/RDMA host against nvmfd on rxe0 in the VM lab (../shared/lab):
# discover, connect, id-ctrl, id-ns, list, fio with --verify=crc32c at 4 KiB and 4 KiB-1 MiB,
# sequential 128 KiB, disconnect, connect again; then failures: disconnect under load, controller
# reset, nvmfd killed and restarted with the host reconnecting by itself, each followed by a
# verify of data written before and a check that nvmfd's pools are full. Fails when any step fails.
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
LAB=${LAB:-$top/../shared/lab}
[ -x "$LAB/run-in-vm.sh" ] || { echo "lab-kernel-host: no VM lab at $LAB" >&2; exit 1; }
"$LAB/build.sh" --if-needed
cd "$top"
cargo build --release --locked --bins 2>&1 | tail -1
log=$(mktemp)
set +e
"$LAB/run-in-vm.sh" "bash $top/scripts/lab/kernel-host-guest.sh $top/target/release" 2>&1 | tee "$log" | grep -vE "^\[ *[0-9.]+\]"
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" -ne 0 ] || ! grep -q "LAB KERNEL HOST: ALL STEPS PASSED" "$log"; then
  echo "lab-kernel-host: FAILED (rc=$rc)" >&2; rm -f "$log"; exit 1
fi
rm -f "$log"
echo "lab-kernel-host: the Linux host ran every step against nvmfd on rxe0"
