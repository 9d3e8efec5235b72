//! OCI layer tars in and out: import streams a (gzip|zstd|plain) tar into chunks without
//! extracting it; export writes a layer back as a deterministic tar.
//!
//! Import applies the OCI layer rules: `.wh.NAME` deletes NAME of lower layers,
//! `.wh..wh..opq` makes its directory opaque, a whiteout never hides entries of its own
//! layer. It rejects: `..` components, bare `.wh.` and other reserved `.wh..wh.` names, hard
//! links to entries not earlier in the same layer, entries under a symlink or file.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::rc::Rc;

use tracing::{debug, warn};

use crate::build::{BuildStats, LayerBuilder, Meta};
use crate::digest::{Digest, Hasher};
use crate::error::{Error, Result};
use crate::index::{Kind, LayerIndex, XattrValue};
use crate::progress::{NoProgress, Progress};
use crate::store::Store;

/// Result of importing one layer tar.
#[derive(Clone, Debug, serde::Serialize)]
pub struct TarImport {
    pub layer: Digest,
    /// sha256 of the uncompressed tar (OCI diff_id).
    pub diff_id: Digest,
    /// sha256 and size of the stream as given (OCI blob digest when compressed).
    pub blob_digest: Digest,
    pub blob_size: u64,
    pub stats: BuildStats,
    #[serde(skip)]
    pub index: LayerIndex,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

/// Reader that hashes into shared state, so the hash survives the reader being moved into
/// a decoder chain.
struct SharedHash<'p, R> {
    inner: R,
    state: Rc<RefCell<(Hasher, u64)>>,
    progress: &'p dyn Progress,
}

impl<R: Read> Read for SharedHash<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        let mut s = self.state.borrow_mut();
        s.0.update(&buf[..n]);
        s.1 += n as u64;
        self.progress.source_read(n as u64);
        Ok(n)
    }
}

/// Splits a tar member name into checked components; `..` anywhere is rejected, leading `/`
/// and `.` components are dropped (members are relative to the layer root).
pub fn normalize_path(raw: &[u8]) -> Result<String> {
    let s = std::str::from_utf8(raw)
        .map_err(|_| Error::entry(String::from_utf8_lossy(raw), "path is not UTF-8"))?;
    let mut parts = Vec::new();
    for c in s.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                return Err(Error::entry(s, "path traversal: '..' component rejected"));
            }
            c if c.contains('\0') => return Err(Error::entry(s, "NUL in path")),
            c => parts.push(c),
        }
    }
    let p = parts.join("/");
    crate::index::check_rel_path(&p)?;
    Ok(p)
}

fn split_name(p: &str) -> (&str, &str) {
    match p.rsplit_once('/') {
        Some((d, n)) => (d, n),
        None => ("", p),
    }
}

fn join(dir: &str, name: &str) -> String {
    if dir.is_empty() {
        name.to_string()
    } else {
        format!("{dir}/{name}")
    }
}

/// Imports one layer tar stream into the store.
pub fn import_tar(store: &Store, reader: impl Read) -> Result<TarImport> {
    import_tar_with_progress(store, reader, &NoProgress)
}

/// `import_tar`, reporting bytes read from `reader` and chunks stored to `progress`.
pub fn import_tar_with_progress(
    store: &Store,
    reader: impl Read,
    progress: &dyn Progress,
) -> Result<TarImport> {
    let raw_state = Rc::new(RefCell::new((Hasher::new(), 0u64)));
    let mut buffered = BufReader::with_capacity(
        256 * 1024,
        SharedHash {
            inner: reader,
            state: raw_state.clone(),
            progress,
        },
    );
    let magic = buffered
        .fill_buf()
        .map_err(|e| Error::Oci(format!("reading layer stream: {e}")))?;
    let comp = if magic.starts_with(&[0x1f, 0x8b]) {
        Compression::Gzip
    } else if magic.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        Compression::Zstd
    } else {
        Compression::None
    };
    let decoded: Box<dyn Read + '_> = match comp {
        Compression::Gzip => Box::new(flate2::bufread::MultiGzDecoder::new(buffered)),
        Compression::Zstd => Box::new(
            zstd::stream::read::Decoder::with_buffer(buffered)
                .map_err(|e| Error::Oci(format!("zstd stream: {e}")))?,
        ),
        Compression::None => Box::new(buffered),
    };
    let diff_state = Rc::new(RefCell::new((Hasher::new(), 0u64)));
    let tar_in = SharedHash {
        inner: decoded,
        state: diff_state.clone(),
        progress: &NoProgress,
    };
    let mut archive = tar::Archive::new(tar_in);
    let mut b = LayerBuilder::new(store).with_progress(progress);
    let entries = archive
        .entries()
        .map_err(|e| Error::Oci(format!("reading tar: {e}")))?;
    for entry in entries {
        let mut entry = entry.map_err(|e| {
            Error::Oci(format!(
                "reading tar entry: {e} (the stream is truncated, or not a plain, gzip or zstd tar)"
            ))
        })?;
        add_tar_entry(&mut b, &mut entry)?;
    }
    // Read to the end so the digests cover trailing padding and compression trailers.
    let mut rest = archive.into_inner();
    io::copy(&mut rest, &mut io::sink())
        .map_err(|e| Error::Oci(format!("reading layer stream tail: {e}")))?;
    drop(rest);
    let stats = b.stats.clone();
    let (layer, index) = b.finish()?;
    let (dh, _) = Rc::try_unwrap(diff_state)
        .map(|c| c.into_inner())
        .unwrap_or_else(|rc| rc.borrow().clone());
    let (rh, rn) = Rc::try_unwrap(raw_state)
        .map(|c| c.into_inner())
        .unwrap_or_else(|rc| rc.borrow().clone());
    let out = TarImport {
        layer,
        diff_id: dh.finish(),
        blob_digest: rh.finish(),
        blob_size: rn,
        stats,
        index,
    };
    debug!(layer = %out.layer.short(), ?comp, bytes = out.blob_size, "imported layer tar");
    Ok(out)
}

fn io_oci(path: &str, e: io::Error) -> Error {
    Error::entry(path, format!("malformed tar header: {e}"))
}

fn add_tar_entry<R: Read>(b: &mut LayerBuilder<'_>, entry: &mut tar::Entry<'_, R>) -> Result<()> {
    let raw_path = entry.path_bytes().into_owned();
    let path = normalize_path(&raw_path)?;
    let hdr = entry.header().clone();
    let et = hdr.entry_type();
    if matches!(et, tar::EntryType::XGlobalHeader | tar::EntryType::XHeader) {
        return Ok(());
    }
    let mut meta = Meta {
        mode: hdr.mode().map_err(|e| io_oci(&path, e))? & 0o7777,
        uid: hdr.uid().map_err(|e| io_oci(&path, e))? as u32,
        gid: hdr.gid().map_err(|e| io_oci(&path, e))? as u32,
        mtime: hdr.mtime().map_err(|e| io_oci(&path, e))? as i64,
        mtime_nsec: 0,
        xattrs: BTreeMap::new(),
    };
    if let Some(exts) = entry.pax_extensions().map_err(|e| io_oci(&path, e))? {
        for ext in exts {
            let ext = ext.map_err(|e| io_oci(&path, e))?;
            let Ok(key) = ext.key() else { continue };
            if let Some(name) = key.strip_prefix("SCHILY.xattr.") {
                meta.xattrs
                    .insert(name.to_string(), XattrValue(ext.value_bytes().to_vec()));
            } else if key == "mtime" {
                if let Some((s, f)) = ext.value().ok().and_then(|v| v.split_once('.')) {
                    if let (Ok(s), Ok(_)) = (s.parse::<i64>(), f.parse::<u64>()) {
                        let digits: String =
                            f.chars().chain(std::iter::repeat('0')).take(9).collect();
                        meta.mtime = s;
                        meta.mtime_nsec = digits.parse().unwrap_or(0);
                    }
                }
            }
        }
    }

    let (dir, name) = split_name(&path);
    if let Some(rest) = name.strip_prefix(".wh.") {
        if rest == ".wh..opq" {
            return b.set_opaque(dir);
        }
        if rest.is_empty() {
            return Err(Error::entry(
                path,
                "bare '.wh.' whiteout with no name rejected",
            ));
        }
        if rest.starts_with(".wh.") {
            return Err(Error::entry(path, "reserved '.wh..wh.' name rejected"));
        }
        if rest == "." || rest == ".." {
            return Err(Error::entry(path, "whiteout of '.' or '..' rejected"));
        }
        return b.add_whiteout(&join(dir, rest));
    }
    match et {
        tar::EntryType::Directory => b.add_dir(&path, meta),
        tar::EntryType::Regular | tar::EntryType::Continuous => {
            let size = hdr.size().map_err(|e| io_oci(&path, e))?;
            b.add_file(&path, meta, entry, Some(size))
        }
        tar::EntryType::Symlink => {
            let t = entry
                .link_name_bytes()
                .ok_or_else(|| Error::entry(&path, "symlink without a target"))?;
            let t = std::str::from_utf8(&t).map_err(|_| Error::entry(&path, "symlink target is not UTF-8"))?;
            // Symlink targets are data: stored verbatim and never followed by layerfs; the
            // kernel resolves them inside the sandbox's root.
            b.add_symlink(&path, t, meta)
        }
        tar::EntryType::Link => {
            let t = entry
                .link_name_bytes()
                .ok_or_else(|| Error::entry(&path, "hard link without a target"))?;
            let target = normalize_path(&t)
                .map_err(|_| Error::entry(&path, "hard link target escapes the layer root"))?;
            b.add_hardlink(&path, &target)
        }
        tar::EntryType::Char | tar::EntryType::Block => {
            let major = hdr.device_major().map_err(|e| io_oci(&path, e))?.unwrap_or(0);
            let minor = hdr.device_minor().map_err(|e| io_oci(&path, e))?.unwrap_or(0);
            let kind = if et == tar::EntryType::Char {
                Kind::Char { major, minor }
            } else {
                Kind::Block { major, minor }
            };
            b.add_special(&path, kind, meta)
        }
        tar::EntryType::Fifo => b.add_special(&path, Kind::Fifo, meta),
        other => Err(Error::entry(
            path,
            format!("unsupported tar entry type {other:?} (sparse and multi-volume files are not supported)"),
        )),
    }
}

/// Writes `index` as a deterministic, uncompressed layer tar (OCI whiteout conventions,
/// xattrs as PAX `SCHILY.xattr.*`, hard links as link entries).
pub fn export_tar(store: &Store, index: &LayerIndex, out: impl Write) -> Result<()> {
    let mut t = tar::Builder::new(out);
    t.mode(tar::HeaderMode::Complete);
    let mut first_of_group: HashMap<u32, &str> = HashMap::new();
    let werr = |e: io::Error| Error::Oci(format!("writing tar: {e}"));
    for e in &index.entries {
        let mut h = tar::Header::new_gnu();
        h.set_mode(e.mode);
        h.set_uid(e.uid as u64);
        h.set_gid(e.gid as u64);
        h.set_mtime(e.mtime.max(0) as u64);
        h.set_size(0);
        let mut pax: Vec<(String, Vec<u8>)> = e
            .xattrs
            .iter()
            .map(|(k, v)| (format!("SCHILY.xattr.{k}"), v.0.clone()))
            .collect();
        if e.mtime_nsec != 0 {
            pax.push((
                "mtime".into(),
                format!("{}.{:09}", e.mtime, e.mtime_nsec).into_bytes(),
            ));
        }
        if let Some(g) = e.link {
            if let Some(first) = first_of_group.get(&g) {
                h.set_entry_type(tar::EntryType::Link);
                t.append_link(&mut h, &e.path, first).map_err(werr)?;
                continue;
            }
            first_of_group.insert(g, &e.path);
        }
        if !pax.is_empty() && e.kind != Kind::Whiteout {
            t.append_pax_extensions(pax.iter().map(|(k, v)| (k.as_str(), v.as_slice())))
                .map_err(werr)?;
        }
        match &e.kind {
            Kind::Dir { opaque, implicit } => {
                if e.path.is_empty() && *implicit {
                    continue;
                }
                h.set_entry_type(tar::EntryType::Directory);
                let p = if e.path.is_empty() {
                    "./".to_string()
                } else {
                    format!("{}/", e.path)
                };
                t.append_data(&mut h, &p, io::empty()).map_err(werr)?;
                if *opaque {
                    let mut w = marker_header();
                    let wp = join(&e.path, ".wh..wh..opq");
                    t.append_data(&mut w, &wp, io::empty()).map_err(werr)?;
                }
            }
            Kind::File { size, chunks } => {
                h.set_entry_type(tar::EntryType::Regular);
                h.set_size(*size);
                let mut r = ChunkReader {
                    store,
                    chunks,
                    next: 0,
                    cur: Vec::new(),
                    pos: 0,
                };
                t.append_data(&mut h, &e.path, &mut r).map_err(werr)?;
            }
            Kind::Symlink { target } => {
                h.set_entry_type(tar::EntryType::Symlink);
                t.append_link(&mut h, &e.path, target).map_err(werr)?;
            }
            Kind::Char { major, minor } | Kind::Block { major, minor } => {
                h.set_entry_type(if matches!(e.kind, Kind::Char { .. }) {
                    tar::EntryType::Char
                } else {
                    tar::EntryType::Block
                });
                h.set_device_major(*major).map_err(werr)?;
                h.set_device_minor(*minor).map_err(werr)?;
                t.append_data(&mut h, &e.path, io::empty()).map_err(werr)?;
            }
            Kind::Fifo => {
                h.set_entry_type(tar::EntryType::Fifo);
                t.append_data(&mut h, &e.path, io::empty()).map_err(werr)?;
            }
            Kind::Socket => warn!(path = %e.path, "sockets cannot be stored in a tar; skipped"),
            Kind::Whiteout => {
                let (d, n) = split_name(&e.path);
                let mut w = marker_header();
                t.append_data(&mut w, join(d, &format!(".wh.{n}")), io::empty())
                    .map_err(werr)?;
            }
        }
    }
    t.into_inner().map_err(werr)?.flush().map_err(werr)?;
    Ok(())
}

/// Header of an empty whiteout / opaque marker file.
fn marker_header() -> tar::Header {
    let mut w = tar::Header::new_gnu();
    w.set_entry_type(tar::EntryType::Regular);
    w.set_mode(0o644);
    w.set_uid(0);
    w.set_gid(0);
    w.set_mtime(0);
    w.set_size(0);
    w
}

/// Reads a file's bytes chunk by chunk straight from the store (verified).
struct ChunkReader<'a> {
    store: &'a Store,
    chunks: &'a [crate::index::ChunkRef],
    next: usize,
    cur: Vec<u8>,
    pos: usize,
}

impl Read for ChunkReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.pos == self.cur.len() {
            let Some(c) = self.chunks.get(self.next) else {
                return Ok(0);
            };
            self.cur = self
                .store
                .get_chunk(&c.digest, c.len)
                .map_err(|e| io::Error::other(e.to_string()))?;
            self.pos = 0;
            self.next += 1;
        }
        let n = buf.len().min(self.cur.len() - self.pos);
        buf[..n].copy_from_slice(&self.cur[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}
