//! virtio-blk request parsing and execution against a 1 MiB scratch image.
#![no_main]
use std::sync::{Arc, OnceLock};

use dsec_vmm::devices::virtio::block::{BlockQueue, Disk};
use dsec_vmm::devices::virtio::testing::hostile_queue;
use libfuzzer_sys::fuzz_target;

fn disk() -> Arc<Disk> {
    static D: OnceLock<Arc<Disk>> = OnceLock::new();
    D.get_or_init(|| {
        let path = std::env::temp_dir().join(format!("dsec-fuzz-blk-{}", std::process::id()));
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .expect("scratch image");
        let _ = std::fs::remove_file(&path);
        f.set_len(1 << 20).expect("size scratch image");
        Arc::new(Disk::from_file(f, false).expect("disk"))
    })
    .clone()
}

fuzz_target!(|data: &[u8]| {
    let (mem, mut q) = hostile_queue(data);
    BlockQueue::new(disk()).process(&mut q, &mem);
});
