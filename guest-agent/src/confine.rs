//! What a container's commands may do: a reduced capability bounding set and a seccomp
//! filter that refuses the kernel interfaces a sandboxed workload never needs and that are
//! the usual ways out of a container (new user namespaces, mounts, module loading, kexec,
//! the kernel log, file handles, io_uring, ...). Refused calls fail with EPERM (ENOSYS for
//! clone3, so libc falls back to clone, whose flags the filter can inspect).
//!
//! Both are applied between fork and exec of every command and session shell; the agent
//! itself keeps its privileges (it set up the container and serves files as root).

use std::io;

use seccompiler::BpfProgram;

use crate::AgentError;

/// Capabilities commands keep in a container (Docker's default set without MKNOD): enough
/// for ordinary root work, not for mounting, loading modules, raw I/O or ptrace of the agent.
const CONTAINER_CAPS: &[u32] = &[
    0,  // CHOWN
    1,  // DAC_OVERRIDE
    3,  // FOWNER
    4,  // FSETID
    5,  // KILL
    6,  // SETGID
    7,  // SETUID
    8,  // SETPCAP
    10, // NET_BIND_SERVICE
    13, // NET_RAW
    18, // SYS_CHROOT
    29, // AUDIT_WRITE
    31, // SETFCAP
];

/// Restrictions applied to each command before exec.
#[derive(Debug, Default)]
pub struct Confinement {
    /// Removed from the bounding set: root keeps only these after exec.
    dropped_caps: Vec<u32>,
    /// Installed with SECCOMP_SET_MODE_FILTER, in order; empty outside containers.
    filters: Vec<BpfProgram>,
    /// Container commands also get no_new_privs.
    container: bool,
}

impl Confinement {
    /// No restrictions: a microVM's guest is the sandbox boundary there.
    pub fn none() -> Self {
        Self::default()
    }

    /// The container set: reduced capabilities and the seccomp deny list.
    pub fn container() -> Result<Self, AgentError> {
        let last_cap = std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
            .ok()
            .and_then(|s| s.trim().parse::<u32>().ok())
            .unwrap_or(40);
        let dropped_caps = (0..=last_cap)
            .filter(|c| !CONTAINER_CAPS.contains(c))
            .collect();
        Ok(Self {
            dropped_caps,
            filters: dsec_confine::sandbox_filters()
                .map_err(|e| AgentError::Setup(e.to_string()))?,
            container: true,
        })
    }

    /// Applies the restrictions to the calling process. Runs between fork and exec: only
    /// raw system calls, no allocation.
    pub fn apply(&self) -> io::Result<()> {
        if self.container {
            // SAFETY: PR_SET_NO_NEW_PRIVS takes integers and touches no memory.
            if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
                return Err(io::Error::last_os_error());
            }
        }
        for filter in &self.filters {
            let prog = libc::sock_fprog {
                len: filter.len() as u16,
                filter: filter.as_ptr() as *mut libc::sock_filter,
            };
            // SAFETY: `prog` points at a BPF program that lives as long as `self` (the
            // caller's copy, made before fork); the kernel copies it during the call.
            let rc = unsafe {
                libc::syscall(
                    libc::SYS_seccomp,
                    libc::SECCOMP_SET_MODE_FILTER,
                    0,
                    &prog as *const libc::sock_fprog,
                )
            };
            if rc != 0 {
                return Err(io::Error::last_os_error());
            }
        }
        for &cap in &self.dropped_caps {
            // SAFETY: PR_CAPBSET_DROP takes a capability number and touches no memory.
            if unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) } != 0 {
                return Err(io::Error::last_os_error());
            }
        }
        Ok(())
    }
}

impl Confinement {
    /// Runs once a confined command has exec'd: makes it (and what it starts later) the OOM
    /// killer's first choice over the agent (oom_score_adj 1000), so an out-of-memory
    /// sandbox loses the offending process, not its agent. Needed where the agent cannot
    /// lower its own score (no CAP_SYS_RESOURCE); done after exec because before it the
    /// child is as undumpable as the agent and its /proc entries are not ours to write.
    /// A command can lower itself back to the agent's 0 at most. Best effort: the command
    /// may already be gone.
    pub fn after_spawn(&self, pid: nix::unistd::Pid) {
        if self.container {
            let _ = std::fs::write(format!("/proc/{pid}/oom_score_adj"), "1000");
        }
    }
}
