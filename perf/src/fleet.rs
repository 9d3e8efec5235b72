//! Many VMM processes at once (forked children, idle VMs), started without waiting for each
//! other, measured, and always stopped: every process is SIGKILLed and reaped on drop
//! (errors and panics included), and the kernel SIGKILLs it should the harness itself die
//! (PR_SET_PDEATHSIG), so no VMM outlives a run.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::run::realtime_ns;

/// One VMM process of a fleet.
#[derive(Debug)]
pub struct Member {
    pub name: String,
    pub child: Child,
    /// CLOCK_REALTIME ns just before its spawn.
    pub spawn_realtime_ns: u64,
    pub metrics_path: PathBuf,
    pub stderr_path: PathBuf,
    /// Exists once the member is ready (its control socket, or a console log to grep).
    pub ready: Ready,
    pub status: Option<ExitStatus>,
}

#[derive(Debug, Clone)]
pub enum Ready {
    /// The path exists (e.g. the control socket, bound once the vCPUs are started).
    Path(PathBuf),
    /// The file contains this line (e.g. the guest's READY on its serial log).
    LineIn(PathBuf, String),
}

impl Ready {
    fn is_ready(&self) -> bool {
        match self {
            Ready::Path(p) => p.exists(),
            Ready::LineIn(p, line) => std::fs::read(p)
                .map(|b| {
                    String::from_utf8_lossy(&b)
                        .lines()
                        .any(|l| l.trim() == line)
                })
                .unwrap_or(false),
        }
    }
}

/// VMM processes that are killed and reaped when dropped.
#[derive(Debug, Default)]
pub struct Fleet {
    pub members: Vec<Member>,
}

impl Fleet {
    /// Starts one more process (never waits for it); `args` should include its
    /// `--metrics-json metrics_path`.
    pub fn spawn(
        &mut self,
        name: String,
        program: &Path,
        args: &[OsString],
        metrics_path: PathBuf,
        stderr_path: PathBuf,
        ready: Ready,
    ) -> std::io::Result<()> {
        let stderr = File::create(&stderr_path)?;
        let mut cmd = Command::new(program);
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(stderr));
        // SAFETY: prctl is async-signal-safe; it only sets this (child) process's
        // parent-death signal between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let spawn_realtime_ns = realtime_ns();
        let child = cmd.spawn()?;
        self.members.push(Member {
            name,
            child,
            spawn_realtime_ns,
            metrics_path,
            stderr_path,
            ready,
            status: None,
        });
        Ok(())
    }

    /// Waits until every member is ready; names of those not ready by the deadline
    /// (or already exited) with a reason.
    pub fn wait_ready(&mut self, timeout: Duration) -> Vec<(String, String)> {
        let deadline = Instant::now() + timeout;
        let mut pending: Vec<usize> = (0..self.members.len()).collect();
        while !pending.is_empty() && Instant::now() < deadline {
            pending.retain(|&i| !self.members[i].ready.is_ready());
            let mut exited = Vec::new();
            for &i in &pending {
                if let Ok(Some(st)) = self.members[i].child.try_wait() {
                    self.members[i].status = Some(st);
                    exited.push(i);
                }
            }
            if !exited.is_empty() {
                return exited
                    .into_iter()
                    .map(|i| {
                        (
                            self.members[i].name.clone(),
                            format!("exited early: {:?}", self.members[i].status),
                        )
                    })
                    .collect();
            }
            std::thread::sleep(Duration::from_micros(500));
        }
        pending
            .into_iter()
            .map(|i| {
                (
                    self.members[i].name.clone(),
                    format!("not ready after {timeout:?}"),
                )
            })
            .collect()
    }

    pub fn pids(&self) -> Vec<u32> {
        self.members.iter().map(|m| m.child.id()).collect()
    }

    /// SIGTERM to every member (a clean stop: the VMM writes its metrics), then waits for
    /// all; whoever is still there after `grace` gets SIGKILL.
    pub fn terminate(&mut self, grace: Duration) {
        for m in self.members.iter().filter(|m| m.status.is_none()) {
            // SAFETY: our own unreaped child.
            unsafe { libc::kill(m.child.id() as libc::pid_t, libc::SIGTERM) };
        }
        let deadline = Instant::now() + grace;
        for m in &mut self.members {
            while m.status.is_none() {
                match m.child.try_wait() {
                    Ok(Some(st)) => m.status = Some(st),
                    Ok(None) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(1))
                    }
                    _ => {
                        let _ = m.child.kill();
                        m.status = m.child.wait().ok();
                        break;
                    }
                }
            }
        }
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for m in &mut self.members {
            if m.status.is_none() {
                let _ = m.child.kill();
                m.status = m.child.wait().ok();
            }
        }
    }
}

/// Milestones from a `dsec-vmm --metrics-json` file, as ms after `spawn_realtime_ns`:
/// `spawn_to_vmm_main_ms`, `spawn_to_vm_ready_ms`, `spawn_to_first_kvm_run_ms`, plus
/// `main_to_vm_ready_ms` and `vm_ready_to_first_kvm_run_ms` (where the time goes).
pub fn vmm_milestones(
    metrics_json: &str,
    spawn_realtime_ns: u64,
) -> Result<BTreeMap<&'static str, f64>, String> {
    let m: serde_json::Value =
        serde_json::from_str(metrics_json).map_err(|e| format!("bad metrics JSON: {e}"))?;
    let get = |k: &str| m.get(k).and_then(|v| v.as_u64()).unwrap_or(0);
    let (main, ready, run) = (
        get("process_start_ns"),
        get("vm_ready_ns"),
        get("first_kvm_run_ns"),
    );
    let mut v = BTreeMap::new();
    let after = crate::direct::ns_after;
    for (key, t) in [
        ("spawn_to_vmm_main_ms", main),
        ("spawn_to_vm_ready_ms", ready),
        ("spawn_to_first_kvm_run_ms", run),
    ] {
        match after(t, spawn_realtime_ns) {
            Some(ms) => {
                v.insert(key, ms);
            }
            None => return Err(format!("metrics lack a valid {key} (value {t})")),
        }
    }
    if let Some(ms) = after(ready, main) {
        v.insert("main_to_vm_ready_ms", ms);
    }
    if let Some(ms) = after(run, ready) {
        v.insert("vm_ready_to_first_kvm_run_ms", ms);
    }
    Ok(v)
}

/// Memory of one process from `/proc/PID/smaps_rollup`, in KiB.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Mem {
    pub rss_kib: u64,
    pub pss_kib: u64,
    pub pss_anon_kib: u64,
    pub pss_file_kib: u64,
}

pub fn parse_smaps_rollup(text: &str) -> Mem {
    let mut m = Mem::default();
    for line in text.lines() {
        let mut it = line.split_whitespace();
        let (Some(k), Some(v)) = (it.next(), it.next()) else {
            continue;
        };
        let Ok(v) = v.parse::<u64>() else { continue };
        match k {
            "Rss:" => m.rss_kib = v,
            "Pss:" => m.pss_kib = v,
            "Pss_Anon:" => m.pss_anon_kib = v,
            "Pss_File:" => m.pss_file_kib = v,
            _ => {}
        }
    }
    m
}

pub fn smaps_rollup(pid: u32) -> std::io::Result<Mem> {
    std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).map(|s| parse_smaps_rollup(&s))
}

/// `MemAvailable` from /proc/meminfo-formatted text, in KiB.
pub fn parse_mem_available(meminfo: &str) -> Option<u64> {
    meminfo
        .lines()
        .find(|l| l.starts_with("MemAvailable:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

/// The host's MemAvailable now, in KiB (catches kernel memory PSS does not show: KVM's
/// per-VM structures, page tables; but also whatever else the machine is doing).
pub fn mem_available_kib() -> Option<u64> {
    parse_mem_available(&std::fs::read_to_string("/proc/meminfo").ok()?)
}

/// Sum over `pids`; an error names the first process that could not be read.
pub fn total_mem(pids: &[u32]) -> Result<Mem, String> {
    let mut t = Mem::default();
    for &pid in pids {
        let m = smaps_rollup(pid).map_err(|e| format!("/proc/{pid}/smaps_rollup: {e}"))?;
        t.rss_kib += m.rss_kib;
        t.pss_kib += m.pss_kib;
        t.pss_anon_kib += m.pss_anon_kib;
        t.pss_file_kib += m.pss_file_kib;
    }
    Ok(t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn milestones_from_metrics() {
        let j = r#"{"exit_reason":"stopped","vm_exits":3,"process_start_ns":1001000000,
                    "vm_ready_ns":1003500000,"first_kvm_run_ns":1004000000}"#;
        let v = vmm_milestones(j, 1_000_000_000).unwrap();
        assert_eq!(v["spawn_to_vmm_main_ms"], 1.0);
        assert_eq!(v["spawn_to_vm_ready_ms"], 3.5);
        assert_eq!(v["spawn_to_first_kvm_run_ms"], 4.0);
        assert_eq!(v["main_to_vm_ready_ms"], 2.5);
        assert_eq!(v["vm_ready_to_first_kvm_run_ms"], 0.5);
        // never ran a vCPU: first_kvm_run_ns is 0
        let j = r#"{"process_start_ns":1001000000,"vm_ready_ns":1003500000,"first_kvm_run_ns":0}"#;
        assert!(vmm_milestones(j, 1_000_000_000)
            .unwrap_err()
            .contains("first_kvm_run"));
        assert!(vmm_milestones("{", 0).is_err());
    }

    #[test]
    fn smaps_rollup_fields() {
        let t = "00400000-7fff ---p 00000000 00:00 0   [rollup]\nRss:               11396 kB\n\
                 Pss:                6133 kB\nPss_Dirty:          2000 kB\nPss_Anon:           2100 kB\n\
                 Pss_File:           4033 kB\nPss_Shmem:             0 kB\n";
        assert_eq!(
            parse_smaps_rollup(t),
            Mem {
                rss_kib: 11396,
                pss_kib: 6133,
                pss_anon_kib: 2100,
                pss_file_kib: 4033
            }
        );
        let own = smaps_rollup(std::process::id()).unwrap();
        assert!(own.pss_kib > 0 && own.rss_kib >= own.pss_kib);
    }

    #[test]
    fn mem_available_from_meminfo() {
        let t = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   12345678 kB\n";
        assert_eq!(parse_mem_available(t), Some(12_345_678));
        assert_eq!(parse_mem_available("MemTotal: 1 kB\n"), None);
        assert!(mem_available_kib().unwrap() > 0);
    }

    #[test]
    fn fleet_stops_everyone_on_drop_and_terminate() {
        let dir = std::env::temp_dir().join(format!("dsec-perf-fleet-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let sh = Path::new("/bin/sh");
        let pids = {
            let mut f = Fleet::default();
            for i in 0..3 {
                let up = dir.join(format!("up{i}"));
                let script = format!("touch {}; exec sleep 60", up.display());
                f.spawn(
                    format!("m{i}"),
                    sh,
                    &["-c".into(), script.into()],
                    dir.join("m.json"),
                    dir.join(format!("m{i}.err")),
                    Ready::Path(up),
                )
                .unwrap();
            }
            assert!(f.wait_ready(Duration::from_secs(10)).is_empty());
            let pids = f.pids();
            assert!(total_mem(&pids).unwrap().pss_kib > 0);
            pids
            // dropped here without terminate(): killed and reaped
        };
        for pid in &pids {
            assert!(
                !Path::new(&format!("/proc/{pid}")).exists(),
                "{pid} survived"
            );
        }
        let mut f = Fleet::default();
        let log = dir.join("log");
        let script = format!(
            "echo hi > {0}; echo READY >> {0}; exec sleep 60",
            log.display()
        );
        f.spawn(
            "x".into(),
            sh,
            &["-c".into(), script.into()],
            dir.join("x.json"),
            dir.join("x.err"),
            Ready::LineIn(log, "READY".into()),
        )
        .unwrap();
        assert!(f.wait_ready(Duration::from_secs(10)).is_empty());
        let t = Instant::now();
        f.terminate(Duration::from_secs(5));
        assert!(t.elapsed() < Duration::from_secs(4));
        assert!(f.members[0].status.is_some());
        // a member that exits early is reported, not waited for
        let mut f = Fleet::default();
        f.spawn(
            "early".into(),
            sh,
            &["-c".into(), "exit 3".into()],
            dir.join("e.json"),
            dir.join("e.err"),
            Ready::Path(dir.join("never")),
        )
        .unwrap();
        let bad = f.wait_ready(Duration::from_secs(10));
        assert_eq!(bad.len(), 1);
        assert!(bad[0].1.contains("exited early"), "{bad:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
