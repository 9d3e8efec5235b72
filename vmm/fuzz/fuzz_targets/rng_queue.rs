//! virtio-rng queue handling with a guest-controlled descriptor table, avail ring and buffers.
#![no_main]
use dsec_vmm::devices::virtio::{rng::RngQueue, testing::hostile_queue};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (mem, mut q) = hostile_queue(data);
    RngQueue::default().process(&mut q, &mem);
});
