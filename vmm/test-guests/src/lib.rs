//! Runtime shared by the DSec test guests: boot code (`start.s`), serial output, result
//! reporting, boot-info access (PVH `hvm_start_info` or Linux `boot_params`), a command-line
//! parser and the deterministic data pattern the host tests also use.
//!
//! Everything after the boot code runs at CPL 3 with IOPL 3, so port I/O works directly and
//! normal code runs at native speed even on the software PVM hypervisor.
#![no_std]
// Index loops over fixed-size driver tables read more clearly than zipped iterators.
#![allow(clippy::needless_range_loop)]

pub mod virtio;
pub mod vsock;

use core::fmt::{self, Write};
use core::sync::atomic::{AtomicU32, Ordering};

core::arch::global_asm!(include_str!("start.s"), options(att_syntax));

/// The entry state recorded by the boot code before it changed anything.
#[derive(Clone, Copy, Debug)]
pub struct BootRegs {
    /// 1 = PVH entry (32-bit), 2 = Linux 64-bit boot protocol entry.
    pub kind: u64,
    pub rbx: u64,
    pub rsi: u64,
    pub cr0: u64,
    pub cr3: u64,
    pub cr4: u64,
    pub efer: u64,
    pub rflags: u64,
    pub cs: u16,
    pub ds: u16,
    pub ss: u16,
    pub es: u16,
    pub gdt_limit: u16,
    pub gdt_base: u64,
}

pub const BOOT_PVH: u64 = 1;
pub const BOOT_LINUX64: u64 = 2;

extern "C" {
    static dsec_boot_regs: [u64; 16];
    static __image_start: u8;
    static __image_end: u8;
}

/// Reads the registers saved by the boot code.
pub fn boot_regs() -> BootRegs {
    // SAFETY: `dsec_boot_regs` is a 128-byte array defined in start.s, written once at CPL 0
    // before `main` runs and never again.
    let r = unsafe { core::ptr::read_volatile(core::ptr::addr_of!(dsec_boot_regs)) };
    let gdtr = r[12].to_le_bytes();
    let kind = r[0];
    let base_bytes = if kind == BOOT_PVH { 4 } else { 6 };
    let mut gdt_base = 0u64;
    for i in 0..base_bytes {
        gdt_base |= u64::from(gdtr[2 + i]) << (8 * i);
    }
    if kind != BOOT_PVH {
        gdt_base |= (r[13] & 0xffff) << 48;
    }
    BootRegs {
        kind,
        rbx: r[1],
        rsi: r[2],
        cr0: r[3],
        cr3: r[4],
        cr4: r[5],
        efer: r[6],
        rflags: r[7],
        cs: r[8] as u16,
        ds: r[9] as u16,
        ss: r[10] as u16,
        es: r[11] as u16,
        gdt_limit: u16::from_le_bytes([gdtr[0], gdtr[1]]),
        gdt_base,
    }
}

/// Guest-physical range occupied by this guest's ELF image including .bss.
pub fn image_range() -> (u64, u64) {
    // Only the addresses of the linker-script symbols are taken, never their contents.
    (
        core::ptr::addr_of!(__image_start) as u64,
        core::ptr::addr_of!(__image_end) as u64,
    )
}

// ---------------------------------------------------------------------------------------------
// Port I/O and raw physical memory (identity mapped, so physical == virtual).

/// Writes one byte to an I/O port (one VM exit).
#[inline(always)]
pub fn outb(port: u16, value: u8) {
    // SAFETY: IOPL is 3, so `out` is allowed at CPL 3; it touches no memory.
    unsafe {
        core::arch::asm!("out dx, al", in("dx") port, in("al") value,
            options(nomem, nostack, preserves_flags));
    }
}

/// Reads one byte from an I/O port (one VM exit).
#[inline(always)]
pub fn inb(port: u16) -> u8 {
    let value: u8;
    // SAFETY: IOPL is 3, so `in` is allowed at CPL 3; it touches no memory.
    unsafe {
        core::arch::asm!("in al, dx", in("dx") port, out("al") value,
            options(nomem, nostack, preserves_flags));
    }
    value
}

/// Reads a little-endian value of type `T` from guest-physical address `addr`.
///
/// # Safety
/// `addr..addr + size_of::<T>()` must be mapped (all of the first 4 GiB is) and must not be 0.
pub unsafe fn peek<T: Copy>(addr: u64) -> T {
    // SAFETY: the caller guarantees the address is mapped and non-null; unaligned is fine.
    unsafe { core::ptr::read_volatile(addr as *const T) }
}

/// Reads `len` bytes at guest-physical `addr` as a slice.
///
/// # Safety
/// The range must be mapped RAM that nothing writes while the slice lives; `addr` != 0.
pub unsafe fn phys_slice(addr: u64, len: usize) -> &'static [u8] {
    // SAFETY: guaranteed by the caller.
    unsafe { core::slice::from_raw_parts(addr as *const u8, len) }
}

/// Reads a NUL-terminated string at guest-physical `addr` (at most `max` bytes).
///
/// # Safety
/// As for [`phys_slice`].
pub unsafe fn phys_cstr(addr: u64, max: usize) -> &'static [u8] {
    // SAFETY: guaranteed by the caller.
    let all = unsafe { phys_slice(addr, max) };
    let len = all.iter().position(|&b| b == 0).unwrap_or(max);
    &all[..len]
}

/// Masks IOAPIC input `pin` (the guest polls; interrupts it never takes would only make the
/// hypervisor kick the vCPU). Three MMIO accesses.
pub fn ioapic_mask(pin: u32) {
    const IOAPIC: u64 = 0xfec0_0000;
    // SAFETY: the IOAPIC window is identity mapped; IOREGSEL/IOWIN are aligned 32-bit
    // registers emulated by KVM. Setting the mask bit of a redirection entry is harmless.
    unsafe {
        core::ptr::write_volatile(IOAPIC as *mut u32, 0x10 + 2 * pin);
        let low = core::ptr::read_volatile((IOAPIC + 0x10) as *const u32);
        core::ptr::write_volatile((IOAPIC + 0x10) as *mut u32, low | (1 << 16));
    }
}

/// Current time stamp counter (for rough timings; its frequency is not calibrated).
pub fn rdtsc() -> u64 {
    let lo: u32;
    let hi: u32;
    // SAFETY: rdtsc only reads the TSC; CR4.TSD is clear so it is allowed at CPL 3.
    unsafe {
        core::arch::asm!("rdtsc", out("eax") lo, out("edx") hi, options(nomem, nostack));
    }
    (u64::from(hi) << 32) | u64::from(lo)
}

// ---------------------------------------------------------------------------------------------
// Serial console and reporting.

const COM1: u16 = 0x3f8;

/// Writer for the 8250 UART's transmit register. The VMM's UART is always ready, so the line
/// status register is not polled (each poll would cost another VM exit).
pub struct Serial;

impl Write for Serial {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        for b in s.bytes() {
            outb(COM1, b);
        }
        Ok(())
    }
}

#[doc(hidden)]
pub fn _print(args: fmt::Arguments) {
    let _ = Serial.write_fmt(args);
}

#[macro_export]
macro_rules! print {
    ($($arg:tt)*) => { $crate::_print(format_args!($($arg)*)) };
}

#[macro_export]
macro_rules! println {
    () => { $crate::print!("\n") };
    ($($arg:tt)*) => {{ $crate::_print(format_args!($($arg)*)); $crate::print!("\n"); }};
}

static N_OK: AtomicU32 = AtomicU32::new(0);
static N_FAIL: AtomicU32 = AtomicU32::new(0);

/// Records a passed check: prints `ok <name>`.
pub fn pass(name: &str) {
    N_OK.fetch_add(1, Ordering::Relaxed);
    println!("ok {}", name);
}

/// Records a failed check: prints `FAIL <name>: <detail>`.
pub fn fail(name: &str, detail: fmt::Arguments) {
    N_FAIL.fetch_add(1, Ordering::Relaxed);
    println!("FAIL {}: {}", name, detail);
}

/// `check!(cond, "name", "detail fmt", args...)`: ok or FAIL with the detail.
#[macro_export]
macro_rules! check {
    ($cond:expr, $name:expr, $($arg:tt)*) => {{
        let c: bool = $cond;
        if c { $crate::pass($name) } else { $crate::fail($name, format_args!($($arg)*)) }
        c
    }};
}

/// Number of failed checks so far.
pub fn failures() -> u32 {
    N_FAIL.load(Ordering::Relaxed)
}

/// Prints `DONE <ok> <fail>` and resets the machine.
pub fn finish() -> ! {
    println!(
        "DONE {} {}",
        N_OK.load(Ordering::Relaxed),
        N_FAIL.load(Ordering::Relaxed)
    );
    reset()
}

/// Asks the i8042 for a CPU reset (the VMM exits with status 0) and spins if it does not.
pub fn reset() -> ! {
    outb(0x64, 0xfe);
    loop {
        core::hint::spin_loop();
    }
}

/// Executes `ud2`. With no IDT this escalates to a triple fault.
pub fn crash() -> ! {
    // SAFETY: deliberately raises #UD; the guest never returns from it.
    unsafe { core::arch::asm!("ud2", options(noreturn, nomem, nostack)) }
}

#[panic_handler]
fn panic(info: &core::panic::PanicInfo) -> ! {
    N_FAIL.fetch_add(1, Ordering::Relaxed);
    println!("FAIL panic: {}", info);
    println!(
        "DONE {} {}",
        N_OK.load(Ordering::Relaxed),
        N_FAIL.load(Ordering::Relaxed)
    );
    crash()
}

// ---------------------------------------------------------------------------------------------
// Boot information as handed over by the VMM.

/// A memory map entry, normalised from either protocol (type 1 = RAM, 2 = reserved).
#[derive(Clone, Copy, Debug, Default)]
pub struct MemEntry {
    pub addr: u64,
    pub size: u64,
    pub kind: u32,
}

pub const MAX_MEMMAP: usize = 128;

/// What the VMM told the guest, read from `hvm_start_info` or `boot_params`.
#[derive(Clone, Copy)]
pub struct BootInfo {
    pub kind: u64,
    /// Address of `hvm_start_info` (PVH) or `boot_params` (Linux 64-bit).
    pub addr: u64,
    pub cmdline_addr: u64,
    pub memmap: [MemEntry; MAX_MEMMAP],
    pub memmap_len: usize,
    pub initrd: Option<(u64, u64)>,
}

impl BootInfo {
    /// Parses the boot structures; `None` if the magic numbers do not match.
    pub fn read(addr: u64, kind: u64) -> Option<BootInfo> {
        let mut bi = BootInfo {
            kind,
            addr,
            cmdline_addr: 0,
            memmap: [MemEntry::default(); MAX_MEMMAP],
            memmap_len: 0,
            initrd: None,
        };
        if addr == 0 || addr >= 0x1_0000_0000 {
            return None;
        }
        // SAFETY (both arms): `addr` is non-null and below 4 GiB, so every read below is of
        // identity-mapped memory; the structures were written by the VMM before boot.
        if kind == BOOT_PVH {
            unsafe {
                if peek::<u32>(addr) != 0x336e_c578 {
                    return None;
                }
                let nr_modules = peek::<u32>(addr + 12);
                let modlist = peek::<u64>(addr + 16);
                bi.cmdline_addr = peek::<u64>(addr + 24);
                let memmap = peek::<u64>(addr + 40);
                let n = (peek::<u32>(addr + 48) as usize).min(MAX_MEMMAP);
                for i in 0..n {
                    let e = memmap + 24 * i as u64;
                    if e == 0 {
                        break;
                    }
                    bi.memmap[i] = MemEntry {
                        addr: peek(e),
                        size: peek(e + 8),
                        kind: peek(e + 16),
                    };
                }
                bi.memmap_len = n;
                if nr_modules > 0 && modlist != 0 {
                    bi.initrd = Some((peek(modlist), peek(modlist + 8)));
                }
            }
        } else {
            unsafe {
                let lo = u64::from(peek::<u32>(addr + 0x228));
                let hi = u64::from(peek::<u32>(addr + 0xc8));
                bi.cmdline_addr = lo | (hi << 32);
                let n = (peek::<u8>(addr + 0x1e8) as usize).min(MAX_MEMMAP);
                for i in 0..n {
                    let e = addr + 0x2d0 + 20 * i as u64;
                    bi.memmap[i] = MemEntry {
                        addr: peek(e),
                        size: peek(e + 8),
                        kind: peek(e + 16),
                    };
                }
                bi.memmap_len = n;
                let image = u64::from(peek::<u32>(addr + 0x218))
                    | (u64::from(peek::<u32>(addr + 0xc0)) << 32);
                let size = u64::from(peek::<u32>(addr + 0x21c))
                    | (u64::from(peek::<u32>(addr + 0xc4)) << 32);
                if size != 0 {
                    bi.initrd = Some((image, size));
                }
            }
        }
        Some(bi)
    }

    pub fn memmap(&self) -> &[MemEntry] {
        &self.memmap[..self.memmap_len]
    }

    /// The kernel command line (empty if there is none).
    pub fn cmdline(&self) -> &'static [u8] {
        if self.cmdline_addr == 0 {
            return &[];
        }
        // SAFETY: the VMM placed a NUL-terminated command line at this non-null address.
        unsafe { phys_cstr(self.cmdline_addr, 4096) }
    }

    /// End of the highest RAM entry.
    pub fn ram_end(&self) -> u64 {
        self.memmap()
            .iter()
            .filter(|e| e.kind == 1)
            .map(|e| e.addr + e.size)
            .max()
            .unwrap_or(0)
    }
}

/// Reads the boot info and reports `ok boot-info` / FAIL; resets the guest if unreadable.
pub fn boot_info_or_finish(addr: u64, kind: u64) -> BootInfo {
    match BootInfo::read(addr, kind) {
        Some(bi) => bi,
        None => {
            fail(
                "boot-info",
                format_args!("no valid boot structure at {:#x} (kind {})", addr, kind),
            );
            finish()
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Command line parameters: `key=value` words.

/// Value of `key=` in the command line.
pub fn param<'a>(cmdline: &'a [u8], key: &str) -> Option<&'a [u8]> {
    cmdline.split(|&b| b == b' ').find_map(|word| {
        let k = key.as_bytes();
        if word.len() > k.len() && word.starts_with(k) && word[k.len()] == b'=' {
            Some(&word[k.len() + 1..])
        } else {
            None
        }
    })
}

/// Parses a number: decimal or 0x-hex, optional K/M/G suffix (binary units).
pub fn parse_num(s: &[u8]) -> Option<u64> {
    let (digits, mult) = match s.last()? {
        b'K' | b'k' => (&s[..s.len() - 1], 1u64 << 10),
        b'M' | b'm' => (&s[..s.len() - 1], 1 << 20),
        b'G' | b'g' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    let (digits, radix) = match digits {
        [b'0', b'x', rest @ ..] => (rest, 16),
        _ => (digits, 10),
    };
    if digits.is_empty() {
        return None;
    }
    let mut v: u64 = 0;
    for &d in digits {
        let x = (d as char).to_digit(radix)?;
        v = v.checked_mul(u64::from(radix))?.checked_add(u64::from(x))?;
    }
    v.checked_mul(mult)
}

/// Numeric `key=` parameter.
pub fn param_num(cmdline: &[u8], key: &str) -> Option<u64> {
    param(cmdline, key).and_then(parse_num)
}

/// Bytes as text for messages (non-UTF-8 is shown as `?`).
pub fn as_str(b: &[u8]) -> &str {
    core::str::from_utf8(b).unwrap_or("?")
}

// ---------------------------------------------------------------------------------------------
// The deterministic data pattern shared with the host tests (vmm/tests/test_guests.rs).

/// 64-bit word `k` of the pattern stream `seed`: byte `o` of the stream is byte `o % 8`
/// (little-endian) of word `o / 8`.
#[inline(always)]
pub fn pattern_word(seed: u64, k: u64) -> u64 {
    let mut z = seed
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .wrapping_add(k.wrapping_mul(0xd1b5_4a32_d192_ed03));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Byte `offset` of the pattern stream `seed`.
#[inline(always)]
pub fn pattern_byte(seed: u64, offset: u64) -> u8 {
    pattern_word(seed, offset / 8).to_le_bytes()[(offset % 8) as usize]
}

pub const HASH_INIT: u64 = 0xcbf2_9ce4_8422_2325;

/// FNV-1a over 64-bit little-endian words.
#[inline(always)]
pub fn hash_word(h: u64, word: u64) -> u64 {
    (h ^ word).wrapping_mul(0x0000_0100_0000_01b3)
}
