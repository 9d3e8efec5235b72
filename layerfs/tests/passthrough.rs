//! FUSE passthrough of fully cached files: the kernel reads a local cache file (a one-chunk
//! file's chunk, a multi-chunk file's flat copy) and the daemon sees no reads; files not
//! fully cached stay in cached mode; the kernel's one-mode-per-inode rule holds under
//! concurrent opens; flat copies survive eviction under a reader and a cache restart.

mod common;

use std::fs;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{can_mount, Env, MountGuard, Tar};
use dsec_layerfs::cache::{CacheStatsSnapshot, NodeCache};
use dsec_layerfs::compose::ImageTree;
use dsec_layerfs::index::ChunkRef;
use dsec_layerfs::store::StoreConfig;
use dsec_layerfs::{fuse, prefetch, Digest};

const CS: usize = 64 * 1024;

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

fn env(cap: u64) -> Env {
    Env::with(
        StoreConfig {
            chunk_size: CS as u32,
            zstd_level: None,
            fsync: false,
        },
        cap,
    )
}

/// The kernel offers passthrough here (6.9+ with CONFIG_FUSE_PASSTHROUGH); mount tests
/// that prove it say SKIPPED elsewhere.
fn can_passthrough(env: &Env, mnt: &Path) -> bool {
    let single = mnt.join("single");
    drop(fs::read(&single).unwrap());
    let before = env.cache.snapshot().passthrough_opens;
    drop(fs::read(&single).unwrap());
    let ok = env.cache.snapshot().passthrough_opens > before;
    if !ok {
        eprintln!("SKIPPED: this kernel does not pass FUSE files through (needs 6.9+, CONFIG_FUSE_PASSTHROUGH)");
    }
    ok
}

struct Fixture {
    env: Env,
    mnt: PathBuf,
    tree: Arc<dsec_layerfs::compose::Composition>,
    m: Option<fuse::Mount>,
    _guard: MountGuard,
    multi: Vec<u8>,
    single: Vec<u8>,
}

impl Fixture {
    fn new(cap: u64, extra: &[(&str, Vec<u8>)]) -> Fixture {
        let env = env(cap);
        let multi = pseudo_random(5 * CS + 100, 1);
        let single = pseudo_random(30_000, 2);
        let mut tar = Tar::new()
            .file("multi", &multi)
            .file("single", &single)
            .file("cold", &pseudo_random(3 * CS, 3))
            .file("cold1", &pseudo_random(1000, 4))
            .file("held", &pseudo_random(2 * CS + 7, 5))
            .file("held1", &pseudo_random(5000, 6));
        for (p, d) in extra {
            tar = tar.file_owned(p, d, 0o755, 0, 0);
        }
        let id = env.import(tar.bytes());
        let mnt = env.path("mnt");
        fs::create_dir(&mnt).unwrap();
        let tree = Arc::new(env.cache.compose(&[id]).unwrap());
        let m = fuse::mount(tree.clone(), env.cache.clone(), &mnt, false).unwrap();
        Fixture {
            _guard: MountGuard(mnt.clone()),
            env,
            mnt,
            tree,
            m: Some(m),
            multi,
            single,
        }
    }

    fn chunks(&self, path: &str) -> Vec<ChunkRef> {
        let ino = self.tree.resolve(path).unwrap();
        self.tree.file_chunks(ino).unwrap().1.to_vec()
    }

    fn stats(&self) -> CacheStatsSnapshot {
        self.env.cache.snapshot()
    }

    fn wait_flat(&self, path: &str) {
        let chunks = self.chunks(path);
        let t = Instant::now();
        while !self.env.cache.has_flat(&chunks) {
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "no flat copy of {path} after release"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        if let Some(m) = self.m.take() {
            m.unmount();
        }
    }
}

#[test]
fn warm_files_pass_through_and_the_daemon_sees_no_reads() {
    if !can_mount() {
        return;
    }
    let f = Fixture::new(u64::MAX, &[]);
    if !can_passthrough(&f.env, &f.mnt) {
        return;
    }
    // First read: cold, so cached mode and daemon reads; the release starts the flat copy.
    let s0 = f.stats();
    assert_eq!(fs::read(f.mnt.join("multi")).unwrap(), f.multi);
    let s1 = f.stats();
    assert_eq!(
        s1.passthrough_opens, s0.passthrough_opens,
        "cold file passed through"
    );
    assert!(s1.daemon_reads > s0.daemon_reads);
    f.wait_flat("multi");
    let s2 = f.stats();
    // The background flat copy may already be done when s1 is read (its count and bytes
    // are updated together).
    let built_before_s1 = s1.flat_builds - s0.flat_builds;
    assert!(built_before_s1 <= 1);
    assert_eq!(s2.flat_builds, s0.flat_builds + 1);
    assert_eq!(s2.flat_files, 1);
    assert_eq!(
        s2.used_bytes,
        s1.used_bytes + (1 - built_before_s1) * f.multi.len() as u64,
        "flat bytes are accounted"
    );
    let flat = f
        .env
        .path("cache/flat")
        .join(NodeCache::flat_id(&f.chunks("multi")).hex());
    assert_eq!(fs::read(&flat).unwrap(), f.multi, "flat copy is the file");

    // Next open: passthrough, byte-exact, and no read reaches the daemon or the cache.
    let mut file = fs::File::open(f.mnt.join("multi")).unwrap();
    let mut got = Vec::new();
    file.read_to_end(&mut got).unwrap();
    // Reads at odd offsets across chunk boundaries, too.
    let mut mid = vec![0u8; CS + 3];
    file.seek(SeekFrom::Start(CS as u64 - 1)).unwrap();
    file.read_exact(&mut mid).unwrap();
    drop(file);
    let s3 = f.stats();
    assert!(got == f.multi, "passthrough bytes differ");
    assert!(mid == f.multi[CS - 1..2 * CS + 2]);
    assert_eq!(s3.passthrough_opens, s2.passthrough_opens + 1);
    assert_eq!(s3.daemon_reads, s2.daemon_reads, "{s2:?} -> {s3:?}");
    assert_eq!((s3.hits, s3.misses), (s2.hits, s2.misses));

    // One-chunk file: its chunk file is the backing, no flat copy needed.
    assert_eq!(fs::read(f.mnt.join("single")).unwrap(), f.single);
    let s4 = f.stats();
    assert_eq!(s4.passthrough_opens, s3.passthrough_opens + 1);
    assert_eq!(s4.daemon_reads, s3.daemon_reads);
    assert_eq!(s4.flat_files, 1);

    // mmap of a passthrough file.
    let file = fs::File::open(f.mnt.join("multi")).unwrap();
    let mapped = map(&file, f.multi.len());
    assert!(mapped == f.multi[..], "mapped bytes differ");
    assert_eq!(f.stats().daemon_reads, s4.daemon_reads);
}

/// The whole file through a private read-only mapping, copied out.
fn map(file: &fs::File, len: usize) -> Vec<u8> {
    use std::os::fd::AsRawFd;
    // SAFETY: a new private read-only mapping of an open file of `len` bytes; the kernel
    // picks the address and the result is checked before use.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_PRIVATE,
            file.as_raw_fd(),
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED, "{}", std::io::Error::last_os_error());
    // SAFETY: p maps len readable bytes until the munmap below.
    let out = unsafe { std::slice::from_raw_parts(p as *const u8, len) }.to_vec();
    // SAFETY: p and len come from the mmap above; no slice of it outlives this.
    unsafe { libc::munmap(p, len) };
    out
}

#[test]
fn cold_files_stay_in_cached_mode_and_read_exactly() {
    if !can_mount() {
        return;
    }
    let f = Fixture::new(u64::MAX, &[]);
    if !can_passthrough(&f.env, &f.mnt) {
        return;
    }
    let want = pseudo_random(3 * CS, 3);
    let s0 = f.stats();
    let mut file = fs::File::open(f.mnt.join("cold")).unwrap();
    let s1 = f.stats();
    assert_eq!(s1.passthrough_opens, s0.passthrough_opens);
    let mut got = Vec::new();
    file.read_to_end(&mut got).unwrap();
    assert!(got == want);
    assert!(f.stats().daemon_reads > s1.daemon_reads);
    assert!(f.stats().misses >= s0.misses + 3);
}

#[test]
fn a_held_cached_open_keeps_new_opens_cached_then_they_pass_through() {
    if !can_mount() {
        return;
    }
    let f = Fixture::new(u64::MAX, &[]);
    if !can_passthrough(&f.env, &f.mnt) {
        return;
    }
    for (path, want) in [
        ("held1", pseudo_random(5000, 6)),
        ("held", pseudo_random(2 * CS + 7, 5)),
    ] {
        // Cold: cached mode; reading it caches every chunk while the open is held.
        let mut first = fs::File::open(f.mnt.join(path)).unwrap();
        let mut got = Vec::new();
        first.read_to_end(&mut got).unwrap();
        assert!(got == want);
        if path == "held" {
            // A flat copy made while the cached open is held must not flip the mode either.
            drop(fs::File::open(f.mnt.join(path)).unwrap());
            f.wait_flat(path);
        }
        let s0 = f.stats();
        // Fully cached now, but the inode is in cached mode: a passthrough open would EIO.
        let mut second = fs::File::open(f.mnt.join(path)).unwrap();
        let mut got2 = Vec::new();
        second.read_to_end(&mut got2).unwrap();
        assert!(got2 == want, "{path}: second open while the first is held");
        assert_eq!(f.stats().passthrough_opens, s0.passthrough_opens);
        drop(first);
        drop(second);
        // All closed: the next opens pass through, several at once sharing one backing.
        let a = fs::File::open(f.mnt.join(path)).unwrap();
        let b = fs::File::open(f.mnt.join(path)).unwrap();
        assert_eq!(
            f.stats().passthrough_opens,
            s0.passthrough_opens + 2,
            "{path}"
        );
        for mut h in [a, b] {
            let mut got = Vec::new();
            h.read_to_end(&mut got).unwrap();
            assert!(got == want, "{path}: concurrent passthrough read");
        }
    }
}

#[test]
fn evicting_a_flat_copy_in_use_does_not_break_its_reader() {
    if !can_mount() {
        return;
    }
    // Cap 2 MiB: `multi` (320 KiB) gets a flat copy (under a quarter of the cap), the
    // fillers (576 KiB each) do not, and reading them pushes 2.8 MiB through the cache.
    let filler: Vec<(String, Vec<u8>)> = (0..5)
        .map(|i| (format!("filler{i}"), pseudo_random(9 * CS, 100 + i)))
        .collect();
    let extra: Vec<(&str, Vec<u8>)> = filler
        .iter()
        .map(|(p, d)| (p.as_str(), d.clone()))
        .collect();
    let f = Fixture::new(2 << 20, &extra);
    if !can_passthrough(&f.env, &f.mnt) {
        return;
    }
    assert_eq!(fs::read(f.mnt.join("multi")).unwrap(), f.multi);
    f.wait_flat("multi");
    let flat = f
        .env
        .path("cache/flat")
        .join(NodeCache::flat_id(&f.chunks("multi")).hex());
    assert!(flat.exists());
    let s0 = f.stats();
    let mut held = fs::File::open(f.mnt.join("multi")).unwrap();
    assert_eq!(f.stats().passthrough_opens, s0.passthrough_opens + 1);
    let mut head = vec![0u8; 1000];
    held.read_exact(&mut head).unwrap();
    // Push everything else out of the cache.
    for (p, d) in &filler {
        assert!(fs::read(f.mnt.join(p)).unwrap() == *d, "{p}");
    }
    assert!(!f.env.cache.has_flat(&f.chunks("multi")), "flat copy kept");
    assert!(!flat.exists(), "evicted flat copy still on disk");
    assert!(f.stats().used_bytes <= 2 << 20);
    // The held passthrough open still reads the whole file from the unlinked copy.
    held.seek(SeekFrom::Start(0)).unwrap();
    let mut got = Vec::new();
    held.read_to_end(&mut got).unwrap();
    assert!(got == f.multi, "reader broken by eviction");
    drop(held);
    // A new open falls back to cached mode and refetches what it needs.
    let s1 = f.stats();
    assert_eq!(fs::read(f.mnt.join("multi")).unwrap(), f.multi);
    assert_eq!(f.stats().passthrough_opens, s1.passthrough_opens);
}

#[test]
fn exec_of_a_passthrough_binary_works() {
    if !can_mount() {
        return;
    }
    // A static binary if the host has one, else any: run from the host, not chrooted.
    let bin = ["/bin/busybox", "/bin/true"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .expect("a binary to run");
    let data = fs::read(bin).unwrap();
    // Named as on the host: busybox picks the applet from argv[0].
    let name = Path::new(bin).file_name().unwrap().to_str().unwrap();
    let f = Fixture::new(u64::MAX, &[(name, data.clone())]);
    if !can_passthrough(&f.env, &f.mnt) {
        return;
    }
    let prog = f.mnt.join(name);
    assert_eq!(
        fs::metadata(&prog).unwrap().permissions().mode() & 0o111,
        0o111
    );
    // Warm it: read it once (cached mode), then wait for the flat copy if it needs one.
    assert!(fs::read(&prog).unwrap() == data);
    if f.chunks(name).len() > 1 {
        f.wait_flat(name);
    }
    let s0 = f.stats();
    let args: &[&str] = if bin.ends_with("busybox") {
        &["echo", "passthrough-exec"]
    } else {
        &[]
    };
    let out = std::process::Command::new(&prog)
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    if bin.ends_with("busybox") {
        assert_eq!(out.stdout, b"passthrough-exec\n");
    }
    let s1 = f.stats();
    assert!(
        s1.passthrough_opens > s0.passthrough_opens,
        "exec did not pass through"
    );
    assert_eq!(
        s1.daemon_reads, s0.daemon_reads,
        "exec read through the daemon"
    );
}

#[test]
fn hot_list_of_a_recording_mount_is_what_cached_mode_records() {
    if !can_mount() {
        return;
    }
    let env = env(u64::MAX);
    let a = pseudo_random(1000, 20);
    let b = pseudo_random(3 * CS, 21);
    let c = pseudo_random(2000, 22);
    let id = env.import(Tar::new().file("a", &a).file("b", &b).file("c", &c).bytes());
    let tree = Arc::new(env.cache.compose(&[id]).unwrap());
    // `c` is cached before the mount (as a prefetch would): its first read in this run must
    // still be recorded, so it must not pass through.
    let cino = tree.resolve("c").unwrap();
    for ch in tree.file_chunks(cino).unwrap().1 {
        drop(env.cache.get(ch).unwrap());
    }
    let mnt = env.path("mnt");
    fs::create_dir(&mnt).unwrap();
    let m = fuse::mount(tree, env.cache.clone(), &mnt, true).unwrap();
    let _g = MountGuard(mnt.clone());
    let s0 = env.cache.snapshot();
    assert_eq!(fs::read(mnt.join("a")).unwrap(), a);
    assert_eq!(fs::read(mnt.join("c")).unwrap(), c);
    assert_eq!(fs::read(mnt.join("b")).unwrap(), b);
    assert_eq!(env.cache.snapshot().passthrough_opens, s0.passthrough_opens);
    // Read again: everything is recorded, so passing through loses nothing.
    assert_eq!(fs::read(mnt.join("a")).unwrap(), a);
    assert_eq!(fs::read(mnt.join("c")).unwrap(), c);
    let passed = env.cache.snapshot().passthrough_opens - s0.passthrough_opens;
    let list = prefetch::HotList::from_mount(&m);
    m.unmount();
    let want: Vec<(String, u64)> = [("a", 0), ("c", 0), ("b", 0), ("b", CS), ("b", 2 * CS)]
        .into_iter()
        .map(|(p, o)| (p.to_string(), o as u64))
        .collect();
    assert_eq!(list.entries, want);
    if passed == 0 {
        eprintln!("SKIPPED (in part): this kernel does not pass FUSE files through");
    } else {
        assert_eq!(passed, 2);
    }
}

#[test]
fn flat_copies_survive_a_cache_restart_and_bad_ones_are_dropped() {
    let env = env(u64::MAX);
    let data = pseudo_random(4 * CS + 9, 30);
    let other = pseudo_random(3 * CS, 31);
    let id = env.import(Tar::new().file("f", &data).file("g", &other).bytes());
    let tree = env.cache.compose(&[id]).unwrap();
    let chunks = |p: &str| {
        tree.file_chunks(tree.resolve(p).unwrap())
            .unwrap()
            .1
            .to_vec()
    };
    let (fc, gc) = (chunks("f"), chunks("g"));
    // Not all chunks cached: no flat copy.
    assert!(!env.cache.build_flat_in_background(&fc));
    for c in fc.iter().chain(&gc) {
        drop(env.cache.get(c).unwrap());
    }
    let chunk_bytes = env.cache.snapshot().used_bytes;
    for cs in [&fc, &gc] {
        // One build at a time: the first may still be finishing when the second starts.
        let t = Instant::now();
        while !env.cache.build_flat_in_background(cs) {
            assert!(t.elapsed() < Duration::from_secs(20));
            std::thread::sleep(Duration::from_millis(10));
        }
        while !env.cache.has_flat(cs) {
            assert!(t.elapsed() < Duration::from_secs(20));
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    assert!(!env.cache.build_flat_in_background(&fc), "built twice");
    let s = env.cache.snapshot();
    assert_eq!(s.flat_files, 2);
    assert_eq!(
        s.used_bytes,
        chunk_bytes + (data.len() + other.len()) as u64
    );
    let mut backing = env.cache.backing_file(&fc).unwrap();
    let mut got = Vec::new();
    backing.read_to_end(&mut got).unwrap();
    assert!(got == data);
    env.cache.persist().unwrap();
    let record = fs::read_to_string(env.path("cache/lru.record")).unwrap();
    assert!(record.contains(&format!("flat/{}", NodeCache::flat_id(&fc).hex())));

    // Restart: both flat copies come back, accounted; a stray name in flat/ is ignored.
    fs::write(env.path("cache/flat/not-a-digest"), b"junk").unwrap();
    let again = NodeCache::open(env.path("cache"), env.store.clone(), u64::MAX).unwrap();
    let s2 = again.snapshot();
    assert_eq!(
        (s2.flat_files, s2.used_bytes, s2.chunks),
        (2, s.used_bytes, s.chunks)
    );
    assert!(again.has_flat(&fc) && again.has_flat(&gc));
    // A flat copy cut short (a crash before its data reached the disk) is never served:
    // dropped from the cache and the accounting.
    let gpath = env.path("cache/flat").join(NodeCache::flat_id(&gc).hex());
    fs::write(&gpath, &other[..100]).unwrap();
    assert!(again.backing_file(&gc).is_none());
    assert!(!again.has_flat(&gc));
    assert!(!gpath.exists());
    assert_eq!(
        again.snapshot().used_bytes,
        s.used_bytes - other.len() as u64
    );
    drop(again);

    // A smaller cap on restart evicts in LRU order; flat copies count like chunks.
    let small = NodeCache::open(env.path("cache"), env.store.clone(), data.len() as u64).unwrap();
    let s3 = small.snapshot();
    assert!(s3.used_bytes <= data.len() as u64, "{s3:?}");
    let on_disk: u64 = ["chunks", "flat"]
        .iter()
        .flat_map(|d| fs::read_dir(env.path(&format!("cache/{d}"))).unwrap())
        .map(|e| e.unwrap())
        .filter(|e| Digest::parse(e.file_name().to_str().unwrap()).is_ok())
        .map(|e| e.metadata().unwrap().len())
        .sum();
    assert_eq!(
        on_disk, s3.used_bytes,
        "accounting matches the files on disk"
    );
}

#[test]
fn flat_id_is_not_the_digest_of_any_chunk_list_bytes_collision() {
    // A chunk whose bytes are exactly a chunk list must not be taken for that list's flat
    // copy: the two live in separate namespaces (chunks/ vs flat/).
    let env = env(u64::MAX);
    let a = pseudo_random(CS, 40);
    let b = pseudo_random(CS, 41);
    let id = env.import(
        Tar::new()
            .file("ab", &[a.clone(), b.clone()].concat())
            .bytes(),
    );
    let tree = env.cache.compose(&[id]).unwrap();
    let chunks = tree
        .file_chunks(tree.resolve("ab").unwrap())
        .unwrap()
        .1
        .to_vec();
    let list: Vec<u8> = chunks.iter().flat_map(|c| c.digest.0).collect();
    let evil = ChunkRef {
        digest: env.store.put_chunk(&list).unwrap(),
        len: list.len() as u32,
    };
    assert_eq!(evil.digest, NodeCache::flat_id(&chunks));
    drop(env.cache.get(&evil).unwrap());
    assert!(!env.cache.has_flat(&chunks));
    assert!(env.cache.backing_file(&chunks).is_none());
    // And the one-chunk file made of `evil` is backed by its chunk file.
    let mut got = Vec::new();
    env.cache
        .backing_file(std::slice::from_ref(&evil))
        .unwrap()
        .read_to_end(&mut got)
        .unwrap();
    assert_eq!(got, list);
}

#[test]
fn passthrough_works_under_an_overlayfs_sandbox_root() {
    if !can_mount() {
        return;
    }
    let env = env(u64::MAX);
    let multi = pseudo_random(4 * CS + 50, 50);
    let busybox = fs::read("/bin/busybox").ok();
    let mut tar = Tar::new()
        .file("multi", &multi)
        .file("single", b"one chunk");
    if let Some(b) = &busybox {
        tar = tar.file_owned("busybox", b, 0o755, 0, 0);
    }
    let id = env.import(tar.bytes());
    let dir = env.path("sb");
    let sb =
        dsec_layerfs::sandbox::SandboxRoot::mount(env.cache.clone(), &[id], &dir, false).unwrap();
    // Fields drop in order: the overlay first, then the FUSE lower under it.
    let _g = (MountGuard(dir.join("root")), MountGuard(dir.join("lower")));
    let root = sb.root();
    if !can_passthrough(&env, &root) {
        sb.unmount().unwrap();
        return;
    }
    assert_eq!(fs::read(root.join("multi")).unwrap(), multi);
    let tree = env.cache.compose(&[id]).unwrap();
    let chunks = tree
        .file_chunks(tree.resolve("multi").unwrap())
        .unwrap()
        .1
        .to_vec();
    let t = Instant::now();
    while !env.cache.has_flat(&chunks) {
        assert!(t.elapsed() < Duration::from_secs(20));
        std::thread::sleep(Duration::from_millis(20));
    }
    let s0 = env.cache.snapshot();
    assert_eq!(fs::read(root.join("multi")).unwrap(), multi);
    let file = fs::File::open(root.join("multi")).unwrap();
    assert!(map(&file, multi.len()) == multi, "mapped through overlayfs");
    drop(file);
    let s1 = env.cache.snapshot();
    assert!(s1.passthrough_opens > s0.passthrough_opens);
    assert_eq!(s1.daemon_reads, s0.daemon_reads);
    if busybox.is_some() {
        // Warm, then run it through the overlay.
        drop(fs::read(root.join("busybox")).unwrap());
        let chunks = tree
            .file_chunks(tree.resolve("busybox").unwrap())
            .unwrap()
            .1
            .to_vec();
        while chunks.len() > 1 && !env.cache.has_flat(&chunks) {
            assert!(t.elapsed() < Duration::from_secs(30));
            std::thread::sleep(Duration::from_millis(20));
        }
        let s2 = env.cache.snapshot();
        let out = std::process::Command::new(root.join("busybox"))
            .args(["echo", "via-overlay"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        assert_eq!(out.stdout, b"via-overlay\n");
        assert!(env.cache.snapshot().passthrough_opens > s2.passthrough_opens);
    }
    sb.unmount().unwrap();
}
