//! `dsec-perf node` end to end with tiny sample counts: a real dsec-edge (built here, debug)
//! on the installed busybox rootfs, so CI notices when the harness breaks. Needs root and
//! `$DSEC_HOME/images/busybox/rootfs` (./setup.sh installs it).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::Value;

fn perf() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_dsec-perf"))
}

/// Builds the daemon and the agent next to dsec-perf (a no-op when fresh).
fn edge() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let status = Command::new(env!("CARGO"))
        .args(["build", "-q", "-p", "dsec-edge", "-p", "dsec-agent"])
        .current_dir(root)
        .status()
        .expect("run cargo build -p dsec-edge -p dsec-agent");
    assert!(
        status.success(),
        "cargo build -p dsec-edge -p dsec-agent failed"
    );
    perf().with_file_name("dsec-edge")
}

#[test]
fn node_scenario_runs_with_tiny_counts() {
    // SAFETY: geteuid has no arguments and cannot fail.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "run as root: the node benchmark starts dsec-edge (namespaces, cgroups)"
    );
    let edge = edge();
    let json =
        std::env::temp_dir().join(format!("dsec-perf-node-smoke-{}.json", std::process::id()));
    let child = Command::new(perf())
        .arg("node")
        .arg("--edge")
        .arg(&edge)
        .args(["--samples", "2", "--warmup", "1", "--burst", "5"])
        .args(["--burst-rounds", "1", "--exec-samples", "5", "--json"])
        .arg(&json)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run dsec-perf node");
    let pid = child.id();
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "dsec-perf node failed: {stderr}\n{stdout}"
    );
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    std::fs::remove_file(&json).unwrap();

    assert_eq!(doc["scenario"], "node");
    assert_eq!(doc["backends"]["container"]["ran"], true);
    if doc["machine"]["kvm_kind"] == "pvm" {
        assert_eq!(doc["backends"]["microvm"]["ran"], false);
        assert!(doc["backends"]["microvm"]["skipped"]
            .as_str()
            .unwrap()
            .contains("PVM"));
    }
    let c = &doc["create"]["contenders"]["container"];
    assert_eq!(c["ok"], 2, "{c}");
    assert_eq!(c["failed"], 0, "{c}");
    assert!(c["metrics"]["first_exec_ms"]["p99"].as_f64().unwrap() > 0.0);
    for base in ["unshare", "bwrap"] {
        let b = &doc["create"]["contenders"][base];
        assert_eq!(b["ok"], 2, "baseline {base}: {b}");
    }
    let ratios = doc["create"]["ratios"].as_array().unwrap();
    assert_eq!(ratios.len(), 2, "{ratios:?}");

    let rounds: Vec<&Value> = doc["burst"]["samples"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["values"].get("burst_created").is_some())
        .collect();
    assert_eq!(rounds.len(), 1);
    let r = rounds[0];
    assert!(r["error"].is_null(), "{r}");
    assert_eq!(r["values"]["burst_created"], 5.0);
    assert_eq!(r["values"]["burst_checked"], 5.0);
    assert_eq!(r["values"]["leftovers"], 0.0);
    assert!(r["values"]["creates_per_s"].as_f64().unwrap() > 0.0);
    assert_eq!(doc["exec"]["contenders"]["container"]["ok"], 5);
    assert!(stdout.contains("goal container exec round trip p50 < 2 ms"));
    assert!(stdout.contains("goal container creations/s"));

    // Nothing of the run is left: scratch dir, the daemon's cgroups.
    for parent in [PathBuf::from("/run"), std::env::temp_dir()] {
        let scratch = parent.join(format!("dsec-perf-node-{pid}"));
        assert!(!scratch.exists(), "{} left", scratch.display());
    }
    let cg = format!("dsec-perf-{pid}");
    for h in std::fs::read_dir("/sys/fs/cgroup").unwrap().flatten() {
        let found = Command::new("find")
            .arg(h.path())
            .args(["-maxdepth", "6", "-name", &cg])
            .output()
            .unwrap();
        assert!(
            found.stdout.is_empty(),
            "cgroup left: {}",
            String::from_utf8_lossy(&found.stdout)
        );
    }
}

#[test]
fn bad_inputs_are_named() {
    let out = Command::new(perf())
        .args(["node", "--backends", "docker"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unknown backend \"docker\""), "{err}");

    let out = Command::new(perf())
        .args(["node", "--edge", "/nonexistent/dsec-edge"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    // As root the missing daemon is named; otherwise the missing privilege.
    assert!(
        err.contains("--edge") || err.contains("needs root"),
        "{err}"
    );
}
