//! The call engine: one pool of warm workers per (image, language, network), kept at its
//! size by background refills; a call takes an idle worker, and a worker that misbehaved
//! is dropped (killed) and replaced instead of going back.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::Semaphore;

use crate::error::{FnCallError, Result};
use crate::request::{CallRequest, CallResult, Language};
use crate::worker::{PoolKey, Worker, WorkerFactory};

/// How the engine sizes its pools.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// The image calls run in unless they name one.
    pub default_image: String,
    /// Workers kept per pool, by language (network pools keep one).
    pub pool_sizes: BTreeMap<Language, usize>,
    /// How long a call waits for a free worker before it is refused.
    pub queue_timeout: Duration,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            default_image: "fncall".into(),
            pool_sizes: BTreeMap::from([
                (Language::Python, 6),
                (Language::Bash, 2),
                (Language::Cpp, 2),
                (Language::Node, 2),
            ]),
            queue_timeout: Duration::from_secs(60),
        }
    }
}

pub struct Engine {
    config: EngineConfig,
    factory: Arc<dyn WorkerFactory>,
    pools: tokio::sync::Mutex<HashMap<PoolKey, Arc<Pool>>>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("config", &self.config)
            .finish()
    }
}

struct Pool {
    key: PoolKey,
    idle: Mutex<VecDeque<Box<dyn Worker>>>,
    /// One permit per idle worker.
    ready: Semaphore,
    factory: Arc<dyn WorkerFactory>,
}

impl Pool {
    fn put_back(&self, worker: Box<dyn Worker>) {
        self.idle.lock().expect("pool lock").push_back(worker);
        self.ready.add_permits(1);
    }

    /// Starts a worker in the background and adds it when ready; retries with a backoff
    /// while the factory fails (the error is logged).
    fn refill(self: &Arc<Self>) {
        let pool = Arc::clone(self);
        tokio::spawn(async move {
            let mut backoff = Duration::from_millis(100);
            loop {
                match pool.factory.spawn(&pool.key).await {
                    Ok(worker) => return pool.put_back(worker),
                    Err(err) => {
                        tracing::warn!(language = pool.key.language.as_str(), %err, "FnCall worker start failed; retrying");
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_secs(10));
                    }
                }
            }
        });
    }
}

impl Engine {
    pub fn new(config: EngineConfig, factory: Arc<dyn WorkerFactory>) -> Self {
        Self {
            config,
            factory,
            pools: tokio::sync::Mutex::new(HashMap::new()),
        }
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Starts the default image's pools now rather than at their first call.
    pub async fn prewarm(&self, languages: &[Language]) -> Result<()> {
        let image = &self.config.default_image;
        for &language in languages {
            let lean = language == Language::Python && self.factory.lean_python(image);
            let mut key = PoolKey {
                image: image.clone(),
                language,
                network: false,
                lean: false,
            };
            self.pool(key.clone()).await?;
            if lean {
                key.lean = true;
                self.pool(key).await?;
            }
        }
        Ok(())
    }

    /// The pool for `key`, created on first use: its first worker starts here, so a missing
    /// image or a broken runtime fails the call at once; the others start in the background.
    async fn pool(&self, key: PoolKey) -> Result<Arc<Pool>> {
        let mut pools = self.pools.lock().await;
        if let Some(pool) = pools.get(&key) {
            return Ok(Arc::clone(pool));
        }
        let first = self.factory.spawn(&key).await?;
        let size = if key.network {
            1
        } else if let Some(size) = self.factory.pool_size(&key) {
            size
        } else {
            self.config
                .pool_sizes
                .get(&key.language)
                .copied()
                .unwrap_or(1)
                .max(1)
        };
        let pool = Arc::new(Pool {
            key: key.clone(),
            idle: Mutex::new(VecDeque::new()),
            ready: Semaphore::new(0),
            factory: Arc::clone(&self.factory),
        });
        pool.put_back(first);
        for _ in 1..size {
            pool.refill();
        }
        pools.insert(key, Arc::clone(&pool));
        Ok(pool)
    }

    /// Runs one call in the default image.
    pub async fn run(&self, call: &CallRequest) -> Result<CallResult> {
        self.run_in(&self.config.default_image.clone(), call).await
    }

    pub async fn run_in(&self, image: &str, call: &CallRequest) -> Result<CallResult> {
        call.validate()?;
        if let Some(rules) = &call.network {
            // Refused where workers have only loopback (never the host's namespace).
            self.factory.check_network(image, rules)?;
        }
        let started = Instant::now();
        let key = PoolKey {
            image: image.to_string(),
            language: call.language,
            network: call.network.is_some(),
            // Networked pools keep one worker per language: always the full zygote.
            lean: call.language == Language::Python
                && call.network.is_none()
                && self.factory.lean_python(image)
                && !call.names_heavy_modules(),
        };
        self.factory.admit(&key, call)?;
        let pool = self.pool(key).await?;
        let permit = tokio::time::timeout(self.config.queue_timeout, pool.ready.acquire())
            .await
            .map_err(|_| FnCallError::Busy(call.language.as_str()))?
            .expect("pool semaphores are never closed");
        permit.forget();
        let worker = pool
            .idle
            .lock()
            .expect("pool lock")
            .pop_front()
            .expect("a permit means an idle worker");
        // Whatever happens to the call from here (even a dropped request), the worker either
        // goes back or is replaced: the guard sees to it.
        let mut checkout = Checkout {
            pool: Arc::clone(&pool),
            worker: Some(worker),
        };
        let outcome = checkout
            .worker
            .as_mut()
            .expect("checked out")
            .call(call)
            .await?;
        let mut result = outcome.result;
        result.total = started.elapsed();
        if outcome.reusable {
            // The caller has its answer; the worker goes back once the call's remains are
            // gone (namespace teardown waits on the kernel, not on the caller).
            let mut worker = checkout.worker.take().expect("checked out");
            let pool = Arc::clone(&pool);
            tokio::spawn(async move {
                if worker.settle().await {
                    pool.put_back(worker);
                } else {
                    drop(worker);
                    pool.refill();
                }
            });
        }
        Ok(result)
    }

    /// Runs calls concurrently (bounded by the pools), results in the order given.
    pub async fn run_batch(&self, calls: &[CallRequest]) -> Vec<Result<CallResult>> {
        let futures = calls.iter().map(|call| self.run(call));
        join_all(futures).await
    }
}

/// A worker taken from its pool for one call. Unless the call hands it back (takes it out),
/// it is dropped (killed) and a replacement started: after an error, a misbehaving call,
/// or a caller that went away mid-call.
struct Checkout {
    pool: Arc<Pool>,
    worker: Option<Box<dyn Worker>>,
}

impl Drop for Checkout {
    fn drop(&mut self) {
        if let Some(worker) = self.worker.take() {
            drop(worker);
            self.pool.refill();
        }
    }
}

pub(crate) async fn join_all<F: std::future::Future>(
    futures: impl IntoIterator<Item = F>,
) -> Vec<F::Output> {
    let mut set = Vec::new();
    for f in futures {
        set.push(Box::pin(f));
    }
    let mut out = Vec::with_capacity(set.len());
    // Polled together: each future makes progress while the others wait on workers.
    let mut pending: Vec<Option<F::Output>> = (0..set.len()).map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut all_done = true;
        for (i, f) in set.iter_mut().enumerate() {
            if pending[i].is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => pending[i] = Some(v),
                    std::task::Poll::Pending => all_done = false,
                }
            }
        }
        if all_done {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await;
    out.extend(pending.into_iter().map(|v| v.expect("all done")));
    out
}
