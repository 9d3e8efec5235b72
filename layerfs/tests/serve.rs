//! The node mount service end to end over its Unix socket.

mod common;

use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{can_mount, MountGuard, Tar};
use dsec_layerfs::store::{now_secs, ImageRecord, Store, StoreConfig};
use serde_json::{json, Value};

fn call(conn: &mut BufReader<UnixStream>, req: Value) -> Value {
    writeln!(conn.get_mut(), "{req}").unwrap();
    let mut line = String::new();
    conn.read_line(&mut line).unwrap();
    serde_json::from_str(&line).unwrap()
}

#[test]
fn serve_mounts_sandboxes_over_a_socket() {
    if !can_mount() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("store"), StoreConfig::default()).unwrap();
    let tar = Tar::new().dir("etc", 0o755).file("etc/a", b"alpha").bytes();
    let id = dsec_layerfs::tarfmt::import_tar(&store, &tar[..])
        .unwrap()
        .layer;
    store
        .put_image(&ImageRecord {
            name: "img".into(),
            layers: vec![id],
            diff_ids: vec![],
            config: None,
            hot_list: None,
            created: now_secs(),
        })
        .unwrap();
    let sock = dir.path().join("layerfs.sock");
    let mut child = Command::new(env!("CARGO_BIN_EXE_dsec-layerfs"))
        .arg("--store")
        .arg(dir.path().join("store"))
        .arg("--cache")
        .arg(dir.path().join("cache"))
        .arg("serve")
        .arg("--socket")
        .arg(&sock)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let sb = dir.path().join("sb1");
    let ro = dir.path().join("ro");
    let _guards = [
        MountGuard(sb.join("root")),
        MountGuard(sb.join("lower")),
        MountGuard(ro.clone()),
    ];
    let deadline = Instant::now() + Duration::from_secs(20);
    let stream = loop {
        if let Ok(s) = UnixStream::connect(&sock) {
            break s;
        }
        assert!(Instant::now() < deadline, "service did not start");
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut conn = BufReader::new(stream);

    let r = call(
        &mut conn,
        json!({"op": "mount", "image": "img", "dir": sb, "writable": true}),
    );
    assert_eq!(r["ok"], true, "{r}");
    let root = std::path::PathBuf::from(r["root"].as_str().unwrap());
    assert_eq!(fs::read(root.join("etc/a")).unwrap(), b"alpha");
    fs::write(root.join("new"), b"written in the sandbox").unwrap();
    let again = call(
        &mut conn,
        json!({"op": "mount", "image": "img", "dir": sb, "writable": true}),
    );
    assert_eq!(again["ok"], false);
    assert!(again["error"].as_str().unwrap().contains("already mounted"));
    let bad = call(
        &mut conn,
        json!({"op": "mount", "image": "nope", "dir": ro}),
    );
    assert!(
        bad["error"].as_str().unwrap().contains("not found"),
        "{bad}"
    );
    assert_eq!(call(&mut conn, json!({"op": "bogus"}))["ok"], false);

    let r = call(
        &mut conn,
        json!({"op": "mount", "image": "img", "dir": ro, "record_hot": true}),
    );
    assert_eq!(r["ok"], true, "{r}");
    assert_eq!(fs::read(ro.join("etc/a")).unwrap(), b"alpha");
    let list = call(&mut conn, json!({"op": "list"}));
    assert_eq!(list["mounts"].as_array().unwrap().len(), 2);
    let stats = call(&mut conn, json!({"op": "stats"}));
    assert!(stats["cache"]["misses"].as_u64().unwrap() >= 1, "{stats}");

    let r = call(&mut conn, json!({"op": "unmount", "dir": sb}));
    assert_eq!(r["ok"], true, "{r}");
    assert_eq!(
        fs::read(sb.join("upper/new")).unwrap(),
        b"written in the sandbox"
    );
    assert!(!root.join("etc").exists());

    // SIGTERM with a mount still up: the service unmounts it and saves its hot list.
    // SAFETY: kill on our own child's pid.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert!(child.wait().unwrap().success());
    assert!(!ro.join("etc").exists());
    assert!(!sock.exists());
    assert!(store.get_image("img").unwrap().hot_list.is_some());
}
