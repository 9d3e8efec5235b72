//! The balloon's snapshot state: target, what the guest gave back, its last statistics, the
//! statistics buffer the device holds and the counters.

use serde::{Deserialize, Serialize};

use super::{Balloon, Counters, MIB_PAGES, QUEUE_SIZE};
use crate::config::BalloonConfig;
use crate::persist::Persist;
use crate::sync::lock;

/// Why a balloon state cannot be restored (the snapshot is damaged or not this VM's).
#[derive(Debug, thiserror::Error)]
pub enum BalloonRestoreError {
    #[error("balloon target of {pages} pages is more than the VM's {mem_mib} MiB; the snapshot is damaged")]
    Target { pages: u32, mem_mib: u64 },
    #[error("balloon statistics buffer index {0} is outside its queue; the snapshot is damaged")]
    StatsHead(u16),
}

/// The balloon's own state in a snapshot (the transport and queues are saved by the slot).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BalloonState {
    pub num_pages: u32,
    pub actual: u32,
    /// The guest's last statistics as (tag, value).
    pub stats: Vec<(u16, u64)>,
    /// The statistics buffer the device was holding.
    pub stats_head: Option<u16>,
    pub counters: Counters,
}

impl Persist for Balloon {
    type State = BalloonState;
    /// The configured balloon and the VM's memory size.
    type Context = (BalloonConfig, u64);
    type Error = BalloonRestoreError;

    fn save(&self) -> BalloonState {
        self.control.state()
    }

    fn restore(
        (config, mem_mib): Self::Context,
        s: &BalloonState,
    ) -> Result<Self, BalloonRestoreError> {
        if u64::from(s.num_pages) > mem_mib * MIB_PAGES {
            return Err(BalloonRestoreError::Target {
                pages: s.num_pages,
                mem_mib,
            });
        }
        if s.stats_head.is_some_and(|h| h >= QUEUE_SIZE) {
            return Err(BalloonRestoreError::StatsHead(
                s.stats_head.unwrap_or_default(),
            ));
        }
        let b = Balloon::new(config, mem_mib);
        {
            let mut inner = lock(&b.control.inner);
            inner.num_pages = s.num_pages;
            inner.actual = s.actual;
            inner.stats = s.stats.iter().copied().collect();
            inner.stats_head = s.stats_head;
            inner.counters = s.counters;
        }
        Ok(b)
    }
}
