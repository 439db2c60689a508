#!/usr/bin/env bash
# Changes while nvmfd serves, seen by the Linux kernel's NVMe/RDMA host on rxe0 in the VM lab
# (../shared/lab): a namespace added with nvmfctl appears on the connected host (nvme list) and
# fio verifies it; resized, lsblk shows the new size; removed under fio, it disappears; fio keeps
# verifying a namespace of the same subsystem and one of another subsystem throughout, with no
# reconnect. Fails when any step fails.
set -euo pipefail
exec "$(dirname "$0")/lab/run-guest-script.sh" lab-runtime runtime-guest.sh \
  "LAB RUNTIME: ALL STEPS PASSED" \
  "the Linux host saw a namespace added, resized and removed while two others served on"
