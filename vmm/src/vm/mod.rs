//! A VM: built from a [`VmConfig`] or restored from a snapshot (`restore`), run by vCPU
//! threads, paused, snapshotted (`snapshot`) and resumed through [`Vm`]'s methods (the
//! control socket calls them).
//!
//! Dependencies point down: `vm` uses devices, vCPUs, memory and the snapshot format; those
//! use only the leaf modules (`sync`, `exit`, `timing`, `persist`), never `vm`.

mod restore;
mod snapshot;

use std::fs::OpenOptions;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvm_bindings::{kvm_pit_config, KVM_MAX_CPUID_ENTRIES, KVM_PIT_SPEAKER_DUMMY};
use kvm_ioctls::{Kvm, VmFd};
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

use crate::arch::{boot, cpu, layout, mptable};
use crate::config::{ConfigError, SerialOutput, VmConfig};
use crate::devices::bus::{Bus, BusOverlap};
use crate::devices::legacy::{Cmos, Serial, SerialRestoreError, SerialSink, I8042};
use crate::devices::virtio::balloon::BalloonControl;
use crate::devices::virtio::pause::PauseError;
use crate::devices::virtio::slots::{self, AttachError, VirtioSlot};
use crate::memory::{self, GuestMemory, RegionLayout};
use crate::persist::Persist;
use crate::snapshot::{DevicesState, SnapshotError};
use crate::sync::lock;
use crate::uffd::{UffdError, UffdHandler};
use crate::vcpu::{self, VcpuError, VcpuHandle, VcpuStats};

pub use crate::exit::VmExitReason;
pub use crate::timing::{now_ns, BootTimes};
pub use restore::{LazyRestore, RestoreError, RestoreOverrides, WORKING_SET_FILE};
pub use snapshot::{LiveSnapshot, SnapshotPages, SnapshotSummary};

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
    #[error("cannot create the serial port's interrupt eventfd: {0}")]
    SerialIrq(std::io::Error),
    #[error("device layout is broken: {0}")]
    Bus(#[from] BusOverlap),
    #[error(transparent)]
    Attach(#[from] AttachError),
    #[error(transparent)]
    SerialRestore(#[from] SerialRestoreError),
    #[error("cannot start vCPU thread: {0}")]
    Thread(std::io::Error),
    #[error(transparent)]
    Vcpu(#[from] VcpuError),
    #[error(transparent)]
    Pause(#[from] PauseError),
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    #[error(transparent)]
    CowWrite(#[from] crate::cow_writer::CowWriteError),
    #[error(transparent)]
    Restore(#[from] RestoreError),
    #[error("cannot serve the restored memory lazily: {0}")]
    Uffd(#[from] UffdError),
    #[error("pause the VM before taking a snapshot")]
    NotPaused,
    #[error(
        "a diff snapshot needs an earlier full snapshot of this running VM; take a full one first"
    )]
    NoBaseSnapshot,
    #[error("a snapshot over the base needs a VM restored by mapping its snapshot's memory (this one was booted or restored lazily); take a full snapshot")]
    NoRestoreBase,
    #[error(transparent)]
    Pagemap(#[from] crate::pagemap::PagemapError),
    #[error(transparent)]
    ParentOutside(#[from] crate::snapshot::ParentOutside),
}

fn kvm_err(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VmError {
    move |source| VmError::Kvm { what, source }
}

/// What a finished run reports.
pub struct RunReport {
    pub reason: VmExitReason,
    pub exits: u64,
    pub first_kvm_run_ns: u64,
    pub first_serial_byte_ns: u64,
    /// Build steps with their end times (CLOCK_REALTIME ns), in order.
    pub steps: Vec<(&'static str, u64)>,
    pub exits_by_address: Vec<vcpu::ExitCount>,
    /// Exits per [`vcpu::EXIT_BUCKET_MS`] since the first KVM_RUN.
    pub exits_by_time: Vec<u64>,
    /// KVM's own per-vCPU statistics summed over the vCPUs (in-kernel exits included).
    pub kvm_vcpu_stats: std::collections::BTreeMap<String, u64>,
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

pub struct Vm {
    config: VmConfig,
    kvm: Kvm,
    fd: VmFd,
    mem: GuestMemory,
    regions: Vec<RegionLayout>,
    serial: Arc<Mutex<Serial>>,
    /// Every virtio device (vsock included) in slot order.
    virtio: Vec<VirtioSlot>,
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
    /// Memory is a MAP_PRIVATE mapping of its restore chain's full snapshot: a page still
    /// backed by that file is unchanged since the restore (see `crate::pagemap`).
    private_base: bool,
    /// Serves page faults of a lazily restored VM; stops when the VM is dropped.
    uffd: Option<UffdHandler>,
    /// The balloon's control handle (target, statistics), when configured.
    balloon: Option<Arc<BalloonControl>>,
    /// Where a restore's time went (all zero for a booted VM).
    restore_steps: dsec_vmm_api::control::RestoreSteps,
}

struct Devices {
    serial: Arc<Mutex<Serial>>,
    /// Every virtio device (vsock included) in slot order.
    virtio: Vec<VirtioSlot>,
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
        let times = Arc::new(BootTimes::default());
        let mem_bytes = config.mem_mib << 20;
        let regions = memory::layout_for(mem_bytes);
        let mem = memory::anonymous(mem_bytes)?;
        let cmdline = kernel_cmdline(&config);
        let (exit_tx, exit_rx) = channel();
        let (kvm, fd, devices, base_cpuid, boot_info) = std::thread::scope(|scope| {
            // Copying the kernel and initrd is CPU work; most of the KVM setup below waits
            // (RCU/SRCU grace periods when the VM, its memory slots and irqfds change), so
            // the two overlap even on one host CPU.
            let loader = scope.spawn(|| -> Result<boot::BootInfo, VmError> {
                let info = boot::load(
                    &mem,
                    mem_bytes,
                    &config.kernel,
                    config.initrd.as_deref(),
                    &cmdline,
                )?;
                mptable::setup(&mem, config.vcpus)?;
                times.mark("kernel_and_initrd_loaded");
                Ok(info)
            });
            let kvm = open_kvm()?;
            let fd = create_vm_fd(&kvm)?;
            times.mark("kvm_vm_created");
            memory::register(&fd, &mem, false)?;
            times.mark("memory_registered");
            let sink = serial_sink(&config.serial, &times)?;
            let devices = build_devices(&config, &fd, &mem, &exit_tx, sink, None)?;
            times.mark("devices_attached");
            let base_cpuid = kvm
                .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
                .map_err(kvm_err("report supported CPUID"))?;
            let boot_info = loader.join().unwrap_or_else(|panic| {
                std::panic::resume_unwind(panic);
            })?;
            Ok::<_, VmError>((kvm, fd, devices, base_cpuid, boot_info))
        })?;
        let host_caps = cpu::HostCaps::of(&kvm);
        let mut vm = Vm::assemble(
            config, kvm, fd, mem, regions, devices, exit_tx, exit_rx, times,
        );
        for id in 0..vm.config.vcpus {
            let vcpu = vm
                .fd
                .create_vcpu(u64::from(id))
                .map_err(kvm_err("create a vCPU"))?;
            cpu::setup_cpuid(&vcpu, &base_cpuid, host_caps, id, vm.config.vcpus)?;
            cpu::setup_msrs(&vcpu)?;
            cpu::setup_sregs(&vm.mem, &vcpu, boot_info.mode)?;
            cpu::setup_regs(&vcpu, boot_info.mode, boot_info.entry)?;
            cpu::setup_fpu(&vcpu)?;
            cpu::setup_lapic(&vcpu)?;
            vm.spawn_vcpu(id, vcpu, true)?;
        }
        vm.times.mark("vcpus_created");
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
            private_base: false,
            uffd: None,
            balloon: devices.balloon,
            restore_steps: Default::default(),
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

    /// Stops every vCPU and device thread at a consistent point: all vCPUs first (nothing
    /// in the guest can then start a device), each group asked at once and then waited for.
    pub fn pause(&self) -> Result<(), VmError> {
        for vcpu in &self.vcpus {
            vcpu.request_pause();
        }
        for vcpu in &self.vcpus {
            vcpu.pause(Duration::from_secs(5))?;
        }
        for slot in &self.virtio {
            lock(&slot.transport).request_device_pause()?;
        }
        for slot in &self.virtio {
            lock(&slot.transport).wait_device_paused()?;
        }
        Ok(())
    }

    pub fn resume(&self) {
        for slot in &self.virtio {
            lock(&slot.transport).resume_device();
        }
        for vcpu in &self.vcpus {
            vcpu.resume();
        }
    }

    /// Waits until the VM stops and returns why. Every vCPU is told to stop.
    pub fn wait(&self) -> RunReport {
        let reason = lock(&self.exit_rx)
            .recv()
            .unwrap_or(VmExitReason::VcpuError {
                vcpu: 0,
                message: "all vCPUs stopped without a reason".into(),
            });
        // Out of KVM_RUN first, so that the counters below are final.
        for vcpu in &self.vcpus {
            vcpu.stop_and_wait(Duration::from_secs(2));
        }
        RunReport {
            reason,
            exits: self.stats.exits.load(Ordering::Relaxed),
            first_kvm_run_ns: self.times.first_kvm_run_ns.load(Ordering::Relaxed),
            first_serial_byte_ns: self.times.first_serial_byte_ns.load(Ordering::Relaxed),
            steps: self.times.steps(),
            exits_by_address: self.stats.by_address(),
            exits_by_time: self.stats.by_time(),
            kvm_vcpu_stats: self.kvm_vcpu_stats(),
        }
    }

    /// KVM's counters of every vCPU, summed by name (readable while the vCPUs run).
    pub fn kvm_vcpu_stats(&self) -> std::collections::BTreeMap<String, u64> {
        self.vcpus.iter().filter_map(|v| v.kvm_stats.as_ref()).fold(
            Default::default(),
            |mut sum, stats| {
                for (name, value) in stats.read() {
                    *sum.entry(name).or_insert(0) += value;
                }
                sum
            },
        )
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

    /// Encodes and decodes, once, a state read from this shell (its vCPUs, interrupt
    /// controllers, PIT and clock, KVM's CPUID list, a vsock config), so that the restore
    /// this VMM waits for does not run the state decoder for the first time in this process:
    /// in the rig's emulated L1 that first run was the largest step of a template restore
    /// (33-111 ms for a 42 KB state). Returns how long it took; an error means only that
    /// nothing was rehearsed.
    pub fn rehearse_state_decoding(&self) -> Result<Duration, VmError> {
        let started = std::time::Instant::now();
        let cpuid = self
            .kvm
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(kvm_err("read KVM's CPUID"))?;
        let mut vcpus = Vec::with_capacity(self.vcpus.len());
        for (id, fd) in self.vcpus.iter().enumerate() {
            let mut state = vcpu::save_state(&self.kvm, id as u8, fd)?;
            state.cpuid = cpuid.as_slice().to_vec();
            vcpus.push(state);
        }
        let (irqchips, pit, clock) = snapshot::read_vm_chips(&self.fd)?;
        let mut config = VmConfig::new("/rehearsal/vmlinux");
        config.mem_mib = self.mem_mib;
        config.vcpus = self.vcpus.len() as u8;
        config.vsock = Some(crate::config::VsockConfig {
            uds_path: "/rehearsal/vsock".into(),
            guest_cid: 3,
        });
        let state = crate::snapshot::VmState {
            vmm_version: env!("CARGO_PKG_VERSION").to_string(),
            config,
            memory: crate::snapshot::MemoryState {
                regions: memory::layout_for(self.mem_mib << 20),
                parent: None,
                pages: Vec::new(),
            },
            vcpus,
            irqchips,
            pit,
            clock,
            devices: DevicesState {
                serial: Default::default(),
                virtio: Vec::new(),
            },
        };
        let bytes = crate::snapshot::encode(&state)?;
        let _: crate::snapshot::VmState =
            crate::snapshot::decode(std::path::Path::new("rehearsal"), &bytes)?;
        Ok(started.elapsed())
    }
}

/// Milliseconds since `t` (the steps of a snapshot's pause and of a restore).
fn ms_since(t: std::time::Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
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
    let mut pio = Bus::default();
    let serial_irq = EventFd::new(libc::EFD_NONBLOCK).map_err(VmError::SerialIrq)?;
    vm.register_irqfd(&serial_irq, layout::SERIAL_IRQ)
        .map_err(kvm_err("wire the serial interrupt"))?;
    let serial = match saved {
        Some(s) => Serial::restore((serial_irq, sink), &s.serial)?,
        None => Serial::new(serial_irq, sink),
    };
    let serial = Arc::new(Mutex::new(serial));
    pio.insert(0x3f8, 8, serial.clone())?;
    pio.insert(0x60, 5, Arc::new(Mutex::new(I8042::new(exit_tx.clone()))))?;
    pio.insert(0x70, 2, Arc::new(Mutex::new(Cmos::default())))?;

    let mut mmio = Bus::default();
    let attached = slots::attach(config, vm, mem, &mut mmio, saved.map(|s| &s.virtio[..]))?;
    Ok(Devices {
        serial,
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
