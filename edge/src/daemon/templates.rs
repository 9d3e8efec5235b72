//! Template snapshots: a microVM create restores its image's snapshot taken at agent-ready
//! instead of booting a kernel. The first create of a shape boots it once and keeps the
//! snapshot in `<state dir>/templates/<key>/` (`snapshot/`, `upper.ext4` on disk images,
//! `ready` written last); the key hashes everything the snapshot depends on, so a changed
//! kernel, initramfs, root disk, VMM binary, shape or command line gets a new template. A
//! template that cannot be restored is removed and the create boots cold (with a warning);
//! the next create builds it again.

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use super::error::NodeError;
use super::memory_base;
use super::node::Node;
use super::record::random_hex;
use crate::backend::microvm::{build_template, MemoryRestore, MicroVmImage, UpperDisk};
use crate::backend::{restore_microvm, BackendKind, Sandbox, SandboxSpec};
use crate::error::EdgeError;
use crate::microvm::SpawnOptions;

/// How long a template restore may take to reach its agent before the create boots cold
/// (the create's own ready timeout when that is shorter).
pub const TEMPLATE_READY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// The node's template snapshots.
pub struct Templates {
    dir: PathBuf,
    /// Off: every microVM create boots (`DSEC_TEMPLATES=off`).
    enabled: bool,
    memory: MemoryRestore,
    /// One build at a time per key; creates of that key wait for it.
    building: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Keys with at least one good restore since this daemon started: a later restore of
    /// one that only times out is a slow (loaded) node, not a bad template.
    proven: Mutex<std::collections::HashSet<String>>,
}

impl Templates {
    /// Templates under `<state_dir>/templates`. `DSEC_TEMPLATES=off` disables them,
    /// `DSEC_TEMPLATE_MEMORY=lazy` restores through userfaultfd instead of MAP_PRIVATE.
    pub fn new(state_dir: &Path) -> Self {
        let env = |name: &str| std::env::var(name).unwrap_or_default();
        Templates {
            dir: state_dir.join("templates"),
            enabled: !matches!(env("DSEC_TEMPLATES").as_str(), "off" | "0" | "false"),
            memory: if env("DSEC_TEMPLATE_MEMORY") == "lazy" {
                MemoryRestore::Lazy
            } else {
                MemoryRestore::Private
            },
            building: Mutex::new(HashMap::new()),
            proven: Mutex::default(),
        }
    }

    fn proven(&self) -> std::sync::MutexGuard<'_, std::collections::HashSet<String>> {
        self.proven.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a failed restore of template `key` means the template is bad (and must be
    /// built again): a VMM that cannot load it does; a guest that only answered too late
    /// does only if no restore of that template has worked yet.
    fn blames_the_template(&self, key: &str, err: &EdgeError) -> bool {
        !matches!(err, EdgeError::AgentNotReady { .. }) || !self.proven().contains(key)
    }

    fn lock_for(&self, key: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.building
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(key.to_string())
            .or_default()
            .clone()
    }
}

/// A file's identity for the key: path, size, mtime, inode (content hashing a 100 MB
/// initramfs per create would cost more than the restore saves).
fn identity(path: &Path) -> String {
    match std::fs::metadata(path) {
        Ok(m) => format!(
            "{}:{}:{}.{}:{}",
            path.display(),
            m.len(),
            m.mtime(),
            m.mtime_nsec(),
            m.ino()
        ),
        Err(_) => format!("{}:missing", path.display()),
    }
}

/// The template key of `image` run by `vmm`: a hash of everything its snapshot depends on.
pub fn template_key(image: &MicroVmImage, vmm: &Path) -> String {
    let inputs = serde_json::json!({
        "kernel": identity(&image.kernel),
        "initrd": identity(&image.initrd),
        "root_disk": image.root_disk.as_deref().map(identity),
        "upper_mib": image.upper_mib,
        "vmm": identity(vmm),
        "vcpus": image.vcpus,
        "mem_mib": image.mem_mib,
        "cmdline": image.cmdline,
        "network_device": image.network_device,
    });
    super::create::fnv1a_hex(&inputs.to_string())
}

/// What a template is of, without the versions of its files: the image's and VMM's paths and
/// the shape. Templates of one family with another key are stale (an input changed since).
pub fn template_family(image: &MicroVmImage, vmm: &Path) -> String {
    let inputs = serde_json::json!({
        "kernel": image.kernel,
        "initrd": image.initrd,
        "root_disk": image.root_disk,
        "upper_mib": image.upper_mib,
        "vmm": vmm,
        "vcpus": image.vcpus,
        "mem_mib": image.mem_mib,
        "cmdline": image.cmdline,
        "network_device": image.network_device,
    });
    super::create::fnv1a_hex(&inputs.to_string())
}

/// The file naming a template's family.
const FAMILY_FILE: &str = "family";

/// The templates under `root` of `family` other than `keep`: built from older inputs.
fn stale_templates(root: &Path, family: &str, keep: &str) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    entries
        .flatten()
        .map(|e| e.path())
        .filter(|dir| dir.file_name().is_some_and(|n| n != keep))
        .filter(|dir| {
            std::fs::read_to_string(dir.join(FAMILY_FILE)).is_ok_and(|f| f.trim() == family)
        })
        .collect()
}

/// A template is usable once its `ready` marker and snapshot state are there.
fn is_ready(dir: &Path) -> bool {
    dir.join("ready").is_file() && dir.join("snapshot").join("state").is_file()
}

impl Node {
    /// A microVM for `spec` restored from its image's template (built first if there is
    /// none); a cold boot when templates are off or the template fails.
    pub(super) async fn create_from_template(
        &self,
        spec: &SandboxSpec,
    ) -> Result<Sandbox, NodeError> {
        let templates = &self.templates;
        if !templates.enabled {
            return Ok(Sandbox::create(BackendKind::MicroVm, &self.edge, spec).await?);
        }
        spec.validate()?;
        let image = MicroVmImage::of(&self.edge, spec)?;
        let vmm = SpawnOptions::find(self.edge.vmm_bin.as_deref())?.vmm_bin;
        let key = template_key(&image, &vmm);
        let dir = templates.dir.join(&key);
        let lock = templates.lock_for(&key);
        let guard = lock.lock().await;
        if !is_ready(&dir) {
            if let Err(err) = self.build_template(spec, &dir).await {
                drop(guard);
                tracing::warn!(template = %key, %err, "cannot build the template snapshot; booting cold");
                return Ok(Sandbox::create(BackendKind::MicroVm, &self.edge, spec).await?);
            }
            let family = template_family(&image, &vmm);
            if let Err(e) = std::fs::write(dir.join(FAMILY_FILE), &family) {
                tracing::warn!(template = %key, "cannot record the template's family: {e}");
            }
            self.remove_stale_templates(&family, &key);
        }
        drop(guard);
        let started = std::time::Instant::now();
        let id = spec.id.clone().unwrap_or_default();
        let cid = self.next_cid.fetch_add(1, Ordering::Relaxed);
        let upper = dir.join("upper.ext4");
        // A restore that has not reached its agent by then is given up and booted cold: one
        // of 4 concurrent restores on a loaded rig once never answered, and the create hung
        // for the whole ready timeout (120 s there).
        let restore_spec = SandboxSpec {
            ready_timeout: spec.ready_timeout.min(TEMPLATE_READY_TIMEOUT),
            ..spec.clone()
        };
        let restored = restore_microvm(
            &self.edge,
            &dir.join("snapshot"),
            &id,
            cid,
            &restore_spec,
            spec.root_disk.is_some().then_some(UpperDisk::Copy(&upper)),
            templates.memory,
        )
        .await;
        match restored {
            Ok(sandbox) => {
                templates.proven().insert(key.clone());
                if let Err(e) = memory_base::keep(&dir.join("snapshot"), sandbox.dir()) {
                    tracing::warn!(sandbox = %id, template = %key, "no memory base, so its pauses write full snapshots: {e}");
                }
                tracing::info!(
                    sandbox = %id,
                    template = %key,
                    memory = ?templates.memory,
                    ms = started.elapsed().as_millis() as u64,
                    "restored from the template snapshot"
                );
                Ok(sandbox)
            }
            Err(err) if !templates.blames_the_template(&key, &err) => {
                tracing::warn!(
                    sandbox = %id,
                    template = %key,
                    %err,
                    "a restore of the template snapshot timed out (it restored fine before, so \
                     it is kept: the node is slow); booting cold"
                );
                Ok(Sandbox::create(BackendKind::MicroVm, &self.edge, spec).await?)
            }
            Err(err) => {
                tracing::warn!(
                    sandbox = %id,
                    template = %key,
                    %err,
                    "the template snapshot could not be restored: removed (the next create \
                     builds it again); booting cold"
                );
                let _guard = lock.lock().await;
                templates.proven().remove(&key);
                let _ = std::fs::remove_dir_all(&dir);
                Ok(Sandbox::create(BackendKind::MicroVm, &self.edge, spec).await?)
            }
        }
    }

    /// Removes the templates of `family` built from older inputs (a changed image, kernel or
    /// VMM), except one being built right now. A restore already mapping one keeps its
    /// pages; one about to start falls back to a cold boot.
    fn remove_stale_templates(&self, family: &str, keep: &str) {
        for stale in stale_templates(&self.templates.dir, family, keep) {
            let Some(key) = stale.file_name().and_then(|n| n.to_str()) else {
                continue;
            };
            let lock = self.templates.lock_for(key);
            let Ok(_building) = lock.try_lock() else {
                continue;
            };
            match std::fs::remove_dir_all(&stale) {
                Ok(()) => {
                    tracing::info!(template = %key, "stale template removed (its image, kernel or VMM changed)")
                }
                Err(e) => tracing::warn!(template = %key, "cannot remove the stale template: {e}"),
            }
        }
    }

    /// Boots `spec`'s image once and keeps its snapshot at agent-ready in `dir`.
    async fn build_template(&self, spec: &SandboxSpec, dir: &Path) -> Result<(), NodeError> {
        let started = std::time::Instant::now();
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir)
            .map_err(|e| NodeError::Internal(format!("create {}: {e}", dir.display())))?;
        // A scratch sandbox: no cgroups (nobody is charged), the daemon's boot timeout.
        let builder = SandboxSpec {
            id: None,
            cgroup_procs: Vec::new(),
            ..spec.clone()
        };
        let id = format!("template-{}", random_hex(6));
        let built = build_template(&self.edge, &builder, &id, dir).await;
        if let Err(err) = built {
            let _ = std::fs::remove_dir_all(dir);
            return Err(err.into());
        }
        if let Err(e) = memory_base::seal(&dir.join("snapshot")) {
            tracing::warn!(template = %dir.display(), "cannot seal the template's files, so its sandboxes' pauses write full snapshots: {e}");
        }
        std::fs::write(dir.join("ready"), b"")
            .map_err(|e| NodeError::Internal(format!("mark {} ready: {e}", dir.display())))?;
        tracing::info!(
            template = %dir.display(),
            ms = started.elapsed().as_millis() as u64,
            "template snapshot built"
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_changes_with_every_input() {
        let base = std::env::temp_dir().join(format!("dsec-tpl-key-{}", std::process::id()));
        std::fs::create_dir_all(&base).unwrap();
        let file = |name: &str, body: &[u8]| {
            let p = base.join(name);
            std::fs::write(&p, body).unwrap();
            p
        };
        let image = MicroVmImage {
            kernel: file("vmlinux", b"k"),
            initrd: file("initramfs.cpio", b"i"),
            root_disk: None,
            upper_mib: None,
            vcpus: 1,
            mem_mib: 256,
            cmdline: "console=ttyS0".into(),
            network_device: false,
        };
        let vmm = file("dsec-vmm", b"v");
        let key = template_key(&image, &vmm);
        assert_eq!(key, template_key(&image, &vmm), "stable");
        let changed = [
            MicroVmImage {
                vcpus: 2,
                ..image.clone()
            },
            MicroVmImage {
                mem_mib: 512,
                ..image.clone()
            },
            MicroVmImage {
                cmdline: "console=ttyS0 x".into(),
                ..image.clone()
            },
            MicroVmImage {
                network_device: true,
                ..image.clone()
            },
            MicroVmImage {
                root_disk: Some(file("rootfs.img", b"r")),
                upper_mib: Some(1024),
                ..image.clone()
            },
        ];
        for other in &changed {
            assert_ne!(key, template_key(other, &vmm), "{other:?}");
        }
        // A rebuilt initramfs (new size) or VMM gets a new template.
        std::fs::write(&image.initrd, b"initrd v2").unwrap();
        let after_image = template_key(&image, &vmm);
        assert_ne!(key, after_image);
        std::fs::write(&vmm, b"vmm v2").unwrap();
        assert_ne!(after_image, template_key(&image, &vmm));
        std::fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn only_older_templates_of_the_same_family_are_stale() {
        let root = std::env::temp_dir().join(format!("dsec-tpl-stale-{}", std::process::id()));
        for (key, family) in [
            ("new", Some("f1")),
            ("old", Some("f1")),
            ("other", Some("f2")),
            ("legacy", None),
        ] {
            std::fs::create_dir_all(root.join(key)).unwrap();
            if let Some(f) = family {
                std::fs::write(root.join(key).join(FAMILY_FILE), f).unwrap();
            }
        }
        assert_eq!(stale_templates(&root, "f1", "new"), vec![root.join("old")]);
        assert!(stale_templates(&root, "f3", "new").is_empty());
        assert!(stale_templates(&root.join("missing"), "f1", "new").is_empty());
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn the_family_ignores_file_versions_but_not_the_shape() {
        let base = std::env::temp_dir().join(format!("dsec-tpl-family-{}", std::process::id()));
        std::fs::create_dir_all(&base).unwrap();
        let initrd = base.join("initramfs.cpio");
        std::fs::write(&initrd, b"v1").unwrap();
        let image = MicroVmImage {
            kernel: base.join("vmlinux"),
            initrd: initrd.clone(),
            root_disk: None,
            upper_mib: None,
            vcpus: 1,
            mem_mib: 256,
            cmdline: "console=ttyS0".into(),
            network_device: false,
        };
        let vmm = base.join("dsec-vmm");
        let (family, key) = (template_family(&image, &vmm), template_key(&image, &vmm));
        std::fs::write(&initrd, b"v2 longer").unwrap();
        assert_eq!(family, template_family(&image, &vmm));
        assert_ne!(key, template_key(&image, &vmm));
        let bigger = MicroVmImage {
            mem_mib: 512,
            ..image
        };
        assert_ne!(family, template_family(&bigger, &vmm));
        std::fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn only_a_proven_template_survives_a_restore_timeout() {
        let templates = Templates::new(Path::new("/nonexistent-state"));
        let timeout = EdgeError::AgentNotReady {
            id: "sb-1".into(),
            timeout: std::time::Duration::from_secs(30),
            detail: String::new(),
        };
        let died = EdgeError::SandboxDied {
            id: "sb-1".into(),
            detail: String::new(),
        };
        assert!(
            templates.blames_the_template("k", &timeout),
            "never restored: bad"
        );
        templates.proven().insert("k".into());
        assert!(!templates.blames_the_template("k", &timeout), "slow node");
        assert!(
            templates.blames_the_template("k", &died),
            "the VMM could not load it"
        );
    }

    #[test]
    fn a_template_without_its_marker_or_state_is_not_ready() {
        let dir = std::env::temp_dir().join(format!("dsec-tpl-ready-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("snapshot")).unwrap();
        assert!(!is_ready(&dir));
        std::fs::write(dir.join("ready"), b"").unwrap();
        assert!(!is_ready(&dir), "no snapshot state");
        std::fs::write(dir.join("snapshot/state"), b"{}").unwrap();
        assert!(is_ready(&dir));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
