//! Who calls and on what: the bearer token of a call, the project it names, and the project of
//! a sandbox named by id (cached; asked of its node the first time, no store lookup).

use std::collections::HashMap;
use std::sync::Mutex;

use dsec_api::sandbox_id::SandboxId;
use dsec_api::v1::sandboxes_client::SandboxesClient;
use dsec_api::v1::GetSandboxRequest;
use tonic::metadata::MetadataMap;
use tonic::transport::Channel;
use tonic::Status;

use super::Shared;
use crate::iam::{Action, AuditRecord, Caller, Iam, Outcome, ProjectPath};
use crate::now_ms;

/// Metadata a client may name its project in when the request has no field for it.
pub const PROJECT_METADATA: &str = "x-dsec-project";
/// Sandboxes whose project one replica remembers; past this the cache starts over.
const PROJECT_CACHE_MAX: usize = 200_000;

/// The token of a call: `authorization: Bearer TOKEN`.
pub fn bearer(metadata: &MetadataMap) -> Result<String, Status> {
    let value = metadata
        .get("authorization")
        .ok_or_else(|| {
            Status::unauthenticated(
                "no API token: send `authorization: Bearer TOKEN` (the SDKs read DSEC_TOKEN; `dsec login`)",
            )
        })?
        .to_str()
        .map_err(|_| Status::unauthenticated("the authorization metadata is not ASCII"))?;
    let token = value
        .strip_prefix("Bearer ")
        .or_else(|| value.strip_prefix("bearer "))
        .ok_or_else(|| {
            Status::unauthenticated("the authorization metadata must read `Bearer TOKEN`")
        })?;
    Ok(token.trim().to_string())
}

/// The project a call names: its field, else the `x-dsec-project` metadata.
pub fn project(field: &str, metadata: &MetadataMap) -> Result<ProjectPath, Status> {
    let text = if field.is_empty() {
        metadata
            .get(PROJECT_METADATA)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
    } else {
        field
    };
    if text.is_empty() {
        return Err(Status::invalid_argument(
            "the call names no project: set the request's project (the SDKs send $DSEC_PROJECT) or the x-dsec-project metadata",
        ));
    }
    text.parse()
        .map_err(|e: crate::iam::IamError| Status::invalid_argument(e.to_string()))
}

#[derive(Debug, Default)]
pub struct ProjectCache(Mutex<HashMap<String, ProjectPath>>);

impl ProjectCache {
    pub fn get(&self, id: &str) -> Option<ProjectPath> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(id)
            .cloned()
    }

    pub fn insert(&self, id: &str, project: ProjectPath) {
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if map.len() >= PROJECT_CACHE_MAX {
            map.clear();
        }
        map.insert(id.to_string(), project);
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn forget(&self, id: &str) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).remove(id);
    }
}

/// An authorized call on one sandbox: where it lives and who asked.
#[derive(Debug)]
pub struct Route {
    pub node: String,
    pub channel: Channel,
    pub project: ProjectPath,
    pub caller: Caller,
}

impl Shared {
    /// Authenticates, finds the sandbox's node from its id and its project (cache, else the
    /// node's Get), and authorizes `action` there.
    pub async fn route(
        &self,
        metadata: &MetadataMap,
        id: &str,
        action: Action,
    ) -> Result<Route, Status> {
        let token = bearer(metadata)?;
        self.iam.authenticate(&token).await?;
        let node = id
            .parse::<SandboxId>()
            .map_err(|e| Status::invalid_argument(e.to_string()))?
            .node()
            .to_string();
        let channel = self.nodes.to_node(&node)?;
        let project = match self.projects.get(id) {
            Some(project) => project,
            None => {
                let sandbox = SandboxesClient::new(channel.clone())
                    .get(GetSandboxRequest {
                        sandbox_id: id.to_string(),
                    })
                    .await?
                    .into_inner();
                let project: ProjectPath = sandbox.project.parse().map_err(|_| {
                    Status::not_found(format!(
                        "sandbox {id} belongs to no project: it was not made through the apiserver"
                    ))
                })?;
                self.projects.insert(id, project.clone());
                project
            }
        };
        let caller = self.iam.authorize(&token, &project, action).await?;
        Ok(Route {
            node,
            channel,
            project,
            caller,
        })
    }

    /// Authorizes `action` on a project named by the call.
    pub async fn authorize(
        &self,
        metadata: &MetadataMap,
        project: &ProjectPath,
        action: Action,
    ) -> Result<Caller, Status> {
        let token = bearer(metadata)?;
        Ok(self.iam.authorize(&token, project, action).await?)
    }

    pub fn remember_project(&self, id: &str, project: &ProjectPath) {
        self.projects.insert(id, project.clone());
    }

    pub fn forget_sandbox(&self, id: &str) {
        self.projects.forget(id);
    }

    /// Audits a call's `result` (see [`audit`](Self::audit)) and hands it back.
    pub async fn audited<T>(
        &self,
        caller: &Caller,
        project: &ProjectPath,
        action: Action,
        target: Option<String>,
        result: Result<T, Status>,
    ) -> Result<T, Status> {
        self.audit(caller, project, action, target, result.as_ref().map(|_| ()))
            .await;
        result
    }

    /// Files an audit record of a call that changed something (best effort: a failure is
    /// logged, the call's answer stands).
    pub async fn audit(
        &self,
        caller: &Caller,
        project: &ProjectPath,
        action: Action,
        target: Option<String>,
        result: Result<(), &Status>,
    ) {
        let record = AuditRecord {
            at_ms: now_ms(),
            principal: caller.principal.clone(),
            token_id: Some(caller.token_id.clone()),
            project: project.clone(),
            action,
            target,
            outcome: match result {
                Ok(()) => Outcome::Allowed,
                Err(status) => Outcome::Failed {
                    reason: status.message().chars().take(500).collect(),
                },
            },
        };
        // Queued for the next batch commit: the answer does not wait for it (a crash of this
        // replica loses the records not yet committed, see README "Audit").
        let (key, value) = Iam::audit_entry(&record);
        if let Err(e) = self.audit_writer.put_later(key, value).await {
            tracing::warn!(%e, "cannot write the audit record");
        }
    }
}
