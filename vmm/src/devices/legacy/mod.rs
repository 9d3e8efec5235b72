//! Legacy PC devices a Linux guest expects: 8250 UART, i8042 (for reset), CMOS.

mod cmos;
mod i8042;
mod persist;
mod serial;

pub use cmos::Cmos;
pub use i8042::I8042;
pub use persist::{SerialRestoreError, SerialState};
pub use serial::{Serial, SerialSink};
