//! Writable upper + pack_diff: what a sandbox sees after its writes equals the image
//! rebuilt from its base layers plus the packed diff.

mod common;

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::sync::Arc;

use common::{can_mount, diff, snapshot, Env, MountGuard, Tar};
use dsec_layerfs::index::Kind;
use dsec_layerfs::sandbox::SandboxRoot;
use dsec_layerfs::{fuse, overlay};

#[test]
fn pack_diff_captures_a_sandbox_and_restores_it() {
    if !can_mount() {
        return;
    }
    let env = Env::new();
    let big: Vec<u8> = (0..200_000u32).map(|i| (i % 253) as u8).collect();
    let l0 = env.import(
        Tar::new()
            .dir("etc", 0o755)
            .file("etc/passwd", b"root:x:0:0::/root:/bin/sh\n")
            .file("etc/motd", b"hello")
            .dir("o", 0o755)
            .dir("o/sub", 0o755)
            .file("o/sub/a", b"a")
            .file("o/b", b"b")
            .dir("bin", 0o755)
            .file_owned("bin/tool", &big, 0o755, 0, 0)
            .file("gone", b"delete me")
            .bytes(),
    );
    let l1 = env.import(
        Tar::new()
            .dir("etc", 0o755)
            .file("etc/hostname", b"box")
            .bytes(),
    );
    let sb_dir = env.path("sb");
    let sb = SandboxRoot::mount(env.cache.clone(), &[l0, l1], &sb_dir, false).unwrap();
    let _g1 = MountGuard(sb_dir.join("root"));
    let _g2 = MountGuard(sb_dir.join("lower"));
    let r = sb.root();
    fs::write(r.join("new.txt"), b"new content").unwrap();
    fs::write(r.join("etc/passwd"), b"root:x:0:0::/root:/bin/bash\n").unwrap();
    fs::remove_file(r.join("gone")).unwrap();
    fs::remove_file(r.join("etc/motd")).unwrap();
    fs::remove_dir_all(r.join("o")).unwrap();
    fs::create_dir(r.join("o")).unwrap();
    fs::write(r.join("o/fresh"), b"fresh").unwrap();
    fs::set_permissions(r.join("bin/tool"), fs::Permissions::from_mode(0o700)).unwrap();
    fs::write(r.join("hl1"), b"linked").unwrap();
    fs::hard_link(r.join("hl1"), r.join("hl2")).unwrap();
    std::os::unix::fs::symlink("/etc/passwd", r.join("pw")).unwrap();
    fs::create_dir_all(r.join("new/dir")).unwrap();
    fs::write(r.join("new/dir/tmp"), b"x").unwrap();
    fs::remove_file(r.join("new/dir/tmp")).unwrap();
    dsec_layerfs::xattr::set(&r.join("new.txt"), std::ffi::OsStr::new("user.tag"), b"v").unwrap();
    let before = snapshot(&r);
    sb.unmount().unwrap();

    let upper = sb_dir.join("upper");
    let (id, idx, stats) = overlay::pack_diff(&env.store, &upper).unwrap();
    let (id2, _, _) = overlay::pack_diff(&env.store, &upper).unwrap();
    assert_eq!(id, id2, "pack_diff must be deterministic");
    let find = |p: &str| {
        idx.entries
            .iter()
            .find(|e| e.path == p)
            .unwrap_or_else(|| panic!("{p} not in diff"))
    };
    assert_eq!(find("gone").kind, Kind::Whiteout);
    assert_eq!(find("etc/motd").kind, Kind::Whiteout);
    assert!(matches!(find("o").kind, Kind::Dir { opaque: true, .. }));
    assert!(idx.entries.iter().all(|e| !e.path.starts_with("new/dir/")));
    // chmod-only copy-up: the data is deduplicated against the base layer's chunks.
    let base = env.cache.layer(&l0).unwrap();
    let base_tool = base.entries.iter().find(|e| e.path == "bin/tool").unwrap();
    assert_eq!(find("bin/tool").kind, base_tool.kind);
    assert!(
        stats.new_chunks <= 4,
        "only new content may add chunks: {stats:?}"
    );

    let mnt = env.path("restored");
    fs::create_dir(&mnt).unwrap();
    let tree = Arc::new(env.cache.compose(&[l0, l1, id]).unwrap());
    let m = fuse::mount(tree, env.cache.clone(), &mnt, false).unwrap();
    let _g3 = MountGuard(mnt.clone());
    let after = snapshot(&mnt);
    assert_eq!(diff(&before, &after, "sandbox", "restored"), 0);
    m.unmount();
}
