//! VM mode on a disk image: the edge attaches the image read-only plus a per-sandbox writable
//! disk and names them on the kernel command line (`dsec.root=/dev/vda dsec.upper=/dev/vdb`).
//! The agent, still PID 1 of the initramfs, mounts both, stacks an overlay on them and makes
//! it the root of everything it runs (the initramfs stays underneath, unreachable).

use std::path::Path;
use std::time::{Duration, Instant};

use nix::mount::{mount, MsFlags};

use crate::AgentError;

/// Where the disks are mounted before the switch: a tmpfs on /mnt, which ends up under the
/// new root (out of reach) and leaves nothing behind where / is not an initramfs (tests).
const STAGE: &str = "/mnt";

/// Disks named on the kernel command line.
#[derive(Debug, PartialEq, Eq)]
pub struct DiskRoot {
    /// Read-only root filesystem (erofs or ext4).
    pub root: String,
    /// Writable ext4 for the overlay's upper layer; None: a tmpfs in guest memory.
    pub upper: Option<String>,
}

/// `dsec.root=` / `dsec.upper=` from a kernel command line; None without `dsec.root=`.
pub fn from_cmdline(cmdline: &str) -> Option<DiskRoot> {
    let mut root = None;
    let mut upper = None;
    for word in cmdline.split_whitespace() {
        if let Some(v) = word.strip_prefix("dsec.root=") {
            root = Some(v.to_string()).filter(|v| !v.is_empty());
        } else if let Some(v) = word.strip_prefix("dsec.upper=") {
            upper = Some(v.to_string()).filter(|v| !v.is_empty());
        }
    }
    Some(DiskRoot { root: root?, upper })
}

fn setup_err(what: impl std::fmt::Display, err: impl std::fmt::Display) -> AgentError {
    AgentError::Setup(format!("{what}: {err}"))
}

fn mkdir(path: &str) -> Result<(), AgentError> {
    std::fs::create_dir_all(path).map_err(|e| setup_err(format!("mkdir {path}"), e))
}

/// Block devices appear in devtmpfs as the driver probes them; give a slow boot a moment.
fn wait_for(device: &str) -> Result<(), AgentError> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !Path::new(device).exists() {
        if Instant::now() > deadline {
            return Err(AgentError::Setup(format!(
                "disk {device} named on the kernel command line did not appear within 10 s"
            )));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

/// Mounts `device` on `target`, trying each filesystem type in turn.
fn mount_disk(
    device: &str,
    target: &str,
    types: &[&str],
    flags: MsFlags,
) -> Result<(), AgentError> {
    wait_for(device)?;
    mkdir(target)?;
    let mut errors = Vec::new();
    for fstype in types {
        match mount(Some(device), target, Some(*fstype), flags, None::<&str>) {
            Ok(()) => return Ok(()),
            Err(err) => errors.push(format!("{fstype}: {err}")),
        }
    }
    Err(AgentError::Setup(format!(
        "mount {device} on {target} failed ({})",
        errors.join(", ")
    )))
}

fn move_mount(from: &str, to: &str) -> Result<(), AgentError> {
    mkdir(to)?;
    mount(Some(from), to, None::<&str>, MsFlags::MS_MOVE, None::<&str>)
        .map_err(|e| setup_err(format!("move mount {from} to {to}"), e))
}

/// Builds the overlay root from the disks and switches into it. Expects the VM's /proc,
/// /sys, /dev, /tmp and /run mounted (they move along into the new root).
pub fn enter(disks: &DiskRoot) -> Result<(), AgentError> {
    mkdir(STAGE)?;
    mount(
        Some("tmpfs"),
        STAGE,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some("mode=0700,size=64k"),
    )
    .map_err(|e| setup_err(format!("mount tmpfs on {STAGE}"), e))?;
    let lower = format!("{STAGE}/lower");
    let rw = format!("{STAGE}/rw");
    let merged = format!("{STAGE}/root");
    mount_disk(&disks.root, &lower, &["erofs", "ext4"], MsFlags::MS_RDONLY)?;
    match &disks.upper {
        Some(device) => mount_disk(device, &rw, &["ext4"], MsFlags::MS_NOATIME)?,
        None => {
            mkdir(&rw)?;
            mount(
                Some("tmpfs"),
                rw.as_str(),
                Some("tmpfs"),
                MsFlags::empty(),
                Some("mode=0755"),
            )
            .map_err(|e| setup_err(format!("mount tmpfs on {rw}"), e))?;
        }
    }
    let (upper, work) = (format!("{rw}/upper"), format!("{rw}/work"));
    for d in [&upper, &work, &merged] {
        mkdir(d)?;
    }
    mount(
        Some("overlay"),
        merged.as_str(),
        Some("overlay"),
        MsFlags::empty(),
        Some(format!("lowerdir={lower},upperdir={upper},workdir={work}").as_str()),
    )
    .map_err(|e| setup_err(format!("mount overlay on {merged}"), e))?;
    if !Path::new(&merged).join("bin").is_dir() {
        return Err(AgentError::Setup(format!(
            "root disk {} holds no bin/: is it a root filesystem image?",
            disks.root
        )));
    }
    // Submounts (/dev/pts, /dev/shm) travel with their parents.
    for m in ["/dev", "/proc", "/sys", "/tmp", "/run"] {
        move_mount(m, &format!("{merged}{m}"))?;
    }
    // The initramfs root cannot be pivot_root'ed away: move the new root over it and chroot,
    // as switch_root does.
    std::env::set_current_dir(&merged).map_err(|e| setup_err(format!("chdir {merged}"), e))?;
    mount(Some("."), "/", None::<&str>, MsFlags::MS_MOVE, None::<&str>)
        .map_err(|e| setup_err("move the new root over /", e))?;
    nix::unistd::chroot(".").map_err(|e| setup_err("chroot into the new root", e))?;
    std::env::set_current_dir("/").map_err(|e| setup_err("chdir /", e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cmdline_names_the_disks() {
        let c = "console=ttyS0 quiet dsec.root=/dev/vda dsec.upper=/dev/vdb panic=-1";
        assert_eq!(
            from_cmdline(c),
            Some(DiskRoot {
                root: "/dev/vda".into(),
                upper: Some("/dev/vdb".into())
            })
        );
        assert_eq!(
            from_cmdline("dsec.root=/dev/vdc"),
            Some(DiskRoot {
                root: "/dev/vdc".into(),
                upper: None
            })
        );
    }

    #[test]
    fn no_root_means_initramfs_root() {
        assert_eq!(from_cmdline("console=ttyS0 dsec.upper=/dev/vdb"), None);
        assert_eq!(from_cmdline("dsec.root= quiet"), None);
        assert_eq!(from_cmdline(""), None);
    }
}
