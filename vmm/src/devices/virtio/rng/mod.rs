//! virtio-rng: fills the guest's buffers from the host's getrandom(2).

use std::sync::Arc;

use virtio_queue::{DescriptorChain, Queue, Writer};

use super::worker::{drain_queue, QueueHandler};
use super::{ActivateError, Interrupt, VirtioCommon, VirtioDevice, VIRTIO_F_VERSION_1};
use crate::memory::GuestMemory;

mod persist;
pub use persist::RngState;

pub const VIRTIO_ID_RNG: u32 = 4;
const QUEUE_SIZES: [u16; 1] = [64];
/// Bytes handed out per request at most: a guest asking for gigabytes gets this much and
/// asks again (the used length tells it how much it got).
pub const MAX_REQUEST: usize = 64 * 1024;

#[derive(Default)]
pub struct Rng {
    common: VirtioCommon,
}

impl Rng {
    pub fn new() -> Self {
        Rng::default()
    }
}

/// The queue side of the device, also driven directly by tests and the fuzz target.
#[derive(Default)]
pub struct RngQueue {
    buf: Vec<u8>,
}

impl RngQueue {
    /// Serves one request: returns the bytes written (0 for a chain we cannot use).
    pub fn handle(&mut self, mem: &GuestMemory, chain: DescriptorChain<&GuestMemory>) -> u32 {
        let mut w = match Writer::new(mem, chain) {
            Ok(w) => w,
            Err(e) => {
                tracing::debug!("virtio-rng: unusable buffer from the guest: {e}");
                return 0;
            }
        };
        let n = w.available_bytes().min(MAX_REQUEST);
        self.buf.resize(n, 0);
        if let Err(e) = getrandom(&mut self.buf[..n]) {
            tracing::warn!("virtio-rng: getrandom failed: {e}");
            return 0;
        }
        match std::io::Write::write_all(&mut w, &self.buf[..n]) {
            Ok(()) => n as u32,
            Err(_) => w.bytes_written() as u32,
        }
    }

    pub fn process(&mut self, queue: &mut Queue, mem: &GuestMemory) -> bool {
        drain_queue(queue, mem, |chain| self.handle(mem, chain))
    }
}

impl QueueHandler for RngQueue {
    fn queue_event(&mut self, index: usize, queues: &mut [Queue], mem: &GuestMemory) -> bool {
        match queues.get_mut(index) {
            Some(q) => self.process(q, mem),
            None => false,
        }
    }
}

/// Fills `buf` from getrandom(2), retrying on short reads and EINTR.
pub fn getrandom(buf: &mut [u8]) -> std::io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let rest = &mut buf[done..];
        // SAFETY: the pointer and length describe `rest`, a live, writable slice.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        done += n as usize;
    }
    Ok(())
}

impl VirtioDevice for Rng {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_RNG
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &QUEUE_SIZES
    }

    fn features(&self) -> u64 {
        VIRTIO_F_VERSION_1
    }

    fn read_config(&self, _offset: u64, data: &mut [u8]) {
        data.fill(0); // virtio-rng has no config space
    }

    crate::virtio_common_field!();

    fn thread_name(&self) -> &'static str {
        "virtio-rng"
    }

    fn queue_handler(
        &mut self,
        _interrupt: &Arc<Interrupt>,
    ) -> Result<Box<dyn QueueHandler>, ActivateError> {
        Ok(Box::new(RngQueue::default()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::virtio::testing::*;
    use vm_memory::{Bytes, GuestAddress};

    fn used_len(mem: &GuestMemory, i: u64) -> u32 {
        mem.read_obj(GuestAddress(0x2000 + 4 + 8 * i + 4)).unwrap()
    }

    #[test]
    fn fills_buffers_and_caps_the_request() {
        let descs = [
            desc(DATA, 4096, F_WRITE, 0),
            desc(DATA + 8192, 8 * MAX_REQUEST as u32, F_WRITE, 0),
        ];
        let (mem, mut q) = hostile_queue(&input(&descs, &[0, 1], &[]));
        assert!(RngQueue::default().process(&mut q, &mem));
        assert_eq!(used_len(&mem, 0), 4096);
        assert_eq!(used_len(&mem, 1), MAX_REQUEST as u32);
        let mut page = [0u8; 4096];
        mem.read_slice(&mut page, GuestAddress(DATA)).unwrap();
        assert!(page.iter().filter(|&&b| b == 0).count() < 64, "not random");
    }

    #[test]
    fn read_only_and_out_of_bounds_buffers_get_nothing() {
        let descs = [
            desc(DATA, 64, 0, 0),
            desc(MEM_SIZE as u64 - 8, 64, F_WRITE, 0),
            desc(u64::MAX - 4, 64, F_WRITE, 0),
        ];
        let (mem, mut q) = hostile_queue(&input(&descs, &[0, 1, 2], &[]));
        RngQueue::default().process(&mut q, &mem);
        for i in 0..3 {
            assert_eq!(used_len(&mem, i), 0, "request {i}");
        }
    }

    #[test]
    fn hostile_chains_never_panic() {
        let good = input(&[desc(DATA, 512, F_WRITE, 0)], &[0], &[]);
        for case in hostile_corpus(&[good]) {
            let (mem, mut q) = hostile_queue(&case);
            RngQueue::default().process(&mut q, &mem);
        }
    }
}
