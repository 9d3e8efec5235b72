"""The Python SDK against a real dsec-edge daemon (container backend; run as root).

    DSEC_EDGE_BIN=target/release/dsec-edge python3 -m unittest discover -s sdk/python/tests -v

Each test class starts its own daemon on a private state directory and cgroup name, and the
teardown removes every process, cgroup and directory it created, also after a failure.
"""

import asyncio
import grpc
import http.client
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import unittest
from pathlib import Path

import dsec

REPO = Path(__file__).resolve().parents[3]


def edge_bin() -> str:
    env = os.environ.get("DSEC_EDGE_BIN")
    if env:
        return env
    for profile in ("release", "debug"):
        p = REPO / "target" / profile / "dsec-edge"
        if p.exists():
            return str(p)
    raise unittest.SkipTest("build dsec-edge first (cargo build -p dsec-edge -p dsec-agent)")


def procs_referencing(text: str):
    """Pids whose command line or environment contains ``text`` (a container's agent names
    its sandbox directory in its environment only)."""
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        for name in ("cmdline", "environ"):
            try:
                with open(f"/proc/{d}/{name}", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if text.encode() in cmd:
                found.append(int(d))
                break
    return found


def cgroup_dirs(name: str):
    """Sandbox cgroups under every hierarchy's ``name`` directory."""
    out = []
    for root, dirs, _ in os.walk("/sys/fs/cgroup"):
        if os.path.basename(root) == name:
            out += [os.path.join(root, d) for d in dirs]
            dirs[:] = []
        elif root.count("/") > 8:
            dirs[:] = []
    return out


class Daemon:
    def __init__(self, tag: str, *extra: str):
        self.tag = f"dsec-pytest-{os.getpid()}-{tag}"
        self.state = Path("/tmp") / self.tag
        self.extra = extra
        self.proc = None
        self.log = None

    @property
    def sandboxes_dir(self) -> str:
        return str(self.state / "sandboxes") + "/"

    def start(self):
        self.state.mkdir(parents=True, exist_ok=True)
        if self.log is None:
            self.log = open(self.state.with_suffix(".log"), "ab")
        self.proc = subprocess.Popen(
            [edge_bin(), "--state-dir", str(self.state), "--metrics", "off",
             "--cgroup-name", self.tag, "--default-backend", "container", *self.extra],
            stdout=self.log, stderr=self.log, start_new_session=True)
        sock = self.state / "edge.sock"
        deadline = time.time() + 30
        while time.time() < deadline:
            if sock.exists():
                try:
                    c = dsec.Client(f"unix:{sock}")
                    c.node_status()
                    return c
                except dsec.DsecError:
                    pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"dsec-edge exited: see {self.state.with_suffix('.log')}")
            time.sleep(0.05)
        raise RuntimeError("dsec-edge did not come up")

    def kill(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def cleanup(self, client=None):
        """Deletes all sandboxes, stops the daemon, then removes anything left by force."""
        if client is not None:
            try:
                for sb in client.list():
                    try:
                        sb.delete()
                    except dsec.DsecError:
                        pass
            except dsec.DsecError:
                pass
        self.stop()
        leftovers = procs_referencing(self.sandboxes_dir)
        for pid in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for cg in cgroup_dirs(self.tag):
            for _ in range(100):
                try:
                    os.rmdir(cg)
                    break
                except OSError:
                    time.sleep(0.05)
        for root, dirs, _ in os.walk("/sys/fs/cgroup"):
            if os.path.basename(root) == self.tag:
                try:
                    os.rmdir(root)
                except OSError:
                    pass
                dirs[:] = []
            elif root.count("/") > 8:
                dirs[:] = []
        shutil.rmtree(self.state, ignore_errors=True)
        if self.log:
            self.log.close()
            self.log = None
            log = self.state.with_suffix(".log")
            if leftovers:
                print(log.read_text(errors="replace")[-4000:])
            log.unlink(missing_ok=True)
        return leftovers


class NodeTest(unittest.TestCase):
    extra_args: tuple = ()

    @classmethod
    def setUpClass(cls):
        cls.daemon = Daemon(cls.__name__, *cls.extra_args)
        try:
            cls.client = cls.daemon.start()
        except Exception:
            cls.daemon.cleanup()
            raise

    @classmethod
    def tearDownClass(cls):
        leftovers = cls.daemon.cleanup(cls.client)
        assert not leftovers, f"processes left after deleting all sandboxes: {leftovers}"
        cls.client.close()

    def assertClean(self):
        """Nothing of any sandbox is left on the host."""
        self.assertEqual(procs_referencing(self.daemon.sandboxes_dir), [])
        self.assertEqual(os.listdir(self.daemon.sandboxes_dir), [])
        self.assertEqual(cgroup_dirs(self.daemon.tag), [])


class ApiTest(NodeTest):
    def tearDown(self):
        # A failed test must not leave sandboxes that starve the next one.
        for sb in self.client.list():
            try:
                sb.delete()
            except dsec.DsecError:
                pass

    def test_concurrent_100_sandboxes(self):
        """100 sandboxes created concurrently through the async SDK each run a command."""
        target = self.client.target

        async def one(client, i):
            sb = await client.create(memory_mib=64, disk_mib=16, labels={"batch": "100"})
            r = await sb.exec(f"echo sandbox-{i}; hostname")
            return sb, i, r

        async def main():
            async with dsec.AsyncClient(target) as client:
                t0 = time.time()
                results = await asyncio.gather(*(one(client, i) for i in range(100)))
                took = time.time() - t0
                for sb, i, r in results:
                    self.assertEqual(r.exit_code, 0)
                    lines = r.stdout.decode().split()
                    self.assertEqual(lines[0], f"sandbox-{i}")
                    self.assertEqual(lines[1], sb.id)
                self.assertEqual(len(await client.list({"batch": "100"})), 100)
                await asyncio.gather(*(sb.delete() for sb, _, _ in results))
                return took

        took = asyncio.run(main())
        print(f"\n100 concurrent creates + exec: {took:.2f} s ({100 / took:.0f}/s)")
        self.assertClean()

    def test_create_many_on_the_node(self):
        """The node's CreateMany: one result per spec, in order; a bad spec fails alone."""
        specs = [dict(memory_mib=64, disk_mib=16, labels={"many": "yes"}),
                 dict(memory_mib=64, disk_mib=16, image="no-such-image"),
                 dict(memory_mib=64, disk_mib=16, env={"WHICH": "third"}, labels={"many": "yes"})]
        first, bad, third = self.client.create_many(specs)
        self.assertIsInstance(bad, dsec.DsecError)
        self.assertIn("no-such-image", bad.details)
        self.assertEqual(first.exec("echo one").text, "one\n")
        self.assertEqual(third.exec("echo $WHICH").text, "third\n")
        self.assertEqual(sorted(sb.id for sb in self.client.list({"many": "yes"})),
                         sorted([first.id, third.id]))
        # Over 256 in one call: the whole call is refused, nothing is made.
        pb = dsec.dsec_pb2
        too_many = pb.CreateSandboxesRequest(requests=[
            pb.CreateSandboxRequest(memory_mib=64, request_id=f"many-{i}")
            for i in range(257)])
        with self.assertRaises(grpc.RpcError) as e:
            self.client._sandboxes.CreateMany(too_many)
        self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertEqual(len(self.client.list({"many": "yes"})), 2)
        for sb in (first, third):
            sb.delete()
        self.assertClean()

    def test_list_pages_through_everything(self):
        """list() pages through the node's List transparently, in the order of the ids."""
        sbs = [self.client.create(memory_mib=64, disk_mib=16, labels={"paged": "yes"})
               for _ in range(5)]
        ids = sorted(sb.id for sb in sbs)
        self.assertEqual([sb.id for sb in self.client.list({"paged": "yes"}, page_size=2)], ids)
        first = self.client._sandboxes.List(dsec.dsec_pb2.ListSandboxesRequest(page_size=2))
        self.assertEqual(len(first.sandboxes), 2)
        self.assertEqual(first.next_page_token, first.sandboxes[-1].id)

        async def listed():
            async with dsec.AsyncClient(self.client.target) as c:
                return [sb.id for sb in await c.list({"paged": "yes"}, page_size=2)]

        self.assertEqual(asyncio.run(listed()), ids)
        for sb in sbs:
            sb.delete()

    def test_create_is_idempotent_with_a_request_id(self):
        a = self.client.create(memory_mib=64, disk_mib=16, request_id="py-req-1")
        b = self.client.create(memory_mib=64, disk_mib=16, request_id="py-req-1")
        self.assertEqual(a.id, b.id)
        self.assertEqual(a.info.request_id, "py-req-1")
        with self.assertRaises(dsec.DsecError) as e:
            self.client.create(memory_mib=128, disk_mib=16, request_id="py-req-1")
        self.assertEqual(e.exception.code.name, "ALREADY_EXISTS")
        self.assertIn("different spec", e.exception.details)
        # Without one, each call gets a fresh random request_id: two sandboxes.
        c = self.client.create(memory_mib=64, disk_mib=16)
        d = self.client.create(memory_mib=64, disk_mib=16)
        self.assertNotEqual(c.id, d.id)
        self.assertNotEqual(c.info.request_id, d.info.request_id)
        for sb in (a, c, d):
            sb.delete()

    def test_files_sessions_pause(self):
        with self.client.create(memory_mib=64, env={"GREETING": "hi"}) as sb:
            self.assertEqual(sb.exec("echo $GREETING").text, "hi\n")
            r = sb.exec(["cat"], stdin=b"x" * 100000)
            self.assertEqual(len(r.stdout), 100000)
            sb.mkdir("/work/a", parents=True)
            sb.write_file("/work/a/f.txt", b"data")
            sb.rename("/work/a/f.txt", "/work/a/g.txt")
            self.assertEqual([f.name for f in sb.list_dir("/work/a")], ["g.txt"])
            self.assertEqual(sb.stat("/work/a/g.txt").size, 4)
            self.assertEqual(sb.read_file("/work/a/g.txt"), b"data")
            sb.remove("/work", recursive=True)
            with self.assertRaises(dsec.NotFound):
                sb.stat("/work")
            s = sb.session()
            s.run("cd /tmp && export X=42")
            self.assertEqual(s.run("echo $PWD $X").text, "/tmp 42\n")
            started = s.run("sleep 0.2; echo done", wait=False)
            self.assertFalse(started.done)
            self.assertEqual(s.read_output(started.command_id, wait=True).text, "done\n")
            sb.pause()
            self.assertEqual(sb.info.state, "paused")
            with self.assertRaises(dsec.FailedPrecondition):
                sb.exec("true")
            sb.resume()
            self.assertEqual(s.run("echo $X").text, "42\n")

    def test_flood_is_capped(self):
        """A `yes | head -c N` flood in a session: head and tail kept, memory bounded.

        N is 1 GiB by default (busybox yes|head in a 1-vCPU container moves ~40 MB/s here);
        DSEC_FLOOD_BYTES=10737418240 runs the full 10 GiB (about 250 s)."""
        flood = int(os.environ.get("DSEC_FLOOD_BYTES", str(2**30)))
        with self.client.create(memory_mib=64) as sb:
            s = sb.session()
            t0 = time.time()
            # busybox head has no G suffix: bytes.
            r = s.run(f"yes | head -c {flood}; echo END", output_limit=64 * 1024, timeout=300)
            took = time.time() - t0
            self.assertEqual(r.exit_code, 0)
            self.assertTrue(r.truncated)
            self.assertEqual(r.total_bytes, flood + 4)
            self.assertLess(len(r.output), 64 * 1024 + 100)
            self.assertTrue(r.output.startswith(b"y\ny\n"))
            self.assertTrue(r.output.endswith(b"y\nEND\n"))
            usage = self.client.get(sb.id).info.memory_bytes
            print(f"\n{flood >> 20} MiB flood through a session: {took:.1f} s, sandbox memory {usage >> 20} MiB")
            # The sandbox's memory cgroup (64 MiB + disk) held; the agent did not balloon.
            self.assertLess(usage, 200 << 20)

    def test_debian_image(self):
        """Create with image "debian" (images/debian/build.sh, run by setup.sh): its tools run
        and a write stays in the sandbox."""
        with self.client.create(image="debian", memory_mib=256, disk_mib=512) as sb:
            self.assertEqual(sb.info.image, "debian")
            r = sb.exec(["python3", "-c", "print(6*7)"])
            self.assertEqual((r.exit_code, r.text), (0, "42\n"), r.stderr)
            r = sb.exec(["bash", "-c", "git --version && echo x > /usr/local/bin/mine"])
            self.assertEqual(r.exit_code, 0, r.stderr)
            self.assertTrue(r.text.startswith("git version 2."), r.text)
            self.assertEqual(sb.read_file("/usr/local/bin/mine"), b"x\n")
        image_rootfs = Path(os.environ.get("DSEC_HOME", "/var/lib/dsec")) / "images/debian/rootfs"
        self.assertFalse((image_rootfs / "usr/local/bin/mine").exists())
        self.assertClean()

    def test_bad_requests(self):
        c = self.client
        with self.assertRaises(dsec.InvalidArgument) as e:
            c.create(memory_mib=-5)
        self.assertIn("memory_mib must be positive", e.exception.details)
        with self.assertRaises(dsec.NotFound) as e:
            c.create(image="no-such-image")
        self.assertIn("available", e.exception.details)
        self.assertIn("./setup.sh", e.exception.details)
        with self.assertRaises(dsec.NotFound):
            c.get("sb-000000000000")
        with self.assertRaises(dsec.NotFound):
            dsec.Sandbox(c, dsec.SandboxInfo("sb-x", "", "", "", 0, 0, 0, 0, {}, 0, 0, 0, 0, "")).exec("true")
        with self.assertRaises(dsec.InvalidArgument):
            c.create(vcpus=-1)
        with self.assertRaises(dsec.InvalidArgument):
            c.create(ttl=-1)
        # A restore takes only a snapshot directory this node wrote.
        with self.assertRaises(dsec.InvalidArgument) as e:
            c.restore("snapshots/relative")
        self.assertIn("absolute path", e.exception.details)
        with self.assertRaises(dsec.InvalidArgument) as e:
            asyncio.run(self._restore_async("/nonexistent-snapshot"))
        self.assertIn("sandbox.json", e.exception.details)
        with c.create(memory_mib=64, disk_mib=1024) as sb:
            with self.assertRaises(dsec.InvalidArgument) as e:
                sb.read_file(b"/tmp/\xff\xfe")
            self.assertIn("UTF-8", e.exception.details)
            with self.assertRaises(dsec.InvalidArgument):
                sb.write_file("relative/path", b"x")
            with self.assertRaises(dsec.NotFound):
                sb.read_file("/does/not/exist")
            # A negative timeout is refused by the SDK before the call, clearly (it used to
            # surface as gRPC's opaque "Exception iterating requests").
            with self.assertRaises(dsec.InvalidArgument) as e:
                sb.exec("true", timeout=-1)
            self.assertIsInstance(e.exception, ValueError)
            self.assertIn("timeout must be >= 0", e.exception.details)
            with self.assertRaises(dsec.InvalidArgument) as e:
                sb.exec("true", timeout=8 * 24 * 3600)
            self.assertIn("more than 7 days", e.exception.details)
            with self.assertRaises(dsec.InvalidArgument) as e:
                c.create(labels={"k": "v" * 257})
            self.assertIn("at most 256", e.exception.details)
            with self.assertRaises(dsec.Unimplemented) as e:
                c.create(allow_internet=True)
            self.assertIn("loopback only", e.exception.details)

            def two_gib():
                chunk = b"\0" * (1 << 20)
                for _ in range(2048):
                    yield chunk

            with self.assertRaises(dsec.ResourceExhausted) as e:
                sb.write_file("/big", two_gib())
            self.assertIn("disk is full", e.exception.details)
            # The sandbox still works after its disk filled up.
            sb.remove("/big")
            self.assertEqual(sb.exec("echo ok").text, "ok\n")

    async def _restore_async(self, snapshot: str) -> None:
        async with dsec.AsyncClient(self.client.target) as c:
            await c.restore(snapshot)

    def test_ttl_reaping_frees_everything(self):
        sb = self.client.create(memory_mib=64, ttl=1)
        pid = sb.info.pid
        self.assertTrue(os.path.exists(f"/proc/{pid}"))
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                self.client.get(sb.id)
            except dsec.NotFound:
                break
            time.sleep(0.1)
        else:
            self.fail("sandbox not reaped within 10 s of its 1 s TTL")
        time.sleep(0.2)
        self.assertFalse(os.path.exists(f"/proc/{pid}"))
        self.assertClean()


class PtyTest(NodeTest):
    """Exec on a pseudo-terminal: tty detection, sizes, resizes, ^C, bad sizes."""

    def tearDown(self):
        for sb in self.client.list():
            try:
                sb.delete()
            except dsec.DsecError:
                pass

    def test_pty_exec_and_resize(self):
        with self.client.create(memory_mib=64) as sb:
            r = sb.exec("tty; test -t 0 && echo stdin-tty; echo err >&2; echo $TERM",
                        pty=dsec.Pty(24, 80))
            lines = r.text.replace("\r", "").splitlines()
            self.assertEqual(r.exit_code, 0, r)
            self.assertTrue(lines[0].startswith("/dev/pts/"), lines)
            self.assertEqual(lines[1:], ["stdin-tty", "err", "xterm"])
            self.assertEqual(r.stderr, b"")
            r = sb.exec("tty")
            self.assertEqual((r.exit_code, r.text), (1, "not a tty\n"))
            r = sb.exec("stty size; echo $TERM", pty=dsec.Pty(7, 33, term="vt100"))
            self.assertEqual(r.text, "7 33\r\nvt100\r\n")
            r = sb.exec("echo $TERM", pty=dsec.Pty(term="vt100"), env={"TERM": "dumb"})
            self.assertEqual(r.text, "dumb\r\n")

            s = sb.exec_stream("stty size; echo ready; read line; stty size", stdin=True,
                               pty=dsec.Pty(33, 111))
            self.assertIn(b"33 111", s.read_until(b"ready"))
            s.resize(50, 200)
            s.write(b"go\n")
            r = s.wait()
            self.assertEqual(r.text.replace("\r", ""), "go\n50 200\n")
            self.assertEqual(r.exit_code, 0)

            s = sb.exec_stream("echo sleeping; exec sleep 30", stdin=True, pty=dsec.Pty())
            s.read_until(b"sleeping")
            time.sleep(0.2)
            t0 = time.monotonic()
            s.write(b"\x03")
            r = s.wait()
            self.assertTrue(r.signal == 2 or r.exit_code == 130, r)
            self.assertLess(time.monotonic() - t0, 5)

    def test_bad_sizes_are_invalid_argument(self):
        with self.client.create(memory_mib=64) as sb:
            for rows, cols in ((0, 80), (24, 0), (4097, 80), (24, 70000)):
                with self.assertRaises(dsec.InvalidArgument) as cm:
                    sb.exec("true", pty=dsec.Pty(rows, cols))
                self.assertIn("1..=4096", cm.exception.details)
            s = sb.exec_stream("echo ready; exec sleep 30", stdin=True, pty=dsec.Pty())
            s.read_until(b"ready")
            s.resize(5000, 80)
            with self.assertRaises(dsec.InvalidArgument):
                s.wait()
            with self.assertRaises(dsec.DsecError):
                s.write(b"late")

    def test_pty_flood_is_bounded(self):
        """A flood through a PTY goes through the same bounded pump as pipes: the call
        finishes, the client keeps only output_limit bytes, the sandbox's memory holds."""
        flood = 64 << 20
        with self.client.create(memory_mib=64) as sb:
            t0 = time.time()
            r = sb.exec(f"stty raw; head -c {flood} /dev/zero; echo", pty=dsec.Pty(),
                        output_limit=4096, timeout=120)
            took = time.time() - t0
            self.assertEqual(r.exit_code, 0, r)
            self.assertEqual(r.stdout, bytes(4096))
            # The agent is PID 1 of the container: its peak RSS shows nothing piled up.
            hwm = sb.exec("grep VmHWM /proc/1/status").text.split()
            peak_kib = int(hwm[1])
            print(f"\n{flood >> 20} MiB through a pty: {took:.1f} s, agent peak RSS {peak_kib >> 10} MiB")
            self.assertLess(peak_kib, 32 << 10)

    def test_async_pty_and_resize(self):
        async def main():
            async with dsec.AsyncClient(self.client.target) as c:
                sb = await c.create(memory_mib=64)
                try:
                    r = await sb.exec("stty size", pty=dsec.Pty(10, 20))
                    self.assertEqual(r.text, "10 20\r\n")
                    s = sb.exec_stream("trap 'stty size; exit 0' WINCH; echo ready; "
                                       "while :; do sleep 0.05; done", stdin=True,
                                       pty=dsec.Pty(20, 60))
                    await s.read_until(b"ready")
                    await s.resize(30, 70)
                    r = await asyncio.wait_for(s.wait(), 10)
                    self.assertEqual(r.text, "30 70\r\n")
                    self.assertEqual(r.exit_code, 0)
                finally:
                    await sb.delete()

        asyncio.run(main())


class AdmissionTest(NodeTest):
    extra_args = ("--memory-mib", "600", "--overcommit-memory", "1")

    def test_memory_budget_refuses_with_resource_exhausted(self):
        # A container reserves memory + its disk (a tmpfs charged to its memory): 272 MiB.
        a = self.client.create(memory_mib=256, disk_mib=16)
        self.assertEqual(a.info.memory_limit_bytes, 272 << 20)
        b = self.client.create(memory_mib=256, disk_mib=16)
        with self.assertRaises(dsec.ResourceExhausted) as e:
            self.client.create(memory_mib=256, disk_mib=16)
        self.assertIn("memory budget spent: 544 of 600", e.exception.details)
        a.delete()
        c = self.client.create(memory_mib=256, disk_mib=16)
        for sb in (b, c):
            sb.delete()


class RestartTest(unittest.TestCase):
    def test_sigkill_readopts_running_and_leaks_nothing(self):
        daemon = Daemon("restart")
        client = None
        try:
            client = daemon.start()
            running = [client.create(memory_mib=64) for _ in range(5)]
            for sb in running:
                sb.session().run("cd /tmp && echo state > mark")
            running[0].pause()
            # Creates in flight when the daemon dies.
            errors = []

            def creator():
                try:
                    c = dsec.Client(client.target)
                    c.create(memory_mib=64)
                except dsec.DsecError as e:
                    errors.append(e)

            threads = [threading.Thread(target=creator) for _ in range(20)]
            for t in threads:
                t.start()
            time.sleep(0.05)
            daemon.kill()
            for t in threads:
                t.join()
            pids = {sb.id: sb.info.pid for sb in running}
            for pid in pids.values():
                self.assertTrue(os.path.exists(f"/proc/{pid}"), "sandbox died with the daemon")
            client.close()
            client = daemon.start()
            adopted = {sb.id: sb for sb in client.list()}
            for sb in running:
                self.assertIn(sb.id, adopted)
                self.assertEqual(adopted[sb.id].info.pid, pids[sb.id])
            self.assertEqual(adopted[running[0].id].info.state, "paused")
            adopted[running[0].id].resume()
            for sb in running:
                self.assertEqual(client.get(sb.id).read_file("/tmp/mark"), b"state\n")
            # Everything on the host belongs to an adopted sandbox: processes, dirs, cgroups.
            dirs = set(os.listdir(daemon.sandboxes_dir))
            self.assertEqual(dirs, set(adopted))
            cgs = {os.path.basename(p) for p in cgroup_dirs(daemon.tag)}
            self.assertEqual(cgs, set(adopted))
            owners = set()
            for pid in procs_referencing(daemon.sandboxes_dir):
                for name in ("cmdline", "environ"):
                    with open(f"/proc/{pid}/{name}", "rb") as f:
                        cmd = f.read().decode(errors="replace")
                    if daemon.sandboxes_dir in cmd:
                        owners.add(cmd.split(daemon.sandboxes_dir, 1)[1].split("/")[0].split("\0")[0])
                        break
            self.assertEqual(owners, set(adopted))
            print(f"\nadopted {len(adopted)} sandboxes ({len(running)} running before, "
                  f"{len(adopted) - len(running)} creates completed in flight, "
                  f"{len(errors)} failed with the daemon)")
            for sb in list(adopted.values()):
                sb.delete()
            self.assertEqual(procs_referencing(daemon.sandboxes_dir), [])
            self.assertEqual(os.listdir(daemon.sandboxes_dir), [])
        finally:
            leftovers = daemon.cleanup(client)
            if client:
                client.close()
        self.assertEqual(leftovers, [])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pattern(n: int, seed: int) -> bytes:
    """Deterministic bytes that do not compress into a lucky pass."""
    import random
    return random.Random(seed).randbytes(n)


class PortsTest(NodeTest):
    """Servers inside sandboxes: port streams (sync and async) and the HTTP entry point."""

    extra_args = ("--http", f"127.0.0.1:{free_port()}")

    def tearDown(self):
        for sb in self.client.list():
            try:
                sb.delete()
            except dsec.DsecError:
                pass

    def start_httpd(self, sb, index: bytes, big: bytes):
        sb.write_file("/www/index.html", index, create_parents=True)
        sb.write_file("/www/big.bin", big)
        # Without -f httpd daemonizes, so the exec returns.
        self.assertEqual(sb.exec("busybox httpd -p 127.0.0.1:8080 -h /www").exit_code, 0)
        deadline = time.time() + 10
        while True:
            try:
                with sb.open_port(8080) as s:
                    s.close_write()
                    s.read_all()
                return
            except dsec.Unavailable:
                self.assertLess(time.time(), deadline, "httpd never listened")
                time.sleep(0.05)

    @staticmethod
    def body(response: bytes) -> bytes:
        head, _, body = response.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1."), head[:100]
        assert b" 200 " in head.split(b"\r\n")[0], head[:100]
        return body

    def get(self, sb, path: str) -> bytes:
        with sb.open_port(8080) as s:
            s.send(f"GET {path} HTTP/1.0\r\nHost: x\r\n\r\n".encode())
            s.close_write()
            return self.body(s.read_all())

    def test_http_server_in_sandbox(self):
        big = pattern(1 << 20, 3)
        with self.client.create(memory_mib=64) as a, self.client.create(memory_mib=64) as b:
            self.start_httpd(a, b"page of A\n", big)
            self.start_httpd(b, b"page of B\n", b"small")
            # Sync port streams; the same port in two sandboxes stays apart.
            self.assertEqual(self.get(a, "/index.html"), b"page of A\n")
            self.assertEqual(self.get(b, "/index.html"), b"page of B\n")
            self.assertTrue(self.get(a, "/big.bin") == big, "1 MiB body differs")

            # The URL helper and a real HTTP client on the entry point.
            u = a.port_url(8080)
            self.assertEqual(len(a.info.access_token), 32)
            self.assertEqual(u.access_token, a.info.access_token)
            self.assertEqual(u.host, f"8080-{a.id}-{a.info.access_token}.localhost")
            self.assertEqual(a.url(8080), u.url)
            self.assertTrue(u.url.startswith(f"http://{u.host}:"), u.url)
            host, port = u.address.rsplit(":", 1)
            for sb, expected in ((a, b"page of A\n"), (b, b"page of B\n")):
                conn = http.client.HTTPConnection(host, int(port), timeout=20)
                conn.request("GET", "/index.html", headers={"Host": sb.port_url(8080).host})
                r = conn.getresponse()
                self.assertEqual((r.status, r.read()), (200, expected))
                conn.close()
            conn = http.client.HTTPConnection(host, int(port), timeout=20)
            conn.request("GET", "/big.bin", headers={"Host": u.host})
            r = conn.getresponse()
            self.assertEqual(r.status, 200)
            self.assertTrue(r.read() == big, "1 MiB body through the entry point differs")
            conn.close()
            # Private by default: no token, or another sandbox's, is 401 like an unknown
            # sandbox; the header works as well as the host name; public ports need none.
            def status(host_header, token=None):
                conn = http.client.HTTPConnection(host, int(port), timeout=20)
                headers = {"Host": host_header}
                if token:
                    headers["X-Dsec-Access-Token"] = token
                conn.request("GET", "/index.html", headers=headers)
                r = conn.getresponse()
                out = (r.status, r.read())
                conn.close()
                return out

            code, body = status(f"8080-{a.id}.localhost")
            self.assertEqual(code, 401)
            self.assertIn(b"X-Dsec-Access-Token", body)
            self.assertEqual(status(f"8080-{a.id}.localhost", b.info.access_token)[0], 401)
            self.assertEqual(status("8080-sb-000000000000.localhost"), (code, body))
            self.assertEqual(status(f"8080-{a.id}.localhost", a.info.access_token),
                             (200, b"page of A\n"))
            self.assertEqual(a.set_port_public(8080), [8080])
            self.assertEqual(status(f"8080-{a.id}.localhost"), (200, b"page of A\n"))
            self.assertEqual(a.port_url(8080).host, f"8080-{a.id}.localhost")
            self.assertEqual(a.set_port_public(8080, False), [])
            self.assertEqual(status(f"8080-{a.id}.localhost")[0], 401)

            # asyncio: the same through AsyncSandbox.
            async def main():
                async with dsec.AsyncClient(self.client.target) as client:
                    sb = await client.get(a.id)
                    async with await sb.open_port(8080) as s:
                        await s.send(b"GET /big.bin HTTP/1.0\r\n\r\n")
                        await s.close_write()
                        got = self.body(await s.read_all())
                    self.assertTrue(got == big, "1 MiB body over the async stream differs")
                    self.assertEqual(await sb.url(8080), u.url)
                    with self.assertRaises(dsec.Unavailable) as e:
                        await sb.open_port(8081)
                    self.assertIn(f"nothing listens on port 8081 in sandbox {a.id}",
                                  e.exception.details)
            asyncio.run(main())

            # Errors name what is wrong.
            with self.assertRaises(dsec.Unavailable) as e:
                a.open_port(8081)
            self.assertIn("nothing listens on port 8081", e.exception.details)
            for port in (0, -1, 65536):
                with self.assertRaises(dsec.InvalidArgument):
                    a.open_port(port)
            with self.assertRaises(dsec.NotFound):
                dsec.PortStream("sb-000000000000", 80, self.client._ports)
            # Raw stub: the first message must be `open`.
            import grpc
            from dsec import dsec_pb2 as pb
            with self.assertRaises(grpc.RpcError) as e:
                list(self.client._ports.Open(iter([pb.PortRequest(data=b"x")])))
            self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn("must be `open`", e.exception.details())
            a.pause()
            with self.assertRaises(dsec.FailedPrecondition):
                a.open_port(8080)
            a.resume()
            self.assertEqual(self.get(a, "/index.html"), b"page of A\n")
        self.assertClean()


if __name__ == "__main__":
    unittest.main()


NET_BRIDGE = f"dtpy{os.getpid() % 100000}"


class NetworkTest(NodeTest):
    """Network policies through the SDK on a node with a sandbox network (its own bridge,
    pool and nftables table, removed when the daemon stops cleanly and again here)."""

    extra_args = ("--net-bridge", NET_BRIDGE, "--net-pool", "10.229.0.0/16")

    @classmethod
    def tearDownClass(cls):
        try:
            super().tearDownClass()
        finally:
            subprocess.run(["nft", "delete", "table", "inet", NET_BRIDGE], stderr=subprocess.DEVNULL)
            subprocess.run(["ip", "link", "del", NET_BRIDGE], stderr=subprocess.DEVNULL)
            shutil.rmtree(f"/run/dsec-net/{NET_BRIDGE}", ignore_errors=True)

    def test_set_network_policy(self):
        with self.client.create(memory_mib=64, disk_mib=16) as sb:
            r = sb.exec(["ip", "-4", "addr", "show", "dev", "eth0"])
            self.assertEqual(r.exit_code, 0, r.stderr)
            self.assertIn(b"inet 10.229.", r.stdout)
            sb.set_network_policy(allow=["tcp:198.51.100.0/24:80-443"], deny=["198.51.100.7"])
            sb.set_network_policy()
            for allow, needle in ((["10.0.0.1/8"], "host bits"),
                                  (["tcp:1.2.3.4:70000"], "1-65535"),
                                  (["nosuch"], "unknown named network policy")):
                with self.assertRaises(dsec.InvalidArgument) as err:
                    sb.set_network_policy(allow=allow)
                self.assertIn(needle, str(err.exception))
            with self.assertRaises(ValueError):
                sb.set_network_policy(allow="tcp:1.2.3.4:80")

    def test_set_network_policy_by_labels(self):
        def allowed(sb) -> str:
            # The node-wide allow set's elements are `sandbox . destination . proto . port`.
            r = sb.exec(["ip", "-4", "addr", "show", "dev", "eth0"])
            addr = r.stdout.split(b"inet ")[1].split(b"/")[0].decode()
            listing = subprocess.run(["nft", "list", "set", "inet", NET_BRIDGE, "allow"],
                                     capture_output=True, text=True, check=True).stdout
            body = listing.split("elements = {", 1)[-1].split("}", 1)[0]
            return " ".join(e for e in (e.strip() for e in body.split(","))
                            if e.startswith(f"{addr} . "))

        sbs = [self.client.create(memory_mib=64, disk_mib=16, labels=labels)
               for labels in ({"task": "t1"}, {"task": "t1", "x": "y"}, {"task": "t2"})]
        try:
            changed = self.client.set_network_policy_by_labels(
                {"task": "t1"}, allow=["tcp:198.51.100.0/24:443"])
            self.assertEqual(sorted(s.id for s in changed), sorted(s.id for s in sbs[:2]))
            for sb, has in zip(sbs, (True, True, False)):
                self.assertEqual("198.51.100.0" in allowed(sb), has, sb.id)
            with self.assertRaises(ValueError):
                self.client.set_network_policy_by_labels({})
        finally:
            for sb in sbs:
                sb.delete()
