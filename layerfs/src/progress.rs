//! Progress of an import, for callers that draw it (the `dsec image` progress bars).
//!
//! The hooks fire once per stored chunk and once per read of the source stream (64-256 KiB
//! at a time), never per byte, so an implementation that bumps an atomic or a progress bar
//! costs nothing measurable next to hashing and compressing the same bytes.

/// Receives progress events of an import or pull. Every method has an empty default.
pub trait Progress {
    /// Layer `index` (0-based) of `count` starts; `source_bytes` is the size of its stream
    /// when known up front (a tar file, a registry blob).
    fn layer_started(&self, index: usize, count: usize, source_bytes: Option<u64>) {
        let _ = (index, count, source_bytes);
    }

    /// The layer started last is done; `reused` when the store already had it and nothing
    /// was read.
    fn layer_finished(&self, reused: bool) {
        let _ = reused;
    }

    /// `bytes` more of the source stream (as given: compressed for a compressed tar) were
    /// read.
    fn source_read(&self, bytes: u64) {
        let _ = bytes;
    }

    /// A chunk of `len` bytes of file content was stored; `new` when the store did not have
    /// it before.
    fn chunk_stored(&self, len: u64, new: bool) {
        let _ = (len, new);
    }
}

/// Ignores every event: what the calls without a progress argument use.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoProgress;

impl Progress for NoProgress {}
