"""Streaming paths of the Python SDK against a real dsec-edge daemon (container backend; run
as root): iterating an exec keeps nothing, ``wait`` after iterating, file helpers.

    DSEC_EDGE_BIN=target/release/dsec-edge python3 -m unittest -v sdk/python/tests/test_streaming.py

Memory is measured in a child interpreter (the peak RSS of its own address space, VmHWM),
so the bound covers exactly the SDK's work: importing ``dsec`` and grpc alone takes about
37 MiB here.
"""

import asyncio
import hashlib
import json
import os
import subprocess
import sys
import textwrap
import unittest
from pathlib import Path

import dsec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_node import NodeTest  # noqa: E402

SDK = Path(__file__).resolve().parents[1]

#: Peak RSS allowed to a child interpreter that moves hundreds of MB. The interpreter with
#: grpc and the stubs loaded peaks at ~37 MiB; a transfer held in memory would add 200-300 MB,
#: while a streamed one adds the chunks in flight (~30 MiB seen on a loaded 2-core machine).
RSS_BOUND_KIB = 96 << 10


def run_child(script: str, *args: str) -> dict:
    """Runs ``script`` in a fresh interpreter using this SDK; its last stdout line is JSON,
    to which its peak RSS (KiB) is added as ``max_rss_kib``."""
    # VmHWM, not ru_maxrss: the latter also counts the parent's peak at fork time.
    code = textwrap.dedent(script) + textwrap.dedent("""
        import json
        with open("/proc/self/status") as f:
            hwm = next(line for line in f if line.startswith("VmHWM:"))
        RESULT["max_rss_kib"] = int(hwm.split()[1])
        print(json.dumps(RESULT))
    """)
    env = dict(os.environ, PYTHONPATH=str(SDK))
    p = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True,
                       timeout=120)
    if p.returncode != 0:
        raise AssertionError(f"child failed ({p.returncode}): {p.stderr.decode()[-3000:]}")
    return json.loads(p.stdout.decode().strip().splitlines()[-1])


class ExecStreamTest(NodeTest):
    def tearDown(self):
        for sb in self.client.list():
            try:
                sb.delete()
            except dsec.DsecError:
                pass

    def test_iterating_keeps_nothing(self):
        """300 MB iterated through ExecStream (sync and async): every byte arrives, the
        interpreter's peak RSS stays below 64 MiB, and wait() then has the exit status."""
        with self.client.create(memory_mib=64) as sb:
            for mode in ("sync", "async"):
                r = run_child("""
                    import asyncio, sys, dsec
                    target, sid, mode = sys.argv[1:4]
                    cmd = "head -c 300000000 /dev/zero; echo end >&2; exit 5"
                    sizes = {"stdout": 0, "stderr": 0}
                    if mode == "sync":
                        s = dsec.Client(target).get(sid).exec_stream(cmd)
                        for kind, data in s:
                            sizes[kind] += len(data)
                        r = s.wait()
                    else:
                        async def main():
                            async with dsec.AsyncClient(target) as c:
                                s = (await c.get(sid)).exec_stream(cmd)
                                async for kind, data in s:
                                    sizes[kind] += len(data)
                                return await s.wait()
                        r = asyncio.run(main())
                    RESULT = dict(sizes, code=r.exit_code, out=len(r.stdout), err=len(r.stderr))
                """, self.client.target, sb.id, mode)
                print(f"\n{mode} iteration of 300 MB: peak RSS {r['max_rss_kib']} KiB")
                self.assertEqual((r["stdout"], r["stderr"]), (300_000_000, 4), mode)
                self.assertEqual((r["code"], r["out"], r["err"]), (5, 0, 0), mode)
                self.assertLess(r["max_rss_kib"], RSS_BOUND_KIB, mode)

    def test_wait_after_iterating(self):
        """wait() after a partial iteration returns the rest of the output and the exit
        status; after a full one, the exit status (every time); a failed call raises again."""
        script = "echo first; sleep 0.5; echo second; echo err >&2; exit 7"
        with self.client.create(memory_mib=64) as sb:
            s = sb.exec_stream(script)
            for kind, data in s:
                self.assertEqual((kind, data), ("stdout", b"first\n"))
                break
            r = s.wait()
            self.assertEqual((r.exit_code, r.stdout, r.stderr), (7, b"second\n", b"err\n"))
            self.assertEqual(s.wait().exit_code, 7)

            s = sb.exec_stream(script)
            events = list(s)
            self.assertEqual(b"".join(d for k, d in events if k == "stdout"),
                             b"first\nsecond\n")
            for _ in range(2):
                r = s.wait()
                self.assertEqual((r.exit_code, r.stdout, r.stderr), (7, b"", b""))
            self.assertEqual(list(s), [])

            s = sb.exec_stream("echo ready; head -c 100000 /dev/zero; exit 2")
            s.read_until(b"ready")
            r = s.wait(output_limit=1000)
            self.assertEqual((r.exit_code, r.stdout), (2, bytes(1000)))

            s = sb.exec_stream("echo ready; exec sleep 30", stdin=True, pty=dsec.Pty())
            s.read_until(b"ready")
            s.resize(5000, 80)
            with self.assertRaises(dsec.InvalidArgument):
                list(s)
            with self.assertRaises(dsec.InvalidArgument):
                s.wait()

    def test_async_wait_after_iterating(self):
        script = "echo first; sleep 0.5; echo second; echo err >&2; exit 7"

        async def main():
            async with dsec.AsyncClient(self.client.target) as c:
                sb = await c.create(memory_mib=64)
                try:
                    s = sb.exec_stream(script)
                    async for kind, data in s:
                        self.assertEqual((kind, data), ("stdout", b"first\n"))
                        break
                    r = await s.wait()
                    self.assertEqual((r.exit_code, r.stdout, r.stderr),
                                     (7, b"second\n", b"err\n"))
                    s = sb.exec_stream(script)
                    async for _ in s:
                        pass
                    for _ in range(2):
                        r = await s.wait()
                        self.assertEqual((r.exit_code, r.stdout, r.stderr), (7, b"", b""))
                finally:
                    await sb.delete()

        asyncio.run(main())


class FileStreamTest(NodeTest):
    def test_file_helpers_stream(self):
        """200 MB up with write_file_from (a path) and back with read_file_to (a path and a
        file object), sync and async: same bytes, peak RSS below 64 MiB, the mode kept."""
        local = self.daemon.state.with_suffix(".big")
        with open(local, "wb") as f:
            for i in range(200):
                f.write(bytes([i]) * 997 + os.urandom(1 << 20)[997:])
        os.chmod(local, 0o750)
        try:
            with self.client.create(memory_mib=64) as sb:
                for mode in ("sync", "async"):
                    r = run_child("""
                        import asyncio, hashlib, sys, dsec
                        target, sid, mode, local = sys.argv[1:5]

                        class Digest:
                            def __init__(self):
                                self.h = hashlib.sha256()

                            def write(self, data):
                                self.h.update(data)

                        digest = Digest()
                        if mode == "sync":
                            sb = dsec.Client(target).get(sid)
                            up = sb.write_file_from("/tmp/big", local)
                            down = sb.read_file_to("/tmp/big", local + ".back")
                            sb.read_file_to("/tmp/big", digest)
                            info = sb.stat("/tmp/big")
                            sb.remove("/tmp/big")
                        else:
                            async def main():
                                async with dsec.AsyncClient(target) as c:
                                    sb = await c.get(sid)
                                    with open(local, "rb") as f:
                                        up = await sb.write_file_from("/tmp/big", f, mode=0o750)
                                    down = await sb.read_file_to("/tmp/big", local + ".back")
                                    await sb.read_file_to("/tmp/big", digest)
                                    return up, down
                            up, down = asyncio.run(main())
                            sb = dsec.Client(target).get(sid)
                            info = sb.stat("/tmp/big")
                            sb.remove("/tmp/big")
                        RESULT = dict(up=up, down=down, sha=digest.h.hexdigest(),
                                      mode=info.mode & 0o7777)
                    """, self.client.target, sb.id, mode, str(local))
                    print(f"\n{mode} 200 MB up and down: peak RSS {r['max_rss_kib']} KiB")
                    self.assertEqual((r["up"], r["down"]), (200 << 20, 200 << 20), mode)
                    self.assertEqual(r["mode"], 0o750, mode)
                    with open(local, "rb") as f:
                        self.assertEqual(r["sha"], hashlib.file_digest(f, "sha256").hexdigest())
                    with open(local, "rb") as a, open(f"{local}.back", "rb") as b:
                        while True:
                            x, y = a.read(1 << 20), b.read(1 << 20)
                            self.assertEqual(x, y, mode)
                            if not x:
                                break
                    self.assertLess(r["max_rss_kib"], RSS_BOUND_KIB, mode)
        finally:
            local.unlink(missing_ok=True)
            Path(f"{local}.back").unlink(missing_ok=True)


if __name__ == "__main__":
    unittest.main()
