//! Names in networked FnCalls: a real daemon with its own bridge and pool whose DNS proxy asks
//! a test zone's server (a thread of this test on a loopback address, `--net-dns`). A
//! networked worker's `/etc/resolv.conf` names the node's DNS proxy (the bridge address), so
//! a call whose policy has a domain rule resolves that name, and only that one; a call
//! without rules resolves nothing. Needs root, `ip`, `nft`, busybox and the fncall image.

mod daemon;
use daemon::{policy, Daemon};

use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dsec_sdk::{Client, NetworkPolicy};

/// What the zone answers for `fn.test` (a documentation address: nothing connects to it).
const ANSWER: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 7);

/// The zone `fn.test` on `addr`:53 (UDP), served until dropped; the names it was asked.
struct Zone {
    asked: Arc<Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
    server: Option<std::thread::JoinHandle<()>>,
}

impl Zone {
    fn serve(addr: Ipv4Addr) -> Self {
        use hickory_proto::op::{Message, MessageType, ResponseCode};
        use hickory_proto::rr::{rdata, RData, Record, RecordType};
        let socket = std::net::UdpSocket::bind((addr, 53)).expect("bind the test zone's :53");
        socket
            .set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        let asked = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (log, done) = (Arc::clone(&asked), Arc::clone(&stop));
        let server = std::thread::spawn(move || {
            let mut buf = [0u8; 1500];
            while !done.load(Ordering::Relaxed) {
                let Ok((len, peer)) = socket.recv_from(&mut buf) else {
                    continue;
                };
                let Ok(query) = Message::from_vec(&buf[..len]) else {
                    continue;
                };
                let meta = &query.metadata;
                let mut reply = Message::error_msg(meta.id, meta.op_code, ResponseCode::NoError);
                reply.metadata.message_type = MessageType::Response;
                reply.queries = query.queries.clone();
                for q in &query.queries {
                    let name = q.name().to_ascii().to_ascii_lowercase();
                    log.lock().unwrap().push(name.clone());
                    if name.trim_end_matches('.') != "fn.test" {
                        reply.metadata.response_code = ResponseCode::NXDomain;
                    } else if q.query_type() == RecordType::A {
                        let a = RData::A(rdata::A(ANSWER));
                        reply
                            .answers
                            .push(Record::from_rdata(q.name().clone(), 60, a));
                    }
                }
                let _ = socket.send_to(&reply.to_vec().unwrap(), peer);
            }
        });
        Self {
            asked,
            stop,
            server: Some(server),
        }
    }
}

impl Drop for Zone {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(server) = self.server.take() {
            let _ = server.join();
        }
    }
}

/// Removes the daemon's bridge, tables and address records should it not have (a failed test).
struct BridgeCleanup(String);

impl Drop for BridgeCleanup {
    fn drop(&mut self) {
        let b = &self.0;
        let _ = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!(
                "ip link del {b}; nft delete table inet {b}; nft delete table bridge {b}; rm -rf /run/dsec-net/{b}"
            ))
            .stderr(std::process::Stdio::null())
            .status();
    }
}

/// A networked python call printing its resolv.conf and what `names` resolve to.
async fn resolve(client: &Client, rules: Option<NetworkPolicy>, names: &[&str]) -> String {
    let code = format!(
        "import socket\nprint(open('/etc/resolv.conf').read().strip())\nfor n in {names:?}:\n    try:\n        print(n, socket.gethostbyname(n))\n    except OSError as e:\n        print(n, 'unresolved', e)\n"
    );
    daemon::run_networked_python(client, code, true, rules).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn networked_calls_resolve_the_names_their_rules_allow() {
    daemon::use_installed_image("fncall");
    let ip_forward = std::fs::read_to_string("/proc/sys/net/ipv4/ip_forward").unwrap();
    let tag = std::process::id() % 100_000;
    let upstream = Ipv4Addr::new(127, 0, 53, (tag % 200 + 20) as u8);
    let zone = Zone::serve(upstream);
    let bridge = format!("dz{tag}");
    let _cleanup = BridgeCleanup(bridge.clone());
    let pool = format!("10.{}.0.0/16", 220 + tag % 10);
    let gateway = format!("10.{}.0.1", 220 + tag % 10);
    let upstream_arg = upstream.to_string();
    let args = [
        "--net-bridge",
        &bridge,
        "--net-pool",
        &pool,
        "--net-dns",
        &upstream_arg,
    ];
    let (daemon, client) = Daemon::start("fn-dns", &args).await;

    let out = resolve(
        &client,
        Some(policy(&["tcp:fn.test:80"])),
        &["fn.test", "other.test"],
    )
    .await;
    eprintln!("{out}");
    assert!(
        out.lines().next() == Some(&format!("nameserver {gateway}")),
        "the worker's resolver is not the node's DNS proxy: {out}"
    );
    assert!(
        out.contains(&format!("fn.test {ANSWER}")),
        "allowed name: {out}"
    );
    assert!(
        out.contains("other.test unresolved"),
        "a name outside the rules: {out}"
    );
    assert!(
        !zone
            .asked
            .lock()
            .unwrap()
            .iter()
            .any(|n| n.starts_with("other.test")),
        "the proxy forwarded a name the call may not resolve: {:?}",
        zone.asked.lock().unwrap()
    );

    // The same worker's next call, without rules: the name is not resolved for it.
    let out = resolve(&client, None, &["fn.test"]).await;
    assert!(out.contains("fn.test unresolved"), "no rules: {out}");

    drop(daemon);
    assert_eq!(
        std::fs::read_to_string("/proc/sys/net/ipv4/ip_forward").unwrap(),
        ip_forward
    );
}
