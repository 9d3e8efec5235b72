//! Intel MultiProcessor Specification 1.4 table: how a guest without ACPI finds its
//! CPUs, the IO-APIC and the legacy IRQ routing.

use crate::memory::GuestMemory;
use vm_memory::{Bytes, GuestAddress};

use super::layout::{APIC_BASE, EBDA_START, IOAPIC_BASE, LOW_MEM_END};

const IO_APIC_PINS: u8 = 24;
const APIC_VERSION: u8 = 0x14;
const IOAPIC_VERSION: u8 = 0x11;
const CPU_ENABLED: u8 = 1;
const CPU_BOOTSTRAP: u8 = 2;
// Family 6, model 15 stepping 11: any plausible value; Linux only logs it.
const CPU_SIGNATURE: u32 = (6 << 8) | (15 << 4) | 11;
const CPU_FEATURE_FPU_APIC: u32 = (1 << 0) | (1 << 9);
const IRQ_TYPE_INT: u8 = 0;
const IRQ_TYPE_NMI: u8 = 1;
const IRQ_TYPE_EXTINT: u8 = 3;

/// Why the MP table could not be written.
#[derive(Debug, thiserror::Error)]
pub enum MptableError {
    #[error("MP table for {0} vCPUs does not fit in the EBDA")]
    TooLarge(u8),
    #[error("cannot write the MP table to guest memory: {0}")]
    Write(vm_memory::GuestMemoryError),
}

fn checksum(bytes: &[u8]) -> u8 {
    0u8.wrapping_sub(bytes.iter().fold(0u8, |acc, b| acc.wrapping_add(*b)))
}

/// Builds the floating pointer and configuration table as bytes, for a table placed at `base`.
pub fn build(vcpus: u8, base: u64) -> Vec<u8> {
    let ioapic_id = vcpus + 1;
    let mut entries: Vec<u8> = Vec::new();
    let mut entry_count: u16 = 0;
    for cpu in 0..vcpus {
        let flags = CPU_ENABLED | if cpu == 0 { CPU_BOOTSTRAP } else { 0 };
        entries.extend_from_slice(&[0, cpu, APIC_VERSION, flags]);
        entries.extend_from_slice(&CPU_SIGNATURE.to_le_bytes());
        entries.extend_from_slice(&CPU_FEATURE_FPU_APIC.to_le_bytes());
        entries.extend_from_slice(&[0; 8]);
        entry_count += 1;
    }
    // Bus 0: ISA.
    entries.extend_from_slice(&[1, 0]);
    entries.extend_from_slice(b"ISA   ");
    entry_count += 1;
    // The IO-APIC.
    entries.extend_from_slice(&[2, ioapic_id, IOAPIC_VERSION, 1]);
    entries.extend_from_slice(&IOAPIC_BASE.to_le_bytes());
    entry_count += 1;
    // ISA IRQ n -> IO-APIC pin n, default polarity and trigger.
    for pin in 0..IO_APIC_PINS {
        entries.extend_from_slice(&[3, IRQ_TYPE_INT, 0, 0, 0, pin, ioapic_id, pin]);
        entry_count += 1;
    }
    // LINT0 = ExtINT (8259 pass-through), LINT1 = NMI, on every local APIC.
    entries.extend_from_slice(&[4, IRQ_TYPE_EXTINT, 0, 0, 0, 0, 0, 0]);
    entries.extend_from_slice(&[4, IRQ_TYPE_NMI, 0, 0, 0, 0, 0xff, 1]);
    entry_count += 2;

    let table_addr = base + 16;
    let mut table = Vec::with_capacity(44 + entries.len());
    table.extend_from_slice(b"PCMP");
    let length = u16::try_from(44 + entries.len()).unwrap_or(u16::MAX);
    table.extend_from_slice(&length.to_le_bytes());
    table.push(4); // spec revision 1.4
    table.push(0); // checksum, patched below
    table.extend_from_slice(b"DSEC    ");
    table.extend_from_slice(b"MICROVM     ");
    table.extend_from_slice(&0u32.to_le_bytes()); // OEM table pointer
    table.extend_from_slice(&0u16.to_le_bytes()); // OEM table size
    table.extend_from_slice(&entry_count.to_le_bytes());
    table.extend_from_slice(&APIC_BASE.to_le_bytes());
    table.extend_from_slice(&0u32.to_le_bytes()); // extended table length + checksum
    table.extend_from_slice(&entries);
    table[7] = checksum(&table);

    let mut floating = Vec::with_capacity(16);
    floating.extend_from_slice(b"_MP_");
    floating.extend_from_slice(&(table_addr as u32).to_le_bytes());
    floating.extend_from_slice(&[1, 4, 0, 0, 0, 0, 0, 0]);
    floating[10] = checksum(&floating);

    floating.extend_from_slice(&table);
    floating
}

/// Writes the MP table into the EBDA.
pub fn setup(mem: &GuestMemory, vcpus: u8) -> Result<(), MptableError> {
    let bytes = build(vcpus, EBDA_START);
    if EBDA_START + bytes.len() as u64 > LOW_MEM_END {
        return Err(MptableError::TooLarge(vcpus));
    }
    mem.write_slice(&bytes, GuestAddress(EBDA_START))
        .map_err(MptableError::Write)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sum(bytes: &[u8]) -> u8 {
        bytes.iter().fold(0u8, |a, b| a.wrapping_add(*b))
    }

    #[test]
    fn checksums_and_counts() {
        for vcpus in [1u8, 2, 32] {
            let bytes = build(vcpus, EBDA_START);
            assert_eq!(&bytes[0..4], b"_MP_");
            assert_eq!(sum(&bytes[0..16]), 0);
            let table = &bytes[16..];
            let len = u16::from_le_bytes([table[4], table[5]]) as usize;
            assert_eq!(len, table.len());
            assert_eq!(sum(table), 0);
            // Processor entries are 20 bytes each and come first.
            let cpu_entries = (0..vcpus as usize)
                .filter(|i| table[44 + i * 20] == 0)
                .count();
            assert_eq!(cpu_entries, vcpus as usize);
            assert!(EBDA_START + bytes.len() as u64 <= LOW_MEM_END);
        }
    }
}
