//! The vCPU thread: runs KVM_RUN and dispatches exits to the buses.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::Arc;

use kvm_ioctls::{VcpuExit, VcpuFd};

use crate::devices::bus::Bus;
use crate::vm::{now_ns, BootTimes, VmExitReason};

/// Exit counters shared by all vCPUs (exits dominate boot time on nested hosts).
#[derive(Default)]
pub struct VcpuStats {
    pub exits: AtomicU64,
}

pub struct VcpuContext {
    pub id: u8,
    pub fd: VcpuFd,
    pub pio: Arc<Bus>,
    pub mmio: Arc<Bus>,
    pub exit: Sender<VmExitReason>,
    pub stats: Arc<VcpuStats>,
    pub times: Arc<BootTimes>,
}

const KVM_SYSTEM_EVENT_SHUTDOWN: u32 = 1;
const KVM_SYSTEM_EVENT_RESET: u32 = 2;

pub fn run(mut ctx: VcpuContext) {
    if ctx.id == 0 {
        ctx.times
            .first_kvm_run_ns
            .store(now_ns(), Ordering::Relaxed);
    }
    let reason = loop {
        let exit = ctx.fd.run();
        ctx.stats.exits.fetch_add(1, Ordering::Relaxed);
        match exit {
            Ok(VcpuExit::IoIn(port, data)) => {
                if !ctx.pio.read(u64::from(port), data) {
                    // Nothing there: the bus floats high, as on real hardware.
                    data.fill(0xff);
                }
            }
            Ok(VcpuExit::IoOut(port, data)) => {
                ctx.pio.write(u64::from(port), data);
            }
            Ok(VcpuExit::MmioRead(addr, data)) => {
                if !ctx.mmio.read(addr, data) {
                    data.fill(0xff);
                }
            }
            Ok(VcpuExit::MmioWrite(addr, data)) => {
                ctx.mmio.write(addr, data);
            }
            Ok(VcpuExit::Hlt) => {
                // Only seen without an in-kernel LAPIC; nothing will wake this vCPU.
                break VmExitReason::PowerOff;
            }
            Ok(VcpuExit::Shutdown) => break VmExitReason::TripleFault { vcpu: ctx.id },
            Ok(VcpuExit::SystemEvent(kind, _)) => match kind {
                KVM_SYSTEM_EVENT_RESET => break VmExitReason::Reset,
                KVM_SYSTEM_EVENT_SHUTDOWN => break VmExitReason::PowerOff,
                other => {
                    break VmExitReason::VcpuError {
                        vcpu: ctx.id,
                        message: format!("unhandled system event {other}"),
                    }
                }
            },
            Ok(VcpuExit::FailEntry(reason, cpu)) => {
                break VmExitReason::VcpuError {
                    vcpu: ctx.id,
                    message: format!(
                        "VM entry failed: hardware reason {reason:#x} on host CPU {cpu}"
                    ),
                }
            }
            Ok(VcpuExit::InternalError) => {
                break VmExitReason::VcpuError {
                    vcpu: ctx.id,
                    message:
                        "KVM internal error (often an instruction the host KVM cannot emulate)"
                            .into(),
                }
            }
            Ok(other) => {
                break VmExitReason::VcpuError {
                    vcpu: ctx.id,
                    message: format!("unexpected exit {other:?}"),
                }
            }
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => continue,
            Err(e) => {
                break VmExitReason::VcpuError {
                    vcpu: ctx.id,
                    message: format!("KVM_RUN failed: {e}"),
                }
            }
        }
    };
    let _ = ctx.exit.send(reason);
}
