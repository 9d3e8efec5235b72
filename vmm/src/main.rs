//! `dsec-vmm`: boots one VM and exits when it stops.
//!
//! Exit status: 0 when the guest resets or powers off, 3 when the guest crashes
//! (triple fault or a vCPU error), 1 when the VM cannot be built.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use dsec_vmm::config::{
    BalloonConfig, DriveConfig, NetConfig, PmemConfig, SerialOutput, VmConfig, VsockConfig,
};
use dsec_vmm::jail::Exposure;
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
    #[arg(long, default_value_t = 65534, requires = "jail")]
    jail_uid: u32,
    #[arg(long, default_value_t = 65534, requires = "jail")]
    jail_gid: u32,
    /// Join this network namespace (e.g. /run/netns/sb1) instead of a new, empty one.
    #[arg(long, value_name = "PATH", requires = "jail")]
    jail_netns: Option<PathBuf>,
    /// Also make PATH visible in the jail (read-only; `,rw` for writable), e.g. where
    /// snapshots are written or, for --prewarm, where they are read from.
    #[arg(long = "jail-expose", value_name = "PATH[,rw]", requires = "jail")]
    jail_expose: Vec<dsec_vmm::jail::Exposure>,
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
    if let Some(balloon) = &args.balloon {
        config.balloon = Some(balloon.clone());
    }
    if !args.pmem.is_empty() {
        config.pmem = args.pmem.clone();
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
    if !args.no_seccomp {
        if let Err(e) = dsec_vmm::seccomp::enable() {
            eprintln!("dsec-vmm: {e}");
            return ExitCode::from(1);
        }
    }
    if let Some(root) = &args.jail {
        if let Err(e) = enter_jail(&args, root) {
            eprintln!("dsec-vmm: {e}");
            return ExitCode::from(1);
        }
        if let Some(path) = &args.jail_check {
            return jail_check(&args, path);
        }
    }
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
        drives: args.drives.clone(),
        lazy: args.lazy.then(|| dsec_vmm::LazyRestore {
            prefetch: args.prefetch,
            record: args
                .record_working_set
                .map(std::time::Duration::from_millis),
        }),
    }
}

/// Everything the VM will open, made visible in the jail at the same paths.
fn jail_exposures(args: &Args) -> Result<Vec<Exposure>, String> {
    let mut expose = Vec::new();
    let parent_rw = |path: &Path| {
        let dir = path.parent().filter(|p| !p.as_os_str().is_empty());
        Exposure::writable(dir.unwrap_or(Path::new(".")))
    };
    let mut drives = Vec::new();
    let mut pmem = Vec::new();
    let mut vsock = None;
    match (&args.restore, args.prewarm) {
        (Some(dir), _) => {
            let state = dsec_vmm::snapshot::read_state(dir).map_err(|e| e.to_string())?;
            expose.push(if args.record_working_set.is_some() {
                Exposure::writable(dir)
            } else {
                Exposure::read_only(dir)
            });
            // A diff snapshot reads its parents too.
            let mut parent = state.memory.parent.clone();
            while let Some(p) = parent {
                parent = dsec_vmm::snapshot::read_state(&p)
                    .map_err(|e| e.to_string())?
                    .memory
                    .parent;
                expose.push(Exposure::read_only(p));
            }
            drives = state.config.drives.clone();
            pmem = state.config.pmem.clone();
            vsock = state.config.vsock.as_ref().map(|v| v.uds_path.clone());
        }
        (None, true) => {}
        (None, false) => {
            let config = build_config(args)?;
            expose.push(Exposure::read_only(&config.kernel));
            if let Some(initrd) = &config.initrd {
                expose.push(Exposure::read_only(initrd));
            }
            if let SerialOutput::File(path) = &config.serial {
                expose.push(parent_rw(path));
            }
            drives = config.drives.clone();
            pmem = config.pmem.clone();
            vsock = config.vsock.as_ref().map(|v| v.uds_path.clone());
        }
    }
    if !args.drives.is_empty() {
        drives = args.drives.clone();
    }
    for d in drives {
        expose.push(Exposure {
            writable: !d.read_only,
            path: d.path,
        });
    }
    for p in pmem {
        expose.push(Exposure {
            writable: !p.read_only,
            path: p.path,
        });
    }
    for path in [
        args.vsock_uds.clone().or(vsock),
        args.api_sock.clone(),
        args.serial_log.clone(),
        args.metrics_json.clone(),
    ]
    .into_iter()
    .flatten()
    {
        expose.push(parent_rw(&path));
    }
    expose.extend(args.jail_expose.iter().cloned());
    // Absolute paths: the jail recreates them under its root. Each path once (the sockets
    // and logs often share a directory), writable if any use needs it.
    let mut unique: Vec<Exposure> = Vec::new();
    for e in expose {
        let path = std::path::absolute(&e.path)
            .map_err(|err| format!("resolve {}: {err}", e.path.display()))?;
        match unique.iter_mut().find(|u| u.path == path) {
            Some(u) => u.writable |= e.writable,
            None => unique.push(Exposure { path, ..e }),
        }
    }
    Ok(unique)
}

fn enter_jail(args: &Args, root: &Path) -> Result<(), String> {
    let expose = jail_exposures(args)?;
    dsec_vmm::seccomp::allow_privilege_drop_to(args.jail_uid, args.jail_gid);
    let root = std::path::absolute(root).map_err(|e| format!("resolve --jail: {e}"))?;
    dsec_vmm::jail::enter(&dsec_vmm::jail::JailSpec {
        root,
        uid: args.jail_uid,
        gid: args.jail_gid,
        netns: args.jail_netns.clone(),
        expose,
        max_open_files: 4096,
    })
    .map_err(|e| e.to_string())
}

/// What a jailed, filtered VMM can still do: prints its view, then makes a forbidden call.
fn jail_check(args: &Args, path: &Path) -> ExitCode {
    if let Err(e) = dsec_vmm::jail::drop_privileges(args.jail_uid, args.jail_gid) {
        eprintln!("dsec-vmm: {e}");
        return ExitCode::from(1);
    }
    if let Err(e) = dsec_vmm::seccomp::install(dsec_vmm::seccomp::ThreadKind::Vmm) {
        eprintln!("dsec-vmm: {e}");
        return ExitCode::from(1);
    }
    // SAFETY: getpid/getuid cannot fail.
    let (pid, uid) = unsafe { (libc::getpid(), libc::getuid()) };
    println!("jail-check: pid {pid} uid {uid}");
    match std::fs::File::open(path) {
        Ok(_) => println!("jail-check: opened {}", path.display()),
        Err(e) => println!("jail-check: cannot open {}: {e}", path.display()),
    }
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let sh = std::ffi::CString::new("/bin/sh").unwrap_or_default();
    let argv = [sh.as_ptr(), std::ptr::null()];
    // SAFETY: execv with a NUL-terminated path and a NULL-terminated argv; it is expected to
    // be refused by the seccomp filter (the process then stops with status 159).
    unsafe { libc::execv(sh.as_ptr(), argv.as_ptr()) };
    println!(
        "jail-check: execv returned: {}",
        std::io::Error::last_os_error()
    );
    ExitCode::from(1)
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
            dsec_vmm::seccomp::install_or_exit(dsec_vmm::seccomp::ThreadKind::Vmm);
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
    // Bound now, served once the VM runs: connections wait in the backlog until then.
    let control = match (prewarm_listener, &args.api_sock) {
        (Some(listener), _) => Some(listener),
        (None, Some(sock)) => match dsec_vmm::control::bind(sock) {
            Ok(listener) => Some(listener),
            Err(e) => return (Err(e.to_string()), loaded_ns),
        },
        (None, None) => None,
    };
    if args.jail.is_some() {
        if let Err(e) = dsec_vmm::jail::drop_privileges(args.jail_uid, args.jail_gid) {
            return (Err(e.to_string()), loaded_ns);
        }
    }
    if let Err(e) = vm.defer_teardown() {
        eprintln!("dsec-vmm: cannot start the teardown helper ({e}); exit will be slower");
    }
    // Setup is over: from here on the main thread only waits, serves and cleans up.
    if let Err(e) = dsec_vmm::seccomp::install(dsec_vmm::seccomp::ThreadKind::Vmm) {
        return (Err(e.to_string()), loaded_ns);
    }
    watch_stop_signals(vm.clone(), stop_signals);
    let uds = vm.config().vsock.as_ref().map(|v| v.uds_path.clone());
    // Start before serving requests: a request must never see the VM mid-start.
    if !args.paused {
        vm.start();
    }
    let served = match control {
        Some(listener) => dsec_vmm::control::serve_on(vm.clone(), listener),
        None => Ok(()),
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
