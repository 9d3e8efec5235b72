//! The layer index: the small, local half of a layer. It lists every entry of the layer
//! (tree, modes, owners, times, xattrs, hard-link groups, symlinks, device nodes, whiteouts,
//! opaque dirs) and, per regular file, the chunks holding its bytes. Entries are sorted by
//! path bytes, so parents precede children and the same layer always serializes to the
//! same bytes; the layer id is the sha256 of those bytes.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::digest::Digest;
use crate::error::{Error, Result};

pub const INDEX_VERSION: u32 = 1;

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ChunkRef {
    pub digest: Digest,
    pub len: u32,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum Kind {
    Dir {
        /// Hides everything lower layers have under this directory.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        opaque: bool,
        /// Created only because a child needed a parent (a tar without the dir's own
        /// entry): it keeps the attributes of a lower layer's directory, as extraction would.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        implicit: bool,
    },
    File {
        size: u64,
        chunks: Vec<ChunkRef>,
    },
    Symlink {
        target: String,
    },
    Char {
        major: u32,
        minor: u32,
    },
    Block {
        major: u32,
        minor: u32,
    },
    Fifo,
    Socket,
    /// Deletes the path from lower layers (never from its own layer).
    Whiteout,
}

impl Kind {
    pub fn is_dir(&self) -> bool {
        matches!(self, Kind::Dir { .. })
    }
}

/// Extended attribute value, serialized as hex so binary values (file capabilities) survive.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct XattrValue(pub Vec<u8>);

impl Serialize for XattrValue {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let mut h = String::with_capacity(self.0.len() * 2);
        for b in &self.0 {
            h.push_str(&format!("{b:02x}"));
        }
        s.serialize_str(&h)
    }
}

impl<'de> Deserialize<'de> for XattrValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        if s.len() % 2 != 0 {
            return Err(serde::de::Error::custom("odd-length hex xattr value"));
        }
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16))
            .collect::<std::result::Result<Vec<u8>, _>>()
            .map(XattrValue)
            .map_err(serde::de::Error::custom)
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Entry {
    /// Relative path, components joined by '/', "" for the layer root.
    pub path: String,
    #[serde(flatten)]
    pub kind: Kind,
    /// Permission bits including setuid/setgid/sticky (mode & 0o7777).
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub mtime: i64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub mtime_nsec: u32,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub xattrs: BTreeMap<String, XattrValue>,
    /// Hard-link group within this layer: entries sharing it are one inode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link: Option<u32>,
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

impl Entry {
    pub fn name(&self) -> &str {
        self.path.rsplit('/').next().unwrap_or("")
    }
    pub fn parent(&self) -> Option<&str> {
        if self.path.is_empty() {
            None
        } else {
            Some(self.path.rsplit_once('/').map(|(p, _)| p).unwrap_or(""))
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct LayerIndex {
    pub version: u32,
    /// Every chunk but a file's last holds exactly this many bytes.
    pub chunk_size: u32,
    pub entries: Vec<Entry>,
}

/// Checks one relative path: no empty, "." or ".." components, no leading '/', no NUL.
pub fn check_rel_path(p: &str) -> Result<()> {
    if p.is_empty() {
        return Ok(());
    }
    if p.len() > 4096 {
        return Err(Error::entry(p, "path longer than PATH_MAX (4096)"));
    }
    for c in p.split('/') {
        if c.is_empty() || c == "." || c == ".." || c.contains('\0') {
            return Err(Error::entry(
                p,
                "path must be relative with no empty, '.' or '..' components",
            ));
        }
        if c.len() > 255 {
            return Err(Error::entry(p, "path component longer than NAME_MAX (255)"));
        }
    }
    Ok(())
}

impl LayerIndex {
    /// Canonical bytes: compact JSON of the sorted entries.
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("layer index serializes")
    }

    pub fn id(&self) -> Digest {
        Digest::of(&self.to_bytes())
    }

    pub fn from_bytes(bytes: &[u8], id: &str) -> Result<LayerIndex> {
        let idx: LayerIndex = serde_json::from_slice(bytes).map_err(|e| Error::BadIndex {
            id: id.to_string(),
            detail: e.to_string(),
        })?;
        idx.validate().map_err(|e| Error::BadIndex {
            id: id.to_string(),
            detail: e.to_string(),
        })?;
        Ok(idx)
    }

    /// Structural checks every index must pass before anything serves it: the store is
    /// shared and indexes are input like any other.
    pub fn validate(&self) -> Result<()> {
        if self.version != INDEX_VERSION {
            return Err(Error::Invalid(format!(
                "index version {} is not supported (this build reads {INDEX_VERSION})",
                self.version
            )));
        }
        if self.chunk_size < 4096 {
            return Err(Error::Invalid(format!(
                "chunk size {} too small",
                self.chunk_size
            )));
        }
        let mut kinds: HashMap<&str, &Kind> = HashMap::new();
        let mut groups: HashMap<u32, &Entry> = HashMap::new();
        let mut prev: Option<&str> = None;
        for e in &self.entries {
            check_rel_path(&e.path)?;
            if let Some(p) = prev {
                if p.as_bytes() >= e.path.as_bytes() {
                    return Err(Error::entry(&e.path, "entries not sorted or duplicated"));
                }
            }
            prev = Some(&e.path);
            if e.path.is_empty() && !e.kind.is_dir() {
                return Err(Error::entry("", "layer root must be a directory"));
            }
            if let Some(parent) = e.parent() {
                match kinds.get(parent) {
                    Some(k) if k.is_dir() => {}
                    Some(_) => {
                        return Err(Error::entry(&e.path, "parent is not a directory"));
                    }
                    None => return Err(Error::entry(&e.path, "parent directory missing")),
                }
            }
            if e.mtime_nsec >= 1_000_000_000 {
                return Err(Error::entry(&e.path, "mtime nanoseconds out of range"));
            }
            if e.mode & !0o7777 != 0 {
                return Err(Error::entry(&e.path, "mode has bits outside 0o7777"));
            }
            if let Kind::File { size, chunks } = &e.kind {
                let mut total = 0u64;
                for (i, c) in chunks.iter().enumerate() {
                    let last = i + 1 == chunks.len();
                    if c.len == 0 || c.len > self.chunk_size || (!last && c.len != self.chunk_size)
                    {
                        return Err(Error::entry(&e.path, "chunk lengths do not tile the file"));
                    }
                    total += c.len as u64;
                }
                if total != *size {
                    return Err(Error::entry(
                        &e.path,
                        "chunk lengths do not add up to the size",
                    ));
                }
            }
            if let Some(g) = e.link {
                if e.kind.is_dir() || e.kind == Kind::Whiteout {
                    return Err(Error::entry(
                        &e.path,
                        "directories and whiteouts cannot be hard-linked",
                    ));
                }
                if let Some(first) = groups.get(&g) {
                    if first.kind != e.kind
                        || first.mode != e.mode
                        || first.uid != e.uid
                        || first.gid != e.gid
                        || first.xattrs != e.xattrs
                    {
                        return Err(Error::entry(&e.path, "hard-link group members disagree"));
                    }
                } else {
                    groups.insert(g, e);
                }
            }
            kinds.insert(&e.path, &e.kind);
        }
        if !self.entries.first().is_some_and(|e| e.path.is_empty()) {
            return Err(Error::entry("", "layer has no root entry"));
        }
        Ok(())
    }

    /// Logical bytes of regular files, each hard-link group counted once.
    pub fn total_file_bytes(&self) -> u64 {
        let mut seen = std::collections::HashSet::new();
        self.entries
            .iter()
            .filter(|e| e.link.is_none_or(|g| seen.insert(g)))
            .map(|e| match &e.kind {
                Kind::File { size, .. } => *size,
                _ => 0,
            })
            .sum()
    }

    /// Bytes of the distinct chunks the files reference (shared chunks once): what fetching
    /// the whole layer into an empty node cache moves.
    pub fn distinct_chunk_bytes(&self) -> u64 {
        let mut seen = std::collections::HashSet::new();
        self.entries
            .iter()
            .filter_map(|e| match &e.kind {
                Kind::File { chunks, .. } => Some(chunks),
                _ => None,
            })
            .flatten()
            .filter(|c| seen.insert(c.digest))
            .map(|c| u64::from(c.len))
            .sum()
    }

    /// The largest regular file as (path, size); among equal sizes the last path in order.
    pub fn largest_file(&self) -> Option<(&str, u64)> {
        self.entries
            .iter()
            .filter_map(|e| match &e.kind {
                Kind::File { size, .. } => Some((*size, e.path.as_str())),
                _ => None,
            })
            .max()
            .map(|(size, path)| (path, size))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(path: &str, size: u64, chunks: &[(&[u8], u32)], link: Option<u32>) -> Entry {
        Entry {
            path: path.into(),
            kind: Kind::File {
                size,
                chunks: chunks
                    .iter()
                    .map(|(data, len)| ChunkRef {
                        digest: Digest::of(data),
                        len: *len,
                    })
                    .collect(),
            },
            mode: 0o644,
            uid: 0,
            gid: 0,
            mtime: 0,
            mtime_nsec: 0,
            xattrs: BTreeMap::new(),
            link,
        }
    }

    #[test]
    fn byte_totals_count_shared_chunks_and_link_groups_once() {
        let idx = LayerIndex {
            version: INDEX_VERSION,
            chunk_size: 8,
            entries: vec![
                file("a", 10, &[(b"x", 8), (b"y", 2)], None),
                // Same content as `a`'s first chunk: stored and fetched once.
                file("b", 8, &[(b"x", 8)], None),
                file("c", 3, &[(b"z", 3)], Some(1)),
                file("d", 3, &[(b"z", 3)], Some(1)),
            ],
        };
        assert_eq!(idx.total_file_bytes(), 10 + 8 + 3);
        assert_eq!(idx.distinct_chunk_bytes(), 8 + 2 + 3);
        assert_eq!(idx.largest_file(), Some(("a", 10)));
        let empty = LayerIndex {
            version: INDEX_VERSION,
            chunk_size: 8,
            entries: vec![],
        };
        assert_eq!(empty.largest_file(), None);
        assert_eq!(empty.distinct_chunk_bytes(), 0);
    }
}
