//! Test helpers: a real single-member etcd on loopback in a temporary directory, and a macro
//! that runs one async test body against both stores.

use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::store::{
    EmbeddedStore, EtcdStore, KeyValue, LeaseId, Range, Revision, Store, StoreResult, Txn,
    TxnOutcome, Watch,
};

/// A store under test and whatever must live as long as it (the etcd process).
pub struct TestStore {
    pub store: Arc<dyn Store>,
    _etcd: Option<EtcdProcess>,
}

pub fn embedded() -> TestStore {
    TestStore {
        store: Arc::new(EmbeddedStore::in_memory()),
        _etcd: None,
    }
}

/// A fresh etcd and a store on it whose endpoint list also names `extra` (e.g. members that
/// are down), or `None` where etcd is not installed.
pub async fn etcd_with(extra: &[String]) -> Option<TestStore> {
    let test = etcd().await?;
    let etcd = test._etcd?;
    let mut endpoints = vec![etcd.endpoint.clone()];
    endpoints.extend(extra.iter().cloned());
    let store = EtcdStore::connect(&endpoints, "/test").await.unwrap();
    Some(TestStore {
        store: Arc::new(store),
        _etcd: Some(etcd),
    })
}

pub fn unused_endpoint() -> String {
    format!("http://127.0.0.1:{}", free_port())
}

/// A fresh etcd and a store on it, or `None` (after saying so loudly) where etcd is not
/// installed. Under CI a missing etcd fails the test instead.
pub async fn etcd() -> Option<TestStore> {
    let etcd = EtcdProcess::start()?;
    let endpoint = etcd.endpoint.clone();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let attempt = async {
            let store = EtcdStore::connect(std::slice::from_ref(&endpoint), "/test").await?;
            store.get("probe").await?;
            Ok::<_, crate::store::StoreError>(store)
        };
        match attempt.await {
            Ok(store) => {
                return Some(TestStore {
                    store: Arc::new(store),
                    _etcd: Some(etcd),
                })
            }
            Err(e) if Instant::now() > deadline => {
                panic!(
                    "etcd at {endpoint} did not answer within 20 s: {e}; its log: {}",
                    std::fs::read_to_string(etcd.dir.path().join("etcd.log")).unwrap_or_default()
                )
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("no free loopback port")
}

/// `etcd` from Debian's `etcd-server`, killed and its data removed on drop.
pub struct EtcdProcess {
    child: Child,
    dir: tempfile::TempDir,
    pub endpoint: String,
}

impl EtcdProcess {
    fn binary() -> Option<PathBuf> {
        ["/usr/bin/etcd", "/usr/local/bin/etcd"]
            .iter()
            .map(PathBuf::from)
            .find(|p| p.exists())
    }

    fn start() -> Option<Self> {
        let Some(binary) = Self::binary() else {
            let message = "etcd is not installed (apt-get install etcd-server; setup.sh does it)";
            if std::env::var_os("CI").is_some() {
                panic!("{message}");
            }
            eprintln!("\n*** SKIPPED an etcd store test: {message} ***\n");
            return None;
        };
        let dir = tempfile::tempdir().expect("temporary directory for etcd");
        let (client, peer) = (free_port(), free_port());
        let endpoint = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let log = std::fs::File::create(dir.path().join("etcd.log")).expect("etcd log file");
        let mut command = Command::new(binary);
        command
            .args(["--name", "test"])
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .args(["--listen-client-urls", &endpoint])
            .args(["--advertise-client-urls", &endpoint])
            .args(["--listen-peer-urls", &peer_url])
            .args(["--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("test={peer_url}")])
            // Short election ticks so that 1 s leases are not rounded up to etcd's minimum.
            .args(["--heartbeat-interval", "10", "--election-timeout", "100"])
            .args(["--log-level", "warn"])
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("etcd log file"))
            .stderr(log);
        // SAFETY: prctl with PR_SET_PDEATHSIG only changes this child's own death signal and is
        // async-signal-safe; it makes etcd die with the test process if a test is killed.
        unsafe {
            command.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command.spawn().expect("spawning etcd");
        Some(EtcdProcess {
            child,
            dir,
            endpoint,
        })
    }
}

impl Drop for EtcdProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Defines `embedded::NAME` and `etcd::NAME` tests that run `super::NAME(store)` for every
/// listed async fn taking an `Arc<dyn Store>`.
macro_rules! on_both_stores {
    ($($name:ident),* $(,)?) => {
        mod embedded {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let store = $crate::testing::embedded();
                    super::$name(store.store.clone()).await;
                }
            )*
        }
        mod etcd {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let Some(store) = $crate::testing::etcd().await else { return };
                    super::$name(store.store.clone()).await;
                }
            )*
        }
    };
}
pub(crate) use on_both_stores;

/// The real store, counting the reads that go through it.
pub struct Counting {
    inner: Arc<dyn Store>,
    reads: AtomicUsize,
}

impl Counting {
    pub fn over(inner: Arc<dyn Store>) -> Arc<Self> {
        Arc::new(Counting {
            inner,
            reads: AtomicUsize::new(0),
        })
    }

    /// Gets and ranges so far.
    pub fn reads(&self) -> usize {
        self.reads.load(Ordering::SeqCst)
    }
}

#[async_trait::async_trait]
impl Store for Counting {
    async fn get(&self, key: &str) -> StoreResult<Option<KeyValue>> {
        self.reads.fetch_add(1, Ordering::SeqCst);
        self.inner.get(key).await
    }
    async fn range(&self, prefix: &str) -> StoreResult<Range> {
        self.reads.fetch_add(1, Ordering::SeqCst);
        self.inner.range(prefix).await
    }
    async fn put(
        &self,
        key: &str,
        value: Vec<u8>,
        lease: Option<LeaseId>,
    ) -> StoreResult<Revision> {
        self.inner.put(key, value, lease).await
    }
    async fn delete(&self, key: &str) -> StoreResult<bool> {
        self.inner.delete(key).await
    }
    async fn txn(&self, txn: Txn) -> StoreResult<TxnOutcome> {
        self.inner.txn(txn).await
    }
    async fn grant_lease(&self, ttl: Duration) -> StoreResult<LeaseId> {
        self.inner.grant_lease(ttl).await
    }
    async fn keep_alive(&self, lease: LeaseId) -> StoreResult<()> {
        self.inner.keep_alive(lease).await
    }
    async fn revoke_lease(&self, lease: LeaseId) -> StoreResult<()> {
        self.inner.revoke_lease(lease).await
    }
    async fn watch(&self, prefix: &str, after: Option<Revision>) -> StoreResult<Watch> {
        self.inner.watch(prefix, after).await
    }
}
