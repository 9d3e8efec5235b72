//! Container workers: a zygote (the image's python3 running zygote.py) in its own mount,
//! network, ipc and uts namespaces, with the image as a read-only root. Each call's init is
//! the compiled call init (init/call_init.rs) spawned by the zygote in fresh pid and mount
//! namespaces; a python call's code runs in the one fork of the zygote made into them ahead
//! of the call (see zygote.py); the hot path spawns nothing else.

use std::ffi::CString;
use std::io;
use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use base64::Engine as _;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, ChildStdin, ChildStdout};

use crate::cgroup::CallCgroup;
use crate::error::{FnCallError, Result};
use crate::network::{CallLink, CallNetwork, NetworkRules};
use crate::request::{CallRequest, CallResult, StageResult, StageStatus};
use crate::worker::{Outcome, PoolKey, Worker, WorkerFactory};

pub(crate) const ZYGOTE: &str = include_str!("zygote.py");
/// The compiled call init (init/call_init.rs, built by build.rs): each call's pid 1, spawned
/// by the zygote, so a python call forks the interpreter once (its stage), not twice.
const CALL_INIT: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/fncall-init"));
/// Where the call init is in a worker: a read-only, executable bind mount in its /dev.
const CALL_INIT_PATH: &str = "/dev/fncall-init";
/// The zygote's command line: reads zygote.py from a pipe (argv[1]) rather than carrying it
/// on a command line everyone can read.
const BOOTSTRAP: &str = "import os, sys\nfd = int(sys.argv.pop(1))\nsrc = b''\nwhile True:\n    chunk = os.read(fd, 65536)\n    if not chunk:\n        break\n    src += chunk\nos.close(fd)\nexec(compile(src, 'zygote.py', 'exec'))\n";
// The script is written into the pipe before the zygote starts: it must fit its buffer.
const _: () = assert!(ZYGOTE.len() < 65536);
/// Bound on one request frame (code, stdin and files, base64 and JSON overhead included).
pub(crate) const MAX_REQUEST_FRAME: usize = crate::request::MAX_INPUT_BYTES * 3 / 2 + (1 << 20);
/// Bound on one result frame.
pub(crate) const MAX_RESULT_FRAME: usize = 64 << 20;
/// How long a new worker may take to import its runtime and say hello.
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// The engine's own deadline beyond the call's timeouts, before it gives the worker up.
pub(crate) const GRACE: Duration = Duration::from_secs(10);

/// Per-call limits every call of a worker gets.
#[derive(Clone, Debug)]
pub struct CallLimits {
    /// Processes (and threads) of one call, the cgroup's pids.max.
    pub processes: u32,
    /// Bytes kept of each of stdout and stderr; more is cut and flagged.
    pub output_bytes: u64,
    /// Largest file a call may write.
    pub file_bytes: u64,
    /// Size of each of the call's /tmp and /work tmpfs.
    pub work_kib: u64,
    pub inodes: u64,
    pub open_files: u64,
    /// Total of the files handed back.
    pub fetch_bytes: u64,
}

impl Default for CallLimits {
    fn default() -> Self {
        Self {
            processes: 64,
            output_bytes: 1 << 20,
            file_bytes: 32 << 20,
            work_kib: 64 << 10,
            inodes: 4096,
            open_files: 256,
            fetch_bytes: 16 << 20,
        }
    }
}

/// Makes container workers from images under `images_dir` (`<image>/rootfs`).
pub struct ContainerFactory {
    images_dir: PathBuf,
    limits: CallLimits,
    /// First host uid of calls; see `call_uid`.
    uid_base: u32,
    /// The sandbox seccomp filters every stage of a call installs, as the zygote reads them
    /// (see `filters_hex`).
    seccomp_hex: String,
    /// The node's sandbox network for networked workers; None: networked calls are refused.
    network: Option<Arc<dyn CallNetwork>>,
}

/// Host uids of calls: above the container backend's id pool (2^30 .. 3 * 2^30), so no
/// call shares an id with a sandbox.
pub const DEFAULT_UID_BASE: u32 = 3 << 30;

/// Worker `n` of the engine in process `pid` runs its calls as its own uid: distinct across
/// the workers of a process, and across engines of the node (daemon, `dsec fn serve`) unless
/// their pids meet modulo 4096, so that per-uid limits (RLIMIT_NPROC) are per worker.
pub fn call_uid(base: u32, pid: u32, n: u64) -> u32 {
    base + ((u64::from(pid % 4096) << 12) + n % 4096) as u32
}

impl ContainerFactory {
    pub fn new(images_dir: PathBuf, limits: CallLimits) -> Self {
        crate::cgroup::sweep_stale();
        Self {
            images_dir,
            limits,
            uid_base: DEFAULT_UID_BASE,
            seccomp_hex: filters_hex(&[crate::filter::sandbox_program()]),
            network: None,
        }
    }

    /// Networked calls run in workers whose namespace has a link on `network`.
    pub fn with_network(mut self, network: Arc<dyn CallNetwork>) -> Self {
        self.network = Some(network);
        self
    }

    pub fn rootfs(&self, image: &str) -> Result<PathBuf> {
        let plain = !image.is_empty()
            && image
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        if !plain {
            return Err(FnCallError::InvalidRequest(format!(
                "image name {image:?} must be lowercase letters, digits and '-'"
            )));
        }
        let rootfs = self.images_dir.join(image).join("rootfs");
        if !rootfs.join("usr/bin/python3").exists() || !rootfs.join("work").is_dir() {
            return Err(FnCallError::MissingImage {
                image: image.to_string(),
                path: rootfs,
            });
        }
        Ok(rootfs)
    }
}

#[async_trait]
impl WorkerFactory for ContainerFactory {
    fn check_network(&self, _image: &str, rules: &NetworkRules) -> Result<()> {
        match &self.network {
            Some(network) => network.check(rules),
            None => Err(FnCallError::NoCallNetwork),
        }
    }

    fn lean_python(&self, _image: &str) -> bool {
        true
    }

    async fn spawn(&self, key: &PoolKey) -> Result<Box<dyn Worker>> {
        let rootfs = self.rootfs(&key.image)?;
        let network = match (key.network, &self.network) {
            (false, _) => None,
            (true, Some(network)) => Some(Arc::clone(network)),
            (true, None) => return Err(FnCallError::NoCallNetwork),
        };
        // Numbered across all factories of the process: cgroup names and uids stay unique.
        static NEXT_WORKER: AtomicU64 = AtomicU64::new(0);
        let n = NEXT_WORKER.fetch_add(1, Ordering::Relaxed);
        let uid = call_uid(self.uid_base, std::process::id(), n);
        let start_err = |detail: String| FnCallError::WorkerStart {
            language: key.language.as_str(),
            detail,
        };
        // The call's processes plus the zygote, the init forker, the next call's init and stage.
        let cgroup = CallCgroup::create(&crate::cgroup::group_name(n), self.limits.processes + 4)
            .map_err(|e| start_err(format!("cgroup: {e} (is this root?)")))?;
        let procs = cgroup
            .procs_files()
            .map_err(|e| start_err(format!("cgroup: {e}")))?;
        let procs: Vec<OwnedFd> = procs.into_iter().map(OwnedFd::from).collect();
        // The zygote goes back to its own pid namespace after each call's unshare with this
        // (a second unshare would fail while the first one's namespace is the children's).
        let pid_ns = OwnedFd::from(
            std::fs::File::open("/proc/self/ns/pid")
                .map_err(|e| start_err(format!("open /proc/self/ns/pid: {e}")))?,
        );
        let (script_r, script_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
            .map_err(|e| start_err(format!("pipe: {e}")))?;
        std::fs::File::from(script_w)
            .write_all(ZYGOTE.as_bytes())
            .map_err(|e| start_err(format!("write the zygote script: {e}")))?;
        // Networked workers resolve through the node's DNS proxy.
        let resolv_conf = network
            .as_ref()
            .and_then(|n| n.nameserver())
            .map(|ns| format!("nameserver {ns}\n"));
        let setup = RootSetup::new(&rootfs, &procs, &[&pid_ns, &script_r], resolv_conf)
            .map_err(|e| start_err(format!("{e}")))?;
        let mut command = tokio::process::Command::new("/usr/bin/python3");
        command
            .arg("-I")
            .arg("-c")
            .arg(BOOTSTRAP)
            .arg(script_r.as_raw_fd().to_string())
            .arg(key.language.as_str())
            .arg(MAX_REQUEST_FRAME.to_string())
            .arg(pid_ns.as_raw_fd().to_string())
            .arg(&self.seccomp_hex)
            .arg(self.limits.work_kib.to_string())
            .arg(self.limits.inodes.to_string())
            .arg(uid.to_string())
            .arg(if key.lean { "lean" } else { "full" })
            .arg(CALL_INIT_PATH)
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            // The zygote forks per call: no BLAS thread pools (a fork keeps only one thread).
            .env("OPENBLAS_NUM_THREADS", "1")
            .env("OMP_NUM_THREADS", "1")
            .env("MKL_NUM_THREADS", "1")
            .env("LANG", "C.UTF-8")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(worker_log())
            .kill_on_drop(true);
        // SAFETY: `enter` only makes system calls (unshare, mount, mknod, chdir, pivot_root,
        // umount2, open, write, unlink, sethostname, socket, ioctl, fcntl, prctl) on memory prepared
        // before the fork; it neither allocates nor takes locks.
        unsafe {
            command.pre_exec(move || setup.enter());
        }
        let mut child = command
            .spawn()
            .map_err(|e| start_err(format!("spawn the zygote in {}: {e}", rootfs.display())))?;
        drop((procs, pid_ns, script_r));
        let stdin = child.stdin.take().expect("piped stdin");
        let stdout = child.stdout.take().expect("piped stdout");
        let mut worker = ContainerWorker {
            child,
            stdin,
            stdout,
            uid,
            limits: self.limits.clone(),
            cgroup,
            end_pending: false,
            link: None,
            call_rules: None,
        };
        match tokio::time::timeout(START_TIMEOUT, worker.read_frame()).await {
            Ok(Ok((b'H', _))) => {
                // What the zygote itself holds: a call's limit comes on top of it.
                worker.cgroup.record_baseline();
                if let Some(network) = network {
                    // The zygote's namespace (its calls' too) gets its link, denying all.
                    let pid = worker.child.id().ok_or_else(|| {
                        start_err("the zygote exited before its network was attached".into())
                    })?;
                    worker.link = Some(
                        tokio::task::spawn_blocking(move || network.attach(pid))
                            .await
                            .map_err(|e| FnCallError::CallNetwork(format!("attach task: {e}")))??,
                    );
                }
                Ok(Box::new(worker))
            }
            Ok(Ok((kind, _))) => Err(start_err(format!(
                "the zygote sent frame {:?} instead of hello",
                kind as char
            ))),
            Ok(Err(e)) => Err(start_err(format!(
                "the zygote died while starting ({e}); is {} a FnCall image?",
                rootfs.display()
            ))),
            Err(_) => Err(start_err(format!(
                "the zygote did not start within {START_TIMEOUT:?}"
            ))),
        }
    }
}

/// BPF programs as the zygote installs them: each program's `sock_filter`s in native layout
/// (u16 code, u8 jt, u8 jf, u32 k), hex, programs separated by commas.
pub(crate) fn filters_hex(filters: &[seccompiler::BpfProgram]) -> String {
    let hex = |program: &seccompiler::BpfProgram| {
        let mut out = String::new();
        for insn in program {
            let mut bytes = Vec::with_capacity(8);
            bytes.extend_from_slice(&insn.code.to_ne_bytes());
            bytes.push(insn.jt);
            bytes.push(insn.jf);
            bytes.extend_from_slice(&insn.k.to_ne_bytes());
            for b in bytes {
                out.push_str(&format!("{b:02x}"));
            }
        }
        out
    };
    filters.iter().map(hex).collect::<Vec<_>>().join(",")
}

/// Where zygotes' own errors go: `DSEC_FNCALL_WORKER_LOG` (a file, appended) or nowhere.
fn worker_log() -> Stdio {
    std::env::var_os("DSEC_FNCALL_WORKER_LOG")
        .and_then(|path| {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .ok()
        })
        .map(Stdio::from)
        .unwrap_or_else(Stdio::null)
}

struct ContainerWorker {
    child: Child,
    stdin: ChildStdin,
    stdout: ChildStdout,
    uid: u32,
    limits: CallLimits,
    cgroup: CallCgroup,
    /// The last call answered; its init's end (frame E) is still to come.
    end_pending: bool,
    /// A networked worker's link on the node's network (released on drop).
    link: Option<Arc<dyn CallLink>>,
    /// The rules the link holds for the current call, taken back once it is over.
    call_rules: Option<NetworkRules>,
}

/// How long a finished call's teardown may take before the worker is given up.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(30);

impl Drop for ContainerWorker {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
        // The group empties once the zygote and its call are reaped; remove it then.
        let pid = self.child.id();
        let cgroup = std::mem::replace(&mut self.cgroup, CallCgroup::placeholder());
        let link = self.link.take();
        std::thread::spawn(move || {
            if let Some(pid) = pid {
                let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(pid as i32), None);
            }
            // After the zygote (and with it its namespace) is gone: address and rules freed.
            drop(link);
            for _ in 0..50 {
                if cgroup.remove() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
    }
}

impl ContainerWorker {
    async fn read_frame(&mut self) -> io::Result<(u8, Vec<u8>)> {
        let size = self.stdout.read_u32().await? as usize;
        if size == 0 || size > MAX_RESULT_FRAME {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("frame of {size} bytes"),
            ));
        }
        let mut buf = vec![0u8; size];
        self.stdout.read_exact(&mut buf).await?;
        let kind = buf.remove(0);
        Ok((kind, buf))
    }

    fn request(&self, call: &CallRequest) -> Vec<u8> {
        init_request(call, self.uid, &self.limits)
    }

    /// Sends the request; returns the result frame, or the init's wait status when it died
    /// without one.
    async fn exchange(&mut self, request: &[u8]) -> io::Result<std::result::Result<Vec<u8>, i32>> {
        self.stdin.write_u32(request.len() as u32).await?;
        self.stdin.write_all(request).await?;
        self.stdin.flush().await?;
        match self.read_frame().await? {
            (b'R', payload) => {
                self.end_pending = true;
                Ok(Ok(payload))
            }
            (b'E', payload) => Ok(Err(wait_status(&payload)?)),
            (other, _) => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("unexpected frame {:?}", other as char),
            )),
        }
    }
}

impl ContainerWorker {
    /// Takes the last call's rules back from the link, if it had any.
    async fn deny_all(&mut self) -> bool {
        let (Some(link), Some(_)) = (&self.link, self.call_rules.take()) else {
            return true;
        };
        let link = Arc::clone(link);
        match tokio::task::spawn_blocking(move || link.apply(&NetworkRules::default())).await {
            Ok(Ok(())) => true,
            Ok(Err(err)) => {
                tracing::warn!(%err, "cannot reset a FnCall worker's network policy; replacing it");
                false
            }
            Err(_) => false,
        }
    }
}

/// A call as the zygote's call init reads it (JSON).
pub(crate) fn request_json(call: &CallRequest, uid: u32, limits: &CallLimits) -> Vec<u8> {
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut files = serde_json::Map::new();
    files.insert(
        call.language.main_file().to_string(),
        b64.encode(call.code.as_bytes()).into(),
    );
    for (name, data) in &call.files {
        files.insert(name.clone(), b64.encode(data).into());
    }
    serde_json::json!({
        "language": call.language.as_str(),
        "main": call.language.main_file(),
        "files": files,
        "fetch": call.fetch_files,
        "stdin": b64.encode(&call.stdin),
        "uid": uid,
        "compile_timeout": call.compile_timeout.as_secs_f64(),
        "run_timeout": call.run_timeout.as_secs_f64(),
        // CPU time: the wall limit rounded up (the wall limit is the one that counts).
        "cpu_seconds": call.run_timeout.max(call.compile_timeout).as_secs_f64().ceil() + 1.0,
        "limits": {
            "processes": limits.processes,
            "output_bytes": limits.output_bytes,
            "file_bytes": limits.file_bytes,
            "work_kib": limits.work_kib,
            "inodes": limits.inodes,
            "open_files": limits.open_files,
            "fetch_bytes": limits.fetch_bytes,
        },
    })
    .to_string()
    .into_bytes()
}

/// A call as the compiled call init reads it: records of a tag byte, a big-endian u32
/// length and the bytes (no JSON, no base64: files and stdin go as they are).
pub(crate) fn init_request(call: &CallRequest, uid: u32, limits: &CallLimits) -> Vec<u8> {
    fn record(out: &mut Vec<u8>, tag: u8, value: &[u8]) {
        out.push(tag);
        out.extend_from_slice(&(value.len() as u32).to_be_bytes());
        out.extend_from_slice(value);
    }
    let files: usize = call.files.values().map(Vec::len).sum();
    let mut out = Vec::with_capacity(call.code.len() + call.stdin.len() + files + 1024);
    let main = call.language.main_file();
    record(&mut out, b'L', call.language.as_str().as_bytes());
    record(&mut out, b'M', main.as_bytes());
    record(&mut out, b'N', main.as_bytes());
    record(&mut out, b'D', call.code.as_bytes());
    for (name, data) in &call.files {
        record(&mut out, b'N', name.as_bytes());
        record(&mut out, b'D', data);
    }
    for name in &call.fetch_files {
        record(&mut out, b'F', name.as_bytes());
    }
    record(&mut out, b'I', &call.stdin);
    // CPU time: the wall limit rounded up (the wall limit is the one that counts).
    let cpu_seconds = call
        .run_timeout
        .max(call.compile_timeout)
        .as_secs_f64()
        .ceil() as u64
        + 1;
    let numbers = [
        u64::from(uid),
        call.compile_timeout.as_millis() as u64,
        call.run_timeout.as_millis() as u64,
        cpu_seconds,
        u64::from(limits.processes),
        limits.output_bytes,
        limits.file_bytes,
        limits.open_files,
        limits.fetch_bytes,
    ];
    let numbers: Vec<String> = numbers.iter().map(u64::to_string).collect();
    record(&mut out, b'T', numbers.join(" ").as_bytes());
    // The python stage's order, as zygote.py's set_limits reads it.
    let order = serde_json::json!({
        "limits": {
            "processes": limits.processes,
            "file_bytes": limits.file_bytes,
            "open_files": limits.open_files,
        },
        "cpu_seconds": cpu_seconds,
    })
    .to_string();
    // The init puts it after the stage's path: the object's fields without their braces.
    record(&mut out, b'J', &order.as_bytes()[1..order.len() - 1]);
    out
}

pub(crate) fn wait_status(payload: &[u8]) -> io::Result<i32> {
    let bytes: [u8; 4] = payload
        .try_into()
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "end frame of the wrong size"))?;
    Ok(i32::from_be_bytes(bytes))
}

#[async_trait]
impl Worker for ContainerWorker {
    async fn call(&mut self, call: &CallRequest) -> Result<Outcome> {
        let lost = |detail: String| FnCallError::WorkerLost(detail);
        self.cgroup
            .set_memory(call.memory_mib)
            .map_err(|e| lost(format!("set the memory limit: {e}")))?;
        if let (Some(link), Some(rules)) = (&self.link, &call.network) {
            if !rules.is_deny_all() {
                // Marked first: if applying fails half-way, settle or drop takes it back.
                self.call_rules = Some(rules.clone());
                let (link, rules) = (Arc::clone(link), rules.clone());
                tokio::task::spawn_blocking(move || link.apply(&rules))
                    .await
                    .map_err(|e| FnCallError::CallNetwork(format!("policy task: {e}")))??;
            }
        }
        let request = self.request(call);
        let deadline = call.compile_timeout + call.run_timeout + GRACE;
        let answer = match tokio::time::timeout(deadline, self.exchange(&request)).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(e)) => return Err(lost(format!("worker protocol: {e}"))),
            Err(_) => return Err(lost(format!("no answer within {deadline:?}"))),
        };
        let out_of_memory = self.cgroup.oom_killed_since_last();
        let raw = match answer {
            Ok(raw) => raw,
            Err(status) => {
                // The call's init died before answering: killed (memory) or crashed.
                let mut result = CallResult {
                    out_of_memory,
                    ..CallResult::default()
                };
                let signal = libc::WIFSIGNALED(status).then(|| libc::WTERMSIG(status));
                result.run = Some(StageResult {
                    status: StageStatus::Finished,
                    exit_code: None,
                    signal: signal.or(Some(libc::SIGKILL)),
                    stdout: Vec::new(),
                    stderr: if out_of_memory {
                        b"killed: over the memory limit\n".to_vec()
                    } else {
                        Vec::new()
                    },
                    stdout_truncated: false,
                    stderr_truncated: false,
                    duration: Duration::ZERO,
                });
                return Ok(Outcome {
                    result,
                    reusable: false,
                });
            }
        };
        let mut result = parse_result(&raw).map_err(|e| lost(format!("result: {e}")))?;
        result.out_of_memory = out_of_memory;
        let timed_out = [&result.compile, &result.run]
            .into_iter()
            .flatten()
            .any(|s| s.status == StageStatus::TimeLimitExceeded);
        let reusable = !out_of_memory && !timed_out;
        Ok(Outcome { result, reusable })
    }

    async fn settle(&mut self) -> bool {
        let ended = !std::mem::take(&mut self.end_pending)
            || match tokio::time::timeout(SETTLE_TIMEOUT, self.read_frame()).await {
                Ok(Ok((b'E', payload))) => {
                    wait_status(&payload).ok() == Some(0) && !self.cgroup.oom_killed_since_last()
                }
                _ => false,
            };
        // The call's processes are gone: the link denies everything again before the next
        // call (a worker whose link cannot be reset is dropped, which releases it).
        ended && self.deny_all().await
    }
}

pub(crate) fn parse_result(raw: &[u8]) -> std::result::Result<CallResult, String> {
    let value: serde_json::Value = serde_json::from_slice(raw).map_err(|e| e.to_string())?;
    if let Some(error) = value.get("error").and_then(|e| e.as_str()) {
        return Err(format!("the call could not be set up: {error}"));
    }
    let b64 = base64::engine::general_purpose::STANDARD;
    let bytes = |v: &serde_json::Value| -> std::result::Result<Vec<u8>, String> {
        b64.decode(v.as_str().unwrap_or_default())
            .map_err(|e| e.to_string())
    };
    let stage = |v: &serde_json::Value| -> std::result::Result<Option<StageResult>, String> {
        if v.is_null() {
            return Ok(None);
        }
        let status = match v["status"].as_str() {
            Some("Finished") => StageStatus::Finished,
            Some("TimeLimitExceeded") => StageStatus::TimeLimitExceeded,
            _ => StageStatus::Error,
        };
        Ok(Some(StageResult {
            status,
            exit_code: v["exit_code"].as_i64().map(|c| c as i32),
            signal: v["signal"].as_i64().map(|c| c as i32),
            stdout: bytes(&v["stdout"])?,
            stderr: bytes(&v["stderr"])?,
            stdout_truncated: v["stdout_truncated"].as_bool().unwrap_or(false),
            stderr_truncated: v["stderr_truncated"].as_bool().unwrap_or(false),
            duration: Duration::from_secs_f64(v["time"].as_f64().unwrap_or(0.0).max(0.0)),
        }))
    };
    let mut files = std::collections::BTreeMap::new();
    if let Some(map) = value["files"].as_object() {
        for (name, data) in map {
            files.insert(name.clone(), bytes(data)?);
        }
    }
    Ok(CallResult {
        compile: stage(&value["compile"])?,
        run: stage(&value["run"])?,
        files,
        file_errors: value["errors"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|e| e.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default(),
        out_of_memory: false,
        total: Duration::ZERO,
    })
}

/// What the child does between fork and exec to become a worker: everything prepared here,
/// so that `enter` only makes system calls.
struct RootSetup {
    rootfs: CString,
    dev: CString,
    /// The /dev tmpfs's options: room for the call init.
    dev_options: CString,
    /// Where the call init is written (in the worker's /dev, before pivot_root).
    call_init: CString,
    dev_nodes: Vec<(CString, libc::dev_t)>,
    /// `cgroup.procs` of the worker's groups: the zygote joins them before it execs.
    cgroup_procs: Vec<i32>,
    /// Descriptors the zygote inherits.
    keep_fds: Vec<i32>,
    /// What the worker's `/etc/resolv.conf` says instead of the image's (networked workers).
    resolv_conf: Option<Vec<u8>>,
}

fn cstr(bytes: &[u8]) -> io::Result<CString> {
    CString::new(bytes).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in a path"))
}

impl RootSetup {
    fn new(
        rootfs: &Path,
        cgroup_procs: &[OwnedFd],
        keep: &[&OwnedFd],
        resolv_conf: Option<String>,
    ) -> io::Result<Self> {
        let dev = rootfs.join("dev");
        let nodes = [
            ("null", 1, 3),
            ("zero", 1, 5),
            ("full", 1, 7),
            ("random", 1, 8),
            ("urandom", 1, 9),
        ];
        Ok(Self {
            rootfs: cstr(rootfs.as_os_str().as_bytes())?,
            dev: cstr(dev.as_os_str().as_bytes())?,
            dev_options: cstr(
                format!(
                    "size={}k,nr_inodes=64,mode=755",
                    CALL_INIT.len() / 1024 + 128
                )
                .as_bytes(),
            )?,
            call_init: cstr(rootfs.join(&CALL_INIT_PATH[1..]).as_os_str().as_bytes())?,
            dev_nodes: nodes
                .iter()
                .map(|(name, major, minor)| {
                    Ok((
                        cstr(dev.join(name).as_os_str().as_bytes())?,
                        libc::makedev(*major, *minor),
                    ))
                })
                .collect::<io::Result<_>>()?,
            cgroup_procs: cgroup_procs.iter().map(|f| f.as_raw_fd()).collect(),
            keep_fds: keep.iter().map(|f| f.as_raw_fd()).collect(),
            resolv_conf: resolv_conf.map(String::into_bytes),
        })
    }

    /// Runs in the forked child: own namespaces, the image read-only as `/`, a tiny /dev.
    fn enter(&self) -> io::Result<()> {
        fn ok(ret: libc::c_int) -> io::Result<()> {
            if ret < 0 {
                Err(io::Error::last_os_error())
            } else {
                Ok(())
            }
        }
        /// `path` bound over itself, then read-only, nosuid, nodev (and executable: a bind
        /// mount has its own flags).
        fn bind_read_only(path: &CString, flags: libc::c_ulong) -> io::Result<()> {
            let null = std::ptr::null::<libc::c_char>();
            // SAFETY: mount on a NUL-terminated string that outlives the calls.
            unsafe {
                ok(libc::mount(
                    path.as_ptr(),
                    path.as_ptr(),
                    null,
                    libc::MS_BIND | flags,
                    std::ptr::null(),
                ))?;
                ok(libc::mount(
                    null,
                    path.as_ptr(),
                    null,
                    libc::MS_REMOUNT
                        | libc::MS_BIND
                        | libc::MS_RDONLY
                        | libc::MS_NOSUID
                        | libc::MS_NODEV,
                    std::ptr::null(),
                ))
            }
        }
        let null = std::ptr::null::<libc::c_char>();
        // Always a network namespace of its own: a worker never shares the host's.
        let flags =
            libc::CLONE_NEWNS | libc::CLONE_NEWIPC | libc::CLONE_NEWUTS | libc::CLONE_NEWNET;
        // SAFETY: plain system calls on NUL-terminated strings owned by `self`, which the
        // forked child keeps alive until exec.
        unsafe {
            for fd in &self.cgroup_procs {
                if libc::write(*fd, b"0".as_ptr().cast(), 1) != 1 {
                    return Err(io::Error::last_os_error());
                }
            }
            // Shielded from the OOM killer where root may (CAP_SYS_RESOURCE); its calls raise
            // theirs to 1000 anyway, so a call over its memory limit dies, not the worker.
            let adj = libc::open(
                c"/proc/self/oom_score_adj".as_ptr(),
                libc::O_WRONLY | libc::O_CLOEXEC,
            );
            if adj >= 0 {
                libc::write(adj, b"-1000".as_ptr().cast(), 5);
                libc::close(adj);
            }
            ok(libc::unshare(flags))?;
            ok(libc::mount(
                null,
                c"/".as_ptr(),
                null,
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            ))?;
            bind_read_only(&self.rootfs, libc::MS_REC)?;
            ok(libc::mount(
                c"tmpfs".as_ptr(),
                self.dev.as_ptr(),
                c"tmpfs".as_ptr(),
                libc::MS_NOSUID | libc::MS_NOEXEC,
                self.dev_options.as_ptr().cast(),
            ))?;
            for (path, dev) in &self.dev_nodes {
                ok(libc::mknod(path.as_ptr(), libc::S_IFCHR | 0o666, *dev))?;
                ok(libc::chmod(path.as_ptr(), 0o666))?;
            }
            {
                // The call init: written into /dev (noexec), then bound over itself read-only
                // and executable (a bind mount has its own flags), for the zygote to spawn.
                let fd = libc::open(
                    self.call_init.as_ptr(),
                    libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC,
                    0o755,
                );
                ok(fd)?;
                let mut written = 0;
                while written < CALL_INIT.len() {
                    let n = libc::write(
                        fd,
                        CALL_INIT[written..].as_ptr().cast(),
                        CALL_INIT.len() - written,
                    );
                    if n <= 0 {
                        libc::close(fd);
                        return Err(io::Error::last_os_error());
                    }
                    written += n as usize;
                }
                libc::close(fd);
                bind_read_only(&self.call_init, 0)?;
            }
            ok(libc::chdir(self.rootfs.as_ptr()))?;
            ok(libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr()) as libc::c_int)?;
            ok(libc::umount2(c".".as_ptr(), libc::MNT_DETACH))?;
            ok(libc::chdir(c"/".as_ptr()))?;
            if let Some(text) = &self.resolv_conf {
                // Written in the worker's own /dev tmpfs and bound over the image's file (the
                // root is read-only), then unlinked: calls see only /etc/resolv.conf. After
                // pivot_root, so a symbolic link in the image cannot lead outside its root.
                let staged = c"/dev/.resolv.conf";
                let fd = libc::open(
                    staged.as_ptr(),
                    libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC,
                    0o644,
                );
                ok(fd)?;
                let written = libc::write(fd, text.as_ptr().cast(), text.len());
                libc::close(fd);
                if written != text.len() as isize {
                    return Err(io::Error::from_raw_os_error(libc::EIO));
                }
                let target = c"/etc/resolv.conf";
                ok(libc::mount(
                    staged.as_ptr(),
                    target.as_ptr(),
                    null,
                    libc::MS_BIND,
                    std::ptr::null(),
                ))?;
                ok(libc::mount(
                    null,
                    target.as_ptr(),
                    null,
                    libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY | libc::MS_NOSUID,
                    std::ptr::null(),
                ))?;
                ok(libc::unlink(staged.as_ptr()))?;
            }
            let host = b"fncall";
            ok(libc::sethostname(host.as_ptr().cast(), host.len()))?;
            {
                // Loopback up: calls may use local sockets, nothing reaches out.
                let sock = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
                ok(sock)?;
                let mut ifr: libc::ifreq = std::mem::zeroed();
                ifr.ifr_name[..2].copy_from_slice(&[b'l' as libc::c_char, b'o' as libc::c_char]);
                ifr.ifr_ifru.ifru_flags =
                    (libc::IFF_UP | libc::IFF_LOOPBACK | libc::IFF_RUNNING) as libc::c_short;
                ok(libc::ioctl(sock, libc::SIOCSIFFLAGS, &ifr))?;
                libc::close(sock);
            }
            for fd in &self.keep_fds {
                ok(libc::fcntl(*fd, libc::F_SETFD, 0))?;
            }
            // The worker goes with whoever started it.
            ok(libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL))?;
        }
        Ok(())
    }
}
