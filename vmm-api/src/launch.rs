//! How a `dsec-vmm` process is started: [`VmmLaunch`] is every mode of its command line as a
//! typed value. [`VmmLaunch::to_args`] renders it to argv and [`VmmLaunch::parse_from`] (what
//! the VMM's `main` runs) reads exactly that back; the round-trip tests keep the two in step.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use clap::Parser;

use crate::config::{
    BalloonConfig, DriveConfig, NetConfig, PmemConfig, SerialOutput, VmConfig, VsockConfig,
    MIN_GUEST_CID,
};

/// Everything one `dsec-vmm` process is started with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VmmLaunch {
    /// Boot, restore or prewarm.
    pub mode: LaunchMode,
    /// Serve the control socket here (`--api-sock`).
    pub api_sock: Option<PathBuf>,
    /// Do not start the vCPUs until a `resume` arrives (`--paused`; needs `api_sock`).
    pub paused: bool,
    /// Run jailed (`--jail ...`).
    pub jail: Option<JailLaunch>,
    /// Run without the per-thread seccomp filters (`--no-seccomp`; debugging only).
    pub no_seccomp: bool,
    /// Write run metrics as JSON here on exit (`--metrics-json`).
    pub metrics_json: Option<PathBuf>,
}

/// What the VMM does with its VM.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LaunchMode {
    /// Boot this configuration (rendered as flags).
    Boot(VmConfig),
    /// Boot the JSON config file `config`, with flags overriding its fields.
    BootFile {
        config: PathBuf,
        overrides: BootOverrides,
    },
    /// Restore a snapshot directory.
    Restore(RestoreLaunch),
    /// Create the VM shell now and restore the snapshot named by the first `restore` request
    /// on the control socket.
    Prewarm(PrewarmLaunch),
}

/// Flags that override fields of a config file (None / empty / false: keep the file's).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BootOverrides {
    pub kernel: Option<PathBuf>,
    pub initrd: Option<PathBuf>,
    pub cmdline: Option<String>,
    pub vcpus: Option<u8>,
    pub mem_mib: Option<u64>,
    /// Replaces the vsock device (guest CID `vsock_cid`, default 3).
    pub vsock_uds: Option<PathBuf>,
    pub vsock_cid: Option<u64>,
    pub rng: bool,
    pub drives: Vec<DriveConfig>,
    pub net: Option<NetConfig>,
    pub balloon: Option<BalloonConfig>,
    pub pmem: Vec<PmemConfig>,
    pub serial: Option<SerialOutput>,
}

impl BootOverrides {
    /// Applies the overrides to a config read from a file.
    pub fn apply(&self, config: &mut VmConfig) {
        if let Some(kernel) = &self.kernel {
            config.kernel = kernel.clone();
        }
        if let Some(initrd) = &self.initrd {
            config.initrd = Some(initrd.clone());
        }
        if let Some(cmdline) = &self.cmdline {
            config.cmdline = cmdline.clone();
        }
        if let Some(vcpus) = self.vcpus {
            config.vcpus = vcpus;
        }
        if let Some(mem) = self.mem_mib {
            config.mem_mib = mem;
        }
        if let Some(uds) = &self.vsock_uds {
            config.vsock = Some(VsockConfig {
                uds_path: uds.clone(),
                guest_cid: self.vsock_cid.unwrap_or(MIN_GUEST_CID),
            });
        }
        if self.rng {
            config.rng = true;
        }
        if !self.drives.is_empty() {
            config.drives = self.drives.clone();
        }
        if let Some(net) = &self.net {
            config.net = Some(net.clone());
        }
        if let Some(balloon) = &self.balloon {
            config.balloon = Some(balloon.clone());
        }
        if !self.pmem.is_empty() {
            config.pmem = self.pmem.clone();
        }
        if let Some(serial) = &self.serial {
            config.serial = serial.clone();
        }
    }
}

/// Restore a snapshot (`--restore DIR`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RestoreLaunch {
    pub snapshot: PathBuf,
    /// Fill memory lazily through userfaultfd (`--lazy ...`) instead of MAP_PRIVATE.
    pub lazy: Option<LazyLaunch>,
    /// What the restored VM takes instead of the snapshot's (a fork's own identity).
    pub overrides: SnapshotOverrides,
}

impl RestoreLaunch {
    /// A MAP_PRIVATE restore of `snapshot` that keeps everything the snapshot says.
    pub fn new(snapshot: impl Into<PathBuf>) -> Self {
        RestoreLaunch {
            snapshot: snapshot.into(),
            lazy: None,
            overrides: SnapshotOverrides::default(),
        }
    }
}

/// `--lazy [--prefetch] [--record-working-set MS]`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LazyLaunch {
    /// Load the snapshot's recorded working set in the background.
    pub prefetch: bool,
    /// Record the pages touched in the first this many milliseconds as the working set.
    pub record_working_set_ms: Option<u64>,
}

/// What a restored (or prewarmed) VM gets instead of its snapshot's settings.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SnapshotOverrides {
    pub vsock_uds: Option<PathBuf>,
    pub vsock_cid: Option<u64>,
    pub net: Option<NetConfig>,
    /// One per snapshot disk, in order (same read-only flags and sizes).
    pub drives: Vec<DriveConfig>,
    /// None keeps the snapshot's console; `Sink` cannot be asked for here (it is the same as
    /// None on the command line).
    pub serial: Option<SerialOutput>,
    /// Refuse a diff chain whose parents are not inside the snapshot's own directory (a
    /// relative path without `..`): a VMM wrote the snapshot, and a parent it named elsewhere
    /// would show this VM another sandbox's memory.
    pub contained_chain: bool,
}

/// `--prewarm`: build the VM shell ahead, restore on request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrewarmLaunch {
    pub mem_mib: u64,
    pub vcpus: u8,
    /// Defaults for the restore; the request's own fields win.
    pub overrides: SnapshotOverrides,
}

/// How the VMM jails itself (`--jail DIR ...`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JailLaunch {
    /// Jail root (created if missing).
    pub root: PathBuf,
    pub uid: u32,
    pub gid: u32,
    /// Join this network namespace instead of a new, empty one.
    pub netns: Option<PathBuf>,
    /// Extra paths visible in the jail, besides the ones the VM's config names.
    pub expose: Vec<Exposure>,
    /// (Tests) report whether this path opens once jailed, then make a forbidden call.
    pub check: Option<PathBuf>,
}

/// The unprivileged uid/gid a jailed VMM runs as by default (`nobody`).
pub const DEFAULT_JAIL_ID: u32 = 65534;

impl JailLaunch {
    /// A jail at `root` as `uid`:`gid`, with a new network namespace and nothing extra.
    pub fn new(root: impl Into<PathBuf>, uid: u32, gid: u32) -> Self {
        JailLaunch {
            root: root.into(),
            uid,
            gid,
            netns: None,
            expose: Vec::new(),
            check: None,
        }
    }
}

/// A host path made visible inside the jail at the same path (`PATH[,rw]`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exposure {
    pub path: PathBuf,
    pub writable: bool,
}

impl std::str::FromStr for Exposure {
    type Err = std::convert::Infallible;
    /// `PATH` or `PATH,rw`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s.strip_suffix(",rw") {
            Some(path) => Exposure {
                path: path.into(),
                writable: true,
            },
            None => Exposure {
                path: s.into(),
                writable: false,
            },
        })
    }
}

/// A command line that parses but names no VM to run.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("no kernel given: pass --kernel PATH or --config FILE")]
    NoKernel,
    #[error(transparent)]
    Usage(#[from] clap::Error),
}

/// The VMM's command line as clap sees it; [`VmmLaunch`] is its typed form.
#[derive(Parser, Debug)]
#[command(
    name = "dsec-vmm",
    version,
    about = "DSec microVM monitor: one VM per process"
)]
pub struct VmmArgs {
    /// JSON config file; flags given here override its fields.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Restore from a snapshot directory instead of booting (vsock, net and serial flags
    /// override the snapshot's, giving a fork its own identity).
    #[arg(long, conflicts_with_all = ["config", "kernel", "initrd", "cmdline", "vcpus", "mem_mib", "rng", "balloon", "pmem"])]
    restore: Option<PathBuf>,
    /// Serve the control socket (pause, resume, snapshot, stop) here.
    #[arg(long)]
    api_sock: Option<PathBuf>,
    /// With --restore: fill memory lazily through userfaultfd instead of MAP_PRIVATE.
    #[arg(long, requires = "restore")]
    lazy: bool,
    /// With --lazy: load the snapshot's recorded working set in the background.
    #[arg(long, requires = "lazy")]
    prefetch: bool,
    /// With --lazy: record the pages touched in the first MS milliseconds as the
    /// snapshot's working set (for --prefetch next time).
    #[arg(long, requires = "lazy", value_name = "MS")]
    record_working_set: Option<u64>,
    /// Create the VM (memory slots, irqchip, vCPUs) now, with --mem-mib/--vcpus, and wait on
    /// --api-sock for `{"op":"restore","path":DIR[,"vsock_uds":P,"vsock_cid":N,"lazy":true]}`:
    /// a pool of these restores snapshots without paying for KVM setup.
    #[arg(long, requires = "api_sock", conflicts_with_all = ["restore", "kernel", "config"])]
    prewarm: bool,
    /// Do not start the vCPUs until a `resume` arrives on the control socket.
    #[arg(long, requires = "api_sock")]
    paused: bool,
    /// Guest kernel: uncompressed ELF vmlinux (PVH) or bzImage.
    #[arg(long)]
    kernel: Option<PathBuf>,
    /// Initramfs to load.
    #[arg(long)]
    initrd: Option<PathBuf>,
    /// Kernel command line (the VMM appends its device declarations).
    #[arg(long)]
    cmdline: Option<String>,
    /// Number of vCPUs (1-32).
    #[arg(long)]
    vcpus: Option<u8>,
    /// Guest memory in MiB.
    #[arg(long)]
    mem_mib: Option<u64>,
    /// Host Unix socket for the vsock device.
    #[arg(long)]
    vsock_uds: Option<PathBuf>,
    /// Guest vsock context id (default 3).
    #[arg(long)]
    vsock_cid: Option<u64>,
    /// Add a virtio-rng device (entropy from the host's getrandom).
    #[arg(long)]
    rng: bool,
    /// Add a virtio-blk disk: raw image PATH, `,ro` for read-only. Repeat for more disks;
    /// the guest sees them in this order. Replaces the config file's drives. With --restore:
    /// replaces the snapshot's disks, one per disk in order, same ,ro flags and sizes (a
    /// fork's own copy of a writable disk).
    #[arg(long = "drive", value_name = "PATH[,ro]")]
    drives: Vec<DriveConfig>,
    /// Add a virtio-pmem device: host file PATH (size a multiple of 2 MiB) mapped into guest
    /// memory (/dev/pmemN); `,ro` read-only (VMs share its pages), `,shared` writable by
    /// several VMs at once. Repeat for more. Replaces the config file's pmem list.
    #[arg(long = "pmem", value_name = "PATH[,ro|,shared]")]
    pmem: Vec<PmemConfig>,
    /// With --restore or --prewarm: refuse a diff chain whose parents are not inside the
    /// snapshot's directory (relative, no `..`).
    #[arg(long)]
    contained_chain: bool,
    /// Add a virtio-net device on a tap: `tap=NAME[,mac=AA:BB:CC:DD:EE:FF]`.
    #[arg(long, value_name = "tap=NAME[,mac=MAC]")]
    net: Option<NetConfig>,
    /// Add a virtio-balloon device: `--balloon` or `--balloon deflate-on-oom,stats=SECS,reporting`
    /// (any subset; the control socket's `balloon` op sets the target and reads statistics).
    #[arg(long, value_name = "[deflate-on-oom][,stats=SECS][,reporting]", num_args = 0..=1, default_missing_value = "")]
    balloon: Option<BalloonConfig>,
    /// Append the serial console to this file.
    #[arg(long, conflicts_with = "serial_stdout")]
    serial_log: Option<PathBuf>,
    /// Copy the serial console to standard output.
    #[arg(long)]
    serial_stdout: bool,
    /// Run in a jail rooted at DIR (created if missing): new PID, mount, IPC, UTS and network
    /// namespaces, only the VM's own files bind-mounted in at their usual paths, /dev/kvm
    /// and /dev/net/tun, rlimits, and --jail-uid/--jail-gid once the VM is built.
    #[arg(long, value_name = "DIR")]
    jail: Option<PathBuf>,
    /// Unprivileged uid the jailed VMM runs the guest as.
    #[arg(long, default_value_t = DEFAULT_JAIL_ID, requires = "jail")]
    jail_uid: u32,
    #[arg(long, default_value_t = DEFAULT_JAIL_ID, requires = "jail")]
    jail_gid: u32,
    /// Join this network namespace (e.g. /run/netns/sb1) instead of a new, empty one.
    #[arg(long, value_name = "PATH", requires = "jail")]
    jail_netns: Option<PathBuf>,
    /// Also make PATH visible in the jail (read-only; `,rw` for writable), e.g. where
    /// snapshots are written or, for --prewarm, where they are read from.
    #[arg(long = "jail-expose", value_name = "PATH[,rw]", requires = "jail")]
    jail_expose: Vec<Exposure>,
    /// (Tests) once jailed and filtered, report whether PATH can be opened, then make a
    /// forbidden system call.
    #[arg(long, value_name = "PATH", requires = "jail", hide = true)]
    jail_check: Option<PathBuf>,
    /// Run without the per-thread seccomp filters (for debugging a filter that is too strict:
    /// a forbidden call stops the VMM with exit status 159 and names the syscall).
    #[arg(long)]
    no_seccomp: bool,
    /// Write run metrics (exit reason, VM exits, boot milestones) as JSON here on exit.
    #[arg(long)]
    metrics_json: Option<PathBuf>,
}

impl VmmArgs {
    fn serial(&self) -> Option<SerialOutput> {
        match (&self.serial_log, self.serial_stdout) {
            (Some(path), _) => Some(SerialOutput::File(path.clone())),
            (None, true) => Some(SerialOutput::Stdout),
            (None, false) => None,
        }
    }

    fn boot_overrides(&self) -> BootOverrides {
        BootOverrides {
            kernel: self.kernel.clone(),
            initrd: self.initrd.clone(),
            cmdline: self.cmdline.clone(),
            vcpus: self.vcpus,
            mem_mib: self.mem_mib,
            vsock_uds: self.vsock_uds.clone(),
            vsock_cid: self.vsock_cid,
            rng: self.rng,
            drives: self.drives.clone(),
            net: self.net.clone(),
            balloon: self.balloon.clone(),
            pmem: self.pmem.clone(),
            serial: self.serial(),
        }
    }

    fn snapshot_overrides(&self) -> SnapshotOverrides {
        SnapshotOverrides {
            vsock_uds: self.vsock_uds.clone(),
            vsock_cid: self.vsock_cid,
            net: self.net.clone(),
            drives: self.drives.clone(),
            serial: self.serial(),
            contained_chain: self.contained_chain,
        }
    }
}

impl TryFrom<VmmArgs> for VmmLaunch {
    type Error = LaunchError;

    fn try_from(args: VmmArgs) -> Result<Self, LaunchError> {
        let mode = match (&args.restore, args.prewarm, &args.config, &args.kernel) {
            (Some(snapshot), ..) => LaunchMode::Restore(RestoreLaunch {
                snapshot: snapshot.clone(),
                lazy: args.lazy.then_some(LazyLaunch {
                    prefetch: args.prefetch,
                    record_working_set_ms: args.record_working_set,
                }),
                overrides: args.snapshot_overrides(),
            }),
            (None, true, ..) => LaunchMode::Prewarm(PrewarmLaunch {
                mem_mib: args.mem_mib.unwrap_or(crate::config::DEFAULT_MEM_MIB),
                vcpus: args.vcpus.unwrap_or(1),
                overrides: args.snapshot_overrides(),
            }),
            (None, false, Some(config), _) => LaunchMode::BootFile {
                config: config.clone(),
                overrides: args.boot_overrides(),
            },
            (None, false, None, Some(kernel)) => {
                let mut config = VmConfig::new(kernel);
                args.boot_overrides().apply(&mut config);
                LaunchMode::Boot(config)
            }
            (None, false, None, None) => return Err(LaunchError::NoKernel),
        };
        Ok(VmmLaunch {
            mode,
            api_sock: args.api_sock,
            paused: args.paused,
            jail: args.jail.map(|root| JailLaunch {
                root,
                uid: args.jail_uid,
                gid: args.jail_gid,
                netns: args.jail_netns,
                expose: args.jail_expose,
                check: args.jail_check,
            }),
            no_seccomp: args.no_seccomp,
            metrics_json: args.metrics_json,
        })
    }
}

/// argv under construction.
#[derive(Default)]
struct Argv(Vec<OsString>);

impl Argv {
    fn flag(&mut self, name: &str) {
        self.0.push(name.into());
    }

    fn value(&mut self, name: &str, value: impl Into<OsString>) {
        self.0.push(name.into());
        self.0.push(value.into());
    }

    fn path(&mut self, name: &str, path: &Path) {
        self.value(name, path.as_os_str());
    }

    fn opt_path(&mut self, name: &str, path: &Option<PathBuf>) {
        if let Some(path) = path {
            self.path(name, path);
        }
    }

    /// `PATH,SUFFIX` (always with a suffix, so a comma inside PATH is never mistaken for one).
    fn suffixed(&mut self, name: &str, path: &Path, suffix: &str) {
        let mut v = path.as_os_str().to_owned();
        v.push(",");
        v.push(suffix);
        self.value(name, v);
    }

    fn drives(&mut self, drives: &[DriveConfig]) {
        for d in drives {
            self.suffixed("--drive", &d.path, if d.read_only { "ro" } else { "rw" });
        }
    }

    fn pmem(&mut self, pmem: &[PmemConfig]) {
        for p in pmem {
            let mode = match (p.read_only, p.shared) {
                (true, _) => "ro",
                (false, true) => "shared",
                (false, false) => "rw",
            };
            self.suffixed("--pmem", &p.path, mode);
        }
    }

    fn balloon(&mut self, balloon: &Option<BalloonConfig>) {
        if let Some(b) = balloon {
            // `=` form: the value may be empty (a plain balloon).
            self.0.push(format!("--balloon={b}").into());
        }
    }

    fn serial(&mut self, serial: &Option<SerialOutput>) {
        match serial {
            Some(SerialOutput::File(path)) => self.path("--serial-log", path),
            Some(SerialOutput::Stdout) => self.flag("--serial-stdout"),
            Some(SerialOutput::Sink) | None => {}
        }
    }

    fn snapshot_overrides(&mut self, o: &SnapshotOverrides) {
        self.opt_path("--vsock-uds", &o.vsock_uds);
        if let Some(cid) = o.vsock_cid {
            self.value("--vsock-cid", cid.to_string());
        }
        if let Some(net) = &o.net {
            self.value("--net", net.to_string());
        }
        self.drives(&o.drives);
        self.serial(&o.serial);
        if o.contained_chain {
            self.flag("--contained-chain");
        }
    }

    fn boot(&mut self, c: &VmConfig) {
        self.path("--kernel", &c.kernel);
        self.opt_path("--initrd", &c.initrd);
        self.value("--cmdline", c.cmdline.as_str());
        self.value("--vcpus", c.vcpus.to_string());
        self.value("--mem-mib", c.mem_mib.to_string());
        if let Some(v) = &c.vsock {
            self.path("--vsock-uds", &v.uds_path);
            self.value("--vsock-cid", v.guest_cid.to_string());
        }
        if c.rng {
            self.flag("--rng");
        }
        self.drives(&c.drives);
        if let Some(net) = &c.net {
            self.value("--net", net.to_string());
        }
        self.balloon(&c.balloon);
        self.pmem(&c.pmem);
        self.serial(&Some(c.serial.clone()));
    }

    fn boot_overrides(&mut self, o: &BootOverrides) {
        self.opt_path("--kernel", &o.kernel);
        self.opt_path("--initrd", &o.initrd);
        if let Some(cmdline) = &o.cmdline {
            self.value("--cmdline", cmdline.as_str());
        }
        if let Some(vcpus) = o.vcpus {
            self.value("--vcpus", vcpus.to_string());
        }
        if let Some(mem) = o.mem_mib {
            self.value("--mem-mib", mem.to_string());
        }
        self.opt_path("--vsock-uds", &o.vsock_uds);
        if let Some(cid) = o.vsock_cid {
            self.value("--vsock-cid", cid.to_string());
        }
        if o.rng {
            self.flag("--rng");
        }
        self.drives(&o.drives);
        if let Some(net) = &o.net {
            self.value("--net", net.to_string());
        }
        self.balloon(&o.balloon);
        self.pmem(&o.pmem);
        self.serial(&o.serial);
    }
}

impl VmmLaunch {
    /// A launch of `mode` with nothing else (no control socket, no jail, seccomp on).
    pub fn new(mode: LaunchMode) -> Self {
        VmmLaunch {
            mode,
            api_sock: None,
            paused: false,
            jail: None,
            no_seccomp: false,
            metrics_json: None,
        }
    }

    /// Boots `config`.
    pub fn boot(config: VmConfig) -> Self {
        Self::new(LaunchMode::Boot(config))
    }

    /// Restores a snapshot.
    pub fn restore(restore: RestoreLaunch) -> Self {
        Self::new(LaunchMode::Restore(restore))
    }

    /// Parses a `dsec-vmm` command line (`argv[0]` first).
    pub fn parse_from<I, T>(argv: I) -> Result<Self, LaunchError>
    where
        I: IntoIterator<Item = T>,
        T: Into<OsString> + Clone,
    {
        VmmArgs::try_parse_from(argv)?.try_into()
    }

    /// The arguments (without `argv[0]`) that make `dsec-vmm` do exactly this.
    pub fn to_args(&self) -> Vec<OsString> {
        let mut a = Argv::default();
        match &self.mode {
            LaunchMode::Boot(config) => a.boot(config),
            LaunchMode::BootFile { config, overrides } => {
                a.path("--config", config);
                a.boot_overrides(overrides);
            }
            LaunchMode::Restore(r) => {
                a.path("--restore", &r.snapshot);
                if let Some(lazy) = &r.lazy {
                    a.flag("--lazy");
                    if lazy.prefetch {
                        a.flag("--prefetch");
                    }
                    if let Some(ms) = lazy.record_working_set_ms {
                        a.value("--record-working-set", ms.to_string());
                    }
                }
                a.snapshot_overrides(&r.overrides);
            }
            LaunchMode::Prewarm(p) => {
                a.flag("--prewarm");
                a.value("--mem-mib", p.mem_mib.to_string());
                a.value("--vcpus", p.vcpus.to_string());
                a.snapshot_overrides(&p.overrides);
            }
        }
        a.opt_path("--api-sock", &self.api_sock);
        if self.paused {
            a.flag("--paused");
        }
        if let Some(j) = &self.jail {
            a.path("--jail", &j.root);
            a.value("--jail-uid", j.uid.to_string());
            a.value("--jail-gid", j.gid.to_string());
            a.opt_path("--jail-netns", &j.netns);
            for e in &j.expose {
                if e.writable {
                    a.suffixed("--jail-expose", &e.path, "rw");
                } else {
                    a.path("--jail-expose", &e.path);
                }
            }
            a.opt_path("--jail-check", &j.check);
        }
        if self.no_seccomp {
            a.flag("--no-seccomp");
        }
        a.opt_path("--metrics-json", &self.metrics_json);
        a.0
    }

    /// The snapshot overrides of a restore or prewarm launch.
    pub fn snapshot_overrides_mut(&mut self) -> Option<&mut SnapshotOverrides> {
        match &mut self.mode {
            LaunchMode::Restore(r) => Some(&mut r.overrides),
            LaunchMode::Prewarm(p) => Some(&mut p.overrides),
            LaunchMode::Boot(_) | LaunchMode::BootFile { .. } => None,
        }
    }
}

#[cfg(test)]
mod tests;
