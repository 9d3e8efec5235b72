//! Create: a validated request ([`Plan`]) is resolved once into a [`CreatePlan`] (the
//! image's files, the cgroup limits admission reserves), admitted, built by the backend,
//! persisted and registered.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use super::admission::{memory_limit_mib, Demand};
use super::cgroup::{self, Limits};
use super::error::NodeError;
use super::node::Node;
use super::record::{append_event, new_access_token, now_ms, Entry, Record};
use crate::backend::{BackendKind, Sandbox, SandboxSpec};
use crate::client::AgentClient;
use crate::images::{Catalog, ImageSource};

/// A validated Create request.
#[derive(Clone, Debug)]
pub struct Plan {
    pub kind: BackendKind,
    pub image: String,
    /// What was asked (`demand.memory_mib` is the guest's / container's memory).
    pub demand: Demand,
    pub env: BTreeMap<String, String>,
    pub labels: BTreeMap<String, String>,
    pub ttl_s: i64,
    pub idle_timeout_s: i64,
    pub allow_internet: bool,
    pub allow: Vec<String>,
    pub deny: Vec<String>,
    /// The policy resolved from the three fields above (named policies expanded).
    pub network: crate::net::Policy,
    /// The client's idempotency key ("" = none).
    pub request_id: String,
    /// Ports open without the access token.
    pub public_ports: std::collections::BTreeSet<u16>,
    /// microVM: a real boot instead of a restore of the image's template snapshot.
    pub cold: bool,
    /// microVM: restore this snapshot directory (checked, written by Snapshot) instead.
    pub from_snapshot: Option<PathBuf>,
}

impl Plan {
    /// A stable digest of what the Create asked for (defaults filled in), to tell a retry
    /// from a different request that reuses a request_id.
    pub fn fingerprint(&self) -> String {
        let mut spec = serde_json::json!({
            "kind": self.kind.as_str(),
            "image": self.image,
            "memory_mib": self.demand.memory_mib,
            "vcpus": self.demand.vcpus,
            "pids": self.demand.pids,
            "disk_mib": self.demand.disk_mib,
            "env": self.env,
            "labels": self.labels,
            "ttl_s": self.ttl_s,
            "idle_timeout_s": self.idle_timeout_s,
            "public_ports": self.public_ports,
        });
        // Only when set, so that digests of records from before these fields still match.
        if let Some(snapshot) = &self.from_snapshot {
            spec["from_snapshot"] = serde_json::json!(snapshot);
        }
        if self.allow_internet || !self.allow.is_empty() || !self.deny.is_empty() {
            spec["network"] = serde_json::json!([self.allow_internet, self.allow, self.deny]);
        }
        fnv1a_hex(&spec.to_string())
    }
}

/// FNV-1a of `text` in hex: stable across builds (records and templates outlive the daemon
/// binary).
pub(super) fn fnv1a_hex(text: &str) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in text.bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{hash:016x}")
}

/// Where a sandbox's image files are, resolved once per create.
#[derive(Clone, Debug)]
pub enum ImagePlan {
    /// A container's root: a directory image or a layer-store image (mounted at create).
    Container(ImageSource),
    /// A microVM's initramfs, and its read-only root disk when the image has one.
    MicroVm {
        initrd: PathBuf,
        root_disk: Option<PathBuf>,
    },
}

/// A create resolved once, before anything is made: the request, its image's files and the
/// cgroup limits (whose memory limit is what admission reserves). Create and fork carry it
/// down to the backend.
#[derive(Clone, Debug)]
pub struct CreatePlan {
    pub request: Plan,
    pub image: ImagePlan,
    pub limits: Limits,
}

impl CreatePlan {
    /// The memory cgroup limit in MiB (memory plus what else is charged to the cgroup).
    pub fn memory_limit_mib(&self) -> i64 {
        (self.limits.memory_bytes >> 20) as i64
    }

    /// What admission reserves: the memory cgroup's limit, not only the asked memory.
    fn reserved(&self) -> Demand {
        Demand {
            memory_mib: self.memory_limit_mib(),
            ..self.request.demand
        }
    }

    /// The backend's spec for sandbox `id` in `cgroups`, its root at `rootfs` (containers).
    pub(super) fn spec(
        &self,
        id: &str,
        cgroups: &[PathBuf],
        rootfs: Option<PathBuf>,
        ready_timeout: std::time::Duration,
    ) -> SandboxSpec {
        let request = &self.request;
        let (initrd, root_disk) = match &self.image {
            ImagePlan::MicroVm { initrd, root_disk } => (Some(initrd.clone()), root_disk.clone()),
            ImagePlan::Container(_) => (None, None),
        };
        SandboxSpec {
            vcpus: request.demand.vcpus as u32,
            mem_mib: request.demand.memory_mib as u32,
            rootfs,
            initrd,
            ready_timeout,
            id: Some(id.to_string()),
            disk_mib: (request.kind == BackendKind::Container || root_disk.is_some())
                .then_some(request.demand.disk_mib as u32),
            root_disk,
            cgroup_procs: cgroup::procs_files(cgroups),
            network_policy: request.network.clone(),
            guest_env: (request.kind == BackendKind::MicroVm).then(|| request.env.clone()),
            ..SandboxSpec::default()
        }
    }
}

/// What a create or fork holds for a sandbox that is not registered yet: its reservation,
/// cgroups and image mount. Dropped before [`keep`](Self::keep), it gives them all back, so
/// every way a create can fail frees the same things.
pub(super) struct Pending {
    node: Arc<Node>,
    reserved: Demand,
    pub(super) cgroups: Vec<PathBuf>,
    pub(super) image_mount: Option<String>,
    armed: bool,
}

impl Pending {
    /// The sandbox is registered: what it holds is its record's now.
    fn keep(mut self) {
        self.armed = false;
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        self.node.release(self.reserved);
        cgroup::remove(&self.cgroups);
        if let Some(instance) = self.image_mount.take() {
            let node = self.node.clone();
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(async move { node.images.release(&instance).await });
            }
        }
    }
}

impl Node {
    fn image_initrd(&self, image: &str) -> PathBuf {
        self.config
            .artifacts
            .home
            .join("images")
            .join(image)
            .join("initramfs.cpio")
    }

    /// The files of a microVM of `image`: its initramfs and, on a disk image, its root disk.
    pub(super) fn microvm_image(&self, image: &str) -> ImagePlan {
        ImagePlan::MicroVm {
            initrd: self.image_initrd(image),
            root_disk: self.config.artifacts.image(image).root_disk(),
        }
    }

    /// Resolves the image for the backend: for containers a directory image
    /// (`$DSEC_HOME/images/NAME/rootfs`) wins over a layer-store image of the same name; for
    /// microVMs only `$DSEC_HOME/images/NAME/initramfs.cpio` counts.
    pub fn check_image(&self, kind: BackendKind, image: &str) -> Result<ImagePlan, NodeError> {
        Catalog::check_name(image)?;
        match kind {
            BackendKind::Container => Ok(ImagePlan::Container(self.catalog.resolve(image)?)),
            BackendKind::MicroVm => {
                let initrd = self.image_initrd(image);
                if !image.contains('/') && initrd.is_file() {
                    return Ok(self.microvm_image(image));
                }
                Err(self.catalog.not_found(image, "microvm").into())
            }
        }
    }

    /// Resolves a validated request once: the backend can run here, the image exists, and
    /// the limits its cgroups get.
    pub fn resolve(&self, request: Plan) -> Result<CreatePlan, NodeError> {
        if request.kind == BackendKind::MicroVm {
            if let Some(reason) = &self.microvm_unavailable {
                return Err(NodeError::FailedPrecondition(format!(
                    "backend microvm cannot run on this node: {reason}; use the container backend"
                )));
            }
        }
        let image = self.check_image(request.kind, &request.image)?;
        let on_disk = matches!(
            &image,
            ImagePlan::MicroVm {
                root_disk: Some(_),
                ..
            }
        );
        let memory_mib = memory_limit_mib(
            request.kind,
            request.demand.memory_mib,
            request.demand.disk_mib,
            on_disk,
        );
        let limits = limits_for(&request, memory_mib);
        Ok(CreatePlan {
            request,
            image,
            limits,
        })
    }

    /// Reserves what `plan` needs and makes sandbox `id`'s cgroups.
    pub(super) fn admit(
        self: &Arc<Self>,
        plan: &CreatePlan,
        id: &str,
    ) -> Result<Pending, NodeError> {
        self.reserve(plan.reserved())?;
        let mut pending = Pending {
            node: self.clone(),
            reserved: plan.reserved(),
            cgroups: Vec::new(),
            image_mount: None,
            armed: true,
        };
        pending.cgroups = self.cgroups.create(id, plan.limits).map_err(|e| {
            NodeError::Internal(format!("cannot set up the sandbox's cgroups: {e}"))
        })?;
        Ok(pending)
    }

    /// Admits, creates, persists and registers a sandbox.
    pub async fn create(self: &Arc<Self>, request: Plan) -> Result<Arc<Entry>, NodeError> {
        self.create_as(request, None).await
    }

    /// The id a create gets: the apiserver's choice (`chosen`, which must name this node and
    /// be new), else a fresh one. Draining nodes take nothing (UNAVAILABLE: try elsewhere).
    fn id_for_create(&self, chosen: Option<String>) -> Result<String, NodeError> {
        if super::registration::draining() {
            return Err(NodeError::Unavailable(
                "this node is being drained and takes no new sandboxes: create it on another node"
                    .into(),
            ));
        }
        let Some(id) = chosen else {
            return Ok(self.new_id());
        };
        let parsed: dsec_api::sandbox_id::SandboxId =
            id.parse().map_err(|e: dsec_api::sandbox_id::IdError| {
                NodeError::InvalidArgument(e.to_string())
            })?;
        match &self.config.node_name {
            Some(name) if parsed.node() == name => {}
            Some(name) => {
                return Err(NodeError::InvalidArgument(format!(
                    "sandbox id {id} names node {}, but this is node {name}",
                    parsed.node()
                )))
            }
            None => {
                return Err(NodeError::InvalidArgument(format!(
                    "sandbox id {id} was chosen by an apiserver, but this node has no --node-name"
                )))
            }
        }
        if self.get(&id).is_ok() {
            return Err(NodeError::InvalidArgument(format!(
                "sandbox id {id} is taken on this node"
            )));
        }
        Ok(id)
    }

    /// [`Node::create`] under the id the apiserver chose, if any.
    pub async fn create_as(
        self: &Arc<Self>,
        request: Plan,
        chosen_id: Option<String>,
    ) -> Result<Arc<Entry>, NodeError> {
        let started = Instant::now();
        let id = self.id_for_create(chosen_id)?;
        let plan = self.resolve(request)?;
        let result = self.create_admitted(&plan, &id).await;
        match &result {
            Ok(_) => {
                self.metrics.creates_total.fetch_add(1, Ordering::Relaxed);
                self.metrics.observe_create(started.elapsed());
                tracing::info!(
                    sandbox = %id,
                    cold = plan.request.cold,
                    ms = started.elapsed().as_millis() as u64,
                    "create done"
                );
            }
            Err(err) => {
                self.metrics
                    .create_failures_total
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(sandbox = %id, %err, "create failed");
            }
        }
        result
    }

    async fn create_admitted(
        self: &Arc<Self>,
        plan: &CreatePlan,
        id: &str,
    ) -> Result<Arc<Entry>, NodeError> {
        let started = Instant::now();
        let mut pending = self.admit(plan, id)?;
        let admitted = started.elapsed();
        let request = &plan.request;
        let rootfs = match &plan.image {
            ImagePlan::Container(ImageSource::Dir(rootfs)) => Some(rootfs.clone()),
            ImagePlan::Container(ImageSource::Layers(image)) => {
                let (instance, root) = self.images.acquire(image).await.map_err(|err| {
                    NodeError::Internal(format!("cannot mount image {:?}: {err}", request.image))
                })?;
                pending.image_mount = Some(instance);
                Some(root)
            }
            ImagePlan::MicroVm { .. } => None,
        };
        let spec = plan.spec(id, &pending.cgroups, rootfs, self.config.ready_timeout);
        let sandbox = if let Some(snapshot) = &request.from_snapshot {
            self.restore_snapshot(&spec, snapshot).await?
        } else if request.kind == BackendKind::MicroVm && !request.cold {
            self.create_from_template(&spec).await?
        } else {
            Sandbox::create(request.kind, &self.edge, &spec).await?
        };
        let built = started.elapsed();
        let client = sandbox.agent().clone();
        let env_in_guest = sandbox.env_in_guest();
        let handle = sandbox.detach();
        let now = now_ms();
        let record = Record {
            handle,
            image: request.image.clone(),
            vcpus: request.demand.vcpus as i32,
            memory_mib: request.demand.memory_mib,
            disk_mib: request.demand.disk_mib,
            pids_limit: request.demand.pids,
            env: request.env.clone(),
            env_in_guest,
            labels: request.labels.clone(),
            allow_internet: request.allow_internet,
            allow: request.allow.clone(),
            deny: request.deny.clone(),
            created_at_ms: now,
            expires_at_ms: if request.ttl_s > 0 {
                now + request.ttl_s * 1000
            } else {
                0
            },
            idle_timeout_s: request.idle_timeout_s,
            paused: false,
            parent_id: String::new(),
            cgroups: pending.cgroups.clone(),
            memory_limit_mib: plan.memory_limit_mib(),
            request_fingerprint: if request.request_id.is_empty() {
                String::new()
            } else {
                request.fingerprint()
            },
            request_id: request.request_id.clone(),
            access_token: new_access_token(),
            public_ports: request.public_ports.clone(),
            image_mount: pending.image_mount.clone(),
            suspended: None,
        };
        let entry = self.register(record, client, pending).await?;
        tracing::info!(
            sandbox = %id,
            admit_ms = admitted.as_millis() as u64,
            backend_ms = (built - admitted).as_millis() as u64,
            register_ms = (started.elapsed() - built).as_millis() as u64,
            "create steps"
        );
        Ok(entry)
    }

    /// Persists and registers a sandbox the backend made; if its record cannot be written
    /// the sandbox is torn down and `pending` frees the rest.
    pub(super) async fn register(
        &self,
        record: Record,
        client: AgentClient,
        pending: Pending,
    ) -> Result<Arc<Entry>, NodeError> {
        if let Err(err) = record.persist() {
            let handle = record.handle.clone();
            let _ = tokio::task::spawn_blocking(move || handle.teardown()).await;
            return Err(NodeError::Internal(format!(
                "cannot persist the sandbox record: {err}"
            )));
        }
        pending.keep();
        append_event(
            &record.handle.dir,
            &format!(
                "created backend={} image={} pid={}",
                record.handle.backend, record.image, record.handle.pid
            ),
        );
        tracing::info!(sandbox = %record.handle.id, backend = %record.handle.backend, pid = record.handle.pid, "created");
        let id = record.handle.id.clone();
        let entry = Entry::new(record, client);
        self.lock().insert(id, entry.clone());
        Ok(entry)
    }
}

/// The cgroup limits of a sandbox of `request` whose memory cgroup limit is `memory_mib`.
pub(super) fn limits_for(request: &Plan, memory_mib: i64) -> Limits {
    Limits {
        memory_bytes: memory_mib.max(0) as u64 * 1024 * 1024,
        ..Limits::for_sandbox(
            request.kind,
            0,
            0,
            request.demand.vcpus as u32,
            request.demand.pids as u64,
        )
    }
}
