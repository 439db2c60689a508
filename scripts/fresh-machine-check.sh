#!/usr/bin/env bash
# Proves the README on a fresh Debian 12: builds a minimal Debian 12 root file system with
# debootstrap, copies this checkout in, and inside it (chroot, as root, nothing installed
# before) runs the quick start's install and build, starts nvmfd on config/examples/ram.toml,
# writes and reads it back with `nvmf verify`, stops it, then installs the service as the
# README's "Running as a service" says and checks the installed unit with `systemd-analyze
# verify` and its ExecStartPre configuration check on the installed example. Prints each step's
# wall time; stops at the first failure and says which. Not part of the test command: it
# downloads Debian packages and crates and builds the workspace in release (several minutes on
# 2 cores). Run as root on a Debian 12 host whose apt reaches a Debian mirror.
#
#   scripts/fresh-machine-check.sh [--worktree] [--keep] [--reuse]
#     --worktree  copy the working tree (tracked and untracked files, less what git ignores)
#                 instead of HEAD
#     --keep      leave the root file system in place afterwards (it is removed otherwise)
#     --reuse     start from the root file system --keep left (its packages, crates and build):
#                 quicker, but not a fresh machine; the default is a new one every run
# FRESH_DIR (default /var/tmp/nvmfd-fresh) holds the root file system, debootstrap's package
# cache and the log; MIRROR and SECURITY_MIRROR override the Debian mirrors taken from the
# host's apt sources.
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
worktree= keep= reuse=
for a in "$@"; do
  case "$a" in
    --worktree) worktree=1 ;;
    --keep) keep=1 ;;
    --reuse) reuse=1 keep=1 ;;
    -h|--help) sed -n '2,/^set -e/{/^set -e/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
    *) echo "fresh-machine-check: unknown argument '$a'" >&2; exit 2 ;;
  esac
done
[ "$(id -u)" -eq 0 ] || { echo "fresh-machine-check: run as root (debootstrap, chroot, mounts)" >&2; exit 1; }

FRESH_DIR=${FRESH_DIR:-/var/tmp/nvmfd-fresh}
ROOT=$FRESH_DIR/rootfs
SRC=/root/nvmfd                       # the checkout, inside the root file system
LOG=$FRESH_DIR/fresh-machine-check.log
NS=nvmfd-fresh-$$                     # network namespace nvmfd runs in: its own 127.0.0.1:4420
NQN=nqn.2024-01.io.nvmfd:ram0
mkdir -p "$FRESH_DIR"
exec 9>"$FRESH_DIR/.lock"
flock -n 9 || { echo "fresh-machine-check: another run holds $FRESH_DIR/.lock" >&2; exit 1; }
: > "$LOG"

t_start=$EPOCHREALTIME
since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN {printf "%.2f", b - a}'; }
summary=()
# Lines of cargo's and apt's progress that go to the log only.
QUIET='^ *(Compiling|Downloaded|Downloading|Updating crates.io|Locking|Adding|Blocking) '
step() { # step NAME COMMAND... : runs COMMAND (set -e), its output to the log and the terminal
  local name=$1 t=$EPOCHREALTIME rc; shift
  echo "==> $name"
  echo "==> $name" >> "$LOG"
  set +e
  ( set -e; "$@" ) 2>&1 | tee -a "$LOG" | { grep --line-buffered -vE "$QUIET" | sed -u 's/^/    /' || true; }
  rc=${PIPESTATUS[0]}
  set -e
  if [ "$rc" -ne 0 ]; then
    echo "FAILED: $name (exit status $rc, after $(since "$t") s); the whole log: $LOG" >&2
    exit 1
  fi
  echo "    ($(since "$t") s)"
  summary+=("$(printf '%7s s  %s' "$(since "$t")" "$name")")
}

# A clean environment in the chroot: root's own HOME (so CARGO_HOME is /root/.cargo there, and
# crates come from crates.io into the new system), Debian's default PATH, nothing of the host's.
in_root() { # in_root COMMAND-LINE: bash -c in the checkout inside the root file system
  env -i HOME=/root USER=root LOGNAME=root TERM="${TERM:-dumb}" LANG=C.UTF-8 \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    chroot "$ROOT" /bin/bash -c "cd $SRC && $1"
}
in_ns() { # in_ns COMMAND-LINE: as in_root, in nvmfd's network namespace
  env -i HOME=/root USER=root LOGNAME=root TERM="${TERM:-dumb}" LANG=C.UTF-8 \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    ip netns exec "$NS" chroot "$ROOT" /bin/bash -c "cd $SRC && $1"
}

alive() { # alive PID: running (a child that has ended stays a zombie until waited for)
  local st
  st=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1) && [ -n "$st" ] && [ "$st" != Z ]
}
mounts_under() { awk -v r="$ROOT" '$2 == r || index($2, r "/") == 1 {print $2}' /proc/self/mounts; }
root_pids() { # the processes whose root is the root file system: this script's only
  local p
  for p in /proc/[0-9]*; do
    [ "$(readlink "$p/root" 2>/dev/null)" = "$ROOT" ] && echo "${p#/proc/}"
  done
  true
}
stop_root_processes() {
  local sig pid
  for sig in TERM KILL; do
    for pid in $(root_pids); do kill -s "$sig" "$pid" 2>/dev/null || true; done
    for _ in $(seq 50); do [ -n "$(root_pids)" ] || return 0; sleep 0.1; done
  done
}
unmount_root() {
  local m
  for m in $(mounts_under | sort -r); do umount -R "$m" 2>/dev/null || umount -R -l "$m" 2>/dev/null || true; done
  [ -z "$(mounts_under)" ] || { echo "fresh-machine-check: still mounted: $(mounts_under | tr '\n' ' ')" >&2; return 1; }
}
remove_root() { # never while anything is mounted in it (/dev is the host's)
  [ -d "$ROOT" ] || return 0
  unmount_root && rm -rf --one-file-system "$ROOT"
}
cleanup() {
  local rc=$?
  set +e
  [ -z "${NVMFD_PID:-}" ] || kill -TERM "$NVMFD_PID" 2>/dev/null
  [ -d "$ROOT" ] && stop_root_processes
  ip netns del "$NS" 2>/dev/null
  if [ -d "$ROOT" ]; then
    if [ -n "$keep" ]; then unmount_root && echo "fresh-machine-check: root file system kept in $ROOT"
    else remove_root; fi
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# The Debian mirrors this host's apt uses (deb822 .sources or one-line .list files).
host_uris() {
  { awk '/^URIs:/ {for (i = 2; i <= NF; i++) print $i}' /etc/apt/sources.list.d/*.sources 2>/dev/null
    awk '$1 == "deb" {for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) {print $i; break}}' \
      /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null
  } | sed 's#/*$##' || true
}
MIRROR=${MIRROR:-$(host_uris | grep -E '/debian$' | head -1 || true)}
[ -n "$MIRROR" ] || { echo "fresh-machine-check: no Debian mirror in the host's apt sources: set MIRROR" >&2; exit 1; }
SECURITY_MIRROR=${SECURITY_MIRROR:-$(host_uris | grep -E '/debian-security$' | head -1 || true)}
SECURITY_MIRROR=${SECURITY_MIRROR:-$MIRROR-security}

echo "fresh-machine-check: Debian 12 in $ROOT from $MIRROR and $SECURITY_MIRROR; log in $LOG"

host_tools() {
  local missing=()
  command -v debootstrap >/dev/null || missing+=(debootstrap)
  command -v ip >/dev/null || missing+=(iproute2)
  command -v git >/dev/null || missing+=(git)
  if [ ${#missing[@]} -gt 0 ]; then
    echo "installing on this host: ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  echo "debootstrap $(dpkg-query -W -f='${Version}' debootstrap)"
}
step "host: debootstrap, ip and git" host_tools

rootfs() {
  mkdir -p "$FRESH_DIR/debs"
  debootstrap --variant=minbase --cache-dir="$FRESH_DIR/debs" bookworm "$ROOT" "$MIRROR" \
    > "$FRESH_DIR/debootstrap.log" 2>&1 || { tail -20 "$FRESH_DIR/debootstrap.log"; return 1; }
  rm -f "$ROOT"/var/cache/apt/archives/*.deb
  echo "$(chroot "$ROOT" dpkg-query -W | wc -l) packages, $(du -sh --one-file-system "$ROOT" | cut -f1)"
}
if [ -n "$reuse" ] && [ -x "$ROOT/usr/bin/apt-get" ]; then
  unmount_root
  echo "==> reusing $ROOT (--reuse): NOT a fresh machine"
else
  remove_root
  step "debootstrap bookworm (minbase) into a new root file system" rootfs
fi

setup() {
  # apt sources as a Debian 12 installation has them: the release, its updates and security.
  rm -f "$ROOT"/etc/apt/sources.list.d/*
  cat > "$ROOT/etc/apt/sources.list" <<SRC
deb $MIRROR bookworm main
deb $MIRROR bookworm-updates main
deb $SECURITY_MIRROR bookworm-security main
SRC
  sed 's/^/apt: /' "$ROOT/etc/apt/sources.list"
  cp -L /etc/resolv.conf "$ROOT/etc/resolv.conf"
  # The CA certificates added on this host (a network that inspects TLS, say): when
  # install-deps installs ca-certificates, they are trusted in there as they are here.
  local crts=(/usr/local/share/ca-certificates/*.crt)
  if [ -e "${crts[0]}" ]; then
    mkdir -p "$ROOT/usr/local/share/ca-certificates"
    cp "${crts[@]}" "$ROOT/usr/local/share/ca-certificates/"
    [ ! -x "$ROOT/usr/sbin/update-ca-certificates" ] || chroot "$ROOT" update-ca-certificates >/dev/null 2>&1
    echo "CA certificates added on this host: ${crts[*]##*/}"
  fi
  # Packages do not start services from inside a chroot (they would run on this host).
  printf '#!/bin/sh\nexit 101\n' > "$ROOT/usr/sbin/policy-rc.d"; chmod 0755 "$ROOT/usr/sbin/policy-rc.d"
  mount -t proc proc "$ROOT/proc"
  mount --rbind /sys "$ROOT/sys"; mount --make-rslave "$ROOT/sys"
  mount --rbind /dev "$ROOT/dev"; mount --make-rslave "$ROOT/dev"
  mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs "$ROOT/run"
  ip netns add "$NS"
  ip netns exec "$NS" ip link set lo up
  echo "mounted /proc, /sys, /dev and /run; DNS from this host; network namespace $NS for nvmfd"
}
step "apt sources, DNS, mounts" setup

copy_checkout() {
  mkdir -p "$ROOT$SRC"
  find "$ROOT$SRC" -mindepth 1 -maxdepth 1 ! -name target -exec rm -rf {} +
  if [ -n "$worktree" ]; then
    (cd "$top" && git ls-files -z --cached --others --exclude-standard \
      | tar --null -T - --ignore-failed-read -cf - 2>/dev/null) | tar -xf - -C "$ROOT$SRC"
    echo "the working tree of $top (HEAD $(git -C "$top" rev-parse --short HEAD), with its changes)"
  else
    git -C "$top" archive HEAD | tar -xf - -C "$ROOT$SRC"
    echo "HEAD of $top: $(git -C "$top" log -1 --format='%h %s' | cut -c1-100)"
  fi
  echo "$(find "$ROOT$SRC" -path "$ROOT$SRC/target" -prune -o -type f -print | wc -l) files in $SRC"
}
step "copy the checkout in" copy_checkout

step "quick start, install: scripts/install-deps.sh --build-only" \
  in_root "scripts/install-deps.sh --build-only && cargo --version && rustc --version"
step "quick start, build: scripts/quickstart.sh --no-run (install-deps again, release build, install)" \
  in_root "scripts/quickstart.sh --no-run"

# The quick start itself, in the background (started here, so that this shell can wait for
# it): install-deps and cargo find everything done, then it runs nvmfd in the foreground on
# config/examples/ram.toml. env, ip netns exec, chroot, bash and the quick start all exec: $!
# ends up being nvmfd.
env -i HOME=/root USER=root LOGNAME=root TERM="${TERM:-dumb}" LANG=C.UTF-8 \
  PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  ip netns exec "$NS" chroot "$ROOT" /bin/bash -c "cd $SRC && exec ./scripts/quickstart.sh" \
  < /dev/null > "$FRESH_DIR/nvmfd.log" 2>&1 &
NVMFD_PID=$!
start_nvmfd() {
  local pid=$NVMFD_PID deadline=$((SECONDS + 300))
  until in_ns "nvmfctl status" > "$FRESH_DIR/status.out" 2>&1; do
    if ! alive "$pid"; then
      echo "the quick start ended before nvmfd answered:"; tail -30 "$FRESH_DIR/nvmfd.log"; return 1
    fi
    if [ $SECONDS -ge $deadline ]; then
      echo "nvmfd did not answer nvmfctl status in 300 s:"; tail -30 "$FRESH_DIR/nvmfd.log"; cat "$FRESH_DIR/status.out"; return 1
    fi
    sleep 0.2
  done
  echo "nvmfd (pid $pid) answers nvmfctl status: $(grep -Eo 'state +[a-z]+' "$FRESH_DIR/status.out" | tr -s ' ')"
}
step "quick start: ./scripts/quickstart.sh in the background until nvmfctl status answers" start_nvmfd

step "nvmf discover" in_ns "nvmf discover"
step "nvmf verify --nqn $NQN" in_ns "nvmf verify --nqn $NQN"
step "nvmfctl status" in_ns "nvmfctl status"

stop_nvmfd() {
  local pid=$NVMFD_PID rc=0
  kill -TERM "$pid"
  for _ in $(seq 300); do alive "$pid" || break; sleep 0.1; done
  if alive "$pid"; then echo "nvmfd did not stop within 30 s of SIGTERM"; return 1; fi
  wait "$pid" || rc=$?
  echo "nvmfd's log:"; sed 's/^/  /' "$FRESH_DIR/nvmfd.log"
  [ "$rc" -eq 0 ] || { echo "nvmfd exited with status $rc"; return 1; }
  echo "nvmfd exited with status 0"
}
# Not in a subshell as the other steps: nvmfd is this shell's child, for its exit status.
t=$EPOCHREALTIME
echo "==> stop nvmfd (SIGTERM)" | tee -a "$LOG"
rc=0; stop_nvmfd > "$FRESH_DIR/stop.out" 2>&1 || rc=$?
tee -a "$LOG" < "$FRESH_DIR/stop.out" | sed 's/^/    /'
[ "$rc" -eq 0 ] || { echo "FAILED: stop nvmfd (SIGTERM); the whole log: $LOG" >&2; exit 1; }
NVMFD_PID=
echo "    ($(since "$t") s)"; summary+=("$(printf '%7s s  %s' "$(since "$t")" "stop nvmfd (SIGTERM)")")

service_install() {
  # The README's commands, as it gives them (systemctl is left out: systemd does not run here).
  local cmds
  cmds=$(sed -n '/^## Running as a service/,/^## /p' "$top/README.md" | sed -n 's/^    \(install .*\)$/\1/p' | sed 's/ *#.*$//')
  [ -n "$cmds" ] || { echo "no install commands under 'Running as a service' in README.md"; return 1; }
  while IFS= read -r c; do echo "# $c"; in_root "$c"; done <<< "$cmds"
}
step "service: the README's install commands" service_install

step "systemd-analyze verify /etc/systemd/system/nvmfd.service" in_root '
  out=$(systemd-analyze verify /etc/systemd/system/nvmfd.service 2>&1) || { echo "$out"; exit 1; }
  [ -z "$out" ] || echo "$out"
  # verify exits 0 on some warnings: any line about the unit fails.
  if grep -q nvmfd.service <<<"$out"; then exit 1; fi
  echo "no complaint about nvmfd.service"'

exec_start_pre() {
  local line cmd
  line=$(grep -m1 '^ExecStartPre=' "$ROOT/etc/systemd/system/nvmfd.service") || { echo "the installed unit has no ExecStartPre"; return 1; }
  cmd=${line#ExecStartPre=}; cmd=${cmd#[-@:+!]}
  echo "# $cmd"
  in_root "$cmd"
}
step "the unit's ExecStartPre on the installed example" exec_start_pre

step "install-deps.sh as the test command runs it (rustfmt, clippy), twice" \
  in_root "scripts/install-deps.sh && scripts/install-deps.sh && cargo fmt --version && cargo clippy --version"

echo
echo "fresh-machine-check: passed in $(since "$t_start") s"
printf '%s\n' "${summary[@]}"
