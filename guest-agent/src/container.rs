//! Container mode: turn a process the edge started in fresh mount, pid, uts, ipc and net
//! namespaces into the sandbox's PID 1, serving as root of the sandbox's own user namespace.
//!
//! Order matters. Still host root (the namespaces above belong to the host's user
//! namespace, so the sandbox can never reconfigure them), the agent:
//! 1. makes its mounts private and takes a cgroup namespace rooted at the sandbox's cgroup;
//! 2. creates the sandbox's user namespace (host ids `id_base..` become 0..);
//! 3. mounts the writable layer and an idmapped, read-only view of the image: files keep
//!    their owners as the sandbox sees them and are stored unshifted;
//! 4. has a child inside the user namespace mount the overlay of both (its copy-ups and new
//!    files then carry the sandbox's ids) and create the mount points in it;
//! 5. mounts /proc (with /proc/sys and friends read-only, kcore, keys, ... masked), a
//!    read-only /sys, a minimal /dev, a capped /dev/shm and /run, and pivots into the root;
//! 6. protects itself from the OOM killer where the host allows it, joins the user
//!    namespace as its root and turns non-dumpable. Everything it serves afterwards runs with the sandbox's own ids.

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{symlink, DirBuilderExt};
use std::path::{Path, PathBuf};

use dsec_api::agent::v1::ContainerLaunch;
use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sched::CloneFlags;

use crate::mountapi::{self, FsContext};
use crate::userns::UserNamespace;
use crate::AgentError;

fn setup_err(what: impl std::fmt::Display, err: impl std::fmt::Display) -> AgentError {
    AgentError::Setup(format!("{what}: {err}"))
}

fn mkdir(path: &Path) -> Result<(), AgentError> {
    std::fs::create_dir_all(path).map_err(|e| setup_err(format!("mkdir {}", path.display()), e))
}

fn mount_at(
    source: &str,
    target: &Path,
    fstype: &str,
    flags: MsFlags,
    data: Option<&str>,
) -> Result<(), AgentError> {
    mount(Some(source), target, Some(fstype), flags, data)
        .map_err(|e| setup_err(format!("mount {fstype} on {}", target.display()), e))
}

fn bind(source: &Path, target: &Path, flags: MsFlags) -> Result<(), AgentError> {
    mount(
        Some(source),
        target,
        None::<&str>,
        MsFlags::MS_BIND | MsFlags::MS_REC,
        None::<&str>,
    )
    .map_err(|e| {
        setup_err(
            format!("bind {} on {}", source.display(), target.display()),
            e,
        )
    })?;
    if flags.is_empty() {
        return Ok(());
    }
    mount(
        None::<&str>,
        target,
        None::<&str>,
        MsFlags::MS_BIND | MsFlags::MS_REMOUNT | flags,
        None::<&str>,
    )
    .map_err(|e| setup_err(format!("remount {} read-only", target.display()), e))
}

fn bind_file(host: &str, target: &Path) -> Result<(), AgentError> {
    std::fs::File::create(target)
        .map_err(|e| setup_err(format!("create {}", target.display()), e))?;
    bind(Path::new(host), target, MsFlags::empty())
}

/// /proc entries the sandbox may read but not write (as the established runtimes do):
/// sysctls, sysrq, IRQ affinity, bus and filesystem knobs are the host kernel's.
const READ_ONLY_PROC: &[&str] = &["sys", "sysrq-trigger", "irq", "bus", "fs"];
/// /proc and /sys entries hidden behind an empty file or directory: kernel memory, other
/// users' keys, timer and scheduler internals that leak host activity, firmware.
const MASKED: &[&str] = &[
    "proc/kcore",
    "proc/keys",
    "proc/key-users",
    "proc/timer_list",
    "proc/timer_stats",
    "proc/sched_debug",
    "proc/latency_stats",
    "proc/interrupts",
    "proc/kpagecount",
    "proc/kpageflags",
    "proc/kpagecgroup",
    "proc/acpi",
    "proc/asound",
    "proc/scsi",
    "sys/firmware",
    "sys/devices/virtual/powercap",
    "sys/kernel/debug",
    "sys/kernel/security",
];

/// Mount points every root gets (created inside the user namespace, so with its ids).
const MOUNT_POINTS: &[&str] = &["proc", "sys", "dev", "run", "tmp"];

/// Reads the launch description the edge wrote into descriptor `fd`.
pub fn read_launch(fd: i32) -> Result<ContainerLaunch, AgentError> {
    use prost::Message;
    use std::io::Read;
    if fd < 3 {
        return Err(AgentError::Setup(format!(
            "--container-launch-fd {fd}: expected an inherited descriptor >= 3"
        )));
    }
    let mut bytes = Vec::new();
    let mut file = std::fs::File::from(crate::userns::owned(fd));
    file.by_ref()
        .take(64 * 1024)
        .read_to_end(&mut bytes)
        .map_err(|e| setup_err(format!("read the container launch from fd {fd}"), e))?;
    ContainerLaunch::decode(bytes.as_slice())
        .map_err(|e| setup_err("decode the container launch", e))
}

/// Builds the sandbox and enters it; see the module docs. Single-threaded callers only.
pub fn enter(launch: &ContainerLaunch) -> Result<(), AgentError> {
    let started = std::time::Instant::now();
    let step = |name: &str| tracing::debug!(us = started.elapsed().as_micros() as u64, "{name}");
    let lower = PathBuf::from(&launch.lower_dir);
    let dir = PathBuf::from(&launch.sandbox_dir);
    if !lower.join("bin").is_dir() {
        return Err(AgentError::Setup(format!(
            "container root {} has no bin/: build it with guest-agent/mkinitramfs.sh",
            lower.display()
        )));
    }
    if !dir.is_absolute() {
        return Err(AgentError::Setup(format!(
            "sandbox directory {} must be an absolute path",
            dir.display()
        )));
    }
    // Nothing below may propagate back to the host's mount namespace.
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .map_err(|e| setup_err("make / private", e))?;
    step("private");
    // The edge moved us into the sandbox's cgroups before exec: that becomes "/" inside.
    nix::sched::unshare(CloneFlags::CLONE_NEWCGROUP)
        .map_err(|e| setup_err("unshare the cgroup namespace", e))?;
    step("cgroupns");
    let userns = UserNamespace::create(launch.id_base, launch.id_count)?;
    step("user namespace created");

    // The layers and the root live in `layers/`, searchable by the sandbox's root (the
    // sandbox directory itself is private to host root) and our working directory: relative
    // layer paths keep host paths out of the sandbox's mountinfo.
    let dir = dir.join("layers");
    std::fs::DirBuilder::new()
        .mode(0o711)
        .create(&dir)
        .map_err(|e| setup_err(format!("mkdir {}", dir.display()), e))?;
    std::env::set_current_dir(&dir)
        .map_err(|e| setup_err(format!("chdir {}", dir.display()), e))?;
    let disk = dir.join("disk");
    mkdir(&disk)?;
    if launch.disk_mib > 0 {
        mount_at(
            "tmpfs",
            &disk,
            "tmpfs",
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
            Some(&format!("size={}m,mode=0755", launch.disk_mib)),
        )?;
    }
    for sub in ["upper", "work"] {
        mkdir(&disk.join(sub))?;
    }
    idmapped(
        &disk,
        &dir.join("rw"),
        &userns,
        mountapi::MOUNT_ATTR_NOSUID | mountapi::MOUNT_ATTR_NODEV,
    )?;
    idmapped(
        &lower,
        &dir.join("lower"),
        &userns,
        mountapi::MOUNT_ATTR_RDONLY | mountapi::MOUNT_ATTR_NODEV,
    )?;
    let root = dir.join("root");
    mkdir(&root)?;
    step("layers idmapped");
    let overlay = mount_overlay_as_sandbox(&userns)?;
    step("overlay mounted");
    mountapi::attach(&overlay, &root).map_err(|e| setup_err("attach the overlay", e))?;
    drop(overlay);

    mount_system(&root, launch)?;
    step("/proc, /sys, /dev mounted");

    // pivot_root(".", ".") stacks the old root under the new one; detaching it leaves no
    // path back to the host filesystem (and the idmapped layer mounts go with it).
    std::env::set_current_dir(&root)
        .map_err(|e| setup_err(format!("chdir {}", root.display()), e))?;
    nix::unistd::pivot_root(".", ".").map_err(|e| setup_err("pivot_root", e))?;
    umount2(".", MntFlags::MNT_DETACH).map_err(|e| setup_err("detach old root", e))?;
    std::env::set_current_dir("/").map_err(|e| setup_err("chdir /", e))?;
    nix::unistd::sethostname(&launch.hostname).map_err(|e| setup_err("sethostname", e))?;
    crate::init::loopback_up();
    step("pivoted, lo up");
    // The agent is what must survive an out-of-memory sandbox. Lowering the score needs
    // CAP_SYS_RESOURCE, which some hosts withhold even from root: then the OOM killer still
    // picks the largest process, which the agent (a few MiB) rarely is.
    if let Err(err) = std::fs::write("/proc/self/oom_score_adj", "-1000") {
        tracing::warn!(%err, "cannot protect the agent from the OOM killer (no CAP_SYS_RESOURCE?)");
    }
    step("oom");
    userns.enter()?;
    step("userns entered");
    // Not dumpable: sandbox processes (now the same uid) cannot ptrace the agent or read its
    // /proc/1/{mem,environ,fd}, so the control channel stays out of reach.
    nix::sys::prctl::set_dumpable(false).map_err(|e| setup_err("prctl(PR_SET_DUMPABLE)", e))?;
    step("in the sandbox");
    Ok(())
}

/// Attaches an idmapped view of `source` at `target`: ids stored as N appear as
/// `id_base + N`, i.e. as N inside the sandbox.
fn idmapped(
    source: &Path,
    target: &Path,
    userns: &UserNamespace,
    attrs: u64,
) -> Result<(), AgentError> {
    mkdir(target)?;
    let tree = mountapi::clone_tree(source, true)
        .map_err(|e| setup_err(format!("open_tree {}", source.display()), e))?;
    mountapi::set_attrs(&tree, attrs, Some(userns.fd())).map_err(|e| {
        let fs = nix::sys::statfs::statfs(source)
            .map(|s| format!("{:?}", s.filesystem_type()))
            .unwrap_or_else(|_| "unknown".into());
        AgentError::Setup(format!(
            "cannot make an idmapped mount of {} (filesystem {fs}): {e}; container sandboxes \
             run only in a user namespace with idmapped layers (Linux >= 6.3 for tmpfs, \
             ext4/xfs/btrfs since 5.12, FUSE >= 6.12 with a server that allows it), so this \
             sandbox is refused rather than run as host root",
            source.display()
        ))
    })?;
    mountapi::attach(&tree, target)
        .map_err(|e| setup_err(format!("attach idmapped {}", target.display()), e))
}

/// Mounts the overlay of `lower` and `rw/{upper,work}` (relative to the current directory)
/// from a child that is root of the sandbox's user namespace, and returns the detached
/// mount. The child also creates the root's mount points, with the sandbox's ids.
fn mount_overlay_as_sandbox(userns: &UserNamespace) -> Result<OwnedFd, AgentError> {
    use nix::sys::socket::{
        recvmsg, sendmsg, socketpair, AddressFamily, ControlMessage, ControlMessageOwned, MsgFlags,
        SockFlag, SockType,
    };
    let (ours, theirs) = socketpair(
        AddressFamily::Unix,
        SockType::SeqPacket,
        None,
        SockFlag::SOCK_CLOEXEC,
    )
    .map_err(|e| setup_err("socketpair", e))?;
    // SAFETY: single-threaded (before tokio); the child does its work and _exits without
    // returning into the caller.
    match unsafe { nix::unistd::fork() }.map_err(|e| setup_err("fork", e))? {
        nix::unistd::ForkResult::Child => {
            drop(ours);
            let mounted = overlay_child(userns);
            let (fds, message) = match &mounted {
                Ok(fd) => (vec![fd.as_raw_fd()], String::from("ok")),
                Err(err) => (Vec::new(), err.to_string()),
            };
            let cmsg = [ControlMessage::ScmRights(&fds)];
            let iov = [std::io::IoSlice::new(message.as_bytes())];
            let cmsgs: &[ControlMessage] = if fds.is_empty() { &[] } else { &cmsg };
            if let Err(e) = sendmsg::<()>(theirs.as_raw_fd(), &iov, cmsgs, MsgFlags::empty(), None)
            {
                eprintln!("dsec-agent: overlay helper: send the mount: {e} ({message})");
            }
            // SAFETY: ends the forked child without running the parent's destructors.
            unsafe { libc::_exit(0) }
        }
        nix::unistd::ForkResult::Parent { child } => {
            drop(theirs);
            let mut buf = vec![0u8; 4096];
            let mut space = nix::cmsg_space!([std::os::fd::RawFd; 1]);
            let received = {
                let mut iov = [std::io::IoSliceMut::new(&mut buf)];
                recvmsg::<()>(
                    ours.as_raw_fd(),
                    &mut iov,
                    Some(&mut space),
                    MsgFlags::MSG_CMSG_CLOEXEC,
                )
                .map(|msg| {
                    let fd = msg.cmsgs().ok().and_then(|mut c| {
                        c.find_map(|m| match m {
                            ControlMessageOwned::ScmRights(fds) => fds.first().copied(),
                            _ => None,
                        })
                    });
                    (fd, msg.bytes)
                })
            };
            let status = nix::sys::wait::waitpid(child, None);
            match received {
                Ok((Some(fd), _)) => Ok(crate::userns::owned(fd)),
                Ok((None, len)) if len > 0 => Err(AgentError::Setup(format!(
                    "mount the overlay inside the user namespace: {}",
                    String::from_utf8_lossy(&buf[..len])
                ))),
                Ok((None, _)) => Err(AgentError::Setup(format!(
                    "the overlay mount helper ended without an answer ({status:?})"
                ))),
                Err(e) => Err(setup_err("receive the overlay mount", e)),
            }
        }
    }
}

/// In the forked child: become the sandbox's root, take a mount namespace of our own (the
/// overlay's superblock must belong to the sandbox's user namespace for its copy-ups to run
/// with the sandbox's ids), mount the overlay detached and create the mount points.
fn overlay_child(userns: &UserNamespace) -> Result<OwnedFd, AgentError> {
    // The agent is what must survive an out-of-memory sandbox. Lowering the score needs
    // CAP_SYS_RESOURCE, which some hosts withhold even from root: then the OOM killer still
    // picks the largest process, which the agent (a few MiB) rarely is.
    if let Err(err) = std::fs::write("/proc/self/oom_score_adj", "-1000") {
        tracing::warn!(%err, "cannot protect the agent from the OOM killer (no CAP_SYS_RESOURCE?)");
    }
    userns.enter()?;
    nix::sched::unshare(CloneFlags::CLONE_NEWNS)
        .map_err(|e| setup_err("unshare the mount namespace", e))?;
    let ctx = FsContext::open("overlay").map_err(|e| setup_err("fsopen overlay", e))?;
    for (key, value) in [
        ("lowerdir", "lower"),
        ("upperdir", "rw/upper"),
        ("workdir", "rw/work"),
    ] {
        ctx.set_string(key, value)
            .map_err(|e| setup_err(format!("overlay option {key}={value}"), e))?;
    }
    // Metadata in user.overlay.* xattrs: trusted.* needs host root.
    ctx.set_flag("userxattr")
        .map_err(|e| setup_err("overlay option userxattr", e))?;
    let mount = ctx
        .mount()
        .map_err(|e| setup_err("create the overlay", e))?;
    for name in MOUNT_POINTS {
        let c = std::ffi::CString::new(*name).expect("static name");
        // SAFETY: mkdirat on the mount's root directory fd with a NUL-terminated name.
        let rc = unsafe { libc::mkdirat(mount.as_raw_fd(), c.as_ptr(), 0o755) };
        if rc != 0 && nix::errno::Errno::last() != nix::errno::Errno::EEXIST {
            return Err(setup_err(
                format!("mkdir /{name} in the root"),
                std::io::Error::last_os_error(),
            ));
        }
    }
    let tmp = c"tmp";
    // SAFETY: fchmodat on the mount's root directory fd with a static name.
    if unsafe { libc::fchmodat(mount.as_raw_fd(), tmp.as_ptr(), 0o1777, 0) } != 0 {
        return Err(setup_err(
            "chmod 1777 /tmp",
            std::io::Error::last_os_error(),
        ));
    }
    Ok(mount)
}

/// /proc, /sys, /dev and /run of the root, hardened.
fn mount_system(root: &Path, launch: &ContainerLaunch) -> Result<(), AgentError> {
    let nosuid_nodev = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    let ro = nosuid_nodev | MsFlags::MS_NOEXEC | MsFlags::MS_RDONLY;
    let proc = root.join("proc");
    mount_at(
        "proc",
        &proc,
        "proc",
        nosuid_nodev | MsFlags::MS_NOEXEC,
        None,
    )?;
    for name in READ_ONLY_PROC {
        let path = proc.join(name);
        if path.exists() {
            bind(&path, &path, ro)?;
        }
    }
    mount_at(
        "sysfs",
        &root.join("sys"),
        "sysfs",
        nosuid_nodev | MsFlags::MS_NOEXEC | MsFlags::MS_RDONLY,
        None,
    )?;
    for rel in MASKED {
        let path = root.join(rel);
        match std::fs::symlink_metadata(&path) {
            Ok(meta) if meta.is_dir() => mount_at("tmpfs", &path, "tmpfs", ro, Some("size=0"))?,
            Ok(_) => bind(Path::new("/dev/null"), &path, MsFlags::empty())?,
            Err(_) => {}
        }
    }
    let owner = format!("uid={0},gid={0}", launch.id_base);
    let dev = root.join("dev");
    mount_at(
        "tmpfs",
        &dev,
        "tmpfs",
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("mode=0755,size=64k"),
    )?;
    for name in ["null", "zero", "full", "random", "urandom", "tty"] {
        bind_file(&format!("/dev/{name}"), &dev.join(name))?;
    }
    for sub in ["pts", "shm"] {
        mkdir(&dev.join(sub))?;
    }
    mount_at(
        "devpts",
        &dev.join("pts"),
        "devpts",
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("newinstance,ptmxmode=0666,mode=0620"),
    )?;
    // /dev/shm is memory: capped below the sandbox's memory, so filling it is ENOSPC, not an
    // OOM kill. /tmp lives on the writable layer (capped by its size).
    mount_at(
        "tmpfs",
        &dev.join("shm"),
        "tmpfs",
        nosuid_nodev,
        Some(&format!(
            "mode=1777,size={}m,{owner}",
            launch.shm_mib.max(1)
        )),
    )?;
    for (link, target) in [
        ("ptmx", "pts/ptmx"),
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        symlink(target, dev.join(link))
            .map_err(|e| setup_err(format!("symlink /dev/{link}"), e))?;
    }
    mount_at(
        "tmpfs",
        &root.join("run"),
        "tmpfs",
        nosuid_nodev,
        Some(&format!("mode=0755,size=16m,{owner}")),
    )?;
    Ok(())
}
