//! `dsec image` end to end against a temp store and cache: import --dir, ls, inspect, pack
//! of an overlayfs-style upper (a new file and a whiteout), rm, gc, and every bad input
//! failing with a message that names what to fix and leaving nothing behind.

use dsec_layerfs::testing::LocalRegistry;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Arc;

use dsec_layerfs::cache::NodeCache;
use dsec_layerfs::store::{Store, StoreConfig};
use serde_json::Value;

/// A temp dir holding the store, the node cache, DSEC_HOME and the test's inputs.
struct Env {
    dir: tempfile::TempDir,
}

impl Env {
    fn new() -> Self {
        Env {
            dir: tempfile::tempdir().unwrap(),
        }
    }

    fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    fn store(&self) -> PathBuf {
        self.path("store")
    }

    /// `dsec` with the store and cache in the temp dir (through the env vars, as a user
    /// would set them) and DSEC_HOME pointing there too, so no default path is touched.
    fn dsec(&self) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_dsec"));
        c.env("DSEC_LAYERFS_STORE", self.store())
            .env("DSEC_LAYERFS_CACHE", self.path("cache"))
            .env("DSEC_HOME", self.path("home"))
            .stdin(Stdio::null());
        c
    }

    fn run(&self, args: &[&str]) -> Output {
        self.dsec().arg("--json").args(args).output().unwrap()
    }

    /// Runs a command that must succeed: one JSON document on stdout, and nothing on
    /// stderr (no progress bars when stderr is not a terminal).
    fn ok(&self, args: &[&str]) -> Value {
        let out = self.run(args);
        assert!(
            out.status.success(),
            "{args:?} failed: {}{}",
            text(&out.stdout),
            text(&out.stderr)
        );
        assert_eq!(text(&out.stderr), "", "{args:?} wrote to stderr");
        serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{args:?}: stdout is not one JSON document ({e})"))
    }

    /// Runs a command that must fail; returns its error message after checking that the
    /// exit code is non-zero, stdout is `{"error": ...}` and stderr says the same.
    fn fails(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(
            !out.status.success(),
            "{args:?} succeeded: {}",
            text(&out.stdout)
        );
        let doc: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "{args:?}: stdout is not a JSON error ({e}): {}",
                text(&out.stdout)
            )
        });
        let msg = doc["error"].as_str().expect("an error field").to_string();
        assert!(text(&out.stderr).contains(&msg), "{}", text(&out.stderr));
        msg
    }

    fn chunk_count(&self) -> usize {
        let mut n = 0;
        for sub in fs::read_dir(self.store().join("chunks")).unwrap() {
            n += fs::read_dir(sub.unwrap().path()).unwrap().count();
        }
        n
    }

    fn image_names(&self) -> Vec<String> {
        self.ok(&["image", "ls"])
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i["name"].as_str().unwrap().to_string())
            .collect()
    }

    fn tmp_is_empty(&self) -> bool {
        fs::read_dir(self.store().join("tmp")).unwrap().count() == 0
    }
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn is_root() -> bool {
    fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// File contents unique to this test (so chunk counts are exact).
fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3] ^ seed)
        .collect()
}

/// The base tree: 4 distinct files, a symlink and nested dirs.
fn base_tree(root: &Path) -> u64 {
    fs::create_dir_all(root.join("etc")).unwrap();
    fs::create_dir_all(root.join("usr/bin")).unwrap();
    let files: [(&str, Vec<u8>); 4] = [
        ("etc/hostname", b"box\n".to_vec()),
        ("etc/motd", b"welcome\n".to_vec()),
        ("usr/bin/tool", pattern(1, 300_000)),
        ("gone", pattern(2, 5000)),
    ];
    let mut bytes = 0;
    for (p, data) in &files {
        fs::write(root.join(p), data).unwrap();
        bytes += data.len() as u64;
    }
    std::os::unix::fs::symlink("usr/bin", root.join("bin")).unwrap();
    bytes
}

/// An overlayfs upper as a sandbox leaves it: a new file, and `gone` deleted (a 0/0 char
/// device is overlayfs's whiteout).
fn upper_dir(root: &Path) {
    fs::create_dir_all(root.join("etc")).unwrap();
    fs::write(root.join("new.txt"), b"written in the sandbox\n").unwrap();
    fs::write(root.join("etc/hostname"), b"changed\n").unwrap();
    let status = Command::new("mknod")
        .arg(root.join("gone"))
        .args(["c", "0", "0"])
        .status()
        .unwrap();
    assert!(
        status.success(),
        "mknod of the whiteout failed (needs root)"
    );
}

/// The merged tree of an image, exported through the library from the store the CLI
/// wrote, through the node cache the CLI's --cache points at.
fn export_image(env: &Env, layers: &[Value], dest: &Path) {
    let store = Arc::new(Store::open_existing(env.store(), StoreConfig::default()).unwrap());
    let cache = NodeCache::open(env.path("cache"), store, 1 << 30).unwrap();
    let ids: Vec<_> = layers
        .iter()
        .map(|l| dsec_layerfs::Digest::parse(l.as_str().unwrap()).unwrap())
        .collect();
    let tree = cache.compose(&ids).unwrap();
    dsec_layerfs::image::export_tree(&cache, &tree, dest).unwrap();
}

#[test]
fn import_ls_inspect_pack_rm_gc() {
    if !is_root() {
        eprintln!("SKIPPED: the whiteout in the upper dir needs root (mknod)");
        return;
    }
    let env = Env::new();
    let tree = env.path("tree");
    let file_bytes = base_tree(&tree);

    let imp = env.ok(&[
        "image",
        "import",
        "--dir",
        tree.to_str().unwrap(),
        "--name",
        "base",
    ]);
    assert_eq!(imp["name"], "base");
    assert_eq!(imp["source"], "dir");
    assert_eq!(imp["chunks"], 4, "{imp}");
    assert_eq!(imp["new_chunks"], 4, "{imp}");
    assert_eq!(imp["file_bytes"], file_bytes);
    let base_layer = imp["layers"][0].as_str().unwrap().to_string();
    assert_eq!(env.chunk_count(), 4);

    assert_eq!(env.image_names(), ["base"]);
    let ins = env.ok(&["image", "inspect", "base"]);
    assert_eq!(ins["image"]["name"], "base");
    assert_eq!(ins["layers"].as_array().unwrap().len(), 1);
    let layer = &ins["layers"][0];
    assert_eq!(layer["id"], base_layer.as_str());
    // root, etc, etc/hostname, etc/motd, usr, usr/bin, usr/bin/tool, gone, bin
    assert_eq!(layer["entries"], 9, "{ins}");
    assert_eq!(layer["file_bytes"], file_bytes);
    assert_eq!(layer["chunks"], 4);
    assert_eq!(layer["whiteouts"], 0);
    assert_eq!(
        layer["cached_chunks"], 0,
        "nothing fetched to this node yet"
    );
    let stored = layer["stored_bytes"].as_u64().unwrap();
    assert!(stored > 0 && stored < file_bytes + 100, "{ins}");

    // Re-importing the same tree stores nothing new.
    let again = env.ok(&["image", "import", "--dir", tree.to_str().unwrap()]);
    assert_eq!(again["new_chunks"], 0, "{again}");
    assert_eq!(again["layers"][0], base_layer.as_str());
    let dir_name = again["name"].as_str().unwrap().to_string();
    assert!(dir_name.starts_with("dir-"), "{again}");
    env.ok(&["image", "rm", &dir_name]);

    let upper = env.path("upper");
    upper_dir(&upper);
    let pack = env.ok(&[
        "image",
        "pack",
        upper.to_str().unwrap(),
        "--base",
        "base",
        "--name",
        "derived",
    ]);
    assert_eq!(pack["name"], "derived");
    assert_eq!(pack["base"], "base");
    let layers = pack["layers"].as_array().unwrap().clone();
    assert_eq!(layers.len(), 2);
    assert_eq!(layers[0], base_layer.as_str());
    assert_eq!(layers[1], pack["layer"]);
    assert_eq!(pack["new_chunks"], 2, "new.txt and etc/hostname: {pack}");
    assert_eq!(env.chunk_count(), 6);

    let ins = env.ok(&["image", "inspect", "derived"]);
    assert_eq!(ins["layers"][0]["id"], base_layer.as_str());
    assert_eq!(ins["layers"][1]["whiteouts"], 1, "{ins}");
    assert_eq!(ins["layers"][1]["chunks"], 2);
    assert_eq!(env.image_names(), ["base", "derived"]);

    // What the packed image holds: the sandbox's view, whiteout applied.
    let merged = env.path("merged");
    export_image(&env, &layers, &merged);
    assert_eq!(
        fs::read(merged.join("new.txt")).unwrap(),
        b"written in the sandbox\n"
    );
    assert_eq!(fs::read(merged.join("etc/hostname")).unwrap(), b"changed\n");
    assert_eq!(fs::read(merged.join("etc/motd")).unwrap(), b"welcome\n");
    assert_eq!(
        fs::read(merged.join("usr/bin/tool")).unwrap(),
        pattern(1, 300_000)
    );
    assert!(!merged.join("gone").exists(), "the whiteout did not delete");
    // The export fetched every live chunk into the node cache; inspect sees them there.
    let ins = env.ok(&["image", "inspect", "derived"]);
    assert_eq!(ins["layers"][1]["cached_chunks"], 2, "{ins}");
    assert_eq!(
        ins["layers"][0]["cached_chunks"], 2,
        "motd and tool (hostname is replaced, gone whited out): {ins}"
    );

    // rm takes the record only; gc within the grace period keeps everything.
    let rm = env.ok(&["image", "rm", "derived"]);
    assert_eq!(rm["removed"], "derived");
    assert_eq!(env.image_names(), ["base"]);
    let gc = env.ok(&["image", "gc"]);
    assert_eq!(gc["chunks_removed"], 0, "grace period ignored: {gc}");
    assert_eq!(env.chunk_count(), 6);
    // With no grace: the packed layer and its 2 chunks go, the base stays whole.
    let gc = env.ok(&["image", "gc", "--grace-secs", "0"]);
    assert_eq!(gc["layers_removed"], 1, "{gc}");
    assert_eq!(gc["chunks_removed"], 2, "{gc}");
    assert_eq!(env.chunk_count(), 4);
    let ins = env.ok(&["image", "inspect", "base"]);
    assert_eq!(ins["layers"][0]["stored_bytes"], stored);
    let merged_base = env.path("merged-base");
    export_image(&env, &[Value::from(base_layer.clone())], &merged_base);
    assert_eq!(
        fs::read(merged_base.join("gone")).unwrap(),
        pattern(2, 5000)
    );

    env.ok(&["image", "rm", "base"]);
    let gc = env.ok(&["image", "gc", "--grace-secs", "0"]);
    assert_eq!(gc["chunks_removed"], 4, "{gc}");
    assert_eq!(env.chunk_count(), 0);
    assert!(env.image_names().is_empty());
    assert!(env.tmp_is_empty());
}

#[test]
fn bad_inputs_fail_with_what_to_fix_and_leave_nothing() {
    let env = Env::new();

    // No store yet: read commands say so and do not create one.
    let msg = env.fails(&["image", "ls"]);
    assert!(
        msg.contains("no layer store at") && msg.contains("--store"),
        "{msg}"
    );
    let msg = env.fails(&["image", "gc", "--grace-secs", "0"]);
    assert!(msg.contains("no layer store at"), "{msg}");
    assert!(!env.store().exists(), "a read command created the store");
    // --store wins over the env var.
    let elsewhere = env.path("elsewhere");
    let out = env
        .dsec()
        .args(["image", "ls", "--store", elsewhere.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains(elsewhere.to_str().unwrap()),
        "{}",
        text(&out.stderr)
    );

    let tree = env.path("tree");
    fs::create_dir_all(&tree).unwrap();
    fs::write(tree.join("f"), b"data").unwrap();
    env.ok(&[
        "image",
        "import",
        "--dir",
        tree.to_str().unwrap(),
        "--name",
        "base",
    ]);
    let chunks = env.chunk_count();

    let msg = env.fails(&["image", "inspect", "nope"]);
    assert!(
        msg.contains("\"nope\" not found") && msg.contains("dsec image ls"),
        "{msg}"
    );
    let msg = env.fails(&["image", "rm", "nope"]);
    assert!(msg.contains("\"nope\" not found"), "{msg}");

    let msg = env.fails(&["image", "import", "busybox"]);
    assert!(
        msg.contains("not a registry reference") && msg.contains("host[:port]/repo"),
        "{msg}"
    );
    let msg = env.fails(&["image", "import", "127.0.0.1:5000/Upper/Case:1"]);
    assert!(msg.contains("lowercase"), "{msg}");

    // A port nothing listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let reference = format!("127.0.0.1:{port}/lib/busybox:1.36");
    let msg = env.fails(&["image", "import", &reference]);
    assert!(
        msg.contains(&format!("127.0.0.1:{port}")) && msg.contains("is the registry running"),
        "{msg}"
    );

    let file = tree.join("f");
    let msg = env.fails(&["image", "import", "--dir", file.to_str().unwrap()]);
    assert!(msg.contains("is not a directory"), "{msg}");
    let msg = env.fails(&["image", "import", tree.to_str().unwrap(), "--name", "x"]);
    assert!(msg.contains("--dir"), "{msg}");
    let msg = env.fails(&["image", "import", file.to_str().unwrap()]);
    assert!(msg.contains("--name"), "{msg}");
    let msg = env.fails(&[
        "image",
        "import",
        "--dir",
        tree.to_str().unwrap(),
        "--name",
        "bad name",
    ]);
    assert!(msg.contains("use letters, digits"), "{msg}");

    // A broken tar after a good one: no image, no temp files; what it stored is complete
    // chunks that gc collects.
    let good = env.path("good.tar");
    let status = Command::new("tar")
        .arg("-cf")
        .arg(&good)
        .arg("-C")
        .arg(&tree)
        .arg(".")
        .status()
        .unwrap();
    assert!(status.success());
    let broken = env.path("broken.tar");
    fs::write(&broken, &fs::read(&good).unwrap()[..700]).unwrap();
    let msg = env.fails(&[
        "image",
        "import",
        good.to_str().unwrap(),
        broken.to_str().unwrap(),
        "--name",
        "half",
    ]);
    assert!(msg.contains("broken.tar"), "{msg}");
    assert!(msg.contains("truncated"), "{msg}");

    let msg = env.fails(&[
        "image",
        "pack",
        file.to_str().unwrap(),
        "--base",
        "base",
        "--name",
        "packed",
    ]);
    assert!(
        msg.contains(file.to_str().unwrap()) && msg.contains("is not a directory"),
        "{msg}"
    );
    let msg = env.fails(&[
        "image",
        "pack",
        env.path("no-such-upper").to_str().unwrap(),
        "--base",
        "base",
        "--name",
        "packed",
    ]);
    assert!(msg.contains("no-such-upper"), "{msg}");
    let msg = env.fails(&[
        "image",
        "pack",
        tree.to_str().unwrap(),
        "--base",
        "nope",
        "--name",
        "packed",
    ]);
    assert!(msg.contains("\"nope\" not found"), "{msg}");

    assert_eq!(
        env.image_names(),
        ["base"],
        "a failed command left an image"
    );
    assert_eq!(env.chunk_count(), chunks, "a failed command stored chunks");
    assert!(env.tmp_is_empty(), "a failed command left temp files");

    // A store path that is a file.
    let msg = env.fails(&[
        "image",
        "import",
        "--dir",
        tree.to_str().unwrap(),
        "--store",
        file.to_str().unwrap(),
    ]);
    assert!(
        msg.contains("not a directory") && msg.contains("--store"),
        "{msg}"
    );

    if is_root() {
        read_only_store_is_refused_before_any_work(&env, &tree);
    } else {
        eprintln!("SKIPPED: the read-only store check needs root (mount)");
    }
}

fn refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// Unmounts on drop, so a failed assertion leaves no mount behind.
struct Mounted(PathBuf);

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

fn read_only_store_is_refused_before_any_work(env: &Env, tree: &Path) {
    let mnt = env.path("ro");
    fs::create_dir(&mnt).unwrap();
    let mount = |opts: &str| {
        Command::new("mount")
            .args(["-t", "tmpfs", "-o", opts, "tmpfs"])
            .arg(&mnt)
            .status()
            .unwrap()
            .success()
    };
    assert!(mount("size=16m"), "mounting a tmpfs failed");
    let _guard = Mounted(mnt.clone());
    let store = mnt.join("store");
    let store_arg = store.to_str().unwrap();
    let with_store = |args: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        v.extend(["--store".to_string(), store_arg.to_string()]);
        v
    };
    env.ok(&refs(&with_store(&[
        "image",
        "import",
        "--dir",
        tree.to_str().unwrap(),
        "--name",
        "ro-base",
    ])));
    assert!(mount("remount,ro"), "remounting the tmpfs read-only failed");
    for args in [
        &[
            "image",
            "import",
            "--dir",
            tree.to_str().unwrap(),
            "--name",
            "x",
        ][..],
        &["image", "rm", "ro-base"],
        &["image", "gc", "--grace-secs", "0"],
        &[
            "image",
            "pack",
            tree.to_str().unwrap(),
            "--base",
            "ro-base",
            "--name",
            "y",
        ],
    ] {
        let msg = env.fails(&refs(&with_store(args)));
        assert!(
            msg.contains("is not writable") && msg.contains("Read-only file system"),
            "{args:?}: {msg}"
        );
    }
    // Reading still works.
    let ls = env.ok(&refs(&with_store(&["image", "ls"])));
    assert_eq!(ls[0]["name"], "ro-base");
}

fn have_script() -> bool {
    let ok = Command::new("script").arg("--version").output().is_ok();
    if !ok {
        eprintln!("SKIPPED: `script` (util-linux) is needed to give dsec a terminal");
    }
    ok
}

/// Runs `dsec ARGS` on a pty (`script`) and returns what the terminal showed.
fn on_terminal(env: &Env, args: &[&str]) -> String {
    let mut command = env!("CARGO_BIN_EXE_dsec").to_string();
    for a in args {
        command.push_str(&format!(" '{a}'"));
    }
    let out = Command::new("script")
        .args(["-qefc", &command, "/dev/null"])
        .env("DSEC_LAYERFS_STORE", env.store())
        .env("DSEC_HOME", env.path("home"))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let screen = text(&out.stdout);
    assert!(out.status.success(), "{args:?} on a terminal: {screen}");
    screen
}

#[test]
fn progress_is_drawn_only_on_a_terminal() {
    if !have_script() {
        return;
    }
    let env = Env::new();
    let tree = env.path("tree");
    fs::create_dir_all(&tree).unwrap();
    fs::write(tree.join("big"), pattern(7, 8 << 20)).unwrap();
    // Not a terminal: only the result, nothing on stderr (checked by `ok`).
    env.ok(&[
        "image",
        "import",
        "--dir",
        tree.to_str().unwrap(),
        "--name",
        "plain",
    ]);
    // On a terminal (a pty from `script`), the bar appears on stderr.
    let screen = on_terminal(
        &env,
        &[
            "image",
            "import",
            "--dir",
            tree.to_str().unwrap(),
            "--name",
            "tty",
        ],
    );
    assert!(
        screen.contains("checking the source") || screen.contains("layer 1/1"),
        "no progress drawn on a terminal: {screen:?}"
    );
    assert!(screen.contains("tty: 1 layer(s) from dir"), "{screen:?}");
}

#[test]
fn import_from_a_registry() {
    let Some(registry) = LocalRegistry::start() else {
        return;
    };
    // Publish an image made from a directory (pushed through the library).
    let publisher = Env::new();
    let tree = publisher.path("tree");
    let file_bytes = base_tree(&tree);
    publisher.ok(&[
        "image",
        "import",
        "--dir",
        tree.to_str().unwrap(),
        "--name",
        "base",
    ]);
    let store = Store::open_existing(publisher.store(), StoreConfig::default()).unwrap();
    let reference = format!("{}/test/base:1", registry.addr);
    dsec_layerfs::oci::push(
        &store,
        "base",
        &dsec_layerfs::oci::Reference::parse(&reference).unwrap(),
    )
    .unwrap();

    let env = Env::new();
    let pulled = env.ok(&["image", "import", &reference]);
    assert_eq!(pulled["name"], reference.as_str(), "default name: {pulled}");
    assert_eq!(pulled["source"], "registry");
    assert_eq!(pulled["file_bytes"], file_bytes);
    assert_eq!(pulled["new_chunks"], 4, "{pulled}");
    assert!(pulled["source_bytes"].as_u64().unwrap() > 0, "{pulled}");
    assert!(pulled["manifest_digest"].is_string(), "{pulled}");
    assert_eq!(env.chunk_count(), 4);
    let merged = env.path("merged");
    export_image(&env, pulled["layers"].as_array().unwrap(), &merged);
    assert_eq!(
        fs::read(merged.join("usr/bin/tool")).unwrap(),
        pattern(1, 300_000)
    );

    // The same layer again: known by its diff_id, nothing downloaded.
    let again = env.ok(&["image", "import", &reference, "--name", "again"]);
    assert_eq!(again["layers"], pulled["layers"]);
    assert_eq!(again["source_bytes"], 0, "{again}");
    assert_eq!(env.image_names(), [reference.as_str(), "again"]);

    let msg = env.fails(&[
        "image",
        "import",
        &format!("{}/test/nothere:1", registry.addr),
    ]);
    assert!(
        msg.contains("HTTP 404") && msg.contains("check the repository and tag"),
        "{msg}"
    );
    assert_eq!(env.image_names().len(), 2);

    // A pull on a terminal draws a byte bar against the blob's size.
    if have_script() {
        let fresh = Env::new();
        let screen = on_terminal(&fresh, &["image", "import", &reference, "--name", "tty"]);
        assert!(
            screen.contains("tty: 1 layer(s) from registry"),
            "{screen:?}"
        );
        assert!(
            screen.contains("checking the source") || screen.contains("layer 1/1"),
            "{screen:?}"
        );
    }
}
