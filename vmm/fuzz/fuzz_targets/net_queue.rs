//! virtio-net tx and rx queue handling; a socketpair stands in for the tap.
#![no_main]
use std::fs::File;
use std::os::unix::net::UnixDatagram;
use std::sync::Arc;

use dsec_vmm::devices::virtio::net::NetQueues;
use dsec_vmm::devices::virtio::testing::hostile_queue;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (a, b) = UnixDatagram::pair().expect("socketpair");
    a.set_nonblocking(true).expect("nonblocking");
    b.set_nonblocking(true).expect("nonblocking");
    let fd: std::os::fd::OwnedFd = a.into();
    let tap = Arc::new(File::from(fd));
    // Feature bits 0-15 from the input (offloads, MRG_RXBUF = 15), VERSION_1 always.
    let low = u64::from(u16::from_le_bytes([
        data.first().copied().unwrap_or(0),
        data.get(1).copied().unwrap_or(0),
    ]));
    let acked = low | (1 << 32);
    let mut n = NetQueues::new(tap, acked);
    let (mem, mut q) = hostile_queue(data);
    n.process_tx(&mut q, &mem);
    let _ = b.send(data.get(..100).unwrap_or(data));
    let (mem, mut q) = hostile_queue(data);
    n.process_rx(&mut q, &mem);
});
