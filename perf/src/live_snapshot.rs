//! `dsec-perf snapshot`, live part: the pause window of a full snapshot of a running VM
//! (a fork's parent pause) and the time until that snapshot is complete, for `dsec-vmm` and
//! optionally a baseline build of it, side by side. Each contender runs one guest of
//! `mem_mib` MiB that touched `touch_mib` MiB and halts (the benchmark guest of `guest.rs`,
//! booted with an idle CID); the contenders' snapshots alternate, sample by sample.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use dsec_vmm_api::{ControlClient, SerialOutput, VmConfig, VmmLaunch, VsockConfig};

use crate::direct::shell_words;
use crate::fleet::{Fleet, Ready};
use crate::guest;
use crate::report::{detail, goal_line, metric, Contender, Sample, Scenario};

#[derive(Debug, Clone)]
pub struct LiveOpts {
    pub vmm: PathBuf,
    /// Another `dsec-vmm` build measured beside it (e.g. the one before a change).
    pub baseline_vmm: Option<PathBuf>,
    pub samples: usize,
    pub mem_mib: u32,
    pub touch_mib: u32,
    pub timeout: Duration,
    pub workdir: PathBuf,
}

fn scenario(o: &LiveOpts) -> Scenario {
    let mut contenders = vec![("ours", o.vmm.clone())];
    if let Some(b) = &o.baseline_vmm {
        contenders.push(("baseline", b.clone()));
    }
    Scenario {
        name: "live-snapshot",
        title: format!(
            "live full snapshot of a running {} MiB guest ({} MiB touched): pause window",
            o.mem_mib, o.touch_mib
        ),
        method: format!(
            "each contender boots one guest and keeps it running; {{\"op\":\"snapshot\"}} on its \
             control socket, contenders alternating, {} samples each; paused_ms and complete_ms \
             from the reply, the steps from its pause_steps (a VMM before them reports 0)",
            o.samples
        ),
        metrics: vec![
            metric("paused_ms", "guest paused (VMM-side)", "ms"),
            metric("complete_ms", "request -> snapshot complete", "ms"),
            detail("step_pause_ms", "  vCPUs + devices paused", "ms"),
            detail("step_state_ms", "  state read", "ms"),
            detail("step_prepare_ms", "  memory writer prepared", "ms"),
            detail("step_write_ms", "  memory written paused", "ms"),
            detail("step_fork_ms", "  copy-on-write fork", "ms"),
            detail("step_resume_ms", "  resumed", "ms"),
            detail("final_pages", "pages for the pause instant", "pages"),
            detail("pages_written", "pages written in all", "pages"),
        ],
        contenders: contenders
            .iter()
            .map(|(name, vmm)| Contender {
                name: (*name).into(),
                description: vmm.display().to_string(),
                command: shell_words(vmm, &launch(o, name).to_args()),
            })
            .collect(),
        comparisons: if o.baseline_vmm.is_some() {
            vec![("ours".into(), "baseline".into())]
        } else {
            Vec::new()
        },
        samples: Vec::new(),
        skipped: None,
        notes: Vec::new(),
    }
}

fn dir_of(o: &LiveOpts, name: &str) -> PathBuf {
    o.workdir.join(format!("live-{name}"))
}

fn launch(o: &LiveOpts, name: &str) -> VmmLaunch {
    let dir = dir_of(o, name);
    let mut config = VmConfig::new(o.workdir.join("live-guest.elf"));
    config.mem_mib = u64::from(o.mem_mib);
    config.serial = SerialOutput::File(dir.join("serial.log"));
    // An idle CID: the guest touches its memory, prints READY and halts.
    config.vsock = Some(VsockConfig {
        uds_path: dir.join("vsock.sock"),
        guest_cid: u64::from(guest::IDLE_CID_MIN),
    });
    let mut l = VmmLaunch::boot(config);
    l.api_sock = Some(dir.join("api.sock"));
    l
}

pub fn bench(o: &LiveOpts) -> Scenario {
    let mut sc = scenario(o);
    if o.samples == 0 {
        sc.skipped = Some("--live-samples 0".into());
        return sc;
    }
    if o.mem_mib < guest::min_mem_mib(o.touch_mib) {
        sc.skipped = Some(format!(
            "--live-touch-mib {} needs --live-mem-mib >= {}",
            o.touch_mib,
            guest::min_mem_mib(o.touch_mib)
        ));
        return sc;
    }
    if let Err(e) = run(o, &mut sc) {
        sc.skipped = Some(e);
    }
    let p50 = sc.summary("ours", "paused_ms").map(|s| s.p50);
    sc.notes
        .push(goal_line("ours: guest paused p50", p50, 20.0, "ms"));
    sc
}

fn run(o: &LiveOpts, sc: &mut Scenario) -> Result<(), String> {
    std::fs::create_dir_all(&o.workdir).map_err(|e| e.to_string())?;
    std::fs::write(
        o.workdir.join("live-guest.elf"),
        guest::touch_guest_elf(o.touch_mib),
    )
    .map_err(|e| e.to_string())?;
    let names: Vec<String> = sc.contenders.iter().map(|c| c.name.clone()).collect();
    let mut fleet = Fleet::default();
    for (name, vmm) in names
        .iter()
        .zip(std::iter::once(&o.vmm).chain(o.baseline_vmm.as_ref()))
    {
        let dir = dir_of(o, name);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        fleet
            .spawn(
                name.clone(),
                vmm,
                &launch(o, name).to_args(),
                dir.join("metrics.json"),
                dir.join("stderr"),
                Ready::LineIn(dir.join("serial.log"), guest::READY_LINE.into()),
            )
            .map_err(|e| format!("spawn {}: {e}", vmm.display()))?;
    }
    let not_ready = fleet.wait_ready(o.timeout);
    if !not_ready.is_empty() {
        return Err(format!("guests never got ready: {not_ready:?}"));
    }
    for index in 0..o.samples {
        for name in &names {
            sc.samples.push(one(o, name, index));
        }
    }
    fleet.terminate(Duration::from_secs(5));
    Ok(())
}

fn one(o: &LiveOpts, name: &str, index: usize) -> Sample {
    let dir = dir_of(o, name);
    let snap = dir.join(format!("snap-{index}"));
    let reply = ControlClient::new(dir.join("api.sock")).snapshot(&snap, false);
    let _ = std::fs::remove_dir_all(&snap);
    let mut values = BTreeMap::new();
    let error = match reply {
        Ok(r) => {
            let s = &r.pause_steps;
            for (key, v) in [
                ("paused_ms", r.paused_ms),
                ("complete_ms", r.complete_ms),
                ("step_pause_ms", s.pause_ms),
                ("step_state_ms", s.state_ms),
                ("step_prepare_ms", s.prepare_ms),
                ("step_write_ms", s.write_ms),
                ("step_fork_ms", s.fork_ms),
                ("step_resume_ms", s.resume_ms),
                ("final_pages", r.final_pages as f64),
                ("pages_written", r.pages_written as f64),
            ] {
                values.insert(key, v);
            }
            None
        }
        Err(e) => Some(e.to_string()),
    };
    Sample {
        contender: name.into(),
        index,
        values,
        error,
    }
}
