//! FnCall container workers against the real fncall image (root, images built by setup.sh).

use std::sync::Arc;
use std::time::Duration;

use dsec_fncall::{
    CallLimits, CallRequest, ContainerFactory, Engine, EngineConfig, Language, StageStatus,
};

fn engine() -> Engine {
    let home = std::env::var("DSEC_HOME").unwrap_or_else(|_| "/var/lib/dsec".into());
    let factory = ContainerFactory::new(format!("{home}/images").into(), CallLimits::default());
    let mut config = EngineConfig::default();
    config.pool_sizes.insert(Language::Python, 2);
    config.pool_sizes.insert(Language::Cpp, 1);
    Engine::new(config, Arc::new(factory))
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

async fn run(engine: &Engine, language: Language, code: &str) -> dsec_fncall::CallResult {
    engine
        .run(&CallRequest::new(language, code))
        .await
        .unwrap_or_else(|e| panic!("{language:?} call failed: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_language_runs() {
    let engine = engine();
    let py = run(
        &engine,
        Language::Python,
        "import numpy as np\nprint(1+1, np.arange(4).sum())",
    )
    .await;
    let run_py = py.run.unwrap();
    assert_eq!(
        text(&run_py.stdout),
        "2 6\n",
        "stderr: {}",
        text(&run_py.stderr)
    );
    assert_eq!(run_py.exit_code, Some(0));

    let sh = run(&engine, Language::Bash, "echo hi; exit 3")
        .await
        .run
        .unwrap();
    assert_eq!((text(&sh.stdout).as_str(), sh.exit_code), ("hi\n", Some(3)));

    let js = run(
        &engine,
        Language::Node,
        "console.log([1,2,3].map(x => x * 2).join(','))",
    )
    .await;
    let js = js.run.unwrap();
    assert_eq!(text(&js.stdout), "2,4,6\n", "stderr: {}", text(&js.stderr));

    let cpp = run(
        &engine,
        Language::Cpp,
        "#include <iostream>\nint main(){int a,b;std::cin>>a>>b;std::cout<<a+b<<std::endl;}",
    );
    let mut call = CallRequest::new(
        Language::Cpp,
        "#include <iostream>\nint main(){int a,b;std::cin>>a>>b;std::cout<<a+b<<std::endl;}",
    );
    call.stdin = b"40 2\n".to_vec();
    drop(cpp);
    let cpp = engine.run(&call).await.unwrap();
    let compile = cpp.compile.expect("a compile stage");
    assert!(compile.succeeded(), "compile: {}", text(&compile.stderr));
    assert_eq!(text(&cpp.run.unwrap().stdout), "42\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_the_right_status_and_the_pool_stays_healthy() {
    let engine = engine();
    // Compile error: reported by the compile stage, nothing run.
    let bad = run(&engine, Language::Cpp, "int main( {").await;
    let compile = bad.compile.unwrap();
    assert_eq!(compile.status, StageStatus::Finished);
    assert_ne!(compile.exit_code, Some(0));
    assert!(
        text(&compile.stderr).contains("error"),
        "{}",
        text(&compile.stderr)
    );
    assert!(bad.run.is_none());

    // Infinite loop: killed at the wall limit.
    let mut call = CallRequest::new(Language::Python, "while True: pass");
    call.run_timeout = Duration::from_millis(500);
    let looped = engine.run(&call).await.unwrap().run.unwrap();
    assert_eq!(looped.status, StageStatus::TimeLimitExceeded);

    // `yes`: output cut at the cap and flagged.
    let yes = run(&engine, Language::Bash, "yes").await.run.unwrap();
    assert!(yes.stdout_truncated);
    assert_eq!(
        yes.stdout.len(),
        CallLimits::default().output_bytes as usize
    );

    // Fork bomb: contained by the pids limit, ended by the time limit at worst.
    let mut bomb = CallRequest::new(Language::Bash, "f(){ f | f & }; f; sleep 1; echo done");
    bomb.run_timeout = Duration::from_secs(3);
    let bombed = engine.run(&bomb).await.unwrap().run.unwrap();
    assert!(bombed.status != StageStatus::Error);

    // Huge file: the file-size limit stops it.
    let big = run(
        &engine,
        Language::Bash,
        "head -c 100M /dev/zero > big; echo $? ; ls -l big | awk '{print $5}'",
    )
    .await
    .run
    .unwrap();
    let out = text(&big.stdout);
    let size: u64 = out.lines().last().unwrap().trim().parse().unwrap();
    assert!(size <= CallLimits::default().file_bytes, "{out}");

    // Binary garbage on stdin.
    let mut garbage = CallRequest::new(
        Language::Python,
        "import sys\nprint(len(sys.stdin.buffer.read()))",
    );
    garbage.stdin = (0..=255u8).cycle().take(100_000).collect();
    let got = engine.run(&garbage).await.unwrap().run.unwrap();
    assert_eq!(text(&got.stdout), "100000\n");

    // Network: only loopback.
    let net = run(
        &engine,
        Language::Python,
        "import socket\ntry:\n socket.create_connection(('1.1.1.1', 53), timeout=2)\n print('connected')\nexcept OSError as e:\n print('no network', e)",
    )
    .await
    .run
    .unwrap();
    assert!(
        text(&net.stdout).starts_with("no network"),
        "{}",
        text(&net.stdout)
    );

    // Unknown language is refused up front.
    assert!(Language::parse("cobol").is_err());

    // After all of that, the pool still answers.
    let ok = run(&engine, Language::Python, "print('still fine')")
        .await
        .run
        .unwrap();
    assert_eq!(text(&ok.stdout), "still fine\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_of_one_call_is_seen_by_the_next() {
    let engine = engine();
    // Python pools hold two workers: run enough calls that the same worker serves several.
    for round in 0..4 {
        let first = run(
            &engine,
            Language::Bash,
            "echo secret > /tmp/left; echo secret > /work/left; export LEFT=1; (sleep 1000 &) ; echo started",
        )
        .await
        .run
        .unwrap();
        assert_eq!(
            text(&first.stdout),
            "started\n",
            "round {round}: {}",
            text(&first.stderr)
        );
        let second = run(
            &engine,
            Language::Bash,
            "ls /tmp /work; echo env=${LEFT:-unset}; ps -e -o comm= 2>/dev/null || ls /proc | grep -c '^[0-9]'",
        )
        .await
        .run
        .unwrap();
        let out = text(&second.stdout);
        assert!(!out.contains("left"), "round {round}: {out}");
        assert!(out.contains("env=unset"), "round {round}: {out}");
        assert!(!out.contains("sleep"), "round {round}: {out}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_code_without_numpy_runs_in_the_lean_zygote() {
    let engine = engine();
    let out = |r: dsec_fncall::CallResult| {
        let run = r.run.unwrap();
        assert_eq!(run.exit_code, Some(0), "stderr: {}", text(&run.stderr));
        text(&run.stdout)
    };
    // (The probe spells the name apart: the name in the text would pick the full zygote.)
    let probe = "import sys\nprint('nu' + 'mpy' in sys.modules)";
    // Lean: numpy is not preloaded; a call naming it gets the full zygote.
    assert_eq!(out(run(&engine, Language::Python, probe).await), "False\n");
    let full = format!("{probe}  # numpy");
    assert_eq!(out(run(&engine, Language::Python, &full).await), "True\n");
    // numpy imported without its name in the text still works in the lean zygote.
    let hidden = "m = __import__('nu' + 'mpy')\nprint(int(m.arange(5).sum()))";
    assert_eq!(out(run(&engine, Language::Python, hidden).await), "10\n");
    // Lean calls are as isolated as the others (the pool holds two workers).
    for round in 0..4 {
        let first = "import subprocess\nopen('/tmp/left', 'w').write('x')\nopen('/work/left', 'w').write('x')\nsubprocess.Popen(['sleep', '1000'])\nprint('started')";
        assert_eq!(
            out(run(&engine, Language::Python, first).await),
            "started\n"
        );
        let second = "import os\nprint(sorted(os.listdir('/tmp') + os.listdir('/work')), [open(f'/proc/{p}/comm').read().strip() for p in os.listdir('/proc') if p.isdigit()])";
        let seen = out(run(&engine, Language::Python, second).await);
        assert!(!seen.contains("left"), "round {round}: {seen}");
        assert!(!seen.contains("sleep"), "round {round}: {seen}");
    }
}

/// Processes running as a call's uid (calls run as DEFAULT_UID_BASE + worker number), but
/// for the python stages made ahead of their call (named fncall-ready until it comes).
fn call_processes() -> Vec<String> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Ok(status) = std::fs::read_to_string(entry.path().join("status")) else {
            continue;
        };
        let uid: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|l| l.split_whitespace().next())
            .and_then(|u| u.parse().ok())
            .unwrap_or(0);
        let waiting = status.lines().next() == Some("Name:\tfncall-ready");
        if uid >= u64::from(dsec_fncall::container::DEFAULT_UID_BASE) && !waiting {
            found.push(format!("{name}: {}", status.lines().next().unwrap_or("")));
        }
    }
    found
}

/// Mount counts of this process's zygotes (children named fncall-zygote): a worker's namespace
/// holds its root, /dev and the call init bound in /dev; a call's mounts live and die in the
/// call's own namespace.
fn zygote_mounts() -> Vec<(String, usize)> {
    let me = std::process::id().to_string();
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let Some((comm, rest)) = stat.split_once(") ") else {
            continue;
        };
        let ppid = rest.split_whitespace().nth(1).unwrap_or("");
        if ppid == me && comm.ends_with("(fncall-zygote") {
            if let Ok(mounts) = std::fs::read_to_string(entry.path().join("mountinfo")) {
                found.push((
                    entry.file_name().to_string_lossy().into_owned(),
                    mounts.lines().count(),
                ));
            }
        }
    }
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_concurrent_calls_leave_nothing_behind() {
    let engine = Arc::new(engine());
    let started = std::time::Instant::now();
    let semaphore = Arc::new(tokio::sync::Semaphore::new(64));
    let mut tasks = Vec::new();
    for i in 0..1000u32 {
        let engine = Arc::clone(&engine);
        let permit = Arc::clone(&semaphore).acquire_owned().await.unwrap();
        tasks.push(tokio::spawn(async move {
            let _permit = permit;
            // A background process in every call: it must die with the call.
            let code =
                format!("import subprocess\nsubprocess.Popen(['sleep', '100'])\nprint({i} * 2)");
            let result = engine.run(&CallRequest::new(Language::Python, code)).await;
            (i, result)
        }));
    }
    for task in tasks {
        let (i, result) = task.await.unwrap();
        let result = result.unwrap_or_else(|e| panic!("call {i}: {e}"));
        let run = result.run.unwrap();
        assert_eq!(
            text(&run.stdout),
            format!("{}\n", i * 2),
            "call {i}: {}",
            text(&run.stderr)
        );
    }
    let elapsed = started.elapsed();
    assert!(
        elapsed < Duration::from_secs(120),
        "1000 calls took {elapsed:?}"
    );
    // Calls' processes die with their pid namespace as the call ends.
    let mut left = call_processes();
    for _ in 0..50 {
        if left.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        left = call_processes();
    }
    assert!(left.is_empty(), "processes left by calls: {left:?}");
    let zygotes = zygote_mounts();
    assert!(!zygotes.is_empty(), "no zygote found");
    assert!(
        zygotes.iter().all(|(_, mounts)| *mounts == 3),
        "mounts left in workers' namespaces: {zygotes:?}"
    );
    eprintln!("1000 python calls at concurrency 64: {elapsed:?}");
}

/// A call cannot reach anything on the host's loopback (where the node's HTTP entry point
/// and gRPC port listen), and a call asking for the network is refused, not run in the
/// host's network namespace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_cannot_reach_the_hosts_loopback() {
    let engine = engine();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let code = format!(
        "import socket\ntry:\n socket.create_connection(('127.0.0.1', {port}), timeout=2)\n print('reached the host')\nexcept OSError as e:\n print('refused', e)"
    );
    let got = run(&engine, Language::Python, &code).await.run.unwrap();
    assert!(
        text(&got.stdout).starts_with("refused"),
        "{}{}",
        text(&got.stdout),
        text(&got.stderr)
    );
    let mut networked = CallRequest::new(Language::Python, &code);
    networked.network = Some(dsec_fncall::NetworkRules::default());
    let err = engine.run(&networked).await.unwrap_err();
    assert!(
        matches!(err, dsec_fncall::FnCallError::NoCallNetwork),
        "{err}"
    );
    assert_eq!(
        dsec_fncall::grpc::status(&err).code(),
        tonic::Code::FailedPrecondition
    );
}

/// The seccomp filter: no user namespace (the way to every other namespace and to mounts
/// for an unprivileged process), no mount, no bpf/keyctl/perf_event_open, clone3 ENOSYS
/// (both programs of the sandbox filter, chained into one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_cannot_make_namespaces_or_mount() {
    let engine = engine();
    let got = run(
        &engine,
        Language::Bash,
        "unshare -Ur true && echo userns-made; unshare -Urm sh -c 'mount -t tmpfs none /tmp && echo mounted'; unshare -m true && echo mountns-made; echo done",
    )
    .await
    .run
    .unwrap();
    let out = text(&got.stdout);
    assert_eq!(out, "done\n", "{out}{}", text(&got.stderr));
    let got = run(
        &engine,
        Language::Python,
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nfor name, nr, args in [('unshare', 272, (0x10000000,)), ('bpf', 321, (0, 0, 0)), ('keyctl', 250, (0, 0, 0)), ('perf_event_open', 298, (0, 0, 0, 0, 0)), ('clone3', 435, (0, 0))]:\n    ret = libc.syscall(nr, *args)\n    print(name, ret, os.strerror(ctypes.get_errno()))",
    )
    .await
    .run
    .unwrap();
    let out = text(&got.stdout);
    for name in ["unshare", "bpf", "keyctl", "perf_event_open"] {
        assert!(
            out.contains(&format!("{name} -1 Operation not permitted")),
            "{name}: {out}{}",
            text(&got.stderr)
        );
    }
    // clone3's own answer (libc falls back to clone, whose flags the filter reads); without
    // the filter it would be EINVAL.
    assert!(
        out.contains("clone3 -1 Function not implemented"),
        "clone3: {out}{}",
        text(&got.stderr)
    );
}

/// The call's init (pid 1 of its namespace, root) runs under the sandbox filter too, once its
/// mounts are made: its stages inherit the filter rather than compiling it again, and a
/// stage that escaped to the init's privileges would still be filtered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_calls_init_is_filtered() {
    let engine = engine();
    for language in [Language::Python, Language::Bash] {
        let code = match language {
            Language::Python => "print([l for l in open('/proc/1/status') if l.startswith('Seccomp:')][0].split()[1])",
            _ => "awk '/^Seccomp:/ {print $2}' /proc/1/status",
        };
        let got = run(&engine, language, code).await.run.unwrap();
        // 2: SECCOMP_MODE_FILTER.
        assert_eq!(
            text(&got.stdout),
            "2\n",
            "{language:?}: {}",
            text(&got.stderr)
        );
    }
}

/// One interpreter fork per python call: the call's pid 1 is the compiled call init (not a
/// fork of the zygote), and the call's python process is pid 2, forked by the zygote
/// (outside the call's namespace: parent pid 0 as the call sees it) into the init's
/// namespaces; it still runs in the warm interpreter (the zygote's preloaded modules), under
/// the seccomp filter and the call's uid, and the call's processes are just those two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_call_is_one_fork_of_the_zygote_beside_a_compiled_init() {
    let engine = engine();
    let code = "import os, sys\n\
        init = open('/proc/1/cmdline', 'rb').read().split(b'\\0')[0].decode()\n\
        seccomp = [l for l in open('/proc/self/status') if l.startswith('Seccomp:')][0].split()[1]\n\
        procs = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\n\
        print(init, os.getpid(), os.getppid(), seccomp, os.getuid() > 0, procs, 'statistics' in sys.modules)";
    for round in 0..3 {
        let got = run(&engine, Language::Python, code).await.run.unwrap();
        assert_eq!(
            text(&got.stdout),
            "/dev/fncall-init 2 0 2 True [1, 2] True\n",
            "round {round}: {}",
            text(&got.stderr)
        );
    }
}

/// Two calls at once on different workers: neither sees the other's files or processes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_cannot_read_another_calls_files() {
    let engine = Arc::new(engine());
    let writer = {
        let engine = Arc::clone(&engine);
        tokio::spawn(async move {
            run(
                &engine,
                Language::Bash,
                "echo secret > /work/mine; echo secret > /tmp/mine; sleep 3; echo written",
            )
            .await
        })
    };
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let reader = run(
        &engine,
        Language::Python,
        "import glob\nfound = glob.glob('/tmp/mine') + glob.glob('/work/mine') + glob.glob('/proc/*/root/*/mine')\nprint('found', found)",
    )
    .await
    .run
    .unwrap();
    assert_eq!(
        text(&reader.stdout),
        "found []\n",
        "{}",
        text(&reader.stderr)
    );
    let writer = writer.await.unwrap().run.unwrap();
    assert_eq!(text(&writer.stdout), "written\n");
}
