//! Where each record lives in the store. Every key starts with `/dsec/`; a prefix range over a
//! folder lists its records.

use crate::iam::{PrincipalId, ProjectPath};

pub const ROOT: &str = "/dsec/";

/// The folders an apiserver's authorization cache follows.
pub const PROJECTS: &str = "/dsec/projects/";
pub const PRINCIPALS: &str = "/dsec/principals/";
pub const BINDINGS: &str = "/dsec/bindings/";
pub const TOKENS: &str = "/dsec/tokens/";

pub fn project(path: &ProjectPath) -> String {
    format!("/dsec/projects/{path}")
}

/// Every project strictly under `path`.
pub fn projects_under(path: &ProjectPath) -> String {
    format!("/dsec/projects/{path}/")
}

pub fn principal(id: &PrincipalId) -> String {
    format!("/dsec/principals/{id}")
}

pub fn binding(principal: &PrincipalId, project: &ProjectPath) -> String {
    format!("/dsec/bindings/{principal}/{project}")
}

pub fn bindings_of(principal: &PrincipalId) -> String {
    format!("/dsec/bindings/{principal}/")
}

pub fn token(id: &str) -> String {
    format!("/dsec/tokens/{id}")
}

/// Index: the tokens of one principal (value: empty).
pub fn principal_token(principal: &PrincipalId, id: &str) -> String {
    format!("/dsec/principal-tokens/{principal}/{id}")
}

pub fn principal_tokens(principal: &PrincipalId) -> String {
    format!("/dsec/principal-tokens/{principal}/")
}

/// Audit records of an organization sort by time.
pub fn audit(org: &str, at_ms: u64, unique: &str) -> String {
    format!("/dsec/audit/{org}/{at_ms:016}-{unique}")
}

pub fn audit_of(org: &str) -> String {
    format!("/dsec/audit/{org}/")
}

pub fn quota(path: &ProjectPath) -> String {
    format!("/dsec/quota/{path}")
}

pub const QUOTAS: &str = "/dsec/quota/";

/// The quota a sandbox holds, filed under its node so that a lost node's are found at once.
pub fn reservation(node: &str, sandbox: &str) -> String {
    format!("/dsec/reservations/{node}/{sandbox}")
}

pub fn reservations_on(node: &str) -> String {
    format!("/dsec/reservations/{node}/")
}

pub const RESERVATIONS: &str = "/dsec/reservations/";

/// A sandbox deleted through the API (value: when, ms): a node listing taken before the
/// delete must not charge it again. Removed after [`crate::quota::DELETED_KEPT`].
pub fn deleted(node: &str, sandbox: &str) -> String {
    format!("/dsec/deleted/{node}/{sandbox}")
}

pub const DELETED: &str = "/dsec/deleted/";

/// A node's registration, attached to its lease.
pub fn node(name: &str) -> String {
    format!("/dsec/nodes/{name}")
}

pub const NODES: &str = "/dsec/nodes/";

/// Operator state of a node (cordoned, draining): outlives its lease.
pub fn node_admin(name: &str) -> String {
    format!("/dsec/node-admin/{name}")
}

pub const NODE_ADMIN: &str = "/dsec/node-admin/";

/// A sandbox whose node vanished.
pub fn lost(sandbox: &str) -> String {
    format!("/dsec/lost/{sandbox}")
}

pub const LOST: &str = "/dsec/lost/";

/// Revoked certificates of a node (outlives its lease).
pub fn revoked_node(name: &str) -> String {
    format!("/dsec/revoked-nodes/{name}")
}

pub const REVOKED_NODES: &str = "/dsec/revoked-nodes/";

/// A revoked apiserver certificate: its fingerprint or a replica name.
pub fn revoked_apiserver(entry: &str) -> String {
    format!("/dsec/revoked-apiservers/{entry}")
}

pub const REVOKED_APISERVERS: &str = "/dsec/revoked-apiservers/";
