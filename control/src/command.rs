//! The command line of `dsec-control` and `dsec control`: `up` serves the apiserver, `init`
//! creates a fresh control plane's first organization and admin.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use dsec_api::tls::TlsDir;

use crate::api::{self, ApiConfig, StoreConfig};
use crate::pki::{self, PkiError};
use crate::revocation;

#[derive(clap::Args, Debug, Clone)]
pub struct StoreArgs {
    /// etcd endpoints (comma-separated, e.g. http://10.0.0.1:2379,http://10.0.0.2:2379);
    /// without it the embedded store under --state-dir (one apiserver only).
    #[arg(long, value_name = "URL[,URL]")]
    pub etcd: Option<String>,
    /// Key prefix in etcd, so that clusters can share one etcd.
    #[arg(long, default_value = "dsec")]
    pub etcd_namespace: String,
    /// Directory of the embedded store.
    #[arg(long, value_name = "DIR", default_value = "/var/lib/dsec/control")]
    pub state_dir: PathBuf,
}

impl StoreArgs {
    fn config(&self) -> StoreConfig {
        match &self.etcd {
            Some(urls) => StoreConfig::Etcd {
                endpoints: urls
                    .split(',')
                    .map(str::trim)
                    .filter(|u| !u.is_empty())
                    .map(|u| {
                        if u.contains("://") {
                            u.to_string()
                        } else {
                            format!("http://{u}")
                        }
                    })
                    .collect(),
                namespace: format!("/{}", self.etcd_namespace.trim_matches('/')),
            },
            None => StoreConfig::Embedded(self.state_dir.clone()),
        }
    }
}

#[derive(clap::Subcommand, Debug, Clone)]
pub enum ControlCommand {
    /// Serve the apiserver: the public API over the cluster's nodes, the admin API and the
    /// node registry.
    Up {
        #[command(flatten)]
        store: StoreArgs,
        /// Where clients and nodes reach this apiserver.
        #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:7000")]
        listen: SocketAddr,
        /// Lease of a node's registration in seconds (nodes heartbeat every third of it).
        #[arg(long, value_name = "S", default_value_t = 10)]
        node_ttl: u64,
        /// The cluster's TLS directory from `init` (ca.pem, apiserver.pem, apiserver.key):
        /// clients get TLS, nodes mTLS. Without it the API is plaintext (loopback only).
        #[arg(long, value_name = "DIR")]
        tls_dir: Option<PathBuf>,
    },
    /// Create a fresh control plane's organization (unlimited quota) and its first user (a
    /// cluster admin); prints that user's API token, once.
    Init {
        #[command(flatten)]
        store: StoreArgs,
        #[arg(long, default_value = "default")]
        org: String,
        #[arg(long, default_value = "admin")]
        admin: String,
        /// Where the cluster CA (ca.pem, ca.key) and the apiservers' certificate go
        /// (default: <state-dir>/tls); an existing CA there is kept.
        #[arg(long, value_name = "DIR")]
        tls_dir: Option<PathBuf>,
        /// Another name or IP address clients reach the apiservers at, for its certificate
        /// (repeatable; apiserver.dsec, localhost and 127.0.0.1 are always in).
        #[arg(long = "san", value_name = "NAME|IP")]
        sans: Vec<String>,
        /// Make no cluster CA (plaintext, one machine).
        #[arg(long)]
        no_tls: bool,
    },
    /// Serve simulated nodes for benchmarks: each speaks the node API on its own port,
    /// registers with the apiservers and admits creates against a fake capacity, starting
    /// nothing.
    SimNodes {
        /// How many (named <prefix>0, <prefix>1, ...).
        #[arg(long, default_value_t = 160)]
        count: usize,
        #[arg(long, default_value = "s")]
        prefix: String,
        /// The first node's address; the others take the ports after it.
        #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:21000")]
        first: SocketAddr,
        /// Apiservers to register with (comma-separated host:port).
        #[arg(long, value_name = "ADDR[,ADDR]")]
        control: String,
        /// Sandboxes each node admits.
        #[arg(long, default_value_t = 1000)]
        sandboxes: u64,
        /// The cluster's TLS directory from `init` (ca.pem, ca.key): each sim node gets its
        /// own certificate (under DIR/sim-nodes/) and uses mTLS as a real node does.
        #[arg(long, value_name = "DIR")]
        tls_dir: Option<PathBuf>,
    },
    /// Issue apiserver replica NAME its own certificate from the cluster CA: writes
    /// apiserver.pem, apiserver.key and ca.pem into --out (its `up --tls-dir`) and prints the
    /// certificate's SHA-256 fingerprint. A replica with its own key can be revoked alone.
    IssueApiserver {
        #[command(flatten)]
        issue: IssueArgs,
        /// Another name or IP address clients reach this replica at (repeatable).
        #[arg(long = "san", value_name = "NAME|IP")]
        sans: Vec<String>,
    },
    /// Revoke an apiserver certificate cluster-wide (a replica's key leaked): every node
    /// refuses it in its TLS handshake and closes its open connections within one heartbeat
    /// interval (a third of the node TTL). Writes to the store directly; `--list` shows the
    /// list, `--undo` lifts an entry.
    RevokeApiserver {
        #[command(flatten)]
        store: StoreArgs,
        /// The certificate's SHA-256 fingerprint (from `issue-apiserver`, or `openssl x509
        /// -noout -fingerprint -sha256`), or a replica name (every certificate naming
        /// NAME.apiserver.dsec).
        #[arg(value_name = "NAME|FINGERPRINT", required_unless_present = "list")]
        entry: Option<String>,
        #[arg(long)]
        undo: bool,
        #[arg(long, conflicts_with = "entry")]
        list: bool,
    },
    /// Issue node NAME's certificate from the cluster CA: writes node.pem, node.key and
    /// ca.pem into --out, the node's `dsec up --tls-dir`.
    IssueNode {
        #[command(flatten)]
        issue: IssueArgs,
    },
}

/// Where a certificate comes from and goes.
#[derive(clap::Args, Debug, Clone)]
pub struct IssueArgs {
    /// The cluster's TLS directory (with ca.key).
    #[arg(long, value_name = "DIR", default_value = "/var/lib/dsec/control/tls")]
    pub tls_dir: PathBuf,
    /// The node's name (its --node-name), or the apiserver replica's (1-32 of a-z, 0-9 and
    /// '-'; its certificate also names NAME.apiserver.dsec).
    #[arg(long, value_name = "NAME")]
    pub name: String,
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
}

/// Runs a control command with logging on stderr; the exit code says how it went.
pub fn run(command: ControlCommand) -> ExitCode {
    let filter = tracing_subscriber::EnvFilter::try_from_env("DSEC_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("dsec-control: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match command {
            ControlCommand::Up {
                store,
                listen,
                node_ttl,
                tls_dir,
            } => {
                if !(1..=3600).contains(&node_ttl) {
                    return Err(format!("--node-ttl {node_ttl}: give 1 to 3600 seconds"));
                }
                let store = store.config().open().await.map_err(|e| e.to_string())?;
                let config = ApiConfig {
                    listen,
                    node_ttl: Duration::from_secs(node_ttl),
                    tls: tls_dir.map(TlsDir::new),
                    ..ApiConfig::default()
                };
                api::serve(store, config).await
            }
            ControlCommand::Init {
                store,
                org,
                admin,
                tls_dir,
                sans,
                no_tls,
            } => {
                if !no_tls {
                    let dir = tls_dir.unwrap_or_else(|| store.state_dir.join("tls"));
                    match pki::init(&dir, &sans) {
                        Ok(()) => eprintln!(
                            "cluster CA and apiserver certificate written to {}",
                            dir.display()
                        ),
                        Err(PkiError::Exists(ca)) => {
                            eprintln!("keeping the cluster CA already in {}", ca.display())
                        }
                        Err(e) => return Err(e.to_string()),
                    }
                }
                let store = store.config().open().await.map_err(|e| e.to_string())?;
                let token = api::init(store, &org, &admin).await?;
                println!("{}", token.secret);
                eprintln!(
                    "organization {org} and cluster admin user:{admin} created; the token above is shown once: export DSEC_TOKEN=... or `dsec login`"
                );
                Ok(())
            }
            ControlCommand::SimNodes {
                count,
                prefix,
                first,
                control,
                sandboxes,
                tls_dir,
            } => {
                let capacity = crate::sim::SimCapacity {
                    sandboxes,
                    vcpus: sandboxes * 4,
                    memory_mib: sandboxes * 4096,
                    disk_mib: sandboxes * 8192,
                };
                let control = control
                    .split(',')
                    .map(str::trim)
                    .filter(|a| !a.is_empty())
                    .map(str::to_string)
                    .collect();
                crate::sim::serve(
                    &prefix,
                    count,
                    first,
                    capacity,
                    control,
                    tls_dir,
                    Default::default(),
                )
                .await
            }
            ControlCommand::IssueApiserver {
                issue: IssueArgs { tls_dir, name, out },
                sans,
            } => {
                let fingerprint = pki::issue_apiserver(&tls_dir, &out, &name, &sans)
                    .map_err(|e| e.to_string())?;
                println!("{fingerprint}");
                eprintln!(
                    "certificate of apiserver replica {name} written to {} (serve it with `up --tls-dir {}`); its SHA-256 fingerprint is above",
                    out.display(),
                    out.display()
                );
                Ok(())
            }
            ControlCommand::RevokeApiserver {
                store,
                entry,
                undo,
                list: _,
            } => {
                let store = store.config().open().await.map_err(|e| e.to_string())?;
                let store = store.as_ref();
                match entry {
                    Some(entry) if undo => {
                        let lifted = revocation::lift_apiserver(store, &entry)
                            .await
                            .map_err(|e| e.to_string())?;
                        eprintln!(
                            "{entry}: {}",
                            if lifted { "revocation lifted" } else { "was not revoked" }
                        );
                    }
                    Some(entry) => {
                        let by = std::env::var("USER").unwrap_or_else(|_| "operator".into());
                        let record = revocation::revoke_apiserver(store, &entry, &by)
                            .await
                            .map_err(|e| e.to_string())?;
                        eprintln!(
                            "{}: revoked; nodes refuse it from their next heartbeat",
                            record.entry
                        );
                    }
                    None => {
                        for record in revocation::revoked_apiservers(store)
                            .await
                            .map_err(|e| e.to_string())?
                        {
                            println!("{}\t{}\t{}", record.entry, record.revoked_ms, record.by);
                        }
                    }
                }
                Ok(())
            }
            ControlCommand::IssueNode {
                issue: IssueArgs { tls_dir, name, out },
            } => {
                pki::issue_node(&tls_dir, &out, &name).map_err(|e| e.to_string())?;
                eprintln!(
                    "certificate of node {name} written to {} (start it with --tls-dir {})",
                    out.display(),
                    out.display()
                );
                Ok(())
            }
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("dsec-control: {e}");
            ExitCode::FAILURE
        }
    }
}
