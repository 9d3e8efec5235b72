//! Revoked node certificates: `/dsec/revoked-nodes/<name>` lists the SHA-256 fingerprints of
//! the node's certificates that are no longer accepted, or says that none of the node's are
//! (a node revoked before it ever showed one, or on a plaintext cluster). Every apiserver
//! replica follows the list with a watch (as the authorization cache does) and checks it on
//! each TLS handshake (a revoked certificate gets no connection) and on each Register and
//! Heartbeat (a connection made before the revocation); a revocation also ends the node's registration, so the
//! watcher marks its sandboxes lost and returns their quota.

mod apiservers;
pub use apiservers::{
    lift_apiserver, revoke_apiserver, revoked_apiservers, valid_replica_name,
    ApiserverRevocationError, ApiserverRevocations, RevokedApiserver,
};

use std::sync::Arc;

use dsec_api::tls::{CertificateDer, Connections};
use serde::{Deserialize, Serialize};

use crate::keys;
use crate::now_ms;
use crate::sandbox_id::valid_node_name;
use crate::store::{from_json, to_json, Compare, Mirror, Op, Store, StoreError, Txn};

/// Fingerprints kept per node (older ones are dropped first; a node re-issued this often is
/// better revoked as a whole).
const MAX_FINGERPRINTS: usize = 64;
/// Compare-and-swap attempts before giving up on a contended record.
const ATTEMPTS: usize = 8;
/// How long a revoke or lift waits for this replica's own copy to show it.
const COPY_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// The revocation record of one node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RevokedNode {
    pub node: String,
    /// Every certificate of the node is refused (no fingerprint was known).
    pub all_certificates: bool,
    /// SHA-256 of the refused certificates' DER, lowercase hex.
    pub fingerprints: Vec<String>,
    pub revoked_ms: u64,
    /// Who revoked it (a principal).
    pub by: String,
}

impl RevokedNode {
    /// Whether a caller showing the certificate `fingerprint` (None: no certificate, plaintext)
    /// is refused.
    pub fn refuses(&self, fingerprint: Option<&str>) -> bool {
        self.all_certificates
            || fingerprint.is_some_and(|f| self.fingerprints.iter().any(|r| r == f))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RevocationError {
    #[error("the certificate of node {node} was revoked at {revoked_ms} ms after the epoch by {by}: issue a new one with `dsec control issue-node --name {node}` and restart the node with it")]
    Revoked {
        node: String,
        revoked_ms: u64,
        by: String,
    },
    #[error(
        "node name {0:?} is invalid: 1-8 of a-z, 0-9 and '-', not starting or ending with '-'"
    )]
    BadNodeName(String),
    #[error("fingerprint {0:?} is not a SHA-256 in hex (64 of 0-9, a-f)")]
    BadFingerprint(String),
    #[error("the revocation record of node {0} kept changing under concurrent writes: try again")]
    Contended(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl RevocationError {
    pub fn code(&self) -> tonic::Code {
        match self {
            RevocationError::Revoked { .. } => tonic::Code::PermissionDenied,
            RevocationError::BadNodeName(_) | RevocationError::BadFingerprint(_) => {
                tonic::Code::InvalidArgument
            }
            RevocationError::Contended(_) => tonic::Code::Aborted,
            RevocationError::Store(e) => crate::store_code(e),
        }
    }
}

impl From<RevocationError> for tonic::Status {
    fn from(e: RevocationError) -> Self {
        tonic::Status::new(e.code(), e.to_string())
    }
}

pub use dsec_api::tls::fingerprint;

fn check_fingerprint(text: &str) -> Result<(), RevocationError> {
    if dsec_api::tls::is_fingerprint(text) {
        Ok(())
    } else {
        Err(RevocationError::BadFingerprint(
            text.chars().take(80).collect(),
        ))
    }
}

/// The record (if any, in a current copy) that refuses `cert`: its fingerprint, or every
/// certificate of a node it names.
fn refusal(mirror: &Mirror<RevokedNode>, cert: &CertificateDer<'_>) -> Option<RevokedNode> {
    let revoked = mirror.under(keys::REVOKED_NODES)?;
    if revoked.is_empty() {
        return None;
    }
    let shown = fingerprint(cert);
    revoked.into_iter().find(|record| {
        record.fingerprints.contains(&shown)
            || record.all_certificates
                && dsec_api::tls::certificate_names(
                    cert,
                    &dsec_api::tls::node_server_name(&record.node),
                )
    })
}

/// On every change of the copy, closes the open connections whose certificate it now
/// refuses (their calls end; the node's reconnect is refused in the handshake).
async fn close_revoked(mirror: Arc<Mirror<RevokedNode>>, connections: Arc<Connections>) {
    let mut changes = mirror.changes();
    while changes.changed().await.is_ok() {
        let closed = connections.close_where(|cert| refusal(&mirror, cert).is_some());
        if closed > 0 {
            tracing::warn!(closed, "closed connections of revoked node certificates");
        }
    }
}

/// One replica's view of the revoked node list; dropping it stops its watch.
pub struct NodeRevocations {
    store: Arc<dyn Store>,
    mirror: Arc<Mirror<RevokedNode>>,
    /// The apiserver's open TLS connections, closed when their certificate is revoked.
    connections: Arc<Connections>,
    task: tokio::task::JoinHandle<()>,
    closer: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for NodeRevocations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NodeRevocations")
    }
}

impl Drop for NodeRevocations {
    fn drop(&mut self) {
        self.task.abort();
        self.closer.abort();
    }
}

impl NodeRevocations {
    /// Starts following the list (on the current tokio runtime).
    pub fn start(store: Arc<dyn Store>) -> Self {
        let mirror = Mirror::new(keys::REVOKED_NODES);
        let task = tokio::spawn(mirror.clone().follow(store.clone()));
        let connections = Connections::new();
        let closer = tokio::spawn(close_revoked(mirror.clone(), connections.clone()));
        NodeRevocations {
            store,
            mirror,
            connections,
            task,
            closer,
        }
    }

    /// The open connections the apiserver's TLS port tracks (`dsec_api::tls::accept_closable`):
    /// those of a certificate revoked later are closed as the revocation reaches this copy.
    pub fn connections(&self) -> Arc<Connections> {
        self.connections.clone()
    }

    /// Whether the copy is current (tests wait for it).
    pub fn is_current(&self) -> bool {
        self.mirror.is_current()
    }

    /// The node's revocation record: from the copy while it is current, else from the store.
    pub async fn get(&self, node: &str) -> Result<Option<RevokedNode>, RevocationError> {
        let key = keys::revoked_node(node);
        if self.mirror.is_current() {
            return Ok(self.mirror.get(&key));
        }
        Ok(self
            .store
            .get(&key)
            .await?
            .as_ref()
            .map(from_json)
            .transpose()?)
    }

    /// Refuses node `node` showing the certificate `fingerprint` if it was revoked.
    pub async fn check(
        &self,
        node: &str,
        fingerprint: Option<&str>,
    ) -> Result<(), RevocationError> {
        match self.get(node).await? {
            Some(revoked) if revoked.refuses(fingerprint) => Err(RevocationError::Revoked {
                node: node.to_string(),
                revoked_ms: revoked.revoked_ms,
                by: revoked.by,
            }),
            _ => Ok(()),
        }
    }

    /// The handshake check of the apiserver's TLS port: a certificate the copy lists as
    /// revoked (its fingerprint, or every certificate of a node it names) gets no connection.
    /// While the copy is not current the handshake lets it through and Register/Heartbeat
    /// (which then read the store) refuse it.
    pub fn handshake_check(&self) -> dsec_api::tls::ClientCheck {
        let mirror = self.mirror.clone();
        Arc::new(move |cert| match refusal(&mirror, cert) {
            Some(record) => {
                tracing::warn!(node = %record.node, "refused a revoked node certificate in the TLS handshake");
                Err(dsec_api::tls::CertificateError::Revoked)
            }
            None => Ok(()),
        })
    }

    /// Every revocation record, in node name order (from the store).
    pub async fn list(&self) -> Result<Vec<RevokedNode>, RevocationError> {
        let range = self.store.range(keys::REVOKED_NODES).await?;
        Ok(range.kvs.iter().map(from_json).collect::<Result<_, _>>()?)
    }

    /// Adds the certificate `fingerprint` of `node` to the list, or (None) refuses all of
    /// the node's certificates.
    pub async fn revoke(
        &self,
        node: &str,
        fingerprint: Option<&str>,
        by: &str,
    ) -> Result<RevokedNode, RevocationError> {
        if !valid_node_name(node) {
            return Err(RevocationError::BadNodeName(
                node.chars().take(40).collect(),
            ));
        }
        if let Some(fingerprint) = fingerprint {
            check_fingerprint(fingerprint)?;
        }
        let key = keys::revoked_node(node);
        for _ in 0..ATTEMPTS {
            let read = self.store.get(&key).await?;
            let mut record = match &read {
                Some(kv) => from_json::<RevokedNode>(kv)?,
                None => RevokedNode {
                    node: node.to_string(),
                    all_certificates: false,
                    fingerprints: Vec::new(),
                    revoked_ms: 0,
                    by: String::new(),
                },
            };
            match fingerprint {
                None => record.all_certificates = true,
                Some(f) if !record.fingerprints.iter().any(|r| r == f) => {
                    record.fingerprints.push(f.to_string());
                    let excess = record.fingerprints.len().saturating_sub(MAX_FINGERPRINTS);
                    record.fingerprints.drain(..excess);
                }
                Some(_) => {}
            }
            record.revoked_ms = now_ms();
            record.by = by.to_string();
            let outcome = self
                .store
                .txn(
                    Txn::default()
                        .when(Compare::as_read(&key, read.as_ref()))
                        .then(Op::put(key.clone(), to_json(&record))),
                )
                .await?;
            if outcome.succeeded {
                self.await_copy(&key, Some(&record)).await;
                return Ok(record);
            }
        }
        Err(RevocationError::Contended(node.to_string()))
    }

    /// Lifts every revocation of `node`; whether there was one.
    pub async fn lift(&self, node: &str) -> Result<bool, RevocationError> {
        if !valid_node_name(node) {
            return Err(RevocationError::BadNodeName(
                node.chars().take(40).collect(),
            ));
        }
        let key = keys::revoked_node(node);
        let existed = self.store.delete(&key).await?;
        self.await_copy(&key, None).await;
        Ok(existed)
    }

    /// Waits (briefly) until this replica's copy shows `expected` at `key`, so that a revoke
    /// or lift answered by this replica is already in force on it. Other replicas follow
    /// within their watch's delivery time.
    async fn await_copy(&self, key: &str, expected: Option<&RevokedNode>) {
        let deadline = tokio::time::Instant::now() + COPY_WAIT;
        while !(self.mirror.is_current() && self.mirror.get(key).as_ref() == expected)
            && tokio::time::Instant::now() < deadline
        {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_refuses_its_fingerprints_or_everything() {
        let mut record = RevokedNode {
            node: "n1".into(),
            all_certificates: false,
            fingerprints: vec!["a".repeat(64)],
            revoked_ms: 1,
            by: "user:root".into(),
        };
        assert!(record.refuses(Some(&"a".repeat(64))));
        assert!(!record.refuses(Some(&"b".repeat(64))));
        assert!(!record.refuses(None));
        record.all_certificates = true;
        assert!(record.refuses(None));
        assert!(record.refuses(Some(&"b".repeat(64))));
    }

    #[test]
    fn fingerprints_are_sha256_hex() {
        assert_eq!(fingerprint(b"").len(), 64);
        assert!(check_fingerprint(&fingerprint(b"x")).is_ok());
        assert!(check_fingerprint("AB").is_err());
        assert!(check_fingerprint(&"A".repeat(64)).is_err());
    }

    crate::testing::on_both_stores!(revocations_accumulate_and_lift);

    async fn revocations_accumulate_and_lift(store: Arc<dyn Store>) {
        let revocations = NodeRevocations::start(store.clone());
        let (one, two) = ("1".repeat(64), "2".repeat(64));
        revocations
            .revoke("n1", Some(&one), "user:a")
            .await
            .unwrap();
        let record = revocations
            .revoke("n1", Some(&two), "user:b")
            .await
            .unwrap();
        assert_eq!(record.fingerprints, vec![one.clone(), two.clone()]);
        assert!(!record.all_certificates);
        assert!(revocations.check("n1", Some(&one)).await.is_err());
        assert!(revocations.check("n1", Some(&"3".repeat(64))).await.is_ok());
        assert!(revocations.check("n2", Some(&one)).await.is_ok());
        let status: tonic::Status = revocations
            .check("n1", Some(&two))
            .await
            .unwrap_err()
            .into();
        assert_eq!(status.code(), tonic::Code::PermissionDenied);
        assert!(
            status.message().contains("issue-node --name n1"),
            "{status:?}"
        );
        assert!(revocations.revoke("Bad!", None, "user:a").await.is_err());
        assert!(revocations
            .revoke("n1", Some("zz"), "user:a")
            .await
            .is_err());
        revocations.revoke("n1", None, "user:a").await.unwrap();
        assert!(revocations.check("n1", None).await.is_err());
        assert_eq!(revocations.list().await.unwrap().len(), 1);
        assert!(revocations.lift("n1").await.unwrap());
        // A lift answered by this replica is in force on it at once.
        assert!(revocations.check("n1", None).await.is_ok());
    }
}
