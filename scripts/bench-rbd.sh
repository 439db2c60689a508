#!/usr/bin/env bash
# What the network store costs: `nvmf bench` against an RBD namespace (an image of the test
# cluster, scripts/ceph-dev-cluster.sh, on this machine: 3 memstore OSDs, pool size 3) and a
# file namespace of the same size, one nvmfd, one reactor, soft provider over TCP loopback;
# the two alternate job by job. Prints each run and, per job, the medians and the ratio
# rbd/file. The cluster is started if needed and left running (scripts/ceph-dev-cluster.sh stop).
# Knobs: RUNTIME (s per run, default 8), ROUNDS (default 2), SIZE_MIB (default 256),
# FILE (default /var/tmp/nvmfd-bench-rbd.img).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNTIME=${RUNTIME:-8}; ROUNDS=${ROUNDS:-2}; SIZE_MIB=${SIZE_MIB:-256}
FILE=${FILE:-/var/tmp/nvmfd-bench-rbd.img}
cargo build --release --locked --bins 2>&1 | tail -1
CONF=$(scripts/ceph-dev-cluster.sh start | tail -1)
WORK=$(mktemp -d)
IMAGE=bench-$$
PORT=4460
NQN=nqn.2024-01.io.nvmfd:bench-rbd
truncate -s ${SIZE_MIB}M "$FILE"
cat > "$WORK/nvmfd.toml" <<CFG
[daemon]
reactor_cores = [0]
admin_socket = "$WORK/nvmfd.sock"
[[listener]]
address = "127.0.0.1"
port = $PORT
provider = "soft"
[[subsystem]]
nqn = "$NQN"
allow_any_host = true
[[subsystem.namespace]]
nsid = 1
backend = "file"
path = "$FILE"
[[subsystem.namespace]]
nsid = 2
backend = "rbd"
pool = "rbd"
image = "$IMAGE"
ceph_conf = "$CONF"
create = true
size = "${SIZE_MIB}MiB"
CFG
target/release/nvmfd --config "$WORK/nvmfd.toml" 2>"$WORK/nvmfd.log" &
pid=$!
cleanup() {
  kill $pid 2>/dev/null; wait $pid 2>/dev/null
  rbd -c "$CONF" rm "rbd/$IMAGE" >/dev/null 2>&1 || true
  rm -rf "$WORK"
}
trap cleanup EXIT
for _ in $(seq 300); do
  target/release/nvmfctl --socket "$WORK/nvmfd.sock" status >/dev/null 2>&1 && break
  kill -0 $pid 2>/dev/null || { cat "$WORK/nvmfd.log" >&2; exit 1; }
  sleep 0.1
done
target/release/nvmfctl --socket "$WORK/nvmfd.sock" --json status \
  | python3 -c "
import json, sys
for n in json.load(sys.stdin)['namespaces']:
    print('bench: nsid', n['nsid'], n['backend'], n['size'] >> 20, 'MiB, serving:', n['serving'], n.get('reason', ''))
"
bench() { # nsid args... -> "iops p99"
  local nsid=$1; shift
  target/release/nvmf bench --addr 127.0.0.1:$PORT --nqn "$NQN" --nsid "$nsid" -t "$RUNTIME" \
      --warmup 1 --json "$@" \
    | python3 -c 'import json,sys; t=json.load(sys.stdin)["total"]; print(round(t["iops"]), t["latency_us"]["p50"], t["latency_us"]["p99"])'
}
# Every block written once, so reads read data on both.
echo "bench: filling both namespaces ($SIZE_MIB MiB each, 128 KiB sequential writes)"
for ns in 1 2; do
  target/release/nvmf bench --addr 127.0.0.1:$PORT --nqn "$NQN" --nsid $ns -w write -o 128k \
      -q 16 -t $(( SIZE_MIB / 64 + 2 )) --warmup 0 --json >/dev/null
done
echo "bench: $RUNTIME s per run, $ROUNDS rounds, file and rbd alternating (ABBA)"
declare -A runs
jobs=("randread 4k 32" "randwrite 4k 32" "write 128k 16")
for r in $(seq "$ROUNDS"); do
  for j in "${jobs[@]}"; do
    set -- $j
    order="1 2"; [ $((r % 2)) -eq 0 ] && order="2 1"
    for ns in $order; do
      out=$(bench $ns -w "$1" -o "$2" -q "$3")
      name=$([ $ns -eq 1 ] && echo file || echo rbd)
      echo "  round $r $1 $2 QD$3 $name: IOPS p50 p99 (µs) = $out"
      runs["$j $name"]+="$out;"
    done
  done
done
echo; echo "medians (IOPS, MiB/s, p99 µs), rbd/file ratio:"
for j in "${jobs[@]}"; do
  python3 - "$j" "${runs["$j file"]}" "${runs["$j rbd"]}" <<'PY'
import statistics, sys
job, f, r = sys.argv[1], sys.argv[2], sys.argv[3]
def med(s):
    rows = [list(map(float, x.split())) for x in s.strip(";").split(";")]
    return [statistics.median(c) for c in zip(*rows)]
(fi, _, fp99), (ri, _, rp99) = med(f), med(r)
w, bs, qd = job.split()
size = int(bs[:-1]) * 1024
mib = lambda iops: iops * size / 2**20
print(f"{w:<9} {bs:>4} QD{qd:<3} file {fi:>8.0f} IOPS {mib(fi):>7.1f} MiB/s p99 {fp99:>8.1f} | rbd {ri:>8.0f} IOPS {mib(ri):>7.1f} MiB/s p99 {rp99:>8.1f} | rbd/file {ri/fi:.3f}")
PY
done
