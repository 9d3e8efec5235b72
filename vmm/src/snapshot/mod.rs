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
