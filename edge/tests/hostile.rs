//! The hostile-sandbox suite: from inside container sandboxes of a real `dsec-edge`, as
//! root, every attack a reward-hacking agent has been seen to try (or that broke other
//! runtimes) must fail, leave the host unchanged (checked from the host) and leave the node
//! healthy. Each isolation feature has a test that fails when it is removed: the user
//! namespace (`sandbox_root_is_an_unprivileged_host_uid`) and the /proc hardening
//! (`proc_and_sys_are_hardened`).
//! Run as root: `cargo test -p dsec-edge --test hostile` (needs the installed debian image
//! for the system-call attacks, which use python3).

mod daemon;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use daemon::Daemon;
use dsec_sdk::{Client, CreateSandboxRequest};

/// Runs `script` with `sh -c` as the sandbox's root: (exit code, stdout, stderr).
async fn sh(c: &Client, id: &str, script: &str) -> (i32, String, String) {
    let out = c
        .exec(id, &["sh", "-c", script], None)
        .await
        .unwrap_or_else(|e| panic!("exec {script:?}: {e}"));
    (
        out.exit_code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

async fn create(c: &Client, request: CreateSandboxRequest) -> String {
    c.create(request).await.expect("create a sandbox").id
}

/// Host sysctls an attacker would change to take over or weaken the node.
const HOST_SYSCTLS: &[&str] = &[
    "kernel/core_pattern",
    "kernel/core_uses_pid",
    "kernel/modprobe",
    "kernel/panic_on_oops",
    "kernel/panic",
    "kernel/randomize_va_space",
    "kernel/sysrq",
    "kernel/hostname",
    "kernel/domainname",
    "kernel/printk",
    "vm/min_free_kbytes",
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "fs/file-max",
    "fs/suid_dumpable",
    "net/ipv4/ip_forward",
];

fn host_sysctls() -> BTreeMap<&'static str, String> {
    HOST_SYSCTLS
        .iter()
        .filter_map(|k| {
            std::fs::read_to_string(Path::new("/proc/sys").join(k))
                .ok()
                .map(|v| (*k, v))
        })
        .collect()
}

/// Host pids whose PID namespace is the one of `agent_pid` (the sandbox's processes).
fn sandbox_pids(agent_pid: u32) -> Vec<u32> {
    let ns = std::fs::read_link(format!("/proc/{agent_pid}/ns/pid")).expect("agent pid ns");
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| std::fs::read_link(format!("/proc/{pid}/ns/pid")).is_ok_and(|l| l == ns))
        .collect()
}

/// Real, effective, saved and filesystem uid of a host process.
fn host_uids(pid: u32) -> Vec<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .map(|v| {
            v.split_whitespace()
                .filter_map(|n| n.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test]
async fn sandbox_root_is_an_unprivileged_host_uid() {
    let (daemon, client) = Daemon::start("hostile-uid", &[]).await;
    let c = &client;
    let a = create(c, Default::default()).await;
    let b = create(c, Default::default()).await;

    let (code, out, err) = sh(
        c,
        &a,
        "id -u; cat /proc/self/uid_map; stat -c %u:%g /bin/busybox; \
         touch /etc/owned-by-root && stat -c %u /etc/owned-by-root; sleep 30 >/dev/null &",
    )
    .await;
    assert_eq!(code, 0, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "0", "sandbox root is uid 0 inside: {out}");
    let map: Vec<u64> = lines[1]
        .split_whitespace()
        .map(|n| n.parse().unwrap())
        .collect();
    assert_eq!(map.len(), 3, "one uid_map line: {out}");
    let (base, count) = (map[1], map[2]);
    assert_eq!(map[0], 0);
    assert!(base >= 65536, "sandbox root maps to host uid {base}");
    assert_eq!(count, 65536);
    // The image's files keep their owners inside (idmapped layers), and root may write them.
    assert_eq!(
        lines[2], "0:0",
        "image files not owned by sandbox root: {out}"
    );
    assert_eq!(lines[3], "0", "{out}");

    // From the host: every process of the sandbox, its agent included, runs as a host uid
    // of the sandbox's range, never as host root.
    let info = c.get(&a).await.unwrap();
    let pids = sandbox_pids(info.pid);
    assert!(pids.len() >= 2, "agent and sleep expected, found {pids:?}");
    for pid in &pids {
        for uid in host_uids(*pid) {
            assert!(
                (base..base + count).contains(&uid),
                "host pid {pid} of the sandbox runs as host uid {uid} (range {base}+{count})"
            );
        }
    }
    // Another sandbox gets another range.
    let (_, other, _) = sh(c, &b, "cat /proc/self/uid_map").await;
    let other_base: u64 = other.split_whitespace().nth(1).unwrap().parse().unwrap();
    assert_ne!(other_base, base, "two sandboxes share a host id range");
    daemon.stop(client).await;
}

#[tokio::test]
async fn proc_and_sys_are_hardened() {
    let (daemon, client) = Daemon::start("hostile-proc", &[]).await;
    let c = &client;
    let id = create(c, Default::default()).await;

    // Read-only, whatever the caller's privileges: the mount itself says so.
    let (_, out, _) = sh(c, &id, "cat /proc/self/mountinfo").await;
    for path in [
        "/proc/sys",
        "/proc/sysrq-trigger",
        "/proc/irq",
        "/proc/bus",
        "/proc/fs",
    ] {
        if !Path::new(path).exists() {
            continue;
        }
        let line = out
            .lines()
            .find(|l| l.split_whitespace().nth(4) == Some(path))
            .unwrap_or_else(|| panic!("{path} is not a mount of its own:\n{out}"));
        let options = line.split_whitespace().nth(5).unwrap();
        assert!(
            options.split(',').any(|o| o == "ro"),
            "{path} mounted {options}"
        );
    }
    let (code, _, err) = sh(c, &id, "echo '|/tmp/x' > /proc/sys/kernel/core_pattern").await;
    assert_ne!(code, 0);
    assert!(err.contains("Read-only file system"), "{err}");
    // Kernel memory, keys, timer and scheduler internals: nothing to read.
    for file in [
        "/proc/kcore",
        "/proc/keys",
        "/proc/timer_list",
        "/proc/sched_debug",
        "/proc/interrupts",
    ] {
        if !Path::new(file).exists() {
            continue;
        }
        // Masked (reads as empty) or, where only host root could read it, refused.
        let (code, out, err) = sh(c, &id, &format!("wc -c < {file}")).await;
        let refused = code != 0 && err.contains("Permission denied");
        assert!(
            refused || (code, out.trim()) == (0, "0"),
            "{file} readable: {out}{err}"
        );
    }
    // A cgroup namespace: the sandbox's cgroup is its root.
    let (_, out, _) = sh(c, &id, "cat /proc/self/cgroup").await;
    assert!(!out.is_empty());
    for line in out.lines() {
        assert!(line.ends_with(":/"), "cgroup path visible: {line}");
    }
    // No host path anywhere: agent arguments, mount sources, socket paths, environment.
    let state = daemon.state.to_string_lossy().into_owned();
    let home = daemon::dsec_home().to_string_lossy().into_owned();
    let (_, out, _) = sh(
        c,
        &id,
        "tr '\\0' ' ' < /proc/1/cmdline; echo; cat /proc/self/mountinfo /proc/net/unix; env",
    )
    .await;
    assert!(
        out.starts_with("dsec-agent --container-launch-fd "),
        "agent cmdline: {out}"
    );
    for leak in [
        state.as_str(),
        home.as_str(),
        "agent.sock",
        "/run/dsec",
        "/tmp/dsec",
    ] {
        assert!(
            !out.contains(leak),
            "host path {leak:?} visible inside:\n{out}"
        );
    }
    daemon.stop(client).await;
}

#[tokio::test]
async fn sysctl_and_core_pattern_attacks_change_nothing_on_the_host() {
    let (daemon, client) = Daemon::start("hostile-sysctl", &[]).await;
    let c = &client;
    let id = create(c, Default::default()).await;
    let before = host_sysctls();
    assert!(before.len() >= 10, "host sysctls unreadable: {before:?}");
    let marker = std::env::temp_dir().join(format!("dsec-pwned-{}", std::process::id()));
    let _ = std::fs::remove_file(&marker);

    // Every sysctl: open it for writing (no bytes written, so nothing changes even on
    // success). None may open.
    let (code, out, err) = sh(
        c,
        &id,
        "n=0; for f in $(find /proc/sys -type f); do n=$((n+1)); \
         ( : > \"$f\" ) 2>/dev/null && echo \"OPENED $f\"; done; echo tried=$n",
    )
    .await;
    assert_eq!(code, 0, "{err}");
    let tried: usize = out
        .lines()
        .find_map(|l| l.strip_prefix("tried="))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(tried > 100, "only {tried} sysctls found: {out}");
    let opened: Vec<&str> = out.lines().filter(|l| l.starts_with("OPENED")).collect();
    assert!(opened.is_empty(), "writable sysctls: {opened:?}");

    // The attack that got host root: a piped core_pattern, then a crash.
    let script = format!(
        "printf '#!/bin/sh\\necho pwned > {m}\\n' > /tmp/pwn; chmod +x /tmp/pwn; \
         echo '|/proc/%P/root/tmp/pwn' > /proc/sys/kernel/core_pattern; \
         echo 1 > /proc/sys/kernel/panic_on_oops; echo 0 > /proc/sys/kernel/randomize_va_space; \
         echo 2 > /proc/sys/vm/overcommit_memory; echo 1 > /proc/sys/vm/min_free_kbytes; \
         echo c > /proc/sysrq-trigger; ulimit -c unlimited; sh -c 'kill -SEGV $$'; true",
        m = marker.display()
    );
    sh(c, &id, &script).await;
    std::thread::sleep(Duration::from_millis(300));
    assert!(!marker.exists(), "the host ran the sandbox's core handler");
    assert_eq!(host_sysctls(), before, "a host sysctl changed");
    // The node is healthy: the same sandbox and a new one still work.
    assert_eq!(sh(c, &id, "echo ok").await.1, "ok\n");
    let fresh = create(c, Default::default()).await;
    assert_eq!(sh(c, &fresh, "echo ok").await.1, "ok\n");
    daemon.stop(client).await;
}

#[tokio::test]
async fn the_agent_and_the_node_are_out_of_reach() {
    let (daemon, client) = Daemon::start("hostile-agent", &[]).await;
    let c = &client;
    let id = create(c, Default::default()).await;
    let agent = dsec_edge::find_binary("dsec-agent").expect("agent binary");
    let agent_bytes = std::fs::read(&agent).unwrap();

    // Signals to PID 1, its memory, environment, descriptors, root and executable.
    let (_, out, _) = sh(
        c,
        &id,
        "kill -9 1; kill -STOP 1; kill -TERM 1; \
         for f in environ mem fd/0 root/ exe maps; do \
           cat /proc/1/$f > /dev/null 2>&1 && echo \"READ $f\"; done; \
         ls /proc/1/fd > /dev/null 2>&1 && echo 'LISTED fd'; \
         echo x >> /proc/1/exe 2>/dev/null && echo 'WROTE exe'; \
         find / -xdev -type s 2>/dev/null | sed 's/^/SOCKET /'; \
         wget -q -T 2 -O- http://127.0.0.1:7080/ > /dev/null 2>&1 && echo 'REACHED http'; \
         wget -q -T 2 -O- http://127.0.0.1:9464/metrics > /dev/null 2>&1 && echo 'REACHED metrics'; \
         echo done",
    )
    .await;
    assert!(out.ends_with("done\n"), "{out}");
    let hits: Vec<&str> = out.lines().filter(|l| *l != "done").collect();
    assert!(hits.is_empty(), "reached the agent or node: {hits:?}");
    // The agent survived all of it and still answers.
    assert_eq!(sh(c, &id, "echo alive").await.1, "alive\n");
    assert_eq!(
        std::fs::read(&agent).unwrap(),
        agent_bytes,
        "agent binary changed"
    );

    // Overwriting the binaries a command runs changes the sandbox's copy only.
    let image_sh = daemon::dsec_home().join("images/busybox/rootfs/bin/busybox");
    let image_bytes = std::fs::read(&image_sh).unwrap();
    let (code, _, err) = sh(
        c,
        &id,
        "cat /proc/self/exe > /dev/null; cp /bin/busybox /tmp/sh && \
         exec /tmp/sh -c \"echo '#!/bin/false' > /bin/busybox\"",
    )
    .await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        std::fs::read(&image_sh).unwrap(),
        image_bytes,
        "the image's busybox changed"
    );
    daemon.stop(client).await;
}

#[tokio::test]
async fn system_call_escapes_are_refused() {
    daemon::use_installed_image("debian");
    let (daemon, client) = Daemon::start("hostile-syscalls", &[]).await;
    let c = &client;
    let id = create(
        c,
        CreateSandboxRequest {
            image: "debian".into(),
            ..Default::default()
        },
    )
    .await;
    // Each attempt prints NAME=errno (0 = it worked).
    let script = r#"
import ctypes, os, socket
libc = ctypes.CDLL(None, use_errno=True)
def call(name, nr, *args):
    rc = libc.syscall(nr, *args)
    print(f"{name}={0 if rc >= 0 else ctypes.get_errno()}")
call("unshare_user", 272, 0x10000000)
call("unshare_mount", 272, 0x00020000)
call("unshare_net", 272, 0x40000000)
call("clone3", 435, 0, 0)
call("mount", 165, b"none", b"/mnt", b"tmpfs", 0, 0)
call("open_tree", 428, -100, b"/", 1)
call("setns", 308, 0, 0)
call("open_by_handle_at", 304, 3, 0, 0)
call("name_to_handle_at", 303, -100, b"/", 0, 0, 0)
call("add_key", 248, b"user", b"k", b"v", 1, -4)
call("keyctl", 250, 0, -4, 0)
call("bpf", 321, 0, 0, 0)
call("perf_event_open", 298, 0, 0, -1, -1, 0)
call("userfaultfd", 323, 0)
call("io_uring_setup", 425, 1, 0)
call("ptrace_attach", 101, 16, 1, 0, 0)
call("ptrace_seize", 101, 0x4206, 1, 0, 0)
call("init_module", 175, 0, 0, b"")
call("reboot", 169, 0xfee1dead, 672274793, 0x1234567, 0)
call("sethostname", 170, b"x", 1)
call("mknod_block", 133, b"/tmp/sda", 0o60600, 0x800)
for fam, typ, proto, name in [(socket.AF_INET, socket.SOCK_RAW, 1, "raw_icmp"), (17, socket.SOCK_RAW, 0, "packet")]:
    try:
        socket.socket(fam, typ, proto).close(); print(f"{name}=0")
    except OSError as e:
        print(f"{name}={e.errno}")
# chroot escape: the old root is detached, so climbing out finds the sandbox's root.
open("/marker-of-the-sandbox", "w").close()
os.makedirs("/tmp/jail", exist_ok=True)
fd = os.open("/", os.O_RDONLY)
os.chroot("/tmp/jail"); os.fchdir(fd)
for _ in range(64): os.chdir("..")
os.chroot(".")
print("escaped=" + ("0" if not os.path.exists("/marker-of-the-sandbox") else "1"))
"#;
    c.write_file(&id, "/tmp/attack.py", 0o644, script.as_bytes().to_vec())
        .await
        .unwrap();
    let (code, out, err) = sh(c, &id, "python3 /tmp/attack.py").await;
    assert_eq!(code, 0, "{out}{err}");
    let results: BTreeMap<&str, i32> = out
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k, v.parse().unwrap()))
        .collect();
    assert_eq!(results.len(), 24, "not every attempt reported: {out}{err}");
    for (name, errno) in &results {
        match *name {
            // Climbing out of a chroot lands in the sandbox's own root.
            "escaped" => assert_eq!(*errno, 1, "chroot escape reached another root"),
            "clone3" => assert_eq!(*errno, libc::ENOSYS, "clone3"),
            _ => assert!(
                *errno == libc::EPERM || *errno == libc::EACCES,
                "{name} was not refused (errno {errno})"
            ),
        }
    }
    daemon.stop(client).await;
}

#[tokio::test]
async fn commands_inherit_no_descriptor_of_the_agent() {
    let (daemon, client) = Daemon::start("hostile-fds", &[]).await;
    let c = &client;
    let id = create(c, Default::default()).await;
    // What a command, a background child of it and a PTY command hold (the "leaky vessels"
    // class: a descriptor of the runtime reaching the workload).
    let list = "for f in /proc/self/fd/*; do echo \"$f -> $(readlink $f)\"; done";
    let (_, plain, _) = sh(c, &id, list).await;
    let (_, child, _) = sh(c, &id, &format!("sh -c '{list}' & wait")).await;
    let mut start = dsec_sdk::ExecStart {
        sandbox_id: id.clone(),
        argv: vec!["sh".into(), "-c".into(), list.into()],
        ..Default::default()
    };
    start.pty = Some(dsec_sdk::pty(24, 200));
    let pty = c.exec_stream(start).await.unwrap().wait().await.unwrap();
    let pty = String::from_utf8_lossy(&pty.stdout).replace('\r', "");
    for out in [&plain, &child, &pty] {
        let fds: Vec<&str> = out.lines().filter(|l| l.contains(" -> ")).collect();
        assert!(fds.len() >= 3, "no descriptors listed: {out}");
        for line in fds {
            let (fd, target) = line.split_once(" -> ").unwrap();
            let n: u32 = fd.rsplit('/').next().unwrap().parse().unwrap();
            // Only the command's own stdio (pipes, a terminal, /dev/null; the shell keeps
            // copies of them above fd 9) and the loop's own directory stream: never a
            // socket, an event fd or a file of the agent's.
            let ok = target.starts_with("pipe:")
                || target == "/dev/null"
                || target.starts_with("/dev/pts/")
                || (n >= 3 && (target.starts_with("/proc/") || target.is_empty()));
            assert!(ok, "inherited descriptor {line}");
        }
    }
    daemon.stop(client).await;
}

#[tokio::test]
async fn filling_tmp_shm_and_the_writable_layer_is_enospc_and_the_sandbox_survives() {
    let (daemon, client) = Daemon::start("hostile-fill", &[]).await;
    let c = &client;
    let id = create(
        c,
        CreateSandboxRequest {
            memory_mib: 256,
            disk_mib: 64,
            ..Default::default()
        },
    )
    .await;
    for (path, cap_mib) in [
        ("/tmp/fill", 64),
        ("/fill", 64),
        ("/dev/shm/fill", 64),
        ("/run/fill", 16),
    ] {
        let (code, _, err) = sh(
            c,
            &id,
            &format!(
                "dd if=/dev/zero of={path} bs=1M count=400 2>&1 >/dev/null | tail -n 3 >&2; exit 1"
            ),
        )
        .await;
        assert_eq!(code, 1);
        assert!(err.contains("No space left"), "{path}: {err}");
        let (_, size, _) = sh(c, &id, &format!("du -m {path} | cut -f1")).await;
        let size: u64 = size.trim().parse().unwrap();
        assert!(size <= cap_mib, "{path} grew to {size} MiB");
        // The agent survived the full filesystem and frees it.
        c.exec(&id, &["rm", path], None).await.unwrap();
    }
    assert_eq!(sh(c, &id, "echo alive").await.1, "alive\n");
    daemon.stop(client).await;
}

#[tokio::test]
async fn fork_and_memory_bombs_are_contained() {
    let (daemon, client) = Daemon::start("hostile-bombs", &[]).await;
    let c = &client;
    let id = create(
        c,
        CreateSandboxRequest {
            memory_mib: 96,
            disk_mib: 32,
            pids_limit: 64,
            ..Default::default()
        },
    )
    .await;
    // Commands are the OOM killer's first choice, not the agent (read by the shell itself,
    // after the agent's post-exec write).
    let (_, adj, _) = sh(
        c,
        &id,
        "sleep 0.2; read v < /proc/self/oom_score_adj; echo $v; read a < /proc/1/oom_score_adj; echo $a",
    )
    .await;
    let adj: Vec<i32> = adj.lines().map(|l| l.parse().unwrap()).collect();
    assert_eq!(adj[0], 1000, "a command's oom_score_adj");
    assert!(adj[1] <= 0, "the agent's oom_score_adj is {}", adj[1]);
    // A fork bomb hits the pid limit; a timeout kills it.
    let started = Instant::now();
    let mut start = dsec_sdk::ExecStart {
        sandbox_id: id.clone(),
        argv: vec![
            "sh".into(),
            "-c".into(),
            "b() { b | b & }; b; sleep 60".into(),
        ],
        timeout_ms: 3000,
        ..Default::default()
    };
    let bomb = c.exec_stream(start.clone()).await.unwrap().wait().await;
    assert!(started.elapsed() < Duration::from_secs(30), "bomb ran on");
    drop(bomb);
    // The bomb's last forks may still hold the pid limit for a moment after the kill (a new
    // command then gets EAGAIN): give the sandbox up to 10 s to be usable and nearly empty.
    let deadline = Instant::now() + Duration::from_secs(10);
    let pids = loop {
        let counted = c
            .exec(&id, &["sh", "-c", "ls -d /proc/[0-9]* | wc -l"], None)
            .await;
        match counted {
            Ok(out) => {
                let n: u32 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
                if n < 64 || Instant::now() > deadline {
                    break n;
                }
            }
            Err(e) if Instant::now() > deadline => panic!("sandbox unusable after the bomb: {e}"),
            Err(_) => {}
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(pids < 64, "bomb processes left: {pids}");
    // A memory bomb (the shell holds 500 MB of output in a variable) is OOM-killed alone.
    start.argv = vec![
        "sh".into(),
        "-c".into(),
        "x=$(head -c 500000000 /dev/zero | tr '\\0' a); echo ${#x}".into(),
    ];
    start.timeout_ms = 60_000;
    let out = c.exec_stream(start).await.unwrap().wait().await.unwrap();
    assert_eq!(
        out.exit_code(),
        128 + 9,
        "500 MB held in a 96 MiB sandbox: {out:?}"
    );
    assert_eq!(sh(c, &id, "echo alive").await.1, "alive\n");
    // The node still creates sandboxes.
    let fresh = create(c, Default::default()).await;
    assert_eq!(sh(c, &fresh, "echo ok").await.1, "ok\n");
    daemon.stop(client).await;
}

#[tokio::test]
async fn symlink_races_against_file_calls_stay_inside() {
    let (daemon, client) = Daemon::start("hostile-symlinks", &[]).await;
    let c = &client;
    let id = create(c, Default::default()).await;
    let canary = std::env::temp_dir().join(format!("dsec-canary-{}", std::process::id()));
    std::fs::write(&canary, "host").unwrap();
    let core_pattern = std::fs::read_to_string("/proc/sys/kernel/core_pattern").unwrap();

    // Links to host paths resolve inside the sandbox's root.
    let (code, _, err) = sh(
        c,
        &id,
        &format!(
            "mkdir -p /tmp/real && echo inside > {p}; ln -s {p} /tmp/to-canary; \
             ln -s /proc/sys/kernel/core_pattern /tmp/to-core",
            p = canary.display()
        ),
    )
    .await;
    assert_eq!(code, 0, "{err}");
    let read = c.read_file(&id, "/tmp/to-canary").await.unwrap();
    assert_eq!(read, b"inside\n", "read followed a link out of the sandbox");
    assert!(c
        .write_file(&id, "/tmp/to-core", 0o644, b"|/tmp/x".to_vec())
        .await
        .is_err());

    // A directory swapped with a link to / and to /proc/sys/kernel while files are written.
    let mut swap = dsec_sdk::ExecStart {
        sandbox_id: id.clone(),
        argv: vec![
            "sh".into(),
            "-c".into(),
            "end=$(($(date +%s)+3)); while [ $(date +%s) -lt $end ]; do \
             rm -rf /tmp/d; mkdir /tmp/d; rm -rf /tmp/d; ln -s / /tmp/d; \
             rm -f /tmp/d; ln -s /proc/sys/kernel /tmp/d; rm -f /tmp/d; done"
                .into(),
        ],
        ..Default::default()
    };
    swap.timeout_ms = 10_000;
    let racer = c.exec_stream(swap).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(3);
    let mut writes = 0;
    while Instant::now() < deadline {
        for name in ["core_pattern", "canary"] {
            let _ = c
                .write_file(&id, &format!("/tmp/d/{name}"), 0o644, b"|/tmp/x".to_vec())
                .await;
            writes += 1;
        }
    }
    racer.wait().await.unwrap();
    assert!(writes > 20, "only {writes} writes raced");
    assert_eq!(std::fs::read_to_string(&canary).unwrap(), "host");
    assert_eq!(
        std::fs::read_to_string("/proc/sys/kernel/core_pattern").unwrap(),
        core_pattern
    );
    let _ = std::fs::remove_file(&canary);
    daemon.stop(client).await;
}
