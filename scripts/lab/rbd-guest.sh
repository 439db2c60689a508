#!/bin/bash
# Runs in the lab guest (see scripts/lab-rbd.sh): a Ceph cluster of the guest's own
# (scripts/ceph-dev-cluster.sh on 127.0.0.1: one monitor, three memstore OSDs), nvmfd on rxe0
# exporting an RBD image of it, and the Linux kernel's NVMe/RDMA host writing through nvmfd
# with fio verifying; an OSD killed while fio writes, then every block checked again.
set -uo pipefail
. "$(dirname "$0")/guest-lib.sh"
BIN=$1
TOP=$(cd "$(dirname "$0")/../.." && pwd)
NQN=nqn.2024-01.io.nvmfd:rbd
WORK=/tmp/nvmfd-rbd
mkdir -p $WORK
# The minimal guest has no /dev/fd, which bash's process substitution needs.
[ -e /dev/fd ] || ln -s /proc/self/fd /dev/fd
export NVMFD_CEPH_DIR=/tmp/nvmfd-ceph NVMFD_CEPH_OSD_MB=384 NVMFD_CEPH_TIMEOUT=300
ceph_cluster() { "$TOP/scripts/ceph-dev-cluster.sh" "$@"; }
pid=
# Every step is bounded: a hang fails the step and dumps what explains it.
step() {
  echo "==> $*"
  if [ "$(type -t "$1")" = function ]; then "$@"; else timeout 600 "$@"; fi || {
    echo "STEP FAILED: $*"
    echo "--- kernel log"; dmesg | tail -30 | sed 's/^/kernel: /'
    [ -n "$pid" ] && { echo "--- nvmfd log"; tail -40 $WORK/nvmfd.log; kill $pid; }
    echo "--- cluster"; ceph_cluster status 2>&1 | tail -20
    exit 1
  }
}
step ceph_cluster start
CONF=$(ceph_cluster start | tail -1)
cat > $WORK/nvmfd.toml <<CFG
[daemon]
reactor_cores = [0]
admin_socket = "$WORK/nvmfd.sock"
[[listener]]
address = "$RDMA_IP"
port = 4420
provider = "ibverbs"
[[subsystem]]
nqn = "$NQN"
allow_any_host = true
[[subsystem.namespace]]
nsid = 1
backend = "rbd"
pool = "rbd"
image = "lab-vol1"
ceph_conf = "$CONF"
create = true
size = "128MiB"
CFG
step $BIN/nvmfd --check-config $WORK/nvmfd.toml
modprobe nvme-rdma || { echo "STEP FAILED: modprobe nvme-rdma"; exit 1; }
$BIN/nvmfd --config $WORK/nvmfd.toml 2> $WORK/nvmfd.log &
pid=$!
wait_until 300 "nvmfd's admin socket is there" test -S $WORK/nvmfd.sock
step $BIN/nvmfctl --socket $WORK/nvmfd.sock status
step rbd -c "$CONF" info rbd/lab-vol1
step nvme connect -t rdma -a "$RDMA_IP" -s 4420 -n $NQN
wait_until 50 "/dev/nvme0n1 is there" test -b /dev/nvme0n1
step nvme list
FIO="fio --filename=/dev/nvme0n1 --ioengine=libaio --direct=1 --verify=crc32c --verify_state_save=0 --output-format=terse --minimal"
step $FIO --name=verify4k --rw=randwrite --bs=4k --size=16M --iodepth=16
step $FIO --name=mixed --rw=randwrite --bsrange=4k-128k --size=32M --offset=16M --iodepth=8
# Sequential writes with verify headers; osd.1 killed while they run; every block they wrote
# checked afterwards, with osd.1 down and again once it is back and backfilled.
osd_kill_during_writes() {
  $FIO --name=seq --rw=write --bs=64k --size=64M --offset=64M --iodepth=8 --do_verify=0 &
  local f=$! w0 i
  w0=$(writes_done /dev/nvme0n1)
  # Once fio has 128 writes done, kill osd.1 under it.
  for i in $(seq 600); do
    [ $(( $(writes_done /dev/nvme0n1) - w0 )) -ge 128 ] && break
    kill -0 $f 2>/dev/null || break
    sleep 0.1
  done
  local done=$(( $(writes_done /dev/nvme0n1) - w0 ))
  # Killed under the writes, or the step shows nothing.
  kill -0 $f 2>/dev/null || { echo "fio ended before osd.1 was killed ($done writes)"; return 1; }
  [ $done -ge 128 ] || { echo "fio did $done writes in 60 s, not 128"; kill $f; return 1; }
  echo "osd.1 killed after $done writes"
  ceph_cluster osd-kill 1 || return 1
  wait $f
}
step osd_kill_during_writes
step $FIO --name=seq --rw=write --bs=64k --size=64M --offset=64M --iodepth=8 --verify_only=1
step ceph_cluster osd-start 1
step $FIO --name=seq --rw=write --bs=64k --size=64M --offset=64M --iodepth=8 --verify_only=1
step nvme disconnect -n $NQN
step $BIN/nvmfctl --socket $WORK/nvmfd.sock --json stats
stop_nvmfd $pid
ceph_cluster stop
echo "LAB RBD: ALL STEPS PASSED"
