//! Restoring a VM from a snapshot, in one place: the snapshot chain and its memory (mapped
//! or served lazily), the in-kernel interrupt controllers and clock, the devices (each
//! through its own `Persist` impl, via `slots::attach`), the vCPUs and, last, the PIT.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc::channel;
use std::sync::Arc;
use std::time::{Duration, Instant};

use vm_memory::{GuestAddress, GuestMemoryBackend};

use super::{
    build_devices, create_vm_fd, kvm_err, ms_since, open_kvm, serial_sink, Prewarmed, Vm, VmError,
};
use crate::config::{DriveConfig, NetConfig, SerialOutput};
use crate::devices::access_mode;
use crate::memory::{self, GuestMemory, PAGE_SIZE};
use crate::snapshot::{self, MemoryState, SnapshotError, VmState};
use crate::sync::lock;
use crate::timing::BootTimes;
use crate::uffd::{self, UffdHandler};
use crate::vcpu;

/// Why a snapshot cannot be restored as asked.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error("the snapshot has {saved} disk(s) but {given} replacement(s) were given; give one per disk, in order")]
    DriveCount { saved: usize, given: usize },
    #[error("disk {index} ({old}) is {saved} in the snapshot but its replacement {new} is not; keep the same ,ro flags")]
    DriveAccess {
        index: usize,
        old: PathBuf,
        new: PathBuf,
        saved: &'static str,
    },
    #[error("disk {index}: replacement {new} has {new_size} bytes but the snapshot's {old} has {old_size}; the guest would see another disk")]
    DriveSize {
        index: usize,
        old: PathBuf,
        new: PathBuf,
        old_size: u64,
        new_size: u64,
    },
    #[error("the snapshot has no network device, so tap `{0}` cannot be attached; drop the net override")]
    NoNetDevice(String),
    #[error("prewarmed VM has {have_mib} MiB and {have_vcpus} vCPUs; the snapshot needs {need_mib} MiB and {need_vcpus}: start the prewarmed VMM with the snapshot's sizes")]
    PrewarmedShape {
        have_mib: u64,
        have_vcpus: usize,
        need_mib: u64,
        need_vcpus: u8,
    },
    #[error("snapshot vCPU count does not match its config; the snapshot is damaged")]
    VcpuCount,
    #[error("diff snapshot chain is longer than 64 or loops; take a full snapshot")]
    ChainTooLong,
    #[error(
        "diff snapshot parent {0} has a different memory layout; it is not this snapshot's parent"
    )]
    ParentLayout(PathBuf),
    #[error("snapshot memory layout does not match its config; the snapshot is damaged")]
    Layout,
    #[error("diff page {0} has no guest address; the snapshot is damaged")]
    DiffPage(u64),
    #[error("cannot apply diff page {page} to guest memory: {detail}")]
    DiffWrite { page: u64, detail: String },
}
/// Host-side settings a restored VM takes instead of the snapshot's (a fork's identity),
/// and how its memory is brought back.
#[derive(Clone, Debug, Default)]
pub struct RestoreOverrides {
    pub vsock_uds: Option<PathBuf>,
    pub vsock_cid: Option<u64>,
    pub serial: Option<SerialOutput>,
    /// A new tap (and MAC) for the snapshot's network device: a fork's own link.
    pub net: Option<NetConfig>,
    /// Fill memory lazily through userfaultfd instead of mapping the file MAP_PRIVATE.
    pub lazy: Option<LazyRestore>,
    /// Replacements for the snapshot's disks, one per disk in order (empty: keep them): a
    /// fork's own copy of a writable disk.
    pub drives: Vec<DriveConfig>,
    /// Every parent of the diff chain must be inside the snapshot's directory.
    pub contained_chain: bool,
}

/// Swaps a snapshot's disks for `new` ones the guest cannot tell apart from them: as many,
/// in the same order, with the same read-only flags and (where the old file still exists)
/// the same size.
fn replace_drives(own: &mut Vec<DriveConfig>, new: &[DriveConfig]) -> Result<(), VmError> {
    if own.len() != new.len() {
        return Err(RestoreError::DriveCount {
            saved: own.len(),
            given: new.len(),
        }
        .into());
    }
    for (i, (old, new)) in own.iter().zip(new).enumerate() {
        if old.read_only != new.read_only {
            return Err(RestoreError::DriveAccess {
                index: i,
                old: old.path.clone(),
                new: new.path.clone(),
                saved: access_mode(old.read_only),
            }
            .into());
        }
        let size = |p: &Path| std::fs::metadata(p).map(|m| m.len()).ok();
        if let (Some(a), Some(b)) = (size(&old.path), size(&new.path)) {
            if a != b {
                return Err(RestoreError::DriveSize {
                    index: i,
                    old: old.path.clone(),
                    new: new.path.clone(),
                    old_size: a,
                    new_size: b,
                }
                .into());
            }
        }
    }
    *own = new.to_vec();
    Ok(())
}

/// Lazy (userfaultfd) restore settings.
#[derive(Clone, Debug, Default)]
pub struct LazyRestore {
    /// Load the snapshot's recorded working set (`<dir>/working-set`) in the background.
    pub prefetch: bool,
    /// Record the pages touched in this window after start into `<dir>/working-set`.
    pub record: Option<Duration>,
}

/// Where a recorded working set lives in a snapshot directory.
pub const WORKING_SET_FILE: &str = "working-set";

impl Vm {
    /// Restores a VM from a snapshot directory (and its diff chain). It starts paused.
    pub fn restore(dir: &Path, overrides: &RestoreOverrides) -> Result<Vm, VmError> {
        Vm::restore_into(None, dir, overrides)
    }

    /// Restores into `shell` when given: its VM, memory slots and vCPUs already exist, so only
    /// the snapshot's state is loaded (the KVM setup is what dominates a restore).
    pub fn restore_into(
        shell: Option<Prewarmed>,
        dir: &Path,
        overrides: &RestoreOverrides,
    ) -> Result<Vm, VmError> {
        let mut steps = dsec_vmm_api::control::RestoreSteps::default();
        let mut t = Instant::now();
        let state = snapshot::read_state(dir)?;
        steps.state_ms = ms_since(t);
        t = Instant::now();
        let mut config = state.config.clone();
        if let Some(vsock) = config.vsock.as_mut() {
            if let Some(uds) = &overrides.vsock_uds {
                vsock.uds_path = uds.clone();
            }
            if let Some(cid) = overrides.vsock_cid {
                vsock.guest_cid = cid;
            }
        }
        if let Some(serial) = &overrides.serial {
            config.serial = serial.clone();
        }
        if !overrides.drives.is_empty() {
            replace_drives(&mut config.drives, &overrides.drives)?;
        }
        if let Some(net) = &overrides.net {
            net.validate()?;
            match config.net.as_mut() {
                Some(own) => *own = net.clone(),
                None => return Err(RestoreError::NoNetDevice(net.tap.clone()).into()),
            }
        }
        let (kvm, fd, shell_mem, mut shell_vcpus) = match shell {
            Some(p) => {
                if p.mem_mib != state.config.mem_mib
                    || p.vcpus.len() != usize::from(state.config.vcpus)
                {
                    return Err(RestoreError::PrewarmedShape {
                        have_mib: p.mem_mib,
                        have_vcpus: p.vcpus.len(),
                        need_mib: state.config.mem_mib,
                        need_vcpus: state.config.vcpus,
                    }
                    .into());
                }
                (p.kvm, p.fd, Some(p.mem), p.vcpus)
            }
            None => {
                let kvm = open_kvm()?;
                let fd = create_vm_fd(&kvm)?;
                (kvm, fd, None, Vec::new())
            }
        };
        let prewarmed = shell_mem.is_some();
        let (mem, uffd) = match &overrides.lazy {
            None => (restore_memory(dir, &state, overrides, shell_mem)?, None),
            Some(lazy) => {
                let (mem, handler) =
                    restore_memory_lazily(dir, &state, overrides, lazy, shell_mem)?;
                (mem, Some(handler))
            }
        };
        if !prewarmed {
            memory::register(&fd, &mem, false)?;
        }
        steps.memory_ms = ms_since(t);
        t = Instant::now();
        let (exit_tx, exit_rx) = channel();
        let times = Arc::new(BootTimes::default());
        let sink = serial_sink(&config.serial, &times)?;
        // In-kernel interrupt controllers before the devices: a device that raises an
        // interrupt as it comes back (vsock announcing the transport reset) must not have it
        // wiped by restoring the controller state afterwards.
        for chip in &state.irqchips {
            fd.set_irqchip(chip)
                .map_err(kvm_err("restore the interrupt controller"))?;
        }
        let mut clock = state.clock;
        clock.flags = 0;
        fd.set_clock(&clock)
            .map_err(kvm_err("restore the guest clock"))?;
        steps.irqchip_clock_ms = ms_since(t);
        t = Instant::now();
        let devices = build_devices(&config, &fd, &mem, &exit_tx, sink, Some(&state.devices))?;
        steps.devices_ms = ms_since(t);
        t = Instant::now();
        let regions = state.memory.regions.clone();
        let mut vm = Vm::assemble(
            config, kvm, fd, mem, regions, devices, exit_tx, exit_rx, times,
        );
        vm.private_base = uffd.is_none();
        vm.uffd = uffd;
        if state.vcpus.len() != usize::from(vm.config.vcpus) {
            return Err(RestoreError::VcpuCount.into());
        }
        shell_vcpus.reverse();
        for saved in &state.vcpus {
            let vcpu = match shell_vcpus.pop() {
                Some(vcpu) => vcpu,
                None => vm
                    .fd
                    .create_vcpu(u64::from(saved.id))
                    .map_err(kvm_err("create a vCPU"))?,
            };
            vcpu::restore_state(&vcpu, saved)?;
            vm.spawn_vcpu(saved.id, vcpu, true)?;
        }
        steps.vcpus_ms = ms_since(t);
        t = Instant::now();
        // Devices came back (and may have signalled, e.g. the vsock transport reset) before
        // the LAPICs were loaded, which dropped those interrupts: raise them again.
        for slot in &vm.virtio {
            lock(&slot.transport).reassert_pending_interrupt();
        }
        // The PIT last: restoring it re-arms its counter, and a tick that fired before the
        // vCPUs' LAPICs were loaded would be lost, after which KVM (reinjecting, so waiting
        // for that tick's acknowledgement) never delivers another one: a guest whose clock
        // events come from the PIT would then sleep forever.
        vm.fd
            .set_pit2(&state.pit)
            .map_err(kvm_err("restore the PIT"))?;
        // The restored memory is the baseline for the next diff snapshot.
        *lock(&vm.last_snapshot) = Some(dir.to_owned());
        steps.finish_ms = ms_since(t);
        vm.restore_steps = steps;
        Ok(vm)
    }

    /// Where this VM's restore spent its time (all zero for a booted VM).
    pub fn restore_steps(&self) -> &dsec_vmm_api::control::RestoreSteps {
        &self.restore_steps
    }
}

/// The snapshot chain from the full snapshot up to `dir`, oldest first. A relative parent
/// is resolved against its child's directory (a snapshot over its base carries that base).
fn snapshot_chain(
    dir: &Path,
    state: &VmState,
    contained: bool,
) -> Result<Vec<(PathBuf, MemoryState)>, VmError> {
    let mut chain = vec![(dir.to_owned(), state.memory.clone())];
    while let Some((child, parent)) = chain
        .last()
        .and_then(|(d, m)| m.parent.clone().map(|p| (d.clone(), p)))
    {
        if chain.len() > snapshot::MAX_CHAIN {
            return Err(RestoreError::ChainTooLong.into());
        }
        if contained {
            snapshot::check_contained(&parent)?;
        }
        let parent = snapshot::parent_dir(&child, &parent);
        let parent_state = snapshot::read_state(&parent)?;
        if parent_state.memory.regions != state.memory.regions {
            return Err(RestoreError::ParentLayout(parent).into());
        }
        chain.push((parent, parent_state.memory));
    }
    chain.reverse();
    Ok(chain)
}

/// Empty memory whose pages a userfaultfd handler fills from the snapshot chain on demand.
fn restore_memory_lazily(
    dir: &Path,
    state: &VmState,
    overrides: &RestoreOverrides,
    lazy: &LazyRestore,
    into: Option<GuestMemory>,
) -> Result<(GuestMemory, UffdHandler), VmError> {
    let chain = snapshot_chain(dir, state, overrides.contained_chain)?;
    let open = |d: &Path| {
        let path = d.join(snapshot::MEMORY_FILE);
        File::open(&path).map_err(|source| SnapshotError::Read { path, source })
    };
    let file_size = state.memory.file_size();
    let base = open(&chain[0].0)?;
    let actual = base.metadata().map(|m| m.len()).unwrap_or(0);
    if actual < file_size {
        return Err(memory::MemoryError::FileSize {
            expected: file_size,
            actual,
        }
        .into());
    }
    let mut source = uffd::PageSource::new(base);
    for (diff_dir, diff) in &chain[1..] {
        source.push_diff(open(diff_dir)?, &diff.pages);
    }
    let layout = memory::layout_for(state.config.mem_mib << 20);
    if layout != state.memory.regions {
        return Err(RestoreError::Layout.into());
    }
    // A prewarmed VM's memory is untouched anonymous memory, just what userfaultfd needs.
    let mem = match into {
        Some(mem) => mem,
        None => memory::anonymous(state.config.mem_mib << 20)?,
    };
    let working_set = dir.join(WORKING_SET_FILE);
    let options = uffd::LazyOptions {
        prefetch: if lazy.prefetch {
            uffd::read_working_set(&working_set, file_size / PAGE_SIZE as u64)
        } else {
            Vec::new()
        },
        record: lazy.record.map(|window| (working_set, window)),
    };
    let handler = uffd::start(&mem, &layout, source, options)?;
    Ok((mem, handler))
}

/// Maps the full snapshot's memory MAP_PRIVATE, then applies each diff in order.
fn restore_memory(
    dir: &Path,
    state: &VmState,
    overrides: &RestoreOverrides,
    into: Option<GuestMemory>,
) -> Result<GuestMemory, VmError> {
    let chain = snapshot_chain(dir, state, overrides.contained_chain)?;
    let (base_dir, _) = &chain[0];
    let base_path = base_dir.join(snapshot::MEMORY_FILE);
    let base = File::open(&base_path).map_err(|source| SnapshotError::Read {
        path: base_path.clone(),
        source,
    })?;
    // A second descriptor for the background populate (its offset moves with SEEK_DATA).
    let for_populate = File::open(&base_path).ok();
    let mem = match into {
        Some(mem) => {
            memory::map_file_over(&mem, &base, &state.memory.regions)?;
            mem
        }
        None => memory::from_file(base, &state.memory.regions)?,
    };
    if let Some(file) = for_populate {
        memory::populate_data_in_background(&mem, file, &state.memory.regions, state.config.vcpus);
    }
    let file_size = state.memory.file_size();
    for (diff_dir, diff_state) in &chain[1..] {
        let path = diff_dir.join(snapshot::MEMORY_FILE);
        let read_err = |source| SnapshotError::Read {
            path: path.clone(),
            source,
        };
        let file = File::open(&path).map_err(read_err)?;
        for run in page_runs(&diff_state.pages) {
            let (first, count) = run;
            let offset = first * PAGE_SIZE as u64;
            let len = count * PAGE_SIZE;
            if first >= file_size / PAGE_SIZE as u64 || offset + len as u64 > file_size {
                return Err(SnapshotError::Corrupt {
                    path: path.clone(),
                    detail: format!(
                        "diff pages {first}..{} lie outside guest memory",
                        first + count as u64
                    ),
                }
                .into());
            }
            let guest = memory::file_offset_to_guest(&state.memory.regions, offset)
                .ok_or(RestoreError::DiffPage(first))?;
            // One read per run straight into guest memory (each page becomes the VM's
            // private copy): a page-by-page copy cost two system calls and a bounce per page.
            let slice =
                mem.get_slice(GuestAddress(guest), len)
                    .map_err(|e| RestoreError::DiffWrite {
                        page: first,
                        detail: e.to_string(),
                    })?;
            let ptr = slice.ptr_guard_mut();
            // SAFETY: `slice` is `len` bytes of this VM's guest memory, mapped for as long as
            // `mem` lives; no vCPU runs yet, so nothing else touches it during the read.
            let dest = unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), len) };
            file.read_exact_at(dest, offset).map_err(read_err)?;
        }
    }
    Ok(mem)
}

/// Sorted, distinct page numbers as runs of consecutive pages, `(first, count)`, each at
/// most 1 MiB (a run that crosses a memory region boundary fails in `get_slice`, so region
/// boundaries, 1 MiB aligned, also end a run).
fn page_runs(pages: &[u64]) -> Vec<(u64, usize)> {
    const MAX_RUN: usize = 256;
    let mut runs: Vec<(u64, usize)> = Vec::new();
    for &page in pages {
        match runs.last_mut() {
            Some((first, count))
                if *first + *count as u64 == page
                    && *count < MAX_RUN
                    && page % MAX_RUN as u64 != 0 =>
            {
                *count += 1
            }
            _ => runs.push((page, 1)),
        }
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rehearsal reads a real shell's state and runs it through the state file's encoder
    /// and decoder (a decoding error would fail here); the restore after it is covered by
    /// `prewarmed_vmm_restores_on_request_and_refuses_a_mismatched_snapshot`.
    #[test]
    fn a_prewarmed_shell_rehearses_the_state_decoding() {
        let shell = Prewarmed::new(32, 2).unwrap();
        let took = shell.rehearse_state_decoding().unwrap();
        assert!(took < std::time::Duration::from_secs(30), "{took:?}");
    }

    #[test]
    fn drive_replacements_must_match_the_snapshot() {
        let dir = std::env::temp_dir().join(format!("dsec-drives-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = |name: &str, len: u64| {
            let p = dir.join(name);
            std::fs::File::create(&p).unwrap().set_len(len).unwrap();
            p
        };
        let drive = |path: PathBuf, read_only: bool| DriveConfig { path, read_only };
        let own = vec![
            drive(file("root", 4096), true),
            drive(file("upper", 8192), false),
        ];
        let mut snap = own.clone();
        let copy = file("copy", 8192);
        replace_drives(&mut snap, &[own[0].clone(), drive(copy.clone(), false)]).unwrap();
        assert_eq!(snap[1].path, copy);
        let err = |new: &[DriveConfig]| {
            let mut snap = own.clone();
            replace_drives(&mut snap, new).unwrap_err().to_string()
        };
        assert!(err(&[own[0].clone()]).contains("2 disk(s) but 1"));
        assert!(err(&[own[0].clone(), drive(copy.clone(), true)]).contains("writable"));
        let small = file("small", 4096);
        assert!(err(&[own[0].clone(), drive(small, false)]).contains("4096 bytes"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
