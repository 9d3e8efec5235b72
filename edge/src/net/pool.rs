//! Network namespaces made ahead of creates, each with its veth pair already in place: the
//! host end a stopped, isolated port of the node bridge named `dspXXXXXXXX`, `eth0` inside.
//! Creating a veth on a bridge costs more the more ports the bridge has (the kernel walks
//! its ports and their adjacency lists per new port: ~1 ms at 0, several ms at 1,000 held,
//! more when namespace teardowns hold the rtnl lock at the same time). A background
//! thread keeps a few ready, so a container create takes one (its agent joins the
//! namespace instead of making its own) and only renames the host end, brings it up and
//! gives `eth0` its address and route (through a socket already inside). A pooled namespace is held only by its descriptor here: it
//! and its veth vanish when that is closed (a daemon that dies leaves nothing behind).

use std::fs::File;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use nix::sched::{unshare, CloneFlags};

use super::{link, NetError};

/// Pooled host ends are named this and 8 random hex digits (unique across the host's nodes).
pub(super) const POOL_PREFIX: &str = "dsp";
/// Wait after a failed refill (a full bridge, a missing module) before trying again.
const RETRY: Duration = Duration::from_secs(2);

/// A namespace with a veth pair, not yet anybody's.
#[derive(Debug)]
pub struct PooledNetns {
    pub(super) netns: File,
    pub(super) host_index: u32,
    /// A route socket inside the namespace (`lo` and `eth0` are up already) and `eth0`'s
    /// index: the address and route need no thread joining the namespace at create.
    pub(super) inside: link::Rtnl,
    pub(super) eth0: u32,
}

impl PooledNetns {
    /// The namespace's descriptor (for the agent to join; valid while this lives).
    pub fn netns(&self) -> &File {
        &self.netns
    }
}

#[derive(Debug, Default)]
pub(super) struct VethPool {
    /// How many are kept ready (`--net-veth-pool`): sequential creates use one at a time; a
    /// burst beyond this takes the slower path (a veth made during the create) until the
    /// pool refills.
    size: usize,
    ready: Mutex<Vec<PooledNetns>>,
    wake: Condvar,
    stopped: AtomicBool,
}

impl VethPool {
    /// Starts the thread that keeps `size` namespaces on `bridge` (none if 0).
    pub(super) fn start(bridge: String, size: usize) -> Arc<Self> {
        let pool = Arc::new(Self {
            size,
            ..Self::default()
        });
        if size == 0 {
            return pool;
        }
        let filler = pool.clone();
        let spawned = std::thread::Builder::new()
            .name("dsec-net-pool".into())
            .spawn(move || filler.fill(&bridge));
        if let Err(err) = spawned {
            tracing::warn!(%err, "no veth pool: every create makes its own veth");
        }
        pool
    }

    /// A ready namespace, if there is one. The filler makes the next one after the taker's
    /// setup ([`VethPool::refill`]: both need the rtnl lock, and a new bridge port holds it
    /// for milliseconds on a large bridge), or at once when the pool ran dry.
    pub(super) fn take(&self) -> Option<PooledNetns> {
        let mut ready = self.ready.lock().unwrap_or_else(|e| e.into_inner());
        let taken = ready.pop();
        if ready.is_empty() {
            self.wake.notify_one();
        }
        taken
    }

    /// Lets the filler make up for what was taken.
    pub(super) fn refill(&self) {
        self.wake.notify_one();
    }

    /// Ends the filler and drops the ready namespaces (their veths go with them).
    pub(super) fn stop(&self) {
        self.stopped.store(true, Ordering::Relaxed);
        self.ready.lock().unwrap_or_else(|e| e.into_inner()).clear();
        self.wake.notify_all();
    }

    fn fill(&self, bridge: &str) {
        loop {
            {
                let ready = self.ready.lock().unwrap_or_else(|e| e.into_inner());
                let ready = self
                    .wake
                    .wait_while(ready, |r| {
                        r.len() >= self.size && !self.stopped.load(Ordering::Relaxed)
                    })
                    .unwrap_or_else(|e| e.into_inner());
                drop(ready);
            }
            if self.stopped.load(Ordering::Relaxed) {
                return;
            }
            match prepare(bridge) {
                Ok(pooled) => {
                    let mut ready = self.ready.lock().unwrap_or_else(|e| e.into_inner());
                    if self.stopped.load(Ordering::Relaxed) {
                        return;
                    }
                    ready.push(pooled);
                }
                Err(err) => {
                    tracing::warn!(%err, "cannot prepare a sandbox network namespace; creates make their own until this works");
                    let ready = self.ready.lock().unwrap_or_else(|e| e.into_inner());
                    let _ = self.wake.wait_timeout_while(ready, RETRY, |_| {
                        !self.stopped.load(Ordering::Relaxed)
                    });
                }
            }
        }
    }
}

/// A fresh namespace and a veth pair into it, the host end an isolated, stopped port of
/// `bridge`.
fn prepare(bridge: &str) -> Result<PooledNetns, NetError> {
    // unshare changes only the calling thread's namespace: a thread of its own, which ends.
    let netns = std::thread::spawn(|| -> Result<File, NetError> {
        unshare(CloneFlags::CLONE_NEWNET)
            .map_err(|e| NetError::Setup(format!("new network namespace: {e}")))?;
        File::open("/proc/thread-self/ns/net")
            .map_err(|e| NetError::Setup(format!("open the new network namespace: {e}")))
    })
    .join()
    .unwrap_or_else(|_| Err(NetError::Setup("the namespace thread panicked".into())))?;
    let mut rtnl = link::Rtnl::open()?;
    let bridge_index = link::index_of(bridge)?;
    let mut host_link = String::new();
    for _ in 0..8 {
        host_link = format!("{POOL_PREFIX}{:08x}", super::random_u32());
        if !std::path::Path::new("/sys/class/net")
            .join(&host_link)
            .exists()
        {
            break;
        }
    }
    rtnl.add_veth(&host_link, bridge_index, "eth0", &netns)?;
    let host_index = link::index_of(&host_link)?;
    // Dropped on failure: the namespace and its veth go with the descriptor.
    rtnl.isolate(host_index, false)?;
    let (inside, eth0) = link::open_inside(&netns)?;
    Ok(PooledNetns {
        netns,
        host_index,
        inside,
        eth0,
    })
}
