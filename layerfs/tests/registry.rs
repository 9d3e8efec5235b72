//! OCI import/export against a real registry (Debian's docker-registry on 127.0.0.1):
//! multi-platform index, gzip and zstd layers, a busybox rootfs that runs from the FUSE
//! view, and a byte-stable push/pull round trip.

mod common;

use std::fs;
use std::io::Write;
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{can_mount, Env, MountGuard, Tar};
use dsec_layerfs::oci::{self, Reference};
use dsec_layerfs::registry::{self, ClientOptions, Credentials};
use dsec_layerfs::{fuse, Digest};
use serde_json::json;

const REGISTRY: &str = "/usr/bin/docker-registry";

/// A registry process with its own config and storage; killed and removed on drop.
struct Registry {
    child: Child,
    addr: String,
    /// The self-signed certificate of a TLS registry.
    ca: Option<std::path::PathBuf>,
    _dir: tempfile::TempDir,
}

impl Registry {
    fn start() -> Option<Registry> {
        if !Path::new(REGISTRY).exists() {
            eprintln!("SKIPPED: {REGISTRY} not installed (apt-get install docker-registry)");
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let addr = format!("127.0.0.1:{port}");
        let cfg = dir.path().join("config.yml");
        fs::write(
            &cfg,
            format!(
                "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\nhttp:\n  addr: {addr}\n",
                dir.path().join("data").display()
            ),
        )
        .unwrap();
        let child = Command::new(REGISTRY)
            .arg("serve")
            .arg(&cfg)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let reg = Registry {
            child,
            addr,
            ca: None,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        let url = format!("http://{}/v2/", reg.addr);
        loop {
            if let Ok(r) = oci::agent().get(&url).call() {
                if r.status().as_u16() == 200 {
                    return Some(reg);
                }
            }
            assert!(
                Instant::now() < deadline,
                "registry did not come up on {}",
                reg.addr
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    /// A registry that speaks only TLS (a self-signed certificate for 127.0.0.1) and wants
    /// HTTP Basic credentials `user:password` (htpasswd, bcrypt).
    fn start_secure(user: &str, password: &str) -> Option<Registry> {
        for tool in [REGISTRY, "/usr/bin/openssl", "/usr/bin/htpasswd"] {
            if !Path::new(tool).exists() {
                eprintln!("SKIPPED: {tool} not installed (setup.sh installs docker-registry, openssl, apache2-utils)");
                return None;
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let (cert, key, htpasswd) = (
            dir.path().join("cert.pem"),
            dir.path().join("key.pem"),
            dir.path().join("htpasswd"),
        );
        let out = Command::new("openssl")
            .args([
                "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            ])
            .args([
                "-subj",
                "/CN=127.0.0.1",
                "-addext",
                "subjectAltName=IP:127.0.0.1",
            ])
            .arg("-keyout")
            .arg(&key)
            .arg("-out")
            .arg(&cert)
            .output()
            .unwrap();
        assert!(out.status.success(), "openssl: {out:?}");
        let out = Command::new("htpasswd")
            .args(["-Bbn", user, password])
            .output()
            .unwrap();
        assert!(out.status.success(), "htpasswd: {out:?}");
        fs::write(&htpasswd, &out.stdout).unwrap();
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let addr = format!("127.0.0.1:{port}");
        let cfg = dir.path().join("config.yml");
        fs::write(
            &cfg,
            format!(
                "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {}\nauth:\n  htpasswd:\n    realm: test\n    path: {}\nhttp:\n  addr: {addr}\n  tls:\n    certificate: {}\n    key: {}\n",
                dir.path().join("data").display(),
                htpasswd.display(),
                cert.display(),
                key.display()
            ),
        )
        .unwrap();
        let child = Command::new(REGISTRY)
            .arg("serve")
            .arg(&cfg)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let reg = Registry {
            child,
            addr: addr.clone(),
            ca: Some(cert),
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(&addr).is_err() {
            assert!(
                Instant::now() < deadline,
                "registry did not come up on {addr}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        Some(reg)
    }

    fn reference(&self, repo_tag: &str) -> Reference {
        Reference::parse(&format!("{}/{repo_tag}", self.addr)).unwrap()
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn gzip(b: &[u8]) -> Vec<u8> {
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(b).unwrap();
    gz.finish().unwrap()
}

/// Publishes a busybox image by hand: a manifest list whose linux/amd64 entry has a gzip
/// base layer and a zstd layer on top.
fn publish_busybox(reg: &Registry) -> Reference {
    let r = reg.reference("test/busybox:1");
    let client = oci::connect(&r, "pull,push").unwrap();
    publish_busybox_with(&client, &r);
    r
}

fn publish_busybox_with(client: &registry::Client, r: &Reference) {
    let busybox = fs::read("/bin/busybox").unwrap();
    let mut base = Tar::new()
        .dir("bin", 0o755)
        .file_owned("bin/busybox", &busybox, 0o755, 0, 0);
    for applet in ["sh", "echo", "cat", "ls"] {
        base = base.symlink(&format!("bin/{applet}"), "busybox");
    }
    let base = base
        .dir("etc", 0o755)
        .file("etc/motd", b"old motd\n")
        .dir("tmp", 0o1777)
        .bytes();
    let top = Tar::new()
        .dir("etc", 0o755)
        .whiteout("etc", "motd")
        .file("etc/hostname", b"sandbox\n")
        .bytes();
    let blobs = [
        (gzip(&base), "gzip", Digest::of(&base)),
        (
            zstd::bulk::compress(&top, 3).unwrap(),
            "zstd",
            Digest::of(&top),
        ),
    ];
    let base = client.base(&r.repo);
    let mut layers = Vec::new();
    for (blob, comp, _) in &blobs {
        let d = Digest::of(blob);
        oci::upload_blob(client, &base, &d, &blob[..]).unwrap();
        layers.push(json!({"mediaType": format!("application/vnd.oci.image.layer.v1.tar+{comp}"), "digest": d.to_string(), "size": blob.len()}));
    }
    let cfg = json!({
        "architecture": "amd64", "os": "linux",
        "config": {"Entrypoint": ["/bin/sh"], "Env": ["PATH=/bin"]},
        "rootfs": {"type": "layers", "diff_ids": blobs.iter().map(|b| b.2.to_string()).collect::<Vec<_>>()},
    });
    let cfg = serde_json::to_vec(&cfg).unwrap();
    let cd = Digest::of(&cfg);
    oci::upload_blob(client, &base, &cd, &cfg[..]).unwrap();
    let manifest = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cd.to_string(), "size": cfg.len()},
        "layers": layers,
    }))
    .unwrap();
    let md = Digest::of(&manifest);
    let by_digest = Reference {
        reference: md.to_string(),
        ..r.clone()
    };
    oci::put_manifest_with_client(
        client,
        &by_digest,
        "application/vnd.oci.image.manifest.v1+json",
        &manifest,
    )
    .unwrap();
    // An arm64 sibling listed first: the pull must pick amd64, not the first entry.
    let arm_cfg = serde_json::to_vec(&json!({"architecture": "arm64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": []}})).unwrap();
    let acd = Digest::of(&arm_cfg);
    oci::upload_blob(client, &base, &acd, &arm_cfg[..]).unwrap();
    let arm = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": acd.to_string(), "size": arm_cfg.len()},
        "layers": [],
    }))
    .unwrap();
    let amd = Digest::of(&arm);
    oci::put_manifest_with_client(
        client,
        &Reference {
            reference: amd.to_string(),
            ..r.clone()
        },
        "application/vnd.oci.image.manifest.v1+json",
        &arm,
    )
    .unwrap();
    let index = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": amd.to_string(), "size": arm.len(),
             "platform": {"os": "linux", "architecture": "arm64"}},
            {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": md.to_string(), "size": manifest.len(),
             "platform": {"os": "linux", "architecture": "amd64"}},
        ],
    }))
    .unwrap();
    oci::put_manifest_with_client(client, r, "application/vnd.oci.image.index.v1+json", &index)
        .unwrap();
}

#[test]
fn pull_run_push_pull_round_trip() {
    let Some(reg) = Registry::start() else { return };
    let env = Env::new();
    let src = publish_busybox(&reg);
    let a = oci::pull(&env.store, &src, "busybox").unwrap();
    assert_eq!(a.image.layers.len(), 2);

    // Push, pull back, push again: same layers, same manifest bytes.
    let r1 = oci::push(&env.store, "busybox", &reg.reference("test/roundtrip:1")).unwrap();
    let b = oci::pull(&env.store, &reg.reference("test/roundtrip:1"), "roundtrip").unwrap();
    // A pull of an image whose layers the store already has downloads no layer blob.
    let again = oci::pull(&env.store, &src, "busybox-again").unwrap();
    assert_eq!(
        (again.compressed_bytes, again.image.layers.clone()),
        (0, a.image.layers.clone())
    );
    assert_eq!(
        a.image.layers, b.image.layers,
        "layers changed through the registry"
    );
    assert_eq!(b.manifest_digest, r1.manifest_digest);
    let r2 = oci::push(&env.store, "roundtrip", &reg.reference("test/roundtrip:2")).unwrap();
    assert_eq!(
        r1.manifest_digest, r2.manifest_digest,
        "push is not byte-stable"
    );
    assert_eq!(r1.layers, r2.layers);
    // The original config (entrypoint, env) survives.
    let cfg: serde_json::Value =
        serde_json::from_slice(&env.store.get_blob(&b.image.config.unwrap()).unwrap()).unwrap();
    assert_eq!(cfg["config"]["Entrypoint"][0], "/bin/sh");

    // Pull by digest works too, and a tampered reference is refused.
    let by_digest = Reference {
        reference: r1.manifest_digest.to_string(),
        ..reg.reference("test/roundtrip:1")
    };
    oci::pull(&env.store, &by_digest, "pinned").unwrap();
    let missing = oci::pull(&env.store, &reg.reference("test/nothere:1"), "x")
        .unwrap_err()
        .to_string();
    assert!(missing.contains("404"), "{missing}");

    if !can_mount() {
        return;
    }
    let mnt = env.path("mnt");
    fs::create_dir(&mnt).unwrap();
    let tree = Arc::new(env.cache.compose(&a.image.layers).unwrap());
    let m = fuse::mount(tree, env.cache.clone(), &mnt, false).unwrap();
    let _g = MountGuard(mnt.clone());
    assert_eq!(
        fs::read(mnt.join("bin/busybox")).unwrap(),
        fs::read("/bin/busybox").unwrap()
    );
    assert!(!mnt.join("etc/motd").exists());
    let out = Command::new("chroot")
        .arg(&mnt)
        .args(["/bin/sh", "-c", "cat /etc/hostname; echo ran"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "sandbox\nran\n");
    m.unmount();
}

#[test]
fn tls_registry_with_basic_auth() {
    let Some(reg) = Registry::start_secure("alice", "s3cret") else {
        return;
    };
    let env = Env::new();
    let r = reg.reference("test/busybox:1");
    let creds = |password: &str| {
        Some(Credentials {
            username: "alice".into(),
            password: password.into(),
        })
    };
    let options = |ca: bool, password: Option<&str>| ClientOptions {
        ca_file: if ca { reg.ca.clone() } else { None },
        credentials: password.and_then(creds),
    };
    let connect =
        |o: ClientOptions| registry::Client::connect_with(&reg.addr, &r.repo, "pull,push", o);

    // The certificate is not trusted by default: a clear TLS error, no silent plain HTTP.
    let err = connect(options(false, Some("s3cret")))
        .unwrap_err()
        .to_string();
    assert!(
        err.to_lowercase().contains("certificate") || err.contains("TLS") || err.contains("tls"),
        "{err}"
    );
    // Trusted, but no credentials or wrong ones: told how to log in / refused.
    let err = connect(options(true, None)).unwrap_err().to_string();
    assert!(err.contains("docker login"), "{err}");
    let err = connect(options(true, Some("wrong")))
        .unwrap_err()
        .to_string();
    assert!(err.contains("refused the credentials"), "{err}");

    // Trusted and logged in: publish, pull (amd64 from the list), push back, pull again.
    let client = connect(options(true, Some("s3cret"))).unwrap();
    assert_eq!(client.scheme(), "https");
    assert!(client.is_authenticated());
    publish_busybox_with(&client, &r);
    let a = oci::pull_with_client(
        &env.store,
        &r,
        "busybox",
        &dsec_layerfs::progress::NoProgress,
        &client,
    )
    .unwrap();
    assert_eq!(a.image.layers.len(), 2);
    let copy = reg.reference("test/copy:1");
    let pushed = oci::push_with_client(&env.store, "busybox", &copy, &client).unwrap();
    let b = oci::pull_with_client(
        &env.store,
        &copy,
        "copy",
        &dsec_layerfs::progress::NoProgress,
        &client,
    )
    .unwrap();
    assert_eq!(b.manifest_digest, pushed.manifest_digest);
    assert_eq!(a.image.layers, b.image.layers);
}
