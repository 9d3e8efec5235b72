//! vCPU register, CPUID, MSR and LAPIC setup for the two boot protocols we support.

use crate::memory::GuestMemory;
use kvm_bindings::{kvm_fpu, kvm_msr_entry, kvm_regs, kvm_segment, CpuId, Msrs};
use kvm_ioctls::VcpuFd;
use vm_memory::{Bytes, GuestAddress};

use super::layout::*;

/// How the vCPU enters the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EntryMode {
    /// PVH: 32-bit protected mode, paging off, EBX = start_info.
    Pvh,
    /// Linux 64-bit boot protocol: long mode, identity map, RSI = boot_params.
    Long64,
}

/// Why a vCPU could not be configured.
#[derive(Debug, thiserror::Error)]
pub enum CpuError {
    #[error(
        "KVM rejected the vCPU {what} setup: {source}; the host KVM may lack a needed feature"
    )]
    Kvm {
        what: &'static str,
        source: kvm_ioctls::Error,
    },
    #[error("cannot write boot page tables or GDT to guest memory: {0}")]
    Memory(vm_memory::GuestMemoryError),
    #[error("cannot build the MSR list: {0}")]
    Msrs(vmm_sys_util::fam::Error),
}

fn kvm(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> CpuError {
    move |source| CpuError::Kvm { what, source }
}

const X86_CR0_PE: u64 = 1 << 0;
const X86_CR0_ET: u64 = 1 << 4;
const X86_CR0_PG: u64 = 1 << 31;
const X86_CR4_PAE: u64 = 1 << 5;
const EFER_LME: u64 = 1 << 8;
const EFER_LMA: u64 = 1 << 10;

/// A GDT entry from (flags, base, limit), in the CPU's packed format.
const fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    ((base as u64 & 0xff00_0000) << (56 - 24))
        | ((flags as u64 & 0xf0ff) << 40)
        | ((limit as u64 & 0x000f_0000) << (48 - 16))
        | ((base as u64 & 0x00ff_ffff) << 16)
        | (limit as u64 & 0x0000_ffff)
}

fn segment_from_gdt(entry: u64, index: u8) -> kvm_segment {
    let limit_raw = ((entry & 0x000f_0000_0000_0000) >> 32) | (entry & 0xffff);
    let granularity = ((entry >> 55) & 1) as u8;
    kvm_segment {
        base: ((entry & 0xff00_0000_0000_0000) >> 32) | ((entry & 0x0000_00ff_ffff_0000) >> 16),
        limit: if granularity == 1 {
            ((limit_raw as u32) << 12) | 0xfff
        } else {
            limit_raw as u32
        },
        selector: u16::from(index) * 8,
        type_: ((entry >> 40) & 0xf) as u8,
        present: ((entry >> 47) & 1) as u8,
        dpl: ((entry >> 45) & 3) as u8,
        db: ((entry >> 54) & 1) as u8,
        s: ((entry >> 44) & 1) as u8,
        l: ((entry >> 53) & 1) as u8,
        g: granularity,
        avl: ((entry >> 52) & 1) as u8,
        padding: 0,
        unusable: if (entry >> 47) & 1 == 0 { 1 } else { 0 },
    }
}

fn boot_gdt(mode: EntryMode) -> [u64; 4] {
    let code = match mode {
        EntryMode::Pvh => gdt_entry(0xc09b, 0, 0xfffff),
        EntryMode::Long64 => gdt_entry(0xa09b, 0, 0xfffff),
    };
    [
        0,
        code,
        gdt_entry(0xc093, 0, 0xfffff),
        gdt_entry(0x008b, 0, 0x67),
    ]
}

/// Sets segment, control registers and (for 64-bit entry) the identity page tables.
pub fn setup_sregs(mem: &GuestMemory, vcpu: &VcpuFd, mode: EntryMode) -> Result<(), CpuError> {
    let mut sregs = vcpu.get_sregs().map_err(kvm("get sregs"))?;
    let gdt = boot_gdt(mode);
    for (i, entry) in gdt.iter().enumerate() {
        mem.write_obj(*entry, GuestAddress(BOOT_GDT_ADDR + 8 * i as u64))
            .map_err(CpuError::Memory)?;
    }
    mem.write_obj(0u64, GuestAddress(BOOT_IDT_ADDR))
        .map_err(CpuError::Memory)?;
    let code = segment_from_gdt(gdt[1], 1);
    let data = segment_from_gdt(gdt[2], 2);
    let tss = segment_from_gdt(gdt[3], 3);
    sregs.gdt.base = BOOT_GDT_ADDR;
    sregs.gdt.limit = (std::mem::size_of_val(&gdt) - 1) as u16;
    sregs.idt.base = BOOT_IDT_ADDR;
    sregs.idt.limit = 7;
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = tss;
    match mode {
        EntryMode::Pvh => {
            sregs.cr0 = X86_CR0_PE | X86_CR0_ET;
            sregs.cr4 = 0;
            sregs.efer = 0;
        }
        EntryMode::Long64 => {
            write_identity_page_tables(mem)?;
            sregs.cr3 = PML4_ADDR;
            sregs.cr4 |= X86_CR4_PAE;
            sregs.cr0 |= X86_CR0_PE | X86_CR0_PG | X86_CR0_ET;
            sregs.efer |= EFER_LME | EFER_LMA;
        }
    }
    vcpu.set_sregs(&sregs).map_err(kvm("sregs"))
}

/// Identity-maps the first 1 GiB with 2 MiB pages (kernel, boot_params and cmdline live there).
fn write_identity_page_tables(mem: &GuestMemory) -> Result<(), CpuError> {
    const PRESENT_RW: u64 = 0x3;
    const HUGE: u64 = 0x80;
    mem.write_obj(PDPTE_ADDR | PRESENT_RW, GuestAddress(PML4_ADDR))
        .map_err(CpuError::Memory)?;
    mem.write_obj(PDE_ADDR | PRESENT_RW, GuestAddress(PDPTE_ADDR))
        .map_err(CpuError::Memory)?;
    let pd: Vec<u8> = (0..512u64)
        .flat_map(|i| ((i << 21) | PRESENT_RW | HUGE).to_le_bytes())
        .collect();
    mem.write_slice(&pd, GuestAddress(PDE_ADDR))
        .map_err(CpuError::Memory)
}

/// Sets general registers for the entry point.
pub fn setup_regs(vcpu: &VcpuFd, mode: EntryMode, entry: u64) -> Result<(), CpuError> {
    let mut regs = kvm_regs {
        rflags: 0x2,
        rip: entry,
        ..Default::default()
    };
    match mode {
        EntryMode::Pvh => regs.rbx = PVH_INFO_ADDR,
        EntryMode::Long64 => {
            regs.rsp = BOOT_STACK_POINTER;
            regs.rbp = BOOT_STACK_POINTER;
            regs.rsi = ZERO_PAGE_ADDR;
        }
    }
    vcpu.set_regs(&regs).map_err(kvm("regs"))
}

/// x87 and SSE control words at their reset values.
pub fn setup_fpu(vcpu: &VcpuFd) -> Result<(), CpuError> {
    let fpu = kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    };
    vcpu.set_fpu(&fpu).map_err(kvm("fpu"))
}

/// MSRs Linux expects a firmware to have left in a sane state.
pub fn setup_msrs(vcpu: &VcpuFd) -> Result<(), CpuError> {
    const MSR_IA32_MISC_ENABLE: u32 = 0x1a0;
    const MISC_ENABLE_FAST_STRING: u64 = 1;
    const MSR_MTRR_DEF_TYPE: u32 = 0x2ff;
    const MTRR_ENABLE_WRITEBACK: u64 = (1 << 11) | 0x6;
    let zeroed = [
        0x174u32,    // SYSENTER_CS
        0x175,       // SYSENTER_ESP
        0x176,       // SYSENTER_EIP
        0xc000_0081, // STAR
        0xc000_0082, // LSTAR
        0xc000_0083, // CSTAR
        0xc000_0084, // SYSCALL_MASK
        0xc000_0102, // KERNEL_GS_BASE
    ];
    let mut entries: Vec<kvm_msr_entry> = zeroed
        .iter()
        .map(|&index| kvm_msr_entry {
            index,
            data: 0,
            ..Default::default()
        })
        .collect();
    entries.push(kvm_msr_entry {
        index: MSR_IA32_MISC_ENABLE,
        data: MISC_ENABLE_FAST_STRING,
        ..Default::default()
    });
    entries.push(kvm_msr_entry {
        index: MSR_MTRR_DEF_TYPE,
        data: MTRR_ENABLE_WRITEBACK,
        ..Default::default()
    });
    let msrs = Msrs::from_entries(&entries).map_err(CpuError::Msrs)?;
    // Some hosts (the PVM hypervisor among them) refuse a few of these; the guest copes.
    let written = vcpu.set_msrs(&msrs).map_err(kvm("msrs"))?;
    if written != entries.len() {
        tracing::debug!(
            written,
            wanted = entries.len(),
            "host accepted only some MSRs"
        );
    }
    Ok(())
}

/// LINT0 as ExtINT (legacy PIC pass-through) and LINT1 as NMI, as firmware would leave them.
pub fn setup_lapic(vcpu: &VcpuFd) -> Result<(), CpuError> {
    const APIC_LVT0: usize = 0x350;
    const APIC_LVT1: usize = 0x360;
    const MODE_EXTINT: u32 = 0x7;
    const MODE_NMI: u32 = 0x4;
    let mut lapic = vcpu.get_lapic().map_err(kvm("get lapic"))?;
    for (offset, mode) in [(APIC_LVT0, MODE_EXTINT), (APIC_LVT1, MODE_NMI)] {
        let bytes: &mut [u8] = {
            let regs = &mut lapic.regs[offset..offset + 4];
            // SAFETY: `regs` is a plain `c_char` array; reinterpreting it as bytes is sound.
            unsafe { std::slice::from_raw_parts_mut(regs.as_mut_ptr().cast::<u8>(), 4) }
        };
        let value = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
        let value = (value & !0x700) | (mode << 8);
        bytes.copy_from_slice(&value.to_le_bytes());
    }
    vcpu.set_lapic(&lapic).map_err(kvm("lapic"))
}

/// What the host's KVM can give the guest beyond what `KVM_GET_SUPPORTED_CPUID` lists.
#[derive(Clone, Copy, Debug, Default)]
pub struct HostCaps {
    /// `KVM_CAP_TSC_DEADLINE_TIMER`: the in-kernel LAPIC emulates the TSC-deadline timer mode.
    /// KVM never lists this bit in its supported CPUID; a VMM has to set it itself.
    pub tsc_deadline_timer: bool,
}

impl HostCaps {
    pub fn of(kvm: &kvm_ioctls::Kvm) -> HostCaps {
        HostCaps {
            tsc_deadline_timer: kvm.check_extension(kvm_ioctls::Cap::TscDeadlineTimer),
        }
    }
}

const CPUID_1_ECX_VMX: u32 = 1 << 5;
const CPUID_1_ECX_TSC_DEADLINE: u32 = 1 << 24;
const CPUID_1_ECX_HYPERVISOR: u32 = 1 << 31;
const CPUID_8000_0001_ECX_SVM: u32 = 1 << 2;
/// AMD's SVM feature leaf (revision, ASIDs, nested paging...).
const CPUID_SVM_FEATURES: u32 = 0x8000_000a;

/// Per-vCPU CPUID: APIC id, CPU count, hypervisor bit, topology, TSC-deadline timer, no
/// nested virtualization.
pub fn setup_cpuid(
    vcpu: &VcpuFd,
    base: &CpuId,
    caps: HostCaps,
    id: u8,
    count: u8,
) -> Result<(), CpuError> {
    vcpu.set_cpuid2(&guest_cpuid(base, caps, id, count))
        .map_err(kvm("cpuid"))
}

/// The CPUID vCPU `id` of `count` sees, from KVM's supported CPUID.
///
/// VMX and SVM are hidden: KVM lists them when the host allows nested virtualization, and a
/// sandbox must not reach the host's nested VMX/SVM emulation (KVM then refuses EFER.SVME and
/// CR4.VMXE). It also spares every guest kernel its KVM setup (~140 ms of a nested boot).
pub fn guest_cpuid(base: &CpuId, caps: HostCaps, id: u8, count: u8) -> CpuId {
    let mut cpuid = base.clone();
    for entry in cpuid.as_mut_slice() {
        match entry.function {
            0x1 => {
                entry.ecx &= !CPUID_1_ECX_VMX;
                entry.ebx =
                    (entry.ebx & 0x0000_ffff) | (u32::from(id) << 24) | (u32::from(count) << 16);
                entry.ecx |= CPUID_1_ECX_HYPERVISOR;
                // Without it Linux calibrates the LAPIC timer against the PIT at boot (100 ms
                // of ticks, far more under nested virtualization) and runs its tick from the
                // periodic LAPIC mode.
                if caps.tsc_deadline_timer {
                    entry.ecx |= CPUID_1_ECX_TSC_DEADLINE;
                }
                if count > 1 {
                    entry.edx |= 1 << 28; // HTT: more than one logical CPU
                }
            }
            0x4 => {
                // Cores per package - 1, in EAX[31:26].
                entry.eax = (entry.eax & 0x03ff_ffff) | (u32::from(count.saturating_sub(1)) << 26);
            }
            0xb => {
                entry.edx = u32::from(id);
                if entry.index == 0 {
                    entry.ebx = 1; // one thread per core
                    entry.ecx = (entry.ecx & !0xff00) | (1 << 8);
                } else if entry.index == 1 {
                    entry.ebx = u32::from(count);
                    entry.ecx = (entry.ecx & !0xff00) | (2 << 8) | 1;
                }
            }
            0x8000_0001 => entry.ecx &= !CPUID_8000_0001_ECX_SVM,
            CPUID_SVM_FEATURES => {
                entry.eax = 0;
                entry.ebx = 0;
                entry.ecx = 0;
                entry.edx = 0;
            }
            _ => {}
        }
    }
    cpuid
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guest_cpuid_sets_identity_hypervisor_and_tsc_deadline_bits() {
        use kvm_bindings::kvm_cpuid_entry2;
        let leaf = |function, ecx| kvm_cpuid_entry2 {
            function,
            ecx,
            ebx: 0x0000_0800,
            ..Default::default()
        };
        let base = CpuId::from_entries(&[leaf(0, 0), leaf(1, 0x1)]).unwrap();
        let caps = HostCaps {
            tsc_deadline_timer: true,
        };
        let cpuid = guest_cpuid(&base, caps, 1, 2);
        let leaf1 = cpuid.as_slice()[1];
        assert_eq!(
            leaf1.ecx,
            0x1 | CPUID_1_ECX_TSC_DEADLINE | CPUID_1_ECX_HYPERVISOR
        );
        assert_eq!(leaf1.ebx, 0x0000_0800 | (1 << 24) | (2 << 16));
        assert_eq!(cpuid.as_slice()[0].ecx, 0, "other leaves untouched");
        let without = guest_cpuid(&base, HostCaps::default(), 0, 1);
        assert_eq!(without.as_slice()[1].ecx & CPUID_1_ECX_TSC_DEADLINE, 0);
    }

    #[test]
    fn guest_cpuid_hides_nested_virtualization() {
        use kvm_bindings::kvm_cpuid_entry2;
        let leaf = |function, ecx, edx| kvm_cpuid_entry2 {
            function,
            eax: 1,
            ecx,
            edx,
            ..Default::default()
        };
        let base = CpuId::from_entries(&[
            leaf(1, CPUID_1_ECX_VMX | 0x1, 0),
            leaf(0x8000_0001, CPUID_8000_0001_ECX_SVM | 0x1, 0x20),
            leaf(CPUID_SVM_FEATURES, 0xff, 0x1234),
        ])
        .unwrap();
        let cpuid = guest_cpuid(&base, HostCaps::default(), 0, 1);
        let leaves = cpuid.as_slice();
        assert_eq!(leaves[0].ecx, 0x1 | CPUID_1_ECX_HYPERVISOR, "VMX hidden");
        assert_eq!(leaves[1].ecx, 0x1, "SVM hidden, other bits kept");
        assert_eq!(leaves[1].edx, 0x20);
        let svm = leaves[2];
        assert_eq!((svm.eax, svm.ebx, svm.ecx, svm.edx), (0, 0, 0, 0));
    }

    #[test]
    fn gdt_segment_round_trip() {
        let code64 = gdt_entry(0xa09b, 0, 0xfffff);
        let seg = segment_from_gdt(code64, 1);
        assert_eq!(seg.selector, 8);
        assert_eq!(seg.l, 1);
        assert_eq!(seg.db, 0);
        assert_eq!(seg.limit, 0xffff_ffff);
        assert_eq!(seg.type_, 0xb);
        assert_eq!(seg.present, 1);
        let data = segment_from_gdt(gdt_entry(0xc093, 0, 0xfffff), 2);
        assert_eq!(data.db, 1);
        assert_eq!(data.type_, 0x3);
        let tss = segment_from_gdt(gdt_entry(0x008b, 0, 0x67), 3);
        assert_eq!(tss.limit, 0x67);
        assert_eq!(tss.g, 0);
    }
}
