#!/usr/bin/env bash
# Checks systemd/nvmfd.service with `systemd-analyze verify`, pointing its commands at the
# binaries of this build (verify insists that they exist).
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
bindir=$(cd "${1:-$top/target/debug}" && pwd)
for b in nvmfd nvmfctl; do
  [ -x "$bindir/$b" ] || { echo "verify-unit: $bindir/$b is missing: build first" >&2; exit 1; }
done
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
sed "s#/usr/local/bin/#$bindir/#g" "$top/systemd/nvmfd.service" > "$tmp/nvmfd.service"
out=$(systemd-analyze verify "$tmp/nvmfd.service" 2>&1) || { echo "$out" >&2; exit 1; }
# verify exits 0 on some warnings: treat any line about our unit as a failure.
if grep -q "nvmfd.service" <<<"$out"; then echo "$out" >&2; exit 1; fi
echo "verify-unit: systemd/nvmfd.service passes systemd-analyze verify"
