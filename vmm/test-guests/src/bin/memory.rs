//! Writes and verifies a pattern over every RAM byte above the guest image (at CPL 3), in
//! three passes: write the pattern, verify it while writing its complement, verify that.
//! `expect_mem=<size>` (optional) is checked against the end of RAM in the memory map.
#![no_std]
#![no_main]

use dsec_test_guests::{
    boot_info_or_finish, check, fail, finish, image_range, param_num, pattern_word, println, rdtsc,
};

#[no_mangle]
pub extern "C" fn main(info_addr: u64, kind: u64) -> ! {
    let bi = boot_info_or_finish(info_addr, kind);
    let cmdline = bi.cmdline();
    if let Some(want) = param_num(cmdline, "expect_mem") {
        check!(
            bi.ram_end() == want,
            "memory-size",
            "RAM ends at {:#x}, want {:#x}",
            bi.ram_end(),
            want
        );
    }
    let (_, image_end) = image_range();
    let seed = rdtsc() | 1;
    let mut total = 0u64;
    let mut bad = 0u64;
    let t0 = rdtsc();
    for e in bi.memmap() {
        if e.kind != 1 {
            continue;
        }
        // Everything in this RAM entry above the image; skip an initrd if the VMM loaded one.
        let start = e.addr.max(image_end).next_multiple_of(8);
        let end = (e.addr + e.size) & !7;
        if start >= end {
            continue;
        }
        let mut ranges = [(start, end), (0, 0)];
        if let Some((ia, is)) = bi.initrd {
            if ia < end && ia + is > start {
                ranges = [(start, ia & !7), ((ia + is).next_multiple_of(8), end)];
            }
        }
        for (s, e) in ranges {
            if s >= e {
                continue;
            }
            let n = ((e - s) / 8) as usize;
            // SAFETY: [s, e) is RAM from the memory map, above this image (code, data,
            // stacks) and outside the initrd; nothing else in the guest references it.
            let words = unsafe { core::slice::from_raw_parts_mut(s as *mut u64, n) };
            let base = s / 8;
            for (i, w) in words.iter_mut().enumerate() {
                *w = pattern_word(seed, base + i as u64);
            }
            for (i, w) in words.iter_mut().enumerate() {
                let want = pattern_word(seed, base + i as u64);
                if *w != want {
                    if bad < 4 {
                        println!(
                            "mismatch at {:#x}: {:#x} != {:#x}",
                            s + 8 * i as u64,
                            *w,
                            want
                        );
                    }
                    bad += 1;
                }
                *w = !want;
            }
            for (i, w) in words.iter().enumerate() {
                if *w != !pattern_word(seed, base + i as u64) {
                    if bad < 4 {
                        println!("complement mismatch at {:#x}", s + 8 * i as u64);
                    }
                    bad += 1;
                }
            }
            total += e - s;
        }
    }
    let cycles = rdtsc() - t0;
    println!(
        "tested {} MiB above {:#x} in {} M TSC cycles",
        total >> 20,
        image_end,
        cycles / 1_000_000
    );
    if total == 0 {
        fail("memory-pattern", format_args!("no RAM above the image"));
    } else {
        check!(
            bad == 0,
            "memory-pattern",
            "{} bad words in {} bytes",
            bad,
            total
        );
    }
    finish()
}
