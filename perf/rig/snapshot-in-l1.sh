#!/bin/sh
# Runs inside the rig's L1 (tests/rig/rig.sh run): the guest-inclusive restore benchmark.
# Boots the Linux guest + agent once, snapshots it, records a working set with one lazy
# restore, then per sample and in a rotating order measures, on L1's clock, from the `dsec vm`
# call to the end of the first `exec true` through the agent:
#   cold      dsec vm boot (a fresh boot of the same VM)
#   private   dsec vm restore (memory file mapped MAP_PRIVATE)
#   lazy      dsec vm restore --lazy (userfaultfd, pages on first touch)
#   prefetch  dsec vm restore --lazy --prefetch (recorded working set loaded in the background)
# Restores include the agent Refresh (entropy, clock). Prints one
# `PERF-SNAP contender=... index=... ok=... first_exec_ms=... [error=...]` line per sample.
# `dsec-perf snapshot` writes the PERF_* settings above this line and reads the output.
: "${PERF_SAMPLES:=3}"
: "${PERF_MEM_MIB:=256}"
: "${PERF_RECORD_MS:=2000}"
K=/guest/vmlinux
I=/guest/initramfs.cpio
now() { cut -d' ' -f1 /proc/uptime; }
ms() { awk -v a="$1" -v b="$2" 'BEGIN{printf "%.0f", (b-a)*1000}'; }
fail() { echo "FAIL $1"; echo "0 passed, 1 failed"; exit 1; }
cd /tmp

timeout 300 dsec vm boot /tmp/base --kernel $K --initrd $I --mem "$PERF_MEM_MIB" >/tmp/base.out 2>&1 \
    || fail "base boot: $(cat /tmp/base.out)"
timeout 60 dsec vm exec /tmp/base -- true || fail "base exec"
timeout 120 dsec vm snapshot /tmp/base /tmp/snap >/dev/null || fail "snapshot"
timeout 30 dsec vm rm /tmp/base >/dev/null
timeout 300 dsec vm restore /tmp/snap /tmp/rec --lazy --record-working-set "$PERF_RECORD_MS" >/tmp/rec.out 2>&1 \
    && timeout 60 dsec vm exec /tmp/rec -- true || fail "recording restore: $(cat /tmp/rec.out)"
sleep "$(awk -v m="$PERF_RECORD_MS" 'BEGIN{print m/1000 + 0.5}')"
timeout 30 dsec vm rm /tmp/rec >/dev/null
echo "PERF-SNAP-INFO working_set_bytes=$(wc -c </tmp/snap/working-set 2>/dev/null || echo 0) memory_allocated_kib=$(du -k /tmp/snap/memory | cut -f1)"

set -- cold private lazy prefetch
i=0
while [ $i -lt "$PERF_SAMPLES" ]; do
    # Rotate the order each round so no contender always runs first.
    r=0
    while [ $r -lt $((i % 4)) ]; do c=$1; shift; set -- "$@" "$c"; r=$((r + 1)); done
    for c in "$@"; do
        d=/tmp/$c-$i
        t0=$(now)
        case $c in
            cold) timeout 300 dsec vm boot $d --kernel $K --initrd $I --mem "$PERF_MEM_MIB" ;;
            private) timeout 300 dsec vm restore /tmp/snap $d ;;
            lazy) timeout 300 dsec vm restore /tmp/snap $d --lazy ;;
            prefetch) timeout 300 dsec vm restore /tmp/snap $d --lazy --prefetch ;;
        esac >/tmp/$c.out 2>&1 && timeout 60 dsec vm exec $d -- true
        rc=$?
        t1=$(now)
        if [ $rc = 0 ]; then
            echo "PERF-SNAP contender=$c index=$i ok=1 first_exec_ms=$(ms "$t0" "$t1")"
        else
            echo "PERF-SNAP contender=$c index=$i ok=0 error=$(tail -1 /tmp/$c.out | tr -c 'A-Za-z0-9.:/-' '_' | cut -c1-200)"
        fi
        timeout 30 dsec vm rm $d >/dev/null 2>&1
    done
    # Back to the base order for the next rotation.
    set -- cold private lazy prefetch
    i=$((i + 1))
done
echo "1 passed, 0 failed"
