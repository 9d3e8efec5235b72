//! The typed aggregate of the virtio devices' snapshot states: one state type per device,
//! defined next to it (`<device>/persist.rs`) and listed once here.

use serde::{Deserialize, Serialize};

use super::balloon::BalloonState;
use super::block::BlockState;
use super::mmio::TransportState;
use super::net::NetState;
use super::pmem::PmemState;
use super::rng::RngState;
use super::vsock::VsockState;

/// A device state type that travels inside [`DeviceState`].
pub trait SavedState: Sized + Into<DeviceState> {
    /// This type's state if `state` holds one.
    fn from_device_state(state: &DeviceState) -> Option<&Self>;
}

macro_rules! device_states {
    ($($variant:ident($state:ty)),* $(,)?) => {
        /// One virtio device's own state (its transport's is beside it in [`SlotState`]).
        #[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
        #[serde(tag = "kind", content = "state", rename_all = "snake_case")]
        pub enum DeviceState {
            $($variant($state)),*
        }

        impl DeviceState {
            /// The device kind, for error messages.
            pub fn kind(&self) -> &'static str {
                match self {
                    $(DeviceState::$variant(_) => stringify!($variant)),*
                }
            }
        }

        $(impl From<$state> for DeviceState {
            fn from(state: $state) -> Self {
                DeviceState::$variant(state)
            }
        }

        impl SavedState for $state {
            fn from_device_state(state: &DeviceState) -> Option<&Self> {
                match state {
                    DeviceState::$variant(s) => Some(s),
                    #[allow(unreachable_patterns)]
                    _ => None,
                }
            }
        })*
    };
}

// Adding a device: its state type goes here, and nowhere else in the snapshot code.
device_states! {
    Vsock(VsockState),
    Rng(RngState),
    Block(BlockState),
    Net(NetState),
    Balloon(BalloonState),
    Pmem(PmemState),
}

/// One virtio-mmio slot in a snapshot: the transport's registers and queues, and the device.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SlotState {
    pub slot: u32,
    pub transport: TransportState,
    pub device: DeviceState,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::virtio::balloon::Counters;
    use crate::devices::virtio::mmio::QueueSnapshot;

    fn transport(device_type: u32) -> TransportState {
        TransportState {
            device_type,
            queues: vec![QueueSnapshot {
                max_size: 256,
                next_avail: 7,
                next_used: 5,
                size: 128,
                ready: true,
                desc_table: 0x1000,
                avail_ring: 0x2000,
                used_ring: 0x3000,
                ..Default::default()
            }],
            queue_select: 0,
            device_features_select: 1,
            driver_features_select: 1,
            driver_features: 1 << 32,
            status: 15,
            activated: true,
            config_generation: 3,
            interrupt_status: 1,
        }
    }

    /// Every device's typed state survives the snapshot encoding and comes back as the
    /// same variant; a state of one kind is never taken for another.
    #[test]
    fn every_device_state_round_trips_through_the_snapshot_encoding() {
        let devices = [
            DeviceState::Vsock(VsockState {
                guest_cid: 42,
                next_host_port: (1 << 30) + 7,
            }),
            DeviceState::Rng(RngState {}),
            DeviceState::Block(BlockState {
                size: 1 << 30,
                read_only: true,
            }),
            DeviceState::Net(NetState {
                mac: [6, 0, 10, 0, 0, 2],
            }),
            DeviceState::Balloon(BalloonState {
                num_pages: 1024,
                actual: 512,
                stats: vec![(4, 1 << 20)],
                stats_head: Some(3),
                counters: Counters::default(),
            }),
            DeviceState::Pmem(PmemState {
                path: "/img/root.ext4".into(),
                guest_addr: 1 << 32,
                size: 2 << 20,
                read_only: true,
                dev: 2049,
                ino: 77,
                mtime_ns: Some(1_700_000_000_000_000_000),
            }),
        ];
        let slots: Vec<SlotState> = devices
            .iter()
            .enumerate()
            .map(|(i, device)| SlotState {
                slot: i as u32,
                transport: transport(i as u32),
                device: device.clone(),
            })
            .collect();
        let bytes = crate::snapshot::encode(&slots).unwrap();
        let back: Vec<SlotState> =
            crate::snapshot::decode(std::path::Path::new("state"), &bytes).unwrap();
        assert_eq!(back, slots);
        assert!(RngState::from_device_state(&back[1].device).is_some());
        assert!(BlockState::from_device_state(&back[1].device).is_none());
        assert_eq!(
            PmemState::from_device_state(&back[5].device).map(|p| p.ino),
            Some(77)
        );
        assert_eq!(back[4].device.kind(), "Balloon");
    }
}
