//! A polled virtio-mmio (version 2) vsock driver for CPL 3.
//!
//! Design for the PVM host, where each VM exit costs ~40 µs: no interrupts (IF stays 0), the
//! used rings are polled, and queue notifications (MMIO writes, one exit each) are batched —
//! at most one tx notify per [`Vsock::poll`] pass and one rx notify per 16 recycled buffers
//! (or when the device has gone idle). Every stream connection gets a receive ring of
//! [`RING`] bytes; its size is the `buf_alloc` we advertise, so the peer's credit is exactly
//! the free space we have, and a CREDIT_UPDATE goes out whenever a quarter of it has been
//! consumed. Our own sends never exceed the peer's advertised credit.
//!
//! Descriptor layout: by default every packet is a two-descriptor chain (44-byte header, then
//! data), like Linux ≤ 5.x; `set_single_desc(true)` before `init` uses one descriptor for
//! header + data (like Linux 6.x rx). Header and data are contiguous in memory either way.

use core::mem::MaybeUninit;
use core::ptr::{addr_of, addr_of_mut, read_volatile, write_volatile};
use core::sync::atomic::{fence, Ordering};

pub const MMIO_BASE: u64 = 0xd000_0000;
pub const HOST_CID: u64 = 2;

const QSIZE: usize = 256;
pub const RX_DATA: usize = 64 * 1024;
pub const TX_DATA: usize = 64 * 1024;
const NRX: usize = 128;
const NTX: usize = 64;
const NEVT: usize = 8;
pub const NCONN: usize = 24;
pub const RING: usize = 512 * 1024;
const HDR: usize = 44;

pub const OP_REQUEST: u16 = 1;
pub const OP_RESPONSE: u16 = 2;
pub const OP_RST: u16 = 3;
pub const OP_SHUTDOWN: u16 = 4;
pub const OP_RW: u16 = 5;
pub const OP_CREDIT_UPDATE: u16 = 6;
pub const OP_CREDIT_REQUEST: u16 = 7;
const TYPE_STREAM: u16 = 1;

const DESC_NEXT: u16 = 1;
const DESC_WRITE: u16 = 2;

/// virtio-vsock packet header (little-endian, packed, 44 bytes).
#[repr(C, packed)]
#[derive(Clone, Copy, Default, Debug)]
pub struct Hdr {
    pub src_cid: u64,
    pub dst_cid: u64,
    pub src_port: u32,
    pub dst_port: u32,
    pub len: u32,
    pub type_: u16,
    pub op: u16,
    pub flags: u32,
    pub buf_alloc: u32,
    pub fwd_cnt: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct Desc {
    addr: u64,
    len: u32,
    flags: u16,
    next: u16,
}

#[repr(C)]
struct UsedElem {
    id: u32,
    len: u32,
}

/// One split virtqueue: descriptor table, driver (avail) and device (used) rings.
#[repr(C, align(4096))]
struct VirtQueue {
    desc: [Desc; QSIZE],
    avail_flags: u16,
    avail_idx: u16,
    avail_ring: [u16; QSIZE],
    used_event: u16,
    _pad: [u8; 4096 - 6 - 2 * QSIZE],
    used_flags: u16,
    used_idx: u16,
    used_ring: [UsedElem; QSIZE],
    avail_event: u16,
}

#[repr(C)]
struct Buf<const N: usize> {
    hdr: Hdr,
    data: [u8; N],
}

static mut QUEUES: MaybeUninit<[VirtQueue; 3]> = MaybeUninit::zeroed();
static mut RXBUFS: MaybeUninit<[Buf<RX_DATA>; NRX]> = MaybeUninit::zeroed();
static mut TXBUFS: MaybeUninit<[Buf<TX_DATA>; NTX]> = MaybeUninit::zeroed();
static mut EVTBUFS: [[u8; 8]; NEVT] = [[0; 8]; NEVT];
static mut RINGS: MaybeUninit<[[u8; RING]; NCONN]> = MaybeUninit::zeroed();

fn mmio_read(off: u64) -> u32 {
    // SAFETY: the virtio-mmio window at 0xd0000000 is identity-mapped; the access is an
    // aligned 32-bit register read that the VMM emulates.
    unsafe { read_volatile((MMIO_BASE + off) as *const u32) }
}

fn mmio_write(off: u64, v: u32) {
    // SAFETY: as for `mmio_read`, an aligned 32-bit register write.
    unsafe { write_volatile((MMIO_BASE + off) as *mut u32, v) }
}

struct Queue {
    vq: *mut VirtQueue,
    index: u32,
    size: u16,
    next_avail: u16,
    last_used: u16,
    unnotified: u16,
}

impl Queue {
    fn set_desc(&mut self, i: usize, addr: u64, len: u32, flags: u16, next: u16) {
        // SAFETY: `vq` points to this queue's static VirtQueue and `i` < QSIZE; the device
        // does not read a descriptor before its head is published in the avail ring.
        unsafe {
            write_volatile(
                addr_of_mut!((*self.vq).desc[i]),
                Desc {
                    addr,
                    len,
                    flags,
                    next,
                },
            );
        }
    }

    fn push(&mut self, head: u16) {
        let slot = usize::from(self.next_avail % self.size);
        // SAFETY: `slot` < size <= QSIZE; the ring entry is published by the idx store below,
        // which is ordered after it (x86 stores are not reordered with other stores; the
        // fence keeps the compiler from doing so).
        unsafe {
            write_volatile(addr_of_mut!((*self.vq).avail_ring[slot]), head);
            fence(Ordering::Release);
            self.next_avail = self.next_avail.wrapping_add(1);
            write_volatile(addr_of_mut!((*self.vq).avail_idx), self.next_avail);
        }
        self.unnotified += 1;
    }

    fn pop(&mut self) -> Option<(u32, u32)> {
        // SAFETY: reads of the device-written used ring of our static VirtQueue; the element
        // is read only after idx shows it is complete (acquire fence in between).
        unsafe {
            let idx = read_volatile(addr_of!((*self.vq).used_idx));
            if idx == self.last_used {
                return None;
            }
            fence(Ordering::Acquire);
            let slot = usize::from(self.last_used % self.size);
            let e = read_volatile(addr_of!((*self.vq).used_ring[slot]));
            self.last_used = self.last_used.wrapping_add(1);
            Some((e.id, e.len))
        }
    }

    fn notify(&mut self) {
        mmio_write(0x50, self.index);
        self.unnotified = 0;
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum State {
    Free,
    Connecting,
    Established,
    /// We sent SHUTDOWN and wait for the peer's RST.
    Closing,
    /// The peer reset the connection (or refused it).
    Reset,
}

#[derive(Clone, Copy)]
pub struct Conn {
    pub state: State,
    pub local_port: u32,
    pub peer_port: u32,
    pub is_new: bool,
    /// SHUTDOWN flags received from the peer (1 = it will receive no more, 2 = send no more).
    pub peer_shutdown: u32,
    pub fwd_cnt: u32,
    last_fwd_sent: u32,
    pub rx_cnt: u32,
    pub tx_cnt: u32,
    peer_buf_alloc: u32,
    peer_fwd_cnt: u32,
    head: usize,
    len: usize,
    stall: u32,
    /// Free for the application (e.g. which service the connection belongs to).
    pub tag: u32,
}

impl Conn {
    const FREE: Conn = Conn {
        state: State::Free,
        local_port: 0,
        peer_port: 0,
        is_new: false,
        peer_shutdown: 0,
        fwd_cnt: 0,
        last_fwd_sent: 0,
        rx_cnt: 0,
        tx_cnt: 0,
        peer_buf_alloc: 0,
        peer_fwd_cnt: 0,
        head: 0,
        len: 0,
        stall: 0,
        tag: 0,
    };

    /// Bytes the peer can still take.
    pub fn credit(&self) -> u32 {
        self.peer_buf_alloc
            .saturating_sub(self.tx_cnt.wrapping_sub(self.peer_fwd_cnt))
    }

    /// Bytes received and not yet consumed.
    pub fn available(&self) -> usize {
        self.len
    }
}

/// Counters for the report.
#[derive(Clone, Copy, Default, Debug)]
pub struct Stats {
    pub rx_packets: u64,
    pub tx_packets: u64,
    pub notifies: u64,
    pub credit_updates_sent: u64,
    pub credit_requests_sent: u64,
    pub credit_violations: u64,
    pub bad_packets: u64,
    pub events: u64,
    pub rsts_for_unknown: u64,
}

pub struct Vsock {
    pub cid: u64,
    single_desc: bool,
    rxq: Queue,
    txq: Queue,
    evq: Queue,
    nrx: usize,
    free_tx: [u16; NTX],
    nfree_tx: usize,
    pub conns: [Conn; NCONN],
    listen: [u32; 4],
    next_port: u32,
    pub stats: Stats,
}

/// Why device initialisation failed.
#[derive(Debug)]
pub enum InitError {
    Magic(u32),
    Version(u32),
    DeviceId(u32),
    NoVersion1(u64),
    FeaturesRejected(u32),
    QueueMissing(u32),
}

impl core::fmt::Display for InitError {
    fn fmt(&self, f: &mut core::fmt::Formatter) -> core::fmt::Result {
        match self {
            InitError::Magic(v) => write!(f, "magic {:#x}, want 0x74726976", v),
            InitError::Version(v) => write!(f, "version {}, want 2", v),
            InitError::DeviceId(v) => write!(f, "device id {}, want 19", v),
            InitError::NoVersion1(v) => write!(f, "features {:#x} lack VIRTIO_F_VERSION_1", v),
            InitError::FeaturesRejected(s) => {
                write!(f, "FEATURES_OK not accepted (status {:#x})", s)
            }
            InitError::QueueMissing(q) => write!(f, "queue {} has QueueNumMax 0", q),
        }
    }
}

impl Vsock {
    /// Probes and initialises the device. Must be called at most once.
    pub fn init(single_desc: bool) -> Result<Vsock, InitError> {
        let magic = mmio_read(0x000);
        if magic != 0x7472_6976 {
            return Err(InitError::Magic(magic));
        }
        let version = mmio_read(0x004);
        if version != 2 {
            return Err(InitError::Version(version));
        }
        let id = mmio_read(0x008);
        if id != 19 {
            return Err(InitError::DeviceId(id));
        }
        mmio_write(0x070, 0); // reset
        mmio_write(0x070, 1); // ACKNOWLEDGE
        mmio_write(0x070, 1 | 2); // DRIVER
        mmio_write(0x014, 0);
        let lo = mmio_read(0x010);
        mmio_write(0x014, 1);
        let hi = mmio_read(0x010);
        let features = u64::from(lo) | (u64::from(hi) << 32);
        if features & (1 << 32) == 0 {
            return Err(InitError::NoVersion1(features));
        }
        // Only VIRTIO_F_VERSION_1: no event index, no seqpacket.
        mmio_write(0x024, 0);
        mmio_write(0x020, 0);
        mmio_write(0x024, 1);
        mmio_write(0x020, 1);
        mmio_write(0x070, 1 | 2 | 8); // FEATURES_OK
        let status = mmio_read(0x070);
        if status & 8 == 0 {
            return Err(InitError::FeaturesRejected(status));
        }
        // `init` runs once, so the driver owns the queue memory from here on.
        let queues = addr_of_mut!(QUEUES) as *mut VirtQueue;
        let mut qs = [(0u32, 0u16); 3];
        for (q, out) in qs.iter_mut().enumerate() {
            mmio_write(0x030, q as u32);
            let max = mmio_read(0x034);
            if max == 0 {
                return Err(InitError::QueueMissing(q as u32));
            }
            let mut size = QSIZE as u32;
            while size > max {
                size /= 2;
            }
            // SAFETY: q < 3, inside the QUEUES array.
            let vq = unsafe { queues.add(q) };
            let desc = vq as u64;
            // SAFETY: only field addresses inside the static queue are computed.
            let (avail, used) = unsafe {
                (
                    addr_of!((*vq).avail_flags) as u64,
                    addr_of!((*vq).used_flags) as u64,
                )
            };
            mmio_write(0x038, size);
            mmio_write(0x080, desc as u32);
            mmio_write(0x084, (desc >> 32) as u32);
            mmio_write(0x090, avail as u32);
            mmio_write(0x094, (avail >> 32) as u32);
            mmio_write(0x0a0, used as u32);
            mmio_write(0x0a4, (used >> 32) as u32);
            mmio_write(0x044, 1);
            *out = (q as u32, size as u16);
        }
        let cid = u64::from(mmio_read(0x100)) | (u64::from(mmio_read(0x104)) << 32);
        let mk = |(index, size): (u32, u16)| Queue {
            // SAFETY: index < 3.
            vq: unsafe { queues.add(index as usize) },
            index,
            size,
            next_avail: 0,
            last_used: 0,
            unnotified: 0,
        };
        let mut v = Vsock {
            cid,
            single_desc,
            rxq: mk(qs[0]),
            txq: mk(qs[1]),
            evq: mk(qs[2]),
            nrx: NRX.min(usize::from(qs[0].1) / 2),
            free_tx: [0; NTX],
            nfree_tx: 0,
            conns: [Conn::FREE; NCONN],
            listen: [0; 4],
            next_port: 40000,
            stats: Stats::default(),
        };
        let ntx = NTX.min(usize::from(qs[1].1) / 2);
        for i in 0..ntx {
            v.free_tx[i] = i as u16;
        }
        v.nfree_tx = ntx;
        for i in 0..v.nrx {
            v.post_rx(i);
        }
        for i in 0..NEVT.min(usize::from(qs[2].1)) {
            // SAFETY: address computation of a static buffer only.
            let a = unsafe { addr_of!(EVTBUFS[i]) } as u64;
            v.evq.set_desc(i, a, 8, DESC_WRITE, 0);
            v.evq.push(i as u16);
        }
        mmio_write(0x070, 1 | 2 | 8 | 4); // DRIVER_OK
        v.rxq.notify();
        v.evq.notify();
        v.stats.notifies += 2;
        Ok(v)
    }

    fn rxbuf(i: usize) -> *mut Buf<RX_DATA> {
        // SAFETY: address computation inside the static array (i < NRX).
        unsafe { (addr_of_mut!(RXBUFS) as *mut Buf<RX_DATA>).add(i) }
    }

    fn txbuf(i: usize) -> *mut Buf<TX_DATA> {
        // SAFETY: address computation inside the static array (i < NTX).
        unsafe { (addr_of_mut!(TXBUFS) as *mut Buf<TX_DATA>).add(i) }
    }

    fn ring(c: usize) -> *mut u8 {
        // SAFETY: address computation inside the static array (c < NCONN).
        unsafe { (addr_of_mut!(RINGS) as *mut [u8; RING]).add(c) as *mut u8 }
    }

    fn post_rx(&mut self, i: usize) {
        let b = Self::rxbuf(i) as u64;
        let d = 2 * i;
        if self.single_desc {
            self.rxq
                .set_desc(d, b, (HDR + RX_DATA) as u32, DESC_WRITE, 0);
        } else {
            self.rxq
                .set_desc(d, b, HDR as u32, DESC_WRITE | DESC_NEXT, (d + 1) as u16);
            self.rxq
                .set_desc(d + 1, b + HDR as u64, RX_DATA as u32, DESC_WRITE, 0);
        }
        self.rxq.push(d as u16);
    }

    /// Accept host-initiated connections to `port`.
    pub fn listen(&mut self, port: u32) {
        if let Some(s) = self.listen.iter_mut().find(|p| **p == 0) {
            *s = port;
        }
    }

    fn reclaim_tx(&mut self) {
        while let Some((id, _)) = self.txq.pop() {
            self.free_tx[self.nfree_tx] = (id / 2) as u16;
            self.nfree_tx += 1;
        }
    }

    fn flush(&mut self, rx_idle: bool) {
        if self.txq.unnotified > 0 {
            self.txq.notify();
            self.stats.notifies += 1;
        }
        if self.rxq.unnotified >= 16 || (rx_idle && self.rxq.unnotified > 0) {
            self.rxq.notify();
            self.stats.notifies += 1;
        }
        if self.evq.unnotified > 0 {
            self.evq.notify();
            self.stats.notifies += 1;
        }
    }

    fn alloc_tx(&mut self) -> usize {
        loop {
            self.reclaim_tx();
            if self.nfree_tx > 0 {
                self.nfree_tx -= 1;
                return usize::from(self.free_tx[self.nfree_tx]);
            }
            // Everything is in flight: make sure the device knows, then wait for it.
            self.flush(true);
            core::hint::spin_loop();
        }
    }

    fn header(&self, c: &Conn, op: u16, len: u32, flags: u32) -> Hdr {
        Hdr {
            src_cid: self.cid,
            dst_cid: HOST_CID,
            src_port: c.local_port,
            dst_port: c.peer_port,
            len,
            type_: TYPE_STREAM,
            op,
            flags,
            buf_alloc: RING as u32,
            fwd_cnt: c.fwd_cnt,
        }
    }

    /// Queues one packet (header + `data`); the device sees it at the next flush.
    fn send_packet(&mut self, hdr: Hdr, data: &[u8]) {
        let s = self.alloc_tx();
        let b = Self::txbuf(s);
        // SAFETY: tx slot `s` is ours until the device returns it; `data` fits TX_DATA
        // (callers chunk) and never aliases the tx buffers.
        unsafe {
            write_volatile(addr_of_mut!((*b).hdr), hdr);
            core::ptr::copy_nonoverlapping(
                data.as_ptr(),
                addr_of_mut!((*b).data) as *mut u8,
                data.len(),
            );
        }
        let a = b as u64;
        let d = 2 * s;
        if self.single_desc || data.is_empty() {
            self.txq.set_desc(d, a, (HDR + data.len()) as u32, 0, 0);
        } else {
            self.txq
                .set_desc(d, a, HDR as u32, DESC_NEXT, (d + 1) as u16);
            self.txq
                .set_desc(d + 1, a + HDR as u64, data.len() as u32, 0, 0);
        }
        self.txq.push(d as u16);
        self.stats.tx_packets += 1;
    }

    fn send_ctrl(&mut self, id: usize, op: u16, flags: u32) {
        let c = self.conns[id];
        let h = self.header(&c, op, 0, flags);
        self.send_packet(h, &[]);
        self.conns[id].last_fwd_sent = c.fwd_cnt;
    }

    fn rst_unknown(&mut self, h: &Hdr) {
        let r = Hdr {
            src_cid: self.cid,
            dst_cid: h.src_cid,
            src_port: h.dst_port,
            dst_port: h.src_port,
            len: 0,
            type_: TYPE_STREAM,
            op: OP_RST,
            flags: 0,
            buf_alloc: 0,
            fwd_cnt: 0,
        };
        self.send_packet(r, &[]);
        self.stats.rsts_for_unknown += 1;
    }

    fn find(&self, local: u32, peer: u32) -> Option<usize> {
        self.conns
            .iter()
            .position(|c| c.state != State::Free && c.local_port == local && c.peer_port == peer)
    }

    /// Processes everything the device returned and sends batched notifications.
    /// Returns true if anything happened.
    pub fn poll(&mut self) -> bool {
        self.reclaim_tx();
        let mut n = 0;
        while let Some((id, len)) = self.rxq.pop() {
            n += 1;
            let i = (id / 2) as usize;
            if i < self.nrx {
                self.handle_rx(i, len);
                self.post_rx(i);
            } else {
                self.stats.bad_packets += 1;
            }
        }
        while let Some((id, _)) = self.evq.pop() {
            self.stats.events += 1;
            self.evq.push(id as u16);
        }
        self.send_owed_credit();
        self.flush(n == 0);
        n > 0
    }

    fn handle_rx(&mut self, i: usize, used_len: u32) {
        self.stats.rx_packets += 1;
        let b = Self::rxbuf(i);
        // SAFETY: the device has returned buffer `i`; we own it until it is re-posted.
        let h: Hdr = unsafe { read_volatile(addr_of!((*b).hdr)) };
        let len = h.len as usize;
        if (used_len as usize) < HDR
            || len > RX_DATA
            || HDR + len > used_len as usize
            || h.dst_cid != self.cid
            || h.type_ != TYPE_STREAM
        {
            self.stats.bad_packets += 1;
            return;
        }
        let Some(id) = self.find(h.dst_port, h.src_port) else {
            if h.op == OP_REQUEST && self.listen.contains(&{ h.dst_port }) {
                self.accept(&h);
            } else if h.op != OP_RST {
                self.rst_unknown(&h);
            }
            return;
        };
        {
            let c = &mut self.conns[id];
            c.peer_buf_alloc = h.buf_alloc;
            c.peer_fwd_cnt = h.fwd_cnt;
        }
        match h.op {
            OP_RESPONSE if self.conns[id].state == State::Connecting => {
                self.conns[id].state = State::Established;
            }
            OP_RW => {
                let c = &mut self.conns[id];
                if len > RING - c.len {
                    // The peer ignored our credit: drop it but remember.
                    self.stats.credit_violations += 1;
                    return;
                }
                let ring = Self::ring(id);
                let tail = (c.head + c.len) % RING;
                let first = len.min(RING - tail);
                // SAFETY: copies `len` bytes from rx buffer `i` (which we own) into free space
                // of connection `id`'s ring, wrapping at RING.
                unsafe {
                    let src = addr_of!((*b).data) as *const u8;
                    core::ptr::copy_nonoverlapping(src, ring.add(tail), first);
                    core::ptr::copy_nonoverlapping(src.add(first), ring, len - first);
                }
                c.len += len;
                c.rx_cnt = c.rx_cnt.wrapping_add(len as u32);
            }
            OP_RST => self.conns[id].state = State::Reset,
            OP_SHUTDOWN => {
                self.conns[id].peer_shutdown |= h.flags & 3;
                if self.conns[id].state == State::Closing {
                    // Both sides are done: finish with RST.
                    self.send_ctrl(id, OP_RST, 0);
                    self.conns[id] = Conn::FREE;
                }
            }
            OP_CREDIT_REQUEST => self.send_ctrl(id, OP_CREDIT_UPDATE, 0),
            OP_CREDIT_UPDATE => {}
            OP_REQUEST => self.stats.bad_packets += 1,
            _ => {}
        }
    }

    fn accept(&mut self, h: &Hdr) {
        let Some(id) = self.conns.iter().position(|c| c.state == State::Free) else {
            self.rst_unknown(h);
            return;
        };
        self.conns[id] = Conn {
            state: State::Established,
            local_port: h.dst_port,
            peer_port: h.src_port,
            is_new: true,
            peer_buf_alloc: h.buf_alloc,
            peer_fwd_cnt: h.fwd_cnt,
            ..Conn::FREE
        };
        self.send_ctrl(id, OP_RESPONSE, 0);
    }

    /// Starts a guest-initiated connection to host port `port`.
    pub fn connect(&mut self, port: u32) -> Option<usize> {
        let id = self.conns.iter().position(|c| c.state == State::Free)?;
        self.next_port += 1;
        self.conns[id] = Conn {
            state: State::Connecting,
            local_port: self.next_port,
            peer_port: port,
            ..Conn::FREE
        };
        self.send_ctrl(id, OP_REQUEST, 0);
        Some(id)
    }

    /// The contiguous part of the received, unconsumed data.
    pub fn peek(&self, id: usize) -> &[u8] {
        let c = &self.conns[id];
        let n = c.len.min(RING - c.head);
        // SAFETY: bytes [head, head + n) of ring `id` hold received data; they are only
        // overwritten after `consume` frees them, which needs `&mut self`.
        unsafe { core::slice::from_raw_parts(Self::ring(id).add(c.head), n) }
    }

    /// Marks `n` received bytes as consumed (returns credit to the peer).
    pub fn consume(&mut self, id: usize, n: usize) {
        let c = &mut self.conns[id];
        let n = n.min(c.len);
        c.head = (c.head + n) % RING;
        c.len -= n;
        c.fwd_cnt = c.fwd_cnt.wrapping_add(n as u32);
    }

    fn send_owed_credit(&mut self) {
        for id in 0..NCONN {
            let c = self.conns[id];
            if c.state == State::Established
                && c.fwd_cnt.wrapping_sub(c.last_fwd_sent) >= (RING / 4) as u32
            {
                self.send_ctrl(id, OP_CREDIT_UPDATE, 0);
                self.stats.credit_updates_sent += 1;
            }
        }
    }

    /// Sends as much of `data` as the peer's credit allows; returns the bytes queued.
    pub fn send(&mut self, id: usize, data: &[u8]) -> usize {
        let mut sent = 0;
        while sent < data.len() && self.conns[id].state == State::Established {
            let credit = self.conns[id].credit() as usize;
            if credit == 0 {
                self.stall(id);
                break;
            }
            let n = (data.len() - sent).min(credit).min(TX_DATA);
            let c = self.conns[id];
            let h = self.header(&c, OP_RW, n as u32, 0);
            self.send_packet(h, &data[sent..sent + n]);
            let c = &mut self.conns[id];
            c.tx_cnt = c.tx_cnt.wrapping_add(n as u32);
            c.last_fwd_sent = c.fwd_cnt;
            c.stall = 0;
            sent += n;
        }
        sent
    }

    /// Sends ring data of connection `id` back to its peer (echo); returns bytes moved.
    pub fn echo(&mut self, id: usize) -> usize {
        let mut moved = 0;
        loop {
            let c = self.conns[id];
            let n = c
                .len
                .min(RING - c.head)
                .min(c.credit() as usize)
                .min(TX_DATA);
            if n == 0 {
                if c.len > 0 && c.credit() == 0 {
                    self.stall(id);
                }
                return moved;
            }
            // SAFETY: [head, head + n) of ring `id` holds received data (see `peek`);
            // `send` copies it into a tx buffer before `consume` frees it.
            let data = unsafe { core::slice::from_raw_parts(Self::ring(id).add(c.head), n) };
            let sent = self.send(id, data);
            self.consume(id, sent);
            moved += sent;
            if sent < n {
                return moved;
            }
        }
    }

    /// Called while waiting for credit: after a long wait, asks the peer for an update.
    pub fn stall(&mut self, id: usize) {
        self.conns[id].stall += 1;
        if self.conns[id].stall >= 100_000 {
            self.conns[id].stall = 0;
            self.send_ctrl(id, OP_CREDIT_REQUEST, 0);
            self.stats.credit_requests_sent += 1;
        }
    }

    /// Closes connection `id`: RST if the peer already shut down, otherwise SHUTDOWN and
    /// wait (in `poll`) for the peer to finish.
    pub fn close(&mut self, id: usize) {
        match self.conns[id].state {
            State::Established if self.conns[id].peer_shutdown != 3 => {
                self.send_ctrl(id, OP_SHUTDOWN, 3);
                self.conns[id].state = State::Closing;
            }
            State::Established => {
                self.send_ctrl(id, OP_RST, 0);
                self.conns[id] = Conn::FREE;
            }
            State::Reset | State::Connecting => self.conns[id] = Conn::FREE,
            _ => {}
        }
    }

    /// Resets connection `id` (sends RST) and frees its slot.
    pub fn abort(&mut self, id: usize) {
        if self.conns[id].state != State::Free {
            self.send_ctrl(id, OP_RST, 0);
            self.conns[id] = Conn::FREE;
        }
    }

    /// Frees a connection slot without telling the peer (after a RST, or to give up).
    pub fn forget(&mut self, id: usize) {
        self.conns[id] = Conn::FREE;
    }
}
