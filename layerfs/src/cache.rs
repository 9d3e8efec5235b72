//! The per-node cache: chunks fetched on demand from the shared store, verified, and kept on
//! local disk for every sandbox of the node. One fetch per chunk however many readers wait
//! (single-flight); a size cap enforced by LRU eviction that never evicts a chunk being
//! read; the LRU order persisted so a restart keeps the cache warm. Layer indexes are
//! copied here too: the index is local, the data remote.

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
}

#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct CacheStatsSnapshot {
    pub hits: u64,
    pub misses: u64,
    pub fetched_bytes: u64,
    pub fetch_errors: u64,
    pub evictions: u64,
    pub used_bytes: u64,
    pub chunks: u64,
}

#[derive(Debug)]
struct Slot {
    size: u64,
    tick: u64,
    pins: u32,
}

#[derive(Debug, Default)]
struct State {
    map: HashMap<Digest, Slot>,
    lru: BTreeMap<u64, Digest>,
    tick: u64,
    used: u64,
    inflight: HashSet<Digest>,
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

/// A cached chunk held open and pinned (not evictable) while this lives.
pub struct Pinned<'a> {
    cache: &'a NodeCache,
    digest: Digest,
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

impl Drop for Pinned<'_> {
    fn drop(&mut self) {
        let mut st = self.cache.lock();
        if let Some(s) = st.map.get_mut(&self.digest) {
            s.pins = s.pins.saturating_sub(1);
        }
        self.cache.evict(&mut st);
    }
}

const RECORD: &str = "lru.record";
/// Temp files younger than this may be another process's fill in flight.
const TMP_GRACE: std::time::Duration = std::time::Duration::from_secs(600);

impl NodeCache {
    /// Opens the cache at `dir` (created if needed), capped at `cap_bytes` of chunks.
    pub fn open(dir: impl Into<PathBuf>, store: Arc<Store>, cap_bytes: u64) -> Result<NodeCache> {
        let dir = dir.into();
        for sub in ["chunks", "layers", "tmp"] {
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
        let mut found: HashMap<Digest, (u64, std::time::SystemTime)> = HashMap::new();
        let cdir = dir.join("chunks");
        for f in fs::read_dir(&cdir)
            .map_err(|e| Error::io("listing cache", &cdir, e))?
            .flatten()
        {
            let name = f.file_name();
            let Some(d) = name.to_str().and_then(|n| Digest::parse(n).ok()) else {
                continue;
            };
            if let Ok(md) = f.metadata() {
                found.insert(
                    d,
                    (md.len(), md.modified().unwrap_or(std::time::UNIX_EPOCH)),
                );
            }
        }
        // Order: the persisted record first (oldest first), then unrecorded files by mtime.
        let mut order: Vec<Digest> = Vec::new();
        let mut seen = HashSet::new();
        if let Ok(rec) = fs::read_to_string(dir.join(RECORD)) {
            for line in rec.lines() {
                if let Ok(d) = Digest::parse(line.trim()) {
                    if found.contains_key(&d) && seen.insert(d) {
                        order.push(d);
                    }
                }
            }
        }
        let mut rest: Vec<_> = found.iter().filter(|(d, _)| !seen.contains(*d)).collect();
        rest.sort_by_key(|(d, (_, t))| (*t, **d));
        order.extend(rest.into_iter().map(|(d, _)| *d));
        let mut st = State::default();
        for d in order {
            let size = found[&d].0;
            st.tick += 1;
            st.lru.insert(st.tick, d);
            st.map.insert(
                d,
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

    fn touch(st: &mut State, d: &Digest) {
        st.tick += 1;
        let tick = st.tick;
        if let Some(s) = st.map.get_mut(d) {
            st.lru.remove(&s.tick);
            s.tick = tick;
            st.lru.insert(tick, *d);
        }
    }

    fn evict(&self, st: &mut State) {
        if st.used <= self.cap {
            return;
        }
        let victims: Vec<(u64, Digest)> = st
            .lru
            .iter()
            .filter(|(_, d)| st.map.get(d).is_some_and(|s| s.pins == 0))
            .map(|(t, d)| (*t, *d))
            .collect();
        for (tick, d) in victims {
            if st.used <= self.cap {
                break;
            }
            let size = st.map.remove(&d).map(|s| s.size).unwrap_or(0);
            st.lru.remove(&tick);
            st.used -= size;
            self.fd_cache().remove(&d);
            let _ = fs::remove_file(self.chunk_path(&d));
            self.stats.evictions.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Returns the chunk pinned, fetching and verifying it from the store if needed.
    pub fn get(&self, c: &ChunkRef) -> Result<Pinned<'_>> {
        let d = c.digest;
        let mut st = self.lock();
        loop {
            if st.map.contains_key(&d) {
                st.map.get_mut(&d).expect("present").pins += 1;
                Self::touch(&mut st, &d);
                drop(st);
                let cached = self.fd_cache().get(&d);
                if let Some(file) = cached {
                    self.stats.hits.fetch_add(1, Ordering::Relaxed);
                    return Ok(Pinned {
                        cache: self,
                        digest: d,
                        file,
                    });
                }
                match ChunkFile::open(&self.chunk_path(&d)) {
                    Ok(file) => {
                        let file = Arc::new(file);
                        self.fd_cache().insert(d, file.clone());
                        self.stats.hits.fetch_add(1, Ordering::Relaxed);
                        return Ok(Pinned {
                            cache: self,
                            digest: d,
                            file,
                        });
                    }
                    Err(e) => {
                        // Deleted behind our back (another process sharing the dir): refetch.
                        warn!(chunk = %d.short(), "cached chunk unreadable, refetching: {e}");
                        st = self.lock();
                        if let Some(s) = st.map.remove(&d) {
                            st.lru.remove(&s.tick);
                            st.used -= s.size;
                        }
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
                st.tick += 1;
                let tick = st.tick;
                st.lru.insert(tick, d);
                st.map.insert(
                    d,
                    Slot {
                        size: c.len as u64,
                        tick,
                        pins: 1,
                    },
                );
                st.used += c.len as u64;
                self.evict(&mut st);
                Ok(Pinned {
                    cache: self,
                    digest: d,
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
        if !self.lock().map.contains_key(d) {
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

    pub fn contains(&self, d: &Digest) -> bool {
        self.lock().map.contains_key(d)
    }

    pub fn snapshot(&self) -> CacheStatsSnapshot {
        let st = self.lock();
        CacheStatsSnapshot {
            hits: self.stats.hits.load(Ordering::Relaxed),
            misses: self.stats.misses.load(Ordering::Relaxed),
            fetched_bytes: self.stats.fetched_bytes.load(Ordering::Relaxed),
            fetch_errors: self.stats.fetch_errors.load(Ordering::Relaxed),
            evictions: self.stats.evictions.load(Ordering::Relaxed),
            used_bytes: st.used,
            chunks: st.map.len() as u64,
        }
    }

    /// Writes the LRU order so a restarted node keeps its hot chunks longest.
    pub fn persist(&self) -> Result<()> {
        let st = self.lock();
        let mut s = String::with_capacity(st.lru.len() * 65);
        for d in st.lru.values() {
            s.push_str(&d.hex());
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
