//! Nodes as the apiserver sees them: the registry service they call, one lazily connected
//! channel per node address, and the watcher's inventory (the node's own List).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dsec_api::node::v1 as pb;
use dsec_api::node::v1::registry_server::Registry;
use dsec_api::tls::{error_chain, node_server_name, TlsDir};
use dsec_api::v1::sandboxes_client::SandboxesClient;
use dsec_api::v1::ListSandboxesRequest;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Response, Status};

use super::Shared;
use crate::now_ms;
use crate::placement::{Backend, NodeRecord, PlacementError, Placer};
use crate::quota::RunningSandbox;
use crate::resources::Resources;
use crate::revocation::fingerprint;
use crate::store::StoreError;
use crate::watcher::NodeInventory;

/// How long the apiserver waits for a node to accept a connection.
const NODE_CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// HTTP/2 pings on every node connection, idle or not: a node whose link went down (no RST
/// ever comes) fails its calls within interval + timeout instead of holding them forever.
const NODE_PING_INTERVAL: Duration = Duration::from_secs(2);
const NODE_PING_TIMEOUT: Duration = Duration::from_secs(3);

/// Channels to nodes, by name and address (lazily connected, shared by every call to the
/// node); with the cluster's TLS directory every channel is mTLS: the node must prove it is
/// `<name>.node.dsec` under the cluster CA, and the apiserver shows its own certificate.
#[derive(Clone, Debug)]
pub struct NodeChannels {
    placer: Arc<Placer>,
    tls: Option<TlsDir>,
    /// By node name: the address the channel goes to and the channel (a node that comes back
    /// at another address gets a new one). Looked up by `&str`: no allocation per call.
    channels: Arc<Mutex<HashMap<String, (String, Channel)>>>,
}

impl NodeChannels {
    pub fn new(placer: Arc<Placer>, tls: Option<TlsDir>) -> Self {
        NodeChannels {
            placer,
            tls,
            channels: Arc::default(),
        }
    }

    /// The channel to node `node` at `address`.
    pub fn to_address(&self, node: &str, address: &str) -> Result<Channel, Status> {
        let mut channels = self.channels.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((known, channel)) = channels.get(node) {
            if known == address {
                return Ok(channel.clone());
            }
        }
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let mut endpoint = Endpoint::from_shared(format!("{scheme}://{address}"))
            .map_err(|e| Status::internal(format!("node address {address:?} is invalid: {e}")))?
            .connect_timeout(NODE_CONNECT_TIMEOUT)
            .http2_keep_alive_interval(NODE_PING_INTERVAL)
            .keep_alive_timeout(NODE_PING_TIMEOUT)
            .keep_alive_while_idle(true)
            .tcp_nodelay(true);
        if let Some(tls) = &self.tls {
            let config = tls
                .client("apiserver", &node_server_name(node))
                .map_err(|e| Status::internal(e.to_string()))?;
            endpoint = endpoint.tls_config(config).map_err(|e| {
                Status::internal(format!("TLS to node {node}: {}", error_chain(&e)))
            })?;
        }
        let channel = endpoint.connect_lazy();
        channels.insert(node.to_string(), (address.to_string(), channel.clone()));
        Ok(channel)
    }

    /// The channel to a registered node by name.
    pub fn to_node(&self, node: &str) -> Result<Channel, Status> {
        let address = self.placer.address(node).map_err(|e| match e {
            PlacementError::UnknownNode(_) => Status::unavailable(format!(
                "node {node} is not registered (its lease expired or it never joined): its sandboxes cannot be reached now"
            )),
            other => other.into(),
        })?;
        self.to_address(node, &address)
    }
}

/// A node call that ended without an answer because the connection failed under it
/// (CANCELLED, or UNKNOWN with a transport cause: the node refused this apiserver's
/// certificate in the handshake, or went away) as UNAVAILABLE naming the node and what to
/// check; a create then tries another node. The node's own statuses pass unchanged.
pub(super) fn unanswered(node: &str, status: Status) -> Status {
    let cause = std::error::Error::source(&status);
    let transport = match status.code() {
        tonic::Code::Cancelled => true,
        tonic::Code::Unknown => cause.is_some(),
        _ => false,
    };
    if !transport {
        return status;
    }
    let why = match cause {
        Some(cause) => format!(
            "{}: {}",
            status.message(),
            dsec_api::tls::error_chain(cause)
        ),
        None => status.message().to_string(),
    };
    Status::unavailable(format!(
        "node {node} closed the connection without answering ({why}): if this apiserver's certificate was revoked (`dsec control revoke-apiserver`) every node refuses it, use another replica; else the node is restarting"
    ))
}

pub(super) fn resources_of(r: Option<pb::Resources>) -> Resources {
    let r = r.unwrap_or_default();
    Resources::new(r.sandboxes, r.vcpus, r.memory_mib, r.disk_mib)
}

fn backend_of(name: &str) -> Option<Backend> {
    match name {
        "container" => Some(Backend::Container),
        "microvm" => Some(Backend::Microvm),
        "fullvm" => Some(Backend::Fullvm),
        "fncall" => Some(Backend::Fncall),
        _ => None,
    }
}

pub(super) fn record_of(info: Option<pb::NodeInfo>) -> Result<NodeRecord, Status> {
    let info = info.ok_or_else(|| Status::invalid_argument("the request carries no node"))?;
    if info.address.is_empty() || info.address.len() > 256 {
        return Err(Status::invalid_argument(format!(
            "node {} gave no usable address (host:port, at most 256 bytes)",
            info.name
        )));
    }
    Ok(NodeRecord {
        backends: info.backends.iter().filter_map(|b| backend_of(b)).collect(),
        images: info.images.into_iter().collect(),
        labels: info.labels.into_iter().collect::<BTreeMap<_, _>>(),
        capacity: resources_of(info.capacity),
        allocated: resources_of(info.allocated),
        name: info.name,
        address: info.address,
        heartbeat_ms: now_ms(),
        cert_sha256: None,
    })
}

/// Whether a DER certificate carries `name` as a DNS subject alternative name: the SAN
/// entry is `[2] IA5String`, tag 0x82, a one-byte length and the name (certificates here
/// come from the cluster CA, which writes only the names it was given).
pub(super) fn names_dns(der: &[u8], name: &str) -> bool {
    let Ok(len) = u8::try_from(name.len()) else {
        return false;
    };
    if len > 127 {
        return false;
    }
    let mut entry = vec![0x82, len];
    entry.extend_from_slice(name.as_bytes());
    der.windows(entry.len()).any(|w| w == entry.as_slice())
}

/// `dsec.node.v1.Registry`.
pub struct RegistryApi(pub Arc<Shared>);

impl RegistryApi {
    /// With TLS on, only a caller with a certificate from the cluster CA is a node (the
    /// handshake already refused certificates from other CAs; token holders have none), and
    /// it may speak only for the node its certificate names. Returns the certificate's
    /// fingerprint (None without TLS).
    fn check_certificate<T>(
        &self,
        request: &Request<T>,
        node: Option<&str>,
    ) -> Result<Option<String>, Status> {
        if self.0.config.tls.is_none() {
            return Ok(None);
        }
        let certs = request.peer_certs().unwrap_or_default();
        let Some(leaf) = certs.first() else {
            return Err(Status::unauthenticated(
                "the node registry needs a node certificate signed by the cluster CA (`dsec control issue-node`, then `dsec up --tls-dir DIR`)",
            ));
        };
        match node {
            Some(node) if !names_dns(leaf.as_ref(), &node_server_name(node)) => {
                Err(Status::permission_denied(format!(
                    "this certificate is not node {node}'s: issue one with `dsec control issue-node --name {node}`"
                )))
            }
            _ => Ok(Some(fingerprint(leaf.as_ref()))),
        }
    }

    /// [`check_certificate`](Self::check_certificate), then the revoked node list: a node
    /// speaks for itself only with a certificate that was not revoked.
    async fn check_node<T>(
        &self,
        request: &Request<T>,
        node: &str,
    ) -> Result<Option<String>, Status> {
        let fingerprint = self.check_certificate(request, Some(node))?;
        if let Err(revoked) = self.0.revocations.check(node, fingerprint.as_deref()).await {
            tracing::warn!(%node, %revoked, "a revoked node was refused");
            return Err(revoked.into());
        }
        Ok(fingerprint)
    }
}

impl RegistryApi {
    /// The revoked apiserver certificates every reply to a node carries.
    async fn revoked_apiservers(&self) -> Vec<String> {
        self.0.apiserver_revocations.entries().await
    }
}

#[tonic::async_trait]
impl Registry for RegistryApi {
    async fn register(
        &self,
        request: Request<pb::RegisterRequest>,
    ) -> Result<Response<pb::RegisterResponse>, Status> {
        let name = request.get_ref().node.as_ref().map(|n| n.name.clone());
        let fingerprint = self
            .check_node(&request, name.as_deref().unwrap_or_default())
            .await?;
        let revoked_apiservers = self.revoked_apiservers().await;
        let mut record = record_of(request.into_inner().node)?;
        record.cert_sha256 = fingerprint;
        let ttl = self.0.config.node_ttl;
        let lease = self.0.registry.register(&record, ttl).await?;
        self.0.placer.update_node(record.clone());
        tracing::info!(node = %record.name, address = %record.address, lease, "node registered");
        Ok(Response::new(pb::RegisterResponse {
            lease_id: lease,
            ttl_seconds: ttl.as_secs() as u32,
            heartbeat_interval_ms: (ttl.as_millis() / 3) as u32,
            revoked_apiservers,
        }))
    }

    async fn heartbeat(
        &self,
        request: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatResponse>, Status> {
        let name = request.get_ref().node.as_ref().map(|n| n.name.clone());
        let fingerprint = self
            .check_node(&request, name.as_deref().unwrap_or_default())
            .await?;
        let revoked_apiservers = self.revoked_apiservers().await;
        let mut request = request.into_inner();
        let running = request
            .node
            .as_mut()
            .map(|node| std::mem::take(&mut node.running))
            .unwrap_or_default();
        let mut record = record_of(request.node)?;
        record.cert_sha256 = fingerprint;
        match self.0.registry.heartbeat(request.lease_id, &record).await {
            Ok(()) => {}
            Err(PlacementError::Store(StoreError::LeaseNotFound(_))) => {
                return Err(Status::not_found(format!(
                    "lease {} of node {} is gone: register again",
                    request.lease_id, record.name
                )))
            }
            Err(e) => return Err(e.into()),
        }
        self.0
            .unreserved
            .heartbeat(&self.0.quotas, &record.name, running_of(&running));
        let admin = self.0.placer.admin(&record.name).unwrap_or_default();
        self.0.placer.update_node(record);
        Ok(Response::new(pb::HeartbeatResponse {
            cordoned: admin.cordoned,
            draining: admin.draining,
            revoked_apiservers,
        }))
    }

    async fn deregister(
        &self,
        request: Request<pb::DeregisterRequest>,
    ) -> Result<Response<pb::DeregisterResponse>, Status> {
        self.check_certificate(&request, None)?;
        match self
            .0
            .registry
            .deregister(request.into_inner().lease_id)
            .await
        {
            Ok(()) | Err(PlacementError::Store(StoreError::LeaseNotFound(_))) => {}
            Err(e) => return Err(e.into()),
        }
        Ok(Response::new(pb::DeregisterResponse {}))
    }
}

/// The sandboxes a heartbeat lists that an apiserver made (they carry a project).
fn running_of(running: &[pb::RunningSandbox]) -> Vec<RunningSandbox> {
    running
        .iter()
        .filter_map(|sandbox| {
            let project = sandbox.project.parse().ok()?;
            Some(RunningSandbox {
                sandbox: sandbox.id.clone(),
                project,
                resources: resources_of(sandbox.resources),
            })
        })
        .collect()
}

/// What a node runs, from its own List: the sandboxes an apiserver made (they carry their
/// project).
pub struct ListInventory(pub NodeChannels);

#[async_trait::async_trait]
impl NodeInventory for ListInventory {
    async fn running(&self, node: &NodeRecord) -> Result<Vec<RunningSandbox>, String> {
        let channel = self
            .0
            .to_address(&node.name, &node.address)
            .map_err(|s| s.message().to_string())?;
        let mut client = SandboxesClient::new(channel);
        let mut running = Vec::new();
        let mut page_token = String::new();
        // Bounded: 1,000 pages of up to 1,000 sandboxes.
        for _ in 0..1000 {
            let page = client
                .list(ListSandboxesRequest {
                    page_size: 1000,
                    page_token: page_token.clone(),
                    ..Default::default()
                })
                .await
                .map_err(|s| format!("List: {}", s.message()))?
                .into_inner();
            for sandbox in page.sandboxes {
                let Some(project) = sandbox.labels.get(dsec_api::PROJECT_LABEL) else {
                    continue;
                };
                let Ok(project) = project.parse() else {
                    continue;
                };
                running.push(RunningSandbox {
                    sandbox: sandbox.id,
                    project,
                    resources: Resources::sandbox(
                        sandbox.vcpus.max(0) as u64,
                        sandbox.memory_mib.max(0) as u64,
                        sandbox.disk_mib.max(0) as u64,
                    ),
                });
            }
            if page.next_page_token.is_empty() || page.next_page_token == page_token {
                return Ok(running);
            }
            page_token = page.next_page_token;
        }
        Ok(running)
    }
}
