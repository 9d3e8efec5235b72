//! What a snapshot holds: the typed aggregate of the VM's state. Each piece is defined next
//! to what it describes (vCPUs in `vcpu`, devices in their folders' `persist.rs`).

use std::path::PathBuf;

use kvm_bindings::{kvm_clock_data, kvm_irqchip, kvm_pit_state2};
use serde::{Deserialize, Serialize};

use crate::config::VmConfig;
use crate::devices::legacy::SerialState;
use crate::devices::virtio::persist::SlotState;
use crate::memory::RegionLayout;
use crate::vcpu::VcpuState;

/// Guest memory of a snapshot: a full image, or the pages dirtied since `parent`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct MemoryState {
    pub regions: Vec<RegionLayout>,
    /// For a diff snapshot: the snapshot this one applies on top of.
    pub parent: Option<PathBuf>,
    /// For a diff snapshot: the page numbers (in file order) this memory file holds.
    pub pages: Vec<u64>,
}

impl MemoryState {
    /// Bytes the memory file of a full snapshot covers.
    pub fn file_size(&self) -> u64 {
        self.regions
            .iter()
            .map(|r| r.file_offset + r.size)
            .max()
            .unwrap_or(0)
    }
}

/// Device states: the UART and every virtio-mmio slot (vsock included), in slot order.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DevicesState {
    pub serial: SerialState,
    pub virtio: Vec<SlotState>,
}

/// Everything needed to bring a VM back.
#[derive(Serialize, Deserialize)]
pub struct VmState {
    pub vmm_version: String,
    pub config: VmConfig,
    pub memory: MemoryState,
    pub vcpus: Vec<VcpuState>,
    #[serde(with = "crate::snapshot::blob::list")]
    pub irqchips: Vec<kvm_irqchip>,
    #[serde(with = "crate::snapshot::blob")]
    pub pit: kvm_pit_state2,
    #[serde(with = "crate::snapshot::blob")]
    pub clock: kvm_clock_data,
    pub devices: DevicesState,
}
