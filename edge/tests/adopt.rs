//! Sandboxes adopted by a restarted `dsec-edge` (container backend). This test process makes
//! itself a child subreaper, so the sandboxes a SIGKILLed daemon leaves become its children
//! and stay zombies after they die until it reaps them: exactly the state an adopting daemon
//! meets when the host's init is slow to reap. Run as root:
//! `cargo test -p dsec-edge --test adopt`.

mod daemon;

use std::time::{Duration, Instant};

use daemon::Daemon;
use dsec_sdk::CreateSandboxRequest;

fn become_subreaper() {
    // SAFETY: prctl(PR_SET_CHILD_SUBREAPER) takes plain integers; no memory is involved.
    let rc = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    assert_eq!(rc, 0, "PR_SET_CHILD_SUBREAPER failed");
}

/// State letter of a process, if it exists.
fn proc_state(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

fn reap(pid: i32) {
    // SAFETY: waitpid on a specific pid with a null status pointer; no memory is involved.
    unsafe { libc::waitpid(pid, std::ptr::null_mut(), libc::WNOHANG) };
}

fn small() -> CreateSandboxRequest {
    CreateSandboxRequest {
        memory_mib: 64,
        disk_mib: 16,
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_an_adopted_sandbox_does_not_wait_for_its_zombie() {
    become_subreaper();
    let (mut daemon, client) = Daemon::start("zombie", &[]).await;
    let sb = client.create(small()).await.unwrap();
    let pid = sb.pid as i32;
    drop(client);
    daemon.kill9();
    let client = daemon.restart().await;
    assert_eq!(client.get(&sb.id).await.unwrap().pid, sb.pid, "not adopted");
    let started = Instant::now();
    let deleted = client.delete(&sb.id).await;
    let took = started.elapsed();
    // Nobody reaps the dead agent but this process, which has not yet: it is a zombie.
    let state = proc_state(pid);
    reap(pid);
    deleted.unwrap();
    assert_eq!(state, Some('Z'), "the agent was reaped by someone else");
    assert!(
        took < Duration::from_millis(500),
        "deleting an adopted sandbox took {took:?}"
    );
    drop(daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_retried_after_a_daemon_restart_returns_the_same_sandbox() {
    become_subreaper();
    let (mut daemon, client) = Daemon::start("retry", &[]).await;
    let request = CreateSandboxRequest {
        request_id: "retry-after-restart".into(),
        ..small()
    };
    let sb = client.create(request.clone()).await.unwrap();
    drop(client);
    daemon.kill9();
    let client = daemon.restart().await;
    let again = client.create(request.clone()).await.unwrap();
    assert_eq!(again.id, sb.id);
    assert_eq!(again.pid, sb.pid);
    assert_eq!(client.list(Default::default()).await.unwrap().len(), 1);
    let mut changed = request;
    changed.memory_mib = 128;
    let err = client.create(changed).await.unwrap_err();
    assert_eq!(err.code(), Some(tonic::Code::AlreadyExists), "{err}");
    client.delete(&sb.id).await.unwrap();
    reap(sb.pid as i32);
    drop(daemon);
}
