//! Guest memory: anonymous for a cold boot, a private file mapping for a restore, with a
//! dirty bitmap for pages the VMM itself writes (KVM's dirty log covers the guest's writes).

use std::fs::File;
use std::io::{Seek, SeekFrom, Write};
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
}

/// Writes guest memory into `file` at each region's file offset. Returns the file page
/// numbers written, in file order.
pub fn dump(
    mem: &GuestMemory,
    regions: &[RegionLayout],
    file: &mut File,
    which: DumpPages<'_>,
) -> Result<Vec<u64>, MemoryError> {
    let total: u64 = regions
        .iter()
        .map(|r| r.file_offset + r.size)
        .max()
        .unwrap_or(0);
    file.set_len(total).map_err(MemoryError::Write)?;
    let mut written = Vec::new();
    for (slot, (region, layout)) in mem.iter().zip(regions).enumerate() {
        let pages = region.len() as usize / PAGE_SIZE;
        let kvm_dirty = match which {
            DumpPages::All => None,
            DumpPages::Dirty(vm) => Some(
                vm.get_dirty_log(slot as u32, region.len() as usize)
                    .map_err(MemoryError::DirtyLog)?,
            ),
        };
        let host = region
            .get_host_address(MemoryRegionAddress(0))
            .map_err(|e| MemoryError::Write(std::io::Error::other(e.to_string())))?;
        // The VMM's own writes (virtio rings, device data) are tracked here, not by KVM.
        let bitmap: &AtomicBitmap = MmapRegion::bitmap(region);
        for page in 0..pages {
            let include = match &kvm_dirty {
                None => true,
                Some(bits) => {
                    (bits[page / 64] >> (page % 64)) & 1 == 1
                        || bitmap.is_addr_set(page * PAGE_SIZE)
                }
            };
            if !include {
                continue;
            }
            // SAFETY: `page` < pages, so the slice lies inside this region's live mapping; the
            // VM is paused, so nothing writes to it while we read.
            let bytes =
                unsafe { std::slice::from_raw_parts(host.add(page * PAGE_SIZE), PAGE_SIZE) };
            if kvm_dirty.is_none() && is_zero(bytes) {
                continue;
            }
            let offset = layout.file_offset + (page * PAGE_SIZE) as u64;
            file.seek(SeekFrom::Start(offset))
                .map_err(MemoryError::Write)?;
            file.write_all(bytes).map_err(MemoryError::Write)?;
            written.push(offset / PAGE_SIZE as u64);
        }
        // The next diff starts from here.
        bitmap.reset();
    }
    Ok(written)
}

/// Whether a page is all zeroes (word-wise: this runs over every page of a full snapshot).
fn is_zero(bytes: &[u8]) -> bool {
    // SAFETY: u64 has no invalid bit patterns; align_to only reinterprets the aligned middle.
    let (head, words, tail) = unsafe { bytes.align_to::<u64>() };
    head.iter().all(|&b| b == 0) && words.iter().all(|&w| w == 0) && tail.iter().all(|&b| b == 0)
}

/// Writes only the pages dirtied since the last snapshot; returns their file page numbers.
pub fn dump_dirty_list(
    mem: &GuestMemory,
    regions: &[RegionLayout],
    vm: &VmFd,
    file: &mut File,
) -> Result<Vec<u64>, MemoryError> {
    dump(mem, regions, file, DumpPages::Dirty(vm))
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
    fn layout_is_contiguous_in_the_file() {
        let l = layout_for(4 << 30);
        assert_eq!(l[0].file_offset, 0);
        assert_eq!(l[1].file_offset, l[0].size);
    }

    #[test]
    fn dump_and_map_private_round_trip() {
        let mem = anonymous(16 << 20).unwrap();
        mem.write_obj(0xdead_beef_u64, GuestAddress(0x5000))
            .unwrap();
        mem.write_obj(0x1234_u64, GuestAddress(0xf0_0000)).unwrap();
        let layout = layout_for(16 << 20);
        let path = std::env::temp_dir().join(format!("dsec-mem-{}", std::process::id()));
        let mut file = File::create(&path).unwrap();
        let pages = dump(&mem, &layout, &mut file, DumpPages::All).unwrap();
        assert_eq!(pages.len(), 2, "only non-zero pages are written");
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
