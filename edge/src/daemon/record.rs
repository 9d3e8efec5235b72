//! What the node keeps of each sandbox: its persisted record (`meta.json`), its live entry,
//! its event log, and the tombstone of one that died.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::admission::{Demand, MICROVM_OVERHEAD_MIB};
use super::cgroup;
use crate::backend::{BackendKind, SandboxHandle};
use crate::client::AgentClient;
use crate::error::EdgeError;

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

pub(super) fn random_hex(bytes: usize) -> String {
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
    /// The guest's agent holds `env` (given by the refresh that named it) and starts every
    /// exec with it; otherwise the node adds it to each exec (containers, older records).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub env_in_guest: bool,
    pub labels: BTreeMap<String, String>,
    pub allow_internet: bool,
    pub allow: Vec<String>,
    /// Network deny rules and policy names (see NetworkPolicy in api/proto/dsec.proto).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deny: Vec<String>,
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
    /// A microVM paused to disk: its VMM was ended after writing this snapshot, which a
    /// resume restores (same id, sockets and disks). None while a VMM runs it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suspended: Option<PathBuf>,
}

impl Record {
    /// Its process runs, or it is paused to disk (no process, nothing lost).
    pub fn is_alive(&self) -> bool {
        self.suspended.is_some() || self.handle.is_alive()
    }

    pub(super) fn demand(&self) -> Demand {
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
    /// A sandbox the node starts supervising now (created or adopted).
    pub fn new(record: Record, client: AgentClient) -> std::sync::Arc<Self> {
        std::sync::Arc::new(Self {
            record: Mutex::new(record),
            client,
            last_activity_ms: AtomicI64::new(now_ms()),
            claims: AtomicU64::new(0),
            death: std::sync::OnceLock::new(),
        })
    }

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
pub(super) fn tail_bytes(path: &Path, max: u64) -> Vec<u8> {
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
pub(super) fn describe_death(record: &Record) -> String {
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
