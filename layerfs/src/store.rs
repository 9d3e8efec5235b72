//! The shared chunk store: a directory (local, or NFS/CephFS/JuiceFS in production) holding
//! content-addressed chunks, layer indexes, OCI config blobs and image records.
//!
//! Layout under the root:
//! ```text
//! chunks/<2 hex>/<64 hex>   one chunk: 1 codec byte (0 raw, 1 zstd) + payload
//! layers/<64 hex>.json      a layer index; its name is the sha256 of the file's bytes
//! blobs/<64 hex>            other blobs by digest (OCI image configs, hot lists)
//! images/<name>.json        image record: ordered layer ids + config
//! diffids/<64 hex>          OCI diff_id -> layer id, to skip layers already imported
//! tmp/                      temporary files, renamed into place when complete
//! ```
//! Every write goes to `tmp/` first and is renamed into place, so a reader on another node
//! never sees a partial object; every read is verified against its digest.

use std::fs::{self, File};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};
use tracing::debug;

use crate::digest::Digest;
use crate::error::{Error, Result};
use crate::index::LayerIndex;

pub const DEFAULT_CHUNK_SIZE: u32 = 1 << 20;
/// Subdirectories every store has.
const STORE_DIRS: [&str; 6] = ["chunks", "layers", "blobs", "images", "diffids", "tmp"];
const CODEC_RAW: u8 = 0;
const CODEC_ZSTD: u8 = 1;

/// How chunks are written. Readers need none of this: each chunk says its own codec.
#[derive(Clone, Debug)]
pub struct StoreConfig {
    /// Fixed chunk size for new layers (bytes, power of two recommended).
    pub chunk_size: u32,
    /// zstd level, or None to store chunks raw.
    pub zstd_level: Option<i32>,
    /// fsync chunk files before renaming them into place (durability on a shared fs).
    pub fsync: bool,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            chunk_size: DEFAULT_CHUNK_SIZE,
            zstd_level: Some(3),
            fsync: false,
        }
    }
}

/// A named image: an ordered list of layers, bottom first.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ImageRecord {
    pub name: String,
    pub layers: Vec<Digest>,
    /// OCI diff_ids (sha256 of each uncompressed layer tar) when imported from OCI.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub diff_ids: Vec<Digest>,
    /// OCI image config blob, kept byte-exact in `blobs/`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<Digest>,
    /// Recorded access order of a first run, in `blobs/` (see prefetch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hot_list: Option<Digest>,
    /// Seconds since the epoch.
    pub created: u64,
}

#[derive(Debug)]
pub struct Store {
    root: PathBuf,
    pub config: StoreConfig,
    tmp_seq: AtomicU64,
}

pub fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl Store {
    /// Opens (creating if needed) a store rooted at `root`.
    pub fn open(root: impl Into<PathBuf>, config: StoreConfig) -> Result<Store> {
        let root = root.into();
        Self::check_config(&config)?;
        if root.exists() && !root.is_dir() {
            return Err(Error::NoStore {
                path: root,
                detail: "the path exists and is not a directory".into(),
            });
        }
        for sub in STORE_DIRS {
            let p = root.join(sub);
            if let Err(source) = fs::create_dir_all(&p) {
                return Err(Error::StoreNotWritable { path: p, source });
            }
        }
        Ok(Store {
            root,
            config,
            tmp_seq: AtomicU64::new(0),
        })
    }

    /// Opens a store that must already exist (never creates anything): for commands that
    /// only read or remove, so a mistyped path is an error instead of a new empty store.
    pub fn open_existing(root: impl Into<PathBuf>, config: StoreConfig) -> Result<Store> {
        let root = root.into();
        Self::check_config(&config)?;
        if !root.is_dir() {
            let detail = match fs::symlink_metadata(&root) {
                Ok(_) => "the path is not a directory".to_string(),
                Err(e) => e.to_string(),
            };
            return Err(Error::NoStore { path: root, detail });
        }
        if let Some(sub) = STORE_DIRS.iter().find(|s| !root.join(s).is_dir()) {
            return Err(Error::NoStore {
                detail: format!("the directory has no {sub}/ (not a layer store)"),
                path: root,
            });
        }
        Ok(Store {
            root,
            config,
            tmp_seq: AtomicU64::new(0),
        })
    }

    /// A handle on a store that cannot be checked now (a network filesystem whose server is
    /// down): nothing is read or created here, and every later read fails or is verified as
    /// usual. For a node cache that serves what it already holds while the store is away.
    pub fn open_unreachable(root: impl Into<PathBuf>, config: StoreConfig) -> Result<Store> {
        Self::check_config(&config)?;
        Ok(Store {
            root: root.into(),
            config,
            tmp_seq: AtomicU64::new(0),
        })
    }

    fn check_config(config: &StoreConfig) -> Result<()> {
        if config.chunk_size < 4096 {
            return Err(Error::Invalid(format!(
                "chunk size {} is too small: use at least 4096 bytes",
                config.chunk_size
            )));
        }
        Ok(())
    }

    /// Fails early, before any work, when the store cannot be written (read-only mount,
    /// permissions): a probe file is created in `tmp/` and removed.
    pub fn check_writable(&self) -> Result<()> {
        let probe = self.root.join("tmp").join(format!(
            "{}.{}.probe",
            std::process::id(),
            self.tmp_seq.fetch_add(1, Ordering::Relaxed)
        ));
        match File::create(&probe) {
            Ok(_) => {
                let _ = fs::remove_file(&probe);
                Ok(())
            }
            Err(source) => Err(Error::StoreNotWritable {
                path: self.root.clone(),
                source,
            }),
        }
    }

    /// Checks an image name before any work is done under it.
    pub fn check_image_name(name: &str) -> Result<()> {
        encode_name(name).map(|_| ())
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn chunk_path(&self, d: &Digest) -> PathBuf {
        let hex = d.hex();
        self.root.join("chunks").join(&hex[..2]).join(hex)
    }

    pub fn layer_path(&self, d: &Digest) -> PathBuf {
        self.root.join("layers").join(format!("{}.json", d.hex()))
    }

    pub fn blob_path(&self, d: &Digest) -> PathBuf {
        self.root.join("blobs").join(d.hex())
    }

    fn image_path(&self, name: &str) -> Result<PathBuf> {
        Ok(self
            .root
            .join("images")
            .join(format!("{}.json", encode_name(name)?)))
    }

    /// Writes `data` under a temporary name in the store and renames it to `dest`.
    fn write_atomic(&self, dest: &Path, parts: &[&[u8]]) -> Result<()> {
        let tmp = self.root.join("tmp").join(format!(
            "{}.{}.{}",
            std::process::id(),
            self.tmp_seq.fetch_add(1, Ordering::Relaxed),
            dest.file_name().and_then(|n| n.to_str()).unwrap_or("obj")
        ));
        let res = (|| {
            let mut f = File::create(&tmp)?;
            for p in parts {
                f.write_all(p)?;
            }
            if self.config.fsync {
                f.sync_data()?;
            }
            drop(f);
            if let Some(parent) = dest.parent() {
                fs::create_dir_all(parent)?;
            }
            fs::rename(&tmp, dest)
        })();
        if let Err(e) = res {
            let _ = fs::remove_file(&tmp);
            return Err(Error::io("writing store object", dest, e));
        }
        Ok(())
    }

    /// Stores one chunk (deduplicated by content) and returns its digest.
    pub fn put_chunk(&self, data: &[u8]) -> Result<Digest> {
        self.put_chunk_new(data).map(|(d, _)| d)
    }

    /// Like `put_chunk`, also telling whether the chunk was new to the store.
    pub fn put_chunk_new(&self, data: &[u8]) -> Result<(Digest, bool)> {
        let d = Digest::of(data);
        let path = self.chunk_path(&d);
        if path.exists() {
            touch(&path);
            return Ok((d, false));
        }
        // Compress only where it pays: incompressible data (already-compressed files) is
        // stored raw so reads skip the decompression.
        if let Some(level) = self.config.zstd_level {
            if let Ok(z) = zstd::bulk::compress(data, level) {
                if z.len() + z.len() / 8 < data.len() {
                    self.write_atomic(&path, &[&[CODEC_ZSTD], &z])?;
                    return Ok((d, true));
                }
            }
        }
        self.write_atomic(&path, &[&[CODEC_RAW], data])?;
        Ok((d, true))
    }

    pub fn has_chunk(&self, d: &Digest) -> bool {
        self.chunk_path(d).exists()
    }

    /// Reads one chunk and verifies it: the bytes returned always hash to `d`.
    pub fn get_chunk(&self, d: &Digest, expected_len: u32) -> Result<Vec<u8>> {
        let path = self.chunk_path(d);
        let raw = match fs::read(&path) {
            Ok(r) => r,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                // A missing chunk on a reachable store is data loss; an unreachable store
                // (root gone) is an I/O problem that may pass.
                if self.root.join("chunks").exists() {
                    return Err(Error::MissingChunk { digest: *d, path });
                }
                return Err(Error::io("reading chunk", path, e));
            }
            Err(e) => return Err(Error::io("reading chunk", path, e)),
        };
        let data = match raw.split_first() {
            Some((&CODEC_RAW, rest)) => rest.to_vec(),
            Some((&CODEC_ZSTD, rest)) => zstd::bulk::decompress(rest, expected_len as usize)
                .map_err(|e| Error::CorruptChunk {
                    digest: *d,
                    detail: format!("zstd: {e}"),
                })?,
            Some((c, _)) => {
                return Err(Error::CorruptChunk {
                    digest: *d,
                    detail: format!("unknown codec byte {c}"),
                })
            }
            None => {
                return Err(Error::CorruptChunk {
                    digest: *d,
                    detail: "empty file".into(),
                })
            }
        };
        if data.len() != expected_len as usize || Digest::of(&data) != *d {
            return Err(Error::CorruptChunk {
                digest: *d,
                detail: format!(
                    "content does not match its digest ({} bytes, expected {expected_len})",
                    data.len()
                ),
            });
        }
        debug!(chunk = %d.short(), len = data.len(), "fetched chunk");
        Ok(data)
    }

    /// Stores a layer index and returns its id (the digest of its canonical bytes).
    pub fn put_layer(&self, index: &LayerIndex) -> Result<Digest> {
        let bytes = index.to_bytes();
        let id = Digest::of(&bytes);
        let path = self.layer_path(&id);
        if path.exists() {
            touch(&path);
        } else {
            self.write_atomic(&path, &[&bytes])?;
        }
        Ok(id)
    }

    pub fn layer_bytes(&self, id: &Digest) -> Result<Vec<u8>> {
        let path = self.layer_path(id);
        let bytes = fs::read(&path).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                Error::MissingLayer(*id)
            } else {
                Error::io("reading layer index", &path, e)
            }
        })?;
        if Digest::of(&bytes) != *id {
            return Err(Error::BadIndex {
                id: id.to_string(),
                detail: "file content does not match the layer id".into(),
            });
        }
        Ok(bytes)
    }

    /// Loads and validates a layer index.
    pub fn get_layer(&self, id: &Digest) -> Result<LayerIndex> {
        LayerIndex::from_bytes(&self.layer_bytes(id)?, &id.to_string())
    }

    pub fn list_layers(&self) -> Result<Vec<Digest>> {
        let dir = self.root.join("layers");
        let mut out = Vec::new();
        for e in fs::read_dir(&dir).map_err(|e| Error::io("listing layers", &dir, e))? {
            let e = e.map_err(|e| Error::io("listing layers", &dir, e))?;
            let name = e.file_name();
            if let Some(hex) = name.to_str().and_then(|n| n.strip_suffix(".json")) {
                if let Ok(d) = Digest::parse(hex) {
                    out.push(d);
                }
            }
        }
        out.sort();
        Ok(out)
    }

    pub fn remove_layer(&self, id: &Digest) -> Result<()> {
        let p = self.layer_path(id);
        fs::remove_file(&p).map_err(|e| Error::io("removing layer index", &p, e))
    }

    /// Remembers which layer an OCI diff_id imported to, so a pull can skip layers the store
    /// already has.
    pub fn record_diff_id(&self, diff_id: &Digest, layer: &Digest) -> Result<()> {
        let p = self.root.join("diffids").join(diff_id.hex());
        self.write_atomic(&p, &[layer.hex().as_bytes()])
    }

    /// The layer a diff_id imported to, if its index is still in the store.
    pub fn layer_for_diff_id(&self, diff_id: &Digest) -> Option<Digest> {
        let s = fs::read_to_string(self.root.join("diffids").join(diff_id.hex())).ok()?;
        let id = Digest::parse(s.trim()).ok()?;
        let p = self.layer_path(&id);
        // Reused by the caller: keep gc off it until the new image record exists.
        p.exists().then(|| touch(&p)).map(|_| id)
    }

    pub fn put_blob(&self, data: &[u8]) -> Result<Digest> {
        let d = Digest::of(data);
        let p = self.blob_path(&d);
        if !p.exists() {
            self.write_atomic(&p, &[data])?;
        }
        Ok(d)
    }

    pub fn get_blob(&self, d: &Digest) -> Result<Vec<u8>> {
        let p = self.blob_path(d);
        let data = fs::read(&p).map_err(|e| Error::io("reading blob", &p, e))?;
        if Digest::of(&data) != *d {
            return Err(Error::Invalid(format!(
                "blob {d} in the store is corrupt; re-import the image that owns it"
            )));
        }
        Ok(data)
    }

    pub fn put_image(&self, rec: &ImageRecord) -> Result<()> {
        let p = self.image_path(&rec.name)?;
        let bytes = serde_json::to_vec_pretty(rec).expect("image record serializes");
        self.write_atomic(&p, &[&bytes])
    }

    pub fn get_image(&self, name: &str) -> Result<ImageRecord> {
        let p = self.image_path(name)?;
        let bytes = match fs::read(&p) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(Error::NoSuchImage(name.to_string()))
            }
            Err(e) => return Err(Error::io("reading image record", &p, e)),
        };
        serde_json::from_slice(&bytes)
            .map_err(|e| Error::Invalid(format!("image record {}: {e}", p.display())))
    }

    pub fn list_images(&self) -> Result<Vec<ImageRecord>> {
        let dir = self.root.join("images");
        let mut out = Vec::new();
        for e in fs::read_dir(&dir).map_err(|e| Error::io("listing images", &dir, e))? {
            let e = e.map_err(|e| Error::io("listing images", &dir, e))?;
            let p = e.path();
            if p.extension().and_then(|x| x.to_str()) != Some("json") {
                continue;
            }
            let bytes = fs::read(&p).map_err(|e| Error::io("reading image record", &p, e))?;
            match serde_json::from_slice::<ImageRecord>(&bytes) {
                Ok(r) => out.push(r),
                Err(e) => {
                    tracing::warn!(path = %p.display(), "skipping unreadable image record: {e}")
                }
            }
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    pub fn remove_image(&self, name: &str) -> Result<()> {
        let p = self.image_path(name)?;
        match fs::remove_file(&p) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Err(Error::NoSuchImage(name.to_string()))
            }
            Err(e) => Err(Error::io("removing image record", &p, e)),
        }
    }

    /// Mark and sweep: removes layers no image references and chunks/blobs no remaining
    /// layer or image references, sparing anything modified within `grace` (an import in
    /// progress writes chunks before its index and image record).
    pub fn gc(&self, grace: std::time::Duration) -> Result<GcReport> {
        let cutoff = std::time::SystemTime::now()
            .checked_sub(grace)
            .unwrap_or(std::time::UNIX_EPOCH);
        let old = |p: &Path| -> bool {
            fs::symlink_metadata(p)
                .and_then(|m| m.modified())
                .map(|t| t < cutoff)
                .unwrap_or(false)
        };
        let mut report = GcReport::default();
        let images = self.list_images()?;
        let mut live_layers = std::collections::HashSet::new();
        let mut live_blobs = std::collections::HashSet::new();
        for img in &images {
            live_layers.extend(img.layers.iter().copied());
            live_blobs.extend(img.config);
            live_blobs.extend(img.hot_list);
        }
        let mut live_chunks = std::collections::HashSet::new();
        for id in self.list_layers()? {
            if !live_layers.contains(&id) && old(&self.layer_path(&id)) {
                self.remove_layer(&id)?;
                report.layers_removed += 1;
                continue;
            }
            // A layer we keep but cannot read keeps everything: never sweep on doubt.
            let idx = self.get_layer(&id)?;
            for e in &idx.entries {
                if let crate::index::Kind::File { chunks, .. } = &e.kind {
                    live_chunks.extend(chunks.iter().map(|c| c.digest));
                }
            }
        }
        let cdir = self.root.join("chunks");
        for sub in fs::read_dir(&cdir).map_err(|e| Error::io("listing chunks", &cdir, e))? {
            let sub = sub
                .map_err(|e| Error::io("listing chunks", &cdir, e))?
                .path();
            let Ok(rd) = fs::read_dir(&sub) else { continue };
            for f in rd.flatten() {
                let p = f.path();
                let keep = p
                    .file_name()
                    .and_then(|n| n.to_str())
                    .and_then(|n| Digest::parse(n).ok())
                    .is_some_and(|d| live_chunks.contains(&d));
                if !keep && old(&p) {
                    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
                    if fs::remove_file(&p).is_ok() {
                        report.chunks_removed += 1;
                        report.bytes_freed += len;
                    }
                }
            }
        }
        let bdir = self.root.join("blobs");
        for f in fs::read_dir(&bdir)
            .map_err(|e| Error::io("listing blobs", &bdir, e))?
            .flatten()
        {
            let p = f.path();
            let keep = p
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| Digest::parse(n).ok())
                .is_some_and(|d| live_blobs.contains(&d));
            if !keep && old(&p) && fs::remove_file(&p).is_ok() {
                report.blobs_removed += 1;
            }
        }
        // Temp files of writers that died.
        let tdir = self.root.join("tmp");
        for f in fs::read_dir(&tdir).into_iter().flatten().flatten() {
            if old(&f.path()) {
                let _ = fs::remove_file(f.path());
            }
        }
        debug!(?report, "gc done");
        Ok(report)
    }

    /// Reads a whole chunk file's raw size (for statistics).
    pub fn chunk_stored_len(&self, d: &Digest) -> Option<u64> {
        fs::metadata(self.chunk_path(d)).ok().map(|m| m.len())
    }
}

#[derive(Debug, Default, Clone, Serialize)]
pub struct GcReport {
    pub layers_removed: u64,
    pub chunks_removed: u64,
    pub blobs_removed: u64,
    pub bytes_freed: u64,
}

/// Marks an existing object as just written: gc spares objects younger than its grace
/// period, and a reused chunk or index is about to be referenced by a new layer or image.
fn touch(p: &Path) {
    if let Ok(f) = fs::OpenOptions::new().append(true).open(p) {
        let _ = f.set_modified(std::time::SystemTime::now());
    }
}

/// Image names like `library/busybox:1.36` become safe file names.
fn encode_name(name: &str) -> Result<String> {
    if name.is_empty() || name.len() > 200 {
        return Err(Error::Invalid(format!(
            "image name {name:?} must be 1 to 200 characters"
        )));
    }
    let mut out = String::new();
    for c in name.chars() {
        match c {
            'a'..='z' | 'A'..='Z' | '0'..='9' | '.' | '-' | '_' | ':' | '@' => out.push(c),
            '/' => out.push_str("%2F"),
            _ => {
                return Err(Error::Invalid(format!(
                    "image name {name:?} has character {c:?}: use letters, digits and . - _ : @ /"
                )))
            }
        }
    }
    if out.starts_with('.') {
        return Err(Error::Invalid(format!(
            "image name {name:?} must not start with '.'"
        )));
    }
    Ok(out)
}

/// Reads exactly `buf.len()` bytes unless EOF comes first; returns bytes read.
pub(crate) fn read_full(r: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_round_trip_compressed_and_raw() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), StoreConfig::default()).unwrap();
        let text = vec![b'a'; 100_000];
        let d = store.put_chunk(&text).unwrap();
        assert_eq!(store.get_chunk(&d, 100_000).unwrap(), text);
        // compressible data was stored compressed
        assert!(store.chunk_stored_len(&d).unwrap() < 10_000);
        let mut rnd = vec![0u8; 50_000];
        let mut x = 12345u64;
        for b in rnd.iter_mut() {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            *b = (x >> 33) as u8;
        }
        let d2 = store.put_chunk(&rnd).unwrap();
        assert_eq!(store.chunk_stored_len(&d2).unwrap(), 50_001);
        assert_eq!(store.get_chunk(&d2, 50_000).unwrap(), rnd);
        // tmp is empty after writes
        assert_eq!(fs::read_dir(dir.path().join("tmp")).unwrap().count(), 0);
    }

    #[test]
    fn corrupt_chunk_is_an_error_not_data() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), StoreConfig::default()).unwrap();
        let d = store.put_chunk(&[7u8; 5000]).unwrap();
        let p = store.chunk_path(&d);
        let mut raw = fs::read(&p).unwrap();
        let last = raw.len() - 1;
        raw[last] ^= 1;
        fs::write(&p, &raw).unwrap();
        assert!(matches!(
            store.get_chunk(&d, 5000),
            Err(Error::CorruptChunk { .. })
        ));
        fs::remove_file(&p).unwrap();
        assert!(matches!(
            store.get_chunk(&d, 5000),
            Err(Error::MissingChunk { .. })
        ));
    }

    #[test]
    fn gc_keeps_what_live_images_use() {
        use crate::build::{LayerBuilder, Meta};
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), StoreConfig::default()).unwrap();
        let layer = |files: &[(&str, &[u8])]| {
            let mut b = LayerBuilder::new(&store);
            for (p, d) in files {
                b.add_file(
                    p,
                    Meta {
                        mode: 0o644,
                        ..Default::default()
                    },
                    &mut &d[..],
                    None,
                )
                .unwrap();
            }
            b.finish().unwrap().0
        };
        let shared = layer(&[("shared", b"shared bytes")]);
        let only_a = layer(&[("a", b"only in a")]);
        let only_b = layer(&[("b", b"only in b")]);
        for (name, top) in [("a", only_a), ("b", only_b)] {
            store
                .put_image(&ImageRecord {
                    name: name.into(),
                    layers: vec![shared, top],
                    diff_ids: vec![],
                    config: None,
                    hot_list: None,
                    created: 0,
                })
                .unwrap();
        }
        // Within the grace period nothing goes, even unreferenced.
        store.remove_image("a").unwrap();
        assert_eq!(
            store
                .gc(std::time::Duration::from_secs(3600))
                .unwrap()
                .layers_removed,
            0
        );
        let r = store.gc(std::time::Duration::ZERO).unwrap();
        assert_eq!((r.layers_removed, r.chunks_removed), (1, 1));
        assert!(store.get_layer(&shared).is_ok() && store.get_layer(&only_b).is_ok());
        assert!(store.get_chunk(&Digest::of(b"shared bytes"), 12).is_ok());
        assert!(store.get_chunk(&Digest::of(b"only in a"), 9).is_err());
    }

    #[test]
    fn image_names() {
        assert_eq!(
            encode_name("library/busybox:1.36").unwrap(),
            "library%2Fbusybox:1.36"
        );
        assert!(encode_name("../x").is_err());
        assert!(encode_name("a b").is_err());
    }
}
