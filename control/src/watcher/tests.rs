use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::*;
use crate::iam::Iam;
use crate::placement::{Backend, NodeRegistry};
use crate::sandbox_id::SandboxId;
use crate::testing::on_both_stores;

on_both_stores!(
    a_vanished_node_loses_its_sandboxes_and_a_returning_one_gets_back_what_it_runs,
    a_sandbox_deleted_while_its_node_is_reconciled_keeps_no_charge,
    a_node_that_never_answers_holds_up_neither_the_placer_nor_the_other_nodes,
);

/// What each node says it runs.
#[derive(Default)]
struct FakeInventory(Mutex<HashMap<String, Vec<RunningSandbox>>>);

#[async_trait::async_trait]
impl NodeInventory for FakeInventory {
    async fn running(&self, node: &NodeRecord) -> Result<Vec<RunningSandbox>, String> {
        Ok(self
            .0
            .lock()
            .unwrap()
            .get(&node.name)
            .cloned()
            .unwrap_or_default())
    }
}

const ONE: Resources = Resources::sandbox(1, 256, 1024);

fn record(name: &str) -> NodeRecord {
    NodeRecord {
        name: name.to_string(),
        address: format!("{name}.local:7000"),
        capacity: Resources::new(100, 100, 100_000, 1_000_000),
        allocated: Resources::ZERO,
        backends: [Backend::Container].into(),
        images: Default::default(),
        labels: BTreeMap::new(),
        heartbeat_ms: now_ms(),
        cert_sha256: None,
    }
}

async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while !check().await {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{what}: not within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Project acme/rl with room for 10 sandboxes.
async fn project_rl(store: &Arc<dyn Store>) -> (ProjectPath, Quotas) {
    let iam = Iam::new(store.clone());
    iam.create_org("acme").await.unwrap();
    let rl = iam
        .create_project(&"acme".parse().unwrap(), "rl")
        .await
        .unwrap()
        .path;
    let quotas = Quotas::new(store.clone());
    quotas
        .set_limit(&"acme".parse().unwrap(), Resources::UNLIMITED)
        .await
        .unwrap();
    quotas
        .set_limit(&rl, Resources::new(10, 10, 10_000, 100_000))
        .await
        .unwrap();
    (rl, quotas)
}

async fn a_vanished_node_loses_its_sandboxes_and_a_returning_one_gets_back_what_it_runs(
    store: Arc<dyn Store>,
) {
    let (rl, quotas) = project_rl(&store).await;

    let registry = NodeRegistry::new(store.clone());
    let _n1_lease = registry
        .register(&record("n1"), Duration::from_secs(1))
        .await
        .unwrap();
    let n2_lease = registry
        .register(&record("n2"), Duration::from_secs(30))
        .await
        .unwrap();
    let on_n1: Vec<SandboxId> = (0..3).map(|_| SandboxId::new("n1").unwrap()).collect();
    for id in &on_n1 {
        quotas.reserve(&rl, "n1", id.as_str(), ONE).await.unwrap();
    }
    let on_n2 = SandboxId::new("n2").unwrap();
    quotas
        .reserve(&rl, "n2", on_n2.as_str(), ONE)
        .await
        .unwrap();
    // n3 held a sandbox and vanished while no watcher ran.
    let on_n3 = SandboxId::new("n3").unwrap();
    quotas
        .reserve(&rl, "n3", on_n3.as_str(), ONE)
        .await
        .unwrap();

    let inventory = Arc::new(FakeInventory::default());
    inventory.0.lock().unwrap().insert(
        "n2".into(),
        vec![RunningSandbox {
            sandbox: on_n2.to_string(),
            project: rl.clone(),
            resources: ONE,
        }],
    );
    let placer = Arc::new(Placer::with_seed(2, 5));
    let watcher = Watcher::new(store.clone(), inventory.clone(), Some(placer.clone()));
    let task = tokio::spawn(watcher.run());

    let used = |quotas: Quotas, rl: ProjectPath| async move {
        quotas.get(&rl).await.unwrap().used.sandboxes
    };
    eventually("n3's sandbox lost at start", || async {
        lost_sandbox(store.as_ref(), on_n3.as_str())
            .await
            .unwrap()
            .is_some()
    })
    .await;
    eventually("the placer knows both nodes", || async {
        placer.address("n1").is_ok() && placer.address("n2").is_ok()
    })
    .await;
    // Cordoning reaches the placer through the watch.
    registry
        .set_admin(
            "n2",
            NodeAdmin {
                cordoned: true,
                draining: false,
            },
        )
        .await
        .unwrap();
    let request = crate::placement::PlacementRequest {
        resources: ONE,
        backend: Backend::Container,
        image: None,
        labels: BTreeMap::new(),
    };
    eventually("cordoned n2 is not chosen", || async {
        (0..10).all(|_| {
            placer
                .pick(&request, &[])
                .map(|t| t.node() == "n1")
                .unwrap_or(false)
        })
    })
    .await;

    // n1 stops heartbeating: after its lease its sandboxes are lost and their quota is back.
    eventually("n1's sandboxes lost", || async {
        for id in &on_n1 {
            if lost_sandbox(store.as_ref(), id.as_str())
                .await
                .unwrap()
                .is_none()
            {
                return false;
            }
        }
        true
    })
    .await;
    let lost = lost_sandbox(store.as_ref(), on_n1[0].as_str())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (lost.node.as_str(), &lost.project, lost.resources),
        ("n1", &rl, ONE)
    );
    assert_eq!(
        used(quotas.clone(), rl.clone()).await,
        1,
        "only n2's sandbox holds quota"
    );
    assert!(matches!(
        placer.address("n1"),
        Err(crate::placement::PlacementError::UnknownNode(_))
    ));
    assert!(lost_sandbox(store.as_ref(), on_n2.as_str())
        .await
        .unwrap()
        .is_none());

    // n1 comes back still running its first sandbox: charged again, no longer lost.
    inventory.0.lock().unwrap().insert(
        "n1".into(),
        vec![RunningSandbox {
            sandbox: on_n1[0].to_string(),
            project: rl.clone(),
            resources: ONE,
        }],
    );
    registry
        .register(&record("n1"), Duration::from_secs(30))
        .await
        .unwrap();
    eventually("n1's surviving sandbox charged again", || async {
        used(quotas.clone(), rl.clone()).await == 2
    })
    .await;
    assert!(lost_sandbox(store.as_ref(), on_n1[0].as_str())
        .await
        .unwrap()
        .is_none());
    assert!(lost_sandbox(store.as_ref(), on_n1[1].as_str())
        .await
        .unwrap()
        .is_some());
    assert_eq!(quotas.reservations_on("n1").await.unwrap().len(), 1);
    assert!(placer.address("n1").is_ok());

    // A clean deregistration with nothing left running loses nothing.
    quotas.release("n2", on_n2.as_str()).await.unwrap();
    registry.deregister(n2_lease).await.unwrap();
    eventually("n2 gone from the placer", || async {
        placer.address("n2").is_err()
    })
    .await;
    assert!(lost_sandbox(store.as_ref(), on_n2.as_str())
        .await
        .unwrap()
        .is_none());
    task.abort();
}

/// A node whose one sandbox is deleted right after the node listed it: the first listing
/// shows it, every later one does not.
#[derive(Default)]
struct DeletedAfterListing {
    sandbox: Mutex<Option<RunningSandbox>>,
    listings: std::sync::atomic::AtomicUsize,
}

#[async_trait::async_trait]
impl NodeInventory for DeletedAfterListing {
    async fn running(&self, _node: &NodeRecord) -> Result<Vec<RunningSandbox>, String> {
        self.listings
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(self.sandbox.lock().unwrap().take().into_iter().collect())
    }
}

/// The charge a reconcile gives a sandbox its listing showed is taken back when the
/// sandbox is gone by the time it was charged (its delete released nothing then).
async fn a_sandbox_deleted_while_its_node_is_reconciled_keeps_no_charge(store: Arc<dyn Store>) {
    let (rl, quotas) = project_rl(&store).await;
    let inventory = Arc::new(DeletedAfterListing::default());
    *inventory.sandbox.lock().unwrap() = Some(RunningSandbox {
        sandbox: SandboxId::new("n1").unwrap().to_string(),
        project: rl.clone(),
        resources: ONE,
    });
    let _lease = NodeRegistry::new(store.clone())
        .register(&record("n1"), Duration::from_secs(30))
        .await
        .unwrap();
    let task = tokio::spawn(Watcher::new(store.clone(), inventory.clone(), None).run());
    eventually("the node listed", || async {
        inventory.listings.load(std::sync::atomic::Ordering::SeqCst) > 0
    })
    .await;
    eventually("no charge for the deleted sandbox", || async {
        quotas.get(&rl).await.unwrap().used == Resources::ZERO
            && quotas.reservations_on("n1").await.unwrap().is_empty()
    })
    .await;
    task.abort();
}

/// Answers for the nodes in `answering`; holds every other node's call forever (a node whose
/// link went down: no reset ever comes).
#[derive(Default)]
struct Silent {
    answering: Mutex<HashMap<String, Vec<RunningSandbox>>>,
    /// Calls made, per node.
    asked: Mutex<HashMap<String, usize>>,
}

#[async_trait::async_trait]
impl NodeInventory for Silent {
    async fn running(&self, node: &NodeRecord) -> Result<Vec<RunningSandbox>, String> {
        *self
            .asked
            .lock()
            .unwrap()
            .entry(node.name.clone())
            .or_default() += 1;
        let answer = self.answering.lock().unwrap().get(&node.name).cloned();
        match answer {
            Some(running) => Ok(running),
            None => std::future::pending().await,
        }
    }
}

/// A registered node whose inventory call never returns: every node is placeable at once,
/// the answering node is reconciled (its lost mark cleared), a node that registers while the
/// silent one is being asked again is reconciled without waiting for that call, and the
/// silent one is once it answers.
async fn a_node_that_never_answers_holds_up_neither_the_placer_nor_the_other_nodes(
    store: Arc<dyn Store>,
) {
    let (rl, quotas) = project_rl(&store).await;
    let registry = NodeRegistry::new(store.clone());
    let mut on = HashMap::new();
    for node in ["n1", "n2"] {
        registry
            .register(&record(node), Duration::from_secs(30))
            .await
            .unwrap();
        let id = SandboxId::new(node).unwrap().to_string();
        quotas.reserve(&rl, node, &id, ONE).await.unwrap();
        // Both sandboxes were marked lost while their nodes were away.
        store
            .put(&keys::lost(&id), to_json(&id), None)
            .await
            .unwrap();
        on.insert(node, id);
    }
    let running = |node: &str| {
        vec![RunningSandbox {
            sandbox: on[node].clone(),
            project: rl.clone(),
            resources: ONE,
        }]
    };
    let inventory = Arc::new(Silent::default());
    inventory
        .answering
        .lock()
        .unwrap()
        .insert("n2".into(), running("n2"));
    let placer = Arc::new(Placer::with_seed(2, 5));
    let timeout = Duration::from_secs(4);
    let watcher = Watcher::new(store.clone(), inventory.clone(), Some(placer.clone()))
        .with_inventory_timeout(timeout);
    let task = tokio::spawn(watcher.run());

    eventually("both nodes placeable", || async {
        placer.address("n1").is_ok() && placer.address("n2").is_ok()
    })
    .await;
    let lost = |node: &'static str| {
        let (store, id) = (store.clone(), on[node].clone());
        async move { store.get(&keys::lost(&id)).await.unwrap().is_some() }
    };
    eventually("n2 reconciled past silent n1", || async {
        !lost("n2").await
    })
    .await;
    assert!(lost("n1").await, "n1 never answered, yet was reconciled");

    // n1 is being asked again (its call held for the whole timeout); n3 registers now.
    eventually("n1 asked again", || async {
        inventory
            .asked
            .lock()
            .unwrap()
            .get("n1")
            .copied()
            .unwrap_or(0)
            >= 2
    })
    .await;
    let n3 = SandboxId::new("n3").unwrap().to_string();
    store
        .put(&keys::lost(&n3), to_json(&n3), None)
        .await
        .unwrap();
    inventory.answering.lock().unwrap().insert(
        "n3".into(),
        vec![RunningSandbox {
            sandbox: n3.clone(),
            project: rl.clone(),
            resources: ONE,
        }],
    );
    let registered = Instant::now();
    registry
        .register(&record("n3"), Duration::from_secs(30))
        .await
        .unwrap();
    while store.get(&keys::lost(&n3)).await.unwrap().is_some() {
        assert!(
            registered.elapsed() < timeout / 2,
            "n3 waited for n1's inventory call"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    inventory
        .answering
        .lock()
        .unwrap()
        .insert("n1".into(), running("n1"));
    eventually("n1 reconciled once it answers", || async {
        !lost("n1").await
    })
    .await;
    assert_eq!(quotas.reservations_on("n1").await.unwrap().len(), 1);
    task.abort();
}
