//! Images a container sandbox runs from: directory images
//! (`$DSEC_HOME/images/NAME/rootfs`) and images of the node's layer store (layerfs), which
//! are served read-only through FUSE and used as the overlay's lowerdir.
//!
//! Lookup order: a directory image wins over a layer-store image of the same name. The
//! directory images are what this node has installed (the default `busybox`, setup.sh's
//! images); the layer store may be shared by many nodes, and an import there must not
//! silently change what an installed name runs. Import under another name to use both.

mod catalog;
mod mount;
pub mod servers;

pub use catalog::{Catalog, ImageError, ImageSource, LayerImage};
pub use mount::{is_layerfs_mount, serve_image, LocalMount, SERVER_IMAGE_FILE, SERVER_READY_FILE};
