#!/usr/bin/env bash
# The data path's cost per I/O, on this machine, with no RDMA device: the real reactor thread
# serving a null namespace (1 GiB, 512-byte blocks) and a host thread in the same process over
# the soft provider's in-process wire (daemon/benches/datapath.rs). Two parts:
#
#  1. Time: for 4 KiB random reads and writes at depth 1 and 32 and 128 KiB reads and writes at
#     depth 16, IOPS and the CPU time the reactor thread spent per I/O (its run time over the
#     I/Os it served; its busy-polling included), and the host thread's (pinned off the
#     reactor's core). Then the same cases with host and target on one thread, turn by turn:
#     the time spent in the target's turns per I/O, its CPU cost with nothing spinning and
#     no other thread contending for the soft provider's lock.
#  2. Instructions (valgrind's callgrind, as `perf stat` cannot count on most of these VMs):
#     the target's work run on the host's thread turn by turn (nothing spins), counted only
#     inside the reactor's poll, over N and 2N I/Os; the difference over N is per I/O. It is
#     split into the soft provider's emulation of the NIC (calls into nvmfd_rdma::soft), the
#     block backend (calls into nvmfd_blockdev; the null backend's zero fill of reads) and the
#     rest, the data path's own.
#
#   scripts/bench-datapath.sh                 both parts (3 s per case; callgrind about 1 min)
#   SECONDS_PER_CASE=10 scripts/bench-datapath.sh
#   scripts/bench-datapath.sh --no-callgrind
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${SECONDS_PER_CASE:-3}
callgrind=1
case "${1:-}" in
  "") ;;
  --no-callgrind) callgrind=0 ;;
  -h|--help) sed -n '2,/^set -e/{/^set -e/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
  *) echo "bench-datapath: unknown argument '$1'" >&2; exit 2 ;;
esac
exe=$(cargo bench --locked -p nvmfd --bench datapath --no-run 2>&1 \
  | sed -n 's/.*Executable .*(\(.*\)).*/\1/p' | tail -1)
[ -x "$exe" ] || { echo "bench-datapath: no benchmark executable" >&2; exit 1; }
echo "== time: reactor thread and host thread, ${secs} s per case"
"$exe" --seconds "$secs"
echo "== time: host and target turn by turn on one thread (nothing spins, no lock contended), ${secs} s per case"
"$exe" --manual --seconds "$secs"
if [ "$callgrind" = 0 ]; then exit 0; fi
if ! command -v valgrind > /dev/null; then
  echo "== instructions: skipped (valgrind is not installed: apt-get install valgrind)"
  exit 0
fi
echo "== instructions per I/O in the target (callgrind; NIC emulation = the soft provider)"
printf '%-18s %9s %14s %14s %14s\n' case total "NIC emulation" "block backend" "data path"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for case in randread-4k-qd1 randread-4k-qd32 randwrite-4k-qd1 randwrite-4k-qd32 read-128k-qd16 write-128k-qd16; do
  n=4000
  case $case in *128k*) n=1000 ;; esac
  for k in "$n" $((2 * n)); do
    valgrind --tool=callgrind --collect-atstart=no \
      '--toggle-collect=*ReactorPaths*ReactorWork*poll*' \
      --callgrind-out-file="$tmp/$case.$k" "$exe" --manual --case "$case" --ios "$k" \
      > /dev/null 2>&1
    python3 scripts/lib/callgrind-split.py "$tmp/$case.$k" > "$tmp/$case.$k.json"
  done
  python3 - "$tmp/$case.$n.json" "$tmp/$case.$((2 * n)).json" "$n" "$case" <<'PY'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
n, case = int(sys.argv[3]), sys.argv[4]
per = {k: (b[k] - a[k]) / n for k in a}
own = per["total"] - per["nic_emulation"] - per["block_backend"]
print(f'{case:<18} {per["total"]:9.0f} {per["nic_emulation"]:14.0f} {per["block_backend"]:14.0f} {own:14.0f}')
PY
done
