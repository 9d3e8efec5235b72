//! Guest memory: anonymous for a cold boot, a private file mapping for a restore, with a
//! dirty bitmap for pages the VMM itself writes (KVM's dirty log covers the guest's writes).

use std::fs::File;
use std::sync::Arc;

use kvm_bindings::{kvm_userspace_memory_region, KVM_MEM_LOG_DIRTY_PAGES};
use kvm_ioctls::VmFd;
use vm_memory::bitmap::AtomicBitmap;
use vm_memory::{
    FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryRegion, GuestRegionMmap,
    MemoryRegionAddress, MmapRegion,
};

use crate::arch::layout;

pub type GuestMemory = vm_memory::GuestMemoryMmap<AtomicBitmap>;
pub const PAGE_SIZE: usize = 4096;

/// Why guest memory could not be set up or saved.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error("cannot map {size} bytes of guest memory: {reason}")]
    Map { size: u64, reason: String },
    #[error("KVM refused the guest memory slot: {0}")]
    Register(kvm_ioctls::Error),
    #[error("KVM cannot report dirty pages: {0}")]
    DirtyLog(kvm_ioctls::Error),
    #[error("memory file is {actual} bytes, the snapshot needs {expected}: it is truncated or from another VM")]
    FileSize { expected: u64, actual: u64 },
    #[error("cannot write guest memory to the snapshot: {0}")]
    Write(std::io::Error),
}

/// One RAM region and where it lives in a memory file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RegionLayout {
    pub guest_addr: u64,
    pub size: u64,
    pub file_offset: u64,
}

/// The region layout of a guest with `mem_bytes` of RAM; file offsets are contiguous.
pub fn layout_for(mem_bytes: u64) -> Vec<RegionLayout> {
    let mut offset = 0;
    layout::ram_regions(mem_bytes)
        .into_iter()
        .map(|(guest_addr, size)| {
            let r = RegionLayout {
                guest_addr,
                size,
                file_offset: offset,
            };
            offset += size;
            r
        })
        .collect()
}

/// Fresh zeroed memory (pages are allocated on first touch).
pub fn anonymous(mem_bytes: u64) -> Result<GuestMemory, MemoryError> {
    let ranges: Vec<(GuestAddress, usize)> = layout_for(mem_bytes)
        .iter()
        .map(|r| (GuestAddress(r.guest_addr), r.size as usize))
        .collect();
    GuestMemory::from_ranges(&ranges).map_err(|e| MemoryError::Map {
        size: mem_bytes,
        reason: format!("{e:?}"),
    })
}

/// Memory backed by a snapshot's memory file, mapped MAP_PRIVATE: pages come from the page
/// cache (shared by every VM restored from the same file) and are copied only when written.
pub fn from_file(file: File, regions: &[RegionLayout]) -> Result<GuestMemory, MemoryError> {
    let needed = regions
        .iter()
        .map(|r| r.file_offset + r.size)
        .max()
        .unwrap_or(0);
    let actual = file.metadata().map_err(MemoryError::Write)?.len();
    if actual < needed {
        return Err(MemoryError::FileSize {
            expected: needed,
            actual,
        });
    }
    let file = Arc::new(file);
    let mut out = Vec::new();
    for r in regions {
        let map_err = |reason: String| MemoryError::Map {
            size: r.size,
            reason,
        };
        let mapping = MmapRegion::<AtomicBitmap>::build(
            Some(FileOffset::from_arc(file.clone(), r.file_offset)),
            r.size as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_NORESERVE,
        )
        .map_err(|e| map_err(format!("{e:?}")))?;
        let region = GuestRegionMmap::new(mapping, GuestAddress(r.guest_addr))
            .ok_or_else(|| map_err("region overflows the address space".into()))?;
        out.push(region);
    }
    GuestMemory::from_regions(out).map_err(|e| MemoryError::Map {
        size: needed,
        reason: format!("{e:?}"),
    })
}

/// Replaces the pages of already-mapped (and KVM-registered) guest memory with a private
/// mapping of a snapshot's memory file at the same addresses. KVM follows the new mapping
/// through its MMU notifiers; the memory slots stay as they are.
pub fn map_file_over(
    mem: &GuestMemory,
    file: &File,
    regions: &[RegionLayout],
) -> Result<(), MemoryError> {
    use std::os::fd::AsRawFd;
    let needed = regions
        .iter()
        .map(|r| r.file_offset + r.size)
        .max()
        .unwrap_or(0);
    let actual = file.metadata().map_err(MemoryError::Write)?.len();
    if actual < needed {
        return Err(MemoryError::FileSize {
            expected: needed,
            actual,
        });
    }
    for (region, layout) in mem.iter().zip(regions) {
        if region.len() != layout.size || region.start_addr().0 != layout.guest_addr {
            return Err(MemoryError::Map {
                size: layout.size,
                reason: "prewarmed memory layout differs from the snapshot's".into(),
            });
        }
        let host = region
            .get_host_address(MemoryRegionAddress(0))
            .map_err(|e| MemoryError::Map {
                size: layout.size,
                reason: e.to_string(),
            })?;
        // SAFETY: MAP_FIXED over a range that is exactly one of our own live mappings (same
        // address and length), so no other mapping is clobbered; vm-memory keeps owning and
        // eventually unmapping the range.
        let mapped = unsafe {
            libc::mmap(
                host.cast(),
                layout.size as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_FIXED | libc::MAP_NORESERVE,
                file.as_raw_fd(),
                layout.file_offset as libc::off_t,
            )
        };
        if mapped == libc::MAP_FAILED {
            return Err(MemoryError::Map {
                size: layout.size,
                reason: std::io::Error::last_os_error().to_string(),
            });
        }
    }
    Ok(())
}

/// Allocates the host pages behind `len` bytes of guest memory at `guest_addr` in one call
/// (`MADV_POPULATE_WRITE`), before the VMM copies a kernel or initrd there: one system call
/// instead of a page fault per 4 KiB, which is expensive under nested virtualization. Best
/// effort: ranges outside guest memory are skipped and kernels before 5.14 simply fault.
pub fn populate(mem: &GuestMemory, guest_addr: u64, len: usize) {
    let page = PAGE_SIZE as u64;
    let start = guest_addr & !(page - 1);
    let end = (guest_addr + len as u64).div_ceil(page) * page;
    let Ok(slice) = mem.get_slice(GuestAddress(start), (end - start) as usize) else {
        return;
    };
    let host = slice.ptr_guard_mut().as_ptr();
    // SAFETY: the range lies inside one of our guest mappings (`get_slice` checked it);
    // MADV_POPULATE_WRITE only faults its pages in, as the copy that follows would.
    unsafe {
        libc::madvise(
            host.cast(),
            (end - start) as usize,
            libc::MADV_POPULATE_WRITE,
        )
    };
}

/// Maps the data of a restored guest's memory file into our page tables on a background
/// thread (`MADV_POPULATE_READ`: read faults, nothing copied), so the restored guest's first
/// touches find their pages mapped instead of each faulting through nested paging. Only the
/// file's data ranges (`SEEK_DATA`/`SEEK_HOLE`): populating a hole would put a zero page into
/// the page cache for it, up to the guest's whole size per VM where the snapshot holds tens of
/// MiB. Best effort: a range the kernel refuses (before 5.14) or that is unmapped meanwhile
/// is skipped. Only done with a CPU to spare beyond the guest's vCPUs: where there is none
/// (the rig's one-CPU L1) the thread takes its time from the guest's first steps, and
/// creates and resumes measured slower with it than without.
pub fn populate_data_in_background(
    mem: &GuestMemory,
    file: File,
    regions: &[RegionLayout],
    vcpus: u8,
) {
    if !populate_has_a_spare_cpu(usable_cpus(), vcpus) {
        return;
    }
    let hosts: Vec<(RegionLayout, usize)> = mem
        .iter()
        .zip(regions)
        .filter_map(|(region, layout)| {
            let host = region.get_host_address(MemoryRegionAddress(0)).ok()?;
            Some((*layout, host as usize))
        })
        .collect();
    let _ = std::thread::Builder::new()
        .name("populate".into())
        .spawn(move || {
            crate::seccomp::install_or_exit(crate::seccomp::ThreadKind::Device);
            populate_data(&file, &hosts);
        });
}

/// CPUs this process may run on (one syscall: this is on the restore path, where
/// `available_parallelism` would also read cgroup files); 1 if it cannot tell.
fn usable_cpus() -> usize {
    // SAFETY: cpu_set_t is plain data; sched_getaffinity fills at most its size for the
    // calling thread and CPU_COUNT only reads it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return 1;
        }
        (libc::CPU_COUNT(&set) as usize).max(1)
    }
}

/// Whether `cpus` usable CPUs leave one for the populate thread beside `vcpus` vCPUs.
fn populate_has_a_spare_cpu(cpus: usize, vcpus: u8) -> bool {
    cpus > usize::from(vcpus)
}

fn populate_data(file: &File, hosts: &[(RegionLayout, usize)]) {
    use std::os::unix::fs::MetadataExt;
    let ranges = data_ranges(file, hosts);
    // A file system that reports no holes (all data up to the end) would have every hole
    // populated: only go on when the data found is what the file really holds on disk.
    let allocated = file.metadata().map(|m| m.blocks() * 512).unwrap_or(0);
    let found: u64 = ranges.iter().map(|&(_, len)| len as u64).sum();
    if found > allocated + (2 << 20) {
        return;
    }
    for (host, len) in ranges {
        // SAFETY: the range lies inside one of our guest mappings (clipped to its region);
        // POPULATE_READ faults pages in as a read would and never changes their contents,
        // whatever is mapped there now.
        unsafe { libc::madvise(host as *mut libc::c_void, len, libc::MADV_POPULATE_READ) };
    }
}

/// The (host address, length) of every data range of `file`, clipped to the regions it backs.
fn data_ranges(file: &File, hosts: &[(RegionLayout, usize)]) -> Vec<(usize, usize)> {
    use std::os::fd::AsRawFd;
    let fd = file.as_raw_fd();
    let end = file.metadata().map(|m| m.len()).unwrap_or(0);
    let mut out = Vec::new();
    let mut offset: u64 = 0;
    while offset < end {
        // SAFETY: lseek on our own descriptor only moves its offset.
        let data = unsafe { libc::lseek(fd, offset as libc::off_t, libc::SEEK_DATA) };
        if data < 0 {
            break; // ENXIO: no data after `offset`
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        let (start, stop) = (data as u64, if hole < 0 { end } else { hole as u64 });
        if stop <= start {
            break;
        }
        for (layout, host) in hosts {
            let (lo, hi) = (
                start.max(layout.file_offset),
                stop.min(layout.file_offset + layout.size),
            );
            if lo < hi {
                out.push((
                    host + (lo - layout.file_offset) as usize,
                    (hi - lo) as usize,
                ));
            }
        }
        offset = stop;
    }
    out
}

/// Hands every region to KVM, optionally with dirty-page logging (for diff snapshots).
pub fn register(vm: &VmFd, mem: &GuestMemory, dirty_log: bool) -> Result<(), MemoryError> {
    for (slot, region) in mem.iter().enumerate() {
        let host_addr = region
            .get_host_address(MemoryRegionAddress(0))
            .map_err(|e| MemoryError::Map {
                size: region.len(),
                reason: e.to_string(),
            })?;
        let kvm_region = kvm_userspace_memory_region {
            slot: slot as u32,
            flags: if dirty_log {
                KVM_MEM_LOG_DIRTY_PAGES
            } else {
                0
            },
            guest_phys_addr: region.start_addr().0,
            memory_size: region.len(),
            userspace_addr: host_addr as u64,
        };
        // SAFETY: the mapping is owned by `mem`, which lives as long as the VM (both are
        // only dropped when the VMM process ends or after the VM fd is closed).
        unsafe { vm.set_user_memory_region(kvm_region) }.map_err(MemoryError::Register)?;
    }
    Ok(())
}

/// Which pages to write into a memory file.
pub enum DumpPages<'a> {
    /// Every non-zero page (a full snapshot; zero pages stay file holes).
    All,
    /// Pages written since the last snapshot: KVM's dirty log plus the VMM's own bitmap.
    Dirty(&'a VmFd),
    /// Exactly these file page numbers (sorted), zero or not.
    These(Vec<u64>),
}

/// One region of guest memory as raw host addresses: what a memory writer reads.
#[derive(Clone, Copy)]
struct RawRegion {
    host: *const u8,
    len: usize,
    file_offset: u64,
}

/// Everything needed to write guest memory into a memory file, prepared while the VM is
/// paused. [`MemoryWriter::write`] allocates nothing and makes only `pwrite64` calls, so it
/// may run in a forked child of this multi-threaded process (see `crate::cow_writer`).
pub struct MemoryWriter {
    fd: std::os::fd::RawFd,
    regions: Vec<RawRegion>,
    /// Sorted file page numbers to write (a diff); None: every non-zero page.
    pages: Option<Vec<u64>>,
}

// SAFETY: the raw pointers name guest memory mappings that live as long as the VM; the
// writer only reads them.
unsafe impl Send for MemoryWriter {}

impl MemoryWriter {
    /// Prepares writing `mem` into `file` (sized to the whole layout here): every non-zero
    /// page, or with `DumpPages::Dirty` the pages dirtied since the last snapshot (reading
    /// KVM's log and the VMM's bitmap clears both: the next diff starts now).
    pub fn prepare(
        mem: &GuestMemory,
        regions: &[RegionLayout],
        file: &File,
        which: DumpPages<'_>,
    ) -> Result<MemoryWriter, MemoryError> {
        size_file(regions, file)?;
        match which {
            DumpPages::Dirty(vm) => {
                let pages = take_dirty_pages(mem, regions, vm)?;
                MemoryWriter::these_pages(mem, regions, file, pages)
            }
            DumpPages::These(pages) => MemoryWriter::these_pages(mem, regions, file, pages),
            DumpPages::All => {
                // The next diff starts from here (KVM's log is the caller's to reset).
                for region in mem.iter() {
                    MmapRegion::bitmap(region).reset();
                }
                MemoryWriter::every_page(mem, regions, file)
            }
        }
    }

    /// Writes every non-zero page of `mem` into `file` (already sized by [`size_file`]),
    /// which the guest may be writing meanwhile: a page it writes is in the next
    /// [`take_dirty_pages`], which must have been reset before this writer runs.
    pub fn every_page(
        mem: &GuestMemory,
        regions: &[RegionLayout],
        file: &File,
    ) -> Result<MemoryWriter, MemoryError> {
        use std::os::fd::AsRawFd;
        Ok(MemoryWriter {
            fd: file.as_raw_fd(),
            regions: raw_regions(mem, regions)?,
            pages: None,
        })
    }

    /// Writes exactly `pages` (sorted file page numbers), zero or not, into `file` (already
    /// sized by [`size_file`]): a page that became zero again overwrites what an earlier
    /// pass wrote there.
    pub fn these_pages(
        mem: &GuestMemory,
        regions: &[RegionLayout],
        file: &File,
        pages: Vec<u64>,
    ) -> Result<MemoryWriter, MemoryError> {
        use std::os::fd::AsRawFd;
        Ok(MemoryWriter {
            fd: file.as_raw_fd(),
            regions: raw_regions(mem, regions)?,
            pages: Some(pages),
        })
    }

    /// How many pages a page list names (None: every non-zero page, unknown until written).
    pub fn page_count(&self) -> Option<usize> {
        self.pages.as_ref().map(Vec::len)
    }

    /// The file page numbers a diff writes (empty for a full snapshot).
    pub fn diff_pages(&self) -> &[u64] {
        self.pages.as_deref().unwrap_or(&[])
    }

    /// Writes the pages; returns how many were written, or the errno of the failed write.
    /// Consecutive pages go out in one `pwrite64`. Allocation-free (see the type's docs).
    pub fn write(&self) -> Result<u64, i32> {
        let mut run = Run::default();
        let mut written = 0u64;
        match &self.pages {
            Some(pages) => {
                for &page in pages {
                    let Some(host) = self.host_of_file_page(page) else {
                        continue;
                    };
                    run.add(self.fd, host, page * PAGE_SIZE as u64)?;
                    written += 1;
                }
            }
            None => {
                for r in &self.regions {
                    for page in 0..r.len / PAGE_SIZE {
                        // SAFETY: `page` < the region's page count, so the page lies inside
                        // its live mapping. A running guest may write it while we read (a
                        // pre-copy pass): the page is then dirty and written again.
                        let host = unsafe { r.host.add(page * PAGE_SIZE) };
                        if is_zero_page(host) {
                            continue;
                        }
                        run.add(self.fd, host, r.file_offset + (page * PAGE_SIZE) as u64)?;
                        written += 1;
                    }
                }
            }
        }
        run.flush(self.fd)?;
        Ok(written)
    }

    fn host_of_file_page(&self, page: u64) -> Option<*const u8> {
        let offset = page * PAGE_SIZE as u64;
        self.regions
            .iter()
            .find(|r| offset >= r.file_offset && offset < r.file_offset + r.len as u64)
            // SAFETY: the offset lies inside this region (checked just above).
            .map(|r| unsafe { r.host.add((offset - r.file_offset) as usize) })
    }
}

/// Sizes a memory file to the whole layout (zero pages stay holes).
pub fn size_file(regions: &[RegionLayout], file: &File) -> Result<(), MemoryError> {
    let total: u64 = regions
        .iter()
        .map(|r| r.file_offset + r.size)
        .max()
        .unwrap_or(0);
    file.set_len(total).map_err(MemoryError::Write)
}

fn raw_regions(mem: &GuestMemory, regions: &[RegionLayout]) -> Result<Vec<RawRegion>, MemoryError> {
    mem.iter()
        .zip(regions)
        .map(|(region, layout)| {
            let host = region
                .get_host_address(MemoryRegionAddress(0))
                .map_err(|e| MemoryError::Write(std::io::Error::other(e.to_string())))?;
            Ok(RawRegion {
                host,
                len: region.len() as usize,
                file_offset: layout.file_offset,
            })
        })
        .collect()
}

/// The file pages written since the last call (or the last snapshot), sorted: KVM's dirty
/// log (the guest's writes) and the VMM's own bitmap (device writes), both read and reset in
/// one step each, so a write after that lands in the next call's set.
pub fn take_dirty_pages(
    mem: &GuestMemory,
    regions: &[RegionLayout],
    vm: &VmFd,
) -> Result<Vec<u64>, MemoryError> {
    let mut pages = Vec::new();
    for (slot, (region, layout)) in mem.iter().zip(regions).enumerate() {
        let count = region.len() as usize / PAGE_SIZE;
        let guest = vm
            .get_dirty_log(slot as u32, region.len() as usize)
            .map_err(MemoryError::DirtyLog)?;
        let device = MmapRegion::bitmap(region).get_and_reset();
        let first = layout.file_offset / PAGE_SIZE as u64;
        for word in 0..count.div_ceil(64) {
            let mut bits =
                guest.get(word).copied().unwrap_or(0) | device.get(word).copied().unwrap_or(0);
            while bits != 0 {
                let page = word * 64 + bits.trailing_zeros() as usize;
                bits &= bits - 1;
                if page < count {
                    pages.push(first + page as u64);
                }
            }
        }
    }
    Ok(pages)
}

/// Pages that are consecutive both in host memory and in the file, written in one call.
#[derive(Default)]
struct Run {
    host: usize,
    offset: u64,
    len: usize,
}

/// At most this much per `pwrite64`, so a run never grows past what one call writes.
const MAX_RUN: usize = 1 << 20;

impl Run {
    fn add(&mut self, fd: i32, host: *const u8, offset: u64) -> Result<(), i32> {
        let contiguous = self.len > 0
            && self.host + self.len == host as usize
            && self.offset + self.len as u64 == offset
            && self.len < MAX_RUN;
        if !contiguous {
            self.flush(fd)?;
            self.host = host as usize;
            self.offset = offset;
        }
        self.len += PAGE_SIZE;
        Ok(())
    }

    fn flush(&mut self, fd: i32) -> Result<(), i32> {
        let mut done = 0;
        while done < self.len {
            // SAFETY: the run spans whole pages inside one live guest mapping (built by
            // `add` from pages checked by the caller).
            let n = unsafe {
                libc::pwrite64(
                    fd,
                    (self.host + done) as *const libc::c_void,
                    self.len - done,
                    (self.offset + done as u64) as libc::off64_t,
                )
            };
            if n < 0 {
                // SAFETY: reads this thread's errno, which the failed call just set.
                let errno = unsafe { *libc::__errno_location() };
                if errno == libc::EINTR {
                    continue;
                }
                return Err(errno);
            }
            if n == 0 {
                return Err(libc::EIO);
            }
            done += n as usize;
        }
        self.len = 0;
        Ok(())
    }
}

/// Whether the page at `page` is all zeroes. Read with volatile loads: during a pre-copy the
/// guest may write the page meanwhile (a torn answer is fine, the page is then dirty and
/// written again). Eight words per step: this runs over every page of a full snapshot.
fn is_zero_page(page: *const u8) -> bool {
    let words = page.cast::<u64>();
    for chunk in (0..PAGE_SIZE / 8).step_by(8) {
        let mut any = 0u64;
        for i in chunk..chunk + 8 {
            // SAFETY: `page` is a page-aligned page of a live guest mapping (the caller's
            // contract), so every u64 of it is aligned and readable.
            any |= unsafe { std::ptr::read_volatile(words.add(i)) };
        }
        if any != 0 {
            return false;
        }
    }
    true
}

/// Writes guest memory into `file` at each region's file offset, in the calling thread.
/// Returns the file page numbers of a diff (empty for a full snapshot) and the pages written.
pub fn dump(
    mem: &GuestMemory,
    regions: &[RegionLayout],
    file: &File,
    which: DumpPages<'_>,
) -> Result<(Vec<u64>, u64), MemoryError> {
    let writer = MemoryWriter::prepare(mem, regions, file, which)?;
    let written = writer
        .write()
        .map_err(|errno| MemoryError::Write(std::io::Error::from_raw_os_error(errno)))?;
    Ok((writer.diff_pages().to_vec(), written))
}

/// Forgets what was dirtied so far (reading KVM's log clears it).
pub fn clear_dirty_log(mem: &GuestMemory, vm: &VmFd) -> Result<(), MemoryError> {
    for (slot, region) in mem.iter().enumerate() {
        vm.get_dirty_log(slot as u32, region.len() as usize)
            .map_err(MemoryError::DirtyLog)?;
        MmapRegion::bitmap(region).reset();
    }
    Ok(())
}

/// The guest address stored at `offset` of a memory file.
pub fn file_offset_to_guest(regions: &[RegionLayout], offset: u64) -> Option<u64> {
    regions
        .iter()
        .find(|r| offset >= r.file_offset && offset < r.file_offset + r.size)
        .map(|r| r.guest_addr + (offset - r.file_offset))
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::Bytes;

    #[test]
    fn usable_cpus_follows_the_affinity_mask() {
        // A thread pinned to one CPU (as a VMM in a one-CPU machine) has no CPU to spare.
        let usable = std::thread::spawn(|| {
            // SAFETY: plain data, and the mask only changes this short-lived thread.
            unsafe {
                let mut one: libc::cpu_set_t = std::mem::zeroed();
                libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut one);
                let first = (0..libc::CPU_SETSIZE as usize)
                    .find(|&cpu| libc::CPU_ISSET(cpu, &one))
                    .unwrap_or(0);
                libc::CPU_ZERO(&mut one);
                libc::CPU_SET(first, &mut one);
                assert_eq!(
                    libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &one),
                    0
                );
            }
            usable_cpus()
        })
        .join()
        .unwrap();
        assert_eq!(usable, 1);
        assert!(!populate_has_a_spare_cpu(usable, 1));
    }

    #[test]
    fn populate_runs_only_with_a_cpu_beside_the_vcpus() {
        assert!(!populate_has_a_spare_cpu(1, 1), "one CPU, one vCPU");
        assert!(!populate_has_a_spare_cpu(2, 2), "two CPUs, two vCPUs");
        assert!(populate_has_a_spare_cpu(2, 1), "two CPUs, one vCPU");
    }

    #[test]
    fn layout_is_contiguous_in_the_file() {
        let l = layout_for(4 << 30);
        assert_eq!(l[0].file_offset, 0);
        assert_eq!(l[1].file_offset, l[0].size);
    }

    /// A KiB field (`Rss:`, `Anonymous:`) of the mapping that starts at `host`, from
    /// /proc/self/smaps.
    fn smaps_kib(host: usize, field: &str) -> u64 {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let start = format!("{host:x}-");
        let mut lines = smaps.lines().skip_while(|l| !l.starts_with(&start));
        lines.next().expect("the mapping is in smaps");
        let line = lines.find(|l| l.starts_with(field)).unwrap();
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    }

    #[test]
    fn populate_maps_only_the_data_of_a_sparse_memory_file() {
        use std::os::unix::fs::FileExt;
        let size = 8u64 << 20;
        let layout = layout_for(size);
        let path = std::env::temp_dir().join(format!("dsec-mem-populate-{}", std::process::id()));
        let file = File::create(&path).unwrap();
        file.set_len(size).unwrap();
        // Two runs of 4 pages with a hole of almost 8 MiB between them.
        file.write_all_at(&[7u8; 4 * PAGE_SIZE], 0).unwrap();
        file.write_all_at(&[9u8; 4 * PAGE_SIZE], 4 << 20).unwrap();
        drop(file);
        let mem = from_file(File::open(&path).unwrap(), &layout).unwrap();
        let for_populate = File::open(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        let region = mem.iter().next().unwrap();
        let host = region.get_host_address(MemoryRegionAddress(0)).unwrap() as usize;
        assert_eq!(
            smaps_kib(host, "Rss:"),
            0,
            "nothing is mapped before a touch"
        );
        populate_data(&for_populate, &[(layout[0], host)]);
        assert_eq!(
            smaps_kib(host, "Rss:"),
            8 * PAGE_SIZE as u64 / 1024,
            "the data pages are mapped, the hole is not"
        );
        assert_eq!(smaps_kib(host, "Anonymous:"), 0, "mapped, not copied");
        assert_eq!(mem.read_obj::<u8>(GuestAddress(4 << 20)).unwrap(), 9);
        assert_eq!(mem.read_obj::<u8>(GuestAddress(2 << 20)).unwrap(), 0);
    }

    #[test]
    fn dump_and_map_private_round_trip() {
        let mem = anonymous(16 << 20).unwrap();
        mem.write_obj(0xdead_beef_u64, GuestAddress(0x5000))
            .unwrap();
        mem.write_obj(0x1234_u64, GuestAddress(0xf0_0000)).unwrap();
        let layout = layout_for(16 << 20);
        let path = std::env::temp_dir().join(format!("dsec-mem-{}", std::process::id()));
        let file = File::create(&path).unwrap();
        let (_, written) = dump(&mem, &layout, &file, DumpPages::All).unwrap();
        assert_eq!(written, 2, "only non-zero pages are written");
        drop(file);
        let restored = from_file(File::open(&path).unwrap(), &layout);
        // MAP_PRIVATE needs write access only to the private copy, not the file.
        let restored = restored.unwrap();
        assert_eq!(
            restored.read_obj::<u64>(GuestAddress(0x5000)).unwrap(),
            0xdead_beef
        );
        restored.write_obj(7u64, GuestAddress(0x5000)).unwrap();
        // Writes stay private: the file is unchanged.
        let again = from_file(File::open(&path).unwrap(), &layout).unwrap();
        assert_eq!(
            again.read_obj::<u64>(GuestAddress(0x5000)).unwrap(),
            0xdead_beef
        );
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn truncated_file_is_refused() {
        let path = std::env::temp_dir().join(format!("dsec-mem-short-{}", std::process::id()));
        std::fs::write(&path, [0u8; 4096]).unwrap();
        let err = from_file(File::open(&path).unwrap(), &layout_for(16 << 20)).unwrap_err();
        assert!(err.to_string().contains("truncated"), "{err}");
        std::fs::remove_file(&path).unwrap();
    }
}
