//! Which virtio-mmio device sits in which slot, and wiring each one to the VM: slot `i` lives
//! at `VIRTIO_MMIO_BASE + i * VIRTIO_MMIO_SIZE` with IRQ `VIRTIO_IRQ_BASE + i`. Order: vsock
//! (slot 0, when configured), rng, the drives in config order, net, balloon, the pmem files in
//! config order. The kernel command line
//! declares them in the same order, so Linux names the disks vda, vdb, ... as configured.

use std::sync::{Arc, Mutex};

use kvm_ioctls::{IoEventAddress, VmFd};
use serde::{Deserialize, Serialize};
use vmm_sys_util::eventfd::EventFd;

use super::balloon::{Balloon, BalloonControl, BalloonState};
use super::block::Block;
use super::mmio::{MmioTransport, TransportState};
use super::net::Net;
use super::pmem::{self, Pmem, PmemState};
use super::rng::Rng;
use super::vsock::Vsock;
use super::VirtioDevice;
use crate::arch::layout;
use crate::config::VmConfig;
use crate::devices::bus::Bus;
use crate::memory::GuestMemory;
use crate::snapshot::Persist;

/// A device's place in the VM.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Slot {
    Vsock,
    Rng,
    /// Index into `VmConfig::drives`.
    Block(usize),
    Net,
    Balloon,
    /// Index into `VmConfig::pmem`.
    Pmem(usize),
}

/// A non-vsock virtio device's snapshot state, keyed by its MMIO slot.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotState {
    pub slot: u32,
    pub transport: TransportState,
    /// The balloon's own state (target, actual, statistics) when this slot is the balloon.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub balloon: Option<BalloonState>,
    /// Device-specific state (pmem: the mapped file's identity and window).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<serde_json::Value>,
}

/// The devices of `config` in slot order.
pub fn plan(config: &VmConfig) -> Vec<Slot> {
    let mut slots = Vec::new();
    if config.vsock.is_some() {
        slots.push(Slot::Vsock);
    }
    if config.rng {
        slots.push(Slot::Rng);
    }
    slots.extend((0..config.drives.len()).map(Slot::Block));
    if config.net.is_some() {
        slots.push(Slot::Net);
    }
    if config.balloon.is_some() {
        slots.push(Slot::Balloon);
    }
    slots.extend((0..config.pmem.len()).map(Slot::Pmem));
    slots
}

pub fn mmio_base(slot: usize) -> u64 {
    layout::VIRTIO_MMIO_BASE + slot as u64 * layout::VIRTIO_MMIO_SIZE
}

pub fn irq(slot: usize) -> u32 {
    layout::VIRTIO_IRQ_BASE + slot as u32
}

/// ` virtio_mmio.device=4K@<base>:<irq>` for every device, in slot order.
pub fn cmdline(config: &VmConfig) -> String {
    plan(config)
        .iter()
        .enumerate()
        .map(|(i, _)| format!(" virtio_mmio.device=4K@{:#x}:{}", mmio_base(i), irq(i)))
        .collect()
}

/// The attached devices: vsock separately (the VM tells it about forks), all of them in
/// slot order for pause/resume/snapshot.
pub struct Attached {
    pub vsock: Option<Arc<Mutex<MmioTransport>>>,
    pub all: Vec<Arc<Mutex<MmioTransport>>>,
    /// The balloon's control handle, when the VM has one.
    pub balloon: Option<Arc<BalloonControl>>,
}

/// Why a device could not be attached.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    #[error("cannot set up the vsock device: {0}")]
    Vsock(std::io::Error),
    #[error("cannot set up virtio device in slot {slot} ({what}): {detail}")]
    Device {
        slot: usize,
        what: String,
        detail: String,
    },
}

/// Builds every virtio device of `config`, restoring transports from `saved` (slot 0 vsock
/// from `saved_vsock`), and puts them on the MMIO bus with their interrupts and kick eventfds.
pub fn attach(
    config: &VmConfig,
    vm: &VmFd,
    mem: &GuestMemory,
    mmio: &mut Bus,
    saved_vsock: Option<&TransportState>,
    saved: &[SlotState],
) -> Result<Attached, AttachError> {
    let mut out = Attached {
        vsock: None,
        all: Vec::new(),
        balloon: None,
    };
    let mut pmem_addr = pmem::window_base(config.mem_mib << 20);
    for (i, slot) in plan(config).into_iter().enumerate() {
        let saved_slot = saved.iter().find(|s| s.slot as usize == i);
        let err = |detail: String| AttachError::Device {
            slot: i,
            what: format!("{slot:?}"),
            detail,
        };
        let device: Box<dyn VirtioDevice> = match &slot {
            Slot::Vsock => {
                let v = config
                    .vsock
                    .as_ref()
                    .ok_or_else(|| err("no config".into()))?;
                Box::new(Vsock::new(v.guest_cid, v.uds_path.clone()).map_err(AttachError::Vsock)?)
            }
            Slot::Rng => Box::new(Rng::new()),
            Slot::Block(d) => {
                let d = &config.drives[*d];
                Block::open(&d.path, d.read_only).map_err(|e| err(e.to_string()))?
            }
            Slot::Net => {
                let n = config.net.as_ref().ok_or_else(|| err("no config".into()))?;
                Net::open(&n.tap, n.mac_bytes()).map_err(|e| err(e.to_string()))?
            }
            Slot::Balloon => {
                let b = config
                    .balloon
                    .clone()
                    .ok_or_else(|| err("no config".into()))?;
                let saved_balloon = saved
                    .iter()
                    .find(|s| s.slot as usize == i)
                    .and_then(|s| s.balloon.as_ref());
                let device = match saved_balloon {
                    Some(state) => Balloon::restore((b, config.mem_mib), state)
                        .map_err(|e| err(format!("restore from snapshot: {e}")))?,
                    None => Balloon::new(b, config.mem_mib),
                };
                out.balloon = Some(device.control());
                Box::new(device)
            }
            Slot::Pmem(index) => {
                let p = &config.pmem[*index];
                let backing = pmem::Backing::open(&p.path, p.read_only, p.shared, pmem_addr)
                    .map_err(|e| err(e.to_string()))?;
                if let Some(saved) = saved_slot.and_then(|s| s.device.clone()) {
                    let saved: PmemState = serde_json::from_value(saved)
                        .map_err(|e| err(format!("restore from snapshot: {e}")))?;
                    backing.matches(&saved).map_err(|e| err(e.to_string()))?;
                }
                backing
                    .register(vm, pmem::KVM_SLOT_BASE + *index as u32)
                    .map_err(|e| err(e.to_string()))?;
                pmem_addr += backing.size();
                Box::new(Pmem::new(backing))
            }
        };
        let irqfd = EventFd::new(libc::EFD_NONBLOCK).map_err(|e| err(e.to_string()))?;
        vm.register_irqfd(&irqfd, irq(i))
            .map_err(|e| err(format!("KVM refused the interrupt: {e}")))?;
        let state = match &slot {
            Slot::Vsock => saved_vsock,
            _ => saved_slot.map(|s| &s.transport),
        };
        let transport = match state {
            Some(state) => MmioTransport::restore((device, mem.clone(), irqfd), state)
                .map_err(|e| err(format!("restore from snapshot: {e}")))?,
            None => MmioTransport::new(device, mem.clone(), irqfd)
                .map_err(|e| err(format!("transport: {e}")))?,
        };
        let base = mmio_base(i);
        for (index, event) in transport.queue_events().iter().enumerate() {
            // Queue kicks go straight to the device thread without a userspace exit.
            let addr = IoEventAddress::Mmio(base + 0x50);
            if let Err(e) = vm.register_ioevent(event, &addr, index as u32) {
                tracing::debug!("ioeventfd unavailable, kicks take the slow path: {e}");
            }
        }
        let transport = Arc::new(Mutex::new(transport));
        mmio.insert(base, layout::VIRTIO_MMIO_SIZE, transport.clone())
            .map_err(|e| err(e.to_string()))?;
        if slot == Slot::Vsock {
            out.vsock = Some(transport.clone());
        }
        out.all.push(transport);
    }
    Ok(out)
}

/// Snapshot states of every non-vsock device, keyed by slot.
pub fn save(config: &VmConfig, all: &[Arc<Mutex<MmioTransport>>]) -> Vec<SlotState> {
    plan(config)
        .iter()
        .zip(all)
        .enumerate()
        .filter(|(_, (slot, _))| **slot != Slot::Vsock)
        .map(|(i, (_, t))| {
            let t = crate::devices::bus::lock(t);
            SlotState {
                slot: i as u32,
                transport: t.save(),
                balloon: None,
                device: t.device_state(),
            }
        })
        .collect()
}

/// Adds the balloon's own state to its slot in `states` (from [`save`]).
pub fn save_balloon(config: &VmConfig, states: &mut [SlotState], balloon: Option<&BalloonControl>) {
    let Some(balloon) = balloon else { return };
    let Some(i) = plan(config).iter().position(|s| *s == Slot::Balloon) else {
        return;
    };
    if let Some(s) = states.iter_mut().find(|s| s.slot as usize == i) {
        s.balloon = Some(balloon.state());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pmem_files_come_last_in_config_order() {
        let mut c = VmConfig::new("/k");
        c.rng = true;
        c.drives.push("/d.img".parse().unwrap());
        c.net = Some("tap=t0".parse().unwrap());
        c.pmem.push("/a.img,ro".parse().unwrap());
        c.pmem.push("/b.img".parse().unwrap());
        assert_eq!(
            plan(&c),
            [
                Slot::Rng,
                Slot::Block(0),
                Slot::Net,
                Slot::Pmem(0),
                Slot::Pmem(1)
            ]
        );
        let line = cmdline(&c);
        assert!(
            line.ends_with(" virtio_mmio.device=4K@0xd0004000:9"),
            "{line}"
        );
    }
}
