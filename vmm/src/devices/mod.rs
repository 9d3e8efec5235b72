//! Devices: the bus they sit on, legacy PC devices and virtio devices.

pub mod bus;
pub mod legacy;
pub mod virtio;

/// How a disk or file is opened, for messages.
pub fn access_mode(read_only: bool) -> &'static str {
    if read_only {
        "read-only"
    } else {
        "writable"
    }
}
