use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::iam::Iam;
use crate::testing::on_both_stores;

on_both_stores!(
    a_child_quota_never_exceeds_what_its_parent_has_left,
    reservations_stop_at_the_limit_and_name_the_project_and_resource,
    concurrent_reservers_never_overrun_a_limit,
    batched_reservations_never_overrun_a_limit_and_refuse_a_taken_id,
    concurrent_delegations_never_overrun_the_parent,
    reconciling_a_node_makes_usage_exact,
    a_burst_of_batches_reads_the_quota_record_once,
    a_listing_from_before_a_delete_never_charges_it_again,
);

fn path(text: &str) -> ProjectPath {
    text.parse().unwrap()
}

fn sandboxes(n: u64) -> Resources {
    Resources::new(n, 4 * n, 1024 * n, 4096 * n)
}

const ONE: Resources = Resources::sandbox(1, 256, 1024);

/// Projects acme, acme/rl, acme/rl/run-1, acme/web.
async fn projects(store: &Arc<dyn Store>) -> Quotas {
    let iam = Iam::new(store.clone());
    iam.create_org("acme").await.unwrap();
    let rl = iam.create_project(&path("acme"), "rl").await.unwrap().path;
    iam.create_project(&rl, "run-1").await.unwrap();
    iam.create_project(&path("acme"), "web").await.unwrap();
    Quotas::new(store.clone())
}

/// The projects, with acme and acme/rl limited to `limit` sandboxes' worth.
async fn rl_limited_to(store: &Arc<dyn Store>, limit: u64) -> (Quotas, ProjectPath) {
    let quotas = projects(store).await;
    let rl = path("acme/rl");
    quotas
        .set_limit(&path("acme"), sandboxes(limit))
        .await
        .unwrap();
    quotas.set_limit(&rl, sandboxes(limit)).await.unwrap();
    (quotas, rl)
}

async fn a_child_quota_never_exceeds_what_its_parent_has_left(store: Arc<dyn Store>) {
    let quotas = projects(&store).await;
    quotas
        .set_limit(&path("acme"), sandboxes(10))
        .await
        .unwrap();
    quotas
        .set_limit(&path("acme/rl"), sandboxes(6))
        .await
        .unwrap();
    let e = quotas
        .set_limit(&path("acme/web"), sandboxes(5))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    assert!(
        matches!(&e, QuotaError::ParentShort { parent, resource: "sandboxes", left: 4, .. } if parent.as_str() == "acme"),
        "{e}"
    );
    quotas
        .set_limit(&path("acme/web"), sandboxes(4))
        .await
        .unwrap();
    let org = quotas.get(&path("acme")).await.unwrap();
    assert_eq!(
        (org.delegated, org.left()),
        (sandboxes(10), Resources::ZERO)
    );

    // Grandchildren come out of the child; the child cannot then shrink below them.
    quotas
        .set_limit(&path("acme/rl/run-1"), sandboxes(5))
        .await
        .unwrap();
    let e = quotas
        .set_limit(&path("acme/rl"), sandboxes(4))
        .await
        .unwrap_err();
    assert!(
        matches!(e, QuotaError::BelowDelegated { delegated: 5, .. }),
        "{e}"
    );
    // Shrinking a child gives back to the parent; a sandbox in the parent uses what is left.
    quotas
        .set_limit(&path("acme/rl/run-1"), sandboxes(2))
        .await
        .unwrap();
    quotas
        .set_limit(&path("acme/rl"), sandboxes(3))
        .await
        .unwrap();
    assert_eq!(
        quotas.get(&path("acme")).await.unwrap().left(),
        sandboxes(3)
    );
    assert_eq!(
        quotas.get(&path("acme/rl")).await.unwrap().left(),
        sandboxes(1)
    );
    let e = quotas
        .set_limit(&path("acme"), sandboxes(6))
        .await
        .unwrap_err();
    assert!(
        matches!(e, QuotaError::BelowDelegated { delegated: 7, .. }),
        "{e}"
    );

    let e = quotas
        .set_limit(&path("acme/ghost"), sandboxes(1))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound);
    // An unlimited organization delegates anything.
    quotas
        .set_limit(&path("acme"), Resources::UNLIMITED)
        .await
        .unwrap();
    quotas
        .set_limit(&path("acme/web"), sandboxes(1_000))
        .await
        .unwrap();
}

async fn reservations_stop_at_the_limit_and_name_the_project_and_resource(store: Arc<dyn Store>) {
    let quotas = projects(&store).await;
    let rl = path("acme/rl");
    quotas
        .set_limit(&path("acme"), sandboxes(20))
        .await
        .unwrap();
    quotas
        .set_limit(&rl, Resources::new(10, 40, 1024, 40_960))
        .await
        .unwrap();
    for i in 0..4 {
        quotas
            .reserve(&rl, "n1", &format!("sb-n1-{i}"), ONE)
            .await
            .unwrap();
    }
    // Memory runs out first: 4 x 256 MiB of 1024.
    let e = quotas.reserve(&rl, "n1", "sb-n1-x", ONE).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::ResourceExhausted);
    let message = e.to_string();
    assert!(
        message.contains("acme/rl") && message.contains("memory_mib"),
        "{message}"
    );
    assert!(
        quotas
            .reserve(&rl, "n1", "sb-n1-0", Resources::ZERO)
            .await
            .is_err(),
        "a sandbox holds one reservation"
    );

    let released = quotas.release("n1", "sb-n1-0").await.unwrap().unwrap();
    assert_eq!((released.project, released.resources), (rl.clone(), ONE));
    assert_eq!(quotas.release("n1", "sb-n1-0").await.unwrap(), None);
    quotas.reserve(&rl, "n2", "sb-n2-a", ONE).await.unwrap();
    assert_eq!(
        quotas.get(&rl).await.unwrap().used,
        Resources::new(4, 4, 1024, 4096)
    );

    // A project with no quota set has none.
    let e = quotas
        .reserve(&path("acme/web"), "n1", "sb-n1-w", ONE)
        .await
        .unwrap_err();
    assert!(
        matches!(
            &e,
            QuotaError::Exceeded {
                resource: "sandboxes",
                left: 0,
                ..
            }
        ),
        "{e}"
    );
    // The 11th sandbox of a 10-sandbox project is refused.
    let tiny = Resources::new(1, 0, 0, 0);
    quotas
        .set_limit(&path("acme/web"), Resources::new(10, 0, 0, 0))
        .await
        .unwrap();
    for i in 0..10 {
        quotas
            .reserve(&path("acme/web"), "n1", &format!("w{i}"), tiny)
            .await
            .unwrap();
    }
    let e = quotas
        .reserve(&path("acme/web"), "n1", "w10", tiny)
        .await
        .unwrap_err();
    assert!(
        e.to_string()
            .starts_with("project acme/web is out of sandboxes quota: asked for 1, 0 left"),
        "{e}"
    );
}

async fn concurrent_reservers_never_overrun_a_limit(store: Arc<dyn Store>) {
    const LIMIT: u64 = 40;
    const RESERVERS: usize = 100;
    let (quotas, rl) = rl_limited_to(&store, LIMIT).await;
    let tasks: Vec<_> = (0..RESERVERS)
        .map(|i| {
            let (quotas, rl) = (quotas.clone(), rl.clone());
            tokio::spawn(async move {
                let node = format!("n{}", i % 4);
                quotas
                    .reserve(&rl, &node, &format!("sb-{i}"), sandboxes(1))
                    .await
                    .map(|_| (node, format!("sb-{i}")))
            })
        })
        .collect();
    let mut granted = Vec::new();
    for task in tasks {
        match task.await.unwrap() {
            Ok(reserved) => granted.push(reserved),
            Err(e) => assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e}"),
        }
    }
    assert_eq!(granted.len() as u64, LIMIT);
    assert_eq!(quotas.get(&rl).await.unwrap().used, sandboxes(LIMIT));
    let mut filed = 0;
    for node in ["n0", "n1", "n2", "n3"] {
        filed += quotas.reservations_on(node).await.unwrap().len();
    }
    assert_eq!(filed as u64, LIMIT);

    // Releasing them all concurrently returns exactly everything.
    let tasks: Vec<_> = granted
        .into_iter()
        .map(|(node, sandbox)| {
            let quotas = quotas.clone();
            tokio::spawn(async move { quotas.release(&node, &sandbox).await.unwrap() })
        })
        .collect();
    for task in tasks {
        assert!(task.await.unwrap().is_some());
    }
    assert_eq!(quotas.get(&rl).await.unwrap().used, Resources::ZERO);
}

async fn concurrent_delegations_never_overrun_the_parent(store: Arc<dyn Store>) {
    let quotas = projects(&store).await;
    let iam = Iam::new(store.clone());
    quotas
        .set_limit(&path("acme"), sandboxes(10))
        .await
        .unwrap();
    let mut children = Vec::new();
    for i in 0..20 {
        children.push(
            iam.create_project(&path("acme"), &format!("c{i}"))
                .await
                .unwrap()
                .path,
        );
    }
    let tasks: Vec<_> = children
        .into_iter()
        .map(|child| {
            let quotas = quotas.clone();
            tokio::spawn(async move { quotas.set_limit(&child, sandboxes(1)).await.is_ok() })
        })
        .collect();
    let mut granted = 0;
    for task in tasks {
        granted += task.await.unwrap() as u64;
    }
    assert_eq!(granted, 10);
    let org = quotas.get(&path("acme")).await.unwrap();
    assert_eq!(
        (org.delegated, org.left()),
        (sandboxes(10), Resources::ZERO)
    );
}

async fn reconciling_a_node_makes_usage_exact(store: Arc<dyn Store>) {
    let quotas = projects(&store).await;
    let (rl, web) = (path("acme/rl"), path("acme/web"));
    quotas
        .set_limit(&path("acme"), sandboxes(10))
        .await
        .unwrap();
    quotas.set_limit(&rl, sandboxes(3)).await.unwrap();
    quotas.set_limit(&web, sandboxes(2)).await.unwrap();
    for id in ["a", "b", "c"] {
        quotas.reserve(&rl, "n1", id, ONE).await.unwrap();
    }
    quotas.reserve(&web, "n2", "other-node", ONE).await.unwrap();
    // The node runs a (as reserved), b with another size, and d that no reservation knows
    // (created before a control-plane crash lost it); c never reached it.
    let running = |id: &str, project: &ProjectPath, resources| RunningSandbox {
        sandbox: id.to_string(),
        project: project.clone(),
        resources,
    };
    let big = Resources::sandbox(2, 512, 1024);
    let report = [
        running("a", &rl, ONE),
        running("b", &rl, big),
        running("d", &rl, ONE),
    ];

    // Within the grace period c may still be on its way: kept; b is fixed, d charged, and
    // charged past the limit because it exists.
    let first = quotas
        .reconcile_node("n1", &report, Duration::from_secs(3600))
        .await
        .unwrap();
    assert_eq!(first.released.len(), 1, "b's stale size");
    let charged: Vec<&str> = first.charged.iter().map(|r| r.sandbox.as_str()).collect();
    assert_eq!(charged, ["b", "d"]);
    let used = quotas.get(&rl).await.unwrap().used;
    assert_eq!(used, ONE.plus(big).plus(ONE).plus(ONE), "a + b + c + d");
    assert_eq!(
        quotas
            .reserve(&rl, "n1", "e", ONE)
            .await
            .unwrap_err()
            .code(),
        tonic::Code::ResourceExhausted
    );

    // After the grace period c is returned; a second pass changes nothing.
    let second = quotas
        .reconcile_node("n1", &report, Duration::ZERO)
        .await
        .unwrap();
    let released: Vec<&str> = second.released.iter().map(|r| r.sandbox.as_str()).collect();
    assert_eq!((released, second.charged.len()), (vec!["c"], 0));
    assert_eq!(quotas.get(&rl).await.unwrap().used, ONE.plus(big).plus(ONE));
    assert_eq!(
        quotas
            .reconcile_node("n1", &report, Duration::ZERO)
            .await
            .unwrap(),
        Reconciled::default()
    );

    // A node that vanished: an empty report with no grace returns all it held.
    let gone = quotas
        .reconcile_node("n1", &[], Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(gone.released.len(), 3);
    assert_eq!(quotas.get(&rl).await.unwrap().used, Resources::ZERO);
    assert_eq!(
        quotas.get(&web).await.unwrap().used,
        ONE,
        "other nodes untouched"
    );
}

/// The group commit keeps `reserve`'s guarantees: exact usage, the limit never overrun, a
/// reservation id taken once, with 300 concurrent reservers (several batches, one project)
/// and a racing plain reserver on the same record.
async fn batched_reservations_never_overrun_a_limit_and_refuse_a_taken_id(store: Arc<dyn Store>) {
    const LIMIT: u64 = 250;
    const RESERVERS: usize = 300;
    let (quotas, rl) = rl_limited_to(&store, LIMIT).await;
    let reserver = Reserver::new(quotas.clone());
    let mut tasks: Vec<_> = (0..RESERVERS)
        .map(|i| {
            let (reserver, rl) = (reserver.clone(), rl.clone());
            tokio::spawn(async move {
                reserver
                    .reserve(
                        &rl,
                        &format!("n{}", i % 4),
                        &format!("sb-{i}"),
                        sandboxes(1),
                    )
                    .await
            })
        })
        .collect();
    // A plain reserver on the same record meanwhile: the batches must go again around it.
    let plain = {
        let (quotas, rl) = (quotas.clone(), rl.clone());
        tokio::spawn(async move { quotas.reserve(&rl, "n9", "sb-plain", sandboxes(1)).await })
    };
    tasks.push(plain);
    let mut granted = Vec::new();
    for task in tasks {
        match task.await.unwrap() {
            Ok(reservation) => granted.push(reservation),
            Err(e) => assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e}"),
        }
    }
    assert_eq!(granted.len() as u64, LIMIT);
    assert_eq!(quotas.get(&rl).await.unwrap().used, sandboxes(LIMIT));

    // An id already reserved is refused, alone or in a batch. Which reservers won is up to
    // the scheduler: free two of the winners.
    for won in &granted[..2] {
        quotas.release(&won.node, &won.sandbox).await.unwrap();
    }
    let first = reserver.reserve(&rl, "n0", "sb-new", sandboxes(1)).await;
    assert!(first.is_ok(), "{first:?}");
    let again = reserver.reserve(&rl, "n0", "sb-new", sandboxes(1)).await;
    assert_eq!(again.unwrap_err().code(), tonic::Code::AlreadyExists);
    assert_eq!(quotas.get(&rl).await.unwrap().used, sandboxes(LIMIT - 1));
}

async fn a_burst_of_batches_reads_the_quota_record_once(store: Arc<dyn Store>) {
    let (_, rl) = rl_limited_to(&store, 1_000).await;
    let counting = crate::testing::Counting::over(store);
    let quotas = Quotas::new(counting.clone());
    let reserver = Reserver::new(quotas.clone());
    for i in 0..20 {
        reserver
            .reserve(&rl, "n0", &format!("sb-{i}"), sandboxes(1))
            .await
            .unwrap();
    }
    assert_eq!(counting.reads(), 1, "each batch read the quota record");
    // A change made elsewhere is found by the failed transaction, and nothing is lost.
    quotas.release("n0", "sb-0").await.unwrap();
    reserver
        .reserve(&rl, "n0", "sb-20", sandboxes(1))
        .await
        .unwrap();
    assert_eq!(quotas.get(&rl).await.unwrap().used, sandboxes(20));
    // A remembered record that looks full is read again before anything is refused.
    quotas.set_limit(&rl, sandboxes(21)).await.unwrap();
    reserver
        .reserve(&rl, "n0", "sb-21", sandboxes(1))
        .await
        .unwrap();
    quotas.release("n0", "sb-1").await.unwrap();
    reserver
        .reserve(&rl, "n0", "sb-22", sandboxes(1))
        .await
        .unwrap();
    let refused = reserver.reserve(&rl, "n0", "sb-23", sandboxes(1)).await;
    assert_eq!(refused.unwrap_err().code(), tonic::Code::ResourceExhausted);
    assert_eq!(quotas.get(&rl).await.unwrap().used, sandboxes(21));

    // The estimate a create uses to go to its node while its reservation commits: only
    // from a record this replica wrote, never past what it showed left.
    assert!(!reserver.likely_fits(&path("acme/none"), sandboxes(1)));
    quotas.set_limit(&rl, sandboxes(30)).await.unwrap();
    reserver
        .reserve(&rl, "n0", "sb-24", sandboxes(1))
        .await
        .unwrap();
    assert!(reserver.likely_fits(&rl, sandboxes(8)));
    assert!(!reserver.likely_fits(&rl, sandboxes(9)));
}

/// A node listing taken before a delete (a watcher's reconcile, a heartbeat's check) that is
/// acted on after the delete returned the quota must not charge the deleted sandbox again;
/// the marks go after `DELETED_KEPT`.
async fn a_listing_from_before_a_delete_never_charges_it_again(store: Arc<dyn Store>) {
    let (quotas, rl) = rl_limited_to(&store, 10).await;
    quotas.reserve(&rl, "n1", "a", ONE).await.unwrap();
    quotas.reserve(&rl, "n1", "b", ONE).await.unwrap();
    let stale = [
        RunningSandbox {
            sandbox: "a".to_string(),
            project: rl.clone(),
            resources: ONE,
        },
        RunningSandbox {
            sandbox: "b".to_string(),
            project: rl.clone(),
            resources: ONE,
        },
    ];
    let released = quotas.release_deleted("n1", "a").await.unwrap();
    assert_eq!(released.map(|r| r.sandbox), Some("a".to_string()));
    assert_eq!(quotas.get(&rl).await.unwrap().used, ONE);
    let report = quotas
        .reconcile_node("n1", &stale, Duration::from_secs(3600))
        .await
        .unwrap();
    assert_eq!(
        report,
        Reconciled::default(),
        "a was deleted, b is reserved"
    );
    assert!(!quotas.charge_if_unreserved("n1", &stale[0]).await.unwrap());
    assert_eq!(quotas.get(&rl).await.unwrap().used, ONE);
    // A second delete of it (a retried call) marks again and returns nothing.
    assert_eq!(quotas.release_deleted("n1", "a").await.unwrap(), None);

    // Kept marks stay; old ones go, and then a sandbox of that name can be charged.
    assert_eq!(quotas.forget_deleted(DELETED_KEPT).await.unwrap(), 0);
    assert_eq!(quotas.forget_deleted(Duration::ZERO).await.unwrap(), 1);
    assert!(quotas.charge_if_unreserved("n1", &stale[0]).await.unwrap());
    assert_eq!(quotas.get(&rl).await.unwrap().used, ONE.plus(ONE));
}
