#!/usr/bin/env bash
# The rig suite test.sh runs: every real-Linux-guest test, each in a fresh L1.
#   1. smoke:       QEMU-KVM inside L1 boots our guest kernel (proves the rig itself)
#   2. first-light: our dsec-vmm and `dsec run --backend microvm` in L1
#   3. snapshot:    `dsec vm` snapshot/restore/fork of a Linux guest in L1
#   4. devices:     the guest's own drivers on virtio-blk (2 disks, one read-only), virtio-net
#                   (TCP both ways over a tap), virtio-rng, 2 vCPUs
#   5. balloon:     the guest's virtio_balloon driver: statistics, inflate/deflate on a host
#                   target, free page reporting (the VMM's RSS falls), a restored copy
#   6. debian-image: `dsec run --image debian` in a microVM: read-only erofs root disk plus a
#                   per-sandbox upper disk, python3/bash/git, writes land on the upper disk;
#                   fork through the daemon (each child gets a copy of the upper disk)
#   7. pmem:        the guest's virtio_pmem driver on our virtio-pmem: ext4 -o dax,ro from a
#                   host-built image, two VMs sharing its host pages, flush of a writable one
#   8. node-microvm: `dsec up` in L1 with microVM sandboxes, driven through the CLI's gRPC
#                   client: create, exec, cp both ways, a session, pause/resume, the HTTP entry
#                   point (with the sandbox's token; refused without), fork, adoption by a restarted daemon, delete with nothing left;
#                   every VMM jailed (checked)
#   9. node-templates: template snapshots (built once, restored by creates: own entropy,
#                   host clock; create -> first exec template vs --cold), pause that ends the
#                   VMM and resume (three cycles, files and a process kept; across a kill -9
#                   of the daemon; a session's cwd kept), a corrupted or missing template falls
#                   back to a cold boot, a changed image rebuilds it (the stale one removed),
#                   restore of a named snapshot (`dsec snapshot` / `dsec restore`: files, a
#                   process, own entropy and clock), a full disk fails a pause cleanly
#                   and `dsec-perf templates` (template / cold / resume -> first exec, one SDK client)
#      fncall-vm:   `dsec fn run --image fncall-vm` through the daemon: python and bash calls
#                   in microVMs restored per call (output, exit status, no /tmp file or VM
#                   left, fresh entropy, a time limit, the VMM jailed, memory_mib,
#                   SandboxFusion /run_code with "image"), VM call vs cold microVM p50
#  10. node-network: microVMs on a node with `--net-bridge` in an L1 whose kernel adds
#                   tests/rig/l1-net.config-fragment (bridge, veth, nftables; built once by
#                   l1-net-kernel.sh, guests keep the standard kernel): a tap per booted
#                   microVM on the bridge, default deny, a policy reaches a test host by port
#                   only, the node's API never, a guest posing as another sandbox sends
#                   nothing, nothing left after delete
# Inputs (override with env): DSEC_BIN_DIR (default target/release) holding dsec
# and dsec-vmm; DSEC_AGENT_INITRAMFS (default $DSEC_HOME/images/busybox/initramfs.cpio);
# DSEC_DEBIAN_IMG (default $DSEC_HOME/images/debian/rootfs.img, from images/debian/build.sh).
# Exit status: number of failed suites.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
BIN=${DSEC_BIN_DIR:-$REPO/target/release}
AGENT_IMG=${DSEC_AGENT_INITRAMFS:-${DSEC_HOME:-/var/lib/dsec}/images/busybox/initramfs.cpio}
DEBIAN_IMG=${DSEC_DEBIAN_IMG:-${DSEC_HOME:-/var/lib/dsec}/images/debian/rootfs.img}

kdir=$("$REPO/guest-kernel/build.sh") || { echo "rig: error: guest kernel build failed" >&2; exit 1; }
tiny=$("$HERE/rig.sh" guest-initramfs)
failed=0
failed_names=()
recap_dir=$(mktemp -d)
trap 'rm -rf "$recap_dir"' EXIT
# rig_suite NAME RIG_ARGS...: one rig.sh run, its output also kept so that the end of this
# script can repeat the FAIL, STALL and TIMEOUT lines of every failed suite (a CI log often
# shows only its tail).
rig_suite() {
    local name=$1; shift
    "$HERE/rig.sh" "$@" 2>&1 | tee "$recap_dir/$name.log"
    local rc=${PIPESTATUS[0]}
    if ((rc != 0)); then
        failed=$((failed + 1)); failed_names+=("$name (exit $rc)")
    fi
    return 0
}

echo "==> rig smoke (QEMU-KVM in L1)"
rig_suite smoke smoke "$tiny"

echo "==> rig first-light (dsec-vmm + dsec run in L1)"
missing=()
for f in "$BIN/dsec" "$BIN/dsec-vmm" "$AGENT_IMG"; do [[ -e $f ]] || missing+=("$f"); done
if ((${#missing[@]})); then
    echo "FAIL first-light: missing ${missing[*]} (run ./setup.sh --no-run, or set DSEC_BIN_DIR / DSEC_AGENT_INITRAMFS)"
    failed=$((failed + 1)); failed_names+=("first-light (inputs missing)")
else
    rig_suite first-light run "$HERE/tests/first-light.sh" \
        "$BIN/dsec=/bin/dsec" "$BIN/dsec-vmm=/bin/dsec-vmm" \
        "$kdir/vmlinux=/guest/vmlinux" "$kdir/bzImage=/guest/bzImage" \
        "$AGENT_IMG=/guest/initramfs.cpio" "$tiny=/guest/initramfs"
fi
echo "==> rig snapshot (dsec vm snapshot/restore/fork of a Linux guest in L1)"
if ((${#missing[@]} == 0)); then
    rig_suite snapshot run "$HERE/tests/snapshot.sh" \
        "$BIN/dsec=/bin/dsec" "$BIN/dsec-vmm=/bin/dsec-vmm" \
        "$kdir/vmlinux=/guest/vmlinux" "$AGENT_IMG=/guest/initramfs.cpio"
fi
echo "==> rig devices (Linux drivers on our virtio-blk/net/rng, 2 vCPUs, in L1)"
if ((${#missing[@]} == 0)); then
    rig_suite devices run "$HERE/tests/devices.sh" \
        "$BIN/dsec=/bin/dsec" "$BIN/dsec-vmm=/bin/dsec-vmm" \
        "$kdir/vmlinux=/guest/vmlinux" "$AGENT_IMG=/guest/initramfs.cpio"
fi
echo "==> rig balloon (Linux virtio_balloon: stats, inflate/deflate, free page reporting, restore)"
if ((${#missing[@]} == 0)); then
    rig_suite balloon run "$HERE/tests/balloon.sh" \
        "$BIN/dsec=/bin/dsec" "$BIN/dsec-vmm=/bin/dsec-vmm" \
        "$kdir/vmlinux=/guest/vmlinux" "$AGENT_IMG=/guest/initramfs.cpio"
fi
echo "==> rig debian-image (dsec run --image debian in a microVM, in L1)"
if ((${#missing[@]})); then
    :
elif [[ ! -f $DEBIAN_IMG ]]; then
    echo "FAIL debian-image: $DEBIAN_IMG missing (run images/debian/build.sh --install, or ./setup.sh --no-run)"
    failed=$((failed + 1)); failed_names+=("debian-image (image missing)")
else
    # mke2fs formats the per-sandbox upper disk (the edge runs mkfs.ext4).
    mke2fs_bin=$(PATH=$PATH:/usr/sbin:/sbin command -v mke2fs) || mke2fs_bin=/sbin/mke2fs
    RIG_MEM=${RIG_MEM:-3072} RIG_TIMEOUT=${RIG_TIMEOUT:-900} rig_suite debian-image run "$HERE/tests/debian-image.sh" \
        "$BIN/dsec=/bin/dsec" "$BIN/dsec-vmm=/bin/dsec-vmm" "$mke2fs_bin=/bin/mkfs.ext4" \
        /etc/mke2fs.conf=/etc/mke2fs.conf "$kdir/vmlinux=/dsec/kernel/vmlinux" \
        "$AGENT_IMG=/dsec/images/debian/initramfs.cpio" "$DEBIAN_IMG=/dsec/images/debian/rootfs.img"
fi
echo "==> rig pmem (Linux virtio_pmem on our virtio-pmem: DAX mount, shared pages, flush, in L1)"
if ((${#missing[@]} == 0)); then
    pm=$(mktemp -d)
    if "$HERE/pmem-image.sh" "$pm"; then
        rig_suite pmem run "$HERE/tests/pmem.sh" \
            "$BIN/dsec=/bin/dsec" "$BIN/dsec-vmm=/bin/dsec-vmm" \
            "$kdir/vmlinux=/guest/vmlinux" "$AGENT_IMG=/guest/initramfs.cpio" \
            "$pm/pmem.img=/guest/pmem.img" "$pm/pmem.expect=/guest/pmem.expect"
    else
        failed=$((failed + 1)); failed_names+=("pmem (image build failed)")
    fi
    rm -rf "$pm"
fi
echo "==> rig node-microvm (the node daemon's API on microVMs through the dsec CLI, in L1)"
if ((${#missing[@]} == 0)); then
    rig_suite node-microvm run "$HERE/tests/node-microvm.sh" \
        "$BIN/dsec=/bin/dsec" "$BIN/dsec-vmm=/bin/dsec-vmm" \
        "$kdir/vmlinux=/dsec/kernel/vmlinux" "$AGENT_IMG=/dsec/images/busybox/initramfs.cpio"
fi
echo "==> rig node-templates (template snapshots and pause to disk through the daemon, in L1)"
if ((${#missing[@]} == 0)); then
    rig_suite node-templates run "$HERE/tests/node-templates.sh" \
        "$BIN/dsec=/bin/dsec" "$BIN/dsec-vmm=/bin/dsec-vmm" "$BIN/dsec-perf=/bin/dsec-perf" \
        "$kdir/vmlinux=/dsec/kernel/vmlinux" "$AGENT_IMG=/dsec/images/busybox/initramfs.cpio"
fi
echo "==> rig fncall-vm (FnCall calls in microVMs restored per call, through the daemon, in L1)"
FNVM_IMG=${DSEC_HOME:-/var/lib/dsec}/images/fncall-vm
if ((${#missing[@]} == 0)); then
    if [[ -e $FNVM_IMG/initramfs.cpio && -e $FNVM_IMG/fncall-vm ]]; then
        rig_suite fncall-vm run "$HERE/tests/fncall-vm.sh" \
            "$BIN/dsec=/bin/dsec" "$BIN/dsec-vmm=/bin/dsec-vmm" "$BIN/dsec-perf=/bin/dsec-perf" \
            "$kdir/vmlinux=/dsec/kernel/vmlinux" "$AGENT_IMG=/dsec/images/busybox/initramfs.cpio" \
            "$FNVM_IMG/initramfs.cpio=/dsec/images/fncall-vm/initramfs.cpio" \
            "$FNVM_IMG/fncall-vm=/dsec/images/fncall-vm/fncall-vm"
    else
        echo "FAIL fncall-vm: $FNVM_IMG not installed (images/fncall-vm/build.sh --install; setup.sh does it)"
        failed=$((failed + 1)); failed_names+=("fncall-vm (image missing)")
    fi
fi
echo "==> rig node-network (microVM taps, policies and the node's isolation, in an L1 with nftables)"
if ((${#missing[@]} == 0)); then
    if l1net=$("$HERE/l1-net-kernel.sh"); then
        RIG_KERNEL=$l1net rig_suite node-network run "$HERE/tests/node-network.sh" \
            "$BIN/dsec=/bin/dsec" "$BIN/dsec-vmm=/bin/dsec-vmm" \
            "$(command -v ip)=/usr/sbin/ip" "$(command -v nft)=/usr/sbin/nft" \
            "$(command -v conntrack)=/usr/sbin/conntrack" \
            "$kdir/vmlinux=/dsec/kernel/vmlinux" "$AGENT_IMG=/dsec/images/busybox/initramfs.cpio"
    else
        echo "FAIL node-network: tests/rig/l1-net-kernel.sh could not build the L1 kernel"
        failed=$((failed + 1)); failed_names+=("node-network (L1 kernel build failed)")
    fi
fi
echo "rig suites failed: $failed"
for name in "${failed_names[@]}"; do
    echo "rig: FAILED suite $name"
    log=$recap_dir/${name%% *}.log
    [[ -f $log ]] && grep -a -E '^(FAIL |rig: (STALL|TIMEOUT|L1 ended))' "$log" | head -20 | sed 's/^/    /'
done
exit "$failed"
