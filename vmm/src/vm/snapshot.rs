//! Taking a snapshot of a paused VM: vCPU, interrupt controller, PIT, clock and device
//! states (the typed aggregate in `crate::snapshot::state`) and its memory, full or diff,
//! written through `crate::snapshot::format`.

use std::path::Path;
use std::sync::atomic::Ordering;

use kvm_bindings::{
    kvm_irqchip, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE,
};

use super::{kvm_err, Vm, VmError};
use crate::devices::virtio::slots;
use crate::memory::{self, DumpPages};
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

impl Vm {
    /// Writes a snapshot of a paused VM into `dest` (which must not exist). With `diff`, only
    /// pages written since the previous snapshot of this VM go into the memory file.
    pub fn snapshot(&self, dest: &Path, diff: bool) -> Result<SnapshotSummary, VmError> {
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

        let mut mem_file = pending.memory_file()?;
        let (pages_written, pages) = match &diff_parent {
            None => (
                memory::dump(&self.mem, &self.regions, &mut mem_file, DumpPages::All)?.len() as u64,
                Vec::new(),
            ),
            Some(_) => {
                let list =
                    memory::dump_dirty_list(&self.mem, &self.regions, &self.fd, &mut mem_file)?;
                (list.len() as u64, list)
            }
        };
        let state = VmState {
            vmm_version: env!("CARGO_PKG_VERSION").to_string(),
            config: self.config.clone(),
            memory: MemoryState {
                regions: self.regions.clone(),
                parent: diff_parent
                    .as_ref()
                    .map(|p| std::fs::canonicalize(p).unwrap_or_else(|_| p.clone())),
                pages,
            },
            vcpus,
            irqchips,
            pit,
            clock,
            devices,
        };
        pending.commit(&state)?;
        if !diff {
            // From now on KVM tracks the guest's writes so the next snapshot can be a diff.
            memory::register(&self.fd, &self.mem, true)?;
            if self.dirty_logging.swap(true, Ordering::SeqCst) {
                // Already logging: clear the log so the diff starts at this snapshot.
                memory::clear_dirty_log(&self.mem, &self.fd)?;
            }
        }
        *lock(&self.last_snapshot) = Some(dest.to_owned());
        Ok(SnapshotSummary {
            pages_written,
            diff: diff_parent.is_some(),
        })
    }
}
