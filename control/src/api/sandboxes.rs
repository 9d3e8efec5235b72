//! `dsec.v1.Sandboxes` over the cluster.

use std::pin::Pin;
use std::sync::Arc;

use dsec_api::sandbox_id::SandboxId;
use dsec_api::v1::sandboxes_client::SandboxesClient;
use dsec_api::v1::sandboxes_server::Sandboxes;
use dsec_api::v1::*;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use super::Shared;
use super::{auth, nodes};
use crate::iam::{Action, ProjectPath};
use crate::placement::{Attempt, Backend as PlacedBackend, PlacementRequest};
use crate::resources::Resources;
use crate::watcher::lost_sandbox;

mod create_many;

/// The node's defaults for what a Create leaves at 0 (edge: DEFAULT_MEMORY_MIB ...), which
/// quota and placement must count the same way.
const DEFAULT_MEMORY_MIB: i64 = 256;
const DEFAULT_DISK_MIB: i64 = 1024;
/// A microVM's VMM overhead the node's admission adds to its memory.
const MICROVM_OVERHEAD_MIB: u64 = 64;
/// Most sandboxes one List gathers from the nodes.
const LIST_MAX: usize = 100_000;

pub struct SandboxesApi(pub Arc<Shared>);

fn positive_or(value: i64, default: i64, what: &str) -> Result<u64, Status> {
    match value {
        0 => Ok(default as u64),
        n if n < 0 => Err(Status::invalid_argument(format!(
            "{what} must be positive, got {n}"
        ))),
        n => Ok(n as u64),
    }
}

/// Labels a client may not set: the project label is the apiserver's.
fn strip_reserved(labels: &mut std::collections::HashMap<String, String>) {
    labels.remove(dsec_api::PROJECT_LABEL);
}

/// What the node's admission reserves for a sandbox (edge `memory_limit_mib`): a container's
/// writable layer is a tmpfs charged to its memory; a microVM adds its VMM's overhead.
fn node_demand(backend: PlacedBackend, vcpus: u64, memory_mib: u64, disk_mib: u64) -> Resources {
    let memory = match backend {
        PlacedBackend::Container => memory_mib + disk_mib,
        _ => memory_mib + MICROVM_OVERHEAD_MIB,
    };
    Resources::sandbox(vcpus, memory, disk_mib)
}

/// A create checked and made ready for its node: what placement and the quota count.
pub(super) struct Prepared {
    pub request: CreateSandboxRequest,
    pub placement: PlacementRequest,
    pub quota: Resources,
}

/// Checks a create and fills in what the cluster decides: the backend's default, the sizes'
/// defaults, the project label (the client's own is dropped).
pub(super) fn prepare(
    mut request: CreateSandboxRequest,
    project: &ProjectPath,
) -> Result<Prepared, Status> {
    let backend = match Backend::try_from(request.backend) {
        Ok(Backend::Unspecified) | Ok(Backend::Container) => PlacedBackend::Container,
        Ok(Backend::Microvm) => PlacedBackend::Microvm,
        Err(_) => {
            return Err(Status::invalid_argument(format!(
                "backend {} is unknown: use BACKEND_CONTAINER or BACKEND_MICROVM",
                request.backend
            )))
        }
    };
    // The cluster's default backend is the container (every node offers it).
    if request.backend == Backend::Unspecified as i32 {
        request.backend = Backend::Container as i32;
    }
    let vcpus = positive_or(request.vcpus.into(), 1, "vcpus")?;
    let memory_mib = positive_or(request.memory_mib, DEFAULT_MEMORY_MIB, "memory_mib")?;
    let disk_mib = positive_or(request.disk_mib, DEFAULT_DISK_MIB, "disk_mib")?;
    let quota = Resources::sandbox(vcpus, memory_mib, disk_mib);
    let image = if request.image.is_empty() {
        "busybox".to_string()
    } else {
        request.image.clone()
    };
    let placement = PlacementRequest {
        resources: node_demand(backend, vcpus, memory_mib, disk_mib),
        backend,
        image: Some(image),
        labels: request.node_labels.clone().into_iter().collect(),
    };
    strip_reserved(&mut request.labels);
    request
        .labels
        .insert(dsec_api::PROJECT_LABEL.to_string(), project.to_string());
    request.project = String::new();
    request.node_labels.clear();
    Ok(Prepared {
        request,
        placement,
        quota,
    })
}

impl SandboxesApi {
    async fn create_placed(
        &self,
        request: CreateSandboxRequest,
        project: ProjectPath,
    ) -> Result<Sandbox, Status> {
        let shared = &self.0;
        let Prepared {
            request,
            placement,
            quota,
        } = prepare(request, &project)?;
        let placed = shared
            .placer
            .place(&placement, shared.config.max_nodes_per_create, |node| {
                let request = request.clone();
                let project = project.clone();
                async move { self.try_node(&node, request, &project, quota).await }
            })
            .await?;
        let (sandbox, _node) = placed?;
        shared.remember_project(&sandbox.id, &project);
        Ok(sandbox)
    }

    /// One attempt on `node`: reserve quota under a fresh id naming it, then the node's own
    /// Create; a refusal (full, draining) gives the quota back and lets placement go on.
    async fn try_node(
        &self,
        node: &str,
        mut request: CreateSandboxRequest,
        project: &ProjectPath,
        quota: Resources,
    ) -> Attempt<Sandbox, Status> {
        let shared = &self.0;
        let id = match SandboxId::new(node) {
            Ok(id) => id.to_string(),
            Err(e) => return Attempt::Failed(Status::internal(e.to_string())),
        };
        request.sandbox_id = id.clone();
        let channel = shared.nodes.to_node(node);
        let create_on_node = |channel: Result<_, Status>| async move {
            match channel {
                Ok(channel) => SandboxesClient::new(channel)
                    .create(request)
                    .await
                    .map(Response::into_inner)
                    .map_err(|status| nodes::unanswered(node, status)),
                Err(status) => Err(status),
            }
        };
        let started = std::time::Instant::now();
        let overlapped = shared.reserver.likely_fits(project, quota);
        let created = if overlapped {
            // The node creates while the reservation commits (the commit's latency off the
            // create's path); a reservation refused after all deletes the sandbox again.
            let (reserved, created) = tokio::join!(
                shared.reserver.reserve(project, node, &id, quota),
                create_on_node(channel.clone())
            );
            match reserved {
                Ok(_) => created,
                // A reconcile that listed the node between its create and the commit charged
                // the sandbox already (the key made the commit fail): that is its reservation.
                Err(_) if created.is_ok() && self.charged_already(node, &id).await => created,
                Err(e) => {
                    if created.is_ok() {
                        self.undo_create(node, &id).await;
                    }
                    return Attempt::Failed(e.into());
                }
            }
        } else {
            if let Err(e) = shared.reserver.reserve(project, node, &id, quota).await {
                return Attempt::Failed(e.into());
            }
            let reserved_us = started.elapsed().as_micros() as u64;
            tracing::debug!(sandbox = %id, reserved_us, "reservation committed before the node's create");
            create_on_node(channel).await
        };
        tracing::debug!(sandbox = %id, overlapped, node_us = started.elapsed().as_micros() as u64, "node create answered");
        match created {
            Ok(sandbox) => {
                shared.unreserved.reserved(node, &id);
                Attempt::Placed(sandbox)
            }
            Err(status) => {
                if let Err(e) = shared.quotas.release(node, &id).await {
                    tracing::warn!(sandbox = %id, %e, "cannot return the quota of a failed create; the watcher will");
                }
                match status.code() {
                    tonic::Code::ResourceExhausted | tonic::Code::Unavailable => {
                        Attempt::Refused(status.message().to_string())
                    }
                    _ => Attempt::Failed(status),
                }
            }
        }
    }

    pub(super) async fn charged_already(&self, node: &str, id: &str) -> bool {
        matches!(
            self.0.store.get(&crate::keys::reservation(node, id)).await,
            Ok(Some(_))
        )
    }

    /// Deletes a sandbox whose reservation was refused after its node made it. Should the
    /// node not answer, its next inventory shows a sandbox without a reservation, which the
    /// watcher's reconcile charges.
    pub(super) async fn undo_create(&self, node: &str, id: &str) {
        let deleted = match self.0.nodes.to_node(node) {
            Ok(channel) => SandboxesClient::new(channel)
                .delete(DeleteSandboxRequest {
                    sandbox_id: id.to_string(),
                })
                .await
                .map(|_| ()),
            Err(status) => Err(status),
        };
        if let Err(status) = deleted {
            tracing::warn!(sandbox = %id, %status, "cannot delete a sandbox whose reservation was refused; the watcher will charge it");
        }
    }

    /// Every sandbox of `project` carrying `labels`, from every node, ordered by id.
    async fn gather(
        &self,
        project: &ProjectPath,
        labels: std::collections::HashMap<String, String>,
    ) -> Result<Vec<Sandbox>, Status> {
        let mut labels = labels;
        strip_reserved(&mut labels);
        labels.insert(dsec_api::PROJECT_LABEL.to_string(), project.to_string());
        let mut calls = tokio::task::JoinSet::new();
        for (node, address) in self.0.placer.nodes() {
            let channel = self.0.nodes.to_address(&node, &address)?;
            let labels = labels.clone();
            calls.spawn(async move {
                let mut client = SandboxesClient::new(channel);
                let mut all = Vec::new();
                let mut page_token = String::new();
                for _ in 0..LIST_MAX / 1000 {
                    let page = client
                        .list(ListSandboxesRequest {
                            labels: labels.clone(),
                            page_size: 1000,
                            page_token: page_token.clone(),
                            project: String::new(),
                        })
                        .await
                        .map_err(|s| {
                            Status::new(s.code(), format!("node {node}: {}", s.message()))
                        })?
                        .into_inner();
                    all.extend(page.sandboxes);
                    if page.next_page_token.is_empty() || page.next_page_token == page_token {
                        break;
                    }
                    page_token = page.next_page_token;
                }
                Ok::<_, Status>(all)
            });
        }
        let mut all = Vec::new();
        while let Some(joined) = calls.join_next().await {
            match joined {
                Ok(Ok(sandboxes)) => all.extend(sandboxes),
                // A node that cannot answer is left out rather than failing the whole list.
                Ok(Err(status)) => tracing::warn!(%status, "List: a node did not answer"),
                Err(e) => tracing::warn!(%e, "List: a node's call panicked"),
            }
        }
        all.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(all)
    }
}

/// One page of `all` (sorted by id) after `page_token`.
fn page(
    all: Vec<Sandbox>,
    page_size: i32,
    page_token: &str,
) -> Result<ListSandboxesResponse, Status> {
    let size = match page_size {
        0 => 500,
        n if (1..=1000).contains(&n) => n as usize,
        n => {
            return Err(Status::invalid_argument(format!(
                "page_size {n} is out of range: give 1 to 1000 (0 means 500)"
            )))
        }
    };
    let mut sandboxes: Vec<Sandbox> = all
        .into_iter()
        .filter(|s| page_token.is_empty() || s.id.as_str() > page_token)
        .take(size + 1)
        .map(|mut s| {
            s.access_token.clear();
            s
        })
        .collect();
    let next_page_token = if sandboxes.len() > size {
        sandboxes.truncate(size);
        sandboxes.last().map(|s| s.id.clone()).unwrap_or_default()
    } else {
        String::new()
    };
    Ok(ListSandboxesResponse {
        sandboxes,
        next_page_token,
    })
}

type LogStream = Pin<Box<dyn Stream<Item = Result<LogChunk, Status>> + Send + 'static>>;

/// A unary call on one sandbox: route (authorize) it, then call the node.
macro_rules! on_node {
    ($self:ident, $request:ident, $action:expr, $method:ident) => {{
        let (metadata, _, message) = $request.into_parts();
        let route = $self
            .0
            .route(&metadata, &message.sandbox_id, $action)
            .await?;
        SandboxesClient::new(route.channel).$method(message).await
    }};
}

#[tonic::async_trait]
impl Sandboxes for SandboxesApi {
    async fn create(
        &self,
        request: Request<CreateSandboxRequest>,
    ) -> Result<Response<Sandbox>, Status> {
        let started = std::time::Instant::now();
        let (metadata, _, message) = request.into_parts();
        let project = auth::project(&message.project, &metadata)?;
        let caller = self
            .0
            .authorize(&metadata, &project, Action::SandboxCreate)
            .await?;
        let authorized = started.elapsed();
        let result = self.create_placed(message, project.clone()).await;
        let placed = started.elapsed();
        let target = result.as_ref().ok().map(|s| s.id.clone());
        let answer = self
            .0
            .audited(&caller, &project, Action::SandboxCreate, target, result)
            .await
            .map(Response::new);
        // Where a create's time goes (RUST_LOG=dsec_control=debug): the steps' end times.
        tracing::debug!(
            authorized_us = authorized.as_micros() as u64,
            placed_us = placed.as_micros() as u64,
            audited_us = started.elapsed().as_micros() as u64,
            "create timing"
        );
        answer
    }

    async fn create_many(
        &self,
        request: Request<CreateSandboxesRequest>,
    ) -> Result<Response<CreateSandboxesResponse>, Status> {
        let (metadata, _, message) = request.into_parts();
        dsec_api::create_many::check_count(message.requests.len())?;
        let project = auth::project(&message.project, &metadata)?;
        if let Some((index, other)) = message
            .requests
            .iter()
            .enumerate()
            .find(|(_, r)| !r.project.is_empty() && r.project != project.as_str())
        {
            return Err(Status::invalid_argument(format!(
                "request {index} of CreateMany names project {:?}, the call {project}: one call creates in one project",
                other.project
            )));
        }
        // One authorization for the call; the creates placed together and sent to their
        // nodes in one call per node (sandboxes/create_many.rs).
        let caller = self
            .0
            .authorize(&metadata, &project, Action::SandboxCreate)
            .await?;
        let results: Vec<CreateSandboxResult> = self
            .create_batch(message.requests, &project)
            .await
            .into_iter()
            .map(CreateSandboxResult::from_result)
            .collect();
        // One audit record for the sandboxes the call made (their ids), one per failed create.
        let made: Vec<&str> = results
            .iter()
            .filter_map(|r| r.sandbox.as_ref().map(|s| s.id.as_str()))
            .collect();
        if !made.is_empty() {
            let target = Some(made.join(","));
            self.0
                .audit(&caller, &project, Action::SandboxCreate, target, Ok(()))
                .await;
        }
        for failed in results.iter().filter(|r| r.sandbox.is_none()) {
            let status = Status::new(failed.code.into(), failed.message.clone());
            self.0
                .audit(&caller, &project, Action::SandboxCreate, None, Err(&status))
                .await;
        }
        Ok(Response::new(CreateSandboxesResponse { results }))
    }

    async fn get(&self, request: Request<GetSandboxRequest>) -> Result<Response<Sandbox>, Status> {
        let (metadata, _, message) = request.into_parts();
        let id = message.sandbox_id.clone();
        match self.0.route(&metadata, &id, Action::SandboxGet).await {
            Ok(route) => SandboxesClient::new(route.channel).get(message).await,
            Err(status) if status.code() == tonic::Code::Unavailable => {
                // The node is gone: a sandbox it held is LOST (its quota returned).
                let Some(lost) = lost_sandbox(self.0.store.as_ref(), &id)
                    .await
                    .map_err(|e| Status::unavailable(e.to_string()))?
                else {
                    return Err(status);
                };
                self.0
                    .authorize(&metadata, &lost.project, Action::SandboxGet)
                    .await?;
                Ok(Response::new(Sandbox {
                    id,
                    state: SandboxState::Lost as i32,
                    project: lost.project.to_string(),
                    node: lost.node,
                    vcpus: lost.resources.vcpus as i32,
                    memory_mib: lost.resources.memory_mib as i64,
                    disk_mib: lost.resources.disk_mib as i64,
                    death_reason: "its node stopped heartbeating and its lease expired".into(),
                    died_at_unix_ms: lost.lost_ms as i64,
                    ..Default::default()
                }))
            }
            Err(status) => Err(status),
        }
    }

    async fn list(
        &self,
        request: Request<ListSandboxesRequest>,
    ) -> Result<Response<ListSandboxesResponse>, Status> {
        let (metadata, _, message) = request.into_parts();
        let project = auth::project(&message.project, &metadata)?;
        self.0
            .authorize(&metadata, &project, Action::SandboxList)
            .await?;
        let all = self.gather(&project, message.labels).await?;
        Ok(Response::new(page(
            all,
            message.page_size,
            &message.page_token,
        )?))
    }

    async fn delete(
        &self,
        request: Request<DeleteSandboxRequest>,
    ) -> Result<Response<DeleteSandboxResponse>, Status> {
        let (metadata, _, message) = request.into_parts();
        let id = message.sandbox_id.clone();
        let route = self.0.route(&metadata, &id, Action::SandboxDelete).await?;
        let result = SandboxesClient::new(route.channel.clone())
            .delete(message)
            .await;
        let gone = match &result {
            Ok(_) => true,
            Err(status) => status.code() == tonic::Code::NotFound,
        };
        if gone {
            self.0.quotas.release_deleted(&route.node, &id).await?;
            self.0.forget_sandbox(&id);
        }
        self.0
            .audited(
                &route.caller,
                &route.project,
                Action::SandboxDelete,
                Some(id),
                result,
            )
            .await
    }

    async fn set_timeout(
        &self,
        request: Request<SetTimeoutRequest>,
    ) -> Result<Response<Sandbox>, Status> {
        on_node!(self, request, Action::SandboxExec, set_timeout)
    }

    async fn pause(
        &self,
        request: Request<PauseSandboxRequest>,
    ) -> Result<Response<Sandbox>, Status> {
        on_node!(self, request, Action::SandboxPause, pause)
    }

    async fn resume(
        &self,
        request: Request<ResumeSandboxRequest>,
    ) -> Result<Response<Sandbox>, Status> {
        on_node!(self, request, Action::SandboxResume, resume)
    }

    async fn fork(
        &self,
        request: Request<ForkSandboxRequest>,
    ) -> Result<Response<ForkSandboxResponse>, Status> {
        let (metadata, _, mut message) = request.into_parts();
        strip_reserved(&mut message.labels);
        let id = message.sandbox_id.clone();
        let route = self.0.route(&metadata, &id, Action::SandboxFork).await?;
        let forked = SandboxesClient::new(route.channel.clone())
            .fork(message)
            .await?
            .into_inner();
        // The children are on the parent's node and in its project: charge them; past the
        // quota the extra children are deleted again.
        let mut refused = None;
        for child in &forked.sandboxes {
            let quota = Resources::sandbox(
                child.vcpus.max(0) as u64,
                child.memory_mib.max(0) as u64,
                child.disk_mib.max(0) as u64,
            );
            let reserved = match &refused {
                Some(_) => Err(None),
                None => self
                    .0
                    .quotas
                    .reserve(&route.project, &route.node, &child.id, quota)
                    .await
                    .map_err(Some),
            };
            match reserved {
                Ok(_) => self.0.remember_project(&child.id, &route.project),
                Err(e) => {
                    if let Some(e) = e {
                        refused = Some(Status::from(e));
                    }
                    let _ = SandboxesClient::new(route.channel.clone())
                        .delete(DeleteSandboxRequest {
                            sandbox_id: child.id.clone(),
                        })
                        .await;
                }
            }
        }
        self.0
            .audit(
                &route.caller,
                &route.project,
                Action::SandboxFork,
                Some(id),
                refused.as_ref().map_or(Ok(()), Err),
            )
            .await;
        match refused {
            Some(status) => Err(status),
            None => Ok(Response::new(forked)),
        }
    }

    async fn snapshot(
        &self,
        request: Request<SnapshotSandboxRequest>,
    ) -> Result<Response<SnapshotSandboxResponse>, Status> {
        on_node!(self, request, Action::SandboxSnapshot, snapshot)
    }

    type LogsStream = LogStream;

    async fn logs(&self, request: Request<LogsRequest>) -> Result<Response<LogStream>, Status> {
        let response = on_node!(self, request, Action::SandboxGet, logs)?;
        Ok(Response::new(Box::pin(response.into_inner()) as LogStream))
    }

    async fn node_status(
        &self,
        _: Request<NodeStatusRequest>,
    ) -> Result<Response<NodeStatusResponse>, Status> {
        Err(Status::unimplemented(
            "NodeStatus describes one node: on a cluster use `dsec node ls` (Admin.ListNodes)",
        ))
    }
}
