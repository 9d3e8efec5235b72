//! The parts of the new mount API that nix does not wrap (open_tree, mount_setattr,
//! move_mount): idmapped mounts need them.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

const OPEN_TREE_CLONE: libc::c_uint = 1;
const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x4;

pub const MOUNT_ATTR_RDONLY: u64 = 0x1;
pub const MOUNT_ATTR_NODEV: u64 = 0x4;
const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;

/// `struct mount_attr` (MOUNT_ATTR_SIZE_VER0).
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

fn cpath(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))
}

fn fd_result(rc: libc::c_long) -> io::Result<OwnedFd> {
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the system call returned a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(rc as libc::c_int) })
}

fn unit_result(rc: libc::c_long) -> io::Result<()> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// A detached copy of the mount tree at `path` (open_tree with OPEN_TREE_CLONE).
pub fn clone_tree(path: &Path, recursive: bool) -> io::Result<OwnedFd> {
    let c = cpath(path)?;
    let flags = OPEN_TREE_CLONE
        | libc::O_CLOEXEC as libc::c_uint
        | if recursive {
            libc::AT_RECURSIVE as libc::c_uint
        } else {
            0
        };
    // SAFETY: `c` is a NUL-terminated path that outlives the call; the kernel only reads it.
    fd_result(unsafe { libc::syscall(libc::SYS_open_tree, libc::AT_FDCWD, c.as_ptr(), flags) })
}

/// Sets attributes (MOUNT_ATTR_*) on a detached mount; with `idmap`, maps its ids through
/// that user namespace (the mount must not have been attached yet).
pub fn set_attrs(mount: &OwnedFd, attrs: u64, idmap: Option<&OwnedFd>) -> io::Result<()> {
    let attr = MountAttr {
        attr_set: attrs | if idmap.is_some() { MOUNT_ATTR_IDMAP } else { 0 },
        attr_clr: 0,
        propagation: 0,
        userns_fd: idmap.map(|fd| fd.as_raw_fd() as u64).unwrap_or(0),
    };
    let empty = c"";
    // SAFETY: `attr` is a properly laid out struct mount_attr whose size is passed; `empty`
    // is a static C string; both outlive the call.
    unit_result(unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            mount.as_raw_fd(),
            empty.as_ptr(),
            libc::AT_EMPTY_PATH as libc::c_uint | libc::AT_RECURSIVE as libc::c_uint,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    })
}

/// Attaches a detached mount at `target`.
pub fn attach(mount: &OwnedFd, target: &Path) -> io::Result<()> {
    let c = cpath(target)?;
    let empty = c"";
    // SAFETY: both strings are NUL-terminated and outlive the call.
    unit_result(unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            mount.as_raw_fd(),
            empty.as_ptr(),
            libc::AT_FDCWD,
            c.as_ptr(),
            MOVE_MOUNT_F_EMPTY_PATH,
        )
    })
}
