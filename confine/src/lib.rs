//! The seccomp deny list every workload the node runs shares (container commands in the
//! guest agent, FnCall calls): the kernel interfaces a sandboxed workload never needs and that
//! are the usual ways out of a container (new user namespaces, mounts, module loading, kexec,
//! the kernel log, file handles, io_uring, ...). Refused calls fail with EPERM (ENOSYS for
//! clone3, so libc falls back to clone, whose flags the filter can inspect).

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

#[derive(Debug, thiserror::Error)]
#[error(
    "build the sandbox seccomp filter: {0} (the deny list in dsec-confine is inconsistent; fix it)"
)]
pub struct FilterError(String);

/// System calls a container's commands may never make.
pub const DENIED_SYSCALLS: &[libc::c_long] = &[
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

fn filter_err(err: impl std::fmt::Display) -> FilterError {
    FilterError(err.to_string())
}

/// The filters, in install order: everything allowed except [`DENIED_SYSCALLS`], new user
/// namespaces through clone/unshare, and clone3 (whose flags live in memory a filter cannot
/// read).
pub fn sandbox_filters() -> Result<Vec<BpfProgram>, FilterError> {
    let eperm = SeccompAction::Errno(libc::EPERM as u32);
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> =
        DENIED_SYSCALLS.iter().map(|&nr| (nr, Vec::new())).collect();
    let new_userns = || -> Result<Vec<SeccompRule>, FilterError> {
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

#[cfg(test)]
mod tests {
    #[test]
    fn the_filters_build() {
        let filters = super::sandbox_filters().unwrap();
        assert_eq!(filters.len(), 2);
        assert!(filters.iter().all(|f| !f.is_empty()));
    }
}
