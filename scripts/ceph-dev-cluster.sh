#!/usr/bin/env bash
# A throwaway Ceph cluster on 127.0.0.1 from Debian 12's own packages, for the tests of the RBD
# backend (nvmfd opens its images with librbd): one monitor, three OSDs on memstore (their data
# lives in memory), no manager (RBD needs none), cephx, and one replicated pool (size 3,
# min_size 2) initialised for RBD. Every daemon runs as root, daemonised, with its pid file, log
# and admin socket in the state directory; no systemd, nothing of the cluster outside that
# directory. Run as root.
#
#   scripts/ceph-dev-cluster.sh start        installs ceph-mon, ceph-osd, ceph-common and
#       librbd-dev if missing, creates the cluster, waits until every PG is active+clean (about 4 s)
#       and prints the time it took, then on its last line the ceph.conf to use, which names the
#       admin keyring: rbd -c CONF ls works. Already running: prints the ceph.conf and exits 0;
#       some daemons down: starts them again; all of them down: a new cluster
#   scripts/ceph-dev-cluster.sh stop         kills every daemon of the cluster, waits for them to
#       exit, removes the state directory
#   scripts/ceph-dev-cluster.sh status       whether it runs, its daemons, ceph -s, the pool and
#       the states of its PGs; exits 1 if it does not run
#   scripts/ceph-dev-cluster.sh osd-kill N   kill -9 of OSD N (0, 1 or 2): the monitor marks it
#       down within a second, I/O goes on with the two others (min_size 2)
#   scripts/ceph-dev-cluster.sh osd-start N  starts OSD N again and waits until every PG is
#       active+clean (it comes back empty, memstore, and is backfilled from the others)
#   scripts/ceph-dev-cluster.sh mon-stop     stops the monitor: clients cannot connect (rbd
#       --client-mount-timeout 3, ceph --connect-timeout 3 fail), connected ones go on with the
#       OSDs until they need the monitor
#   scripts/ceph-dev-cluster.sh mon-start    starts it again and waits until it answers
#
# Knobs: NVMFD_CEPH_DIR (state directory, default /tmp/nvmfd-ceph), NVMFD_CEPH_PORT (the
# monitor's msgr2 port, its msgr1 port is the next one; default 3300 and 6789, or if either is
# taken the first free pair from 3302/3303 on), NVMFD_CEPH_POOL (default rbd), NVMFD_CEPH_OSD_MB
# (the memstore size of each OSD, default 512: every OSD holds a copy of all the data),
# NVMFD_CEPH_TIMEOUT (seconds to wait for active+clean, default 60). Commands on state
# directories of one parent directory run one at a time (flock on that parent).
# Without a manager the monitor knows no PG states (ceph -s shows no pools, ceph pg stat hangs):
# the PG states come from the OSDs' admin sockets.
set -euo pipefail
DIR=${NVMFD_CEPH_DIR:-/tmp/nvmfd-ceph}
POOL=${NVMFD_CEPH_POOL:-rbd}
OSD_MB=${NVMFD_CEPH_OSD_MB:-512}
TIMEOUT=${NVMFD_CEPH_TIMEOUT:-60}
OSDS=(0 1 2)
PG_NUM=32
say() { echo "ceph-dev-cluster: $*"; }
die() { echo "ceph-dev-cluster: $*" >&2; exit 1; }
usage() { sed -n '2,/^set -e/{/^set -e/d;s/^# \{0,1\}//;p}' "$0"; }

[[ $OSD_MB =~ ^[1-9][0-9]*$ && $TIMEOUT =~ ^[1-9][0-9]*$ ]] \
  || die "NVMFD_CEPH_OSD_MB and NVMFD_CEPH_TIMEOUT must be positive integers"
[[ $POOL =~ ^[A-Za-z0-9_.-]+$ ]] || die "NVMFD_CEPH_POOL '$POOL': letters, digits, _ . - only"
[[ $DIR = /* ]] || DIR=$PWD/$DIR
[[ $DIR =~ ^/[A-Za-z0-9_./+-]+$ ]] || die "NVMFD_CEPH_DIR '$DIR': no spaces or odd characters"
DIR=${DIR%/}
CONF=$DIR/ceph.conf
ADMIN_KEYRING=$DIR/ceph.client.admin.keyring
RUN=$DIR/run

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN {printf "%.1f", b - a}'; }

# ---- daemons and their pid files ----
pidfile() { echo "$RUN/$1.pid"; }   # pidfile mon.a | osd.N
# The pid of a daemon of this cluster (its command line names this ceph.conf), or nothing.
daemon_pid() {
  local f pid
  f=$(pidfile "$1")
  [ -s "$f" ] || return 0
  pid=$(cat "$f")
  [[ $pid =~ ^[0-9]+$ ]] || return 0
  if { tr '\0' ' ' <"/proc/$pid/cmdline"; } 2>/dev/null | grep -qF -- "-c $CONF "; then echo "$pid"; fi
}
running() { [ -n "$(daemon_pid "$1")" ]; }
# Every ceph-mon or ceph-osd process started with this ceph.conf, pid files or not.
dir_pids() {
  ps -eo pid=,args= | awk -v c="$CONF" '$2 ~ /ceph-(mon|osd)$/ {
    for (i = 3; i < NF; i++) if ($i == "-c" && $(i + 1) == c) {print $1; next}
  }'
}
# Whether a process lives: a zombie does not (init here may reap it only seconds later).
alive() {
  local st
  st=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  st=${st##*) }
  [ "${st%% *}" != Z ]
}
# Waits (polling) until none of the given pids is alive; false after $2 seconds.
wait_gone() {   # wait_gone "PIDS" SECONDS
  local pids=$1 deadline p alive
  deadline=$(( $(date +%s) + $2 ))
  while :; do
    alive=
    for p in $pids; do alive "$p" && alive=1; done
    [ -z "$alive" ] && return 0
    [ "$(date +%s)" -lt "$deadline" ] || return 1
    sleep 0.05
  done
}
reaped() {   # reaped "PIDS" SECONDS: polls until no pid is left in /proc, zombie or not
  local deadline p left
  deadline=$(( $(date +%s) + $2 ))
  while :; do
    left=
    for p in $1; do [ ! -e "/proc/$p" ] || left=1; done
    [ -z "$left" ] && return 0
    [ "$(date +%s)" -lt "$deadline" ] || return 1
    sleep 0.05
  done
}
stop_daemon() {   # stop_daemon NAME SIGNAL
  local pid
  pid=$(daemon_pid "$1")
  [ -n "$pid" ] || return 0
  kill "-$2" "$pid" 2>/dev/null || true
  wait_gone "$pid" 30 || { kill -KILL "$pid" 2>/dev/null || true; wait_gone "$pid" 5; } \
    || die "$1 (pid $pid) does not exit"
  rm -f "$(pidfile "$1")"
}
# A daemon forks once initialised; what it prints before goes to log/NAME.out, and it inherits no
# descriptor but those three: not the caller's stdout and stderr (a test reading them to their
# end), not this script's lock (fd 9), not a lock its caller holds (`flock FILE cmd`).
start_daemon() {   # start_daemon NAME COMMAND...
  local name=$1
  shift
  (
    for fd in /proc/$BASHPID/fd/*; do
      fd=${fd##*/}
      [ "$fd" -gt 2 ] && eval "exec $fd>&-"
    done
    exec "$@"
  ) >"$DIR/log/$name.out" 2>&1 \
    || { tail -5 "$DIR/log/$name.out" >&2; die "$name did not start: see $DIR/log/$name.log"; }
}
start_mon() { start_daemon mon.a ceph-mon -i a -c "$CONF"; }
start_osd() { start_daemon "osd.$1" ceph-osd -i "$1" -c "$CONF"; }
# Starts the given OSDs at once and waits for them to have forked.
start_osds() {
  local n pids=()
  for n in "$@"; do start_osd "$n" & pids+=($!); done
  for n in "${pids[@]}"; do wait "$n" || exit 1; done
}

# ---- the ceph commands, as client.admin ----
cephc() { ceph -c "$CONF" --connect-timeout 10 "$@"; }

# The PGs of every pool, and their states. Without a manager the monitor knows no PG states (ceph
# pg stat, ceph -s show none), so they come from the OSDs: each running OSD's admin socket lists
# its PGs (dump_pgstate_history), and the primary of each tells its state (pg PGID query).
pg_total() { cephc osd dump -f json | grep -o '"pg_num":[0-9]*' | awk -F: '{s += $2} END {print s + 0}'; }
pg_states() {   # prints "CLEAN STATE:COUNT,...": how many PGs are active+clean, and every state
  local n socks=()
  for n in "${OSDS[@]}"; do running "osd.$n" && socks+=("$RUN/osd.$n.asok"); done
  /usr/bin/python3 - "${socks[@]}" <<'PY'
import collections, json, socket, struct, sys
def asok(path, cmd):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(path)
        s.sendall(json.dumps(dict(cmd, format="json")).encode() + b"\0")
        def recv(n):
            b = b""
            while len(b) < n:
                c = s.recv(n - len(b))
                if not c:
                    raise EOFError
                b += c
            return b
        return json.loads(recv(struct.unpack(">I", recv(4))[0]))
state = {}
for path in sys.argv[1:]:
    try:
        for pg in asok(path, {"prefix": "dump_pgstate_history"})["pgs"]:
            if pg["currently"].startswith("Started/Primary"):
                state[pg["pg"]] = asok(path, {"prefix": "pg", "pgid": pg["pg"], "cmd": "query"})["state"]
    except (OSError, EOFError, ValueError, KeyError, TypeError):
        pass  # an OSD starting or stopping: its PGs count as not clean
count = collections.Counter(state.values())
print(count["active+clean"], ",".join(f"{k}:{v}" for k, v in sorted(count.items())) or "-")
PY
}
osd_counts() {   # "up in"
  cephc osd stat -f json | tr -d '\n' | sed -E 's/.*"num_up_osds":([0-9]+).*"num_in_osds":([0-9]+).*/\1 \2/'
}
osd_up() { cephc osd dump | grep -q "^osd\.$1 up "; }
# Polls a command until it succeeds; dies after TIMEOUT seconds.
wait_for() {   # wait_for WHAT COMMAND...
  local what=$1 deadline
  shift
  deadline=$(( $(date +%s) + TIMEOUT ))
  until "$@" >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$deadline" ] || die "still waiting for $what after ${TIMEOUT}s"
    sleep 0.2
  done
}
# Waits until every OSD is up and in and every PG active+clean; false after TIMEOUT seconds.
wait_clean() {
  local deadline total clean states ui
  deadline=$(( $(date +%s) + TIMEOUT ))
  while :; do
    ui=$(osd_counts 2>/dev/null || true)
    total=$(pg_total 2>/dev/null || echo 0)
    read -r clean states < <(pg_states) || true
    clean=${clean:-0}
    if [ "$ui" = "${#OSDS[@]} ${#OSDS[@]}" ] && [ "$total" -gt 0 ] && [ "$clean" -eq "$total" ]; then
      return 0
    fi
    if [ "$(date +%s)" -ge "$deadline" ]; then
      say "after ${TIMEOUT}s: OSDs up/in ${ui:-?}, PGs active+clean $clean of $total ($states)" >&2
      return 1
    fi
    sleep 0.2
  done
}

# ---- start ----
install_pkgs() {
  local groups=(
    "ceph-mon|the monitor"
    "ceph-osd|the OSDs (memstore)"
    "ceph-common|the ceph, rbd and ceph-authtool commands"
    "librbd-dev|librbd's headers and library, which nvmfd's RBD backend links"
  )
  local g log todo=() names=()
  for g in "${groups[@]}"; do
    dpkg-query -W -f='${Status}' "${g%%|*}" 2>/dev/null | grep -q "install ok installed" || todo+=("$g")
  done
  [ ${#todo[@]} -gt 0 ] || return 0
  [ "$(id -u)" -eq 0 ] || die "not root: the packages $(printf '%s ' "${todo[@]%%|*}")are missing"
  export DEBIAN_FRONTEND=noninteractive
  for g in "${todo[@]}"; do names+=("${g%%|*}"); done
  log=$(mktemp)
  { apt-get -o DPkg::Lock::Timeout=600 update -qq \
      && apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${names[@]}"
  } >"$log" 2>&1 || { tail -20 "$log" >&2; rm -f "$log"; die "apt-get install ${names[*]} failed"; }
  rm -f "$log"
  for g in "${todo[@]}"; do say "installed ${g%%|*}: ${g#*|}"; done
}

port_busy() { [ -n "$(ss -Hltn "( sport = :$1 )")" ]; }
pick_ports() {   # sets V2 and V1
  local p
  if [ -n "${NVMFD_CEPH_PORT:-}" ]; then
    if ! [[ $NVMFD_CEPH_PORT =~ ^[1-9][0-9]*$ ]] || [ "$NVMFD_CEPH_PORT" -ge 65535 ]; then
      die "NVMFD_CEPH_PORT '$NVMFD_CEPH_PORT' is not a port"
    fi
    V2=$NVMFD_CEPH_PORT; V1=$((V2 + 1))
    if port_busy "$V2" || port_busy "$V1"; then die "port $V2 or $V1 (NVMFD_CEPH_PORT) is in use"; fi
    return 0
  fi
  V2=3300; V1=6789
  ! port_busy "$V2" && ! port_busy "$V1" && return 0
  for ((p = 3302; p < 3400; p += 2)); do
    V2=$p; V1=$((p + 1))
    ! port_busy "$V2" && ! port_busy "$V1" && return 0
  done
  die "no free port pair for the monitor in 3300-3399"
}

write_conf() {
  local fsid=$1
  cat >"$CONF" <<EOF
# A throwaway cluster of scripts/ceph-dev-cluster.sh: one monitor, ${#OSDS[@]} memstore OSDs.
[global]
fsid = $fsid
mon_host = [v2:127.0.0.1:$V2,v1:127.0.0.1:$V1]
mon_initial_members = a
auth_cluster_required = cephx
auth_service_required = cephx
auth_client_required = cephx
auth_allow_insecure_global_id_reclaim = false
run_dir = $RUN
# One host: the default CRUSH rule picks OSDs, not hosts (before the monitor's mkfs).
osd_crush_chooseleaf_type = 0
osd_pool_default_size = 3
osd_pool_default_min_size = 2
osd_pool_default_pg_autoscale_mode = off
mon_allow_pool_delete = true
# A killed OSD is marked down within a second (its peers see the connection refused, or miss
# its heartbeats), and out after 10 s.
osd_heartbeat_interval = 1
osd_heartbeat_grace = 3
mon_osd_adjust_heartbeat_grace = false
mon_osd_min_down_reporters = 1
osd_fast_fail_on_connection_refused = true
mon_osd_down_out_interval = 10
mon_data_avail_warn = 2
mon_data_avail_crit = 1
# No manager: no MGR_DOWN health error 2 minutes after the mkfs (10 years: more overflows).
mon_mgr_mkfs_grace = 315360000

[mon]
# A map change is proposed at once, not after 1 s: every step of the start is one.
paxos_propose_interval = 0.05
mon_data = $DIR/mon/ceph-\$id
public_addr = 127.0.0.1
pid_file = $RUN/\$name.pid
admin_socket = $RUN/\$name.asok
log_file = $DIR/log/\$name.log

[osd]
osd_data = $DIR/osd/ceph-\$id
osd_objectstore = memstore
memstore_device_bytes = $((OSD_MB * 1024 * 1024))
public_addr = 127.0.0.1
cluster_addr = 127.0.0.1
osd_op_num_shards = 2
osd_op_num_threads_per_shard = 1
# A restarted OSD comes back empty (memstore): its PGs are backfilled all at once, not one by one.
osd_max_backfills = 32
osd_recovery_max_active = 16
# Memstore says it is rotational: without the _hdd (and the others') 0, each recovery
# operation waits 0.1 s and an OSD's refill takes minutes once the tests have written some.
osd_recovery_sleep = 0
osd_recovery_sleep_hdd = 0
osd_recovery_sleep_ssd = 0
osd_recovery_sleep_hybrid = 0
pid_file = $RUN/\$name.pid
admin_socket = $RUN/\$name.asok
log_file = $DIR/log/\$name.log

[client]
keyring = $ADMIN_KEYRING
# Tests stop OSDs: an operation nothing can answer fails in 8 s (nvmfd's own default is 10 s).
rados_osd_op_timeout = 8
EOF
}

authtool() { ceph-authtool "$@" >/dev/null; }
quiet() {   # runs a command, showing its output only if it fails
  local out
  out=$("$@" 2>&1) || { echo "$out" >&2; die "failed: $*"; }
}
create() {
  local t0=$1 fsid n uuid pids=()
  pick_ports
  mkdir -p "$RUN" "$DIR/log" "$DIR/mon/ceph-a"
  fsid=$(cat /proc/sys/kernel/random/uuid)
  write_conf "$fsid"
  # Keys: client.admin, mon., one per OSD; the monitor's mkfs takes them all into its database.
  authtool --create-keyring "$ADMIN_KEYRING" --gen-key -n client.admin \
    --cap mon 'allow *' --cap osd 'allow *' --cap mgr 'allow *' --cap mds 'allow *'
  authtool --create-keyring "$DIR/mon.keyring" --gen-key -n mon. --cap mon 'allow *'
  authtool "$DIR/mon.keyring" --import-keyring "$ADMIN_KEYRING"
  for n in "${OSDS[@]}"; do
    mkdir -p "$DIR/osd/ceph-$n"
    authtool --create-keyring "$DIR/osd/ceph-$n/keyring" --gen-key -n "osd.$n" \
      --cap mon 'allow profile osd' --cap mgr 'allow profile osd' --cap osd 'allow *'
    authtool "$DIR/mon.keyring" --import-keyring "$DIR/osd/ceph-$n/keyring"
  done
  monmaptool --create --fsid "$fsid" --addv a "[v2:127.0.0.1:$V2,v1:127.0.0.1:$V1]" "$DIR/monmap" >/dev/null
  ceph-mon --mkfs -i a -c "$CONF" --monmap "$DIR/monmap" --keyring "$DIR/mon.keyring"
  start_mon
  # The OSDs' stores, while the monitor starts.
  for n in "${OSDS[@]}"; do
    uuid=$(cat /proc/sys/kernel/random/uuid)
    echo "$uuid" >"$DIR/osd/ceph-$n/uuid"
    ceph-osd -i "$n" -c "$CONF" --no-mon-config --mkfs --osd-uuid "$uuid" >"$DIR/log/osd.$n.mkfs" 2>&1 &
    pids+=($!)
  done
  for n in "${pids[@]}"; do wait "$n" || die "ceph-osd --mkfs failed: see $DIR/log"; done
  for n in "${OSDS[@]}"; do
    quiet cephc osd new "$(cat "$DIR/osd/ceph-$n/uuid")" "$n"
  done
  # The pool before the OSDs boot: its PGs are created and peered once.
  quiet cephc osd pool create "$POOL" "$PG_NUM" "$PG_NUM" replicated --size 3
  quiet cephc osd pool set "$POOL" min_size 2
  start_osds "${OSDS[@]}"
  wait_clean || die "the cluster did not become active+clean: see $DIR/log"
  rbd -c "$CONF" pool init "$POOL"
  touch "$DIR/ready"
  say "up in $(since "$t0")s: Ceph $(ceph-mon --version | awk '{print $3}'), 1 monitor (127.0.0.1:$V2 v2, :$V1 v1), ${#OSDS[@]} memstore OSDs of ${OSD_MB} MiB, pool $POOL (size 3, min_size 2, rbd), all $PG_NUM PGs active+clean, $(cephc health)"
  echo "$CONF"
}

start() {
  local t0 n osds_up=0 missing=()
  t0=$(now)
  install_pkgs
  if [ -e "$DIR/ready" ]; then
    for n in mon.a "${OSDS[@]/#/osd.}"; do
      if running "$n"; then [ "$n" = mon.a ] || osds_up=$((osds_up + 1)); else missing+=("$n"); fi
    done
    if [ ${#missing[@]} -eq 0 ]; then
      say "already running"
      echo "$CONF"; return 0
    fi
    # An OSD still up holds the data (memstore keeps it in memory only): start the others.
    if [ "$osds_up" -gt 0 ]; then
      say "starting ${missing[*]}"
      if [ "${missing[0]}" = mon.a ]; then start_mon; missing=("${missing[@]:1}"); fi
      [ ${#missing[@]} -eq 0 ] || start_osds "${missing[@]#osd.}"
      wait_clean || die "the cluster did not become active+clean: see $DIR/log"
      say "running again in $(since "$t0")s"
      echo "$CONF"; return 0
    fi
  fi
  # Nothing of it runs, or it was never complete: anew.
  if [ -e "$DIR" ]; then
    say "removing the leftovers of an earlier cluster in $DIR"
    teardown
  fi
  create "$t0"
}

# ---- stop ----
teardown() {
  local pids
  pids=$(dir_pids)
  if [ -n "$pids" ]; then
    # shellcheck disable=SC2086 # a list of pids
    kill -KILL $pids 2>/dev/null || true
    wait_gone "$pids" 30 || die "daemons of $DIR still alive: $pids"
    # Dead, they may stay zombies until init reaps them: give it a few seconds, no more.
    reaped "$pids" 5 || true
  fi
  rm -rf "$DIR"
}
stop() {
  local pids
  pids=$(dir_pids | tr '\n' ' ')
  [ -e "$DIR" ] || [ -n "$pids" ] || { say "not running (no $DIR)"; return 0; }
  teardown
  [ -z "$(dir_pids)" ] || die "daemons of $DIR still alive"
  say "stopped${pids:+ (killed ${pids% })}, $DIR removed"
}

status() {
  local n clean states down=()
  if [ ! -e "$DIR/ready" ]; then say "not running (no cluster in $DIR)"; return 1; fi
  for n in mon.a "${OSDS[@]/#/osd.}"; do running "$n" || down+=("$n"); done
  if [ ${#down[@]} -eq $(( ${#OSDS[@]} + 1 )) ]; then say "not running (cluster in $DIR, every daemon down)"; return 1; fi
  say "running${down[*]:+, not running: ${down[*]}}; conf $CONF"
  for n in mon.a "${OSDS[@]/#/osd.}"; do
    ! running "$n" || say "  $n pid $(daemon_pid "$n"), log $DIR/log/$n.log"
  done
  running mon.a || return 0
  cephc -s || true
  cephc osd pool ls detail | awk 'NF {print "ceph-dev-cluster: " $0}'
  read -r clean states < <(pg_states) || true
  clean=${clean:-0}
  say "PGs (from the OSDs: without a manager ceph -s counts none): $clean active+clean of $(pg_total): $states"
}

need_cluster() { [ -e "$DIR/ready" ] || die "no cluster in $DIR: run start first"; }
osd_arg() {
  local n
  for n in "${OSDS[@]}"; do [ "${1:-}" = "$n" ] && return 0; done
  die "which OSD? one of ${OSDS[*]}"
}

# One command at a time changes the clusters of a directory: concurrent starts (parallel tests)
# neither build one cluster twice nor pick the same free port. The lock is on the parent of the
# state directory, which is left behind anyway.
lock() {
  local parent=${DIR%/*}
  parent=${parent:-/}
  mkdir -p "$parent"
  exec 9<"$parent"
  flock -w 300 9 || die "another ceph-dev-cluster command on $parent has run for 5 minutes"
}

cmd=${1:-}
case "$cmd" in
  start|stop|osd-kill|osd-start|mon-stop|mon-start) lock ;;
esac
case "$cmd" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  osd-kill)
    need_cluster; osd_arg "${2:-}"
    running "osd.$2" || die "osd.$2 is not running"
    stop_daemon "osd.$2" KILL
    say "osd.$2 killed (kill -9)" ;;
  osd-start)
    need_cluster; osd_arg "${2:-}"
    if running "osd.$2"; then say "osd.$2 already running"; exit 0; fi
    t0=$(now)
    start_osd "$2"
    if ! running mon.a; then say "osd.$2 started (the monitor is stopped: it boots once it runs)"; exit 0; fi
    all=1
    for n in "${OSDS[@]}"; do running "osd.$n" || all=; done
    if [ -n "$all" ]; then
      wait_clean || die "osd.$2 started, but the cluster did not become active+clean"
      say "osd.$2 started, all PGs active+clean again in $(since "$t0")s"
    else
      wait_for "osd.$2 up" osd_up "$2"
      say "osd.$2 started and up in $(since "$t0")s (other OSDs are down)"
    fi ;;
  mon-stop)
    need_cluster
    stop_daemon mon.a TERM
    say "monitor stopped" ;;
  mon-start)
    need_cluster
    if running mon.a; then say "monitor already running"; exit 0; fi
    t0=$(now)
    start_mon
    wait_for "the monitor to answer" cephc health
    say "monitor started, answering in $(since "$t0")s" ;;
  -h|--help|help) usage ;;
  *) usage >&2; exit 2 ;;
esac
