# Sourced by the lab's guest scripts (scripts/lab/*-guest.sh).

# nvmfd stops cleanly (exit 0) within a minute, or the run fails.
stop_nvmfd() {
  kill -TERM "$1"
  local t=0
  while kill -0 "$1" 2>/dev/null && [ $t -lt 600 ]; do sleep 0.1; t=$((t + 1)); done
  if kill -0 "$1" 2>/dev/null; then
    echo "STEP FAILED: nvmfd still running 60 s after SIGTERM"; kill -KILL "$1"; exit 1
  fi
  wait "$1"; local rc=$?
  echo "nvmfd exit status $rc"
  [ $rc -eq 0 ] || { echo "STEP FAILED: nvmfd exit status $rc"; exit 1; }
}

# Waits until a command holds, $1 tenths of a second at most; if it never does, says what
# ($2) and fails the run (stopping nvmfd, $pid, if it runs).
wait_until() {
  local tenths=$1 what=$2 i; shift 2
  for i in $(seq "$tenths"); do "$@" && return 0; sleep 0.1; done
  echo "STEP FAILED: not so after $((tenths / 10)) s: $what"
  [ -n "${pid:-}" ] && kill "$pid" 2>/dev/null
  exit 1
}

# Writes completed on namespace device $1 (/dev/nvmeXnY), counted on its paths too
# (/sys/block/nvmeXcZnY): with the kernel's native multipath, 6.1 keeps no count on the
# namespace's own device.
writes_done() {
  local d=${1#/dev/} n=0 f
  for f in /sys/block/$d/stat /sys/block/${d%n*}c*n${d##*n}/stat; do
    [ -r "$f" ] && n=$((n + $(awk '{print $5}' "$f")))
  done
  echo $n
}

# The guests that serve one nvmfd ($BIN, its work folder $WORK, its pid $pid) and step
# through the kernel host's commands.
ctl() { timeout 5 $BIN/nvmfctl --socket $WORK/nvmfd.sock --json "$@"; }

# Runs a step (a command bounded to 120 s, or a function); on failure shows the kernel log,
# nvmfd's status and log, stops nvmfd and fails the run.
step() {
  echo "==> $*"
  if [ "$(type -t "$1")" = function ]; then "$@"; else timeout 120 "$@"; fi || {
    echo "STEP FAILED: $*"
    echo "--- kernel log"; dmesg | tail -40 | sed 's/^/kernel: /'
    echo "--- nvmfd status"; ctl status
    echo "--- nvmfd log"; tail -40 $WORK/nvmfd.log
    kill $pid; exit 1
  }
}

# Waits (bounded) until the listener's `serving` is $1.
serving_is() {
  for i in $(seq 600); do
    ctl status | tr -d ' \n' | grep -q "\"serving\":$1" && return 0
    sleep 0.1
  done
  return 1
}
