#!/usr/bin/env bash
# DSec one-command setup: installs what a fresh Debian 12 host needs, builds the guest kernel
# (cached by input hash), the binaries, the static guest agent, the default busybox image and
# the Debian image (cached by input hash), then runs
# the main job: a single-node DSec on its embedded defaults running a command in a sandbox.
#
#   ./setup.sh            set up everything, then `dsec run -- uname -r`
#   ./setup.sh --no-run   set up only (used by test.sh)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
export DSEC_HOME=${DSEC_HOME:-/var/lib/dsec}
run_main_job=1
[[ ${1:-} == --no-run ]] && run_main_job=0

step() { printf '\n==> %s\n' "$*" >&2; }
die() { echo "setup: error: $*" >&2; exit 1; }

[[ $(id -u) == 0 ]] || die "run as root: setup installs apt packages and writes $DSEC_HOME"

step "apt packages"
pkgs=(build-essential pkg-config protobuf-compiler busybox-static cpio qemu-system-x86
      linux-source-6.1 bc flex bison libelf-dev libssl-dev dwarves rsync kmod xz-utils
      nftables libnftables1 conntrack iproute2
      docker-registry apache2-utils curl debootstrap erofs-utils e2fsprogs bubblewrap
      libprotobuf-dev etcd-server glusterfs-server)
missing=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
command -v cargo >/dev/null || die "cargo not found: install the Rust toolchain (rustup) first"

step "guest kernel (cached under ${DSEC_CACHE:-/var/cache/dsec}/kernel)"
guest-kernel/install.sh >/dev/null

step "binaries (cargo build --release)"
cargo build --release --workspace --bins

step "static guest agent (and the guest side of dsec-perf devices)"
RUSTFLAGS="-C target-feature=+crt-static" \
    cargo build --release -p dsec-agent -p dsec-guest-bench --target x86_64-unknown-linux-gnu
mkdir -p "$DSEC_HOME/bin"
install -m 0755 target/release/dsec-vmm "$DSEC_HOME/bin/dsec-vmm"
install -m 0755 target/x86_64-unknown-linux-gnu/release/dsec-agent "$DSEC_HOME/bin/dsec-agent"

step "default image (busybox + agent)"
guest-agent/mkinitramfs.sh --install --agent target/x86_64-unknown-linux-gnu/release/dsec-agent >/dev/null

step "debian image (cached under ${DSEC_CACHE:-/var/cache/dsec}/images/debian; first build: debootstrap, a few minutes)"
images/debian/build.sh --install >/dev/null

step "fncall image: python3 + numpy, g++, nodejs (cached under ${DSEC_CACHE:-/var/cache/dsec}/images/fncall; first build: a few minutes)"
images/fncall/build.sh --install >/dev/null

step "VM FnCall image: initramfs with busybox, the agent, python3 and bash (cached under ${DSEC_CACHE:-/var/cache/dsec}/images/fncall-vm)"
images/fncall-vm/build.sh --install --agent target/x86_64-unknown-linux-gnu/release/dsec-agent >/dev/null

# The unmodified SandboxFusion client, for the FnCall compatibility test (sdk/python/tests).
sf_venv=${DSEC_CACHE:-/var/cache/dsec}/venv/sandbox-fusion
if ! "$sf_venv/bin/python" -c 'import sandbox_fusion' 2>/dev/null; then
    step "sandbox-fusion client (venv in $sf_venv)"
    { python3 -m venv "$sf_venv" && "$sf_venv/bin/pip" install -q sandbox-fusion; } \
        || echo "setup: warning: could not install sandbox-fusion (PyPI unreachable?); its test will try again" >&2
fi

target/release/dsec info
if ((run_main_job)); then
    step "main job: dsec run -- uname -r"
    target/release/dsec run -- uname -r
fi
