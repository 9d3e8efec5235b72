//! One error type for the whole crate: every message says what went wrong and what to do.

use std::path::PathBuf;

use crate::digest::Digest;

/// Result alias used throughout layerfs.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{what} {path}: {source} (check that the path exists and is accessible)")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("chunk {digest} is corrupt in the store: {detail}; re-import the layer that owns it or restore the file from a replica")]
    CorruptChunk { digest: Digest, detail: String },
    #[error(
        "chunk {digest} is missing from the store at {path}; re-import the layer that owns it"
    )]
    MissingChunk { digest: Digest, path: PathBuf },
    #[error("layer {0} is not in the store; re-import the image that uses it (`dsec image ls` lists what is there)")]
    MissingLayer(Digest),
    #[error("layer index {id} is invalid: {detail}; the index file was damaged or written by an incompatible version, re-import the layer")]
    BadIndex { id: String, detail: String },
    #[error("layer input rejected at {path:?}: {detail}")]
    BadEntry { path: String, detail: String },
    #[error("OCI: {0}")]
    Oci(String),
    #[error("registry {url}: {detail}")]
    Registry { url: String, detail: String },
    #[error("image {0:?} not found in the store; `dsec image ls` lists the known images")]
    NoSuchImage(String),
    #[error("{0} is not a directory: give a directory (a plain tree, or a stopped sandbox's overlayfs upper dir)")]
    NotADirectory(PathBuf),
    #[error("no layer store at {path}: {detail}; check --store / DSEC_LAYERFS_STORE, or import an image first to create it")]
    NoStore { path: PathBuf, detail: String },
    #[error("layer store {path} is not writable: {source}; fix its permissions or mount, or choose another --store")]
    StoreNotWritable {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid digest {0:?}: expected 64 hex digits, optionally prefixed with sha256:")]
    BadDigest(String),
    #[error("layer tar {path}: {source}")]
    InTar {
        path: PathBuf,
        #[source]
        source: Box<Error>,
    },
    #[error("{0}")]
    Invalid(String),
}

impl Error {
    /// An I/O error on `path` while doing `what`.
    pub fn io(what: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            what,
            path: path.into(),
            source,
        }
    }

    pub(crate) fn entry(path: impl Into<String>, detail: impl Into<String>) -> Self {
        Error::BadEntry {
            path: path.into(),
            detail: detail.into(),
        }
    }

    /// errno to hand back to a FUSE caller for this error.
    pub fn errno(&self) -> i32 {
        match self {
            Error::Io { source, .. } => match source.raw_os_error() {
                Some(libc::ENOENT) | None => libc::EIO,
                Some(e) => e,
            },
            _ => libc::EIO,
        }
    }
}
