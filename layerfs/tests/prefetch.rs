//! Hot list: record the first run's access order, prefetch it on the next mount.

mod common;

use std::fs;
use std::io::{Read, Seek, SeekFrom};
use std::sync::Arc;

use common::{can_mount, Env, MountGuard, Tar};
use dsec_layerfs::cache::NodeCache;
use dsec_layerfs::store::{now_secs, ImageRecord};
use dsec_layerfs::{fuse, prefetch};

#[test]
fn recorded_hot_list_is_prefetched_on_next_mount() {
    if !can_mount() {
        return;
    }
    let env = Env::new(); // 64 KiB chunks
    let big: Vec<u8> = (0..1_000_000u32).map(|i| (i % 241) as u8).collect();
    let id = env.import(
        Tar::new()
            .file("big", &big)
            .file("small", b"small")
            .file("unused", &vec![9u8; 300_000])
            .bytes(),
    );
    env.store
        .put_image(&ImageRecord {
            name: "img".into(),
            layers: vec![id],
            diff_ids: vec![],
            config: None,
            hot_list: None,
            created: now_secs(),
        })
        .unwrap();
    let mnt = env.path("mnt");
    fs::create_dir(&mnt).unwrap();
    let tree = Arc::new(env.cache.compose(&[id]).unwrap());
    let m = fuse::mount(tree, env.cache.clone(), &mnt, true).unwrap();
    let g = MountGuard(mnt.clone());
    assert_eq!(fs::read(mnt.join("small")).unwrap(), b"small");
    let mut f = fs::File::open(mnt.join("big")).unwrap();
    f.seek(SeekFrom::Start(700_000)).unwrap();
    let mut buf = vec![0u8; 1000];
    f.read_exact(&mut buf).unwrap();
    drop(f);
    let list = prefetch::HotList::from_mount(&m);
    m.unmount();
    drop(g);
    assert!(list.entries.contains(&("small".to_string(), 0)));
    assert!(
        list.entries
            .iter()
            .any(|(p, off)| p == "big" && *off == 655_360),
        "{list:?}"
    );
    assert!(list.entries.iter().all(|(p, _)| p != "unused"));
    prefetch::save(&env.store, "img", list.clone()).unwrap();
    assert_eq!(prefetch::load(&env.store, "img").unwrap().unwrap(), list);

    // A fresh node: prefetch brings exactly the hot chunks, nothing else.
    let cache = Arc::new(NodeCache::open(env.path("cache2"), env.store.clone(), u64::MAX).unwrap());
    let tree = Arc::new(cache.compose(&[id]).unwrap());
    let hot = prefetch::load(&env.store, "img").unwrap().unwrap();
    let want = prefetch::chunks_of(tree.as_ref(), &hot);
    let fetched = prefetch::start(cache.clone(), tree, hot, u64::MAX)
        .join()
        .unwrap();
    assert_eq!(fetched, want.iter().map(|c| c.len as u64).sum::<u64>());
    assert!(want.iter().all(|c| cache.contains(&c.digest)));
    assert_eq!(cache.snapshot().fetched_bytes, fetched);
    assert!(
        fetched < 300_000,
        "prefetch fetched more than the hot set: {fetched}"
    );
}
