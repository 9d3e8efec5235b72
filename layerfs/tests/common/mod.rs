//! Test helpers: hand-built layer tars, mounts that clean up on drop, tree snapshots.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use dsec_layerfs::cache::NodeCache;
use dsec_layerfs::store::{Store, StoreConfig};
use dsec_layerfs::Digest;

/// Root + /dev/fuse + overlayfs are needed for mount tests; elsewhere they say so and pass.
pub fn can_mount() -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let ok = root
        && Path::new("/dev/fuse").exists()
        && fs::read_to_string("/proc/filesystems")
            .is_ok_and(|s| s.contains("overlay") && s.contains("fuse"));
    if !ok {
        eprintln!("SKIPPED: mount tests need root, /dev/fuse and overlayfs");
    }
    ok
}

/// A layer tar under construction.
pub struct Tar {
    b: tar::Builder<Vec<u8>>,
}

impl Default for Tar {
    fn default() -> Self {
        Self::new()
    }
}

impl Tar {
    pub fn new() -> Self {
        Tar {
            b: tar::Builder::new(Vec::new()),
        }
    }
    fn hdr(kind: tar::EntryType, mode: u32, size: u64) -> tar::Header {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(1_700_000_000);
        h.set_size(size);
        h
    }
    pub fn dir(mut self, p: &str, mode: u32) -> Self {
        let mut h = Self::hdr(tar::EntryType::Directory, mode, 0);
        self.b.append_data(&mut h, p, std::io::empty()).unwrap();
        self
    }
    pub fn file(self, p: &str, data: &[u8]) -> Self {
        self.file_owned(p, data, 0o644, 0, 0)
    }
    pub fn file_owned(mut self, p: &str, data: &[u8], mode: u32, uid: u64, gid: u64) -> Self {
        let mut h = Self::hdr(tar::EntryType::Regular, mode, data.len() as u64);
        h.set_uid(uid);
        h.set_gid(gid);
        self.b.append_data(&mut h, p, data).unwrap();
        self
    }
    pub fn file_xattr(mut self, p: &str, data: &[u8], uid: u64, xattrs: &[(&str, &[u8])]) -> Self {
        let keys: Vec<(String, &[u8])> = xattrs
            .iter()
            .map(|(k, v)| (format!("SCHILY.xattr.{k}"), *v))
            .collect();
        self.b
            .append_pax_extensions(keys.iter().map(|(k, v)| (k.as_str(), *v)))
            .unwrap();
        let mut h = Self::hdr(tar::EntryType::Regular, 0o755, data.len() as u64);
        h.set_uid(uid);
        h.set_gid(uid);
        self.b.append_data(&mut h, p, data).unwrap();
        self
    }
    pub fn symlink(mut self, p: &str, target: &str) -> Self {
        let mut h = Self::hdr(tar::EntryType::Symlink, 0o777, 0);
        self.b.append_link(&mut h, p, target).unwrap();
        self
    }
    pub fn hardlink(mut self, p: &str, target: &str) -> Self {
        let mut h = Self::hdr(tar::EntryType::Link, 0o644, 0);
        self.b.append_link(&mut h, p, target).unwrap();
        self
    }
    /// Writes a raw link name without the tar crate's path checks (for traversal tests).
    pub fn raw_link(mut self, kind: tar::EntryType, p: &str, target: &str) -> Self {
        let mut h = Self::hdr(kind, 0o644, 0);
        h.set_path(p).ok();
        {
            let gnu = h.as_gnu_mut().unwrap();
            let t = target.as_bytes();
            gnu.linkname = [0; 100];
            gnu.linkname[..t.len()].copy_from_slice(t);
        }
        h.set_cksum();
        self.b.append(&h, std::io::empty()).unwrap();
        self
    }
    /// A regular entry with a raw name (bypasses the tar crate's checks).
    pub fn raw_file(mut self, p: &str, data: &[u8]) -> Self {
        let mut h = Self::hdr(tar::EntryType::Regular, 0o644, data.len() as u64);
        {
            let gnu = h.as_gnu_mut().unwrap();
            let n = p.as_bytes();
            gnu.name = [0; 100];
            gnu.name[..n.len()].copy_from_slice(n);
        }
        h.set_cksum();
        self.b.append(&h, data).unwrap();
        self
    }
    pub fn dev(mut self, p: &str, kind: tar::EntryType, major: u32, minor: u32) -> Self {
        let mut h = Self::hdr(kind, 0o666, 0);
        h.set_device_major(major).unwrap();
        h.set_device_minor(minor).unwrap();
        self.b.append_data(&mut h, p, std::io::empty()).unwrap();
        self
    }
    pub fn whiteout(self, dir: &str, name: &str) -> Self {
        let p = if dir.is_empty() {
            format!(".wh.{name}")
        } else {
            format!("{dir}/.wh.{name}")
        };
        self.file(&p, b"")
    }
    pub fn opaque(self, dir: &str) -> Self {
        self.file(&format!("{dir}/.wh..wh..opq"), b"")
    }
    pub fn bytes(self) -> Vec<u8> {
        self.b.into_inner().unwrap()
    }
}

/// Store + node cache in one temp dir.
pub struct Env {
    pub dir: tempfile::TempDir,
    pub store: Arc<Store>,
    pub cache: Arc<NodeCache>,
}

impl Env {
    pub fn new() -> Env {
        Self::with(
            StoreConfig {
                chunk_size: 64 * 1024,
                ..Default::default()
            },
            u64::MAX,
        )
    }
    pub fn with(cfg: StoreConfig, cap: u64) -> Env {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(Store::open(dir.path().join("store"), cfg).unwrap());
        let cache =
            Arc::new(NodeCache::open(dir.path().join("cache"), store.clone(), cap).unwrap());
        Env { dir, store, cache }
    }
    pub fn import(&self, tar: Vec<u8>) -> Digest {
        dsec_layerfs::tarfmt::import_tar(&self.store, &tar[..])
            .unwrap()
            .layer
    }
    pub fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }
}

/// Unmounts on drop, even when a test panics.
pub struct MountGuard(pub PathBuf);

impl Drop for MountGuard {
    fn drop(&mut self) {
        let _ = dsec_layerfs::overlay::unmount(&self.0);
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rec {
    pub kind: &'static str,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub size: u64,
    pub nlink: u64,
    pub mtime: i64,
    pub rdev: u64,
    pub data: Option<Digest>,
    pub target: Option<String>,
    pub xattrs: BTreeMap<String, Vec<u8>>,
    /// For hard links (nlink > 1): the first path of the inode's group.
    pub link: Option<String>,
    /// Raw (dev, ino) key, used only to build `link`; not compared.
    #[doc(hidden)]
    pub raw_ino: u64,
}

/// Snapshot of a tree, keyed by relative path. Directory nlink and size are left out:
/// overlayfs reports nlink=1 for merged directories.
pub fn snapshot(root: &Path) -> BTreeMap<String, Rec> {
    snapshot_opts(root, false)
}

/// Like `snapshot`; with `skip_ghosts`, names readdir lists but lstat cannot find are left
/// out. Kernel overlayfs lists a whiteout inside a directory that only one layer provides
/// (nothing below to merge), yet hides it on lookup; layerfs never lists such a name.
pub fn snapshot_opts(root: &Path, skip_ghosts: bool) -> BTreeMap<String, Rec> {
    let mut out = BTreeMap::new();
    walk(root, root, &mut out, skip_ghosts);
    // Replace inode numbers by the first path of each inode, so trees compare.
    // Only hard links (nlink > 1) are grouped: overlayfs over mixed filesystems may
    // repeat inode numbers of unrelated files.
    let mut first: BTreeMap<u64, String> = BTreeMap::new();
    for (path, r) in out.iter_mut() {
        if r.kind != "dir" && r.nlink > 1 {
            r.link = Some(
                first
                    .entry(r.raw_ino)
                    .or_insert_with(|| path.clone())
                    .clone(),
            );
        }
        r.raw_ino = 0;
    }
    // A group with one visible name is no group (overlayfs may still count hidden links).
    let mut members: BTreeMap<String, usize> = BTreeMap::new();
    for r in out.values() {
        if let Some(l) = &r.link {
            *members.entry(l.clone()).or_default() += 1;
        }
    }
    for r in out.values_mut() {
        if r.link.as_ref().is_some_and(|l| members[l] < 2) {
            r.link = None;
        }
    }
    out
}

fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<String, Rec>, skip_ghosts: bool) {
    let mut names: Vec<_> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    names.sort();
    for n in names {
        let p = dir.join(&n);
        let rel = p.strip_prefix(root).unwrap().to_str().unwrap().to_string();
        let md = match fs::symlink_metadata(&p) {
            Ok(md) => md,
            Err(e) if skip_ghosts && e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => panic!("lstat {}: {e}", p.display()),
        };
        let ft = md.file_type();
        let kind = if ft.is_dir() {
            "dir"
        } else if ft.is_file() {
            "file"
        } else if ft.is_symlink() {
            "symlink"
        } else if ft.is_char_device() {
            "char"
        } else if ft.is_block_device() {
            "block"
        } else if ft.is_fifo() {
            "fifo"
        } else {
            "socket"
        };
        let mut xattrs = BTreeMap::new();
        for k in dsec_layerfs::xattr::list(&p).unwrap() {
            if k.starts_with(b"trusted.overlay.") {
                continue;
            }
            let v = dsec_layerfs::xattr::get(&p, &k)
                .unwrap()
                .unwrap_or_default();
            xattrs.insert(String::from_utf8(k).unwrap(), v);
        }
        let rec = Rec {
            kind,
            mode: md.mode() & 0o7777,
            uid: md.uid(),
            gid: md.gid(),
            size: if ft.is_dir() { 0 } else { md.len() },
            nlink: if ft.is_dir() { 0 } else { md.nlink() },
            mtime: md.mtime(),
            rdev: md.rdev(),
            data: ft.is_file().then(|| Digest::of(&fs::read(&p).unwrap())),
            target: ft
                .is_symlink()
                .then(|| fs::read_link(&p).unwrap().to_str().unwrap().to_string()),
            xattrs,
            // dev folded in so equal inode numbers on different filesystems stay apart.
            raw_ino: md.ino() ^ md.dev().rotate_left(48),
            link: None,
        };
        out.insert(rel, rec);
        if ft.is_dir() {
            walk(root, &p, out, skip_ghosts);
        }
    }
}

/// Prints the differences between two snapshots and returns how many there are.
pub fn diff(a: &BTreeMap<String, Rec>, b: &BTreeMap<String, Rec>, an: &str, bn: &str) -> usize {
    let mut n = 0;
    for (k, v) in a {
        match b.get(k) {
            None => {
                eprintln!("only in {an}: {k}");
                n += 1
            }
            Some(w) if w != v => {
                eprintln!("differs: {k}\n  {an}: {v:?}\n  {bn}: {w:?}");
                n += 1
            }
            _ => {}
        }
    }
    for k in b.keys() {
        if !a.contains_key(k) {
            eprintln!("only in {bn}: {k}");
            n += 1;
        }
    }
    n
}
