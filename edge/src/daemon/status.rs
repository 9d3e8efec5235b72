//! How node errors and agent errors reach gRPC clients: the one place that picks status
//! codes (NOT_FOUND, INVALID_ARGUMENT, RESOURCE_EXHAUSTED, FAILED_PRECONDITION ...; the
//! contract is at the top of api/proto/dsec.proto).

use std::time::Duration;

use tonic::Status;

use super::error::NodeError;
use super::node::Node;
use super::record::Entry;
use crate::error::EdgeError;
use crate::images::ImageError;
use dsec_vmm_api::ControlError;

/// Agent failures: its own status codes pass through; transport failures become UNAVAILABLE.
pub(crate) fn agent_status(id: &str, status: Status) -> Status {
    match status.code() {
        tonic::Code::Unavailable | tonic::Code::Unknown
            if status.message().contains("transport") || status.message().contains("connect") =>
        {
            Status::unavailable(format!(
                "cannot reach the agent of sandbox {id}: {}",
                status.message()
            ))
        }
        _ => status,
    }
}

/// The status code and message a node error reaches clients with.
pub fn status_of(err: &NodeError) -> Status {
    let text = err.to_string();
    match err {
        NodeError::InvalidArgument(_) => Status::invalid_argument(text),
        NodeError::NoSuchSandbox { .. } => Status::not_found(text),
        NodeError::Dead { .. } | NodeError::Paused { .. } | NodeError::FailedPrecondition(_) => {
            Status::failed_precondition(text)
        }
        NodeError::BudgetSpent(_) => Status::resource_exhausted(text),
        NodeError::Unavailable(_) => Status::unavailable(text),
        NodeError::RequestIdReused { .. } => Status::already_exists(text),
        NodeError::Unsupported(_) => Status::unimplemented(text),
        NodeError::Image(e) => match e {
            ImageError::InvalidName { .. } => Status::invalid_argument(text),
            ImageError::NotFound { .. } => Status::not_found(text),
            ImageError::Store { .. } => Status::failed_precondition(text),
            ImageError::StoreUnreachable { .. } => Status::failed_precondition(text),
            ImageError::Mount { .. } => Status::internal(text),
        },
        NodeError::Edge(e) => match e {
            EdgeError::InvalidSpec(_) => Status::invalid_argument(text),
            EdgeError::MissingArtifact { .. } => Status::not_found(text),
            EdgeError::MissingBinary { .. } | EdgeError::BackendUnavailable { .. } => {
                Status::failed_precondition(text)
            }
            EdgeError::AgentNotReady { .. } => Status::deadline_exceeded(text),
            EdgeError::Agent { code, message, .. } => Status::new(*code, message.clone()),
            EdgeError::Connect(_) => Status::unavailable(text),
            _ => Status::internal(text),
        },
        NodeError::Vmm(e) => match e {
            ControlError::Refused { .. } => Status::failed_precondition(text),
            ControlError::Timeout { .. } => Status::deadline_exceeded(text),
            ControlError::Connect { .. }
            | ControlError::Io { .. }
            | ControlError::Closed { .. } => Status::unavailable(text),
            ControlError::ReplyTooLong { .. } | ControlError::Malformed { .. } => {
                Status::internal(text)
            }
        },
        NodeError::FirstAttempt(first) => status_of(first),
        NodeError::Internal(_) => Status::internal(text),
    }
}

impl From<NodeError> for Status {
    fn from(err: NodeError) -> Self {
        status_of(&err)
    }
}

impl Node {
    /// [`agent_error`](Self::agent_error) for a sandbox named by id (a status as is when the
    /// sandbox is gone).
    pub fn call_error(&self, id: &str, status: Status) -> Status {
        match self.lock().get(id).cloned() {
            Some(entry) => self.agent_error(&entry, status),
            None => status,
        }
    }

    /// An agent call's error in terms of the sandbox: FAILED_PRECONDITION naming why it died
    /// when it did (instead of a transport error), else the agent's status.
    pub fn agent_error(&self, entry: &Entry, status: Status) -> Status {
        let id = entry.id();
        let text = status.message();
        let broken = matches!(
            status.code(),
            tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Internal
        ) && ["h2 protocol", "transport", "connect", "broken pipe"]
            .iter()
            .any(|w| text.contains(w));
        if broken && entry.death.get().is_none() {
            // The connection broke first; the dying process may take a moment to show as
            // dead (its namespace is torn down before it becomes a zombie).
            let dead = || !entry.record().is_alive();
            let wait = || {
                for _ in 0..100 {
                    if dead() {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
            };
            match tokio::runtime::Handle::try_current() {
                Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
                    tokio::task::block_in_place(wait)
                }
                _ => wait(),
            }
        }
        match self.death_reason(entry) {
            Some(reason) => status_of(&super::node::dead(&id, reason)),
            None => agent_status(&id, status),
        }
    }
}
