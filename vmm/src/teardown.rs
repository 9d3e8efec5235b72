//! Fast exit: the kernel's teardown of a KVM VM (vCPUs, irqchip, memory slots; several RCU
//! grace periods, ~12-16 ms on PVM hosts) and of guest memory runs in the last process that
//! holds them. A helper process that shares the VMM's memory and holds its own copies of the
//! KVM descriptors takes that work over: the VMM's exit (what a caller's `waitpid` sees) no
//! longer waits for it, whether the VMM returns, is stopped or is killed.

use std::io;
use std::os::fd::RawFd;

/// Stack of the helper: it only makes a handful of raw syscalls.
const HELPER_STACK: usize = 64 << 10;

/// What the helper reads; leaked, so it stays valid as long as the shared memory does.
struct HelperArgs {
    /// Descriptors to keep, sorted ascending (everything else is closed at once).
    keep: Vec<RawFd>,
    /// A pidfd of the VMM: readable once its whole thread group has exited and whoever
    /// waits for it has been told, not before (a descriptor-table close would come earlier,
    /// while KVM's own worker thread of the VMM may still be exiting).
    vmm: RawFd,
}

/// Starts the helper. `keep` names the KVM descriptors (VM and vCPUs) whose last close
/// destroys the VM; the helper closes every other descriptor right away (disk locks, taps
/// and sockets are released with the VMM, as before) and waits until the VMM has exited
/// and its parent has been told.
/// Call it once the VM's vCPUs exist and before the seccomp filter forbids `clone`.
pub fn defer_to_helper(keep: &[RawFd]) -> io::Result<()> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let vmm = unsafe { libc::syscall(libc::SYS_pidfd_open, libc::getpid(), 0) } as RawFd;
    if vmm < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut keep = keep.to_vec();
    keep.push(vmm);
    keep.sort_unstable();
    keep.dedup();
    let args = Box::into_raw(Box::new(HelperArgs { keep, vmm }));
    // SAFETY: an anonymous private mapping; failure is checked below.
    let stack = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            HELPER_STACK,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK,
            -1,
            0,
        )
    };
    if stack == libc::MAP_FAILED {
        let e = io::Error::last_os_error();
        // SAFETY: the pidfd is ours and not used elsewhere; `args` came from Box::into_raw
        // above and the helper was never started.
        unsafe {
            libc::close(vmm);
            drop(Box::from_raw(args));
        }
        return Err(e);
    }
    // SAFETY: the stack grows down from the end of the mapping we own (never unmapped); the
    // helper shares our memory (CLONE_VM) so `args` stays valid, and it only makes raw
    // syscalls (prctl, close_range, setpriority, poll, _exit), which is safe in a child of a
    // threaded process.
    // Without CLONE_FILES it gets its own copy of the descriptor table; exit signal 0 keeps
    // us from being told when it ends (it ends after us and is reaped by our reaper).
    let pid = unsafe {
        libc::clone(
            helper_main,
            (stack as *mut u8).add(HELPER_STACK) as *mut libc::c_void,
            libc::CLONE_VM,
            args as *mut libc::c_void,
        )
    };
    let started = if pid < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    };
    // SAFETY: our copy of the pidfd is not needed; the helper holds its own.
    unsafe { libc::close(vmm) };
    started
}

extern "C" fn helper_main(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the leaked HelperArgs passed by `defer_to_helper`, in shared memory.
    let args = unsafe { &*(arg as *const HelperArgs) };
    // Named apart from the VMM in process listings. SAFETY: PR_SET_NAME reads a NUL-terminated
    // string of at most 16 bytes, which this static is.
    unsafe { libc::prctl(libc::PR_SET_NAME, c"vmm-teardown".as_ptr()) };
    let mut from: libc::c_uint = 0;
    for &fd in &args.keep {
        let fd = fd as libc::c_uint;
        if fd > from {
            // SAFETY: closes descriptors in our own (copied) table only.
            unsafe { libc::syscall(libc::SYS_close_range, from, fd - 1, 0) };
        }
        from = fd + 1;
    }
    // SAFETY: as above.
    unsafe { libc::syscall(libc::SYS_close_range, from, libc::c_uint::MAX, 0) };
    // The teardown may wait its turn: whoever reaps the VMM (and the next VM it starts) runs
    // first on a busy host. Still a normal-class task, so memory is freed soon either way.
    // SAFETY: changes only this helper's own nice value.
    unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, 19) };
    let mut vmm_exited = libc::pollfd {
        fd: args.vmm,
        events: libc::POLLIN,
        revents: 0,
    };
    loop {
        // SAFETY: polls one pollfd that lives on this stack.
        let n = unsafe { libc::poll(&mut vmm_exited, 1, -1) };
        if n >= 0 || io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            break;
        }
    }
    // SAFETY: ends this helper process only; the kernel now frees guest memory and the VM.
    unsafe { libc::_exit(0) }
}
