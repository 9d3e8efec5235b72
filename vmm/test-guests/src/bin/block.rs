//! Drives two virtio-blk disks (see `dsec_test_guests::virtio`). The host (vmm/tests) makes
//! disk 0 writable with pattern seed 1 over its first 4 MiB, disk 1 read-only with pattern
//! seed 2; `cap0=`/`cap1=` give their sizes in sectors. The guest checks: order and capacity,
//! RO feature, pattern reads, write + read back (pattern seed 3 at sector 2048, which the host
//! verifies after exit), refused writes on the read-only disk, out-of-range and unaligned
//! requests, unknown request type, flush, GET_ID, discard and write-zeroes (read back as
//! zeroes), then `seq_mib=` MiB of sequential 64 KiB reads for a throughput figure.
#![no_std]
#![no_main]

use dsec_test_guests::virtio::{Device, Queue};
use dsec_test_guests::{
    boot_info_or_finish, check, fail, finish, param_num, pass, pattern_byte, pattern_word, println,
    rdtsc,
};

const WAIT: u64 = 20_000_000_000;
const CHUNK: usize = 64 * 1024;

#[repr(C, align(4096))]
struct Bufs {
    hdr: [u8; 16],
    status: [u8; 16],
    seg: [u8; 16],
    _pad: [u8; 4096 - 48],
    data: [u8; CHUNK],
}

static mut B: Bufs = Bufs {
    hdr: [0; 16],
    status: [0; 16],
    seg: [0; 16],
    _pad: [0; 4096 - 48],
    data: [0; CHUNK],
};

fn b() -> *mut Bufs {
    core::ptr::addr_of_mut!(B)
}

fn bufs() -> &'static mut Bufs {
    // SAFETY: single-threaded guest; the device only writes these buffers while a request is
    // in flight, and callers only look at them after the request completed.
    unsafe { &mut *b() }
}

fn data() -> &'static mut [u8; CHUNK] {
    &mut bufs().data
}

fn addr<T>(p: *const T) -> u64 {
    p as u64
}

/// One request: (status, used len). `data`: (len, device writes it).
fn req(q: &mut Queue, kind: u32, sector: u64, data: Option<(u32, bool)>, seg: bool) -> (u8, u32) {
    let bs = bufs();
    bs.hdr[0..4].copy_from_slice(&kind.to_le_bytes());
    bs.hdr[4..8].fill(0);
    bs.hdr[8..16].copy_from_slice(&sector.to_le_bytes());
    bs.status[0] = 0xee;
    // SAFETY (addresses only): fields of the static.
    let (h, s, sg, d) = unsafe {
        (
            addr(core::ptr::addr_of!((*b()).hdr)),
            addr(core::ptr::addr_of!((*b()).status)),
            addr(core::ptr::addr_of!((*b()).seg)),
            addr(core::ptr::addr_of!((*b()).data)),
        )
    };
    let r = match (data, seg) {
        (_, true) => q.call(&[(h, 16, false), (sg, 16, false), (s, 1, true)], WAIT),
        (Some((len, w)), _) => q.call(&[(h, 16, false), (d, len, w), (s, 1, true)], WAIT),
        (None, _) => q.call(&[(h, 16, false), (s, 1, true)], WAIT),
    };
    // SAFETY: the request completed (or timed out: then the value is 0xee).
    let status = unsafe { core::ptr::read_volatile(core::ptr::addr_of!((*b()).status[0])) };
    (status, r.map_or(u32::MAX, |e| e.1))
}

fn set_seg(sector: u64, count: u32, flags: u32) {
    let bs = bufs();
    bs.seg[0..8].copy_from_slice(&sector.to_le_bytes());
    bs.seg[8..12].copy_from_slice(&count.to_le_bytes());
    bs.seg[12..16].copy_from_slice(&flags.to_le_bytes());
}

fn open(nth: usize) -> Option<(Device, Queue, u64)> {
    let dev = Device::find(2, nth)?;
    dsec_test_guests::ioapic_mask(dev.irq());
    let features = dev
        .begin((1 << 5) | (1 << 9) | (1 << 13) | (1 << 14))
        .ok()?;
    let q = dev.queue(0)?;
    dev.driver_ok();
    Some((dev, q, features))
}

#[no_mangle]
pub extern "C" fn main(info_addr: u64, kind: u64) -> ! {
    let bi = boot_info_or_finish(info_addr, kind);
    let cmdline = bi.cmdline();
    let (Some((d0, mut q0, f0)), Some((d1, mut q1, f1))) = (open(0), open(1)) else {
        fail("blk-probe", format_args!("two virtio-blk devices expected"));
        finish()
    };
    pass("blk-probe");
    let cap0 = d0.read_config64(0);
    let cap1 = d1.read_config64(0);
    check!(
        Some(cap0) == param_num(cmdline, "cap0") && Some(cap1) == param_num(cmdline, "cap1"),
        "blk-order-and-capacity",
        "capacities {} {}",
        cap0,
        cap1
    );
    check!(
        f0 & (1 << 5) == 0 && f1 & (1 << 5) != 0 && f0 & (1 << 13) != 0,
        "blk-features",
        "features {:#x} {:#x}",
        f0,
        f1
    );

    // Pattern reads from both disks.
    let r = req(&mut q0, 0, 8, Some((4096, true)), false);
    let ok = (0..4096).all(|i| data()[i] == pattern_byte(1, 8 * 512 + i as u64));
    check!(
        r == (0, 4097) && ok,
        "blk-read",
        "result {:?}, pattern ok {}",
        r,
        ok
    );
    let r = req(&mut q1, 0, 1, Some((512, true)), false);
    let ok = (0..512).all(|i| data()[i] == pattern_byte(2, 512 + i as u64));
    check!(
        r == (0, 513) && ok,
        "blk-read-disk1",
        "result {:?}, pattern ok {}",
        r,
        ok
    );

    // Write, read back.
    for i in 0..CHUNK / 8 {
        data()[i * 8..i * 8 + 8].copy_from_slice(&pattern_word(3, i as u64).to_le_bytes());
    }
    let r = req(&mut q0, 1, 2048, Some((CHUNK as u32, false)), false);
    check!(r == (0, 1), "blk-write", "result {:?}", r);
    data().fill(0);
    let r = req(&mut q0, 0, 2048, Some((CHUNK as u32, true)), false);
    let ok =
        (0..CHUNK / 8).all(|i| data()[i * 8..i * 8 + 8] == pattern_word(3, i as u64).to_le_bytes());
    check!(
        r.0 == 0 && ok,
        "blk-write-readback",
        "result {:?}, pattern ok {}",
        r,
        ok
    );

    // Refusals.
    let r = req(&mut q1, 1, 0, Some((512, false)), false);
    check!(r.0 == 1, "blk-readonly-write-refused", "result {:?}", r);
    let r = req(&mut q0, 0, cap0 - 1, Some((1024, true)), false);
    check!(r.0 == 1, "blk-read-past-end", "result {:?}", r);
    let r = req(&mut q0, 0, u64::MAX, Some((512, true)), false);
    check!(r.0 == 1, "blk-wrapping-sector", "result {:?}", r);
    let r = req(&mut q0, 0, 0, Some((100, true)), false);
    check!(r.0 == 1, "blk-unaligned-length", "result {:?}", r);
    let r = req(&mut q0, 99, 0, None, false);
    check!(r.0 == 2, "blk-unknown-type", "result {:?}", r);
    let r = req(&mut q0, 4, 0, None, false);
    check!(r.0 == 0, "blk-flush", "result {:?}", r);
    let r = req(&mut q0, 8, 0, Some((20, true)), false);
    let id = &data()[..9];
    check!(
        r == (0, 21) && id == b"disk0.img",
        "blk-get-id",
        "result {:?}",
        r
    );

    // Discard 1 MiB at sector 4096 (pattern there), write-zeroes 8 sectors at 0.
    set_seg(4096, 2048, 0);
    let r = req(&mut q0, 11, 0, None, true);
    check!(r.0 == 0, "blk-discard", "result {:?}", r);
    set_seg(0, 8, 0);
    let r = req(&mut q0, 13, 0, None, true);
    check!(r.0 == 0, "blk-write-zeroes", "result {:?}", r);
    let mut zero = true;
    for (sector, len) in [(4096u64, CHUNK), (4096 + 1920, CHUNK), (0, 4096)] {
        data().fill(0xaa);
        let r = req(&mut q0, 0, sector, Some((len as u32, true)), false);
        zero &= r.0 == 0 && data()[..len].iter().all(|&x| x == 0);
    }
    check!(
        zero,
        "blk-zeroed-reads-zero",
        "non-zero bytes after discard/write-zeroes"
    );
    set_seg(cap0, 8, 0);
    let r = req(&mut q0, 11, 0, None, true);
    check!(r.0 == 1, "blk-discard-past-end", "result {:?}", r);

    let mib = param_num(cmdline, "seq_mib").unwrap_or(16);
    let t0 = rdtsc();
    let mut ok = true;
    for i in 0..mib * 16 {
        let sector = (i * 128) % (cap0 - 128);
        ok &= req(&mut q0, 0, sector, Some((CHUNK as u32, true)), false).0 == 0;
    }
    check!(ok, "blk-sequential-reads", "a read failed");
    println!("blk: {} MiB in {} cycles", mib, rdtsc() - t0);
    check!(
        (d0.status() | d1.status()) & 0x80 == 0,
        "blk-not-failed",
        "status {:#x} {:#x}",
        d0.status(),
        d1.status()
    );
    finish()
}
