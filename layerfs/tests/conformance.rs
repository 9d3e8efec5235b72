//! OCI layer conformance: the merged FUSE view must equal what kernel overlayfs shows for
//! the same layers, and malformed or hostile layers must be rejected.

mod common;

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::sync::Arc;

use common::{can_mount, diff, snapshot, Env, MountGuard, Tar};
use dsec_layerfs::compose::ImageTree;
use dsec_layerfs::{fuse, overlay, tarfmt, Digest};

/// vfs_cap_data v2 with cap_net_raw permitted + effective.
const CAP_NET_RAW: [u8; 20] = [
    1, 0, 0, 2, 0, 0x20, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
];

fn long_name() -> String {
    "n".repeat(255)
}

fn deep_dir() -> String {
    (0..40)
        .map(|i| format!("deep{i:02}"))
        .collect::<Vec<_>>()
        .join("/")
}

fn layers() -> Vec<Vec<u8>> {
    let mut l0 = Tar::new()
        .dir("etc", 0o755)
        .file("etc/passwd", b"root:x:0:0::/root:/bin/sh\n")
        .dir("a", 0o755)
        .file("a/file", b"A")
        .file("a/other", b"other")
        .dir("d", 0o755)
        .dir("d/x", 0o755)
        .file("d/x/y", b"y")
        .dir("o", 0o755)
        .file("o/a", b"oa")
        .file("o/b", b"ob")
        .dir("h", 0o755)
        .file("h/h1", b"hard")
        .hardlink("h/h2", "h/h1")
        .symlink("h/s", "h1")
        .hardlink("h/s2", "h/s")
        .file("h/r1", b"replace me")
        .hardlink("h/r2", "h/r1")
        .dir("same", 0o755)
        .file("same/f", b"lower")
        .dir("same/d", 0o755)
        .file("same/d/old", b"old")
        .dir("bin", 0o755)
        .file_xattr(
            "bin/capped",
            b"#!/bin/sh\n",
            1000,
            &[("security.capability", &CAP_NET_RAW)],
        )
        .file_owned("bin/su", b"su", 0o4755, 0, 0)
        .file_owned("bin/owned", b"x", 0o640, 1234, 5678)
        .symlink("bin/abs", "/etc/passwd")
        .dir("dev", 0o755)
        .dev("dev/null", tar::EntryType::Char, 1, 3)
        .dev("dev/loop0", tar::EntryType::Block, 7, 0)
        .dev("dev/fifo", tar::EntryType::Fifo, 0, 0)
        .dir("long", 0o755)
        .file(&format!("long/{}", long_name()), b"long name");
    let mut p = String::from("long");
    for c in deep_dir().split('/') {
        p = format!("{p}/{c}");
        l0 = l0.dir(&p, 0o755);
    }
    l0 = l0.file(&format!("{p}/leaf"), b"deep leaf");
    let big: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
    l0 = l0.file("big", &big);

    let l1 = Tar::new()
        .dir("a", 0o700)
        .whiteout("a", "file")
        .whiteout("", "d")
        .dir("o", 0o755)
        .opaque("o")
        .file("o/c", b"oc")
        .dir("h", 0o755)
        .file("h/r1", b"replaced")
        .dir("same", 0o755)
        .whiteout("same", "f")
        .file("same/f", b"upper")
        .whiteout("same", "d")
        .dir("same/d", 0o755)
        .file("same/d/new", b"new")
        .dir("etc", 0o755)
        .file("etc/passwd", b"root:x:0:0::/root:/bin/bash\n");
    let l2 = Tar::new()
        .dir("a", 0o700)
        .file("a/file", b"A again")
        .dir("d", 0o750)
        .file("d/z", b"z");
    vec![l0.bytes(), l1.bytes(), l2.bytes()]
}

#[test]
fn composition_semantics_without_mounting() {
    let env = Env::new();
    let ids: Vec<Digest> = layers().into_iter().map(|t| env.import(t)).collect();
    let c = env.cache.compose(&ids).unwrap();
    let read = |p: &str| {
        let ino = c.resolve(p).unwrap_or_else(|| panic!("{p} missing"));
        env.cache.read(&c, ino, 0, 1 << 20).unwrap()
    };
    assert_eq!(read("a/file"), b"A again");
    assert!(c.resolve("a/other").is_some());
    assert!(
        c.resolve("d/x").is_none(),
        "whited-out dir must not come back when recreated"
    );
    assert_eq!(read("d/z"), b"z");
    assert!(c.resolve("o/a").is_none() && c.resolve("o/b").is_none());
    assert_eq!(read("o/c"), b"oc");
    assert_eq!(
        read("same/f"),
        b"upper",
        "whiteout must not hide its own layer's entry"
    );
    assert!(c.resolve("same/d/old").is_none());
    assert_eq!(read("same/d/new"), b"new");
    let h1 = c.resolve("h/h1").unwrap();
    assert_eq!(c.resolve("h/h2"), Some(h1));
    assert_eq!(c.attr(h1).unwrap().nlink, 2);
    let s = c.resolve("h/s").unwrap();
    assert_eq!(c.resolve("h/s2"), Some(s));
    assert_eq!(c.readlink(s), Some("h1"));
    assert_eq!(read("h/r1"), b"replaced");
    assert_eq!(read("h/r2"), b"replace me");
    assert_eq!(c.attr(c.resolve("h/r2").unwrap()).unwrap().nlink, 1);
    assert_eq!(c.attr(c.resolve("a").unwrap()).unwrap().perm, 0o700);
    let capped = c.resolve("bin/capped").unwrap();
    assert_eq!(
        c.xattrs(capped).unwrap()["security.capability"].0,
        CAP_NET_RAW
    );
    assert_eq!(c.attr(capped).unwrap().uid, 1000);
    assert_eq!(c.attr(c.resolve("bin/su").unwrap()).unwrap().perm, 0o4755);
    assert_eq!(read(&format!("long/{}/leaf", deep_dir())), b"deep leaf");
    assert_eq!(read(&format!("long/{}", long_name())), b"long name");
    let null = c.attr(c.resolve("dev/null").unwrap()).unwrap();
    assert_eq!(null.rdev, libc::makedev(1, 3));
    // Inode numbers are a function of the layer stack only.
    let again = env.cache.compose(&ids).unwrap();
    assert_eq!(again.resolve("h/h1"), Some(h1));
    assert_eq!(again.resolve("o/c"), c.resolve("o/c"));
}

fn import_err(tar: Vec<u8>) -> String {
    let env = Env::new();
    match tarfmt::import_tar(&env.store, &tar[..]) {
        Ok(_) => panic!("hostile layer was accepted"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn hostile_layers_are_rejected() {
    let e = import_err(Tar::new().dir("x", 0o755).file("x/.wh.", b"").bytes());
    assert!(e.contains("bare"), "{e}");
    let e = import_err(Tar::new().raw_file("../evil", b"x").bytes());
    assert!(e.contains("traversal"), "{e}");
    let e = import_err(
        Tar::new()
            .dir("a", 0o755)
            .raw_file("a/../../evil", b"x")
            .bytes(),
    );
    assert!(e.contains("traversal"), "{e}");
    let e = import_err(
        Tar::new()
            .file("f", b"x")
            .raw_link(tar::EntryType::Link, "l", "../../etc/passwd")
            .bytes(),
    );
    assert!(e.contains("escapes"), "{e}");
    let e = import_err(
        Tar::new()
            .raw_link(tar::EntryType::Link, "l", "nothere")
            .bytes(),
    );
    assert!(e.contains("not an earlier entry"), "{e}");
    let e = import_err(
        Tar::new()
            .symlink("lnk", "/etc")
            .file("lnk/passwd", b"pwned")
            .bytes(),
    );
    assert!(e.contains("not a directory"), "{e}");
    let e = import_err(
        Tar::new()
            .dir("x", 0o755)
            .file("x/.wh..wh.plnk", b"")
            .bytes(),
    );
    assert!(e.contains("reserved"), "{e}");
    let e = import_err(
        Tar::new()
            .dir("x", 0o755)
            .file("x/f", b"")
            .file("x", b"replaces dir")
            .bytes(),
    );
    assert!(e.contains("replaces a directory"), "{e}");

    // An absolute hard-link name is relative to the layer root: fine when it stays inside.
    let env = Env::new();
    let ok = Tar::new()
        .dir("etc", 0o755)
        .file("etc/passwd", b"x")
        .raw_link(tar::EntryType::Link, "pw", "/etc/passwd")
        .bytes();
    let id = env.import(ok);
    let c = env.cache.compose(&[id]).unwrap();
    assert_eq!(c.resolve("pw"), c.resolve("etc/passwd"));
}

#[test]
fn tar_export_is_deterministic_and_round_trips() {
    let env = Env::new();
    for t in layers() {
        let first = tarfmt::import_tar(&env.store, &t[..]).unwrap();
        let mut out1 = Vec::new();
        tarfmt::export_tar(&env.store, &first.index, &mut out1).unwrap();
        let second = tarfmt::import_tar(&env.store, &out1[..]).unwrap();
        assert_eq!(
            first.layer, second.layer,
            "export then import must give the same layer"
        );
        let mut out2 = Vec::new();
        tarfmt::export_tar(&env.store, &second.index, &mut out2).unwrap();
        assert_eq!(out1, out2, "export must be byte-stable");
    }
}

#[test]
fn compressed_layers_import_identically() {
    use std::io::Write;
    let env = Env::new();
    let t = layers().remove(0);
    let plain = tarfmt::import_tar(&env.store, &t[..]).unwrap();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(&t).unwrap();
    let gz = gz.finish().unwrap();
    let g = tarfmt::import_tar(&env.store, &gz[..]).unwrap();
    let zs = zstd::bulk::compress(&t, 3).unwrap();
    let z = tarfmt::import_tar(&env.store, &zs[..]).unwrap();
    assert_eq!(plain.layer, g.layer);
    assert_eq!(plain.layer, z.layer);
    assert_eq!(plain.diff_id, g.diff_id);
    assert_eq!(g.blob_digest, Digest::of(&gz));
    assert_eq!(z.blob_digest, Digest::of(&zs));
    assert_eq!(plain.diff_id, Digest::of(&t));
}

#[test]
fn fuse_view_equals_kernel_overlayfs() {
    if !can_mount() {
        return;
    }
    let env = Env::new();
    let ids: Vec<Digest> = layers().into_iter().map(|t| env.import(t)).collect();

    let mut lowers = Vec::new();
    for (i, id) in ids.iter().enumerate() {
        let p = env.path(&format!("lower{i}"));
        overlay::export_overlay_dir(&env.cache, &env.cache.layer(id).unwrap(), &p).unwrap();
        lowers.push(p);
    }
    let ovl = env.path("ovl");
    fs::create_dir(&ovl).unwrap();
    let top_first: Vec<&std::path::Path> = lowers.iter().rev().map(|p| p.as_path()).collect();
    overlay::mount_overlay(&top_first, None, &ovl).unwrap();
    let _og = MountGuard(ovl.clone());

    let mnt = env.path("fuse");
    fs::create_dir(&mnt).unwrap();
    let tree = Arc::new(env.cache.compose(&ids).unwrap());
    let m = fuse::mount(tree, env.cache.clone(), &mnt, false).unwrap();
    let _fg = MountGuard(mnt.clone());

    let ours = snapshot(&mnt);
    let mut theirs = snapshot(&ovl);
    // Known, intended difference: overlayfs shows the lower inode's link count (2) for a
    // hard link whose sibling an upper layer replaced; layerfs counts the names visible.
    assert_eq!(theirs["h/r2"].nlink, 2);
    assert_eq!(ours["h/r2"].nlink, 1);
    theirs.get_mut("h/r2").unwrap().nlink = 1;
    assert!(ours.len() > 60, "tree too small: {}", ours.len());
    assert_eq!(
        diff(&ours, &theirs, "layerfs", "overlayfs"),
        0,
        "merged trees differ"
    );

    // Hard links share an inode; the capability is visible to the kernel.
    let a = fs::metadata(mnt.join("h/h1")).unwrap();
    let b = fs::metadata(mnt.join("h/h2")).unwrap();
    assert_eq!((a.ino(), a.nlink()), (b.ino(), 2));
    assert_eq!(
        dsec_layerfs::xattr::get(&mnt.join("bin/capped"), b"security.capability")
            .unwrap()
            .unwrap(),
        CAP_NET_RAW
    );
    m.unmount();
}

#[test]
fn damaged_or_hostile_index_in_the_store_is_refused() {
    let env = Env::new();
    let put_raw = |bytes: &[u8]| {
        let id = Digest::of(bytes);
        fs::write(env.store.layer_path(&id), bytes).unwrap();
        id
    };
    let cases: [&[u8]; 5] = [
        b"not json",
        br#"{"version":1,"chunk_size":65536,"entries":[{"path":"","type":"dir","mode":493,"uid":0,"gid":0,"mtime":0},{"path":"a/b","type":"fifo","mode":420,"uid":0,"gid":0,"mtime":0}]}"#,
        br#"{"version":1,"chunk_size":65536,"entries":[{"path":"","type":"dir","mode":493,"uid":0,"gid":0,"mtime":0},{"path":"../x","type":"fifo","mode":420,"uid":0,"gid":0,"mtime":0}]}"#,
        br#"{"version":1,"chunk_size":65536,"entries":[{"path":"","type":"dir","mode":493,"uid":0,"gid":0,"mtime":0},{"path":"f","type":"file","size":10,"chunks":[],"mode":420,"uid":0,"gid":0,"mtime":0}]}"#,
        br#"{"version":1,"chunk_size":65536,"entries":[{"path":"","type":"dir","mode":493,"uid":0,"gid":0,"mtime":0},{"path":"z","type":"fifo","mode":420,"uid":0,"gid":0,"mtime":0},{"path":"a","type":"fifo","mode":420,"uid":0,"gid":0,"mtime":0}]}"#,
    ];
    for bytes in cases {
        let id = put_raw(bytes);
        let err = env.cache.layer(&id).unwrap_err().to_string();
        assert!(err.contains("invalid"), "{err}");
    }
    // A file whose name does not match its content is refused too.
    let good = env.import(Tar::new().file("f", b"x").bytes());
    let p = env.store.layer_path(&good);
    let mut bytes = fs::read(&p).unwrap();
    bytes.push(b' ');
    fs::write(&p, bytes).unwrap();
    assert!(env.store.get_layer(&good).is_err());
}

#[test]
fn ext4_image_for_microvms_equals_fuse_view() {
    if !can_mount() {
        return;
    }
    let env = Env::new();
    let ids: Vec<Digest> = layers().into_iter().map(|t| env.import(t)).collect();
    let tree = Arc::new(env.cache.compose(&ids).unwrap());
    let img = env.path("rootfs.ext4");
    dsec_layerfs::image::build_ext4(&env.cache, tree.as_ref(), &img, env.dir.path()).unwrap();

    let mnt = env.path("fuse");
    fs::create_dir(&mnt).unwrap();
    let m = fuse::mount(tree, env.cache.clone(), &mnt, false).unwrap();
    let _g1 = MountGuard(mnt.clone());
    let ext = env.path("ext4");
    fs::create_dir(&ext).unwrap();
    let st = std::process::Command::new("mount")
        .args(["-o", "loop,ro"])
        .arg(&img)
        .arg(&ext)
        .status()
        .unwrap();
    assert!(st.success(), "loop mount failed");
    let _g2 = MountGuard(ext.clone());
    let ours = snapshot(&mnt);
    let mut theirs = snapshot(&ext);
    theirs.remove("lost+found");
    // mkfs.ext4 -d (e2fsprogs 1.47) keeps hard links of regular files but copies a
    // hard-linked symlink as two symlinks: same target, separate inodes.
    for p in ["h/s", "h/s2"] {
        let r = theirs.get_mut(p).unwrap();
        assert_eq!((r.nlink, r.target.as_deref()), (1, Some("h1")));
        r.nlink = 2;
        r.link = Some("h/s".into());
    }
    assert_eq!(diff(&ours, &theirs, "layerfs", "ext4 image"), 0);
    m.unmount();
}
