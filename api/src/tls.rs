//! TLS material of a cluster, shared by the apiserver, nodes, SDK and CLI (feature `tls`).
//!
//! A cluster's directory (made by `dsec control init`) holds `ca.pem`, the cluster CA, and
//! for each role `<role>.pem` + `<role>.key`: `apiserver` (every replica) and `node` (one per
//! node, issued by `dsec control issue-node`). Apiservers and nodes authenticate each other
//! with these (mTLS); clients check the apiserver against `ca.pem` and authenticate with
//! tokens.
//!
//! Servers accept TLS through [`TlsDir::acceptor`], which checks a client's certificate in the
//! handshake: signed by the cluster CA, then a [`ClientCheck`] of the server's (a node lets in
//! only apiservers, [`apiserver_only`]; an apiserver refuses revoked node certificates).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
pub use tokio_rustls::rustls::pki_types::CertificateDer;
use tokio_rustls::rustls::pki_types::{PrivateKeyDer, ServerName, UnixTime};
use tokio_rustls::rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use tokio_rustls::rustls::server::{ParsedCertificate, WebPkiClientVerifier};
use tokio_rustls::TlsAcceptor;
use tonic::transport::{Certificate, ClientTlsConfig, Identity};

pub use tokio_rustls::rustls::CertificateError;
pub use tokio_rustls::server::TlsStream;

mod connections;
mod revoked;
pub use connections::{Closable, Connections};
pub use revoked::{
    apiserver_replica_name, fingerprint, is_fingerprint, revoked_by, RevokedApiservers,
};

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
    #[error("the TLS files in {dir} do not make a server configuration: {why} (give the files `dsec control init` or `issue-node` wrote)")]
    Config { dir: PathBuf, why: String },
}

/// What a server asks of a client's certificate beyond the cluster CA's signature, checked
/// during the handshake; an error ends the connection with the matching alert.
pub type ClientCheck =
    Arc<dyn Fn(&CertificateDer<'_>) -> Result<(), CertificateError> + Send + Sync>;

/// Whether `cert` (DER) names `name` among its subject alternative names.
pub fn certificate_names(cert: &CertificateDer<'_>, name: &str) -> bool {
    let Ok(server_name) = ServerName::try_from(name) else {
        return false;
    };
    ParsedCertificate::try_from(cert)
        .and_then(|parsed| rustls::client::verify_server_name(&parsed, &server_name))
        .is_ok()
}

/// The check of a node's API: only apiservers call it. Their certificate (from `dsec control
/// init`) carries [`APISERVER_NAME`]; a node's (`issue-node`) carries `<name>.node.dsec` only,
/// so one node's key cannot drive another node.
pub fn apiserver_only() -> ClientCheck {
    Arc::new(|cert| {
        if certificate_names(cert, APISERVER_NAME) {
            Ok(())
        } else {
            Err(CertificateError::NotValidForName)
        }
    })
}

/// The cluster CA's verifier followed by the server's own check.
#[derive(Debug)]
struct CheckedClients {
    ca: Arc<dyn ClientCertVerifier>,
    check: CheckFn,
}

struct CheckFn(ClientCheck);

impl std::fmt::Debug for CheckFn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClientCheck")
    }
}

impl ClientCertVerifier for CheckedClients {
    fn offer_client_auth(&self) -> bool {
        self.ca.offer_client_auth()
    }

    fn client_auth_mandatory(&self) -> bool {
        self.ca.client_auth_mandatory()
    }

    fn root_hint_subjects(&self) -> &[rustls::DistinguishedName] {
        self.ca.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let verified = self.ca.verify_client_cert(end_entity, intermediates, now)?;
        (self.check.0)(end_entity).map_err(rustls::Error::InvalidCertificate)?;
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.ca.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.ca.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.ca.supported_verify_schemes()
    }
}

/// A handshake that takes longer than this is dropped (a stalled client holds no slot).
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// TLS connections from `listener`, each handshake on its own task (a slow client does not
/// hold up the others); failed handshakes are dropped. For `Server::serve_with_incoming`;
/// the accept loop ends when the server drops the stream.
pub fn accept(
    listener: TcpListener,
    acceptor: TlsAcceptor,
) -> tokio_stream::wrappers::ReceiverStream<std::io::Result<TlsStream<TcpStream>>> {
    accept_mapped(listener, acceptor, |tls| tls)
}

/// [`accept`], each connection tracked in `connections` so that the server can close it
/// later (a revoked client certificate).
pub fn accept_closable(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    connections: Arc<Connections>,
) -> tokio_stream::wrappers::ReceiverStream<std::io::Result<Closable<TlsStream<TcpStream>>>> {
    accept_mapped(listener, acceptor, move |tls| connections.track(tls))
}

fn accept_mapped<T: Send + 'static>(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    map: impl Fn(TlsStream<TcpStream>) -> T + Send + Sync + 'static,
) -> tokio_stream::wrappers::ReceiverStream<std::io::Result<T>> {
    let map = Arc::new(map);
    let (sender, receiver) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            let tcp = tokio::select! {
                _ = sender.closed() => return,
                accepted = listener.accept() => accepted,
            };
            let (tcp, _) = match tcp {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of descriptors and the like: pause instead of spinning.
                    if sender.send(Err(e)).await.is_err() {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = tcp.set_nodelay(true);
            let acceptor = acceptor.clone();
            let sender = sender.clone();
            let map = map.clone();
            tokio::spawn(async move {
                if let Ok(Ok(tls)) =
                    tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await
                {
                    let _ = sender.send(Ok(map(tls))).await;
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(receiver)
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

    /// A TLS acceptor for a server of `role`: its own certificate; client certificates signed
    /// by the cluster CA and passing `check` required (`optional_client_cert`: clients without
    /// one are let in, e.g. token holders; one from another CA or failing `check` is still
    /// refused). Serve with [`accept`].
    pub fn acceptor(
        &self,
        role: &str,
        optional_client_cert: bool,
        check: ClientCheck,
    ) -> Result<TlsAcceptor, TlsError> {
        let config_error = |why: String| TlsError::Config {
            dir: self.dir.clone(),
            why,
        };
        let cert_path = self.dir.join(format!("{role}.pem"));
        let chain = CertificateDer::pem_slice_iter(&read_pem(&cert_path, "certificate")?)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| config_error(format!("{}: {e}", cert_path.display())))?;
        let key_path = self.dir.join(format!("{role}.key"));
        let key = PrivateKeyDer::from_pem_slice(&read_pem(&key_path, "private key")?)
            .map_err(|e| config_error(format!("{}: {e}", key_path.display())))?;
        let ca_path = self.dir.join("ca.pem");
        let mut roots = rustls::RootCertStore::empty();
        for ca in CertificateDer::pem_slice_iter(&read_pem(&ca_path, "certificate")?) {
            let ca = ca.map_err(|e| config_error(format!("{}: {e}", ca_path.display())))?;
            roots
                .add(ca)
                .map_err(|e| config_error(format!("{}: {e}", ca_path.display())))?;
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut ca = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone());
        if optional_client_cert {
            ca = ca.allow_unauthenticated();
        }
        let ca = ca.build().map_err(|e| config_error(e.to_string()))?;
        let verifier = Arc::new(CheckedClients {
            ca,
            check: CheckFn(check),
        });
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| config_error(e.to_string()))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain, key)
            .map_err(|e| config_error(e.to_string()))?;
        config.alpn_protocols = vec![b"h2".to_vec()];
        // No session resumption: a resumed session skips the client certificate check, so a
        // certificate revoked since its first handshake would get back in.
        config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
        config.send_tls13_tickets = 0;
        Ok(TlsAcceptor::from(Arc::new(config)))
    }

    /// A node's API: the node's certificate; only apiservers' certificates let in.
    pub fn node_acceptor(&self) -> Result<TlsAcceptor, TlsError> {
        self.acceptor("node", false, apiserver_only())
    }

    /// A node's API in a cluster: [`node_acceptor`](Self::node_acceptor) that also refuses the
    /// apiserver certificates `revoked` lists (serve with [`accept_closable`] on its
    /// connections, so those open when the list changes are closed).
    pub fn node_acceptor_with(
        &self,
        revoked: &Arc<RevokedApiservers>,
    ) -> Result<TlsAcceptor, TlsError> {
        self.acceptor("node", false, revoked.check())
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
