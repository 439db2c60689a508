#!/usr/bin/env bash
# The Linux kernel's NVMe/RDMA host against nvmfd on rxe0 in the VM lab (../shared/lab):
# discover, connect, id-ctrl, id-ns, list, fio with --verify=crc32c at 4 KiB and 4 KiB-1 MiB,
# sequential 128 KiB, disconnect, connect again, discard (the limits the host took from CNS 06h,
# blkdiscard read back as zeroes, mkfs.ext4 with discard, fstrim on a mounted ext4 whose files
# read back after a remount); then failures: disconnect under load, controller
# reset, nvmfd killed and restarted with the host reconnecting by itself, each followed by a
# verify of data written before and a check that nvmfd's pools are full. Fails when any step fails.
set -euo pipefail
exec "$(dirname "$0")/lab/run-guest-script.sh" lab-kernel-host kernel-host-guest.sh \
  "LAB KERNEL HOST: ALL STEPS PASSED" \
  "the Linux host ran every step against nvmfd on rxe0"
