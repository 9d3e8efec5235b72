//! Chronus sessions and the extra file calls, against the agent as a plain process on a Unix
//! socket. Each test starts its own agent and stops it.

use dsec_api::agent::v1::files_client::FilesClient;
use dsec_api::agent::v1::sessions_client::SessionsClient;
use dsec_api::agent::v1::*;

mod common;
use common::Agent;

fn sessions(agent: &Agent) -> SessionsClient<tonic::transport::Channel> {
    SessionsClient::new(agent.client.channel())
}

async fn run(
    client: &mut SessionsClient<tonic::transport::Channel>,
    session: &str,
    command: &str,
    limit: u64,
    timeout_ms: u64,
) -> CommandResult {
    client
        .run_in_session(RunInSessionRequest {
            session_id: session.into(),
            command: command.into(),
            timeout_ms,
            wait: true,
            output_limit: limit,
        })
        .await
        .expect("run in session")
        .into_inner()
}

#[tokio::test]
async fn session_keeps_cwd_env_and_functions() {
    let agent = Agent::start("state").await;
    let mut c = sessions(&agent);
    let s = c
        .create_session(CreateSessionRequest::default())
        .await
        .unwrap()
        .into_inner()
        .session_id;
    let r = run(
        &mut c,
        &s,
        "cd /tmp && export FOO=bar && f() { echo fn-$1; }",
        0,
        0,
    )
    .await;
    assert_eq!(r.exit_code, Some(0));
    let r = run(&mut c, &s, "pwd; echo $FOO; f x; echo err >&2; false", 0, 0).await;
    assert_eq!(String::from_utf8_lossy(&r.output), "/tmp\nbar\nfn-x\nerr\n");
    assert_eq!(r.exit_code, Some(1));
    assert!(!r.truncated);
    // A syntax error is reported, and the session survives it.
    let r = run(&mut c, &s, "if then fi (", 0, 0).await;
    assert_eq!(r.exit_code, Some(2));
    assert!(!r.output.is_empty());
    let r = run(&mut c, &s, "echo $FOO", 0, 0).await;
    assert_eq!(r.output, b"bar\n");
    // Commands cannot eat the script from stdin.
    let r = run(&mut c, &s, "cat; echo after", 0, 0).await;
    assert_eq!(r.output, b"after\n");
    // Async: start, then read later.
    let started = c
        .run_in_session(RunInSessionRequest {
            session_id: s.clone(),
            command: "sleep 0.3; echo late".into(),
            wait: false,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!started.done);
    let busy = c
        .run_in_session(RunInSessionRequest {
            session_id: s.clone(),
            command: "true".into(),
            wait: true,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(busy.code(), tonic::Code::FailedPrecondition);
    let done = c
        .read_output(ReadOutputRequest {
            session_id: s.clone(),
            command_id: started.command_id,
            wait: true,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(done.done);
    assert_eq!(done.output, b"late\n");
    // `exit` ends the session and says so.
    let r = run(&mut c, &s, "exit 3", 0, 0).await;
    assert!(r.session_ended);
    assert_eq!(r.exit_code, Some(3));
    let gone = c
        .run_in_session(RunInSessionRequest {
            session_id: s.clone(),
            command: "true".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(gone.code(), tonic::Code::FailedPrecondition);
    c.close_session(CloseSessionRequest { session_id: s })
        .await
        .unwrap();
}

#[tokio::test]
async fn session_flood_is_capped_and_timeouts_kill_the_command() {
    let agent = Agent::start("flood").await;
    let mut c = sessions(&agent);
    let s = c
        .create_session(CreateSessionRequest::default())
        .await
        .unwrap()
        .into_inner()
        .session_id;
    let r = run(&mut c, &s, "yes | head -c 200000000; echo END", 4096, 0).await;
    assert_eq!(r.exit_code, Some(0));
    assert!(r.truncated);
    assert_eq!(r.total_bytes, 200_000_004);
    assert!(
        r.output.len() < 4096 + 100,
        "output {} bytes",
        r.output.len()
    );
    assert!(r.output.starts_with(b"y\ny\n"));
    assert!(r.output.ends_with(b"y\nEND\n"));
    let rss = agent_rss_kib(agent.child.id());
    assert!(rss < 64 * 1024, "agent RSS {rss} KiB after a 200 MB flood");
    let r = run(&mut c, &s, "echo before; sleep 30", 0, 300).await;
    assert!(r.timed_out);
    // The shell may report the kill ("Killed").
    assert!(r.output.starts_with(b"before\n"), "{:?}", r.output);
    let r = run(&mut c, &s, "echo still-alive", 0, 0).await;
    assert_eq!(r.output, b"still-alive\n");
}

fn agent_rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

#[tokio::test]
async fn files_list_stat_mkdir_rename_remove() {
    let agent = Agent::start("files").await;
    let base = agent.dir.join("tree");
    let base = base.to_str().unwrap().to_string();
    let mut f = FilesClient::new(agent.client.channel());
    f.mkdir(MkdirRequest {
        path: format!("{base}/a/b"),
        parents: true,
        mode: 0,
    })
    .await
    .unwrap();
    agent
        .client
        .write_file(&format!("{base}/a/x.txt"), 0, b"hello")
        .await
        .unwrap();
    let list = f
        .list_dir(ListDirRequest {
            path: format!("{base}/a"),
        })
        .await
        .unwrap()
        .into_inner();
    let names: Vec<_> = list.entries.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names, ["b", "x.txt"]);
    assert_eq!(list.entries[0].r#type, FileType::Dir as i32);
    assert_eq!(list.entries[1].size, 5);
    f.rename(RenameRequest {
        from: format!("{base}/a/x.txt"),
        to: format!("{base}/a/y.txt"),
    })
    .await
    .unwrap();
    let st = f
        .stat(StatRequest {
            path: format!("{base}/a/y.txt"),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(st.r#type, FileType::File as i32);
    let err = f
        .stat(StatRequest {
            path: format!("{base}/a/x.txt"),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound);
    let err = f
        .remove(RemoveRequest {
            path: format!("{base}/a"),
            recursive: false,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
    f.remove(RemoveRequest {
        path: format!("{base}/a"),
        recursive: true,
    })
    .await
    .unwrap();
    let err = f
        .list_dir(ListDirRequest {
            path: "relative".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
}
