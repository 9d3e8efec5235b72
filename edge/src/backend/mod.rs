//! Sandboxes and the backends that create them: [`container`] (the agent as PID 1 of fresh
//! namespaces) and [`microvm`] (the agent inside a guest run by `dsec-vmm`). What a sandbox
//! holds on the host, and its teardown, is in [`host`]; its shape in [`spec`].

mod container;
pub mod host;
pub mod microvm;
pub mod spec;
pub mod vmm_pool;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::client::AgentClient;
use crate::error::{EdgeError, Result};
use crate::kvm::KvmStatus;
use crate::paths::Artifacts;

pub use container::AGENT_DIR_ENV;
pub use host::{pids_referencing, proc_stat, SandboxHandle};
pub use microvm::{restore_microvm, VmmJail, DEFAULT_UPPER_DISK_MIB, JAIL_GID, JAIL_UID};
pub use spec::{parse_env, parse_env_pair, SandboxSpec};

use host::{HostResources, Runtime};

/// Which isolation a sandbox gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    MicroVm,
    Container,
}

impl BackendKind {
    pub fn as_str(self) -> &'static str {
        match self {
            BackendKind::MicroVm => "microvm",
            BackendKind::Container => "container",
        }
    }

    /// Picks microVM where hardware KVM can run the guest, else container; the second value
    /// explains a fallback.
    pub fn auto(kvm: &KvmStatus) -> (Self, Option<String>) {
        match kvm.why_not_microvm() {
            None => (BackendKind::MicroVm, None),
            Some(reason) => (BackendKind::Container, Some(reason)),
        }
    }
}

/// Node-level settings shared by all sandboxes.
#[derive(Clone, Debug)]
pub struct EdgeConfig {
    /// Per-sandbox state: `<state_dir>/<id>/` (sockets, logs, overlay upper).
    pub state_dir: PathBuf,
    pub artifacts: Artifacts,
    /// `dsec-agent`; default: found next to this executable, in $DSEC_HOME/bin or PATH.
    pub agent_bin: Option<PathBuf>,
    /// `dsec-vmm`; same lookup.
    pub vmm_bin: Option<PathBuf>,
    /// Run every VMM in a jail (`dsec-vmm --jail`); None runs them unjailed.
    pub jail: Option<VmmJail>,
    /// The node's sandbox network; None: containers have loopback only.
    pub network: Option<std::sync::Arc<crate::net::Network>>,
    /// Prewarmed VMMs that restores take (vmm_pool.rs); None: every restore starts one.
    pub vmm_pool: Option<std::sync::Arc<vmm_pool::VmmPool>>,
}

impl Default for EdgeConfig {
    /// State under `${DSEC_RUN_DIR:-/run/dsec}/sandboxes`, artifacts under `$DSEC_HOME`;
    /// VMMs jailed when running as root.
    fn default() -> Self {
        let run_dir = std::env::var_os("DSEC_RUN_DIR")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/run/dsec"));
        Self {
            state_dir: run_dir.join("sandboxes"),
            artifacts: Artifacts::from_env(),
            agent_bin: None,
            vmm_bin: None,
            // Root can jail its VMMs; anyone else runs them as themselves.
            jail: nix::unistd::geteuid().is_root().then(|| VmmJail {
                uid: JAIL_UID,
                gid: JAIL_GID,
                snapshots: run_dir.join("snapshots"),
                roots: run_dir.join("jails"),
            }),
            network: None,
            vmm_pool: None,
        }
    }
}

static SANDBOX_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A fresh sandbox id (`ct-...` or `vm-...`), unique on the node.
pub fn new_sandbox_id(kind: BackendKind) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let n = SANDBOX_COUNTER.fetch_add(1, Ordering::Relaxed);
    let prefix = match kind {
        BackendKind::MicroVm => "vm",
        BackendKind::Container => "ct",
    };
    format!("{prefix}-{:x}-{nanos:08x}-{n}", std::process::id())
}

/// A running sandbox. Call [`Sandbox::destroy`]; dropping it tears it down forcefully.
pub struct Sandbox {
    id: String,
    kind: BackendKind,
    client: AgentClient,
    host: HostResources,
    /// microVM: its agent took the sandbox's env (`SandboxSpec::guest_env`).
    env_in_guest: bool,
}

impl std::fmt::Debug for Sandbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sandbox")
            .field("id", &self.id)
            .field("kind", &self.kind)
            .finish()
    }
}

impl Sandbox {
    /// Creates a sandbox with the given backend and waits until its agent answers.
    pub async fn create(
        kind: BackendKind,
        config: &EdgeConfig,
        spec: &SandboxSpec,
    ) -> Result<Self> {
        spec.validate()?;
        match kind {
            BackendKind::Container => container::create(config, spec).await,
            BackendKind::MicroVm => microvm::create(config, spec).await,
        }
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    pub fn kind(&self) -> BackendKind {
        self.kind
    }

    /// Host directory with this sandbox's sockets and logs.
    pub fn dir(&self) -> &Path {
        &self.host.dir
    }

    pub fn agent(&self) -> &AgentClient {
        &self.client
    }

    /// Its agent holds the env the spec gave (`SandboxSpec::guest_env`) and starts every exec
    /// and session with it.
    pub fn env_in_guest(&self) -> bool {
        self.env_in_guest
    }

    /// Hands the sandbox over to a supervisor: nothing is torn down on drop any more; the
    /// returned handle reaches, checks and tears it down (also from another process).
    pub fn detach(mut self) -> SandboxHandle {
        let runtime = std::mem::replace(&mut self.host.runtime, Runtime::Gone);
        let (pid, agent_socket, api_socket) = match runtime {
            Runtime::Container { agent_pid } => {
                (agent_pid.as_raw(), self.host.dir.join("agent.sock"), None)
            }
            Runtime::MicroVm { vmm } => (
                vmm.id().map(|p| p as i32).unwrap_or(0),
                self.host.dir.join("vsock.sock"),
                Some(self.host.dir.join("api.sock")),
            ),
            Runtime::Gone => (0, PathBuf::new(), None),
        };
        // Disarm the drop-time teardown: the handle owns the directory now.
        let dir = std::mem::take(&mut self.host.dir);
        SandboxHandle {
            id: self.id.clone(),
            backend: self.kind.as_str().to_string(),
            dir,
            pid,
            pid_start: proc_stat(pid).map(|(_, s)| s).unwrap_or(0),
            agent_socket,
            api_socket,
            snapshot_dir: self.host.snapshot_dir.take(),
            jail_root: self.host.jail_root.take(),
        }
    }

    /// Stops the sandbox and removes everything it left on the host.
    pub async fn destroy(mut self) -> Result<()> {
        if let Runtime::MicroVm { vmm } = &mut self.host.runtime {
            // Ask for a clean poweroff first; the VMM exits on the guest's reset.
            let _ = tokio::time::timeout(Duration::from_secs(2), self.client.shutdown()).await;
            if tokio::time::timeout(Duration::from_secs(3), vmm.wait())
                .await
                .is_err()
            {
                tracing::warn!(id = %self.id, "VMM did not exit after shutdown; killing it");
                let _ = vmm.kill().await;
            }
        }
        let mut host = self.host;
        tokio::task::spawn_blocking(move || host.release())
            .await
            .map_err(|e| EdgeError::Protocol(format!("teardown task failed: {e}")))?
    }
}
