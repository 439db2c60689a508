#!/bin/bash
# Runs in the lab guest (see scripts/lab-kernel-host.sh): the RDMA device nvmfd listens on is
# removed under it (rdma link delete rxe0) and added back. nvmfd must let go of everything on
# the device (the kernel cannot finish removing it before), say why its listener is down,
# listen again once the device is back, and serve the kernel host the data written before.
set -uo pipefail
. "$(dirname "$0")/guest-lib.sh"
BIN=$1
NQN=nqn.2024-01.io.nvmfd:removal
WORK=/tmp/nvmfd-removal
mkdir -p $WORK
cat > $WORK/nvmfd.toml <<CFG
[daemon]
reactor_cores = [0, 1]
admin_socket = "$WORK/nvmfd.sock"
log_format = "json"
[[listener]]
address = "$RDMA_IP"
port = 4420
provider = "ibverbs"
[[subsystem]]
nqn = "$NQN"
allow_any_host = true
[[subsystem.namespace]]
nsid = 1
backend = "malloc"
size = "64MiB"
CFG
modprobe nvme-rdma || { echo "STEP FAILED: modprobe nvme-rdma"; exit 1; }
$BIN/nvmfd --config $WORK/nvmfd.toml 2> $WORK/nvmfd.log &
pid=$!
wait_until 100 "nvmfd's admin socket is there" test -S $WORK/nvmfd.sock
# Deletes rxe0 without hanging the lab: the delete runs in the background and is waited for
# (bounded) by polling. If it has not finished, nvmfd still holds something of the device: show
# its log, status, open fds (uverbs and rdma_cm), its RDMA resources and the kernel log, and fail
# (the guest powers off when this script exits, even with the delete stuck).
delete_rxe0() {
  rdma link delete rxe0 &
  local del=$! t0=$SECONDS
  for i in $(seq 300); do
    if ! kill -0 $del 2>/dev/null; then
      wait $del; local rc=$?
      echo "rdma link delete rxe0: exit status $rc after $((SECONDS - t0)) s"
      echo "nvmfd's open RDMA files now: $(ls -l /proc/$pid/fd | grep -cE 'uverbs|infinibandevent') verbs, $(ls -l /proc/$pid/fd | grep -c rdma_cm) rdma_cm"
      return $rc
    fi
    sleep 0.1
  done
  echo "rdma link delete rxe0: still running after $((SECONDS - t0)) s: the kernel waits for a user of rxe0 to let go"
  echo "--- nvmfd status"; ctl status
  echo "--- nvmfd fds (uverbs: verbs contexts; rdma_cm: CM channels; infinibandevent: async and completion channels)"
  ls -l /proc/$pid/fd | sed 's/^/fd: /'
  echo "--- RDMA resources"; for r in ctx pd mr cq qp srq cm_id; do timeout 5 rdma resource show $r 2>&1 | sed "s/^/$r: /"; done
  echo "--- delete's kernel stack"; cat /proc/$del/stack 2>/dev/null | sed 's/^/stack: /'
  echo "--- nvmfd log"; cat $WORK/nvmfd.log
  return 1
}
listener_count() { ctl stats | tr -d ' \n' | grep -o "\"$1\":[0-9]*" | head -1 | grep -o "[0-9]*$"; }
step serving_is true
step nvme connect -t rdma -a "$RDMA_IP" -s 4420 -n $NQN
wait_until 50 "/dev/nvme0n1 is there" test -b /dev/nvme0n1
step fio --name=before --filename=/dev/nvme0n1 --rw=write --bs=64k --size=32M --verify=crc32c --verify_state_save=0 --do_verify=0 --ioengine=libaio --direct=1 --iodepth=8 --output-format=terse --minimal
# The kernel finishes removing the device only once every user of it has let go: nvmfd must
# free its QPs, CQs, SRQs, MRs and PDs and the listener's rdma_cm ID on DEVICE_REMOVAL.
# (The kernel host on the same device loses its controller too.)
step delete_rxe0
step serving_is false
ctl status | tr -d ' \n' | grep -o '"reason":"[^"]*"'
step rdma link add rxe0 type rxe netdev eth0
step serving_is true
removals() { echo "listener: device removals $(listener_count device_removals_total), returns $(listener_count returns_total)"; [ "$(listener_count device_removals_total)" -ge 1 ] && [ "$(listener_count returns_total)" -ge 1 ]; }
step removals
wait_until 100 "/dev/nvme0 is gone" test ! -e /dev/nvme0
step nvme connect -t rdma -a "$RDMA_IP" -s 4420 -n $NQN
wait_until 50 "/dev/nvme0n1 is there" test -b /dev/nvme0n1
step fio --name=before --filename=/dev/nvme0n1 --rw=write --bs=64k --size=32M --verify=crc32c --verify_state_save=0 --verify_only --ioengine=libaio --direct=1 --iodepth=8 --output-format=terse --minimal
step fio --name=after --filename=/dev/nvme0n1 --rw=randwrite --bs=4k --size=16M --offset=32M --verify=crc32c --verify_state_save=0 --ioengine=libaio --direct=1 --iodepth=16 --output-format=terse --minimal
step nvme disconnect -n $NQN
stop_nvmfd $pid
echo "--- nvmfd's log of the removal and the return"
grep -E "device removed|removed device|device returned|still held|cannot let go|returned device" $WORK/nvmfd.log | sed 's/^/nvmfd: /'

echo "LAB DEVICE REMOVAL: ALL STEPS PASSED"
