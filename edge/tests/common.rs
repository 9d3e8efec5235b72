//! Shared setup for the container-path tests: a fresh agent binary, the busybox rootfs and a
//! private state directory that is removed afterwards.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use dsec_edge::{Artifacts, BackendKind, EdgeConfig, Sandbox, SandboxSpec};

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Builds (or reuses) the agent and the busybox rootfs once per test binary.
fn artifacts() -> &'static (PathBuf, PathBuf) {
    static ARTIFACTS: OnceLock<(PathBuf, PathBuf)> = OnceLock::new();
    ARTIFACTS.get_or_init(|| {
        let target_tmp = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
        let agent = match std::env::var_os("DSEC_AGENT_BIN") {
            Some(path) => PathBuf::from(path),
            None => {
                // A no-op when fresh; keeps these tests from ever running a stale agent.
                let status = Command::new(env!("CARGO"))
                    .args(["build", "-q", "-p", "dsec-agent"])
                    .current_dir(workspace_root())
                    .status()
                    .expect("run cargo build -p dsec-agent");
                assert!(status.success(), "cargo build -p dsec-agent failed");
                target_tmp.parent().unwrap().join("debug/dsec-agent")
            }
        };
        assert!(agent.is_file(), "agent binary {} missing", agent.display());
        let image = target_tmp.join("busybox-image");
        let status = Command::new(workspace_root().join("guest-agent/mkinitramfs.sh"))
            .arg("--agent")
            .arg(&agent)
            .arg(&image)
            .stdout(std::process::Stdio::null())
            .status()
            .expect("run guest-agent/mkinitramfs.sh");
        assert!(status.success(), "mkinitramfs.sh failed");
        (agent, image.join("rootfs"))
    })
}

/// A state directory private to one test, removed (with anything left in it) on drop.
pub struct TestNode {
    pub config: EdgeConfig,
    pub rootfs: PathBuf,
}

impl TestNode {
    pub fn new(name: &str) -> Self {
        let (agent, rootfs) = artifacts().clone();
        let state_dir =
            std::env::temp_dir().join(format!("dsec-test-{}-{name}", std::process::id()));
        let config = EdgeConfig {
            state_dir,
            artifacts: Artifacts::under(rootfs.parent().unwrap()),
            agent_bin: Some(agent),
            vmm_bin: None,
            jail: None,
            network: None,
            vmm_pool: None,
        };
        Self { config, rootfs }
    }

    pub fn spec(&self) -> SandboxSpec {
        SandboxSpec {
            rootfs: Some(self.rootfs.clone()),
            ..SandboxSpec::default()
        }
    }

    pub async fn sandbox(&self) -> Sandbox {
        Sandbox::create(BackendKind::Container, &self.config, &self.spec())
            .await
            .expect("create container sandbox")
    }

    /// Entries left in the state directory (sandboxes not cleaned up).
    pub fn leftovers(&self) -> Vec<String> {
        std::fs::read_dir(&self.config.state_dir)
            .map(|dir| {
                dir.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default()
    }
}

impl Drop for TestNode {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.config.state_dir);
    }
}
