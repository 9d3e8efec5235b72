//! `dsec-vmm`: boots one VM and exits when it stops.
//!
//! Exit status: 0 when the guest resets or powers off, 3 when the guest crashes
//! (triple fault or a vCPU error), 1 when the VM cannot be built.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use dsec_vmm::config::{DriveConfig, NetConfig, SerialOutput, VmConfig, VsockConfig};
use dsec_vmm::{RestoreOverrides, RunReport, Vm, VmExitReason};

#[derive(Parser, Debug)]
#[command(
    name = "dsec-vmm",
    version,
    about = "DSec microVM monitor: one VM per process"
)]
struct Args {
    /// JSON config file; flags given here override its fields.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Restore from a snapshot directory instead of booting (vsock, net and serial flags
    /// override the snapshot's, giving a fork its own identity).
    #[arg(long, conflicts_with_all = ["config", "kernel", "initrd", "cmdline", "vcpus", "mem_mib", "rng", "drives"])]
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
    /// the guest sees them in this order. Replaces the config file's drives.
    #[arg(long = "drive", value_name = "PATH[,ro]")]
    drives: Vec<DriveConfig>,
    /// Add a virtio-net device on a tap: `tap=NAME[,mac=AA:BB:CC:DD:EE:FF]`.
    #[arg(long, value_name = "tap=NAME[,mac=MAC]")]
    net: Option<NetConfig>,
    /// Append the serial console to this file.
    #[arg(long, conflicts_with = "serial_stdout")]
    serial_log: Option<PathBuf>,
    /// Copy the serial console to standard output.
    #[arg(long)]
    serial_stdout: bool,
    /// Write run metrics (exit reason, VM exits, boot milestones) as JSON here on exit.
    #[arg(long)]
    metrics_json: Option<PathBuf>,
}

fn build_config(args: &Args) -> Result<VmConfig, String> {
    let mut config = match (&args.config, &args.kernel) {
        (Some(path), _) => VmConfig::from_file(path).map_err(|e| e.to_string())?,
        (None, Some(kernel)) => VmConfig::new(kernel),
        (None, None) => return Err("no kernel given: pass --kernel PATH or --config FILE".into()),
    };
    if let Some(kernel) = &args.kernel {
        config.kernel = kernel.clone();
    }
    if let Some(initrd) = &args.initrd {
        config.initrd = Some(initrd.clone());
    }
    if let Some(cmdline) = &args.cmdline {
        config.cmdline = cmdline.clone();
    }
    if let Some(vcpus) = args.vcpus {
        config.vcpus = vcpus;
    }
    if let Some(mem) = args.mem_mib {
        config.mem_mib = mem;
    }
    if let Some(uds) = &args.vsock_uds {
        config.vsock = Some(VsockConfig {
            uds_path: uds.clone(),
            guest_cid: args.vsock_cid.unwrap_or(dsec_vmm::config::MIN_GUEST_CID),
        });
    }
    if args.rng {
        config.rng = true;
    }
    if !args.drives.is_empty() {
        config.drives = args.drives.clone();
    }
    if let Some(net) = &args.net {
        config.net = Some(net.clone());
    }
    if let Some(path) = &args.serial_log {
        config.serial = SerialOutput::File(path.clone());
    } else if args.serial_stdout {
        config.serial = SerialOutput::Stdout;
    }
    Ok(config)
}

fn main() -> ExitCode {
    let started_ns = dsec_vmm::vm::now_ns();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("DSEC_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let args = Args::parse();
    // Blocked here, before any thread exists, so every thread inherits the mask and only the
    // signal thread receives them: SIGTERM/SIGINT end the VM cleanly (sockets removed,
    // metrics written) instead of killing the process mid-write.
    let stop_signals = block_stop_signals();
    let (result, loaded_ns) = build_and_run(&args, stop_signals);
    let report = match result {
        Ok(r) => r,
        Err(e) => {
            eprintln!("dsec-vmm: {e}");
            return ExitCode::from(1);
        }
    };
    if let Some(path) = &args.metrics_json {
        let metrics = serde_json::json!({
            "exit_reason": report.reason.to_string(),
            "vm_exits": report.exits,
            "process_start_ns": started_ns,
            "vm_ready_ns": loaded_ns,
            "first_kvm_run_ns": report.first_kvm_run_ns,
            "first_serial_byte_ns": report.first_serial_byte_ns,
        });
        if let Err(e) = std::fs::write(path, metrics.to_string()) {
            eprintln!("dsec-vmm: cannot write metrics to {}: {e}", path.display());
        }
    }
    match report.reason {
        VmExitReason::Reset | VmExitReason::PowerOff | VmExitReason::Stopped => ExitCode::SUCCESS,
        reason => {
            eprintln!("dsec-vmm: {reason}");
            ExitCode::from(3)
        }
    }
}

fn overrides(args: &Args) -> RestoreOverrides {
    RestoreOverrides {
        vsock_uds: args.vsock_uds.clone(),
        vsock_cid: args.vsock_cid,
        serial: match (&args.serial_log, args.serial_stdout) {
            (Some(path), _) => Some(SerialOutput::File(path.clone())),
            (None, true) => Some(SerialOutput::Stdout),
            (None, false) => None,
        },
        net: args.net.clone(),
        lazy: args.lazy.then(|| dsec_vmm::LazyRestore {
            prefetch: args.prefetch,
            record: args
                .record_working_set
                .map(std::time::Duration::from_millis),
        }),
    }
}

/// Builds the VM shell now, then restores the snapshot named by the first restore request.
fn restore_prewarmed(
    args: &Args,
    sock: &std::path::Path,
) -> Result<(Vm, std::os::unix::net::UnixListener), String> {
    let shell = dsec_vmm::vm::Prewarmed::new(args.mem_mib.unwrap_or(256), args.vcpus.unwrap_or(1))
        .map_err(|e| e.to_string())?;
    let (request, answer, listener) =
        dsec_vmm::control::accept_restore(sock).map_err(|e| e.to_string())?;
    let started = std::time::Instant::now();
    let mut overrides = overrides(args);
    overrides.vsock_uds = request.vsock_uds.or(overrides.vsock_uds);
    overrides.vsock_cid = request.vsock_cid.or(overrides.vsock_cid);
    overrides.net = request.net.or(overrides.net);
    if request.lazy {
        overrides.lazy = Some(dsec_vmm::LazyRestore {
            prefetch: request.prefetch,
            record: None,
        });
    }
    let result =
        Vm::restore_into(Some(shell), &request.path, &overrides).map_err(|e| e.to_string());
    dsec_vmm::control::answer_restore(
        answer,
        result
            .as_ref()
            .map(|_| started.elapsed().as_secs_f64() * 1e3)
            .map_err(Clone::clone),
    );
    result.map(|vm| (vm, listener))
}

fn block_stop_signals() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data; sigemptyset/sigaddset initialise it, and
    // pthread_sigmask only changes this thread's mask.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

/// Waits for SIGTERM/SIGINT and turns it into a clean stop of the VM.
fn watch_stop_signals(vm: Arc<Vm>, set: libc::sigset_t) {
    let spawned = std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            let mut signal = 0;
            // SAFETY: `set` is an initialised signal set; sigwait writes one int.
            if unsafe { libc::sigwait(&set, &mut signal) } == 0 {
                vm.request_exit(VmExitReason::Stopped);
            }
        });
    if let Err(e) = spawned {
        eprintln!("dsec-vmm: cannot watch for SIGTERM ({e}); it will kill the VMM outright");
    }
}

fn build_and_run(args: &Args, stop_signals: libc::sigset_t) -> (Result<RunReport, String>, u64) {
    let mut prewarm_listener = None;
    let vm: Result<Vm, String> = match (&args.restore, args.prewarm, &args.api_sock) {
        (Some(dir), _, _) => Vm::restore(dir, &overrides(args)).map_err(|e| e.to_string()),
        (None, true, Some(sock)) => restore_prewarmed(args, sock).map(|(vm, listener)| {
            prewarm_listener = Some(listener);
            vm
        }),
        _ => build_config(args).and_then(|c| Vm::new(c).map_err(|e| e.to_string())),
    };
    let vm = match vm {
        Ok(vm) => Arc::new(vm),
        Err(e) => return (Err(e), 0),
    };
    let loaded_ns = dsec_vmm::vm::now_ns();
    watch_stop_signals(vm.clone(), stop_signals);
    let uds = vm.config().vsock.as_ref().map(|v| v.uds_path.clone());
    // Start before serving requests: a request must never see the VM mid-start.
    if !args.paused {
        vm.start();
    }
    let served = match (prewarm_listener, &args.api_sock) {
        (Some(listener), _) => dsec_vmm::control::serve_on(vm.clone(), listener),
        (None, Some(sock)) => dsec_vmm::control::serve(vm.clone(), sock),
        (None, None) => Ok(()),
    };
    if let Err(e) = served {
        return (Err(e.to_string()), loaded_ns);
    }
    let report = vm.wait();
    // Device threads die with the process: remove the sockets they own here.
    if let Some(uds) = uds {
        let _ = std::fs::remove_file(uds);
    }
    if let Some(sock) = &args.api_sock {
        let _ = std::fs::remove_file(sock);
    }
    (Ok(report), loaded_ns)
}
