//! virtio-balloon queue handling (inflate, deflate, statistics, free page reporting) with a
//! guest-controlled descriptor table, avail ring, page frame lists and ranges.
#![no_main]
use std::sync::Arc;

use dsec_vmm::devices::virtio::balloon::{
    BalloonControl, BalloonQueues, Role, F_REPORTING, F_STATS_VQ,
};
use dsec_vmm::devices::virtio::testing::hostile_queue;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let control = Arc::new(BalloonControl::new(1));
    let mut h = BalloonQueues::new(F_STATS_VQ | F_REPORTING, control.clone(), None);
    for role in [Role::Inflate, Role::Deflate, Role::Stats, Role::Reporting] {
        let (mem, mut q) = hostile_queue(data);
        h.process(role, &mut q, &mem);
        h.request_stats(&mut q, &mem);
    }
    let _ = control.status();
});
