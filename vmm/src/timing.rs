//! Boot milestones the perf harness reads from the metrics file.

use std::sync::atomic::AtomicU64;
use std::time::{SystemTime, UNIX_EPOCH};

/// Wall-clock timestamps (ns since the Unix epoch) of boot milestones.
#[derive(Default)]
pub struct BootTimes {
    pub first_kvm_run_ns: AtomicU64,
    pub first_serial_byte_ns: AtomicU64,
}

/// CLOCK_REALTIME in ns (the harness aligns it with its own spawn stamp).
pub fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}
