//! virtio-pmem: a host file mapped into guest-physical address space above RAM and the MMIO
//! hole, so the guest reads (and, if writable, writes) it with plain loads and stores (DAX,
//! no page cache copy in the guest). Read-only files are mapped MAP_PRIVATE/PROT_READ and
//! registered with KVM_MEM_READONLY (guest writes become MMIO exits that are dropped); writable
//! ones MAP_SHARED, so guest stores land in the host page cache. The one request queue carries
//! flushes: fdatasync(2) of the file for a writable mapping, nothing to do for a read-only one.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvm_bindings::{kvm_userspace_memory_region, KVM_MEM_READONLY};
use kvm_ioctls::VmFd;
use virtio_queue::{DescriptorChain, Queue, Reader, Writer};

use super::worker::{drain_queue, QueueHandler};
use super::{
    read_config_bytes, ActivateError, Interrupt, VirtioCommon, VirtioDevice, VIRTIO_F_VERSION_1,
};
use crate::arch::layout;
use crate::memory::GuestMemory;

mod persist;
pub use persist::PmemState;

pub const VIRTIO_ID_PMEM: u32 = 27;
const QUEUE_SIZES: [u16; 1] = [32];
/// Start and size of every pmem window: Linux hot-adds the range as ZONE_DEVICE memory in
/// 2 MiB subsections.
pub const ALIGN: u64 = dsec_vmm_api::config::PMEM_ALIGN;
/// KVM memory slot of pmem device `i` is `KVM_SLOT_BASE + i` (RAM uses slots 0 and 1).
pub const KVM_SLOT_BASE: u32 = 16;
/// The only request type (`VIRTIO_PMEM_REQ_TYPE_FLUSH`).
pub const REQ_FLUSH: u32 = 0;
pub const RESP_OK: u32 = 0;
pub const RESP_EIO: u32 = 1;

/// Why a pmem file could not be mapped or restored.
#[derive(Debug, thiserror::Error)]
pub enum PmemError {
    #[error(transparent)]
    File(#[from] dsec_vmm_api::config::PmemFileError),
    #[error("pmem file {0} is in use by another VM (locked); map it read-only (,ro) or shared (,shared) in every VM, or give each VM its own copy")]
    Locked(PathBuf),
    #[error("cannot map pmem file {path} ({size} bytes): {source}")]
    Map {
        path: PathBuf,
        size: u64,
        source: std::io::Error,
    },
    #[error("KVM refused the memory slot for pmem file {path} at {addr:#x}: {source}{hint}")]
    Register {
        path: PathBuf,
        addr: u64,
        source: kvm_ioctls::Error,
        hint: &'static str,
    },
    #[error("pmem file {path} changed since the snapshot: {detail}; restore needs the same, unmodified file")]
    Changed { path: PathBuf, detail: String },
}

/// The mapped file. Unmapped on drop.
pub struct Backing {
    file: File,
    path: PathBuf,
    host: *mut libc::c_void,
    size: u64,
    read_only: bool,
    guest_addr: u64,
    dev: u64,
    ino: u64,
    mtime_ns: i128,
}

// SAFETY: `host` is a mapping owned by this value; nothing in the VMM reads or writes through
// the pointer (only the guest does, through KVM), so sharing it between threads is sound.
unsafe impl Send for Backing {}
// SAFETY: as above; every method takes `&self` and only uses the file descriptor.
unsafe impl Sync for Backing {}

/// Opens `path` as a pmem file and checks its size (the contract's check, shared with
/// config validation).
pub fn open_file(path: &Path, read_only: bool) -> Result<(File, u64), PmemError> {
    Ok(dsec_vmm_api::config::open_pmem_file(path, read_only)?)
}

/// Where the first pmem window goes: above RAM and the 32-bit MMIO hole, at a 1 GiB boundary.
pub fn window_base(mem_bytes: u64) -> u64 {
    let ram_end = layout::ram_regions(mem_bytes)
        .iter()
        .map(|(start, size)| start + size)
        .max()
        .unwrap_or(0);
    ram_end.max(layout::MMIO_GAP_END).next_multiple_of(1 << 30)
}

impl Backing {
    /// Opens, locks and maps `path` for a window at `guest_addr`. A writable file is locked
    /// exclusively unless `shared`; read-only and shared ones take a shared lock.
    pub fn open(
        path: &Path,
        read_only: bool,
        shared: bool,
        guest_addr: u64,
    ) -> Result<Backing, PmemError> {
        let (file, size) = open_file(path, read_only)?;
        let op = if read_only || shared {
            libc::LOCK_SH
        } else {
            libc::LOCK_EX
        };
        // SAFETY: flock on a file descriptor we own; no memory is passed.
        if unsafe { libc::flock(file.as_raw_fd(), op | libc::LOCK_NB) } != 0 {
            return Err(PmemError::Locked(path.to_owned()));
        }
        let meta = file.metadata().map_err(|source| {
            PmemError::File(dsec_vmm_api::config::PmemFileError::Open {
                path: path.to_owned(),
                mode: "",
                source,
            })
        })?;
        let (prot, flags) = if read_only {
            (libc::PROT_READ, libc::MAP_PRIVATE | libc::MAP_NORESERVE)
        } else {
            (libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED)
        };
        let map_err = |source| PmemError::Map {
            path: path.to_owned(),
            size,
            source,
        };
        let len = usize::try_from(size).map_err(|_| map_err(std::io::Error::other("too large")))?;
        // SAFETY: a new mapping chosen by the kernel (no MAP_FIXED) of a file we hold open;
        // the result is checked before use and unmapped in Drop.
        let host =
            unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, file.as_raw_fd(), 0) };
        if host == libc::MAP_FAILED {
            return Err(map_err(std::io::Error::last_os_error()));
        }
        Ok(Backing {
            file,
            path: path.to_owned(),
            host,
            size,
            read_only,
            guest_addr,
            dev: meta.dev(),
            ino: meta.ino(),
            mtime_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
        })
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn guest_addr(&self) -> u64 {
        self.guest_addr
    }

    /// Hands the mapping to KVM as memory slot `slot` (read-only slots fault writes out to
    /// userspace as MMIO, where nothing claims them).
    pub fn register(&self, vm: &VmFd, slot: u32) -> Result<(), PmemError> {
        let region = kvm_userspace_memory_region {
            slot,
            flags: if self.read_only { KVM_MEM_READONLY } else { 0 },
            guest_phys_addr: self.guest_addr,
            memory_size: self.size,
            userspace_addr: self.host as u64,
        };
        // SAFETY: the mapping lives as long as this Backing, which the device (and so the VM)
        // holds until the VMM exits; KVM drops its pages through its MMU notifier on unmap.
        unsafe { vm.set_user_memory_region(region) }.map_err(|source| PmemError::Register {
            path: self.path.clone(),
            addr: self.guest_addr,
            hint: if self.read_only && source.errno() == libc::EINVAL {
                " (this KVM may not support read-only memory slots; try a writable mapping)"
            } else {
                ""
            },
            source,
        })
    }

    /// Makes guest writes durable: fdatasync writes back the page-cache pages the guest
    /// dirtied through the shared mapping. Nothing to do for a read-only mapping.
    pub fn flush(&self) -> std::io::Result<()> {
        if self.read_only {
            return Ok(());
        }
        self.file.sync_data()
    }
}

impl Drop for Backing {
    fn drop(&mut self) {
        // SAFETY: `host`/`size` are exactly the mapping made in `open`, unmapped only here.
        unsafe { libc::munmap(self.host, self.size as usize) };
    }
}

/// The queue side of the device, also driven directly by tests and the fuzz target.
pub struct PmemQueue {
    backing: Arc<Backing>,
}

impl PmemQueue {
    pub fn new(backing: Arc<Backing>) -> Self {
        PmemQueue { backing }
    }

    /// Serves one request: a 4-byte type the device reads, then a 4-byte status it writes.
    /// Returns the bytes written (0 when there is no room for the status).
    pub fn handle(&mut self, mem: &GuestMemory, chain: DescriptorChain<&GuestMemory>) -> u32 {
        let (mut reader, mut writer) =
            match (Reader::new(mem, chain.clone()), Writer::new(mem, chain)) {
                (Ok(r), Ok(w)) => (r, w),
                (Err(e), _) | (_, Err(e)) => {
                    tracing::debug!("virtio-pmem: unusable request from the guest: {e}");
                    return 0;
                }
            };
        if writer.available_bytes() < 4 {
            tracing::debug!("virtio-pmem: request has no room for the status");
            return 0;
        }
        let status = match reader.read_obj::<u32>() {
            Ok(t) if u32::from_le(t) == REQ_FLUSH => match self.backing.flush() {
                Ok(()) => RESP_OK,
                Err(e) => {
                    tracing::warn!(
                        "virtio-pmem: flush of {} failed: {e}",
                        self.backing.path.display()
                    );
                    RESP_EIO
                }
            },
            Ok(t) => {
                tracing::debug!("virtio-pmem: unknown request type {t}");
                RESP_EIO
            }
            Err(e) => {
                tracing::debug!("virtio-pmem: request without a type: {e}");
                RESP_EIO
            }
        };
        match writer.write_obj(status.to_le()) {
            Ok(()) => 4,
            Err(_) => 0,
        }
    }

    pub fn process(&mut self, queue: &mut Queue, mem: &GuestMemory) -> bool {
        drain_queue(queue, mem, |chain| self.handle(mem, chain))
    }
}

impl QueueHandler for PmemQueue {
    fn queue_event(&mut self, index: usize, queues: &mut [Queue], mem: &GuestMemory) -> bool {
        match queues.get_mut(index) {
            Some(q) => self.process(q, mem),
            None => false,
        }
    }
}

pub struct Pmem {
    backing: Arc<Backing>,
    config: [u8; 16],
    common: VirtioCommon,
}

impl Pmem {
    pub fn new(backing: Backing) -> Self {
        let mut config = [0u8; 16];
        config[..8].copy_from_slice(&backing.guest_addr.to_le_bytes());
        config[8..].copy_from_slice(&backing.size.to_le_bytes());
        Pmem {
            backing: Arc::new(backing),
            config,
            common: VirtioCommon::default(),
        }
    }

    pub fn backing(&self) -> &Arc<Backing> {
        &self.backing
    }
}

impl VirtioDevice for Pmem {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_PMEM
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &QUEUE_SIZES
    }

    fn features(&self) -> u64 {
        VIRTIO_F_VERSION_1
    }

    /// `struct virtio_pmem_config { le64 start; le64 size; }`
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.config, offset, data);
    }

    crate::virtio_common_field!();

    fn thread_name(&self) -> &'static str {
        "virtio-pmem"
    }

    fn queue_handler(
        &mut self,
        _interrupt: &Arc<Interrupt>,
    ) -> Result<Box<dyn QueueHandler>, ActivateError> {
        Ok(Box::new(PmemQueue::new(self.backing.clone())))
    }
}

#[cfg(test)]
mod tests;
