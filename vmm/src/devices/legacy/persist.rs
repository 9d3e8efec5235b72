//! Snapshot states of the legacy devices. Only the UART has any: the i8042 and the CMOS stub
//! hold nothing the guest could notice losing.

use serde::{Deserialize, Serialize};
use vm_superio::serial::NoEvents;
use vmm_sys_util::eventfd::EventFd;

use super::serial::{IrqTrigger, Serial, SerialSink};
use crate::persist::Persist;

#[derive(Debug, thiserror::Error)]
#[error("the snapshot's serial port state is invalid ({0}); the snapshot is damaged")]
pub struct SerialRestoreError(String);

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
    type Error = SerialRestoreError;

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

    fn restore((irq, out): Self::Context, s: &SerialState) -> Result<Self, SerialRestoreError> {
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
            .map_err(|e| SerialRestoreError(format!("{e:?}")))?;
        Ok(Serial { inner })
    }
}
