//! The apiserver certificates a node refuses: the cluster's revoked list
//! (`dsec control revoke-apiserver`), which the node learns from the apiserver's Register and
//! Heartbeat replies. Checked in the node's TLS handshake; open connections of a certificate
//! the list gains are closed.

use std::sync::{Arc, RwLock};

use sha2::Digest;
use tokio_rustls::rustls::pki_types::CertificateDer;

use super::{apiserver_only, certificate_names, ClientCheck, Connections};

/// The SHA-256 of a certificate's DER, lowercase hex.
pub fn fingerprint(der: &[u8]) -> String {
    sha2::Sha256::digest(der)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Whether `entry` is a SHA-256 fingerprint (64 of 0-9, a-f); else it names a replica.
pub fn is_fingerprint(entry: &str) -> bool {
    entry.len() == 64
        && entry
            .bytes()
            .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// The name an apiserver replica's own certificate carries besides `apiserver.dsec`
/// (`dsec control issue-apiserver --name NAME`), so it can be revoked by name.
pub fn apiserver_replica_name(name: &str) -> String {
    format!("{name}.apiserver.dsec")
}

/// Whether `cert` is refused by one of `entries`: its fingerprint, or a replica name it
/// carries.
pub fn revoked_by(entries: &[String], cert: &CertificateDer<'_>) -> bool {
    if entries.is_empty() {
        return false;
    }
    let shown = fingerprint(cert);
    entries.iter().any(|entry| {
        if is_fingerprint(entry) {
            *entry == shown
        } else {
            certificate_names(cert, &apiserver_replica_name(entry))
        }
    })
}

/// A node's copy of the revoked apiserver list.
#[derive(Debug)]
pub struct RevokedApiservers {
    /// None until an apiserver handed the node the list: then every apiserver is refused
    /// (a restarted node must not trust a revoked key in the moment before it registers).
    entries: RwLock<Option<Vec<String>>>,
    connections: Arc<Connections>,
}

impl RevokedApiservers {
    /// `known`: start with an empty list (a node that never registers, so never learns one);
    /// else apiservers are refused until the first [`update`](Self::update).
    pub fn new(known: bool) -> Arc<Self> {
        Arc::new(RevokedApiservers {
            entries: RwLock::new(known.then(Vec::new)),
            connections: Connections::new(),
        })
    }

    /// Whether the node refuses `cert` now.
    pub fn refuses(&self, cert: &CertificateDer<'_>) -> bool {
        match &*self.entries.read().unwrap_or_else(|e| e.into_inner()) {
            None => true,
            Some(entries) => revoked_by(entries, cert),
        }
    }

    /// The node API's handshake check: an apiserver's certificate ([`apiserver_only`]) that
    /// the list does not refuse.
    pub fn check(self: &Arc<Self>) -> ClientCheck {
        let role = apiserver_only();
        let this = self.clone();
        Arc::new(move |cert| {
            role(cert)?;
            if this.refuses(cert) {
                return Err(tokio_rustls::rustls::CertificateError::Revoked);
            }
            Ok(())
        })
    }

    /// The open connections of the node's API (`accept_closable`), closed when their
    /// certificate becomes refused.
    pub fn connections(&self) -> Arc<Connections> {
        self.connections.clone()
    }

    /// Takes the list an apiserver handed out (bounded: at most `MAX_ENTRIES` of at most
    /// 64 bytes each are kept); closes the open connections it now refuses and returns how
    /// many.
    pub fn update(&self, mut entries: Vec<String>) -> usize {
        entries.retain(|e| !e.is_empty() && e.len() <= 64);
        entries.truncate(MAX_ENTRIES);
        entries.sort();
        entries.dedup();
        {
            let mut current = self.entries.write().unwrap_or_else(|e| e.into_inner());
            if current.as_ref() == Some(&entries) {
                return 0;
            }
            *current = Some(entries);
        }
        self.connections.close_where(|cert| self.refuses(cert))
    }
}

/// Entries a node keeps (the list is operator-made; a longer one is cut).
pub const MAX_ENTRIES: usize = 1024;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_fingerprints_or_names_and_unknown_refuses_everything() {
        let cert = CertificateDer::from(b"not a real certificate".to_vec());
        let revoked = RevokedApiservers::new(false);
        assert!(revoked.refuses(&cert), "no list yet: refused");
        revoked.update(vec!["a".repeat(64)]);
        assert!(!revoked.refuses(&cert));
        revoked.update(vec![fingerprint(&cert)]);
        assert!(revoked.refuses(&cert));
        assert!(is_fingerprint(&"0".repeat(64)));
        assert!(!is_fingerprint("replica-a"));
        assert!(!RevokedApiservers::new(true).refuses(&cert));
    }
}
