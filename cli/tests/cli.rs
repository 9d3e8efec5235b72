//! `dsec` as a user runs it (container backend; run as root).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
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
        assert!(agent.is_file(), "{} missing", agent.display());
        let home = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cli-home");
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

/// A private run directory per test, removed on drop.
struct RunDir(PathBuf);

impl RunDir {
    fn new(name: &str) -> Self {
        Self(std::env::temp_dir().join(format!("dsec-cli-test-{}-{name}", std::process::id())))
    }

    fn leftovers(&self) -> usize {
        std::fs::read_dir(self.0.join("sandboxes"))
            .map(|d| d.count())
            .unwrap_or(0)
    }

    fn dsec(&self) -> Command {
        let mut command = Command::new(env!("CARGO_BIN_EXE_dsec"));
        command
            .env("DSEC_HOME", dsec_home())
            .env("DSEC_RUN_DIR", &self.0)
            .stdin(Stdio::null());
        command
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn stderr_of(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn run_passes_exit_code_and_output() {
    let run = RunDir::new("exit");
    let out = run
        .dsec()
        .args(["run", "--", "sh", "-c", "uname -r; exit 7"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(7), "{}", stderr_of(&out));
    let host = Command::new("uname").arg("-r").output().unwrap();
    assert_eq!(
        out.stdout, host.stdout,
        "a container shares the host kernel"
    );
    assert!(
        stderr_of(&out).contains("using the container backend"),
        "{}",
        stderr_of(&out)
    );

    let out = run
        .dsec()
        .args([
            "run",
            "--backend",
            "container",
            "--",
            "sh",
            "-c",
            "kill -9 $$",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(137));
    assert_eq!(run.leftovers(), 0);
}

#[test]
fn run_forwards_stdin_env_and_workdir() {
    let run = RunDir::new("stdin");
    let mut child = run
        .dsec()
        .args([
            "run",
            "--env",
            "A=1",
            "-e",
            "B=two words",
            "--workdir",
            "/tmp",
            "--",
        ])
        .args(["sh", "-c", "cat; echo \"$A $B\"; pwd"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"piped input\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "piped input\n1 two words\n/tmp\n"
    );
}

#[test]
fn run_timeout_kills_and_says_so() {
    let run = RunDir::new("timeout");
    let started = Instant::now();
    let out = run
        .dsec()
        .args(["run", "--timeout", "0.5", "--", "sleep", "1000"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(137));
    assert!(stderr_of(&out).contains("timed out"), "{}", stderr_of(&out));
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(run.leftovers(), 0);
}

#[test]
fn bad_input_is_named() {
    let run = RunDir::new("bad");
    let cases: [(&[&str], &str); 6] = [
        (
            &["run", "--env", "NOEQUALS", "--", "true"],
            "expected KEY=VALUE",
        ),
        (
            &["run", "--vcpus", "0", "--", "true"],
            "vcpus must be at least 1",
        ),
        (
            &["run", "--mem", "99999999", "--", "true"],
            "more than this host has",
        ),
        (
            &["run", "--timeout", "0", "--", "true"],
            "--timeout must be a positive number",
        ),
        (
            &[
                "run",
                "--backend",
                "microvm",
                "--kernel",
                "/nonexistent/vmlinux",
                "--",
                "true",
            ],
            "guest kernel not found at /nonexistent/vmlinux",
        ),
        (
            &["run", "--", "no-such-cmd-xyz"],
            "command not found: no-such-cmd-xyz",
        ),
    ];
    for (args, expected) in cases {
        let out = run.dsec().args(args).output().unwrap();
        assert_eq!(
            out.status.code(),
            Some(125),
            "{args:?}: {}",
            stderr_of(&out)
        );
        assert!(
            stderr_of(&out).contains(expected),
            "{args:?}: {}",
            stderr_of(&out)
        );
    }
    assert_eq!(run.leftovers(), 0);
}

#[test]
fn ctrl_c_tears_the_sandbox_down() {
    let run = RunDir::new("sigint");
    let mut child = run
        .dsec()
        .args(["run", "--", "sh", "-c", "echo started; sleep 1000"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut first = [0u8; 8];
    std::io::Read::read_exact(&mut stdout, &mut first).unwrap();
    assert_eq!(&first, b"started\n");
    let started = Instant::now();
    let status = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(130));
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(run.leftovers(), 0, "sandbox left behind after Ctrl-C");
}

#[test]
fn info_json_describes_the_host() {
    let run = RunDir::new("info");
    let out = run.dsec().args(["info", "--json"]).output().unwrap();
    assert!(out.status.success(), "{}", stderr_of(&out));
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let kind = info["kvm"]["kind"].as_str().unwrap();
    assert!(["none", "pvm", "hardware"].contains(&kind), "{kind}");
    if kind != "hardware" {
        assert_eq!(info["microvm_available"], false);
        assert!(info["microvm_unavailable_reason"].as_str().is_some());
    }
    assert_eq!(info["rootfs"]["present"], true);
    assert_eq!(info["agent"]["version"], env!("CARGO_PKG_VERSION"));
    if Path::new("/sys/module/kvm_pvm").exists() {
        assert_eq!(kind, "pvm");
        assert_eq!(info["default_backend"], "container");
    }
}

#[test]
fn closed_stdout_ends_the_run_quietly() {
    let run = RunDir::new("epipe");
    let mut child = run
        .dsec()
        .args(["run", "--", "yes"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut first = [0u8; 4];
    std::io::Read::read_exact(&mut stdout, &mut first).unwrap();
    assert_eq!(&first, b"y\ny\n");
    drop(stdout);
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(141), "{}", stderr_of(&out));
    assert!(
        !stderr_of(&out).contains("Broken pipe"),
        "{}",
        stderr_of(&out)
    );
    assert_eq!(run.leftovers(), 0);
}

/// `dsec run --image debian` against the installed image (setup.sh builds it); the private
/// DSEC_HOME links to it.
#[test]
fn run_image_debian_in_a_container() {
    let installed = dsec_edge::Artifacts::from_env().image("debian");
    installed
        .check("debian", dsec_edge::BackendKind::Container)
        .unwrap_or_else(|e| panic!("{e}"));
    let link = dsec_home().join("images/debian");
    if !link.exists() {
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&installed.dir, &link).unwrap();
    }
    let run = RunDir::new("debian");
    let out = run
        .dsec()
        .args(["run", "--image", "debian", "--backend", "container", "--"])
        .args(["python3", "-c", "print(6*7)"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "42\n");
    // The default image stays busybox: no python3 there.
    let out = run
        .dsec()
        .args(["run", "--backend", "container", "--", "sh", "-c"])
        .arg("command -v python3 || echo none")
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "none\n");
    assert_eq!(run.leftovers(), 0);
}

#[test]
fn run_missing_image_names_the_setup_command() {
    let run = RunDir::new("noimage");
    let empty_home = run.0.join("empty-home");
    for (image, hint) in [
        ("debian", "images/debian/build.sh --install"),
        ("busybox", "guest-agent/mkinitramfs.sh --install"),
    ] {
        let out = run
            .dsec()
            .env("DSEC_HOME", &empty_home)
            .args([
                "run",
                "--image",
                image,
                "--backend",
                "container",
                "--",
                "true",
            ])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(125));
        let err = stderr_of(&out);
        assert!(
            err.contains(&format!("image \"{image}\" is not installed")),
            "{err}"
        );
        assert!(err.contains(hint), "{err}");
    }
    let out = run
        .dsec()
        .args(["run", "--image", "../etc", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(125));
    assert!(
        stderr_of(&out).contains("is invalid"),
        "{}",
        stderr_of(&out)
    );
    assert_eq!(run.leftovers(), 0);
}
