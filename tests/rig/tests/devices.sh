#!/bin/sh
# Runs inside the rig's L1: the real guest kernel's drivers against our devices. One VM with
# 2 vCPUs, virtio-rng, a writable and a read-only virtio-blk disk and virtio-net on a tap;
# checks go through the agent (`dsec vm exec`). Prints PASS/FAIL and "N passed, N failed".
pass=0; fail=0
ok()  { echo "PASS $1"; pass=$((pass+1)); }
bad() { echo "FAIL $1: $2"; fail=$((fail+1)); }
K=/guest/vmlinux
I=/guest/initramfs.cpio
D=/tmp/dev1
x() { timeout 60 dsec vm exec $D -- "$@"; }
mkdir -p $D
dd if=/dev/urandom of=/tmp/disk.img bs=1M count=8 2>/dev/null
truncate -s 64M /tmp/disk.img
dd if=/dev/urandom of=/tmp/ro.img bs=1M count=4 2>/dev/null
host_sum=$(md5sum </tmp/disk.img | cut -d' ' -f1)
ro_sum=$(md5sum </tmp/ro.img | cut -d' ' -f1)

dsec-vmm --kernel $K --initrd $I --cmdline "console=ttyS0 reboot=k panic=-1 quiet" \
    --vcpus 2 --mem-mib 256 --rng --drive /tmp/disk.img --drive /tmp/ro.img,ro \
    --net tap=dsdev0,mac=06:00:0a:00:02:02 \
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
    kill $vmm 2>/dev/null; echo "$pass passed, $fail failed"; exit 1
fi
ok boot

[ "$(x nproc)" = 2 ] && ok two-vcpus || bad two-vcpus "guest sees $(x nproc) CPUs"

# Block: the guest reads the image byte for byte, writes land in the host file, the
# read-only disk refuses writes.
[ "$(x sh -c 'md5sum </dev/vda' | cut -d' ' -f1)" = "$host_sum" ] && ok blk-read || bad blk-read "guest checksum differs"
x sh -c 'printf written-by-guest | dd of=/dev/vda bs=512 seek=20000 conv=notrunc,fsync 2>/dev/null'
[ "$(dd if=/tmp/disk.img bs=512 skip=20000 count=1 2>/dev/null | head -c 16)" = written-by-guest ] \
    && ok blk-write || bad blk-write "host file does not hold the guest's write"
[ "$(x sh -c 'md5sum </dev/vdb' | cut -d' ' -f1)" = "$ro_sum" ] && ok blk-second-disk || bad blk-second-disk "vdb checksum differs"
if x sh -c 'printf x | dd of=/dev/vdb conv=notrunc,fsync 2>/dev/null'; then
    bad blk-read-only "a write to the read-only disk succeeded"
else
    [ "$(md5sum </tmp/ro.img | cut -d' ' -f1)" = "$ro_sum" ] && ok blk-read-only || bad blk-read-only "image changed"
fi

# RNG: the virtio driver is the current hw_random source and yields bytes.
cur=$(x cat /sys/class/misc/hw_random/rng_current)
n=$(x sh -c 'head -c 4096 /dev/hwrng | wc -c')
case "$cur" in virtio_rng*) [ "$n" = 4096 ] && ok rng || bad rng "read $n bytes";; *) bad rng "rng_current=$cur";; esac

# Net: the guest has its MAC; host and guest exchange a TCP stream over the tap.
[ "$(x cat /sys/class/net/eth0/address)" = 06:00:0a:00:02:02 ] && ok net-mac || bad net-mac "$(x cat /sys/class/net/eth0/address)"
# The driver took mergeable rx buffers (feature bit 15; sysfs lists bits as 0/1 from bit 0).
bits=$(x cat /sys/class/net/eth0/device/features)
[ "$(echo "$bits" | cut -c16)" = 1 ] && ok net-mrg-rxbuf || bad net-mrg-rxbuf "features $bits"
ip addr add 10.0.2.1/24 dev dsdev0 && ip link set dsdev0 up
x sh -c 'ip addr add 10.0.2.2/24 dev eth0 && ip link set eth0 up'
if x ping -c 1 -W 5 10.0.2.1 >/dev/null; then ok net-ping; else bad net-ping "no reply"; fi
# busybox nc ends a connection when its stdin ends, so the receiving side keeps its stdin open.
dd if=/dev/urandom of=/tmp/payload bs=1M count=4 2>/dev/null
want=$(md5sum </tmp/payload | cut -d' ' -f1)
# Host to guest: the host serves the payload, the guest reads and sums it.
timeout 300 nc -l -p 5001 </tmp/payload &
server=$!
sleep 1
got=$(timeout 300 dsec vm exec $D -- sh -c 'sleep 60 | nc 10.0.2.1 5001 | md5sum' | cut -d' ' -f1)
kill $server 2>/dev/null
[ "$got" = "$want" ] && ok net-tcp-host-to-guest || bad net-tcp-host-to-guest "guest got $got, want $want"
# Guest to host: the guest sends 4 MiB, the host sums what arrives.
# The listener's stdin stays open well past the transfer, which takes tens of seconds on a
# loaded machine (the guest's network stack runs emulated here).
(sleep 600 | timeout 600 nc -l -p 5000 >/tmp/received) &
receiver=$!
sleep 1
x sh -c 'head -c 4194304 /dev/urandom > /tmp/up; md5sum </tmp/up > /tmp/up.sum; nc 10.0.2.1 5000 </tmp/up' >/dev/null 2>&1
up_want=$(x cat /tmp/up.sum | cut -d' ' -f1)
for i in $(seq 1 240); do [ "$(wc -c </tmp/received)" -ge 4194304 ] && break; sleep 1; done
pkill -P $receiver 2>/dev/null; kill $receiver 2>/dev/null
[ -n "$up_want" ] && [ "$(md5sum </tmp/received | cut -d' ' -f1)" = "$up_want" ] \
    && ok net-tcp-guest-to-host || bad net-tcp-guest-to-host "host got $(wc -c </tmp/received) bytes"

kill $vmm 2>/dev/null; wait $vmm 2>/dev/null
grep -q "forbidden system call" $D/vmm.log && bad seccomp "$(cat $D/vmm.log)" || ok no-seccomp-violation
echo "$pass passed, $fail failed"
exit $fail
