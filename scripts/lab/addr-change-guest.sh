#!/bin/bash
# Runs in the lab guest (see scripts/lab-addr-change.sh): a bond's failover moves the address
# nvmfd listens on from one RDMA device to another. Two Soft-RoCE devices sit on the two ports
# of an active-backup bond (veth pairs, fail_over_mac=active); RoCE puts the bond's address in
# the GID table of the active port's device only, so a failover moves it to the other device,
# and rdma_cm reports RDMA_CM_EVENT_ADDR_CHANGE on every ID bound there. nvmfd must listen
# again on the device that now has the address, and the kernel host, which reconnects on the
# same event, must read back what it wrote before.
set -uo pipefail
. "$(dirname "$0")/guest-lib.sh"
BIN=$1
NQN=nqn.2024-01.io.nvmfd:failover
WORK=/tmp/nvmfd-failover
ADDR=10.99.0.1
mkdir -p $WORK
fail() { echo "STEP FAILED: $*"; exit 1; }
modprobe -a bonding veth rdma_rxe nvme-rdma || fail "modprobe bonding veth rdma_rxe nvme-rdma"
ip link add fobond type bond mode active-backup fail_over_mac active miimon 100 || fail "fobond"
for p in 0 1; do
  ip link add port$p type veth peer name peer$p || fail "veth port$p"
  ip link set peer$p up
  ip link set port$p master fobond || fail "port$p into fobond"
done
ip link set fobond up
ip addr add $ADDR/24 dev fobond
ip link set port0 up; ip link set port1 up
echo port0 > /sys/class/net/fobond/bonding/active_slave
rdma link add rxe_p0 type rxe netdev port0 || fail "rxe on port0"
rdma link add rxe_p1 type rxe netdev port1 || fail "rxe on port1"
# The bond's address shows in the GID table of the active port's device alone.
gid_on() { ibv_devinfo -v -d "$1" 2>/dev/null | grep -q "::ffff:$ADDR"; }
for i in $(seq 50); do gid_on rxe_p0 && break; sleep 0.1; done
gid_on rxe_p0 || fail "the bond's address is not in rxe_p0's GID table"
gid_on rxe_p1 && echo "note: the bond's address is in rxe_p1's GID table too"
cat > $WORK/nvmfd.toml <<CFG
[daemon]
reactor_cores = [0]
admin_socket = "$WORK/nvmfd.sock"
log_format = "json"
[[listener]]
address = "$ADDR"
port = 4420
provider = "ibverbs"
[[subsystem]]
nqn = "$NQN"
allow_any_host = true
[[subsystem.namespace]]
nsid = 1
backend = "malloc"
size = "64MiB"
CFG
$BIN/nvmfd --config $WORK/nvmfd.toml 2> $WORK/nvmfd.log &
pid=$!
wait_until 100 "nvmfd's admin socket is there" test -S $WORK/nvmfd.sock
address_changes() {
  for i in $(seq 600); do
    local n
    n=$(ctl stats | tr -d ' \n' | grep -o '"address_changes_total":[0-9]*' | head -1 | grep -o '[0-9]*$')
    [ "${n:-0}" -ge 1 ] && { echo "listener: address changes $n"; return 0; }
    sleep 0.1
  done
  return 1
}
fio_verify() {
  fio --name=before --filename=/dev/nvme0n1 --rw=write --bs=64k --size=16M --verify=crc32c \
    --verify_state_save=0 --verify_only --ioengine=libaio --direct=1 --iodepth=8 \
    --output-format=terse --minimal
}
# Until the host has reconnected (after its reconnect delay) and the data reads back.
verify_after_reconnect() {
  for i in $(seq 90); do
    [ -b /dev/nvme0n1 ] && fio_verify >/dev/null 2>&1 && { echo "read back intact"; return 0; }
    sleep 1
  done
  return 1
}
step serving_is true
step nvme connect -t rdma -a $ADDR -s 4420 -n $NQN --reconnect-delay=1 --ctrl-loss-tmo=120
wait_until 50 "/dev/nvme0n1 is there" test -b /dev/nvme0n1
step fio --name=before --filename=/dev/nvme0n1 --rw=write --bs=64k --size=16M --verify=crc32c --verify_state_save=0 --do_verify=0 --ioengine=libaio --direct=1 --iodepth=8 --output-format=terse --minimal
# The failover: port1 becomes active, the bond takes its hardware address, and the address
# moves to rxe_p1's GID table.
step sh -c 'echo port1 > /sys/class/net/fobond/bonding/active_slave'
for i in $(seq 50); do gid_on rxe_p1 && break; sleep 0.1; done
gid_on rxe_p1 || echo "note: the bond's address is not in rxe_p1's GID table"
step verify_after_reconnect
step address_changes
step serving_is true
step fio --name=after --filename=/dev/nvme0n1 --rw=randwrite --bs=4k --size=8M --offset=32M --verify=crc32c --verify_state_save=0 --ioengine=libaio --direct=1 --iodepth=16 --output-format=terse --minimal
echo "--- where nvmfd's objects are now"
for r in qp cm_id; do timeout 5 rdma resource show $r 2>&1 | grep -E "nvmfd|4420" | sed "s/^/$r: /"; done
step nvme disconnect -n $NQN
stop_nvmfd $pid
echo "--- nvmfd's log of the move"
grep -E "address moved|listens again|listening|data path built" $WORK/nvmfd.log | sed 's/^/nvmfd: /'
echo "LAB ADDRESS CHANGE: ALL STEPS PASSED"
