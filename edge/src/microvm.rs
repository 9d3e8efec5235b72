//! One microVM process: a `dsec-vmm` started from a typed [`VmmLaunch`], waited on until its
//! guest agent answers, driven through its control socket, refreshed after a restore, killed
//! and reaped.
//!
//! A microVM lives in a directory ([`MicroVmDir`]): `api.sock` (control socket), `vsock.sock`
//! (its agent), `serial.log`, `vmm.log` (the VMM's stdout and stderr) and `pid`.
//!
//! # How callers start one
//!
//! ```text
//! let dir = MicroVmDir::new(sandbox_dir);                 // the directory must exist
//! let mut launch = VmmLaunch::boot(config);                // or ::restore(RestoreLaunch{..})
//! launch.jail = Some(JailLaunch { expose: vec![snapshot_dir,rw], ..JailLaunch::new(root, uid, gid) });
//! let vm = MicroVm::spawn(&SpawnOptions { vmm_bin, cgroup_procs, nice: 0 }, &dir, launch)?
//!     .ready(ready_timeout)                                // agent answers; a restore is refreshed
//!     .await?;
//! vm.agent();  vm.control().pause() (blocking) / control_call(vm.control().clone(), req).await
//! let child = vm.into_child();   // keep supervising it (the daemon's record), or
//! let pid = vm.detach();         // leave it running (`dsec vm boot`), or
//! vm.kill().await?;              // SIGKILL to its process group (a jailed VMM's child too), reap
//! ```
//!
//! - `spawn` points the launch's sockets and logs at the directory, puts the VMM in its own
//!   session (it outlives the caller) and, before it runs, in the given cgroups.
//! - `ready` is the one wait loop: it returns once the agent answers `Info`, fails with the
//!   VMM's and the console's log tails when the VMM exits or the deadline passes, and kills
//!   the VMM on any failure. A restored guest (`--restore`, or a prewarmed VMM after
//!   [`StartingMicroVm::restore`]) is refreshed first: fresh host entropy (CRNG reseed), the
//!   host's clock and, when the launch gives the snapshot's network device a MAC, that MAC.
//!   Nobody sees a restored guest that still shares its parent's random state.
//! - For a sandbox already recorded (no `MicroVm` at hand, e.g. after a daemon restart), build
//!   a [`ControlClient`] on its `api.sock` and use [`control_call`].
//!
//! The daemon's create, restore and fork (`backend/microvm.rs`) and `dsec vm` start every
//! VMM this way.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use dsec_vmm_api::control::{Request, RestoreReply, RestoreRequest};
use dsec_vmm_api::{ControlClient, LaunchMode, SerialOutput, VmmLaunch, VsockConfig};
use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::Pid;
use serde::de::DeserializeOwned;

use crate::cgroup_join::{join_in_child, CgroupJoin};
use crate::paths::log_tail;
use crate::{AgentAddr, AgentClient, EdgeError, Result};

/// Bounds of one readiness attempt (connect + Info): before the guest's vsock driver is up
/// the VMM accepts the connection but cannot answer, and that must become a retry.
const ATTEMPT_MIN: Duration = Duration::from_millis(100);
const ATTEMPT_MAX: Duration = Duration::from_secs(5);
/// How long a restored guest may take to accept fresh entropy and time.
pub const REFRESH_TIMEOUT: Duration = Duration::from_secs(30);
/// Bytes of host entropy a restored guest is reseeded with.
const REFRESH_ENTROPY: usize = 64;

/// The directory one microVM's sockets and logs live in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MicroVmDir(PathBuf);

impl MicroVmDir {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        MicroVmDir(dir.into())
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    /// The VMM's control socket.
    pub fn api_sock(&self) -> PathBuf {
        self.0.join("api.sock")
    }

    /// The host end of the guest's vsock device.
    pub fn vsock(&self) -> PathBuf {
        self.0.join("vsock.sock")
    }

    pub fn serial_log(&self) -> PathBuf {
        self.0.join("serial.log")
    }

    pub fn vmm_log(&self) -> PathBuf {
        self.0.join("vmm.log")
    }

    pub fn pid_file(&self) -> PathBuf {
        self.0.join("pid")
    }

    /// Where the guest agent answers.
    pub fn agent_addr(&self) -> AgentAddr {
        AgentAddr::VsockUds {
            uds: self.vsock(),
            port: dsec_api::AGENT_VSOCK_PORT,
        }
    }

    /// A control client for this VM's socket.
    pub fn control(&self) -> ControlClient {
        ControlClient::new(self.api_sock())
    }

    /// Points the launch's control socket, vsock device and console at this directory.
    pub fn wire(&self, launch: &mut VmmLaunch) {
        launch.api_sock = Some(self.api_sock());
        let serial = SerialOutput::File(self.serial_log());
        match &mut launch.mode {
            LaunchMode::Boot(config) => {
                let guest_cid = config
                    .vsock
                    .as_ref()
                    .map_or(dsec_vmm_api::config::MIN_GUEST_CID, |v| v.guest_cid);
                config.vsock = Some(VsockConfig {
                    uds_path: self.vsock(),
                    guest_cid,
                });
                config.serial = serial;
            }
            LaunchMode::BootFile { overrides, .. } => {
                overrides.vsock_uds = Some(self.vsock());
                overrides.serial = Some(serial);
            }
            LaunchMode::Restore(_) | LaunchMode::Prewarm(_) => {
                if let Some(o) = launch.snapshot_overrides_mut() {
                    o.vsock_uds = Some(self.vsock());
                    o.serial = Some(serial);
                }
            }
        }
    }

    fn name(&self) -> String {
        self.0
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| self.0.display().to_string())
    }
}

/// How the VMM process is started.
#[derive(Clone, Debug)]
pub struct SpawnOptions {
    /// The `dsec-vmm` binary.
    pub vmm_bin: PathBuf,
    /// `cgroup.procs` files the VMM joins before it runs (a jailed VMM's child cannot
    /// start outside them).
    pub cgroup_procs: Vec<PathBuf>,
    /// Nice value the VMM starts with (0: the daemon's). Prewarmed VMMs of the pool start at
    /// 19 so that building their VM shells never takes CPU from running sandboxes; a taken
    /// one is put back to 0 ([`StartingMicroVm::renice`]).
    pub nice: i32,
}

impl SpawnOptions {
    /// `dsec-vmm` from `bin` if given, else found next to this executable, in
    /// `$DSEC_HOME/bin` or on PATH; no cgroups.
    pub fn find(bin: Option<&Path>) -> Result<Self> {
        let vmm_bin = match bin {
            Some(path) => path.to_owned(),
            None => crate::find_binary("dsec-vmm").ok_or(EdgeError::MissingBinary {
                what: "VMM",
                name: "dsec-vmm",
                hint: "build it with `cargo build --release -p dsec-vmm`",
            })?,
        };
        Ok(SpawnOptions {
            vmm_bin,
            cgroup_procs: Vec::new(),
            nice: 0,
        })
    }
}

/// The VMM process; killed (with its process group) when dropped while still owned.
struct Process {
    child: Option<tokio::process::Child>,
    pid: u32,
}

impl Process {
    fn kill_group(&self) {
        let pid = Pid::from_raw(self.pid as i32);
        // Its own session (setsid): the group holds a jailed VMM's forked child too.
        let _ = killpg(pid, Signal::SIGKILL);
        let _ = kill(pid, Signal::SIGKILL);
    }

    async fn kill_and_reap(&mut self) -> Result<()> {
        if let Some(mut child) = self.child.take() {
            if matches!(child.try_wait(), Ok(None)) {
                self.kill_group();
            }
            child
                .wait()
                .await
                .map_err(|e| EdgeError::io(format!("reap the VMM (pid {})", self.pid), e))?;
        }
        Ok(())
    }

    fn release(&mut self) -> tokio::process::Child {
        // Only ever called once, on a value that still owns its child.
        self.child
            .take()
            .expect("the VMM process is owned until released")
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            if matches!(child.try_wait(), Ok(None)) {
                self.kill_group();
            }
        }
    }
}

/// A VMM that has been started but whose guest is not known to answer yet.
pub struct StartingMicroVm {
    dir: MicroVmDir,
    process: Process,
    /// A restored guest must be refreshed before anyone sees it.
    restored: bool,
    /// The MAC the restored guest's interface takes (the launch's or the restore request's).
    mac: Option<String>,
    /// The hostname a restored guest takes (its sandbox id); None keeps the snapshot's.
    hostname: Option<String>,
    /// The sandbox's env the agent starts every exec with; None leaves the agent's.
    env: Option<BTreeMap<String, String>>,
    /// The agent took `env` (agents from before that refresh field ignore it).
    env_set: bool,
    started: Instant,
    /// Connections tried before the agent answered, and when the first was (for the log).
    connect_attempts: u32,
    first_attempt_after: Option<Duration>,
}

impl std::fmt::Debug for StartingMicroVm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StartingMicroVm")
            .field("dir", &self.dir)
            .field("pid", &self.process.pid)
            .finish()
    }
}

/// A running microVM whose agent answers (and, if restored, has been refreshed).
pub struct MicroVm {
    dir: MicroVmDir,
    process: Process,
    agent: AgentClient,
    ready_after: Duration,
    clock_skew: Option<Duration>,
    env_in_guest: bool,
}

impl std::fmt::Debug for MicroVm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MicroVm")
            .field("dir", &self.dir)
            .field("pid", &self.process.pid)
            .finish()
    }
}

impl MicroVm {
    /// Starts `dsec-vmm` for `launch` with its sockets and logs in `dir` (which must exist).
    pub fn spawn(
        options: &SpawnOptions,
        dir: &MicroVmDir,
        mut launch: VmmLaunch,
    ) -> Result<StartingMicroVm> {
        dir.wire(&mut launch);
        let (restored, mac) = match &launch.mode {
            LaunchMode::Restore(r) => (true, r.overrides.net.as_ref().and_then(|n| n.mac.clone())),
            _ => (false, None),
        };
        let log_path = dir.vmm_log();
        let log = std::fs::File::create(&log_path)
            .map_err(|e| EdgeError::io(format!("create {}", log_path.display()), e))?;
        let log_err = log
            .try_clone()
            .map_err(|e| EdgeError::io("duplicate the VMM log descriptor", e))?;
        // The VMM is in its cgroups before it runs.
        let cgroups = CgroupJoin::open(&options.cgroup_procs)?;
        let fds = cgroups.fds();
        let nice = options.nice;
        let mut command = tokio::process::Command::new(&options.vmm_bin);
        command
            .args(launch.to_args())
            .stdin(std::process::Stdio::null())
            .stdout(log)
            .stderr(log_err);
        // SAFETY: setsid, setpriority and write (join_in_child) are async-signal-safe; the
        // closure only reads `fds` and `nice`, copied into it.
        unsafe {
            command.pre_exec(move || {
                nix::unistd::setsid().map_err(std::io::Error::from)?;
                if nice != 0 && libc::setpriority(libc::PRIO_PROCESS, 0, nice) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if !join_in_child(&fds) {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command
            .spawn()
            .map_err(|e| EdgeError::io(format!("start {}", options.vmm_bin.display()), e))?;
        drop(cgroups);
        let pid = child.id().unwrap_or(0);
        let process = Process {
            child: Some(child),
            pid,
        };
        std::fs::write(dir.pid_file(), pid.to_string())
            .map_err(|e| EdgeError::io(format!("write {}", dir.pid_file().display()), e))?;
        Ok(StartingMicroVm {
            dir: dir.clone(),
            process,
            restored,
            mac,
            hostname: None,
            env: None,
            env_set: false,
            started: Instant::now(),
            connect_attempts: 0,
            first_attempt_after: None,
        })
    }

    pub fn dir(&self) -> &MicroVmDir {
        &self.dir
    }

    pub fn pid(&self) -> u32 {
        self.process.pid
    }

    /// The guest agent (connected).
    pub fn agent(&self) -> &AgentClient {
        &self.agent
    }

    /// The VMM's control socket (blocking; see [`control_call`] from async code).
    pub fn control(&self) -> ControlClient {
        self.dir.control()
    }

    /// Spawn -> agent answering (and refreshed).
    pub fn ready_after(&self) -> Duration {
        self.ready_after
    }

    /// Its agent holds the sandbox's env (given [`with_env`](StartingMicroVm::with_env) and
    /// taken by the agent), which it starts every exec and session with.
    pub fn env_in_guest(&self) -> bool {
        self.env_in_guest
    }

    /// How far a restored guest's clock was off before the refresh set it (None: booted).
    pub fn clock_skew(&self) -> Option<Duration> {
        self.clock_skew
    }

    /// Kills the VMM and its process group and reaps it. The directory stays.
    pub async fn kill(mut self) -> Result<()> {
        self.process.kill_and_reap().await
    }

    /// Hands the process over to a caller that supervises it from now on.
    pub fn into_child(mut self) -> tokio::process::Child {
        self.process.release()
    }

    /// Leaves the VMM running on its own (it is in its own session); returns its pid.
    pub fn detach(self) -> u32 {
        let pid = self.process.pid;
        drop(self.into_child());
        pid
    }
}

impl StartingMicroVm {
    pub fn pid(&self) -> u32 {
        self.process.pid
    }

    pub fn dir(&self) -> &MicroVmDir {
        &self.dir
    }

    /// Whether the VMM has exited (a pooled VMM that died while it waited).
    pub fn has_exited(&mut self) -> bool {
        self.process
            .child
            .as_mut()
            .is_none_or(|c| !matches!(c.try_wait(), Ok(None)))
    }

    /// The same VMM, whose directory was renamed on the host to `dir` (a pooled VMM handed to
    /// a sandbox: its jail still sees the old path, which names the same directory).
    pub fn relocated(mut self, dir: MicroVmDir) -> Self {
        self.dir = dir;
        self
    }

    /// The VMM's pid and its children's (a jailed VMM's forked child).
    fn pids(&self) -> Vec<u32> {
        let mut pids = vec![self.process.pid];
        let children = format!("/proc/{0}/task/{0}/children", self.process.pid);
        if let Ok(text) = std::fs::read_to_string(&children) {
            pids.extend(
                text.split_whitespace()
                    .filter_map(|p| p.parse::<u32>().ok()),
            );
        }
        pids
    }

    /// Moves the running VMM (and, jailed, its forked child) into the cgroups whose
    /// `cgroup.procs` files are given: a pooled VMM joins its sandbox's before it restores,
    /// so everything the restore maps is charged there.
    pub fn join_cgroups(&self, procs: &[PathBuf]) -> Result<()> {
        let pids = self.pids();
        for file in procs {
            for pid in &pids {
                std::fs::write(file, pid.to_string()).map_err(|e| {
                    EdgeError::io(format!("move VMM pid {pid} into {}", file.display()), e)
                })?;
            }
        }
        Ok(())
    }

    /// Sets the nice value of every thread of the VMM and of its children (a jailed VMM's
    /// forked child): a prewarmed VMM started at 19 runs its sandbox at `nice`.
    pub fn renice(&self, nice: i32) -> Result<()> {
        let pids = self.pids();
        for pid in pids {
            let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
                .map_err(|e| EdgeError::io(format!("list the threads of VMM pid {pid}"), e))?;
            for tid in tasks
                .flatten()
                .filter_map(|t| t.file_name().to_str()?.parse::<u32>().ok())
            {
                // SAFETY: a plain syscall on a thread id; the result is checked.
                if unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, nice) } != 0 {
                    return Err(EdgeError::io(
                        format!("set the nice value of VMM thread {tid}"),
                        std::io::Error::last_os_error(),
                    ));
                }
            }
        }
        Ok(())
    }

    /// The hostname a restored guest takes when it is refreshed (a sandbox's id: every
    /// sandbox from one template or snapshot would otherwise share the snapshot's name).
    pub fn with_hostname(mut self, hostname: &str) -> Self {
        self.hostname = Some(hostname.to_string());
        self
    }

    /// The sandbox's env, given to the guest's agent with its hostname (a template's guest was
    /// snapshotted before the sandbox existed).
    pub fn with_env(mut self, env: Option<BTreeMap<String, String>>) -> Self {
        self.env = env;
        self
    }

    /// For a `--prewarm` VMM: asks it to restore a snapshot (waiting up to `timeout` for its
    /// socket to appear); the guest is then refreshed by [`ready`](Self::ready) like any
    /// restore, with the request's MAC.
    pub async fn restore(
        &mut self,
        request: RestoreRequest,
        timeout: Duration,
    ) -> Result<RestoreReply> {
        self.restored = true;
        self.mac = request.net.as_ref().and_then(|n| n.mac.clone());
        // A pooled VMM may have waited long: the agent deadline runs from the request.
        self.started = Instant::now();
        let client = self.dir.control().connect_timeout(timeout);
        control_call(client, Request::Restore(request)).await
    }

    /// Waits until the guest agent answers (refreshing a restored guest first), or fails
    /// with the logs' tails; the VMM is killed on failure.
    pub async fn ready(mut self, timeout: Duration) -> Result<MicroVm> {
        match self.wait_agent(timeout).await {
            Ok((agent, ready_after, clock_skew)) => Ok(MicroVm {
                dir: self.dir,
                process: self.process,
                agent,
                ready_after,
                clock_skew,
                env_in_guest: self.env_set,
            }),
            Err(e) => {
                let _ = self.process.kill_and_reap().await;
                Err(e)
            }
        }
    }

    async fn wait_agent(
        &mut self,
        timeout: Duration,
    ) -> Result<(AgentClient, Duration, Option<Duration>)> {
        let deadline = self.started + timeout;
        let vsock = self.dir.vsock();
        loop {
            if let Some(child) = &mut self.process.child {
                if let Ok(Some(status)) = child.try_wait() {
                    return Err(EdgeError::SandboxDied {
                        id: self.dir.name(),
                        detail: format!(
                            " (VMM exited: {status}){}{}",
                            log_tail(&self.dir.vmm_log(), "VMM log"),
                            log_tail(&self.dir.serial_log(), "serial console")
                        ),
                    });
                }
            }
            if vsock.exists() {
                // Bound every attempt, not just the loop: a guest that accepts the connection
                // but never answers must not hang us.
                let remaining = deadline.saturating_duration_since(Instant::now());
                // A restored guest's agent was serving when it was snapshotted: once the vsock
                // connection is accepted, its refresh is the first call (one round trip less).
                let probe = !self.restored;
                self.connect_attempts += 1;
                self.first_attempt_after
                    .get_or_insert_with(|| self.started.elapsed());
                let attempt =
                    tokio::time::timeout(remaining.clamp(ATTEMPT_MIN, ATTEMPT_MAX), async {
                        let client = AgentClient::connect(self.dir.agent_addr()).await?;
                        if probe {
                            client.info().await?;
                        }
                        Ok::<_, EdgeError>(client)
                    });
                if let Ok(Ok(agent)) = attempt.await {
                    let skew = if self.restored {
                        Some(self.refresh(&agent, self.started.elapsed()).await?)
                    } else {
                        self.name_booted_guest(&agent).await?;
                        None
                    };
                    return Ok((agent, self.started.elapsed(), skew));
                }
            }
            if Instant::now() > deadline {
                return Err(EdgeError::AgentNotReady {
                    id: self.dir.name(),
                    timeout,
                    detail: log_tail(&self.dir.serial_log(), "serial console"),
                });
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// A booted guest gets its hostname (and the host's clock) too: every VM boots as `dsec`.
    async fn name_booted_guest(&mut self, agent: &AgentClient) -> Result<()> {
        if self.hostname.is_none() && self.env.is_none() {
            return Ok(());
        }
        let identity = crate::GuestIdentity {
            hostname: self.hostname.clone(),
            env: self.env.clone(),
            ..Default::default()
        };
        match tokio::time::timeout(
            REFRESH_TIMEOUT,
            agent.refresh_identity(Vec::new(), identity),
        )
        .await
        {
            Ok(result) => {
                self.env_set = result?.env_set;
                Ok(())
            }
            Err(_) => Err(EdgeError::Protocol(format!(
                "guest {} did not take its hostname within {} s, so it was stopped",
                self.dir.name(),
                REFRESH_TIMEOUT.as_secs()
            ))),
        }
    }

    /// A restored guest has the snapshot's RNG state and a clock stopped at the snapshot:
    /// give it fresh host entropy, the host's time and its own MAC. Returns the clock skew
    /// that was corrected.
    async fn refresh(&mut self, agent: &AgentClient, answered_after: Duration) -> Result<Duration> {
        let started = Instant::now();
        let entropy = host_entropy(REFRESH_ENTROPY)
            .map_err(|e| EdgeError::io("read host entropy for a restored guest", e))?;
        let identity = crate::GuestIdentity {
            mac: self.mac.clone(),
            hostname: self.hostname.clone(),
            env: self.env.clone(),
            ..Default::default()
        };
        match tokio::time::timeout(REFRESH_TIMEOUT, agent.refresh_identity(entropy, identity)).await
        {
            Ok(result) => {
                let refreshed = result?;
                self.env_set = refreshed.env_set;
                let skew = refreshed.clock_skew;
                tracing::info!(
                    vm = %self.dir.name(),
                    clock_skew_ms = skew.as_millis() as u64,
                    hostname = self.hostname.as_deref().unwrap_or(""),
                    agent_ms = answered_after.as_millis() as u64,
                    connect_attempts = self.connect_attempts,
                    first_attempt_ms = self
                        .first_attempt_after
                        .map_or(0, |after| after.as_millis() as u64),
                    refresh_ms = started.elapsed().as_millis() as u64,
                    "restored guest refreshed (fresh entropy, host clock, identity)"
                );
                Ok(skew)
            }
            Err(_) => Err(EdgeError::Protocol(format!(
                "restored guest {} did not take fresh entropy within {} s, so it was stopped{}",
                self.dir.name(),
                REFRESH_TIMEOUT.as_secs(),
                log_tail(&self.dir.serial_log(), "serial console")
            ))),
        }
    }
}

/// One control request from async code (the client blocks, so it runs on the blocking pool).
pub async fn control_call<T: DeserializeOwned + Send + 'static>(
    client: ControlClient,
    request: Request,
) -> Result<T> {
    tokio::task::spawn_blocking(move || client.call(&request))
        .await
        .map_err(|e| EdgeError::Protocol(format!("VMM control task failed: {e}")))?
        .map_err(EdgeError::from)
}

/// `len` bytes from the host's /dev/urandom: what a restored guest's RNG is reseeded with.
pub(crate) fn host_entropy(len: usize) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut bytes = vec![0u8; len];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(bytes)
}

/// A random locally administered unicast MAC (`06:xx:xx:xx:xx:xx`) for a restored guest's
/// own network interface.
pub fn random_mac() -> Result<String> {
    let bytes = host_entropy(5).map_err(|e| EdgeError::io("read host entropy for a MAC", e))?;
    Ok(std::iter::once(0x06)
        .chain(bytes)
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":"))
}

#[cfg(test)]
mod tests;
