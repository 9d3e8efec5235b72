//! Subordinate id ranges for container sandboxes: each sandbox's root is host uid/gid
//! `first + slot * RANGE`, and its ids 0..RANGE map onto that slot's range, so no two live
//! sandboxes (of any daemon or `dsec run` on the node) share a host id.
//!
//! A slot is taken by creating the symlink `<slots dir>/<slot>` -> the sandbox directory
//! (O_EXCL semantics: symlink fails if it exists). A slot whose sandbox directory is gone
//! is free again (the owner crashed before releasing it), so nothing leaks across crashes.

use std::path::{Path, PathBuf};

use crate::error::{EdgeError, Result};

/// Ids per sandbox: a whole 16-bit range, so images' users (nobody = 65534) all map.
pub const RANGE: u32 = 65536;
const DEFAULT_FIRST: u32 = 1 << 30;
const DEFAULT_SLOTS: u32 = 32768;
/// Where the node's slots live: one place for every daemon and `dsec run` of the node.
const DEFAULT_DIR: &str = "/run/dsec-id-slots";
/// File in the sandbox directory recording its slot ("SLOT BASE COUNT").
const RECORD: &str = "id-range";

/// The node's pool: `DSEC_ID_POOL=FIRST:SLOTS` (default 1073741824:32768, i.e. host ids
/// 2^30 .. 3 * 2^30) and `DSEC_ID_SLOTS_DIR` override the defaults.
#[derive(Clone, Debug)]
pub struct IdPool {
    first: u32,
    slots: u32,
    dir: PathBuf,
}

/// A slot held by one sandbox.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IdRange {
    pub slot: u32,
    pub base: u32,
    pub count: u32,
}

impl IdPool {
    pub fn from_env() -> Result<Self> {
        let (first, slots) = match std::env::var("DSEC_ID_POOL") {
            Ok(spec) if !spec.is_empty() => parse_pool(&spec)?,
            _ => (DEFAULT_FIRST, DEFAULT_SLOTS),
        };
        let dir = std::env::var_os("DSEC_ID_SLOTS_DIR")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(DEFAULT_DIR));
        Ok(Self { first, slots, dir })
    }

    #[cfg(test)]
    fn new(first: u32, slots: u32, dir: PathBuf) -> Self {
        Self { first, slots, dir }
    }

    /// Takes a free slot for the sandbox in `sandbox_dir` and records it there.
    pub fn allocate(&self, sandbox_dir: &Path) -> Result<IdRange> {
        std::fs::create_dir_all(&self.dir)
            .map_err(|e| EdgeError::io(format!("create {}", self.dir.display()), e))?;
        let start = rand_u32() % self.slots;
        // Each slot is tried twice: a stale one is freed on the first try and taken on the
        // second (unless another allocator is faster).
        for i in 0..self.slots * 2 {
            let slot = (start + i / 2) % self.slots;
            let link = self.dir.join(slot.to_string());
            match std::os::unix::fs::symlink(sandbox_dir, &link) {
                Ok(()) => {
                    let range = IdRange {
                        slot,
                        base: self.first + slot * RANGE,
                        count: RANGE,
                    };
                    let record = format!("{} {} {}\n", range.slot, range.base, range.count);
                    if let Err(e) = std::fs::write(sandbox_dir.join(RECORD), record) {
                        let _ = std::fs::remove_file(&link);
                        return Err(EdgeError::io("record the sandbox's id range", e));
                    }
                    return Ok(range);
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    // Held by a sandbox whose directory is gone: its owner died without
                    // releasing it. Free it; the next pass (or another allocator) takes it.
                    if let Ok(target) = std::fs::read_link(&link) {
                        if !target.exists() {
                            let _ = std::fs::remove_file(&link);
                        }
                    }
                }
                Err(e) => return Err(EdgeError::io(format!("take id slot {}", link.display()), e)),
            }
        }
        Err(EdgeError::InvalidSpec(format!(
            "all {} id ranges of the node's pool ({}) are in use: delete sandboxes or widen \
             DSEC_ID_POOL",
            self.slots,
            self.dir.display()
        )))
    }

    /// Frees the slot recorded in `sandbox_dir` (if it is still this sandbox's).
    pub fn release(&self, sandbox_dir: &Path) {
        let Some(range) = recorded(sandbox_dir) else {
            return;
        };
        let link = self.dir.join(range.slot.to_string());
        if std::fs::read_link(&link).is_ok_and(|t| t == sandbox_dir) {
            let _ = std::fs::remove_file(&link);
        }
    }
}

/// The id range recorded in a sandbox directory.
pub fn recorded(sandbox_dir: &Path) -> Option<IdRange> {
    let text = std::fs::read_to_string(sandbox_dir.join(RECORD)).ok()?;
    let mut parts = text.split_whitespace().map(|p| p.parse::<u32>().ok());
    Some(IdRange {
        slot: parts.next()??,
        base: parts.next()??,
        count: parts.next()??,
    })
}

/// Frees the id slot of a sandbox directory about to be removed (best effort).
pub fn release(sandbox_dir: &Path) {
    if let Ok(pool) = IdPool::from_env() {
        pool.release(sandbox_dir);
    }
}

fn parse_pool(spec: &str) -> Result<(u32, u32)> {
    let bad = |why: &str| {
        EdgeError::InvalidSpec(format!(
            "DSEC_ID_POOL={spec:?}: {why}; expected FIRST:SLOTS, e.g. 1073741824:32768"
        ))
    };
    let (first, slots) = spec.split_once(':').ok_or_else(|| bad("no ':'"))?;
    let first: u32 = first.parse().map_err(|_| bad("FIRST is not a number"))?;
    let slots: u32 = slots.parse().map_err(|_| bad("SLOTS is not a number"))?;
    if first < RANGE {
        return Err(bad(
            "FIRST must be at least 65536 (above every ordinary host user)",
        ));
    }
    if slots == 0 {
        return Err(bad("SLOTS must be at least 1"));
    }
    let end = u64::from(first) + u64::from(slots) * u64::from(RANGE);
    if end > u64::from(u32::MAX) {
        return Err(bad("the pool ends past the largest uid (2^32 - 1)"));
    }
    Ok((first, slots))
}

fn rand_u32() -> u32 {
    let mut buf = [0u8; 4];
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut buf))
        .is_err()
    {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        return nanos ^ std::process::id();
    }
    u32::from_ne_bytes(buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_exclusive_and_freed_when_their_sandbox_is_gone() {
        let tmp = tempfile::tempdir().unwrap();
        let pool = IdPool::new(1 << 20, 2, tmp.path().join("slots"));
        let (a, b, c) = (
            tmp.path().join("a"),
            tmp.path().join("b"),
            tmp.path().join("c"),
        );
        for d in [&a, &b, &c] {
            std::fs::create_dir(d).unwrap();
        }
        let ra = pool.allocate(&a).unwrap();
        let rb = pool.allocate(&b).unwrap();
        assert_ne!(ra.slot, rb.slot);
        assert_eq!(ra.base, (1 << 20) + ra.slot * RANGE);
        assert_eq!(recorded(&a), Some(ra));
        let err = pool.allocate(&c).unwrap_err().to_string();
        assert!(err.contains("in use"), "{err}");
        // a's directory disappears without a release (a crashed owner): its slot is reused.
        std::fs::remove_dir_all(&a).unwrap();
        let rc = pool.allocate(&c).unwrap();
        assert_eq!(rc.slot, ra.slot);
        // An explicit release frees b's slot at once.
        pool.release(&b);
        assert!(!tmp.path().join("slots").join(rb.slot.to_string()).exists());
    }

    #[test]
    fn pool_specs_are_checked() {
        assert_eq!(parse_pool("1073741824:32768").unwrap(), (1 << 30, 32768));
        for bad in ["", "1:2", "x:2", "1073741824:0", "4294901760:2", "100000"] {
            assert!(parse_pool(bad).is_err(), "{bad} accepted");
        }
    }
}
