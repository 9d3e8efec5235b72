#!/usr/bin/env bash
# Builds the default busybox sandbox image:
#   OUT_DIR/rootfs/          busybox-static + applet links, /etc basics, /init = dsec-agent
#   OUT_DIR/initramfs.cpio   newc, uncompressed (unpacks faster in an emulated guest)
# usage: mkinitramfs.sh [--agent PATH] [--install] [OUT_DIR]
#   --agent PATH  agent binary to use as /init (default: build the static release agent)
#   --install     also install to ${DSEC_HOME:-/var/lib/dsec}/images/busybox/
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
repo="$(dirname "$here")"
agent=""
install=0
out=""
while [ $# -gt 0 ]; do
    case "$1" in
        --agent) agent="$2"; shift 2 ;;
        --install) install=1; shift ;;
        -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
        -*) echo "mkinitramfs.sh: unknown option $1" >&2; exit 2 ;;
        *) out="$1"; shift ;;
    esac
done
if [ -z "$out" ]; then
    if [ "$install" = 1 ]; then out="$repo/target/images/busybox"; else
        echo "usage: mkinitramfs.sh [--agent PATH] [--install] OUT_DIR" >&2; exit 2; fi
fi

need_pkg() { # command package
    command -v "$1" >/dev/null 2>&1 && return 0
    echo "mkinitramfs.sh: installing $2" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$2" >/dev/null
}
need_pkg cpio cpio
busybox=/bin/busybox
if ! [ -x "$busybox" ] || ldd "$busybox" >/dev/null 2>&1; then
    echo "mkinitramfs.sh: installing busybox-static" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq busybox-static >/dev/null
fi
if ldd "$busybox" >/dev/null 2>&1; then
    echo "mkinitramfs.sh: $busybox is not static: install busybox-static" >&2; exit 1
fi

if [ -z "$agent" ]; then
    (cd "$repo" && RUSTFLAGS="-C target-feature=+crt-static" \
        cargo build --release --target x86_64-unknown-linux-gnu -p dsec-agent)
    agent="$repo/target/x86_64-unknown-linux-gnu/release/dsec-agent"
fi
[ -x "$agent" ] || { echo "mkinitramfs.sh: agent binary $agent not found" >&2; exit 1; }
agent="$(realpath "$agent")"
mkdir -p "$out"
out="$(realpath "$out")"

mkdir -p "$out"
stage="$(mktemp -d "$out/.rootfs.XXXXXX")"
trap 'rm -rf "$stage"' EXIT
root="$stage/rootfs"
mkdir -p "$root"
cd "$root"
mkdir -p bin sbin usr/bin usr/sbin usr/local/bin etc root tmp proc sys dev run var/tmp home
chmod 1777 tmp var/tmp
chmod 0700 root
cp "$busybox" bin/busybox
for applet in $("$busybox" --list-full); do
    [ -e "$applet" ] || ln -s /bin/busybox "$applet"
done
# Smaller initramfs unpacks faster in the guest; symbols are not needed there.
if command -v strip >/dev/null 2>&1; then strip -o init "$agent"; else cp "$agent" init; fi
chmod 0755 init
cat > etc/passwd <<'P'
root:x:0:0:root:/root:/bin/sh
nobody:x:65534:65534:nobody:/nonexistent:/bin/false
P
cat > etc/group <<'G'
root:x:0:
nogroup:x:65534:
G
echo dsec > etc/hostname
printf '127.0.0.1 localhost\n::1 localhost\n' > etc/hosts
: > etc/resolv.conf
# The kernel opens /dev/console for init before devtmpfs is mounted.
if [ "$(id -u)" = 0 ]; then
    mknod -m 600 dev/console c 5 1
    mknod -m 666 dev/null c 1 3
fi

(find . -print0 | LC_ALL=C sort -z | cpio --null -o -H newc --reproducible -R 0:0 --quiet) \
    > "$stage/initramfs.cpio"
cd "$stage"
rm -rf "$out/rootfs" "$out/initramfs.cpio"
mv rootfs "$out/rootfs"
mv initramfs.cpio "$out/initramfs.cpio"
echo "built $out/rootfs and $out/initramfs.cpio ($(du -h "$out/initramfs.cpio" | cut -f1))"

if [ "$install" = 1 ]; then
    dest="${DSEC_HOME:-/var/lib/dsec}/images/busybox"
    mkdir -p "$dest"
    tmp="$(mktemp -d "$dest/.install.XXXXXX")"
    cp -a "$out/rootfs" "$tmp/rootfs"
    cp "$out/initramfs.cpio" "$tmp/initramfs.cpio"
    rm -rf "$dest/rootfs" "$dest/initramfs.cpio"
    mv "$tmp/rootfs" "$tmp/initramfs.cpio" "$dest/"
    rmdir "$tmp"
    echo "installed to $dest"
fi
