//! Adoption after a restart: live sandboxes a previous daemon left are taken over (pid and
//! start time checked); everything else it left (half-created sandboxes, processes whose
//! command line or environment references a sandbox directory, cgroups, directories) goes.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::cgroup;
use super::node::Node;
use super::record::{append_event, new_access_token, Entry, Record};
use super::request_ids::RequestState;
use crate::client::AgentClient;

impl Node {
    pub(super) async fn adopt(self: &Arc<Self>) {
        let dir = Self::sandboxes_dir(&self.config);
        // Image servers first: a sandbox whose image mount is gone cannot read its root.
        let servers = self.images.recover();
        let mut image_users: HashMap<String, usize> = HashMap::new();
        let mut kept = HashSet::new();
        let mut stale: Vec<(PathBuf, Option<Record>)> = Vec::new();
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if !path.is_dir() {
                continue;
            }
            let record: Option<Record> = std::fs::read(path.join("meta.json"))
                .ok()
                .and_then(|d| serde_json::from_slice(&d).ok());
            match record {
                Some(mut record)
                    if record.is_alive()
                        && record
                            .image_mount
                            .as_ref()
                            .is_none_or(|m| servers.contains_key(m)) =>
                {
                    if let Some(m) = &record.image_mount {
                        *image_users.entry(m.clone()).or_default() += 1;
                    }
                    let id = record.handle.id.clone();
                    let client = AgentClient::connect_lazy(record.handle.agent_addr());
                    let _ = self
                        .budgets
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .reserve(record.demand(), true);
                    if record.access_token.is_empty() {
                        // A record of a daemon from before access tokens.
                        record.access_token = new_access_token();
                        let _ = record.persist();
                    }
                    if !record.request_id.is_empty() {
                        self.requests().insert(
                            record.request_id.clone(),
                            RequestState::Done {
                                fingerprint: record.request_fingerprint.clone(),
                                id: id.clone(),
                            },
                        );
                    }
                    append_event(&record.handle.dir, "adopted by a restarted daemon");
                    tracing::info!(sandbox = %id, pid = record.handle.pid, "adopted");
                    let entry = Entry::new(record, client);
                    kept.insert(id.clone());
                    self.lock().insert(id, entry);
                    self.metrics.adopted_total.fetch_add(1, Ordering::Relaxed);
                }
                other => stale.push((path, other)),
            }
        }
        // Processes started for sandboxes that are not adopted (creates in flight when the
        // previous daemon died, or whose record is gone) reference their directory.
        let mut killed = kill_strays(&dir, &kept);
        // Prewarmed VMMs no sandbox took; the ones that were taken serve adopted sandboxes
        // under their pool names (jail root, snapshot directory), which stay.
        let adopted_pids: HashSet<i32> =
            self.list().iter().map(|e| e.record().handle.pid).collect();
        killed += crate::backend::vmm_pool::VmmPool::sweep(
            &Self::vmm_pool_dir(&self.config),
            &adopted_pids,
        );
        let mut kept_names = kept.clone();
        for entry in self.list() {
            let handle = entry.record().handle;
            for path in [&handle.jail_root, &handle.snapshot_dir]
                .into_iter()
                .flatten()
            {
                if let Some(name) = path.file_name() {
                    kept_names.insert(name.to_string_lossy().into_owned());
                }
            }
        }
        for (path, record) in &stale {
            if let Some(record) = record {
                let _ = record.handle.teardown();
                cgroup::remove(&record.cgroups);
            }
            crate::idpool::release(path);
            crate::net::release(path);
            let _ = std::fs::remove_dir_all(path);
        }
        // Jail roots of sandboxes that are gone (their VMMs were killed above); empty
        // snapshot directories too (ones holding snapshots stay).
        if let Some(jail) = &self.edge.jail {
            for entry in std::fs::read_dir(&jail.roots)
                .into_iter()
                .flatten()
                .flatten()
            {
                if !kept_names.contains(entry.file_name().to_string_lossy().as_ref()) {
                    let _ = std::fs::remove_dir_all(entry.path());
                }
            }
            for entry in std::fs::read_dir(&jail.snapshots)
                .into_iter()
                .flatten()
                .flatten()
            {
                if !kept_names.contains(entry.file_name().to_string_lossy().as_ref()) {
                    let _ = std::fs::remove_dir(entry.path());
                }
            }
        }
        if let Some(net) = self.edge.network.clone() {
            // The table again with the adopted sandboxes' policies; veths of others go.
            let live: Vec<_> = self
                .list()
                .iter()
                .filter_map(|e| {
                    let record = e.record();
                    let addr = crate::net::address(&record.handle.dir)?;
                    Some((addr, super::network::recorded_policy(self, &record)))
                })
                .collect();
            match tokio::task::spawn_blocking(move || net.adopt(&live)).await {
                Ok(Ok(())) => {}
                Ok(Err(err)) => tracing::error!(%err, "cannot restore the sandbox network's rules"),
                Err(err) => tracing::error!(%err, "network adoption task failed"),
            }
        }
        let cgroups = self.cgroups.sweep(&kept);
        self.images.adopted(servers, &image_users).await;
        tracing::info!(
            adopted = kept.len(),
            removed_dirs = stale.len(),
            killed_processes = killed,
            removed_cgroups = cgroups,
            "state recovered"
        );
    }
}

/// Kills processes whose command line or environment references a sandbox directory under `dir` that is not
/// in `keep`. Returns how many were killed.
fn kill_strays(dir: &Path, keep: &HashSet<String>) -> usize {
    let prefix = format!("{}/", dir.display());
    let me = std::process::id() as i32;
    let mut killed = 0;
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        if pid == me {
            continue;
        }
        // A VMM names its sandbox directory on its command line; a container's agent (whose
        // command line must not show host paths) in its environment.
        let Some((text, pos)) = ["cmdline", "environ"].iter().find_map(|file| {
            let bytes = std::fs::read(format!("/proc/{pid}/{file}")).ok()?;
            let text = String::from_utf8_lossy(&bytes).into_owned();
            let pos = text.find(&prefix)?;
            Some((text, pos))
        }) else {
            continue;
        };
        let id: String = text[pos + prefix.len()..]
            .chars()
            .take_while(|c| *c != '/' && *c != '\0')
            .collect();
        if keep.contains(&id) {
            continue;
        }
        tracing::info!(pid, sandbox = %id, "killing a process of a sandbox that was not adopted");
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
        let _ = nix::sys::wait::waitpid(
            nix::unistd::Pid::from_raw(pid),
            Some(nix::sys::wait::WaitPidFlag::WNOHANG),
        );
        killed += 1;
    }
    killed
}
