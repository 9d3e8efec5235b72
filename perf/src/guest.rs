//! The benchmark's own test guest, assembled here (like vmm/tests/snapshot.rs does): a PVH
//! ELF whose 32-bit entry
//! 1. writes one word into each 4 KiB page of a memory range and prints `READY`;
//! 2. spins reading its vsock device's guest CID (config space of virtio-mmio slot 0) while
//!    it is `BASE_CID`, i.e. until it runs as a restore or fork with a CID of its own (a VM
//!    booted with another CID goes straight on);
//! 3. unless that CID is `IDLE_CID_MIN` or more, reads one word of each page of the range
//!    again (its working set) and prints `PASS`;
//! 4. halts with interrupts off. A halted vCPU sleeps in the host kernel (in-kernel LAPIC),
//!    so a hundred of these idle at no CPU cost.
//!
//! The snapshot is taken in step 2, so a restored guest's first work is to read back its
//! memory: MAP_PRIVATE, lazy and prefetching restores differ there.

/// Console line the guest prints once its memory is touched.
pub const READY_LINE: &str = "READY";
/// Console line the guest prints once it has read its memory back (after a restore).
pub const PASS_LINE: &str = "PASS";
/// The CID the guest waits under (the VM that is snapshotted has it; nothing else may).
pub const BASE_CID: u32 = 3;
/// Restored with a CID of at least this, the guest halts at once (idle forks).
pub const IDLE_CID_MIN: u32 = 1000;

/// Guest-physical address where the touched range starts (above the image at 2 MiB).
pub const TOUCH_BASE: u32 = 0x40_0000;

/// Where the ELF loads the code (and where PVH enters).
const LOAD_ADDR: u64 = 0x20_0000;

/// The low half of the vsock device's guest_cid (virtio-mmio slot 0, config at 0x100).
const VSOCK_CID_ADDR: u32 = 0xd000_0100;

const READY_OFF: usize = 93;
const PASS_OFF: usize = READY_OFF + 7;

/// The guest code for `pages` pages from TOUCH_BASE (offsets in the comments).
pub fn touch_then_halt_code(pages: u32) -> Vec<u8> {
    assert!(pages >= 1, "the touch loop needs at least one page");
    let msg = |off: usize| (LOAD_ADDR as u32 + off as u32).to_le_bytes();
    let mut c = vec![0xbf]; // 0: mov edi, TOUCH_BASE
    c.extend_from_slice(&TOUCH_BASE.to_le_bytes());
    c.push(0xb9); // 5: mov ecx, pages
    c.extend_from_slice(&pages.to_le_bytes());
    // 10: mov [edi], edi; add edi, 4096; dec ecx; jnz 10
    c.extend_from_slice(&[
        0x89, 0x3f, 0x81, 0xc7, 0x00, 0x10, 0x00, 0x00, 0x49, 0x75, 0xf5,
    ]);
    c.extend_from_slice(&[0x66, 0xba, 0xf8, 0x03]); // 21: mov dx, 0x3f8
    c.push(0xbe); // 25: mov esi, READY
    c.extend_from_slice(&msg(READY_OFF));
    // 30: lodsb; test al, al; jz 38; out dx, al; jmp 30
    c.extend_from_slice(&[0xac, 0x84, 0xc0, 0x74, 0x03, 0xee, 0xeb, 0xf8]);
    c.push(0xa1); // 38: mov eax, [cid]
    c.extend_from_slice(&VSOCK_CID_ADDR.to_le_bytes());
    c.extend_from_slice(&[0x83, 0xf8, BASE_CID as u8]); // 43: cmp eax, BASE_CID
    c.extend_from_slice(&[0x74, 0xf6]); // 46: je 38
    c.push(0x3d); // 48: cmp eax, IDLE_CID_MIN
    c.extend_from_slice(&IDLE_CID_MIN.to_le_bytes());
    c.extend_from_slice(&[0x73, 0x22]); // 53: jae 89 (halt)
    c.push(0xbf); // 55: mov edi, TOUCH_BASE
    c.extend_from_slice(&TOUCH_BASE.to_le_bytes());
    c.push(0xb9); // 60: mov ecx, pages
    c.extend_from_slice(&pages.to_le_bytes());
    // 65: mov eax, [edi]; add edi, 4096; dec ecx; jnz 65
    c.extend_from_slice(&[
        0x8b, 0x07, 0x81, 0xc7, 0x00, 0x10, 0x00, 0x00, 0x49, 0x75, 0xf5,
    ]);
    c.push(0xbe); // 76: mov esi, PASS
    c.extend_from_slice(&msg(PASS_OFF));
    // 81: lodsb; test al, al; jz 89; out dx, al; jmp 81
    c.extend_from_slice(&[0xac, 0x84, 0xc0, 0x74, 0x03, 0xee, 0xeb, 0xf8]);
    // 89: cli; hlt; jmp 90
    c.extend_from_slice(&[0xfa, 0xf4, 0xeb, 0xfd]);
    assert_eq!(c.len(), READY_OFF);
    c.extend_from_slice(READY_LINE.as_bytes());
    c.extend_from_slice(b"\n\0");
    assert_eq!(c.len(), PASS_OFF);
    c.extend_from_slice(PASS_LINE.as_bytes());
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

    fn rel8_target(c: &[u8], at: usize) -> usize {
        (at as i64 + 2 + (c[at + 1] as i8) as i64) as usize
    }

    #[test]
    fn code_layout_and_jumps() {
        let c = touch_then_halt_code(8192);
        assert_eq!(u32_at(&c, 1), TOUCH_BASE);
        assert_eq!(u32_at(&c, 6), 8192);
        assert_eq!((c[19], rel8_target(&c, 19)), (0x75, 10)); // touch loop
        let ready = (u32_at(&c, 26) - LOAD_ADDR as u32) as usize;
        assert_eq!(&c[ready..ready + 7], b"READY\n\0");
        assert_eq!((c[33], rel8_target(&c, 33)), (0x74, 38)); // end of string
        assert_eq!((c[36], rel8_target(&c, 36)), (0xeb, 30)); // next char
        assert_eq!(c[38], 0xa1);
        assert_eq!(u32_at(&c, 39), VSOCK_CID_ADDR);
        assert_eq!(&c[43..46], &[0x83, 0xf8, 3]);
        assert_eq!((c[46], rel8_target(&c, 46)), (0x74, 38)); // spin while CID 3
        assert_eq!((c[48], u32_at(&c, 49)), (0x3d, IDLE_CID_MIN));
        assert_eq!((c[53], rel8_target(&c, 53)), (0x73, 89)); // idle forks halt
        assert_eq!(u32_at(&c, 56), TOUCH_BASE);
        assert_eq!(u32_at(&c, 61), 8192);
        assert_eq!(&c[65..67], &[0x8b, 0x07]);
        assert_eq!((c[74], rel8_target(&c, 74)), (0x75, 65)); // read loop
        let pass = (u32_at(&c, 77) - LOAD_ADDR as u32) as usize;
        assert_eq!(&c[pass..pass + 6], b"PASS\n\0");
        assert_eq!((c[84], rel8_target(&c, 84)), (0x74, 89));
        assert_eq!((c[87], rel8_target(&c, 87)), (0xeb, 81));
        assert_eq!(&c[89..91], &[0xfa, 0xf4]);
        assert_eq!((c[91], rel8_target(&c, 91)), (0xeb, 90)); // hlt forever
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
