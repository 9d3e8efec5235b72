//! The single-machine store: a `BTreeMap` in memory, made durable by a write-ahead log of JSON
//! lines (`wal.jsonl`, each commit fsynced before it is acknowledged) and a snapshot
//! (`snapshot.json`, written to a temporary file and renamed) that the log is folded into
//! once it grows. Opening replays the snapshot, then every log record above its revision; a
//! torn last line (a crash mid-write) is cut off, anything else unreadable is an error.
//! Leases survive a restart with a fresh TTL, as in etcd.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use super::{
    check_ttl, EventKind, KeyValue, LeaseId, Op, Range, Revision, Store, StoreError, StoreResult,
    Txn, TxnOutcome, Watch, WatchEvent,
};

/// Changes kept in memory so that a watch can start a little in the past.
const HISTORY: usize = 8192;
/// Log records after which the log is folded into a new snapshot.
const COMPACT_AFTER: usize = 20_000;
/// How often expired leases are collected.
const LEASE_SWEEP: Duration = Duration::from_millis(100);

const SNAPSHOT: &str = "snapshot.json";
const WAL: &str = "wal.jsonl";

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Entry {
    #[serde(with = "b64")]
    value: Vec<u8>,
    mod_revision: Revision,
    lease: Option<LeaseId>,
}

#[derive(Debug)]
struct Lease {
    ttl: Duration,
    deadline: Instant,
    keys: BTreeSet<String>,
}

/// One line of the write-ahead log.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "t", rename_all = "snake_case")]
enum LogRecord {
    Commit {
        revision: Revision,
        ops: Vec<LoggedOp>,
    },
    Lease {
        id: LeaseId,
        ttl_ms: u64,
    },
    LeaseEnd {
        id: LeaseId,
    },
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
enum LoggedOp {
    Put {
        key: String,
        #[serde(with = "b64")]
        value: Vec<u8>,
        lease: Option<LeaseId>,
    },
    Delete {
        key: String,
    },
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct Snapshot {
    revision: Revision,
    next_lease: LeaseId,
    kvs: BTreeMap<String, Entry>,
    /// Lease id -> TTL in milliseconds.
    leases: BTreeMap<LeaseId, u64>,
}

struct Watcher {
    prefix: String,
    events: mpsc::UnboundedSender<StoreResult<WatchEvent>>,
}

struct Log {
    dir: PathBuf,
    file: File,
    records: usize,
    compact_after: usize,
}

#[derive(Default)]
struct State {
    kvs: BTreeMap<String, Entry>,
    revision: Revision,
    next_lease: LeaseId,
    leases: HashMap<LeaseId, Lease>,
    history: VecDeque<WatchEvent>,
    watchers: Vec<Watcher>,
    log: Option<Log>,
}

/// In-process store for one machine; see the module doc.
#[derive(Clone)]
pub struct EmbeddedStore {
    state: Arc<Mutex<State>>,
}

impl std::fmt::Debug for EmbeddedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EmbeddedStore")
    }
}

impl EmbeddedStore {
    /// A store that keeps nothing on disk (tests, simulations).
    pub fn in_memory() -> Self {
        Self::start(State {
            next_lease: 1,
            ..State::default()
        })
    }

    /// Opens (or creates) the store persisted under `dir`. Must run inside a tokio runtime:
    /// a task collects expired leases.
    pub fn open(dir: &Path) -> StoreResult<Self> {
        Self::open_compacting_after(dir, COMPACT_AFTER)
    }

    /// [`EmbeddedStore::open`] with the log folded into a snapshot every `records` records.
    pub fn open_compacting_after(dir: &Path, records: usize) -> StoreResult<Self> {
        let compact_after = records.max(1);
        std::fs::create_dir_all(dir).map_err(io_err(dir))?;
        let snapshot_path = dir.join(SNAPSHOT);
        let snapshot: Snapshot = match std::fs::read(&snapshot_path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| StoreError::Corrupt {
                path: snapshot_path.display().to_string(),
                what: format!("unreadable snapshot: {e}"),
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Snapshot {
                next_lease: 1,
                ..Snapshot::default()
            },
            Err(e) => return Err(io_err(&snapshot_path)(e)),
        };
        let mut state = State {
            kvs: snapshot.kvs,
            revision: snapshot.revision,
            next_lease: snapshot.next_lease,
            ..State::default()
        };
        let now = Instant::now();
        for (id, ttl_ms) in snapshot.leases {
            state.leases.insert(id, new_lease(ttl_ms, now));
        }
        let records = replay_log(&dir.join(WAL), &mut state, now)?;
        for (key, entry) in &state.kvs {
            if let Some(lease) = entry.lease.and_then(|id| state.leases.get_mut(&id)) {
                lease.keys.insert(key.clone());
            }
        }
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join(WAL))
            .map_err(io_err(&dir.join(WAL)))?;
        state.log = Some(Log {
            dir: dir.to_path_buf(),
            file,
            records,
            compact_after,
        });
        Ok(Self::start(state))
    }

    fn start(state: State) -> Self {
        let store = EmbeddedStore {
            state: Arc::new(Mutex::new(state)),
        };
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(sweep_leases(Arc::downgrade(&store.state)));
        }
        store
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves consistent data (every mutation is applied
        // after its log write), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn new_lease(ttl_ms: u64, now: Instant) -> Lease {
    let ttl = Duration::from_millis(ttl_ms);
    Lease {
        ttl,
        deadline: now + ttl,
        keys: BTreeSet::new(),
    }
}

fn io_err(path: &Path) -> impl Fn(std::io::Error) -> StoreError + '_ {
    move |source| StoreError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Applies the log's records above the state's revision; returns how many records it holds.
/// Cuts off a torn last line.
fn replay_log(path: &Path, state: &mut State, now: Instant) -> StoreResult<usize> {
    let file = match File::open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(io_err(path)(e)),
    };
    let mut reader = BufReader::new(file);
    let mut good_len = 0u64;
    let mut records = 0;
    let mut line = String::new();
    loop {
        line.clear();
        let read = reader.read_line(&mut line).map_err(io_err(path))?;
        if read == 0 {
            break;
        }
        let complete = line.ends_with('\n');
        let record: LogRecord = match serde_json::from_str(line.trim_end()) {
            Ok(record) if complete => record,
            parsed => {
                // Only the last line may be torn; check nothing follows it.
                let mut rest = String::new();
                reader.read_line(&mut rest).map_err(io_err(path))?;
                if !rest.is_empty() {
                    let what = match parsed {
                        Err(e) => format!("log record after byte {good_len} is unreadable: {e}"),
                        Ok(_) => format!("log record after byte {good_len} has no line end"),
                    };
                    return Err(StoreError::Corrupt {
                        path: path.display().to_string(),
                        what,
                    });
                }
                tracing::warn!(
                    path = %path.display(),
                    offset = good_len,
                    "cutting off a torn last log record (a crash during a write)"
                );
                let file = OpenOptions::new()
                    .write(true)
                    .open(path)
                    .map_err(io_err(path))?;
                file.set_len(good_len).map_err(io_err(path))?;
                file.sync_all().map_err(io_err(path))?;
                break;
            }
        };
        good_len += read as u64;
        records += 1;
        match record {
            LogRecord::Commit { revision, ops } if revision > state.revision => {
                for op in ops {
                    match op {
                        LoggedOp::Put { key, value, lease } => {
                            state.kvs.insert(
                                key,
                                Entry {
                                    value,
                                    mod_revision: revision,
                                    lease,
                                },
                            );
                        }
                        LoggedOp::Delete { key } => {
                            state.kvs.remove(&key);
                        }
                    }
                }
                state.revision = revision;
            }
            LogRecord::Commit { .. } => {}
            LogRecord::Lease { id, ttl_ms } => {
                state.leases.insert(id, new_lease(ttl_ms, now));
                state.next_lease = state.next_lease.max(id + 1);
            }
            LogRecord::LeaseEnd { id } => {
                state.leases.remove(&id);
            }
        }
    }
    Ok(records)
}

impl State {
    /// Makes a record durable before the caller applies it.
    fn log(&mut self, record: &LogRecord) -> StoreResult<()> {
        let Some(log) = self.log.as_mut() else {
            return Ok(());
        };
        let path = log.dir.join(WAL);
        let mut line = serde_json::to_vec(record).map_err(|e| StoreError::Corrupt {
            path: path.display().to_string(),
            what: format!("cannot encode a log record: {e}"),
        })?;
        line.push(b'\n');
        log.file.write_all(&line).map_err(io_err(&path))?;
        log.file.sync_data().map_err(io_err(&path))?;
        log.records += 1;
        Ok(())
    }

    /// Folds the log into a snapshot once it is long enough; call only after the logged
    /// change is applied in memory, or the snapshot would miss it.
    fn maybe_compact(&mut self) -> StoreResult<()> {
        match &self.log {
            Some(log) if log.records >= log.compact_after => self.write_snapshot(),
            _ => Ok(()),
        }
    }

    /// Folds the log into a new snapshot. A crash between the rename and the truncation
    /// leaves log records at or below the snapshot's revision, which replay skips.
    fn write_snapshot(&mut self) -> StoreResult<()> {
        let Some(log) = self.log.as_mut() else {
            return Ok(());
        };
        let snapshot = Snapshot {
            revision: self.revision,
            next_lease: self.next_lease,
            kvs: self.kvs.clone(),
            leases: self
                .leases
                .iter()
                .map(|(id, lease)| (*id, lease.ttl.as_millis() as u64))
                .collect(),
        };
        let tmp = log.dir.join(format!("{SNAPSHOT}.tmp"));
        let bytes = serde_json::to_vec(&snapshot).map_err(|e| StoreError::Corrupt {
            path: tmp.display().to_string(),
            what: format!("cannot encode the snapshot: {e}"),
        })?;
        let mut file = File::create(&tmp).map_err(io_err(&tmp))?;
        file.write_all(&bytes).map_err(io_err(&tmp))?;
        file.sync_all().map_err(io_err(&tmp))?;
        let dest = log.dir.join(SNAPSHOT);
        std::fs::rename(&tmp, &dest).map_err(io_err(&dest))?;
        File::open(&log.dir)
            .and_then(|dir| dir.sync_all())
            .map_err(io_err(&log.dir))?;
        log.file.set_len(0).map_err(io_err(&log.dir.join(WAL)))?;
        log.file.sync_all().map_err(io_err(&log.dir.join(WAL)))?;
        log.records = 0;
        Ok(())
    }

    /// Logs and applies ops as one new revision, notifying watchers.
    fn commit(&mut self, ops: Vec<Op>) -> StoreResult<Revision> {
        for op in &ops {
            if let Op::Put {
                lease: Some(lease), ..
            } = op
            {
                if !self.leases.contains_key(lease) {
                    return Err(StoreError::LeaseNotFound(*lease));
                }
            }
        }
        let revision = self.revision + 1;
        let logged = ops
            .iter()
            .map(|op| match op {
                Op::Put { key, value, lease } => LoggedOp::Put {
                    key: key.clone(),
                    value: value.clone(),
                    lease: *lease,
                },
                Op::Delete { key } => LoggedOp::Delete { key: key.clone() },
            })
            .collect();
        self.log(&LogRecord::Commit {
            revision,
            ops: logged,
        })?;
        self.revision = revision;
        for op in ops {
            let event = match op {
                Op::Put { key, value, lease } => {
                    if let Some(old) = self.kvs.get(&key).and_then(|e| e.lease) {
                        if let Some(l) = self.leases.get_mut(&old) {
                            l.keys.remove(&key);
                        }
                    }
                    if let Some(l) = lease.and_then(|id| self.leases.get_mut(&id)) {
                        l.keys.insert(key.clone());
                    }
                    self.kvs.insert(
                        key.clone(),
                        Entry {
                            value: value.clone(),
                            mod_revision: revision,
                            lease,
                        },
                    );
                    WatchEvent {
                        kind: EventKind::Put,
                        key,
                        value,
                        revision,
                    }
                }
                Op::Delete { key } => {
                    let Some(old) = self.kvs.remove(&key) else {
                        continue;
                    };
                    if let Some(l) = old.lease.and_then(|id| self.leases.get_mut(&id)) {
                        l.keys.remove(&key);
                    }
                    WatchEvent {
                        kind: EventKind::Delete,
                        key,
                        value: Vec::new(),
                        revision,
                    }
                }
            };
            self.publish(event);
        }
        self.maybe_compact()?;
        Ok(revision)
    }

    fn publish(&mut self, event: WatchEvent) {
        self.watchers.retain(|w| {
            !event.key.starts_with(&w.prefix) || w.events.send(Ok(event.clone())).is_ok()
        });
        self.watchers.retain(|w| !w.events.is_closed());
        if self.history.len() == HISTORY {
            self.history.pop_front();
        }
        self.history.push_back(event);
    }

    fn end_lease(&mut self, id: LeaseId) -> StoreResult<()> {
        let Some(lease) = self.leases.get(&id) else {
            return Err(StoreError::LeaseNotFound(id));
        };
        let keys: Vec<Op> = lease.keys.iter().cloned().map(Op::delete).collect();
        if !keys.is_empty() {
            self.commit(keys)?;
        }
        self.log(&LogRecord::LeaseEnd { id })?;
        self.leases.remove(&id);
        self.maybe_compact()
    }

    fn key_value(&self, key: &str) -> Option<KeyValue> {
        self.kvs.get(key).map(|e| KeyValue {
            key: key.to_string(),
            value: e.value.clone(),
            mod_revision: e.mod_revision,
            lease: e.lease,
        })
    }
}

async fn sweep_leases(state: Weak<Mutex<State>>) {
    let mut tick = tokio::time::interval(LEASE_SWEEP);
    loop {
        tick.tick().await;
        let Some(state) = state.upgrade() else {
            return;
        };
        let mut state = state.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        let expired: Vec<LeaseId> = state
            .leases
            .iter()
            .filter(|(_, lease)| lease.deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in expired {
            if let Err(e) = state.end_lease(id) {
                tracing::error!(lease = id, "cannot expire a lease: {e}");
            }
        }
    }
}

#[async_trait::async_trait]
impl Store for EmbeddedStore {
    async fn get(&self, key: &str) -> StoreResult<Option<KeyValue>> {
        Ok(self.lock().key_value(key))
    }

    async fn range(&self, prefix: &str) -> StoreResult<Range> {
        let state = self.lock();
        let kvs = state
            .kvs
            .range(prefix.to_string()..)
            .take_while(|(key, _)| key.starts_with(prefix))
            .map(|(key, e)| KeyValue {
                key: key.clone(),
                value: e.value.clone(),
                mod_revision: e.mod_revision,
                lease: e.lease,
            })
            .collect();
        Ok(Range {
            kvs,
            revision: state.revision,
        })
    }

    async fn put(
        &self,
        key: &str,
        value: Vec<u8>,
        lease: Option<LeaseId>,
    ) -> StoreResult<Revision> {
        self.lock().commit(vec![Op::Put {
            key: key.to_string(),
            value,
            lease,
        }])
    }

    async fn delete(&self, key: &str) -> StoreResult<bool> {
        let mut state = self.lock();
        if !state.kvs.contains_key(key) {
            return Ok(false);
        }
        state.commit(vec![Op::delete(key)])?;
        Ok(true)
    }

    async fn txn(&self, txn: Txn) -> StoreResult<TxnOutcome> {
        let mut state = self.lock();
        let holds = txn
            .compares
            .iter()
            .all(|c| state.kvs.get(&c.key).map_or(0, |e| e.mod_revision) == c.mod_revision);
        if !holds || txn.ops.is_empty() {
            return Ok(TxnOutcome {
                succeeded: holds,
                revision: state.revision,
            });
        }
        let revision = state.commit(txn.ops)?;
        Ok(TxnOutcome {
            succeeded: true,
            revision,
        })
    }

    async fn grant_lease(&self, ttl: Duration) -> StoreResult<LeaseId> {
        check_ttl(ttl)?;
        let ttl = Duration::from_secs(ttl.as_secs_f64().ceil() as u64);
        let mut state = self.lock();
        let id = state.next_lease;
        state.log(&LogRecord::Lease {
            id,
            ttl_ms: ttl.as_millis() as u64,
        })?;
        state.next_lease += 1;
        state
            .leases
            .insert(id, new_lease(ttl.as_millis() as u64, Instant::now()));
        state.maybe_compact()?;
        Ok(id)
    }

    async fn keep_alive(&self, lease: LeaseId) -> StoreResult<()> {
        let mut state = self.lock();
        let now = Instant::now();
        match state.leases.get_mut(&lease) {
            Some(l) if l.deadline > now => {
                l.deadline = now + l.ttl;
                Ok(())
            }
            _ => Err(StoreError::LeaseNotFound(lease)),
        }
    }

    async fn revoke_lease(&self, lease: LeaseId) -> StoreResult<()> {
        self.lock().end_lease(lease)
    }

    async fn watch(&self, prefix: &str, after: Option<Revision>) -> StoreResult<Watch> {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut state = self.lock();
        if let Some(after) = after {
            let oldest_kept = state
                .history
                .front()
                .map_or(state.revision + 1, |e| e.revision);
            // Revisions in (after, oldest_kept) may have held changes we no longer have.
            if after + 1 < oldest_kept && after < state.revision {
                return Err(StoreError::Compacted {
                    requested: after + 1,
                    oldest: oldest_kept,
                });
            }
            for event in state.history.iter() {
                if event.revision > after && event.key.starts_with(prefix) {
                    let _ = tx.send(Ok(event.clone()));
                }
            }
        }
        state.watchers.push(Watcher {
            prefix: prefix.to_string(),
            events: tx,
        });
        Ok(Watch::new(rx))
    }
}

/// Byte values as base64 strings in the JSON files.
mod b64 {
    use base64::engine::general_purpose::STANDARD;
    use base64::Engine;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&STANDARD.encode(bytes))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let text = String::deserialize(d)?;
        STANDARD.decode(text).map_err(serde::de::Error::custom)
    }
}
