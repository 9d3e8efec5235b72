//! The snapshot file format: one versioned, checksummed state file plus a memory file per
//! directory, written under a temporary name and renamed so a crash never leaves a snapshot
//! that loads.
//!
//! `state` = magic `DSECSNAP` | format version (u32 LE) | payload length (u64 LE) |
//! CRC-32 of the payload (u32 LE) | payload (JSON, self-describing).
//!
//! Versions: 1 kept vsock's transport apart and other devices' states untyped; 2 (this one)
//! holds every virtio slot as a typed `SlotState`.

use std::fs::{self, File};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::Serialize;

use super::state::VmState;

pub const MAGIC: &[u8; 8] = b"DSECSNAP";
pub const FORMAT_VERSION: u32 = 2;
pub const STATE_FILE: &str = dsec_vmm_api::SNAPSHOT_STATE_FILE;
pub const MEMORY_FILE: &str = dsec_vmm_api::SNAPSHOT_MEMORY_FILE;
const HEADER_LEN: usize = 8 + 4 + 8 + 4;
/// Far above any real state file; a corrupt length must not make us allocate gigabytes.
const MAX_PAYLOAD: u64 = 64 << 20;

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("snapshot {0} already exists; choose a new directory")]
    Exists(PathBuf),
    #[error("cannot write snapshot {path}: {source} (is the disk full?); nothing was kept")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot read snapshot {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not a DSec snapshot (bad magic)")]
    NotASnapshot { path: PathBuf },
    #[error("{path} is snapshot format version {found}; this dsec-vmm reads version {FORMAT_VERSION} only: restore it with the dsec-vmm that wrote it, or take the snapshot again")]
    Version { path: PathBuf, found: u32 },
    #[error("{path} is corrupted: {detail}")]
    Corrupt { path: PathBuf, detail: String },
    #[error("cannot encode the VM state: {0}")]
    Encode(serde_json::Error),
    #[error(transparent)]
    Memory(#[from] crate::memory::MemoryError),
}

fn write_err(path: &Path) -> impl Fn(std::io::Error) -> SnapshotError + '_ {
    move |source| SnapshotError::Write {
        path: path.to_owned(),
        source,
    }
}

/// Encodes a state with its header.
pub fn encode<T: Serialize>(state: &T) -> Result<Vec<u8>, SnapshotError> {
    let payload = serde_json::to_vec(state).map_err(SnapshotError::Encode)?;
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
    out.extend_from_slice(&payload);
    Ok(out)
}

/// Decodes and verifies a state file's bytes.
pub fn decode<T: DeserializeOwned>(path: &Path, bytes: &[u8]) -> Result<T, SnapshotError> {
    let corrupt = |detail: String| SnapshotError::Corrupt {
        path: path.to_owned(),
        detail,
    };
    if bytes.len() < HEADER_LEN || &bytes[..8] != MAGIC {
        return Err(SnapshotError::NotASnapshot {
            path: path.to_owned(),
        });
    }
    let version = u32::from_le_bytes(bytes[8..12].try_into().unwrap_or_default());
    if version != FORMAT_VERSION {
        return Err(SnapshotError::Version {
            path: path.to_owned(),
            found: version,
        });
    }
    let len = u64::from_le_bytes(bytes[12..20].try_into().unwrap_or_default());
    let crc = u32::from_le_bytes(bytes[20..24].try_into().unwrap_or_default());
    let payload = &bytes[HEADER_LEN..];
    if len > MAX_PAYLOAD || payload.len() as u64 != len {
        return Err(corrupt(format!(
            "state is {} bytes, header says {len} (truncated?)",
            payload.len()
        )));
    }
    if crc32fast::hash(payload) != crc {
        return Err(corrupt("state checksum mismatch".into()));
    }
    serde_json::from_slice(payload).map_err(|e| corrupt(format!("state does not parse: {e}")))
}

/// Reads a snapshot's state file.
pub fn read_state(dir: &Path) -> Result<VmState, SnapshotError> {
    let path = dir.join(STATE_FILE);
    let mut bytes = Vec::new();
    File::open(&path)
        .and_then(|mut f| f.read_to_end(&mut bytes))
        .map_err(|source| SnapshotError::Read {
            path: path.clone(),
            source,
        })?;
    decode(&path, &bytes)
}

/// A snapshot directory being written: everything goes into `<dir>.tmp-<pid>` and is renamed
/// into place by [`PendingSnapshot::commit`]; dropping it uncommitted removes the partial files.
pub struct PendingSnapshot {
    pub tmp: PathBuf,
    pub dest: PathBuf,
    committed: bool,
}

impl PendingSnapshot {
    pub fn create(dest: &Path) -> Result<Self, SnapshotError> {
        if dest.exists() {
            return Err(SnapshotError::Exists(dest.to_owned()));
        }
        let mut name = dest.as_os_str().to_owned();
        name.push(format!(".tmp-{}", std::process::id()));
        let tmp = PathBuf::from(name);
        let _ = fs::remove_dir_all(&tmp);
        fs::create_dir_all(&tmp).map_err(write_err(&tmp))?;
        Ok(PendingSnapshot {
            tmp,
            dest: dest.to_owned(),
            committed: false,
        })
    }

    pub fn memory_file(&self) -> Result<File, SnapshotError> {
        let path = self.tmp.join(MEMORY_FILE);
        File::create(&path).map_err(write_err(&path))
    }

    /// Writes the state, fsyncs everything and renames the directory into place.
    pub fn commit(mut self, state: &VmState) -> Result<(), SnapshotError> {
        let bytes = encode(state)?;
        let state_path = self.tmp.join(STATE_FILE);
        let mut f = File::create(&state_path).map_err(write_err(&state_path))?;
        f.write_all(&bytes).map_err(write_err(&state_path))?;
        f.sync_all().map_err(write_err(&state_path))?;
        let mem_path = self.tmp.join(MEMORY_FILE);
        File::open(&mem_path)
            .and_then(|m| m.sync_all())
            .map_err(write_err(&mem_path))?;
        File::open(&self.tmp)
            .and_then(|d| d.sync_all())
            .map_err(write_err(&self.tmp))?;
        fs::rename(&self.tmp, &self.dest).map_err(write_err(&self.dest))?;
        if let Some(parent) = self.dest.parent() {
            let _ = File::open(parent).and_then(|d| d.sync_all());
        }
        self.committed = true;
        Ok(())
    }
}

impl Drop for PendingSnapshot {
    fn drop(&mut self) {
        if !self.committed {
            let _ = fs::remove_dir_all(&self.tmp);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use serde::Deserialize;

    #[derive(Serialize, Deserialize, PartialEq, Debug)]
    struct Toy {
        a: u64,
        b: String,
    }

    fn toy() -> Toy {
        Toy {
            a: 42,
            b: "x".into(),
        }
    }

    #[test]
    fn round_trip() {
        let bytes = encode(&toy()).unwrap();
        let back: Toy = decode(Path::new("s"), &bytes).unwrap();
        assert_eq!(back, toy());
    }

    #[test]
    fn truncated_corrupted_and_foreign_are_refused() {
        let bytes = encode(&toy()).unwrap();
        let p = Path::new("s");
        let err = decode::<Toy>(p, &bytes[..bytes.len() - 3]).unwrap_err();
        assert!(err.to_string().contains("truncated"), "{err}");
        let mut flipped = bytes.clone();
        let last = flipped.len() - 2;
        flipped[last] ^= 0x20;
        let err = decode::<Toy>(p, &flipped).unwrap_err();
        assert!(err.to_string().contains("checksum"), "{err}");
        let mut foreign = bytes.clone();
        foreign[8..12].copy_from_slice(&99u32.to_le_bytes());
        let err = decode::<Toy>(p, &foreign).unwrap_err();
        assert!(err.to_string().contains("version 99"), "{err}");
        let err = decode::<Toy>(p, b"not a snapshot at all....").unwrap_err();
        assert!(err.to_string().contains("not a DSec snapshot"), "{err}");
        let mut huge = bytes;
        huge[12..20].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(decode::<Toy>(p, &huge).is_err());
    }

    #[test]
    fn uncommitted_snapshot_leaves_nothing() {
        let dest = std::env::temp_dir().join(format!("dsec-snap-test-{}", std::process::id()));
        {
            let pending = PendingSnapshot::create(&dest).unwrap();
            pending.memory_file().unwrap();
            assert!(pending.tmp.exists());
        }
        assert!(!dest.exists());
        let mut tmp = dest.as_os_str().to_owned();
        tmp.push(format!(".tmp-{}", std::process::id()));
        assert!(!PathBuf::from(tmp).exists());
    }
}
