#!/usr/bin/env bash
# Installs from Debian 12's packages what nvmfd needs, saying what it installs and why. Nothing
# has to be installed before it, Rust included. Run again, it installs nothing and prints one
# line. Run as root (or as a user with sudo).
#
#   scripts/install-deps.sh               the build, the quick start, the service and the tests
#                                         (scripts/test.sh runs this)
#   scripts/install-deps.sh --build-only  what building and running nvmfd and its service need
#                                         (scripts/quickstart.sh runs this)
#
# Rust: a cargo and rustc at least as new as the workspace's rust-version (Cargo.toml) that are
# already on the PATH, rustup's for one, are left alone and used. Otherwise Debian 12's own
# current toolchain is installed: rustc-web and cargo-web (/usr/bin/rustc, /usr/bin/cargo; a
# current release comes from bookworm-security and bookworm-updates), and for the tests
# rustfmt-web and rust-web-clippy (cargo fmt, cargo clippy). No rustup, no download but Debian's.
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
mode=all
case "${1:-}" in
  "") ;;
  --build-only) mode=build ;;
  -h|--help) sed -n '2,/^set -e/{/^set -e/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
  *) echo "install-deps: unknown argument '$1' (--build-only or nothing)" >&2; exit 2 ;;
esac
say() { echo "install-deps: $*"; }
die() { echo "install-deps: $*" >&2; exit 1; }

# Debian packages and why nvmfd needs them.
build_pkgs=(
  "build-essential|the C compiler, linker and C library headers that cargo links nvmfd with"
  "pkg-config|rdma-sys finds libibverbs and librdmacm with it"
  "libclang-dev|bindgen (rdma-sys) reads the verbs headers with libclang"
  "clang|bindgen asks clang for the C system include paths"
  "libibverbs-dev|the verbs library the ibverbs provider links"
  "librdmacm-dev|the RDMA connection manager library the ibverbs provider links"
  "librbd-dev|the RBD backend's bindings are generated from librbd's and librados's headers (the libraries are loaded when an RBD namespace is opened)"
  "ibverbs-providers|the user-space drivers of RDMA NICs and of Soft-RoCE (rxe)"
  "rdma-core|loads the RDMA kernel modules (the unit starts after rdma-load-modules@rdma.service)"
  "iproute2|rdma and ip: RDMA links (rdma link add for Soft-RoCE) and the listener's address"
  "procps|ps and top: nvmfd's reactor threads by name"
  "ca-certificates|cargo fetches the crates from crates.io over HTTPS"
  "systemd|the service manager of systemd/nvmfd.service, and systemd-analyze"
)
test_pkgs=(
  "fio|scripts/bench-blockdev.sh compares the io_uring backend with fio"
  "ceph-mon|scripts/ceph-dev-cluster.sh runs the RBD tests' cluster: its monitor"
  "ceph-osd|scripts/ceph-dev-cluster.sh: its OSDs"
  "ceph-common|scripts/ceph-dev-cluster.sh: the ceph and rbd commands"
  "python3|scripts/lab-rdma.sh, scripts/ceph-dev-cluster.sh and the bench scripts read JSON with it"
)
pkgs=("${build_pkgs[@]}")
[ "$mode" = build ] || pkgs+=("${test_pkgs[@]}")

installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
todo=()    # "package|why"
for p in "${pkgs[@]}"; do installed "${p%%|*}" || todo+=("$p"); done

# The Rust toolchain.
need=$(sed -nE 's/^rust-version *= *"([0-9.]+)".*/\1/p' "$top/Cargo.toml" | head -1)
[ -n "$need" ] || die "no rust-version in $top/Cargo.toml"
version_of() { "$1" --version 2>/dev/null | awk 'NR == 1 {print $2}' || true; }
at_least() { [ "$(printf '%s\n%s\n' "$1" "$2" | sort -V | head -1)" = "$1" ]; }  # at_least MIN VERSION
debian_pkg_of() { dpkg-query -S "$(readlink -f "$1")" 2>/dev/null | awk -F: 'NR == 1 {print $1}' || true; }
rust_ok() {
  local c r
  c=$(version_of cargo); r=$(version_of rustc)
  [ -n "$c" ] && [ -n "$r" ] && at_least "$need" "$c" && at_least "$need" "$r"
}
debian_rust=
if ! rust_ok; then
  for t in cargo rustc; do
    path=$(command -v "$t" || true)
    [ -n "$path" ] || { say "Rust: no $t on the PATH"; continue; }
    v=$(version_of "$t")
    if [ -n "$v" ] && at_least "$need" "$v"; then continue; fi
    if [ -z "$(debian_pkg_of "$path")" ]; then
      # Debian's would go to /usr/bin, behind this one on the PATH: it would not be used.
      die "$t ${v:-(no version)} at $path is older than the workspace's rust-version $need and is not Debian's: update it (rustup update) or take it off the PATH, then run this again"
    fi
    say "Rust: Debian's $t ${v:-(broken)} ($(debian_pkg_of "$path")) is older than $need"
  done
  debian_rust=1
  todo+=("rustc-web|Rust $need or newer (the workspace's rust-version): Debian 12's current rustc")
  todo+=("cargo-web|Rust $need or newer: Debian 12's current cargo")
fi
if [ "$mode" = all ]; then
  if [ -n "$debian_rust" ] || [ "$(debian_pkg_of "$(command -v cargo)")" = cargo-web ]; then
    installed rustfmt-web || todo+=("rustfmt-web|cargo fmt --check (the test command), for Debian's Rust")
    installed rust-web-clippy || todo+=("rust-web-clippy|cargo clippy (the test command), for Debian's Rust")
  else
    for c in fmt clippy; do
      cargo "$c" --version >/dev/null 2>&1 \
        || die "cargo $c, which the test command runs, is missing from the toolchain of $(command -v cargo): rustup component add rustfmt clippy"
    done
  fi
fi

if [ ${#todo[@]} -gt 0 ]; then
  SUDO=
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || die "not root and no sudo: run this as root"
    SUDO=sudo
  fi
  names=()
  say "installing from Debian's packages:"
  for p in "${todo[@]}"; do printf '  %-18s %s\n' "${p%%|*}" "${p#*|}"; names+=("${p%%|*}"); done
  export DEBIAN_FRONTEND=noninteractive
  apt=($SUDO apt-get -o DPkg::Lock::Timeout=600)
  "${apt[@]}" update -qq
  if [ -n "$debian_rust" ]; then
    cand=$(apt-cache policy cargo-web | awk '/Candidate:/ {print $2}')
    upstream=${cand%%+*}
    if [ -z "$cand" ] || [ "$cand" = "(none)" ] || ! at_least "$need" "$upstream"; then
      die "Debian's cargo-web here is ${cand:-missing}, older than $need: apt needs bookworm-security and bookworm-updates (as a Debian 12 install has them), e.g. in /etc/apt/sources.list:
  deb http://deb.debian.org/debian bookworm-updates main
  deb http://deb.debian.org/debian-security bookworm-security main"
    fi
    say "Rust: cargo-web and rustc-web $upstream ($cand)"
  fi
  removed=$("${apt[@]}" install -s --no-install-recommends "${names[@]}" | awk '$1 == "Remv" {print $2}' | tr '\n' ' ')
  [ -z "$removed" ] || say "removing, as they conflict with Debian 12's current Rust: $removed"
  "${apt[@]}" install -y -qq --no-install-recommends "${names[@]}" >/dev/null
  hash -r
fi

rust_ok || die "cargo on the PATH ($(command -v cargo || echo none), $(version_of cargo)) is still older than $need"
if [ "$mode" = all ]; then
  cargo fmt --version >/dev/null 2>&1 || die "cargo fmt does not run"
  cargo clippy --version >/dev/null 2>&1 || die "cargo clippy does not run"
fi
say "ready (Rust $(version_of rustc), cargo at $(command -v cargo)$([ "$mode" = build ] && echo '; build only'))"
