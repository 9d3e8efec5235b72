//! `dsec-perf node`: the node daemon end to end. A real `dsec-edge` (embedded defaults, a
//! private state directory and cgroup name) is started and driven through the Rust SDK:
//! create -> first exec latency beside `unshare ... chroot` and `bwrap` on the same rootfs,
//! bursts of concurrent creates (creations per second, latency under load, every sandbox's
//! output checked, nothing left behind after the deletes), and the exec round trip in a warm
//! sandbox. Per backend: container everywhere, microVM where a Linux guest can boot.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use dsec_sdk::{Backend, Client, CreateSandboxRequest};
use serde_json::{json, Value};

use crate::direct::{ms, shell_words};
use crate::layerfs::round_order;
use crate::report::{detail, goal, goal_line, metric, Bound, Contender, Sample, Scenario};

/// Design goals the tables are checked against.
pub const GOAL_CREATES_PER_S: f64 = 100.0;
pub const GOAL_EXEC_P50_MS: f64 = 2.0;

#[derive(Debug, Clone)]
pub struct NodeOpts {
    pub edge: PathBuf,
    pub rootfs: PathBuf,
    pub bwrap: Option<PathBuf>,
    pub unshare: Option<PathBuf>,
    /// Backends asked for (container, microvm); microvm is skipped where it cannot boot.
    pub backends: Vec<String>,
    pub samples: usize,
    pub warmup: usize,
    pub burst: usize,
    pub burst_rounds: usize,
    pub exec_samples: usize,
    pub memory_mib: i64,
    pub disk_mib: i64,
    pub timeout: Duration,
    pub workdir: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error(
        "dsec-edge not found at {0}: build it with `cargo build --release -p dsec-edge -p \
         dsec-agent` (the agent must sit next to it) or pass --edge"
    )]
    NoEdge(PathBuf),
    #[error(
        "the container rootfs {0} has no bin/: run ./setup.sh (installs \
         $DSEC_HOME/images/busybox) or pass --rootfs"
    )]
    NoRootfs(PathBuf),
    #[error("unknown backend {0:?} in --backends: expected container or microvm")]
    UnknownBackend(String),
    #[error(
        "the node benchmark needs root (dsec-edge makes namespaces and cgroups): run it with sudo"
    )]
    NotRoot,
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("dsec-edge did not serve on {socket} within {timeout:?} ({why}); its log: {log}")]
    EdgeNotReady {
        socket: PathBuf,
        timeout: Duration,
        why: String,
        log: String,
    },
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> NodeError {
    let what = what.into();
    move |source| NodeError::Io { what, source }
}

pub struct Results {
    pub create: Scenario,
    pub burst: Scenario,
    pub exec: Scenario,
    /// Per backend: ran, or why not.
    pub backends: Value,
    pub edge_command: String,
}

/// One sandbox backend: its API value and whether (and why not) it runs here.
#[derive(Debug, Clone)]
pub struct BackendPlan {
    pub name: &'static str,
    pub api: Backend,
    pub skipped: Option<String>,
}

/// What runs of `wanted` on a host whose /dev/kvm is `kvm_kind` (machine::kvm_kind()).
pub fn plan_backends(wanted: &[String], kvm_kind: &str) -> Result<Vec<BackendPlan>, NodeError> {
    let mut plans = Vec::new();
    for w in wanted {
        let plan = match w.as_str() {
            "container" => BackendPlan {
                name: "container",
                api: Backend::Container,
                skipped: None,
            },
            "microvm" => BackendPlan {
                name: "microvm",
                api: Backend::Microvm,
                skipped: match kvm_kind {
                    "hardware" => None,
                    "pvm" => Some(
                        "kvm_kind=pvm: /dev/kvm is the PVM software hypervisor, a Linux guest \
                         cannot boot on it (microVM figures need hardware KVM or the rig)"
                            .into(),
                    ),
                    other => Some(format!(
                        "kvm_kind={other}: no usable /dev/kvm for a Linux guest"
                    )),
                },
            },
            other => return Err(NodeError::UnknownBackend(other.into())),
        };
        plans.push(plan);
    }
    Ok(plans)
}

/// The daemon's default vCPU overcommit (DaemonConfig::default()).
pub const DEFAULT_OVERCOMMIT_CPU: f64 = 64.0;

/// The `--overcommit-cpu` a daemon on `cores` needs to admit `sandboxes` 1-vCPU sandboxes at
/// once, when its default does not (on 2 cores the default budget is 128 vCPUs).
pub fn cpu_overcommit_for(sandboxes: usize, cores: usize) -> Option<f64> {
    let needed = (sandboxes as f64 / cores.max(1) as f64).ceil();
    (needed > DEFAULT_OVERCOMMIT_CPU).then_some(needed)
}

/// A `dsec-edge` on a private state directory and cgroup name. Dropping it deletes nothing
/// through the API (use `Edge::delete_all` first) but always stops the daemon, kills any
/// process still referencing its sandboxes, removes its cgroups and the state directory.
pub struct Edge {
    child: Option<Child>,
    pub state: PathBuf,
    pub socket: PathBuf,
    pub cgroup_name: String,
    pub log: PathBuf,
    pub command: String,
}

impl Edge {
    pub fn start(bin: &Path, workdir: &Path, extra: &[String]) -> Result<Edge, NodeError> {
        Self::start_named(
            bin,
            workdir,
            extra,
            &format!("dsec-perf-{}", std::process::id()),
        )
    }

    /// As [`Edge::start`], with the sandboxes' cgroup name (several daemons at once need
    /// one each).
    pub fn start_named(
        bin: &Path,
        workdir: &Path,
        extra: &[String],
        cgroup_name: &str,
    ) -> Result<Edge, NodeError> {
        let state = workdir.join("edge");
        let cgroup_name = cgroup_name.to_string();
        std::fs::create_dir_all(&state).map_err(io(format!("create {}", state.display())))?;
        let log = workdir.join("edge.log");
        let log_file =
            std::fs::File::create(&log).map_err(io(format!("create {}", log.display())))?;
        let err_file = log_file.try_clone().map_err(io("dup the log file"))?;
        // Isolation only (state dir, cgroup name, no metrics port clash); all else default.
        let mut args: Vec<std::ffi::OsString> = vec![
            "--state-dir".into(),
            state.clone().into(),
            "--metrics".into(),
            "off".into(),
            "--cgroup-name".into(),
            cgroup_name.clone().into(),
        ];
        args.extend(extra.iter().map(Into::into));
        let command = shell_words(bin, &args);
        let mut cmd = Command::new(bin);
        cmd.args(&args)
            .stdin(Stdio::null())
            .stdout(log_file)
            .stderr(err_file);
        {
            use std::os::unix::process::CommandExt;
            // SAFETY: prctl is async-signal-safe and touches no memory of the parent; the
            // daemon dies with the harness (its sandboxes are removed by the drop below or
            // by the next daemon on this state dir).
            unsafe {
                cmd.pre_exec(|| {
                    if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let child = cmd
            .spawn()
            .map_err(io(format!("start {}", bin.display())))?;
        Ok(Edge {
            child: Some(child),
            socket: state.join("edge.sock"),
            state,
            cgroup_name,
            log,
            command,
        })
    }

    /// CPU time of the daemon and of its reaped children (the sandboxes' agents and what
    /// they ran), in ms: kernel work done elsewhere (e.g. network namespace cleanup in
    /// kworkers) is not in it.
    pub fn cpu_ms(&self) -> Option<f64> {
        let pid = self.child.as_ref()?.id();
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // SAFETY: sysconf has no memory arguments.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
        cpu_ms_of_stat(&stat, hz as f64)
    }

    fn sandboxes_dir(&self) -> PathBuf {
        self.state.join("sandboxes")
    }

    /// Connects once the daemon answers NodeStatus.
    pub async fn connect(&mut self, timeout: Duration) -> Result<Client, NodeError> {
        let deadline = Instant::now() + timeout;
        let target = format!("unix:{}", self.socket.display());
        let mut why = String::from("socket not bound");
        loop {
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    why = format!("it exited: {status}");
                    break;
                }
            }
            if self.socket.exists() {
                match Client::connect(&target).await {
                    Ok(c) => match c.node_status().await {
                        Ok(_) => return Ok(c),
                        Err(e) => why = e.to_string(),
                    },
                    Err(e) => why = e.to_string(),
                }
            }
            if Instant::now() > deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Err(NodeError::EdgeNotReady {
            socket: self.socket.clone(),
            timeout,
            why,
            log: crate::run::read_tail(&self.log, 2000),
        })
    }

    /// What of the node's sandboxes is still on the host: processes whose command line
    /// names the sandboxes directory, entries in it, mounts under it, sandbox cgroups.
    pub fn leftovers(&self) -> Vec<String> {
        let dir = self.sandboxes_dir();
        let mut out: Vec<String> = procs_referencing(&dir)
            .into_iter()
            .map(|p| format!("process {p}"))
            .collect();
        if let Ok(rd) = std::fs::read_dir(&dir) {
            out.extend(rd.flatten().map(|e| format!("dir {}", e.path().display())));
        }
        let needle = dir.to_string_lossy().into_owned();
        if let Ok(mi) = std::fs::read_to_string("/proc/self/mountinfo") {
            out.extend(
                mi.lines()
                    .filter(|l| l.contains(&needle))
                    .map(|l| format!("mount {l}")),
            );
        }
        out.extend(
            sandbox_cgroups(Path::new("/sys/fs/cgroup"), &self.cgroup_name)
                .into_iter()
                .map(|c| format!("cgroup {}", c.display())),
        );
        out
    }

    /// Polls `leftovers` until empty or `within` has passed (teardown finishes in the
    /// kernel after the API call returns: a zombie reaped a moment later is not a leak).
    pub async fn wait_clean(&self, within: Duration) -> Vec<String> {
        let deadline = Instant::now() + within;
        loop {
            let left = self.leftovers();
            if left.is_empty() || Instant::now() > deadline {
                return left;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Edge {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SAFETY: kill(2) on the pid of a child we have not reaped yet.
            unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(10);
            while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        for pid in procs_referencing(&self.sandboxes_dir()) {
            // SAFETY: kill(2) with a pid read from /proc; at worst ESRCH.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        for cg in sandbox_cgroups(Path::new("/sys/fs/cgroup"), &self.cgroup_name) {
            for _ in 0..100 {
                if std::fs::remove_dir(&cg).is_ok() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        for d in cgroup_dirs_named(Path::new("/sys/fs/cgroup"), &self.cgroup_name) {
            let _ = std::fs::remove_dir(d);
        }
        let _ = std::fs::remove_dir_all(&self.state);
    }
}

/// utime + stime + cutime + cstime of a `/proc/PID/stat` line, in ms.
pub fn cpu_ms_of_stat(stat: &str, ticks_per_s: f64) -> Option<f64> {
    // The command name may contain spaces and parentheses: fields start after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After the name: state is field 3, utime..cstime are fields 14..=17.
    let ticks: f64 = f
        .get(11..15)?
        .iter()
        .map(|v| v.parse::<f64>().ok())
        .sum::<Option<f64>>()?;
    (ticks_per_s > 0.0).then(|| ticks * 1000.0 / ticks_per_s)
}

/// Pids (not ours) whose command line or environment contains `text`.
fn procs_referencing(text: &Path) -> Vec<libc::pid_t> {
    let needle = text.as_os_str().as_encoded_bytes();
    let me = std::process::id() as libc::pid_t;
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    // A container's agent names its sandbox directory in its environment, a VMM on its
    // command line.
    rd.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<libc::pid_t>().ok())
        .filter(|&p| p != me)
        .filter(|p| {
            ["cmdline", "environ"].iter().any(|f| {
                std::fs::read(format!("/proc/{p}/{f}"))
                    .is_ok_and(|c| c.windows(needle.len()).any(|w| w == needle))
            })
        })
        .collect()
}

/// Directories called `name` in any cgroup hierarchy under `root` (depth-limited walk).
fn cgroup_dirs_named(root: &Path, name: &str) -> Vec<PathBuf> {
    fn walk(dir: &Path, name: &str, depth: usize, out: &mut Vec<PathBuf>) {
        let Ok(rd) = std::fs::read_dir(dir) else {
            return;
        };
        for e in rd.flatten() {
            if !e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                continue;
            }
            let p = e.path();
            if e.file_name() == name {
                out.push(p);
            } else if depth < 8 {
                walk(&p, name, depth + 1, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(root, name, 0, &mut out);
    out
}

/// The per-sandbox cgroups under every `name` directory.
fn sandbox_cgroups(root: &Path, name: &str) -> Vec<PathBuf> {
    cgroup_dirs_named(root, name)
        .into_iter()
        .flat_map(|d| {
            std::fs::read_dir(d)
                .into_iter()
                .flatten()
                .flatten()
                .filter(|e| e.file_type().map(|t| t.is_dir()).unwrap_or(false))
                .map(|e| e.path())
        })
        .collect()
}

fn contender(name: &str, description: &str, command: String) -> Contender {
    Contender {
        name: name.into(),
        description: description.into(),
        command,
    }
}

fn request(o: &NodeOpts, b: &BackendPlan, label: &str) -> CreateSandboxRequest {
    CreateSandboxRequest {
        backend: b.api as i32,
        memory_mib: o.memory_mib,
        disk_mib: o.disk_mib,
        labels: [("dsec-perf".to_string(), label.to_string())]
            .into_iter()
            .collect(),
        ..Default::default()
    }
}

/// The two baselines: a one-shot namespaced `true` in the same rootfs, no daemon.
fn baselines(o: &NodeOpts) -> Vec<(&'static str, &'static str, PathBuf, Vec<String>)> {
    let root = o.rootfs.to_string_lossy().into_owned();
    let mut v = Vec::new();
    if let Some(unshare) = &o.unshare {
        v.push((
            "unshare",
            "unshare(1) new mount/pid/net/uts/ipc namespaces + chroot, /bin/true, waited for",
            unshare.clone(),
            [
                "--mount",
                "--pid",
                "--fork",
                "--net",
                "--uts",
                "--ipc",
                "chroot",
                &root,
                "/bin/true",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect(),
        ));
    }
    if let Some(bwrap) = &o.bwrap {
        v.push((
            "bwrap",
            "bubblewrap, all namespaces, rootfs read-only as /, /proc and /dev, /bin/true",
            bwrap.clone(),
            [
                "--unshare-all",
                "--die-with-parent",
                "--ro-bind",
                &root,
                "/",
                "--proc",
                "/proc",
                "--dev",
                "/dev",
                "/bin/true",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect(),
        ));
    }
    v
}

fn run_baseline(program: &Path, args: &[String]) -> Result<f64, String> {
    let t0 = Instant::now();
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| format!("run {}: {e}", program.display()))?;
    let took = ms(t0.elapsed());
    if !out.status.success() {
        return Err(format!(
            "{} exited {}: {}",
            program.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(took)
}

/// One DSec sample: create -> ready -> `true` done -> deleted.
async fn dsec_create_exec(
    client: &Client,
    o: &NodeOpts,
    b: &BackendPlan,
) -> Result<BTreeMap<&'static str, f64>, String> {
    let t0 = Instant::now();
    let sb = client
        .create(request(o, b, "create"))
        .await
        .map_err(|e| format!("create: {e}"))?;
    let created = ms(t0.elapsed());
    let out = client.exec(&sb.id, &["true"], None).await;
    let first_exec = ms(t0.elapsed());
    let t_del = Instant::now();
    let deleted = client.delete(&sb.id).await;
    let delete_ms = ms(t_del.elapsed());
    let out = out.map_err(|e| format!("exec true in {}: {e}", sb.id))?;
    if out.exit_code() != 0 {
        return Err(format!("`true` in {} exited {}", sb.id, out.exit_code()));
    }
    deleted.map_err(|e| format!("delete {}: {e}", sb.id))?;
    Ok([
        ("create_ms", created),
        ("first_exec_ms", first_exec),
        ("delete_ms", delete_ms),
    ]
    .into_iter()
    .collect())
}

fn skeleton_create(o: &NodeOpts, plans: &[BackendPlan], edge_cmd: &str) -> Scenario {
    let mut contenders: Vec<Contender> = plans
        .iter()
        .filter(|b| b.skipped.is_none())
        .map(|b| {
            contender(
                b.name,
                &format!("dsec-edge {} sandbox through the Rust SDK", b.name),
                format!(
                    "Create(backend={}, memory_mib={}, disk_mib={}); Exec([\"true\"]); Delete  \
                     against {edge_cmd}",
                    b.name, o.memory_mib, o.disk_mib
                ),
            )
        })
        .collect();
    for (name, desc, prog, args) in baselines(o) {
        contenders.push(contender(name, desc, shell_words(&prog, &to_os(&args))));
    }
    let comparisons = plans
        .iter()
        .filter(|b| b.skipped.is_none())
        .flat_map(|b| {
            baselines(o)
                .into_iter()
                .map(move |(base, ..)| (b.name.to_string(), base.to_string()))
        })
        .collect();
    Scenario {
        name: "node_create",
        title: "node: create -> first exec done (sequential)".into(),
        method: format!(
            "per sample one sandbox created, `true` run in it, deleted (delete not in the \
             first-exec time); baselines spawn their command and wait for it; contenders \
             alternate every sample, the first rotating; {} warm-up rounds discarded",
            o.warmup
        ),
        metrics: vec![
            metric("first_exec_ms", "create + first exec done", "ms"),
            detail("create_ms", "create returned (sandbox ready)", "ms"),
            detail("delete_ms", "delete returned", "ms"),
        ],
        contenders,
        comparisons,
        samples: Vec::new(),
        skipped: None,
        notes: Vec::new(),
    }
}

fn to_os(args: &[String]) -> Vec<std::ffi::OsString> {
    args.iter().map(Into::into).collect()
}

async fn bench_create(client: &Client, o: &NodeOpts, plans: &[BackendPlan], sc: &mut Scenario) {
    #[derive(Clone, Copy)]
    enum Who<'a> {
        Dsec(&'a BackendPlan),
        Base(usize),
    }
    let bases = baselines(o);
    let mut who: Vec<Who> = plans
        .iter()
        .filter(|b| b.skipped.is_none())
        .map(Who::Dsec)
        .collect();
    who.extend((0..bases.len()).map(Who::Base));
    let mut fails: BTreeMap<String, usize> = BTreeMap::new();
    for round in 0..o.warmup + o.samples {
        for w in round_order(&who, round) {
            let name = match w {
                Who::Dsec(b) => b.name.to_string(),
                Who::Base(i) => bases[i].0.to_string(),
            };
            // A contender failing 3 times in a row is not run again.
            if fails.get(&name).copied().unwrap_or(0) >= 3 {
                continue;
            }
            let r = match w {
                Who::Dsec(b) => dsec_create_exec(client, o, b).await,
                Who::Base(i) => run_baseline(&bases[i].2, &bases[i].3)
                    .map(|t| [("first_exec_ms", t)].into_iter().collect()),
            };
            if round < o.warmup && r.is_ok() {
                continue;
            }
            let f = fails.entry(name.clone()).or_default();
            *f = if r.is_err() { *f + 1 } else { 0 };
            let (values, error) = match r {
                Ok(v) => (v, None),
                Err(e) => (BTreeMap::new(), Some(e)),
            };
            sc.samples.push(Sample {
                contender: name,
                index: round.saturating_sub(o.warmup),
                values,
                error,
            });
        }
    }
}

/// One burst: `n` concurrent creates, then one checked command in each, then concurrent
/// deletes and a leak check. Returns the round's sample and per-sandbox latency samples.
async fn burst_round(
    client: &Client,
    edge: &Edge,
    o: &NodeOpts,
    b: &BackendPlan,
    round: usize,
) -> Vec<Sample> {
    let name = b.name.to_string();
    let cpu0 = edge.cpu_ms();
    let mut set = tokio::task::JoinSet::new();
    let t0 = Instant::now();
    for i in 0..o.burst {
        let c = client.clone();
        let req = request(o, b, "burst");
        set.spawn(async move {
            let sent = t0.elapsed();
            let r = c.create(req).await;
            (i, sent, t0.elapsed(), r)
        });
    }
    let mut created = Vec::new();
    let mut errors = Vec::new();
    let mut lat = Vec::new();
    let (mut first_sent, mut last_ready) = (Duration::MAX, Duration::ZERO);
    while let Some(joined) = set.join_next().await {
        match joined {
            Ok((i, sent, ready, Ok(sb))) => {
                first_sent = first_sent.min(sent);
                last_ready = last_ready.max(ready);
                lat.push(ms(ready - sent));
                created.push((i, sb.id));
            }
            Ok((i, _, _, Err(e))) => errors.push(format!("create #{i}: {e}")),
            Err(e) => errors.push(format!("create task: {e}")),
        }
    }
    let span = last_ready.saturating_sub(first_sent);
    // Every sandbox runs one command; its output must be its own.
    let t_exec = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for (i, id) in created.clone() {
        let c = client.clone();
        set.spawn(async move {
            let script = format!("echo sandbox-{i}; hostname");
            let r = c.exec(&id, &["sh", "-c", &script], None).await;
            (i, id, r)
        });
    }
    let mut checked = 0usize;
    while let Some(joined) = set.join_next().await {
        match joined {
            Ok((i, id, Ok(out))) => {
                let want = format!("sandbox-{i}\n{id}\n");
                if out.exit_code() == 0 && out.stdout == want.as_bytes() {
                    checked += 1;
                } else {
                    errors.push(format!(
                        "sandbox {id}: exit {} output {:?}, expected {want:?}",
                        out.exit_code(),
                        String::from_utf8_lossy(&out.stdout)
                    ));
                }
            }
            Ok((_, id, Err(e))) => errors.push(format!("exec in {id}: {e}")),
            Err(e) => errors.push(format!("exec task: {e}")),
        }
    }
    let exec_all = ms(t_exec.elapsed());
    let t_del = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for (_, id) in created.clone() {
        let c = client.clone();
        set.spawn(async move { (id.clone(), c.delete(&id).await) });
    }
    while let Some(joined) = set.join_next().await {
        match joined {
            Ok((_, Ok(()))) => {}
            Ok((id, Err(e))) => errors.push(format!("delete {id}: {e}")),
            Err(e) => errors.push(format!("delete task: {e}")),
        }
    }
    let delete_all = ms(t_del.elapsed());
    match client.list(Default::default()).await {
        Ok(l) if l.is_empty() => {}
        Ok(l) => errors.push(format!(
            "{} sandboxes still listed after the deletes",
            l.len()
        )),
        Err(e) => errors.push(format!("list: {e}")),
    }
    let left = edge.wait_clean(Duration::from_secs(5)).await;
    if !left.is_empty() {
        errors.push(format!(
            "left on the host 5 s after the deletes: {}",
            left.iter().take(5).cloned().collect::<Vec<_>>().join(", ")
        ));
    }
    let mut values: BTreeMap<&'static str, f64> = [
        ("burst_created", created.len() as f64),
        ("burst_checked", checked as f64),
        ("burst_span_ms", ms(span)),
        ("burst_exec_all_ms", exec_all),
        ("burst_delete_all_ms", delete_all),
        ("leftovers", left.len() as f64),
    ]
    .into_iter()
    .collect();
    if let (Some(a), Some(b)) = (cpu0, edge.cpu_ms()) {
        if !created.is_empty() {
            values.insert("cpu_ms_per_sandbox", (b - a) / created.len() as f64);
        }
    }
    if !created.is_empty() && span > Duration::ZERO {
        values.insert("creates_per_s", created.len() as f64 / span.as_secs_f64());
    }
    let mut out = vec![Sample {
        contender: name.clone(),
        index: round,
        values,
        error: (!errors.is_empty()).then(|| {
            let more = errors.len().saturating_sub(3);
            let short = |e: &String| e.chars().take(160).collect::<String>();
            let mut e = errors
                .iter()
                .take(3)
                .map(short)
                .collect::<Vec<_>>()
                .join("; ");
            if more > 0 {
                e.push_str(&format!("; {more} more"));
            }
            e
        }),
    }];
    out.extend(lat.into_iter().enumerate().map(|(k, l)| Sample {
        contender: name.clone(),
        index: round * o.burst + k,
        values: [("burst_create_ms", l)].into_iter().collect(),
        error: None,
    }));
    out
}

async fn bench_exec(client: &Client, o: &NodeOpts, plans: &[BackendPlan], sc: &mut Scenario) {
    let mut warm = Vec::new();
    for b in plans.iter().filter(|b| b.skipped.is_none()) {
        match client.create(request(o, b, "exec")).await {
            Ok(sb) => warm.push((b.name, sb.id)),
            Err(e) => sc.samples.push(Sample {
                contender: b.name.into(),
                index: 0,
                values: BTreeMap::new(),
                error: Some(format!("create the warm sandbox: {e}")),
            }),
        }
    }
    // Warm-up: the agent's first exec, the channel's first stream.
    for (_, id) in &warm {
        for _ in 0..o.warmup.max(1) * 5 {
            let _ = client.exec(id, &["true"], None).await;
        }
    }
    for i in 0..o.exec_samples {
        for (name, id) in round_order(&warm.iter().collect::<Vec<_>>(), i) {
            let t0 = Instant::now();
            let r = client.exec(id, &["true"], None).await;
            let took = ms(t0.elapsed());
            let (values, error) = match r {
                Ok(out) if out.exit_code() == 0 => {
                    ([("exec_ms", took)].into_iter().collect(), None)
                }
                Ok(out) => (
                    BTreeMap::new(),
                    Some(format!("`true` exited {}", out.exit_code())),
                ),
                Err(e) => (BTreeMap::new(), Some(format!("exec: {e}"))),
            };
            sc.samples.push(Sample {
                contender: name.to_string(),
                index: i,
                values,
                error,
            });
        }
    }
    for (_, id) in &warm {
        let _ = client.delete(id).await;
    }
}

/// Checks what the benchmark needs before anything starts.
pub fn check_prerequisites(o: &NodeOpts) -> Result<(), NodeError> {
    // SAFETY: geteuid has no arguments and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Err(NodeError::NotRoot);
    }
    if !o.edge.is_file() {
        return Err(NodeError::NoEdge(o.edge.clone()));
    }
    if !o.rootfs.join("bin").is_dir() {
        return Err(NodeError::NoRootfs(o.rootfs.clone()));
    }
    Ok(())
}

pub fn bench(o: &NodeOpts, kvm_kind: &str) -> Result<Results, NodeError> {
    let plans = plan_backends(&o.backends, kvm_kind)?;
    check_prerequisites(o)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(io("start the async runtime"))?;
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let mut extra = Vec::new();
    let mut budget_note = None;
    if let Some(ratio) = cpu_overcommit_for(o.burst, cores) {
        extra = vec!["--overcommit-cpu".to_string(), ratio.to_string()];
        budget_note = Some(format!(
            "the default vCPU budget ({cores} cores x {DEFAULT_OVERCOMMIT_CPU} = {} vCPUs) \
             admits fewer than {} 1-vCPU sandboxes at once (the rest get RESOURCE_EXHAUSTED): \
             the daemon ran with --overcommit-cpu {ratio}, its only non-default setting \
             besides the state dir, cgroup name and metrics",
            cores as f64 * DEFAULT_OVERCOMMIT_CPU,
            o.burst
        ));
    }
    let mut edge = Edge::start(&o.edge, &o.workdir, &extra)?;
    let edge_cmd = edge.command.clone();
    let result = runtime.block_on(async {
        let client = edge.connect(o.timeout).await?;
        let mut create = skeleton_create(o, &plans, &edge_cmd);
        let mut burst = skeleton_burst(o, &plans);
        let mut exec = skeleton_exec(o, &plans);
        for b in plans.iter().filter(|b| b.skipped.is_some()) {
            let why = format!("{} skipped: {}", b.name, b.skipped.as_deref().unwrap_or(""));
            for sc in [&mut create, &mut burst, &mut exec] {
                sc.notes.push(why.clone());
            }
        }
        for (name, found, package) in [
            ("unshare", o.unshare.is_some(), "util-linux"),
            ("bwrap", o.bwrap.is_some(), "bubblewrap"),
        ] {
            if !found {
                create.notes.push(format!(
                    "baseline {name} not run: not found on PATH (apt-get install {package})"
                ));
            }
        }
        eprintln!(
            "dsec-perf: node: create -> first exec, {} samples",
            o.samples
        );
        bench_create(&client, o, &plans, &mut create).await;
        for b in plans.iter().filter(|b| b.skipped.is_none()) {
            for round in 0..o.burst_rounds {
                eprintln!(
                    "dsec-perf: node: burst of {} {} creates, round {}",
                    o.burst, b.name, round
                );
                let s = burst_round(&client, &edge, o, b, round).await;
                burst.samples.extend(s);
            }
        }
        eprintln!(
            "dsec-perf: node: exec round trip, {} samples",
            o.exec_samples
        );
        bench_exec(&client, o, &plans, &mut exec).await;
        let left = edge.wait_clean(Duration::from_secs(5)).await;
        if !left.is_empty() {
            exec.notes.push(format!(
                "LEAK: left on the host after the last delete: {}",
                left.join(", ")
            ));
        }
        if let Some(n) = &budget_note {
            burst.notes.push(n.clone());
        }
        add_goal_notes(&mut burst, &mut exec, &plans);
        Ok::<_, NodeError>((create, burst, exec))
    });
    drop(edge);
    let (create, burst, exec) = result?;
    let backends: serde_json::Map<String, Value> = plans
        .iter()
        .map(|b| {
            (
                b.name.to_string(),
                json!({"ran": b.skipped.is_none(), "skipped": b.skipped}),
            )
        })
        .collect();
    Ok(Results {
        create,
        burst,
        exec,
        backends: Value::Object(backends),
        edge_command: edge_cmd,
    })
}

fn skeleton_burst(o: &NodeOpts, plans: &[BackendPlan]) -> Scenario {
    Scenario {
        name: "node_burst",
        title: format!("node: bursts of {} concurrent creates", o.burst),
        method: format!(
            "{} round(s) per backend: {} Create calls sent at once over one connection; \
             creations/s = sandboxes created / (first create sent -> last sandbox ready); then \
             every sandbox runs `sh -c 'echo sandbox-I; hostname'` (output checked), all are \
             deleted at once, and the node must have no sandbox, process, directory, mount \
             or cgroup of them left within 5 s",
            o.burst_rounds, o.burst
        ),
        metrics: vec![
            metric("creates_per_s", "creations per second", "1/s"),
            metric("burst_create_ms", "create latency in the burst", "ms"),
            detail("burst_span_ms", "first sent -> last ready", "ms"),
            detail("burst_exec_all_ms", "all checked commands done", "ms"),
            detail("burst_delete_all_ms", "all deletes done", "ms"),
            detail("burst_created", "sandboxes created", "count"),
            detail("burst_checked", "outputs checked ok", "count"),
            detail("leftovers", "left on the host after deletes", "count"),
            detail(
                "cpu_ms_per_sandbox",
                "node CPU per sandbox, create..delete",
                "ms",
            ),
        ],
        contenders: plans
            .iter()
            .filter(|b| b.skipped.is_none())
            .map(|b| {
                contender(
                    b.name,
                    &format!("{} sandboxes", b.name),
                    format!(
                        "{} x Create(backend={}, memory_mib={}, disk_mib={}) concurrently",
                        o.burst, b.name, o.memory_mib, o.disk_mib
                    ),
                )
            })
            .collect(),
        comparisons: Vec::new(),
        samples: Vec::new(),
        skipped: None,
        notes: Vec::new(),
    }
}

fn skeleton_exec(o: &NodeOpts, plans: &[BackendPlan]) -> Scenario {
    Scenario {
        name: "node_exec",
        title: "node: exec round trip of `true` in a warm sandbox".into(),
        method: format!(
            "one sandbox per backend, {} warm-up execs, then {} Exec([\"true\"]) calls one \
             after the other (backends alternating), timed from the call to the exit status",
            o.warmup.max(1) * 5,
            o.exec_samples
        ),
        metrics: vec![metric("exec_ms", "exec `true` round trip", "ms")],
        contenders: plans
            .iter()
            .filter(|b| b.skipped.is_none())
            .map(|b| {
                contender(
                    b.name,
                    &format!("warm {} sandbox", b.name),
                    "Exec([\"true\"])".into(),
                )
            })
            .collect(),
        comparisons: Vec::new(),
        samples: Vec::new(),
        skipped: None,
        notes: Vec::new(),
    }
}

fn add_goal_notes(burst: &mut Scenario, exec: &mut Scenario, plans: &[BackendPlan]) {
    if plans
        .iter()
        .any(|b| b.name == "container" && b.skipped.is_none())
    {
        let rate = burst.summary("container", "creates_per_s").map(|s| s.p50);
        burst.notes.push(goal(
            "container creations/s (p50 of rounds)",
            rate,
            Bound::AtLeast,
            GOAL_CREATES_PER_S,
            "1/s",
        ));
        let p50 = exec.summary("container", "exec_ms").map(|s| s.p50);
        exec.notes.push(goal_line(
            "container exec round trip p50",
            p50,
            GOAL_EXEC_P50_MS,
            "ms",
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn microvm_is_skipped_with_a_reason_on_pvm() {
        let want = vec!["container".to_string(), "microvm".to_string()];
        let p = plan_backends(&want, "pvm").unwrap();
        assert_eq!(p.len(), 2);
        assert!(p[0].skipped.is_none());
        assert!(p[1].skipped.as_deref().unwrap().contains("PVM"));
        let p = plan_backends(&want, "hardware").unwrap();
        assert!(p.iter().all(|b| b.skipped.is_none()));
        let p = plan_backends(&want, "none").unwrap();
        assert!(p[1].skipped.as_deref().unwrap().contains("kvm_kind=none"));
    }

    #[test]
    fn cpu_budget_is_raised_only_when_the_default_is_short() {
        assert_eq!(cpu_overcommit_for(128, 2), None);
        assert_eq!(cpu_overcommit_for(200, 2), Some(100.0));
        assert_eq!(cpu_overcommit_for(201, 2), Some(101.0));
        assert_eq!(cpu_overcommit_for(200, 4), None);
        assert_eq!(cpu_overcommit_for(10, 0), None);
    }

    #[test]
    fn cpu_time_from_proc_stat() {
        let stat = "42 (tokio (rt) x) S 1 42 42 0 -1 4194560 100 0 0 0 150 50 7 3 20 0 4";
        assert_eq!(cpu_ms_of_stat(stat, 100.0), Some(2100.0));
        assert_eq!(cpu_ms_of_stat("42 (x) S 1", 100.0), None);
        assert_eq!(cpu_ms_of_stat(stat, 0.0), None);
        let me = std::fs::read_to_string("/proc/self/stat").unwrap();
        assert!(cpu_ms_of_stat(&me, 100.0).unwrap() >= 0.0);
    }

    #[test]
    fn unknown_backend_is_an_error() {
        let e = plan_backends(&["docker".to_string()], "pvm").err().unwrap();
        assert!(e.to_string().contains("expected container or microvm"));
    }

    #[test]
    fn cgroup_walk_finds_sandbox_dirs() {
        let d = std::env::temp_dir().join(format!("dsec-perf-cg-{}", std::process::id()));
        let tag = "dsec-perf-test";
        std::fs::create_dir_all(d.join("memory/a").join(tag).join("sb1")).unwrap();
        std::fs::create_dir_all(d.join("pids").join(tag).join("sb1")).unwrap();
        std::fs::create_dir_all(d.join("cpu/other")).unwrap();
        assert_eq!(cgroup_dirs_named(&d, tag).len(), 2);
        let mut sbs = sandbox_cgroups(&d, tag);
        sbs.sort();
        assert_eq!(sbs.len(), 2);
        assert!(sbs.iter().all(|p| p.ends_with("sb1")));
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn procs_referencing_finds_a_child_by_its_argument() {
        let marker = std::env::temp_dir().join(format!("dsec-perf-marker-{}", std::process::id()));
        // `$0` of the shell is the marker; the builtin `read` waits on the pipe without
        // forking, so the shell is the only process carrying it.
        let mut child = Command::new("sh")
            .arg("-c")
            .arg("read x")
            .arg(&marker)
            .stdin(Stdio::piped())
            .spawn()
            .unwrap();
        let pid = child.id() as libc::pid_t;
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut found = procs_referencing(&marker);
        while !found.contains(&pid) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
            found = procs_referencing(&marker);
        }
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(found, vec![pid]);
        assert!(procs_referencing(&marker).is_empty());
    }

    #[test]
    fn preconditions_name_what_is_missing() {
        let o = NodeOpts {
            edge: PathBuf::from("/nonexistent/dsec-edge"),
            rootfs: PathBuf::from("/nonexistent/rootfs"),
            bwrap: None,
            unshare: None,
            backends: vec!["container".into()],
            samples: 1,
            warmup: 0,
            burst: 1,
            burst_rounds: 1,
            exec_samples: 1,
            memory_mib: 64,
            disk_mib: 64,
            timeout: Duration::from_secs(1),
            workdir: std::env::temp_dir(),
        };
        // SAFETY: geteuid cannot fail.
        if unsafe { libc::geteuid() } == 0 {
            let e = check_prerequisites(&o).unwrap_err().to_string();
            assert!(e.contains("--edge"), "{e}");
            let o2 = NodeOpts {
                edge: std::env::current_exe().unwrap(),
                ..o
            };
            let e = check_prerequisites(&o2).unwrap_err().to_string();
            assert!(e.contains("--rootfs"), "{e}");
        } else {
            assert!(matches!(check_prerequisites(&o), Err(NodeError::NotRoot)));
        }
    }
}
