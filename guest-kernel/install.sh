#!/usr/bin/env bash
# Build the guest kernel (or reuse the cached build) and install it as the
# default for dsec: ${DSEC_HOME:-/var/lib/dsec}/kernel/{vmlinux,bzImage,version,config}.
# Files are copied (not symlinked) so clearing the build cache never breaks dsec.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
DEST=${DSEC_HOME:-/var/lib/dsec}/kernel

dir=$("$HERE/build.sh" "$@") || { echo "guest-kernel/install.sh: error: build failed (see above)" >&2; exit 1; }
mkdir -p "$DEST" || { echo "guest-kernel/install.sh: error: cannot create $DEST (set DSEC_HOME or run as root)" >&2; exit 1; }
tmp=$(mktemp -d "$DEST/.install.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
for f in vmlinux bzImage version config; do
    cp "$dir/$f" "$tmp/$f"
done
# rename() per file: readers see the old or the new kernel, never half of one.
for f in vmlinux bzImage version config; do
    mv -f "$tmp/$f" "$DEST/$f"
done
echo "guest-kernel/install.sh: installed $(cat "$DEST/version") into $DEST" >&2
echo "$DEST"
