//! Virtio devices and their MMIO transport.

pub mod balloon;
pub mod block;
pub mod mmio;
pub mod net;
pub mod pause;
pub mod persist;
pub mod pmem;
pub mod rng;
pub mod slots;
pub mod testing;
pub mod vsock;
pub mod worker;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use crate::memory::GuestMemory;
use pause::PauseError;
use virtio_queue::{Queue, QueueState};
use vmm_sys_util::eventfd::EventFd;
use worker::{QueueHandler, Worker};

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

/// What every virtio device shares (Cloud Hypervisor's `VirtioCommon`): the features the
/// guest accepted and, while the device is active, the thread serving its queues.
#[derive(Default)]
pub struct VirtioCommon {
    pub acked_features: u64,
    pub worker: Option<Worker>,
}

/// The [`VirtioDevice::common`] pair for a device that keeps its [`VirtioCommon`] in a
/// field named `common`.
#[macro_export]
#[doc(hidden)]
macro_rules! virtio_common_field {
    () => {
        fn common(&self) -> &$crate::devices::virtio::VirtioCommon {
            &self.common
        }

        fn common_mut(&mut self) -> &mut $crate::devices::virtio::VirtioCommon {
            &mut self.common
        }
    };
}

/// Lets the device manager (`slots`) reach a device's concrete type to save its state.
pub trait AsAny {
    fn as_any(&self) -> &dyn std::any::Any;
}

impl<T: std::any::Any> AsAny for T {
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// What the MMIO transport needs from a device. A device writes its identity, its config
/// space and its queue handler; activation, reset and the snapshot hooks come from
/// [`VirtioCommon`] (a device with its own thread, like vsock, overrides them).
pub trait VirtioDevice: AsAny + Send {
    /// Virtio device id (19 = vsock).
    fn device_type(&self) -> u32;
    /// Maximum size of each queue; the length is the number of queues.
    fn queue_max_sizes(&self) -> &[u16];
    /// Features offered to the guest.
    fn features(&self) -> u64;
    /// Device config space, guest-chosen offset and width.
    fn read_config(&self, offset: u64, data: &mut [u8]);
    fn write_config(&mut self, _offset: u64, _data: &[u8]) {
        tracing::debug!(
            device = self.device_type(),
            "guest wrote read-only config space; ignored"
        );
    }
    fn common(&self) -> &VirtioCommon;
    fn common_mut(&mut self) -> &mut VirtioCommon;
    /// Name of the device's thread.
    fn thread_name(&self) -> &'static str;
    /// What runs on the device thread once the guest set DRIVER_OK.
    fn queue_handler(
        &mut self,
        _interrupt: &Arc<Interrupt>,
    ) -> Result<Box<dyn QueueHandler>, ActivateError> {
        Err(ActivateError::BadQueues)
    }
    /// Features the guest accepted (a subset of `features`).
    fn ack_features(&mut self, features: u64) {
        self.common_mut().acked_features = features;
    }
    /// Starts processing: the guest set DRIVER_OK.
    fn activate(
        &mut self,
        mem: GuestMemory,
        queues: Vec<Queue>,
        queue_events: Vec<EventFd>,
        interrupt: Arc<Interrupt>,
    ) -> Result<(), ActivateError> {
        let count = self.queue_max_sizes().len();
        if queues.len() != count || queue_events.len() != count {
            return Err(ActivateError::BadQueues);
        }
        let handler = self.queue_handler(&interrupt)?;
        let worker = Worker::spawn(
            self.thread_name(),
            handler,
            mem,
            queues,
            queue_events,
            interrupt,
        )?;
        self.common_mut().worker = Some(worker);
        Ok(())
    }
    /// Stops processing after a guest reset; returns false if the device cannot be reset.
    fn reset(&mut self) -> bool {
        self.common_mut().worker = None;
        true
    }
    /// Called before `activate` when the device comes back from a snapshot: host-side
    /// state (connections, files) did not survive, so the device tells the guest.
    fn prepare_restore(&mut self) {}
    /// Live queue positions while the device thread runs (for snapshots); None if inactive.
    /// Only meaningful while the device is paused.
    fn queue_states(&self) -> Option<Vec<QueueState>> {
        self.common().worker.as_ref().map(Worker::queue_states)
    }
    /// Asks the device to stop touching guest memory (the VM is being snapshotted) without
    /// waiting, so that every device parks at once; [`VirtioDevice::wait_paused`] waits.
    fn request_pause(&mut self) -> Result<(), PauseError> {
        self.common()
            .worker
            .as_ref()
            .map_or(Ok(()), Worker::request_pause)
    }
    /// Waits until a device asked to pause has stopped touching guest memory.
    fn wait_paused(&mut self) -> Result<(), PauseError> {
        self.common()
            .worker
            .as_ref()
            .map_or(Ok(()), Worker::wait_paused)
    }
    fn resume(&mut self) {
        if let Some(worker) = &self.common().worker {
            worker.resume();
        }
    }
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
