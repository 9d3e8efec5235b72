//! Identity and access: organizations and nested projects, principals (users, service
//! accounts), API tokens, roles per project inherited down the tree, `authorize` for every
//! call, and the audit log.

mod audit;
mod cache;
mod model;
mod token;

#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::time::Duration;

pub use audit::{AuditRecord, Outcome};
pub use cache::{IamCache, REVOCATION_BOUND};
pub use model::{
    valid_segment, Action, Principal, PrincipalId, Project, ProjectPath, Role, RoleBinding,
    MAX_PROJECT_DEPTH,
};
pub use token::{IssuedToken, TokenRecord};

use crate::keys;
use crate::now_ms;
use crate::store::{from_json, to_json, Compare, Op, Store, StoreError, Txn};

/// Longest token lifetime.
pub const MAX_TOKEN_TTL: Duration = Duration::from_secs(400 * 86_400);

#[derive(Debug, thiserror::Error)]
pub enum IamError {
    #[error("the API token is malformed: expected dsec_<16 hex>_<64 hex> as `authorization: Bearer TOKEN`; create one with `dsec token create`")]
    TokenMalformed,
    #[error("the API token is not recognized: check it was copied whole, or create a new one with `dsec token create`")]
    TokenUnknown,
    #[error("API token {0} has expired: create a new one with `dsec token create`")]
    TokenExpired(String),
    #[error("API token {0} was revoked: create a new one with `dsec token create`")]
    TokenRevoked(String),
    #[error("{principal} may not {action} in project {project}: that needs the {needed} role there or on a parent project ({has}); ask an admin of the project to grant it")]
    PermissionDenied {
        principal: PrincipalId,
        project: ProjectPath,
        action: Action,
        needed: Role,
        has: String,
    },
    #[error("{0} is not a cluster admin: node operations need the principal created by `dsec control init`")]
    NotClusterAdmin(PrincipalId),
    #[error("project {0} does not exist: list projects with `dsec project ls`")]
    ProjectNotFound(ProjectPath),
    #[error("principal {0} does not exist")]
    PrincipalNotFound(PrincipalId),
    #[error("no API token with id {0}: list tokens with `dsec token ls`")]
    TokenNotFound(String),
    #[error("{0} already exists")]
    AlreadyExists(String),
    #[error("project path {path:?} is invalid: {why}")]
    InvalidProject { path: String, why: String },
    #[error("principal {0:?} is invalid: use user:NAME or sa:PROJECT:NAME, NAME 1-64 of a-z, 0-9, '-', '.', '_', '@'")]
    InvalidPrincipal(String),
    #[error("role {0:?} is invalid: use viewer, editor or admin")]
    InvalidRole(String),
    #[error("a token lifetime must be between 1 s and 400 days, got {0:?}")]
    InvalidTtl(Duration),
    #[error("{0} changed concurrently too many times: retry the call")]
    Contended(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl IamError {
    /// The gRPC status code this error is answered with.
    pub fn code(&self) -> tonic::Code {
        use tonic::Code;
        match self {
            IamError::TokenMalformed
            | IamError::TokenUnknown
            | IamError::TokenExpired(_)
            | IamError::TokenRevoked(_) => Code::Unauthenticated,
            IamError::PermissionDenied { .. } | IamError::NotClusterAdmin(_) => {
                Code::PermissionDenied
            }
            IamError::ProjectNotFound(_)
            | IamError::PrincipalNotFound(_)
            | IamError::TokenNotFound(_) => Code::NotFound,
            IamError::AlreadyExists(_) => Code::AlreadyExists,
            IamError::InvalidProject { .. }
            | IamError::InvalidPrincipal(_)
            | IamError::InvalidRole(_)
            | IamError::InvalidTtl(_) => Code::InvalidArgument,
            IamError::Contended(_) => Code::Aborted,
            IamError::Store(e) => crate::store_code(e),
        }
    }
}

impl From<IamError> for tonic::Status {
    fn from(e: IamError) -> Self {
        tonic::Status::new(e.code(), e.to_string())
    }
}

pub type IamResult<T> = Result<T, IamError>;

/// An authenticated, authorized caller.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    pub principal: PrincipalId,
    pub token_id: String,
    /// The role that allowed the call (the highest on the project or a parent), if the call
    /// named a project.
    pub role: Option<Role>,
}

/// Identity and access over a [`Store`].
#[derive(Clone)]
pub struct Iam {
    store: Arc<dyn Store>,
    /// The replica's copy of tokens, principals, projects and bindings, if it keeps one.
    cache: Option<Arc<IamCache>>,
}

impl std::fmt::Debug for Iam {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Iam")
    }
}

/// Attempts of a read-check-write before giving up with `Contended`.
const CAS_ATTEMPTS: usize = 64;

impl Iam {
    pub fn new(store: Arc<dyn Store>) -> Self {
        Iam { store, cache: None }
    }

    /// Authorizes from `cache` where it answers (see [`IamCache`]), else from the store.
    pub fn with_cache(store: Arc<dyn Store>, cache: Arc<IamCache>) -> Self {
        Iam {
            store,
            cache: Some(cache),
        }
    }

    /// A fresh control plane's first organization with its first user, who is an admin of
    /// it and a cluster admin; returns that user's first token.
    pub async fn bootstrap(&self, org: &str, admin: &str) -> IamResult<IssuedToken> {
        let org = self.create_org(org).await?;
        let user = PrincipalId::user(admin)?;
        self.create_principal(user.clone(), admin, true).await?;
        self.grant(&user, &org.path, Role::Admin).await?;
        self.issue_token(&user, "bootstrap", None).await
    }

    pub async fn create_org(&self, name: &str) -> IamResult<Project> {
        let path: ProjectPath = name.parse()?;
        if !path.is_org() {
            return Err(IamError::InvalidProject {
                path: name.to_string(),
                why: "an organization name has no '/'".to_string(),
            });
        }
        self.insert_project(path, None).await
    }

    /// A project `name` under `parent` (an organization or project).
    pub async fn create_project(&self, parent: &ProjectPath, name: &str) -> IamResult<Project> {
        let path = parent.child(name)?;
        let parent_kv = self
            .store
            .get(&keys::project(parent))
            .await?
            .ok_or_else(|| IamError::ProjectNotFound(parent.clone()))?;
        self.insert_project(path, Some(Compare::unchanged(&parent_kv)))
            .await
    }

    async fn insert_project(
        &self,
        path: ProjectPath,
        parent_still_there: Option<Compare>,
    ) -> IamResult<Project> {
        let project = Project {
            path: path.clone(),
            created_ms: now_ms(),
        };
        let key = keys::project(&path);
        let mut txn = Txn::default()
            .when(Compare::absent(&key))
            .then(Op::put(&key, to_json(&project)));
        if let Some(parent) = parent_still_there {
            txn = txn.when(parent);
        }
        if self.store.txn(txn).await?.succeeded {
            return Ok(project);
        }
        if self.store.get(&key).await?.is_some() {
            Err(IamError::AlreadyExists(format!("project {path}")))
        } else {
            Err(IamError::ProjectNotFound(
                path.parent().unwrap_or_else(|| path.clone()),
            ))
        }
    }

    pub async fn project(&self, path: &ProjectPath) -> IamResult<Project> {
        let kv = self
            .store
            .get(&keys::project(path))
            .await?
            .ok_or_else(|| IamError::ProjectNotFound(path.clone()))?;
        Ok(from_json(&kv)?)
    }

    /// Every project under `path` (not `path` itself), in path order.
    pub async fn projects_under(&self, path: &ProjectPath) -> IamResult<Vec<Project>> {
        let range = self.store.range(&keys::projects_under(path)).await?;
        Ok(range.kvs.iter().map(from_json).collect::<Result<_, _>>()?)
    }

    /// A user, or a service account of an existing project.
    pub async fn create_principal(
        &self,
        id: PrincipalId,
        display_name: &str,
        cluster_admin: bool,
    ) -> IamResult<Principal> {
        let mut txn = Txn::default();
        if let PrincipalId::ServiceAccount { project, .. } = &id {
            let owner = self
                .store
                .get(&keys::project(project))
                .await?
                .ok_or_else(|| IamError::ProjectNotFound(project.clone()))?;
            txn = txn.when(Compare::unchanged(&owner));
        }
        let principal = Principal {
            id: id.clone(),
            display_name: display_name.chars().take(200).collect(),
            cluster_admin,
            created_ms: now_ms(),
        };
        let key = keys::principal(&id);
        let txn = txn
            .when(Compare::absent(&key))
            .then(Op::put(&key, to_json(&principal)));
        if self.store.txn(txn).await?.succeeded {
            Ok(principal)
        } else {
            Err(IamError::AlreadyExists(format!("principal {id}")))
        }
    }

    pub async fn principal(&self, id: &PrincipalId) -> IamResult<Principal> {
        let kv = self
            .store
            .get(&keys::principal(id))
            .await?
            .ok_or_else(|| IamError::PrincipalNotFound(id.clone()))?;
        Ok(from_json(&kv)?)
    }

    /// Gives `principal` `role` on `project` and everything under it (replacing a role it had
    /// there).
    pub async fn grant(
        &self,
        principal: &PrincipalId,
        project: &ProjectPath,
        role: Role,
    ) -> IamResult<()> {
        let who = self
            .store
            .get(&keys::principal(principal))
            .await?
            .ok_or_else(|| IamError::PrincipalNotFound(principal.clone()))?;
        let scope = self
            .store
            .get(&keys::project(project))
            .await?
            .ok_or_else(|| IamError::ProjectNotFound(project.clone()))?;
        let binding = RoleBinding {
            principal: principal.clone(),
            project: project.clone(),
            role,
        };
        let txn = Txn::default()
            .when(Compare::unchanged(&who))
            .when(Compare::unchanged(&scope))
            .then(Op::put(
                keys::binding(principal, project),
                to_json(&binding),
            ));
        if self.store.txn(txn).await?.succeeded {
            Ok(())
        } else {
            Err(IamError::Contended(format!(
                "the binding of {principal} on {project}"
            )))
        }
    }

    /// Removes the role `principal` has directly on `project`; `false` if it had none.
    pub async fn revoke_role(
        &self,
        principal: &PrincipalId,
        project: &ProjectPath,
    ) -> IamResult<bool> {
        Ok(self
            .store
            .delete(&keys::binding(principal, project))
            .await?)
    }

    /// The roles `principal` holds directly, in project order.
    pub async fn bindings_of(&self, principal: &PrincipalId) -> IamResult<Vec<RoleBinding>> {
        let range = self.store.range(&keys::bindings_of(principal)).await?;
        Ok(range.kvs.iter().map(from_json).collect::<Result<_, _>>()?)
    }

    /// A new token for `principal`, valid for `ttl` (forever if `None`) until revoked.
    pub async fn issue_token(
        &self,
        principal: &PrincipalId,
        description: &str,
        ttl: Option<Duration>,
    ) -> IamResult<IssuedToken> {
        if let Some(ttl) = ttl {
            if ttl < Duration::from_secs(1) || ttl > MAX_TOKEN_TTL {
                return Err(IamError::InvalidTtl(ttl));
            }
        }
        let who = self
            .store
            .get(&keys::principal(principal))
            .await?
            .ok_or_else(|| IamError::PrincipalNotFound(principal.clone()))?;
        let (id, secret, secret_sha256) = token::generate();
        let created_ms = now_ms();
        let record = TokenRecord {
            id: id.clone(),
            principal: principal.clone(),
            secret_sha256,
            description: description.chars().take(200).collect(),
            created_ms,
            expires_ms: ttl.map(|ttl| created_ms + ttl.as_millis() as u64),
            revoked_ms: None,
        };
        let key = keys::token(&id);
        let txn = Txn::default()
            .when(Compare::unchanged(&who))
            .when(Compare::absent(&key))
            .then(Op::put(&key, to_json(&record)))
            .then(Op::put(keys::principal_token(principal, &id), Vec::new()));
        if !self.store.txn(txn).await?.succeeded {
            return Err(IamError::Contended(format!("principal {principal}")));
        }
        Ok(IssuedToken { id, secret, record })
    }

    pub async fn token(&self, id: &str) -> IamResult<TokenRecord> {
        let kv = self
            .store
            .get(&keys::token(id))
            .await?
            .ok_or_else(|| IamError::TokenNotFound(id.chars().take(40).collect()))?;
        Ok(from_json(&kv)?)
    }

    /// Marks a token revoked (kept, so that the audit log still resolves it).
    pub async fn revoke_token(&self, id: &str) -> IamResult<TokenRecord> {
        for _ in 0..CAS_ATTEMPTS {
            let kv = self
                .store
                .get(&keys::token(id))
                .await?
                .ok_or_else(|| IamError::TokenNotFound(id.chars().take(40).collect()))?;
            let mut record: TokenRecord = from_json(&kv)?;
            if record.revoked_ms.is_some() {
                return Ok(record);
            }
            record.revoked_ms = Some(now_ms());
            let txn = Txn::default()
                .when(Compare::unchanged(&kv))
                .then(Op::put(&kv.key, to_json(&record)));
            if self.store.txn(txn).await?.succeeded {
                return Ok(record);
            }
        }
        Err(IamError::Contended(format!("token {id}")))
    }

    pub async fn tokens_of(&self, principal: &PrincipalId) -> IamResult<Vec<TokenRecord>> {
        let index = self.store.range(&keys::principal_tokens(principal)).await?;
        let mut tokens = Vec::with_capacity(index.kvs.len());
        for kv in &index.kvs {
            let id = kv.key.rsplit('/').next().unwrap_or_default();
            tokens.push(self.token(id).await?);
        }
        Ok(tokens)
    }

    /// The principal a token stands for, if the token is valid now.
    pub async fn authenticate(&self, token: &str) -> IamResult<(PrincipalId, String)> {
        let (id, secret) = token::parse(token)?;
        let key = keys::token(id);
        let record = match self.cache.as_ref().and_then(|c| c.token(&key)) {
            Some(record) => record,
            None => {
                let Some(kv) = self.store.get(&key).await? else {
                    return Err(IamError::TokenUnknown);
                };
                from_json(&kv)?
            }
        };
        if !token::constant_time_eq(&token::sha256_hex(secret), &record.secret_sha256) {
            return Err(IamError::TokenUnknown);
        }
        if record.revoked_ms.is_some() {
            return Err(IamError::TokenRevoked(record.id));
        }
        if record.expires_ms.is_some_and(|at| now_ms() >= at) {
            return Err(IamError::TokenExpired(record.id));
        }
        Ok((record.principal, record.id))
    }

    /// The check every API call makes: the token is valid, the project exists, and the
    /// token's principal holds a role there or on a parent that allows `action`.
    pub async fn authorize(
        &self,
        token: &str,
        project: &ProjectPath,
        action: Action,
    ) -> IamResult<Caller> {
        let (principal, token_id) = self.authenticate(token).await?;
        let project_key = keys::project(project);
        let cached = self.cache.as_ref();
        if !cached.is_some_and(|c| c.has_project(&project_key))
            && self.store.get(&project_key).await?.is_none()
        {
            return Err(IamError::ProjectNotFound(project.clone()));
        }
        let role_in = |bindings: Vec<RoleBinding>| {
            bindings
                .into_iter()
                .filter(|b| project.is_within(&b.project))
                .map(|b| b.role)
                .max()
        };
        let needed = action.required_role();
        let mut role = cached
            .and_then(|c| c.bindings_under(&keys::bindings_of(&principal)))
            .and_then(role_in);
        // The copy only allows: a role it lacks may have been granted a moment ago.
        if role.is_none_or(|role| role < needed) {
            role = role_in(self.bindings_of(&principal).await?);
        }
        match role {
            Some(role) if role >= needed => Ok(Caller {
                principal,
                token_id,
                role: Some(role),
            }),
            _ => Err(IamError::PermissionDenied {
                principal,
                project: project.clone(),
                action,
                needed,
                has: role.map_or("it has no role there".to_string(), |r| format!("it is {r}")),
            }),
        }
    }

    /// The check node operations make: the token is a cluster admin's.
    pub async fn authorize_cluster(&self, token: &str) -> IamResult<Caller> {
        let (principal, token_id) = self.authenticate(token).await?;
        let cached = self
            .cache
            .as_ref()
            .and_then(|c| c.principal(&keys::principal(&principal)));
        let is_admin = match cached {
            Some(record) if record.cluster_admin => true,
            _ => self.principal(&principal).await?.cluster_admin,
        };
        if !is_admin {
            return Err(IamError::NotClusterAdmin(principal));
        }
        Ok(Caller {
            principal,
            token_id,
            role: None,
        })
    }

    /// Files an audit record under the project's organization.
    pub async fn audit(&self, record: &AuditRecord) -> IamResult<()> {
        let (key, value) = Self::audit_entry(record);
        self.store.put(&key, value, None).await?;
        Ok(())
    }

    /// Where an audit record is filed and what is written there.
    pub fn audit_entry(record: &AuditRecord) -> (String, Vec<u8>) {
        let key = keys::audit(record.project.org(), record.at_ms, &token::random_hex(4));
        (key, to_json(record))
    }

    /// The newest `limit` audit records of an organization, oldest first.
    pub async fn audit_log(&self, org: &str, limit: usize) -> IamResult<Vec<AuditRecord>> {
        let range = self.store.range(&keys::audit_of(org)).await?;
        let skip = range.kvs.len().saturating_sub(limit);
        Ok(range.kvs[skip..]
            .iter()
            .map(from_json)
            .collect::<Result<_, _>>()?)
    }
}
