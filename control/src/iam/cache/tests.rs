use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::iam::{
    Action, Iam, IamCache, IamError, PrincipalId, ProjectPath, Role, REVOCATION_BOUND,
};
use crate::store::Store;
use crate::testing::{on_both_stores, Counting};

on_both_stores!(
    a_revoked_token_is_refused_on_every_replica_within_the_bound,
    a_current_cache_authorizes_without_reading_the_store,
    what_another_replica_just_granted_works_at_once,
);

async fn replica(store: Arc<dyn Store>) -> (Iam, Arc<IamCache>) {
    let cache = IamCache::start(store.clone());
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cache.is_current() {
        assert!(
            Instant::now() < deadline,
            "the cache never listed the store"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    (Iam::with_cache(store, cache.clone()), cache)
}

fn path(text: &str) -> ProjectPath {
    text.parse().unwrap()
}

async fn a_revoked_token_is_refused_on_every_replica_within_the_bound(store: Arc<dyn Store>) {
    let admin = Iam::new(store.clone());
    admin.bootstrap("acme", "alice").await.unwrap();
    let bob = PrincipalId::user("bob").unwrap();
    admin
        .create_principal(bob.clone(), "bob", false)
        .await
        .unwrap();
    admin
        .grant(&bob, &path("acme"), Role::Editor)
        .await
        .unwrap();
    let token = admin.issue_token(&bob, "job", None).await.unwrap();
    let (one, _c1) = replica(store.clone()).await;
    let (two, _c2) = replica(store.clone()).await;
    for iam in [&one, &two] {
        iam.authorize(&token.secret, &path("acme"), Action::SandboxExec)
            .await
            .unwrap();
    }
    admin.revoke_token(&token.id).await.unwrap();
    let revoked = Instant::now();
    for iam in [&one, &two] {
        loop {
            match iam
                .authorize(&token.secret, &path("acme"), Action::SandboxExec)
                .await
            {
                Err(IamError::TokenRevoked(_)) => break,
                Ok(_) => assert!(
                    revoked.elapsed() < REVOCATION_BOUND,
                    "a replica still accepts a token revoked {:?} ago",
                    revoked.elapsed()
                ),
                Err(e) => panic!("{e}"),
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    eprintln!(
        "revocation seen by both replicas after {:?}",
        revoked.elapsed()
    );
    // A role taken away is refused within the same bound.
    let carol = PrincipalId::user("carol").unwrap();
    admin
        .create_principal(carol.clone(), "carol", false)
        .await
        .unwrap();
    admin
        .grant(&carol, &path("acme"), Role::Editor)
        .await
        .unwrap();
    let carols = admin.issue_token(&carol, "job", None).await.unwrap();
    one.authorize(&carols.secret, &path("acme"), Action::SandboxCreate)
        .await
        .unwrap();
    admin.revoke_role(&carol, &path("acme")).await.unwrap();
    let taken = Instant::now();
    while one
        .authorize(&carols.secret, &path("acme"), Action::SandboxCreate)
        .await
        .is_ok()
    {
        assert!(
            taken.elapsed() < REVOCATION_BOUND,
            "a removed role still allows"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

async fn a_current_cache_authorizes_without_reading_the_store(store: Arc<dyn Store>) {
    let admin = Iam::new(store.clone());
    let alice = admin.bootstrap("acme", "alice").await.unwrap();
    let rl = admin
        .create_project(&path("acme"), "rl")
        .await
        .unwrap()
        .path;
    let counting = Counting::over(store);
    let (iam, _cache) = replica(counting.clone()).await;
    let before = counting.reads();
    for _ in 0..100 {
        iam.authorize(&alice.secret, &rl, Action::SandboxCreate)
            .await
            .unwrap();
        iam.authorize_cluster(&alice.secret).await.unwrap();
    }
    assert_eq!(counting.reads(), before, "authorization read the store");
    // Without a cache each call reads token, project and bindings.
    let plain = Iam::new(counting.clone());
    plain
        .authorize(&alice.secret, &rl, Action::SandboxCreate)
        .await
        .unwrap();
    assert_eq!(counting.reads(), before + 3);
}

async fn what_another_replica_just_granted_works_at_once(store: Arc<dyn Store>) {
    let (one, _c1) = replica(store.clone()).await;
    let (two, _c2) = replica(store.clone()).await;
    one.bootstrap("acme", "alice").await.unwrap();
    let dave = PrincipalId::user("dave").unwrap();
    one.create_principal(dave.clone(), "dave", false)
        .await
        .unwrap();
    let web = one.create_project(&path("acme"), "web").await.unwrap().path;
    one.grant(&dave, &web, Role::Viewer).await.unwrap();
    let token = one.issue_token(&dave, "new", None).await.unwrap();
    // No wait for the watch: a token, project or role the copy lacks is read from the store.
    two.authorize(&token.secret, &web, Action::SandboxList)
        .await
        .unwrap();
    let e = two
        .authorize(&token.secret, &web, Action::SandboxCreate)
        .await
        .unwrap_err();
    assert!(matches!(e, IamError::PermissionDenied { .. }), "{e}");
}
