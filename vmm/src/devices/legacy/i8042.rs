//! Just enough of the i8042 keyboard controller for a guest to reset the machine:
//! writing 0xFE to the command port is how Linux `reboot=k` ends the VM.
//!
//! There is no keyboard. The status register reports a permanently full output buffer, which
//! Linux's i8042 driver reads as "no controller" after 16 reads; an idle controller instead makes
//! it time out on the config-byte read, which costs seconds of VM exits on a nested host.
//! The reset path only waits for the input buffer (bit 1) to be empty, which it always is.

use std::sync::mpsc::Sender;

use crate::devices::bus::BusDevice;
use crate::exit::VmExitReason;

const COMMAND_RESET: u8 = 0xfe;
const STATUS_PORT_OFFSET: u64 = 4;
/// Output buffer full; input buffer (bit 1) always empty.
const STATUS_OUTPUT_FULL: u8 = 0x01;

pub struct I8042 {
    exit: Sender<VmExitReason>,
}

impl I8042 {
    pub fn new(exit: Sender<VmExitReason>) -> Self {
        I8042 { exit }
    }
}

impl BusDevice for I8042 {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if offset == STATUS_PORT_OFFSET {
            data[0] = STATUS_OUTPUT_FULL;
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset == STATUS_PORT_OFFSET && data.first() == Some(&COMMAND_RESET) {
            // The receiver only disappears while the VM is already shutting down.
            let _ = self.exit.send(VmExitReason::Reset);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reset_ends_the_vm_and_status_never_blocks_the_reset_path() {
        let (tx, rx) = std::sync::mpsc::channel();
        let mut dev = I8042::new(tx);
        let mut status = [0u8];
        dev.read(4, &mut status);
        assert_eq!(status[0] & 0x02, 0, "input buffer must read empty");
        assert_eq!(
            status[0] & 0x01,
            1,
            "output buffer reads full: no controller"
        );
        dev.write(4, &[0xaa]);
        assert!(rx.try_recv().is_err());
        dev.write(4, &[0xfe]);
        assert_eq!(rx.try_recv().unwrap(), VmExitReason::Reset);
    }
}
