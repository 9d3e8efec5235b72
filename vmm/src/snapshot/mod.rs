//! Snapshots: the file format (`format`: header, version, checksum, atomic directory) apart
//! from what is in them (`state`: the typed aggregate). Pausing, saving and restoring a VM
//! is `vm::snapshot` and `vm::restore`.

pub mod blob;
pub mod format;
pub mod state;

pub use format::{
    decode, encode, read_state, PendingSnapshot, SnapshotError, FORMAT_VERSION, MAGIC, MEMORY_FILE,
    STATE_FILE,
};
pub use state::{DevicesState, MemoryState, VmState};

/// Where a diff snapshot's recorded `parent` is: relative to the child's directory when
/// relative (a snapshot over a memory base carries that base inside it), else as written.
pub fn parent_dir(child: &std::path::Path, parent: &std::path::Path) -> std::path::PathBuf {
    child.join(parent)
}

/// The longest diff chain a restore follows (a chain that loops is refused by this bound).
pub const MAX_CHAIN: usize = 64;

/// A recorded parent that must stay inside its child's directory.
#[derive(Debug, thiserror::Error)]
#[error("diff snapshot parent {0} is not inside the snapshot's directory (a relative path without `..`), which this restore requires (--contained-chain): the snapshot names another snapshot's memory")]
pub struct ParentOutside(pub std::path::PathBuf);

/// Checks that `parent`, as recorded, names a directory inside its child's.
pub fn check_contained(parent: &std::path::Path) -> Result<(), ParentOutside> {
    use std::path::Component;
    let inside = parent.components().next().is_some()
        && parent
            .components()
            .all(|c| matches!(c, Component::Normal(_)));
    if inside {
        Ok(())
    } else {
        Err(ParentOutside(parent.to_owned()))
    }
}
