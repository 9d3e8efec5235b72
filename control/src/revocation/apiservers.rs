//! Revoked apiserver certificates: `/dsec/revoked-apiservers/<entry>`, an entry being the
//! SHA-256 fingerprint of a certificate's DER or a replica's name (its certificate from
//! `dsec control issue-apiserver --name NAME` carries `NAME.apiserver.dsec`). Written by
//! `dsec control revoke-apiserver` straight to the store; every replica follows the list with
//! a watch and hands it to each node in every Register and Heartbeat reply; the node refuses
//! those certificates in its TLS handshake and closes their open connections
//! (`dsec_api::tls::RevokedApiservers`).

use std::sync::Arc;

use dsec_api::tls::is_fingerprint;
use serde::{Deserialize, Serialize};

use crate::keys;
use crate::now_ms;
use crate::store::{from_json, to_json, Mirror, Store, StoreError};

/// A replica name: 1-32 of a-z, 0-9 and '-', not starting or ending with '-' (one DNS label).
pub fn valid_replica_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 32
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-')
}

/// One revoked apiserver certificate (or every certificate of a replica name).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RevokedApiserver {
    /// A SHA-256 fingerprint (64 hex) or a replica name.
    pub entry: String,
    pub revoked_ms: u64,
    /// Who revoked it (the operator's user name on the machine that ran the command).
    pub by: String,
}

#[derive(Debug, thiserror::Error)]
pub enum ApiserverRevocationError {
    #[error("{0:?} is neither a SHA-256 fingerprint (64 of 0-9, a-f; `dsec control issue-apiserver` prints it) nor a replica name (1-32 of a-z, 0-9 and '-')")]
    BadEntry(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

fn checked(entry: &str) -> Result<String, ApiserverRevocationError> {
    // `openssl x509 -fingerprint` writes upper case hex with colons.
    let entry = entry.trim().replace(':', "").to_ascii_lowercase();
    if is_fingerprint(&entry) || valid_replica_name(&entry) {
        Ok(entry)
    } else {
        Err(ApiserverRevocationError::BadEntry(
            entry.chars().take(80).collect(),
        ))
    }
}

/// Adds `entry` to the revoked list (again: a fresh time and author).
pub async fn revoke_apiserver(
    store: &dyn Store,
    entry: &str,
    by: &str,
) -> Result<RevokedApiserver, ApiserverRevocationError> {
    let entry = checked(entry)?;
    let record = RevokedApiserver {
        entry: entry.clone(),
        revoked_ms: now_ms(),
        by: by.to_string(),
    };
    store
        .put(&keys::revoked_apiserver(&entry), to_json(&record), None)
        .await?;
    Ok(record)
}

/// Takes `entry` off the list; whether it was on it.
pub async fn lift_apiserver(
    store: &dyn Store,
    entry: &str,
) -> Result<bool, ApiserverRevocationError> {
    let entry = checked(entry)?;
    Ok(store.delete(&keys::revoked_apiserver(&entry)).await?)
}

/// The whole list, in entry order (from the store).
pub async fn revoked_apiservers(
    store: &dyn Store,
) -> Result<Vec<RevokedApiserver>, ApiserverRevocationError> {
    let range = store.range(keys::REVOKED_APISERVERS).await?;
    Ok(range.kvs.iter().map(from_json).collect::<Result<_, _>>()?)
}

/// One replica's copy of the list, for its Register and Heartbeat replies; dropping it
/// stops its watch.
pub struct ApiserverRevocations {
    store: Arc<dyn Store>,
    mirror: Arc<Mirror<RevokedApiserver>>,
    /// The list as last read, for when the store cannot be read.
    last: std::sync::Mutex<Vec<String>>,
    task: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for ApiserverRevocations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiserverRevocations")
    }
}

impl Drop for ApiserverRevocations {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl ApiserverRevocations {
    /// Starts following the list (on the current tokio runtime).
    pub fn start(store: Arc<dyn Store>) -> Self {
        let mirror = Mirror::new(keys::REVOKED_APISERVERS);
        let task = tokio::spawn(mirror.clone().follow(store.clone()));
        ApiserverRevocations {
            store,
            mirror,
            last: Default::default(),
            task,
        }
    }

    /// The entries a node must refuse: from the copy while it is current, else from the
    /// store; when the store cannot be read either (an etcd member down), the last list
    /// this replica handed out, so that a Register or Heartbeat never fails for it (a node
    /// losing its lease over this list would be worse than one heartbeat with an old list).
    pub async fn entries(&self) -> Vec<String> {
        let records = match self.mirror.under(keys::REVOKED_APISERVERS) {
            Some(records) => Some(records),
            None => revoked_apiservers(self.store.as_ref()).await.ok(),
        };
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(records) = records {
            *last = records.into_iter().map(|r| r.entry).collect();
        }
        last.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_fingerprints_or_replica_names() {
        assert_eq!(checked(&"AB".repeat(32)).unwrap(), "ab".repeat(32));
        assert_eq!(checked("replica-a").unwrap(), "replica-a");
        assert_eq!(checked(&"AB:".repeat(32)).unwrap(), "ab".repeat(32));
        for bad in ["", "-a", "a/b", "x".repeat(33).as_str(), "apiserver.dsec"] {
            assert!(checked(bad).is_err(), "{bad:?}");
        }
    }

    crate::testing::on_both_stores!(the_list_follows_revokes_and_lifts);

    async fn the_list_follows_revokes_and_lifts(store: Arc<dyn Store>) {
        let copy = ApiserverRevocations::start(store.clone());
        assert!(copy.entries().await.is_empty());
        revoke_apiserver(store.as_ref(), "replica-a", "root")
            .await
            .unwrap();
        let fp = "1".repeat(64);
        revoke_apiserver(store.as_ref(), &fp, "root").await.unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while copy.entries().await.len() < 2 && std::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert_eq!(copy.entries().await, vec![fp.clone(), "replica-a".into()]);
        assert!(lift_apiserver(store.as_ref(), "replica-a").await.unwrap());
        assert!(!lift_apiserver(store.as_ref(), "replica-a").await.unwrap());
        assert_eq!(revoked_apiservers(store.as_ref()).await.unwrap().len(), 1);
    }
}
