#!/usr/bin/env bash
# The whole test suite, as CI runs it: dependencies, formatting, lints, build, every test, and
# the systemd unit. Exits non-zero on the first failure.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
# The RBD tests start a Ceph cluster on 127.0.0.1 (scripts/ceph-dev-cluster.sh): gone at the end.
trap 'scripts/ceph-dev-cluster.sh stop > /dev/null 2>&1 || true' EXIT
# Killed (a CI timeout's SIGTERM), the EXIT trap still stops the cluster.
trap 'exit 130' INT TERM
# Each lab run is bounded (a guest that hangs is killed, the step fails): about two and a half
# times the slowest run's usual time (180 s), so that six hung runs, the tests' own bound
# (below) and the builds stay within a CI job's 90 minutes.
export LAB_TIMEOUT="${LAB_TIMEOUT:-450}"
step() { echo; echo "==> $* ($(( $(date +%s) - t0 ))s)"; }
step "dependencies"
scripts/install-deps.sh
step "every source file is in git"
# A file the build needs but git ignores or does not track builds here and fails in a clean clone.
if git rev-parse --is-inside-work-tree > /dev/null 2>&1; then
  srcs=('*.rs' '*Cargo.toml' 'Cargo.lock' '*.sh' ':!:target/' ':!:nvme/fuzz/target/')
  stray=$( { git ls-files --others -- "${srcs[@]}"
             git ls-files --others --ignored --exclude-standard -- "${srcs[@]}"; } | sort -u)
  if [ -n "$stray" ]; then
    echo "not in git (a clean clone would lack them):"; echo "$stray"; exit 1
  fi
fi
step "cargo fmt --check"
cargo fmt --all -- --check
step "cargo clippy -D warnings"
cargo clippy --workspace --all-targets --locked -- -D warnings
step "build the binaries the end-to-end tests start"
cargo build --workspace --bins --locked
# The lab runs below use the release binaries (scripts/lab/run-guest-script.sh runs this same
# command, then finds nothing to do); built before `cargo test` so that a test can check the
# release build's debug logging.
step "build the release binaries"
cargo build --release --locked --bins
step "cargo test"
mkdir -p target/tmp && rm -f target/tmp/skipped-tests.txt
timeout 1500 cargo test --workspace --locked 2>&1 | tee target/test-output.txt
# The RBD tests skip when the test cluster cannot start; this script installs and starts it,
# so here that is a failure, not a skip (a run that never reached Ceph would pass).
no_ceph='the test cluster did not start|cannot run scripts/ceph-dev-cluster.sh'
if grep -Eq "$no_ceph" target/tmp/skipped-tests.txt 2>/dev/null; then
  echo "the RBD tests were skipped: the Ceph test cluster did not start (scripts/ceph-dev-cluster.sh)"
  grep -E "$no_ceph" target/tmp/skipped-tests.txt | head -3
  exit 1
fi
# Not needed by the lab runs below (each guest runs its own): its memory back.
scripts/ceph-dev-cluster.sh stop > /dev/null 2>&1 || true
step "systemd unit"
scripts/verify-unit.sh target/debug
step "real verbs: the ibverbs provider on rxe0 in the VM lab (../shared/lab)"
scripts/lab-rdma.sh
step "the Linux kernel NVMe/RDMA host against nvmfd on rxe0 in the VM lab"
scripts/lab-kernel-host.sh
step "changes while serving: the Linux kernel host sees a namespace added, resized and removed on rxe0 in the VM lab"
scripts/lab-runtime.sh
step "device removal on real verbs: rxe0 deleted under nvmfd and added back, in the VM lab"
scripts/lab-device-removal.sh
step "a bond's failover on real verbs: the listener's address moves to another rxe device, in the VM lab"
scripts/lab-addr-change.sh
step "the Linux kernel host through nvmfd to Ceph RBD on rxe0, an OSD killed under fio, in the VM lab"
scripts/lab-rbd.sh
passed=$(grep -Eo '[0-9]+ passed' target/test-output.txt | awk '{s+=$1} END {print s+0}')
failed=$(grep -Eo '[0-9]+ failed' target/test-output.txt | awk '{s+=$1} END {print s+0}')
skipped=0
if [ -s target/tmp/skipped-tests.txt ]; then
  echo; echo "Skipped here, with the reason (cargo counts them as passed):"; sort -u target/tmp/skipped-tests.txt
  skipped=$(sort -u target/tmp/skipped-tests.txt | wc -l)
  passed=$((passed - skipped))
fi
echo
echo "all checks done in $(( $(date +%s) - t0 ))s"
echo "$passed passed, $failed failed, $skipped skipped"
