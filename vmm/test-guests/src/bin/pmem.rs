//! Drives a virtio-pmem device. The host (vmm/tests) fills the file with pattern `seed=` and
//! passes its size as `size=`. The guest reads the window's start and size from the config
//! space, maps the window (above 4 GiB, so it adds its own page directory), checks every byte
//! against the pattern, then by `mode=`:
//! - `ro`: stores into the window are dropped (KVM read-only slot), a flush still succeeds;
//! - `rw`: writes pattern seed+1 over 64 KiB at offset 1 MiB, prints `pmem-written`, waits
//!   until the host stores [`GO_FLUSH`] at offset 4 KiB of the file (the host checks the pages
//!   are dirty, and may snapshot and restore the VM meanwhile), flushes, prints
//!   `pmem-flushed` and waits for [`GO_FINISH`] (the host checks the pages are clean now).
//!
//! Both modes also send malformed requests (unknown type, no status buffer, a type cut short)
//! and expect an error status or an empty used element.
#![no_std]
#![no_main]

use core::ptr::{addr_of_mut, read_volatile, write_volatile};

use dsec_test_guests::virtio::{Device, Queue};
use dsec_test_guests::{
    boot_info_or_finish, check, fail, finish, param, param_num, pass, pattern_word, println, rdtsc,
};

const VIRTIO_ID_PMEM: u32 = 27;
const WAIT: u64 = 20_000_000_000;
/// About two minutes at a few GHz: the host may snapshot and restore us meanwhile.
const HOST_WAIT: u64 = 400_000_000_000;
const DOORBELL: u64 = 0x1000;
const GO_FLUSH: u64 = 0x600d_f105_0000_0001;
const GO_FINISH: u64 = 0x600d_f105_0000_0002;
const WRITE_AT: u64 = 1 << 20;
const WRITE_LEN: u64 = 64 * 1024;

extern "C" {
    static mut dsec_pdpt: [u64; 512];
}

#[repr(C, align(4096))]
struct PageDir([u64; 512]);

static mut PMEM_PD: PageDir = PageDir([0; 512]);

#[repr(C, align(64))]
struct Req {
    kind: [u8; 16],
    status: [u8; 16],
}

static mut R: Req = Req {
    kind: [0; 16],
    status: [0; 16],
};

/// Maps `[start, start + size)` (inside one 1 GiB-aligned gigabyte above 4 GiB) with 2 MiB
/// pages through our own page directory. The boot page tables are user-writable and the new
/// entries were not present before, so no TLB flush is needed.
fn map_window(start: u64, size: u64) -> bool {
    let gib = start >> 30;
    if start < (4 << 30) || gib >= 512 || (start + size - 1) >> 30 != gib {
        return false;
    }
    // SAFETY: single-threaded guest; PMEM_PD is ours, dsec_pdpt is the live PDPT from start.s
    // whose entry `gib` (>= 4) was empty: filling it maps only the pmem window.
    unsafe {
        let pd = addr_of_mut!(PMEM_PD) as *mut u64;
        for i in 0..512u64 {
            write_volatile(pd.add(i as usize), ((gib << 30) + (i << 21)) | 0x87);
        }
        let pdpt = addr_of_mut!(dsec_pdpt) as *mut u64;
        write_volatile(pdpt.add(gib as usize), pd as u64 | 0x7);
    }
    true
}

fn word(addr: u64) -> u64 {
    // SAFETY: `addr` lies in the pmem window, mapped by map_window (checked by the caller).
    unsafe { read_volatile(addr as *const u64) }
}

fn store(addr: u64, v: u64) {
    // SAFETY: as for `word`; a store to a read-only slot exits to the VMM, which drops it.
    unsafe { write_volatile(addr as *mut u64, v) }
}

/// Sends `kind` as a request of `kind_len` bytes, with (`status`) or without a status buffer.
/// Returns (status, used len).
fn request(q: &mut Queue, kind: u32, kind_len: u32, status: bool) -> (u32, u32) {
    // SAFETY: single-threaded; the device touches R only while the request is in flight.
    let (k, s) = unsafe {
        let r = addr_of_mut!(R);
        let (k, s) = (addr_of_mut!((*r).kind), addr_of_mut!((*r).status));
        write_volatile(k as *mut u32, kind.to_le());
        write_volatile(s as *mut u32, 0xeeee_eeee);
        (k as u64, s as u64)
    };
    let used = if status {
        q.call(&[(k, kind_len, false), (s, 4, true)], WAIT)
    } else {
        q.call(&[(k, kind_len, false)], WAIT)
    };
    // SAFETY: the request completed (or timed out, leaving the 0xee marker).
    let st = unsafe { read_volatile(addr_of_mut!(R.status) as *const u32) };
    (st, used.map_or(u32::MAX, |u| u.1))
}

fn wait_doorbell(start: u64, want: u64, name: &str) -> bool {
    let t0 = rdtsc();
    while word(start + DOORBELL) != want {
        if rdtsc() - t0 > HOST_WAIT {
            fail(name, format_args!("the host never stored {want:#x}"));
            return false;
        }
        core::hint::spin_loop();
    }
    true
}

#[no_mangle]
pub extern "C" fn main(info_addr: u64, kind: u64) -> ! {
    let bi = boot_info_or_finish(info_addr, kind);
    let cmdline = bi.cmdline();
    let seed = param_num(cmdline, "seed").unwrap_or(1);
    let want_size = param_num(cmdline, "size").unwrap_or(0);
    let rw = param(cmdline, "mode") == Some(b"rw".as_slice());
    let Some(dev) = Device::find(VIRTIO_ID_PMEM, 0) else {
        fail("pmem-probe", format_args!("no virtio-pmem device"));
        finish()
    };
    dsec_test_guests::ioapic_mask(dev.irq());
    if let Err(status) = dev.begin(0) {
        fail(
            "pmem-probe",
            format_args!("FEATURES_OK refused, status {status:#x}"),
        );
        finish()
    }
    let Some(mut q) = dev.queue(0) else {
        fail("pmem-probe", format_args!("no request queue"));
        finish()
    };
    dev.driver_ok();
    check!(
        dev.status() & 0x80 == 0,
        "pmem-probe",
        "status {:#x}",
        dev.status()
    );

    let start = dev.read_config64(0);
    let size = dev.read_config64(8);
    check!(
        size == want_size && start.is_multiple_of(2 << 20) && start >= bi.ram_end().max(4 << 30),
        "pmem-config",
        "start {:#x} size {:#x} (want size {:#x}, RAM ends at {:#x})",
        start,
        size,
        want_size,
        bi.ram_end()
    );
    if size == 0 || !map_window(start, size) {
        fail(
            "pmem-map",
            format_args!("window {start:#x}+{size:#x} not mappable here"),
        );
        finish()
    }

    // Every byte of the file, as the host wrote it.
    let mut bad = None;
    for k in 0..size / 8 {
        if word(start + 8 * k) != pattern_word(seed, k) {
            bad = Some(k);
            break;
        }
    }
    check!(
        bad.is_none(),
        "pmem-read-pattern",
        "word {} differs",
        bad.unwrap_or(0)
    );

    let (st, len) = request(&mut q, 7, 4, true);
    check!(
        st == 1 && len == 4,
        "pmem-unknown-type",
        "status {st} len {len}"
    );
    let (_, len) = request(&mut q, 0, 4, false);
    check!(len == 0, "pmem-no-status-buffer", "len {len}");
    let (st, len) = request(&mut q, 0, 2, true);
    check!(
        st == 1 && len == 4,
        "pmem-short-type",
        "status {st} len {len}"
    );

    if !rw {
        let before = word(start);
        store(start, !before);
        store(start + size - 8, 0);
        let after = (word(start), word(start + size - 8));
        check!(
            after == (before, pattern_word(seed, size / 8 - 1)),
            "pmem-ro-write-dropped",
            "window reads {:#x} {:#x} after stores",
            after.0,
            after.1
        );
        let (st, len) = request(&mut q, 0, 4, true);
        check!(
            st == 0 && len == 4,
            "pmem-flush-ro",
            "status {st} len {len}"
        );
        finish()
    }

    for k in 0..WRITE_LEN / 8 {
        store(start + WRITE_AT + 8 * k, pattern_word(seed + 1, k));
    }
    let back =
        (0..WRITE_LEN / 8).all(|k| word(start + WRITE_AT + 8 * k) == pattern_word(seed + 1, k));
    check!(
        back,
        "pmem-write-readback",
        "a stored word reads back differently"
    );
    println!("pmem-written");
    if !wait_doorbell(start, GO_FLUSH, "pmem-wait-flush") {
        finish()
    }
    let (st, len) = request(&mut q, 0, 4, true);
    check!(st == 0 && len == 4, "pmem-flush", "status {st} len {len}");
    println!("pmem-flushed");
    if !wait_doorbell(start, GO_FINISH, "pmem-wait-finish") {
        finish()
    }
    pass("pmem-host-checked");
    finish()
}
