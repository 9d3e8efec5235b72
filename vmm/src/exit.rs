//! Why a VM stopped: sent by vCPU threads, the i8042 and the stop paths to whoever waits.

/// Why the VM stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VmExitReason {
    /// The guest reset the machine (i8042 or a KVM reset event): a clean stop.
    Reset,
    /// The guest asked KVM to power off.
    PowerOff,
    /// A vCPU hit a triple fault: the guest crashed.
    TripleFault { vcpu: u8 },
    /// A vCPU stopped on an error KVM reported.
    VcpuError { vcpu: u8, message: String },
    /// The VMM was told to stop (control socket `stop`, SIGTERM or SIGINT).
    Stopped,
}

impl std::fmt::Display for VmExitReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            VmExitReason::Reset => write!(f, "guest reset the machine"),
            VmExitReason::PowerOff => write!(f, "guest powered off"),
            VmExitReason::TripleFault { vcpu } => write!(
                f,
                "guest crashed: triple fault on vCPU {vcpu} (KVM_EXIT_SHUTDOWN); check the serial log"
            ),
            VmExitReason::VcpuError { vcpu, message } => write!(f, "vCPU {vcpu} failed: {message}"),
            VmExitReason::Stopped => write!(f, "stopped on request (control socket or SIGTERM)"),
        }
    }
}
