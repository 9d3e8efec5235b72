//! The agent's VM mode (PID 1: mounts, hostname, loopback, orphan reaping, poweroff), run as
//! PID 1 of fresh PID/mount/UTS/net/IPC namespaces so nothing leaks onto the host. In a real
//! VM the same code serves over vsock (tested in the rig).

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use dsec_edge::{AgentAddr, AgentClient, ExecSpec};

async fn connect(socket: &std::path::Path) -> Option<AgentClient> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if socket.exists() {
            if let Ok(client) = AgentClient::connect(AgentAddr::Unix(socket.to_path_buf())).await {
                if client.info().await.is_ok() {
                    return Some(client);
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    None
}

/// Kills the namespace (unshare --kill-child takes the agent along) and removes the dir,
/// also when an assertion fails.
struct Pid1Agent {
    child: std::process::Child,
    dir: PathBuf,
}

impl Drop for Pid1Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[tokio::test]
async fn agent_as_pid1_sets_up_reaps_and_powers_off() {
    // Not under /tmp or /run: PID 1 mounts fresh tmpfs there (and the repo itself may
    // live under /tmp, as in CI's clone).
    let dir = PathBuf::from("/var/tmp").join(format!("dsec-pid1-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let socket = dir.join("agent.sock");
    let child = Command::new("unshare")
        .args([
            "--pid",
            "--fork",
            "--mount",
            "--uts",
            "--net",
            "--ipc",
            "--kill-child",
        ])
        .arg(env!("CARGO_BIN_EXE_dsec-agent"))
        .arg("--listen")
        .arg(format!("unix:{}", socket.display()))
        .stdin(Stdio::null())
        .spawn()
        .expect("run unshare (util-linux)");
    let mut agent = Pid1Agent { child, dir };
    let client = connect(&socket)
        .await
        .expect("agent as PID 1 did not answer");

    let info = client.info().await.unwrap();
    assert_eq!(info.mode, "vm");
    assert_eq!(info.hostname, "dsec");
    // A restored or booted sandbox is then named after its id (no clock: the host's is shared).
    dsec_api::agent::v1::agent_client::AgentClient::new(client.channel())
        .refresh(dsec_api::agent::v1::RefreshRequest {
            hostname: "sb-pid1".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(client.info().await.unwrap().hostname, "sb-pid1");
    // The sandbox's env from a refresh: every exec starts with it, its own env wins; a bad
    // one is refused and changes nothing.
    let refresh_env = |vars: &[(&str, &str)]| dsec_api::agent::v1::RefreshRequest {
        env: Some(dsec_api::agent::v1::SandboxEnv {
            vars: vars
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        }),
        ..Default::default()
    };
    let mut rpc = dsec_api::agent::v1::agent_client::AgentClient::new(client.channel());
    let refreshed = rpc
        .refresh(refresh_env(&[("FROM_CREATE", "one"), ("BOTH", "sandbox")]))
        .await
        .unwrap();
    assert!(refreshed.into_inner().env_set);
    assert!(rpc
        .refresh(refresh_env(&[("BAD=NAME", "x")]))
        .await
        .is_err());
    let mut spec = ExecSpec::new(["sh", "-c", "echo $FROM_CREATE-$BOTH"]);
    spec.env.insert("BOTH".into(), "exec".into());
    let out = client.exec_collect(&spec, None).await.unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "one-exec");
    rpc.refresh(refresh_env(&[])).await.unwrap();
    let out = client
        .exec_collect(&ExecSpec::new(["sh", "-c", "echo x$FROM_CREATE"]), None)
        .await
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "x");

    let script = "cat /proc/1/comm; for m in '/dev devtmpfs' '/tmp tmpfs' '/run tmpfs' '/proc proc'; do \
                  cut -d' ' -f2,3 /proc/mounts | grep -qx \"$m\" || echo \"missing $m\"; done; echo mounts-checked; \
                  cat /sys/class/net/lo/operstate; sleep 0.2 & exit 4";
    let out = client
        .exec_collect(&ExecSpec::new(["sh", "-c", script]), None)
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(out.outcome.code, Some(4), "{stdout}");
    assert_eq!(lines[0], "dsec-agent");
    assert_eq!(lines[1], "mounts-checked", "{stdout}");
    assert_ne!(lines[2], "down", "lo not up");

    // The orphaned sleep is reaped by PID 1 (no zombies left after it ends).
    tokio::time::sleep(Duration::from_millis(400)).await;
    let out = client
        .exec_collect(
            &ExecSpec::new([
                "sh",
                "-c",
                "grep -l '^State:.*Z' /proc/[0-9]*/status | wc -l",
            ]),
            None,
        )
        .await
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "0",
        "zombies under PID 1"
    );

    // PTY exec on VM mode's own devpts (the same code path as in a microVM).
    let start = dsec_api::agent::v1::ExecStart {
        argv: vec!["sh".into(), "-c".into(), "tty; stty size; test -t 0".into()],
        pty: Some(dsec_api::agent::v1::PtyConfig {
            rows: 9,
            cols: 21,
            term: String::new(),
        }),
        ..Default::default()
    };
    let first = dsec_api::agent::v1::ExecRequest {
        kind: Some(dsec_api::agent::v1::exec_request::Kind::Start(start)),
    };
    let mut stream = dsec_api::agent::v1::process_client::ProcessClient::new(client.channel())
        .exec(tokio_stream::iter([first]))
        .await
        .unwrap()
        .into_inner();
    let (mut tty_out, mut code) = (Vec::new(), None);
    while let Some(message) = stream.message().await.unwrap() {
        match message.kind {
            Some(dsec_api::agent::v1::exec_response::Kind::Stdout(d)) => tty_out.extend(d),
            Some(dsec_api::agent::v1::exec_response::Kind::Exit(e)) => code = e.code,
            _ => {}
        }
    }
    let tty_text = String::from_utf8_lossy(&tty_out).replace('\r', "");
    assert_eq!(code, Some(0), "{tty_text}");
    assert!(tty_text.starts_with("/dev/pts/"), "{tty_text}");
    assert!(tty_text.contains("\n9 21\n"), "{tty_text}");

    client.shutdown().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    let exited = loop {
        if let Some(status) = agent.child.try_wait().unwrap() {
            break Some(status);
        }
        if Instant::now() > deadline {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(exited.is_some(), "PID 1 did not power off on Shutdown");
}

/// Removes a directory on drop, also when an assertion fails.
struct RemoveDir(PathBuf);

impl Drop for RemoveDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A loop device over a file, detached on drop (deferred by the kernel while still mounted).
struct Loop(String);

impl Loop {
    fn attach(file: &std::path::Path, read_only: bool) -> Self {
        let mut cmd = Command::new("losetup");
        cmd.args(["--find", "--show"]);
        if read_only {
            cmd.arg("--read-only");
        }
        let out = cmd.arg(file).output().expect("run losetup (util-linux)");
        assert!(
            out.status.success(),
            "losetup {}: {}",
            file.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        Self(String::from_utf8_lossy(&out.stdout).trim().to_string())
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = Command::new("losetup").args(["-d", &self.0]).status();
    }
}

fn sh(script: &str) {
    let status = Command::new("sh").args(["-ec", script]).status().unwrap();
    assert!(status.success(), "{script}");
}

/// VM mode on a disk image, as in a microVM on the debian image: a read-only erofs root
/// disk and an ext4 upper disk (loop devices here, virtio-blk there) become an overlay root
/// that every command runs in; writes land on the upper disk only.
#[tokio::test]
async fn agent_as_pid1_boots_into_a_root_disk_with_an_upper_disk() {
    let dir = PathBuf::from("/var/tmp").join(format!("dsec-pid1-disk-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let _cleanup = RemoveDir(dir.clone());
    let tree = dir.join("tree");
    let (root_img, upper_img) = (dir.join("root.img"), dir.join("upper.img"));
    sh(&format!(
        "mkdir -p {t}/bin {t}/etc {t}/proc {t}/sys {t}/dev {t}/tmp {t}/run {t}/mnt
         cp \"$(command -v busybox)\" {t}/bin/busybox
         for a in sh cat echo grep cut awk test sync; do ln -s busybox {t}/bin/$a; done
         echo from-image > {t}/etc/marker
         mkfs.erofs --quiet -zlz4hc {r} {t} >/dev/null
         truncate -s 64M {u}
         mkfs.ext4 -q -F -O ^has_journal {u}",
        t = tree.display(),
        r = root_img.display(),
        u = upper_img.display()
    ));
    let image_before = std::fs::read(&root_img).unwrap();
    let root_loop = Loop::attach(&root_img, true);
    let upper_loop = Loop::attach(&upper_img, false);

    let socket = dir.join("agent.sock");
    let child = Command::new("unshare")
        .args([
            "--pid",
            "--fork",
            "--mount",
            "--uts",
            "--net",
            "--ipc",
            "--kill-child",
        ])
        .arg(env!("CARGO_BIN_EXE_dsec-agent"))
        .arg("--listen")
        .arg(format!("unix:{}", socket.display()))
        .args(["--root-disk", &root_loop.0, "--upper-disk", &upper_loop.0])
        .stdin(Stdio::null())
        .spawn()
        .expect("run unshare (util-linux)");
    let mut agent = Pid1Agent {
        child,
        dir: dir.clone(),
    };
    let client = connect(&socket)
        .await
        .expect("agent as PID 1 on a root disk did not answer");

    let script = "cat /etc/marker; awk '$2 == \"/\" {print $3}' /proc/mounts | tail -1; \
                  test -x /bin/busybox && test -c /dev/null && test -e /proc/1/comm && echo sane; \
                  echo written-in-sandbox > /etc/new && sync && cat /etc/new";
    let out = client
        .exec_collect(&ExecSpec::new(["sh", "-c", script]), None)
        .await
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "from-image\noverlay\nsane\nwritten-in-sandbox\n",
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.outcome.code, Some(0));
    // The Files API sees the same root.
    assert_eq!(
        client.read_file("/etc/marker").await.unwrap(),
        b"from-image\n"
    );

    drop(client);
    let _ = agent.child.kill();
    let _ = agent.child.wait();
    let upper = std::fs::read(&upper_img).unwrap();
    let needle = b"written-in-sandbox\n";
    assert!(
        upper.windows(needle.len()).any(|w| w == needle),
        "the write did not land on the upper disk"
    );
    assert!(
        std::fs::read(&root_img).unwrap() == image_before,
        "the read-only root disk changed"
    );
    drop(agent);
    drop(upper_loop);
    drop(root_loop);
}
