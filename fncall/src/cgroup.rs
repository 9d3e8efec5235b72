//! One pre-made cgroup per worker (memory and process limits): created once when the worker
//! starts, which joins it before exec so that every call is born inside (no per-call
//! migration); its memory limit (the idle worker's usage + the call's limit) is rewritten
//! only when a call asks for a different one; removed when the worker goes. cgroup v1
//! (memory + pids hierarchies) or v2.

use std::fs::File;
use std::path::{Path, PathBuf};

const ROOT: &str = "/sys/fs/cgroup";
const PARENT: &str = "dsec-fncall";

#[derive(Debug)]
pub struct CallCgroup {
    /// Where memory.* lives (v1 memory hierarchy, or the v2 group).
    memory: PathBuf,
    /// Where pids.* lives.
    pids: PathBuf,
    v2: bool,
    memory_mib: Option<u32>,
    oom_kills_seen: u64,
    /// Memory the worker's zygote holds, added to each call's limit.
    baseline: u64,
}

fn write(path: &Path, value: &str) -> std::io::Result<()> {
    std::fs::write(path, value)
        .map_err(|e| std::io::Error::new(e.kind(), format!("write {}: {e}", path.display())))
}

fn is_v2() -> bool {
    Path::new(ROOT).join("cgroup.controllers").exists()
}

impl CallCgroup {
    pub fn create(name: &str, max_processes: u32) -> std::io::Result<Self> {
        let v2 = is_v2();
        let (memory, pids) = if v2 {
            let dir = Path::new(ROOT).join(PARENT).join(name);
            let parent = Path::new(ROOT).join(PARENT);
            std::fs::create_dir_all(&dir)?;
            // Controllers must be enabled in the parent for the child to have them.
            let _ = write(
                &Path::new(ROOT).join("cgroup.subtree_control"),
                "+memory +pids",
            );
            let _ = write(&parent.join("cgroup.subtree_control"), "+memory +pids");
            (dir.clone(), dir)
        } else {
            let memory = Path::new(ROOT).join("memory").join(PARENT).join(name);
            let pids = Path::new(ROOT).join("pids").join(PARENT).join(name);
            std::fs::create_dir_all(&memory)?;
            std::fs::create_dir_all(&pids)?;
            (memory, pids)
        };
        write(&pids.join("pids.max"), &max_processes.to_string())?;
        Ok(Self {
            memory,
            pids,
            v2,
            memory_mib: None,
            oom_kills_seen: 0,
            baseline: 0,
        })
    }

    /// Stands in for a group already handed off for removal.
    pub fn placeholder() -> Self {
        Self {
            memory: PathBuf::new(),
            pids: PathBuf::new(),
            v2: false,
            memory_mib: None,
            oom_kills_seen: 0,
            baseline: 0,
        }
    }

    /// Takes the group's current usage (the idle worker) as what calls are limited on top of.
    pub fn record_baseline(&mut self) {
        let file = if self.v2 {
            "memory.current"
        } else {
            "memory.usage_in_bytes"
        };
        self.baseline = std::fs::read_to_string(self.memory.join(file))
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
    }

    /// The `cgroup.procs` files a call's init writes "0" to, joining them.
    pub fn procs_files(&self) -> std::io::Result<Vec<File>> {
        let mut dirs = vec![&self.memory];
        if self.pids != self.memory {
            dirs.push(&self.pids);
        }
        dirs.iter()
            .map(|d| {
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(d.join("cgroup.procs"))
            })
            .collect()
    }

    pub fn set_memory(&mut self, mib: u32) -> std::io::Result<()> {
        if self.memory_mib == Some(mib) {
            return Ok(());
        }
        let bytes = (self.baseline + (u64::from(mib) << 20)).to_string();
        if self.v2 {
            write(&self.memory.join("memory.max"), &bytes)?;
            let _ = write(&self.memory.join("memory.swap.max"), "0");
        } else {
            // With swap accounting, memory+swap must stay >= memory: order the writes.
            let memsw = self.memory.join("memory.memsw.limit_in_bytes");
            let raising = self.memory_mib.is_some_and(|old| mib > old); // None: unlimited
            if raising && memsw.exists() {
                write(&memsw, &bytes)?;
            }
            write(&self.memory.join("memory.limit_in_bytes"), &bytes)?;
            if !raising && memsw.exists() {
                write(&memsw, &bytes)?;
            }
        }
        self.memory_mib = Some(mib);
        Ok(())
    }

    /// Whether the OOM killer acted in this cgroup since the last look.
    pub fn oom_killed_since_last(&mut self) -> bool {
        let file = if self.v2 {
            "memory.events"
        } else {
            "memory.oom_control"
        };
        let count = std::fs::read_to_string(self.memory.join(file))
            .ok()
            .and_then(|text| {
                text.lines()
                    .find_map(|l| l.strip_prefix("oom_kill "))
                    .and_then(|n| n.trim().parse::<u64>().ok())
            })
            .unwrap_or(0);
        let killed = count > self.oom_kills_seen;
        self.oom_kills_seen = count;
        killed
    }

    /// Removes the groups; they must be empty (the worker and its calls gone).
    pub fn remove(&self) -> bool {
        let mut ok = std::fs::remove_dir(&self.memory).is_ok();
        if self.pids != self.memory {
            ok &= std::fs::remove_dir(&self.pids).is_ok();
        }
        ok
    }
}

/// A worker's group name: the engine's pid first, so that `sweep_stale` can tell the groups
/// of live engines (several may share a node) from those of dead ones.
pub fn group_name(worker: u64) -> String {
    format!("{}-w{worker}", std::process::id())
}

/// Removes the groups engines that are gone left behind (they crashed or were killed).
/// Processes still in such a group (a dead engine's workers on their way out) are killed;
/// a group they have not left yet is removed by a background thread once they have.
pub fn sweep_stale() {
    let parents = if is_v2() {
        vec![Path::new(ROOT).join(PARENT)]
    } else {
        vec![
            Path::new(ROOT).join("memory").join(PARENT),
            Path::new(ROOT).join("pids").join(PARENT),
        ]
    };
    let mut busy = Vec::new();
    for parent in parents {
        let Ok(entries) = std::fs::read_dir(&parent) else {
            continue;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let owner = name.split('-').next().unwrap_or("");
            let owner_alive = !owner.is_empty() && Path::new("/proc").join(owner).exists();
            let group = entry.path();
            if group.is_dir() && !owner_alive && std::fs::remove_dir(&group).is_err() {
                kill_members(&group);
                busy.push(group);
            }
        }
    }
    if !busy.is_empty() {
        std::thread::spawn(move || remove_when_empty(busy, STALE_GROUP_PATIENCE));
    }
}

/// How long a dead engine's group may take to empty after its members were killed.
const STALE_GROUP_PATIENCE: std::time::Duration = std::time::Duration::from_secs(10);

/// SIGKILLs every process in `group` (none of them belongs to a live engine).
fn kill_members(group: &Path) {
    let Ok(procs) = std::fs::read_to_string(group.join("cgroup.procs")) else {
        return;
    };
    for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
        // SAFETY: kill(2) takes plain integers and touches no memory of ours.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
}

/// Retries `rmdir` of each group until it succeeds, the group is gone, or `patience` ends.
fn remove_when_empty(mut groups: Vec<PathBuf>, patience: std::time::Duration) {
    let deadline = std::time::Instant::now() + patience;
    while !groups.is_empty() {
        groups.retain(|g| g.exists() && std::fs::remove_dir(g).is_err());
        if std::time::Instant::now() >= deadline {
            for group in &groups {
                tracing::warn!(group = %group.display(), "a dead engine's cgroup did not empty");
            }
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::CommandExt;

    /// A dead engine's group that still holds a process (a worker on its way out when the
    /// engine was killed) is emptied and removed by the next engine's sweep.
    #[test]
    fn a_dead_engines_busy_group_is_emptied_and_removed() {
        if !nix::unistd::Uid::effective().is_root() {
            eprintln!("skipped: needs root for cgroups");
            return;
        }
        // pid 0 is never a live process: this group's engine is dead.
        let name = format!("0-w{}", std::process::id());
        let group = CallCgroup::create(&name, 16).expect("create a worker cgroup");
        let procs = group.pids.join("cgroup.procs");
        let memory_procs = group.memory.join("cgroup.procs");
        // "0" moves the writing process itself.
        let join = move || {
            std::fs::write(&procs, b"0")?;
            if memory_procs != procs {
                std::fs::write(&memory_procs, b"0")?;
            }
            Ok(())
        };
        // SAFETY: between fork and exec the closure only writes to files whose paths were
        // built before the fork.
        let mut member = unsafe {
            std::process::Command::new("sleep")
                .arg("60")
                .pre_exec(join)
                .spawn()
                .expect("spawn a member")
        };
        sweep_stale();

        let status = member.wait().expect("wait for the member");
        assert!(!status.success(), "the sweep did not kill the member");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while group.pids.exists() || group.memory.exists() {
            assert!(
                std::time::Instant::now() < deadline,
                "the dead engine's group was not removed"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}
