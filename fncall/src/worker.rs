//! The seam between the call engine and what runs calls: a pool holds `Worker`s made by one
//! `WorkerFactory`. Container workers (a zygote in namespaces, `container.rs`) are one kind;
//! a microVM restored from a warm snapshot per call would be another (see README).

use async_trait::async_trait;

use crate::error::{FnCallError, Result};
use crate::network::NetworkRules;
use crate::request::{CallRequest, CallResult, Language};

/// What a pool's workers have in common.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PoolKey {
    pub image: String,
    pub language: Language,
    /// Workers on the node's sandbox network (each call's policy applied around it); the
    /// others have loopback only.
    pub network: bool,
    /// A python zygote without the heavy preloads (numpy), for code that does not name them:
    /// its forks copy far fewer page tables (see `CallRequest::names_heavy_modules`).
    pub lean: bool,
}

/// What a worker hands back: the result, and whether it may serve another call.
#[derive(Debug)]
pub struct Outcome {
    pub result: CallResult,
    /// False after a timeout, an OOM kill or a crash: the pool replaces the worker.
    pub reusable: bool,
}

/// Runs one call at a time, each isolated from the ones before.
#[async_trait]
pub trait Worker: Send {
    /// Runs the call; returns as soon as its result is known.
    async fn call(&mut self, call: &CallRequest) -> Result<Outcome>;

    /// Waits until the last call's remains are gone (its namespaces torn down) and the
    /// worker can take another; false: it cannot, replace it. Runs off the caller's path.
    async fn settle(&mut self) -> bool {
        true
    }
}

/// Makes workers for a pool, in the background of calls.
#[async_trait]
pub trait WorkerFactory: Send + Sync {
    /// Workers kept in `key`'s pool when this factory sizes its pools itself (a VM worker is
    /// a prewarmed VMM); None: the engine's size for the language.
    fn pool_size(&self, _key: &PoolKey) -> Option<usize> {
        None
    }

    /// Refuses a call this pool's workers cannot honour, before it takes a worker.
    fn admit(&self, _key: &PoolKey, _call: &CallRequest) -> Result<()> {
        Ok(())
    }

    async fn spawn(&self, key: &PoolKey) -> Result<Box<dyn Worker>>;

    /// Whether `image`'s python calls that name no heavy module may go to a lean zygote.
    fn lean_python(&self, _image: &str) -> bool {
        false
    }

    /// Checks a networked call's rules (for a worker of `image`) before it waits for a
    /// worker; factories whose workers have no network refuse every networked call.
    fn check_network(&self, _image: &str, _rules: &NetworkRules) -> Result<()> {
        Err(FnCallError::NoCallNetwork)
    }
}
