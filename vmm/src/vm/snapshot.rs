//! Taking a snapshot of a paused VM: vCPU, interrupt controller, PIT, clock and device
//! states (the typed aggregate in `crate::snapshot::state`) and its memory, full or diff,
//! written through `crate::snapshot::format`.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use dsec_vmm_api::control::{PauseSteps, SnapshotMemoryMode};
use kvm_bindings::{
    kvm_clock_data, kvm_irqchip, kvm_pit_state2, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER,
    KVM_IRQCHIP_PIC_SLAVE,
};

use super::{kvm_err, ms_since, Vm, VmError};
use crate::cow_writer;
use crate::devices::virtio::slots;
use crate::memory::{self, DumpPages, MemoryWriter};
use crate::pagemap;
use crate::persist::Persist;
use crate::snapshot::{DevicesState, MemoryState, PendingSnapshot, VmState};
use crate::sync::lock;
use crate::vcpu::{self, VcpuHandle};

/// Pre-copy rounds (after the first pass over all memory) at most, while the guest runs.
const PRECOPY_ROUNDS: usize = 4;
/// A dirty set this small ends the pre-copy rounds: the pause writes what is left.
const PRECOPY_SETTLED_PAGES: usize = 256;
/// The last dirty set is written with the guest paused up to this many pages (8 MiB, a few
/// ms); a larger one (a guest writing fast) goes through a copy-on-write fork instead.
const PAUSED_WRITE_MAX_PAGES: usize = 2048;

/// Whether the guest stayed paused for the memory write or a forked child wrote it.
enum Mode {
    Paused,
    Forked,
}

/// Which pages a snapshot's memory file holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SnapshotPages {
    /// Every non-zero page.
    Full,
    /// The pages written since this VM's previous snapshot (KVM's dirty log).
    Diff,
    /// The pages that differ from the full snapshot this VM's memory maps (a VM restored
    /// MAP_PRIVATE), found in the VMM's pagemap; the path is recorded as the parent.
    OverBase(PathBuf),
}

/// What a snapshot wrote.
#[derive(Clone, Copy, Debug)]
pub struct SnapshotSummary {
    pub pages_written: u64,
    pub diff: bool,
}

/// A snapshot of a running VM: what it wrote, how long the guest stood still for it (and
/// where that time went), how long until its memory was written (the snapshot is complete
/// only then) and how the memory was written.
#[derive(Clone, Debug)]
pub struct LiveSnapshot {
    pub summary: SnapshotSummary,
    pub paused: Duration,
    pub complete: Duration,
    pub mode: SnapshotMemoryMode,
    pub steps: PauseSteps,
    /// Pre-copy: pages written per round while the guest ran.
    pub precopy_rounds: Vec<u64>,
    /// Pages written for the pause instant.
    pub final_pages: u64,
}

fn errno_err(errno: i32) -> VmError {
    memory::MemoryError::Write(std::io::Error::from_raw_os_error(errno)).into()
}

/// Writes the memory from this thread (the guest must stay paused meanwhile, unless the
/// writer is a pre-copy pass).
fn write_in_place(writer: &MemoryWriter) -> Result<u64, VmError> {
    writer.write().map_err(errno_err)
}

/// The paused machine's state apart from memory.
struct MachineState {
    vcpus: Vec<vcpu::VcpuState>,
    irqchips: Vec<kvm_irqchip>,
    pit: kvm_pit_state2,
    clock: kvm_clock_data,
    devices: DevicesState,
}

/// A snapshot whose state is taken and whose memory is still to be written.
struct Captured {
    pending: PendingSnapshot,
    state: VmState,
    writer: MemoryWriter,
    // Holds the descriptor the writer writes to.
    _memory_file: File,
    diff: bool,
    /// Over the restore base: the dirty log and the last snapshot are left as they were.
    over_base: bool,
}

/// How the memory of a live snapshot gets written once the state is read.
enum Writing {
    InPlace(MemoryWriter),
    Forked(cow_writer::CowWrite),
}

impl Vm {
    /// Writes a snapshot of a paused VM into `dest` (which must not exist), of the `pages`
    /// asked for.
    pub fn snapshot(&self, dest: &Path, pages: &SnapshotPages) -> Result<SnapshotSummary, VmError> {
        let captured = self.capture(dest, pages, &mut PauseSteps::default())?;
        let written = write_in_place(&captured.writer);
        self.finish(captured, written)
    }

    /// Snapshot of a running VM with a short pause. A full snapshot of a VM whose memory is
    /// all mapped is pre-copied ([`Vm::snapshot_precopy`]). Otherwise the vCPUs and devices
    /// stand still only while their state is read and a child process is forked with a
    /// copy-on-write view of guest memory; the guest runs again while that child writes the
    /// memory, and this returns once it has. A lazily restored VM (pages still to come
    /// through userfaultfd, which a forked child would read as zeroes) or a failed fork
    /// keeps the guest paused for the whole write instead.
    pub fn snapshot_live(
        &self,
        dest: &Path,
        pages: &SnapshotPages,
    ) -> Result<LiveSnapshot, VmError> {
        let requested = Instant::now();
        let full = *pages == SnapshotPages::Full;
        if full && !self.dirty_logging.load(Ordering::SeqCst) {
            // Turning KVM's dirty log on changes the memory slots (an SRCU grace period,
            // milliseconds): do it before the pause, which then only clears the log.
            memory::register(&self.fd, &self.mem, true)?;
            self.dirty_logging.store(true, Ordering::SeqCst);
        }
        if full && self.uffd.is_none() {
            return self.snapshot_precopy(dest, requested).inspect_err(|_| {
                // The dirty log was reset for a snapshot that does not exist.
                *lock(&self.last_snapshot) = None;
            });
        }
        let mut steps = PauseSteps::default();
        let started = Instant::now();
        let captured = self
            .pause_timed(&mut steps)
            .and_then(|()| self.capture(dest, pages, &mut steps));
        let captured = match captured {
            Ok(c) => c,
            Err(e) => {
                self.resume();
                return Err(e);
            }
        };
        let Captured {
            pending,
            state,
            writer,
            _memory_file,
            diff,
            over_base,
        } = captured;
        let final_pages = writer.page_count();
        let writing = if self.uffd.is_some() {
            Writing::InPlace(writer)
        } else {
            self.fork_writer(writer, &mut steps)
        };
        let (written, paused, mode) = self.finish_writing(writing, started, &mut steps);
        let summary = self.finish_parts(pending, state, diff, over_base, written)?;
        Ok(LiveSnapshot {
            summary,
            paused,
            complete: requested.elapsed(),
            mode: match mode {
                Mode::Paused => SnapshotMemoryMode::Paused,
                Mode::Forked => SnapshotMemoryMode::CopyOnWrite,
            },
            steps,
            precopy_rounds: Vec::new(),
            final_pages: final_pages.unwrap_or(summary.pages_written as usize) as u64,
        })
    }

    /// A full snapshot written like a live migration: every non-zero page while the guest
    /// runs (KVM's dirty log and the VMM's bitmap reset just before), then rounds of the
    /// pages dirtied meanwhile while that set shrinks; then a pause in which the state is
    /// read and the last dirty set is written in place over the same file offsets (a page
    /// that became zero included), so the file holds the memory of the pause instant. Reading
    /// that last set resets both logs with the guest paused, so the next diff is exact. A last
    /// set too large to write in a short pause goes through a copy-on-write fork.
    fn snapshot_precopy(&self, dest: &Path, requested: Instant) -> Result<LiveSnapshot, VmError> {
        let pending = PendingSnapshot::create(dest)?;
        let memory_file = pending.memory_file()?;
        memory::size_file(&self.regions, &memory_file)?;
        let mut rounds = Vec::new();
        memory::take_dirty_pages(&self.mem, &self.regions, &self.fd)?;
        rounds.push(write_in_place(&MemoryWriter::every_page(
            &self.mem,
            &self.regions,
            &memory_file,
        )?)?);
        for _ in 0..PRECOPY_ROUNDS {
            let dirty = memory::take_dirty_pages(&self.mem, &self.regions, &self.fd)?;
            let count = dirty.len();
            let writer = MemoryWriter::these_pages(&self.mem, &self.regions, &memory_file, dirty)?;
            rounds.push(write_in_place(&writer)?);
            // Settled, or not shrinking (the guest writes as fast as we copy).
            let previous = rounds[rounds.len() - 2] as usize;
            if count <= PRECOPY_SETTLED_PAGES || count * 2 > previous {
                break;
            }
        }

        let mut steps = PauseSteps::default();
        let started = Instant::now();
        let paused = self.pause_timed(&mut steps).and_then(|()| {
            let t = Instant::now();
            let machine = self.read_machine()?;
            steps.state_ms = ms_since(t);
            let t = Instant::now();
            let dirty = memory::take_dirty_pages(&self.mem, &self.regions, &self.fd)?;
            let writer = MemoryWriter::these_pages(&self.mem, &self.regions, &memory_file, dirty)?;
            steps.prepare_ms = ms_since(t);
            Ok((machine, writer))
        });
        let (machine, writer) = match paused {
            Ok(p) => p,
            Err(e) => {
                self.resume();
                return Err(e);
            }
        };
        let final_pages = writer.page_count().unwrap_or(0);
        let writing = if final_pages <= PAUSED_WRITE_MAX_PAGES {
            Writing::InPlace(writer)
        } else {
            self.fork_writer(writer, &mut steps)
        };
        let (written, paused, mode) = self.finish_writing(writing, started, &mut steps);
        let state = self.vm_state(machine, None, Vec::new());
        let written = written.map(|last| rounds.iter().sum::<u64>() + last);
        let summary = self.finish_parts(pending, state, false, false, written)?;
        Ok(LiveSnapshot {
            summary,
            paused,
            complete: requested.elapsed(),
            mode: match mode {
                Mode::Paused => SnapshotMemoryMode::Precopy,
                Mode::Forked => SnapshotMemoryMode::PrecopyCopyOnWrite,
            },
            steps,
            precopy_rounds: rounds,
            final_pages: final_pages as u64,
        })
    }

    fn pause_timed(&self, steps: &mut PauseSteps) -> Result<(), VmError> {
        let t = Instant::now();
        let paused = self.pause();
        steps.pause_ms = ms_since(t);
        paused
    }

    /// Forks the child that writes `writer` (guest paused); a failed fork hands the writer
    /// back to be run in place.
    fn fork_writer(&self, writer: MemoryWriter, steps: &mut PauseSteps) -> Writing {
        let t = Instant::now();
        let forked = cow_writer::start(writer);
        steps.fork_ms = ms_since(t);
        match forked {
            Ok(child) => Writing::Forked(child),
            Err((e, writer)) => {
                eprintln!("dsec-vmm: {e}; writing the snapshot's memory with the guest paused");
                Writing::InPlace(writer)
            }
        }
    }

    /// Writes in place (guest still paused) or lets the forked child write, resumes the
    /// guest, and waits for the memory. Returns the pages written, the pause since `started`
    /// and how the memory was written.
    fn finish_writing(
        &self,
        writing: Writing,
        started: Instant,
        steps: &mut PauseSteps,
    ) -> (Result<u64, VmError>, Duration, Mode) {
        let (pending, mode) = match writing {
            Writing::InPlace(writer) => {
                let t = Instant::now();
                let written = write_in_place(&writer);
                steps.write_ms = ms_since(t);
                (Err(written), Mode::Paused)
            }
            Writing::Forked(child) => (Ok(child), Mode::Forked),
        };
        let t = Instant::now();
        self.resume();
        steps.resume_ms = ms_since(t);
        let paused = started.elapsed();
        let written = match pending {
            Err(written) => written,
            Ok(child) => child.wait().map_err(VmError::from),
        };
        (written, paused, mode)
    }

    /// Checks that every vCPU is parked (a VM restored with `--paused` asks its vCPU threads
    /// to park as they start; on a busy host they may not have got there yet) and reads the
    /// state of vCPUs, interrupt controllers, PIT, clock and devices.
    fn read_machine(&self) -> Result<MachineState, VmError> {
        if !self.vcpus.iter().all(VcpuHandle::is_paused) {
            return Err(VmError::NotPaused);
        }
        for vcpu in &self.vcpus {
            vcpu.pause(std::time::Duration::from_secs(5))?;
        }
        if !self.vcpus.iter().all(VcpuHandle::is_parked) {
            return Err(VmError::NotPaused);
        }
        let mut vcpus = Vec::new();
        for handle in &self.vcpus {
            let fd = lock(&handle.fd);
            vcpus.push(vcpu::save_state(&self.kvm, handle.id, &fd)?);
        }
        let (irqchips, pit, clock) = read_vm_chips(&self.fd)?;
        let devices = DevicesState {
            serial: lock(&self.serial).save(),
            virtio: slots::save(&self.virtio),
        };
        Ok(MachineState {
            vcpus,
            irqchips,
            pit,
            clock,
            devices,
        })
    }

    fn vm_state(&self, machine: MachineState, parent: Option<PathBuf>, pages: Vec<u64>) -> VmState {
        VmState {
            vmm_version: env!("CARGO_PKG_VERSION").to_string(),
            config: self.config.clone(),
            memory: MemoryState {
                regions: self.regions.clone(),
                parent,
                pages,
            },
            vcpus: machine.vcpus,
            irqchips: machine.irqchips,
            pit: machine.pit,
            clock: machine.clock,
            devices: machine.devices,
        }
    }

    /// Reads the paused VM's state and prepares its memory write. KVM's dirty log and the
    /// VMM's own bitmap are reset here, while the guest is paused, so the next diff holds
    /// exactly the pages written after this instant.
    /// A snapshot over the restore base reads which pages the guest wrote from the pagemap
    /// instead, and leaves both alone.
    fn capture(
        &self,
        dest: &Path,
        pages: &SnapshotPages,
        steps: &mut PauseSteps,
    ) -> Result<Captured, VmError> {
        let t = Instant::now();
        let machine = self.read_machine()?;
        steps.state_ms = ms_since(t);
        let last = lock(&self.last_snapshot).clone();
        // The parent as recorded: a dirty-log diff's absolute, an over-base one's as given.
        let parent = match (pages, &last) {
            (SnapshotPages::Full, _) => None,
            (SnapshotPages::Diff, Some(p)) if self.dirty_logging.load(Ordering::SeqCst) => {
                Some(std::fs::canonicalize(p).unwrap_or_else(|_| p.clone()))
            }
            (SnapshotPages::Diff, _) => return Err(VmError::NoBaseSnapshot),
            (SnapshotPages::OverBase(base), _) if self.private_base => Some(base.clone()),
            (SnapshotPages::OverBase(_), _) => return Err(VmError::NoRestoreBase),
        };
        // Read while paused: a page the guest writes after this is not in the set.
        let t = Instant::now();
        let written = match pages {
            SnapshotPages::OverBase(_) => Some(pagemap::written_pages(&self.mem, &self.regions)?),
            _ => None,
        };
        let pagemap_ms = ms_since(t);
        let t = Instant::now();
        let pending = PendingSnapshot::create(dest)?;
        let memory_file = pending.memory_file()?;
        steps.create_ms = ms_since(t);

        let t = Instant::now();
        let which = match (pages, written) {
            (SnapshotPages::Full, _) => DumpPages::All,
            (_, Some(written)) => DumpPages::These(written),
            (_, None) => DumpPages::Dirty(&self.fd),
        };
        let writer = MemoryWriter::prepare(&self.mem, &self.regions, &memory_file, which)?;
        steps.prepare_ms = ms_since(t) + pagemap_ms;
        if *pages == SnapshotPages::Full {
            let t = Instant::now();
            // From now on KVM tracks the guest's writes so the next snapshot can be a diff.
            memory::register(&self.fd, &self.mem, true)?;
            if self.dirty_logging.swap(true, Ordering::SeqCst) {
                // Already logging: clear the log so the diff starts at this snapshot.
                memory::clear_dirty_log(&self.mem, &self.fd)?;
            }
            steps.dirty_log_ms = ms_since(t);
        }
        let state = self.vm_state(machine, parent, writer.diff_pages().to_vec());
        Ok(Captured {
            pending,
            state,
            writer,
            _memory_file: memory_file,
            diff: *pages != SnapshotPages::Full,
            over_base: matches!(pages, SnapshotPages::OverBase(_)),
        })
    }

    fn finish(
        &self,
        captured: Captured,
        written: Result<u64, VmError>,
    ) -> Result<SnapshotSummary, VmError> {
        self.finish_parts(
            captured.pending,
            captured.state,
            captured.diff,
            captured.over_base,
            written,
        )
    }

    /// Commits the snapshot once its memory is written. On any failure the next diff has no
    /// base: the dirty log was already reset for a snapshot that does not exist. A snapshot
    /// over the restore base reset nothing, so the next diff's base stays what it was.
    fn finish_parts(
        &self,
        pending: PendingSnapshot,
        state: VmState,
        diff: bool,
        over_base: bool,
        written: Result<u64, VmError>,
    ) -> Result<SnapshotSummary, VmError> {
        let dest = pending.dest.clone();
        let committed = written.and_then(|pages| {
            pending.commit(&state)?;
            Ok(pages)
        });
        if over_base {
            return committed.map(|pages_written| SnapshotSummary {
                pages_written,
                diff,
            });
        }
        let mut last = lock(&self.last_snapshot);
        match committed {
            Ok(pages_written) => {
                *last = Some(dest);
                Ok(SnapshotSummary {
                    pages_written,
                    diff,
                })
            }
            Err(e) => {
                *last = None;
                Err(e)
            }
        }
    }
}

/// The VM-wide in-kernel state: the three interrupt controllers (PIC master, PIC slave,
/// IOAPIC), the PIT and the clock.
pub(super) fn read_vm_chips(
    fd: &kvm_ioctls::VmFd,
) -> Result<(Vec<kvm_irqchip>, kvm_pit_state2, kvm_clock_data), VmError> {
    let mut irqchips = Vec::new();
    for chip_id in [
        KVM_IRQCHIP_PIC_MASTER,
        KVM_IRQCHIP_PIC_SLAVE,
        KVM_IRQCHIP_IOAPIC,
    ] {
        let mut chip = kvm_irqchip {
            chip_id,
            ..Default::default()
        };
        fd.get_irqchip(&mut chip)
            .map_err(kvm_err("read the interrupt controller"))?;
        irqchips.push(chip);
    }
    let pit = fd.get_pit2().map_err(kvm_err("read the PIT"))?;
    let clock = fd.get_clock().map_err(kvm_err("read the guest clock"))?;
    Ok((irqchips, pit, clock))
}
