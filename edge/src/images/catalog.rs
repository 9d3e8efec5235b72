//! Image lookup: which directory image or layer-store image a name means.

use std::path::{Path, PathBuf};

use dsec_layerfs::manage;
use dsec_layerfs::store::{Store, StoreConfig};
use dsec_layerfs::Digest;

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
    #[error("cannot read the layer store {store} for image {name:?} and this node holds no copy of it: {source}; check the shared store's mount (DSEC_LAYERFS_STORE / $DSEC_HOME/layerfs/store) or create on a node that ran the image before")]
    StoreUnreachable {
        store: PathBuf,
        name: String,
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

    pub(super) fn digests(&self) -> Result<Vec<Digest>, ImageError> {
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
}

/// A node's copy of a layer-store image record.
#[derive(serde::Serialize, serde::Deserialize)]
struct LocalCopy {
    name: String,
    layers: Vec<String>,
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
        // Only a store that is not there means "none yet"; one that cannot be looked at (a
        // network filesystem whose server is down) is an error.
        if matches!(std::fs::symlink_metadata(&self.store), Err(e) if e.kind() == std::io::ErrorKind::NotFound)
        {
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

    /// The layer-store image `name`, if there is one. Each one found is also kept in the
    /// node cache (`images/<digest of the name>.json`), so that while a shared store cannot
    /// be read the node still runs the images it ran before from what its cache holds.
    pub fn layer_image(&self, name: &str) -> Result<Option<LayerImage>, ImageError> {
        if Store::check_image_name(name).is_err() {
            return Ok(None);
        }
        let found = self.open_store().and_then(|store| {
            let Some(store) = store else {
                return Ok(None);
            };
            match store.get_image(name) {
                Ok(rec) => Ok(Some(rec.layers.iter().map(|d| d.to_string()).collect())),
                Err(dsec_layerfs::Error::NoSuchImage(_)) => Ok(None),
                Err(source) => Err(ImageError::Store {
                    store: self.store.clone(),
                    source: Box::new(source),
                }),
            }
        });
        let image = |layers| LayerImage {
            name: name.to_string(),
            layers,
            store: self.store.clone(),
            cache: self.cache.clone(),
        };
        match found {
            Ok(Some(layers)) => {
                let image = image(layers);
                self.keep_local_copy(&image);
                Ok(Some(image))
            }
            Ok(None) => Ok(None),
            Err(ImageError::Store { store, source }) => match self.local_copy(name) {
                Some(layers) => {
                    tracing::warn!(image = name, store = %store.display(), error = %source,
                        "layer store unreadable: running the image from this node's cache");
                    Ok(Some(image(layers)))
                }
                None => Err(ImageError::StoreUnreachable {
                    store,
                    name: name.to_string(),
                    source,
                }),
            },
            Err(e) => Err(e),
        }
    }

    fn local_copy_path(&self, name: &str) -> PathBuf {
        self.cache
            .join("images")
            .join(format!("{}.json", Digest::of(name.as_bytes()).hex()))
    }

    /// Best effort: without the copy the node only loses the offline fallback.
    fn keep_local_copy(&self, image: &LayerImage) {
        let path = self.local_copy_path(&image.name);
        if std::fs::read(&path).is_ok_and(|b| {
            serde_json::from_slice::<LocalCopy>(&b).is_ok_and(|c| c.layers == image.layers)
        }) {
            return;
        }
        let copy = LocalCopy {
            name: image.name.clone(),
            layers: image.layers.clone(),
        };
        let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
        let written = std::fs::create_dir_all(path.parent().unwrap_or(&self.cache))
            .and_then(|()| std::fs::write(&tmp, serde_json::to_vec(&copy).unwrap_or_default()))
            .and_then(|()| std::fs::rename(&tmp, &path));
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            tracing::warn!(image = %image.name, "could not keep a local copy of the image record: {e}");
        }
    }

    /// The layers of the copy kept for `name`, if it is whole and names valid layers.
    fn local_copy(&self, name: &str) -> Option<Vec<String>> {
        let bytes = std::fs::read(self.local_copy_path(name)).ok()?;
        let copy: LocalCopy = serde_json::from_slice(&bytes).ok()?;
        let valid = copy.name == name
            && !copy.layers.is_empty()
            && copy.layers.iter().all(|l| Digest::parse(l).is_ok());
        valid.then_some(copy.layers)
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
    fn images_run_before_resolve_while_the_store_is_unreadable() {
        let dir = tempfile::tempdir().unwrap();
        let tree = dir.path().join("tree");
        std::fs::create_dir_all(tree.join("etc")).unwrap();
        std::fs::write(tree.join("etc/motd"), "hi\n").unwrap();
        let store = Store::open(dir.path().join("store"), StoreConfig::default()).unwrap();
        let source = manage::ImportSource::from_dir(tree).unwrap();
        for name in ["seen", "unseen"] {
            manage::import(
                &store,
                &source,
                Some(name),
                &dsec_layerfs::progress::NoProgress,
            )
            .unwrap();
        }
        let catalog = Catalog {
            home: dir.path().join("home"),
            store: dir.path().join("store"),
            cache: dir.path().join("cache"),
        };
        let seen = catalog.layer_image("seen").unwrap().unwrap();
        assert!(catalog.layer_image("nothing").unwrap().is_none());

        // The store cannot be opened any more (as a network mount whose server is down).
        std::fs::rename(dir.path().join("store/images"), dir.path().join("away")).unwrap();
        assert_eq!(catalog.layer_image("seen").unwrap(), Some(seen));
        let err = catalog.layer_image("unseen").unwrap_err();
        assert!(matches!(err, ImageError::StoreUnreachable { .. }), "{err}");
        assert!(err.to_string().contains("\"unseen\""), "{err}");

        // A damaged local copy is no copy.
        let copy = catalog.local_copy_path("seen");
        std::fs::write(&copy, b"{\"name\":\"seen\",\"layers\":[\"x\"]}").unwrap();
        assert!(matches!(
            catalog.layer_image("seen"),
            Err(ImageError::StoreUnreachable { .. })
        ));
    }
}
