//! Per-node mount service: one process owns the node cache and serves every sandbox's
//! mounts, so the cap, the LRU and single-flight fetches really are node-wide, and mounts
//! outlive restarts of whoever asked for them (the edge daemon).
//!
//! Protocol: a Unix stream socket, one JSON request per line, one JSON response per line.
//! ```text
//! {"op":"mount","image":"busybox","dir":"/run/sb1","writable":true,"prefetch":true,"record_hot":false}
//!    -> {"ok":true,"root":"/run/sb1/root"}     (read-only: the FUSE view is mounted at dir)
//! {"op":"unmount","dir":"/run/sb1"}            -> {"ok":true}  (saves the hot list if recorded)
//! {"op":"list"}                                -> {"ok":true,"mounts":[{"dir":..,"image":..}]}
//! {"op":"stats"}                               -> {"ok":true,"cache":{...}}
//! ```
//! Errors: {"ok":false,"error":"..."}.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::Deserialize;
use serde_json::{json, Value};
use tracing::{info, warn};

use crate::cache::NodeCache;
use crate::error::{Error, Result};
use crate::fuse::{self, Mount};
use crate::prefetch;
use crate::sandbox::SandboxRoot;
use crate::store::Store;

#[derive(Deserialize)]
#[serde(tag = "op", rename_all = "lowercase")]
enum Request {
    Mount {
        image: String,
        dir: PathBuf,
        #[serde(default)]
        writable: bool,
        #[serde(default)]
        prefetch: bool,
        #[serde(default)]
        record_hot: bool,
    },
    Unmount {
        dir: PathBuf,
    },
    List,
    Stats,
}

enum Mounted {
    Sandbox(SandboxRoot),
    Plain(Mount),
}

struct Entry {
    image: String,
    record_hot: bool,
    mounted: Mounted,
}

impl Entry {
    fn fuse(&self) -> Option<&Mount> {
        match &self.mounted {
            Mounted::Sandbox(s) => s.fuse(),
            Mounted::Plain(m) => Some(m),
        }
    }
}

/// The service state; `handle` serves one request line.
pub struct Service {
    store: Arc<Store>,
    cache: Arc<NodeCache>,
    mounts: Mutex<BTreeMap<PathBuf, Entry>>,
}

impl Service {
    pub fn new(store: Arc<Store>, cache: Arc<NodeCache>) -> Arc<Service> {
        Arc::new(Service {
            store,
            cache,
            mounts: Mutex::new(BTreeMap::new()),
        })
    }

    fn mounts(&self) -> std::sync::MutexGuard<'_, BTreeMap<PathBuf, Entry>> {
        self.mounts.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn handle(&self, line: &str) -> Value {
        let req: Request = match serde_json::from_str(line) {
            Ok(r) => r,
            Err(e) => return json!({"ok": false, "error": format!("bad request: {e}")}),
        };
        match self.dispatch(req) {
            Ok(v) => v,
            Err(e) => json!({"ok": false, "error": e.to_string()}),
        }
    }

    fn dispatch(&self, req: Request) -> Result<Value> {
        match req {
            Request::Mount {
                image,
                dir,
                writable,
                prefetch: want_prefetch,
                record_hot,
            } => {
                if self.mounts().contains_key(&dir) {
                    return Err(Error::Invalid(format!(
                        "{} is already mounted; unmount it first",
                        dir.display()
                    )));
                }
                let img = self.store.get_image(&image)?;
                let (mounted, root) = if writable {
                    let s = SandboxRoot::mount(self.cache.clone(), &img.layers, &dir, record_hot)?;
                    let root = s.root();
                    (Mounted::Sandbox(s), root)
                } else {
                    std::fs::create_dir_all(&dir)
                        .map_err(|e| Error::io("creating mountpoint", &dir, e))?;
                    let tree = Arc::new(self.cache.compose(&img.layers)?);
                    (
                        Mounted::Plain(fuse::mount(tree, self.cache.clone(), &dir, record_hot)?),
                        dir.clone(),
                    )
                };
                let entry = Entry {
                    image: image.clone(),
                    record_hot,
                    mounted,
                };
                if want_prefetch {
                    if let (Some(list), Some(m)) =
                        (prefetch::load(&self.store, &image)?, entry.fuse())
                    {
                        prefetch::start(self.cache.clone(), m.tree.clone(), list, u64::MAX);
                    }
                }
                info!(image, dir = %dir.display(), writable, "mounted");
                self.mounts().insert(dir, entry);
                Ok(json!({"ok": true, "root": root}))
            }
            Request::Unmount { dir } => {
                let entry = self.mounts().remove(&dir).ok_or_else(|| {
                    Error::Invalid(format!("{} is not mounted by this service", dir.display()))
                })?;
                self.unmount(entry)?;
                Ok(json!({"ok": true}))
            }
            Request::List => {
                let list: Vec<Value> = self
                    .mounts()
                    .iter()
                    .map(|(d, e)| json!({"dir": d, "image": e.image, "writable": matches!(e.mounted, Mounted::Sandbox(_))}))
                    .collect();
                Ok(json!({"ok": true, "mounts": list}))
            }
            Request::Stats => Ok(json!({"ok": true, "cache": self.cache.snapshot()})),
        }
    }

    fn unmount(&self, entry: Entry) -> Result<()> {
        let hot = if entry.record_hot {
            entry.fuse().map(prefetch::HotList::from_mount)
        } else {
            None
        };
        match entry.mounted {
            Mounted::Sandbox(s) => s.unmount()?,
            Mounted::Plain(m) => m.unmount(),
        }
        if let Some(h) = hot {
            prefetch::save(&self.store, &entry.image, h)?;
        }
        Ok(())
    }

    /// Unmounts everything (service shutdown).
    pub fn shutdown(&self) {
        let all = std::mem::take(&mut *self.mounts());
        for (dir, e) in all {
            if let Err(err) = self.unmount(e) {
                warn!(dir = %dir.display(), "unmount at shutdown: {err}");
            }
        }
        if let Err(e) = self.cache.persist() {
            warn!("{e}");
        }
    }
}

/// Accepts connections on `socket` until the process ends; each connection gets a thread.
pub fn listen(service: Arc<Service>, socket: &Path) -> Result<std::thread::JoinHandle<()>> {
    let _ = std::fs::remove_file(socket);
    let listener = UnixListener::bind(socket)
        .map_err(|e| Error::io("binding the service socket", socket, e))?;
    // Only root (the edge daemon) may drive mounts.
    let _ = std::fs::set_permissions(socket, std::os::unix::fs::PermissionsExt::from_mode(0o600));
    Ok(std::thread::Builder::new()
        .name("layerfs-serve".into())
        .spawn(move || {
            for conn in listener.incoming().flatten() {
                let svc = service.clone();
                let _ = std::thread::Builder::new()
                    .name("layerfs-conn".into())
                    .spawn(move || serve_conn(&svc, conn));
            }
        })
        .expect("spawning the listener thread"))
}

fn serve_conn(svc: &Service, conn: UnixStream) {
    let Ok(mut out) = conn.try_clone() else {
        return;
    };
    for line in BufReader::new(conn).lines() {
        let Ok(line) = line else { return };
        if line.trim().is_empty() {
            continue;
        }
        let resp = svc.handle(&line);
        if writeln!(out, "{resp}").is_err() {
            return;
        }
    }
}
