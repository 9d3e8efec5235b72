#!/usr/bin/env python3
"""Cluster test with real processes and real network namespaces (root), with the cluster's
TLS everywhere (CA from `dsec control init`, node certificates, https clients):

- a 3-member etcd cluster on loopback, 2 apiservers (`dsec control up`) on a test bridge's
  address, 3 nodes (`dsec up --node-name nK`, container backend), each in its own network
  namespace with its own address on a veth attached to that bridge;
- through the Python SDK against both apiservers: 60 concurrent creates spread over the 3
  nodes; exec, files and ports through the apiserver; a viewer cannot create, a revoked token
  is refused, project B cannot see or touch project A's sandboxes; the 11th sandbox of a
  10-sandbox project is refused, a child cannot get more than its parent has;
- transport security: plaintext and CA-less clients, callers without a cluster certificate
  at a node, a node with another CA's certificate: all refused;
- bad input: malformed tokens, unknown projects, ids that name no node, quotas that do not
  add up: each a clear status;
- faults, each with nothing lost and no quota leaked (usage == live sandboxes, up to the
  reservations of creates cut off with a killed apiserver): SIGKILL of one apiserver during a
  burst (the clients go on on the other), SIGKILL of one etcd member, SIGKILL of a node (its
  sandboxes LOST after the lease, new creates elsewhere, back when it restarts), a node's
  link down and up, the whole control plane (etcd + apiservers) stopped and started again;
- the multi-node image store: a GlusterFS volume (glusterd and its brick in a test host's
  namespace of their own), mounted with `mount -t glusterfs` in each node's namespace at its
  layer store (DSEC_LAYERFS_STORE); an image imported through n1 is created from on n2 and n3
  (fetched through their own caches); with the gluster server stopped, a node that ran the
  image still creates from its cache, one that did not fails with a clear error;
- every sandbox deleted at the end; every process, mount, netns, link and directory removed,
  also on failure.

Run: cargo build -p dsec-cli -p dsec-agent && python3 control/tests/cluster.py
(DSEC_BIN overrides target/debug/dsec; DSEC_KEEP_LOGS=1 keeps the logs). Every wait is
bounded; about 2 minutes.
"""

import concurrent.futures as futures
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "sdk" / "python"))
import dsec  # noqa: E402

DSEC = os.environ.get("DSEC_BIN") or str(REPO / "target" / "debug" / "dsec")
NODES = ["n1", "n2", "n3"]
ETCD = ["e1", "e2", "e3"]
BRIDGE = "dsecct0"
GLUSTER_NS = "dsecct-gl"
VOLUME = "dsec-layers"
SHARED_IMAGE = "shared-bb"
TTL = 3
SMALL = dict(backend="container", memory_mib=64, disk_mib=64)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what, check, timeout=30.0):
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        try:
            if check():
                return
        except Exception as e:  # noqa: BLE001 - not up yet
            last = e
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what} (last error: {last!r})")


def ip(*args, check=True):
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if check and r.returncode != 0:
        raise AssertionError(f"ip {' '.join(args)}: {r.stderr}")
    return r


def free_subnet() -> str:
    """A 10.X.77.0/24 no host address or route touches."""
    used = ip("-4", "addr").stdout + ip("-4", "route").stdout
    for x in range(200, 250):
        if f"10.{x}." not in used:
            return f"10.{x}.77"
    raise AssertionError("no free 10.X.77.0/24 for the test network")


class Cluster:
    def __init__(self):
        self.dir = Path(tempfile.mkdtemp(prefix="dsec-cluster-"))
        self.procs = {}
        self.net = free_subnet()
        self.gateway = f"{self.net}.1"
        self.etcd_client = {e: f"http://127.0.0.1:{free_port()}" for e in ETCD}
        self.etcd_peer = {e: f"http://127.0.0.1:{free_port()}" for e in ETCD}
        self.api = [f"{self.gateway}:{free_port()}" for _ in range(2)]
        self.node_ip = {n: f"{self.net}.{11 + i}" for i, n in enumerate(NODES)}
        self.node_addr = {n: f"{self.node_ip[n]}:7070" for n in NODES}
        self.admin_token = ""
        self.tls = self.dir / "tls"
        self.ca = str(self.tls / "ca.pem")
        self.netns = []
        self.links = []
        self.gluster_ip = f"{self.net}.5"
        self.gluster = self.dir / "gluster"
        self.gluster_mounts = []

    # ------------------------------------------------------------ network

    def make_network(self):
        ip("link", "add", BRIDGE, "type", "bridge")
        self.links.append(BRIDGE)
        ip("addr", "add", f"{self.gateway}/24", "dev", BRIDGE)
        ip("link", "set", BRIDGE, "up")
        hosts = {f"dsecct-{n}": self.node_ip[n] for n in NODES}
        hosts[GLUSTER_NS] = self.gluster_ip
        for ns, addr in hosts.items():
            veth = ns
            ip("netns", "add", ns)
            self.netns.append(ns)
            ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self.links.append(veth)
            ip("link", "set", veth, "master", BRIDGE, "up")
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", ns, "link", "set", "lo", "up")

    def remove_network(self):
        for ns in self.netns:
            ip("netns", "del", ns, check=False)
        for link in reversed(self.links):
            ip("link", "del", link, check=False)

    # ------------------------------------------------------------ image store

    def gluster_cli(self, *args):
        r = subprocess.run(["nsenter", f"--net=/run/netns/{GLUSTER_NS}", "--", "gluster",
                            f"--glusterd-sock={self.gluster / 'glusterd.socket'}",
                            f"--log-file={self.gluster / 'cli.log'}", "--mode=script", *args],
                           capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise AssertionError(f"gluster {' '.join(args)}: {r.stdout}{r.stderr}")
        return r.stdout

    def start_glusterd(self):
        """glusterd in the gluster host's namespace, its state and sockets under the test
        dir; on a restart it starts the volume's brick again."""
        self.gluster.mkdir(exist_ok=True)
        vol = self.gluster / "glusterd.vol"
        vol.write_text(f"""volume management
    type mgmt/glusterd
    option working-directory {self.gluster / 'state'}
    option run-directory {self.gluster / 'run'}
    option glusterd-sockfile {self.gluster / 'glusterd.socket'}
    option transport-type socket
    option transport.address-family inet
    option event-threads 1
    option ping-timeout 0
end-volume
""")
        self.spawn("glusterd", ["glusterd", "-N", "-f", str(vol), "-l",
                                str(self.gluster / "glusterd.log")], netns=GLUSTER_NS)
        wait_for("glusterd", lambda: self.gluster_cli("volume", "list") is not None, 30)

    def brick_pids(self):
        pids = []
        for f in (self.gluster / "run").glob("vols/*/*.pid"):
            try:
                pids.append(int(f.read_text().strip()))
            except (OSError, ValueError):
                pass
        return pids

    def stop_gluster_server(self):
        """glusterd and the brick process: the volume's whole server side."""
        if "glusterd" in self.procs:
            self.kill("glusterd")
        for pid in self.brick_pids():
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                os.kill(pid, signal.SIGKILL)
            except (OSError, ProcessLookupError):
                continue
            # Its control socket is outside the test dir (-S /var/run/gluster/HASH.socket).
            if b"-S" in argv[:-1]:
                Path(os.fsdecode(argv[argv.index(b"-S") + 1])).unlink(missing_ok=True)

    def start_image_store(self):
        """A one-brick GlusterFS volume on the gluster host, mounted in each node's namespace
        at the node's layer store."""
        self.start_glusterd()
        brick = self.gluster / "brick"
        brick.mkdir()
        self.gluster_cli("volume", "create", VOLUME, f"{self.gluster_ip}:{brick}", "force")
        self.gluster_cli("volume", "start", VOLUME)
        for n in NODES:
            store = self.dir / f"{n}-store"
            store.mkdir()
            subprocess.run(["nsenter", f"--net=/run/netns/dsecct-{n}", "--", "mount", "-t",
                            "glusterfs", "-o", f"log-file={self.gluster / f'{n}-client.log'}",
                            f"{self.gluster_ip}:/{VOLUME}", str(store)],
                           check=True, capture_output=True, timeout=60)
            self.gluster_mounts.append(store)

    def stop_image_store(self):
        for store in self.gluster_mounts:
            r = subprocess.run(["umount", str(store)], capture_output=True, timeout=30)
            if r.returncode != 0:
                subprocess.run(["umount", "-l", str(store)], capture_output=True, timeout=30)
        self.gluster_mounts = []
        self.stop_gluster_server()
        # What the brick process leaves outside the test dir: its log, named after the brick.
        brick_log = str(self.gluster / "brick").strip("/").replace("/", "-") + ".log"
        Path("/var/log/glusterfs/bricks", brick_log).unlink(missing_ok=True)

    # ------------------------------------------------------------ processes

    def spawn(self, name, argv, env=None, netns=None):
        if netns:
            # Only the network namespace: `ip netns exec` would remount /sys (and hide the
            # cgroups the node needs).
            argv = ["nsenter", f"--net=/run/netns/{netns}", "--", *argv]
        log = open(self.dir / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen(
            argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, **(env or {})})

    def kill(self, name, sig=signal.SIGKILL):
        p = self.procs.pop(name)
        p.send_signal(sig)
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

    def cli(self, *args, token=None, check=True):
        # The CLI talks to one apiserver: the first one running.
        up = [a for i, a in enumerate(self.api) if f"api{i}" in self.procs] or self.api
        env = {**os.environ, "DSEC_TOKEN": token or self.admin_token,
               "DSEC_ENDPOINT": f"https://{up[0]}", "DSEC_CA_FILE": self.ca,
               "XDG_CONFIG_HOME": str(self.dir)}
        r = subprocess.run([DSEC, *args], capture_output=True, text=True, env=env, timeout=30)
        if check and r.returncode != 0:
            raise AssertionError(f"dsec {' '.join(args)}: {r.returncode} {r.stderr}")
        return r

    def start_etcd(self, e, state="new"):
        cluster = ",".join(f"{m}={self.etcd_peer[m]}" for m in ETCD)
        self.spawn(e, ["etcd", "--name", e, "--data-dir", str(self.dir / e),
                       "--listen-client-urls", self.etcd_client[e],
                       "--advertise-client-urls", self.etcd_client[e],
                       "--listen-peer-urls", self.etcd_peer[e],
                       "--initial-advertise-peer-urls", self.etcd_peer[e],
                       "--initial-cluster", cluster, "--initial-cluster-state", state,
                       "--initial-cluster-token", f"dsec-test-{self.dir.name}",
                       "--log-level", "warn"])

    def etcd_urls(self):
        return ",".join(self.etcd_client[e] for e in ETCD)

    def start_api(self, i):
        self.spawn(f"api{i}", [DSEC, "control", "up", "--etcd", self.etcd_urls(),
                               "--listen", self.api[i], "--node-ttl", str(TTL),
                               "--tls-dir", str(self.tls)])

    def start_control_plane(self, first=False):
        for e in ETCD:
            self.start_etcd(e, "new" if first else "existing")
        if first:
            init = None
            deadline = time.time() + 30
            while time.time() < deadline:
                init = subprocess.run([DSEC, "control", "init", "--etcd", self.etcd_urls(),
                                       "--org", "acme", "--admin", "root",
                                       "--tls-dir", str(self.tls), "--san", self.gateway],
                                      capture_output=True, text=True, timeout=30)
                if init.returncode == 0:
                    break
                time.sleep(0.3)
            assert init and init.returncode == 0, init.stderr if init else "no init"
            self.admin_token = init.stdout.strip()
        for i in range(len(self.api)):
            self.start_api(i)
        wait_for("the apiservers", lambda: self.cli("node", "ls", check=False).returncode == 0)

    def start(self):
        self.make_network()
        if HAVE_GLUSTER:
            self.start_image_store()
        self.start_control_plane(first=True)
        for n in NODES:
            self.issue_node(n, self.tls)
            self.start_node(n)
        wait_for("3 registered nodes", lambda: len(self.nodes()) == 3)

    def issue_node(self, n, ca_dir):
        subprocess.run([DSEC, "control", "issue-node", "--tls-dir", str(ca_dir), "--name", n,
                        "--out", str(self.dir / f"{n}-tls")],
                       check=True, capture_output=True, timeout=30)

    def start_node(self, n, addr=None):
        addr = addr or self.node_addr[n]
        self.spawn(n, [DSEC, "up", "--state-dir", str(self.dir / n), "--metrics", "off",
                       "--http", "off", "--cgroup-name", f"dsec-cluster-{n}",
                       "--default-backend", "container", "--memory-mib", "16384",
                       "--listen", addr, "--node-name", n, "--label", f"host={n}",
                       "--control", ",".join(self.api), "--tls-dir", str(self.dir / f"{n}-tls")],
                   env=self.layer_store_env(n), netns=f"dsecct-{n}" if n in NODES else None)

    def layer_store_env(self, n):
        """The node's layer store (its gluster mount, when there is one) and its own cache."""
        store = self.dir / f"{n}-store"
        return {"DSEC_LAYERFS_STORE": str(store), "DSEC_LAYERFS_CACHE": str(self.dir / f"{n}-cache")}

    def nodes(self):
        r = self.cli("--json", "node", "ls", check=False)
        return [json.loads(line) for line in r.stdout.splitlines() if line.strip()]

    def node_names(self):
        return sorted(n["name"] for n in self.nodes())

    def used(self, project):
        for line in self.cli("--json", "project", "ls", "acme").stdout.splitlines():
            p = json.loads(line)
            if p["path"] == project:
                return p["used"]["sandboxes"]
        raise AssertionError(f"project {project} not listed")

    def client(self, token=None, project="acme/a"):
        return dsec.Client(",".join(f"https://{a}" for a in self.api),
                           token=token or self.admin_token, project=project, ca_file=self.ca)

    def stop(self):
        order = ["n1", "n2", "n3", "n4", "api0", "api1", *ETCD]
        for name in order + [n for n in self.procs if n not in order]:
            if name in self.procs:
                self.kill(name, signal.SIGTERM)
        for n in NODES + ["n4"]:
            for root, dirs, _ in os.walk("/sys/fs/cgroup"):
                if os.path.basename(root) == f"dsec-cluster-{n}":
                    remove_cgroup_tree(root)
                    dirs[:] = []
                elif root.count("/") > 8:
                    dirs[:] = []
        self.stop_image_store()
        self.remove_network()
        if os.environ.get("DSEC_KEEP_LOGS"):
            print(f"logs kept in {self.dir}")
        else:
            shutil.rmtree(self.dir, ignore_errors=True)


def remove_cgroup_tree(top):
    """Kills what still runs under the cgroup `top` (sandboxes of a node stopped by a failed
    test outlive it, as they do a daemon restart) and removes its groups, deepest first."""
    for _ in range(50):
        pids = []
        for root, _, files in os.walk(top):
            if "cgroup.procs" in files:
                try:
                    pids += Path(root, "cgroup.procs").read_text().split()
                except OSError:
                    pass
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (OSError, ValueError):
                pass
        time.sleep(0.1)
    for root, _, _ in sorted(os.walk(top), key=lambda w: -w[0].count("/")):
        try:
            os.rmdir(root)
        except OSError:
            pass


HAVE_GLUSTER = shutil.which("glusterd") is not None


def on_host(cluster, project, n, image=SHARED_IMAGE):
    """A sandbox of `image` created through the apiserver on node `n` (its `host` label)."""
    req = dsec.client._create_request("container", image, 0, 64, 64, None, 0, 0, None, 0,
                                      False, None)
    req.node_labels["host"] = n
    return project._create(req)


def check_image_store(cluster, a, made):
    """Nodes share one layer store on a GlusterFS volume: an image imported through n1 runs
    on n2 and n3; with the gluster server down a node that ran the image still creates from
    its own cache and one that did not gets a clear error."""
    if not HAVE_GLUSTER:
        assert not os.environ.get("CI"), "glusterfs-server is not installed (setup.sh installs it)"
        print("*** SKIPPED: the multi-node image store (apt-get install glusterfs-server) ***")
        return
    mounts = Path("/proc/mounts").read_text()
    for n in NODES:
        assert f" {cluster.dir / f'{n}-store'} fuse.glusterfs " in mounts, n
    tree = cluster.dir / "shared-tree"
    (tree / "bin").mkdir(parents=True)
    (tree / "etc").mkdir()
    shutil.copy("/bin/busybox", tree / "bin" / "busybox")
    for applet in ["sh", "cat", "echo"]:
        os.symlink("busybox", tree / "bin" / applet)
    (tree / "etc" / "motd").write_text("imported through n1\n")
    subprocess.run(["nsenter", "--net=/run/netns/dsecct-n1", "--", DSEC, "--json", "image",
                    "import", "--dir", str(tree), "--name", SHARED_IMAGE],
                   check=True, capture_output=True, timeout=120,
                   env={**os.environ, **cluster.layer_store_env("n1")})
    # The chunks are on the gluster brick, not in a node's directory.
    assert any((cluster.gluster / "brick" / "chunks").rglob("*")), "no chunk on the brick"

    first = [on_host(cluster, a, n) for n in ["n2", "n3"]]
    made += first
    for sb, n in zip(first, ["n2", "n3"]):
        assert sb.id.startswith(f"sb-{n}-"), sb.id
        assert sb.exec("cat /etc/motd").stdout == b"imported through n1\n"
        assert any((cluster.dir / f"{n}-cache").glob("chunks/*")), f"{n} cached nothing"
    # n2 keeps nothing mounted: its next create mounts the image again from its cache.
    first[0].delete()
    made.remove(first[0])

    cluster.stop_gluster_server()
    store = cluster.dir / "n2-store"
    wait_for("the gluster mounts to lose their server",
             lambda: refused(lambda: os.stat(store), OSError), 15)
    cached = on_host(cluster, a, "n2")
    made.append(cached)
    assert cached.exec("cat /etc/motd").stdout == b"imported through n1\n"
    e = status_of(lambda: on_host(cluster, a, "n1"))
    assert isinstance(e, dsec.FailedPrecondition), e
    assert "cannot read the layer store" in e.details and SHARED_IMAGE in e.details, e.details

    # The server back: every node reads the volume again.
    cluster.start_glusterd()
    wait_for("the gluster mounts back", lambda: not refused(lambda: os.stat(store), OSError), 30)
    made.append(on_host(cluster, a, "n1"))
    assert made[-1].exec("cat /etc/motd").stdout == b"imported through n1\n"
    print("image store: imported through n1, run on n2 and n3 from the gluster volume; "
          "server down: n2 created from its cache, n1 refused; server back: n1 runs it")


def refused(call, error):
    try:
        call()
    except error:
        return True
    return False


def status_of(call):
    try:
        call()
    except dsec.DsecError as e:
        return e
    raise AssertionError("the call succeeded")


def check_transport_security(cluster):
    """TLS for clients, mTLS between apiservers and nodes, a foreign node certificate refused."""
    import grpc
    from dsec import dsec_pb2 as pb, dsec_pb2_grpc as rpc

    # Plaintext to a TLS apiserver gets no answer; https without the CA is refused up front.
    plain = dsec.Client(cluster.api[0], token=cluster.admin_token, project="acme/a")
    assert refused(lambda: plain.list(), dsec.DsecError)
    no_ca = dict(os.environ)
    no_ca.pop("DSEC_CA_FILE", None)
    try:
        dsec.Client(f"https://{cluster.api[0]}", token=cluster.admin_token, ca_file="")
        raise AssertionError("an https client without a CA was made")
    except dsec.DsecError as e:
        assert "DSEC_CA_FILE" in e.details, e.details
    r = subprocess.run([DSEC, "--endpoint", f"https://{cluster.api[0]}", "node", "ls"],
                       capture_output=True, text=True, timeout=30,
                       env={**no_ca, "DSEC_TOKEN": cluster.admin_token,
                            "XDG_CONFIG_HOME": str(cluster.dir)})
    assert r.returncode != 0 and "DSEC_CA_FILE" in r.stderr, r.stderr

    # A node's TCP API takes only apiservers: the CA alone is not enough, nor another node's
    # certificate of the same CA; the apiservers' certificate is.
    with open(cluster.ca, "rb") as f:
        ca = f.read()

    def node_list(cert_dir=None, role="node"):
        key = cert = None
        if cert_dir:
            key = (cert_dir / f"{role}.key").read_bytes()
            cert = (cert_dir / f"{role}.pem").read_bytes()
        creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                             certificate_chain=cert)
        with grpc.secure_channel(cluster.node_addr["n1"], creds, options=[
                ("grpc.ssl_target_name_override", "n1.node.dsec")]) as ch:
            return rpc.SandboxesStub(ch).List(pb.ListSandboxesRequest(), timeout=5)

    try:
        node_list()
        raise AssertionError("a node answered a caller without a cluster certificate")
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.UNAVAILABLE, e
    try:
        node_list(cluster.dir / "n2-tls")
        raise AssertionError("node n1 answered node n2's certificate")
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.UNAVAILABLE, e
    assert len(node_list(cluster.tls, role="apiserver").sandboxes) >= 1
    with grpc.insecure_channel(cluster.node_addr["n1"]) as ch:
        try:
            rpc.SandboxesStub(ch).List(pb.ListSandboxesRequest(), timeout=5)
            raise AssertionError("a node answered plaintext on its TLS port")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e

    # A node with a certificate from another CA (that trusts this cluster's CA) is refused
    # and says why; it never joins.
    other = cluster.dir / "other-ca"
    subprocess.run([DSEC, "control", "init", "--state-dir", str(cluster.dir / "other-state"),
                    "--tls-dir", str(other)], check=True, capture_output=True, timeout=30)
    cluster.issue_node("n4", other)
    shutil.copy(cluster.ca, cluster.dir / "n4-tls" / "ca.pem")
    cluster.start_node("n4", f"127.0.0.1:{free_port()}")
    log = cluster.dir / "n4.log"
    wait_for("n4's refusal in its log",
             lambda: "closed the TLS connection" in log.read_text(errors="replace"), 20)
    assert "n4" not in [n["name"] for n in cluster.nodes()]
    p = cluster.procs.pop("n4")
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=10)
    print("TLS: plaintext and CA-less callers refused, node mTLS enforced (apiservers only), "
          "foreign node certificate refused")


def on_node(sandboxes):
    return {n: sum(1 for s in sandboxes if s.id.startswith(f"sb-{n}-")) for n in NODES}


class Usage:
    """No quota leaked: acme/a's sandbox usage equals what its List shows, plus at most the
    reservations of creates cut off with a killed apiserver (returned by the watcher's
    reconcile after its grace)."""

    def __init__(self, cluster, client):
        self.cluster, self.client, self.slack = cluster, client, 0

    def check(self, when, expect_live=None):
        # Node records and watcher changes settle within a heartbeat.
        deadline = time.time() + 15
        while True:
            try:
                live = len(self.client.list())
                used = self.cluster.used("acme/a")
            except (dsec.DsecError, AssertionError):
                live, used = -1, -1  # an apiserver or node still coming back
            ok = 0 <= live and 0 <= used - live <= self.slack \
                and (expect_live is None or live == expect_live)
            if ok or time.time() > deadline:
                break
            time.sleep(0.3)
        assert ok, f"{when}: {used} charged for {live} live sandboxes (slack {self.slack}, " \
                   f"expected {expect_live})"
        print(f"  usage after {when}: {used} charged, {live} live")
        return live


def whole_list(client, expected):
    """The List once it shows `expected` sandboxes: a List leaves out a node that does not
    answer in time."""
    got = []

    def check():
        got[:] = client.list()
        return len(got) == expected
    wait_for(f"a List of {expected} sandboxes", check, 15)
    return got


def check_bad_input(cluster, a):
    e = status_of(lambda: cluster.client(token="dsec_bad").list())
    assert isinstance(e, dsec.Unauthenticated), e
    e = status_of(lambda: cluster.client(token="dsec_" + "0" * 16 + "_" + "f" * 64).list())
    assert isinstance(e, dsec.Unauthenticated), e
    e = status_of(lambda: cluster.client(project="acme/nope").create(**SMALL))
    assert isinstance(e, dsec.NotFound) and "acme/nope" in e.details, e
    e = status_of(lambda: a.get("sb-zz-aaaaaaaaaaaa"))
    assert isinstance(e, dsec.Unavailable) and "zz" in e.details, e
    e = status_of(lambda: a.get("not-an-id"))
    assert isinstance(e, dsec.InvalidArgument), e
    # Quotas that do not add up: a child above its parent, a parent below what it delegated.
    cluster.cli("project", "create", "acme/p")
    cluster.cli("project", "create", "acme/p/c")
    cluster.cli("project", "quota", "acme/p", "--sandboxes", "10", "--vcpus", "10",
                "--mem", "10000", "--disk", "10000")
    r = cluster.cli("project", "quota", "acme/p/c", "--sandboxes", "11", check=False)
    assert r.returncode != 0 and "acme/p" in r.stderr, r.stderr
    cluster.cli("project", "quota", "acme/p/c", "--sandboxes", "6")
    r = cluster.cli("project", "quota", "acme/p", "--sandboxes", "5", check=False)
    assert r.returncode != 0 and "acme/p" in r.stderr, r.stderr
    print("bad input: malformed and unknown tokens, unknown project, ids naming no node, "
          "quotas that do not add up: refused")


def check_ports(sb):
    sb.write_file("/www/index.html", b"served through the apiserver\n", create_parents=True)
    assert sb.exec("busybox httpd -p 127.0.0.1:8080 -h /www").exit_code == 0

    def get():
        with sb.open_port(8080) as s:
            s.send(b"GET /index.html HTTP/1.0\r\n\r\n")
            s.close_write()
            return s.read_all()
    got = b""
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            got = get()
            break
        except dsec.Unavailable:
            time.sleep(0.1)
    assert got.endswith(b"served through the apiserver\n"), got[:200]


def main():
    cluster = Cluster()
    made = []
    forward_before = Path("/proc/sys/net/ipv4/ip_forward").read_text()
    # SIGTERM (e.g. a CI timeout) unwinds through the cleanup below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        t0 = time.time()
        cluster.start()
        print(f"cluster up in {time.time() - t0:.1f} s: etcd x3, apiservers {cluster.api}, "
              f"nodes {cluster.node_addr} (own netns each)")
        for project in ["acme/a", "acme/b", "acme/q"]:
            cluster.cli("project", "create", project)
        cluster.cli("project", "quota", "acme/a", "--sandboxes", "200", "--vcpus", "400",
                    "--mem", "1000000", "--disk", "1000000")
        cluster.cli("project", "quota", "acme/b", "--sandboxes", "10", "--vcpus", "10",
                    "--mem", "100000", "--disk", "100000")
        cluster.cli("project", "quota", "acme/q", "--sandboxes", "10", "--vcpus", "100",
                    "--mem", "100000", "--disk", "100000")
        for user, project, role in [("viewer", "acme/a", "viewer"), ("bob", "acme/b", "editor")]:
            cluster.cli("account", "create", f"user:{user}")
            cluster.cli("role", "grant", f"user:{user}", project, role)
        viewer = cluster.cli("token", "create", "--principal", "user:viewer").stdout.strip()
        bob = cluster.cli("token", "create", "--principal", "user:bob").stdout.strip()

        a = cluster.client()
        usage = Usage(cluster, a)

        # 60 concurrent creates spread over the 3 nodes.
        t0 = time.time()
        with futures.ThreadPoolExecutor(20) as pool:
            sbs = list(pool.map(lambda _: a.create(**SMALL), range(60)))
        made += sbs
        per_node = on_node(sbs)
        print(f"60 creates in {time.time() - t0:.1f} s: {per_node}")
        assert all(v >= 5 for v in per_node.values()), per_node
        assert len(a.list()) == 60

        # Exec, files and ports through the apiserver.
        sb = sbs[0]
        assert sb.exec("echo hi").stdout == b"hi\n"
        sb.write_file("/tmp/x", b"through the apiserver")
        assert sb.read_file("/tmp/x") == b"through the apiserver"
        check_ports(sb)

        check_transport_security(cluster)
        check_bad_input(cluster, a)
        before = len(made)
        check_image_store(cluster, a, made)
        for s in made[before:]:
            s.delete()
        del made[before:]

        # A viewer lists but cannot create; a revoked token is refused.
        v = cluster.client(token=viewer)
        assert len(v.list()) == 60
        assert refused(lambda: v.create(**SMALL), dsec.PermissionDenied)
        spare = cluster.cli("token", "create", "--description", "to revoke").stdout.strip()
        spare_id = spare.split("_")[1]
        assert len(cluster.client(token=spare).list()) == 60
        cluster.cli("token", "revoke", spare_id)
        # Each apiserver learns of it through its watch: refused within 500 ms everywhere
        # (the revocation bound, control/README.md "Authorization cache").
        revoked_at = time.monotonic()
        for _ in range(2):  # the client's list is balanced over both replicas
            while not refused(lambda: cluster.client(token=spare).list(), dsec.Unauthenticated):
                assert time.monotonic() - revoked_at < 0.5, "a revoked token still works"
                time.sleep(0.01)

        # Project B sees none of A's sandboxes and cannot touch them.
        b = cluster.client(token=bob, project="acme/b")
        assert b.list() == []
        assert refused(lambda: b.get(sb.id), dsec.PermissionDenied)
        assert refused(lambda: b.get(sb.id).exec("true"), dsec.PermissionDenied)
        assert refused(lambda: cluster.client(token=bob, project="acme/a").list(),
                       dsec.PermissionDenied)

        # The 11th sandbox of a 10-sandbox project is refused.
        q = cluster.client(project="acme/q")
        with futures.ThreadPoolExecutor(10) as pool:
            qs = list(pool.map(lambda _: q.create(**SMALL), range(10)))
        made += qs
        try:
            q.create(**SMALL)
            raise AssertionError("the 11th sandbox was created")
        except dsec.ResourceExhausted as e:
            assert "acme/q" in e.details and "sandboxes" in e.details, e.details
        usage.check("the first creates", 60)

        print("faults:")
        # SIGKILL of one apiserver during a burst: the clients go on on the other.
        burst = []
        with futures.ThreadPoolExecutor(10) as pool:
            jobs = [pool.submit(a.create, **SMALL) for _ in range(20)]
            time.sleep(0.2)
            cluster.kill("api0")
            for job in jobs:
                burst.append(job.result(timeout=60))
        made += burst
        assert len(burst) == 20
        assert burst[-1].exec("echo still").stdout == b"still\n"
        # A create cut off between its reservation and the node leaves a reservation the
        # watcher returns after its grace; a retried one may have made a second sandbox
        # (listed and charged).
        usage.slack = max(0, cluster.used("acme/a") - len(a.list()))
        assert usage.slack <= 10, usage.slack
        cluster.start_api(0)
        wait_for("api0 back", lambda: cluster.cli("node", "ls", check=False).returncode == 0)
        print(f"  SIGKILL api0 mid-burst: 20 of 20 creates done on api1 "
              f"({usage.slack} cut-off reservations)")
        live = usage.check("SIGKILL of an apiserver")

        # SIGKILL of one etcd member: the other two keep quorum.
        cluster.kill("e2")
        with futures.ThreadPoolExecutor(10) as pool:
            more = list(pool.map(lambda _: a.create(**SMALL), range(10)))
        made += more
        assert more[0].exec("echo quorum").stdout == b"quorum\n"
        cluster.start_etcd("e2", "existing")
        print("  SIGKILL etcd e2: 10 creates done on the other two members")
        live = usage.check("SIGKILL of an etcd member", live + 10)

        # SIGKILL of a node: after its lease its sandboxes are LOST and their quota returned,
        # new creates go elsewhere; when it comes back it re-registers with what it runs.
        mine = [s for s in made if s.id.startswith("sb-n2-")]
        mine_a = [s for s in mine if s in sbs + burst + more]
        # Counted from the List, not from `made`: a create cut off with api0 may still have
        # made its sandbox on n2.
        listed = [s.id for s in whole_list(a, live)]
        kept = sum(1 for i in listed if not i.startswith("sb-n2-"))
        cluster.kill("n2")
        wait_for("n2's lease to expire", lambda: "n2" not in cluster.node_names(), 4 * TTL)
        wait_for("n2's sandboxes LOST", lambda: a.get(mine_a[0].id).info.state == "lost", 4 * TTL)
        live = usage.check("SIGKILL of node n2", kept)
        with futures.ThreadPoolExecutor(10) as pool:
            elsewhere = list(pool.map(lambda _: a.create(**SMALL), range(10)))
        made += elsewhere
        assert on_node(elsewhere)["n2"] == 0, on_node(elsewhere)
        live = usage.check("creates without n2", live + 10)
        cluster.start_node("n2")
        wait_for("n2 back", lambda: "n2" in cluster.node_names(), 30)
        wait_for("n2's sandboxes back", lambda: a.get(mine_a[0].id).info.state == "running", 30)
        wait_for("exec on n2 after its restart",
                 lambda: mine_a[-1].exec("echo back").stdout == b"back\n", 15)
        live = usage.check("node n2 back", live + len(listed) - kept)
        print(f"  SIGKILL node n2: {len(mine_a)} sandboxes LOST then back, 10 creates elsewhere")

        # A node cut off (its link down past its lease), then back.
        cut = [s for s in usage.client.list() if s.id.startswith("sb-n3-")]
        ip("link", "set", "dsecct-n3", "down")
        try:
            wait_for("n3's lease to expire", lambda: "n3" not in cluster.node_names(), 6 * TTL)
            live = usage.check("n3 cut off", live - len(cut))
            with futures.ThreadPoolExecutor(5) as pool:
                away = list(pool.map(lambda _: a.create(**SMALL), range(5)))
            made += away
            assert on_node(away)["n3"] == 0, on_node(away)
            live += 5
        finally:
            ip("link", "set", "dsecct-n3", "up")
        wait_for("n3 back", lambda: "n3" in cluster.node_names(), 30)
        # The apiserver's connection to n3 died with the link (its pings went unanswered):
        # the first call on the new one may be UNAVAILABLE, which callers retry.
        wait_for("exec on n3 after its link is back",
                 lambda: cut[0].exec("echo reconnected").stdout == b"reconnected\n", 15)
        live = usage.check("n3 reconnected", live + len(cut))
        print(f"  n3's link down past its lease and up: {len(cut)} sandboxes back")

        # The whole control plane stopped and started again: nodes re-register, nothing lost.
        for name in ["api0", "api1", *ETCD]:
            cluster.kill(name, signal.SIGTERM)
        cluster.start_control_plane()
        wait_for("3 nodes after the restart", lambda: len(cluster.nodes()) == 3, 30)
        for n in NODES:
            one = next(s for s in made if s.id.startswith(f"sb-{n}-"))
            wait_for(f"exec on {n} after the restart",
                     lambda: one.exec("echo alive").stdout == b"alive\n", 30)
        live = usage.check("control plane restart", live)
        print("  control plane (3 etcd + 2 apiservers) restarted: 3 nodes back, nothing lost")

        # Everything deleted: no quota leaked.
        with futures.ThreadPoolExecutor(20) as pool:
            list(pool.map(lambda s: s.delete(), made))
        made = []
        leftovers = a.list()
        print(f"{len(leftovers)} sandboxes of creates cut off with api0")
        assert len(leftovers) <= 10, leftovers
        for s in leftovers:
            s.delete()
        assert len(q.list()) == 0
        assert cluster.used("acme/q") == 0, cluster.cli("--json", "project", "ls", "acme").stdout
        assert cluster.used("acme/a") <= usage.slack
        print(f"acme/a: {cluster.used('acme/a')} reservations of cut-off creates left for the "
              "watcher's reconcile")
        print("cluster test passed")
    finally:
        for s in made:
            try:
                s.delete()
            except dsec.DsecError:
                pass
        cluster.stop()
        after = Path("/proc/sys/net/ipv4/ip_forward").read_text()
        assert after == forward_before, f"ip_forward changed: {forward_before} -> {after}"


if __name__ == "__main__":
    main()
