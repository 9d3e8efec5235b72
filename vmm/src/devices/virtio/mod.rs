//! Virtio devices and their MMIO transport.

pub mod balloon;
pub mod block;
pub mod mmio;
pub mod net;
pub mod pmem;
pub mod rng;
pub mod slots;
pub mod testing;
pub mod vsock;
pub mod worker;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use crate::memory::GuestMemory;
use virtio_queue::Queue;
use vmm_sys_util::eventfd::EventFd;

/// VIRTIO_F_VERSION_1: we only speak modern virtio.
pub const VIRTIO_F_VERSION_1: u64 = 1 << 32;
/// Interrupt status bit: a used ring was updated.
pub const INTERRUPT_USED_RING: u32 = 1;
/// Interrupt status bit: the device's config space changed.
pub const INTERRUPT_CONFIG: u32 = 2;

/// A device's interrupt line: the status register the guest reads, and the irqfd that raises it.
pub struct Interrupt {
    status: AtomicU32,
    irqfd: EventFd,
}

impl Interrupt {
    pub fn new(irqfd: EventFd) -> Self {
        Interrupt {
            status: AtomicU32::new(0),
            irqfd,
        }
    }

    /// Tells the guest a used ring changed.
    pub fn signal_used_queue(&self) {
        self.status.fetch_or(INTERRUPT_USED_RING, Ordering::SeqCst);
        if let Err(e) = self.irqfd.write(1) {
            tracing::warn!("cannot raise virtio interrupt: {e}");
        }
    }

    /// Tells the guest the device's config space changed (e.g. a new balloon target).
    pub fn signal_config_change(&self) {
        self.status.fetch_or(INTERRUPT_CONFIG, Ordering::SeqCst);
        if let Err(e) = self.irqfd.write(1) {
            tracing::warn!("cannot raise virtio interrupt: {e}");
        }
    }

    pub fn status(&self) -> u32 {
        self.status.load(Ordering::SeqCst)
    }

    /// Raises the line again if the guest has not acknowledged an interrupt yet: one sent
    /// while a restore was still loading vCPU state was wiped with the old LAPIC state.
    pub fn reassert_pending(&self) {
        if self.status() != 0 {
            if let Err(e) = self.irqfd.write(1) {
                tracing::warn!("cannot raise virtio interrupt: {e}");
            }
        }
    }

    pub fn ack(&self, bits: u32) {
        self.status.fetch_and(!bits, Ordering::SeqCst);
    }
}

/// Why a device could not start.
#[derive(Debug, thiserror::Error)]
pub enum ActivateError {
    #[error("device setup failed: {0}")]
    Io(#[from] std::io::Error),
    #[error("guest set up invalid queues")]
    BadQueues,
}

/// What the MMIO transport needs from a device.
pub trait VirtioDevice: Send {
    /// Virtio device id (19 = vsock).
    fn device_type(&self) -> u32;
    /// Maximum size of each queue; the length is the number of queues.
    fn queue_max_sizes(&self) -> &[u16];
    /// Features offered to the guest.
    fn features(&self) -> u64;
    /// Features the guest accepted (a subset of `features`).
    fn ack_features(&mut self, features: u64);
    /// Device config space, guest-chosen offset and width.
    fn read_config(&self, offset: u64, data: &mut [u8]);
    fn write_config(&mut self, offset: u64, data: &[u8]);
    /// Starts processing: the guest set DRIVER_OK.
    fn activate(
        &mut self,
        mem: GuestMemory,
        queues: Vec<Queue>,
        queue_events: Vec<EventFd>,
        interrupt: Arc<Interrupt>,
    ) -> Result<(), ActivateError>;
    /// Stops processing after a guest reset; returns false if the device cannot be reset.
    fn reset(&mut self) -> bool;
    /// Called before `activate` when the device comes back from a snapshot: host-side
    /// state (connections, files) did not survive, so the device tells the guest.
    fn prepare_restore(&mut self) {}
    /// Device-specific snapshot state beyond the transport's (e.g. which file pmem mapped),
    /// checked by the device's own restore path in `slots::attach`.
    fn device_state(&self) -> Option<serde_json::Value> {
        None
    }
    /// Live queue positions while the device thread runs (for snapshots); None if inactive.
    /// Only meaningful while the device is paused.
    fn queue_states(&self) -> Option<Vec<virtio_queue::QueueState>> {
        None
    }
    /// Stops touching guest memory (the VM is being snapshotted).
    fn pause(&mut self) -> Result<(), String> {
        Ok(())
    }
    fn resume(&mut self) {}
}

/// Copies `src` into `data` at a guest-chosen `offset`, reading past the end as zeroes.
pub fn read_config_bytes(src: &[u8], offset: u64, data: &mut [u8]) {
    data.fill(0);
    let Ok(offset) = usize::try_from(offset) else {
        return;
    };
    if offset < src.len() {
        let n = data.len().min(src.len() - offset);
        data[..n].copy_from_slice(&src[offset..offset + n]);
    }
}
