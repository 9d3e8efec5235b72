//! VM configuration: from a JSON file, command-line flags, or both (flags win).
//!
//! The VMM re-exports this module as `dsec_vmm::config`; validation checks the fields against
//! this host (files exist and open, memory is available) without touching KVM.

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

/// A virtio-blk disk: a raw image file (sparse files stay sparse: discard punches holes).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DriveConfig {
    pub path: PathBuf,
    /// The guest sees a read-only disk and every write is refused.
    #[serde(default)]
    pub read_only: bool,
}

impl std::str::FromStr for DriveConfig {
    type Err = FlagError;
    /// `PATH[,ro]`
    fn from_str(s: &str) -> Result<Self, FlagError> {
        let (path, read_only) = match s.rsplit_once(',') {
            Some((p, "ro")) => (p, true),
            Some((p, "rw")) => (p, false),
            Some((_, other)) => return Err(FlagError::DriveOption(other.to_string())),
            None => (s, false),
        };
        if path.is_empty() {
            return Err(FlagError::DrivePath);
        }
        Ok(DriveConfig {
            path: path.into(),
            read_only,
        })
    }
}

/// A virtio-pmem device: a host file mapped into guest-physical memory (the guest sees
/// /dev/pmemN and can mount it with `-o dax`). Its size must be a non-zero multiple of 2 MiB.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PmemConfig {
    pub path: PathBuf,
    /// Mapped read-only (MAP_PRIVATE, KVM read-only slot): guest writes are dropped. Several
    /// VMs mapping one read-only file share its page-cache pages.
    #[serde(default)]
    pub read_only: bool,
    /// Writable, but with a shared lock: several VMs may map the file at once (and see each
    /// other's writes). Without it a writable file is locked to one VM.
    #[serde(default)]
    pub shared: bool,
}

impl std::str::FromStr for PmemConfig {
    type Err = FlagError;
    /// `PATH[,ro|,shared]`
    fn from_str(s: &str) -> Result<Self, FlagError> {
        let (path, read_only, shared) = match s.rsplit_once(',') {
            Some((p, "ro")) => (p, true, false),
            Some((p, "shared")) => (p, false, true),
            Some((p, "rw")) => (p, false, false),
            Some((_, other)) => return Err(FlagError::PmemOption(other.to_string())),
            None => (s, false, false),
        };
        if path.is_empty() {
            return Err(FlagError::PmemPath);
        }
        Ok(PmemConfig {
            path: path.into(),
            read_only,
            shared,
        })
    }
}

/// A virtio-net device on a host tap interface.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetConfig {
    /// Tap interface name (created if missing; usually pre-created in the sandbox's netns).
    pub tap: String,
    /// Guest MAC `aa:bb:cc:dd:ee:ff`; default: a locally administered one from the tap name.
    #[serde(default)]
    pub mac: Option<String>,
}

impl NetConfig {
    /// Checks the tap name and the MAC.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let t = &self.tap;
        if t.is_empty()
            || t.len() > 15
            || t.bytes()
                .any(|b| b == b'/' || b == b':' || !b.is_ascii_graphic())
        {
            return Err(ConfigError::TapName(t.clone()));
        }
        if let Some(mac) = &self.mac {
            match parse_mac(mac) {
                Some(m) if m[0] & 1 == 0 && m != [0; 6] => {}
                _ => return Err(ConfigError::Mac(mac.clone())),
            }
        }
        Ok(())
    }

    /// The guest's MAC address (validate() has checked the string).
    pub fn mac_bytes(&self) -> [u8; 6] {
        match self.mac.as_deref().and_then(parse_mac) {
            Some(m) => m,
            None => {
                // FNV-1a of the name; 0x06 = locally administered, unicast.
                let mut h: u64 = 0xcbf2_9ce4_8422_2325;
                for b in self.tap.bytes() {
                    h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
                }
                let b = h.to_le_bytes();
                [0x06, b[0], b[1], b[2], b[3], b[4]]
            }
        }
    }
}

impl std::str::FromStr for NetConfig {
    type Err = FlagError;
    /// `tap=NAME[,mac=AA:BB:CC:DD:EE:FF]`
    fn from_str(s: &str) -> Result<Self, FlagError> {
        let mut tap = None;
        let mut mac = None;
        for part in s.split(',') {
            match part.split_once('=') {
                Some(("tap", v)) => tap = Some(v.to_string()),
                Some(("mac", v)) => mac = Some(v.to_string()),
                _ => return Err(FlagError::NetOption(part.to_string())),
            }
        }
        let tap = tap.ok_or(FlagError::NetTap)?;
        Ok(NetConfig { tap, mac })
    }
}

impl std::fmt::Display for NetConfig {
    /// The `--net` flag value (`tap=NAME[,mac=MAC]`).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "tap={}", self.tap)?;
        match &self.mac {
            Some(mac) => write!(f, ",mac={mac}"),
            None => Ok(()),
        }
    }
}

/// Longest statistics polling interval accepted for the balloon.
pub const MAX_BALLOON_STATS_S: u32 = 3600;

/// A virtio-balloon device: the host sets a target with the control socket's `balloon` op.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BalloonConfig {
    /// Offer VIRTIO_BALLOON_F_DEFLATE_ON_OOM: the guest may take pages back under memory pressure.
    #[serde(default)]
    pub deflate_on_oom: bool,
    /// Ask the guest for memory statistics every this many seconds (0: no statistics queue).
    #[serde(default)]
    pub stats_interval_s: u32,
    /// Offer VIRTIO_BALLOON_F_REPORTING: the guest reports free pages, which the host drops.
    #[serde(default)]
    pub free_page_reporting: bool,
}

impl std::str::FromStr for BalloonConfig {
    type Err = FlagError;
    /// `[deflate-on-oom][,stats=SECS][,reporting]` (empty: a plain balloon).
    fn from_str(s: &str) -> Result<Self, FlagError> {
        let mut c = BalloonConfig::default();
        for part in s.split(',').filter(|p| !p.is_empty()) {
            match part.split_once('=') {
                None if part == "deflate-on-oom" => c.deflate_on_oom = true,
                None if part == "reporting" => c.free_page_reporting = true,
                Some(("stats", v)) => {
                    c.stats_interval_s = v
                        .parse()
                        .map_err(|_| FlagError::BalloonStats(v.to_string()))?;
                }
                _ => return Err(FlagError::BalloonOption(part.to_string())),
            }
        }
        Ok(c)
    }
}

impl std::fmt::Display for BalloonConfig {
    /// The `--balloon` flag value (empty for a plain balloon).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut parts = Vec::new();
        if self.deflate_on_oom {
            parts.push("deflate-on-oom".to_string());
        }
        if self.stats_interval_s != 0 {
            parts.push(format!("stats={}", self.stats_interval_s));
        }
        if self.free_page_reporting {
            parts.push("reporting".to_string());
        }
        f.write_str(&parts.join(","))
    }
}

/// A device flag value (`--drive`, `--pmem`, `--net`, `--balloon`) that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FlagError {
    #[error("unknown drive option `{0}`; use PATH or PATH,ro")]
    DriveOption(String),
    #[error("empty drive path; use PATH or PATH,ro")]
    DrivePath,
    #[error("unknown pmem option `{0}`; use PATH, PATH,ro or PATH,shared")]
    PmemOption(String),
    #[error("empty pmem path; use PATH, PATH,ro or PATH,shared")]
    PmemPath,
    #[error("unknown net option `{0}`; use tap=NAME[,mac=AA:BB:CC:DD:EE:FF]")]
    NetOption(String),
    #[error("missing tap=NAME; use tap=NAME[,mac=AA:BB:CC:DD:EE:FF]")]
    NetTap,
    #[error("balloon stats=`{0}` is not a number of seconds; use [deflate-on-oom][,stats=SECS][,reporting]")]
    BalloonStats(String),
    #[error("unknown balloon option `{0}`; use [deflate-on-oom][,stats=SECS][,reporting]")]
    BalloonOption(String),
}

/// Parses `aa:bb:cc:dd:ee:ff`.
pub fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let mut out = [0u8; 6];
    let mut parts = s.split(':');
    for b in &mut out {
        let p = parts.next()?;
        if p.len() != 2 {
            return None;
        }
        *b = u8::from_str_radix(p, 16).ok()?;
    }
    parts.next().is_none().then_some(out)
}

/// Most virtio-mmio devices one VM may have (IRQs 5..=20 stay below the IOAPIC's 24 pins).
pub const MAX_VIRTIO_DEVICES: usize = 16;

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
    /// virtio-rng device (entropy from the host's getrandom).
    #[serde(default)]
    pub rng: bool,
    /// virtio-blk disks; the guest sees them in this order (vda, vdb, ...).
    #[serde(default)]
    pub drives: Vec<DriveConfig>,
    /// virtio-net device on a tap.
    #[serde(default)]
    pub net: Option<NetConfig>,
    /// virtio-balloon device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub balloon: Option<BalloonConfig>,
    /// virtio-pmem devices (/dev/pmem0, /dev/pmem1, ... in this order).
    #[serde(default)]
    pub pmem: Vec<PmemConfig>,
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
/// Guest memory when none is given.
pub const DEFAULT_MEM_MIB: u64 = 256;

fn default_mem_mib() -> u64 {
    DEFAULT_MEM_MIB
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
    #[error("field `drives`: {path} does not exist or cannot be opened{mode} ({source})")]
    Drive {
        path: PathBuf,
        mode: &'static str,
        source: std::io::Error,
    },
    #[error("field `net.tap`: `{0}` is not a valid interface name (1-15 bytes, no `/`, `:` or whitespace)")]
    TapName(String),
    #[error("field `net.mac`: `{0}` is not a unicast MAC address like 06:00:ac:10:00:02")]
    Mac(String),
    #[error("field `balloon.stats_interval_s`: {0} s is too long; use 0 (no statistics) to {MAX_BALLOON_STATS_S}")]
    BalloonStats(u32),
    #[error("field `pmem`: {0}")]
    Pmem(PmemFileError),
    #[error(
        "field `pmem`: {0} is both read-only and shared; shared is for writable files, pick one"
    )]
    PmemMode(PathBuf),
    #[error("too many virtio devices ({0}); a VM has at most {MAX_VIRTIO_DEVICES} (vsock + rng + drives + net + balloon + pmem)")]
    TooManyDevices(usize),
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
            rng: false,
            drives: Vec::new(),
            net: None,
            balloon: None,
            pmem: Vec::new(),
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
        for d in &self.drives {
            std::fs::OpenOptions::new()
                .read(true)
                .write(!d.read_only)
                .open(&d.path)
                .map_err(|source| ConfigError::Drive {
                    path: d.path.clone(),
                    mode: if d.read_only {
                        ""
                    } else {
                        " for writing (add ,ro?)"
                    },
                    source,
                })?;
        }
        if let Some(net) = &self.net {
            net.validate()?;
        }
        if let Some(b) = &self.balloon {
            if b.stats_interval_s > MAX_BALLOON_STATS_S {
                return Err(ConfigError::BalloonStats(b.stats_interval_s));
            }
        }
        for p in &self.pmem {
            if p.read_only && p.shared {
                return Err(ConfigError::PmemMode(p.path.clone()));
            }
            check_pmem_file(&p.path, p.read_only).map_err(ConfigError::Pmem)?;
        }
        let n = usize::from(self.vsock.is_some())
            + usize::from(self.rng)
            + self.drives.len()
            + usize::from(self.net.is_some())
            + usize::from(self.balloon.is_some())
            + self.pmem.len();
        if n > MAX_VIRTIO_DEVICES {
            return Err(ConfigError::TooManyDevices(n));
        }
        Ok(())
    }
}

/// A pmem file's size must be a non-zero multiple of this (Linux hot-adds the window in
/// 2 MiB subsections).
pub const PMEM_ALIGN: u64 = 2 << 20;

/// Why a file cannot back a pmem device.
#[derive(Debug, thiserror::Error)]
pub enum PmemFileError {
    #[error("cannot open pmem file {path}{mode}: {source}")]
    Open {
        path: PathBuf,
        mode: &'static str,
        source: std::io::Error,
    },
    #[error("pmem file {0} is empty; it needs a non-zero size that is a multiple of 2 MiB")]
    Empty(PathBuf),
    #[error("pmem file {path} is {size} bytes, not a multiple of 2 MiB (the guest maps it in 2 MiB units); pad it, e.g. truncate -s {padded} {path}")]
    Unaligned {
        path: PathBuf,
        size: u64,
        padded: u64,
    },
}

/// Checks that `path` opens as a regular file (for writing unless `read_only`) whose size
/// can be a pmem window; returns the size.
pub fn check_pmem_file(path: &Path, read_only: bool) -> Result<u64, PmemFileError> {
    open_pmem_file(path, read_only).map(|(_, size)| size)
}

/// Opens `path` as a pmem file (for writing unless `read_only`): a regular file whose size
/// is a non-zero multiple of 2 MiB. Returns the file and its size.
pub fn open_pmem_file(path: &Path, read_only: bool) -> Result<(std::fs::File, u64), PmemFileError> {
    let open_err = |source| PmemFileError::Open {
        path: path.to_owned(),
        mode: if read_only {
            ""
        } else {
            " for writing (add ,ro?)"
        },
        source,
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(!read_only)
        .open(path)
        .map_err(open_err)?;
    let meta = file.metadata().map_err(open_err)?;
    if !meta.is_file() {
        return Err(open_err(std::io::Error::other("not a regular file")));
    }
    let size = meta.len();
    if size == 0 {
        return Err(PmemFileError::Empty(path.to_owned()));
    }
    if !size.is_multiple_of(PMEM_ALIGN) {
        return Err(PmemFileError::Unaligned {
            path: path.to_owned(),
            size,
            padded: size.div_ceil(PMEM_ALIGN) * PMEM_ALIGN,
        });
    }
    Ok((file, size))
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
    fn drive_and_net_flags_parse() {
        let d: DriveConfig = "/a/b.img,ro".parse().unwrap();
        assert_eq!(d.path, PathBuf::from("/a/b.img"));
        assert!(d.read_only);
        assert!(!"/x".parse::<DriveConfig>().unwrap().read_only);
        assert!("/x,rx".parse::<DriveConfig>().is_err());
        let n: NetConfig = "tap=tap0,mac=06:00:00:00:00:02".parse().unwrap();
        assert_eq!(n.mac_bytes(), [6, 0, 0, 0, 0, 2]);
        assert!("mac=06:00:00:00:00:02".parse::<NetConfig>().is_err());
        let n: NetConfig = "tap=tap0".parse().unwrap();
        assert_eq!(n.mac_bytes()[0], 0x06);
        let mut c = valid();
        c.net = Some("tap=tap0,mac=01:00:00:00:00:02".parse().unwrap());
        assert!(c.validate().unwrap_err().to_string().contains("net.mac"));
        c.net = Some("tap=a/b".parse().unwrap());
        assert!(c.validate().unwrap_err().to_string().contains("net.tap"));
        c.net = None;
        c.drives.push("/nonexistent.img".parse().unwrap());
        assert!(c.validate().unwrap_err().to_string().contains("`drives`"));
    }

    #[test]
    fn balloon_flag_and_json_parse() {
        let b: BalloonConfig = "".parse().unwrap();
        assert_eq!(b, BalloonConfig::default());
        let b: BalloonConfig = "deflate-on-oom,stats=5,reporting".parse().unwrap();
        assert!(b.deflate_on_oom && b.free_page_reporting && b.stats_interval_s == 5);
        let err = "stats=soon"
            .parse::<BalloonConfig>()
            .unwrap_err()
            .to_string();
        assert!(err.contains("stats=`soon`"), "{err}");
        let err = "inflate".parse::<BalloonConfig>().unwrap_err().to_string();
        assert!(err.contains("unknown balloon option `inflate`"), "{err}");
        let c: VmConfig = serde_json::from_str(
            r#"{"kernel":"/k","balloon":{"stats_interval_s":2,"free_page_reporting":true}}"#,
        )
        .unwrap();
        let b = c.balloon.unwrap();
        assert!(b.free_page_reporting && !b.deflate_on_oom && b.stats_interval_s == 2);
        let mut c = valid();
        c.balloon = Some(BalloonConfig {
            stats_interval_s: 100_000,
            ..Default::default()
        });
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("balloon.stats_interval_s"), "{err}");
    }

    #[test]
    fn old_configs_without_device_fields_load() {
        let c: VmConfig = serde_json::from_str(r#"{"kernel":"/k"}"#).unwrap();
        assert!(!c.rng && c.drives.is_empty() && c.net.is_none() && c.pmem.is_empty());
    }

    #[test]
    fn pmem_flag_parses_and_bad_files_are_named() {
        let p: PmemConfig = "/a/b.img,ro".parse().unwrap();
        assert!(p.read_only && !p.shared);
        let p: PmemConfig = "/a/b.img,shared".parse().unwrap();
        assert!(!p.read_only && p.shared);
        let p: PmemConfig = "/a/b.img".parse().unwrap();
        assert!(!p.read_only && !p.shared);
        assert!("/x,dax".parse::<PmemConfig>().is_err());
        assert!(",ro".parse::<PmemConfig>().is_err());
        let json: VmConfig =
            serde_json::from_str(r#"{"kernel":"/k","pmem":[{"path":"/p","read_only":true}]}"#)
                .unwrap();
        assert_eq!(json.pmem[0].path, PathBuf::from("/p"));
        let dir = std::env::temp_dir().join(format!("dsec-cfg-pmem-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut c = valid();
        let check = |c: &VmConfig, want: &[&str]| {
            let err = c.validate().unwrap_err().to_string();
            for w in want {
                assert!(err.contains(w), "{err} lacks {w}");
            }
        };
        c.pmem = vec![format!("{}/missing.img,ro", dir.display()).parse().unwrap()];
        check(&c, &["`pmem`", "missing.img"]);
        let empty = dir.join("empty.img");
        std::fs::write(&empty, b"").unwrap();
        c.pmem = vec![format!("{},ro", empty.display()).parse().unwrap()];
        check(&c, &["`pmem`", "empty"]);
        let odd = dir.join("odd.img");
        std::fs::File::create(&odd)
            .unwrap()
            .set_len(3 << 20)
            .unwrap();
        c.pmem = vec![format!("{},ro", odd.display()).parse().unwrap()];
        check(&c, &["`pmem`", "multiple of 2 MiB", "truncate -s 4194304"]);
        std::fs::File::create(&odd)
            .unwrap()
            .set_len(4 << 20)
            .unwrap();
        c.validate().unwrap();
        c.pmem[0].shared = true;
        check(&c, &["`pmem`", "read-only and shared"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn unknown_json_field_rejected() {
        let err = serde_json::from_str::<VmConfig>(r#"{"kernel":"/k","vcpu":2}"#).unwrap_err();
        assert!(err.to_string().contains("vcpu"), "{err}");
    }
}
