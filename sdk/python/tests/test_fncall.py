"""FnCall through a real dsec-edge daemon (root, the fncall image from setup.sh): the SDK's
run_code (sync and async), SandboxFusion's POST /run_code on the node's HTTP entry point with
plain HTTP, and the unmodified `sandbox-fusion` client from PyPI against it.

    DSEC_EDGE_BIN=target/release/dsec-edge python3 -m unittest sdk/python/tests/test_fncall.py -v

The sandbox-fusion client lives in a venv under ${DSEC_CACHE:-/var/cache/dsec}/venv/
sandbox-fusion (setup.sh makes it; made here when missing, which needs PyPI).
"""

import asyncio
import base64
import http.client
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
import unittest
from pathlib import Path

import dsec

from test_node import NodeTest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


HTTP_PORT = free_port()


def sandbox_fusion_python() -> str:
    venv = Path(os.environ.get("DSEC_CACHE", "/var/cache/dsec")) / "venv" / "sandbox-fusion"
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import sandbox_fusion"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return str(python)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "sandbox-fusion"], check=True)
    return str(python)


class FnCallTest(NodeTest):
    extra_args = ("--http", f"127.0.0.1:{HTTP_PORT}")

    def post(self, body: dict) -> dict:
        conn = http.client.HTTPConnection("127.0.0.1", HTTP_PORT, timeout=60)
        conn.request("POST", "/run_code", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        self.assertEqual(resp.status, 200)
        answer = json.loads(resp.read())
        conn.close()
        return answer

    def test_run_code(self):
        r = self.client.run_code("import numpy\nprint(numpy.arange(5).sum())")
        self.assertTrue(r.success, r)
        self.assertEqual(r.stdout, "10\n")
        r = self.client.run_code("#include <iostream>\nint main(){int x;std::cin>>x;std::cout<<x*2;}",
                                 "cpp", stdin="21")
        self.assertTrue(r.compile.exit_code == 0 and r.stdout == "42", r)
        r = self.client.run_code("console.log(require('fs').readFileSync('in.txt', 'utf8'))",
                                 "nodejs", files={"in.txt": b"from a file"})
        self.assertEqual(r.stdout, "from a file\n", r)
        r = self.client.run_code("echo out > result.txt", "bash", fetch_files=["result.txt"])
        self.assertEqual(r.files, {"result.txt": b"out\n"})
        r = self.client.run_code("while True: pass", run_timeout=0.5)
        self.assertEqual(r.run.status, "TimeLimitExceeded")
        self.assertFalse(r.success)
        with self.assertRaises(dsec.InvalidArgument) as e:
            self.client.run_code("x", "cobol")
        self.assertIn("cobol", str(e.exception))
        with self.assertRaises(dsec.InvalidArgument):
            self.client.run_code("x", files={"../escape": b""})

    def test_run_code_async(self):
        async def go():
            client = dsec.AsyncClient(self.client.target)
            try:
                results = await asyncio.gather(
                    *[client.run_code(f"print({i} * 3)") for i in range(20)])
            finally:
                await client.close()
            return results

        results = asyncio.run(go())
        self.assertEqual([r.stdout for r in results], [f"{i * 3}\n" for i in range(20)])

    def test_run_code_network_policy(self):
        # This node has no sandbox network: a call with a policy is refused, which a call
        # whose policy was not sent would not be (it runs with loopback only).
        policy = {"allow": ["tcp:fn.test:80", "tcp:10.0.0.0/8:443"], "deny": [],
                  "allow_internet": False}
        with self.assertRaises(dsec.FailedPrecondition) as e:
            self.client.run_code("print(1)", network_policy=policy)
        self.assertIn("network", str(e.exception))

        async def go():
            client = dsec.AsyncClient(self.client.target)
            try:
                await client.run_code("print(1)", network_policy={"allow": ["tcp:fn.test:80"]})
            finally:
                await client.close()

        with self.assertRaises(dsec.FailedPrecondition):
            asyncio.run(go())
        with self.assertRaises(ValueError) as e:
            self.client.run_code("print(1)", network_policy={"allowed": ["x"]})
        self.assertIn("allowed", str(e.exception))
        req = dsec.client._run_code_request("print(1)", "python", b"", None, (), 10, 10, 0,
                                            False, "", policy)
        self.assertEqual(list(req.network_policy.allow), policy["allow"])

    def test_sandbox_fusion_http(self):
        ok = self.post({"code": "print(input())", "language": "python", "stdin": "hi"})
        self.assertEqual(ok["status"], "Success")
        self.assertEqual(ok["run_result"]["stdout"], "hi\n")
        self.assertEqual(ok["run_result"]["return_code"], 0)
        self.assertIsNone(ok["compile_result"])
        failed = self.post({"code": "int main( {", "language": "cpp"})
        self.assertEqual(failed["status"], "Failed")
        self.assertEqual(failed["compile_result"]["status"], "Finished")
        self.assertNotEqual(failed["compile_result"]["return_code"], 0)
        self.assertIsNone(failed["run_result"])
        files = self.post({"code": "cat data.bin | wc -c; cp data.bin out.bin", "language": "bash",
                           "files": {"data.bin": base64.b64encode(b"\x00\x01\x02").decode()},
                           "fetch_files": ["out.bin"]})
        self.assertEqual(files["run_result"]["stdout"].strip(), "3")
        self.assertEqual(base64.b64decode(files["files"]["out.bin"]), b"\x00\x01\x02")
        bad = self.post({"code": "x", "language": "cobol"})
        self.assertEqual(bad["status"], "SandboxError")
        self.assertIn("cobol", bad["message"])
        conn = http.client.HTTPConnection("127.0.0.1", HTTP_PORT, timeout=10)
        conn.request("GET", "/v1/ping")
        self.assertEqual(json.loads(conn.getresponse().read()), "pong")
        conn.close()

    def test_sandbox_fusion_client(self):
        script = textwrap.dedent(f"""
            from sandbox_fusion import run_code, RunCodeRequest, set_endpoint
            set_endpoint("http://127.0.0.1:{HTTP_PORT}")
            r = run_code(RunCodeRequest(code="print(1+1)", language="python"))
            assert r.status == "Success" and r.run_result.stdout == "2\\n", r
            r = run_code(RunCodeRequest(code="#include <cstdio>\\nint main(){{puts(\\"c\\");}}",
                                        language="cpp"))
            assert r.status == "Success" and r.run_result.stdout == "c\\n", r
            assert r.compile_result.status == "Finished", r
            r = run_code(RunCodeRequest(code="while True: pass", language="python", run_timeout=1))
            assert r.status == "Failed" and r.run_result.status == "TimeLimitExceeded", r
            r = run_code(RunCodeRequest(code="import sys; sys.exit(3)", language="python"))
            assert r.status == "Failed" and r.run_result.return_code == 3, r
            print("sandbox-fusion client ok")
        """)
        out = subprocess.run([sandbox_fusion_python(), "-c", script], capture_output=True,
                             text=True, timeout=300)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertIn("sandbox-fusion client ok", out.stdout)

    def test_sandbox_fusion_client_thousand_calls(self):
        """1,000 calls through the unmodified sandbox-fusion client at concurrency 64, each
        leaving a background process behind: no error, and no call's process, mount or
        worker cgroup left on the host."""
        script = textwrap.dedent(f"""
            from concurrent.futures import ThreadPoolExecutor
            from sandbox_fusion import run_code, RunCodeRequest, set_endpoint
            set_endpoint("http://127.0.0.1:{HTTP_PORT}")
            def one(i):
                code = "import subprocess\\nsubprocess.Popen(['sleep', '100'])\\nprint(%d * 2)" % i
                r = run_code(RunCodeRequest(code=code, language="python"), max_attempts=1)
                assert r.status == "Success" and r.run_result.stdout == "%d\\n" % (i * 2), (i, r)
            with ThreadPoolExecutor(64) as pool:
                list(pool.map(one, range(1000)))
            print("1000 calls ok")
        """)
        out = subprocess.run([sandbox_fusion_python(), "-c", script], capture_output=True,
                             text=True, timeout=600)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr[-4000:])
        self.assertIn("1000 calls ok", out.stdout)
        daemon = str(self.daemon.proc.pid)
        deadline = time.monotonic() + 10
        while True:
            left = fncall_leftovers(daemon)
            if not any(left.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        self.assertEqual(left, {"processes": [], "mounts": [], "cgroups": []})


# FnCall calls run as uids from 3 * 2^30 up (fncall/src/container.rs, DEFAULT_UID_BASE).
CALL_UID_BASE = 3 << 30


def fncall_leftovers(daemon_pid: str) -> dict:
    """What calls of the daemon's FnCall workers left: processes of a call uid (but the python
    stages made ahead, named fncall-ready), mounts in a zygote's namespace beyond its root,
    /dev and the call init bound in /dev, and worker cgroups (v1 memory hierarchy, named <daemon pid>-w<n>) without a zygote."""
    processes, mounts, zygotes = [], [], 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        name = status.splitlines()[0]
        uid = int(next(l for l in status.splitlines() if l.startswith("Uid:")).split()[1])
        if uid >= CALL_UID_BASE and name != "Name:\tfncall-ready":
            processes.append(f"{pid} {name}")
        comm, rest = stat.rsplit(") ", 1)
        if comm.endswith("(fncall-zygote") and rest.split()[1] == daemon_pid:
            zygotes += 1
            try:
                count = len(Path(f"/proc/{pid}/mountinfo").read_text().splitlines())
            except OSError:
                continue
            if count != 3:
                mounts.append(f"zygote {pid}: {count} mounts")
    groups = Path("/sys/fs/cgroup/memory/dsec-fncall")
    cgroups = []
    if groups.is_dir():
        mine = sorted(g.name for g in groups.iterdir() if g.name.startswith(daemon_pid + "-w"))
        if len(mine) > zygotes:
            cgroups = [f"{len(mine)} worker groups for {zygotes} zygotes: {mine}"]
    return {"processes": processes, "mounts": mounts, "cgroups": cgroups}


if __name__ == "__main__":
    unittest.main()
