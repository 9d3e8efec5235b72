//! Sim nodes (`dsec control sim-nodes`, the benchmark's nodes) behind a real apiserver:
//! they register, creates through the apiserver spread over them, each admits only up to its
//! fake capacity (then the apiserver tries another node, and a full cluster is
//! RESOURCE_EXHAUSTED), and List/Get/Delete go through to them.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use dsec_api::v1::sandboxes_client::SandboxesClient;
use dsec_api::v1::*;
use dsec_control::api::{self, ApiConfig};
use dsec_control::iam::Iam;
use dsec_control::quota::Quotas;
use dsec_control::resources::Resources;
use dsec_control::sim::{self, SimCapacity};
use dsec_control::store::{EmbeddedStore, Store};

fn free_addr() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sim_nodes_register_admit_to_their_capacity_and_answer_the_apiserver() {
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn Store> = Arc::new(EmbeddedStore::open(dir.path()).unwrap());
    let token = api::init(store.clone(), "acme", "root")
        .await
        .unwrap()
        .secret;
    let project = "acme/sim".parse().unwrap();
    Iam::new(store.clone())
        .create_project(&"acme".parse().unwrap(), "sim")
        .await
        .unwrap();
    Quotas::new(store.clone())
        .set_limit(&project, Resources::new(1000, 1000, 1_000_000, 1_000_000))
        .await
        .unwrap();
    let listen = free_addr();
    let config = ApiConfig {
        listen,
        node_ttl: Duration::from_secs(3),
        ..ApiConfig::default()
    };
    tokio::spawn(api::serve(store, config));
    // Three sim nodes of 5 sandboxes each on consecutive ports.
    let first = loop {
        let base = free_addr();
        let free =
            (0..3).all(|i| std::net::TcpListener::bind(("127.0.0.1", base.port() + i)).is_ok());
        if free && base.port() < 65000 {
            break base;
        }
    };
    let capacity = SimCapacity {
        sandboxes: 5,
        vcpus: 100,
        memory_mib: 100_000,
        disk_mib: 100_000,
    };
    tokio::spawn(sim::serve(
        "s",
        3,
        first,
        capacity,
        vec![listen.to_string()],
    ));

    let bearer: tonic::metadata::AsciiMetadataValue = format!("Bearer {token}").parse().unwrap();
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{listen}"))
        .unwrap()
        .connect_lazy();
    let mut client = SandboxesClient::with_interceptor(channel, move |mut r: tonic::Request<()>| {
        r.metadata_mut().insert("authorization", bearer.clone());
        Ok(r)
    });
    let request = || CreateSandboxRequest {
        project: "acme/sim".into(),
        memory_mib: 64,
        disk_mib: 64,
        ..Default::default()
    };
    // Wait for the three registrations: a create succeeds once one is in.
    let mut made = Vec::new();
    for _ in 0..100 {
        match client.create(request()).await {
            Ok(s) => {
                made.push(s.into_inner());
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    while made.len() < 15 {
        made.push(client.create(request()).await.unwrap().into_inner());
    }
    let mut per_node = std::collections::BTreeMap::new();
    for s in &made {
        *per_node.entry(s.node.clone()).or_insert(0) += 1;
    }
    assert_eq!(per_node.len(), 3, "{per_node:?}");
    assert!(per_node.values().all(|&n| n == 5), "{per_node:?}");
    let full = client.create(request()).await.unwrap_err();
    assert_eq!(full.code(), tonic::Code::ResourceExhausted, "{full:?}");

    let listed = client
        .list(ListSandboxesRequest {
            project: "acme/sim".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.sandboxes.len(), 15);
    let one = &made[0].id;
    let got = client
        .get(GetSandboxRequest {
            sandbox_id: one.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(got.project, "acme/sim");
    client
        .delete(DeleteSandboxRequest {
            sandbox_id: one.clone(),
        })
        .await
        .unwrap();
    // The freed place is taken again once the node's next heartbeat reports it free.
    let mut again = Err(tonic::Status::unknown("not tried"));
    for _ in 0..40 {
        again = client.create(request()).await;
        if again.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    again.unwrap();
}
