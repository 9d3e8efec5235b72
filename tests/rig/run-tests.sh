#!/usr/bin/env bash
# Real-Linux-guest tests: boots a fresh rig L1 carrying our dsec + dsec-vmm, the installed guest
# kernel and the agent image, and runs tests/rig/tests/first-light.sh inside it.
# Needs ./setup.sh --no-run first (kernel, image, release binaries).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$repo"
home=${DSEC_HOME:-/var/lib/dsec}
kernel=$home/kernel
image=$home/images/busybox/initramfs.cpio
for f in target/release/dsec target/release/dsec-vmm "$kernel/vmlinux" "$kernel/bzImage" "$image"; do
    [[ -e $f ]] || { echo "run-tests: $f is missing; run ./setup.sh --no-run first" >&2; exit 2; }
done
tiny=$(tests/rig/rig.sh guest-initramfs)
exec tests/rig/rig.sh run tests/rig/tests/first-light.sh \
    target/release/dsec target/release/dsec-vmm \
    "$kernel/vmlinux=/guest/vmlinux" "$kernel/bzImage=/guest/bzImage" \
    "$image=/guest/initramfs.cpio" "$tiny=/guest/initramfs"
