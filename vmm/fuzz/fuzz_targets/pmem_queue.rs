//! virtio-pmem request parsing (flush, unknown types, short or status-less chains) against a
//! 2 MiB writable scratch file.
#![no_main]
use std::sync::{Arc, OnceLock};

use dsec_vmm::devices::virtio::pmem::{Backing, PmemQueue, ALIGN};
use dsec_vmm::devices::virtio::testing::hostile_queue;
use libfuzzer_sys::fuzz_target;

fn backing() -> Arc<Backing> {
    static B: OnceLock<Arc<Backing>> = OnceLock::new();
    B.get_or_init(|| {
        let path = std::env::temp_dir().join(format!("dsec-fuzz-pmem-{}", std::process::id()));
        std::fs::File::create(&path)
            .and_then(|f| f.set_len(ALIGN))
            .expect("scratch file");
        let b = Backing::open(&path, false, false, 1 << 32).expect("map scratch file");
        // The mapping keeps the file alive.
        let _ = std::fs::remove_file(&path);
        Arc::new(b)
    })
    .clone()
}

fuzz_target!(|data: &[u8]| {
    let (mem, mut q) = hostile_queue(data);
    PmemQueue::new(backing()).process(&mut q, &mem);
});
