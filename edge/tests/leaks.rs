//! Repeated create/destroy must leave no fds, processes, mounts or directories behind.
//! A separate test binary so nothing else runs in this process meanwhile.

mod common;

use common::TestNode;
use dsec_edge::ExecSpec;

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Our direct children (the agents we clone) still alive or unreaped.
fn child_pids() -> Vec<i32> {
    let me = std::process::id() as i32;
    let mut children = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // Fields after the ")" that ends the command name: state, ppid, ...
        let after = &stat[stat.rfind(')').unwrap() + 2..];
        let ppid: i32 = after.split(' ').nth(1).unwrap().parse().unwrap();
        if ppid == me {
            children.push(pid);
        }
    }
    children
}

/// Processes anywhere on the host whose command line or environment mentions `needle`
/// (their command lines, for the message).
fn processes_mentioning(needle: &str) -> Vec<String> {
    dsec_edge::backend::pids_referencing(needle.as_bytes())
        .into_iter()
        .map(|pid| {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            format!(
                "{pid}: {}",
                String::from_utf8_lossy(&cmdline).replace('\0', " ")
            )
        })
        .collect()
}

/// Host mounts under `dir` (other work on the host may mount elsewhere meanwhile).
fn mounts_under(dir: &str) -> Vec<String> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter(|line| line.contains(dir))
        .map(str::to_string)
        .collect()
}

#[tokio::test]
async fn repeated_create_destroy_leaks_nothing() {
    let node = TestNode::new("leaks");
    // Warm up: first use creates the state dir, runtime threads, lazily opened fds.
    node.sandbox().await.destroy().await.unwrap();
    let fds = open_fds();
    let sleepers = processes_mentioning("sleep 1717").len();

    for round in 0..20 {
        let sandbox = node.sandbox().await;
        let out = sandbox
            .agent()
            .exec_collect(&ExecSpec::new(["sh", "-c", "sleep 1717 & echo ok"]), None)
            .await
            .unwrap();
        assert_eq!(out.outcome.code, Some(0), "round {round}");
        if round % 2 == 0 {
            sandbox.destroy().await.unwrap();
        } else {
            // Dropping without destroy() must clean up as well.
            drop(sandbox);
        }
    }

    assert_eq!(
        node.leftovers(),
        Vec::<String>::new(),
        "sandbox directories left behind"
    );
    assert_eq!(
        child_pids(),
        Vec::<i32>::new(),
        "agent processes left behind"
    );
    assert_eq!(
        processes_mentioning(&node.config.state_dir.to_string_lossy()),
        Vec::<String>::new(),
        "sandbox processes still running"
    );
    assert_eq!(
        processes_mentioning("sleep 1717").len(),
        sleepers,
        "background processes of sandboxes survived their sandbox"
    );
    let state_dir = node.config.state_dir.to_string_lossy().into_owned();
    let rootfs = node.rootfs.to_string_lossy().into_owned();
    assert_eq!(
        mounts_under(&state_dir),
        Vec::<String>::new(),
        "sandbox mounts leaked to the host"
    );
    assert_eq!(
        mounts_under(&rootfs),
        Vec::<String>::new(),
        "image mounts leaked to the host"
    );
    // Allow a couple of fds for runtime internals that open lazily.
    let now = open_fds();
    assert!(
        now <= fds + 2,
        "fds grew from {fds} to {now} over 20 sandboxes"
    );
}
