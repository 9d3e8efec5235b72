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
        let response = self
            .client
            .kv_client()
            .get(self.full(key), None)
            .await
            .map_err(unavailable)?;
        response
            .kvs()
            .first()
            .map(|kv| self.key_value(kv))
            .transpose()
    }

    async fn range(&self, prefix: &str) -> StoreResult<Range> {
        let response = self
            .client
            .kv_client()
            .get(self.full(prefix), Some(GetOptions::new().with_prefix()))
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
        let response = self
            .client
            .kv_client()
            .put(self.full(key), value, options)
            .await
            .map_err(lease_error(lease))?;
        Ok(header_revision(response.header()))
    }

    async fn delete(&self, key: &str) -> StoreResult<bool> {
        let response = self
            .client
            .kv_client()
            .delete(self.full(key), None)
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
        let response = self
            .client
            .kv_client()
            .txn(EtcdTxn::new().when(compares).and_then(ops))
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
        let response = self
            .client
            .lease_client()
            .grant(seconds, None)
            .await
            .map_err(unavailable)?;
        Ok(response.id())
    }

    async fn keep_alive(&self, lease: LeaseId) -> StoreResult<()> {
        // One refresh: the client opens the keep-alive stream, sends one request and checks
        // the answer's TTL; dropping the stream closes it.
        self.client
            .lease_client()
            .keep_alive(lease)
            .await
            .map_err(lease_error(Some(lease)))?;
        Ok(())
    }

    async fn revoke_lease(&self, lease: LeaseId) -> StoreResult<()> {
        self.client
            .lease_client()
            .revoke(lease)
            .await
            .map_err(lease_error(Some(lease)))?;
        Ok(())
    }

    async fn watch(&self, prefix: &str, after: Option<Revision>) -> StoreResult<Watch> {
        let mut options = WatchOptions::new().with_prefix();
        if let Some(after) = after {
            options = options.with_start_revision(after + 1);
        }
        let mut stream = self
            .client
            .watch_client()
            .watch(self.full(prefix), Some(options))
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
