//! Who did what: one record per call, filed under the organization, in time order.

use serde::{Deserialize, Serialize};

use super::model::{Action, PrincipalId, ProjectPath};

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum Outcome {
    Allowed,
    /// Refused by authorization (the reason is the error's message).
    Denied {
        reason: String,
    },
    /// Authorized, then failed (quota, placement, the node).
    Failed {
        reason: String,
    },
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditRecord {
    pub at_ms: u64,
    pub principal: PrincipalId,
    /// The token the call came with (its id, never its secret).
    pub token_id: Option<String>,
    pub project: ProjectPath,
    pub action: Action,
    /// The object acted on, e.g. a sandbox id or a subproject.
    pub target: Option<String>,
    pub outcome: Outcome,
}
