//! Mounting a layer-store image in this process: for one `dsec run` ([`LocalMount`]) or as
//! the body of an image server process ([`serve_image`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use dsec_layerfs::cache::NodeCache;
use dsec_layerfs::store::{Store, StoreConfig};

use super::{ImageError, LayerImage};

/// Node cache cap of an image server (the same default as `dsec-layerfs mount`).
const CACHE_CAP_BYTES: u64 = 10 << 30;

impl LayerImage {
    /// Mounts the image read-only at `mountpoint` in this process (the mount lives as long as
    /// the returned value; dropping it unmounts) and starts fetching the image's hot list
    /// (`dsec-layerfs mount --record-hot`), if it has one, in the background.
    pub fn mount(&self, mountpoint: &Path) -> Result<dsec_layerfs::fuse::Mount, ImageError> {
        let store_err = |source| ImageError::Store {
            store: self.store.clone(),
            source: Box::new(source),
        };
        let store = match Store::open_existing(&self.store, StoreConfig::default()) {
            Ok(store) => store,
            // A shared store that cannot be reached: what the node cache holds is served, a
            // miss fails (EIO) until the store is back.
            Err(e @ dsec_layerfs::Error::NoStore { .. }) if unreachable(&self.store) => {
                tracing::warn!(image = %self.name, "layer store unreadable ({e}): serving from the node cache");
                Store::open_unreachable(&self.store, StoreConfig::default()).map_err(store_err)?
            }
            Err(e) => return Err(store_err(e)),
        };
        let store = Arc::new(store);
        let cache = Arc::new(
            NodeCache::open(&self.cache, store.clone(), CACHE_CAP_BYTES).map_err(|e| {
                ImageError::Mount {
                    name: self.name.clone(),
                    detail: format!("node cache {}: {e}", self.cache.display()),
                }
            })?,
        );
        let tree = Arc::new(cache.compose(&self.digests()?).map_err(store_err)?);
        let mount =
            dsec_layerfs::fuse::mount(tree, cache.clone(), mountpoint, false).map_err(|e| {
                ImageError::Mount {
                    name: self.name.clone(),
                    detail: e.to_string(),
                }
            })?;
        // Best effort: a missing or unreadable hot list only costs speed.
        match dsec_layerfs::prefetch::load(&store, &self.name) {
            Ok(Some(list)) => {
                dsec_layerfs::prefetch::start(cache, mount.tree.clone(), list, CACHE_CAP_BYTES / 2);
            }
            Ok(None) => {}
            Err(e) => tracing::warn!(image = %self.name, "no prefetch: {e}"),
        }
        Ok(mount)
    }
}

/// There is something at `path` that cannot be looked at (ENOTCONN, EIO, a timeout): not a
/// missing or mistyped store.
fn unreachable(path: &Path) -> bool {
    matches!(std::fs::symlink_metadata(path), Err(e) if e.kind() != std::io::ErrorKind::NotFound)
}

/// A layer-store image mounted by this process for a one-shot sandbox (`dsec run`);
/// dropping it unmounts and removes the mount point.
pub struct LocalMount {
    mount: Option<dsec_layerfs::fuse::Mount>,
    dir: PathBuf,
}

impl LocalMount {
    /// Mounts `image` at `dir/root` (`dir` is created and must be new).
    pub fn new(image: &LayerImage, dir: PathBuf) -> Result<Self, ImageError> {
        let root = dir.join("root");
        if is_layerfs_mount(&root) {
            // Left by a killed run whose pid this process now has: its server is gone.
            let _ = nix::mount::umount2(&root, nix::mount::MntFlags::MNT_DETACH);
        }
        std::fs::create_dir_all(&root).map_err(|e| ImageError::Mount {
            name: image.name.clone(),
            detail: format!("cannot create the mount point {}: {e}", root.display()),
        })?;
        match image.mount(&root) {
            Ok(mount) => Ok(Self {
                mount: Some(mount),
                dir,
            }),
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                Err(e)
            }
        }
    }

    /// The image's tree: the container's lowerdir.
    pub fn root(&self) -> PathBuf {
        self.dir.join("root")
    }
}

impl Drop for LocalMount {
    fn drop(&mut self) {
        if let Some(m) = self.mount.take() {
            m.unmount();
        }
        // Never remove_dir_all: if the unmount failed it would walk the image.
        let _ = std::fs::remove_dir(self.root());
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// Blocks SIGINT and SIGTERM in the calling thread (and the threads it starts later), so
/// `wait_for_stop` can take them synchronously.
fn block_stop_signals() -> libc::sigset_t {
    // SAFETY: `set` is a plain sigset_t initialised by sigemptyset before any other use;
    // pthread_sigmask only reads it.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

fn wait_for_stop(set: &libc::sigset_t) {
    let mut sig = 0;
    // SAFETY: `set` is a valid, initialised sigset_t and `sig` a valid out pointer.
    while unsafe { libc::sigwait(set, &mut sig) } != 0 {}
}

/// File an image server reads its image from (in its directory).
pub const SERVER_IMAGE_FILE: &str = "image.json";
/// File an image server creates once its mount is up.
pub const SERVER_READY_FILE: &str = "ready";

/// Body of an image server process (`dsec-edge --serve-image DIR`): mounts the image in
/// `DIR/image.json` at `DIR/root`, creates `DIR/ready`, serves until SIGTERM/SIGINT, then
/// unmounts. A process of its own per image, so the mount survives the daemon.
pub fn serve_image(dir: &Path) -> Result<(), ImageError> {
    let spec_path = dir.join(SERVER_IMAGE_FILE);
    let image: LayerImage = std::fs::read(&spec_path)
        .map_err(|e| e.to_string())
        .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()))
        .map_err(|detail| ImageError::Mount {
            name: String::new(),
            detail: format!("{}: {detail}", spec_path.display()),
        })?;
    // Before the FUSE threads start, so they inherit the mask and the signal comes here.
    let set = block_stop_signals();
    let mount = image.mount(&dir.join("root"))?;
    std::fs::write(dir.join(SERVER_READY_FILE), b"").map_err(|e| ImageError::Mount {
        name: image.name.clone(),
        detail: format!(
            "cannot write {}: {e}",
            dir.join(SERVER_READY_FILE).display()
        ),
    })?;
    tracing::info!(image = %image.name, root = %dir.join("root").display(), "image served");
    wait_for_stop(&set);
    let _ = std::fs::remove_file(dir.join(SERVER_READY_FILE));
    mount.unmount();
    tracing::info!(image = %image.name, "image unmounted");
    Ok(())
}

/// Whether `path` is a layerfs FUSE mount point in this mount namespace.
pub fn is_layerfs_mount(path: &Path) -> bool {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let want = path.to_string_lossy();
    info.lines().any(|line| {
        let fields: Vec<&str> = line.split(' ').collect();
        let Some(sep) = fields.iter().position(|f| *f == "-") else {
            return false;
        };
        // fuser mounts show as fstype `fuse` or `fuse.layerfs`, source `layerfs`.
        fields
            .get(4)
            .is_some_and(|mp| unescape_mountinfo(mp) == want)
            && fields
                .get(sep + 1)
                .is_some_and(|t| *t == "fuse" || *t == "fuse.layerfs")
            && fields.get(sep + 2) == Some(&"layerfs")
    })
}

/// mountinfo escapes space, tab, newline and backslash as `\NNN` (octal).
fn unescape_mountinfo(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 4 <= b.len() {
            let digits = std::str::from_utf8(&b[i + 1..i + 4]).ok();
            if let Some(v) = digits.and_then(|d| u8::from_str_radix(d, 8).ok()) {
                out.push(v);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_escapes() {
        assert_eq!(unescape_mountinfo("/a\\040b"), "/a b");
        assert_eq!(unescape_mountinfo("/plain"), "/plain");
    }
}
