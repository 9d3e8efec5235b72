//! KVM's binary statistics of a vCPU (`KVM_GET_STATS_FD`): the exits KVM handles itself (HLT,
//! MSR, CPUID, nested page faults, ...) never reach the VMM, so the metrics take their counts
//! and times from here. Hosts without the ioctl (before Linux 5.14) report nothing.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::fs::FileExt;

use kvm_bindings::{KVM_STATS_TYPE_LINEAR_HIST, KVM_STATS_TYPE_LOG_HIST, KVM_STATS_TYPE_MASK};

/// `_IO(KVMIO, 0xce)`.
const KVM_GET_STATS_FD: libc::c_ulong = 0xaece;
const HEADER_SIZE: usize = 24;
const DESC_FIXED_SIZE: usize = 16;

fn u32_at(bytes: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
}

/// The statistics file of one vCPU. Open it before the vCPU first runs: the ioctl takes the
/// vCPU's lock, which KVM_RUN holds for as long as the guest runs (or halts), whereas reading
/// the file later needs no lock.
#[derive(Debug)]
pub struct VcpuStatsFile(File);

impl VcpuStatsFile {
    /// None on hosts without the ioctl.
    pub fn open(vcpu_fd: RawFd) -> Option<Self> {
        // SAFETY: KVM_GET_STATS_FD takes no argument and returns a new fd or -1.
        let fd = unsafe { libc::ioctl(vcpu_fd, KVM_GET_STATS_FD as _) };
        if fd < 0 {
            return None;
        }
        // SAFETY: `fd` is a fresh descriptor that nothing else owns.
        Some(Self(unsafe { File::from_raw_fd(fd) }))
    }

    /// Every non-zero single-value statistic, by KVM's name (`exits`, `halt_exits`,
    /// `halt_wait_ns`, `pf_taken`, ...). Histograms are left out.
    pub fn read(&self) -> BTreeMap<String, u64> {
        parse(|offset, buf| self.0.read_exact_at(buf, offset).is_ok()).unwrap_or_default()
    }
}

/// Parses the stats file through `read(offset, buf) -> ok`.
fn parse(read: impl Fn(u64, &mut [u8]) -> bool) -> Option<BTreeMap<String, u64>> {
    let mut header = [0u8; HEADER_SIZE];
    if !read(0, &mut header) {
        return None;
    }
    let name_size = u32_at(&header, 4)? as usize;
    let count = u32_at(&header, 8)? as usize;
    let desc_offset = u64::from(u32_at(&header, 16)?);
    let data_offset = u64::from(u32_at(&header, 20)?);
    let desc_size = DESC_FIXED_SIZE + name_size;
    let mut descs = vec![0u8; desc_size.checked_mul(count)?];
    if !read(desc_offset, &mut descs) {
        return None;
    }
    let mut out = BTreeMap::new();
    for desc in descs.chunks_exact(desc_size) {
        let flags = u32_at(desc, 0)?;
        let size = u16::from_le_bytes([desc[6], desc[7]]);
        let offset = u64::from(u32_at(desc, 8)?);
        let kind = flags & KVM_STATS_TYPE_MASK;
        if size != 1 || kind == KVM_STATS_TYPE_LINEAR_HIST || kind == KVM_STATS_TYPE_LOG_HIST {
            continue;
        }
        let name = &desc[DESC_FIXED_SIZE..];
        let name = &name[..name.iter().position(|&b| b == 0).unwrap_or(name.len())];
        let mut value = [0u8; 8];
        if !read(data_offset + offset, &mut value) {
            return None;
        }
        let value = u64::from_le_bytes(value);
        if value != 0 {
            out.insert(String::from_utf8_lossy(name).into_owned(), value);
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_single_values_and_skips_histograms_and_zeros() {
        let name_size = 16;
        let mut file = vec![0u8; 24];
        file[4..8].copy_from_slice(&(name_size as u32).to_le_bytes());
        file[8..12].copy_from_slice(&3u32.to_le_bytes());
        file[16..20].copy_from_slice(&24u32.to_le_bytes());
        let data_offset = 24 + 3 * (16 + name_size);
        file[20..24].copy_from_slice(&(data_offset as u32).to_le_bytes());
        for (i, (name, kind, size, offset)) in [
            ("exits", 0u32, 1u16, 0u32),
            ("halt_hist", KVM_STATS_TYPE_LOG_HIST, 32, 8),
            ("zero", 0, 1, 8 + 32 * 8),
        ]
        .into_iter()
        .enumerate()
        {
            let mut desc = vec![0u8; 16 + name_size];
            desc[0..4].copy_from_slice(&kind.to_le_bytes());
            desc[6..8].copy_from_slice(&size.to_le_bytes());
            desc[8..12].copy_from_slice(&offset.to_le_bytes());
            desc[16..16 + name.len()].copy_from_slice(name.as_bytes());
            file.extend_from_slice(&desc);
            assert_eq!(file.len(), 24 + (i + 1) * (16 + name_size));
        }
        let mut data = vec![0u8; 8 * 34];
        data[0..8].copy_from_slice(&1234u64.to_le_bytes());
        data[8..16].copy_from_slice(&7u64.to_le_bytes());
        file.extend_from_slice(&data);
        let read = |offset: u64, buf: &mut [u8]| {
            let start = offset as usize;
            match file.get(start..start + buf.len()) {
                Some(src) => {
                    buf.copy_from_slice(src);
                    true
                }
                None => false,
            }
        };
        let stats = parse(read).unwrap();
        assert_eq!(stats.len(), 1, "{stats:?}");
        assert_eq!(stats["exits"], 1234);
        assert!(parse(|_, _| false).is_none());
    }
}
