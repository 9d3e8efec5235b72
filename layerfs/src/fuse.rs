//! Read-only FUSE view of an `ImageTree`. The tree is immutable, so attributes and entries
//! get long TTLs and file pages stay in the kernel page cache across opens (KEEP_CACHE).
//! Reads run on a small worker pool so a slow chunk fetch does not stall lookups. A file
//! whose bytes are all in one local cache file (a one-chunk file, or a flat copy) is opened
//! with FUSE passthrough: the kernel reads that file itself and the daemon sees no reads.

use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::path::Path;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, UNIX_EPOCH};

use fuser::{
    BackingId, FileAttr, FileType, Filesystem, KernelConfig, MountOption, ReplyAttr, ReplyData,
    ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyXattr, Request,
};
use tracing::{debug, warn};

use crate::cache::NodeCache;
use crate::compose::{Attr, FileKind, ImageTree};
use crate::error::{Error, Result};

/// Immutable layers: the kernel may cache names and attributes for as long as it likes.
/// FUSE_ALLOW_IDMAP (init flags2 bit 8, Linux 6.12): idmapped mounts of this filesystem.
const FUSE_ALLOW_IDMAP: u64 = 1 << 40;
const TTL: Duration = Duration::from_secs(365 * 24 * 3600);
const WORKERS: usize = 4;
const HOT_LIST_MAX: usize = 200_000;
/// Readahead of the mount's bdi, in KiB: one chunk, so a sequential reader's requests are
/// whole chunks (1 MiB, the FUSE request limit). 4 MiB measured slower here (more requests
/// in flight on a 2-core machine), so it stays at one chunk.
const READAHEAD_KB: u32 = 1024;

thread_local! {
    /// Each read worker's reply buffer: grows to the largest request once, then is reused
    /// (no allocation or zeroing per read).
    static READ_BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// First-touch order of (inode, chunk index) during a run, for the prefetch hot list.
#[derive(Debug, Default)]
pub struct HotRecorder {
    seen: HashSet<(u64, u32)>,
    order: Vec<(u64, u32)>,
}

impl HotRecorder {
    fn record(&mut self, ino: u64, first: u32, last: u32) {
        for c in first..=last {
            if self.order.len() < HOT_LIST_MAX && self.seen.insert((ino, c)) {
                self.order.push((ino, c));
            }
        }
    }
    pub fn order(&self) -> &[(u64, u32)] {
        &self.order
    }
    /// Whether reading any of chunks `0..n` of `ino` would add nothing to the list.
    fn covers(&self, ino: u64, n: usize) -> bool {
        self.order.len() >= HOT_LIST_MAX || (0..n as u32).all(|c| self.seen.contains(&(ino, c)))
    }
}

/// How the kernel reads an inode's open files. Every open of an inode must agree: the kernel
/// fails (EIO) a cached open while a passthrough one is active and the reverse, and all
/// passthrough opens of an inode must name the same backing file.
enum OpenMode {
    /// Page cache filled by daemon reads (FOPEN_KEEP_CACHE).
    Cached,
    /// Reads go straight to a local cache file; the id lives until the last open closes.
    Passthrough(Arc<BackingId>),
}

struct OpenInode {
    mode: OpenMode,
    count: u32,
}

type Job = Box<dyn FnOnce() + Send>;

pub struct LayerFs {
    tree: Arc<dyn ImageTree>,
    cache: Arc<NodeCache>,
    jobs: Option<mpsc::Sender<Job>>,
    workers: Vec<std::thread::JoinHandle<()>>,
    hot: Option<Arc<Mutex<HotRecorder>>>,
    /// Background chunk fetches in flight (bounded).
    readahead: Arc<std::sync::atomic::AtomicUsize>,
    /// Inodes with open files; open and release run on the session thread only.
    opens: HashMap<u64, OpenInode>,
    next_fh: u64,
    /// Whether to try passthrough: set when the kernel accepts it at INIT, cleared for good
    /// when it refuses a backing file for a reason that holds for every file.
    passthrough: bool,
}

const MAX_FETCH_AHEAD: usize = 2;

/// A reader that reached the second half of a chunk will likely want the next one: fetch it
/// into the node cache in the background, so sequential reads of a cold file overlap the
/// store's latency instead of paying it chunk by chunk.
fn fetch_ahead(
    cache: &Arc<NodeCache>,
    tree: &dyn ImageTree,
    inflight: &Arc<std::sync::atomic::AtomicUsize>,
    ino: u64,
    end: u64,
) {
    use std::sync::atomic::Ordering;
    let Some((cs, chunks)) = tree.file_chunks(ino) else {
        return;
    };
    let cs = cs as u64;
    if end == 0 || (end - 1) % cs < cs / 2 {
        return;
    }
    let Some(next) = chunks.get(((end - 1) / cs + 1) as usize) else {
        return;
    };
    if cache.contains(&next.digest) {
        return;
    }
    if inflight.fetch_add(1, Ordering::AcqRel) >= MAX_FETCH_AHEAD {
        inflight.fetch_sub(1, Ordering::AcqRel);
        return;
    }
    let (cache, inflight, next) = (cache.clone(), inflight.clone(), next.clone());
    let spawned = std::thread::Builder::new()
        .name("layerfs-ahead".into())
        .spawn({
            let inflight = inflight.clone();
            move || {
                if let Err(e) = cache.get(&next) {
                    debug!("fetch-ahead failed: {e}");
                }
                inflight.fetch_sub(1, Ordering::AcqRel);
            }
        });
    if spawned.is_err() {
        inflight.fetch_sub(1, Ordering::AcqRel);
    }
}

impl LayerFs {
    pub fn new(
        tree: Arc<dyn ImageTree>,
        cache: Arc<NodeCache>,
        hot: Option<Arc<Mutex<HotRecorder>>>,
    ) -> Self {
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let workers = (0..WORKERS)
            .map(|i| {
                let rx = rx.clone();
                std::thread::Builder::new()
                    .name(format!("layerfs-read-{i}"))
                    .spawn(move || loop {
                        let job = match rx.lock().unwrap_or_else(|p| p.into_inner()).recv() {
                            Ok(j) => j,
                            Err(_) => return,
                        };
                        job();
                    })
                    .expect("spawning a read worker")
            })
            .collect();
        LayerFs {
            tree,
            cache,
            jobs: Some(tx),
            workers,
            hot,
            readahead: Arc::new(std::sync::atomic::AtomicUsize::new(0)),
            opens: HashMap::new(),
            next_fh: 0,
            passthrough: false,
        }
    }

    /// A passthrough backing for a first open of `ino`, if its bytes are in one local cache
    /// file and reading it this way loses nothing: with a hot list being recorded, only
    /// files whose chunks are all recorded already (else first touches would go unseen).
    fn backing(&mut self, ino: u64, reply: &ReplyOpen) -> Option<BackingId> {
        if !self.passthrough {
            return None;
        }
        let (_, chunks) = self.tree.file_chunks(ino)?;
        if let Some(hot) = &self.hot {
            if !hot
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .covers(ino, chunks.len())
            {
                return None;
            }
        }
        let file = self.cache.backing_file(chunks)?;
        match reply.open_backing(&file) {
            Ok(id) => Some(id),
            Err(e) => {
                // No passthrough in this kernel or for this process (EPERM: needs
                // CAP_SYS_ADMIN), or the cache dir is on a stacked filesystem (ELOOP).
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EPERM | libc::EOPNOTSUPP | libc::ENOTTY | libc::ELOOP)
                ) {
                    warn!("FUSE passthrough refused ({e}): every read goes through the daemon");
                    self.passthrough = false;
                } else {
                    debug!(ino, "FUSE passthrough backing failed: {e}");
                }
                None
            }
        }
    }
}

impl Drop for LayerFs {
    fn drop(&mut self) {
        self.jobs = None;
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

fn file_type(k: FileKind) -> FileType {
    match k {
        FileKind::Dir => FileType::Directory,
        FileKind::File => FileType::RegularFile,
        FileKind::Symlink => FileType::Symlink,
        FileKind::Char => FileType::CharDevice,
        FileKind::Block => FileType::BlockDevice,
        FileKind::Fifo => FileType::NamedPipe,
        FileKind::Socket => FileType::Socket,
    }
}

fn to_fuse(a: &Attr) -> FileAttr {
    // Times come from layer input: out-of-range values clamp to the epoch, never panic.
    let t = if a.mtime >= 0 {
        UNIX_EPOCH.checked_add(Duration::new(a.mtime as u64, a.mtime_nsec.min(999_999_999)))
    } else {
        UNIX_EPOCH
            .checked_sub(Duration::from_secs(a.mtime.unsigned_abs()))
            .and_then(|t| t.checked_add(Duration::from_nanos(a.mtime_nsec as u64)))
    }
    .unwrap_or(UNIX_EPOCH);
    let (major, minor) = (libc::major(a.rdev), libc::minor(a.rdev));
    FileAttr {
        ino: a.ino,
        size: a.size,
        blocks: a.size.div_ceil(512),
        atime: t,
        mtime: t,
        ctime: t,
        crtime: t,
        kind: file_type(a.kind),
        perm: a.perm as u16,
        nlink: a.nlink,
        uid: a.uid,
        gid: a.gid,
        // The kernel decodes FUSE rdev with new_decode_dev.
        rdev: (minor & 0xff) | (major << 8) | ((minor & !0xff) << 12),
        blksize: 4096,
        flags: 0,
    }
}

fn negative_entry() -> FileAttr {
    FileAttr {
        ino: 0,
        size: 0,
        blocks: 0,
        atime: UNIX_EPOCH,
        mtime: UNIX_EPOCH,
        ctime: UNIX_EPOCH,
        crtime: UNIX_EPOCH,
        kind: FileType::RegularFile,
        perm: 0,
        nlink: 0,
        uid: 0,
        gid: 0,
        rdev: 0,
        blksize: 4096,
        flags: 0,
    }
}

impl Filesystem for LayerFs {
    fn init(
        &mut self,
        _req: &Request<'_>,
        config: &mut KernelConfig,
    ) -> std::result::Result<(), libc::c_int> {
        // Large readahead: sequential reads then ask for whole chunks. The kernel caps this
        // at what it offered (often 128 KiB); `raise_readahead` lifts the bdi afterwards.
        if let Err(max) = config.set_max_readahead(READAHEAD_KB << 10) {
            let _ = config.set_max_readahead(max);
        }
        // Stack depth 1: backing files on a plain filesystem, and the mount itself can still
        // be an overlayfs lowerdir (overlayfs adds a level; the kernel allows two).
        self.passthrough = config
            .add_capabilities(fuser::consts::FUSE_PASSTHROUGH)
            .is_ok()
            && config.set_max_stack_depth(1).is_ok();
        if !self.passthrough {
            debug!("the kernel offers no FUSE passthrough: every read goes through the daemon");
        }
        // Container sandboxes see the image through an idmapped mount of this one (their
        // root is an unprivileged host uid); permissions are checked by the kernel from the
        // modes (default_permissions), so ids mapped at the mount are all that is needed.
        if config.add_capabilities(FUSE_ALLOW_IDMAP).is_err() {
            debug!("the kernel does not offer FUSE_ALLOW_IDMAP (Linux < 6.12): container sandboxes cannot use this mount");
        }
        Ok(())
    }

    fn lookup(&mut self, _req: &Request<'_>, parent: u64, name: &OsStr, reply: ReplyEntry) {
        let found = name
            .to_str()
            .and_then(|n| self.tree.lookup(parent, n))
            .and_then(|ino| self.tree.attr(ino));
        match found {
            Some(a) => reply.entry(&TTL, &to_fuse(&a), 0),
            // A negative entry (node id 0) the kernel may cache: the tree never changes, and
            // language runtimes probe many paths that do not exist.
            None => reply.entry(&TTL, &negative_entry(), 0),
        }
    }

    fn getattr(&mut self, _req: &Request<'_>, ino: u64, _fh: Option<u64>, reply: ReplyAttr) {
        match self.tree.attr(ino) {
            Some(a) => reply.attr(&TTL, &to_fuse(&a)),
            None => reply.error(libc::ENOENT),
        }
    }

    fn readlink(&mut self, _req: &Request<'_>, ino: u64, reply: ReplyData) {
        match self.tree.readlink(ino) {
            Some(t) => reply.data(t.as_bytes()),
            None => reply.error(libc::EINVAL),
        }
    }

    fn open(&mut self, _req: &Request<'_>, ino: u64, flags: i32, reply: ReplyOpen) {
        if flags & libc::O_ACCMODE != libc::O_RDONLY || flags & libc::O_TRUNC != 0 {
            return reply.error(libc::EROFS);
        }
        match self.tree.attr(ino) {
            Some(a) if a.kind == FileKind::File => {}
            Some(_) => return reply.error(libc::EINVAL),
            None => return reply.error(libc::ENOENT),
        }
        self.next_fh += 1;
        let fh = self.next_fh;
        if !self.opens.contains_key(&ino) {
            // A new open decides the mode; later ones follow it until the last closes.
            let mode = match self.backing(ino, &reply) {
                Some(id) => OpenMode::Passthrough(Arc::new(id)),
                None => OpenMode::Cached,
            };
            self.opens.insert(ino, OpenInode { mode, count: 0 });
        }
        let open = self.opens.get_mut(&ino).expect("inserted above");
        open.count += 1;
        match &open.mode {
            OpenMode::Cached => reply.opened(fh, fuser::consts::FOPEN_KEEP_CACHE),
            OpenMode::Passthrough(id) => {
                self.cache
                    .stats
                    .passthrough_opens
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                // No KEEP_CACHE: the kernel refuses it with passthrough (no FUSE page cache).
                reply.opened_passthrough(fh, 0, id)
            }
        }
    }

    fn release(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _fh: u64,
        _flags: i32,
        _lock_owner: Option<u64>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        // The kernel has already left this open's io mode when it sends RELEASE, so a later
        // open may pick a new mode once the count is 0.
        reply.ok();
        let Some(open) = self.opens.get_mut(&ino) else {
            return;
        };
        open.count = open.count.saturating_sub(1);
        let cached = matches!(open.mode, OpenMode::Cached);
        if open.count == 0 {
            // Drops the backing id, if any: the kernel keeps its own reference while needed.
            self.opens.remove(&ino);
        }
        if cached && self.passthrough {
            // Read through the daemon this time: a flat copy lets the next open pass through.
            if let Some((_, chunks)) = self.tree.file_chunks(ino) {
                self.cache.build_flat_in_background(chunks);
            }
        }
    }

    fn read(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _fh: u64,
        offset: i64,
        size: u32,
        _flags: i32,
        _lock_owner: Option<u64>,
        reply: ReplyData,
    ) {
        if offset < 0 {
            return reply.error(libc::EINVAL);
        }
        self.cache
            .stats
            .daemon_reads
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if let (Some(hot), Some((cs, chunks))) = (&self.hot, self.tree.file_chunks(ino)) {
            if !chunks.is_empty() && size > 0 {
                let first = (offset as u64 / cs as u64) as u32;
                let last = ((offset as u64 + size as u64 - 1) / cs as u64)
                    .min(chunks.len() as u64 - 1) as u32;
                if first <= last {
                    hot.lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .record(ino, first, last);
                }
            }
        }
        let tree = self.tree.clone();
        let cache = self.cache.clone();
        let readahead = self.readahead.clone();
        let job: Job = Box::new(move || {
            // The reply is sent once: data from inside with_data, or the error after it.
            let mut reply = Some(reply);
            let res = READ_BUF.with_borrow_mut(|buf| {
                cache.with_data(tree.as_ref(), ino, offset as u64, size, buf, |data| {
                    if let Some(r) = reply.take() {
                        r.data(data)
                    }
                })
            });
            if let Err(e) = res {
                warn!(ino, offset, size, "read failed: {e}");
                if let Some(r) = reply.take() {
                    r.error(e.errno());
                }
                return;
            }
            fetch_ahead(
                &cache,
                tree.as_ref(),
                &readahead,
                ino,
                offset as u64 + size as u64,
            );
        });
        if let Some(tx) = &self.jobs {
            if let Err(mpsc::SendError(job)) = tx.send(job) {
                job();
            }
        }
    }

    fn opendir(&mut self, _req: &Request<'_>, ino: u64, _flags: i32, reply: ReplyOpen) {
        match self.tree.children(ino) {
            Some(_) => reply.opened(0, fuser::consts::FOPEN_KEEP_CACHE),
            None => reply.error(libc::ENOTDIR),
        }
    }

    fn readdir(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _fh: u64,
        offset: i64,
        mut reply: ReplyDirectory,
    ) {
        let Some(kids) = self.tree.children(ino) else {
            return reply.error(libc::ENOTDIR);
        };
        let parent = self.tree.parent(ino).unwrap_or(ino);
        let total = kids.len() as i64 + 2;
        let mut i = offset.max(0);
        while i < total {
            let (name, cino, kind) = match i {
                0 => (".", ino, FileType::Directory),
                1 => ("..", parent, FileType::Directory),
                _ => {
                    let (n, c) = &kids[(i - 2) as usize];
                    let k = self
                        .tree
                        .attr(*c)
                        .map(|a| file_type(a.kind))
                        .unwrap_or(FileType::RegularFile);
                    (n.as_str(), *c, k)
                }
            };
            if reply.add(cino, i + 1, kind, name) {
                break;
            }
            i += 1;
        }
        reply.ok()
    }

    fn statfs(&mut self, _req: &Request<'_>, _ino: u64, reply: ReplyStatfs) {
        reply.statfs(0, 0, 0, self.tree.inode_count(), 0, 4096, 255, 4096);
    }

    fn getxattr(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        name: &OsStr,
        size: u32,
        reply: ReplyXattr,
    ) {
        let v = name
            .to_str()
            .and_then(|n| self.tree.xattrs(ino).and_then(|x| x.get(n)));
        match v {
            None => reply.error(libc::ENODATA),
            Some(v) if size == 0 => reply.size(v.0.len() as u32),
            Some(v) if v.0.len() > size as usize => reply.error(libc::ERANGE),
            Some(v) => reply.data(&v.0),
        }
    }

    fn listxattr(&mut self, _req: &Request<'_>, ino: u64, size: u32, reply: ReplyXattr) {
        let Some(x) = self.tree.xattrs(ino) else {
            return reply.error(libc::ENOENT);
        };
        let mut buf = Vec::new();
        for k in x.keys() {
            buf.extend_from_slice(k.as_bytes());
            buf.push(0);
        }
        if size == 0 {
            reply.size(buf.len() as u32)
        } else if buf.len() > size as usize {
            reply.error(libc::ERANGE)
        } else {
            reply.data(&buf)
        }
    }

    fn access(&mut self, _req: &Request<'_>, ino: u64, mask: i32, reply: ReplyEmpty) {
        if self.tree.attr(ino).is_none() {
            reply.error(libc::ENOENT)
        } else if mask & libc::W_OK != 0 {
            reply.error(libc::EROFS)
        } else {
            reply.ok()
        }
    }
}

/// A mounted view; dropping it (or `unmount`) unmounts.
pub struct Mount {
    session: Option<fuser::BackgroundSession>,
    pub hot: Option<Arc<Mutex<HotRecorder>>>,
    pub tree: Arc<dyn ImageTree>,
    mountpoint: std::path::PathBuf,
}

impl std::fmt::Debug for Mount {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mount")
            .field("mountpoint", &self.mountpoint)
            .finish()
    }
}

impl Mount {
    /// Unmounts and waits for the session to end. If files are still open the mount is
    /// detached lazily instead (it disappears from the namespace at once, the session
    /// ends when the last file closes) so this never hangs.
    pub fn unmount(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        let Some(s) = self.session.take() else { return };
        let c = match std::ffi::CString::new(self.mountpoint.as_os_str().as_encoded_bytes()) {
            Ok(c) => c,
            Err(_) => return,
        };
        // SAFETY: c is a valid NUL-terminated path.
        if unsafe { libc::umount2(c.as_ptr(), 0) } == 0 {
            s.join();
            return;
        }
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::EBUSY) {
            warn!(mountpoint = %self.mountpoint.display(), "mount busy: detaching lazily");
            // SAFETY: as above.
            unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
            drop(s);
        } else {
            // Already gone (unmounted from outside): the session thread has ended or will.
            s.join();
        }
    }

    /// Hot list as (path, chunk index) in first-touch order.
    pub fn hot_list(&self) -> Vec<(String, u32)> {
        let Some(h) = &self.hot else {
            return Vec::new();
        };
        let h = h.lock().unwrap_or_else(|p| p.into_inner());
        h.order()
            .iter()
            .filter_map(|(ino, c)| Some((self.tree.path(*ino)?, *c)))
            .collect()
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// FUSE starts with the kernel's 128 KiB readahead whatever the daemon asks; raising the
/// mount's bdi readahead to several chunks lets sequential readers keep several requests in
/// flight. Best effort: needs root and sysfs. The stat is a GETATTR, which the kernel holds
/// until the daemon has answered INIT, so INIT (which clamps the bdi readahead to the
/// daemon's max_readahead) cannot undo the write.
fn raise_readahead(mountpoint: &Path) {
    use std::os::unix::fs::MetadataExt;
    if let Ok(md) = std::fs::metadata(mountpoint) {
        let dev = md.dev();
        let p = format!(
            "/sys/class/bdi/{}:{}/read_ahead_kb",
            libc::major(dev),
            libc::minor(dev)
        );
        if let Err(e) = std::fs::write(&p, READAHEAD_KB.to_string()) {
            debug!("could not raise readahead via {p}: {e}");
        }
    }
}

/// Mounts `tree` read-only at `mountpoint`. `record_hot` keeps the access order for a hot
/// list. Device nodes and setuid bits work (this is a root filesystem); the kernel checks
/// permissions from the modes (default_permissions).
pub fn mount(
    tree: Arc<dyn ImageTree>,
    cache: Arc<NodeCache>,
    mountpoint: &Path,
    record_hot: bool,
) -> Result<Mount> {
    let hot = record_hot.then(|| Arc::new(Mutex::new(HotRecorder::default())));
    let fs = LayerFs::new(tree.clone(), cache, hot.clone());
    let opts = [
        MountOption::RO,
        MountOption::FSName("layerfs".into()),
        MountOption::Subtype("layerfs".into()),
        MountOption::DefaultPermissions,
        MountOption::AllowOther,
        MountOption::Dev,
        MountOption::Suid,
        MountOption::Exec,
    ];
    let session = fuser::spawn_mount2(fs, mountpoint, &opts).map_err(|e| {
        Error::io(
            "mounting FUSE at",
            mountpoint,
            std::io::Error::new(
                e.kind(),
                format!("{e} (needs root or fusermount3, and /dev/fuse)"),
            ),
        )
    })?;
    raise_readahead(mountpoint);
    debug!(mountpoint = %mountpoint.display(), "layerfs mounted");
    Ok(Mount {
        session: Some(session),
        hot,
        tree,
        mountpoint: mountpoint.to_path_buf(),
    })
}
