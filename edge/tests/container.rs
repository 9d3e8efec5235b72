//! The container path end to end: real namespaces, real overlay root, the real agent.
//! Run as root: `cargo test -p dsec-edge --test container`.

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::TestNode;
use dsec_edge::{ExecSpec, Sandbox};
use tokio::io::AsyncBufReadExt;

async fn run(sandbox: &Sandbox, argv: &[&str]) -> dsec_edge::CollectedExec {
    sandbox
        .agent()
        .exec_collect(&ExecSpec::new(argv.iter().copied()), None)
        .await
        .expect("exec")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Deterministic, incompressible-looking test data.
fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

#[tokio::test]
async fn exit_code_and_streams_kept_apart() {
    let node = TestNode::new("exit");
    let sandbox = node.sandbox().await;
    let out = run(&sandbox, &["sh", "-c", "exit 7"]).await;
    assert_eq!(out.outcome.code, Some(7));
    assert_eq!(out.outcome.exit_code(), 7);

    let out = run(
        &sandbox,
        &["sh", "-c", "echo to-out; echo to-err >&2; echo more-out"],
    )
    .await;
    assert_eq!(text(&out.stdout), "to-out\nmore-out\n");
    assert_eq!(text(&out.stderr), "to-err\n");
    assert_eq!(out.outcome.code, Some(0));

    let out = run(&sandbox, &["sh", "-c", "kill -TERM $$"]).await;
    assert_eq!(out.outcome.signal, Some(15));
    assert_eq!(out.outcome.exit_code(), 128 + 15);
    sandbox.destroy().await.unwrap();
    assert!(node.leftovers().is_empty());
}

#[tokio::test]
async fn megabyte_output_intact_both_ways() {
    let node = TestNode::new("bigout");
    let sandbox = node.sandbox().await;
    let data = pattern(1 << 20, 42);
    let written = sandbox
        .agent()
        .write_file("/tmp/blob", 0o600, &data)
        .await
        .unwrap();
    assert_eq!(written, data.len() as u64);
    let out = run(&sandbox, &["cat", "/tmp/blob"]).await;
    assert_eq!(out.stdout.len(), data.len());
    assert!(
        out.stdout == data,
        "1 MiB of stdout differs from the file written"
    );

    // Generated inside, streamed out, compared with the copy kept inside.
    let out = run(
        &sandbox,
        &["sh", "-c", "head -c 1048576 /dev/urandom | tee /tmp/gen"],
    )
    .await;
    let kept = sandbox.agent().read_file("/tmp/gen").await.unwrap();
    assert_eq!(kept.len(), 1 << 20);
    assert!(
        out.stdout == kept,
        "streamed output differs from the file tee kept"
    );
    let sum = run(&sandbox, &["sha256sum", "/tmp/gen"]).await;
    assert_eq!(sum.outcome.code, Some(0));
    sandbox.destroy().await.unwrap();
}

#[tokio::test]
async fn stdin_env_and_workdir() {
    let node = TestNode::new("stdin");
    let sandbox = node.sandbox().await;
    let input = pattern(300 * 1024, 7);
    let out = sandbox
        .agent()
        .exec_collect(&ExecSpec::new(["cat"]), Some(input.clone()))
        .await
        .unwrap();
    assert!(
        out.stdout == input,
        "stdin did not come back intact through cat"
    );
    assert_eq!(out.outcome.code, Some(0));

    let mut spec = ExecSpec::new(["sh", "-c", "echo \"$GREETING|$HOME|$PATH\"; pwd"]);
    spec.env = HashMap::from([("GREETING".to_string(), "hello world".to_string())]);
    spec.workdir = Some("/etc".into());
    let out = sandbox.agent().exec_collect(&spec, None).await.unwrap();
    let stdout = text(&out.stdout);
    let mut lines = stdout.lines();
    let first = lines.next().unwrap();
    assert!(first.starts_with("hello world|/root|"), "{first}");
    assert!(first.contains("/bin"), "{first}");
    assert_eq!(lines.next(), Some("/etc"));

    spec.workdir = Some("/does/not/exist".into());
    let err = sandbox.agent().exec_collect(&spec, None).await.unwrap_err();
    assert_eq!(err.agent_code(), Some(tonic::Code::NotFound), "{err}");
    assert!(err.to_string().contains("/does/not/exist"), "{err}");
    sandbox.destroy().await.unwrap();
}

#[tokio::test]
async fn timeout_kills_the_process_tree_promptly() {
    let node = TestNode::new("timeout");
    let sandbox = node.sandbox().await;
    let mut spec = ExecSpec::new(["sh", "-c", "sleep 1000 & sleep 1000 & sleep 1000"]);
    spec.timeout = Some(Duration::from_millis(500));
    let started = Instant::now();
    let out = sandbox.agent().exec_collect(&spec, None).await.unwrap();
    let elapsed = started.elapsed();
    assert!(out.outcome.timed_out);
    assert_eq!(out.outcome.signal, Some(9));
    assert!(elapsed < Duration::from_secs(3), "timeout took {elapsed:?}");
    // The background sleeps were in the same process group and must be gone too.
    let ps = run(&sandbox, &["ps", "-o", "pid,args"]).await;
    let stdout = text(&ps.stdout);
    assert!(!stdout.contains("sleep 1000"), "survivors:\n{stdout}");
    sandbox.destroy().await.unwrap();
}

#[tokio::test]
async fn output_streams_live() {
    let node = TestNode::new("live");
    let sandbox = node.sandbox().await;
    let (writer, reader) = tokio::io::duplex(64 * 1024);
    let agent = sandbox.agent().clone();
    let exec = tokio::spawn(async move {
        let mut writer = writer;
        let spec = ExecSpec::new(["sh", "-c", "echo first; sleep 3; echo second"]);
        agent
            .exec(
                &spec,
                None::<tokio::io::Empty>,
                &mut writer,
                &mut tokio::io::sink(),
            )
            .await
    });
    let started = Instant::now();
    let mut lines = tokio::io::BufReader::new(reader).lines();
    let first = tokio::time::timeout(Duration::from_secs(2), lines.next_line())
        .await
        .expect("first line must arrive before the command ends")
        .unwrap();
    assert_eq!(first.as_deref(), Some("first"));
    assert!(started.elapsed() < Duration::from_secs(2));
    let outcome = exec.await.unwrap().unwrap();
    assert_eq!(outcome.code, Some(0));
    sandbox.destroy().await.unwrap();
}

#[tokio::test]
async fn files_round_trip_and_clear_errors() {
    let node = TestNode::new("files");
    let sandbox = node.sandbox().await;
    let agent = sandbox.agent();
    agent
        .write_file("/root/note.txt", 0o640, b"hello\n")
        .await
        .unwrap();
    assert_eq!(agent.read_file("/root/note.txt").await.unwrap(), b"hello\n");
    let ls = run(&sandbox, &["stat", "-c", "%a %s", "/root/note.txt"]).await;
    assert_eq!(text(&ls.stdout), "640 6\n");
    // Empty file.
    agent.write_file("/tmp/empty", 0, b"").await.unwrap();
    assert!(agent.read_file("/tmp/empty").await.unwrap().is_empty());

    let cases: [(&str, tonic::Code); 3] = [
        ("/no/such/file", tonic::Code::NotFound),
        ("relative/path", tonic::Code::InvalidArgument),
        ("/etc", tonic::Code::InvalidArgument),
    ];
    for (path, code) in cases {
        let err = agent.read_file(path).await.unwrap_err();
        assert_eq!(err.agent_code(), Some(code), "read {path}: {err}");
        assert!(
            err.to_string().contains(path),
            "error should name {path}: {err}"
        );
    }
    let err = agent
        .write_file("/no/such/dir/f", 0, b"x")
        .await
        .unwrap_err();
    assert_eq!(err.agent_code(), Some(tonic::Code::NotFound), "{err}");
    let err = agent.write_file("rel", 0, b"x").await.unwrap_err();
    assert_eq!(
        err.agent_code(),
        Some(tonic::Code::InvalidArgument),
        "{err}"
    );
    sandbox.destroy().await.unwrap();
}

#[tokio::test]
async fn unknown_command_is_a_clear_error() {
    let node = TestNode::new("unknown");
    let sandbox = node.sandbox().await;
    let err = sandbox
        .agent()
        .exec_collect(&ExecSpec::new(["no-such-command-xyz"]), None)
        .await
        .unwrap_err();
    assert_eq!(err.agent_code(), Some(tonic::Code::NotFound), "{err}");
    assert!(
        err.to_string()
            .contains("command not found: no-such-command-xyz"),
        "{err}"
    );
    let err = sandbox
        .agent()
        .exec_collect(&ExecSpec::new(["/etc/passwd"]), None)
        .await
        .unwrap_err();
    assert_eq!(
        err.agent_code(),
        Some(tonic::Code::PermissionDenied),
        "{err}"
    );
    // The sandbox still works afterwards.
    assert_eq!(run(&sandbox, &["true"]).await.outcome.code, Some(0));
    sandbox.destroy().await.unwrap();
}

#[tokio::test]
async fn sandbox_is_isolated_from_host_and_agent_socket() {
    let node = TestNode::new("isolation");
    let sandbox = node.sandbox().await;
    let info = sandbox.agent().info().await.unwrap();
    assert_eq!(info.mode, "container");
    assert_eq!(info.hostname, sandbox.id());
    assert!(!info.kernel_release.is_empty());

    let out = run(
        &sandbox,
        &[
            "sh",
            "-c",
            "echo $$; hostname; cat /proc/1/cmdline | tr '\\0' ' '",
        ],
    )
    .await;
    let stdout = text(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_ne!(lines[0], "1", "command must not be PID 1");
    assert_eq!(lines[1], sandbox.id());
    assert!(lines[2].contains("dsec-agent"), "PID 1 is {}", lines[2]);

    // The agent socket's host path does not exist inside.
    let socket = sandbox.dir().join("agent.sock");
    assert!(socket.exists());
    let out = run(&sandbox, &["ls", &socket.to_string_lossy()]).await;
    assert_ne!(
        out.outcome.code,
        Some(0),
        "agent socket visible inside the sandbox"
    );

    // Commands run without the capabilities to mount, mknod or reach into the agent.
    for (script, what) in [
        ("mkdir -p /mnt/t && mount -t tmpfs none /mnt/t", "mount"),
        ("mknod /tmp/disk b 8 0", "mknod a block device"),
        (
            "for f in /proc/1/fd/*; do readlink $f || exit 1; done",
            "see the agent's fds",
        ),
        ("readlink /proc/1/exe", "resolve the agent's binary"),
        ("cat /proc/1/environ", "read the agent's environment"),
    ] {
        let out = run(&sandbox, &["sh", "-c", script]).await;
        assert_ne!(out.outcome.code, Some(0), "sandbox could {what}");
    }
    // The seccomp filter refuses what capabilities alone do not: an unprivileged user
    // namespace (root inside it would regain every capability) and joining namespaces.
    let out = run(&sandbox, &["grep", "^Seccomp:", "/proc/self/status"]).await;
    assert_eq!(text(&out.stdout).split_whitespace().nth(1), Some("2"));
    for (script, what) in [
        ("unshare -U true", "create a user namespace"),
        ("unshare -Ur true", "become root in a user namespace"),
        ("nsenter -t 1 -m true", "join the agent's mount namespace"),
    ] {
        let out = run(&sandbox, &["sh", "-c", script]).await;
        assert_ne!(out.outcome.code, Some(0), "sandbox could {what}");
    }
    let out = run(&sandbox, &["sh", "-c", "unshare -U true 2>&1"]).await;
    assert!(
        text(&out.stdout).contains("Operation not permitted"),
        "unshare -U: {}",
        text(&out.stdout)
    );
    // Ordinary root work still succeeds.
    let out = run(
        &sandbox,
        &[
            "sh",
            "-c",
            "touch /tmp/f && chown nobody /tmp/f && chmod 600 /tmp/f",
        ],
    )
    .await;
    assert_eq!(out.outcome.code, Some(0), "{}", text(&out.stderr));

    // Only loopback networking.
    let out = run(&sandbox, &["ls", "/sys/class/net"]).await;
    assert_eq!(text(&out.stdout).trim(), "lo");

    // Writes land in the sandbox's upper layer, not in the shared image.
    run(
        &sandbox,
        &["sh", "-c", "echo x > /etc/written-inside; rm /bin/ls"],
    )
    .await;
    assert!(!node.rootfs.join("etc/written-inside").exists());
    assert!(
        node.rootfs.join("bin/ls").exists(),
        "image modified through the sandbox"
    );
    let out = run(
        &sandbox,
        &["sh", "-c", "cat /etc/written-inside; test -e /bin/ls"],
    )
    .await;
    assert_eq!(text(&out.stdout), "x\n");
    assert_eq!(
        out.outcome.code,
        Some(1),
        "rm inside the sandbox must be visible inside"
    );

    sandbox.destroy().await.unwrap();
}

#[tokio::test]
async fn many_concurrent_execs_get_their_own_exit_codes() {
    let node = TestNode::new("concurrent");
    let sandbox = node.sandbox().await;
    let mut tasks = Vec::new();
    for i in 0..24 {
        let agent = sandbox.agent().clone();
        tasks.push(tokio::spawn(async move {
            // Each leaves an orphan behind that PID 1 reaps; the exit code must still be ours.
            let script = format!("sleep 0.05 & echo {i}; exit {i}");
            let out = agent
                .exec_collect(&ExecSpec::new(["sh", "-c", script.as_str()]), None)
                .await
                .unwrap();
            (i, out)
        }));
    }
    for task in tasks {
        let (i, out) = task.await.unwrap();
        assert_eq!(out.outcome.code, Some(i));
        assert_eq!(text(&out.stdout), format!("{i}\n"));
    }
    sandbox.destroy().await.unwrap();
}
