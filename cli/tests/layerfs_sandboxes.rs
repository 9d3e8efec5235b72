//! Container sandboxes on layer-store images, end to end: a busybox image published to a
//! real local registry (Debian's docker-registry on 127.0.0.1), `dsec image import`ed into
//! the node's store, run by the real daemon (`dsec up`) through one shared FUSE mount, the
//! daemon SIGKILLed and restarted, and by `dsec run --image`. Needs root, /dev/fuse and
//! overlayfs; says SKIPPED otherwise.

use dsec_layerfs::testing::{LocalRegistry, REGISTRY};
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use dsec_api::v1::CreateSandboxRequest;
use dsec_layerfs::store::{Store, StoreConfig};
use serde_json::Value;

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn can_run() -> bool {
    if !fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0) {
        eprintln!("SKIPPED: needs root");
        return false;
    }
    if !Path::new("/dev/fuse").exists() || !Path::new(REGISTRY).exists() {
        eprintln!(
            "SKIPPED: needs /dev/fuse and {REGISTRY} (apt-get install fuse3 docker-registry)"
        );
        return false;
    }
    true
}

/// The agent the daemon starts, built fresh next to the `dsec` binary (where the daemon
/// looks first).
fn build_agent() {
    let status = Command::new(env!("CARGO"))
        .args(["build", "-q", "-p", "dsec-agent"])
        .current_dir(workspace_root())
        .status()
        .expect("run cargo build -p dsec-agent");
    assert!(status.success(), "cargo build -p dsec-agent failed");
}

/// A busybox-static tree: the host's static busybox and a few applet links.
fn busybox_tree(root: &Path, motd: &str) {
    fs::create_dir_all(root.join("bin")).unwrap();
    fs::create_dir_all(root.join("etc")).unwrap();
    fs::copy("/bin/busybox", root.join("bin/busybox")).unwrap();
    for applet in ["sh", "cat", "ls", "echo", "test"] {
        std::os::unix::fs::symlink("busybox", root.join("bin").join(applet)).unwrap();
    }
    fs::write(root.join("etc/motd"), motd).unwrap();
}

/// Everything of one test under a temp dir: DSEC_HOME (directory images), the layer store
/// and cache, the daemon's state dir and the one-shot run dir.
struct Node {
    dir: tempfile::TempDir,
    daemon: Option<Child>,
}

impl Node {
    fn new() -> Node {
        let dir = tempfile::Builder::new()
            .prefix("dsec-layerfs-sb-")
            .tempdir()
            .unwrap();
        fs::create_dir_all(dir.path().join("home/images")).unwrap();
        Node { dir, daemon: None }
    }

    fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    fn endpoint(&self) -> String {
        format!("unix:{}", self.path("state/edge.sock").display())
    }

    fn dsec(&self) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_dsec"));
        c.env("DSEC_HOME", self.path("home"))
            .env("DSEC_LAYERFS_STORE", self.path("store"))
            .env("DSEC_LAYERFS_CACHE", self.path("cache"))
            .env("DSEC_RUN_DIR", self.path("run"))
            .stdin(Stdio::null());
        c
    }

    fn ok(&self, args: &[&str]) -> Output {
        let out = self.dsec().args(args).output().unwrap();
        assert!(
            out.status.success(),
            "dsec {args:?} failed: {}{}",
            text(&out.stdout),
            text(&out.stderr)
        );
        out
    }

    fn start_daemon(&mut self) {
        let socket = self.path("state/edge.sock");
        let _ = fs::remove_file(&socket);
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.path("daemon.log"))
            .unwrap();
        let child = self
            .dsec()
            .args(["up", "--metrics", "off", "--default-backend", "container"])
            .arg("--state-dir")
            .arg(self.path("state"))
            // Its own cgroup: a daemon sweeps cgroups of sandboxes it does not know, so two
            // test daemons must not share one.
            .arg("--cgroup-name")
            .arg(self.dir.path().file_name().unwrap())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        self.daemon = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        while !socket.exists() {
            assert!(
                Instant::now() < deadline,
                "daemon did not start: {}",
                fs::read_to_string(self.path("daemon.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn kill_daemon(&mut self) {
        if let Some(mut d) = self.daemon.take() {
            let _ = d.kill();
            let _ = d.wait();
        }
    }

    fn stop_daemon(&mut self) {
        if let Some(mut d) = self.daemon.take() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(d.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
            let _ = d.wait();
        }
    }

    /// layerfs mounts under this node's temp dir in the test's mount namespace.
    fn layerfs_mounts(&self) -> Vec<String> {
        let prefix = format!("{}/", self.dir.path().display());
        fs::read_to_string("/proc/self/mountinfo")
            .unwrap()
            .lines()
            .filter(|l| l.contains(" - fuse") && l.contains(" layerfs "))
            .filter_map(|l| l.split(' ').nth(4).map(str::to_string))
            .filter(|mp| mp.starts_with(&prefix))
            .collect()
    }

    /// Processes started for this node (agents, image servers): their command line or
    /// environment names its temp dir.
    fn processes(&self) -> Vec<i32> {
        let needle = self.dir.path().to_string_lossy().into_owned();
        let daemon = self.daemon.as_ref().map(|d| d.id() as i32);
        dsec_edge::backend::pids_referencing(needle.as_bytes())
            .into_iter()
            .filter(|&pid| Some(pid) != daemon)
            .collect()
    }
}

impl Drop for Node {
    /// Whatever a failed test left: its sandboxes, image servers, mounts and the daemon.
    fn drop(&mut self) {
        self.stop_daemon();
        for pid in self.processes() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        std::thread::sleep(Duration::from_millis(200));
        for mp in self.layerfs_mounts() {
            let _ = nix::mount::umount2(mp.as_str(), nix::mount::MntFlags::MNT_DETACH);
        }
        // The daemon's cgroup parents (named after the temp dir), emptied above.
        let name = self.dir.path().file_name().unwrap().to_owned();
        remove_cgroups(Path::new("/sys/fs/cgroup"), &name, 5);
    }
}

/// Removes cgroups named `name` (and their children) up to `depth` levels down.
fn remove_cgroups(dir: &Path, name: &std::ffi::OsStr, depth: u32) {
    for entry in fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if !entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        if entry.file_name() == name {
            for child in fs::read_dir(&path).into_iter().flatten().flatten() {
                if child.file_type().is_ok_and(|t| t.is_dir()) {
                    let _ = fs::remove_dir(child.path());
                }
            }
            let _ = fs::remove_dir(&path);
        } else if depth > 0 {
            remove_cgroups(&path, name, depth - 1);
        }
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn container(image: &str) -> CreateSandboxRequest {
    CreateSandboxRequest {
        backend: 1,
        image: image.to_string(),
        ..Default::default()
    }
}

async fn sh(c: &dsec_sdk::Client, id: &str, script: &str) -> String {
    let out = c.exec(id, &["sh", "-c", script], None).await.unwrap();
    assert_eq!(
        out.exit_code(),
        0,
        "{script} in {id}: {}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stdout)
}

/// Publishes a busybox image to the registry and imports it into the node's store under
/// its reference; returns the reference.
fn publish_and_import(node: &Node, registry: &LocalRegistry) -> String {
    let publisher = tempfile::tempdir().unwrap();
    let tree = publisher.path().join("tree");
    busybox_tree(&tree, "from the registry\n");
    let out = node
        .dsec()
        .env("DSEC_LAYERFS_STORE", publisher.path().join("store"))
        .env("DSEC_LAYERFS_CACHE", publisher.path().join("cache"))
        .args(["--json", "image", "import", "--dir"])
        .arg(&tree)
        .args(["--name", "bb"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let store =
        Store::open_existing(publisher.path().join("store"), StoreConfig::default()).unwrap();
    let reference = format!("{}/test/busybox:1", registry.addr);
    dsec_layerfs::oci::push(
        &store,
        "bb",
        &dsec_layerfs::oci::Reference::parse(&reference).unwrap(),
    )
    .unwrap();
    let imported: Value =
        serde_json::from_slice(&node.ok(&["--json", "image", "import", &reference]).stdout)
            .unwrap();
    assert_eq!(imported["name"], reference.as_str(), "{imported}");
    reference
}

#[test]
fn shared_mount_isolation_restart_and_cleanup() {
    if !can_run() {
        return;
    }
    build_agent();
    let registry = LocalRegistry::start().expect("docker-registry is installed (checked above)");
    let mut node = Node::new();
    let image = publish_and_import(&node, &registry);
    node.start_daemon();
    let rt = runtime();
    let c = rt
        .block_on(dsec_sdk::Client::connect(&node.endpoint()))
        .unwrap();

    // Three sandboxes of the image, created concurrently.
    let ids: Vec<String> = rt.block_on(async {
        let creates: Vec<_> = (0..3)
            .map(|_| {
                let (c, r) = (c.clone(), container(&image));
                tokio::spawn(async move { c.create(r).await })
            })
            .collect();
        let mut ids = Vec::new();
        for t in creates {
            let sb = t.await.unwrap().unwrap();
            assert_eq!(sb.image, image);
            ids.push(sb.id);
        }
        ids
    });
    let mounts = node.layerfs_mounts();
    assert_eq!(mounts.len(), 1, "one FUSE mount for all three: {mounts:?}");

    rt.block_on(async {
        for (i, id) in ids.iter().enumerate() {
            // A command from the image, reading the image.
            assert_eq!(sh(&c, id, "cat /etc/motd").await, "from the registry\n");
            sh(&c, id, &format!("echo {i} > /etc/only-{i}")).await;
        }
        for (i, id) in ids.iter().enumerate() {
            let listed = sh(&c, id, "ls /etc").await;
            let own: Vec<&str> = listed
                .split_whitespace()
                .filter(|f| f.starts_with("only-"))
                .collect();
            assert_eq!(own, [format!("only-{i}")], "sandbox {i} sees: {listed}");
        }
    });
    // The writes went to the uppers, not the shared image.
    assert!(!Path::new(&mounts[0]).join("etc/only-0").exists());

    // SIGKILL the daemon while they run; the next one adopts them and the mount.
    node.kill_daemon();
    assert_eq!(
        node.layerfs_mounts(),
        mounts,
        "the mount outlives the daemon"
    );
    node.start_daemon();
    let c = rt
        .block_on(dsec_sdk::Client::connect(&node.endpoint()))
        .unwrap();
    rt.block_on(async {
        let listed = c.list(Default::default()).await.unwrap();
        assert_eq!(listed.len(), 3, "all three adopted");
        for (i, id) in ids.iter().enumerate() {
            assert_eq!(
                sh(&c, id, &format!("cat /etc/motd /etc/only-{i}")).await,
                format!("from the registry\n{i}\n")
            );
        }
    });
    assert_eq!(node.layerfs_mounts(), mounts, "still one mount");

    // A clean stop leaves the sandboxes and their mount to the next daemon too.
    node.stop_daemon();
    assert_eq!(
        node.layerfs_mounts(),
        mounts,
        "in use: kept at a clean stop"
    );
    node.start_daemon();
    let c = rt
        .block_on(dsec_sdk::Client::connect(&node.endpoint()))
        .unwrap();
    rt.block_on(async {
        assert_eq!(c.list(Default::default()).await.unwrap().len(), 3);
        assert_eq!(sh(&c, &ids[1], "cat /etc/only-1").await, "1\n");
    });

    // A new sandbox after the restart shares the adopted mount.
    let fourth = rt.block_on(c.create(container(&image))).unwrap().id;
    assert_eq!(node.layerfs_mounts(), mounts);
    rt.block_on(async {
        assert_eq!(sh(&c, &fourth, "ls /etc").await, "motd\n");
    });

    // Deleting all but one keeps the mount; deleting the last one removes it.
    rt.block_on(async {
        for id in &ids {
            c.delete(id).await.unwrap();
        }
    });
    assert_eq!(node.layerfs_mounts(), mounts, "one sandbox still uses it");
    rt.block_on(c.delete(&fourth)).unwrap();
    assert_eq!(node.layerfs_mounts(), Vec::<String>::new(), "mount gone");
    assert_eq!(
        node.processes(),
        Vec::<i32>::new(),
        "no agent or image server left"
    );
    assert_eq!(
        fs::read_dir(node.path("state/images")).unwrap().count(),
        0,
        "image server directories removed"
    );
    node.stop_daemon();
}

#[test]
fn lookup_order_errors_and_one_shot_run() {
    if !can_run() {
        return;
    }
    build_agent();
    let registry = LocalRegistry::start().expect("docker-registry is installed (checked above)");
    let mut node = Node::new();
    let image = publish_and_import(&node, &registry);
    // "clash" exists as a directory image and in the layer store: the directory wins.
    busybox_tree(&node.path("home/images/clash/rootfs"), "directory image\n");
    let layer_tree = node.path("layer-tree");
    busybox_tree(&layer_tree, "layer-store image\n");
    node.ok(&[
        "--json",
        "image",
        "import",
        "--dir",
        layer_tree.to_str().unwrap(),
        "--name",
        "clash",
    ]);
    node.start_daemon();
    let rt = runtime();
    let c = rt
        .block_on(dsec_sdk::Client::connect(&node.endpoint()))
        .unwrap();
    rt.block_on(async {
        let sb = c.create(container("clash")).await.unwrap();
        assert_eq!(sh(&c, &sb.id, "cat /etc/motd").await, "directory image\n");
        c.delete(&sb.id).await.unwrap();

        let err = c.create(container("nothere")).await.unwrap_err();
        assert_eq!(err.code(), Some(tonic::Code::NotFound), "{err}");
        let msg = err.to_string();
        assert!(msg.contains("available"), "{msg}");
        assert!(msg.contains("[clash]"), "directory images listed: {msg}");
        assert!(
            msg.contains(&format!("[{image}, clash]"))
                || msg.contains(&format!("[clash, {image}]")),
            "layer-store images listed: {msg}"
        );

        let err = c.create(container("bad name;")).await.unwrap_err();
        assert_eq!(err.code(), Some(tonic::Code::InvalidArgument), "{err}");
    });
    assert!(
        node.layerfs_mounts().is_empty(),
        "a directory image mounts nothing"
    );
    node.stop_daemon();

    // One-shot: the image mounted for the run only.
    let out = node.ok(&[
        "run",
        "--backend",
        "container",
        "--image",
        &image,
        "--",
        "sh",
        "-c",
        "cat /etc/motd; echo x > /etc/new; cat /etc/new",
    ]);
    assert_eq!(text(&out.stdout), "from the registry\nx\n");
    let out = node.ok(&[
        "run",
        "--backend",
        "container",
        "--image",
        "clash",
        "--",
        "cat",
        "/etc/motd",
    ]);
    assert_eq!(text(&out.stdout), "directory image\n");
    assert!(node.layerfs_mounts().is_empty(), "the run's mount is gone");
    assert_eq!(node.processes(), Vec::<i32>::new());
    let out = node
        .dsec()
        .args([
            "run",
            "--backend",
            "container",
            "--image",
            "nothere",
            "--",
            "true",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("not found") && err.contains("available") && err.contains("clash"),
        "{err}"
    );
    // microVMs boot directory images only: a layer-store name is not found for them.
    let out = node
        .dsec()
        .args([
            "run",
            "--backend",
            "microvm",
            "--image",
            &image,
            "--",
            "true",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("not found for the microvm backend") && err.contains("(containers only)"),
        "{err}"
    );
}

/// Pids of this node's image servers.
fn image_servers(node: &Node) -> Vec<i32> {
    node.processes()
        .into_iter()
        .filter(|pid| {
            fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| text(&c).contains("--serve-image"))
        })
        .collect()
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_dead_image_server_takes_its_sandboxes_with_it() {
    if !can_run() {
        return;
    }
    build_agent();
    let registry = LocalRegistry::start().expect("docker-registry is installed (checked above)");
    let mut node = Node::new();
    let image = publish_and_import(&node, &registry);
    node.start_daemon();
    let rt = runtime();
    let c = rt
        .block_on(dsec_sdk::Client::connect(&node.endpoint()))
        .unwrap();

    // While the daemon runs: the reaper removes the sandbox, the dead mount is detached, and
    // the next create starts a new server.
    let first = rt.block_on(c.create(container(&image))).unwrap().id;
    let servers = image_servers(&node);
    assert_eq!(servers.len(), 1, "{servers:?}");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(servers[0]),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    // Reaped: what is left is its tombstone, naming the cause.
    wait_until("the sandbox is reaped", || {
        rt.block_on(c.get(&first))
            .is_ok_and(|s| s.state == dsec_sdk::SandboxState::Dead as i32)
    });
    let dead = rt.block_on(c.get(&first)).unwrap();
    assert!(
        dead.death_reason.contains("image server died"),
        "{}",
        dead.death_reason
    );
    assert!(rt.block_on(c.list(Default::default())).unwrap().is_empty());
    wait_until("the dead mount is gone", || {
        node.layerfs_mounts().is_empty()
    });
    let second = rt.block_on(c.create(container(&image))).unwrap().id;
    rt.block_on(async {
        assert_eq!(
            sh(&c, &second, "cat /etc/motd").await,
            "from the registry\n"
        );
    });
    assert_eq!(node.layerfs_mounts().len(), 1);

    // While the daemon is down: the next daemon does not adopt a sandbox whose image server
    // died, and leaves no mount behind.
    node.kill_daemon();
    for pid in image_servers(&node) {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
    }
    wait_until("the server is gone", || image_servers(&node).is_empty());
    // And a server the killed daemon had started but not recorded yet (no server.json).
    let served = fs::read_dir(node.path("state/images"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let half = node.path("state/images/half-started");
    fs::create_dir_all(half.join("root")).unwrap();
    fs::copy(served.join("image.json"), half.join("image.json")).unwrap();
    let mut orphan = node
        .dsec()
        .args(["up", "--serve-image"])
        .arg(&half)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_until("the unrecorded server mounts", || {
        half.join("ready").exists()
    });
    assert_eq!(
        node.layerfs_mounts().len(),
        2,
        "a dead mount and the unrecorded one"
    );
    node.start_daemon();
    wait_until("the unrecorded server is killed", || {
        orphan.try_wait().unwrap().is_some()
    });
    assert!(!half.exists(), "its directory is removed");
    let c = rt
        .block_on(dsec_sdk::Client::connect(&node.endpoint()))
        .unwrap();
    let listed = rt.block_on(c.list(Default::default())).unwrap();
    assert!(listed.is_empty(), "{listed:?}");
    assert!(node.layerfs_mounts().is_empty());
    assert_eq!(
        node.processes(),
        Vec::<i32>::new(),
        "the sandbox was removed"
    );
    node.stop_daemon();
}

/// Chunks of the image's first layer in the node cache.
fn cached_chunks(node: &Node, image: &str) -> u64 {
    let out = node.ok(&["--json", "image", "inspect", image]);
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    doc["layers"][0]["cached_chunks"].as_u64().unwrap()
}

#[test]
fn the_image_server_prefetches_the_hot_list() {
    if !can_run() {
        return;
    }
    build_agent();
    let mut node = Node::new();
    let tree = node.path("tree");
    busybox_tree(&tree, "hot\n");
    // 3 chunks of 1 MiB; the hot list names only the second.
    let big: Vec<u8> = (0..3u32 << 20)
        .map(|i| i.wrapping_mul(2_654_435_761).to_le_bytes()[3])
        .collect();
    fs::create_dir_all(tree.join("data")).unwrap();
    fs::write(tree.join("data/big"), &big).unwrap();
    node.ok(&[
        "--json",
        "image",
        "import",
        "--dir",
        tree.to_str().unwrap(),
        "--name",
        "hot",
    ]);
    let store = Store::open_existing(node.path("store"), StoreConfig::default()).unwrap();
    let list = dsec_layerfs::prefetch::HotList {
        version: 1,
        entries: vec![("data/big".to_string(), 1 << 20)],
    };
    dsec_layerfs::prefetch::save(&store, "hot", list).unwrap();
    assert_eq!(cached_chunks(&node, "hot"), 0);
    node.start_daemon();
    let rt = runtime();
    let c = rt
        .block_on(dsec_sdk::Client::connect(&node.endpoint()))
        .unwrap();
    let id = rt.block_on(c.create(container("hot"))).unwrap().id;
    // Nothing in the sandbox reads data/big; only the prefetch fetches its second chunk.
    wait_until("the hot chunk is cached", || {
        cached_chunks(&node, "hot") == 1
    });
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(cached_chunks(&node, "hot"), 1, "exactly the hot chunk");
    rt.block_on(c.delete(&id)).unwrap();
    node.stop_daemon();
}
