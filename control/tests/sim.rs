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

type WithToken =
    Box<dyn FnMut(tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> + Send>;
type Client = SandboxesClient<
    tonic::service::interceptor::InterceptedService<tonic::transport::Channel, WithToken>,
>;

/// A real apiserver on an embedded store, project `acme/sim` with `quota`, and three sim
/// nodes of `per_node` sandboxes; returns the store and a client with the admin's token.
async fn cluster(
    dir: &std::path::Path,
    quota: Resources,
    per_node: u64,
) -> (Arc<dyn Store>, Client) {
    let store: Arc<dyn Store> = Arc::new(EmbeddedStore::open(dir).unwrap());
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
        .set_limit(&project, quota)
        .await
        .unwrap();
    let listen = free_addr();
    let config = ApiConfig {
        listen,
        node_ttl: Duration::from_secs(3),
        ..ApiConfig::default()
    };
    tokio::spawn(api::serve(store.clone(), config));
    // Three sim nodes on consecutive ports.
    let first = loop {
        let base = free_addr();
        let free =
            (0..3).all(|i| std::net::TcpListener::bind(("127.0.0.1", base.port() + i)).is_ok());
        if free && base.port() < 65000 {
            break base;
        }
    };
    let capacity = SimCapacity {
        sandboxes: per_node,
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
    let with_token: WithToken = Box::new(move |mut r: tonic::Request<()>| {
        r.metadata_mut().insert("authorization", bearer.clone());
        Ok(r)
    });
    (
        store,
        SandboxesClient::with_interceptor(channel, with_token),
    )
}

fn small() -> CreateSandboxRequest {
    CreateSandboxRequest {
        project: "acme/sim".into(),
        memory_mib: 64,
        disk_mib: 64,
        ..Default::default()
    }
}

/// The first create once a node has registered.
async fn first_create(client: &mut Client) -> Sandbox {
    for _ in 0..100 {
        if let Ok(s) = client.create(small()).await {
            return s.into_inner();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("no sim node registered in 10 s");
}

async fn listed(client: &mut Client) -> Vec<Sandbox> {
    client
        .list(ListSandboxesRequest {
            project: "acme/sim".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .sandboxes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sim_nodes_register_admit_to_their_capacity_and_answer_the_apiserver() {
    let dir = tempfile::tempdir().unwrap();
    let (_store, mut client) = cluster(
        dir.path(),
        Resources::new(1000, 1000, 1_000_000, 1_000_000),
        5,
    )
    .await;
    let request = small;
    // Wait for the three registrations: a create succeeds once one is in.
    let mut made = vec![first_create(&mut client).await];
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

    assert_eq!(listed(&mut client).await.len(), 15);
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

/// A create is sent to its node while its reservation commits when this replica's last
/// quota record has room; when the record changed meanwhile (another replica spent the
/// quota) and the reservation is refused, the sandbox the node made is deleted again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_whose_reservation_fails_after_its_node_made_it_is_undone() {
    let dir = tempfile::tempdir().unwrap();
    let each = Resources::sandbox(1, 64, 64);
    let (store, mut client) = cluster(dir.path(), Resources::new(3, 3, 192, 192), 10).await;
    let first = first_create(&mut client).await;
    // Another replica takes the rest of the quota; this one's record still shows room.
    let other = Quotas::new(store.clone());
    let project = "acme/sim".parse().unwrap();
    for n in 0..2 {
        other
            .reserve(&project, "s0", &format!("sb-s0-other{n:07}"), each)
            .await
            .unwrap();
    }
    let refused = client.create(small()).await.unwrap_err();
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );
    assert!(refused.message().contains("acme/sim"), "{refused:?}");
    let left: Vec<String> = listed(&mut client)
        .await
        .into_iter()
        .map(|s| s.id)
        .collect();
    assert_eq!(
        left,
        vec![first.id],
        "the refused create's sandbox is still on its node"
    );
}
