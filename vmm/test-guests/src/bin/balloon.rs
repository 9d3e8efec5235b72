//! Drives the virtio-balloon device as a driver would, with the host test steering through
//! the balloon target (`num_pages`) and reading the VMM's RSS between the steps the guest
//! announces on the serial port (`balloon: <step>`).
//!
//! `balloon_mode=full` (device with stats, deflate-on-OOM, reporting): touch region A (64 MiB
//! at 64 MiB) and region B (32 MiB at 128 MiB); hostile inflate requests come back; wait for
//! target 64 MiB, inflate A, `balloon: inflated`; wait for target 0, deflate A (its pages read
//! as zeroes: the host dropped them); report B as free pages, `balloon: reported`; wait for
//! target 1 MiB and finish. The statistics buffer is refilled whenever the device returns it.
//! `balloon_mode=plain` (no options): only inflate/deflate are offered and negotiated; a small
//! inflate drops the pages.
#![no_std]
#![no_main]

use core::ptr::{addr_of, addr_of_mut, read_volatile, write_volatile};

use dsec_test_guests::virtio::{Device, Queue};
use dsec_test_guests::{boot_info_or_finish, check, fail, finish, param, pass, println, rdtsc};

const WAIT: u64 = 20_000_000_000;
/// How long to wait for the host to change the target.
const HOST_WAIT: u64 = 600_000_000_000;
const F_VERSION_1: u64 = 1 << 32;
const F_STATS: u64 = 1 << 1;
const F_DOO: u64 = 1 << 2;
const F_REPORTING: u64 = 1 << 5;
const MIB: u64 = 1 << 20;
const A_START: u64 = 64 * MIB;
const A_PAGES: usize = 16384;
const B_START: u64 = 128 * MIB;
const B_LEN: u64 = 32 * MIB;

static mut PFNS: [u32; A_PAGES] = [0; A_PAGES];
static mut BAD: [u32; 4] = [0; 4];
static mut STATS: [u8; 40] = [0; 40];
static mut STATS_ROUNDS: u64 = 0;

fn touch(start: u64, len: u64, value: u64) {
    let mut a = start;
    while a < start + len {
        // SAFETY: guest RAM above the image, identity mapped and user-accessible; nothing else
        // uses these regions.
        unsafe { write_volatile(a as *mut u64, value) };
        a += 4096;
    }
}

fn first_word(addr: u64) -> u64 {
    // SAFETY: as for `touch`, a read of guest RAM.
    unsafe { read_volatile(addr as *const u64) }
}

fn set_actual(dev: &Device, pages: u32) {
    dev.write(0x104, pages);
}

/// Fills the statistics buffer: free/total/available memory and a round counter (tag 99).
fn fill_stats(round: u64) {
    let entries: [(u16, u64); 4] = [(4, 12345), (5, 256 * MIB), (6, 4096), (99, round)];
    // SAFETY: single-threaded guest; the device does not hold the buffer while we refill it.
    let buf = unsafe { &mut *addr_of_mut!(STATS) };
    for (i, (tag, v)) in entries.iter().enumerate() {
        buf[i * 10..i * 10 + 2].copy_from_slice(&tag.to_le_bytes());
        buf[i * 10 + 2..i * 10 + 10].copy_from_slice(&v.to_le_bytes());
    }
}

fn submit_stats(q: &mut Queue) {
    q.submit(&[(addr_of!(STATS) as u64, 40, false)]);
    q.notify();
}

/// Refills and resubmits the statistics buffer if the device gave it back.
fn service_stats(q: &mut Option<Queue>) {
    if let Some(q) = q {
        if q.pop().is_some() {
            // SAFETY: single-threaded guest.
            let round = unsafe {
                STATS_ROUNDS += 1;
                STATS_ROUNDS
            };
            fill_stats(round);
            submit_stats(q);
        }
    }
}

/// Waits until the host sets the target to `pages`, answering statistics requests.
fn wait_target(dev: &Device, stats: &mut Option<Queue>, pages: u32) -> bool {
    let t0 = rdtsc();
    while rdtsc() - t0 < HOST_WAIT {
        if dev.read_config32(0) == pages {
            return true;
        }
        service_stats(stats);
        core::hint::spin_loop();
    }
    false
}

/// Sends the frames of region A in 16 chains of 1024 on `q`; true if all came back.
fn send_region_a(q: &mut Queue) -> bool {
    // SAFETY: single-threaded guest; the device only reads the array while a chain is out.
    let pfns = unsafe { &mut *addr_of_mut!(PFNS) };
    for (i, p) in pfns.iter_mut().enumerate() {
        *p = (A_START >> 12) as u32 + i as u32;
    }
    let base = addr_of!(PFNS) as u64;
    (0..16).all(|c| q.call(&[(base + c * 4096, 4096, false)], WAIT).is_some())
}

#[no_mangle]
pub extern "C" fn main(info_addr: u64, kind: u64) -> ! {
    let bi = boot_info_or_finish(info_addr, kind);
    let full = param(bi.cmdline(), "balloon_mode") == Some(b"full");
    let Some(dev) = Device::find(5, 0) else {
        fail("balloon-probe", format_args!("no virtio device with id 5"));
        finish()
    };
    dsec_test_guests::ioapic_mask(dev.irq());
    let offered = dev.features();
    let want = if full {
        F_VERSION_1 | F_STATS | F_DOO | F_REPORTING
    } else {
        F_VERSION_1
    };
    check!(
        offered == want,
        "balloon-features-offered",
        "{:#x}, want {:#x}",
        offered,
        want
    );
    let accepted = match dev.begin(F_STATS | F_DOO | F_REPORTING) {
        Ok(a) => a,
        Err(status) => {
            fail("balloon-features-ok", format_args!("status {:#x}", status));
            finish()
        }
    };
    check!(
        accepted == want,
        "balloon-features-negotiated",
        "{:#x}",
        accepted
    );
    let (Some(mut inflate), Some(mut deflate)) = (dev.queue(0), dev.queue(1)) else {
        fail("balloon-queues", format_args!("no inflate/deflate queue"));
        finish()
    };
    let mut stats = if full { dev.queue(2) } else { None };
    let reporting = if full { dev.queue(3) } else { dev.queue(2) };
    check!(
        reporting.is_some() == full,
        "balloon-queue-count",
        "reporting queue present: {}",
        reporting.is_some()
    );
    let mut reporting = reporting;
    dev.driver_ok();
    check!(
        dev.status() & 0x80 == 0,
        "balloon-driver-ok",
        "status {:#x}",
        dev.status()
    );
    if let Some(q) = stats.as_mut() {
        fill_stats(0);
        submit_stats(q);
    }

    if !full {
        // Dirty 16 pages, inflate them: they read as zeroes afterwards.
        touch(A_START, 16 * 4096, 0x5a5a);
        // SAFETY: single-threaded guest.
        let pfns = unsafe { &mut *addr_of_mut!(PFNS) };
        for (i, p) in pfns.iter_mut().take(16).enumerate() {
            *p = (A_START >> 12) as u32 + i as u32;
        }
        let r = inflate.call(&[(addr_of!(PFNS) as u64, 64, false)], WAIT);
        let zero = (0..16).all(|i| first_word(A_START + i * 4096) == 0);
        check!(
            r.is_some() && zero,
            "balloon-plain-inflate",
            "used {:?}, zero {}",
            r,
            zero
        );
        let r = deflate.call(&[(addr_of!(PFNS) as u64, 64, false)], WAIT);
        check!(r.is_some(), "balloon-plain-deflate", "used {:?}", r);
        finish()
    }

    touch(A_START, A_PAGES as u64 * 4096, 0xa5a5_a5a5);
    touch(B_START, B_LEN, 0x5a5a_5a5a);
    println!("balloon: touched");

    // Hostile inflate requests: frames outside RAM and in the MMIO hole, a buffer outside
    // RAM, a wrapping one, a length that is not whole frames. Each must come back.
    // SAFETY: single-threaded guest.
    unsafe {
        *addr_of_mut!(BAD) = [u32::MAX, (bi.ram_end() >> 12) as u32 + 5, 0xd0000, 0xfec00];
    }
    let bad = addr_of!(BAD) as u64;
    let hostile: [(u64, u32); 4] = [
        (bad, 16),
        (0xffff_f000_0000, 16),
        (u64::MAX - 8, 16),
        (bad, 6),
    ];
    let returned = hostile
        .iter()
        .all(|&(a, l)| inflate.call(&[(a, l, false)], WAIT).is_some());
    check!(
        returned,
        "balloon-hostile-inflate-returned",
        "a request got lost"
    );

    if !wait_target(&dev, &mut stats, A_PAGES as u32) {
        fail(
            "balloon-target",
            format_args!("host never asked for 64 MiB"),
        );
        finish()
    }
    check!(
        send_region_a(&mut inflate),
        "balloon-inflate",
        "a chain got lost"
    );
    set_actual(&dev, A_PAGES as u32);
    println!("balloon: inflated");

    if !wait_target(&dev, &mut stats, 0) {
        fail("balloon-target-0", format_args!("host never asked for 0"));
        finish()
    }
    check!(
        send_region_a(&mut deflate),
        "balloon-deflate",
        "a chain got lost"
    );
    set_actual(&dev, 0);
    let zero = (0..A_PAGES as u64)
        .step_by(256)
        .all(|i| first_word(A_START + i * 4096) == 0);
    check!(
        zero,
        "balloon-deflated-pages-zero",
        "an inflated page kept its contents"
    );

    // Free page reporting: region B as 16 ranges of 2 MiB in one chain.
    let mut ranges = [(0u64, 0u32, true); 16];
    for (i, r) in ranges.iter_mut().enumerate() {
        *r = (B_START + i as u64 * 2 * MIB, (2 * MIB) as u32, true);
    }
    let r = reporting.as_mut().and_then(|q| q.call(&ranges, WAIT));
    check!(r.is_some(), "balloon-report", "report not returned");
    let zero = (0..B_LEN)
        .step_by(1 << 20)
        .all(|o| first_word(B_START + o) == 0);
    check!(
        zero,
        "balloon-reported-pages-zero",
        "a reported page kept its contents"
    );
    println!("balloon: reported");

    if !wait_target(&dev, &mut stats, 256) {
        fail(
            "balloon-finish",
            format_args!("host never signalled the end"),
        );
    }
    // SAFETY: single-threaded guest.
    let rounds = unsafe { STATS_ROUNDS };
    check!(
        rounds >= 2,
        "balloon-stats-rounds",
        "{} statistics requests",
        rounds
    );
    check!(
        dev.status() & 0x80 == 0,
        "balloon-not-failed",
        "status {:#x}",
        dev.status()
    );
    pass("balloon-done");
    finish()
}
