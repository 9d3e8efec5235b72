//! `dsec` as a user runs it (container backend; run as root).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::dsec_home;

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
fn run_containers_get_memory_and_pid_limits() {
    let run = RunDir::new("limits");
    // 300 MB held by the shell in a sandbox of 64 MiB memory + a 16 MiB disk: OOM-killed.
    let out = run
        .dsec()
        .args([
            "run",
            "--backend",
            "container",
            "--mem",
            "64",
            "--disk",
            "16",
            "--",
        ])
        .args([
            "sh",
            "-c",
            "x=$(head -c 300000000 /dev/zero | tr '\\0' a); echo ${#x}",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(137), "{}", stderr_of(&out));
    // The pid limit: 40 background sleepers fit under --pids 64 but not under --pids 16.
    let sleepers = |pids: &str| {
        run.dsec()
            .args(["run", "--backend", "container", "--pids", pids, "--"])
            .args([
                "sh",
                "-c",
                "for i in $(seq 40); do sleep 3 & done; echo started",
            ])
            .output()
            .unwrap()
    };
    let out = sleepers("64");
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let out = sleepers("16");
    assert_ne!(out.status.code(), Some(0), "40 processes under --pids 16");
    assert!(stderr_of(&out).contains("fork"), "{}", stderr_of(&out));
    // `dsec inspect` shows a running `dsec run` sandbox's limits.
    let mut running = run
        .dsec()
        .args([
            "run",
            "--backend",
            "container",
            "--mem",
            "96",
            "--disk",
            "32",
        ])
        .args(["--pids", "77", "--", "sleep", "30"])
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let record = loop {
        let id = std::fs::read_dir(run.0.join("sandboxes"))
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .next();
        if let Some(id) = id {
            let out = run.dsec().args(["inspect", &id]).output().unwrap();
            if out.status.success() {
                break serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap();
            }
        }
        assert!(Instant::now() < deadline, "no run record");
        std::thread::sleep(Duration::from_millis(50));
    };
    // SAFETY: kill(2) on the child we spawned; ^C makes `dsec run` tear its sandbox down.
    unsafe { libc::kill(running.id() as i32, libc::SIGINT) };
    running.wait().unwrap();
    assert_eq!(record["pids_limit"], 77, "{record}");
    assert_eq!(record["memory_limit_bytes"], (96 + 32) << 20, "{record}");
    assert!(
        record["host_id_range"]["base"].as_u64().unwrap() >= 65536,
        "{record}"
    );
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
fn printing_commands_end_quietly_when_their_reader_goes_away() {
    use std::os::unix::process::ExitStatusExt;
    let run = RunDir::new("sigpipe");
    // stdout is a pipe whose read end is already closed: the first write hits EPIPE.
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = run
        .dsec()
        .args(["info", "--json"])
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    assert_eq!(out.status.signal(), Some(libc::SIGPIPE), "{:?}", out.status);
    assert!(out.stderr.is_empty(), "{}", stderr_of(&out));
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

/// `dsec up` on a private run directory, HTTP entry point on a free port; on drop every
/// sandbox is deleted through it, then it is stopped and its cgroups removed.
struct NodeUp {
    run: RunDir,
    daemon: std::process::Child,
    tag: String,
}

impl NodeUp {
    fn start(name: &str) -> Self {
        Self::start_with(name, &[])
    }

    /// [`NodeUp::start`] with more `dsec up` arguments.
    fn start_with(name: &str, extra: &[&str]) -> Self {
        let run = RunDir::new(name);
        let tag = format!("dsec-cli-test-{}-{name}", std::process::id());
        let daemon = run
            .dsec()
            .args(["up", "--metrics", "off", "--http", "127.0.0.1:0"])
            .args(["--default-backend", "container", "--cgroup-name", &tag])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let node = Self { run, daemon, tag };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !node.dsec().args(["ls"]).output().unwrap().status.success() {
            assert!(Instant::now() < deadline, "dsec up did not come up");
            std::thread::sleep(Duration::from_millis(50));
        }
        node
    }

    fn dsec(&self) -> Command {
        let mut command = self.run.dsec();
        let socket = self.run.0.join("edge/edge.sock");
        command.env("DSEC_ENDPOINT", format!("unix:{}", socket.display()));
        command
    }

    fn ok(&self, args: &[&str]) -> String {
        let out = self.dsec().args(args).output().unwrap();
        assert!(out.status.success(), "{args:?}: {}", stderr_of(&out));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for NodeUp {
    fn drop(&mut self) {
        if let Ok(out) = self.dsec().args(["--json", "ls"]).output() {
            for line in String::from_utf8_lossy(&out.stdout).lines() {
                if let Ok(v) = serde_json::from_str::<serde_json::Value>(line) {
                    let ids: Vec<String> = match v.as_array() {
                        Some(list) => list
                            .iter()
                            .filter_map(|s| s["id"].as_str().map(String::from))
                            .collect(),
                        None => v["id"].as_str().map(String::from).into_iter().collect(),
                    };
                    for id in ids {
                        let _ = self.dsec().args(["rm", &id]).output();
                    }
                }
            }
        }
        let _ = Command::new("kill")
            .args(["-TERM", &self.daemon.id().to_string()])
            .status();
        let _ = self.daemon.wait();
        for base in [
            "/sys/fs/cgroup",
            "/sys/fs/cgroup/pids",
            "/sys/fs/cgroup/memory",
        ] {
            let _ = Command::new("find")
                .args([base, "-depth", "-type", "d", "-path"])
                .arg(format!("*/{}*", self.tag))
                .args(["-delete"])
                .stderr(Stdio::null())
                .status();
        }
    }
}

#[test]
fn url_and_port_forward_reach_a_server_in_the_sandbox() {
    let node = NodeUp::start("ports");
    let id = node
        .ok(&["create", "--backend", "container"])
        .trim()
        .to_string();
    node.ok(&[
        "exec",
        &id,
        "--",
        "sh",
        "-c",
        "mkdir -p /www && echo hello from the sandbox > /www/index.html && busybox httpd -p 127.0.0.1:8080 -h /www",
    ]);

    // `dsec inspect` shows the access token and the effective memory limit (256 MiB of
    // memory + the 1024 MiB tmpfs disk charged to it).
    let info: serde_json::Value = serde_json::from_str(&node.ok(&["inspect", &id])).unwrap();
    let token = info["access_token"].as_str().unwrap().to_string();
    assert_eq!(token.len(), 32, "{info}");
    assert_eq!(info["memory_limit_bytes"], 1280u64 << 20, "{info}");

    // `dsec url` prints a URL curl can fetch as-is: it carries the token.
    let url = node.ok(&["url", &id, "8080"]).trim().to_string();
    assert!(
        url.starts_with(&format!("http://8080-{id}-{token}.localhost:")),
        "{url}"
    );
    let fetch = |url: &str| {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let out = Command::new("curl")
                .args(["-sS", "--fail", "--max-time", "10", url])
                .output()
                .unwrap();
            if out.status.success() || Instant::now() > deadline {
                return String::from_utf8_lossy(&out.stdout).into_owned();
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    assert_eq!(
        fetch(&format!("{url}index.html")),
        "hello from the sandbox\n"
    );
    // Without the token: refused until `dsec port-public` opens the port.
    let plain = url.replace(&format!("-{token}"), "");
    let status = |url: &str| {
        let out = Command::new("curl")
            .args([
                "-sS",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                "--max-time",
                "10",
            ])
            .arg(url)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    assert_eq!(status(&format!("{plain}index.html")), "401");
    node.ok(&["port-public", &id, "8080"]);
    assert_eq!(status(&format!("{plain}index.html")), "200");
    assert_eq!(node.ok(&["url", &id, "8080"]).trim(), plain);
    node.ok(&["port-public", &id, "8080", "--private"]);
    assert_eq!(status(&format!("{plain}index.html")), "401");

    // `dsec port-forward` on a free local port.
    let mut forward = node
        .dsec()
        .args(["port-forward", &id, "8080", "--listen", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(forward.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    let local = line
        .strip_prefix("forwarding ")
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_string();
    assert!(line.contains(&format!("-> {id}:8080")), "{line}");
    for _ in 0..3 {
        assert_eq!(
            fetch(&format!("http://{local}/index.html")),
            "hello from the sandbox\n"
        );
    }
    let _ = Command::new("kill")
        .args(["-INT", &forward.id().to_string()])
        .status();
    let status = forward.wait().unwrap();
    assert_eq!(status.code(), Some(0));

    // Bad input is named.
    for (args, expected) in [
        (vec!["url", &id, "0"], "give 1-65535"),
        (vec!["url", "sb-000000000000", "80"], "no sandbox"),
        (vec!["port-forward", &id, "70000"], "give 1-65535"),
        (vec!["port-forward", "sb-000000000000", "80"], "no sandbox"),
        (
            vec!["port-forward", &id, "80", "--listen", "nonsense"],
            "expected HOST:PORT",
        ),
    ] {
        let out = node.dsec().args(&args).output().unwrap();
        assert_eq!(out.status.code(), Some(125), "{args:?}");
        assert!(
            stderr_of(&out).contains(expected),
            "{args:?}: {}",
            stderr_of(&out)
        );
    }
    node.ok(&["rm", &id]);
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
            err.contains(&format!(
                "image \"{image}\" not found for the container backend"
            )),
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

#[test]
fn create_takes_network_policy_flags() {
    // A node without a sandbox network refuses any policy it cannot enforce: the flags
    // reach the request.
    let plain = NodeUp::start("netflags");
    for flags in [
        &["--allow", "tcp:198.51.100.0/24:443"][..],
        &["--internet"],
        &["--deny", "198.51.100.7"],
    ] {
        let out = plain
            .dsec()
            .args(["create", "--backend", "container"])
            .args(flags)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{flags:?} was accepted");
        assert!(
            stderr_of(&out).contains("network egress needs"),
            "{flags:?}: {}",
            stderr_of(&out)
        );
    }
    plain.ok(&["create", "--backend", "container"]);
    drop(plain);

    // With one, the sandbox's sets hold the rules.
    let bridge = format!("dscli{}", std::process::id() % 100_000);
    let node = NodeUp::start_with("netflags2", &["--net-bridge", &bridge]);
    let id = node
        .ok(&[
            "create",
            "--backend",
            "container",
            "--allow",
            "tcp:198.51.100.0/24:443",
            "--deny",
            "tcp:198.51.100.7",
        ])
        .trim()
        .to_string();
    let inet = node.ok(&["exec", &id, "--", "ip", "-4", "addr", "show", "dev", "eth0"]);
    let addr: std::net::Ipv4Addr = inet
        .split_whitespace()
        .skip_while(|w| *w != "inet")
        .nth(1)
        .and_then(|a| a.split('/').next())
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("no address: {inet}"));
    // The node's sets hold each sandbox's rules behind its address.
    let set = |kind: &str| {
        let out = Command::new("nft")
            .args(["list", "set", "inet", &bridge, kind])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    assert!(
        set("allow").contains(&format!("{addr} . 198.51.100.0/24 . tcp . 443")),
        "{}",
        set("allow")
    );
    assert!(
        set("deny").contains(&format!("{addr} . 198.51.100.7 . tcp")),
        "{}",
        set("deny")
    );
}
