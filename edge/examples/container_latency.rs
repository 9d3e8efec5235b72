//! Container-path latency on this host: sandbox create (to agent ready), exec round trip of
//! `true` in a warm sandbox, destroy. Uses $DSEC_HOME's busybox rootfs and the dsec-agent
//! next to this binary.
//!
//! `cargo run --release -p dsec-edge --example container_latency [ROUNDS]`

use std::time::{Duration, Instant};

use dsec_edge::{BackendKind, EdgeConfig, ExecSpec, Sandbox, SandboxSpec};

fn percentile(samples: &mut [Duration], p: f64) -> Duration {
    samples.sort();
    let index = ((samples.len() as f64 - 1.0) * p).round() as usize;
    samples[index]
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let rounds: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(20);
    let config = EdgeConfig::default();
    let spec = SandboxSpec::default();
    let (mut create, mut exec, mut destroy) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        let started = Instant::now();
        let sandbox = Sandbox::create(BackendKind::Container, &config, &spec).await?;
        create.push(started.elapsed());
        for _ in 0..10 {
            let started = Instant::now();
            let out = sandbox
                .agent()
                .exec_collect(&ExecSpec::new(["true"]), None)
                .await?;
            exec.push(started.elapsed());
            assert_eq!(out.outcome.code, Some(0));
        }
        let started = Instant::now();
        sandbox.destroy().await?;
        destroy.push(started.elapsed());
    }
    for (name, samples) in [
        ("create", &mut create),
        ("exec true", &mut exec),
        ("destroy", &mut destroy),
    ] {
        println!(
            "{name:10} n={:4} p50 {}  p90 {}",
            samples.len(),
            ms(percentile(samples, 0.5)),
            ms(percentile(samples, 0.9))
        );
    }
    Ok(())
}
