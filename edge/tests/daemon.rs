//! A real `dsec-edge` for tests: private state dir, cgroup name, HTTP and metrics ports, the
//! test busybox image as DSEC_HOME. Dropping it deletes its sandboxes, stops it and removes
//! everything it left, also when a test fails.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use dsec_sdk::Client;

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// DSEC_HOME with the busybox image; the daemon finds the agent next to itself.
pub fn dsec_home() -> &'static Path {
    static HOME: OnceLock<PathBuf> = OnceLock::new();
    HOME.get_or_init(|| {
        let status = Command::new(env!("CARGO"))
            .args(["build", "-q", "-p", "dsec-agent"])
            .current_dir(workspace_root())
            .status()
            .unwrap();
        assert!(status.success(), "cargo build -p dsec-agent failed");
        let agent = Path::new(env!("CARGO_BIN_EXE_dsec-edge")).with_file_name("dsec-agent");
        let home = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("edge-test-home");
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

/// Pids whose command line or environment contains `text`.
pub fn procs_referencing(text: &str) -> Vec<i32> {
    dsec_edge::backend::pids_referencing(text.as_bytes())
}

/// Links an image installed on this host (`$DSEC_HOME/images/NAME`, e.g. setup.sh's debian)
/// into the test DSEC_HOME; fails the test, naming the command that builds it, when absent.
pub fn use_installed_image(name: &str) {
    let installed = dsec_edge::Artifacts::home().join("images").join(name);
    assert!(
        installed.is_dir(),
        "image {name} is not installed at {}: run setup.sh (or images/{name}/build.sh --install)",
        installed.display()
    );
    let link = dsec_home().join("images").join(name);
    if std::fs::read_link(&link).ok().as_deref() != Some(installed.as_path()) {
        let _ = std::fs::remove_file(&link);
        if let Err(e) = std::os::unix::fs::symlink(&installed, &link) {
            assert!(link.exists(), "link {}: {e}", link.display());
        }
    }
}

/// A dsec-edge with a private state dir, cgroup name and HTTP port.
pub struct Daemon {
    pub child: Child,
    pub tag: String,
    pub state: PathBuf,
    pub socket: String,
    pub http: SocketAddr,
    pub metrics: SocketAddr,
    /// Arguments after the fixed ones, kept for restarts.
    extra: Vec<String>,
    /// Environment variables set for the daemon, kept for restarts.
    env: Vec<(String, String)>,
}

impl Daemon {
    pub async fn start(name: &str, extra: &[&str]) -> (Self, Client) {
        Self::start_with_env(name, extra, &[]).await
    }

    /// [`Daemon::start`] with `env` added to the daemon's environment.
    pub async fn start_with_env(
        name: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> (Self, Client) {
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let tag = format!("dsec-edge-test-{}-{name}", std::process::id());
        let state = std::env::temp_dir().join(&tag);
        std::fs::create_dir_all(&state).unwrap();
        let free = || SocketAddr::from(([127, 0, 0, 1], free_port()));
        let (http, metrics) = (free(), free());
        let socket = format!("unix:{}", state.join("edge.sock").display());
        let child = Self::spawn(&state, &tag, http, metrics, extra, &env);
        let mut daemon = Self {
            child,
            tag,
            state,
            socket,
            http,
            metrics,
            extra: extra.iter().map(|s| s.to_string()).collect(),
            env,
        };
        let client = daemon.wait_ready().await;
        (daemon, client)
    }

    fn spawn(
        state: &Path,
        tag: &str,
        http: SocketAddr,
        metrics: SocketAddr,
        extra: &[impl AsRef<std::ffi::OsStr>],
        env: &[(String, String)],
    ) -> Child {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(state.with_extension("log"))
            .unwrap();
        Command::new(env!("CARGO_BIN_EXE_dsec-edge"))
            .arg("--state-dir")
            .arg(state)
            .args(["--metrics", &metrics.to_string()])
            .args(["--default-backend", "container"])
            .args(["--cgroup-name", tag, "--http", &http.to_string()])
            .args(extra)
            .env("DSEC_HOME", dsec_home())
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap()
    }

    async fn wait_ready(&mut self) -> Client {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(client) = Client::connect(&self.socket).await {
                if client.node_status().await.is_ok() {
                    return client;
                }
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("dsec-edge exited with {status}: see {}", self.log());
            }
            assert!(Instant::now() < deadline, "dsec-edge did not come up");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGKILLs the daemon (its sandboxes keep running) and waits for it.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts a new daemon on the same state dir, cgroup name and ports.
    pub async fn restart(&mut self) -> Client {
        self.child = Self::spawn(
            &self.state,
            &self.tag,
            self.http,
            self.metrics,
            &self.extra,
            &self.env,
        );
        self.wait_ready().await
    }

    /// Deletes every sandbox, checks that none of their directories is left, then stops
    /// the daemon (drop).
    pub async fn stop(mut self, client: Client) {
        for sb in client.list(Default::default()).await.unwrap() {
            client.delete(&sb.id).await.unwrap();
        }
        drop(client);
        let left: Vec<_> = std::fs::read_dir(self.state.join("sandboxes"))
            .map(|d| d.flatten().map(|e| e.file_name()).collect())
            .unwrap_or_default();
        assert!(left.is_empty(), "sandboxes left: {left:?}");
        // Stop it here, waiting asynchronously: the dropped client's connection closes on
        // this runtime, and the daemon finishes once its connections are closed.
        // SAFETY: kill(2) on the daemon we spawned; no memory is involved.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.child.try_wait().ok().flatten().is_none() {
            assert!(
                Instant::now() < deadline,
                "dsec-edge did not stop on SIGTERM"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_file()).unwrap_or_default()
    }

    /// The daemon's log (it outlives [`Self::stop`]).
    pub fn log_file(&self) -> PathBuf {
        self.state.with_extension("log")
    }

    /// `curl` against the HTTP entry point: (HTTP status, body).
    pub fn curl(&self, host: &str, path: &str, extra: &[&str]) -> (u32, Vec<u8>) {
        curl(None, self.http, host, path, extra)
    }

    /// The same request as host user `user` (e.g. nobody: any local user).
    pub fn curl_as(&self, user: &str, host: &str, path: &str) -> (u32, Vec<u8>) {
        curl(Some(user), self.http, host, path, &[])
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // Sandboxes outlive their daemon by design: delete them through it first.
        let socket = self.socket.clone();
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async {
                if let Ok(client) = Client::connect(&socket).await {
                    for sandbox in client.list(Default::default()).await.unwrap_or_default() {
                        let _ = client.delete(&sandbox.id).await;
                    }
                }
            });
        })
        .join();
        // SAFETY: kill(2) on the daemon we spawned; no memory is involved.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let sandboxes = format!("{}/sandboxes/", self.state.display());
        for pid in procs_referencing(&sandboxes) {
            // SAFETY: kill(2) on a process of a sandbox this test created.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        for hierarchy in std::fs::read_dir("/sys/fs/cgroup")
            .into_iter()
            .flatten()
            .flatten()
        {
            for base in [hierarchy.path(), PathBuf::from("/sys/fs/cgroup")] {
                let _ = remove_cgroup_named(&base, &self.tag, 6);
            }
        }
        let _ = std::fs::remove_dir_all(&self.state);
        let _ = std::fs::remove_file(self.state.with_extension("log"));
    }
}

/// GET `http://{http}{path}` with `Host: host` (as `user` when given): status and body.
fn curl(
    user: Option<&str>,
    http: SocketAddr,
    host: &str,
    path: &str,
    extra: &[&str],
) -> (u32, Vec<u8>) {
    let mut command = match user {
        Some(user) => {
            let mut c = Command::new("runuser");
            c.args(["-u", user, "--", "curl"]);
            c
        }
        None => Command::new("curl"),
    };
    let out = command
        .args(["-sS", "--max-time", "20", "-o", "-", "-w", "\n%{http_code}"])
        .args(["-H", &format!("Host: {host}")])
        .args(extra)
        .arg(format!("http://{http}{path}"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "curl {host}{path}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let split = out.stdout.iter().rposition(|b| *b == b'\n').unwrap();
    let code = std::str::from_utf8(&out.stdout[split + 1..])
        .unwrap()
        .parse()
        .unwrap();
    (code, out.stdout[..split].to_vec())
}

/// Removes (bottom-up) every cgroup directory called `name` below `dir`.
pub fn remove_cgroup_named(dir: &Path, name: &str, depth: u32) -> std::io::Result<()> {
    if depth == 0 {
        return Ok(());
    }
    for entry in std::fs::read_dir(dir)?.flatten() {
        let path = entry.path();
        if !entry.file_type().map(|t| t.is_dir()).unwrap_or(false) {
            continue;
        }
        if entry.file_name() == name {
            for child in std::fs::read_dir(&path)?.flatten() {
                if child.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                    let _ = std::fs::remove_dir(child.path());
                }
            }
            let _ = std::fs::remove_dir(&path);
        } else {
            let _ = remove_cgroup_named(&path, name, depth - 1);
        }
    }
    Ok(())
}

/// A free TCP port on loopback: bound and released, and never handed out twice in this
/// process (the kernel may give a just-released port again, and the tests of one binary
/// start their daemons at once: two of them would race for it).
pub fn free_port() -> u16 {
    static HANDED_OUT: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut handed_out = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        if !handed_out.contains(&port) {
            handed_out.push(port);
            return port;
        }
    }
}

/// A network policy allowing `allow` (rules or named policies).
pub fn policy(allow: &[&str]) -> dsec_sdk::NetworkPolicy {
    dsec_sdk::NetworkPolicy {
        allow: allow.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

/// Runs python `code` as a networked call (`network`, with `rules`) through `client`; its
/// stdout, once it exited 0 (the test fails otherwise, showing stdout and stderr).
pub async fn run_networked_python(
    client: &Client,
    code: String,
    network: bool,
    rules: Option<dsec_sdk::NetworkPolicy>,
) -> String {
    let response = client
        .run_code(dsec_sdk::FnRunRequest {
            code,
            language: "python".into(),
            run_timeout: 30.0,
            network,
            network_policy: rules,
            ..Default::default()
        })
        .await
        .expect("Fn.Run");
    let run = response.run.expect("a run stage");
    let out = String::from_utf8_lossy(&run.stdout).into_owned();
    assert_eq!(
        run.exit_code,
        Some(0),
        "{out}{}",
        String::from_utf8_lossy(&run.stderr)
    );
    out
}
