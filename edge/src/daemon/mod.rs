//! The node daemon: serves the public `dsec.v1` API on a Unix socket (and optionally TCP),
//! supervises sandboxes, admits them against budgets, reaps them, survives its own restart.
//!
//! State lives under `state_dir` (default `${DSEC_RUN_DIR:-/run/dsec}/edge`):
//! `edge.sock`, `edge.lock`, `sandboxes/<id>/{meta.json,events.log,agent.log,...}`,
//! `snapshots/`. Sandboxes run in their own sessions, so they outlive a daemon that is killed;
//! the next daemon re-adopts them from `meta.json` and removes everything else.

mod admission;
mod adoption;
pub mod cgroup;
mod create;
pub mod error;
pub mod fncall;
mod fork;
pub mod grpc;
pub mod limits;
mod memory_base;
pub mod metrics;
pub mod network;
pub mod node;
pub mod ports;
mod reaper;
pub mod record;
pub mod registration;
mod request_ids;
mod restore;
mod runtime;
mod status;
mod suspend;
mod templates;
mod vmm_control;

use std::ffi::OsString;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::time::Duration;

use dsec_api::v1::files_server::FilesServer;
use dsec_api::v1::network_labels_server::NetworkLabelsServer;
use dsec_api::v1::network_server::NetworkServer;
use dsec_api::v1::ports_server::PortsServer;
use dsec_api::v1::process_server::ProcessServer;
use dsec_api::v1::sandboxes_server::SandboxesServer;
use dsec_api::v1::sessions_server::SessionsServer;
use tokio_stream::wrappers::UnixListenerStream;

use crate::backend::BackendKind;
use crate::error::EdgeError;
use crate::paths::Artifacts;

pub use admission::{memory_limit_mib, Budget, Budgets, Demand};
pub use create::{CreatePlan, ImagePlan, Plan};
pub use error::NodeError;
pub use node::Node;
pub use request_ids::{Claim, CreateOutcome};

/// Port of the default HTTP entry point (127.0.0.1:7080).
pub const DEFAULT_HTTP_PORT: u16 = 7080;

/// Everything the daemon needs; `Default` gives the embedded single-node defaults.
#[derive(Clone, Debug)]
pub struct DaemonConfig {
    pub state_dir: PathBuf,
    /// Unix socket of the API; default `<state_dir>/edge.sock`.
    pub listen_unix: Option<PathBuf>,
    /// Optional TCP address of the API (e.g. 127.0.0.1:7070).
    pub listen_tcp: Option<SocketAddr>,
    /// The cluster's TLS directory (ca.pem, node.pem, node.key): the TCP API then takes only
    /// callers with a certificate of the cluster CA (the apiservers), and registration is
    /// mTLS.
    pub tls: Option<dsec_api::tls::TlsDir>,
    /// Prometheus /metrics address; None disables it.
    pub metrics: Option<SocketAddr>,
    /// HTTP entry point to servers in sandboxes (Host `PORT-ID.<anything>`); None disables it.
    pub http: Option<SocketAddr>,
    /// The operator asked for these addresses (not the defaults): the start fails when one
    /// cannot be bound, rather than running without it.
    pub metrics_required: bool,
    pub http_required: bool,
    /// Open connections the HTTP entry point serves at once; more get 503 at once.
    pub http_max_connections: usize,
    pub artifacts: Artifacts,
    pub agent_bin: Option<PathBuf>,
    pub vmm_bin: Option<PathBuf>,
    /// Backend for requests that do not name one; default: microVM where it can run.
    pub default_backend: Option<BackendKind>,
    /// Capacities (default: detected) and overcommit ratios of the admission budgets.
    pub memory_mib: Option<u64>,
    pub cpus: Option<u64>,
    pub pids: Option<u64>,
    pub disk_mib: Option<u64>,
    pub overcommit_memory: f64,
    pub overcommit_cpu: f64,
    /// Disk sizes are ceilings of sparse writable layers, so they are overcommitted too.
    pub overcommit_disk: f64,
    /// TTL of sandboxes created without one.
    pub default_ttl: Option<Duration>,
    pub reap_interval: Duration,
    pub ready_timeout: Duration,
    /// Name of the daemon's cgroup under its own cgroup in each hierarchy.
    pub cgroup_name: String,
    /// Arguments that make this executable the daemon (`up` for `dsec`); image servers are
    /// started as this executable with these and `--serve-image DIR`.
    pub invocation: Vec<OsString>,
    /// Run microVMs' VMMs in a jail (namespaces, pivot_root, unprivileged uid); needs root.
    pub jail_vmms: bool,
    /// Prewarmed VMMs kept per memory/vCPU shape for restores (jailed VMMs only); 0: none.
    pub vmm_pool: usize,
    /// Prewarmed VMMs kept per FnCall VM pool (image, language).
    pub fncall_vm_pool: usize,
    /// This node's name in a cluster: its sandbox ids become `sb-<name>-<12 of a-z2-7>`.
    pub node_name: Option<String>,
    /// Apiservers to register with (needs `node_name` and a TCP API to advertise).
    pub registration: Option<registration::Registration>,
    /// The sandbox network (bridge, pool, named policies); None: containers get loopback only.
    pub network: Option<crate::net::NetConfig>,
}

impl Default for DaemonConfig {
    fn default() -> Self {
        let run_dir = std::env::var_os("DSEC_RUN_DIR")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/run/dsec"));
        Self {
            state_dir: run_dir.join("edge"),
            listen_unix: None,
            listen_tcp: None,
            tls: None,
            metrics: Some(SocketAddr::from(([127, 0, 0, 1], 9464))),
            http: Some(SocketAddr::from(([127, 0, 0, 1], DEFAULT_HTTP_PORT))),
            metrics_required: false,
            http_required: false,
            http_max_connections: 4096,
            artifacts: Artifacts::from_env(),
            agent_bin: None,
            vmm_bin: None,
            default_backend: None,
            memory_mib: None,
            cpus: None,
            pids: None,
            disk_mib: None,
            overcommit_memory: 1.5,
            // ~90% of sandboxes use <= 5% of the CPU they ask for.
            overcommit_cpu: 64.0,
            overcommit_disk: 8.0,
            default_ttl: None,
            reap_interval: Duration::from_millis(500),
            ready_timeout: Duration::from_secs(30),
            cgroup_name: "dsec-edge".into(),
            invocation: Vec::new(),
            jail_vmms: nix::unistd::geteuid().is_root(),
            vmm_pool: crate::backend::vmm_pool::DEFAULT_POOL_SIZE,
            fncall_vm_pool: dsec_fncall::vm::DEFAULT_VM_POOL_SIZE,
            node_name: None,
            registration: None,
            network: None,
        }
    }
}

impl DaemonConfig {
    pub fn socket_path(&self) -> PathBuf {
        self.listen_unix
            .clone()
            .unwrap_or_else(|| self.state_dir.join("edge.sock"))
    }
}

/// Takes an exclusive lock on the state directory (one daemon per state dir).
fn lock_state_dir(config: &DaemonConfig) -> Result<std::fs::File, EdgeError> {
    std::fs::create_dir_all(&config.state_dir)
        .map_err(|e| EdgeError::io(format!("create {}", config.state_dir.display()), e))?;
    let path = config.state_dir.join("edge.lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| EdgeError::io(format!("open {}", path.display()), e))?;
    // SAFETY: flock on a descriptor we own; no memory is involved.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc != 0 {
        return Err(EdgeError::Protocol(format!(
            "another dsec-edge already serves {} (lock {} is held): stop it or use another --state-dir",
            config.state_dir.display(),
            path.display()
        )));
    }
    Ok(file)
}

/// The listener of `flag`'s address: a failure is an error when the operator gave the
/// address, else a warning (the default address may be taken by another daemon).
async fn bind_listener(
    flag: &str,
    addr: Option<SocketAddr>,
    required: bool,
) -> Result<Option<tokio::net::TcpListener>, EdgeError> {
    let Some(addr) = addr else {
        return Ok(None);
    };
    match tokio::net::TcpListener::bind(addr).await {
        Ok(listener) => Ok(Some(listener)),
        Err(err) if required => Err(EdgeError::io(
            format!("bind {flag} {addr} (in use? pick another address or pass {flag} off)"),
            err,
        )),
        Err(err) => {
            tracing::warn!(%addr, %err, "{flag}: cannot serve the default address (in use?): running without it");
            Ok(None)
        }
    }
}

/// Runs the daemon until SIGINT/SIGTERM. Sandboxes keep running when it stops.
pub async fn run(config: DaemonConfig) -> Result<(), EdgeError> {
    let _lock = lock_state_dir(&config)?;
    let socket = config.socket_path();
    // Bound before the node starts: an address the operator asked for that is in use stops
    // the start before anything was made.
    let metrics_listener =
        bind_listener("--metrics", config.metrics, config.metrics_required).await?;
    let http_listener = bind_listener("--http", config.http, config.http_required).await?;
    if let Some(addr) = metrics_listener.as_ref().and_then(|l| l.local_addr().ok()) {
        tracing::info!(%addr, "metrics on http://{addr}/metrics");
    }
    if let Some(bound) = http_listener.as_ref().and_then(|l| l.local_addr().ok()) {
        tracing::info!(%bound, "HTTP entry point: http://PORT-SANDBOXID-TOKEN.localhost:{}/", bound.port());
    }
    let node = Node::start(config.clone()).await?;
    tokio::spawn(node.clone().reaper());
    tokio::spawn(network::report_denied(node.clone()));

    let _ = std::fs::remove_file(&socket);
    let unix = tokio::net::UnixListener::bind(&socket)
        .map_err(|e| EdgeError::io(format!("bind {}", socket.display()), e))?;
    // Root-only, like the rest of the node's state.
    use std::os::unix::fs::PermissionsExt;
    let _ = std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o600));

    if let Some(listener) = metrics_listener {
        tokio::spawn(metrics::serve(node.clone(), listener));
    }
    let http = match http_listener {
        Some(listener) => {
            let bound = listener.local_addr().ok();
            tokio::spawn(ports::serve_http(
                node.clone(),
                listener,
                config.http_max_connections,
            ));
            bound
        }
        None => None,
    };
    let fn_engine = fncall::start(&node, config.fncall_vm_pool);
    let router = |mut builder: tonic::transport::Server, require_token: bool| {
        builder
            .add_service(dsec_fncall::grpc::server(fn_engine.clone()))
            .add_service(SandboxesServer::new(grpc::SandboxesService(node.clone())))
            .add_service(
                ProcessServer::new(runtime::ProcessService(node.clone()))
                    .max_decoding_message_size(16 << 20),
            )
            .add_service(
                FilesServer::new(runtime::FilesService(node.clone()))
                    .max_decoding_message_size(16 << 20),
            )
            .add_service(SessionsServer::new(runtime::SessionsService(node.clone())))
            .add_service(NetworkServer::new(network::NetworkService(node.clone())))
            .add_service(NetworkLabelsServer::new(network::NetworkService(
                node.clone(),
            )))
            .add_service(
                PortsServer::new(ports::PortsService {
                    node: node.clone(),
                    http,
                    require_token,
                })
                .max_decoding_message_size(ports::MAX_CHUNK + 1024),
            )
    };
    let shutdown = async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("install SIGTERM handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        tracing::info!("stopping; sandboxes keep running and are adopted by the next daemon");
    };
    let revoked_apiservers = dsec_api::tls::RevokedApiservers::new(config.registration.is_none());
    if let Some(addr) = config.listen_tcp {
        let tcp = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| EdgeError::io(format!("bind {addr}"), e))?;
        // Anyone who can reach the TCP address may call it: private ports need the token.
        // With the cluster's TLS only apiservers can (their certificate's role is checked in
        // the handshake: another node's certificate of the same CA is refused).
        // In a cluster the apiservers' revoked certificates are refused too (the list comes
        // with every registration reply; none is trusted before the first).
        let acceptor = match &config.tls {
            Some(tls) => Some(
                tls.node_acceptor_with(&revoked_apiservers)
                    .map_err(|e| EdgeError::InvalidSpec(e.to_string()))?,
            ),
            None => None,
        };
        let connections = revoked_apiservers.connections();
        tracing::info!(%addr, tls = acceptor.is_some(), "API on tcp");
        let server = router(tonic::transport::Server::builder(), true);
        tokio::spawn(async move {
            let served = match acceptor {
                Some(acceptor) => {
                    server
                        .serve_with_incoming(dsec_api::tls::accept_closable(
                            tcp,
                            acceptor,
                            connections,
                        ))
                        .await
                }
                None => {
                    // Replies go out at once (Nagle would hold a reply's second write for
                    // the caller's delayed ACK, ~40 ms).
                    server
                        .serve_with_incoming(
                            tonic::transport::server::TcpIncoming::from(tcp)
                                .with_nodelay(Some(true)),
                        )
                        .await
                }
            };
            if let Err(err) = served {
                tracing::error!(%err, "TCP API server failed");
            }
        });
    }
    let lease = std::sync::Arc::new(registration::Lease::default());
    if let Some(cluster) = config.registration.clone() {
        tokio::spawn(registration::run(
            node.clone(),
            cluster,
            lease.clone(),
            revoked_apiservers,
        ));
    }
    tracing::info!(socket = %socket.display(), sandboxes = node.count(), "dsec-edge ready");
    println!("dsec-edge ready on unix:{}", socket.display());
    // The Unix socket is root-only (0600): its callers can run anything in any sandbox.
    router(tonic::transport::Server::builder(), false)
        .serve_with_incoming_shutdown(UnixListenerStream::new(unix), shutdown)
        .await
        .map_err(|e| EdgeError::Protocol(format!("API server: {e}")))?;
    registration::deregister(&lease).await;
    if let Some(pool) = &node.edge.vmm_pool {
        pool.close();
    }
    let _ = std::fs::remove_file(&socket);
    // Image mounts of running sandboxes stay (the sandboxes do); the rest are unmounted.
    let in_use = node
        .list()
        .iter()
        .filter_map(|e| e.record().image_mount)
        .collect();
    node.images.stop_unused(&in_use).await;
    // FnCall workers die with the daemon: their links on the sandbox network go now.
    let edge = node.edge.clone();
    let _ = tokio::task::spawn_blocking(move || fncall::release_links_at_stop(&edge)).await;
    // The bridge and table go with the last sandbox; running ones keep their network for
    // the next daemon.
    if let Some(net) = node.edge.network.clone() {
        if node.count() == 0 {
            let _ = tokio::task::spawn_blocking(move || net.stop()).await;
        }
    }
    Ok(())
}

/// Command-line options of the daemon (`dsec-edge`, `dsec up`).
#[derive(clap::Args, Debug, Clone)]
pub struct DaemonArgs {
    /// State directory (sockets, sandbox records, logs). Default: ${DSEC_RUN_DIR:-/run/dsec}/edge.
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
    /// Unix socket of the API. Default: <state-dir>/edge.sock.
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,
    /// Also serve the API on TCP (e.g. 127.0.0.1:7070).
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<SocketAddr>,
    /// Prometheus metrics address; "off" disables [default: 127.0.0.1:9464, served only
    /// while free; an address given here must be free or the start fails].
    #[arg(long, value_name = "ADDR|off")]
    pub metrics: Option<String>,
    /// HTTP entry point to servers in sandboxes: a request with Host `PORT-SANDBOXID-TOKEN.<any
    /// domain>` (e.g. http://8080-sb-0123456789ab-TOKEN.localhost:7080/, see `dsec url`), or
    /// Host `PORT-SANDBOXID.<domain>` and header `X-Dsec-Access-Token: TOKEN`, is piped to
    /// 127.0.0.1:PORT inside the sandbox (public ports need no token); "off" disables
    /// [default: 127.0.0.1:7080, served only while free; an address given here must be free
    /// or the start fails].
    #[arg(long, value_name = "ADDR|off")]
    pub http: Option<String>,
    /// Connections the HTTP entry point serves at once (each is a stream to a sandbox); more
    /// are answered 503 at once.
    #[arg(long, value_name = "N", default_value_t = 4096)]
    pub http_max_connections: usize,
    /// Backend for requests that name none: container or microvm (default: microvm where
    /// hardware KVM can run it, else container).
    #[arg(long, value_name = "KIND")]
    pub default_backend: Option<String>,
    /// Memory capacity for admission in MiB (default: host memory).
    #[arg(long, value_name = "MiB")]
    pub memory_mib: Option<u64>,
    /// CPU capacity for admission (default: host cores).
    #[arg(long)]
    pub cpus: Option<u64>,
    /// Pid budget: sum of per-sandbox pid limits (default: 8 x pid_max).
    #[arg(long)]
    pub pids: Option<u64>,
    /// Disk capacity in MiB (default: free space of the state dir).
    #[arg(long, value_name = "MiB")]
    pub disk_mib: Option<u64>,
    /// Memory overcommit ratio (admitted memory <= capacity x ratio).
    #[arg(long, default_value_t = 1.5)]
    pub overcommit_memory: f64,
    /// vCPU overcommit ratio.
    #[arg(long, default_value_t = 64.0)]
    pub overcommit_cpu: f64,
    /// Disk overcommit ratio.
    #[arg(long, default_value_t = 8.0)]
    pub overcommit_disk: f64,
    /// Default TTL in seconds for sandboxes created without one.
    #[arg(long, value_name = "S")]
    pub default_ttl: Option<u64>,
    /// cgroup name under the daemon's own cgroups.
    #[arg(long, default_value = "dsec-edge")]
    pub cgroup_name: String,
    /// Seconds a new sandbox's agent has to answer before the create fails.
    #[arg(long, value_name = "S", default_value_t = 30)]
    pub ready_timeout: u64,
    /// Run VMMs unjailed (debugging). By default a root daemon runs each microVM's VMM in its
    /// own namespaces, pivot_rooted into the sandbox's `jail` directory, as uid 65534.
    #[arg(long)]
    pub no_jail: bool,
    /// Prewarmed VMMs kept ready per memory/vCPU shape: template creates and snapshot
    /// restores take one instead of starting a VMM, and it is refilled in the background
    /// (jailed VMMs only; 0 turns the pool off).
    #[arg(long, value_name = "N", default_value_t = crate::backend::vmm_pool::DEFAULT_POOL_SIZE)]
    pub vmm_pool: usize,
    /// Prewarmed VMMs kept per FnCall VM pool (image, language; 1-16): each holds a VM
    /// shell and serves one call, so a small pool keeps refills from starving sandboxes.
    #[arg(long, value_name = "N", default_value_t = dsec_fncall::vm::DEFAULT_VM_POOL_SIZE)]
    pub fncall_vm_pool: usize,
    /// This node's name in a cluster (1-8 of a-z, 0-9, '-'): sandbox ids become
    /// `sb-<name>-<12 of a-z2-7>` and Create accepts ids the apiserver chose.
    #[arg(long, value_name = "NAME")]
    pub node_name: Option<String>,
    /// Register with these apiservers (`dsec control up`), comma-separated: heartbeats, and
    /// the cluster's creates arrive on `--listen`. Needs --node-name and --listen.
    #[arg(long, value_name = "ADDR[,ADDR]")]
    pub control: Option<String>,
    /// Address the apiservers reach this node's API at (default: the --listen address).
    #[arg(long, value_name = "HOST:PORT")]
    pub advertise: Option<String>,
    /// The cluster's TLS directory for this node (ca.pem, node.pem, node.key from `dsec
    /// control issue-node`): the --listen API takes only apiservers (mTLS) and registration
    /// checks the apiserver against the cluster CA.
    #[arg(long, value_name = "DIR")]
    pub tls_dir: Option<PathBuf>,
    /// Node label for placement (`--label gpu=a100`), repeatable.
    #[arg(long = "label", value_name = "K=V")]
    pub labels: Vec<String>,
    /// Sandbox network: a bridge of this name (1-11 of a-z, 0-9, _; also the nftables
    /// table's name), a veth per container sandbox, NAT to the uplink, default-deny policies
    /// in nftables. "off": containers have loopback only.
    #[arg(long, value_name = "NAME|off", default_value = "off")]
    pub net_bridge: String,
    /// Address pool of the sandbox network (default: the first 10.200-254.0.0/16 no host
    /// route overlaps); the bridge takes the first address.
    #[arg(long, value_name = "CIDR")]
    pub net_pool: Option<String>,
    /// Named network policies, a JSON object {"NAME": {"allow": [RULE...], "deny": [RULE...]}}
    /// (rules as in NetworkPolicy), referenced by name in sandboxes' policies.
    #[arg(long, value_name = "FILE")]
    pub policies: Option<PathBuf>,
    /// Upstream resolver of the node's DNS proxy (port 53; default: the host's first IPv4
    /// nameserver). Sandboxes resolve through the proxy on the bridge address, which
    /// answers only names their policy allows.
    #[arg(long, value_name = "ADDR")]
    pub net_dns: Option<std::net::Ipv4Addr>,
    /// Network namespaces (each with its veth on the bridge) kept ready for container
    /// creates; 0 makes each create's veth during the create.
    #[arg(long, value_name = "N", default_value_t = 4)]
    pub net_veth_pool: usize,
    /// Internal: serve one layer-store image's mount from DIR (started by the daemon).
    #[arg(long, value_name = "DIR", hide = true)]
    pub serve_image: Option<PathBuf>,
    /// Arguments that select the daemon in this executable (`up` for `dsec`).
    #[arg(skip)]
    pub invocation: Vec<OsString>,
}

/// `flag`'s value: HOST:PORT, or "off" (or empty) for none.
fn listener_address(flag: &str, value: &str) -> Result<Option<SocketAddr>, EdgeError> {
    match value {
        "off" | "" => Ok(None),
        addr => addr.parse().map(Some).map_err(|_| {
            EdgeError::InvalidSpec(format!("{flag} {addr:?}: expected HOST:PORT or off"))
        }),
    }
}

impl DaemonArgs {
    pub fn into_config(self) -> Result<DaemonConfig, EdgeError> {
        let mut config = DaemonConfig::default();
        if let Some(dir) = self.state_dir {
            config.state_dir = dir;
        }
        config.listen_unix = self.socket;
        config.listen_tcp = self.listen;
        config.tls = self.tls_dir.clone().map(dsec_api::tls::TlsDir::new);
        config.jail_vmms &= !self.no_jail;
        if self.vmm_pool > 64 {
            return Err(EdgeError::InvalidSpec(format!(
                "--vmm-pool {}: at most 64 prewarmed VMMs per shape",
                self.vmm_pool
            )));
        }
        config.vmm_pool = self.vmm_pool;
        if !(1..=16).contains(&self.fncall_vm_pool) {
            return Err(EdgeError::InvalidSpec(format!(
                "--fncall-vm-pool {}: 1 to 16 prewarmed VMMs per FnCall VM pool",
                self.fncall_vm_pool
            )));
        }
        config.fncall_vm_pool = self.fncall_vm_pool;
        if self.ready_timeout == 0 {
            return Err(EdgeError::InvalidSpec(
                "--ready-timeout must be at least 1 second".into(),
            ));
        }
        config.ready_timeout = Duration::from_secs(self.ready_timeout);
        if let Some(metrics) = self.metrics.as_deref() {
            config.metrics = listener_address("--metrics", metrics)?;
            config.metrics_required = true;
        }
        if let Some(http) = self.http.as_deref() {
            config.http = listener_address("--http", http)?;
            config.http_required = true;
        }
        if self.http_max_connections == 0 {
            return Err(EdgeError::InvalidSpec(
                "--http-max-connections must be at least 1 (use --http off to disable)".into(),
            ));
        }
        config.http_max_connections = self.http_max_connections;
        config.default_backend = match self.default_backend.as_deref() {
            None | Some("auto") => None,
            Some("container") => Some(BackendKind::Container),
            Some("microvm") => Some(BackendKind::MicroVm),
            Some(other) => {
                return Err(EdgeError::InvalidSpec(format!(
                    "--default-backend {other:?}: expected container, microvm or auto"
                )))
            }
        };
        for (name, ratio) in [
            ("--overcommit-memory", self.overcommit_memory),
            ("--overcommit-cpu", self.overcommit_cpu),
            ("--overcommit-disk", self.overcommit_disk),
        ] {
            if !(ratio.is_finite() && ratio > 0.0) {
                return Err(EdgeError::InvalidSpec(format!(
                    "{name} must be a positive ratio, got {ratio}"
                )));
            }
        }
        config.memory_mib = self.memory_mib;
        config.cpus = self.cpus;
        config.pids = self.pids;
        config.disk_mib = self.disk_mib;
        config.overcommit_memory = self.overcommit_memory;
        config.overcommit_cpu = self.overcommit_cpu;
        config.overcommit_disk = self.overcommit_disk;
        config.default_ttl = self.default_ttl.map(Duration::from_secs);
        config.cgroup_name = self.cgroup_name;
        config.invocation = self.invocation;
        if let Some(name) = &self.node_name {
            if !dsec_api::sandbox_id::valid_node_name(name) {
                return Err(EdgeError::InvalidSpec(format!(
                    "--node-name {name:?}: give 1-8 of a-z, 0-9 and '-', not starting or ending with '-'"
                )));
            }
        }
        config.node_name = self.node_name.clone();
        config.network = match self.net_bridge.as_str() {
            "off" | "" => {
                if self.net_pool.is_some() || self.policies.is_some() || self.net_dns.is_some() {
                    return Err(EdgeError::InvalidSpec(
                        "--net-pool, --net-dns and --policies need a sandbox network: add --net-bridge NAME"
                            .into(),
                    ));
                }
                None
            }
            bridge => Some(crate::net::NetConfig {
                bridge: bridge.to_string(),
                pool: self
                    .net_pool
                    .as_deref()
                    .map(crate::net::parse_pool)
                    .transpose()?,
                policies: match &self.policies {
                    Some(file) => crate::net::NamedPolicies::load(file)
                        .map_err(|e| EdgeError::InvalidSpec(e.to_string()))?,
                    None => Default::default(),
                },
                resolver: self.net_dns,
                veth_pool: self.net_veth_pool,
            }),
        };
        if let Some(control) = &self.control {
            let node_name = self
                .node_name
                .clone()
                .ok_or_else(|| EdgeError::InvalidSpec("--control needs --node-name NAME".into()))?;
            let advertise = match (&self.advertise, config.listen_tcp) {
                (Some(addr), _) => addr.clone(),
                (None, Some(addr)) if !addr.ip().is_unspecified() => addr.to_string(),
                _ => {
                    return Err(EdgeError::InvalidSpec(
                        "--control needs --listen HOST:PORT (the apiservers call the node there) and, when it listens on all addresses, --advertise HOST:PORT".into(),
                    ))
                }
            };
            let mut labels = std::collections::BTreeMap::new();
            for label in &self.labels {
                let (k, v) = label.split_once('=').ok_or_else(|| {
                    EdgeError::InvalidSpec(format!("--label {label:?}: expected KEY=VALUE"))
                })?;
                labels.insert(k.to_string(), v.to_string());
            }
            let control: Vec<String> = control
                .split(',')
                .map(str::trim)
                .filter(|a| !a.is_empty())
                .map(str::to_string)
                .collect();
            if control.is_empty() {
                return Err(EdgeError::InvalidSpec(
                    "--control needs at least one apiserver address".into(),
                ));
            }
            config.registration = Some(registration::Registration {
                node_name,
                control,
                advertise,
                labels,
                tls: config.tls.clone(),
            });
        }
        Ok(config)
    }
}

/// Entry point of `dsec-edge` and `dsec up`: logging, runtime, daemon.
pub fn main_with(args: DaemonArgs) -> std::process::ExitCode {
    let filter = tracing_subscriber::EnvFilter::try_from_env("DSEC_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
    if let Some(dir) = &args.serve_image {
        return match crate::images::serve_image(dir) {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(err) => {
                eprintln!("dsec-edge --serve-image: {err}");
                std::process::ExitCode::FAILURE
            }
        };
    }
    let result = args.into_config().and_then(|config| {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .map_err(|e| EdgeError::io("start the async runtime", e))?;
        runtime.block_on(run(config))
    });
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("dsec-edge: {err}");
            std::process::ExitCode::FAILURE
        }
    }
}
