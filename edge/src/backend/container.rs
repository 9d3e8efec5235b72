//! The container backend: the agent as PID 1 of fresh mount/pid/uts/ipc/net namespaces,
//! in the sandbox's cgroups before it execs; it builds the rest itself (see guest-agent).

use std::ffi::CString;
use std::io::Write;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::sched::CloneFlags;
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

use super::host::{HostResources, Runtime};
use super::{new_sandbox_id, BackendKind, EdgeConfig, Sandbox, SandboxSpec};
use crate::cgroup_join::{join_in_child, CgroupJoin};
use crate::client::{AgentAddr, AgentClient};
use crate::error::{EdgeError, Result};
use crate::paths::{find_binary, log_tail};

fn cstring(s: impl AsRef<std::ffi::OsStr>) -> Result<CString> {
    CString::new(s.as_ref().as_bytes())
        .map_err(|_| EdgeError::InvalidSpec(format!("{:?} contains a NUL byte", s.as_ref())))
}

pub(super) async fn create(config: &EdgeConfig, spec: &SandboxSpec) -> Result<Sandbox> {
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
    let mut host = HostResources::create(config, &id)?;
    let dir = host.dir.clone();
    let socket = dir.join("agent.sock");
    // A namespace with its veth made ahead (net/pool.rs), if one is ready.
    let pooled = config.network.as_ref().and_then(|n| n.take_netns());
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
                resolv_conf: config
                    .network
                    .as_ref()
                    .map(|n| format!("nameserver {}\n", n.gateway))
                    .unwrap_or_default(),
                netns: pooled.as_ref().map(|p| p.netns().as_raw_fd()),
            })
        });
    let agent_pid = started?;
    host.runtime = Runtime::Container { agent_pid };
    // The network is set up while the agent starts; both must be done before the sandbox
    // is handed out, and a failed create waits for it so that release finds all of it.
    let attach = config.network.clone().map(|network| {
        let (dir, policy) = (dir.clone(), spec.network_policy.clone());
        tokio::task::spawn_blocking(move || {
            let started = Instant::now();
            let result = match pooled {
                Some(pooled) => network.attach_pooled(&dir, pooled, &policy),
                None => network.attach(&dir, agent_pid.as_raw(), &policy),
            };
            (result, started.elapsed())
        })
    });
    let ready = wait_ready(&mut host, &id, agent_pid, &socket, &log_path, spec).await;
    if let Some(attach) = attach {
        let agent_ready = Instant::now();
        let (attached, setup) = attach
            .await
            .map_err(|e| EdgeError::Protocol(format!("network setup task failed: {e}")))?;
        // What the network cost this create: the setup itself, and how much of it was
        // still running when the agent answered (the latency it added).
        tracing::debug!(
            setup_us = setup.as_micros() as u64,
            added_us = agent_ready.elapsed().as_micros() as u64,
            "network attached"
        );
        attached?;
    }
    Ok(Sandbox {
        id,
        kind,
        client: ready?,
        host,
        env_in_guest: false,
    })
}

/// Waits until the agent answers on its socket, or dies, or the spec's timeout passes.
async fn wait_ready(
    host: &mut HostResources,
    id: &str,
    agent_pid: Pid,
    socket: &Path,
    log_path: &Path,
    spec: &SandboxSpec,
) -> Result<AgentClient> {
    let deadline = Instant::now() + spec.ready_timeout;
    loop {
        if let Ok(Some(status)) = try_reap(agent_pid) {
            host.runtime = Runtime::Gone;
            return Err(EdgeError::SandboxDied {
                id: id.to_string(),
                detail: format!(" ({status:?}){}", log_tail(log_path, "agent log")),
            });
        }
        if socket.exists() {
            // Bound the whole attempt (connect, HTTP/2 handshake, Info): retry, never hang.
            let attempt = tokio::time::timeout(Duration::from_secs(5), async {
                let client = AgentClient::connect(AgentAddr::Unix(socket.to_path_buf())).await?;
                client.info().await.map(|_| client)
            });
            if let Ok(Ok(client)) = attempt.await {
                return Ok(client);
            }
        }
        if Instant::now() > deadline {
            return Err(EdgeError::AgentNotReady {
                id: id.to_string(),
                timeout: spec.ready_timeout,
                detail: log_tail(log_path, "agent log"),
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
    /// The sandbox's /etc/resolv.conf; empty: the image's.
    resolv_conf: String,
    /// A network namespace for the agent to join; None: a new one of its own.
    netns: Option<RawFd>,
}

/// Starts the agent as PID 1 of fresh mount/pid/uts/ipc/net namespaces (or the pooled
/// network namespace `netns` names), already in the sandbox's cgroups. It gets two
/// descriptors: the listening socket (bound here, in the host's network namespace) and a
/// pipe holding its `ContainerLaunch`; its command line names no host path. The agent builds the root and the user namespace itself.
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
        resolv_conf: start.resolv_conf.clone(),
    }
    .encode_to_vec();
    let (launch_r, launch_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
        .map_err(|e| EdgeError::io("pipe for the container launch", e.into()))?;
    // A few hundred bytes: far below the pipe's buffer, so this never blocks.
    std::fs::File::from(launch_w)
        .write_all(&launch)
        .map_err(|e| EdgeError::io("write the container launch", e))?;
    let cgroups = CgroupJoin::open(start.cgroup_procs)?;
    let cgroup_fds = cgroups.fds();
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
    let netns = start.netns;
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
            if let Some(netns) = netns {
                if libc::setns(netns, libc::CLONE_NEWNET) != 0 {
                    let msg = b"dsec-edge: the agent could not join its network namespace\n";
                    libc::write(log_fd, msg.as_ptr().cast(), msg.len());
                    libc::_exit(126);
                }
            }
            // Into the sandbox's cgroups before anything runs ("0" = the writer): the
            // agent's cgroup namespace is rooted there.
            if !join_in_child(&cgroup_fds) {
                let msg = b"dsec-edge: the agent could not join its cgroups\n";
                libc::write(log_fd, msg.as_ptr().cast(), msg.len());
                libc::_exit(126);
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
    let mut flags = CloneFlags::CLONE_NEWNS
        | CloneFlags::CLONE_NEWPID
        | CloneFlags::CLONE_NEWUTS
        | CloneFlags::CLONE_NEWIPC
        | CloneFlags::CLONE_VM
        | CloneFlags::CLONE_VFORK;
    if start.netns.is_none() {
        flags |= CloneFlags::CLONE_NEWNET;
    }
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
    drop((listener, launch_r, cgroups));
    Ok(pid)
}
