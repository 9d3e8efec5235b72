//! A real `dsec-edge` daemon for integration tests: private state dir, cgroup name and
//! DSEC_HOME (the fresh test busybox image, plus installed images a test asks for).

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use dsec_sdk::{Client, CreateSandboxRequest};

/// A `dsec-edge` on a private state dir, cgroup name and DSEC_HOME (the fresh test image);
/// dropping it deletes its sandboxes, stops it and removes everything it left.
pub struct Daemon {
    child: Child,
    pub dir: PathBuf,
    pub tag: String,
    /// Taken on stop: the daemon finishes once its connections are closed.
    client: Option<Client>,
}

impl Daemon {
    pub async fn start(name: &str) -> Self {
        Self::start_with_images(name, &[]).await
    }

    /// Also links these installed images (`$DSEC_HOME/images/NAME`) into its DSEC_HOME.
    pub async fn start_with_images(name: &str, extra_images: &[&str]) -> Self {
        // Builds the agent the daemon finds next to itself, and the busybox image.
        let node = crate::common::TestNode::new(&format!("pty-{name}"));
        let tag = format!("dsec-test-{}-ptyedge-{name}", std::process::id());
        let dir = std::env::temp_dir().join(&tag);
        let images = dir.join("home/images");
        std::fs::create_dir_all(&images).unwrap();
        std::os::unix::fs::symlink(node.rootfs.parent().unwrap(), images.join("busybox")).unwrap();
        for image in extra_images {
            let installed = dsec_edge::Artifacts::home().join("images").join(image);
            assert!(
                installed.is_dir(),
                "image {image} is not installed at {}: run setup.sh (or images/{image}/build.sh --install)",
                installed.display()
            );
            std::os::unix::fs::symlink(&installed, images.join(image)).unwrap();
        }
        let log = std::fs::File::create(dir.join("edge.log")).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_dsec-edge"))
            .arg("--state-dir")
            .arg(dir.join("state"))
            .args(["--metrics", "off", "--default-backend", "container"])
            .args(["--cgroup-name", &tag])
            .env("DSEC_HOME", dir.join("home"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start dsec-edge");
        // Owned at once, so that a failure below still stops it and cleans up.
        let mut daemon = Daemon {
            child,
            dir,
            tag,
            client: None,
        };
        let socket = daemon.dir.join("state/edge.sock");
        let deadline = Instant::now() + Duration::from_secs(30);
        while daemon.client.is_none() {
            if let Ok(client) = Client::connect(&format!("unix:{}", socket.display())).await {
                if client.node_status().await.is_ok() {
                    daemon.client = Some(client);
                    break;
                }
            }
            assert!(
                daemon.child.try_wait().unwrap().is_none(),
                "dsec-edge exited: see {}/edge.log",
                daemon.dir.display()
            );
            assert!(Instant::now() < deadline, "dsec-edge did not come up");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        daemon
    }

    pub fn client(&self) -> &Client {
        self.client.as_ref().expect("daemon running")
    }

    pub async fn sandbox(&self) -> String {
        self.client()
            .create(CreateSandboxRequest {
                memory_mib: 128,
                ..Default::default()
            })
            .await
            .expect("create a sandbox")
            .id
    }

    /// Deletes every sandbox, checks nothing of them is left, stops the daemon.
    pub async fn stop(mut self) {
        let client = self.client.take().expect("daemon running");
        for sb in client.list(Default::default()).await.unwrap() {
            client.delete(&sb.id).await.unwrap();
        }
        drop(client);
        let sandboxes = self.dir.join("state/sandboxes");
        let left: Vec<_> = std::fs::read_dir(&sandboxes)
            .map(|d| d.flatten().map(|e| e.file_name()).collect())
            .unwrap_or_default();
        assert!(left.is_empty(), "sandboxes left: {left:?}");
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.child.try_wait().unwrap().is_none() {
            assert!(
                Instant::now() < deadline,
                "dsec-edge did not stop on SIGTERM"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        remove_cgroup_dirs(Path::new("/sys/fs/cgroup"), &self.tag, 0);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Removes the daemon's cgroup `tag` on every hierarchy: it leaves the (empty) parent
/// behind, and after a failed test also sandboxes, whose processes are killed first.
fn remove_cgroup_dirs(dir: &Path, tag: &str, depth: usize) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if !entry.file_type().map(|t| t.is_dir()).unwrap_or(false) {
            continue;
        }
        if entry.file_name() == tag {
            kill_and_remove(&path);
        } else if depth < 8 {
            remove_cgroup_dirs(&path, tag, depth + 1);
        }
    }
}

fn kill_and_remove(cgroup: &Path) {
    for entry in std::fs::read_dir(cgroup).into_iter().flatten().flatten() {
        if entry.file_type().map(|t| t.is_dir()).unwrap_or(false) {
            kill_and_remove(&entry.path());
        }
    }
    let _ = std::fs::write(cgroup.join("freezer.state"), "THAWED");
    let deadline = Instant::now() + Duration::from_secs(5);
    while std::fs::remove_dir(cgroup).is_err() && Instant::now() < deadline {
        let procs = std::fs::read_to_string(cgroup.join("cgroup.procs")).unwrap_or_default();
        for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
