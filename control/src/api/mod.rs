//! The apiserver: the public `dsec.v1` API over many nodes, the admin services and the
//! node-facing registry. Stateless: every replica keeps only caches (node channels, the
//! project of sandboxes it has seen, its placer's view of the nodes); everything else is in
//! the store.
//!
//! - `auth.rs`: the bearer token and project of a call; the project of a sandbox by id.
//! - `sandboxes.rs`: Sandboxes (Create = authorize, quota, placement with retries, the node's
//!   Create under an id naming it; List merges the nodes' lists of the project).
//! - `runtime.rs`: Process, Files, Sessions, Ports, proxied to the node named by the id
//!   (streams as streams).
//! - `network.rs`: NetworkLabels (a label-wide policy change fanned out to the nodes).
//! - `admin.rs`: projects, quotas, principals, roles, tokens, nodes.
//! - `nodes.rs`: the node registry service, node channels, the watcher's inventory.

mod admin;
mod auth;
mod network;
mod nodes;
mod runtime;
mod sandboxes;
#[cfg(test)]
mod tests;
mod unreserved;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use dsec_api::node::v1::registry_server::RegistryServer;
use dsec_api::v1::admin_server::AdminServer;
use dsec_api::v1::files_server::FilesServer;
use dsec_api::v1::network_labels_server::NetworkLabelsServer;
use dsec_api::v1::network_server::NetworkServer;
use dsec_api::v1::ports_server::PortsServer;
use dsec_api::v1::process_server::ProcessServer;
use dsec_api::v1::sandboxes_server::SandboxesServer;
use dsec_api::v1::sessions_server::SessionsServer;

use dsec_api::tls::TlsDir;

use crate::iam::{Iam, IamCache, IssuedToken};
use crate::placement::{NodeRegistry, Placer, DEFAULT_CHOICES};
use crate::quota::{Quotas, Reserver};
use crate::resources::Resources;
use crate::revocation::{ApiserverRevocations, NodeRevocations};
use crate::store::{EmbeddedStore, EtcdStore, PutBatcher, Store, StoreError};
use crate::watcher::Watcher;

pub use nodes::NodeChannels;

/// Where the control plane keeps its state.
#[derive(Clone, Debug)]
pub enum StoreConfig {
    /// etcd endpoints (`http://host:port`) and the key namespace.
    Etcd {
        endpoints: Vec<String>,
        namespace: String,
    },
    /// The embedded store under this directory (one apiserver only).
    Embedded(PathBuf),
}

impl StoreConfig {
    pub async fn open(&self) -> Result<Arc<dyn Store>, StoreError> {
        Ok(match self {
            StoreConfig::Etcd {
                endpoints,
                namespace,
            } => Arc::new(EtcdStore::connect(endpoints, namespace).await?),
            StoreConfig::Embedded(dir) => Arc::new(EmbeddedStore::open(dir)?),
        })
    }
}

#[derive(Clone, Debug)]
pub struct ApiConfig {
    pub listen: SocketAddr,
    /// Lease of a node's registration; nodes heartbeat every third of it.
    pub node_ttl: Duration,
    /// Nodes a create tries before giving up.
    pub max_nodes_per_create: usize,
    /// The cluster's TLS directory (`ca.pem`, `apiserver.pem`, `apiserver.key`): TLS for
    /// clients, mTLS with nodes. None: plaintext (one machine, loopback).
    pub tls: Option<TlsDir>,
}

impl Default for ApiConfig {
    fn default() -> Self {
        ApiConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 7000)),
            node_ttl: Duration::from_secs(10),
            max_nodes_per_create: 3,
            tls: None,
        }
    }
}

/// What every service of one apiserver shares.
pub struct Shared {
    pub store: Arc<dyn Store>,
    pub iam: Iam,
    pub quotas: Quotas,
    /// Creates' reservations, committed per project in batches.
    pub reserver: Reserver,
    /// Audit records, written in batches of concurrent calls.
    pub audit_writer: PutBatcher,
    pub registry: NodeRegistry,
    pub placer: Arc<Placer>,
    pub nodes: NodeChannels,
    /// Revoked node certificates, followed by a watch.
    pub revocations: NodeRevocations,
    /// Revoked apiserver certificates, handed to nodes in Register and Heartbeat replies.
    pub apiserver_revocations: ApiserverRevocations,
    pub config: ApiConfig,
    /// The project of each sandbox this replica has seen (sandboxes never change project).
    projects: auth::ProjectCache,
    /// Sandboxes nodes report without a reservation, charged from their heartbeats.
    pub unreserved: unreserved::UnreservedCheck,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("config", &self.config)
            .finish()
    }
}

impl Shared {
    /// Starts the replica's authorization cache: call inside the tokio runtime.
    pub fn new(store: Arc<dyn Store>, config: ApiConfig) -> Arc<Self> {
        let placer = Arc::new(Placer::new(DEFAULT_CHOICES));
        Arc::new(Shared {
            iam: Iam::with_cache(store.clone(), IamCache::start(store.clone())),
            quotas: Quotas::new(store.clone()),
            reserver: Reserver::new(Quotas::new(store.clone())),
            audit_writer: PutBatcher::new(store.clone()),
            registry: NodeRegistry::new(store.clone()),
            nodes: NodeChannels::new(placer.clone(), config.tls.clone()),
            revocations: NodeRevocations::start(store.clone()),
            apiserver_revocations: ApiserverRevocations::start(store.clone()),
            placer,
            store,
            config,
            projects: auth::ProjectCache::default(),
            unreserved: unreserved::UnreservedCheck::default(),
        })
    }
}

/// A fresh control plane: organization `org` (unlimited quota) and its first user `admin`, a
/// cluster admin; returns the admin's token (shown once).
pub async fn init(store: Arc<dyn Store>, org: &str, admin: &str) -> Result<IssuedToken, String> {
    let iam = Iam::new(store.clone());
    let token = iam.bootstrap(org, admin).await.map_err(|e| e.to_string())?;
    let org_path = org
        .parse()
        .map_err(|e: crate::iam::IamError| e.to_string())?;
    Quotas::new(store)
        .set_limit(&org_path, Resources::UNLIMITED)
        .await
        .map_err(|e| e.to_string())?;
    Ok(token)
}

/// Serves the apiserver until SIGINT/SIGTERM.
pub async fn serve(store: Arc<dyn Store>, config: ApiConfig) -> Result<(), String> {
    // Read the TLS files first: a missing or wrong file stops the start with its name.
    if let Some(tls) = &config.tls {
        tls.client("apiserver", dsec_api::tls::APISERVER_NAME)
            .map_err(|e| e.to_string())?;
    }
    let shared = Shared::new(store.clone(), config.clone());
    // Client certificates are optional (token holders show none); a node's is checked
    // against the revoked list in the handshake.
    let acceptor = match &config.tls {
        Some(tls) => Some(
            tls.acceptor("apiserver", true, shared.revocations.handshake_check())
                .map_err(|e| e.to_string())?,
        ),
        None => None,
    };
    let watcher = Watcher::new(
        store,
        Arc::new(nodes::ListInventory(shared.nodes.clone())),
        Some(shared.placer.clone()),
    );
    tokio::spawn(watcher.run());
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", config.listen))?;
    let bound = listener.local_addr().unwrap_or(config.listen);
    let tls_note = if acceptor.is_some() {
        "tls"
    } else {
        "plaintext"
    };
    tracing::info!(%bound, tls = tls_note, "apiserver ready");
    println!("dsec-control ready on {bound} ({tls_note})");
    let shutdown = async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("install SIGTERM handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    };
    let router = tonic::transport::Server::builder()
        .add_service(SandboxesServer::new(sandboxes::SandboxesApi(
            shared.clone(),
        )))
        .add_service(
            ProcessServer::new(runtime::ProcessApi(shared.clone()))
                .max_decoding_message_size(16 << 20),
        )
        .add_service(
            FilesServer::new(runtime::FilesApi(shared.clone()))
                .max_decoding_message_size(16 << 20)
                .max_encoding_message_size(32 << 20),
        )
        .add_service(SessionsServer::new(runtime::SessionsApi(shared.clone())))
        .add_service(
            PortsServer::new(runtime::PortsApi(shared.clone())).max_decoding_message_size(2 << 20),
        )
        .add_service(NetworkServer::new(runtime::NetworkApi(shared.clone())))
        .add_service(NetworkLabelsServer::new(network::NetworkLabelsApi(
            shared.clone(),
        )))
        .add_service(AdminServer::new(admin::AdminApi(shared.clone())))
        .add_service(RegistryServer::new(nodes::RegistryApi(shared.clone())));
    match acceptor {
        Some(acceptor) => {
            router
                .serve_with_incoming_shutdown(
                    dsec_api::tls::accept_closable(
                        listener,
                        acceptor,
                        shared.revocations.connections(),
                    ),
                    shutdown,
                )
                .await
        }
        None => {
            router
                .serve_with_incoming_shutdown(
                    // No Nagle: a reply's second write would wait for the caller's delayed
                    // ACK (~40 ms).
                    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
                    shutdown,
                )
                .await
        }
    }
    .map_err(|e| format!("API server: {e}"))
}
