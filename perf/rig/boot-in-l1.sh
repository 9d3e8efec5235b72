#!/bin/sh
# Runs inside the rig's L1 (tests/rig/rig.sh run): boots the guest kernel + agent
# initramfs with each VMM named in PERF_ORDER, in that order, and prints one
# `PERF-RIG contender=... index=... ok=... first_byte_ms=... ready_ms=... [error=...]`
# line per boot (L1's CLOCK_MONOTONIC, measured by `dsec-perf rig-inner`).
# `dsec-perf boot` writes the PERF_* settings above this line and reads the output.
# Expects in L1: /bin/dsec-perf, /bin/dsec-vmm, /usr/bin/qemu-system-x86_64 (rig.sh
# --qemu), /guest/vmlinux, /guest/initramfs.cpio, /bin/firecracker when PERF_ORDER names
# firecracker; with PERF_ROOT_DISK also that image
# and /bin/mkfs.ext4 (each boot gets a fresh upper disk, as a sandbox does).
: "${PERF_ORDER:=ours,qemu}"
: "${PERF_MEM_MIB:=256}"
: "${PERF_TIMEOUT_S:=120}"
: "${PERF_CMDLINE_EXTRA:=}"
: "${PERF_ROOT_DISK:=}"

missing=0
disk_inputs=
[ -n "$PERF_ROOT_DISK" ] && disk_inputs="$PERF_ROOT_DISK /bin/mkfs.ext4"
firecracker=
case ",$PERF_ORDER," in *,firecracker,*) firecracker=/bin/firecracker ;; esac
for f in /bin/dsec-perf /bin/dsec-vmm /usr/bin/qemu-system-x86_64 /guest/vmlinux /guest/initramfs.cpio $disk_inputs $firecracker; do
    [ -e "$f" ] || { echo "FAIL input: $f missing from the L1 initramfs"; missing=1; }
done
if [ $missing = 1 ]; then echo "0 passed, 1 failed"; exit 1; fi

echo "PERF-RIG-INFO uptime=$(cut -d' ' -f1 /proc/uptime) vhost_vsock=$([ -e /dev/vhost-vsock ] && echo yes || echo no)"
dsec-perf rig-inner --order "$PERF_ORDER" --vmm /bin/dsec-vmm \
    --qemu /usr/bin/qemu-system-x86_64 --kernel /guest/vmlinux \
    --initrd /guest/initramfs.cpio --mem-mib "$PERF_MEM_MIB" --timeout-s "$PERF_TIMEOUT_S" \
    --cmdline-extra "$PERF_CMDLINE_EXTRA" ${PERF_ROOT_DISK:+--root-disk "$PERF_ROOT_DISK"} \
    ${firecracker:+--firecracker "$firecracker"}
failed=$?
n=$(echo "$PERF_ORDER" | tr ',' '\n' | wc -l)
echo "$((n - failed)) passed, $failed failed"
exit $failed
