#!/usr/bin/env bash
# blktests' nvme group against nvmfd on rxe0 in the VM lab (../shared/lab), through
# scripts/blktests-target-control: nvmfd is started once and every subsystem blktests asks for
# is made and taken down with nvmfctl while nvmfd serves, never restarted. A bystander host
# (nvmf bench over ibverbs, with --verify) keeps a subsystem of its own busy on one connection
# for the whole run, and must end with no error.
#   scripts/lab-blktests.sh DIR [TEST...]
# DIR is a blktests tree (github linux-blktests/blktests); it is copied to target/blktests, which
# the guest sees. TESTS defaults to the nvme tests that apply to an external RDMA target on the
# lab's kernel 6.1. Every test's verdict is printed; the script fails when any test failed or
# did not run. Not part of the test command: blktests cannot be fetched in CI.
# Environment: NVME_IMG_SIZE (blktests', default 1G), BLKTESTS_TIMEOUT (fio's time limit in
# blktests' timed tests, default 60 s), BLKTESTS_STALL (seconds without progress from check
# before the guest's state is printed; at the second time the run ends; default 240).
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
src=${1:?usage: scripts/lab-blktests.sh BLKTESTS-DIR [TEST...]}
shift
[ -x "$src/check" ] && [ -d "$src/tests/nvme" ] || { echo "lab-blktests: $src is not a blktests tree" >&2; exit 2; }
tests=("$@")
[ ${#tests[@]} -gt 0 ] || tests=(003 004 005 006 008 010 012 014 018 019 021 022 023 025 026 027 028 029 031 038 040 047 061)
dst=$top/target/blktests
src=$(cd "$src" && pwd)
if [ "$src" != "$dst" ]; then
  rm -rf "$dst"
  mkdir -p "$top/target"
  cp -a "$src" "$dst"
fi
rm -rf "$dst/results"
{
  printf 'TESTS="%s"\n' "${tests[*]/#/nvme/}"
  printf 'NVME_IMG_SIZE=%s\n' "${NVME_IMG_SIZE:-1G}"
  printf 'TIMEOUT=%s\n' "${BLKTESTS_TIMEOUT:-60}"
  printf 'BLKTESTS_STALL=%s\n' "${BLKTESTS_STALL:-240}"
} > "$dst/.nvmfd-lab"
exec "$top/scripts/lab/run-guest-script.sh" lab-blktests blktests-guest.sh \
  "LAB BLKTESTS: ALL TESTS PASSED" \
  "blktests' nvme tests passed against nvmfd, changed while it served, and the bystander never noticed"
