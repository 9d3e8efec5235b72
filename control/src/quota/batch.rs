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
//!
//! Batches are pipelined: while one commits, up to [`PIPELINE_DEPTH`] more may be sent, each
//! expecting the exact record the one before it writes (a value compare: its revision is not
//! known yet). A batch waits for its own round trip only, not its predecessor's. Only a batch
//! whose every reservation fits in the record its predecessor writes is sent so; it never
//! refuses. One whose predecessor lost (or that etcd applied first) fails its compare, writes
//! nothing and commits again the usual way once the pipeline is empty.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::sync::{oneshot, Notify};

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

/// Batches of one project a replica has in flight at once (etcd commits concurrent
/// transactions in one fsync).
pub const PIPELINE_DEPTH: usize = 4;

struct Pending {
    node: String,
    sandbox: String,
    resources: Resources,
    queued: Instant,
    reply: oneshot::Sender<QuotaResult<Reservation>>,
}

/// A project's reservations waiting for a batch, and the wake-up of its committing task.
struct Queue {
    pending: Vec<Pending>,
    arrived: Arc<Notify>,
}

/// The quota record the last batch sent writes if it commits: what the next one expects.
#[derive(Clone)]
struct Chain {
    key: String,
    record: QuotaRecord,
    value: Vec<u8>,
}

/// How a pipelined batch ended (its reservations are answered, except a lost batch's).
enum Sent {
    Committed {
        order: u64,
        written: Read,
    },
    /// A compare failed: nothing written; these commit again.
    Lost(Vec<Pending>),
    /// The store failed: answered with the error; what it holds is unknown.
    Failed,
}

/// Batches [`Quotas::reserve`] per project; cheap to clone.
#[derive(Clone)]
pub struct Reserver {
    quotas: Quotas,
    /// Projects with a commit under way, and what waits for the next one.
    queues: Arc<Mutex<HashMap<ProjectPath, Queue>>>,
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
        let queued = Instant::now();
        let pending: Vec<Pending> = sandboxes
            .into_iter()
            .map(|(sandbox, resources)| {
                let (reply, answer) = oneshot::channel();
                answers.push(answer);
                Pending {
                    node: node.to_string(),
                    sandbox,
                    resources,
                    queued,
                    reply,
                }
            })
            .collect();
        let lead = {
            let mut queues = self.queues.lock().unwrap_or_else(|e| e.into_inner());
            match queues.get_mut(project) {
                Some(queue) => {
                    queue.pending.extend(pending);
                    queue.arrived.notify_one();
                    false
                }
                None => {
                    let queue = Queue {
                        pending,
                        arrived: Arc::default(),
                    };
                    queues.insert(project.clone(), queue);
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
                    q.pending
                        .iter()
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
        let Some(arrived) = self
            .queues
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&project)
            .map(|q| q.arrived.clone())
        else {
            return;
        };
        // Polled by this task alone, so batches go out in the order they chain.
        let mut in_flight = FuturesUnordered::new();
        let mut chain: Option<Chain> = None;
        let (mut sent, mut newest) = (0u64, 0u64);
        let mut lost: Vec<Pending> = Vec::new();
        loop {
            if in_flight.is_empty() && !lost.is_empty() {
                // Lost batches commit again, reading the record afresh if need be.
                while !lost.is_empty() {
                    let take = lost.len().min(BATCH_MAX);
                    let batch = lost.drain(..take).collect();
                    self.commit(&project, batch).await;
                }
                chain = self.chain_from_known(&project);
                continue;
            }
            let batch = {
                let mut queues = self.queues.lock().unwrap_or_else(|e| e.into_inner());
                let Some(queue) = queues.get_mut(&project) else {
                    return;
                };
                if queue.pending.is_empty() && in_flight.is_empty() && lost.is_empty() {
                    queues.remove(&project);
                    return;
                }
                if in_flight.len() >= PIPELINE_DEPTH || !lost.is_empty() {
                    Vec::new()
                } else {
                    let take = queue.pending.len().min(BATCH_MAX);
                    queue.pending.drain(..take).collect::<Vec<_>>()
                }
            };
            if batch.is_empty() {
                tokio::select! {
                    Some(done) = in_flight.next() => {
                        self.finished(&project, done, &mut chain, &mut lost, &mut newest);
                    }
                    _ = arrived.notified() => {}
                }
                continue;
            }
            match chain.take() {
                Some(base) if fits_all(&base.record, &batch) => {
                    sent += 1;
                    let (txn, accepted, next) = chained(&project, &base, batch);
                    chain = Some(next.clone());
                    in_flight.push(send_chained(self.quotas.clone(), txn, accepted, sent, next));
                }
                _ => {
                    // Nothing to chain to, or the batch may need a refusal: wait for what is
                    // in flight, then commit against a record read or known.
                    while let Some(done) = in_flight.next().await {
                        self.finished(&project, done, &mut chain, &mut lost, &mut newest);
                    }
                    lost.extend(batch);
                    while !lost.is_empty() {
                        let take = lost.len().min(BATCH_MAX);
                        let batch = lost.drain(..take).collect();
                        self.commit(&project, batch).await;
                    }
                    chain = self.chain_from_known(&project);
                }
            }
        }
    }

    /// Takes in a pipelined batch's end: a committed one is remembered if no later one
    /// committed first; a lost or failed one breaks the chain.
    fn finished(
        &self,
        project: &ProjectPath,
        done: Sent,
        chain: &mut Option<Chain>,
        lost: &mut Vec<Pending>,
        newest: &mut u64,
    ) {
        match done {
            Sent::Committed { order, written } => {
                if order > *newest {
                    *newest = order;
                    self.remember(project, written);
                }
            }
            Sent::Lost(batch) => {
                tracing::debug!(%project, size = batch.len(), "chained reservation batch lost");
                *chain = None;
                lost.extend(batch);
            }
            Sent::Failed => *chain = None,
        }
    }

    /// What the next batch may expect: the record this replica last wrote (kept, not taken).
    fn chain_from_known(&self, project: &ProjectPath) -> Option<Chain> {
        let known = self.known.lock().unwrap_or_else(|e| e.into_inner());
        let read = known.get(project)?;
        let kv = read.kv.as_ref()?;
        Some(Chain {
            key: read.key.clone(),
            record: read.record,
            value: kv.value.clone(),
        })
    }

    fn remember(&self, project: &ProjectPath, read: Read) {
        let mut known = self.known.lock().unwrap_or_else(|e| e.into_inner());
        if known.len() >= KNOWN_MAX {
            known.clear();
        }
        known.insert(project.clone(), read);
    }

    async fn commit(&self, project: &ProjectPath, mut batch: Vec<Pending>) {
        let started = Instant::now();
        let waited = batch.iter().map(|p| p.queued).min().map(|t| started - t);
        // The record the previous batch wrote: it may be stale, so it may allow (the
        // transaction then fails if it changed) but never refuse.
        // Kept meanwhile for `likely_fits`; replaced by what this batch writes.
        let mut remembered = self
            .known
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(project)
            .cloned();
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
                    tracing::debug!(
                        %project,
                        size = accepted.len(),
                        waited_us = waited.unwrap_or_default().as_micros() as u64,
                        txn_us = started.elapsed().as_micros() as u64,
                        attempt,
                        "reservation batch committed"
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

/// The transaction of a batch chained to `base` (every reservation fits in it, checked by
/// the caller), its reservations, and the record it writes.
fn chained(
    project: &ProjectPath,
    base: &Chain,
    batch: Vec<Pending>,
) -> (Txn, Vec<(Pending, Reservation)>, Chain) {
    let mut record = base.record;
    let mut txn = Txn::default().when(Compare::holds(&base.key, base.value.clone()));
    let at_ms = now_ms();
    let mut accepted = Vec::with_capacity(batch.len());
    for p in batch {
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
    let value = to_json(&record);
    txn = txn.then(Op::put(&base.key, value.clone()));
    let next = Chain {
        key: base.key.clone(),
        record,
        value,
    };
    (txn, accepted, next)
}

/// Sends a chained batch and answers its reservations, unless it lost its compare.
async fn send_chained(
    quotas: Quotas,
    txn: Txn,
    accepted: Vec<(Pending, Reservation)>,
    order: u64,
    writes: Chain,
) -> Sent {
    let started = Instant::now();
    let waited = accepted
        .iter()
        .map(|(p, _)| p.queued)
        .min()
        .map(|t| started - t);
    match quotas.store.txn(txn).await {
        Ok(outcome) if outcome.succeeded => {
            tracing::debug!(
                size = accepted.len(),
                waited_us = waited.unwrap_or_default().as_micros() as u64,
                txn_us = started.elapsed().as_micros() as u64,
                order,
                "reservation batch committed (chained)"
            );
            for (p, reservation) in accepted {
                let _ = p.reply.send(Ok(reservation));
            }
            let written = KeyValue {
                key: writes.key.clone(),
                value: writes.value,
                mod_revision: outcome.revision,
                lease: None,
            };
            Sent::Committed {
                order,
                written: Read {
                    record: writes.record,
                    kv: Some(written),
                    key: writes.key,
                },
            }
        }
        Ok(_) => Sent::Lost(accepted.into_iter().map(|(p, _)| p).collect()),
        Err(e) => {
            for (p, _) in accepted {
                let _ = p.reply.send(Err(shared_error(&e)));
            }
            Sent::Failed
        }
    }
}
