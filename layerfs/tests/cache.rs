//! Node cache and failure behaviour: single-flight, LRU cap that spares chunks in use,
//! persisted record, corrupted chunks and an unreachable store.

mod common;

use std::fs;
use std::io::Read;
use std::sync::Arc;

use common::{can_mount, Env, MountGuard, Tar};
use dsec_layerfs::cache::NodeCache;
use dsec_layerfs::index::ChunkRef;
use dsec_layerfs::store::StoreConfig;
use dsec_layerfs::{fuse, Digest};

fn pseudo_random(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 33) as u8
        })
        .collect()
}

fn chunk(env: &Env, data: &[u8]) -> ChunkRef {
    ChunkRef {
        digest: env.store.put_chunk(data).unwrap(),
        len: data.len() as u32,
    }
}

#[test]
fn single_flight_fetches_each_chunk_once() {
    let env = Env::new();
    let c = chunk(&env, &pseudo_random(60_000, 1));
    let cache = env.cache.clone();
    let threads: Vec<_> = (0..16)
        .map(|_| {
            let cache = cache.clone();
            let c = c.clone();
            std::thread::spawn(move || {
                let p = cache.get(&c).unwrap();
                let mut b = vec![0u8; 10];
                p.read_at(&mut b, 0).unwrap();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let s = cache.snapshot();
    assert_eq!(s.misses, 1, "{s:?}");
    assert_eq!(s.fetched_bytes, 60_000);
    assert_eq!(s.hits, 15);
}

#[test]
fn lru_cap_never_evicts_a_pinned_chunk_and_survives_restart() {
    let env = Env::with(StoreConfig::default(), 3 * 10_000);
    let chunks: Vec<ChunkRef> = (0..6)
        .map(|i| chunk(&env, &pseudo_random(10_000, i + 10)))
        .collect();
    let pinned = env.cache.get(&chunks[0]).unwrap();
    for c in &chunks[1..] {
        drop(env.cache.get(c).unwrap());
    }
    let s = env.cache.snapshot();
    assert!(s.used_bytes <= 30_000, "{s:?}");
    assert!(
        env.cache.contains(&chunks[0].digest),
        "pinned chunk was evicted"
    );
    assert!(env.cache.contains(&chunks[5].digest));
    assert!(
        !env.cache.contains(&chunks[1].digest),
        "oldest unpinned chunk should go first"
    );
    let mut b = vec![0u8; 100];
    pinned.read_at(&mut b, 0).unwrap();
    assert_eq!(b, pseudo_random(10_000, 10)[..100]);
    drop(pinned);
    // Touch chunk 0 so it is the most recent, then restart the cache.
    drop(env.cache.get(&chunks[0]).unwrap());
    env.cache.persist().unwrap();
    let kept: Vec<Digest> = chunks
        .iter()
        .filter(|c| env.cache.contains(&c.digest))
        .map(|c| c.digest)
        .collect();
    let reopened = NodeCache::open(env.path("cache"), env.store.clone(), 20_000).unwrap();
    // A smaller cap on restart evicts in recorded LRU order: chunk 0 (most recent) stays.
    assert!(reopened.contains(&chunks[0].digest));
    assert_eq!(reopened.snapshot().chunks, 2);
    assert!(kept.len() >= 2);
    // What survived is served without touching the store.
    drop(reopened.get(&chunks[0]).unwrap());
    assert_eq!(reopened.snapshot().misses, 0);
}

#[test]
fn corrupt_chunk_gives_eio_never_wrong_bytes() {
    if !can_mount() {
        return;
    }
    let env = Env::with(
        StoreConfig {
            chunk_size: 64 * 1024,
            zstd_level: None,
            fsync: false,
        },
        u64::MAX,
    );
    let data = pseudo_random(3 * 64 * 1024 + 100, 7);
    let id = env.import(Tar::new().file("f", &data).file("g", b"fine").bytes());
    let idx = env.cache.layer(&id).unwrap();
    let f = idx.entries.iter().find(|e| e.path == "f").unwrap();
    let dsec_layerfs::index::Kind::File { chunks, .. } = &f.kind else {
        panic!()
    };
    // Flip one byte of the second chunk in the shared store.
    let p = env.store.chunk_path(&chunks[1].digest);
    let mut raw = fs::read(&p).unwrap();
    raw[1000] ^= 0xff;
    fs::write(&p, raw).unwrap();

    let mnt = env.path("mnt");
    fs::create_dir(&mnt).unwrap();
    let m = fuse::mount(
        Arc::new(env.cache.compose(&[id]).unwrap()),
        env.cache.clone(),
        &mnt,
        false,
    )
    .unwrap();
    let _g = MountGuard(mnt.clone());
    let err = fs::read(mnt.join("f")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    // The intact chunks still read correctly.
    let mut file = fs::File::open(mnt.join("f")).unwrap();
    let mut first = vec![0u8; 64 * 1024];
    file.read_exact(&mut first).unwrap();
    assert_eq!(first, data[..64 * 1024]);
    assert_eq!(fs::read(mnt.join("g")).unwrap(), b"fine");
    drop(file);
    m.unmount();
}

#[test]
fn store_unavailable_mid_read_gives_eio_then_recovers() {
    if !can_mount() {
        return;
    }
    let env = Env::new();
    let a = pseudo_random(200_000, 3);
    let b = pseudo_random(200_000, 4);
    let id = env.import(Tar::new().file("a", &a).file("b", &b).bytes());
    let mnt = env.path("mnt");
    fs::create_dir(&mnt).unwrap();
    let m = fuse::mount(
        Arc::new(env.cache.compose(&[id]).unwrap()),
        env.cache.clone(),
        &mnt,
        false,
    )
    .unwrap();
    let _g = MountGuard(mnt.clone());
    assert_eq!(fs::read(mnt.join("a")).unwrap(), a);

    // The shared filesystem goes away (e.g. an NFS outage).
    let chunks = env.store.root().join("chunks");
    let away = env.store.root().join("chunks.away");
    fs::rename(&chunks, &away).unwrap();
    let err = fs::read(mnt.join("b")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    // Cached data keeps working during the outage; the mount is alive.
    assert_eq!(fs::read(mnt.join("a")).unwrap(), a);
    assert!(fs::metadata(mnt.join("b")).is_ok());

    fs::rename(&away, &chunks).unwrap();
    assert_eq!(
        fs::read(mnt.join("b")).unwrap(),
        b,
        "must recover once the store is back"
    );
    assert!(env.cache.snapshot().fetch_errors >= 1);
    m.unmount();
}

#[test]
fn a_second_process_on_the_cache_dir_spares_fills_in_flight() {
    let env = Env::new();
    let c = chunk(&env, &pseudo_random(30_000, 9));
    let tmp = env.path("cache/tmp");
    // Another process's fill in progress, and a leftover of one that crashed long ago.
    fs::write(tmp.join("in-flight.4242.0"), b"partial").unwrap();
    let old = tmp.join("crashed.4243.0");
    fs::write(&old, b"partial").unwrap();
    fs::File::options()
        .write(true)
        .open(&old)
        .unwrap()
        .set_modified(std::time::SystemTime::now() - std::time::Duration::from_secs(3600))
        .unwrap();
    let second = NodeCache::open(env.path("cache"), env.store.clone(), u64::MAX).unwrap();
    assert!(
        tmp.join("in-flight.4242.0").exists(),
        "a fill in flight was removed"
    );
    assert!(!old.exists(), "an old leftover was kept");
    // Both fill and read the same chunk through the shared dir.
    let mut a = vec![0u8; 30_000];
    let mut b = vec![0u8; 30_000];
    env.cache.get(&c).unwrap().read_at(&mut a, 0).unwrap();
    second.get(&c).unwrap().read_at(&mut b, 0).unwrap();
    assert_eq!(a, b);
    assert_eq!(a, pseudo_random(30_000, 9));
    // Nothing but the simulated in-flight file is left in tmp.
    let left: Vec<_> = fs::read_dir(&tmp)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(left, ["in-flight.4242.0"]);
}

#[test]
fn reads_at_any_offset_match_the_file_mapped_or_buffered() {
    let env = Env::with(
        StoreConfig {
            chunk_size: 64 * 1024,
            zstd_level: None,
            fsync: false,
        },
        u64::MAX,
    );
    let cs = 64 * 1024usize;
    let data = pseudo_random(3 * cs + 1000, 11);
    let id = env.import(
        Tar::new()
            .file("f", &data)
            .file("empty", b"")
            .dir("d", 0o755)
            .bytes(),
    );
    let c = env.cache.compose(&[id]).unwrap();
    let ino = c.resolve("f").unwrap();
    let mut buf = Vec::new();
    // Inside one chunk (mapped), across chunk ends (buffered), the short last chunk, at and
    // past EOF; a reused buffer must not leak bytes of an earlier, longer read.
    let len = data.len() as u64;
    let cases: &[(u64, u32)] = &[
        (0, 65536),
        (0, 4096),
        (65536, 65536),
        (100, 65536),
        (65000, 200_000),
        (0, 1 << 20),
        (3 * 65536, 65536),
        (3 * 65536 + 10, 5),
        (len - 1, 4096),
        (len, 4096),
        (len + 5000, 10),
        (0, 0),
    ];
    for &(off, size) in cases {
        let end = (off + size as u64).min(len).max(off.min(len)) as usize;
        let want = &data[(off.min(len) as usize)..end];
        let got = env
            .cache
            .with_data(&c, ino, off, size, &mut buf, |d| d.to_vec())
            .unwrap();
        assert_eq!(got.len(), want.len(), "read at {off} size {size}");
        assert!(got == want, "bytes differ at {off} size {size}");
        assert_eq!(env.cache.read(&c, ino, off, size).unwrap(), want);
    }
    let empty = c.resolve("empty").unwrap();
    let got = env
        .cache
        .with_data(&c, empty, 0, 4096, &mut buf, |d| d.len())
        .unwrap();
    assert_eq!(got, 0);
    // Not a regular file: an error, and the callback never runs.
    let d = c.resolve("d").unwrap();
    let mut called = false;
    let err = env
        .cache
        .with_data(&c, d, 0, 10, &mut buf, |_| called = true)
        .unwrap_err();
    assert!(!called);
    assert!(err.to_string().contains("not a regular file"), "{err}");
}

#[test]
fn mapped_read_of_a_corrupt_chunk_is_an_error_and_intact_chunks_still_read() {
    let env = Env::with(
        StoreConfig {
            chunk_size: 64 * 1024,
            zstd_level: None,
            fsync: false,
        },
        u64::MAX,
    );
    let data = pseudo_random(2 * 64 * 1024, 12);
    let id = env.import(Tar::new().file("f", &data).bytes());
    let c = env.cache.compose(&[id]).unwrap();
    let ino = c.resolve("f").unwrap();
    let idx = env.cache.layer(&id).unwrap();
    let f = idx.entries.iter().find(|e| e.path == "f").unwrap();
    let dsec_layerfs::index::Kind::File { chunks, .. } = &f.kind else {
        panic!("f is a file")
    };
    let p = env.store.chunk_path(&chunks[1].digest);
    let mut raw = fs::read(&p).unwrap();
    raw[10] ^= 0xff;
    fs::write(&p, raw).unwrap();
    let mut buf = Vec::new();
    let mut called = false;
    let err = env
        .cache
        .with_data(&c, ino, 64 * 1024, 64 * 1024, &mut buf, |_| called = true)
        .unwrap_err();
    assert!(!called, "no bytes of a corrupt chunk reach the reader");
    assert_eq!(err.errno(), libc::EIO, "{err}");
    let first = env
        .cache
        .with_data(&c, ino, 0, 64 * 1024, &mut buf, |d| d.to_vec())
        .unwrap();
    assert!(first == data[..64 * 1024]);
}
