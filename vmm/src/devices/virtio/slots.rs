//! Which virtio-mmio device sits in which slot, and wiring each one to the VM: slot `i` lives
//! at `VIRTIO_MMIO_BASE + i * VIRTIO_MMIO_SIZE` with IRQ `VIRTIO_IRQ_BASE + i`. Order: vsock
//! (slot 0, when configured), rng, the drives in config order, net, balloon, the pmem files in
//! config order. The kernel command line
//! declares them in the same order, so Linux names the disks vda, vdb, ... as configured.

use std::sync::{Arc, Mutex};

use kvm_ioctls::{IoEventAddress, VmFd};
use vmm_sys_util::eventfd::EventFd;

use super::balloon::{Balloon, BalloonControl};
use super::block::{Block, Disk};
use super::mmio::MmioTransport;
use super::net::{open_tap, Net};
use super::persist::{DeviceState, SavedState, SlotState};
use super::pmem::{self, Pmem};
use super::rng::Rng;
use super::vsock::Vsock;
use super::VirtioDevice;
use crate::arch::layout;
use crate::config::VmConfig;
use crate::devices::bus::Bus;
use crate::memory::GuestMemory;
use crate::persist::Persist;
use crate::sync::lock;

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

/// The attached devices in slot order (pause, resume, snapshot), and the balloon's control
/// handle when the VM has one.
pub struct Attached {
    pub all: Vec<VirtioSlot>,
    pub balloon: Option<Arc<BalloonControl>>,
}

/// Reads the typed state of the device type a slot was built with.
type SaveDevice = fn(&dyn VirtioDevice) -> Option<DeviceState>;

fn save_as<D: VirtioDevice + Persist + 'static>(device: &dyn VirtioDevice) -> Option<DeviceState>
where
    D::State: SavedState,
{
    let device: &D = device.as_any().downcast_ref()?;
    Some(device.save().into())
}

/// An attached virtio device: its transport on the MMIO bus, and how to save its state
/// (chosen when the slot was built, so saving needs no list of device kinds).
pub struct VirtioSlot {
    pub transport: Arc<Mutex<MmioTransport>>,
    save_device: SaveDevice,
}

/// A device ready to go behind its transport.
struct Built {
    device: Box<dyn VirtioDevice>,
    save_device: SaveDevice,
}

fn built<D: VirtioDevice + Persist + 'static>(device: D) -> Built
where
    D::State: SavedState,
{
    Built {
        device: Box::new(device),
        save_device: save_as::<D>,
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why a device could not be attached.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    #[error("cannot set up virtio device in slot {slot} ({what}): {source}")]
    Device {
        slot: usize,
        what: String,
        source: BoxError,
    },
    #[error("the snapshot has no state for virtio slot {slot} ({what}); restore with the configuration it was taken with")]
    MissingState { slot: usize, what: String },
    #[error("the snapshot holds a {saved} device in virtio slot {slot} where this VM has {what}; restore with the configuration it was taken with")]
    WrongKind {
        slot: usize,
        what: String,
        saved: &'static str,
    },
    #[error("cannot restore virtio device in slot {slot} ({what}) from the snapshot: {source}")]
    Restore {
        slot: usize,
        what: String,
        source: BoxError,
    },
}

/// One slot being attached: builds its device fresh, or through the device's own
/// [`Persist`] impl from the slot's saved state.
struct SlotBuilder<'a> {
    index: usize,
    what: String,
    saved: Option<&'a SlotState>,
}

impl SlotBuilder<'_> {
    fn device<D: Persist>(
        &self,
        context: D::Context,
        fresh: impl FnOnce(D::Context) -> D,
    ) -> Result<D, AttachError>
    where
        D::State: SavedState,
    {
        let Some(saved) = self.saved else {
            return Ok(fresh(context));
        };
        let state =
            D::State::from_device_state(&saved.device).ok_or_else(|| AttachError::WrongKind {
                slot: self.index,
                what: self.what.clone(),
                saved: saved.device.kind(),
            })?;
        D::restore(context, state).map_err(|e| AttachError::Restore {
            slot: self.index,
            what: self.what.clone(),
            source: Box::new(e),
        })
    }

    fn setup_error(&self, source: impl Into<BoxError>) -> AttachError {
        AttachError::Device {
            slot: self.index,
            what: self.what.clone(),
            source: source.into(),
        }
    }
}

/// Builds every virtio device of `config` (each restored from its slot in `saved` when
/// given) and puts it on the MMIO bus with its interrupt and kick eventfds.
pub fn attach(
    config: &VmConfig,
    vm: &VmFd,
    mem: &GuestMemory,
    mmio: &mut Bus,
    saved: Option<&[SlotState]>,
) -> Result<Attached, AttachError> {
    let mut out = Attached {
        all: Vec::new(),
        balloon: None,
    };
    let mut pmem_addr = pmem::window_base(config.mem_mib << 20);
    for (i, slot) in plan(config).into_iter().enumerate() {
        let what = format!("{slot:?}");
        let saved_slot = match saved {
            None => None,
            Some(all) => Some(all.iter().find(|s| s.slot as usize == i).ok_or_else(|| {
                AttachError::MissingState {
                    slot: i,
                    what: what.clone(),
                }
            })?),
        };
        let b = SlotBuilder {
            index: i,
            what,
            saved: saved_slot,
        };
        let missing = || b.setup_error("missing from the configuration");
        let Built {
            device,
            save_device,
        } = match &slot {
            Slot::Vsock => {
                let v = config.vsock.as_ref().ok_or_else(missing)?;
                let fresh =
                    Vsock::new(v.guest_cid, v.uds_path.clone()).map_err(|e| b.setup_error(e))?;
                built(b.device::<Vsock>(fresh, |d| d)?)
            }
            Slot::Rng => built(b.device((), |()| Rng::new())?),
            Slot::Block(d) => {
                let d = &config.drives[*d];
                let disk = Disk::open(&d.path, d.read_only).map_err(|e| b.setup_error(e))?;
                built(b.device(disk, Block::new)?)
            }
            Slot::Net => {
                let n = config.net.as_ref().ok_or_else(missing)?;
                let tap = open_tap(&n.tap).map_err(|e| b.setup_error(e))?;
                built(b.device((tap, n.mac_bytes()), |(t, m)| Net::new(t, m))?)
            }
            Slot::Balloon => {
                let c = config.balloon.clone().ok_or_else(missing)?;
                let balloon = b.device((c, config.mem_mib), |(c, m)| Balloon::new(c, m))?;
                out.balloon = Some(balloon.control());
                built(balloon)
            }
            Slot::Pmem(index) => {
                let p = &config.pmem[*index];
                let backing = pmem::Backing::open(&p.path, p.read_only, p.shared, pmem_addr)
                    .map_err(|e| b.setup_error(e))?;
                let device = b.device(backing, Pmem::new)?;
                device
                    .backing()
                    .register(vm, pmem::KVM_SLOT_BASE + *index as u32)
                    .map_err(|e| b.setup_error(e))?;
                pmem_addr += device.backing().size();
                built(device)
            }
        };
        let irqfd = EventFd::new(libc::EFD_NONBLOCK).map_err(|e| b.setup_error(e))?;
        vm.register_irqfd(&irqfd, irq(i))
            .map_err(|e| b.setup_error(format!("KVM refused the interrupt: {e}")))?;
        let transport = match saved_slot {
            Some(state) => MmioTransport::restore((device, mem.clone(), irqfd), &state.transport)
                .map_err(|e| AttachError::Restore {
                slot: i,
                what: b.what.clone(),
                source: Box::new(e),
            })?,
            None => MmioTransport::new(device, mem.clone(), irqfd).map_err(|e| b.setup_error(e))?,
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
            .map_err(|e| b.setup_error(e))?;
        out.all.push(VirtioSlot {
            transport,
            save_device,
        });
    }
    Ok(out)
}

/// Snapshot states of every virtio device, keyed by slot.
pub fn save(all: &[VirtioSlot]) -> Vec<SlotState> {
    all.iter()
        .enumerate()
        .filter_map(|(i, slot)| {
            let t = lock(&slot.transport);
            let device = (slot.save_device)(t.device());
            if device.is_none() {
                tracing::error!(
                    slot = i,
                    "virtio device is not the type its slot was built with"
                );
            }
            Some(SlotState {
                slot: i as u32,
                transport: t.save(),
                device: device?,
            })
        })
        .collect()
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
