//! FnCall across a daemon crash: after SIGKILL and a restart on the same state, calls work
//! again, and nothing of the dead daemon's workers is left (no zygote or call process, no
//! worker cgroup, no mount). Needs root and the fncall image (`images/fncall/build.sh`).

mod daemon;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use daemon::Daemon;
use dsec_sdk::{Client, FnRunRequest};

async fn print_42(client: &Client) -> String {
    let response = client
        .run_code(FnRunRequest {
            code: "print(6 * 7)".into(),
            language: "python".into(),
            ..Default::default()
        })
        .await
        .expect("Fn.Run");
    let run = response.run.expect("a run stage");
    String::from_utf8_lossy(&run.stdout).into_owned()
}

/// Pids of FnCall processes (zygotes, call inits and stages: named `fncall-*`) whose
/// engine is `daemon` (the zygotes' parent) or who descend from such a zygote.
fn fncall_processes_of(daemon: u32) -> Vec<i32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let Some((comm, rest)) = stat.split_once(") ") else {
            continue;
        };
        let ppid: u32 = rest
            .split_whitespace()
            .nth(1)
            .and_then(|p| p.parse().ok())
            .unwrap_or(0);
        if comm.ends_with("(fncall-zygote") && ppid == daemon {
            found.push(pid);
        }
    }
    found
}

fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| !s.split_once(") ").is_some_and(|(_, r)| r.starts_with('Z')))
}

/// The FnCall worker cgroups of the engine in process `pid` (named `<pid>-w<n>`).
fn worker_cgroups_of(pid: u32) -> Vec<PathBuf> {
    let prefix = format!("{pid}-w");
    [
        "/sys/fs/cgroup/dsec-fncall",
        "/sys/fs/cgroup/memory/dsec-fncall",
        "/sys/fs/cgroup/pids/dsec-fncall",
    ]
    .iter()
    .flat_map(|dir| std::fs::read_dir(dir).into_iter().flatten().flatten())
    .map(|e| e.path())
    .filter(|p| {
        p.file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with(&prefix))
    })
    .collect()
}

/// Host mounts of the fncall image's root (workers mount it only in their own namespace).
fn host_mounts_of(rootfs: &Path) -> usize {
    let text = rootfs.to_string_lossy().into_owned();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter(|l| l.contains(&text))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fncall_works_again_after_the_daemon_is_killed() {
    daemon::use_installed_image("fncall");
    let rootfs = dsec_edge::Artifacts::home().join("images/fncall/rootfs");
    let mounts_before = host_mounts_of(&rootfs);
    let (mut daemon, client) = Daemon::start("fnrestart", &[]).await;
    assert_eq!(print_42(&client).await, "42\n");
    let old = daemon.child.id();
    let zygotes = fncall_processes_of(old);
    assert!(!zygotes.is_empty(), "no zygote of the daemon found");
    assert!(
        !worker_cgroups_of(old).is_empty(),
        "no worker cgroup of the daemon found"
    );
    drop(client);
    daemon.kill9();

    // The workers die with their daemon (and their calls with their pid namespaces).
    let deadline = Instant::now() + Duration::from_secs(10);
    while zygotes.iter().any(|pid| alive(*pid)) {
        assert!(
            Instant::now() < deadline,
            "zygotes outlived their daemon: {zygotes:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let client = daemon.restart().await;
    let new = daemon.child.id();
    assert_ne!(old, new);
    for round in 0..5 {
        assert_eq!(
            print_42(&client).await,
            "42\n",
            "call {round} after restart"
        );
    }
    assert!(
        !fncall_processes_of(new).is_empty(),
        "the new daemon has no worker"
    );
    // The new engine removed the dead one's cgroups when it started.
    let stale = worker_cgroups_of(old);
    assert!(
        stale.is_empty(),
        "cgroups of the dead daemon left: {stale:?}"
    );
    assert_eq!(
        host_mounts_of(&rootfs),
        mounts_before,
        "mounts of the fncall image left on the host"
    );
    daemon.stop(client).await;
}
