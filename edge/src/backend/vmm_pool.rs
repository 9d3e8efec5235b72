//! The pool of prewarmed VMMs: per memory/vCPU shape, a few `dsec-vmm --prewarm` processes
//! whose KVM VM, memory slots and vCPUs already exist, waiting for one restore request. A
//! template create, a restore of a named snapshot or a resume takes one instead of starting a
//! VMM (the memory-slot ioctls alone cost ~5.5 ms of SRCU grace periods per VMM), and the
//! pool refills in the background.
//!
//! A pooled VMM is jailed like any other before its sandbox exists, so what differs is where
//! its files are:
//! - its directory (sockets, logs, pid) is `<pool>/<name>`, on the same file system as the
//!   sandbox directories; when it is taken, the directory is renamed to the sandbox's. The
//!   jail sees the old path, which is a bind mount of the same directory, so the VMM's
//!   sockets and console stay its own and the host finds them at the sandbox's path.
//! - its one read-only extra is `<pool>/<name>.in`; the snapshot to restore is hard-linked
//!   into it (same inodes: MAP_PRIVATE still shares the page cache with every other restore
//!   of the template) and the links go once the VM is restored. The VMM never sees the
//!   template's or the snapshot's own directory, and cannot write either.
//! - its writable snapshot directory and jail root are named after the pooled VMM
//!   (`<snapshots>/<name>`, `<jails>/<name>`); the sandbox's record keeps those paths.
//! - it runs in no sandbox's cgroups until taken; then the VMM and its jailed child are moved
//!   into the sandbox's (`cgroup.procs`) before the restore request, so the restored memory
//!   is charged to the sandbox. Its idle cost is a VM shell with untouched memory.
//!
//! The pool serves only jailed VMMs without a disk image or network device (the snapshot's
//! disks and taps would have to be in the jail from the start); those start a fresh VMM, as
//! does any take from an empty shape. Pooled VMMs are killed when the daemon stops; after a
//! crash, adoption kills the ones no sandbox took (their command line names the pool
//! directory) and empties the directory.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use dsec_vmm_api::launch::{Exposure, PrewarmLaunch};
use dsec_vmm_api::{LaunchMode, VmmLaunch};

use super::microvm::VmmJail;
use crate::error::{EdgeError, Result};
use crate::microvm::{MicroVm, MicroVmDir, SpawnOptions, StartingMicroVm};

/// How many prewarmed VMMs are kept per shape by default.
pub const DEFAULT_POOL_SIZE: usize = 2;

/// Memory and vCPUs: a prewarmed VMM restores only snapshots of its own shape.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub struct Shape {
    pub mem_mib: u64,
    pub vcpus: u8,
}

/// One prewarmed VMM, ready or still building its VM shell.
pub struct PooledVmm {
    pub(super) name: String,
    pub(super) vm: StartingMicroVm,
    /// Read-only in its jail: the snapshot to restore is linked in here.
    pub(super) inbox: PathBuf,
    pub(super) snapshot_dir: PathBuf,
    pub(super) jail_root: PathBuf,
    /// Set on a taken VMM: its shape is refilled once this is dropped.
    pub(super) refill: Option<Refill>,
}

/// Refills a shape of the pool when dropped. A taken VMM carries one until its sandbox's
/// agent answers: a new VMM building its VM shell meanwhile (~0.3-0.5 s of CPU in the rig's
/// L1) competed with the restore and the guest for the same cores.
pub(super) struct Refill {
    pool: Arc<VmmPool>,
    shape: Shape,
}

impl Drop for Refill {
    fn drop(&mut self) {
        let (pool, shape) = (self.pool.clone(), self.shape);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move { pool.fill(shape) });
        }
    }
}

impl PooledVmm {
    /// Hard-links the snapshot's files (and those of its `base`, the parent of a snapshot
    /// over a memory base) into the inbox; returns the path the VMM reads.
    pub(super) fn link_snapshot(&self, snapshot: &Path) -> Result<PathBuf> {
        let into = self.inbox.join("snapshot");
        link_files(snapshot, &into)?;
        let base = snapshot.join(super::microvm::SNAPSHOT_BASE_DIR);
        if base.is_dir() {
            link_files(&base, &into.join(super::microvm::SNAPSHOT_BASE_DIR))?;
        }
        Ok(into)
    }

    /// Kills it and removes everything it had on the host.
    fn discard(self) {
        let run = self.vm.dir().path().to_path_buf();
        // Dropping a VMM that is still owned kills its process group.
        drop(self.vm);
        let _ = std::fs::remove_dir_all(run);
        let _ = std::fs::remove_dir_all(&self.inbox);
        let _ = std::fs::remove_dir(&self.snapshot_dir);
        let _ = std::fs::remove_dir_all(&self.jail_root);
    }
}

/// Hard-links the regular files of `from` into the new directory `into` (same inodes: a
/// mapping of them shares the page cache of every other).
fn link_files(from: &Path, into: &Path) -> Result<()> {
    std::fs::create_dir(into)
        .map_err(|e| EdgeError::io(format!("create {}", into.display()), e))?;
    let entries = std::fs::read_dir(from)
        .map_err(|e| EdgeError::io(format!("read {}", from.display()), e))?;
    for entry in entries.flatten() {
        if entry.file_type().is_ok_and(|t| t.is_file()) {
            let to = into.join(entry.file_name());
            std::fs::hard_link(entry.path(), &to).map_err(|e| {
                EdgeError::io(
                    format!("link {} to {}", entry.path().display(), to.display()),
                    e,
                )
            })?;
        }
    }
    Ok(())
}

/// The node's prewarmed VMMs.
pub struct VmmPool {
    per_shape: usize,
    /// `<pool>/<name>` per VMM; on the sandboxes' file system.
    dir: PathBuf,
    jail: VmmJail,
    options: SpawnOptions,
    ready: Mutex<HashMap<Shape, Vec<PooledVmm>>>,
    closed: AtomicBool,
    pub served: AtomicU64,
    pub missed: AtomicU64,
}

impl std::fmt::Debug for VmmPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VmmPool")
            .field("dir", &self.dir)
            .field("per_shape", &self.per_shape)
            .finish()
    }
}

impl VmmPool {
    /// A pool of `per_shape` VMMs per shape in `dir`, for sandboxes under `sandboxes`.
    /// None when it cannot serve: no VMMs wanted, no jail, or `dir` on another file system
    /// than the sandbox directories (the rename that hands a VMM over needs the same one).
    pub fn new(
        per_shape: usize,
        dir: &Path,
        sandboxes: &Path,
        jail: Option<&VmmJail>,
        vmm_bin: Option<&Path>,
    ) -> Option<Arc<Self>> {
        use std::os::unix::fs::{DirBuilderExt, MetadataExt};
        let jail = jail?.clone();
        if per_shape == 0 {
            return None;
        }
        let options = match SpawnOptions::find(vmm_bin) {
            Ok(o) => SpawnOptions { nice: 19, ..o },
            Err(err) => {
                tracing::warn!(%err, "no prewarmed VMM pool");
                return None;
            }
        };
        if let Err(e) = std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
        {
            tracing::warn!(dir = %dir.display(), "no prewarmed VMM pool: cannot create its directory: {e}");
            return None;
        }
        let dev = |p: &Path| std::fs::metadata(p).map(|m| m.dev()).ok();
        if dev(dir).is_none() || dev(dir) != dev(sandboxes) {
            tracing::warn!(dir = %dir.display(), sandboxes = %sandboxes.display(),
                "no prewarmed VMM pool: its directory is not on the sandboxes' file system");
            return None;
        }
        Some(Arc::new(VmmPool {
            per_shape,
            dir: dir.to_path_buf(),
            jail,
            options,
            ready: Mutex::new(HashMap::new()),
            closed: AtomicBool::new(false),
            served: AtomicU64::new(0),
            missed: AtomicU64::new(0),
        }))
    }

    fn ready(&self) -> std::sync::MutexGuard<'_, HashMap<Shape, Vec<PooledVmm>>> {
        self.ready.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Prewarmed VMMs whose shell is built (their control socket is there), per shape.
    pub fn counts(&self) -> Vec<(Shape, usize)> {
        self.ready()
            .iter()
            .map(|(shape, vmms)| {
                let ready = vmms
                    .iter()
                    .filter(|p| p.vm.dir().api_sock().exists())
                    .count();
                (*shape, ready)
            })
            .collect()
    }

    /// A prewarmed VMM of `shape` whose shell is built, if there is one; the shape is
    /// refilled in the background once the taken VMM's [`Refill`] is dropped, or at once
    /// when none was taken (the first take of a shape starts its pool).
    pub fn take(self: &Arc<Self>, shape: Shape) -> Option<PooledVmm> {
        let mut dead = Vec::new();
        let taken = {
            let mut ready = self.ready();
            let vmms = ready.entry(shape).or_default();
            let mut i = 0;
            let mut taken = None;
            while i < vmms.len() {
                if vmms[i].vm.has_exited() {
                    dead.push(vmms.swap_remove(i));
                } else if taken.is_none() && vmms[i].vm.dir().api_sock().exists() {
                    taken = Some(vmms.swap_remove(i));
                } else {
                    i += 1;
                }
            }
            taken
        };
        for vmm in dead {
            tracing::warn!(vmm = %vmm.name, "a prewarmed VMM had exited; replaced{}",
                crate::paths::log_tail(&vmm.vm.dir().vmm_log(), "VMM log"));
            vmm.discard();
        }
        let counter = if taken.is_some() {
            &self.served
        } else {
            &self.missed
        };
        counter.fetch_add(1, Ordering::Relaxed);
        let refill = Refill {
            pool: self.clone(),
            shape,
        };
        match taken {
            Some(mut vmm) => {
                vmm.refill = Some(refill);
                Some(vmm)
            }
            None => {
                drop(refill);
                None
            }
        }
    }

    /// Starts VMMs until `shape` has its count (ready or building).
    fn fill(&self, shape: Shape) {
        loop {
            if self.closed.load(Ordering::Relaxed)
                || self.ready().get(&shape).map_or(0, Vec::len) >= self.per_shape
            {
                return;
            }
            match self.spawn(shape) {
                Ok(vmm) => {
                    let mut ready = self.ready();
                    if self.closed.load(Ordering::Relaxed) {
                        drop(ready);
                        vmm.discard();
                        return;
                    }
                    ready.entry(shape).or_default().push(vmm);
                }
                Err(err) => {
                    tracing::warn!(?shape, %err, "cannot start a prewarmed VMM; creates start their own");
                    return;
                }
            }
        }
    }

    fn spawn(&self, shape: Shape) -> Result<PooledVmm> {
        use std::os::unix::fs::DirBuilderExt;
        let name = format!(
            "pool-{}",
            super::new_sandbox_id(super::BackendKind::MicroVm)
        );
        let run = self.dir.join(&name);
        let inbox = self.dir.join(format!("{name}.in"));
        for dir in [&run, &inbox] {
            std::fs::DirBuilder::new()
                .mode(0o700)
                .create(dir)
                .map_err(|e| EdgeError::io(format!("create {}", dir.display()), e))?;
        }
        let snapshot_dir = self.jail.snapshot_dir(&name)?;
        let mut jail = self.jail.launch(&name, &snapshot_dir);
        jail.expose.push(Exposure {
            path: inbox.clone(),
            writable: false,
        });
        let mut launch = VmmLaunch::new(LaunchMode::Prewarm(PrewarmLaunch {
            mem_mib: shape.mem_mib,
            vcpus: shape.vcpus,
            // Every snapshot it may be handed was written by a VMM: see restore_microvm.
            overrides: dsec_vmm_api::SnapshotOverrides {
                contained_chain: true,
                ..Default::default()
            },
        }));
        launch.jail = Some(jail);
        let vm = MicroVm::spawn(&self.options, &MicroVmDir::new(&run), launch)?;
        tracing::debug!(vmm = %name, ?shape, "prewarmed VMM started");
        Ok(PooledVmm {
            name: name.clone(),
            vm,
            inbox,
            snapshot_dir,
            jail_root: self.jail.root(&name),
            refill: None,
        })
    }

    /// Kills every pooled VMM and removes their files (the daemon stops).
    pub fn close(&self) {
        self.closed.store(true, Ordering::Relaxed);
        let all: Vec<PooledVmm> = self.ready().drain().flat_map(|(_, v)| v).collect();
        for vmm in all {
            vmm.discard();
        }
    }

    /// After a crash: kills pooled VMMs that no adopted sandbox took (any process naming the
    /// pool directory whose pid and nearest ancestors are not in `adopted`) and empties the
    /// directory.
    /// Returns how many processes were killed.
    pub fn sweep(dir: &Path, adopted: &std::collections::HashSet<i32>) -> usize {
        let prefix = format!("{}/", dir.display());
        let mut killed = 0;
        for pid in super::host::pids_referencing(prefix.as_bytes()) {
            if adopted.contains(&pid) {
                continue;
            }
            // A taken VMM's jailed child, its teardown helper and snapshot writers name the
            // pool directory too: spared when an ancestor is an adopted sandbox's VMM.
            let spared =
                std::iter::successors(parent_of(pid), |&p| (p > 1).then(|| parent_of(p)).flatten())
                    .take(4)
                    .any(|p| adopted.contains(&p));
            if spared {
                continue;
            }
            let pid = nix::unistd::Pid::from_raw(pid);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
            let _ = nix::sys::wait::waitpid(pid, Some(nix::sys::wait::WaitPidFlag::WNOHANG));
            killed += 1;
        }
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
        killed
    }
}

/// The parent pid of `pid` (field 4 of /proc/PID/stat, after the command name).
fn parent_of(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

impl Drop for VmmPool {
    fn drop(&mut self) {
        self.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A process whose command line names `dir` (as a pooled VMM's names its directory).
    /// Returns once the child has exec'd: before that its command line is still ours and a
    /// sweep would not see it.
    fn naming(dir: &Path) -> std::process::Child {
        let mut child = std::process::Command::new("sh")
            .args(["-c", "sleep 30; true"])
            .arg(dir.join("pool-x/api.sock"))
            .spawn()
            .unwrap();
        let needle = dir.display().to_string();
        for _ in 0..500 {
            let cmdline =
                std::fs::read(format!("/proc/{}/cmdline", child.id())).unwrap_or_default();
            if String::from_utf8_lossy(&cmdline).contains(&needle) {
                return child;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let _ = child.kill();
        let _ = child.wait();
        panic!("the test child never exec'd");
    }

    #[test]
    fn sweep_kills_pool_processes_but_spares_adopted_ones_and_their_children() {
        let dir = std::env::temp_dir().join(format!("dsec-pool-sweep-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("pool-x")).unwrap();
        let mut stray = naming(&dir);
        let mut adopted = naming(&dir);
        let adopted_pid = adopted.id() as i32;
        // Our own pid adopted: the processes we started count as an adopted VMM's children.
        let mine = std::collections::HashSet::from([std::process::id() as i32]);
        assert_eq!(VmmPool::sweep(&dir, &mine), 0);
        assert!(
            stray.try_wait().unwrap().is_none(),
            "a child of an adopted pid was killed"
        );
        let killed = VmmPool::sweep(&dir, &std::collections::HashSet::from([adopted_pid]));
        // Killed and possibly reaped by the sweep already (it reaps what it kills).
        let stray_killed = stray.wait().map_or(true, |status| !status.success());
        let adopted_alive = adopted.try_wait().unwrap().is_none();
        let _ = adopted.kill();
        let _ = adopted.wait();
        let left = std::fs::read_dir(&dir).unwrap().count();
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(killed, 1);
        assert!(stray_killed, "the stray was not killed");
        assert!(adopted_alive, "an adopted VMM was killed");
        assert_eq!(left, 0, "the pool directory was not emptied");
    }
}
