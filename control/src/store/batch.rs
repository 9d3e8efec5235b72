//! Group commit of independent puts (the apiserver's audit records): concurrent puts share
//! one transaction of up to `PUTS_MAX`, so a burst of calls costs etcd one fsynced write per
//! batch instead of one per call. A put still returns only once its transaction is
//! committed.

use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

use super::{Op, Store, StoreError, StoreResult, Txn};

/// Puts one transaction carries at most (etcd's default limit is 128 operations).
pub const PUTS_MAX: usize = 100;
/// Puts [`PutBatcher::put_later`] leaves queued at most; past it callers wait for their
/// commit, so a slow store slows them down instead of growing the queue.
pub const QUEUED_MAX: usize = 2_000;

type Waiting = (String, Vec<u8>, oneshot::Sender<StoreResult<()>>);

#[derive(Default)]
struct Queue {
    committing: bool,
    waiting: Vec<Waiting>,
}

/// Batches [`Store::put`]s without leases or conditions; cheap to clone.
#[derive(Clone)]
pub struct PutBatcher {
    store: Arc<dyn Store>,
    queue: Arc<Mutex<Queue>>,
}

impl std::fmt::Debug for PutBatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PutBatcher").finish_non_exhaustive()
    }
}

impl PutBatcher {
    pub fn new(store: Arc<dyn Store>) -> Self {
        PutBatcher {
            store,
            queue: Arc::default(),
        }
    }

    /// Writes `value` at `key` together with the other puts waiting now.
    pub async fn put(&self, key: String, value: Vec<u8>) -> StoreResult<()> {
        let (reply, answer) = oneshot::channel();
        let lead = {
            let mut queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
            queue.waiting.push((key, value, reply));
            !std::mem::replace(&mut queue.committing, true)
        };
        if lead {
            // On its own task: a caller that goes away must not strand the others.
            let batcher = self.clone();
            tokio::spawn(async move { batcher.drain().await });
        }
        answer.await.unwrap_or_else(|_| {
            Err(StoreError::Unavailable(
                "the write batch ended without an answer".into(),
            ))
        })
    }

    /// Queues a put and returns before it is committed, unless [`QUEUED_MAX`] puts wait
    /// already (then as [`put`](Self::put)). A crash of this process loses what is queued; a
    /// failed commit is logged.
    pub async fn put_later(&self, key: String, value: Vec<u8>) -> StoreResult<()> {
        let queued = {
            let mut queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
            if queue.waiting.len() >= QUEUED_MAX {
                Err((key, value))
            } else {
                // Nobody waits for the answer: the closed receiver drops it.
                let (reply, _) = oneshot::channel();
                queue.waiting.push((key, value, reply));
                Ok(!std::mem::replace(&mut queue.committing, true))
            }
        };
        match queued {
            Err((key, value)) => self.put(key, value).await,
            Ok(true) => {
                let batcher = self.clone();
                tokio::spawn(async move { batcher.drain().await });
                Ok(())
            }
            Ok(false) => Ok(()),
        }
    }

    async fn drain(&self) {
        loop {
            let batch: Vec<Waiting> = {
                let mut queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
                if queue.waiting.is_empty() {
                    queue.committing = false;
                    return;
                }
                let take = queue.waiting.len().min(PUTS_MAX);
                queue.waiting.drain(..take).collect()
            };
            let mut txn = Txn::default();
            let mut replies = Vec::with_capacity(batch.len());
            for (key, value, reply) in batch {
                txn = txn.then(Op::put(&key, value));
                replies.push(reply);
            }
            let result = self.store.txn(txn).await.map(|_| ());
            if let Err(e) = &result {
                tracing::warn!(%e, puts = replies.len(), "a batch of puts was not written");
            }
            for reply in replies {
                let _ = reply.send(match &result {
                    Ok(()) => Ok(()),
                    Err(e) => Err(StoreError::Unavailable(e.to_string())),
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::EmbeddedStore;

    /// 300 concurrent puts are all written, in fewer transactions than puts (every batch is
    /// one revision) on stores whose commits take time: the embedded store on disk (fsync)
    /// and etcd.
    async fn concurrent_puts_are_all_written_in_fewer_transactions(store: Arc<dyn Store>) {
        let batcher = PutBatcher::new(store.clone());
        let before = store.range("batch/").await.unwrap().revision;
        let tasks: Vec<_> = (0..300)
            .map(|i| {
                let batcher = batcher.clone();
                tokio::spawn(
                    async move { batcher.put(format!("batch/{i:03}"), vec![i as u8]).await },
                )
            })
            .collect();
        for task in tasks {
            task.await.unwrap().unwrap();
        }
        let after = store.range("batch/").await.unwrap();
        assert_eq!(after.kvs.len(), 300);
        assert_eq!(after.kvs[7].value, vec![7u8]);
        let transactions = after.revision - before;
        assert!(
            transactions < 300,
            "{transactions} transactions for 300 puts"
        );
    }

    /// Puts queued without waiting are all written, also past `QUEUED_MAX` (those wait).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn puts_queued_without_waiting_are_all_written() {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn Store> = Arc::new(EmbeddedStore::open(dir.path()).unwrap());
        let batcher = PutBatcher::new(store.clone());
        let count = QUEUED_MAX + 500;
        for i in 0..count {
            batcher
                .put_later(format!("later/{i:05}"), vec![1])
                .await
                .unwrap();
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        loop {
            let written = store.range("later/").await.unwrap().kvs.len();
            if written == count {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{written} of {count} queued puts written"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn embedded_on_disk() {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn Store> = Arc::new(EmbeddedStore::open(dir.path()).unwrap());
        concurrent_puts_are_all_written_in_fewer_transactions(store).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn etcd() {
        if let Some(test) = crate::testing::etcd().await {
            concurrent_puts_are_all_written_in_fewer_transactions(test.store.clone()).await;
        }
    }
}
