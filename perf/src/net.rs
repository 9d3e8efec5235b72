//! `dsec-perf net`: what sandbox networking costs a container node. Two real `dsec-edge`s
//! (private state dirs), one with a sandbox network (its own bridge, nftables table and DNS
//! proxy) and one without, and a test host in a network namespace of its own (a TCP sink
//! and an accept-and-close server, threads of this process in that namespace):
//!
//! - setup: create latency with and without the network, alternating, and the network
//!   setup time the daemon logs per create (`setup_us`, and `added_us`: the part still
//!   running when the agent answered);
//! - growth: the same while N sandboxes with networks are held on the node;
//! - policy: TCP throughput and connection rate from a sandbox to the test host through a
//!   policy of 1 rule vs one of `--rules` rules (the same allowing rule among them);
//! - live: `SetNetworkPolicy` on a running sandbox, alone and while other clients create
//!   and delete sandboxes on the node, with the daemon's breakdown of each change.

use std::io::Read;
use std::net::{Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dsec_sdk::{Backend, Client, CreateSandboxRequest, ExecStart, NetworkPolicy};

use crate::node::Edge;
use crate::report::{detail, metric, Contender, Sample, Scenario};

pub struct NetOpts {
    pub edge: PathBuf,
    pub workdir: PathBuf,
    pub samples: usize,
    pub held: Vec<usize>,
    pub rules: usize,
    pub transfer_mib: usize,
    pub connections: usize,
    pub policy_samples: usize,
    pub live_samples: usize,
    /// Concurrent create+delete loops during the loaded live changes.
    pub live_load: usize,
    /// Extra daemon flags of the networked daemon (e.g. `--net-veth-pool 0`).
    pub edge_args: Vec<String>,
}

pub struct NetResults {
    pub setup: Scenario,
    pub growth: Scenario,
    pub policy: Scenario,
    pub live: Scenario,
    pub commands: Vec<String>,
}

/// Port of the test host's sink (reads and drops) and of its accept-and-close server.
const SINK_PORT: u16 = 9000;
const ACCEPT_PORT: u16 = 9001;

/// The test host: a namespace with a veth to the host and two servers in it.
struct TestHost {
    netns: String,
    link: String,
    addr: Ipv4Addr,
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

fn sh(script: &str) -> Result<(), String> {
    let out = Command::new("sh")
        .args(["-c", script])
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| format!("sh: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{script}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}

impl TestHost {
    fn start(tag: &str) -> Result<Self, String> {
        let netns = format!("dsperf-{tag}");
        let link = format!("dp{tag}h");
        let (uplink, addr) = (Ipv4Addr::new(198, 19, 77, 1), Ipv4Addr::new(198, 19, 77, 2));
        let mut host = Self {
            netns: netns.clone(),
            link: link.clone(),
            addr,
            stop: Arc::default(),
            threads: Vec::new(),
        };
        sh(&format!(
            "ip netns add {netns} && ip link add {link} type veth peer name eth0 netns {netns} && \
             ip addr add {uplink}/24 dev {link} && ip link set {link} up && \
             ip -n {netns} addr add {addr}/24 dev eth0 && ip -n {netns} link set eth0 up && \
             ip -n {netns} link set lo up"
        ))?;
        for (port, sink) in [(SINK_PORT, true), (ACCEPT_PORT, false)] {
            let (ready_tx, ready_rx) = std::sync::mpsc::channel();
            let ns = std::fs::File::open(format!("/var/run/netns/{netns}"))
                .map_err(|e| format!("open netns {netns}: {e}"))?;
            let stop = host.stop.clone();
            host.threads.push(std::thread::spawn(move || {
                use std::os::fd::AsRawFd;
                // SAFETY: setns(2) on a namespace file this thread holds open; it moves only
                // this thread, which then binds its listener there.
                if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                    let _ = ready_tx.send(Err(std::io::Error::last_os_error().to_string()));
                    return;
                }
                let listener = match TcpListener::bind((addr, port)) {
                    Ok(l) => l,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e.to_string()));
                        return;
                    }
                };
                let _ = listener.set_nonblocking(true);
                let _ = ready_tx.send(Ok(()));
                while !stop.load(Ordering::Relaxed) {
                    match listener.accept() {
                        Ok((mut conn, _)) if sink => {
                            let _ = conn.set_nonblocking(false);
                            std::thread::spawn(move || {
                                let mut buf = vec![0u8; 1 << 16];
                                while matches!(conn.read(&mut buf), Ok(n) if n > 0) {}
                            });
                        }
                        Ok((conn, _)) => drop(conn),
                        Err(_) => std::thread::sleep(Duration::from_millis(1)),
                    }
                }
            }));
            ready_rx
                .recv_timeout(Duration::from_secs(5))
                .map_err(|_| "the test host's server did not start".to_string())??;
        }
        Ok(host)
    }
}

impl Drop for TestHost {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        let _ = Command::new("ip")
            .args(["netns", "del", &self.netns])
            .status();
        let _ = Command::new("ip")
            .args(["link", "del", &self.link])
            .stderr(Stdio::null())
            .status();
    }
}

fn request(network: NetworkPolicy) -> CreateSandboxRequest {
    CreateSandboxRequest {
        backend: Backend::Container as i32,
        memory_mib: 64,
        disk_mib: 16,
        network: Some(network),
        ..Default::default()
    }
}

/// The `setup_us` and `added_us` of the "network attached" lines of the daemon's log, in
/// order.
fn setup_times(log: &Path) -> Vec<(f64, f64)> {
    logged_fields(log, "network attached", ["setup_us", "added_us"])
}

/// The `rules_us` (nft transaction) and `links_us` (veth, address, route) of the "network
/// setup parts" lines, in order (one per create, as the "network attached" lines).
fn setup_parts(log: &Path) -> Vec<(f64, f64)> {
    logged_fields(log, "network setup parts", ["rules_us", "links_us"])
}

/// Two numeric fields of the daemon's log lines holding `message`, in order.
fn logged_fields(log: &Path, message: &str, names: [&str; 2]) -> Vec<(f64, f64)> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let field = |line: &str, name: &str| -> Option<f64> {
        let v = line.split(&format!("{name}=")).nth(1)?;
        v.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
    };
    text.lines()
        .filter(|l| l.contains(message))
        .map(|l| {
            // tracing's colours stripped.
            let plain: String = l
                .split('\x1b')
                .map(|p| p.split_once('m').map_or(p, |(_, rest)| rest))
                .collect();
            (
                field(&plain, names[0]).unwrap_or(f64::NAN),
                field(&plain, names[1]).unwrap_or(f64::NAN),
            )
        })
        .collect()
}

/// Runs `script` in the sandbox: its wall time in ms, or why it failed.
async fn exec_ms(client: &Client, id: &str, script: &str) -> Result<f64, String> {
    let start = ExecStart {
        sandbox_id: id.into(),
        argv: vec!["sh".into(), "-c".into(), script.into()],
        timeout_ms: 120_000,
        ..Default::default()
    };
    let t = Instant::now();
    let out = client
        .exec_with(start, None, |_, _| {})
        .await
        .map_err(|e| e.to_string())?;
    let ms = t.elapsed().as_secs_f64() * 1e3;
    match out.code {
        Some(0) => Ok(ms),
        code => Err(format!(
            "exit {code:?}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )),
    }
}

fn sample(contender: &str, index: usize, values: &[(&'static str, f64)]) -> Sample {
    Sample {
        contender: contender.into(),
        index,
        values: values.iter().copied().collect(),
        error: None,
    }
}

fn failed(contender: &str, index: usize, error: String) -> Sample {
    Sample {
        contender: contender.into(),
        index,
        values: Default::default(),
        error: Some(error),
    }
}

fn contender(name: &str, description: &str, command: &str) -> Contender {
    Contender {
        name: name.into(),
        description: description.into(),
        command: command.into(),
    }
}

/// One create + delete: the create's latency in ms.
async fn create_delete(client: &Client, network: NetworkPolicy) -> Result<f64, String> {
    let t = Instant::now();
    let sb = client
        .create(request(network))
        .await
        .map_err(|e| e.to_string())?;
    let ms = t.elapsed().as_secs_f64() * 1e3;
    client.delete(&sb.id).await.map_err(|e| e.to_string())?;
    Ok(ms)
}

pub fn bench(o: &NetOpts) -> Result<NetResults, String> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    runtime.block_on(bench_async(o))
}

async fn bench_async(o: &NetOpts) -> Result<NetResults, String> {
    let tag = format!("{}", std::process::id() % 100_000);
    let host = TestHost::start(&tag)?;
    // The daemon logs each create's network setup time at debug level.
    std::env::set_var(
        "DSEC_LOG",
        "info,dsec_edge::backend::container=debug,dsec_edge::net=debug,dsec_edge::daemon::network=debug",
    );
    let bridge = format!("dp{tag}");
    let net_dir = o.workdir.join("net");
    let plain_dir = o.workdir.join("plain");
    for d in [&net_dir, &plain_dir] {
        std::fs::create_dir_all(d).map_err(|e| format!("create {}: {e}", d.display()))?;
    }
    let pid = std::process::id();
    let mut net_args = vec![
        "--http".to_string(),
        "off".into(),
        "--net-bridge".into(),
        bridge.clone(),
    ];
    net_args.extend(o.edge_args.iter().cloned());
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let most = o.held.iter().max().copied().unwrap_or(0) + 4;
    if let Some(ratio) = crate::node::cpu_overcommit_for(most, cores) {
        net_args.extend(["--overcommit-cpu".to_string(), ratio.to_string()]);
    }
    // Held sandboxes are idle (a few MiB each), but each reserves its memory limit plus
    // overhead (~80 MiB): 1,000 of them need more than the default ratio's budget.
    if let Some(ratio) = memory_overcommit_for(most) {
        net_args.extend(["--overcommit-memory".to_string(), ratio.to_string()]);
    }
    // Each sandbox reserves its pid limit (512) of the node's pid budget (default 8 x
    // pid_max, 262,144 here: 512 sandboxes); held ones run a handful of processes.
    if most * 512 > 200_000 {
        net_args.extend(["--pids".to_string(), (most * 1024).to_string()]);
    }
    let mut with_net = Edge::start_named(
        &o.edge,
        &net_dir,
        &net_args,
        &format!("dsec-perf-net-{pid}"),
    )
    .map_err(|e| e.to_string())?;
    let mut without = Edge::start_named(
        &o.edge,
        &plain_dir,
        &["--http".into(), "off".into()],
        &format!("dsec-perf-plain-{pid}"),
    )
    .map_err(|e| e.to_string())?;
    let timeout = Duration::from_secs(30);
    let net_client = with_net.connect(timeout).await.map_err(|e| e.to_string())?;
    let plain_client = without.connect(timeout).await.map_err(|e| e.to_string())?;
    let commands = vec![with_net.command.clone(), without.command.clone()];

    // Setup: alternating creates on both daemons (one warm-up each).
    let mut setup = Scenario {
        name: "net-setup",
        title: "container create with and without a sandbox network".into(),
        method: format!(
            "{} sequential create+delete per daemon, alternating (after one warm-up each); \
             setup_us/added_us from the network daemon's log",
            o.samples
        ),
        metrics: vec![
            metric("create_ms", "create latency", "ms"),
            detail("setup_ms", "network setup (in parallel)", "ms"),
            detail("added_ms", "setup still running at agent-ready", "ms"),
        ],
        contenders: vec![
            contender("net", "--net-bridge, no policy", &commands[0]),
            contender("no-net", "loopback only", &commands[1]),
        ],
        comparisons: vec![("net".into(), "no-net".into())],
        samples: Vec::new(),
        skipped: None,
        notes: vec![format!("goal: network setup p50 under 5 ms (container)")],
    };
    for (client, name) in [(&net_client, "net"), (&plain_client, "no-net")] {
        create_delete(client, NetworkPolicy::default())
            .await
            .map_err(|e| format!("{name} warm-up: {e}"))?;
    }
    let logged_before = setup_times(&with_net.log).len();
    let mut net_creates = Vec::new();
    for i in 0..o.samples {
        match create_delete(&net_client, NetworkPolicy::default()).await {
            Ok(ms) => net_creates.push((i, ms)),
            Err(e) => setup.samples.push(failed("net", i, e)),
        }
        setup.samples.push(
            match create_delete(&plain_client, NetworkPolicy::default()).await {
                Ok(ms) => sample("no-net", i, &[("create_ms", ms)]),
                Err(e) => failed("no-net", i, e),
            },
        );
    }
    let times = setup_times(&with_net.log);
    for (k, (i, ms)) in net_creates.into_iter().enumerate() {
        let (s, a) = times
            .get(logged_before + k)
            .copied()
            .unwrap_or((f64::NAN, f64::NAN));
        setup.samples.push(sample(
            "net",
            i,
            &[
                ("create_ms", ms),
                ("setup_ms", s / 1e3),
                ("added_ms", a / 1e3),
            ],
        ));
    }

    // Growth: setup time while N networked sandboxes are held.
    let mut growth = Scenario {
        name: "net-growth",
        title: "network setup time with sandboxes held on the node".into(),
        method: format!(
            "{} create+delete at each level of held sandboxes (each held one has a veth and a \
             few elements in the node's sets); setup_us from the daemon's log",
            o.samples
        ),
        metrics: vec![
            metric("setup_ms", "network setup", "ms"),
            detail("rules_ms", "its nft transaction", "ms"),
            detail("links_ms", "its veth, address and route", "ms"),
            detail("create_ms", "create latency", "ms"),
        ],
        contenders: o
            .held
            .iter()
            .map(|n| contender(&format!("held-{n}"), "sandboxes held", &commands[0]))
            .collect(),
        comparisons: o
            .held
            .iter()
            .skip(1)
            .map(|n| (format!("held-{n}"), format!("held-{}", o.held[0])))
            .collect(),
        samples: Vec::new(),
        skipped: None,
        notes: Vec::new(),
    };
    let mut held_ids: Vec<String> = Vec::new();
    for &level in &o.held {
        let mut hold_error = None;
        while held_ids.len() < level {
            match net_client.create(request(NetworkPolicy::default())).await {
                Ok(sb) => held_ids.push(sb.id),
                Err(e) => {
                    hold_error = Some(format!("hold sandbox {}: {e}", held_ids.len()));
                    break;
                }
            }
        }
        if let Some(e) = hold_error {
            growth.samples.push(failed(&format!("held-{level}"), 0, e));
            break;
        }
        let before = setup_times(&with_net.log).len();
        let parts_before = setup_parts(&with_net.log).len();
        let mut creates = Vec::new();
        for i in 0..o.samples {
            creates.push((
                i,
                create_delete(&net_client, NetworkPolicy::default()).await,
            ));
        }
        let times = setup_times(&with_net.log);
        let parts = setup_parts(&with_net.log);
        let (mut k, mut p) = (before, parts_before);
        let name = format!("held-{level}");
        for (i, r) in creates {
            growth.samples.push(match r {
                Ok(ms) => {
                    let s = times.get(k).map_or(f64::NAN, |t| t.0 / 1e3);
                    let (rules, links) = parts
                        .get(p)
                        .map_or((f64::NAN, f64::NAN), |t| (t.0 / 1e3, t.1 / 1e3));
                    k += 1;
                    p += 1;
                    sample(
                        &name,
                        i,
                        &[
                            ("setup_ms", s),
                            ("rules_ms", rules),
                            ("links_ms", links),
                            ("create_ms", ms),
                        ],
                    )
                }
                Err(e) => failed(&name, i, e),
            });
        }
    }
    for id in held_ids.drain(..) {
        let _ = net_client.delete(&id).await;
    }

    // Policy: throughput and connection rate with 1 rule vs many.
    let allow = format!("tcp:{}:{SINK_PORT}-{ACCEPT_PORT}", host.addr);
    let mut many: Vec<String> = (0..o.rules.saturating_sub(1))
        .map(|i| {
            format!(
                "tcp:10.{}.{}.{}:443",
                100 + i / 65536 % 100,
                i / 256 % 256,
                i % 256
            )
        })
        .collect();
    many.insert(many.len() / 2, allow.clone());
    let many_name = if o.rules == 1000 {
        "1000-rules"
    } else {
        "many-rules"
    };
    let rules = |allow: Vec<String>| NetworkPolicy {
        allow,
        ..NetworkPolicy::default()
    };
    // "no-policy": every destination allowed, nothing in the sandbox's sets (what the
    // issue calls no policy; a sandbox created without one reaches nothing).
    let policies = [
        (
            "no-policy",
            "allow_internet, no rules",
            NetworkPolicy {
                allow_internet: true,
                ..NetworkPolicy::default()
            },
        ),
        ("1-rule", "1 allow rule", rules(vec![allow.clone()])),
        (many_name, "allow rules", rules(many)),
    ];
    let mut policy = Scenario {
        name: "net-policy",
        title: format!(
            "sandbox -> test host with no policy (allow all) vs 1 rule vs {} rules",
            o.rules
        ),
        method: format!(
            "per sample and policy: {} MiB sent with dd | nc to a sink, and {} sequential nc \
             connections (connect, close) to an accept-and-close server; alternating",
            o.transfer_mib, o.connections
        ),
        metrics: vec![
            metric("throughput_mib_s", "TCP throughput", "MiB/s"),
            metric("conn_per_s", "connections", "1/s"),
        ],
        contenders: policies
            .iter()
            .map(|(n, what, p)| {
                let what = if p.allow.len() > 1 {
                    format!("{} {what}", p.allow.len())
                } else {
                    what.to_string()
                };
                contender(n, &what, &commands[0])
            })
            .collect(),
        comparisons: vec![
            (many_name.to_string(), "no-policy".to_string()),
            (many_name.to_string(), "1-rule".to_string()),
            ("1-rule".to_string(), "no-policy".to_string()),
        ],
        samples: Vec::new(),
        skipped: None,
        notes: vec![format!(
            "goal: {many_name} within 10% of no policy (higher is better for both metrics)"
        )],
    };
    let mut ids = Vec::new();
    for (name, _, net) in &policies {
        let sb = net_client
            .create(request(net.clone()))
            .await
            .map_err(|e| format!("create with policy {name}: {e}"))?;
        ids.push(sb.id);
    }
    let send = format!(
        "dd if=/dev/zero bs=64k count={} 2>/dev/null | nc {} {SINK_PORT}",
        o.transfer_mib * 16,
        host.addr
    );
    let connect = format!(
        "i=0; while [ $i -lt {} ]; do nc {} {ACCEPT_PORT} </dev/null || exit 1; i=$((i+1)); done",
        o.connections, host.addr
    );
    for i in 0..o.policy_samples {
        for ((name, _, _), id) in policies.iter().zip(&ids) {
            let result = async {
                let send_ms = exec_ms(&net_client, id, &send).await?;
                let conn_ms = exec_ms(&net_client, id, &connect).await?;
                Ok::<_, String>((send_ms, conn_ms))
            }
            .await;
            policy.samples.push(match result {
                Ok((send_ms, conn_ms)) => sample(
                    name,
                    i,
                    &[
                        ("throughput_mib_s", o.transfer_mib as f64 / (send_ms / 1e3)),
                        ("conn_per_s", o.connections as f64 / (conn_ms / 1e3)),
                    ],
                ),
                Err(e) => failed(name, i, e),
            });
        }
    }
    for id in ids {
        let _ = net_client.delete(&id).await;
    }
    let live = live_changes(o, &net_client, &with_net.log, &commands[0], host.addr).await;
    drop(net_client);
    drop(plain_client);
    drop(with_net);
    drop(without);
    drop(host);
    Ok(NetResults {
        setup,
        growth,
        policy,
        live,
        commands,
    })
}

/// Live policy changes on one sandbox: alone ("idle") and while `live_load` clients create
/// and delete sandboxes on the node ("under-creates"), in alternating blocks of 5. Each
/// change flips between a policy allowing the test host and none. The daemon's debug lines
/// give each change's queueing before the blocking task, its wait for other changes, its
/// nft transaction and its conntrack cut.
async fn live_changes(
    o: &NetOpts,
    client: &Client,
    log: &Path,
    command: &str,
    host: Ipv4Addr,
) -> Scenario {
    let mut live = Scenario {
        name: "net-live",
        title: "live policy change (SetNetworkPolicy) on a running sandbox".into(),
        method: format!(
            "{} changes per contender in alternating blocks of 5, each flipping between \
             `tcp:{host}:{SINK_PORT}` and no rule; under-creates: {} concurrent create+delete \
             loops on the node meanwhile; breakdown from the daemon's debug log",
            o.live_samples, o.live_load
        ),
        metrics: vec![
            metric("change_ms", "SetNetworkPolicy round trip", "ms"),
            detail("applied_ms", "daemon: asked -> applied", "ms"),
            detail("queued_ms", "daemon: waiting for a blocking thread", "ms"),
            detail("lock_ms", "daemon: waiting for other changes", "ms"),
            detail("rules_ms", "daemon: nft transaction", "ms"),
            detail("conntrack_ms", "daemon: conntrack cut", "ms"),
        ],
        contenders: vec![
            contender("idle", "no other requests", command),
            contender(
                "under-creates",
                &format!("{} create+delete loops", o.live_load),
                command,
            ),
        ],
        comparisons: vec![("under-creates".into(), "idle".into())],
        samples: Vec::new(),
        skipped: None,
        notes: vec!["goal: within 100 ms under load".into()],
    };
    if o.live_samples == 0 {
        live.skipped = Some("--live-samples 0".into());
        return live;
    }
    let id = match client.create(request(NetworkPolicy::default())).await {
        Ok(sb) => sb.id,
        Err(e) => {
            live.skipped = Some(format!("create the sandbox: {e}"));
            return live;
        }
    };
    let allow = NetworkPolicy {
        allow: vec![format!("tcp:{host}:{SINK_PORT}")],
        ..NetworkPolicy::default()
    };
    let stop = Arc::new(AtomicBool::new(false));
    let mut done = [0usize; 2];
    let mut flip = false;
    while done.iter().any(|&d| d < o.live_samples) {
        for (which, name) in ["idle", "under-creates"].into_iter().enumerate() {
            let block = (o.live_samples - done[which]).min(5);
            if block == 0 {
                continue;
            }
            let loads: Vec<_> = if which == 1 {
                stop.store(false, Ordering::Relaxed);
                (0..o.live_load)
                    .map(|_| {
                        let (client, stop) = (client.clone(), stop.clone());
                        tokio::spawn(async move {
                            while !stop.load(Ordering::Relaxed) {
                                let _ = create_delete(&client, NetworkPolicy::default()).await;
                            }
                        })
                    })
                    .collect()
            } else {
                Vec::new()
            };
            // Let the loops get going.
            if which == 1 {
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            for _ in 0..block {
                flip = !flip;
                let policy = if flip {
                    allow.clone()
                } else {
                    NetworkPolicy::default()
                };
                let parts_before =
                    logged_fields(log, "policy change parts", ["lock_us", "rules_us"]).len();
                let t = Instant::now();
                let result = client.set_network_policy(&id, policy).await;
                let ms = t.elapsed().as_secs_f64() * 1e3;
                let index = done[which];
                done[which] += 1;
                if let Err(e) = result {
                    live.samples.push(failed(name, index, e.to_string()));
                    continue;
                }
                let at = |message: &str, names: [&str; 2]| {
                    logged_fields(log, message, names)
                        .get(parts_before)
                        .copied()
                        .unwrap_or((f64::NAN, f64::NAN))
                };
                let (lock, rules) = at("policy change parts", ["lock_us", "rules_us"]);
                let (conntrack, _) = at("policy change parts", ["conntrack_us", "conntrack_us"]);
                let (queued, applied) = at("policy change applied", ["queued_us", "applied_us"]);
                live.samples.push(sample(
                    name,
                    index,
                    &[
                        ("change_ms", ms),
                        ("applied_ms", applied / 1e3),
                        ("queued_ms", queued / 1e3),
                        ("lock_ms", lock / 1e3),
                        ("rules_ms", rules / 1e3),
                        ("conntrack_ms", conntrack / 1e3),
                    ],
                ));
            }
            stop.store(true, Ordering::Relaxed);
            for load in loads {
                let _ = load.await;
            }
        }
    }
    let _ = client.delete(&id).await;
    live
}

/// A memory overcommit ratio that admits `sandboxes` held ones of ~96 MiB reserved each, if
/// the daemon's default (1.5) does not.
fn memory_overcommit_for(sandboxes: usize) -> Option<f64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let total_kib: f64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    let ratio = (sandboxes as f64 * 96.0 * 1024.0 / total_kib).ceil();
    (ratio > 1.5).then_some(ratio)
}
