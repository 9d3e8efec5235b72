//! Prometheus text exposition on a plain HTTP/1 listener (GET /metrics).

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use super::node::Node;

const BUCKETS: [f64; 11] = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];

/// Counters of the node.
#[derive(Default)]
pub struct Metrics {
    pub creates_total: AtomicU64,
    pub create_failures_total: AtomicU64,
    pub deletes_total: AtomicU64,
    pub adopted_total: AtomicU64,
    pub execs_total: AtomicU64,
    /// Connections opened to ports inside sandboxes (gRPC Ports.Open and the HTTP entry point).
    pub port_connections_total: AtomicU64,
    /// memory, cpu, pids, disk.
    pub admission_rejections: [AtomicU64; 4],
    /// ttl, idle, died.
    pub reaped: [AtomicU64; 3],
    /// MicroVM pauses by the snapshot they wrote: over the template's memory base, full.
    pub pauses: [AtomicU64; 2],
    create_buckets: [AtomicU64; BUCKETS.len()],
    create_count: AtomicU64,
    create_sum_us: AtomicU64,
}

impl Metrics {
    pub fn observe_create(&self, took: Duration) {
        let secs = took.as_secs_f64();
        for (i, bound) in BUCKETS.iter().enumerate() {
            if secs <= *bound {
                self.create_buckets[i].fetch_add(1, Ordering::Relaxed);
            }
        }
        self.create_count.fetch_add(1, Ordering::Relaxed);
        self.create_sum_us
            .fetch_add(took.as_micros() as u64, Ordering::Relaxed);
    }

    pub fn rejections_total(&self) -> u64 {
        self.admission_rejections
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .sum()
    }

    pub fn reaped_total(&self) -> u64 {
        self.reaped.iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }
}

/// Renders all metrics of the node.
pub fn render(node: &Node, denied: &[(std::net::Ipv4Addr, u64)]) -> String {
    let m = &node.metrics;
    let mut out = String::new();
    let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
    let mut counter = |name: &str, help: &str, value: u64| {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} counter\n{name} {value}"
        );
    };
    counter(
        "dsec_sandbox_creates_total",
        "Sandboxes created.",
        get(&m.creates_total),
    );
    counter(
        "dsec_sandbox_create_failures_total",
        "Creates that failed after admission.",
        get(&m.create_failures_total),
    );
    counter(
        "dsec_sandbox_deletes_total",
        "Sandboxes deleted (any reason).",
        get(&m.deletes_total),
    );
    counter(
        "dsec_sandbox_adopted_total",
        "Sandboxes re-adopted after a daemon restart.",
        get(&m.adopted_total),
    );
    counter("dsec_exec_total", "Exec calls.", get(&m.execs_total));
    counter(
        "dsec_port_connections_total",
        "Connections opened to ports inside sandboxes.",
        get(&m.port_connections_total),
    );
    if let Some(pool) = &node.edge.vmm_pool {
        for (name, help, value) in [
            (
                "dsec_vmm_pool_served_total",
                "Restores served by a prewarmed VMM.",
                get(&pool.served),
            ),
            (
                "dsec_vmm_pool_missed_total",
                "Restores that found no prewarmed VMM of their shape ready.",
                get(&pool.missed),
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {value}"
            );
        }
        let _ = writeln!(
            out,
            "# HELP dsec_vmm_pool_ready Prewarmed VMMs ready, per shape.\n# TYPE dsec_vmm_pool_ready gauge"
        );
        for (shape, ready) in pool.counts() {
            let _ = writeln!(
                out,
                "dsec_vmm_pool_ready{{mem_mib=\"{}\",vcpus=\"{}\"}} {ready}",
                shape.mem_mib, shape.vcpus
            );
        }
    }
    let _ = writeln!(
        out,
        "# HELP dsec_admission_rejections_total Creates refused because a budget was spent.\n# TYPE dsec_admission_rejections_total counter"
    );
    for (i, r) in ["memory", "cpu", "pids", "disk"].iter().enumerate() {
        let _ = writeln!(
            out,
            "dsec_admission_rejections_total{{resource=\"{r}\"}} {}",
            get(&m.admission_rejections[i])
        );
    }
    let _ = writeln!(
        out,
        "# HELP dsec_sandbox_reaped_total Sandboxes removed by the node.\n# TYPE dsec_sandbox_reaped_total counter"
    );
    for (i, r) in ["ttl", "idle", "died"].iter().enumerate() {
        let _ = writeln!(
            out,
            "dsec_sandbox_reaped_total{{reason=\"{r}\"}} {}",
            get(&m.reaped[i])
        );
    }
    let _ = writeln!(
        out,
        "# HELP dsec_sandbox_pauses_total MicroVM pauses by the snapshot written: over_base (only the pages that differ from the template) or full (a sandbox with no sealed memory base, or a pause over it that failed).\n# TYPE dsec_sandbox_pauses_total counter"
    );
    for (i, kind) in ["over_base", "full"].iter().enumerate() {
        let _ = writeln!(
            out,
            "dsec_sandbox_pauses_total{{snapshot=\"{kind}\"}} {}",
            get(&m.pauses[i])
        );
    }
    let _ = writeln!(
        out,
        "# HELP dsec_sandbox_create_seconds Time to create a sandbox (admission to agent ready).\n# TYPE dsec_sandbox_create_seconds histogram"
    );
    for (i, bound) in BUCKETS.iter().enumerate() {
        let _ = writeln!(
            out,
            "dsec_sandbox_create_seconds_bucket{{le=\"{bound}\"}} {}",
            get(&m.create_buckets[i])
        );
    }
    let count = get(&m.create_count);
    let _ = writeln!(
        out,
        "dsec_sandbox_create_seconds_bucket{{le=\"+Inf\"}} {count}"
    );
    let _ = writeln!(
        out,
        "dsec_sandbox_create_seconds_sum {}",
        get(&m.create_sum_us) as f64 / 1e6
    );
    let _ = writeln!(out, "dsec_sandbox_create_seconds_count {count}");

    let list = node.list();
    let paused = list.iter().filter(|e| e.record().paused).count();
    let _ = writeln!(
        out,
        "# HELP dsec_sandboxes Sandboxes on this node by state.\n# TYPE dsec_sandboxes gauge\ndsec_sandboxes{{state=\"running\"}} {}\ndsec_sandboxes{{state=\"paused\"}} {paused}",
        list.len() - paused
    );
    let budgets = node.budgets.lock().unwrap_or_else(|e| e.into_inner());
    let _ = writeln!(
        out,
        "# HELP dsec_budget_limit Admission budget (capacity x overcommit).\n# TYPE dsec_budget_limit gauge"
    );
    let rows = [
        ("memory_mib", budgets.memory_mib),
        ("vcpus", budgets.vcpus),
        ("pids", budgets.pids),
        ("disk_mib", budgets.disk_mib),
    ];
    for (name, b) in rows {
        let _ = writeln!(out, "dsec_budget_limit{{resource=\"{name}\"}} {}", b.limit);
    }
    let _ = writeln!(
        out,
        "# HELP dsec_budget_reserved Reserved by admitted sandboxes.\n# TYPE dsec_budget_reserved gauge"
    );
    for (name, b) in rows {
        let _ = writeln!(
            out,
            "dsec_budget_reserved{{resource=\"{name}\"}} {}",
            b.reserved
        );
    }
    if node.edge.network.is_some() {
        let _ = writeln!(
            out,
            "# HELP dsec_sandbox_network_denied_packets_total Packets a sandbox sent that its network policy rejected.\n# TYPE dsec_sandbox_network_denied_packets_total counter"
        );
        for entry in &list {
            let record = entry.record();
            let Some(addr) = crate::net::address(&record.handle.dir) else {
                continue;
            };
            let packets = denied
                .iter()
                .find(|(a, _)| *a == addr)
                .map_or(0, |(_, p)| *p);
            let _ = writeln!(
                out,
                "dsec_sandbox_network_denied_packets_total{{sandbox=\"{}\"}} {packets}",
                record.handle.id
            );
        }
    }
    out
}

/// Packets the network policies rejected, per sandbox address (empty without a network).
async fn denied_packets(node: &Node) -> Vec<(std::net::Ipv4Addr, u64)> {
    let Some(net) = node.edge.network.clone() else {
        return Vec::new();
    };
    match tokio::task::spawn_blocking(move || net.denied_packets()).await {
        Ok(Ok(denied)) => denied,
        Ok(Err(err)) => {
            tracing::warn!(%err, "cannot read the network policies' counters");
            Vec::new()
        }
        Err(_) => Vec::new(),
    }
}

/// Serves GET /metrics until the process ends.
pub async fn serve(node: Arc<Node>, listener: TcpListener) {
    loop {
        let Ok((mut stream, _)) = listener.accept().await else {
            continue;
        };
        let node = node.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 4096];
            let mut len = 0;
            // Read the request head (bounded); the body, if any, is ignored.
            while len < buf.len() {
                match tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf[len..]))
                    .await
                {
                    Ok(Ok(0)) | Ok(Err(_)) | Err(_) => break,
                    Ok(Ok(n)) => len += n,
                }
                if buf[..len].windows(4).any(|w| w == b"\r\n\r\n") {
                    break;
                }
            }
            let head = String::from_utf8_lossy(&buf[..len]);
            let path = head.split_whitespace().nth(1).unwrap_or("");
            let (status, body) = if path == "/metrics" || path.starts_with("/metrics?") {
                ("200 OK", render(&node, &denied_packets(&node).await))
            } else {
                (
                    "404 Not Found",
                    "only /metrics is served here\n".to_string(),
                )
            };
            let response = format!(
                "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = stream.write_all(response.as_bytes()).await;
        });
    }
}
