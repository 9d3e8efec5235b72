//! Cluster commands, through an apiserver (`dsec control up`): `login`, `project`, `token`,
//! `account`, `role`, `node`. Credentials come from `--endpoint`, `DSEC_TOKEN` and
//! `DSEC_PROJECT`, else from what `dsec login` saved.

use std::path::PathBuf;

use clap::Subcommand;
use dsec_api::v1::admin_client::AdminClient;
use dsec_api::v1::*;
use dsec_sdk::Credentials;
use serde::{Deserialize, Serialize};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("{}: {}", .0.code(), .0.message())]
    Status(#[from] tonic::Status),
    #[error("cannot reach the apiserver at {endpoint}: {reason}")]
    Connect { endpoint: String, reason: String },
    #[error("{0}")]
    Usage(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

type Result<T> = std::result::Result<T, ClusterError>;

/// What `dsec login` saves (mode 0600).
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct Login {
    pub endpoint: String,
    pub token: String,
    #[serde(default)]
    pub project: String,
    /// The cluster CA of an https:// endpoint.
    #[serde(default)]
    pub ca_file: String,
}

fn login_path() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CONFIG_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config")))?;
    Some(base.join("dsec").join("login.json"))
}

impl Login {
    pub fn load() -> Option<Login> {
        let text = std::fs::read_to_string(login_path()?).ok()?;
        serde_json::from_str(&text).ok()
    }

    fn save(&self) -> Result<PathBuf> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let path = login_path()
            .ok_or_else(|| ClusterError::Usage("neither XDG_CONFIG_HOME nor HOME is set".into()))?;
        let io = |what: &str| {
            let what = format!("{what} {}", path.display());
            move |source| ClusterError::Io { what, source }
        };
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(io("create the directory of"))?;
        }
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(true)
            .mode(0o600)
            .open(&path)
            .map_err(io("write"))?;
        let text = serde_json::to_string_pretty(self).expect("a login serializes");
        file.write_all(text.as_bytes()).map_err(io("write"))?;
        Ok(path)
    }
}

#[derive(Subcommand, Debug)]
pub enum ProjectCommand {
    /// Create a project (`org/name`, or an organization as a cluster admin).
    Create { path: String },
    /// A project and everything under it, with quotas (default: $DSEC_PROJECT's organization).
    Ls { path: Option<String> },
    /// Show, or with any of the flags set, a project's quota (u64 max = unlimited; flags left
    /// out keep their value).
    Quota {
        path: String,
        #[arg(long)]
        sandboxes: Option<u64>,
        #[arg(long)]
        vcpus: Option<u64>,
        #[arg(long = "mem", value_name = "MiB")]
        memory_mib: Option<u64>,
        #[arg(long = "disk", value_name = "MiB")]
        disk_mib: Option<u64>,
    },
}

#[derive(Subcommand, Debug)]
pub enum TokenCommand {
    /// A new token (printed once) for you, or for --principal (a service account you
    /// administer; any principal as a cluster admin).
    Create {
        #[arg(long)]
        principal: Option<String>,
        #[arg(long, default_value = "")]
        description: String,
        /// Lifetime in seconds (default: until revoked).
        #[arg(long, value_name = "S")]
        ttl: Option<u64>,
    },
    Ls {
        #[arg(long)]
        principal: Option<String>,
    },
    Revoke {
        id: String,
    },
}

#[derive(Subcommand, Debug)]
pub enum AccountCommand {
    /// A user (`user:NAME`, cluster admin) or service account (`sa:PROJECT:NAME`).
    Create {
        principal: String,
        #[arg(long, default_value = "")]
        name: String,
    },
}

#[derive(Subcommand, Debug)]
pub enum RoleCommand {
    /// Grant PRINCIPAL the role (viewer, editor, admin) on PROJECT and everything under it.
    Grant {
        principal: String,
        project: String,
        role: String,
    },
    Revoke {
        principal: String,
        project: String,
    },
}

#[derive(Subcommand, Debug)]
pub enum NodeCommand {
    Ls,
    /// No new sandboxes on the node (--undo clears).
    Cordon {
        name: String,
        #[arg(long)]
        undo: bool,
    },
    /// No new sandboxes, and the node refuses creates itself (--undo clears).
    Drain {
        name: String,
        #[arg(long)]
        undo: bool,
    },
    /// Revoke the node's certificate (the one it registered with, else all of its
    /// certificates): it can no longer register or heartbeat and its sandboxes become lost
    /// (--undo lifts every revocation of the node).
    Revoke {
        name: String,
        /// SHA-256 of the certificate's DER in hex, instead of the one it registered with.
        #[arg(long, value_name = "HEX")]
        fingerprint: Option<String>,
        #[arg(long)]
        undo: bool,
    },
}

#[derive(Debug)]
pub enum ClusterCommand {
    Login {
        token: String,
        project: Option<String>,
    },
    Project(ProjectCommand),
    Token(TokenCommand),
    Account(AccountCommand),
    Role(RoleCommand),
    Node(NodeCommand),
}

type Admin = AdminClient<InterceptedService<Channel, Credentials>>;

async fn admin(endpoint: &str, credentials: Credentials) -> Result<Admin> {
    let first = endpoint.split(',').next().unwrap_or_default().trim();
    let connect_error = |reason: String| ClusterError::Connect {
        endpoint: first.to_string(),
        reason,
    };
    if !first.starts_with("http") {
        return Err(connect_error(
            "cluster commands need an apiserver address: --endpoint http(s)://HOST:PORT or DSEC_ENDPOINT (`dsec login`)".into(),
        ));
    }
    let channel = credentials
        .endpoint(first)
        .map_err(|e| connect_error(e.to_string()))?
        .connect()
        .await
        .map_err(|e| connect_error(dsec_api::tls::error_chain(&e)))?;
    Ok(AdminClient::with_interceptor(channel, credentials))
}

fn quota_text(q: &Option<Quota>) -> String {
    let q = (*q).unwrap_or_default();
    let n = |v: u64| {
        if v == u64::MAX {
            "unlimited".to_string()
        } else {
            v.to_string()
        }
    };
    format!(
        "sandboxes={} vcpus={} mem={} disk={}",
        n(q.sandboxes),
        n(q.vcpus),
        n(q.memory_mib),
        n(q.disk_mib)
    )
}

fn print_project(p: &ProjectInfo, json: bool) {
    if json {
        let doc = serde_json::json!({
            "path": p.path,
            "limit": quota_json(&p.limit),
            "used": quota_json(&p.used),
            "delegated": quota_json(&p.delegated),
        });
        println!("{doc}");
    } else {
        println!(
            "{}\n  limit:     {}\n  used:      {}\n  delegated: {}",
            p.path,
            quota_text(&p.limit),
            quota_text(&p.used),
            quota_text(&p.delegated)
        );
    }
}

fn quota_json(q: &Option<Quota>) -> serde_json::Value {
    let q = (*q).unwrap_or_default();
    serde_json::json!({"sandboxes": q.sandboxes, "vcpus": q.vcpus, "memory_mib": q.memory_mib, "disk_mib": q.disk_mib})
}

fn token_json(t: &TokenInfo) -> serde_json::Value {
    serde_json::json!({
        "id": t.id, "principal": t.principal, "description": t.description,
        "created_unix_ms": t.created_unix_ms, "expires_unix_ms": t.expires_unix_ms,
        "revoked_unix_ms": t.revoked_unix_ms,
    })
}

fn node_json(n: &NodeSummary) -> serde_json::Value {
    serde_json::json!({
        "name": n.name, "address": n.address, "cordoned": n.cordoned, "draining": n.draining,
        "capacity": quota_json(&n.capacity), "allocated": quota_json(&n.allocated),
        "backends": n.backends, "labels": n.labels, "heartbeat_unix_ms": n.heartbeat_unix_ms,
    })
}

fn revoked_json(r: &RevokedNode) -> serde_json::Value {
    serde_json::json!({
        "name": r.name, "revoked": true, "all_certificates": r.all_certificates,
        "fingerprints": r.fingerprints, "revoked_unix_ms": r.revoked_unix_ms,
        "revoked_by": r.revoked_by,
    })
}

fn revoked_text(r: &RevokedNode) -> String {
    let which = if r.all_certificates {
        "every certificate".to_string()
    } else {
        format!("certificates {}", r.fingerprints.join(", "))
    };
    format!("{:<8} revoked: {which} (by {})", r.name, r.revoked_by)
}

/// Runs one cluster command against the apiserver at `endpoint`.
pub async fn run(endpoint: &str, command: ClusterCommand, json: bool) -> Result<i32> {
    let credentials = Credentials::from_env();
    match command {
        ClusterCommand::Login { token, project } => {
            let project = project
                .or_else(|| std::env::var("DSEC_PROJECT").ok())
                .unwrap_or_default();
            let ca_file = std::env::var("DSEC_CA_FILE").unwrap_or_default();
            let credentials = Credentials::new(Some(&token), Some(&project))
                .with_ca_file((!ca_file.is_empty()).then(|| PathBuf::from(&ca_file)));
            let mut c = admin(endpoint, credentials).await?;
            let who = c.who_am_i(WhoAmIRequest {}).await?.into_inner();
            let path = Login {
                endpoint: endpoint.to_string(),
                token,
                project,
                ca_file,
            }
            .save()?;
            if json {
                println!(
                    "{}",
                    serde_json::json!({"principal": who.principal, "token_id": who.token_id, "cluster_admin": who.cluster_admin, "roles": who.roles, "saved": path})
                );
            } else {
                println!(
                    "logged in as {} (token {}{}); saved to {}",
                    who.principal,
                    who.token_id,
                    if who.cluster_admin {
                        ", cluster admin"
                    } else {
                        ""
                    },
                    path.display()
                );
            }
        }
        ClusterCommand::Project(command) => {
            let mut c = admin(endpoint, credentials.clone()).await?;
            match command {
                ProjectCommand::Create { path } => {
                    let p = c
                        .create_project(CreateProjectRequest { path })
                        .await?
                        .into_inner();
                    print_project(&p, json);
                }
                ProjectCommand::Ls { path } => {
                    let path = path.unwrap_or_else(|| {
                        credentials
                            .project()
                            .split('/')
                            .next()
                            .unwrap_or_default()
                            .to_string()
                    });
                    let list = c
                        .list_projects(ListProjectsRequest { path })
                        .await?
                        .into_inner();
                    for p in &list.projects {
                        print_project(p, json);
                    }
                }
                ProjectCommand::Quota {
                    path,
                    sandboxes,
                    vcpus,
                    memory_mib,
                    disk_mib,
                } => {
                    let current = c
                        .list_projects(ListProjectsRequest { path: path.clone() })
                        .await?
                        .into_inner()
                        .projects
                        .into_iter()
                        .next()
                        .and_then(|p| p.limit)
                        .unwrap_or_default();
                    let p = if sandboxes.or(vcpus).or(memory_mib).or(disk_mib).is_none() {
                        c.list_projects(ListProjectsRequest { path })
                            .await?
                            .into_inner()
                            .projects
                            .into_iter()
                            .next()
                            .unwrap_or_default()
                    } else {
                        let limit = Quota {
                            sandboxes: sandboxes.unwrap_or(current.sandboxes),
                            vcpus: vcpus.unwrap_or(current.vcpus),
                            memory_mib: memory_mib.unwrap_or(current.memory_mib),
                            disk_mib: disk_mib.unwrap_or(current.disk_mib),
                        };
                        c.set_quota(SetQuotaRequest {
                            path,
                            limit: Some(limit),
                        })
                        .await?
                        .into_inner()
                    };
                    print_project(&p, json);
                }
            }
        }
        ClusterCommand::Token(command) => {
            let mut c = admin(endpoint, credentials).await?;
            match command {
                TokenCommand::Create {
                    principal,
                    description,
                    ttl,
                } => {
                    let t = c
                        .create_token(CreateTokenRequest {
                            principal: principal.unwrap_or_default(),
                            description,
                            ttl_seconds: ttl.unwrap_or(0),
                        })
                        .await?
                        .into_inner();
                    if json {
                        let info = t.info.as_ref().map(token_json);
                        println!("{}", serde_json::json!({"token": t.token, "info": info}));
                    } else {
                        println!("{}", t.token);
                    }
                }
                TokenCommand::Ls { principal } => {
                    let list = c
                        .list_tokens(ListTokensRequest {
                            principal: principal.unwrap_or_default(),
                        })
                        .await?
                        .into_inner();
                    for t in &list.tokens {
                        if json {
                            println!("{}", token_json(t));
                        } else {
                            let state = if t.revoked_unix_ms > 0 {
                                "revoked"
                            } else {
                                "valid"
                            };
                            println!("{}  {}  {}  {}", t.id, t.principal, state, t.description);
                        }
                    }
                }
                TokenCommand::Revoke { id } => {
                    let t = c
                        .revoke_token(RevokeTokenRequest { id })
                        .await?
                        .into_inner();
                    if json {
                        println!("{}", token_json(&t));
                    } else {
                        println!("revoked {}", t.id);
                    }
                }
            }
        }
        ClusterCommand::Account(AccountCommand::Create { principal, name }) => {
            let mut c = admin(endpoint, credentials).await?;
            let made = c
                .create_principal(CreatePrincipalRequest {
                    principal,
                    display_name: name,
                })
                .await?
                .into_inner();
            println!("{}", made.principal);
        }
        ClusterCommand::Role(command) => {
            let mut c = admin(endpoint, credentials).await?;
            let (principal, project, role) = match command {
                RoleCommand::Grant {
                    principal,
                    project,
                    role,
                } => (principal, project, role),
                RoleCommand::Revoke { principal, project } => (principal, project, String::new()),
            };
            c.set_role(SetRoleRequest {
                principal,
                project,
                role,
            })
            .await?;
        }
        ClusterCommand::Node(command) => {
            let mut c = admin(endpoint, credentials).await?;
            let mut revoked = Vec::new();
            let nodes = match command {
                NodeCommand::Ls => {
                    let listed = c.list_nodes(ListNodesRequest {}).await?.into_inner();
                    revoked = listed.revoked;
                    listed.nodes
                }
                NodeCommand::Cordon { name, undo } => {
                    vec![c
                        .cordon_node(NodeAdminRequest { name, undo })
                        .await?
                        .into_inner()]
                }
                NodeCommand::Drain { name, undo } => {
                    vec![c
                        .drain_node(NodeAdminRequest { name, undo })
                        .await?
                        .into_inner()]
                }
                NodeCommand::Revoke {
                    name,
                    fingerprint,
                    undo,
                } => {
                    let revoked = c
                        .revoke_node(RevokeNodeRequest {
                            name,
                            fingerprint: fingerprint.unwrap_or_default(),
                            undo,
                        })
                        .await?
                        .into_inner();
                    if json {
                        println!("{}", revoked_json(&revoked));
                    } else if undo {
                        println!("node {}: revocations lifted", revoked.name);
                    } else {
                        println!("{}", revoked_text(&revoked));
                    }
                    return Ok(0);
                }
            };
            for r in &revoked {
                if json {
                    println!("{}", revoked_json(r));
                } else {
                    println!("{}", revoked_text(r));
                }
            }
            for n in &nodes {
                if json {
                    println!("{}", node_json(n));
                } else {
                    let flags = match (n.cordoned, n.draining) {
                        (_, true) => "draining",
                        (true, false) => "cordoned",
                        _ => "ready",
                    };
                    println!(
                        "{:<8} {:<22} {:<9} allocated {} of {}",
                        n.name,
                        n.address,
                        flags,
                        quota_text(&n.allocated),
                        quota_text(&n.capacity)
                    );
                }
            }
        }
    }
    Ok(0)
}
