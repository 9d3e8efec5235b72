//! Which pages of a restored VM's memory the guest (or the VMM) wrote, read from the VMM's
//! own `/proc/self/pagemap`: a restore maps its full snapshot's memory file MAP_PRIVATE, so a
//! page still backed by that file is unchanged, and a written page became a private copy
//! (anonymous). That set is what a snapshot over the base must hold; it costs the running
//! guest nothing (no dirty log, no write-protection faults).
//!
//! A jailed VMM has no /proc: [`open`] runs before it leaves the host's root, in the process
//! that maps guest memory (pagemap describes the opener's address space, so a descriptor
//! inherited across a fork would describe the wrong process and is refused).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Mutex;

use vm_memory::{GuestMemoryBackend, GuestMemoryRegion, MemoryRegionAddress};

use crate::memory::{GuestMemory, RegionLayout, PAGE_SIZE};

/// Present in RAM.
const PM_PRESENT: u64 = 1 << 63;
/// Swapped out (or being migrated).
const PM_SWAP: u64 = 1 << 62;
/// Backed by a file (the snapshot's page cache) or shared anonymous memory.
const PM_FILE: u64 = 1 << 61;
/// Entries read per `pread` (64 KiB).
const ENTRIES_PER_READ: usize = 8192;

#[derive(Debug, thiserror::Error)]
pub enum PagemapError {
    #[error("cannot open /proc/self/pagemap: {0}; a snapshot over the base needs /proc (a jailed VMM opens it before entering its jail)")]
    Open(std::io::Error),
    #[error("/proc/self/pagemap was opened by process {opened_by}, not this one ({this}); it describes another address space")]
    OtherProcess { opened_by: u32, this: u32 },
    #[error("cannot read /proc/self/pagemap: {0}")]
    Read(std::io::Error),
    #[error("guest memory has no host address: {0}")]
    Address(String),
    #[error("pagemap shows no page of guest memory in RAM, which a VM that ran cannot be; refusing a snapshot that would drop the guest's writes (take a full snapshot)")]
    NothingPresent,
}

/// The descriptor and the process that opened it.
static PAGEMAP: Mutex<Option<(u32, File)>> = Mutex::new(None);

/// Opens this process's pagemap (once per process); a jailed VMM calls it before its
/// pivot_root. Without /proc the error is kept for [`written_pages`] to report.
pub fn open() -> Result<(), PagemapError> {
    open_into(&mut PAGEMAP.lock().unwrap_or_else(|e| e.into_inner()))
}

/// Fills `slot` with this process's pagemap unless this process opened it already.
fn open_into(slot: &mut Option<(u32, File)>) -> Result<(), PagemapError> {
    let this = std::process::id();
    if slot.as_ref().is_some_and(|(pid, _)| *pid == this) {
        return Ok(());
    }
    let file = File::open("/proc/self/pagemap").map_err(PagemapError::Open)?;
    *slot = Some((this, file));
    Ok(())
}

/// The file page numbers (sorted) of `mem` that are no longer the mapped file's pages: the
/// pages written since the memory was mapped from its snapshot (a page the guest freed
/// through the balloon reads as the file's again, which is what the guest would see too).
pub fn written_pages(
    mem: &GuestMemory,
    regions: &[RegionLayout],
) -> Result<Vec<u64>, PagemapError> {
    let mut slot = PAGEMAP.lock().unwrap_or_else(|e| e.into_inner());
    if slot.is_none() {
        // Not jailed: open it now, in this process.
        open_into(&mut slot)?;
    }
    let Some((opened_by, file)) = slot.as_ref() else {
        return Err(PagemapError::Open(std::io::ErrorKind::NotFound.into()));
    };
    let this = std::process::id();
    if *opened_by != this {
        return Err(PagemapError::OtherProcess {
            opened_by: *opened_by,
            this,
        });
    }
    let mut pages = Vec::new();
    let mut present = 0u64;
    let mut buf = vec![0u8; ENTRIES_PER_READ * 8];
    for (region, layout) in mem.iter().zip(regions) {
        let host = region
            .get_host_address(MemoryRegionAddress(0))
            .map_err(|e| PagemapError::Address(e.to_string()))? as u64;
        let first_entry = host / PAGE_SIZE as u64;
        let first_file_page = layout.file_offset / PAGE_SIZE as u64;
        let count = region.len() / PAGE_SIZE as u64;
        let mut done = 0u64;
        while done < count {
            let n = (count - done).min(ENTRIES_PER_READ as u64) as usize;
            let bytes = &mut buf[..n * 8];
            file.read_exact_at(bytes, (first_entry + done) * 8)
                .map_err(PagemapError::Read)?;
            for (i, entry) in bytes.chunks_exact(8).enumerate() {
                let entry = u64::from_le_bytes(entry.try_into().unwrap_or_default());
                if entry & PM_PRESENT != 0 {
                    present += 1;
                }
                if is_written(entry) {
                    pages.push(first_file_page + done + i as u64);
                }
            }
            done += n as u64;
        }
    }
    if present == 0 {
        return Err(PagemapError::NothingPresent);
    }
    pages.sort_unstable();
    Ok(pages)
}

/// A private copy in RAM or in swap; a page never touched, or still the file's, is not.
fn is_written(entry: u64) -> bool {
    entry & (PM_PRESENT | PM_SWAP) != 0 && entry & PM_FILE == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use vm_memory::{Bytes, GuestAddress};

    #[test]
    fn entries_are_classified_by_their_flags() {
        assert!(!is_written(0), "never touched");
        assert!(
            !is_written(PM_PRESENT | PM_FILE | 42),
            "still the file's page"
        );
        assert!(is_written(PM_PRESENT | 42), "a private copy");
        assert!(is_written(PM_SWAP), "a private copy in swap");
        assert!(!is_written(PM_SWAP | PM_FILE), "a file page being migrated");
    }

    /// A private mapping of a real file: read pages stay the file's, written ones (by a
    /// plain write or through the memory API) are reported, in file page numbers.
    #[test]
    fn a_private_mapping_reports_exactly_the_written_pages() {
        let path = std::env::temp_dir().join(format!("dsec-pagemap-{}", std::process::id()));
        let layout = crate::memory::layout_for(8 << 20);
        let size = layout.iter().map(|r| r.file_offset + r.size).max().unwrap();
        let mut file = File::create(&path).unwrap();
        file.write_all(&vec![7u8; size as usize]).unwrap();
        drop(file);
        let mem = crate::memory::from_file(File::open(&path).unwrap(), &layout).unwrap();
        std::fs::remove_file(&path).unwrap();
        let mut byte = [0u8; 1];
        for page in [0u64, 5, 9] {
            mem.read_slice(&mut byte, GuestAddress(page * 4096))
                .unwrap();
            assert_eq!(byte[0], 7);
        }
        for page in [3u64, 9, 1000] {
            mem.write_slice(&[1], GuestAddress(page * 4096 + 17))
                .unwrap();
        }
        assert_eq!(written_pages(&mem, &layout).unwrap(), vec![3, 9, 1000]);
    }

    #[test]
    fn untouched_memory_is_refused_rather_than_reported_unchanged() {
        let layout = crate::memory::layout_for(4 << 20);
        let mem = crate::memory::anonymous(4 << 20).unwrap();
        assert!(matches!(
            written_pages(&mem, &layout),
            Err(PagemapError::NothingPresent)
        ));
    }
}
