//! `dsec vm ...`: drive single microVMs directly through `dsec-vmm` — boot one in the
//! background, run commands in it, pause, snapshot, restore and fork it. The node daemon
//! offers the same through its API; these commands work without one (and inside the rig).
//!
//! A VM lives in a directory: `api.sock` (the VMM's control socket), `vsock.sock` (its
//! agent), `serial.log`, `vmm.log` and `pid`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use dsec_edge::microvm::{control_call, random_mac, MicroVmDir, SpawnOptions, StartingMicroVm};
use dsec_edge::{AgentClient, Artifacts, ExecSpec, MicroVm};
use dsec_vmm_api::control::{BalloonReply, Done, Request, SnapshotReply, StatusReply};
use dsec_vmm_api::{LazyLaunch, NetConfig, RestoreLaunch, VmConfig, VmmLaunch, VsockConfig};

/// Guest command line for the default image: quiet console (every byte is a VM exit).
const CMDLINE: &str = "console=ttyS0 reboot=k panic=-1 quiet";

#[derive(clap::Subcommand, Debug)]
pub enum VmCommand {
    /// Boot a microVM in the background and wait until its agent answers.
    Boot {
        /// Directory for the VM's sockets and logs (must not exist).
        dir: PathBuf,
        #[arg(long)]
        kernel: Option<PathBuf>,
        #[arg(long)]
        initrd: Option<PathBuf>,
        #[arg(long, default_value_t = 1)]
        vcpus: u8,
        #[arg(long = "mem", value_name = "MiB", default_value_t = 256)]
        mem_mib: u64,
        #[arg(long, default_value_t = 3)]
        cid: u64,
        /// Attach a virtio-net device on this tap (the VMM creates it if it does not exist).
        #[arg(long, value_name = "tap=NAME[,mac=MAC]")]
        net: Option<NetConfig>,
        /// Seconds to wait for the agent.
        #[arg(long, default_value_t = 120.0)]
        boot_timeout: f64,
    },
    /// Run a command in the VM through its agent; exits with the command's exit code.
    Exec {
        dir: PathBuf,
        #[arg(trailing_var_arg = true, required = true)]
        argv: Vec<String>,
    },
    /// Run shell text in a persistent session of the VM's agent (cwd, exports and shell
    /// state carry over between calls, and across snapshot/restore). Without --id a new
    /// session is created and its id printed on the first line.
    Session {
        dir: PathBuf,
        /// The session to run in (as printed by an earlier call).
        #[arg(long)]
        id: Option<String>,
        /// Shell text, run as-is by the session's shell.
        #[arg(trailing_var_arg = true, required = true)]
        command: Vec<String>,
    },
    /// Pause the VM's vCPUs and devices.
    Pause { dir: PathBuf },
    /// Print the VMM's status as JSON: run state, shape, lazy-restore counters and KVM's own
    /// vCPU counters (exits, nested page faults as `pf_taken`, halts, ...).
    Status { dir: PathBuf },
    /// Resume a paused VM.
    Resume { dir: PathBuf },
    /// Snapshot the VM into SNAPSHOT (a new directory); a running VM is paused meanwhile.
    Snapshot {
        dir: PathBuf,
        snapshot: PathBuf,
        /// Only pages written since the previous snapshot of this VM.
        #[arg(long, conflicts_with = "base")]
        diff: bool,
        /// Only pages that differ from the full snapshot this restored VM maps; BASE is
        /// recorded as the parent (relative to SNAPSHOT when relative) and must hold a copy
        /// of that snapshot when this one is restored.
        #[arg(long)]
        base: Option<PathBuf>,
    },
    /// Restore a snapshot into a new VM directory and wait until its agent answers.
    Restore {
        snapshot: PathBuf,
        dir: PathBuf,
        /// Give the restored guest this CID (default: the snapshot's).
        #[arg(long)]
        cid: Option<u64>,
        /// Fill memory lazily through userfaultfd.
        #[arg(long)]
        lazy: bool,
        /// With --lazy: load the working set recorded in the snapshot in the background.
        #[arg(long, requires = "lazy")]
        prefetch: bool,
        /// With --lazy: record the pages the guest touches in its first MS milliseconds as
        /// the snapshot's working set (for --prefetch).
        #[arg(long, requires = "lazy", value_name = "MS")]
        record_working_set: Option<u64>,
        /// Put the snapshot's network device on this tap, with a new random MAC that the
        /// agent also gives the guest interface.
        #[arg(long, value_name = "TAP")]
        tap: Option<String>,
        #[arg(long, default_value_t = 120.0)]
        boot_timeout: f64,
    },
    /// Start N children from a snapshot, or from a running VM's directory (paused,
    /// snapshotted into PREFIX.snapshot, resumed), each with its own vsock socket, entropy
    /// and clock, and with --tap-prefix its own tap and MAC. They keep the snapshot's guest
    /// CID unless --first-cid is given (the CID only addresses the guest on its own device;
    /// the guest learns a new one from the vsock transport reset).
    Fork {
        /// A snapshot directory, or the directory of a running VM.
        source: PathBuf,
        /// Children are created as PREFIX-0, PREFIX-1, ...
        prefix: PathBuf,
        #[arg(short = 'n', long, default_value_t = 1)]
        count: u32,
        /// Give child i the CID FIRST_CID + i.
        #[arg(long)]
        first_cid: Option<u64>,
        /// Put child i's network device on tap TAP_PREFIX<i> with a MAC of its own.
        #[arg(long)]
        tap_prefix: Option<String>,
        #[arg(long, default_value_t = 120.0)]
        boot_timeout: f64,
    },
    /// Print the VM's balloon (target, actual size, the guest's statistics) as JSON; with
    /// --target-mib first ask the guest to hand over that much memory (0 gives it all back).
    Balloon {
        dir: PathBuf,
        #[arg(long, value_name = "MiB")]
        target_mib: Option<u64>,
    },
    /// Stop the VM (its VMM exits) and remove its directory.
    Rm { dir: PathBuf },
}

#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("{0}")]
    Usage(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Edge(#[from] dsec_edge::EdgeError),
    #[error("the agent refused: {}: {}", .0.code(), .0.message())]
    Agent(#[from] tonic::Status),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> VmError {
    let what = what.into();
    move |source| VmError::Io { what, source }
}

/// One request on the VM's control socket.
async fn control<T: serde::de::DeserializeOwned + Send + 'static>(
    dir: &Path,
    request: Request,
) -> Result<T, VmError> {
    Ok(control_call(MicroVmDir::new(dir).control(), request).await?)
}

fn agent(dir: &Path) -> AgentClient {
    AgentClient::connect_lazy(MicroVmDir::new(dir).agent_addr())
}

/// Starts `dsec-vmm` for `launch` in the new directory `dir`; it runs in its own session, so
/// it outlives this command once detached.
fn start(dir: &Path, launch: VmmLaunch) -> Result<StartingMicroVm, VmError> {
    let options = SpawnOptions::find(None).map_err(|_| {
        VmError::Usage("dsec-vmm not found next to dsec, in $DSEC_HOME/bin or on PATH".into())
    })?;
    if dir.exists() {
        return Err(VmError::Usage(format!(
            "{} already exists; pick a new VM directory",
            dir.display()
        )));
    }
    std::fs::create_dir_all(dir).map_err(io(format!("create {}", dir.display())))?;
    Ok(MicroVm::spawn(&options, &MicroVmDir::new(dir), launch)?)
}

/// A restore of `snapshot`, with the guest CID `cid` and, on `tap`, a network device with a
/// new random MAC (which the agent also gives the guest interface).
fn restore_launch(
    snapshot: &Path,
    cid: Option<u64>,
    tap: Option<String>,
    lazy: Option<LazyLaunch>,
) -> Result<VmmLaunch, VmError> {
    let mut restore = RestoreLaunch::new(snapshot);
    restore.lazy = lazy;
    restore.overrides.vsock_cid = cid;
    restore.overrides.net = tap
        .map(|tap| {
            random_mac().map(|mac| NetConfig {
                tap,
                mac: Some(mac),
            })
        })
        .transpose()?;
    Ok(VmmLaunch::restore(restore))
}

fn timeout(seconds: f64) -> Duration {
    Duration::from_secs_f64(seconds.max(0.1))
}

pub async fn run(command: VmCommand) -> Result<i32, VmError> {
    match command {
        VmCommand::Boot {
            dir,
            kernel,
            initrd,
            vcpus,
            mem_mib,
            cid,
            net,
            boot_timeout,
        } => {
            let artifacts = Artifacts::from_env();
            let mut config = VmConfig::new(kernel.unwrap_or(artifacts.kernel));
            config.initrd = Some(initrd.unwrap_or(artifacts.initramfs));
            config.cmdline = CMDLINE.into();
            config.vcpus = vcpus;
            config.mem_mib = mem_mib;
            // The socket path is the VM directory's; the CID is ours to pick.
            config.vsock = Some(VsockConfig {
                uds_path: PathBuf::new(),
                guest_cid: cid,
            });
            config.net = net;
            let vm = start(&dir, VmmLaunch::boot(config))?
                .ready(timeout(boot_timeout))
                .await?;
            println!(
                "booted {} (pid {}): agent ready after {:.0} ms",
                dir.display(),
                vm.pid(),
                vm.ready_after().as_secs_f64() * 1e3
            );
            vm.detach();
            Ok(0)
        }
        VmCommand::Exec { dir, argv } => {
            let outcome = agent(&dir)
                .exec(
                    &ExecSpec::new(argv),
                    None::<tokio::io::Stdin>,
                    &mut tokio::io::stdout(),
                    &mut tokio::io::stderr(),
                )
                .await?;
            Ok(outcome.exit_code())
        }
        VmCommand::Session { dir, id, command } => {
            use dsec_api::agent::v1::sessions_client::SessionsClient;
            use dsec_api::agent::v1::{CreateSessionRequest, RunInSessionRequest};
            let mut sessions = SessionsClient::new(agent(&dir).channel());
            let session_id = match id {
                Some(id) => id,
                None => {
                    let info = sessions
                        .create_session(CreateSessionRequest::default())
                        .await?
                        .into_inner();
                    println!("{}", info.session_id);
                    info.session_id
                }
            };
            let result = sessions
                .run_in_session(RunInSessionRequest {
                    session_id,
                    command: command.join(" "),
                    wait: true,
                    ..Default::default()
                })
                .await?
                .into_inner();
            std::io::stdout()
                .write_all(&result.output)
                .map_err(io("write the output"))?;
            Ok(result.exit_code.unwrap_or(1))
        }
        VmCommand::Pause { dir } => {
            control::<Done>(&dir, Request::Pause).await?;
            println!("paused {}", dir.display());
            Ok(0)
        }
        VmCommand::Status { dir } => {
            let reply: StatusReply = control(&dir, Request::Status).await?;
            print_json(&reply, "the status reply")
        }
        VmCommand::Balloon { dir, target_mib } => {
            let reply: BalloonReply = control(&dir, Request::Balloon { target_mib }).await?;
            print_json(&reply, "the balloon reply")
        }
        VmCommand::Resume { dir } => {
            control::<Done>(&dir, Request::Resume).await?;
            println!("resumed {}", dir.display());
            Ok(0)
        }
        VmCommand::Snapshot {
            dir,
            snapshot,
            diff,
            base,
        } => {
            let snapshot = std::path::absolute(&snapshot).map_err(io("resolve snapshot path"))?;
            let r: SnapshotReply = control(
                &dir,
                Request::Snapshot {
                    path: snapshot.clone(),
                    diff,
                    base,
                },
            )
            .await?;
            println!(
                "snapshot {} ({}): {} pages written, VM paused {:.1} ms, complete after {:.1} ms, memory {:?} ({} pages for the pause instant)",
                snapshot.display(),
                if r.diff { "diff" } else { "full" },
                r.pages_written,
                r.paused_ms,
                r.complete_ms,
                r.memory_mode,
                r.final_pages
            );
            Ok(0)
        }
        VmCommand::Restore {
            snapshot,
            dir,
            cid,
            lazy,
            prefetch,
            record_working_set,
            tap,
            boot_timeout,
        } => {
            let lazy = lazy.then_some(LazyLaunch {
                prefetch,
                record_working_set_ms: record_working_set,
            });
            let launch = restore_launch(&snapshot, cid, tap, lazy)?;
            let mac = launch_mac(&launch);
            // Refreshed (entropy, clock, MAC) before it counts as ready.
            let vm = start(&dir, launch)?.ready(timeout(boot_timeout)).await?;
            if let Some(mac) = &mac {
                println!("{} has MAC {mac}", dir.display());
            }
            println!(
                "restored {} into {} (pid {}): agent ready after {:.1} ms; RNG reseeded, clock corrected by {:.1} s",
                snapshot.display(),
                dir.display(),
                vm.pid(),
                vm.ready_after().as_secs_f64() * 1e3,
                vm.clock_skew().unwrap_or_default().as_secs_f64()
            );
            vm.detach();
            Ok(0)
        }
        VmCommand::Fork {
            source,
            prefix,
            count,
            first_cid,
            tap_prefix,
            boot_timeout,
        } => {
            let started = Instant::now();
            let snapshot = if MicroVmDir::new(&source).api_sock().exists() {
                // A running VM: pause, snapshot, resume (the VMM does all three).
                let mut name = prefix.clone().into_os_string();
                name.push(".snapshot");
                let snapshot = std::path::absolute(PathBuf::from(name))
                    .map_err(io("resolve snapshot path"))?;
                control::<SnapshotReply>(
                    &source,
                    Request::Snapshot {
                        path: snapshot.clone(),
                        diff: false,
                        base: None,
                    },
                )
                .await?;
                eprintln!(
                    "snapshotted {} into {}",
                    source.display(),
                    snapshot.display()
                );
                snapshot
            } else {
                source
            };
            let mut children = Vec::new();
            for i in 0..count {
                let mut name = prefix.clone().into_os_string();
                name.push(format!("-{i}"));
                let dir = PathBuf::from(name);
                let launch = restore_launch(
                    &snapshot,
                    first_cid.map(|first| first + u64::from(i)),
                    tap_prefix.as_ref().map(|tap| format!("{tap}{i}")),
                    None,
                )?;
                let mac = launch_mac(&launch);
                children.push((dir.clone(), mac, start(&dir, launch)?));
            }
            for (dir, mac, child) in children {
                // Each child gets its own entropy before it is ready: forks must not share
                // random streams.
                child.ready(timeout(boot_timeout)).await?.detach();
                match mac {
                    Some(mac) => println!("{} {mac}", dir.display()),
                    None => println!("{}", dir.display()),
                }
            }
            let total = started.elapsed().as_secs_f64() * 1e3;
            eprintln!(
                "forked {count} children of {} in {total:.0} ms ({:.1} ms per child, agents answering)",
                snapshot.display(),
                total / f64::from(count.max(1))
            );
            Ok(0)
        }
        VmCommand::Rm { dir } => {
            if let Err(e) = control::<Done>(&dir, Request::Stop).await {
                eprintln!("dsec: {e}; removing the directory anyway");
            }
            // The VMM removes its sockets as it exits; give it a moment before the rest.
            let deadline = Instant::now() + Duration::from_secs(5);
            while MicroVmDir::new(&dir).api_sock().exists() && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            std::fs::remove_dir_all(&dir).map_err(io(format!("remove {}", dir.display())))?;
            println!("removed {}", dir.display());
            Ok(0)
        }
    }
}

/// The MAC a restore gives the snapshot's network device (and the guest interface).
fn launch_mac(launch: &VmmLaunch) -> Option<String> {
    match &launch.mode {
        dsec_vmm_api::LaunchMode::Restore(r) => r.overrides.net.as_ref()?.mac.clone(),
        _ => None,
    }
}

/// Prints a control reply as one JSON line.
fn print_json(reply: &impl serde::Serialize, what: &str) -> Result<i32, VmError> {
    let line = serde_json::to_string(reply).map_err(|e| VmError::Io {
        what: format!("print {what}"),
        source: e.into(),
    })?;
    println!("{line}");
    Ok(0)
}
