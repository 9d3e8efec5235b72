//! The device scenario: in one rig L1, our VMM and QEMU `-M microvm` boot the same Linux
//! guest with the same disk image and tap; the guest measures block and TCP throughput with
//! `dsec-guest-bench`, and L1 measures each VMM's own memory next to an idle guest.
//! The L1 side is `perf/rig/devices-in-l1.sh`; the guest side `perf/rig/bench-init`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::report::{detail, metric, Contender, Sample, Scenario};
use crate::rig::{parse_tagged, scenario_inputs, write_script, ScriptRun};

const SCRIPT_TEMPLATE: &str = include_str!("../rig/devices-in-l1.sh");
const BENCH_INIT: &str = include_str!("../rig/bench-init");
const TAG: &str = "PERF-DEV ";

#[derive(Debug, Clone)]
pub struct RigDevOpts {
    pub samples: usize,
    pub rig: PathBuf,
    /// The guest (and L1) kernel, or why there is none.
    pub kernel: Result<PathBuf, String>,
    pub initramfs: Option<PathBuf>,
    /// Static `dsec-guest-bench` (runs in the guest and in L1).
    pub guest_bench: PathBuf,
    pub vmm: PathBuf,
    pub mem_mib: u32,
    pub disk_mib: u32,
    pub rand_reads: u32,
    pub tcp_mib: u32,
    pub workdir: PathBuf,
}

fn skeleton(o: &RigDevOpts) -> Scenario {
    Scenario {
        name: "rig-devices",
        title: format!(
            "in the rig (nested KVM in a QEMU-TCG L1): device throughput and VMM memory, ours vs QEMU microvm, same Linux guest ({} samples each, alternating order)",
            o.samples
        ),
        method: format!(
            "idle: 1 vCPU, {mem} MiB, no devices; once the guest idles, VMM RSS minus the RSS of \
             the guest-memory mapping (/proc/PID/smaps in L1). io: + virtio-blk on a {disk} MiB \
             raw image in L1's tmpfs and virtio-net on a tap; the guest's dsec-guest-bench reads \
             the disk with O_DIRECT ({disk} x 1 MiB sequential, {rand} x 4 KiB random) and sends \
             / fetches {tcp} MiB over TCP to the same tool in L1; guest CLOCK_MONOTONIC. Times \
             are compared (lower is better); throughputs are shown as details.",
            mem = o.mem_mib,
            disk = o.disk_mib,
            rand = o.rand_reads,
            tcp = o.tcp_mib,
        ),
        metrics: vec![
            metric("overhead_mib", "VMM memory overhead (idle)", "MiB"),
            detail("pss_mib", "VMM PSS incl. guest memory (idle)", "MiB"),
            metric("blk_seq_s", "blk sequential read time", "s"),
            detail("blk_seq_mib_s", "blk sequential read", "MiB/s"),
            metric("blk_rand_us", "blk random 4 KiB read latency", "us"),
            detail("blk_rand_iops", "blk random 4 KiB reads", "IOPS"),
            metric("tcp_send_s", "TCP guest -> host time", "s"),
            detail("tcp_send_mib_s", "TCP guest -> host", "MiB/s"),
            metric("tcp_fetch_s", "TCP host -> guest time", "s"),
            detail("tcp_fetch_mib_s", "TCP host -> guest", "MiB/s"),
        ],
        contenders: vec![
            Contender {
                name: "ours".into(),
                description: "dsec-vmm in L1".into(),
                command: "dsec-vmm --kernel vmlinux --initrd bench.cpio --vcpus 1 --mem-mib M [--drive disk.img --net tap=dsb0]".into(),
            },
            Contender {
                name: "qemu".into(),
                description: "qemu-system-x86_64 -M microvm -accel kvm in L1".into(),
                command: "qemu-system-x86_64 -M microvm -accel kvm -cpu host -smp 1 -m M -kernel vmlinux -initrd bench.cpio [-device virtio-blk-device -device virtio-net-device (tap)]".into(),
            },
        ],
        comparisons: vec![("ours".into(), "qemu".into())],
        samples: Vec::new(),
        skipped: None,
        notes: vec![
            "the guest's device traffic exits through nested virtualization emulated by TCG, so \
             absolute throughputs are far below real hardware; the ratios are the result"
                .into(),
            "each contender has one idle and one io sample per round, so its run counts are twice \
             the samples"
                .into(),
        ],
    }
}

/// The sample of one `PERF-DEV` line.
pub fn sample_of(m: &BTreeMap<String, String>) -> Sample {
    let num = |k: &str| m.get(k).and_then(|v| v.parse::<f64>().ok());
    let mut values = BTreeMap::new();
    let mut put = |key: &'static str, v: Option<f64>| {
        if let Some(v) = v.filter(|v| v.is_finite()) {
            values.insert(key, v);
        }
    };
    match m.get("kind").map(String::as_str) {
        Some("idle") => {
            put("overhead_mib", num("overhead_kib").map(|k| k / 1024.0));
            put("pss_mib", num("pss_kib").map(|k| k / 1024.0));
        }
        Some("io") => {
            put("blk_seq_s", num("blk_seq_secs"));
            put("blk_seq_mib_s", num("blk_seq_mib_s"));
            put(
                "blk_rand_us",
                num("blk_rand_iops").filter(|&v| v > 0.0).map(|v| 1e6 / v),
            );
            put("blk_rand_iops", num("blk_rand_iops"));
            put("tcp_send_s", num("tcp_send_secs"));
            put("tcp_send_mib_s", num("tcp_send_mib_s"));
            put("tcp_fetch_s", num("tcp_fetch_secs"));
            put("tcp_fetch_mib_s", num("tcp_fetch_mib_s"));
        }
        _ => {}
    }
    let ok = m.get("ok").map(String::as_str) == Some("1") && !values.is_empty();
    Sample {
        contender: m.get("contender").cloned().unwrap_or_default(),
        index: m.get("index").and_then(|v| v.parse().ok()).unwrap_or(0),
        values,
        error: (!ok).then(|| {
            m.get("error")
                .cloned()
                .unwrap_or_else(|| "no measurements in the line".into())
        }),
    }
}

pub fn bench(o: &RigDevOpts) -> Scenario {
    let mut sc = skeleton(o);
    if let Err(why) = run(o, &mut sc) {
        sc.skipped = Some(why);
    }
    sc
}

/// The agent initramfs with `/bench-init` and `/bin/dsec-guest-bench` appended (the kernel
/// unpacks concatenated newc archives in order).
fn bench_initramfs(o: &RigDevOpts, initramfs: &Path) -> Result<PathBuf, String> {
    let stage = o.workdir.join("bench-overlay");
    let _ = std::fs::remove_dir_all(&stage);
    std::fs::create_dir_all(stage.join("bin")).map_err(|e| format!("create overlay: {e}"))?;
    let init = stage.join("bench-init");
    std::fs::write(&init, BENCH_INIT).map_err(|e| format!("write bench-init: {e}"))?;
    std::fs::copy(&o.guest_bench, stage.join("bin/dsec-guest-bench"))
        .map_err(|e| format!("copy {}: {e}", o.guest_bench.display()))?;
    use std::os::unix::fs::PermissionsExt;
    for f in [init, stage.join("bin/dsec-guest-bench")] {
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| format!("chmod {}: {e}", f.display()))?;
    }
    let overlay = o.workdir.join("bench-overlay.cpio");
    let out = std::fs::File::create(&overlay).map_err(|e| format!("create cpio: {e}"))?;
    let mut child = Command::new("cpio")
        .args(["-o", "-H", "newc", "--quiet"])
        .current_dir(&stage)
        .stdin(Stdio::piped())
        .stdout(out)
        .spawn()
        .map_err(|e| format!("cannot run cpio (apt-get install cpio): {e}"))?;
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().ok_or("cpio stdin")?;
        stdin
            .write_all(b"bench-init\nbin\nbin/dsec-guest-bench\n")
            .map_err(|e| format!("feed cpio: {e}"))?;
    }
    let status = child.wait().map_err(|e| format!("wait cpio: {e}"))?;
    if !status.success() {
        return Err(format!("cpio failed: {status}"));
    }
    let combined = o.workdir.join("bench.cpio");
    let mut bytes =
        std::fs::read(initramfs).map_err(|e| format!("read {}: {e}", initramfs.display()))?;
    bytes.extend(std::fs::read(&overlay).map_err(|e| format!("read overlay: {e}"))?);
    std::fs::write(&combined, bytes).map_err(|e| format!("write bench.cpio: {e}"))?;
    Ok(combined)
}

fn run(o: &RigDevOpts, sc: &mut Scenario) -> Result<(), String> {
    if o.samples == 0 {
        return Err("--rig-samples 0".into());
    }
    let (kernel, initramfs) = scenario_inputs(
        &o.kernel,
        &o.initramfs,
        &[
            ("rig driver", &o.rig),
            ("dsec-vmm", &o.vmm),
            (
                "static dsec-guest-bench (setup.sh builds it; or --guest-bench)",
                &o.guest_bench,
            ),
        ],
    )?;
    std::fs::create_dir_all(&o.workdir).map_err(|e| e.to_string())?;
    let bench_cpio = bench_initramfs(o, &initramfs)?;
    let script = write_script(
        &o.workdir,
        "devices-in-l1.sh",
        &[
            ("PERF_SAMPLES", o.samples.to_string()),
            ("PERF_MEM_MIB", o.mem_mib.to_string()),
            ("PERF_DISK_MIB", o.disk_mib.to_string()),
            ("PERF_RAND_READS", o.rand_reads.to_string()),
            ("PERF_TCP_MIB", o.tcp_mib.to_string()),
        ],
        SCRIPT_TEMPLATE,
    )?;
    eprintln!(
        "dsec-perf: rig device scenario: one L1, {} rounds x 2 VMMs x (idle + io)",
        o.samples
    );
    let run = ScriptRun {
        rig: &o.rig,
        script: &script,
        files: vec![
            format!("{}=/bin/dsec-vmm", o.vmm.display()),
            format!("{}=/bin/dsec-guest-bench", o.guest_bench.display()),
            format!("{}=/guest/vmlinux", kernel.display()),
            format!("{}=/guest/bench.cpio", bench_cpio.display()),
        ],
        qemu: true,
        kernel: &kernel,
        timeout_s: 600 + 900 * o.samples as u64,
        workdir: &o.workdir,
        name: "rig-devices",
    };
    run.run(TAG, |line| {
        if let Some(m) = parse_tagged(line, TAG) {
            sc.samples.push(sample_of(&m));
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
            "PERF-DEV kind=idle contender=ours index=1 ok=1 rss_kib=9000 guest_rss_kib=6952 overhead_kib=2048 pss_kib=8000",
            TAG,
        )
        .unwrap();
        let s = sample_of(&m);
        assert_eq!((s.contender.as_str(), s.index), ("ours", 1));
        assert_eq!(s.values["overhead_mib"], 2.0);
        assert!(s.error.is_none());

        let m = parse_tagged(
            "PERF-DEV kind=io contender=qemu index=0 ok=1 blk_seq_mib_s=100.0 blk_seq_secs=0.640 blk_rand_iops=2000 blk_rand_secs=1.0 tcp_send_mib_s=50.0 tcp_send_secs=0.320 tcp_fetch_mib_s=40.0 tcp_fetch_bytes=16777216 tcp_fetch_secs=0.400",
            TAG,
        )
        .unwrap();
        let s = sample_of(&m);
        assert_eq!(s.values["blk_rand_us"], 500.0);
        assert_eq!(s.values["tcp_fetch_s"], 0.4);
        assert!(!s.values.contains_key("overhead_mib"));

        let m = parse_tagged(
            "PERF-DEV kind=io contender=ours index=2 ok=0 error=guest_never_finished",
            TAG,
        )
        .unwrap();
        assert_eq!(sample_of(&m).error.as_deref(), Some("guest_never_finished"));
    }
}
