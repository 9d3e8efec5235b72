//! Guest-physical memory layout shared by the boot code, devices and test guests.

/// Boot GDT used for the first instructions (the kernel loads its own).
pub const BOOT_GDT_ADDR: u64 = 0x500;
/// Empty boot IDT.
pub const BOOT_IDT_ADDR: u64 = 0x520;
/// PVH `hvm_start_info`, followed by its memory map and module list.
pub const PVH_INFO_ADDR: u64 = 0x6000;
/// PVH memory map (right after the 56-byte start_info, 8-byte aligned).
pub const PVH_MEMMAP_ADDR: u64 = 0x6040;
/// Most memory-map entries we write (PVH and e820 alike).
pub const MAX_MEMMAP_ENTRIES: usize = 16;
/// PVH module list (one entry: the initrd).
pub const PVH_MODLIST_ADDR: u64 = 0x6400;
/// Linux `boot_params` ("zero page") for the 64-bit boot protocol.
pub const ZERO_PAGE_ADDR: u64 = 0x7000;
/// Initial stack pointer for the 64-bit entry.
pub const BOOT_STACK_POINTER: u64 = 0x8ff0;
/// Identity-map page tables for the 64-bit entry: PML4, PDPT, one PD (1 GiB of 2 MiB pages).
pub const PML4_ADDR: u64 = 0x9000;
pub const PDPTE_ADDR: u64 = 0xa000;
pub const PDE_ADDR: u64 = 0xb000;
/// Kernel command line.
pub const CMDLINE_ADDR: u64 = 0x20000;
/// Linux/x86 truncates the command line beyond this (COMMAND_LINE_SIZE).
pub const CMDLINE_MAX_SIZE: usize = 2048;
/// Start of the extended BIOS data area: the MP table lives here, reserved in e820.
pub const EBDA_START: u64 = 0x9fc00;
/// End of conventional memory.
pub const LOW_MEM_END: u64 = 0xa0000;
/// Kernels load at or above 1 MiB.
pub const HIMEM_START: u64 = 0x10_0000;
/// 32-bit MMIO hole: no RAM between here and 4 GiB.
pub const MMIO_GAP_START: u64 = 0xc000_0000;
pub const MMIO_GAP_END: u64 = 0x1_0000_0000;
/// First virtio-mmio device window; each device takes one 4 KiB window.
pub const VIRTIO_MMIO_BASE: u64 = 0xd000_0000;
pub const VIRTIO_MMIO_SIZE: u64 = 0x1000;
/// First legacy IRQ handed to virtio devices (4 is the serial port).
pub const VIRTIO_IRQ_BASE: u32 = 5;
/// Serial port IRQ.
pub const SERIAL_IRQ: u32 = 4;
/// KVM needs three pages for the TSS and one for the identity map, inside the MMIO gap.
pub const KVM_TSS_ADDR: u64 = 0xfffb_d000;
pub const KVM_IDENTITY_MAP_ADDR: u64 = 0xfffb_c000;
/// Local APIC and IO-APIC default bases.
pub const APIC_BASE: u32 = 0xfee0_0000;
pub const IOAPIC_BASE: u32 = 0xfec0_0000;

/// RAM regions `(start, size)` for a guest of `mem_bytes`: below the MMIO gap, then above 4 GiB.
pub fn ram_regions(mem_bytes: u64) -> Vec<(u64, u64)> {
    if mem_bytes <= MMIO_GAP_START {
        vec![(0, mem_bytes)]
    } else {
        vec![
            (0, MMIO_GAP_START),
            (MMIO_GAP_END, mem_bytes - MMIO_GAP_START),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_split_around_gap() {
        assert_eq!(ram_regions(256 << 20), vec![(0, 256 << 20)]);
        let r = ram_regions(4 << 30);
        assert_eq!(r[0], (0, MMIO_GAP_START));
        assert_eq!(r[1].0, MMIO_GAP_END);
        assert_eq!(r[0].1 + r[1].1, 4 << 30);
    }

    #[test]
    fn boot_structures_do_not_overlap() {
        let areas = [
            (BOOT_GDT_ADDR, 0x20),
            (BOOT_IDT_ADDR, 0x8),
            (PVH_INFO_ADDR, 0x40),
            (PVH_MEMMAP_ADDR, 24 * MAX_MEMMAP_ENTRIES as u64),
            (PVH_MODLIST_ADDR, 0x20),
            (ZERO_PAGE_ADDR, 0x1000),
            (PML4_ADDR, 0x3000),
            (CMDLINE_ADDR, CMDLINE_MAX_SIZE as u64),
            (EBDA_START, LOW_MEM_END - EBDA_START),
        ];
        for (i, a) in areas.iter().enumerate() {
            for b in &areas[i + 1..] {
                assert!(
                    a.0 + a.1 <= b.0 || b.0 + b.1 <= a.0,
                    "{a:x?} overlaps {b:x?}"
                );
            }
        }
    }
}
