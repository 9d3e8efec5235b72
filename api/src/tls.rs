//! TLS material of a cluster, shared by the apiserver, nodes, SDK and CLI (feature `tls`).
//!
//! A cluster's directory (made by `dsec control init`) holds `ca.pem`, the cluster CA, and
//! for each role `<role>.pem` + `<role>.key`: `apiserver` (every replica) and `node` (one per
//! node, issued by `dsec control issue-node`). Apiservers and nodes authenticate each other
//! with these (mTLS); clients check the apiserver against `ca.pem` and authenticate with
//! tokens.

use std::path::{Path, PathBuf};

use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

/// The name every apiserver certificate carries; nodes check apiservers against it, so they
/// can reach an apiserver at any address.
pub const APISERVER_NAME: &str = "apiserver.dsec";

/// The name a node's certificate carries; the apiserver checks it when it calls the node.
pub fn node_server_name(node: &str) -> String {
    format!("{node}.node.dsec")
}

/// Files of one role in a cluster's TLS directory.
#[derive(Clone, Debug)]
pub struct TlsDir {
    pub dir: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {path}: {source} (make it with `dsec control init --tls-dir DIR` or `dsec control issue-node`)")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} holds no PEM {what}: give the file `dsec control init` or `issue-node` wrote")]
    NotPem { path: PathBuf, what: &'static str },
}

/// Reads a PEM file, checking it holds a block of the expected kind.
pub fn read_pem(path: &Path, what: &'static str) -> Result<Vec<u8>, TlsError> {
    let bytes = std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    if !bytes.windows(11).any(|w| w == b"-----BEGIN ") {
        return Err(TlsError::NotPem {
            path: path.to_path_buf(),
            what,
        });
    }
    Ok(bytes)
}

impl TlsDir {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        TlsDir { dir: dir.into() }
    }

    pub fn ca(&self) -> Result<Certificate, TlsError> {
        Ok(Certificate::from_pem(read_pem(
            &self.dir.join("ca.pem"),
            "certificate",
        )?))
    }

    pub fn identity(&self, role: &str) -> Result<Identity, TlsError> {
        let cert = read_pem(&self.dir.join(format!("{role}.pem")), "certificate")?;
        let key = read_pem(&self.dir.join(format!("{role}.key")), "private key")?;
        Ok(Identity::from_pem(cert, key))
    }

    /// A server of `role`: its own certificate; client certificates signed by the cluster CA
    /// required (`optional`: clients without one are let in, e.g. token holders, and clients
    /// with one from another CA are still refused).
    pub fn server(
        &self,
        role: &str,
        optional_client_cert: bool,
    ) -> Result<ServerTlsConfig, TlsError> {
        Ok(ServerTlsConfig::new()
            .identity(self.identity(role)?)
            .client_ca_root(self.ca()?)
            .client_auth_optional(optional_client_cert))
    }

    /// A client of `role` calling a server that must prove it is `server_name`.
    pub fn client(&self, role: &str, server_name: &str) -> Result<ClientTlsConfig, TlsError> {
        Ok(ClientTlsConfig::new()
            .ca_certificate(self.ca()?)
            .identity(self.identity(role)?)
            .domain_name(server_name))
    }
}

/// A token-holding client's TLS: the server checked against the CA in `ca_file`.
pub fn client_with_ca(ca_file: &Path) -> Result<ClientTlsConfig, TlsError> {
    Ok(ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(read_pem(ca_file, "certificate")?)))
}

/// The error and its causes on one line, so a refused handshake says why (e.g. "invalid peer
/// certificate: UnknownIssuer").
pub fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}
