#!/usr/bin/env bash
# The io_uring backend beside fio's io_uring engine, on the same file, same block size and
# queue depth, alternating runs so that both see the same machine. Prints each pair and the
# ratio nvmfd/fio of the medians.
#   scripts/bench-blockdev.sh [FILE]     (default /var/tmp/nvmfd-bench.img, 1 GiB, created)
# Knobs: RUNTIME (s, default 10), ROUNDS (default 4), QD (default 32), SIZE_MIB (default 1024).
set -euo pipefail
cd "$(dirname "$0")/.."
FILE=${1:-/var/tmp/nvmfd-bench.img}
RUNTIME=${RUNTIME:-10}; ROUNDS=${ROUNDS:-4}; QD=${QD:-32}; SIZE_MIB=${SIZE_MIB:-1024}
command -v fio >/dev/null || { echo "bench: fio is missing (scripts/install-deps.sh installs it)" >&2; exit 1; }
cargo build --release --locked -p nvmfd-blockdev --example blockdev-bench 2>&1 | tail -1
BENCH=target/release/examples/blockdev-bench
if [ ! -f "$FILE" ] || [ "$(stat -c %s "$FILE")" -ne $((SIZE_MIB << 20)) ]; then
  echo "bench: writing $SIZE_MIB MiB of data to $FILE (reads of never-written blocks would not touch the disk)"
  fio --name=fill --filename="$FILE" --size=${SIZE_MIB}m --rw=write --bs=1m --direct=1 \
      --ioengine=io_uring --iodepth=8 --output=/dev/null
fi
fio_run() { # mode bs -> iops
  local rw=$1 bs=$2
  fio --name=b --filename="$FILE" --size=${SIZE_MIB}m --rw="$rw" --bs="$bs" --direct=1 \
      --ioengine=io_uring --iodepth="$QD" --runtime="$RUNTIME" --time_based --norandommap \
      --randrepeat=0 --buffer_pattern=0x6e766d66 --output-format=json \
    | python3 -c 'import json,sys; j=json.load(sys.stdin)["jobs"][0]; print(round(j["read"]["iops"]+j["write"]["iops"]))'
}
ours_run() { # mode bs submit-policy
  "$BENCH" --file "$FILE" --mode "$1" --bs "$2" --qd "$QD" --runtime "$RUNTIME" --submit "$3" \
    | python3 -c 'import json,sys; j=json.loads(sys.stdin.read()); assert j["errors"]==0, j; print(round(j["iops"]))'
}
median() { grep -v '^$' | sort -n | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
report() { # name bs fio-list ours-list label
  local f o; f=$(tr ' ' '\n' <<<"$3" | median); o=$(tr ' ' '\n' <<<"$4" | median)
  python3 - "$1" "$2" "$f" "$o" "$5" <<'PY'
import sys
name, bs, f, o, label = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
print(f"{name:<24} fio {f:>8.0f} IOPS {f*bs/2**20:>7.1f} MiB/s | nvmfd {label:<14} {o:>8.0f} IOPS {o*bs/2**20:>7.1f} MiB/s | ratio {o/f:.3f}")
PY
}
echo "bench: $FILE, QD $QD, $RUNTIME s per run, $ROUNDS rounds, fio and nvmfd in ABBA order"
echo "bench: nvmfd submits each operation as queued (as fio does), once per loop turn blocking for a"
echo "bench: completion, and once per turn of a loop that never blocks (as the reactor runs it: poll)"
results=()
for spec in "randread 4096 randread" "seqwrite 131072 write"; do
  set -- $spec; mode=$1; bs=$2; rw=$3
  fl=""; el=""; tl=""; pl=""
  for r in $(seq "$ROUNDS"); do
    # ABBA order: the host's caches and write-back favour neither side.
    if [ $((r % 2)) -eq 1 ]; then
      f=$(fio_run "$rw" "$bs"); e=$(ours_run "$mode" "$bs" each); t=$(ours_run "$mode" "$bs" turn)
      p=$(ours_run "$mode" "$bs" poll)
    else
      p=$(ours_run "$mode" "$bs" poll); t=$(ours_run "$mode" "$bs" turn)
      e=$(ours_run "$mode" "$bs" each); f=$(fio_run "$rw" "$bs")
    fi
    echo "  $mode bs=$bs round $r: fio $f IOPS, nvmfd $e IOPS (each), $t IOPS (per turn), $p IOPS (poll)"
    fl="$fl $f"; el="$el $e"; tl="$tl $t"; pl="$pl $p"
  done
  results+=("$(report "$mode bs=$bs qd=$QD" "$bs" "$fl" "$el" "submit-each")")
  results+=("$(report "$mode bs=$bs qd=$QD" "$bs" "$fl" "$tl" "submit-per-turn")")
  results+=("$(report "$mode bs=$bs qd=$QD" "$bs" "$fl" "$pl" "poll")")
done
echo; echo "medians:"; printf '%s\n' "${results[@]}"
