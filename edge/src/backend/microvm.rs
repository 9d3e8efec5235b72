//! The microVM backend: `dsec-vmm` (jailed when the edge runs as root) boots the guest
//! kernel with the agent in its initramfs; the agent answers on the VMM's vsock socket.
//! Create, restore from a snapshot, the writable upper disk of disk images and the jail.

use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use dsec_vmm_api::launch::Exposure;
use dsec_vmm_api::{DriveConfig, JailLaunch, RestoreLaunch, VmConfig, VmmLaunch};

use super::host::{HostResources, Runtime};
use super::{new_sandbox_id, BackendKind, EdgeConfig, Sandbox, SandboxSpec};
use crate::error::{EdgeError, Result};
use crate::kvm::KvmStatus;
use crate::microvm::{MicroVm, MicroVmDir, SpawnOptions};
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

    /// How the VMM of sandbox `id` jails itself: its snapshot directory is its one
    /// writable extra.
    fn launch(&self, id: &str, snapshot_dir: &Path) -> JailLaunch {
        let mut jail = JailLaunch::new(self.root(id), self.uid, self.gid);
        jail.expose.push(Exposure {
            path: snapshot_dir.to_path_buf(),
            writable: true,
        });
        jail
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
        check_drive_path(root)?;
    }
    let kvm = KvmStatus::detect();
    if let Some(reason) = kvm.why_not_microvm() {
        return Err(EdgeError::BackendUnavailable {
            backend: "microvm",
            reason: format!("{reason}; use --backend container (or auto)"),
        });
    }
    let vcpus = u8::try_from(spec.vcpus).map_err(|_| {
        EdgeError::InvalidSpec(format!(
            "{} vCPUs: a microVM takes at most {}",
            spec.vcpus,
            dsec_vmm_api::config::MAX_VCPUS
        ))
    })?;
    let options = spawn_options(config, spec)?;
    let id = spec
        .id
        .clone()
        .unwrap_or_else(|| new_sandbox_id(BackendKind::MicroVm));
    let host = HostResources::create(config, &id)?;
    let mut vm = VmConfig::new(&kernel);
    vm.initrd = Some(initrd);
    vm.cmdline = String::from("console=ttyS0 reboot=k panic=-1 quiet");
    vm.vcpus = vcpus;
    vm.mem_mib = u64::from(spec.mem_mib);
    if let Some(root) = &spec.root_disk {
        let upper = host.dir.join("upper.ext4");
        make_upper_disk(&upper, spec.disk_mib.unwrap_or(DEFAULT_UPPER_DISK_MIB)).await?;
        vm.drives = root_and_upper(root, upper);
        // Read by the agent from /proc/cmdline (dotted words never reach init's argv).
        vm.cmdline
            .push_str(" dsec.root=/dev/vda dsec.upper=/dev/vdb");
    }
    if let Some(extra) = &spec.extra_cmdline {
        vm.cmdline.push(' ');
        vm.cmdline.push_str(extra);
    }
    start(config, host, VmmLaunch::boot(vm), &options, id, spec).await
}

/// The image's read-only root disk and the sandbox's own writable upper disk.
fn root_and_upper(root: &Path, upper: PathBuf) -> Vec<DriveConfig> {
    vec![
        DriveConfig {
            path: root.to_path_buf(),
            read_only: true,
        },
        DriveConfig {
            path: upper,
            read_only: false,
        },
    ]
}

/// The VMM's `--drive PATH[,ro]` flag cannot carry a path with a comma.
fn check_drive_path(path: &Path) -> Result<()> {
    if path.as_os_str().as_bytes().contains(&b',') {
        return Err(EdgeError::InvalidSpec(format!(
            "disk path {} contains ',', which the VMM's --drive flag cannot take",
            path.display()
        )));
    }
    Ok(())
}

/// The `dsec-vmm` to run (the configured one, else found next to this executable, in
/// $DSEC_HOME/bin or PATH), joining the sandbox's cgroups before it runs.
fn spawn_options(config: &EdgeConfig, spec: &SandboxSpec) -> Result<SpawnOptions> {
    let mut options = SpawnOptions::find(config.vmm_bin.as_deref())?;
    options.cgroup_procs = spec.cgroup_procs.clone();
    Ok(options)
}

/// Jails the launch (when the edge jails its VMMs), starts the VMM of `host`'s sandbox and
/// waits until its agent answers; a restored guest is refreshed (entropy, clock) first. On
/// failure the VMM is killed and `host` frees the rest.
async fn start(
    config: &EdgeConfig,
    mut host: HostResources,
    mut launch: VmmLaunch,
    options: &SpawnOptions,
    id: String,
    spec: &SandboxSpec,
) -> Result<Sandbox> {
    if let Some(jail) = &config.jail {
        let snapshots = jail.snapshot_dir(&id)?;
        launch.jail = Some(jail.launch(&id, &snapshots));
        host.jail_root = Some(jail.root(&id));
        host.snapshot_dir = Some(snapshots);
    }
    let vm = MicroVm::spawn(options, &MicroVmDir::new(&host.dir), launch)?
        .ready(spec.ready_timeout)
        .await?;
    let client = vm.agent().clone();
    host.runtime = Runtime::MicroVm {
        vmm: vm.into_child(),
    };
    Ok(Sandbox {
        id,
        kind: BackendKind::MicroVm,
        client,
        host,
    })
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
    let options = spawn_options(config, spec)?;
    let host = HostResources::create(config, id)?;
    let mut restore = RestoreLaunch::new(snapshot);
    restore.overrides.vsock_cid = Some(vsock_cid);
    if let (Some(root), Some(upper)) = (&spec.root_disk, upper) {
        check_drive_path(root)?;
        let own = host.dir.join("upper.ext4");
        std::fs::rename(upper, &own).map_err(|e| {
            EdgeError::io(format!("move {} to {}", upper.display(), own.display()), e)
        })?;
        restore.overrides.drives = root_and_upper(root, own);
    }
    start(
        config,
        host,
        VmmLaunch::restore(restore),
        &options,
        id.to_string(),
        spec,
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jailed_vmms_get_a_private_snapshot_dir_exposed_writable() {
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
        let launch = jail.launch("vm-1", &dir);
        assert_eq!(launch.root, PathBuf::from("/run/dsec/jails/vm-1"));
        assert_eq!((launch.uid, launch.gid), (JAIL_UID, JAIL_GID));
        assert_eq!(
            launch.expose,
            [Exposure {
                path: dir.clone(),
                writable: true
            }]
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
