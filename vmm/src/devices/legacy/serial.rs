//! 8250 UART on port 0x3f8 (vm-superio), output to a sink, stdout or a file,
//! interrupts through an irqfd.

use std::io::Write;

use serde::{Deserialize, Serialize};
use vm_superio::serial::NoEvents;
use vm_superio::Trigger;
use vmm_sys_util::eventfd::EventFd;

use crate::devices::bus::BusDevice;
use crate::snapshot::Persist;

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
    inner: vm_superio::Serial<IrqTrigger, NoEvents, SerialSink>,
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

/// UART registers as saved in a snapshot.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SerialState {
    pub baud_divisor_low: u8,
    pub baud_divisor_high: u8,
    pub interrupt_enable: u8,
    pub interrupt_identification: u8,
    pub line_control: u8,
    pub line_status: u8,
    pub modem_control: u8,
    pub modem_status: u8,
    pub scratch: u8,
    pub in_buffer: Vec<u8>,
}

impl Persist for Serial {
    type State = SerialState;
    type Context = (EventFd, SerialSink);
    type Error = String;

    fn save(&self) -> SerialState {
        let s = self.inner.state();
        SerialState {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer,
        }
    }

    fn restore((irq, out): Self::Context, s: &SerialState) -> Result<Self, String> {
        let state = vm_superio::serial::SerialState {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer.clone(),
        };
        let inner = vm_superio::Serial::from_state(&state, IrqTrigger(irq), NoEvents, out)
            .map_err(|e| format!("serial state: {e:?}"))?;
        Ok(Serial { inner })
    }
}
