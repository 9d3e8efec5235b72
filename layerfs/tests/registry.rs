//! OCI import/export against a real registry (Debian's docker-registry on 127.0.0.1):
//! multi-platform index, gzip and zstd layers, a busybox rootfs that runs from the FUSE
//! view, and a byte-stable push/pull round trip.

mod common;

use std::fs;
use std::io::Write;
use std::process::Command;
use std::sync::Arc;

use common::{can_mount, Env, MountGuard, Tar};
use dsec_layerfs::oci::{self, Reference};
use dsec_layerfs::registry::{self, ClientOptions, Credentials};
use dsec_layerfs::testing::LocalRegistry;
use dsec_layerfs::{fuse, Digest};
use serde_json::json;

fn gzip(b: &[u8]) -> Vec<u8> {
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(b).unwrap();
    gz.finish().unwrap()
}

/// Publishes a busybox image by hand: a manifest list whose linux/amd64 entry has a gzip
/// base layer and a zstd layer on top.
fn publish_busybox(reg: &LocalRegistry) -> Reference {
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
    let Some(reg) = LocalRegistry::start() else {
        return;
    };
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
    let Some(reg) = LocalRegistry::start_secure("alice", "s3cret") else {
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

/// The Bearer flow against a live token-auth registry: the 401 names the token realm, the
/// client fetches a token for the repository and the actions it needs (with the stored
/// credentials), and the registry honours exactly the actions the token grants.
#[test]
fn token_registry_with_bearer_auth() {
    let Some(reg) = LocalRegistry::start_token_auth(&[
        ("alice", "s3cret", "pull,push"),
        ("reader", "r3ad", "pull"),
    ]) else {
        return;
    };
    let tokens = reg.tokens.as_ref().expect("token server");
    let env = Env::new();
    let r = reg.reference("test/busybox:1");
    let connect = |user: Option<(&str, &str)>, actions: &str| {
        registry::Client::connect_with(
            &reg.addr,
            &r.repo,
            actions,
            ClientOptions {
                ca_file: None,
                credentials: user.map(|(u, p)| Credentials {
                    username: u.into(),
                    password: p.into(),
                }),
            },
        )
    };

    // No credentials or wrong ones: the token server says no, the client says how to log in.
    for user in [None, Some(("alice", "wrong"))] {
        let err = connect(user, "pull,push").unwrap_err().to_string();
        assert!(err.contains("docker login"), "{err}");
    }
    assert_eq!(tokens.issued.load(std::sync::atomic::Ordering::SeqCst), 0);

    // Logged in with push rights: publish, then pull it back through a token.
    let client = connect(Some(("alice", "s3cret")), "pull,push").unwrap();
    assert!(client.is_authenticated());
    publish_busybox_with(&client, &r);
    let pulled = oci::pull_with_client(
        &env.store,
        &r,
        "busybox",
        &dsec_layerfs::progress::NoProgress,
        &connect(Some(("reader", "r3ad")), "pull").unwrap(),
    )
    .unwrap();
    assert_eq!(pulled.image.layers.len(), 2);
    assert!(tokens.issued.load(std::sync::atomic::Ordering::SeqCst) >= 2);

    // A pull-only token: reads work, the registry refuses a push and the error says so.
    let reader = connect(Some(("reader", "r3ad")), "pull,push").unwrap();
    let copy = reg.reference("test/busybox:2");
    let err = oci::push_with_client(&env.store, "busybox", &copy, &reader)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("401") || err.contains("403") || err.to_lowercase().contains("denied"),
        "{err}"
    );
}
