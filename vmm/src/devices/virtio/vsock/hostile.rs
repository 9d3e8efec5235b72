//! The vsock muxer against hostile guest input: the harness shared by the fuzz target and
//! the unit test that replays the hostile descriptor corpus.

use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::Arc;

use virtio_queue::{Queue, QueueT};
use vmm_sys_util::eventfd::EventFd;

use super::muxer::{Muxer, MuxerLimits};
use crate::devices::virtio::pause::PauseHandshake;
use crate::devices::virtio::Interrupt;

/// The hostile-guest harness of the fuzz target and unit test: a muxer whose tx queue (and,
/// aliasing it, rx queue) come from arbitrary bytes ([`crate::devices::virtio::testing`]);
/// the guest's packets are consumed and whatever the muxer answers (RSTs, responses) is
/// written back. Connection requests go to a socket path that does not exist.
#[doc(hidden)]
pub fn hostile_round(input: &[u8]) -> std::io::Result<()> {
    use std::os::linux::net::SocketAddrExt;

    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let (mem, tx) = crate::devices::virtio::testing::hostile_queue(input);
    // rx shares the descriptors and avail ring (a guest may alias them) but has its own used
    // ring, so both directions run over the same hostile chains.
    let mut rx = Queue::new(crate::devices::virtio::testing::QUEUE_SIZE)
        .map_err(|e| std::io::Error::other(format!("{e:?}")))?;
    rx.set_size(crate::devices::virtio::testing::QUEUE_SIZE);
    rx.set_desc_table_address(Some(0), Some(0));
    rx.set_avail_ring_address(Some(0x1000), Some(0));
    rx.set_used_ring_address(Some(0x2800), Some(0));
    rx.set_ready(true);
    let event = Queue::new(4).map_err(|e| std::io::Error::other(format!("{e:?}")))?;
    let name = format!(
        "dsec-vsock-fuzz-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    );
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
    let listener = UnixListener::bind_addr(&addr)?;
    let evt = || EventFd::new(libc::EFD_NONBLOCK);
    let mut muxer = Muxer::new(
        3,
        PathBuf::from("/nonexistent/dsec-vsock-fuzz"),
        listener,
        mem,
        [rx, tx, event],
        evt()?,
        evt()?,
        evt()?,
        evt()?,
        Arc::new(PauseHandshake::new("vsock")?),
        Arc::new(Interrupt::new(evt()?)),
        MuxerLimits::default(),
    )?;
    muxer.process_tx();
    muxer.process_rx();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::virtio::testing::{desc, hostile_corpus, input, DATA, F_NEXT, F_WRITE};
    use crate::devices::virtio::vsock::packet::*;
    use vm_memory::ByteValued;

    /// Well-formed guest packets (a request, data on no connection, a response, a reset)
    /// as seeds; the corpus mangles every byte of the tables and the lengths around them.
    #[test]
    fn hostile_chains_never_panic() {
        let header = |op: u16, len: u32| {
            let h = Header {
                src_cid: 3,
                dst_cid: HOST_CID,
                src_port: 1000,
                dst_port: 1024,
                len,
                type_: TYPE_STREAM,
                op,
                flags: 0,
                buf_alloc: 65536,
                fwd_cnt: 0,
            };
            h.as_slice().to_vec()
        };
        let goods: Vec<Vec<u8>> = [OP_REQUEST, OP_RW, OP_RESPONSE, OP_RST, OP_SHUTDOWN]
            .iter()
            .map(|&op| {
                let descs = [
                    desc(DATA, HEADER_SIZE as u32, F_NEXT, 1),
                    desc(DATA + 0x100, 64, 0, 0),
                    desc(DATA + 0x200, 4096, F_WRITE, 0),
                ];
                let mut data = header(op, 64);
                data.resize(0x200, 0x5a);
                input(&descs, &[0, 2], &data)
            })
            .collect();
        for case in hostile_corpus(&goods) {
            hostile_round(&case).expect("harness setup");
        }
    }
}
