//! Whole-image outputs built from any `ImageTree`: the merged tree as a plain directory, and
//! an ext4 image of it for microVMs (virtio-blk, or pmem with DAX so co-located VMs share one
//! host page cache). These are eager by nature; the lazy path is the FUSE view.

use std::collections::HashMap;
use std::fs;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::cache::NodeCache;
use crate::compose::{FileKind, ImageTree, ROOT_INO};
use crate::error::{Error, Result};
use crate::overlay::{chmod, lchown, mknod, set_mtime};

/// Writes the merged tree into `dest` (which must not exist). Hard links stay hard links;
/// ownership is set before modes and xattrs (chown clears setuid bits and capabilities).
pub fn export_tree(cache: &NodeCache, tree: &dyn ImageTree, dest: &Path) -> Result<()> {
    fs::create_dir(dest)
        .map_err(|e| Error::io("creating export directory (it must not exist yet)", dest, e))?;
    let mut seen: HashMap<u64, PathBuf> = HashMap::new();
    let mut dirs: Vec<(PathBuf, u64)> = vec![(dest.to_path_buf(), ROOT_INO)];
    let mut stack = vec![(dest.to_path_buf(), ROOT_INO)];
    while let Some((dir, dino)) = stack.pop() {
        for (name, ino) in tree.children(dino).unwrap_or(&[]) {
            let p = dir.join(name);
            if let Some(first) = seen.get(ino) {
                fs::hard_link(first, &p).map_err(|e| Error::io("hard-linking", &p, e))?;
                continue;
            }
            let a = tree
                .attr(*ino)
                .ok_or_else(|| Error::Invalid(format!("inode {ino} vanished from the tree")))?;
            match a.kind {
                FileKind::Dir => {
                    fs::create_dir(&p).map_err(|e| Error::io("creating directory", &p, e))?;
                    dirs.push((p.clone(), *ino));
                    stack.push((p.clone(), *ino));
                }
                FileKind::File => {
                    let mut f = fs::OpenOptions::new()
                        .write(true)
                        .create_new(true)
                        .custom_flags(libc::O_NOFOLLOW)
                        .mode(0o600)
                        .open(&p)
                        .map_err(|e| Error::io("creating file", &p, e))?;
                    let (_, chunks) = tree.file_chunks(*ino).unwrap_or((0, &[]));
                    let mut buf = Vec::new();
                    for c in chunks {
                        let pinned = cache.get(c)?;
                        buf.resize(c.len as usize, 0);
                        pinned
                            .read_at(&mut buf, 0)
                            .map_err(|e| Error::io("reading cached chunk for", &p, e))?;
                        f.write_all(&buf).map_err(|e| Error::io("writing", &p, e))?;
                    }
                }
                FileKind::Symlink => {
                    let t = tree.readlink(*ino).unwrap_or_default();
                    std::os::unix::fs::symlink(t, &p)
                        .map_err(|e| Error::io("creating symlink", &p, e))?;
                }
                FileKind::Char => mknod(&p, libc::S_IFCHR, a.perm, a.rdev)?,
                FileKind::Block => mknod(&p, libc::S_IFBLK, a.perm, a.rdev)?,
                FileKind::Fifo => mknod(&p, libc::S_IFIFO, a.perm, 0)?,
                FileKind::Socket => continue,
            }
            seen.insert(*ino, p.clone());
            finish(tree, &p, *ino)?;
        }
    }
    finish(tree, dest, ROOT_INO)?;
    for (p, ino) in dirs.iter().rev() {
        let a = tree.attr(*ino).expect("listed above");
        set_mtime(p, a.mtime, a.mtime_nsec)?;
    }
    Ok(())
}

fn finish(tree: &dyn ImageTree, p: &Path, ino: u64) -> Result<()> {
    let a = tree.attr(ino).expect("caller checked");
    lchown(p, a.uid, a.gid)?;
    if a.kind != FileKind::Symlink {
        chmod(p, a.perm)?;
    }
    for (k, v) in tree.xattrs(ino).into_iter().flatten() {
        crate::xattr::set(p, std::ffi::OsStr::new(k), &v.0)
            .map_err(|e| Error::io("setting xattr on", p, e))?;
    }
    if a.kind != FileKind::Dir {
        set_mtime(p, a.mtime, a.mtime_nsec)?;
    }
    Ok(())
}

/// Builds an ext4 image of the tree at `out` with `mkfs.ext4 -d` (e2fsprogs >= 1.47),
/// staging the tree in `work` (removed afterwards). Returns the image size in bytes.
pub fn build_ext4(cache: &NodeCache, tree: &dyn ImageTree, out: &Path, work: &Path) -> Result<u64> {
    let stage = work.join("ext4-stage");
    let res = (|| {
        export_tree(cache, tree, &stage)?;
        let mut data = 0u64;
        let mut inodes = 0u64;
        for ino in 1..=tree.inode_count() {
            if let Some(a) = tree.attr(ino) {
                inodes += 1;
                data += a.size.div_ceil(4096) * 4096 + 4096;
            }
        }
        // Room for metadata, inode tables and the tree itself.
        let size = (data + inodes * 256 + (64 << 20)) * 11 / 10;
        let size = size.div_ceil(1 << 20) << 20;
        let f = fs::File::create(out).map_err(|e| Error::io("creating image", out, e))?;
        f.set_len(size)
            .map_err(|e| Error::io("sizing image", out, e))?;
        drop(f);
        let st = Command::new("mkfs.ext4")
            .args(["-q", "-F", "-b", "4096", "-O", "^has_journal", "-N"])
            .arg((inodes + 1024).to_string())
            .arg("-d")
            .arg(&stage)
            .arg(out)
            .status()
            .map_err(|e| Error::io("running mkfs.ext4 (install e2fsprogs >= 1.47)", out, e))?;
        if !st.success() {
            return Err(Error::Invalid(format!(
                "mkfs.ext4 -d failed for {} ({st})",
                out.display()
            )));
        }
        Ok(size)
    })();
    let _ = fs::remove_dir_all(&stage);
    res
}
