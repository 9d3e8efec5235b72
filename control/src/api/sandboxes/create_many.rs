//! `Sandboxes.CreateMany` through the apiserver: every create of the call is placed first,
//! alike creates in chunks of up to [`NODE_CHUNK`] per node (power of k choices for the
//! chunk; each create counts as in flight), the creates are grouped by node and each group
//! goes to its node as one node-side CreateMany while (or after) the group's reservations
//! are queued at once. A create its
//! node refuses (full, going away) is placed again on another node in the next round, up to
//! `max_nodes_per_create` rounds, as a lone create retries.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use dsec_api::sandbox_id::SandboxId;
use dsec_api::v1::sandboxes_client::SandboxesClient;
use dsec_api::v1::*;
use tonic::{Response, Status};

use super::{prepare, Prepared, SandboxesApi, Shared};
use crate::iam::ProjectPath;
use crate::placement::{PlacementError, Ticket};
use crate::quota::{QuotaResult, Reservation};
use crate::resources::Resources;

/// Alike creates (same size, backend, image and node labels) placed on one node together:
/// the node gets them in one call, at the cost of spreading in steps of this many.
const NODE_CHUNK: usize = 8;

/// One create of the call, with the nodes that refused it so far.
struct Item {
    index: usize,
    prepared: Prepared,
    refused: Vec<String>,
    reasons: Vec<String>,
}

impl Item {
    /// The create's error when no node is left to try: as a lone create's.
    fn unplaced(&self, pick_error: Option<PlacementError>) -> Status {
        match pick_error {
            Some(e) if self.refused.is_empty() => e.into(),
            _ => PlacementError::AllRefused(self.reasons.join("; ")).into(),
        }
    }
}

/// How one create of a node's group ended.
enum Outcome {
    Placed(Box<Sandbox>),
    /// The node's own admission said no: another node may take it.
    Refused(String),
    Failed(Status),
}

impl SandboxesApi {
    /// The creates of one CreateMany (one project), one result per request in its order.
    pub(super) async fn create_batch(
        &self,
        requests: Vec<CreateSandboxRequest>,
        project: &ProjectPath,
    ) -> Vec<Result<Sandbox, Status>> {
        let shared = &self.0;
        let mut results: Vec<Option<Result<Sandbox, Status>>> =
            (0..requests.len()).map(|_| None).collect();
        let mut pending = Vec::with_capacity(requests.len());
        for (index, request) in requests.into_iter().enumerate() {
            match prepare(request, project) {
                Ok(prepared) => pending.push(Item {
                    index,
                    prepared,
                    refused: Vec::new(),
                    reasons: Vec::new(),
                }),
                Err(status) => results[index] = Some(Err(status)),
            }
        }
        for _ in 0..shared.config.max_nodes_per_create.max(1) {
            if pending.is_empty() {
                break;
            }
            // Place the whole round first, in chunks of alike creates (one node per chunk),
            // then group by node.
            let mut groups: BTreeMap<String, Vec<(Item, Ticket<'_>)>> = BTreeMap::new();
            let mut unplaced: VecDeque<Item> = pending.drain(..).collect();
            while let Some(first) = unplaced.front() {
                let alike = unplaced
                    .iter()
                    .take(NODE_CHUNK)
                    .take_while(|i| {
                        i.prepared.placement == first.prepared.placement
                            && i.refused == first.refused
                    })
                    .count();
                let mut size = alike;
                let picked = loop {
                    match shared
                        .placer
                        .pick_many(&first.prepared.placement, size, &first.refused)
                    {
                        Ok(tickets) => break Ok(tickets),
                        // No node has room for the whole chunk: a smaller one may fit.
                        Err(_) if size > 1 => size /= 2,
                        Err(e) => break Err(e),
                    }
                };
                match picked {
                    Ok(tickets) => {
                        for ticket in tickets {
                            let Some(item) = unplaced.pop_front() else {
                                break;
                            };
                            groups
                                .entry(ticket.node().to_string())
                                .or_default()
                                .push((item, ticket));
                        }
                    }
                    Err(e) => {
                        if let Some(item) = unplaced.pop_front() {
                            results[item.index] = Some(Err(item.unplaced(Some(e))));
                        }
                    }
                }
            }
            let mut calls = tokio::task::JoinSet::new();
            for (node, group) in &groups {
                let creates: Vec<(CreateSandboxRequest, Resources)> = group
                    .iter()
                    .map(|(item, _)| (item.prepared.request.clone(), item.prepared.quota))
                    .collect();
                let (shared, node, project) = (shared.clone(), node.clone(), project.clone());
                calls.spawn(async move {
                    let outcomes = create_on(shared, &node, &project, creates).await;
                    (node, outcomes)
                });
            }
            while let Some(joined) = calls.join_next().await {
                let (node, outcomes) = match joined {
                    Ok(done) => done,
                    Err(e) => {
                        tracing::error!(%e, "a node's part of a CreateMany panicked");
                        continue;
                    }
                };
                let Some(group) = groups.remove(&node) else {
                    continue;
                };
                for ((mut item, ticket), outcome) in group.into_iter().zip(outcomes) {
                    match outcome {
                        Outcome::Placed(sandbox) => {
                            ticket.commit();
                            shared.remember_project(&sandbox.id, project);
                            results[item.index] = Some(Ok(*sandbox));
                        }
                        Outcome::Refused(why) => {
                            item.reasons.push(format!("{node}: {why}"));
                            item.refused.push(node.clone());
                            pending.push(item);
                        }
                        Outcome::Failed(status) => results[item.index] = Some(Err(status)),
                    }
                }
            }
            // A group whose task panicked: its creates failed (their tickets drop here).
            for (_, group) in std::mem::take(&mut groups) {
                for (item, _) in group {
                    results[item.index] = Some(Err(Status::internal(
                        "a node's part of a CreateMany panicked: see the apiserver's log",
                    )));
                }
            }
        }
        for item in pending {
            results[item.index] = Some(Err(item.unplaced(None)));
        }
        results
            .into_iter()
            .map(|r| {
                r.unwrap_or_else(|| Err(Status::internal("a create of CreateMany got no result")))
            })
            .collect()
    }
}

/// One node's group: fresh ids naming the node, the group's reservations queued at once and
/// the node's CreateMany (at the same time when the project's quota, as this replica last
/// wrote it, has room for the whole group; else the reservations first and only the reserved
/// creates to the node). One outcome per create, in order.
async fn create_on(
    shared: Arc<Shared>,
    node: &str,
    project: &ProjectPath,
    mut creates: Vec<(CreateSandboxRequest, Resources)>,
) -> Vec<Outcome> {
    let count = creates.len();
    for (request, _) in &mut creates {
        match SandboxId::new(node) {
            Ok(id) => request.sandbox_id = id.to_string(),
            Err(e) => {
                return (0..count)
                    .map(|_| Outcome::Failed(Status::internal(e.to_string())))
                    .collect()
            }
        }
    }
    let claims: Vec<(String, Resources)> = creates
        .iter()
        .map(|(request, quota)| (request.sandbox_id.clone(), *quota))
        .collect();
    let total = claims
        .iter()
        .fold(Resources::ZERO, |sum, (_, quota)| sum.plus(*quota));
    let requests: Vec<CreateSandboxRequest> = creates.into_iter().map(|(r, _)| r).collect();
    let ids: Vec<String> = requests.iter().map(|r| r.sandbox_id.clone()).collect();
    let overlapped = shared.reserver.likely_fits(project, total);
    let (reserved, created): (Vec<QuotaResult<Reservation>>, Vec<Result<Sandbox, Status>>) =
        if overlapped {
            tokio::join!(
                shared.reserver.reserve_many(project, node, claims),
                node_create_many(&shared, node, requests)
            )
        } else {
            let reserved = shared.reserver.reserve_many(project, node, claims).await;
            let to_node: Vec<CreateSandboxRequest> = requests
                .into_iter()
                .zip(&reserved)
                .filter(|(_, r)| r.is_ok())
                .map(|(request, _)| request)
                .collect();
            let mut made = node_create_many(&shared, node, to_node).await.into_iter();
            let created = reserved
                .iter()
                .map(|r| match r {
                    Ok(_) => made.next().unwrap_or_else(|| {
                        Err(Status::internal(
                            "the node answered fewer creates than asked",
                        ))
                    }),
                    // Not sent: the reservation's error decides below.
                    Err(_) => Err(Status::aborted("not sent")),
                })
                .collect();
            (reserved, created)
        };
    let api = SandboxesApi(shared.clone());
    let mut outcomes = Vec::with_capacity(count);
    for ((id, reserved), created) in ids.iter().zip(reserved).zip(created) {
        let outcome = match (reserved, created) {
            (Ok(_), Ok(sandbox)) => Outcome::Placed(Box::new(sandbox)),
            // A reconcile that listed the node between its create and the commit charged
            // the sandbox already (the key made the commit fail): that is its reservation.
            (Err(_), Ok(sandbox)) if api.charged_already(node, id).await => {
                Outcome::Placed(Box::new(sandbox))
            }
            (Err(e), Ok(_)) => {
                api.undo_create(node, id).await;
                Outcome::Failed(e.into())
            }
            (Err(e), Err(_)) => Outcome::Failed(e.into()),
            (Ok(_), Err(status)) => {
                if let Err(e) = shared.quotas.release(node, id).await {
                    tracing::warn!(sandbox = %id, %e, "cannot return the quota of a failed create; the watcher will");
                }
                match status.code() {
                    tonic::Code::ResourceExhausted | tonic::Code::Unavailable => {
                        Outcome::Refused(status.message().to_string())
                    }
                    _ => Outcome::Failed(status),
                }
            }
        };
        if let Outcome::Placed(sandbox) = &outcome {
            shared.unreserved.reserved(node, &sandbox.id);
        }
        outcomes.push(outcome);
    }
    tracing::debug!(node, count, overlapped, "CreateMany group answered");
    outcomes
}

/// The node's CreateMany of `requests`, one result per request; a call that fails as a
/// whole (node unreachable) fails each create with its status.
async fn node_create_many(
    shared: &Shared,
    node: &str,
    requests: Vec<CreateSandboxRequest>,
) -> Vec<Result<Sandbox, Status>> {
    let count = requests.len();
    if count == 0 {
        return Vec::new();
    }
    let answered = match shared.nodes.to_node(node) {
        Ok(channel) => SandboxesClient::new(channel)
            .create_many(CreateSandboxesRequest {
                requests,
                project: String::new(),
            })
            .await
            .map(Response::into_inner)
            .map_err(|status| crate::api::nodes::unanswered(node, status)),
        Err(status) => Err(status),
    };
    match answered {
        Ok(answer) if answer.results.len() == count => answer
            .results
            .into_iter()
            .map(CreateSandboxResult::into_result)
            .collect(),
        Ok(answer) => {
            let why = format!(
                "node {node} answered {} results to a CreateMany of {count}",
                answer.results.len()
            );
            (0..count)
                .map(|_| Err(Status::internal(why.clone())))
                .collect()
        }
        Err(status) => (0..count)
            .map(|_| Err(Status::new(status.code(), status.message())))
            .collect(),
    }
}
