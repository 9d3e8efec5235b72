//! The benchmark's own test guest, assembled here (like vmm/tests/snapshot.rs does): a PVH
//! ELF whose 32-bit entry writes one word into each 4 KiB page of a memory range, prints
//! `READY` on the serial port, then halts with interrupts off. A halted vCPU sleeps in the
//! host kernel (in-kernel LAPIC), so a hundred of these idle at no CPU cost, and after a
//! restore the guest touches no memory at all: what is measured is the VMM.

/// Console line the guest prints once its memory is touched.
pub const READY_LINE: &str = "READY";

/// Guest-physical address where the touched range starts (above the image at 2 MiB).
pub const TOUCH_BASE: u32 = 0x40_0000;

/// Where the ELF loads the code (and where PVH enters).
const LOAD_ADDR: u64 = 0x20_0000;

/// 32-bit code: touch `pages` pages from TOUCH_BASE, print READY, `cli; hlt` forever.
pub fn touch_then_halt_code(pages: u32) -> Vec<u8> {
    assert!(pages >= 1, "the touch loop needs at least one page");
    let mut c = vec![0xbf]; // mov edi, TOUCH_BASE
    c.extend_from_slice(&TOUCH_BASE.to_le_bytes());
    c.push(0xb9); // mov ecx, pages
    c.extend_from_slice(&pages.to_le_bytes());
    // loop (offset 10): mov [edi], edi; add edi, 4096; dec ecx; jnz loop
    c.extend_from_slice(&[
        0x89, 0x3f, 0x81, 0xc7, 0x00, 0x10, 0x00, 0x00, 0x49, 0x75, 0xf5,
    ]);
    c.extend_from_slice(&[0x66, 0xba, 0xf8, 0x03]); // mov dx, 0x3f8
    let msg_off = 42u32;
    c.push(0xbe); // mov esi, msg
    c.extend_from_slice(&(LOAD_ADDR as u32 + msg_off).to_le_bytes());
    // print (offset 30): lodsb; test al, al; jz done; out dx, al; jmp print
    c.extend_from_slice(&[0xac, 0x84, 0xc0, 0x74, 0x03, 0xee, 0xeb, 0xf8]);
    // done (offset 38): cli; hlt; jmp hlt
    c.extend_from_slice(&[0xfa, 0xf4, 0xeb, 0xfd]);
    assert_eq!(c.len(), msg_off as usize);
    c.extend_from_slice(READY_LINE.as_bytes());
    c.extend_from_slice(b"\n\0");
    c
}

/// A minimal ELF64 with one PT_LOAD at 2 MiB and a PVH entry note pointing at it.
pub fn pvh_elf(code: &[u8]) -> Vec<u8> {
    let note: Vec<u8> = [4u32, 4, 18]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .chain(*b"Xen\0")
        .chain((LOAD_ADDR as u32).to_le_bytes())
        .collect();
    let phoff = 64u64;
    let note_off = phoff + 2 * 56;
    let code_off = (note_off + note.len() as u64 + 15) & !15;
    let mut e = Vec::new();
    e.extend_from_slice(b"\x7fELF\x02\x01\x01");
    e.resize(16, 0);
    e.extend_from_slice(&2u16.to_le_bytes()); // ET_EXEC
    e.extend_from_slice(&0x3eu16.to_le_bytes()); // x86-64
    e.extend_from_slice(&1u32.to_le_bytes());
    e.extend_from_slice(&LOAD_ADDR.to_le_bytes()); // entry
    e.extend_from_slice(&phoff.to_le_bytes());
    e.extend_from_slice(&0u64.to_le_bytes());
    e.extend_from_slice(&0u32.to_le_bytes());
    for v in [64u16, 56, 2, 64, 0, 0] {
        e.extend_from_slice(&v.to_le_bytes());
    }
    let phdr = |e: &mut Vec<u8>, kind: u32, flags: u32, off: u64, addr: u64, size: u64| {
        e.extend_from_slice(&kind.to_le_bytes());
        e.extend_from_slice(&flags.to_le_bytes());
        for v in [off, addr, addr, size, size, 0x1000] {
            e.extend_from_slice(&v.to_le_bytes());
        }
    };
    phdr(&mut e, 1, 5, code_off, LOAD_ADDR, code.len() as u64);
    phdr(&mut e, 4, 4, note_off, 0, note.len() as u64);
    e.extend_from_slice(&note);
    e.resize(code_off as usize, 0);
    e.extend_from_slice(code);
    e
}

/// The guest that touches `touch_mib` MiB, as an ELF file's bytes.
pub fn touch_guest_elf(touch_mib: u32) -> Vec<u8> {
    pvh_elf(&touch_then_halt_code(touch_mib * 256))
}

/// Guest memory needed for `touch_mib` MiB above TOUCH_BASE.
pub fn min_mem_mib(touch_mib: u32) -> u32 {
    (TOUCH_BASE >> 20) + touch_mib
}

#[cfg(test)]
mod tests {
    use super::*;

    fn u32_at(b: &[u8], off: usize) -> u32 {
        u32::from_le_bytes(b[off..off + 4].try_into().unwrap())
    }

    #[test]
    fn code_layout_and_jumps() {
        let c = touch_then_halt_code(8192);
        assert_eq!(u32_at(&c, 1), TOUCH_BASE);
        assert_eq!(u32_at(&c, 6), 8192);
        // jnz at 19..21 jumps back to the loop at 10.
        assert_eq!(c[19], 0x75);
        assert_eq!(21 + (c[20] as i8) as i32, 10);
        // the message pointer points at READY in the loaded image
        let msg = (u32_at(&c, 26) - LOAD_ADDR as u32) as usize;
        assert_eq!(&c[msg..msg + 7], b"READY\n\0");
        // jz skips to cli; the final jmp loops on hlt
        assert_eq!(35 + c[34] as usize, 38);
        assert_eq!(&c[38..40], &[0xfa, 0xf4]);
        assert_eq!(42 + (c[41] as i8) as i32, 39);
        assert_eq!(36 + 2 + (c[37] as i8) as i32, 30);
    }

    #[test]
    fn elf_has_entry_note_and_code() {
        let code = touch_then_halt_code(1);
        let e = pvh_elf(&code);
        assert_eq!(&e[..4], b"\x7fELF");
        assert_eq!(u64::from_le_bytes(e[24..32].try_into().unwrap()), LOAD_ADDR);
        let note = e.windows(4).position(|w| w == b"Xen\0").unwrap();
        assert_eq!(u32_at(&e, note - 4), 18); // XEN_ELFNOTE_PHYS32_ENTRY
        assert_eq!(u32_at(&e, note + 4), LOAD_ADDR as u32);
        assert!(e.ends_with(&code));
        assert_eq!(min_mem_mib(32), 36);
        assert_eq!(u32_at(&touch_then_halt_code(32 * 256), 6), 8192);
    }
}
