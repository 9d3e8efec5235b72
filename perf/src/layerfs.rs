//! `dsec-perf layerfs`: the layerfs image path on this machine, through the library API.
//! The benchmark image (the cached Debian debootstrap image of `debian.rs`, else one staged
//! from the host's own files, `stage.rs`) is imported once into a fresh store; then (1) from an empty node cache to the first command done in the image, lazy
//! (FUSE mount, chunks fetched on demand) against eager (every chunk fetched and the tree
//! extracted, as pull + extract in a plain OCI runtime), and (2) warm re-reads through the
//! FUSE view against the same files extracted on the host's disk, the page cache dropped
//! before every measurement. Needs root (drop_caches, FUSE with allow_other, chroot).

use std::collections::BTreeMap;
use std::fs;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Instant;

use dsec_layerfs::build::{build_from_dir, DirMode};
use dsec_layerfs::cache::NodeCache;
use dsec_layerfs::index::LayerIndex;
use dsec_layerfs::store::{Store, StoreConfig};
use dsec_layerfs::{fuse, overlay, Digest};
use serde_json::{json, Value};

use crate::report::{detail, goal, goal_line, metric, Bound, Contender, Sample, Scenario};
use crate::stage::{self, Staged, PYTHON};
use crate::stats::ratio;

/// Which benchmark image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageChoice {
    /// The Debian image (built and cached if absent), else the host's files with a message.
    Auto,
    /// The Debian image or an error.
    Debian,
    /// Staged from the host's files.
    Host,
}

impl std::str::FromStr for ImageChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(ImageChoice::Auto),
            "debian" => Ok(ImageChoice::Debian),
            "host" => Ok(ImageChoice::Host),
            _ => Err(format!("unknown image {s:?}: use auto, debian or host")),
        }
    }
}

#[derive(Debug, Clone)]
pub struct LayerfsOpts {
    pub image: ImageChoice,
    /// Samples per contender in both scenarios.
    pub samples: usize,
    /// Byte budget of a host-staged image beyond what the first command needs.
    pub image_bytes: u64,
    /// Random 4 KiB reads per sample.
    pub random_reads: usize,
    /// Scratch directory (empty; on the filesystem of /usr for hard links).
    pub workdir: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error(
        "the layerfs benchmark needs root (drop_caches, a FUSE mount with allow_other, \
         chroot): run it with sudo"
    )]
    NotRoot,
    #[error("{0} is missing: load the fuse module (modprobe fuse) or run where /dev/fuse exists")]
    NoFuse(&'static str),
    #[error("the staged image has no regular file: raise --image-mib")]
    NoFiles,
    #[error(
        "{0}; the benchmark drops the page cache before every measurement: run it as root \
         where /proc/sys/vm/drop_caches is writable"
    )]
    DropCaches(String),
    #[error(transparent)]
    Stage(#[from] stage::StageError),
    #[error(transparent)]
    Debian(#[from] crate::debian::DebianError),
    #[error("{what}: {source}")]
    Layerfs {
        what: &'static str,
        #[source]
        source: dsec_layerfs::Error,
    },
}

pub struct Results {
    pub import: Scenario,
    pub cold: Scenario,
    pub warm: Scenario,
    /// What was staged and imported, for the JSON.
    pub image: Value,
}

fn contender(name: &str, description: &str, command: String) -> Contender {
    Contender {
        name: name.into(),
        description: description.into(),
        command,
    }
}

pub fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// `part` as a percentage of `total`, `None` for an empty total.
pub fn percent(part: u64, total: u64) -> Option<f64> {
    (total > 0).then(|| 100.0 * part as f64 / total as f64)
}

/// Writes back dirty data, then drops the kernel's page, dentry and inode caches, so the
/// next read comes from the disk (or, through FUSE, from the daemon).
fn drop_caches() -> Result<(), String> {
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe { libc::sync() };
    fs::write("/proc/sys/vm/drop_caches", "3")
        .map_err(|e| format!("dropping the page cache (/proc/sys/vm/drop_caches): {e}"))
}

/// Waits (up to a minute) for the flat copies a FUSE release started: a background copy
/// of the largest file must not run into the next timed measurement.
fn settle(cache: &NodeCache) {
    let t = Instant::now();
    while cache.flat_builds_in_flight() > 0 && t.elapsed().as_secs() < 60 {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Reads `p` start to end in 1 MiB reads: (bytes, seconds).
fn seq_read(p: &Path) -> Result<(u64, f64), String> {
    let mut f = fs::File::open(p).map_err(|e| format!("open {}: {e}", p.display()))?;
    let mut buf = vec![0u8; 1 << 20];
    let t = Instant::now();
    let mut n = 0u64;
    loop {
        let k = f
            .read(&mut buf)
            .map_err(|e| format!("read {}: {e}", p.display()))?;
        if k == 0 {
            break;
        }
        n += k as u64;
    }
    Ok((n, t.elapsed().as_secs_f64()))
}

/// `count` 4 KiB-aligned offsets of whole 4 KiB blocks inside a file of `len` bytes, from a
/// fixed xorshift sequence (the same for every contender and sample).
pub fn random_offsets(len: u64, count: usize) -> Vec<u64> {
    let blocks = len / 4096;
    if blocks == 0 {
        return Vec::new();
    }
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    (0..count)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % blocks) * 4096
        })
        .collect()
}

/// Seconds for `count` random 4 KiB reads of `p`.
fn random_read(p: &Path, count: usize) -> Result<f64, String> {
    let f = fs::File::open(p).map_err(|e| format!("open {}: {e}", p.display()))?;
    let len = f
        .metadata()
        .map_err(|e| format!("stat {}: {e}", p.display()))?
        .len();
    let offsets = random_offsets(len, count);
    if offsets.is_empty() {
        return Err(format!("{} is smaller than 4 KiB", p.display()));
    }
    let mut buf = vec![0u8; 4096];
    let t = Instant::now();
    for off in offsets {
        f.read_exact_at(&mut buf, off)
            .map_err(|e| format!("read {} at {off}: {e}", p.display()))?;
    }
    Ok(t.elapsed().as_secs_f64())
}

/// Seconds for `tar cf - -C ROOT SUB | cat > /dev/null` (no shell: tar's stdout is cat's
/// stdin, so tar really writes every byte into a pipe).
fn tar_time(root: &Path, sub: &str) -> Result<f64, String> {
    let t = Instant::now();
    let mut tar = Command::new("tar")
        .args(["cf", "-", "-C"])
        .arg(root)
        .arg(sub)
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run tar: {e}"))?;
    let pipe = tar.stdout.take().expect("stdout is piped");
    let cat = Command::new("cat")
        .stdin(pipe)
        .stdout(Stdio::null())
        .status();
    let tar_status = tar.wait().map_err(|e| format!("waiting for tar: {e}"))?;
    let cat_status = cat.map_err(|e| format!("cannot run cat: {e}"))?;
    if !tar_status.success() || !cat_status.success() {
        return Err(format!(
            "tar cf - -C {} {sub} | cat: tar {tar_status}, cat {cat_status}",
            root.display()
        ));
    }
    Ok(t.elapsed().as_secs_f64())
}

/// Name of a filesystem type from its statfs magic (for the method text).
pub fn fs_name(magic: i64) -> &'static str {
    match magic {
        0xEF53 => "ext2/3/4",
        0x0102_1994 => "tmpfs",
        0x5846_5342 => "xfs",
        0x9123_683E => "btrfs",
        0x794C_7630 => "overlayfs",
        0x6573_5546 => "fuse",
        0x6969 => "nfs",
        _ => "other",
    }
}

fn fs_of(path: &Path) -> &'static str {
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) else {
        return "unknown";
    };
    // SAFETY: statfs is plain old data, valid when zeroed.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: c is a NUL-terminated path, st a valid out-pointer for the call.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return "unknown";
    }
    #[allow(clippy::unnecessary_cast)] // f_type's width differs between libcs
    fs_name(st.f_type as i64)
}

fn layerfs_err(what: &'static str) -> impl FnOnce(dsec_layerfs::Error) -> BenchError {
    move |source| BenchError::Layerfs { what, source }
}

pub fn check_prerequisites() -> Result<(), BenchError> {
    // SAFETY: geteuid has no arguments and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Err(BenchError::NotRoot);
    }
    if !Path::new("/dev/fuse").exists() {
        return Err(BenchError::NoFuse("/dev/fuse"));
    }
    Ok(())
}

/// The imported image.
struct Image {
    store: Arc<Store>,
    id: Digest,
    index: LayerIndex,
    staged: Staged,
    /// The largest file (path in the image, bytes): the sequential and random read target.
    big: (String, u64),
}

fn import(o: &LayerfsOpts) -> Result<(Image, Scenario), BenchError> {
    let t = Instant::now();
    let host = || stage::stage(&o.workdir.join("stage"), o.image_bytes);
    let staged = match o.image {
        ImageChoice::Host => host()?,
        ImageChoice::Debian => stage::debian(crate::debian::ensure()?)?,
        ImageChoice::Auto => match crate::debian::ensure() {
            Ok(d) => stage::debian(d)?,
            Err(e) => {
                eprintln!(
                    "dsec-perf: no Debian benchmark image: {e}\n\
                     dsec-perf: FALLING BACK to an image staged from this host's own files \
                     (not the Debian image; figures are not comparable)"
                );
                host()?
            }
        },
    };
    let stage_s = t.elapsed().as_secs_f64();
    match &staged.debian {
        Some(d) => eprintln!(
            "dsec-perf: Debian image {} ({}): {} files, {:.0} MiB; importing",
            d.root.display(),
            d.built_s
                .map(|s| format!("built now in {s:.0} s"))
                .unwrap_or_else(|| "cached".into()),
            staged.files,
            mib(staged.bytes)
        ),
        None => eprintln!(
            "dsec-perf: staged {} files, {:.0} MiB from this host in {stage_s:.1} s; importing",
            staged.files,
            mib(staged.bytes)
        ),
    }
    let store = Arc::new(
        Store::open(o.workdir.join("store"), StoreConfig::default())
            .map_err(layerfs_err("creating the store"))?,
    );
    drop_caches().map_err(BenchError::DropCaches)?;
    let t = Instant::now();
    let (id, index, stats) = build_from_dir(&store, &staged.root, DirMode::Plain)
        .map_err(layerfs_err("importing the staged tree"))?;
    let import_s = t.elapsed().as_secs_f64();
    let big = index
        .largest_file()
        .map(|(p, s)| (p.to_string(), s))
        .ok_or(BenchError::NoFiles)?;
    let mut digests = std::collections::HashSet::new();
    for e in &index.entries {
        if let dsec_layerfs::index::Kind::File { chunks, .. } = &e.kind {
            digests.extend(chunks.iter().map(|c| c.digest));
        }
    }
    let stored: u64 = digests
        .iter()
        .filter_map(|d| store.chunk_stored_len(d))
        .sum();
    let values: BTreeMap<&'static str, f64> = [
        ("stage_s", stage_s),
        ("import_s", import_s),
        ("entries", index.entries.len() as f64),
        ("file_mib", mib(index.total_file_bytes())),
        ("chunk_mib", mib(index.distinct_chunk_bytes())),
        ("stored_mib", mib(stored)),
        ("chunks", digests.len() as f64),
        ("import_mib_s", mib(index.total_file_bytes()) / import_s),
    ]
    .into_iter()
    .collect();
    let sources: Vec<String> = staged
        .sources
        .iter()
        .filter(|src| src.dir != "/etc")
        .map(ToString::to_string)
        .collect();
    let what = match &staged.debian {
        Some(d) => format!(
            "the Debian image `{}` (cached in {}{})",
            d.key,
            d.root.display(),
            d.built_s
                .map(|s| format!(", built by this run in {s:.0} s"))
                .unwrap_or_default()
        ),
        None => format!(
            "a root tree staged from THIS HOST's own files (NOT the Debian image, which was \
             unavailable): hard links to {}, in that order, cut at a budget of {:.0} MiB \
             (what the first command needs always goes in), a copy of /etc, the merged-/usr \
             symlinks ({} files copied in all)",
            sources.join(", "),
            mib(o.image_bytes),
            staged.copied,
        ),
    };
    let sc = Scenario {
        name: "import",
        title: "layerfs: the image, imported once into a fresh store".into(),
        method: format!(
            "{what}; imported with \
             build_from_dir into a new store in {} ({}; {} KiB chunks, zstd where it \
             saves > 1/9), page cache dropped first. {} new chunks of {}",
            o.workdir.join("store").display(),
            fs_of(&o.workdir),
            index.chunk_size / 1024,
            stats.new_chunks,
            stats.chunks,
        ),
        metrics: vec![
            detail("stage_s", "stage or check image", "s"),
            detail("import_s", "import", "s"),
            detail("import_mib_s", "import rate, file bytes", "MiB/s"),
            detail("entries", "entries", "count"),
            detail("file_mib", "file bytes", "MiB"),
            detail("chunk_mib", "distinct chunk bytes", "MiB"),
            detail("stored_mib", "stored bytes (after zstd)", "MiB"),
            detail("chunks", "distinct chunks", "count"),
        ],
        contenders: vec![contender(
            "layerfs",
            "import of the staged tree",
            format!("build_from_dir(store, {}, Plain)", staged.root.display()),
        )],
        comparisons: Vec::new(),
        samples: vec![Sample {
            contender: "layerfs".into(),
            index: 0,
            values,
            error: None,
        }],
        skipped: None,
        notes: Vec::new(),
    };
    Ok((
        Image {
            store,
            id,
            index,
            staged,
            big,
        },
        sc,
    ))
}

/// What one eager sample leaves for the warm scenario: its full node cache and the tree.
struct Extracted {
    dir: PathBuf,
    cache: Arc<NodeCache>,
    root: PathBuf,
}

fn lazy_sample(img: &Image, dir: &Path) -> Result<BTreeMap<&'static str, f64>, String> {
    let (cache_dir, mnt) = (dir.join("cache"), dir.join("mnt"));
    fs::create_dir_all(&mnt).map_err(|e| format!("create {}: {e}", mnt.display()))?;
    drop_caches()?;
    let t = Instant::now();
    let cache = Arc::new(
        NodeCache::open(&cache_dir, img.store.clone(), u64::MAX).map_err(|e| e.to_string())?,
    );
    let tree = Arc::new(cache.compose(&[img.id]).map_err(|e| e.to_string())?);
    let m = fuse::mount(tree, cache.clone(), &mnt, false).map_err(|e| e.to_string())?;
    let ready = t.elapsed().as_secs_f64();
    stage::run_first_command(&mnt, img.staged.first_imports)?;
    let done = t.elapsed().as_secs_f64();
    let fetched = cache.snapshot().fetched_bytes;
    // Then the largest file, straight from the store (read + verify + cache write).
    settle(&cache);
    drop_caches()?;
    let (n, cold_s) = seq_read(&mnt.join(&img.big.0))?;
    settle(&cache);
    m.unmount();
    let total = img.index.distinct_chunk_bytes();
    Ok([
        ("ready_s", ready),
        ("first_cmd_s", done),
        ("fetched_mib", mib(fetched)),
        ("fetched_pct", percent(fetched, total).unwrap_or(f64::NAN)),
        ("cold_seq_mib_s", mib(n) / cold_s),
    ]
    .into_iter()
    .collect())
}

fn eager_sample(
    img: &Image,
    dir: &Path,
) -> Result<(BTreeMap<&'static str, f64>, Extracted), String> {
    let (cache_dir, root) = (dir.join("cache"), dir.join("root"));
    fs::create_dir_all(dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
    drop_caches()?;
    let t = Instant::now();
    let cache = Arc::new(
        NodeCache::open(&cache_dir, img.store.clone(), u64::MAX).map_err(|e| e.to_string())?,
    );
    let index = cache.layer(&img.id).map_err(|e| e.to_string())?;
    overlay::export_overlay_dir(&cache, &index, &root).map_err(|e| e.to_string())?;
    let ready = t.elapsed().as_secs_f64();
    stage::run_first_command(&root, img.staged.first_imports)?;
    let done = t.elapsed().as_secs_f64();
    let fetched = cache.snapshot().fetched_bytes;
    let values = [
        ("ready_s", ready),
        ("first_cmd_s", done),
        ("fetched_mib", mib(fetched)),
        (
            "fetched_pct",
            percent(fetched, img.index.distinct_chunk_bytes()).unwrap_or(f64::NAN),
        ),
    ]
    .into_iter()
    .collect();
    Ok((
        values,
        Extracted {
            dir: dir.to_path_buf(),
            cache,
            root,
        },
    ))
}

/// Contender order of round `i`: the first one rotates, so neither always runs first.
pub fn round_order<T: Copy>(items: &[T], i: usize) -> Vec<T> {
    let n = items.len();
    (0..n).map(|k| items[(i + k) % n.max(1)]).collect()
}

fn cold(o: &LayerfsOpts, img: &Image) -> (Scenario, Option<Extracted>) {
    let cmd = format!(
        "chroot ROOT {PYTHON} -c {:?}",
        stage::first_cmd(img.staged.first_imports)
    );
    let mut sc = Scenario {
        name: "cold",
        title: "layerfs: empty node cache -> first command done in the image".into(),
        method: format!(
            "per sample a new empty node cache, page cache dropped, then timed from opening \
             the cache: lazy = compose + FUSE mount + `{cmd}` (chunks fetched on demand); \
             eager = fetch every chunk into the cache + extract the tree to the local disk \
             (like pull + extract of a plain OCI runtime) + the same command. Then (lazy \
             only, not in the times) the largest file {} ({:.0} MiB) read cold from the \
             store. The store is on local disk, so a fetch is a local read + verify + \
             decompress, not a network transfer. Contenders alternate, the first rotating",
            img.big.0,
            mib(img.big.1)
        ),
        metrics: vec![
            metric("first_cmd_s", "empty cache -> cmd done", "s"),
            metric("ready_s", "-> mounted / extracted", "s"),
            metric("fetched_mib", "fetched from the store", "MiB"),
            detail("fetched_pct", "fetched / image chunks", "%"),
            detail("cold_seq_mib_s", "then cold seq read", "MiB/s"),
        ],
        contenders: vec![
            contender(
                "lazy",
                "FUSE mount, chunks fetched on demand",
                format!("NodeCache::open + compose + fuse::mount; {cmd}"),
            ),
            contender(
                "eager",
                "fetch all + extract, then run",
                format!("NodeCache::open + layer + export_overlay_dir; {cmd}"),
            ),
        ],
        comparisons: vec![("lazy".into(), "eager".into())],
        samples: Vec::new(),
        skipped: None,
        notes: Vec::new(),
    };
    let mut kept: Option<Extracted> = None;
    for i in 0..o.samples {
        for c in round_order(&["lazy", "eager"], i) {
            let dir = o.workdir.join(format!("cold-{c}-{i}"));
            eprintln!("dsec-perf: cold {c} #{i}");
            let (values, error) = if c == "lazy" {
                let r = lazy_sample(img, &dir);
                let _ = fs::remove_dir_all(&dir);
                match r {
                    Ok(v) => (v, None),
                    Err(e) => (BTreeMap::new(), Some(e)),
                }
            } else {
                match eager_sample(img, &dir) {
                    Ok((v, ex)) => {
                        // Keep the newest extraction for the warm scenario.
                        if let Some(old) = kept.replace(ex) {
                            let _ = fs::remove_dir_all(&old.dir);
                        }
                        (v, None)
                    }
                    Err(e) => {
                        let _ = fs::remove_dir_all(&dir);
                        (BTreeMap::new(), Some(e))
                    }
                }
            };
            sc.samples.push(Sample {
                contender: c.into(),
                index: i,
                values,
                error,
            });
        }
    }
    let p50 = |c: &str, m: &str| sc.summary(c, m).map(|s| s.p50);
    let goals = [
        goal_line(
            "lazy: empty cache -> first command done p50",
            p50("lazy", "first_cmd_s"),
            1.0,
            "s",
        ),
        goal_line(
            "lazy: bytes fetched / image p50",
            p50("lazy", "fetched_pct"),
            10.0,
            "%",
        ),
    ];
    sc.notes.extend(goals);
    (sc, kept)
}

fn warm(o: &LayerfsOpts, img: &Image, ex: Option<&Extracted>) -> Scenario {
    let stdlib = &img.staged.python_stdlib;
    let big = &img.big.0;
    let mut sc = Scenario {
        name: "warm",
        title: "layerfs: warm re-reads, FUSE view vs the same files on the host's disk".into(),
        method: format!(
            "node cache full (the last eager sample's), so no store access; `native` is \
             the tree that sample extracted ({}). Per round and test the contenders run \
             back to back, the first rotating, each after dropping the page cache: \
             sequential 1 MiB reads of the largest file {big} ({:.0} MiB), then the same \
             again with the page cache warm; {} random 4 KiB reads of it; \
             `tar cf - -C ROOT {stdlib} | cat > /dev/null`",
            ex.map(|e| fs_of(&e.root)).unwrap_or("?"),
            mib(img.big.1),
            o.random_reads,
        ),
        metrics: vec![
            metric("seq_s", "seq read, cache dropped", "s"),
            detail("seq_mib_s", "  seq throughput", "MiB/s"),
            metric("hot_seq_s", "seq re-read, cache warm", "s"),
            detail("hot_seq_mib_s", "  re-read throughput", "MiB/s"),
            metric("rand_s", "random 4K reads, dropped", "s"),
            metric("tar_s", "tar | cat, cache dropped", "s"),
        ],
        contenders: vec![
            contender(
                "layerfs",
                "FUSE view of the image, node cache warm",
                "compose + fuse::mount of the full node cache".into(),
            ),
            contender(
                "native",
                "the extracted tree on the host's disk",
                "the eager sample's export_overlay_dir output".into(),
            ),
        ],
        comparisons: vec![("layerfs".into(), "native".into())],
        samples: Vec::new(),
        skipped: None,
        notes: Vec::new(),
    };
    let Some(ex) = ex else {
        sc.skipped = Some("no eager sample succeeded, so there is no full cache or tree".into());
        return sc;
    };
    let mnt = o.workdir.join("warm-mnt");
    let mounted = fs::create_dir_all(&mnt)
        .map_err(|e| e.to_string())
        .and_then(|_| ex.cache.compose(&[img.id]).map_err(|e| e.to_string()))
        .and_then(|tree| {
            fuse::mount(Arc::new(tree), ex.cache.clone(), &mnt, false).map_err(|e| e.to_string())
        });
    let m = match mounted {
        Ok(m) => m,
        Err(e) => {
            sc.skipped = Some(format!("mounting the warm cache at {}: {e}", mnt.display()));
            return sc;
        }
    };
    let before = ex.cache.snapshot();
    let fetched_before = before.fetched_bytes;
    let roots: [(&str, &Path); 2] = [("layerfs", &mnt), ("native", &ex.root)];
    for i in 0..o.samples {
        eprintln!("dsec-perf: warm round {i}");
        let order = round_order(&roots, i);
        let mut values: BTreeMap<&str, BTreeMap<&'static str, f64>> = BTreeMap::new();
        let mut errors: BTreeMap<&str, String> = BTreeMap::new();
        type Test<'a> = Box<dyn Fn(&Path) -> Result<Vec<(&'static str, f64)>, String> + 'a>;
        let tests: Vec<Test> = vec![
            Box::new(|root| {
                let p = root.join(big);
                let (n, s) = seq_read(&p)?;
                let (_, hot) = seq_read(&p)?;
                Ok(vec![
                    ("seq_s", s),
                    ("seq_mib_s", mib(n) / s),
                    ("hot_seq_s", hot),
                    ("hot_seq_mib_s", mib(n) / hot),
                ])
            }),
            Box::new(|root| {
                Ok(vec![(
                    "rand_s",
                    random_read(&root.join(big), o.random_reads)?,
                )])
            }),
            Box::new(|root| Ok(vec![("tar_s", tar_time(root, stdlib)?)])),
        ];
        for test in &tests {
            for (name, root) in &order {
                if errors.contains_key(name) {
                    continue;
                }
                settle(&ex.cache);
                match drop_caches().and_then(|_| test(root)) {
                    Ok(v) => values.entry(name).or_default().extend(v),
                    Err(e) => {
                        errors.insert(name, e);
                    }
                }
            }
        }
        for (name, _) in &roots {
            sc.samples.push(Sample {
                contender: (*name).into(),
                index: i,
                values: values.remove(name).unwrap_or_default(),
                error: errors.remove(name),
            });
        }
    }
    let after = ex.cache.snapshot();
    let fetched = after.fetched_bytes - fetched_before;
    m.unmount();
    sc.notes.push(format!(
        "store fetches during the warm rounds: {:.1} MiB (0 expected: the node cache is full)",
        mib(fetched)
    ));
    // A multi-chunk file passes through once it has a flat copy, built when a read
    // through the daemon releases it: so not in the first round.
    sc.notes.push(format!(
        "layerfs during the warm rounds: {} opens passed through (FUSE passthrough), {} \
         reads answered by the daemon, {} flat copies built",
        after.passthrough_opens - before.passthrough_opens,
        after.daemon_reads - before.daemon_reads,
        after.flat_builds - before.flat_builds,
    ));
    let p50 = |c: &str, m: &str| sc.summary(c, m).map(|s| s.p50);
    let goals = [
        goal(
            "layerfs/native sequential throughput, page cache dropped (p50 times)",
            ratio(p50("native", "seq_s"), p50("layerfs", "seq_s")),
            Bound::AtLeast,
            0.75,
            "x",
        ),
        goal(
            "layerfs/native small-file tar time p50",
            ratio(p50("layerfs", "tar_s"), p50("native", "tar_s")),
            Bound::AtMost,
            2.0,
            "x",
        ),
    ];
    sc.notes.extend(goals);
    sc
}

/// Runs everything in `o.workdir` (an empty directory the caller made and removes after).
/// Leaves no mount behind, also on errors: every mount unmounts when dropped.
pub fn bench(o: &LayerfsOpts) -> Result<Results, BenchError> {
    let (img, import_sc) = import(o)?;
    let (cold_sc, extracted) = cold(o, &img);
    let warm_sc = warm(o, &img, extracted.as_ref());
    let image = json!({
        "debian": img.staged.debian.as_ref().map(|d| json!({
            "key": d.key, "dir": d.root, "built_s": d.built_s,
        })),
        "first_imports": img.staged.first_imports,
        "staged_files": img.staged.files,
        "staged_bytes": img.staged.bytes,
        "copied_files": img.staged.copied,
        "sources": img.staged.sources.iter()
            .map(|s| json!({"dir": s.dir, "whole": s.whole, "files": s.files}))
            .collect::<Vec<_>>(),
        "python_stdlib": img.staged.python_stdlib,
        "largest_file": {"path": img.big.0, "bytes": img.big.1},
        "layer": img.id.to_string(),
        "workdir_fs": fs_of(&o.workdir),
    });
    Ok(Results {
        import: import_sc,
        cold: cold_sc,
        warm: warm_sc,
        image,
    })
}

/// `explicit`, else the `--quick` value, else the default.
pub fn pick<T>(explicit: Option<T>, quick: bool, quick_value: T, default: T) -> T {
    explicit.unwrap_or(if quick { quick_value } else { default })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percent_and_mib() {
        assert_eq!(percent(1, 4), Some(25.0));
        assert_eq!(percent(0, 0), None);
        assert_eq!(mib(3 << 20), 3.0);
    }

    #[test]
    fn random_offsets_are_aligned_inside_and_repeatable() {
        let len = 10 * 4096 + 100;
        let a = random_offsets(len, 1000);
        assert_eq!(a.len(), 1000);
        assert!(a.iter().all(|o| o % 4096 == 0 && o + 4096 <= len));
        // Spread over the file, not stuck on a few blocks.
        let distinct: std::collections::HashSet<_> = a.iter().collect();
        assert_eq!(distinct.len(), 10);
        assert_eq!(a, random_offsets(len, 1000));
        assert!(random_offsets(4095, 10).is_empty());
        assert_eq!(random_offsets(4096, 3), vec![0, 0, 0]);
    }

    #[test]
    fn rounds_rotate_the_first_contender() {
        assert_eq!(round_order(&["a", "b"], 0), ["a", "b"]);
        assert_eq!(round_order(&["a", "b"], 1), ["b", "a"]);
        assert_eq!(round_order(&["a", "b", "c"], 4), ["b", "c", "a"]);
        assert!(round_order::<u8>(&[], 3).is_empty());
    }

    #[test]
    fn image_choice_parses_and_rejects_unknown() {
        assert_eq!("auto".parse(), Ok(ImageChoice::Auto));
        assert_eq!("debian".parse(), Ok(ImageChoice::Debian));
        assert_eq!("host".parse(), Ok(ImageChoice::Host));
        let e = "ubuntu".parse::<ImageChoice>().unwrap_err();
        assert!(e.contains("auto, debian or host"), "{e}");
    }

    #[test]
    fn quick_values_only_fill_in() {
        assert_eq!(pick(None, false, 1, 3), 3);
        assert_eq!(pick(None, true, 1, 3), 1);
        assert_eq!(pick(Some(5), true, 1, 3), 5);
    }

    #[test]
    fn filesystem_names() {
        assert_eq!(fs_name(0xEF53), "ext2/3/4");
        assert_eq!(fs_name(0x0102_1994), "tmpfs");
        assert_eq!(fs_name(1), "other");
    }
}
