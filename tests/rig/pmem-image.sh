#!/usr/bin/env bash
# Builds the rig pmem suite's inputs in DIR: pmem.img, a 32 MiB ext4 image (4 KiB blocks, so
# the guest can mount it with -o dax) made with mkfs.ext4 -d from hello.txt and a 16 MiB
# blob.bin, and pmem.expect, the shell assignments tests/pmem.sh checks against.
set -euo pipefail
dir=${1:?usage: pmem-image.sh DIR}
command -v mkfs.ext4 >/dev/null || { echo "pmem-image: mkfs.ext4 missing (apt-get install e2fsprogs)" >&2; exit 1; }
mkdir -p "$dir/root"
hello="hello from a host-built ext4 image"
printf '%s\n' "$hello" >"$dir/root/hello.txt"
# Deterministic content (a new random blob would make a new cached L1 image every run).
# Exactly 16 MiB of data, no holes: every page of it is on the pmem device.
seq 1 2240000 >"$dir/seq"
head -c 16777216 "$dir/seq" >"$dir/root/blob.bin"
rm "$dir/seq"
mkfs.ext4 -q -F -b 4096 -d "$dir/root" "$dir/pmem.img" 32M >/dev/null
{
    echo "hello='$hello'"
    echo "blob_md5=$(md5sum <"$dir/root/blob.bin" | cut -d' ' -f1)"
    echo "blob_kib=16384"
} >"$dir/pmem.expect"
rm -rf "$dir/root"
