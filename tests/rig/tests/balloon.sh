#!/bin/sh
# Runs inside the rig's L1: the real guest kernel's virtio_balloon driver against our device.
# One VM (512 MiB, balloon with deflate-on-OOM, 1 s statistics and free page reporting):
# the driver binds, statistics reach the control socket, the guest inflates to a host target
# and deflates again, memory the guest frees is reported and the VMM's RSS falls, and a
# restored copy keeps its balloon. Prints PASS/FAIL, METRIC lines and "N passed, N failed".
pass=0; fail=0
ok()  { echo "PASS $1"; pass=$((pass+1)); }
bad() { echo "FAIL $1: $2"; fail=$((fail+1)); }
K=/guest/vmlinux
I=/guest/initramfs.cpio
D=/tmp/bal1
R=/tmp/bal2
x() { timeout 120 dsec vm exec $D -- "$@"; }
b() { timeout 30 dsec vm balloon "$@"; }
# A number field of the balloon op's JSON answer.
field() { sed -n "s/.*\"$1\":\([0-9]*\).*/\1/p"; }
rss_mib() { awk '/^VmRSS/ {print int($2/1024)}' /proc/$1/status; }
# Waits up to $3 seconds for field $2 of VM dir $1 to read $4.
wait_field() {
    for i in $(seq 1 $3); do
        [ "$(b $1 | field $2)" = "$4" ] && return 0
        sleep 1
    done
    return 1
}
cleanup() { kill $vmm 2>/dev/null; [ -f $R/pid ] && kill "$(cat $R/pid)" 2>/dev/null; }
mkdir -p $D

dsec-vmm --kernel $K --initrd $I --cmdline "console=ttyS0 reboot=k panic=-1 quiet" \
    --mem-mib 512 --balloon deflate-on-oom,stats=1,reporting \
    --vsock-uds $D/vsock.sock --api-sock $D/api.sock --serial-log $D/serial.log \
    2>$D/vmm.log &
vmm=$!
up=0
for i in $(seq 1 240); do
    if x true 2>/dev/null; then up=1; break; fi
    kill -0 $vmm 2>/dev/null || break
    sleep 0.5
done
if [ $up != 1 ]; then
    bad boot "agent never answered"; tail -20 $D/serial.log $D/vmm.log
    cleanup; echo "$pass passed, $fail failed"; exit 1
fi
ok boot

# The driver bound and negotiated what we offered: bits 1 (stats), 2 (deflate-on-OOM) and 5
# (reporting) set, 0, 3 and 4 clear in the features string sysfs shows (bit 0 first).
feat=$(x sh -c 'cat /sys/bus/virtio/drivers/virtio_balloon/virtio*/features')
case "$feat" in
    011001*) ok driver-features ;;
    *) bad driver-features "features '$feat'" ;;
esac

# Statistics: the driver answers the device's 1 s requests.
sleep 3
st=$(b $D)
echo "$st" | grep -q '"free_memory":[1-9]' && echo "$st" | grep -q '"total_memory":[1-9]' \
    && ok stats || bad stats "$st"

# Free page reporting: the guest touches 200 MiB, frees it, and the VMM's RSS falls back.
base=$(rss_mib $vmm)
x sh -c 'mkdir -p /run/fill && mount -t tmpfs -o size=300m fill /run/fill && dd if=/dev/zero of=/run/fill/f bs=1M count=200 2>/dev/null'
high=$(rss_mib $vmm)
x sh -c 'rm /run/fill/f && umount /run/fill'
low=$high
for i in $(seq 1 90); do
    sleep 1
    low=$(rss_mib $vmm)
    [ $((high - low)) -ge 100 ] && break
done
echo "METRIC balloon_rss_before_mib $base"
echo "METRIC balloon_rss_touched_mib $high"
echo "METRIC balloon_rss_after_report_mib $low"
echo "METRIC balloon_reported_mib $(( $(b $D | field reported_bytes) / 1048576 ))"
[ $((high - base)) -ge 100 ] && [ $((high - low)) -ge 100 ] \
    && ok reporting-rss-falls || bad reporting-rss-falls "RSS $base -> $high -> $low MiB"

# Inflate on a host request, then deflate.
b $D --target-mib 128 >/dev/null
if wait_field $D actual_pages 120 32768; then ok inflate; else bad inflate "$(b $D)"; fi
echo "METRIC balloon_rss_inflated_mib $(rss_mib $vmm)"
b $D --target-mib 0 >/dev/null
if wait_field $D actual_pages 120 0; then ok deflate; else bad deflate "$(b $D)"; fi
[ "$(x echo alive)" = alive ] && ok guest-alive || bad guest-alive "agent gone after deflate"

# A restored copy keeps its balloon: target and statistics come back, and its driver still
# follows a new target.
b $D --target-mib 64 >/dev/null
wait_field $D actual_pages 120 16384 || bad pre-snapshot-inflate "$(b $D)"
snap_ok=0
timeout 120 dsec vm snapshot $D /tmp/bal.snap >/dev/null && snap_ok=1
# The original goes first: L1 has one (emulated) CPU for both.
kill $vmm 2>/dev/null; wait $vmm 2>/dev/null
if [ $snap_ok = 1 ] && timeout 200 dsec vm restore /tmp/bal.snap $R >/dev/null; then
    [ "$(b $R | field target_pages)" = 16384 ] && [ "$(b $R | field actual_pages)" = 16384 ] \
        && ok restore-keeps-balloon || bad restore-keeps-balloon "$(b $R)"
    b $R --target-mib 0 >/dev/null
    if wait_field $R actual_pages 120 0; then ok restored-deflate; else bad restored-deflate "$(b $R)"; fi
else
    bad restore-keeps-balloon "snapshot ($snap_ok) or restore failed: $(cat $R/vmm.log 2>/dev/null)"
fi

cleanup; wait $vmm 2>/dev/null
grep -q "forbidden system call" $D/vmm.log $R/vmm.log 2>/dev/null \
    && bad seccomp "$(cat $D/vmm.log $R/vmm.log)" || ok no-seccomp-violation
echo "$pass passed, $fail failed"
exit $fail
