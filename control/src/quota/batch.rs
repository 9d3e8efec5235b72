//! Group commit of one project's reservations: concurrent creates into one project would
//! otherwise serialize on compare-and-swap retries of its record (each retry a read and a
//! transaction). Here the first reservation of a project leads: it takes every reservation
//! queued for the project meanwhile (up to `BATCH_MAX`), reads the record once and writes
//! the new usage and all reservation keys in one transaction; arrivals during that commit
//! form the next batch. The checks are [`Quotas::reserve`]'s, applied in arrival order.
//!
//! The record a batch wrote is kept for the project's next batch, which compares against it
//! instead of reading it first: a burst costs one transaction per batch and no read. When
//! something else changed the record the transaction fails and the record is read again.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

use super::{
    back_off, QuotaError, QuotaRecord, QuotaResult, Quotas, Read, Reservation, CAS_ATTEMPTS,
};
use crate::iam::ProjectPath;
use crate::keys;
use crate::now_ms;
use crate::resources::Resources;
use crate::store::{to_json, Compare, KeyValue, Op, StoreError, Txn};

/// Projects whose last written quota record one replica keeps; past this it starts over.
const KNOWN_MAX: usize = 10_000;

/// Reservations one transaction carries at most (etcd refuses transactions of more than
/// 128 operations by default; each reservation is one put, the record one more).
pub const BATCH_MAX: usize = 100;

struct Pending {
    node: String,
    sandbox: String,
    resources: Resources,
    reply: oneshot::Sender<QuotaResult<Reservation>>,
}

/// Batches [`Quotas::reserve`] per project; cheap to clone.
#[derive(Clone)]
pub struct Reserver {
    quotas: Quotas,
    /// Projects with a commit under way, and what waits for the next one.
    queues: Arc<Mutex<HashMap<ProjectPath, Vec<Pending>>>>,
    /// The quota record each project's last batch wrote (used once, by its next batch).
    known: Arc<Mutex<HashMap<ProjectPath, Read>>>,
}

impl std::fmt::Debug for Reserver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reserver").finish_non_exhaustive()
    }
}

/// Whether every reservation of `batch` fits in what `record` has left.
fn fits_all(record: &QuotaRecord, batch: &[Pending]) -> bool {
    let mut record = *record;
    batch.iter().all(|p| {
        let fits = p.resources.first_excess(&record.left()).is_none();
        record.used = record.used.plus(p.resources);
        fits
    })
}

fn shared_error(e: &StoreError) -> QuotaError {
    QuotaError::Store(StoreError::Unavailable(e.to_string()))
}

impl Reserver {
    pub fn new(quotas: Quotas) -> Self {
        Reserver {
            quotas,
            queues: Arc::default(),
            known: Arc::default(),
        }
    }

    /// As [`Quotas::reserve`], committed together with the project's other concurrent
    /// reservations.
    pub async fn reserve(
        &self,
        project: &ProjectPath,
        node: &str,
        sandbox: &str,
        resources: Resources,
    ) -> QuotaResult<Reservation> {
        let mut results = self
            .reserve_many(project, node, vec![(sandbox.to_string(), resources)])
            .await;
        results.pop().unwrap_or_else(|| {
            Err(QuotaError::Contended(
                "the reservation batch ended without an answer".into(),
            ))
        })
    }

    /// [`Reserver::reserve`] for several sandboxes on one node, queued at once (so they
    /// share the project's next commits), one result per sandbox in the order given.
    pub async fn reserve_many(
        &self,
        project: &ProjectPath,
        node: &str,
        sandboxes: Vec<(String, Resources)>,
    ) -> Vec<QuotaResult<Reservation>> {
        let mut answers = Vec::with_capacity(sandboxes.len());
        let pending: Vec<Pending> = sandboxes
            .into_iter()
            .map(|(sandbox, resources)| {
                let (reply, answer) = oneshot::channel();
                answers.push(answer);
                Pending {
                    node: node.to_string(),
                    sandbox,
                    resources,
                    reply,
                }
            })
            .collect();
        let lead = {
            let mut queues = self.queues.lock().unwrap_or_else(|e| e.into_inner());
            match queues.get_mut(project) {
                Some(queue) => {
                    queue.extend(pending);
                    false
                }
                None => {
                    queues.insert(project.clone(), pending);
                    true
                }
            }
        };
        if lead {
            // On its own task: a caller that goes away must not strand the others.
            let (reserver, project) = (self.clone(), project.clone());
            tokio::spawn(async move { reserver.drain(project).await });
        }
        let mut results = Vec::with_capacity(answers.len());
        for answer in answers {
            results.push(answer.await.unwrap_or_else(|_| {
                Err(QuotaError::Contended(
                    "the reservation batch ended without an answer".into(),
                ))
            }));
        }
        results
    }

    /// Whether this replica expects `resources` to fit in `project`'s quota: the record its
    /// last batch wrote has room for them and for everything queued for the project's next
    /// batch. An estimate (no store read), used to start a create on its node while its
    /// reservation commits; the reservation alone decides. False when no record is kept.
    pub fn likely_fits(&self, project: &ProjectPath, resources: Resources) -> bool {
        let queued = {
            let queues = self.queues.lock().unwrap_or_else(|e| e.into_inner());
            queues
                .get(project)
                .map(|q| {
                    q.iter()
                        .fold(Resources::ZERO, |sum, p| sum.plus(p.resources))
                })
                .unwrap_or(Resources::ZERO)
        };
        let known = self.known.lock().unwrap_or_else(|e| e.into_inner());
        known.get(project).is_some_and(|read| {
            resources
                .plus(queued)
                .first_excess(&read.record.left())
                .is_none()
        })
    }

    async fn drain(&self, project: ProjectPath) {
        loop {
            let batch = {
                let mut queues = self.queues.lock().unwrap_or_else(|e| e.into_inner());
                let Some(queue) = queues.get_mut(&project) else {
                    return;
                };
                if queue.is_empty() {
                    queues.remove(&project);
                    return;
                }
                let take = queue.len().min(BATCH_MAX);
                queue.drain(..take).collect::<Vec<_>>()
            };
            self.commit(&project, batch).await;
        }
    }

    fn remember(&self, project: &ProjectPath, read: Read) {
        let mut known = self.known.lock().unwrap_or_else(|e| e.into_inner());
        if known.len() >= KNOWN_MAX {
            known.clear();
        }
        known.insert(project.clone(), read);
    }

    async fn commit(&self, project: &ProjectPath, mut batch: Vec<Pending>) {
        // The record the previous batch wrote: it may be stale, so it may allow (the
        // transaction then fails if it changed) but never refuse.
        let mut remembered = self
            .known
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(project);
        let mut fresh = None;
        for attempt in 0..CAS_ATTEMPTS {
            let (read, may_refuse) = match (remembered.take(), fresh.take()) {
                (Some(read), _) => (Ok(read), false),
                (None, Some(read)) => (Ok(read), true),
                (None, None) => (self.quotas.read(project).await, true),
            };
            let quota = match read {
                Ok(quota) => quota,
                Err(QuotaError::Store(e)) => {
                    for p in batch {
                        let _ = p.reply.send(Err(shared_error(&e)));
                    }
                    return;
                }
                Err(e) => {
                    let text = e.to_string();
                    for p in batch {
                        let _ = p.reply.send(Err(QuotaError::Contended(text.clone())));
                    }
                    return;
                }
            };
            if !may_refuse && !fits_all(&quota.record, &batch) {
                continue;
            }
            let mut record = quota.record;
            let mut txn = Txn::default().when(quota.unchanged());
            let mut accepted = Vec::new();
            let at_ms = now_ms();
            for p in batch {
                if let Some((resource, asked, left)) = p.resources.first_excess(&record.left()) {
                    let _ = p.reply.send(Err(QuotaError::Exceeded {
                        project: project.clone(),
                        resource,
                        asked,
                        left,
                    }));
                    continue;
                }
                record.used = record.used.plus(p.resources);
                let reservation = Reservation {
                    sandbox: p.sandbox.clone(),
                    node: p.node.clone(),
                    project: project.clone(),
                    resources: p.resources,
                    at_ms,
                };
                let key = keys::reservation(&p.node, &p.sandbox);
                txn = txn
                    .when(Compare::absent(&key))
                    .then(Op::put(&key, to_json(&reservation)));
                accepted.push((p, reservation));
            }
            if accepted.is_empty() {
                return;
            }
            let value = to_json(&record);
            txn = txn.then(Op::put(&quota.key, value.clone()));
            match self.quotas.store.txn(txn).await {
                Ok(outcome) if outcome.succeeded => {
                    let written = KeyValue {
                        key: quota.key.clone(),
                        value,
                        mod_revision: outcome.revision,
                        lease: None,
                    };
                    self.remember(
                        project,
                        Read {
                            record,
                            kv: Some(written),
                            key: quota.key,
                        },
                    );
                    for (p, reservation) in accepted {
                        let _ = p.reply.send(Ok(reservation));
                    }
                    return;
                }
                Ok(_) => {}
                Err(e) => {
                    for (p, _) in accepted {
                        let _ = p.reply.send(Err(shared_error(&e)));
                    }
                    return;
                }
            }
            // Lost: the record changed (go again) or a key exists. An unchanged record
            // means a key: those reservations answer one by one.
            let record_unchanged = match self.quotas.store.get(&quota.key).await {
                Ok(kv) => {
                    let unchanged = kv.as_ref().map(|kv| kv.mod_revision)
                        == quota.kv.as_ref().map(|kv| kv.mod_revision);
                    // What was just read is the next attempt's record.
                    fresh = Read::decode(quota.key.clone(), kv).ok();
                    unchanged
                }
                Err(_) => false,
            };
            batch = accepted.into_iter().map(|(p, _)| p).collect();
            if record_unchanged {
                for p in batch {
                    let result = self
                        .quotas
                        .reserve(project, &p.node, &p.sandbox, p.resources)
                        .await;
                    let _ = p.reply.send(result);
                }
                return;
            }
            back_off(attempt).await;
        }
        for p in batch {
            let _ = p.reply.send(Err(QuotaError::Contended(format!(
                "the quota of {project}"
            ))));
        }
    }
}
