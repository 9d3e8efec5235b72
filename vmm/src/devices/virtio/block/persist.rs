//! virtio-blk's snapshot state: what the guest was told about the disk. The contents are not
//! saved; a restore reopens the configured image, which must look the same to the guest.

use serde::{Deserialize, Serialize};

use super::{Block, Disk};
use crate::devices::access_mode;
use crate::persist::Persist;

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockState {
    /// Bytes the guest could address.
    pub size: u64,
    pub read_only: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum BlockRestoreError {
    #[error("the disk has {found} bytes but the snapshot's guest saw {saved}; restore with the same image (or a copy of it)")]
    Size { saved: u64, found: u64 },
    #[error("the disk is {found} but the snapshot's guest saw it {saved}; keep the same ,ro flag")]
    ReadOnly {
        saved: &'static str,
        found: &'static str,
    },
}

impl Persist for Block {
    type State = BlockState;
    /// The reopened image.
    type Context = Disk;
    type Error = BlockRestoreError;

    fn save(&self) -> BlockState {
        BlockState {
            size: self.disk.size,
            read_only: self.disk.read_only,
        }
    }

    fn restore(disk: Disk, state: &BlockState) -> Result<Self, BlockRestoreError> {
        if disk.size != state.size {
            return Err(BlockRestoreError::Size {
                saved: state.size,
                found: disk.size,
            });
        }
        if disk.read_only != state.read_only {
            return Err(BlockRestoreError::ReadOnly {
                saved: access_mode(state.read_only),
                found: access_mode(disk.read_only),
            });
        }
        Ok(Block::new(disk))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_restored_disk_must_look_the_same_to_the_guest() {
        let dir = std::env::temp_dir().join(format!("dsec-blk-persist-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let image = |name: &str, len: u64| {
            let p = dir.join(name);
            std::fs::File::create(&p).unwrap().set_len(len).unwrap();
            p
        };
        let (a, b) = (image("a", 1 << 20), image("b", 2 << 20));
        let saved = Block::new(Disk::open(&a, true).unwrap()).save();
        assert_eq!(saved.size, 1 << 20);
        let back = Block::restore(Disk::open(&a, true).unwrap(), &saved).unwrap();
        assert_eq!(back.save(), saved);
        // Its shared lock would keep the writable reopen below out.
        drop(back);
        let err = Block::restore(Disk::open(&b, true).unwrap(), &saved)
            .err()
            .unwrap();
        assert!(err.to_string().contains("2097152 bytes"), "{err}");
        let err = Block::restore(Disk::open(&a, false).unwrap(), &saved)
            .err()
            .unwrap();
        assert!(err.to_string().contains("read-only"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
