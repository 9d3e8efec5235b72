//! `dsec exec` and `dsec cp` move big data in bounded memory: each test runs the CLI against a
//! real node (`dsec up`, container backend, private run directory and cgroup name) and reads
//! the CLI's peak RSS from wait4(2). Run as root: `cargo test -p dsec-cli --test streaming`.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::dsec_home;

/// Peak RSS allowed to the CLI while it moves hundreds of MB.
const RSS_BOUND_KIB: i64 = 64 << 10;

/// `dsec up` on a private run directory and cgroup name, with one container sandbox; on
/// drop the sandbox is deleted, the daemon stopped, its cgroups and directories removed.
struct Node {
    daemon: Child,
    dir: PathBuf,
    tag: String,
    id: String,
}

impl Node {
    fn start(name: &str) -> Self {
        let tag = format!("dsec-cli-stream-{}-{name}", std::process::id());
        let dir = std::env::temp_dir().join(&tag);
        std::fs::create_dir_all(dir.join("run")).unwrap();
        let log = std::fs::File::create(dir.join("edge.log")).unwrap();
        let daemon = Command::new(env!("CARGO_BIN_EXE_dsec"))
            .args(["up", "--metrics", "off", "--default-backend", "container"])
            .args(["--cgroup-name", &tag])
            .env("DSEC_HOME", dsec_home())
            .env("DSEC_RUN_DIR", dir.join("run"))
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
        node.id = loop {
            let out = node
                .dsec()
                .args(["create", "--backend", "container"])
                .output()
                .unwrap();
            if out.status.success() {
                break String::from_utf8(out.stdout).unwrap().trim().to_string();
            }
            assert!(
                Instant::now() < deadline,
                "no sandbox: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            std::thread::sleep(Duration::from_millis(100));
        };
        node
    }

    fn dsec(&self) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_dsec"));
        let socket = self.dir.join("run/edge/edge.sock");
        c.env("DSEC_ENDPOINT", format!("unix:{}", socket.display()))
            .stdin(Stdio::null());
        c
    }

    /// Runs `dsec ARGS` to success and returns its stdout.
    fn ok(&self, args: &[&str]) -> String {
        let out = self.dsec().args(args).output().unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
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

/// How a child ended and its peak RSS (KiB): `max_rss_kib` from wait4(2) is a sound upper
/// bound (Linux folds the spawning process's own peak into it, this test process's few MiB),
/// `hwm_kib` the child's own high-water mark (VmHWM) last sampled before it exited.
struct Ended {
    code: Option<i32>,
    max_rss_kib: i64,
    hwm_kib: i64,
}

fn vm_hwm_kib(pid: libc::pid_t) -> Option<i64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn wait_rusage(child: Child, limit: Duration) -> Ended {
    let pid = child.id() as libc::pid_t;
    // Reaped here, not through `Child`: dropping a `Child` neither waits nor kills.
    drop(child);
    let deadline = Instant::now() + limit;
    let mut status = 0;
    // SAFETY: all-zero is a valid `rusage`, which wait4 fills in.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let mut hwm_kib = 0;
    loop {
        hwm_kib = hwm_kib.max(vm_hwm_kib(pid).unwrap_or(0));
        // SAFETY: `status` and `usage` are valid, exclusively borrowed out-parameters.
        let rc = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut usage) };
        assert!(rc >= 0, "wait4: {}", std::io::Error::last_os_error());
        if rc == pid {
            break;
        }
        if Instant::now() > deadline {
            // SAFETY: plain kill(2) of our own unreaped child.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("pid {pid} did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ended {
        code: libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status)),
        max_rss_kib: usage.ru_maxrss,
        hwm_kib,
    }
}

/// Counts what a pipe carries until EOF (keeping nothing), on a thread.
fn count_bytes(mut pipe: impl Read + Send + 'static) -> std::thread::JoinHandle<(u64, bool)> {
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 1 << 20];
        let (mut total, mut zeros) = (0u64, true);
        loop {
            match pipe.read(&mut buf) {
                Ok(0) | Err(_) => return (total, zeros),
                Ok(n) => {
                    zeros &= buf[..n].iter().all(|b| *b == 0);
                    total += n as u64;
                }
            }
        }
    })
}

/// Writes `len` zero bytes into a pipe, on a thread.
fn feed_zeros(mut pipe: impl Write + Send + 'static, len: u64) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let buf = vec![0u8; 1 << 20];
        let mut left = len;
        while left > 0 {
            let n = left.min(buf.len() as u64) as usize;
            if pipe.write_all(&buf[..n]).is_err() {
                return;
            }
            left -= n as u64;
        }
    })
}

#[test]
fn exec_streams_output_and_stdin_in_bounded_memory() {
    let node = Node::start("exec");
    let id = node.id.clone();

    // 400 MB on stdout and 100 MB on stderr: all of it arrives, the CLI's memory stays put.
    let mut child = node
        .dsec()
        .args(["exec", &id, "--", "sh", "-c"])
        .arg("head -c 400000000 /dev/zero; head -c 100000000 /dev/zero >&2; exit 3")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = count_bytes(child.stdout.take().unwrap());
    let stderr = count_bytes(child.stderr.take().unwrap());
    let ended = wait_rusage(child, Duration::from_secs(60));
    assert_eq!(stdout.join().unwrap(), (400_000_000, true));
    assert_eq!(stderr.join().unwrap(), (100_000_000, true));
    assert_eq!(ended.code, Some(3));
    println!(
        "dsec exec, 500 MB of output: peak RSS {} KiB (own VmHWM {} KiB)",
        ended.max_rss_kib, ended.hwm_kib
    );
    assert!(ended.max_rss_kib < RSS_BOUND_KIB, "{}", ended.max_rss_kib);

    // 300 MB into the command's stdin, streamed as it reads.
    let mut child = node
        .dsec()
        .args(["exec", &id, "--", "wc", "-c"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let feeder = feed_zeros(child.stdin.take().unwrap(), 300_000_000);
    let mut stdout = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut out = String::new();
        stdout.read_to_string(&mut out).map(|_| out)
    });
    let ended = wait_rusage(child, Duration::from_secs(60));
    feeder.join().unwrap();
    let out = reader.join().unwrap().unwrap();
    assert_eq!(out.trim(), "300000000");
    assert_eq!(ended.code, Some(0));
    println!(
        "dsec exec, 300 MB of stdin: peak RSS {} KiB (own VmHWM {} KiB)",
        ended.max_rss_kib, ended.hwm_kib
    );
    assert!(ended.max_rss_kib < RSS_BOUND_KIB, "{}", ended.max_rss_kib);

    // --json keeps the last 1 MiB of each stream and counts all of it.
    let child = node
        .dsec()
        .args(["--json", "exec", &id, "--", "sh", "-c"])
        .arg("yes | head -c 50000000; echo END; echo oops >&2")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let text = doc["stdout"].as_str().unwrap();
    assert_eq!(text.len(), 1 << 20);
    assert!(
        text.ends_with("y\ny\nEND\n"),
        "{}",
        &text[text.len() - 10..]
    );
    assert_eq!(doc["stdout_bytes"], 50_000_004);
    assert_eq!(doc["stderr"], "oops\n");
    assert_eq!(doc["stderr_bytes"], 5);
    assert_eq!(doc["truncated"], true);
    assert_eq!(doc["exit_code"], 0);

    // A reader that goes away ends `dsec exec` (141, like a shell pipeline) and the command.
    let mut child = node
        .dsec()
        .args(["exec", &id, "--", "yes"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = [0u8; 4];
    child.stdout.take().unwrap().read_exact(&mut first).unwrap();
    assert_eq!(&first, b"y\ny\n");
    let ended = wait_rusage(child, Duration::from_secs(20));
    assert_eq!(ended.code, Some(141));
    let deadline = Instant::now() + Duration::from_secs(10);
    let yes_runs = || {
        let script = "cat /proc/[0-9]*/comm | grep -x yes || true";
        !node.ok(&["exec", &id, "--", "sh", "-c", script]).is_empty()
    };
    while yes_runs() {
        assert!(Instant::now() < deadline, "`yes` still runs in the sandbox");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Writes `len` bytes of a position-dependent pattern to `path` (no two MiB alike).
fn write_pattern(path: &Path, len: usize) {
    let mut file = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    let mut block = vec![0u8; 1 << 20];
    let mut written = 0;
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    while written < len {
        for b in block.iter_mut() {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            *b = seed as u8;
        }
        let n = block.len().min(len - written);
        file.write_all(&block[..n]).unwrap();
        written += n;
    }
    file.flush().unwrap();
}

/// Whether two files hold the same bytes (compared in chunks).
fn same_content(a: &Path, b: &Path) -> bool {
    let (mut a, mut b) = (
        std::fs::File::open(a).unwrap(),
        std::fs::File::open(b).unwrap(),
    );
    let (mut x, mut y) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
    loop {
        let n = a.read(&mut x).unwrap();
        if n == 0 {
            return b.read(&mut y).unwrap() == 0;
        }
        if b.read_exact(&mut y[..n]).is_err() || x[..n] != y[..n] {
            return false;
        }
    }
}

fn md5(path: &Path) -> String {
    let out = Command::new("md5sum").arg(path).output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

/// `mode kind [target]` of every entry under `root`, sorted (host side).
fn host_tree(root: &Path) -> Vec<String> {
    use std::os::unix::fs::PermissionsExt;
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            let rel = path.strip_prefix(root).unwrap().display().to_string();
            let mode = meta.permissions().mode() & 0o7777;
            let line = if meta.file_type().is_symlink() {
                let target = std::fs::read_link(&path).unwrap();
                format!("{rel} link {}", target.display())
            } else if meta.is_dir() {
                stack.push(path.clone());
                format!("{rel} dir {mode:o}")
            } else {
                format!(
                    "{rel} file {mode:o} {}",
                    std::fs::read(&path).unwrap().len()
                )
            };
            out.push(line);
        }
    }
    out.sort();
    out
}

#[test]
fn cp_streams_files_and_copies_trees_without_following_symlinks() {
    let node = Node::start("cp");
    let id = node.id.clone();

    // A 200 MB file up and back down: same bytes, the CLI's memory stays put both ways.
    let big = node.dir.join("big");
    write_pattern(&big, 200_000_000);
    let remote = format!("{id}:/tmp/big");
    for (src, dst, what) in [
        (big.to_str().unwrap(), remote.as_str(), "upload"),
        (
            remote.as_str(),
            node.dir.join("back").to_str().unwrap(),
            "download",
        ),
    ] {
        let child = node
            .dsec()
            .args(["cp", src, dst])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let ended = wait_rusage(child, Duration::from_secs(60));
        assert_eq!(ended.code, Some(0), "{what}");
        println!(
            "dsec cp, 200 MB {what}: peak RSS {} KiB (own VmHWM {} KiB)",
            ended.max_rss_kib, ended.hwm_kib
        );
        assert!(
            ended.max_rss_kib < RSS_BOUND_KIB,
            "{what}: {}",
            ended.max_rss_kib
        );
    }
    let in_sandbox = node.ok(&["exec", &id, "--", "md5sum", "/tmp/big"]);
    assert_eq!(in_sandbox.split_whitespace().next().unwrap(), md5(&big));
    assert!(same_content(&big, &node.dir.join("back")));
    node.ok(&["exec", &id, "--", "rm", "/tmp/big"]);

    // A tree with modes and symlinks (one out of the tree, one up it) goes up with -r: modes
    // kept, symlinks copied as symlinks, not followed.
    let src = node.dir.join("src");
    std::fs::create_dir_all(src.join("a/b")).unwrap();
    std::fs::write(src.join("a/b/f"), "hi\n").unwrap();
    std::fs::write(src.join("exe"), "#!/bin/sh\n").unwrap();
    std::os::unix::fs::symlink("/etc", src.join("out")).unwrap();
    std::os::unix::fs::symlink("../..", src.join("a/up")).unwrap();
    for (path, mode) in [("a/b/f", 0o640), ("exe", 0o777), ("a", 0o711)] {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(src.join(path), std::fs::Permissions::from_mode(mode)).unwrap();
    }
    let src_arg = src.to_str().unwrap();
    let out = node
        .dsec()
        .args(["cp", src_arg, &format!("{id}:/tmp/up")])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(125));
    assert!(String::from_utf8_lossy(&out.stderr).contains("use -r"));
    node.ok(&["cp", "-r", src_arg, &format!("{id}:/tmp/up")]);
    let listing = node.ok(&[
        "exec",
        &id,
        "--",
        "sh",
        "-c",
        "cd /tmp/up && find . | sort | while read f; do echo \"$f $(stat -c %a \"$f\") $(readlink \"$f\")\"; done",
    ]);
    assert_eq!(
        listing,
        ". 755 \n./a 711 \n./a/b 755 \n./a/b/f 640 \n./a/up 777 ../..\n./exe 777 \n./out 777 /etc\n"
    );

    // Down again into an existing directory: the same tree under its own name.
    let down = node.dir.join("down");
    std::fs::create_dir(&down).unwrap();
    node.ok(&["cp", "-r", &format!("{id}:/tmp/up"), down.to_str().unwrap()]);
    assert_eq!(host_tree(&down.join("up")), host_tree(&src));

    // Symlinks made in the sandbox cannot make `dsec cp` write outside the destination:
    // one pointing at a host directory is copied as a link, and a directory of the sandbox
    // meeting a symlink already in the destination is refused.
    let victim = node.dir.join("victim");
    std::fs::create_dir(&victim).unwrap();
    let script = format!(
        "mkdir -p /tmp/evil/trap && echo pwn > /tmp/evil/trap/pwn && ln -s {} /tmp/evil/esc && ln -s {} /tmp/evil/trap2",
        victim.display(),
        victim.display(),
    );
    node.ok(&["exec", &id, "--", "sh", "-c", &script]);
    node.ok(&[
        "cp",
        "-r",
        &format!("{id}:/tmp/evil"),
        node.dir.join("got").to_str().unwrap(),
    ]);
    assert_eq!(
        host_tree(&node.dir.join("got")),
        [
            format!("esc link {}", victim.display()),
            "trap dir 755".to_string(),
            "trap/pwn file 644 4".to_string(),
            format!("trap2 link {}", victim.display()),
        ]
    );
    let planted = node.dir.join("planted");
    std::fs::create_dir(&planted).unwrap();
    std::os::unix::fs::symlink(&victim, planted.join("trap")).unwrap();
    let out = node
        .dsec()
        .args([
            "cp",
            "-r",
            &format!("{id}:/tmp/evil/."),
            planted.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(125));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("refusing to copy into"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A file over a planted symlink is refused too.
    std::fs::create_dir(planted.join("x")).unwrap();
    std::os::unix::fs::symlink(victim.join("pwn"), planted.join("x/pwn")).unwrap();
    let out = node
        .dsec()
        .args([
            "cp",
            "-r",
            &format!("{id}:/tmp/evil/trap/."),
            planted.join("x").to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(125));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("it is a symlink"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        std::fs::read_dir(&victim).unwrap().count(),
        0,
        "wrote outside"
    );
}
