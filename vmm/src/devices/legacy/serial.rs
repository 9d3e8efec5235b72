//! 8250 UART on port 0x3f8 (vm-superio), output to a sink, stdout or a file,
//! interrupts through an irqfd.

use std::io::Write;

use vm_superio::serial::NoEvents;
use vm_superio::Trigger;
use vmm_sys_util::eventfd::EventFd;

use crate::devices::bus::BusDevice;

/// Raises the serial IRQ by writing to an irqfd.
pub struct IrqTrigger(pub EventFd);

impl Trigger for IrqTrigger {
    type E = std::io::Error;
    fn trigger(&self) -> std::io::Result<()> {
        self.0.write(1)
    }
}

/// Where console bytes go.
pub type SerialSink = Box<dyn Write + Send>;

pub struct Serial {
    pub(super) inner: vm_superio::Serial<IrqTrigger, NoEvents, SerialSink>,
}

impl Serial {
    pub fn new(irq: EventFd, out: SerialSink) -> Self {
        Serial {
            inner: vm_superio::Serial::new(IrqTrigger(irq), out),
        }
    }
}

impl BusDevice for Serial {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if let (Ok(offset), Some(first)) = (u8::try_from(offset), data.first_mut()) {
            *first = self.inner.read(offset);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if let (Ok(offset), Some(&value)) = (u8::try_from(offset), data.first()) {
            if let Err(e) = self.inner.write(offset, value) {
                tracing::warn!("serial output failed: {e:?}");
            }
        }
    }
}
