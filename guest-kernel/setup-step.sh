#!/usr/bin/env bash
# Kernel step of the top-level setup.sh. Source this file and call
# `dsec_setup_guest_kernel`, or run it directly. Installs the build
# dependencies (apt), builds or reuses the cached kernel and installs it
# into ${DSEC_HOME:-/var/lib/dsec}/kernel.
dsec_setup_guest_kernel() (
    set -euo pipefail
    local here
    here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
    local pkgs=(build-essential linux-source-6.1 bc flex bison libelf-dev libssl-dev dwarves
                cpio rsync kmod xz-utils busybox-static qemu-system-x86)
    local missing=() p
    for p in "${pkgs[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
    done
    if [[ ${#missing[@]} -gt 0 ]]; then
        echo "setup: installing ${missing[*]}" >&2
        [[ $(id -u) == 0 ]] || { echo "setup: error: need root to apt-get install ${missing[*]}" >&2; exit 1; }
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}" >&2
    fi
    "$here/install.sh"
)

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
    set -euo pipefail
    dsec_setup_guest_kernel "$@"
fi
