//! The transport's snapshot state: registers and queue positions.

use serde::{Deserialize, Serialize};
use virtio_queue::{Queue, QueueState, QueueT};
use vmm_sys_util::eventfd::EventFd;

use super::MmioTransport;
use crate::devices::virtio::VirtioDevice;
use crate::memory::GuestMemory;
use crate::persist::Persist;

/// Why a transport cannot come back from a snapshot: the snapshot does not describe this
/// VM's device (restore it with the configuration it was taken with) or is damaged.
#[derive(Debug, thiserror::Error)]
pub enum TransportRestoreError {
    #[error("snapshot holds virtio device type {saved} where this VM has {found}; restore with the snapshot's own device configuration")]
    DeviceType { saved: u32, found: u32 },
    #[error("snapshot queue count does not match the device; restore with the dsec-vmm and configuration that took it")]
    QueueCount,
    #[error("snapshot negotiated features this device does not offer (was it taken with other device options?)")]
    Features,
    #[error(
        "snapshot queue size does not match the device; restore with the dsec-vmm that took it"
    )]
    QueueSize,
    #[error("invalid queue in snapshot ({0}); the snapshot is damaged")]
    Queue(String),
    #[error("cannot create the transport's queue eventfds: {0}")]
    Setup(std::io::Error),
    #[error("device failed to restart from the snapshot; see the log for the device's error")]
    Restart,
}

/// A queue as saved in a snapshot (virtio-queue's `QueueState` has no serde support).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueSnapshot {
    pub max_size: u16,
    pub next_avail: u16,
    pub next_used: u16,
    pub event_idx_enabled: bool,
    pub size: u16,
    pub ready: bool,
    pub desc_table: u64,
    pub avail_ring: u64,
    pub used_ring: u64,
}

impl From<QueueState> for QueueSnapshot {
    fn from(q: QueueState) -> Self {
        QueueSnapshot {
            max_size: q.max_size,
            next_avail: q.next_avail,
            next_used: q.next_used,
            event_idx_enabled: q.event_idx_enabled,
            size: q.size,
            ready: q.ready,
            desc_table: q.desc_table,
            avail_ring: q.avail_ring,
            used_ring: q.used_ring,
        }
    }
}

impl From<QueueSnapshot> for QueueState {
    fn from(q: QueueSnapshot) -> Self {
        QueueState {
            max_size: q.max_size,
            next_avail: q.next_avail,
            next_used: q.next_used,
            event_idx_enabled: q.event_idx_enabled,
            size: q.size,
            ready: q.ready,
            desc_table: q.desc_table,
            avail_ring: q.avail_ring,
            used_ring: q.used_ring,
        }
    }
}

/// The transport's registers and queues. The device thread must be stopped (VM paused and
/// the device's queues drained) for `next_avail`/`next_used` to be current.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransportState {
    pub device_type: u32,
    pub queues: Vec<QueueSnapshot>,
    pub queue_select: u32,
    pub device_features_select: u32,
    pub driver_features_select: u32,
    pub driver_features: u64,
    pub status: u32,
    pub activated: bool,
    pub config_generation: u32,
    pub interrupt_status: u32,
}

impl Persist for MmioTransport {
    type State = TransportState;
    type Context = (Box<dyn VirtioDevice>, GuestMemory, EventFd);
    type Error = TransportRestoreError;

    fn save(&self) -> TransportState {
        // While active, the device thread owns the live queues: ask it for their state.
        let live = self.device.queue_states();
        let queues = self
            .queues
            .iter()
            .enumerate()
            .map(|(i, q)| match live.as_ref().and_then(|l| l.get(i)) {
                Some(state) => QueueSnapshot::from(*state),
                None => QueueSnapshot::from(q.state()),
            })
            .collect();
        TransportState {
            device_type: self.device.device_type(),
            queues,
            queue_select: self.queue_select,
            device_features_select: self.device_features_select,
            driver_features_select: self.driver_features_select,
            driver_features: self.driver_features,
            status: self.status,
            activated: self.activated,
            config_generation: self.config_generation,
            interrupt_status: self.interrupt.status(),
        }
    }

    fn restore(
        (mut device, mem, irqfd): Self::Context,
        s: &TransportState,
    ) -> Result<Self, TransportRestoreError> {
        use TransportRestoreError as E;
        if device.device_type() != s.device_type {
            return Err(E::DeviceType {
                saved: s.device_type,
                found: device.device_type(),
            });
        }
        if s.queues.len() != device.queue_max_sizes().len() {
            return Err(E::QueueCount);
        }
        if s.driver_features & !device.features() != 0 {
            return Err(E::Features);
        }
        device.ack_features(s.driver_features);
        let mut t = MmioTransport::new(device, mem, irqfd).map_err(E::Setup)?;
        for (q, saved) in t.queues.iter_mut().zip(&s.queues) {
            if saved.max_size != q.max_size() {
                return Err(E::QueueSize);
            }
            *q = Queue::try_from(QueueState::from(*saved))
                .map_err(|e| E::Queue(format!("{e:?}")))?;
        }
        t.queue_select = s.queue_select;
        t.device_features_select = s.device_features_select;
        t.driver_features_select = s.driver_features_select;
        t.driver_features = s.driver_features;
        t.status = s.status;
        t.config_generation = s.config_generation;
        if s.interrupt_status != 0 {
            t.interrupt.signal_used_queue();
        }
        if s.activated {
            t.device.prepare_restore();
            t.activate();
            if !t.activated {
                return Err(E::Restart);
            }
        }
        Ok(t)
    }
}
