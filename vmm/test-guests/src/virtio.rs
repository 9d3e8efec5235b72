//! A small polled virtio-mmio (version 2) driver core for CPL 3, shared by the rng, block and
//! net test guests: finds a device by id among the VMM's slots, negotiates features, sets up
//! split queues in static memory and submits descriptor chains. No interrupts: the used rings
//! are polled (the IOAPIC pin of the device is masked so the hypervisor never kicks us).

use core::mem::MaybeUninit;
use core::ptr::{addr_of, addr_of_mut, read_volatile, write_volatile};
use core::sync::atomic::{fence, Ordering};

/// Where the VMM puts virtio-mmio slot 0; slot `i` is `i * SLOT_SIZE` above.
pub const MMIO_BASE: u64 = 0xd000_0000;
pub const SLOT_SIZE: u64 = 0x1000;
pub const MAX_SLOTS: u64 = 16;
/// IRQ of slot 0 (slot `i` uses `IRQ_BASE + i`).
pub const IRQ_BASE: u32 = 5;

pub const QSIZE: usize = 64;
const MAX_QUEUES: usize = 8;

pub const DESC_NEXT: u16 = 1;
pub const DESC_WRITE: u16 = 2;

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

#[repr(C, align(4096))]
struct VirtQueue {
    desc: [Desc; QSIZE],
    avail_flags: u16,
    avail_idx: u16,
    avail_ring: [u16; QSIZE],
    used_event: u16,
    _pad: [u8; 4096 - 16 * QSIZE - 6 - 2 * QSIZE],
    used_flags: u16,
    used_idx: u16,
    used_ring: [UsedElem; QSIZE],
    avail_event: u16,
}

static mut QUEUES: MaybeUninit<[VirtQueue; MAX_QUEUES]> = MaybeUninit::zeroed();
static mut NEXT_QUEUE: usize = 0;

/// One device's register window.
#[derive(Clone, Copy)]
pub struct Device {
    pub base: u64,
    pub slot: u64,
}

impl Device {
    /// The `nth` (0-based) device with virtio id `id`, scanning the slots in order.
    pub fn find(id: u32, nth: usize) -> Option<Device> {
        let mut seen = 0;
        for slot in 0..MAX_SLOTS {
            let d = Device {
                base: MMIO_BASE + slot * SLOT_SIZE,
                slot,
            };
            if d.read(0) != 0x7472_6976 {
                continue;
            }
            if d.read(8) == id {
                if seen == nth {
                    return Some(d);
                }
                seen += 1;
            }
        }
        None
    }

    pub fn irq(&self) -> u32 {
        IRQ_BASE + self.slot as u32
    }

    pub fn read(&self, off: u64) -> u32 {
        // SAFETY: the virtio-mmio window is identity-mapped MMIO; an aligned 32-bit read of a
        // register the VMM emulates (unbacked slots read as 0).
        unsafe { read_volatile((self.base + off) as *const u32) }
    }

    pub fn write(&self, off: u64, v: u32) {
        // SAFETY: as for `read`, an aligned 32-bit register write.
        unsafe { write_volatile((self.base + off) as *mut u32, v) }
    }

    pub fn read_config8(&self, off: u64) -> u8 {
        // SAFETY: byte read of the device config space (MMIO, emulated by the VMM).
        unsafe { read_volatile((self.base + 0x100 + off) as *const u8) }
    }

    pub fn read_config32(&self, off: u64) -> u32 {
        self.read(0x100 + off)
    }

    pub fn read_config64(&self, off: u64) -> u64 {
        u64::from(self.read(0x100 + off)) | (u64::from(self.read(0x104 + off)) << 32)
    }

    /// Offered features.
    pub fn features(&self) -> u64 {
        self.write(0x014, 0);
        let lo = self.read(0x010);
        self.write(0x014, 1);
        let hi = self.read(0x010);
        u64::from(lo) | (u64::from(hi) << 32)
    }

    /// Reset, ACKNOWLEDGE, DRIVER, accept `wanted & offered` (VERSION_1 always), FEATURES_OK.
    /// Returns the accepted features, or the status if FEATURES_OK did not stick.
    pub fn begin(&self, wanted: u64) -> Result<u64, u32> {
        self.write(0x070, 0);
        self.write(0x070, 1);
        self.write(0x070, 1 | 2);
        let accepted = (wanted | (1 << 32)) & self.features();
        self.write(0x024, 0);
        self.write(0x020, accepted as u32);
        self.write(0x024, 1);
        self.write(0x020, (accepted >> 32) as u32);
        self.write(0x070, 1 | 2 | 8);
        let status = self.read(0x070);
        if status & 8 == 0 {
            return Err(status);
        }
        Ok(accepted)
    }

    /// Sets up queue `index` with up to [`QSIZE`] entries; None if the device has no such
    /// queue or we ran out of static queue memory.
    pub fn queue(&self, index: u32) -> Option<Queue> {
        self.write(0x030, index);
        let max = self.read(0x034) as usize;
        if max == 0 {
            return None;
        }
        let mut size = QSIZE;
        while size > max {
            size /= 2;
        }
        // SAFETY: single-threaded guest; NEXT_QUEUE is only touched here.
        let n = unsafe {
            let n = NEXT_QUEUE;
            if n >= MAX_QUEUES {
                return None;
            }
            NEXT_QUEUE = n + 1;
            n
        };
        // SAFETY: n < MAX_QUEUES, inside the static array; each queue is handed out once.
        let vq = unsafe { (addr_of_mut!(QUEUES) as *mut VirtQueue).add(n) };
        let desc = vq as u64;
        // SAFETY: only field addresses inside the static queue are computed.
        let (avail, used) = unsafe {
            (
                addr_of!((*vq).avail_flags) as u64,
                addr_of!((*vq).used_flags) as u64,
            )
        };
        self.write(0x038, size as u32);
        self.write(0x080, desc as u32);
        self.write(0x084, (desc >> 32) as u32);
        self.write(0x090, avail as u32);
        self.write(0x094, (avail >> 32) as u32);
        self.write(0x0a0, used as u32);
        self.write(0x0a4, (used >> 32) as u32);
        self.write(0x044, 1);
        Some(Queue {
            dev: *self,
            vq,
            index,
            size: size as u16,
            next_avail: 0,
            last_used: 0,
            next_desc: 0,
        })
    }

    /// DRIVER_OK: the device starts.
    pub fn driver_ok(&self) {
        self.write(0x070, 1 | 2 | 8 | 4);
    }

    pub fn status(&self) -> u32 {
        self.read(0x070)
    }
}

/// A split virtqueue driven by polling.
pub struct Queue {
    dev: Device,
    vq: *mut VirtQueue,
    pub index: u32,
    pub size: u16,
    next_avail: u16,
    last_used: u16,
    next_desc: u16,
}

impl Queue {
    /// Writes a chain of `(addr, len, device_writable)` buffers into descriptors (allocated
    /// round-robin: callers keep at most `size` descriptors in flight) and publishes it.
    /// Returns the head index.
    pub fn submit(&mut self, bufs: &[(u64, u32, bool)]) -> u16 {
        let head = self.next_desc;
        for (i, &(addr, len, writable)) in bufs.iter().enumerate() {
            let idx = self.next_desc;
            self.next_desc = (self.next_desc + 1) % self.size;
            let mut flags = if writable { DESC_WRITE } else { 0 };
            if i + 1 < bufs.len() {
                flags |= DESC_NEXT;
            }
            self.set_desc(idx, addr, len, flags, self.next_desc);
        }
        self.publish(head);
        head
    }

    /// Writes one raw descriptor (for hostile chains).
    pub fn set_desc(&mut self, idx: u16, addr: u64, len: u32, flags: u16, next: u16) {
        // SAFETY: idx is taken modulo the size, inside the static table; the device does not
        // read it before the head is published.
        unsafe {
            write_volatile(
                addr_of_mut!((*self.vq).desc[usize::from(idx % self.size)]),
                Desc {
                    addr,
                    len,
                    flags,
                    next,
                },
            );
        }
    }

    /// Publishes `head` in the avail ring (no notify).
    pub fn publish(&mut self, head: u16) {
        let slot = usize::from(self.next_avail % self.size);
        // SAFETY: slot < size <= QSIZE; the idx store is ordered after the ring entry.
        unsafe {
            write_volatile(addr_of_mut!((*self.vq).avail_ring[slot]), head);
            fence(Ordering::Release);
            self.next_avail = self.next_avail.wrapping_add(1);
            write_volatile(addr_of_mut!((*self.vq).avail_idx), self.next_avail);
        }
    }

    /// Kicks the device (one MMIO write).
    pub fn notify(&self) {
        self.dev.write(0x050, self.index);
    }

    /// The next used element `(head, len)`, if any.
    pub fn pop(&mut self) -> Option<(u32, u32)> {
        // SAFETY: reads of the device-written used ring of our static queue; the element is
        // read only after idx shows it is complete.
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

    /// Polls for the next used element for at most `cycles` TSC cycles.
    pub fn wait(&mut self, cycles: u64) -> Option<(u32, u32)> {
        let t0 = crate::rdtsc();
        loop {
            if let Some(e) = self.pop() {
                return Some(e);
            }
            if crate::rdtsc() - t0 > cycles {
                return None;
            }
            core::hint::spin_loop();
        }
    }

    /// Submits, notifies and waits for the chain to come back: `(head, used len)`.
    pub fn call(&mut self, bufs: &[(u64, u32, bool)], cycles: u64) -> Option<(u32, u32)> {
        self.submit(bufs);
        self.notify();
        self.wait(cycles)
    }
}

/// A static buffer's guest-physical address (identity mapped).
pub fn addr_of_buf<T>(p: *const T) -> u64 {
    p as u64
}
