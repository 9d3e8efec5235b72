//! What the node's operations fail with. The gRPC layer alone turns these into status codes
//! (`status::status_of`).

use std::sync::Arc;

use crate::error::EdgeError;
use crate::images::ImageError;

/// Why a node operation failed; each message says what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// A request the node cannot take as given (bad id, too many labels, a snapshot path
    /// the jailed VMM cannot reach ...).
    #[error("{0}")]
    InvalidArgument(String),
    #[error("no sandbox {id:?} on this node ({why}): list them with `dsec ls`")]
    NoSuchSandbox { id: String, why: &'static str },
    #[error("sandbox {id} is dead: {reason}. Get and Logs (`dsec logs {id}`) still show it for {minutes} minutes; create a new sandbox")]
    Dead {
        id: String,
        reason: String,
        minutes: u64,
    },
    #[error("sandbox {id} is paused: resume it first")]
    Paused { id: String },
    /// The sandbox or node is not in a state that allows the operation.
    #[error("{0}")]
    FailedPrecondition(String),
    /// The node takes no new sandboxes now (an operator is draining it): try another node.
    #[error("{0}")]
    Unavailable(String),
    /// A node budget (memory, vCPUs, pids, disk) cannot take the sandbox.
    #[error("{0}")]
    BudgetSpent(String),
    #[error("request_id {request_id:?} was already used by a Create with a different spec ({what}): a retry must repeat the request unchanged; use a fresh request_id for a new sandbox")]
    RequestIdReused { request_id: String, what: String },
    #[error("{0}")]
    Unsupported(&'static str),
    #[error(transparent)]
    Image(#[from] ImageError),
    #[error(transparent)]
    Edge(#[from] EdgeError),
    #[error(transparent)]
    Vmm(#[from] dsec_vmm_api::ControlError),
    /// The first Create with the same request_id failed with this.
    #[error(transparent)]
    FirstAttempt(Arc<NodeError>),
    /// A host operation failed (cgroups, records, copies, mounts); the message names it.
    #[error("{0}")]
    Internal(String),
}
