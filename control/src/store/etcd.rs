//! The cluster store: etcd v3 through `etcd-client`. Every key lives under a namespace prefix
//! so that several deployments (or tests) can share one etcd cluster.

use std::time::Duration;

use etcd_client::{
    Client, Compare as EtcdCompare, CompareOp, ConnectOptions, EventType, GetOptions, PutOptions,
    Txn as EtcdTxn, TxnOp, WatchOptions,
};
use tokio::sync::mpsc;

use super::{
    check_ttl, EventKind, KeyValue, LeaseId, Op, Range, Revision, Store, StoreError, StoreResult,
    Txn, TxnOutcome, Watch, WatchEvent,
};

/// A store in an etcd cluster; cheap to clone (one shared HTTP/2 channel).
#[derive(Clone)]
pub struct EtcdStore {
    client: Client,
    namespace: String,
}

impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore")
            .field("namespace", &self.namespace)
            .finish()
    }
}

impl EtcdStore {
    /// Connects to the cluster at `endpoints` (`http://host:port`); every key is stored under
    /// `namespace`.
    pub async fn connect(endpoints: &[String], namespace: &str) -> StoreResult<Self> {
        let options = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(3))
            .with_timeout(Duration::from_secs(10))
            .with_keep_alive(Duration::from_secs(5), Duration::from_secs(3));
        let client = Client::connect(endpoints, Some(options))
            .await
            .map_err(unavailable)?;
        Ok(EtcdStore {
            client,
            namespace: namespace.to_string(),
        })
    }

    fn full(&self, key: &str) -> String {
        format!("{}{key}", self.namespace)
    }

    fn key_value(&self, kv: &etcd_client::KeyValue) -> StoreResult<KeyValue> {
        Ok(KeyValue {
            key: self.strip(kv.key())?,
            value: kv.value().to_vec(),
            mod_revision: kv.mod_revision(),
            lease: (kv.lease() != 0).then_some(kv.lease()),
        })
    }

    fn strip(&self, key: &[u8]) -> StoreResult<String> {
        let text = std::str::from_utf8(key)
            .map_err(|_| StoreError::ForeignKey(String::from_utf8_lossy(key).into_owned()))?;
        Ok(text
            .strip_prefix(&self.namespace)
            .unwrap_or(text)
            .to_string())
    }
}

/// Tries of a call that could not connect to an etcd member (the channel picks members at
/// random, so with one of three down 16 tries all miss once in ~40 million calls).
const CONNECT_ATTEMPTS: u32 = 16;

/// Whether the call never reached a member (its connection could not be made): the
/// balanced channel still picks members that are down, so such a call is simply made again,
/// which is safe for writes too.
fn not_connected(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::GRpcStatus(status) => {
            status.code() == tonic::Code::Unavailable
                && dsec_api::tls::error_chain(status).contains("tcp connect error")
        }
        etcd_client::Error::TransportError(e) => {
            dsec_api::tls::error_chain(e).contains("tcp connect error")
        }
        _ => false,
    }
}

/// Runs `call` until it reaches a member (a short pause between tries), up to
/// `CONNECT_ATTEMPTS` times.
async fn retrying<T, F, Fut>(mut call: F) -> Result<T, etcd_client::Error>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, etcd_client::Error>>,
{
    let mut attempt = 1;
    loop {
        match call().await {
            Err(e) if attempt < CONNECT_ATTEMPTS && not_connected(&e) => {
                tokio::time::sleep(Duration::from_millis(5 * u64::from(attempt))).await;
                attempt += 1;
            }
            result => return result,
        }
    }
}

fn unavailable(e: etcd_client::Error) -> StoreError {
    StoreError::Unavailable(e.to_string())
}

/// etcd answers a put or keep-alive on an expired lease with NOT_FOUND.
fn lease_error(lease: Option<LeaseId>) -> impl Fn(etcd_client::Error) -> StoreError {
    move |e| match (&e, lease) {
        (etcd_client::Error::GRpcStatus(status), Some(lease))
            if status.code() == tonic::Code::NotFound =>
        {
            StoreError::LeaseNotFound(lease)
        }
        (etcd_client::Error::LeaseKeepAliveError(_), Some(lease)) => {
            StoreError::LeaseNotFound(lease)
        }
        _ => unavailable(e),
    }
}

fn header_revision(header: Option<&etcd_client::ResponseHeader>) -> Revision {
    header.map_or(0, |h| h.revision())
}

#[async_trait::async_trait]
impl Store for EtcdStore {
    async fn get(&self, key: &str) -> StoreResult<Option<KeyValue>> {
        let (kv, key) = (self.client.kv_client(), self.full(key));
        let response = retrying(|| {
            let (mut kv, key) = (kv.clone(), key.clone());
            async move { kv.get(key, None).await }
        })
        .await
        .map_err(unavailable)?;
        response
            .kvs()
            .first()
            .map(|kv| self.key_value(kv))
            .transpose()
    }

    async fn range(&self, prefix: &str) -> StoreResult<Range> {
        let (kv, prefix) = (self.client.kv_client(), self.full(prefix));
        let response = retrying(|| {
            let (mut kv, prefix) = (kv.clone(), prefix.clone());
            async move { kv.get(prefix, Some(GetOptions::new().with_prefix())).await }
        })
        .await
        .map_err(unavailable)?;
        Ok(Range {
            kvs: response
                .kvs()
                .iter()
                .map(|kv| self.key_value(kv))
                .collect::<StoreResult<_>>()?,
            revision: header_revision(response.header()),
        })
    }

    async fn put(
        &self,
        key: &str,
        value: Vec<u8>,
        lease: Option<LeaseId>,
    ) -> StoreResult<Revision> {
        let options = lease.map(|id| PutOptions::new().with_lease(id));
        let (kv, key) = (self.client.kv_client(), self.full(key));
        let response = retrying(|| {
            let (mut kv, key, value, options) =
                (kv.clone(), key.clone(), value.clone(), options.clone());
            async move { kv.put(key, value, options).await }
        })
        .await
        .map_err(lease_error(lease))?;
        Ok(header_revision(response.header()))
    }

    async fn delete(&self, key: &str) -> StoreResult<bool> {
        let (kv, key) = (self.client.kv_client(), self.full(key));
        let response = retrying(|| {
            let (mut kv, key) = (kv.clone(), key.clone());
            async move { kv.delete(key, None).await }
        })
        .await
        .map_err(unavailable)?;
        Ok(response.deleted() > 0)
    }

    async fn txn(&self, txn: Txn) -> StoreResult<TxnOutcome> {
        let compares: Vec<EtcdCompare> = txn
            .compares
            .iter()
            .map(|c| EtcdCompare::mod_revision(self.full(&c.key), CompareOp::Equal, c.mod_revision))
            .collect();
        let mut lease = None;
        let ops: Vec<TxnOp> = txn
            .ops
            .iter()
            .map(|op| match op {
                Op::Put {
                    key,
                    value,
                    lease: l,
                } => {
                    lease = lease.or(*l);
                    TxnOp::put(
                        self.full(key),
                        value.clone(),
                        l.map(|id| PutOptions::new().with_lease(id)),
                    )
                }
                Op::Delete { key } => TxnOp::delete(self.full(key), None),
            })
            .collect();
        let kv = self.client.kv_client();
        let etcd_txn = EtcdTxn::new().when(compares).and_then(ops);
        let response = retrying(|| {
            let (mut kv, etcd_txn) = (kv.clone(), etcd_txn.clone());
            async move { kv.txn(etcd_txn).await }
        })
        .await
        .map_err(lease_error(lease))?;
        Ok(TxnOutcome {
            succeeded: response.succeeded(),
            revision: header_revision(response.header()),
        })
    }

    async fn grant_lease(&self, ttl: Duration) -> StoreResult<LeaseId> {
        check_ttl(ttl)?;
        let seconds = ttl.as_secs_f64().ceil() as i64;
        let leases = self.client.lease_client();
        let response = retrying(|| {
            let mut leases = leases.clone();
            async move { leases.grant(seconds, None).await }
        })
        .await
        .map_err(unavailable)?;
        Ok(response.id())
    }

    async fn keep_alive(&self, lease: LeaseId) -> StoreResult<()> {
        // One refresh: the client opens the keep-alive stream, sends one request and checks
        // the answer's TTL; dropping the stream closes it.
        let leases = self.client.lease_client();
        retrying(|| {
            let mut leases = leases.clone();
            async move { leases.keep_alive(lease).await }
        })
        .await
        .map_err(lease_error(Some(lease)))?;
        Ok(())
    }

    async fn revoke_lease(&self, lease: LeaseId) -> StoreResult<()> {
        let leases = self.client.lease_client();
        retrying(|| {
            let mut leases = leases.clone();
            async move { leases.revoke(lease).await }
        })
        .await
        .map_err(lease_error(Some(lease)))?;
        Ok(())
    }

    async fn watch(&self, prefix: &str, after: Option<Revision>) -> StoreResult<Watch> {
        let mut options = WatchOptions::new().with_prefix();
        if let Some(after) = after {
            options = options.with_start_revision(after + 1);
        }
        let (watches, prefix) = (self.client.watch_client(), self.full(prefix));
        let mut stream = retrying(|| {
            let (mut watches, prefix, options) = (watches.clone(), prefix.clone(), options.clone());
            async move { watches.watch(prefix, Some(options)).await }
        })
        .await
        .map_err(unavailable)?;
        // Return only once etcd has registered the watch, so that no later write is missed.
        match stream.message().await.map_err(unavailable)? {
            Some(response) if response.created() && !response.canceled() => {}
            Some(response) if response.compact_revision() > 0 => {
                return Err(StoreError::Compacted {
                    requested: after.map_or(0, |a| a + 1),
                    oldest: response.compact_revision(),
                })
            }
            Some(response) => {
                return Err(StoreError::Unavailable(format!(
                    "etcd refused the watch: {}",
                    response.cancel_reason()
                )))
            }
            None => {
                return Err(StoreError::Unavailable(
                    "etcd closed the watch stream".to_string(),
                ))
            }
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let store = self.clone();
        tokio::spawn(async move {
            loop {
                let message = tokio::select! {
                    _ = tx.closed() => return,
                    message = stream.message() => message,
                };
                let response = match message {
                    Ok(Some(response)) => response,
                    Ok(None) => {
                        let _ = tx.send(Err(StoreError::Unavailable(
                            "etcd closed the watch stream".to_string(),
                        )));
                        return;
                    }
                    Err(e) => {
                        let _ = tx.send(Err(unavailable(e)));
                        return;
                    }
                };
                if response.canceled() {
                    let error = if response.compact_revision() > 0 {
                        StoreError::Compacted {
                            requested: after.map_or(0, |a| a + 1),
                            oldest: response.compact_revision(),
                        }
                    } else {
                        StoreError::Unavailable(format!(
                            "etcd cancelled the watch: {}",
                            response.cancel_reason()
                        ))
                    };
                    let _ = tx.send(Err(error));
                    return;
                }
                for event in response.events() {
                    let Some(kv) = event.kv() else { continue };
                    let event = match store.strip(kv.key()) {
                        Ok(key) => Ok(WatchEvent {
                            kind: match event.event_type() {
                                EventType::Put => EventKind::Put,
                                EventType::Delete => EventKind::Delete,
                            },
                            key,
                            value: kv.value().to_vec(),
                            revision: kv.mod_revision(),
                        }),
                        Err(e) => Err(e),
                    };
                    if tx.send(event).is_err() {
                        return;
                    }
                }
            }
        });
        Ok(Watch::new(rx))
    }
}
