//! `--container-root`: turn a process started in fresh namespaces into the sandbox's PID 1.
//!
//! Called after the agent socket is bound on the host path, so the listener keeps working
//! while the path itself becomes unreachable once the old root is detached.

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

use nix::mount::{mount, umount2, MntFlags, MsFlags};

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
    mkdir(target)?;
    mount(Some(source), target, Some(fstype), flags, data)
        .map_err(|e| setup_err(format!("mount {fstype} on {}", target.display()), e))
}

fn bind_file(host: &str, target: &Path) -> Result<(), AgentError> {
    std::fs::File::create(target)
        .map_err(|e| setup_err(format!("create {}", target.display()), e))?;
    mount(
        Some(host),
        target,
        None::<&str>,
        MsFlags::MS_BIND,
        None::<&str>,
    )
    .map_err(|e| setup_err(format!("bind {host} on {}", target.display()), e))
}

/// Builds the root (overlay of `lower` with upper/work under `overlay_dir`, or a bind of
/// `lower`), mounts /proc, a minimal /dev, /tmp and /run into it, and pivots into it.
pub fn enter_root(
    lower: &Path,
    overlay_dir: Option<&Path>,
    disk_mib: Option<u64>,
    hostname: &str,
) -> Result<(), AgentError> {
    if !lower.join("bin").is_dir() {
        return Err(AgentError::Setup(format!(
            "container root {} has no bin/: build it with guest-agent/mkinitramfs.sh",
            lower.display()
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

    let root: PathBuf = match overlay_dir {
        Some(dir) => {
            // The writable layer: a size-capped tmpfs seen only in this mount namespace (it
            // disappears with the container), or a directory on the host.
            let rw = match disk_mib {
                Some(mib) => {
                    let rw = dir.join("disk");
                    mount_at(
                        "tmpfs",
                        &rw,
                        "tmpfs",
                        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
                        Some(&format!("size={mib}m,mode=0755")),
                    )?;
                    rw
                }
                None => dir.to_path_buf(),
            };
            let (upper, work, merged) = (rw.join("upper"), rw.join("work"), dir.join("root"));
            for d in [&upper, &work, &merged] {
                mkdir(d)?;
            }
            let options = format!(
                "lowerdir={},upperdir={},workdir={}",
                lower.display(),
                upper.display(),
                work.display()
            );
            mount_at(
                "overlay",
                &merged,
                "overlay",
                MsFlags::empty(),
                Some(&options),
            )?;
            merged
        }
        None => {
            mount(
                Some(lower),
                lower,
                None::<&str>,
                MsFlags::MS_BIND | MsFlags::MS_REC,
                None::<&str>,
            )
            .map_err(|e| setup_err(format!("bind {}", lower.display()), e))?;
            lower.to_path_buf()
        }
    };

    let nosuid_nodev = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    mount_at(
        "proc",
        &root.join("proc"),
        "proc",
        nosuid_nodev | MsFlags::MS_NOEXEC,
        None,
    )?;
    mount_at(
        "sysfs",
        &root.join("sys"),
        "sysfs",
        nosuid_nodev | MsFlags::MS_NOEXEC | MsFlags::MS_RDONLY,
        None,
    )?;
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
    mount_at(
        "devpts",
        &dev.join("pts"),
        "devpts",
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("newinstance,ptmxmode=0666,mode=0620"),
    )?;
    mount_at(
        "tmpfs",
        &dev.join("shm"),
        "tmpfs",
        nosuid_nodev,
        Some("mode=1777"),
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
        &root.join("tmp"),
        "tmpfs",
        nosuid_nodev,
        Some("mode=1777"),
    )?;
    mount_at(
        "tmpfs",
        &root.join("run"),
        "tmpfs",
        nosuid_nodev,
        Some("mode=0755"),
    )?;

    // pivot_root(".", ".") stacks the old root under the new one; detaching it leaves no
    // path back to the host filesystem (and to the agent socket).
    std::env::set_current_dir(&root)
        .map_err(|e| setup_err(format!("chdir {}", root.display()), e))?;
    nix::unistd::pivot_root(".", ".").map_err(|e| setup_err("pivot_root", e))?;
    umount2(".", MntFlags::MNT_DETACH).map_err(|e| setup_err("detach old root", e))?;
    std::env::set_current_dir("/").map_err(|e| setup_err("chdir /", e))?;
    nix::unistd::sethostname(hostname).map_err(|e| setup_err("sethostname", e))?;
    crate::init::loopback_up();
    // Not dumpable: sandbox processes (same uid) cannot ptrace the agent or read its
    // /proc/1/{mem,environ,fd}, so the control channel stays out of reach.
    nix::sys::prctl::set_dumpable(false).map_err(|e| setup_err("prctl(PR_SET_DUMPABLE)", e))?;
    Ok(())
}
