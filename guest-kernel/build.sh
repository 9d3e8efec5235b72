#!/usr/bin/env bash
# Reproducible build of the DSec guest kernel (also the tests/rig L1 kernel)
# from Debian's linux-source-6.1: tinyconfig + config-fragment (+ patches/*.patch).
#
# Outputs are cached outside the repo in
#   ${DSEC_CACHE:-/var/cache/dsec}/kernel/<hash>/{vmlinux,bzImage,version,config}
# where <hash> covers the source package version, the fragment, the patches and
# this script, so a hit costs nothing and any input change rebuilds from scratch.
#
# Usage: build.sh [--print-dir] [--force] [-j N]
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SRC_TARBALL=${DSEC_KERNEL_TARBALL:-/usr/src/linux-source-6.1.tar.xz}
SRC_PKG=linux-source-6.1
CACHE_ROOT=${DSEC_CACHE:-/var/cache/dsec}/kernel
JOBS=${DSEC_KERNEL_JOBS:-2}
PRINT_DIR=0
FORCE=0

die() { echo "guest-kernel/build.sh: error: $*" >&2; exit 1; }
log() { echo "guest-kernel/build.sh: $*" >&2; }

while [[ $# -gt 0 ]]; do
    case $1 in
        --print-dir) PRINT_DIR=1 ;;
        --force) FORCE=1 ;;
        -j) JOBS=${2:?-j needs a number}; shift ;;
        -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
        *) die "unknown argument '$1' (try --help)" ;;
    esac
    shift
done

[[ -r $SRC_TARBALL ]] || die "$SRC_TARBALL not found: run 'apt-get install $SRC_PKG' (or setup.sh)"
PKG_VERSION=$(dpkg-query -W -f='${Version}' "$SRC_PKG" 2>/dev/null || true)
# A tarball not from dpkg (DSEC_KERNEL_TARBALL) is keyed by its own digest.
[[ -n $PKG_VERSION ]] || PKG_VERSION="tarball-$(sha256sum <"$SRC_TARBALL" | cut -d' ' -f1)"

# Cache key: everything that can change the output bytes.
shopt -s nullglob
PATCHES=("$HERE"/patches/*.patch)
HASH=$( {
    echo "pkg $SRC_PKG $PKG_VERSION"
    echo "--- fragment"; cat "$HERE/config-fragment"
    for p in "${PATCHES[@]}"; do echo "--- patch $(basename "$p")"; cat "$p"; done
    echo "--- build.sh"; cat "$HERE/build.sh"
} | sha256sum | cut -c1-16)
OUT=$CACHE_ROOT/$HASH

if [[ $PRINT_DIR == 1 ]]; then echo "$OUT"; exit 0; fi

if [[ $FORCE == 0 && -f $OUT/vmlinux && -f $OUT/bzImage && -f $OUT/version && -f $OUT/config ]]; then
    log "cache hit: $OUT ($(cat "$OUT/version"))"
    echo "$OUT"
    exit 0
fi

for tool in make gcc flex bison bc cpio rsync xz gzip sha256sum flock setsid readelf; do
    command -v "$tool" >/dev/null || die "'$tool' missing: run setup.sh (or apt-get install build-essential flex bison bc cpio rsync xz-utils libelf-dev libssl-dev dwarves)"
done

mkdir -p "$CACHE_ROOT"
# One builder per hash: a concurrent caller waits here, then finds the cache hit.
exec 9>"$CACHE_ROOT/.lock-$HASH"
if ! flock -n 9; then
    log "another build of $HASH is running; waiting for it"
    flock 9
fi
if [[ $FORCE == 0 && -f $OUT/vmlinux && -f $OUT/bzImage && -f $OUT/version && -f $OUT/config ]]; then
    log "cache hit after waiting: $OUT"
    echo "$OUT"
    exit 0
fi
# Fixed path (not mktemp): nothing path-dependent may differ between two builds.
WORK=$CACHE_ROOT/.build-$HASH
MAKE_PID=
cleanup() {
    # bash defers traps while a foreground child runs, so make runs in the
    # background and is killed (with its whole job) here on any exit.
    [[ -n $MAKE_PID ]] && kill -TERM -- -"$MAKE_PID" 2>/dev/null
    [[ -n $MAKE_PID ]] && wait "$MAKE_PID" 2>/dev/null
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM HUP
rm -rf "$WORK"
mkdir -p "$WORK"

START=$(date +%s)
log "cache miss: building $SRC_PKG $PKG_VERSION into $OUT (-j$JOBS)"
tar -C "$WORK" -xf "$SRC_TARBALL"
KSRC=$WORK/$SRC_PKG
[[ -f $KSRC/Makefile ]] || die "unexpected tarball layout: $KSRC/Makefile missing"
for p in "${PATCHES[@]}"; do
    log "applying $(basename "$p")"
    patch -d "$KSRC" -p1 --quiet --forward <"$p" || die "patch $(basename "$p") does not apply to $SRC_PKG $PKG_VERSION"
done

# Fixed identity so two builds of the same inputs produce the same bytes.
export KBUILD_BUILD_TIMESTAMP="1970-01-01 00:00:00 UTC"
export KBUILD_BUILD_USER=dsec KBUILD_BUILD_HOST=dsec KBUILD_BUILD_VERSION=1
export SOURCE_DATE_EPOCH=0 LC_ALL=C TZ=UTC
MK=(make -C "$KSRC" ARCH=x86_64 -s)

# tinyconfig, then the fragment merged over it, then allnoconfig with that as
# the "forced" set: every symbol we do not ask for stays off (leanest result).
"${MK[@]}" tinyconfig >/dev/null 2>&1 || die "make tinyconfig failed"
(cd "$KSRC" && ./scripts/kconfig/merge_config.sh -m .config "$HERE/config-fragment" >/dev/null)
cp "$KSRC/.config" "$WORK/merged.config"
"${MK[@]}" KCONFIG_ALLCONFIG="$WORK/merged.config" allnoconfig >/dev/null 2>"$WORK/kconfig.log" \
    || { cat "$WORK/kconfig.log" >&2; die "kconfig failed"; }

# Every fragment line must survive; Kconfig silently drops unmet dependencies.
missing=()
while IFS= read -r line; do
    if [[ $line =~ ^#\ (CONFIG_[A-Za-z0-9_]+)\ is\ not\ set$ ]]; then
        grep -q "^${BASH_REMATCH[1]}=" "$KSRC/.config" && missing+=("$line")
    elif [[ $line =~ ^CONFIG_[A-Za-z0-9_]+= ]]; then
        grep -qxF "$line" "$KSRC/.config" || missing+=("$line")
    fi
done <"$HERE/config-fragment"
if [[ ${#missing[@]} -gt 0 ]]; then
    printf '  %s\n' "${missing[@]}" >&2
    die "${#missing[@]} config-fragment line(s) did not stick (unmet dependency or typo); add the dependency to guest-kernel/config-fragment"
fi

log "config ok ($(grep -c '=y' "$KSRC/.config") options =y); compiling"
# setsid: make and its compilers form one process group cleanup() can kill.
setsid nice -n 10 "${MK[@]}" -j"$JOBS" vmlinux bzImage >"$WORK/build.log" 2>&1 &
MAKE_PID=$!
rc=0; wait "$MAKE_PID" || rc=$?
MAKE_PID=
[[ $rc == 0 ]] || { tail -40 "$WORK/build.log" >&2; die "kernel build failed (log above)"; }

# PVH entry is what lets our VMM (and QEMU -kernel) boot the ELF directly.
readelf -n "$KSRC/vmlinux" | grep -q 'Xen.*0x00000012' \
    || die "vmlinux lacks the PVH ELF note (XEN_ELFNOTE_PHYS32_ENTRY); is CONFIG_PVH set?"

STAGE=$WORK/out
mkdir -p "$STAGE"
cp "$KSRC/vmlinux" "$STAGE/vmlinux"
cp "$KSRC/arch/x86/boot/bzImage" "$STAGE/bzImage"
cp "$KSRC/.config" "$STAGE/config"
"${MK[@]}" kernelrelease >"$STAGE/version"
cp "$WORK/build.log" "$STAGE/build.log"
# Publish atomically: a half-written cache entry must never look like a hit.
rm -rf "$OUT"
mv "$STAGE" "$OUT"
log "built in $(( $(date +%s) - START ))s: $OUT ($(cat "$OUT/version"))"
echo "$OUT"
