//! Admission: what a sandbox reserves (its memory cgroup limit, vCPUs, pids, disk) against
//! the node's budgets, which are capacity x overcommit.

use std::path::Path;
use std::sync::atomic::Ordering;

use super::cgroup::{self, Limits};
use super::error::NodeError;
use super::node::Node;
use super::DaemonConfig;
use crate::backend::BackendKind;

/// Charged to a microVM's memory cgroup besides guest memory: the VMM's own memory.
pub const MICROVM_OVERHEAD_MIB: i64 = cgroup::MICROVM_OVERHEAD_MIB as i64;

/// The memory cgroup limit of a sandbox, in MiB, and so what admission reserves for it:
/// whatever the cgroup is charged must be in the budget ([`Limits::for_sandbox`], which
/// `dsec run` uses too). On a disk image a microVM's upper disk is charged as well.
pub fn memory_limit_mib(kind: BackendKind, memory_mib: i64, disk_mib: i64, on_disk: bool) -> i64 {
    let charged_disk = match kind {
        BackendKind::Container => disk_mib,
        BackendKind::MicroVm if on_disk => disk_mib,
        BackendKind::MicroVm => 0,
    };
    let limits = Limits::for_sandbox(
        kind,
        memory_mib.max(0) as u64,
        charged_disk.max(0) as u64,
        1,
        0,
    );
    (limits.memory_bytes >> 20) as i64
}

/// Resources a sandbox reserves at admission.
#[derive(Clone, Copy, Debug, Default)]
pub struct Demand {
    pub memory_mib: i64,
    pub vcpus: i64,
    pub pids: i64,
    pub disk_mib: i64,
}

#[derive(Clone, Copy, Debug, Default)]
pub struct Budget {
    pub limit: i64,
    pub reserved: i64,
}

#[derive(Debug, Default)]
pub struct Budgets {
    pub memory_mib: Budget,
    pub vcpus: Budget,
    pub pids: Budget,
    pub disk_mib: Budget,
}

impl Budgets {
    /// The node's budgets: its capacity (or what the config gives) times the overcommit
    /// ratios; the disk budget from the free space under `sandboxes_dir`.
    pub fn for_node(config: &DaemonConfig, sandboxes_dir: &Path) -> Self {
        let cores = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1) as f64;
        let host_mib = crate::backend::spec::host_memory_mib().unwrap_or(1024) as f64;
        Budgets {
            memory_mib: Budget {
                limit: (config.memory_mib.map(|m| m as f64).unwrap_or(host_mib)
                    * config.overcommit_memory) as i64,
                reserved: 0,
            },
            vcpus: Budget {
                limit: (config.cpus.map(|c| c as f64).unwrap_or(cores) * config.overcommit_cpu)
                    as i64,
                reserved: 0,
            },
            pids: Budget {
                limit: config.pids.unwrap_or_else(default_pid_budget) as i64,
                reserved: 0,
            },
            disk_mib: Budget {
                limit: (config
                    .disk_mib
                    .unwrap_or_else(|| free_disk_mib(sandboxes_dir)) as f64
                    * config.overcommit_disk) as i64,
                reserved: 0,
            },
        }
    }

    fn all(&mut self) -> [(&'static str, &'static str, &mut Budget, i64); 4] {
        [
            ("memory", "MiB of memory", &mut self.memory_mib, 0),
            ("cpu", "vCPUs", &mut self.vcpus, 0),
            ("pids", "pids", &mut self.pids, 0),
            ("disk", "MiB of disk", &mut self.disk_mib, 0),
        ]
    }

    /// Reserves `d` or says which budget is spent. `force` (adoption) never refuses.
    pub(super) fn reserve(&mut self, d: Demand, force: bool) -> Result<(), (usize, String)> {
        let wants = [d.memory_mib, d.vcpus, d.pids, d.disk_mib];
        if !force {
            for (i, (name, unit, budget, _)) in self.all().into_iter().enumerate() {
                if budget.reserved + wants[i] > budget.limit {
                    let why = if i == 0 {
                        " (its memory cgroup limit: memory plus a container's disk, a tmpfs charged to its memory, or a microVM's VMM overhead)"
                    } else {
                        ""
                    };
                    return Err((
                        i,
                        format!(
                            "node {name} budget spent: {} of {} {unit} reserved, this sandbox needs {}{why}; delete sandboxes, ask for less, or start the daemon with a larger budget/overcommit ratio",
                            budget.reserved, budget.limit, wants[i]
                        ),
                    ));
                }
            }
        }
        for (i, (_, _, budget, _)) in self.all().into_iter().enumerate() {
            budget.reserved += wants[i];
        }
        Ok(())
    }

    pub(super) fn release(&mut self, d: Demand) {
        let wants = [d.memory_mib, d.vcpus, d.pids, d.disk_mib];
        for (i, (_, _, budget, _)) in self.all().into_iter().enumerate() {
            budget.reserved = (budget.reserved - wants[i]).max(0);
        }
    }
}

impl Node {
    pub(super) fn reserve(&self, demand: Demand) -> Result<(), NodeError> {
        self.budgets
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .reserve(demand, false)
            .map_err(|(which, message)| {
                self.metrics.admission_rejections[which].fetch_add(1, Ordering::Relaxed);
                NodeError::BudgetSpent(message)
            })
    }

    pub(super) fn release(&self, demand: Demand) {
        self.budgets
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .release(demand);
    }
}

/// Per-sandbox pid limits are ceilings most sandboxes never approach, so their sum may
/// exceed pid_max: 8x overcommit.
fn default_pid_budget() -> u64 {
    std::fs::read_to_string("/proc/sys/kernel/pid_max")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .unwrap_or(32768)
        * 8
}

fn free_disk_mib(path: &Path) -> u64 {
    nix::sys::statvfs::statvfs(path)
        .map(|s| s.blocks_available() * s.fragment_size() / (1024 * 1024))
        .unwrap_or(10 * 1024)
}
