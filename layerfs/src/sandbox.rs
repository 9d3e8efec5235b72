//! A sandbox root for the container backend: the image's layers through one FUSE mount as
//! the read-only lower, a local writable upper on top (kernel overlayfs). After unmounting,
//! `overlay::pack_diff` turns the upper into a new layer.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::cache::NodeCache;
use crate::digest::Digest;
use crate::error::{Error, Result};
use crate::fuse::{self, Mount};

/// Layout under `dir`: `lower/` (FUSE), `upper/`, `work/`, `root/` (the sandbox's /).
#[derive(Debug)]
pub struct SandboxRoot {
    dir: PathBuf,
    fuse: Option<Mount>,
    overlay_mounted: bool,
}

impl SandboxRoot {
    /// Mounts `layers` (bottom first) with a writable upper in `dir`. An existing upper is
    /// reused, so a stopped sandbox resumes with its writes.
    pub fn mount(
        cache: Arc<NodeCache>,
        layers: &[Digest],
        dir: &Path,
        record_hot: bool,
    ) -> Result<SandboxRoot> {
        for sub in ["lower", "upper", "work", "root"] {
            let p = dir.join(sub);
            fs::create_dir_all(&p).map_err(|e| Error::io("creating sandbox directory", &p, e))?;
        }
        let tree = Arc::new(cache.compose(layers)?);
        let fuse = fuse::mount(tree, cache, &dir.join("lower"), record_hot)?;
        let mut me = SandboxRoot {
            dir: dir.to_path_buf(),
            fuse: Some(fuse),
            overlay_mounted: false,
        };
        crate::overlay::mount_overlay(
            &[&dir.join("lower")],
            Some((&dir.join("upper"), &dir.join("work"))),
            &dir.join("root"),
        )?;
        me.overlay_mounted = true;
        Ok(me)
    }

    pub fn root(&self) -> PathBuf {
        self.dir.join("root")
    }

    pub fn upper(&self) -> PathBuf {
        self.dir.join("upper")
    }

    pub fn fuse(&self) -> Option<&Mount> {
        self.fuse.as_ref()
    }

    /// Unmounts the overlay, then the FUSE view.
    pub fn unmount(mut self) -> Result<()> {
        self.teardown()
    }

    fn teardown(&mut self) -> Result<()> {
        if self.overlay_mounted {
            self.overlay_mounted = false;
            crate::overlay::unmount(&self.dir.join("root"))?;
        }
        if let Some(f) = self.fuse.take() {
            f.unmount();
        }
        Ok(())
    }
}

impl Drop for SandboxRoot {
    fn drop(&mut self) {
        if let Err(e) = self.teardown() {
            tracing::warn!("sandbox root teardown: {e}");
        }
    }
}
