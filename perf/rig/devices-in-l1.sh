#!/bin/sh
# Runs inside the rig's L1 (tests/rig/rig.sh run --qemu): our VMM and QEMU `-M microvm` side by
# side on the same guest kernel, initramfs, disk image and tap, in a rotating order:
#   idle  1 vCPU, PERF_MEM_MIB guest, no devices: once the guest idles, the VMM process's RSS
#         minus the RSS of its guest-memory mapping (the VMM's own memory overhead)
#   io    + a virtio-blk disk and virtio-net on a tap: dsec-guest-bench inside the guest reads
#         the disk (O_DIRECT, sequential 1 MiB and random 4 KiB) and moves TCP to and from
#         the same tool running in L1
# The guest runs /bench-init (rdinit=) from the benchmark initramfs, which reads its mode from
# the kernel command line. Prints `PERF-DEV kind=idle|io contender=... index=... ok=... ...`.
# `dsec-perf devices` writes the PERF_* settings above this line and reads the output.
: "${PERF_SAMPLES:=3}"
: "${PERF_MEM_MIB:=128}"
: "${PERF_DISK_MIB:=64}"
: "${PERF_RAND_READS:=2000}"
: "${PERF_TCP_MIB:=16}"
K=/guest/vmlinux
I=/guest/bench.cpio
BASE="console=ttyS0 reboot=k panic=-1 quiet rdinit=/bench-init"
MAC=06:00:0a:00:03:02
fail() { echo "FAIL $1"; echo "0 passed, 1 failed"; exit 1; }
for f in /bin/dsec-vmm /usr/bin/qemu-system-x86_64 /bin/dsec-guest-bench $K $I; do
    [ -e "$f" ] || fail "input: $f missing from the L1 initramfs"
done
cd /tmp
dd if=/dev/urandom of=/tmp/disk.img bs=1M count="$PERF_DISK_MIB" 2>/dev/null || fail "disk image"
dsec-guest-bench tcp-sink 5000 &
sink=$!
dsec-guest-bench tcp-source 5001 $((PERF_TCP_MIB * 1048576)) &
source=$!
trap 'kill $sink $source 2>/dev/null' EXIT

# launch CONTENDER KIND DIR: starts the VMM in the background, sets $vm.
launch() {
    c=$1 kind=$2 d=$3
    cmd="$BASE dsec.bench=$kind dsec.disk_mib=$PERF_DISK_MIB dsec.rand=$PERF_RAND_READS dsec.tcp_mib=$PERF_TCP_MIB"
    case $c in
        ours)
            set -- --kernel $K --initrd $I --cmdline "$cmd" --vcpus 1 --mem-mib "$PERF_MEM_MIB" \
                --serial-log $d/serial.log
            [ $kind = io ] && set -- "$@" --drive /tmp/disk.img --net tap=dsb0,mac=$MAC
            dsec-vmm "$@" 2>$d/vmm.log &
            ;;
        qemu)
            set -- -M microvm,x-option-roms=off,isa-serial=on,rtc=off -accel kvm -cpu host \
                -smp 1 -m "$PERF_MEM_MIB" -nodefaults -no-user-config -display none \
                -serial file:$d/serial.log -no-reboot -kernel $K -initrd $I -append "$cmd"
            [ $kind = io ] && set -- "$@" \
                -drive id=d0,file=/tmp/disk.img,format=raw,if=none \
                -device virtio-blk-device,drive=d0 \
                -netdev tap,id=n0,ifname=dsb0,script=no,downscript=no \
                -device virtio-net-device,netdev=n0,mac=$MAC
            qemu-system-x86_64 "$@" 2>$d/vmm.log &
            ;;
    esac
    vm=$!
}

# wait_for DIR PATTERN SECONDS: until the guest's console shows PATTERN or the VMM exits.
wait_for() {
    n=0
    while [ $n -lt $(($3 * 10)) ]; do
        grep -q "$2" $1/serial.log 2>/dev/null && return 0
        kill -0 $vm 2>/dev/null || { sleep 0.2; grep -q "$2" $1/serial.log 2>/dev/null; return; }
        sleep 0.1; n=$((n + 1))
    done
    return 1
}

why() { tail -3 $1/serial.log $1/vmm.log 2>/dev/null | tr -c 'A-Za-z0-9.:/=-' '_' | cut -c1-200; }

# The guest-memory mapping is the one whose size is the guest's memory (allowing for a
# little rounding); its RSS is guest memory, the rest of the process's RSS is the VMM's own.
measure_idle() {
    pid=$1
    guest_kib=$(awk -v mem=$((PERF_MEM_MIB * 1024)) '
        /^[0-9a-f]+-[0-9a-f]+ / { size = -1 }
        /^Size:/ { size = $2 }
        /^Rss:/ { if (size >= mem && size <= mem + 4096 && $2 > best) best = $2 }
        END { print best + 0 }' /proc/$pid/smaps)
    rss_kib=$(awk '/^Rss:/ { print $2 }' /proc/$pid/smaps_rollup)
    pss_kib=$(awk '/^Pss:/ { print $2 }' /proc/$pid/smaps_rollup)
    if [ -z "$rss_kib" ] || [ "$guest_kib" = 0 ]; then
        echo "ok=0 error=no_guest-memory_mapping_in_/proc/$pid/smaps_(kernel_without_CONFIG_PROC_PAGE_MONITOR?)"
        return
    fi
    echo "ok=1 rss_kib=$rss_kib guest_rss_kib=$guest_kib overhead_kib=$((rss_kib - guest_kib)) pss_kib=$pss_kib"
}

set -- ours qemu
i=0
while [ $i -lt "$PERF_SAMPLES" ]; do
    [ $((i % 2)) = 1 ] && set -- qemu ours || set -- ours qemu
    for c in "$@"; do
        # Idle memory overhead.
        d=/tmp/$c-idle-$i; mkdir -p $d
        launch $c idle $d
        if wait_for $d "PERF-DEV-GUEST idle" 300; then
            sleep 3
            echo "PERF-DEV kind=idle contender=$c index=$i $(measure_idle $vm)"
        else
            echo "PERF-DEV kind=idle contender=$c index=$i ok=0 error=$(why $d)"
        fi
        kill -9 $vm 2>/dev/null; wait $vm 2>/dev/null

        # Block and TCP throughput, measured by the guest.
        d=/tmp/$c-io-$i; mkdir -p $d
        launch $c io $d
        n=0
        while ! ip link show dsb0 >/dev/null 2>&1 && [ $n -lt 600 ]; do sleep 0.1; n=$((n + 1)); done
        ip addr add 10.0.3.1/24 dev dsb0 2>/dev/null; ip link set dsb0 up 2>/dev/null
        if wait_for $d "PERF-DEV-GUEST done" 600; then
            vals=$(sed -n 's/.*PERF-DEV-GUEST \(.*=.*\)/\1/p' $d/serial.log | grep -v '^error' | tr '\r\n' '  ')
            errs=$(grep -c 'PERF-DEV-GUEST error' $d/serial.log)
            if [ "$errs" = 0 ]; then
                echo "PERF-DEV kind=io contender=$c index=$i ok=1 $vals"
            else
                echo "PERF-DEV kind=io contender=$c index=$i ok=0 error=$(grep 'PERF-DEV-GUEST error' $d/serial.log | head -1 | tr -c 'A-Za-z0-9.:/=-' '_' | cut -c1-200)"
            fi
        else
            echo "PERF-DEV kind=io contender=$c index=$i ok=0 error=$(why $d)"
        fi
        n=0; while kill -0 $vm 2>/dev/null && [ $n -lt 100 ]; do sleep 0.1; n=$((n + 1)); done
        kill -9 $vm 2>/dev/null; wait $vm 2>/dev/null
    done
    i=$((i + 1))
done
echo "1 passed, 0 failed"
