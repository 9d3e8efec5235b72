//! The key-value store the control plane keeps its state in, behind one small trait:
//! [`EmbeddedStore`] on one machine (in-process, persisted to a write-ahead log under the
//! state dir) and [`EtcdStore`] for a cluster. Both give the same guarantees the control plane
//! relies on: a global revision that orders every write, compare-and-swap transactions on
//! `mod_revision`, leases whose expiry deletes the keys attached to them, and prefix watches
//! that deliver every change after a given revision in order.

mod batch;
mod embedded;
mod etcd;
mod mirror;

#[cfg(test)]
mod conformance;

use std::time::Duration;

pub use batch::PutBatcher;
pub use embedded::EmbeddedStore;
pub use etcd::EtcdStore;
pub(crate) use mirror::Mirror;
use tokio::sync::mpsc;

/// A store-wide, strictly increasing write counter (etcd's revision).
pub type Revision = i64;
/// A lease: keys put with it are deleted when it expires or is revoked.
pub type LeaseId = i64;

/// One stored key with its value and the revision that last wrote it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyValue {
    pub key: String,
    pub value: Vec<u8>,
    pub mod_revision: Revision,
    pub lease: Option<LeaseId>,
}

/// The keys under a prefix, in key order, as of `revision`.
#[derive(Clone, Debug, Default)]
pub struct Range {
    pub kvs: Vec<KeyValue>,
    pub revision: Revision,
}

/// A condition of a transaction: the key was last written at `mod_revision` (0: it is absent).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Compare {
    pub key: String,
    pub mod_revision: Revision,
}

impl Compare {
    /// The key does not exist.
    pub fn absent(key: impl Into<String>) -> Self {
        Compare {
            key: key.into(),
            mod_revision: 0,
        }
    }

    /// The key still holds what `kv` read.
    pub fn unchanged(kv: &KeyValue) -> Self {
        Compare {
            key: kv.key.clone(),
            mod_revision: kv.mod_revision,
        }
    }

    /// The key is as it was read: unchanged if it was there, still absent if not.
    pub fn as_read(key: &str, read: Option<&KeyValue>) -> Self {
        Compare {
            key: key.to_string(),
            mod_revision: read.map_or(0, |kv| kv.mod_revision),
        }
    }
}

/// A write inside a transaction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    Put {
        key: String,
        value: Vec<u8>,
        lease: Option<LeaseId>,
    },
    Delete {
        key: String,
    },
}

impl Op {
    pub fn put(key: impl Into<String>, value: Vec<u8>) -> Self {
        Op::Put {
            key: key.into(),
            value,
            lease: None,
        }
    }

    pub fn delete(key: impl Into<String>) -> Self {
        Op::Delete { key: key.into() }
    }
}

/// If every compare holds, apply every op atomically (one revision); else apply nothing.
#[derive(Clone, Debug, Default)]
pub struct Txn {
    pub compares: Vec<Compare>,
    pub ops: Vec<Op>,
}

impl Txn {
    pub fn when(mut self, compare: Compare) -> Self {
        self.compares.push(compare);
        self
    }

    pub fn then(mut self, op: Op) -> Self {
        self.ops.push(op);
        self
    }
}

/// What a transaction did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TxnOutcome {
    /// All compares held and the ops were applied.
    pub succeeded: bool,
    /// The store's revision after the transaction.
    pub revision: Revision,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    Put,
    Delete,
}

/// One change seen by a watch. `value` is empty for a delete.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WatchEvent {
    pub kind: EventKind,
    pub key: String,
    pub value: Vec<u8>,
    pub revision: Revision,
}

/// A stream of changes under a prefix, in revision order. Dropping it cancels the watch.
pub struct Watch {
    events: mpsc::UnboundedReceiver<Result<WatchEvent, StoreError>>,
}

impl Watch {
    fn new(events: mpsc::UnboundedReceiver<Result<WatchEvent, StoreError>>) -> Self {
        Watch { events }
    }

    /// The next change; `None` once the store has closed the watch (after an error).
    pub async fn next(&mut self) -> Option<Result<WatchEvent, StoreError>> {
        self.events.recv().await
    }
}

impl std::fmt::Debug for Watch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Watch")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("the store is unreachable or failed: {0}; check that etcd is running and reachable at the configured endpoints")]
    Unavailable(String),
    #[error("lease {0:x} does not exist (it expired or was revoked): grant a new lease and put the keys again")]
    LeaseNotFound(LeaseId),
    #[error("revision {requested} was compacted away (oldest kept: {oldest}): list again and watch from the revision of that list")]
    Compacted {
        requested: Revision,
        oldest: Revision,
    },
    #[error("{path}: {what}; the store's files are damaged: restore them from a backup or move them aside to start empty")]
    Corrupt { path: String, what: String },
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("stored key {0:?} is not UTF-8: the store holds keys written by something else; use a separate etcd namespace")]
    ForeignKey(String),
    #[error("a lease TTL must be between 1 s and 1 day, got {0:?}")]
    BadTtl(Duration),
}

pub type StoreResult<T> = Result<T, StoreError>;

/// What the control plane needs from a key-value store.
#[async_trait::async_trait]
pub trait Store: Send + Sync + 'static {
    async fn get(&self, key: &str) -> StoreResult<Option<KeyValue>>;
    /// Every key starting with `prefix`, in key order.
    async fn range(&self, prefix: &str) -> StoreResult<Range>;
    /// Writes a key (attached to `lease` if given); returns the new revision.
    async fn put(&self, key: &str, value: Vec<u8>, lease: Option<LeaseId>)
        -> StoreResult<Revision>;
    /// Deletes a key; `true` if it existed.
    async fn delete(&self, key: &str) -> StoreResult<bool>;
    async fn txn(&self, txn: Txn) -> StoreResult<TxnOutcome>;
    /// A new lease that expires `ttl` after its last keep-alive.
    async fn grant_lease(&self, ttl: Duration) -> StoreResult<LeaseId>;
    /// Restarts the lease's TTL; [`StoreError::LeaseNotFound`] once it has expired.
    async fn keep_alive(&self, lease: LeaseId) -> StoreResult<()>;
    /// Ends the lease now, deleting its keys.
    async fn revoke_lease(&self, lease: LeaseId) -> StoreResult<()>;
    /// Changes under `prefix` with a revision above `after` (all future changes if `None`).
    async fn watch(&self, prefix: &str, after: Option<Revision>) -> StoreResult<Watch>;
}

/// Lease TTLs both stores accept (etcd rounds below its minimum up; we refuse instead).
pub(crate) fn check_ttl(ttl: Duration) -> StoreResult<()> {
    if ttl < Duration::from_secs(1) || ttl > Duration::from_secs(86_400) {
        return Err(StoreError::BadTtl(ttl));
    }
    Ok(())
}

/// A record as stored: JSON.
pub(crate) fn to_json<T: serde::Serialize>(value: &T) -> Vec<u8> {
    serde_json::to_vec(value).expect("control-plane records always serialize")
}

/// A stored record, or `Corrupt` naming the key when it does not decode.
pub(crate) fn from_json<T: serde::de::DeserializeOwned>(kv: &KeyValue) -> StoreResult<T> {
    serde_json::from_slice(&kv.value).map_err(|e| StoreError::Corrupt {
        path: kv.key.clone(),
        what: format!("unreadable record: {e}"),
    })
}
