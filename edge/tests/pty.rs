//! Exec on a pseudo-terminal through the public API of a real `dsec-edge` daemon (container
//! backend): tty detection, window sizes and resizes, ^C, bad sizes, output floods.
//! Run as root: `cargo test -p dsec-edge --test pty`.

mod daemon;

use daemon::Daemon;

use std::time::{Duration, Instant};

use dsec_sdk::{ExecEvent, ExecOutput, ExecStart};

fn start(id: &str, script: &str, pty: Option<(u32, u32)>, stdin: bool) -> ExecStart {
    ExecStart {
        sandbox_id: id.into(),
        argv: vec!["sh".into(), "-c".into(), script.into()],
        stdin,
        pty: pty.map(|(rows, cols)| dsec_sdk::pty(rows, cols)),
        ..Default::default()
    }
}

fn text(out: &ExecOutput) -> String {
    String::from_utf8_lossy(&out.stdout).replace('\r', "")
}

/// Output until `needle` shows up (or the deadline passes).
async fn read_until(session: &mut dsec_sdk::ExecSession, needle: &str) -> String {
    let mut seen = String::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !seen.contains(needle) {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, session.next()).await {
            Ok(Ok(Some(ExecEvent::Stdout(d)))) => seen.push_str(&String::from_utf8_lossy(&d)),
            Ok(Ok(Some(ExecEvent::Started(_)))) => {}
            other => panic!("waiting for {needle:?}, got {other:?} after {seen:?}"),
        }
    }
    seen
}

async fn sandbox(c: &dsec_sdk::Client) -> String {
    c.create(dsec_sdk::CreateSandboxRequest {
        memory_mib: 128,
        ..Default::default()
    })
    .await
    .expect("create a sandbox")
    .id
}

#[tokio::test]
async fn pty_exec_end_to_end() {
    let (daemon, c) = Daemon::start("pty-e2e", &[]).await;
    let id = sandbox(&c).await;

    // With a PTY: stdin is a terminal under /dev/pts, stderr is merged into stdout, TERM set.
    let script = "tty; test -t 0 && echo stdin-is-tty; echo to-stderr >&2; echo TERM=$TERM";
    let out = c
        .exec_stream(start(&id, script, Some((24, 80)), false))
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    let t = text(&out);
    assert_eq!(out.code, Some(0), "{t}");
    let tty = t.lines().next().unwrap();
    assert!(tty.starts_with("/dev/pts/"), "tty printed {tty:?}");
    assert!(t.contains("stdin-is-tty\n"), "{t}");
    assert!(t.contains("to-stderr\n"), "stderr not on the terminal: {t}");
    assert!(t.contains("TERM=xterm\n"), "{t}");
    assert!(out.stderr.is_empty(), "{:?}", out.stderr);
    // PTY output is translated (onlcr): lines end in \r\n.
    assert!(out.stdout.windows(2).any(|w| w == b"\r\n"));

    // Without one: not a terminal, stderr kept apart.
    let out = c
        .exec_stream(start(&id, "tty; test -t 0", None, false))
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert_eq!(out.code, Some(1), "test -t 0 must fail without a pty");
    assert!(text(&out).contains("not a tty"), "{}", text(&out));

    // The requested size, then the new one after a resize.
    let mut session = c
        .exec_stream(start(
            &id,
            "stty size; echo ready; read line; stty size",
            Some((33, 111)),
            true,
        ))
        .await
        .unwrap();
    let seen = read_until(&mut session, "ready").await;
    assert!(seen.contains("33 111"), "initial size: {seen:?}");
    session.resize(50, 200).await.unwrap();
    session.stdin(b"go\n".to_vec()).await.unwrap();
    let out = session.wait().await.unwrap();
    assert_eq!(
        text(&out),
        "go\n50 200\n",
        "echo of the input, then the new size"
    );
    assert_eq!(out.code, Some(0));

    // The resize reaches the foreground process as SIGWINCH.
    let mut session = c
        .exec_stream(start(
            &id,
            "trap 'stty size; exit 0' WINCH; echo ready; while :; do sleep 0.05; done",
            Some((24, 80)),
            true,
        ))
        .await
        .unwrap();
    read_until(&mut session, "ready").await;
    session.resize(41, 99).await.unwrap();
    let out = tokio::time::timeout(Duration::from_secs(10), session.wait())
        .await
        .expect("no SIGWINCH after the resize")
        .unwrap();
    assert_eq!(text(&out), "41 99\n");
    assert_eq!(out.code, Some(0));

    // ^C (0x03) on a PTY's stdin interrupts the foreground job.
    let mut session = c
        .exec_stream(start(
            &id,
            "echo sleeping; exec sleep 30",
            Some((24, 80)),
            true,
        ))
        .await
        .unwrap();
    read_until(&mut session, "sleeping").await;
    // The shell has exec'd sleep once its echo is out; give it a moment to get there.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let sent = Instant::now();
    session.stdin(vec![3u8]).await.unwrap();
    let out = tokio::time::timeout(Duration::from_secs(10), session.wait())
        .await
        .expect("^C did not stop sleep 30")
        .unwrap();
    assert!(
        out.signal == Some(2) || out.code == Some(130),
        "not interrupted: {out:?}"
    );
    assert!(
        sent.elapsed() < Duration::from_secs(5),
        "{:?}",
        sent.elapsed()
    );

    // `-t` without stdin: still a terminal, input is not forwarded.
    let out = c
        .exec_stream(start(&id, "test -t 0 && test -t 1", Some((24, 80)), false))
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert_eq!(out.code, Some(0));

    // Flood protection is the same pump: 16 MiB through the terminal arrive whole (zeros
    // are not translated), and the call ends with the exit status.
    let bytes = 16 << 20;
    let out = c
        .exec_stream(start(
            &id,
            &format!("stty raw; head -c {bytes} /dev/zero"),
            Some((24, 80)),
            false,
        ))
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert_eq!(out.code, Some(0));
    assert_eq!(out.stdout.len(), bytes);

    daemon.stop(c).await;
}

#[tokio::test]
async fn bad_pty_requests_are_invalid_argument() {
    let (daemon, c) = Daemon::start("pty-bad", &[]).await;
    let id = sandbox(&c).await;

    for (rows, cols) in [(0, 80), (24, 0), (4097, 80), (24, 100_000)] {
        let err = match c
            .exec_stream(start(&id, "true", Some((rows, cols)), false))
            .await
        {
            Ok(session) => session.wait().await.unwrap_err(),
            Err(err) => err,
        };
        assert_eq!(
            err.code(),
            Some(tonic::Code::InvalidArgument),
            "{rows}x{cols}: {err}"
        );
        assert!(err.to_string().contains("1..=4096"), "{err}");
    }
    let mut bad_term = start(&id, "true", Some((24, 80)), false);
    bad_term.pty.as_mut().unwrap().term = "xterm\nevil".into();
    let err = match c.exec_stream(bad_term).await {
        Ok(session) => session.wait().await.unwrap_err(),
        Err(err) => err,
    };
    assert_eq!(err.code(), Some(tonic::Code::InvalidArgument), "{err}");
    assert!(err.to_string().contains("term"), "{err}");

    // A bad resize ends the call with INVALID_ARGUMENT and kills the command.
    let mut session = c
        .exec_stream(start(
            &id,
            "echo ready; exec sleep 30",
            Some((24, 80)),
            true,
        ))
        .await
        .unwrap();
    read_until(&mut session, "ready").await;
    session.resize(0, 0).await.unwrap();
    let err = tokio::time::timeout(Duration::from_secs(10), session.wait())
        .await
        .expect("a bad resize must end the call")
        .unwrap_err();
    assert_eq!(err.code(), Some(tonic::Code::InvalidArgument), "{err}");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let ps = c
            .exec(&id, &["sh", "-c", "ps | grep -c '[s]leep 30'"], None)
            .await
            .unwrap();
        if String::from_utf8_lossy(&ps.stdout).trim() == "0" {
            break;
        }
        assert!(Instant::now() < deadline, "sleep survived the bad resize");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // A resize without a PTY is ignored.
    let session = c
        .exec_stream(start(&id, "read line; echo got-$line", None, true))
        .await
        .unwrap();
    session.resize(40, 100).await.unwrap();
    session.stdin(b"x\n".to_vec()).await.unwrap();
    let out = session.wait().await.unwrap();
    assert_eq!(text(&out), "got-x\n");

    daemon.stop(c).await;
}
