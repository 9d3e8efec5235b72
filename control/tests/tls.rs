//! Transport security of the apiserver, with real certificates from `pki` and a real
//! apiserver on loopback: nodes need a certificate of the cluster CA, one from another CA is
//! refused in the handshake, token holders get TLS checked against the CA, plaintext is
//! refused.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use dsec_api::node::v1 as pb;
use dsec_api::node::v1::registry_client::RegistryClient;
use dsec_api::tls::{client_with_ca, error_chain, TlsDir, APISERVER_NAME};
use dsec_api::v1::admin_client::AdminClient;
use dsec_api::v1::sandboxes_client::SandboxesClient;
use dsec_api::v1::{
    CreateSandboxRequest, ListNodesRequest, ListSandboxesRequest, RevokeNodeRequest, WhoAmIRequest,
};
use dsec_control::api::{self, ApiConfig};
use dsec_control::iam::{Iam, PrincipalId};
use dsec_control::pki;
use dsec_control::placement::NodeRegistry;
use dsec_control::quota::Quotas;
use dsec_control::resources::Resources;
use dsec_control::sim;
use dsec_control::store::{EmbeddedStore, Store};
use dsec_control::watcher::lost_sandbox;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};

use std::sync::atomic::{AtomicBool, Ordering};

fn free_addr() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap()
}

/// An apiserver with TLS from a fresh CA in `dir/ca`; returns its address and admin token.
async fn apiserver(dir: &Path) -> (SocketAddr, String) {
    let (addr, token, _) = apiserver_with_store(dir).await;
    (addr, token)
}

/// [`apiserver`], also handing back its store (another replica can serve from it).
async fn apiserver_with_store(dir: &Path) -> (SocketAddr, String, Arc<dyn Store>) {
    pki::init(&dir.join("ca"), &[]).unwrap();
    let store: Arc<dyn Store> = Arc::new(EmbeddedStore::open(&dir.join("store")).unwrap());
    let token = api::init(store.clone(), "acme", "root").await.unwrap();
    let addr = replica(dir, store.clone()).await;
    (addr, token.secret, store)
}

/// One more apiserver replica on `store`, with the TLS files in `dir/ca`.
async fn replica(dir: &Path, store: Arc<dyn Store>) -> SocketAddr {
    replica_with(store, &dir.join("ca")).await
}

async fn connect(addr: SocketAddr, tls: Option<ClientTlsConfig>) -> Result<Channel, String> {
    let scheme = if tls.is_some() { "https" } else { "http" };
    let mut endpoint = Endpoint::from_shared(format!("{scheme}://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(5));
    if let Some(tls) = tls {
        endpoint = endpoint.tls_config(tls).unwrap();
    }
    endpoint.connect().await.map_err(|e| error_chain(&e))
}

/// The client refuses the apiserver's certificate: not signed by the CA it trusts.
async fn refused_as_unknown_issuer(addr: SocketAddr, tls: ClientTlsConfig) {
    let refused = connect(addr, Some(tls)).await.map(|_| ()).unwrap_err();
    assert!(
        refused.contains("UnknownIssuer"),
        "unexpected refusal: {refused}"
    );
}

/// A refusal in the TLS handshake as the client sees it: one of the server's `alerts`, or a
/// closed or reset connection (TLS 1.3: the alert can race the client's first request; when
/// the connection closes before that request is sent, hyper reports "connection was not ready").
fn assert_refused_in_handshake(why: &str, alerts: &[&str]) {
    assert!(
        alerts.iter().any(|alert| why.contains(alert))
            || why.contains("closed")
            || why.contains("broken pipe")
            || why.contains("reset")
            || why.contains("connection was not ready"),
        "unexpected refusal: {why}"
    );
}

fn node_info(name: &str) -> pb::NodeInfo {
    pb::NodeInfo {
        name: name.into(),
        address: "127.0.0.1:1".into(),
        capacity: Some(pb::Resources {
            sandboxes: 10,
            vcpus: 4,
            memory_mib: 4096,
            disk_mib: 10240,
        }),
        backends: vec!["container".into()],
        ..Default::default()
    }
}

async fn register(channel: Channel, name: &str) -> Result<pb::RegisterResponse, tonic::Status> {
    RegistryClient::new(channel)
        .register(pb::RegisterRequest {
            node: Some(node_info(name)),
        })
        .await
        .map(|r| r.into_inner())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_need_a_certificate_of_the_cluster_ca() {
    let dir = tempfile::tempdir().unwrap();
    let (addr, _) = apiserver(dir.path()).await;

    // A node with a certificate of the cluster CA registers.
    pki::issue_node(&dir.path().join("ca"), &dir.path().join("n1"), "n1").unwrap();
    let n1 = TlsDir::new(dir.path().join("n1"));
    let channel = connect(addr, Some(n1.client("node", APISERVER_NAME).unwrap()))
        .await
        .unwrap();
    let lease = register(channel.clone(), "n1").await.unwrap();
    assert!(lease.lease_id != 0);
    // ...under its own name only.
    let status = register(channel, "n9").await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::PermissionDenied);
    assert!(status.message().contains("not node n9's"), "{status:?}");

    // A node whose certificate comes from another CA (but that trusts this cluster's CA) is
    // refused in the handshake: the apiserver closes the connection (TLS 1.3 checks the
    // client's certificate after the client has finished its side).
    pki::init(&dir.path().join("other-ca"), &[]).unwrap();
    pki::issue_node(&dir.path().join("other-ca"), &dir.path().join("n2"), "n2").unwrap();
    let foreign = TlsDir::new(dir.path().join("n2"));
    let mixed = ClientTlsConfig::new()
        .ca_certificate(TlsDir::new(dir.path().join("ca")).ca().unwrap())
        .identity(foreign.identity("node").unwrap())
        .domain_name(APISERVER_NAME);
    let refused = match connect(addr, Some(mixed)).await {
        Err(why) => why,
        Ok(channel) => {
            let status = register(channel, "n2").await.unwrap_err();
            format!("{}: {}", status.message(), error_chain(&status))
        }
    };
    assert_refused_in_handshake(&refused, &["UnknownCA", "certificate"]);

    // A node trusting only its own CA refuses the apiserver: it is not who it says.
    refused_as_unknown_issuer(addr, foreign.client("node", APISERVER_NAME).unwrap()).await;

    // A caller without a certificate (a token holder) is not a node.
    let channel = connect(
        addr,
        Some(client_with_ca(&dir.path().join("ca/ca.pem")).unwrap()),
    )
    .await
    .unwrap();
    let status = register(channel, "n3").await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unauthenticated);
    assert!(status.message().contains("node certificate"), "{status:?}");
}

async fn heartbeat(
    channel: Channel,
    name: &str,
    lease_id: i64,
) -> Result<pb::HeartbeatResponse, tonic::Status> {
    RegistryClient::new(channel)
        .heartbeat(pb::HeartbeatRequest {
            lease_id,
            node: Some(node_info(name)),
        })
        .await
        .map(|r| r.into_inner())
}

/// Node `name`'s channel to `addr` with a fresh certificate of the cluster CA in `dir/ca`.
async fn node_channel(dir: &Path, addr: SocketAddr, name: &str, cert_dir: &str) -> Channel {
    pki::issue_node(&dir.join("ca"), &dir.join(cert_dir), name).unwrap();
    channel_with(dir, addr, cert_dir).await
}

/// A node's channel to `addr` with the certificate in `dir/cert_dir`.
async fn channel_with(dir: &Path, addr: SocketAddr, cert_dir: &str) -> Channel {
    let tls = TlsDir::new(dir.join(cert_dir));
    connect(addr, Some(tls.client("node", APISERVER_NAME).unwrap()))
        .await
        .unwrap()
}

/// A new connection of node `name` with the certificate in `dir/cert_dir`: Ok(why) when the
/// apiserver refused it before any call was answered (the handshake), Err(what answered).
async fn refused_in_handshake(
    dir: &Path,
    addr: SocketAddr,
    name: &str,
    lease_id: i64,
) -> Result<String, String> {
    let tls = TlsDir::new(dir.join(name));
    let channel = match connect(addr, Some(tls.client("node", APISERVER_NAME).unwrap())).await {
        Err(why) => return Ok(why),
        Ok(channel) => channel,
    };
    match heartbeat(channel, name, lease_id).await {
        Ok(answer) => Err(format!("{answer:?}")),
        // An answer of the registry (the status it sets carries a message of its own).
        Err(status)
            if status.code() == tonic::Code::PermissionDenied
                || status.code() == tonic::Code::NotFound =>
        {
            Err(format!("{status:?}"))
        }
        Err(status) => Ok(format!("{}: {}", status.message(), error_chain(&status))),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_node_certificate_is_refused_on_every_replica() {
    let dir = tempfile::tempdir().unwrap();
    let (first, token, store) = apiserver_with_store(dir.path()).await;
    let second = replica(dir.path(), store.clone()).await;
    let n1 = node_channel(dir.path(), first, "n1", "n1").await;
    let n2 = node_channel(dir.path(), second, "n2", "n2").await;
    let n1_lease = register(n1.clone(), "n1").await.unwrap().lease_id;
    let n2_lease = register(n2.clone(), "n2").await.unwrap().lease_id;
    // n1's connection to the second replica, made (and answered) before the revocation.
    let n1_at_second = channel_with(dir.path(), second, "n1").await;
    heartbeat(n1_at_second.clone(), "n1", n1_lease)
        .await
        .unwrap();
    // A sandbox of n1's holds quota: revoked, it goes the way of a lost node's.
    let project = "acme".parse().unwrap();
    let quotas = Quotas::new(store.clone());
    quotas
        .reserve(
            &project,
            "n1",
            "sb-n1-aaaaaaaaaaaa",
            Resources::sandbox(1, 256, 1024),
        )
        .await
        .unwrap();

    let admin_channel = connect(
        first,
        Some(client_with_ca(&dir.path().join("ca/ca.pem")).unwrap()),
    )
    .await
    .unwrap();
    let mut admin =
        AdminClient::with_interceptor(admin_channel.clone(), dsec_sdk_free_credentials(&token));
    // Only a cluster admin revokes.
    let iam = Iam::new(store.clone());
    let user: PrincipalId = "user:eve".parse().unwrap();
    iam.create_principal(user.clone(), "eve", false)
        .await
        .unwrap();
    let eve = iam.issue_token(&user, "test", None).await.unwrap().secret;
    let refused = AdminClient::with_interceptor(admin_channel, dsec_sdk_free_credentials(&eve))
        .revoke_node(RevokeNodeRequest {
            name: "n1".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");

    let revoked = admin
        .revoke_node(RevokeNodeRequest {
            name: "n1".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    // The certificate n1 registered with, not every certificate of the name.
    assert!(!revoked.all_certificates);
    assert_eq!(revoked.fingerprints.len(), 1);
    assert_eq!(revoked.revoked_by, "user:root");

    // Both replicas refuse n1's certificate once their watch has the revocation: a
    // connection made before it is closed (or, in the moment before, refused on Register and
    // Heartbeat: PERMISSION_DENIED), a new one in the TLS handshake.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    for (addr, n1) in [(first, n1.clone()), (second, n1_at_second.clone())] {
        loop {
            match heartbeat(n1.clone(), "n1", n1_lease).await {
                Err(status) if status.code() == tonic::Code::PermissionDenied => {
                    assert!(status.message().contains("revoked"), "{status:?}");
                    assert!(
                        status.message().contains("issue-node --name n1"),
                        "{status:?}"
                    );
                    break;
                }
                // Closed and refused again in the handshake: no answer of the registry.
                Err(status) if status.code() != tonic::Code::NotFound => break,
                other => assert!(
                    tokio::time::Instant::now() < deadline,
                    "n1 still heartbeats at {addr}: {other:?}"
                ),
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let status = register(n1, "n1").await.unwrap_err();
        assert_ne!(status.code(), tonic::Code::NotFound, "{status:?}");
        loop {
            let refused = refused_in_handshake(dir.path(), addr, "n1", n1_lease).await;
            match refused {
                Ok(why) => {
                    assert_refused_in_handshake(&why, &["CertificateRevoked"]);
                    break;
                }
                Err(answer) => assert!(
                    tokio::time::Instant::now() < deadline,
                    "a new connection with n1's revoked certificate got an answer at {addr}: {answer}"
                ),
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    // n2 is unaffected, on both replicas.
    heartbeat(n2.clone(), "n2", n2_lease).await.unwrap();
    let n2_first = node_channel(dir.path(), first, "n2", "n2-again").await;
    heartbeat(n2_first, "n2", n2_lease).await.unwrap();

    // n1's registration ended: it is not listed, its sandbox is lost and its quota back.
    let listed = admin
        .list_nodes(ListNodesRequest {})
        .await
        .unwrap()
        .into_inner();
    let names: Vec<_> = listed.nodes.iter().map(|n| n.name.as_str()).collect();
    assert_eq!(names, ["n2"]);
    assert_eq!(listed.revoked.len(), 1);
    assert_eq!(listed.revoked[0].name, "n1");
    for _ in 0..250 {
        if quotas.get(&project).await.unwrap().used == Resources::ZERO {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(quotas.get(&project).await.unwrap().used, Resources::ZERO);
    assert!(lost_sandbox(store.as_ref(), "sb-n1-aaaaaaaaaaaa")
        .await
        .unwrap()
        .is_some());

    // A new certificate for n1 (a re-issued key) is not the revoked one.
    let renewed = node_channel(dir.path(), second, "n1", "n1-renewed").await;
    register(renewed, "n1").await.unwrap();

    // Bad input: a malformed fingerprint or node name.
    for (name, fingerprint) in [("n1", "xyz"), ("Bad Name", "")] {
        let status = admin
            .revoke_node(RevokeNodeRequest {
                name: name.into(),
                fingerprint: fingerprint.into(),
                undo: false,
            })
            .await
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_certificate_cannot_call_another_nodes_api() {
    let dir = tempfile::tempdir().unwrap();
    let (addr, token, store) = apiserver_with_store(dir.path()).await;
    // Two sim nodes with certificates of the cluster CA, serving their API as a node does.
    let first = sim::free_loopback_ports(2);
    let second = SocketAddr::new(first.ip(), first.port() + 1);
    let capacity = sim::SimCapacity {
        sandboxes: 10,
        vcpus: 40,
        memory_mib: 40_960,
        disk_mib: 81_920,
    };
    tokio::spawn(sim::serve(
        "n",
        2,
        first,
        capacity,
        vec![addr.to_string()],
        Some(dir.path().join("ca")),
        Default::default(),
    ));
    let registry = NodeRegistry::new(store);
    for _ in 0..250 {
        if registry.list().await.unwrap().len() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        registry.list().await.unwrap().len(),
        2,
        "sim nodes did not register"
    );

    // The apiserver reaches the nodes (its certificate is an apiserver's).
    let client_tls = client_with_ca(&dir.path().join("ca/ca.pem")).unwrap();
    let channel = connect(addr, Some(client_tls)).await.unwrap();
    let mut sandboxes =
        SandboxesClient::with_interceptor(channel, dsec_sdk_free_credentials(&token));
    let created = sandboxes
        .create(CreateSandboxRequest {
            project: "acme".into(),
            image: "busybox".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(created.id.starts_with("sb-n"), "{created:?}");

    // The apiserver's own certificate, shown to node n1 directly, is let in...
    let list = |channel: Channel| async move {
        SandboxesClient::new(channel)
            .list(ListSandboxesRequest::default())
            .await
    };
    let ca = TlsDir::new(dir.path().join("ca"));
    let as_apiserver = connect(
        second,
        Some(ca.client("apiserver", "n1.node.dsec").unwrap()),
    )
    .await
    .unwrap();
    list(as_apiserver).await.unwrap();
    // ...node n0's certificate (same CA) is refused in n1's handshake: no call answered.
    let n0 = TlsDir::new(dir.path().join("ca/sim-nodes/n0"));
    let refused = match connect(second, Some(n0.client("node", "n1.node.dsec").unwrap())).await {
        Err(why) => why,
        Ok(channel) => {
            let status = list(channel)
                .await
                .expect_err("node n0's certificate called node n1's API");
            format!("{}: {}", status.message(), error_chain(&status))
        }
    };
    assert_refused_in_handshake(&refused, &["BadCertificate"]);
    // A caller without a certificate is refused too.
    let no_cert = ClientTlsConfig::new()
        .ca_certificate(ca.ca().unwrap())
        .domain_name("n1.node.dsec");
    let anonymous = match connect(second, Some(no_cert)).await {
        Err(_) => true,
        Ok(channel) => list(channel).await.is_err(),
    };
    assert!(
        anonymous,
        "a caller without a certificate called node n1's API"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_get_tls_checked_against_the_ca_and_plaintext_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (addr, token) = apiserver(dir.path()).await;

    let channel = connect(
        addr,
        Some(client_with_ca(&dir.path().join("ca/ca.pem")).unwrap()),
    )
    .await
    .unwrap();
    let credentials = dsec_sdk_free_credentials(&token);
    let who = AdminClient::with_interceptor(channel, credentials)
        .who_am_i(WhoAmIRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(who.principal, "user:root");

    // Plaintext gRPC to the TLS port gets no answer.
    let plaintext = match connect(addr, None).await {
        Err(why) => Err(why),
        Ok(channel) => AdminClient::new(channel)
            .who_am_i(WhoAmIRequest {})
            .await
            .map(|_| ())
            .map_err(|s| s.to_string()),
    };
    assert!(plaintext.is_err(), "plaintext was answered");

    // A client checking against another CA refuses the apiserver.
    pki::init(&dir.path().join("other-ca"), &[]).unwrap();
    refused_as_unknown_issuer(
        addr,
        client_with_ca(&dir.path().join("other-ca/ca.pem")).unwrap(),
    )
    .await;
}

#[test]
fn a_second_init_keeps_the_ca_and_bad_names_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    pki::init(dir.path(), &["10.0.0.1".into()]).unwrap();
    let ca = std::fs::read(dir.path().join("ca.pem")).unwrap();
    assert!(matches!(
        pki::init(dir.path(), &[]),
        Err(pki::PkiError::Exists(_))
    ));
    assert_eq!(std::fs::read(dir.path().join("ca.pem")).unwrap(), ca);
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(dir.path().join("ca.key"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    assert!(matches!(
        pki::issue_node(dir.path(), &dir.path().join("x"), "Bad Name"),
        Err(pki::PkiError::BadName(_))
    ));
    assert!(matches!(
        pki::issue_node(&dir.path().join("missing"), &dir.path().join("x"), "n1"),
        Err(pki::PkiError::Read { .. })
    ));
    assert!(matches!(
        pki::init(dir.path().join("y").as_path(), &["a b".into()]),
        Err(pki::PkiError::BadName(_))
    ));
}

/// The bearer token on every call (what the SDK's credentials do).
fn dsec_sdk_free_credentials(
    token: &str,
) -> impl FnMut(tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> + Clone {
    let value: tonic::metadata::AsciiMetadataValue = format!("Bearer {token}").parse().unwrap();
    move |mut request: tonic::Request<()>| {
        request
            .metadata_mut()
            .insert("authorization", value.clone());
        Ok(request)
    }
}

/// A TCP stream that notes when the server closed it (a read ends or fails).
struct Watched {
    tcp: tokio::net::TcpStream,
    closed: Arc<AtomicBool>,
}

impl tokio::io::AsyncRead for Watched {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = std::pin::Pin::new(&mut self.tcp).poll_read(cx, buf);
        if let std::task::Poll::Ready(result) = &polled {
            if result.is_err() || buf.filled().len() == before {
                self.closed.store(true, Ordering::SeqCst);
            }
        }
        polled
    }
}

impl tokio::io::AsyncWrite for Watched {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.tcp).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.tcp).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.tcp).poll_shutdown(cx)
    }
}

/// Node `name`'s channel to `addr` (its certificate in `dir/name`) over one TCP connection,
/// and a flag set when the apiserver closes that connection.
async fn watched_channel(dir: &Path, addr: SocketAddr, name: &str) -> (Channel, Arc<AtomicBool>) {
    let closed = Arc::new(AtomicBool::new(false));
    let flag = closed.clone();
    let connector = tower::service_fn(move |_: tonic::transport::Uri| {
        let flag = flag.clone();
        async move {
            let tcp = tokio::net::TcpStream::connect(addr).await?;
            Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(Watched { tcp, closed: flag }))
        }
    });
    let tls = TlsDir::new(dir.join(name));
    let channel = Endpoint::from_shared(format!("https://{addr}"))
        .unwrap()
        .timeout(Duration::from_secs(5))
        .tls_config(tls.client("node", APISERVER_NAME).unwrap())
        .unwrap()
        .connect_with_connector(connector)
        .await
        .unwrap();
    (channel, closed)
}

/// The apiserver closes the connections a node opened before its certificate was revoked as
/// soon as the revocation reaches it, without waiting for the node's next call; other nodes'
/// connections stay open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_nodes_open_connections_are_closed() {
    let dir = tempfile::tempdir().unwrap();
    let (addr, token, _store) = apiserver_with_store(dir.path()).await;
    for name in ["n1", "n2"] {
        pki::issue_node(&dir.path().join("ca"), &dir.path().join(name), name).unwrap();
    }
    let (n1, n1_closed) = watched_channel(dir.path(), addr, "n1").await;
    let (n2, n2_closed) = watched_channel(dir.path(), addr, "n2").await;
    register(n1.clone(), "n1").await.unwrap();
    let n2_lease = register(n2.clone(), "n2").await.unwrap().lease_id;

    let admin_channel = connect(
        addr,
        Some(client_with_ca(&dir.path().join("ca/ca.pem")).unwrap()),
    )
    .await
    .unwrap();
    AdminClient::with_interceptor(admin_channel, dsec_sdk_free_credentials(&token))
        .revoke_node(RevokeNodeRequest {
            name: "n1".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    // No call on n1's channel: the apiserver closes the connection by itself.
    for _ in 0..250 {
        if n1_closed.load(Ordering::SeqCst) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        n1_closed.load(Ordering::SeqCst),
        "n1's connection made before the revocation is still open 5 s after it"
    );
    heartbeat(n2, "n2", n2_lease).await.unwrap();
    assert!(
        !n2_closed.load(Ordering::SeqCst),
        "n2's connection was closed too"
    );
}

/// One more apiserver replica on `store`, serving with the TLS files in `tls_dir`.
async fn replica_with(store: Arc<dyn Store>, tls_dir: &Path) -> SocketAddr {
    let listen = free_addr();
    let config = ApiConfig {
        listen,
        tls: Some(TlsDir::new(tls_dir)),
        ..ApiConfig::default()
    };
    tokio::spawn(async move { api::serve(store, config).await });
    for _ in 0..100 {
        if tokio::net::TcpStream::connect(listen).await.is_ok() {
            return listen;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the apiserver did not come up on {listen}");
}

/// Node `node` at `addr`, called directly with the apiserver certificate in `tls_dir`: Ok
/// when it answered a List, Err(why) when it refused.
async fn node_answers(addr: SocketAddr, tls_dir: &Path, node: &str) -> Result<(), String> {
    let tls = TlsDir::new(tls_dir)
        .client("apiserver", &format!("{node}.node.dsec"))
        .unwrap();
    let channel = connect(addr, Some(tls)).await?;
    SandboxesClient::new(channel)
        .list(ListSandboxesRequest::default())
        .await
        .map(drop)
        .map_err(|status| format!("{}: {}", status.message(), error_chain(&status)))
}

/// Spawns sim node `n0` on `addr`, registering with `control`.
fn sim_node(dir: &Path, addr: SocketAddr, control: SocketAddr) -> tokio::task::JoinHandle<()> {
    let capacity = sim::SimCapacity {
        sandboxes: 10,
        vcpus: 40,
        memory_mib: 40_960,
        disk_mib: 81_920,
    };
    let ca = dir.join("ca");
    tokio::spawn(async move {
        let _ = sim::serve(
            "n",
            1,
            addr,
            capacity,
            vec![control.to_string()],
            Some(ca),
            Default::default(),
        )
        .await;
    })
}

/// Waits up to `limit` for `done`; how long it took.
async fn within(limit: Duration, mut done: impl AsyncFnMut() -> bool) -> Option<Duration> {
    let started = std::time::Instant::now();
    while started.elapsed() < limit {
        if done().await {
            return Some(started.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

/// A revoked apiserver certificate (replica A's, its own key) is refused by the node within
/// 5 s of the revocation (the list comes with the node's next heartbeat reply), A's open
/// connection to the node is closed, replica B keeps working, and a restarted node refuses A
/// from its registration on (also when A is revoked by name).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_apiserver_certificate_is_refused_by_the_nodes() {
    let dir = tempfile::tempdir().unwrap();
    let (b, token, store) = apiserver_with_store(dir.path()).await;
    let a_tls = dir.path().join("replica-a");
    let a_fingerprint =
        pki::issue_apiserver(&dir.path().join("ca"), &a_tls, "replica-a", &[]).unwrap();
    let a = replica_with(store.clone(), &a_tls).await;
    let b_tls = dir.path().join("ca");
    let node = sim::free_loopback_ports(1);
    let mut serving = sim_node(dir.path(), node, b);
    let registry = NodeRegistry::new(store.clone());
    within(Duration::from_secs(5), async || {
        registry.list().await.unwrap().len() == 1
    })
    .await
    .expect("sim node n0 did not register");
    within(Duration::from_secs(5), async || {
        node_answers(node, &a_tls, "n0").await.is_ok()
    })
    .await
    .expect("node n0 does not answer replica A before any revocation");

    let client_tls = client_with_ca(&dir.path().join("ca/ca.pem")).unwrap();
    let create_via = |addr: SocketAddr| {
        let (client_tls, token) = (client_tls.clone(), token.clone());
        async move {
            let channel = connect(addr, Some(client_tls)).await.unwrap();
            SandboxesClient::with_interceptor(channel, dsec_sdk_free_credentials(&token))
                .create(CreateSandboxRequest {
                    project: "acme".into(),
                    image: "busybox".into(),
                    ..Default::default()
                })
                .await
        }
    };
    // Both replicas reach the node (A once its placer has seen it).
    within(Duration::from_secs(5), async || create_via(a).await.is_ok())
        .await
        .expect("replica A cannot create on node n0 before any revocation");
    create_via(b).await.unwrap();
    // A connection replica A's certificate holds open to the node.
    let a_client = TlsDir::new(&a_tls)
        .client("apiserver", "n0.node.dsec")
        .unwrap();
    let closed = Arc::new(AtomicBool::new(false));
    let flag = closed.clone();
    let connector = tower::service_fn(move |_: tonic::transport::Uri| {
        let flag = flag.clone();
        async move {
            let tcp = tokio::net::TcpStream::connect(node).await?;
            Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(Watched { tcp, closed: flag }))
        }
    });
    let held = Endpoint::from_shared(format!("https://{node}"))
        .unwrap()
        .tls_config(a_client)
        .unwrap()
        .connect_with_connector(connector)
        .await
        .unwrap();
    SandboxesClient::new(held.clone())
        .list(ListSandboxesRequest::default())
        .await
        .unwrap();

    dsec_control::revocation::revoke_apiserver(store.as_ref(), &a_fingerprint, "test")
        .await
        .unwrap();
    let took = within(Duration::from_secs(5), async || {
        node_answers(node, &a_tls, "n0").await.is_err()
    })
    .await
    .expect("node n0 still answers replica A's revoked certificate 5 s after the revocation");
    eprintln!("node n0 refused replica A {took:?} after the revocation");
    let refused = node_answers(node, &a_tls, "n0").await.unwrap_err();
    assert_refused_in_handshake(&refused, &["CertificateRevoked"]);
    within(Duration::from_secs(2), async || {
        closed.load(Ordering::SeqCst)
    })
    .await
    .expect("replica A's open connection to node n0 was not closed");
    // Replica A's creates on the node fail with a status naming the node; B's still work.
    let status = create_via(a).await.unwrap_err();
    assert!(
        status.message().contains("n0"),
        "replica A's create: {status:?}"
    );
    create_via(b).await.unwrap();
    node_answers(node, &b_tls, "n0").await.unwrap();

    // A restarted node (no list yet) takes the list from its registration: A is refused
    // (now revoked by name), B answers.
    dsec_control::revocation::lift_apiserver(store.as_ref(), &a_fingerprint)
        .await
        .unwrap();
    dsec_control::revocation::revoke_apiserver(store.as_ref(), "replica-a", "test")
        .await
        .unwrap();
    serving.abort();
    let _ = (&mut serving).await;
    // The aborted node's listener closes as its tasks wind down.
    within(Duration::from_secs(5), async || {
        std::net::TcpListener::bind(node).is_ok()
    })
    .await
    .expect("the stopped node's port stays taken");
    serving = sim_node(dir.path(), node, b);
    within(Duration::from_secs(5), async || {
        node_answers(node, &b_tls, "n0").await.is_ok()
    })
    .await
    .expect("restarted node n0 does not answer replica B");
    let refused = node_answers(node, &a_tls, "n0").await.unwrap_err();
    assert_refused_in_handshake(&refused, &["CertificateRevoked"]);
    serving.abort();
}
