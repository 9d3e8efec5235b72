//! The microVM backend: `dsec-vmm` (jailed when the edge runs as root) boots the guest
//! kernel with the agent in its initramfs; the agent answers on the VMM's vsock socket.
//! Create, restore from a snapshot, the writable upper disk of disk images and the jail.

use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use dsec_vmm_api::launch::Exposure;
use dsec_vmm_api::launch::LazyLaunch;
use dsec_vmm_api::{DriveConfig, JailLaunch, RestoreLaunch, VmConfig, VmmLaunch};

use super::host::{HostResources, Runtime, SandboxHandle};
use super::vmm_pool::{PooledVmm, Refill, Shape};
use super::{new_sandbox_id, BackendKind, EdgeConfig, Sandbox, SandboxSpec};
use crate::error::{EdgeError, Result};
use crate::kvm::KvmStatus;
use crate::microvm::{MicroVm, MicroVmDir, SpawnOptions, StartingMicroVm};
use crate::paths::find_binary;
use dsec_vmm_api::control::RestoreRequest;

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
/// In a snapshot over a memory base: the directory holding that base (the snapshot's
/// recorded parent, relative to it).
pub const SNAPSHOT_BASE_DIR: &str = "base";

impl VmmJail {
    /// The snapshot directory of sandbox `id`: made, owned by the jail's uid, private.
    pub(super) fn snapshot_dir(&self, id: &str) -> Result<PathBuf> {
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
    pub(super) fn launch(&self, id: &str, snapshot_dir: &Path) -> JailLaunch {
        let mut jail = JailLaunch::new(self.root(id), self.uid, self.gid);
        jail.expose.push(Exposure {
            path: snapshot_dir.to_path_buf(),
            writable: true,
        });
        jail
    }
}

/// What a microVM of a spec boots: its checked files and shape. The template key of the
/// node's template snapshots is made of exactly these (plus the VMM binary).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MicroVmImage {
    pub kernel: PathBuf,
    pub initrd: PathBuf,
    pub root_disk: Option<PathBuf>,
    /// Size of the writable upper disk (disk images only).
    pub upper_mib: Option<u32>,
    pub vcpus: u8,
    pub mem_mib: u64,
    pub cmdline: String,
    /// A virtio-net device (the node has a sandbox network): its template snapshot has
    /// one, so restored sandboxes get their own tap for it.
    pub network_device: bool,
}

impl MicroVmImage {
    /// Checks that `spec`'s kernel, initramfs and root disk exist and that microVMs can run
    /// here.
    pub fn of(config: &EdgeConfig, spec: &SandboxSpec) -> Result<Self> {
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
        let mut cmdline = String::from("console=ttyS0 reboot=k panic=-1 quiet");
        if spec.root_disk.is_some() {
            // Read by the agent from /proc/cmdline (dotted words never reach init's argv).
            cmdline.push_str(" dsec.root=/dev/vda dsec.upper=/dev/vdb");
        }
        if let Some(extra) = &spec.extra_cmdline {
            cmdline.push(' ');
            cmdline.push_str(extra);
        }
        Ok(MicroVmImage {
            kernel,
            initrd,
            upper_mib: spec
                .root_disk
                .is_some()
                .then(|| spec.disk_mib.unwrap_or(DEFAULT_UPPER_DISK_MIB)),
            root_disk: spec.root_disk.clone(),
            vcpus,
            mem_mib: u64::from(spec.mem_mib),
            cmdline,
            network_device: config.network.is_some() && config.jail.is_some(),
        })
    }

    /// Makes the upper disk (disk images) in `dir` and the VM's configuration.
    async fn boot_config(&self, dir: &Path) -> Result<VmConfig> {
        let mut vm = VmConfig::new(&self.kernel);
        vm.initrd = Some(self.initrd.clone());
        vm.cmdline = self.cmdline.clone();
        vm.vcpus = self.vcpus;
        vm.mem_mib = self.mem_mib;
        if let (Some(root), Some(mib)) = (&self.root_disk, self.upper_mib) {
            let upper = dir.join("upper.ext4");
            make_upper_disk(&upper, mib).await?;
            vm.drives = root_and_upper(root, upper);
        }
        Ok(vm)
    }
}

pub(super) async fn create(config: &EdgeConfig, spec: &SandboxSpec) -> Result<Sandbox> {
    let image = MicroVmImage::of(config, spec)?;
    let options = spawn_options(config, spec)?;
    let id = spec
        .id
        .clone()
        .unwrap_or_else(|| new_sandbox_id(BackendKind::MicroVm));
    let host = HostResources::create(config, &id)?;
    let mut vm = image.boot_config(&host.dir).await?;
    let tap = crate::net::prepare_microvm(config, &host.dir, &spec.network_policy).await?;
    vm.net = tap.as_ref().map(crate::net::restore_override);
    let sandbox = start(config, host, VmmLaunch::boot(vm), &options, id, spec).await?;
    if let Some(tap) = &tap {
        crate::net::attach_microvm(config, tap, &sandbox.client).await?;
    }
    Ok(sandbox)
}

/// Boots `image` once as `id` (a scratch sandbox without cgroups), snapshots it paused at
/// agent-ready and moves the snapshot to `<out>/snapshot` and, on a disk image, its upper
/// disk to `<out>/upper.ext4`. The VMM is gone afterwards; `out` must exist.
pub async fn build_template(
    config: &EdgeConfig,
    spec: &SandboxSpec,
    id: &str,
    out: &Path,
) -> Result<()> {
    let image = MicroVmImage::of(config, spec)?;
    let options = SpawnOptions::find(config.vmm_bin.as_deref())?;
    let host = HostResources::create(config, id)?;
    let mut vm = image.boot_config(&host.dir).await?;
    vm.net = image.network_device.then(crate::net::template_net_device);
    let mut sandbox = start(
        config,
        host,
        VmmLaunch::boot(vm),
        &options,
        id.to_string(),
        spec,
    )
    .await?;
    warm_up(&sandbox.client, id).await;
    let host = &mut sandbox.host;
    let snapshot = host
        .snapshot_dir
        .clone()
        .unwrap_or_else(|| host.dir.clone())
        .join("template");
    // Paused, and never resumed: the guest must not write its disk after the snapshot.
    let control = MicroVmDir::new(&host.dir).control();
    crate::microvm::control_call::<dsec_vmm_api::control::Done>(
        control.clone(),
        dsec_vmm_api::Request::Pause,
    )
    .await?;
    crate::microvm::control_call::<dsec_vmm_api::control::SnapshotReply>(
        control,
        dsec_vmm_api::Request::Snapshot {
            path: snapshot.clone(),
            diff: false,
            base: None,
        },
    )
    .await?;
    let (dir, out, vm_has_net) = (host.dir.clone(), out.to_path_buf(), image.network_device);
    tokio::task::spawn_blocking(move || -> Result<()> {
        let rename = |from: &Path, to: &Path| {
            std::fs::rename(from, to).map_err(|e| {
                EdgeError::io(format!("move {} to {}", from.display(), to.display()), e)
            })
        };
        if vm_has_net {
            crate::net::mark_snapshot_net_device(&snapshot)?;
        }
        rename(&snapshot, &out.join("snapshot"))?;
        let upper = dir.join("upper.ext4");
        if upper.exists() {
            rename(&upper, &out.join("upper.ext4"))?;
        }
        Ok(())
    })
    .await
    .map_err(|e| EdgeError::Protocol(format!("template move task failed: {e}")))??;
    // Dropping the sandbox kills the VMM and removes its directory.
    drop(sandbox);
    Ok(())
}

/// After the warm-up, before the snapshot: the guest finishes what the exec and its boot left
/// running (a restore of a busy guest made its first refresh up to twice as slow as a
/// resumed idle one's in the rig).
const TEMPLATE_SETTLE_MS: u64 = 2000;

/// Runs the agent's paths that every template-created sandbox runs first, once, before the
/// template is snapshotted: a refresh (entropy, clock) and an exec. Each sandbox then starts
/// with their code and data already in guest memory, as a resumed sandbox does, instead of
/// faulting them in on its first calls (in the rig, through nested paging and L1's code
/// translation: most of a template create's first exec). Best effort: an image without
/// `true` only loses the warm start.
async fn warm_up(agent: &crate::AgentClient, id: &str) {
    let entropy = crate::microvm::host_entropy(64).unwrap_or_else(|e| {
        tracing::warn!(template = %id, "no host entropy for the warm-up refresh: {e}");
        Vec::new()
    });
    let refreshed = agent
        .refresh_identity(entropy, crate::GuestIdentity::default())
        .await;
    let spec = crate::ExecSpec {
        timeout: Some(std::time::Duration::from_secs(30)),
        ..crate::ExecSpec::new(["true"])
    };
    let exec = agent.exec_collect(&spec, None).await;
    if let Err(e) = refreshed.as_ref().map(drop).and(exec.as_ref().map(drop)) {
        tracing::warn!(template = %id, "the template's warm-up failed (its sandboxes start colder): {e}");
    }
    tokio::time::sleep(std::time::Duration::from_millis(TEMPLATE_SETTLE_MS)).await;
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
        let mut jailed = jail.launch(&id, &snapshots);
        jailed.netns = crate::net::jail_netns(&host.dir);
        launch.jail = Some(jailed);
        host.jail_root = Some(jail.root(&id));
        host.snapshot_dir = Some(snapshots);
    }
    let vm = MicroVm::spawn(options, &MicroVmDir::new(&host.dir), launch)?
        .with_hostname(&id)
        .with_env(spec.guest_env.clone());
    finish(host, vm, id, spec).await
}

/// Waits until the started VMM's agent answers and hands the sandbox out.
async fn finish(
    mut host: HostResources,
    vm: StartingMicroVm,
    id: String,
    spec: &SandboxSpec,
) -> Result<Sandbox> {
    let vm = vm.ready(spec.ready_timeout).await?;
    let client = vm.agent().clone();
    let env_in_guest = vm.env_in_guest();
    host.runtime = Runtime::MicroVm {
        vmm: vm.into_child(),
    };
    Ok(Sandbox {
        id,
        kind: BackendKind::MicroVm,
        client,
        host,
        env_in_guest,
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

/// Where a restored sandbox's own upper disk comes from (disk images).
#[derive(Clone, Copy, Debug)]
pub enum UpperDisk<'a> {
    /// A copy made for it (a fork child's), moved into its directory.
    Move(&'a Path),
    /// A template's disk, copied (holes kept) into its directory.
    Copy(&'a Path),
}

/// How guest memory comes back from a snapshot's memory file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemoryRestore {
    /// MAP_PRIVATE over the file: pages come from the page cache on first touch, shared by
    /// every VM restored from the same file until written.
    Private,
    /// userfaultfd: the VMM fills pages as they fault, prefetching the recorded working set.
    Lazy,
}

impl MemoryRestore {
    fn lazy_launch(self) -> Option<LazyLaunch> {
        (self == MemoryRestore::Lazy).then_some(LazyLaunch {
            prefetch: true,
            record_working_set_ms: None,
        })
    }
}

/// Restores a microVM from a snapshot directory written by the VMM (`{"op":"snapshot"}`),
/// with its own vsock socket and context id, and waits until its agent answers (refreshed:
/// entropy, clock). A sandbox on a disk image gets its own upper disk in place of the disk
/// the snapshot names.
pub async fn restore_microvm(
    config: &EdgeConfig,
    snapshot: &Path,
    id: &str,
    vsock_cid: u64,
    spec: &SandboxSpec,
    upper: Option<UpperDisk<'_>>,
    memory: MemoryRestore,
) -> Result<Sandbox> {
    let options = spawn_options(config, spec)?;
    // A snapshot with a network device needs its tap in the VMM's own namespace, which a
    // pooled VMM (started before the sandbox existed) does not have.
    if upper.is_none()
        && spec.root_disk.is_none()
        && spec.network_policy.is_empty()
        && !crate::net::snapshot_has_net_device(snapshot)
    {
        if let Some(pooled) = config.vmm_pool.as_ref().and_then(|pool| {
            pool.take(Shape {
                mem_mib: u64::from(spec.mem_mib),
                vcpus: u8::try_from(spec.vcpus).ok()?,
            })
        }) {
            let name = pooled.name.clone();
            match start_pooled(config, pooled, snapshot, id, vsock_cid, spec, memory).await {
                Ok((host, vm, refill)) => {
                    let sandbox = finish(host, vm, id.to_string(), spec).await;
                    drop(refill);
                    return sandbox;
                }
                Err(err) => tracing::warn!(
                    sandbox = %id,
                    vmm = %name,
                    %err,
                    "a prewarmed VMM could not restore the snapshot; starting a fresh VMM"
                ),
            }
        }
    }
    let host = HostResources::create(config, id)?;
    let mut restore = RestoreLaunch::new(snapshot);
    restore.lazy = memory.lazy_launch();
    restore.overrides.vsock_cid = Some(vsock_cid);
    // A VMM (whose guest may have taken it over) wrote this snapshot and its state: a parent
    // it named outside the snapshot would be read, and exposed in the jail, for this VM.
    restore.overrides.contained_chain = true;
    if let (Some(root), Some(upper)) = (&spec.root_disk, upper) {
        check_drive_path(root)?;
        let own = host.dir.join("upper.ext4");
        match upper {
            UpperDisk::Move(from) => std::fs::rename(from, &own).map_err(|e| {
                EdgeError::io(format!("move {} to {}", from.display(), own.display()), e)
            })?,
            UpperDisk::Copy(from) => {
                let (from, to) = (from.to_path_buf(), own.clone());
                tokio::task::spawn_blocking(move || copy_sparse(&from, &to))
                    .await
                    .map_err(|e| EdgeError::Protocol(format!("disk copy task failed: {e}")))?
                    .map_err(|e| {
                        EdgeError::io(format!("copy the upper disk to {}", own.display()), e)
                    })?
            }
        }
        restore.overrides.drives = root_and_upper(root, own);
    }
    let tap = crate::net::prepare_restore(config, &host.dir, snapshot, spec).await?;
    restore.overrides.net = tap.as_ref().map(crate::net::restore_override);
    let sandbox = start(
        config,
        host,
        VmmLaunch::restore(restore),
        &options,
        id.to_string(),
        spec,
    )
    .await?;
    if let Some(tap) = &tap {
        crate::net::attach_microvm(config, tap, &sandbox.client).await?;
    }
    Ok(sandbox)
}

/// The first half of [`restore_microvm`] in a prewarmed VMM of the pool (vmm_pool.rs says
/// how its jail gets the snapshot): into the sandbox's cgroups, its directory renamed to the
/// sandbox's, the snapshot linked in, the restore request answered. The agent wait and
/// refresh are [`finish`]'s, as for any restore.
async fn start_pooled(
    config: &EdgeConfig,
    mut pooled: PooledVmm,
    snapshot: &Path,
    id: &str,
    vsock_cid: u64,
    spec: &SandboxSpec,
    memory: MemoryRestore,
) -> Result<(HostResources, StartingMicroVm, Option<Refill>)> {
    let started = std::time::Instant::now();
    let refill = pooled.refill.take();
    let taken = scopeguard_inbox(&pooled);
    pooled.vm.renice(0)?;
    pooled.vm.join_cgroups(&spec.cgroup_procs)?;
    let path = pooled.link_snapshot(snapshot)?;
    let dir = config.state_dir.join(id);
    rename_no_replace(pooled.vm.dir().path(), &dir).map_err(|e| {
        EdgeError::io(
            format!("move the prewarmed VMM's directory to {}", dir.display()),
            e,
        )
    })?;
    // From here the guard owns the VMM's files: a failure removes them all.
    let host = HostResources::taken_over(dir.clone(), pooled.snapshot_dir, pooled.jail_root);
    let mut vm = pooled
        .vm
        .relocated(MicroVmDir::new(&dir))
        .with_hostname(id)
        .with_env(spec.guest_env.clone());
    let request = RestoreRequest {
        path,
        vsock_cid: Some(vsock_cid),
        lazy: memory == MemoryRestore::Lazy,
        prefetch: memory == MemoryRestore::Lazy,
        ..RestoreRequest::default()
    };
    let handover = started.elapsed();
    let reply = vm.restore(request, spec.ready_timeout).await;
    drop(taken);
    let reply = reply?;
    tracing::info!(
        sandbox = %id,
        vmm = %pooled.name,
        handover_ms = handover.as_millis() as u64,
        request_ms = (started.elapsed() - handover).as_millis() as u64,
        restore_ms = reply.restore_ms,
        steps = %restore_steps(&reply.steps),
        "restored into a prewarmed VMM"
    );
    Ok((host, vm, refill))
}

/// The VMM's restore steps for a log line: `state=0.4 memory=12.0 ...` (ms).
fn restore_steps(steps: &dsec_vmm_api::control::RestoreSteps) -> String {
    format!(
        "state={:.1} memory={:.1} irqchip_clock={:.1} devices={:.1} vcpus={:.1} finish={:.1}",
        steps.state_ms,
        steps.memory_ms,
        steps.irqchip_clock_ms,
        steps.devices_ms,
        steps.vcpus_ms,
        steps.finish_ms
    )
}

/// rename(2) that fails rather than replace an existing (empty) directory.
fn rename_no_replace(from: &Path, to: &Path) -> std::io::Result<()> {
    rename_flags(from, to, libc::RENAME_NOREPLACE)
}

/// renameat2(2) of two absolute paths with `flags`.
fn rename_flags(from: &Path, to: &Path, flags: libc::c_uint) -> std::io::Result<()> {
    let c =
        |p: &Path| std::ffi::CString::new(p.as_os_str().as_bytes()).map_err(std::io::Error::other);
    let (from, to) = (c(from)?, c(to)?);
    // SAFETY: two NUL-terminated paths that outlive the call; absolute, so the dirfds are
    // not used.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            from.as_ptr(),
            libc::AT_FDCWD,
            to.as_ptr(),
            flags,
        )
    };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Removes a taken VMM's inbox (the links to the snapshot) when dropped: once the VMM has
/// answered the restore it holds what it mapped, and on failure nothing needs them.
fn scopeguard_inbox(pooled: &PooledVmm) -> InboxLinks {
    InboxLinks(pooled.inbox.clone())
}

struct InboxLinks(PathBuf);

impl Drop for InboxLinks {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A resumed sandbox's new VMM: its pid, its refreshed agent and, when a prewarmed VMM of
/// the pool took it, the jail paths that VMM brought (its snapshot directory and jail root,
/// which the record keeps from now on).
pub struct Resumed {
    pub pid: u32,
    pub agent: crate::AgentClient,
    pub pooled_jail: Option<(PathBuf, PathBuf)>,
}

/// Brings back a sandbox whose VMM was ended after a snapshot (pause that frees memory):
/// a restore of `snapshot` (MAP_PRIVATE: pages come in as the guest touches them; in the rig
/// it reached the first exec 2-3x sooner than userfaultfd) in its own directory, so it keeps its id, vsock socket,
/// context id and disks, jailed like before and in `cgroup_procs`. A prewarmed VMM of the
/// pool takes it when there is one of `shape` (a jailed sandbox without disk image or
/// network), else a fresh VMM starts. On failure nothing runs and the snapshot is untouched.
pub async fn resume_microvm(
    config: &EdgeConfig,
    handle: &SandboxHandle,
    snapshot: &Path,
    cgroup_procs: Vec<PathBuf>,
    shape: Shape,
    timeout: std::time::Duration,
) -> Result<Resumed> {
    let dir = MicroVmDir::new(&handle.dir);
    let poolable = handle.snapshot_dir.is_some()
        && !handle.dir.join("upper.ext4").exists()
        && crate::net::jail_netns(&handle.dir).is_none()
        && crate::net::address(&handle.dir).is_none();
    if let Some(pooled) = config
        .vmm_pool
        .as_ref()
        .filter(|_| poolable)
        .and_then(|pool| pool.take(shape))
    {
        let name = pooled.name.clone();
        match resume_pooled(pooled, handle, snapshot, &cgroup_procs, timeout).await {
            Ok(resumed) => return Ok(resumed),
            Err(err) => tracing::warn!(
                sandbox = %handle.id,
                vmm = %name,
                %err,
                "a prewarmed VMM could not resume the sandbox; starting a fresh VMM"
            ),
        }
    }
    let mut options = SpawnOptions::find(config.vmm_bin.as_deref())?;
    options.cgroup_procs = cgroup_procs;
    // A networked sandbox's tap went with its ended VMM: a new one for the same address.
    let tap = crate::net::prepare_resume(config, &handle.dir).await?;
    let mut restore = RestoreLaunch::new(snapshot);
    restore.overrides.net = tap.as_ref().map(crate::net::restore_override);
    // See restore_microvm: only the snapshot's own base may be its parent.
    restore.overrides.contained_chain = true;
    let mut launch = VmmLaunch::restore(restore);
    if let (Some(jail), Some(snapshots)) = (&config.jail, &handle.snapshot_dir) {
        let mut jailed = jail.launch(&handle.id, snapshots);
        jailed.netns = tap.as_ref().map(|t| t.netns.clone());
        // A sandbox once taken by a pooled VMM keeps that VMM's jail root in its record.
        if let Some(root) = &handle.jail_root {
            jailed.root = root.clone();
        }
        launch.jail = Some(jailed);
    }
    keep_ended_logs(&handle.dir).map_err(|e| {
        EdgeError::io(
            format!("keep the ended VMM's logs in {}", handle.dir.display()),
            e,
        )
    })?;
    // The ended VMM's sockets: the wait must not find the old vsock path.
    let _ = std::fs::remove_file(dir.vsock());
    let _ = std::fs::remove_file(dir.api_sock());
    let started = match MicroVm::spawn(&options, &dir, launch) {
        Ok(vm) => vm.with_hostname(&handle.id).ready(timeout).await,
        Err(err) => Err(err),
    };
    let vm = match (started, &tap) {
        (Ok(vm), Some(tap)) => match crate::net::attach_microvm(config, tap, vm.agent()).await {
            Ok(()) => vm,
            Err(err) => {
                crate::net::abandon_tap(tap);
                return Err(err);
            }
        },
        (Ok(vm), None) => vm,
        (Err(err), tap) => {
            tap.iter().for_each(crate::net::abandon_tap);
            return Err(err);
        }
    };
    let agent = vm.agent().clone();
    Ok(Resumed {
        pid: vm.detach(),
        agent,
        pooled_jail: None,
    })
}

/// [`resume_microvm`] in a prewarmed VMM: into the sandbox's cgroups, the snapshot linked
/// into its inbox, and its directory swapped with the sandbox's (the sandbox's files moved
/// over first as hard links, so a crash at any point leaves a directory holding the
/// record), then the restore request, the agent wait and the refresh.
async fn resume_pooled(
    mut pooled: PooledVmm,
    handle: &SandboxHandle,
    snapshot: &Path,
    cgroup_procs: &[PathBuf],
    timeout: std::time::Duration,
) -> Result<Resumed> {
    // Held until the agent answers (or the resume fails).
    let _refill = pooled.refill.take();
    let taken = scopeguard_inbox(&pooled);
    let jail = (pooled.snapshot_dir.clone(), pooled.jail_root.clone());
    let forget_jail = |jail: &(PathBuf, PathBuf)| {
        let _ = std::fs::remove_dir(&jail.0);
        let _ = std::fs::remove_dir_all(&jail.1);
    };
    let pool_dir = pooled.vm.dir().path().to_path_buf();
    let handed_over = pooled
        .vm
        .renice(0)
        .and_then(|()| pooled.vm.join_cgroups(cgroup_procs))
        .and_then(|()| pooled.link_snapshot(snapshot))
        .and_then(|path| {
            swap_in_vmm_dir(&handle.dir, &pool_dir)
                .map_err(|e| {
                    EdgeError::io(
                        format!(
                            "hand the prewarmed VMM's directory to {}",
                            handle.dir.display()
                        ),
                        e,
                    )
                })
                .map(|()| path)
        });
    let path = match handed_over {
        Ok(path) => path,
        Err(err) => {
            let _ = std::fs::remove_dir_all(&pool_dir);
            drop(pooled.vm);
            forget_jail(&jail);
            return Err(err);
        }
    };
    let mut vm = pooled
        .vm
        .relocated(MicroVmDir::new(&handle.dir))
        .with_hostname(&handle.id);
    // The snapshot's own context id: the sandbox keeps it.
    let request = RestoreRequest {
        path,
        ..RestoreRequest::default()
    };
    let reply = vm.restore(request, timeout).await;
    drop(taken);
    let ready = match reply {
        Ok(reply) => {
            tracing::info!(
                sandbox = %handle.id,
                vmm = %pooled.name,
                restore_ms = reply.restore_ms,
                steps = %restore_steps(&reply.steps),
                "resumed into a prewarmed VMM"
            );
            vm.ready(timeout).await
        }
        // Dropping a VMM that is still owned kills its process group.
        Err(err) => Err(err),
    };
    match ready {
        Ok(vm) => {
            let agent = vm.agent().clone();
            Ok(Resumed {
                pid: vm.detach(),
                agent,
                pooled_jail: Some(jail),
            })
        }
        Err(err) => {
            // The sandbox directory (now the pooled VMM's, holding the record) stays; the
            // next resume starts a fresh VMM there.
            forget_jail(&jail);
            Err(err)
        }
    }
}

/// Makes the pooled VMM's directory `vmm_dir` the sandbox directory `sandbox_dir`: the
/// sandbox's entries (record, event log...) are hard-linked into it, the two directories
/// are exchanged atomically, and whatever the sandbox's directory gained meanwhile is moved
/// over before the old one is removed. The VMM's own files (logs, pid, sockets) win.
fn swap_in_vmm_dir(sandbox_dir: &Path, vmm_dir: &Path) -> std::io::Result<()> {
    keep_ended_logs(sandbox_dir)?;
    for entry in std::fs::read_dir(sandbox_dir)?.flatten() {
        let to = vmm_dir.join(entry.file_name());
        if entry.file_type()?.is_file() && !to.exists() {
            std::fs::hard_link(entry.path(), &to)?;
        }
    }
    rename_flags(vmm_dir, sandbox_dir, libc::RENAME_EXCHANGE)?;
    // `vmm_dir` now names the sandbox's old directory.
    for entry in std::fs::read_dir(vmm_dir)?.flatten() {
        let to = sandbox_dir.join(entry.file_name());
        let own = ["vmm.log", "serial.log", "pid", "api.sock", "vsock.sock"];
        if own.iter().any(|n| entry.file_name() == *n) {
            continue;
        }
        // A newer record replaces its link; everything else moves as it is.
        std::fs::rename(entry.path(), &to)?;
    }
    std::fs::remove_dir_all(vmm_dir)
}

/// The most a sandbox keeps of its ended VMMs' logs per log (the console is the guest's to
/// fill).
const ENDED_LOG_MAX: usize = 1 << 20;

/// Before a resumed sandbox's new VMM writes its logs in `dir`: the ended VMM's `vmm.log` and
/// `serial.log` are appended to `vmm.log.old` and `serial.log.old` (their last
/// [`ENDED_LOG_MAX`] bytes kept), so a pause/resume cycle loses neither.
fn keep_ended_logs(dir: &Path) -> std::io::Result<()> {
    for name in ["vmm.log", "serial.log"] {
        let log = dir.join(name);
        let ended = match std::fs::read(&log) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        let old = dir.join(format!("{name}.old"));
        let mut kept = std::fs::read(&old).unwrap_or_default();
        kept.extend_from_slice(&ended);
        let start = kept.len().saturating_sub(ENDED_LOG_MAX);
        let tmp = dir.join(format!(".{name}.old.tmp"));
        std::fs::write(&tmp, &kept[start..])?;
        std::fs::rename(&tmp, &old)?;
        std::fs::remove_file(&log)?;
    }
    Ok(())
}

/// Copies a sparse disk image keeping its holes: only the data extents are copied (a fresh
/// 1 GiB upper disk holds a few MiB of ext4 metadata).
pub fn copy_sparse(src: &Path, dst: &Path) -> std::io::Result<()> {
    use nix::unistd::{lseek, Whence};
    use std::os::unix::fs::FileExt;
    let from = std::fs::File::open(src)?;
    let len = from.metadata()?.len() as i64;
    let to = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(dst)?;
    to.set_len(len as u64)?;
    let mut buf = vec![0u8; 1 << 20];
    let mut pos = 0i64;
    while pos < len {
        let data = match lseek(&from, pos, Whence::SeekData) {
            Ok(d) => d,
            // No data after pos: the rest is a hole.
            Err(nix::errno::Errno::ENXIO) => break,
            Err(e) => return Err(e.into()),
        };
        let hole = lseek(&from, data, Whence::SeekHole)?.min(len);
        let mut at = data;
        while at < hole {
            let n = ((hole - at) as usize).min(buf.len());
            from.read_exact_at(&mut buf[..n], at as u64)?;
            to.write_all_at(&buf[..n], at as u64)?;
            at += n as i64;
        }
        pos = hole;
    }
    to.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pooled_resume_keeps_the_ended_vmms_logs() {
        let base = std::env::temp_dir().join(format!("dsec-swap-logs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let (sandbox, vmm) = (base.join("sb-1"), base.join("pool-1"));
        for cycle in 1..=2 {
            std::fs::create_dir_all(&sandbox).unwrap();
            std::fs::create_dir_all(&vmm).unwrap();
            std::fs::write(sandbox.join("meta.json"), "{}").unwrap();
            std::fs::write(sandbox.join("vmm.log"), format!("vmm {cycle}\n")).unwrap();
            std::fs::write(sandbox.join("serial.log"), format!("console {cycle}\n")).unwrap();
            std::fs::write(vmm.join("vmm.log"), "new vmm\n").unwrap();
            swap_in_vmm_dir(&sandbox, &vmm).unwrap();
            assert!(!vmm.exists());
            assert_eq!(
                std::fs::read_to_string(sandbox.join("vmm.log")).unwrap(),
                "new vmm\n"
            );
            assert!(sandbox.join("meta.json").is_file());
        }
        let old = |name: &str| std::fs::read_to_string(sandbox.join(name)).unwrap();
        assert_eq!(old("vmm.log.old"), "vmm 1\nvmm 2\n");
        assert_eq!(old("serial.log.old"), "console 1\nconsole 2\n");
        // A guest's console cannot grow what is kept past the bound.
        std::fs::write(sandbox.join("serial.log"), vec![b'x'; ENDED_LOG_MAX + 10]).unwrap();
        keep_ended_logs(&sandbox).unwrap();
        let kept = std::fs::read(sandbox.join("serial.log.old")).unwrap();
        assert_eq!(kept.len(), ENDED_LOG_MAX);
        assert!(kept.iter().all(|b| *b == b'x'));
        assert!(!sandbox.join("serial.log").exists());
        std::fs::remove_dir_all(&base).unwrap();
    }

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

    #[test]
    fn resume_hands_the_vmm_directory_to_the_sandbox_keeping_its_files() {
        let base = std::env::temp_dir().join(format!("dsec-swap-{}", std::process::id()));
        let (sandbox, vmm) = (base.join("sb-x"), base.join("pool-y"));
        std::fs::create_dir_all(&sandbox).unwrap();
        std::fs::create_dir_all(&vmm).unwrap();
        for (dir, name, text) in [
            (&sandbox, "meta.json", "record"),
            (&sandbox, "events.log", "events"),
            (&sandbox, "vmm.log", "old vmm"),
            (&vmm, "vmm.log", "new vmm"),
            (&vmm, "pid", "42"),
        ] {
            std::fs::write(dir.join(name), text).unwrap();
        }
        std::fs::create_dir(sandbox.join("extra")).unwrap();
        let vmm_inode = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(&vmm).unwrap());
        swap_in_vmm_dir(&sandbox, &vmm).unwrap();
        let read = |name: &str| std::fs::read_to_string(sandbox.join(name)).unwrap();
        let inode = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(&sandbox).unwrap());
        let (meta, events, log, pid) = (
            read("meta.json"),
            read("events.log"),
            read("vmm.log"),
            read("pid"),
        );
        let (extra, vmm_gone) = (sandbox.join("extra").is_dir(), !vmm.exists());
        std::fs::remove_dir_all(&base).unwrap();
        // The sandbox's path now names the VMM's directory (its jail bind-mounts that one).
        assert_eq!(inode, vmm_inode);
        assert_eq!((meta.as_str(), events.as_str()), ("record", "events"));
        assert_eq!((log.as_str(), pid.as_str()), ("new vmm", "42"));
        assert!(extra, "a directory of the sandbox was not moved over");
        assert!(vmm_gone, "the old directory was left behind");
    }

    #[test]
    fn sparse_copies_keep_data_and_holes() {
        use std::os::unix::fs::{FileExt, MetadataExt};
        let dir = std::env::temp_dir().join(format!("dsec-sparse-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (src, dst) = (dir.join("a.img"), dir.join("b.img"));
        let f = std::fs::File::create(&src).unwrap();
        f.set_len(64 << 20).unwrap();
        f.write_all_at(b"head", 0).unwrap();
        f.write_all_at(&vec![7u8; 3 << 20], 20 << 20).unwrap();
        f.write_all_at(b"tail", (64 << 20) - 4).unwrap();
        drop(f);
        copy_sparse(&src, &dst).unwrap();
        assert_eq!(std::fs::read(&src).unwrap(), std::fs::read(&dst).unwrap());
        let blocks = std::fs::metadata(&dst).unwrap().blocks() * 512;
        assert!(
            blocks < 8 << 20,
            "copy allocates {blocks} bytes of a 64 MiB file"
        );
        // Never overwrites.
        assert!(copy_sparse(&src, &dst).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
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
