//! The public `dsec.v1` services, backed by the node and the sandboxes' agents.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use dsec_api::v1::{self as api, *};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use super::error::NodeError;
use super::limits::{self, check_env, check_labels, check_len};
use super::node::{Node, MAX_PUBLIC_PORTS};
use super::record::{Entry, Tombstone, LOG_SOURCES};
use super::restore::SnapshotOrigin;
use super::status::status_of;
use super::{Budget, Claim, CreateOutcome, Demand, Plan};
use crate::backend::BackendKind;

type Stream<T> = ReceiverStream<Result<T, Status>>;

const MAX_VCPUS: i32 = 64;
const DEFAULT_MEMORY_MIB: i64 = 256;
const DEFAULT_DISK_MIB: i64 = 1024;
const DEFAULT_PIDS: i64 = 512;

fn backend_of(kind: &str) -> i32 {
    if kind == BackendKind::MicroVm.as_str() {
        Backend::Microvm as i32
    } else {
        Backend::Container as i32
    }
}

/// The project an apiserver created the sandbox for ("" for the node's own clients).
fn project_of(labels: &std::collections::BTreeMap<String, String>) -> String {
    labels
        .get(dsec_api::PROJECT_LABEL)
        .cloned()
        .unwrap_or_default()
}

pub fn sandbox_proto(node: &Node, entry: &Entry) -> api::Sandbox {
    let r = entry.record();
    let (memory_bytes, cpu_usage_ns, pids) = node.usage(&r);
    api::Sandbox {
        id: r.handle.id.clone(),
        backend: backend_of(&r.handle.backend),
        image: r.image.clone(),
        state: if r.paused {
            SandboxState::Paused as i32
        } else {
            SandboxState::Running as i32
        },
        vcpus: r.vcpus,
        memory_mib: r.memory_mib,
        disk_mib: r.disk_mib,
        pids_limit: r.pids_limit,
        labels: r.labels.clone().into_iter().collect(),
        created_at_unix_ms: r.created_at_ms,
        expires_at_unix_ms: r.expires_at_ms,
        idle_timeout_seconds: r.idle_timeout_s,
        last_activity_unix_ms: entry.last_activity_ms.load(Ordering::Relaxed),
        pid: r.handle.pid as u32,
        parent_id: r.parent_id.clone(),
        usage: Some(ResourceUsage {
            memory_bytes,
            cpu_usage_ns,
            pids,
        }),
        network: Some(NetworkPolicy {
            allow_internet: r.allow_internet,
            allow: r.allow.clone(),
            deny: r.deny.clone(),
        }),
        request_id: r.request_id.clone(),
        access_token: r.access_token.clone(),
        public_ports: r.public_ports.iter().map(|p| u32::from(*p)).collect(),
        memory_limit_bytes: super::cgroup::memory_limit(&r.cgroups)
            .map(|b| b as i64)
            .unwrap_or(r.memory_limit_mib << 20),
        death_reason: String::new(),
        died_at_unix_ms: 0,
        project: project_of(&r.labels),
        node: node.config.node_name.clone().unwrap_or_default(),
    }
}

/// What Get shows of a sandbox that died.
fn tombstone_proto(t: &Tombstone) -> api::Sandbox {
    let r = &t.record;
    api::Sandbox {
        id: r.handle.id.clone(),
        backend: backend_of(&r.handle.backend),
        image: r.image.clone(),
        state: SandboxState::Dead as i32,
        vcpus: r.vcpus,
        memory_mib: r.memory_mib,
        disk_mib: r.disk_mib,
        pids_limit: r.pids_limit,
        labels: r.labels.clone().into_iter().collect(),
        created_at_unix_ms: r.created_at_ms,
        expires_at_unix_ms: r.expires_at_ms,
        idle_timeout_seconds: r.idle_timeout_s,
        last_activity_unix_ms: t.last_activity_ms,
        pid: r.handle.pid as u32,
        parent_id: r.parent_id.clone(),
        usage: None,
        network: Some(NetworkPolicy::default()),
        memory_limit_bytes: r.memory_limit_mib << 20,
        request_id: r.request_id.clone(),
        access_token: String::new(),
        public_ports: Vec::new(),
        death_reason: t.reason.clone(),
        died_at_unix_ms: t.died_at_ms,
        project: project_of(&r.labels),
        node: String::new(),
    }
}

const DEFAULT_PAGE_SIZE: usize = 500;
const MAX_PAGE_SIZE: usize = 1000;
/// A List reply ends early past this many encoded bytes (gRPC's default limit is 4 MiB).
const MAX_PAGE_BYTES: usize = 2 << 20;

/// One page of `items` (ordered by id): at most `size` of them and, beyond the first, at most
/// `max_bytes` encoded; the token is the page's last id when more follow.
fn page<'a, F: FnOnce() -> api::Sandbox>(
    items: impl ExactSizeIterator<Item = (&'a str, F)>,
    size: usize,
    max_bytes: usize,
) -> (Vec<api::Sandbox>, String) {
    use prost::Message;
    let total = items.len();
    let mut out: Vec<api::Sandbox> = Vec::new();
    let mut bytes = 0usize;
    let mut last = "";
    for (id, make) in items {
        if out.len() == size {
            break;
        }
        let sandbox = make();
        let len = sandbox.encoded_len() + 8;
        if !out.is_empty() && bytes + len > max_bytes {
            break;
        }
        bytes += len;
        last = id;
        out.push(sandbox);
    }
    let next = if out.len() < total {
        last.to_string()
    } else {
        String::new()
    };
    (out, next)
}

/// How long a sandbox whose creating client went away is kept for a retry with the same
/// request_id before it is deleted.
const ABANDONED_KEEP: Duration = Duration::from_secs(60);

/// Runs a create in its own task, so that a client that goes away cannot leak a half-built
/// sandbox (its budget, its cgroups). An abandoned result is deleted at once, or, with a
/// request_id, after ABANDONED_KEEP unless a retry has returned it by then.
async fn spawn_create(
    node: Arc<Node>,
    plan: Plan,
    chosen_id: Option<String>,
    claim: Option<(String, tokio::sync::watch::Sender<CreateOutcome>)>,
) -> Result<Arc<Entry>, Status> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let request_id = plan.request_id.clone();
        let result = node.create_as(plan, chosen_id).await.map_err(Arc::new);
        if let Some((fingerprint, done)) = claim {
            node.finish_claim(&request_id, &fingerprint, &result, done);
        }
        if let Err(Ok(entry)) = tx.send(result) {
            let id = entry.id();
            if request_id.is_empty() {
                let _ = node.delete(&id, "client cancelled the create").await;
                return;
            }
            entry.event(&format!(
                "the creating client went away; kept {} s for a retry with its request_id",
                ABANDONED_KEEP.as_secs()
            ));
            let claims = entry.claims.load(Ordering::Relaxed);
            tokio::time::sleep(ABANDONED_KEEP).await;
            if entry.claims.load(Ordering::Relaxed) == claims {
                let _ = node
                    .delete(&id, "client cancelled the create and never retried")
                    .await;
            }
        }
    });
    rx.await
        .map_err(|_| Status::internal("the create task failed; see the daemon log"))?
        .map_err(|err| status_of(&err))
}

/// A Create request_id: bounded, and plain enough to log and store.
fn check_request_id(id: &str) -> Result<(), Status> {
    let ok = id.len() <= limits::MAX_REQUEST_ID
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':'));
    if !ok {
        let shown: String = id.chars().take(80).collect();
        return Err(Status::invalid_argument(format!(
            "request_id {shown:?} ({} bytes) is invalid: give at most {} bytes of A-Z a-z 0-9 - _ . : (e.g. a UUID)",
            id.len(),
            limits::MAX_REQUEST_ID
        )));
    }
    Ok(())
}

/// Validates a Create request and fills in defaults.
pub fn plan(node: &Node, mut req: CreateSandboxRequest) -> Result<Plan, Status> {
    let from_snapshot = take_snapshot_shape(&mut req)?;
    let kind = match Backend::try_from(req.backend) {
        Ok(Backend::Unspecified) => node.default_backend,
        Ok(Backend::Container) => BackendKind::Container,
        Ok(Backend::Microvm) => BackendKind::MicroVm,
        Err(_) => {
            return Err(Status::invalid_argument(format!(
                "backend {} is unknown: use BACKEND_CONTAINER or BACKEND_MICROVM",
                req.backend
            )))
        }
    };
    let vcpus = match req.vcpus {
        0 => 1,
        n if !(1..=MAX_VCPUS).contains(&n) => {
            return Err(Status::invalid_argument(format!(
                "vcpus {n} is out of range: give 1 to {MAX_VCPUS}"
            )))
        }
        n => n,
    };
    let memory_mib = match req.memory_mib {
        0 => DEFAULT_MEMORY_MIB,
        n if n < 0 => {
            return Err(Status::invalid_argument(format!(
                "memory_mib must be positive, got {n}: give the sandbox's memory in MiB, e.g. 256"
            )))
        }
        n if n < 32 => {
            return Err(Status::invalid_argument(format!(
                "memory_mib {n} is too small: a sandbox needs at least 32 MiB"
            )))
        }
        n if n > 1 << 20 => {
            return Err(Status::invalid_argument(format!(
                "memory_mib {n} is more than 1 TiB: give MiB, not bytes"
            )))
        }
        n => n,
    };
    let disk_mib = match req.disk_mib {
        0 => DEFAULT_DISK_MIB,
        n if n < 0 => {
            return Err(Status::invalid_argument(format!(
                "disk_mib must be positive, got {n}: give the writable disk size in MiB"
            )))
        }
        n if n < 16 => {
            return Err(Status::invalid_argument(format!(
                "disk_mib {n} is too small: at least 16 MiB"
            )))
        }
        n => n,
    };
    let pids = match req.pids_limit {
        0 => DEFAULT_PIDS,
        n if n < 16 => {
            return Err(Status::invalid_argument(format!(
                "pids_limit {n} is too small: at least 16 processes"
            )))
        }
        n => n,
    };
    limits::check_lifetime_s("ttl_seconds", req.ttl_seconds)?;
    limits::check_lifetime_s("idle_timeout_seconds", req.idle_timeout_seconds)?;
    check_env("env", &req.env)?;
    check_labels("labels", req.labels.iter())?;
    let image = if req.image.is_empty() {
        "busybox".to_string()
    } else {
        req.image
    };
    let network = req.network.unwrap_or_default();
    let policy = super::network::resolve(node, kind, &network)?;
    check_request_id(&req.request_id)?;
    if req.public_ports.len() > MAX_PUBLIC_PORTS {
        return Err(Status::invalid_argument(format!(
            "{} public_ports, at most {} are allowed",
            req.public_ports.len(),
            MAX_PUBLIC_PORTS
        )));
    }
    let public_ports = req
        .public_ports
        .iter()
        .map(|p| super::ports::check_port(*p))
        .collect::<Result<_, _>>()?;
    let ttl_s = if req.ttl_seconds > 0 {
        req.ttl_seconds
    } else {
        node.config
            .default_ttl
            .map(|d| d.as_secs() as i64)
            .unwrap_or(0)
    };
    Ok(Plan {
        kind,
        image,
        demand: Demand {
            memory_mib,
            vcpus: i64::from(vcpus),
            pids,
            disk_mib,
        },
        env: req.env.into_iter().collect(),
        labels: req.labels.into_iter().collect(),
        ttl_s,
        idle_timeout_s: req.idle_timeout_seconds,
        allow_internet: network.allow_internet,
        allow: network.allow,
        deny: network.deny,
        network: policy,
        request_id: req.request_id,
        public_ports,
        cold: req.cold,
        from_snapshot,
    })
}

/// A restore (`from_snapshot`): checks the snapshot and fills the request's image and shape
/// from it (a value the request sets must match).
fn take_snapshot_shape(req: &mut CreateSandboxRequest) -> Result<Option<PathBuf>, Status> {
    if req.from_snapshot.is_empty() {
        return Ok(None);
    }
    check_len(
        "from_snapshot",
        req.from_snapshot.as_bytes(),
        limits::MAX_PATH,
    )?;
    if req.cold {
        return Err(Status::invalid_argument(
            "cold and from_snapshot exclude each other: a restore never boots; drop one",
        ));
    }
    let (dir, origin) = SnapshotOrigin::read(&req.from_snapshot)?;
    req.backend = match Backend::try_from(req.backend) {
        Ok(Backend::Unspecified | Backend::Microvm) => Backend::Microvm as i32,
        _ => {
            return Err(Status::invalid_argument(
                "from_snapshot restores a microVM snapshot: leave backend unset or microvm",
            ))
        }
    };
    if !req.image.is_empty() && req.image != origin.image {
        return Err(NodeError::InvalidArgument(format!(
            "image {:?} differs from the snapshot's {:?} (sandbox {}): leave image unset",
            req.image, origin.image, origin.sandbox_id
        ))
        .into());
    }
    req.image = origin.image.clone();
    req.vcpus = origin.pick("vcpus", req.vcpus, origin.vcpus)?;
    req.memory_mib = origin.pick("memory_mib", req.memory_mib, origin.memory_mib)?;
    req.disk_mib = origin.pick("disk_mib", req.disk_mib, origin.disk_mib)?;
    req.pids_limit = origin.pick("pids_limit", req.pids_limit, origin.pids_limit)?;
    // The source's network policy, unless the Create gives one of its own.
    if req
        .network
        .as_ref()
        .is_none_or(|n| *n == NetworkPolicy::default())
    {
        req.network = Some(NetworkPolicy {
            allow_internet: origin.allow_internet,
            allow: origin.allow,
            deny: origin.deny,
        });
    }
    Ok(Some(dir))
}

// ------------------------------------------------------------------ Sandboxes

pub struct SandboxesService(pub Arc<Node>);

#[tonic::async_trait]
impl sandboxes_server::Sandboxes for SandboxesService {
    async fn create(
        &self,
        request: Request<CreateSandboxRequest>,
    ) -> Result<Response<api::Sandbox>, Status> {
        let request = request.into_inner();
        let chosen_id = Some(request.sandbox_id.clone()).filter(|id| !id.is_empty());
        let plan = plan(&self.0, request)?;
        if plan.request_id.is_empty() {
            let entry = spawn_create(self.0.clone(), plan, chosen_id, None).await?;
            return Ok(Response::new(sandbox_proto(&self.0, &entry)));
        }
        let fingerprint = plan.fingerprint();
        loop {
            match self.0.claim(&plan.request_id, &fingerprint)? {
                Claim::Existing(entry) => {
                    return Ok(Response::new(sandbox_proto(&self.0, &entry)));
                }
                Claim::Create(tx) => {
                    let entry = spawn_create(
                        self.0.clone(),
                        plan,
                        chosen_id.clone(),
                        Some((fingerprint, tx)),
                    )
                    .await?;
                    return Ok(Response::new(sandbox_proto(&self.0, &entry)));
                }
                Claim::Wait(mut done) => {
                    let outcome = done
                        .wait_for(Option::is_some)
                        .await
                        .map_err(|_| Status::internal("the first create with this request_id ended without an outcome; retry"))?
                        .clone();
                    match outcome {
                        Some(Ok(id)) => {
                            if let Ok(entry) = self.0.get(&id) {
                                entry.claims.fetch_add(1, Ordering::Relaxed);
                                return Ok(Response::new(sandbox_proto(&self.0, &entry)));
                            }
                            // Deleted meanwhile: claim again (and create afresh).
                        }
                        Some(Err(first)) => return Err(NodeError::FirstAttempt(first).into()),
                        None => unreachable!("waited for an outcome"),
                    }
                }
            }
        }
    }

    async fn create_many(
        &self,
        request: Request<CreateSandboxesRequest>,
    ) -> Result<Response<CreateSandboxesResponse>, Status> {
        let requests = dsec_api::create_many::requests(request)?;
        // Each one exactly as a lone Create, concurrently (admission decides per sandbox).
        let mut creates = tokio::task::JoinSet::new();
        for (index, item) in requests.into_iter().enumerate() {
            let service = SandboxesService(self.0.clone());
            creates.spawn(async move {
                let created = <SandboxesService as sandboxes_server::Sandboxes>::create(
                    &service,
                    Request::new(item),
                )
                .await;
                (index, created.map(Response::into_inner))
            });
        }
        let mut results = vec![CreateSandboxResult::default(); creates.len()];
        while let Some(joined) = creates.join_next().await {
            let (index, created) = joined
                .map_err(|e| Status::internal(format!("a create of CreateMany panicked: {e}")))?;
            results[index] = CreateSandboxResult::from_result(created);
        }
        Ok(Response::new(CreateSandboxesResponse { results }))
    }

    async fn get(
        &self,
        request: Request<GetSandboxRequest>,
    ) -> Result<Response<api::Sandbox>, Status> {
        let id = request.into_inner().sandbox_id;
        match self.0.get(&id) {
            Ok(entry) => Ok(Response::new(sandbox_proto(&self.0, &entry))),
            Err(status) => match self.0.tombstone(&id) {
                Some(t) => Ok(Response::new(tombstone_proto(&t))),
                None => Err(status.into()),
            },
        }
    }

    async fn list(
        &self,
        request: Request<ListSandboxesRequest>,
    ) -> Result<Response<ListSandboxesResponse>, Status> {
        let r = request.into_inner();
        check_labels("label filter", r.labels.iter())?;
        let size = match r.page_size {
            0 => DEFAULT_PAGE_SIZE,
            n if !(1..=MAX_PAGE_SIZE as i32).contains(&n) => {
                return Err(Status::invalid_argument(format!(
                    "page_size {n} is out of range: give 1 to {MAX_PAGE_SIZE} (0 means {DEFAULT_PAGE_SIZE})"
                )))
            }
            n => n as usize,
        };
        // The token is the last id of the previous page.
        let after = r.page_token;
        if after.len() > limits::MAX_SANDBOX_ID {
            return Err(Status::invalid_argument(
                "page_token is not one this node handed out: pass back next_page_token as it came, or leave it empty for the first page",
            ));
        }
        let mut entries: Vec<(String, Arc<Entry>)> = self
            .0
            .list()
            .into_iter()
            .map(|e| (e.id(), e))
            .filter(|(id, _)| *id > after)
            .filter(|(_, e)| {
                let labels = e.record().labels;
                r.labels.iter().all(|(k, v)| labels.get(k) == Some(v))
            })
            .collect();
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        let (sandboxes, next_page_token) = page(
            entries.iter().map(|(id, e)| {
                (id.as_str(), || {
                    // Tokens go to callers naming one sandbox, not to listings.
                    let mut s = sandbox_proto(&self.0, e);
                    s.access_token.clear();
                    s
                })
            }),
            size,
            MAX_PAGE_BYTES,
        );
        Ok(Response::new(ListSandboxesResponse {
            sandboxes,
            next_page_token,
        }))
    }

    async fn delete(
        &self,
        request: Request<DeleteSandboxRequest>,
    ) -> Result<Response<DeleteSandboxResponse>, Status> {
        let id = request.into_inner().sandbox_id;
        if self.0.get(&id).is_err() && self.0.remove_tombstone(&id) {
            return Ok(Response::new(DeleteSandboxResponse {}));
        }
        self.0.get(&id)?;
        self.0.delete(&id, "requested").await?;
        Ok(Response::new(DeleteSandboxResponse {}))
    }

    async fn set_timeout(
        &self,
        request: Request<SetTimeoutRequest>,
    ) -> Result<Response<api::Sandbox>, Status> {
        let r = request.into_inner();
        limits::check_lifetime_s("ttl_seconds", r.ttl_seconds)?;
        if let Some(idle) = r.idle_timeout_seconds {
            limits::check_lifetime_s("idle_timeout_seconds", idle)?;
        }
        let entry = self
            .0
            .set_timeout(&r.sandbox_id, r.ttl_seconds, r.idle_timeout_seconds)?;
        Ok(Response::new(sandbox_proto(&self.0, &entry)))
    }

    async fn pause(
        &self,
        request: Request<PauseSandboxRequest>,
    ) -> Result<Response<api::Sandbox>, Status> {
        let entry = self
            .0
            .set_paused(&request.into_inner().sandbox_id, true)
            .await?;
        Ok(Response::new(sandbox_proto(&self.0, &entry)))
    }

    async fn resume(
        &self,
        request: Request<ResumeSandboxRequest>,
    ) -> Result<Response<api::Sandbox>, Status> {
        let entry = self
            .0
            .set_paused(&request.into_inner().sandbox_id, false)
            .await?;
        Ok(Response::new(sandbox_proto(&self.0, &entry)))
    }

    async fn fork(
        &self,
        request: Request<ForkSandboxRequest>,
    ) -> Result<Response<ForkSandboxResponse>, Status> {
        let r = request.into_inner();
        let count = match r.count {
            0 => 1,
            n if !(1..=256).contains(&n) => {
                return Err(Status::invalid_argument(format!(
                    "count {n} is out of range: fork 1 to 256 children at a time"
                )))
            }
            n => n as usize,
        };
        check_labels("labels", r.labels.iter())?;
        let children = self
            .0
            .fork(
                &r.sandbox_id,
                count,
                r.labels.into_iter().collect::<BTreeMap<_, _>>(),
            )
            .await?;
        Ok(Response::new(ForkSandboxResponse {
            sandboxes: children.iter().map(|e| sandbox_proto(&self.0, e)).collect(),
        }))
    }

    async fn snapshot(
        &self,
        request: Request<SnapshotSandboxRequest>,
    ) -> Result<Response<SnapshotSandboxResponse>, Status> {
        let r = request.into_inner();
        check_len("path", r.path.as_bytes(), limits::MAX_PATH)?;
        let path = self.0.snapshot(&r.sandbox_id, &r.path, r.diff).await?;
        Ok(Response::new(SnapshotSandboxResponse {
            path: path.display().to_string(),
        }))
    }

    type LogsStream = Stream<LogChunk>;

    async fn logs(
        &self,
        request: Request<LogsRequest>,
    ) -> Result<Response<Self::LogsStream>, Status> {
        let r = request.into_inner();
        let entry = match self.0.get(&r.sandbox_id) {
            Ok(entry) => entry,
            Err(status) => {
                let Some(t) = self.0.tombstone(&r.sandbox_id) else {
                    return Err(status.into());
                };
                // A dead sandbox: the kept tails, no following.
                let (tx, rx) = mpsc::channel(LOG_SOURCES.len());
                for (source, data) in &t.logs {
                    let start = if r.tail_bytes > 0 {
                        data.len().saturating_sub(r.tail_bytes as usize)
                    } else {
                        0
                    };
                    let chunk = LogChunk {
                        source: source.to_string(),
                        data: data[start..].to_vec(),
                    };
                    let _ = tx.try_send(Ok(chunk));
                }
                return Ok(Response::new(ReceiverStream::new(rx)));
            }
        };
        let dir = entry.record().handle.dir.clone();
        let node = self.0.clone();
        let id = r.sandbox_id.clone();
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(async move {
            let sources = LOG_SOURCES;
            let mut offsets = [0u64; 4];
            for (i, (_, file)) in sources.iter().enumerate() {
                let len = std::fs::metadata(dir.join(file))
                    .map(|m| m.len())
                    .unwrap_or(0);
                if r.tail_bytes > 0 {
                    offsets[i] = len.saturating_sub(r.tail_bytes);
                }
            }
            loop {
                for (i, (source, file)) in sources.iter().enumerate() {
                    let Ok(data) = std::fs::read(dir.join(file)) else {
                        continue;
                    };
                    let start = (offsets[i] as usize).min(data.len());
                    if start < data.len() {
                        offsets[i] = data.len() as u64;
                        let chunk = LogChunk {
                            source: source.to_string(),
                            data: data[start..].to_vec(),
                        };
                        if tx.send(Ok(chunk)).await.is_err() {
                            return;
                        }
                    }
                }
                if !r.follow || node.get(&id).is_err() || tx.is_closed() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn node_status(
        &self,
        _: Request<NodeStatusRequest>,
    ) -> Result<Response<NodeStatusResponse>, Status> {
        let node = &self.0;
        let m = &node.metrics;
        let b = node.budgets.lock().unwrap_or_else(|e| e.into_inner());
        let budget = |x: Budget| {
            Some(api::Budget {
                limit: x.limit,
                reserved: x.reserved,
            })
        };
        Ok(Response::new(NodeStatusResponse {
            version: env!("CARGO_PKG_VERSION").to_string(),
            default_backend: node.default_backend.as_str().to_string(),
            memory_mib: budget(b.memory_mib),
            vcpus: budget(b.vcpus),
            pids: budget(b.pids),
            disk_mib: budget(b.disk_mib),
            sandboxes: node.count() as u64,
            creates_total: m.creates_total.load(Ordering::Relaxed),
            create_failures_total: m.create_failures_total.load(Ordering::Relaxed),
            admission_rejections_total: m.rejections_total(),
            reaped_total: m.reaped_total(),
            adopted_total: m.adopted_total.load(Ordering::Relaxed),
            started_at_unix_ms: node.started_at_ms,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sandbox(id: &str, label_bytes: usize) -> api::Sandbox {
        api::Sandbox {
            id: id.to_string(),
            labels: [("k".to_string(), "v".repeat(label_bytes))].into(),
            ..Default::default()
        }
    }

    #[test]
    fn pages_end_at_size_or_bytes_and_name_their_last_id() {
        let ids: Vec<String> = (0..7).map(|i| format!("sb-{i}")).collect();
        let items = || ids.iter().map(|id| (id.as_str(), || sandbox(id, 10)));
        let (p, next) = page(items(), 3, 1 << 20);
        assert_eq!(p.len(), 3);
        assert_eq!(next, "sb-2");
        let (p, next) = page(items(), 7, 1 << 20);
        assert_eq!((p.len(), next.as_str()), (7, ""));
        // 1000-byte sandboxes, 2500 bytes allowed: two fit; a page always holds one.
        let big = || ids.iter().map(|id| (id.as_str(), || sandbox(id, 1000)));
        let (p, next) = page(big(), 7, 2500);
        assert_eq!((p.len(), next.as_str()), (2, "sb-1"));
        let (p, next) = page(big(), 7, 10);
        assert_eq!((p.len(), next.as_str()), (1, "sb-0"));
    }
}
