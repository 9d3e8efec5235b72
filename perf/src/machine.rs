//! What machine the figures were taken on.

use std::path::Path;
use std::process::Command;

use serde_json::{json, Value};

/// Which KVM `/dev/kvm` is: the software PVM hypervisor, hardware VMX/SVM, or none.
pub fn kvm_kind() -> &'static str {
    kvm_kind_in(Path::new("/sys/module"), Path::new("/dev/kvm"))
}

fn kvm_kind_in(modules: &Path, dev: &Path) -> &'static str {
    if !dev.exists() {
        "none"
    } else if modules.join("kvm_pvm").exists() {
        "pvm"
    } else if modules.join("kvm_intel").exists() || modules.join("kvm_amd").exists() {
        "hardware"
    } else {
        "unknown"
    }
}

pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

fn first_line(path: &str) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.lines().next().unwrap_or("").trim().to_string())
}

/// First line of `PROGRAM --version`, if it runs.
pub fn program_version(program: &Path) -> Option<String> {
    let out = Command::new(program).arg("--version").output().ok()?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .next()
        .map(|l| l.trim().to_string())
}

pub fn info(qemu: &Path) -> Value {
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let mem_kib = std::fs::read_to_string("/proc/meminfo").ok().and_then(|s| {
        s.lines()
            .find(|l| l.starts_with("MemTotal:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
    });
    json!({
        "kvm_kind": kvm_kind(),
        "cpu_model": cpu_model(),
        "cpus": cpus,
        "mem_total_mib": mem_kib.map(|k| k / 1024),
        "host_kernel": first_line("/proc/sys/kernel/osrelease"),
        "qemu_version": program_version(qemu),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kvm_kind_from_modules() {
        let d = std::env::temp_dir().join(format!("dsec-perf-kvm-{}", std::process::id()));
        let modules = d.join("module");
        let dev = d.join("kvm");
        std::fs::create_dir_all(&modules).unwrap();
        assert_eq!(kvm_kind_in(&modules, &dev), "none");
        std::fs::write(&dev, b"").unwrap();
        assert_eq!(kvm_kind_in(&modules, &dev), "unknown");
        std::fs::create_dir_all(modules.join("kvm_amd")).unwrap();
        assert_eq!(kvm_kind_in(&modules, &dev), "hardware");
        std::fs::create_dir_all(modules.join("kvm_pvm")).unwrap();
        assert_eq!(kvm_kind_in(&modules, &dev), "pvm");
        std::fs::remove_dir_all(&d).unwrap();
    }
}
