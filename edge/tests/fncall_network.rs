//! Networked FnCalls against a test internet: a test host in a network namespace of its own
//! (HTTP on 8080 and 8081, behind a veth to the host, on 198.19.0.0/16) and a real daemon
//! with its own bridge, pool and nftables table, its TCP API on the bridge address and a
//! stand-in for a node service listening on every host address. A networked call reaches
//! exactly what its policy allows for that call, never a node address; the same worker
//! reaches nothing in the next call without rules; a call without network reaches nothing;
//! after a daemon crash the dead workers' addresses are freed. Everything is removed on
//! drop, also when the test fails. Needs root, `ip`, `nft`, `conntrack`, busybox and the
//! fncall image (`images/fncall/build.sh`).

mod daemon;
use daemon::{free_port, policy};

use std::collections::BTreeSet;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use daemon::Daemon;
use dsec_sdk::{Client, FnRunRequest, NetworkPolicy};

fn sh(script: &str) {
    let out = Command::new("sh").args(["-c", script]).output().unwrap();
    assert!(
        out.status.success(),
        "{script}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The test host, the daemon's network names; all removed on drop.
struct TestNet {
    bridge: String,
    pool_prefix: String,
    host: Ipv4Addr,
    /// The host's end of the test host's link (a node address too).
    uplink: Ipv4Addr,
    netns: String,
    link: String,
    servers: Vec<Child>,
    dir: PathBuf,
}

impl TestNet {
    fn new() -> Self {
        let tag = std::process::id() % 100_000;
        let third = (tag % 200 + 20) as u8;
        let dir = std::env::temp_dir().join(format!("dsec-fnnet-test-{tag}"));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("index.html"), "hello\n").unwrap();
        let mut net = Self {
            bridge: format!("df{tag}"),
            pool_prefix: format!("10.{}", 240 + tag % 10),
            host: Ipv4Addr::new(198, 19, third, 2),
            uplink: Ipv4Addr::new(198, 19, third, 1),
            netns: format!("dsfn-{tag}"),
            link: format!("df{tag}h"),
            servers: Vec::new(),
            dir,
        };
        let (ns, link, host, uplink) = (&net.netns, &net.link, net.host, net.uplink);
        sh(&format!(
            "ip netns add {ns} && ip link add {link} type veth peer name eth0 netns {ns} && \
             ip addr add {uplink}/24 dev {link} && ip link set {link} up && \
             ip -n {ns} addr add {host}/24 dev eth0 && ip -n {ns} link set eth0 up && \
             ip -n {ns} link set lo up"
        ));
        let www = net.dir.display().to_string();
        for port in ["8080", "8081"] {
            use std::os::unix::process::CommandExt;
            let child = Command::new("ip")
                .args(["netns", "exec", ns, "busybox", "httpd", "-f", "-p", port])
                .args(["-h", &www])
                .process_group(0)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap();
            net.servers.push(child);
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        for port in [8080, 8081] {
            while std::net::TcpStream::connect_timeout(
                &(net.host, port).into(),
                Duration::from_millis(200),
            )
            .is_err()
            {
                assert!(
                    Instant::now() < deadline,
                    "test server :{port} did not start"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        net
    }

    fn gateway(&self) -> Ipv4Addr {
        format!("{}.0.1", self.pool_prefix).parse().unwrap()
    }

    /// Daemon arguments: this network, a named policy "testhost-alt" (the host's 8081), the
    /// TCP API on the bridge address.
    fn daemon_args(&self, api_port: u16) -> Vec<String> {
        let policies = self.dir.join("policies.json");
        std::fs::write(
            &policies,
            format!(
                r#"{{"testhost-alt": {{"allow": ["tcp:{}:8081"]}}}}"#,
                self.host
            ),
        )
        .unwrap();
        vec![
            "--net-bridge".into(),
            self.bridge.clone(),
            "--net-pool".into(),
            format!("{}.0.0/16", self.pool_prefix),
            "--policies".into(),
            policies.display().to_string(),
            "--listen".into(),
            format!("{}:{api_port}", self.gateway()),
        ]
    }

    /// Host links on the bridge (networked workers' veths; not the node's pooled ones,
    /// `dsp*`, made ahead for container creates).
    fn veths(&self) -> Vec<String> {
        std::fs::read_dir("/sys/class/net")
            .unwrap()
            .flatten()
            .filter(|e| {
                std::fs::read_link(e.path().join("master")).is_ok_and(|m| m.ends_with(&self.bridge))
            })
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|name| !name.starts_with("dsp"))
            .collect()
    }

    /// Addresses of the pool taken.
    fn slots(&self) -> usize {
        self.holders().len()
    }

    /// Each taken address with the directory holding it (for failure messages).
    fn holders(&self) -> Vec<(String, std::path::PathBuf)> {
        std::fs::read_dir(format!("/run/dsec-net/{}", self.bridge))
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| {
                let holder = std::fs::read_link(e.path()).unwrap_or_default();
                (e.file_name().to_string_lossy().into_owned(), holder)
            })
            .collect()
    }
}

impl Drop for TestNet {
    fn drop(&mut self) {
        for child in &mut self.servers {
            // SAFETY: kill(2) on the process group of a server this test started.
            unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
            let _ = child.wait();
        }
        let _ = Command::new("ip")
            .args(["netns", "del", &self.netns])
            .status();
        for link in [&self.link, &self.bridge] {
            let _ = Command::new("ip")
                .args(["link", "del", link])
                .stderr(Stdio::null())
                .status();
        }
        let _ = Command::new("nft")
            .args(["delete", "table", "inet", &self.bridge])
            .stderr(Stdio::null())
            .status();
        let _ = Command::new("nft")
            .args(["delete", "table", "bridge", &self.bridge])
            .stderr(Stdio::null())
            .status();
        let _ = std::fs::remove_dir_all(format!("/run/dsec-net/{}", self.bridge));
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Runs a python call that tries a TCP connection to each target (1 s each); the targets
/// it opened.
async fn reached(
    client: &Client,
    network: bool,
    network_policy: Option<NetworkPolicy>,
    targets: &[(Ipv4Addr, u16)],
) -> BTreeSet<(Ipv4Addr, u16)> {
    let list: Vec<String> = targets
        .iter()
        .map(|(a, p)| format!("('{a}', {p})"))
        .collect();
    let code = format!(
        "import socket\nfor t in [{}]:\n    try:\n        socket.create_connection(t, timeout=1).close()\n        print('open', t[0], t[1])\n    except OSError as e:\n        print('closed', t[0], t[1], e)\n",
        list.join(", ")
    );
    let out = daemon::run_networked_python(client, code, network, network_policy).await;
    eprintln!("{out}");
    out.lines()
        .filter_map(|l| l.strip_prefix("open "))
        .map(|l| {
            let (a, p) = l.split_once(' ').unwrap();
            (a.parse().unwrap(), p.parse().unwrap())
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn networked_calls_reach_only_what_their_policy_allows() {
    daemon::use_installed_image("fncall");
    let ip_forward = std::fs::read_to_string("/proc/sys/net/ipv4/ip_forward").unwrap();
    let net = TestNet::new();
    let api_port = free_port();
    // A stand-in for a node service on every address (an HTTP entry point on 0.0.0.0).
    let service = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    let service_port = service.local_addr().unwrap().port();
    let args = net.daemon_args(api_port);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (mut daemon, client) = Daemon::start_with_env(
        "fn-net",
        &args,
        &[("RUST_LOG", "info,dsec_edge::daemon::fncall=debug")],
    )
    .await;
    std::net::TcpStream::connect((net.gateway(), api_port)).expect("the API listens");
    let (host, gateway, uplink) = (net.host, net.gateway(), net.uplink);
    let targets = [
        (host, 8080),
        (host, 8081),
        (gateway, api_port),
        (gateway, service_port),
        (gateway, daemon.http.port()),
        (uplink, service_port),
        (uplink, api_port),
    ];
    let set = |items: &[(Ipv4Addr, u16)]| items.iter().copied().collect::<BTreeSet<_>>();

    // An allow rule: the host's 8080, nothing else (the node's addresses never).
    let rule = format!("tcp:{host}:8080");
    let got = reached(&client, false, Some(policy(&[&rule])), &targets).await;
    assert_eq!(got, set(&[(host, 8080)]), "allow rule");
    assert_eq!(
        net.veths().len(),
        1,
        "one networked worker: {:?}",
        net.veths()
    );

    // The same worker, next call without rules: reaches nothing (its policy was taken back).
    let got = reached(&client, true, None, &targets).await;
    assert_eq!(got, set(&[]), "networked call without rules");
    assert_eq!(net.veths().len(), 1, "the same worker: {:?}", net.veths());

    // A named policy, then the whole internet: never a node address.
    let got = reached(&client, false, Some(policy(&["testhost-alt"])), &targets).await;
    assert_eq!(got, set(&[(host, 8081)]), "named policy");
    let internet = NetworkPolicy {
        allow_internet: true,
        deny: vec![format!("tcp:{host}:8081")],
        ..NetworkPolicy::default()
    };
    let got = reached(&client, false, Some(internet), &targets).await;
    assert_eq!(
        got,
        set(&[(host, 8080)]),
        "allow_internet minus a deny rule"
    );

    // No network: nothing, not even with the worker above on the bridge.
    let got = reached(&client, false, None, &targets).await;
    assert_eq!(got, set(&[]), "call without network");

    // Bad rules and unknown names are the caller's error, and nothing ran.
    for bad in ["tcp:300.1.1.1:80", "no-such-policy", "tcp:10.0.0.1:0"] {
        let err = client
            .run_code(FnRunRequest {
                code: "print(1)".into(),
                network_policy: Some(policy(&[bad])),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert!(
            format!("{err:?}").contains("InvalidArgument"),
            "{bad}: {err:?}"
        );
    }

    // A crash: the workers die with the daemon; the next one frees their addresses.
    assert_eq!(net.slots(), 1, "one address for the networked worker");
    drop(client);
    daemon.kill9();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !net.veths().is_empty() {
        assert!(
            Instant::now() < deadline,
            "veths outlived the daemon: {:?}",
            net.veths()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let client = daemon.restart().await;
    assert_eq!(
        net.slots(),
        0,
        "the dead worker's address is still taken: {:?}\n{}",
        net.holders(),
        daemon.log()
    );
    let got = reached(&client, false, Some(policy(&[&rule])), &targets).await;
    assert_eq!(got, set(&[(host, 8080)]), "allow rule after a restart");
    assert_eq!(net.slots(), 1);
    let log_file = daemon.log_file();
    daemon.stop(client).await;
    // A clean stop frees the workers' addresses and removes bridge and table.
    assert_eq!(
        net.slots(),
        0,
        "addresses left after a clean stop: {:?}\n{}",
        net.holders(),
        std::fs::read_to_string(&log_file).unwrap_or_default()
    );
    assert!(
        !std::path::Path::new("/sys/class/net")
            .join(&net.bridge)
            .exists(),
        "bridge left after a clean stop"
    );
    drop(service);
    drop(net);
    assert_eq!(
        std::fs::read_to_string("/proc/sys/net/ipv4/ip_forward").unwrap(),
        ip_forward,
        "ip_forward not put back"
    );
}
