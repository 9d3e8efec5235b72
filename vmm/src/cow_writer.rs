//! Writing a snapshot's memory while the guest runs again: a forked child of the VMM holds a
//! copy-on-write view of guest memory as it was at the fork, and writes it out; the parent
//! resumes the vCPUs at once and waits for the child. The guest's pause therefore covers only
//! the vCPU and device state, not the memory.
//!
//! The VMM is multi-threaded, so the child may only make raw system calls: it runs a
//! [`MemoryWriter`] prepared before the fork (no allocation, only `pwrite64`), stores its
//! result in a shared page and `_exit`s. Both fit in the VMM thread's seccomp list (`clone`
//! to fork, `pwrite64`, `prctl`; the parent's `wait4`).

use std::io;

use crate::memory::MemoryWriter;

/// Why the child could not be started or did not write the memory.
#[derive(Debug, thiserror::Error)]
pub enum CowWriteError {
    #[error("cannot map the result page for the memory writer: {0}; the host is out of memory")]
    ResultPage(io::Error),
    #[error("cannot fork the memory writer: {0}; the host is out of memory or processes")]
    Fork(io::Error),
    #[error("cannot wait for the memory writer: {0}")]
    Wait(io::Error),
    #[error(
        "the memory writer ended without finishing (wait status {0:#x}); take the snapshot again"
    )]
    Died(i32),
    #[error("cannot write guest memory to the snapshot: {0}; free disk space and take the snapshot again")]
    Write(io::Error),
}

/// What the child reports through the shared page.
#[repr(C)]
struct Outcome {
    /// 1 once the child is done (then `pages` or `errno` is valid).
    done: u64,
    pages: u64,
    errno: i64,
}

/// A running memory writer (the forked child).
pub struct CowWrite {
    pid: libc::pid_t,
    reaped: bool,
    outcome: *mut Outcome,
    // Kept alive (and its memory mapped) until the child has ended.
    _writer: MemoryWriter,
}

// SAFETY: `outcome` is a shared mapping owned by this value; only `wait` reads it.
unsafe impl Send for CowWrite {}

const OUTCOME_LEN: usize = 4096;

/// Forks the child that writes `writer`'s pages. Call it while the VM is paused: the child's
/// view of guest memory is frozen at this instant. On failure the writer comes back, to be
/// run in place.
pub fn start(writer: MemoryWriter) -> Result<CowWrite, (CowWriteError, MemoryWriter)> {
    // SAFETY: a fresh anonymous shared mapping; failure is checked below.
    let page = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            OUTCOME_LEN,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if page == libc::MAP_FAILED {
        return Err((
            CowWriteError::ResultPage(io::Error::last_os_error()),
            writer,
        ));
    }
    let outcome = page.cast::<Outcome>();
    // SAFETY: fork duplicates this process with only the calling thread. The child below
    // touches nothing another thread could have left locked: it reads the writer prepared
    // before the fork, makes raw system calls and ends with _exit.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        let e = io::Error::last_os_error();
        // SAFETY: our own mapping, unused by anyone else.
        unsafe { libc::munmap(page, OUTCOME_LEN) };
        return Err((CowWriteError::Fork(e), writer));
    }
    if pid == 0 {
        child(&writer, outcome);
    }
    Ok(CowWrite {
        pid,
        reaped: false,
        outcome,
        _writer: writer,
    })
}

fn child(writer: &MemoryWriter, outcome: *mut Outcome) -> ! {
    // The writer must not outlive the VMM (its snapshot would be abandoned anyway).
    // SAFETY: plain prctl with integer arguments.
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong);
    }
    let result = writer.write();
    // SAFETY: `outcome` is the shared page mapped before the fork; the parent reads it only
    // after this process has ended.
    unsafe {
        match result {
            Ok(pages) => (*outcome).pages = pages,
            Err(errno) => (*outcome).errno = errno.into(),
        }
        (*outcome).done = 1;
        libc::_exit(if result.is_ok() { 0 } else { 1 })
    }
}

impl CowWrite {
    /// Waits until the child has written everything; returns the pages written.
    pub fn wait(mut self) -> Result<u64, CowWriteError> {
        let status = self.reap().map_err(CowWriteError::Wait)?;
        // SAFETY: the child has ended, so nothing writes the shared page any more.
        let outcome = unsafe { std::ptr::read(self.outcome) };
        if outcome.done != 1 || !libc::WIFEXITED(status) {
            return Err(CowWriteError::Died(status));
        }
        if libc::WEXITSTATUS(status) != 0 {
            return Err(CowWriteError::Write(io::Error::from_raw_os_error(
                outcome.errno as i32,
            )));
        }
        Ok(outcome.pages)
    }
}

impl CowWrite {
    /// Waits for the child to end; returns its wait status.
    fn reap(&mut self) -> io::Result<i32> {
        let mut status = 0;
        loop {
            // SAFETY: waits for our own child with a valid status pointer.
            let r = unsafe { libc::waitpid(self.pid, &mut status, 0) };
            if r == self.pid {
                self.reaped = true;
                return Ok(status);
            }
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EINTR) {
                self.reaped = true;
                return Err(e);
            }
        }
    }
}

impl Drop for CowWrite {
    fn drop(&mut self) {
        if !self.reaped {
            // Never leave a zombie (or a writer into a directory about to be removed).
            let _ = self.reap();
        }
        // SAFETY: the page is ours; the child (if still running) has its own copy of the
        // mapping, so unmapping ours cannot fault it.
        unsafe { libc::munmap(self.outcome.cast(), OUTCOME_LEN) };
    }
}
