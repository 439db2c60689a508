#!/usr/bin/env bash
# A bond's failover on real verbs, in the VM lab (../shared/lab): the address nvmfd listens on
# moves from one Soft-RoCE device to another (RDMA_CM_EVENT_ADDR_CHANGE); nvmfd must listen
# again where the address is now and serve the Linux kernel host the data written before.
# Fails when any step fails.
set -euo pipefail
exec "$(dirname "$0")/lab/run-guest-script.sh" lab-addr-change addr-change-guest.sh \
  "LAB ADDRESS CHANGE: ALL STEPS PASSED" \
  "the listener's address moved to another device; nvmfd listened again there and served the data written before"
