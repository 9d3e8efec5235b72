#!/usr/bin/env bash
# DSec test suite, everything CI runs: setup (installs, cached kernel build, binaries, image),
# formatting and lints, unit tests, VMM test-guest tests, the container path end to end, and the
# real-Linux-guest tests inside the nested-virtualization rig.
#
#   ./test.sh            all suites
#   ./test.sh --no-rig   skip the rig (about 5 minutes of TCG emulation)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
export DSEC_HOME=${DSEC_HOME:-/var/lib/dsec}
run_rig=1
[[ ${1:-} == --no-rig ]] && run_rig=0

passed=0 failed=0 failed_names=()
suite() {
    local name=$1; shift
    printf '\n==> suite %s: %s\n' "$name" "$*"
    local start=$SECONDS
    if "$@"; then
        passed=$((passed + 1)); echo "<== suite $name passed ($((SECONDS - start)) s)"
    else
        failed=$((failed + 1)); failed_names+=("$name"); echo "<== suite $name FAILED ($((SECONDS - start)) s)"
    fi
}

./setup.sh --no-run || { echo "setup failed: nothing can be tested"; echo "suites: 0 passed, 1 failed"; exit 1; }

suite fmt cargo fmt --all -- --check
suite clippy cargo clippy --workspace --all-targets -- -D warnings
suite cargo-test cargo test --workspace --no-fail-fast
# The Quick-start job: a real sandbox prints the kernel release and passes the exit code back.
main_job() {
    local out rc
    out=$(target/release/dsec run -- sh -c 'uname -r; exit 7'); rc=$?
    echo "$out"
    [[ $rc == 7 && $out =~ ^[0-9]+\.[0-9]+ ]]
}
suite main-job main_job
# The node daemon through the Python SDK: 100 concurrent creates, SIGKILL + re-adoption, status codes, TTL, floods.
python_sdk() { cargo build --release -p dsec-edge -p dsec-agent && pip install -q ./sdk/python && DSEC_EDGE_BIN=target/release/dsec-edge python3 -m unittest discover -s sdk/python/tests -v; }
suite python-sdk python_sdk
# The control plane with real processes: etcd, 2 apiservers, 3 nodes, through the Python SDK.
suite cluster env DSEC_BIN=target/release/dsec python3 control/tests/cluster.py
if ((run_rig)); then
    suite rig tests/rig/run-tests.sh
fi

echo
((failed)) && echo "failed suites: ${failed_names[*]}"
echo "suites: $passed passed, $failed failed"
((failed == 0))
