//! Commands that drive a running node daemon through the Rust SDK (`dsec up` starts one).

use std::collections::HashMap;
use std::io::Write;

use dsec_sdk::{Client, CreateSandboxRequest, ExecStart, Sandbox};
use serde_json::json;

/// Errors of node commands.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error(transparent)]
    Sdk(#[from] dsec_sdk::Error),
    #[error("{0}")]
    Usage(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

fn state(s: &Sandbox) -> &'static str {
    match s.state {
        2 => "running",
        3 => "paused",
        1 => "creating",
        4 => "stopping",
        5 => "dead",
        6 => "lost",
        _ => "unknown",
    }
}

fn backend(s: &Sandbox) -> &'static str {
    match s.backend {
        1 => "container",
        2 => "microvm",
        _ => "unspecified",
    }
}

pub fn sandbox_json(s: &Sandbox) -> serde_json::Value {
    let usage = s.usage.unwrap_or_default();
    json!({
        "id": s.id, "backend": backend(s), "image": s.image, "state": state(s),
        "vcpus": s.vcpus, "memory_mib": s.memory_mib, "disk_mib": s.disk_mib,
        "pids_limit": s.pids_limit, "labels": s.labels, "created_at_unix_ms": s.created_at_unix_ms,
        "expires_at_unix_ms": s.expires_at_unix_ms, "idle_timeout_seconds": s.idle_timeout_seconds,
        "pid": s.pid, "parent_id": s.parent_id, "memory_limit_bytes": s.memory_limit_bytes,
        "request_id": s.request_id, "public_ports": s.public_ports,
        // Only in replies about one sandbox (inspect, create --json), never in ls.
        "access_token": s.access_token,
        "death_reason": s.death_reason, "died_at_unix_ms": s.died_at_unix_ms,
        "usage": {"memory_bytes": usage.memory_bytes, "cpu_usage_ns": usage.cpu_usage_ns, "pids": usage.pids},
    })
}

fn print_table(list: &[Sandbox]) {
    println!(
        "{:<16} {:<10} {:<8} {:<8} {:>5} {:>8} {:>9} {:>5}  LABELS",
        "ID", "BACKEND", "IMAGE", "STATE", "VCPU", "MEM MiB", "USED MiB", "PIDS"
    );
    for s in list {
        let u = s.usage.unwrap_or_default();
        let mut labels: Vec<String> = s.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
        labels.sort();
        println!(
            "{:<16} {:<10} {:<8} {:<8} {:>5} {:>8} {:>9} {:>5}  {}",
            s.id,
            backend(s),
            s.image,
            state(s),
            s.vcpus,
            s.memory_mib,
            u.memory_bytes >> 20,
            u.pids,
            labels.join(",")
        );
    }
}

pub fn emit(json_out: bool, value: serde_json::Value, text: impl FnOnce()) {
    if json_out {
        println!("{value}");
    } else {
        text();
    }
}

pub fn parse_labels(pairs: &[String]) -> Result<HashMap<String, String>, NodeError> {
    pairs
        .iter()
        .map(|p| match p.split_once('=') {
            Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
            _ => Err(NodeError::Usage(format!(
                "bad label/env {p:?}: expected KEY=VALUE"
            ))),
        })
        .collect()
}

/// What every new sandbox gets besides its image and shape (`dsec create`, `dsec restore`).
#[derive(clap::Args, Clone, Debug)]
pub struct NewSandboxArgs {
    /// Seconds until the node deletes it.
    #[arg(long, default_value_t = 0)]
    pub ttl: i64,
    #[arg(long, default_value_t = 0)]
    pub idle_timeout: i64,
    #[arg(long = "env", short = 'e', value_name = "K=V")]
    pub env: Vec<String>,
    #[arg(long = "label", short = 'l', value_name = "K=V")]
    pub labels: Vec<String>,
    /// How many sandboxes (made concurrently).
    #[arg(long, short = 'n', default_value_t = 1)]
    pub count: usize,
    /// A port open to everyone through the HTTP entry point, without the sandbox's access
    /// token (repeatable; see `dsec port-public`).
    #[arg(long = "public-port", value_name = "PORT")]
    pub public_ports: Vec<u32>,
    #[command(flatten)]
    pub network: crate::net::CreatePolicyArgs,
}

pub struct CreateOpts {
    pub backend: String,
    pub image: String,
    pub vcpus: i32,
    pub memory_mib: i64,
    pub disk_mib: i64,
    pub sandbox: NewSandboxArgs,
    /// microVM: a real boot, not a template restore.
    pub cold: bool,
    /// Restore this snapshot directory (its image and shape) instead of creating afresh.
    pub from_snapshot: String,
}

pub async fn create(c: &Client, o: CreateOpts, json_out: bool) -> Result<(), NodeError> {
    let backend = match o.backend.as_str() {
        "auto" | "" => 0,
        "container" => 1,
        "microvm" => 2,
        other => {
            return Err(NodeError::Usage(format!(
                "--backend {other}: container, microvm or auto"
            )))
        }
    };
    let request = CreateSandboxRequest {
        backend,
        image: o.image,
        vcpus: o.vcpus,
        memory_mib: o.memory_mib,
        disk_mib: o.disk_mib,
        env: parse_labels(&o.sandbox.env)?,
        ttl_seconds: o.sandbox.ttl,
        idle_timeout_seconds: o.sandbox.idle_timeout,
        labels: parse_labels(&o.sandbox.labels)?,
        public_ports: o.sandbox.public_ports,
        cold: o.cold,
        from_snapshot: o.from_snapshot,
        network: o.sandbox.network.policy(),
        ..Default::default()
    };
    let mut tasks = Vec::new();
    for _ in 0..o.sandbox.count.max(1) {
        let (c, r) = (c.clone(), request.clone());
        tasks.push(tokio::spawn(async move { c.create(r).await }));
    }
    let total = tasks.len();
    let mut failures = 0;
    for (done, task) in tasks.into_iter().enumerate() {
        match task.await {
            Ok(Ok(s)) => emit(json_out, sandbox_json(&s), || println!("{}", s.id)),
            Ok(Err(e)) => {
                failures += 1;
                eprintln!("dsec: create failed: {e}");
            }
            Err(e) => {
                failures += 1;
                eprintln!("dsec: create task failed: {e}");
            }
        }
        if total > 1 && !json_out {
            eprint!("\r[{}/{total}] created", done + 1);
        }
    }
    if total > 1 && !json_out {
        eprintln!();
    }
    if failures > 0 {
        return Err(NodeError::Usage(format!(
            "{failures} of {total} creates failed"
        )));
    }
    Ok(())
}

pub async fn ls(c: &Client, labels: &[String], json_out: bool) -> Result<(), NodeError> {
    // The SDK pages through the node's List (by id); shown oldest first.
    let mut list = c.list(parse_labels(labels)?).await?;
    list.sort_by_key(|s| s.created_at_unix_ms);
    emit(
        json_out,
        json!(list.iter().map(sandbox_json).collect::<Vec<_>>()),
        || print_table(&list),
    );
    Ok(())
}

pub async fn inspect(c: &Client, id: &str) -> Result<(), NodeError> {
    let s = c.get(id).await?;
    println!(
        "{}",
        serde_json::to_string_pretty(&sandbox_json(&s)).unwrap_or_default()
    );
    Ok(())
}

pub async fn url(c: &Client, id: &str, port: u32, json_out: bool) -> Result<(), NodeError> {
    let u = c.port_url(id, port).await?;
    emit(
        json_out,
        json!({"url": u.url, "host": u.host, "address": u.address, "access_token": u.access_token}),
        || println!("{}", u.url),
    );
    Ok(())
}

/// `dsec port-public ID PORT [--private]`.
pub async fn port_public(
    c: &Client,
    id: &str,
    port: u32,
    public: bool,
    json_out: bool,
) -> Result<(), NodeError> {
    let ports = c.set_port_public(id, port, public).await?;
    emit(json_out, json!({"public_ports": ports}), || {
        let list: Vec<String> = ports.iter().map(u32::to_string).collect();
        println!(
            "port {port} of {id} is {}; public ports: {}",
            if public { "public" } else { "private" },
            if list.is_empty() {
                "none".to_string()
            } else {
                list.join(",")
            }
        )
    });
    Ok(())
}

/// `--listen`: HOST:PORT, or a bare PORT on 127.0.0.1.
fn listen_addr(listen: Option<&str>, port: u16) -> Result<std::net::SocketAddr, NodeError> {
    let text = listen
        .map(str::to_string)
        .unwrap_or_else(|| port.to_string());
    if let Ok(local) = text.parse::<u16>() {
        return Ok(std::net::SocketAddr::from(([127, 0, 0, 1], local)));
    }
    text.parse().map_err(|_| {
        NodeError::Usage(format!(
            "--listen {text:?}: expected HOST:PORT (127.0.0.1:8080) or a port number"
        ))
    })
}

/// Serves local connections, each piped to `port` in the sandbox, until Ctrl-C.
pub async fn port_forward(
    c: &Client,
    id: &str,
    port: u32,
    listen: Option<&str>,
) -> Result<i32, NodeError> {
    let sandbox_port = u16::try_from(port)
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| NodeError::Usage(format!("port {port} is not a TCP port: give 1-65535")))?;
    // Fail now, not at the first connection, on a wrong id.
    c.get(id).await?;
    let addr = listen_addr(listen, sandbox_port)?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| NodeError::Io {
            what: format!("cannot listen on {addr} (in use? pick another with --listen)"),
            source,
        })?;
    let local = listener.local_addr().unwrap_or(addr);
    println!("forwarding {local} -> {id}:{port} (Ctrl-C stops)");
    let _ = std::io::stdout().flush();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (socket, peer) = match accepted {
                    Ok(pair) => pair,
                    Err(err) => {
                        eprintln!("dsec: accept on {local} failed: {err}");
                        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let (c, id) = (c.clone(), id.to_string());
                tokio::spawn(async move {
                    let result = match c.open_port(&id, port).await {
                        Ok(stream) => stream.pipe(socket).await,
                        Err(err) => Err(err),
                    };
                    if let Err(err) = result {
                        eprintln!("dsec: connection from {peer}: {err}");
                    }
                });
            }
            _ = tokio::signal::ctrl_c() => return Ok(0),
        }
    }
}

/// How much of each stream `dsec --json exec` puts in its JSON document: the last 1 MiB
/// (`stdout_bytes` / `stderr_bytes` count everything, `truncated` says when bytes were left
/// out). Without `--json` all output is streamed and nothing is kept.
pub const JSON_OUTPUT_BYTES: usize = 1 << 20;

pub async fn exec(
    c: &Client,
    id: &str,
    argv: Vec<String>,
    json_out: bool,
) -> Result<i32, NodeError> {
    // Streamed as the command reads it (a blocking thread; the runtime is not waited for).
    let stdin = (!std::io::IsTerminal::is_terminal(&std::io::stdin())).then(tokio::io::stdin);
    let start = ExecStart {
        sandbox_id: id.into(),
        argv,
        ..Default::default()
    };
    let keep = if json_out { JSON_OUTPUT_BYTES } else { 0 };
    let out = c
        .exec_streaming(start, stdin, keep, |err, data| {
            if json_out {
                return;
            }
            let written = if err {
                std::io::stderr().write_all(data)
            } else {
                let mut stdout = std::io::stdout();
                stdout.write_all(data).and_then(|()| stdout.flush())
            };
            // Our reader went away (`dsec exec ID -- yes | head`): end as a shell would; the
            // node kills the command when the call drops.
            if matches!(&written, Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe) {
                std::process::exit(128 + libc::SIGPIPE);
            }
        })
        .await?;
    if json_out {
        println!(
            "{}",
            json!({
                "stdout": String::from_utf8_lossy(&out.stdout), "stderr": String::from_utf8_lossy(&out.stderr),
                "stdout_bytes": out.stdout_bytes, "stderr_bytes": out.stderr_bytes, "truncated": out.truncated(),
                "exit_code": out.code, "signal": out.signal, "timed_out": out.timed_out,
            })
        );
    }
    Ok(out.exit_code())
}

/// `dsec shell ID`: a persistent session fed line by line from stdin.
pub async fn shell(c: &Client, id: &str) -> Result<i32, NodeError> {
    let mut sessions = c.sessions();
    let session = sessions
        .create(dsec_sdk::CreateSessionRequest {
            sandbox_id: id.into(),
            ..Default::default()
        })
        .await
        .map_err(dsec_sdk::Error::from)?
        .into_inner();
    let mut line = String::new();
    loop {
        eprint!("{id}$ ");
        line.clear();
        if std::io::stdin()
            .read_line(&mut line)
            .map_err(|e| NodeError::Io {
                what: "read stdin".into(),
                source: e,
            })?
            == 0
        {
            break;
        }
        let r = sessions
            .run(dsec_sdk::RunInSessionRequest {
                sandbox_id: id.into(),
                session_id: session.session_id.clone(),
                command: line.clone(),
                wait: true,
                ..Default::default()
            })
            .await
            .map_err(dsec_sdk::Error::from)?
            .into_inner();
        let _ = std::io::stdout().write_all(&r.output);
        if r.session_ended {
            return Ok(r.exit_code.unwrap_or(0));
        }
    }
    let _ = sessions
        .close(dsec_sdk::CloseSessionRequest {
            sandbox_id: id.into(),
            session_id: session.session_id,
        })
        .await;
    Ok(0)
}

pub async fn logs(c: &Client, id: &str, follow: bool, json_out: bool) -> Result<(), NodeError> {
    c.logs(id, follow, |chunk| {
        if json_out {
            println!(
                "{}",
                json!({"source": chunk.source, "data": String::from_utf8_lossy(&chunk.data)})
            );
        } else {
            for line in String::from_utf8_lossy(&chunk.data).lines() {
                println!("[{}] {line}", chunk.source);
            }
        }
    })
    .await?;
    Ok(())
}

pub async fn lifecycle(
    c: &Client,
    op: &str,
    ids: &[String],
    json_out: bool,
) -> Result<(), NodeError> {
    for id in ids {
        match op {
            "rm" => {
                c.delete(id).await?;
                emit(json_out, json!({"deleted": id}), || println!("{id}"));
            }
            "pause" => {
                let s = c.pause(id).await?;
                emit(json_out, sandbox_json(&s), || println!("{id} paused"));
            }
            "resume" => {
                let s = c.resume(id).await?;
                emit(json_out, sandbox_json(&s), || println!("{id} running"));
            }
            _ => return Err(NodeError::Usage(format!("unknown operation {op}"))),
        }
    }
    Ok(())
}

pub async fn fork(c: &Client, id: &str, count: i32, json_out: bool) -> Result<(), NodeError> {
    let children = c.fork(id, count).await?;
    emit(
        json_out,
        json!(children.iter().map(sandbox_json).collect::<Vec<_>>()),
        || {
            for s in &children {
                println!("{}", s.id);
            }
        },
    );
    Ok(())
}

/// `dsec top`: node budgets and sandboxes by memory, refreshed every 2 s (`--once`: one frame).
pub async fn top(c: &Client, once: bool, json_out: bool) -> Result<(), NodeError> {
    loop {
        let status = c.node_status().await?;
        let mut list = c.list(HashMap::new()).await?;
        list.sort_by_key(|s| std::cmp::Reverse(s.usage.unwrap_or_default().memory_bytes));
        if json_out {
            println!(
                "{}",
                json!({
                    "sandboxes": list.iter().map(sandbox_json).collect::<Vec<_>>(),
                    "memory_mib": status.memory_mib.map(|b| json!({"limit": b.limit, "reserved": b.reserved})),
                    "vcpus": status.vcpus.map(|b| json!({"limit": b.limit, "reserved": b.reserved})),
                    "creates_total": status.creates_total, "reaped_total": status.reaped_total,
                    "admission_rejections_total": status.admission_rejections_total,
                })
            );
        } else {
            if !once {
                print!("\x1b[2J\x1b[H");
            }
            let b = |x: Option<dsec_sdk::Budget>| {
                x.map(|b| format!("{}/{}", b.reserved, b.limit))
                    .unwrap_or_default()
            };
            println!(
                "dsec node {}: {} sandboxes | memory MiB {} | vCPUs {} | pids {} | disk MiB {} | creates {} rejected {} reaped {}",
                status.version, status.sandboxes, b(status.memory_mib), b(status.vcpus), b(status.pids),
                b(status.disk_mib), status.creates_total, status.admission_rejections_total, status.reaped_total
            );
            print_table(&list);
        }
        if once {
            return Ok(());
        }
        tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    }
}
