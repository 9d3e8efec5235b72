//! Per-thread seccomp allowlists (seccompiler). Each thread installs the filter of its kind as
//! it starts: the VMM's own threads (main, control, signals, userfaultfd) get the broadest list,
//! vCPU threads a narrower one and device threads the narrowest. Filters stack and are
//! inherited, so a device thread started from a vCPU thread (device activation happens on an
//! MMIO write) ends up with both: the vCPU list therefore includes what device threads need.
//!
//! A call outside the list raises SIGSYS; the handler reports the syscall number and ends the
//! process with [`FORBIDDEN_SYSCALL_EXIT`]. Filters are only installed once [`enable`] has been
//! called (the `dsec-vmm` binary does; library users such as in-process tests do not).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use seccompiler::{BpfProgram, SeccompAction, SeccompFilter, TargetArch};

/// Exit status of a VMM stopped for a forbidden system call.
pub const FORBIDDEN_SYSCALL_EXIT: i32 = 159;

static ENABLED: AtomicBool = AtomicBool::new(false);
/// The uid/gid a jailed VMM drops to. glibc changes credentials on every thread (a signal
/// makes each thread repeat the call), so filtered threads must allow exactly this change.
static JAIL_IDS: OnceLock<(u32, u32)> = OnceLock::new();

/// Lets every filter installed from now on allow switching to `uid`/`gid` (and nothing else).
pub fn allow_privilege_drop_to(uid: u32, gid: u32) {
    let _ = JAIL_IDS.set((uid, gid));
}

/// Which allowlist a thread runs under.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ThreadKind {
    /// Main, control, signal and userfaultfd threads: setup, snapshots, the control socket.
    Vmm,
    /// vCPU threads: KVM_RUN, port/MMIO emulation, device activation.
    Vcpu,
    /// virtio device workers: queues, taps, sockets, disk files.
    Device,
}

#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("cannot build the {kind:?} seccomp filter: {message}")]
    Build { kind: ThreadKind, message: String },
    #[error("cannot install the {kind:?} seccomp filter: {message}; run without --seccomp or on a kernel with seccomp")]
    Install { kind: ThreadKind, message: String },
    #[error("cannot install the SIGSYS handler: {0}")]
    Handler(std::io::Error),
}

/// What every thread does: memory, locks, signals, thread exit, plain fd I/O.
const COMMON: &[libc::c_long] = &[
    libc::SYS_read,
    libc::SYS_write,
    libc::SYS_readv,
    libc::SYS_writev,
    libc::SYS_close,
    libc::SYS_futex,
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_mprotect,
    // Also how the balloon drops guest pages (MADV_DONTNEED) on its device thread.
    libc::SYS_madvise,
    libc::SYS_mremap,
    libc::SYS_brk,
    libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigreturn,
    libc::SYS_sigaltstack,
    libc::SYS_rseq,
    libc::SYS_set_robust_list,
    libc::SYS_gettid,
    libc::SYS_getpid,
    libc::SYS_sched_getaffinity,
    libc::SYS_sched_yield,
    libc::SYS_exit,
    libc::SYS_exit_group,
    libc::SYS_clock_gettime,
    libc::SYS_clock_nanosleep,
    libc::SYS_nanosleep,
    libc::SYS_getrandom,
    libc::SYS_prctl,
    libc::SYS_fcntl,
    libc::SYS_epoll_create1,
    libc::SYS_epoll_ctl,
    libc::SYS_epoll_wait,
    libc::SYS_epoll_pwait,
    libc::SYS_eventfd2,
    libc::SYS_poll,
    libc::SYS_ppoll,
    libc::SYS_ioctl,
    // A panic aborts through tgkill; the abort must not turn into a SIGSYS.
    libc::SYS_tgkill,
    // Threads started by a filtered thread add their own (narrower) filter.
    libc::SYS_seccomp,
    libc::SYS_lseek,
    libc::SYS_statx,
    libc::SYS_newfstatat,
    libc::SYS_fstat,
];

/// Device workers: disk files, taps, the vsock Unix sockets.
const DEVICE: &[libc::c_long] = &[
    libc::SYS_pread64,
    libc::SYS_pwrite64,
    libc::SYS_preadv,
    libc::SYS_pwritev,
    libc::SYS_fsync,
    libc::SYS_fdatasync,
    libc::SYS_fallocate,
    libc::SYS_socket,
    libc::SYS_connect,
    libc::SYS_accept4,
    libc::SYS_recvfrom,
    libc::SYS_sendto,
    libc::SYS_recvmsg,
    libc::SYS_sendmsg,
    libc::SYS_shutdown,
    libc::SYS_openat,
];

/// vCPU threads additionally start device workers (activation runs on the vCPU thread).
const VCPU: &[libc::c_long] = &[libc::SYS_clone, libc::SYS_clone3];

/// The VMM's own threads: snapshots (files, directories, renames), the control socket,
/// userfaultfd, signal waiting.
const VMM: &[libc::c_long] = &[
    libc::SYS_bind,
    libc::SYS_listen,
    libc::SYS_mkdir,
    libc::SYS_mkdirat,
    libc::SYS_rename,
    libc::SYS_renameat,
    libc::SYS_renameat2,
    libc::SYS_unlink,
    libc::SYS_unlinkat,
    libc::SYS_rmdir,
    libc::SYS_getdents64,
    libc::SYS_readlink,
    libc::SYS_readlinkat,
    libc::SYS_ftruncate,
    libc::SYS_copy_file_range,
    libc::SYS_sendfile,
    libc::SYS_rt_sigtimedwait,
    libc::SYS_rt_sigaction,
    libc::SYS_userfaultfd,
    libc::SYS_access,
    libc::SYS_faccessat,
    libc::SYS_faccessat2,
    libc::SYS_flock,
    libc::SYS_prlimit64,
    libc::SYS_getcwd,
    libc::SYS_getuid,
    libc::SYS_geteuid,
    libc::SYS_getgid,
    libc::SYS_getegid,
    libc::SYS_getsockopt,
    libc::SYS_setsockopt,
    libc::SYS_getsockname,
    libc::SYS_munlock,
    libc::SYS_mlock,
    libc::SYS_fchmod,
    libc::SYS_sync_file_range,
    // Reaping the forked child that writes a snapshot's memory (`cow_writer`).
    libc::SYS_wait4,
];

/// The syscalls a thread of `kind` may make.
pub fn allowed(kind: ThreadKind) -> Vec<libc::c_long> {
    let mut list: Vec<libc::c_long> = COMMON.iter().chain(DEVICE).copied().collect();
    if matches!(kind, ThreadKind::Vcpu | ThreadKind::Vmm) {
        list.extend_from_slice(VCPU);
    }
    if kind == ThreadKind::Vmm {
        list.extend_from_slice(VMM);
    }
    list.sort_unstable();
    list.dedup();
    list
}

/// Compiles the allowlist of `kind` into BPF.
pub fn program(kind: ThreadKind) -> Result<BpfProgram, SeccompError> {
    let build = |message: String| SeccompError::Build { kind, message };
    let mut rules: BTreeMap<i64, Vec<seccompiler::SeccompRule>> = allowed(kind)
        .into_iter()
        .map(|nr| (nr, Vec::new()))
        .collect();
    if let Some(&(uid, gid)) = JAIL_IDS.get() {
        use seccompiler::{SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompRule};
        let all_args_are = |value: u32| -> Result<SeccompRule, seccompiler::BackendError> {
            let conditions = (0..3)
                .map(|arg| {
                    SeccompCondition::new(
                        arg,
                        SeccompCmpArgLen::Dword,
                        SeccompCmpOp::Eq,
                        value.into(),
                    )
                })
                .collect::<Result<Vec<_>, _>>()?;
            SeccompRule::new(conditions)
        };
        let no_groups = SeccompCondition::new(0, SeccompCmpArgLen::Qword, SeccompCmpOp::Eq, 0)
            .and_then(|c| SeccompRule::new(vec![c]))
            .map_err(|e| build(e.to_string()))?;
        let id_rule = |id| all_args_are(id).map_err(|e| build(e.to_string()));
        rules.insert(libc::SYS_setresuid, vec![id_rule(uid)?]);
        rules.insert(libc::SYS_setresgid, vec![id_rule(gid)?]);
        rules.insert(libc::SYS_setgroups, vec![no_groups]);
    }
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Trap,
        SeccompAction::Allow,
        TargetArch::x86_64,
    )
    .map_err(|e| build(e.to_string()))?;
    filter
        .try_into()
        .map_err(|e: seccompiler::BackendError| build(e.to_string()))
}

/// Turns filtering on for this process and installs the SIGSYS reporter.
pub fn enable() -> Result<(), SeccompError> {
    // SAFETY: sigaction with a zeroed struct, an empty mask and a handler that only calls
    // async-signal-safe functions (write, _exit).
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_sigsys as *const () as usize;
        action.sa_flags = libc::SA_SIGINFO;
        libc::sigemptyset(&mut action.sa_mask);
        if libc::sigaction(libc::SIGSYS, &action, std::ptr::null_mut()) != 0 {
            return Err(SeccompError::Handler(std::io::Error::last_os_error()));
        }
    }
    ENABLED.store(true, Ordering::SeqCst);
    Ok(())
}

pub fn is_enabled() -> bool {
    ENABLED.load(Ordering::SeqCst)
}

/// Installs the filter of `kind` on the calling thread (a no-op unless [`enable`]d).
/// Compiled once per kind and process: vCPU and device threads start on the restore path,
/// before the first KVM_RUN. (The jail's uid/gid are fixed before any thread starts.)
static PROGRAMS: [OnceLock<BpfProgram>; 3] = [OnceLock::new(), OnceLock::new(), OnceLock::new()];

fn compiled(kind: ThreadKind) -> Result<&'static BpfProgram, SeccompError> {
    let slot = &PROGRAMS[kind as usize];
    match slot.get() {
        Some(p) => Ok(p),
        None => {
            let compiled = program(kind)?;
            Ok(slot.get_or_init(|| compiled))
        }
    }
}

/// Compiles every kind's filter now (a prewarmed VMM, before its restore starts the vCPU and
/// device threads that install them). Only once the jail's ids are known: the filters allow
/// exactly that privilege drop.
pub fn precompile() -> Result<(), SeccompError> {
    if !is_enabled() {
        return Ok(());
    }
    for kind in [ThreadKind::Vmm, ThreadKind::Vcpu, ThreadKind::Device] {
        compiled(kind)?;
    }
    Ok(())
}

pub fn install(kind: ThreadKind) -> Result<(), SeccompError> {
    if !is_enabled() {
        return Ok(());
    }
    let program = compiled(kind)?;
    seccompiler::apply_filter(program).map_err(|e| SeccompError::Install {
        kind,
        message: e.to_string(),
    })
}

/// Installs the filter of `kind` on a thread that cannot return an error to anyone: a thread
/// that fails to lock itself down must not run unfiltered.
pub fn install_or_exit(kind: ThreadKind) {
    if let Err(e) = install(kind) {
        eprintln!("dsec-vmm: {e}");
        std::process::exit(1);
    }
}

extern "C" fn on_sigsys(_: libc::c_int, info: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // x86-64 `siginfo_t` for SIGSYS: si_call_addr at 16, si_syscall (int) at 24.
    // SAFETY: the kernel passes a valid siginfo for SA_SIGINFO handlers; offset 24 lies within
    // its 128 bytes.
    let nr = unsafe { info.cast::<u8>().add(24).cast::<i32>().read_unaligned() };
    let mut digits = [0u8; 10];
    let mut at = digits.len();
    let mut n = nr.unsigned_abs();
    loop {
        at -= 1;
        digits[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 || at == 0 {
            break;
        }
    }
    let parts: [&[u8]; 3] = [
        b"dsec-vmm: seccomp: forbidden system call ",
        &digits[at..],
        b"; the VMM stops\n",
    ];
    // SAFETY: write(2) and _exit(2) are async-signal-safe; the buffers outlive the calls.
    unsafe {
        for part in parts {
            libc::write(2, part.as_ptr().cast(), part.len());
        }
        libc::_exit(FORBIDDEN_SYSCALL_EXIT);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_nest_and_compile() {
        let vmm = allowed(ThreadKind::Vmm);
        let vcpu = allowed(ThreadKind::Vcpu);
        let device = allowed(ThreadKind::Device);
        // Stacked filters intersect: each narrower list must fit in the wider one.
        assert!(device.iter().all(|s| vcpu.contains(s)));
        assert!(vcpu.iter().all(|s| vmm.contains(s)));
        for forbidden in [
            libc::SYS_execve,
            libc::SYS_ptrace,
            libc::SYS_mount,
            libc::SYS_setuid,
        ] {
            assert!(!vmm.contains(&forbidden), "{forbidden} allowed");
        }
        assert!(!device.contains(&libc::SYS_clone3));
        for kind in [ThreadKind::Vmm, ThreadKind::Vcpu, ThreadKind::Device] {
            assert!(!program(kind).unwrap().is_empty());
        }
    }
}
