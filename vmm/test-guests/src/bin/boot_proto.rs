//! Verifies what the VMM built for a Linux guest, from CPL 3 and from the copies of the entry
//! registers the boot code saved: hvm_start_info (PVH) or boot_params (Linux 64-bit), the
//! memory map, command line, initrd, MP table, entry register state, the VMM's GDT and (64-bit
//! path) its page tables.
//!
//! Command line parameters (all optional unless noted):
//! `expect_boot=pvh|linux64` (required), `expect_mem=<size>`, `expect_vcpus=<n>`,
//! `initrd_size=<bytes> initrd_seed=<n>` (initrd holds pattern bytes), `expect_virtio_mmio=1`.
#![no_std]
#![no_main]

use dsec_test_guests::{
    as_str, boot_info_or_finish, boot_regs, check, fail, finish, image_range, param, param_num,
    pass, pattern_byte, peek, phys_slice, println, BootInfo, BootRegs, BOOT_LINUX64, BOOT_PVH,
};

const START_INFO_ADDR: u64 = 0x6000;
const BOOT_PARAMS_ADDR: u64 = 0x7000;
const CMDLINE_ADDR: u64 = 0x2_0000;
const MIB: u64 = 1 << 20;

fn overlaps(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.1 && b.0 < a.1
}

fn in_ram(bi: &BootInfo, start: u64, end: u64) -> bool {
    bi.memmap()
        .iter()
        .any(|e| e.kind == 1 && e.addr <= start && end <= e.addr + e.size)
}

#[no_mangle]
pub extern "C" fn main(info_addr: u64, kind: u64) -> ! {
    let regs = boot_regs();
    let bi = boot_info_or_finish(info_addr, kind);
    let cmdline = bi.cmdline();
    println!("cmdline: {}", as_str(cmdline));

    let want_kind = match param(cmdline, "expect_boot") {
        Some(b"pvh") => BOOT_PVH,
        Some(b"linux64") => BOOT_LINUX64,
        _ => 0,
    };
    check!(
        kind == want_kind,
        "boot-kind",
        "entered through kind {} (1 = PVH, 2 = Linux 64-bit), cmdline wants {}",
        kind,
        want_kind
    );

    check_entry_regs(&regs);
    check_vmm_gdt(&regs);
    if kind == BOOT_PVH {
        check_start_info(info_addr);
    } else {
        check_boot_params(info_addr, &bi);
        check_vmm_page_tables(regs.cr3);
    }
    check_memmap(&bi, cmdline);
    check_cmdline(&bi, cmdline);
    check_initrd(&bi, cmdline, info_addr);
    check_mp_table(cmdline);
    finish()
}

fn check_entry_regs(r: &BootRegs) {
    println!(
        "entry: rbx={:#x} rsi={:#x} cr0={:#x} cr3={:#x} cr4={:#x} efer={:#x} rflags={:#x} cs={:#x} ds={:#x} ss={:#x} es={:#x}",
        r.rbx, r.rsi, r.cr0, r.cr3, r.cr4, r.efer, r.rflags, r.cs, r.ds, r.ss, r.es
    );
    const PE: u64 = 1;
    const PG: u64 = 1 << 31;
    const PAE: u64 = 1 << 5;
    const LME: u64 = 1 << 8;
    const LMA: u64 = 1 << 10;
    check!(
        r.rflags == 0x2,
        "entry-rflags",
        "EFLAGS {:#x}, want 0x2",
        r.rflags
    );
    check!(r.cs == 0x08, "entry-cs", "CS {:#x}, want 0x08", r.cs);
    check!(
        r.ds == 0x10 && r.es == 0x10 && r.ss == 0x10,
        "entry-data-selectors",
        "DS {:#x} ES {:#x} SS {:#x}, want 0x10",
        r.ds,
        r.es,
        r.ss
    );
    if r.kind == BOOT_PVH {
        check!(
            r.rbx == START_INFO_ADDR,
            "entry-ebx",
            "EBX {:#x}, want {:#x}",
            r.rbx,
            START_INFO_ADDR
        );
        check!(
            r.cr0 & (PE | PG) == PE,
            "entry-cr0",
            "CR0 {:#x}: want PE set, PG clear",
            r.cr0
        );
        check!(r.cr4 == 0, "entry-cr4", "CR4 {:#x}, want 0", r.cr4);
        check!(
            r.efer & (LME | LMA) == 0,
            "entry-efer",
            "EFER {:#x}: LME/LMA set",
            r.efer
        );
    } else {
        check!(
            r.rsi == BOOT_PARAMS_ADDR,
            "entry-rsi",
            "RSI {:#x}, want {:#x}",
            r.rsi,
            BOOT_PARAMS_ADDR
        );
        check!(
            r.cr0 & (PE | PG) == PE | PG,
            "entry-cr0",
            "CR0 {:#x}: want PE and PG",
            r.cr0
        );
        check!(r.cr4 & PAE != 0, "entry-cr4", "CR4 {:#x}: PAE clear", r.cr4);
        check!(
            r.efer & (LME | LMA) == LME | LMA,
            "entry-efer",
            "EFER {:#x}: want LME and LMA",
            r.efer
        );
    }
}

/// Decodes the descriptor the VMM put behind CS and DS at entry.
fn check_vmm_gdt(r: &BootRegs) {
    println!("entry gdt: base={:#x} limit={:#x}", r.gdt_base, r.gdt_limit);
    let ok_range = r.gdt_base != 0 && r.gdt_base < MIB && u64::from(r.gdt_limit) >= 0x17;
    if !check!(
        ok_range,
        "vmm-gdt",
        "GDTR base {:#x} limit {:#x}",
        r.gdt_base,
        r.gdt_limit
    ) {
        return;
    }
    // SAFETY: the GDT lies below 1 MiB (checked above), which is identity mapped.
    let (code, data) = unsafe { (peek::<u64>(r.gdt_base + 8), peek::<u64>(r.gdt_base + 16)) };
    let base = |d: u64| ((d >> 16) & 0xff_ffff) | (((d >> 56) & 0xff) << 24);
    let limit = |d: u64| (d & 0xffff) | (((d >> 48) & 0xf) << 16);
    let access = |d: u64| (d >> 40) & 0xff;
    let gran = |d: u64| (d >> 55) & 1;
    let long = |d: u64| (d >> 53) & 1;
    let db = |d: u64| (d >> 54) & 1;
    let flat = |d: u64| base(d) == 0 && limit(d) == 0xfffff && gran(d) == 1;
    // Present, DPL 0, code, readable (0x9a/0x9b); 32-bit (D=1, L=0) for PVH, 64-bit (L=1, D=0).
    let code_ok = access(code) & 0xfa == 0x9a
        && flat(code)
        && if r.kind == BOOT_PVH {
            db(code) == 1 && long(code) == 0
        } else {
            long(code) == 1 && db(code) == 0
        };
    check!(code_ok, "vmm-gdt-code", "descriptor 0x08 = {:#018x}", code);
    // Present, DPL 0, data, writable (0x92/0x93), flat.
    let data_ok = access(data) & 0xfe == 0x92 && flat(data);
    check!(data_ok, "vmm-gdt-data", "descriptor 0x10 = {:#018x}", data);
}

fn check_start_info(addr: u64) {
    // SAFETY: `addr` was validated non-null and below 4 GiB by BootInfo::read.
    let (magic, version, nr_modules, memmap_entries) = unsafe {
        (
            peek::<u32>(addr),
            peek::<u32>(addr + 4),
            peek::<u32>(addr + 12),
            peek::<u32>(addr + 48),
        )
    };
    check!(magic == 0x336e_c578, "start-info-magic", "{:#x}", magic);
    check!(version >= 1, "start-info-version", "version {}", version);
    check!(
        addr == START_INFO_ADDR,
        "start-info-addr",
        "at {:#x}, want {:#x}",
        addr,
        START_INFO_ADDR
    );
    check!(
        nr_modules <= 1,
        "start-info-modules",
        "nr_modules {}",
        nr_modules
    );
    check!(
        memmap_entries > 0,
        "start-info-memmap",
        "memmap_entries {}",
        memmap_entries
    );
}

fn check_boot_params(addr: u64, bi: &BootInfo) {
    // SAFETY: `addr` was validated non-null and below 4 GiB; boot_params is 4 KiB.
    let (boot_flag, header, version, cmd_line_ptr, e820_entries, loader) = unsafe {
        (
            peek::<u16>(addr + 0x1fe),
            peek::<u32>(addr + 0x202),
            peek::<u16>(addr + 0x206),
            peek::<u32>(addr + 0x228),
            peek::<u8>(addr + 0x1e8),
            peek::<u8>(addr + 0x210),
        )
    };
    println!(
        "boot_params: boot_flag={:#x} header={:#x} version={:#x} type_of_loader={:#x}",
        boot_flag, header, version, loader
    );
    check!(
        addr == BOOT_PARAMS_ADDR,
        "boot-params-addr",
        "at {:#x}",
        addr
    );
    check!(
        boot_flag == 0xaa55,
        "boot-params-boot-flag",
        "{:#x}, want 0xaa55",
        boot_flag
    );
    check!(
        header == 0x5372_6448,
        "boot-params-header",
        "{:#x}, want \"HdrS\"",
        header
    );
    check!(
        u64::from(cmd_line_ptr) == bi.cmdline_addr && cmd_line_ptr != 0,
        "boot-params-cmd-line-ptr",
        "{:#x}",
        cmd_line_ptr
    );
    check!(
        e820_entries > 0 && usize::from(e820_entries) <= 128,
        "boot-params-e820-entries",
        "{}",
        e820_entries
    );
}

/// Walks the VMM's page tables (CR3 at entry): the first 1 GiB must be identity mapped.
fn check_vmm_page_tables(cr3: u64) {
    const ADDR_MASK: u64 = 0x000f_ffff_ffff_f000;
    let walk = |va: u64| -> Option<u64> {
        let mut table = cr3 & ADDR_MASK;
        for (level, shift) in [(4, 39u32), (3, 30), (2, 21), (1, 12)] {
            if table == 0 || table >= 1 << 32 {
                return None;
            }
            let idx = (va >> shift) & 0x1ff;
            // SAFETY: page-table pages are below 4 GiB (checked) and thus identity mapped.
            let e = unsafe { peek::<u64>(table + idx * 8) };
            if e & 1 == 0 {
                return None;
            }
            if (level == 3 || level == 2) && e & 0x80 != 0 {
                let page_mask = (1u64 << shift) - 1;
                return Some((e & ADDR_MASK & !page_mask) | (va & page_mask));
            }
            if level == 1 {
                return Some((e & ADDR_MASK) | (va & 0xfff));
            }
            table = e & ADDR_MASK;
        }
        None
    };
    let mut bad = None;
    for i in 0..512u64 {
        let va = i * 2 * MIB + 0x1234;
        if walk(va) != Some(va) {
            bad = Some((va, walk(va)));
            break;
        }
    }
    match bad {
        None => pass("vmm-page-tables-identity-1g"),
        Some((va, pa)) => fail(
            "vmm-page-tables-identity-1g",
            format_args!("{:#x} translates to {:?}", va, pa),
        ),
    }
}

fn check_memmap(bi: &BootInfo, cmdline: &[u8]) {
    for e in bi.memmap() {
        println!(
            "memmap: {:#x}..{:#x} type {}",
            e.addr,
            e.addr + e.size,
            e.kind
        );
    }
    let map = bi.memmap();
    let sorted = map.windows(2).all(|w| w[0].addr + w[0].size <= w[1].addr);
    check!(
        sorted,
        "memmap-sorted-disjoint",
        "entries out of order or overlapping"
    );
    check!(
        map.iter().all(|e| e.size > 0),
        "memmap-nonempty-entries",
        "zero-sized entry"
    );
    let expect_mem = param_num(cmdline, "expect_mem").unwrap_or(0);
    let want = [
        (0u64, 0x9fc00u64, 1u32),
        (0x9fc00, 0x400, 2),
        (0x10_0000, expect_mem.saturating_sub(0x10_0000), 1),
    ];
    let exact = map.len() == want.len()
        && map
            .iter()
            .zip(want.iter())
            .all(|(e, w)| (e.addr, e.size, e.kind) == *w);
    check!(
        exact,
        "memmap-layout",
        "want [0,0x9fc00) RAM, [0x9fc00,0xa0000) reserved, [1M,{:#x}) RAM",
        expect_mem
    );
    check!(
        bi.ram_end() == expect_mem,
        "memmap-ram-end",
        "RAM ends at {:#x}, want {:#x}",
        bi.ram_end(),
        expect_mem
    );
    let hole = map
        .iter()
        .any(|e| e.kind == 1 && overlaps((e.addr, e.addr + e.size), (0xa_0000, 0x10_0000)));
    check!(
        !hole,
        "memmap-legacy-hole",
        "RAM declared in [0xa0000, 0x100000)"
    );
    let (img_start, img_end) = image_range();
    check!(
        in_ram(bi, img_start, img_end),
        "memmap-kernel-in-ram",
        "image {:#x}..{:#x} not inside one RAM entry",
        img_start,
        img_end
    );
}

fn check_cmdline(bi: &BootInfo, cmdline: &[u8]) {
    let addr = bi.cmdline_addr;
    check!(
        addr == CMDLINE_ADDR,
        "cmdline-addr",
        "at {:#x}, want {:#x}",
        addr,
        CMDLINE_ADDR
    );
    let end = addr + cmdline.len() as u64 + 1;
    check!(
        in_ram(bi, addr, end) && !overlaps((addr, end), image_range()),
        "cmdline-placement",
        "{:#x}..{:#x}",
        addr,
        end
    );
    check!(
        param(cmdline, "token").is_some(),
        "cmdline-token",
        "no token= word (cmdline truncated or missing?)"
    );
    if param_num(cmdline, "expect_virtio_mmio") == Some(1) {
        let needle = b"virtio_mmio.device=4K@0xd0000000:5";
        let found = cmdline.split(|&b| b == b' ').any(|w| w == needle);
        check!(found, "cmdline-virtio-mmio", "no {}", as_str(needle));
    }
}

fn check_initrd(bi: &BootInfo, cmdline: &[u8], info_addr: u64) {
    let want_size = param_num(cmdline, "initrd_size");
    let Some(want_size) = want_size else {
        check!(
            bi.initrd.is_none(),
            "initrd-absent",
            "unexpected initrd {:?}",
            bi.initrd
        );
        return;
    };
    let Some((addr, size)) = bi.initrd else {
        fail(
            "initrd-present",
            format_args!("no initrd in the boot structure"),
        );
        return;
    };
    pass("initrd-present");
    println!(
        "initrd: {:#x}..{:#x} ({} bytes), RAM ends {:#x}",
        addr,
        addr + size,
        size,
        bi.ram_end()
    );
    check!(
        size == want_size,
        "initrd-size",
        "{} bytes, want {}",
        size,
        want_size
    );
    check!(addr % 4096 == 0, "initrd-aligned", "address {:#x}", addr);
    let range = (addr, addr + size);
    check!(
        in_ram(bi, range.0, range.1),
        "initrd-in-ram",
        "{:#x}..{:#x}",
        range.0,
        range.1
    );
    let cmd = (bi.cmdline_addr, bi.cmdline_addr + cmdline.len() as u64 + 1);
    let info = (info_addr, info_addr + 4096);
    check!(
        !overlaps(range, image_range()) && !overlaps(range, cmd) && !overlaps(range, info),
        "initrd-no-overlap",
        "overlaps the kernel image, the cmdline or the boot structure"
    );
    if in_ram(bi, range.0, range.1) && addr != 0 {
        let seed = param_num(cmdline, "initrd_seed").unwrap_or(0);
        // SAFETY: the range is inside RAM (checked) and nothing writes it.
        let data = unsafe { phys_slice(addr, size as usize) };
        let bad = data
            .iter()
            .enumerate()
            .position(|(i, &b)| b != pattern_byte(seed, i as u64));
        match bad {
            None => pass("initrd-content"),
            Some(i) => fail(
                "initrd-content",
                format_args!("first mismatch at offset {}", i),
            ),
        }
    }
}

fn checksum(addr: u64, len: u64) -> u8 {
    // SAFETY: callers pass ranges below 1 MiB, which is identity-mapped RAM or ROM area.
    let bytes = unsafe { phys_slice(addr, len as usize) };
    bytes.iter().fold(0u8, |a, &b| a.wrapping_add(b))
}

fn check_mp_table(cmdline: &[u8]) {
    let mut fp = None;
    let mut a = 0x9_fc00u64;
    while a < 0xa_0000 {
        // SAFETY: [0x9fc00, 0xa0000) is below 1 MiB, identity mapped, non-null.
        if unsafe { peek::<[u8; 4]>(a) } == *b"_MP_" {
            fp = Some(a);
            break;
        }
        a += 16;
    }
    let Some(fp) = fp else {
        fail(
            "mp-floating-pointer",
            format_args!("no _MP_ in [0x9fc00, 0xa0000)"),
        );
        return;
    };
    // SAFETY: the 16-byte floating pointer structure lies below 0xa0000.
    let (cfg, len16) = unsafe { (u64::from(peek::<u32>(fp + 4)), peek::<u8>(fp + 8)) };
    check!(
        len16 == 1 && checksum(fp, 16) == 0,
        "mp-floating-pointer",
        "at {:#x}: length {} checksum {:#x}",
        fp,
        len16,
        checksum(fp, 16)
    );
    if cfg == 0 || cfg >= MIB {
        fail(
            "mp-config-table",
            format_args!("config table pointer {:#x}", cfg),
        );
        return;
    }
    // SAFETY: `cfg` is non-null and below 1 MiB (checked).
    let (sig, base_len, count) = unsafe {
        (
            peek::<[u8; 4]>(cfg),
            u64::from(peek::<u16>(cfg + 4)),
            peek::<u16>(cfg + 34),
        )
    };
    let ok =
        sig == *b"PCMP" && base_len >= 44 && cfg + base_len <= MIB && checksum(cfg, base_len) == 0;
    if !check!(
        ok,
        "mp-config-table",
        "at {:#x}: sig {:?} length {}",
        cfg,
        sig,
        base_len
    ) {
        return;
    }
    let mut p = cfg + 44;
    let end = cfg + base_len;
    let (mut cpus, mut bsps, mut ioapics) = (0u64, 0u64, 0u64);
    let mut apic_ids = 0u64; // bitmap of ids < 64
    let mut dup = false;
    for _ in 0..count {
        if p >= end {
            break;
        }
        // SAFETY: `p` stays inside the config table (below 1 MiB).
        let t = unsafe { peek::<u8>(p) };
        match t {
            0 => {
                // SAFETY: as above; a processor entry is 20 bytes.
                let (id, flags) = unsafe { (peek::<u8>(p + 1), peek::<u8>(p + 3)) };
                if flags & 1 != 0 {
                    cpus += 1;
                    if id < 64 {
                        dup |= apic_ids & (1 << id) != 0;
                        apic_ids |= 1 << id;
                    }
                }
                if flags & 2 != 0 {
                    bsps += 1;
                }
                p += 20;
            }
            2 => {
                ioapics += 1;
                p += 8;
            }
            1 | 3 | 4 => p += 8,
            _ => {
                fail(
                    "mp-entries",
                    format_args!("unknown entry type {} at {:#x}", t, p),
                );
                return;
            }
        }
    }
    println!(
        "mp: {} cpus, {} bsp, {} ioapic, {} entries",
        cpus, bsps, ioapics, count
    );
    check!(p <= end, "mp-entries", "entries run past the table end");
    let want = param_num(cmdline, "expect_vcpus").unwrap_or(1);
    check!(
        cpus == want,
        "mp-cpu-count",
        "{} enabled processors, want {}",
        cpus,
        want
    );
    check!(
        bsps == 1 && !dup,
        "mp-bsp",
        "{} BSP entries, duplicate APIC ids: {}",
        bsps,
        dup
    );
}
