#!/bin/bash
# Runs in the lab guest (see scripts/bench-lab.sh): nvmfd and the kernel's nvmet-rdma target on
# rxe0, side by side, both over a null backend of the same size and block size (nvmfd
# `backend = "null"`, the kernel target null_blk), measured by the kernel host with fio pinned to
# vCPU 1 while nvmfd's one reactor runs on vCPU 0. Rounds alternate nvmfd, kernel, nvmfd,
# kernel, ...; each round connects, runs every job, disconnects (and stops nvmfd with SIGTERM).
# Prints IOPS and completion latency (mean, p99, max) per job, round and target, then the means
# over the rounds and the ratios nvmfd/kernel.
#   bench-guest.sh BIN-DIR        Env: RUNTIME (s per job, default 10), ROUNDS (default 2),
#     ONLY (an extended regex: only the jobs whose names match, e.g. 'qd1$'), IDLE (space-separated values of
#     nvmfd's daemon.idle_sleep_after, each measured as its own target "nvmfd@VALUE"; default:
#     the configuration's default, target "nvmfd"), FIO_WAIT (how fio waits for completions,
#     against both targets: `poll`, the default, reaps without blocking
#     (--iodepth_batch_complete_min=0), so vCPU 1 never halts; `sleep` blocks in io_uring_enter
#     until one is in, and a halted vCPU's wake-up under QEMU's emulation is then part of every
#     I/O that completes from the other vCPU), FIO_EXTRA (more fio options for every fio job),
#     INLINE (bytes of data a command capsule may carry, for both targets: nvmet's port
#     param_inline_data_size and nvmfd's transport.in_capsule_data_size; default: each one's
#     default, 4096 for both)
set -Eeuo pipefail
BIN=$1
RUNTIME=${RUNTIME:-10}; ROUNDS=${ROUNDS:-2}; ONLY=${ONLY:-.}; IDLE=${IDLE:-}; FIO_EXTRA=${FIO_EXTRA:-}; INLINE=${INLINE:-}; FIO_WAIT=${FIO_WAIT:-poll}
case $FIO_WAIT in
  poll) FIO_WAIT_OPTS=--iodepth_batch_complete_min=0 ;;
  sleep) FIO_WAIT_OPTS= ;;
  *) echo "bench-guest: FIO_WAIT is poll or sleep, not '$FIO_WAIT'" >&2; exit 2 ;;
esac
IP=${RDMA_IP:-10.0.2.15}
SIZE_GIB=4; BS=512
NVMFD_NQN=nqn.2024-01.io.nvmfd:bench; NVMFD_PORT=4421
KERNEL_NQN=nqn.2024-01.io.lab:bench-kernel; KERNEL_PORT=4420
# name rw bs iodepth
JOBS=("randread-4k-qd1 randread 4k 1" "randwrite-4k-qd1 randwrite 4k 1"
      "randread-4k-qd32 randread 4k 32" "randwrite-4k-qd32 randwrite 4k 32"
      "write-128k-qd16 write 128k 16")
WORK=/tmp/nvmfd-bench
RESULTS=$WORK/results.tsv
C=/sys/kernel/config/nvmet
pid= DEV=

fail() {
  trap - ERR
  exec 1>&2
  echo "BENCH FAILED: $*"
  echo "--- kernel log"; dmesg | tail -40 | sed 's/^/kernel: /' || true
  if [ -f $WORK/nvmfd.log ]; then echo "--- nvmfd log"; tail -40 $WORK/nvmfd.log || true; fi
  [ -z "$pid" ] || kill -KILL "$pid" 2>/dev/null || true
  exit 1
}
trap 'fail "line $LINENO: $BASH_COMMAND"' ERR

mkdir -p $WORK /etc/nvme
: > $RESULTS
[ -s /etc/nvme/hostnqn ] || nvme gen-hostnqn > /etc/nvme/hostnqn
modprobe -a nvmet nvmet-rdma nvme-rdma
modprobe null_blk nr_devices=1 gb=$SIZE_GIB bs=$BS queue_mode=2

# The kernel target: a subsystem over null_blk, and a port it is linked to only for its rounds.
mkdir $C/subsystems/$KERNEL_NQN
echo 1 > $C/subsystems/$KERNEL_NQN/attr_allow_any_host
mkdir $C/subsystems/$KERNEL_NQN/namespaces/1
echo /dev/nullb0 > $C/subsystems/$KERNEL_NQN/namespaces/1/device_path
echo 1 > $C/subsystems/$KERNEL_NQN/namespaces/1/enable
mkdir $C/ports/1
echo rdma > $C/ports/1/addr_trtype; echo ipv4 > $C/ports/1/addr_adrfam
echo "$IP" > $C/ports/1/addr_traddr; echo $KERNEL_PORT > $C/ports/1/addr_trsvcid
[ -z "$INLINE" ] || echo "$INLINE" > $C/ports/1/param_inline_data_size

# nvmfd: one reactor on vCPU 0, a null namespace like null_blk's.
nvmfd_config() { # [IDLE_SLEEP_AFTER]
local idle_line= inline_lines=
[ -z "${1:-}" ] || idle_line="idle_sleep_after = \"$1\""
[ -z "$INLINE" ] || inline_lines=$(printf '[transport]\nin_capsule_data_size = %s' "$INLINE")
cat > $WORK/nvmfd.toml <<CFG
[daemon]
reactor_cores = [0]
$idle_line
admin_socket = "$WORK/nvmfd.sock"
log_format = "json"
$inline_lines
[[listener]]
address = "$IP"
port = $NVMFD_PORT
provider = "ibverbs"
[[subsystem]]
nqn = "$NVMFD_NQN"
allow_any_host = true
[[subsystem.namespace]]
nsid = 1
backend = "null"
size = "${SIZE_GIB}GiB"
block_size = $BS
CFG
$BIN/nvmfd --check-config $WORK/nvmfd.toml > /dev/null
}
nvmfd_config

stat_sum() { # KEY: the sum of every KEY in nvmfd's stats
  timeout 10 $BIN/nvmfctl --socket $WORK/nvmfd.sock --json stats | jq "[.. | .\"$1\"? | numbers] | add // 0"
}
nvmfd_start() {
  rm -f $WORK/nvmfd.sock
  $BIN/nvmfd --config $WORK/nvmfd.toml 2>> $WORK/nvmfd.log &
  pid=$!
  for _ in $(seq 100); do [ -S $WORK/nvmfd.sock ] && break; sleep 0.1; done
  timeout 10 $BIN/nvmfctl --socket $WORK/nvmfd.sock status > /dev/null
}
nvmfd_stop() { # SIGTERM; it must exit 0 within 30 s
  local rc=0
  kill -TERM "$pid"
  for _ in $(seq 300); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$pid" 2>/dev/null && fail "nvmfd did not exit within 30 s of SIGTERM"
  wait "$pid" || rc=$?
  pid=
  [ $rc -eq 0 ] || fail "nvmfd exited with status $rc after SIGTERM"
}
kernel_start() { ln -s $C/subsystems/$KERNEL_NQN $C/ports/1/subsystems/$KERNEL_NQN; }
kernel_stop() { rm $C/ports/1/subsystems/$KERNEL_NQN; }

ctrls_of() { # NQN: the host's controllers of that subsystem
  local c
  for c in /sys/class/nvme/nvme*; do
    [ -e "$c/subsysnqn" ] && [ "$(cat "$c/subsysnqn")" = "$1" ] && basename "$c"
  done
  return 0
}
connect() { # NQN PORT: connects; DEV is the namespace's block device
  local b
  timeout 120 nvme connect -t rdma -a "$IP" -s "$2" -n "$1" > /dev/null
  for _ in $(seq 100); do
    for b in /sys/block/nvme*n1; do
      [ -b "/dev/${b##*/}" ] && [ "$(cat "$b/device/subsysnqn" 2>/dev/null)" = "$1" ] \
        && { DEV=/dev/${b##*/}; return 0; }
    done
    sleep 0.1
  done
  fail "no block device for $1 after connecting"
}
disconnect() { # NQN: disconnects and checks that no controller of it is left
  timeout 120 nvme disconnect -n "$1"
  for _ in $(seq 100); do [ -z "$(ctrls_of "$1")" ] && return 0; sleep 0.1; done
  fail "controllers of $1 still there after disconnect: $(ctrls_of "$1")"
}

cpu_snap() { grep -E '^cpu[01] ' /proc/stat; }
cpu_split() { # BEFORE AFTER: each vCPU's time over the interval, in per cent: user, system,
  # interrupts (hard and soft), idle
  printf '%s\n%s\n' "$1" "$2" | awk '
    NR <= 2 { for (i = 2; i <= 11; i++) b[$1, i] = $i; next }
    { t = 0; for (i = 2; i <= 11; i++) { d[i] = $i - b[$1, i]; t += d[i] }; if (!t) t = 1
      printf "  %s usr %3.0f%% sys %3.0f%% irq %3.0f%% idle %3.0f%%", $1,
        100 * (d[2] + d[3]) / t, 100 * d[4] / t, 100 * (d[7] + d[8]) / t, 100 * (d[5] + d[6]) / t }'
}
run_job() { # TARGET ROUND DEV NAME RW BS QD
  local target=$1 round=$2 dev=$3 name=$4 rw=$5 bs=$6 qd=$7 dir out line before cpus
  case $rw in *read) dir=read ;; *) dir=write ;; esac
  out=$WORK/$target-$round-$name.json
  before=$(cpu_snap)
  # shellcheck disable=SC2086 # FIO_EXTRA is split into options
  timeout $((RUNTIME + 120)) taskset -c 1 fio --name="$name" --filename="$dev" --rw="$rw" \
    --bs="$bs" --iodepth="$qd" --ioengine=io_uring --direct=1 --runtime="$RUNTIME" --time_based \
    --norandommap --randrepeat=0 --output-format=json --output="$out" $FIO_WAIT_OPTS $FIO_EXTRA
  cpus=$(cpu_split "$before" "$(cpu_snap)")
  [ "$(jq '.jobs[0].error' "$out")" = 0 ] || fail "fio $name on $target: error $(jq '.jobs[0].error' "$out")"
  line=$(jq -r --arg d $dir '.jobs[0][$d] | [.iops, .clat_ns.mean / 1e3,
    .clat_ns.percentile["99.000000"] / 1e3, .clat_ns.max / 1e6, .bw_bytes / 1048576,
    .lat_ns.mean / 1e3] | @tsv' "$out")
  printf '%s\t%s\t%s\t%s\n' "$target" "$round" "$name" "$line" >> $RESULTS
  awk -F'\t' -v t="$target" -v r="$round" -v n="$name" '{
    printf "%-6s round %s  %-17s %9.0f IOPS %8.1f MiB/s  clat mean %8.1f us  p99 %8.1f us  max %8.2f ms  (lat mean %.1f us)\n",
      t, r, n, $1, $5, $2, $3, $4, $6 }' <<< "$line"
  echo "$cpus"
}
nvmf_job() { # TARGET ROUND NQN PORT NAME RW BS QD
  local target=$1 round=$2 nqn=$3 port=$4 name=$5 rw=$6 bs=$7 qd=$8 out line before cpus
  out=$WORK/$target-$round-$name.json
  before=$(cpu_snap)
  timeout $((RUNTIME + 120)) taskset -c 1 $BIN/nvmf --provider ibverbs --addr "$IP:$port" \
    bench --nqn "$nqn" -q "$qd" -o "$bs" -w "$rw" -t "$RUNTIME" --warmup 1 --json > "$out" \
    || fail "nvmf bench $name on $target failed: $(tail -3 "$out")"
  cpus=$(cpu_split "$before" "$(cpu_snap)")
  line=$(jq -r '.total | [.iops, .latency_us.mean, .latency_us.p99, .latency_us.max / 1e3,
    .mib_per_s, .latency_us.mean] | @tsv' "$out")
  printf '%s\t%s\t%s\t%s\n' "$target" "$round" "$name" "$line" >> $RESULTS
  awk -F'\t' -v t="$target" -v r="$round" -v n="$name" '{
    printf "%-6s round %s  %-21s %9.0f IOPS %8.1f MiB/s  lat mean %8.1f us  p99 %8.1f us  max %8.2f ms\n",
      t, r, n, $1, $5, $2, $3, $4 }' <<< "$line"
  echo "$cpus"
}
round() { # TARGET ROUND: TARGET is kernel, nvmfd or nvmfd@IDLE_SLEEP_AFTER
  local target=$1 r=$2 nqn port spec
  if [ "$target" = kernel ]; then nqn=$KERNEL_NQN; port=$KERNEL_PORT; kernel_start
  else
    nqn=$NVMFD_NQN; port=$NVMFD_PORT
    case $target in nvmfd@*) nvmfd_config "${target#nvmfd@}" ;; *) nvmfd_config ;; esac
    nvmfd_start
  fi
  connect $nqn $port
  echo "== $target round $r: $DEV ($nqn, port $port)"
  for spec in "${JOBS[@]}"; do
    [[ ${spec%% *} =~ $ONLY ]] || continue
    # shellcheck disable=SC2086
    run_job "$target" "$r" "$DEV" $spec
  done
  disconnect $nqn
  # nvmfd's own host tool over ibverbs (user-space verbs on rxe0), pinned as fio was.
  for spec in "nvmf-randread-4k-qd32 randread 4k 32" "nvmf-randread-4k-qd1 randread 4k 1"; do
    [[ ${spec%% *} =~ $ONLY ]] || continue
    # shellcheck disable=SC2086
    nvmf_job "$target" "$r" "$nqn" "$port" $spec
  done
  if [ "$target" != kernel ]; then
    echo "$target round $r: reactor sleeps $(stat_sum sleeps_total), caught before sleep" \
      "$(stat_sum caught_before_sleep_total), commands $(stat_sum commands_total)," \
      "command errors $(stat_sum command_errors_total), drain timeouts $(stat_sum drain_timeouts_total)"
    nvmfd_stop
  else
    kernel_stop
  fi
}

echo "bench: $RUNTIME s per job, $ROUNDS rounds; nvmfd (reactor on vCPU 0) and nvmet-rdma, both" \
  "over a ${SIZE_GIB} GiB null device of $BS-byte blocks; fio io_uring --direct=1 $FIO_WAIT_OPTS $FIO_EXTRA (FIO_WAIT=$FIO_WAIT) on vCPU 1${INLINE:+; in-capsule data $INLINE bytes on both}"
targets=(nvmfd)
if [ -n "$IDLE" ]; then
  targets=()
  for v in $IDLE; do targets+=("nvmfd@$v"); done
fi
for r in $(seq "$ROUNDS"); do
  for t in "${targets[@]}"; do round "$t" "$r"; done
  round kernel "$r"
done

echo
echo "Means over $ROUNDS rounds (clat: fio's completion latency; ratio = nvmfd / kernel)"
awk -F'\t' -v targets="${targets[*]}" '
  { k = $1 SUBSEP $3; n[k]++; iops[k] += $4; mean[k] += $5; p99[k] += $6; mx[k] += $7
    if ($7 > worst[k]) worst[k] = $7
    if (!($3 in seen)) { seen[$3] = 1; order[++jobs] = $3 } }
  function row(t, j, what, a, unit, fmt,   x, y) {
    x = a[t SUBSEP j] / n[t SUBSEP j]; y = a["kernel" SUBSEP j] / n["kernel" SUBSEP j]
    printf "%-21s %-15s " fmt " " fmt "  %6.2f\n", j, what " (" unit ")", x, y, y ? x / y : 0
  }
  END {
    nt = split(targets, ts, " ")
    for (m = 1; m <= nt; m++) {
      t = ts[m]
      printf "%-21s %-15s %10s %10s  %6s\n", "job", "figure", t, "kernel", "ratio"
      for (i = 1; i <= jobs; i++) {
        j = order[i]
        row(t, j, "IOPS", iops, "", "%10.0f"); row(t, j, "clat mean", mean, "us", "%10.1f")
        row(t, j, "clat p99", p99, "us", "%10.1f"); row(t, j, "clat max", mx, "ms", "%10.2f")
        printf "%-21s %-15s %10.2f %10.2f\n", j, "worst max (ms)", worst[t SUBSEP j], worst["kernel" SUBSEP j]
      }
      if (m < nt) print ""
    }
  }' $RESULTS | sed 's/ ()/   /'
echo
echo "kernel log lines about NVMe errors, resets or timeouts:"
dmesg | grep -iE "nvme.*(error|timeout|reset|reconnect|failed)|nvmet.*(error|failed)" || echo "  none"
echo "nvmfd warnings and errors: $(grep -cE '"level":"(WARN|ERRO|CRIT)"' $WORK/nvmfd.log || true)"
grep -E '"level":"(WARN|ERRO|CRIT)"' $WORK/nvmfd.log | head -20 || true
echo "BENCH LAB: DONE"
