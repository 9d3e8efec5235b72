//! `dsec`: run commands in fresh sandboxes, inspect what this host can run, start the node
//! daemon (`up`) and drive it (create, ls, exec, cp, ...).

mod allocator;
mod cluster;
mod cp;
mod fncall;
mod image;
mod net;
mod node;
mod tty;
mod vm;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};
use dsec_edge::daemon::cgroup::{self, Cgroups, Limits};
use dsec_edge::images::{Catalog, ImageSource, LocalMount};
use dsec_edge::{
    find_binary, parse_env, Artifacts, BackendKind, EdgeConfig, EdgeError, ExecSpec, KvmStatus,
    Sandbox, SandboxSpec,
};
use serde::Serialize;

#[derive(Parser, Debug)]
#[command(
    name = "dsec",
    version,
    about = "DSec sandboxes: run commands in fresh microVMs or containers"
)]
struct Cli {
    /// Node API endpoint (unix:/path, http://host:port, or an apiserver's https://host:port);
    /// default $DSEC_ENDPOINT or unix:/run/dsec/edge/edge.sock.
    #[arg(long, global = true)]
    endpoint: Option<String>,
    /// The cluster CA (ca.pem from `dsec control init`) an https:// endpoint is checked
    /// against; default $DSEC_CA_FILE.
    #[arg(long, global = true, value_name = "FILE")]
    ca_file: Option<PathBuf>,
    /// JSON output (node and image commands).
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

/// Each subcommand's arguments are built only when it is the one called: building the whole
/// tree (the daemon's and the control plane's flags included) was most of a `dsec` call's
/// start, ~450 ms of CPU in the rig's emulated L1.
#[derive(Subcommand, Debug)]
#[command(defer = true)]
enum Command {
    /// Run a command in a fresh sandbox, stream its output, exit with its exit code.
    Run(RunArgs),
    /// Drive single microVMs directly: boot, exec, pause, snapshot, restore, fork, rm.
    #[command(subcommand)]
    Vm(vm::VmCommand),
    /// Manage images in the layer store: import, ls, inspect, rm, pack, gc.
    Image(image::ImageArgs),
    /// Show KVM status, artifacts and versions on this host.
    Info,
    /// Start the node daemon with embedded defaults (same as `dsec-edge`).
    Up(Box<dsec_edge::daemon::DaemonArgs>),
    /// The cluster's apiserver: `up` serves it, `init` creates the first organization and
    /// cluster admin (same as `dsec-control`).
    #[command(subcommand)]
    Control(dsec_control::command::ControlCommand),
    /// Check an API token against the apiserver (--endpoint) and save endpoint, token and
    /// project for later commands (~/.config/dsec/login.json, mode 0600).
    Login {
        /// Default: $DSEC_TOKEN.
        #[arg(long)]
        token: Option<String>,
        /// Default project of Create and List (default: $DSEC_PROJECT).
        #[arg(long)]
        project: Option<String>,
    },
    /// Projects and their quotas (cluster).
    #[command(subcommand)]
    Project(cluster::ProjectCommand),
    /// API tokens (cluster).
    #[command(subcommand)]
    Token(cluster::TokenCommand),
    /// Users and service accounts (cluster).
    #[command(subcommand)]
    Account(cluster::AccountCommand),
    /// Roles on projects (cluster).
    #[command(subcommand)]
    Role(cluster::RoleCommand),
    /// The cluster's nodes: ls, cordon, drain.
    #[command(subcommand)]
    Node(cluster::NodeCommand),
    /// Create sandboxes on the node; prints their ids.
    Create {
        #[arg(long, default_value = "auto")]
        backend: String,
        #[arg(long, default_value = "")]
        image: String,
        #[arg(long, default_value_t = 0)]
        vcpus: i32,
        #[arg(long = "mem", value_name = "MiB", default_value_t = 0)]
        memory_mib: i64,
        #[arg(long = "disk", value_name = "MiB", default_value_t = 0)]
        disk_mib: i64,
        #[command(flatten)]
        sandbox: node::NewSandboxArgs,
        /// microVM: boot the kernel for real instead of restoring the image's template
        /// snapshot (the default).
        #[arg(long)]
        cold: bool,
    },
    /// List sandboxes (optionally only those with all the given labels).
    Ls {
        #[arg(long = "label", short = 'l', value_name = "K=V")]
        labels: Vec<String>,
    },
    /// Show one sandbox as JSON.
    Inspect {
        id: String,
    },
    /// Run a command in a sandbox; exits with its exit code. Output is streamed (nothing is
    /// kept; with --json the last 1 MiB of each stream). Without -i, stdin (when not a
    /// terminal) is streamed to the command as it reads it.
    Exec {
        /// Stream stdin to the command live.
        #[arg(short = 'i', long)]
        interactive: bool,
        /// Run the command on a pseudo-terminal sized like this one (stdin must be a
        /// terminal); with -i the local terminal goes raw and every key is forwarded.
        #[arg(short = 't', long)]
        tty: bool,
        id: String,
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
    /// An interactive login shell in a sandbox (bash if the image has it, else sh) on a
    /// pseudo-terminal. When stdin is not a terminal: a persistent shell session fed line
    /// by line from stdin instead.
    Shell {
        id: String,
    },
    /// Copy a file, or with -r a directory tree, streamed: `dsec cp [-r] ID:/path local` or
    /// `dsec cp [-r] local ID:/path` (into DST when it is an existing directory). Symlinks
    /// inside a tree are copied as symlinks, never followed; modes are kept.
    Cp {
        /// Copy directories recursively.
        #[arg(short = 'r', long)]
        recursive: bool,
        src: String,
        dst: String,
    },
    /// Show a sandbox's logs.
    Logs {
        id: String,
        #[arg(long, short = 'f')]
        follow: bool,
    },
    Pause {
        ids: Vec<String>,
    },
    Resume {
        ids: Vec<String>,
    },
    /// Fork a (microVM) sandbox.
    Fork {
        id: String,
        #[arg(long, short = 'n', default_value_t = 1)]
        count: i32,
    },
    /// Snapshot a running microVM sandbox to a new directory on its node; prints the path
    /// (what `dsec restore` takes).
    Snapshot {
        id: String,
        /// Directory to write (default: under the node's state dir).
        #[arg(long, default_value = "")]
        path: String,
        /// Only the pages changed since the previous snapshot (not restorable alone).
        #[arg(long)]
        diff: bool,
    },
    /// Restore a snapshot (`dsec snapshot`'s path) as new sandboxes with the snapshot's image,
    /// shape, files and processes, each with its own id, entropy and the host's clock; prints
    /// their ids. The snapshot is kept.
    Restore {
        snapshot: String,
        #[command(flatten)]
        sandbox: node::NewSandboxArgs,
    },
    /// Delete sandboxes.
    Rm {
        ids: Vec<String>,
    },
    /// Network policies of sandboxes (what they may reach).
    #[command(subcommand)]
    Net(net::NetCommand),
    /// One-shot code execution from warm workers (FnCall): `dsec fn run`, `dsec fn serve`.
    #[command(subcommand)]
    Fn(fncall::FnCommand),
    /// Print the URL of a port inside a sandbox on the node's HTTP entry point
    /// (http://PORT-ID-TOKEN.localhost:7080/ by default; no token for a public port).
    Url {
        id: String,
        port: u32,
    },
    /// Open a sandbox port to everyone through the HTTP entry point (no access token needed),
    /// or with --private make it private again.
    PortPublic {
        id: String,
        port: u32,
        #[arg(long)]
        private: bool,
    },
    /// Forward a local TCP port to a port inside a sandbox, one stream per connection, until
    /// Ctrl-C.
    PortForward {
        id: String,
        port: u32,
        /// Local address to listen on: HOST:PORT, or PORT on 127.0.0.1. Default:
        /// 127.0.0.1:<PORT>; port 0 picks a free one (printed).
        #[arg(long, value_name = "ADDR")]
        listen: Option<String>,
    },
    /// Live view of the node's budgets and sandboxes.
    Top {
        #[arg(long)]
        once: bool,
    },
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum BackendChoice {
    Microvm,
    Container,
    Auto,
}

#[derive(clap::Args, Debug)]
struct RunArgs {
    /// Isolation: microvm, container, or auto (microVM where KVM can run the guest).
    #[arg(long, value_enum, default_value = "auto")]
    backend: BackendChoice,
    /// Image: a directory image under $DSEC_HOME/images/ (busybox: tiny, the default; debian:
    /// bash, python3, git, built by images/debian/build.sh) or, for containers, an image of
    /// the layer store (`dsec image ls`); a directory image wins a name clash.
    #[arg(long, value_name = "NAME")]
    image: Option<String>,
    /// Virtual CPUs (microVM).
    #[arg(long, default_value_t = 1)]
    vcpus: u32,
    /// Memory in MiB: the microVM's RAM, or the container's memory cgroup (plus its disk,
    /// whose tmpfs is charged there too).
    #[arg(long = "mem", value_name = "MiB", default_value_t = 256)]
    mem_mib: u32,
    /// Process limit of the sandbox's cgroup (containers; a microVM's VMM gets 64 + vCPUs).
    #[arg(long, value_name = "N", default_value_t = 512)]
    pids: u64,
    /// Environment variable for the command (repeatable).
    #[arg(long = "env", short = 'e', value_name = "K=V")]
    env: Vec<String>,
    /// Working directory inside the sandbox.
    #[arg(long, value_name = "DIR")]
    workdir: Option<String>,
    /// Kill the command (and everything it started) after this many seconds.
    #[arg(long, value_name = "S")]
    timeout: Option<f64>,
    /// Writable disk in MiB: a container's tmpfs writable layer (its /tmp too) or a
    /// microVM's sparse upper disk on a disk image such as debian.
    #[arg(long = "disk", value_name = "MiB", default_value_t = 1024)]
    disk_mib: u32,
    /// Guest kernel (microVM). Default: $DSEC_HOME/kernel/vmlinux.
    #[arg(long, value_name = "PATH")]
    kernel: Option<PathBuf>,
    /// Initramfs (microVM). Default: the image's initramfs.cpio.
    #[arg(long, value_name = "PATH")]
    initrd: Option<PathBuf>,
    /// Seconds to wait for the sandbox's agent to answer.
    #[arg(long, value_name = "S", default_value_t = 60.0)]
    boot_timeout: f64,
    /// The command and its arguments.
    #[arg(last = true, required = true, value_name = "CMD")]
    command: Vec<String>,
}

/// Errors of the CLI itself; sandbox errors come from the edge.
#[derive(Debug, thiserror::Error)]
enum CliError {
    #[error("{0}")]
    Usage(String),
    #[error(transparent)]
    Edge(#[from] EdgeError),
    #[error(transparent)]
    Node(node::NodeError),
    #[error(transparent)]
    Cluster(cluster::ClusterError),
    #[error("cannot start the async runtime: {0}")]
    Runtime(std::io::Error),
    #[error(transparent)]
    Vm(#[from] vm::VmError),
    #[error(transparent)]
    Fn(#[from] fncall::FnError),
    #[error(transparent)]
    Image(#[from] dsec_layerfs::Error),
    #[error(transparent)]
    ImageLookup(#[from] dsec_edge::images::ImageError),
}

fn vm_command(command: vm::VmCommand) -> Result<i32, CliError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(CliError::Runtime)?;
    Ok(runtime.block_on(vm::run(command))?)
}

fn fn_command(endpoint: &str, command: fncall::FnCommand, json: bool) -> Result<i32, CliError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(CliError::Runtime)?;
    Ok(runtime.block_on(fncall::run(endpoint, command, json))?)
}

#[global_allocator]
static ALLOCATOR: allocator::ByCommand = allocator::ByCommand;

fn main() -> ExitCode {
    let filter = tracing_subscriber::EnvFilter::try_from_env("DSEC_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    // What `dsec login` saved fills in what the environment leaves unset (before any thread
    // starts).
    if std::env::var_os("DSEC_TOKEN").is_none() {
        if let Some(login) = cluster::Login::load() {
            for (name, value) in [
                ("DSEC_TOKEN", login.token),
                ("DSEC_PROJECT", login.project),
                ("DSEC_ENDPOINT", login.endpoint),
                ("DSEC_CA_FILE", login.ca_file),
            ] {
                if std::env::var_os(name).is_none() && !value.is_empty() {
                    std::env::set_var(name, value);
                }
            }
        }
    }
    let cli = Cli::parse();
    // The SDK reads the CA from the environment (still one thread here).
    if let Some(ca_file) = &cli.ca_file {
        std::env::set_var("DSEC_CA_FILE", ca_file);
    }
    // Commands that only print die quietly when their reader goes away (`dsec inspect ID |
    // grep -q`), as Unix tools do; the streaming ones (run, exec, cp, logs, shell, ports)
    // handle a closed stdout themselves, tearing down what they started.
    if matches!(
        cli.command,
        Command::Info
            | Command::Ls { .. }
            | Command::Inspect { .. }
            | Command::Top { .. }
            | Command::Url { .. }
            | Command::Create { .. }
            | Command::Restore { .. }
            | Command::Snapshot { .. }
    ) {
        // SAFETY: restores the default disposition of SIGPIPE before any thread starts.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    let json = cli.json;
    let endpoint = cli
        .endpoint
        .clone()
        .unwrap_or_else(dsec_sdk::default_target);
    let result = match cli.command {
        Command::Run(args) => run(args),
        Command::Vm(command) => vm_command(command),
        Command::Fn(command) => fn_command(&endpoint, command, json),
        Command::Image(args) => image::run(args, json).map_err(CliError::from),
        Command::Info => info(json).map(|()| 0),
        Command::Up(mut args) => {
            // Image servers are started as `dsec up --serve-image DIR`.
            args.invocation = vec!["up".into()];
            return dsec_edge::daemon::main_with(*args);
        }
        Command::Control(command) => return dsec_control::command::run(command),
        Command::Login { token, project } => {
            let token = token.or_else(|| std::env::var("DSEC_TOKEN").ok());
            match token {
                Some(token) => cluster_command(
                    &endpoint,
                    cluster::ClusterCommand::Login { token, project },
                    json,
                ),
                None => Err(CliError::Usage(
                    "dsec login needs --token TOKEN or DSEC_TOKEN".into(),
                )),
            }
        }
        Command::Project(c) => {
            cluster_command(&endpoint, cluster::ClusterCommand::Project(c), json)
        }
        Command::Token(c) => cluster_command(&endpoint, cluster::ClusterCommand::Token(c), json),
        Command::Account(c) => {
            cluster_command(&endpoint, cluster::ClusterCommand::Account(c), json)
        }
        Command::Role(c) => cluster_command(&endpoint, cluster::ClusterCommand::Role(c), json),
        Command::Node(c) => cluster_command(&endpoint, cluster::ClusterCommand::Node(c), json),
        other => node_command(&endpoint, other, json),
    };
    match result {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(err) => {
            eprintln!("dsec: {err}");
            ExitCode::from(125)
        }
    }
}

fn cluster_command(
    endpoint: &str,
    command: cluster::ClusterCommand,
    json: bool,
) -> Result<i32, CliError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(CliError::Runtime)?;
    runtime
        .block_on(cluster::run(endpoint, command, json))
        .map_err(CliError::Cluster)
}

/// What `dsec run` records of its sandbox (`<state dir>/<id>/run.json`): `dsec inspect ID`
/// shows it, since a `dsec run` sandbox is not the node daemon's.
const RUN_RECORD: &str = "run.json";

fn node_command(endpoint: &str, command: Command, json: bool) -> Result<i32, CliError> {
    if let Command::Inspect { id } = &command {
        let record = EdgeConfig::default().state_dir.join(id).join(RUN_RECORD);
        if let Some(text) = (!id.contains('/'))
            .then(|| std::fs::read_to_string(&record).ok())
            .flatten()
        {
            println!("{}", text.trim_end());
            return Ok(0);
        }
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(CliError::Runtime)?;
    let result = runtime
        .block_on(async {
            let c = dsec_sdk::Client::connect(endpoint).await?;
            match command {
                Command::Create {
                    backend,
                    image,
                    vcpus,
                    memory_mib,
                    disk_mib,
                    sandbox,
                    cold,
                } => {
                    let opts = node::CreateOpts {
                        backend,
                        image,
                        vcpus,
                        memory_mib,
                        disk_mib,
                        sandbox,
                        cold,
                        from_snapshot: String::new(),
                    };
                    node::create(&c, opts, json).await.map(|()| 0)
                }
                Command::Snapshot { id, path, diff } => {
                    let path = c.snapshot(&id, &path, diff).await?;
                    node::emit(json, serde_json::json!({ "path": path }), || {
                        println!("{path}")
                    });
                    Ok(0)
                }
                Command::Restore { snapshot, sandbox } => {
                    let opts = node::CreateOpts {
                        backend: String::new(),
                        image: String::new(),
                        vcpus: 0,
                        memory_mib: 0,
                        disk_mib: 0,
                        sandbox,
                        cold: false,
                        from_snapshot: snapshot,
                    };
                    node::create(&c, opts, json).await.map(|()| 0)
                }
                Command::Ls { labels } => node::ls(&c, &labels, json).await.map(|()| 0),
                Command::Inspect { id } => node::inspect(&c, &id).await.map(|()| 0),
                Command::Exec {
                    interactive,
                    tty,
                    id,
                    command,
                } if interactive || tty => {
                    if json {
                        return Err(node::NodeError::Usage(
                            "--json cannot be combined with -i or -t: output is streamed".into(),
                        ));
                    }
                    tty::exec(&c, &id, command, interactive, tty).await
                }
                Command::Exec { id, command, .. } => node::exec(&c, &id, command, json).await,
                Command::Shell { id } if std::io::stdin().is_terminal() => {
                    let argv = ["/bin/sh", "-c", tty::SHELL_SCRIPT].map(String::from);
                    tty::exec(&c, &id, argv.to_vec(), true, true).await
                }
                Command::Shell { id } => node::shell(&c, &id).await,
                Command::Cp {
                    src,
                    dst,
                    recursive,
                } => cp::cp(&c, &src, &dst, recursive, json).await.map(|()| 0),
                Command::Logs { id, follow } => node::logs(&c, &id, follow, json).await.map(|()| 0),
                Command::Pause { ids } => {
                    node::lifecycle(&c, "pause", &ids, json).await.map(|()| 0)
                }
                Command::Resume { ids } => {
                    node::lifecycle(&c, "resume", &ids, json).await.map(|()| 0)
                }
                Command::Rm { ids } => node::lifecycle(&c, "rm", &ids, json).await.map(|()| 0),
                Command::Fork { id, count } => node::fork(&c, &id, count, json).await.map(|()| 0),
                Command::Top { once } => node::top(&c, once, json).await.map(|()| 0),
                Command::Url { id, port } => node::url(&c, &id, port, json).await.map(|()| 0),
                Command::PortPublic { id, port, private } => {
                    node::port_public(&c, &id, port, !private, json)
                        .await
                        .map(|()| 0)
                }
                Command::Net(command) => net::run(&c, command, json).await.map(|()| 0),
                Command::PortForward { id, port, listen } => {
                    node::port_forward(&c, &id, port, listen.as_deref()).await
                }
                Command::Run(_)
                | Command::Info
                | Command::Up(_)
                | Command::Control(_)
                | Command::Login { .. }
                | Command::Project(_)
                | Command::Token(_)
                | Command::Account(_)
                | Command::Role(_)
                | Command::Node(_)
                | Command::Vm(_)
                | Command::Fn(_)
                | Command::Image(_) => Ok(0),
            }
        })
        .map_err(CliError::Node);
    // Don't wait for a blocking stdin reader (`dsec exec` whose command ended first).
    runtime.shutdown_background();
    result
}

fn positive_seconds(what: &str, seconds: f64) -> Result<Duration, CliError> {
    if seconds.is_finite() && seconds > 0.0 {
        Ok(Duration::from_secs_f64(seconds))
    } else {
        Err(CliError::Usage(format!(
            "{what} must be a positive number of seconds, got {seconds}"
        )))
    }
}

fn run(args: RunArgs) -> Result<i32, CliError> {
    // Validate everything before any sandbox exists.
    let env = parse_env(&args.env)?;
    let timeout = args
        .timeout
        .map(|s| positive_seconds("--timeout", s))
        .transpose()?;
    let ready_timeout = positive_seconds("--boot-timeout", args.boot_timeout)?;
    let kind = match args.backend {
        BackendChoice::Microvm => BackendKind::MicroVm,
        BackendChoice::Container => BackendKind::Container,
        BackendChoice::Auto => {
            let (kind, fallback_reason) = BackendKind::auto(&KvmStatus::detect());
            if let Some(reason) = fallback_reason {
                eprintln!("dsec: using the container backend: microVMs cannot run here: {reason}");
            }
            kind
        }
    };
    let mut spec = SandboxSpec {
        vcpus: args.vcpus,
        mem_mib: args.mem_mib,
        kernel: args.kernel,
        initrd: args.initrd,
        disk_mib: Some(args.disk_mib),
        ready_timeout,
        ..SandboxSpec::default()
    };
    // Held until the sandbox is gone: a layer-store image's FUSE view is its lowerdir.
    let _image_mount = match &args.image {
        Some(name) => choose_image(kind, name, &mut spec)?,
        None => None,
    };
    let exec = ExecSpec {
        argv: args.command,
        env,
        workdir: args.workdir,
        timeout,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(CliError::Runtime)?;
    let code = runtime.block_on(run_in_sandbox(kind, spec, exec, args.pids))?;
    // Don't wait for the blocking stdin reader thread.
    runtime.shutdown_background();
    Ok(code)
}

/// Records the sandbox's limits for `dsec inspect` (best effort: the run goes on without).
fn write_run_record(sandbox: &Sandbox, spec: &SandboxSpec, limits: &Limits, cgroups: &[PathBuf]) {
    let range = dsec_edge::idpool::recorded(sandbox.dir());
    let record = serde_json::json!({
        "id": sandbox.id(),
        "backend": sandbox.kind().as_str(),
        "runner": "dsec run",
        "vcpus": spec.vcpus,
        "memory_mib": spec.mem_mib,
        "disk_mib": spec.disk_mib,
        "pids_limit": limits.pids,
        "memory_limit_bytes": limits.memory_bytes,
        "cpu_quota_vcpus": limits.vcpus,
        "host_id_range": range.map(|r| serde_json::json!({"base": r.base, "count": r.count})),
        "cgroups": cgroups,
    });
    let path = sandbox.dir().join(RUN_RECORD);
    if let Err(err) = std::fs::write(&path, format!("{record:#}\n")) {
        eprintln!(
            "dsec: cannot record the sandbox's limits in {}: {err}",
            path.display()
        );
    }
}

/// Removes a `dsec run` sandbox's cgroups (after the sandbox is gone) when dropped.
struct RemoveCgroups(Vec<PathBuf>);

impl Drop for RemoveCgroups {
    fn drop(&mut self) {
        cgroup::remove(&self.0);
    }
}

/// Points `spec` at image `name`; a layer-store image is mounted here for the run.
fn choose_image(
    kind: BackendKind,
    name: &str,
    spec: &mut SandboxSpec,
) -> Result<Option<LocalMount>, CliError> {
    let catalog = Catalog::new(&Artifacts::home());
    if kind == BackendKind::MicroVm {
        Catalog::check_name(name)?;
        let initrd = catalog
            .home
            .join("images")
            .join(name)
            .join("initramfs.cpio");
        if name.contains('/') || !initrd.is_file() {
            return Err(catalog.not_found(name, "microvm").into());
        }
        spec.initrd.get_or_insert(initrd);
        // A disk image (debian) boots from its read-only root disk with an upper disk.
        spec.root_disk = Artifacts::from_env().image(name).root_disk();
        return Ok(None);
    }
    match catalog.resolve(name)? {
        ImageSource::Dir(rootfs) => {
            spec.rootfs = Some(rootfs);
            Ok(None)
        }
        ImageSource::Layers(image) => {
            let run_dir = EdgeConfig::default().state_dir;
            let dir = run_dir
                .parent()
                .unwrap_or(&run_dir)
                .join("images")
                .join(format!("run-{}", std::process::id()));
            let mount = LocalMount::new(&image, dir)?;
            spec.rootfs = Some(mount.root());
            Ok(Some(mount))
        }
    }
}

async fn run_in_sandbox(
    kind: BackendKind,
    mut spec: SandboxSpec,
    exec: ExecSpec,
    pids: u64,
) -> Result<i32, CliError> {
    let config = EdgeConfig::default();
    // The same cgroup limits a node sandbox of this shape gets (memory, pids, CPU), under
    // `<our cgroup>/dsec-run/<id>`; removed with the sandbox.
    let id = dsec_edge::backend::new_sandbox_id(kind);
    let charged_disk = match kind {
        BackendKind::Container => spec.disk_mib.unwrap_or(0),
        BackendKind::MicroVm if spec.root_disk.is_some() => spec.disk_mib.unwrap_or(1024),
        BackendKind::MicroVm => 0,
    };
    let limits = Limits::for_sandbox(
        kind,
        u64::from(spec.mem_mib),
        u64::from(charged_disk),
        spec.vcpus,
        pids,
    );
    let cgroups = Cgroups::detect("dsec-run")
        .create(&id, limits)
        .map_err(CliError::Edge)?;
    spec.id = Some(id);
    spec.cgroup_procs = cgroup::procs_files(&cgroups);
    let cgroups = RemoveCgroups(cgroups);
    let sandbox = tokio::select! {
        created = Sandbox::create(kind, &config, &spec) => created?,
        _ = tokio::signal::ctrl_c() => return Ok(130),
    };
    write_run_record(&sandbox, &spec, &limits, &cgroups.0);
    let stdin = (!std::io::stdin().is_terminal()).then(tokio::io::stdin);
    let mut stdout = tokio::io::stdout();
    let mut stderr = tokio::io::stderr();
    let outcome = tokio::select! {
        outcome = sandbox.agent().exec(&exec, stdin, &mut stdout, &mut stderr) => Some(outcome),
        _ = tokio::signal::ctrl_c() => None,
    };
    let destroyed = sandbox.destroy().await;
    let outcome = match outcome {
        None => {
            eprintln!("dsec: interrupted; sandbox torn down");
            return Ok(130);
        }
        // Our stdout was closed (`dsec run -- yes | head`): end quietly, as a shell would.
        Some(Err(EdgeError::Io { source, .. }))
            if source.kind() == std::io::ErrorKind::BrokenPipe =>
        {
            return Ok(128 + 13);
        }
        Some(outcome) => outcome?,
    };
    if let Err(err) = destroyed {
        eprintln!("dsec: warning: {err}");
    }
    if outcome.timed_out {
        eprintln!(
            "dsec: command timed out after {:.1}s and was killed",
            exec.timeout.unwrap_or_default().as_secs_f64()
        );
    }
    Ok(outcome.exit_code())
}

#[derive(Serialize)]
struct Info {
    dsec_version: &'static str,
    kvm: KvmStatus,
    microvm_available: bool,
    microvm_unavailable_reason: Option<String>,
    default_backend: &'static str,
    dsec_home: PathBuf,
    kernel: ArtifactInfo,
    initramfs: ArtifactInfo,
    rootfs: ArtifactInfo,
    agent: BinaryInfo,
    vmm: BinaryInfo,
}

#[derive(Serialize)]
struct ArtifactInfo {
    path: PathBuf,
    present: bool,
    version: Option<String>,
}

#[derive(Serialize)]
struct BinaryInfo {
    path: Option<PathBuf>,
    version: Option<String>,
}

fn binary_info(name: &str) -> BinaryInfo {
    let path = find_binary(name);
    let version = path.as_ref().and_then(|p| {
        let out = std::process::Command::new(p)
            .arg("--version")
            .output()
            .ok()?;
        let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
        out.status
            .success()
            .then(|| text.rsplit(' ').next().unwrap_or(&text).to_string())
    });
    BinaryInfo { path, version }
}

fn info(json: bool) -> Result<(), CliError> {
    let artifacts = Artifacts::from_env();
    let kvm = KvmStatus::detect();
    let kernel = ArtifactInfo {
        present: artifacts.kernel.is_file(),
        version: artifacts.kernel_version(),
        path: artifacts.kernel.clone(),
    };
    let initramfs = ArtifactInfo {
        present: artifacts.initramfs.is_file(),
        version: None,
        path: artifacts.initramfs.clone(),
    };
    let rootfs = ArtifactInfo {
        present: artifacts.rootfs.join("bin").is_dir(),
        version: None,
        path: artifacts.rootfs.clone(),
    };
    let agent = binary_info("dsec-agent");
    let vmm = binary_info("dsec-vmm");
    let mut missing = Vec::new();
    if let Some(reason) = kvm.why_not_microvm() {
        missing.push(reason);
    }
    if !kernel.present {
        missing.push(format!("no guest kernel at {}", kernel.path.display()));
    }
    if !initramfs.present {
        missing.push(format!("no initramfs at {}", initramfs.path.display()));
    }
    if vmm.path.is_none() {
        missing.push("dsec-vmm binary not found".into());
    }
    let (default_kind, _) = BackendKind::auto(&kvm);
    let info = Info {
        dsec_version: env!("CARGO_PKG_VERSION"),
        microvm_available: missing.is_empty(),
        microvm_unavailable_reason: (!missing.is_empty()).then(|| missing.join("; ")),
        default_backend: default_kind.as_str(),
        kvm,
        dsec_home: artifacts.home.clone(),
        kernel,
        initramfs,
        rootfs,
        agent,
        vmm,
    };
    if json {
        let text = serde_json::to_string_pretty(&info)
            .map_err(|e| CliError::Usage(format!("cannot encode info as JSON: {e}")))?;
        println!("{text}");
        return Ok(());
    }
    let show_path = |p: &Option<PathBuf>| {
        p.as_ref()
            .map_or("not found".to_string(), |p| p.display().to_string())
    };
    let show_artifact = |a: &ArtifactInfo| {
        format!(
            "{}{}{}",
            a.path.display(),
            if a.present { "" } else { " (missing)" },
            a.version
                .as_ref()
                .map_or(String::new(), |v| format!(" version {v}"))
        )
    };
    println!("dsec {}", info.dsec_version);
    println!("kvm:       {}", info.kvm.describe());
    match &info.microvm_unavailable_reason {
        None => println!("microvm:   available"),
        Some(reason) => println!("microvm:   unavailable: {reason}"),
    }
    println!("default:   {} backend", info.default_backend);
    println!("home:      {}", info.dsec_home.display());
    println!("kernel:    {}", show_artifact(&info.kernel));
    println!("initramfs: {}", show_artifact(&info.initramfs));
    println!("rootfs:    {}", show_artifact(&info.rootfs));
    println!(
        "agent:     {} {}",
        show_path(&info.agent.path),
        info.agent.version.as_deref().unwrap_or("")
    );
    println!(
        "vmm:       {} {}",
        show_path(&info.vmm.path),
        info.vmm.version.as_deref().unwrap_or("")
    );
    Ok(())
}
