//! Lazy restore: guest memory starts empty and a handler thread fills each page from the
//! snapshot on first touch, through userfaultfd. Pages the guest (or balloon) discards are
//! served as zeroes afterwards. A recorded working set can be loaded in the background first.
//!
//! The userfaultfd ABI is a handful of stable structs and ioctls; declaring them here avoids
//! a bindgen/libclang build dependency.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vm_memory::{GuestMemoryBackend, GuestMemoryRegion, MemoryRegionAddress};
use vmm_sys_util::ioctl::ioctl_with_mut_ref;
use vmm_sys_util::{ioctl_ior_nr, ioctl_iowr_nr};

use crate::memory::{GuestMemory, RegionLayout, PAGE_SIZE};

#[repr(C)]
#[derive(Default)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}
#[repr(C)]
#[derive(Default, Clone, Copy)]
struct UffdioRange {
    start: u64,
    len: u64,
}
#[repr(C)]
#[derive(Default)]
struct UffdioRegister {
    range: UffdioRange,
    mode: u64,
    ioctls: u64,
}
#[repr(C)]
#[derive(Default)]
struct UffdioCopy {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    copy: i64,
}
#[repr(C)]
#[derive(Default)]
struct UffdioZeropage {
    range: UffdioRange,
    mode: u64,
    zeropage: i64,
}
/// `struct uffd_msg`: 8 bytes of header, then a 24-byte union.
#[repr(C)]
#[derive(Default, Clone, Copy)]
struct UffdMsg {
    event: u8,
    reserved1: u8,
    reserved2: u16,
    reserved3: u32,
    arg0: u64,
    arg1: u64,
    arg2: u64,
}
const _: () = assert!(std::mem::size_of::<UffdMsg>() == 32);

const UFFDIO: u32 = 0xAA;
ioctl_iowr_nr!(UFFDIO_API, UFFDIO, 0x3F, UffdioApi);
ioctl_iowr_nr!(UFFDIO_REGISTER, UFFDIO, 0x00, UffdioRegister);
ioctl_ior_nr!(UFFDIO_WAKE, UFFDIO, 0x02, UffdioRange);
ioctl_iowr_nr!(UFFDIO_COPY, UFFDIO, 0x03, UffdioCopy);
ioctl_iowr_nr!(UFFDIO_ZEROPAGE, UFFDIO, 0x04, UffdioZeropage);

const UFFD_API: u64 = 0xAA;
const UFFD_FEATURE_EVENT_REMOVE: u64 = 1 << 3;
const UFFDIO_REGISTER_MODE_MISSING: u64 = 1;
const UFFD_EVENT_PAGEFAULT: u8 = 0x12;
const UFFD_EVENT_REMOVE: u8 = 0x15;

#[derive(Debug, thiserror::Error)]
pub enum UffdError {
    #[error("cannot create a userfaultfd: {0} (needs root or vm.unprivileged_userfaultfd=1)")]
    Create(std::io::Error),
    #[error("userfaultfd {what} failed: {source}")]
    Ioctl {
        what: &'static str,
        source: std::io::Error,
    },
    #[error("cannot start the page-fault handler: {0}")]
    Thread(std::io::Error),
}

/// Where each guest page's bytes come from: the full snapshot's memory file, overlaid by
/// the pages of each diff snapshot on top of it.
pub struct PageSource {
    base: File,
    diffs: Vec<File>,
    /// File page number -> index into `diffs` holding its newest copy.
    overlay: HashMap<u64, usize>,
}

impl PageSource {
    pub fn new(base: File) -> Self {
        PageSource {
            base,
            diffs: Vec::new(),
            overlay: HashMap::new(),
        }
    }

    /// Adds a diff snapshot (apply in chain order, oldest first).
    pub fn push_diff(&mut self, file: File, pages: &[u64]) {
        let index = self.diffs.len();
        self.diffs.push(file);
        for &page in pages {
            self.overlay.insert(page, index);
        }
    }

    /// Reads one page; `false` when it is all zeroes (a hole in the file).
    fn read(&self, file_page: u64, buf: &mut [u8]) -> std::io::Result<bool> {
        let file = match self.overlay.get(&file_page) {
            Some(&i) => &self.diffs[i],
            None => &self.base,
        };
        file.read_exact_at(buf, file_page * PAGE_SIZE as u64)?;
        Ok(buf.iter().any(|&b| b != 0))
    }
}

/// Lazy-restore settings.
#[derive(Clone, Debug, Default)]
pub struct LazyOptions {
    /// File pages to load in the background, in this order, before they are touched.
    pub prefetch: Vec<u64>,
    /// Record the pages faulted during this window after start into `record_path`.
    pub record: Option<(PathBuf, Duration)>,
}

/// Counters the perf harness and tests read.
#[derive(Default)]
pub struct UffdStats {
    pub faults: AtomicU64,
    pub prefetched: AtomicU64,
    pub zero_pages: AtomicU64,
    pub removed: AtomicU64,
}

/// The running handler; dropping it stops the thread.
pub struct UffdHandler {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    pub stats: Arc<UffdStats>,
}

impl Drop for UffdHandler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct HostRegion {
    host: u64,
    size: u64,
    file_offset: u64,
}

fn ioctl_err(what: &'static str) -> impl Fn(std::io::Error) -> UffdError {
    move |source| UffdError::Ioctl { what, source }
}

/// Registers all of `mem` (which must be freshly mapped, untouched anonymous memory) with a
/// new userfaultfd and serves its faults from `source`.
pub fn start(
    mem: &GuestMemory,
    layout: &[RegionLayout],
    source: PageSource,
    options: LazyOptions,
) -> Result<UffdHandler, UffdError> {
    // SAFETY: a plain syscall with flag arguments; the result is checked below.
    let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | libc::O_NONBLOCK) };
    if fd < 0 {
        return Err(UffdError::Create(std::io::Error::last_os_error()));
    }
    // SAFETY: `fd` is a fresh descriptor we own exclusively.
    let uffd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let mut api = UffdioApi {
        api: UFFD_API,
        features: UFFD_FEATURE_EVENT_REMOVE,
        ioctls: 0,
    };
    // SAFETY: UFFDIO_API reads and writes exactly one `UffdioApi`.
    if unsafe { ioctl_with_mut_ref(&uffd, UFFDIO_API(), &mut api) } < 0 {
        return Err(ioctl_err("API handshake")(std::io::Error::last_os_error()));
    }
    let mut regions = Vec::new();
    for (region, l) in mem.iter().zip(layout) {
        let host = region
            .get_host_address(MemoryRegionAddress(0))
            .map_err(|e| ioctl_err("region address")(std::io::Error::other(e.to_string())))?
            as u64;
        let mut reg = UffdioRegister {
            range: UffdioRange {
                start: host,
                len: region.len(),
            },
            mode: UFFDIO_REGISTER_MODE_MISSING,
            ioctls: 0,
        };
        // SAFETY: UFFDIO_REGISTER reads and writes one `UffdioRegister`; the range is our
        // own live mapping.
        if unsafe { ioctl_with_mut_ref(&uffd, UFFDIO_REGISTER(), &mut reg) } < 0 {
            return Err(ioctl_err("register guest memory")(
                std::io::Error::last_os_error(),
            ));
        }
        regions.push(HostRegion {
            host,
            size: region.len(),
            file_offset: l.file_offset,
        });
    }
    let stop = Arc::new(AtomicBool::new(false));
    let stats = Arc::new(UffdStats::default());
    let total_pages = layout
        .iter()
        .map(|l| (l.file_offset + l.size) / PAGE_SIZE as u64)
        .max()
        .unwrap_or(0);
    let mut server = Server {
        uffd,
        regions,
        source,
        served: vec![false; total_pages as usize],
        removed: vec![false; total_pages as usize],
        stats: stats.clone(),
        buf: vec![0u8; PAGE_SIZE],
    };
    let thread = {
        let stop = stop.clone();
        std::thread::Builder::new()
            .name("uffd".into())
            .spawn(move || {
                crate::seccomp::install_or_exit(crate::seccomp::ThreadKind::Vmm);
                server.run(&stop, options)
            })
            .map_err(UffdError::Thread)?
    };
    Ok(UffdHandler {
        stop,
        thread: Some(thread),
        stats,
    })
}

struct Server {
    uffd: OwnedFd,
    regions: Vec<HostRegion>,
    source: PageSource,
    served: Vec<bool>,
    removed: Vec<bool>,
    stats: Arc<UffdStats>,
    buf: Vec<u8>,
}

impl Server {
    fn run(&mut self, stop: &AtomicBool, options: LazyOptions) {
        let started = Instant::now();
        let mut prefetch = options.prefetch.into_iter();
        let mut prefetch_done = false;
        let mut recorded: Vec<u64> = Vec::new();
        let mut record = options.record;
        while !stop.load(Ordering::SeqCst) {
            // Faults first; background prefetch only while nothing is waiting.
            let timeout = if prefetch_done { 50 } else { 0 };
            let mut pfd = libc::pollfd {
                fd: self.uffd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd for the duration of the call.
            let ready = unsafe { libc::poll(&mut pfd, 1, timeout) };
            if ready > 0 {
                self.drain_events(record.is_some().then_some(&mut recorded));
            } else if !prefetch_done {
                // A small batch, then look for faults again.
                for _ in 0..16 {
                    match prefetch.next() {
                        Some(page) => {
                            if self.serve_page(page, false) {
                                self.stats.prefetched.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        None => {
                            prefetch_done = true;
                            break;
                        }
                    }
                }
            }
            if let Some((path, window)) = &record {
                if started.elapsed() >= *window {
                    write_working_set(path, &recorded);
                    record = None;
                }
            }
        }
        if let Some((path, _)) = record {
            write_working_set(&path, &recorded);
        }
    }

    fn drain_events(&mut self, mut recorded: Option<&mut Vec<u64>>) {
        loop {
            let mut msg = UffdMsg::default();
            // SAFETY: reading at most one `UffdMsg` into a properly sized local.
            let n = unsafe {
                libc::read(
                    self.uffd.as_raw_fd(),
                    (&mut msg as *mut UffdMsg).cast(),
                    std::mem::size_of::<UffdMsg>(),
                )
            };
            if n != std::mem::size_of::<UffdMsg>() as isize {
                return; // EAGAIN: drained
            }
            match msg.event {
                UFFD_EVENT_PAGEFAULT => {
                    let addr = msg.arg1 & !(PAGE_SIZE as u64 - 1);
                    let Some(page) = self.file_page(addr) else {
                        tracing::warn!("fault outside guest memory at {addr:#x}");
                        continue;
                    };
                    self.stats.faults.fetch_add(1, Ordering::Relaxed);
                    if let Some(r) = recorded.as_deref_mut() {
                        r.push(page);
                    }
                    self.serve_page(page, true);
                }
                UFFD_EVENT_REMOVE => self.mark_removed(msg.arg0, msg.arg1),
                _ => {}
            }
        }
    }

    fn file_page(&self, host_addr: u64) -> Option<u64> {
        self.regions
            .iter()
            .find(|r| host_addr >= r.host && host_addr < r.host + r.size)
            .map(|r| (r.file_offset + (host_addr - r.host)) / PAGE_SIZE as u64)
    }

    fn host_addr(&self, file_page: u64) -> Option<u64> {
        let offset = file_page * PAGE_SIZE as u64;
        self.regions
            .iter()
            .find(|r| offset >= r.file_offset && offset < r.file_offset + r.size)
            .map(|r| r.host + (offset - r.file_offset))
    }

    /// Pages the guest gave back (balloon, MADV_DONTNEED) must read as zero from now on.
    fn mark_removed(&mut self, start: u64, end: u64) {
        let mut addr = start & !(PAGE_SIZE as u64 - 1);
        while addr < end {
            if let Some(page) = self.file_page(addr) {
                self.removed[page as usize] = true;
                self.served[page as usize] = false;
                self.stats.removed.fetch_add(1, Ordering::Relaxed);
            }
            addr += PAGE_SIZE as u64;
        }
    }

    /// Populates one page; returns whether it was newly populated.
    fn serve_page(&mut self, page: u64, faulted: bool) -> bool {
        let Some(dst) = self.host_addr(page) else {
            return false;
        };
        if self.served.get(page as usize).copied().unwrap_or(true) {
            if faulted {
                self.wake(dst);
            }
            return false;
        }
        let data = !self.removed[page as usize]
            && match self.source.read(page, &mut self.buf) {
                Ok(nonzero) => nonzero,
                Err(e) => {
                    tracing::error!("cannot read snapshot page {page}: {e}; serving zeroes");
                    false
                }
            };
        let result = if data {
            let mut copy = UffdioCopy {
                dst,
                src: self.buf.as_ptr() as u64,
                len: PAGE_SIZE as u64,
                mode: 0,
                copy: 0,
            };
            // SAFETY: copies one page from our buffer into our registered mapping.
            unsafe { ioctl_with_mut_ref(&self.uffd, UFFDIO_COPY(), &mut copy) }
        } else {
            let mut zero = UffdioZeropage {
                range: UffdioRange {
                    start: dst,
                    len: PAGE_SIZE as u64,
                },
                mode: 0,
                zeropage: 0,
            };
            self.stats.zero_pages.fetch_add(1, Ordering::Relaxed);
            // SAFETY: maps the zero page at one page of our registered mapping.
            unsafe { ioctl_with_mut_ref(&self.uffd, UFFDIO_ZEROPAGE(), &mut zero) }
        };
        self.served[page as usize] = true;
        if result < 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EEXIST) {
                // Someone populated it first; make sure a waiting thread retries.
                if faulted {
                    self.wake(dst);
                }
            } else {
                tracing::error!("cannot populate guest page {page}: {err}");
            }
            return false;
        }
        true
    }

    fn wake(&self, dst: u64) {
        let mut range = UffdioRange {
            start: dst,
            len: PAGE_SIZE as u64,
        };
        // SAFETY: UFFDIO_WAKE reads one range inside our registered mapping.
        unsafe { ioctl_with_mut_ref(&self.uffd, UFFDIO_WAKE(), &mut range) };
    }
}

fn write_working_set(path: &std::path::Path, pages: &[u64]) {
    let mut seen = std::collections::HashSet::new();
    let ordered: Vec<u64> = pages.iter().copied().filter(|p| seen.insert(*p)).collect();
    let tmp = path.with_extension("tmp");
    let result = serde_json::to_vec(&ordered)
        .map_err(std::io::Error::other)
        .and_then(|bytes| std::fs::write(&tmp, bytes))
        .and_then(|_| std::fs::rename(&tmp, path));
    if let Err(e) = result {
        tracing::warn!("cannot save the working set to {}: {e}", path.display());
    }
}

/// Reads a working set written by a recorded restore (bounded to the guest's page count).
pub fn read_working_set(path: &std::path::Path, max_pages: u64) -> Vec<u64> {
    std::fs::read(path)
        .ok()
        .and_then(|b| serde_json::from_slice::<Vec<u64>>(&b).ok())
        .map(|v| v.into_iter().filter(|&p| p < max_pages).collect())
        .unwrap_or_default()
}
