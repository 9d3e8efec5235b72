//! The node API's rules through a real `dsec-edge` (container backend): input bounds at their
//! limits, refused network policies, paged List, admission, idempotent Create, and what is
//! left of a sandbox that died. Run as root: `cargo test -p dsec-edge --test api`.

mod daemon;

use std::collections::HashMap;

use daemon::Daemon;
use dsec_sdk::{Client, CreateSandboxRequest, ExecStart, ListSandboxesRequest, NetworkPolicy};

fn code(result: Result<impl std::fmt::Debug, dsec_sdk::Error>) -> (tonic::Code, String) {
    let err = result.expect_err("the node accepted a request past a limit");
    (err.code().expect("a status from the node"), err.to_string())
}

fn assert_invalid(result: Result<impl std::fmt::Debug, dsec_sdk::Error>, needle: &str) {
    let (code, text) = code(result);
    assert_eq!(code, tonic::Code::InvalidArgument, "{text}");
    assert!(text.contains(needle), "{needle:?} not in: {text}");
}

fn request(labels: HashMap<String, String>, env: HashMap<String, String>) -> CreateSandboxRequest {
    CreateSandboxRequest {
        memory_mib: 64,
        disk_mib: 16,
        labels,
        env,
        ..Default::default()
    }
}

async fn exec_ok(client: &Client, start: ExecStart) -> String {
    let out = client.exec_with(start, None, |_, _| {}).await.unwrap();
    assert_eq!(
        out.exit_code(),
        0,
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inputs_are_bounded_at_documented_limits() {
    let (daemon, client) = Daemon::start("bounds", &[]).await;
    let none = HashMap::new;

    // Labels: 64 accepted, 65 refused; key 63 bytes / 64; value 256 bytes / 257; charset.
    let labels = |n: usize| -> HashMap<String, String> {
        (0..n).map(|i| (format!("k{i}"), "v".into())).collect()
    };
    let sb = client.create(request(labels(64), none())).await.unwrap();
    assert_eq!(sb.labels.len(), 64);
    client.delete(&sb.id).await.unwrap();
    assert_invalid(
        client.create(request(labels(65), none())).await,
        "65 labels, at most 64",
    );
    let one = |k: String, v: String| HashMap::from([(k, v)]);
    let sb = client
        .create(request(one("k".repeat(63), "v".repeat(256)), none()))
        .await
        .unwrap();
    client.delete(&sb.id).await.unwrap();
    assert_invalid(
        client
            .create(request(one("k".repeat(64), "v".into()), none()))
            .await,
        "keys are 1 to 63 bytes",
    );
    assert_invalid(
        client
            .create(request(one("k".into(), "v".repeat(257)), none()))
            .await,
        "257 bytes, at most 256",
    );
    assert_invalid(
        client
            .create(request(one("bad key".into(), "v".into()), none()))
            .await,
        "label key",
    );
    assert_invalid(client.list(labels(65)).await, "at most 64");

    // Sandbox env: 256 vars / 257; value 32 KiB / +1; total 128 KiB / +1.
    let vars = |n: usize| -> HashMap<String, String> {
        (0..n).map(|i| (format!("V{i}"), "x".into())).collect()
    };
    let sb = client.create(request(none(), vars(256))).await.unwrap();
    client.delete(&sb.id).await.unwrap();
    assert_invalid(
        client.create(request(none(), vars(257))).await,
        "257 environment variables, at most 256",
    );
    assert_invalid(
        client
            .create(request(
                none(),
                one("BIG".into(), "x".repeat(32 * 1024 + 1)),
            ))
            .await,
        "at most 32768 (32 KiB)",
    );
    // Four variables of K0..K3 with 32764-byte values: 4 x (2 + 32764 + 2) = 128 KiB exactly.
    let full = |extra: usize| -> HashMap<String, String> {
        (0..4)
            .map(|i| {
                let len = 32764 + if i == 0 { extra } else { 0 };
                (format!("K{i}"), "x".repeat(len))
            })
            .collect()
    };
    assert_invalid(
        client.create(request(none(), full(1))).await,
        "131073 bytes in all, at most 131072",
    );
    // At the limit the sandbox is created and commands still run: per-exec env and argv at
    // their limits too never reach the kernel's E2BIG.
    let id = client.create(request(none(), full(0))).await.unwrap().id;
    let exec_env: HashMap<String, String> = (0..4)
        .map(|i| (format!("E{i}"), "y".repeat(32764)))
        .collect();
    // argv: "sh\0" + "-c\0" + script\0 + "_\0" + two fillers = 256 KiB exactly, the
    // first filler at the 128 KiB per-string limit (with its NUL).
    let script = "echo ${#K0} ${#E3} $#";
    let used = 3 + 3 + script.len() + 1 + 2;
    let filler = "z".repeat((128 << 10) - 1);
    let rest = "w".repeat((256 << 10) - used - (128 << 10) - 1);
    let start = |argv: Vec<String>, env: HashMap<String, String>| ExecStart {
        sandbox_id: id.clone(),
        argv,
        env,
        ..Default::default()
    };
    let argv = vec![
        "sh".to_string(),
        "-c".into(),
        script.into(),
        "_".into(),
        filler,
        rest,
    ];
    assert_eq!(
        exec_ok(&client, start(argv.clone(), exec_env.clone())).await,
        "32764 32764 2\n"
    );
    let mut longer = argv.clone();
    longer[5].push('w');
    assert_invalid(
        client
            .exec_with(start(longer, HashMap::new()), None, |_, _| {})
            .await,
        "262145 bytes in all, at most 262144",
    );
    let mut too_much_env = exec_env.clone();
    too_much_env.insert("E0".into(), "y".repeat(32765));
    assert_invalid(
        client
            .exec_with(start(argv.clone(), too_much_env), None, |_, _| {})
            .await,
        "env of this exec",
    );
    // One argument is capped at the kernel's 128 KiB per string.
    assert_invalid(
        client
            .exec_with(
                start(vec!["true".into(), "a".repeat(128 << 10)], HashMap::new()),
                None,
                |_, _| {},
            )
            .await,
        "argv[1] is 131072 bytes, at most 131071",
    );

    // Exec timeouts: 7 days accepted, a millisecond more refused, a wrapped negative named.
    let mut timed = start(vec!["true".into()], HashMap::new());
    timed.timeout_ms = 7 * 24 * 3600 * 1000;
    exec_ok(&client, timed.clone()).await;
    timed.timeout_ms += 1;
    assert_invalid(
        client.exec_with(timed.clone(), None, |_, _| {}).await,
        "more than 7 days",
    );
    timed.timeout_ms = -5000i64 as u64;
    assert_invalid(
        client.exec_with(timed, None, |_, _| {}).await,
        "negative timeout wrapped",
    );
    // TTLs: a year accepted, more refused.
    client.set_timeout(&id, 365 * 24 * 3600).await.unwrap();
    assert_invalid(
        client.set_timeout(&id, 365 * 24 * 3600 + 1).await,
        "more than 365 days",
    );
    // Oversized ids and paths are refused before anything is looked up.
    assert_invalid(client.get(&"s".repeat(65)).await, "at most 64");
    assert_invalid(
        client
            .read_file(&id, &format!("/{}", "p".repeat(4096)))
            .await,
        "4097 bytes, at most 4096",
    );
    client.delete(&id).await.unwrap();
    drop(daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn network_policies_that_cannot_be_enforced_are_refused() {
    let (daemon, client) = Daemon::start("network", &[]).await;
    for network in [
        NetworkPolicy {
            allow_internet: true,
            ..NetworkPolicy::default()
        },
        NetworkPolicy {
            allow: vec!["pypi".into()],
            ..NetworkPolicy::default()
        },
    ] {
        let mut r = request(HashMap::new(), HashMap::new());
        r.network = Some(network.clone());
        let (code, text) = code(client.create(r).await);
        assert_eq!(code, tonic::Code::Unimplemented, "{network:?}: {text}");
        assert!(text.contains("loopback only"), "{text}");
    }
    assert!(
        client.list(HashMap::new()).await.unwrap().is_empty(),
        "a refused create left a sandbox"
    );
    // An empty policy, explicit or left out, is fine.
    let mut r = request(HashMap::new(), HashMap::new());
    r.network = Some(NetworkPolicy::default());
    let id = client.create(r).await.unwrap().id;
    client.delete(&id).await.unwrap();
    drop(daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_pages_through_more_sandboxes_than_a_page() {
    let (daemon, client) = Daemon::start("paging", &[]).await;
    let mut ids = Vec::new();
    for i in 0..7 {
        let labels = HashMap::from([("odd".to_string(), (i % 2).to_string())]);
        ids.push(
            client
                .create(request(labels, HashMap::new()))
                .await
                .unwrap()
                .id,
        );
    }
    ids.sort();
    // Pages of 3: 3 + 3 + 1, in id order, each token the page's last id, no repeats.
    let mut seen = Vec::new();
    let mut token = String::new();
    let mut sizes = Vec::new();
    loop {
        let page = client
            .list_page(ListSandboxesRequest {
                page_size: 3,
                page_token: token.clone(),
                ..Default::default()
            })
            .await
            .unwrap();
        sizes.push(page.sandboxes.len());
        seen.extend(page.sandboxes.into_iter().map(|s| s.id));
        if page.next_page_token.is_empty() {
            break;
        }
        assert_eq!(&page.next_page_token, seen.last().unwrap());
        token = page.next_page_token;
    }
    assert_eq!(sizes, [3, 3, 1]);
    assert_eq!(seen, ids);
    // The SDK's list pages transparently; with a label filter too.
    let all: Vec<String> = client
        .list(HashMap::new())
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.id)
        .collect();
    assert_eq!(all, ids);
    let odd = client
        .list(HashMap::from([("odd".to_string(), "1".to_string())]))
        .await
        .unwrap();
    assert_eq!(odd.len(), 3);
    // A page past the end is empty; a deleted token still pages on from where it was.
    client.delete(&ids[2]).await.unwrap();
    let page = client
        .list_page(ListSandboxesRequest {
            page_size: 2,
            page_token: ids[2].clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    let got: Vec<_> = page.sandboxes.iter().map(|s| s.id.clone()).collect();
    assert_eq!(got, ids[3..5]);
    for bad in [-1, 1001] {
        assert_invalid(
            client
                .list_page(ListSandboxesRequest {
                    page_size: bad,
                    ..Default::default()
                })
                .await,
            "give 1 to 1000",
        );
    }
    let ok_max = client
        .list_page(ListSandboxesRequest {
            page_size: 1000,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(ok_max.sandboxes.len(), 6);
    assert!(ok_max.next_page_token.is_empty());
    for id in ids.iter().filter(|id| **id != ids[2]) {
        client.delete(id).await.unwrap();
    }
    drop(daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_reserves_what_the_memory_cgroup_allows() {
    let (daemon, client) = Daemon::start(
        "admission",
        &["--memory-mib", "1000", "--overcommit-memory", "1"],
    )
    .await;
    let sized = |memory_mib, disk_mib| CreateSandboxRequest {
        memory_mib,
        disk_mib,
        ..Default::default()
    };
    // A container's disk is a tmpfs charged to its memory cgroup: 64 + 512 MiB reserved, and
    // that is the cgroup's limit.
    let a = client.create(sized(64, 512)).await.unwrap();
    assert_eq!(a.memory_limit_bytes, 576 << 20);
    assert_eq!(a.memory_mib, 64);
    assert_eq!(a.disk_mib, 512);
    let reserved = || async {
        client
            .node_status()
            .await
            .unwrap()
            .memory_mib
            .unwrap()
            .reserved
    };
    assert_eq!(reserved().await, 576);
    let (code, text) = code(client.create(sized(64, 512)).await);
    assert_eq!(code, tonic::Code::ResourceExhausted, "{text}");
    assert!(
        text.contains(
            "memory budget spent: 576 of 1000 MiB of memory reserved, this sandbox needs 576"
        ),
        "{text}"
    );
    // Fits: 576 + 80 <= 1000.
    let b = client.create(sized(64, 16)).await.unwrap();
    assert_eq!(b.memory_limit_bytes, 80 << 20);
    assert_eq!(
        client.get(&b.id).await.unwrap().memory_limit_bytes,
        80 << 20
    );
    assert_eq!(reserved().await, 656);
    client.delete(&a.id).await.unwrap();
    client.delete(&b.id).await.unwrap();
    assert_eq!(reserved().await, 0);
    drop(daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creates_with_one_request_id_make_one_sandbox() {
    let (daemon, client) = Daemon::start("idempotent", &[]).await;
    let with_id = |request_id: &str| CreateSandboxRequest {
        request_id: request_id.into(),
        ..request(HashMap::new(), HashMap::new())
    };
    // Two at once: the second waits for the first and gets its sandbox.
    let (a, b) = tokio::join!(
        client.create(with_id("req-1")),
        client.create(with_id("req-1"))
    );
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a.id, b.id);
    assert_eq!(a.request_id, "req-1");
    // A later retry too; only one sandbox exists.
    assert_eq!(client.create(with_id("req-1")).await.unwrap().id, a.id);
    assert_eq!(client.list(HashMap::new()).await.unwrap().len(), 1);
    // The same request_id with a different spec is refused, naming the rule.
    let mut other = with_id("req-1");
    other.memory_mib = 128;
    let (status, text) = code(client.create(other).await);
    assert_eq!(status, tonic::Code::AlreadyExists, "{text}");
    assert!(text.contains("different spec"), "{text}");
    // A failed first attempt is not remembered: the retry creates.
    let mut failing = with_id("req-2");
    failing.image = "no-such-image".into();
    assert_eq!(code(client.create(failing).await).0, tonic::Code::NotFound);
    let c = client.create(with_id("req-2")).await.unwrap();
    assert_ne!(c.id, a.id);
    // Once its sandbox is deleted, a request_id creates afresh.
    client.delete(&a.id).await.unwrap();
    let d = client.create(with_id("req-1")).await.unwrap();
    assert_ne!(d.id, a.id);
    // Without a request_id the SDK sends a fresh one each time: two sandboxes.
    let e = client
        .create(request(HashMap::new(), HashMap::new()))
        .await
        .unwrap();
    let f = client
        .create(request(HashMap::new(), HashMap::new()))
        .await
        .unwrap();
    assert_ne!(e.id, f.id);
    assert!(!e.request_id.is_empty() && e.request_id != f.request_id);
    // Bounded, plain request_ids only.
    assert_invalid(
        client.create(with_id(&"r".repeat(129))).await,
        "at most 128 bytes",
    );
    assert_invalid(client.create(with_id("a b")).await, "request_id");
    for id in [c.id, d.id, e.id, f.id] {
        client.delete(&id).await.unwrap();
    }
    drop(daemon);
}

async fn get_dead(client: &Client, id: &str) -> dsec_sdk::Sandbox {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let sb = client.get(id).await.unwrap();
        if sb.state == dsec_sdk::SandboxState::Dead as i32 {
            return sb;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the reaper never buried {id}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

fn kill9(pid: u32) {
    // SAFETY: kill(2) on a sandbox process this test created; no memory is involved.
    let rc = unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    assert_eq!(rc, 0, "kill {pid}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_sandbox_keeps_its_reason_and_logs() {
    let (daemon, client) = Daemon::start("dead", &[]).await;
    let sb = client
        .create(request(HashMap::new(), HashMap::new()))
        .await
        .unwrap();
    // An exec in flight when the agent dies ends with the reason, not a transport error.
    let mut running = client
        .exec_stream(ExecStart {
            sandbox_id: sb.id.clone(),
            argv: vec!["sh".into(), "-c".into(), "echo started; sleep 60".into()],
            ..Default::default()
        })
        .await
        .unwrap();
    loop {
        match running.next().await.unwrap() {
            Some(dsec_sdk::ExecEvent::Stdout(d)) if d.starts_with(b"started") => break,
            Some(_) => {}
            None => panic!("the command ended early"),
        }
    }
    kill9(sb.pid);
    let err = loop {
        match running.next().await {
            Ok(Some(_)) => {}
            Ok(None) => panic!("the exec ended without an error"),
            Err(err) => break err,
        }
    };
    assert_eq!(err.code(), Some(tonic::Code::FailedPrecondition), "{err}");
    assert!(err.to_string().contains("killed by SIGKILL"), "{err}");
    drop(running);

    // Get keeps showing it, dead, with the reason; it is gone from List.
    let dead = get_dead(&client, &sb.id).await;
    assert_eq!(
        dead.death_reason, "the agent was killed by SIGKILL",
        "{dead:?}"
    );
    assert!(dead.died_at_unix_ms > 0);
    assert!(client.list(HashMap::new()).await.unwrap().is_empty());
    // Runtime calls name the reason.
    for result in [
        client.exec(&sb.id, &["true"], None).await.map(|_| ()),
        client.read_file(&sb.id, "/etc/passwd").await.map(|_| ()),
        client.open_port(&sb.id, 80).await.map(|_| ()),
    ] {
        let (status, text) = code(result);
        assert_eq!(status, tonic::Code::FailedPrecondition, "{text}");
        assert!(
            text.contains("is dead: the agent was killed by SIGKILL"),
            "{text}"
        );
    }
    // Logs serve the kept tails: the daemon's events (with the death) and the agent's log.
    let mut logs: HashMap<String, Vec<u8>> = HashMap::new();
    client
        .logs(&sb.id, false, |chunk| {
            logs.entry(chunk.source).or_default().extend(chunk.data)
        })
        .await
        .unwrap();
    let events = String::from_utf8_lossy(&logs["events"]).into_owned();
    assert!(
        events.contains("died: the agent was killed by SIGKILL"),
        "{events}"
    );
    assert!(
        logs.contains_key("agent"),
        "no agent log kept: {:?}",
        logs.keys()
    );
    // Nothing of it is left on the host.
    assert!(!daemon.state.join("sandboxes").join(&sb.id).exists());
    // Delete forgets the tombstone.
    client.delete(&sb.id).await.unwrap();
    assert_eq!(code(client.get(&sb.id).await).0, tonic::Code::NotFound);
    drop(daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_dying_after_an_oom_kill_says_out_of_memory() {
    let (daemon, client) = Daemon::start("oom", &[]).await;
    let sb = client
        .create(CreateSandboxRequest {
            memory_mib: 48,
            disk_mib: 16,
            ..Default::default()
        })
        .await
        .unwrap();
    // A shell that grows past the 64 MiB limit is killed by the cgroup's OOM killer.
    let out = client
        .exec(
            &sb.id,
            &[
                "sh",
                "-c",
                "x=$(head -c 200000000 /dev/zero | tr '\\0' a); echo ${#x}",
            ],
            None,
        )
        .await;
    assert!(
        out.as_ref().map_or(true, |o| o.exit_code() != 0),
        "200 MB fit in a 64 MiB sandbox: {out:?}"
    );
    kill9(sb.pid);
    let dead = get_dead(&client, &sb.id).await;
    assert!(
        dead.death_reason.starts_with("the agent was killed by SIGKILL (out of memory: the memory cgroup's oom_kill count rose to"),
        "{}",
        dead.death_reason
    );
    assert!(
        dead.death_reason.contains("its limit is 64 MiB"),
        "{}",
        dead.death_reason
    );
    client.delete(&sb.id).await.unwrap();
    drop(daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restore_takes_only_snapshots_this_node_wrote() {
    let (daemon, client) = Daemon::start("restore", &[]).await;
    let restore = |snapshot: &str, request: CreateSandboxRequest| {
        let (client, snapshot) = (client.clone(), snapshot.to_string());
        async move { client.restore(&snapshot, request).await }
    };
    let plain = CreateSandboxRequest::default;
    assert_invalid(restore("snap/1", plain()).await, "absolute path");
    assert_invalid(restore("/tmp/../etc", plain()).await, "without '..'");
    assert_invalid(
        restore(&format!("/{}", "a".repeat(4096)), plain()).await,
        "from_snapshot",
    );
    let dir = std::env::temp_dir().join(format!("dsec-api-restore-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let snap = dir.display().to_string();
    assert_invalid(restore(&snap, plain()).await, "sandbox.json");
    let origin = |extra: &str| {
        format!(
            r#"{{"sandbox_id":"sb-src","image":"busybox","vcpus":1,"memory_mib":128,
                "disk_mib":1024,"pids_limit":512,"on_disk":false{extra}}}"#
        )
    };
    std::fs::write(dir.join("sandbox.json"), origin("")).unwrap();
    assert_invalid(restore(&snap, plain()).await, "no VMM state");
    std::fs::write(dir.join("state"), b"{}").unwrap();
    // The snapshot's shape is kept: a different one is refused, as is a container or a cold boot.
    assert_invalid(
        restore(
            &snap,
            CreateSandboxRequest {
                memory_mib: 256,
                ..plain()
            },
        )
        .await,
        "memory_mib 256 differs from the snapshot's 128",
    );
    assert_invalid(
        restore(
            &snap,
            CreateSandboxRequest {
                image: "debian".into(),
                ..plain()
            },
        )
        .await,
        "leave image unset",
    );
    assert_invalid(
        restore(
            &snap,
            CreateSandboxRequest {
                backend: 1,
                ..plain()
            },
        )
        .await,
        "leave backend unset or microvm",
    );
    assert_invalid(
        restore(
            &snap,
            CreateSandboxRequest {
                cold: true,
                ..plain()
            },
        )
        .await,
        "exclude each other",
    );
    // A file a jailed VMM (uid 65534) could have put there is not trusted.
    std::os::unix::fs::chown(dir.join("sandbox.json"), Some(65534), Some(65534)).unwrap();
    assert_invalid(restore(&snap, plain()).await, "did not write");
    std::fs::remove_file(dir.join("sandbox.json")).unwrap();
    std::fs::write(dir.join("sandbox.json"), origin(r#","diff":true"#)).unwrap();
    let (code, text) = code(restore(&snap, plain()).await);
    assert_eq!(code, tonic::Code::FailedPrecondition, "{text}");
    assert!(text.contains("diff snapshot"), "{text}");
    std::fs::remove_dir_all(&dir).unwrap();
    drop(daemon);
}
