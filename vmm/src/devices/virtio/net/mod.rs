//! virtio-net on a tap interface (`IFF_TAP | IFF_NO_PI | IFF_VNET_HDR`): frames pass between the
//! guest's queues and the tap with their 12-byte virtio-net header, which the tap understands,
//! so checksum and TSO offloads cost nothing here. The guest's receive offloads are switched
//! on in the tap (TUNSETOFFLOAD) only when the guest negotiated them.

use std::fs::{File, OpenOptions};
use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::sync::Arc;

use virtio_queue::{Queue, QueueT, Reader, Writer};

use super::worker::QueueHandler;
use super::{
    read_config_bytes, ActivateError, Interrupt, VirtioCommon, VirtioDevice, VIRTIO_F_VERSION_1,
};
use crate::memory::GuestMemory;

mod persist;
pub use persist::NetState;

pub const VIRTIO_ID_NET: u32 = 1;
const QUEUE_SIZES: [u16; 2] = [256, 256];
const RX: usize = 0;
const TX: usize = 1;

pub const F_CSUM: u64 = 1 << 0;
pub const F_GUEST_CSUM: u64 = 1 << 1;
pub const F_MAC: u64 = 1 << 5;
pub const F_GUEST_TSO4: u64 = 1 << 7;
pub const F_GUEST_TSO6: u64 = 1 << 8;
pub const F_HOST_TSO4: u64 = 1 << 11;
pub const F_HOST_TSO6: u64 = 1 << 12;
/// Mergeable receive buffers: a frame may span several small guest buffers, so the guest
/// can post many page-sized buffers instead of a few 64 KiB chains.
pub const F_MRG_RXBUF: u64 = 1 << 15;

/// virtio-net header with VIRTIO_F_VERSION_1 (num_buffers included).
pub const HDR_LEN: usize = 12;
/// Largest frame either way: a 64 KiB GSO frame plus Ethernet/VLAN header plus our header.
pub const MAX_FRAME: usize = 65535 + 14 + 4 + HDR_LEN;

const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const TUNSETOFFLOAD: libc::c_ulong = 0x4004_54d0;
const TUNSETVNETHDRSZ: libc::c_ulong = 0x4004_54d8;
const IFF_TAP: libc::c_short = 0x0002;
const IFF_NO_PI: libc::c_short = 0x1000;
const IFF_VNET_HDR: libc::c_short = 0x4000;
const TUN_F_CSUM: libc::c_uint = 0x01;
const TUN_F_TSO4: libc::c_uint = 0x02;
const TUN_F_TSO6: libc::c_uint = 0x04;
const GSO_NONE: u8 = 0;
const GSO_TCPV4: u8 = 1;
const GSO_TCPV6: u8 = 4;
const HDR_F_NEEDS_CSUM: u8 = 1;

/// Why the tap could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("cannot open /dev/net/tun: {0}; load the tun module and let the VMM use it")]
    OpenTun(std::io::Error),
    #[error("cannot attach tap `{name}`: {source}; create it first (ip tuntap add dev {name} mode tap) in the VMM's network namespace, or run with CAP_NET_ADMIN")]
    Attach {
        name: String,
        source: std::io::Error,
    },
    #[error("tap `{name}` is already attached to another process (a running VM, or the VM this snapshot came from); give this VM a tap of its own (dsec-vmm --net tap=NEW, dsec vm fork --tap-prefix)")]
    Busy { name: String },
    #[error("tap `{name}` rejected the 12-byte virtio-net header: {source}")]
    VnetHdr {
        name: String,
        source: std::io::Error,
    },
}

#[repr(C)]
struct IfReq {
    name: [u8; 16],
    flags: libc::c_short,
    _pad: [u8; 22],
}

fn ioctl_val(fd: RawFd, req: libc::c_ulong, val: libc::c_ulong) -> std::io::Result<()> {
    // SAFETY: the tun ioctls used with this helper take an integer argument, no memory.
    if unsafe { libc::ioctl(fd, req, val) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Opens (or creates) tap `name` in non-blocking mode with a 12-byte vnet header.
pub fn open_tap(name: &str) -> Result<File, NetError> {
    let tun = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open("/dev/net/tun")
        .map_err(NetError::OpenTun)?;
    let mut req = IfReq {
        name: [0; 16],
        flags: IFF_TAP | IFF_NO_PI | IFF_VNET_HDR,
        _pad: [0; 22],
    };
    let n = name.len().min(15);
    req.name[..n].copy_from_slice(&name.as_bytes()[..n]);
    // SAFETY: TUNSETIFF reads and writes a `struct ifreq`; `req` has its layout (16-byte name,
    // flags, padding to 40 bytes) and lives across the call.
    if unsafe { libc::ioctl(tun.as_raw_fd(), TUNSETIFF, &mut req as *mut IfReq) } < 0 {
        let source = std::io::Error::last_os_error();
        if source.raw_os_error() == Some(libc::EBUSY) {
            return Err(NetError::Busy { name: name.into() });
        }
        return Err(NetError::Attach {
            name: name.into(),
            source,
        });
    }
    let hdr_len: libc::c_int = HDR_LEN as libc::c_int;
    // SAFETY: TUNSETVNETHDRSZ reads one int through the pointer, which lives across the call.
    if unsafe {
        libc::ioctl(
            tun.as_raw_fd(),
            TUNSETVNETHDRSZ,
            &hdr_len as *const libc::c_int,
        )
    } < 0
    {
        return Err(NetError::VnetHdr {
            name: name.into(),
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(tun)
}

pub struct Net {
    tap: Arc<File>,
    mac: [u8; 6],
    common: VirtioCommon,
}

impl Net {
    pub fn open(tap: &str, mac: [u8; 6]) -> Result<Box<dyn VirtioDevice>, NetError> {
        Ok(Box::new(Net::new(open_tap(tap)?, mac)))
    }

    pub fn new(tap: File, mac: [u8; 6]) -> Net {
        Net {
            tap: Arc::new(tap),
            mac,
            common: VirtioCommon::default(),
        }
    }
}

/// Checks a guest frame's virtio-net header against what was negotiated.
pub fn tx_header_ok(hdr: &[u8], acked: u64) -> bool {
    let (flags, gso) = (hdr[0], hdr[1] & 0x7f);
    if flags & HDR_F_NEEDS_CSUM != 0 && acked & F_CSUM == 0 {
        return false;
    }
    match gso {
        GSO_NONE => true,
        GSO_TCPV4 => acked & F_HOST_TSO4 != 0,
        GSO_TCPV6 => acked & F_HOST_TSO6 != 0,
        _ => false,
    }
}

/// The queue side of the device: guest tx to the tap, tap to guest rx.
pub struct NetQueues {
    tap: Arc<File>,
    acked: u64,
    buf: Vec<u8>,
    /// A frame read from the tap that waits for a guest rx buffer.
    pending: Option<usize>,
    rx_frame: Vec<u8>,
    pub stats: NetStats,
}

#[derive(Default, Debug, Clone, Copy)]
pub struct NetStats {
    pub tx_frames: u64,
    pub tx_dropped: u64,
    pub rx_frames: u64,
    pub rx_dropped: u64,
}

impl NetQueues {
    pub fn new(tap: Arc<File>, acked: u64) -> Self {
        NetQueues {
            tap,
            acked,
            buf: vec![0; MAX_FRAME],
            pending: None,
            rx_frame: vec![0; MAX_FRAME],
            stats: NetStats::default(),
        }
    }

    /// Sends every frame the guest queued. Returns true if the used ring changed.
    pub fn process_tx(&mut self, queue: &mut Queue, mem: &GuestMemory) -> bool {
        let mut used = false;
        for _ in 0..queue.size().max(1) {
            let Some(chain) = queue.pop_descriptor_chain(mem) else {
                break;
            };
            let head = chain.head_index();
            let sent = Reader::new(mem, chain).ok().and_then(|mut r| {
                let len = r.available_bytes();
                if !(HDR_LEN + 14..=MAX_FRAME).contains(&len) {
                    return None;
                }
                r.read_exact(&mut self.buf[..len]).ok()?;
                if !tx_header_ok(&self.buf[..HDR_LEN], self.acked) {
                    tracing::debug!(len, hdr = ?&self.buf[..HDR_LEN], "virtio-net: tx header refused");
                    return None;
                }
                // A full tap queue drops the frame, like a real NIC; TCP recovers.
                (&*self.tap)
                    .write(&self.buf[..len])
                    .inspect_err(|e| {
                        tracing::debug!(len, hdr = ?&self.buf[..HDR_LEN], "virtio-net: tap write failed: {e}")
                    })
                    .ok()
            });
            match sent {
                Some(_) => self.stats.tx_frames += 1,
                None => self.stats.tx_dropped += 1,
            }
            if queue.add_used(mem, head, 0).is_err() {
                break;
            }
            used = true;
        }
        used
    }

    /// Moves frames from the tap into guest rx buffers until either runs out.
    pub fn process_rx(&mut self, queue: &mut Queue, mem: &GuestMemory) -> bool {
        let mut used = false;
        loop {
            let len = match self.pending.take() {
                Some(len) => len,
                None => match (&*self.tap).read(&mut self.rx_frame) {
                    Ok(n) if n > HDR_LEN => n,
                    Ok(_) => continue,
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    Err(e) => {
                        if e.kind() != ErrorKind::WouldBlock {
                            tracing::warn!("virtio-net: tap read failed: {e}");
                        }
                        break;
                    }
                },
            };
            if self.acked & F_MRG_RXBUF != 0 {
                match self.rx_merged(queue, mem, len) {
                    Some(delivered) => {
                        used = true;
                        if !delivered {
                            continue;
                        }
                    }
                    None => {
                        self.pending = Some(len);
                        break;
                    }
                }
                continue;
            }
            let Some(chain) = queue.pop_descriptor_chain(mem) else {
                self.pending = Some(len);
                break;
            };
            let head = chain.head_index();
            // Without MRG_RXBUF every frame goes into one chain; num_buffers is 1.
            self.rx_frame[10..12].copy_from_slice(&1u16.to_le_bytes());
            let written = match Writer::new(mem, chain) {
                Ok(mut w) if w.available_bytes() >= len => {
                    w.write_all(&self.rx_frame[..len]).ok().map(|_| len as u32)
                }
                Ok(w) => {
                    tracing::debug!(
                        len,
                        room = w.available_bytes(),
                        "virtio-net: rx frame larger than the guest buffer"
                    );
                    None
                }
                Err(e) => {
                    tracing::debug!(len, "virtio-net: bad rx chain: {e}");
                    None
                }
            };
            match written {
                Some(_) => self.stats.rx_frames += 1,
                None => self.stats.rx_dropped += 1,
            }
            if queue.add_used(mem, head, written.unwrap_or(0)).is_err() {
                break;
            }
            used = true;
        }
        used
    }
}

impl NetQueues {
    /// Delivers the `len`-byte frame in `rx_frame` across as many guest buffers as it takes
    /// (MRG_RXBUF), telling the guest how many in the header's num_buffers. None: the guest
    /// has not posted room for the whole frame yet, and nothing was taken from the queue.
    /// Some(false): the frame was dropped (a broken chain); its buffers are returned empty.
    fn rx_merged(&mut self, queue: &mut Queue, mem: &GuestMemory, len: usize) -> Option<bool> {
        let start = queue.next_avail();
        let mut parts = Vec::new();
        let mut room = 0usize;
        while room < len {
            let Some(chain) = queue.pop_descriptor_chain(mem) else {
                queue.set_next_avail(start);
                return None;
            };
            let head = chain.head_index();
            match Writer::new(mem, chain) {
                Ok(w) if w.available_bytes() > 0 => {
                    room += w.available_bytes();
                    parts.push((head, Some(w)));
                }
                Ok(_) => parts.push((head, None)),
                Err(e) => {
                    tracing::debug!(len, "virtio-net: bad rx chain: {e}");
                    parts.push((head, None));
                }
            }
        }
        let broken = parts.iter().any(|(_, w)| w.is_none());
        let buffers = u16::try_from(parts.len()).unwrap_or(u16::MAX);
        self.rx_frame[10..12].copy_from_slice(&buffers.to_le_bytes());
        let mut done = 0usize;
        for (head, w) in parts {
            let written = match w {
                Some(mut w) if !broken && done < len => {
                    let n = w.available_bytes().min(len - done);
                    match w.write_all(&self.rx_frame[done..done + n]) {
                        Ok(()) => {
                            done += n;
                            n
                        }
                        Err(_) => 0,
                    }
                }
                _ => 0,
            };
            if queue.add_used(mem, head, written as u32).is_err() {
                break;
            }
        }
        if !broken && done == len {
            self.stats.rx_frames += 1;
            Some(true)
        } else {
            self.stats.rx_dropped += 1;
            Some(false)
        }
    }
}

impl QueueHandler for NetQueues {
    fn queue_event(&mut self, index: usize, queues: &mut [Queue], mem: &GuestMemory) -> bool {
        match index {
            RX => queues.get_mut(RX).is_some_and(|q| self.process_rx(q, mem)),
            TX => {
                let mut used = queues.get_mut(TX).is_some_and(|q| self.process_tx(q, mem));
                // Sending may have made room for replies already waiting.
                used |= queues.get_mut(RX).is_some_and(|q| self.process_rx(q, mem));
                used
            }
            _ => false,
        }
    }

    fn host_fds(&self) -> Vec<RawFd> {
        vec![self.tap.as_raw_fd()]
    }

    fn fd_event(&mut self, _index: usize, queues: &mut [Queue], mem: &GuestMemory) -> bool {
        queues.get_mut(RX).is_some_and(|q| self.process_rx(q, mem))
    }
}

impl VirtioDevice for Net {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_NET
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &QUEUE_SIZES
    }

    fn features(&self) -> u64 {
        VIRTIO_F_VERSION_1
            | F_MAC
            | F_CSUM
            | F_GUEST_CSUM
            | F_GUEST_TSO4
            | F_GUEST_TSO6
            | F_HOST_TSO4
            | F_HOST_TSO6
            | F_MRG_RXBUF
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.mac, offset, data);
    }

    fn write_config(&mut self, _offset: u64, _data: &[u8]) {
        tracing::debug!("guest wrote virtio-net config; ignored");
    }

    crate::virtio_common_field!();

    fn thread_name(&self) -> &'static str {
        "virtio-net"
    }

    fn queue_handler(
        &mut self,
        _interrupt: &Arc<Interrupt>,
    ) -> Result<Box<dyn QueueHandler>, ActivateError> {
        // The tap may hand us only what the guest said it can take.
        let a = self.common.acked_features;
        let mut offload = 0;
        if a & F_GUEST_CSUM != 0 {
            offload |= TUN_F_CSUM;
            if a & F_GUEST_TSO4 != 0 {
                offload |= TUN_F_TSO4;
            }
            if a & F_GUEST_TSO6 != 0 {
                offload |= TUN_F_TSO6;
            }
        }
        ioctl_val(
            self.tap.as_raw_fd(),
            TUNSETOFFLOAD,
            libc::c_ulong::from(offload),
        )?;
        Ok(Box::new(NetQueues::new(self.tap.clone(), a)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::virtio::testing::*;

    /// A socketpair stands in for the tap (datagram semantics like a tap's frames).
    fn fake_tap() -> (Arc<File>, std::os::unix::net::UnixDatagram) {
        let (a, b) = std::os::unix::net::UnixDatagram::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        b.set_nonblocking(true).unwrap();
        let fd: std::os::fd::OwnedFd = a.into();
        (Arc::new(File::from(fd)), b)
    }

    #[test]
    fn tx_frames_reach_the_tap_and_bad_headers_are_dropped() {
        let (tap, peer) = fake_tap();
        let mut frame = vec![0u8; HDR_LEN + 60];
        frame[HDR_LEN..].fill(0xab);
        let mut gso = frame.clone();
        gso[1] = GSO_TCPV4;
        let data = [frame.clone(), gso].concat();
        let descs = [
            desc(DATA, frame.len() as u32, 0, 0),
            desc(DATA + frame.len() as u64, frame.len() as u32, 0, 0),
            desc(DATA, 4, 0, 0),
        ];
        let (mem, mut q) = hostile_queue(&input(&descs, &[0, 1, 2], &data));
        let mut n = NetQueues::new(tap, VIRTIO_F_VERSION_1);
        assert!(n.process_tx(&mut q, &mem));
        assert_eq!((n.stats.tx_frames, n.stats.tx_dropped), (1, 2));
        let mut got = vec![0u8; 200];
        assert_eq!(peer.recv(&mut got).unwrap(), frame.len());
        assert_eq!(&got[..frame.len()], &frame[..]);
    }

    #[test]
    fn rx_frames_fill_guest_buffers_and_wait_for_buffers() {
        let (tap, peer) = fake_tap();
        let (mem, mut q) = hostile_queue(&input(&[], &[], &[]));
        let mut n = NetQueues::new(tap.clone(), VIRTIO_F_VERSION_1);
        peer.send(&[7u8; 80]).unwrap();
        assert!(!n.process_rx(&mut q, &mem), "no buffers yet");
        let descs = [
            desc(DATA, 40, F_WRITE, 0),
            desc(DATA + 0x1000, 2048, F_WRITE, 0),
        ];
        let (mem, mut q) = hostile_queue(&input(&descs, &[0, 1], &[]));
        peer.send(&[8u8; 80]).unwrap();
        assert!(n.process_rx(&mut q, &mem));
        // The pending 80-byte frame did not fit the 40-byte buffer; the next one fit.
        assert_eq!((n.stats.rx_frames, n.stats.rx_dropped), (1, 1));
    }

    #[test]
    fn merged_rx_spreads_a_frame_over_buffers_or_waits_for_room() {
        let (tap, peer) = fake_tap();
        let frame: Vec<u8> = (0..3000u32).map(|i| (i % 251) as u8).collect();
        // Two 1 KiB buffers: not room for 3000 bytes, so nothing is taken.
        let two = [
            desc(DATA, 1024, F_WRITE, 0),
            desc(DATA + 0x1000, 1024, F_WRITE, 0),
        ];
        let (mem, mut q) = hostile_queue(&input(&two, &[0, 1], &[]));
        let mut n = NetQueues::new(tap.clone(), VIRTIO_F_VERSION_1 | F_MRG_RXBUF);
        peer.send(&frame).unwrap();
        assert!(!n.process_rx(&mut q, &mem));
        assert_eq!(q.next_avail(), 0, "buffers were given back");
        assert_eq!(n.pending, Some(frame.len()));
        // Four: the frame takes three of them, num_buffers says 3, the bytes are in order.
        let four = [
            desc(DATA, 1024, F_WRITE, 0),
            desc(DATA + 0x1000, 1024, F_WRITE, 0),
            desc(DATA + 0x2000, 1024, F_WRITE, 0),
            desc(DATA + 0x3000, 1024, F_WRITE, 0),
        ];
        let (mem, mut q) = hostile_queue(&input(&four, &[0, 1, 2, 3], &[]));
        assert!(n.process_rx(&mut q, &mem));
        assert_eq!((n.stats.rx_frames, n.stats.rx_dropped), (1, 0));
        assert_eq!(q.next_avail(), 3);
        let mut got = Vec::new();
        for (i, len) in [1024usize, 1024, 952].into_iter().enumerate() {
            let mut part = vec![0u8; len];
            vm_memory::Bytes::read_slice(
                &mem,
                &mut part,
                vm_memory::GuestAddress(DATA + 0x1000 * i as u64),
            )
            .unwrap();
            got.extend(part);
        }
        assert_eq!(&got[10..12], &3u16.to_le_bytes());
        assert_eq!(&got[..10], &frame[..10]);
        assert_eq!(&got[12..], &frame[12..]);
        // A read-only buffer among them: the frame is dropped, every buffer comes back.
        let bad = [
            desc(DATA, 1024, F_WRITE, 0),
            desc(DATA + 0x1000, 4096, 0, 0),
            desc(DATA + 0x3000, 4096, F_WRITE, 0),
        ];
        let (mem, mut q) = hostile_queue(&input(&bad, &[0, 1, 2], &[]));
        peer.send(&frame).unwrap();
        assert!(n.process_rx(&mut q, &mem));
        assert_eq!((n.stats.rx_frames, n.stats.rx_dropped), (1, 1));
        assert_eq!(q.next_avail(), 3);
    }

    #[test]
    fn hostile_chains_never_panic() {
        let (tap, peer) = fake_tap();
        let frame = vec![0u8; HDR_LEN + 64];
        let good = input(&[desc(DATA, frame.len() as u32, 0, 0)], &[0], &frame);
        for case in hostile_corpus(&[good]) {
            let (mem, mut q) = hostile_queue(&case);
            let mut n = NetQueues::new(tap.clone(), u64::MAX);
            n.process_tx(&mut q, &mem);
            let _ = peer.send(&[1u8; 100]);
            let (mem, mut q) = hostile_queue(&case);
            n.process_rx(&mut q, &mem);
            let mut sink = [0u8; 70000];
            while peer.recv(&mut sink).is_ok() {}
        }
    }
}
