//! Container mode: turn a process the edge started in fresh mount, pid, uts, ipc and net
//! namespaces into the sandbox's PID 1, serving as root of the sandbox's own user namespace.
//!
//! Order matters. Still host root (the namespaces above belong to the host's user
//! namespace, so the sandbox can never reconfigure them), the agent:
//! 1. makes its mounts private and takes a cgroup namespace rooted at the sandbox's cgroup;
//! 2. creates the sandbox's user namespace (host ids `id_base..` become 0..);
//! 3. mounts the writable layer and an idmapped, read-only view of the image (files keep
//!    their owners as the sandbox sees them), and the overlay of both;
//! 4. mounts /proc (with /proc/sys and friends read-only, kcore, keys, ... masked), a
//!    read-only /sys, a minimal /dev, a capped /dev/shm and /run, and pivots into the root;
//! 5. protects itself from the OOM killer where the host allows it, joins the user
//!    namespace as its root and turns non-dumpable. Everything it serves afterwards runs with the sandbox's own ids.

use std::os::unix::fs::{symlink, DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use dsec_api::agent::v1::ContainerLaunch;
use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sched::CloneFlags;

use crate::mountapi;
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
];

/// Mount points every root gets.
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
    let (upper, work) = (disk.join("upper"), disk.join("work"));
    for d in [&upper, &work] {
        mkdir(d)?;
    }
    // The upper layer holds the sandbox's ids as host ids (id_base + N): the image root's
    // owner and mode carry over to its root, so "/" belongs to sandbox root.
    let image_root =
        std::fs::metadata(&lower).map_err(|e| setup_err(format!("stat {}", lower.display()), e))?;
    let shift = |id: u32| {
        launch
            .id_base
            .checked_add(id)
            .filter(|_| id < launch.id_count)
    };
    let (Some(uid), Some(gid)) = (shift(image_root.uid()), shift(image_root.gid())) else {
        return Err(AgentError::Setup(format!(
            "the image root {} is owned by {}:{}, outside the sandbox's {} ids",
            lower.display(),
            image_root.uid(),
            image_root.gid(),
            launch.id_count
        )));
    };
    std::os::unix::fs::chown(&upper, Some(uid), Some(gid))
        .map_err(|e| setup_err(format!("chown {}", upper.display()), e))?;
    std::fs::set_permissions(&upper, std::fs::Permissions::from_mode(image_root.mode()))
        .map_err(|e| setup_err(format!("chmod {}", upper.display()), e))?;
    idmapped(
        &lower,
        &dir.join("lower"),
        &userns,
        mountapi::MOUNT_ATTR_RDONLY | mountapi::MOUNT_ATTR_NODEV,
    )?;
    step("layers idmapped");
    let root = dir.join("root");
    mkdir(&root)?;
    // Mounted by host root (so no user-namespace restrictions on overlayfs features), over
    // the idmapped image: copy-ups keep the owners the sandbox sees, new files get the
    // creator's (shifted) ids.
    mount_at(
        "overlay",
        &root,
        "overlay",
        MsFlags::empty(),
        Some("lowerdir=lower,upperdir=disk/upper,workdir=disk/work"),
    )?;
    for name in MOUNT_POINTS {
        let path = root.join(name);
        if !path.is_dir() {
            mkdir(&path)?;
        }
    }
    let tmp = root.join("tmp");
    std::os::unix::fs::chown(&tmp, Some(launch.id_base), Some(launch.id_base))
        .map_err(|e| setup_err("chown /tmp", e))?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o1777))
        .map_err(|e| setup_err("chmod 1777 /tmp", e))?;
    if !launch.resolv_conf.is_empty() {
        write_resolv_conf(&root, launch)?;
    }
    step("overlay mounted");

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

/// Replaces the image's /etc/resolv.conf with the launch's, owned by sandbox root. Every step
/// refuses symbolic links: an image's `etc` or `resolv.conf` pointing elsewhere must not make
/// host root write outside the container's root.
fn write_resolv_conf(root: &Path, launch: &ContainerLaunch) -> Result<(), AgentError> {
    use nix::fcntl::{openat, OFlag};
    use nix::sys::stat::Mode;
    use nix::unistd::{fchown, unlinkat, Gid, Uid, UnlinkatFlags};
    use std::io::Write;
    let etc = root.join("etc");
    if !etc.exists() {
        mkdir(&etc)?;
        std::os::unix::fs::chown(&etc, Some(launch.id_base), Some(launch.id_base))
            .map_err(|e| setup_err("chown /etc", e))?;
    }
    let root_dir =
        std::fs::File::open(root).map_err(|e| setup_err("open the container root", e))?;
    let etc_fd = openat(
        &root_dir,
        "etc",
        OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| setup_err("open the image's /etc (a symbolic link is refused)", e))?;
    match unlinkat(&etc_fd, "resolv.conf", UnlinkatFlags::NoRemoveDir) {
        Ok(()) | Err(nix::errno::Errno::ENOENT) => {}
        Err(e) => return Err(setup_err("remove the image's /etc/resolv.conf", e)),
    }
    let fd = openat(
        &etc_fd,
        "resolv.conf",
        OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::from_bits_truncate(0o644),
    )
    .map_err(|e| setup_err("create /etc/resolv.conf", e))?;
    fchown(
        &fd,
        Some(Uid::from_raw(launch.id_base)),
        Some(Gid::from_raw(launch.id_base)),
    )
    .map_err(|e| setup_err("chown /etc/resolv.conf", e))?;
    std::fs::File::from(fd)
        .write_all(launch.resolv_conf.as_bytes())
        .map_err(|e| setup_err("write /etc/resolv.conf", e))
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
        // Sandbox root is "other" to these host-root-owned entries: what others cannot read
        // needs no mask (each mount costs every create and delete a global lock).
        match std::fs::symlink_metadata(&path) {
            Ok(meta) if meta.mode() & 0o004 == 0 => {}
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
    // Device nodes made here (we are still host root, and this tmpfs belongs to the host's
    // user namespace, so they work for the sandbox): a mknod is not a mount, and every mount
    // costs each create and delete the kernel's global namespace lock.
    for (name, major, minor) in [
        ("null", 1, 3),
        ("zero", 1, 5),
        ("full", 1, 7),
        ("random", 1, 8),
        ("urandom", 1, 9),
        ("tty", 5, 0),
    ] {
        let path = dev.join(name);
        nix::sys::stat::mknod(
            &path,
            nix::sys::stat::SFlag::S_IFCHR,
            nix::sys::stat::Mode::from_bits_truncate(0o666),
            nix::sys::stat::makedev(major, minor),
        )
        .map_err(|e| setup_err(format!("mknod {}", path.display()), e))?;
        // The umask took bits off the mode.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666))
            .map_err(|e| setup_err(format!("chmod {}", path.display()), e))?;
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
