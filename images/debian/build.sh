#!/usr/bin/env bash
# Builds the Debian sandbox image: `debootstrap --variant=minbase bookworm` plus the packages
# listed in ./packages (docs, man pages and translations dropped), then a read-only,
# lz4-compressed erofs image of the same tree for microVMs.
#
# Outputs are cached outside the repo in
#   ${DSEC_CACHE:-/var/cache/dsec}/images/debian/<hash>/{rootfs/,rootfs.img,manifest}
# where <hash> covers this script, the package list, the suite and the mirror: a hit costs
# nothing, any input change rebuilds from scratch (--force rebuilds anyway). The entry is
# built in a temporary directory and renamed into place, so a half-built one never counts.
#
# --install copies it to ${DSEC_HOME:-/var/lib/dsec}/images/debian/: rootfs/ (container
# backend), rootfs.img (microVM root disk, attached read-only) and initramfs.cpio, a link
# to the busybox image's initramfs (the agent boots from it, then switches into the disk).
#
# --name NAME builds images/NAME/packages into images/NAME instead (images/fncall/build.sh).
#
# Usage: build.sh [--name NAME] [--install] [--print-dir] [--force]
set -euo pipefail

IMAGES=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
NAME=debian
SUITE=bookworm
MIRROR=${DSEC_DEBIAN_MIRROR:-http://deb.debian.org/debian}
INSTALL=0
PRINT_DIR=0
FORCE=0

die() { echo "images/debian/build.sh: error: $*" >&2; exit 1; }
log() { echo "images/debian/build.sh: $*" >&2; }

while [[ $# -gt 0 ]]; do
    case $1 in
        --install) INSTALL=1 ;;
        --print-dir) PRINT_DIR=1 ;;
        --force) FORCE=1 ;;
        --name) NAME=${2:?--name needs a value}; shift ;;
        -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
        *) die "unknown argument '$1' (try --help)" ;;
    esac
    shift
done

[[ $NAME =~ ^[a-z0-9-]+$ && -f $IMAGES/$NAME/packages ]] || die "no image '$NAME' (no $IMAGES/$NAME/packages)"
HERE=$IMAGES/$NAME
CACHE_ROOT=${DSEC_CACHE:-/var/cache/dsec}/images/$NAME
DEST=${DSEC_HOME:-/var/lib/dsec}/images/$NAME
mapfile -t PKGS < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$HERE/packages" | grep -v '^$')
[[ ${#PKGS[@]} -gt 0 ]] || die "$HERE/packages lists no package"
HASH=$( {
    echo "suite $SUITE mirror $MIRROR"
    echo "--- packages"; printf '%s\n' "${PKGS[@]}"
    echo "--- build.sh"; cat "$IMAGES/debian/build.sh"
} | sha256sum | cut -c1-16)
OUT=$CACHE_ROOT/$HASH

if [[ $PRINT_DIR == 1 ]]; then echo "$OUT"; exit 0; fi

complete() { [[ -f $1/manifest && -f $1/rootfs.img && -d $1/rootfs/usr/bin ]]; }

install_image() {
    local src=$1
    [[ -f ${DSEC_HOME:-/var/lib/dsec}/images/busybox/initramfs.cpio ]] \
        || log "warning: images/busybox/initramfs.cpio missing: microVMs need it (guest-agent/mkinitramfs.sh --install)"
    mkdir -p "$DEST" || die "cannot create $DEST (set DSEC_HOME or run as root)"
    local tmp
    tmp=$(mktemp -d "$DEST/.install.XXXXXX")
    # shellcheck disable=SC2064
    trap "rm -rf '$tmp'" EXIT
    cp -a "$src/rootfs" "$tmp/rootfs"
    cp "$src/rootfs.img" "$src/manifest" "$tmp/"
    # A link, not a copy: a rebuilt agent (busybox initramfs) is picked up at once.
    ln -s ../busybox/initramfs.cpio "$tmp/initramfs.cpio"
    # Each part is replaced by two renames (old aside, new in): a reader may miss a part
    # for an instant but never sees half of one; running VMs keep the old disk open.
    local old
    old=$(mktemp -d "$DEST/.old.XXXXXX")
    local f
    for f in rootfs rootfs.img manifest initramfs.cpio; do
        if [[ -e $DEST/$f || -L $DEST/$f ]]; then mv "$DEST/$f" "$old/"; fi
        mv "$tmp/$f" "$DEST/$f"
    done
    # Whatever an older layout left (not hidden entries: other installs in progress).
    for f in "$DEST"/*; do
        case ${f##*/} in rootfs|rootfs.img|manifest|initramfs.cpio) ;; *) mv "$f" "$old/" ;; esac
    done
    rm -rf "$old" "$tmp"
    trap - EXIT
    log "installed $(basename "$src") into $DEST"
    echo "$DEST"
}

if [[ $FORCE == 0 ]] && complete "$OUT"; then
    log "cache hit: $OUT"
    if [[ $INSTALL == 1 ]]; then install_image "$OUT"; else echo "$OUT"; fi
    exit 0
fi

[[ $(id -u) == 0 ]] || die "debootstrap needs root"
for tool in debootstrap mkfs.erofs flock sha256sum; do
    command -v "$tool" >/dev/null || die "'$tool' missing: run setup.sh (or apt-get install debootstrap erofs-utils)"
done

mkdir -p "$CACHE_ROOT"
# One builder per hash: a concurrent caller waits, then finds the cache hit.
exec 9>"$CACHE_ROOT/.lock-$HASH"
if ! flock -n 9; then
    log "another build of $HASH is running; waiting for it"
    flock 9
fi
if [[ $FORCE == 1 ]] || ! complete "$OUT"; then
    WORK=$(mktemp -d "$CACHE_ROOT/.build-$HASH.XXXXXX")
    trap 'rm -rf "$WORK"' EXIT
    trap 'exit 130' INT TERM HUP
    STAGE=$WORK/out
    ROOT=$STAGE/rootfs
    mkdir -p "$STAGE"
    START=$(date +%s)
    log "cache miss: debootstrap $SUITE (minbase + ${PKGS[*]}) from $MIRROR into $OUT"
    include=$(IFS=,; echo "${PKGS[*]}")
    if ! debootstrap --variant=minbase --include="$include" "$SUITE" "$ROOT" "$MIRROR" \
        >"$WORK/debootstrap.log" 2>&1; then
        tail -30 "$WORK/debootstrap.log" >&2
        [[ -f $ROOT/debootstrap/debootstrap.log ]] && tail -30 "$ROOT/debootstrap/debootstrap.log" >&2
        die "debootstrap failed (log above); is $MIRROR reachable?"
    fi
    # A small image: no apt caches, lists or logs; no docs (copyright files stay), man pages
    # or translations, now or from later installs in a sandbox (as Debian's slim images do).
    chroot "$ROOT" apt-get clean
    rm -rf "$ROOT"/var/lib/apt/lists/* "$ROOT"/var/cache/apt/*.bin "$ROOT"/var/log/*.log \
        "$ROOT"/var/log/apt/* "$ROOT"/var/cache/debconf/*-old "$ROOT"/var/lib/dpkg/*-old \
        "$ROOT"/tmp/* "$ROOT"/var/tmp/* "$ROOT"/usr/share/man/* "$ROOT"/usr/share/info/* \
        "$ROOT"/usr/share/locale/* "$ROOT"/usr/share/gitweb
    find "$ROOT/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
    cat >"$ROOT/etc/dpkg/dpkg.cfg.d/dsec-slim" <<'CFG'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
CFG
    # Sandbox identity: set per sandbox, not baked in.
    : >"$ROOT/etc/machine-id"
    echo dsec >"$ROOT/etc/hostname"
    printf '127.0.0.1 localhost\n::1 localhost\n' >"$ROOT/etc/hosts"
    rm -f "$ROOT/etc/resolv.conf"
    : >"$ROOT/etc/resolv.conf"
    for bin in bash python3; do
        [[ -x $ROOT/usr/bin/$bin ]] || die "$bin missing from the debootstrapped tree"
    done
    # FnCall workers mount each call's working directory here (the root stays read-only).
    mkdir -p "$ROOT/work"
    chroot "$ROOT" dpkg-query -W -f='${Package} ${Version}\n' >"$STAGE/manifest"

    # The microVM root disk: erofs is read-only by design, sized to its content and lz4
    # keeps it about half the tree (the guest kernel has EROFS_FS_ZIP). Real mtimes: Python
    # checks them against its .pyc files.
    mkfs.erofs --quiet -zlz4hc --preserve-mtime -U 00000000-0000-4000-8000-00000000dec0 \
        "$STAGE/rootfs.img" "$ROOT" >"$WORK/mkfs.log" 2>&1 \
        || { tail -20 "$WORK/mkfs.log" >&2; die "mkfs.erofs failed for $ROOT"; }
    rm -rf "$OUT"
    mv "$STAGE" "$OUT"
    rm -rf "$WORK"
    trap - EXIT
    # Entries of other inputs are dead weight (hundreds of MiB each): drop those unused for a
    # day, and build leftovers of runs that were killed.
    find "$CACHE_ROOT" -mindepth 1 -maxdepth 1 -type d -not -name "$HASH" -not -name '.build-*' \
        -mtime +0 -exec rm -rf {} + 2>/dev/null || true
    find "$CACHE_ROOT" -mindepth 1 -maxdepth 1 -type d -name '.build-*' -mmin +120 \
        -exec rm -rf {} + 2>/dev/null || true
    log "built in $(( $(date +%s) - START ))s: $OUT ($(wc -l <"$OUT/manifest") packages, rootfs $(du -sh "$OUT/rootfs" | cut -f1), rootfs.img $(du -h "$OUT/rootfs.img" | cut -f1))"
fi
if [[ $INSTALL == 1 ]]; then install_image "$OUT"; else echo "$OUT"; fi
