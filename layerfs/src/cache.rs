//! The per-node cache: chunks fetched on demand from the shared store, verified, and kept on
//! local disk for every sandbox of the node. One fetch per chunk however many readers wait
//! (single-flight); a size cap enforced by LRU eviction that never evicts a chunk being
//! read; the LRU order persisted so a restart keeps the cache warm. Layer indexes are
//! copied here too: the index is local, the data remote. A file of several chunks that is
//! fully cached also gets a "flat" copy (its chunks concatenated), so the kernel can read
//! it from one local file (FUSE passthrough); flat copies share the cap and the LRU order.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::{self, File};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use tracing::{debug, warn};

use crate::compose::{Composition, ImageTree};
use crate::digest::Digest;
use crate::error::{Error, Result};
use crate::index::{ChunkRef, LayerIndex};
use crate::store::Store;

#[derive(Debug, Default)]
pub struct CacheStats {
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    /// Chunk bytes (uncompressed) fetched from the store.
    pub fetched_bytes: AtomicU64,
    pub fetch_errors: AtomicU64,
    pub evictions: AtomicU64,
    /// Opens the kernel serves from a cache file itself (FUSE passthrough).
    pub passthrough_opens: AtomicU64,
    /// Read requests the FUSE daemon answered (passthrough reads never reach it).
    pub daemon_reads: AtomicU64,
    /// Flat copies assembled from cached chunks.
    pub flat_builds: AtomicU64,
}

#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct CacheStatsSnapshot {
    pub hits: u64,
    pub misses: u64,
    pub fetched_bytes: u64,
    pub fetch_errors: u64,
    pub evictions: u64,
    pub passthrough_opens: u64,
    pub daemon_reads: u64,
    pub flat_builds: u64,
    /// Chunk and flat bytes on disk, counted against the cap.
    pub used_bytes: u64,
    pub chunks: u64,
    pub flat_files: u64,
}

/// A cache file: one chunk, or a multi-chunk file's flat copy named by the digest of its
/// chunk list. Two kinds, not one digest space: a chunk's bytes may hash to a list's digest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Key {
    Chunk(Digest),
    Flat(Digest),
}

#[derive(Debug)]
struct Slot {
    size: u64,
    tick: u64,
    pins: u32,
}

#[derive(Debug, Default)]
struct State {
    map: HashMap<Key, Slot>,
    lru: BTreeMap<u64, Key>,
    tick: u64,
    used: u64,
    inflight: HashSet<Digest>,
    /// Flat copies being assembled (at most `MAX_FLAT_BUILDS`).
    flat_inflight: HashSet<Digest>,
}

#[derive(Debug)]
pub struct NodeCache {
    dir: PathBuf,
    store: Arc<Store>,
    cap: u64,
    state: Mutex<State>,
    cv: Condvar,
    layers: Mutex<HashMap<Digest, Arc<LayerIndex>>>,
    /// Open (and mapped) files of recently read chunks: a read then costs no open/close.
    fds: Mutex<FdCache>,
    pub stats: CacheStats,
    tmp_seq: AtomicU64,
}

const FD_CACHE: usize = 256;
/// Flat copies assembled at once: each is a disk-bound copy in the background.
const MAX_FLAT_BUILDS: usize = 1;
/// No flat copy larger than this share of the cap: it duplicates its chunks and would push
/// a large part of the cache out.
const FLAT_CAP_SHARE: u64 = 4;
/// Cached chunk files a sequential reader asks the kernel to read ahead (WILLNEED).
const WILLNEED_AHEAD: usize = 4;

/// A cached chunk file, open and, when it is not empty, mapped read-only. A reply is then
/// written to /dev/fuse straight from the mapping (the chunk file's page cache): one copy
/// of the data fewer than `pread` into a buffer first.
#[derive(Debug)]
struct ChunkFile {
    file: File,
    map: Option<Mapping>,
}

#[derive(Debug)]
struct Mapping {
    ptr: *mut libc::c_void,
    len: usize,
}

// SAFETY: a read-only shared mapping of a file nobody writes (cache files are written under
// tmp/ and renamed into place, never modified, only unlinked, which keeps the pages): any
// thread may read it, and it is unmapped once, on drop.
unsafe impl Send for Mapping {}
// SAFETY: as above, reads only.
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: ptr and len come from a successful mmap and are unmapped only here.
        unsafe { libc::munmap(self.ptr, self.len) };
    }
}

impl ChunkFile {
    fn open(path: &Path) -> std::io::Result<ChunkFile> {
        use std::os::fd::AsRawFd;
        let file = File::open(path)?;
        let len = file.metadata()?.len() as usize;
        let map = (len > 0)
            .then(|| {
                // SAFETY: a new read-only shared mapping of an open file; the kernel picks
                // the address, and the result is checked before use.
                let ptr = unsafe {
                    libc::mmap(
                        std::ptr::null_mut(),
                        len,
                        libc::PROT_READ,
                        libc::MAP_SHARED,
                        file.as_raw_fd(),
                        0,
                    )
                };
                (ptr != libc::MAP_FAILED).then_some(Mapping { ptr, len })
            })
            .flatten();
        if let Some(m) = &map {
            // No 1 MiB read-around on a fault: `mapped` asks for exactly what it copies.
            // SAFETY: the range is the mapping just made.
            unsafe { libc::madvise(m.ptr, m.len, libc::MADV_RANDOM) };
        }
        Ok(ChunkFile { file, map })
    }
}

#[derive(Debug, Default)]
struct FdCache {
    map: HashMap<Digest, Arc<ChunkFile>>,
    order: std::collections::VecDeque<Digest>,
}

impl FdCache {
    fn get(&self, d: &Digest) -> Option<Arc<ChunkFile>> {
        self.map.get(d).cloned()
    }
    fn insert(&mut self, d: Digest, f: Arc<ChunkFile>) {
        if self.map.insert(d, f).is_none() {
            self.order.push_back(d);
        }
        while self.order.len() > FD_CACHE {
            if let Some(old) = self.order.pop_front() {
                self.map.remove(&old);
            }
        }
    }
    fn remove(&mut self, d: &Digest) {
        if self.map.remove(d).is_some() {
            self.order.retain(|x| x != d);
        }
    }
}

/// A cached chunk kept from eviction while this lives.
struct Pin<'a> {
    cache: &'a NodeCache,
    digest: Digest,
}

impl Drop for Pin<'_> {
    fn drop(&mut self) {
        let mut st = self.cache.lock();
        if let Some(s) = st.map.get_mut(&Key::Chunk(self.digest)) {
            s.pins = s.pins.saturating_sub(1);
        }
        self.cache.evict(&mut st);
    }
}

/// A cached chunk held open and pinned (not evictable) while this lives.
pub struct Pinned<'a> {
    _pin: Pin<'a>,
    file: Arc<ChunkFile>,
}

impl Pinned<'_> {
    pub fn read_at(&self, buf: &mut [u8], off: u64) -> std::io::Result<()> {
        self.file.file.read_exact_at(buf, off)
    }

    /// `len` bytes at `off` of the mapped chunk (`None` if unmapped or out of range), after
    /// asking the kernel to read that range in (one request, not a fault per page).
    pub fn mapped(&self, off: u64, len: usize) -> Option<&[u8]> {
        use std::os::fd::AsRawFd;
        let m = self.file.map.as_ref()?;
        let off = usize::try_from(off).ok()?;
        if off.checked_add(len)? > m.len {
            return None;
        }
        // SAFETY: fadvise only hints the page cache about this open file's range.
        unsafe {
            libc::posix_fadvise(
                self.file.file.as_raw_fd(),
                off as i64,
                len as i64,
                libc::POSIX_FADV_WILLNEED,
            )
        };
        // SAFETY: off + len is within the mapping, which lives as long as self.file (an Arc
        // this borrow holds); the file is never written (see ChunkFile).
        Some(unsafe { std::slice::from_raw_parts((m.ptr as *const u8).add(off), len) })
    }

    /// Drops this process's page table entries for a range `mapped` returned, once the
    /// reply is written. The pages stay in the page cache, but a mapped page is one the
    /// kernel will not drop (drop_caches skips it, reclaim must unmap it first): without
    /// this the daemon would pin every chunk it served while the mapping is cached.
    fn unmap_pages(&self, off: u64, len: usize) {
        let Some(m) = self.file.map.as_ref() else {
            return;
        };
        let page = 4096usize;
        let start = (off as usize) & !(page - 1);
        let end = ((off as usize + len).div_ceil(page) * page).min(m.len.div_ceil(page) * page);
        if end > start {
            // SAFETY: [start, end) lies in the mapping (whole pages of it); MADV_DONTNEED on
            // a read-only shared file mapping only zaps page table entries (a later access
            // faults the page cache page back in), and no slice of it is alive here.
            unsafe {
                libc::madvise(
                    m.ptr.cast::<u8>().add(start).cast(),
                    end - start,
                    libc::MADV_DONTNEED,
                )
            };
        }
    }
}

const RECORD: &str = "lru.record";
/// A flat copy's line in the record (a chunk's line is its bare hex digest).
const FLAT_RECORD_PREFIX: &str = "flat/";
/// Temp files younger than this may be another process's fill in flight.
const TMP_GRACE: std::time::Duration = std::time::Duration::from_secs(600);

impl NodeCache {
    /// Opens the cache at `dir` (created if needed), capped at `cap_bytes` of chunks.
    pub fn open(dir: impl Into<PathBuf>, store: Arc<Store>, cap_bytes: u64) -> Result<NodeCache> {
        let dir = dir.into();
        for sub in ["chunks", "flat", "layers", "tmp"] {
            let p = dir.join(sub);
            fs::create_dir_all(&p).map_err(|e| Error::io("creating cache directory", &p, e))?;
        }
        // Leftovers of fills interrupted by a crash. Other processes may share the cache dir
        // (one image server per image on a node) and fill right now: only old files go.
        let now = std::time::SystemTime::now();
        for f in fs::read_dir(dir.join("tmp"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let stale = f
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| now.duration_since(t).ok())
                .is_none_or(|age| age >= TMP_GRACE);
            if stale {
                let _ = fs::remove_file(f.path());
            }
        }
        let mut found: HashMap<Key, (u64, std::time::SystemTime)> = HashMap::new();
        for sub in ["chunks", "flat"] {
            let sdir = dir.join(sub);
            for f in fs::read_dir(&sdir)
                .map_err(|e| Error::io("listing cache", &sdir, e))?
                .flatten()
            {
                let name = f.file_name();
                let Some(d) = name.to_str().and_then(|n| Digest::parse(n).ok()) else {
                    continue;
                };
                let key = if sub == "flat" {
                    Key::Flat(d)
                } else {
                    Key::Chunk(d)
                };
                if let Ok(md) = f.metadata() {
                    found.insert(
                        key,
                        (md.len(), md.modified().unwrap_or(std::time::UNIX_EPOCH)),
                    );
                }
            }
        }
        // Order: the persisted record first (oldest first), then unrecorded files by mtime.
        let mut order: Vec<Key> = Vec::new();
        let mut seen = HashSet::new();
        if let Ok(rec) = fs::read_to_string(dir.join(RECORD)) {
            for line in rec.lines() {
                let line = line.trim();
                let key = match line.strip_prefix(FLAT_RECORD_PREFIX) {
                    Some(hex) => Digest::parse(hex).map(Key::Flat),
                    None => Digest::parse(line).map(Key::Chunk),
                };
                if let Ok(k) = key {
                    if found.contains_key(&k) && seen.insert(k) {
                        order.push(k);
                    }
                }
            }
        }
        let mut rest: Vec<_> = found.iter().filter(|(d, _)| !seen.contains(*d)).collect();
        rest.sort_by_key(|(d, (_, t))| (*t, **d));
        order.extend(rest.into_iter().map(|(d, _)| *d));
        let mut st = State::default();
        for k in order {
            let size = found[&k].0;
            st.tick += 1;
            st.lru.insert(st.tick, k);
            st.map.insert(
                k,
                Slot {
                    size,
                    tick: st.tick,
                    pins: 0,
                },
            );
            st.used += size;
        }
        debug!(dir = %dir.display(), chunks = st.map.len(), bytes = st.used, "node cache opened");
        let cache = NodeCache {
            dir,
            store,
            cap: cap_bytes,
            state: Mutex::new(st),
            cv: Condvar::new(),
            layers: Mutex::new(HashMap::new()),
            fds: Mutex::new(FdCache::default()),
            stats: CacheStats::default(),
            tmp_seq: AtomicU64::new(0),
        };
        {
            let mut st = cache.lock();
            cache.evict(&mut st);
        }
        Ok(cache)
    }

    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panicking reader must not take the cache down with it: the state stays valid.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn fd_cache(&self) -> MutexGuard<'_, FdCache> {
        self.fds.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn chunk_path(&self, d: &Digest) -> PathBuf {
        Self::cached_chunk_path(&self.dir, d)
    }

    /// Where a cache rooted at `dir` keeps chunk `d` (to look without opening the cache).
    pub fn cached_chunk_path(dir: &Path, d: &Digest) -> PathBuf {
        dir.join("chunks").join(d.hex())
    }

    fn flat_path(&self, id: &Digest) -> PathBuf {
        self.dir.join("flat").join(id.hex())
    }

    fn key_path(&self, k: &Key) -> PathBuf {
        match k {
            Key::Chunk(d) => self.chunk_path(d),
            Key::Flat(id) => self.flat_path(id),
        }
    }

    fn touch(st: &mut State, k: &Key) {
        st.tick += 1;
        let tick = st.tick;
        if let Some(s) = st.map.get_mut(k) {
            st.lru.remove(&s.tick);
            s.tick = tick;
            st.lru.insert(tick, *k);
        }
    }

    /// Accounts a new cache file as the most recently used, then enforces the cap.
    fn insert(&self, st: &mut State, k: Key, size: u64, pins: u32) {
        st.tick += 1;
        let tick = st.tick;
        st.lru.insert(tick, k);
        if let Some(old) = st.map.insert(k, Slot { size, tick, pins }) {
            st.lru.remove(&old.tick);
            st.used -= old.size;
        }
        st.used += size;
        self.evict(st);
    }

    /// Drops a cache file from the accounting (the caller removes or lost the file).
    fn forget(st: &mut State, k: &Key) {
        if let Some(s) = st.map.remove(k) {
            st.lru.remove(&s.tick);
            st.used -= s.size;
        }
    }

    fn evict(&self, st: &mut State) {
        if st.used <= self.cap {
            return;
        }
        let victims: Vec<(u64, Key)> = st
            .lru
            .iter()
            .filter(|(_, k)| st.map.get(k).is_some_and(|s| s.pins == 0))
            .map(|(t, k)| (*t, *k))
            .collect();
        for (tick, k) in victims {
            if st.used <= self.cap {
                break;
            }
            let size = st.map.remove(&k).map(|s| s.size).unwrap_or(0);
            st.lru.remove(&tick);
            st.used -= size;
            if let Key::Chunk(d) = &k {
                self.fd_cache().remove(d);
            }
            // A flat copy or chunk that is a passthrough backing stays readable through the
            // kernel's open file; unlinking only frees the space once that closes.
            let _ = fs::remove_file(self.key_path(&k));
            self.stats.evictions.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Returns the chunk pinned, fetching and verifying it from the store if needed.
    pub fn get(&self, c: &ChunkRef) -> Result<Pinned<'_>> {
        let d = c.digest;
        let key = Key::Chunk(d);
        let mut st = self.lock();
        loop {
            if let Some(slot) = st.map.get_mut(&key) {
                slot.pins += 1;
                Self::touch(&mut st, &key);
                drop(st);
                let pin = Pin {
                    cache: self,
                    digest: d,
                };
                let cached = self.fd_cache().get(&d);
                if let Some(file) = cached {
                    self.stats.hits.fetch_add(1, Ordering::Relaxed);
                    return Ok(Pinned { _pin: pin, file });
                }
                match ChunkFile::open(&self.chunk_path(&d)) {
                    Ok(file) => {
                        let file = Arc::new(file);
                        self.fd_cache().insert(d, file.clone());
                        self.stats.hits.fetch_add(1, Ordering::Relaxed);
                        return Ok(Pinned { _pin: pin, file });
                    }
                    Err(e) => {
                        // Deleted behind our back (another process sharing the dir): refetch.
                        warn!(chunk = %d.short(), "cached chunk unreadable, refetching: {e}");
                        drop(pin);
                        st = self.lock();
                        Self::forget(&mut st, &key);
                        continue;
                    }
                }
            }
            if st.inflight.contains(&d) {
                st = self.cv.wait(st).unwrap_or_else(|p| p.into_inner());
                continue;
            }
            st.inflight.insert(d);
            break;
        }
        drop(st);
        self.stats.misses.fetch_add(1, Ordering::Relaxed);
        let res = self.fill(c);
        let mut st = self.lock();
        st.inflight.remove(&d);
        self.cv.notify_all();
        match res {
            Ok(file) => {
                let file = Arc::new(file);
                self.fd_cache().insert(d, file.clone());
                self.insert(&mut st, key, c.len as u64, 1);
                Ok(Pinned {
                    _pin: Pin {
                        cache: self,
                        digest: d,
                    },
                    file,
                })
            }
            Err(e) => {
                self.stats.fetch_errors.fetch_add(1, Ordering::Relaxed);
                Err(e)
            }
        }
    }

    fn fill(&self, c: &ChunkRef) -> Result<ChunkFile> {
        let data = self.store.get_chunk(&c.digest, c.len)?;
        self.stats
            .fetched_bytes
            .fetch_add(data.len() as u64, Ordering::Relaxed);
        let tmp = self.tmp_path(&c.digest.hex());
        let dest = self.chunk_path(&c.digest);
        let res = (|| {
            let mut f = File::create(&tmp)?;
            f.write_all(&data)?;
            drop(f);
            fs::rename(&tmp, &dest)?;
            ChunkFile::open(&dest)
        })();
        res.map_err(|e| {
            let _ = fs::remove_file(&tmp);
            Error::io("writing node cache", &dest, e)
        })
    }

    /// The layer index, from the local copy or fetched (and verified) from the store.
    pub fn layer(&self, id: &Digest) -> Result<Arc<LayerIndex>> {
        if let Some(l) = self
            .layers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
        {
            return Ok(l.clone());
        }
        let local = self.dir.join("layers").join(format!("{}.json", id.hex()));
        let bytes = match fs::read(&local) {
            Ok(b) if Digest::of(&b) == *id => b,
            _ => {
                let b = self.store.layer_bytes(id)?;
                let tmp = self.tmp_path(&format!("{}.json", id.hex()));
                if fs::write(&tmp, &b)
                    .and_then(|_| fs::rename(&tmp, &local))
                    .is_err()
                {
                    warn!(layer = %id.short(), "could not keep a local copy of the layer index");
                }
                b
            }
        };
        let idx = Arc::new(LayerIndex::from_bytes(&bytes, &id.to_string())?);
        self.layers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(*id, idx.clone());
        Ok(idx)
    }

    /// Composes the given layers (bottom first).
    pub fn compose(&self, layers: &[Digest]) -> Result<Composition> {
        if layers.is_empty() {
            return Err(Error::Invalid("an image needs at least one layer".into()));
        }
        let idx = layers
            .iter()
            .map(|l| self.layer(l))
            .collect::<Result<Vec<_>>>()?;
        Ok(Composition::new(idx))
    }

    /// Reads `size` bytes at `off` of a regular file (short at EOF). Every chunk touched is
    /// verified on fill, so the bytes returned are the layer's bytes or an error.
    pub fn read(&self, tree: &dyn ImageTree, ino: u64, off: u64, size: u32) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        let n = self.read_into(tree, ino, off, size, &mut out)?;
        out.truncate(n);
        Ok(out)
    }

    /// Calls `f` with `size` bytes at `off` of a regular file (short at EOF), or the error.
    /// A range inside one chunk (every aligned FUSE readahead request) is passed straight
    /// from the chunk's mapping; any other range goes through `buf`.
    pub fn with_data<R>(
        &self,
        tree: &dyn ImageTree,
        ino: u64,
        off: u64,
        size: u32,
        buf: &mut Vec<u8>,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R> {
        let (cs, chunks) = tree
            .file_chunks(ino)
            .ok_or_else(|| Error::Invalid(format!("inode {ino} is not a regular file")))?;
        let cs = cs as u64;
        let ci = (off / cs) as usize;
        let within = off % cs;
        if let Some(c) = chunks.get(ci) {
            let len = (c.len as u64).saturating_sub(within).min(size as u64) as usize;
            // Whole request in this chunk (or it is the file's last chunk: short at EOF).
            if len > 0 && (len == size as usize || ci + 1 == chunks.len()) {
                let p = self.get(c)?;
                if let Some(data) = p.mapped(within, len) {
                    if within < 256 * 1024 {
                        for next in chunks.iter().skip(ci + 1).take(WILLNEED_AHEAD) {
                            self.advise_willneed(&next.digest);
                        }
                    }
                    let r = f(data);
                    p.unmap_pages(within, len);
                    return Ok(r);
                }
            }
        }
        let n = self.read_into(tree, ino, off, size, buf)?;
        Ok(f(&buf[..n]))
    }

    /// [`NodeCache::read`] into a caller-kept buffer: returns the byte count, the data is
    /// `buf[..n]`. The buffer only grows, so a reader that keeps it (the FUSE workers, one
    /// per thread) neither allocates nor zeroes per request.
    pub fn read_into(
        &self,
        tree: &dyn ImageTree,
        ino: u64,
        off: u64,
        size: u32,
        buf: &mut Vec<u8>,
    ) -> Result<usize> {
        let (cs, chunks) = tree
            .file_chunks(ino)
            .ok_or_else(|| Error::Invalid(format!("inode {ino} is not a regular file")))?;
        let cs = cs as u64;
        let file_size: u64 = chunks.iter().map(|c| c.len as u64).sum();
        let end = file_size.min(off.saturating_add(size as u64));
        if off >= end {
            return Ok(0);
        }
        let len = (end - off) as usize;
        if buf.len() < len {
            buf.resize(len, 0);
        }
        let out = &mut buf[..len];
        let mut pos = off;
        while pos < end {
            let ci = (pos / cs) as usize;
            let within = pos % cs;
            let c = &chunks[ci];
            let n = (c.len as u64 - within).min(end - pos) as usize;
            let p = self.get(c)?;
            let at = (pos - off) as usize;
            p.read_at(&mut out[at..at + n], within)
                .map_err(|e| Error::io("reading cached chunk", self.chunk_path(&c.digest), e))?;
            drop(p);
            pos += n as u64;
            // Sequential reader: ask the kernel to start reading the next cached chunk files
            // now (each chunk is its own file, so page cache readahead stops at chunk ends).
            // Once per chunk (on the read that enters it), as far ahead as the FUSE
            // readahead window: keeps the disk queue busy like the page cache's own
            // readahead does within one file.
            if pos == end && within < 256 * 1024 {
                for next in chunks.iter().skip(ci + 1).take(WILLNEED_AHEAD) {
                    self.advise_willneed(&next.digest);
                }
            }
        }
        Ok(len)
    }

    fn advise_willneed(&self, d: &Digest) {
        if !self.contains(d) {
            return;
        }
        if let Some(f) = self.fd_cache().get(d) {
            use std::os::fd::AsRawFd;
            // SAFETY: f is an open file descriptor owned by the Arc for this call.
            unsafe { libc::posix_fadvise(f.file.as_raw_fd(), 0, 0, libc::POSIX_FADV_WILLNEED) };
        }
    }

    /// Fetches chunks in the background order given, stopping after `max_bytes`.
    pub fn prefetch(&self, chunks: &[ChunkRef], max_bytes: u64) -> u64 {
        let mut done = 0u64;
        for c in chunks {
            if done >= max_bytes {
                break;
            }
            // Leave room: prefetch must not evict what the sandbox is using.
            if self.lock().used + c.len as u64 > self.cap {
                break;
            }
            match self.get(c) {
                Ok(_) => done += c.len as u64,
                Err(e) => {
                    debug!("prefetch stopped: {e}");
                    break;
                }
            }
        }
        done
    }

    /// Whether chunk `d` is cached.
    pub fn contains(&self, d: &Digest) -> bool {
        self.lock().map.contains_key(&Key::Chunk(*d))
    }

    /// The name of the flat copy of a file made of `chunks`: the digest of its chunk list.
    pub fn flat_id(chunks: &[ChunkRef]) -> Digest {
        let mut list = Vec::with_capacity(chunks.len() * 32);
        for c in chunks {
            list.extend_from_slice(&c.digest.0);
        }
        Digest::of(&list)
    }

    /// Whether the flat copy of a file made of `chunks` is cached.
    pub fn has_flat(&self, chunks: &[ChunkRef]) -> bool {
        self.lock()
            .map
            .contains_key(&Key::Flat(Self::flat_id(chunks)))
    }

    /// A local file holding exactly the bytes of a file made of `chunks`, opened read-only,
    /// if the cache has one: the chunk file of a one-chunk file, else the file's flat copy.
    /// For the kernel to read from itself (FUSE passthrough); counts as a use for the LRU.
    /// Never fetches: `None` means serve the file through [`NodeCache::with_data`].
    pub fn backing_file(&self, chunks: &[ChunkRef]) -> Option<File> {
        let key = match chunks {
            [] => return None,
            [c] => Key::Chunk(c.digest),
            _ => Key::Flat(Self::flat_id(chunks)),
        };
        {
            let mut st = self.lock();
            if !st.map.contains_key(&key) {
                return None;
            }
            Self::touch(&mut st, &key);
        }
        let want: u64 = chunks.iter().map(|c| c.len as u64).sum();
        let path = self.key_path(&key);
        let problem = match File::open(&path).and_then(|f| Ok((f.metadata()?.len(), f))) {
            Ok((len, f)) if len == want => return Some(f),
            Ok((len, _)) => format!("holds {len} bytes, the file has {want}"),
            Err(e) => e.to_string(),
        };
        // Removed by another process sharing the dir, or a flat copy cut short by a crash
        // before its data reached the disk: never serve it. Chunk files are left to `get`,
        // which refetches a missing one.
        warn!(path = %path.display(), "cache file not used for passthrough: {problem}");
        if let Key::Flat(_) = key {
            Self::forget(&mut self.lock(), &key);
            let _ = fs::remove_file(&path);
        }
        None
    }

    /// Starts assembling the flat copy of a file made of `chunks` in the background if it
    /// has several chunks, all cached, no flat copy yet, fits the cap's share, and fewer
    /// than `MAX_FLAT_BUILDS` are under way. Returns whether it started one.
    pub fn build_flat_in_background(self: &Arc<Self>, chunks: &[ChunkRef]) -> bool {
        let size: u64 = chunks.iter().map(|c| c.len as u64).sum();
        if chunks.len() < 2 || size > self.cap / FLAT_CAP_SHARE {
            return false;
        }
        let id = Self::flat_id(chunks);
        {
            let mut st = self.lock();
            if st.flat_inflight.len() >= MAX_FLAT_BUILDS
                || st.flat_inflight.contains(&id)
                || st.map.contains_key(&Key::Flat(id))
                || !chunks
                    .iter()
                    .all(|c| st.map.contains_key(&Key::Chunk(c.digest)))
            {
                return false;
            }
            st.flat_inflight.insert(id);
        }
        let (cache, chunks) = (self.clone(), chunks.to_vec());
        let spawned = std::thread::Builder::new()
            .name("layerfs-flat".into())
            .spawn(move || {
                if let Err(e) = cache.build_flat(id, &chunks) {
                    warn!("{e}");
                }
                cache.lock().flat_inflight.remove(&id);
            });
        if spawned.is_err() {
            self.lock().flat_inflight.remove(&id);
            return false;
        }
        true
    }

    /// Flat copies being assembled right now (for callers that time disk work).
    pub fn flat_builds_in_flight(&self) -> usize {
        self.lock().flat_inflight.len()
    }

    /// Concatenates the cached `chunks` into `flat/<id>` (under tmp/, then renamed). Gives
    /// up quietly if a chunk was evicted meanwhile: flat copies are only built from the
    /// cache, never from the store.
    fn build_flat(&self, id: Digest, chunks: &[ChunkRef]) -> Result<()> {
        let dest = self.flat_path(&id);
        let tmp = self.tmp_path(&format!("flat-{}", id.hex()));
        let want: u64 = chunks.iter().map(|c| c.len as u64).sum();
        let res = (|| -> std::io::Result<bool> {
            let mut out = File::create(&tmp)?;
            for c in chunks {
                let Some(_pin) = self.pin_cached(&c.digest) else {
                    return Ok(false);
                };
                // A file of its own (not the shared, mapped one): io::copy moves its offset,
                // and copies in the kernel (copy_file_range) where it can.
                let mut src = File::open(self.chunk_path(&c.digest))?;
                let n = std::io::copy(&mut src, &mut out)?;
                if n != c.len as u64 {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!("chunk {} has {n} bytes, expected {}", c.digest, c.len),
                    ));
                }
            }
            drop(out);
            fs::rename(&tmp, &dest)?;
            Ok(true)
        })();
        match res {
            Ok(true) => {
                let mut st = self.lock();
                self.insert(&mut st, Key::Flat(id), want, 0);
                self.stats.flat_builds.fetch_add(1, Ordering::Relaxed);
                debug!(flat = %id.short(), bytes = want, "flat copy assembled");
                Ok(())
            }
            Ok(false) => {
                let _ = fs::remove_file(&tmp);
                Ok(())
            }
            Err(e) => {
                let _ = fs::remove_file(&tmp);
                Err(Error::io(
                    "assembling a flat copy in the node cache",
                    dest,
                    e,
                ))
            }
        }
    }

    /// Pins chunk `d` if it is cached (never fetches), without opening it.
    fn pin_cached(&self, d: &Digest) -> Option<Pin<'_>> {
        let mut st = self.lock();
        st.map.get_mut(&Key::Chunk(*d))?.pins += 1;
        Some(Pin {
            cache: self,
            digest: *d,
        })
    }

    pub fn snapshot(&self) -> CacheStatsSnapshot {
        let st = self.lock();
        let flat_files = st.map.keys().filter(|k| matches!(k, Key::Flat(_))).count() as u64;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        CacheStatsSnapshot {
            hits: load(&self.stats.hits),
            misses: load(&self.stats.misses),
            fetched_bytes: load(&self.stats.fetched_bytes),
            fetch_errors: load(&self.stats.fetch_errors),
            evictions: load(&self.stats.evictions),
            passthrough_opens: load(&self.stats.passthrough_opens),
            daemon_reads: load(&self.stats.daemon_reads),
            flat_builds: load(&self.stats.flat_builds),
            used_bytes: st.used,
            chunks: st.map.len() as u64 - flat_files,
            flat_files,
        }
    }

    /// Writes the LRU order so a restarted node keeps its hot chunks longest.
    pub fn persist(&self) -> Result<()> {
        let st = self.lock();
        let mut s = String::with_capacity(st.lru.len() * 65);
        for k in st.lru.values() {
            match k {
                Key::Chunk(d) => s.push_str(&d.hex()),
                Key::Flat(id) => {
                    s.push_str(FLAT_RECORD_PREFIX);
                    s.push_str(&id.hex());
                }
            }
            s.push('\n');
        }
        drop(st);
        let tmp = self.tmp_path(RECORD);
        let dest = self.dir.join(RECORD);
        fs::write(&tmp, s)
            .and_then(|_| fs::rename(&tmp, &dest))
            .map_err(|e| Error::io("writing cache record", dest, e))
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A temp file name no other thread or process sharing this cache dir uses.
    fn tmp_path(&self, base: &str) -> PathBuf {
        self.dir.join("tmp").join(format!(
            "{base}.{}.{}",
            std::process::id(),
            self.tmp_seq.fetch_add(1, Ordering::Relaxed)
        ))
    }
}

impl Drop for NodeCache {
    fn drop(&mut self) {
        if let Err(e) = self.persist() {
            warn!("{e}");
        }
    }
}
