#!/bin/sh
# Runs inside the rig's L1: the guest kernel's virtio_pmem + nd_pmem drivers against our
# virtio-pmem. /guest/pmem.img is an ext4 image built on the host (run-tests.sh, mkfs.ext4 -d)
# holding hello.txt and blob.bin; /guest/pmem.expect has their contents' checks. Two VMs map it
# read-only and mount it with -o dax,ro; their VMMs must share the file's host pages. A copy is
# mapped writable into the first VM: a file written there and synced (virtio-pmem flush) must
# be in the host file. Prints PASS/FAIL, METRIC lines and "N passed, N failed".
pass=0; fail=0
ok()  { echo "PASS $1"; pass=$((pass+1)); }
bad() { echo "FAIL $1: $2"; fail=$((fail+1)); }
K=/guest/vmlinux
I=/guest/initramfs.cpio
IMG=/guest/pmem.img
. /guest/pmem.expect    # hello=..., blob_md5=..., blob_kib=...
x() { d=$1; shift; timeout 60 dsec vm exec "$d" -- "$@"; }
cp $IMG /tmp/rw.img

start_vm() { # DIR EXTRA-ARGS...: starts a VMM, sets $vmm_pid
    d=$1; shift
    mkdir -p "$d"
    dsec-vmm --kernel $K --initrd $I --cmdline "console=ttyS0 reboot=k panic=-1 quiet" \
        --mem-mib 256 --pmem $IMG,ro "$@" \
        --vsock-uds "$d/vsock.sock" --serial-log "$d/serial.log" 2>"$d/vmm.log" &
    vmm_pid=$!
}
wait_agent() { # DIR PID
    for i in $(seq 1 240); do
        x "$1" true 2>/dev/null && return 0
        kill -0 "$2" 2>/dev/null || break
        sleep 0.5
    done
    tail -20 "$1/serial.log" "$1/vmm.log"
    return 1
}
# Sums a field of /proc/PID/smaps over the mappings of FILE, in KiB.
smaps_kib() { # PID FILE FIELD
    awk -v f="$2" -v k="$3:" '
        /^[0-9a-f]+-[0-9a-f]+ / { m = ($NF == f) }
        m && $1 == k { s += $2 }
        END { print s + 0 }' "/proc/$1/smaps"
}
finish() {
    kill $vm1 $vm2 2>/dev/null; wait $vm1 $vm2 2>/dev/null
    for d in /tmp/pm1 /tmp/pm2; do
        grep -q "forbidden system call" $d/vmm.log 2>/dev/null && bad "seccomp-$d" "$(cat $d/vmm.log)"
    done
    echo "$pass passed, $fail failed"
    exit $fail
}

start_vm /tmp/pm1 --pmem /tmp/rw.img
vm1=$vmm_pid
start_vm /tmp/pm2
vm2=$vmm_pid
wait_agent /tmp/pm1 $vm1 || { bad boot-vm1 "agent never answered"; finish; }
wait_agent /tmp/pm2 $vm2 || { bad boot-vm2 "agent never answered"; finish; }
ok boot

for d in /tmp/pm1 /tmp/pm2; do
    n=${d#/tmp/}
    # nvdimm namespaces are probed asynchronously: the agent can answer before /dev/pmem0 exists.
    if ! x $d sh -c 'for i in $(seq 1 60); do [ -b /dev/pmem0 ] && exit 0; sleep 0.5; done; exit 1'; then
        bad "$n-pmem-device" "no /dev/pmem0"
        x $d sh -c 'dmesg | tail -40; ls /sys/bus/nd/devices /sys/bus/virtio/devices; cat /sys/bus/virtio/devices/*/device; grep -i -e pmem -e persist -e nd /proc/iomem'
        continue
    fi
    ok "$n-pmem-device"
    if ! x $d sh -c 'mkdir -p /mnt/p && mount -t ext4 -o dax,ro /dev/pmem0 /mnt/p'; then
        bad "$n-mount-dax" "$(x $d sh -c 'dmesg | tail -8')"
        continue
    fi
    opts=$(x $d sh -c 'grep " /mnt/p " /proc/mounts')
    case "$opts" in *dax*) ok "$n-mount-dax";; *) bad "$n-mount-dax" "mounted without dax: $opts";; esac
    [ "$(x $d cat /mnt/p/hello.txt)" = "$hello" ] && ok "$n-read-file" || bad "$n-read-file" "hello.txt differs"
    got=$(x $d sh -c 'md5sum /mnt/p/blob.bin' | cut -d' ' -f1)
    [ "$got" = "$blob_md5" ] && ok "$n-read-blob" || bad "$n-read-blob" "md5 $got, want $blob_md5"
done

# Both VMMs map the read-only file MAP_PRIVATE and never write it, so the pages the guests
# read are the same page-cache pages: each VMM's proportional share is about half its RSS.
for p in $vm1 $vm2; do
    if [ ! -r /proc/$p/smaps ]; then
        bad "shared-pages-$p" "no /proc/$p/smaps (L1 kernel without CONFIG_PROC_PAGE_MONITOR?)"
        continue
    fi
    rss=$(smaps_kib $p $IMG Rss); pss=$(smaps_kib $p $IMG Pss)
    # Pages of L1's in-memory root file system count as dirty: shared = clean + dirty.
    sh=$(( $(smaps_kib $p $IMG Shared_Clean) + $(smaps_kib $p $IMG Shared_Dirty) ))
    echo "METRIC pmem_vmm${p}_rss_kib $rss"; echo "METRIC pmem_vmm${p}_pss_kib $pss"
    echo "METRIC pmem_vmm${p}_shared_kib $sh"
    # Both guests read the whole blob: each VMM maps (nearly) all of it, shared, at half share.
    if [ $((rss * 10)) -ge $((blob_kib * 9)) ] && [ $((sh * 10)) -ge $((blob_kib * 9)) ] \
        && [ $((pss * 3)) -lt $((rss * 2)) ]; then
        ok "shared-pages-$p"
    else
        bad "shared-pages-$p" "Rss $rss KiB, Pss $pss KiB, Shared $sh KiB (blob $blob_kib KiB)"
    fi
done

# Writable pmem: a file written through DAX and synced (the driver's flush request) is in the
# host file.
marker="pmem-flush-$(date +%s)-$$"
if x /tmp/pm1 sh -c "for i in \$(seq 1 60); do [ -b /dev/pmem1 ] && break; sleep 0.5; done; mkdir -p /mnt/w && mount -t ext4 -o dax /dev/pmem1 /mnt/w && echo $marker > /mnt/w/new.txt && sync && umount /mnt/w"; then
    grep -q "$marker" /tmp/rw.img && ok rw-flush || bad rw-flush "the guest's file is not in the host image"
else
    bad rw-flush "mount/write/sync failed: $(x /tmp/pm1 sh -c 'dmesg | tail -5')"
fi
cmp -s $IMG /guest/pmem.img && ok ro-unchanged || bad ro-unchanged "read-only image changed"
finish
