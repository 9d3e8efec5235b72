//! dsec-agent: the in-sandbox runtime agent. PID 1 of a microVM (serving over vsock) or of
//! a container (serving on a Unix socket bound on the host before pivot_root), or a plain
//! process serving on a Unix socket (tests).

mod agent;
mod confine;
mod container;
mod diskroot;
mod exec;
mod files;
mod fnworker;
mod init;
mod listen;
mod mountapi;
mod ports;
mod reaper;
mod sandbox_env;
mod sessions;
mod userns;

use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use dsec_api::agent::v1::agent_server::AgentServer;
use dsec_api::agent::v1::files_server::FilesServer;
use dsec_api::agent::v1::ports_server::PortsServer;
use dsec_api::agent::v1::process_server::ProcessServer;
use dsec_api::agent::v1::sessions_server::SessionsServer;

use crate::listen::{BoundListener, ListenAddr};

/// Errors that stop the agent.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("sandbox setup failed: {0}")]
    Setup(String),
    #[error("cannot listen: {0}")]
    Listen(String),
    #[error("runtime error: {0}")]
    Runtime(String),
}

/// How the agent runs, which decides setup and shutdown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// PID 1 of a VM.
    Vm,
    /// PID 1 of a container (fresh namespaces, `--container-root`).
    Container,
    /// A plain process (tests, debugging).
    Process,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Vm => "vm",
            Mode::Container => "container",
            Mode::Process => "process",
        }
    }
}

#[derive(Parser, Debug)]
#[command(name = "dsec-agent", version, about = "DSec in-sandbox runtime agent")]
struct Args {
    /// Where to serve the runtime API: vsock:PORT or unix:/path/agent.sock.
    #[arg(long, default_value = "vsock:1024")]
    listen: ListenAddr,
    /// Become a container's PID 1: read the edge's launch description (api
    /// `ContainerLaunch`, protobuf) from this inherited descriptor; it names the listening
    /// socket, the image, the sandbox directory and the user-namespace id range.
    #[arg(long, value_name = "FD", conflicts_with = "listen")]
    container_launch_fd: Option<i32>,
    /// VM mode: boot into this read-only root disk (erofs or ext4) with an overlay; default:
    /// `dsec.root=` on the kernel command line, else stay in the initramfs.
    #[arg(long, value_name = "DEV")]
    root_disk: Option<String>,
    /// With a root disk: the writable disk (ext4) for the overlay's upper layer; default:
    /// `dsec.upper=` on the kernel command line, else a tmpfs.
    #[arg(long, value_name = "DEV")]
    upper_disk: Option<String>,
    /// Hostname to set in a VM or container.
    #[arg(long, default_value = "dsec")]
    hostname: String,
}

fn parse_args(is_pid1: bool) -> Result<Args, clap::Error> {
    match Args::try_parse() {
        Ok(args) => Ok(args),
        // The kernel passes unknown cmdline words to init as arguments; PID 1 must not die
        // over them.
        Err(err) if is_pid1 && !matches!(err.kind(), clap::error::ErrorKind::DisplayVersion) => {
            eprintln!("dsec-agent: ignoring arguments ({})", err.kind());
            Ok(Args::parse_from(["dsec-agent"]))
        }
        Err(err) => Err(err),
    }
}

fn main() -> ExitCode {
    // The edge's marker of a container agent's sandbox directory (a host path): for the
    // host only, never inherited by the commands we start.
    std::env::remove_var("DSEC_SANDBOX_DIR");
    let is_pid1 = std::process::id() == 1;
    let args = match parse_args(is_pid1) {
        Ok(args) => args,
        Err(err) => err.exit(),
    };
    let mode = match (&args.container_launch_fd, is_pid1) {
        (Some(_), _) => Mode::Container,
        (None, true) => Mode::Vm,
        (None, false) => Mode::Process,
    };
    // A VM console is slow (each byte is VM exits): warnings only unless asked.
    let default_level = if mode == Mode::Vm { "warn" } else { "info" };
    let filter = tracing_subscriber::EnvFilter::try_from_env("DSEC_AGENT_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();

    match run(args, mode) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            tracing::error!("{err}");
            eprintln!("dsec-agent: {err}");
            if mode == Mode::Vm {
                // PID 1 exiting panics the kernel; a reset lets the VMM exit cleanly.
                init::power_off(mode);
            }
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args, mode: Mode) -> Result<(), AgentError> {
    if mode == Mode::Vm {
        init::mount_vm_filesystems()?;
        let _ = nix::unistd::sethostname(&args.hostname);
        init::loopback_up();
    }
    // Bind first: in a container the socket path lives on the host and is gone after pivot.
    let listener = match args.container_launch_fd {
        Some(fd) => {
            let launch = container::read_launch(fd)?;
            let listener = BoundListener::inherited_unix(launch.listen_fd)?;
            container::enter(&launch)?;
            listener
        }
        None => BoundListener::bind(&args.listen)?,
    };
    if mode == Mode::Vm {
        let disks = match args.root_disk {
            Some(root) => Some(diskroot::DiskRoot {
                root,
                upper: args.upper_disk,
            }),
            None => diskroot::from_cmdline(
                &std::fs::read_to_string("/proc/cmdline").unwrap_or_default(),
            ),
        };
        if let Some(disks) = disks {
            diskroot::enter(&disks)?;
        }
    }
    if mode == Mode::Process {
        // Reap orphans of the commands we start, like PID 1 would.
        let _ = nix::sys::prctl::set_child_subreaper(true);
    }

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| AgentError::Runtime(format!("start tokio: {e}")))?;
    runtime.block_on(serve(listener, mode))
}

async fn serve(listener: BoundListener, mode: Mode) -> Result<(), AgentError> {
    let reaper = reaper::Reaper::start()
        .map_err(|e| AgentError::Runtime(format!("install SIGCHLD handler: {e}")))?;
    let incoming = listener
        .incoming()
        .map_err(|e| AgentError::Listen(format!("register listener: {e}")))?;
    // Containers share the host kernel: their commands get reduced capabilities and a
    // seccomp filter. In a microVM the guest kernel is the boundary.
    let confinement = Arc::new(if mode == Mode::Container {
        confine::Confinement::container()?
    } else {
        confine::Confinement::none()
    });
    let server = tonic::transport::Server::builder()
        .add_service(AgentServer::new(agent::AgentService { mode }))
        .add_service(ProcessServer::new(exec::ProcessService::new(
            reaper.clone(),
            confinement.clone(),
        )))
        .add_service(FilesServer::new(files::FilesService))
        .add_service(SessionsServer::new(sessions::SessionsService::new(
            reaper,
            confinement,
        )))
        .add_service(
            PortsServer::new(ports::PortsService)
                .max_decoding_message_size(ports::MAX_CHUNK + 1024),
        );
    if mode == Mode::Vm {
        start_fn_worker();
    }
    init::announce_ready(mode);
    server
        .serve_with_incoming(incoming)
        .await
        .map_err(|e| AgentError::Runtime(format!("gRPC server: {e}")))
}

/// Starts the FnCall worker a worker VM's command line asks for (after the reaper, which
/// reaps it); a failure is logged on the console, the agent serves on.
fn start_fn_worker() {
    let cmdline = std::fs::read_to_string("/proc/cmdline").unwrap_or_default();
    match fnworker::from_cmdline(&cmdline) {
        None => {}
        Some(Err(why)) => tracing::error!("FnCall worker not started: {why}"),
        Some(Ok(worker)) => {
            if let Err(e) = worker.start() {
                tracing::error!("FnCall worker {} not started: {e}", fnworker::WORKER_SCRIPT);
            }
        }
    }
}
