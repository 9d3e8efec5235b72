//! Sandboxes and the backends that create them.

use std::collections::HashMap;
use std::ffi::CString;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use nix::sched::CloneFlags;
use nix::sys::signal::{kill, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

use crate::client::{AgentAddr, AgentClient};
use crate::error::{EdgeError, Result};
use crate::kvm::KvmStatus;
use crate::paths::{find_binary, Artifacts};

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

/// Shape of a sandbox.
#[derive(Clone, Debug)]
pub struct SandboxSpec {
    pub vcpus: u32,
    pub mem_mib: u32,
    /// Guest kernel (microVM); default `$DSEC_HOME/kernel/vmlinux`.
    pub kernel: Option<PathBuf>,
    /// Initramfs (microVM); default `$DSEC_HOME/images/busybox/initramfs.cpio`.
    pub initrd: Option<PathBuf>,
    /// Extra kernel command line words appended to the defaults.
    pub extra_cmdline: Option<String>,
    /// Root directory of the container image; default `$DSEC_HOME/images/busybox/rootfs`.
    pub rootfs: Option<PathBuf>,
    /// How long the agent may take to answer after the sandbox starts.
    pub ready_timeout: Duration,
    /// Sandbox id; default: generated.
    pub id: Option<String>,
    /// Read-only root filesystem image (microVM): attached as the first virtio-blk disk, with a
    /// fresh sparse ext4 disk of `disk_mib` (default 1024) MiB as the second; the agent
    /// mounts them as an overlay and runs every command in it.
    pub root_disk: Option<PathBuf>,
    /// Writable disk in MiB: of a container a tmpfs in the container (None: unlimited, on the
    /// host under the sandbox directory); of a microVM with a root disk the sparse upper disk.
    pub disk_mib: Option<u32>,
    /// `cgroup.procs` files the sandbox's first process is written into right after it
    /// starts (everything it starts later inherits them).
    pub cgroup_procs: Vec<PathBuf>,
}

impl Default for SandboxSpec {
    fn default() -> Self {
        Self {
            vcpus: 1,
            mem_mib: 256,
            kernel: None,
            initrd: None,
            extra_cmdline: None,
            rootfs: None,
            ready_timeout: Duration::from_secs(30),
            id: None,
            root_disk: None,
            disk_mib: None,
            cgroup_procs: Vec::new(),
        }
    }
}

impl SandboxSpec {
    fn validate(&self) -> Result<()> {
        if self.vcpus == 0 {
            return Err(EdgeError::InvalidSpec("vcpus must be at least 1".into()));
        }
        if self.vcpus > 255 {
            return Err(EdgeError::InvalidSpec(format!(
                "{} vcpus is more than the 255 supported",
                self.vcpus
            )));
        }
        if self.mem_mib < 32 {
            return Err(EdgeError::InvalidSpec(format!(
                "{} MiB of memory is too little: a sandbox needs at least 32 MiB",
                self.mem_mib
            )));
        }
        let host_mib = host_memory_mib();
        if host_mib > 0 && u64::from(self.mem_mib) > host_mib {
            return Err(EdgeError::InvalidSpec(format!(
                "{} MiB of memory is more than this host has ({host_mib} MiB)",
                self.mem_mib
            )));
        }
        Ok(())
    }
}

fn host_memory_mib() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("MemTotal:"))?;
            line.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .map(|kib| kib / 1024)
        .unwrap_or(0)
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
}

/// How microVM sandboxes' VMMs are jailed: each runs in its own PID, mount, IPC, UTS and
/// network namespaces, pivot_rooted into `<roots>/<sandbox id>` (which holds only its kernel,
/// initrd, disks and socket directory), as `uid`:`gid` once its VM is built. The only place
/// it may write afterwards is its own snapshot directory `<snapshots>/<sandbox id>`.
#[derive(Clone, Debug)]
pub struct VmmJail {
    pub uid: u32,
    pub gid: u32,
    /// Parent of the per-sandbox snapshot directories.
    pub snapshots: PathBuf,
    /// Parent of the jail roots (outside the sandbox directories, which the jail exposes).
    pub roots: PathBuf,
}

/// The unprivileged uid/gid jailed VMMs run as (`nobody`).
pub const JAIL_UID: u32 = 65534;
pub const JAIL_GID: u32 = 65534;

impl VmmJail {
    /// The snapshot directory of sandbox `id`: made, owned by the jail's uid, private.
    fn snapshot_dir(&self, id: &str) -> Result<PathBuf> {
        use std::os::unix::fs::PermissionsExt;
        let dir = self.snapshots.join(id);
        std::fs::create_dir_all(&dir)
            .map_err(|e| EdgeError::io(format!("create {}", dir.display()), e))?;
        std::os::unix::fs::chown(&dir, Some(self.uid), Some(self.gid))
            .map_err(|e| EdgeError::io(format!("chown {} to the jail uid", dir.display()), e))?;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| EdgeError::io(format!("chmod {}", dir.display()), e))?;
        Ok(dir)
    }

    /// The jail root of sandbox `id`.
    pub fn root(&self, id: &str) -> PathBuf {
        self.roots.join(id)
    }

    /// `dsec-vmm` arguments that jail it, with the snapshot directory as its one writable
    /// extra.
    fn args(&self, id: &str, snapshot_dir: &Path) -> Vec<std::ffi::OsString> {
        let mut expose = snapshot_dir.as_os_str().to_owned();
        expose.push(",rw");
        vec![
            "--jail".into(),
            self.root(id).into_os_string(),
            "--jail-uid".into(),
            self.uid.to_string().into(),
            "--jail-gid".into(),
            self.gid.to_string().into(),
            "--jail-expose".into(),
            expose,
        ]
    }
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

enum Runtime {
    /// PID (in our namespace) of the agent, which is PID 1 of the sandbox's PID namespace.
    Container {
        agent_pid: Pid,
    },
    MicroVm {
        vmm: tokio::process::Child,
    },
    /// Already torn down.
    Gone,
}

/// Owns what a sandbox holds on the host; dropping it kills and removes everything.
struct HostResources {
    runtime: Runtime,
    dir: PathBuf,
    /// Where a jailed VMM may write snapshots, and its jail root; None when not jailed.
    snapshot_dir: Option<PathBuf>,
    jail_root: Option<PathBuf>,
}

impl Drop for HostResources {
    fn drop(&mut self) {
        let runtime = std::mem::replace(&mut self.runtime, Runtime::Gone);
        remove_if_empty(self.snapshot_dir.as_deref());
        remove_jail_root(self.jail_root.as_deref());
        if let Err(err) = teardown(runtime, &self.dir) {
            tracing::warn!(dir = %self.dir.display(), %err, "sandbox teardown failed");
        }
    }
}

/// A running sandbox. Call [`Sandbox::destroy`]; dropping it tears it down forcefully.
pub struct Sandbox {
    id: String,
    kind: BackendKind,
    client: AgentClient,
    host: HostResources,
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
            BackendKind::Container => create_container(config, spec).await,
            BackendKind::MicroVm => create_microvm(config, spec).await,
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
        let runtime = std::mem::replace(&mut self.host.runtime, Runtime::Gone);
        let dir = self.host.dir.clone();
        remove_if_empty(self.host.snapshot_dir.take().as_deref());
        remove_jail_root(self.host.jail_root.take().as_deref());
        tokio::task::spawn_blocking(move || teardown(runtime, &dir))
            .await
            .map_err(|e| EdgeError::Protocol(format!("teardown task failed: {e}")))?
    }
}

/// A jailed sandbox's snapshot directory outlives it only when it holds snapshots.
fn remove_if_empty(dir: Option<&Path>) {
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

/// Kills what runs, reaps it and removes the sandbox directory. Blocking.
fn teardown(runtime: Runtime, dir: &Path) -> Result<()> {
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
    if dir.as_os_str().is_empty() {
        return Ok(());
    }
    crate::idpool::release(dir);
    match std::fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(EdgeError::io(
            format!("remove sandbox directory {}", dir.display()),
            e,
        )),
    }
}

fn make_sandbox_dir(config: &EdgeConfig, id: &str) -> Result<PathBuf> {
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
    Ok(dir)
}

fn tail_of(path: &Path, label: &str) -> String {
    match std::fs::read(path) {
        Ok(bytes) if !bytes.is_empty() => {
            let start = bytes.len().saturating_sub(2000);
            format!(
                "; last lines of {label} ({}):\n{}",
                path.display(),
                String::from_utf8_lossy(&bytes[start..]).trim_end()
            )
        }
        _ => String::new(),
    }
}

fn cstring(s: impl AsRef<std::ffi::OsStr>) -> Result<CString> {
    CString::new(s.as_ref().as_bytes())
        .map_err(|_| EdgeError::InvalidSpec(format!("{:?} contains a NUL byte", s.as_ref())))
}

async fn create_container(config: &EdgeConfig, spec: &SandboxSpec) -> Result<Sandbox> {
    let kind = BackendKind::Container;
    let rootfs = spec
        .rootfs
        .clone()
        .unwrap_or_else(|| config.artifacts.rootfs.clone());
    if !rootfs.join("bin").is_dir() {
        return Err(EdgeError::MissingArtifact {
            what: "container root filesystem",
            path: rootfs,
            hint: "build it with `guest-agent/mkinitramfs.sh --install` (or set DSEC_HOME)",
        });
    }
    let agent_bin = match &config.agent_bin {
        Some(path) => path.clone(),
        None => find_binary("dsec-agent").ok_or(EdgeError::MissingBinary {
            what: "agent",
            name: "dsec-agent",
            hint: "build it with `cargo build -p dsec-agent`",
        })?,
    };
    let id = spec
        .id
        .clone()
        .unwrap_or_else(|| new_sandbox_id(BackendKind::Container));
    let dir = make_sandbox_dir(config, &id)?;
    let socket = dir.join("agent.sock");
    let log_path = dir.join("agent.log");
    let started = crate::idpool::IdPool::from_env()
        .and_then(|pool| pool.allocate(&dir))
        .and_then(|ids| {
            spawn_container_agent(&ContainerStart {
                agent_bin: &agent_bin,
                rootfs: &rootfs,
                dir: &dir,
                socket: &socket,
                log_path: &log_path,
                id: &id,
                disk_mib: spec.disk_mib,
                // /dev/shm is memory: a quarter of it, at most 64 MiB (Docker's default).
                shm_mib: (u64::from(spec.mem_mib) / 4).clamp(1, 64),
                ids,
                cgroup_procs: &spec.cgroup_procs,
            })
        });
    let agent_pid = match started {
        Ok(pid) => pid,
        Err(err) => {
            crate::idpool::release(&dir);
            let _ = std::fs::remove_dir_all(&dir);
            return Err(err);
        }
    };
    let mut host = HostResources {
        runtime: Runtime::Container { agent_pid },
        dir,
        snapshot_dir: None,
        jail_root: None,
    };
    let deadline = Instant::now() + spec.ready_timeout;
    loop {
        if let Ok(Some(status)) = try_reap(agent_pid) {
            host.runtime = Runtime::Gone;
            return Err(EdgeError::SandboxDied {
                id,
                detail: format!(" ({status:?}){}", tail_of(&log_path, "agent log")),
            });
        }
        if socket.exists() {
            // Bound the whole attempt (connect, HTTP/2 handshake, Info): retry, never hang.
            let attempt = tokio::time::timeout(Duration::from_secs(5), async {
                let client = AgentClient::connect(AgentAddr::Unix(socket.clone())).await?;
                client.info().await.map(|_| client)
            });
            if let Ok(Ok(client)) = attempt.await {
                return Ok(Sandbox {
                    id,
                    kind,
                    client,
                    host,
                });
            }
        }
        if Instant::now() > deadline {
            return Err(EdgeError::AgentNotReady {
                id,
                timeout: spec.ready_timeout,
                detail: tail_of(&log_path, "agent log"),
            });
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn try_reap(pid: Pid) -> nix::Result<Option<WaitStatus>> {
    match waitpid(pid, Some(WaitPidFlag::WNOHANG))? {
        WaitStatus::StillAlive => Ok(None),
        status => Ok(Some(status)),
    }
}

/// Environment variable naming a container agent's sandbox directory (see
/// `spawn_container_agent`).
pub const AGENT_DIR_ENV: &str = "DSEC_SANDBOX_DIR";

/// What a container's agent is started with.
struct ContainerStart<'a> {
    agent_bin: &'a Path,
    rootfs: &'a Path,
    dir: &'a Path,
    socket: &'a Path,
    log_path: &'a Path,
    id: &'a str,
    disk_mib: Option<u32>,
    shm_mib: u64,
    ids: crate::idpool::IdRange,
    cgroup_procs: &'a [PathBuf],
}

/// Starts the agent as PID 1 of fresh mount/pid/uts/ipc/net namespaces, already in the
/// sandbox's cgroups. It gets two descriptors: the listening socket (bound here, in the
/// host's network namespace) and a pipe holding its `ContainerLaunch`; its command line
/// names no host path. The agent builds the root and the user namespace itself.
fn spawn_container_agent(start: &ContainerStart<'_>) -> Result<Pid> {
    use prost::Message;
    use std::os::unix::fs::PermissionsExt;
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(start.log_path)
        .map_err(|e| EdgeError::io(format!("create {}", start.log_path.display()), e))?;
    let devnull =
        std::fs::File::open("/dev/null").map_err(|e| EdgeError::io("open /dev/null", e))?;
    let _ = std::fs::remove_file(start.socket);
    let listener = std::os::unix::net::UnixListener::bind(start.socket)
        .map_err(|e| EdgeError::io(format!("bind {}", start.socket.display()), e))?;
    // Only the host side (root) may talk to the agent.
    std::fs::set_permissions(start.socket, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| EdgeError::io(format!("chmod {}", start.socket.display()), e))?;
    let path_str = |p: &Path| {
        p.to_str()
            .map(str::to_owned)
            .ok_or_else(|| EdgeError::InvalidSpec(format!("{} is not valid UTF-8", p.display())))
    };
    let launch = dsec_api::agent::v1::ContainerLaunch {
        listen_fd: listener.as_raw_fd(),
        lower_dir: path_str(start.rootfs)?,
        sandbox_dir: path_str(start.dir)?,
        disk_mib: start.disk_mib.map(u64::from).unwrap_or(0),
        hostname: start.id.to_string(),
        id_base: start.ids.base,
        id_count: start.ids.count,
        shm_mib: start.shm_mib,
    }
    .encode_to_vec();
    let (launch_r, launch_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
        .map_err(|e| EdgeError::io("pipe for the container launch", e.into()))?;
    // A few hundred bytes: far below the pipe's buffer, so this never blocks.
    std::fs::File::from(launch_w)
        .write_all(&launch)
        .map_err(|e| EdgeError::io("write the container launch", e))?;
    let procs = start
        .cgroup_procs
        .iter()
        .map(|p| {
            std::fs::OpenOptions::new()
                .write(true)
                .open(p)
                .map_err(|e| EdgeError::io(format!("open {}", p.display()), e))
        })
        .collect::<Result<Vec<_>>>()?;
    let cgroup_fds: Vec<i32> = procs.iter().map(|f| f.as_raw_fd()).collect();
    let inherited = [listener.as_raw_fd(), launch_r.as_raw_fd()];
    // Everything the child touches is prepared here: after clone only async-signal-safe
    // calls (write, fcntl, dup2, execve) may run, so no allocation happens in the child.
    let argv: Vec<CString> = vec![
        cstring("dsec-agent")?,
        cstring("--container-launch-fd")?,
        cstring(launch_r.as_raw_fd().to_string())?,
    ];
    let agent_path = cstring(start.agent_bin)?;
    let mut envp: Vec<CString> = std::env::vars_os()
        .filter(|(k, _)| k == "DSEC_AGENT_LOG" || k == "RUST_BACKTRACE")
        .map(|(k, v)| {
            let mut kv = k;
            kv.push("=");
            kv.push(v);
            cstring(kv)
        })
        .collect::<Result<_>>()?;
    // How a daemon restarted after a crash finds the agent of a sandbox it never recorded:
    // only host root can read another process's environment (the agent drops it from what
    // its commands inherit), where anyone could read a command line.
    let mut marker = std::ffi::OsString::from(format!("{AGENT_DIR_ENV}="));
    marker.push(start.dir);
    envp.push(cstring(marker)?);
    let mut argv_ptrs: Vec<*const libc::c_char> = argv.iter().map(|s| s.as_ptr()).collect();
    argv_ptrs.push(std::ptr::null());
    let mut envp_ptrs: Vec<*const libc::c_char> = envp.iter().map(|s| s.as_ptr()).collect();
    envp_ptrs.push(std::ptr::null());
    let (log_fd, null_fd) = (log.as_raw_fd(), devnull.as_raw_fd());
    // The child shares our memory until its execve (CLONE_VM | CLONE_VFORK, like
    // posix_spawn): copying the daemon's page tables for every sandbox, then tearing them
    // down at exec, was a large part of a create's CPU time in bursts. Signals stay blocked
    // in between so that none of our handlers runs on the child's side of shared memory.
    // SAFETY: sigset_t is plain data; sigfillset and pthread_sigmask only write the sets.
    let mut old_mask: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old_mask);
    }
    let child_main = Box::new(|| {
        // SAFETY: runs in the cloned child while the parent thread waits (CLONE_VFORK);
        // setsid, write, fcntl, dup2, pthread_sigmask and execve are async-signal-safe,
        // nothing allocates, and all pointers refer to memory prepared before clone.
        unsafe {
            // Into the sandbox's cgroups before anything runs ("0" = the writer): the
            // agent's cgroup namespace is rooted there.
            for fd in &cgroup_fds {
                if libc::write(*fd, b"0".as_ptr().cast(), 1) != 1 {
                    let msg = b"dsec-edge: the agent could not join its cgroups\n";
                    libc::write(log_fd, msg.as_ptr().cast(), msg.len());
                    libc::_exit(126);
                }
            }
            // Own session: the sandbox must outlive the daemon (no SIGHUP from its terminal).
            libc::setsid();
            for fd in inherited {
                libc::fcntl(fd, libc::F_SETFD, 0);
            }
            libc::dup2(null_fd, 0);
            libc::dup2(log_fd, 1);
            libc::dup2(log_fd, 2);
            libc::pthread_sigmask(libc::SIG_SETMASK, &old_mask, std::ptr::null_mut());
            libc::execve(agent_path.as_ptr(), argv_ptrs.as_ptr(), envp_ptrs.as_ptr());
            libc::_exit(127)
        }
    });
    let mut stack = vec![0u8; 64 * 1024];
    let flags = CloneFlags::CLONE_NEWNS
        | CloneFlags::CLONE_NEWPID
        | CloneFlags::CLONE_NEWUTS
        | CloneFlags::CLONE_NEWIPC
        | CloneFlags::CLONE_NEWNET
        | CloneFlags::CLONE_VM
        | CloneFlags::CLONE_VFORK;
    // SAFETY: the child only runs `child_main` (async-signal-safe calls, then execve or
    // _exit) on `stack`, which stays alive because this thread is suspended until the child
    // has exec'd or exited; it never returns into Rust code of the parent.
    let cloned = unsafe { nix::sched::clone(child_main, &mut stack, flags, Some(libc::SIGCHLD)) };
    // SAFETY: restores this thread's signal mask saved above.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &old_mask, std::ptr::null_mut()) };
    let pid = cloned
        .map_err(|e| EdgeError::io("clone the sandbox's namespaces (are we root?)", e.into()))?;
    // Our copies close here: the agent holds the only listening descriptor, so a dead
    // agent refuses connections at once instead of leaving them pending.
    drop((listener, launch_r, procs));
    Ok(pid)
}

async fn create_microvm(config: &EdgeConfig, spec: &SandboxSpec) -> Result<Sandbox> {
    let kernel = spec
        .kernel
        .clone()
        .unwrap_or_else(|| config.artifacts.kernel.clone());
    let initrd = spec
        .initrd
        .clone()
        .unwrap_or_else(|| config.artifacts.initramfs.clone());
    if !kernel.is_file() {
        return Err(EdgeError::MissingArtifact {
            what: "guest kernel",
            path: kernel,
            hint: "build it with guest-kernel/build.sh, or pass --kernel",
        });
    }
    if !initrd.is_file() {
        return Err(EdgeError::MissingArtifact {
            what: "initramfs",
            path: initrd,
            hint: "build it with `guest-agent/mkinitramfs.sh --install`, or pass --initrd",
        });
    }
    if let Some(root) = &spec.root_disk {
        if !root.is_file() {
            return Err(EdgeError::MissingArtifact {
                what: "root disk image",
                path: root.clone(),
                hint: "build it with `images/debian/build.sh --install` (./setup.sh runs it)",
            });
        }
        if root.as_os_str().as_bytes().contains(&b',') {
            return Err(EdgeError::InvalidSpec(format!(
                "root disk path {} contains ',', which the VMM's --drive flag cannot take",
                root.display()
            )));
        }
    }
    let kvm = KvmStatus::detect();
    if let Some(reason) = kvm.why_not_microvm() {
        return Err(EdgeError::BackendUnavailable {
            backend: "microvm",
            reason: format!("{reason}; use --backend container (or auto)"),
        });
    }
    let vmm_bin = match &config.vmm_bin {
        Some(path) => path.clone(),
        None => find_binary("dsec-vmm").ok_or(EdgeError::MissingBinary {
            what: "VMM",
            name: "dsec-vmm",
            hint: "build it with `cargo build --release -p dsec-vmm`",
        })?,
    };
    let id = spec
        .id
        .clone()
        .unwrap_or_else(|| new_sandbox_id(BackendKind::MicroVm));
    let dir = make_sandbox_dir(config, &id)?;
    let vsock = dir.join("vsock.sock");
    let serial = dir.join("serial.log");
    let vmm_log = dir.join("vmm.log");
    let api_sock = dir.join("api.sock");
    let mut cmdline = String::from("console=ttyS0 reboot=k panic=-1 quiet");
    let mut drives = Vec::new();
    if let Some(root) = &spec.root_disk {
        let upper = dir.join("upper.ext4");
        let mib = spec.disk_mib.unwrap_or(DEFAULT_UPPER_DISK_MIB);
        if let Err(err) = make_upper_disk(&upper, mib).await {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(err);
        }
        let mut ro = root.clone().into_os_string();
        ro.push(",ro");
        drives.push(ro);
        drives.push(upper.into_os_string());
        // Read by the agent from /proc/cmdline (dotted words never reach init's argv).
        cmdline.push_str(" dsec.root=/dev/vda dsec.upper=/dev/vdb");
    }
    if let Some(extra) = &spec.extra_cmdline {
        cmdline.push(' ');
        cmdline.push_str(extra);
    }
    let log = std::fs::File::create(&vmm_log)
        .map_err(|e| EdgeError::io(format!("create {}", vmm_log.display()), e))?;
    let log_err = log
        .try_clone()
        .map_err(|e| EdgeError::io("dup log fd", e))?;
    let mut command = tokio::process::Command::new(&vmm_bin);
    command
        .arg("--kernel")
        .arg(&kernel)
        .arg("--initrd")
        .arg(&initrd)
        .arg("--cmdline")
        .arg(&cmdline)
        .arg("--vcpus")
        .arg(spec.vcpus.to_string())
        .arg("--mem-mib")
        .arg(spec.mem_mib.to_string())
        .arg("--vsock-uds")
        .arg(&vsock)
        .arg("--serial-log")
        .arg(&serial)
        .arg("--api-sock")
        .arg(&api_sock);
    for drive in &drives {
        command.arg("--drive").arg(drive);
    }
    let snapshot_dir = match jail_vmm(config, &mut command, &id) {
        Ok(d) => d,
        Err(err) => {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(err);
        }
    };
    command
        .stdin(std::process::Stdio::null())
        .stdout(log)
        .stderr(log_err);
    let spawned = spawn_vmm(command, &spec.cgroup_procs);
    let vmm = match spawned {
        Ok(child) => child,
        Err(e) => {
            remove_if_empty(snapshot_dir.as_deref());
            let _ = std::fs::remove_dir_all(&dir);
            return Err(EdgeError::io(format!("start {}", vmm_bin.display()), e));
        }
    };
    let host = HostResources {
        runtime: Runtime::MicroVm { vmm },
        dir,
        jail_root: snapshot_dir
            .as_ref()
            .and(config.jail.as_ref())
            .map(|j| j.root(&id)),
        snapshot_dir,
    };
    wait_microvm_ready(id, host, spec.ready_timeout).await
}

/// Size of a microVM's writable upper disk when the spec gives none.
pub const DEFAULT_UPPER_DISK_MIB: u32 = 1024;

/// Creates a sparse file of `mib` MiB holding an empty ext4 (no journal: the disk lives and
/// dies with the sandbox; lazy init: only metadata blocks get written).
async fn make_upper_disk(path: &Path, mib: u32) -> Result<()> {
    if mib < 16 {
        return Err(EdgeError::InvalidSpec(format!(
            "a {mib} MiB disk is too small for a root overlay: use at least 16 MiB"
        )));
    }
    let file = std::fs::File::create(path)
        .map_err(|e| EdgeError::io(format!("create {}", path.display()), e))?;
    file.set_len(u64::from(mib) << 20)
        .map_err(|e| EdgeError::io(format!("size {} to {mib} MiB", path.display()), e))?;
    drop(file);
    // sbin is often not on a non-root PATH.
    let mkfs = find_binary("mkfs.ext4")
        .or_else(|| {
            ["/usr/sbin/mkfs.ext4", "/sbin/mkfs.ext4"]
                .into_iter()
                .map(PathBuf::from)
                .find(|p| p.is_file())
        })
        .unwrap_or_else(|| PathBuf::from("mkfs.ext4"));
    let output = tokio::process::Command::new(mkfs)
        .args([
            "-q",
            "-F",
            "-m",
            "0",
            "-L",
            "dsec-upper",
            "-O",
            "^has_journal",
        ])
        .args(["-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard"])
        .arg(path)
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .map_err(|e| EdgeError::FormatDisk {
            path: path.to_path_buf(),
            detail: format!("cannot run mkfs.ext4: {e}"),
        })?;
    if !output.status.success() {
        return Err(EdgeError::FormatDisk {
            path: path.to_path_buf(),
            detail: format!(
                "{}: {}",
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            ),
        });
    }
    Ok(())
}

async fn wait_microvm_ready(
    id: String,
    mut host: HostResources,
    ready_timeout: Duration,
) -> Result<Sandbox> {
    let kind = BackendKind::MicroVm;
    let vsock = host.dir.join("vsock.sock");
    let serial = host.dir.join("serial.log");
    let vmm_log = host.dir.join("vmm.log");
    let deadline = Instant::now() + ready_timeout;
    let addr = AgentAddr::VsockUds {
        uds: vsock.clone(),
        port: dsec_api::AGENT_VSOCK_PORT,
    };
    loop {
        if let Runtime::MicroVm { vmm } = &mut host.runtime {
            if let Ok(Some(status)) = vmm.try_wait() {
                host.runtime = Runtime::Gone;
                let detail = format!(
                    " (VMM exited: {status}){}{}",
                    tail_of(&vmm_log, "VMM log"),
                    tail_of(&serial, "serial console")
                );
                return Err(EdgeError::SandboxDied { id, detail });
            }
        }
        if vsock.exists() {
            // Bound the whole attempt: before the guest's vsock driver is up the VMM accepts
            // the connection but cannot answer the handshake yet, and a handshake that is
            // never answered must turn into a retry, not a hang.
            let attempt = tokio::time::timeout(Duration::from_secs(5), async {
                let client = AgentClient::connect(addr.clone()).await?;
                client.info().await.map(|_| client)
            });
            if let Ok(Ok(client)) = attempt.await {
                return Ok(Sandbox {
                    id,
                    kind,
                    client,
                    host,
                });
            }
        }
        if Instant::now() > deadline {
            return Err(EdgeError::AgentNotReady {
                id,
                timeout: ready_timeout,
                detail: tail_of(&serial, "serial console"),
            });
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Starts a VMM in its own session (it must outlive a daemon that is killed) and moves it
/// into the given cgroups. Teardown (not drop) kills it.
/// Adds the jail arguments when the edge jails its VMMs; returns the sandbox's snapshot
/// directory then.
fn jail_vmm(
    config: &EdgeConfig,
    command: &mut tokio::process::Command,
    id: &str,
) -> Result<Option<PathBuf>> {
    let Some(jail) = &config.jail else {
        return Ok(None);
    };
    let snapshots = jail.snapshot_dir(id)?;
    command.args(jail.args(id, &snapshots));
    Ok(Some(snapshots))
}

fn spawn_vmm(
    mut command: tokio::process::Command,
    cgroup_procs: &[PathBuf],
) -> std::io::Result<tokio::process::Child> {
    use std::os::fd::AsRawFd;
    // Opened here, written by the child before exec: the VMM is in its cgroups before it
    // runs, so a jailed VMM's forked child cannot start outside them.
    let procs = cgroup_procs
        .iter()
        .map(|p| {
            std::fs::OpenOptions::new()
                .write(true)
                .open(p)
                .map_err(|e| std::io::Error::new(e.kind(), format!("open {}: {e}", p.display())))
        })
        .collect::<std::io::Result<Vec<_>>>()?;
    let fds: Vec<i32> = procs.iter().map(|f| f.as_raw_fd()).collect();
    // SAFETY: setsid and write are async-signal-safe; the closure only reads `fds` (copied
    // into it) and a static byte string.
    unsafe {
        command.pre_exec(move || {
            nix::unistd::setsid().map_err(std::io::Error::from)?;
            for fd in &fds {
                // "0" moves the writing process (this child) into the cgroup.
                if libc::write(*fd, b"0".as_ptr().cast(), 1) != 1 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    let child = command.spawn();
    drop(procs);
    child
}

/// Restores a microVM from a snapshot directory written by the VMM (`{"op":"snapshot"}`),
/// with its own vsock socket and context id, and waits until its agent answers. A sandbox on
/// a disk image gets `upper`, its own copy of the parent's upper disk (moved into its
/// directory), in place of the disk the snapshot names.
pub async fn restore_microvm(
    config: &EdgeConfig,
    snapshot: &Path,
    id: &str,
    vsock_cid: u64,
    spec: &SandboxSpec,
    upper: Option<&Path>,
) -> Result<Sandbox> {
    let vmm_bin = match &config.vmm_bin {
        Some(path) => path.clone(),
        None => find_binary("dsec-vmm").ok_or(EdgeError::MissingBinary {
            what: "VMM",
            name: "dsec-vmm",
            hint: "build it with `cargo build --release -p dsec-vmm`",
        })?,
    };
    let dir = make_sandbox_dir(config, id)?;
    let vsock = dir.join("vsock.sock");
    let serial = dir.join("serial.log");
    let vmm_log = dir.join("vmm.log");
    let log = std::fs::File::create(&vmm_log)
        .map_err(|e| EdgeError::io(format!("create {}", vmm_log.display()), e))?;
    let log_err = log
        .try_clone()
        .map_err(|e| EdgeError::io("dup log fd", e))?;
    let mut command = tokio::process::Command::new(&vmm_bin);
    command
        .arg("--restore")
        .arg(snapshot)
        .arg("--vsock-uds")
        .arg(&vsock)
        .arg("--vsock-cid")
        .arg(vsock_cid.to_string())
        .arg("--serial-log")
        .arg(&serial)
        .arg("--api-sock")
        .arg(dir.join("api.sock"));
    if let (Some(root), Some(upper)) = (&spec.root_disk, upper) {
        let own = dir.join("upper.ext4");
        if let Err(e) = std::fs::rename(upper, &own) {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(EdgeError::io(
                format!("move {} to {}", upper.display(), own.display()),
                e,
            ));
        }
        let mut ro = root.clone().into_os_string();
        ro.push(",ro");
        command.arg("--drive").arg(ro).arg("--drive").arg(own);
    }
    let snapshot_dir = match jail_vmm(config, &mut command, id) {
        Ok(d) => d,
        Err(err) => {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(err);
        }
    };
    command
        .stdin(std::process::Stdio::null())
        .stdout(log)
        .stderr(log_err);
    let vmm = match spawn_vmm(command, &spec.cgroup_procs) {
        Ok(child) => child,
        Err(e) => {
            remove_if_empty(snapshot_dir.as_deref());
            let _ = std::fs::remove_dir_all(&dir);
            return Err(EdgeError::io(format!("start {}", vmm_bin.display()), e));
        }
    };
    let host = HostResources {
        runtime: Runtime::MicroVm { vmm },
        dir,
        jail_root: snapshot_dir
            .as_ref()
            .and(config.jail.as_ref())
            .map(|j| j.root(id)),
        snapshot_dir,
    };
    wait_microvm_ready(id.to_string(), host, spec.ready_timeout).await
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
        remove_if_empty(self.snapshot_dir.as_deref());
        remove_jail_root(self.jail_root.as_deref());
        crate::idpool::release(&self.dir);
        match std::fs::remove_dir_all(&self.dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(EdgeError::io(
                format!("remove sandbox directory {}", self.dir.display()),
                e,
            )),
        }
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

/// Environment helper for callers: parses `K=V`.
pub fn parse_env_pair(pair: &str) -> Result<(String, String)> {
    match pair.split_once('=') {
        Some((key, value)) if !key.is_empty() => Ok((key.to_string(), value.to_string())),
        _ => Err(EdgeError::InvalidSpec(format!(
            "bad environment variable {pair:?}: expected KEY=VALUE with a non-empty KEY"
        ))),
    }
}

/// Collects `K=V` pairs into a map (later ones win).
pub fn parse_env(pairs: &[String]) -> Result<HashMap<String, String>> {
    pairs.iter().map(|p| parse_env_pair(p)).collect()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jailed_vmms_get_a_private_snapshot_dir_and_the_jail_flags() {
        use std::os::unix::fs::MetadataExt;
        if !nix::unistd::geteuid().is_root() {
            panic!("this test needs root (chown to the jail uid)");
        }
        let base = std::env::temp_dir().join(format!("dsec-jail-test-{}", std::process::id()));
        let jail = VmmJail {
            uid: JAIL_UID,
            gid: JAIL_GID,
            snapshots: base.join("snapshots"),
            roots: PathBuf::from("/run/dsec/jails"),
        };
        let dir = jail.snapshot_dir("vm-1").unwrap();
        let meta = std::fs::metadata(&dir).unwrap();
        assert_eq!(
            (meta.uid(), meta.gid(), meta.mode() & 0o777),
            (JAIL_UID, JAIL_GID, 0o700)
        );
        let args: Vec<String> = jail
            .args("vm-1", &dir)
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            args,
            [
                "--jail",
                "/run/dsec/jails/vm-1",
                "--jail-uid",
                "65534",
                "--jail-gid",
                "65534",
                "--jail-expose",
                &format!("{},rw", dir.display()),
            ]
        );
        std::fs::remove_dir_all(&base).unwrap();
    }

    #[tokio::test]
    async fn upper_disk_is_a_sparse_ext4_of_the_asked_size() {
        let dir = std::env::temp_dir().join(format!("dsec-upper-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("upper.ext4");
        let made = make_upper_disk(&path, 256).await;
        let meta = std::fs::metadata(&path);
        let mut superblock = [0u8; 2048];
        let read = std::fs::File::open(&path).and_then(|mut f| {
            use std::io::Read;
            f.read_exact(&mut superblock)
        });
        let too_small = make_upper_disk(&dir.join("tiny.ext4"), 8).await;
        let _ = std::fs::remove_dir_all(&dir);
        made.unwrap();
        read.unwrap();
        let meta = meta.unwrap();
        assert_eq!(meta.len(), 256 << 20);
        use std::os::unix::fs::MetadataExt;
        // Lazy init writes only metadata: a small part of the size is allocated.
        assert!(
            meta.blocks() * 512 < 32 << 20,
            "{} bytes allocated",
            meta.blocks() * 512
        );
        // ext4 superblock magic at byte 1024 + 0x38.
        assert_eq!(&superblock[1080..1082], &[0x53, 0xef]);
        let err = too_small.unwrap_err().to_string();
        assert!(err.contains("too small"), "{err}");
    }
}
