//! Images a container sandbox runs from: directory images
//! (`$DSEC_HOME/images/NAME/rootfs`) and images of the node's layer store (layerfs), which
//! are served read-only through FUSE and used as the overlay's lowerdir.
//!
//! Lookup order: a directory image wins over a layer-store image of the same name. The
//! directory images are what this node has installed (the default `busybox`, setup.sh's
//! images); the layer store may be shared by many nodes, and an import there must not
//! silently change what an installed name runs. Import under another name to use both.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use dsec_layerfs::cache::NodeCache;
use dsec_layerfs::manage;
use dsec_layerfs::store::{Store, StoreConfig};
use dsec_layerfs::Digest;

/// Node cache cap of an image server (the same default as `dsec-layerfs mount`).
const CACHE_CAP_BYTES: u64 = 10 << 30;

/// Why an image cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("image name {name:?} is invalid: use letters, digits, '.', '_' and '-' (plus ':', '@' and '/' for layer-store images), not starting with '.'")]
    InvalidName { name: String },
    #[error("image {name:?} not found for the {backend} backend; available: {available}; {hint}, or import one with `dsec image import REF --name NAME`")]
    NotFound {
        name: String,
        backend: &'static str,
        /// Both kinds, with where they were looked up.
        available: String,
        /// How to install a directory image of that name.
        hint: &'static str,
    },
    #[error("cannot read the layer store {store}: {source}; check DSEC_LAYERFS_STORE / $DSEC_HOME/layerfs/store")]
    Store {
        store: PathBuf,
        #[source]
        source: Box<dsec_layerfs::Error>,
    },
    #[error("cannot mount layer-store image {name:?}: {detail}")]
    Mount { name: String, detail: String },
}

/// A resolved container image.
#[derive(Clone, Debug)]
pub enum ImageSource {
    /// A plain directory tree, used as the lowerdir as is.
    Dir(PathBuf),
    /// An image of the layer store: mounted through FUSE first.
    Layers(LayerImage),
}

/// A layer-store image pinned to its layers at resolution time (a later re-import under the
/// same name does not change a running sandbox's root).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LayerImage {
    pub name: String,
    /// Layer ids, bottom first.
    pub layers: Vec<String>,
    pub store: PathBuf,
    pub cache: PathBuf,
}

impl LayerImage {
    /// Names the layer stack: sandboxes of images with the same layers share one mount.
    pub fn key(&self) -> String {
        let joined = self.layers.join("\n");
        Digest::of(joined.as_bytes()).hex()[..16].to_string()
    }

    fn digests(&self) -> Result<Vec<Digest>, ImageError> {
        self.layers
            .iter()
            .map(|l| {
                Digest::parse(l).map_err(|source| ImageError::Store {
                    store: self.store.clone(),
                    source: Box::new(source),
                })
            })
            .collect()
    }

    /// Mounts the image read-only at `mountpoint` in this process (the mount lives as long as
    /// the returned value; dropping it unmounts) and starts fetching the image's hot list
    /// (`dsec-layerfs mount --record-hot`), if it has one, in the background.
    pub fn mount(&self, mountpoint: &Path) -> Result<dsec_layerfs::fuse::Mount, ImageError> {
        let store_err = |source| ImageError::Store {
            store: self.store.clone(),
            source: Box::new(source),
        };
        let store =
            Arc::new(Store::open_existing(&self.store, StoreConfig::default()).map_err(store_err)?);
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

/// Where images are looked up.
#[derive(Clone, Debug)]
pub struct Catalog {
    /// `$DSEC_HOME`: directory images are `images/NAME/rootfs`.
    pub home: PathBuf,
    pub store: PathBuf,
    pub cache: PathBuf,
}

fn dir_name_ok(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

impl Catalog {
    /// `home`'s images; the layer store and cache from `DSEC_LAYERFS_STORE` /
    /// `DSEC_LAYERFS_CACHE`, else `home/layerfs/{store,cache}`.
    pub fn new(home: &Path) -> Self {
        let from_env = |var: &str, leaf: &str| {
            std::env::var_os(var)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
                .unwrap_or_else(|| home.join("layerfs").join(leaf))
        };
        Self {
            home: home.to_path_buf(),
            store: from_env(manage::STORE_ENV, "store"),
            cache: from_env(manage::CACHE_ENV, "cache"),
        }
    }

    /// The directory image's root, if `name` is one.
    pub fn dir_rootfs(&self, name: &str) -> Option<PathBuf> {
        let rootfs = self.home.join("images").join(name).join("rootfs");
        (dir_name_ok(name) && rootfs.join("bin").is_dir()).then_some(rootfs)
    }

    /// Directory images with a container root (`rootfs/`) or, for `"microvm"`, with an
    /// `initramfs.cpio`.
    pub fn dir_images(&self, backend: &str) -> Vec<String> {
        let images = self.home.join("images");
        let mut names: Vec<String> = std::fs::read_dir(&images)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| match backend {
                "microvm" => images.join(n).join("initramfs.cpio").is_file(),
                _ => self.dir_rootfs(n).is_some(),
            })
            .collect();
        names.sort();
        names
    }

    fn open_store(&self) -> Result<Option<Store>, ImageError> {
        if !self.store.exists() {
            return Ok(None);
        }
        Store::open_existing(&self.store, StoreConfig::default())
            .map(Some)
            .map_err(|source| ImageError::Store {
                store: self.store.clone(),
                source: Box::new(source),
            })
    }

    /// Images in the layer store (none when there is no store yet).
    pub fn layer_images(&self) -> Result<Vec<String>, ImageError> {
        let Some(store) = self.open_store()? else {
            return Ok(Vec::new());
        };
        let images = store.list_images().map_err(|source| ImageError::Store {
            store: self.store.clone(),
            source: Box::new(source),
        })?;
        Ok(images.into_iter().map(|i| i.name).collect())
    }

    /// The layer-store image `name`, if there is one.
    pub fn layer_image(&self, name: &str) -> Result<Option<LayerImage>, ImageError> {
        if Store::check_image_name(name).is_err() {
            return Ok(None);
        }
        let Some(store) = self.open_store()? else {
            return Ok(None);
        };
        match store.get_image(name) {
            Ok(rec) => Ok(Some(LayerImage {
                name: name.to_string(),
                layers: rec.layers.iter().map(|d| d.to_string()).collect(),
                store: self.store.clone(),
                cache: self.cache.clone(),
            })),
            Err(dsec_layerfs::Error::NoSuchImage(_)) => Ok(None),
            Err(source) => Err(ImageError::Store {
                store: self.store.clone(),
                source: Box::new(source),
            }),
        }
    }

    /// Checks a name before any lookup.
    pub fn check_name(name: &str) -> Result<(), ImageError> {
        if dir_name_ok(name) || Store::check_image_name(name).is_ok() {
            Ok(())
        } else {
            Err(ImageError::InvalidName {
                name: name.to_string(),
            })
        }
    }

    /// Resolves a container image: the directory image, else the layer-store image, else
    /// NOT_FOUND listing both kinds.
    pub fn resolve(&self, name: &str) -> Result<ImageSource, ImageError> {
        Self::check_name(name)?;
        if let Some(rootfs) = self.dir_rootfs(name) {
            return Ok(ImageSource::Dir(rootfs));
        }
        if let Some(image) = self.layer_image(name)? {
            return Ok(ImageSource::Layers(image));
        }
        Err(self.not_found(name, "container"))
    }

    /// The NOT_FOUND error for `name`, listing what the node has for `backend` (layer-store
    /// images run on containers only).
    pub fn not_found(&self, name: &str, backend: &'static str) -> ImageError {
        let layers = match self.layer_images() {
            Ok(l) => format!("[{}]", l.join(", ")),
            Err(e) => format!("unreadable: {e}"),
        };
        let only = if backend == "microvm" {
            " (containers only)"
        } else {
            ""
        };
        ImageError::NotFound {
            name: name.to_string(),
            backend,
            hint: crate::paths::ImagePaths::install_hint(name),
            available: format!(
                "directory images under {}/images: [{}]; layer-store images in {}{only}: {layers}",
                self.home.display(),
                self.dir_images(backend).join(", "),
                self.store.display()
            ),
        }
    }
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
    fn names() {
        assert!(Catalog::check_name("busybox").is_ok());
        assert!(Catalog::check_name("127.0.0.1:5000/lib/busybox:1").is_ok());
        for bad in ["", ".hidden", "a b", "x\0", "a/../b;"] {
            assert!(Catalog::check_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn mountinfo_escapes() {
        assert_eq!(unescape_mountinfo("/a\\040b"), "/a b");
        assert_eq!(unescape_mountinfo("/plain"), "/plain");
    }
}
