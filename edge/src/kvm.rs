//! What kind of KVM this host has, and so whether microVMs can run a Linux guest.

use serde::Serialize;

/// The host's KVM.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum KvmStatus {
    /// No usable /dev/kvm.
    None { reason: String },
    /// The software PVM hypervisor: guest kernels (CPL 0) are emulated and Linux cannot boot.
    Pvm,
    /// Hardware virtualization through this module (kvm_amd or kvm_intel).
    Hardware { module: String },
}

impl KvmStatus {
    pub fn detect() -> Self {
        if !std::path::Path::new("/dev/kvm").exists() {
            return Self::None {
                reason: "/dev/kvm does not exist".into(),
            };
        }
        if std::path::Path::new("/sys/module/kvm_pvm").exists() {
            return Self::Pvm;
        }
        for module in ["kvm_amd", "kvm_intel"] {
            if std::path::Path::new("/sys/module").join(module).exists() {
                return Self::Hardware {
                    module: module.into(),
                };
            }
        }
        Self::None {
            reason: "/dev/kvm exists but neither kvm_amd, kvm_intel nor kvm_pvm is loaded".into(),
        }
    }

    /// Whether a Linux guest can run under this KVM.
    pub fn can_run_linux_guest(&self) -> bool {
        matches!(self, Self::Hardware { .. })
    }

    /// Why microVMs cannot run here (None when they can).
    pub fn why_not_microvm(&self) -> Option<String> {
        match self {
            Self::Hardware { .. } => None,
            Self::Pvm => Some(
                "/dev/kvm is the software PVM hypervisor (kvm_pvm), which cannot run a Linux guest kernel"
                    .into(),
            ),
            Self::None { reason } => Some(reason.clone()),
        }
    }

    pub fn describe(&self) -> String {
        match self {
            Self::None { reason } => format!("none ({reason})"),
            Self::Pvm => "pvm (software, kvm_pvm: no Linux guests)".into(),
            Self::Hardware { module } => format!("hardware ({module})"),
        }
    }
}
