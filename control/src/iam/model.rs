//! The identity records and their names: project paths, principals, roles and actions.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::IamError;

/// Deepest project tree: the organization and five levels below it.
pub const MAX_PROJECT_DEPTH: usize = 6;
const MAX_SEGMENT: usize = 63;

/// `org/project/subproject`: the organization is the first segment, every segment is 1 to 63
/// of `a-z 0-9 -` and does not start or end with `-`. The path names every ancestor, so
/// role inheritance needs no lookups of the tree.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct ProjectPath(String);

impl ProjectPath {
    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn org(&self) -> &str {
        self.0.split('/').next().unwrap_or("")
    }

    pub fn depth(&self) -> usize {
        self.0.split('/').count()
    }

    pub fn is_org(&self) -> bool {
        self.depth() == 1
    }

    pub fn parent(&self) -> Option<ProjectPath> {
        self.0
            .rsplit_once('/')
            .map(|(parent, _)| ProjectPath(parent.to_string()))
    }

    pub fn child(&self, name: &str) -> Result<ProjectPath, IamError> {
        format!("{}/{name}", self.0).parse()
    }

    /// This path and every ancestor, nearest first.
    pub fn self_and_ancestors(&self) -> impl Iterator<Item = ProjectPath> + '_ {
        std::iter::successors(Some(self.clone()), |p| p.parent())
    }

    /// `self` is `other` or lies under it.
    pub fn is_within(&self, other: &ProjectPath) -> bool {
        self.0 == other.0
            || (self.0.starts_with(&other.0) && self.0.as_bytes().get(other.0.len()) == Some(&b'/'))
    }
}

pub fn valid_segment(segment: &str) -> bool {
    !segment.is_empty()
        && segment.len() <= MAX_SEGMENT
        && segment
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !segment.starts_with('-')
        && !segment.ends_with('-')
}

impl FromStr for ProjectPath {
    type Err = IamError;

    fn from_str(text: &str) -> Result<Self, IamError> {
        let bad = |why: &str| IamError::InvalidProject {
            path: text.chars().take(200).collect(),
            why: why.to_string(),
        };
        let segments: Vec<&str> = text.split('/').collect();
        if segments.len() > MAX_PROJECT_DEPTH {
            return Err(bad(&format!(
                "more than {MAX_PROJECT_DEPTH} levels (organization included)"
            )));
        }
        if !segments.iter().all(|s| valid_segment(s)) {
            return Err(bad(
                "each level is 1-63 of a-z, 0-9 and '-', not starting or ending with '-', separated by '/'",
            ));
        }
        Ok(ProjectPath(text.to_string()))
    }
}

impl TryFrom<String> for ProjectPath {
    type Error = IamError;
    fn try_from(text: String) -> Result<Self, IamError> {
        text.parse()
    }
}

impl From<ProjectPath> for String {
    fn from(path: ProjectPath) -> String {
        path.0
    }
}

impl fmt::Display for ProjectPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Who makes a call: a person, or a service account owned by a project (an RL job).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum PrincipalId {
    /// `user:NAME`
    User(String),
    /// `sa:PROJECT:NAME`
    ServiceAccount { project: ProjectPath, name: String },
}

fn valid_principal_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'-' | b'.' | b'_' | b'@')
        })
}

impl PrincipalId {
    pub fn user(name: &str) -> Result<Self, IamError> {
        format!("user:{name}").parse()
    }

    pub fn service_account(project: &ProjectPath, name: &str) -> Result<Self, IamError> {
        format!("sa:{project}:{name}").parse()
    }
}

impl FromStr for PrincipalId {
    type Err = IamError;

    fn from_str(text: &str) -> Result<Self, IamError> {
        let bad = || IamError::InvalidPrincipal(text.chars().take(200).collect());
        if let Some(name) = text.strip_prefix("user:") {
            return valid_principal_name(name)
                .then(|| PrincipalId::User(name.to_string()))
                .ok_or_else(bad);
        }
        if let Some(rest) = text.strip_prefix("sa:") {
            let (project, name) = rest.rsplit_once(':').ok_or_else(bad)?;
            let project = project.parse().map_err(|_| bad())?;
            return valid_principal_name(name)
                .then(|| PrincipalId::ServiceAccount {
                    project,
                    name: name.to_string(),
                })
                .ok_or_else(bad);
        }
        Err(bad())
    }
}

impl TryFrom<String> for PrincipalId {
    type Error = IamError;
    fn try_from(text: String) -> Result<Self, IamError> {
        text.parse()
    }
}

impl From<PrincipalId> for String {
    fn from(id: PrincipalId) -> String {
        id.to_string()
    }
}

impl fmt::Display for PrincipalId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PrincipalId::User(name) => write!(f, "user:{name}"),
            PrincipalId::ServiceAccount { project, name } => write!(f, "sa:{project}:{name}"),
        }
    }
}

/// What a principal may do in a project and everything under it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Read sandboxes and the project.
    Viewer,
    /// Also create, drive and delete sandboxes.
    Editor,
    /// Also create subprojects, set their quotas, grant roles, manage service accounts and
    /// tokens, read the audit log.
    Admin,
}

impl FromStr for Role {
    type Err = IamError;
    fn from_str(text: &str) -> Result<Self, IamError> {
        match text {
            "viewer" => Ok(Role::Viewer),
            "editor" => Ok(Role::Editor),
            "admin" => Ok(Role::Admin),
            other => Err(IamError::InvalidRole(other.chars().take(40).collect())),
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Role::Viewer => "viewer",
            Role::Editor => "editor",
            Role::Admin => "admin",
        })
    }
}

/// Every call the API serves, with the least role it needs in the target project.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    SandboxGet,
    SandboxList,
    SandboxCreate,
    SandboxDelete,
    SandboxExec,
    SandboxFiles,
    SandboxPorts,
    SandboxPause,
    SandboxResume,
    SandboxFork,
    SandboxSnapshot,
    SandboxNetwork,
    ProjectGet,
    ProjectCreate,
    ProjectSetQuota,
    RoleGrant,
    ServiceAccountCreate,
    TokenCreate,
    TokenRevoke,
    AuditRead,
}

impl Action {
    pub fn required_role(self) -> Role {
        use Action::*;
        match self {
            SandboxGet | SandboxList | ProjectGet => Role::Viewer,
            SandboxCreate | SandboxDelete | SandboxExec | SandboxFiles | SandboxPorts
            | SandboxPause | SandboxResume | SandboxFork | SandboxSnapshot | SandboxNetwork => {
                Role::Editor
            }
            ProjectCreate | ProjectSetQuota | RoleGrant | ServiceAccountCreate | TokenCreate
            | TokenRevoke | AuditRead => Role::Admin,
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = serde_json::to_value(self)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default();
        f.write_str(&text)
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Project {
    pub path: ProjectPath,
    pub created_ms: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Principal {
    pub id: PrincipalId,
    pub display_name: String,
    /// May list, cordon and drain nodes (set by `dsec control init`).
    pub cluster_admin: bool,
    pub created_ms: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoleBinding {
    pub principal: PrincipalId,
    pub project: ProjectPath,
    pub role: Role,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_is_within_itself_and_its_ancestors_only() {
        let run: ProjectPath = "acme/rl/run-1".parse().unwrap();
        let within = |p: &str| run.is_within(&p.parse().unwrap());
        assert!(within("acme/rl/run-1") && within("acme/rl") && within("acme"));
        assert!(!within("acme/r") && !within("acme/rl/run") && !within("acm"));
        let chain: Vec<String> = run.self_and_ancestors().map(String::from).collect();
        assert_eq!(chain, ["acme/rl/run-1", "acme/rl", "acme"]);
        assert_eq!((run.org(), run.depth(), run.is_org()), ("acme", 3, false));
    }

    #[test]
    fn every_action_needs_a_role_and_roles_are_ordered() {
        assert!(Role::Viewer < Role::Editor && Role::Editor < Role::Admin);
        assert_eq!(Action::SandboxList.required_role(), Role::Viewer);
        assert_eq!(Action::SandboxExec.required_role(), Role::Editor);
        assert_eq!(Action::TokenCreate.required_role(), Role::Admin);
        assert_eq!(Action::SandboxCreate.to_string(), "sandbox_create");
    }
}
