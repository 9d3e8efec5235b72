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
use dsec_api::v1::WhoAmIRequest;
use dsec_control::api::{self, ApiConfig};
use dsec_control::pki;
use dsec_control::store::{EmbeddedStore, Store};
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};

fn free_addr() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap()
}

/// An apiserver with TLS from a fresh CA in `dir/ca`; returns its address and admin token.
async fn apiserver(dir: &Path) -> (SocketAddr, String) {
    pki::init(&dir.join("ca"), &[]).unwrap();
    let store: Arc<dyn Store> = Arc::new(EmbeddedStore::open(&dir.join("store")).unwrap());
    let token = api::init(store.clone(), "acme", "root").await.unwrap();
    let listen = free_addr();
    let config = ApiConfig {
        listen,
        tls: Some(TlsDir::new(dir.join("ca"))),
        ..ApiConfig::default()
    };
    tokio::spawn(async move { api::serve(store, config).await });
    for _ in 0..100 {
        if tokio::net::TcpStream::connect(listen).await.is_ok() {
            return (listen, token.secret);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the apiserver did not come up on {listen}");
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
    assert!(
        refused.contains("UnknownCA")
            || refused.contains("certificate")
            || refused.contains("connection closed")
            // TLS 1.3: the server's alert can race the client's first request on the wire.
            || refused.contains("broken pipe"),
        "unexpected refusal: {refused}"
    );

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
