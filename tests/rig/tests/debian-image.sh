#!/bin/sh
# Runs inside the rig's L1: `dsec run --image debian` on the microVM backend. The agent boots
# from the initramfs, mounts the read-only erofs root disk (vda) and a fresh sparse upper disk
# (vdb, made by the edge with mkfs.ext4) as an overlay, and runs every command in it.
# Expects in L1: /bin/dsec, /bin/dsec-vmm, /bin/mkfs.ext4 and DSEC_HOME=/dsec holding
# kernel/vmlinux and images/debian/{initramfs.cpio,rootfs.img}.
# Prints PASS/FAIL per check and "N passed, N failed"; exit status = failures.
pass=0; fail=0
ok()  { echo "PASS $1"; pass=$((pass+1)); }
bad() { echo "FAIL $1: $2"; fail=$((fail+1)); }
now() { cut -d' ' -f1 /proc/uptime; }
export DSEC_HOME=/dsec DSEC_RUN_DIR=/tmp/dsec-run
T=${DEBIAN_IMAGE_TIMEOUT:-300}
IMG=$DSEC_HOME/images/debian/rootfs.img

for f in /bin/dsec /bin/dsec-vmm /bin/mkfs.ext4 $DSEC_HOME/kernel/vmlinux \
         $DSEC_HOME/images/debian/initramfs.cpio $IMG; do
    [ -e $f ] || bad "input $f" "missing from the L1 initramfs (pass it to rig.sh run)"
done
img_sum=$(md5sum <$IMG | cut -d' ' -f1)

# run NAME EXPECTED_STATUS EXPECTED_STDOUT CMD...: one `dsec run --image debian` check.
run() {
    name=$1; want_rc=$2; want_out=$3; shift 3
    t0=$(now)
    out=$(timeout $T dsec run --backend microvm --image debian --boot-timeout 240 -- "$@" 2>/tmp/$name.err)
    rc=$?; t1=$(now)
    if [ "$rc" = "$want_rc" ] && [ "$out" = "$want_out" ]; then
        ok "$name"
        echo "METRIC ${name}_s $(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.2f", b-a}')"
    else
        bad "$name" "exit=$rc (want $want_rc) stdout='$out' (want '$want_out'); stderr:"
        tail -30 /tmp/$name.err
    fi
}

run debian-python3 0 42 python3 -c 'print(6*7)'
# Each run boots a VM (minutes under TCG on a loaded machine): checks share runs.
run debian-bash-git-exit 3 "bash git version ID=debian" \
    bash -c 'echo bash $(git --version | cut -d" " -f1-2) $(grep -x ID=debian /etc/os-release); exit 3'
# Writes (to / itself and to /usr) land on the upper disk: after a sync the upper disk (vdb)
# has written sectors (field 7 of its stat), the read-only root disk (vda) none, and / is
# the overlay.
run debian-writes-to-upper 0 "marker ok root=overlay vda=0 vdb=big" bash -c '
    head -c 8388608 /dev/zero >/big && echo marker >/usr/local/marker && sync
    [ "$(cat /usr/local/marker)" = marker ] && m=ok || m=lost
    vda=$(awk "{print \$7}" /sys/block/vda/stat); vdb=$(awk "{print \$7}" /sys/block/vdb/stat)
    [ "$vdb" -ge 16384 ] && vdb=big
    echo "marker $m root=$(awk "\$2 == \"/\" {print \$3}" /proc/mounts | tail -1) vda=$vda vdb=$vdb"'
[ "$(md5sum <$IMG | cut -d' ' -f1)" = "$img_sum" ] && ok image-unchanged || bad image-unchanged "rootfs.img changed on the host"
# Each sandbox gets a fresh upper disk: the previous one's file is gone.
run debian-fresh-upper 0 "" sh -c 'test ! -e /usr/local/marker && test ! -e /big'
# Run as root, so each VMM was jailed: its jail root and (empty) snapshot directory go too.
left=$(ls $DSEC_RUN_DIR/sandboxes $DSEC_RUN_DIR/jails $DSEC_RUN_DIR/snapshots 2>/dev/null | grep -c '^vm-')
[ "$left" = 0 ] && ok no-leftovers || bad no-leftovers "$left sandbox, jail or snapshot directories left in $DSEC_RUN_DIR: $(ls -R $DSEC_RUN_DIR)"

# Fork on the disk image through the node daemon: the parent pauses while its upper disk is
# copied once per child, so each child starts from the parent's files and writes privately.
export DSEC_ENDPOINT=unix:/tmp/node/edge.sock
dsec up --state-dir /tmp/node --default-backend microvm --metrics off --http off \
    --cgroup-name dsec-rig --ready-timeout 240 >/tmp/node.log 2>&1 &
daemon=$!
i=0
until dsec ls >/dev/null 2>&1 || [ $i -ge 100 ]; do sleep 0.2; i=$((i + 1)); done
id=$(timeout $T dsec create --backend microvm --image debian 2>/tmp/create.err)
if [ -n "$id" ] && timeout $T dsec exec $id -- sh -c 'echo parent >/root/who'; then
    children=$(timeout $T dsec fork $id -n 2 2>/tmp/fork.err)
    n=0
    for c in $children; do
        [ "$(timeout $T dsec exec $c -- cat /root/who)" = parent ] \
            && timeout $T dsec exec $c -- sh -c "echo $c >/root/who" \
            && [ "$(timeout $T dsec exec $c -- cat /root/who)" = "$c" ] && n=$((n + 1))
    done
    [ "$n" = 2 ] && [ "$(timeout $T dsec exec $id -- cat /root/who)" = parent ] && ok debian-fork \
        || bad debian-fork "children '$children' ($n ok): $(cat /tmp/fork.err)"
    for s in $id $children; do timeout $T dsec rm $s >/dev/null 2>&1; done
else
    bad debian-fork "create/exec failed: $(cat /tmp/create.err; tail -5 /tmp/node.log)"
fi
# A killed jail supervisor's VMM dies with it (PDEATHSIG), a moment later.
i=0
while [ "$(ps | grep -c "[d]sec-vmm")" != 0 ] && [ $i -lt 50 ]; do sleep 0.2; i=$((i + 1)); done
left=$(ls /tmp/node/sandboxes /tmp/node/jails 2>/dev/null | grep -c '^sb-')
vmms=$(ps | grep -c "[d]sec-vmm")
[ "$left" = 0 ] && [ "$vmms" = 0 ] && ok debian-fork-nothing-left || bad debian-fork-nothing-left "$left directories, $vmms VMMs"
kill $daemon 2>/dev/null; wait $daemon 2>/dev/null

echo "$pass passed, $fail failed"
exit $fail
