#!/bin/sh
# Runs inside the rig's L1: microVM template snapshots and pause that frees memory, through
# the node daemon (`dsec up`, every VMM jailed) and the `dsec` CLI.
# - the first create builds the image's template; creates restore it and run commands; two
#   sandboxes from one template differ in /dev/urandom, have the host's clock and are named
#   after their ids (`hostname`; a fork child too); the create's env is seen by the first exec;
#   `dsec vm status` on a sandbox directory reports KVM's counters (nested page faults);
# - create -> first exec, template vs --cold, and a burst of 4 concurrent creates (METRIC lines);
#   the same and pause -> resume -> first exec through one SDK client (`dsec-perf templates`);
# - pause ends the sandbox's VMM (no dsec-vmm left for it); resume brings back files and a
#   background process; three pause/resume cycles with writes between them (the agent's
#   connections from before each pause closed, the daemon's first connection accepted);
#   pause -> resume -> first exec (METRIC); later resumes take a prewarmed VMM of the pool;
#   each pause writes only what differs from the template (a diff under 16 MiB, the
#   template's files linked in as its base; the node's /metrics counts them as over_base,
#   not full); a sandbox paused over a template resumes after
#   that template was rebuilt and removed;
# - a paused sandbox survives kill -9 of the daemon and a restart, then resumes;
# - a corrupted template falls back to a cold boot with a warning, and is built again.
# - restore of a named snapshot (`dsec snapshot`, `dsec restore`): new sandboxes with the
#   source's files and processes (also after the source is deleted), each with its own id,
#   entropy, the host's clock and private writes;
# - creates are served by the pool of prewarmed VMMs once it is started, and it refills;
# - a session's cwd survives the three pause/resume cycles;
# - a missing template memory file falls back to a cold boot; a changed image (new mtime)
#   builds a new template and removes the stale one;
# - a full disk during pause (the snapshot dir on a 4 MiB tmpfs) fails the pause cleanly
#   and the sandbox keeps running.
# Expects in L1: /bin/dsec, /bin/dsec-vmm, /bin/dsec-perf and DSEC_HOME=/dsec holding kernel/vmlinux and
# images/busybox/initramfs.cpio.
# Prints PASS/FAIL per check, METRIC lines and "N passed, N failed"; exit status = failures.
pass=0; fail=0
ok()  { echo "PASS $1"; pass=$((pass+1)); }
bad() { echo "FAIL $1: $2"; fail=$((fail+1)); }
export DSEC_HOME=/dsec DSEC_RUN_DIR=/tmp/dsec-run
export DSEC_ENDPOINT=unix:/tmp/node/edge.sock
T=300
for f in /bin/dsec /bin/dsec-vmm /bin/dsec-perf $DSEC_HOME/kernel/vmlinux $DSEC_HOME/images/busybox/initramfs.cpio; do
    [ -e $f ] || { bad "input $f" "missing from the L1 initramfs"; echo "$pass passed, $fail failed"; exit 1; }
done
# L1's clock in ms (10 ms steps).
now_ms() { read up _ </proc/uptime; echo $(( ${up%.*} * 1000 + 1${up#*.} * 10 - 1000 )); }
start_daemon() {
    DSEC_LOG=info dsec up --state-dir /tmp/node --default-backend microvm --metrics 127.0.0.1:9464 \
        --http 127.0.0.1:7080 --cgroup-name dsec-rig --ready-timeout 120 >>/tmp/node.log 2>&1 &
    daemon=$!
    i=0
    until dsec ls >/dev/null 2>&1 || [ $i -ge 100 ]; do sleep 0.2; i=$((i + 1)); done
}
# dsec-vmm processes whose command line names sandbox $1, or that its pid file names (a
# VMM taken from the prewarmed pool is named after the pool) and their children.
vmms_of() {
    n=0
    vpid=$(cat /tmp/node/sandboxes/$1/pid 2>/dev/null)
    for d in /proc/[0-9]*; do
        [ "$(cat $d/comm 2>/dev/null)" = dsec-vmm ] || continue
        if tr '\0' ' ' <$d/cmdline 2>/dev/null | grep -q "$1"; then n=$((n + 1)); continue; fi
        [ -n "$vpid" ] || continue
        ppid=$(sed 's/.*) [A-Za-z] \([0-9]*\).*/\1/' $d/stat 2>/dev/null)
        [ "${d#/proc/}" = "$vpid" ] || [ "$ppid" = "$vpid" ] && n=$((n + 1))
    done
    echo $n
}
# Prewarmed VMMs of the pool whose VM shell is built (their control socket is there).
pool_ready() { ls /tmp/node/vmm-pool/*/api.sock 2>/dev/null | wc -l; }
start_daemon
dsec ls >/dev/null 2>&1 && ok daemon-up || { bad daemon-up "$(tail -5 /tmp/node.log)"; echo "$pass passed, $fail failed"; exit 1; }

# The first create builds the template, then restores it.
a=$(timeout $T dsec create --backend microvm --mem 128 2>/tmp/create.err)
out=$(timeout $T dsec exec $a -- cat /proc/1/comm)
[ -n "$a" ] && [ "$out" = init ] && ok template-create-exec || bad template-create-exec "id '$a', out '$out': $(cat /tmp/create.err)"
[ "$(grep -c 'template snapshot built' /tmp/node.log)" = 1 ] && ok template-built \
    || bad template-built "$(grep -i template /tmp/node.log | tail -3)"
b=$(timeout $T dsec create --backend microvm --mem 128 2>>/tmp/create.err)
[ "$(grep -c 'restored from the template snapshot' /tmp/node.log)" = 2 ] && ok template-restored \
    || bad template-restored "$(grep -i template /tmp/node.log | tail -3)"
[ "$(grep -c 'template snapshot built' /tmp/node.log)" = 1 ] && ok template-reused || bad template-reused "built again"
ls -d /tmp/node/templates/*/snapshot >/dev/null 2>&1 && ok template-on-disk || bad template-on-disk "$(ls -R /tmp/node/templates | head)"
# KVM's own counters of a sandbox's (jailed) VMM through its control socket: the restored
# guest took nested page faults for what the create and first exec touched.
vs=$(timeout $T dsec vm status /tmp/node/sandboxes/$a 2>&1)
pf=$(echo "$vs" | grep -o '"pf_taken":[0-9]*' | cut -d: -f2)
echo "METRIC template_sandbox_pf_taken ${pf:-none}"
[ "${pf:-0}" -gt 0 ] && echo "$vs" | grep -q '"state":"running"' && ok vm-status-kvm-counters \
    || bad vm-status-kvm-counters "$vs"

# create -> first exec, template vs cold, and pause -> resume -> first exec through one SDK
# client and connection (no CLI process per step): `dsec-perf templates` (table, ratios,
# goals, PERF-TEMPLATES JSON). It runs first, in a young L1: later the rig's translated-code
# cache fills and flushes (rig.sh), and timings across a flush are not comparable.
# The rig reports its translation cache at each mark, so a flush inside the window shows.
# Kernel messages stay off the console meanwhile (still in dmesg): one written at the same
# time as a mark once cost the mark a byte, and each costs L1 an emulated UART's time.
dmesg -n 1
echo "RIG-MARK perf-templates start"; sleep 2
perf_ok=0
timeout $T dsec-perf templates --samples 5 --json /tmp/templates.json >/tmp/perf.out 2>&1 && perf_ok=1
echo "RIG-MARK perf-templates end"
dmesg -n 4  # what `quiet` set
if [ $perf_ok = 1 ]; then
    cat /tmp/perf.out
    grep -q '"template"' /tmp/perf.out && ! grep -q '"error":"' /tmp/perf.out \
        && ok perf-templates || bad perf-templates "samples missing or failed: $(grep -o '"error":"[^"]*' /tmp/perf.out | head -3)"
else
    bad perf-templates "$(tail -8 /tmp/perf.out)"
fi

# Two sandboxes of one template: their own entropy, the host's clock, private writes.
ra=$(timeout $T dsec exec $a -- sh -c 'head -c 32 /dev/urandom | od -An -tx1 | tr -d " \n"')
rb=$(timeout $T dsec exec $b -- sh -c 'head -c 32 /dev/urandom | od -An -tx1 | tr -d " \n"')
[ ${#ra} = 64 ] && [ "$ra" != "$rb" ] && ok template-random-differs || bad template-random-differs "'$ra' vs '$rb'"
clocks=""
for s in $a $b; do
    before=$(date +%s); guest=$(timeout $T dsec exec $s -- date +%s); after=$(date +%s)
    [ "$guest" -ge $((before - 1)) ] && [ "$guest" -le $((after + 1)) ] && clocks="$clocks 0" \
        || clocks="$clocks guest=$guest,host=$before..$after"
done
[ "$clocks" = " 0 0" ] && ok template-clock || bad template-clock "clocks outside the host's +-1 s:$clocks"
timeout $T dsec exec $a -- sh -c 'echo a >/root/who'
timeout $T dsec exec $b -- sh -c 'echo b >/root/who'
[ "$(timeout $T dsec exec $a -- cat /root/who)" = a ] && [ "$(timeout $T dsec exec $b -- cat /root/who)" = b ] \
    && ok template-private-writes || bad template-private-writes "files mixed up"
# Each sandbox is named after its id (the template's guest was snapshotted as another).
ha=$(timeout $T dsec exec $a -- hostname); hb=$(timeout $T dsec exec $b -- hostname)
[ "$ha" = "$a" ] && [ "$hb" = "$b" ] && ok template-hostname || bad template-hostname "'$ha' for $a, '$hb' for $b"
# The create's env reaches a template-restored guest through its refresh (the node does not
# add it to execs of such a sandbox): the first exec sees it.
ev=$(timeout $T dsec create --backend microvm --mem 128 --env PROBE=from-create 2>>/tmp/create.err)
eo=$(timeout $T dsec exec $ev -- sh -c 'echo $PROBE')
[ "$eo" = from-create ] && grep -q '"env_in_guest": true' /tmp/node/sandboxes/$ev/meta.json \
    && [ "$(grep -c 'restored from the template snapshot' /tmp/node.log)" -ge 3 ] \
    && ok template-env || bad template-env "'$eo' for $ev: $(grep env /tmp/node/sandboxes/$ev/meta.json)"
timeout $T dsec rm $ev >/dev/null 2>&1
# The prewarmed VMM pool: the first restore of a shape starts its pool (2 VMMs), later
# creates take one (the hostname check above ran in one) and it refills in the background.
i=0; until [ "$(pool_ready)" -ge 2 ] || [ $i -ge 150 ]; do sleep 0.2; i=$((i + 1)); done
served=$(grep -c 'restored into a prewarmed VMM' /tmp/node.log)
pb=$(timeout $T dsec create --backend microvm --mem 128 2>>/tmp/create.err)
pout=$(timeout $T dsec exec $pb -- hostname)
i=0; until [ "$(pool_ready)" -ge 2 ] || [ $i -ge 150 ]; do sleep 0.2; i=$((i + 1)); done
# (Pooled VMMs build at nice 19, so the creates above may have found none ready yet.)
[ "$(grep -c 'restored into a prewarmed VMM' /tmp/node.log)" = $((served + 1)) ] \
    && [ "$pout" = "$pb" ] && [ "$(pool_ready)" = 2 ] && [ "$(vmms_of $pb)" -ge 1 ] \
    && ok vmm-pool-serves-and-refills \
    || bad vmm-pool-serves-and-refills "served before $served, '$pout' for $pb, $(pool_ready) ready, $(vmms_of $pb) VMMs: $(grep -i 'prewarm' /tmp/node.log | tail -3)"
timeout $T dsec rm $pb >/dev/null 2>&1
timeout $T dsec rm $b >/dev/null 2>&1

# Restore of a named snapshot into new sandboxes (Create.from_snapshot), after the source is gone.
src=$(timeout $T dsec create --backend microvm --mem 128 2>>/tmp/create.err)
timeout $T dsec exec $src -- sh -c 'echo from-source >/root/snapfile
    setsid sleep 100000 </dev/null >/dev/null 2>&1 & echo $! >/root/snap-bg.pid' >/dev/null
snap=$(timeout $T dsec snapshot $src 2>/tmp/snap.err)
timeout $T dsec exec $src -- sh -c 'echo changed-after-the-snapshot >/root/snapfile'
timeout $T dsec rm $src >/dev/null 2>&1
t0=$(now_ms)
r1=$(timeout $T dsec restore $snap 2>>/tmp/create.err)
f1=$(timeout $T dsec exec $r1 -- cat /root/snapfile)
t1=$(now_ms)
echo "METRIC restore_snapshot_first_exec_ms $((t1 - t0))"
r2=$(timeout $T dsec restore $snap 2>>/tmp/create.err)
grep -o 'restored from a named snapshot.*' /tmp/node.log | tail -2
f2=$(timeout $T dsec exec $r2 -- cat /root/snapfile)
[ -n "$snap" ] && [ -n "$r1" ] && [ -n "$r2" ] && [ "$r1" != "$r2" ] && [ "$f1" = from-source ] && [ "$f2" = from-source ] \
    && [ "$(grep -c 'restored from a named snapshot' /tmp/node.log)" = 2 ] \
    && ok restore-snapshot-files || bad restore-snapshot-files "snap '$snap' $(cat /tmp/snap.err), ids '$r1' '$r2', files '$f1' '$f2': $(tail -3 /tmp/create.err)"
bgp=$(timeout $T dsec exec $r1 -- cat /root/snap-bg.pid)
timeout $T dsec exec $r1 -- sh -c "kill -0 $bgp" && timeout $T dsec exec $r2 -- sh -c "kill -0 $bgp" \
    && ok restore-snapshot-process || bad restore-snapshot-process "background process $bgp is not in both"
timeout $T dsec inspect $r1 | grep -q '"memory_mib": 128' && ok restore-snapshot-shape \
    || bad restore-snapshot-shape "$(timeout $T dsec inspect $r1 | grep memory)"
ra=$(timeout $T dsec exec $r1 -- sh -c 'head -c 32 /dev/urandom | od -An -tx1 | tr -d " \n"')
rb=$(timeout $T dsec exec $r2 -- sh -c 'head -c 32 /dev/urandom | od -An -tx1 | tr -d " \n"')
before=$(date +%s); guest=$(timeout $T dsec exec $r2 -- date +%s); after=$(date +%s)
timeout $T dsec exec $r1 -- sh -c 'echo one >/root/snapfile'
[ ${#ra} = 64 ] && [ "$ra" != "$rb" ] && [ "$guest" -ge $((before - 1)) ] && [ "$guest" -le $((after + 1)) ] \
    && [ "$(timeout $T dsec exec $r2 -- cat /root/snapfile)" = from-source ] \
    && ok restore-snapshot-identity || bad restore-snapshot-identity "random '$ra' vs '$rb', clock $guest in $before..$after"
out=$(timeout $T dsec restore /tmp/nowhere 2>&1)
case $out in *sandbox.json*) ok restore-bad-snapshot-refused ;; *) bad restore-bad-snapshot-refused "$out" ;; esac
timeout $T dsec rm $r1 $r2 >/dev/null 2>&1
rm -rf "$(dirname "$snap")"

# create -> first exec, template vs cold, alternating; then template restores through
# userfaultfd (DSEC_TEMPLATE_MEMORY=lazy, daemon restarted; the sandbox $a is adopted).
sample() { # KIND [--cold]
    t0=$(now_ms)
    s=$(timeout $T dsec create --backend microvm --mem 128 $2 2>>/tmp/create.err)
    t1=$(now_ms)
    timeout $T dsec exec $s -- true
    t2=$(now_ms)
    echo "METRIC create_${1}_ms $((t1 - t0))"
    echo "METRIC create_first_exec_${1}_ms $((t2 - t0))"
    timeout $T dsec rm $s >/dev/null 2>&1
}
for i in 1 2 3; do sample cold --cold; sample template; done
# The daemon's own create time (request in -> agent answering), without the CLI's, and
# its steps: admission, the backend (pool handover, VMM restore, agent, refresh), register.
grep -o 'create done.*' /tmp/node.log | tail -6
grep -o -e 'create steps.*' -e 'restored into a prewarmed VMM.*' -e 'restored guest refreshed.*' /tmp/node.log \
    | sed 's/\x1b\[[0-9;]*m//g' | tail -15
t0=$(now_ms); timeout $T dsec exec $a -- true; t1=$(now_ms)
echo "METRIC exec_running_sandbox_ms $((t1 - t0))"
# A burst of 4 concurrent creates (`dsec create -n 4`), cold then template: wall time, how
# many were made, creations per second x100.
burst() { # KIND [--cold]
    t0=$(now_ms)
    ids=$(timeout $T dsec create --backend microvm --mem 128 -n 4 $2 2>>/tmp/create.err)
    t1=$(now_ms)
    n=$(echo "$ids" | grep -c sb-)
    echo "METRIC burst4_${1}_ms $((t1 - t0))"
    echo "METRIC burst4_${1}_created $n"
    echo "METRIC burst4_${1}_creations_per_s_x100 $((n * 100000 / (t1 - t0 + 1)))"
    timeout $T dsec rm $ids >/dev/null 2>&1
}
burst cold --cold
burst template
# A fork's parent pause window, VMM-side (the snapshot reply's paused_ms), 1 GiB guest.
big=$(timeout $T dsec create --backend microvm --mem 1024 --cold 2>>/tmp/create.err)
timeout $T dsec exec $big -- sh -c 'echo parent >/root/p'
kid=$(timeout $T dsec fork $big 2>>/tmp/create.err | grep -o 'sb-[a-z0-9]*' | head -1)
win=$(grep -o 'snapshot written.*' /tmp/node.log | tail -1 | tr -d '\033' | sed 's/\[[0-9;]*m//g')
echo "fork of a 1 GiB guest: $win"
echo "METRIC fork_parent_paused_ms_1g $(echo "$win" | grep -o 'paused_ms=[0-9.]*' | cut -d= -f2)"
# Where that pause went (vCPU pause, state read, last dirty set, fork...).
for step in pause state prepare dirty_log write fork resume; do
    echo "METRIC fork_parent_step_${step}_ms_1g $(echo "$win" | grep -o "step_${step}_ms=[0-9.]*" | cut -d= -f2)"
done
echo "METRIC fork_parent_final_pages_1g $(echo "$win" | grep -o 'final_pages=[0-9]*' | cut -d= -f2)"
echo "METRIC fork_parent_complete_ms_1g $(echo "$win" | grep -o 'complete_ms=[0-9.]*' | cut -d= -f2)"
[ -n "$kid" ] && [ "$(timeout $T dsec exec $kid -- cat /root/p)" = parent ] \
    && [ "$(timeout $T dsec exec $kid -- hostname)" = "$kid" ] && [ "$(timeout $T dsec exec $big -- hostname)" = "$big" ] \
    && ok fork-1g-child || bad fork-1g-child "child '$kid' of '$big' (files, hostnames)"
timeout $T dsec rm $big $kid >/dev/null 2>&1
kill $daemon; wait $daemon 2>/dev/null
export DSEC_TEMPLATE_MEMORY=lazy
start_daemon
for i in 1 2 3; do sample template_lazy; done
kill $daemon; wait $daemon 2>/dev/null
unset DSEC_TEMPLATE_MEMORY
start_daemon
grep -o 'restored from the template snapshot.*' /tmp/node.log | tail -7

# Pause that frees memory: three cycles, writes between them, a background process kept.
timeout $T dsec exec $a -- sh -c 'setsid sleep 100000 </dev/null >/dev/null 2>&1 & echo $! >/root/bg.pid' >/dev/null
bg=$(timeout $T dsec exec $a -- cat /root/bg.pid)
# A session kept open across the cycles (fed through a FIFO); its cwd must survive each.
mkfifo /tmp/sess.in
dsec shell $a </tmp/sess.in >/tmp/sess.out 2>/dev/null &
sess=$!
exec 7>/tmp/sess.in
echo 'mkdir -p /root/deep/er && cd /root/deep/er && echo cwd-set' >&7
# Waits until the session printed line $1.
sess_wait() { i=0; until grep -qx "$1" /tmp/sess.out || [ $i -ge 150 ]; do sleep 0.2; i=$((i + 1)); done; grep -qx "$1" /tmp/sess.out; }
sess_wait cwd-set || bad session-open "$(cat /tmp/sess.out)"
sessions=0
cycles=0
# Sockets the agent holds: a resume resets the guest's connections from before the pause,
# and each must close (they once stayed open forever, one more per cycle).
agent_sockets() { timeout $T dsec exec $a -- sh -c 'ls -l /proc/1/fd | grep -c socket:'; }
sockets_before=$(agent_sockets)
# A template-created sandbox's pause writes only what differs from its template: under an
# eighth of the 128 MiB guest (a full snapshot of it was ~34 MB), with the template's files
# linked in as its base.
over_base=0
for i in 1 2 3; do
    timeout $T dsec exec $a -- sh -c "echo cycle-$i >/root/f$i"
    timeout $T dsec pause $a >/dev/null || { bad "pause-$i" "refused"; break; }
    left=$(vmms_of $a)
    [ "$left" = 0 ] || bad "pause-$i-ends-vmm" "$left dsec-vmm processes still name $a"
    # What the paused sandbox holds instead: its snapshot on disk.
    snapdir=$(sed -n 's/.*"suspended": "\(.*\)".*/\1/p' /tmp/node/sandboxes/$a/meta.json)
    # Its own memory file (base/ holds links to the template's: no extra disk).
    own_kib=$(du -sk "$snapdir/memory" | cut -f1)
    echo "METRIC paused_snapshot_disk_kib $own_kib"
    [ -e "$snapdir/base/memory" ] && [ "$own_kib" -lt 16384 ] && over_base=$((over_base + 1))
    # Host memory the paused sandbox holds: the RSS of whatever is left in its cgroup, and the
    # cgroup's own charge where L1 has the memory controller (the snapshot's page cache is
    # dropped after the pause; in L1 its directory is on tmpfs, so there it is RAM anyway).
    cg=$(find /sys/fs/cgroup -path "*/dsec-rig/$a" -maxdepth 3 -type d 2>/dev/null | head -1)
    rss=0
    for p in $(cat $cg/cgroup.procs 2>/dev/null); do
        r=$(awk '/^VmRSS/{print $2}' /proc/$p/status 2>/dev/null); rss=$((rss + ${r:-0}))
    done
    echo "METRIC paused_sandbox_rss_kib $rss"
    [ -r "$cg/memory.current" ] && echo "METRIC paused_cgroup_memory_kib $(( $(cat $cg/memory.current) / 1024 ))"
    t0=$(now_ms)
    timeout $T dsec resume $a >/dev/null || { bad "resume-$i" "refused"; break; }
    timeout $T dsec exec $a -- true
    t1=$(now_ms)
    echo "METRIC pause_resume_first_exec_ms $((t1 - t0))"
    want=""; got=""
    for j in $(seq 1 $i); do want="$want cycle-$j"; got="$got $(timeout $T dsec exec $a -- cat /root/f$j)"; done
    timeout $T dsec exec $a -- sh -c "kill -0 $bg" || { bad "resume-$i-process" "background process $bg is gone"; break; }
    echo "echo cwd-$i=\$(pwd)" >&7
    sess_wait "cwd-$i=/root/deep/er" && sessions=$((sessions + 1)) || bad "resume-$i-session" "$(tail -2 /tmp/sess.out)"
    [ "$got" = "$want" ] && cycles=$((cycles + 1)) || { bad "resume-$i-files" "got '$got', want '$want'"; break; }
done
grep -o 'resumed from its snapshot on disk.*' /tmp/node.log | tail -3
[ $cycles = 3 ] && ok pause-resume-three-cycles || bad pause-resume-three-cycles "$cycles of 3 cycles kept everything"
[ $over_base = 3 ] && ok pause-over-template-base \
    || bad pause-over-template-base "$over_base of 3 pauses wrote a diff over the template under 16 MiB: $(grep -i 'memory base' /tmp/node.log | tail -2)"
# The node's /metrics counts what each pause wrote (the daemon restarted before the cycles).
pm=$(timeout 30 wget -q -O - http://127.0.0.1:9464/metrics 2>&1 | grep '^dsec_sandbox_pauses_total')
[ "$(echo "$pm" | grep over_base | cut -d' ' -f2)" = 3 ] && [ "$(echo "$pm" | grep full | cut -d' ' -f2)" = 0 ] \
    && ok pause-metrics || bad pause-metrics "got '$pm'"
sockets_after=$(agent_sockets)
[ -n "$sockets_before" ] && [ "$sockets_after" -le "$sockets_before" ] && ok resume-closes-old-connections \
    || bad resume-closes-old-connections "the agent held $sockets_before sockets before the cycles, $sockets_after after"
# The daemon's first connection to each resumed guest is accepted: the restored VMM's host
# ports go on after the snapshot's, which the guest may still hold.
attempts=$(grep 'restored guest refreshed' /tmp/node.log | tail -3 | tr -d '\033' | sed 's/\[[0-9;]*m//g' \
    | grep -o 'connect_attempts=[0-9]*' | tr '\n' ' ')
[ "$attempts" = "connect_attempts=1 connect_attempts=1 connect_attempts=1 " ] && ok resume-first-connection-accepted \
    || bad resume-first-connection-accepted "the last three resumes needed: $attempts"
# The first resume starts the shape's pool (the daemon was restarted), later ones take from it.
pooled=$(grep -c 'resumed into a prewarmed VMM' /tmp/node.log)
[ "$pooled" -ge 1 ] && [ "$(vmms_of $a)" -ge 1 ] && ok resume-through-vmm-pool \
    || bad resume-through-vmm-pool "$pooled resumes in a prewarmed VMM, $(vmms_of $a) VMMs: $(grep -i 'prewarm' /tmp/node.log | tail -3)"
[ $sessions = 3 ] && ok pause-resume-session-cwd || bad pause-resume-session-cwd "the session's cwd survived $sessions of 3 cycles"
exec 7>&-
wait $sess 2>/dev/null

# A paused sandbox survives kill -9 of the daemon and a restart.
timeout $T dsec exec $a -- sh -c 'echo before-kill >/root/k'
timeout $T dsec pause $a >/dev/null
kill -9 $daemon; wait $daemon 2>/dev/null
start_daemon
out=$(timeout $T dsec inspect $a 2>&1)
case $out in *PAUSED*|*paused*) ok paused-adopted ;; *) bad paused-adopted "$out" ;; esac
timeout $T dsec resume $a >/dev/null && [ "$(timeout $T dsec exec $a -- cat /root/k)" = before-kill ] \
    && ok resume-after-daemon-kill || bad resume-after-daemon-kill "$(tail -5 /tmp/node.log)"

# A corrupted template: the create boots cold (warning), the next one builds it again.
built=$(grep -c 'template snapshot built' /tmp/node.log)
for st in /tmp/node/templates/*/snapshot/state; do echo garbage >$st; done
c=$(timeout $T dsec create --backend microvm --mem 128 2>>/tmp/create.err)
[ -n "$c" ] && [ "$(timeout $T dsec exec $c -- echo hi)" = hi ] && grep -q 'could not be restored' /tmp/node.log \
    && ok corrupt-template-falls-back-cold || bad corrupt-template-falls-back-cold "id '$c': $(grep -i template /tmp/node.log | tail -3)"
d=$(timeout $T dsec create --backend microvm --mem 128 2>>/tmp/create.err)
[ -n "$d" ] && [ "$(grep -c 'template snapshot built' /tmp/node.log)" = $((built + 1)) ] && [ "$(timeout $T dsec exec $d -- echo hi)" = hi ] \
    && ok template-rebuilt || bad template-rebuilt "$(grep -i template /tmp/node.log | tail -3)"

# (The node's disk budget in L1 takes five sandboxes of 1 GiB.)
timeout $T dsec rm $c $d >/dev/null 2>&1
# A template whose memory file is missing: a cold boot with a warning, then built again.
rm -f /tmp/node/templates/*/snapshot/memory
warned=$(grep -c 'could not be restored' /tmp/node.log)
e=$(timeout $T dsec create --backend microvm --mem 128 2>>/tmp/create.err)
[ -n "$e" ] && [ "$(timeout $T dsec exec $e -- echo hi)" = hi ] && [ "$(grep -c 'could not be restored' /tmp/node.log)" -gt "$warned" ] \
    && ok missing-template-falls-back-cold || bad missing-template-falls-back-cold "id '$e': $(grep -i template /tmp/node.log | tail -3)"
f=$(timeout $T dsec create --backend microvm --mem 128 2>>/tmp/create.err)
[ -n "$f" ] && [ "$(grep -c 'template snapshot built' /tmp/node.log)" = $((built + 2)) ] && ok missing-template-rebuilt \
    || bad missing-template-rebuilt "$(grep -i template /tmp/node.log | tail -3)"

timeout $T dsec rm $e $f >/dev/null 2>&1
# A changed image (the initramfs rewritten: new mtime) gets a new template; the stale one goes.
old_tpl=$(ls /tmp/node/templates)
# A sandbox paused over the old template: resumes after the template is gone.
timeout $T dsec exec $a -- sh -c 'echo over-old-template >/root/t'
timeout $T dsec pause $a >/dev/null
touch $DSEC_HOME/images/busybox/initramfs.cpio
g=$(timeout $T dsec create --backend microvm --mem 128 2>>/tmp/create.err)
new_tpl=$(ls /tmp/node/templates)
[ -n "$g" ] && [ "$(timeout $T dsec exec $g -- echo hi)" = hi ] && [ "$(grep -c 'template snapshot built' /tmp/node.log)" = $((built + 3)) ] \
    && [ -n "$new_tpl" ] && [ "$new_tpl" != "$old_tpl" ] && [ ! -e "/tmp/node/templates/$old_tpl" ] \
    && grep -q 'stale template removed' /tmp/node.log \
    && ok image-change-rebuilds-template || bad image-change-rebuilds-template "before '$old_tpl', after '$new_tpl': $(grep -i template /tmp/node.log | tail -3)"
timeout $T dsec resume $a >/dev/null && [ "$(timeout $T dsec exec $a -- cat /root/t /root/f1)" = "over-old-template
cycle-1" ] && [ ! -e "/tmp/node/templates/$old_tpl" ] \
    && ok resume-after-template-rebuilt || bad resume-after-template-rebuilt "$(tail -3 /tmp/node.log)"

for s in $a $c $d $e $f $g; do timeout $T dsec rm $s >/dev/null 2>&1; done

# A full disk during pause: the snapshot dir on a 4 MiB tmpfs; the pause fails, the sandbox runs on.
kill $daemon; wait $daemon 2>/dev/null
mount -t tmpfs -o size=4m tmpfs /tmp/node/snapshots
start_daemon
h=$(timeout $T dsec create --backend microvm --mem 128 2>>/tmp/create.err)
timeout $T dsec exec $h -- sh -c 'echo kept >/root/full'
out=$(timeout $T dsec pause $h 2>&1); paused=$?
[ -n "$h" ] && [ $paused != 0 ] && [ "$(timeout $T dsec exec $h -- cat /root/full)" = kept ] && [ "$(vmms_of $h)" -ge 1 ] \
    && ok full-disk-pause-fails-cleanly || bad full-disk-pause-fails-cleanly "id '$h', pause exit $paused: $out"
echo "full-disk pause error: $out"
[ "$(df -k /tmp/node/snapshots | awk 'NR==2 {print $3}')" -lt 64 ] && ok full-disk-pause-leaves-no-snapshot \
    || bad full-disk-pause-leaves-no-snapshot "$(ls -lR /tmp/node/snapshots | head)"
timeout $T dsec rm $h >/dev/null 2>&1
kill $daemon; wait $daemon 2>/dev/null
umount /tmp/node/snapshots
start_daemon
i=0
while [ "$(ps | grep -c "[d]sec-vmm")" != 0 ] && [ $i -lt 50 ]; do sleep 0.2; i=$((i + 1)); done
left=$(dsec ls 2>/dev/null | grep -c sb-)
vmms=$(ps | grep -c "[d]sec-vmm")
dirs=$(ls -A /tmp/node/sandboxes /tmp/node/jails /tmp/node/snapshots /tmp/node/vmm-pool 2>/dev/null | grep -c -e '^sb-' -e '^template-' -e '^pool-')
[ "$left" = 0 ] && [ "$vmms" = 0 ] && [ "$dirs" = 0 ] && ok nothing-left \
    || bad nothing-left "$left sandboxes, $vmms VMMs, $dirs sandbox, jail, snapshot or pool directories"
kill $daemon 2>/dev/null; wait $daemon 2>/dev/null
grep -E 'WARN|ERROR' /tmp/node.log | tail -20
echo "$pass passed, $fail failed"
exit $fail
