//! VM configuration: from a JSON file, command-line flags, or both (flags win).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Largest vCPU count we accept; KVM and the MP table both handle this many.
pub const MAX_VCPUS: u8 = 32;
/// Smallest guest memory that fits the boot structures, a kernel and an initramfs.
pub const MIN_MEM_MIB: u64 = 16;
/// Guest CIDs 0-2 are reserved by the vsock spec (hypervisor, local, host).
pub const MIN_GUEST_CID: u64 = 3;

/// Where the guest's serial console goes.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SerialOutput {
    /// Discard console output (fastest: no host writes).
    #[default]
    Sink,
    /// Write to the VMM's standard output.
    Stdout,
    /// Append to a file.
    File(PathBuf),
}

/// Host side of the virtio-vsock device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VsockConfig {
    /// Unix socket the host connects to (`CONNECT <port>\n`); guest-initiated
    /// connections to port P go to `<uds_path>_P`.
    pub uds_path: PathBuf,
    /// The guest's context id.
    #[serde(default = "default_cid")]
    pub guest_cid: u64,
}

fn default_cid() -> u64 {
    MIN_GUEST_CID
}

/// Everything needed to build and boot one VM.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmConfig {
    /// Uncompressed ELF vmlinux (PVH entry preferred) or bzImage.
    pub kernel: PathBuf,
    /// Optional initramfs (cpio, optionally compressed).
    #[serde(default)]
    pub initrd: Option<PathBuf>,
    /// Kernel command line; the VMM appends its device declarations.
    #[serde(default = "default_cmdline")]
    pub cmdline: String,
    /// Number of vCPUs, 1..=32.
    #[serde(default = "default_vcpus")]
    pub vcpus: u8,
    /// Guest memory in MiB.
    #[serde(default = "default_mem_mib")]
    pub mem_mib: u64,
    /// Optional vsock device.
    #[serde(default)]
    pub vsock: Option<VsockConfig>,
    /// Serial console destination.
    #[serde(default)]
    pub serial: SerialOutput,
}

/// Default command line for a Linux guest: quiet console (each byte costs VM exits),
/// keyboard-controller reboot so a guest `reboot` ends the VMM, no PCI probing.
pub const DEFAULT_CMDLINE: &str = "console=ttyS0 reboot=k panic=-1 pci=off quiet";

fn default_cmdline() -> String {
    DEFAULT_CMDLINE.to_string()
}
fn default_vcpus() -> u8 {
    1
}
fn default_mem_mib() -> u64 {
    256
}

/// A configuration problem, naming the offending field and what to do.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    ReadFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config file {path} is not valid VM config JSON: {source}")]
    Parse {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("field `kernel`: {path} does not exist or is unreadable ({source}); build the guest kernel (guest-kernel/build.sh) or pass --kernel")]
    KernelMissing {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("field `initrd`: {path} does not exist or is unreadable ({source})")]
    InitrdMissing {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("field `vcpus`: {0} is out of range; use 1..={MAX_VCPUS}")]
    Vcpus(u8),
    #[error("field `mem_mib`: {0} MiB is too small; use at least {MIN_MEM_MIB} MiB")]
    MemTooSmall(u64),
    #[error("field `mem_mib`: {requested} MiB is more than this host has available ({available} MiB in MemAvailable); ask for less memory")]
    MemTooLarge { requested: u64, available: u64 },
    #[error("field `vsock.guest_cid`: {0} is reserved; use {MIN_GUEST_CID} or more")]
    GuestCid(u64),
    #[error("field `vsock.uds_path`: parent directory of {0} does not exist")]
    VsockDir(PathBuf),
    #[error("field `cmdline`: contains a NUL byte or non-printable character")]
    Cmdline,
}

impl VmConfig {
    /// A config with defaults for everything but the kernel.
    pub fn new(kernel: impl Into<PathBuf>) -> Self {
        VmConfig {
            kernel: kernel.into(),
            initrd: None,
            cmdline: default_cmdline(),
            vcpus: default_vcpus(),
            mem_mib: default_mem_mib(),
            vsock: None,
            serial: SerialOutput::default(),
        }
    }

    /// Reads a JSON config file.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::ReadFile {
            path: path.to_owned(),
            source,
        })?;
        serde_json::from_str(&text).map_err(|source| ConfigError::Parse {
            path: path.to_owned(),
            source,
        })
    }

    /// Checks every field against this host; the error names the first bad field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        std::fs::File::open(&self.kernel).map_err(|source| ConfigError::KernelMissing {
            path: self.kernel.clone(),
            source,
        })?;
        if let Some(initrd) = &self.initrd {
            std::fs::File::open(initrd).map_err(|source| ConfigError::InitrdMissing {
                path: initrd.clone(),
                source,
            })?;
        }
        if self.vcpus == 0 || self.vcpus > MAX_VCPUS {
            return Err(ConfigError::Vcpus(self.vcpus));
        }
        if self.mem_mib < MIN_MEM_MIB {
            return Err(ConfigError::MemTooSmall(self.mem_mib));
        }
        if let Some(available) = host_available_mib() {
            if self.mem_mib > available {
                return Err(ConfigError::MemTooLarge {
                    requested: self.mem_mib,
                    available,
                });
            }
        }
        if let Some(vsock) = &self.vsock {
            if vsock.guest_cid < MIN_GUEST_CID || vsock.guest_cid > u64::from(u32::MAX) {
                return Err(ConfigError::GuestCid(vsock.guest_cid));
            }
            let parent = vsock.uds_path.parent().unwrap_or(Path::new("."));
            if !parent.as_os_str().is_empty() && !parent.is_dir() {
                return Err(ConfigError::VsockDir(vsock.uds_path.clone()));
            }
        }
        if self.cmdline.bytes().any(|b| !(0x20..0x7f).contains(&b)) {
            return Err(ConfigError::Cmdline);
        }
        Ok(())
    }
}

/// MemAvailable from /proc/meminfo, in MiB.
pub fn host_available_mib() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn valid() -> VmConfig {
        VmConfig::new("/proc/self/exe")
    }

    #[test]
    fn defaults_validate() {
        valid().validate().unwrap();
    }

    #[test]
    fn zero_vcpus_named() {
        let mut c = valid();
        c.vcpus = 0;
        assert!(c.validate().unwrap_err().to_string().contains("`vcpus`"));
    }

    #[test]
    fn huge_memory_named() {
        let mut c = valid();
        c.mem_mib = 1 << 40;
        let err = c.validate().unwrap_err().to_string();
        assert!(
            err.contains("`mem_mib`") && err.contains("available"),
            "{err}"
        );
    }

    #[test]
    fn missing_kernel_named() {
        let c = VmConfig::new("/nonexistent/vmlinux");
        assert!(c.validate().unwrap_err().to_string().contains("`kernel`"));
    }

    #[test]
    fn reserved_cid_rejected() {
        let mut c = valid();
        c.vsock = Some(VsockConfig {
            uds_path: "/tmp/x.sock".into(),
            guest_cid: 2,
        });
        assert!(c.validate().is_err());
    }

    #[test]
    fn unknown_json_field_rejected() {
        let err = serde_json::from_str::<VmConfig>(r#"{"kernel":"/k","vcpu":2}"#).unwrap_err();
        assert!(err.to_string().contains("vcpu"), "{err}");
    }
}
