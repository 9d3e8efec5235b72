//! `dsec-vmm`: boots one VM and exits when it stops.
//!
//! Exit status: 0 when the guest resets or powers off, 3 when the guest crashes
//! (triple fault or a vCPU error), 1 when the VM cannot be built.

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

use dsec_vmm::config::{ConfigError, SerialOutput, VmConfig};
use dsec_vmm::jail::{Exposure, JailError};
use dsec_vmm::seccomp::SeccompError;
use dsec_vmm::snapshot::SnapshotError;
use dsec_vmm::{RestoreOverrides, RunReport, Vm, VmError, VmExitReason};
use dsec_vmm_api::control::RestoreReply;
use dsec_vmm_api::launch::{
    BootOverrides, JailLaunch, LaunchError, LaunchMode, LazyLaunch, PrewarmLaunch,
    SnapshotOverrides, VmmLaunch,
};

/// Why the VMM could not start (or run) its VM; printed as `dsec-vmm: ...`, exit status 1.
#[derive(Debug, thiserror::Error)]
enum MainError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Vm(#[from] VmError),
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    #[error(transparent)]
    Jail(#[from] JailError),
    #[error(transparent)]
    ParentOutside(#[from] dsec_vmm::snapshot::ParentOutside),
    #[error(transparent)]
    Seccomp(#[from] SeccompError),
    #[error("control socket: {0}")]
    Control(std::io::Error),
    #[error("cannot resolve {path} to an absolute path for the jail: {source}")]
    Resolve {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
}

/// A config file with its flag overrides applied.
fn file_config(path: &Path, overrides: &BootOverrides) -> Result<VmConfig, ConfigError> {
    let mut config = VmConfig::from_file(path)?;
    overrides.apply(&mut config);
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
    let launch = match VmmLaunch::parse_from(std::env::args_os()) {
        Ok(launch) => launch,
        Err(LaunchError::Usage(e)) => e.exit(),
        Err(e) => {
            eprintln!("dsec-vmm: {e}");
            return ExitCode::from(1);
        }
    };
    // Blocked here, before any thread exists, so every thread inherits the mask and only the
    // signal thread receives them: SIGTERM/SIGINT end the VM cleanly (sockets removed,
    // metrics written) instead of killing the process mid-write.
    let stop_signals = block_stop_signals();
    let args_parsed_ns = dsec_vmm::vm::now_ns();
    if !launch.no_seccomp {
        if let Err(e) = dsec_vmm::seccomp::enable() {
            eprintln!("dsec-vmm: {e}");
            return ExitCode::from(1);
        }
    }
    if let Some(jail) = &launch.jail {
        if let Err(e) = enter_jail(&launch, jail) {
            eprintln!("dsec-vmm: {e}");
            return ExitCode::from(1);
        }
        if let Some(path) = &jail.check {
            return jail_check(jail, path);
        }
    }
    let setup_done_ns = dsec_vmm::vm::now_ns();
    let (result, loaded_ns) = build_and_run(&launch, stop_signals);
    let report = match result {
        Ok(r) => r,
        Err(e) => {
            eprintln!("dsec-vmm: {e}");
            return ExitCode::from(1);
        }
    };
    if let Some(path) = &launch.metrics_json {
        let metrics = serde_json::json!({
            "exit_reason": report.reason.to_string(),
            "vm_exits": report.exits,
            "process_start_ns": started_ns,
            "args_parsed_ns": args_parsed_ns,
            "seccomp_and_jail_ready_ns": setup_done_ns,
            "vm_ready_ns": loaded_ns,
            "first_kvm_run_ns": report.first_kvm_run_ns,
            "first_serial_byte_ns": report.first_serial_byte_ns,
            "build_steps_ns": report.steps.iter().map(|(step, ns)| serde_json::json!({"step": step, "ns": ns})).collect::<Vec<_>>(),
            "exits_by_address": report.exits_by_address,
            "exit_bucket_ms": dsec_vmm::vcpu::EXIT_BUCKET_MS,
            "exits_by_time": report.exits_by_time,
            "kvm_vcpu_stats": report.kvm_vcpu_stats,
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

fn restore_overrides(o: &SnapshotOverrides, lazy: Option<&LazyLaunch>) -> RestoreOverrides {
    RestoreOverrides {
        vsock_uds: o.vsock_uds.clone(),
        vsock_cid: o.vsock_cid,
        serial: o.serial.clone(),
        net: o.net.clone(),
        drives: o.drives.clone(),
        contained_chain: o.contained_chain,
        lazy: lazy.map(|l| dsec_vmm::LazyRestore {
            prefetch: l.prefetch,
            record: l
                .record_working_set_ms
                .map(std::time::Duration::from_millis),
        }),
    }
}

/// Everything the VM will open, made visible in the jail at the same paths.
fn jail_exposures(launch: &VmmLaunch, jail: &JailLaunch) -> Result<Vec<Exposure>, MainError> {
    let mut expose = Vec::new();
    let parent_rw = |path: &Path| {
        let dir = path.parent().filter(|p| !p.as_os_str().is_empty());
        Exposure::writable(dir.unwrap_or(Path::new(".")))
    };
    let mut drives = Vec::new();
    let mut pmem = Vec::new();
    let mut vsock = None;
    let mut overrides = None;
    let boot = match &launch.mode {
        LaunchMode::Boot(config) => Some(config.clone()),
        LaunchMode::BootFile { config, overrides } => Some(file_config(config, overrides)?),
        LaunchMode::Restore(_) | LaunchMode::Prewarm(_) => None,
    };
    match (&launch.mode, boot) {
        (_, Some(config)) => {
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
        (LaunchMode::Restore(restore), None) => {
            let dir = &restore.snapshot;
            let state = dsec_vmm::snapshot::read_state(dir)?;
            let records = restore
                .lazy
                .as_ref()
                .is_some_and(|l| l.record_working_set_ms.is_some());
            expose.push(if records {
                Exposure::writable(dir)
            } else {
                Exposure::read_only(dir)
            });
            // A diff snapshot reads its parents too.
            let (mut child, mut parent) = (dir.clone(), state.memory.parent.clone());
            // Bounded like the restore's own chain walk, which refuses a longer one.
            for _ in 0..dsec_vmm::snapshot::MAX_CHAIN {
                let Some(p) = parent else { break };
                // Checked before anything outside the jail is read or exposed for it.
                if restore.overrides.contained_chain {
                    dsec_vmm::snapshot::check_contained(&p)?;
                }
                let p = dsec_vmm::snapshot::parent_dir(&child, &p);
                parent = dsec_vmm::snapshot::read_state(&p)?.memory.parent;
                expose.push(Exposure::read_only(&p));
                child = p;
            }
            drives = state.config.drives.clone();
            pmem = state.config.pmem.clone();
            vsock = state.config.vsock.as_ref().map(|v| v.uds_path.clone());
            overrides = Some(&restore.overrides);
        }
        (LaunchMode::Prewarm(prewarm), None) => overrides = Some(&prewarm.overrides),
        (LaunchMode::Boot(_) | LaunchMode::BootFile { .. }, None) => {}
    }
    if let Some(o) = overrides {
        if !o.drives.is_empty() {
            drives = o.drives.clone();
        }
        vsock = o.vsock_uds.clone().or(vsock);
        if let Some(SerialOutput::File(path)) = &o.serial {
            expose.push(parent_rw(path));
        }
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
    for path in [vsock, launch.api_sock.clone(), launch.metrics_json.clone()]
        .into_iter()
        .flatten()
    {
        expose.push(parent_rw(&path));
    }
    expose.extend(jail.expose.iter().map(|e| Exposure {
        path: e.path.clone(),
        writable: e.writable,
    }));
    // Absolute paths: the jail recreates them under its root. Each path once (the sockets
    // and logs often share a directory), writable if any use needs it.
    let mut unique: Vec<Exposure> = Vec::new();
    for e in expose {
        let path = std::path::absolute(&e.path).map_err(|source| MainError::Resolve {
            path: e.path.clone(),
            source,
        })?;
        match unique.iter_mut().find(|u| u.path == path) {
            Some(u) => u.writable |= e.writable,
            None => unique.push(Exposure { path, ..e }),
        }
    }
    Ok(unique)
}

fn enter_jail(launch: &VmmLaunch, jail: &JailLaunch) -> Result<(), MainError> {
    let expose = jail_exposures(launch, jail)?;
    dsec_vmm::seccomp::allow_privilege_drop_to(jail.uid, jail.gid);
    let root = std::path::absolute(&jail.root).map_err(|source| MainError::Resolve {
        path: jail.root.clone(),
        source,
    })?;
    dsec_vmm::jail::enter(&dsec_vmm::jail::JailSpec {
        root,
        uid: jail.uid,
        gid: jail.gid,
        netns: jail.netns.clone(),
        expose,
        max_open_files: 4096,
    })?;
    Ok(())
}

/// What a jailed, filtered VMM can still do: prints its view, then makes a forbidden call.
fn jail_check(jail: &JailLaunch, path: &Path) -> ExitCode {
    if let Err(e) = dsec_vmm::jail::drop_privileges(jail.uid, jail.gid) {
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
    prewarm: &PrewarmLaunch,
    sock: &Path,
) -> Result<(Vm, std::os::unix::net::UnixListener), MainError> {
    // No priority of its own while it waits: the daemon starts pool VMMs at nice 19 and
    // renices a taken one's threads.
    let shell = dsec_vmm::vm::Prewarmed::new(prewarm.mem_mib, prewarm.vcpus)?;
    match shell.rehearse_state_decoding() {
        Ok(took) => tracing::debug!(ms = took.as_secs_f64() * 1e3, "state decoding rehearsed"),
        Err(e) => tracing::debug!("state decoding not rehearsed: {e}"),
    }
    // The jail's ids are set by now (enter_jail runs first), which the filters need.
    dsec_vmm::seccomp::precompile()?;
    let (request, answer, listener) =
        dsec_vmm::control::accept_restore(sock).map_err(MainError::Control)?;
    let started = std::time::Instant::now();
    let mut overrides = restore_overrides(&prewarm.overrides, None);
    overrides.vsock_uds = request.vsock_uds.or(overrides.vsock_uds);
    overrides.vsock_cid = request.vsock_cid.or(overrides.vsock_cid);
    overrides.net = request.net.or(overrides.net);
    if request.lazy {
        overrides.lazy = Some(dsec_vmm::LazyRestore {
            prefetch: request.prefetch,
            record: None,
        });
    }
    let result = Vm::restore_into(Some(shell), &request.path, &overrides);
    dsec_vmm::control::answer_restore(
        answer,
        result.as_ref().map(|vm| RestoreReply {
            restore_ms: started.elapsed().as_secs_f64() * 1e3,
            steps: vm.restore_steps().clone(),
        }),
    );
    Ok(result.map(|vm| (vm, listener))?)
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

fn build_vm(
    launch: &VmmLaunch,
) -> Result<(Vm, Option<std::os::unix::net::UnixListener>), MainError> {
    match (&launch.mode, &launch.api_sock) {
        (LaunchMode::Restore(r), _) => {
            let overrides = restore_overrides(&r.overrides, r.lazy.as_ref());
            Ok((Vm::restore(&r.snapshot, &overrides)?, None))
        }
        (LaunchMode::Prewarm(p), Some(sock)) => {
            restore_prewarmed(p, sock).map(|(vm, listener)| (vm, Some(listener)))
        }
        // A prewarmed VMM without a socket cannot be asked to restore: clap refuses it.
        (LaunchMode::Prewarm(_), None) => Err(MainError::Control(std::io::Error::other(
            "--prewarm needs --api-sock",
        ))),
        (LaunchMode::Boot(config), _) => Ok((Vm::new(config.clone())?, None)),
        (LaunchMode::BootFile { config, overrides }, _) => {
            Ok((Vm::new(file_config(config, overrides)?)?, None))
        }
    }
}

fn build_and_run(
    launch: &VmmLaunch,
    stop_signals: libc::sigset_t,
) -> (Result<RunReport, MainError>, u64) {
    let (vm, prewarm_listener) = match build_vm(launch) {
        Ok(built) => built,
        Err(e) => return (Err(e), 0),
    };
    let vm = Arc::new(vm);
    let loaded_ns = dsec_vmm::vm::now_ns();
    // Bound now, served once the VM runs: connections wait in the backlog until then.
    let control = match (prewarm_listener, &launch.api_sock) {
        (Some(listener), _) => Some(listener),
        (None, Some(sock)) => match dsec_vmm::control::bind(sock) {
            Ok(listener) => Some(listener),
            Err(e) => return (Err(MainError::Control(e)), loaded_ns),
        },
        (None, None) => None,
    };
    if let Some(jail) = &launch.jail {
        if let Err(e) = dsec_vmm::jail::drop_privileges(jail.uid, jail.gid) {
            return (Err(e.into()), loaded_ns);
        }
    }
    if let Err(e) = vm.defer_teardown() {
        eprintln!("dsec-vmm: cannot start the teardown helper ({e}); exit will be slower");
    }
    // Setup is over: from here on the main thread only waits, serves and cleans up.
    if let Err(e) = dsec_vmm::seccomp::install(dsec_vmm::seccomp::ThreadKind::Vmm) {
        return (Err(e.into()), loaded_ns);
    }
    watch_stop_signals(vm.clone(), stop_signals);
    let uds = vm.config().vsock.as_ref().map(|v| v.uds_path.clone());
    // Start before serving requests: a request must never see the VM mid-start.
    if !launch.paused {
        vm.start();
    }
    let served = match control {
        Some(listener) => dsec_vmm::control::serve_on(vm.clone(), listener),
        None => Ok(()),
    };
    if let Err(e) = served {
        return (Err(MainError::Control(e)), loaded_ns);
    }
    let report = vm.wait();
    // The process is about to exit without tearing anything down (see `defer_teardown`):
    // keep the VM alive until then, so that the last reference to a device is never dropped
    // on a vCPU thread, whose seccomp filter forbids what a device's drop does (the vsock
    // device unlinks its socket: SIGSYS, exit status 159, metrics never written).
    std::mem::forget(vm.clone());
    // Device threads die with the process: remove the sockets they own here.
    if let Some(uds) = uds {
        let _ = std::fs::remove_file(uds);
    }
    if let Some(sock) = &launch.api_sock {
        let _ = std::fs::remove_file(sock);
    }
    (Ok(report), loaded_ns)
}
