//! The KVM floor under any restore: the ioctls every VM needs before its first KVM_RUN
//! (create VM, irqchip, PIT, one memory slot, one vCPU), timed one by one inside this
//! process (no fork/exec, no snapshot). What a pre-created VM would take off the critical
//! path.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Instant;

const KVM_CREATE_VM: libc::c_ulong = 0xae01;
const KVM_CREATE_VCPU: libc::c_ulong = 0xae41;
const KVM_SET_USER_MEMORY_REGION: libc::c_ulong = 0x4020_ae46;
const KVM_SET_TSS_ADDR: libc::c_ulong = 0xae47;
const KVM_CREATE_IRQCHIP: libc::c_ulong = 0xae60;
const KVM_CREATE_PIT2: libc::c_ulong = 0x4040_ae77;

#[repr(C)]
struct UserspaceMemoryRegion {
    slot: u32,
    flags: u32,
    guest_phys_addr: u64,
    memory_size: u64,
    userspace_addr: u64,
}

#[repr(C)]
struct PitConfig {
    flags: u32,
    pad: [u32; 15],
}

/// Metric keys, in the order the steps run.
pub const STEPS: [&str; 6] = [
    "create_vm_ms",
    "create_irqchip_ms",
    "create_pit2_ms",
    "set_user_memory_region_ms",
    "create_vcpu_ms",
    "total_ms",
];

fn ioctl(fd: i32, req: libc::c_ulong, arg: libc::c_ulong, what: &str) -> Result<i32, String> {
    // SAFETY: KVM ioctls on fds we own; pointer arguments point at live, correctly sized
    // repr(C) structs for the duration of the call.
    let r = unsafe { libc::ioctl(fd, req as _, arg) };
    if r < 0 {
        Err(format!("{what}: {}", std::io::Error::last_os_error()))
    } else {
        Ok(r)
    }
}

/// One VM built and torn down; ms per step.
pub fn measure(mem_mib: u64) -> Result<BTreeMap<&'static str, f64>, String> {
    let kvm = File::options()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .map_err(|e| format!("/dev/kvm: {e}"))?;
    let size = (mem_mib << 20) as usize;
    // SAFETY: a fresh anonymous mapping, unmapped below after the VM is gone.
    let mem = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if mem == libc::MAP_FAILED {
        return Err(format!("mmap: {}", std::io::Error::last_os_error()));
    }
    let result = (|| {
        let mut v = BTreeMap::new();
        let ms = |t: Instant| t.elapsed().as_secs_f64() * 1e3;
        let t0 = Instant::now();
        let t = Instant::now();
        let vm = ioctl(kvm.as_raw_fd(), KVM_CREATE_VM, 0, "KVM_CREATE_VM")?;
        // SAFETY: a new fd returned by KVM_CREATE_VM, owned from here on.
        let vm = unsafe { OwnedFd::from_raw_fd(vm) };
        v.insert("create_vm_ms", ms(t));
        let _ = ioctl(
            vm.as_raw_fd(),
            KVM_SET_TSS_ADDR,
            0xfffb_d000,
            "KVM_SET_TSS_ADDR",
        );
        let t = Instant::now();
        ioctl(vm.as_raw_fd(), KVM_CREATE_IRQCHIP, 0, "KVM_CREATE_IRQCHIP")?;
        v.insert("create_irqchip_ms", ms(t));
        let pit = PitConfig {
            flags: 1, // KVM_PIT_SPEAKER_DUMMY
            pad: [0; 15],
        };
        let t = Instant::now();
        ioctl(
            vm.as_raw_fd(),
            KVM_CREATE_PIT2,
            &pit as *const PitConfig as libc::c_ulong,
            "KVM_CREATE_PIT2",
        )?;
        v.insert("create_pit2_ms", ms(t));
        let region = UserspaceMemoryRegion {
            slot: 0,
            flags: 0,
            guest_phys_addr: 0,
            memory_size: size as u64,
            userspace_addr: mem as u64,
        };
        let t = Instant::now();
        ioctl(
            vm.as_raw_fd(),
            KVM_SET_USER_MEMORY_REGION,
            &region as *const UserspaceMemoryRegion as libc::c_ulong,
            "KVM_SET_USER_MEMORY_REGION",
        )?;
        v.insert("set_user_memory_region_ms", ms(t));
        let t = Instant::now();
        let vcpu = ioctl(vm.as_raw_fd(), KVM_CREATE_VCPU, 0, "KVM_CREATE_VCPU")?;
        // SAFETY: a new fd returned by KVM_CREATE_VCPU.
        drop(unsafe { OwnedFd::from_raw_fd(vcpu) });
        v.insert("create_vcpu_ms", ms(t));
        v.insert("total_ms", ms(t0));
        drop(vm);
        Ok(v)
    })();
    // SAFETY: the mapping made above; the VM that used it is closed.
    unsafe { libc::munmap(mem, size) };
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn struct_sizes_match_the_ioctl_numbers() {
        // _IOW(0xAE, nr, T) encodes sizeof(T) in bits 16..30.
        let size = |req: libc::c_ulong| ((req >> 16) & 0x3fff) as usize;
        assert_eq!(
            size(KVM_SET_USER_MEMORY_REGION),
            std::mem::size_of::<UserspaceMemoryRegion>()
        );
        assert_eq!(size(KVM_CREATE_PIT2), std::mem::size_of::<PitConfig>());
    }

    #[test]
    fn measures_every_step_when_kvm_is_there() {
        if !std::path::Path::new("/dev/kvm").exists() {
            return;
        }
        let v = measure(16).unwrap();
        for k in STEPS {
            assert!(v[k] >= 0.0, "{k}");
        }
        let parts: f64 = STEPS[..5].iter().map(|k| v[k]).sum();
        assert!(v["total_ms"] >= parts * 0.99, "{v:?}");
    }
}
