//! The `dsec` binary's allocator: mimalloc for the control plane's servers (`dsec control up`,
//! `dsec control sim-nodes`), whose many small short-lived allocations per call cost less CPU
//! with it (perf/README.md, "cluster"); glibc malloc for everything else (the node daemon and
//! the short CLI commands keep what they were measured with). Chosen once, from the command
//! line, at the first allocation: every block is freed by the allocator that made it.
//! `DSEC_ALLOCATOR=system` keeps glibc malloc for the servers too.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU8, Ordering};

const UNDECIDED: u8 = 0;
const SYSTEM: u8 = 1;
const MIMALLOC: u8 = 2;

static CHOICE: AtomicU8 = AtomicU8::new(UNDECIDED);

pub struct ByCommand;

/// Whether `cmdline` (NUL-separated, as in /proc/self/cmdline) runs a control plane server:
/// `control` followed by `up` or `sim-nodes` as its next word that is not an option.
fn runs_control_server(cmdline: &[u8]) -> bool {
    let mut words = cmdline.split(|&b| b == 0).skip(1);
    if !words.any(|w| w == b"control") {
        return false;
    }
    matches!(
        words.find(|w| !w.starts_with(b"-")),
        Some(b"up") | Some(b"sim-nodes")
    )
}

/// Reads the command line without allocating (this runs inside the first allocation).
/// `DSEC_ALLOCATOR=system` keeps glibc malloc everywhere (to compare).
fn choose() -> u8 {
    // SAFETY: a NUL-terminated name; no thread runs yet that could change the environment.
    let forced = unsafe { libc::getenv(c"DSEC_ALLOCATOR".as_ptr()) };
    // SAFETY: getenv's answer, when not null, is a NUL-terminated string.
    if !forced.is_null() && unsafe { std::ffi::CStr::from_ptr(forced) }.to_bytes() == b"system" {
        return SYSTEM;
    }
    let mut buf = [0u8; 4096];
    // SAFETY: a NUL-terminated path literal; the descriptor is closed below.
    let fd = unsafe {
        libc::open(
            c"/proc/self/cmdline".as_ptr(),
            libc::O_RDONLY | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return SYSTEM;
    }
    let mut len = 0;
    while len < buf.len() {
        // SAFETY: reads into the unfilled tail of `buf`, within its bounds.
        let n = unsafe { libc::read(fd, buf[len..].as_mut_ptr().cast(), buf.len() - len) };
        if n <= 0 {
            break;
        }
        len += n as usize;
    }
    // SAFETY: `fd` was opened above and is closed once.
    unsafe { libc::close(fd) };
    if runs_control_server(&buf[..len]) {
        MIMALLOC
    } else {
        SYSTEM
    }
}

fn choice() -> u8 {
    match CHOICE.load(Ordering::Relaxed) {
        UNDECIDED => {
            // Threads racing here read the same command line and decide alike.
            let chosen = choose();
            CHOICE.store(chosen, Ordering::Relaxed);
            chosen
        }
        chosen => chosen,
    }
}

// SAFETY: every call goes to one allocator for the whole process (decided before the first
// block exists), which upholds GlobalAlloc's contract itself.
unsafe impl GlobalAlloc for ByCommand {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe {
            if choice() == MIMALLOC {
                mimalloc::MiMalloc.alloc(layout)
            } else {
                System.alloc(layout)
            }
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe {
            if choice() == MIMALLOC {
                mimalloc::MiMalloc.alloc_zeroed(layout)
            } else {
                System.alloc_zeroed(layout)
            }
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from the same allocator (the choice never changes).
        unsafe {
            if choice() == MIMALLOC {
                mimalloc::MiMalloc.dealloc(ptr, layout)
            } else {
                System.dealloc(ptr, layout)
            }
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` came from the same allocator (the choice never changes).
        unsafe {
            if choice() == MIMALLOC {
                mimalloc::MiMalloc.realloc(ptr, layout, new_size)
            } else {
                System.realloc(ptr, layout, new_size)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::runs_control_server;

    #[test]
    fn only_control_servers_get_mimalloc() {
        assert!(runs_control_server(b"dsec\0control\0up\0--etcd\0x\0"));
        assert!(runs_control_server(
            b"/bin/dsec\0--json\0control\0sim-nodes\0--count\x002\0"
        ));
        assert!(!runs_control_server(b"dsec\0up\0"));
        assert!(!runs_control_server(b"dsec\0control\0init\0"));
        assert!(!runs_control_server(b"dsec\0ls\0"));
        assert!(!runs_control_server(b""));
    }
}
