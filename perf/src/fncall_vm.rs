//! `dsec-perf fncall-vm`: the VMM FnCall mode through a running node (`dsec up`): a python
//! `print(1+1)` call in a microVM restored for it (restore -> result -> VM gone) beside the
//! same call in a container worker, `dsec run -- true` (a sandbox from the node's template)
//! and a cold microVM (create --cold, exec, rm), end to end from the client, contenders
//! alternating. Meant for the rig's L1 (tests/rig/tests/
//! fncall-vm.sh runs it); a node without hardware KVM refuses the VM calls.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use dsec_sdk::FnRunRequest;

use crate::report::{detail, metric, Contender, Sample, Scenario};

pub struct FnVmOpts {
    pub endpoint: String,
    pub vm_image: String,
    pub container_image: String,
    pub dsec: PathBuf,
    pub samples: usize,
    pub cold_samples: usize,
}

const CODE: &str = "print(1+1)";

fn request(image: &str) -> FnRunRequest {
    FnRunRequest {
        language: "python".into(),
        code: CODE.into(),
        image: image.into(),
        ..FnRunRequest::default()
    }
}

/// One call through the node: client wall time and the node's own total, or why it failed.
async fn one_call(
    client: &dsec_sdk::Client,
    image: &str,
) -> Result<BTreeMap<&'static str, f64>, String> {
    let started = Instant::now();
    let response = client
        .run_code(request(image))
        .await
        .map_err(|e| e.to_string())?;
    let wall = started.elapsed().as_secs_f64() * 1e3;
    let stdout = response
        .run
        .as_ref()
        .map(|r| String::from_utf8_lossy(&r.stdout).trim().to_string())
        .unwrap_or_default();
    if !response.success || stdout != "2" {
        return Err(format!(
            "call failed: success {}, stdout {stdout:?}",
            response.success
        ));
    }
    Ok(BTreeMap::from([
        ("call_ms", wall),
        ("node_total_ms", response.total_seconds * 1e3),
    ]))
}

/// Runs `dsec ARGS`; its trimmed stdout.
fn dsec_cli(dsec: &Path, args: &[&str]) -> Result<String, String> {
    let out = std::process::Command::new(dsec)
        .args(args)
        .stderr(std::process::Stdio::piped())
        .output()
        .map_err(|e| format!("run {}: {e}", dsec.display()))?;
    if !out.status.success() {
        return Err(format!(
            "dsec {} exited {}: {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// `dsec run --backend microvm -- true`: a sandbox from the node's template, its command, gone.
fn dsec_run(dsec: &Path) -> Result<BTreeMap<&'static str, f64>, String> {
    let started = Instant::now();
    dsec_cli(dsec, &["run", "--backend", "microvm", "--", "true"])?;
    Ok(BTreeMap::from([(
        "call_ms",
        started.elapsed().as_secs_f64() * 1e3,
    )]))
}

/// A booted microVM: `dsec create --cold`, `dsec exec ID -- true`, `dsec rm ID`.
fn cold_vm(dsec: &Path) -> Result<BTreeMap<&'static str, f64>, String> {
    let started = Instant::now();
    let id = dsec_cli(dsec, &["create", "--backend", "microvm", "--cold"])?;
    let ran = dsec_cli(dsec, &["exec", &id, "--", "true"]);
    let removed = dsec_cli(dsec, &["rm", &id]);
    ran?;
    removed?;
    Ok(BTreeMap::from([(
        "call_ms",
        started.elapsed().as_secs_f64() * 1e3,
    )]))
}

pub fn bench(o: &FnVmOpts) -> Result<Scenario, String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let client = runtime
        .block_on(dsec_sdk::Client::connect(&o.endpoint))
        .map_err(|e| format!("connect to the node at {}: {e}", o.endpoint))?;
    let contenders = vec![
        Contender {
            name: "vm".into(),
            description: format!(
                "Fn.Run image {}: a microVM restored per call, killed after it",
                o.vm_image
            ),
            command: format!("dsec fn run --image {} -c '{CODE}'", o.vm_image),
        },
        Contender {
            name: "container".into(),
            description: format!(
                "Fn.Run image {}: a container worker's zygote fork",
                o.container_image
            ),
            command: format!("dsec fn run --image {} -c '{CODE}'", o.container_image),
        },
        Contender {
            name: "dsec-run".into(),
            description: "dsec run --backend microvm -- true (the node's template restored)".into(),
            command: format!("{} run --backend microvm -- true", o.dsec.display()),
        },
        Contender {
            name: "cold-vm".into(),
            description: "dsec create --cold, exec true, rm (a booted microVM)".into(),
            command: format!(
                "{0} create --backend microvm --cold; {0} exec ID -- true; {0} rm ID",
                o.dsec.display()
            ),
        },
    ];
    // Not counted: the first call of each pool builds its template or starts its workers.
    for image in [&o.vm_image, &o.container_image] {
        if let Err(e) = runtime.block_on(one_call(&client, image)) {
            eprintln!("dsec-perf: warm-up call in {image} failed: {e}");
        }
    }
    let mut samples = Vec::new();
    let mut record =
        |contender: &str, index: usize, value: Result<BTreeMap<&'static str, f64>, String>| {
            samples.push(Sample::of(contender, index, value))
        };
    for i in 0..o.samples.max(o.cold_samples) {
        if i < o.samples {
            record("vm", i, runtime.block_on(one_call(&client, &o.vm_image)));
            record(
                "container",
                i,
                runtime.block_on(one_call(&client, &o.container_image)),
            );
        }
        if i < o.cold_samples {
            record("dsec-run", i, dsec_run(&o.dsec));
            record("cold-vm", i, cold_vm(&o.dsec));
        }
    }
    Ok(Scenario {
        name: "fncall-vm",
        title: format!("FnCall VM mode: python {CODE} end to end through the node"),
        method: "client wall time per call (SDK over the node's socket), contenders alternating; \
                 the first call of each pool (template build) not counted"
            .into(),
        metrics: vec![
            metric("call_ms", "call, client wall time", "ms"),
            detail("node_total_ms", "call, the node's total", "ms"),
        ],
        contenders,
        comparisons: vec![
            ("vm".into(), "container".into()),
            ("vm".into(), "dsec-run".into()),
            ("vm".into(), "cold-vm".into()),
        ],
        samples,
        skipped: None,
        notes: vec![],
    })
}
