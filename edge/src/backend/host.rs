//! What a sandbox holds on the host (its process, directory, id range, jail root and
//! snapshot directory) and how it is freed: [`HostResources`], the guard both backends
//! create with the sandbox directory, so any failure on the way frees what was made; and
//! [`SandboxHandle`], what a supervisor keeps once the sandbox is detached.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

use super::{BackendKind, EdgeConfig};
use crate::client::AgentAddr;
use crate::error::{EdgeError, Result};

pub(super) enum Runtime {
    /// PID (in our namespace) of the agent, which is PID 1 of the sandbox's PID namespace.
    Container {
        agent_pid: Pid,
    },
    MicroVm {
        vmm: tokio::process::Child,
    },
    /// Not started yet, or already torn down.
    Gone,
}

/// Owns what a sandbox holds on the host; dropping it kills and removes everything. Both
/// backends make it together with the sandbox directory, before anything else, and fill it
/// in as they go: whatever fails on the way frees what was made so far.
pub(super) struct HostResources {
    pub(super) runtime: Runtime,
    pub(super) dir: PathBuf,
    /// Where a jailed VMM may write snapshots, and its jail root; None when not jailed.
    pub(super) snapshot_dir: Option<PathBuf>,
    pub(super) jail_root: Option<PathBuf>,
}

impl HostResources {
    /// Makes the sandbox directory `<state_dir>/<id>` (private) and the guard that removes it.
    pub(super) fn create(config: &EdgeConfig, id: &str) -> Result<Self> {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o711)
            .create(&config.state_dir)
            .map_err(|e| {
                EdgeError::io(
                    format!("create state directory {}", config.state_dir.display()),
                    e,
                )
            })?;
        let dir = config.state_dir.join(id);
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .map_err(|e| EdgeError::io(format!("create sandbox directory {}", dir.display()), e))?;
        Ok(Self {
            runtime: Runtime::Gone,
            dir,
            snapshot_dir: None,
            jail_root: None,
        })
    }

    /// The guard of a sandbox whose directory, snapshot directory and jail root were made
    /// for a prewarmed VMM and have just been handed to it.
    pub(super) fn taken_over(dir: PathBuf, snapshot_dir: PathBuf, jail_root: PathBuf) -> Self {
        Self {
            runtime: Runtime::Gone,
            dir,
            snapshot_dir: Some(snapshot_dir),
            jail_root: Some(jail_root),
        }
    }

    /// Kills what runs, reaps it and removes everything; afterwards the guard holds nothing.
    /// Blocking.
    pub(super) fn release(&mut self) -> Result<()> {
        let runtime = std::mem::replace(&mut self.runtime, Runtime::Gone);
        remove_if_empty(self.snapshot_dir.take().as_deref());
        remove_jail_root(self.jail_root.take().as_deref());
        kill_runtime(runtime);
        let dir = std::mem::take(&mut self.dir);
        if dir.as_os_str().is_empty() {
            return Ok(());
        }
        remove_sandbox_dir(&dir)
    }
}

impl Drop for HostResources {
    fn drop(&mut self) {
        let dir = self.dir.clone();
        if let Err(err) = self.release() {
            tracing::warn!(dir = %dir.display(), %err, "sandbox teardown failed");
        }
    }
}

/// A jailed sandbox's snapshot directory outlives it only when it holds snapshots.
pub(super) fn remove_if_empty(dir: Option<&Path>) {
    if let Some(dir) = dir {
        let _ = std::fs::remove_dir(dir);
    }
}

/// A jail root the VMM could not remove itself (killed): only mount points of the jail's
/// own mount namespace are left in it, plain directories on the host.
fn remove_jail_root(root: Option<&Path>) {
    if let Some(root) = root {
        let _ = std::fs::remove_dir_all(root);
    }
}

/// Kills what runs and reaps it. Blocking.
fn kill_runtime(runtime: Runtime) {
    match runtime {
        Runtime::Container { agent_pid } => {
            // Killing PID 1 of the namespace kills every process in it; waitpid returns once
            // all of them are gone, and with them the sandbox's mounts.
            let _ = kill(agent_pid, Signal::SIGKILL);
            while let Err(nix::errno::Errno::EINTR) = waitpid(agent_pid, None) {}
        }
        Runtime::MicroVm { mut vmm } => {
            // The VMM leads its own process group (setsid at spawn): killing the group also
            // takes a jailed VMM's forked child, not only its supervisor.
            if let Some(pid) = vmm.id() {
                let _ = nix::sys::signal::killpg(Pid::from_raw(pid as i32), Signal::SIGKILL);
            }
            // Already reaped after destroy(); otherwise tokio reaps it after the kill.
            let _ = vmm.start_kill();
        }
        Runtime::Gone => {}
    }
}

/// Frees the sandbox's id range and removes its directory (gone already is fine).
fn remove_sandbox_dir(dir: &Path) -> Result<()> {
    crate::idpool::release(dir);
    crate::net::release(dir);
    match std::fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(EdgeError::io(
            format!("remove sandbox directory {}", dir.display()),
            e,
        )),
    }
}

/// What the daemon keeps of a sandbox it supervises: enough to reach, check and tear it
/// down after a restart of the daemon (the sandbox is no longer its child then).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct SandboxHandle {
    pub id: String,
    pub backend: String,
    pub dir: PathBuf,
    /// Host pid of the container's agent (PID 1 of its namespace) or of the VMM.
    pub pid: i32,
    /// Start time of `pid` (clock ticks since boot), so a reused pid is never mistaken.
    pub pid_start: u64,
    /// The agent's Unix socket (container) or the VMM's vsock socket (microVM).
    pub agent_socket: PathBuf,
    /// The VMM's control socket (microVM).
    pub api_socket: Option<PathBuf>,
    /// A jailed VMM writes snapshots only here; None when it is not jailed.
    #[serde(default)]
    pub snapshot_dir: Option<PathBuf>,
    /// A jailed VMM's root directory.
    #[serde(default)]
    pub jail_root: Option<PathBuf>,
}

impl SandboxHandle {
    pub fn agent_addr(&self) -> AgentAddr {
        if self.backend == BackendKind::MicroVm.as_str() {
            AgentAddr::VsockUds {
                uds: self.agent_socket.clone(),
                port: dsec_api::AGENT_VSOCK_PORT,
            }
        } else {
            AgentAddr::Unix(self.agent_socket.clone())
        }
    }

    /// The process still runs (not a zombie) and is the one we started.
    pub fn is_alive(&self) -> bool {
        match proc_stat(self.pid) {
            Some((state, start)) => state != 'Z' && state != 'X' && start == self.pid_start,
            None => false,
        }
    }

    /// Kills the sandbox's process, waits until it is gone (reaping it when it is our
    /// child) and removes the sandbox directory. Blocking.
    pub fn teardown(&self) -> Result<()> {
        self.kill_process()?;
        remove_if_empty(self.snapshot_dir.as_deref());
        remove_jail_root(self.jail_root.as_deref());
        remove_sandbox_dir(&self.dir)
    }

    /// Kills the sandbox's process (a VMM's whole process group) and waits until it is gone,
    /// reaping it when it is our child. Blocking.
    pub fn kill_process(&self) -> Result<()> {
        let pid = Pid::from_raw(self.pid);
        if proc_stat(self.pid).is_some_and(|(_, start)| start == self.pid_start) {
            if self.backend == BackendKind::MicroVm.as_str() {
                // The VMM's process group (it called setsid): a jailed VMM's child too.
                let _ = nix::sys::signal::killpg(pid, Signal::SIGKILL);
            }
            let _ = kill(pid, Signal::SIGKILL);
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match waitpid(pid, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) => {}
                Ok(_) => break,
                // Not our child (adopted after a daemon restart): whoever reaps it (init,
                // a subreaper) may take its time, and a zombie is dead already.
                Err(_) => {
                    if proc_stat(self.pid).is_none_or(|(state, start)| {
                        start != self.pid_start || state == 'Z' || state == 'X'
                    }) {
                        break;
                    }
                }
            }
            if Instant::now() > deadline {
                return Err(EdgeError::Protocol(format!(
                    "sandbox {} (pid {}) did not die within 10 s of SIGKILL",
                    self.id, self.pid
                )));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(())
    }
}

/// State letter and start time (field 22) of a process, from /proc/PID/stat.
pub fn proc_stat(pid: i32) -> Option<(char, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = stat.rsplit_once(')')?.1;
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    // rest starts at field 3 (state); starttime is field 22.
    let start = fields.nth(18)?.parse().ok()?;
    Some((state, start))
}

/// Host pids (other than ours) whose command line or environment contains `needle`: how
/// leftovers of a sandbox are found (a VMM names its sandbox directory on its command line,
/// a container's agent in its environment; see [`AGENT_DIR_ENV`]).
pub fn pids_referencing(needle: &[u8]) -> Vec<i32> {
    let me = std::process::id() as i32;
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| pid != me)
        .filter(|pid| {
            ["cmdline", "environ"].iter().any(|file| {
                std::fs::read(format!("/proc/{pid}/{file}")).is_ok_and(|c| {
                    !needle.is_empty() && c.windows(needle.len()).any(|w| w == needle)
                })
            })
        })
        .collect()
}
