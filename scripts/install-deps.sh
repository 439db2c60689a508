#!/usr/bin/env bash
# Installs what building and testing nvmfd needs on Debian 12, and checks the Rust toolchain.
# Idempotent and quick when everything is there. Run as root (or with sudo available).
set -euo pipefail
PKGS=(build-essential pkg-config libclang-dev clang libibverbs-dev librdmacm-dev ibverbs-providers
      rdma-core systemd iproute2 procps fio)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  echo "install-deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
need=1.85
if ! command -v cargo >/dev/null 2>&1; then
  echo "install-deps: no Rust toolchain: install Rust $need or newer with rustup (https://rustup.rs), then run this again" >&2
  exit 1
fi
have=$(rustc --version | awk '{print $2}')
if [ "$(printf '%s\n%s\n' "$need" "$have" | sort -V | head -1)" != "$need" ]; then
  echo "install-deps: Rust $have is too old: nvmfd needs $need or newer (rustup update)" >&2
  exit 1
fi
echo "install-deps: ready (Rust $have)"
