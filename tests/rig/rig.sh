#!/usr/bin/env bash
# DSec hardware-virtualization test rig.
#
# This host's /dev/kvm is the software PVM hypervisor, which cannot run a Linux
# guest. QEMU TCG emulates AMD SVM, so an L1 Linux under `-accel tcg -cpu max`
# gets a real nested /dev/kvm (kvm_amd). The rig boots such an L1 (kernel from
# guest-kernel/build.sh, the same one the guests use), runs a test script in it
# and returns the script's output and exit status.
#
# Usage:
#   rig.sh build [--qemu] [FILE...]        assemble (or reuse) the L1 initramfs; prints its path
#   rig.sh run SCRIPT [--qemu] [FILE...]   boot a fresh L1, run SCRIPT, exit with its status
#   rig.sh guest-initramfs                 build (or reuse) a tiny busybox guest initramfs; prints its path
#   rig.sh smoke [GUEST_INITRAMFS]         QEMU-KVM inside L1 boots the guest kernel (proves the rig)
#   rig.sh direct SCRIPT [--qemu] [FILE...] hosts with hardware KVM: run SCRIPT on this host's
#                                          /dev/kvm in a chroot laid out like L1 (no nesting)
#
# FILE is SRC or SRC=DEST (DEST absolute inside L1). Without DEST, ELF programs
# go to /bin/, anything else to /guest/. Dynamically linked programs bring
# their shared libraries (found with ldd). --qemu adds Debian's
# qemu-system-x86_64, its libraries and firmware, for side-by-side runs.
#
# Environment: RIG_KERNEL (L1 kernel, default: guest-kernel build output),
#   RIG_TIMEOUT (seconds, default 900), RIG_MEM (MiB, default 2048), RIG_RETRIES (`run`
#   tries a fresh L1 again when one times out or ends without RIG-EXIT; default 1),
#   RIG_STALL (seconds, default 300: an L1 that prints nothing and uses under 3 s of CPU
#   for this long has hung, idle with no timer waking it; it is killed like a timeout),
#   RIG_LOG (keep the raw serial log here), DSEC_CACHE (default /var/cache/dsec),
#   RIG_TB_MIB (QEMU's translated-code cache, default 2048, the most an x86-64 host allows).
#
# The translated-code cache: TCG translates L1's code, and its guests', into host code
# and keeps it until the cache is full, then flushes all of it and translates again. A
# flush slows L1 and every guest for a while after it, so a timing taken across one is
# not comparable with one that is not; node-templates generates ~16 MiB of code a
# second on average, and QEMU's default cache (1 GiB) filled within one suite. After each L1 the rig
# prints how many flushes it had ("translation cache: N flushes"), and so does a line
# `RIG-MARK name` that a script prints (asking stalls L1 briefly: mark outside the timings).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
CACHE=${DSEC_CACHE:-/var/cache/dsec}/rig
TIMEOUT=${RIG_TIMEOUT:-900}
STALL=${RIG_STALL:-300}
MEM=${RIG_MEM:-2048}
TB_MIB=${RIG_TB_MIB:-2048}
QEMU=${RIG_QEMU_BIN:-qemu-system-x86_64}

die() { echo "rig: error: $*" >&2; exit 2; }
log() { echo "rig: $*" >&2; }

# Everything temporary lives under one dir; QEMU is killed on every exit path.
TMP=$(mktemp -d /tmp/dsec-rig.XXXXXX)
QPID=
# Ends the current L1's QEMU (a retry reuses QPID, so no attempt's L1 outlives it).
stop_l1() {
    if [[ -n $QPID ]] && kill -0 "$QPID" 2>/dev/null; then
        kill "$QPID" 2>/dev/null || true
        sleep 0.2
        kill -9 "$QPID" 2>/dev/null || true
    fi
    [[ -n $QPID ]] && { wait "$QPID" 2>/dev/null || true; }
    QPID=
}
cleanup() {
    stop_l1
    rm -rf "$TMP"
}
trap cleanup EXIT
trap 'exit 130' INT TERM HUP

need() { command -v "$1" >/dev/null || die "'$1' not found: $2"; }

l1_kernel() {
    if [[ -n ${RIG_KERNEL:-} ]]; then
        [[ -r $RIG_KERNEL ]] || die "RIG_KERNEL=$RIG_KERNEL is not readable"
        echo "$RIG_KERNEL"; return
    fi
    local dir
    dir=$("$REPO/guest-kernel/build.sh") || die "guest-kernel/build.sh failed; the L1 kernel is that build"
    echo "$dir/vmlinux"
}

is_elf() { [[ $(head -c4 "$1" | od -An -c | tr -d ' ') == '177ELF' ]]; }

# Copy SRC to ROOT/DEST, plus (for dynamic ELF) every library ldd resolves.
add_file() {
    local root=$1 src=$2 dest=$3
    [[ -e $src ]] || die "file '$src' does not exist"
    mkdir -p "$root$(dirname "$dest")"
    cp -L "$src" "$root$dest"
    if is_elf "$src" && ldd "$src" >/dev/null 2>&1; then
        local lib
        while read -r lib; do
            [[ -n $lib && -e $lib ]] || continue
            mkdir -p "$root$(dirname "$lib")"
            [[ -e $root$lib ]] || cp -L "$lib" "$root$lib"
        done < <(ldd "$src" | awk '/=> \//{print $3} /^\t\//{print $1}')
        if ldd "$src" | grep -q 'not found'; then
            ldd "$src" | grep 'not found' >&2
            die "'$src' needs libraries this host lacks"
        fi
    fi
}

# Parse [--qemu] [FILE...] into SPECS (SRC=DEST lines).
parse_files() {
    SPECS=()
    WITH_QEMU=0
    local a src dest
    for a in "$@"; do
        if [[ $a == --qemu ]]; then WITH_QEMU=1; continue; fi
        if [[ $a == *=* ]]; then src=${a%%=*}; dest=${a#*=}; else src=$a; dest=; fi
        [[ -e $src ]] || die "file '$src' does not exist"
        src=$(readlink -f "$src")
        if [[ -z $dest ]]; then
            if is_elf "$src" && [[ -x $src ]]; then dest=/bin/$(basename "$src"); else dest=/guest/$(basename "$src"); fi
        fi
        [[ $dest == /* ]] || die "destination '$dest' must be an absolute path inside L1"
        SPECS+=("$src=$dest")
    done
}

QEMU_FIRMWARE=(bios-microvm.bin qboot.rom pvh.bin linuxboot_dma.bin multiboot_dma.bin bios-256k.bin kvmvapic.bin)

# Build (or reuse) the base L1 initramfs for SPECS/WITH_QEMU; prints its path.
build_l1() {
    need busybox "apt-get install busybox-static"
    need cpio "apt-get install cpio"
    local bb
    bb=$(command -v busybox)
    is_elf "$bb" && ! ldd "$bb" >/dev/null 2>&1 || die "$bb is not static: apt-get install busybox-static"
    # Cache key: rig.sh itself, busybox, and every input (path + content digest).
    local key spec qemu_bin=
    if [[ $WITH_QEMU == 1 ]]; then
        qemu_bin=$(command -v "$QEMU") || die "$QEMU not found: apt-get install qemu-system-x86"
    fi
    key=$( {
        sha256sum "$HERE/rig.sh" "$HERE/l1-init" "$bb" | cut -d' ' -f1
        for spec in "${SPECS[@]}"; do echo "$spec $(sha256sum <"${spec%%=*}" | cut -d' ' -f1)"; done
        [[ -z $qemu_bin ]] || echo "qemu $(sha256sum <"$qemu_bin" | cut -d' ' -f1)"
    } | sha256sum | cut -c1-16)
    local out=$CACHE/l1-$key.cpio
    if [[ -f $out ]]; then log "L1 initramfs cache hit: $out"; echo "$out"; return; fi

    local root=$TMP/l1root
    rm -rf "$root"; mkdir -p "$root"/{bin,sbin,usr/bin,usr/sbin,proc,sys,dev,tmp,run,guest,rig,root,etc}
    cp "$bb" "$root/bin/busybox"
    local app
    for app in $(busybox --list); do
        [[ -e $root/bin/$app ]] || ln -s busybox "$root/bin/$app"
    done
    # Initial console for /init before devtmpfs is mounted (needs root).
    mknod -m 600 "$root/dev/console" c 5 1 2>/dev/null || true
    cp "$HERE/l1-init" "$root/init"; chmod 755 "$root/init"
    for spec in "${SPECS[@]}"; do add_file "$root" "${spec%%=*}" "${spec#*=}"; done
    if [[ $WITH_QEMU == 1 ]]; then
        add_file "$root" "$qemu_bin" /usr/bin/qemu-system-x86_64
        local fw
        mkdir -p "$root/usr/share/qemu"
        for fw in "${QEMU_FIRMWARE[@]}"; do
            [[ -e /usr/share/qemu/$fw ]] && cp -L "/usr/share/qemu/$fw" "$root/usr/share/qemu/$fw"
        done
        [[ -e $root/usr/share/qemu/bios-microvm.bin ]] || die "/usr/share/qemu/bios-microvm.bin missing: apt-get install qemu-system-x86"
    fi
    mkdir -p "$CACHE"
    # Written next to its final name, then renamed: concurrent builds never see half a file.
    (cd "$root" && find . -mindepth 1 | LC_ALL=C sort | cpio --quiet -o -H newc -R 0:0) >"$out.$$" \
        || { rm -f "$out.$$"; die "cpio failed writing $out"; }
    mv "$out.$$" "$out"
    # Every new binary makes a new entry; drop ones unused for two days.
    find "$CACHE" -maxdepth 1 -name 'l1-*.cpio' -atime +2 -delete 2>/dev/null || true
    log "L1 initramfs built: $out ($(du -h "$out" | cut -f1))"
    echo "$out"
}

# The running L1's translated-code cache from QEMU's monitor (`info jit`): flushes and
# code generated, or why it is not known.
translation_cache_stats() {
    [[ -S $TMP/monitor.sock ]] || { echo "unknown (QEMU has exited)"; return; }
    command -v python3 >/dev/null || { echo "unknown (no python3 to ask QEMU's monitor)"; return; }
    python3 - "$TMP/monitor.sock" <<'PY' 2>/dev/null || echo "unknown (QEMU's monitor did not answer)"
import re, socket, sys, time
sock = socket.socket(socket.AF_UNIX)
# Walking a full cache takes QEMU a while on a busy host.
sock.settimeout(10)
sock.connect(sys.argv[1])
sock.sendall(b"info jit\n")
out, end = b"", time.time() + 10
while time.time() < end and not re.search(rb"TB invalidate count", out):
    chunk = sock.recv(65536)
    if not chunk:
        break
    out += chunk
text = out.decode(errors="replace")
flushes = re.search(r"TB flush count\s+(\d+)", text)
code = re.search(r"gen code size\s+(\d+)/(\d+)", text)
if not flushes or not code:
    sys.exit(1)
print(f"{flushes.group(1)} flushes, {int(code.group(1)) >> 20} MiB of code in it")
PY
}

# Run SCRIPT in a fresh L1; stream the serial console; exit with its status.
run_l1() {
    local script=$1; shift
    [[ -r $script ]] || die "test script '$script' not readable"
    need "$QEMU" "apt-get install qemu-system-x86"
    parse_files "$@"
    local kernel base
    # die() inside $(...) only ends the subshell: propagate by hand.
    kernel=$(l1_kernel) || exit 2
    base=$(build_l1) || exit 2
    # The script travels as a second cpio appended to the cached base one.
    mkdir -p "$TMP/script/rig"
    cp "$script" "$TMP/script/rig/test.sh"
    (cd "$TMP/script" && printf 'rig\nrig/test.sh\n' | cpio --quiet -o -H newc -R 0:0) >"$TMP/script.cpio" \
        || die "cpio failed packing $script"
    cat "$base" "$TMP/script.cpio" >"$TMP/initramfs.cpio" || die "cannot write $TMP/initramfs.cpio (disk full?)"

    local logf=${RIG_LOG:-$TMP/serial.log}
    : >"$logf"
    local t0 now
    t0=$(date +%s.%N)
    log "booting L1 ($(basename "$kernel"), ${MEM} MiB, timeout ${TIMEOUT}s) for $(basename "$script")"
    rm -f "$TMP/monitor.sock"
    "$QEMU" -accel "tcg,tb-size=$TB_MIB" -cpu max -m "$MEM" -smp 1 \
        -monitor "unix:$TMP/monitor.sock,server=on,wait=off" \
        -M microvm,x-option-roms=off,isa-serial=on,rtc=off \
        -nodefaults -no-user-config -nographic -serial stdio -no-reboot \
        -kernel "$kernel" -initrd "$TMP/initramfs.cpio" \
        -append "console=ttyS0 panic=-1 tsc_early_khz=2300000 tsc=reliable quiet ${RIG_APPEND:-}" \
        </dev/null >"$logf" 2>&1 &
    QPID=$!

    local code= line deadline progress ticks last_ticks=0 tcache=
    deadline=$(( $(date +%s) + TIMEOUT ))
    progress=$(date +%s)
    exec 3< <(tail -n +1 -s 0.1 -f --pid="$QPID" "$logf")
    while :; do
        # Progress: a serial line, or 3 s more of L1 CPU (utime + stime, 100 ticks/s).
        ticks=$(awk '{print $14 + $15}' "/proc/$QPID/stat" 2>/dev/null || echo 0)
        if (( ticks - last_ticks >= 300 )); then last_ticks=$ticks; progress=$(date +%s); fi
        if [[ -z $code ]] && (( $(date +%s) - progress >= STALL )); then
            log "STALL: the L1 printed nothing and used under 3 s of CPU in ${STALL}s (hung); killing it"
            exec 3<&-
            stop_l1
            return 124
        fi
        if IFS= read -r -t 2 line <&3; then
            progress=$(date +%s)
            line=${line%$'\r'}
            printf '%s\n' "$line"
            case $line in
                RIG-BOOTED*)
                    now=$(date +%s.%N)
                    log "L1 reached /init after $(awk -v a="$t0" -v b="$now" 'BEGIN{printf "%.2f", b-a}') s (host wall clock)" ;;
                RIG-MARK\ *)
                    # A script marks a measurement window; a flush inside it is seen here.
                    log "translation cache at ${line#RIG-MARK }: $(translation_cache_stats)" ;;
                RIG-EXIT\ *)
                    code=${line#RIG-EXIT }; code=${code%% *}
                    # Asked now: QEMU exits when L1 powers off.
                    tcache=$(translation_cache_stats)
                    # L1 should power off now; do not wait long for it.
                    deadline=$(( $(date +%s) + 10 )) ;;
            esac
        else
            local rc=$?
            if (( rc > 128 )); then :  # read timed out: just check the deadline
            else [[ -n $line ]] && printf '%s\n' "${line%$'\r'}"; break; fi
        fi
        if (( $(date +%s) >= deadline )); then
            if [[ -n $code ]]; then
                log "L1 did not power off after RIG-EXIT; killing it"
                break
            fi
            log "TIMEOUT after ${TIMEOUT}s: killing L1 (raise RIG_TIMEOUT if the test is just slow)"
            exec 3<&-
            stop_l1
            return 124
        fi
    done
    exec 3<&-
    log "translation cache: ${tcache:-unknown (no RIG-EXIT)} (tb-size ${TB_MIB} MiB)"
    stop_l1
    now=$(date +%s.%N)
    log "L1 finished after $(awk -v a="$t0" -v b="$now" 'BEGIN{printf "%.2f", b-a}') s"
    if [[ -z $code || ! $code =~ ^[0-9]+$ ]]; then
        log "L1 ended without a RIG-EXIT line (kernel panic or crash?); serial log above"
        return 125
    fi
    return "$code"
}

# Hosts with hardware virtualization need no L1: the same script runs in a
# private mount namespace, chrooted into the unpacked L1 initramfs, with the
# host's /dev (and its /dev/kvm), /proc and /sys.
run_direct() {
    local script=$1; shift
    [[ -r $script ]] || die "test script '$script' not readable"
    [[ -c /dev/kvm ]] || die "/dev/kvm missing: use 'rig.sh run' (nested KVM under QEMU TCG) instead"
    if [[ -d /sys/module/kvm_pvm && -z ${RIG_DIRECT_FORCE:-} ]]; then
        die "this /dev/kvm is the software PVM hypervisor, which cannot run Linux guests: use 'rig.sh run'"
    fi
    [[ -d /sys/module/kvm_amd || -d /sys/module/kvm_intel || -n ${RIG_DIRECT_FORCE:-} ]] \
        || die "no kvm_amd/kvm_intel loaded: this host has no hardware KVM; use 'rig.sh run'"
    need unshare "apt-get install util-linux"
    parse_files "$@"
    local base root
    base=$(build_l1) || exit 2
    root=$TMP/direct
    mkdir -p "$root/rig"
    (cd "$root" && cpio --quiet -id <"$base") || die "cannot unpack $base"
    cp "$script" "$root/rig/test.sh"
    log "running $(basename "$script") directly on this host's /dev/kvm (chroot $root)"
    local rc=0
    unshare -m --propagation private sh -c '
        set -e
        r=$1
        for d in dev proc sys; do mount --rbind "/$d" "$r/$d"; done
        mount -t tmpfs tmp "$r/tmp"
        mount -t tmpfs run "$r/run"
        exec chroot "$r" /bin/sh -c "cd /tmp && PATH=/bin:/sbin:/usr/bin:/usr/sbin HOME=/root sh /rig/test.sh"
    ' rig-direct "$root" || rc=$?
    echo "RIG-EXIT $rc"
    return "$rc"
}

# Tiny guest initramfs: static busybox + an /init that prints a marker and powers off.
guest_initramfs() {
    need busybox "apt-get install busybox-static"
    local bb key out root
    bb=$(command -v busybox)
    key=$( { sha256sum "$HERE/rig.sh" "$HERE/guest-init" "$bb" | cut -d' ' -f1; } | sha256sum | cut -c1-16)
    out=$CACHE/guest-$key.cpio
    if [[ -f $out ]]; then echo "$out"; return; fi
    root=$TMP/guestroot
    mkdir -p "$root"/{bin,proc,sys,dev,tmp}
    cp "$bb" "$root/bin/busybox"
    for app in sh mount echo cat poweroff reboot uname sleep; do ln -s busybox "$root/bin/$app"; done
    mknod -m 600 "$root/dev/console" c 5 1 2>/dev/null || true
    cp "$HERE/guest-init" "$root/init"; chmod 755 "$root/init"
    mkdir -p "$CACHE"
    (cd "$root" && find . -mindepth 1 | LC_ALL=C sort | cpio --quiet -o -H newc -R 0:0) >"$out.$$" \
        || { rm -f "$out.$$"; die "cpio failed writing $out"; }
    mv "$out.$$" "$out"
    echo "$out"
}

cmd=${1:-}
[[ $# -gt 0 ]] && shift
case $cmd in
    build) parse_files "$@"; build_l1 || exit 2 ;;
    run)
        [[ $# -ge 1 ]] || die "usage: rig.sh run SCRIPT [--qemu] [FILE...]"
        rc=0; run_l1 "$@" || rc=$?
        # 124/125: the L1 itself hung or died (a wedged TCG L1 has been seen), not a test
        # verdict; a test's own failures come with a RIG-EXIT line and are never retried.
        if (( rc == 124 || rc == 125 )) && (( ${RIG_RETRIES:-1} > 0 )); then
            log "RETRY: the L1 ended with status $rc (no RIG-EXIT): one more try in a fresh L1 (RIG_RETRIES=0: none)"
            rc=0; run_l1 "$@" || rc=$?
        fi
        exit "$rc" ;;
    guest-initramfs) guest_initramfs || exit 2 ;;
    direct)
        [[ $# -ge 1 ]] || die "usage: rig.sh direct SCRIPT [--qemu] [FILE...]"
        rc=0; run_direct "$@" || rc=$?
        exit "$rc" ;;
    smoke)
        if [[ $# -ge 1 ]]; then gi=$1; else gi=$(guest_initramfs) || exit 2; fi
        kdir=$("$REPO/guest-kernel/build.sh") || die "guest-kernel/build.sh failed"
        rc=0
        run_l1 "$HERE/tests/smoke.sh" --qemu "$kdir/vmlinux=/guest/vmlinux" "$kdir/bzImage=/guest/bzImage" "$gi=/guest/initramfs" || rc=$?
        exit "$rc" ;;
    ""|-h|--help|help) sed -n '2,25p' "$0"; exit 0 ;;
    *) die "unknown subcommand '$cmd' (build, run, direct, guest-initramfs, smoke)" ;;
esac
