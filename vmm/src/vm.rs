//! Builds a VM from a [`VmConfig`], runs it, and reports why it stopped.

use std::fs::OpenOptions;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use kvm_bindings::{
    kvm_pit_config, kvm_userspace_memory_region, KVM_MAX_CPUID_ENTRIES, KVM_PIT_SPEAKER_DUMMY,
};
use kvm_ioctls::{IoEventAddress, Kvm, VmFd};
use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};
use vmm_sys_util::eventfd::EventFd;

use crate::arch::{boot, cpu, layout, mptable};
use crate::config::{ConfigError, SerialOutput, VmConfig};
use crate::devices::bus::Bus;
use crate::devices::legacy::{Cmos, Serial, SerialSink, I8042};
use crate::devices::virtio::mmio::MmioTransport;
use crate::devices::virtio::vsock::Vsock;
use crate::vcpu::{self, VcpuStats};

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
        }
    }
}

/// Why a VM could not be built or run.
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
    #[error("cannot allocate {mib} MiB of guest memory: {reason}")]
    Memory { mib: u64, reason: String },
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

fn serial_sink(config: &VmConfig) -> Result<SerialSink, VmError> {
    Ok(match &config.serial {
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
    })
}

fn create_memory(vm: &VmFd, mem_mib: u64) -> Result<GuestMemoryMmap, VmError> {
    let bytes = mem_mib << 20;
    let ranges: Vec<(GuestAddress, usize)> = layout::ram_regions(bytes)
        .into_iter()
        .map(|(start, size)| (GuestAddress(start), size as usize))
        .collect();
    let mem = GuestMemoryMmap::from_ranges(&ranges).map_err(|e| VmError::Memory {
        mib: mem_mib,
        reason: format!("{e:?}"),
    })?;
    for (slot, region) in mem.iter().enumerate() {
        let host_addr = region
            .get_host_address(vm_memory::MemoryRegionAddress(0))
            .map_err(|e| VmError::Memory {
                mib: mem_mib,
                reason: e.to_string(),
            })?;
        let kvm_region = kvm_userspace_memory_region {
            slot: slot as u32,
            flags: 0,
            guest_phys_addr: region.start_addr().0,
            memory_size: region.len(),
            userspace_addr: host_addr as u64,
        };
        // SAFETY: the region is a live mapping owned by `mem`, which outlives the VM fd in
        // every caller (both are dropped only when the VMM process ends).
        unsafe { vm.set_user_memory_region(kvm_region) }.map_err(kvm_err("map guest memory"))?;
    }
    Ok(mem)
}

/// Builds the VM and runs it until the guest stops.
pub fn run(config: &VmConfig) -> Result<RunReport, VmError> {
    config.validate()?;
    let kvm = Kvm::new().map_err(VmError::OpenKvm)?;
    let api = kvm.get_api_version();
    if api != 12 {
        return Err(VmError::KvmApi(api));
    }
    let vm = kvm.create_vm().map_err(kvm_err("create a VM"))?;
    let mem = create_memory(&vm, config.mem_mib)?;

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

    let (exit_tx, exit_rx) = channel();
    let times = Arc::new(BootTimes::default());
    let (pio, mmio, cmdline) = build_devices(config, &vm, &mem, &exit_tx, &times)?;

    let boot_info = boot::load(
        &mem,
        config.mem_mib << 20,
        &config.kernel,
        config.initrd.as_deref(),
        &cmdline,
    )?;
    mptable::setup(&mem, config.vcpus)?;

    let base_cpuid = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(kvm_err("report supported CPUID"))?;
    let stats = Arc::new(VcpuStats::default());
    let mut vcpu_fds = Vec::new();
    for id in 0..config.vcpus {
        let fd = vm
            .create_vcpu(u64::from(id))
            .map_err(kvm_err("create a vCPU"))?;
        cpu::setup_cpuid(&fd, &base_cpuid, id, config.vcpus)?;
        cpu::setup_msrs(&fd)?;
        cpu::setup_sregs(&mem, &fd, boot_info.mode)?;
        cpu::setup_regs(&fd, boot_info.mode, boot_info.entry)?;
        cpu::setup_fpu(&fd)?;
        cpu::setup_lapic(&fd)?;
        vcpu_fds.push(fd);
    }
    for (id, fd) in vcpu_fds.into_iter().enumerate() {
        let ctx = vcpu::VcpuContext {
            id: id as u8,
            fd,
            pio: pio.clone(),
            mmio: mmio.clone(),
            exit: exit_tx.clone(),
            stats: stats.clone(),
            times: times.clone(),
        };
        std::thread::Builder::new()
            .name(format!("vcpu{id}"))
            .spawn(move || vcpu::run(ctx))
            .map_err(VmError::Thread)?;
    }
    drop(exit_tx);
    // The i8042 holds a sender, so this only fails if every sender is gone.
    let reason = exit_rx.recv().unwrap_or(VmExitReason::VcpuError {
        vcpu: 0,
        message: "all vCPUs stopped without a reason".into(),
    });
    // Keep `vm` and `mem` alive until here: vCPU threads still reference them.
    drop(vm);
    Ok(RunReport {
        reason,
        exits: stats.exits.load(Ordering::Relaxed),
        first_kvm_run_ns: times.first_kvm_run_ns.load(Ordering::Relaxed),
        first_serial_byte_ns: times.first_serial_byte_ns.load(Ordering::Relaxed),
    })
}

type Devices = (Arc<Bus>, Arc<Bus>, String);

fn build_devices(
    config: &VmConfig,
    vm: &VmFd,
    mem: &GuestMemoryMmap,
    exit_tx: &Sender<VmExitReason>,
    times: &Arc<BootTimes>,
) -> Result<Devices, VmError> {
    let dev_err = |what: &str, e: std::io::Error| VmError::Device(format!("{what}: {e}"));
    let mut pio = Bus::default();
    let serial_irq = EventFd::new(libc::EFD_NONBLOCK).map_err(|e| dev_err("serial irq", e))?;
    vm.register_irqfd(&serial_irq, layout::SERIAL_IRQ)
        .map_err(kvm_err("wire the serial interrupt"))?;
    let sink = TimedSink {
        inner: serial_sink(config)?,
        times: times.clone(),
    };
    let overlap = |e: crate::devices::bus::BusOverlap| VmError::Device(e.to_string());
    pio.insert(
        0x3f8,
        8,
        Arc::new(Mutex::new(Serial::new(serial_irq, Box::new(sink)))),
    )
    .map_err(overlap)?;
    pio.insert(0x60, 5, Arc::new(Mutex::new(I8042::new(exit_tx.clone()))))
        .map_err(overlap)?;
    pio.insert(0x70, 2, Arc::new(Mutex::new(Cmos::default())))
        .map_err(overlap)?;

    let mut mmio = Bus::default();
    let mut cmdline = config.cmdline.clone();
    if let Some(vsock_config) = &config.vsock {
        let base = layout::VIRTIO_MMIO_BASE;
        let irq = layout::VIRTIO_IRQ_BASE;
        let device = Vsock::new(vsock_config.guest_cid, vsock_config.uds_path.clone())
            .map_err(VmError::Vsock)?;
        let irqfd = EventFd::new(libc::EFD_NONBLOCK).map_err(|e| dev_err("vsock irq", e))?;
        vm.register_irqfd(&irqfd, irq)
            .map_err(kvm_err("wire the vsock interrupt"))?;
        let transport = MmioTransport::new(Box::new(device), mem.clone(), irqfd)
            .map_err(|e| dev_err("vsock transport", e))?;
        for (index, event) in transport.queue_events().iter().enumerate() {
            // Queue kicks go straight to the device thread without a userspace exit.
            let addr = IoEventAddress::Mmio(base + 0x50);
            if let Err(e) = vm.register_ioevent(event, &addr, index as u32) {
                tracing::debug!("ioeventfd unavailable, kicks take the slow path: {e}");
            }
        }
        mmio.insert(
            base,
            layout::VIRTIO_MMIO_SIZE,
            Arc::new(Mutex::new(transport)),
        )
        .map_err(overlap)?;
        cmdline.push_str(&format!(" virtio_mmio.device=4K@{base:#x}:{irq}"));
    }
    Ok((Arc::new(pio), Arc::new(mmio), cmdline))
}
