//! The node: sandboxes it supervises, admission budgets, persistence, adoption after a
//! restart, TTL/idle reaping.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tonic::Status;

use super::cgroup::{self, Cgroups, Limits};
use super::metrics::Metrics;
use super::DaemonConfig;
use crate::backend::{
    restore_microvm, BackendKind, EdgeConfig, Sandbox, SandboxHandle, SandboxSpec,
};
use crate::client::AgentClient;
use crate::error::EdgeError;
use crate::images::servers::ImageMounts;
use crate::images::{Catalog, ImageError, ImageSource};
use crate::kvm::KvmStatus;

pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// A sandbox's access token: 128 random bits.
pub fn new_access_token() -> String {
    random_hex(16)
}

fn random_hex(bytes: usize) -> String {
    let mut buf = vec![0u8; bytes];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        use std::io::Read;
        let _ = f.read_exact(&mut buf);
    }
    buf.iter().map(|b| format!("{b:02x}")).collect()
}

/// What is persisted per sandbox (`<sandbox dir>/meta.json`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Record {
    pub handle: SandboxHandle,
    pub image: String,
    pub vcpus: i32,
    pub memory_mib: i64,
    pub disk_mib: i64,
    pub pids_limit: i64,
    pub env: BTreeMap<String, String>,
    pub labels: BTreeMap<String, String>,
    pub allow_internet: bool,
    pub allow: Vec<String>,
    pub created_at_ms: i64,
    /// 0: no TTL.
    pub expires_at_ms: i64,
    pub idle_timeout_s: i64,
    pub paused: bool,
    pub parent_id: String,
    pub cgroups: Vec<PathBuf>,
    /// The memory cgroup's limit, which admission reserves: memory plus what else is charged
    /// to the cgroup (a container's tmpfs disk; a microVM's overhead and upper disk). 0 in
    /// records of older daemons (derived then).
    #[serde(default)]
    pub memory_limit_mib: i64,
    /// The client's Create request_id and the fingerprint of its spec: a retry after a daemon
    /// restart still finds this sandbox.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub request_id: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub request_fingerprint: String,
    /// Secret a request must carry to reach the sandbox's ports (not its public ones) through
    /// the HTTP entry point or Ports.Open on TCP. Never logged.
    #[serde(default)]
    pub access_token: String,
    /// Ports open without the token.
    #[serde(default)]
    pub public_ports: std::collections::BTreeSet<u16>,
    /// The image server whose mount is this container's lowerdir (layer-store images).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_mount: Option<String>,
}

impl Record {
    fn demand(&self) -> Demand {
        let memory_mib = if self.memory_limit_mib > 0 {
            self.memory_limit_mib
        } else if self.handle.backend == BackendKind::Container.as_str() {
            self.memory_mib + self.disk_mib
        } else {
            self.memory_mib + MICROVM_OVERHEAD_MIB
        };
        Demand {
            memory_mib,
            vcpus: i64::from(self.vcpus),
            pids: self.pids_limit,
            disk_mib: self.disk_mib,
        }
    }

    fn meta_path(&self) -> PathBuf {
        self.handle.dir.join("meta.json")
    }

    /// Atomically replaces meta.json.
    pub fn persist(&self) -> Result<(), EdgeError> {
        let path = self.meta_path();
        let tmp = path.with_extension("json.tmp");
        let data = serde_json::to_vec_pretty(self)
            .map_err(|e| EdgeError::Protocol(format!("encode sandbox record: {e}")))?;
        // Root-only: it holds the sandbox's access token.
        let mut file = {
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&tmp)
                .map_err(|e| EdgeError::io(format!("create {}", tmp.display()), e))?
        };
        file.write_all(&data)
            .and_then(|()| file.sync_data())
            .map_err(|e| EdgeError::io(format!("write {}", tmp.display()), e))?;
        std::fs::rename(&tmp, &path)
            .map_err(|e| EdgeError::io(format!("rename {}", tmp.display()), e))
    }
}

/// A sandbox the node supervises.
pub struct Entry {
    pub record: Mutex<Record>,
    pub client: AgentClient,
    pub last_activity_ms: AtomicI64,
    /// Creates with its request_id that returned it (a retry counts as a claim).
    pub claims: AtomicU64,
    /// Why its agent / VMM died, once seen (computed once: it reaps the process).
    pub death: std::sync::OnceLock<String>,
}

impl Entry {
    pub fn touch(&self) {
        self.last_activity_ms.store(now_ms(), Ordering::Relaxed);
    }

    pub fn record(&self) -> Record {
        self.record
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub fn id(&self) -> String {
        self.record
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .handle
            .id
            .clone()
    }

    pub fn event(&self, message: &str) {
        let dir = self
            .record
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .handle
            .dir
            .clone();
        append_event(&dir, message);
    }
}

pub fn append_event(dir: &Path, message: &str) {
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("events.log"))
    {
        let _ = writeln!(f, "{} {message}", now_ms());
    }
}

/// Most ports one sandbox may open to everyone.
pub const MAX_PUBLIC_PORTS: usize = 64;

/// Charged to a microVM's memory cgroup besides guest memory: the VMM's own memory.
pub const MICROVM_OVERHEAD_MIB: i64 = cgroup::MICROVM_OVERHEAD_MIB as i64;

/// The memory cgroup limit of a sandbox, in MiB, and so what admission reserves for it:
/// whatever the cgroup is charged must be in the budget ([`Limits::for_sandbox`], which
/// `dsec run` uses too). On a disk image a microVM's upper disk is charged as well.
pub fn memory_limit_mib(kind: BackendKind, memory_mib: i64, disk_mib: i64, on_disk: bool) -> i64 {
    let charged_disk = match kind {
        BackendKind::Container => disk_mib,
        BackendKind::MicroVm if on_disk => disk_mib,
        BackendKind::MicroVm => 0,
    };
    let limits = Limits::for_sandbox(
        kind,
        memory_mib.max(0) as u64,
        charged_disk.max(0) as u64,
        1,
        0,
    );
    (limits.memory_bytes >> 20) as i64
}

/// Resources a sandbox reserves at admission.
#[derive(Clone, Copy, Debug, Default)]
pub struct Demand {
    pub memory_mib: i64,
    pub vcpus: i64,
    pub pids: i64,
    pub disk_mib: i64,
}

#[derive(Clone, Copy, Debug, Default)]
pub struct Budget {
    pub limit: i64,
    pub reserved: i64,
}

#[derive(Debug, Default)]
pub struct Budgets {
    pub memory_mib: Budget,
    pub vcpus: Budget,
    pub pids: Budget,
    pub disk_mib: Budget,
}

impl Budgets {
    fn all(&mut self) -> [(&'static str, &'static str, &mut Budget, i64); 4] {
        [
            ("memory", "MiB of memory", &mut self.memory_mib, 0),
            ("cpu", "vCPUs", &mut self.vcpus, 0),
            ("pids", "pids", &mut self.pids, 0),
            ("disk", "MiB of disk", &mut self.disk_mib, 0),
        ]
    }

    /// Reserves `d` or says which budget is spent. `force` (adoption) never refuses.
    fn reserve(&mut self, d: Demand, force: bool) -> Result<(), (usize, String)> {
        let wants = [d.memory_mib, d.vcpus, d.pids, d.disk_mib];
        if !force {
            for (i, (name, unit, budget, _)) in self.all().into_iter().enumerate() {
                if budget.reserved + wants[i] > budget.limit {
                    let why = if i == 0 {
                        " (its memory cgroup limit: memory plus a container's disk, a tmpfs charged to its memory, or a microVM's VMM overhead)"
                    } else {
                        ""
                    };
                    return Err((
                        i,
                        format!(
                            "node {name} budget spent: {} of {} {unit} reserved, this sandbox needs {}{why}; delete sandboxes, ask for less, or start the daemon with a larger budget/overcommit ratio",
                            budget.reserved, budget.limit, wants[i]
                        ),
                    ));
                }
            }
        }
        for (i, (_, _, budget, _)) in self.all().into_iter().enumerate() {
            budget.reserved += wants[i];
        }
        Ok(())
    }

    fn release(&mut self, d: Demand) {
        let wants = [d.memory_mib, d.vcpus, d.pids, d.disk_mib];
        for (i, (_, _, budget, _)) in self.all().into_iter().enumerate() {
            budget.reserved = (budget.reserved - wants[i]).max(0);
        }
    }
}

/// The outcome of a Create, as waiting retries see it: the sandbox id, or the error.
pub type CreateOutcome = Option<Result<String, (tonic::Code, String)>>;

/// What the node knows about a Create request_id.
enum RequestState {
    /// Being created; the receiver yields the outcome.
    InFlight {
        fingerprint: String,
        done: tokio::sync::watch::Receiver<CreateOutcome>,
    },
    /// Made this sandbox (which still exists).
    Done { fingerprint: String, id: String },
}

/// What a Create with a request_id has to do.
pub enum Claim {
    /// Nobody has this request_id: create, then report through the sender.
    Create(tokio::sync::watch::Sender<CreateOutcome>),
    /// An earlier attempt made this sandbox.
    Existing(Arc<Entry>),
    /// An earlier attempt is still running: wait for its outcome.
    Wait(tokio::sync::watch::Receiver<CreateOutcome>),
}

/// How long a dead sandbox's tombstone (state, reason, log tails) is kept.
pub const TOMBSTONE_KEEP: Duration = Duration::from_secs(600);
/// Most tombstones kept (the oldest go first).
pub const MAX_TOMBSTONES: usize = 1000;
/// Bytes kept of the end of each of a dead sandbox's logs.
pub const TOMBSTONE_LOG_BYTES: u64 = 16 << 10;

/// What is left of a sandbox whose agent or VMM died, for Get and Logs.
pub struct Tombstone {
    pub record: Record,
    pub reason: String,
    pub died_at_ms: i64,
    pub last_activity_ms: i64,
    /// (source, tail of its log), as Logs names them.
    pub logs: Vec<(&'static str, Vec<u8>)>,
}

/// The log files of a sandbox directory, by the source names of the Logs call.
pub const LOG_SOURCES: [(&str, &str); 4] = [
    ("events", "events.log"),
    ("agent", "agent.log"),
    ("vmm", "vmm.log"),
    ("serial", "serial.log"),
];

/// The last `max` bytes of a file (empty if it is missing).
fn tail_bytes(path: &Path, max: u64) -> Vec<u8> {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut file) = std::fs::File::open(path) else {
        return Vec::new();
    };
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = file.seek(SeekFrom::Start(len.saturating_sub(max)));
    let mut out = Vec::new();
    let _ = file.take(max).read_to_end(&mut out);
    out
}

/// Why a sandbox's process is gone: its exit status when this daemon is its parent (reaping
/// it), and whether the memory cgroup's OOM killer struck.
fn describe_death(record: &Record) -> String {
    use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
    let container = record.handle.backend == BackendKind::Container.as_str();
    let mut reason = if container {
        let pid = nix::unistd::Pid::from_raw(record.handle.pid);
        // A dying multi-threaded leader shows as a zombie before its other threads are gone,
        // and waitpid reports it only then: give it a moment.
        let mut status = waitpid(pid, Some(WaitPidFlag::WNOHANG));
        for _ in 0..200 {
            if !matches!(status, Ok(WaitStatus::StillAlive)) {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
            status = waitpid(pid, Some(WaitPidFlag::WNOHANG));
        }
        match status {
            Ok(WaitStatus::Exited(_, code)) => format!("the agent exited with code {code}"),
            Ok(WaitStatus::Signaled(_, signal, _)) => {
                format!("the agent was killed by {}", signal.as_str())
            }
            _ => "the agent process is gone (exit status unknown: it is not this daemon's child, e.g. adopted after a restart)".to_string(),
        }
    } else {
        "the VMM process exited".to_string()
    };
    if let Some(kills) = cgroup::oom_kills(&record.cgroups).filter(|n| *n > 0) {
        reason.push_str(&format!(
            " (out of memory: the memory cgroup's oom_kill count rose to {kills}; its limit is {} MiB, memory plus the disk: give the sandbox more memory_mib or write less to its disk and tmpfs)",
            record.demand().memory_mib
        ));
    }
    reason
}

/// Why a sandbox was removed by the node itself.
#[derive(Clone, Copy, Debug)]
pub enum ReapReason {
    Ttl,
    Idle,
    Died,
}

impl ReapReason {
    pub fn as_str(self) -> &'static str {
        match self {
            ReapReason::Ttl => "ttl",
            ReapReason::Idle => "idle",
            ReapReason::Died => "died",
        }
    }
}

/// A validated Create request.
#[derive(Clone, Debug)]
pub struct Plan {
    pub kind: BackendKind,
    pub image: String,
    /// What was asked (`demand.memory_mib` is the guest's / container's memory).
    pub demand: Demand,
    /// The memory cgroup limit (see [`memory_limit_mib`]); filled in by the node.
    pub memory_limit_mib: i64,
    pub env: BTreeMap<String, String>,
    pub labels: BTreeMap<String, String>,
    pub ttl_s: i64,
    pub idle_timeout_s: i64,
    pub allow_internet: bool,
    pub allow: Vec<String>,
    /// The client's idempotency key ("" = none).
    pub request_id: String,
    /// Ports open without the access token.
    pub public_ports: std::collections::BTreeSet<u16>,
}

impl Plan {
    /// A stable digest of what the Create asked for (defaults filled in), to tell a retry
    /// from a different request that reuses a request_id.
    pub fn fingerprint(&self) -> String {
        let spec = serde_json::json!({
            "kind": self.kind.as_str(),
            "image": self.image,
            "memory_mib": self.demand.memory_mib,
            "vcpus": self.demand.vcpus,
            "pids": self.demand.pids,
            "disk_mib": self.demand.disk_mib,
            "env": self.env,
            "labels": self.labels,
            "ttl_s": self.ttl_s,
            "idle_timeout_s": self.idle_timeout_s,
            "public_ports": self.public_ports,
        });
        // FNV-1a: stable across builds (records outlive the daemon binary).
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for byte in spec.to_string().bytes() {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
        format!("{hash:016x}")
    }

    /// What admission reserves: the memory cgroup's limit, not only the asked memory.
    fn reserved(&self) -> Demand {
        Demand {
            memory_mib: self.memory_limit_mib,
            ..self.demand
        }
    }
}

pub struct Node {
    pub config: DaemonConfig,
    pub edge: EdgeConfig,
    cgroups: Cgroups,
    sandboxes: Mutex<HashMap<String, Arc<Entry>>>,
    pub budgets: Mutex<Budgets>,
    pub metrics: Metrics,
    pub started_at_ms: i64,
    pub default_backend: BackendKind,
    pub microvm_unavailable: Option<String>,
    next_cid: AtomicU64,
    /// Where images are looked up (directory images, then the layer store).
    pub catalog: Catalog,
    /// Shared FUSE mounts of layer-store images.
    pub images: ImageMounts,
    /// Create request_ids: in flight, or the sandbox they made.
    requests: Mutex<HashMap<String, RequestState>>,
    /// Sandboxes that died, oldest first.
    tombstones: Mutex<std::collections::VecDeque<Arc<Tombstone>>>,
}

/// What calls to a dead sandbox get.
pub fn dead_status(id: &str, reason: &str) -> Status {
    Status::failed_precondition(format!(
        "sandbox {id} is dead: {reason}. Get and Logs (`dsec logs {id}`) still show it for {} minutes; create a new sandbox",
        TOMBSTONE_KEEP.as_secs() / 60
    ))
}

/// Maps a library error to a status whose message says what to do.
pub fn edge_status(err: EdgeError) -> Status {
    let text = err.to_string();
    match err {
        EdgeError::InvalidSpec(_) => Status::invalid_argument(text),
        EdgeError::MissingArtifact { .. } => Status::not_found(text),
        EdgeError::MissingBinary { .. } | EdgeError::BackendUnavailable { .. } => {
            Status::failed_precondition(text)
        }
        EdgeError::AgentNotReady { .. } => Status::deadline_exceeded(text),
        EdgeError::Agent { code, message, .. } => Status::new(code, message),
        EdgeError::Connect(_) => Status::unavailable(text),
        _ => Status::internal(text),
    }
}

/// Maps an image lookup error to a status.
pub fn image_status(err: ImageError) -> Status {
    let text = err.to_string();
    match err {
        ImageError::InvalidName { .. } => Status::invalid_argument(text),
        ImageError::NotFound { .. } => Status::not_found(text),
        ImageError::Store { .. } => Status::failed_precondition(text),
        ImageError::Mount { .. } => Status::internal(text),
    }
}

impl Node {
    pub fn sandboxes_dir(config: &DaemonConfig) -> PathBuf {
        config.state_dir.join("sandboxes")
    }

    /// Builds the node and re-adopts the sandboxes a previous daemon left running; everything
    /// else it left (half-created sandboxes, processes, cgroups, directories) is removed.
    pub async fn start(config: DaemonConfig) -> Result<Arc<Self>, EdgeError> {
        let sandboxes_dir = Self::sandboxes_dir(&config);
        std::fs::create_dir_all(&sandboxes_dir)
            .map_err(|e| EdgeError::io(format!("create {}", sandboxes_dir.display()), e))?;
        let edge = EdgeConfig {
            state_dir: sandboxes_dir.clone(),
            artifacts: config.artifacts.clone(),
            agent_bin: config.agent_bin.clone(),
            vmm_bin: config.vmm_bin.clone(),
            jail: config.jail_vmms.then(|| crate::backend::VmmJail {
                uid: crate::backend::JAIL_UID,
                gid: crate::backend::JAIL_GID,
                snapshots: config.state_dir.join("snapshots"),
                roots: config.state_dir.join("jails"),
            }),
        };
        let kvm = KvmStatus::detect();
        let microvm_unavailable = kvm.why_not_microvm();
        let default_backend = config
            .default_backend
            .unwrap_or(if microvm_unavailable.is_none() {
                BackendKind::MicroVm
            } else {
                BackendKind::Container
            });
        let cores = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1) as f64;
        let host_mib = host_memory_mib() as f64;
        let budgets = Budgets {
            memory_mib: Budget {
                limit: (config.memory_mib.map(|m| m as f64).unwrap_or(host_mib)
                    * config.overcommit_memory) as i64,
                reserved: 0,
            },
            vcpus: Budget {
                limit: (config.cpus.map(|c| c as f64).unwrap_or(cores) * config.overcommit_cpu)
                    as i64,
                reserved: 0,
            },
            pids: Budget {
                limit: config.pids.unwrap_or_else(default_pid_budget) as i64,
                reserved: 0,
            },
            disk_mib: Budget {
                limit: (config
                    .disk_mib
                    .unwrap_or_else(|| free_disk_mib(&sandboxes_dir))
                    as f64
                    * config.overcommit_disk) as i64,
                reserved: 0,
            },
        };
        let node = Arc::new(Self {
            cgroups: Cgroups::detect(&config.cgroup_name),
            edge,
            sandboxes: Mutex::new(HashMap::new()),
            budgets: Mutex::new(budgets),
            metrics: Metrics::default(),
            started_at_ms: now_ms(),
            default_backend,
            microvm_unavailable,
            next_cid: AtomicU64::new(3 + (now_ms() as u64 % 1_000_000) * 16),
            catalog: Catalog::new(&config.artifacts.home),
            images: ImageMounts::new(&config.state_dir, &config.invocation),
            requests: Mutex::new(HashMap::new()),
            tombstones: Mutex::new(std::collections::VecDeque::new()),
            config,
        });
        node.adopt().await;
        Ok(node)
    }

    async fn adopt(self: &Arc<Self>) {
        let dir = Self::sandboxes_dir(&self.config);
        // Image servers first: a sandbox whose image mount is gone cannot read its root.
        let servers = self.images.recover();
        let mut image_users: HashMap<String, usize> = HashMap::new();
        let mut kept = HashSet::new();
        let mut stale: Vec<(PathBuf, Option<Record>)> = Vec::new();
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if !path.is_dir() {
                continue;
            }
            let record: Option<Record> = std::fs::read(path.join("meta.json"))
                .ok()
                .and_then(|d| serde_json::from_slice(&d).ok());
            match record {
                Some(mut record)
                    if record.handle.is_alive()
                        && record
                            .image_mount
                            .as_ref()
                            .is_none_or(|m| servers.contains_key(m)) =>
                {
                    if let Some(m) = &record.image_mount {
                        *image_users.entry(m.clone()).or_default() += 1;
                    }
                    let id = record.handle.id.clone();
                    let client = AgentClient::connect_lazy(record.handle.agent_addr());
                    let _ = self
                        .budgets
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .reserve(record.demand(), true);
                    if record.access_token.is_empty() {
                        // A record of a daemon from before access tokens.
                        record.access_token = new_access_token();
                        let _ = record.persist();
                    }
                    if !record.request_id.is_empty() {
                        self.requests().insert(
                            record.request_id.clone(),
                            RequestState::Done {
                                fingerprint: record.request_fingerprint.clone(),
                                id: id.clone(),
                            },
                        );
                    }
                    append_event(&record.handle.dir, "adopted by a restarted daemon");
                    tracing::info!(sandbox = %id, pid = record.handle.pid, "adopted");
                    let entry = Arc::new(Entry {
                        record: Mutex::new(record),
                        client,
                        last_activity_ms: AtomicI64::new(now_ms()),
                        claims: AtomicU64::new(0),
                        death: std::sync::OnceLock::new(),
                    });
                    kept.insert(id.clone());
                    self.lock().insert(id, entry);
                    self.metrics.adopted_total.fetch_add(1, Ordering::Relaxed);
                }
                other => stale.push((path, other)),
            }
        }
        // Processes started for sandboxes that are not adopted (creates in flight when the
        // previous daemon died, or whose record is gone) reference their directory.
        let killed = kill_strays(&dir, &kept);
        for (path, record) in &stale {
            if let Some(record) = record {
                let _ = record.handle.teardown();
                cgroup::remove(&record.cgroups);
            }
            crate::idpool::release(path);
            let _ = std::fs::remove_dir_all(path);
        }
        // Jail roots of sandboxes that are gone (their VMMs were killed above); empty
        // snapshot directories too (ones holding snapshots stay).
        if let Some(jail) = &self.edge.jail {
            for entry in std::fs::read_dir(&jail.roots)
                .into_iter()
                .flatten()
                .flatten()
            {
                if !kept.contains(entry.file_name().to_string_lossy().as_ref()) {
                    let _ = std::fs::remove_dir_all(entry.path());
                }
            }
            for entry in std::fs::read_dir(&jail.snapshots)
                .into_iter()
                .flatten()
                .flatten()
            {
                if !kept.contains(entry.file_name().to_string_lossy().as_ref()) {
                    let _ = std::fs::remove_dir(entry.path());
                }
            }
        }
        let cgroups = self.cgroups.sweep(&kept);
        self.images.adopted(servers, &image_users).await;
        tracing::info!(
            adopted = kept.len(),
            removed_dirs = stale.len(),
            killed_processes = killed,
            removed_cgroups = cgroups,
            "state recovered"
        );
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Entry>>> {
        self.sandboxes.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn requests(&self) -> std::sync::MutexGuard<'_, HashMap<String, RequestState>> {
        self.requests.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Decides what a Create with `request_id` does: the sandbox an earlier attempt made, a
    /// wait for one in flight, or a new create. The same request_id with another spec is
    /// ALREADY_EXISTS.
    pub fn claim(&self, request_id: &str, fingerprint: &str) -> Result<Claim, Status> {
        let mismatch = |what: &str| {
            Status::already_exists(format!(
                "request_id {request_id:?} was already used by a Create with a different spec ({what}): a retry must repeat the request unchanged; use a fresh request_id for a new sandbox"
            ))
        };
        let mut requests = self.requests();
        match requests.get(request_id) {
            // A create task that ended without reporting (it panicked): forget it.
            Some(RequestState::InFlight { done, .. }) if done.has_changed().is_err() => {
                requests.remove(request_id);
                self.claim_new(&mut requests, request_id, fingerprint)
            }
            Some(RequestState::InFlight {
                fingerprint: f,
                done,
            }) => {
                if f != fingerprint {
                    return Err(mismatch("still being created"));
                }
                Ok(Claim::Wait(done.clone()))
            }
            Some(RequestState::Done { fingerprint: f, id }) => {
                if let Some(entry) = self.lock().get(id).cloned() {
                    if f != fingerprint {
                        return Err(mismatch(&format!("sandbox {id}")));
                    }
                    entry.claims.fetch_add(1, Ordering::Relaxed);
                    return Ok(Claim::Existing(entry));
                }
                // Deleted since: a retry creates afresh.
                requests.remove(request_id);
                self.claim_new(&mut requests, request_id, fingerprint)
            }
            None => self.claim_new(&mut requests, request_id, fingerprint),
        }
    }

    fn claim_new(
        &self,
        requests: &mut HashMap<String, RequestState>,
        request_id: &str,
        fingerprint: &str,
    ) -> Result<Claim, Status> {
        let (tx, rx) = tokio::sync::watch::channel(None);
        requests.insert(
            request_id.to_string(),
            RequestState::InFlight {
                fingerprint: fingerprint.to_string(),
                done: rx,
            },
        );
        Ok(Claim::Create(tx))
    }

    /// Records the outcome of a claimed Create and wakes the retries waiting for it. A failed
    /// attempt forgets the request_id (a retry may create afresh).
    pub fn finish_claim(
        &self,
        request_id: &str,
        fingerprint: &str,
        result: &Result<Arc<Entry>, Status>,
        tx: tokio::sync::watch::Sender<CreateOutcome>,
    ) {
        let outcome = match result {
            Ok(entry) => {
                let id = entry.id();
                self.requests().insert(
                    request_id.to_string(),
                    RequestState::Done {
                        fingerprint: fingerprint.to_string(),
                        id: id.clone(),
                    },
                );
                Ok(id)
            }
            Err(status) => {
                self.requests().remove(request_id);
                Err((status.code(), status.message().to_string()))
            }
        };
        let _ = tx.send(Some(outcome));
    }

    pub fn list(&self) -> Vec<Arc<Entry>> {
        let mut all: Vec<_> = self.lock().values().cloned().collect();
        all.sort_by_key(|e| e.record().created_at_ms);
        all
    }

    pub fn count(&self) -> usize {
        self.lock().len()
    }

    /// The sandbox, or NOT_FOUND saying so.
    pub fn get(&self, id: &str) -> Result<Arc<Entry>, Status> {
        if id.is_empty() {
            return Err(Status::invalid_argument(
                "sandbox_id is empty: give the id Create returned (see List)",
            ));
        }
        if id.len() > super::limits::MAX_SANDBOX_ID {
            return Err(Status::invalid_argument(format!(
                "sandbox_id is {} bytes, at most {} are allowed: give the id Create returned (like sb-0123456789ab)",
                id.len(),
                super::limits::MAX_SANDBOX_ID
            )));
        }
        if let Some(entry) = self.lock().get(id).cloned() {
            return Ok(entry);
        }
        if let Some(t) = self.tombstone(id) {
            return Err(dead_status(id, &t.reason));
        }
        Err(Status::not_found(format!(
            "no sandbox {id:?} on this node (never created, deleted, or expired): list them with `dsec ls`"
        )))
    }

    /// The tombstone of a sandbox that died (within the last 10 minutes).
    pub fn tombstone(&self, id: &str) -> Option<Arc<Tombstone>> {
        self.tombstones
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .rev()
            .find(|t| t.record.handle.id == id)
            .cloned()
    }

    /// Forgets a tombstone (Delete of a dead sandbox); whether there was one.
    pub fn remove_tombstone(&self, id: &str) -> bool {
        let mut all = self.tombstones.lock().unwrap_or_else(|e| e.into_inner());
        let before = all.len();
        all.retain(|t| t.record.handle.id != id);
        all.len() != before
    }

    fn bury(&self, tombstone: Tombstone) {
        let mut all = self.tombstones.lock().unwrap_or_else(|e| e.into_inner());
        all.push_back(Arc::new(tombstone));
        let cutoff = now_ms() - TOMBSTONE_KEEP.as_millis() as i64;
        while all
            .front()
            .is_some_and(|t| all.len() > MAX_TOMBSTONES || t.died_at_ms < cutoff)
        {
            all.pop_front();
        }
    }

    /// Why the sandbox's agent / VMM is dead, or None while it runs.
    pub fn death_reason(&self, entry: &Entry) -> Option<String> {
        if let Some(reason) = entry.death.get() {
            return Some(reason.clone());
        }
        let record = entry.record();
        if record.handle.is_alive() {
            return None;
        }
        Some(entry.death.get_or_init(|| describe_death(&record)).clone())
    }

    /// [`agent_error`](Self::agent_error) for a sandbox named by id (a status as is when the
    /// sandbox is gone).
    pub fn call_error(&self, id: &str, status: Status) -> Status {
        match self.lock().get(id).cloned() {
            Some(entry) => self.agent_error(&entry, status),
            None => status,
        }
    }

    /// An agent call's error in terms of the sandbox: FAILED_PRECONDITION naming why it died
    /// when it did (instead of a transport error), else the agent's status.
    pub fn agent_error(&self, entry: &Entry, status: Status) -> Status {
        let id = entry.id();
        let text = status.message();
        let broken = matches!(
            status.code(),
            tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Internal
        ) && ["h2 protocol", "transport", "connect", "broken pipe"]
            .iter()
            .any(|w| text.contains(w));
        if broken && entry.death.get().is_none() {
            // The connection broke first; the dying process may take a moment to show as
            // dead (its namespace is torn down before it becomes a zombie).
            let dead = || !entry.record().handle.is_alive();
            let wait = || {
                for _ in 0..100 {
                    if dead() {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
            };
            match tokio::runtime::Handle::try_current() {
                Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
                    tokio::task::block_in_place(wait)
                }
                _ => wait(),
            }
        }
        match self.death_reason(entry) {
            Some(reason) => dead_status(&id, &reason),
            None => super::grpc::agent_status(&id, status),
        }
    }

    /// The sandbox if it can run commands now (not paused, not dead).
    pub fn running(&self, id: &str) -> Result<Arc<Entry>, Status> {
        let entry = self.get(id)?;
        if let Some(reason) = self.death_reason(&entry) {
            return Err(dead_status(id, &reason));
        }
        if entry.record().paused {
            return Err(Status::failed_precondition(format!(
                "sandbox {id} is paused: resume it first"
            )));
        }
        entry.touch();
        Ok(entry)
    }

    fn image_initrd(&self, image: &str) -> PathBuf {
        self.config
            .artifacts
            .home
            .join("images")
            .join(image)
            .join("initramfs.cpio")
    }

    /// The read-only root disk a microVM of this plan boots into, if its image has one.
    fn image_root_disk(&self, plan: &Plan) -> Option<PathBuf> {
        if plan.kind != BackendKind::MicroVm {
            return None;
        }
        self.config.artifacts.image(&plan.image).root_disk()
    }

    /// Resolves the image for the backend: for containers a directory image
    /// (`$DSEC_HOME/images/NAME/rootfs`) wins over a layer-store image of the same name; for
    /// microVMs only `$DSEC_HOME/images/NAME/initramfs.cpio` counts.
    pub fn check_image(&self, kind: BackendKind, image: &str) -> Result<ImageSource, Status> {
        Catalog::check_name(image).map_err(image_status)?;
        match kind {
            BackendKind::Container => self.catalog.resolve(image).map_err(image_status),
            BackendKind::MicroVm => {
                let initrd = self.image_initrd(image);
                if !image.contains('/') && initrd.is_file() {
                    return Ok(ImageSource::Dir(initrd));
                }
                Err(image_status(self.catalog.not_found(image, "microvm")))
            }
        }
    }

    fn new_id(&self) -> String {
        format!("sb-{}", random_hex(6))
    }

    fn reserve(&self, demand: Demand) -> Result<(), Status> {
        self.budgets
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .reserve(demand, false)
            .map_err(|(which, message)| {
                self.metrics.admission_rejections[which].fetch_add(1, Ordering::Relaxed);
                Status::resource_exhausted(message)
            })
    }

    fn release(&self, demand: Demand) {
        self.budgets
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .release(demand);
    }

    fn spec_for(
        &self,
        plan: &Plan,
        id: &str,
        cgroups: &[PathBuf],
        rootfs: Option<PathBuf>,
    ) -> SandboxSpec {
        let root_disk = self.image_root_disk(plan);
        SandboxSpec {
            vcpus: plan.demand.vcpus as u32,
            mem_mib: plan.demand.memory_mib as u32,
            rootfs,
            initrd: Some(self.image_initrd(&plan.image)),
            ready_timeout: self.config.ready_timeout,
            id: Some(id.to_string()),
            disk_mib: (plan.kind == BackendKind::Container || root_disk.is_some())
                .then_some(plan.demand.disk_mib as u32),
            root_disk,
            cgroup_procs: cgroup::procs_files(cgroups),
            ..SandboxSpec::default()
        }
    }

    fn make_cgroups(&self, plan: &Plan, id: &str) -> Result<Vec<PathBuf>, Status> {
        let limits = Limits {
            memory_bytes: plan.memory_limit_mib as u64 * 1024 * 1024,
            ..Limits::for_sandbox(
                plan.kind,
                0,
                0,
                plan.demand.vcpus as u32,
                plan.demand.pids as u64,
            )
        };
        self.cgroups
            .create(id, limits)
            .map_err(|e| Status::internal(format!("cannot set up the sandbox's cgroups: {e}")))
    }

    /// Admits, creates, persists and registers a sandbox.
    pub async fn create(self: &Arc<Self>, mut plan: Plan) -> Result<Arc<Entry>, Status> {
        let started = Instant::now();
        plan.memory_limit_mib = memory_limit_mib(
            plan.kind,
            plan.demand.memory_mib,
            plan.demand.disk_mib,
            self.image_root_disk(&plan).is_some(),
        );
        if plan.kind == BackendKind::MicroVm {
            if let Some(reason) = &self.microvm_unavailable {
                return Err(Status::failed_precondition(format!(
                    "backend microvm cannot run on this node: {reason}; use the container backend"
                )));
            }
        }
        let source = self.check_image(plan.kind, &plan.image)?;
        self.reserve(plan.reserved())?;
        let id = self.new_id();
        let result = self.create_admitted(&plan, &id, source).await;
        match &result {
            Ok(_) => {
                self.metrics.creates_total.fetch_add(1, Ordering::Relaxed);
                self.metrics.observe_create(started.elapsed());
            }
            Err(status) => {
                self.release(plan.reserved());
                self.metrics
                    .create_failures_total
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(sandbox = %id, code = ?status.code(), message = status.message(), "create failed");
            }
        }
        result
    }

    async fn create_admitted(
        self: &Arc<Self>,
        plan: &Plan,
        id: &str,
        source: ImageSource,
    ) -> Result<Arc<Entry>, Status> {
        let cgroups = self.make_cgroups(plan, id)?;
        let (image_mount, rootfs) = match (plan.kind, source) {
            (BackendKind::Container, ImageSource::Dir(rootfs)) => (None, Some(rootfs)),
            (BackendKind::Container, ImageSource::Layers(image)) => {
                match self.images.acquire(&image).await {
                    Ok((instance, root)) => (Some(instance), Some(root)),
                    Err(err) => {
                        cgroup::remove(&cgroups);
                        return Err(Status::internal(format!(
                            "cannot mount image {:?}: {err}",
                            plan.image
                        )));
                    }
                }
            }
            (BackendKind::MicroVm, _) => (None, None),
        };
        let spec = self.spec_for(plan, id, &cgroups, rootfs);
        let sandbox = match Sandbox::create(plan.kind, &self.edge, &spec).await {
            Ok(sandbox) => sandbox,
            Err(err) => {
                cgroup::remove(&cgroups);
                if let Some(instance) = &image_mount {
                    self.images.release(instance).await;
                }
                return Err(edge_status(err));
            }
        };
        let client = sandbox.agent().clone();
        let handle = sandbox.detach();
        let now = now_ms();
        let record = Record {
            handle,
            image: plan.image.clone(),
            vcpus: plan.demand.vcpus as i32,
            memory_mib: plan.demand.memory_mib,
            disk_mib: plan.demand.disk_mib,
            pids_limit: plan.demand.pids,
            env: plan.env.clone(),
            labels: plan.labels.clone(),
            allow_internet: plan.allow_internet,
            allow: plan.allow.clone(),
            created_at_ms: now,
            expires_at_ms: if plan.ttl_s > 0 {
                now + plan.ttl_s * 1000
            } else {
                0
            },
            idle_timeout_s: plan.idle_timeout_s,
            paused: false,
            parent_id: String::new(),
            cgroups,
            memory_limit_mib: plan.memory_limit_mib,
            request_fingerprint: if plan.request_id.is_empty() {
                String::new()
            } else {
                plan.fingerprint()
            },
            request_id: plan.request_id.clone(),
            access_token: new_access_token(),
            public_ports: plan.public_ports.clone(),
            image_mount,
        };
        self.register(record, client).await
    }

    async fn register(&self, record: Record, client: AgentClient) -> Result<Arc<Entry>, Status> {
        if let Err(err) = record.persist() {
            let r = record.clone();
            let _ = tokio::task::spawn_blocking(move || {
                let _ = r.handle.teardown();
                cgroup::remove(&r.cgroups);
            })
            .await;
            if let Some(instance) = &record.image_mount {
                self.images.release(instance).await;
            }
            return Err(Status::internal(format!(
                "cannot persist the sandbox record: {err}"
            )));
        }
        append_event(
            &record.handle.dir,
            &format!(
                "created backend={} image={} pid={}",
                record.handle.backend, record.image, record.handle.pid
            ),
        );
        tracing::info!(sandbox = %record.handle.id, backend = %record.handle.backend, pid = record.handle.pid, "created");
        let id = record.handle.id.clone();
        let entry = Arc::new(Entry {
            record: Mutex::new(record),
            client,
            last_activity_ms: AtomicI64::new(now_ms()),
            claims: AtomicU64::new(0),
            death: std::sync::OnceLock::new(),
        });
        self.lock().insert(id, entry.clone());
        Ok(entry)
    }

    /// Removes the sandbox from the node and frees everything it held.
    pub async fn delete(&self, id: &str, reason: &str) -> Result<(), Status> {
        let entry = self.lock().remove(id).ok_or_else(|| {
            Status::not_found(format!("no sandbox {id:?} on this node (already deleted?)"))
        })?;
        let record = entry.record();
        append_event(&record.handle.dir, &format!("deleting ({reason})"));
        let r = record.clone();
        let result = tokio::task::spawn_blocking(move || {
            if r.paused && r.handle.backend == BackendKind::Container.as_str() {
                // Frozen tasks cannot die: thaw first.
                let _ = cgroup::set_frozen(&r.cgroups, false);
            }
            let torn = r.handle.teardown();
            cgroup::remove(&r.cgroups);
            torn
        })
        .await
        .map_err(|e| Status::internal(format!("teardown task failed: {e}")))?;
        if let Some(instance) = &record.image_mount {
            self.images.release(instance).await;
        }
        self.release(record.demand());
        self.metrics.deletes_total.fetch_add(1, Ordering::Relaxed);
        if !record.request_id.is_empty() {
            let mut requests = self.requests();
            if matches!(requests.get(&record.request_id), Some(RequestState::Done { id: done, .. }) if done == id)
            {
                requests.remove(&record.request_id);
            }
        }
        tracing::info!(sandbox = %id, reason, "deleted");
        result.map_err(|e| Status::internal(format!("sandbox {id} teardown: {e}")))
    }

    pub async fn set_paused(&self, id: &str, paused: bool) -> Result<Arc<Entry>, Status> {
        let entry = self.get(id)?;
        let record = entry.record();
        if record.paused == paused {
            return Ok(entry);
        }
        if record.handle.backend == BackendKind::Container.as_str() {
            let cgroups = record.cgroups.clone();
            tokio::task::spawn_blocking(move || cgroup::set_frozen(&cgroups, paused))
                .await
                .map_err(|e| Status::internal(format!("freezer task failed: {e}")))?
                .map_err(|e| {
                    Status::failed_precondition(format!("cannot pause/resume sandbox {id}: {e}"))
                })?;
        } else {
            let op = if paused { "pause" } else { "resume" };
            vmm_control(&record, serde_json::json!({ "op": op })).await?;
        }
        {
            let mut r = entry.record.lock().unwrap_or_else(|e| e.into_inner());
            r.paused = paused;
            let _ = r.persist();
        }
        entry.touch();
        entry.event(if paused { "paused" } else { "resumed" });
        Ok(entry)
    }

    /// Opens `port` to everyone or makes it private again; returns the public ports.
    pub fn set_port_public(&self, id: &str, port: u16, public: bool) -> Result<Vec<u32>, Status> {
        let entry = self.get(id)?;
        let mut r = entry.record.lock().unwrap_or_else(|e| e.into_inner());
        if public && !r.public_ports.contains(&port) && r.public_ports.len() >= MAX_PUBLIC_PORTS {
            return Err(Status::invalid_argument(format!(
                "sandbox {id} already has {MAX_PUBLIC_PORTS} public ports, the most allowed: make one private first"
            )));
        }
        let changed = if public {
            r.public_ports.insert(port)
        } else {
            r.public_ports.remove(&port)
        };
        if changed {
            r.persist().map_err(|e| Status::internal(e.to_string()))?;
            append_event(
                &r.handle.dir,
                &format!(
                    "port {port} made {}",
                    if public { "public" } else { "private" }
                ),
            );
        }
        Ok(r.public_ports.iter().map(|p| u32::from(*p)).collect())
    }

    pub fn set_timeout(
        &self,
        id: &str,
        ttl_s: i64,
        idle_s: Option<i64>,
    ) -> Result<Arc<Entry>, Status> {
        super::limits::check_lifetime_s("ttl_seconds", ttl_s)?;
        if let Some(idle) = idle_s {
            super::limits::check_lifetime_s("idle_timeout_seconds", idle)?;
        }
        let entry = self.get(id)?;
        {
            let mut r = entry.record.lock().unwrap_or_else(|e| e.into_inner());
            r.expires_at_ms = if ttl_s > 0 {
                now_ms() + ttl_s * 1000
            } else {
                0
            };
            if let Some(idle) = idle_s {
                r.idle_timeout_s = idle;
            }
            r.persist().map_err(|e| Status::internal(e.to_string()))?;
        }
        entry.touch();
        Ok(entry)
    }

    /// Snapshot of a microVM sandbox into `path` (default under the state dir).
    pub async fn snapshot(&self, id: &str, path: &str, diff: bool) -> Result<PathBuf, Status> {
        let entry = self.get(id)?;
        let record = entry.record();
        if record.handle.backend != BackendKind::MicroVm.as_str() {
            return Err(Status::unimplemented(
                "snapshots are implemented for microvm sandboxes only (container state is not captured yet)",
            ));
        }
        let default_dir = self.config.state_dir.join("snapshots");
        let path = snapshot_path(
            id,
            path,
            record.handle.snapshot_dir.as_deref(),
            &default_dir,
        )?;
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)
                .map_err(|e| Status::internal(format!("create {}: {e}", parent.display())))?;
        }
        vmm_control(
            &record,
            serde_json::json!({ "op": "snapshot", "path": path, "diff": diff }),
        )
        .await?;
        entry.event(&format!("snapshot written to {}", path.display()));
        Ok(path)
    }

    /// Forks a microVM sandbox: one snapshot, `count` children restored from it.
    pub async fn fork(
        self: &Arc<Self>,
        id: &str,
        count: usize,
        labels: BTreeMap<String, String>,
    ) -> Result<Vec<Arc<Entry>>, Status> {
        let parent = self.get(id)?.record();
        let mut merged = parent.labels.clone();
        merged.extend(labels.clone());
        if merged.len() > super::limits::MAX_LABELS {
            return Err(Status::invalid_argument(format!(
                "the children would carry {} labels (the parent's and these), at most {} are allowed",
                merged.len(),
                super::limits::MAX_LABELS
            )));
        }
        if parent.handle.backend != BackendKind::MicroVm.as_str() {
            return Err(Status::unimplemented(
                "fork is implemented for microvm sandboxes only (from a VMM snapshot); for containers create a new sandbox",
            ));
        }
        let on_disk = self
            .config
            .artifacts
            .image(&parent.image)
            .root_disk()
            .is_some();
        // On a disk image every child needs its own copy of the writable upper disk, taken
        // while the parent is paused so that it matches the snapshot's memory exactly.
        let was_paused = parent.paused;
        if on_disk && !was_paused {
            vmm_control(&parent, serde_json::json!({ "op": "pause" })).await?;
        }
        let frozen = async {
            let snapshot = self.snapshot(id, "", false).await?;
            let mut uppers = Vec::new();
            if on_disk {
                let src = parent.handle.dir.join("upper.ext4");
                for i in 0..count {
                    let dst = parent
                        .handle
                        .dir
                        .join(format!("fork-{}-{i}.ext4", now_ms()));
                    let copied = {
                        let (src, dst) = (src.clone(), dst.clone());
                        tokio::task::spawn_blocking(move || copy_sparse(&src, &dst))
                            .await
                            .map_err(|e| Status::internal(format!("copy task failed: {e}")))?
                    };
                    if let Err(e) = copied {
                        let _ = std::fs::remove_file(&dst);
                        uppers.iter().for_each(|u| drop(std::fs::remove_file(u)));
                        let _ = std::fs::remove_dir_all(&snapshot);
                        return Err(Status::internal(format!(
                            "copy the upper disk {} for a fork child: {e}",
                            src.display()
                        )));
                    }
                    uppers.push(dst);
                }
            }
            Ok::<_, Status>((snapshot, uppers))
        }
        .await;
        if on_disk && !was_paused {
            vmm_control(&parent, serde_json::json!({ "op": "resume" })).await?;
        }
        let (snapshot, uppers) = frozen?;
        let mut uppers = uppers.into_iter();
        let mut children = Vec::new();
        for _ in 0..count {
            let upper = uppers.next();
            let mut all_labels = parent.labels.clone();
            all_labels.extend(labels.clone());
            let plan = Plan {
                kind: BackendKind::MicroVm,
                image: parent.image.clone(),
                demand: Demand {
                    memory_mib: parent.memory_mib,
                    ..parent.demand()
                },
                memory_limit_mib: parent.demand().memory_mib,
                env: parent.env.clone(),
                labels: all_labels,
                ttl_s: 0,
                idle_timeout_s: parent.idle_timeout_s,
                allow_internet: parent.allow_internet,
                allow: parent.allow.clone(),
                request_id: String::new(),
                public_ports: parent.public_ports.clone(),
            };
            self.reserve(plan.reserved())?;
            let child_id = self.new_id();
            let cgroups = match self.make_cgroups(&plan, &child_id) {
                Ok(c) => c,
                Err(e) => {
                    self.release(plan.reserved());
                    return Err(e);
                }
            };
            let spec = self.spec_for(&plan, &child_id, &cgroups, None);
            let cid = self.next_cid.fetch_add(1, Ordering::Relaxed);
            let restored = restore_microvm(
                &self.edge,
                &snapshot,
                &child_id,
                cid,
                &spec,
                upper.as_deref(),
            )
            .await;
            // Every child restores the parent's RNG state and its clock as of the snapshot:
            // without fresh entropy, children would produce the same "random" keys, UUIDs
            // and nonces. A child that cannot be refreshed is not handed out.
            let restored = match restored {
                Ok(sandbox) => match refresh_child(&sandbox).await {
                    Ok(()) => Ok(sandbox),
                    Err(err) => {
                        let _ = sandbox.destroy().await;
                        Err(err)
                    }
                },
                Err(err) => Err(err),
            };
            let sandbox = match restored {
                Ok(s) => s,
                Err(err) => {
                    cgroup::remove(&cgroups);
                    self.release(plan.reserved());
                    uppers.for_each(|u| drop(std::fs::remove_file(u)));
                    let _ = std::fs::remove_dir_all(&snapshot);
                    return Err(edge_status(err));
                }
            };
            let client = sandbox.agent().clone();
            let now = now_ms();
            let record = Record {
                handle: sandbox.detach(),
                image: plan.image.clone(),
                vcpus: parent.vcpus,
                memory_mib: parent.memory_mib,
                disk_mib: parent.disk_mib,
                pids_limit: parent.pids_limit,
                env: plan.env.clone(),
                labels: plan.labels.clone(),
                allow_internet: plan.allow_internet,
                allow: plan.allow.clone(),
                created_at_ms: now,
                expires_at_ms: 0,
                idle_timeout_s: plan.idle_timeout_s,
                paused: false,
                parent_id: id.to_string(),
                cgroups,
                memory_limit_mib: plan.memory_limit_mib,
                request_id: String::new(),
                request_fingerprint: String::new(),
                access_token: new_access_token(),
                public_ports: plan.public_ports.clone(),
                image_mount: None,
            };
            children.push(self.register(record, client).await?);
        }
        let _ = std::fs::remove_dir_all(&snapshot);
        Ok(children)
    }

    /// One pass of TTL / idle / death reaping.
    pub async fn reap_once(&self) {
        let now = now_ms();
        let mut doomed = Vec::new();
        let dead_images = self.images.dead().await;
        for entry in self.list() {
            let r = entry.record();
            let image_gone = r
                .image_mount
                .as_ref()
                .is_some_and(|m| dead_images.contains(m));
            let reason = if !r.handle.is_alive() || image_gone {
                Some(ReapReason::Died)
            } else if r.expires_at_ms > 0 && now >= r.expires_at_ms {
                Some(ReapReason::Ttl)
            } else if r.idle_timeout_s > 0
                && !r.paused
                && now - entry.last_activity_ms.load(Ordering::Relaxed) >= r.idle_timeout_s * 1000
            {
                Some(ReapReason::Idle)
            } else {
                None
            };
            if let Some(reason) = reason {
                doomed.push((r.handle.id.clone(), reason));
            }
        }
        for (id, reason) in doomed {
            let mut why = reason.as_str().to_string();
            let mut tombstone = None;
            if let (ReapReason::Died, Ok(entry)) = (reason, self.get(&id)) {
                let record = entry.record();
                let image_gone = record
                    .image_mount
                    .as_ref()
                    .is_some_and(|m| dead_images.contains(m));
                let cause = match self.death_reason(&entry) {
                    Some(cause) => cause,
                    None if image_gone => {
                        "its image server died (the layer-store mount under its root is gone)"
                            .to_string()
                    }
                    None => "its process is gone".to_string(),
                };
                why = format!("died: {cause}");
                entry.event(&why);
                let logs = LOG_SOURCES
                    .iter()
                    .map(|(source, file)| {
                        (
                            *source,
                            tail_bytes(&record.handle.dir.join(file), TOMBSTONE_LOG_BYTES),
                        )
                    })
                    .filter(|(_, data)| !data.is_empty())
                    .collect();
                tombstone = Some(Tombstone {
                    record,
                    reason: cause,
                    died_at_ms: now_ms(),
                    last_activity_ms: entry.last_activity_ms.load(Ordering::Relaxed),
                    logs,
                });
            }
            // Buried before the record goes, so a Get never falls between the two (it sees
            // the record, then the tombstone); taken back if the delete fails.
            let died = tombstone.map(|t| {
                tracing::warn!(sandbox = %id, reason = %t.reason, "sandbox died");
                self.bury(t);
            });
            if self.delete(&id, &why).await.is_ok() {
                self.metrics.reaped[reason as usize].fetch_add(1, Ordering::Relaxed);
            } else if died.is_some() {
                self.remove_tombstone(&id);
            }
        }
    }

    pub async fn reaper(self: Arc<Self>) {
        loop {
            tokio::time::sleep(self.config.reap_interval).await;
            self.reap_once().await;
        }
    }

    pub fn usage(&self, record: &Record) -> (u64, u64, u64) {
        cgroup::usage(&record.cgroups)
    }
}

/// One request on the VMM's control socket.
async fn vmm_control(
    record: &Record,
    request: serde_json::Value,
) -> Result<serde_json::Value, Status> {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    let sock =
        record.handle.api_socket.clone().ok_or_else(|| {
            Status::failed_precondition("this sandbox's VMM has no control socket")
        })?;
    let talk = async {
        let mut stream = tokio::net::UnixStream::connect(&sock).await?;
        let mut line = request.to_string();
        line.push('\n');
        stream.write_all(line.as_bytes()).await?;
        let mut reader = tokio::io::BufReader::new(stream);
        let mut reply = String::new();
        reader.read_line(&mut reply).await?;
        Ok::<_, std::io::Error>(reply)
    };
    let reply = tokio::time::timeout(Duration::from_secs(60), talk)
        .await
        .map_err(|_| {
            Status::deadline_exceeded("the VMM did not answer its control socket within 60 s")
        })?
        .map_err(|e| Status::unavailable(format!("VMM control socket {}: {e}", sock.display())))?;
    let value: serde_json::Value = serde_json::from_str(reply.trim())
        .map_err(|e| Status::internal(format!("VMM control reply {reply:?}: {e}")))?;
    if value["ok"].as_bool() == Some(true) {
        Ok(value)
    } else {
        Err(Status::failed_precondition(format!(
            "the VMM refused {request}: {}",
            value["error"].as_str().unwrap_or("no reason given")
        )))
    }
}

/// Copies a sparse disk image keeping its holes: only the data extents are copied (a fresh
/// 1 GiB upper disk holds a few MiB of ext4 metadata).
fn copy_sparse(src: &Path, dst: &Path) -> std::io::Result<()> {
    use nix::unistd::{lseek, Whence};
    use std::os::unix::fs::FileExt;
    let from = std::fs::File::open(src)?;
    let len = from.metadata()?.len() as i64;
    let to = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(dst)?;
    to.set_len(len as u64)?;
    let mut buf = vec![0u8; 1 << 20];
    let mut pos = 0i64;
    while pos < len {
        let data = match lseek(&from, pos, Whence::SeekData) {
            Ok(d) => d,
            // No data after pos: the rest is a hole.
            Err(nix::errno::Errno::ENXIO) => break,
            Err(e) => return Err(e.into()),
        };
        let hole = lseek(&from, data, Whence::SeekHole)?.min(len);
        let mut at = data;
        while at < hole {
            let n = ((hole - at) as usize).min(buf.len());
            from.read_exact_at(&mut buf[..n], at as u64)?;
            to.write_all_at(&buf[..n], at as u64)?;
            at += n as i64;
        }
        pos = hole;
    }
    to.sync_all()
}

/// Where a snapshot of sandbox `id` goes: `requested`, or a new directory under the
/// sandbox's jail snapshot directory (jailed VMM) or `default_dir`. A jailed VMM sees no other
/// host path, so a requested path elsewhere is refused before the VMM is asked.
fn snapshot_path(
    id: &str,
    requested: &str,
    jail_dir: Option<&Path>,
    default_dir: &Path,
) -> Result<PathBuf, Status> {
    let stamp = now_ms();
    match (requested.is_empty(), jail_dir) {
        (true, Some(dir)) => Ok(dir.join(stamp.to_string())),
        (true, None) => Ok(default_dir.join(format!("{id}-{stamp}"))),
        (false, Some(dir)) => {
            let p = PathBuf::from(requested);
            let inside = p.is_absolute()
                && p.starts_with(dir)
                && p != dir
                && !p
                    .components()
                    .any(|c| matches!(c, std::path::Component::ParentDir));
            if inside {
                Ok(p)
            } else {
                Err(Status::invalid_argument(format!(
                    "snapshot path {requested:?}: this sandbox's VMM runs in a jail and can write \
                     snapshots only under {}; leave the path empty or name a directory there \
                     (or start the node with --no-jail)",
                    dir.display()
                )))
            }
        }
        (false, None) => Ok(PathBuf::from(requested)),
    }
}

/// Gives a forked child fresh host entropy and the host's clock (see `fork`).
async fn refresh_child(sandbox: &crate::Sandbox) -> Result<(), EdgeError> {
    use std::io::Read;
    let mut entropy = vec![0u8; 64];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut entropy))
        .map_err(|e| EdgeError::io("read host entropy for a fork child", e))?;
    match tokio::time::timeout(
        Duration::from_secs(10),
        sandbox.agent().refresh(entropy, None),
    )
    .await
    {
        Ok(result) => result.map(|skew| {
            tracing::info!(
                sandbox = %sandbox.id(),
                clock_skew_ms = skew.as_millis() as u64,
                "fork child refreshed (fresh entropy, host clock)"
            );
        }),
        Err(_) => Err(EdgeError::Protocol(format!(
            "fork child {} did not take fresh entropy within 10 s; it was removed",
            sandbox.id()
        ))),
    }
}

/// Kills processes whose command line or environment references a sandbox directory under `dir` that is not
/// in `keep`. Returns how many were killed.
fn kill_strays(dir: &Path, keep: &HashSet<String>) -> usize {
    let prefix = format!("{}/", dir.display());
    let me = std::process::id() as i32;
    let mut killed = 0;
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        if pid == me {
            continue;
        }
        // A VMM names its sandbox directory on its command line; a container's agent (whose
        // command line must not show host paths) in its environment.
        let Some((text, pos)) = ["cmdline", "environ"].iter().find_map(|file| {
            let bytes = std::fs::read(format!("/proc/{pid}/{file}")).ok()?;
            let text = String::from_utf8_lossy(&bytes).into_owned();
            let pos = text.find(&prefix)?;
            Some((text, pos))
        }) else {
            continue;
        };
        let id: String = text[pos + prefix.len()..]
            .chars()
            .take_while(|c| *c != '/' && *c != '\0')
            .collect();
        if keep.contains(&id) {
            continue;
        }
        tracing::info!(pid, sandbox = %id, "killing a process of a sandbox that was not adopted");
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
        let _ = nix::sys::wait::waitpid(
            nix::unistd::Pid::from_raw(pid),
            Some(nix::sys::wait::WaitPidFlag::WNOHANG),
        );
        killed += 1;
    }
    killed
}

fn host_memory_mib() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("MemTotal:"))?;
            line.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .map(|kib| kib / 1024)
        .unwrap_or(1024)
}

/// Per-sandbox pid limits are ceilings most sandboxes never approach, so their sum may
/// exceed pid_max: 8x overcommit.
fn default_pid_budget() -> u64 {
    std::fs::read_to_string("/proc/sys/kernel/pid_max")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .unwrap_or(32768)
        * 8
}

fn free_disk_mib(path: &Path) -> u64 {
    nix::sys::statvfs::statvfs(path)
        .map(|s| s.blocks_available() * s.fragment_size() / (1024 * 1024))
        .unwrap_or(10 * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sparse_copies_keep_data_and_holes() {
        use std::os::unix::fs::{FileExt, MetadataExt};
        let dir = std::env::temp_dir().join(format!("dsec-sparse-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (src, dst) = (dir.join("a.img"), dir.join("b.img"));
        let f = std::fs::File::create(&src).unwrap();
        f.set_len(64 << 20).unwrap();
        f.write_all_at(b"head", 0).unwrap();
        f.write_all_at(&vec![7u8; 3 << 20], 20 << 20).unwrap();
        f.write_all_at(b"tail", (64 << 20) - 4).unwrap();
        drop(f);
        copy_sparse(&src, &dst).unwrap();
        assert_eq!(std::fs::read(&src).unwrap(), std::fs::read(&dst).unwrap());
        let blocks = std::fs::metadata(&dst).unwrap().blocks() * 512;
        assert!(
            blocks < 8 << 20,
            "copy allocates {blocks} bytes of a 64 MiB file"
        );
        // Never overwrites.
        assert!(copy_sparse(&src, &dst).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn jailed_snapshots_stay_in_the_jail_snapshot_dir() {
        let jail = Path::new("/run/dsec/edge/snapshots/vm-1");
        let default = Path::new("/run/dsec/edge/snapshots");
        let p = snapshot_path("vm-1", "", Some(jail), default).unwrap();
        assert_eq!(p.parent(), Some(jail));
        let p = snapshot_path("vm-1", "", None, default).unwrap();
        assert_eq!(p.parent(), Some(default));
        assert!(p
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .starts_with("vm-1-"));
        assert_eq!(
            snapshot_path(
                "vm-1",
                "/run/dsec/edge/snapshots/vm-1/a",
                Some(jail),
                default
            )
            .unwrap(),
            Path::new("/run/dsec/edge/snapshots/vm-1/a")
        );
        assert_eq!(
            snapshot_path("vm-1", "/srv/snap", None, default).unwrap(),
            Path::new("/srv/snap")
        );
        for outside in [
            "/srv/snap",
            "/run/dsec/edge/snapshots/vm-1",
            "/run/dsec/edge/snapshots/vm-1/../vm-2/x",
            "/run/dsec/edge/snapshots/vm-10/x",
            "run/dsec/edge/snapshots/vm-1/x",
        ] {
            let err = snapshot_path("vm-1", outside, Some(jail), default).unwrap_err();
            assert_eq!(err.code(), tonic::Code::InvalidArgument, "{outside}");
            assert!(err.message().contains("--no-jail"), "{}", err.message());
        }
    }
}
