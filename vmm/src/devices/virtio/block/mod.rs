//! virtio-blk on a raw image file: read, write, flush, discard and write-zeroes (holes punched
//! into the file, so sparse images stay sparse), GET_ID, read-only disks. Requests are served
//! synchronously on the device thread; every sector, length and offset from the guest is
//! checked against the disk size and the per-request limits below.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use virtio_queue::{DescriptorChain, Queue, Reader, Writer};
use vm_memory::bitmap::{Bitmap, BitmapSlice};
use vm_memory::{GuestAddress, GuestMemoryBackend as _};

use super::worker::{drain_queue, QueueHandler};
use super::{
    read_config_bytes, ActivateError, Interrupt, VirtioCommon, VirtioDevice, VIRTIO_F_VERSION_1,
};
use crate::memory::GuestMemory;

mod persist;
pub use persist::{BlockRestoreError, BlockState};

pub const VIRTIO_ID_BLOCK: u32 = 2;
pub const SECTOR: u64 = 512;
const QUEUE_SIZES: [u16; 1] = [256];

pub const F_SIZE_MAX: u64 = 1 << 1;
pub const F_SEG_MAX: u64 = 1 << 2;
pub const F_RO: u64 = 1 << 5;
pub const F_FLUSH: u64 = 1 << 9;
pub const F_DISCARD: u64 = 1 << 13;
pub const F_WRITE_ZEROES: u64 = 1 << 14;

pub const T_IN: u32 = 0;
pub const T_OUT: u32 = 1;
pub const T_FLUSH: u32 = 4;
pub const T_GET_ID: u32 = 8;
pub const T_DISCARD: u32 = 11;
pub const T_WRITE_ZEROES: u32 = 13;

pub const S_OK: u8 = 0;
pub const S_IOERR: u8 = 1;
pub const S_UNSUPP: u8 = 2;

/// Largest data transfer of one read/write request; seg_max * size_max stays within it so a
/// well-behaved driver never exceeds it, and a hostile one gets IOERR.
pub const MAX_REQUEST: usize = 4 << 20;
const SIZE_MAX: u32 = 64 * 1024;
const SEG_MAX: u32 = 64;
/// Largest discard / write-zeroes range (64 MiB), one segment per request.
pub const MAX_ZERO_SECTORS: u32 = 128 * 1024;
const CHUNK: usize = 128 * 1024;
const ID_LEN: usize = 20;
const WRITE_ZEROES_UNMAP: u32 = 1;

/// Why a disk could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    #[error("cannot open disk image {path}: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "disk image {0} is in use by another VM (locked); give each VM its own writable image"
    )]
    Locked(PathBuf),
    #[error("disk image {0} is smaller than one 512-byte sector")]
    Empty(PathBuf),
}

/// The image file and what the guest is told about it.
pub struct Disk {
    file: File,
    /// Bytes the guest may address (the file size rounded down to whole sectors).
    size: u64,
    read_only: bool,
    id: [u8; ID_LEN],
}

impl Disk {
    pub fn open(path: &Path, read_only: bool) -> Result<Disk, BlockError> {
        let open_err = |source| BlockError::Open {
            path: path.to_owned(),
            source,
        };
        let file = OpenOptions::new()
            .read(true)
            .write(!read_only)
            .open(path)
            .map_err(open_err)?;
        // Two VMs writing one image corrupt it: writers take an exclusive lock, readers a
        // shared one.
        let op = if read_only {
            libc::LOCK_SH
        } else {
            libc::LOCK_EX
        };
        // SAFETY: flock on a file descriptor we own; no memory is passed.
        if unsafe { libc::flock(file.as_raw_fd(), op | libc::LOCK_NB) } != 0 {
            return Err(BlockError::Locked(path.to_owned()));
        }
        let len = file.metadata().map_err(open_err)?.len();
        let size = len - len % SECTOR;
        if size == 0 {
            return Err(BlockError::Empty(path.to_owned()));
        }
        let mut id = [0u8; ID_LEN];
        let name = path
            .file_name()
            .map(|n| n.as_encoded_bytes())
            .unwrap_or(b"");
        let n = name.len().min(ID_LEN);
        id[..n].copy_from_slice(&name[..n]);
        Ok(Disk {
            file,
            size,
            read_only,
            id,
        })
    }

    pub fn from_file(file: File, read_only: bool) -> std::io::Result<Disk> {
        let len = file.metadata()?.len();
        Ok(Disk {
            file,
            size: len - len % SECTOR,
            read_only,
            id: *b"test-disk\0\0\0\0\0\0\0\0\0\0\0",
        })
    }

    /// Byte range of a request, or None if it is unaligned or leaves the disk.
    fn range(&self, sector: u64, len: u64) -> Option<u64> {
        if !len.is_multiple_of(SECTOR) {
            return None;
        }
        let start = sector.checked_mul(SECTOR)?;
        (start.checked_add(len)? <= self.size).then_some(start)
    }
}

pub struct Block {
    disk: Arc<Disk>,
    common: VirtioCommon,
}

impl Block {
    pub fn open(path: &Path, read_only: bool) -> Result<Box<dyn VirtioDevice>, BlockError> {
        Ok(Box::new(Block::new(Disk::open(path, read_only)?)))
    }

    pub fn new(disk: Disk) -> Block {
        Block {
            disk: Arc::new(disk),
            common: VirtioCommon::default(),
        }
    }

    fn config(&self) -> [u8; 60] {
        let mut c = [0u8; 60];
        c[0..8].copy_from_slice(&(self.disk.size / SECTOR).to_le_bytes());
        c[8..12].copy_from_slice(&SIZE_MAX.to_le_bytes());
        c[12..16].copy_from_slice(&SEG_MAX.to_le_bytes());
        c[20..24].copy_from_slice(&(SECTOR as u32).to_le_bytes());
        c[36..40].copy_from_slice(&MAX_ZERO_SECTORS.to_le_bytes()); // max_discard_sectors
        c[40..44].copy_from_slice(&1u32.to_le_bytes()); // max_discard_seg
        c[44..48].copy_from_slice(&8u32.to_le_bytes()); // discard_sector_alignment (4 KiB)
        c[48..52].copy_from_slice(&MAX_ZERO_SECTORS.to_le_bytes()); // max_write_zeroes_sectors
        c[52..56].copy_from_slice(&1u32.to_le_bytes()); // max_write_zeroes_seg
        c[56] = 1; // write_zeroes_may_unmap
        c
    }
}

/// The queue side of the device, also driven directly by tests and the fuzz target.
pub struct BlockQueue {
    disk: Arc<Disk>,
    buf: Vec<u8>,
}

fn fallocate(file: &File, mode: i32, offset: u64, len: u64) -> std::io::Result<()> {
    // SAFETY: fallocate on a file descriptor we own; no memory is passed.
    let r = unsafe { libc::fallocate(file.as_raw_fd(), mode, offset as i64, len as i64) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

impl BlockQueue {
    pub fn new(disk: Arc<Disk>) -> Self {
        BlockQueue {
            disk,
            buf: vec![0; CHUNK],
        }
    }

    pub fn process(&mut self, queue: &mut Queue, mem: &GuestMemory) -> bool {
        drain_queue(queue, mem, |chain| self.handle(mem, chain))
    }

    /// Serves one request; returns the bytes written into the chain (data + status).
    pub fn handle(&mut self, mem: &GuestMemory, chain: DescriptorChain<&GuestMemory>) -> u32 {
        // Where a read's data goes, so it can be read from the file straight into them.
        let segments: Vec<(GuestAddress, usize)> = chain
            .clone()
            .writable()
            .map(|d| (d.addr(), d.len() as usize))
            .collect();
        let (mut reader, mut writer) =
            match (Reader::new(mem, chain.clone()), Writer::new(mem, chain)) {
                (Ok(r), Ok(w)) => (r, w),
                _ => {
                    tracing::debug!("virtio-blk: request with buffers outside guest memory");
                    return 0;
                }
            };
        let avail = writer.available_bytes();
        if avail == 0 {
            return 0; // no room for a status byte: nothing we can answer
        }
        let Ok(mut status_writer) = writer.split_at(avail - 1) else {
            return 0;
        };
        let (status, data_written) = self.execute(mem, &segments, &mut reader, &mut writer);
        if status_writer.write_all(&[status]).is_err() {
            return data_written as u32;
        }
        (data_written + 1) as u32
    }

    /// Returns (status, bytes of data written to the guest).
    fn execute<B: BitmapSlice>(
        &mut self,
        mem: &GuestMemory,
        segments: &[(GuestAddress, usize)],
        reader: &mut Reader<'_, B>,
        writer: &mut Writer<'_, B>,
    ) -> (u8, usize) {
        let mut hdr = [0u8; 16];
        if reader.read_exact(&mut hdr).is_err() {
            return (S_IOERR, 0);
        }
        let kind = u32::from_le_bytes(hdr[0..4].try_into().unwrap_or_default());
        let sector = u64::from_le_bytes(hdr[8..16].try_into().unwrap_or_default());
        let disk = self.disk.clone();
        match kind {
            T_IN => {
                let len = writer.available_bytes();
                let Some(start) = disk
                    .range(sector, len as u64)
                    .filter(|_| len <= MAX_REQUEST)
                else {
                    return (S_IOERR, 0);
                };
                if let Some(read) = read_into_guest(&disk.file, mem, segments, len, start) {
                    return match read {
                        Ok(()) => (S_OK, len),
                        Err(_) => (S_IOERR, 0),
                    };
                }
                let mut done = 0;
                while done < len {
                    let n = (len - done).min(CHUNK);
                    if disk
                        .file
                        .read_exact_at(&mut self.buf[..n], start + done as u64)
                        .is_err()
                        || writer.write_all(&self.buf[..n]).is_err()
                    {
                        return (S_IOERR, done);
                    }
                    done += n;
                }
                (S_OK, done)
            }
            T_OUT => {
                let len = reader.available_bytes();
                if disk.read_only {
                    return (S_IOERR, 0);
                }
                let Some(start) = disk
                    .range(sector, len as u64)
                    .filter(|_| len <= MAX_REQUEST)
                else {
                    return (S_IOERR, 0);
                };
                let mut done = 0;
                while done < len {
                    let n = (len - done).min(CHUNK);
                    if reader.read_exact(&mut self.buf[..n]).is_err()
                        || disk
                            .file
                            .write_all_at(&self.buf[..n], start + done as u64)
                            .is_err()
                    {
                        return (S_IOERR, 0);
                    }
                    done += n;
                }
                (S_OK, 0)
            }
            T_FLUSH => {
                if !disk.read_only && disk.file.sync_data().is_err() {
                    return (S_IOERR, 0);
                }
                (S_OK, 0)
            }
            T_GET_ID => {
                let n = writer.available_bytes().min(ID_LEN);
                match writer.write_all(&disk.id[..n]) {
                    Ok(()) => (S_OK, n),
                    Err(_) => (S_IOERR, 0),
                }
            }
            T_DISCARD | T_WRITE_ZEROES => {
                if disk.read_only {
                    return (S_IOERR, 0);
                }
                // Exactly one 16-byte segment (max_*_seg = 1).
                let mut seg = [0u8; 16];
                if reader.available_bytes() != 16 || reader.read_exact(&mut seg).is_err() {
                    return (S_IOERR, 0);
                }
                let sector = u64::from_le_bytes(seg[0..8].try_into().unwrap_or_default());
                let count = u32::from_le_bytes(seg[8..12].try_into().unwrap_or_default());
                let flags = u32::from_le_bytes(seg[12..16].try_into().unwrap_or_default());
                if count > MAX_ZERO_SECTORS || flags & !WRITE_ZEROES_UNMAP != 0 {
                    return (S_UNSUPP, 0);
                }
                if kind == T_DISCARD && flags != 0 {
                    return (S_UNSUPP, 0);
                }
                let len = u64::from(count) * SECTOR;
                let Some(start) = disk.range(sector, len) else {
                    return (S_IOERR, 0);
                };
                (self.zero(start, len, kind == T_DISCARD || flags != 0), 0)
            }
            _ => (S_UNSUPP, 0),
        }
    }

    /// Discard / write-zeroes: punch a hole when the guest allows deallocation, otherwise
    /// zero the range in place (ZERO_RANGE, or plain zero writes where unsupported).
    fn zero(&mut self, start: u64, len: u64, unmap: bool) -> u8 {
        if len == 0 {
            return S_OK;
        }
        let file = &self.disk.file;
        let keep = libc::FALLOC_FL_KEEP_SIZE;
        let mode = if unmap {
            libc::FALLOC_FL_PUNCH_HOLE | keep
        } else {
            libc::FALLOC_FL_ZERO_RANGE | keep
        };
        if fallocate(file, mode, start, len).is_ok() {
            return S_OK;
        }
        self.buf.fill(0);
        let mut done = 0u64;
        while done < len {
            let n = (len - done).min(CHUNK as u64) as usize;
            if file.write_all_at(&self.buf[..n], start + done).is_err() {
                return S_IOERR;
            }
            done += n as u64;
        }
        S_OK
    }
}

/// Reads `len` bytes at `start` of `file` straight into the first `len` bytes of the
/// guest buffers `segments` (one preadv per up to 1024 buffers, no bounce copy), and marks
/// them dirty for diff snapshots. None when a buffer is not one contiguous host mapping (the
/// caller copies then); the lengths were bounded by the caller against the disk.
fn read_into_guest(
    file: &File,
    mem: &GuestMemory,
    segments: &[(GuestAddress, usize)],
    len: usize,
    start: u64,
) -> Option<std::io::Result<()>> {
    let mut slices = Vec::with_capacity(segments.len());
    let mut left = len;
    for &(addr, seg_len) in segments {
        if left == 0 {
            break;
        }
        let n = seg_len.min(left);
        slices.push(mem.get_slice(addr, n).ok()?);
        left -= n;
    }
    if left != 0 {
        return None;
    }
    let guards: Vec<_> = slices.iter().map(|s| s.ptr_guard_mut()).collect();
    let mut iov: Vec<libc::iovec> = guards
        .iter()
        .zip(&slices)
        .map(|(g, s)| libc::iovec {
            iov_base: g.as_ptr().cast(),
            iov_len: s.len(),
        })
        .collect();
    let (mut first, mut offset) = (0usize, start);
    while first < iov.len() {
        let count = (iov.len() - first).min(1024) as libc::c_int;
        // SAFETY: every iovec points into a guest memory slice of its length, kept mapped by
        // `guards` (and the memory `mem` borrows) for this call; the kernel writes at most
        // that many bytes into each.
        let n = unsafe {
            libc::preadv(
                file.as_raw_fd(),
                iov[first..].as_ptr(),
                count,
                offset as libc::off_t,
            )
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Some(Err(e));
        }
        if n == 0 {
            return Some(Err(std::io::ErrorKind::UnexpectedEof.into()));
        }
        offset += n as u64;
        // Skip the buffers filled; trim the one filled in part.
        let mut n = n as usize;
        while n > 0 && first < iov.len() {
            let cur = &mut iov[first];
            if n >= cur.iov_len {
                n -= cur.iov_len;
                first += 1;
            } else {
                // SAFETY: advancing within the same buffer, n < its length.
                cur.iov_base = unsafe { cur.iov_base.cast::<u8>().add(n).cast() };
                cur.iov_len -= n;
                n = 0;
            }
        }
    }
    for s in &slices {
        s.bitmap().mark_dirty(0, s.len());
    }
    Some(Ok(()))
}

impl QueueHandler for BlockQueue {
    fn queue_event(&mut self, index: usize, queues: &mut [Queue], mem: &GuestMemory) -> bool {
        match queues.get_mut(index) {
            Some(q) => self.process(q, mem),
            None => false,
        }
    }
}

impl VirtioDevice for Block {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_BLOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &QUEUE_SIZES
    }

    fn features(&self) -> u64 {
        let base = VIRTIO_F_VERSION_1 | F_SIZE_MAX | F_SEG_MAX | F_FLUSH;
        if self.disk.read_only {
            base | F_RO
        } else {
            base | F_DISCARD | F_WRITE_ZEROES
        }
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.config(), offset, data);
    }

    fn write_config(&mut self, _offset: u64, _data: &[u8]) {
        tracing::debug!("guest wrote virtio-blk config (writeback toggle unsupported); ignored");
    }

    crate::virtio_common_field!();

    fn thread_name(&self) -> &'static str {
        "virtio-blk"
    }

    fn queue_handler(
        &mut self,
        _interrupt: &Arc<Interrupt>,
    ) -> Result<Box<dyn QueueHandler>, ActivateError> {
        Ok(Box::new(BlockQueue::new(self.disk.clone())))
    }
}

#[cfg(test)]
mod tests;
