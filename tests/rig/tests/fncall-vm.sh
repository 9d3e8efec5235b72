#!/bin/sh
# Runs inside the rig's L1: the VMM FnCall mode through the node daemon (`dsec up`) and
# `dsec fn run --image fncall-vm` (a microVM restored per call from the image's warm template).
# - python and bash calls: right output and exit status;
# - a file written to /tmp by call 1 is absent in call 2;
# - no dsec-vmm of a call is left after it (only the pool's prewarmed, not yet restored VMMs);
# - a call that never ends is killed at its time limit (exit 124) and its VM is gone;
# - METRIC lines: VM call (restore -> result -> VM gone, CLI round trip) p50 over 5 calls,
#   beside a cold microVM `dsec run`, on L1's clock.
# Expects in L1: /bin/dsec, /bin/dsec-vmm, DSEC_HOME=/dsec with kernel/vmlinux,
# images/busybox/initramfs.cpio and images/fncall-vm/{initramfs.cpio,fncall-vm}.
pass=0; fail=0
ok()  { echo "PASS $1"; pass=$((pass+1)); }
bad() { echo "FAIL $1: $2"; fail=$((fail+1)); }
export DSEC_HOME=/dsec DSEC_RUN_DIR=/tmp/dsec-run
export DSEC_ENDPOINT=unix:/tmp/node/edge.sock
T=600
for f in /bin/dsec /bin/dsec-vmm $DSEC_HOME/kernel/vmlinux $DSEC_HOME/images/fncall-vm/initramfs.cpio $DSEC_HOME/images/fncall-vm/fncall-vm; do
    [ -e $f ] || { bad "input $f" "missing from the L1 initramfs"; echo "$pass passed, $fail failed"; exit 1; }
done
now_ms() { read up _ </proc/uptime; echo $(( ${up%.*} * 1000 + 1${up#*.} * 10 - 1000 )); }
# dsec-vmm processes that restored a snapshot (prewarmed ones waiting have no vsock yet).
restored_vmms() {
    n=0
    for d in /proc/[0-9]*; do
        [ "$(cat $d/comm 2>/dev/null)" = dsec-vmm ] || continue
        ls -l $d/fd 2>/dev/null | grep -q 'vsock.sock\|snapshot' && n=$((n + 1))
    done
    echo $n
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

# Nothing of call 1 reaches call 2.
fn --lang python -c 'open("/tmp/left-behind","w").write("x"); print("wrote")' >/tmp/fn.out 2>&1
out=$(fn --lang python -c 'import os; print(os.path.exists("/tmp/left-behind"))' 2>&1)
grep -q wrote /tmp/fn.out && [ "$out" = False ] && ok tmp-file-not-shared || bad tmp-file-not-shared "call 1 '$(cat /tmp/fn.out)', call 2 '$out'"
a=$(fn --lang python -c 'import random; print(random.getrandbits(64))' 2>&1)
b=$(fn --lang python -c 'import random; print(random.getrandbits(64))' 2>&1)
[ -n "$a" ] && [ "$a" != "$b" ] && ok fresh-entropy || bad fresh-entropy "'$a' vs '$b'"

# A call that never ends: killed at its limit, its VM gone.
t0=$(now_ms)
fn --lang python --timeout 2 -c 'while True: pass' >/dev/null 2>/tmp/fn.err; rc=$?
took=$(( $(now_ms) - t0 ))
[ $rc = 124 ] && ok time-limit || bad time-limit "rc $rc after $took ms: $(cat /tmp/fn.err)"
[ "$(restored_vmms)" = 0 ] && ok vm-gone-after-time-limit || bad vm-gone-after-time-limit "$(restored_vmms) restored dsec-vmm left"

# Figures (L1 clock): 5 VM calls, then 3 cold microVM `dsec run`s.
p50() { sort -n | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }
: >/tmp/vm.ms
for i in 1 2 3 4 5; do
    t0=$(now_ms); fn --lang python -c 'print(1+1)' >/dev/null 2>&1; echo $(( $(now_ms) - t0 )) >>/tmp/vm.ms
done
: >/tmp/cold.ms
for i in 1 2 3; do
    t0=$(now_ms); timeout $T dsec run --backend microvm --cold -- true >/dev/null 2>&1; echo $(( $(now_ms) - t0 )) >>/tmp/cold.ms
done
vm=$(p50 </tmp/vm.ms); cold=$(p50 </tmp/cold.ms)
echo "METRIC fncall-vm-call-p50-ms $vm"
echo "METRIC microvm-cold-run-p50-ms $cold"
echo "PERF-FNCALL-VM {\"vm_call_p50_ms\":$vm,\"vm_call_ms\":[$(paste -sd, /tmp/vm.ms)],\"cold_microvm_run_p50_ms\":$cold,\"cold_microvm_run_ms\":[$(paste -sd, /tmp/cold.ms)]}"
printf '%-40s %10s\n' "what (L1 clock)" "p50 ms" "fncall-vm python print(1+1)" "$vm" "dsec run --cold (microVM) true" "$cold"
[ "$(restored_vmms)" = 0 ] && ok nothing-left || bad nothing-left "$(restored_vmms) restored dsec-vmm left"

kill $daemon 2>/dev/null; wait $daemon 2>/dev/null
grep -i "fncall\|FnCall" /tmp/node.log | tail -5
echo "$pass passed, $fail failed"
exit $fail
