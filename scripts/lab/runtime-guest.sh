#!/bin/bash
# Runs in the lab guest (see scripts/lab-runtime.sh): nvmfd on rxe0 serves two subsystems to the
# Linux kernel host, and namespaces are added, resized and removed with nvmfctl while fio
# verifies namespace 1 of the first subsystem and namespace 1 of the second the whole time.
# The host must see each change by itself (Namespace Attribute Changed, then the Changed
# Namespace List), with no reconnect and no fio error on the namespaces left alone. Then a
# second listener on rxe0 is added, removed and added back while the first serves.
set -uo pipefail
. "$(dirname "$0")/guest-lib.sh"
BIN=$1
NQN=nqn.2024-01.io.nvmfd:runtime
OTHER=nqn.2024-01.io.nvmfd:bystander
WORK=/tmp/nvmfd-runtime
mkdir -p $WORK
truncate -s 128M $WORK/other.img
cat > $WORK/nvmfd.toml <<CFG
# nvmfd for the runtime lab test; nvmfctl's changes are written back into this file.
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
size = "128MiB"
[[subsystem]]
nqn = "$OTHER"
allow_any_host = true
[[subsystem.namespace]]
nsid = 1
backend = "file"
path = "$WORK/other.img"
CFG
modprobe nvme-rdma || { echo "STEP FAILED: modprobe nvme-rdma"; exit 1; }
$BIN/nvmfd --config $WORK/nvmfd.toml 2> $WORK/nvmfd.log &
pid=$!
wait_until 100 "nvmfd's admin socket is there" test -S $WORK/nvmfd.sock
ctl() { $BIN/nvmfctl --socket $WORK/nvmfd.sock "$@"; }
step() {
  echo "==> $*"
  if [ "$(type -t "$1")" = function ]; then "$@"; else timeout 300 "$@"; fi || {
    echo "STEP FAILED: $*"
    echo "--- kernel log"; dmesg | tail -40 | sed 's/^/kernel: /'
    echo "--- nvmfd log"; tail -40 $WORK/nvmfd.log
    kill $pid; exit 1
  }
}
# Waits up to 30 s for a condition (a shell command), polling every 0.1 s.
wait_for() { local i; for i in $(seq 300); do eval "$1" && return 0; sleep 0.1; done; echo "not true after 30 s: $1"; return 1; }
# The block device of NSID $2 on the controller connected to subsystem $1, or nothing.
ns_dev() {
  local n name
  for n in /sys/block/nvme*; do
    name=${n##*/}
    [[ $name =~ ^nvme[0-9]+n[0-9]+$ ]] || continue
    [ "$(cat "$n/nsid" 2>/dev/null)" = "$2" ] || continue
    [ "$(cat "$n/device/subsysnqn" 2>/dev/null)" = "$1" ] && { echo "/dev/$name"; return 0; }
  done
  return 1
}
step ctl status
step nvme connect -t rdma -a "$RDMA_IP" -s 4420 -n $NQN
step nvme connect -t rdma -a "$RDMA_IP" -s 4420 -n $OTHER
step wait_for 'ns_dev $NQN 1 >/dev/null && ns_dev $OTHER 1 >/dev/null'
A1=$(ns_dev $NQN 1); B1=$(ns_dev $OTHER 1)
echo "namespace 1 of $NQN is $A1, namespace 1 of $OTHER is $B1"
ctrls_before=$(ls -d /sys/class/nvme/nvme* | wc -l)

# fio with crc32c verify on both untouched namespaces, round after round, until told to stop.
rm -f $WORK/stop $WORK/bg-*.fail
background() {
  local dev=$1 tag=$2 n=0
  while [ ! -e $WORK/stop ]; do
    fio --name=bg$tag --filename=$dev --rw=randwrite --bs=4k --size=16M --iodepth=8 \
      --verify=crc32c --verify_state_save=0 --ioengine=libaio --direct=1 --output-format=terse \
      --minimal > $WORK/bg-$tag.out 2>&1 || { cp $WORK/bg-$tag.out $WORK/bg-$tag.fail; break; }
    n=$((n + 1)); echo $n > $WORK/bg-$tag.rounds
  done
}
background "$A1" a & bg_a=$!
background "$B1" b & bg_b=$!

# 1. Add namespace 2 (a file) to the connected subsystem: the host finds it by itself.
truncate -s 64M $WORK/ns2.img
step ctl namespace add $NQN --nsid 2 --backend file --path $WORK/ns2.img --uuid 4b1e5c1a-9a7e-4f5b-8d4c-2f9a3c1e7d10
step wait_for 'ns_dev $NQN 2 >/dev/null'
A2=$(ns_dev $NQN 2)
step nvme list
nvme list | grep -q "${A2#/dev/}" || { echo "STEP FAILED: nvme list does not show $A2"; kill $pid; exit 1; }
echo "namespace 2 appeared as $A2: $(lsblk -bno SIZE "$A2") bytes, uuid $(cat /sys/block/${A2#/dev/}/uuid 2>/dev/null)"
step fio --name=added --filename=$A2 --rw=randwrite --bs=4k --size=64M --iodepth=16 --verify=crc32c --verify_state_save=0 --ioengine=libaio --direct=1 --output-format=terse --minimal
grep -q 'nsid = 2' $WORK/nvmfd.toml || { echo "STEP FAILED: namespace 2 not written back to the file"; kill $pid; exit 1; }

# 2. Grow its file and resize: lsblk shows the new size, the old data is intact.
step fio --name=before --filename=$A2 --rw=write --bs=64k --size=64M --iodepth=8 --verify=crc32c --verify_state_save=0 --do_verify=0 --ioengine=libaio --direct=1 --output-format=terse --minimal
truncate -s 96M $WORK/ns2.img
step ctl namespace resize $NQN 2
step wait_for '[ "$(lsblk -bno SIZE $A2)" = $((96 << 20)) ]'
echo "namespace 2 resized: lsblk says $(lsblk -bno SIZE "$A2") bytes"
step fio --name=before --filename=$A2 --rw=read --bs=64k --size=64M --iodepth=8 --verify=crc32c --verify_state_save=0 --ioengine=libaio --direct=1 --output-format=terse --minimal
step fio --name=grown --filename=$A2 --rw=randwrite --bs=4k --offset=64M --size=32M --iodepth=16 --verify=crc32c --verify_state_save=0 --ioengine=libaio --direct=1 --output-format=terse --minimal

# 3. Remove it while fio writes to it: that fio ends (with errors), the device goes away.
fio --name=doomed --filename=$A2 --rw=randwrite --bs=4k --size=64M --iodepth=16 --runtime=60 --time_based --ioengine=libaio --direct=1 --output-format=terse --minimal > /dev/null 2>&1 &
doomed=$!
# Removed while fio's writes are under way: 64 of them done first.
w0=$(writes_done $A2)
step wait_for '[ $(( $(writes_done $A2) - w0 )) -ge 64 ]'
step wait_for 'kill -0 $doomed 2>/dev/null'
step ctl namespace remove $NQN 2
step wait_for '! ns_dev $NQN 2 >/dev/null'
echo "namespace 2 is gone from the host"
step wait_for '! kill -0 $doomed 2>/dev/null'
# Its writes failed: fio says so in its exit status.
if wait $doomed; then echo "STEP FAILED: fio's writes to the removed namespace all succeeded"; kill $pid; exit 1; fi
step nvme list

# The namespaces left alone served throughout, on the same controllers.
touch $WORK/stop
wait $bg_a $bg_b
untouched() {
  local t ok=0
  for t in a b; do
    if [ -e $WORK/bg-$t.fail ]; then echo "fio on the untouched namespace $t failed:"; cat $WORK/bg-$t.fail; ok=1
    else echo "untouched namespace $t: $(cat $WORK/bg-$t.rounds 2>/dev/null || echo 0) fio rounds verified"; fi
  done
  [ "$(cat $WORK/bg-a.rounds 2>/dev/null || echo 0)" -gt 0 ] && [ "$(cat $WORK/bg-b.rounds 2>/dev/null || echo 0)" -gt 0 ] || ok=1
  [ "$(ls -d /sys/class/nvme/nvme* | wc -l)" -eq "$ctrls_before" ] || { echo "controllers changed"; ok=1; }
  return $ok
}
step untouched
no_reconnects() { ! dmesg | grep -E "nvme nvme[0-9]+: (Reconnecting|resetting controller|starting error recovery)"; }
step no_reconnects
step ctl controllers
# Each controller shows where its host connects from (the kernel host on rxe0).
addresses() { ctl --json controllers | jq -e --arg ip "$RDMA_IP" 'length == 2 and all(.[]; .host_address | startswith($ip + ":"))'; }
step addresses

# 4. A second listener on the same device, removed and added back while the first serves: its
#    port is let go of (the device's objects, made through the first listener's device, had
#    taken the second's listening ID, and kept it listening: adding it back failed).
step ctl listener add "$RDMA_IP" --port 4421 --provider ibverbs
step nvme discover -t rdma -a "$RDMA_IP" -s 4421
step ctl listener remove "$RDMA_IP" --port 4421
step ctl listener add "$RDMA_IP" --port 4421 --provider ibverbs
step nvme discover -t rdma -a "$RDMA_IP" -s 4421
step ctl listener remove "$RDMA_IP" --port 4421
same_controllers() { [ "$(ls -d /sys/class/nvme/nvme* | wc -l)" -eq "$ctrls_before" ]; }
step same_controllers

# 5. The only listener of the device removed under its hosts and added back at once: its port
#    is free (an ID bound to the address, not listening, holds the device while the data paths
#    drain; the listening ID held it, and adding the listener back failed "Address already in
#    use" until they had drained). The hosts reconnect through it. (A soft listener meanwhile:
#    a configuration keeps at least one.)
step ctl listener add 127.0.0.1 --port 4430 --provider soft
step ctl listener remove "$RDMA_IP" --port 4420
step ctl listener add "$RDMA_IP" --port 4420 --provider ibverbs
step nvme discover -t rdma -a "$RDMA_IP" -s 4420
reconnected() { [ "$(cat /sys/class/nvme/nvme*/state | grep -c live)" -eq "$ctrls_before" ]; }
step wait_for reconnected
step ctl listener remove 127.0.0.1 --port 4430

step nvme disconnect -n $NQN
step nvme disconnect -n $OTHER
stop_nvmfd $pid
echo "LAB RUNTIME: ALL STEPS PASSED"
