//! One replica's copy of the records under a store prefix, listed once and kept fresh by a
//! watch from the listing's revision (the authorization cache, the revoked node list). A copy
//! whose watch failed answers nothing (callers read the store) until it has listed again.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use serde::de::DeserializeOwned;

use super::{from_json, EventKind, Store};

/// Pause before listing again after a watch failed.
const RELIST_PAUSE: Duration = Duration::from_millis(200);

/// The records under one prefix, by key.
pub(crate) struct Mirror<T> {
    prefix: &'static str,
    /// None while the copy is not known to be current (before the first listing, after a
    /// watch failure).
    records: RwLock<Option<BTreeMap<String, T>>>,
    /// Bumped on every change of the copy (listing, event, loss), for [`Mirror::changes`].
    changed: tokio::sync::watch::Sender<u64>,
}

impl<T: DeserializeOwned + Clone + Send + Sync + 'static> Mirror<T> {
    pub(crate) fn new(prefix: &'static str) -> Arc<Self> {
        Arc::new(Mirror {
            prefix,
            records: RwLock::new(None),
            changed: tokio::sync::watch::Sender::new(0),
        })
    }

    fn set(&self, records: Option<BTreeMap<String, T>>) {
        *self.records.write().unwrap_or_else(|e| e.into_inner()) = records;
        self.changed.send_modify(|n| *n += 1);
    }

    /// Told after each change of the copy.
    pub(crate) fn changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changed.subscribe()
    }

    pub(crate) fn is_current(&self) -> bool {
        self.records
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// The record at `key` if the copy is current and holds it.
    pub(crate) fn get(&self, key: &str) -> Option<T> {
        self.records
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()?
            .get(key)
            .cloned()
    }

    /// Every record under `prefix`, if the copy is current.
    pub(crate) fn under(&self, prefix: &str) -> Option<Vec<T>> {
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
    pub(crate) async fn follow(self: Arc<Self>, store: Arc<dyn Store>) {
        loop {
            if let Err(e) = self.list_and_watch(&store).await {
                tracing::warn!(prefix = self.prefix, %e, "store mirror: watch failed, reading the store until it is listed again");
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
                Err(e) => tracing::warn!(%e, "store mirror: record skipped"),
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
            drop(guard);
            self.changed.send_modify(|n| *n += 1);
        }
        Err("the store closed the watch".into())
    }
}
