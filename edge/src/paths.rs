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

    /// The guest kernel version recorded next to the kernel, if any.
    pub fn kernel_version(&self) -> Option<String> {
        std::fs::read_to_string(&self.kernel_version_file)
            .ok()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
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
