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
