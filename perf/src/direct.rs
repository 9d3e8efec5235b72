//! Scenario 1: a test guest booted directly on this host's /dev/kvm, our VMM beside QEMU.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::report::{Contender, Metric, Sample, Scenario};
use crate::run::{self, RunSpec};

/// QEMU microvm has no i8042: the test guests' reset (0xFE to port 0x64) would be ignored
/// and the guest would spin forever. An `isa-debug-exit` device on port 0x64 turns that
/// same write into a QEMU exit with status (0xFE << 1 | 1) & 0xFF = 253, which is what
/// our VMM's i8042 does (exit 0). No guest change, no polling.
pub const QEMU_RESET_EXIT_STATUS: i32 = 253;

#[derive(Debug, Clone)]
pub struct DirectOpts {
    pub vmm: PathBuf,
    pub qemu: PathBuf,
    pub guest: PathBuf,
    pub samples: usize,
    pub warmup: usize,
    pub accels: Vec<String>,
    pub timeout: Duration,
    /// Line the guest prints when its work is done (before the reset).
    pub done_marker: String,
    pub mem_mib: u32,
    pub workdir: PathBuf,
}

/// Consecutive failures after which a contender is dropped from the remaining samples.
const GIVE_UP_AFTER: usize = 3;

pub fn metrics() -> Vec<Metric> {
    vec![
        Metric {
            key: "spawn_to_vmm_main_ms",
            label: "spawn -> VMM main()",
            unit: "ms",
            compare: true,
        },
        Metric {
            key: "spawn_to_vm_ready_ms",
            label: "spawn -> VM built (vm_ready)",
            unit: "ms",
            compare: true,
        },
        Metric {
            key: "spawn_to_first_kvm_run_ms",
            label: "spawn -> first KVM_RUN",
            unit: "ms",
            compare: true,
        },
        Metric {
            key: "spawn_to_first_serial_byte_ms",
            label: "spawn -> first serial byte",
            unit: "ms",
            compare: true,
        },
        Metric {
            key: "spawn_to_guest_done_ms",
            label: "spawn -> guest done line",
            unit: "ms",
            compare: true,
        },
        Metric {
            key: "spawn_to_exit_ms",
            label: "spawn -> process exit",
            unit: "ms",
            compare: true,
        },
        Metric {
            key: "guest_done_to_exit_ms",
            label: "guest done -> process exit (teardown)",
            unit: "ms",
            compare: true,
        },
        Metric {
            key: "vm_exits",
            label: "VM exits per boot",
            unit: "exits",
            compare: true,
        },
    ]
}

enum Kind {
    Ours,
    Qemu,
}

struct Plan {
    contender: Contender,
    kind: Kind,
    args: Vec<OsString>,
    program: PathBuf,
}

fn os(v: &[&str]) -> Vec<OsString> {
    v.iter().map(OsString::from).collect()
}

pub fn shell_words(program: &Path, args: &[OsString]) -> String {
    std::iter::once(program.as_os_str())
        .chain(args.iter().map(|a| a.as_os_str()))
        .map(|a| {
            let s = a.to_string_lossy();
            if s.contains([' ', '"', '\'']) {
                format!("'{}'", s.replace('\'', "'\\''"))
            } else {
                s.into_owned()
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn plans(o: &DirectOpts) -> Vec<Plan> {
    let mem = o.mem_mib.to_string();
    let mut config = dsec_vmm_api::VmConfig::new(&o.guest);
    config.mem_mib = u64::from(o.mem_mib);
    config.vcpus = 1;
    config.serial = dsec_vmm_api::SerialOutput::Stdout;
    let mut ours = dsec_vmm_api::VmmLaunch::boot(config);
    ours.metrics_json = Some(o.workdir.join("vmm-metrics.json"));
    let ours_args = ours.to_args();
    let mut v = vec![Plan {
        contender: Contender {
            name: "ours".into(),
            description: "dsec-vmm (serial on stdout, i8042 reset -> exit 0)".into(),
            command: shell_words(&o.vmm, &ours_args),
        },
        kind: Kind::Ours,
        args: ours_args,
        program: o.vmm.clone(),
    }];
    for accel in &o.accels {
        let mut args = os(&[
            "-M",
            "microvm,x-option-roms=off,isa-serial=on,rtc=off",
            "-accel",
            accel,
            "-nodefaults",
            "-no-user-config",
            "-nographic",
            "-serial",
            "stdio",
            "-no-reboot",
            "-m",
            &mem,
            "-device",
            "isa-debug-exit,iobase=0x64,iosize=1",
            "-kernel",
        ]);
        args.push(o.guest.clone().into());
        v.push(Plan {
            contender: Contender {
                name: format!("qemu-{accel}"),
                description: format!(
                    "qemu-system-x86_64 -M microvm -accel {accel} (PVH via bios-microvm; \
                     isa-debug-exit on port 0x64 stands in for the i8042 reset)"
                ),
                command: shell_words(&o.qemu, &args),
            },
            kind: Kind::Qemu,
            args,
            program: o.qemu.clone(),
        });
    }
    v
}

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

pub fn ns_after(t: u64, spawn_ns: u64) -> Option<f64> {
    (t != 0 && t >= spawn_ns).then(|| (t - spawn_ns) as f64 / 1e6)
}

fn one(plan: &Plan, o: &DirectOpts, index: usize) -> Sample {
    let metrics_path = o.workdir.join("vmm-metrics.json");
    let _ = std::fs::remove_file(&metrics_path);
    let spec = RunSpec {
        program: plan.program.clone(),
        args: plan.args.clone(),
        stderr_path: o.workdir.join(format!("{}.stderr", plan.contender.name)),
        timeout: o.timeout,
        marker: Some(o.done_marker.clone()),
        kill_after_marker: false,
        ready_path: None,
        stop_signal: libc::SIGKILL,
        stop_delay: Duration::ZERO,
        die_with_parent: false,
    };
    let mut values = BTreeMap::new();
    let mut errors = Vec::new();
    let r = match run::run(&spec) {
        Ok(r) => r,
        Err(e) => {
            return Sample {
                contender: plan.contender.name.clone(),
                index,
                values,
                error: Some(format!("cannot run {}: {e}", plan.program.display())),
            }
        }
    };
    if let Some(d) = r.first_byte {
        values.insert("spawn_to_first_serial_byte_ms", ms(d));
    }
    if let Some(d) = r.marker {
        values.insert("spawn_to_guest_done_ms", ms(d));
    } else {
        errors.push(format!("no '{}' line on the console", o.done_marker));
    }
    if let Some(d) = r.exit {
        values.insert("spawn_to_exit_ms", ms(d));
        if let Some(done) = r.marker {
            values.insert("guest_done_to_exit_ms", ms(d.saturating_sub(done)));
        }
    }
    if r.timed_out {
        errors.push(format!("timed out after {:?}, killed", o.timeout));
    }
    let code = r.status.and_then(|s| s.code());
    match plan.kind {
        Kind::Ours => {
            if code != Some(0) && !r.timed_out {
                errors.push(format!("exit status {code:?}, want 0"));
            }
            match std::fs::read_to_string(&metrics_path)
                .ok()
                .and_then(|s| serde_json::from_str::<serde_json::Value>(&s).ok())
            {
                Some(m) => {
                    let get = |k: &str| m.get(k).and_then(|v| v.as_u64()).unwrap_or(0);
                    let spawn = r.spawn_realtime_ns;
                    if let Some(v) = ns_after(get("process_start_ns"), spawn) {
                        values.insert("spawn_to_vmm_main_ms", v);
                    }
                    if let Some(v) = ns_after(get("vm_ready_ns"), spawn) {
                        values.insert("spawn_to_vm_ready_ms", v);
                    }
                    if let Some(v) = ns_after(get("first_kvm_run_ns"), spawn) {
                        values.insert("spawn_to_first_kvm_run_ms", v);
                    }
                    if let Some(v) = m.get("vm_exits").and_then(|v| v.as_u64()) {
                        values.insert("vm_exits", v as f64);
                    }
                }
                None => errors.push("no metrics JSON from dsec-vmm".into()),
            }
        }
        Kind::Qemu => {
            if code != Some(QEMU_RESET_EXIT_STATUS) && !r.timed_out {
                errors.push(format!(
                    "exit status {code:?}, want {QEMU_RESET_EXIT_STATUS} (guest reset via isa-debug-exit)"
                ));
            }
        }
    }
    let error = (!errors.is_empty()).then(|| {
        format!(
            "{}; console tail: {:?}; stderr tail: {:?}",
            errors.join("; "),
            r.output_tail(160),
            run::read_tail(&spec.stderr_path, 240)
        )
    });
    Sample {
        contender: plan.contender.name.clone(),
        index,
        values,
        error,
    }
}

pub fn scenario_skeleton(o: &DirectOpts) -> Scenario {
    let plans = plans(o);
    let mut comparisons = Vec::new();
    for p in &plans[1..] {
        comparisons.push(("ours".to_string(), p.contender.name.clone()));
    }
    Scenario {
        name: "direct",
        title: format!(
            "direct on this host: test guest {} ({} samples per contender, alternating)",
            o.guest.file_name().unwrap_or_default().to_string_lossy(),
            o.samples
        ),
        method: "harness clock (CLOCK_MONOTONIC) from just before spawn; first serial byte = \
                 first read() on the child's stdout pipe (same for all); exit = waitid(); \
                 first KVM_RUN / VMM main() from dsec-vmm's metrics (CLOCK_REALTIME, \
                 aligned to the harness's realtime spawn stamp)"
            .into(),
        metrics: metrics(),
        contenders: plans.iter().map(|p| p.contender.clone()).collect(),
        comparisons,
        samples: Vec::new(),
        skipped: None,
        notes: vec!["QEMU cannot report VM exits; 'VM exits per boot' is ours alone".into()],
    }
}

pub fn bench(o: &DirectOpts) -> Scenario {
    let mut sc = scenario_skeleton(o);
    for what in [&o.vmm, &o.qemu, &o.guest] {
        if !what.exists() && which(what).is_none() {
            sc.skipped = Some(format!("{} not found", what.display()));
            return sc;
        }
    }
    let plans = plans(o);
    let mut consecutive_failures = vec![0usize; plans.len()];
    for round in 0..o.warmup {
        for p in &plans {
            let s = one(p, o, round);
            eprintln!(
                "dsec-perf: warm-up {} {}",
                p.contender.name,
                if s.error.is_some() { "FAILED" } else { "ok" }
            );
        }
    }
    for i in 0..o.samples {
        for (k, p) in plans.iter().enumerate() {
            if consecutive_failures[k] >= GIVE_UP_AFTER {
                continue;
            }
            let s = one(p, o, i);
            if s.error.is_some() {
                consecutive_failures[k] += 1;
                if consecutive_failures[k] == GIVE_UP_AFTER {
                    eprintln!(
                        "dsec-perf: {} failed {GIVE_UP_AFTER} times in a row; not running it again",
                        p.contender.name
                    );
                }
            } else {
                consecutive_failures[k] = 0;
            }
            sc.samples.push(s);
        }
        if (i + 1) % 10 == 0 || i + 1 == o.samples {
            eprintln!("dsec-perf: direct: {}/{} rounds", i + 1, o.samples);
        }
    }
    sc
}

/// `program` if it contains a slash, else its first hit on PATH.
pub fn which(program: &Path) -> Option<PathBuf> {
    if program.components().count() > 1 {
        return program.exists().then(|| program.to_path_buf());
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(program))
            .find(|p| p.is_file())
    })
}
