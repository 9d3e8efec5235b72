#!/usr/bin/env bash
# Builds (or finds in the cache) the L1 kernel of the node-network suite: the guest kernel's
# build with tests/rig/l1-net.config-fragment added, and prints its vmlinux. The guest kernel
# itself is unchanged; this one is cached under its own hash next to it.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp "$REPO/guest-kernel/build.sh" "$work/"
[[ -d $REPO/guest-kernel/patches ]] && cp -r "$REPO/guest-kernel/patches" "$work/"
cat "$REPO/guest-kernel/config-fragment" "$HERE/l1-net.config-fragment" >"$work/config-fragment"
dir=$("$work/build.sh" "$@")
echo "$dir/vmlinux"
