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
