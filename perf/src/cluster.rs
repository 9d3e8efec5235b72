//! `dsec-perf cluster`: placement throughput of the control plane. A real etcd, 1 or 2 real
//! apiservers (`dsec control up`) and N simulated nodes (`dsec control sim-nodes`: the real
//! node API, fake capacity, nothing started); concurrent SDK clients fire bursts of creates
//! through the apiservers. Per replica count: creations/s, create latency, etcd write
//! transactions per create (revision delta; the nodes' heartbeats included) and CPU per
//! create of etcd, the apiservers and the sim nodes (from /proc). Also the cost the control
//! plane adds to a real create on one real node: create -> first exec through the apiserver
//! vs straight to the node, alternating.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dsec_sdk::{Client, Credentials};
use serde_json::{json, Value};

use crate::stats::Summary;

#[derive(Debug, Clone)]
pub struct ClusterOpts {
    pub dsec: PathBuf,
    /// `dsec-control` to run the apiservers with (None: `dsec control up`).
    pub apiserver: Option<PathBuf>,
    pub workdir: PathBuf,
    pub nodes: usize,
    pub creates: usize,
    pub clients: usize,
    pub rounds: usize,
    pub replicas: Vec<usize>,
    pub real_samples: usize,
    /// Creates per call, per mode: 0 = one Create per sandbox, N = CreateMany of N.
    pub batches: Vec<usize>,
}

/// Processes this run started, killed (by pid) when dropped.
struct Procs(Vec<(String, Child)>);

impl Procs {
    fn spawn(
        &mut self,
        name: &str,
        log: &Path,
        program: &Path,
        args: &[String],
    ) -> Result<u32, String> {
        let out = std::fs::File::create(log).map_err(|e| format!("{}: {e}", log.display()))?;
        let err = out.try_clone().map_err(|e| e.to_string())?;
        let child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(|e| format!("start {name} ({}): {e}", program.display()))?;
        let pid = child.id();
        self.0.push((name.to_string(), child));
        Ok(pid)
    }
}

impl Drop for Procs {
    fn drop(&mut self) {
        for (_, child) in self.0.iter_mut().rev() {
            // SAFETY: kill(2) on a child this run started and has not reaped.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        }
        for (_, child) in self.0.iter_mut() {
            let deadline = Instant::now() + Duration::from_secs(5);
            while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(0)
}

/// A run of `free` consecutive ports nobody listens on, starting at the returned one.
fn free_port_range(count: usize) -> Result<u16, String> {
    'base: for base in (30000u16..60000).step_by(997) {
        for p in base..base + count as u16 {
            if std::net::TcpListener::bind(("127.0.0.1", p)).is_err() {
                continue 'base;
            }
        }
        return Ok(base);
    }
    Err(format!("no {count} consecutive free loopback ports"))
}

/// User + system CPU seconds a process has used.
fn cpu_seconds(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after.split_whitespace().collect();
    // Fields 14 and 15 (utime, stime) are the 12th and 13th after the command name.
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    (ticks(11) + ticks(12)) / hz
}

/// etcd's current revision, from its /metrics.
fn etcd_revision(port: u16) -> Result<u64, String> {
    let mut stream =
        std::net::TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
    stream
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .map_err(|e| e.to_string())?;
    let mut text = String::new();
    stream
        .read_to_string(&mut text)
        .map_err(|e| e.to_string())?;
    text.lines()
        .find_map(|l| l.strip_prefix("etcd_debugging_mvcc_current_revision "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map(|v| v as u64)
        .ok_or_else(|| "etcd's /metrics has no etcd_debugging_mvcc_current_revision".into())
}

fn cli(dsec: &Path, token: &str, endpoint: &str, args: &[&str]) -> Result<String, String> {
    let out = Command::new(dsec)
        .args(args)
        .env("DSEC_TOKEN", token)
        .env("DSEC_ENDPOINT", endpoint)
        .env("XDG_CONFIG_HOME", "/nonexistent")
        .output()
        .map_err(|e| format!("dsec {}: {e}", args.join(" ")))?;
    if !out.status.success() {
        return Err(format!(
            "dsec {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn wait_until(what: &str, within: Duration, mut check: impl FnMut() -> bool) -> Result<(), String> {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if check() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    Err(format!("timed out waiting for {what}"))
}

/// A control plane: etcd, `replicas` apiservers, and `nodes` sim nodes (or none).
struct Plane {
    procs: Procs,
    etcd_port: u16,
    etcd_pid: u32,
    api: Vec<String>,
    api_pids: Vec<u32>,
    sim_pid: Option<u32>,
    token: String,
}

fn start_plane(
    o: &ClusterOpts,
    dir: &Path,
    replicas: usize,
    sim_nodes: usize,
) -> Result<Plane, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut procs = Procs(Vec::new());
    let (client, peer) = (free_port(), free_port());
    let url = format!("http://127.0.0.1:{client}");
    let etcd_pid = procs.spawn(
        "etcd",
        &dir.join("etcd.log"),
        Path::new("etcd"),
        &[
            "--name".into(),
            "perf".into(),
            "--data-dir".into(),
            dir.join("etcd").display().to_string(),
            "--listen-client-urls".into(),
            url.clone(),
            "--advertise-client-urls".into(),
            url.clone(),
            "--listen-peer-urls".into(),
            format!("http://127.0.0.1:{peer}"),
            "--initial-advertise-peer-urls".into(),
            format!("http://127.0.0.1:{peer}"),
            "--initial-cluster".into(),
            format!("perf=http://127.0.0.1:{peer}"),
            "--log-level".into(),
            "warn".into(),
        ],
    )?;
    let mut token = String::new();
    wait_until(
        "etcd and `dsec control init`",
        Duration::from_secs(30),
        || match cli(
            &o.dsec,
            "",
            "",
            &[
                "control", "init", "--etcd", &url, "--org", "perf", "--admin", "root", "--no-tls",
            ],
        ) {
            Ok(out) => {
                token = out.trim().to_string();
                true
            }
            Err(_) => false,
        },
    )?;
    let mut api = Vec::new();
    let mut api_pids = Vec::new();
    for i in 0..replicas {
        let addr = format!("127.0.0.1:{}", free_port());
        let (program, subcommand) = match &o.apiserver {
            Some(apiserver) => (apiserver, vec![]),
            None => (&o.dsec, vec!["control".to_string()]),
        };
        api_pids.push(
            procs.spawn(
                &format!("api{i}"),
                &dir.join(format!("api{i}.log")),
                program,
                &[
                    subcommand,
                    vec![
                        "up".into(),
                        "--etcd".into(),
                        url.clone(),
                        "--listen".into(),
                        addr.clone(),
                        "--node-ttl".into(),
                        "10".into(),
                    ],
                ]
                .concat(),
            )?,
        );
        api.push(addr);
    }
    let endpoint = format!("http://{}", api[0]);
    wait_until("the apiservers", Duration::from_secs(30), || {
        cli(&o.dsec, &token, &endpoint, &["node", "ls"]).is_ok()
    })?;
    let mut sim_pid = None;
    if sim_nodes > 0 {
        let first = free_port_range(sim_nodes)?;
        sim_pid = Some(procs.spawn(
            "sim",
            &dir.join("sim.log"),
            &o.dsec,
            &[
                "control".into(),
                "sim-nodes".into(),
                "--count".into(),
                sim_nodes.to_string(),
                "--first".into(),
                format!("127.0.0.1:{first}"),
                "--control".into(),
                api.join(","),
            ],
        )?);
        wait_until(
            &format!("{sim_nodes} sim nodes"),
            Duration::from_secs(60),
            || {
                cli(&o.dsec, &token, &endpoint, &["--json", "node", "ls"])
                    .map(|out| out.lines().filter(|l| !l.trim().is_empty()).count() == sim_nodes)
                    .unwrap_or(false)
            },
        )?;
    }
    for args in [
        vec!["project", "create", "perf/bench"],
        vec![
            "project",
            "quota",
            "perf/bench",
            "--sandboxes",
            "100000000",
            "--vcpus",
            "100000000",
            "--mem",
            "1000000000000",
            "--disk",
            "1000000000000",
        ],
    ] {
        cli(&o.dsec, &token, &endpoint, &args)?;
    }
    Ok(Plane {
        procs,
        etcd_port: client,
        etcd_pid,
        api,
        api_pids,
        sim_pid,
        token,
    })
}

struct Burst {
    latencies_ms: Vec<f64>,
    wall_s: f64,
    failed: usize,
    first_error: Option<String>,
}

/// `creates` sandboxes from every client at once, `batch` per call (0: one Create each).
/// A sandbox's latency is its call's.
async fn burst(clients: &[Client], creates: usize, batch: usize) -> Burst {
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    let per_call = batch.max(1);
    for client in clients {
        let (client, next) = (client.clone(), next.clone());
        tasks.spawn(async move {
            let mut latencies = Vec::new();
            let mut failed = 0;
            let mut first_error = None;
            let request = || dsec_sdk::CreateSandboxRequest {
                memory_mib: 64,
                disk_mib: 64,
                vcpus: 1,
                ..Default::default()
            };
            loop {
                let taken = next.fetch_add(per_call, Ordering::Relaxed);
                if taken >= creates {
                    break;
                }
                let count = per_call.min(creates - taken);
                let t0 = Instant::now();
                let results: Vec<Result<(), String>> = if batch == 0 {
                    vec![client
                        .create(request())
                        .await
                        .map(drop)
                        .map_err(|e| e.to_string())]
                } else {
                    match client
                        .create_many((0..count).map(|_| request()).collect())
                        .await
                    {
                        Ok(results) => results
                            .into_iter()
                            .map(|r| r.map(drop).map_err(|e| e.to_string()))
                            .collect(),
                        Err(e) => vec![Err(e.to_string()); count],
                    }
                };
                let ms = t0.elapsed().as_secs_f64() * 1e3;
                for result in results {
                    match result {
                        Ok(_) => latencies.push(ms),
                        Err(e) => {
                            failed += 1;
                            first_error.get_or_insert(e);
                        }
                    }
                }
            }
            (latencies, failed, first_error)
        });
    }
    let mut out = Burst {
        latencies_ms: Vec::new(),
        wall_s: 0.0,
        failed: 0,
        first_error: None,
    };
    while let Some(Ok((latencies, failed, first_error))) = tasks.join_next().await {
        out.latencies_ms.extend(latencies);
        out.failed += failed;
        if out.first_error.is_none() {
            out.first_error = first_error;
        }
    }
    out.wall_s = started.elapsed().as_secs_f64();
    out
}

/// Placement throughput with `replicas` apiservers.
fn placement(
    o: &ClusterOpts,
    replicas: usize,
    runtime: &tokio::runtime::Runtime,
) -> Result<Value, String> {
    let dir = o.workdir.join(format!("replicas-{replicas}"));
    let plane = start_plane(o, &dir, replicas, o.nodes)?;
    let targets = plane
        .api
        .iter()
        .map(|a| format!("http://{a}"))
        .collect::<Vec<_>>()
        .join(",");
    let clients: Vec<Client> = runtime.block_on(async {
        let mut clients = Vec::new();
        for _ in 0..o.clients {
            let credentials = Credentials::new(Some(&plane.token), Some("perf/bench"));
            clients.push(
                Client::connect_with(&targets, credentials)
                    .await
                    .map_err(|e| e.to_string())?,
            );
        }
        Ok::<_, String>(clients)
    })?;
    // A small warm-up: connections, caches, the placer's view.
    for &batch in &o.batches {
        let warm = runtime.block_on(burst(&clients, o.clients * 2 * batch.max(1), batch));
        if warm.failed > 0 {
            return Err(format!("warm-up creates failed: {:?}", warm.first_error));
        }
    }
    let mut rounds = Vec::new();
    for (round, batch) in
        (0..o.rounds).flat_map(|round| o.batches.iter().map(move |&batch| (round, batch)))
    {
        let pids: Vec<u32> = plane
            .api_pids
            .iter()
            .copied()
            .chain([plane.etcd_pid])
            .chain(plane.sim_pid)
            .collect();
        let cpu0: Vec<f64> = pids.iter().map(|&p| cpu_seconds(p)).collect();
        let self0 = cpu_seconds(std::process::id());
        let rev0 = etcd_revision(plane.etcd_port)?;
        let result = runtime.block_on(burst(&clients, o.creates, batch));
        let rev1 = etcd_revision(plane.etcd_port)?;
        let cpu1: Vec<f64> = pids.iter().map(|&p| cpu_seconds(p)).collect();
        let self1 = cpu_seconds(std::process::id());
        let done = result.latencies_ms.len().max(1) as f64;
        let per_create_ms = |i: usize| (cpu1[i] - cpu0[i]) * 1e3 / done;
        let apiservers_ms: f64 = (0..replicas).map(per_create_ms).sum();
        let summary = Summary::of(&result.latencies_ms);
        let line = json!({
            "round": round,
            "batch": batch,
            "creates": result.latencies_ms.len(),
            "failed": result.failed,
            "first_error": result.first_error,
            "wall_s": result.wall_s,
            "creates_per_s": result.latencies_ms.len() as f64 / result.wall_s,
            "latency_ms": summary.as_ref().map(|s| s.to_json()),
            "etcd_write_txns_per_create": (rev1 - rev0) as f64 / done,
            "cpu_ms_per_create": {
                "apiservers": apiservers_ms,
                "etcd": per_create_ms(replicas),
                "sim_nodes": if plane.sim_pid.is_some() { per_create_ms(replicas + 1) } else { 0.0 },
                "clients": (self1 - self0) * 1e3 / done,
            },
        });
        eprintln!(
            "dsec-perf cluster: {replicas} apiserver(s), batch {batch}, round {round}: {line}"
        );
        rounds.push(line);
    }
    drop(clients);
    drop(plane);
    Ok(json!({"replicas": replicas, "rounds": rounds}))
}

/// create -> first exec on one real node, through the apiserver vs straight to the node.
fn real_create(o: &ClusterOpts, runtime: &tokio::runtime::Runtime) -> Result<Value, String> {
    let dir = o.workdir.join("real");
    let mut plane = start_plane(o, &dir, 1, 0)?;
    let node_addr = format!("127.0.0.1:{}", free_port());
    plane.procs.spawn(
        "node",
        &dir.join("node.log"),
        &o.dsec,
        &[
            "up".into(),
            "--state-dir".into(),
            dir.join("node").display().to_string(),
            "--metrics".into(),
            "off".into(),
            "--http".into(),
            "off".into(),
            "--cgroup-name".into(),
            format!("dsec-perf-cluster-{}", std::process::id()),
            "--default-backend".into(),
            "container".into(),
            "--listen".into(),
            node_addr.clone(),
            "--node-name".into(),
            "real".into(),
            "--control".into(),
            plane.api[0].clone(),
        ],
    )?;
    let endpoint = format!("http://{}", plane.api[0]);
    wait_until("the real node", Duration::from_secs(60), || {
        cli(&o.dsec, &plane.token, &endpoint, &["--json", "node", "ls"])
            .map(|out| out.contains("\"real\""))
            .unwrap_or(false)
    })?;
    let (via, direct) = runtime.block_on(async {
        let via = Client::connect_with(
            &endpoint,
            Credentials::new(Some(&plane.token), Some("perf/bench")),
        )
        .await
        .map_err(|e| e.to_string())?;
        let direct = Client::connect_with(&format!("http://{node_addr}"), Credentials::default())
            .await
            .map_err(|e| e.to_string())?;
        Ok::<_, String>((via, direct))
    })?;
    let one = |client: &Client| -> Result<f64, String> {
        runtime.block_on(async {
            let t0 = Instant::now();
            let sandbox = client
                .create(dsec_sdk::CreateSandboxRequest {
                    memory_mib: 64,
                    disk_mib: 64,
                    ..Default::default()
                })
                .await
                .map_err(|e| e.to_string())?;
            client
                .exec(&sandbox.id, &["true"], None)
                .await
                .map_err(|e| e.to_string())?;
            let ms = t0.elapsed().as_secs_f64() * 1e3;
            client
                .delete(&sandbox.id)
                .await
                .map_err(|e| e.to_string())?;
            Ok(ms)
        })
    };
    let (mut via_ms, mut direct_ms) = (Vec::new(), Vec::new());
    for i in 0..o.real_samples + 2 {
        let (a, b) = (one(&via)?, one(&direct)?);
        if i >= 2 {
            via_ms.push(a);
            direct_ms.push(b);
        }
    }
    let (sv, sd) = (Summary::of(&via_ms), Summary::of(&direct_ms));
    let added = match (&sv, &sd) {
        (Some(v), Some(d)) => Some(v.p50 - d.p50),
        _ => None,
    };
    drop(plane);
    Ok(json!({
        "create_to_first_exec_ms": {
            "via_apiserver": sv.map(|s| s.to_json()),
            "straight_to_node": sd.map(|s| s.to_json()),
        },
        "added_p50_ms": added,
    }))
}

pub fn run(o: &ClusterOpts) -> Result<(String, Value), String> {
    std::fs::create_dir_all(&o.workdir).map_err(|e| format!("{}: {e}", o.workdir.display()))?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let mut placements = Vec::new();
    for &replicas in &o.replicas {
        placements.push(placement(o, replicas, &runtime)?);
    }
    let real = if o.real_samples > 0 {
        Some(real_create(o, &runtime)?)
    } else {
        None
    };
    let mut table = format!(
        "placement: {} sim nodes, {} creates per round from {} clients, {} rounds (medians over rounds)\n",
        o.nodes, o.creates, o.clients, o.rounds
    );
    table += "replicas |      per call | creates/s | p50 ms | p99 ms | etcd txns/create | CPU ms/create: apiservers, etcd, sim nodes, clients | failed\n";
    let median = |values: &mut Vec<f64>| {
        values.sort_by(f64::total_cmp);
        values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
    };
    let mut summaries = Vec::new();
    for (p, &batch) in placements
        .iter()
        .flat_map(|p| o.batches.iter().map(move |b| (p, b)))
    {
        let rounds: Vec<Value> = p["rounds"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .into_iter()
            .filter(|r| r["batch"].as_u64() == Some(batch as u64))
            .collect();
        let pick = |f: &dyn Fn(&Value) -> Option<f64>| -> Vec<f64> {
            rounds.iter().filter_map(f).collect()
        };
        let rate = median(&mut pick(&|r| r["creates_per_s"].as_f64()));
        let p50 = median(&mut pick(&|r| r["latency_ms"]["p50"].as_f64()));
        let p99 = median(&mut pick(&|r| r["latency_ms"]["p99"].as_f64()));
        let txns = median(&mut pick(&|r| r["etcd_write_txns_per_create"].as_f64()));
        let api = median(&mut pick(&|r| {
            r["cpu_ms_per_create"]["apiservers"].as_f64()
        }));
        let etcd = median(&mut pick(&|r| r["cpu_ms_per_create"]["etcd"].as_f64()));
        let sim = median(&mut pick(&|r| r["cpu_ms_per_create"]["sim_nodes"].as_f64()));
        let clients = median(&mut pick(&|r| r["cpu_ms_per_create"]["clients"].as_f64()));
        let failed: u64 = rounds.iter().filter_map(|r| r["failed"].as_u64()).sum();
        let mode = if batch == 0 {
            "Create".to_string()
        } else {
            format!("CreateMany {batch}")
        };
        table += &format!(
            "{:>8} | {:>13} | {:>9.0} | {:>6.1} | {:>6.1} | {:>16.2} | {:.3}, {:.3}, {:.3}, {:.3} | {}\n",
            p["replicas"], mode, rate, p50, p99, txns, api, etcd, sim, clients, failed
        );
        summaries.push(json!({
            "replicas": p["replicas"], "batch": batch, "creates_per_s": rate, "p50_ms": p50, "p99_ms": p99,
            "etcd_write_txns_per_create": txns,
            "cpu_ms_per_create": {"apiservers": api, "etcd": etcd, "sim_nodes": sim, "clients": clients},
            "failed": failed,
        }));
    }
    if let Some(real) = &real {
        let v = &real["create_to_first_exec_ms"];
        table += &format!(
            "real create -> first exec (container, {} samples): via apiserver p50 {:.1} ms p99 {:.1} ms; straight to the node p50 {:.1} ms p99 {:.1} ms; added at p50 {:.1} ms\n",
            o.real_samples,
            v["via_apiserver"]["p50"].as_f64().unwrap_or(f64::NAN),
            v["via_apiserver"]["p99"].as_f64().unwrap_or(f64::NAN),
            v["straight_to_node"]["p50"].as_f64().unwrap_or(f64::NAN),
            v["straight_to_node"]["p99"].as_f64().unwrap_or(f64::NAN),
            real["added_p50_ms"].as_f64().unwrap_or(f64::NAN),
        );
    }
    table += "goal: >= 5000 creates/s with p99 < 100 ms; < 2 ms added to a real create at p50\n";
    let doc = json!({
        "options": {
            "nodes": o.nodes, "creates": o.creates, "clients": o.clients, "rounds": o.rounds,
            "replicas": o.replicas, "real_samples": o.real_samples, "batch": o.batches,
            "apiserver": o.apiserver.as_ref().map(|p| p.display().to_string())
                .unwrap_or_else(|| format!("{} control", o.dsec.display())),
        },
        "summary": summaries,
        "placement": placements,
        "real_create": real,
    });
    Ok((table, doc))
}
