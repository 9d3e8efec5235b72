//! Building layers: a `LayerBuilder` takes entries in any order (tar order, walk order),
//! chunks file contents into the store, and produces a canonical, validated index.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs;
use std::io::Read;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;

use tracing::debug;

use crate::digest::Digest;
use crate::error::{Error, Result};
use crate::index::{check_rel_path, ChunkRef, Entry, Kind, LayerIndex, XattrValue, INDEX_VERSION};
use crate::progress::{NoProgress, Progress};
use crate::store::{read_full, Store};

/// Attributes shared by every kind of entry.
#[derive(Clone, Debug, Default)]
pub struct Meta {
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub mtime: i64,
    pub mtime_nsec: u32,
    pub xattrs: BTreeMap<String, XattrValue>,
}

/// Counters of one build.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct BuildStats {
    pub entries: u64,
    pub file_bytes: u64,
    pub chunks: u64,
    /// Chunks that were not in the store yet.
    pub new_chunks: u64,
}

impl BuildStats {
    /// Adds another build's counters (an image of several layers).
    pub fn add(&mut self, other: &BuildStats) {
        self.entries += other.entries;
        self.file_bytes += other.file_bytes;
        self.chunks += other.chunks;
        self.new_chunks += other.new_chunks;
    }
}

pub struct LayerBuilder<'a> {
    store: &'a Store,
    chunk_size: u32,
    entries: BTreeMap<String, Entry>,
    whiteouts: BTreeSet<String>,
    next_group: u32,
    buf: Vec<u8>,
    progress: &'a dyn Progress,
    pub stats: BuildStats,
}

impl<'a> LayerBuilder<'a> {
    pub fn new(store: &'a Store) -> Self {
        let chunk_size = store.config.chunk_size;
        let mut entries = BTreeMap::new();
        entries.insert(String::new(), implicit_dir(String::new()));
        LayerBuilder {
            store,
            chunk_size,
            entries,
            whiteouts: BTreeSet::new(),
            next_group: 0,
            buf: Vec::new(),
            progress: &NoProgress,
            stats: BuildStats::default(),
        }
    }

    /// Reports every stored chunk to `progress`.
    pub fn with_progress(mut self, progress: &'a dyn Progress) -> Self {
        self.progress = progress;
        self
    }

    fn ensure_parents(&mut self, path: &str) -> Result<()> {
        let mut end = 0;
        while let Some(pos) = path[end..].find('/') {
            let parent = &path[..end + pos];
            match self.entries.get(parent) {
                Some(e) if e.kind.is_dir() => {}
                Some(_) => {
                    return Err(Error::entry(
                        path,
                        format!("parent {parent:?} is not a directory in this layer (a symlink or file used as a directory is rejected: it could redirect writes outside the tree)"),
                    ))
                }
                None => {
                    self.entries.insert(parent.to_string(), implicit_dir(parent.to_string()));
                }
            }
            end += pos + 1;
        }
        Ok(())
    }

    fn has_children(&self, path: &str) -> bool {
        let prefix = format!("{path}/");
        self.entries
            .range(prefix.clone()..)
            .next()
            .is_some_and(|(k, _)| k.starts_with(&prefix))
            || self
                .whiteouts
                .range(prefix.clone()..)
                .next()
                .is_some_and(|k| k.starts_with(&prefix))
    }

    fn insert(&mut self, path: &str, kind: Kind, meta: Meta, link: Option<u32>) -> Result<()> {
        check_rel_path(path)?;
        self.ensure_parents(path)?;
        let mut kind = kind;
        if let Some(old) = self.entries.get(path) {
            match (&old.kind, &mut kind) {
                (Kind::Dir { opaque: o, .. }, Kind::Dir { opaque, .. }) => *opaque |= *o,
                (Kind::Dir { .. }, _) if self.has_children(path) => {
                    return Err(Error::entry(
                        path,
                        "a non-directory replaces a directory that has entries in this layer",
                    ))
                }
                _ => {}
            }
        }
        self.stats.entries += 1;
        self.entries.insert(
            path.to_string(),
            Entry {
                path: path.to_string(),
                kind,
                mode: meta.mode & 0o7777,
                uid: meta.uid,
                gid: meta.gid,
                mtime: meta.mtime,
                mtime_nsec: meta.mtime_nsec,
                xattrs: meta.xattrs,
                link,
            },
        );
        Ok(())
    }

    pub fn add_dir(&mut self, path: &str, meta: Meta) -> Result<()> {
        self.insert(
            path,
            Kind::Dir {
                opaque: false,
                implicit: false,
            },
            meta,
            None,
        )
    }

    pub fn add_symlink(&mut self, path: &str, target: &str, meta: Meta) -> Result<()> {
        if target.is_empty() || target.contains('\0') {
            return Err(Error::entry(
                path,
                "symlink target is empty or contains NUL",
            ));
        }
        self.insert(
            path,
            Kind::Symlink {
                target: target.to_string(),
            },
            meta,
            None,
        )
    }

    /// Device nodes, fifos and sockets.
    pub fn add_special(&mut self, path: &str, kind: Kind, meta: Meta) -> Result<()> {
        match kind {
            Kind::Char { .. } | Kind::Block { .. } | Kind::Fifo | Kind::Socket => {
                self.insert(path, kind, meta, None)
            }
            _ => Err(Error::entry(path, "not a special file kind")),
        }
    }

    /// Streams a regular file's contents into chunks. `size` is checked when given.
    pub fn add_file(
        &mut self,
        path: &str,
        meta: Meta,
        r: &mut impl Read,
        size: Option<u64>,
    ) -> Result<()> {
        check_rel_path(path)?;
        let cs = self.chunk_size as usize;
        if self.buf.len() != cs {
            self.buf = vec![0u8; cs];
        }
        let mut chunks = Vec::new();
        let mut total = 0u64;
        loop {
            let n = read_full(r, &mut self.buf)
                .map_err(|e| Error::io("reading file contents for", path, e))?;
            if n == 0 {
                break;
            }
            let data = &self.buf[..n];
            let (d, new) = self.store.put_chunk_new(data)?;
            if new {
                self.stats.new_chunks += 1;
            }
            self.stats.chunks += 1;
            self.progress.chunk_stored(n as u64, new);
            chunks.push(ChunkRef {
                digest: d,
                len: n as u32,
            });
            total += n as u64;
            if n < cs {
                break;
            }
        }
        if let Some(s) = size {
            if s != total {
                return Err(Error::entry(
                    path,
                    format!("file is {total} bytes, header said {s}"),
                ));
            }
        }
        self.stats.file_bytes += total;
        self.insert(
            path,
            Kind::File {
                size: total,
                chunks,
            },
            meta,
            None,
        )
    }

    /// A hard link to an entry already added to this layer.
    pub fn add_hardlink(&mut self, path: &str, target: &str) -> Result<()> {
        check_rel_path(path)?;
        check_rel_path(target)?;
        if path == target {
            return Err(Error::entry(path, "hard link to itself"));
        }
        let group = match self.entries.get(target) {
            None => {
                return Err(Error::entry(
                    path,
                    format!("hard link target {target:?} is not an earlier entry of this layer"),
                ))
            }
            Some(t) if t.kind.is_dir() || t.kind == Kind::Whiteout => {
                return Err(Error::entry(
                    path,
                    format!("hard link target {target:?} is a directory or whiteout"),
                ))
            }
            Some(t) => t.link,
        };
        let group = match group {
            Some(g) => g,
            None => {
                let g = self.next_group;
                self.next_group += 1;
                self.entries.get_mut(target).expect("checked above").link = Some(g);
                g
            }
        };
        let t = self.entries[target].clone();
        let meta = Meta {
            mode: t.mode,
            uid: t.uid,
            gid: t.gid,
            mtime: t.mtime,
            mtime_nsec: t.mtime_nsec,
            xattrs: t.xattrs,
        };
        self.insert(path, t.kind, meta, Some(group))
    }

    /// Deletes `path` of lower layers. Entries of this layer at the same path win.
    pub fn add_whiteout(&mut self, path: &str) -> Result<()> {
        check_rel_path(path)?;
        if path.is_empty() {
            return Err(Error::entry(path, "cannot white out the root"));
        }
        self.ensure_parents(path)?;
        self.whiteouts.insert(path.to_string());
        Ok(())
    }

    /// Marks `dir` opaque: nothing of lower layers below it shows.
    pub fn set_opaque(&mut self, dir: &str) -> Result<()> {
        check_rel_path(dir)?;
        if !self.entries.contains_key(dir) {
            self.ensure_parents(dir)?;
            self.entries
                .insert(dir.to_string(), implicit_dir(dir.to_string()));
        }
        match &mut self.entries.get_mut(dir).expect("inserted").kind {
            Kind::Dir { opaque, .. } => {
                *opaque = true;
                Ok(())
            }
            _ => Err(Error::entry(
                dir,
                "opaque marker in something that is not a directory",
            )),
        }
    }

    /// Writes the index to the store and returns the layer id.
    pub fn finish(mut self) -> Result<(Digest, LayerIndex)> {
        for w in std::mem::take(&mut self.whiteouts) {
            match self.entries.get_mut(&w) {
                // Same-layer entry wins; a whited-out lower directory replaced by one of this
                // layer's must not merge with it, hence opaque.
                Some(Entry {
                    kind: Kind::Dir { opaque, .. },
                    ..
                }) => *opaque = true,
                Some(_) => {}
                None => {
                    self.entries.insert(
                        w.clone(),
                        Entry {
                            path: w,
                            kind: Kind::Whiteout,
                            mode: 0,
                            uid: 0,
                            gid: 0,
                            mtime: 0,
                            mtime_nsec: 0,
                            xattrs: BTreeMap::new(),
                            link: None,
                        },
                    );
                }
            }
        }
        // Renumber hard-link groups in path order so the index is independent of input order,
        // and drop groups left with one member (a replaced link target).
        let mut count: HashMap<u32, u32> = HashMap::new();
        for e in self.entries.values() {
            if let Some(g) = e.link {
                *count.entry(g).or_default() += 1;
            }
        }
        let mut renum: HashMap<u32, u32> = HashMap::new();
        for e in self.entries.values_mut() {
            if let Some(g) = e.link {
                if count[&g] < 2 {
                    e.link = None;
                } else {
                    let n = renum.len() as u32;
                    e.link = Some(*renum.entry(g).or_insert(n));
                }
            }
        }
        let index = LayerIndex {
            version: INDEX_VERSION,
            chunk_size: self.chunk_size,
            entries: self.entries.into_values().collect(),
        };
        index.validate()?;
        let id = self.store.put_layer(&index)?;
        debug!(layer = %id.short(), entries = index.entries.len(), "layer built");
        Ok((id, index))
    }
}

fn implicit_dir(path: String) -> Entry {
    Entry {
        path,
        kind: Kind::Dir {
            opaque: false,
            implicit: true,
        },
        mode: 0o755,
        uid: 0,
        gid: 0,
        mtime: 0,
        mtime_nsec: 0,
        xattrs: BTreeMap::new(),
        link: None,
    }
}

/// How to read a directory tree as a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DirMode {
    /// Every entry is content.
    Plain,
    /// An overlayfs upper dir: 0/0 char devices are whiteouts, `trusted.overlay.opaque=y`
    /// marks opaque dirs, other `trusted.overlay.*` xattrs are overlayfs bookkeeping.
    OverlayUpper,
}

fn meta_of(path: &Path, md: &fs::Metadata, mode: DirMode) -> Result<Meta> {
    let mut xattrs = BTreeMap::new();
    for name in crate::xattr::list(path).map_err(|e| Error::io("listing xattrs of", path, e))? {
        if name.starts_with(b"trusted.overlay.") {
            continue;
        }
        let Ok(n) = String::from_utf8(name.clone()) else {
            return Err(Error::entry(
                path.display().to_string(),
                "xattr name is not UTF-8",
            ));
        };
        if let Some(v) =
            crate::xattr::get(path, &name).map_err(|e| Error::io("reading xattr of", path, e))?
        {
            xattrs.insert(n, XattrValue(v));
        }
    }
    let _ = mode;
    Ok(Meta {
        mode: md.mode() & 0o7777,
        uid: md.uid(),
        gid: md.gid(),
        mtime: md.mtime(),
        mtime_nsec: md.mtime_nsec() as u32,
        xattrs,
    })
}

/// Builds a layer from a directory tree (see `DirMode`). Hard links are found by inode.
pub fn build_from_dir(
    store: &Store,
    root: &Path,
    mode: DirMode,
) -> Result<(Digest, LayerIndex, BuildStats)> {
    build_from_dir_with_progress(store, root, mode, &NoProgress)
}

/// `build_from_dir`, reporting every stored chunk to `progress`.
pub fn build_from_dir_with_progress(
    store: &Store,
    root: &Path,
    mode: DirMode,
    progress: &dyn Progress,
) -> Result<(Digest, LayerIndex, BuildStats)> {
    let mut b = LayerBuilder::new(store).with_progress(progress);
    let md = fs::symlink_metadata(root).map_err(|e| Error::io("reading", root, e))?;
    if !md.is_dir() {
        return Err(Error::NotADirectory(root.to_path_buf()));
    }
    let meta = meta_of(root, &md, mode)?;
    b.add_dir("", meta)?;
    if mode == DirMode::OverlayUpper && is_opaque(root)? {
        b.set_opaque("")?;
    }
    let mut inodes: HashMap<(u64, u64), String> = HashMap::new();
    walk(&mut b, root, "", mode, &mut inodes)?;
    let stats = b.stats.clone();
    let (id, idx) = b.finish()?;
    Ok((id, idx, stats))
}

fn is_opaque(p: &Path) -> Result<bool> {
    Ok(crate::xattr::get(p, b"trusted.overlay.opaque")
        .map_err(|e| Error::io("reading xattr of", p, e))?
        .is_some_and(|v| v == b"y"))
}

fn walk(
    b: &mut LayerBuilder<'_>,
    dir: &Path,
    rel: &str,
    mode: DirMode,
    inodes: &mut HashMap<(u64, u64), String>,
) -> Result<()> {
    let mut names = Vec::new();
    for e in fs::read_dir(dir).map_err(|e| Error::io("listing", dir, e))? {
        let e = e.map_err(|e| Error::io("listing", dir, e))?;
        let name = e.file_name().into_string().map_err(|n| {
            Error::entry(
                format!("{rel}/{n:?}"),
                "file name is not UTF-8 (layer indexes store UTF-8 paths)",
            )
        })?;
        names.push(name);
    }
    names.sort();
    for name in names {
        let p = dir.join(&name);
        let r = if rel.is_empty() {
            name.clone()
        } else {
            format!("{rel}/{name}")
        };
        let md = fs::symlink_metadata(&p).map_err(|e| Error::io("reading", &p, e))?;
        let ft = md.file_type();
        if mode == DirMode::OverlayUpper && ft.is_char_device() && md.rdev() == 0 {
            b.add_whiteout(&r)?;
            continue;
        }
        let meta = meta_of(&p, &md, mode)?;
        if ft.is_dir() {
            b.add_dir(&r, meta)?;
            if mode == DirMode::OverlayUpper && is_opaque(&p)? {
                b.set_opaque(&r)?;
            }
            walk(b, &p, &r, mode, inodes)?;
            continue;
        }
        if md.nlink() > 1 {
            if let Some(first) = inodes.get(&(md.dev(), md.ino())) {
                b.add_hardlink(&r, &first.clone())?;
                continue;
            }
            inodes.insert((md.dev(), md.ino()), r.clone());
        }
        if ft.is_file() {
            if mode == DirMode::OverlayUpper
                && crate::xattr::get(&p, b"trusted.overlay.metacopy")
                    .ok()
                    .flatten()
                    .is_some()
            {
                return Err(Error::entry(
                    r,
                    "metacopy-only upper file: mount the overlay with metacopy=off",
                ));
            }
            let mut f = fs::File::open(&p).map_err(|e| Error::io("opening", &p, e))?;
            b.add_file(&r, meta, &mut f, Some(md.len()))?;
        } else if ft.is_symlink() {
            let t = fs::read_link(&p).map_err(|e| Error::io("reading symlink", &p, e))?;
            let t = t
                .to_str()
                .ok_or_else(|| Error::entry(&r, "symlink target is not UTF-8"))?;
            b.add_symlink(&r, t, meta)?;
        } else {
            let rdev = md.rdev();
            let (major, minor) = (libc::major(rdev), libc::minor(rdev));
            let kind = if ft.is_char_device() {
                Kind::Char { major, minor }
            } else if ft.is_block_device() {
                Kind::Block { major, minor }
            } else if ft.is_fifo() {
                Kind::Fifo
            } else {
                Kind::Socket
            };
            b.add_special(&r, kind, meta)?;
        }
    }
    Ok(())
}
