//! `dsec-perf snapshot`: restore latency (MAP_PRIVATE, lazy, lazy + prefetch) against a cold
//! boot, fork latency for batches of children, and the host memory of idle forked children
//! against independently booted VMs. All with the guest from `guest.rs`: it touches
//! `touch_mib` MiB, is snapshotted, and after a restore reads that memory back (PASS) and
//! halts.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use dsec_vmm_api::control::RestoreRequest;
use dsec_vmm_api::{
    ControlClient, LaunchMode, LazyLaunch, PrewarmLaunch, RestoreLaunch, SerialOutput, VmConfig,
    VmmLaunch, VsockConfig,
};

use crate::direct::{ms, shell_words};
use crate::fleet::{self, Fleet, Ready};
use crate::guest;
use crate::report::{detail, goal_line, metric, Contender, Metric, Sample, Scenario};
use crate::run::{self, RunSpec};

#[derive(Debug, Clone)]
pub struct SnapOpts {
    pub vmm: PathBuf,
    /// Restore samples per contender.
    pub samples: usize,
    pub warmup: usize,
    /// Rounds of (fork batches, cold fleet).
    pub fleet_samples: usize,
    /// Fork batch sizes.
    pub children: Vec<usize>,
    /// VMs in the memory comparison (forked children vs cold boots).
    pub memory_vms: usize,
    pub mem_mib: u32,
    pub touch_mib: u32,
    /// `--record-working-set` window of the recording run.
    pub record_ms: u64,
    pub timeout: Duration,
    /// Pause between "all ready" and the memory reading / the stop.
    pub settle: Duration,
    pub workdir: PathBuf,
}

const GIVE_UP_AFTER: usize = 3;

/// The control socket of the VM in `dir`.
fn control(dir: &Path) -> ControlClient {
    ControlClient::new(dir.join("api.sock"))
}

/// A boot of the benchmark guest with `mem_mib` MiB.
fn cold_boot(guest: &Path, mem_mib: u32, serial: SerialOutput) -> VmmLaunch {
    let mut config = VmConfig::new(guest);
    config.mem_mib = u64::from(mem_mib);
    config.serial = serial;
    VmmLaunch::boot(config)
}

/// A restore of `snap` with its console at `serial`.
fn restore_of(snap: &Path, lazy: Option<LazyLaunch>, serial: SerialOutput) -> VmmLaunch {
    let mut restore = RestoreLaunch::new(snap);
    restore.lazy = lazy;
    restore.overrides.serial = Some(serial);
    VmmLaunch::restore(restore)
}

/// Places a VM's vsock socket (guest CID `cid`), control socket and metrics in `dir`.
fn in_dir(mut launch: VmmLaunch, dir: &Path, cid: u64) -> VmmLaunch {
    let uds_path = dir.join("vsock.sock");
    match &mut launch.mode {
        LaunchMode::Boot(config) => {
            config.vsock = Some(VsockConfig {
                uds_path,
                guest_cid: cid,
            })
        }
        _ => {
            if let Some(o) = launch.snapshot_overrides_mut() {
                o.vsock_uds = Some(uds_path);
                o.vsock_cid = Some(cid);
            }
        }
    }
    launch.api_sock = Some(dir.join("api.sock"));
    launch.metrics_json = Some(dir.join("metrics.json"));
    launch
}

/// Bytes of data (not holes) in a file.
fn allocated_bytes(path: &Path) -> u64 {
    std::fs::metadata(path)
        .map(|m| m.blocks() * 512)
        .unwrap_or(0)
}

struct Prepared {
    guest: PathBuf,
    snap: PathBuf,
    working_set_pages: Option<usize>,
    snapshot_data_mib: f64,
}

/// Boots the guest, waits for READY, snapshots it, records a working set.
fn prepare(o: &SnapOpts) -> Result<Prepared, String> {
    let guest = o.workdir.join("touch-guest.elf");
    std::fs::write(&guest, guest::touch_guest_elf(o.touch_mib)).map_err(|e| e.to_string())?;
    let base = o.workdir.join("base");
    std::fs::create_dir_all(&base).map_err(|e| e.to_string())?;
    let serial = base.join("serial.log");
    let api = base.join("api.sock");
    let launch = cold_boot(&guest, o.mem_mib, SerialOutput::File(serial.clone()));
    let launch = in_dir(launch, &base, u64::from(guest::BASE_CID));
    let mut f = Fleet::default();
    f.spawn(
        "base".into(),
        &o.vmm,
        &launch.to_args(),
        base.join("metrics.json"),
        base.join("stderr"),
        Ready::LineIn(serial.clone(), guest::READY_LINE.into()),
    )
    .map_err(|e| format!("spawn {}: {e}", o.vmm.display()))?;
    let not_ready = f.wait_ready(o.timeout);
    if !not_ready.is_empty() || !wait_for(&api, Duration::from_secs(5)) {
        f.terminate(Duration::from_secs(2));
        return Err(format!(
            "base VM never got ready ({not_ready:?}); stderr: {:?}",
            run::read_tail(&base.join("stderr"), 400)
        ));
    }
    let snap = o.workdir.join("snap");
    control(&base)
        .snapshot(&snap, false)
        .map_err(|e| e.to_string())?;
    f.terminate(Duration::from_secs(10));
    drop(f);

    // One lazy restore that records the working set, for --prefetch.
    let rec = o.workdir.join("record");
    std::fs::create_dir_all(&rec).map_err(|e| e.to_string())?;
    let mut record = RestoreLaunch::new(&snap);
    record.lazy = Some(LazyLaunch {
        prefetch: false,
        record_working_set_ms: Some(o.record_ms),
    });
    let launch = in_dir(VmmLaunch::restore(record), &rec, 4);
    let mut f = Fleet::default();
    f.spawn(
        "record".into(),
        &o.vmm,
        &launch.to_args(),
        rec.join("metrics.json"),
        rec.join("stderr"),
        Ready::Path(rec.join("api.sock")),
    )
    .map_err(|e| e.to_string())?;
    let ws = snap.join("working-set");
    let recorded = f.wait_ready(o.timeout).is_empty()
        && wait_for(
            &ws,
            Duration::from_millis(o.record_ms) + Duration::from_secs(10),
        );
    f.terminate(Duration::from_secs(10));
    let working_set_pages = recorded
        .then(|| std::fs::read(&ws).ok())
        .flatten()
        .and_then(|b| serde_json::from_slice::<Vec<u64>>(&b).ok())
        .map(|v| v.len());
    Ok(Prepared {
        guest,
        snapshot_data_mib: allocated_bytes(&snap.join("memory")) as f64 / (1 << 20) as f64,
        snap,
        working_set_pages,
    })
}

fn wait_for(path: &Path, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while !path.exists() {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    true
}

// ---------------------------------------------------------------- restore latency

struct RestorePlan {
    contender: Contender,
    args: Vec<OsString>,
    dir: PathBuf,
}

fn restore_plans(o: &SnapOpts, pr: &Prepared) -> Vec<RestorePlan> {
    let mk = |name: &str, desc: &str, lazy: Option<LazyLaunch>, cold: bool| {
        let dir = o.workdir.join(format!("restore-{name}"));
        let launch = if cold {
            cold_boot(&pr.guest, o.mem_mib, SerialOutput::Stdout)
        } else {
            restore_of(&pr.snap, lazy, SerialOutput::Stdout)
        };
        let args = in_dir(launch, &dir, 5).to_args();
        RestorePlan {
            contender: Contender {
                name: name.into(),
                description: desc.into(),
                command: shell_words(&o.vmm, &args),
            },
            args,
            dir,
        }
    };
    vec![
        mk(
            "private",
            "--restore (memory file mapped MAP_PRIVATE)",
            None,
            false,
        ),
        mk(
            "lazy",
            "--restore --lazy (userfaultfd, pages on first touch)",
            Some(LazyLaunch::default()),
            false,
        ),
        mk(
            "prefetch",
            "--restore --lazy --prefetch (recorded working set loaded in the background)",
            Some(LazyLaunch {
                prefetch: true,
                record_working_set_ms: None,
            }),
            false,
        ),
        mk(
            "cold",
            "cold boot of the same guest (--kernel): touches its memory, then reads it",
            None,
            true,
        ),
        prewarmed_plan(o, "prewarmed", false),
        prewarmed_plan(o, "prewarmed-lazy", true),
    ]
}

/// A VMM started with --prewarm (VM, memory slots and vCPUs created ahead), then asked to
/// restore; timed from the request.
fn prewarmed_plan(o: &SnapOpts, name: &str, lazy: bool) -> RestorePlan {
    let dir = o.workdir.join(format!("restore-{name}"));
    let mut launch = VmmLaunch::new(LaunchMode::Prewarm(PrewarmLaunch {
        mem_mib: u64::from(o.mem_mib),
        vcpus: 1,
        overrides: Default::default(),
    }));
    launch.api_sock = Some(dir.join("api.sock"));
    launch.metrics_json = Some(dir.join("metrics.json"));
    let args = launch.to_args();
    RestorePlan {
        contender: Contender {
            name: name.into(),
            description: format!(
                "--prewarm, then {{\"op\":\"restore\"{}}}: KVM setup paid before the request",
                if lazy { ",\"lazy\":true" } else { "" }
            ),
            command: shell_words(&o.vmm, &args),
        },
        args,
        dir,
    }
}

/// One prewarmed restore: spawn, wait until the shell is ready (its socket appears only
/// then), send the restore, and time request -> first KVM_RUN from the VMM's metrics.
fn one_prewarmed(plan: &RestorePlan, o: &SnapOpts, pr: &Prepared, index: usize) -> Sample {
    let _ = std::fs::remove_dir_all(&plan.dir);
    let mut values = BTreeMap::new();
    let mut error = None;
    let run = || -> Result<f64, String> {
        std::fs::create_dir_all(&plan.dir).map_err(|e| e.to_string())?;
        let mut child = std::process::Command::new(&o.vmm)
            .args(&plan.args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot run {}: {e}", o.vmm.display()))?;
        let api = plan.dir.join("api.sock");
        let outcome = (|| {
            if !wait_for(&api, o.timeout) {
                return Err("prewarmed VMM never opened its socket".to_string());
            }
            let requested = run::realtime_ns();
            let lazy = plan.contender.name.ends_with("lazy");
            control(&plan.dir)
                .restore(RestoreRequest {
                    path: pr.snap.clone(),
                    lazy,
                    vsock_uds: Some(plan.dir.join("vsock.sock")),
                    ..Default::default()
                })
                .map_err(|e| e.to_string())?;
            std::thread::sleep(Duration::from_millis(50));
            // The guest may already have stopped the VM; a refused stop is fine then.
            let _ = control(&plan.dir).stop();
            Ok(requested)
        })();
        // Let it exit on its own (it writes its metrics on the way out), then make sure.
        let deadline = Instant::now() + Duration::from_secs(5);
        while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = child.kill();
        let _ = child.wait();
        let requested = outcome?;
        let metrics = std::fs::read_to_string(plan.dir.join("metrics.json"))
            .map_err(|e| format!("no metrics JSON: {e}"))?;
        let m: serde_json::Value = serde_json::from_str(&metrics).map_err(|e| e.to_string())?;
        let first_run = m["first_kvm_run_ns"].as_u64().unwrap_or(0);
        crate::direct::ns_after(first_run, requested)
            .ok_or_else(|| format!("metrics lack a first KVM_RUN after the request: {metrics}"))
    };
    match run() {
        Ok(v) => {
            values.insert("request_to_first_kvm_run_ms", v);
        }
        Err(e) => error = Some(e),
    }
    Sample {
        contender: plan.contender.name.clone(),
        index,
        values,
        error,
    }
}

fn restore_metrics() -> Vec<Metric> {
    vec![
        detail("spawn_to_vmm_main_ms", "spawn -> VMM main()", "ms"),
        detail("main_to_vm_ready_ms", "VMM main() -> state loaded", "ms"),
        metric(
            "spawn_to_vm_ready_ms",
            "spawn -> state loaded (vm_ready)",
            "ms",
        ),
        metric(
            "vm_ready_to_first_kvm_run_ms",
            "state loaded -> first KVM_RUN",
            "ms",
        ),
        metric("spawn_to_first_kvm_run_ms", "spawn -> first KVM_RUN", "ms"),
        metric(
            "request_to_first_kvm_run_ms",
            "asked for a VM -> first KVM_RUN (spawn, or a prewarmed VMM's restore request)",
            "ms",
        ),
        detail(
            "spawn_to_guest_ready_ms",
            "spawn -> guest READY (cold: touched)",
            "ms",
        ),
        metric(
            "spawn_to_guest_pass_ms",
            "spawn -> guest read memory (PASS)",
            "ms",
        ),
    ]
}

fn one_restore(plan: &RestorePlan, o: &SnapOpts, index: usize) -> Sample {
    let _ = std::fs::remove_dir_all(&plan.dir);
    let mut values = BTreeMap::new();
    let mut errors = Vec::new();
    if let Err(e) = std::fs::create_dir_all(&plan.dir) {
        errors.push(e.to_string());
    }
    let spec = RunSpec {
        program: o.vmm.clone(),
        args: plan.args.clone(),
        stderr_path: plan.dir.join("stderr"),
        timeout: o.timeout,
        marker: Some(guest::PASS_LINE.to_string()),
        kill_after_marker: true,
        ready_path: None,
        stop_signal: libc::SIGTERM,
        stop_delay: Duration::ZERO,
        die_with_parent: true,
    };
    match run::run(&spec) {
        Err(e) => errors.push(format!("cannot run {}: {e}", o.vmm.display())),
        Ok(r) => {
            match r.marker {
                Some(d) => {
                    values.insert("spawn_to_guest_pass_ms", ms(d));
                }
                None => errors.push(format!("no {} line", guest::PASS_LINE)),
            }
            if let Some((d, _)) = r.timeline.iter().find(|(_, l)| l == guest::READY_LINE) {
                values.insert("spawn_to_guest_ready_ms", ms(*d));
            }
            if r.timed_out {
                errors.push(format!("timed out after {:?}", o.timeout));
            }
            let code = r.status.and_then(|s| s.code());
            if code != Some(0) && !r.timed_out {
                errors.push(format!("exit status {code:?} after SIGTERM, want 0"));
            }
            match std::fs::read_to_string(plan.dir.join("metrics.json"))
                .map_err(|e| format!("no metrics JSON: {e}"))
                .and_then(|s| fleet::vmm_milestones(&s, r.spawn_realtime_ns))
            {
                Ok(m) => {
                    if let Some(&v) = m.get("spawn_to_first_kvm_run_ms") {
                        // For a process started on demand, asking for a VM is the spawn.
                        values.insert("request_to_first_kvm_run_ms", v);
                    }
                    values.extend(m)
                }
                Err(e) => errors.push(e),
            }
            if !errors.is_empty() {
                errors.push(format!(
                    "console tail {:?}; stderr tail {:?}",
                    r.output_tail(120),
                    run::read_tail(&spec.stderr_path, 300)
                ));
            }
        }
    }
    Sample {
        contender: plan.contender.name.clone(),
        index,
        values,
        error: (!errors.is_empty()).then(|| errors.join("; ")),
    }
}

fn kvm_scenario(o: &SnapOpts) -> Scenario {
    let labels = [
        "KVM_CREATE_VM",
        "KVM_CREATE_IRQCHIP",
        "KVM_CREATE_PIT2",
        "KVM_SET_USER_MEMORY_REGION",
        "KVM_CREATE_VCPU",
        "all five",
    ];
    Scenario {
        name: "kvm",
        title: format!(
            "KVM floor: the ioctls every VM needs, timed inside the harness ({} MiB slot, \
             one sample per restore round)",
            o.mem_mib
        ),
        method: "CLOCK_MONOTONIC around each ioctl; no fork/exec, no snapshot: what a \
                 pre-created VM would take off a restore's critical path"
            .into(),
        metrics: crate::kvmfloor::STEPS
            .iter()
            .zip(labels)
            .map(|(k, l)| detail(k, l, "ms"))
            .collect(),
        contenders: vec![Contender {
            name: "kvm".into(),
            description: "in-process ioctls".into(),
            command: String::new(),
        }],
        comparisons: Vec::new(),
        samples: Vec::new(),
        skipped: None,
        notes: Vec::new(),
    }
}

fn run_plan(plan: &RestorePlan, o: &SnapOpts, pr: &Prepared, index: usize) -> Sample {
    if plan.contender.name.starts_with("prewarmed") {
        one_prewarmed(plan, o, pr, index)
    } else {
        one_restore(plan, o, index)
    }
}

fn restore_bench(o: &SnapOpts, pr: &Prepared, kvm: &mut Scenario) -> Scenario {
    let plans = restore_plans(o, pr);
    let mut notes = vec![
        format!(
            "PASS: the guest has read one word of each of its {} MiB of touched pages (a \
             restore's first work; a cold boot touches them first, then reads); every run is \
             stopped with SIGTERM at PASS",
            o.touch_mib
        ),
        format!(
            "the snapshot's memory file holds {:.1} MiB of data in a {} MiB guest",
            pr.snapshot_data_mib, o.mem_mib
        ),
    ];
    notes.push(match pr.working_set_pages {
        Some(n) => format!(
            "recorded working set ({} ms window of one lazy restore): {n} pages",
            o.record_ms
        ),
        None => "no working set was recorded: 'prefetch' runs without one".into(),
    });
    let mut sc = Scenario {
        name: "restore",
        title: format!(
            "restore latency: {} MiB guest, {} MiB touched ({} samples per contender, alternating)",
            o.mem_mib, o.touch_mib, o.samples
        ),
        method: "harness CLOCK_REALTIME just before spawn; VMM milestones from dsec-vmm \
                 --metrics-json (process_start_ns, vm_ready_ns, first_kvm_run_ns)"
            .into(),
        metrics: restore_metrics(),
        contenders: plans.iter().map(|p| p.contender.clone()).collect(),
        comparisons: ["private", "lazy", "prefetch", "prewarmed", "prewarmed-lazy"]
            .iter()
            .map(|c| (c.to_string(), "cold".to_string()))
            .chain([("lazy".to_string(), "private".to_string())])
            .chain([("prewarmed".to_string(), "private".to_string())])
            .collect(),
        samples: Vec::new(),
        skipped: None,
        notes,
    };
    for round in 0..o.warmup {
        for plan in &plans {
            let s = run_plan(plan, o, pr, round);
            if let Some(e) = &s.error {
                eprintln!("dsec-perf: warm-up {} FAILED: {e}", plan.contender.name);
            }
        }
    }
    let mut fails = vec![0usize; plans.len()];
    for i in 0..o.samples {
        // Rotate who goes first, so no contender always follows the same one.
        for k in (0..plans.len()).map(|j| (i + j) % plans.len()) {
            let plan = &plans[k];
            if fails[k] >= GIVE_UP_AFTER {
                continue;
            }
            let s = run_plan(plan, o, pr, i);
            fails[k] = if s.error.is_some() { fails[k] + 1 } else { 0 };
            sc.samples.push(s);
        }
        let (values, error) = match crate::kvmfloor::measure(u64::from(o.mem_mib)) {
            Ok(v) => (v, None),
            Err(e) => (BTreeMap::new(), Some(e)),
        };
        kvm.samples.push(Sample {
            contender: "kvm".into(),
            index: i,
            values,
            error,
        });
        if (i + 1) % 10 == 0 || i + 1 == o.samples {
            eprintln!("dsec-perf: restore: {}/{} rounds", i + 1, o.samples);
        }
    }
    sc
}

// ---------------------------------------------------------------- fork and memory

fn fork_metrics() -> Vec<Metric> {
    vec![
        metric("spawn_to_vm_ready_ms", "child: spawn -> state loaded", "ms"),
        metric(
            "spawn_to_first_kvm_run_ms",
            "child: spawn -> first KVM_RUN",
            "ms",
        ),
        metric("batch_wall_ms", "batch: spawn -> last KVM_RUN", "ms"),
        metric("wall_per_child_ms", "batch wall time / N", "ms"),
    ]
}

fn memory_metrics() -> Vec<Metric> {
    vec![
        metric("pss_total_mib", "sum of PSS", "MiB"),
        detail("pss_per_vm_mib", "PSS per VM", "MiB"),
        detail("pss_anon_total_mib", "sum of PSS, anonymous", "MiB"),
        detail("pss_file_total_mib", "sum of PSS, file-backed", "MiB"),
        detail("rss_total_mib", "sum of RSS", "MiB"),
        metric(
            "pss_plus_snapshot_file_mib",
            "sum of PSS + whole snapshot file",
            "MiB",
        ),
        detail(
            "host_mem_available_drop_mib",
            "host MemAvailable drop (noisy)",
            "MiB",
        ),
    ]
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

fn memory_values(m: &fleet::Mem, n: usize) -> BTreeMap<&'static str, f64> {
    [
        ("pss_total_mib", mib(m.pss_kib)),
        ("pss_per_vm_mib", mib(m.pss_kib) / n.max(1) as f64),
        ("pss_anon_total_mib", mib(m.pss_anon_kib)),
        ("pss_file_total_mib", mib(m.pss_file_kib)),
        ("rss_total_mib", mib(m.rss_kib)),
    ]
    .into_iter()
    .collect()
}

fn insert_avail_drop(values: &mut BTreeMap<&'static str, f64>, before: Option<u64>) {
    if let (Some(b), Some(a)) = (before, fleet::mem_available_kib()) {
        values.insert(
            "host_mem_available_drop_mib",
            (b as f64 - a as f64) / 1024.0,
        );
    }
}

/// Batch wall time: first spawn to the last child's first KVM_RUN, in ms.
pub fn batch_wall_ms(spawns_ns: &[u64], first_runs_ns: &[u64]) -> Option<f64> {
    let start = *spawns_ns.iter().min()?;
    let end = *first_runs_ns.iter().max()?;
    (end >= start && first_runs_ns.iter().all(|&t| t != 0)).then(|| (end - start) as f64 / 1e6)
}

/// One fork batch of `n`; returns the per-child samples, the batch sample and, when
/// `memory_as` names a contender, the memory sample of the children once ready. With
/// `read_back` the children read their memory back (PASS) before they count as ready,
/// else they get CIDs from `guest::IDLE_CID_MIN` and halt at once.
fn fork_batch(
    o: &SnapOpts,
    pr: &Prepared,
    n: usize,
    round: usize,
    read_back: bool,
    memory_as: Option<&str>,
) -> (Vec<Sample>, Option<Sample>) {
    let name = format!("fork-{n}");
    let dir = o.workdir.join(format!("{name}-{read_back}"));
    let _ = std::fs::remove_dir_all(&dir);
    let mut samples = Vec::new();
    let mut batch_err = Vec::new();
    let mut mem_sample = None;
    let avail_before = fleet::mem_available_kib();
    let mut f = Fleet::default();
    for i in 0..n {
        let cdir = dir.join(format!("c{i}"));
        if let Err(e) = std::fs::create_dir_all(&cdir) {
            batch_err.push(e.to_string());
            break;
        }
        let serial = cdir.join("serial.log");
        let launch = restore_of(&pr.snap, None, SerialOutput::File(serial.clone()));
        let (cid, ready) = if read_back {
            (
                100 + i as u64,
                Ready::LineIn(serial, guest::PASS_LINE.into()),
            )
        } else {
            (
                u64::from(guest::IDLE_CID_MIN) + i as u64,
                Ready::Path(cdir.join("api.sock")),
            )
        };
        let args = in_dir(launch, &cdir, cid).to_args();
        if let Err(e) = f.spawn(
            format!("c{i}"),
            &o.vmm,
            &args,
            cdir.join("metrics.json"),
            cdir.join("stderr"),
            ready,
        ) {
            batch_err.push(format!("spawn child {i}: {e}"));
            break;
        }
    }
    let not_ready = f.wait_ready(o.timeout);
    if !not_ready.is_empty() {
        batch_err.push(format!(
            "{} children not ready, e.g. {:?}",
            not_ready.len(),
            not_ready[0]
        ));
    }
    std::thread::sleep(o.settle);
    if let Some(contender) = memory_as {
        let m = fleet::total_mem(&f.pids());
        let (mut values, mut error) = (BTreeMap::new(), None);
        match m {
            Ok(m) => {
                values = memory_values(&m, n);
                values.insert(
                    "pss_plus_snapshot_file_mib",
                    mib(m.pss_kib) + pr.snapshot_data_mib,
                );
                insert_avail_drop(&mut values, avail_before);
            }
            Err(e) => error = Some(e),
        }
        if !batch_err.is_empty() {
            error = Some(batch_err.join("; "));
        }
        mem_sample = Some(Sample {
            contender: contender.into(),
            index: round,
            values,
            error,
        });
    }
    f.terminate(Duration::from_secs(20));
    let (mut spawns, mut runs) = (Vec::new(), Vec::new());
    for (i, m) in f.members.iter().enumerate() {
        let code = m.status.and_then(|s| s.code());
        let parsed = std::fs::read_to_string(&m.metrics_path)
            .map_err(|e| format!("no metrics JSON: {e}"))
            .and_then(|s| {
                let v = fleet::vmm_milestones(&s, m.spawn_realtime_ns)?;
                let j: serde_json::Value = serde_json::from_str(&s).map_err(|e| e.to_string())?;
                Ok((v, j["first_kvm_run_ns"].as_u64().unwrap_or(0)))
            });
        let (values, error) = match (parsed, code) {
            (Ok((v, run_ns)), Some(0)) => {
                spawns.push(m.spawn_realtime_ns);
                runs.push(run_ns);
                (v, None)
            }
            (Ok((v, _)), c) => (v, Some(format!("exit status {c:?} after SIGTERM"))),
            (Err(e), _) => (
                BTreeMap::new(),
                Some(format!(
                    "{e}; stderr {:?}",
                    run::read_tail(&m.stderr_path, 200)
                )),
            ),
        };
        samples.push(Sample {
            contender: name.clone(),
            index: round * n + i,
            values,
            error,
        });
    }
    let mut values = BTreeMap::new();
    if spawns.len() == n {
        if let Some(w) = batch_wall_ms(&spawns, &runs) {
            values.insert("batch_wall_ms", w);
            values.insert("wall_per_child_ms", w / n as f64);
        }
    } else {
        batch_err.push(format!("{} of {n} children failed", n - spawns.len()));
    }
    samples.push(Sample {
        contender: name,
        index: round,
        values,
        error: (!batch_err.is_empty()).then(|| batch_err.join("; ")),
    });
    drop(f);
    let _ = std::fs::remove_dir_all(&dir);
    (samples, mem_sample)
}

/// `n` independent cold boots of the guest, measured once all printed READY.
fn cold_fleet(o: &SnapOpts, pr: &Prepared, n: usize, round: usize) -> Sample {
    let dir = o.workdir.join("cold-fleet");
    let _ = std::fs::remove_dir_all(&dir);
    let mut errors = Vec::new();
    let avail_before = fleet::mem_available_kib();
    let mut f = Fleet::default();
    for i in 0..n {
        let vdir = dir.join(format!("v{i}"));
        if let Err(e) = std::fs::create_dir_all(&vdir) {
            errors.push(e.to_string());
            break;
        }
        let serial = vdir.join("serial.log");
        let launch = cold_boot(&pr.guest, o.mem_mib, SerialOutput::File(serial.clone()));
        let args = in_dir(launch, &vdir, 100 + i as u64).to_args();
        if let Err(e) = f.spawn(
            format!("v{i}"),
            &o.vmm,
            &args,
            vdir.join("metrics.json"),
            vdir.join("stderr"),
            Ready::LineIn(serial, guest::PASS_LINE.into()),
        ) {
            errors.push(format!("spawn VM {i}: {e}"));
            break;
        }
    }
    let not_ready = f.wait_ready(o.timeout * 4);
    if !not_ready.is_empty() {
        errors.push(format!(
            "{} VMs not ready, e.g. {:?}",
            not_ready.len(),
            not_ready[0]
        ));
    }
    std::thread::sleep(o.settle);
    let mut values = BTreeMap::new();
    match fleet::total_mem(&f.pids()) {
        Ok(m) => {
            values = memory_values(&m, n);
            values.insert("pss_plus_snapshot_file_mib", mib(m.pss_kib));
            insert_avail_drop(&mut values, avail_before);
        }
        Err(e) => errors.push(e),
    }
    f.terminate(Duration::from_secs(20));
    drop(f);
    let _ = std::fs::remove_dir_all(&dir);
    Sample {
        contender: "cold".into(),
        index: round,
        values,
        error: (!errors.is_empty()).then(|| errors.join("; ")),
    }
}

fn fleet_bench(o: &SnapOpts, pr: &Prepared) -> (Scenario, Scenario) {
    let child_args = {
        let child = restore_of(
            &pr.snap,
            None,
            SerialOutput::File("DIR/cI/serial.log".into()),
        );
        shell_words(&o.vmm, &in_dir(child, Path::new("DIR/cI"), 1000).to_args())
    };
    let mut fork = Scenario {
        name: "fork",
        title: format!(
            "fork: batches of {:?} children from one snapshot ({} rounds, alternating)",
            o.children, o.fleet_samples
        ),
        method: "children spawned back to back, each with its own --vsock-uds/--vsock-cid \
                 and control socket; per child: its spawn stamp -> its first_kvm_run_ns; \
                 batch: first spawn -> last child's first KVM_RUN; n of child rows counts \
                 children, n of batch rows counts batches; the children get CIDs >= 1000, \
                 so the guest halts right after the restore (no guest work)"
            .into(),
        metrics: fork_metrics(),
        contenders: o
            .children
            .iter()
            .map(|n| Contender {
                name: format!("fork-{n}"),
                description: format!("{n} children"),
                command: child_args.clone(),
            })
            .collect(),
        comparisons: Vec::new(),
        samples: Vec::new(),
        skipped: None,
        notes: vec![
            "a spawn is fork+exec of the harness (which sets PR_SET_PDEATHSIG so no VMM \
             outlives it) and is included"
                .into(),
        ],
    };
    let n = o.memory_vms;
    let mut memory = Scenario {
        name: "memory",
        title: format!(
            "host memory: {n} forked children vs {n} cold-booted VMs that touched the same \
             {} MiB ({} rounds, alternating)",
            o.touch_mib, o.fleet_samples
        ),
        method: format!(
            "sum over the VMM processes of /proc/PID/smaps_rollup once all are ready (+{:?}); \
             forked = children restored MAP_PRIVATE from one snapshot; cold = --kernel boots \
             that touched the memory and read it back (PASS), then halted",
            o.settle
        ),
        metrics: memory_metrics(),
        contenders: vec![
            Contender {
                name: "forked-idle".into(),
                description: format!(
                    "{n} children of one snapshot, halted right after the restore (the \
                     fork-{n} batch)"
                ),
                command: child_args.clone(),
            },
            Contender {
                name: "forked-read".into(),
                description: format!(
                    "{n} children of one snapshot that read their {} MiB back (CIDs 100+)",
                    o.touch_mib
                ),
                command: child_args.replace("1000", "100"),
            },
            Contender {
                name: "cold".into(),
                description: format!("{n} independent boots"),
                command: shell_words(
                    &o.vmm,
                    &in_dir(
                        cold_boot(
                            &pr.guest,
                            o.mem_mib,
                            SerialOutput::File("DIR/vI/serial.log".into()),
                        ),
                        Path::new("DIR/vI"),
                        100,
                    )
                    .to_args(),
                ),
            },
        ],
        comparisons: vec![
            ("forked-idle".into(), "cold".into()),
            ("forked-read".into(), "cold".into()),
        ],
        samples: Vec::new(),
        skipped: None,
        notes: vec![
            format!(
                "the snapshot's memory file holds {:.1} MiB of data; its page cache is shared \
             by all children and appears in their PSS only for pages they map; \
             'sum of PSS + whole snapshot file' charges all of it to the children (upper bound)",
                pr.snapshot_data_mib
            ),
            "PSS misses kernel memory (KVM's per-VM and per-vCPU structures, page tables, the \
            PIT thread); 'host MemAvailable drop' (before spawning -> all ready) includes it, \
            but also everything else the machine does meanwhile"
                .into(),
        ],
    };
    for round in 0..o.fleet_samples {
        let mut measured = false;
        for &c in &o.children {
            let want_mem = c == n && !measured;
            let (s, m) = fork_batch(o, pr, c, round, false, want_mem.then_some("forked-idle"));
            let failed = s.iter().filter(|s| s.error.is_some()).count();
            eprintln!(
                "dsec-perf: fork-{c} round {round}: {}",
                if failed == 0 {
                    "ok".to_string()
                } else {
                    format!("{failed} failed")
                }
            );
            fork.samples.extend(s);
            if let Some(m) = m {
                measured = true;
                memory.samples.push(m);
            }
        }
        if !measured {
            let (_, m) = fork_batch(o, pr, n, round, false, Some("forked-idle"));
            memory.samples.extend(m);
        }
        let (_, m) = fork_batch(o, pr, n, round, true, Some("forked-read"));
        memory.samples.extend(m);
        memory.samples.push(cold_fleet(o, pr, n, round));
        eprintln!(
            "dsec-perf: fleet round {}/{} done",
            round + 1,
            o.fleet_samples
        );
    }
    (fork, memory)
}

pub struct Results {
    pub restore: Scenario,
    pub kvm: Scenario,
    pub fork: Scenario,
    pub memory: Scenario,
}

/// Appends the design goals, checked against the p50s, to the scenarios' notes.
fn add_goals(r: &mut Results, o: &SnapOpts) {
    let p50 = |sc: &Scenario, c: &str, m: &str| sc.summary(c, m).map(|s| s.p50);
    for c in ["private", "lazy", "prefetch", "prewarmed", "prewarmed-lazy"] {
        let v = p50(&r.restore, c, "request_to_first_kvm_run_ms");
        let line = goal_line(&format!("{c}: restore to first KVM_RUN p50"), v, 5.0, "ms");
        r.restore.notes.push(line);
    }
    for &n in &o.children {
        let c = format!("fork-{n}");
        let v = p50(&r.fork, &c, "wall_per_child_ms");
        let line = goal_line(
            &format!("{c}: batch wall time per child p50"),
            v,
            10.0,
            "ms",
        );
        r.fork.notes.push(line);
    }
    for c in ["forked-idle", "forked-read"] {
        let ratio = crate::stats::ratio(
            p50(&r.memory, c, "pss_total_mib"),
            p50(&r.memory, "cold", "pss_total_mib"),
        );
        let line = goal_line(&format!("{c}/cold sum of PSS p50"), ratio, 0.25, "x");
        r.memory.notes.push(line);
    }
}

pub fn bench(o: &SnapOpts) -> Results {
    let skip = |why: String| {
        let mk = |name: &'static str, title: &str| Scenario {
            name,
            title: title.into(),
            method: String::new(),
            metrics: Vec::new(),
            contenders: Vec::new(),
            comparisons: Vec::new(),
            samples: Vec::new(),
            skipped: Some(why.clone()),
            notes: Vec::new(),
        };
        Results {
            restore: mk("restore", "restore latency"),
            kvm: mk("kvm", "KVM floor"),
            fork: mk("fork", "fork latency"),
            memory: mk("memory", "host memory of forked children"),
        }
    };
    if !o.vmm.is_file() {
        return skip(format!("{} not found", o.vmm.display()));
    }
    if o.mem_mib < guest::min_mem_mib(o.touch_mib) || o.touch_mib == 0 {
        return skip(format!(
            "--touch-mib {} needs --mem-mib >= {} (and at least 1 MiB touched)",
            o.touch_mib,
            guest::min_mem_mib(o.touch_mib)
        ));
    }
    let pr = match prepare(o) {
        Ok(p) => p,
        Err(e) => return skip(format!("could not take the snapshot: {e}")),
    };
    let mut kvm = kvm_scenario(o);
    let restore = restore_bench(o, &pr, &mut kvm);
    let (fork, memory) = if o.fleet_samples == 0 {
        let s = skip("--fleet-samples 0".into());
        (s.fork, s.memory)
    } else {
        fleet_bench(o, &pr)
    };
    let mut r = Results {
        restore,
        kvm,
        fork,
        memory,
    };
    add_goals(&mut r, o);
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_wall_spans_first_spawn_to_last_run() {
        let w = batch_wall_ms(&[1_000_000, 2_000_000], &[5_000_000, 4_000_000]).unwrap();
        assert_eq!(w, 4.0);
        assert_eq!(batch_wall_ms(&[], &[]), None);
        assert_eq!(batch_wall_ms(&[1], &[0, 5]), None);
    }

    #[test]
    fn memory_values_per_vm() {
        let m = fleet::Mem {
            rss_kib: 4096,
            pss_kib: 2048,
            pss_anon_kib: 1024,
            pss_file_kib: 1024,
        };
        let v = memory_values(&m, 4);
        assert_eq!(v["pss_total_mib"], 2.0);
        assert_eq!(v["pss_per_vm_mib"], 0.5);
        assert_eq!(v["rss_total_mib"], 4.0);
    }

    #[test]
    fn restore_plans_have_the_flags() {
        let o = SnapOpts {
            vmm: "/x/dsec-vmm".into(),
            samples: 1,
            warmup: 0,
            fleet_samples: 0,
            children: vec![1],
            memory_vms: 1,
            mem_mib: 64,
            touch_mib: 32,
            record_ms: 100,
            timeout: Duration::from_secs(1),
            settle: Duration::ZERO,
            workdir: "/w".into(),
        };
        let pr = Prepared {
            guest: "/w/g.elf".into(),
            snap: "/w/snap".into(),
            working_set_pages: None,
            snapshot_data_mib: 0.0,
        };
        let plans = restore_plans(&o, &pr);
        let cmd: Vec<&str> = plans.iter().map(|p| p.contender.command.as_str()).collect();
        assert!(cmd[0].contains("--restore /w/snap") && !cmd[0].contains("--lazy"));
        assert!(cmd[1].contains("--lazy") && !cmd[1].contains("--prefetch"));
        assert!(cmd[2].contains("--lazy --prefetch"));
        assert!(cmd[3].contains("--kernel /w/g.elf") && cmd[3].contains("--mem-mib 64"));
        assert!(cmd
            .iter()
            .all(|c| c.contains("--metrics-json /w/restore-") && c.contains("--api-sock")));
    }
}
