#!/bin/bash
# Runs in the lab guest (see scripts/lab-kernel-host.sh): nvmfd on rxe0 with a RAM and a file
# namespace, and the Linux kernel's NVMe/RDMA host against it: I/O with verify, two paths
# (native multipath), discard (blkdiscard, mkfs.ext4, fstrim), disconnect and reconnect,
# failures.
set -uo pipefail
. "$(dirname "$0")/guest-lib.sh"
BIN=$1
NQN=nqn.2024-01.io.nvmfd:lab
WORK=/tmp/nvmfd-lab
mkdir -p $WORK
truncate -s 256M $WORK/disk.img
cat > $WORK/nvmfd.toml <<CFG
[daemon]
reactor_cores = [0, 1]
admin_socket = "$WORK/nvmfd.sock"
log_format = "json"
[[listener]]
address = "$RDMA_IP"
port = 4420
provider = "ibverbs"
# A second listener on the same device: it shares each reactor's data path.
[[listener]]
address = "$RDMA_IP"
port = 4421
provider = "ibverbs"
[transport]
# A small SRQ, so that connecting and the burst below make it grow on real verbs
# (srq_cover_queues, the default, grows it to cover the queues before each is accepted).
srq_initial = 32
srq_low_watermark = 8
srq_grow_chunk = 32
srq_max = 1024
srq_shrink_delay = "2s"
[[subsystem]]
nqn = "$NQN"
allow_any_host = true
[[subsystem.namespace]]
nsid = 1
backend = "malloc"
size = "256MiB"
[[subsystem.namespace]]
nsid = 2
backend = "file"
path = "$WORK/disk.img"
CFG
modprobe nvme-rdma || { echo "STEP FAILED: modprobe nvme-rdma"; exit 1; }
$BIN/nvmfd --config $WORK/nvmfd.toml 2> $WORK/nvmfd.log &
pid=$!
wait_until 100 "nvmfd's admin socket is there" test -S $WORK/nvmfd.sock
# Every step is bounded: a hang fails the step and dumps what explains it.
step() {
  echo "==> $*"
  if [ "$(type -t "$1")" = function ]; then "$@"; else timeout 300 "$@"; fi || {
    echo "STEP FAILED: $*"
    echo "--- kernel log"; dmesg | tail -40 | sed 's/^/kernel: /'
    echo "--- nvmfd stats"; timeout 5 $BIN/nvmfctl --socket $WORK/nvmfd.sock --json stats
    echo "--- nvmfd log"; tail -40 $WORK/nvmfd.log
    kill $pid; exit 1
  }
}
step $BIN/nvmfctl --socket $WORK/nvmfd.sock status
step nvme discover -t rdma -a "$RDMA_IP" -s 4420
step nvme connect -t rdma -a "$RDMA_IP" -s 4420 -n $NQN
wait_until 50 "/dev/nvme0n2 is there" test -b /dev/nvme0n2
step nvme list
step nvme id-ctrl /dev/nvme0
step nvme id-ns /dev/nvme0n1
for dev in /dev/nvme0n1 /dev/nvme0n2; do
  step fio --name=verify4k --filename=$dev --rw=randwrite --bs=4k --size=32M --verify=crc32c --verify_state_save=0 --ioengine=libaio --direct=1 --iodepth=16 --output-format=terse --minimal
  step fio --name=mixed --filename=$dev --rw=randwrite --bsrange=4k-1m --size=64M --verify=crc32c --verify_state_save=0 --ioengine=libaio --direct=1 --iodepth=8 --output-format=terse --minimal
  # Written with verify headers, checked only after disconnect and connect again.
  step fio --name=seq128k --filename=$dev --rw=write --bs=128k --size=64M --verify=crc32c --verify_state_save=0 --do_verify=0 --ioengine=libaio --direct=1 --iodepth=16 --output-format=terse --minimal
done
# A burst of 512 in-capsule writes in flight across the queues: no host meets an empty SRQ.
step fio --name=burst --filename=/dev/nvme0n1 --rw=randwrite --bs=4k --size=16M --offset=128M --offset_increment=16M --numjobs=4 --iodepth=128 --verify=crc32c --verify_state_save=0 --ioengine=libaio --direct=1 --group_reporting --output-format=terse --minimal
stat_sum() { $BIN/nvmfctl --socket $WORK/nvmfd.sock --json stats | grep -o "\"$1\": *[0-9]*" | grep -o "[0-9]*$" | awk '{s+=$1} END {print s+0}'; }
# rxe counts the RNR NAKs its responders sent: every one would be a host meeting an empty SRQ
# (and on rxe an RNR NAK stalls the host's queue pair).
rnr_naks() { cat /sys/class/infiniband/rxe0/ports/1/hw_counters/send_rnr_err 2>/dev/null || echo 0; }
srq_check() {
  local ev grows rnr
  ev=$(stat_sum srq_limit_events_total); grows=$(stat_sum srq_grows_total); rnr=$(rnr_naks)
  echo "SRQ after the burst: limit events $ev, grows $grows, registered $(stat_sum srq_receives_registered), errors $(stat_sum srq_errors_total), RNR NAKs sent $rnr"
  # The kernel host sends 4 KiB writes in the capsule: they go to the disk from their receive.
  echo "in-capsule writes written from their receive: $(stat_sum writes_from_receive_total)"
  [ "$grows" -gt 0 ] && [ "$(stat_sum srq_errors_total)" -eq 0 ] && [ "$rnr" -eq 0 ] \
    && [ "$(stat_sum writes_from_receive_total)" -gt 0 ]
}
step srq_check
# Native multipath: the same host connects a second controller through the second listener.
# The namespaces are shared (NMIC), so the kernel puts both paths under one device each (an
# unshared one would be refused on the second path: "Duplicate unshared namespace"); data
# written through the device reads back with one path gone.
# The paths of namespace device nvme0nN: its hidden per-controller disks nvme0cCnN.
paths_of() { ls -d /sys/block/nvme0c*${1#nvme0} 2>/dev/null | wc -l; }
multipath() {
  local i
  [ "$(cat /sys/module/nvme_core/parameters/multipath 2>/dev/null)" = Y ] \
    || { echo "the guest kernel's native multipath is off"; return 1; }
  timeout 120 nvme connect -t rdma -a "$RDMA_IP" -s 4421 -n $NQN > /dev/null || return 1
  for i in $(seq 100); do [ "$(paths_of nvme0n1)" -eq 2 ] && [ "$(paths_of nvme0n2)" -eq 2 ] && break; sleep 0.1; done
  echo "paths: nvme0n1 $(paths_of nvme0n1), nvme0n2 $(paths_of nvme0n2); block devices: $(ls /sys/block | tr '\n' ' ')"
  echo "controllers of the subsystem: $(ls /sys/class/nvme-subsystem/nvme-subsys0 2>/dev/null | grep -E '^nvme[0-9]+$' | tr '\n' ' ')"
  ! dmesg | grep -i "duplicate unshared namespace" || return 1
  [ "$(paths_of nvme0n1)" -eq 2 ] && [ "$(paths_of nvme0n2)" -eq 2 ] || return 1
  timeout 300 fio --name=mpath --filename=/dev/nvme0n2 --rw=randwrite --bs=4k --size=16M --offset=192M --verify=crc32c --verify_state_save=0 --do_verify=0 --ioengine=libaio --direct=1 --iodepth=16 --output-format=terse --minimal > /dev/null || return 1
  timeout 120 nvme disconnect -d nvme1 > /dev/null || return 1
  for i in $(seq 100); do [ "$(paths_of nvme0n2)" -eq 1 ] && break; sleep 0.1; done
  [ "$(paths_of nvme0n2)" -eq 1 ] || return 1
  timeout 300 fio --name=mpath --filename=/dev/nvme0n2 --rw=randwrite --bs=4k --size=16M --offset=192M --verify=crc32c --verify_state_save=0 --verify_only --ioengine=libaio --direct=1 --iodepth=16 --output-format=terse --minimal
}
step multipath
step nvme disconnect -n $NQN
# The next controller is nvme0 again only once the kernel has let go of this one.
wait_until 100 "/dev/nvme0 is gone" test ! -e /dev/nvme0
step nvme connect -t rdma -a "$RDMA_IP" -s 4420 -n $NQN
wait_until 50 "/dev/nvme0n2 is there" test -b /dev/nvme0n2
for dev in /dev/nvme0n1 /dev/nvme0n2; do
  step fio --name=seq128k --filename=$dev --rw=write --bs=128k --size=64M --verify=crc32c --verify_state_save=0 --verify_only --ioengine=libaio --direct=1 --iodepth=16 --output-format=terse --minimal
done
step fio --name=again --filename=/dev/nvme0n1 --rw=randread --bs=4k --size=32M --ioengine=libaio --direct=1 --iodepth=16 --runtime=3 --time_based --output-format=terse --minimal
# Discard: Dataset Management with the 4096-byte range buffer Linux sends whatever the range
# count. The host took the limits from the NVM command set's Identify Controller (CNS 06h: DMRL
# 255 ranges); blkdiscard leaves zeroes exactly where it discarded (RAM and file namespaces
# deallocate to zeroes); mkfs.ext4 discards the whole device; fstrim trims a mounted ext4 whose
# files read back intact after a remount. Any failed discard in the kernel log fails the step.
MNT=$WORK/mnt
# zeroes DEV OFFSET-MiB LENGTH-MiB: the range reads back as zeroes (direct I/O, no page cache).
# (The guest has no /dev/fd: a pipe, not process substitution.)
zeroes() { timeout 300 dd if=$1 bs=1M skip=$2 count=$3 iflag=direct status=none | cmp -n $(($3 << 20)) - /dev/zero; }
sum_of() { timeout 300 dd if=$1 bs=1M skip=$2 count=$3 iflag=direct status=none | md5sum; }
no_failed_discards() { ! dmesg | grep -E "Cmd\(0x9\)|op 0x3:\(DISCARD\)"; }
discard_limits() {
  local q=/sys/block/nvme0n1/queue
  timeout 30 nvme nvm-id-ctrl /dev/nvme0 2>&1 || true
  echo "nvme0n1: max_discard_segments $(cat $q/max_discard_segments), discard_max_bytes $(cat $q/discard_max_bytes), discard_granularity $(cat $q/discard_granularity)"
  [ "$(cat $q/max_discard_segments)" -eq 255 ] && [ "$(cat $q/discard_max_bytes)" -gt 0 ]
}
discard_reads_zeroes() {
  timeout 300 dd if=/dev/urandom of=/dev/nvme0n1 bs=1M count=256 oflag=direct status=none || return 1
  if zeroes /dev/nvme0n1 0 256 > /dev/null 2>&1; then echo "random data read back as zeroes"; return 1; fi
  timeout 300 blkdiscard -v /dev/nvme0n1 && zeroes /dev/nvme0n1 0 256 && no_failed_discards
}
discard_part_reads_zeroes() {
  local dev=/dev/nvme0n2 before after
  timeout 300 dd if=/dev/urandom of=$dev bs=1M seek=128 count=128 oflag=direct status=none || return 1
  before=$(sum_of $dev 192 64); [ -n "$before" ] || return 1
  timeout 300 blkdiscard -v -o $((128 << 20)) -l $((64 << 20)) $dev && zeroes $dev 128 64 || return 1
  after=$(sum_of $dev 192 64)
  [ "$before" = "$after" ] || { echo "blocks past the discarded range changed"; return 1; }
  no_failed_discards
}
mkfs_discards() {
  local out rc
  out=$(timeout 300 mkfs.ext4 -F -E discard /dev/nvme0n1 2>&1); rc=$?
  echo "$out" | tr '\b' ' '
  [ $rc -eq 0 ] && grep -q "Discarding device blocks:.*done" <<< "$out" && no_failed_discards
}
files_written() {
  mkdir -p $MNT && timeout 60 mount /dev/nvme0n1 $MNT || return 1
  for i in $(seq 16); do timeout 60 head -c $((i * 300000)) /dev/urandom > $MNT/keep$i || return 1; done
  for i in $(seq 16); do timeout 60 head -c $((i * 300000)) /dev/urandom > $MNT/gone$i || return 1; done
  (cd $MNT && sha256sum keep* > $WORK/files.sha256) || return 1
  rm -f $MNT/gone* && sync
}
fstrim_trims() {
  local out rc
  out=$(timeout 300 fstrim -v $MNT 2>&1); rc=$?
  echo "$out"
  [ $rc -eq 0 ] && [ "$(grep -o '[0-9]* bytes' <<< "$out" | grep -o '^[0-9]*')" -gt 0 ] && no_failed_discards
}
files_intact() {
  timeout 60 umount $MNT && timeout 60 mount /dev/nvme0n1 $MNT || return 1
  (cd $MNT && timeout 300 sha256sum -c --quiet $WORK/files.sha256) && timeout 60 umount $MNT
}
step discard_limits
step discard_reads_zeroes
step discard_part_reads_zeroes
step mkfs_discards
step files_written
step fstrim_trims
step files_intact
step nvme disconnect -n $NQN
# Failure runs on real verbs: the host disconnects under load, resets the controller, and
# reconnects by itself after nvmfd is killed and restarted. Data written on the file namespace
# before verifies after each; nvmfd's pools are back to full after each teardown.
dev_live() { for i in $(seq 300); do [ "$(cat /sys/class/nvme/nvme0/state 2>/dev/null)" = live ] && [ -b /dev/nvme0n2 ] && return 0; sleep 0.1; done; return 1; }
pools_full() {
  local s; for i in $(seq 100); do
    s=$($BIN/nvmfctl --socket $WORK/nvmfd.sock --json stats)
    [ "$(stat_sum requests_active)" -eq 0 ] && [ "$(stat_sum qps_draining)" -eq 0 ] \
      && [ "$(stat_sum buffers_free)" -eq "$(stat_sum buffers)" ] \
      && [ "$(stat_sum request_slots_free)" -eq "$(stat_sum request_slots)" ] && return 0
    sleep 0.1
  done
  echo "pools not full: $s"; return 1
}
load_started() { local c0; c0=$(stat_sum commands_total); for i in $(seq 100); do [ "$(stat_sum commands_total)" -gt $((c0 + 200)) ] && return 0; sleep 0.1; done; return 1; }
verify_base() { fio --name=base --filename=/dev/nvme0n2 --rw=write --bs=64k --size=32M --verify=crc32c --verify_state_save=0 --verify_only --ioengine=libaio --direct=1 --iodepth=8 --output-format=terse --minimal; }
wait_until 100 "/dev/nvme0 is gone" test ! -e /dev/nvme0
step nvme connect -t rdma -a "$RDMA_IP" -s 4420 -n $NQN --ctrl-loss-tmo=60 --reconnect-delay=1
step dev_live
step fio --name=base --filename=/dev/nvme0n2 --rw=write --bs=64k --size=32M --verify=crc32c --verify_state_save=0 --do_verify=0 --ioengine=libaio --direct=1 --iodepth=8 --output-format=terse --minimal
# 1. Disconnect with I/O in flight (fio's errors are expected; nothing may hang or leak).
fio --name=load --filename=/dev/nvme0n1 --rw=randrw --bs=4k --size=64M --ioengine=libaio --direct=1 --iodepth=32 --numjobs=2 --runtime=60 --time_based --output-format=terse --minimal > /dev/null 2>&1 &
fio_pid=$!
step load_started
step nvme disconnect -n $NQN
timeout 60 bash -c "while kill -0 $fio_pid 2>/dev/null; do sleep 0.1; done" || { echo "STEP FAILED: fio did not end after the disconnect"; kill $pid; exit 1; }
step pools_full
wait_until 100 "/dev/nvme0 is gone" test ! -e /dev/nvme0
step nvme connect -t rdma -a "$RDMA_IP" -s 4420 -n $NQN --ctrl-loss-tmo=60 --reconnect-delay=1
step dev_live
step verify_base
# 2. Controller reset.
step nvme reset /dev/nvme0
step dev_live
step verify_base
# 3. nvmfd killed and started again: the host reconnects by itself.
kill -KILL $pid; wait $pid 2>/dev/null
$BIN/nvmfd --config $WORK/nvmfd.toml 2>> $WORK/nvmfd.log &
pid=$!
wait_until 100 "nvmfd's admin socket is there" test -S $WORK/nvmfd.sock
reconnected() { for i in $(seq 600); do [ "$(stat_sum qps)" -gt 0 ] && dev_live && return 0; sleep 0.1; done; return 1; }
step reconnected
step verify_base
step nvme disconnect -n $NQN
step pools_full
teardowns() { echo "teardowns: disconnect $(stat_sum teardowns_disconnect_total), controller $(stat_sum teardowns_controller_total), QP error $(stat_sum teardowns_qp_error_total), drain timeouts $(stat_sum drain_timeouts_total)"; [ "$(stat_sum drain_timeouts_total)" -eq 0 ]; }
step teardowns
# nvmfd's own host tool over ibverbs, against the same daemon.
step $BIN/nvmf --provider ibverbs --addr "$RDMA_IP:4420" discover
step $BIN/nvmf --provider ibverbs --addr "$RDMA_IP:4420" identify --nqn $NQN
step $BIN/nvmf --provider ibverbs --addr "$RDMA_IP:4420" verify --nqn $NQN --nsid 2
# Both listeners on rxe0 share one data path per reactor (1,024 request slots each), and a
# QP of the second is made on the first's protection domain, CQ and SRQ.
one_path_per_reactor() { echo "request slots: $(stat_sum request_slots)"; [ "$(stat_sum request_slots)" -eq 2048 ]; }
step one_path_per_reactor
step $BIN/nvmf --provider ibverbs --addr "$RDMA_IP:4421" verify --nqn $NQN --nsid 2
# Removing the first listener, whose device the shared data path was made on, stops it
# listening while the second serves on; its port can be listened on again at once.
step $BIN/nvmfctl --socket $WORK/nvmfd.sock listener remove "$RDMA_IP" --port 4420
refused_4420() { ! $BIN/nvmf --provider ibverbs --addr "$RDMA_IP:4420" discover; }
step refused_4420
step $BIN/nvmf --provider ibverbs --addr "$RDMA_IP:4421" verify --nqn $NQN --nsid 2
step $BIN/nvmfctl --socket $WORK/nvmfd.sock listener add "$RDMA_IP" --port 4420 --provider ibverbs
step $BIN/nvmf --provider ibverbs --addr "$RDMA_IP:4420" verify --nqn $NQN --nsid 2
step one_path_per_reactor
# And the other way: what was made on the device held 4421's ID since 4420 went.
step $BIN/nvmfctl --socket $WORK/nvmfd.sock listener remove "$RDMA_IP" --port 4421
step $BIN/nvmf --provider ibverbs --addr "$RDMA_IP:4420" verify --nqn $NQN --nsid 2
step $BIN/nvmfctl --socket $WORK/nvmfd.sock listener add "$RDMA_IP" --port 4421 --provider ibverbs
step $BIN/nvmf --provider ibverbs --addr "$RDMA_IP:4421" verify --nqn $NQN --nsid 2
step one_path_per_reactor
# With both gone (a soft listener stays: the daemon keeps one), rxe0 is let go once its data
# paths have drained; then a listener on it can come back (a listening ID still held would
# refuse it: address in use).
step $BIN/nvmfctl --socket $WORK/nvmfd.sock listener add 127.0.0.1 --port 4430 --provider soft
step $BIN/nvmfctl --socket $WORK/nvmfd.sock listener remove "$RDMA_IP" --port 4420
step $BIN/nvmfctl --socket $WORK/nvmfd.sock listener remove "$RDMA_IP" --port 4421
let_go() { for _ in $(seq 100); do grep -q '"device let go' $WORK/nvmfd.log && return 0; sleep 0.1; done; return 1; }
step let_go
step $BIN/nvmfctl --socket $WORK/nvmfd.sock listener add "$RDMA_IP" --port 4420 --provider ibverbs
step $BIN/nvmf --provider ibverbs --addr "$RDMA_IP:4420" verify --nqn $NQN --nsid 2
# The last listener on rxe0 removed and another added at once, then the first back.
step $BIN/nvmfctl --socket $WORK/nvmfd.sock listener remove "$RDMA_IP" --port 4420
step $BIN/nvmfctl --socket $WORK/nvmfd.sock listener add "$RDMA_IP" --port 4421 --provider ibverbs
step $BIN/nvmfctl --socket $WORK/nvmfd.sock listener add "$RDMA_IP" --port 4420 --provider ibverbs
step $BIN/nvmf --provider ibverbs --addr "$RDMA_IP:4420" verify --nqn $NQN --nsid 2
step $BIN/nvmf --provider ibverbs --addr "$RDMA_IP:4421" verify --nqn $NQN --nsid 2
step $BIN/nvmfctl --socket $WORK/nvmfd.sock stats
# No controller may have ended for a missed keep-alive: the host kept up through every burst.
no_keep_alive_timeouts() { ! grep "keep-alive timeout" $WORK/nvmfd.log; }
step no_keep_alive_timeouts
stop_nvmfd $pid
echo "LAB KERNEL HOST: ALL STEPS PASSED"
