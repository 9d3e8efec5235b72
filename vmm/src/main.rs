//! `dsec-vmm`: boots one VM and exits when it stops.
//!
//! Exit status: 0 when the guest resets or powers off, 3 when the guest crashes
//! (triple fault or a vCPU error), 1 when the VM cannot be built.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use dsec_vmm::config::{SerialOutput, VmConfig, VsockConfig};
use dsec_vmm::VmExitReason;

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
    /// Guest vsock context id.
    #[arg(long, default_value_t = 3)]
    vsock_cid: u64,
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
            guest_cid: args.vsock_cid,
        });
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
    let config = match build_config(&args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("dsec-vmm: {e}");
            return ExitCode::from(1);
        }
    };
    let result = dsec_vmm::run(&config);
    // The vsock device lives on in vCPU threads that die with the process: clean up here.
    if let Some(vsock) = &config.vsock {
        let _ = std::fs::remove_file(&vsock.uds_path);
    }
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
            "first_kvm_run_ns": report.first_kvm_run_ns,
            "first_serial_byte_ns": report.first_serial_byte_ns,
        });
        if let Err(e) = std::fs::write(path, metrics.to_string()) {
            eprintln!("dsec-vmm: cannot write metrics to {}: {e}", path.display());
        }
    }
    match report.reason {
        VmExitReason::Reset | VmExitReason::PowerOff => ExitCode::SUCCESS,
        reason => {
            eprintln!("dsec-vmm: {reason}");
            ExitCode::from(3)
        }
    }
}
