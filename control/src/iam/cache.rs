//! One replica's copy of what authorization reads (tokens, principals, projects, role
//! bindings), listed once and kept fresh by prefix watches, so that a call is authorized
//! without a store round trip.
//!
//! Freshness: a change reaches every replica's copy when its watch delivers it (tested:
//! a revoked token is refused on two replicas within [`REVOCATION_BOUND`]). A copy whose
//! watch failed stops answering (callers read the store) until it has listed again.
//! Only positive answers are trusted from the copy: a token, project or binding it lacks is
//! looked up in the store, so that what another replica just created works at once.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use serde::de::DeserializeOwned;

use super::{Principal, Project, RoleBinding, TokenRecord};
use crate::keys;
use crate::store::{from_json, EventKind, Store};

/// Within this time of a revocation committing, every replica with a live watch refuses the
/// token (the watch's delivery time; the test checks it).
pub const REVOCATION_BOUND: Duration = Duration::from_millis(500);
/// Pause before listing again after a watch failed.
const RELIST_PAUSE: Duration = Duration::from_millis(200);

/// The records under one prefix, by key.
struct Mirror<T> {
    prefix: &'static str,
    /// None while the copy is not known to be current (before the first listing, after a
    /// watch failure).
    records: RwLock<Option<BTreeMap<String, T>>>,
}

impl<T: DeserializeOwned + Clone + Send + Sync + 'static> Mirror<T> {
    fn new(prefix: &'static str) -> Arc<Self> {
        Arc::new(Mirror {
            prefix,
            records: RwLock::new(None),
        })
    }

    fn set(&self, records: Option<BTreeMap<String, T>>) {
        *self.records.write().unwrap_or_else(|e| e.into_inner()) = records;
    }

    fn is_current(&self) -> bool {
        self.records
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// The record at `key` if the copy is current and holds it.
    fn get(&self, key: &str) -> Option<T> {
        self.records
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()?
            .get(key)
            .cloned()
    }

    /// Every record under `prefix`, if the copy is current.
    fn under(&self, prefix: &str) -> Option<Vec<T>> {
        let records = self.records.read().unwrap_or_else(|e| e.into_inner());
        let records = records.as_ref()?;
        Some(
            records
                .range(prefix.to_string()..)
                .take_while(|(key, _)| key.starts_with(prefix))
                .map(|(_, record)| record.clone())
                .collect(),
        )
    }

    /// List, then follow the watch from the listing's revision; list again when it fails.
    async fn follow(self: Arc<Self>, store: Arc<dyn Store>) {
        loop {
            if let Err(e) = self.list_and_watch(&store).await {
                tracing::warn!(prefix = self.prefix, %e, "authorization cache: watch failed, reading the store until it is listed again");
            }
            self.set(None);
            tokio::time::sleep(RELIST_PAUSE).await;
        }
    }

    async fn list_and_watch(&self, store: &Arc<dyn Store>) -> Result<(), String> {
        let range = store.range(self.prefix).await.map_err(|e| e.to_string())?;
        let mut watch = store
            .watch(self.prefix, Some(range.revision))
            .await
            .map_err(|e| e.to_string())?;
        let mut records = BTreeMap::new();
        for kv in &range.kvs {
            match from_json::<T>(kv) {
                Ok(record) => {
                    records.insert(kv.key.clone(), record);
                }
                Err(e) => tracing::warn!(%e, "authorization cache: record skipped"),
            }
        }
        self.set(Some(records));
        while let Some(event) = watch.next().await {
            let event = event.map_err(|e| e.to_string())?;
            let mut guard = self.records.write().unwrap_or_else(|e| e.into_inner());
            let Some(records) = guard.as_mut() else {
                return Err("the copy was dropped".into());
            };
            let decoded = match event.kind {
                EventKind::Put => serde_json::from_slice::<T>(&event.value).ok(),
                EventKind::Delete => None,
            };
            // An undecodable put removes the key: the store's reads then say what is wrong.
            match decoded {
                Some(record) => records.insert(event.key, record),
                None => records.remove(&event.key),
            };
        }
        Err("the store closed the watch".into())
    }
}

/// The authorization records of one replica; dropping it stops its watches.
pub struct IamCache {
    tokens: Arc<Mirror<TokenRecord>>,
    principals: Arc<Mirror<Principal>>,
    projects: Arc<Mirror<Project>>,
    bindings: Arc<Mirror<RoleBinding>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl std::fmt::Debug for IamCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("IamCache")
    }
}

impl Drop for IamCache {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

impl IamCache {
    /// Starts following the store (on the current tokio runtime).
    pub fn start(store: Arc<dyn Store>) -> Arc<Self> {
        let tokens = Mirror::new(keys::TOKENS);
        let principals = Mirror::new(keys::PRINCIPALS);
        let projects = Mirror::new(keys::PROJECTS);
        let bindings = Mirror::new(keys::BINDINGS);
        let tasks = vec![
            tokio::spawn(tokens.clone().follow(store.clone())),
            tokio::spawn(principals.clone().follow(store.clone())),
            tokio::spawn(projects.clone().follow(store.clone())),
            tokio::spawn(bindings.clone().follow(store)),
        ];
        Arc::new(IamCache {
            tokens,
            principals,
            projects,
            bindings,
            tasks,
        })
    }

    pub(super) fn token(&self, key: &str) -> Option<TokenRecord> {
        self.tokens.get(key)
    }

    pub(super) fn principal(&self, key: &str) -> Option<Principal> {
        self.principals.get(key)
    }

    pub(super) fn has_project(&self, key: &str) -> bool {
        self.projects.get(key).is_some()
    }

    pub(super) fn bindings_under(&self, prefix: &str) -> Option<Vec<RoleBinding>> {
        self.bindings.under(prefix)
    }

    /// Whether every part of the copy is current (tests wait for it).
    pub fn is_current(&self) -> bool {
        self.tokens.is_current()
            && self.principals.is_current()
            && self.projects.is_current()
            && self.bindings.is_current()
    }
}

#[cfg(test)]
mod tests;
