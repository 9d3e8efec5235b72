//! The host side of vsock against the real `dsec-vmm`: `vsock_connect` (the `CONNECT <port>`
//! handshake the microVM backend uses to reach the agent) talking to the in-tree vsock test
//! guest's echo port. Runs wherever /dev/kvm exists (the guest works at CPL 3, so PVM is fine).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use dsec_edge::client::vsock_connect;
use dsec_vmm_api::{SerialOutput, VmConfig, VmmLaunch, VsockConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Builds dsec-vmm and the vsock test guest (no-ops when fresh).
fn vmm_and_guest() -> (PathBuf, PathBuf) {
    let target = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .unwrap()
        .to_path_buf();
    let status = Command::new(env!("CARGO"))
        .args(["build", "-q", "-p", "dsec-vmm"])
        .current_dir(workspace_root())
        .status()
        .unwrap();
    assert!(status.success(), "cargo build -p dsec-vmm failed");
    let guests = target.join("test-guests");
    // Same invocation as vmm/tests/test_guests.rs: the guest crate's own .cargo/config.toml
    // applies only when cargo runs in its directory, and outer flags must not leak in.
    let status = Command::new(env!("CARGO"))
        .current_dir(workspace_root().join("vmm/test-guests"))
        .args(["build", "-q", "--release", "--target-dir"])
        .arg(&guests)
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .env_remove("CARGO_BUILD_RUSTFLAGS")
        .env_remove("CARGO_BUILD_TARGET")
        .env_remove("CARGO_TARGET_DIR")
        .status()
        .unwrap();
    assert!(status.success(), "building vmm/test-guests failed");
    (
        target.join("debug/dsec-vmm"),
        guests.join("x86_64-unknown-linux-gnu/release/vsock"),
    )
}

struct Vm {
    child: std::process::Child,
    dir: PathBuf,
}

impl Drop for Vm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[tokio::test]
async fn connect_handshake_reaches_the_guest_port() {
    if !Path::new("/dev/kvm").exists() {
        eprintln!("skipped: no /dev/kvm");
        return;
    }
    let (vmm, guest) = vmm_and_guest();
    let dir = std::env::temp_dir().join(format!("dsec-vsock-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let uds = dir.join("vsock.sock");
    let mut config = VmConfig::new(&guest);
    // The guest powers off after `streams` echo connections; keep it up for all of ours.
    config.cmdline = "guest_connect=0 bulk=0 streams=100 expect_cid=3".into();
    config.vcpus = 1;
    config.mem_mib = 64;
    config.vsock = Some(VsockConfig {
        uds_path: uds.clone(),
        guest_cid: 3,
    });
    config.serial = SerialOutput::File(dir.join("serial.log"));
    let child = Command::new(&vmm)
        .args(VmmLaunch::boot(config).to_args())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut vm = Vm { child, dir };

    // Retry like the microVM backend does while the guest is still starting.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut first = Some(loop {
        match vsock_connect(&uds, 5001).await {
            Ok(stream) => break stream,
            Err(err) => {
                assert!(
                    vm.child.try_wait().unwrap().is_none(),
                    "VMM exited: {}",
                    std::fs::read_to_string(vm.dir.join("serial.log")).unwrap_or_default()
                );
                assert!(
                    Instant::now() < deadline,
                    "guest port 5001 never answered: {err}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    });
    for round in 0..3 {
        let mut stream = match first.take() {
            Some(stream) => stream,
            None => vsock_connect(&uds, 5001).await.unwrap(),
        };
        let message: Vec<u8> = (0..100_000u32).map(|i| (i * 31 + round) as u8).collect();
        let (mut reader, mut writer) = stream.split();
        let (written, echoed) = tokio::join!(
            async {
                writer.write_all(&message).await.unwrap();
                writer.shutdown().await.unwrap();
            },
            async {
                let mut echoed = Vec::new();
                tokio::time::timeout(Duration::from_secs(20), reader.read_to_end(&mut echoed))
                    .await
                    .expect("echo timed out")
                    .unwrap();
                echoed
            }
        );
        let () = written;
        assert!(
            echoed == message,
            "round {round}: echo differs ({} bytes back)",
            echoed.len()
        );
    }

    // A port nobody listens on is refused, not hung.
    let err = tokio::time::timeout(Duration::from_secs(10), vsock_connect(&uds, 7777))
        .await
        .expect("CONNECT to a closed port must not hang")
        .unwrap_err();
    assert!(err.to_string().contains("7777"), "{err}");
}
