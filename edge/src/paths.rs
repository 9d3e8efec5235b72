//! Where artifacts and helper binaries live.

use std::path::{Path, PathBuf};

/// Default artifact locations under `${DSEC_HOME:-/var/lib/dsec}`.
#[derive(Clone, Debug)]
pub struct Artifacts {
    pub home: PathBuf,
    pub kernel: PathBuf,
    pub kernel_version_file: PathBuf,
    pub initramfs: PathBuf,
    pub rootfs: PathBuf,
}

impl Artifacts {
    pub fn home() -> PathBuf {
        std::env::var_os("DSEC_HOME")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/var/lib/dsec"))
    }

    pub fn from_env() -> Self {
        Self::under(&Self::home())
    }

    pub fn under(home: &Path) -> Self {
        Self {
            home: home.to_path_buf(),
            kernel: home.join("kernel/vmlinux"),
            kernel_version_file: home.join("kernel/version"),
            initramfs: home.join("images/busybox/initramfs.cpio"),
            rootfs: home.join("images/busybox/rootfs"),
        }
    }

    /// The files of image `name` under `$DSEC_HOME/images/<name>/` (present or not).
    pub fn image(&self, name: &str) -> ImagePaths {
        let dir = self.home.join("images").join(name);
        ImagePaths {
            rootfs: dir.join("rootfs"),
            initramfs: dir.join("initramfs.cpio"),
            root_disk: dir.join("rootfs.img"),
            dir,
        }
    }

    /// The guest kernel version recorded next to the kernel, if any.
    pub fn kernel_version(&self) -> Option<String> {
        std::fs::read_to_string(&self.kernel_version_file)
            .ok()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
    }
}

/// Where an installed image keeps its parts.
#[derive(Clone, Debug)]
pub struct ImagePaths {
    pub dir: PathBuf,
    /// Root directory (container backend: the overlay's lower layer).
    pub rootfs: PathBuf,
    /// Initramfs whose /init is the agent (microVM).
    pub initramfs: PathBuf,
    /// Read-only root filesystem image, erofs or ext4 (microVM, optional): when present the
    /// agent boots from the initramfs, then switches into this disk with an overlay on a
    /// per-sandbox disk.
    pub root_disk: PathBuf,
}

impl ImagePaths {
    /// Checks the part `kind` needs is installed; the error names the command that installs it.
    pub fn check(&self, name: &str, kind: crate::BackendKind) -> crate::Result<()> {
        let (present, path) = match kind {
            crate::BackendKind::Container => (self.rootfs.join("bin").is_dir(), &self.rootfs),
            crate::BackendKind::MicroVm => (self.initramfs.is_file(), &self.initramfs),
        };
        if present {
            return Ok(());
        }
        Err(crate::EdgeError::MissingImage {
            name: name.to_string(),
            backend: kind.as_str(),
            path: path.clone(),
            hint: Self::install_hint(name),
        })
    }

    /// The root disk, if this image has one.
    pub fn root_disk(&self) -> Option<PathBuf> {
        self.root_disk.is_file().then(|| self.root_disk.clone())
    }

    /// How to install image `name`, for error messages.
    pub fn install_hint(name: &str) -> &'static str {
        match name {
            "busybox" => {
                "build it with `guest-agent/mkinitramfs.sh --install` (./setup.sh runs it)"
            }
            "debian" => "build it with `images/debian/build.sh --install` (./setup.sh runs it)",
            _ => "install the image there (./setup.sh installs busybox and debian)",
        }
    }
}

/// Finds a helper binary: next to the current executable (or its parent, for test
/// and example binaries in target/*/{deps,examples}), then in $DSEC_HOME/bin, then in PATH.
pub fn find_binary(name: &str) -> Option<PathBuf> {
    let mut candidates = Vec::new();
    if let Ok(exe) = std::env::current_exe() {
        if let Some(dir) = exe.parent() {
            candidates.push(dir.join(name));
            if dir.ends_with("deps") || dir.ends_with("examples") {
                if let Some(parent) = dir.parent() {
                    candidates.push(parent.join(name));
                }
            }
        }
    }
    candidates.push(Artifacts::home().join("bin").join(name));
    if let Some(path) = std::env::var_os("PATH") {
        candidates.extend(std::env::split_paths(&path).map(|dir| dir.join(name)));
    }
    candidates.into_iter().find(|p| is_executable(p))
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// The last 2000 bytes of a log, as `; last lines of LABEL (PATH):\n...` for an error
/// message (empty when the log is missing or empty).
pub fn log_tail(path: &Path, label: &str) -> String {
    match std::fs::read(path) {
        Ok(bytes) if !bytes.is_empty() => {
            let start = bytes.len().saturating_sub(2000);
            format!(
                "; last lines of {label} ({}):\n{}",
                path.display(),
                String::from_utf8_lossy(&bytes[start..]).trim_end()
            )
        }
        _ => String::new(),
    }
}
