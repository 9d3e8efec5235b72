//! Sim nodes (`dsec control sim-nodes`, the benchmark's nodes) behind a real apiserver:
//! they register, creates through the apiserver spread over them, each admits only up to its
//! fake capacity (then the apiserver tries another node, and a full cluster is
//! RESOURCE_EXHAUSTED), and List/Get/Delete go through to them.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use dsec_api::v1::network_labels_client::NetworkLabelsClient;
use dsec_api::v1::sandboxes_client::SandboxesClient;
use dsec_api::v1::*;
use dsec_control::api::{self, ApiConfig};
use dsec_control::iam::{Action, Iam, Outcome};
use dsec_control::placement::NodeRegistry;
use dsec_control::quota::Quotas;
use dsec_control::resources::Resources;
use dsec_control::sim::{self, CallCount, SimCalls, SimCapacity};
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
    let (store, client, _, _) = cluster_at(dir, quota, per_node, Arc::default()).await;
    (store, client)
}

/// [`cluster`], also handing back the apiserver's address and the admin's token.
async fn cluster_at(
    dir: &std::path::Path,
    quota: Resources,
    per_node: u64,
    calls: Arc<SimCalls>,
) -> (Arc<dyn Store>, Client, SocketAddr, String) {
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
    let first = sim::free_loopback_ports(3);
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
        None,
        calls,
    ));

    let bearer: tonic::metadata::AsciiMetadataValue = format!("Bearer {token}").parse().unwrap();
    let admin_token = token.clone();
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
        listen,
        admin_token,
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

/// Waits until the three sim nodes are registered and the watcher has seen them.
async fn all_registered(store: &Arc<dyn Store>) {
    let registry = NodeRegistry::new(store.clone());
    for _ in 0..100 {
        if registry.list().await.unwrap().len() == 3 {
            tokio::time::sleep(Duration::from_millis(300)).await;
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the sim nodes did not all register in 5 s");
}

/// The sandboxes a CreateMany made, every one of its creates expected to succeed.
async fn made_by(client: &mut Client, request: CreateSandboxesRequest) -> Vec<Sandbox> {
    client
        .create_many(request)
        .await
        .unwrap()
        .into_inner()
        .results
        .into_iter()
        .map(|r| r.into_result().unwrap())
        .collect()
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
    // A node registering later would have its sandboxes listed and charged by the watcher,
    // which can charge the refused create's sandbox before its commit (README: "Create:
    // node and reservation at once"): wait for all three first.
    all_registered(&store).await;
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

/// NetworkLabels through the apiserver: fanned out to every node, only the caller's
/// project's sandboxes with the labels change, the answers merged in id order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_label_wide_policy_change_reaches_the_projects_sandboxes_on_every_node() {
    let dir = tempfile::tempdir().unwrap();
    let (store, mut client, listen, token) = cluster_at(
        dir.path(),
        Resources::new(100, 100, 100_000, 100_000),
        10,
        Arc::default(),
    )
    .await;
    Iam::new(store.clone())
        .create_project(&"acme".parse().unwrap(), "other")
        .await
        .unwrap();
    Quotas::new(store.clone())
        .set_limit(
            &"acme/other".parse().unwrap(),
            Resources::new(100, 100, 100_000, 100_000),
        )
        .await
        .unwrap();
    first_create(&mut client).await;
    all_registered(&store).await;
    let labelled = |project: &str, team: &str| CreateSandboxRequest {
        project: project.into(),
        labels: [("team".to_string(), team.to_string())].into(),
        ..small()
    };
    let mut team_a = Vec::new();
    for _ in 0..6 {
        team_a.push(
            client
                .create(labelled("acme/sim", "a"))
                .await
                .unwrap()
                .into_inner(),
        );
        client.create(labelled("acme/sim", "b")).await.unwrap();
        client.create(labelled("acme/other", "a")).await.unwrap();
    }
    let nodes: std::collections::BTreeSet<_> = team_a.iter().map(|s| s.node.clone()).collect();
    assert!(nodes.len() > 1, "team a landed on one node: {nodes:?}");

    let channel = tonic::transport::Endpoint::from_shared(format!("http://{listen}"))
        .unwrap()
        .connect_lazy();
    let bearer: tonic::metadata::AsciiMetadataValue = format!("Bearer {token}").parse().unwrap();
    let mut labels_client =
        NetworkLabelsClient::with_interceptor(channel, move |mut r: tonic::Request<()>| {
            r.metadata_mut().insert("authorization", bearer.clone());
            r.metadata_mut()
                .insert("x-dsec-project", "acme/sim".parse().unwrap());
            Ok(r)
        });
    let policy = NetworkPolicy {
        allow: vec!["10.0.0.0/8".into()],
        ..Default::default()
    };
    let changed = labels_client
        .set_network_policy_by_labels(SetNetworkPolicyByLabelsRequest {
            // The project label is the apiserver's: naming another project changes nothing.
            labels: [
                ("team".to_string(), "a".to_string()),
                (
                    dsec_api::PROJECT_LABEL.to_string(),
                    "acme/other".to_string(),
                ),
            ]
            .into(),
            network: Some(policy.clone()),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(changed.failed.is_empty(), "{:?}", changed.failed);
    let mut expected: Vec<_> = team_a.iter().map(|s| s.id.clone()).collect();
    expected.sort();
    let ids: Vec<_> = changed.sandboxes.iter().map(|s| s.id.clone()).collect();
    assert_eq!(ids, expected);
    for sandbox in listed(&mut client).await {
        let team = sandbox.labels.get("team").map(String::as_str);
        let want = (team == Some("a")).then(|| policy.clone());
        assert_eq!(sandbox.network, want, "{}", sandbox.id);
    }

    for labels in [
        std::collections::HashMap::new(),
        [(dsec_api::PROJECT_LABEL.to_string(), "acme/sim".to_string())].into(),
    ] {
        let status = labels_client
            .set_network_policy_by_labels(SetNetworkPolicyByLabelsRequest {
                labels,
                network: Some(policy.clone()),
            })
            .await
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    }
}

/// An apiserver killed between its node's create and the reservation's commit (the create
/// goes to the node while the reservation commits) leaves a sandbox without a reservation:
/// the node's heartbeats get it charged within a few seconds, not at the watcher's full
/// reconcile a minute later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_its_node_runs_without_a_reservation_is_charged_from_heartbeats() {
    let dir = tempfile::tempdir().unwrap();
    let (store, mut client) = cluster(dir.path(), Resources::new(10, 10, 1000, 1000), 10).await;
    first_create(&mut client).await;
    all_registered(&store).await;
    // What the cut-off create left: the sandbox on node s1, made with the id and project the
    // apiserver gave it, and no reservation.
    let nodes = NodeRegistry::new(store.clone()).list().await.unwrap();
    let (s1, _) = nodes.iter().find(|(n, _)| n.name == "s1").unwrap();
    let id = dsec_api::sandbox_id::SandboxId::new("s1")
        .unwrap()
        .to_string();
    SandboxesClient::connect(format!("http://{}", s1.address))
        .await
        .unwrap()
        .create(CreateSandboxRequest {
            sandbox_id: id.clone(),
            labels: [(dsec_api::PROJECT_LABEL.to_string(), "acme/sim".to_string())].into(),
            vcpus: 1,
            ..small()
        })
        .await
        .unwrap();
    let quotas = Quotas::new(store.clone());
    let project = "acme/sim".parse().unwrap();
    let started = std::time::Instant::now();
    // Heartbeats every second here (node TTL 3 s); the grace is 2 s.
    while quotas.get(&project).await.unwrap().used.sandboxes < 2 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the unreserved sandbox {id} was not charged from the heartbeats"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let used = quotas.get(&project).await.unwrap().used;
    assert_eq!(used, Resources::new(2, 2, 128, 128), "{used:?}");
    assert!(store
        .get(&format!("/dsec/reservations/s1/{id}"))
        .await
        .unwrap()
        .is_some());
    // Its delete through the apiserver returns the charge.
    client
        .delete(DeleteSandboxRequest { sandbox_id: id })
        .await
        .unwrap();
    assert_eq!(
        quotas.get(&project).await.unwrap().used,
        Resources::sandbox(1, 64, 64)
    );
}

/// CreateMany through the apiserver: each request is admitted and charged as a lone Create,
/// the ones over the project's quota fail on their own (RESOURCE_EXHAUSTED naming the project
/// and resource) and the rest are made; malformed calls fail as a whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_many_charges_each_sandbox_and_refuses_only_those_over_quota() {
    let dir = tempfile::tempdir().unwrap();
    let (store, mut client) = cluster(
        dir.path(),
        Resources::new(6, 1000, 1_000_000, 1_000_000),
        100,
    )
    .await;
    first_create(&mut client).await;
    let many = |count: usize| CreateSandboxesRequest {
        requests: (0..count).map(|_| small()).collect(),
        project: "acme/sim".into(),
    };
    let results = client
        .create_many(many(8))
        .await
        .unwrap()
        .into_inner()
        .results;
    assert_eq!(results.len(), 8);
    let (made, refused): (Vec<_>, Vec<_>) = results
        .into_iter()
        .map(CreateSandboxResult::into_result)
        .partition(Result::is_ok);
    assert_eq!(made.len(), 5, "{refused:?}");
    for status in refused.iter().map(|r| r.as_ref().unwrap_err()) {
        assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
        assert!(
            status.message().contains("acme/sim") && status.message().contains("sandboxes"),
            "{status:?}"
        );
    }
    assert_eq!(listed(&mut client).await.len(), 6);
    // Audited: one record naming the five sandboxes made, one per refused create.
    let mut made_ids: Vec<String> = made
        .iter()
        .map(|r| r.as_ref().unwrap().id.clone())
        .collect();
    made_ids.sort();
    let iam = Iam::new(store.clone());
    let mut audited = (Vec::new(), 0);
    for _ in 0..100 {
        let log = iam.audit_log("acme", 1000).await.unwrap();
        let creates = log.iter().filter(|r| r.action == Action::SandboxCreate);
        let mut targets: Vec<Vec<String>> = creates
            .clone()
            .filter(|r| r.outcome == Outcome::Allowed)
            .filter_map(|r| r.target.as_ref())
            .map(|t| {
                let mut ids: Vec<String> = t.split(',').map(str::to_string).collect();
                ids.sort();
                ids
            })
            .filter(|ids| ids.len() > 1)
            .collect();
        // Over quota only: creates refused while the sim nodes registered are audited too.
        let failed = creates
            .filter(
                |r| matches!(&r.outcome, Outcome::Failed { reason } if reason.contains("quota")),
            )
            .count();
        audited = (targets.pop().unwrap_or_default(), failed);
        if audited == (made_ids.clone(), 3) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(audited, (made_ids, 3));
    for sandbox in made.into_iter().map(Result::unwrap) {
        let got = client
            .get(GetSandboxRequest {
                sandbox_id: sandbox.id.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(got.project, "acme/sim");
    }

    for count in [0, dsec_api::create_many::MAX_CREATES_PER_CALL + 1] {
        let e = client.create_many(many(count)).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    }
    let mut elsewhere = many(2);
    elsewhere.requests[1].project = "acme/other".into();
    let e = client.create_many(elsewhere).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("acme/other"), "{e:?}");
    assert_eq!(listed(&mut client).await.len(), 6);
}

/// A CreateMany over several nodes reaches each node it lands on as one node-side CreateMany
/// (no lone Creates): the apiserver places the whole call, alike creates in chunks of up to
/// 8 per node, then groups it by node. Past the nodes' capacity the extra creates fail on
/// their own (RESOURCE_EXHAUSTED) and the rest are made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_many_reaches_each_node_in_one_call() {
    let dir = tempfile::tempdir().unwrap();
    let calls = Arc::new(SimCalls::default());
    let (store, mut client, _, _) = cluster_at(
        dir.path(),
        Resources::new(100, 100, 100_000, 100_000),
        12,
        calls.clone(),
    )
    .await;
    all_registered(&store).await;
    let many = |count: usize| CreateSandboxesRequest {
        requests: (0..count).map(|_| small()).collect(),
        project: "acme/sim".into(),
    };
    // 8 alike creates: one chunk, one node, one call.
    let before = calls.by_node();
    let made = made_by(&mut client, many(8)).await;
    let nodes: std::collections::BTreeSet<String> = made.iter().map(|s| s.node.clone()).collect();
    assert_eq!(nodes.len(), 1, "{made:?}");
    let after = calls.by_node();
    let new_calls = |before: &BTreeMap<String, CallCount>, after: &BTreeMap<String, CallCount>| {
        after
            .iter()
            .map(|(node, count)| {
                let was = before.get(node).copied().unwrap_or_default();
                assert_eq!(count.creates, was.creates, "node {node} got lone creates");
                (node.clone(), count.create_manys - was.create_manys)
            })
            .filter(|(_, calls)| *calls > 0)
            .collect::<BTreeMap<String, u64>>()
    };
    let one_each = |nodes: &std::collections::BTreeSet<String>| {
        nodes
            .iter()
            .map(|n| (n.clone(), 1))
            .collect::<BTreeMap<String, u64>>()
    };
    assert_eq!(new_calls(&before, &after), one_each(&nodes));
    // 22 more over the three nodes: each node used gets one call.
    let before = after;
    let made = made_by(&mut client, many(22)).await;
    assert_eq!(made.len(), 22);
    let nodes: std::collections::BTreeSet<String> = made.iter().map(|s| s.node.clone()).collect();
    assert!(
        nodes.len() > 1,
        "22 creates on 3 nodes of 12 all on {nodes:?}"
    );
    assert_eq!(new_calls(&before, &calls.by_node()), one_each(&nodes));
    let project = "acme/sim".parse().unwrap();
    let quotas = Quotas::new(store.clone());
    assert_eq!(quotas.get(&project).await.unwrap().used.sandboxes, 30);

    // 6 places left on the nodes: 6 of 10 made, 4 refused, only the 6 charged.
    let results: Vec<_> = client
        .create_many(many(10))
        .await
        .unwrap()
        .into_inner()
        .results
        .into_iter()
        .map(CreateSandboxResult::into_result)
        .collect();
    let refused: Vec<_> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert_eq!(refused.len(), 4, "{results:?}");
    for status in refused {
        assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    }
    assert_eq!(quotas.get(&project).await.unwrap().used.sandboxes, 36);
    assert_eq!(listed(&mut client).await.len(), 36);
}
