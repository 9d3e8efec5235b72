//! Nested, delegated quotas. Each project has a limit, what its own sandboxes use, and what
//! it has delegated to its children (the sum of their limits): a child's limit is carved out
//! of what its parent has left, so a reservation only ever touches its own project's record
//! (one compare-and-swap, no contention across projects). A project without a record has a
//! zero limit; an organization's limit is set by a cluster admin (unlimited on a single
//! machine's default organization).
//!
//! Each sandbox's reservation is its own key, filed under its node, written in the same
//! transaction as the usage: usage is exact after any crash (reconcile a node's reservations
//! against what the node reports it runs) and a vanished node's quota is found and returned
//! with one range.

mod batch;

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::iam::ProjectPath;
use crate::keys;
use crate::now_ms;
use crate::resources::Resources;
use crate::store::{from_json, to_json, Compare, KeyValue, Op, Store, StoreError, Txn};

pub use batch::{Reserver, BATCH_MAX};

/// A read-check-write is retried this often under contention before `Contended`.
const CAS_ATTEMPTS: usize = 10_000;

/// How long the mark of a sandbox deleted through the API is kept: longer than any node
/// listing (inventory, heartbeat) taken before the delete can take to be acted on.
pub const DELETED_KEPT: Duration = Duration::from_secs(300);

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuotaRecord {
    pub limit: Resources,
    /// By this project's own sandboxes.
    pub used: Resources,
    /// The sum of the children's limits.
    pub delegated: Resources,
}

impl QuotaRecord {
    /// What new sandboxes or new child limits may still take.
    pub fn left(&self) -> Resources {
        self.limit.left_after(self.used.plus(self.delegated))
    }
}

/// The quota one sandbox holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reservation {
    pub sandbox: String,
    pub node: String,
    pub project: ProjectPath,
    pub resources: Resources,
    pub at_ms: u64,
}

/// A sandbox a node reports it runs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunningSandbox {
    pub sandbox: String,
    pub project: ProjectPath,
    pub resources: Resources,
}

/// What reconciling one node changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Reconciled {
    /// Reservations with no sandbox behind them, returned.
    pub released: Vec<Reservation>,
    /// Sandboxes the node runs that held no reservation, now charged (even past a limit:
    /// they exist).
    pub charged: Vec<RunningSandbox>,
}

#[derive(Debug, thiserror::Error)]
pub enum QuotaError {
    #[error("project {project} is out of {resource} quota: asked for {asked}, {left} left; delete sandboxes or ask an admin to raise the quota (`dsec project quota {project}`)")]
    Exceeded {
        project: ProjectPath,
        resource: &'static str,
        asked: u64,
        left: u64,
    },
    #[error("project {parent} has only {left} {resource} left to give, and {child} would need {asked} more: raise {parent}'s quota or lower the others'")]
    ParentShort {
        parent: ProjectPath,
        child: ProjectPath,
        resource: &'static str,
        asked: u64,
        left: u64,
    },
    #[error("project {project} has delegated {delegated} {resource} to its subprojects, more than the new limit {limit}: lower theirs first")]
    BelowDelegated {
        project: ProjectPath,
        resource: &'static str,
        limit: u64,
        delegated: u64,
    },
    #[error("project {0} does not exist: list projects with `dsec project ls`")]
    ProjectNotFound(ProjectPath),
    #[error("sandbox {0} already holds a reservation")]
    AlreadyReserved(String),
    #[error("{0} changed concurrently too many times: retry the call")]
    Contended(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl QuotaError {
    pub fn code(&self) -> tonic::Code {
        use tonic::Code;
        match self {
            QuotaError::Exceeded { .. } => Code::ResourceExhausted,
            QuotaError::ParentShort { .. } | QuotaError::BelowDelegated { .. } => {
                Code::FailedPrecondition
            }
            QuotaError::ProjectNotFound(_) => Code::NotFound,
            QuotaError::AlreadyReserved(_) => Code::AlreadyExists,
            QuotaError::Contended(_) => Code::Aborted,
            QuotaError::Store(e) => crate::store_code(e),
        }
    }
}

impl From<QuotaError> for tonic::Status {
    fn from(e: QuotaError) -> Self {
        tonic::Status::new(e.code(), e.to_string())
    }
}

pub type QuotaResult<T> = Result<T, QuotaError>;

/// Quotas over a [`Store`].
#[derive(Clone)]
pub struct Quotas {
    store: Arc<dyn Store>,
}

impl std::fmt::Debug for Quotas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Quotas")
    }
}

/// A quota record as read, with what a transaction must compare against.
struct Read {
    record: QuotaRecord,
    kv: Option<KeyValue>,
    key: String,
}

impl Read {
    fn decode(key: String, kv: Option<KeyValue>) -> QuotaResult<Read> {
        let record = kv.as_ref().map(from_json).transpose()?.unwrap_or_default();
        Ok(Read { record, kv, key })
    }

    fn unchanged(&self) -> Compare {
        Compare::as_read(&self.key, self.kv.as_ref())
    }

    fn put(&self, record: &QuotaRecord) -> Op {
        Op::put(&self.key, to_json(record))
    }
}

/// Short random pause after a lost compare-and-swap, so that contenders spread out.
async fn back_off(attempt: usize) {
    let cap_us = 50 * (attempt.min(20) as u64 + 1);
    tokio::time::sleep(Duration::from_micros(fastrand::u64(0..=cap_us))).await;
}

impl Quotas {
    pub fn new(store: Arc<dyn Store>) -> Self {
        Quotas { store }
    }

    async fn read(&self, project: &ProjectPath) -> QuotaResult<Read> {
        let key = keys::quota(project);
        let kv = self.store.get(&key).await?;
        Read::decode(key, kv)
    }

    pub async fn get(&self, project: &ProjectPath) -> QuotaResult<QuotaRecord> {
        Ok(self.read(project).await?.record)
    }

    /// Sets a project's limit. For a subproject the change comes out of (or goes back to)
    /// what its parent has left; no limit may drop below what it has delegated.
    pub async fn set_limit(
        &self,
        project: &ProjectPath,
        limit: Resources,
    ) -> QuotaResult<QuotaRecord> {
        for attempt in 0..CAS_ATTEMPTS {
            let Some(project_kv) = self.store.get(&keys::project(project)).await? else {
                return Err(QuotaError::ProjectNotFound(project.clone()));
            };
            let own = self.read(project).await?;
            if let Some((resource, delegated, new_limit)) =
                own.record.delegated.first_excess(&limit)
            {
                return Err(QuotaError::BelowDelegated {
                    project: project.clone(),
                    resource,
                    limit: new_limit,
                    delegated,
                });
            }
            let mut record = own.record;
            record.limit = limit;
            let mut txn = Txn::default()
                .when(Compare::unchanged(&project_kv))
                .when(own.unchanged())
                .then(own.put(&record));
            if let Some(parent) = project.parent() {
                let above = self.read(&parent).await?;
                let old = own.record.limit;
                let grow = limit.minus(old);
                if let Some((resource, asked, left)) = grow.first_excess(&above.record.left()) {
                    return Err(QuotaError::ParentShort {
                        parent,
                        child: project.clone(),
                        resource,
                        asked,
                        left,
                    });
                }
                let mut parent_record = above.record;
                parent_record.delegated = parent_record.delegated.minus(old).plus(limit);
                txn = txn.when(above.unchanged()).then(above.put(&parent_record));
            }
            if self.store.txn(txn).await?.succeeded {
                return Ok(record);
            }
            back_off(attempt).await;
        }
        Err(QuotaError::Contended(format!("the quota of {project}")))
    }

    /// Charges `resources` to `project` for `sandbox` on `node`, or refuses naming the
    /// resource that ran out.
    pub async fn reserve(
        &self,
        project: &ProjectPath,
        node: &str,
        sandbox: &str,
        resources: Resources,
    ) -> QuotaResult<Reservation> {
        let reservation = Reservation {
            sandbox: sandbox.to_string(),
            node: node.to_string(),
            project: project.clone(),
            resources,
            at_ms: now_ms(),
        };
        let key = keys::reservation(node, sandbox);
        for attempt in 0..CAS_ATTEMPTS {
            let quota = self.read(project).await?;
            if let Some((resource, asked, left)) = resources.first_excess(&quota.record.left()) {
                return Err(QuotaError::Exceeded {
                    project: project.clone(),
                    resource,
                    asked,
                    left,
                });
            }
            let mut record = quota.record;
            record.used = record.used.plus(resources);
            let txn = Txn::default()
                .when(quota.unchanged())
                .when(Compare::absent(&key))
                .then(quota.put(&record))
                .then(Op::put(&key, to_json(&reservation)));
            if self.store.txn(txn).await?.succeeded {
                return Ok(reservation);
            }
            if self.store.get(&key).await?.is_some() {
                return Err(QuotaError::AlreadyReserved(sandbox.to_string()));
            }
            back_off(attempt).await;
        }
        Err(QuotaError::Contended(format!("the quota of {project}")))
    }

    /// Returns a sandbox's reservation to its project; `None` if it held none (already
    /// released).
    pub async fn release(&self, node: &str, sandbox: &str) -> QuotaResult<Option<Reservation>> {
        self.release_with(node, sandbox, |_| Vec::new()).await
    }

    /// Returns the reservation of a sandbox deleted through the API and marks it deleted in
    /// the same transaction, so that a node listing taken before the delete (a watcher's
    /// reconcile, a heartbeat's check) cannot charge it again. Marked even if nothing was
    /// reserved any more.
    pub async fn release_deleted(
        &self,
        node: &str,
        sandbox: &str,
    ) -> QuotaResult<Option<Reservation>> {
        let mark = keys::deleted(node, sandbox);
        let at = to_json(&now_ms());
        let reservation = keys::reservation(node, sandbox);
        for attempt in 0..CAS_ATTEMPTS {
            let released = self
                .release_with(node, sandbox, |_| vec![Op::put(&mark, at.clone())])
                .await?;
            if released.is_some() {
                return Ok(released);
            }
            let txn = Txn::default()
                .when(Compare::absent(&reservation))
                .then(Op::put(&mark, at.clone()));
            if self.store.txn(txn).await?.succeeded {
                return Ok(None);
            }
            // Charged between the two: release that one.
            back_off(attempt).await;
        }
        Err(QuotaError::Contended(format!(
            "the reservation of {sandbox}"
        )))
    }

    /// Drops the marks of sandboxes deleted longer than `kept` ago; how many.
    pub async fn forget_deleted(&self, kept: Duration) -> QuotaResult<usize> {
        let cutoff = now_ms().saturating_sub(kept.as_millis() as u64);
        let marks = self.store.range(keys::DELETED).await?;
        let mut forgotten = 0;
        for kv in &marks.kvs {
            // An unreadable mark is dropped too: it only ever blocks a charge.
            let at: u64 = from_json(kv).unwrap_or(0);
            if at <= cutoff {
                forgotten += self.store.delete(&kv.key).await? as usize;
            }
        }
        Ok(forgotten)
    }

    /// [`Quotas::release`], writing `also(reservation)` in the same transaction.
    pub(crate) async fn release_with(
        &self,
        node: &str,
        sandbox: &str,
        also: impl Fn(&Reservation) -> Vec<Op>,
    ) -> QuotaResult<Option<Reservation>> {
        let key = keys::reservation(node, sandbox);
        for attempt in 0..CAS_ATTEMPTS {
            let Some(kv) = self.store.get(&key).await? else {
                return Ok(None);
            };
            let reservation: Reservation = from_json(&kv)?;
            let quota = self.read(&reservation.project).await?;
            let mut record = quota.record;
            record.used = record.used.minus(reservation.resources);
            let mut txn = Txn::default()
                .when(Compare::unchanged(&kv))
                .when(quota.unchanged())
                .then(Op::delete(&kv.key))
                .then(quota.put(&record));
            txn.ops.extend(also(&reservation));
            if self.store.txn(txn).await?.succeeded {
                return Ok(Some(reservation));
            }
            back_off(attempt).await;
        }
        Err(QuotaError::Contended(format!(
            "the reservation of {sandbox}"
        )))
    }

    /// One attempt to charge a running sandbox that holds no reservation, past any limit.
    async fn charge_existing(&self, node: &str, running: &RunningSandbox) -> QuotaResult<bool> {
        let key = keys::reservation(node, &running.sandbox);
        let quota = self.read(&running.project).await?;
        let mut record = quota.record;
        record.used = record.used.plus(running.resources);
        let reservation = Reservation {
            sandbox: running.sandbox.clone(),
            node: node.to_string(),
            project: running.project.clone(),
            resources: running.resources,
            at_ms: now_ms(),
        };
        let txn = Txn::default()
            .when(Compare::absent(&key))
            .when(Compare::absent(keys::deleted(node, &running.sandbox)))
            .when(quota.unchanged())
            .then(Op::put(&key, to_json(&reservation)))
            .then(quota.put(&record));
        Ok(self.store.txn(txn).await?.succeeded)
    }

    /// The reservations filed under a node.
    pub async fn reservations_on(&self, node: &str) -> QuotaResult<Vec<Reservation>> {
        let range = self.store.range(&keys::reservations_on(node)).await?;
        Ok(range.kvs.iter().map(from_json).collect::<Result<_, _>>()?)
    }

    /// Makes a node's reservations match what it reports it runs: reservations older than
    /// `grace` with no sandbox behind them are returned (younger ones may be creates still
    /// on their way to the node), and running sandboxes without one are charged. With an
    /// empty report and no grace, this returns everything a lost node held.
    pub async fn reconcile_node(
        &self,
        node: &str,
        running: &[RunningSandbox],
        grace: Duration,
    ) -> QuotaResult<Reconciled> {
        let mut report = Reconciled::default();
        let cutoff = now_ms().saturating_sub(grace.as_millis() as u64);
        let range = self.store.range(&keys::reservations_on(node)).await?;
        for kv in &range.kvs {
            let reservation: Reservation = from_json(kv)?;
            let runs = running.iter().find(|r| r.sandbox == reservation.sandbox);
            let matches = runs.is_some_and(|r| {
                r.project == reservation.project && r.resources == reservation.resources
            });
            let stale = runs.is_some() || reservation.at_ms <= cutoff;
            if matches || !stale {
                continue;
            }
            // A reservation that disagrees with the node is replaced by what the node says.
            if let Some(released) = self.release(node, &reservation.sandbox).await? {
                report.released.push(released);
            }
        }
        for sandbox in running {
            if self.charge_if_unreserved(node, sandbox).await? {
                report.charged.push(sandbox.clone());
            }
        }
        Ok(report)
    }

    /// Charges a sandbox `node` runs if it holds no reservation (past any limit: it exists);
    /// whether it was charged here.
    pub async fn charge_if_unreserved(
        &self,
        node: &str,
        sandbox: &RunningSandbox,
    ) -> QuotaResult<bool> {
        let key = keys::reservation(node, &sandbox.sandbox);
        let deleted = keys::deleted(node, &sandbox.sandbox);
        for attempt in 0..CAS_ATTEMPTS {
            if self.store.get(&key).await?.is_some() {
                return Ok(false);
            }
            if self.charge_existing(node, sandbox).await? {
                return Ok(true);
            }
            if self.store.get(&deleted).await?.is_some() {
                return Ok(false);
            }
            back_off(attempt).await;
        }
        Ok(false)
    }
}

#[cfg(test)]
mod tests;
