#!/usr/bin/env bash
# The Linux kernel's NVMe/RDMA host writing through nvmfd to a Ceph RBD image, in the VM lab
# (../shared/lab): the guest runs its own throwaway cluster (scripts/ceph-dev-cluster.sh on the
# guest's 127.0.0.1, from the Ceph packages the lab image carries, see scripts/lib/lab-env.sh),
# nvmfd exports an image of it on rxe0, the kernel host connects and fio writes with crc32c
# verify; an OSD is killed while fio writes, and every block is checked with the OSD down and
# again after it is back. Fails when any step fails.
set -euo pipefail
exec "$(dirname "$0")/lab/run-guest-script.sh" lab-rbd rbd-guest.sh \
  "LAB RBD: ALL STEPS PASSED" \
  "the Linux host wrote through nvmfd to RBD on rxe0 and fio verified it, across an OSD kill"
