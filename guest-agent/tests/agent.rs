//! The agent as a plain process on a Unix socket (no namespaces): the Exec and Files
//! semantics the sandboxes rely on. Each test starts its own agent and stops it.

use std::process::Command;
use std::time::{Duration, Instant};

use dsec_edge::{ExecSpec, GuestIdentity};

mod common;
use common::Agent;

fn spec(argv: &[&str]) -> ExecSpec {
    ExecSpec::new(argv.iter().copied())
}

#[tokio::test]
async fn info_reports_version_kernel_and_mode() {
    let agent = Agent::start("info").await;
    let info = agent.client.info().await.unwrap();
    assert_eq!(info.agent_version, env!("CARGO_PKG_VERSION"));
    assert_eq!(info.mode, "process");
    let uname = Command::new("uname").arg("-r").output().unwrap();
    assert_eq!(
        info.kernel_release,
        String::from_utf8_lossy(&uname.stdout).trim()
    );
    assert!(info.uptime_ms > 0);
}

#[tokio::test]
async fn exec_exit_codes_streams_and_stdin() {
    let agent = Agent::start("exec").await;
    let out = agent
        .client
        .exec_collect(&spec(&["sh", "-c", "exit 7"]), None)
        .await
        .unwrap();
    assert_eq!(out.outcome.code, Some(7));
    let out = agent
        .client
        .exec_collect(
            &spec(&["sh", "-c", "printf a; printf b >&2; printf c"]),
            None,
        )
        .await
        .unwrap();
    assert_eq!(out.stdout, b"ac");
    assert_eq!(out.stderr, b"b");
    let out = agent
        .client
        .exec_collect(&spec(&["tr", "a-z", "A-Z"]), Some(b"hello\n".to_vec()))
        .await
        .unwrap();
    assert_eq!(out.stdout, b"HELLO\n");
    // Without stdin the command reads EOF at once instead of hanging.
    let out = agent
        .client
        .exec_collect(&spec(&["cat"]), None)
        .await
        .unwrap();
    assert_eq!(out.outcome.code, Some(0));
    assert!(out.stdout.is_empty());
}

#[tokio::test]
async fn exec_environment_is_clean_and_overridable() {
    let agent = Agent::start("env").await;
    let mut s = spec(&["env"]);
    s.env.insert("ONLY_THIS".into(), "1".into());
    let out = agent.client.exec_collect(&s, None).await.unwrap();
    let env = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(env.contains("ONLY_THIS=1"), "{env}");
    assert!(env.contains("PATH="), "{env}");
    // The agent's own environment does not leak into commands.
    assert!(!env.contains("DSEC_AGENT_LOG"), "{env}");
}

#[tokio::test]
async fn timeout_kills_group_and_reports_it() {
    let agent = Agent::start("timeout").await;
    let mut s = spec(&["sh", "-c", "sleep 1000 & sleep 1000"]);
    s.timeout = Some(Duration::from_millis(300));
    let started = Instant::now();
    let out = agent.client.exec_collect(&s, None).await.unwrap();
    assert!(out.outcome.timed_out);
    assert_eq!(out.outcome.signal, Some(9));
    assert!(started.elapsed() < Duration::from_secs(3));
    // A command that finishes in time is not marked.
    s.argv = vec!["true".into()];
    let out = agent.client.exec_collect(&s, None).await.unwrap();
    assert!(!out.outcome.timed_out);
    assert_eq!(out.outcome.code, Some(0));
}

#[tokio::test]
async fn background_children_do_not_hold_the_exit_status() {
    let agent = Agent::start("bg").await;
    // The background child keeps stdout open; the exit status still arrives promptly.
    let started = Instant::now();
    let out = agent
        .client
        .exec_collect(&spec(&["sh", "-c", "echo hi; sleep 5 & exit 3"]), None)
        .await
        .unwrap();
    assert_eq!(out.outcome.code, Some(3));
    assert_eq!(out.stdout, b"hi\n");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn flood_output_is_bounded_and_complete() {
    let agent = Agent::start("flood").await;
    // 64 MiB through the stream: must arrive complete with bounded agent memory.
    let out = agent
        .client
        .exec_collect(&spec(&["sh", "-c", "head -c 67108864 /dev/zero"]), None)
        .await
        .unwrap();
    assert_eq!(out.stdout.len(), 64 << 20);
    let rss_kib = std::fs::read_to_string(format!("/proc/{}/status", agent.child.id()))
        .unwrap()
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .unwrap();
    assert!(
        rss_kib < 48 * 1024,
        "agent peak RSS {rss_kib} KiB after a 64 MiB stream"
    );
}

#[tokio::test]
async fn exec_bad_requests_are_clear() {
    let agent = Agent::start("bad").await;
    let err = agent
        .client
        .exec_collect(&spec(&["definitely-not-a-command"]), None)
        .await
        .unwrap_err();
    assert_eq!(err.agent_code(), Some(tonic::Code::NotFound), "{err}");
    let mut s = spec(&["true"]);
    s.env.insert("BAD=NAME".into(), "x".into());
    let err = agent.client.exec_collect(&s, None).await.unwrap_err();
    assert_eq!(
        err.agent_code(),
        Some(tonic::Code::InvalidArgument),
        "{err}"
    );
    let err = agent
        .client
        .exec_collect(&spec(&[]), None)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("no command"), "{err}");
}

#[tokio::test]
async fn files_write_read_and_errors() {
    let agent = Agent::start("files").await;
    let path = agent.dir.join("data.bin");
    let path = path.to_str().unwrap();
    let data: Vec<u8> = (0..200_000u32).map(|i| (i * 7 % 251) as u8).collect();
    assert_eq!(
        agent.client.write_file(path, 0o600, &data).await.unwrap(),
        data.len() as u64
    );
    assert_eq!(agent.client.read_file(path).await.unwrap(), data);
    // Overwrite truncates.
    agent.client.write_file(path, 0, b"short").await.unwrap();
    assert_eq!(agent.client.read_file(path).await.unwrap(), b"short");
    let missing = agent.dir.join("missing");
    let err = agent
        .client
        .read_file(missing.to_str().unwrap())
        .await
        .unwrap_err();
    assert_eq!(err.agent_code(), Some(tonic::Code::NotFound), "{err}");
    let err = agent.client.read_file("").await.unwrap_err();
    assert_eq!(
        err.agent_code(),
        Some(tonic::Code::InvalidArgument),
        "{err}"
    );
}

#[tokio::test]
async fn signals_reach_the_process_group() {
    use tokio::io::AsyncBufReadExt;
    let agent = Agent::start("signal").await;
    let (signal_tx, signal_rx) = tokio::sync::mpsc::channel(1);
    let (writer, reader) = tokio::io::duplex(4096);
    let client = agent.client.clone();
    let exec = tokio::spawn(async move {
        let mut writer = writer;
        let script = "trap 'echo got-term; exit 5' TERM; echo ready; while :; do sleep 0.05; done";
        client
            .exec_with_signals(
                &spec(&["sh", "-c", script]),
                None::<tokio::io::Empty>,
                &mut writer,
                &mut tokio::io::sink(),
                Some(signal_rx),
            )
            .await
    });
    let mut lines = tokio::io::BufReader::new(reader).lines();
    assert_eq!(lines.next_line().await.unwrap().as_deref(), Some("ready"));
    signal_tx.send(15).await.unwrap();
    let outcome = tokio::time::timeout(Duration::from_secs(5), exec)
        .await
        .expect("command did not end after SIGTERM")
        .unwrap()
        .unwrap();
    assert_eq!(
        lines.next_line().await.unwrap().as_deref(),
        Some("got-term")
    );
    assert_eq!(outcome.code, Some(5));
}

#[tokio::test]
async fn refresh_reseeds_and_bounds_its_input_without_touching_a_shared_clock() {
    let agent = Agent::start("refresh").await;
    // A plain process shares the host clock: the skew is measured, the clock is left alone.
    let skew = agent
        .client
        .refresh(vec![7u8; 64], Default::default())
        .await
        .unwrap();
    assert!(skew < Duration::from_secs(5), "skew {skew:?}");
    let err = agent
        .client
        .refresh(vec![0u8; 64 * 1024], Default::default())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("at most"), "{err}");
    // A bad MAC is refused, and a plain process never touches the host's interfaces.
    let err = agent
        .client
        .refresh(
            Vec::new(),
            GuestIdentity {
                mac: Some("07:00:00:00:00:01".into()),
                ..Default::default()
            },
        )
        .await
        .unwrap_err();
    assert!(err.to_string().contains("unicast"), "{err}");
    let err = agent
        .client
        .refresh(
            Vec::new(),
            GuestIdentity {
                mac: Some("06:00:00:00:00:01".into()),
                ..Default::default()
            },
        )
        .await
        .unwrap_err();
    assert!(err.to_string().contains("VM's init"), "{err}");
    // The same for a hostname: checked, then refused outside a VM.
    for (name, expected) in [
        ("-bad", "letters"),
        (&*"x".repeat(65), "letters"),
        ("sb-1", "VM's init"),
    ] {
        let err = agent
            .client
            .refresh(
                Vec::new(),
                GuestIdentity {
                    mac: None,
                    hostname: Some(name.into()),
                    ..Default::default()
                },
            )
            .await
            .unwrap_err();
        assert!(err.to_string().contains(expected), "{name}: {err}");
    }
    // And for an IPv4 setup: a bad prefix or a gateway outside the network is refused, a good
    // one only outside a VM.
    let gateway = std::net::Ipv4Addr::new(10, 200, 0, 1);
    for (prefix_len, gateway, expected) in [
        (40, gateway, "1-32"),
        (
            16,
            std::net::Ipv4Addr::new(10, 9, 0, 1),
            "not another address",
        ),
        (16, gateway, "VM's init"),
    ] {
        let ipv4 = dsec_edge::GuestIpv4 {
            address: std::net::Ipv4Addr::new(10, 200, 0, 5),
            prefix_len,
            gateway,
            nameserver: gateway,
        };
        let err = agent
            .client
            .refresh(
                Vec::new(),
                GuestIdentity {
                    ipv4: Some(ipv4),
                    ..Default::default()
                },
            )
            .await
            .unwrap_err();
        assert!(err.to_string().contains(expected), "{ipv4:?}: {err}");
    }
}

/// PTY exec on the host's devpts: the command's stdio is the slave and nothing else of the
/// pair (or of any other command) leaks into it; ^D after stdin EOF ends a reader.
#[tokio::test]
async fn pty_exec_gets_only_the_terminal() {
    use dsec_api::agent::v1::{
        exec_request, exec_response, process_client::ProcessClient, ExecRequest, ExecStart,
        PtyConfig, StdinEof,
    };

    let agent = Agent::start("pty").await;
    let start = ExecStart {
        argv: vec![
            "sh".into(),
            "-c".into(),
            "tty; stty size; ls /proc/self/fd | tr '\\n' ' '; echo; cat; echo cat-done".into(),
        ],
        stdin: true,
        pty: Some(PtyConfig {
            rows: 12,
            cols: 34,
            term: String::new(),
        }),
        ..Default::default()
    };
    let requests = vec![
        ExecRequest {
            kind: Some(exec_request::Kind::Start(start)),
        },
        ExecRequest {
            kind: Some(exec_request::Kind::Stdin(b"typed\n".to_vec())),
        },
        ExecRequest {
            kind: Some(exec_request::Kind::StdinEof(StdinEof {})),
        },
    ];
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    for r in requests {
        tx.send(r).await.unwrap();
    }
    let mut stream = ProcessClient::new(agent.client.channel())
        .exec(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let mut out = Vec::new();
    let mut exit = None;
    let deadline = Instant::now() + Duration::from_secs(20);
    while let Some(message) = tokio::time::timeout_at(deadline.into(), stream.message())
        .await
        .expect("pty exec did not finish")
        .unwrap()
    {
        match message.kind {
            Some(exec_response::Kind::Stdout(d)) => out.extend_from_slice(&d),
            Some(exec_response::Kind::Stderr(d)) => panic!("stderr on a pty: {d:?}"),
            Some(exec_response::Kind::Exit(e)) => exit = Some(e),
            _ => {}
        }
    }
    drop(tx);
    let text = String::from_utf8_lossy(&out).replace('\r', "");
    assert_eq!(exit.unwrap().code, Some(0), "{text}");
    // The terminal echoes the typed line whenever it arrives: look for lines, not positions.
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines.iter().any(|l| l.starts_with("/dev/pts/")), "{text}");
    assert!(lines.contains(&"12 34"), "{text}");
    let fds = lines
        .iter()
        .find(|l| l.starts_with("0 1 "))
        .expect("the fd list");
    // The same fds as a command without a pty (ls's directory fd, and whatever the agent
    // itself inherited from the test harness): a leaked master or slave would be extra.
    let plain = agent
        .client
        .exec_collect(
            &spec(&["sh", "-c", "ls /proc/self/fd | tr '\\n' ' '"]),
            Some(Vec::new()),
        )
        .await
        .unwrap();
    assert_eq!(*fds, String::from_utf8_lossy(&plain.stdout), "{text}");
    assert!(text.contains("cat-done"), "cat did not see EOF: {text}");
}
