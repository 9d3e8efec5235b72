//! `dsec vm ...`: drive single microVMs directly through `dsec-vmm` — boot one in the
//! background, run commands in it, pause, snapshot, restore and fork it. The node daemon
//! offers the same through its API; these commands work without one (and inside the rig).
//!
//! A VM lives in a directory: `api.sock` (the VMM's control socket), `vsock.sock` (its
//! agent), `serial.log`, `vmm.log` and `pid`.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use dsec_edge::{find_binary, AgentAddr, AgentClient, Artifacts, ExecSpec};

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
        net: Option<String>,
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
    /// Resume a paused VM.
    Resume { dir: PathBuf },
    /// Snapshot the VM into SNAPSHOT (a new directory); a running VM is paused meanwhile.
    Snapshot {
        dir: PathBuf,
        snapshot: PathBuf,
        /// Only pages written since the previous snapshot of this VM.
        #[arg(long)]
        diff: bool,
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
    #[error("the VMM refused: {0}")]
    Vmm(String),
    #[error(transparent)]
    Edge(#[from] dsec_edge::EdgeError),
    #[error("the agent refused: {}: {}", .0.code(), .0.message())]
    Agent(#[from] tonic::Status),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> VmError {
    let what = what.into();
    move |source| VmError::Io { what, source }
}

/// One request on the VMM's control socket.
fn control(dir: &Path, request: serde_json::Value) -> Result<serde_json::Value, VmError> {
    let path = dir.join("api.sock");
    let mut stream = UnixStream::connect(&path).map_err(io(format!(
        "connect to {} (is the VM running?)",
        path.display()
    )))?;
    stream
        .write_all(format!("{request}\n").as_bytes())
        .map_err(io("send to the VMM"))?;
    let mut line = String::new();
    BufReader::new(stream)
        .read_line(&mut line)
        .map_err(io("read the VMM's answer"))?;
    let reply: serde_json::Value = serde_json::from_str(&line)
        .map_err(|e| VmError::Vmm(format!("unreadable answer {line:?}: {e}")))?;
    if reply["ok"] != true {
        return Err(VmError::Vmm(
            reply["error"]
                .as_str()
                .unwrap_or("unknown error")
                .to_string(),
        ));
    }
    Ok(reply)
}

fn agent(dir: &Path) -> AgentClient {
    AgentClient::connect_lazy(AgentAddr::VsockUds {
        uds: dir.join("vsock.sock"),
        port: dsec_api::AGENT_VSOCK_PORT,
    })
}

/// Starts `dsec-vmm` detached (own process group: it outlives this command).
fn spawn_vmm(dir: &Path, args: &[String]) -> Result<std::process::Child, VmError> {
    let vmm = find_binary("dsec-vmm").ok_or_else(|| {
        VmError::Usage("dsec-vmm not found next to dsec, in $DSEC_HOME/bin or on PATH".into())
    })?;
    if dir.exists() {
        return Err(VmError::Usage(format!(
            "{} already exists; pick a new VM directory",
            dir.display()
        )));
    }
    std::fs::create_dir_all(dir).map_err(io(format!("create {}", dir.display())))?;
    let log = std::fs::File::create(dir.join("vmm.log")).map_err(io("create vmm.log"))?;
    let child = Command::new(vmm)
        .args(args)
        .arg("--api-sock")
        .arg(dir.join("api.sock"))
        .arg("--vsock-uds")
        .arg(dir.join("vsock.sock"))
        .arg("--serial-log")
        .arg(dir.join("serial.log"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .process_group(0)
        .spawn()
        .map_err(io("start dsec-vmm"))?;
    std::fs::write(dir.join("pid"), child.id().to_string()).map_err(io("write pid"))?;
    Ok(child)
}

/// A restored guest has the snapshot's RNG state and a clock stopped at the snapshot: give it
/// fresh host entropy, the host's time and (on a new tap) its new MAC. Returns the clock skew
/// that was corrected.
async fn refresh(dir: &Path, mac: Option<&str>) -> Result<Duration, VmError> {
    use std::io::Read;
    let mut entropy = vec![0u8; 64];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut entropy))
        .map_err(io("read host entropy"))?;
    match tokio::time::timeout(
        REFRESH_TIMEOUT,
        agent(dir).refresh(entropy, mac.map(str::to_owned)),
    )
    .await
    {
        Ok(result) => Ok(result?),
        Err(_) => Err(VmError::Vmm(format!(
            "the restored guest did not answer the refresh call within {} s; see {}",
            REFRESH_TIMEOUT.as_secs(),
            dir.join("serial.log").display()
        ))),
    }
}

/// A restored VM that could not be given fresh entropy must not be used: stop it.
async fn refresh_or_remove(dir: &Path, mac: Option<&str>) -> Result<Duration, VmError> {
    match refresh(dir, mac).await {
        Ok(skew) => Ok(skew),
        Err(e) => {
            let _ = control(dir, serde_json::json!({"op": "stop"}));
            Err(e)
        }
    }
}

/// A random locally administered unicast MAC (`06:xx:xx:xx:xx:xx`).
fn random_mac() -> Result<String, VmError> {
    use std::io::Read;
    let mut bytes = [0u8; 5];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(io("read host entropy"))?;
    Ok(std::iter::once(0x06)
        .chain(bytes)
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":"))
}

/// Bounds of one readiness attempt (connect + Info).
const ATTEMPT_MIN: Duration = Duration::from_millis(100);
const ATTEMPT_MAX: Duration = Duration::from_secs(5);
/// How long a restored guest may take to accept fresh entropy and time.
const REFRESH_TIMEOUT: Duration = Duration::from_secs(30);

/// Waits until the agent of the VM that `vmm` runs answers, or the VMM exits.
async fn wait_agent(
    dir: &Path,
    vmm: &mut std::process::Child,
    timeout: f64,
) -> Result<Duration, VmError> {
    let started = Instant::now();
    let deadline = started + Duration::from_secs_f64(timeout.max(0.1));
    loop {
        // A guest that accepts the connection but never answers must not hang us: bound
        // every attempt, not just the loop.
        let remaining = deadline.saturating_duration_since(Instant::now());
        let attempt = tokio::time::timeout(remaining.clamp(ATTEMPT_MIN, ATTEMPT_MAX), async {
            let client = AgentClient::connect(AgentAddr::VsockUds {
                uds: dir.join("vsock.sock"),
                port: dsec_api::AGENT_VSOCK_PORT,
            })
            .await?;
            client.info().await
        });
        if let Ok(Ok(_)) = attempt.await {
            return Ok(started.elapsed());
        }
        if let Ok(Some(status)) = vmm.try_wait() {
            let log = std::fs::read_to_string(dir.join("vmm.log")).unwrap_or_default();
            return Err(VmError::Vmm(format!(
                "VMM exited ({status}): {}",
                log.trim()
            )));
        }
        if Instant::now() > deadline {
            return Err(VmError::Vmm(format!(
                "agent did not answer within {timeout} s; see {}",
                dir.join("serial.log").display()
            )));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
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
            let kernel = kernel.unwrap_or(artifacts.kernel);
            let initrd = initrd.unwrap_or(artifacts.initramfs);
            let mut args: Vec<String> = vec![
                "--kernel".into(),
                kernel.display().to_string(),
                "--initrd".into(),
                initrd.display().to_string(),
                "--cmdline".into(),
                CMDLINE.into(),
                "--vcpus".into(),
                vcpus.to_string(),
                "--mem-mib".into(),
                mem_mib.to_string(),
                "--vsock-cid".into(),
                cid.to_string(),
            ];
            if let Some(net) = net {
                args.extend(["--net".into(), net]);
            }
            let mut vmm = spawn_vmm(&dir, &args)?;
            let pid = vmm.id();
            let ready = wait_agent(&dir, &mut vmm, boot_timeout).await?;
            println!(
                "booted {} (pid {pid}): agent ready after {:.0} ms",
                dir.display(),
                ready.as_secs_f64() * 1e3
            );
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
            control(&dir, serde_json::json!({"op": "pause"}))?;
            println!("paused {}", dir.display());
            Ok(0)
        }
        VmCommand::Balloon { dir, target_mib } => {
            let mut request = serde_json::json!({"op": "balloon"});
            if let Some(mib) = target_mib {
                request["target_mib"] = mib.into();
            }
            let mut reply = control(&dir, request)?;
            if let Some(map) = reply.as_object_mut() {
                map.remove("ok");
            }
            println!("{reply}");
            Ok(0)
        }
        VmCommand::Resume { dir } => {
            control(&dir, serde_json::json!({"op": "resume"}))?;
            println!("resumed {}", dir.display());
            Ok(0)
        }
        VmCommand::Snapshot {
            dir,
            snapshot,
            diff,
        } => {
            let snapshot = std::path::absolute(&snapshot).map_err(io("resolve snapshot path"))?;
            let r = control(
                &dir,
                serde_json::json!({"op": "snapshot", "path": snapshot, "diff": diff}),
            )?;
            println!(
                "snapshot {} ({}): {} pages written, VM paused {:.1} ms",
                snapshot.display(),
                if diff { "diff" } else { "full" },
                r["pages_written"],
                r["paused_ms"].as_f64().unwrap_or(0.0)
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
            let mut args = vec!["--restore".to_string(), snapshot.display().to_string()];
            if let Some(cid) = cid {
                args.push("--vsock-cid".into());
                args.push(cid.to_string());
            }
            if lazy {
                args.push("--lazy".into());
            }
            if prefetch {
                args.push("--prefetch".into());
            }
            if let Some(ms) = record_working_set {
                args.extend(["--record-working-set".into(), ms.to_string()]);
            }
            let mac = tap.as_ref().map(|_| random_mac()).transpose()?;
            if let (Some(tap), Some(mac)) = (&tap, &mac) {
                args.extend(["--net".into(), format!("tap={tap},mac={mac}")]);
            }
            let mut vmm = spawn_vmm(&dir, &args)?;
            let pid = vmm.id();
            let ready = wait_agent(&dir, &mut vmm, boot_timeout).await?;
            let skew = refresh_or_remove(&dir, mac.as_deref()).await?;
            if let Some(mac) = &mac {
                println!("{} has MAC {mac}", dir.display());
            }
            println!(
                "restored {} into {} (pid {pid}): agent ready after {:.1} ms; RNG reseeded, clock corrected by {:.1} s",
                snapshot.display(),
                dir.display(),
                ready.as_secs_f64() * 1e3,
                skew.as_secs_f64()
            );
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
            let snapshot = if source.join("api.sock").exists() {
                // A running VM: pause, snapshot, resume (the VMM does all three).
                let mut name = prefix.clone().into_os_string();
                name.push(".snapshot");
                let snapshot = std::path::absolute(PathBuf::from(name))
                    .map_err(io("resolve snapshot path"))?;
                control(
                    &source,
                    serde_json::json!({"op": "snapshot", "path": snapshot}),
                )?;
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
                let mut args = vec!["--restore".to_string(), snapshot.display().to_string()];
                if let Some(first) = first_cid {
                    args.push("--vsock-cid".into());
                    args.push((first + u64::from(i)).to_string());
                }
                let mac = tap_prefix.as_ref().map(|_| random_mac()).transpose()?;
                if let (Some(tap), Some(mac)) = (&tap_prefix, &mac) {
                    args.extend(["--net".into(), format!("tap={tap}{i},mac={mac}")]);
                }
                let vmm = spawn_vmm(&dir, &args)?;
                children.push((dir, mac, vmm));
            }
            for (dir, mac, vmm) in &mut children {
                wait_agent(dir, vmm, boot_timeout).await?;
                // Each child gets its own entropy: forks must not share random streams.
                refresh_or_remove(dir, mac.as_deref()).await?;
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
            if let Err(e) = control(&dir, serde_json::json!({"op": "stop"})) {
                eprintln!("dsec: {e}; removing the directory anyway");
            }
            // The VMM removes its sockets as it exits; give it a moment before the rest.
            let deadline = Instant::now() + Duration::from_secs(5);
            while dir.join("api.sock").exists() && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            std::fs::remove_dir_all(&dir).map_err(io(format!("remove {}", dir.display())))?;
            println!("removed {}", dir.display());
            Ok(0)
        }
    }
}
