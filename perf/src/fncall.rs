//! `dsec-perf fncall`: one-shot code execution. Our FnCall engine (warm container workers)
//! served in this process over HTTP (SandboxFusion's `POST /run_code`, kept-alive
//! connections) and gRPC (`Fn.Run` through the Rust SDK), beside a fresh `python3` (or
//! `g++` + run) in `bwrap` per call and a cold `dsec run` sandbox per call, on the same
//! image. Three snippets: python `print(1+1)`, a numpy snippet, a C++ hello world. Latency
//! at concurrency 1 (contenders alternate call by call), then calls/s at each concurrency.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

use crate::report::{goal, metric, Bound, Contender, Sample, Scenario};

pub const GOAL_HTTP_P50_MS: f64 = 10.0;
pub const GOAL_CALLS_PER_S: f64 = 300.0;
pub const GOAL_BWRAP_RATIO: f64 = 0.3;

#[derive(Debug, Clone)]
pub struct FnOpts {
    pub images: PathBuf,
    pub image: String,
    pub bwrap: Option<PathBuf>,
    pub dsec: Option<PathBuf>,
    pub samples: usize,
    pub run_samples: usize,
    pub concurrency: Vec<usize>,
    pub rounds: usize,
    /// Each throughput round makes this many times its snippet's base number of calls.
    pub round_scale: usize,
    pub python_workers: usize,
    /// Snippets to run (names as `Snippet::name`); empty: all.
    pub snippets: Vec<String>,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Snippet {
    Print,
    /// `print(1+1)` with numpy named in a comment: the full (numpy) zygote, what every python
    /// call ran in before the lean one.
    PrintFull,
    Numpy,
    Cpp,
}

impl Snippet {
    const ALL: [Snippet; 4] = [
        Snippet::Print,
        Snippet::PrintFull,
        Snippet::Numpy,
        Snippet::Cpp,
    ];

    fn name(self) -> &'static str {
        match self {
            Self::Print => "print",
            Self::PrintFull => "print-full",
            Self::Numpy => "numpy",
            Self::Cpp => "cpp",
        }
    }

    fn by_name(name: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|s| s.name() == name)
            .ok_or_else(|| {
                format!("unknown snippet {name:?}: expected print, print-full, numpy or cpp")
            })
    }

    fn language(self) -> &'static str {
        match self {
            Self::Cpp => "cpp",
            _ => "python",
        }
    }

    fn code(self) -> &'static str {
        match self {
            Self::Print => "print(1+1)",
            Self::PrintFull => "print(1+1)  # numpy",
            Self::Numpy => "import numpy as np\nprint(int(np.arange(10).sum()))",
            Self::Cpp => "#include <cstdio>\nint main(){std::puts(\"hello\");return 0;}\n",
        }
    }

    fn expected(self) -> &'static str {
        match self {
            Self::Print | Self::PrintFull => "2\n",
            Self::Numpy => "45\n",
            Self::Cpp => "hello\n",
        }
    }

    /// Calls per throughput round (C++ compiles: far fewer), times `scale`.
    fn calls_per_round(self, scale: usize) -> usize {
        scale.max(1)
            * match self {
                Self::Print | Self::PrintFull => 400,
                Self::Numpy => 200,
                Self::Cpp => 24,
            }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Transport {
    Http,
    Grpc,
    Bwrap,
    DsecRun,
}

impl Transport {
    fn name(self) -> &'static str {
        match self {
            Self::Http => "fncall-http",
            Self::Grpc => "fncall-grpc",
            Self::Bwrap => "bwrap",
            Self::DsecRun => "dsec-run",
        }
    }
}

/// A kept-alive HTTP/1.1 connection posting SandboxFusion requests.
struct HttpConn {
    reader: BufReader<tokio::net::TcpStream>,
}

impl HttpConn {
    async fn connect(addr: std::net::SocketAddr) -> Result<Self, String> {
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect {addr}: {e}"))?;
        let _ = stream.set_nodelay(true);
        Ok(Self {
            reader: BufReader::new(stream),
        })
    }

    async fn run_code(&mut self, snippet: Snippet) -> Result<String, String> {
        let body = json!({"code": snippet.code(), "language": snippet.language()}).to_string();
        let head = format!(
            "POST /run_code HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        let stream = self.reader.get_mut();
        stream
            .write_all(format!("{head}{body}").as_bytes())
            .await
            .map_err(|e| e.to_string())?;
        let mut length = None;
        let mut line = String::new();
        loop {
            line.clear();
            let n = self
                .reader
                .read_line(&mut line)
                .await
                .map_err(|e| e.to_string())?;
            if n == 0 {
                return Err("connection closed".into());
            }
            let trimmed = line.trim_end();
            if trimmed.is_empty() {
                break;
            }
            if let Some((name, value)) = trimmed.split_once(':') {
                if name.eq_ignore_ascii_case("content-length") {
                    length = value.trim().parse::<usize>().ok();
                }
            }
        }
        let mut body = vec![0u8; length.ok_or("no content-length")?];
        self.reader
            .read_exact(&mut body)
            .await
            .map_err(|e| e.to_string())?;
        let answer: Value = serde_json::from_slice(&body).map_err(|e| e.to_string())?;
        if answer["status"] != "Success" {
            return Err(format!("answer: {answer}"));
        }
        Ok(answer["run_result"]["stdout"]
            .as_str()
            .unwrap_or_default()
            .to_string())
    }
}

/// The engine and its two servers, on a runtime of their own.
struct Servers {
    http: std::net::SocketAddr,
    grpc: std::net::SocketAddr,
}

fn start_servers(o: &FnOpts) -> Result<Servers, String> {
    use dsec_fncall::{CallLimits, ContainerFactory, Engine, EngineConfig, Language};
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let factory = ContainerFactory::new(o.images.clone(), CallLimits::default());
    let mut config = EngineConfig {
        default_image: o.image.clone(),
        ..EngineConfig::default()
    };
    config.pool_sizes.insert(Language::Python, o.python_workers);
    config.pool_sizes.insert(Language::Cpp, 2);
    let engine = Arc::new(Engine::new(config, Arc::new(factory)));
    let (http, grpc) = runtime.block_on(async {
        engine
            .prewarm(&[Language::Python, Language::Cpp])
            .await
            .map_err(|e| e.to_string())?;
        let http = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| e.to_string())?;
        let grpc = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| e.to_string())?;
        Ok::<_, String>((http, grpc))
    })?;
    let addrs = Servers {
        http: http.local_addr().map_err(|e| e.to_string())?,
        grpc: grpc.local_addr().map_err(|e| e.to_string())?,
    };
    std::thread::spawn(move || {
        runtime.block_on(async move {
            tokio::spawn(dsec_fncall::sandboxfusion::serve(http, Arc::clone(&engine)));
            let incoming = tokio_stream::wrappers::TcpListenerStream::new(grpc);
            let _ = tonic::transport::Server::builder()
                .add_service(dsec_fncall::grpc::server(engine))
                .serve_with_incoming(incoming)
                .await;
        })
    });
    Ok(addrs)
}

/// One call by a baseline: a process per call.
async fn baseline_call(o: &FnOpts, t: Transport, snippet: Snippet) -> Result<String, String> {
    let rootfs = o.images.join(&o.image).join("rootfs");
    let script = match snippet {
        Snippet::Cpp => {
            "printf '%s' \"$0\" > /tmp/main.cpp && g++ -O2 -o /tmp/a.out /tmp/main.cpp && /tmp/a.out"
                .to_string()
        }
        _ => "exec python3 -c \"$0\"".to_string(),
    };
    let mut command = match t {
        Transport::Bwrap => {
            let mut c = tokio::process::Command::new(o.bwrap.as_ref().ok_or("no bwrap")?);
            c.arg("--ro-bind")
                .arg(&rootfs)
                .arg("/")
                .args(["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"])
                .args([
                    "--unshare-all",
                    "--die-with-parent",
                    "--new-session",
                    "--chdir",
                    "/tmp",
                ])
                .args(["--", "/bin/sh", "-c", &script, snippet.code()]);
            c
        }
        _ => {
            let mut c = tokio::process::Command::new(o.dsec.as_ref().ok_or("no dsec binary")?);
            c.args(["run", "--backend", "container", "--image", &o.image, "--"])
                .args(["/bin/sh", "-c", &script, snippet.code()]);
            c
        }
    };
    let out = command
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(format!(
            "{:?}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A caller of one transport: its own connection (HTTP) or channel (gRPC).
enum Caller {
    Http(HttpConn),
    Grpc(Box<dsec_sdk::Client>),
    Process(Transport),
}

impl Caller {
    async fn new(t: Transport, servers: &Servers) -> Result<Self, String> {
        Ok(match t {
            Transport::Http => Caller::Http(HttpConn::connect(servers.http).await?),
            Transport::Grpc => Caller::Grpc(Box::new(
                dsec_sdk::Client::connect(&format!("http://{}", servers.grpc))
                    .await
                    .map_err(|e| e.to_string())?,
            )),
            other => Caller::Process(other),
        })
    }

    async fn call(&mut self, o: &FnOpts, snippet: Snippet) -> Result<Duration, String> {
        let started = Instant::now();
        let stdout = match self {
            Caller::Http(conn) => conn.run_code(snippet).await?,
            Caller::Grpc(client) => {
                let answer = client
                    .run_code(dsec_sdk::FnRunRequest {
                        language: snippet.language().into(),
                        code: snippet.code().into(),
                        ..Default::default()
                    })
                    .await
                    .map_err(|e| e.to_string())?;
                if !answer.success {
                    return Err(format!("call failed: {answer:?}"));
                }
                String::from_utf8_lossy(&answer.run.map(|r| r.stdout).unwrap_or_default())
                    .into_owned()
            }
            Caller::Process(t) => baseline_call(o, *t, snippet).await?,
        };
        let elapsed = started.elapsed();
        if stdout != snippet.expected() {
            return Err(format!("unexpected output {stdout:?}"));
        }
        Ok(elapsed)
    }
}

pub struct FnResults {
    pub latency: Scenario,
    pub throughput: Scenario,
}

fn contender(name: String, description: &str, command: &str) -> Contender {
    Contender {
        name,
        description: description.into(),
        command: command.into(),
    }
}

fn description(t: Transport) -> &'static str {
    match t {
        Transport::Http => {
            "FnCall, SandboxFusion POST /run_code over a kept-alive HTTP/1.1 connection"
        }
        Transport::Grpc => "FnCall, Fn.Run through the Rust SDK over TCP",
        Transport::Bwrap => {
            "a fresh python3 (g++ then the binary) in bwrap per call, same image, --unshare-all"
        }
        Transport::DsecRun => {
            "`dsec run --backend container --image IMAGE` per call (cold sandbox)"
        }
    }
}

pub fn bench(o: &FnOpts) -> Result<FnResults, String> {
    let snippets = if o.snippets.is_empty() {
        Snippet::ALL.to_vec()
    } else {
        o.snippets
            .iter()
            .map(|n| Snippet::by_name(n))
            .collect::<Result<Vec<_>, _>>()?
    };
    // Joined before the workers start, so their CPU (and their calls') is counted too.
    let cpu = CpuAccount::join();
    let servers = start_servers(o)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let mut transports = vec![Transport::Http, Transport::Grpc];
    if o.bwrap.is_some() {
        transports.push(Transport::Bwrap);
    }
    let with_run = o.dsec.is_some() && o.run_samples > 0;
    if with_run {
        transports.push(Transport::DsecRun);
    }
    let mut latency = Scenario {
        name: "fncall-latency",
        title: "FnCall: one call's latency at concurrency 1".into(),
        method: format!(
            "{} samples per contender ({} for dsec-run), contenders alternating call by call; end to end at the caller, output checked; engine and servers in this process on their own 2 threads",
            o.samples, o.run_samples
        ),
        metrics: vec![metric("latency_ms", "latency", "ms")],
        contenders: Vec::new(),
        comparisons: Vec::new(),
        samples: Vec::new(),
        skipped: None,
        notes: Vec::new(),
    };
    let mut throughput = Scenario {
        name: "fncall-throughput",
        title: "FnCall: calls per second at concurrency C".into(),
        method: format!(
            "{} rounds per contender; a round is N calls (print and print-full {}, numpy {}, cpp {}) by C concurrent callers, each with its own connection",
            o.rounds,
            Snippet::Print.calls_per_round(o.round_scale),
            Snippet::Numpy.calls_per_round(o.round_scale),
            Snippet::Cpp.calls_per_round(o.round_scale)
        ),
        metrics: vec![
            metric("calls_per_s", "calls/s", "1/s"),
            metric("cpu_ms_per_call", "CPU per call", "ms"),
            metric("sys_share", "kernel share of that CPU", "x"),
        ],
        contenders: Vec::new(),
        comparisons: Vec::new(),
        samples: Vec::new(),
        skipped: None,
        notes: Vec::new(),
    };
    for &snippet in &snippets {
        for &t in &transports {
            let name = format!("{}/{}", t.name(), snippet.name());
            latency
                .contenders
                .push(contender(name.clone(), description(t), snippet.code()));
        }
        for ours in ["fncall-http", "fncall-grpc"] {
            for base in ["bwrap", "dsec-run"] {
                if transports.iter().any(|t| t.name() == base) {
                    latency.comparisons.push((
                        format!("{ours}/{}", snippet.name()),
                        format!("{base}/{}", snippet.name()),
                    ));
                }
            }
        }
    }
    for ours in ["fncall-http", "fncall-grpc"] {
        latency
            .comparisons
            .push((format!("{ours}/print"), format!("{ours}/print-full")));
    }
    runtime.block_on(async {
        let mut callers = Vec::new();
        for &t in &transports {
            callers.push((t, Caller::new(t, &servers).await?));
        }
        // Warm-up: each path once (C++ pools, connections, page cache of the image).
        for (_, caller) in callers.iter_mut() {
            for &snippet in &snippets {
                let _ = caller.call(o, snippet).await;
            }
        }
        for i in 0..o.samples {
            for &snippet in &snippets {
                for (t, caller) in callers.iter_mut() {
                    if *t == Transport::DsecRun && i >= o.run_samples {
                        continue;
                    }
                    let result = caller.call(o, snippet).await;
                    latency.samples.push(Sample {
                        contender: format!("{}/{}", t.name(), snippet.name()),
                        index: i,
                        values: match &result {
                            Ok(d) => [("latency_ms", d.as_secs_f64() * 1000.0)].into(),
                            Err(_) => Default::default(),
                        },
                        error: result.err(),
                    });
                }
            }
        }
        for &snippet in &snippets {
            for &t in transports.iter().filter(|t| **t != Transport::DsecRun) {
                for &c in &o.concurrency {
                    let name = format!("{}/{}@c{c}", t.name(), snippet.name());
                    throughput.contenders.push(contender(
                        name.clone(),
                        description(t),
                        snippet.code(),
                    ));
                    for round in 0..o.rounds {
                        let before = cpu.as_ref().map(CpuAccount::read);
                        let result = throughput_round(o, t, snippet, c, &servers).await;
                        let used = cpu.as_ref().zip(before).map(|(a, b)| a.read().since(&b));
                        throughput.samples.push(Sample {
                            contender: name.clone(),
                            index: round,
                            values: match &result {
                                Ok(rate) => {
                                    let mut v: std::collections::BTreeMap<_, _> =
                                        [("calls_per_s", *rate)].into();
                                    if let Some((total, sys)) = used {
                                        let calls = snippet.calls_per_round(o.round_scale) as f64;
                                        v.insert("cpu_ms_per_call", total * 1000.0 / calls);
                                        v.insert("sys_share", sys / total.max(1e-9));
                                    }
                                    v
                                }
                                Err(_) => Default::default(),
                            },
                            error: result.err(),
                        });
                    }
                }
            }
        }
        Ok::<_, String>(())
    })?;
    throughput.notes.push(match &cpu {
        Some(_) => "CPU per call: CPU time of this process and all its children (engine, servers, clients, zygotes, calls, bwrap) over the round, from the cgroup v1 cpuacct group it joined at start; kernel share = system / total".into(),
        None => "CPU per call not measured: no cgroup v1 cpuacct hierarchy (or not root)".into(),
    });
    drop(cpu);
    let p50 = |sc: &Scenario, c: &str, m: &str| sc.summary(c, m).map(|s| s.p50);
    let http_p50 = p50(&latency, "fncall-http/print", "latency_ms");
    latency.notes.push(goal(
        "python print(1+1) p50 via HTTP",
        http_p50,
        Bound::Below,
        GOAL_HTTP_P50_MS,
        "ms",
    ));
    if let (Some(ours), Some(base)) = (http_p50, p50(&latency, "bwrap/print", "latency_ms")) {
        latency.notes.push(goal(
            "python print(1+1) p50 via HTTP / bwrap p50",
            Some(ours / base),
            Bound::AtMost,
            GOAL_BWRAP_RATIO,
            "x",
        ));
    }
    let best = o
        .concurrency
        .iter()
        .filter_map(|c| {
            p50(
                &throughput,
                &format!("fncall-http/print@c{c}"),
                "calls_per_s",
            )
        })
        .fold(None, |acc: Option<f64>, v| {
            Some(acc.map_or(v, |a| a.max(v)))
        });
    throughput.notes.push(goal(
        "python print(1+1) calls/s via HTTP (best concurrency, median round)",
        best,
        Bound::AtLeast,
        GOAL_CALLS_PER_S,
        "1/s",
    ));
    Ok(FnResults {
        latency,
        throughput,
    })
}

/// CPU time of this process and every process it starts: a cgroup v1 cpuacct group of its
/// own (v2 would lose the workers, which move to the engine's groups). Left on drop.
struct CpuAccount {
    dir: PathBuf,
}

#[derive(Clone, Copy)]
struct CpuUsage {
    total_ns: u64,
    sys_ns: u64,
}

impl CpuUsage {
    /// (total, system) seconds from `earlier` to this reading.
    fn since(&self, earlier: &CpuUsage) -> (f64, f64) {
        (
            self.total_ns.saturating_sub(earlier.total_ns) as f64 / 1e9,
            self.sys_ns.saturating_sub(earlier.sys_ns) as f64 / 1e9,
        )
    }
}

impl CpuAccount {
    const ROOT: &'static str = "/sys/fs/cgroup/cpuacct";

    fn join() -> Option<Self> {
        // Groups of earlier runs, empty once their workers died with them.
        if let Ok(entries) = std::fs::read_dir(Self::ROOT) {
            for entry in entries.flatten() {
                if entry
                    .file_name()
                    .to_string_lossy()
                    .starts_with("dsec-perf-fncall-")
                {
                    let _ = std::fs::remove_dir(entry.path());
                }
            }
        }
        let dir = Path::new(Self::ROOT).join(format!("dsec-perf-fncall-{}", std::process::id()));
        std::fs::create_dir_all(&dir).ok()?;
        let account = Self { dir };
        // cgroup.procs moves every thread of this process.
        std::fs::write(
            account.dir.join("cgroup.procs"),
            std::process::id().to_string(),
        )
        .ok()?;
        Some(account)
    }

    fn read_ns(&self, file: &str) -> u64 {
        std::fs::read_to_string(self.dir.join(file))
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    }

    fn read(&self) -> CpuUsage {
        CpuUsage {
            total_ns: self.read_ns("cpuacct.usage"),
            sys_ns: self.read_ns("cpuacct.usage_sys"),
        }
    }
}

impl Drop for CpuAccount {
    fn drop(&mut self) {
        // Back to the root group; the group goes once the workers (children) have left it.
        let _ = std::fs::write(
            Path::new(Self::ROOT).join("cgroup.procs"),
            std::process::id().to_string(),
        );
        let dir = self.dir.clone();
        std::thread::spawn(move || {
            for _ in 0..100 {
                if std::fs::remove_dir(&dir).is_ok() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
    }
}

/// Calls per second of N calls by `c` concurrent callers.
async fn throughput_round(
    o: &FnOpts,
    t: Transport,
    snippet: Snippet,
    c: usize,
    servers: &Servers,
) -> Result<f64, String> {
    let total = snippet.calls_per_round(o.round_scale);
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut callers = Vec::new();
    for _ in 0..c {
        callers.push(Caller::new(t, servers).await?);
    }
    let started = Instant::now();
    let mut tasks = Vec::new();
    for mut caller in callers {
        let next = Arc::clone(&next);
        let o = o.clone();
        tasks.push(tokio::spawn(async move {
            while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < total {
                caller.call(&o, snippet).await?;
            }
            Ok::<_, String>(())
        }));
    }
    for task in tasks {
        task.await.map_err(|e| e.to_string())??;
    }
    Ok(total as f64 / started.elapsed().as_secs_f64())
}

pub fn to_json(r: &FnResults) -> Value {
    json!({"latency": r.latency.to_json(), "throughput": r.throughput.to_json()})
}

pub fn default_images() -> PathBuf {
    std::env::var_os("DSEC_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/lib/dsec"))
        .join("images")
}

pub fn check_image(o: &FnOpts) -> Result<(), String> {
    let rootfs = o.images.join(&o.image).join("rootfs");
    if !Path::new(&rootfs).join("usr/bin/python3").exists() {
        return Err(format!(
            "no FnCall image at {}: build it with `images/fncall/build.sh --install`",
            rootfs.display()
        ));
    }
    Ok(())
}
