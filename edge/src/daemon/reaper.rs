//! TTL, idle and death reaping: a sandbox past its TTL or idle timeout is deleted; one whose
//! agent or VMM died leaves a tombstone (reason, log tails) for Get and Logs.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::node::Node;
use super::record::{now_ms, tail_bytes, Tombstone, LOG_SOURCES, TOMBSTONE_LOG_BYTES};

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

impl Node {
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
            let reason = if !r.is_alive() || image_gone {
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
}
