#!/bin/sh
# Runs inside the rig's L1 (the kernel of tests/rig/l1-net-kernel.sh: bridge, veth,
# nftables): microVM sandboxes on a node with a sandbox network. A test host in a network
# namespace of L1's own ("web", 192.168.77.2, HTTP on 8080 and 9090); the daemon with
# `--net-bridge dsec0`. A booted microVM gets a tap on the bridge and reaches nothing; with a
# policy, the test host by port only; never the node's API or HTTP entry point, even with
# --internet; a guest that takes another sandbox's address sends nothing; two template
# creates get their own tap, address, MAC, route and resolver, and their policy; so do a
# fork child and a named restore (the source's policy) and a resumed sandbox (its own); taps,
# namespaces and rules are gone after delete, and ip_forward is put back when the daemon stops.
# Expects in L1: /bin/dsec, /bin/dsec-vmm, iproute2 at /usr/sbin/ip, nft and conntrack in
# /usr/sbin, DSEC_HOME=/dsec holding kernel/vmlinux and images/busybox/initramfs.cpio.
# Prints PASS/FAIL per check and "N passed, N failed"; exit status = failures.
pass=0; fail=0
ok()  { echo "PASS $1"; pass=$((pass+1)); }
bad() { echo "FAIL $1: $2"; fail=$((fail+1)); }
export DSEC_HOME=/dsec DSEC_RUN_DIR=/tmp/dsec-run
export DSEC_ENDPOINT=unix:/tmp/node/edge.sock
# iproute2 and nftables before busybox's applets (the daemon runs `ip -batch`).
export PATH=/usr/sbin:$PATH
T=300
for f in /bin/dsec /bin/dsec-vmm /usr/sbin/ip /usr/sbin/nft $DSEC_HOME/kernel/vmlinux $DSEC_HOME/images/busybox/initramfs.cpio; do
    [ -e $f ] || { bad "input $f" "missing from the L1 initramfs"; echo "$pass passed, $fail failed"; exit 1; }
done
nft list tables >/dev/null 2>&1 || { bad kernel "no nftables in L1 (run with RIG_KERNEL from tests/rig/l1-net-kernel.sh)"; echo "$pass passed, $fail failed"; exit 1; }
forward_before=$(cat /proc/sys/net/ipv4/ip_forward)
# `nft -f -` opens /dev/stdin, which L1's bare devtmpfs lacks.
[ -e /dev/stdin ] || ln -s /proc/self/fd/0 /dev/stdin

# The test host: its own namespace, a veth to L1's. iproute2 by path: busybox's sh runs
# its own applets before PATH.
IP=/usr/sbin/ip
$IP link set lo up
$IP netns add web
$IP link add webhost type veth peer name eth0 netns web
$IP addr add 192.168.77.1/24 dev webhost; $IP link set webhost up
$IP -n web link set lo up; $IP -n web addr add 192.168.77.2/24 dev eth0; $IP -n web link set eth0 up
mkdir -p /tmp/www; echo web-ok >/tmp/www/index.html
$IP netns exec web busybox httpd -p 8080 -h /tmp/www
$IP netns exec web busybox httpd -p 9090 -h /tmp/www
# SYNs the test host receives on 8081 (nothing listens there), counted.
$IP netns exec web nft -f - <<'EOF'
table ip probe {
  chain input { type filter hook input priority 0; tcp dport 8081 counter; }
}
EOF
syns() { $IP netns exec web nft list chain ip probe input | awk '/counter/ {for (i=1;i<=NF;i++) if ($i=="packets") print $(i+1)}'; }

DSEC_LOG=info dsec up --state-dir /tmp/node --default-backend microvm --metrics off --http 0.0.0.0:7080 \
    --cgroup-name dsec-rig --net-bridge dsec0 --net-pool 10.77.0.0/24 >/tmp/node.log 2>&1 &
daemon=$!
i=0
until dsec ls >/dev/null 2>&1 || [ $i -ge 100 ]; do sleep 0.2; i=$((i + 1)); done
dsec ls >/dev/null 2>&1 && ok daemon-up || { bad daemon-up "$(tail -5 /tmp/node.log)"; echo "$pass passed, $fail failed"; exit 1; }
gw=10.77.0.1
# The gateway's MAC is fixed: a bridge that takes its lowest port's MAC changes it as taps
# come and go, and cuts off every sandbox that cached the old one (a fork's parent did).
gwmac=06:00:0a:4d:00:01
[ "$(cat /sys/class/net/dsec0/address)" = $gwmac ] && ok bridge-mac-fixed || bad bridge-mac-fixed "dsec0 has $(cat /sys/class/net/dsec0/address)"

a=$(timeout $T dsec create --backend microvm --mem 128 --cold 2>/tmp/create.err)
[ -n "$a" ] && ok create || { bad create "$(cat /tmp/create.err; tail -5 /tmp/node.log)"; }
addr_of() { timeout $T dsec exec $1 -- sh -c "ip -4 addr show dev eth0 | awk '/inet / {print \$2}'" | cut -d/ -f1; }
aa=$(addr_of $a)
taps=$(ls /sys/class/net | grep -c '^dst')
case $aa in 10.77.0.*) [ "$taps" = 1 ] && [ "$(basename "$(readlink /sys/class/net/dst*/master)")" = dsec0 ] \
    && ok tap-on-bridge || bad tap-on-bridge "$taps taps: $(ls /sys/class/net)";;
    *) bad tap-on-bridge "guest eth0 has '$aa'; $(tail -5 /tmp/node.log)";; esac
# The VMM joined a namespace of its own; once the tap left it the bind mount went.
[ -z "$(ls /run/dsec-net/dsec0/ | grep netns)" ] && ok netns-dropped || bad netns-dropped "$(ls /run/dsec-net/dsec0/)"
# The body an HTTP GET of HOST:PORT gets from inside sandbox $1 (busybox nc: the guest
# image's static wget crashes resolving names), empty if nothing answers.
reach() { timeout 60 dsec exec $1 -- sh -c "printf 'GET / HTTP/1.0\r\n\r\n' | nc -w 3 $2 2>/dev/null" | tail -1; }

[ -z "$(reach $a '192.168.77.2 8080')" ] && ok no-policy-reaches-nothing || bad no-policy-reaches-nothing "reached the test host"
timeout $T dsec net set $a tcp:192.168.77.2:8080 >/dev/null || bad net-set "refused"
[ "$(reach $a '192.168.77.2 8080')" = web-ok ] && ok policy-reaches-test-host || bad policy-reaches-test-host "$(timeout 60 dsec exec $a -- nc -w 3 192.168.77.2 8080 </dev/null 2>&1)"
[ -z "$(reach $a '192.168.77.2 9090')" ] && ok policy-by-port-only || bad policy-by-port-only "reached port 9090"
timeout $T dsec net set $a --internet >/dev/null
[ "$(reach $a '192.168.77.2 9090')" = web-ok ] && ok internet-reaches-any-port || bad internet-reaches-any-port "9090 closed with --internet"
n=0
for target in "$gw 7080" "192.168.77.1 7080" "$gw 1"; do
    # Connected, or refused by a closed port of the node: either way the node answered.
    out=$(timeout 60 dsec exec $a -- sh -c "nc -w 3 $target </dev/null 2>&1; echo rc=\$?")
    case $out in *"rc=0"*|*refused*) echo "  reached $target: $out";; *) n=$((n + 1));; esac
done
[ $n = 3 ] && ok node-unreachable || bad node-unreachable "$n of 3 node addresses closed"

# A guest owns its kernel: taking another sandbox's address must not get it that one's policy.
b=$(timeout $T dsec create --backend microvm --mem 128 --cold 2>/tmp/create.err)
set_a=$(timeout $T dsec net set $a tcp:192.168.77.2 2>&1; echo "rc=$?")
set_b=$(timeout $T dsec net set $b tcp:192.168.77.2:9090 2>&1; echo "rc=$?")
probe=$(timeout 60 dsec exec $a -- sh -c "nc -w 3 192.168.77.2 8081 </dev/null 2>&1; echo rc=\$?")
before=$(syns)
[ "${before:-0}" -ge 1 ] && ok probe-counts || bad probe-counts "the test host saw no SYN from $a on 8081: set $a: $set_a; set $b: $set_b; nc: $probe; conntrack: $(conntrack -L 2>&1 | tail -5); log: $(tail -8 /tmp/node.log)"
timeout 60 dsec exec $b -- sh -c "ip addr flush dev eth0; ip addr add $aa/24 dev eth0; ip route add default via $gw; nc -w 3 192.168.77.2 8081 </dev/null" >/dev/null 2>&1
after=$(syns)
[ "$after" = "$before" ] && ok spoofed-source-dropped || bad spoofed-source-dropped "the test host got $((after - before)) SYNs from $b posing as $a"

# Template creates: the template is built with a network device; each restore gets a tap,
# MAC, address, route and resolver of its own through the agent's refresh, and its policy.
c=$(timeout $T dsec create --backend microvm --mem 128 --allow tcp:192.168.77.2:8080 2>/tmp/create.err)
d=$(timeout $T dsec create --backend microvm --mem 128 --allow tcp:192.168.77.2:8080 2>/tmp/create.err)
# The log's fields are coloured: escapes between a name and its value.
restored=$(tr -d '\033' </tmp/node.log | sed 's/\[[0-9;]*m//g' | grep 'restored from the template snapshot' | grep -c -e "sandbox=$c" -e "sandbox=$d")
[ -n "$c" ] && [ -n "$d" ] && [ "$restored" = 2 ] && ok template-creates \
    || bad template-creates "c='$c' d='$d', $restored restored: $(cat /tmp/create.err; grep -i -e template -e warn /tmp/node.log | tail -5)"
ac=$(addr_of $c); ad=$(addr_of $d)
mac_of() { timeout 60 dsec exec $1 -- cat /sys/class/net/eth0/address; }
mc=$(mac_of $c); md=$(mac_of $d)
# The MAC the node derives from the address (06:00 and the address's bytes).
mac_for() { echo "$1" | awk -F. '{printf "06:00:%02x:%02x:%02x:%02x", $1, $2, $3, $4}'; }
case $ac$ad in 10.77.0.*10.77.0.*) [ "$ac" != "$ad" ] && [ "$mc" != "$md" ] && [ "$mc" = "$(mac_for $ac)" ] \
    && [ "$md" = "$(mac_for $ad)" ] && ok template-own-address-and-mac \
    || bad template-own-address-and-mac "$c: $ac $mc, $d: $ad $md";;
    *) bad template-own-address-and-mac "$c: '$ac', $d: '$ad'; $(tail -5 /tmp/node.log)";; esac
resolvers=$(for s in $c $d; do timeout 60 dsec exec $s -- cat /etc/resolv.conf; done | sort -u)
routes=$(for s in $c $d; do timeout 60 dsec exec $s -- ip route; done | awk '$1 == "default" {print $3}' | sort -u)
[ "$resolvers" = "nameserver $gw" ] && [ "$routes" = "$gw" ] && ok template-route-and-resolver \
    || bad template-route-and-resolver "resolv.conf '$resolvers', default via '$routes'"
for s in $c $d; do
    [ "$(reach $s '192.168.77.2 8080')" = web-ok ] && [ -z "$(reach $s '192.168.77.2 9090')" ] \
        && ok "template-policy-$s" || bad "template-policy-$s" "8080 '$(reach $s '192.168.77.2 8080')', 9090 '$(reach $s '192.168.77.2 9090')'"
done
taps=$(ls /sys/class/net | grep -c '^dst')
[ "$taps" = 4 ] && ok template-taps-on-bridge || bad template-taps-on-bridge "$taps taps: $(ls /sys/class/net)"
# Which way the rules went: libnftables in the daemon, or the nft program per change.
if grep -q 'rules through libnftables' /tmp/node.log; then echo "  rules through libnftables"
else echo "  rules through the nft program (libnftables not found)"; fi

# Fork, named restore and resume (pause to disk): each gets a tap of its own through the
# restore's net override and the agent's refresh. A fork child and a restore: a new address
# and MAC with the source's policy; a resumed sandbox: its own address and policy again.
e=$(timeout $T dsec fork $c 2>/tmp/fork.err | head -1)
ae=$(addr_of $e)
case $ae in 10.77.0.*) [ "$ae" != "$ac" ] && [ "$(mac_of $e)" = "$(mac_for $ae)" ] \
    && [ "$(reach $e '192.168.77.2 8080')" = web-ok ] && [ -z "$(reach $e '192.168.77.2 9090')" ] \
    && [ "$(reach $c '192.168.77.2 8080')" = web-ok ] && ok fork-own-network \
    || bad fork-own-network "$e: $ae $(mac_of $e), 8080 '$(reach $e '192.168.77.2 8080')', 9090 '$(reach $e '192.168.77.2 9090')'; parent 8080 '$(reach $c '192.168.77.2 8080')', its ARP: $(timeout 60 dsec exec $c -- cat /proc/net/arp | tail -n +2)";;
    *) bad fork-own-network "child '$e' has '$ae': $(cat /tmp/fork.err; tail -5 /tmp/node.log)";; esac
timeout $T dsec net set $e tcp:192.168.77.2:9090 >/dev/null
[ "$(reach $e '192.168.77.2 9090')" = web-ok ] && [ -z "$(reach $e '192.168.77.2 8080')" ] \
    && [ "$(reach $c '192.168.77.2 8080')" = web-ok ] && ok fork-policy-changes-alone \
    || bad fork-policy-changes-alone "child 9090 '$(reach $e '192.168.77.2 9090')', parent 8080 '$(reach $c '192.168.77.2 8080')'"
snap=$(timeout $T dsec snapshot $c 2>/tmp/snap.err)
f=$(timeout $T dsec restore $snap 2>/tmp/create.err)
af=$(addr_of $f)
case $af in 10.77.0.*) [ "$af" != "$ac" ] && [ "$af" != "$ae" ] && [ "$(mac_of $f)" = "$(mac_for $af)" ] \
    && [ "$(reach $f '192.168.77.2 8080')" = web-ok ] && [ -z "$(reach $f '192.168.77.2 9090')" ] \
    && ok restore-own-network \
    || bad restore-own-network "$f: $af $(mac_of $f), 8080 '$(reach $f '192.168.77.2 8080')', 9090 '$(reach $f '192.168.77.2 9090')'";;
    *) bad restore-own-network "restored '$f' has '$af': $(cat /tmp/snap.err /tmp/create.err; tail -5 /tmp/node.log)";; esac
timeout $T dsec pause $d >/dev/null || bad pause "refused"
timeout $T dsec resume $d >/dev/null || bad resume "refused: $(tail -5 /tmp/node.log)"
[ "$(addr_of $d)" = "$ad" ] && [ "$(basename "$(readlink /sys/class/net/$(printf 'dst%02x%02x%02x%02x' $(echo $ad | tr . ' '))/master)")" = dsec0 ] \
    && [ "$(reach $d '192.168.77.2 8080')" = web-ok ] && [ -z "$(reach $d '192.168.77.2 9090')" ] \
    && ok resume-keeps-network || bad resume-keeps-network "$d: '$(addr_of $d)' (was $ad), taps $(ls /sys/class/net | grep dst), 8080 '$(reach $d '192.168.77.2 8080')'"

[ "$(cat /sys/class/net/dsec0/address)" = $gwmac ] && ok bridge-mac-kept || bad bridge-mac-kept "dsec0 has $(cat /sys/class/net/dsec0/address) after taps came and went"
for s in $a $b $c $d $e $f; do timeout $T dsec rm $s >/dev/null 2>&1; done
i=0
while [ "$(ls /sys/class/net | grep -c '^dst')" != 0 ] && [ $i -lt 50 ]; do sleep 0.2; i=$((i + 1)); done
taps=$(ls /sys/class/net | grep -c '^dst')
slots=$(ls /run/dsec-net/dsec0 | wc -l)
chains=$(nft list set inet dsec0 sandboxes | grep -c 'elements =')
ports=$(nft list set bridge dsec0 ports | grep -c 'dst')
[ "$taps$slots$chains$ports" = 0000 ] && ok nothing-left || bad nothing-left "$taps taps, $slots slots, $chains sandboxes in the table, $ports port elements"

kill $daemon 2>/dev/null; wait $daemon 2>/dev/null
[ "$(cat /proc/sys/net/ipv4/ip_forward)" = "$forward_before" ] && [ ! -e /sys/class/net/dsec0 ] \
    && ok clean-stop || bad clean-stop "ip_forward $(cat /proc/sys/net/ipv4/ip_forward) (was $forward_before), bridge $(ls /sys/class/net)"
echo "$pass passed, $fail failed"
exit $fail
