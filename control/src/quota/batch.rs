//! Group commit of one project's reservations: concurrent creates into one project would
//! otherwise serialize on compare-and-swap retries of its record (each retry a read and a
//! transaction). Here the first reservation of a project leads: it takes every reservation
//! queued for the project meanwhile (up to `BATCH_MAX`), reads the record once and writes
//! the new usage and all reservation keys in one transaction; arrivals during that commit
//! form the next batch. The checks are [`Quotas::reserve`]'s, applied in arrival order.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

use super::{back_off, QuotaError, QuotaResult, Quotas, Reservation, CAS_ATTEMPTS};
use crate::iam::ProjectPath;
use crate::keys;
use crate::now_ms;
use crate::resources::Resources;
use crate::store::{to_json, Compare, Op, StoreError, Txn};

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
}

impl std::fmt::Debug for Reserver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reserver").finish_non_exhaustive()
    }
}

fn shared_error(e: &StoreError) -> QuotaError {
    QuotaError::Store(StoreError::Unavailable(e.to_string()))
}

impl Reserver {
    pub fn new(quotas: Quotas) -> Self {
        Reserver {
            quotas,
            queues: Arc::default(),
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
        let (reply, answer) = oneshot::channel();
        let pending = Pending {
            node: node.to_string(),
            sandbox: sandbox.to_string(),
            resources,
            reply,
        };
        let lead = {
            let mut queues = self.queues.lock().unwrap_or_else(|e| e.into_inner());
            match queues.get_mut(project) {
                Some(queue) => {
                    queue.push(pending);
                    false
                }
                None => {
                    queues.insert(project.clone(), vec![pending]);
                    true
                }
            }
        };
        if lead {
            // On its own task: a caller that goes away must not strand the others.
            let (reserver, project) = (self.clone(), project.clone());
            tokio::spawn(async move { reserver.drain(project).await });
        }
        answer.await.unwrap_or_else(|_| {
            Err(QuotaError::Contended(
                "the reservation batch ended without an answer".into(),
            ))
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

    async fn commit(&self, project: &ProjectPath, mut batch: Vec<Pending>) {
        for attempt in 0..CAS_ATTEMPTS {
            let quota = match self.quotas.read(project).await {
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
            txn = txn.then(quota.put(&record));
            match self.quotas.store.txn(txn).await {
                Ok(outcome) if outcome.succeeded => {
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
                    kv.map(|kv| kv.mod_revision) == quota.kv.as_ref().map(|kv| kv.mod_revision)
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
