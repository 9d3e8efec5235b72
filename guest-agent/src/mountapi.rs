//! The new mount API (open_tree, mount_setattr, move_mount, fsopen, fsconfig, fsmount), which
//! nix does not wrap: idmapped mounts and mounts built in one namespace and attached in
//! another need it.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

const OPEN_TREE_CLONE: libc::c_uint = 1;
const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x4;
const FSOPEN_CLOEXEC: libc::c_uint = 1;
const FSCONFIG_SET_FLAG: libc::c_uint = 0;
const FSCONFIG_SET_STRING: libc::c_uint = 1;
const FSCONFIG_CMD_CREATE: libc::c_uint = 6;
const FSMOUNT_CLOEXEC: libc::c_uint = 1;

pub const MOUNT_ATTR_RDONLY: u64 = 0x1;
pub const MOUNT_ATTR_NOSUID: u64 = 0x2;
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

/// A filesystem context being configured (fsopen .. fsmount).
pub struct FsContext(OwnedFd);

impl FsContext {
    pub fn open(fstype: &str) -> io::Result<Self> {
        let c = CString::new(fstype)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in fs type"))?;
        // SAFETY: `c` is NUL-terminated and outlives the call.
        fd_result(unsafe { libc::syscall(libc::SYS_fsopen, c.as_ptr(), FSOPEN_CLOEXEC) }).map(Self)
    }

    fn config(&self, cmd: libc::c_uint, key: Option<&str>, value: Option<&str>) -> io::Result<()> {
        let key = key
            .map(CString::new)
            .transpose()
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in option"))?;
        let value = value
            .map(CString::new)
            .transpose()
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in option"))?;
        // SAFETY: key and value are NUL-terminated strings (or NULL) that outlive the call.
        unit_result(unsafe {
            libc::syscall(
                libc::SYS_fsconfig,
                self.0.as_raw_fd(),
                cmd,
                key.as_ref().map_or(std::ptr::null(), |k| k.as_ptr()),
                value.as_ref().map_or(std::ptr::null(), |v| v.as_ptr()),
                0,
            )
        })
    }

    pub fn set_string(&self, key: &str, value: &str) -> io::Result<()> {
        self.config(FSCONFIG_SET_STRING, Some(key), Some(value))
    }

    pub fn set_flag(&self, key: &str) -> io::Result<()> {
        self.config(FSCONFIG_SET_FLAG, Some(key), None)
    }

    /// Creates the superblock and returns a detached mount of it.
    pub fn mount(self) -> io::Result<OwnedFd> {
        self.config(FSCONFIG_CMD_CREATE, None, None)?;
        // SAFETY: fsmount takes the context fd and flags; no memory is passed.
        fd_result(unsafe {
            libc::syscall(libc::SYS_fsmount, self.0.as_raw_fd(), FSMOUNT_CLOEXEC, 0)
        })
    }
}
