//! What the `dsec-layerfs` binary and `dsec image` share: where the store and the node
//! cache live, importing an image from any source, describing an image, packing a
//! sandbox's upper dir on top of one, and the text both print for these.
//!
//! Nothing here writes an image record before all of its layers are in the store, so a
//! failed import or pack leaves no image behind; chunks and indexes it already stored are
//! complete, unreferenced objects that the next `gc` (after its grace period) removes.

use std::collections::HashSet;
use std::fmt;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::build::{build_from_dir_with_progress, BuildStats, DirMode};
use crate::cache::NodeCache;
use crate::digest::Digest;
use crate::error::{Error, Result};
use crate::index::Kind;
use crate::oci::{self, Reference};
use crate::overlay::pack_diff_with_progress;
use crate::progress::Progress;
use crate::store::{now_secs, GcReport, ImageRecord, Store};
use crate::tarfmt;

/// Environment variable naming the shared chunk store.
pub const STORE_ENV: &str = "DSEC_LAYERFS_STORE";
/// Environment variable naming this node's chunk cache.
pub const CACHE_ENV: &str = "DSEC_LAYERFS_CACHE";

/// `${DSEC_HOME:-/var/lib/dsec}`, where the rest of DSec keeps installed state.
pub fn dsec_home() -> PathBuf {
    std::env::var_os("DSEC_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/lib/dsec"))
}

/// The store: `flag`, else `$DSEC_LAYERFS_STORE`, else `$DSEC_HOME/layerfs/store`.
pub fn store_dir(flag: Option<&Path>) -> PathBuf {
    location(flag, STORE_ENV, "store")
}

/// The node cache: `flag`, else `$DSEC_LAYERFS_CACHE`, else `$DSEC_HOME/layerfs/cache`.
pub fn cache_dir(flag: Option<&Path>) -> PathBuf {
    location(flag, CACHE_ENV, "cache")
}

fn location(flag: Option<&Path>, env: &str, leaf: &str) -> PathBuf {
    flag.map(Path::to_path_buf)
        .or_else(|| {
            std::env::var_os(env)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        })
        .unwrap_or_else(|| dsec_home().join("layerfs").join(leaf))
}

/// Where an import reads from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ImportSource {
    /// A plain-HTTP registry reference.
    Registry(Reference),
    /// Layer tars (gzip/zstd/plain), bottom first; `-` is standard input.
    Tars(Vec<PathBuf>),
    /// A directory tree, as one layer.
    Dir(PathBuf),
}

impl ImportSource {
    /// Classifies command-line sources: with `dir`, exactly one directory; otherwise one
    /// source that is not an existing file is a registry reference, and everything else
    /// must be existing tar files. Checks every path before any work starts.
    pub fn from_args(sources: &[String], dir: bool) -> Result<ImportSource> {
        let Some(first) = sources.first() else {
            return Err(Error::Invalid(
                "import needs a source: a registry reference (host[:port]/repo[:tag]), \
                 layer tar files, or --dir DIR"
                    .into(),
            ));
        };
        if dir {
            if sources.len() != 1 {
                return Err(Error::Invalid(format!(
                    "--dir takes exactly one directory, got {} sources",
                    sources.len()
                )));
            }
            return Self::from_dir(PathBuf::from(first));
        }
        let is_file = |s: &str| s == "-" || Path::new(s).exists();
        if sources.len() == 1 && !is_file(first) {
            return Reference::parse(first)
                .map(ImportSource::Registry)
                .map_err(|e| {
                    Error::Invalid(format!(
                        "import source {first:?} is not an existing file, and not a registry \
                         reference either: {e}"
                    ))
                });
        }
        if sources.iter().filter(|s| *s == "-").count() > 1 {
            return Err(Error::Invalid(
                "standard input (-) can be given only once".into(),
            ));
        }
        for s in sources.iter().filter(|s| *s != "-") {
            match std::fs::metadata(s) {
                Ok(md) if md.is_dir() => {
                    return Err(Error::Invalid(format!(
                        "{s} is a directory: import a directory tree with --dir {s}"
                    )))
                }
                Ok(_) => {}
                Err(e) => return Err(Error::io("opening layer tar", s, e)),
            }
        }
        Ok(ImportSource::Tars(
            sources.iter().map(PathBuf::from).collect(),
        ))
    }

    /// A directory tree to import, checked to exist and be a directory.
    pub fn from_dir(path: PathBuf) -> Result<ImportSource> {
        let md = std::fs::metadata(&path)
            .map_err(|e| Error::io("reading directory to import", &path, e))?;
        if !md.is_dir() {
            return Err(Error::NotADirectory(path));
        }
        Ok(ImportSource::Dir(path))
    }

    fn kind(&self) -> &'static str {
        match self {
            ImportSource::Registry(_) => "registry",
            ImportSource::Tars(_) => "tar",
            ImportSource::Dir(_) => "dir",
        }
    }
}

/// What an import produced.
#[derive(Clone, Debug, Serialize)]
pub struct ImportReport {
    #[serde(flatten)]
    pub image: ImageRecord,
    /// `registry`, `tar` or `dir`.
    pub source: &'static str,
    /// Bytes read from the sources as given (compressed tars and blobs); 0 for a directory.
    pub source_bytes: u64,
    /// Counters of the layers built (a registry layer the store already had adds nothing).
    #[serde(flatten)]
    pub stats: BuildStats,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub manifest_digest: Option<Digest>,
    /// An image of the same name existed and now points at the new layers.
    pub replaced: bool,
}

/// Imports `source` into the store as image `name` (default: the reference for a
/// registry, `dir-<layer>` for a directory; layer tars need a name).
pub fn import(
    store: &Store,
    source: &ImportSource,
    name: Option<&str>,
    progress: &dyn Progress,
) -> Result<ImportReport> {
    let name = match (name, source) {
        (Some(n), _) => Some(n.to_string()),
        (None, ImportSource::Registry(r)) => Some(r.to_string()),
        (None, ImportSource::Tars(_)) => {
            return Err(Error::Invalid(
                "importing layer tars needs --name NAME".into(),
            ))
        }
        (None, ImportSource::Dir(_)) => None,
    };
    if let Some(n) = &name {
        Store::check_image_name(n)?;
    }
    let replaced = |n: &str| store.get_image(n).is_ok();
    let mut report = ImportReport {
        image: ImageRecord {
            name: String::new(),
            layers: Vec::new(),
            diff_ids: Vec::new(),
            config: None,
            hot_list: None,
            created: now_secs(),
        },
        source: source.kind(),
        source_bytes: 0,
        stats: BuildStats::default(),
        manifest_digest: None,
        replaced: false,
    };
    match source {
        ImportSource::Registry(reference) => {
            let name = name.expect("a registry import always has a name");
            report.replaced = replaced(&name);
            let pulled = oci::pull_with_progress(store, reference, &name, progress)?;
            report.image = pulled.image;
            report.source_bytes = pulled.compressed_bytes;
            report.stats = pulled.stats;
            report.manifest_digest = Some(pulled.manifest_digest);
            // pull wrote the record itself.
            return Ok(report);
        }
        ImportSource::Dir(dir) => {
            progress.layer_started(0, 1, None);
            let (id, _, stats) =
                build_from_dir_with_progress(store, dir, DirMode::Plain, progress)?;
            progress.layer_finished(false);
            report.image.name = name.unwrap_or_else(|| format!("dir-{}", id.short()));
            report.image.layers.push(id);
            report.stats = stats;
        }
        ImportSource::Tars(tars) => {
            report.image.name = name.expect("checked above");
            for (i, tar) in tars.iter().enumerate() {
                let imported =
                    import_one_tar(store, tar, i, tars.len(), progress).map_err(|e| {
                        Error::InTar {
                            path: tar.clone(),
                            source: Box::new(e),
                        }
                    })?;
                progress.layer_finished(false);
                report.image.layers.push(imported.layer);
                report.image.diff_ids.push(imported.diff_id);
                report.source_bytes += imported.blob_size;
                report.stats.add(&imported.stats);
            }
        }
    }
    report.replaced = replaced(&report.image.name);
    store.put_image(&report.image)?;
    Ok(report)
}

/// Imports layer tar `index` of `count` (`-` is standard input).
fn import_one_tar(
    store: &Store,
    tar: &Path,
    index: usize,
    count: usize,
    progress: &dyn Progress,
) -> Result<tarfmt::TarImport> {
    if tar.as_os_str() == "-" {
        progress.layer_started(index, count, None);
        return tarfmt::import_tar_with_progress(store, std::io::stdin().lock(), progress);
    }
    let file = std::fs::File::open(tar).map_err(|e| Error::io("opening layer tar", tar, e))?;
    let size = file.metadata().ok().map(|m| m.len());
    progress.layer_started(index, count, size);
    tarfmt::import_tar_with_progress(store, std::io::BufReader::new(file), progress)
}

/// One layer of an image, as `inspect` shows it.
#[derive(Clone, Debug, Serialize)]
pub struct LayerSummary {
    pub id: Digest,
    pub entries: usize,
    pub whiteouts: usize,
    /// Bytes of file content (each hard-link group once).
    pub file_bytes: u64,
    /// Distinct chunks the layer references.
    pub chunks: u64,
    /// Their size in the store (after compression); chunks missing from the store add 0.
    pub stored_bytes: u64,
    pub chunk_size: u32,
    /// Of `chunks`, how many this node's cache holds (when a cache dir was given).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cached_chunks: Option<u64>,
}

/// An image record with its layers described.
#[derive(Clone, Debug, Serialize)]
pub struct ImageDetails {
    pub image: ImageRecord,
    pub layers: Vec<LayerSummary>,
    /// Sum of the layers' file bytes.
    pub file_bytes: u64,
    /// Store bytes of the distinct chunks of all layers (shared chunks once).
    pub stored_bytes: u64,
}

/// Describes image `name`; with `cache`, also counts the chunks this node has cached
/// (read-only: the cache is looked at, never opened or created).
pub fn inspect(store: &Store, name: &str, cache: Option<&Path>) -> Result<ImageDetails> {
    let image = store.get_image(name)?;
    let mut layers = Vec::new();
    let mut all_chunks = HashSet::new();
    let mut stored_total = 0;
    for id in &image.layers {
        let index = store.get_layer(id)?;
        let mut chunks = HashSet::new();
        for e in &index.entries {
            if let Kind::File { chunks: refs, .. } = &e.kind {
                chunks.extend(refs.iter().map(|c| c.digest));
            }
        }
        let stored = |d: &Digest| store.chunk_stored_len(d).unwrap_or(0);
        let stored_bytes = chunks.iter().map(stored).sum();
        stored_total += chunks
            .iter()
            .filter(|d| all_chunks.insert(**d))
            .map(stored)
            .sum::<u64>();
        layers.push(LayerSummary {
            id: *id,
            entries: index.entries.len(),
            whiteouts: index
                .entries
                .iter()
                .filter(|e| e.kind == Kind::Whiteout)
                .count(),
            file_bytes: index.total_file_bytes(),
            chunks: chunks.len() as u64,
            stored_bytes,
            chunk_size: index.chunk_size,
            cached_chunks: cache.map(|dir| {
                chunks
                    .iter()
                    .filter(|d| NodeCache::cached_chunk_path(dir, d).exists())
                    .count() as u64
            }),
        });
    }
    Ok(ImageDetails {
        file_bytes: layers.iter().map(|l| l.file_bytes).sum(),
        stored_bytes: stored_total,
        image,
        layers,
    })
}

/// What a pack produced.
#[derive(Clone, Debug, Serialize)]
pub struct PackReport {
    #[serde(flatten)]
    pub image: ImageRecord,
    pub base: String,
    /// The new top layer.
    pub layer: Digest,
    #[serde(flatten)]
    pub stats: BuildStats,
    pub replaced: bool,
}

/// Turns `upper` (a stopped sandbox's overlayfs upper dir) into a new layer on top of image
/// `base`, recorded as image `name`. Everything is checked before any chunk is written.
pub fn pack(
    store: &Store,
    upper: &Path,
    base: &str,
    name: &str,
    progress: &dyn Progress,
) -> Result<PackReport> {
    Store::check_image_name(name)?;
    let base_image = store.get_image(base)?;
    let md = std::fs::symlink_metadata(upper)
        .map_err(|e| Error::io("reading upper directory", upper, e))?;
    if !md.is_dir() {
        return Err(Error::NotADirectory(upper.to_path_buf()));
    }
    progress.layer_started(0, 1, None);
    let (layer, _, stats) = pack_diff_with_progress(store, upper, progress)?;
    progress.layer_finished(false);
    let mut layers = base_image.layers.clone();
    layers.push(layer);
    let image = ImageRecord {
        name: name.to_string(),
        layers,
        // The packed layer has no OCI tar yet: diff_ids are computed again at push.
        diff_ids: Vec::new(),
        config: base_image.config,
        hot_list: None,
        created: now_secs(),
    };
    let replaced = store.get_image(name).is_ok();
    store.put_image(&image)?;
    Ok(PackReport {
        image,
        base: base.to_string(),
        layer,
        stats,
        replaced,
    })
}

/// `1536` -> `1.5 KiB`.
pub fn human_bytes(n: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.1} {}", units[u])
}

/// The `ls` table.
pub struct ImageTable<'a>(pub &'a [ImageRecord]);

impl fmt::Display for ImageTable<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:<40} {:>6} {:>12}  TOP LAYER",
            "NAME", "LAYERS", "CREATED"
        )?;
        for i in self.0 {
            write!(
                f,
                "\n{:<40} {:>6} {:>12}  {}",
                i.name,
                i.layers.len(),
                i.created,
                i.layers.last().map(|l| l.short()).unwrap_or_default()
            )?;
        }
        Ok(())
    }
}

impl fmt::Display for ImportReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} layer(s) from {}, {} of files, {} chunks ({} new)",
            self.image.name,
            self.image.layers.len(),
            self.source,
            human_bytes(self.stats.file_bytes),
            self.stats.chunks,
            self.stats.new_chunks
        )?;
        if self.source_bytes > 0 {
            write!(f, ", {} read", human_bytes(self.source_bytes))?;
        }
        if self.replaced {
            write!(f, " (replaced the previous image of that name)")?;
        }
        Ok(())
    }
}

impl fmt::Display for ImageDetails {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "image {}: {} layers, {} of files, {} in the store",
            self.image.name,
            self.layers.len(),
            human_bytes(self.file_bytes),
            human_bytes(self.stored_bytes)
        )?;
        for l in &self.layers {
            write!(
                f,
                "\n  layer {}  {} entries  {}  {} chunks ({} stored)  {} whiteouts",
                l.id.short(),
                l.entries,
                human_bytes(l.file_bytes),
                l.chunks,
                human_bytes(l.stored_bytes),
                l.whiteouts
            )?;
            if let Some(cached) = l.cached_chunks {
                write!(f, "  {cached} cached here")?;
            }
        }
        Ok(())
    }
}

impl fmt::Display for PackReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} + layer {} ({} of files, {} chunks, {} new)",
            self.image.name,
            self.base,
            self.layer.short(),
            human_bytes(self.stats.file_bytes),
            self.stats.chunks,
            self.stats.new_chunks
        )?;
        if self.replaced {
            write!(f, " (replaced the previous image of that name)")?;
        }
        Ok(())
    }
}

impl fmt::Display for GcReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "removed {} layers, {} chunks ({}), {} blobs",
            self.layers_removed,
            self.chunks_removed,
            human_bytes(self.bytes_freed),
            self.blobs_removed
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_are_classified_and_checked_up_front() {
        let dir = tempfile::tempdir().unwrap();
        let tar = dir.path().join("l.tar");
        std::fs::write(&tar, b"").unwrap();
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        assert!(matches!(
            ImportSource::from_args(&s(&["127.0.0.1:5000/lib/busybox:1.36"]), false),
            Ok(ImportSource::Registry(_))
        ));
        assert!(matches!(
            ImportSource::from_args(&s(&[tar.to_str().unwrap()]), false),
            Ok(ImportSource::Tars(_))
        ));
        let dir_arg = dir.path().to_str().unwrap();
        assert!(matches!(
            ImportSource::from_args(&s(&[dir_arg]), true),
            Ok(ImportSource::Dir(_))
        ));
        let e = ImportSource::from_args(&s(&[dir_arg]), false).unwrap_err();
        assert!(e.to_string().contains("--dir"), "{e}");
        let e = ImportSource::from_args(&s(&["busybox"]), false).unwrap_err();
        assert!(e.to_string().contains("not a registry reference"), "{e}");
        let e = ImportSource::from_args(&s(&[tar.to_str().unwrap()]), true).unwrap_err();
        assert!(matches!(e, Error::NotADirectory(_)), "{e}");
        let e = ImportSource::from_args(&s(&[tar.to_str().unwrap(), "/no/such.tar"]), false)
            .unwrap_err();
        assert!(e.to_string().contains("/no/such.tar"), "{e}");
        assert!(ImportSource::from_args(&[], false).is_err());
    }

    #[test]
    fn locations_follow_flag_then_env_then_dsec_home() {
        // Only the flag path: the env is process-wide and other tests run in parallel.
        assert_eq!(
            store_dir(Some(Path::new("/x/store"))),
            PathBuf::from("/x/store")
        );
        assert_eq!(human_bytes(1536), "1.5 KiB");
    }
}
