"""The Python SDK against a real dsec-edge daemon (container backend; run as root).

    DSEC_EDGE_BIN=target/release/dsec-edge python3 -m unittest discover -s sdk/python/tests -v

Each test class starts its own daemon on a private state directory and cgroup name, and the
teardown removes every process, cgroup and directory it created, also after a failure.
"""

import asyncio
import os
import shutil
import signal
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
    """Pids whose command line contains ``text``."""
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if text.encode() in cmd:
            found.append(int(d))
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
            sb = await client.create(memory_mib=64, labels={"batch": "100"})
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
        with c.create(memory_mib=64, disk_mib=1024) as sb:
            with self.assertRaises(dsec.InvalidArgument) as e:
                sb.read_file(b"/tmp/\xff\xfe")
            self.assertIn("UTF-8", e.exception.details)
            with self.assertRaises(dsec.InvalidArgument):
                sb.write_file("relative/path", b"x")
            with self.assertRaises(dsec.NotFound):
                sb.read_file("/does/not/exist")

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


class AdmissionTest(NodeTest):
    extra_args = ("--memory-mib", "600", "--overcommit-memory", "1")

    def test_memory_budget_refuses_with_resource_exhausted(self):
        a = self.client.create(memory_mib=256)
        b = self.client.create(memory_mib=256)
        with self.assertRaises(dsec.ResourceExhausted) as e:
            self.client.create(memory_mib=256)
        self.assertIn("memory budget spent", e.exception.details)
        a.delete()
        c = self.client.create(memory_mib=256)
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
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().decode(errors="replace")
                owners.add(cmd.split(daemon.sandboxes_dir, 1)[1].split("/")[0].split("\0")[0])
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


if __name__ == "__main__":
    unittest.main()
