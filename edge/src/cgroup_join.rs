//! Putting a child into its sandbox's cgroups before it runs: the parent opens each
//! `cgroup.procs` file, the child writes "0" (itself) to each between fork and exec, so
//! nothing it starts ever runs outside them.

use std::os::fd::AsRawFd;
use std::path::PathBuf;

use crate::error::{EdgeError, Result};

/// The opened `cgroup.procs` files; keep it alive until the child has been started.
#[derive(Debug)]
pub struct CgroupJoin {
    files: Vec<std::fs::File>,
}

impl CgroupJoin {
    pub fn open(procs: &[PathBuf]) -> Result<Self> {
        let files = procs
            .iter()
            .map(|p| {
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(p)
                    .map_err(|e| EdgeError::io(format!("open {}", p.display()), e))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(CgroupJoin { files })
    }

    /// The descriptors, to copy into the child's code.
    pub fn fds(&self) -> Vec<i32> {
        self.files.iter().map(|f| f.as_raw_fd()).collect()
    }
}

/// In the child, after fork or clone and before exec: joins every cgroup. Only calls
/// write(2), so it is async-signal-safe and allocates nothing. False when a write failed
/// (errno says why).
pub fn join_in_child(fds: &[i32]) -> bool {
    fds.iter().all(|fd| {
        // SAFETY: writes one byte from a static string to a descriptor the parent opened;
        // a closed or wrong descriptor makes write fail, which is reported.
        unsafe { libc::write(*fd, b"0".as_ptr().cast(), 1) == 1 }
    })
}
