//! The container's user namespace: host ids [base, base + count) become 0.. inside, so
//! sandbox root is an unprivileged host uid.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use nix::fcntl::OFlag;
use nix::sched::CloneFlags;
use nix::unistd::{ForkResult, Gid, Uid};

use crate::AgentError;

fn setup_err(what: impl std::fmt::Display, err: impl std::fmt::Display) -> AgentError {
    AgentError::Setup(format!("{what}: {err}"))
}

/// A user namespace mapping host ids [base, base + count) to [0, count).
#[derive(Debug)]
pub struct UserNamespace {
    fd: OwnedFd,
}

impl UserNamespace {
    /// Creates the namespace through a short-lived child (a process cannot write an id map
    /// of more than its own id into its own namespace; we, still host root, write the
    /// child's). Forks: call while single-threaded.
    pub fn create(base: u32, count: u32) -> Result<Self, AgentError> {
        if count == 0 || base == 0 || base.checked_add(count).is_none() {
            return Err(AgentError::Setup(format!(
                "invalid id range {base}+{count}: sandbox root must map to a non-zero host id"
            )));
        }
        let (ready_r, ready_w) =
            nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(|e| setup_err("pipe", e))?;
        let (go_r, go_w) =
            nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(|e| setup_err("pipe", e))?;
        // SAFETY: the agent is single-threaded here (before tokio starts); the child only
        // makes raw system calls and _exits.
        match unsafe { nix::unistd::fork() }.map_err(|e| setup_err("fork", e))? {
            ForkResult::Child => {
                // SAFETY: raw system calls on descriptors this process owns, then _exit.
                unsafe {
                    // Our copy of the write end would keep the pipe from ever reaching EOF.
                    libc::close(go_w.as_raw_fd());
                    // Our pid as the parent's /proc (the host's procfs, not yet ours)
                    // names it; nothing written means unshare failed.
                    if libc::unshare(libc::CLONE_NEWUSER) == 0 {
                        let mut name = [0u8; 32];
                        let n = libc::readlink(
                            c"/proc/self".as_ptr(),
                            name.as_mut_ptr().cast(),
                            name.len(),
                        );
                        if n > 0 {
                            libc::write(ready_w.as_raw_fd(), name.as_ptr().cast(), n as usize);
                        }
                    }
                    libc::close(ready_w.as_raw_fd());
                    let mut byte = 0u8;
                    libc::read(go_r.as_raw_fd(), (&mut byte as *mut u8).cast(), 1);
                    libc::_exit(0)
                }
            }
            ForkResult::Parent { child } => {
                drop(ready_w);
                drop(go_r);
                let result = Self::map_child(ready_r, base, count);
                // EOF on its pipe lets the child exit; the namespace lives on in our fd.
                drop(go_w);
                let _ = nix::sys::wait::waitpid(child, None);
                result
            }
        }
    }

    fn map_child(ready: OwnedFd, base: u32, count: u32) -> Result<Self, AgentError> {
        let mut name = String::new();
        std::fs::File::from(ready)
            .take(32)
            .read_to_string(&mut name)
            .map_err(|e| setup_err("wait for the user-namespace child", e))?;
        let pid: u32 = name.trim().parse().map_err(|_| {
            AgentError::Setup(
                "unshare(CLONE_NEWUSER) failed: this kernel refuses user namespaces \
                 (check user.max_user_namespaces); container sandboxes need one"
                    .into(),
            )
        })?;
        let map = format!("0 {base} {count}\n");
        for file in ["uid_map", "gid_map"] {
            let path = format!("/proc/{pid}/{file}");
            std::fs::OpenOptions::new()
                .write(true)
                .open(&path)
                .and_then(|mut f| f.write_all(map.as_bytes()))
                .map_err(|e| setup_err(format!("write {path}"), e))?;
        }
        let path = format!("/proc/{pid}/ns/user");
        let fd = nix::fcntl::open(
            path.as_str(),
            OFlag::O_RDONLY | OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::empty(),
        )
        .map_err(|e| setup_err(format!("open {path}"), e))?;
        Ok(Self { fd })
    }

    pub fn fd(&self) -> &OwnedFd {
        &self.fd
    }

    /// Moves the calling process into the namespace as its root (uid and gid 0, no
    /// supplementary groups). Its capabilities then count only inside the namespace.
    /// Single-threaded callers only (setns of a user namespace requires it).
    pub fn enter(&self) -> Result<(), AgentError> {
        nix::sched::setns(&self.fd, CloneFlags::CLONE_NEWUSER)
            .map_err(|e| setup_err("join the sandbox's user namespace", e))?;
        become_root()
    }
}

/// Inside a freshly joined user namespace: become its uid/gid 0.
pub fn become_root() -> Result<(), AgentError> {
    let (uid, gid) = (Uid::from_raw(0), Gid::from_raw(0));
    nix::unistd::setresgid(gid, gid, gid).map_err(|e| setup_err("setresgid(0)", e))?;
    nix::unistd::setgroups(&[]).map_err(|e| setup_err("setgroups([])", e))?;
    nix::unistd::setresuid(uid, uid, uid).map_err(|e| setup_err("setresuid(0)", e))?;
    Ok(())
}

/// Wraps a raw descriptor received from another process.
pub fn owned(raw: i32) -> OwnedFd {
    // SAFETY: callers pass a descriptor that was just received and that nothing else owns.
    unsafe { OwnedFd::from_raw_fd(raw) }
}
