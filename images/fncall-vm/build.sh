#!/usr/bin/env bash
# Builds the VM FnCall image: an initramfs for worker microVMs (the VMM FnCall mode, see
# fncall/README.md): busybox + the guest agent as /init (guest-agent/mkinitramfs.sh), python3
# with its standard library (test suites, tk, idle, build-time parts and the modules that need
# OpenSSL, Berkeley DB, NIS, curses, readline or SQLite left out: no network, no terminal), bash,
# and fncall/src/vm/guest_worker.py. Python and bash come from the installed fncall image
# (images/fncall/build.sh --install first), with the shared libraries they and python's
# extension modules need; numpy (without its tests, type stubs and build tools) with the
# reference BLAS/LAPACK it links, so the VM zygote preloads it like the container one.
#   ${DSEC_CACHE:-/var/cache/dsec}/images/fncall-vm/<hash>/initramfs.cpio
# <hash> covers this script, the agent binary, guest_worker.py and the fncall image's
# manifest: a hit costs nothing. --install copies it to ${DSEC_HOME:-/var/lib/dsec}/images/
# fncall-vm/ with the marker file `fncall-vm` that makes the node run the image's calls in VMs.
# Usage: build.sh [--agent PATH] [--install] [--print-dir]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
agent="$repo/target/x86_64-unknown-linux-gnu/release/dsec-agent"
install=0
print_dir=0
while [ $# -gt 0 ]; do
    case "$1" in
        --agent) agent="$2"; shift 2 ;;
        --install) install=1; shift ;;
        --print-dir) print_dir=1; shift ;;
        -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
        *) echo "fncall-vm/build.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
home=${DSEC_HOME:-/var/lib/dsec}
src="$home/images/fncall/rootfs"
worker="$repo/fncall/src/vm/guest_worker.py"
[ -x "$agent" ] || { echo "fncall-vm/build.sh: agent $agent missing: build the static agent (setup.sh)" >&2; exit 1; }
[ -x "$src/usr/bin/python3" ] || { echo "fncall-vm/build.sh: $src has no python3: run images/fncall/build.sh --install first" >&2; exit 1; }

hash=$({ sha256sum "$0" "$agent" "$worker" "$repo/guest-agent/mkinitramfs.sh"
         cat "$home/images/fncall/manifest" 2>/dev/null || ls -l --time-style=+%s "$src/usr/bin"; } \
       | sha256sum | cut -c1-16)
cache="${DSEC_CACHE:-/var/cache/dsec}/images/fncall-vm"
out="$cache/$hash"
if ! [ -f "$out/initramfs.cpio" ]; then
    mkdir -p "$cache"
    stage=$(mktemp -d "$cache/.build.XXXXXX")
    trap 'rm -rf "$stage"' EXIT
    "$repo/guest-agent/mkinitramfs.sh" --agent "$agent" "$stage/base" >/dev/null
    root="$stage/base/rootfs"
    # Python and its standard library, without what a call never imports.
    mkdir -p "$root/usr/lib" "$root/usr/lib/dsec-fncall" "$root/lib64" "$root/work"
    py=$(readlink -f "$src/usr/bin/python3"); pyname=$(basename "$py")
    rm -f "$root/usr/bin/$pyname" "$root/usr/bin/python3"
    cp "$py" "$root/usr/bin/$pyname"; ln -s "$pyname" "$root/usr/bin/python3"
    stdlib="usr/lib/$pyname"
    tar -C "$src" --exclude="$stdlib/test" --exclude="$stdlib/idlelib" --exclude="$stdlib/tkinter" \
        --exclude="$stdlib/turtledemo" --exclude="$stdlib/ensurepip" --exclude="$stdlib/lib2to3" \
        --exclude="$stdlib/pydoc_data" --exclude="$stdlib/config-*" --exclude="$stdlib/distutils" \
        --exclude="*.opt-1.pyc" --exclude="*.opt-2.pyc" --exclude="*/_test*.so" \
        --exclude="$stdlib/site-packages" --exclude="$stdlib/dist-packages" \
        --exclude="$stdlib/venv" --exclude="$stdlib/sqlite3" --exclude="$stdlib/curses" \
        --exclude="*/_ssl.*.so" --exclude="*/_hashlib.*.so" --exclude="*/_dbm.*.so" \
        --exclude="*/_gdbm.*.so" --exclude="*/nis.*.so" --exclude="*/_curses*.so" \
        --exclude="*/readline.*.so" --exclude="*/_sqlite3.*.so" --exclude="*/_crypt.*.so" \
        -cf - "$stdlib" | tar -C "$root" -xf -
    # numpy: what reward code imports most; preloaded by the zygote, as in container workers.
    np="usr/lib/python3/dist-packages/numpy"
    np_libs=()
    if [ -d "$src/$np" ]; then
        tar -C "$src" --exclude="$np/tests" --exclude="$np/*/tests" --exclude="$np/f2py" \
            --exclude="$np/distutils" --exclude="$np/doc" --exclude="$np/_pyinstaller" \
            --exclude="*.pyi" --exclude="*.pxd" \
            -cf - "$np" | tar -C "$root" -xf -
        mapfile -t np_libs < <(find "$root/$np" -name '*.so')
    fi
    rm -f "$root/bin/bash"
    cp "$src/usr/bin/bash" "$root/bin/bash"
    cp "$worker" "$root/usr/lib/dsec-fncall/guest_worker.py"
    # Shared libraries (from the fncall image, not the host), followed transitively.
    # A path of the fncall image with its last component's symbolic links followed inside the
    # image (Debian's alternatives, e.g. libblas.so.3, are absolute links).
    in_src() { local p=$1 t n=0; while [ -L "$src/$p" ] && [ $n -lt 16 ]; do
        t=$(readlink "$src/$p"); case $t in /*) p=${t#/} ;; *) p=$(dirname "$p")/$t ;; esac
        n=$((n + 1)); done; echo "$p"; }
    find_lib() { for d in lib/x86_64-linux-gnu usr/lib/x86_64-linux-gnu lib usr/lib; do
        [ -e "$src/$(in_src "$d/$1")" ] && { echo "$d/$1"; return; }; done; return 1; }
    queue=("$root/usr/bin/$pyname" "$root/bin/bash" "$root/$stdlib"/lib-dynload/*.so "${np_libs[@]}")
    declare -A seen=()
    while [ ${#queue[@]} -gt 0 ]; do
        file=${queue[0]}; queue=("${queue[@]:1}")
        for lib in $(readelf -d "$file" 2>/dev/null | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'); do
            [ -n "${seen[$lib]:-}" ] && continue
            seen[$lib]=1
            rel=$(find_lib "$lib") || { echo "fncall-vm/build.sh: $lib (needed by $file) not in $src" >&2; exit 1; }
            mkdir -p "$root/$(dirname "$rel")"
            cp "$src/$(in_src "$rel")" "$root/$rel"
            queue+=("$root/$rel")
        done
    done
    cp -L "$src/lib64/ld-linux-x86-64.so.2" "$root/lib64/ld-linux-x86-64.so.2"
    (cd "$root" && find . -mindepth 1 | LC_ALL=C sort | cpio -o -H newc --quiet > "$stage/initramfs.cpio")
    mkdir -p "$out.tmp"
    mv "$stage/initramfs.cpio" "$out.tmp/initramfs.cpio"
    rm -rf "$out"; mv "$out.tmp" "$out"
fi
if [ "$install" = 1 ]; then
    dest="$home/images/fncall-vm"
    mkdir -p "$dest"
    cp "$out/initramfs.cpio" "$dest/.initramfs.cpio.tmp"
    mv "$dest/.initramfs.cpio.tmp" "$dest/initramfs.cpio"
    echo "VM FnCall image (initramfs $hash); calls naming this image run in microVMs" > "$dest/fncall-vm"
fi
if [ "$print_dir" = 1 ]; then echo "$out"; fi
