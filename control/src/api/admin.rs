//! `dsec.v1.Admin`: projects and quotas, principals and roles, tokens, nodes.

use std::sync::Arc;
use std::time::Duration;

use dsec_api::v1::admin_server::Admin;
use dsec_api::v1::*;
use tonic::metadata::MetadataMap;
use tonic::{Request, Response, Status};

use super::auth::bearer;
use super::Shared;
use crate::iam::{Action, Caller, IamError, PrincipalId, ProjectPath, TokenRecord};
use crate::placement::{NodeAdmin, NodeRecord};
use crate::resources::Resources;
use crate::revocation::RevokedNode as RevokedNodeRecord;

pub struct AdminApi(pub Arc<Shared>);

fn quota_of(r: Resources) -> Option<Quota> {
    Some(Quota {
        sandboxes: r.sandboxes,
        vcpus: r.vcpus,
        memory_mib: r.memory_mib,
        disk_mib: r.disk_mib,
    })
}

fn token_info(t: &TokenRecord) -> TokenInfo {
    TokenInfo {
        id: t.id.clone(),
        principal: t.principal.to_string(),
        description: t.description.clone(),
        created_unix_ms: t.created_ms,
        expires_unix_ms: t.expires_ms.unwrap_or(0),
        revoked_unix_ms: t.revoked_ms.unwrap_or(0),
    }
}

fn parse_project(text: &str) -> Result<ProjectPath, Status> {
    text.parse()
        .map_err(|e: IamError| Status::invalid_argument(e.to_string()))
}

fn parse_principal(text: &str) -> Result<PrincipalId, Status> {
    text.parse()
        .map_err(|e: IamError| Status::invalid_argument(e.to_string()))
}

fn revoked_info(revoked: RevokedNodeRecord) -> RevokedNode {
    RevokedNode {
        name: revoked.node,
        all_certificates: revoked.all_certificates,
        fingerprints: revoked.fingerprints,
        revoked_unix_ms: revoked.revoked_ms,
        revoked_by: revoked.by,
    }
}

fn node_summary(record: &NodeRecord, admin: NodeAdmin) -> NodeSummary {
    NodeSummary {
        name: record.name.clone(),
        address: record.address.clone(),
        cordoned: admin.cordoned,
        draining: admin.draining,
        capacity: quota_of(record.capacity),
        allocated: quota_of(record.allocated),
        backends: record
            .backends
            .iter()
            .map(|b| format!("{b:?}").to_lowercase())
            .collect(),
        labels: record.labels.clone().into_iter().collect(),
        heartbeat_unix_ms: record.heartbeat_ms,
    }
}

impl AdminApi {
    async fn project_info(&self, path: &ProjectPath) -> Result<ProjectInfo, Status> {
        let quota = self.0.quotas.get(path).await?;
        Ok(ProjectInfo {
            path: path.to_string(),
            limit: quota_of(quota.limit),
            used: quota_of(quota.used),
            delegated: quota_of(quota.delegated),
        })
    }

    /// Changes to a project (subprojects, its quota) need an admin of its parent; to an
    /// organization a cluster admin.
    async fn authorize_above(
        &self,
        metadata: &MetadataMap,
        path: &ProjectPath,
        action: Action,
    ) -> Result<Caller, Status> {
        let token = bearer(metadata)?;
        Ok(match path.parent() {
            Some(parent) => self.0.iam.authorize(&token, &parent, action).await?,
            None => self.0.iam.authorize_cluster(&token).await?,
        })
    }

    /// Tokens of `principal`: the caller's own, a service account's for an admin of its
    /// project, anyone's for a cluster admin.
    async fn authorize_tokens_of(
        &self,
        metadata: &MetadataMap,
        principal: &PrincipalId,
        action: Action,
    ) -> Result<Caller, Status> {
        let token = bearer(metadata)?;
        let (me, token_id) = self.0.iam.authenticate(&token).await?;
        if &me == principal {
            return Ok(Caller {
                principal: me,
                token_id,
                role: None,
            });
        }
        match principal {
            PrincipalId::ServiceAccount { project, .. } => {
                match self.0.iam.authorize(&token, project, action).await {
                    Ok(caller) => Ok(caller),
                    Err(denied) => self
                        .0
                        .iam
                        .authorize_cluster(&token)
                        .await
                        .map_err(|_| denied.into()),
                }
            }
            PrincipalId::User(_) => Ok(self.0.iam.authorize_cluster(&token).await?),
        }
    }

    /// The principal a request names, or the caller's.
    async fn principal_or_caller(
        &self,
        metadata: &MetadataMap,
        text: &str,
    ) -> Result<PrincipalId, Status> {
        if text.is_empty() {
            let token = bearer(metadata)?;
            Ok(self.0.iam.authenticate(&token).await?.0)
        } else {
            parse_principal(text)
        }
    }

    async fn set_node_flag(
        &self,
        request: Request<NodeAdminRequest>,
        change: fn(&mut NodeAdmin, bool),
    ) -> Result<Response<NodeSummary>, Status> {
        let (metadata, _, message) = request.into_parts();
        self.0.iam.authorize_cluster(&bearer(&metadata)?).await?;
        let nodes = self.0.registry.list().await?;
        let (record, mut admin) = nodes
            .into_iter()
            .find(|(r, _)| r.name == message.name)
            .ok_or_else(|| {
                Status::not_found(format!(
                    "node {:?} is not registered: list nodes with `dsec node ls`",
                    message.name
                ))
            })?;
        change(&mut admin, !message.undo);
        self.0.registry.set_admin(&record.name, admin).await?;
        self.0.placer.set_admin(&record.name, admin);
        Ok(Response::new(node_summary(&record, admin)))
    }
}

#[tonic::async_trait]
impl Admin for AdminApi {
    async fn who_am_i(
        &self,
        request: Request<WhoAmIRequest>,
    ) -> Result<Response<WhoAmIResponse>, Status> {
        let token = bearer(request.metadata())?;
        let (principal, token_id) = self.0.iam.authenticate(&token).await?;
        let who = self.0.iam.principal(&principal).await?;
        let roles = self
            .0
            .iam
            .bindings_of(&principal)
            .await?
            .into_iter()
            .map(|b| format!("{}={}", b.project, b.role))
            .collect();
        Ok(Response::new(WhoAmIResponse {
            principal: principal.to_string(),
            token_id,
            cluster_admin: who.cluster_admin,
            roles,
        }))
    }

    async fn create_project(
        &self,
        request: Request<CreateProjectRequest>,
    ) -> Result<Response<ProjectInfo>, Status> {
        let (metadata, _, message) = request.into_parts();
        let path = parse_project(&message.path)?;
        let caller = self
            .authorize_above(&metadata, &path, Action::ProjectCreate)
            .await?;
        let result = match path.parent() {
            Some(parent) => {
                let name = path.as_str().rsplit('/').next().unwrap_or_default();
                self.0.iam.create_project(&parent, name).await
            }
            None => self.0.iam.create_org(path.as_str()).await,
        };
        let audit_project = path.parent().unwrap_or_else(|| path.clone());
        self.0
            .audited(
                &caller,
                &audit_project,
                Action::ProjectCreate,
                Some(path.to_string()),
                result.map_err(Status::from),
            )
            .await?;
        Ok(Response::new(self.project_info(&path).await?))
    }

    async fn list_projects(
        &self,
        request: Request<ListProjectsRequest>,
    ) -> Result<Response<ListProjectsResponse>, Status> {
        let (metadata, _, message) = request.into_parts();
        let path = parse_project(&message.path)?;
        self.0
            .authorize(&metadata, &path, Action::ProjectGet)
            .await?;
        let mut projects = vec![self.project_info(&path).await?];
        for project in self.0.iam.projects_under(&path).await? {
            projects.push(self.project_info(&project.path).await?);
        }
        Ok(Response::new(ListProjectsResponse { projects }))
    }

    async fn set_quota(
        &self,
        request: Request<SetQuotaRequest>,
    ) -> Result<Response<ProjectInfo>, Status> {
        let (metadata, _, message) = request.into_parts();
        let path = parse_project(&message.path)?;
        let caller = self
            .authorize_above(&metadata, &path, Action::ProjectSetQuota)
            .await?;
        let limit = message.limit.unwrap_or_default();
        let limit = Resources::new(
            limit.sandboxes,
            limit.vcpus,
            limit.memory_mib,
            limit.disk_mib,
        );
        let result = self.0.quotas.set_limit(&path, limit).await;
        self.0
            .audited(
                &caller,
                &path,
                Action::ProjectSetQuota,
                Some(format!("{limit}")),
                result.map_err(Status::from),
            )
            .await?;
        Ok(Response::new(self.project_info(&path).await?))
    }

    async fn create_principal(
        &self,
        request: Request<CreatePrincipalRequest>,
    ) -> Result<Response<CreatePrincipalResponse>, Status> {
        let (metadata, _, message) = request.into_parts();
        let id = parse_principal(&message.principal)?;
        let token = bearer(&metadata)?;
        match &id {
            PrincipalId::ServiceAccount { project, .. } => {
                self.0
                    .iam
                    .authorize(&token, project, Action::ServiceAccountCreate)
                    .await?;
            }
            PrincipalId::User(_) => {
                self.0.iam.authorize_cluster(&token).await?;
            }
        }
        let principal = self
            .0
            .iam
            .create_principal(id, &message.display_name, false)
            .await?;
        Ok(Response::new(CreatePrincipalResponse {
            principal: principal.id.to_string(),
        }))
    }

    async fn set_role(
        &self,
        request: Request<SetRoleRequest>,
    ) -> Result<Response<SetRoleResponse>, Status> {
        let (metadata, _, message) = request.into_parts();
        let principal = parse_principal(&message.principal)?;
        let project = parse_project(&message.project)?;
        let caller = self
            .0
            .authorize(&metadata, &project, Action::RoleGrant)
            .await?;
        let result = if message.role.is_empty() {
            self.0
                .iam
                .revoke_role(&principal, &project)
                .await
                .map(|_| ())
        } else {
            let role = message
                .role
                .parse()
                .map_err(|e: IamError| Status::invalid_argument(e.to_string()))?;
            self.0.iam.grant(&principal, &project, role).await
        };
        self.0
            .audited(
                &caller,
                &project,
                Action::RoleGrant,
                Some(format!("{principal}={}", message.role)),
                result.map_err(Status::from),
            )
            .await?;
        Ok(Response::new(SetRoleResponse {}))
    }

    async fn create_token(
        &self,
        request: Request<CreateTokenRequest>,
    ) -> Result<Response<CreateTokenResponse>, Status> {
        let (metadata, _, message) = request.into_parts();
        let principal = self
            .principal_or_caller(&metadata, &message.principal)
            .await?;
        self.authorize_tokens_of(&metadata, &principal, Action::TokenCreate)
            .await?;
        let ttl = (message.ttl_seconds > 0).then(|| Duration::from_secs(message.ttl_seconds));
        let issued = self
            .0
            .iam
            .issue_token(&principal, &message.description, ttl)
            .await?;
        Ok(Response::new(CreateTokenResponse {
            token: issued.secret.clone(),
            info: Some(token_info(&issued.record)),
        }))
    }

    async fn list_tokens(
        &self,
        request: Request<ListTokensRequest>,
    ) -> Result<Response<ListTokensResponse>, Status> {
        let (metadata, _, message) = request.into_parts();
        let principal = self
            .principal_or_caller(&metadata, &message.principal)
            .await?;
        self.authorize_tokens_of(&metadata, &principal, Action::TokenCreate)
            .await?;
        let tokens = self.0.iam.tokens_of(&principal).await?;
        Ok(Response::new(ListTokensResponse {
            tokens: tokens.iter().map(token_info).collect(),
        }))
    }

    async fn revoke_token(
        &self,
        request: Request<RevokeTokenRequest>,
    ) -> Result<Response<TokenInfo>, Status> {
        let (metadata, _, message) = request.into_parts();
        // Anyone authenticated may ask; unknown ids and others' tokens read the same.
        bearer(&metadata)?;
        let record = self.0.iam.token(&message.id).await?;
        self.authorize_tokens_of(&metadata, &record.principal, Action::TokenRevoke)
            .await?;
        let revoked = self.0.iam.revoke_token(&message.id).await?;
        Ok(Response::new(token_info(&revoked)))
    }

    async fn list_nodes(
        &self,
        request: Request<ListNodesRequest>,
    ) -> Result<Response<ListNodesResponse>, Status> {
        self.0
            .iam
            .authorize_cluster(&bearer(request.metadata())?)
            .await?;
        let nodes = self.0.registry.list().await?;
        let revoked = self.0.revocations.list().await?;
        Ok(Response::new(ListNodesResponse {
            nodes: nodes.iter().map(|(r, a)| node_summary(r, *a)).collect(),
            revoked: revoked.into_iter().map(revoked_info).collect(),
        }))
    }

    async fn revoke_node(
        &self,
        request: Request<RevokeNodeRequest>,
    ) -> Result<Response<RevokedNode>, Status> {
        let (metadata, _, message) = request.into_parts();
        let caller = self.0.iam.authorize_cluster(&bearer(&metadata)?).await?;
        let name = message.name;
        if message.undo {
            if !self.0.revocations.lift(&name).await? {
                return Err(Status::not_found(format!(
                    "node {name:?} has no revoked certificate: see `dsec node ls`"
                )));
            }
            tracing::info!(node = %name, by = %caller.principal, "node revocation lifted");
            return Ok(Response::new(RevokedNode {
                name,
                ..Default::default()
            }));
        }
        // The certificate named, else the one the node registered with, else all of them.
        let fingerprint = match message.fingerprint.trim() {
            "" => self
                .0
                .registry
                .list()
                .await?
                .into_iter()
                .find(|(record, _)| record.name == name)
                .and_then(|(record, _)| record.cert_sha256),
            named => Some(named.to_ascii_lowercase()),
        };
        let revoked = self
            .0
            .revocations
            .revoke(&name, fingerprint.as_deref(), &caller.principal.to_string())
            .await?;
        // Its sandboxes go the way of a vanished node's: the watchers see the record deleted.
        let evicted = self.0.registry.evict(&name, fingerprint.as_deref()).await?;
        if evicted.is_some() {
            self.0.placer.remove_node(&name);
        }
        tracing::info!(node = %name, by = %caller.principal, fingerprint = ?fingerprint, evicted = evicted.is_some(), "node certificate revoked");
        Ok(Response::new(revoked_info(revoked)))
    }

    async fn cordon_node(
        &self,
        request: Request<NodeAdminRequest>,
    ) -> Result<Response<NodeSummary>, Status> {
        self.set_node_flag(request, |admin, on| admin.cordoned = on)
            .await
    }

    async fn drain_node(
        &self,
        request: Request<NodeAdminRequest>,
    ) -> Result<Response<NodeSummary>, Status> {
        self.set_node_flag(request, |admin, on| admin.draining = on)
            .await
    }
}
