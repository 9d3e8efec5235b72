//! `dsec-perf templates`: microVM creates through a running node (`dsec up`), as an SDK user
//! sees them: one client, one connection, create -> first exec `true` for a sandbox restored
//! from the image's template beside a `cold` one that boots its kernel, and pause -> resume ->
//! first exec of one sandbox, contenders alternating. Meant for the rig's L1
//! (tests/rig/tests/node-templates.sh runs it); a node without hardware KVM refuses microVMs.

use std::collections::BTreeMap;
use std::time::Instant;

use dsec_sdk::{Backend, Client, CreateSandboxRequest};

use crate::direct::ms;
use crate::report::{detail, goal, metric, Bound, Contender, Sample, Scenario};
use crate::stats::ratio;

/// Issue goals: a template create at most 0.2x a cold one, a resume at most 0.3x.
pub const GOAL_TEMPLATE_OVER_COLD: f64 = 0.2;
pub const GOAL_RESUME_OVER_COLD: f64 = 0.3;

pub struct TemplateOpts {
    pub endpoint: String,
    pub samples: usize,
    pub memory_mib: i64,
}

type Values = BTreeMap<&'static str, f64>;

fn request(o: &TemplateOpts, cold: bool) -> CreateSandboxRequest {
    CreateSandboxRequest {
        backend: Backend::Microvm as i32,
        memory_mib: o.memory_mib,
        cold,
        labels: [("dsec-perf".to_string(), "templates".to_string())]
            .into_iter()
            .collect(),
        ..Default::default()
    }
}

/// `true` in `id`; an error unless it ran and exited 0.
async fn exec_true(client: &Client, id: &str) -> Result<(), String> {
    let out = client
        .exec(id, &["true"], None)
        .await
        .map_err(|e| format!("exec true in {id}: {e}"))?;
    match out.exit_code() {
        0 => Ok(()),
        code => Err(format!("`true` in {id} exited {code}")),
    }
}

/// Create -> first exec (timed), then delete (not timed).
async fn create_exec(client: &Client, o: &TemplateOpts, cold: bool) -> Result<Values, String> {
    let t0 = Instant::now();
    let sandbox = client
        .create(request(o, cold))
        .await
        .map_err(|e| format!("create (cold {cold}): {e}"))?;
    let created = ms(t0.elapsed());
    let ran = exec_true(client, &sandbox.id).await;
    let total = ms(t0.elapsed());
    let deleted = client.delete(&sandbox.id).await;
    ran?;
    deleted.map_err(|e| format!("delete {}: {e}", sandbox.id))?;
    Ok(Values::from([
        ("to_first_exec_ms", total),
        ("start_ms", created),
        ("first_exec_ms", total - created),
    ]))
}

/// Pause (not timed: it writes the snapshot and ends the VMM), then resume -> first exec.
async fn pause_resume_exec(client: &Client, id: &str) -> Result<Values, String> {
    client
        .pause(id)
        .await
        .map_err(|e| format!("pause {id}: {e}"))?;
    let t0 = Instant::now();
    client
        .resume(id)
        .await
        .map_err(|e| format!("resume {id}: {e}"))?;
    let resumed = ms(t0.elapsed());
    exec_true(client, id).await?;
    let total = ms(t0.elapsed());
    Ok(Values::from([
        ("to_first_exec_ms", total),
        ("start_ms", resumed),
        ("first_exec_ms", total - resumed),
    ]))
}

pub fn bench(o: &TemplateOpts) -> Result<Scenario, String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let client = runtime
        .block_on(Client::connect(&o.endpoint))
        .map_err(|e| format!("connect to the node at {}: {e}", o.endpoint))?;
    // Not counted: the first create builds the template if the node has none yet.
    runtime.block_on(create_exec(&client, o, false))?;
    let resumed = runtime
        .block_on(client.create(request(o, false)))
        .map_err(|e| format!("create the sandbox to pause: {e}"))?;
    let mut samples = Vec::new();
    let mut record = |contender: &str, index: usize, value: Result<Values, String>| {
        samples.push(Sample::of(contender, index, value))
    };
    for i in 0..o.samples {
        record("cold", i, runtime.block_on(create_exec(&client, o, true)));
        record(
            "template",
            i,
            runtime.block_on(create_exec(&client, o, false)),
        );
        record(
            "resume",
            i,
            runtime.block_on(pause_resume_exec(&client, &resumed.id)),
        );
    }
    if let Err(e) = runtime.block_on(client.delete(&resumed.id)) {
        eprintln!("dsec-perf: delete {}: {e}", resumed.id);
    }
    let mut scenario = Scenario {
        name: "templates",
        title: format!(
            "microVM create -> first exec through the node, {} MiB guest",
            o.memory_mib
        ),
        method: "client wall time (one SDK client, one connection to the node), contenders \
                 alternating; a warm-up template create not counted; resume = one sandbox \
                 paused (snapshot to disk, VMM ended, not timed) then resumed"
            .into(),
        metrics: vec![
            metric(
                "to_first_exec_ms",
                "create (resume) -> first exec done",
                "ms",
            ),
            detail("start_ms", "create (resume) call", "ms"),
            detail("first_exec_ms", "first exec", "ms"),
        ],
        contenders: vec![
            Contender {
                name: "template".into(),
                description: "Create: the image's template snapshot restored".into(),
                command: "client.create(backend=microvm); client.exec(id, true)".into(),
            },
            Contender {
                name: "cold".into(),
                description: "Create with cold=true: the guest kernel booted".into(),
                command: "client.create(backend=microvm, cold=true); client.exec(id, true)".into(),
            },
            Contender {
                name: "resume".into(),
                description: "Resume of a paused sandbox (its snapshot on disk)".into(),
                command: "client.pause(id) (untimed); client.resume(id); client.exec(id, true)"
                    .into(),
            },
        ],
        comparisons: vec![
            ("template".into(), "cold".into()),
            ("resume".into(), "cold".into()),
        ],
        samples,
        skipped: None,
        notes: vec![],
    };
    let p50 = |name: &str| scenario.summary(name, "to_first_exec_ms").map(|s| s.p50);
    let notes = vec![
        goal(
            "template / cold, create -> first exec p50",
            ratio(p50("template"), p50("cold")),
            Bound::AtMost,
            GOAL_TEMPLATE_OVER_COLD,
            "x",
        ),
        goal(
            "resume / cold, -> first exec p50",
            ratio(p50("resume"), p50("cold")),
            Bound::AtMost,
            GOAL_RESUME_OVER_COLD,
            "x",
        ),
    ];
    scenario.notes = notes;
    Ok(scenario)
}
