//! One suite for every [`Store`]: what the control plane relies on, checked against the
//! embedded store and a real etcd alike.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Compare, EventKind, Op, Store, StoreError, Txn};
use crate::testing::on_both_stores;

on_both_stores!(
    put_get_delete,
    range_returns_only_the_prefix_in_key_order,
    transaction_applies_all_or_nothing,
    concurrent_compare_and_swap_loses_no_update,
    kept_alive_lease_keeps_its_keys_and_expiry_deletes_them,
    revoked_lease_deletes_its_keys_and_refuses_new_ones,
    watch_sees_puts_and_deletes_under_its_prefix_in_order,
    watch_from_a_revision_replays_what_came_after_it,
    bad_lease_ttl_is_refused,
);

async fn put_get_delete(store: Arc<dyn Store>) {
    assert_eq!(store.get("k").await.unwrap(), None);
    let revision = store.put("k", b"v1".to_vec(), None).await.unwrap();
    let kv = store.get("k").await.unwrap().unwrap();
    assert_eq!(
        (
            kv.key.as_str(),
            kv.value.as_slice(),
            kv.mod_revision,
            kv.lease
        ),
        ("k", &b"v1"[..], revision, None)
    );
    let later = store.put("k", b"v2".to_vec(), None).await.unwrap();
    assert!(later > revision);
    assert!(store.delete("k").await.unwrap());
    assert!(!store.delete("k").await.unwrap());
    assert_eq!(store.get("k").await.unwrap(), None);
}

async fn range_returns_only_the_prefix_in_key_order(store: Arc<dyn Store>) {
    for key in ["a/2", "b/1", "a/1", "ab/3", "a/10"] {
        store.put(key, key.as_bytes().to_vec(), None).await.unwrap();
    }
    let range = store.range("a/").await.unwrap();
    let keys: Vec<&str> = range.kvs.iter().map(|kv| kv.key.as_str()).collect();
    assert_eq!(keys, ["a/1", "a/10", "a/2"]);
    assert_eq!(range.kvs[0].value, b"a/1");
    assert!(range.revision >= range.kvs.iter().map(|kv| kv.mod_revision).max().unwrap());
    assert!(store.range("zzz/").await.unwrap().kvs.is_empty());
}

async fn transaction_applies_all_or_nothing(store: Arc<dyn Store>) {
    let create = Txn::default()
        .when(Compare::absent("t/a"))
        .then(Op::put("t/a", b"1".to_vec()))
        .then(Op::put("t/b", b"1".to_vec()));
    let outcome = store.txn(create.clone()).await.unwrap();
    assert!(outcome.succeeded);
    let a = store.get("t/a").await.unwrap().unwrap();
    let b = store.get("t/b").await.unwrap().unwrap();
    assert_eq!(a.mod_revision, outcome.revision, "one revision for all ops");
    assert_eq!(b.mod_revision, outcome.revision);

    // The key exists now: the same create fails and writes nothing.
    let again = store.txn(create).await.unwrap();
    assert!(!again.succeeded);
    assert_eq!(
        store.get("t/a").await.unwrap().unwrap().mod_revision,
        a.mod_revision
    );

    // A swap against a stale read fails; against a fresh one it succeeds.
    store.put("t/a", b"2".to_vec(), None).await.unwrap();
    let stale = Txn::default()
        .when(Compare::unchanged(&a))
        .then(Op::delete("t/b"));
    assert!(!store.txn(stale).await.unwrap().succeeded);
    assert!(store.get("t/b").await.unwrap().is_some());
    let fresh_a = store.get("t/a").await.unwrap();
    let fresh = Txn::default()
        .when(Compare::as_read("t/a", fresh_a.as_ref()))
        .then(Op::delete("t/b"));
    assert!(store.txn(fresh).await.unwrap().succeeded);
    assert_eq!(store.get("t/b").await.unwrap(), None);
}

async fn concurrent_compare_and_swap_loses_no_update(store: Arc<dyn Store>) {
    const TASKS: usize = 16;
    const EACH: usize = 10;
    let tasks: Vec<_> = (0..TASKS)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move {
                for _ in 0..EACH {
                    loop {
                        let read = store.get("counter").await.unwrap();
                        let n: u64 = read
                            .as_ref()
                            .map_or(0, |kv| String::from_utf8_lossy(&kv.value).parse().unwrap());
                        let txn = Txn::default()
                            .when(Compare::as_read("counter", read.as_ref()))
                            .then(Op::put("counter", (n + 1).to_string().into_bytes()));
                        if store.txn(txn).await.unwrap().succeeded {
                            break;
                        }
                    }
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    let value = store.get("counter").await.unwrap().unwrap().value;
    assert_eq!(
        String::from_utf8(value).unwrap(),
        (TASKS * EACH).to_string()
    );
}

async fn wait_until_gone(store: &Arc<dyn Store>, key: &str, within: Duration) -> Duration {
    let start = Instant::now();
    while store.get(key).await.unwrap().is_some() {
        assert!(
            start.elapsed() < within,
            "{key} still there after {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    start.elapsed()
}

async fn kept_alive_lease_keeps_its_keys_and_expiry_deletes_them(store: Arc<dyn Store>) {
    let lease = store.grant_lease(Duration::from_secs(1)).await.unwrap();
    store
        .put("node/a", b"up".to_vec(), Some(lease))
        .await
        .unwrap();
    store.put("node/plain", b"x".to_vec(), None).await.unwrap();
    assert_eq!(
        store.get("node/a").await.unwrap().unwrap().lease,
        Some(lease)
    );
    for _ in 0..8 {
        tokio::time::sleep(Duration::from_millis(250)).await;
        store.keep_alive(lease).await.unwrap();
    }
    assert!(
        store.get("node/a").await.unwrap().is_some(),
        "kept alive for 2 s"
    );
    wait_until_gone(&store, "node/a", Duration::from_secs(5)).await;
    assert!(store.get("node/plain").await.unwrap().is_some());
    assert!(matches!(
        store.keep_alive(lease).await,
        Err(StoreError::LeaseNotFound(id)) if id == lease
    ));
}

async fn revoked_lease_deletes_its_keys_and_refuses_new_ones(store: Arc<dyn Store>) {
    let lease = store.grant_lease(Duration::from_secs(30)).await.unwrap();
    store.put("r/1", b"x".to_vec(), Some(lease)).await.unwrap();
    store.put("r/2", b"x".to_vec(), Some(lease)).await.unwrap();
    store.revoke_lease(lease).await.unwrap();
    assert!(store.range("r/").await.unwrap().kvs.is_empty());
    assert!(matches!(
        store.put("r/3", b"x".to_vec(), Some(lease)).await,
        Err(StoreError::LeaseNotFound(_))
    ));
    let in_txn = Txn::default().then(Op::Put {
        key: "r/4".into(),
        value: b"x".to_vec(),
        lease: Some(lease),
    });
    assert!(matches!(
        store.txn(in_txn).await,
        Err(StoreError::LeaseNotFound(_))
    ));
    assert!(matches!(
        store.revoke_lease(lease).await,
        Err(StoreError::LeaseNotFound(_))
    ));
}

async fn watch_sees_puts_and_deletes_under_its_prefix_in_order(store: Arc<dyn Store>) {
    let mut watch = store.watch("w/", None).await.unwrap();
    let lease = store.grant_lease(Duration::from_secs(1)).await.unwrap();
    store.put("w/a", b"1".to_vec(), None).await.unwrap();
    store
        .put("x/a", b"other prefix".to_vec(), None)
        .await
        .unwrap();
    store.put("w/b", b"2".to_vec(), Some(lease)).await.unwrap();
    store.delete("w/a").await.unwrap();
    let mut seen = Vec::new();
    while seen.len() < 4 {
        let event = tokio::time::timeout(Duration::from_secs(10), watch.next())
            .await
            .expect("watch event within 10 s (the lease expiry comes last)")
            .unwrap()
            .unwrap();
        seen.push(event);
    }
    let summary: Vec<(EventKind, &str, &[u8])> = seen
        .iter()
        .map(|e| (e.kind, e.key.as_str(), e.value.as_slice()))
        .collect();
    assert_eq!(
        summary,
        [
            (EventKind::Put, "w/a", &b"1"[..]),
            (EventKind::Put, "w/b", &b"2"[..]),
            (EventKind::Delete, "w/a", &b""[..]),
            (EventKind::Delete, "w/b", &b""[..]),
        ],
        "the last delete is the lease's expiry"
    );
    assert!(seen.windows(2).all(|w| w[0].revision < w[1].revision));
}

async fn watch_from_a_revision_replays_what_came_after_it(store: Arc<dyn Store>) {
    let first = store.put("h/1", b"1".to_vec(), None).await.unwrap();
    store.put("h/2", b"2".to_vec(), None).await.unwrap();
    store.delete("h/1").await.unwrap();
    let mut watch = store.watch("h/", Some(first)).await.unwrap();
    store.put("h/3", b"3".to_vec(), None).await.unwrap();
    let mut keys = Vec::new();
    for _ in 0..3 {
        let event = tokio::time::timeout(Duration::from_secs(5), watch.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        keys.push((event.kind, event.key));
    }
    assert_eq!(
        keys,
        [
            (EventKind::Put, "h/2".to_string()),
            (EventKind::Delete, "h/1".to_string()),
            (EventKind::Put, "h/3".to_string()),
        ]
    );
}

async fn bad_lease_ttl_is_refused(store: Arc<dyn Store>) {
    for ttl in [
        Duration::ZERO,
        Duration::from_millis(500),
        Duration::from_secs(90_000),
    ] {
        assert!(matches!(
            store.grant_lease(ttl).await,
            Err(StoreError::BadTtl(_))
        ));
    }
}

/// A member that is down (nothing listens at its endpoint) costs retries, not failures: the
/// balanced channel still sends calls there, and those that cannot connect are made again.
#[tokio::test]
async fn etcd_calls_go_on_when_a_listed_member_is_down() {
    let Some(test) = crate::testing::etcd_with(&[crate::testing::unused_endpoint()]).await else {
        return;
    };
    let store = test.store;
    for i in 0..40 {
        let key = format!("down/{i}");
        store.put(&key, vec![1], None).await.unwrap();
        assert!(store.get(&key).await.unwrap().is_some());
        let lease = store.grant_lease(Duration::from_secs(5)).await.unwrap();
        store.keep_alive(lease).await.unwrap();
        let txn = Txn {
            compares: vec![],
            ops: vec![Op::Delete { key }],
        };
        assert!(store.txn(txn).await.unwrap().succeeded);
    }
    assert!(store.range("down/").await.unwrap().kvs.is_empty());
}

mod embedded_persistence {
    use std::io::Write;
    use std::time::Duration;

    use crate::store::{Compare, EmbeddedStore, Op, Store, StoreError, Txn};

    #[tokio::test]
    async fn a_reopened_store_has_every_acknowledged_write() {
        let dir = tempfile::tempdir().unwrap();
        let (revision, lease) = {
            let store = EmbeddedStore::open(dir.path()).unwrap();
            store.put("a", b"1".to_vec(), None).await.unwrap();
            store.put("b", b"2".to_vec(), None).await.unwrap();
            store.delete("a").await.unwrap();
            let lease = store.grant_lease(Duration::from_secs(60)).await.unwrap();
            store
                .put("leased", b"l".to_vec(), Some(lease))
                .await
                .unwrap();
            let txn = Txn::default()
                .when(Compare::absent("c"))
                .then(Op::put("c", b"3".to_vec()));
            (store.txn(txn).await.unwrap().revision, lease)
        };
        let store = EmbeddedStore::open(dir.path()).unwrap();
        assert_eq!(store.get("a").await.unwrap(), None);
        assert_eq!(store.get("b").await.unwrap().unwrap().value, b"2");
        assert_eq!(
            store.get("c").await.unwrap().unwrap().mod_revision,
            revision
        );
        assert_eq!(store.range("").await.unwrap().revision, revision);
        // The lease came back with its keys, and revoking it still deletes them.
        store.keep_alive(lease).await.unwrap();
        store.revoke_lease(lease).await.unwrap();
        assert_eq!(store.get("leased").await.unwrap(), None);
        let next = store.grant_lease(Duration::from_secs(5)).await.unwrap();
        assert!(next > lease, "lease ids are not reused after a restart");
    }

    #[tokio::test]
    async fn a_torn_last_log_line_is_cut_off_and_a_damaged_middle_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        {
            let store = EmbeddedStore::open(dir.path()).unwrap();
            store.put("kept", b"1".to_vec(), None).await.unwrap();
        }
        let wal = dir.path().join("wal.jsonl");
        let mut file = std::fs::OpenOptions::new().append(true).open(&wal).unwrap();
        file.write_all(br#"{"t":"commit","revision":2,"ops":[{"op":"put","ke"#)
            .unwrap();
        drop(file);
        {
            let store = EmbeddedStore::open(dir.path()).unwrap();
            assert_eq!(store.get("kept").await.unwrap().unwrap().value, b"1");
            store.put("after", b"2".to_vec(), None).await.unwrap();
        }
        let store = EmbeddedStore::open(dir.path()).unwrap();
        assert_eq!(store.get("after").await.unwrap().unwrap().value, b"2");
        drop(store);

        let text = std::fs::read_to_string(&wal).unwrap();
        std::fs::write(&wal, format!("garbage\n{text}")).unwrap();
        assert!(matches!(
            EmbeddedStore::open(dir.path()),
            Err(StoreError::Corrupt { .. })
        ));
    }

    #[tokio::test]
    async fn the_log_is_folded_into_a_snapshot_and_replay_skips_what_it_holds() {
        let dir = tempfile::tempdir().unwrap();
        {
            let store = EmbeddedStore::open_compacting_after(dir.path(), 10).unwrap();
            for i in 0..25 {
                store
                    .put(&format!("k/{i:02}"), vec![i], None)
                    .await
                    .unwrap();
            }
        }
        let lines = std::fs::read_to_string(dir.path().join("wal.jsonl"))
            .unwrap()
            .lines()
            .count();
        assert!(lines < 10, "the log was folded: {lines} lines left");
        assert!(dir.path().join("snapshot.json").exists());
        let store = EmbeddedStore::open(dir.path()).unwrap();
        let range = store.range("k/").await.unwrap();
        assert_eq!(range.kvs.len(), 25);
        assert_eq!(range.revision, 25);
        assert_eq!(range.kvs[24].value, vec![24]);
    }
}
