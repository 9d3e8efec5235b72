//! Boot milestones the perf harness reads from the metrics file.

use std::sync::atomic::AtomicU64;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

/// Wall-clock timestamps (ns since the Unix epoch) of boot milestones.
#[derive(Default)]
pub struct BootTimes {
    pub first_kvm_run_ns: AtomicU64,
    pub first_serial_byte_ns: AtomicU64,
    /// When each step of building the VM ended, in order.
    steps: Mutex<Vec<(&'static str, u64)>>,
}

impl BootTimes {
    /// Records that `step` just finished.
    pub fn mark(&self, step: &'static str) {
        crate::sync::lock(&self.steps).push((step, now_ns()));
    }

    /// Every recorded step with its end time, in order.
    pub fn steps(&self) -> Vec<(&'static str, u64)> {
        crate::sync::lock(&self.steps).clone()
    }
}

/// CLOCK_REALTIME in ns (the harness aligns it with its own spawn stamp).
pub fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}
