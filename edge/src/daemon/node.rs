//! The node: the sandboxes it supervises and the operations on one (get, delete, pause,
//! ports, timeouts). Create, fork, admission, adoption, reaping and create idempotency have
//! their own files beside this one.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::admission::Budgets;
use super::cgroup::{self, Cgroups};
use super::error::NodeError;
use super::metrics::Metrics;
use super::record::{
    append_event, describe_death, now_ms, random_hex, Entry, Record, Tombstone, MAX_TOMBSTONES,
    TOMBSTONE_KEEP,
};
use super::request_ids::RequestState;
use super::vmm_control;
use super::DaemonConfig;
use crate::backend::{BackendKind, EdgeConfig};
use crate::error::EdgeError;
use crate::images::servers::ImageMounts;
use crate::images::Catalog;
use crate::kvm::KvmStatus;

/// Most ports one sandbox may open to everyone.
pub const MAX_PUBLIC_PORTS: usize = 64;

pub struct Node {
    pub config: DaemonConfig,
    pub edge: EdgeConfig,
    pub(super) cgroups: Cgroups,
    sandboxes: Mutex<HashMap<String, Arc<Entry>>>,
    pub budgets: Mutex<Budgets>,
    pub metrics: Metrics,
    pub started_at_ms: i64,
    pub default_backend: BackendKind,
    pub microvm_unavailable: Option<String>,
    pub(super) next_cid: AtomicU64,
    /// Where images are looked up (directory images, then the layer store).
    pub catalog: Catalog,
    /// Shared FUSE mounts of layer-store images.
    pub images: ImageMounts,
    /// Create request_ids: in flight, or the sandbox they made.
    pub(super) requests: Mutex<HashMap<String, RequestState>>,
    /// Sandboxes that died, oldest first.
    tombstones: Mutex<std::collections::VecDeque<Arc<Tombstone>>>,
    /// microVM template snapshots per image and shape.
    pub(super) templates: super::templates::Templates,
}

impl Node {
    pub fn sandboxes_dir(config: &DaemonConfig) -> PathBuf {
        config.state_dir.join("sandboxes")
    }

    /// The prewarmed VMMs' directories (beside the sandboxes': a taken one is renamed there).
    pub fn vmm_pool_dir(config: &DaemonConfig) -> PathBuf {
        config.state_dir.join("vmm-pool")
    }

    /// Builds the node and re-adopts the sandboxes a previous daemon left running; everything
    /// else it left (half-created sandboxes, processes, cgroups, directories) is removed.
    pub async fn start(config: DaemonConfig) -> Result<Arc<Self>, EdgeError> {
        let sandboxes_dir = Self::sandboxes_dir(&config);
        std::fs::create_dir_all(&sandboxes_dir)
            .map_err(|e| EdgeError::io(format!("create {}", sandboxes_dir.display()), e))?;
        let edge = EdgeConfig {
            state_dir: sandboxes_dir.clone(),
            artifacts: config.artifacts.clone(),
            agent_bin: config.agent_bin.clone(),
            vmm_bin: config.vmm_bin.clone(),
            jail: config.jail_vmms.then(|| crate::backend::VmmJail {
                uid: crate::backend::JAIL_UID,
                gid: crate::backend::JAIL_GID,
                snapshots: config.state_dir.join("snapshots"),
                roots: config.state_dir.join("jails"),
            }),
            network: match &config.network {
                Some(net) => {
                    let net = net.clone();
                    Some(
                        tokio::task::spawn_blocking(move || crate::net::Network::start(&net))
                            .await
                            .map_err(|e| {
                                EdgeError::Protocol(format!("network setup task failed: {e}"))
                            })??,
                    )
                    .inspect(|net| net.serve_dns())
                }
                None => None,
            },
            vmm_pool: None,
        };
        // Pooled VMMs a crashed daemon left are swept by adoption before any is started.
        let mut edge = edge;
        edge.vmm_pool = crate::backend::vmm_pool::VmmPool::new(
            config.vmm_pool,
            &Self::vmm_pool_dir(&config),
            &sandboxes_dir,
            edge.jail.as_ref(),
            edge.vmm_bin.as_deref(),
        );
        let kvm = KvmStatus::detect();
        let microvm_unavailable = kvm.why_not_microvm();
        let default_backend = config
            .default_backend
            .unwrap_or(if microvm_unavailable.is_none() {
                BackendKind::MicroVm
            } else {
                BackendKind::Container
            });
        let budgets = Budgets::for_node(&config, &sandboxes_dir);
        let node = Arc::new(Self {
            cgroups: Cgroups::detect(&config.cgroup_name),
            edge,
            sandboxes: Mutex::new(HashMap::new()),
            budgets: Mutex::new(budgets),
            metrics: Metrics::default(),
            started_at_ms: now_ms(),
            default_backend,
            microvm_unavailable,
            next_cid: AtomicU64::new(3 + (now_ms() as u64 % 1_000_000) * 16),
            catalog: Catalog::new(&config.artifacts.home),
            images: ImageMounts::new(&config.state_dir, &config.invocation),
            requests: Mutex::new(HashMap::new()),
            tombstones: Mutex::new(std::collections::VecDeque::new()),
            templates: super::templates::Templates::new(&config.state_dir),
            config,
        });
        node.adopt().await;
        Ok(node)
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Entry>>> {
        self.sandboxes.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn list(&self) -> Vec<Arc<Entry>> {
        let mut all: Vec<_> = self.lock().values().cloned().collect();
        all.sort_by_key(|e| e.record().created_at_ms);
        all
    }

    pub fn count(&self) -> usize {
        self.lock().len()
    }

    /// The sandbox, or why there is none.
    pub fn get(&self, id: &str) -> Result<Arc<Entry>, NodeError> {
        if id.is_empty() {
            return Err(NodeError::InvalidArgument(
                "sandbox_id is empty: give the id Create returned (see List)".into(),
            ));
        }
        if id.len() > super::limits::MAX_SANDBOX_ID {
            return Err(NodeError::InvalidArgument(format!(
                "sandbox_id is {} bytes, at most {} are allowed: give the id Create returned (like sb-0123456789ab)",
                id.len(),
                super::limits::MAX_SANDBOX_ID
            )));
        }
        if let Some(entry) = self.lock().get(id).cloned() {
            return Ok(entry);
        }
        if let Some(t) = self.tombstone(id) {
            return Err(dead(id, t.reason.clone()));
        }
        Err(NodeError::NoSuchSandbox {
            id: id.to_string(),
            why: "never created, deleted, or expired",
        })
    }

    /// The tombstone of a sandbox that died (within the last 10 minutes).
    pub fn tombstone(&self, id: &str) -> Option<Arc<Tombstone>> {
        self.tombstones
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .rev()
            .find(|t| t.record.handle.id == id)
            .cloned()
    }

    /// Forgets a tombstone (Delete of a dead sandbox); whether there was one.
    pub fn remove_tombstone(&self, id: &str) -> bool {
        let mut all = self.tombstones.lock().unwrap_or_else(|e| e.into_inner());
        let before = all.len();
        all.retain(|t| t.record.handle.id != id);
        all.len() != before
    }

    pub(super) fn bury(&self, tombstone: Tombstone) {
        let mut all = self.tombstones.lock().unwrap_or_else(|e| e.into_inner());
        all.push_back(Arc::new(tombstone));
        let cutoff = now_ms() - TOMBSTONE_KEEP.as_millis() as i64;
        while all
            .front()
            .is_some_and(|t| all.len() > MAX_TOMBSTONES || t.died_at_ms < cutoff)
        {
            all.pop_front();
        }
    }

    /// Why the sandbox's agent / VMM is dead, or None while it runs.
    pub fn death_reason(&self, entry: &Entry) -> Option<String> {
        if let Some(reason) = entry.death.get() {
            return Some(reason.clone());
        }
        let record = entry.record();
        if record.is_alive() {
            return None;
        }
        Some(entry.death.get_or_init(|| describe_death(&record)).clone())
    }

    /// The sandbox if it can run commands now (not paused, not dead).
    pub fn running(&self, id: &str) -> Result<Arc<Entry>, NodeError> {
        let entry = self.get(id)?;
        if let Some(reason) = self.death_reason(&entry) {
            return Err(dead(id, reason));
        }
        if entry.record().paused {
            return Err(NodeError::Paused { id: id.to_string() });
        }
        entry.touch();
        Ok(entry)
    }

    pub(super) fn new_id(&self) -> String {
        match &self.config.node_name {
            // A cluster id names its node, so the apiserver routes by id alone.
            Some(name) => dsec_api::sandbox_id::SandboxId::new(name)
                .map(|id| id.to_string())
                .unwrap_or_else(|_| format!("sb-{}", random_hex(6))),
            None => format!("sb-{}", random_hex(6)),
        }
    }

    /// Removes the sandbox from the node and frees everything it held.
    pub async fn delete(&self, id: &str, reason: &str) -> Result<(), NodeError> {
        let entry = self
            .lock()
            .remove(id)
            .ok_or_else(|| NodeError::NoSuchSandbox {
                id: id.to_string(),
                why: "already deleted?",
            })?;
        let record = entry.record();
        append_event(&record.handle.dir, &format!("deleting ({reason})"));
        let r = record.clone();
        let result = tokio::task::spawn_blocking(move || {
            if r.paused && r.handle.backend == BackendKind::Container.as_str() {
                // Frozen tasks cannot die: thaw first.
                let _ = cgroup::set_frozen(&r.cgroups, false);
            }
            if let Some(snapshot) = &r.suspended {
                let _ = std::fs::remove_dir_all(snapshot);
            }
            let torn = r.handle.teardown();
            cgroup::remove(&r.cgroups);
            torn
        })
        .await
        .map_err(|e| NodeError::Internal(format!("teardown task failed: {e}")))?;
        if let Some(instance) = &record.image_mount {
            self.images.release(instance).await;
        }
        self.release(record.demand());
        self.metrics.deletes_total.fetch_add(1, Ordering::Relaxed);
        self.forget_request(&record.request_id, id);
        tracing::info!(sandbox = %id, reason, "deleted");
        result.map_err(|e| NodeError::Internal(format!("sandbox {id} teardown: {e}")))
    }

    pub async fn set_paused(&self, id: &str, paused: bool) -> Result<Arc<Entry>, NodeError> {
        let entry = self.get(id)?;
        let record = entry.record();
        if record.paused == paused {
            return Ok(entry);
        }
        if record.handle.backend == BackendKind::Container.as_str() {
            let cgroups = record.cgroups.clone();
            tokio::task::spawn_blocking(move || cgroup::set_frozen(&cgroups, paused))
                .await
                .map_err(|e| NodeError::Internal(format!("freezer task failed: {e}")))?
                .map_err(|e| {
                    NodeError::FailedPrecondition(format!("cannot pause/resume sandbox {id}: {e}"))
                })?;
        } else if paused {
            // The VMM is ended; its snapshot on disk is the sandbox until resume.
            self.suspend(&entry).await?;
        } else if let Some(snapshot) = record.suspended.clone() {
            let woken = self.wake(&entry, snapshot).await?;
            woken.touch();
            woken.event("resumed");
            return Ok(woken);
        } else {
            // Paused by an older daemon, which kept the VMM.
            vmm_control::resume(&record).await?;
        }
        {
            let mut r = entry.record.lock().unwrap_or_else(|e| e.into_inner());
            r.paused = paused;
            let _ = r.persist();
        }
        entry.touch();
        entry.event(if paused { "paused" } else { "resumed" });
        Ok(entry)
    }

    /// Opens `port` to everyone or makes it private again; returns the public ports.
    pub fn set_port_public(
        &self,
        id: &str,
        port: u16,
        public: bool,
    ) -> Result<Vec<u32>, NodeError> {
        let entry = self.get(id)?;
        let mut r = entry.record.lock().unwrap_or_else(|e| e.into_inner());
        if public && !r.public_ports.contains(&port) && r.public_ports.len() >= MAX_PUBLIC_PORTS {
            return Err(NodeError::InvalidArgument(format!(
                "sandbox {id} already has {MAX_PUBLIC_PORTS} public ports, the most allowed: make one private first"
            )));
        }
        let changed = if public {
            r.public_ports.insert(port)
        } else {
            r.public_ports.remove(&port)
        };
        if changed {
            r.persist()
                .map_err(|e| NodeError::Internal(e.to_string()))?;
            append_event(
                &r.handle.dir,
                &format!(
                    "port {port} made {}",
                    if public { "public" } else { "private" }
                ),
            );
        }
        Ok(r.public_ports.iter().map(|p| u32::from(*p)).collect())
    }

    pub fn set_timeout(
        &self,
        id: &str,
        ttl_s: i64,
        idle_s: Option<i64>,
    ) -> Result<Arc<Entry>, NodeError> {
        let entry = self.get(id)?;
        {
            let mut r = entry.record.lock().unwrap_or_else(|e| e.into_inner());
            r.expires_at_ms = if ttl_s > 0 {
                now_ms() + ttl_s * 1000
            } else {
                0
            };
            if let Some(idle) = idle_s {
                r.idle_timeout_s = idle;
            }
            r.persist()
                .map_err(|e| NodeError::Internal(e.to_string()))?;
        }
        entry.touch();
        Ok(entry)
    }

    pub fn usage(&self, record: &Record) -> (u64, u64, u64) {
        cgroup::usage(&record.cgroups)
    }
}

/// What calls to a dead sandbox get.
pub fn dead(id: &str, reason: String) -> NodeError {
    NodeError::Dead {
        id: id.to_string(),
        reason,
        minutes: TOMBSTONE_KEEP.as_secs() / 60,
    }
}
