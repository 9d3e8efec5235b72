//! layerfs: composable image layers stored once as content-addressed chunks on a shared
//! filesystem and loaded lazily, chunk by chunk, into a per-node cache.

pub mod build;
pub mod digest;
pub mod error;
pub mod index;
pub mod store;
pub mod xattr;

pub use digest::Digest;
pub use error::{Error, Result};
pub mod cache;
pub mod compose;
pub mod fuse;
pub mod image;
pub mod manage;
pub mod oci;
pub mod overlay;
pub mod prefetch;
pub mod progress;
pub mod registry;
pub mod sandbox;
pub mod serve;
pub mod tarfmt;
pub mod testing;
