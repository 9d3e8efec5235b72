//! The VMM's jail: before any VM exists the process forks into a new PID namespace; the child
//! (PID 1 there) takes new mount, IPC, UTS and network namespaces (or joins a given network
//! namespace), pivot_roots into the jail directory, which holds only bind mounts of what the VM
//! needs at the same absolute paths (kernel, initrd, disks, snapshot, the directories of its
//! sockets and logs, /dev/kvm, /dev/net/tun), and lowers its rlimits. The VM is then built as
//! root inside the jail (taps are created in the jail's network namespace) and
//! [`drop_privileges`] switches to the unprivileged uid/gid before any guest code runs.
//! The parent stays outside, forwards SIGTERM/SIGINT and exits with the child's status.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum JailError {
    #[error("jail: {what} failed: {source}; the jail needs root (CAP_SYS_ADMIN) and a kernel with user-visible namespaces")]
    Sys {
        what: String,
        source: std::io::Error,
    },
    #[error("jail: {0} does not exist, so it cannot be placed in the jail; check the path")]
    Missing(PathBuf),
    #[error("jail: {0} must be an absolute path")]
    Relative(PathBuf),
}

fn sys(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> JailError {
    let what = what.into();
    move |source| JailError::Sys { what, source }
}

fn check(rc: libc::c_int, what: impl Into<String>) -> Result<(), JailError> {
    if rc < 0 {
        return Err(sys(what)(std::io::Error::last_os_error()));
    }
    Ok(())
}

fn cpath(path: &Path) -> CString {
    // Paths come from the command line or a parsed config: no interior NUL is possible there,
    // and a NUL would make the path unusable anyway.
    CString::new(path.as_os_str().as_bytes()).unwrap_or_default()
}

/// Something from the host made visible inside the jail, at the same absolute path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exposure {
    pub path: PathBuf,
    pub writable: bool,
}

impl Exposure {
    pub fn read_only(path: impl Into<PathBuf>) -> Self {
        Exposure {
            path: path.into(),
            writable: false,
        }
    }

    pub fn writable(path: impl Into<PathBuf>) -> Self {
        Exposure {
            path: path.into(),
            writable: true,
        }
    }
}

impl std::str::FromStr for Exposure {
    type Err = std::convert::Infallible;

    /// `PATH` or `PATH,rw`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.strip_suffix(",rw") {
            Some(path) => Ok(Exposure::writable(path)),
            None => Ok(Exposure::read_only(s)),
        }
    }
}

#[derive(Clone, Debug)]
pub struct JailSpec {
    /// The jail's root directory on the host (created if missing, removed afterwards if so).
    pub root: PathBuf,
    pub uid: u32,
    pub gid: u32,
    /// Join this network namespace (e.g. /run/netns/NAME) instead of creating an empty one.
    pub netns: Option<PathBuf>,
    pub expose: Vec<Exposure>,
    pub max_open_files: u64,
}

/// Enters the jail. Returns in the jailed child only; the parent exits with its status.
pub fn enter(spec: &JailSpec) -> Result<(), JailError> {
    for e in &spec.expose {
        if !e.path.is_absolute() {
            return Err(JailError::Relative(e.path.clone()));
        }
        if !e.path.exists() {
            return Err(JailError::Missing(e.path.clone()));
        }
    }
    if !spec.root.is_absolute() {
        return Err(JailError::Relative(spec.root.clone()));
    }
    let created_root = !spec.root.exists();
    std::fs::create_dir_all(&spec.root).map_err(sys(format!("create {}", spec.root.display())))?;
    // SAFETY: unshare only changes this process's namespace membership.
    check(unsafe { libc::unshare(libc::CLONE_NEWPID) }, "unshare(PID)")?;
    // SAFETY: no other thread exists yet (the jail is entered before any is spawned), so the
    // child may run arbitrary code after fork.
    let child = unsafe { libc::fork() };
    if child < 0 {
        return Err(sys("fork")(std::io::Error::last_os_error()));
    }
    if child > 0 {
        let status = supervise(child);
        if created_root {
            let _ = std::fs::remove_dir_all(&spec.root);
        }
        std::process::exit(status);
    }
    // The VMM dies with its supervisor.
    // SAFETY: plain prctl with integer arguments.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) };
    if let Err(e) = build(spec) {
        eprintln!("dsec-vmm: {e}");
        std::process::exit(1);
    }
    Ok(())
}

/// Waits for the jailed child, forwarding stop signals; returns its exit status.
fn supervise(child: libc::pid_t) -> i32 {
    // SAFETY: sigset_t is plain data, initialised by sigemptyset/sigaddset; the mask change
    // only affects this (single-threaded) process.
    let set = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in [libc::SIGTERM, libc::SIGINT, libc::SIGCHLD] {
            libc::sigaddset(&mut set, s);
        }
        libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    };
    loop {
        let mut status = 0;
        // SAFETY: waitpid on our own child with a valid status pointer.
        match unsafe { libc::waitpid(child, &mut status, libc::WNOHANG) } {
            pid if pid == child => {
                return if libc::WIFEXITED(status) {
                    libc::WEXITSTATUS(status)
                } else {
                    128 + libc::WTERMSIG(status)
                }
            }
            pid if pid < 0 => return 1,
            _ => {}
        }
        let timeout = libc::timespec {
            tv_sec: 1,
            tv_nsec: 0,
        };
        // SAFETY: `set` is initialised; a null siginfo pointer is allowed.
        let signal = unsafe { libc::sigtimedwait(&set, std::ptr::null_mut(), &timeout) };
        if signal == libc::SIGTERM || signal == libc::SIGINT {
            // SAFETY: signalling our own child.
            unsafe { libc::kill(child, signal) };
        }
    }
}

fn build(spec: &JailSpec) -> Result<(), JailError> {
    let mut flags = libc::CLONE_NEWNS | libc::CLONE_NEWIPC | libc::CLONE_NEWUTS;
    if spec.netns.is_none() {
        flags |= libc::CLONE_NEWNET;
    }
    // SAFETY: unshare only changes this process's namespace membership.
    let rc = unsafe { libc::unshare(flags) };
    check(rc, "unshare(mount, IPC, UTS, net)")?;
    if let Some(netns) = &spec.netns {
        let ns = std::fs::File::open(netns).map_err(sys(format!("open {}", netns.display())))?;
        // SAFETY: setns on an open namespace fd.
        let rc = unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&ns), libc::CLONE_NEWNET) };
        check(rc, format!("join network namespace {}", netns.display()))?;
    }
    let hostname = b"dsec-vmm";
    // SAFETY: the buffer is valid for its length.
    let rc = unsafe { libc::sethostname(hostname.as_ptr().cast(), hostname.len()) };
    check(rc, "sethostname")?;
    mount(None, Path::new("/"), None, libc::MS_REC | libc::MS_PRIVATE)?;
    let root = &spec.root;
    mount(Some(root), root, None, libc::MS_BIND | libc::MS_REC)?;
    let mut devices = vec![Exposure::writable("/dev/kvm")];
    if Path::new("/dev/net/tun").exists() {
        devices.push(Exposure::writable("/dev/net/tun"));
    }
    for e in devices.iter().chain(&spec.expose) {
        expose(root, e)?;
    }
    // The last chance to open /proc: a restored VM's snapshot over its base reads it.
    if let Err(e) = crate::pagemap::open() {
        eprintln!("dsec-vmm: {e}");
    }
    pivot_into(root)?;
    for (resource, limit) in [
        (libc::RLIMIT_NOFILE, spec.max_open_files),
        (libc::RLIMIT_CORE, 0),
    ] {
        let rlim = libc::rlimit {
            rlim_cur: limit,
            rlim_max: limit,
        };
        // SAFETY: setrlimit reads one rlimit struct.
        check(unsafe { libc::setrlimit(resource, &rlim) }, "setrlimit")?;
    }
    Ok(())
}

fn mount(
    source: Option<&Path>,
    target: &Path,
    fstype: Option<&str>,
    flags: libc::c_ulong,
) -> Result<(), JailError> {
    let source = source.map(cpath);
    let target_c = cpath(target);
    let fstype = fstype.map(|f| CString::new(f).unwrap_or_default());
    // SAFETY: every pointer is either null or a NUL-terminated string that outlives the call.
    let rc = unsafe {
        libc::mount(
            source.as_ref().map_or(std::ptr::null(), |s| s.as_ptr()),
            target_c.as_ptr(),
            fstype.as_ref().map_or(std::ptr::null(), |s| s.as_ptr()),
            flags,
            std::ptr::null(),
        )
    };
    check(rc, format!("mount {}", target.display()))
}

/// Bind-mounts `e.path` at the same path under `root` (read-only unless writable).
fn expose(root: &Path, e: &Exposure) -> Result<(), JailError> {
    let inside = root.join(e.path.strip_prefix("/").unwrap_or(&e.path));
    let is_dir = e.path.is_dir();
    if let Some(parent) = inside.parent() {
        std::fs::create_dir_all(parent).map_err(sys(format!("create {}", parent.display())))?;
    }
    if is_dir {
        std::fs::create_dir_all(&inside).map_err(sys(format!("create {}", inside.display())))?;
    } else if !inside.exists() {
        std::fs::File::create(&inside).map_err(sys(format!("create {}", inside.display())))?;
    }
    mount(Some(&e.path), &inside, None, libc::MS_BIND | libc::MS_REC)?;
    if !e.writable {
        mount(
            None,
            &inside,
            None,
            libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY,
        )?;
    }
    Ok(())
}

fn pivot_into(root: &Path) -> Result<(), JailError> {
    let old = root.join(".old-root");
    std::fs::create_dir_all(&old).map_err(sys("create .old-root"))?;
    let (new_c, old_c) = (cpath(root), cpath(&old));
    // SAFETY: pivot_root takes two NUL-terminated paths that outlive the call.
    let rc = unsafe { libc::syscall(libc::SYS_pivot_root, new_c.as_ptr(), old_c.as_ptr()) };
    if rc < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINVAL) {
        // The current root is the initial ramfs, which pivot_root cannot leave (a host
        // running from its initramfs). Move the jail over / and chroot into it instead: the
        // old root stays mounted underneath but unreachable, and the jailed process can
        // neither chroot again nor mount (seccomp) once it has dropped to the jail uid.
        let _ = std::fs::remove_dir(&old);
        return move_root(root);
    }
    check(rc as libc::c_int, "pivot_root")?;
    std::env::set_current_dir("/").map_err(sys("chdir /"))?;
    let old_inside = CString::new("/.old-root").unwrap_or_default();
    // SAFETY: umount2 on a NUL-terminated path.
    let rc = unsafe { libc::umount2(old_inside.as_ptr(), libc::MNT_DETACH) };
    check(rc, "detach the old root")?;
    let _ = std::fs::remove_dir("/.old-root");
    Ok(())
}

/// The no-pivot way into the jail: `root` mounted over `/`, then chroot into it.
fn move_root(root: &Path) -> Result<(), JailError> {
    std::env::set_current_dir(root).map_err(sys(format!("chdir {}", root.display())))?;
    mount(Some(Path::new(".")), Path::new("/"), None, libc::MS_MOVE)?;
    let dot = CString::new(".").unwrap_or_default();
    // SAFETY: chroot on a NUL-terminated path.
    let rc = unsafe { libc::chroot(dot.as_ptr()) };
    check(rc, "chroot into the jail")?;
    std::env::set_current_dir("/").map_err(sys("chdir /"))
}

/// Switches to the jail's uid/gid for good (no supplementary groups, no capabilities left).
pub fn drop_privileges(uid: u32, gid: u32) -> Result<(), JailError> {
    // SAFETY: setgroups with an empty list; setresgid/setresuid take plain integers.
    unsafe {
        check(libc::setgroups(0, std::ptr::null()), "setgroups")?;
        check(libc::setresgid(gid, gid, gid), format!("setresgid {gid}"))?;
        check(libc::setresuid(uid, uid, uid), format!("setresuid {uid}"))?;
    }
    // A credential change clears the parent-death signal: arm it again, or a jailed VMM
    // whose supervisor is SIGKILLed would run on, orphaned.
    // SAFETY: plain prctl with integer arguments.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) };
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposures_parse() {
        assert_eq!(
            "/a/b,rw".parse::<Exposure>().unwrap(),
            Exposure::writable("/a/b")
        );
        assert_eq!(
            "/a/b".parse::<Exposure>().unwrap(),
            Exposure::read_only("/a/b")
        );
    }
}
