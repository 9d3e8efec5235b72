//! Kernel overlayfs glue: materialize a layer as an overlayfs lower directory (the container
//! backend can use layers as lowerdirs directly), mount a sandbox root (read-only layers
//! below, a local writable upper on top) and `pack_diff` the upper into a new layer.

use std::collections::HashMap;
use std::ffi::CString;
use std::fs;
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::build::{build_from_dir, build_from_dir_with_progress, BuildStats, DirMode};
use crate::cache::NodeCache;
use crate::digest::Digest;
use crate::error::{Error, Result};
use crate::index::{Kind, LayerIndex};
use crate::progress::Progress;
use crate::store::Store;

fn cstr(p: &Path) -> Result<CString> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| Error::Invalid(format!("path {} has a NUL byte", p.display())))
}

fn check(r: libc::c_int, what: &'static str, p: &Path) -> Result<()> {
    if r < 0 {
        Err(Error::io(what, p, std::io::Error::last_os_error()))
    } else {
        Ok(())
    }
}

pub(crate) fn lchown(p: &Path, uid: u32, gid: u32) -> Result<()> {
    let c = cstr(p)?;
    // SAFETY: c is a valid NUL-terminated path.
    check(unsafe { libc::lchown(c.as_ptr(), uid, gid) }, "chown", p)
}

pub(crate) fn chmod(p: &Path, mode: u32) -> Result<()> {
    let c = cstr(p)?;
    // SAFETY: c is a valid NUL-terminated path.
    check(
        unsafe { libc::chmod(c.as_ptr(), mode as libc::mode_t) },
        "chmod",
        p,
    )
}

pub(crate) fn set_mtime(p: &Path, sec: i64, nsec: u32) -> Result<()> {
    let c = cstr(p)?;
    let ts = [
        libc::timespec {
            tv_sec: sec,
            tv_nsec: nsec as _,
        },
        libc::timespec {
            tv_sec: sec,
            tv_nsec: nsec as _,
        },
    ];
    // SAFETY: c is a valid path, ts points to two timespecs.
    let r = unsafe {
        libc::utimensat(
            libc::AT_FDCWD,
            c.as_ptr(),
            ts.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    check(r, "setting times of", p)
}

pub(crate) fn mknod(p: &Path, kind: u32, perm: u32, dev: libc::dev_t) -> Result<()> {
    let c = cstr(p)?;
    // SAFETY: c is a valid NUL-terminated path.
    check(
        unsafe { libc::mknod(c.as_ptr(), (kind | perm) as libc::mode_t, dev) },
        "mknod",
        p,
    )
}

/// Writes `index` as an overlayfs lower directory at `dest` (which must not exist):
/// whiteouts become 0/0 character devices, opaque dirs get `trusted.overlay.opaque=y`.
/// Ownership is set before modes and xattrs, since chown clears setuid bits and file
/// capabilities. Nothing is ever followed: every path's parent was created here as a dir.
pub fn export_overlay_dir(cache: &NodeCache, index: &LayerIndex, dest: &Path) -> Result<()> {
    fs::create_dir(dest)
        .map_err(|e| Error::io("creating export directory (it must not exist yet)", dest, e))?;
    let mut first_of_group: HashMap<u32, PathBuf> = HashMap::new();
    let mut dirs = Vec::new();
    for e in &index.entries {
        let p = if e.path.is_empty() {
            dest.to_path_buf()
        } else {
            dest.join(&e.path)
        };
        if let Some(g) = e.link {
            if let Some(first) = first_of_group.get(&g) {
                fs::hard_link(first, &p).map_err(|err| Error::io("hard-linking", &p, err))?;
                continue;
            }
            first_of_group.insert(g, p.clone());
        }
        match &e.kind {
            Kind::Dir { opaque, .. } => {
                if !e.path.is_empty() {
                    fs::create_dir(&p).map_err(|err| Error::io("creating directory", &p, err))?;
                }
                if *opaque {
                    crate::xattr::set(&p, std::ffi::OsStr::new("trusted.overlay.opaque"), b"y")
                        .map_err(|err| Error::io("marking opaque", &p, err))?;
                }
                dirs.push((p.clone(), e));
                lchown(&p, e.uid, e.gid)?;
                chmod(&p, e.mode)?;
            }
            Kind::File { chunks, .. } => {
                let mut f = fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .custom_flags(libc::O_NOFOLLOW)
                    .mode(0o600)
                    .open(&p)
                    .map_err(|err| Error::io("creating file", &p, err))?;
                for c in chunks {
                    let pinned = cache.get(c)?;
                    let mut buf = vec![0u8; c.len as usize];
                    pinned
                        .read_at(&mut buf, 0)
                        .map_err(|err| Error::io("reading cached chunk for", &p, err))?;
                    f.write_all(&buf)
                        .map_err(|err| Error::io("writing", &p, err))?;
                }
                drop(f);
                lchown(&p, e.uid, e.gid)?;
                chmod(&p, e.mode)?;
            }
            Kind::Symlink { target } => {
                std::os::unix::fs::symlink(target, &p)
                    .map_err(|err| Error::io("creating symlink", &p, err))?;
                lchown(&p, e.uid, e.gid)?;
            }
            Kind::Char { major, minor } => {
                mknod(&p, libc::S_IFCHR, e.mode, libc::makedev(*major, *minor))?;
                lchown(&p, e.uid, e.gid)?;
                chmod(&p, e.mode)?;
            }
            Kind::Block { major, minor } => {
                mknod(&p, libc::S_IFBLK, e.mode, libc::makedev(*major, *minor))?;
                lchown(&p, e.uid, e.gid)?;
                chmod(&p, e.mode)?;
            }
            Kind::Fifo => {
                mknod(&p, libc::S_IFIFO, e.mode, 0)?;
                lchown(&p, e.uid, e.gid)?;
                chmod(&p, e.mode)?;
            }
            Kind::Socket => continue,
            Kind::Whiteout => {
                mknod(&p, libc::S_IFCHR, 0, 0)?;
                continue;
            }
        }
        for (k, v) in &e.xattrs {
            crate::xattr::set(&p, std::ffi::OsStr::new(k), &v.0)
                .map_err(|err| Error::io("setting xattr on", &p, err))?;
        }
        if !e.kind.is_dir() {
            set_mtime(&p, e.mtime, e.mtime_nsec)?;
        }
    }
    // Directory times last: creating children changed them.
    for (p, e) in dirs.iter().rev() {
        set_mtime(p, e.mtime, e.mtime_nsec)?;
    }
    Ok(())
}

/// Mounts overlayfs at `target`: `lowers` top first; with `upper`/`work` it is writable.
/// redirect_dir and metacopy stay off so the upper is a plain OCI-style diff for pack_diff.
pub fn mount_overlay(lowers: &[&Path], upper: Option<(&Path, &Path)>, target: &Path) -> Result<()> {
    let mut opts = format!(
        "lowerdir={}",
        lowers
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(":")
    );
    if let Some((u, w)) = upper {
        opts.push_str(&format!(
            ",upperdir={},workdir={}",
            u.display(),
            w.display()
        ));
    }
    opts.push_str(",redirect_dir=off,metacopy=off,index=off");
    let src = CString::new("overlay").expect("static");
    let tgt = cstr(target)?;
    let data =
        CString::new(opts.clone()).map_err(|_| Error::Invalid("NUL in overlay options".into()))?;
    // SAFETY: all pointers are valid NUL-terminated strings for the duration of the call.
    let r = unsafe {
        libc::mount(
            src.as_ptr(),
            tgt.as_ptr(),
            src.as_ptr(),
            0,
            data.as_ptr().cast(),
        )
    };
    if r < 0 {
        let e = std::io::Error::last_os_error();
        return Err(Error::io(
            "mounting overlayfs at",
            target,
            std::io::Error::new(e.kind(), format!("{e} (options {opts})")),
        ));
    }
    Ok(())
}

/// Unmounts `target` (lazily if busy, so cleanup never hangs).
pub fn unmount(target: &Path) -> Result<()> {
    let c = cstr(target)?;
    // SAFETY: c is a valid NUL-terminated path.
    if unsafe { libc::umount2(c.as_ptr(), 0) } == 0 {
        return Ok(());
    }
    // SAFETY: as above.
    check(
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) },
        "unmounting",
        target,
    )
}

/// Turns a sandbox's overlayfs upper directory into a new layer: new chunks only for new
/// content, deletions as whiteouts, replaced directories opaque. Unmount the overlay first.
pub fn pack_diff(store: &Store, upper: &Path) -> Result<(Digest, LayerIndex, BuildStats)> {
    build_from_dir(store, upper, DirMode::OverlayUpper)
}

/// `pack_diff`, reporting every stored chunk to `progress`.
pub fn pack_diff_with_progress(
    store: &Store,
    upper: &Path,
    progress: &dyn Progress,
) -> Result<(Digest, LayerIndex, BuildStats)> {
    build_from_dir_with_progress(store, upper, DirMode::OverlayUpper, progress)
}
