//! Two nodes with a sandbox network on one host: the host's IPv4 forwarding stays on while
//! either runs, and goes back to what it was when the last one stops.

mod daemon;

use daemon::Daemon;

const IP_FORWARD: &str = "/proc/sys/net/ipv4/ip_forward";

fn ip_forward() -> String {
    std::fs::read_to_string(IP_FORWARD)
        .unwrap()
        .trim()
        .to_string()
}

/// Puts back the host's value and removes the test's bridges, even when an assertion failed.
struct HostState {
    original: String,
    bridges: [String; 2],
}

impl Drop for HostState {
    fn drop(&mut self) {
        for bridge in &self.bridges {
            if std::path::Path::new("/sys/class/net").join(bridge).exists() {
                let _ = std::process::Command::new("ip")
                    .args(["link", "del", bridge])
                    .status();
            }
            let _ = std::process::Command::new("nft")
                .args(["delete", "table", "inet", bridge])
                .stderr(std::process::Stdio::null())
                .status();
        }
        let _ = std::fs::write(IP_FORWARD, &self.original);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarding_is_restored_by_the_last_node_to_stop() {
    let tag = std::process::id() % 100_000;
    let host = HostState {
        original: ip_forward(),
        bridges: [format!("dtfa{tag}"), format!("dtfb{tag}")],
    };
    std::fs::write(IP_FORWARD, "0").unwrap();
    let args = |bridge: &str, pool: &str| {
        vec![
            "--net-bridge".to_string(),
            bridge.to_string(),
            "--net-pool".to_string(),
            pool.to_string(),
        ]
    };
    let a_args = args(&host.bridges[0], "10.236.0.0/16");
    let b_args = args(&host.bridges[1], "10.237.0.0/16");
    let a_args: Vec<&str> = a_args.iter().map(String::as_str).collect();
    let b_args: Vec<&str> = b_args.iter().map(String::as_str).collect();

    let (a, a_client) = Daemon::start("fwd-a", &a_args).await;
    assert_eq!(ip_forward(), "1", "a node with a sandbox network forwards");
    let (b, b_client) = Daemon::start("fwd-b", &b_args).await;
    a.stop(a_client).await;
    assert_eq!(
        ip_forward(),
        "1",
        "one node's stop turned forwarding off under another node's sandboxes"
    );
    b.stop(b_client).await;
    assert_eq!(
        ip_forward(),
        "0",
        "the last node's stop did not put back the host's value"
    );
    drop(host);
}
