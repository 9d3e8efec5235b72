#!/bin/sh
# Runs inside the rig's L1: snapshot, restore and fork of a real Linux guest through
# `dsec vm`. A file, a background process and a shell session started before the snapshot
# must all still be there after the VM is killed and restored (the process still running, the
# session with its cwd and exports); forks each
# answer on their own socket and write privately.
# Prints PASS/FAIL per check and "N passed, N failed"; exit status = failures.
pass=0; fail=0
ok()  { echo "PASS $1"; pass=$((pass+1)); }
bad() { echo "FAIL $1: $2"; fail=$((fail+1)); }
now() { cut -d' ' -f1 /proc/uptime; }
ms() { awk -v a="$1" -v b="$2" 'BEGIN{printf "%.0f", (b-a)*1000}'; }
K=/guest/vmlinux
I=/guest/initramfs.cpio
cd /tmp

t0=$(now)
if ! timeout 300 dsec vm boot /tmp/vm1 --kernel $K --initrd $I --net tap=dsvm1 >/tmp/boot.out 2>&1; then
    bad boot "$(cat /tmp/boot.out)"; tail -20 /tmp/vm1/serial.log /tmp/vm1/vmm.log
    echo "$pass passed, $fail failed"; exit 1
fi
echo "METRIC boot_to_agent_ms $(ms "$t0" "$(now)")"
timeout 60 dsec vm exec /tmp/vm1 -- sh -c 'echo kept > /root/file
(i=0; while :; do i=$((i+1)); echo $i > /tmp/count; sleep 0.1; done) </dev/null >/dev/null 2>&1 &
echo $! > /root/bgpid'
# A persistent shell session (Chronus): its cwd and exports must survive the restore.
sid=$(timeout 60 dsec vm session /tmp/vm1 -- 'cd /tmp && export KEPT_VAR=from-before' | head -1)
sleep 1
before=$(timeout 60 dsec vm exec /tmp/vm1 -- cat /tmp/count)
t0=$(now)
timeout 120 dsec vm snapshot /tmp/vm1 /tmp/snap1 && ok snapshot || bad snapshot "exit $?"
echo "METRIC snapshot_ms $(ms "$t0" "$(now)")"
timeout 60 dsec vm rm /tmp/vm1 >/dev/null && [ ! -e /tmp/vm1 ] && ok kill-original || bad kill-original "vm1 still there"
# The guest clock stops at the snapshot; restore must bring it back to the host's time.
sleep 4

t0=$(now)
timeout 120 dsec vm restore /tmp/snap1 /tmp/vm2 --boot-timeout 60 && ok restore || bad restore "exit $?; $(cat /tmp/vm2/vmm.log 2>/dev/null)"
echo "METRIC restore_to_agent_ms $(ms "$t0" "$(now)")"
[ "$(timeout 60 dsec vm exec /tmp/vm2 -- cat /root/file)" = kept ] && ok file-survives || bad file-survives "file lost"
got=$(timeout 60 dsec vm session /tmp/vm2 --id "$sid" -- 'echo "$(pwd) $KEPT_VAR"')
[ -n "$sid" ] && [ "$got" = "/tmp from-before" ] && ok session-survives || bad session-survives "session '$sid' answered '$got'"
guest_now=$(timeout 60 dsec vm exec /tmp/vm2 -- date +%s); host_now=$(date +%s)
diff=$((guest_now - host_now)); [ $diff -lt 0 ] && diff=$((-diff))
[ $diff -le 2 ] && ok clock-corrected || bad clock-corrected "guest $guest_now vs host $host_now"
pid=$(timeout 60 dsec vm exec /tmp/vm2 -- cat /root/bgpid)
timeout 60 dsec vm exec /tmp/vm2 -- kill -0 "$pid" && ok process-survives || bad process-survives "pid $pid gone"
c1=$(timeout 60 dsec vm exec /tmp/vm2 -- cat /tmp/count); sleep 1; c2=$(timeout 60 dsec vm exec /tmp/vm2 -- cat /tmp/count)
if [ "$c1" -ge "$before" ] 2>/dev/null && [ "$c2" -gt "$c1" ] 2>/dev/null; then
    ok process-keeps-running
else
    bad process-keeps-running "count before=$before after restore=$c1 then $c2"
    timeout 30 dsec vm exec /tmp/vm2 -- sh -c 'cat /sys/devices/system/clocksource/clocksource0/current_clocksource; grep LOC /proc/interrupts; cat /proc/uptime; sleep 1; grep LOC /proc/interrupts; cat /proc/uptime /tmp/count; ps -o pid,stat,args'
fi

t0=$(now)
if timeout 200 dsec vm fork /tmp/snap1 /tmp/child -n 3 --tap-prefix dsfk --first-cid 40 >/tmp/fork.out 2>/tmp/fork.err; then ok fork; else bad fork "$(cat /tmp/fork.out /tmp/fork.err)"; fi
echo "METRIC fork3_to_agents_ms $(ms "$t0" "$(now)")"
# Each child sits on its own tap and its guest interface took the MAC it was given; the
# children answer on new CIDs (40-42), which the guest learns from the transport reset.
macs_ok=1
for i in 0 1 2; do
    want=$(awk -v d=/tmp/child-$i '$1 == d {print $2}' /tmp/fork.out)
    got=$(timeout 60 dsec vm exec /tmp/child-$i -- cat /sys/class/net/eth0/address)
    [ -n "$want" ] && [ "$got" = "$want" ] && [ -e /sys/class/net/dsfk$i ] || { macs_ok=0; echo "child-$i: want MAC '$want', guest has '$got'"; }
done
n=$(awk '{print $2}' /tmp/fork.out | sort -u | wc -l)
[ $macs_ok = 1 ] && [ "$n" = 3 ] && ok forks-own-taps-and-macs || bad forks-own-taps-and-macs "$(cat /tmp/fork.out)"
for i in 0 1 2; do timeout 60 dsec vm exec /tmp/child-$i -- sh -c "echo child-$i > /root/file"; done
private=1
for i in 0 1 2; do [ "$(timeout 60 dsec vm exec /tmp/child-$i -- cat /root/file)" = "child-$i" ] || private=0; done
[ "$(timeout 60 dsec vm exec /tmp/vm2 -- cat /root/file)" = kept ] || private=0
[ $private = 1 ] && ok forks-write-privately || bad forks-write-privately "a child saw another's write"
[ -S /tmp/child-0/vsock.sock ] && [ -S /tmp/child-2/vsock.sock ] && ok forks-own-sockets || bad forks-own-sockets "missing"
r0=$(timeout 60 dsec vm exec /tmp/child-0 -- sh -c 'head -c 16 /dev/urandom | od -An -tx1')
r1=$(timeout 60 dsec vm exec /tmp/child-1 -- sh -c 'head -c 16 /dev/urandom | od -An -tx1')
[ -n "$r0" ] && [ "$r0" != "$r1" ] && ok forks-fresh-entropy || bad forks-fresh-entropy "children read the same random bytes: $r0"

# Forking a running VM: it is paused, snapshotted and resumed; the child answers too.
if timeout 200 dsec vm fork /tmp/vm2 /tmp/live -n 1 --tap-prefix dslive >/tmp/live.out 2>&1 \
    && [ "$(timeout 60 dsec vm exec /tmp/live-0 -- cat /root/file)" = kept ] \
    && [ "$(timeout 60 dsec vm exec /tmp/vm2 -- cat /root/file)" = kept ]; then
    ok fork-running-vm
else
    bad fork-running-vm "$(cat /tmp/live.out)"
fi

for d in /tmp/vm2 /tmp/child-0 /tmp/child-1 /tmp/child-2 /tmp/live-0; do timeout 30 dsec vm rm $d >/dev/null 2>&1; done
echo "$pass passed, $fail failed"
exit $fail
