#!/bin/bash
# Runs in the lab guest (see scripts/lab-blktests.sh): nvmfd on rxe0 with one bystander
# subsystem, a bystander host (nvmf bench --verify over ibverbs) on it, and blktests' `check`
# with NVME_TARGET_CONTROL=scripts/blktests-target-control against the same nvmfd.
set -uo pipefail
BIN=$1
top=$(cd "$(dirname "$0")/../.." && pwd)
BT=$top/target/blktests
# shellcheck disable=SC1091 # written by scripts/lab-blktests.sh
. "$BT/.nvmfd-lab"
WORK=/tmp/nvmfd-blktests-lab
BYSTANDER=nqn.2024-01.io.nvmfd:bystander
mkdir -p $WORK
cat > $WORK/nvmfd.toml <<CFG
# nvmfd for blktests: scripts/blktests-target-control adds and removes its subsystems.
[daemon]
reactor_cores = [0, 1]
admin_socket = "$WORK/nvmfd.sock"
log_format = "json"
# nvme/029 reads and writes up to 1025 blocks of 512 B in one passthrough command, which the
# Linux host refuses above the target's MDTS: 1 MiB, as the kernel target offers over RDMA
# (nvmfd's default is 128 KiB, as SPDK's).
[transport]
max_io_size = "1MiB"
[[listener]]
address = "$RDMA_IP"
port = 4420
provider = "ibverbs"
[[subsystem]]
nqn = "$BYSTANDER"
allow_any_host = true
[[subsystem.namespace]]
nsid = 1
backend = "malloc"
size = "64MiB"
CFG
# blktests' check needs /dev/fd, which the minimal guest lacks.
[ -e /dev/fd ] || ln -s /proc/self/fd /dev/fd
modprobe -a nvme-rdma nvme-fabrics || { echo "modprobe nvme-rdma failed"; exit 1; }
# blktests unloads after each test the modules it loaded itself (`_have_driver`), waiting for
# them in `modprobe --remove --wait=50000`; for `loop`, which its nvme tests ask for, that
# wait spun in this guest (state R, minutes past its 50 s, nvmfd idle: the stall watcher caught
# it after nvme/003), and otherwise took 50 s per test ("still loop has references"). Loaded
# here first, it is not blktests' to unload.
modprobe loop || echo "modprobe loop failed: blktests will load and unload it itself"
$BIN/nvmfd --config $WORK/nvmfd.toml 2> $WORK/nvmfd.log &
pid=$!
for i in $(seq 100); do [ -S $WORK/nvmfd.sock ] && break; sleep 0.1; done
[ -S $WORK/nvmfd.sock ] || { echo "nvmfd did not start"; tail -20 $WORK/nvmfd.log; exit 1; }

# The bystander: one connection for the whole run, written and read back with --verify.
$BIN/nvmf --provider ibverbs --addr "$RDMA_IP:4420" bench --nqn $BYSTANDER -q 4 -o 4k \
  -w randrw -M 50 --verify -t 86400 > $WORK/bystander.out 2> $WORK/bystander.err &
bystander=$!

export NVMFCTL=$BIN/nvmfctl NVMFD_SOCKET=$WORK/nvmfd.sock NVMFD_TRADDR=$RDMA_IP
export NVMFD_BACKING_DIR=$WORK/backing NVMFD_CONTROL_LOG=$WORK/control.log
export NVME_IMG_SIZE
cat > "$BT/config" <<CFG
NVME_TARGET_CONTROL=$top/scripts/blktests-target-control
USE_RXE=1
NVMET_TRTYPES=rdma
NVME_IMG_SIZE=$NVME_IMG_SIZE
TIMEOUT=$TIMEOUT
CFG
cd "$BT"
make -s > $WORK/make.log 2>&1 || echo "blktests' make failed (its C helpers): $(tail -3 $WORK/make.log)"
# A stall watcher: when neither check's output nor its results have changed for STALL seconds,
# the guest's state (processes and where they wait, the kernel's stacks of those blocked, the
# NVMe controllers, dmesg, nvmfd's and the control hook's logs) is printed; at the second such
# dump check is stopped, so that the run ends with a verdict and the state on record.
STALL=${BLKTESTS_STALL:-240}
stall_dump() {
  echo "==> STALL: nothing new from check for ${STALL}s ($(date +%T))"
  ps -eo pid,ppid,stat,etimes,wchan:28,args | grep -v ' \[' | cut -c1-220
  for p in /proc/[0-9]*; do
    st=$(awk '{print $3}' "$p/stat" 2>/dev/null) || continue
    case $st in D) echo "--- blocked: $(tr '\0' ' ' < "$p/cmdline" | cut -c1-120)"; cat "$p/stack" 2>/dev/null ;; esac
  done
  for c in /sys/class/nvme/nvme*; do
    [ -e "$c/state" ] && echo "$(basename "$c") $(cat "$c/transport" "$c/subsysnqn" "$c/state" 2>/dev/null | tr '\n' ' ')"
  done
  echo "--- dmesg"; dmesg | tail -40
  echo "--- nvmfd log"; tail -40 $WORK/nvmfd.log
  echo "--- control log"; tail -10 $WORK/control.log 2>/dev/null
  echo "--- nvmfctl"; timeout 20 $BIN/nvmfctl --socket $WORK/nvmfd.sock --json status 2>&1 | cut -c1-2000
}
echo "==> ./check $TESTS (NVME_IMG_SIZE=$NVME_IMG_SIZE, TIMEOUT=$TIMEOUT)"
: > $WORK/check.out
# shellcheck disable=SC2086 # one word per test
timeout 3600 ./check $TESTS > >(tee $WORK/check.out) 2>&1 &
check=$!
(
  dumps=0
  while sleep 10; do
    kill -0 $check 2>/dev/null || exit 0
    newest=$(find $WORK/check.out "$BT/results" -newermt "-${STALL} seconds" 2>/dev/null | head -1)
    [ -n "$newest" ] && continue
    stall_dump
    dumps=$((dumps + 1))
    if [ $dumps -ge 2 ]; then echo "==> STALL: stopping check"; pkill -TERM -P $check; kill -TERM $check; exit 0; fi
    touch $WORK/check.out
  done
) &
watcher=$!
wait $check
kill $watcher 2>/dev/null
wait $watcher 2>/dev/null
echo "==> verdicts"
verdicts=$(grep -aoE '^nvme/[0-9]+ .*\[(passed|failed|not run)\]' $WORK/check.out | sed -E 's/ +/ /g')
echo "$verdicts"
n_pass=$(grep -c '\[passed\]' <<<"$verdicts")
n_fail=$(grep -c '\[failed\]' <<<"$verdicts")
n_skip=$(grep -c '\[not run\]' <<<"$verdicts")
n_want=$(wc -w <<<"$TESTS")
echo "blktests: $n_pass passed, $n_fail failed, $n_skip not run, of $n_want asked"
rc=0
[ "$n_fail" -eq 0 ] && [ "$n_skip" -eq 0 ] && [ "$n_pass" -eq "$n_want" ] || rc=1
if [ "$n_fail" -gt 0 ]; then
  for d in results/nodev*/nvme/*; do
    case $d in *.full|*.out.bad) ;; *) continue ;; esac
    echo "--- $d"; tail -20 "$d"
  done
fi

# The bystander ran on one connection through every change: stop it, it reports no error.
kill -INT $bystander
wait $bystander
brc=$?
echo "==> bystander (nvmf bench --verify on $BYSTANDER): exit status $brc"
cat $WORK/bystander.out; tail -5 $WORK/bystander.err
[ "$brc" -eq 0 ] && grep -q "interrupted" $WORK/bystander.out || rc=1
echo "==> nvmfd: changes it applied"
grep -c '"change' $WORK/nvmfd.log || true
grep -iE 'panic|"level":"(CRIT|ERRO)"' $WORK/nvmfd.log | tail -10
echo "==> nvmfd: Connects that waited for an ended controller's I/O (Controller Busy)"
grep -c "waits until I/O of its ended controller" $WORK/nvmfd.log || true
$BIN/nvmfctl --socket $WORK/nvmfd.sock status | head -20
kill -TERM $pid
wait $pid
echo "nvmfd exit status $?"
[ "$rc" -eq 0 ] && echo "LAB BLKTESTS: ALL TESTS PASSED"
exit $rc
