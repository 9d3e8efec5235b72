//! The guest-inclusive restore scenario: in one rig L1, a Linux guest + agent is restored
//! through `dsec vm restore` (MAP_PRIVATE, lazy, lazy + prefetch) and cold-booted through
//! `dsec vm boot`, each timed to the end of its first `exec true` through the agent.
//! The L1 side is `perf/rig/snapshot-in-l1.sh`; this side runs it and parses its lines.

use std::path::PathBuf;

use crate::report::{Contender, Metric, Sample, Scenario};
use crate::rig::{parse_tagged, scenario_inputs, write_script, ScriptRun};

const SCRIPT_TEMPLATE: &str = include_str!("../rig/snapshot-in-l1.sh");
const TAG: &str = "PERF-SNAP ";
pub const CONTENDERS: [(&str, &str); 4] = [
    ("cold", "dsec vm boot DIR; dsec vm exec DIR -- true"),
    (
        "private",
        "dsec vm restore SNAP DIR; dsec vm exec DIR -- true",
    ),
    (
        "lazy",
        "dsec vm restore SNAP DIR --lazy; dsec vm exec DIR -- true",
    ),
    (
        "prefetch",
        "dsec vm restore SNAP DIR --lazy --prefetch; dsec vm exec DIR -- true",
    ),
];

#[derive(Debug, Clone)]
pub struct RigSnapOpts {
    pub samples: usize,
    pub rig: PathBuf,
    /// The guest (and L1) kernel, or why there is none.
    pub kernel: Result<PathBuf, String>,
    pub initramfs: Option<PathBuf>,
    pub dsec: PathBuf,
    pub vmm: PathBuf,
    pub mem_mib: u32,
    pub record_ms: u64,
    pub workdir: PathBuf,
}

fn skeleton(o: &RigSnapOpts) -> Scenario {
    Scenario {
        name: "rig-restore",
        title: format!(
            "in the rig (nested KVM in a QEMU-TCG L1): Linux guest, restore or boot to the first exec through the agent ({} samples per contender, one L1, rotating order)",
            o.samples
        ),
        method: format!(
            "L1's /proc/uptime (10 ms steps) from the `dsec vm` call to the end of the first \
             `dsec vm exec DIR -- true`; restores include the agent Refresh (entropy, clock). \
             One snapshot of a booted guest ({} MiB, 1 vCPU); its working set is recorded once \
             with a lazy restore and a {} ms window before the samples.",
            o.mem_mib, o.record_ms
        ),
        metrics: vec![Metric {
            key: "first_exec_ms",
            label: "call -> first exec done",
            unit: "ms",
            compare: true,
        }],
        contenders: CONTENDERS
            .iter()
            .map(|(name, cmd)| Contender {
                name: name.to_string(),
                description: match *name {
                    "cold" => "a fresh boot of the same VM",
                    "private" => "restore, memory file mapped MAP_PRIVATE",
                    "lazy" => "restore, memory through userfaultfd",
                    _ => "restore through userfaultfd + recorded working set prefetched",
                }
                .into(),
                command: cmd.to_string(),
            })
            .collect(),
        comparisons: vec![
            ("private".into(), "cold".into()),
            ("lazy".into(), "cold".into()),
            ("prefetch".into(), "cold".into()),
            ("prefetch".into(), "lazy".into()),
        ],
        samples: Vec::new(),
        skipped: None,
        notes: vec![
            "guest kernel code is emulated under PVM-in-TCG here, so absolute times are far \
             above real hardware; the ratios are the result"
                .into(),
        ],
    }
}

/// The samples of one `PERF-SNAP` line.
pub fn sample_of(m: &std::collections::BTreeMap<String, String>) -> Sample {
    let mut values = std::collections::BTreeMap::new();
    if let Some(v) = m.get("first_exec_ms").and_then(|v| v.parse::<f64>().ok()) {
        values.insert("first_exec_ms", v);
    }
    let ok = m.get("ok").map(String::as_str) == Some("1") && !values.is_empty();
    Sample {
        contender: m.get("contender").cloned().unwrap_or_default(),
        index: m.get("index").and_then(|v| v.parse().ok()).unwrap_or(0),
        values,
        error: (!ok).then(|| {
            m.get("error")
                .cloned()
                .unwrap_or_else(|| "no first_exec_ms".into())
        }),
    }
}

pub fn bench(o: &RigSnapOpts) -> Scenario {
    let mut sc = skeleton(o);
    if let Err(why) = run(o, &mut sc) {
        sc.skipped = Some(why);
    }
    sc
}

fn run(o: &RigSnapOpts, sc: &mut Scenario) -> Result<(), String> {
    if o.samples == 0 {
        return Err("--rig-samples 0".into());
    }
    let (kernel, initramfs) = scenario_inputs(
        &o.kernel,
        &o.initramfs,
        &[
            ("rig driver", &o.rig),
            ("dsec", &o.dsec),
            ("dsec-vmm", &o.vmm),
        ],
    )?;
    let script = write_script(
        &o.workdir,
        "snapshot-in-l1.sh",
        &[
            ("PERF_SAMPLES", o.samples.to_string()),
            ("PERF_MEM_MIB", o.mem_mib.to_string()),
            ("PERF_RECORD_MS", o.record_ms.to_string()),
        ],
        SCRIPT_TEMPLATE,
    )?;
    eprintln!(
        "dsec-perf: rig restore scenario: one L1, {} samples x {} contenders",
        o.samples,
        CONTENDERS.len()
    );
    let run = ScriptRun {
        rig: &o.rig,
        script: &script,
        files: vec![
            format!("{}=/bin/dsec", o.dsec.display()),
            format!("{}=/bin/dsec-vmm", o.vmm.display()),
            format!("{}=/guest/vmlinux", kernel.display()),
            format!("{}=/guest/initramfs.cpio", initramfs.display()),
        ],
        qemu: false,
        kernel: &kernel,
        timeout_s: 600 + 300 * o.samples as u64,
        workdir: &o.workdir,
        name: "rig-restore",
    };
    run.run(TAG, |line| {
        if let Some(m) = parse_tagged(line, TAG) {
            sc.samples.push(sample_of(&m));
        } else if let Some(info) = line.strip_prefix("PERF-SNAP-INFO ") {
            sc.notes.push(format!("snapshot: {info}"));
        }
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_become_samples() {
        let m = parse_tagged(
            "PERF-SNAP contender=lazy index=2 ok=1 first_exec_ms=812",
            TAG,
        )
        .unwrap();
        let s = sample_of(&m);
        assert_eq!((s.contender.as_str(), s.index), ("lazy", 2));
        assert_eq!(s.values["first_exec_ms"], 812.0);
        assert!(s.error.is_none());
        let m = parse_tagged(
            "PERF-SNAP contender=cold index=0 ok=0 error=agent did not answer",
            TAG,
        )
        .unwrap();
        assert_eq!(sample_of(&m).error.as_deref(), Some("agent did not answer"));
        assert!(parse_tagged("PERF-RIG contender=ours", TAG).is_none());
    }
}
