//! Just enough of the i8042 keyboard controller for a guest to reset the machine:
//! writing 0xFE to the command port is how Linux `reboot=k` ends the VM.

use std::sync::mpsc::Sender;

use crate::devices::bus::BusDevice;
use crate::vm::VmExitReason;

const COMMAND_RESET: u8 = 0xfe;
const STATUS_PORT_OFFSET: u64 = 4;

pub struct I8042 {
    exit: Sender<VmExitReason>,
}

impl I8042 {
    pub fn new(exit: Sender<VmExitReason>) -> Self {
        I8042 { exit }
    }
}

impl BusDevice for I8042 {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        // No keys pending, input buffer empty: Linux stops probing quickly.
        data.fill(0);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset == STATUS_PORT_OFFSET && data.first() == Some(&COMMAND_RESET) {
            // The receiver only disappears while the VM is already shutting down.
            let _ = self.exit.send(VmExitReason::Reset);
        }
    }
}
