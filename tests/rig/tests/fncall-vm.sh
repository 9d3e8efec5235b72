#!/bin/sh
# Runs inside the rig's L1: the VMM FnCall mode through the node daemon (`dsec up`) and
# `dsec fn run --image fncall-vm` (a microVM restored per call from the image's warm template).
# - python and bash calls: right output and exit status; numpy preloaded in the VM;
# - a file written to /tmp by call 1 is absent in call 2;
# - a call's VMM is jailed like the node's microVMs: uid 65534, its own mount namespace and
#   root (no /bin/dsec in it, /dev/kvm there), seccomp filters on; and in a cgroup of its
#   own under the node's (like a microVM sandbox's VMM), removed with the VM;
# - no dsec-vmm of a call is left after it (only the pool's prewarmed, not yet restored VMMs);
# - SandboxFusion's POST /run_code with `"image": "fncall-vm"` runs the call in a worker VM;
# - memory_mib: 200 MB in a 64 MiB call is killed, 100 MB in a 300 MiB call runs, 1024 MiB
#   (above the VM's 512) is refused naming the VM's size;
# - a call that never ends is killed at its time limit (exit 124) and its VM is gone;
# - `dsec-perf fncall-vm`: VM call (restore -> result -> VM gone) beside a container call,
#   `dsec run` (template restore) and a cold microVM (create --cold, exec, rm), a few samples
#   on L1's clock (table + PERF-FNCALL-VM JSON).
# Expects in L1: /bin/dsec, /bin/dsec-vmm, /bin/dsec-perf, DSEC_HOME=/dsec with kernel/vmlinux,
# images/busybox/initramfs.cpio and images/fncall-vm/{initramfs.cpio,fncall-vm}.
# Container workers (the benchmark's container contender) pivot_root into their image, which
# a process whose root is L1's initramfs cannot: the suite re-runs itself in a tmpfs copy of
# L1's root.
if [ -z "${FNVM_IN_COPY:-}" ]; then
    mkdir -p /newroot && mount -t tmpfs -o size=1200m newroot /newroot
    for d in /*; do
        case $d in /proc|/sys|/dev|/tmp|/run|/newroot) mkdir -p /newroot$d ;; *) cp -a $d /newroot/ ;; esac
    done
    mount --rbind /dev /newroot/dev && mount --rbind /sys /newroot/sys
    mount -t proc proc /newroot/proc && mount -t tmpfs -o mode=1777 tmp /newroot/tmp
    mount -t tmpfs run /newroot/run
    cp "$0" /newroot/fncall-vm.sh
    FNVM_IN_COPY=1 chroot /newroot /bin/sh /fncall-vm.sh
    exit $?
fi
pass=0; fail=0
ok()  { echo "PASS $1"; pass=$((pass+1)); }
bad() { echo "FAIL $1: $2"; fail=$((fail+1)); }
export DSEC_HOME=/dsec DSEC_RUN_DIR=/tmp/dsec-run
export DSEC_ENDPOINT=unix:/tmp/node/edge.sock
T=600
for f in /bin/dsec /bin/dsec-vmm /bin/dsec-perf $DSEC_HOME/kernel/vmlinux $DSEC_HOME/images/fncall-vm/initramfs.cpio $DSEC_HOME/images/fncall-vm/fncall-vm; do
    [ -e $f ] || { bad "input $f" "missing from the L1 initramfs"; echo "$pass passed, $fail failed"; exit 1; }
done
now_ms() { read up _ </proc/uptime; echo $(( ${up%.*} * 1000 + 1${up#*.} * 10 - 1000 )); }
# dsec-vmm processes running a restored worker VM: the template's memory file is mapped
# (the pool's prewarmed VMMs, still empty, map nothing of it).
restored_vmm_pids() {
    for d in /proc/[0-9]*; do
        [ "$(cat $d/comm 2>/dev/null)" = dsec-vmm ] || continue
        grep -q 'fncall-vm/.*/snapshot' $d/maps 2>/dev/null && echo ${d#/proc/}
    done
}
restored_vmms() { restored_vmm_pids | wc -l | tr -d ' '; }
# Why the VMM `$1` is not jailed (empty when it is).
not_jailed() {
    uid=$(awk '/^Uid:/ {print $2}' /proc/$1/status)
    [ "$uid" = 65534 ] || echo "uid $uid"
    [ "$(readlink /proc/$1/ns/mnt)" != "$(readlink /proc/self/ns/mnt)" ] || echo "host mount namespace"
    [ ! -e /proc/$1/root/bin/dsec ] && [ -e /proc/$1/root/dev/kvm ] || echo "root is not its jail ($(ls /proc/$1/root/ | tr '\n' ' '))"
    grep -qs '^Seccomp:[[:space:]]*2' /proc/$1/task/*/status || echo "no seccomp filter"
}
# Why the VMM `$1` is not in a group of its own under the node's cgroup (empty when it is).
not_in_node_cgroup() {
    grep -q '/dsec-rig/fncall-vm-' /proc/$1/cgroup || echo "cgroups: $(tr '\n' ' ' </proc/$1/cgroup)"
}
# Groups of VM workers under the node's cgroup that hold no process (left behind).
empty_vm_groups() {
    for g in $(find /sys/fs/cgroup -path '*/dsec-rig/fncall-vm-*' -maxdepth 4 -type d 2>/dev/null); do
        [ -n "$(cat $g/cgroup.procs 2>/dev/null)" ] || echo $g
    done
}
DSEC_LOG=info dsec up --state-dir /tmp/node --default-backend microvm --metrics off \
    --cgroup-name dsec-rig --ready-timeout 120 >>/tmp/node.log 2>&1 &
daemon=$!
i=0
until dsec ls >/dev/null 2>&1 || [ $i -ge 100 ]; do sleep 0.2; i=$((i + 1)); done
dsec ls >/dev/null 2>&1 && ok daemon-up || { bad daemon-up "$(tail -5 /tmp/node.log)"; echo "$pass passed, $fail failed"; exit 1; }
fn() { timeout $T dsec fn run --image fncall-vm "$@"; }

# The first call builds the template (boot, zygote loaded, snapshot), then restores it.
t0=$(now_ms)
out=$(fn --lang python -c 'print(1+1)' 2>/tmp/fn.err); rc=$?
echo "METRIC fncall-vm-first-call-ms $(( $(now_ms) - t0 ))"
[ "$out" = 2 ] && [ $rc = 0 ] && ok python-call || bad python-call "rc $rc out '$out': $(cat /tmp/fn.err; tail -5 /tmp/node.log)"
[ "$(restored_vmms)" = 0 ] && ok vm-gone-after-call || bad vm-gone-after-call "$(restored_vmms) restored dsec-vmm left"
out=$(fn --lang python -c 'import sys; print("err", file=sys.stderr); sys.exit(3)' 2>/tmp/fn.err); rc=$?
[ $rc = 3 ] && grep -q err /tmp/fn.err && ok python-exit-status || bad python-exit-status "rc $rc: $(cat /tmp/fn.err)"
out=$(fn --lang bash -c 'echo "bash $((6*7))"; exit 5' 2>/tmp/fn.err); rc=$?
[ "$out" = "bash 42" ] && [ $rc = 5 ] && ok bash-call || bad bash-call "rc $rc out '$out': $(cat /tmp/fn.err)"

# numpy is in the image, preloaded by the VM's zygote.
out=$(fn --lang python -c 'import sys; pre = "nu" "mpy" in sys.modules; import numpy; print(pre, int(numpy.arange(10).sum()))' 2>/tmp/fn.err); rc=$?
[ "$out" = "True 45" ] && [ $rc = 0 ] && ok numpy-in-vm || bad numpy-in-vm "rc $rc out '$out': $(cat /tmp/fn.err)"

# Nothing of call 1 reaches call 2.
fn --lang python -c 'open("/tmp/left-behind","w").write("x"); print("wrote")' >/tmp/fn.out 2>&1
out=$(fn --lang python -c 'import os; print(os.path.exists("/tmp/left-behind"))' 2>&1)
grep -q wrote /tmp/fn.out && [ "$out" = False ] && ok tmp-file-not-shared || bad tmp-file-not-shared "call 1 '$(cat /tmp/fn.out)', call 2 '$out'"
a=$(fn --lang python -c 'import random; print(random.getrandbits(64))' 2>&1)
b=$(fn --lang python -c 'import random; print(random.getrandbits(64))' 2>&1)
[ -n "$a" ] && [ "$a" != "$b" ] && ok fresh-entropy || bad fresh-entropy "'$a' vs '$b'"

# SandboxFusion's POST /run_code on the node's HTTP entry point picks the VM image with our
# `image` field: the call's kernel command line is the worker VM's.
sf=$(timeout $T wget -q -O - --header 'Content-Type: application/json' \
    --post-data '{"code":"print(\"dsec.fnworker\" in open(\"/proc/cmdline\").read())","language":"python","image":"fncall-vm"}' \
    http://127.0.0.1:7080/run_code 2>&1)
echo "$sf" | grep -q '"status":"Success"' && echo "$sf" | grep -q '"stdout":"True\\n"' && ok sandboxfusion-vm || bad sandboxfusion-vm "$sf"

# memory_mib: a cgroup in the guest bounds the call; above the VM's size it is refused.
out=$(fn --lang python --mem 64 -c 'x = bytearray(200 << 20); print("allocated")' 2>/tmp/fn.err); rc=$?
[ $rc = 137 ] && [ "$out" != allocated ] && ok memory-limit || bad memory-limit "rc $rc out '$out': $(cat /tmp/fn.err)"
# (120 s: touching 100 MB under nested TCG on a loaded host took over the default 10 s,
# and once over 60 s plus the per-call VM restore.)
out=$(fn --lang python --mem 300 --timeout 120 -c 'x = bytearray(100 << 20); print("allocated")' 2>/tmp/fn.err); rc=$?
[ $rc = 0 ] && [ "$out" = allocated ] && ok memory-within-limit || bad memory-within-limit "rc $rc out '$out': $(cat /tmp/fn.err)"
fn --lang python --mem 1024 -c 'print(1)' >/dev/null 2>/tmp/fn.err; rc=$?
[ $rc != 0 ] && grep -q "above the VM worker's 512 MiB" /tmp/fn.err && ok memory-above-vm-refused || bad memory-above-vm-refused "rc $rc: $(cat /tmp/fn.err)"

# The probe sees a call's VM while it runs (so its 0 after a call means something).
fn --lang python --timeout 30 -c 'import time; time.sleep(15); print("slept")' >/tmp/slow.out 2>&1 &
slow=$!
seen=0; i=0; jail_problem="no VMM seen"; cgroup_problem="no VMM seen"
while [ $i -lt 150 ] && [ $seen = 0 ]; do
    for pid in $(restored_vmm_pids); do
        seen=1; jail_problem=$(not_jailed $pid); cgroup_problem=$(not_in_node_cgroup $pid)
    done
    sleep 0.1; i=$((i + 1))
done
wait $slow
[ $seen = 1 ] && grep -q slept /tmp/slow.out && ok vm-seen-during-call || bad vm-seen-during-call "seen $seen, out '$(cat /tmp/slow.out)'"
[ -z "$jail_problem" ] && ok vm-jailed || bad vm-jailed "$jail_problem"
[ -z "$cgroup_problem" ] && ok vm-in-node-cgroup || bad vm-in-node-cgroup "$cgroup_problem"
i=0
while [ -n "$(empty_vm_groups)" ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
[ -z "$(empty_vm_groups)" ] && ok vm-cgroups-removed || bad vm-cgroups-removed "left: $(empty_vm_groups)"
[ "$(restored_vmms)" = 0 ] && ok vm-gone-after-slow-call || bad vm-gone-after-slow-call "$(restored_vmms) restored dsec-vmm left"

# A call that never ends: killed at its limit, its VM gone.
t0=$(now_ms)
fn --lang python --timeout 2 -c 'while True: pass' >/dev/null 2>/tmp/fn.err; rc=$?
took=$(( $(now_ms) - t0 ))
[ $rc = 124 ] && ok time-limit || bad time-limit "rc $rc after $took ms: $(cat /tmp/fn.err)"
[ "$(restored_vmms)" = 0 ] && ok vm-gone-after-time-limit || bad vm-gone-after-time-limit "$(restored_vmms) restored dsec-vmm left"

# Figures (L1 clock): dsec-perf fncall-vm, VM calls beside container calls (the VM image's
# root unpacked as a container image) and cold microVM `dsec run`s.
mkdir -p $DSEC_HOME/images/fncall-lite/rootfs
(cd $DSEC_HOME/images/fncall-lite/rootfs && cpio -id <$DSEC_HOME/images/fncall-vm/initramfs.cpio 2>/dev/null)
if timeout $T dsec-perf fncall-vm --samples 5 --cold-samples 3 --container-image fncall-lite \
        --dsec /bin/dsec --json /tmp/fncall-vm.json >/tmp/perf.out 2>&1; then
    cat /tmp/perf.out
    grep -q '"vm"' /tmp/perf.out && ok perf-fncall-vm || bad perf-fncall-vm "no vm figures: $(tail -5 /tmp/perf.out)"
else
    bad perf-fncall-vm "$(tail -8 /tmp/perf.out)"
fi
[ "$(restored_vmms)" = 0 ] && ok nothing-left || bad nothing-left "$(restored_vmms) restored dsec-vmm left"

kill $daemon 2>/dev/null; wait $daemon 2>/dev/null
grep -i "fncall\|FnCall" /tmp/node.log | tail -5
echo "$pass passed, $fail failed"
exit $fail
