//! Restore of a named snapshot as a new sandbox (`Create.from_snapshot`): a Snapshot call
//! writes `sandbox.json` (the source's image and shape) next to the VMM's state; a Create
//! naming that directory takes its image and shape from it and restores the VM with its own
//! id, vsock socket, CID, fresh entropy and the host's clock. The snapshot stays.

use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::Ordering;

use serde::{Deserialize, Serialize};

use super::error::NodeError;
use super::node::Node;
use super::record::Record;
use crate::backend::microvm::MemoryRestore;
use crate::backend::{restore_microvm, Sandbox, SandboxSpec};

/// The file a Snapshot call leaves next to the VMM's state.
const ORIGIN_FILE: &str = "sandbox.json";
/// A sandbox.json is a few hundred bytes; anything larger is not ours.
const MAX_ORIGIN_BYTES: u64 = 64 * 1024;

/// What a restore of a snapshot takes from the sandbox it was taken of.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotOrigin {
    pub sandbox_id: String,
    pub image: String,
    pub vcpus: i32,
    pub memory_mib: i64,
    pub disk_mib: i64,
    pub pids_limit: i64,
    /// The source ran on a disk image: its upper disk is not in the snapshot.
    pub on_disk: bool,
    /// A diff snapshot: only the pages changed since the one before, not restorable alone.
    #[serde(default)]
    pub diff: bool,
    /// The source's network policy as written: a restore whose Create gives none gets it.
    #[serde(default)]
    pub allow_internet: bool,
    #[serde(default)]
    pub allow: Vec<String>,
    #[serde(default)]
    pub deny: Vec<String>,
}

impl SnapshotOrigin {
    pub(super) fn of(record: &Record, on_disk: bool) -> Self {
        SnapshotOrigin {
            sandbox_id: record.handle.id.clone(),
            image: record.image.clone(),
            vcpus: record.vcpus,
            memory_mib: record.memory_mib,
            disk_mib: record.disk_mib,
            pids_limit: record.pids_limit,
            on_disk,
            diff: false,
            allow_internet: record.allow_internet,
            allow: record.allow.clone(),
            deny: record.deny.clone(),
        }
    }

    /// Writes it into the snapshot directory `dir` (as the daemon's user: a restore trusts
    /// no other owner's file there, since a jailed VMM can write that directory).
    pub(super) fn write(&self, dir: &Path) -> Result<(), NodeError> {
        let path = dir.join(ORIGIN_FILE);
        let body = serde_json::to_vec_pretty(self)
            .map_err(|e| NodeError::Internal(format!("encode {}: {e}", path.display())))?;
        std::fs::write(&path, body)
            .map_err(|e| NodeError::Internal(format!("write {}: {e}", path.display())))
    }

    /// Reads the origin of the snapshot directory a client named; the path must be absolute,
    /// without `..`, and hold a `sandbox.json` this daemon's user wrote.
    pub fn read(requested: &str) -> Result<(PathBuf, Self), NodeError> {
        let not_one = |why: String| {
            NodeError::InvalidArgument(format!(
                "from_snapshot {requested:?} {why}: give the path a Snapshot call on this node \
                 returned (`dsec snapshot ID`)"
            ))
        };
        let dir = PathBuf::from(requested);
        if !dir.is_absolute() || dir.components().any(|c| c == Component::ParentDir) {
            return Err(not_one("is not an absolute path without '..'".into()));
        }
        let path = dir.join(ORIGIN_FILE);
        let meta = std::fs::symlink_metadata(&path)
            .map_err(|e| not_one(format!("has no readable {ORIGIN_FILE} ({e})")))?;
        if !meta.is_file() || meta.uid() != nix::unistd::geteuid().as_raw() {
            return Err(not_one(format!(
                "holds a {ORIGIN_FILE} that this node did not write"
            )));
        }
        if meta.len() > MAX_ORIGIN_BYTES {
            return Err(not_one(format!("holds an oversized {ORIGIN_FILE}")));
        }
        let body = std::fs::read(&path).map_err(|e| not_one(format!("cannot be read ({e})")))?;
        let origin: SnapshotOrigin = serde_json::from_slice(&body)
            .map_err(|e| not_one(format!("holds a {ORIGIN_FILE} that does not parse ({e})")))?;
        if !dir.join("state").is_file() {
            return Err(not_one("has no VMM state (an incomplete snapshot)".into()));
        }
        if origin.diff {
            return Err(NodeError::FailedPrecondition(format!(
                "snapshot {requested} is a diff snapshot (only the pages changed since the one \
                 before): restore a full snapshot (`dsec snapshot ID` without --diff)"
            )));
        }
        if origin.on_disk {
            return Err(NodeError::FailedPrecondition(format!(
                "snapshot {requested} is of sandbox {} on disk image {:?}, whose upper disk is \
                 not part of the snapshot: restoring disk-image snapshots is not supported yet \
                 (fork the running sandbox instead)",
                origin.sandbox_id, origin.image
            )));
        }
        Ok((dir, origin))
    }

    /// Fills an unset field of a Create with the snapshot's value; a set one must match.
    pub fn pick<T: PartialEq + Default + std::fmt::Debug + Copy>(
        &self,
        field: &str,
        requested: T,
        snapshot: T,
    ) -> Result<T, NodeError> {
        if requested == T::default() || requested == snapshot {
            Ok(snapshot)
        } else {
            Err(NodeError::InvalidArgument(format!(
                "{field} {requested:?} differs from the snapshot's {snapshot:?} (sandbox {}): a \
                 restore keeps the snapshot's shape; leave {field} unset",
                self.sandbox_id
            )))
        }
    }
}

impl Node {
    /// Sandbox `spec` restored from the snapshot directory `snapshot` (checked by
    /// [`SnapshotOrigin::read`]) with its own vsock CID; refreshed before it is returned.
    pub(super) async fn restore_snapshot(
        &self,
        spec: &SandboxSpec,
        snapshot: &Path,
    ) -> Result<Sandbox, NodeError> {
        let started = std::time::Instant::now();
        let id = spec.id.clone().unwrap_or_default();
        let cid = self.next_cid.fetch_add(1, Ordering::Relaxed);
        let sandbox = restore_microvm(
            &self.edge,
            snapshot,
            &id,
            cid,
            spec,
            None,
            MemoryRestore::Private,
        )
        .await?;
        tracing::info!(
            sandbox = %id,
            snapshot = %snapshot.display(),
            ms = started.elapsed().as_millis() as u64,
            "restored from a named snapshot"
        );
        Ok(sandbox)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn origin() -> SnapshotOrigin {
        SnapshotOrigin {
            sandbox_id: "sb-1".into(),
            image: "busybox".into(),
            vcpus: 1,
            memory_mib: 128,
            disk_mib: 1024,
            pids_limit: 512,
            on_disk: false,
            diff: false,
            allow_internet: false,
            allow: vec!["tcp:10.1.2.3:443".into()],
            deny: Vec::new(),
        }
    }

    #[test]
    fn a_snapshot_origin_round_trips_and_bad_paths_are_refused() {
        let dir = std::env::temp_dir().join(format!("dsec-restore-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let text = dir.display().to_string();
        let err = SnapshotOrigin::read(&text).unwrap_err();
        assert!(err.to_string().contains("sandbox.json"), "{err}");
        origin().write(&dir).unwrap();
        let err = SnapshotOrigin::read(&text).unwrap_err();
        assert!(err.to_string().contains("no VMM state"), "{err}");
        std::fs::write(dir.join("state"), b"{}").unwrap();
        let (path, read) = SnapshotOrigin::read(&text).unwrap();
        assert_eq!((path, read), (dir.clone(), origin()));
        for bad in ["relative/snap", "/tmp/../etc", ""] {
            let err = SnapshotOrigin::read(bad).unwrap_err();
            assert!(matches!(err, NodeError::InvalidArgument(_)), "{bad}: {err}");
        }
        SnapshotOrigin {
            on_disk: true,
            ..origin()
        }
        .write(&dir)
        .unwrap();
        let err = SnapshotOrigin::read(&text).unwrap_err();
        assert!(matches!(err, NodeError::FailedPrecondition(_)), "{err}");
        std::fs::write(dir.join(ORIGIN_FILE), b"not json").unwrap();
        assert!(SnapshotOrigin::read(&text).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_restore_keeps_the_snapshots_shape() {
        let o = origin();
        assert_eq!(o.pick("memory_mib", 0i64, 128).unwrap(), 128);
        assert_eq!(o.pick("memory_mib", 128i64, 128).unwrap(), 128);
        let err = o.pick("memory_mib", 256i64, 128).unwrap_err();
        assert!(err.to_string().contains("leave memory_mib unset"), "{err}");
    }
}
