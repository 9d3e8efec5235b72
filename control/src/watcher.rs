//! The watcher: node health from the store's leases. Every apiserver replica runs one; all
//! their writes are compare-and-swap, so running several is safe (whoever wins a
//! transaction does the work once).
//!
//! - A node's record disappears when its lease expires (it stopped heartbeating) or it
//!   deregisters: each sandbox still reserved on it is marked lost (`/dsec/lost/<id>`) and
//!   its quota returned, in one transaction per sandbox.
//! - A node that (re)appears is asked what it still runs ([`NodeInventory`]); its
//!   reservations are reconciled to that and the lost marks of sandboxes it still runs are
//!   cleared.
//! - On start, every minute, and after any watch failure, it lists everything again: nodes
//!   that hold reservations but are not registered are lost (whatever happened while no
//!   watcher ran, or a create reserved on a node just after it vanished). Every minute it
//!   also reconciles each registered node with what it runs (a create whose apiserver died
//!   between reserving and answering leaves a reservation the node may not back).
//! - The [`Placer`] (if given) follows every change.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::task::JoinSet;

use crate::iam::ProjectPath;
use crate::keys;
use crate::now_ms;
use crate::placement::{NodeAdmin, NodeRecord, Placer};
use crate::quota::{QuotaError, Quotas, RunningSandbox};
use crate::resources::Resources;
use crate::store::{from_json, to_json, EventKind, Op, Store, StoreError};

/// Reservations younger than this are creates that may still be on their way to a node that
/// just came back: they are kept when reconciling it.
pub const RECONCILE_GRACE: Duration = Duration::from_secs(60);

/// A full re-listing this often catches what events cannot: a create reserved on a node
/// just after its lease expired.
pub const RESYNC_EVERY: Duration = Duration::from_secs(60);

/// A sandbox whose node vanished.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LostSandbox {
    pub sandbox: String,
    pub node: String,
    pub project: ProjectPath,
    pub resources: Resources,
    pub lost_ms: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum WatcherError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Quota(#[from] QuotaError),
    #[error("cannot ask node {node} what it runs: {why}")]
    Inventory { node: String, why: String },
}

/// What a node runs, asked when it (re)appears: in the cluster, the node's own List call.
#[async_trait::async_trait]
pub trait NodeInventory: Send + Sync + 'static {
    async fn running(&self, node: &NodeRecord) -> Result<Vec<RunningSandbox>, String>;
}

pub struct Watcher {
    store: Arc<dyn Store>,
    quotas: Quotas,
    inventory: Arc<dyn NodeInventory>,
    placer: Option<Arc<Placer>>,
    /// Nodes registered as of the last event whose inventory was reconciled.
    live: BTreeSet<String>,
    /// How long one inventory call may take ([`INVENTORY_TIMEOUT`]).
    inventory_timeout: Duration,
    /// Registered nodes that did not answer what they run yet (in the placer already): asked
    /// again every [`RETRY_UNRECONCILED`].
    unreconciled: BTreeMap<String, NodeRecord>,
}

/// How often a registered node that did not answer its inventory is asked again.
pub const RETRY_UNRECONCILED: Duration = Duration::from_secs(2);

/// How long the watcher waits for a node to say what it runs: one node that holds the call
/// (its link is down and no reset comes) must not stop the watcher.
pub const INVENTORY_TIMEOUT: Duration = Duration::from_secs(10);

impl std::fmt::Debug for Watcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watcher")
            .field("live", &self.live)
            .field("unreconciled", &self.unreconciled.keys())
            .finish()
    }
}

impl Watcher {
    pub fn new(
        store: Arc<dyn Store>,
        inventory: Arc<dyn NodeInventory>,
        placer: Option<Arc<Placer>>,
    ) -> Self {
        Watcher {
            quotas: Quotas::new(store.clone()),
            store,
            inventory,
            placer,
            live: BTreeSet::new(),
            unreconciled: BTreeMap::new(),
            inventory_timeout: INVENTORY_TIMEOUT,
        }
    }

    /// Gives up on an inventory call after `timeout` instead of [`INVENTORY_TIMEOUT`].
    pub fn with_inventory_timeout(mut self, timeout: Duration) -> Self {
        self.inventory_timeout = timeout;
        self
    }

    /// What `node` runs, or why it did not say within the inventory timeout.
    async fn running(&self, node: &NodeRecord) -> Result<Vec<RunningSandbox>, String> {
        ask_inventory(&*self.inventory, self.inventory_timeout, node).await
    }

    /// Runs until the store fails for good; re-lists after every watch failure.
    pub async fn run(mut self) {
        loop {
            if let Err(e) = self.follow().await {
                tracing::warn!("node watcher: {e}; listing again in 1 s");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }

    /// Lists, then applies node changes until a watch fails.
    async fn follow(&mut self) -> Result<(), WatcherError> {
        let revision = self.resync().await?;
        let mut nodes = self.store.watch(keys::NODES, Some(revision)).await?;
        let mut admin = self.store.watch(keys::NODE_ADMIN, Some(revision)).await?;
        let mut resync =
            tokio::time::interval_at(tokio::time::Instant::now() + RESYNC_EVERY, RESYNC_EVERY);
        let mut retry = tokio::time::interval(RETRY_UNRECONCILED);
        retry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Nodes asked again run in tasks: a silent node holds its call for the whole
        // inventory timeout, and the watch must go on meanwhile.
        let mut asking: JoinSet<(String, Result<Vec<RunningSandbox>, String>)> = JoinSet::new();
        let mut asked = BTreeSet::new();
        loop {
            tokio::select! {
                _ = resync.tick() => {
                    self.resync().await?;
                    self.reconcile_live().await?;
                }
                _ = retry.tick(), if !self.unreconciled.is_empty() => {
                    for record in self.unreconciled.values() {
                        if asked.insert(record.name.clone()) {
                            let (inventory, timeout) = (self.inventory.clone(), self.inventory_timeout);
                            let record = record.clone();
                            asking.spawn(async move {
                                let answer = ask_inventory(&*inventory, timeout, &record).await;
                                (record.name, answer)
                            });
                        }
                    }
                }
                Some(done) = asking.join_next(), if !asking.is_empty() => {
                    let (name, answer) = done.map_err(|e| {
                        StoreError::Unavailable(format!("an inventory task failed: {e}"))
                    })?;
                    asked.remove(&name);
                    // Gone meanwhile, or reconciled by a listing: nothing to do.
                    let Some(record) = self.unreconciled.get(&name).cloned() else { continue };
                    match answer {
                        Ok(running) => self.reconcile_up(record, running).await?,
                        Err(why) => tracing::warn!(
                            "{}; asking again in {} s",
                            WatcherError::Inventory { node: name, why },
                            RETRY_UNRECONCILED.as_secs()
                        ),
                    }
                }
                event = nodes.next() => {
                    let Some(event) = event else { break };
                    let event = event?;
                    let name = event.key.trim_start_matches(keys::NODES).to_string();
                    match event.kind {
                        EventKind::Put => {
                            let record: NodeRecord = serde_json::from_slice(&event.value)
                                .map_err(|e| StoreError::Corrupt {
                                    path: event.key.clone(),
                                    what: format!("unreadable node record: {e}"),
                                })?;
                            if self.unreconciled.contains_key(&record.name) {
                                // The retry tick asks it; a heartbeat must not.
                                if let Some(placer) = &self.placer {
                                    placer.update_node(record.clone());
                                }
                                self.unreconciled.insert(record.name.clone(), record);
                            } else {
                                self.node_up(record).await?;
                            }
                        }
                        EventKind::Delete => self.node_gone(&name).await?,
                    }
                }
                event = admin.next() => {
                    let Some(event) = event else { break };
                    let event = event?;
                    if let Some(placer) = &self.placer {
                        let name = event.key.trim_start_matches(keys::NODE_ADMIN);
                        let flags = serde_json::from_slice(&event.value).unwrap_or_default();
                        placer.set_admin(name, flags);
                    }
                }
            }
        }
        Err(StoreError::Unavailable("a watch ended".to_string()).into())
    }

    /// Rebuilds everything from a full listing; returns the revision to watch from.
    pub async fn resync(&mut self) -> Result<i64, WatcherError> {
        let nodes = self.store.range(keys::NODES).await?;
        let admin = self.store.range(keys::NODE_ADMIN).await?;
        let reservations = self.store.range(keys::RESERVATIONS).await?;
        let mut registered = BTreeSet::new();
        let mut records = Vec::with_capacity(nodes.kvs.len());
        for kv in &nodes.kvs {
            let record: NodeRecord = from_json(kv)?;
            registered.insert(record.name.clone());
            // Every registered node is placeable at once; the inventories (one call to each
            // new node) follow.
            if let Some(placer) = &self.placer {
                placer.update_node(record.clone());
            }
            records.push(record);
        }
        for record in records {
            if let Some(waiting) = self.unreconciled.get_mut(&record.name) {
                // Asked again by the retry tick, off the watch loop.
                *waiting = record;
            } else if !self.live.contains(&record.name) {
                self.node_up(record).await?;
            }
        }
        if let Some(placer) = &self.placer {
            for kv in &admin.kvs {
                let name = kv.key.trim_start_matches(keys::NODE_ADMIN);
                placer.set_admin(name, from_json::<NodeAdmin>(kv)?);
            }
        }
        let mut holders: BTreeSet<String> = reservations
            .kvs
            .iter()
            .filter_map(|kv| kv.key.strip_prefix(keys::RESERVATIONS))
            .filter_map(|rest| rest.split('/').next())
            .map(str::to_string)
            .collect();
        holders.extend(self.live.iter().cloned());
        holders.extend(self.unreconciled.keys().cloned());
        for node in holders.difference(&registered) {
            self.node_gone(node).await?;
        }
        // Watch from the oldest listing: replaying a change twice is harmless.
        Ok(nodes
            .revision
            .min(admin.revision)
            .min(reservations.revision))
    }

    /// Reconciles every registered node with what it runs: creates whose apiserver died
    /// after reserving (the node dropped the sandbox, or never made it) give their quota
    /// back once older than the grace. A node that cannot answer is left for next time.
    /// Then drops the marks of sandboxes deleted long ago.
    async fn reconcile_live(&mut self) -> Result<(), WatcherError> {
        let nodes = self.store.range(keys::NODES).await?;
        for kv in &nodes.kvs {
            let record: NodeRecord = from_json(kv)?;
            match self.running(&record).await {
                Ok(running) => {
                    let reconciled = self
                        .quotas
                        .reconcile_node(&record.name, &running, RECONCILE_GRACE)
                        .await?;
                    self.recheck_charged(&record, &reconciled.charged).await?;
                }
                Err(why) => {
                    tracing::warn!(node = %record.name, %why, "cannot reconcile the node now")
                }
            }
        }
        let forgotten = self
            .quotas
            .forget_deleted(crate::quota::DELETED_KEPT)
            .await?;
        tracing::debug!(forgotten, "marks of deleted sandboxes dropped");
        Ok(())
    }

    /// A registered node: placeable at once; reconciled with what it runs when it answers
    /// (a node that does not is asked again, and the other nodes do not wait for it).
    async fn node_up(&mut self, record: NodeRecord) -> Result<(), WatcherError> {
        let name = record.name.clone();
        if let Some(placer) = &self.placer {
            placer.update_node(record.clone());
        }
        if self.live.contains(&name) {
            return Ok(());
        }
        let running = match self.running(&record).await {
            Ok(running) => running,
            Err(why) => {
                let error = WatcherError::Inventory {
                    node: name.clone(),
                    why,
                };
                tracing::warn!(
                    "{error}; asking again in {} s",
                    RETRY_UNRECONCILED.as_secs()
                );
                self.unreconciled.insert(name, record);
                return Ok(());
            }
        };
        self.reconcile_up(record, running).await
    }

    /// Reconciles a registered node with what it said it runs, clears the lost marks of
    /// those sandboxes and counts it live.
    async fn reconcile_up(
        &mut self,
        record: NodeRecord,
        running: Vec<RunningSandbox>,
    ) -> Result<(), WatcherError> {
        let name = record.name.clone();
        let reconciled = self
            .quotas
            .reconcile_node(&name, &running, RECONCILE_GRACE)
            .await?;
        self.recheck_charged(&record, &reconciled.charged).await?;
        for sandbox in &running {
            self.store.delete(&keys::lost(&sandbox.sandbox)).await?;
        }
        // Live only once reconciled: a store failure above leaves it for the next listing.
        self.unreconciled.remove(&name);
        self.live.insert(name.clone());
        tracing::info!(
            node = %name,
            running = running.len(),
            released = reconciled.released.len(),
            charged = reconciled.charged.len(),
            "node up"
        );
        Ok(())
    }

    /// A sandbox deleted between the node's listing and its charge would keep the charge
    /// (its delete released nothing yet): the sandboxes just charged that the node no longer
    /// lists are released again. Costs a listing only when something was charged.
    async fn recheck_charged(
        &self,
        record: &NodeRecord,
        charged: &[RunningSandbox],
    ) -> Result<(), WatcherError> {
        if charged.is_empty() {
            return Ok(());
        }
        let Ok(running) = self.running(record).await else {
            return Ok(()); // the next reconcile looks again
        };
        for sandbox in charged {
            if !running.iter().any(|r| r.sandbox == sandbox.sandbox) {
                self.quotas.release(&record.name, &sandbox.sandbox).await?;
            }
        }
        Ok(())
    }

    /// Marks every sandbox reserved on a vanished node lost and returns its quota.
    async fn node_gone(&mut self, name: &str) -> Result<(), WatcherError> {
        self.live.remove(name);
        self.unreconciled.remove(name);
        if let Some(placer) = &self.placer {
            placer.remove_node(name);
        }
        let reservations = self.quotas.reservations_on(name).await?;
        let lost_ms = now_ms();
        let mut lost = 0;
        for reservation in reservations {
            let released = self
                .quotas
                .release_with(name, &reservation.sandbox, |r| {
                    let record = LostSandbox {
                        sandbox: r.sandbox.clone(),
                        node: r.node.clone(),
                        project: r.project.clone(),
                        resources: r.resources,
                        lost_ms,
                    };
                    vec![Op::put(keys::lost(&r.sandbox), to_json(&record))]
                })
                .await?;
            lost += released.is_some() as usize;
        }
        if lost > 0 {
            tracing::warn!(node = %name, lost, "node gone: its sandboxes are lost");
        }
        Ok(())
    }
}

/// What `node` runs, or why it did not say within `timeout`.
async fn ask_inventory(
    inventory: &dyn NodeInventory,
    timeout: Duration,
    node: &NodeRecord,
) -> Result<Vec<RunningSandbox>, String> {
    tokio::time::timeout(timeout, inventory.running(node))
        .await
        .unwrap_or_else(|_| {
            Err(format!(
                "no answer in {} ms (is its link up?)",
                timeout.as_millis()
            ))
        })
}

/// The lost mark of a sandbox, if its node vanished.
pub async fn lost_sandbox(
    store: &dyn Store,
    sandbox: &str,
) -> Result<Option<LostSandbox>, StoreError> {
    store
        .get(&keys::lost(sandbox))
        .await?
        .as_ref()
        .map(from_json)
        .transpose()
}

#[cfg(test)]
mod tests;
