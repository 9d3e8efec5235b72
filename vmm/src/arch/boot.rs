//! Loads a kernel (PVH ELF, plain 64-bit ELF or bzImage), its initrd and command line, and
//! writes the boot structures each protocol expects.

use std::fs::File;
use std::io::{Seek, SeekFrom};
use std::path::Path;

use crate::memory::GuestMemory;
use linux_loader::loader::bootparam::{boot_e820_entry, boot_params};
use linux_loader::loader::elf::PvhBootCapability;
use linux_loader::loader::{BzImage, Elf, KernelLoader, KernelLoaderResult};
use vm_memory::{Address, ByteValued, Bytes, GuestAddress};

use super::cpu::EntryMode;
use super::layout::*;

/// Why the guest could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    #[error("cannot open kernel {path}: {source}")]
    OpenKernel {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not a kernel this VMM can boot: not an x86_64 ELF vmlinux ({elf}) and not a bzImage ({bzimage}); pass the guest-kernel build's vmlinux or bzImage")]
    NotAKernel {
        path: std::path::PathBuf,
        elf: String,
        bzimage: String,
    },
    #[error("cannot read initrd {path}: {source}")]
    ReadInitrd {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("initrd of {size} bytes does not fit in guest memory above the kernel (kernel ends at {kernel_end:#x}, RAM below 4 GiB ends at {ram_end:#x}); give the VM more memory")]
    InitrdTooLarge {
        size: u64,
        kernel_end: u64,
        ram_end: u64,
    },
    #[error("kernel command line is {len} bytes with the VMM's additions; the limit is {max}")]
    CmdlineTooLong { len: usize, max: usize },
    #[error("cannot write boot structures to guest memory: {0}")]
    Memory(#[from] vm_memory::GuestMemoryError),
}

/// What the vCPU setup needs to know after loading.
#[derive(Clone, Copy, Debug)]
pub struct BootInfo {
    pub mode: EntryMode,
    pub entry: u64,
}

/// Hands the PVH structures to vm-memory as plain bytes.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct HvmStartInfo {
    magic: u32,
    version: u32,
    flags: u32,
    nr_modules: u32,
    modlist_paddr: u64,
    cmdline_paddr: u64,
    rsdp_paddr: u64,
    memmap_paddr: u64,
    memmap_entries: u32,
    reserved: u32,
}
// SAFETY: plain-old-data with no padding holes that matter (all fields initialised).
unsafe impl ByteValued for HvmStartInfo {}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct HvmMemmapEntry {
    addr: u64,
    size: u64,
    type_: u32,
    reserved: u32,
}
// SAFETY: plain-old-data, fully initialised.
unsafe impl ByteValued for HvmMemmapEntry {}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct HvmModlistEntry {
    paddr: u64,
    size: u64,
    cmdline_paddr: u64,
    reserved: u64,
}
// SAFETY: plain-old-data, fully initialised.
unsafe impl ByteValued for HvmModlistEntry {}

const XEN_HVM_START_MAGIC: u32 = 0x336e_c578;
const E820_RAM: u32 = 1;
const E820_RESERVED: u32 = 2;
const KERNEL_BOOT_FLAG_MAGIC: u16 = 0xaa55;
const KERNEL_HDR_MAGIC: u32 = 0x5372_6448; // "HdrS"
const KERNEL_LOADER_OTHER: u8 = 0xff;
const KERNEL_MIN_ALIGNMENT: u32 = 0x0100_0000;
const BZIMAGE_64BIT_ENTRY_OFFSET: u64 = 0x200;

/// The guest's physical memory map: `(addr, size, type)`.
pub fn memory_map(mem_bytes: u64) -> Vec<(u64, u64, u32)> {
    let mut map = vec![
        (0, EBDA_START, E820_RAM),
        (EBDA_START, LOW_MEM_END - EBDA_START, E820_RESERVED),
    ];
    for (start, size) in ram_regions(mem_bytes) {
        if start == 0 {
            map.push((HIMEM_START, size - HIMEM_START, E820_RAM));
        } else {
            map.push((start, size, E820_RAM));
        }
    }
    map
}

/// Loads everything and writes the boot structures. Returns where and how to enter.
pub fn load(
    mem: &GuestMemory,
    mem_bytes: u64,
    kernel_path: &Path,
    initrd_path: Option<&Path>,
    cmdline: &str,
) -> Result<BootInfo, BootError> {
    let (result, mode, entry) = load_kernel(mem, kernel_path)?;
    let low_ram_end = mem_bytes.min(MMIO_GAP_START);
    let initrd = match initrd_path {
        Some(path) => Some(load_initrd(
            mem,
            path,
            result.kernel_end,
            low_ram_end,
            &result,
        )?),
        None => None,
    };

    let cmdline_bytes = cmdline.as_bytes();
    if cmdline_bytes.len() + 1 > CMDLINE_MAX_SIZE {
        return Err(BootError::CmdlineTooLong {
            len: cmdline_bytes.len(),
            max: CMDLINE_MAX_SIZE - 1,
        });
    }
    mem.write_slice(cmdline_bytes, GuestAddress(CMDLINE_ADDR))?;
    mem.write_obj(0u8, GuestAddress(CMDLINE_ADDR + cmdline_bytes.len() as u64))?;

    let map = memory_map(mem_bytes);
    match mode {
        EntryMode::Pvh => write_pvh_info(mem, &map, initrd)?,
        EntryMode::Long64 => write_boot_params(mem, &map, initrd, &result, cmdline_bytes.len())?,
    }
    Ok(BootInfo { mode, entry })
}

fn load_kernel(
    mem: &GuestMemory,
    path: &Path,
) -> Result<(KernelLoaderResult, EntryMode, u64), BootError> {
    let open = || {
        File::open(path).map_err(|source| BootError::OpenKernel {
            path: path.to_owned(),
            source,
        })
    };
    for (addr, len) in elf_load_ranges(&mut open()?) {
        crate::memory::populate(mem, addr, len);
    }
    let elf_err = match Elf::load(mem, None, &mut open()?, Some(GuestAddress(HIMEM_START))) {
        Ok(result) => {
            return Ok(match result.pvh_boot_cap {
                PvhBootCapability::PvhEntryPresent(addr) => {
                    (result, EntryMode::Pvh, addr.raw_value())
                }
                _ => (result, EntryMode::Long64, result.kernel_load.raw_value()),
            });
        }
        Err(e) => e,
    };
    match BzImage::load(mem, None, &mut open()?, Some(GuestAddress(HIMEM_START))) {
        Ok(result) => {
            let entry = result.kernel_load.raw_value() + BZIMAGE_64BIT_ENTRY_OFFSET;
            Ok((result, EntryMode::Long64, entry))
        }
        Err(bz_err) => Err(BootError::NotAKernel {
            path: path.to_owned(),
            elf: elf_err.to_string(),
            bzimage: bz_err.to_string(),
        }),
    }
}

/// Where a 64-bit ELF's loadable segments go (physical address, bytes in the file); empty
/// for anything else. Only used to populate those pages before the loader copies them.
fn elf_load_ranges(file: &mut File) -> Vec<(u64, usize)> {
    use std::io::Read;
    const PT_LOAD: u32 = 1;
    let mut header = [0u8; 64];
    if file.read_exact(&mut header).is_err() || &header[..5] != b"\x7fELF\x02" {
        return Vec::new();
    }
    let u16_at = |b: &[u8], at: usize| u16::from_le_bytes([b[at], b[at + 1]]);
    let u64_at =
        |b: &[u8], at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap_or_default());
    let (phoff, phentsize, phnum) = (
        u64_at(&header, 0x20),
        usize::from(u16_at(&header, 0x36)),
        usize::from(u16_at(&header, 0x38)),
    );
    if phentsize < 0x30 || phnum > 64 {
        return Vec::new();
    }
    let mut table = vec![0u8; phentsize * phnum];
    if file.seek(SeekFrom::Start(phoff)).is_err() || file.read_exact(&mut table).is_err() {
        return Vec::new();
    }
    table
        .chunks_exact(phentsize)
        .filter(|ph| u32::from_le_bytes([ph[0], ph[1], ph[2], ph[3]]) == PT_LOAD)
        .map(|ph| (u64_at(ph, 0x18), u64_at(ph, 0x20) as usize))
        .collect()
}

/// Places the initrd page-aligned at the top of low RAM (as bootloaders do) and returns (addr, size).
fn load_initrd(
    mem: &GuestMemory,
    path: &Path,
    kernel_end: u64,
    low_ram_end: u64,
    result: &KernelLoaderResult,
) -> Result<(u64, u64), BootError> {
    let read_err = |source| BootError::ReadInitrd {
        path: path.to_owned(),
        source,
    };
    let mut file = File::open(path).map_err(read_err)?;
    let size = file.metadata().map_err(read_err)?.len();
    let mut ceiling = low_ram_end;
    if let Some(hdr) = result.setup_header {
        let max = u64::from(hdr.initrd_addr_max);
        if max != 0 {
            ceiling = ceiling.min(max + 1);
        }
    }
    let too_large = || BootError::InitrdTooLarge {
        size,
        kernel_end,
        ram_end: low_ram_end,
    };
    let addr = ceiling.checked_sub(size).ok_or_else(too_large)? & !0xfff;
    if addr < kernel_end.max(HIMEM_START) {
        return Err(too_large());
    }
    crate::memory::populate(mem, addr, size as usize);
    mem.read_volatile_from(GuestAddress(addr), &mut file, size as usize)
        .map_err(BootError::Memory)?;
    Ok((addr, size))
}

fn write_pvh_info(
    mem: &GuestMemory,
    map: &[(u64, u64, u32)],
    initrd: Option<(u64, u64)>,
) -> Result<(), BootError> {
    for (i, &(addr, size, type_)) in map.iter().take(MAX_MEMMAP_ENTRIES).enumerate() {
        let entry = HvmMemmapEntry {
            addr,
            size,
            type_,
            reserved: 0,
        };
        mem.write_obj(entry, GuestAddress(PVH_MEMMAP_ADDR + 24 * i as u64))?;
    }
    let mut info = HvmStartInfo {
        magic: XEN_HVM_START_MAGIC,
        version: 1,
        cmdline_paddr: CMDLINE_ADDR,
        memmap_paddr: PVH_MEMMAP_ADDR,
        memmap_entries: map.len().min(MAX_MEMMAP_ENTRIES) as u32,
        ..Default::default()
    };
    if let Some((paddr, size)) = initrd {
        mem.write_obj(
            HvmModlistEntry {
                paddr,
                size,
                ..Default::default()
            },
            GuestAddress(PVH_MODLIST_ADDR),
        )?;
        info.nr_modules = 1;
        info.modlist_paddr = PVH_MODLIST_ADDR;
    }
    mem.write_obj(info, GuestAddress(PVH_INFO_ADDR))?;
    Ok(())
}

fn write_boot_params(
    mem: &GuestMemory,
    map: &[(u64, u64, u32)],
    initrd: Option<(u64, u64)>,
    result: &KernelLoaderResult,
    cmdline_len: usize,
) -> Result<(), BootError> {
    let mut params = boot_params::default();
    if let Some(hdr) = result.setup_header {
        params.hdr = hdr;
    }
    params.hdr.type_of_loader = KERNEL_LOADER_OTHER;
    params.hdr.boot_flag = KERNEL_BOOT_FLAG_MAGIC;
    params.hdr.header = KERNEL_HDR_MAGIC;
    params.hdr.cmd_line_ptr = CMDLINE_ADDR as u32;
    params.hdr.cmdline_size = cmdline_len as u32;
    params.hdr.kernel_alignment = KERNEL_MIN_ALIGNMENT;
    if let Some((addr, size)) = initrd {
        params.hdr.ramdisk_image = addr as u32;
        params.hdr.ramdisk_size = size as u32;
    }
    let entries = map.len().min(params.e820_table.len());
    for (slot, &(addr, size, type_)) in params.e820_table.iter_mut().zip(map) {
        *slot = boot_e820_entry {
            addr,
            size,
            r#type: type_,
        };
    }
    params.e820_entries = entries as u8;
    mem.write_obj(params, GuestAddress(ZERO_PAGE_ADDR))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_map_is_sorted_and_disjoint() {
        for mem in [64u64 << 20, 3 << 30, 8 << 30] {
            let map = memory_map(mem);
            for pair in map.windows(2) {
                assert!(pair[0].0 + pair[0].1 <= pair[1].0, "{map:x?}");
            }
            let ram: u64 = map.iter().filter(|e| e.2 == E820_RAM).map(|e| e.1).sum();
            // RAM minus the EBDA and the legacy hole below 1 MiB.
            assert_eq!(ram, mem - (HIMEM_START - EBDA_START));
        }
    }
}
