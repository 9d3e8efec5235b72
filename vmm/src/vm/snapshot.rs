//! Taking a snapshot of a paused VM: vCPU, interrupt controller, PIT, clock and device
//! states (the typed aggregate in `crate::snapshot::state`) and its memory, full or diff,
//! written through `crate::snapshot::format`.

use std::fs::File;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kvm_bindings::{
    kvm_irqchip, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE,
};

use super::{kvm_err, Vm, VmError};
use crate::cow_writer;
use crate::devices::virtio::slots;
use crate::memory::{self, DumpPages, MemoryWriter};
use crate::persist::Persist;
use crate::snapshot::{DevicesState, MemoryState, PendingSnapshot, VmState};
use crate::sync::lock;
use crate::vcpu::{self, VcpuHandle};

/// What a snapshot wrote.
#[derive(Clone, Copy, Debug)]
pub struct SnapshotSummary {
    pub pages_written: u64,
    pub diff: bool,
}

/// A snapshot of a running VM: what it wrote, how long the guest stood still for it and
/// how long until its memory was written (the snapshot is complete only then).
#[derive(Clone, Copy, Debug)]
pub struct LiveSnapshot {
    pub summary: SnapshotSummary,
    pub paused: Duration,
    pub complete: Duration,
}

/// Writes the memory from this thread (the guest must stay paused meanwhile).
fn write_in_place(writer: &MemoryWriter) -> Result<u64, VmError> {
    writer.write().map_err(|errno| {
        memory::MemoryError::Write(std::io::Error::from_raw_os_error(errno)).into()
    })
}

/// A snapshot whose state is taken and whose memory is still to be written.
struct Captured {
    pending: PendingSnapshot,
    state: VmState,
    writer: MemoryWriter,
    // Holds the descriptor the writer writes to.
    _memory_file: File,
    diff: bool,
}

impl Vm {
    /// Writes a snapshot of a paused VM into `dest` (which must not exist). With `diff`, only
    /// pages written since the previous snapshot of this VM go into the memory file.
    pub fn snapshot(&self, dest: &Path, diff: bool) -> Result<SnapshotSummary, VmError> {
        let captured = self.capture(dest, diff)?;
        let written = write_in_place(&captured.writer);
        self.finish(captured, written)
    }

    /// Snapshot of a running VM with a short pause: the vCPUs and devices stand still only
    /// while their state is read and a child process is forked with a copy-on-write view of
    /// guest memory; the guest runs again while that child writes the memory, and this
    /// returns once it has. A lazily restored VM (pages still to come through userfaultfd,
    /// which a forked child would read as zeroes) or a failed fork keeps the guest paused
    /// for the whole write instead.
    pub fn snapshot_live(&self, dest: &Path, diff: bool) -> Result<LiveSnapshot, VmError> {
        let requested = Instant::now();
        if !diff && !self.dirty_logging.load(Ordering::SeqCst) {
            // Turning KVM's dirty log on changes the memory slots (an SRCU grace period,
            // milliseconds): do it before the pause, which then only clears the log.
            memory::register(&self.fd, &self.mem, true)?;
            self.dirty_logging.store(true, Ordering::SeqCst);
        }
        let started = Instant::now();
        let captured = self.pause().and_then(|()| self.capture(dest, diff));
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
        } = captured;
        let in_background = if self.uffd.is_some() {
            Err(writer)
        } else {
            cow_writer::start(writer).map_err(|(e, writer)| {
                eprintln!("dsec-vmm: {e}; writing the snapshot's memory with the guest paused");
                writer
            })
        };
        let (written, paused) = match in_background {
            Ok(child) => {
                self.resume();
                let paused = started.elapsed();
                (child.wait().map_err(VmError::from), paused)
            }
            Err(writer) => {
                let written = write_in_place(&writer);
                self.resume();
                (written, started.elapsed())
            }
        };
        let summary = self.finish_parts(pending, state, diff, written)?;
        Ok(LiveSnapshot {
            summary,
            paused,
            complete: requested.elapsed(),
        })
    }

    /// Reads the paused VM's state and prepares its memory write. KVM's dirty log and the
    /// VMM's own bitmap are reset here, while the guest is paused, so the next diff holds
    /// exactly the pages written after this instant.
    fn capture(&self, dest: &Path, diff: bool) -> Result<Captured, VmError> {
        if !self.vcpus.iter().all(VcpuHandle::is_paused) {
            return Err(VmError::NotPaused);
        }
        // A VM restored with `--paused` asks its vCPU threads to park as they start; on a
        // busy host they may not have got there yet.
        for vcpu in &self.vcpus {
            vcpu.pause(std::time::Duration::from_secs(5))?;
        }
        if !self.vcpus.iter().all(VcpuHandle::is_parked) {
            return Err(VmError::NotPaused);
        }
        let parent = lock(&self.last_snapshot).clone();
        let diff_parent = match (diff, &parent) {
            (true, Some(p)) if self.dirty_logging.load(Ordering::SeqCst) => Some(p.clone()),
            (true, _) => return Err(VmError::NoBaseSnapshot),
            (false, _) => None,
        };
        let pending = PendingSnapshot::create(dest)?;
        let mut vcpus = Vec::new();
        for handle in &self.vcpus {
            let fd = lock(&handle.fd);
            vcpus.push(vcpu::save_state(&self.kvm, handle.id, &fd)?);
        }
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
            self.fd
                .get_irqchip(&mut chip)
                .map_err(kvm_err("read the interrupt controller"))?;
            irqchips.push(chip);
        }
        let pit = self.fd.get_pit2().map_err(kvm_err("read the PIT"))?;
        let clock = self
            .fd
            .get_clock()
            .map_err(kvm_err("read the guest clock"))?;
        let devices = DevicesState {
            serial: lock(&self.serial).save(),
            virtio: slots::save(&self.virtio),
        };

        let memory_file = pending.memory_file()?;
        let which = match diff_parent {
            None => DumpPages::All,
            Some(_) => DumpPages::Dirty(&self.fd),
        };
        let writer = MemoryWriter::prepare(&self.mem, &self.regions, &memory_file, which)?;
        if !diff {
            // From now on KVM tracks the guest's writes so the next snapshot can be a diff.
            memory::register(&self.fd, &self.mem, true)?;
            if self.dirty_logging.swap(true, Ordering::SeqCst) {
                // Already logging: clear the log so the diff starts at this snapshot.
                memory::clear_dirty_log(&self.mem, &self.fd)?;
            }
        }
        let state = VmState {
            vmm_version: env!("CARGO_PKG_VERSION").to_string(),
            config: self.config.clone(),
            memory: MemoryState {
                regions: self.regions.clone(),
                parent: diff_parent
                    .as_ref()
                    .map(|p| std::fs::canonicalize(p).unwrap_or_else(|_| p.clone())),
                pages: writer.diff_pages().to_vec(),
            },
            vcpus,
            irqchips,
            pit,
            clock,
            devices,
        };
        Ok(Captured {
            pending,
            state,
            writer,
            _memory_file: memory_file,
            diff: diff_parent.is_some(),
        })
    }

    fn finish(
        &self,
        captured: Captured,
        written: Result<u64, VmError>,
    ) -> Result<SnapshotSummary, VmError> {
        self.finish_parts(captured.pending, captured.state, captured.diff, written)
    }

    /// Commits the snapshot once its memory is written. On any failure the next diff has no
    /// base: the dirty log was already reset for a snapshot that does not exist.
    fn finish_parts(
        &self,
        pending: PendingSnapshot,
        state: VmState,
        diff: bool,
        written: Result<u64, VmError>,
    ) -> Result<SnapshotSummary, VmError> {
        let dest = pending.dest.clone();
        let committed = written.and_then(|pages| {
            pending.commit(&state)?;
            Ok(pages)
        });
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
