//! Sandboxes a node runs without a reservation, found from its heartbeats: a create whose
//! apiserver died between the node's create and the reservation's commit (the create goes to
//! the node while its reservation commits) is charged within a few heartbeats instead of at
//! the watcher's next full reconcile (every minute).
//!
//! Each replica remembers, per node, the sandboxes it knows hold a reservation (its own
//! creates, and what it read); a heartbeat listing others makes it read the node's
//! reservations once (off the heartbeat's path, one read at a time per node). A sandbox still
//! unreserved [`GRACE`] after it was first seen so is charged: the grace lets a create whose
//! commit is under way (or that is being undone) finish first.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::now_ms;
use crate::quota::{Quotas, RunningSandbox};

/// How long a sandbox may be seen without a reservation before it is charged.
pub const GRACE: Duration = Duration::from_secs(2);

#[derive(Default)]
struct NodeState {
    /// Sandboxes known to hold a reservation.
    reserved: HashSet<String>,
    /// Sandboxes seen without one: when first seen (ms).
    suspects: HashMap<String, u64>,
    /// A read of the node's reservations is under way.
    checking: bool,
}

/// One replica's per-node view (see the module's text).
#[derive(Clone, Default)]
pub struct UnreservedCheck {
    nodes: Arc<Mutex<HashMap<String, NodeState>>>,
}

impl std::fmt::Debug for UnreservedCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("UnreservedCheck")
    }
}

impl UnreservedCheck {
    fn with_nodes<T>(&self, f: impl FnOnce(&mut HashMap<String, NodeState>) -> T) -> T {
        f(&mut self.nodes.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// A create of this replica committed the reservation of `sandbox` on `node`.
    pub fn reserved(&self, node: &str, sandbox: &str) {
        self.with_nodes(|nodes| {
            if let Some(state) = nodes.get_mut(node) {
                state.reserved.insert(sandbox.to_string());
            }
        });
    }

    /// The node's heartbeat listed `running`: forget what it no longer runs and, when it runs
    /// sandboxes not known to be reserved, check them against the store in the background.
    pub fn heartbeat(&self, quotas: &Quotas, node: &str, running: Vec<RunningSandbox>) {
        let unknown: Vec<RunningSandbox> = self.with_nodes(|nodes| {
            let state = nodes.entry(node.to_string()).or_default();
            let listed: HashSet<&str> = running.iter().map(|r| r.sandbox.as_str()).collect();
            state.reserved.retain(|id| listed.contains(id.as_str()));
            state.suspects.retain(|id, _| listed.contains(id.as_str()));
            if state.checking {
                return Vec::new();
            }
            let unknown: Vec<RunningSandbox> = running
                .into_iter()
                .filter(|r| !state.reserved.contains(&r.sandbox))
                .collect();
            state.checking = !unknown.is_empty();
            unknown
        });
        if unknown.is_empty() {
            return;
        }
        let (check, quotas, node) = (self.clone(), quotas.clone(), node.to_string());
        tokio::spawn(async move {
            if let Err(e) = check.check(&quotas, &node, unknown).await {
                tracing::warn!(%node, %e, "cannot check the node's sandboxes against their reservations; the next heartbeat tries again");
            }
            check.with_nodes(|nodes| {
                if let Some(state) = nodes.get_mut(&node) {
                    state.checking = false;
                }
            });
        });
    }

    async fn check(
        &self,
        quotas: &Quotas,
        node: &str,
        unknown: Vec<RunningSandbox>,
    ) -> Result<(), crate::quota::QuotaError> {
        let filed: HashSet<String> = quotas
            .reservations_on(node)
            .await?
            .into_iter()
            .map(|r| r.sandbox)
            .collect();
        let now = now_ms();
        let grace = GRACE.as_millis() as u64;
        let due: Vec<RunningSandbox> = self.with_nodes(|nodes| {
            let state = nodes.entry(node.to_string()).or_default();
            let mut due = Vec::new();
            for sandbox in unknown {
                if filed.contains(&sandbox.sandbox) {
                    state.suspects.remove(&sandbox.sandbox);
                    state.reserved.insert(sandbox.sandbox);
                    continue;
                }
                let first_seen = *state.suspects.entry(sandbox.sandbox.clone()).or_insert(now);
                if now.saturating_sub(first_seen) >= grace {
                    due.push(sandbox);
                }
            }
            due
        });
        for sandbox in due {
            if quotas.charge_if_unreserved(node, &sandbox).await? {
                tracing::warn!(%node, sandbox = %sandbox.sandbox, project = %sandbox.project, "charged a sandbox its node runs without a reservation (its create's apiserver stopped before the commit)");
            }
            self.with_nodes(|nodes| {
                if let Some(state) = nodes.get_mut(node) {
                    state.suspects.remove(&sandbox.sandbox);
                    state.reserved.insert(sandbox.sandbox);
                }
            });
        }
        Ok(())
    }
}
