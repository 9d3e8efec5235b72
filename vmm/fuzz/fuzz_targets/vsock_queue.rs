//! virtio-vsock: the muxer consumes hostile guest packets on its tx queue and answers on an
//! rx queue aliasing the same descriptors.
#![no_main]
use dsec_vmm::devices::virtio::vsock::hostile_round;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    hostile_round(data).expect("harness setup");
});
