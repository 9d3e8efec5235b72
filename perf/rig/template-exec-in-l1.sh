#!/bin/sh
# Runs inside the rig's L1 (tests/rig/rig.sh run): where the CLI's time goes around a
# template create, and where the guest kernel's boot time goes. Not run by test.sh.
# 1. `--version` of /bin/dsec and of every /bin/dsec-* variant given (e.g. an older build),
#    alternating, 6 rounds: one METRIC line each (L1 clock, 10 ms steps).
# 2. Guest boot trace: dsec-vmm boots the guest kernel + busybox initramfs with
#    `initcall_debug printk.time=1` (and `quiet`, so the console costs nothing) twice, the
#    second time with `initramfs_async=0` (initcall times then exclude the initramfs unpack);
#    each guest's dmesg is printed as DMESG / DMESG2 lines (`dsec vm exec DIR -- dmesg`).
# 3. `dsec up` (microVMs, jailed, pool of prewarmed VMMs), the template built by a first
#    create, then 3 rounds of a template and a --cold create, each followed by three
#    `dsec exec ID -- true`: `METRIC KIND_create_ms N exec1 N exec2 N exec3 N`; then the
#    daemon's create steps from its log.
# Expects /bin/dsec, /bin/dsec-vmm, /dsec/kernel/vmlinux, /dsec/images/busybox/initramfs.cpio:
#   kdir=$(guest-kernel/build.sh --print-dir)
#   tests/rig/rig.sh run perf/rig/template-exec-in-l1.sh target/release/dsec=/bin/dsec \
#       /path/to/older/dsec=/bin/dsec-old target/release/dsec-vmm=/bin/dsec-vmm \
#       "$kdir/vmlinux=/dsec/kernel/vmlinux" \
#       "$DSEC_HOME/images/busybox/initramfs.cpio=/dsec/images/busybox/initramfs.cpio"
export DSEC_HOME=/dsec DSEC_RUN_DIR=/tmp/dsec-run
export DSEC_ENDPOINT=unix:/tmp/node/edge.sock
T=300
now_ms() { read up _ </proc/uptime; echo $(( ${up%.*} * 1000 + 1${up#*.} * 10 - 1000 )); }

for i in 1 2 3 4 5 6; do
    for b in /bin/dsec /bin/dsec-*; do
        [ -x "$b" ] && [ "$b" != /bin/dsec-vmm ] || continue
        t0=$(now_ms); $b --version >/dev/null; t1=$(now_ms)
        echo "METRIC version_$(basename $b)_ms $((t1 - t0))"
    done
done

trace_boot() { # DIR PREFIX EXTRA_CMDLINE
    mkdir -p $1
    dsec-vmm --kernel $DSEC_HOME/kernel/vmlinux --initrd $DSEC_HOME/images/busybox/initramfs.cpio \
        --cmdline "console=ttyS0 reboot=k panic=-1 quiet initcall_debug printk.time=1 $3" \
        --mem-mib 256 --vsock-uds $1/vsock.sock --vsock-cid 3 --serial-log $1/serial.log \
        >$1/out 2>&1 &
    vmm=$!
    i=0
    until grep -q "dsec-agent ready" $1/serial.log 2>/dev/null || [ $i -ge 600 ]; do
        sleep 0.1; i=$((i + 1))
    done
    timeout 60 dsec vm exec $1 -- dmesg | sed "s/^/$2 /"
    kill $vmm; wait $vmm 2>/dev/null
}
trace_boot /tmp/trace1 DMESG ""
trace_boot /tmp/trace2 DMESG2 initramfs_async=0

DSEC_LOG=info dsec up --state-dir /tmp/node --default-backend microvm --metrics off \
    --http 127.0.0.1:7080 --cgroup-name dsec-rig --ready-timeout 120 >>/tmp/node.log 2>&1 &
daemon=$!
i=0; until dsec ls >/dev/null 2>&1 || [ $i -ge 100 ]; do sleep 0.2; i=$((i + 1)); done
a=$(timeout $T dsec create --backend microvm --mem 128)
timeout $T dsec exec $a -- true
sleep 3
for i in 1 2 3; do
    for kind in template cold; do
        [ $kind = cold ] && c=--cold || c=
        t0=$(now_ms); s=$(timeout $T dsec create --backend microvm --mem 128 $c); t1=$(now_ms)
        timeout $T dsec exec $s -- true; t2=$(now_ms)
        timeout $T dsec exec $s -- true; t3=$(now_ms)
        timeout $T dsec exec $s -- true; t4=$(now_ms)
        echo "METRIC ${kind}_create_ms $((t1 - t0)) exec1 $((t2 - t1)) exec2 $((t3 - t2)) exec3 $((t4 - t3))"
        timeout $T dsec rm $s >/dev/null 2>&1
        sleep 3
    done
done
grep -o -e 'create done.*' -e 'create steps.*' -e 'restored into a prewarmed VMM.*' \
    -e 'restored guest refreshed.*' /tmp/node.log | sed 's/\x1b\[[0-9;]*m//g' | tail -40
timeout $T dsec rm $a >/dev/null 2>&1
kill $daemon; wait $daemon 2>/dev/null
echo "1 passed, 0 failed"
