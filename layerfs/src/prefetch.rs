//! Prefetch hot lists: the (file, offset) order in which a sandbox's first run touched the
//! image, stored with the image; later mounts fetch it in the background, deduplicated
//! and bounded, so the chunks a command needs are usually local before it asks.

use std::collections::HashSet;
use std::sync::Arc;
use std::thread::JoinHandle;

use serde::{Deserialize, Serialize};
use tracing::debug;

use crate::cache::NodeCache;
use crate::compose::{ImageTree, ROOT_INO};
use crate::digest::Digest;
use crate::error::{Error, Result};
use crate::fuse::Mount;
use crate::index::ChunkRef;
use crate::store::Store;

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct HotList {
    pub version: u32,
    /// (path, byte offset of the chunk) in first-touch order.
    pub entries: Vec<(String, u64)>,
}

const MAX_ENTRIES: usize = 200_000;

impl HotList {
    /// The access order recorded by a mount made with `record_hot`.
    pub fn from_mount(m: &Mount) -> HotList {
        let entries = m
            .hot_list()
            .into_iter()
            .filter_map(|(path, chunk)| {
                let ino = resolve(m.tree.as_ref(), &path)?;
                let (cs, _) = m.tree.file_chunks(ino)?;
                Some((path, chunk as u64 * cs as u64))
            })
            .collect();
        HotList {
            version: 1,
            entries,
        }
    }

    /// Union with an older list: this run's order first, then what only the old one had.
    pub fn merge(mut self, older: &HotList) -> HotList {
        let mut seen: HashSet<(String, u64)> = self.entries.iter().cloned().collect();
        for e in &older.entries {
            if self.entries.len() >= MAX_ENTRIES {
                break;
            }
            if seen.insert(e.clone()) {
                self.entries.push(e.clone());
            }
        }
        self
    }
}

fn resolve(tree: &dyn ImageTree, path: &str) -> Option<u64> {
    let mut ino = ROOT_INO;
    for c in path.split('/').filter(|c| !c.is_empty()) {
        ino = tree.lookup(ino, c)?;
    }
    Some(ino)
}

/// Stores `list` (merged with the image's current one) and points the image at it.
pub fn save(store: &Store, image: &str, list: HotList) -> Result<Digest> {
    let mut rec = store.get_image(image)?;
    let list = match load(store, image)? {
        Some(old) => list.merge(&old),
        None => list,
    };
    let bytes = serde_json::to_vec(&list).expect("hot list serializes");
    let d = store.put_blob(&bytes)?;
    rec.hot_list = Some(d);
    store.put_image(&rec)?;
    Ok(d)
}

pub fn load(store: &Store, image: &str) -> Result<Option<HotList>> {
    let rec = store.get_image(image)?;
    let Some(d) = rec.hot_list else {
        return Ok(None);
    };
    let bytes = store.get_blob(&d)?;
    serde_json::from_slice(&bytes).map(Some).map_err(|e| {
        Error::Invalid(format!(
            "hot list {d} of {image} is unreadable: {e}; re-record it"
        ))
    })
}

/// The chunks a hot list names in `tree`, in order, without duplicates.
pub fn chunks_of(tree: &dyn ImageTree, list: &HotList) -> Vec<ChunkRef> {
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for (path, off) in &list.entries {
        let Some(ino) = resolve(tree, path) else {
            continue;
        };
        let Some((cs, chunks)) = tree.file_chunks(ino) else {
            continue;
        };
        if let Some(c) = chunks.get((off / cs as u64) as usize) {
            if seen.insert(c.digest) {
                out.push(c.clone());
            }
        }
    }
    out
}

/// Starts fetching a hot list in the background; the handle yields the bytes fetched.
/// Bounded by `max_bytes` and by the cache's free room.
pub fn start(
    cache: Arc<NodeCache>,
    tree: Arc<dyn ImageTree>,
    list: HotList,
    max_bytes: u64,
) -> JoinHandle<u64> {
    std::thread::Builder::new()
        .name("layerfs-prefetch".into())
        .spawn(move || {
            let chunks = chunks_of(tree.as_ref(), &list);
            let n = cache.prefetch(&chunks, max_bytes);
            debug!(chunks = chunks.len(), bytes = n, "prefetch done");
            n
        })
        .expect("spawning the prefetch thread")
}
