//! vCPU threads: run KVM_RUN, dispatch exits to the buses, park on request so the VM can be
//! paused and its state saved, and save/restore the architectural state.

use std::collections::BTreeMap;
use std::os::unix::thread::JoinHandleExt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Condvar, Mutex, Once};
use std::thread::JoinHandle;
use std::time::Duration;

use kvm_bindings::{
    kvm_cpuid_entry2, kvm_debugregs, kvm_lapic_state, kvm_mp_state, kvm_msr_entry, kvm_regs,
    kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave, CpuId, Msrs,
};
use kvm_ioctls::{Kvm, VcpuExit, VcpuFd};
use serde::{Deserialize, Serialize};

use crate::devices::bus::Bus;
use crate::exit::VmExitReason;
use crate::sync::lock;
use crate::timing::{now_ns, BootTimes};

/// Why a vCPU could not be paused, saved or restored.
#[derive(Debug, thiserror::Error)]
pub enum VcpuError {
    #[error(
        "vCPU {id} did not pause within {timeout:?}; the host may be overloaded, retry the pause"
    )]
    PauseTimeout { id: u8, timeout: Duration },
    #[error("KVM refused to {what}: {source}")]
    Kvm {
        what: &'static str,
        source: kvm_ioctls::Error,
    },
    #[error("the saved {what} list is too long for KVM ({detail}); the snapshot is damaged")]
    List { what: &'static str, detail: String },
    #[error("host accepted only {written} of {total} saved MSRs (MSR {refused:#x} refused); restore on a host with the same CPU and KVM")]
    Msrs {
        written: usize,
        total: usize,
        refused: u32,
    },
}

/// Exit counters shared by all vCPUs (exits dominate boot time on nested hosts).
pub struct VcpuStats {
    pub exits: AtomicU64,
    /// Exits by kind and device address (I/O port, or the 4 KiB MMIO page), for the metrics:
    /// count, first and last time (ns since the first KVM_RUN).
    by_address: Mutex<BTreeMap<(&'static str, u64), AddressExits>>,
    /// Exits per [`EXIT_BUCKET_MS`] since the first KVM_RUN: shows where a boot stalls.
    by_time: [AtomicU64; EXIT_BUCKETS],
}

/// Exits to one device address: how many, the first and the last (ns since the first KVM_RUN).
#[derive(Clone, Copy)]
struct AddressExits {
    count: u64,
    first_ns: u64,
    last_ns: u64,
}

/// Width of one `by_time` bucket.
pub const EXIT_BUCKET_MS: u64 = 100;
const EXIT_BUCKETS: usize = 100;

/// One line of the exit breakdown: kind (`io_in`, `io_out`, `mmio_read`, `mmio_write`),
/// address and count.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ExitCount {
    pub kind: &'static str,
    pub address: String,
    pub count: u64,
    /// First and last such exit, in ms after the first KVM_RUN.
    pub first_ms: f64,
    pub last_ms: f64,
}

impl Default for VcpuStats {
    fn default() -> Self {
        VcpuStats {
            exits: AtomicU64::new(0),
            by_address: Mutex::default(),
            by_time: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

impl VcpuStats {
    fn count(&self, kind: &'static str, address: u64, since_first_run_ns: u64) {
        let mut map = lock(&self.by_address);
        let entry = map.entry((kind, address)).or_insert(AddressExits {
            count: 0,
            first_ns: since_first_run_ns,
            last_ns: 0,
        });
        entry.count += 1;
        entry.last_ns = since_first_run_ns;
    }

    fn count_at(&self, since_first_run_ns: u64) {
        let bucket = (since_first_run_ns / (EXIT_BUCKET_MS * 1_000_000)) as usize;
        self.by_time[bucket.min(EXIT_BUCKETS - 1)].fetch_add(1, Ordering::Relaxed);
    }

    /// Device exits, most frequent first.
    pub fn by_address(&self) -> Vec<ExitCount> {
        let mut counts: Vec<ExitCount> = lock(&self.by_address)
            .iter()
            .map(|(&(kind, address), exits)| ExitCount {
                kind,
                address: format!("{address:#x}"),
                count: exits.count,
                first_ms: exits.first_ns as f64 / 1e6,
                last_ms: exits.last_ns as f64 / 1e6,
            })
            .collect();
        counts.sort_by_key(|c| std::cmp::Reverse(c.count));
        counts
    }

    /// Exits per [`EXIT_BUCKET_MS`] since the first KVM_RUN, trailing empty buckets dropped
    /// (the last bucket also holds everything later).
    pub fn by_time(&self) -> Vec<u64> {
        let mut buckets: Vec<u64> = self
            .by_time
            .iter()
            .map(|b| b.load(Ordering::Relaxed))
            .collect();
        while buckets.last() == Some(&0) {
            buckets.pop();
        }
        buckets
    }
}

const KVM_SYSTEM_EVENT_SHUTDOWN: u32 = 1;
const KVM_SYSTEM_EVENT_RESET: u32 = 2;

/// Pause handshake between the VMM and one vCPU thread.
#[derive(Default)]
struct Control {
    pause_requested: AtomicBool,
    /// The VM is over: leave the run loop at the next exit instead of entering KVM_RUN again.
    stop_requested: AtomicBool,
    parked: Mutex<bool>,
    changed: Condvar,
}

/// A running vCPU thread and the fd the VMM uses to save its state while parked.
pub struct VcpuHandle {
    pub id: u8,
    pub fd: Arc<Mutex<VcpuFd>>,
    /// The vCPU fd's number, readable while the thread holds `fd` inside KVM_RUN.
    pub raw_fd: std::os::fd::RawFd,
    /// KVM's counters of this vCPU, readable while it runs.
    pub kvm_stats: Option<crate::kvm_stats::VcpuStatsFile>,
    control: Arc<Control>,
    thread: Option<JoinHandle<()>>,
}

/// What a vCPU thread needs.
pub struct VcpuContext {
    pub id: u8,
    pub fd: VcpuFd,
    pub pio: Arc<Bus>,
    pub mmio: Arc<Bus>,
    pub exit: Sender<VmExitReason>,
    pub stats: Arc<VcpuStats>,
    pub times: Arc<BootTimes>,
    /// Start parked (a restored VM starts paused until told to resume).
    pub start_paused: bool,
}

extern "C" fn kick_handler(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

fn kick_signal() -> libc::c_int {
    vmm_sys_util::signal::SIGRTMIN()
}

/// Starts a vCPU thread.
pub fn spawn(ctx: VcpuContext) -> std::io::Result<VcpuHandle> {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        // A no-op handler: the signal only has to interrupt KVM_RUN with EINTR.
        if let Err(e) = vmm_sys_util::signal::register_signal_handler(kick_signal(), kick_handler) {
            tracing::warn!("cannot install the vCPU kick handler, pause will not work: {e}");
        }
    });
    let control = Arc::new(Control::default());
    control
        .pause_requested
        .store(ctx.start_paused, Ordering::SeqCst);
    let raw_fd = std::os::fd::AsRawFd::as_raw_fd(&ctx.fd);
    let kvm_stats = crate::kvm_stats::VcpuStatsFile::open(raw_fd);
    let fd = Arc::new(Mutex::new(ctx.fd));
    let id = ctx.id;
    let thread = {
        let control = control.clone();
        let fd = fd.clone();
        let runner = Runner {
            id: ctx.id,
            pio: ctx.pio,
            mmio: ctx.mmio,
            stats: ctx.stats,
            times: ctx.times,
        };
        let exit = ctx.exit;
        std::thread::Builder::new()
            .name(format!("vcpu{id}"))
            .spawn(move || {
                crate::seccomp::install_or_exit(crate::seccomp::ThreadKind::Vcpu);
                let reason = runner.run(&fd, &control);
                let _ = exit.send(reason);
            })?
    };
    Ok(VcpuHandle {
        id,
        fd,
        raw_fd,
        kvm_stats,
        control,
        thread: Some(thread),
    })
}

impl VcpuHandle {
    /// Stops the vCPU at its next exit and waits until it is parked.
    /// Asks the thread to park and kicks it out of KVM_RUN, without waiting (every vCPU
    /// leaves the guest at once); [`VcpuHandle::pause`] then waits.
    pub fn request_pause(&self) {
        self.control.pause_requested.store(true, Ordering::SeqCst);
        self.kick();
    }

    pub fn pause(&self, timeout: Duration) -> Result<(), VcpuError> {
        self.control.pause_requested.store(true, Ordering::SeqCst);
        let deadline = std::time::Instant::now() + timeout;
        let mut parked = lock(&self.control.parked);
        while !*parked {
            // Re-kick: a signal that lands just before KVM_RUN starts is otherwise lost.
            self.kick();
            if std::time::Instant::now() > deadline {
                return Err(VcpuError::PauseTimeout {
                    id: self.id,
                    timeout,
                });
            }
            parked = self
                .control
                .changed
                .wait_timeout(parked, Duration::from_millis(1))
                .map(|(guard, _)| guard)
                .unwrap_or_else(|e| e.into_inner().0);
        }
        Ok(())
    }

    pub fn resume(&self) {
        self.control.pause_requested.store(false, Ordering::SeqCst);
        self.control.changed.notify_all();
    }

    /// Makes the thread leave its run loop (the VM is over): it stops burning a host CPU on
    /// guest code nobody waits for while the process exits. Does not wait.
    pub fn stop(&self) {
        self.control.stop_requested.store(true, Ordering::SeqCst);
        self.resume();
        self.kick();
    }

    /// [`VcpuHandle::stop`], then waits up to `timeout` for the thread to leave its run loop,
    /// kicking it again meanwhile (a kick that lands just before KVM_RUN starts is lost, and a
    /// guest that makes no exits would keep the vCPU forever).
    pub fn stop_and_wait(&self, timeout: Duration) {
        self.stop();
        let deadline = std::time::Instant::now() + timeout;
        loop {
            match &self.thread {
                None => return,
                Some(thread) if thread.is_finished() => return,
                Some(_) => {}
            }
            if std::time::Instant::now() > deadline {
                return;
            }
            self.kick();
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn kick(&self) {
        if let Some(thread) = &self.thread {
            // SAFETY: the pthread id belongs to a thread we own and have not joined.
            unsafe { libc::pthread_kill(thread.as_pthread_t(), kick_signal()) };
        }
    }

    /// Whether a pause was requested (the thread may still be on its way to parking).
    pub fn is_paused(&self) -> bool {
        self.control.pause_requested.load(Ordering::SeqCst)
    }

    /// Whether the thread is parked and will not touch guest state.
    pub fn is_parked(&self) -> bool {
        *lock(&self.control.parked)
    }
}

struct Runner {
    id: u8,
    pio: Arc<Bus>,
    mmio: Arc<Bus>,
    stats: Arc<VcpuStats>,
    times: Arc<BootTimes>,
}

impl Runner {
    fn run(&self, fd: &Mutex<VcpuFd>, control: &Control) -> VmExitReason {
        let mut first = true;
        loop {
            if control.stop_requested.load(Ordering::SeqCst) {
                return VmExitReason::Stopped;
            }
            if control.pause_requested.load(Ordering::SeqCst) {
                let mut parked = lock(&control.parked);
                *parked = true;
                control.changed.notify_all();
                while control.pause_requested.load(Ordering::SeqCst) {
                    parked = control
                        .changed
                        .wait(parked)
                        .unwrap_or_else(|e| e.into_inner());
                }
                *parked = false;
                control.changed.notify_all();
                // Stopped while parked: the stop's kick found no KVM_RUN to interrupt, so
                // check again before entering the guest.
                continue;
            }
            if first && self.id == 0 {
                self.times
                    .first_kvm_run_ns
                    .store(now_ns(), Ordering::Relaxed);
                first = false;
            }
            let mut fd = lock(fd);
            if let Some(reason) = self.run_once(&mut fd) {
                return reason;
            }
        }
    }

    /// One KVM_RUN; `Some` when the vCPU must stop for good.
    fn run_once(&self, fd: &mut VcpuFd) -> Option<VmExitReason> {
        let exit = fd.run();
        self.stats.exits.fetch_add(1, Ordering::Relaxed);
        let since_first_run =
            now_ns().saturating_sub(self.times.first_kvm_run_ns.load(Ordering::Relaxed));
        self.stats.count_at(since_first_run);
        let error = |message: String| {
            Some(VmExitReason::VcpuError {
                vcpu: self.id,
                message,
            })
        };
        match exit {
            Ok(VcpuExit::IoIn(port, data)) => {
                self.stats.count("io_in", u64::from(port), since_first_run);
                if !self.pio.read(u64::from(port), data) {
                    // Nothing there: the bus floats high, as on real hardware.
                    data.fill(0xff);
                }
                None
            }
            Ok(VcpuExit::IoOut(port, data)) => {
                self.stats.count("io_out", u64::from(port), since_first_run);
                self.pio.write(u64::from(port), data);
                None
            }
            Ok(VcpuExit::MmioRead(addr, data)) => {
                self.stats
                    .count("mmio_read", addr & !0xfff, since_first_run);
                if !self.mmio.read(addr, data) {
                    data.fill(0xff);
                }
                None
            }
            Ok(VcpuExit::MmioWrite(addr, data)) => {
                self.stats
                    .count("mmio_write", addr & !0xfff, since_first_run);
                self.mmio.write(addr, data);
                None
            }
            // Only seen without an in-kernel LAPIC: nothing would wake this vCPU.
            Ok(VcpuExit::Hlt) => Some(VmExitReason::PowerOff),
            Ok(VcpuExit::Shutdown) => Some(VmExitReason::TripleFault { vcpu: self.id }),
            Ok(VcpuExit::SystemEvent(kind, _)) => match kind {
                KVM_SYSTEM_EVENT_RESET => Some(VmExitReason::Reset),
                KVM_SYSTEM_EVENT_SHUTDOWN => Some(VmExitReason::PowerOff),
                other => error(format!("unhandled system event {other}")),
            },
            Ok(VcpuExit::FailEntry(reason, cpu)) => error(format!(
                "VM entry failed: hardware reason {reason:#x} on host CPU {cpu}"
            )),
            Ok(VcpuExit::InternalError) => error(
                "KVM internal error (often an instruction the host KVM cannot emulate)".into(),
            ),
            Ok(other) => error(format!("unexpected exit {other:?}")),
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => None,
            Err(e) => error(format!("KVM_RUN failed: {e}")),
        }
    }
}

/// Everything KVM keeps about one vCPU.
#[derive(Serialize, Deserialize)]
pub struct VcpuState {
    pub id: u8,
    #[serde(with = "crate::snapshot::blob::list")]
    pub cpuid: Vec<kvm_cpuid_entry2>,
    #[serde(with = "crate::snapshot::blob::list")]
    pub msrs: Vec<kvm_msr_entry>,
    #[serde(with = "crate::snapshot::blob")]
    pub regs: kvm_regs,
    #[serde(with = "crate::snapshot::blob")]
    pub sregs: kvm_sregs,
    #[serde(with = "crate::snapshot::blob")]
    pub xsave: kvm_xsave,
    #[serde(with = "crate::snapshot::blob")]
    pub xcrs: kvm_xcrs,
    #[serde(with = "crate::snapshot::blob")]
    pub debug_regs: kvm_debugregs,
    #[serde(with = "crate::snapshot::blob")]
    pub lapic: kvm_lapic_state,
    #[serde(with = "crate::snapshot::blob")]
    pub mp_state: kvm_mp_state,
    #[serde(with = "crate::snapshot::blob")]
    pub events: kvm_vcpu_events,
}

fn kvm_err(what: &'static str) -> impl Fn(kvm_ioctls::Error) -> VcpuError {
    move |source| VcpuError::Kvm { what, source }
}

fn list_err(what: &'static str) -> impl Fn(vmm_sys_util::fam::Error) -> VcpuError {
    move |e| VcpuError::List {
        what,
        detail: format!("{e:?}"),
    }
}

/// Reads every MSR KVM lists, skipping the few a host refuses to read back.
fn save_msrs(kvm: &Kvm, fd: &VcpuFd) -> Result<Vec<kvm_msr_entry>, VcpuError> {
    let indices = kvm.get_msr_index_list().map_err(kvm_err("list MSRs"))?;
    let mut saved = Vec::new();
    let mut pending: Vec<u32> = indices.as_slice().to_vec();
    while !pending.is_empty() {
        let entries: Vec<kvm_msr_entry> = pending
            .iter()
            .map(|&index| kvm_msr_entry {
                index,
                ..Default::default()
            })
            .collect();
        let mut msrs = Msrs::from_entries(&entries).map_err(list_err("MSR"))?;
        let read = fd.get_msrs(&mut msrs).map_err(kvm_err("read MSRs"))?;
        saved.extend_from_slice(&msrs.as_slice()[..read]);
        // KVM stops at the first MSR it cannot read: skip it and carry on.
        pending.drain(..(read + 1).min(pending.len()));
    }
    Ok(saved)
}

/// Saves a parked vCPU.
pub fn save_state(kvm: &Kvm, id: u8, fd: &VcpuFd) -> Result<VcpuState, VcpuError> {
    let cpuid = fd
        .get_cpuid2(kvm_bindings::KVM_MAX_CPUID_ENTRIES)
        .map_err(kvm_err("read CPUID"))?;
    // Tell the guest's kvmclock it was stopped, so it does not report a soft lockup.
    let _ = fd.kvmclock_ctrl();
    Ok(VcpuState {
        id,
        cpuid: cpuid.as_slice().to_vec(),
        msrs: save_msrs(kvm, fd)?,
        regs: fd.get_regs().map_err(kvm_err("read the registers"))?,
        sregs: fd.get_sregs().map_err(kvm_err("read segment registers"))?,
        xsave: fd.get_xsave().map_err(kvm_err("read FPU/XSAVE state"))?,
        xcrs: fd.get_xcrs().map_err(kvm_err("read XCRs"))?,
        debug_regs: fd
            .get_debug_regs()
            .map_err(kvm_err("read debug registers"))?,
        lapic: fd.get_lapic().map_err(kvm_err("read the local APIC"))?,
        mp_state: fd.get_mp_state().map_err(kvm_err("read the MP state"))?,
        events: fd
            .get_vcpu_events()
            .map_err(kvm_err("read pending events"))?,
    })
}

const MSR_IA32_TSC: u32 = 0x10;
const MSR_IA32_TSC_DEADLINE: u32 = 0x6e0;

/// KVM reads the TSC-deadline MSR back as 0 once the timer has fired, even when the guest
/// has not yet seen that interrupt; restoring the 0 disarms the timer and a tickless guest
/// waits for it forever. A deadline equal to the saved TSC fires at once instead, and one
/// early timer interrupt is harmless.
fn rearm_tsc_deadline(saved: &[kvm_msr_entry]) -> Vec<kvm_msr_entry> {
    let tsc = saved
        .iter()
        .find(|m| m.index == MSR_IA32_TSC)
        .map(|m| m.data);
    saved
        .iter()
        .map(|m| match (m.index, m.data, tsc) {
            (MSR_IA32_TSC_DEADLINE, 0, Some(tsc)) => kvm_msr_entry { data: tsc, ..*m },
            _ => *m,
        })
        .collect()
}

/// Loads a saved state into a fresh vCPU (order matters: CPUID first, events last).
pub fn restore_state(fd: &VcpuFd, state: &VcpuState) -> Result<(), VcpuError> {
    let cpuid = CpuId::from_entries(&state.cpuid).map_err(list_err("CPUID"))?;
    fd.set_cpuid2(&cpuid).map_err(kvm_err("set CPUID"))?;
    fd.set_mp_state(state.mp_state)
        .map_err(kvm_err("set the MP state"))?;
    fd.set_regs(&state.regs).map_err(kvm_err("set registers"))?;
    fd.set_sregs(&state.sregs)
        .map_err(kvm_err("set segment registers"))?;
    // SAFETY: the buffer came from KVM_GET_XSAVE on a vCPU of the same kind and is the
    // fixed-size legacy XSAVE area, which is what KVM_SET_XSAVE reads.
    unsafe { fd.set_xsave(&state.xsave) }.map_err(kvm_err("set FPU/XSAVE state"))?;
    fd.set_xcrs(&state.xcrs).map_err(kvm_err("set XCRs"))?;
    fd.set_debug_regs(&state.debug_regs)
        .map_err(kvm_err("set debug registers"))?;
    fd.set_lapic(&state.lapic)
        .map_err(kvm_err("set the local APIC"))?;
    let msrs = Msrs::from_entries(&rearm_tsc_deadline(&state.msrs)).map_err(list_err("MSR"))?;
    let written = fd.set_msrs(&msrs).map_err(kvm_err("set MSRs"))?;
    if written != state.msrs.len() {
        return Err(VcpuError::Msrs {
            written,
            total: state.msrs.len(),
            refused: state.msrs[written].index,
        });
    }
    fd.set_vcpu_events(&state.events)
        .map_err(kvm_err("set pending events"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msr(index: u32, data: u64) -> kvm_msr_entry {
        kvm_msr_entry {
            index,
            data,
            ..Default::default()
        }
    }

    #[test]
    fn exits_are_counted_by_address_and_by_time() {
        let stats = VcpuStats::default();
        stats.count("io_out", 0x3f8, 5_000_000);
        stats.count("io_out", 0x3f8, 250_000_000);
        stats.count("io_in", 0x64, 7_000_000);
        for at in [5_000_000, 250_000_000, 7_000_000, u64::MAX] {
            stats.count_at(at);
        }
        let by_address = stats.by_address();
        assert_eq!(by_address[0].address, "0x3f8");
        assert_eq!(by_address[0].count, 2);
        assert_eq!(by_address[0].first_ms, 5.0);
        assert_eq!(by_address[0].last_ms, 250.0);
        assert_eq!(by_address[1].count, 1);
        let by_time = stats.by_time();
        assert_eq!(
            by_time.len(),
            EXIT_BUCKETS,
            "late exits land in the last bucket"
        );
        assert_eq!(
            (by_time[0], by_time[2], by_time[EXIT_BUCKETS - 1]),
            (2, 1, 1)
        );
    }

    #[test]
    fn zero_tsc_deadline_is_rearmed_at_the_saved_tsc() {
        let saved = [
            msr(MSR_IA32_TSC, 5000),
            msr(0x1a0, 1),
            msr(MSR_IA32_TSC_DEADLINE, 0),
        ];
        let fixed = rearm_tsc_deadline(&saved);
        assert_eq!(fixed[2].data, 5000);
        assert_eq!(fixed[1].data, 1);
        let armed = [msr(MSR_IA32_TSC, 5000), msr(MSR_IA32_TSC_DEADLINE, 9000)];
        assert_eq!(rearm_tsc_deadline(&armed)[1].data, 9000);
    }
}
