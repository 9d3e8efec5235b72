//! Devices: the bus they sit on, legacy PC devices and virtio devices.

pub mod bus;
pub mod legacy;
pub mod virtio;
