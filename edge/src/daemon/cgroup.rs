//! Per-sandbox cgroups: memory, pids and CPU limits, freezing (pause), usage figures.
//!
//! Works on cgroup v1 (one hierarchy per controller; freezing through the v1 freezer, or the
//! v2 `cgroup.freeze` of a hybrid host's unified mount when there is no v1 freezer) and on a
//! pure v2 host. Sandbox cgroups live under `<daemon's own cgroup>/<name>/<sandbox id>` in
//! each hierarchy, so they nest inside whatever the daemon was started in.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::error::{EdgeError, Result};

const ROOT: &str = "/sys/fs/cgroup";

/// Limits applied to one sandbox.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub memory_bytes: u64,
    pub pids: u64,
    pub vcpus: u32,
}

/// Charged to a microVM's memory cgroup besides guest memory: the VMM's own memory.
pub const MICROVM_OVERHEAD_MIB: u64 = 64;

impl Limits {
    /// The limits of a sandbox, the same for the daemon's and `dsec run`'s: its memory plus
    /// what else is charged to its cgroup (a container's tmpfs writable layer of
    /// `charged_disk_mib`; a microVM's VMM overhead, 64 MiB, and on a disk image its upper
    /// disk's pages), its process limit (a VMM needs a few threads per vCPU) and vCPUs.
    pub fn for_sandbox(
        kind: crate::BackendKind,
        memory_mib: u64,
        charged_disk_mib: u64,
        vcpus: u32,
        pids: u64,
    ) -> Self {
        let (memory_mib, pids) = match kind {
            crate::BackendKind::Container => (memory_mib + charged_disk_mib, pids),
            crate::BackendKind::MicroVm => (
                memory_mib + MICROVM_OVERHEAD_MIB + charged_disk_mib,
                64 + u64::from(vcpus),
            ),
        };
        Self {
            memory_bytes: memory_mib * 1024 * 1024,
            pids,
            vcpus,
        }
    }
}

/// The parent cgroups of this daemon's sandboxes, one per hierarchy used.
#[derive(Clone, Debug, Default)]
pub struct Cgroups {
    parents: Vec<PathBuf>,
}

/// Own cgroup path for `controller` (v1) or the v2 path ("" controller), from /proc/self/cgroup.
fn own_path(controller: &str) -> Option<String> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    text.lines().find_map(|line| {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let matches = if controller.is_empty() {
            controllers.is_empty()
        } else {
            controllers.split(',').any(|c| c == controller)
        };
        matches.then(|| path.to_string())
    })
}

impl Cgroups {
    /// Finds the hierarchies and creates `<own cgroup>/<name>` in each. Missing or read-only
    /// cgroup filesystems leave the set empty (sandboxes then run without limits; logged).
    pub fn detect(name: &str) -> Self {
        let mut parents = Vec::new();
        let pure_v2 = Path::new(ROOT).join("cgroup.controllers").exists();
        if pure_v2 {
            if let Some(own) = own_path("") {
                let parent = Path::new(ROOT).join(own.trim_start_matches('/')).join(name);
                // Controllers must be enabled for children; best effort.
                let _ = std::fs::create_dir_all(&parent);
                let _ = std::fs::write(parent.join("cgroup.subtree_control"), "+memory +pids +cpu");
                parents.push(parent);
            }
        } else {
            let mut have_freezer = false;
            for controller in ["memory", "pids", "cpu", "cpuacct", "freezer"] {
                let mount = Path::new(ROOT).join(controller);
                if !mount.join("cgroup.procs").exists() {
                    continue;
                }
                let own = own_path(controller).unwrap_or_else(|| "/".into());
                parents.push(mount.join(own.trim_start_matches('/')).join(name));
                have_freezer |= controller == "freezer";
            }
            let unified = Path::new(ROOT).join("unified");
            if !have_freezer && unified.join("cgroup.procs").exists() {
                let own = own_path("").unwrap_or_else(|| "/".into());
                parents.push(unified.join(own.trim_start_matches('/')).join(name));
            }
        }
        parents.retain(|p| match std::fs::create_dir_all(p) {
            Ok(()) => true,
            Err(err) => {
                tracing::warn!(path = %p.display(), %err, "cgroup hierarchy unusable; skipping it");
                false
            }
        });
        if parents.is_empty() {
            tracing::warn!("no usable cgroup hierarchy: sandboxes run without resource limits");
        }
        Self { parents }
    }

    /// Creates the sandbox's cgroups with `limits`; returns their directories.
    pub fn create(&self, id: &str, limits: Limits) -> Result<Vec<PathBuf>> {
        let mut made = Vec::new();
        for parent in &self.parents {
            let dir = parent.join(id);
            if let Err(e) = std::fs::create_dir(&dir) {
                remove(&made);
                return Err(EdgeError::io(format!("create cgroup {}", dir.display()), e));
            }
            made.push(dir.clone());
            if let Err(err) = apply_limits(&dir, limits) {
                remove(&made);
                return Err(err);
            }
        }
        Ok(made)
    }

    /// The directories `create(id, ..)` made (whether they exist or not).
    pub fn dirs(&self, id: &str) -> Vec<PathBuf> {
        self.parents.iter().map(|p| p.join(id)).collect()
    }

    /// Children of the parents whose names are not in `keep`: killed and removed (leftovers of
    /// a daemon that died).
    pub fn sweep(&self, keep: &HashSet<String>) -> usize {
        let mut stale = Vec::new();
        for parent in &self.parents {
            if let Ok(entries) = std::fs::read_dir(parent) {
                for entry in entries.flatten() {
                    let name = entry.file_name().to_string_lossy().into_owned();
                    if entry.path().is_dir() && !keep.contains(&name) {
                        stale.push(entry.path());
                    }
                }
            }
        }
        let count = stale.len();
        remove(&stale);
        count
    }
}

fn write(dir: &Path, file: &str, value: &str) -> Result<()> {
    std::fs::write(dir.join(file), value)
        .map_err(|e| EdgeError::io(format!("write {value:?} to {}/{file}", dir.display()), e))
}

fn apply_limits(dir: &Path, limits: Limits) -> Result<()> {
    if dir.join("memory.limit_in_bytes").exists() {
        write(
            dir,
            "memory.limit_in_bytes",
            &limits.memory_bytes.to_string(),
        )?;
    } else if dir.join("memory.max").exists() {
        write(dir, "memory.max", &limits.memory_bytes.to_string())?;
    }
    if dir.join("pids.max").exists() {
        write(dir, "pids.max", &limits.pids.to_string())?;
    }
    let period = 100_000u64;
    let quota = period * u64::from(limits.vcpus.max(1));
    if dir.join("cpu.cfs_quota_us").exists() {
        write(dir, "cpu.cfs_quota_us", &quota.to_string())?;
    } else if dir.join("cpu.max").exists() {
        write(dir, "cpu.max", &format!("{quota} {period}"))?;
    }
    Ok(())
}

/// `cgroup.procs` of each directory (what a new sandbox process is written into).
pub fn procs_files(dirs: &[PathBuf]) -> Vec<PathBuf> {
    dirs.iter().map(|d| d.join("cgroup.procs")).collect()
}

/// Freezes (true) or thaws every process of the sandbox and waits until it took effect.
pub fn set_frozen(dirs: &[PathBuf], frozen: bool) -> Result<()> {
    for dir in dirs {
        if dir.join("freezer.state").exists() {
            let want = if frozen { "FROZEN" } else { "THAWED" };
            write(dir, "freezer.state", want)?;
            let deadline = Instant::now() + Duration::from_secs(5);
            loop {
                let state = std::fs::read_to_string(dir.join("freezer.state")).unwrap_or_default();
                if state.trim() == want {
                    break;
                }
                if Instant::now() > deadline {
                    return Err(EdgeError::Protocol(format!(
                        "{}: freezer stuck in {} (wanted {want})",
                        dir.display(),
                        state.trim()
                    )));
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            return Ok(());
        }
        if dir.join("cgroup.freeze").exists() {
            write(dir, "cgroup.freeze", if frozen { "1" } else { "0" })?;
            return Ok(());
        }
    }
    Err(EdgeError::BackendUnavailable {
        backend: "container",
        reason: "no freezer cgroup (v1 freezer or v2 cgroup.freeze) is available to pause it"
            .into(),
    })
}

/// The memory limit in force (v1 memory.limit_in_bytes, v2 memory.max), if one is set.
pub fn memory_limit(dirs: &[PathBuf]) -> Option<u64> {
    dirs.iter().find_map(|dir| {
        ["memory.limit_in_bytes", "memory.max"]
            .iter()
            .find_map(|f| {
                std::fs::read_to_string(dir.join(f))
                    .ok()?
                    .trim()
                    .parse()
                    .ok()
            })
    })
}

/// How often the memory cgroup's OOM killer struck (`oom_kill` of v1 memory.oom_control or v2
/// memory.events), if the kernel says.
pub fn oom_kills(dirs: &[PathBuf]) -> Option<u64> {
    dirs.iter().find_map(|dir| {
        ["memory.oom_control", "memory.events"]
            .iter()
            .find_map(|f| {
                std::fs::read_to_string(dir.join(f))
                    .ok()?
                    .lines()
                    .find_map(|l| l.strip_prefix("oom_kill "))?
                    .trim()
                    .parse()
                    .ok()
            })
    })
}

/// Memory in use (bytes), CPU time (ns) and number of processes.
pub fn usage(dirs: &[PathBuf]) -> (u64, u64, u64) {
    let read = |p: PathBuf| -> Option<u64> {
        std::fs::read_to_string(p)
            .ok()?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    };
    let (mut mem, mut cpu, mut pids) = (0, 0, 0);
    for dir in dirs {
        if let Some(v) =
            read(dir.join("memory.usage_in_bytes")).or_else(|| read(dir.join("memory.current")))
        {
            mem = v;
        }
        if let Some(v) = read(dir.join("cpuacct.usage")) {
            cpu = v;
        } else if let Ok(stat) = std::fs::read_to_string(dir.join("cpu.stat")) {
            if let Some(usec) = stat
                .lines()
                .find_map(|l| l.strip_prefix("usage_usec "))
                .and_then(|v| v.trim().parse::<u64>().ok())
            {
                cpu = usec * 1000;
            }
        }
        if let Some(v) = read(dir.join("pids.current")) {
            pids = v;
        }
    }
    (mem, cpu, pids)
}

/// Kills whatever is left in the cgroups (thawing them first) and removes them.
pub fn remove(dirs: &[PathBuf]) {
    for dir in dirs {
        if dir.join("freezer.state").exists() {
            let _ = std::fs::write(dir.join("freezer.state"), "THAWED");
        }
        if dir.join("cgroup.freeze").exists() {
            let _ = std::fs::write(dir.join("cgroup.freeze"), "0");
        }
    }
    for dir in dirs {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
            for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            match std::fs::remove_dir(dir) {
                Ok(()) => break,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
                Err(err) if Instant::now() > deadline => {
                    tracing::warn!(cgroup = %dir.display(), %err, "cannot remove cgroup");
                    break;
                }
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    }
}
