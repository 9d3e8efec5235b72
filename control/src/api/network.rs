//! `dsec.v1.NetworkLabels` through the apiserver: a label-wide policy change within the
//! caller's project, fanned out to every registered node (each selects its own sandboxes of
//! the project with those labels) and merged.

use std::collections::HashMap;
use std::sync::Arc;

use dsec_api::v1::network_labels_client::NetworkLabelsClient;
use dsec_api::v1::network_labels_server::NetworkLabels;
use dsec_api::v1::*;
use tonic::transport::Channel;
use tonic::{Code, Request, Response, Status};

use super::{auth, Shared};
use crate::iam::Action;

pub struct NetworkLabelsApi(pub Arc<Shared>);

/// What one node answered.
enum NodeAnswer {
    Changed(SetNetworkPolicyByLabelsResponse),
    /// The node refused the policy itself (INVALID_ARGUMENT): nothing changed there.
    Refused(Status),
    /// The node could not be asked; its sandboxes were not changed.
    Unreachable(String),
}

async fn on_node(
    node: String,
    channel: Channel,
    request: SetNetworkPolicyByLabelsRequest,
) -> NodeAnswer {
    let answer = NetworkLabelsClient::new(channel)
        .set_network_policy_by_labels(request)
        .await;
    match answer {
        Ok(response) => NodeAnswer::Changed(response.into_inner()),
        Err(status) if status.code() == Code::Unimplemented => NodeAnswer::Unreachable(format!(
            "node {node} does not serve label-wide policy changes (an older node): {}",
            status.message()
        )),
        Err(status) if status.code() == Code::InvalidArgument => NodeAnswer::Refused(status),
        Err(status) => NodeAnswer::Unreachable(format!("node {node}: {}", status.message())),
    }
}

/// The nodes' answers as one: changed sandboxes and failures in id order, a whole node that
/// could not be asked as a failure with an empty sandbox id; a policy the nodes refused is
/// the call's INVALID_ARGUMENT.
fn merge(answers: Vec<NodeAnswer>) -> Result<SetNetworkPolicyByLabelsResponse, Status> {
    let mut merged = SetNetworkPolicyByLabelsResponse::default();
    let mut unreachable = Vec::new();
    for answer in answers {
        match answer {
            NodeAnswer::Changed(response) => {
                merged.sandboxes.extend(response.sandboxes);
                merged.failed.extend(response.failed);
            }
            NodeAnswer::Refused(status) => return Err(status),
            NodeAnswer::Unreachable(why) => unreachable.push(why),
        }
    }
    merged.sandboxes.sort_by(|a, b| a.id.cmp(&b.id));
    merged
        .failed
        .sort_by(|a, b| a.sandbox_id.cmp(&b.sandbox_id));
    unreachable.sort();
    merged
        .failed
        .extend(unreachable.into_iter().map(|why| SetNetworkPolicyFailure {
            sandbox_id: String::new(),
            message: format!("{why} (its sandboxes were not changed; the call is safe to repeat)"),
        }));
    Ok(merged)
}

#[tonic::async_trait]
impl NetworkLabels for NetworkLabelsApi {
    async fn set_network_policy_by_labels(
        &self,
        request: Request<SetNetworkPolicyByLabelsRequest>,
    ) -> Result<Response<SetNetworkPolicyByLabelsResponse>, Status> {
        let (metadata, _, mut message) = request.into_parts();
        let project = auth::project("", &metadata)?;
        let caller = self
            .0
            .authorize(&metadata, &project, Action::SandboxNetwork)
            .await?;
        // The project label is the apiserver's: a caller reaches its own project's sandboxes.
        message.labels.remove(dsec_api::PROJECT_LABEL);
        if message.labels.is_empty() {
            return Err(Status::invalid_argument(
                "name at least one label (other than dsec.io/project) to select sandboxes by",
            ));
        }
        let target = Some(label_text(&message.labels));
        message
            .labels
            .insert(dsec_api::PROJECT_LABEL.to_string(), project.to_string());
        let mut calls = tokio::task::JoinSet::new();
        for (node, address) in self.0.placer.nodes() {
            let channel = self.0.nodes.to_address(&node, &address)?;
            calls.spawn(on_node(node, channel, message.clone()));
        }
        let mut answers = Vec::new();
        while let Some(joined) = calls.join_next().await {
            answers.push(
                joined.unwrap_or_else(|e| {
                    NodeAnswer::Unreachable(format!("a node's call failed: {e}"))
                }),
            );
        }
        let result = merge(answers).map(Response::new);
        self.0
            .audited(&caller, &project, Action::SandboxNetwork, target, result)
            .await
    }
}

fn label_text(labels: &HashMap<String, String>) -> String {
    let mut pairs: Vec<_> = labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
    pairs.sort();
    let text = format!("labels {}", pairs.join(","));
    text.chars().take(500).collect()
}
