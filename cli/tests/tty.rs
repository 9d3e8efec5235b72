//! `dsec exec -i/-t` and `dsec shell` against a real node (`dsec up`, container backend),
//! run under a pseudo-terminal made by `script(1)` (util-linux), as a user at a terminal
//! would run them. Run as root: `cargo test -p dsec-cli --test tty`.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// DSEC_HOME with the busybox image; the agent is built next to `dsec`.
fn dsec_home() -> &'static Path {
    static HOME: OnceLock<PathBuf> = OnceLock::new();
    HOME.get_or_init(|| {
        let status = Command::new(env!("CARGO"))
            .args(["build", "-q", "-p", "dsec-agent"])
            .current_dir(workspace_root())
            .status()
            .unwrap();
        assert!(status.success(), "cargo build -p dsec-agent failed");
        let agent = Path::new(env!("CARGO_BIN_EXE_dsec")).with_file_name("dsec-agent");
        let home = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("tty-home");
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

/// `dsec up` on a private state dir and cgroup name with one sandbox; dropping it deletes
/// the sandbox, stops the daemon and removes everything it left.
struct Node {
    daemon: Child,
    dir: PathBuf,
    tag: String,
    id: String,
}

impl Node {
    fn start(name: &str) -> Self {
        let tag = format!("dsec-cli-tty-{}-{name}", std::process::id());
        let dir = std::env::temp_dir().join(&tag);
        std::fs::create_dir_all(&dir).unwrap();
        let log = std::fs::File::create(dir.join("edge.log")).unwrap();
        let daemon = Command::new(env!("CARGO_BIN_EXE_dsec"))
            .arg("up")
            .arg("--state-dir")
            .arg(dir.join("state"))
            .args(["--metrics", "off", "--default-backend", "container"])
            .args(["--cgroup-name", &tag])
            .env("DSEC_HOME", dsec_home())
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start dsec up");
        let mut node = Node {
            daemon,
            dir,
            tag,
            id: String::new(),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        let id = loop {
            let out = node
                .dsec()
                .args(["--json", "create", "--backend", "container"])
                .output()
                .unwrap();
            if out.status.success() {
                let doc = String::from_utf8_lossy(&out.stdout).into_owned();
                let start = doc.find("\"sb-").expect("an id in the create output") + 1;
                let len = doc[start..].find('"').unwrap();
                break doc[start..start + len].to_string();
            }
            assert!(
                Instant::now() < deadline,
                "no sandbox: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            std::thread::sleep(Duration::from_millis(100));
        };
        node.id = id;
        node
    }

    fn endpoint(&self) -> String {
        format!("unix:{}", self.dir.join("state/edge.sock").display())
    }

    fn dsec(&self) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_dsec"));
        c.env("DSEC_ENDPOINT", self.endpoint()).stdin(Stdio::null());
        c
    }

    /// Runs `shell` (sh syntax; `$DSEC` is the CLI, `$ID` the sandbox, `$DIR` a scratch
    /// dir) on a fresh pseudo-terminal, typing `keys` (each after its delay). Returns the
    /// terminal's output and the exit code of `shell`.
    fn in_pty(&self, shell: &str, keys: &[(u64, &[u8])]) -> (String, i32) {
        let mut child = Command::new("script")
            .args(["-qec", shell, "/dev/null"])
            .env("DSEC", env!("CARGO_BIN_EXE_dsec"))
            .env("DSEC_ENDPOINT", self.endpoint())
            .env("ID", &self.id)
            .env("DIR", &self.dir)
            .env("TERM", "xterm")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("run script(1) from util-linux");
        let mut stdout = child.stdout.take().unwrap();
        let reader = std::thread::spawn(move || {
            let mut out = Vec::new();
            let _ = stdout.read_to_end(&mut out);
            out
        });
        // Kept open until the end: script(1) may stop at EOF on its input.
        let mut stdin = child.stdin.take().unwrap();
        for (delay_ms, key) in keys {
            std::thread::sleep(Duration::from_millis(*delay_ms));
            let _ = stdin.write_all(key);
            let _ = stdin.flush();
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("{shell:?} did not finish");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        drop(stdin);
        let out = String::from_utf8_lossy(&reader.join().unwrap()).replace('\r', "");
        (out, status.code().unwrap_or(-1))
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if !self.id.is_empty() {
            let _ = self.dsec().args(["rm", &self.id]).output();
        }
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.daemon.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.daemon.try_wait().unwrap().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.daemon.kill();
        let _ = self.daemon.wait();
        remove_cgroups(Path::new("/sys/fs/cgroup"), &self.tag, 0);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The daemon leaves its parent cgroup `tag` behind (and, after a failure, sandboxes).
fn remove_cgroups(dir: &Path, tag: &str, depth: usize) {
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if !entry.file_type().map(|t| t.is_dir()).unwrap_or(false) {
            continue;
        }
        if entry.file_name() == tag {
            kill_and_remove(&entry.path());
        } else if depth < 8 {
            remove_cgroups(&entry.path(), tag, depth + 1);
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

#[test]
fn exec_it_runs_on_a_terminal_and_restores_ours() {
    let node = Node::start("it");

    // The remote side is a terminal of the local size; the exit code comes back; the local
    // terminal settings are the same afterwards.
    let (out, code) = node.in_pty(
        "stty rows 30 cols 90; stty -g > $DIR/before; \
         $DSEC exec -it $ID -- sh -c 'tty; stty size; test -t 0 && echo stdin-tty; exit 3'; \
         echo rc=$?; stty -g > $DIR/after",
        &[],
    );
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("/dev/pts/"), "{out}");
    assert!(out.contains("30 90\n"), "{out}");
    assert!(out.contains("stdin-tty\n"), "{out}");
    assert!(out.contains("rc=3\n"), "{out}");
    let before = std::fs::read(node.dir.join("before")).unwrap();
    assert_eq!(before, std::fs::read(node.dir.join("after")).unwrap());

    // Keys typed locally reach an interactive shell, whose exit code is ours.
    let (out, code) = node.in_pty(
        "$DSEC exec -it $ID -- sh",
        &[(500, b"echo typed-$((6*7))\n"), (300, b"exit 5\n")],
    );
    assert_eq!(code, 5, "{out}");
    assert!(out.contains("typed-42\n"), "{out}");

    // ^C interrupts the remote foreground command promptly.
    let started = Instant::now();
    let (out, code) = node.in_pty("$DSEC exec -it $ID -- sleep 30", &[(1000, b"\x03")]);
    assert_eq!(code, 130, "{out}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );

    // A local resize (SIGWINCH) reaches the command as its new size.
    let (out, code) = node.in_pty(
        "(sleep 1; stty rows 40 cols 100 < /dev/tty) & \
         $DSEC exec -it $ID -- sh -c 'trap \"stty size; exit 0\" WINCH; while :; do sleep 0.05; done'",
        &[],
    );
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("40 100\n"), "{out}");

    // Killed by SIGTERM while raw: the terminal is restored (it was raw meanwhile).
    let (out, code) = node.in_pty(
        "stty -g > $DIR/before; \
         $DSEC exec -it $ID -- sleep 30 < /dev/tty & pid=$!; \
         sleep 1; stty -g > $DIR/during; kill -TERM $pid; wait $pid; echo rc=$?; \
         stty -g > $DIR/after",
        &[],
    );
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("rc=143\n"), "{out}");
    let before = std::fs::read(node.dir.join("before")).unwrap();
    assert_ne!(
        before,
        std::fs::read(node.dir.join("during")).unwrap(),
        "never raw"
    );
    assert_eq!(before, std::fs::read(node.dir.join("after")).unwrap());

    // An error mid-way (the sandbox deleted under the command) also restores it.
    let (out, code) = node.in_pty(
        "stty -g > $DIR/before; \
         $DSEC exec -it $ID -- sleep 30 < /dev/tty & pid=$!; \
         sleep 1; $DSEC rm $ID >/dev/null; wait $pid; echo rc=$?; stty -g > $DIR/after",
        &[],
    );
    assert_eq!(code, 0, "{out}");
    assert!(!out.contains("rc=0\n"), "{out}");
    let before = std::fs::read(node.dir.join("before")).unwrap();
    assert_eq!(before, std::fs::read(node.dir.join("after")).unwrap());
}

#[test]
fn shell_and_flags() {
    let node = Node::start("shell");

    // `dsec shell` on a terminal: an interactive login shell (busybox has no bash).
    let (out, code) = node.in_pty(
        "$DSEC shell $ID",
        &[
            (500, b"test -t 0 && echo shell-$0-tty\n"),
            (300, b"exit 7\n"),
        ],
    );
    assert_eq!(code, 7, "{out}");
    assert!(out.contains("shell-/bin/sh-tty\n"), "{out}");

    // -t alone: a terminal without input; -i alone: live stdin without a terminal.
    let (out, code) = node.in_pty("$DSEC exec -t $ID -- sh -c 'tty; stty size'", &[]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("/dev/pts/"), "{out}");
    let mut child = node
        .dsec()
        .args(["exec", "-i", &node.id, "--", "sh", "-c", "cat; tty; exit 4"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"piped\n").unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(4));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "piped\nnot a tty\n");

    // -t without a terminal on stdin: a clear error, nothing run.
    let out = node
        .dsec()
        .args(["exec", "-t", &node.id, "--", "touch", "/tmp/ran"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(125));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("-t needs a terminal on stdin"), "{err}");
    let out = node
        .dsec()
        .args(["exec", &node.id, "--", "test", "-e", "/tmp/ran"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "the command ran anyway");

    // Without a terminal, `dsec shell` falls back to the line-fed session shell.
    let mut child = node
        .dsec()
        .args(["shell", &node.id])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"cd /tmp\npwd\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "/tmp\n");
}
