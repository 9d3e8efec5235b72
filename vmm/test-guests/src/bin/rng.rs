//! Drives the virtio-rng device (see `dsec_test_guests::virtio`): normal requests, a request
//! larger than the device's per-request cap, a read-only buffer and a buffer outside RAM
//! (both must come back with length 0), and the device must keep working after them.
//! `rng_rounds=` sets how many 4 KiB requests the throughput loop makes (default 256).
#![no_std]
#![no_main]

use dsec_test_guests::virtio::Device;
use dsec_test_guests::{boot_info_or_finish, check, fail, finish, param_num, pass, println, rdtsc};

const WAIT: u64 = 20_000_000_000;
static mut BUF: [u8; 256 * 1024] = [0; 256 * 1024];

fn buf() -> u64 {
    core::ptr::addr_of!(BUF) as u64
}

fn bytes(off: usize, len: usize) -> &'static [u8] {
    // SAFETY: inside the static buffer; the device wrote it before the used entry appeared.
    unsafe { dsec_test_guests::phys_slice(buf() + off as u64, len) }
}

#[no_mangle]
pub extern "C" fn main(info_addr: u64, kind: u64) -> ! {
    let bi = boot_info_or_finish(info_addr, kind);
    let cmdline = bi.cmdline();
    let Some(dev) = Device::find(4, 0) else {
        fail("rng-probe", format_args!("no virtio device with id 4"));
        finish()
    };
    dsec_test_guests::ioapic_mask(dev.irq());
    if let Err(status) = dev.begin(0) {
        fail("rng-features", format_args!("status {:#x}", status));
        finish()
    }
    let Some(mut q) = dev.queue(0) else {
        fail("rng-queue", format_args!("no queue 0"));
        finish()
    };
    dev.driver_ok();
    pass("rng-probe");

    let r = q.call(&[(buf(), 4096, true)], WAIT);
    let first = bytes(0, 4096);
    let zeros = first.iter().filter(|&&b| b == 0).count();
    check!(
        r.map(|e| e.1) == Some(4096) && zeros < 64,
        "rng-4k",
        "used {:?}, {} zero bytes",
        r,
        zeros
    );
    let mut copy = [0u8; 64];
    copy.copy_from_slice(&first[..64]);
    let r = q.call(&[(buf(), 4096, true)], WAIT);
    check!(
        r.map(|e| e.1) == Some(4096) && bytes(0, 64) != copy,
        "rng-differs",
        "used {:?}, same bytes twice",
        r
    );

    // Two 128 KiB descriptors: the device caps one request at 64 KiB.
    let r = q.call(
        &[
            (buf(), 128 * 1024, true),
            (buf() + 128 * 1024, 128 * 1024, true),
        ],
        WAIT,
    );
    check!(
        r.map(|e| e.1) == Some(64 * 1024),
        "rng-capped",
        "used {:?}, want 65536",
        r
    );

    // Hostile buffers: read-only, outside RAM, wrapping the address space.
    let r = q.call(&[(buf(), 4096, false)], WAIT);
    check!(
        r.map(|e| e.1) == Some(0),
        "rng-readonly-buffer",
        "used {:?}",
        r
    );
    let r = q.call(&[(0xffff_f000_0000, 4096, true)], WAIT);
    check!(r.map(|e| e.1) == Some(0), "rng-outside-ram", "used {:?}", r);
    let r = q.call(&[(u64::MAX - 8, 4096, true)], WAIT);
    check!(
        r.map(|e| e.1) == Some(0),
        "rng-wrapping-address",
        "used {:?}",
        r
    );

    let rounds = param_num(cmdline, "rng_rounds").unwrap_or(256);
    let t0 = rdtsc();
    let mut got = 0u64;
    for _ in 0..rounds {
        match q.call(&[(buf(), 4096, true)], WAIT) {
            Some((_, n)) => got += u64::from(n),
            None => break,
        }
    }
    check!(
        got == rounds * 4096,
        "rng-rounds",
        "{} bytes of {}",
        got,
        rounds * 4096
    );
    println!("rng: {} bytes in {} cycles", got, rdtsc() - t0);
    check!(
        dev.status() & 0x80 == 0,
        "rng-not-failed",
        "status {:#x}",
        dev.status()
    );
    finish()
}
