//! Snapshot and fork of microVM sandboxes: one snapshot of the parent, each child restored
//! from it with its own vsock socket and CID, its own copy of the upper disk (disk images)
//! and fresh entropy and clock before it is handed out.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::admission::Demand;
use super::create::{limits_for, CreatePlan, Plan};
use super::error::NodeError;
use super::node::Node;
use super::record::{new_access_token, now_ms, Entry, Record};
use super::restore::SnapshotOrigin;
use super::vmm_control;
use crate::backend::microvm::{copy_sparse, MemoryRestore, UpperDisk};
use crate::backend::{restore_microvm, BackendKind};

impl Node {
    /// `image` boots from a root disk (its sandboxes have a writable upper disk).
    fn on_disk_image(&self, image: &str) -> bool {
        self.config.artifacts.image(image).root_disk().is_some()
    }

    /// Snapshot of a microVM sandbox into `path` (default under the state dir).
    pub async fn snapshot(&self, id: &str, path: &str, diff: bool) -> Result<PathBuf, NodeError> {
        let entry = self.get(id)?;
        let record = entry.record();
        if record.handle.backend != BackendKind::MicroVm.as_str() {
            return Err(NodeError::Unsupported(
                "snapshots are implemented for microvm sandboxes only (container state is not captured yet)",
            ));
        }
        let default_dir = self.config.state_dir.join("snapshots");
        let path = snapshot_path(
            id,
            path,
            record.handle.snapshot_dir.as_deref(),
            &default_dir,
        )?;
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)
                .map_err(|e| NodeError::Internal(format!("create {}: {e}", parent.display())))?;
        }
        let written = vmm_control::snapshot(&record, path.clone(), diff).await?;
        // How long the guest stood still for it (a fork's parent pause window, VMM-side).
        let steps = &written.pause_steps;
        tracing::info!(
            sandbox = %id,
            paused_ms = written.paused_ms,
            complete_ms = written.complete_ms,
            pages = written.pages_written,
            diff,
            memory = ?written.memory_mode,
            final_pages = written.final_pages,
            precopy_rounds = ?written.precopy_rounds,
            step_pause_ms = steps.pause_ms,
            step_create_ms = steps.create_ms,
            step_state_ms = steps.state_ms,
            step_prepare_ms = steps.prepare_ms,
            step_dirty_log_ms = steps.dirty_log_ms,
            step_write_ms = steps.write_ms,
            step_fork_ms = steps.fork_ms,
            step_resume_ms = steps.resume_ms,
            "snapshot written"
        );
        // What a later restore of it (Create.from_snapshot) takes from this sandbox.
        let origin = SnapshotOrigin {
            diff,
            ..SnapshotOrigin::of(&record, self.on_disk_image(&record.image))
        };
        origin.write(&path)?;
        crate::net::mark_if_networked(&record.handle.dir, &path)?;
        entry.event(&format!(
            "snapshot written to {} ({} pages, guest paused {:.1} ms)",
            path.display(),
            written.pages_written,
            written.paused_ms
        ));
        Ok(path)
    }

    /// Forks a microVM sandbox: one snapshot, `count` children restored from it.
    pub async fn fork(
        self: &Arc<Self>,
        id: &str,
        count: usize,
        labels: BTreeMap<String, String>,
    ) -> Result<Vec<Arc<Entry>>, NodeError> {
        let parent = self.get(id)?.record();
        let mut merged = parent.labels.clone();
        merged.extend(labels.clone());
        if merged.len() > super::limits::MAX_LABELS {
            return Err(NodeError::InvalidArgument(format!(
                "the children would carry {} labels (the parent's and these), at most {} are allowed",
                merged.len(),
                super::limits::MAX_LABELS
            )));
        }
        if parent.handle.backend != BackendKind::MicroVm.as_str() {
            return Err(NodeError::Unsupported(
                "fork is implemented for microvm sandboxes only (from a VMM snapshot); for containers create a new sandbox",
            ));
        }
        let on_disk = self.on_disk_image(&parent.image);
        // On a disk image every child needs its own copy of the writable upper disk, taken
        // while the parent is paused so that it matches the snapshot's memory exactly.
        let was_paused = parent.paused;
        if on_disk && !was_paused {
            vmm_control::pause(&parent).await?;
        }
        let frozen = async {
            let snapshot = self.snapshot(id, "", false).await?;
            let mut uppers = Vec::new();
            if on_disk {
                let src = parent.handle.dir.join("upper.ext4");
                for i in 0..count {
                    let dst = parent
                        .handle
                        .dir
                        .join(format!("fork-{}-{i}.ext4", now_ms()));
                    let copied = {
                        let (src, dst) = (src.clone(), dst.clone());
                        tokio::task::spawn_blocking(move || copy_sparse(&src, &dst))
                            .await
                            .map_err(|e| NodeError::Internal(format!("copy task failed: {e}")))?
                    };
                    if let Err(e) = copied {
                        let _ = std::fs::remove_file(&dst);
                        uppers.iter().for_each(|u| drop(std::fs::remove_file(u)));
                        let _ = std::fs::remove_dir_all(&snapshot);
                        return Err(NodeError::Internal(format!(
                            "copy the upper disk {} for a fork child: {e}",
                            src.display()
                        )));
                    }
                    uppers.push(dst);
                }
            }
            Ok::<_, NodeError>((snapshot, uppers))
        }
        .await;
        if on_disk && !was_paused {
            vmm_control::resume(&parent).await?;
        }
        let (snapshot, uppers) = frozen?;
        let mut uppers = uppers.into_iter();
        let mut children = Vec::new();
        for _ in 0..count {
            let upper = uppers.next();
            let mut all_labels = parent.labels.clone();
            all_labels.extend(labels.clone());
            let request = Plan {
                kind: BackendKind::MicroVm,
                image: parent.image.clone(),
                demand: Demand {
                    memory_mib: parent.memory_mib,
                    ..parent.demand()
                },
                env: parent.env.clone(),
                labels: all_labels,
                ttl_s: 0,
                idle_timeout_s: parent.idle_timeout_s,
                allow_internet: parent.allow_internet,
                allow: parent.allow.clone(),
                deny: parent.deny.clone(),
                // The parent's policy, on a tap and address of the child's own.
                network: super::network::recorded_policy(self, &parent),
                request_id: String::new(),
                public_ports: parent.public_ports.clone(),
                cold: false,
                from_snapshot: None,
            };
            // The parent's image and memory cgroup limit, as it was created with.
            let plan = CreatePlan {
                image: self.microvm_image(&parent.image),
                limits: limits_for(&request, parent.demand().memory_mib),
                request,
            };
            let child_id = self.new_id();
            let pending = self.admit(&plan, &child_id)?;
            let spec = plan.spec(&child_id, &pending.cgroups, None, self.config.ready_timeout);
            let cid = self.next_cid.fetch_add(1, Ordering::Relaxed);
            // The child is refreshed (fresh entropy, the host's clock) before it is handed
            // out: restored from one snapshot, children would otherwise produce the same
            // "random" keys, UUIDs and nonces. One that cannot be refreshed is not handed out.
            let restored = restore_microvm(
                &self.edge,
                &snapshot,
                &child_id,
                cid,
                &spec,
                upper.as_deref().map(UpperDisk::Move),
                MemoryRestore::Private,
            )
            .await;
            let sandbox = match restored {
                Ok(s) => s,
                Err(err) => {
                    uppers.for_each(|u| drop(std::fs::remove_file(u)));
                    let _ = std::fs::remove_dir_all(&snapshot);
                    return Err(err.into());
                }
            };
            let client = sandbox.agent().clone();
            let env_in_guest = sandbox.env_in_guest();
            let now = now_ms();
            let record = Record {
                handle: sandbox.detach(),
                image: plan.request.image.clone(),
                vcpus: parent.vcpus,
                memory_mib: parent.memory_mib,
                disk_mib: parent.disk_mib,
                pids_limit: parent.pids_limit,
                env: plan.request.env.clone(),
                env_in_guest,
                labels: plan.request.labels.clone(),
                allow_internet: plan.request.allow_internet,
                allow: plan.request.allow.clone(),
                deny: plan.request.deny.clone(),
                created_at_ms: now,
                expires_at_ms: 0,
                idle_timeout_s: plan.request.idle_timeout_s,
                paused: false,
                parent_id: id.to_string(),
                cgroups: pending.cgroups.clone(),
                memory_limit_mib: plan.memory_limit_mib(),
                request_id: String::new(),
                request_fingerprint: String::new(),
                access_token: new_access_token(),
                public_ports: plan.request.public_ports.clone(),
                image_mount: None,
                suspended: None,
            };
            children.push(self.register(record, client, pending).await?);
        }
        let _ = std::fs::remove_dir_all(&snapshot);
        Ok(children)
    }
}

/// Where a snapshot of sandbox `id` goes: `requested`, or a new directory under the
/// sandbox's jail snapshot directory (jailed VMM) or `default_dir`. A jailed VMM sees no other
/// host path, so a requested path elsewhere is refused before the VMM is asked.
fn snapshot_path(
    id: &str,
    requested: &str,
    jail_dir: Option<&Path>,
    default_dir: &Path,
) -> Result<PathBuf, NodeError> {
    let stamp = now_ms();
    match (requested.is_empty(), jail_dir) {
        (true, Some(dir)) => Ok(dir.join(stamp.to_string())),
        (true, None) => Ok(default_dir.join(format!("{id}-{stamp}"))),
        (false, Some(dir)) => {
            let p = PathBuf::from(requested);
            let inside = p.is_absolute()
                && p.starts_with(dir)
                && p != dir
                && !p
                    .components()
                    .any(|c| matches!(c, std::path::Component::ParentDir));
            if inside {
                Ok(p)
            } else {
                Err(NodeError::InvalidArgument(format!(
                    "snapshot path {requested:?}: this sandbox's VMM runs in a jail and can write \
                     snapshots only under {}; leave the path empty or name a directory there \
                     (or start the node with --no-jail)",
                    dir.display()
                )))
            }
        }
        (false, None) => Ok(PathBuf::from(requested)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jailed_snapshots_stay_in_the_jail_snapshot_dir() {
        let jail = Path::new("/run/dsec/edge/snapshots/vm-1");
        let default = Path::new("/run/dsec/edge/snapshots");
        let p = snapshot_path("vm-1", "", Some(jail), default).unwrap();
        assert_eq!(p.parent(), Some(jail));
        let p = snapshot_path("vm-1", "", None, default).unwrap();
        assert_eq!(p.parent(), Some(default));
        assert!(p
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .starts_with("vm-1-"));
        assert_eq!(
            snapshot_path(
                "vm-1",
                "/run/dsec/edge/snapshots/vm-1/a",
                Some(jail),
                default
            )
            .unwrap(),
            Path::new("/run/dsec/edge/snapshots/vm-1/a")
        );
        assert_eq!(
            snapshot_path("vm-1", "/srv/snap", None, default).unwrap(),
            Path::new("/srv/snap")
        );
        for outside in [
            "/srv/snap",
            "/run/dsec/edge/snapshots/vm-1",
            "/run/dsec/edge/snapshots/vm-1/../vm-2/x",
            "/run/dsec/edge/snapshots/vm-10/x",
            "run/dsec/edge/snapshots/vm-1/x",
        ] {
            let err = snapshot_path("vm-1", outside, Some(jail), default).unwrap_err();
            assert!(matches!(err, NodeError::InvalidArgument(_)), "{outside}");
            assert!(err.to_string().contains("--no-jail"), "{err}");
        }
    }
}
