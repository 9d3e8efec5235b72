//! Composition of N read-only layers into one merged tree, computed once: whiteouts and
//! opaque directories are resolved here, so lookups are plain map reads. The FUSE view and
//! any future block/pmem image builder serve the same `ImageTree`.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use crate::index::{ChunkRef, Entry, Kind, LayerIndex, XattrValue};

pub const ROOT_INO: u64 = 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileKind {
    Dir,
    File,
    Symlink,
    Char,
    Block,
    Fifo,
    Socket,
}

/// What stat(2) shows for an inode.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attr {
    pub ino: u64,
    pub kind: FileKind,
    pub size: u64,
    /// Permission bits (mode & 0o7777).
    pub perm: u32,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub rdev: u64,
    pub mtime: i64,
    pub mtime_nsec: u32,
}

/// A read-only merged tree of inodes. Inode numbers are stable for a given layer stack.
pub trait ImageTree: Send + Sync {
    fn lookup(&self, parent: u64, name: &str) -> Option<u64>;
    fn attr(&self, ino: u64) -> Option<Attr>;
    /// Sorted (name, ino) pairs of a directory.
    fn children(&self, ino: u64) -> Option<&[(String, u64)]>;
    /// Parent directory (root's parent is root).
    fn parent(&self, ino: u64) -> Option<u64>;
    fn readlink(&self, ino: u64) -> Option<&str>;
    fn xattrs(&self, ino: u64) -> Option<&BTreeMap<String, XattrValue>>;
    /// Chunk size and chunk list of a regular file.
    fn file_chunks(&self, ino: u64) -> Option<(u32, &[ChunkRef])>;
    /// A path of the inode (first name found), for logs and hot lists.
    fn path(&self, ino: u64) -> Option<String>;
    fn inode_count(&self) -> u64;
}

#[derive(Debug)]
struct Inode {
    layer: u32,
    entry: u32,
    nlink: u32,
    parent: u64,
    children: Vec<(String, u64)>,
}

#[derive(Debug)]
pub struct Composition {
    layers: Vec<Arc<LayerIndex>>,
    inodes: Vec<Inode>,
}

struct MNode {
    src: (u32, u32),
    children: BTreeMap<String, MNode>,
}

impl Composition {
    /// Merges layers, bottom first.
    pub fn new(layers: Vec<Arc<LayerIndex>>) -> Composition {
        let mut root = MNode {
            src: (0, 0),
            children: BTreeMap::new(),
        };
        let is_dir = |layers: &[Arc<LayerIndex>], src: (u32, u32)| {
            layers[src.0 as usize].entries[src.1 as usize].kind.is_dir()
        };
        for (li, layer) in layers.iter().enumerate() {
            for (ei, e) in layer.entries.iter().enumerate() {
                let src = (li as u32, ei as u32);
                if e.path.is_empty() {
                    if let Kind::Dir { opaque, implicit } = e.kind {
                        if opaque {
                            root.children.clear();
                        }
                        if !implicit || li == 0 {
                            root.src = src;
                        }
                    }
                    continue;
                }
                // The parent is this layer's own earlier entry (validated), so it exists.
                let mut node = &mut root;
                let (dir, name) = match e.path.rsplit_once('/') {
                    Some((d, n)) => (Some(d), n),
                    None => (None, e.path.as_str()),
                };
                if let Some(dir) = dir {
                    for c in dir.split('/') {
                        node = node
                            .children
                            .get_mut(c)
                            .expect("validated index: parent precedes child");
                    }
                }
                match &e.kind {
                    Kind::Whiteout => {
                        node.children.remove(name);
                    }
                    Kind::Dir { opaque, implicit } => match node.children.get_mut(name) {
                        Some(existing) if is_dir(&layers, existing.src) => {
                            if *opaque {
                                existing.children.clear();
                            }
                            if !*implicit {
                                existing.src = src;
                            }
                        }
                        _ => {
                            node.children.insert(
                                name.to_string(),
                                MNode {
                                    src,
                                    children: BTreeMap::new(),
                                },
                            );
                        }
                    },
                    _ => {
                        node.children.insert(
                            name.to_string(),
                            MNode {
                                src,
                                children: BTreeMap::new(),
                            },
                        );
                    }
                }
            }
        }

        // Flatten depth-first in name order: inode numbers depend only on the layer stack.
        let mut inodes = vec![Inode {
            layer: root.src.0,
            entry: root.src.1,
            nlink: 2,
            parent: ROOT_INO,
            children: Vec::new(),
        }];
        let mut groups: HashMap<(u32, u32), u64> = HashMap::new();
        fn flatten(
            layers: &[Arc<LayerIndex>],
            node: MNode,
            ino: u64,
            inodes: &mut Vec<Inode>,
            groups: &mut HashMap<(u32, u32), u64>,
        ) {
            let mut kids = Vec::with_capacity(node.children.len());
            let mut subdirs = 0;
            for (name, child) in node.children {
                let e = &layers[child.src.0 as usize].entries[child.src.1 as usize];
                if let Some(g) = e.link {
                    if let Some(&existing) = groups.get(&(child.src.0, g)) {
                        inodes[(existing - 1) as usize].nlink += 1;
                        kids.push((name, existing));
                        continue;
                    }
                }
                let cino = inodes.len() as u64 + 1;
                inodes.push(Inode {
                    layer: child.src.0,
                    entry: child.src.1,
                    nlink: if e.kind.is_dir() { 2 } else { 1 },
                    parent: ino,
                    children: Vec::new(),
                });
                if let Some(g) = e.link {
                    groups.insert((child.src.0, g), cino);
                }
                if e.kind.is_dir() {
                    subdirs += 1;
                    flatten(layers, child, cino, inodes, groups);
                }
                kids.push((name, cino));
            }
            let me = &mut inodes[(ino - 1) as usize];
            me.nlink = 2 + subdirs;
            me.children = kids;
        }
        flatten(&layers, root, ROOT_INO, &mut inodes, &mut groups);
        Composition { layers, inodes }
    }

    fn inode(&self, ino: u64) -> Option<&Inode> {
        self.inodes.get(ino.checked_sub(1)? as usize)
    }

    /// The index entry behind an inode.
    pub fn entry(&self, ino: u64) -> Option<&Entry> {
        let i = self.inode(ino)?;
        Some(&self.layers[i.layer as usize].entries[i.entry as usize])
    }

    pub fn layers(&self) -> &[Arc<LayerIndex>] {
        &self.layers
    }

    /// Resolves a relative path without following symlinks.
    pub fn resolve(&self, path: &str) -> Option<u64> {
        let mut ino = ROOT_INO;
        for c in path.split('/').filter(|c| !c.is_empty()) {
            ino = self.lookup(ino, c)?;
        }
        Some(ino)
    }

    /// Chunk size of the layer owning `ino`'s data.
    fn chunk_size(&self, ino: u64) -> u32 {
        self.inode(ino)
            .map(|i| self.layers[i.layer as usize].chunk_size)
            .unwrap_or(crate::store::DEFAULT_CHUNK_SIZE)
    }
}

impl ImageTree for Composition {
    fn lookup(&self, parent: u64, name: &str) -> Option<u64> {
        let kids = &self.inode(parent)?.children;
        kids.binary_search_by(|(n, _)| n.as_str().cmp(name))
            .ok()
            .map(|i| kids[i].1)
    }

    fn attr(&self, ino: u64) -> Option<Attr> {
        let i = self.inode(ino)?;
        let e = self.entry(ino)?;
        let (kind, size, rdev) = match &e.kind {
            Kind::Dir { .. } => (FileKind::Dir, 4096, 0),
            Kind::File { size, .. } => (FileKind::File, *size, 0),
            Kind::Symlink { target } => (FileKind::Symlink, target.len() as u64, 0),
            Kind::Char { major, minor } => (FileKind::Char, 0, libc::makedev(*major, *minor)),
            Kind::Block { major, minor } => (FileKind::Block, 0, libc::makedev(*major, *minor)),
            Kind::Fifo => (FileKind::Fifo, 0, 0),
            Kind::Socket => (FileKind::Socket, 0, 0),
            Kind::Whiteout => return None,
        };
        Some(Attr {
            ino,
            kind,
            size,
            perm: e.mode,
            nlink: i.nlink,
            uid: e.uid,
            gid: e.gid,
            rdev,
            mtime: e.mtime,
            mtime_nsec: e.mtime_nsec,
        })
    }

    fn children(&self, ino: u64) -> Option<&[(String, u64)]> {
        let i = self.inode(ino)?;
        self.entry(ino)?
            .kind
            .is_dir()
            .then_some(i.children.as_slice())
    }

    fn parent(&self, ino: u64) -> Option<u64> {
        Some(self.inode(ino)?.parent)
    }

    fn readlink(&self, ino: u64) -> Option<&str> {
        match &self.entry(ino)?.kind {
            Kind::Symlink { target } => Some(target),
            _ => None,
        }
    }

    fn xattrs(&self, ino: u64) -> Option<&BTreeMap<String, XattrValue>> {
        Some(&self.entry(ino)?.xattrs)
    }

    fn file_chunks(&self, ino: u64) -> Option<(u32, &[ChunkRef])> {
        match &self.entry(ino)?.kind {
            Kind::File { chunks, .. } => Some((self.chunk_size(ino), chunks)),
            _ => None,
        }
    }

    fn path(&self, ino: u64) -> Option<String> {
        let mut parts = Vec::new();
        let mut cur = ino;
        while cur != ROOT_INO {
            let p = self.inode(cur)?.parent;
            let name = self
                .inode(p)?
                .children
                .iter()
                .find(|(_, c)| *c == cur)?
                .0
                .clone();
            parts.push(name);
            cur = p;
        }
        parts.reverse();
        Some(parts.join("/"))
    }

    fn inode_count(&self) -> u64 {
        self.inodes.len() as u64
    }
}
