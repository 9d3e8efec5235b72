//! virtio-pmem's snapshot state: the identity of the mapped file and its guest window. The
//! guest may hold the file's contents (a read-only one in its caches, a writable one as the
//! data it wrote), so a restore must map the same, unmodified file at the same address.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::{Backing, Pmem, PmemError};
use crate::devices::access_mode;
use crate::persist::Persist;

/// What identifies the mapped file, checked again when a snapshot is restored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PmemState {
    pub path: PathBuf,
    pub guest_addr: u64,
    pub size: u64,
    pub read_only: bool,
    pub dev: u64,
    pub ino: u64,
    /// Modification time (ns) of a read-only file: the guest may have its contents cached.
    /// Not checked for writable files, which the guest itself modifies.
    pub mtime_ns: Option<i128>,
}

impl Backing {
    pub fn identity(&self) -> PmemState {
        PmemState {
            path: self.path.clone(),
            guest_addr: self.guest_addr,
            size: self.size,
            read_only: self.read_only,
            dev: self.dev,
            ino: self.ino,
            mtime_ns: self.read_only.then_some(self.mtime_ns),
        }
    }

    /// Checks that this is the file a snapshot mapped, unchanged.
    pub fn matches(&self, saved: &PmemState) -> Result<(), PmemError> {
        let changed = |detail: String| PmemError::Changed {
            path: self.path.clone(),
            detail,
        };
        if self.size != saved.size {
            return Err(changed(format!(
                "it is {} bytes, the snapshot mapped {}",
                self.size, saved.size
            )));
        }
        if (self.dev, self.ino) != (saved.dev, saved.ino) {
            return Err(changed(format!(
                "it is another file (device {} inode {}, the snapshot mapped device {} inode {})",
                self.dev, self.ino, saved.dev, saved.ino
            )));
        }
        if self.read_only != saved.read_only {
            return Err(changed(format!(
                "it is mapped {}, the snapshot mapped it {}",
                access_mode(self.read_only),
                access_mode(saved.read_only)
            )));
        }
        if let Some(mtime) = saved.mtime_ns {
            if mtime != self.mtime_ns {
                return Err(changed("it was modified".into()));
            }
        }
        if self.guest_addr != saved.guest_addr {
            return Err(changed(format!(
                "its window moved from {:#x} to {:#x} (did an earlier pmem file change size?)",
                saved.guest_addr, self.guest_addr
            )));
        }
        Ok(())
    }
}

impl Persist for Pmem {
    type State = PmemState;
    /// The reopened, mapped file.
    type Context = Backing;
    type Error = PmemError;

    fn save(&self) -> PmemState {
        self.backing.identity()
    }

    fn restore(backing: Backing, state: &PmemState) -> Result<Self, PmemError> {
        backing.matches(state)?;
        Ok(Pmem::new(backing))
    }
}
