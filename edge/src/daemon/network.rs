//! Network policies on the node: validation of the API's `NetworkPolicy`, live changes
//! (`Network.SetNetworkPolicy`) and the policies of adopted sandboxes.

use std::net::Ipv4Addr;
use std::sync::Arc;

use dsec_api::v1::{
    self as api, NetworkPolicy, SetNetworkPolicyByLabelsRequest, SetNetworkPolicyByLabelsResponse,
    SetNetworkPolicyFailure, SetNetworkPolicyRequest,
};
use tonic::{Request, Response, Status};

use super::error::NodeError;
use super::node::Node;
use super::record::{append_event, Entry, Record};
use crate::backend::BackendKind;
use crate::net::{Policy, PolicyText};

fn text_of(network: &NetworkPolicy) -> PolicyText {
    PolicyText {
        allow: network.allow.clone(),
        deny: network.deny.clone(),
    }
}

/// The policy a sandbox of `kind` gets from `network`: INVALID_ARGUMENT for malformed rules
/// and unknown names; UNIMPLEMENTED for a non-empty policy where nothing can enforce it.
pub fn resolve(
    node: &Node,
    kind: BackendKind,
    network: &NetworkPolicy,
) -> Result<Policy, NodeError> {
    let empty = !network.allow_internet && network.allow.is_empty() && network.deny.is_empty();
    let Some(net) = node
        .edge
        .network
        .as_ref()
        .filter(|_| kind != BackendKind::MicroVm || node.edge.jail.is_some())
    else {
        if empty {
            return Ok(Policy::default());
        }
        return Err(NodeError::Unsupported(
            "network egress needs a node started as root with a sandbox network (`dsec up --net-bridge dsec0`); without it sandboxes have loopback only, so allow_internet, allow and deny rules cannot be enforced: leave the network policy empty (servers inside a sandbox are reachable through Ports.Open and the node's HTTP entry point)",
        ));
    };
    let count = network.allow.len() + network.deny.len();
    if count > crate::net::policy::MAX_RULES {
        // Before parsing 100,000 strings.
        return Err(NodeError::InvalidArgument(
            crate::net::PolicyError::TooManyRules { count }.to_string(),
        ));
    }
    net.resolve(network.allow_internet, &text_of(network))
        .map_err(|e| NodeError::InvalidArgument(e.to_string()))
}

/// The policy recorded for a sandbox, resolved against today's named policies (an unknown
/// name now denies everything it would have allowed).
pub(super) fn recorded_policy(node: &Node, record: &Record) -> Policy {
    let Some(net) = &node.edge.network else {
        return Policy::default();
    };
    let text = PolicyText {
        allow: record.allow.clone(),
        deny: record.deny.clone(),
    };
    net.resolve(record.allow_internet, &text)
        .unwrap_or_else(|err| {
            tracing::warn!(sandbox = %record.handle.id, %err, "recorded network policy no longer resolves; denying everything");
            Policy::default()
        })
}

impl Node {
    /// Replaces a running sandbox's network policy (see `Network::set_policy`).
    pub async fn set_network_policy(
        &self,
        id: &str,
        network: NetworkPolicy,
    ) -> Result<Arc<Entry>, NodeError> {
        let entry = self.get(id)?;
        let record = entry.record();
        let kind = if record.handle.backend == BackendKind::MicroVm.as_str() {
            BackendKind::MicroVm
        } else {
            BackendKind::Container
        };
        let policy = resolve(self, kind, &network)?;
        if let Some(net) = self.edge.network.clone() {
            let addr: Option<Ipv4Addr> = crate::net::address(&record.handle.dir);
            let Some(addr) = addr else {
                return Err(NodeError::FailedPrecondition(format!(
                    "sandbox {id} has no network interface (a sandbox created before this node had a sandbox network, or restored from a snapshot of one, has none): create a new one"
                )));
            };
            let asked = std::time::Instant::now();
            tokio::task::spawn_blocking(move || {
                let queued_us = asked.elapsed().as_micros() as u64;
                let result = net.set_policy(addr, &policy);
                // Where a live change waits before its own work (the benchmark reads this).
                tracing::debug!(
                    queued_us,
                    applied_us = asked.elapsed().as_micros() as u64,
                    "policy change applied"
                );
                result
            })
            .await
            .map_err(|e| NodeError::Internal(format!("network policy task failed: {e}")))?
            .map_err(|e| NodeError::Internal(format!("cannot apply the network policy: {e}")))?;
        }
        {
            let mut r = entry.record.lock().unwrap_or_else(|e| e.into_inner());
            r.allow_internet = network.allow_internet;
            r.allow = network.allow.clone();
            r.deny = network.deny.clone();
            r.persist()
                .map_err(|e| NodeError::Internal(e.to_string()))?;
            append_event(
                &r.handle.dir,
                &format!(
                    "network policy set: allow_internet={} allow={:?} deny={:?}",
                    network.allow_internet, network.allow, network.deny
                ),
            );
        }
        entry.touch();
        Ok(entry)
    }
}

/// How often the packets the policies rejected are written to the sandboxes' event logs.
const DENIED_REPORT_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// Writes, every few seconds, how many packets each sandbox's policy rejected since the
/// last look to its event log (the counters of `dsec_sandbox_network_denied_packets_total`).
pub async fn report_denied(node: Arc<Node>) {
    let Some(net) = node.edge.network.clone() else {
        return;
    };
    let mut last: std::collections::HashMap<Ipv4Addr, u64> = Default::default();
    let mut tick = tokio::time::interval(DENIED_REPORT_EVERY);
    loop {
        tick.tick().await;
        let reader = net.clone();
        let denied = match tokio::task::spawn_blocking(move || reader.denied_packets()).await {
            Ok(Ok(denied)) => denied,
            _ => continue,
        };
        let mut seen = std::collections::HashMap::with_capacity(denied.len());
        for (addr, total) in denied {
            // A policy change rewrites the chain and starts its counters at 0.
            let before = last
                .get(&addr)
                .copied()
                .filter(|b| *b <= total)
                .unwrap_or(0);
            if total > before {
                if let Some(dir) = net.sandbox_dir(addr) {
                    append_event(
                        &dir,
                        &format!(
                            "network: {} packets denied by the policy ({total} since it was set)",
                            total - before
                        ),
                    );
                }
            }
            seen.insert(addr, total);
        }
        last = seen;
    }
}

// ------------------------------------------------------------------ Network service

pub struct NetworkService(pub Arc<Node>);

#[tonic::async_trait]
impl api::network_server::Network for NetworkService {
    async fn set_network_policy(
        &self,
        request: Request<SetNetworkPolicyRequest>,
    ) -> Result<Response<api::Sandbox>, Status> {
        let r = request.into_inner();
        let entry = self
            .0
            .set_network_policy(&r.sandbox_id, r.network.unwrap_or_default())
            .await?;
        Ok(Response::new(super::grpc::sandbox_proto(&self.0, &entry)))
    }
}

#[tonic::async_trait]
impl api::network_labels_server::NetworkLabels for NetworkService {
    async fn set_network_policy_by_labels(
        &self,
        request: Request<SetNetworkPolicyByLabelsRequest>,
    ) -> Result<Response<SetNetworkPolicyByLabelsResponse>, Status> {
        let r = request.into_inner();
        if r.labels.is_empty() {
            return Err(Status::invalid_argument(
                "labels is empty: give at least one label (SetNetworkPolicy changes one sandbox)",
            ));
        }
        super::limits::check_labels("labels", r.labels.iter())?;
        let network = r.network.unwrap_or_default();
        // Checked once, before any sandbox changes (the backend only matters for nodes
        // without a network for microVMs, reported per sandbox below).
        resolve(&self.0, BackendKind::Container, &network)?;
        let mut matching: Vec<(String, Arc<Entry>)> = self
            .0
            .list()
            .into_iter()
            .filter(|e| {
                let labels = e.record().labels;
                r.labels.iter().all(|(k, v)| labels.get(k) == Some(v))
            })
            .map(|e| (e.id(), e))
            .collect();
        matching.sort_by(|a, b| a.0.cmp(&b.0));
        let mut response = SetNetworkPolicyByLabelsResponse::default();
        for (id, _) in matching {
            match self.0.set_network_policy(&id, network.clone()).await {
                Ok(entry) => {
                    // Tokens go to callers naming one sandbox, as in List.
                    let mut sandbox = super::grpc::sandbox_proto(&self.0, &entry);
                    sandbox.access_token.clear();
                    response.sandboxes.push(sandbox);
                }
                // Deleted meanwhile.
                Err(NodeError::NoSuchSandbox { .. } | NodeError::Dead { .. }) => {}
                Err(err) => response.failed.push(SetNetworkPolicyFailure {
                    sandbox_id: id,
                    message: err.to_string(),
                }),
            }
        }
        Ok(Response::new(response))
    }
}
