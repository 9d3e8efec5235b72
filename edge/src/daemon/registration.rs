//! Joining a cluster: with `--node-name NAME --control ADDR[,ADDR]` the daemon registers with
//! an apiserver (`dsec.node.v1.Registry`), heartbeats every third of its lease's TTL with
//! what it holds and runs, registers again when the apiserver answers NOT_FOUND (the lease
//! expired, e.g. after the node was cut off), moves on to the next apiserver when one cannot
//! be reached, and deregisters when it stops. While an operator drains it the node refuses
//! new sandboxes with UNAVAILABLE (the apiserver then tries another node).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dsec_api::node::v1 as pb;
use dsec_api::node::v1::registry_client::RegistryClient;
use dsec_api::tls::{error_chain, RevokedApiservers, TlsDir, APISERVER_NAME};
use tonic::transport::{Channel, Endpoint};

use super::node::Node;
use crate::backend::BackendKind;

/// Set from the last heartbeat's answer: an operator is draining this node.
static DRAINING: AtomicBool = AtomicBool::new(false);

/// Whether new sandboxes are refused because the node is being drained.
pub fn draining() -> bool {
    DRAINING.load(Ordering::Relaxed)
}

/// How long one call to an apiserver may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// Pause before trying the next apiserver after a failure.
const RETRY_PAUSE: Duration = Duration::from_millis(500);

/// Where the node registers and what it says about itself besides its sandboxes.
#[derive(Clone, Debug)]
pub struct Registration {
    pub node_name: String,
    /// Apiserver addresses (`host:port` or `http://host:port`), tried in turn.
    pub control: Vec<String>,
    /// Where the apiserver reaches this node's `dsec.v1` API.
    pub advertise: String,
    pub labels: BTreeMap<String, String>,
    /// The cluster's TLS directory: apiservers are called over mTLS and must prove they are
    /// `apiserver.dsec` under the cluster CA.
    pub tls: Option<TlsDir>,
}

/// The lease the node holds and the apiserver it got it from, for deregistering.
#[derive(Debug, Default)]
pub struct Lease {
    current: Mutex<Option<(i64, Channel)>>,
}

fn endpoint(address: &str, tls: Option<&TlsDir>) -> Result<Endpoint, String> {
    let bare = address.split_once("://").map_or(address, |(_, rest)| rest);
    let uri = match tls {
        Some(_) => format!("https://{bare}"),
        None if address.contains("://") => address.to_string(),
        None => format!("http://{address}"),
    };
    let mut endpoint = Endpoint::from_shared(uri)
        .map_err(|e| format!("bad apiserver address {address:?}: {e}"))?
        .connect_timeout(CALL_TIMEOUT)
        .timeout(CALL_TIMEOUT);
    if let Some(tls) = tls {
        let config = tls
            .client("node", APISERVER_NAME)
            .map_err(|e| e.to_string())?;
        endpoint = endpoint
            .tls_config(config)
            .map_err(|e| format!("TLS: {}", error_chain(&e)))?;
    }
    Ok(endpoint)
}

/// A failed call's message with its transport cause (a refused certificate shows up here
/// when the handshake fails on the apiserver's side).
fn describe(status: &tonic::Status) -> String {
    match std::error::Error::source(status) {
        Some(cause) => format!("{}: {}", status.message(), error_chain(cause)),
        None => status.message().to_string(),
    }
}

fn resources(sandboxes: u64, vcpus: i64, memory_mib: i64, disk_mib: i64) -> pb::Resources {
    pb::Resources {
        sandboxes,
        vcpus: vcpus.max(0) as u64,
        memory_mib: memory_mib.max(0) as u64,
        disk_mib: disk_mib.max(0) as u64,
    }
}

/// Directory images under `$DSEC_HOME/images` (layer-store images are not listed yet).
fn images(node: &Node) -> Vec<String> {
    let dir = node.config.artifacts.home.join("images");
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().is_dir())
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    names.sort();
    names
}

/// What the node reports now: capacity, what admission handed out, its sandboxes.
pub fn node_info(node: &Node, registration: &Registration) -> pb::NodeInfo {
    let budgets = node.budgets.lock().unwrap_or_else(|e| e.into_inner());
    // Sandboxes fit the pid budget at the default limit of 512 each.
    let sandbox_capacity = (budgets.pids.limit.max(0) as u64 / 512).max(1);
    let capacity = resources(
        sandbox_capacity,
        budgets.vcpus.limit,
        budgets.memory_mib.limit,
        budgets.disk_mib.limit,
    );
    let entries = node.list();
    let allocated = resources(
        entries.len() as u64,
        budgets.vcpus.reserved,
        budgets.memory_mib.reserved,
        budgets.disk_mib.reserved,
    );
    drop(budgets);
    let running = entries
        .iter()
        .map(|entry| {
            let record = entry.record();
            pb::RunningSandbox {
                id: record.handle.id.clone(),
                project: record
                    .labels
                    .get(dsec_api::PROJECT_LABEL)
                    .cloned()
                    .unwrap_or_default(),
                resources: Some(resources(
                    1,
                    record.vcpus as i64,
                    record.memory_mib,
                    record.disk_mib,
                )),
            }
        })
        .collect();
    let mut backends = vec![BackendKind::Container.as_str().to_string()];
    if node.microvm_unavailable.is_none() {
        backends.push(BackendKind::MicroVm.as_str().to_string());
    }
    pb::NodeInfo {
        name: registration.node_name.clone(),
        address: registration.advertise.clone(),
        capacity: Some(capacity),
        allocated: Some(allocated),
        backends,
        images: images(node),
        labels: registration.labels.clone().into_iter().collect(),
        running,
    }
}

/// Registers and heartbeats until the process ends.
pub async fn run(
    node: Arc<Node>,
    registration: Registration,
    lease: Arc<Lease>,
    revoked: Arc<RevokedApiservers>,
) {
    let mut next = 0usize;
    loop {
        let address = registration.control[next % registration.control.len()].clone();
        next += 1;
        match serve_one(&node, &registration, &address, &lease, &revoked).await {
            Ok(()) => {}
            Err(why) => {
                tracing::warn!(apiserver = %address, %why, "cluster registration: trying the next apiserver");
                tokio::time::sleep(RETRY_PAUSE).await;
            }
        }
    }
}

/// Registers with one apiserver and heartbeats; returns Ok to register again (lease gone),
/// Err when that apiserver cannot be reached.
async fn serve_one(
    node: &Arc<Node>,
    registration: &Registration,
    address: &str,
    lease: &Lease,
    revoked: &RevokedApiservers,
) -> Result<(), String> {
    let channel = endpoint(address, registration.tls.as_ref())?
        .connect()
        .await
        .map_err(|e| {
            let why = error_chain(&e);
            if registration.tls.is_some() && why.contains("certificate") {
                format!("TLS handshake refused ({why}): the apiserver and this node must hold certificates of the same cluster CA (`dsec control issue-node`)")
            } else {
                format!("cannot connect: {why}")
            }
        })?;
    let mut client = RegistryClient::new(channel.clone());
    let registered = client
        .register(pb::RegisterRequest {
            node: Some(node_info(node, registration)),
        })
        .await
        .map_err(|s| {
            let why = describe(&s);
            if registration.tls.is_some() && why.contains("connection closed") {
                format!("register: {why} (the apiserver closed the TLS connection: it refuses certificates not issued by its cluster CA; issue this node's with `dsec control issue-node`)")
            } else {
                format!("register: {why}")
            }
        })?
        .into_inner();
    note_revoked(revoked, registered.revoked_apiservers);
    *lease.current.lock().unwrap_or_else(|e| e.into_inner()) =
        Some((registered.lease_id, channel.clone()));
    tracing::info!(apiserver = %address, lease = registered.lease_id, ttl_s = registered.ttl_seconds, "registered with the cluster");
    let interval = Duration::from_millis(u64::from(registered.heartbeat_interval_ms).max(100));
    loop {
        tokio::time::sleep(interval).await;
        let beat = client
            .heartbeat(pb::HeartbeatRequest {
                lease_id: registered.lease_id,
                node: Some(node_info(node, registration)),
            })
            .await;
        match beat {
            Ok(reply) => {
                let reply = reply.into_inner();
                DRAINING.store(reply.draining, Ordering::Relaxed);
                note_revoked(revoked, reply.revoked_apiservers);
            }
            Err(status) if status.code() == tonic::Code::NotFound => {
                tracing::warn!(apiserver = %address, "lease gone: registering again");
                return Ok(());
            }
            Err(status) => return Err(format!("heartbeat: {}", describe(&status))),
        }
    }
}

/// Takes the revoked apiserver list of a reply; logs the connections it closed.
fn note_revoked(revoked: &RevokedApiservers, entries: Vec<String>) {
    let closed = revoked.update(entries);
    if closed > 0 {
        tracing::warn!(
            closed,
            "closed API connections of revoked apiserver certificates"
        );
    }
}

/// Leaves the cluster at once (best effort; the lease would expire anyway).
pub async fn deregister(lease: &Lease) {
    let current = lease
        .current
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take();
    if let Some((lease_id, channel)) = current {
        let mut client = RegistryClient::new(channel);
        let _ = tokio::time::timeout(
            CALL_TIMEOUT,
            client.deregister(pb::DeregisterRequest { lease_id }),
        )
        .await;
    }
}
