//! Simulated nodes for placement benchmarks (`dsec control sim-nodes`): each speaks the real
//! node API (`dsec.v1.Sandboxes` on its own port, `dsec.node.v1.Registry` towards the
//! apiservers: register, heartbeat with its allocation and sandboxes, deregister) and admits
//! creates against a fake capacity, starting nothing. The other runtime services are absent
//! (UNIMPLEMENTED): a sim node only makes, lists, gets and deletes records. With the
//! cluster's TLS each sim node gets its own certificate from the CA and serves its API as a
//! real node does (only apiservers' certificates let in).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dsec_api::node::v1 as pb;
use dsec_api::node::v1::registry_client::RegistryClient;
use dsec_api::tls::{RevokedApiservers, TlsDir, APISERVER_NAME};
use dsec_api::v1::network_labels_server::{NetworkLabels, NetworkLabelsServer};
use dsec_api::v1::sandboxes_server::{Sandboxes, SandboxesServer};
use dsec_api::v1::*;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Response, Status};

use crate::now_ms;

/// A sim node's fake capacity.
#[derive(Clone, Copy, Debug)]
pub struct SimCapacity {
    pub sandboxes: u64,
    pub vcpus: u64,
    pub memory_mib: u64,
    pub disk_mib: u64,
}

/// Sandboxes a sim node lists per page at most.
const PAGE_MAX: usize = 1000;

#[derive(Debug, Default)]
struct Held {
    sandboxes: BTreeMap<String, Sandbox>,
    vcpus: u64,
    memory_mib: u64,
    disk_mib: u64,
}

/// How many Create and CreateMany calls one sim node answered.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CallCount {
    pub creates: u64,
    pub create_manys: u64,
}

/// The calls every sim node of one [`serve`] answered, by node name (tests check
/// how the apiserver talks to its nodes).
#[derive(Debug, Default)]
pub struct SimCalls(Mutex<BTreeMap<String, CallCount>>);

impl SimCalls {
    pub fn by_node(&self) -> BTreeMap<String, CallCount> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn count(&self, node: &str, add: impl FnOnce(&mut CallCount)) {
        let mut calls = self.0.lock().unwrap_or_else(|e| e.into_inner());
        add(calls.entry(node.to_string()).or_default());
    }
}

/// One simulated node.
#[derive(Debug)]
pub struct SimNode {
    name: String,
    address: String,
    capacity: SimCapacity,
    held: Mutex<Held>,
    calls: Arc<SimCalls>,
}

impl SimNode {
    fn info(&self) -> pb::NodeInfo {
        let held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        let running = held
            .sandboxes
            .values()
            .map(|s| pb::RunningSandbox {
                id: s.id.clone(),
                project: s.project.clone(),
                resources: Some(pb::Resources {
                    sandboxes: 1,
                    vcpus: s.vcpus.max(0) as u64,
                    memory_mib: s.memory_mib.max(0) as u64,
                    disk_mib: s.disk_mib.max(0) as u64,
                }),
            })
            .collect();
        pb::NodeInfo {
            name: self.name.clone(),
            address: self.address.clone(),
            capacity: Some(pb::Resources {
                sandboxes: self.capacity.sandboxes,
                vcpus: self.capacity.vcpus,
                memory_mib: self.capacity.memory_mib,
                disk_mib: self.capacity.disk_mib,
            }),
            allocated: Some(pb::Resources {
                sandboxes: held.sandboxes.len() as u64,
                vcpus: held.vcpus,
                memory_mib: held.memory_mib,
                disk_mib: held.disk_mib,
            }),
            backends: vec!["container".into()],
            images: vec![],
            labels: [("sim".to_string(), "true".to_string())].into(),
            running,
        }
    }
}

struct SimApi(Arc<SimNode>);

fn demand(vcpus: i32, memory_mib: i64, disk_mib: i64) -> (u64, u64, u64) {
    // The node daemon's defaults for a container.
    let vcpus = if vcpus > 0 { vcpus as u64 } else { 1 };
    let memory_mib = if memory_mib > 0 {
        memory_mib as u64
    } else {
        512
    };
    let disk_mib = if disk_mib > 0 { disk_mib as u64 } else { 1024 };
    (vcpus, memory_mib, disk_mib)
}

impl SimApi {
    /// One create, admitted against the node's fake capacity.
    fn create_one(&self, request: CreateSandboxRequest) -> Result<Sandbox, Status> {
        let node = &self.0;
        if dsec_api::sandbox_id::SandboxId::node_of(&request.sandbox_id) != Some(&node.name) {
            return Err(Status::invalid_argument(format!(
                "sandbox id {:?} does not name node {}",
                request.sandbox_id, node.name
            )));
        }
        let (vcpus, memory_mib, disk_mib) =
            demand(request.vcpus, request.memory_mib, request.disk_mib);
        let mut held = node.held.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(existing) = held.sandboxes.get(&request.sandbox_id) {
            return Ok(existing.clone());
        }
        let cap = node.capacity;
        if held.sandboxes.len() as u64 >= cap.sandboxes
            || held.vcpus + vcpus > cap.vcpus
            || held.memory_mib + memory_mib > cap.memory_mib
            || held.disk_mib + disk_mib > cap.disk_mib
        {
            return Err(Status::resource_exhausted(format!(
                "sim node {} is full",
                node.name
            )));
        }
        let sandbox = Sandbox {
            id: request.sandbox_id.clone(),
            backend: Backend::Container as i32,
            state: SandboxState::Running as i32,
            vcpus: vcpus as i32,
            memory_mib: memory_mib as i64,
            disk_mib: disk_mib as i64,
            project: request
                .labels
                .get(dsec_api::PROJECT_LABEL)
                .cloned()
                .unwrap_or_default(),
            labels: request.labels,
            created_at_unix_ms: now_ms() as i64,
            request_id: request.request_id,
            node: node.name.clone(),
            ..Default::default()
        };
        held.vcpus += vcpus;
        held.memory_mib += memory_mib;
        held.disk_mib += disk_mib;
        held.sandboxes.insert(sandbox.id.clone(), sandbox.clone());
        Ok(sandbox)
    }
}

#[tonic::async_trait]
impl Sandboxes for SimApi {
    async fn create(
        &self,
        request: Request<CreateSandboxRequest>,
    ) -> Result<Response<Sandbox>, Status> {
        self.0.calls.count(&self.0.name, |c| c.creates += 1);
        self.create_one(request.into_inner()).map(Response::new)
    }

    async fn create_many(
        &self,
        request: Request<CreateSandboxesRequest>,
    ) -> Result<Response<CreateSandboxesResponse>, Status> {
        self.0.calls.count(&self.0.name, |c| c.create_manys += 1);
        let requests = dsec_api::create_many::requests(request)?;
        let results = requests
            .into_iter()
            .map(|item| CreateSandboxResult::from_result(self.create_one(item)))
            .collect();
        Ok(Response::new(CreateSandboxesResponse { results }))
    }

    async fn get(&self, request: Request<GetSandboxRequest>) -> Result<Response<Sandbox>, Status> {
        let id = request.into_inner().sandbox_id;
        let held = self.0.held.lock().unwrap_or_else(|e| e.into_inner());
        held.sandboxes
            .get(&id)
            .cloned()
            .map(Response::new)
            .ok_or_else(|| Status::not_found(format!("sandbox {id} not found")))
    }

    async fn list(
        &self,
        request: Request<ListSandboxesRequest>,
    ) -> Result<Response<ListSandboxesResponse>, Status> {
        let request = request.into_inner();
        let size = match request.page_size {
            n if n <= 0 => 500,
            n => (n as usize).min(PAGE_MAX),
        };
        let held = self.0.held.lock().unwrap_or_else(|e| e.into_inner());
        let after = request.page_token;
        let sandboxes: Vec<Sandbox> = held
            .sandboxes
            .range::<String, _>((
                std::ops::Bound::Excluded(&after),
                std::ops::Bound::Unbounded,
            ))
            .map(|(_, s)| s)
            .filter(|s| {
                request
                    .labels
                    .iter()
                    .all(|(k, v)| s.labels.get(k) == Some(v))
            })
            .take(size)
            .cloned()
            .collect();
        let next_page_token = if sandboxes.len() == size {
            sandboxes.last().map(|s| s.id.clone()).unwrap_or_default()
        } else {
            String::new()
        };
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
        let mut held = self.0.held.lock().unwrap_or_else(|e| e.into_inner());
        let sandbox = held
            .sandboxes
            .remove(&id)
            .ok_or_else(|| Status::not_found(format!("sandbox {id} not found")))?;
        held.vcpus -= sandbox.vcpus.max(0) as u64;
        held.memory_mib -= sandbox.memory_mib.max(0) as u64;
        held.disk_mib -= sandbox.disk_mib.max(0) as u64;
        Ok(Response::new(DeleteSandboxResponse {}))
    }

    async fn set_timeout(
        &self,
        _: Request<SetTimeoutRequest>,
    ) -> Result<Response<Sandbox>, Status> {
        Err(unsupported("SetTimeout"))
    }

    async fn pause(&self, _: Request<PauseSandboxRequest>) -> Result<Response<Sandbox>, Status> {
        Err(unsupported("Pause"))
    }

    async fn resume(&self, _: Request<ResumeSandboxRequest>) -> Result<Response<Sandbox>, Status> {
        Err(unsupported("Resume"))
    }

    async fn fork(
        &self,
        _: Request<ForkSandboxRequest>,
    ) -> Result<Response<ForkSandboxResponse>, Status> {
        Err(unsupported("Fork"))
    }

    async fn snapshot(
        &self,
        _: Request<SnapshotSandboxRequest>,
    ) -> Result<Response<SnapshotSandboxResponse>, Status> {
        Err(unsupported("Snapshot"))
    }

    type LogsStream = tokio_stream::Empty<Result<LogChunk, Status>>;

    async fn logs(&self, _: Request<LogsRequest>) -> Result<Response<Self::LogsStream>, Status> {
        Err(unsupported("Logs"))
    }

    async fn node_status(
        &self,
        _: Request<NodeStatusRequest>,
    ) -> Result<Response<NodeStatusResponse>, Status> {
        Err(unsupported("NodeStatus"))
    }
}

/// Label-wide policy changes: the policy is recorded on each matching sandbox (not checked).
#[tonic::async_trait]
impl NetworkLabels for SimApi {
    async fn set_network_policy_by_labels(
        &self,
        request: Request<SetNetworkPolicyByLabelsRequest>,
    ) -> Result<Response<SetNetworkPolicyByLabelsResponse>, Status> {
        let request = request.into_inner();
        if request.labels.is_empty() {
            return Err(Status::invalid_argument("name at least one label"));
        }
        let mut held = self.0.held.lock().unwrap_or_else(|e| e.into_inner());
        let sandboxes = held
            .sandboxes
            .values_mut()
            .filter(|s| {
                request
                    .labels
                    .iter()
                    .all(|(k, v)| s.labels.get(k) == Some(v))
            })
            .map(|s| {
                s.network = request.network.clone();
                s.clone()
            })
            .collect();
        Ok(Response::new(SetNetworkPolicyByLabelsResponse {
            sandboxes,
            failed: Vec::new(),
        }))
    }
}

fn unsupported(call: &str) -> Status {
    Status::unimplemented(format!(
        "{call}: a sim node only creates, gets, lists and deletes"
    ))
}

/// Registers `node` with the apiservers and heartbeats until the task is dropped.
async fn keep_registered(
    node: Arc<SimNode>,
    control: Vec<String>,
    tls: Option<TlsDir>,
    revoked: Arc<RevokedApiservers>,
) {
    let mut next = 0usize;
    loop {
        let address = &control[next % control.len()];
        next += 1;
        let result: Result<(), String> = async {
            let scheme = if tls.is_some() { "https" } else { "http" };
            let mut endpoint = Endpoint::from_shared(format!("{scheme}://{address}"))
                .map_err(|e| e.to_string())?
                .timeout(Duration::from_secs(5));
            if let Some(tls) = &tls {
                let config = tls
                    .client("node", APISERVER_NAME)
                    .map_err(|e| e.to_string())?;
                endpoint = endpoint.tls_config(config).map_err(|e| e.to_string())?;
            }
            let channel: Channel = endpoint.connect().await.map_err(|e| e.to_string())?;
            let mut client = RegistryClient::new(channel);
            let lease = client
                .register(pb::RegisterRequest {
                    node: Some(node.info()),
                })
                .await
                .map_err(|s| s.message().to_string())?
                .into_inner();
            revoked.update(lease.revoked_apiservers);
            let interval = Duration::from_millis(u64::from(lease.heartbeat_interval_ms).max(100));
            loop {
                tokio::time::sleep(interval).await;
                match client
                    .heartbeat(pb::HeartbeatRequest {
                        lease_id: lease.lease_id,
                        node: Some(node.info()),
                    })
                    .await
                {
                    Ok(reply) => {
                        revoked.update(reply.into_inner().revoked_apiservers);
                    }
                    Err(s) if s.code() == tonic::Code::NotFound => return Ok(()),
                    Err(s) => return Err(s.message().to_string()),
                }
            }
        }
        .await;
        if let Err(why) = result {
            tracing::warn!(node = %node.name, apiserver = %address, %why, "sim node: trying the next apiserver");
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}

/// The first of `count` consecutive free ports on loopback, for `count` sim nodes (tests).
pub fn free_loopback_ports(count: u16) -> SocketAddr {
    loop {
        let base = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| listener.local_addr())
            .expect("bind a loopback port");
        let fits = base.port() < 65000;
        if fits
            && (0..count)
                .all(|i| std::net::TcpListener::bind(("127.0.0.1", base.port() + i)).is_ok())
        {
            return base;
        }
    }
}

/// Node `name`'s TLS directory under the cluster CA's `ca_dir`: `sim-nodes/<name>`, its
/// certificate issued on first use.
fn sim_node_tls(ca_dir: &Path, name: &str) -> Result<TlsDir, String> {
    let dir = ca_dir.join("sim-nodes").join(name);
    if !dir.join("node.pem").exists() {
        crate::pki::issue_node(ca_dir, &dir, name).map_err(|e| format!("sim node {name}: {e}"))?;
    }
    Ok(TlsDir::new(dir))
}

/// Serves `count` sim nodes named `<prefix><i>` on consecutive ports from `first` and keeps
/// them registered with `control`, until SIGINT/SIGTERM. `tls`: the cluster CA's directory
/// (`ca.pem`, `ca.key`), for mTLS as real nodes use it. Each node's
/// calls are counted in `calls` (tests read them).
pub async fn serve(
    prefix: &str,
    count: usize,
    first: SocketAddr,
    capacity: SimCapacity,
    control: Vec<String>,
    tls: Option<PathBuf>,
    calls: Arc<SimCalls>,
) -> Result<(), String> {
    if control.is_empty() {
        return Err("sim nodes need --control ADDR[,ADDR]".into());
    }
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..count {
        let name = format!("{prefix}{i}");
        if !dsec_api::sandbox_id::valid_node_name(&name) {
            return Err(format!(
                "{name:?} is not a node name (1-8 of a-z, 0-9, '-')"
            ));
        }
        let port = first
            .port()
            .checked_add(i as u16)
            .ok_or("the sim nodes' ports run past 65535: give a lower --first-port")?;
        let addr = SocketAddr::new(first.ip(), port);
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| format!("sim node {name}: cannot listen on {addr}: {e}"))?;
        let node = Arc::new(SimNode {
            name,
            address: addr.to_string(),
            capacity,
            held: Mutex::default(),
            calls: calls.clone(),
        });
        let node_tls = match &tls {
            Some(ca_dir) => Some(sim_node_tls(ca_dir, &node.name)?),
            None => None,
        };
        let router = tonic::transport::Server::builder()
            .add_service(SandboxesServer::new(SimApi(node.clone())))
            .add_service(NetworkLabelsServer::new(SimApi(node.clone())));
        // Apiservers are refused until the first registration reply says which are revoked.
        let revoked = RevokedApiservers::new(node_tls.is_none());
        match &node_tls {
            Some(node_tls) => {
                let acceptor = node_tls
                    .node_acceptor_with(&revoked)
                    .map_err(|e| e.to_string())?;
                let connections = revoked.connections();
                tasks.spawn(async move {
                    let _ = router
                        .serve_with_incoming(dsec_api::tls::accept_closable(
                            listener,
                            acceptor,
                            connections,
                        ))
                        .await;
                });
            }
            None => {
                tasks.spawn(async move {
                    // No Nagle: a reply's second write would wait for the delayed ACK.
                    let _ = router
                        .serve_with_incoming(
                            tonic::transport::server::TcpIncoming::from(listener)
                                .with_nodelay(Some(true)),
                        )
                        .await;
                });
            }
        }
        tasks.spawn(keep_registered(node, control.clone(), node_tls, revoked));
    }
    println!(
        "{count} sim nodes on {first} and the {} ports after it",
        count - 1
    );
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| format!("SIGTERM handler: {e}"))?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    tasks.abort_all();
    Ok(())
}
