//! Shared read-only mounts of layer-store images, one image server process per layer stack.
//!
//! Each server is `dsec-edge --serve-image DIR` (the daemon's own executable) in its own
//! session: it mounts the image's FUSE view at `DIR/root` and serves it until SIGTERM. It
//! is a separate process so the mount (and every container overlay whose lowerdir it is)
//! survives a daemon that is killed; the next daemon re-adopts it from `DIR/server.json`
//! like a sandbox (pid + start time). Every container sandbox of the image uses the same
//! mount; the daemon counts them and stops the server when the last one is deleted.
//!
//! Layout: `<state_dir>/images/<layer-stack key>-<random>/{image.json, server.json,
//! server.log, ready, root/}`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};

use super::{is_layerfs_mount, LayerImage, SERVER_IMAGE_FILE, SERVER_READY_FILE};
use crate::backend::proc_stat;

/// How long a new server may take to mount.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a server may take to unmount after SIGTERM before it is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// Errors of starting an image server.
#[derive(Debug, thiserror::Error)]
pub enum MountError {
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the image server for {image:?} exited before its mount was up ({status}){log}")]
    ServerDied {
        image: String,
        status: String,
        log: String,
    },
    #[error("the image server for {image:?} did not mount within {timeout:?}{log}")]
    NotReady {
        image: String,
        timeout: Duration,
        log: String,
    },
}

/// What is persisted per server (`server.json`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ServerHandle {
    /// Directory name under `<state_dir>/images`; sandbox records name their server by it.
    pub instance: String,
    pub key: String,
    pub image: String,
    pub dir: PathBuf,
    pub pid: i32,
    pub pid_start: u64,
}

impl ServerHandle {
    pub fn root(&self) -> PathBuf {
        self.dir.join("root")
    }

    /// The server process is the one we started and its mount is up.
    pub fn is_alive(&self) -> bool {
        let running = match proc_stat(self.pid) {
            Some((state, start)) => state != 'Z' && state != 'X' && start == self.pid_start,
            None => false,
        };
        running && is_layerfs_mount(&self.root())
    }

    /// SIGTERM (the server unmounts), SIGKILL after STOP_TIMEOUT, a lazy unmount of whatever
    /// is left at the mount point, then the directory goes. Blocking.
    pub fn stop(&self) {
        let pid = Pid::from_raw(self.pid);
        let ours = || proc_stat(self.pid).is_some_and(|(_, start)| start == self.pid_start);
        if ours() {
            let _ = kill(pid, Signal::SIGTERM);
            let killed_at = Instant::now() + STOP_TIMEOUT;
            let mut killed = false;
            loop {
                match waitpid(pid, Some(WaitPidFlag::WNOHANG)) {
                    Ok(WaitStatus::StillAlive) => {}
                    Ok(_) => break,
                    // Not our child (started by a previous daemon): init reaps it.
                    Err(_) => {
                        if !ours() {
                            break;
                        }
                    }
                }
                if !killed && Instant::now() > killed_at {
                    tracing::warn!(image = %self.image, pid = self.pid, "image server ignored SIGTERM; killing it");
                    let _ = kill(pid, Signal::SIGKILL);
                    killed = true;
                }
                if Instant::now() > killed_at + STOP_TIMEOUT {
                    tracing::warn!(image = %self.image, pid = self.pid, "image server does not die; leaving it");
                    return;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        } else {
            // A zombie child of this daemon.
            let _ = waitpid(pid, Some(WaitPidFlag::WNOHANG));
        }
        let root = self.root();
        if is_layerfs_mount(&root) {
            // The server died without unmounting: the mount answers ENOTCONN; detach it.
            if let Err(e) = nix::mount::umount2(&root, nix::mount::MntFlags::MNT_DETACH) {
                tracing::warn!(root = %root.display(), "cannot detach a dead image mount: {e}");
                return;
            }
        }
        if let Err(e) = std::fs::remove_dir_all(&self.dir) {
            tracing::warn!(dir = %self.dir.display(), "cannot remove image server directory: {e}");
        }
    }
}

struct Served {
    handle: ServerHandle,
    /// Sandboxes whose overlay uses this mount.
    users: usize,
}

/// The node's image servers.
pub struct ImageMounts {
    dir: PathBuf,
    /// How to start this executable as an image server (followed by `--serve-image DIR`).
    argv: Vec<OsString>,
    served: tokio::sync::Mutex<BTreeMap<String, Served>>,
}

fn random_hex(bytes: usize) -> String {
    let mut buf = vec![0u8; bytes];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        use std::io::Read;
        let _ = f.read_exact(&mut buf);
    }
    buf.iter().map(|b| format!("{b:02x}")).collect()
}

fn tail(path: &Path) -> String {
    match std::fs::read(path) {
        Ok(b) if !b.is_empty() => {
            let start = b.len().saturating_sub(2000);
            format!(
                "; last lines of {}:\n{}",
                path.display(),
                String::from_utf8_lossy(&b[start..]).trim_end()
            )
        }
        _ => String::new(),
    }
}

/// SIGKILLs a process started as `... --serve-image DIR` (no record of its pid exists).
fn kill_server_of(dir: &Path) {
    let mut needle = b"--serve-image\0".to_vec();
    needle.extend_from_slice(dir.as_os_str().as_encoded_bytes());
    needle.push(0);
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        if cmdline
            .windows(needle.len())
            .any(|w| w == needle.as_slice())
        {
            tracing::info!(pid, dir = %dir.display(), "killing a half-started image server");
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            // Ours only if this very daemon started it; otherwise init reaps it.
            let _ = waitpid(Pid::from_raw(pid), Some(WaitPidFlag::WNOHANG));
        }
    }
}

impl ImageMounts {
    /// `invocation`: the arguments that make this executable the daemon (`up` for `dsec`).
    pub fn new(state_dir: &Path, invocation: &[OsString]) -> Self {
        // /proc/self/exe, not the path: an upgrade that replaced the file on disk must not
        // start servers of another version (or fail on a " (deleted)" path).
        let mut argv = vec![OsString::from("/proc/self/exe")];
        argv.extend(invocation.iter().cloned());
        Self {
            dir: state_dir.join("images"),
            argv,
            served: tokio::sync::Mutex::new(BTreeMap::new()),
        }
    }

    /// Servers a previous daemon left that still serve their mount; dead ones are cleaned
    /// up. Call `adopted` with the users found among the sandbox records next.
    pub fn recover(&self) -> HashMap<String, ServerHandle> {
        let mut alive = HashMap::new();
        for entry in std::fs::read_dir(&self.dir).into_iter().flatten().flatten() {
            let dir = entry.path();
            let handle: Option<ServerHandle> = std::fs::read(dir.join("server.json"))
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok());
            match handle {
                Some(h) if h.dir == dir && h.is_alive() => {
                    alive.insert(h.instance.clone(), h);
                }
                Some(h) if h.dir == dir => {
                    tracing::info!(image = %h.image, "removing a dead image server's mount");
                    h.stop();
                }
                _ => {
                    // Half-started (the daemon died before writing server.json): find the
                    // server by its command line; the mount point may be up.
                    kill_server_of(&dir);
                    let root = dir.join("root");
                    if is_layerfs_mount(&root) {
                        let _ = nix::mount::umount2(&root, nix::mount::MntFlags::MNT_DETACH);
                    }
                    let _ = std::fs::remove_dir_all(&dir);
                }
            }
        }
        alive
    }

    /// Keeps the recovered servers that adopted sandboxes use (with their counts) and stops
    /// the rest.
    pub async fn adopted(
        &self,
        servers: HashMap<String, ServerHandle>,
        users: &HashMap<String, usize>,
    ) {
        let mut served = self.served.lock().await;
        for (instance, handle) in servers {
            match users.get(&instance) {
                Some(&n) if n > 0 => {
                    tracing::info!(image = %handle.image, users = n, "image server adopted");
                    served.insert(instance, Served { handle, users: n });
                }
                _ => {
                    tracing::info!(image = %handle.image, "stopping an unused image server");
                    let _ = tokio::task::spawn_blocking(move || handle.stop()).await;
                }
            }
        }
    }

    /// The root of a live mount of `image`'s layers for one more sandbox: the existing one,
    /// or a new server. Returns the server's instance name (for `release`) and the root.
    pub async fn acquire(&self, image: &LayerImage) -> Result<(String, PathBuf), MountError> {
        let key = image.key();
        let mut served = self.served.lock().await;
        if let Some(s) = served
            .values_mut()
            .find(|s| s.handle.key == key && s.handle.is_alive())
        {
            s.users += 1;
            return Ok((s.handle.instance.clone(), s.handle.root()));
        }
        let handle = self.start(image, &key).await?;
        let result = (handle.instance.clone(), handle.root());
        served.insert(handle.instance.clone(), Served { handle, users: 1 });
        Ok(result)
    }

    /// One sandbox less on `instance`; the last one stops the server (unmounts).
    pub async fn release(&self, instance: &str) {
        let mut served = self.served.lock().await;
        let Some(s) = served.get_mut(instance) else {
            return;
        };
        s.users = s.users.saturating_sub(1);
        if s.users > 0 {
            return;
        }
        let Some(s) = served.remove(instance) else {
            return;
        };
        drop(served);
        tracing::info!(image = %s.handle.image, "last sandbox gone: unmounting the image");
        let _ = tokio::task::spawn_blocking(move || s.handle.stop()).await;
    }

    /// Stops every server no sandbox in `in_use` needs (a clean daemon stop: creates cut
    /// short by the shutdown may have started one).
    pub async fn stop_unused(&self, in_use: &HashSet<String>) {
        let unused: Vec<Served> = {
            let mut served = self.served.lock().await;
            let names: Vec<String> = served
                .keys()
                .filter(|k| !in_use.contains(*k))
                .cloned()
                .collect();
            names.iter().filter_map(|k| served.remove(k)).collect()
        };
        for s in unused {
            tracing::info!(image = %s.handle.image, "daemon stopping: unmounting an unused image");
            let _ = tokio::task::spawn_blocking(move || s.handle.stop()).await;
        }
    }

    /// Servers that no longer serve their mount (a sandbox on one cannot read its root any
    /// more): one check per server, whatever the number of sandboxes.
    pub async fn dead(&self) -> HashSet<String> {
        self.served
            .lock()
            .await
            .iter()
            .filter(|(_, s)| !s.handle.is_alive())
            .map(|(instance, _)| instance.clone())
            .collect()
    }

    /// (image, users, root) of every server, for listings and tests.
    pub async fn list(&self) -> Vec<(String, usize, PathBuf)> {
        self.served
            .lock()
            .await
            .values()
            .map(|s| (s.handle.image.clone(), s.users, s.handle.root()))
            .collect()
    }

    async fn start(&self, image: &LayerImage, key: &str) -> Result<ServerHandle, MountError> {
        let instance = format!("{key}-{}", random_hex(4));
        let dir = self.dir.join(&instance);
        let io = |what, path: &Path| {
            let path = path.to_path_buf();
            move |source| MountError::Io { what, path, source }
        };
        std::fs::create_dir_all(dir.join("root"))
            .map_err(io("cannot create the image mount point", &dir))?;
        let cleanup = |dir: &Path| {
            let _ = std::fs::remove_dir_all(dir);
        };
        let spec = serde_json::to_vec_pretty(image).expect("a LayerImage serializes");
        if let Err(e) = std::fs::write(dir.join(SERVER_IMAGE_FILE), spec) {
            cleanup(&dir);
            return Err(io("cannot write", &dir.join(SERVER_IMAGE_FILE))(e));
        }
        let log_path = dir.join("server.log");
        let log = match std::fs::File::create(&log_path) {
            Ok(f) => f,
            Err(e) => {
                cleanup(&dir);
                return Err(io("cannot create", &log_path)(e));
            }
        };
        let log_err = log.try_clone().map_err(io("cannot dup", &log_path))?;
        let mut command = std::process::Command::new(&self.argv[0]);
        if let Ok(exe) = std::env::current_exe() {
            use std::os::unix::process::CommandExt;
            // What `ps` shows.
            command.arg0(exe);
        }
        command
            .args(&self.argv[1..])
            .arg("--serve-image")
            .arg(&dir)
            .stdin(std::process::Stdio::null())
            .stdout(log)
            .stderr(log_err);
        // SAFETY: setsid is async-signal-safe and touches no memory of the parent.
        unsafe {
            use std::os::unix::process::CommandExt;
            // Own session: the server must outlive a daemon that is killed.
            command.pre_exec(|| {
                nix::unistd::setsid().map_err(std::io::Error::from)?;
                Ok(())
            });
        }
        let mut child = match command.spawn() {
            Ok(c) => c,
            Err(e) => {
                cleanup(&dir);
                return Err(io(
                    "cannot start the image server",
                    Path::new(&self.argv[0]),
                )(e));
            }
        };
        let pid = child.id() as i32;
        let handle = ServerHandle {
            instance,
            key: key.to_string(),
            image: image.name.clone(),
            dir: dir.clone(),
            pid,
            pid_start: proc_stat(pid).map(|(_, s)| s).unwrap_or(0),
        };
        let record = serde_json::to_vec_pretty(&handle).expect("a ServerHandle serializes");
        if let Err(e) = std::fs::write(dir.join("server.json"), record) {
            let _ = child.kill();
            let _ = child.wait();
            cleanup(&dir);
            return Err(io("cannot write", &dir.join("server.json"))(e));
        }
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                let log = tail(&log_path);
                handle.stop();
                return Err(MountError::ServerDied {
                    image: image.name.clone(),
                    status: status.to_string(),
                    log,
                });
            }
            if dir.join(SERVER_READY_FILE).exists() && is_layerfs_mount(&handle.root()) {
                tracing::info!(image = %image.name, pid, root = %handle.root().display(), "image mounted");
                return Ok(handle);
            }
            if Instant::now() > deadline {
                let log = tail(&log_path);
                let h = handle.clone();
                let _ = tokio::task::spawn_blocking(move || h.stop()).await;
                return Err(MountError::NotReady {
                    image: image.name.clone(),
                    timeout: READY_TIMEOUT,
                    log,
                });
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}
