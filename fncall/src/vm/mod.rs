//! VM workers (the VMM FnCall mode): each call runs in a microVM restored from a snapshot of
//! a booted worker VM whose zygote has its runtime loaded, and the VM is killed after the
//! call: nothing of a call outlives it, not even the guest kernel.
//!
//! Per (image, language) the factory boots one template VM (the image's initramfs: busybox,
//! the guest agent, python3; vsock and rng only, no disk or network device). The agent starts
//! `guest_worker.py` (`dsec.fnworker=PORT` on the kernel command line), the host sends it the
//! zygote, the worker loads it and waits; the VM is snapshotted and stopped. A worker of the
//! pool is a prewarmed `dsec-vmm` (VM shell made, memory slots registered): its one call
//! restores the snapshot into it (memory MAP_PRIVATE over the snapshot file, its own vsock
//! socket and CID), sends fresh entropy and the clock, the request, reads the result and kills
//! the VMM.

mod channel;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use base64::Engine as _;
use dsec_vmm_api::config::{SerialOutput, VmConfig, VsockConfig, DEFAULT_CMDLINE};
use dsec_vmm_api::control::RestoreRequest;
use dsec_vmm_api::launch::{
    Exposure, JailLaunch, LaunchMode, PrewarmLaunch, SnapshotOverrides, VmmLaunch,
};
use dsec_vmm_api::ControlClient;
use tokio::process::{Child, Command};

use crate::container::{self, CallLimits};
use crate::error::{FnCallError, Result};
use crate::network::NetworkRules;
use crate::request::{CallRequest, CallResult, StageResult, StageStatus};
use crate::worker::{Outcome, PoolKey, Worker, WorkerFactory};

/// The file in an image's directory that makes it a VM FnCall image (next to its
/// `initramfs.cpio`); `images/fncall-vm/build.sh` writes it.
pub const VM_IMAGE_MARKER: &str = "fncall-vm";
/// How long a template VM may take to boot and load its runtime (a TCG-emulated L1 is slow).
const BOOT_TIMEOUT: Duration = Duration::from_secs(300);
/// How long a prewarmed VMM may take to make its VM shell.
const PREWARM_TIMEOUT: Duration = Duration::from_secs(60);
/// What the guest worker prints on the console once it waits for the call's connection.
const WARM_LINE: &str = "dsec-fnworker warm";
/// The uid calls run as inside a worker VM (the zygote's argv and every request name it: the
/// python stage is dropped to it before its call arrives); one for all, since the VM is the
/// call's own.
const GUEST_CALL_UID: u32 = 1000;

/// Where a node's VM workers come from.
#[derive(Clone, Debug)]
pub struct VmSettings {
    /// Images (`<images>/<name>/initramfs.cpio` + the marker).
    pub images_dir: PathBuf,
    /// The guest kernel (vmlinux).
    pub kernel: PathBuf,
    /// The `dsec-vmm` binary.
    pub vmm: PathBuf,
    /// Templates and per-call sockets live under `<run_dir>/<pid>/`.
    pub run_dir: PathBuf,
    /// Each worker VM's memory: a call may ask for at most this much (`memory_mib`, enforced
    /// by a cgroup in the guest).
    pub mem_mib: u64,
    /// Prewarmed VMMs kept per VM pool (each holds its VM shell's memory slots, and a call
    /// uses one up): small, so refills do not starve the node's sandboxes.
    pub pool_size: usize,
    /// Jail the workers' VMMs (as the node jails its microVM sandboxes); None runs them
    /// unjailed (a node started with `--no-jail`, or not as root).
    pub jail: Option<VmJail>,
    /// Why this host cannot run a Linux guest, if it cannot (PVM, no /dev/kvm).
    pub unsupported: Option<String>,
    /// Cgroups for each VMM (the node's, as its microVM sandboxes' VMMs get); None: the VMMs
    /// stay in the engine's own (`dsec fn run --local`).
    pub cgroups: Option<Arc<dyn VmCgroups>>,
}

impl std::fmt::Debug for dyn VmCgroups {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("VmCgroups")
    }
}

/// Where the node keeps each VM worker's VMM (and each template's): cgroups of its own
/// under the node's, with a microVM sandbox's limits (memory, processes, one vCPU of CPU).
/// The node implements it over its cgroups (edge/src/daemon/fncall.rs). Blocking calls.
pub trait VmCgroups: Send + Sync {
    /// Makes the groups of VMM `name` for a VM of `mem_mib` and one vCPU; returns their
    /// `cgroup.procs` files, which the VMM joins before it runs.
    fn create(&self, name: &str, mem_mib: u64) -> std::result::Result<Vec<PathBuf>, String>;

    /// Removes them, killing whatever is left in them.
    fn remove(&self, name: &str);
}

/// A VMM's cgroups, removed (off the async threads) when dropped.
struct VmmCgroup {
    cgroups: Arc<dyn VmCgroups>,
    name: String,
    procs: Vec<PathBuf>,
}

impl VmmCgroup {
    fn create(
        cgroups: &Option<Arc<dyn VmCgroups>>,
        name: String,
        mem_mib: u64,
    ) -> std::result::Result<Option<Self>, String> {
        let Some(cgroups) = cgroups else {
            return Ok(None);
        };
        let procs = cgroups
            .create(&name, mem_mib)
            .map_err(|e| format!("cgroup {name}: {e}"))?;
        Ok(Some(Self {
            cgroups: Arc::clone(cgroups),
            name,
            procs,
        }))
    }
}

impl Drop for VmmCgroup {
    fn drop(&mut self) {
        let (cgroups, name) = (Arc::clone(&self.cgroups), std::mem::take(&mut self.name));
        std::thread::spawn(move || cgroups.remove(&name));
    }
}

/// How VM workers' VMMs are jailed: each in its own PID, mount, IPC, UTS and (empty) network
/// namespaces, pivot_rooted into `<engine dir>/jails/<vm>` holding only its kernel, initrd,
/// template snapshot and socket directory, as `uid`:`gid` once its VM is built, seccomp on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VmJail {
    pub uid: u32,
    pub gid: u32,
}

/// Default VM pool size: one prewarmed VMM per (image, language).
pub const DEFAULT_VM_POOL_SIZE: usize = 1;

/// Whether `image` is a VM FnCall image under `images_dir`.
pub fn is_vm_image(images_dir: &Path, image: &str) -> bool {
    plain_name(image) && images_dir.join(image).join(VM_IMAGE_MARKER).is_file()
}

fn plain_name(image: &str) -> bool {
    !image.is_empty()
        && image
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// A booted, warm worker VM's snapshot.
struct Template {
    snapshot: PathBuf,
}

/// Makes VM workers: a template per pool key, built on its first worker.
pub struct VmFactory {
    settings: VmSettings,
    limits: CallLimits,
    seccomp_hex: String,
    /// This engine's directory under the run dir.
    own_dir: PathBuf,
    templates: tokio::sync::Mutex<HashMap<PoolKey, Arc<tokio::sync::OnceCell<Arc<Template>>>>>,
}

impl VmFactory {
    pub fn new(settings: VmSettings, limits: CallLimits) -> Self {
        sweep_stale(&settings.run_dir);
        let own_dir = settings.run_dir.join(std::process::id().to_string());
        Self {
            settings,
            limits,
            seccomp_hex: container::filters_hex(&[crate::filter::sandbox_program()]),
            own_dir,
            templates: tokio::sync::Mutex::new(HashMap::new()),
        }
    }

    async fn template(&self, key: &PoolKey) -> Result<Arc<Template>> {
        let cell = {
            let mut templates = self.templates.lock().await;
            Arc::clone(templates.entry(key.clone()).or_default())
        };
        cell.get_or_try_init(|| self.build_template(key))
            .await
            .cloned()
    }

    /// Boots the image's worker VM, hands it the zygote, snapshots it once it is warm.
    async fn build_template(&self, key: &PoolKey) -> Result<Arc<Template>> {
        let start_err = |detail: String| FnCallError::WorkerStart {
            language: key.language.as_str(),
            detail,
        };
        let initrd = self
            .settings
            .images_dir
            .join(&key.image)
            .join("initramfs.cpio");
        let dir = self
            .own_dir
            .join(format!("template-{}-{}", key.image, key.language.as_str()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)
            .map_err(|e| start_err(format!("create {}: {e}", dir.display())))?;
        let uds = dir.join("vsock.sock");
        let api = dir.join("api.sock");
        let console = dir.join("console.log");
        let mut config = VmConfig::new(&self.settings.kernel);
        config.initrd = Some(initrd);
        config.cmdline = format!("{DEFAULT_CMDLINE} dsec.fnworker={}", channel::WORKER_PORT);
        config.vcpus = 1;
        config.mem_mib = self.settings.mem_mib;
        config.vsock = Some(VsockConfig {
            uds_path: uds.clone(),
            guest_cid: 3,
        });
        config.serial = SerialOutput::File(console.clone());
        config.rng = true;
        let launch = VmmLaunch {
            mode: LaunchMode::Boot(config),
            api_sock: Some(api.clone()),
            paused: false,
            jail: self.jail(&dir, Vec::new()).map_err(&start_err)?,
            no_seccomp: false,
            metrics_json: None,
        };
        let cgroup = VmmCgroup::create(
            &self.settings.cgroups,
            format!(
                "fncall-vm-{}-template-{}-{}",
                std::process::id(),
                key.image,
                key.language.as_str()
            ),
            self.settings.mem_mib,
        )
        .map_err(&start_err)?;
        let mut vmm = self
            .start_vmm(&launch, &dir, cgroup.as_ref())
            .map_err(&start_err)?;
        let console_tail = || {
            let text = std::fs::read_to_string(&console).unwrap_or_default();
            let tail: String = text.lines().rev().take(8).collect::<Vec<_>>().join(" | ");
            format!("console (last lines, newest first): {tail}")
        };
        let deadline = Instant::now() + BOOT_TIMEOUT;
        let mut stream = loop {
            match channel::connect(&uds, channel::WORKER_PORT).await {
                Ok(stream) => break stream,
                Err(e) => {
                    if let Ok(Some(status)) = vmm.try_wait() {
                        return Err(start_err(format!(
                            "the template VM exited ({status}) before its worker listened; {}",
                            console_tail()
                        )));
                    }
                    if Instant::now() > deadline {
                        return Err(start_err(format!(
                            "the template VM's worker did not listen within {BOOT_TIMEOUT:?} ({e}); {}",
                            console_tail()
                        )));
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        };
        let boot = boot_frame(key.language, &self.seccomp_hex, &self.limits);
        let warm = async {
            channel::send(&mut stream, boot.to_string().as_bytes()).await?;
            channel::receive(&mut stream, 16).await
        };
        match tokio::time::timeout_at(deadline.into(), warm).await {
            Ok(Ok((b'P', _))) => {}
            Ok(Ok((kind, _))) => {
                return Err(start_err(format!(
                    "the guest worker sent frame {:?} instead of P",
                    kind as char
                )))
            }
            Ok(Err(e)) => {
                return Err(start_err(format!(
                    "the guest worker failed to load the zygote ({e}); {}",
                    console_tail()
                )))
            }
            Err(_) => {
                return Err(start_err(format!(
                    "the guest worker did not load the zygote within {BOOT_TIMEOUT:?}"
                )))
            }
        }
        drop(stream);
        // Snapshot only once the worker has closed the boot connection and waits for the next.
        while !std::fs::read_to_string(&console)
            .unwrap_or_default()
            .contains(WARM_LINE)
        {
            if Instant::now() > deadline {
                return Err(start_err(format!(
                    "the guest worker never said it was warm; {}",
                    console_tail()
                )));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let snapshot = dir.join("snapshot");
        let control = ControlClient::new(api).reply_timeout(BOOT_TIMEOUT);
        let path = snapshot.clone();
        tokio::task::spawn_blocking(move || {
            control.snapshot(&path, false)?;
            control.stop()
        })
        .await
        .map_err(|e| start_err(format!("snapshot task: {e}")))?
        .map_err(|e| start_err(format!("snapshot the template VM: {e}")))?;
        if tokio::time::timeout(Duration::from_secs(30), vmm.wait())
            .await
            .is_err()
        {
            kill_group(&vmm);
            let _ = vmm.start_kill();
            let _ = vmm.wait().await;
        }
        tracing::info!(
            image = key.image,
            language = key.language.as_str(),
            "FnCall VM template ready"
        );
        Ok(Arc::new(Template { snapshot }))
    }

    /// The jail of the VMM that works in `dir` (named after it), with `expose` visible besides
    /// what its launch names; `dir` is handed to the jail's uid, which writes snapshots there.
    fn jail(
        &self,
        dir: &Path,
        expose: Vec<Exposure>,
    ) -> std::result::Result<Option<JailLaunch>, String> {
        let Some(jail) = self.settings.jail else {
            return Ok(None);
        };
        std::os::unix::fs::chown(dir, Some(jail.uid), Some(jail.gid))
            .map_err(|e| format!("chown {} to the jail uid {}: {e}", dir.display(), jail.uid))?;
        let name = dir.file_name().unwrap_or_default();
        let mut launch = JailLaunch::new(self.own_dir.join("jails").join(name), jail.uid, jail.gid);
        launch.expose = expose;
        Ok(Some(launch))
    }

    /// Starts the VMM of `launch`, in `cgroup` from its first instruction when given.
    fn start_vmm(
        &self,
        launch: &VmmLaunch,
        dir: &Path,
        cgroup: Option<&VmmCgroup>,
    ) -> std::result::Result<Child, String> {
        let mut command = Command::new(&self.settings.vmm);
        if let Some(cgroup) = cgroup {
            let mut procs = Vec::new();
            for path in &cgroup.procs {
                let file = std::fs::OpenOptions::new()
                    .write(true)
                    .open(path)
                    .map_err(|e| format!("open {}: {e}", path.display()))?;
                procs.push(std::os::fd::OwnedFd::from(file));
            }
            // SAFETY: the child only writes to descriptors opened before the fork (owned by
            // the closure); no allocation, no lock.
            unsafe {
                command.pre_exec(move || {
                    for fd in &procs {
                        let fd = std::os::fd::AsRawFd::as_raw_fd(fd);
                        if libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                            return Err(std::io::Error::last_os_error());
                        }
                    }
                    Ok(())
                });
            }
        }
        let log = std::fs::File::create(dir.join("vmm.log"))
            .map_err(|e| format!("create {}: {e}", dir.join("vmm.log").display()))?;
        command
            .args(launch.to_args())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            // Its own process group: a jailed VMM's forked child is killed with it.
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("start {}: {e}", self.settings.vmm.display()))
    }
}

/// What the template's guest worker gets: the zygote's source and its argv.
fn boot_frame(
    language: crate::request::Language,
    seccomp_hex: &str,
    limits: &CallLimits,
) -> serde_json::Value {
    serde_json::json!({
        "zygote": container::ZYGOTE,
        "args": {
            "language": language.as_str(),
            "max_request": container::MAX_REQUEST_FRAME,
            "seccomp_hex": seccomp_hex,
            "work_kib": limits.work_kib,
            "work_inodes": limits.inodes,
            "call_uid": GUEST_CALL_UID,
        },
    })
}

/// Removes the directories of engines that are gone (their VMMs died with them: kill_on_drop
/// and the VMM's parent-death signal).
fn sweep_stale(run_dir: &Path) {
    let Ok(entries) = std::fs::read_dir(run_dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

#[async_trait]
impl WorkerFactory for VmFactory {
    fn pool_size(&self, _key: &PoolKey) -> Option<usize> {
        Some(self.settings.pool_size.max(1))
    }

    fn admit(&self, _key: &PoolKey, call: &CallRequest) -> Result<()> {
        check_memory(call.memory_mib, self.settings.mem_mib)
    }

    async fn spawn(&self, key: &PoolKey) -> Result<Box<dyn Worker>> {
        if let Some(reason) = &self.settings.unsupported {
            return Err(FnCallError::NoVmSupport(reason.clone()));
        }
        if !is_vm_image(&self.settings.images_dir, &key.image) {
            return Err(FnCallError::MissingImage {
                image: key.image.clone(),
                path: self.settings.images_dir.join(&key.image),
            });
        }
        let template = self.template(key).await?;
        static NEXT_WORKER: AtomicU64 = AtomicU64::new(0);
        let n = NEXT_WORKER.fetch_add(1, Ordering::Relaxed);
        let start_err = |detail: String| FnCallError::WorkerStart {
            language: key.language.as_str(),
            detail,
        };
        let dir = self.own_dir.join(format!("vm-{n}"));
        std::fs::create_dir_all(&dir)
            .map_err(|e| start_err(format!("create {}: {e}", dir.display())))?;
        let api = dir.join("api.sock");
        let launch = VmmLaunch {
            mode: LaunchMode::Prewarm(PrewarmLaunch {
                mem_mib: self.settings.mem_mib,
                vcpus: 1,
                // Its own console (the template's is outside its jail).
                overrides: SnapshotOverrides {
                    serial: Some(SerialOutput::File(dir.join("console.log"))),
                    ..Default::default()
                },
            }),
            api_sock: Some(api.clone()),
            paused: false,
            jail: self
                .jail(
                    &dir,
                    vec![Exposure {
                        path: template.snapshot.clone(),
                        writable: false,
                    }],
                )
                .map_err(&start_err)?,
            no_seccomp: false,
            metrics_json: None,
        };
        let cgroup = VmmCgroup::create(
            &self.settings.cgroups,
            format!("fncall-vm-{}-{n}", std::process::id()),
            self.settings.mem_mib,
        )
        .map_err(&start_err)?;
        let vmm = self
            .start_vmm(&launch, &dir, cgroup.as_ref())
            .map_err(&start_err)?;
        let mut worker = VmWorker {
            vmm: Some(vmm),
            _cgroup: cgroup,
            jail_root: launch.jail.as_ref().map(|j| j.root.clone()),
            dir,
            api,
            template,
            // Guest CIDs 0-2 are reserved; each restored copy gets its own.
            cid: 3 + n % (u64::from(u32::MAX) - 3),
            uid: GUEST_CALL_UID,
            limits: self.limits.clone(),
        };
        // The shell is ready once its control socket appears (it takes `restore` first).
        let deadline = Instant::now() + PREWARM_TIMEOUT;
        while !worker.api.exists() {
            let exited = worker
                .vmm
                .as_mut()
                .and_then(|vmm| vmm.try_wait().ok().flatten());
            if exited.is_some() || Instant::now() > deadline {
                let log = std::fs::read_to_string(worker.dir.join("vmm.log")).unwrap_or_default();
                worker.kill().await;
                return Err(start_err(format!(
                    "the prewarmed VMM did not come up ({}): {}",
                    exited.map_or("no control socket".to_string(), |s| s.to_string()),
                    log.trim()
                )));
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        Ok(Box::new(worker))
    }
}

/// A call may ask for at most the worker VM's memory.
fn check_memory(memory_mib: u32, vm_mib: u64) -> Result<()> {
    if u64::from(memory_mib) > vm_mib {
        return Err(FnCallError::InvalidRequest(format!(
            "memory limit {memory_mib} MiB is above the VM worker's {vm_mib} MiB of memory: \
             ask for at most {vm_mib} MiB, or use a container image"
        )));
    }
    Ok(())
}

/// A prewarmed VMM waiting for its one call.
struct VmWorker {
    vmm: Option<Child>,
    /// The VMM's cgroups, removed after the worker (which kills the VMM first).
    _cgroup: Option<VmmCgroup>,
    dir: PathBuf,
    /// The jailed VMM's root directory (left behind when its supervisor is killed).
    jail_root: Option<PathBuf>,
    api: PathBuf,
    template: Arc<Template>,
    cid: u64,
    uid: u32,
    limits: CallLimits,
}

impl VmWorker {
    /// Kills the VMM and waits for it: after this no process of the call is left.
    async fn kill(&mut self) {
        if let Some(mut vmm) = self.vmm.take() {
            kill_group(&vmm);
            let _ = vmm.start_kill();
            let _ = vmm.wait().await;
        }
        self.remove_dirs();
    }

    fn remove_dirs(&self) {
        let _ = std::fs::remove_dir_all(&self.dir);
        if let Some(root) = &self.jail_root {
            // Its bind mounts live in the jail's own mount namespace: on the host it is only
            // empty directories and files.
            let _ = std::fs::remove_dir_all(root);
        }
    }

    /// Restores the template into the prewarmed VMM and runs the call; the raw result frame,
    /// or the call init's wait status when it died without one.
    async fn exchange(
        &mut self,
        request: &[u8],
        memory_mib: u32,
    ) -> std::io::Result<std::result::Result<Vec<u8>, i32>> {
        let uds = self.dir.join("vsock.sock");
        let control = ControlClient::new(self.api.clone()).reply_timeout(Duration::from_secs(60));
        let restore = RestoreRequest {
            path: self.template.snapshot.clone(),
            vsock_uds: Some(uds.clone()),
            vsock_cid: Some(self.cid),
            ..Default::default()
        };
        tokio::task::spawn_blocking(move || control.restore(restore))
            .await
            .map_err(std::io::Error::other)?
            .map_err(|e| std::io::Error::other(format!("restore: {e}")))?;
        // The restored guest answers once its vCPU runs again; give it a moment.
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut stream = loop {
            match channel::connect(&uds, channel::WORKER_PORT).await {
                Ok(stream) => break stream,
                Err(e) if Instant::now() > deadline => return Err(e),
                Err(_) => tokio::time::sleep(Duration::from_millis(2)).await,
            }
        };
        let mut entropy = [0u8; 64];
        getrandom(&mut entropy)?;
        let realtime_ns = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or_default();
        let preamble = serde_json::json!({
            "entropy": base64::engine::general_purpose::STANDARD.encode(entropy),
            "realtime_ns": realtime_ns,
            "memory_mib": memory_mib,
        });
        channel::send(&mut stream, preamble.to_string().as_bytes()).await?;
        match channel::receive(&mut stream, 4096).await? {
            (b'H', _) => {}
            (b'X', why) => {
                return Err(protocol(format!(
                    "the guest could not set {}",
                    String::from_utf8_lossy(&why)
                )))
            }
            (kind, _) => {
                return Err(protocol(format!(
                    "frame {:?} instead of hello",
                    kind as char
                )))
            }
        }
        channel::send(&mut stream, request).await?;
        match channel::receive(&mut stream, container::MAX_RESULT_FRAME).await? {
            (b'R', payload) => Ok(Ok(payload)),
            (b'E', payload) => Ok(Err(container::wait_status(&payload)?)),
            (kind, _) => Err(protocol(format!("unexpected frame {:?}", kind as char))),
        }
    }
}

fn protocol(detail: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, detail)
}

fn getrandom(buf: &mut [u8]) -> std::io::Result<()> {
    use std::io::Read;
    std::fs::File::open("/dev/urandom")?.read_exact(buf)
}

/// SIGKILLs the VMM's process group: the VMM and, jailed, its forked child.
fn kill_group(vmm: &Child) {
    if let Some(pid) = vmm.id() {
        // SAFETY: killpg with a plain pid and signal number; the group is the VMM's own
        // (process_group(0) at spawn) and its pid is not reaped yet, so not reused.
        unsafe { libc::killpg(pid as libc::pid_t, libc::SIGKILL) };
    }
}

impl Drop for VmWorker {
    fn drop(&mut self) {
        // kill_on_drop ends the VMM (its group here: a jailed VMM's child too); its
        // directories go too.
        if let Some(vmm) = &self.vmm {
            kill_group(vmm);
        }
        self.remove_dirs();
    }
}

#[async_trait]
impl Worker for VmWorker {
    async fn call(&mut self, call: &CallRequest) -> Result<Outcome> {
        let request = container::request_json(call, self.uid, &self.limits);
        let deadline = call.compile_timeout + call.run_timeout + container::GRACE;
        let answer = tokio::time::timeout(deadline, self.exchange(&request, call.memory_mib)).await;
        // Whatever happened, this VM served its one call.
        self.kill().await;
        let answer = match answer {
            Ok(Ok(answer)) => answer,
            Ok(Err(e)) => return Err(FnCallError::WorkerLost(format!("VM worker: {e}"))),
            Err(_) => {
                return Err(FnCallError::WorkerLost(format!(
                    "VM worker: no answer within {deadline:?}"
                )))
            }
        };
        let result = match answer {
            Ok(raw) => container::parse_result(&raw)
                .map_err(|e| FnCallError::WorkerLost(format!("result: {e}")))?,
            Err(status) => {
                // The call's init died before answering: the guest's OOM killer, or a crash.
                let signal = libc::WIFSIGNALED(status).then(|| libc::WTERMSIG(status));
                CallResult {
                    run: Some(StageResult {
                        status: StageStatus::Finished,
                        exit_code: None,
                        signal: signal.or(Some(libc::SIGKILL)),
                        stdout: Vec::new(),
                        stderr: b"killed: the call's init died (over its memory limit?)\n".to_vec(),
                        stdout_truncated: false,
                        stderr_truncated: false,
                        duration: Duration::ZERO,
                    }),
                    ..CallResult::default()
                }
            }
        };
        Ok(Outcome {
            result,
            reusable: false,
        })
    }
}

/// Sends each pool to the factory of its image's kind: VM images (see [`is_vm_image`]) to the
/// VM factory, the others to the container factory.
pub struct ByImageKind {
    pub images_dir: PathBuf,
    pub container: Arc<dyn WorkerFactory>,
    pub vm: Arc<dyn WorkerFactory>,
}

impl ByImageKind {
    fn factory(&self, key: &PoolKey) -> &dyn WorkerFactory {
        if is_vm_image(&self.images_dir, &key.image) {
            self.vm.as_ref()
        } else {
            self.container.as_ref()
        }
    }
}

#[async_trait]
impl WorkerFactory for ByImageKind {
    fn check_network(&self, image: &str, rules: &NetworkRules) -> Result<()> {
        if is_vm_image(&self.images_dir, image) {
            // A VM worker has no network device.
            return Err(FnCallError::NoCallNetwork);
        }
        self.container.check_network(image, rules)
    }

    fn pool_size(&self, key: &PoolKey) -> Option<usize> {
        self.factory(key).pool_size(key)
    }

    fn admit(&self, key: &PoolKey, call: &CallRequest) -> Result<()> {
        self.factory(key).admit(key, call)
    }

    async fn spawn(&self, key: &PoolKey) -> Result<Box<dyn Worker>> {
        self.factory(key).spawn(key).await
    }

    fn lean_python(&self, image: &str) -> bool {
        !is_vm_image(&self.images_dir, image) && self.container.lean_python(image)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_asking_for_more_memory_than_the_vm_are_refused() {
        assert!(check_memory(512, 512).is_ok());
        assert!(check_memory(16, 512).is_ok());
        let err = check_memory(513, 512).unwrap_err();
        assert!(matches!(err, FnCallError::InvalidRequest(_)), "{err}");
        assert!(err.to_string().contains("512 MiB"), "{err}");
    }

    /// The guest worker's `load_zygote` (on the host's python3) takes this zygote with the
    /// boot frame a template gets: the two files' argv contract holds.
    #[test]
    fn the_guest_worker_loads_this_zygote() {
        use std::io::Write;
        let worker = include_str!("guest_worker.py");
        let body = worker
            .trim_end()
            .strip_suffix("main()")
            .expect("guest_worker.py ends with main()");
        let script = format!(
            "{body}\nz = load_zygote(json.loads(sys.stdin.read()))\n\
             print(callable(z['main']), z['CALL_UID'], z['LANG'])\n"
        );
        let boot = boot_frame(
            crate::request::Language::Python,
            "00",
            &CallLimits::default(),
        );
        let mut python = std::process::Command::new("python3")
            .args(["-I", "-c", &script, "1100"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("python3 runs (the FnCall tests need it)");
        python
            .stdin
            .take()
            .unwrap()
            .write_all(boot.to_string().as_bytes())
            .unwrap();
        let out = python.wait_with_output().unwrap();
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            format!("True {GUEST_CALL_UID} python"),
            "stderr: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
