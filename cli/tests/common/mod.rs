//! Test setup shared by the CLI's integration tests.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// DSEC_HOME with the busybox image, one per test binary; the agent is built next to `dsec`.
pub fn dsec_home() -> &'static Path {
    static HOME: OnceLock<PathBuf> = OnceLock::new();
    HOME.get_or_init(|| {
        let status = Command::new(env!("CARGO"))
            .args(["build", "-q", "-p", "dsec-agent"])
            .current_dir(workspace_root())
            .status()
            .unwrap();
        assert!(status.success(), "cargo build -p dsec-agent failed");
        let agent = Path::new(env!("CARGO_BIN_EXE_dsec")).with_file_name("dsec-agent");
        assert!(agent.is_file(), "{} missing", agent.display());
        let home = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("{}-home", env!("CARGO_CRATE_NAME")));
        let status = Command::new(workspace_root().join("guest-agent/mkinitramfs.sh"))
            .arg("--agent")
            .arg(&agent)
            .arg(home.join("images/busybox"))
            .stdout(Stdio::null())
            .status()
            .unwrap();
        assert!(status.success(), "mkinitramfs.sh failed");
        home
    })
}
