#!/usr/bin/env bash
# Device removal on real verbs, in the VM lab (../shared/lab): rxe0 is deleted under nvmfd while
# the Linux kernel host has written to it, and added back; nvmfd must release the device, report
# its listener down, listen again when the device returns and serve the data written before.
# Fails when any step fails.
set -euo pipefail
exec "$(dirname "$0")/lab/run-guest-script.sh" lab-device-removal device-removal-guest.sh \
  "LAB DEVICE REMOVAL: ALL STEPS PASSED" \
  "rxe0 went and came back; nvmfd let go of it, listened again and served the data written before"
