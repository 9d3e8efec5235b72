//! Scenario 2: the real guest kernel + agent initramfs booted to `dsec-agent ready`, our
//! VMM beside QEMU `-M microvm -accel kvm`, inside the nested-KVM rig's L1.
//!
//! The outer half (on the host) starts `tests/rig/rig.sh run` once per boot: a fresh L1
//! for every sample of every contender, alternating ours / qemu. Inside L1 the rig script
//! (`perf/rig/boot-in-l1.sh`) runs `dsec-perf rig-inner`, which times the boot on L1's
//! clock with the same pipe method as the direct scenario and prints one `PERF-RIG` line
//! per boot; the outer half parses those lines.

use dsec_vmm_api::{DriveConfig, SerialOutput, VmConfig, VmmLaunch, VsockConfig};
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::report::{Contender, Metric, Sample, Scenario};
use crate::run::{self, RunSpec};

pub const READY_LINE: &str = "dsec-agent ready";
pub const GUEST_CMDLINE: &str = "console=ttyS0 reboot=k panic=-1 quiet";
const SCRIPT_TEMPLATE: &str = include_str!("../rig/boot-in-l1.sh");
pub const CONTENDERS: [&str; 2] = ["ours", "qemu"];
/// The optional third contender (`--firecracker PATH`), and where its binary goes in L1.
pub const FIRECRACKER: &str = "firecracker";
const L1_FIRECRACKER: &str = "/bin/firecracker";

pub fn metrics() -> Vec<Metric> {
    vec![
        Metric {
            key: "spawn_to_first_console_byte_ms",
            label: "spawn -> first console byte*",
            unit: "ms",
            compare: true,
        },
        Metric {
            key: "spawn_to_agent_ready_ms",
            label: "spawn -> dsec-agent ready",
            unit: "ms",
            compare: true,
        },
        Metric {
            key: "l1_boot_s",
            label: "L1 boot (rig health, host clock)",
            unit: "s",
            compare: false,
        },
    ]
}

// ---------------------------------------------------------------- inside L1

#[derive(Debug, Clone)]
pub struct InnerOpts {
    pub order: Vec<String>,
    pub vmm: PathBuf,
    pub qemu: PathBuf,
    /// Firecracker, when it is a contender (`--no-api --config-file`, config written per boot).
    pub firecracker: PathBuf,
    pub kernel: PathBuf,
    pub initrd: PathBuf,
    pub mem_mib: u32,
    pub timeout: Duration,
    pub workdir: PathBuf,
    /// Appended to the guest cmdline of every contender.
    pub cmdline_extra: String,
    /// Boot from this read-only root disk (vda) with a fresh writable upper disk (vdb) per
    /// boot, as the edge starts a sandbox on a disk image: the agent mounts the overlay
    /// before it reports ready.
    pub root_disk: Option<RootDisk>,
}

/// A disk-image root: the read-only image and how to make each boot's empty upper disk.
#[derive(Debug, Clone)]
pub struct RootDisk {
    pub image: PathBuf,
    pub mkfs: PathBuf,
    pub upper_mib: u64,
}

/// What the agent reads to find its root and upper disks (see the edge's microVM spec).
pub const DISK_ROOT_CMDLINE: &str = "dsec.root=/dev/vda dsec.upper=/dev/vdb";

/// The upper disk of boot `index` (made before the boot, outside the timed span).
pub fn upper_path(workdir: &Path, index: usize) -> PathBuf {
    workdir.join(format!("upper-{index}.ext4"))
}

/// Makes an empty sparse ext4 upper disk the way the edge does for every sandbox.
fn make_upper(root: &RootDisk, path: &Path) -> Result<(), String> {
    let _ = std::fs::remove_file(path);
    let f = std::fs::File::create(path).map_err(|e| format!("create {}: {e}", path.display()))?;
    f.set_len(root.upper_mib << 20)
        .map_err(|e| format!("size {}: {e}", path.display()))?;
    drop(f);
    let out = Command::new(&root.mkfs)
        .args([
            "-q",
            "-F",
            "-m",
            "0",
            "-L",
            "dsec-upper",
            "-O",
            "^has_journal",
        ])
        .args(["-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard"])
        .arg(path)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {}: {e}", root.mkfs.display()))?;
    if !out.status.success() {
        return Err(format!(
            "{} {} failed ({}): {}",
            root.mkfs.display(),
            path.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}

/// The guest kernel command line both VMMs get.
pub fn guest_cmdline(extra: &str) -> String {
    let extra = extra.trim();
    if extra.is_empty() {
        GUEST_CMDLINE.to_string()
    } else {
        format!("{GUEST_CMDLINE} {extra}")
    }
}

/// The argv each contender runs inside L1 (also recorded in the JSON).
pub fn inner_command(
    contender: &str,
    o: &InnerOpts,
    index: usize,
) -> Result<(PathBuf, Vec<OsString>), String> {
    let mem = o.mem_mib.to_string();
    let mut cmdline = guest_cmdline(&o.cmdline_extra);
    if o.root_disk.is_some() {
        cmdline = format!("{cmdline} {DISK_ROOT_CMDLINE}");
    }
    let upper = upper_path(&o.workdir, index);
    let mut a: Vec<OsString> = Vec::new();
    let mut push = |v: &[&str]| a.extend(v.iter().map(OsString::from));
    match contender {
        "ours" => {
            let mut config = VmConfig::new(&o.kernel);
            config.initrd = Some(o.initrd.clone());
            config.mem_mib = u64::from(o.mem_mib);
            config.vcpus = 1;
            config.cmdline = cmdline;
            config.serial = SerialOutput::Stdout;
            config.vsock = Some(VsockConfig {
                uds_path: o.workdir.join(format!("vsock-{index}.sock")),
                guest_cid: dsec_vmm_api::config::MIN_GUEST_CID,
            });
            if let Some(root) = &o.root_disk {
                config.drives = vec![
                    DriveConfig {
                        path: root.image.clone(),
                        read_only: true,
                    },
                    DriveConfig {
                        path: upper,
                        read_only: false,
                    },
                ];
            }
            let mut launch = VmmLaunch::boot(config);
            launch.metrics_json = Some(metrics_path(&o.workdir, index));
            Ok((o.vmm.clone(), launch.to_args()))
        }
        "qemu" => {
            push(&[
                "-M",
                "microvm,x-option-roms=off,isa-serial=on,rtc=off",
                "-accel",
                "kvm",
                "-cpu",
                "host",
                "-smp",
                "1",
                "-m",
                &mem,
                "-nodefaults",
                "-no-user-config",
                "-nographic",
                "-serial",
                "stdio",
                "-no-reboot",
                "-kernel",
            ]);
            a.push(o.kernel.clone().into());
            a.push("-initrd".into());
            a.push(o.initrd.clone().into());
            a.push("-append".into());
            a.push(cmdline.into());
            // The same two disks in the same order (vda read-only root, vdb upper).
            if let Some(root) = &o.root_disk {
                let mut r = OsString::from("id=root,format=raw,if=none,readonly=on,file=");
                r.push(&root.image);
                let mut u = OsString::from("id=upper,format=raw,if=none,file=");
                u.push(&upper);
                for (drive, dev) in [
                    (r, "virtio-blk-device,drive=root"),
                    (u, "virtio-blk-device,drive=upper"),
                ] {
                    a.extend(["-drive".into(), drive, "-device".into(), dev.into()]);
                }
            }
            // Same devices as ours: a vsock device (vhost in L1's kernel) when L1 has it.
            if Path::new("/dev/vhost-vsock").exists() {
                a.push("-device".into());
                a.push(format!("vhost-vsock-device,guest-cid={}", 3 + index).into());
            }
            Ok((o.qemu.clone(), a))
        }
        FIRECRACKER => {
            a.push("--no-api".into());
            a.push("--config-file".into());
            a.push(firecracker_config_path(&o.workdir, index).into());
            // Its log would otherwise go to stdout, where the console is timed.
            a.push("--log-path".into());
            a.push(o.workdir.join(format!("firecracker-{index}.log")).into());
            a.push("--level".into());
            a.push("Info".into());
            Ok((o.firecracker.clone(), a))
        }
        other => Err(format!(
            "unknown contender '{other}' (ours, qemu, {FIRECRACKER})"
        )),
    }
}

/// Where boot `index`'s Firecracker configuration is written.
pub fn firecracker_config_path(workdir: &Path, index: usize) -> PathBuf {
    workdir.join(format!("firecracker-{index}.json"))
}

/// Firecracker's configuration for boot `index`: the same kernel, initrd, cmdline, memory,
/// one vCPU, a vsock device and (on a root disk) the same two disks in the same order.
pub fn firecracker_config(o: &InnerOpts, index: usize) -> serde_json::Value {
    let mut cmdline = guest_cmdline(&o.cmdline_extra);
    let mut drives = Vec::new();
    if let Some(root) = &o.root_disk {
        cmdline = format!("{cmdline} {DISK_ROOT_CMDLINE}");
        for (id, path, read_only) in [
            ("root", root.image.clone(), true),
            ("upper", upper_path(&o.workdir, index), false),
        ] {
            drives.push(serde_json::json!({
                "drive_id": id,
                "path_on_host": path,
                "is_root_device": false,
                "is_read_only": read_only,
            }));
        }
    }
    serde_json::json!({
        "boot-source": {
            "kernel_image_path": o.kernel,
            "initrd_path": o.initrd,
            "boot_args": cmdline,
        },
        "drives": drives,
        "machine-config": {"vcpu_count": 1, "mem_size_mib": o.mem_mib, "smt": false},
        "vsock": {
            "guest_cid": dsec_vmm_api::config::MIN_GUEST_CID,
            "uds_path": o.workdir.join(format!("firecracker-vsock-{index}.sock")),
        },
    })
}

/// Writes what a contender needs on disk before its spawn (outside the timed span).
fn prepare(contender: &str, o: &InnerOpts, index: usize) -> Result<(), String> {
    if contender == FIRECRACKER {
        let path = firecracker_config_path(&o.workdir, index);
        std::fs::write(&path, firecracker_config(o, index).to_string())
            .map_err(|e| format!("write {}: {e}", path.display()))?;
        let _ = std::fs::remove_file(o.workdir.join(format!("firecracker-vsock-{index}.sock")));
    }
    Ok(())
}

/// Where our VMM writes its metrics (build steps, exits by device and by time) for boot
/// `index`; it writes them when it is stopped with SIGTERM after agent-ready.
pub fn metrics_path(workdir: &Path, index: usize) -> PathBuf {
    workdir.join(format!("ours-{index}.metrics.json"))
}

/// Console lines kept per boot in the rig console (a verbose boot log has a few hundred).
const CONSOLE_LINES_KEPT: usize = 2000;

/// Runs the boots in `o.order` one after another; prints one `PERF-RIG` line each.
/// Returns the number of failed boots.
pub fn inner(o: &InnerOpts) -> usize {
    let _ = std::fs::create_dir_all(&o.workdir);
    let mut failed = 0;
    for (i, c) in o.order.iter().enumerate() {
        let made = match &o.root_disk {
            Some(root) => make_upper(root, &upper_path(&o.workdir, i)),
            None => Ok(()),
        };
        let made = made.and_then(|()| prepare(c, o, i));
        let line = match made.and_then(|()| inner_command(c, o, i)) {
            Err(e) => format!("contender={c} index={i} ok=0 error={e}"),
            Ok((program, args)) => {
                let spec = RunSpec {
                    program,
                    args,
                    stderr_path: o.workdir.join(format!("{c}-{i}.stderr")),
                    timeout: o.timeout,
                    marker: Some(READY_LINE.into()),
                    kill_after_marker: true,
                    ready_path: None,
                    // Ours stops cleanly so that it writes its metrics; timing ends before.
                    stop_signal: if c == "ours" {
                        libc::SIGTERM
                    } else {
                        libc::SIGKILL
                    },
                    stop_delay: Duration::ZERO,
                    die_with_parent: false,
                };
                let result = run::run(&spec);
                if c == FIRECRACKER {
                    // Its own log (with timestamps) shows where its startup goes.
                    let log = o.workdir.join(format!("firecracker-{i}.log"));
                    for line in std::fs::read_to_string(log).unwrap_or_default().lines() {
                        println!("PERF-RIG-FCLOG {c}#{i} {line}");
                    }
                }
                if c == "ours" {
                    match std::fs::read_to_string(metrics_path(&o.workdir, i)) {
                        Ok(text) => println!("PERF-RIG-METRICS {c}#{i} {}", text.trim()),
                        Err(e) => println!(
                            "PERF-RIG-METRICS {c}#{i} unavailable ({e}); exit {:?}; stderr tail: {:?}",
                            result.as_ref().ok().and_then(|r| r.status),
                            run::read_tail(&spec.stderr_path, 300)
                        ),
                    }
                }
                match result {
                    Err(e) => format!("contender={c} index={i} ok=0 error=spawn: {e}"),
                    Ok(r) => {
                        let f = |d: Option<Duration>| {
                            d.map_or("-".to_string(), |d| format!("{:.3}", d.as_secs_f64() * 1e3))
                        };
                        let mut l = format!(
                            "contender={c} index={i} ok={} killed_after_ready={} first_byte_ms={} ready_ms={}",
                            u8::from(r.marker.is_some()),
                            u8::from(r.killed_after_marker),
                            f(r.first_byte),
                            f(r.marker)
                        );
                        if r.marker.is_none() {
                            let why = if r.timed_out {
                                format!("no '{READY_LINE}' within {:?}", o.timeout)
                            } else {
                                format!("exited ({:?}) before '{READY_LINE}'", r.status)
                            };
                            l.push_str(&format!(
                                " error={why}; console tail: {:?}; stderr tail: {:?}",
                                r.output_tail(300),
                                run::read_tail(&spec.stderr_path, 300)
                            ));
                        }
                        // The guest console with arrival times, for diagnosis (rig console).
                        for (t, text) in r.timeline.iter().rev().take(CONSOLE_LINES_KEPT).rev() {
                            println!(
                                "PERF-RIG-CONSOLE {c}#{i} +{:.1}ms {text}",
                                t.as_secs_f64() * 1e3
                            );
                        }
                        l
                    }
                }
            }
        };
        if !line.contains(" ok=1 ") {
            failed += 1;
        }
        println!("PERF-RIG {line}");
        if o.root_disk.is_some() {
            let _ = std::fs::remove_file(upper_path(&o.workdir, i));
        }
    }
    failed
}

// ---------------------------------------------------------------- on the host

#[derive(Debug, Clone)]
pub struct OuterOpts {
    pub samples: usize,
    /// One L1 for all boots (strictly alternating) instead of a fresh L1 per boot.
    pub shared_l1: bool,
    pub rig: PathBuf,
    /// The guest (and L1) kernel, or why there is none.
    pub kernel: Result<PathBuf, String>,
    pub initramfs: Option<PathBuf>,
    pub vmm: PathBuf,
    pub qemu: PathBuf,
    /// A Firecracker binary: a third contender when given.
    pub firecracker: Option<PathBuf>,
    pub mem_mib: u32,
    pub boot_timeout: Duration,
    pub workdir: PathBuf,
    pub cmdline_extra: String,
    /// Boot from a read-only root disk image (the Debian rootfs) instead of the initramfs
    /// alone: the scenario becomes `rig-disk`.
    pub root_disk: Option<PathBuf>,
}

/// Where the root disk and mkfs go inside L1.
const L1_ROOT_DISK: &str = "/guest/rootfs.img";
const L1_MKFS: &str = "/bin/mkfs.ext4";
/// The edge's default upper disk size, so the guest mounts what a sandbox mounts.
pub const UPPER_MIB: u64 = 1024;

/// mke2fs on this host (sbin is often not on PATH).
fn host_mkfs() -> Option<PathBuf> {
    crate::direct::which(Path::new("mke2fs")).or_else(|| {
        ["/usr/sbin/mke2fs", "/sbin/mke2fs"]
            .into_iter()
            .map(PathBuf::from)
            .find(|p| p.is_file())
    })
}

/// A parsed `PERF-RIG key=value ... [error=rest of line]` line.
pub fn parse_line(line: &str) -> Option<BTreeMap<String, String>> {
    parse_tagged(line, "PERF-RIG ")
}

/// The guest kernel and agent initramfs of a rig scenario, once they and every `other`
/// input exist; else why the scenario cannot run.
pub fn scenario_inputs(
    kernel: &Result<PathBuf, String>,
    initramfs: &Option<PathBuf>,
    others: &[(&str, &Path)],
) -> Result<(PathBuf, PathBuf), String> {
    let kernel = kernel.clone()?;
    let initramfs = initramfs
        .clone()
        .ok_or("agent initramfs not found (guest-agent/mkinitramfs.sh --install, or setup.sh)")?;
    let fixed = [
        ("guest kernel", kernel.as_path()),
        ("agent initramfs", initramfs.as_path()),
    ];
    for (what, path) in fixed.iter().chain(others) {
        if !path.is_file() {
            return Err(format!("{what} {} not found", path.display()));
        }
    }
    Ok((kernel, initramfs))
}

/// Writes `WORKDIR/NAME`: the `settings` as `KEY=value` lines above `template`'s body (the
/// template's defaults use `: "${KEY:=...}"`, so these win).
pub fn write_script(
    workdir: &Path,
    name: &str,
    settings: &[(&str, String)],
    template: &str,
) -> Result<PathBuf, String> {
    std::fs::create_dir_all(workdir).map_err(|e| format!("create {}: {e}", workdir.display()))?;
    let mut text = String::from("#!/bin/sh\n");
    for (key, value) in settings {
        text.push_str(&format!("{key}={value}\n"));
    }
    text.push_str(template.strip_prefix("#!/bin/sh\n").unwrap_or(template));
    let script = workdir.join(name);
    std::fs::write(&script, text).map_err(|e| format!("write {}: {e}", script.display()))?;
    Ok(script)
}

/// One `rig.sh run SCRIPT FILES...` of a scenario script in a fresh L1 (`--qemu` adds QEMU
/// to it): its console lines go to `on_line` as they arrive and are kept in
/// `WORKDIR/NAME.console`, rig.sh's own log in `WORKDIR/NAME.log`. Errors when nothing
/// matching `tag` came back, with the console's tail.
pub struct ScriptRun<'a> {
    pub rig: &'a Path,
    pub script: &'a Path,
    /// `SRC=DEST` files for the L1 initramfs.
    pub files: Vec<String>,
    pub qemu: bool,
    /// The guest kernel, also L1's unless RIG_KERNEL says otherwise.
    pub kernel: &'a Path,
    pub timeout_s: u64,
    pub workdir: &'a Path,
    pub name: &'a str,
}

impl ScriptRun<'_> {
    pub fn run(&self, tag: &str, mut on_line: impl FnMut(&str)) -> Result<(), String> {
        let log = self.workdir.join(format!("{}.log", self.name));
        let stderr =
            std::fs::File::create(&log).map_err(|e| format!("create {}: {e}", log.display()))?;
        let mut command = Command::new(self.rig);
        command.arg("run").arg(self.script);
        if self.qemu {
            command.arg("--qemu");
        }
        let mut child = command
            .args(&self.files)
            .env(
                "RIG_KERNEL",
                std::env::var_os("RIG_KERNEL")
                    .unwrap_or_else(|| self.kernel.as_os_str().to_owned()),
            )
            .env("RIG_TIMEOUT", self.timeout_s.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .map_err(|e| format!("cannot run {}: {e}", self.rig.display()))?;
        let mut console = Vec::new();
        let mut tagged = 0;
        if let Some(out) = child.stdout.take() {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if line.trim_end_matches('\r').starts_with(tag) {
                    tagged += 1;
                }
                on_line(&line);
                console.push(line);
            }
        }
        let status = child.wait().map_err(|e| format!("wait rig.sh: {e}"))?;
        let _ = std::fs::write(
            self.workdir.join(format!("{}.console", self.name)),
            console.join("\n"),
        );
        if tagged == 0 {
            let tail: Vec<String> = console.iter().rev().take(15).rev().cloned().collect();
            return Err(format!(
                "rig.sh exited {status} with no {} lines; console tail: {tail:?}",
                tag.trim()
            ));
        }
        Ok(())
    }
}

/// A parsed `<tag>key=value ... [error=rest of line]` line with a `contender` key.
pub fn parse_tagged(line: &str, tag: &str) -> Option<BTreeMap<String, String>> {
    let rest = line.trim_end_matches('\r').strip_prefix(tag)?;
    let (kv, error) = match rest.split_once(" error=") {
        Some((kv, e)) => (kv, Some(e)),
        None => (rest, None),
    };
    let mut m: BTreeMap<String, String> = kv
        .split_whitespace()
        .filter_map(|w| w.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    if let Some(e) = error {
        m.insert("error".into(), e.to_string());
    }
    m.contains_key("contender").then_some(m)
}

fn sample_from_line(m: &BTreeMap<String, String>, index: usize, l1_boot_s: Option<f64>) -> Sample {
    let mut values = BTreeMap::new();
    let num = |k: &str| m.get(k).and_then(|v| v.parse::<f64>().ok());
    if let Some(v) = num("first_byte_ms") {
        values.insert("spawn_to_first_console_byte_ms", v);
    }
    if let Some(v) = num("ready_ms") {
        values.insert("spawn_to_agent_ready_ms", v);
    }
    if let Some(v) = l1_boot_s {
        values.insert("l1_boot_s", v);
    }
    let ok = m.get("ok").map(String::as_str) == Some("1");
    Sample {
        contender: m.get("contender").cloned().unwrap_or_default(),
        index,
        values,
        error: (!ok).then(|| {
            m.get("error")
                .cloned()
                .unwrap_or_else(|| "boot failed".into())
        }),
    }
}

/// The contenders of a run: ours and QEMU, and Firecracker when given.
pub fn contenders(o: &OuterOpts) -> Vec<&'static str> {
    let mut list = CONTENDERS.to_vec();
    if o.firecracker.is_some() {
        list.push(FIRECRACKER);
    }
    list
}

pub fn skeleton(o: &OuterOpts) -> Scenario {
    let io = InnerOpts {
        order: vec![],
        vmm: "/bin/dsec-vmm".into(),
        qemu: "/usr/bin/qemu-system-x86_64".into(),
        firecracker: L1_FIRECRACKER.into(),
        kernel: "/guest/vmlinux".into(),
        initrd: "/guest/initramfs.cpio".into(),
        mem_mib: o.mem_mib,
        timeout: o.boot_timeout,
        workdir: "/tmp/dsec-perf".into(),
        cmdline_extra: o.cmdline_extra.clone(),
        root_disk: o.root_disk.as_ref().map(|_| RootDisk {
            image: L1_ROOT_DISK.into(),
            mkfs: L1_MKFS.into(),
            upper_mib: UPPER_MIB,
        }),
    };
    let disk = o.root_disk.is_some();
    let guest = if disk {
        "agent initramfs + read-only Debian root disk (vda) + fresh ext4 upper disk (vdb)"
    } else {
        "agent initramfs"
    };
    let names = contenders(o);
    let contenders = names
        .iter()
        .map(|c| {
            let (p, a) = inner_command(c, &io, 0).expect("known contender");
            let mut cmd = p.display().to_string();
            for x in a {
                let s = x.to_string_lossy();
                if s.contains(' ') {
                    cmd.push_str(&format!(" '{s}'"));
                } else {
                    cmd.push(' ');
                    cmd.push_str(&s);
                }
            }
            Contender {
                name: c.to_string(),
                description: match *c {
                    "ours" => format!("dsec-vmm in L1 (PVH vmlinux + {guest}, virtio-mmio vsock)"),
                    FIRECRACKER => format!("Firecracker in L1, --no-api --config-file (same kernel, {guest}, cmdline, memory, 1 vCPU, virtio-mmio vsock)"),
                    _ => format!("qemu-system-x86_64 -M microvm -accel kvm in L1 (same kernel, {guest}, cmdline; vhost-vsock-device if L1 has /dev/vhost-vsock)"),
                },
                command: cmd,
            }
        })
        .collect();
    Scenario {
        name: if disk { "rig-disk" } else { "rig" },
        title: format!(
            "in the rig (nested KVM in a QEMU-TCG L1): Linux guest {}to agent-ready ({} samples per contender, {})",
            if disk { "on the Debian root disk " } else { "" },
            o.samples,
            if o.shared_l1 { "one L1, strictly alternating" } else { "fresh L1 per boot, alternating" }
        ),
        method: format!(
            "L1's CLOCK_MONOTONIC from just before spawning the VMM (by dsec-perf inside L1) to the \
             first console byte and to the line '{READY_LINE}' on the VMM's stdout pipe; the VMM is \
             then killed. Guest cmdline '{}{}', {} MiB, 1 vCPU.{}",
            guest_cmdline(&o.cmdline_extra),
            if disk { format!(" {DISK_ROOT_CMDLINE}") } else { String::new() },
            o.mem_mib,
            if disk {
                format!(
                    " Before each boot (untimed) a fresh sparse {UPPER_MIB} MiB ext4 upper disk is \
                     made with the edge's mkfs flags; the agent reports ready only after it has \
                     mounted the erofs root (vda) and the upper (vdb) as an overlay and \
                     chrooted into it."
                )
            } else {
                String::new()
            }
        ),
        metrics: metrics(),
        contenders,
        comparisons: {
            let mut pairs = vec![("ours".to_string(), "qemu".to_string())];
            if names.contains(&FIRECRACKER) {
                pairs.push(("ours".into(), FIRECRACKER.into()));
                pairs.push((FIRECRACKER.into(), "qemu".into()));
            }
            pairs
        },
        samples: Vec::new(),
        skipped: None,
        notes: vec![
            "* the first console line differs between the VMMs (without ACPI tables our guest \
             prints an ACPI RSDP error first); 'agent ready' is the like-for-like figure"
                .into(),
        ],
    }
}

/// Why the rig scenario cannot run here, if it cannot.
fn check_inputs(o: &OuterOpts) -> Result<(PathBuf, PathBuf), String> {
    if o.samples == 0 {
        return Err("--rig-samples 0".into());
    }
    if !o.rig.is_file() {
        return Err(format!("rig script {} not found", o.rig.display()));
    }
    let kernel = o.kernel.clone()?;
    if !kernel.is_file() {
        return Err(format!("guest kernel {} not found", kernel.display()));
    }
    let initramfs = o.initramfs.clone().ok_or_else(|| {
        "agent initramfs not found (build it with guest-agent/mkinitramfs.sh --install, or pass --guest-initramfs)".to_string()
    })?;
    if !initramfs.is_file() {
        return Err(format!("agent initramfs {} not found", initramfs.display()));
    }
    if !o.vmm.is_file() {
        return Err(format!("dsec-vmm {} not found", o.vmm.display()));
    }
    if let Some(firecracker) = &o.firecracker {
        if !firecracker.is_file() {
            return Err(format!("Firecracker {} not found", firecracker.display()));
        }
    }
    if crate::direct::which(&o.qemu).is_none() {
        return Err(format!(
            "{} not found (apt-get install qemu-system-x86)",
            o.qemu.display()
        ));
    }
    if let Some(disk) = &o.root_disk {
        if !disk.is_file() {
            return Err(format!(
                "root disk {} not found (images/debian/build.sh --install, or setup.sh)",
                disk.display()
            ));
        }
        if host_mkfs().is_none() {
            return Err("mke2fs not found (apt-get install e2fsprogs)".into());
        }
    }
    for bin in ["cpio", "busybox"] {
        if crate::direct::which(Path::new(bin)).is_none() {
            return Err(format!(
                "'{bin}' not found (rig.sh needs cpio and busybox-static)"
            ));
        }
    }
    Ok((kernel, initramfs))
}

/// One `rig.sh run`: a fresh L1 running the boots in `order`.
fn run_l1(o: &OuterOpts, kernel: &Path, initramfs: &Path, order: &[&str], tag: &str) -> L1Result {
    let me = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
    let script = o.workdir.join(format!("boot-in-l1-{tag}.sh"));
    let header = format!(
        "#!/bin/sh\nPERF_ORDER={}\nPERF_MEM_MIB={}\nPERF_TIMEOUT_S={}\nPERF_CMDLINE_EXTRA='{}'\nPERF_ROOT_DISK={}\n",
        order.join(","),
        o.mem_mib,
        o.boot_timeout.as_secs(),
        o.cmdline_extra.replace('\'', "'\\''"),
        if o.root_disk.is_some() { L1_ROOT_DISK } else { "" },
    );
    let body = SCRIPT_TEMPLATE
        .strip_prefix("#!/bin/sh\n")
        .unwrap_or(SCRIPT_TEMPLATE);
    std::fs::write(&script, format!("{header}{body}")).map_err(|e| format!("write script: {e}"))?;
    let log = o.workdir.join(format!("rig-{tag}.log"));
    let stderr =
        std::fs::File::create(&log).map_err(|e| format!("create {}: {e}", log.display()))?;
    let per_boot = o.boot_timeout.as_secs() + 30;
    let mut command = Command::new(&o.rig);
    command
        .arg("run")
        .arg(&script)
        .arg("--qemu")
        .arg(format!("{}=/bin/dsec-perf", me.display()))
        .arg(format!("{}=/bin/dsec-vmm", o.vmm.display()))
        .arg(format!("{}=/guest/vmlinux", kernel.display()))
        .arg(format!("{}=/guest/initramfs.cpio", initramfs.display()));
    if let Some(firecracker) = &o.firecracker {
        command.arg(format!("{}={L1_FIRECRACKER}", firecracker.display()));
    }
    if let Some(disk) = &o.root_disk {
        let mkfs = host_mkfs().ok_or("mke2fs not found (apt-get install e2fsprogs)")?;
        command
            .arg(format!("{}={L1_ROOT_DISK}", disk.display()))
            .arg(format!("{}={L1_MKFS}", mkfs.display()))
            .arg("/etc/mke2fs.conf=/etc/mke2fs.conf");
        // The root disk lives in L1's RAM (its initramfs) beside the guest's memory.
        if std::env::var_os("RIG_MEM").is_none() {
            command.env("RIG_MEM", "3072");
        }
    }
    let mut child = command
        // L1 runs the same kernel build as the guest; without this rig.sh would ask
        // guest-kernel/build.sh for it (and build it if its cache is cold).
        .env(
            "RIG_KERNEL",
            std::env::var_os("RIG_KERNEL").unwrap_or_else(|| kernel.as_os_str().to_owned()),
        )
        .env(
            "RIG_TIMEOUT",
            (300 + per_boot * order.len() as u64).to_string(),
        )
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .map_err(|e| format!("cannot run {}: {e}", o.rig.display()))?;
    let mut lines = Vec::new();
    let mut console = Vec::new();
    if let Some(out) = child.stdout.take() {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if let Some(m) = parse_line(&line) {
                lines.push(m);
            }
            console.push(line);
        }
    }
    let status = child.wait().map_err(|e| format!("wait rig.sh: {e}"))?;
    let _ = std::fs::write(
        o.workdir.join(format!("rig-{tag}.console")),
        console.join("\n"),
    );
    let stderr_text = std::fs::read_to_string(&log).unwrap_or_default();
    let l1_boot_s = stderr_text.lines().find_map(|l| {
        l.split_once("L1 reached /init after ")
            .and_then(|(_, r)| r.split_whitespace().next())
            .and_then(|v| v.parse::<f64>().ok())
    });
    if lines.is_empty() {
        let tail: Vec<&String> = console.iter().rev().take(15).collect();
        return Err(format!(
            "rig.sh exited {status} with no PERF-RIG lines; stderr tail: {:?}; console tail: {:?}",
            run::read_tail(&log, 400),
            tail.into_iter().rev().cloned().collect::<Vec<_>>()
        ));
    }
    Ok((lines, l1_boot_s))
}

pub fn bench(o: &OuterOpts) -> Scenario {
    let mut sc = skeleton(o);
    let (kernel, initramfs) = match check_inputs(o) {
        Ok(x) => x,
        Err(why) => {
            sc.skipped = Some(why);
            return sc;
        }
    };
    let _ = std::fs::create_dir_all(&o.workdir);
    let started = Instant::now();
    let names = contenders(o);
    if o.shared_l1 {
        let order: Vec<&str> = (0..o.samples).flat_map(|_| names.clone()).collect();
        let res = run_l1(o, &kernel, &initramfs, &order, "shared");
        record(&mut sc, &order, |k| k / names.len(), res);
    } else {
        for i in 0..o.samples {
            for &c in &names {
                let res = run_l1(o, &kernel, &initramfs, &[c], &format!("{c}-{i}"));
                record(&mut sc, &[c], |_| i, res);
                let last = sc.samples.last().expect("just pushed");
                eprintln!(
                    "dsec-perf: rig {c} #{i}: {} ({:.0} s elapsed)",
                    match (&last.error, last.values.get("spawn_to_agent_ready_ms")) {
                        (None, Some(v)) => format!("agent ready after {v:.0} ms"),
                        (Some(e), _) =>
                            format!("FAILED: {}", e.chars().take(200).collect::<String>()),
                        _ => "?".into(),
                    },
                    started.elapsed().as_secs_f64()
                );
            }
        }
    }
    sc
}

type L1Result = Result<(Vec<BTreeMap<String, String>>, Option<f64>), String>;

/// Turns one L1's PERF-RIG lines into samples; boot `k` of `order` is sample `round(k)`.
/// The L1 boot time is attributed only when the L1 ran a single boot.
fn record(sc: &mut Scenario, order: &[&str], round: impl Fn(usize) -> usize, res: L1Result) {
    match res {
        Ok((lines, l1)) => {
            let l1 = if order.len() == 1 { l1 } else { None };
            for (k, c) in order.iter().enumerate() {
                let key = k.to_string();
                match lines.iter().find(|m| m.get("index") == Some(&key)) {
                    Some(m) => sc.samples.push(sample_from_line(m, round(k), l1)),
                    None => sc.samples.push(Sample {
                        contender: c.to_string(),
                        index: round(k),
                        values: BTreeMap::new(),
                        error: Some("no PERF-RIG line for this boot (L1 died?)".into()),
                    }),
                }
            }
        }
        Err(e) => {
            for (k, c) in order.iter().enumerate() {
                sc.samples.push(Sample {
                    contender: c.to_string(),
                    index: round(k),
                    values: BTreeMap::new(),
                    error: Some(e.clone()),
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ok_and_error_lines() {
        let m = parse_line(
            "PERF-RIG contender=ours index=0 ok=1 first_byte_ms=12.5 ready_ms=2100.000\r",
        )
        .unwrap();
        assert_eq!(m["contender"], "ours");
        assert_eq!(m["ready_ms"], "2100.000");
        let s = sample_from_line(&m, 3, Some(2.5));
        assert!(s.error.is_none());
        assert_eq!(s.values["spawn_to_agent_ready_ms"], 2100.0);
        assert_eq!(s.values["l1_boot_s"], 2.5);
        let m = parse_line("PERF-RIG contender=qemu index=1 ok=0 first_byte_ms=- ready_ms=- error=no 'x' within 1s; tail: \"a=b c\"").unwrap();
        assert_eq!(m["error"], "no 'x' within 1s; tail: \"a=b c\"");
        let s = sample_from_line(&m, 0, None);
        assert!(s.error.is_some() && s.values.is_empty());
        assert!(parse_line("PASS something").is_none());
    }

    #[test]
    fn inner_commands_share_kernel_initrd_and_cmdline() {
        let o = InnerOpts {
            order: vec![],
            vmm: "/bin/dsec-vmm".into(),
            qemu: "/usr/bin/qemu-system-x86_64".into(),
            firecracker: L1_FIRECRACKER.into(),
            kernel: "/guest/vmlinux".into(),
            initrd: "/guest/initramfs.cpio".into(),
            mem_mib: 256,
            timeout: Duration::from_secs(1),
            workdir: "/tmp".into(),
            cmdline_extra: "quiet2".into(),
            root_disk: None,
        };
        let words = |c: &str, o: &InnerOpts| -> Vec<String> {
            let (_, a) = inner_command(c, o, 0).unwrap();
            a.iter().map(|x| x.to_string_lossy().into_owned()).collect()
        };
        for c in CONTENDERS {
            let a = words(c, &o);
            assert!(a.contains(&"/guest/vmlinux".to_string()));
            assert!(a.contains(&"/guest/initramfs.cpio".to_string()));
            assert!(a.contains(&format!("{GUEST_CMDLINE} quiet2")), "{c}: {a:?}");
            assert!(a.contains(&"256".to_string()));
            assert!(!a.iter().any(|w| w.contains("upper")), "{c}: {a:?}");
        }
        assert!(inner_command("xen", &o, 0).is_err());

        // On a root disk both get the disk cmdline, the image read-only first, then the
        // boot's own upper disk.
        let o = InnerOpts {
            root_disk: Some(RootDisk {
                image: "/guest/rootfs.img".into(),
                mkfs: "/bin/mkfs.ext4".into(),
                upper_mib: 8,
            }),
            ..o
        };
        let cmdline = format!("{GUEST_CMDLINE} quiet2 {DISK_ROOT_CMDLINE}");
        let ours = words("ours", &o);
        assert!(ours.contains(&cmdline), "{ours:?}");
        let i = ours
            .iter()
            .position(|w| w == "/guest/rootfs.img,ro")
            .unwrap();
        assert_eq!(ours[i + 2], "/tmp/upper-0.ext4,rw");
        let qemu = words("qemu", &o);
        assert!(qemu.contains(&cmdline), "{qemu:?}");
        let root = qemu
            .iter()
            .position(|w| w.ends_with("readonly=on,file=/guest/rootfs.img"))
            .unwrap();
        let upper = qemu
            .iter()
            .position(|w| w.ends_with("file=/tmp/upper-0.ext4"))
            .unwrap();
        assert!(root < upper, "{qemu:?}");

        // Firecracker reads all of it from its config file, written before the spawn.
        let fc = words(FIRECRACKER, &o);
        assert_eq!(
            fc[..3],
            ["--no-api", "--config-file", "/tmp/firecracker-0.json"]
        );
        let config = firecracker_config(&o, 0);
        assert_eq!(config["boot-source"]["kernel_image_path"], "/guest/vmlinux");
        assert_eq!(
            config["boot-source"]["initrd_path"],
            "/guest/initramfs.cpio"
        );
        assert_eq!(config["boot-source"]["boot_args"], cmdline.as_str());
        assert_eq!(config["machine-config"]["mem_size_mib"], 256);
        assert_eq!(config["machine-config"]["vcpu_count"], 1);
        assert_eq!(config["vsock"]["guest_cid"], 3);
        assert_eq!(config["drives"][0]["path_on_host"], "/guest/rootfs.img");
        assert_eq!(config["drives"][0]["is_read_only"], true);
        assert_eq!(config["drives"][1]["path_on_host"], "/tmp/upper-0.ext4");
    }

    #[test]
    fn upper_disks_are_made_like_the_edge_makes_them() {
        let Some(mkfs) = host_mkfs() else {
            panic!("mke2fs missing: apt-get install e2fsprogs");
        };
        let dir = std::env::temp_dir().join(format!("dsec-perf-upper-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let root = RootDisk {
            image: "/x".into(),
            mkfs,
            upper_mib: 16,
        };
        let path = upper_path(&dir, 1);
        make_upper(&root, &path).unwrap();
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!(meta.len(), 16 << 20);
        // ext4 superblock magic at 1024 + 56.
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[1080..1082], &[0x53, 0xef]);
        let bad = RootDisk {
            mkfs: "/nonexistent/mkfs".into(),
            ..root
        };
        assert!(make_upper(&bad, &path)
            .unwrap_err()
            .contains("/nonexistent/mkfs"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn scenario_scripts_put_settings_above_the_template() {
        let dir = std::env::temp_dir().join(format!("dsec-perf-script-{}", std::process::id()));
        let script = write_script(
            &dir,
            "s.sh",
            &[("PERF_SAMPLES", "3".into()), ("PERF_MEM_MIB", "128".into())],
            "#!/bin/sh\n: \"${PERF_SAMPLES:=1}\"\necho $PERF_SAMPLES\n",
        )
        .unwrap();
        let text = std::fs::read_to_string(&script).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(
            text,
            "#!/bin/sh\nPERF_SAMPLES=3\nPERF_MEM_MIB=128\n: \"${PERF_SAMPLES:=1}\"\necho $PERF_SAMPLES\n"
        );
        let missing = scenario_inputs(
            &Ok(PathBuf::from("/nonexistent/vmlinux")),
            &Some(PathBuf::from("/etc/hostname")),
            &[],
        )
        .unwrap_err();
        assert!(
            missing.contains("guest kernel /nonexistent/vmlinux not found"),
            "{missing}"
        );
        let no_initramfs = scenario_inputs(&Ok(PathBuf::from("/etc/hostname")), &None, &[]);
        assert!(no_initramfs.unwrap_err().contains("mkinitramfs.sh"));
    }
}
