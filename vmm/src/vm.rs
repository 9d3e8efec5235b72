//! A VM: built from a [`VmConfig`] or restored from a snapshot, run by vCPU threads, paused,
//! snapshotted and resumed through [`Vm`]'s methods (the control socket calls them).

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvm_bindings::{
    kvm_irqchip, kvm_pit_config, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE,
    KVM_MAX_CPUID_ENTRIES, KVM_PIT_SPEAKER_DUMMY,
};
use kvm_ioctls::{Kvm, VmFd};
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

use crate::arch::{boot, cpu, layout, mptable};
use crate::config::{ConfigError, NetConfig, SerialOutput, VmConfig};
use crate::devices::bus::{lock, Bus};
use crate::devices::legacy::{Cmos, Serial, SerialSink, I8042};
use crate::devices::virtio::balloon::BalloonControl;
use crate::devices::virtio::mmio::MmioTransport;
use crate::devices::virtio::slots;
use crate::memory::{self, DumpPages, GuestMemory, RegionLayout, PAGE_SIZE};
use crate::snapshot::{self, DevicesState, MemoryState, Persist, SnapshotError, VmState};
use crate::uffd::{self, UffdHandler};
use crate::vcpu::{self, VcpuHandle, VcpuStats};

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

/// Why a VM could not be built, run, paused or snapshotted.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cannot open /dev/kvm: {0}; check that KVM is loaded and that you may use /dev/kvm")]
    OpenKvm(kvm_ioctls::Error),
    #[error("KVM API version is {0}, expected 12")]
    KvmApi(i32),
    #[error("KVM refused to {what}: {source}")]
    Kvm {
        what: &'static str,
        source: kvm_ioctls::Error,
    },
    #[error(transparent)]
    Memory(#[from] memory::MemoryError),
    #[error(transparent)]
    Boot(#[from] boot::BootError),
    #[error(transparent)]
    Cpu(#[from] cpu::CpuError),
    #[error(transparent)]
    Mptable(#[from] mptable::MptableError),
    #[error("cannot open serial log {path}: {source}")]
    SerialLog {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot set up the vsock device: {0}")]
    Vsock(std::io::Error),
    #[error("device setup failed: {0}")]
    Device(String),
    #[error("cannot start vCPU thread: {0}")]
    Thread(std::io::Error),
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    #[error("{0}")]
    State(String),
}

fn kvm_err(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VmError {
    move |source| VmError::Kvm { what, source }
}

/// Wall-clock timestamps (ns since the Unix epoch) of boot milestones, for the perf harness.
#[derive(Default)]
pub struct BootTimes {
    pub first_kvm_run_ns: AtomicU64,
    pub first_serial_byte_ns: AtomicU64,
}

pub fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// What a finished run reports.
pub struct RunReport {
    pub reason: VmExitReason,
    pub exits: u64,
    pub first_kvm_run_ns: u64,
    pub first_serial_byte_ns: u64,
}

/// Records the time of the first console byte, then passes bytes through.
struct TimedSink {
    inner: SerialSink,
    times: Arc<BootTimes>,
}

impl std::io::Write for TimedSink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let _ = self.times.first_serial_byte_ns.compare_exchange(
            0,
            now_ns(),
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
        self.inner.write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

fn serial_sink(output: &SerialOutput, times: &Arc<BootTimes>) -> Result<SerialSink, VmError> {
    let inner: SerialSink = match output {
        SerialOutput::Sink => Box::new(std::io::sink()),
        SerialOutput::Stdout => Box::new(std::io::stdout()),
        SerialOutput::File(path) => Box::new(
            OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(|source| VmError::SerialLog {
                    path: path.clone(),
                    source,
                })?,
        ),
    };
    Ok(Box::new(TimedSink {
        inner,
        times: times.clone(),
    }))
}

/// Host-side settings a restored VM takes instead of the snapshot's (a fork's identity),
/// and how its memory is brought back.
#[derive(Clone, Debug, Default)]
pub struct RestoreOverrides {
    pub vsock_uds: Option<PathBuf>,
    pub vsock_cid: Option<u64>,
    pub serial: Option<SerialOutput>,
    /// A new tap (and MAC) for the snapshot's network device: a fork's own link.
    pub net: Option<NetConfig>,
    /// Fill memory lazily through userfaultfd instead of mapping the file MAP_PRIVATE.
    pub lazy: Option<LazyRestore>,
    /// Replacements for the snapshot's disks, one per disk in order (empty: keep them): a
    /// fork's own copy of a writable disk.
    pub drives: Vec<crate::config::DriveConfig>,
}

/// Swaps a snapshot's disks for `new` ones the guest cannot tell apart from them: as many,
/// in the same order, with the same read-only flags and (where the old file still exists)
/// the same size.
fn replace_drives(
    own: &mut Vec<crate::config::DriveConfig>,
    new: &[crate::config::DriveConfig],
) -> Result<(), VmError> {
    if own.len() != new.len() {
        return Err(VmError::State(format!(
            "the snapshot has {} disk(s) but {} replacement(s) were given; give one per disk, in order",
            own.len(),
            new.len()
        )));
    }
    for (i, (old, new)) in own.iter().zip(new).enumerate() {
        if old.read_only != new.read_only {
            return Err(VmError::State(format!(
                "disk {i} ({}) is {} in the snapshot but its replacement {} is not; keep the same ,ro flags",
                old.path.display(),
                if old.read_only { "read-only" } else { "writable" },
                new.path.display()
            )));
        }
        let size = |p: &Path| std::fs::metadata(p).map(|m| m.len()).ok();
        if let (Some(a), Some(b)) = (size(&old.path), size(&new.path)) {
            if a != b {
                return Err(VmError::State(format!(
                    "disk {i}: replacement {} has {b} bytes but the snapshot's {} has {a}; the guest would see another disk",
                    new.path.display(),
                    old.path.display()
                )));
            }
        }
    }
    *own = new.to_vec();
    Ok(())
}

/// Lazy (userfaultfd) restore settings.
#[derive(Clone, Debug, Default)]
pub struct LazyRestore {
    /// Load the snapshot's recorded working set (`<dir>/working-set`) in the background.
    pub prefetch: bool,
    /// Record the pages touched in this window after start into `<dir>/working-set`.
    pub record: Option<Duration>,
}

/// Where a recorded working set lives in a snapshot directory.
pub const WORKING_SET_FILE: &str = "working-set";

pub struct Vm {
    config: VmConfig,
    kvm: Kvm,
    fd: VmFd,
    mem: GuestMemory,
    regions: Vec<RegionLayout>,
    serial: Arc<Mutex<Serial>>,
    vsock: Option<Arc<Mutex<MmioTransport>>>,
    virtio: Vec<Arc<Mutex<MmioTransport>>>,
    pio: Arc<Bus>,
    mmio: Arc<Bus>,
    vcpus: Vec<VcpuHandle>,
    exit_tx: Sender<VmExitReason>,
    exit_rx: Mutex<Receiver<VmExitReason>>,
    stats: Arc<VcpuStats>,
    times: Arc<BootTimes>,
    /// Set once a full snapshot exists: later snapshots may be diffs against it.
    dirty_logging: AtomicBool,
    last_snapshot: Mutex<Option<PathBuf>>,
    /// Serves page faults of a lazily restored VM; stops when the VM is dropped.
    uffd: Option<UffdHandler>,
    /// The balloon's control handle (target, statistics), when configured.
    balloon: Option<Arc<BalloonControl>>,
}

struct Devices {
    serial: Arc<Mutex<Serial>>,
    vsock: Option<Arc<Mutex<MmioTransport>>>,
    /// Every virtio device (vsock included) in slot order.
    virtio: Vec<Arc<Mutex<MmioTransport>>>,
    pio: Arc<Bus>,
    mmio: Arc<Bus>,
    balloon: Option<Arc<BalloonControl>>,
}

fn open_kvm() -> Result<Kvm, VmError> {
    let kvm = Kvm::new().map_err(VmError::OpenKvm)?;
    let api = kvm.get_api_version();
    if api != 12 {
        return Err(VmError::KvmApi(api));
    }
    Ok(kvm)
}

fn create_vm_fd(kvm: &Kvm) -> Result<VmFd, VmError> {
    let vm = kvm.create_vm().map_err(kvm_err("create a VM"))?;
    // Not every host needs these (SVM ignores the TSS); failures are not fatal.
    if let Err(e) = vm.set_tss_address(layout::KVM_TSS_ADDR as usize) {
        tracing::debug!("set_tss_address: {e}");
    }
    if let Err(e) = vm.set_identity_map_address(layout::KVM_IDENTITY_MAP_ADDR) {
        tracing::debug!("set_identity_map_address: {e}");
    }
    vm.create_irq_chip()
        .map_err(kvm_err("create the in-kernel interrupt controller"))?;
    let pit = kvm_pit_config {
        flags: KVM_PIT_SPEAKER_DUMMY,
        ..Default::default()
    };
    vm.create_pit2(pit).map_err(kvm_err("create the PIT"))?;
    Ok(vm)
}

impl Vm {
    /// Builds a VM ready to boot `config.kernel`; call [`Vm::start`] to run it.
    pub fn new(config: VmConfig) -> Result<Vm, VmError> {
        config.validate()?;
        let kvm = open_kvm()?;
        let fd = create_vm_fd(&kvm)?;
        let mem_bytes = config.mem_mib << 20;
        let regions = memory::layout_for(mem_bytes);
        let mem = memory::anonymous(mem_bytes)?;
        memory::register(&fd, &mem, false)?;
        let (exit_tx, exit_rx) = channel();
        let times = Arc::new(BootTimes::default());
        let sink = serial_sink(&config.serial, &times)?;
        let devices = build_devices(&config, &fd, &mem, &exit_tx, sink, None)?;
        let cmdline = kernel_cmdline(&config);
        let boot_info = boot::load(
            &mem,
            mem_bytes,
            &config.kernel,
            config.initrd.as_deref(),
            &cmdline,
        )?;
        mptable::setup(&mem, config.vcpus)?;
        let base_cpuid = kvm
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(kvm_err("report supported CPUID"))?;
        let mut vm = Vm::assemble(
            config, kvm, fd, mem, regions, devices, exit_tx, exit_rx, times,
        );
        for id in 0..vm.config.vcpus {
            let vcpu = vm
                .fd
                .create_vcpu(u64::from(id))
                .map_err(kvm_err("create a vCPU"))?;
            cpu::setup_cpuid(&vcpu, &base_cpuid, id, vm.config.vcpus)?;
            cpu::setup_msrs(&vcpu)?;
            cpu::setup_sregs(&vm.mem, &vcpu, boot_info.mode)?;
            cpu::setup_regs(&vcpu, boot_info.mode, boot_info.entry)?;
            cpu::setup_fpu(&vcpu)?;
            cpu::setup_lapic(&vcpu)?;
            vm.spawn_vcpu(id, vcpu, true)?;
        }
        Ok(vm)
    }

    #[allow(clippy::too_many_arguments)]
    fn assemble(
        config: VmConfig,
        kvm: Kvm,
        fd: VmFd,
        mem: GuestMemory,
        regions: Vec<RegionLayout>,
        devices: Devices,
        exit_tx: Sender<VmExitReason>,
        exit_rx: Receiver<VmExitReason>,
        times: Arc<BootTimes>,
    ) -> Vm {
        Vm {
            config,
            kvm,
            fd,
            mem,
            regions,
            serial: devices.serial,
            vsock: devices.vsock,
            virtio: devices.virtio,
            pio: devices.pio,
            mmio: devices.mmio,
            vcpus: Vec::new(),
            exit_tx,
            exit_rx: Mutex::new(exit_rx),
            stats: Arc::new(VcpuStats::default()),
            times,
            dirty_logging: AtomicBool::new(false),
            last_snapshot: Mutex::new(None),
            uffd: None,
            balloon: devices.balloon,
        }
    }

    fn spawn_vcpu(&mut self, id: u8, fd: kvm_ioctls::VcpuFd, paused: bool) -> Result<(), VmError> {
        let handle = vcpu::spawn(vcpu::VcpuContext {
            id,
            fd,
            pio: self.pio.clone(),
            mmio: self.mmio.clone(),
            exit: self.exit_tx.clone(),
            stats: self.stats.clone(),
            times: self.times.clone(),
            start_paused: paused,
        })
        .map_err(VmError::Thread)?;
        self.vcpus.push(handle);
        Ok(())
    }

    /// Restores a VM from a snapshot directory (and its diff chain). It starts paused.
    pub fn restore(dir: &Path, overrides: &RestoreOverrides) -> Result<Vm, VmError> {
        Vm::restore_into(None, dir, overrides)
    }

    /// Restores into `shell` when given: its VM, memory slots and vCPUs already exist, so only
    /// the snapshot's state is loaded (the KVM setup is what dominates a restore).
    pub fn restore_into(
        shell: Option<Prewarmed>,
        dir: &Path,
        overrides: &RestoreOverrides,
    ) -> Result<Vm, VmError> {
        let state = snapshot::read_state(dir)?;
        let mut config = state.config.clone();
        if let Some(vsock) = config.vsock.as_mut() {
            if let Some(uds) = &overrides.vsock_uds {
                vsock.uds_path = uds.clone();
            }
            if let Some(cid) = overrides.vsock_cid {
                vsock.guest_cid = cid;
            }
        }
        if let Some(serial) = &overrides.serial {
            config.serial = serial.clone();
        }
        if !overrides.drives.is_empty() {
            replace_drives(&mut config.drives, &overrides.drives)?;
        }
        if let Some(net) = &overrides.net {
            net.validate()?;
            match config.net.as_mut() {
                Some(own) => *own = net.clone(),
                None => {
                    return Err(VmError::State(format!(
                        "the snapshot has no network device, so tap `{}` cannot be attached; drop the net override",
                        net.tap
                    )))
                }
            }
        }
        let (kvm, fd, shell_mem, mut shell_vcpus) = match shell {
            Some(p) => {
                if p.mem_mib != state.config.mem_mib
                    || p.vcpus.len() != usize::from(state.config.vcpus)
                {
                    return Err(VmError::State(format!(
                        "prewarmed VM has {} MiB and {} vCPUs; the snapshot needs {} MiB and {}",
                        p.mem_mib,
                        p.vcpus.len(),
                        state.config.mem_mib,
                        state.config.vcpus
                    )));
                }
                (p.kvm, p.fd, Some(p.mem), p.vcpus)
            }
            None => {
                let kvm = open_kvm()?;
                let fd = create_vm_fd(&kvm)?;
                (kvm, fd, None, Vec::new())
            }
        };
        let prewarmed = shell_mem.is_some();
        let (mem, uffd) = match &overrides.lazy {
            None => (restore_memory(dir, &state, shell_mem)?, None),
            Some(lazy) => {
                let (mem, handler) = restore_memory_lazily(dir, &state, lazy, shell_mem)?;
                (mem, Some(handler))
            }
        };
        if !prewarmed {
            memory::register(&fd, &mem, false)?;
        }
        let (exit_tx, exit_rx) = channel();
        let times = Arc::new(BootTimes::default());
        let sink = serial_sink(&config.serial, &times)?;
        // In-kernel interrupt controllers before the devices: a device that raises an
        // interrupt as it comes back (vsock announcing the transport reset) must not have it
        // wiped by restoring the controller state afterwards.
        for chip in &state.irqchips {
            fd.set_irqchip(chip)
                .map_err(kvm_err("restore the interrupt controller"))?;
        }
        let mut clock = state.clock;
        clock.flags = 0;
        fd.set_clock(&clock)
            .map_err(kvm_err("restore the guest clock"))?;
        let devices = build_devices(&config, &fd, &mem, &exit_tx, sink, Some(&state.devices))?;
        let regions = state.memory.regions.clone();
        let mut vm = Vm::assemble(
            config, kvm, fd, mem, regions, devices, exit_tx, exit_rx, times,
        );
        vm.uffd = uffd;
        if state.vcpus.len() != usize::from(vm.config.vcpus) {
            return Err(VmError::State(
                "snapshot vCPU count does not match its config".into(),
            ));
        }
        shell_vcpus.reverse();
        for saved in &state.vcpus {
            let vcpu = match shell_vcpus.pop() {
                Some(vcpu) => vcpu,
                None => vm
                    .fd
                    .create_vcpu(u64::from(saved.id))
                    .map_err(kvm_err("create a vCPU"))?,
            };
            vcpu::restore_state(&vcpu, saved).map_err(VmError::State)?;
            vm.spawn_vcpu(saved.id, vcpu, true)?;
        }
        // Devices came back (and may have signalled, e.g. the vsock transport reset) before
        // the LAPICs were loaded, which dropped those interrupts: raise them again.
        for device in &vm.virtio {
            lock(device).reassert_pending_interrupt();
        }
        // The PIT last: restoring it re-arms its counter, and a tick that fired before the
        // vCPUs' LAPICs were loaded would be lost, after which KVM (reinjecting, so waiting
        // for that tick's acknowledgement) never delivers another one: a guest whose clock
        // events come from the PIT would then sleep forever.
        vm.fd
            .set_pit2(&state.pit)
            .map_err(kvm_err("restore the PIT"))?;
        // The restored memory is the baseline for the next diff snapshot.
        *lock(&vm.last_snapshot) = Some(dir.to_owned());
        Ok(vm)
    }

    /// Lets every vCPU run.
    pub fn start(&self) {
        self.resume();
    }

    pub fn config(&self) -> &VmConfig {
        &self.config
    }

    /// The balloon's control handle, if the VM has a balloon.
    pub fn balloon(&self) -> Option<&Arc<BalloonControl>> {
        self.balloon.as_ref()
    }

    pub fn is_paused(&self) -> bool {
        self.vcpus.iter().all(VcpuHandle::is_paused)
    }

    /// Stops every vCPU and device thread at a consistent point.
    pub fn pause(&self) -> Result<(), VmError> {
        for vcpu in &self.vcpus {
            vcpu.pause(Duration::from_secs(5)).map_err(VmError::State)?;
        }
        for device in &self.virtio {
            lock(device).pause_device().map_err(VmError::State)?;
        }
        Ok(())
    }

    pub fn resume(&self) {
        for device in &self.virtio {
            lock(device).resume_device();
        }
        for vcpu in &self.vcpus {
            vcpu.resume();
        }
    }

    /// Writes a snapshot of a paused VM into `dest` (which must not exist). With `diff`, only
    /// pages written since the previous snapshot of this VM go into the memory file.
    pub fn snapshot(&self, dest: &Path, diff: bool) -> Result<SnapshotSummary, VmError> {
        if !self.vcpus.iter().all(VcpuHandle::is_parked) {
            return Err(VmError::State(
                "pause the VM before taking a snapshot".into(),
            ));
        }
        let parent = lock(&self.last_snapshot).clone();
        let diff_parent = match (diff, &parent) {
            (true, Some(p)) if self.dirty_logging.load(Ordering::SeqCst) => Some(p.clone()),
            (true, _) => {
                return Err(VmError::State(
                    "a diff snapshot needs an earlier full snapshot of this running VM".into(),
                ))
            }
            (false, _) => None,
        };
        let pending = snapshot::PendingSnapshot::create(dest)?;
        let mut vcpus = Vec::new();
        for handle in &self.vcpus {
            let fd = lock(&handle.fd);
            vcpus.push(vcpu::save_state(&self.kvm, handle.id, &fd).map_err(VmError::State)?);
        }
        let mut irqchips = Vec::new();
        for chip_id in [
            KVM_IRQCHIP_PIC_MASTER,
            KVM_IRQCHIP_PIC_SLAVE,
            KVM_IRQCHIP_IOAPIC,
        ] {
            let mut chip = kvm_irqchip {
                chip_id,
                ..Default::default()
            };
            self.fd
                .get_irqchip(&mut chip)
                .map_err(kvm_err("read the interrupt controller"))?;
            irqchips.push(chip);
        }
        let pit = self.fd.get_pit2().map_err(kvm_err("read the PIT"))?;
        let clock = self
            .fd
            .get_clock()
            .map_err(kvm_err("read the guest clock"))?;
        let devices = DevicesState {
            serial: lock(&self.serial).save(),
            vsock: self.vsock.as_ref().map(|t| lock(t).save()),
            virtio: {
                let mut v = slots::save(&self.config, &self.virtio);
                slots::save_balloon(&self.config, &mut v, self.balloon.as_deref());
                v
            },
        };

        let mut mem_file = pending.memory_file()?;
        let (pages_written, pages) = match &diff_parent {
            None => (
                memory::dump(&self.mem, &self.regions, &mut mem_file, DumpPages::All)?.len() as u64,
                Vec::new(),
            ),
            Some(_) => {
                let list =
                    memory::dump_dirty_list(&self.mem, &self.regions, &self.fd, &mut mem_file)?;
                (list.len() as u64, list)
            }
        };
        let state = VmState {
            vmm_version: env!("CARGO_PKG_VERSION").to_string(),
            config: self.config.clone(),
            memory: MemoryState {
                regions: self.regions.clone(),
                parent: diff_parent
                    .as_ref()
                    .map(|p| std::fs::canonicalize(p).unwrap_or_else(|_| p.clone())),
                pages,
            },
            vcpus,
            irqchips,
            pit,
            clock,
            devices,
        };
        pending.commit(&state)?;
        if !diff {
            // From now on KVM tracks the guest's writes so the next snapshot can be a diff.
            memory::register(&self.fd, &self.mem, true)?;
            if self.dirty_logging.swap(true, Ordering::SeqCst) {
                // Already logging: clear the log so the diff starts at this snapshot.
                memory::clear_dirty_log(&self.mem, &self.fd)?;
            }
        }
        *lock(&self.last_snapshot) = Some(dest.to_owned());
        Ok(SnapshotSummary {
            pages_written,
            diff: diff_parent.is_some(),
        })
    }

    /// Waits until the VM stops and returns why. Every vCPU is told to stop.
    pub fn wait(&self) -> RunReport {
        let reason = lock(&self.exit_rx)
            .recv()
            .unwrap_or(VmExitReason::VcpuError {
                vcpu: 0,
                message: "all vCPUs stopped without a reason".into(),
            });
        for vcpu in &self.vcpus {
            vcpu.stop();
        }
        RunReport {
            reason,
            exits: self.stats.exits.load(Ordering::Relaxed),
            first_kvm_run_ns: self.times.first_kvm_run_ns.load(Ordering::Relaxed),
            first_serial_byte_ns: self.times.first_serial_byte_ns.load(Ordering::Relaxed),
        }
    }

    /// Hands the destruction of the KVM VM and of guest memory to a helper process (see
    /// [`crate::teardown`]) so this process exits without waiting for it. Call once, after
    /// the VM is built and before the seccomp filter is installed.
    pub fn defer_teardown(&self) -> std::io::Result<()> {
        use std::os::fd::AsRawFd;
        let mut keep = vec![self.fd.as_raw_fd()];
        keep.extend(self.vcpus.iter().map(|v| v.raw_fd));
        crate::teardown::defer_to_helper(&keep)
    }

    /// Makes [`Vm::wait`] return with `reason` (the control socket's stop).
    pub fn request_exit(&self, reason: VmExitReason) {
        let _ = self.exit_tx.send(reason);
    }

    /// Page-fault counters of a lazily restored VM.
    pub fn lazy_stats(&self) -> Option<(u64, u64)> {
        self.uffd.as_ref().map(|u| {
            (
                u.stats.faults.load(Ordering::Relaxed),
                u.stats.prefetched.load(Ordering::Relaxed),
            )
        })
    }

    /// Reads guest memory (tests and the control socket's status use it).
    pub fn read_guest_u64(&self, addr: u64) -> Option<u64> {
        self.mem.read_obj(GuestAddress(addr)).ok()
    }
}

/// A VM created ahead of time (KVM VM, irqchip, PIT, memory slots, vCPUs) waiting for a
/// snapshot to restore: the ioctls that dominate a restore (the memory-slot one waits for an
/// SRCU grace period) are paid before the request arrives.
pub struct Prewarmed {
    kvm: Kvm,
    fd: VmFd,
    mem: GuestMemory,
    mem_mib: u64,
    vcpus: Vec<kvm_ioctls::VcpuFd>,
}

impl Prewarmed {
    pub fn new(mem_mib: u64, vcpus: u8) -> Result<Prewarmed, VmError> {
        if vcpus == 0 || vcpus > crate::config::MAX_VCPUS {
            return Err(ConfigError::Vcpus(vcpus).into());
        }
        let kvm = open_kvm()?;
        let fd = create_vm_fd(&kvm)?;
        let mem = memory::anonymous(mem_mib << 20)?;
        memory::register(&fd, &mem, false)?;
        let vcpus = (0..vcpus)
            .map(|id| fd.create_vcpu(u64::from(id)))
            .collect::<Result<Vec<_>, _>>()
            .map_err(kvm_err("create a vCPU"))?;
        Ok(Prewarmed {
            kvm,
            fd,
            mem,
            mem_mib,
            vcpus,
        })
    }
}

/// What a snapshot wrote.
#[derive(Clone, Copy, Debug)]
pub struct SnapshotSummary {
    pub pages_written: u64,
    pub diff: bool,
}

/// The snapshot chain from the full snapshot up to `dir`, oldest first.
fn snapshot_chain(dir: &Path, state: &VmState) -> Result<Vec<(PathBuf, MemoryState)>, VmError> {
    let mut chain = vec![(dir.to_owned(), state.memory.clone())];
    while let Some(parent) = chain.last().and_then(|(_, m)| m.parent.clone()) {
        if chain.len() > 64 {
            return Err(VmError::State(
                "diff snapshot chain is longer than 64 or loops".into(),
            ));
        }
        let parent_state = snapshot::read_state(&parent)?;
        if parent_state.memory.regions != state.memory.regions {
            return Err(VmError::State(format!(
                "diff snapshot parent {} has a different memory layout",
                parent.display()
            )));
        }
        chain.push((parent, parent_state.memory));
    }
    chain.reverse();
    Ok(chain)
}

/// Empty memory whose pages a userfaultfd handler fills from the snapshot chain on demand.
fn restore_memory_lazily(
    dir: &Path,
    state: &VmState,
    lazy: &LazyRestore,
    into: Option<GuestMemory>,
) -> Result<(GuestMemory, UffdHandler), VmError> {
    let chain = snapshot_chain(dir, state)?;
    let open = |d: &Path| {
        let path = d.join(snapshot::MEMORY_FILE);
        File::open(&path).map_err(|source| SnapshotError::Read { path, source })
    };
    let file_size: u64 = state
        .memory
        .regions
        .iter()
        .map(|r| r.file_offset + r.size)
        .max()
        .unwrap_or(0);
    let base = open(&chain[0].0)?;
    let actual = base.metadata().map(|m| m.len()).unwrap_or(0);
    if actual < file_size {
        return Err(memory::MemoryError::FileSize {
            expected: file_size,
            actual,
        }
        .into());
    }
    let mut source = uffd::PageSource::new(base);
    for (diff_dir, diff) in &chain[1..] {
        source.push_diff(open(diff_dir)?, &diff.pages);
    }
    let layout = memory::layout_for(state.config.mem_mib << 20);
    if layout != state.memory.regions {
        return Err(VmError::State(
            "snapshot memory layout does not match its config".into(),
        ));
    }
    // A prewarmed VM's memory is untouched anonymous memory, just what userfaultfd needs.
    let mem = match into {
        Some(mem) => mem,
        None => memory::anonymous(state.config.mem_mib << 20)?,
    };
    let working_set = dir.join(WORKING_SET_FILE);
    let options = uffd::LazyOptions {
        prefetch: if lazy.prefetch {
            uffd::read_working_set(&working_set, file_size / PAGE_SIZE as u64)
        } else {
            Vec::new()
        },
        record: lazy.record.map(|window| (working_set, window)),
    };
    let handler =
        uffd::start(&mem, &layout, source, options).map_err(|e| VmError::State(e.to_string()))?;
    Ok((mem, handler))
}

/// Maps the full snapshot's memory MAP_PRIVATE, then applies each diff in order.
fn restore_memory(
    dir: &Path,
    state: &VmState,
    into: Option<GuestMemory>,
) -> Result<GuestMemory, VmError> {
    let chain = snapshot_chain(dir, state)?;
    let (base_dir, _) = &chain[0];
    let base_path = base_dir.join(snapshot::MEMORY_FILE);
    let base = File::open(&base_path).map_err(|source| SnapshotError::Read {
        path: base_path.clone(),
        source,
    })?;
    let mem = match into {
        Some(mem) => {
            memory::map_file_over(&mem, &base, &state.memory.regions)?;
            mem
        }
        None => memory::from_file(base, &state.memory.regions)?,
    };
    let file_size: u64 = state
        .memory
        .regions
        .iter()
        .map(|r| r.file_offset + r.size)
        .max()
        .unwrap_or(0);
    for (diff_dir, diff_state) in &chain[1..] {
        let path = diff_dir.join(snapshot::MEMORY_FILE);
        let read_err = |source| SnapshotError::Read {
            path: path.clone(),
            source,
        };
        let mut file = File::open(&path).map_err(read_err)?;
        let mut page = vec![0u8; PAGE_SIZE];
        for &file_page in &diff_state.pages {
            let offset = file_page * PAGE_SIZE as u64;
            if offset + PAGE_SIZE as u64 > file_size {
                return Err(SnapshotError::Corrupt {
                    path: path.clone(),
                    detail: format!("diff page {file_page} lies outside guest memory"),
                }
                .into());
            }
            file.seek(SeekFrom::Start(offset)).map_err(read_err)?;
            file.read_exact(&mut page).map_err(read_err)?;
            let guest =
                memory::file_offset_to_guest(&state.memory.regions, offset).ok_or_else(|| {
                    VmError::State(format!("diff page {file_page} has no guest address"))
                })?;
            mem.write_slice(&page, GuestAddress(guest))
                .map_err(|e| VmError::State(format!("apply diff page: {e}")))?;
        }
    }
    Ok(mem)
}

fn kernel_cmdline(config: &VmConfig) -> String {
    let mut cmdline = config.cmdline.clone();
    cmdline.push_str(&slots::cmdline(config));
    cmdline
}

fn build_devices(
    config: &VmConfig,
    vm: &VmFd,
    mem: &GuestMemory,
    exit_tx: &Sender<VmExitReason>,
    sink: SerialSink,
    saved: Option<&DevicesState>,
) -> Result<Devices, VmError> {
    let dev_err = |what: &str, e: std::io::Error| VmError::Device(format!("{what}: {e}"));
    let overlap = |e: crate::devices::bus::BusOverlap| VmError::Device(e.to_string());
    let mut pio = Bus::default();
    let serial_irq = EventFd::new(libc::EFD_NONBLOCK).map_err(|e| dev_err("serial irq", e))?;
    vm.register_irqfd(&serial_irq, layout::SERIAL_IRQ)
        .map_err(kvm_err("wire the serial interrupt"))?;
    let serial = match saved {
        Some(s) => Serial::restore((serial_irq, sink), &s.serial).map_err(VmError::State)?,
        None => Serial::new(serial_irq, sink),
    };
    let serial = Arc::new(Mutex::new(serial));
    pio.insert(0x3f8, 8, serial.clone()).map_err(overlap)?;
    pio.insert(0x60, 5, Arc::new(Mutex::new(I8042::new(exit_tx.clone()))))
        .map_err(overlap)?;
    pio.insert(0x70, 2, Arc::new(Mutex::new(Cmos::default())))
        .map_err(overlap)?;

    let mut mmio = Bus::default();
    let attached = slots::attach(
        config,
        vm,
        mem,
        &mut mmio,
        saved.and_then(|s| s.vsock.as_ref()),
        saved.map_or(&[][..], |s| &s.virtio[..]),
    )
    .map_err(|e| match e {
        slots::AttachError::Vsock(e) => VmError::Vsock(e),
        e => VmError::Device(e.to_string()),
    })?;
    Ok(Devices {
        serial,
        vsock: attached.vsock,
        virtio: attached.all,
        pio: Arc::new(pio),
        mmio: Arc::new(mmio),
        balloon: attached.balloon,
    })
}

/// Builds the VM and runs it until the guest stops (the simple, one-shot path).
pub fn run(config: &VmConfig) -> Result<RunReport, VmError> {
    let vm = Vm::new(config.clone())?;
    vm.start();
    Ok(vm.wait())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::DriveConfig;

    #[test]
    fn drive_replacements_must_match_the_snapshot() {
        let dir = std::env::temp_dir().join(format!("dsec-drives-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = |name: &str, len: u64| {
            let p = dir.join(name);
            std::fs::File::create(&p).unwrap().set_len(len).unwrap();
            p
        };
        let drive = |path: PathBuf, read_only: bool| DriveConfig { path, read_only };
        let own = vec![
            drive(file("root", 4096), true),
            drive(file("upper", 8192), false),
        ];
        let mut snap = own.clone();
        let copy = file("copy", 8192);
        replace_drives(&mut snap, &[own[0].clone(), drive(copy.clone(), false)]).unwrap();
        assert_eq!(snap[1].path, copy);
        let err = |new: &[DriveConfig]| {
            let mut snap = own.clone();
            replace_drives(&mut snap, new).unwrap_err().to_string()
        };
        assert!(err(&[own[0].clone()]).contains("2 disk(s) but 1"));
        assert!(err(&[own[0].clone(), drive(copy.clone(), true)]).contains("writable"));
        let small = file("small", 4096);
        assert!(err(&[own[0].clone(), drive(small, false)]).contains("4096 bytes"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
