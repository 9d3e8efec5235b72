//! The microVM backend: `dsec-vmm` (jailed when the edge runs as root) boots the guest
//! kernel with the agent in its initramfs; the agent answers on the VMM's vsock socket.
//! Create, restore from a snapshot, the writable upper disk of disk images and the jail.

use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::host::{HostResources, Runtime};
use super::{new_sandbox_id, tail_of, BackendKind, EdgeConfig, Sandbox, SandboxSpec};
use crate::client::{AgentAddr, AgentClient};
use crate::error::{EdgeError, Result};
use crate::kvm::KvmStatus;
use crate::paths::find_binary;

/// How microVM sandboxes' VMMs are jailed: each runs in its own PID, mount, IPC, UTS and
/// network namespaces, pivot_rooted into `<roots>/<sandbox id>` (which holds only its kernel,
/// initrd, disks and socket directory), as `uid`:`gid` once its VM is built. The only place
/// it may write afterwards is its own snapshot directory `<snapshots>/<sandbox id>`.
#[derive(Clone, Debug)]
pub struct VmmJail {
    pub uid: u32,
    pub gid: u32,
    /// Parent of the per-sandbox snapshot directories.
    pub snapshots: PathBuf,
    /// Parent of the jail roots (outside the sandbox directories, which the jail exposes).
    pub roots: PathBuf,
}

/// The unprivileged uid/gid jailed VMMs run as (`nobody`).
pub const JAIL_UID: u32 = 65534;
pub const JAIL_GID: u32 = 65534;

impl VmmJail {
    /// The snapshot directory of sandbox `id`: made, owned by the jail's uid, private.
    fn snapshot_dir(&self, id: &str) -> Result<PathBuf> {
        use std::os::unix::fs::PermissionsExt;
        let dir = self.snapshots.join(id);
        std::fs::create_dir_all(&dir)
            .map_err(|e| EdgeError::io(format!("create {}", dir.display()), e))?;
        std::os::unix::fs::chown(&dir, Some(self.uid), Some(self.gid))
            .map_err(|e| EdgeError::io(format!("chown {} to the jail uid", dir.display()), e))?;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| EdgeError::io(format!("chmod {}", dir.display()), e))?;
        Ok(dir)
    }

    /// The jail root of sandbox `id`.
    pub fn root(&self, id: &str) -> PathBuf {
        self.roots.join(id)
    }

    /// `dsec-vmm` arguments that jail it, with the snapshot directory as its one writable
    /// extra.
    fn args(&self, id: &str, snapshot_dir: &Path) -> Vec<std::ffi::OsString> {
        let mut expose = snapshot_dir.as_os_str().to_owned();
        expose.push(",rw");
        vec![
            "--jail".into(),
            self.root(id).into_os_string(),
            "--jail-uid".into(),
            self.uid.to_string().into(),
            "--jail-gid".into(),
            self.gid.to_string().into(),
            "--jail-expose".into(),
            expose,
        ]
    }
}

pub(super) async fn create(config: &EdgeConfig, spec: &SandboxSpec) -> Result<Sandbox> {
    let kernel = spec
        .kernel
        .clone()
        .unwrap_or_else(|| config.artifacts.kernel.clone());
    let initrd = spec
        .initrd
        .clone()
        .unwrap_or_else(|| config.artifacts.initramfs.clone());
    if !kernel.is_file() {
        return Err(EdgeError::MissingArtifact {
            what: "guest kernel",
            path: kernel,
            hint: "build it with guest-kernel/build.sh, or pass --kernel",
        });
    }
    if !initrd.is_file() {
        return Err(EdgeError::MissingArtifact {
            what: "initramfs",
            path: initrd,
            hint: "build it with `guest-agent/mkinitramfs.sh --install`, or pass --initrd",
        });
    }
    if let Some(root) = &spec.root_disk {
        if !root.is_file() {
            return Err(EdgeError::MissingArtifact {
                what: "root disk image",
                path: root.clone(),
                hint: "build it with `images/debian/build.sh --install` (./setup.sh runs it)",
            });
        }
        if root.as_os_str().as_bytes().contains(&b',') {
            return Err(EdgeError::InvalidSpec(format!(
                "root disk path {} contains ',', which the VMM's --drive flag cannot take",
                root.display()
            )));
        }
    }
    let kvm = KvmStatus::detect();
    if let Some(reason) = kvm.why_not_microvm() {
        return Err(EdgeError::BackendUnavailable {
            backend: "microvm",
            reason: format!("{reason}; use --backend container (or auto)"),
        });
    }
    let vmm_bin = vmm_binary(config)?;
    let id = spec
        .id
        .clone()
        .unwrap_or_else(|| new_sandbox_id(BackendKind::MicroVm));
    let host = HostResources::create(config, &id)?;
    let dir = host.dir.clone();
    let vsock = dir.join("vsock.sock");
    let serial = dir.join("serial.log");
    let api_sock = dir.join("api.sock");
    let mut cmdline = String::from("console=ttyS0 reboot=k panic=-1 quiet");
    let mut drives = Vec::new();
    if let Some(root) = &spec.root_disk {
        let upper = dir.join("upper.ext4");
        let mib = spec.disk_mib.unwrap_or(DEFAULT_UPPER_DISK_MIB);
        make_upper_disk(&upper, mib).await?;
        let mut ro = root.clone().into_os_string();
        ro.push(",ro");
        drives.push(ro);
        drives.push(upper.into_os_string());
        // Read by the agent from /proc/cmdline (dotted words never reach init's argv).
        cmdline.push_str(" dsec.root=/dev/vda dsec.upper=/dev/vdb");
    }
    if let Some(extra) = &spec.extra_cmdline {
        cmdline.push(' ');
        cmdline.push_str(extra);
    }
    let mut command = tokio::process::Command::new(&vmm_bin);
    command
        .arg("--kernel")
        .arg(&kernel)
        .arg("--initrd")
        .arg(&initrd)
        .arg("--cmdline")
        .arg(&cmdline)
        .arg("--vcpus")
        .arg(spec.vcpus.to_string())
        .arg("--mem-mib")
        .arg(spec.mem_mib.to_string())
        .arg("--vsock-uds")
        .arg(&vsock)
        .arg("--serial-log")
        .arg(&serial)
        .arg("--api-sock")
        .arg(&api_sock);
    for drive in &drives {
        command.arg("--drive").arg(drive);
    }
    launch(config, host, command, &vmm_bin, id, spec).await
}

/// The `dsec-vmm` to run: the configured one, else found next to this executable, in
/// $DSEC_HOME/bin or PATH.
fn vmm_binary(config: &EdgeConfig) -> Result<PathBuf> {
    match &config.vmm_bin {
        Some(path) => Ok(path.clone()),
        None => find_binary("dsec-vmm").ok_or(EdgeError::MissingBinary {
            what: "VMM",
            name: "dsec-vmm",
            hint: "build it with `cargo build --release -p dsec-vmm`",
        }),
    }
}

/// Jails (when the edge jails its VMMs) and starts the VMM of `host`'s sandbox, logging to
/// `vmm.log` in its directory, then waits until its agent answers.
async fn launch(
    config: &EdgeConfig,
    mut host: HostResources,
    mut command: tokio::process::Command,
    vmm_bin: &Path,
    id: String,
    spec: &SandboxSpec,
) -> Result<Sandbox> {
    let vmm_log = host.dir.join("vmm.log");
    let log = std::fs::File::create(&vmm_log)
        .map_err(|e| EdgeError::io(format!("create {}", vmm_log.display()), e))?;
    let log_err = log
        .try_clone()
        .map_err(|e| EdgeError::io("dup log fd", e))?;
    host.snapshot_dir = jail_vmm(config, &mut command, &id)?;
    command
        .stdin(std::process::Stdio::null())
        .stdout(log)
        .stderr(log_err);
    let vmm = spawn_vmm(command, &spec.cgroup_procs)
        .map_err(|e| EdgeError::io(format!("start {}", vmm_bin.display()), e))?;
    host.runtime = Runtime::MicroVm { vmm };
    host.jail_root = host
        .snapshot_dir
        .as_ref()
        .and(config.jail.as_ref())
        .map(|j| j.root(&id));
    wait_microvm_ready(id, host, spec.ready_timeout).await
}

/// Size of a microVM's writable upper disk when the spec gives none.
pub const DEFAULT_UPPER_DISK_MIB: u32 = 1024;

/// Creates a sparse file of `mib` MiB holding an empty ext4 (no journal: the disk lives and
/// dies with the sandbox; lazy init: only metadata blocks get written).
async fn make_upper_disk(path: &Path, mib: u32) -> Result<()> {
    if mib < 16 {
        return Err(EdgeError::InvalidSpec(format!(
            "a {mib} MiB disk is too small for a root overlay: use at least 16 MiB"
        )));
    }
    let file = std::fs::File::create(path)
        .map_err(|e| EdgeError::io(format!("create {}", path.display()), e))?;
    file.set_len(u64::from(mib) << 20)
        .map_err(|e| EdgeError::io(format!("size {} to {mib} MiB", path.display()), e))?;
    drop(file);
    // sbin is often not on a non-root PATH.
    let mkfs = find_binary("mkfs.ext4")
        .or_else(|| {
            ["/usr/sbin/mkfs.ext4", "/sbin/mkfs.ext4"]
                .into_iter()
                .map(PathBuf::from)
                .find(|p| p.is_file())
        })
        .unwrap_or_else(|| PathBuf::from("mkfs.ext4"));
    let output = tokio::process::Command::new(mkfs)
        .args([
            "-q",
            "-F",
            "-m",
            "0",
            "-L",
            "dsec-upper",
            "-O",
            "^has_journal",
        ])
        .args(["-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard"])
        .arg(path)
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .map_err(|e| EdgeError::FormatDisk {
            path: path.to_path_buf(),
            detail: format!("cannot run mkfs.ext4: {e}"),
        })?;
    if !output.status.success() {
        return Err(EdgeError::FormatDisk {
            path: path.to_path_buf(),
            detail: format!(
                "{}: {}",
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            ),
        });
    }
    Ok(())
}

async fn wait_microvm_ready(
    id: String,
    mut host: HostResources,
    ready_timeout: Duration,
) -> Result<Sandbox> {
    let kind = BackendKind::MicroVm;
    let vsock = host.dir.join("vsock.sock");
    let serial = host.dir.join("serial.log");
    let vmm_log = host.dir.join("vmm.log");
    let deadline = Instant::now() + ready_timeout;
    let addr = AgentAddr::VsockUds {
        uds: vsock.clone(),
        port: dsec_api::AGENT_VSOCK_PORT,
    };
    loop {
        if let Runtime::MicroVm { vmm } = &mut host.runtime {
            if let Ok(Some(status)) = vmm.try_wait() {
                host.runtime = Runtime::Gone;
                let detail = format!(
                    " (VMM exited: {status}){}{}",
                    tail_of(&vmm_log, "VMM log"),
                    tail_of(&serial, "serial console")
                );
                return Err(EdgeError::SandboxDied { id, detail });
            }
        }
        if vsock.exists() {
            // Bound the whole attempt: before the guest's vsock driver is up the VMM accepts
            // the connection but cannot answer the handshake yet, and a handshake that is
            // never answered must turn into a retry, not a hang.
            let attempt = tokio::time::timeout(Duration::from_secs(5), async {
                let client = AgentClient::connect(addr.clone()).await?;
                client.info().await.map(|_| client)
            });
            if let Ok(Ok(client)) = attempt.await {
                return Ok(Sandbox {
                    id,
                    kind,
                    client,
                    host,
                });
            }
        }
        if Instant::now() > deadline {
            return Err(EdgeError::AgentNotReady {
                id,
                timeout: ready_timeout,
                detail: tail_of(&serial, "serial console"),
            });
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Starts a VMM in its own session (it must outlive a daemon that is killed) and moves it
/// into the given cgroups. Teardown (not drop) kills it.
/// Adds the jail arguments when the edge jails its VMMs; returns the sandbox's snapshot
/// directory then.
fn jail_vmm(
    config: &EdgeConfig,
    command: &mut tokio::process::Command,
    id: &str,
) -> Result<Option<PathBuf>> {
    let Some(jail) = &config.jail else {
        return Ok(None);
    };
    let snapshots = jail.snapshot_dir(id)?;
    command.args(jail.args(id, &snapshots));
    Ok(Some(snapshots))
}

fn spawn_vmm(
    mut command: tokio::process::Command,
    cgroup_procs: &[PathBuf],
) -> std::io::Result<tokio::process::Child> {
    use std::os::fd::AsRawFd;
    // Opened here, written by the child before exec: the VMM is in its cgroups before it
    // runs, so a jailed VMM's forked child cannot start outside them.
    let procs = cgroup_procs
        .iter()
        .map(|p| {
            std::fs::OpenOptions::new()
                .write(true)
                .open(p)
                .map_err(|e| std::io::Error::new(e.kind(), format!("open {}: {e}", p.display())))
        })
        .collect::<std::io::Result<Vec<_>>>()?;
    let fds: Vec<i32> = procs.iter().map(|f| f.as_raw_fd()).collect();
    // SAFETY: setsid and write are async-signal-safe; the closure only reads `fds` (copied
    // into it) and a static byte string.
    unsafe {
        command.pre_exec(move || {
            nix::unistd::setsid().map_err(std::io::Error::from)?;
            for fd in &fds {
                // "0" moves the writing process (this child) into the cgroup.
                if libc::write(*fd, b"0".as_ptr().cast(), 1) != 1 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    let child = command.spawn();
    drop(procs);
    child
}

/// Restores a microVM from a snapshot directory written by the VMM (`{"op":"snapshot"}`),
/// with its own vsock socket and context id, and waits until its agent answers. A sandbox on
/// a disk image gets `upper`, its own copy of the parent's upper disk (moved into its
/// directory), in place of the disk the snapshot names.
pub async fn restore_microvm(
    config: &EdgeConfig,
    snapshot: &Path,
    id: &str,
    vsock_cid: u64,
    spec: &SandboxSpec,
    upper: Option<&Path>,
) -> Result<Sandbox> {
    let vmm_bin = vmm_binary(config)?;
    let host = HostResources::create(config, id)?;
    let dir = host.dir.clone();
    let vsock = dir.join("vsock.sock");
    let serial = dir.join("serial.log");
    let mut command = tokio::process::Command::new(&vmm_bin);
    command
        .arg("--restore")
        .arg(snapshot)
        .arg("--vsock-uds")
        .arg(&vsock)
        .arg("--vsock-cid")
        .arg(vsock_cid.to_string())
        .arg("--serial-log")
        .arg(&serial)
        .arg("--api-sock")
        .arg(dir.join("api.sock"));
    if let (Some(root), Some(upper)) = (&spec.root_disk, upper) {
        let own = dir.join("upper.ext4");
        std::fs::rename(upper, &own).map_err(|e| {
            EdgeError::io(format!("move {} to {}", upper.display(), own.display()), e)
        })?;
        let mut ro = root.clone().into_os_string();
        ro.push(",ro");
        command.arg("--drive").arg(ro).arg("--drive").arg(own);
    }
    launch(config, host, command, &vmm_bin, id.to_string(), spec).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jailed_vmms_get_a_private_snapshot_dir_and_the_jail_flags() {
        use std::os::unix::fs::MetadataExt;
        if !nix::unistd::geteuid().is_root() {
            panic!("this test needs root (chown to the jail uid)");
        }
        let base = std::env::temp_dir().join(format!("dsec-jail-test-{}", std::process::id()));
        let jail = VmmJail {
            uid: JAIL_UID,
            gid: JAIL_GID,
            snapshots: base.join("snapshots"),
            roots: PathBuf::from("/run/dsec/jails"),
        };
        let dir = jail.snapshot_dir("vm-1").unwrap();
        let meta = std::fs::metadata(&dir).unwrap();
        assert_eq!(
            (meta.uid(), meta.gid(), meta.mode() & 0o777),
            (JAIL_UID, JAIL_GID, 0o700)
        );
        let args: Vec<String> = jail
            .args("vm-1", &dir)
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            args,
            [
                "--jail",
                "/run/dsec/jails/vm-1",
                "--jail-uid",
                "65534",
                "--jail-gid",
                "65534",
                "--jail-expose",
                &format!("{},rw", dir.display()),
            ]
        );
        std::fs::remove_dir_all(&base).unwrap();
    }

    #[tokio::test]
    async fn upper_disk_is_a_sparse_ext4_of_the_asked_size() {
        let dir = std::env::temp_dir().join(format!("dsec-upper-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("upper.ext4");
        let made = make_upper_disk(&path, 256).await;
        let meta = std::fs::metadata(&path);
        let mut superblock = [0u8; 2048];
        let read = std::fs::File::open(&path).and_then(|mut f| {
            use std::io::Read;
            f.read_exact(&mut superblock)
        });
        let too_small = make_upper_disk(&dir.join("tiny.ext4"), 8).await;
        let _ = std::fs::remove_dir_all(&dir);
        made.unwrap();
        read.unwrap();
        let meta = meta.unwrap();
        assert_eq!(meta.len(), 256 << 20);
        use std::os::unix::fs::MetadataExt;
        // Lazy init writes only metadata: a small part of the size is allocated.
        assert!(
            meta.blocks() * 512 < 32 << 20,
            "{} bytes allocated",
            meta.blocks() * 512
        );
        // ext4 superblock magic at byte 1024 + 0x38.
        assert_eq!(&superblock[1080..1082], &[0x53, 0xef]);
        let err = too_small.unwrap_err().to_string();
        assert!(err.contains("too small"), "{err}");
    }
}
