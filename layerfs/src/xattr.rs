//! Thin libc wrappers for extended attributes on paths (never following symlinks).

use std::ffi::{CString, OsStr};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

fn cpath(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

/// Names of all xattrs of `p` (the link itself for symlinks).
pub fn list(p: &Path) -> io::Result<Vec<Vec<u8>>> {
    let c = cpath(p)?;
    loop {
        // SAFETY: a null buffer with size 0 asks only for the needed size.
        let n = unsafe { libc::llistxattr(c.as_ptr(), std::ptr::null_mut(), 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENOTSUP) {
                return Ok(Vec::new());
            }
            return Err(e);
        }
        if n == 0 {
            return Ok(Vec::new());
        }
        let mut buf = vec![0u8; n as usize];
        // SAFETY: buf is valid for writes of buf.len() bytes.
        let m = unsafe { libc::llistxattr(c.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        if m < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ERANGE) {
                continue; // grew between the calls
            }
            return Err(e);
        }
        buf.truncate(m as usize);
        return Ok(buf
            .split(|b| *b == 0)
            .filter(|s| !s.is_empty())
            .map(|s| s.to_vec())
            .collect());
    }
}

pub fn get(p: &Path, name: &[u8]) -> io::Result<Option<Vec<u8>>> {
    let c = cpath(p)?;
    let n = CString::new(name).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    loop {
        // SAFETY: null buffer, size 0: size query only.
        let len = unsafe { libc::lgetxattr(c.as_ptr(), n.as_ptr(), std::ptr::null_mut(), 0) };
        if len < 0 {
            let e = io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::ENODATA) | Some(libc::ENOTSUP) => Ok(None),
                _ => Err(e),
            };
        }
        let mut buf = vec![0u8; len as usize];
        // SAFETY: buf is valid for writes of buf.len() bytes.
        let m =
            unsafe { libc::lgetxattr(c.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        if m < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ERANGE) {
                continue;
            }
            return Err(e);
        }
        buf.truncate(m as usize);
        return Ok(Some(buf));
    }
}

pub fn set(p: &Path, name: &OsStr, value: &[u8]) -> io::Result<()> {
    let c = cpath(p)?;
    let n =
        CString::new(name.as_bytes()).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: pointers are valid C strings / a valid buffer of value.len() bytes.
    let r = unsafe {
        libc::lsetxattr(
            c.as_ptr(),
            n.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
