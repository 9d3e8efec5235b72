#!/bin/sh
# Runs inside the rig's L1 (real nested /dev/kvm): our VMM and CLI boot the
# guest kernel and run commands in it. Expects in L1: /bin/dsec, /bin/dsec-vmm,
# /guest/vmlinux, /guest/bzImage, /guest/initramfs.cpio (the agent image) and
# optionally /guest/initramfs (tiny busybox one from `rig.sh guest-initramfs`).
# Prints PASS/FAIL per check and "N passed, N failed"; exit status = failures.
pass=0; fail=0
ok()  { echo "PASS $1"; pass=$((pass+1)); }
bad() { echo "FAIL $1: $2"; fail=$((fail+1)); }
now() { cut -d' ' -f1 /proc/uptime; }
T=${FIRST_LIGHT_TIMEOUT:-120}
K=/guest/vmlinux
I=/guest/initramfs.cpio
want_release=$(uname -r)   # L1 runs the same kernel build as the guest

for f in /bin/dsec /bin/dsec-vmm $K $I; do
    [ -e $f ] || bad "input $f" "missing from the L1 initramfs (pass it to rig.sh run)"
done

# 1. The VMM alone boots the busybox guest to /init and exits 0 on i8042 reset.
if [ -f /guest/initramfs ]; then
    t0=$(now)
    timeout $T dsec-vmm --kernel $K --initrd /guest/initramfs --mem-mib 256 \
        --cmdline "console=ttyS0 reboot=k panic=-1 quiet acpi=off i8042.noaux i8042.nomux i8042.nopnp" --serial-stdout >/tmp/vmm.log 2>&1
    rc=$?; t1=$(now)
    if grep -q GUEST-INIT-OK /tmp/vmm.log && [ $rc = 0 ]; then
        ok vmm-boot-busybox
        echo "METRIC dsec_vmm_pvh_boot_and_reset_s $(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.2f", b-a}')"
    else
        bad vmm-boot-busybox "exit=$rc; output:"; tail -30 /tmp/vmm.log
    fi
fi

# run NAME EXPECTED_STATUS EXPECTED_STDOUT CMD...: one `dsec run` check.
run() {
    name=$1; want_rc=$2; want_out=$3; shift 3
    t0=$(now)
    out=$(timeout $T dsec run --backend microvm --kernel "$KERN" --initrd $I -- "$@" 2>/tmp/$name.err)
    rc=$?; t1=$(now)
    if [ "$rc" = "$want_rc" ] && [ "$out" = "$want_out" ]; then
        ok "$name"
        echo "METRIC ${name}_s $(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.2f", b-a}')"
    else
        bad "$name" "exit=$rc (want $want_rc) stdout='$out' (want '$want_out'); stderr:"
        tail -20 /tmp/$name.err
    fi
}

KERN=$K
run uname-pvh 0 "$want_release" uname -r
run exit-status 7 "" sh -c 'exit 7'
run stdout-stderr-apart 0 "out" sh -c 'echo out; echo err >&2'
grep -qx err /tmp/stdout-stderr-apart.err && ok stderr-delivered || bad stderr-delivered "stderr lacks the line 'err'"
# A sandbox gets no nested virtualization (the VMM hides VMX/SVM): no vmx/svm CPU flag and
# no KVM device in the guest, whose kernel has KVM built in (it is also L1's kernel).
run no-nested-virt 0 "flags kvm:0" sh -c \
    'grep -q "^flags" /proc/cpuinfo && echo -n flags; grep "^flags" /proc/cpuinfo | grep -qw -e svm -e vmx && echo -n " svm/vmx"; echo " kvm:$(grep -cw kvm /proc/misc)"'
KERN=/guest/bzImage
[ -f $KERN ] && run uname-bzimage 0 "$want_release" uname -r

echo "$pass passed, $fail failed"
exit $fail
