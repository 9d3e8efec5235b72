#!/bin/sh
# Runs inside L1: QEMU-KVM (-M microvm) boots the guest kernel + initramfs from
# /guest and must see the guest's /init marker. Proves nested KVM works and
# records the QEMU-in-L1 guest boot time (L1 wall clock, QEMU start -> marker).
# Prints PASS/FAIL per check and "N passed, N failed"; exit status = failures.
pass=0; fail=0
ok()  { echo "PASS $1"; pass=$((pass+1)); }
bad() { echo "FAIL $1: $2"; fail=$((fail+1)); }
now() { cut -d' ' -f1 /proc/uptime; }

[ -c /dev/kvm ] && ok kvm-device || bad kvm-device "/dev/kvm missing"
initrd=/guest/initramfs
[ -f "$initrd" ] || initrd=/guest/initramfs.cpio

# boot KERNEL NAME: one QEMU-KVM run; waits for the marker, at most 60 s.
boot() {
    kernel=$1; name=$2; out=/tmp/$name.log
    if [ ! -f "$kernel" ]; then bad "$name" "$kernel missing"; return; fi
    t0=$(now)
    qemu-system-x86_64 -accel kvm -cpu host -m 256 -smp 1 \
        -M microvm,x-option-roms=off,isa-serial=on,rtc=off \
        -nodefaults -no-user-config -nographic -serial stdio -no-reboot \
        -kernel "$kernel" -initrd "$initrd" \
        -append "console=ttyS0 panic=-1 reboot=k quiet tsc=reliable" \
        </dev/null >"$out" 2>&1 &
    qpid=$!
    i=0
    while [ $i -lt 1200 ]; do
        grep -q GUEST-INIT-OK "$out" && break
        kill -0 $qpid 2>/dev/null || break
        sleep 0.05; i=$((i+1))
    done
    t1=$(now)
    # Give the guest 10 s to power off by itself, then make sure QEMU is gone.
    j=0; while kill -0 $qpid 2>/dev/null && [ $j -lt 100 ]; do sleep 0.1; j=$((j+1)); done
    exited=yes; kill -0 $qpid 2>/dev/null && { exited=no; kill -9 $qpid; }
    wait $qpid 2>/dev/null
    if grep -q GUEST-INIT-OK "$out"; then
        ok "$name"
        echo "METRIC ${name}_to_init_s $(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.2f", b-a}')"
        grep GUEST-INIT-OK "$out"
        [ $exited = yes ] && ok "$name-poweroff" || bad "$name-poweroff" "guest did not exit within 10 s"
    else
        bad "$name" "no GUEST-INIT-OK marker; guest output:"
        tail -30 "$out"
    fi
}

boot /guest/vmlinux qemu-kvm-pvh-vmlinux
boot /guest/bzImage qemu-kvm-bzimage
echo "$pass passed, $fail failed"
exit $fail
