//! virtio-mmio transport, version 2 (modern). Every register value from the guest is checked
//! before it reaches a queue or a device.

use std::sync::Arc;

use crate::memory::GuestMemory;
use virtio_queue::{Queue, QueueT};
use vmm_sys_util::eventfd::EventFd;

use super::pause::PauseError;
use super::{Interrupt, VirtioDevice, VIRTIO_F_VERSION_1};
use crate::devices::bus::BusDevice;

mod persist;
pub use persist::{QueueSnapshot, TransportRestoreError, TransportState};

const MAGIC: u32 = 0x7472_6976; // "virt"
const VERSION: u32 = 2;
const VENDOR_ID: u32 = 0x4453_4543; // "DSEC"
const CONFIG_SPACE_OFFSET: u64 = 0x100;

const STATUS_ACKNOWLEDGE: u32 = 1;
const STATUS_DRIVER: u32 = 2;
const STATUS_DRIVER_OK: u32 = 4;
const STATUS_FEATURES_OK: u32 = 8;
const STATUS_FAILED: u32 = 0x80;

pub struct MmioTransport {
    device: Box<dyn VirtioDevice>,
    mem: GuestMemory,
    interrupt: Arc<Interrupt>,
    queues: Vec<Queue>,
    queue_events: Vec<EventFd>,
    queue_select: u32,
    device_features_select: u32,
    driver_features_select: u32,
    driver_features: u64,
    status: u32,
    activated: bool,
    config_generation: u32,
}

impl MmioTransport {
    pub fn new(
        device: Box<dyn VirtioDevice>,
        mem: GuestMemory,
        irqfd: EventFd,
    ) -> std::io::Result<Self> {
        let mut queues = Vec::new();
        let mut queue_events = Vec::new();
        for &max in device.queue_max_sizes() {
            queues.push(Queue::new(max).map_err(|e| std::io::Error::other(format!("{e:?}")))?);
            queue_events.push(EventFd::new(libc::EFD_NONBLOCK)?);
        }
        Ok(MmioTransport {
            device,
            mem,
            interrupt: Arc::new(Interrupt::new(irqfd)),
            queues,
            queue_events,
            queue_select: 0,
            device_features_select: 0,
            driver_features_select: 0,
            driver_features: 0,
            status: 0,
            activated: false,
            config_generation: 0,
        })
    }

    /// Stops the device thread touching guest memory (for a snapshot).
    /// Asks an active device to park; [`MmioTransport::wait_device_paused`] waits for it.
    pub fn request_device_pause(&mut self) -> Result<(), PauseError> {
        if self.activated {
            self.device.request_pause()
        } else {
            Ok(())
        }
    }

    pub fn wait_device_paused(&mut self) -> Result<(), PauseError> {
        if self.activated {
            self.device.wait_paused()
        } else {
            Ok(())
        }
    }

    pub fn resume_device(&mut self) {
        if self.activated {
            self.device.resume();
        }
    }

    /// The device behind this transport.
    pub fn device(&self) -> &dyn VirtioDevice {
        self.device.as_ref()
    }

    /// See `Interrupt::reassert_pending`.
    pub fn reassert_pending_interrupt(&self) {
        self.interrupt.reassert_pending();
    }

    /// Eventfds the VMM can register as ioeventfds for QueueNotify (index = queue).
    pub fn queue_events(&self) -> &[EventFd] {
        &self.queue_events
    }

    fn selected_queue(&mut self) -> Option<&mut Queue> {
        self.queues.get_mut(self.queue_select as usize)
    }

    fn update_queue(&mut self, f: impl FnOnce(&mut Queue)) {
        // Queue registers are only writable while the driver is setting up.
        if self.status & STATUS_DRIVER_OK != 0 {
            tracing::debug!("guest wrote a queue register after DRIVER_OK; ignored");
            return;
        }
        if let Some(q) = self.selected_queue() {
            f(q);
        }
    }

    fn set_status(&mut self, value: u32) {
        if value == 0 {
            self.reset();
            return;
        }
        // The driver may only add bits, in order.
        let added = value & !self.status;
        if value & self.status != self.status {
            tracing::debug!(value, "guest cleared virtio status bits without reset");
            self.status |= STATUS_FAILED;
            return;
        }
        if added & STATUS_FEATURES_OK != 0 && self.driver_features & VIRTIO_F_VERSION_1 == 0 {
            // Legacy drivers are not supported: refuse FEATURES_OK.
            self.status = value & !STATUS_FEATURES_OK;
            return;
        }
        self.status = value;
        if added & STATUS_DRIVER_OK != 0 && !self.activated {
            self.activate();
        }
    }

    fn activate(&mut self) {
        let ready = self
            .queues
            .iter()
            .all(|q| !q.ready() || q.is_valid(&self.mem));
        if self.status & STATUS_FEATURES_OK == 0 || !ready {
            self.status |= STATUS_FAILED;
            return;
        }
        let events: std::io::Result<Vec<EventFd>> =
            self.queue_events.iter().map(|e| e.try_clone()).collect();
        // The device gets its own copies; ours keep answering register reads.
        let queues: Result<Vec<Queue>, _> = self
            .queues
            .iter()
            .map(|q| Queue::try_from(q.state()))
            .collect();
        let result = match (events, queues) {
            (Ok(events), Ok(queues)) => {
                self.device
                    .activate(self.mem.clone(), queues, events, self.interrupt.clone())
            }
            (Err(e), _) => Err(e.into()),
            (_, Err(_)) => Err(super::ActivateError::BadQueues),
        };
        match result {
            Ok(()) => self.activated = true,
            Err(e) => {
                tracing::warn!("virtio device activation failed: {e}");
                self.status |= STATUS_FAILED;
            }
        }
    }

    fn reset(&mut self) {
        if self.activated && !self.device.reset() {
            self.status |= STATUS_FAILED;
            return;
        }
        self.activated = false;
        self.status = 0;
        self.driver_features = 0;
        self.queue_select = 0;
        self.interrupt.ack(u32::MAX);
        for q in &mut self.queues {
            q.reset();
        }
    }
}

fn read_u32(data: &[u8]) -> Option<u32> {
    Some(u32::from_le_bytes(data.try_into().ok()?))
}

impl BusDevice for MmioTransport {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if offset >= CONFIG_SPACE_OFFSET {
            self.device.read_config(offset - CONFIG_SPACE_OFFSET, data);
            return;
        }
        data.fill(0);
        if data.len() != 4 {
            return; // registers are 32-bit only
        }
        let features = self.device.features();
        let value = match offset {
            0x000 => MAGIC,
            0x004 => VERSION,
            0x008 => self.device.device_type(),
            0x00c => VENDOR_ID,
            0x010 => match self.device_features_select {
                0 => features as u32,
                1 => (features >> 32) as u32,
                _ => 0,
            },
            0x034 => self.selected_queue().map_or(0, |q| u32::from(q.max_size())),
            0x044 => self.selected_queue().map_or(0, |q| u32::from(q.ready())),
            0x060 => self.interrupt.status(),
            0x070 => self.status,
            0x0fc => self.config_generation,
            _ => 0,
        };
        data.copy_from_slice(&value.to_le_bytes());
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset >= CONFIG_SPACE_OFFSET {
            self.device.write_config(offset - CONFIG_SPACE_OFFSET, data);
            self.config_generation = self.config_generation.wrapping_add(1);
            return;
        }
        let Some(value) = read_u32(data) else { return };
        match offset {
            0x014 => self.device_features_select = value,
            0x020 => {
                if self.status & STATUS_DRIVER != 0 && self.status & STATUS_FEATURES_OK == 0 {
                    let shift = match self.driver_features_select {
                        0 => 0,
                        1 => 32,
                        _ => return,
                    };
                    let mask = 0xffff_ffffu64 << shift;
                    // Only features we offered can be accepted.
                    let accepted = (u64::from(value) << shift) & self.device.features();
                    self.driver_features = (self.driver_features & !mask) | accepted;
                    self.device.ack_features(self.driver_features);
                }
            }
            0x024 => self.driver_features_select = value,
            0x030 => self.queue_select = value,
            0x038 => self.update_queue(|q| {
                if let Ok(size) = u16::try_from(value) {
                    q.set_size(size);
                }
            }),
            0x044 => self.update_queue(|q| q.set_ready(value == 1)),
            0x050 => {
                if let Some(event) = self.queue_events.get(value as usize) {
                    let _ = event.write(1);
                }
            }
            0x064 => self.interrupt.ack(value),
            0x070 => self.set_status(value),
            0x080 => self.update_queue(|q| q.set_desc_table_address(Some(value), None)),
            0x084 => self.update_queue(|q| q.set_desc_table_address(None, Some(value))),
            0x090 => self.update_queue(|q| q.set_avail_ring_address(Some(value), None)),
            0x094 => self.update_queue(|q| q.set_avail_ring_address(None, Some(value))),
            0x0a0 => self.update_queue(|q| q.set_used_ring_address(Some(value), None)),
            0x0a4 => self.update_queue(|q| q.set_used_ring_address(None, Some(value))),
            _ => tracing::debug!(offset, "guest wrote an unknown virtio-mmio register"),
        }
    }
}

/// The status bits a well-behaved driver sets, in order (used by tests).
pub const DRIVER_INIT_SEQUENCE: [u32; 3] = [
    STATUS_ACKNOWLEDGE,
    STATUS_ACKNOWLEDGE | STATUS_DRIVER,
    STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK,
];
