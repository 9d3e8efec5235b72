//! What a container's commands may do: a reduced capability bounding set and a seccomp
//! filter that refuses the kernel interfaces a sandboxed workload never needs and that are
//! the usual ways out of a container (new user namespaces, mounts, module loading, kexec,
//! the kernel log, file handles, io_uring, ...). Refused calls fail with EPERM (ENOSYS for
//! clone3, so libc falls back to clone, whose flags the filter can inspect).
//!
//! Both are applied between fork and exec of every command and session shell; the agent
//! itself keeps its privileges (it set up the container and serves files as root).

use std::collections::BTreeMap;
use std::io;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

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

/// System calls a container's commands may never make.
const DENIED_SYSCALLS: &[libc::c_long] = &[
    // Mounts, old and new API, and root switching.
    libc::SYS_mount,
    libc::SYS_umount2,
    libc::SYS_pivot_root,
    libc::SYS_fsopen,
    libc::SYS_fsconfig,
    libc::SYS_fsmount,
    libc::SYS_fspick,
    libc::SYS_open_tree,
    libc::SYS_move_mount,
    libc::SYS_mount_setattr,
    // Joining other namespaces.
    libc::SYS_setns,
    // The kernel itself: modules, kexec, reboot, swap, clock, accounting, quotas, log.
    libc::SYS_init_module,
    libc::SYS_finit_module,
    libc::SYS_delete_module,
    libc::SYS_kexec_load,
    libc::SYS_kexec_file_load,
    libc::SYS_reboot,
    libc::SYS_swapon,
    libc::SYS_swapoff,
    libc::SYS_settimeofday,
    libc::SYS_clock_settime,
    libc::SYS_clock_adjtime,
    libc::SYS_adjtimex,
    libc::SYS_acct,
    libc::SYS_quotactl,
    libc::SYS_syslog,
    libc::SYS_vhangup,
    libc::SYS_iopl,
    libc::SYS_ioperm,
    libc::SYS_lookup_dcookie,
    // Interfaces with a long record of kernel exploits and no use in a sandbox.
    libc::SYS_bpf,
    libc::SYS_perf_event_open,
    libc::SYS_userfaultfd,
    libc::SYS_keyctl,
    libc::SYS_add_key,
    libc::SYS_request_key,
    libc::SYS_open_by_handle_at,
    libc::SYS_name_to_handle_at,
    libc::SYS_io_uring_setup,
    libc::SYS_io_uring_enter,
    libc::SYS_io_uring_register,
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
            filters: container_filters()?,
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

fn filter_err(err: impl std::fmt::Display) -> AgentError {
    AgentError::Setup(format!("build the container seccomp filter: {err}"))
}

/// The container filters: everything allowed except [`DENIED_SYSCALLS`], new user
/// namespaces through clone/unshare, and clone3 (whose flags live in memory a filter cannot
/// read).
fn container_filters() -> Result<Vec<BpfProgram>, AgentError> {
    let eperm = SeccompAction::Errno(libc::EPERM as u32);
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> =
        DENIED_SYSCALLS.iter().map(|&nr| (nr, Vec::new())).collect();
    let new_userns = || -> Result<Vec<SeccompRule>, AgentError> {
        let flag = libc::CLONE_NEWUSER as u64;
        let cond = SeccompCondition::new(
            0,
            SeccompCmpArgLen::Qword,
            SeccompCmpOp::MaskedEq(flag),
            flag,
        )
        .map_err(filter_err)?;
        Ok(vec![SeccompRule::new(vec![cond]).map_err(filter_err)?])
    };
    rules.insert(libc::SYS_clone, new_userns()?);
    rules.insert(libc::SYS_unshare, new_userns()?);
    let main = SeccompFilter::new(rules, SeccompAction::Allow, eperm, TargetArch::x86_64)
        .map_err(filter_err)?;
    // clone3 needs a different answer (ENOSYS), hence a second filter: the kernel runs
    // every installed filter and the strictest answer wins, so the two compose.
    let clone3 = SeccompFilter::new(
        BTreeMap::from([(libc::SYS_clone3, Vec::new())]),
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        TargetArch::x86_64,
    )
    .map_err(filter_err)?;
    Ok(vec![
        main.try_into().map_err(filter_err)?,
        clone3.try_into().map_err(filter_err)?,
    ])
}
