//! The jailed VMM (`--jail`): what it can see and do, and that a guest still runs, snapshots
//! and restores inside it. Needs root (namespaces, mounts, a uid switch).

mod common;

use std::os::unix::fs::chown;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;

const JAIL_UID: u32 = 65534;

/// A directory the jailed VMM (running as the jail uid) may write to.
fn jail_writable_dir(s: &Scratch, name: &str) -> PathBuf {
    let dir = s.path(name);
    std::fs::create_dir_all(&dir).unwrap();
    chown(&dir, Some(JAIL_UID), Some(JAIL_UID)).unwrap();
    dir
}

fn write_counter_kernel(s: &Scratch) -> PathBuf {
    let kernel = s.path("counter.elf");
    std::fs::write(&kernel, pvh_elf(&counter_guest_code())).unwrap();
    kernel
}

#[test]
fn jailed_vmm_sees_only_its_files_and_dies_on_a_forbidden_syscall() {
    let s = Scratch::new("jail-check");
    let kernel = write_counter_kernel(&s);
    let secret = s.path("host-secret");
    std::fs::write(&secret, "not for the VMM").unwrap();
    let root = s.path("root");
    let out = Command::new(VMM)
        .args(["--kernel", kernel.to_str().unwrap(), "--jail"])
        .arg(&root)
        .arg("--jail-check")
        .arg(&secret)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stdout.contains(&format!("pid 1 uid {JAIL_UID}")),
        "not PID 1 of its own namespace as the jail uid: {stdout} {stderr}"
    );
    assert!(
        stdout.contains(&format!("cannot open {}", secret.display())),
        "the jailed VMM could open a host file: {stdout}"
    );
    assert!(
        stderr.contains("forbidden system call 59"),
        "execve was not refused: {stderr}"
    );
    assert_eq!(out.status.code(), Some(159), "{stdout} {stderr}");
    assert!(!root.exists(), "the jail root outlived the VMM");
}

/// The host pid of the jailed VMM: the only child of the supervisor we spawned.
fn jailed_pid(supervisor: u32) -> u32 {
    let mut pid = None;
    wait_until("the jailed VMM to exist", || {
        pid = std::fs::read_to_string(format!("/proc/{supervisor}/task/{supervisor}/children"))
            .ok()
            .and_then(|c| c.split_whitespace().next().and_then(|p| p.parse().ok()));
        pid.is_some()
    });
    pid.unwrap()
}

/// The jailed VMM's pid once it runs as the jail uid (its control socket is bound before the
/// privilege drop, so the socket may appear first).
fn jailed_pid_as_jail_uid(supervisor: u32) -> u32 {
    let pid = jailed_pid(supervisor);
    wait_until("the jailed VMM to switch to the jail uid", || {
        status_field(pid, "Uid:")
            .split_whitespace()
            .all(|u| u == JAIL_UID.to_string())
    });
    pid
}

fn status_field(pid: u32, field: &str) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix(field).map(|v| v.trim().to_string()))
        .unwrap_or_default()
}

#[test]
fn jailed_vmm_runs_snapshots_and_restores_a_guest() {
    let s = Scratch::new("jail-run");
    let kernel = write_counter_kernel(&s);
    let vm_dir = jail_writable_dir(&s, "vm");
    let api = vm_dir.join("api.sock");
    let mut vm = Vmm::spawn(
        &[
            "--kernel",
            kernel.to_str().unwrap(),
            "--mem-mib",
            "32",
            "--vsock-uds",
            vm_dir.join("vsock.sock").to_str().unwrap(),
            "--jail",
            s.path("root1").to_str().unwrap(),
        ],
        &api,
    );
    let pid = jailed_pid_as_jail_uid(vm.child.id());
    let nspid = status_field(pid, "NSpid:");
    assert!(
        nspid.ends_with(" 1") || nspid.ends_with("\t1"),
        "NSpid {nspid}"
    );
    // The main thread installs its filter just after the switch to the jail uid.
    wait_until("the jailed VMM's seccomp filter (Seccomp: 2)", || {
        status_field(pid, "Seccomp:") == "2"
    });
    let host_ns = std::fs::read_link("/proc/self/ns/net").unwrap();
    let vm_ns = std::fs::read_link(format!("/proc/{pid}/ns/net")).unwrap();
    assert_ne!(
        host_ns, vm_ns,
        "the jailed VMM shares the host's network namespace"
    );

    std::thread::sleep(Duration::from_millis(100));
    let snap = vm_dir.join("snap");
    vm.ok(serde_json::json!({"op": "snapshot", "path": snap}));
    let at_snapshot = counter(&snap);
    assert!(at_snapshot > 0, "the jailed guest did not run");
    vm.stop();

    let mut restored = Vmm::spawn(
        &[
            "--restore",
            snap.to_str().unwrap(),
            "--vsock-uds",
            vm_dir.join("vsock2.sock").to_str().unwrap(),
            "--jail",
            s.path("root2").to_str().unwrap(),
        ],
        &vm_dir.join("api2.sock"),
    );
    let again = vm_dir.join("snap2");
    wait_until("the restored jailed guest to count on", || {
        let _ = std::fs::remove_dir_all(&again);
        restored.ok(serde_json::json!({"op": "snapshot", "path": again}));
        counter(&again) > at_snapshot
    });
    // Jailed, the VMM has no /proc: the pagemap it opened before entering serves a
    // snapshot over its restore base.
    let over = vm_dir.join("over-base");
    let r = restored.ok(serde_json::json!({"op": "snapshot", "path": over, "base": "../snap"}));
    let written = r["pages_written"].as_u64().unwrap();
    assert!(r["diff"] == true && written > 0 && written < 64, "{r}");
    // One naming a parent far outside (that does not exist: without the check, the error
    // would be the failed read of its state).
    let outside = vm_dir.join("outside");
    restored.ok(serde_json::json!({"op": "snapshot", "path": outside, "base": "/no/such/base"}));
    restored.stop();
    // Jailed too: the relative parent is exposed in the jail as the restore resolves it.
    let mut from_diff = Vmm::spawn(
        &[
            "--restore",
            over.to_str().unwrap(),
            "--paused",
            "--vsock-uds",
            vm_dir.join("vsock3.sock").to_str().unwrap(),
            "--jail",
            s.path("root3").to_str().unwrap(),
        ],
        &vm_dir.join("api3.sock"),
    );
    let full = vm_dir.join("from-diff");
    from_diff.ok(serde_json::json!({"op": "snapshot", "path": full}));
    from_diff.stop();
    assert!(
        counter(&full) > at_snapshot,
        "base + diff lost the guest's count"
    );
    // With --contained-chain a parent outside the snapshot is refused before anything of it
    // is read or exposed in the jail.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_dsec-vmm"))
        .args([
            "--restore",
            outside.to_str().unwrap(),
            "--paused",
            "--contained-chain",
        ])
        .args(["--jail", s.path("root4").to_str().unwrap(), "--api-sock"])
        .arg(vm_dir.join("api4.sock"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("not inside the snapshot's directory"),
        "{err}"
    );
    assert!(!Path::new(&s.path("root1")).exists() && !s.path("root2").exists());
    assert!(!s.path("root3").exists());
}

/// Killing the supervisor (what the edge does to a sandbox it deletes) takes the jailed VMM
/// with it, also after the VMM has switched to the jail uid (a credential change clears the
/// parent-death signal, so the jail arms it again).
#[test]
fn jailed_vmm_dies_with_its_supervisor_after_the_privilege_drop() {
    let s = Scratch::new("jail-orphan");
    let kernel = write_counter_kernel(&s);
    let vm_dir = jail_writable_dir(&s, "vm");
    let api = vm_dir.join("api.sock");
    let mut vm = Vmm::spawn(
        &[
            "--kernel",
            kernel.to_str().unwrap(),
            "--mem-mib",
            "32",
            "--jail",
            s.path("root").to_str().unwrap(),
        ],
        &api,
    );
    let pid = jailed_pid_as_jail_uid(vm.child.id());
    vm.child.kill().unwrap();
    vm.child.wait().unwrap();
    let gone = || {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map_or(true, |st| st.contains(") Z ") || st.contains(") X "))
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !gone() {
        if std::time::Instant::now() > deadline {
            // Do not leave it running for the rest of the suite.
            // SAFETY: kill with a pid and a signal number.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            panic!("the jailed VMM {pid} outlived its SIGKILLed supervisor");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}
