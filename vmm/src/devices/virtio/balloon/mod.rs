//! virtio-balloon (device id 5): the host sets a target size (`num_pages`), the guest hands
//! that many 4 KiB page frames over on the inflate queue and the host drops them with
//! `madvise(MADV_DONTNEED)`; deflate gives them back (they fault in again as zero pages).
//! Optional: a statistics queue polled at a fixed interval, free page reporting (reported
//! ranges are dropped like inflated pages) and deflate-on-OOM (a feature bit only).
//!
//! Every page frame and range comes from the guest and is checked against guest RAM: a bad
//! one is counted, logged (the first few) and skipped.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use virtio_queue::{DescriptorChain, Queue, QueueT, Reader};
use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryRegion, MemoryRegionAddress};

use super::worker::{drain_queue, QueueHandler};
use super::{ActivateError, Interrupt, VirtioCommon, VirtioDevice, VIRTIO_F_VERSION_1};
use crate::config::BalloonConfig;
use crate::memory::{GuestMemory, PAGE_SIZE};
use crate::sync::lock;

mod persist;
#[cfg(test)]
mod tests;

pub use persist::{BalloonRestoreError, BalloonState};

pub const VIRTIO_ID_BALLOON: u32 = 5;
pub const F_STATS_VQ: u64 = 1 << 1;
pub const F_DEFLATE_ON_OOM: u64 = 1 << 2;
pub const F_REPORTING: u64 = 1 << 5;
const QUEUE_SIZE: u16 = 256;
/// Balloon page frames are 4 KiB whatever the guest's page size.
const PFN_SHIFT: u32 = 12;
/// Page frames read from one chain at most (1 GiB worth; Linux sends 256 at a time).
pub const MAX_PFNS_PER_CHAIN: usize = 1 << 18;
/// Statistics entries read from one buffer at most (Linux sends about a dozen).
const MAX_STATS: usize = 64;
/// Bad guest input is logged this many times, then only counted.
const LOG_LIMIT: u64 = 16;
const MIB_PAGES: u64 = (1 << 20) / PAGE_SIZE as u64;

/// What went wrong with a balloon request.
#[derive(Debug, thiserror::Error)]
pub enum BalloonError {
    #[error("balloon target of {requested} MiB is more than the guest's {mem_mib} MiB; ask for at most {mem_mib} MiB")]
    TargetTooLarge { requested: u64, mem_mib: u64 },
    #[error("guest range {addr:#x}+{len:#x} is not inside guest RAM")]
    OutOfRange { addr: u64, len: u64 },
    #[error("cannot drop guest pages at {addr:#x}+{len:#x}: madvise failed: {source}")]
    Madvise {
        addr: u64,
        len: u64,
        source: std::io::Error,
    },
}

/// Which job a queue does; the indices depend on the negotiated features (Linux numbers
/// only the queues it uses: inflate, deflate, then stats and reporting if acked).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Inflate,
    Deflate,
    Stats,
    Reporting,
}

/// The queue roles for `features` in index order.
pub fn roles(features: u64) -> Vec<Role> {
    let mut r = vec![Role::Inflate, Role::Deflate];
    if features & F_STATS_VQ != 0 {
        r.push(Role::Stats);
    }
    if features & F_REPORTING != 0 {
        r.push(Role::Reporting);
    }
    r
}

/// Running totals, for the control socket and the tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    pub inflated_pages: u64,
    pub deflated_pages: u64,
    pub reported_bytes: u64,
    /// Page frames or ranges outside guest RAM (skipped).
    pub bad_pfns: u64,
    /// Chains that could not be read at all (returned unused).
    pub bad_chains: u64,
}

#[derive(Default)]
struct Inner {
    num_pages: u32,
    actual: u32,
    stats: BTreeMap<u16, u64>,
    stats_at: Option<Instant>,
    /// The stats buffer the device holds until it wants fresh numbers.
    stats_head: Option<u16>,
    counters: Counters,
    interrupt: Option<Arc<Interrupt>>,
}

/// The host's handle on the balloon: target, actual size, statistics. Shared by the device,
/// its queue thread and the control socket.
pub struct BalloonControl {
    mem_mib: u64,
    inner: Mutex<Inner>,
}

/// What the control socket's `balloon` op reports.
#[derive(Clone, Debug, Serialize)]
pub struct BalloonStatus {
    pub target_mib: u64,
    pub target_pages: u32,
    pub actual_mib: u64,
    pub actual_pages: u32,
    /// The guest's last statistics by name (Linux's VIRTIO_BALLOON_S_* tags).
    pub stats: BTreeMap<String, u64>,
    /// How long ago they arrived (None: never).
    pub stats_age_ms: Option<u64>,
    #[serde(flatten)]
    pub counters: Counters,
}

impl BalloonControl {
    pub fn new(mem_mib: u64) -> Self {
        BalloonControl {
            mem_mib,
            inner: Mutex::new(Inner::default()),
        }
    }

    /// Sets the balloon target (how much memory the guest should hand over) and tells the
    /// guest through a config-change interrupt.
    pub fn set_target_mib(&self, mib: u64) -> Result<(), BalloonError> {
        if mib > self.mem_mib {
            return Err(BalloonError::TargetTooLarge {
                requested: mib,
                mem_mib: self.mem_mib,
            });
        }
        let mut inner = lock(&self.inner);
        // mem_mib is validated against host memory, so the page count fits in u32.
        inner.num_pages = u32::try_from(mib * MIB_PAGES).unwrap_or(u32::MAX);
        if let Some(i) = &inner.interrupt {
            i.signal_config_change();
        }
        Ok(())
    }

    /// The snapshot state (the device thread must be paused for `stats_head` to be current).
    pub fn state(&self) -> BalloonState {
        let inner = lock(&self.inner);
        BalloonState {
            num_pages: inner.num_pages,
            actual: inner.actual,
            stats: inner.stats.iter().map(|(&t, &v)| (t, v)).collect(),
            stats_head: inner.stats_head,
            counters: inner.counters,
        }
    }

    pub fn status(&self) -> BalloonStatus {
        let inner = lock(&self.inner);
        BalloonStatus {
            target_mib: u64::from(inner.num_pages) / MIB_PAGES,
            target_pages: inner.num_pages,
            actual_mib: u64::from(inner.actual) / MIB_PAGES,
            actual_pages: inner.actual,
            stats: inner
                .stats
                .iter()
                .map(|(&tag, &v)| (stat_name(tag), v))
                .collect(),
            stats_age_ms: inner.stats_at.map(|t| t.elapsed().as_millis() as u64),
            counters: inner.counters,
        }
    }
}

/// Linux's names for the statistics tags (include/uapi/linux/virtio_balloon.h).
pub fn stat_name(tag: u16) -> String {
    const NAMES: [&str; 16] = [
        "swap_in",
        "swap_out",
        "major_faults",
        "minor_faults",
        "free_memory",
        "total_memory",
        "available_memory",
        "disk_caches",
        "hugetlb_allocations",
        "hugetlb_failures",
        "oom_kills",
        "alloc_stalls",
        "async_scans",
        "direct_scans",
        "async_reclaims",
        "direct_reclaims",
    ];
    NAMES
        .get(usize::from(tag))
        .map_or_else(|| format!("tag_{tag}"), |n| n.to_string())
}

/// Drops `len` bytes of guest memory at guest address `addr` from the host (they read as
/// zeroes, or as the snapshot file's contents for a restored VM, when touched again). Only
/// whole pages inside the range are dropped; the range must lie in one RAM region.
pub fn discard(mem: &GuestMemory, addr: u64, len: u64) -> Result<(), BalloonError> {
    let out = || BalloonError::OutOfRange { addr, len };
    let end = addr.checked_add(len).ok_or_else(out)?;
    let page = PAGE_SIZE as u64;
    let (start, end) = (addr.div_ceil(page) * page, end / page * page);
    if len == 0 || start >= end {
        return Ok(());
    }
    let region = mem.find_region(GuestAddress(start)).ok_or_else(out)?;
    let offset = start - region.start_addr().0;
    let size = end - start;
    if offset.checked_add(size).is_none_or(|e| e > region.len()) {
        return Err(out());
    }
    let host = region
        .get_host_address(MemoryRegionAddress(offset))
        .map_err(|_| out())?;
    // SAFETY: [host, host + size) lies inside this region's live mapping (checked above), and
    // is page aligned. MADV_DONTNEED on our private mapping only replaces the contents with
    // fresh pages; the VMM holds no Rust references into guest memory (all accesses are
    // volatile copies), so nothing observes the change as undefined behaviour.
    let rc = unsafe { libc::madvise(host.cast(), size as usize, libc::MADV_DONTNEED) };
    if rc != 0 {
        return Err(BalloonError::Madvise {
            addr,
            len,
            source: std::io::Error::last_os_error(),
        });
    }
    // The pages changed (to zeroes) without a write KVM or the VMM would log: a diff or a
    // pre-copied snapshot must still write them.
    vm_memory::MmapRegion::bitmap(region).set_addr_range(offset as usize, size as usize);
    Ok(())
}

/// Whether page frame `pfn` is guest RAM.
fn pfn_is_ram(mem: &GuestMemory, pfn: u64) -> bool {
    let addr = pfn << PFN_SHIFT;
    mem.find_region(GuestAddress(addr))
        .is_some_and(|r| addr - r.start_addr().0 + PAGE_SIZE as u64 <= r.len())
}

/// The queue side of the device, also driven directly by the tests and the fuzz target.
pub struct BalloonQueues {
    roles: Vec<Role>,
    control: Arc<BalloonControl>,
    stats_interval: Option<Duration>,
}

impl BalloonQueues {
    pub fn new(
        features: u64,
        control: Arc<BalloonControl>,
        stats_interval: Option<Duration>,
    ) -> Self {
        BalloonQueues {
            roles: roles(features),
            stats_interval: stats_interval.filter(|_| features & F_STATS_VQ != 0),
            control,
        }
    }

    fn bad_input(&self, what: std::fmt::Arguments) {
        let mut inner = lock(&self.control.inner);
        let c = &mut inner.counters;
        if c.bad_pfns + c.bad_chains < LOG_LIMIT {
            tracing::warn!("virtio-balloon: {what}; skipped");
        }
    }

    /// Reads the page frames of one inflate/deflate chain (returns them, at most
    /// [`MAX_PFNS_PER_CHAIN`]); None for a chain that cannot be read.
    fn read_pfns(
        &self,
        mem: &GuestMemory,
        chain: DescriptorChain<&GuestMemory>,
    ) -> Option<Vec<u64>> {
        let mut r = match Reader::new(mem, chain) {
            Ok(r) => r,
            Err(e) => {
                self.bad_input(format_args!("unreadable page frame buffer: {e}"));
                lock(&self.control.inner).counters.bad_chains += 1;
                return None;
            }
        };
        if r.available_bytes() % 4 != 0 {
            self.bad_input(format_args!(
                "page frame buffer of {} bytes is not whole 32-bit entries",
                r.available_bytes()
            ));
        }
        let n = (r.available_bytes() / 4).min(MAX_PFNS_PER_CHAIN);
        let mut pfns = Vec::with_capacity(n);
        for _ in 0..n {
            match r.read_obj::<u32>() {
                Ok(p) => pfns.push(u64::from(p)),
                Err(_) => break,
            }
        }
        Some(pfns)
    }

    /// Drops the pages of one inflate chain.
    pub fn inflate(&mut self, mem: &GuestMemory, chain: DescriptorChain<&GuestMemory>) -> u32 {
        let Some(pfns) = self.read_pfns(mem, chain) else {
            return 0;
        };
        // Runs of consecutive frames go to madvise together.
        let mut i = 0;
        while i < pfns.len() {
            let mut j = i + 1;
            while j < pfns.len() && pfns[j] == pfns[j - 1] + 1 {
                j += 1;
            }
            self.drop_run(mem, pfns[i], (j - i) as u64);
            i = j;
        }
        0
    }

    fn drop_run(&mut self, mem: &GuestMemory, first: u64, count: u64) {
        let (addr, len) = (first << PFN_SHIFT, count << PFN_SHIFT);
        if discard(mem, addr, len).is_ok() {
            lock(&self.control.inner).counters.inflated_pages += count;
            return;
        }
        // Some of the run is not RAM (or straddles a region end): page by page.
        for pfn in first..first + count {
            match discard(mem, pfn << PFN_SHIFT, PAGE_SIZE as u64) {
                Ok(()) => lock(&self.control.inner).counters.inflated_pages += 1,
                Err(e) => {
                    self.bad_input(format_args!("inflate page frame {pfn:#x}: {e}"));
                    lock(&self.control.inner).counters.bad_pfns += 1;
                }
            }
        }
    }

    /// Takes note of one deflate chain: the pages come back on their own when the guest
    /// touches them, so only the frames are checked.
    pub fn deflate(&mut self, mem: &GuestMemory, chain: DescriptorChain<&GuestMemory>) -> u32 {
        let Some(pfns) = self.read_pfns(mem, chain) else {
            return 0;
        };
        let good = pfns.iter().filter(|&&p| pfn_is_ram(mem, p)).count() as u64;
        let bad = pfns.len() as u64 - good;
        if bad > 0 {
            self.bad_input(format_args!("{bad} deflate page frames outside guest RAM"));
        }
        let mut inner = lock(&self.control.inner);
        inner.counters.deflated_pages += good;
        inner.counters.bad_pfns += bad;
        0
    }

    /// Drops every range of one free page report (each descriptor is a free range).
    pub fn report(&mut self, mem: &GuestMemory, chain: DescriptorChain<&GuestMemory>) -> u32 {
        for desc in chain {
            let (addr, len) = (desc.addr().0, u64::from(desc.len()));
            match discard(mem, addr, len) {
                Ok(()) => lock(&self.control.inner).counters.reported_bytes += len,
                Err(e) => {
                    self.bad_input(format_args!("free page report: {e}"));
                    lock(&self.control.inner).counters.bad_pfns += 1;
                }
            }
        }
        0
    }

    /// Takes the guest's statistics buffers; the device keeps the newest one until it wants
    /// fresh numbers (then `tick` returns it, and the guest refills and resubmits it).
    pub fn stats(&mut self, queue: &mut Queue, mem: &GuestMemory) -> bool {
        let mut used = false;
        for _ in 0..queue.size().max(1) {
            let Some(chain) = queue.pop_descriptor_chain(mem) else {
                break;
            };
            let head = chain.head_index();
            let parsed = match Reader::new(mem, chain) {
                Ok(mut r) => {
                    let mut stats = BTreeMap::new();
                    for _ in 0..MAX_STATS {
                        let Ok(entry) = r.read_obj::<[u8; 10]>() else {
                            break;
                        };
                        let tag = u16::from_le_bytes([entry[0], entry[1]]);
                        let mut v = [0u8; 8];
                        v.copy_from_slice(&entry[2..]);
                        stats.insert(tag, u64::from_le_bytes(v));
                    }
                    Some(stats)
                }
                Err(e) => {
                    self.bad_input(format_args!("unreadable statistics buffer: {e}"));
                    None
                }
            };
            let mut inner = lock(&self.control.inner);
            match parsed {
                Some(stats) => {
                    inner.stats = stats;
                    inner.stats_at = Some(Instant::now());
                }
                None => inner.counters.bad_chains += 1,
            }
            // A driver only has one buffer out; an older one goes back at once.
            if let Some(old) = inner.stats_head.replace(head) {
                drop(inner);
                if queue.add_used(mem, old, 0).is_err() {
                    break;
                }
                used = true;
            }
        }
        used
    }

    /// Hands the held statistics buffer back: the guest answers with fresh numbers.
    pub fn request_stats(&mut self, queue: &mut Queue, mem: &GuestMemory) -> bool {
        let Some(head) = lock(&self.control.inner).stats_head.take() else {
            return false;
        };
        if let Err(e) = queue.add_used(mem, head, 0) {
            tracing::debug!("virtio-balloon: cannot return the statistics buffer: {e:?}");
            return false;
        }
        true
    }

    /// Processes queue `role`.
    pub fn process(&mut self, role: Role, queue: &mut Queue, mem: &GuestMemory) -> bool {
        match role {
            Role::Inflate => drain_queue(queue, mem, |c| self.inflate(mem, c)),
            Role::Deflate => drain_queue(queue, mem, |c| self.deflate(mem, c)),
            Role::Reporting => drain_queue(queue, mem, |c| self.report(mem, c)),
            Role::Stats => self.stats(queue, mem),
        }
    }
}

impl QueueHandler for BalloonQueues {
    fn queue_event(&mut self, index: usize, queues: &mut [Queue], mem: &GuestMemory) -> bool {
        match (self.roles.get(index).copied(), queues.get_mut(index)) {
            (Some(role), Some(q)) => self.process(role, q, mem),
            _ => false,
        }
    }

    fn tick_interval(&self) -> Option<Duration> {
        self.stats_interval
    }

    fn tick(&mut self, queues: &mut [Queue], mem: &GuestMemory) -> bool {
        let Some(i) = self.roles.iter().position(|&r| r == Role::Stats) else {
            return false;
        };
        match queues.get_mut(i) {
            Some(q) => self.request_stats(q, mem),
            None => false,
        }
    }
}

pub struct Balloon {
    config: BalloonConfig,
    control: Arc<BalloonControl>,
    queue_sizes: Vec<u16>,
    common: VirtioCommon,
}

impl Balloon {
    pub fn new(config: BalloonConfig, mem_mib: u64) -> Self {
        let mut b = Balloon {
            config,
            control: Arc::new(BalloonControl::new(mem_mib)),
            queue_sizes: Vec::new(),
            common: VirtioCommon::default(),
        };
        b.queue_sizes = vec![QUEUE_SIZE; roles(b.features()).len()];
        b
    }

    /// The host's handle (control socket).
    pub fn control(&self) -> Arc<BalloonControl> {
        self.control.clone()
    }

    fn config_bytes(&self) -> [u8; 16] {
        let inner = lock(&self.control.inner);
        let mut c = [0u8; 16];
        c[..4].copy_from_slice(&inner.num_pages.to_le_bytes());
        c[4..8].copy_from_slice(&inner.actual.to_le_bytes());
        c
    }
}

impl VirtioDevice for Balloon {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_BALLOON
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_sizes
    }

    fn features(&self) -> u64 {
        let mut f = VIRTIO_F_VERSION_1;
        if self.config.stats_interval_s > 0 {
            f |= F_STATS_VQ;
        }
        if self.config.deflate_on_oom {
            f |= F_DEFLATE_ON_OOM;
        }
        if self.config.free_page_reporting {
            f |= F_REPORTING;
        }
        f
    }

    /// `num_pages` (u32, host-set target) then `actual` (u32, guest-written), then the
    /// unused free-page-hint and poison fields as zeroes.
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        super::read_config_bytes(&self.config_bytes(), offset, data);
    }

    fn write_config(&mut self, offset: u64, data: &[u8]) {
        // Only `actual` (bytes 4..8) is the driver's to write.
        let mut c = self.config_bytes();
        for (i, &b) in data.iter().enumerate() {
            match offset.checked_add(i as u64) {
                Some(o @ 4..=7) => c[o as usize] = b,
                _ => tracing::debug!(offset, "guest wrote read-only balloon config"),
            }
        }
        let actual = u32::from_le_bytes([c[4], c[5], c[6], c[7]]);
        lock(&self.control.inner).actual = actual;
    }

    fn reset(&mut self) -> bool {
        self.common.worker = None;
        let mut inner = lock(&self.control.inner);
        inner.interrupt = None;
        inner.stats_head = None;
        true
    }

    crate::virtio_common_field!();

    fn thread_name(&self) -> &'static str {
        "virtio-balloon"
    }

    fn queue_handler(
        &mut self,
        interrupt: &Arc<Interrupt>,
    ) -> Result<Box<dyn QueueHandler>, ActivateError> {
        let interval = (self.config.stats_interval_s > 0)
            .then(|| Duration::from_secs(u64::from(self.config.stats_interval_s)));
        let handler =
            BalloonQueues::new(self.common.acked_features, self.control.clone(), interval);
        let mut inner = lock(&self.control.inner);
        // A restored VM may have had a target change in flight (the transport only
        // re-raises used-ring interrupts): tell the guest again while it is off target.
        if inner.num_pages != inner.actual {
            interrupt.signal_config_change();
        }
        inner.interrupt = Some(interrupt.clone());
        Ok(Box::new(handler))
    }
}
