//! Sandbox networking against a test internet of network namespaces this test creates: a
//! "mirror" host (HTTP on 8080 and 8081, a plain TCP listener on 8082) and a "forbidden"
//! host (HTTP on 8080 and 22), each behind its own veth to the host, on 198.18.0.0/15
//! (the benchmarking range). The mirror's namespace also serves DNS for the zone `test`
//! (`mirror.test`, `*.mirror.test`, `forbidden.test`; a thread of this test in that
//! namespace), the daemon's upstream resolver. A real daemon runs with its own bridge, pool
//! and nftables table; everything (namespaces, veths, servers, table, bridge) is removed on
//! drop, also when a test fails. Needs root, `ip`, `nft`, `conntrack` and busybox.

mod daemon;
use daemon::{free_port, policy};

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use daemon::Daemon;
use dsec_sdk::{Client, CreateSandboxRequest, ExecStart, NetworkPolicy};

static NEXT: AtomicU32 = AtomicU32::new(1);

fn sh(script: &str) -> String {
    let out = Command::new("sh").args(["-c", script]).output().unwrap();
    assert!(
        out.status.success(),
        "{script}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The test internet and the names of the daemon's network; all removed on drop.
struct Internet {
    bridge: String,
    pool_prefix: String,
    mirror: Ipv4Addr,
    forbidden: Ipv4Addr,
    /// The host's ends of the two links.
    uplinks: [Ipv4Addr; 2],
    netns: Vec<String>,
    links: Vec<String>,
    servers: Vec<Child>,
    dns: TestDns,
    dir: PathBuf,
}

/// The test zone's DNS server, a thread in the mirror's namespace; the names it was asked.
struct TestDns {
    asked: Arc<Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl TestDns {
    fn start(netns: &str, mirror: Ipv4Addr, forbidden: Ipv4Addr) -> Self {
        use hickory_proto::op::{Message, MessageType, ResponseCode};
        use hickory_proto::rr::{rdata, RData, Record, RecordType};
        let asked = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let ns = std::fs::File::open(format!("/var/run/netns/{netns}")).unwrap();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread = {
            let (asked, stop, netns) = (asked.clone(), stop.clone(), netns.to_string());
            std::thread::spawn(move || {
                use std::os::fd::AsRawFd;
                // SAFETY: setns(2) on a namespace file this thread holds open; it moves only
                // this thread, which then binds its socket there.
                let moved = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
                assert_eq!(moved, 0, "setns into {netns}");
                let socket = std::net::UdpSocket::bind((mirror, 53)).unwrap();
                socket
                    .set_read_timeout(Some(Duration::from_millis(100)))
                    .unwrap();
                ready_tx.send(()).unwrap();
                let mut buf = [0u8; 1500];
                while !stop.load(Ordering::Relaxed) {
                    let Ok((len, from)) = socket.recv_from(&mut buf) else {
                        continue;
                    };
                    let Ok(query) = Message::from_vec(&buf[..len]) else {
                        continue;
                    };
                    let mut reply = Message::error_msg(
                        query.metadata.id,
                        query.metadata.op_code,
                        ResponseCode::NoError,
                    );
                    reply.metadata.message_type = MessageType::Response;
                    reply.queries = query.queries.clone();
                    for q in &query.queries {
                        let name = q.name().to_ascii().to_ascii_lowercase();
                        asked.lock().unwrap().push(name.clone());
                        let addr = match name.trim_end_matches('.') {
                            "mirror.test" => Some(mirror),
                            n if n.ends_with(".mirror.test") => Some(mirror),
                            "forbidden.test" => Some(forbidden),
                            _ => None,
                        };
                        match (addr, q.query_type()) {
                            (Some(addr), RecordType::A) => reply.answers.push(Record::from_rdata(
                                q.name().clone(),
                                300,
                                RData::A(rdata::A(addr)),
                            )),
                            (Some(_), RecordType::TXT) => reply.answers.push(Record::from_rdata(
                                q.name().clone(),
                                300,
                                RData::TXT(rdata::TXT::new(vec!["secret".into()])),
                            )),
                            (Some(_), _) => {}
                            (None, _) => reply.metadata.response_code = ResponseCode::NXDomain,
                        }
                    }
                    let _ = socket.send_to(&reply.to_vec().unwrap(), from);
                }
            })
        };
        ready_rx
            .recv_timeout(Duration::from_secs(5))
            .expect("the test DNS server did not start");
        Self {
            asked,
            stop,
            thread: Some(thread),
        }
    }

    fn asked(&self) -> Vec<String> {
        self.asked.lock().unwrap().clone()
    }
}

impl Drop for TestDns {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Internet {
    fn new() -> Self {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let tag = format!("{}{n}", std::process::id() % 100_000);
        let dir = std::env::temp_dir().join(format!("dsec-net-test-{tag}"));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("index.html"), "hello-mirror\n").unwrap();
        let mut net = Self {
            bridge: format!("dt{tag}"),
            pool_prefix: format!("10.{}", 210 + n),
            mirror: Ipv4Addr::new(198, 18, (n * 10 + 1) as u8, 2),
            forbidden: Ipv4Addr::new(198, 18, (n * 10 + 2) as u8, 2),
            uplinks: [
                Ipv4Addr::new(198, 18, (n * 10 + 1) as u8, 1),
                Ipv4Addr::new(198, 18, (n * 10 + 2) as u8, 1),
            ],
            netns: Vec::new(),
            links: Vec::new(),
            servers: Vec::new(),
            dns: TestDns {
                asked: Arc::default(),
                stop: Arc::default(),
                thread: None,
            },
            dir,
        };
        for (role, host, uplink) in [
            ("m", net.mirror, net.uplinks[0]),
            ("f", net.forbidden, net.uplinks[1]),
        ] {
            let (ns, link) = (format!("dsect-{tag}-{role}"), format!("dt{tag}{role}"));
            net.netns.push(ns.clone());
            net.links.push(link.clone());
            sh(&format!(
                "ip netns add {ns} && ip link add {link} type veth peer name eth0 netns {ns} && \
                 ip addr add {uplink}/24 dev {link} && ip link set {link} up && \
                 ip -n {ns} addr add {host}/24 dev eth0 && ip -n {ns} link set eth0 up && \
                 ip -n {ns} link set lo up"
            ));
        }
        net.dns = TestDns::start(&net.netns[0], net.mirror, net.forbidden);
        let www = net.dir.display().to_string();
        let (mirror_ns, forbidden_ns) = (net.netns[0].clone(), net.netns[1].clone());
        for (ns, args) in [
            (&mirror_ns, vec!["httpd", "-f", "-p", "8080", "-h", &www]),
            (&mirror_ns, vec!["httpd", "-f", "-p", "8081", "-h", &www]),
            (&forbidden_ns, vec!["httpd", "-f", "-p", "8080", "-h", &www]),
            (&forbidden_ns, vec!["httpd", "-f", "-p", "22", "-h", &www]),
        ] {
            net.spawn(ns, &args, None);
        }
        let held = std::fs::File::create(net.dir.join("held.txt")).unwrap();
        // Its stdin never ends (an ended stdin would close the connection at once).
        net.spawn(
            &mirror_ns,
            &["sh", "-c", "busybox sleep 60 | busybox nc -l -p 8082"],
            Some(held),
        );
        // The servers are up once the host reaches them (bounded).
        let deadline = Instant::now() + Duration::from_secs(5);
        for target in [(net.mirror, 8080), (net.forbidden, 22)] {
            while std::net::TcpStream::connect_timeout(&target.into(), Duration::from_millis(200))
                .is_err()
            {
                assert!(
                    Instant::now() < deadline,
                    "test server {target:?} did not start"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        // The one-shot listener is checked without connecting to it.
        while !sh(&format!(
            "ip netns exec {mirror_ns} ss -Hltn 'sport = :8082'"
        ))
        .contains("8082")
        {
            assert!(
                Instant::now() < deadline,
                "the mirror's listener did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        net
    }

    fn spawn(&mut self, ns: &str, args: &[&str], stdout: Option<std::fs::File>) {
        use std::os::unix::process::CommandExt;
        let child = Command::new("ip")
            .args(["netns", "exec", ns, "busybox"])
            .args(args)
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(stdout.map(Stdio::from).unwrap_or_else(Stdio::null))
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        self.servers.push(child);
    }

    fn gateway(&self) -> Ipv4Addr {
        format!("{}.0.1", self.pool_prefix).parse().unwrap()
    }

    /// Daemon arguments: this network, a named policy "mirror", the TCP API on the bridge.
    fn daemon_args(&self, api_port: u16) -> Vec<String> {
        let policies = self.dir.join("policies.json");
        std::fs::write(
            &policies,
            format!(
                r#"{{"mirror": {{"allow": ["tcp:{m}:8080", "tcp:{m}:8082"]}},
                    "grading": {{"allow": ["tcp:{f}:22"]}},
                    "pypi-mirror": {{"allow": ["tcp:mirror.test:8080"]}}}}"#,
                m = self.mirror,
                f = self.forbidden
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
            // The test zone's server is the DNS proxy's upstream.
            "--net-dns".into(),
            self.mirror.to_string(),
        ]
    }

    /// Host links on the bridge: sandboxes' veths, and the pooled ones (`dsp*`) of
    /// namespaces made ahead of creates.
    fn bridge_links(&self) -> (Vec<String>, Vec<String>) {
        std::fs::read_dir("/sys/class/net")
            .unwrap()
            .flatten()
            .filter(|e| {
                std::fs::read_link(e.path().join("master")).is_ok_and(|m| m.ends_with(&self.bridge))
            })
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .partition(|name| !name.starts_with("dsp"))
    }

    /// Sandboxes' veths on the bridge.
    fn veths(&self) -> Vec<String> {
        self.bridge_links().0
    }

    /// Pooled veths on the bridge, once the node's pool is full again (the default
    /// `--net-veth-pool`, 4, at most).
    async fn pooled_when_settled(&self) -> usize {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let pooled = self.bridge_links().1.len();
            if pooled <= 4 || Instant::now() > deadline {
                return pooled;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Elements of each of the table's sets (all of them a sandbox's), by set name.
    fn elements(&self) -> std::collections::BTreeMap<String, usize> {
        let table: serde_json::Value =
            serde_json::from_str(&sh(&format!("nft -j list table inet {}", self.bridge))).unwrap();
        table["nftables"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|item| {
                let set = &item["set"];
                let name = set["name"].as_str()?.to_string();
                Some((name, set["elem"].as_array().map_or(0, Vec::len)))
            })
            .collect()
    }

    /// Elements of sandboxes left in the table.
    fn sandbox_elements(&self) -> usize {
        self.elements().values().sum()
    }

    fn slots(&self) -> usize {
        std::fs::read_dir(format!("/run/dsec-net/{}", self.bridge))
            .map(|d| d.count())
            .unwrap_or(0)
    }
}

impl Drop for Internet {
    fn drop(&mut self) {
        for child in &mut self.servers {
            // SAFETY: kill(2) on the process group of a server this test started.
            unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
            let _ = child.wait();
        }
        for ns in &self.netns {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
        for link in self.links.iter().chain([&self.bridge]) {
            let _ = Command::new("ip")
                .args(["link", "del", link])
                .stderr(Stdio::null())
                .status();
        }
        let _ = Command::new("nft")
            .args(["delete", "table", "inet", &self.bridge])
            .stderr(Stdio::null())
            .status();
        let _ = std::fs::remove_dir_all(format!("/run/dsec-net/{}", self.bridge));
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

async fn create(client: &Client, network: NetworkPolicy) -> String {
    client
        .create(CreateSandboxRequest {
            memory_mib: 64,
            disk_mib: 16,
            network: Some(network),
            ..Default::default()
        })
        .await
        .unwrap()
        .id
}

/// Runs a shell script in the sandbox (as its root): exit code and stdout + stderr.
async fn run(client: &Client, id: &str, script: &str) -> (i32, String) {
    let start = ExecStart {
        sandbox_id: id.into(),
        argv: vec!["sh".into(), "-c".into(), script.into()],
        timeout_ms: 20_000,
        ..Default::default()
    };
    let out = client.exec_with(start, None, |_, _| {}).await.unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.code.unwrap_or(-1), text)
}

/// Whether a TCP connection from the sandbox to `addr:port` opens (1 s timeout).
async fn reaches(client: &Client, id: &str, addr: Ipv4Addr, port: u16) -> bool {
    let (code, _) = run(client, id, &format!("nc -w 1 {addr} {port} </dev/null")).await;
    code == 0
}

async fn address_of(client: &Client, id: &str) -> Ipv4Addr {
    let (code, out) = run(client, id, "ip -4 addr show dev eth0").await;
    assert_eq!(code, 0, "{out}");
    let inet = out
        .split_whitespace()
        .skip_while(|w| *w != "inet")
        .nth(1)
        .unwrap_or_else(|| panic!("no address on eth0: {out}"));
    inet.split('/').next().unwrap().parse().unwrap()
}

fn host_addresses() -> Vec<Ipv4Addr> {
    sh("ip -4 -o addr show scope global")
        .lines()
        .filter_map(|l| {
            let inet = l.split_whitespace().skip_while(|w| *w != "inet").nth(1)?;
            inet.split('/').next()?.parse().ok()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policies_are_enforced_against_a_test_internet() {
    let net = Internet::new();
    let api_port = free_port();
    let args = net.daemon_args(api_port);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    // No `nft` on the daemon's PATH: its rules, live changes and counters go through
    // libnftables in its own process (only `ip` and `conntrack` are run).
    let tools = net.dir.join("tools");
    std::fs::create_dir_all(&tools).unwrap();
    for tool in ["ip", "conntrack"] {
        let found = sh(&format!("command -v {tool}"));
        std::os::unix::fs::symlink(found.trim(), tools.join(tool)).unwrap();
    }
    let path = tools.to_str().unwrap();
    let (daemon, client) = Daemon::start_with_env("net-policy", &args, &[("PATH", path)]).await;
    // The node API listens on the bridge's own address: the most tempting target.
    std::net::TcpStream::connect((net.gateway(), api_port)).expect("the API listens");

    let closed = create(&client, NetworkPolicy::default()).await;
    let open = create(&client, policy(&["mirror"])).await;
    let closed_addr = address_of(&client, &closed).await;
    let open_addr = address_of(&client, &open).await;
    assert!(closed_addr.to_string().starts_with(&net.pool_prefix));
    assert_ne!(closed_addr, open_addr);
    let (_, resolv) = run(
        &client,
        &closed,
        "cat /etc/resolv.conf; stat -c %u /etc/resolv.conf",
    )
    .await;
    assert_eq!(resolv, format!("nameserver {}\n0\n", net.gateway()));
    // Root in the sandbox cannot move its interface, address or route elsewhere.
    for change in [
        format!("ip addr add {}.0.99/16 dev eth0", net.pool_prefix),
        "ip link set eth0 down".to_string(),
        "ip route del default".to_string(),
        "ip link add x type dummy".to_string(),
    ] {
        let (code, out) = run(&client, &closed, &change).await;
        assert_ne!(code, 0, "{change} worked: {out}");
    }
    let (_, routes) = run(&client, &closed, "ip route").await;
    assert!(
        routes.contains(&format!("default via {}", net.gateway())),
        "{routes}"
    );

    // No policy: nothing outside the sandbox.
    for (addr, port) in [
        (net.mirror, 8080),
        (net.forbidden, 8080),
        (net.forbidden, 22),
    ] {
        assert!(
            !reaches(&client, &closed, addr, port).await,
            "{addr}:{port} reached without a policy"
        );
    }
    // The named policy: the mirror's 8080 and 8082, nothing else.
    let (code, page) = run(
        &client,
        &open,
        &format!(
            "printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 2 {} 8080",
            net.mirror
        ),
    )
    .await;
    assert!(code == 0 && page.contains("hello-mirror"), "{code}: {page}");
    assert!(!reaches(&client, &open, net.mirror, 8081).await);
    assert!(!reaches(&client, &open, net.forbidden, 8080).await);
    assert!(!reaches(&client, &open, net.forbidden, 22).await);
    // The gateway's MAC is fixed (06:00 and its address) and stays while sandboxes come and
    // go: a bridge left to itself takes the lowest MAC of its ports, and a sandbox that had
    // cached the old one lost the gateway until its ARP entry expired.
    let bridge_mac = || {
        std::fs::read_to_string(format!("/sys/class/net/{}/address", net.bridge))
            .unwrap()
            .trim()
            .to_string()
    };
    let [a, b, c, d] = net.gateway().octets();
    let fixed = format!("06:00:{a:02x}:{b:02x}:{c:02x}:{d:02x}");
    assert_eq!(bridge_mac(), fixed);
    for _ in 0..6 {
        let id = create(&client, NetworkPolicy::default()).await;
        client.delete(&id).await.unwrap();
    }
    assert_eq!(bridge_mac(), fixed, "the bridge's MAC moved");
    let (_, arp) = run(&client, &open, "cat /proc/net/arp").await;
    assert!(arp.contains(&fixed), "{arp}");
    assert!(reaches(&client, &open, net.mirror, 8080).await);
    // Those refused attempts are counted per sandbox.
    let metrics = sh(&format!("curl -sf http://{}/metrics", daemon.metrics));
    let denied = |id: &str| -> u64 {
        let line = format!("dsec_sandbox_network_denied_packets_total{{sandbox=\"{id}\"}} ");
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(&line))
            .unwrap_or_else(|| panic!("no denied count for {id} in {metrics}"))
            .parse()
            .unwrap()
    };
    assert!(denied(&open) >= 3, "{metrics}");
    assert!(denied(&closed) >= 3, "{metrics}");

    // A scan, as root in the sandbox, of the node's addresses, the bridge, the other
    // sandbox and the forbidden host finds only what the policy allows (the mirror's 8080,
    // included so that the scan is known to see open ports).
    let mut targets = vec![net.gateway(), closed_addr, net.forbidden, net.mirror];
    targets.extend(net.uplinks);
    targets.extend(host_addresses());
    targets.sort();
    targets.dedup();
    let ports = [
        22,
        53,
        80,
        443,
        8080,
        8081,
        api_port,
        daemon.http.port(),
        daemon.metrics.port(),
        7070,
        7080,
        9464,
    ];
    let mut script = String::new();
    for t in &targets {
        for p in ports {
            script.push_str(&format!(
                "(nc -w 1 {t} {p} </dev/null >/dev/null 2>&1 && echo OPEN {t}:{p}) &\n"
            ));
        }
    }
    script.push_str("wait\n");
    let started = Instant::now();
    let (_, found) = run(&client, &open, &script).await;
    let mut found: Vec<&str> = found.lines().filter(|l| l.starts_with("OPEN")).collect();
    found.sort();
    // The DNS proxy (TCP 53 on the bridge address) is the one service of the node.
    assert_eq!(
        found,
        vec![
            format!("OPEN {}:53", net.gateway()),
            format!("OPEN {}:8080", net.mirror)
        ],
        "scan of {targets:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(15));

    // Another sandbox is never reachable, even when a policy allows the whole pool.
    let (code, out) = run(&client, &closed, "httpd -p 9000 -h /").await;
    assert_eq!(code, 0, "{out}");
    assert!(reaches(&client, &closed, Ipv4Addr::LOCALHOST, 9000).await);
    client
        .set_network_policy(
            &open,
            NetworkPolicy {
                allow_internet: true,
                allow: vec![format!("{}.0.0/16", net.pool_prefix), "mirror".into()],
                deny: vec![format!("tcp:{}:8081", net.mirror)],
            },
        )
        .await
        .unwrap();
    assert!(!reaches(&client, &open, closed_addr, 9000).await);
    assert!(!reaches(&client, &open, net.gateway(), api_port).await);
    // allow_internet opened the forbidden host; the deny rule still wins for 8081.
    assert!(reaches(&client, &open, net.forbidden, 22).await);
    assert!(!reaches(&client, &open, net.mirror, 8081).await);

    // Live change from allow to deny cuts an open connection: the sandbox writes a line
    // every 100 ms for 4 s to the mirror's listener; after the change its next write is
    // answered with a reset and the writer ends long before its 4 s.
    client
        .set_network_policy(&open, policy(&["mirror"]))
        .await
        .unwrap();
    let writer = {
        let (client, id, mirror) = (client.clone(), open.clone(), net.mirror);
        tokio::spawn(async move {
            run(
                &client,
                &id,
                &format!(
                    "i=0; while [ $i -lt 40 ]; do echo ping$i; i=$((i+1)); sleep 0.1; done \
                     | nc {mirror} 8082; echo nc-exit=$?"
                ),
            )
            .await
        })
    };
    let held = net.dir.join("held.txt");
    let lines = || {
        std::fs::read_to_string(&held)
            .unwrap_or_default()
            .lines()
            .count()
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while lines() < 3 {
        if writer.is_finished() {
            let out = writer.await.unwrap();
            panic!("the writer ended before the change: {out:?}");
        }
        assert!(
            Instant::now() < deadline,
            "the held connection never carried data"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let changed = Instant::now();
    client
        .set_network_policy(&open, NetworkPolicy::default())
        .await
        .unwrap();
    let applied = changed.elapsed();
    let at_change = lines();
    let (_, out) = tokio::time::timeout(Duration::from_secs(10), writer)
        .await
        .expect("the writer was not cut")
        .unwrap();
    let cut_after = changed.elapsed();
    assert!(
        cut_after < Duration::from_millis(2500),
        "the connection lived {cut_after:?} after the change: {out}"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        lines() <= at_change + 1,
        "data passed after the change: {} -> {}",
        at_change,
        lines()
    );
    assert!(!reaches(&client, &open, net.mirror, 8080).await);
    println!("policy change applied in {applied:?}, connection cut {cut_after:?} after it");

    // Bad input is INVALID_ARGUMENT with a message naming the problem.
    let huge: Vec<String> = (0..100_000)
        .map(|i| format!("10.{}.{}.0/24", i / 256 % 256, i % 256))
        .collect();
    for (allow, needle) in [
        (vec!["10.0.0.1/8".to_string()], "host bits"),
        (vec!["10.0.0.0/40".to_string()], "0-32"),
        (vec!["tcp:1.2.3.4:70000".to_string()], "1-65535"),
        (vec!["tcp:1.2.3.4:0".to_string()], "1-65535"),
        (vec!["nosuch".to_string()], "unknown named network policy"),
        (huge, "at most 4096"),
    ] {
        let network = NetworkPolicy {
            allow,
            ..NetworkPolicy::default()
        };
        let err = client
            .create(CreateSandboxRequest {
                network: Some(network.clone()),
                ..Default::default()
            })
            .await
            .expect_err("a bad policy was accepted");
        assert_eq!(err.code(), Some(tonic::Code::InvalidArgument), "{err}");
        assert!(err.to_string().contains(needle), "{needle}: {err}");
        let err = client
            .set_network_policy(&open, network)
            .await
            .expect_err("a bad policy was accepted");
        assert_eq!(err.code(), Some(tonic::Code::InvalidArgument), "{err}");
    }
    assert_eq!(client.list(Default::default()).await.unwrap().len(), 2);

    daemon.stop(client).await;
    // A clean stop with no sandbox left removes the bridge and the table.
    assert!(!std::path::Path::new("/sys/class/net")
        .join(&net.bridge)
        .exists());
    assert!(Command::new("nft")
        .args(["list", "table", "inet", &net.bridge])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| !s.success()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_delete_and_adoption_leak_nothing() {
    // Per-create network setup times come from the daemon's debug log.
    std::env::set_var(
        "DSEC_LOG",
        "info,dsec_edge::backend::container=debug,dsec_edge::net=debug",
    );
    let net = Internet::new();
    let args = net.daemon_args(free_port());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (mut daemon, mut client) = Daemon::start("net-leaks", &args).await;
    const CYCLES: usize = 1000;
    let mut creates = Vec::with_capacity(CYCLES);
    let started = Instant::now();
    for i in 0..CYCLES {
        let network = if i % 10 == 0 {
            policy(&["mirror", "pypi-mirror", "tcp:198.18.0.0/15:1-1024"])
        } else {
            NetworkPolicy::default()
        };
        let t = Instant::now();
        let id = create(&client, network).await;
        creates.push(t.elapsed());
        client.delete(&id).await.unwrap();
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "cycles too slow"
        );
    }
    assert_eq!(net.veths(), Vec::<String>::new(), "veths left");
    assert!(
        net.pooled_when_settled().await <= 4,
        "pooled veths beyond the pool's size"
    );
    assert_eq!(net.slots(), 0, "addresses left");
    assert_eq!(
        net.sandbox_elements(),
        0,
        "elements left: {:?}",
        net.elements()
    );
    // "network attached setup_us=N added_us=M" (tracing's colours stripped).
    let log = daemon.log();
    let field = |name: &str| -> Vec<u64> {
        let mut values: Vec<u64> = log
            .lines()
            .filter(|l| l.contains("network attached"))
            .filter_map(|l| {
                let value = without_colours(l)
                    .split(&format!("{name}="))
                    .nth(1)?
                    .to_string();
                value
                    .split(|c: char| !c.is_ascii_digit())
                    .next()?
                    .parse()
                    .ok()
            })
            .collect();
        values.sort_unstable();
        values
    };
    let (setup, added) = (field("setup_us"), field("added_us"));
    creates.sort_unstable();
    assert_eq!(setup.len(), CYCLES, "network setup times in the log");
    // Sequential creates find a namespace made ahead (the pool refills between them).
    let pooled = log
        .lines()
        .filter(|l| l.contains("network setup parts") && without_colours(l).contains("pooled=true"))
        .count();
    assert!(
        pooled >= CYCLES * 9 / 10,
        "only {pooled} of {CYCLES} creates took a pooled namespace"
    );
    println!(
        "network setup over {CYCLES} creates: p50 {} us, p90 {} us; added to the create \
         (still running when the agent answered): p50 {} us, p90 {} us; create p50 {:?}, p90 {:?}",
        setup[CYCLES / 2],
        setup[CYCLES * 9 / 10],
        added[CYCLES / 2],
        added[CYCLES * 9 / 10],
        creates[CYCLES / 2],
        creates[CYCLES * 9 / 10]
    );

    // Adoption: a daemon killed with two sandboxes; one's record is lost (as if the daemon
    // died while creating it). The restarted daemon keeps the other one's network and
    // policy and frees everything of the lost one.
    let kept = create(&client, policy(&["mirror", "pypi-mirror"])).await;
    let lost = create(&client, NetworkPolicy::default()).await;
    assert_eq!(net.veths().len(), 2);
    daemon.kill9();
    std::fs::remove_file(daemon.state.join("sandboxes").join(&lost).join("meta.json")).unwrap();
    client = daemon.restart().await;
    let ids: Vec<String> = client
        .list(Default::default())
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.id)
        .collect();
    assert_eq!(ids, vec![kept.clone()]);
    assert_eq!(net.veths().len(), 1, "the lost sandbox's veth is left");
    // The killed daemon's pooled namespaces died with it; the new one keeps its own.
    assert!(
        net.pooled_when_settled().await <= 4,
        "the killed daemon's pool is left"
    );
    assert_eq!(net.slots(), 1);
    // Its membership, counter, allow elements and one domain-rule combination; the proxy
    // knows its names again.
    let elements = net.elements();
    assert_eq!(
        (elements["sandboxes"], elements["denied"], elements["spec0"]),
        (1, 1, 1),
        "{elements:?}"
    );
    assert!(elements["allow"] > 0, "{elements:?}");
    assert_eq!(
        lookup(&client, &kept, "mirror.test").await,
        Some(vec![net.mirror])
    );
    assert!(reaches(&client, &kept, net.mirror, 8080).await);
    assert!(!reaches(&client, &kept, net.mirror, 8081).await);
    client.delete(&kept).await.unwrap();
    assert_eq!(net.veths(), Vec::<String>::new());
    assert_eq!((net.slots(), net.sandbox_elements()), (0, 0));
    let pool = net.bridge_links().1;
    daemon.stop(client).await;
    // A clean stop closes the pooled namespaces: their veths go with them.
    let deadline = Instant::now() + Duration::from_secs(10);
    while pool
        .iter()
        .any(|l| std::path::Path::new("/sys/class/net").join(l).exists())
    {
        assert!(
            Instant::now() < deadline,
            "pooled veths left after stop: {pool:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A log line without tracing's colour codes.
fn without_colours(line: &str) -> String {
    line.split('\x1b')
        .map(|part| part.split_once('m').map_or(part, |(_, rest)| rest))
        .collect()
}

/// Resolves `name` in the sandbox through its resolv.conf: the addresses, or None when the
/// lookup failed.
async fn lookup(client: &Client, id: &str, name: &str) -> Option<Vec<Ipv4Addr>> {
    let (code, out) = run(client, id, &format!("nslookup {name}")).await;
    // busybox prints the server first ("Address: 10.x.0.1:53"), then the answers.
    let addrs: Vec<Ipv4Addr> = out
        .split("Name:")
        .skip(1)
        .flat_map(|part| part.split_whitespace())
        .filter_map(|w| w.parse().ok())
        .collect();
    (code == 0 && !addrs.is_empty()).then_some(addrs)
}

/// Asks the proxy at `server` for `name`'s A record over TCP from inside the sandbox (busybox
/// `nc`, the query written with `printf`): the response code and the answers' addresses.
async fn lookup_tcp(
    client: &Client,
    id: &str,
    server: Ipv4Addr,
    name: &str,
) -> (u8, Vec<Ipv4Addr>) {
    let mut query = vec![0x12, 0x34, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
    for label in name.split('.') {
        query.push(label.len() as u8);
        query.extend_from_slice(label.as_bytes());
    }
    query.extend_from_slice(&[0, 0, 1, 0, 1]);
    let mut framed = (query.len() as u16).to_be_bytes().to_vec();
    framed.extend_from_slice(&query);
    let escaped: String = framed.iter().map(|b| format!("\\{b:03o}")).collect();
    let (code, out) = run(
        client,
        id,
        &format!("printf '{escaped}' | nc -w 8 {server} 53 | od -An -tu1 -v"),
    )
    .await;
    let reply: Vec<u8> = out
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    assert!(code == 0 && reply.len() >= 14, "no TCP answer: {out:?}");
    assert_eq!(
        usize::from(u16::from_be_bytes([reply[0], reply[1]])),
        reply.len() - 2
    );
    let reply = &reply[2..];
    assert_eq!(&reply[..2], &[0x12, 0x34], "the reply answers our query");
    // Answers are the last records; an A record ends with type, class, TTL, length 4 and
    // the address, so its 4 bytes follow "0 4" after type 1.
    let answers = u16::from_be_bytes([reply[6], reply[7]]) as usize;
    let addrs = reply
        .windows(14)
        .filter(|w| w[..4] == [0, 1, 0, 1] && w[8..10] == [0, 4])
        .map(|w| Ipv4Addr::new(w[10], w[11], w[12], w[13]))
        .take(answers)
        .collect();
    (reply[3] & 0x0f, addrs)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns_proxy_answers_only_allowed_names() {
    let net = Internet::new();
    let args = net.daemon_args(free_port());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (daemon, client) = Daemon::start("net-dns", &args).await;
    let open = create(&client, policy(&["pypi-mirror"])).await;
    let closed = create(&client, NetworkPolicy::default()).await;

    // The name's address is closed until the proxy resolved it for this sandbox.
    assert!(!reaches(&client, &open, net.mirror, 8080).await);
    assert_eq!(
        lookup(&client, &open, "mirror.test").await,
        Some(vec![net.mirror])
    );
    // The image's busybox is static, so its wget cannot use the C library's resolver: the
    // page is fetched from the address the lookup gave.
    let (code, page) = run(
        &client,
        &open,
        "ip=$(nslookup mirror.test | sed -n '/^Name:/,$s/^Address: *//p' | head -n1); \
         printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 2 $ip 8080",
    )
    .await;
    assert!(code == 0 && page.contains("hello-mirror"), "{code}: {page}");
    // By name and port only.
    assert!(!reaches(&client, &open, net.mirror, 8081).await);
    let set = sh(&format!("nft list set inet {} dns0", net.bridge));
    assert!(
        set.contains(&format!(
            "{} . {} timeout",
            address_of(&client, &open).await,
            net.mirror
        )) && set.contains("expires"),
        "{set}"
    );

    // Over TCP (what resolvers fall back to): the same answers, the same refusals.
    assert_eq!(
        lookup_tcp(&client, &open, net.gateway(), "mirror.test").await,
        (0, vec![net.mirror])
    );

    // Names no rule allows are refused without asking upstream; so are other record types.
    let asked_before = net.dns.asked().len();
    assert_eq!(
        lookup_tcp(&client, &open, net.gateway(), "forbidden.test").await,
        (5, vec![])
    );
    assert_eq!(lookup(&client, &open, "forbidden.test").await, None);
    assert!(!reaches(&client, &open, net.forbidden, 8080).await);
    let (code, out) = run(&client, &open, "nslookup -type=TXT mirror.test").await;
    assert!(code != 0 && !out.contains("secret"), "{out}");
    // The sandbox without a policy resolves nothing.
    assert_eq!(lookup(&client, &closed, "mirror.test").await, None);
    assert!(!reaches(&client, &closed, net.mirror, 8080).await);
    assert_eq!(net.dns.asked().len(), asked_before, "{:?}", net.dns.asked());

    // Refused queries and denied packets are written to the sandbox's event log (refused
    // queries at most 30 a minute).
    let events = || {
        std::fs::read_to_string(
            daemon
                .state
                .join("sandboxes")
                .join(&open)
                .join("events.log"),
        )
        .unwrap_or_default()
    };
    assert!(
        events().contains("DNS query A \"forbidden.test\" refused"),
        "{}",
        events()
    );
    let (code, out) = run(
        &client,
        &open,
        "i=0; while [ $i -lt 60 ]; do nslookup x$i.forbidden.test >/dev/null 2>&1; i=$((i+1)); done",
    )
    .await;
    assert_eq!(code, 0, "{out}");
    let refused = events().matches("refused").count();
    assert!((30..=32).contains(&refused), "{refused} refusals logged");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !events().contains("packets denied by the policy") {
        assert!(
            Instant::now() < deadline,
            "no denied packets logged: {}",
            events()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // A suffix rule: names below it resolve, tunnel-shaped ones are refused; deny wins.
    client
        .set_network_policy(
            &open,
            NetworkPolicy {
                allow: vec!["tcp:*.mirror.test:8080".into()],
                deny: vec!["secret.mirror.test".into()],
                ..NetworkPolicy::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(
        lookup(&client, &open, "files.mirror.test").await,
        Some(vec![net.mirror])
    );
    assert!(reaches(&client, &open, net.mirror, 8080).await);
    for refused in [
        "mzxw6ytboi2dqnzrgq3tgnbvgy3dsnzyfzxw6ytboi.mirror.test",
        "a.b.c.d.mirror.test",
        "secret.mirror.test",
        "mirror.test",
    ] {
        assert_eq!(lookup(&client, &open, refused).await, None, "{refused}");
    }
    // A policy without the name closes its address at once.
    client
        .set_network_policy(&open, policy(&["tcp:forbidden.test:22"]))
        .await
        .unwrap();
    assert!(!reaches(&client, &open, net.mirror, 8080).await);
    assert_eq!(lookup(&client, &open, "files.mirror.test").await, None);
    assert_eq!(
        lookup(&client, &open, "forbidden.test").await,
        Some(vec![net.forbidden])
    );
    assert!(reaches(&client, &open, net.forbidden, 22).await);
    assert!(!reaches(&client, &open, net.forbidden, 8080).await);

    // Bad domain rules are INVALID_ARGUMENT naming the problem.
    for (rule, needle) in [
        ("tcp:mirror..test:80", "not a domain name"),
        ("tcp:*.mirror.test:0", "1-65535"),
        ("icmp:mirror.test", "TCP and UDP"),
        ("tcp:mi_rror.test:80", "not a domain name"),
    ] {
        let err = client
            .set_network_policy(&open, policy(&[rule]))
            .await
            .expect_err("a bad rule was accepted");
        assert_eq!(err.code(), Some(tonic::Code::InvalidArgument), "{err}");
        assert!(err.to_string().contains(needle), "{rule}: {err}");
    }
    let specs: Vec<String> = (1..=9).map(|p| format!("tcp:mirror.test:{p}")).collect();
    let specs: Vec<&str> = specs.iter().map(String::as_str).collect();
    let err = client
        .set_network_policy(&open, policy(&specs))
        .await
        .expect_err("nine port combinations were accepted");
    assert!(err.to_string().contains("at most 8"), "{err}");
    daemon.stop(client).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn label_wide_policy_change_is_one_call_to_the_node() {
    use dsec_api::v1::network_labels_client::NetworkLabelsClient;
    use dsec_api::v1::SetNetworkPolicyByLabelsRequest;
    let net = Internet::new();
    let api_port = free_port();
    let args = net.daemon_args(api_port);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (daemon, client) = Daemon::start("net-labels", &args).await;
    let labelled = |pairs: &[(&str, &str)]| CreateSandboxRequest {
        memory_mib: 64,
        disk_mib: 16,
        labels: pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..Default::default()
    };
    let mut ids = Vec::new();
    for labels in [
        &[("task", "t1")][..],
        &[("task", "t1"), ("stage", "build")],
        &[("task", "t2")],
    ] {
        ids.push(client.create(labelled(labels)).await.unwrap().id);
    }
    let mut expected = vec![ids[0].clone(), ids[1].clone()];
    expected.sort();
    let t1: std::collections::HashMap<String, String> =
        [("task".to_string(), "t1".to_string())].into();

    // The node's own RPC (on its TCP API), not the SDK's List + per-sandbox fallback.
    let mut labels_api =
        NetworkLabelsClient::connect(format!("http://{}:{api_port}", net.gateway()))
            .await
            .unwrap();
    let request = |network: NetworkPolicy, labels: &std::collections::HashMap<String, String>| {
        SetNetworkPolicyByLabelsRequest {
            labels: labels.clone(),
            network: Some(network),
        }
    };
    let answer = labels_api
        .set_network_policy_by_labels(request(policy(&["mirror"]), &t1))
        .await
        .unwrap()
        .into_inner();
    let changed: Vec<String> = answer.sandboxes.iter().map(|s| s.id.clone()).collect();
    assert_eq!(changed, expected);
    assert!(answer.failed.is_empty(), "{:?}", answer.failed);
    assert!(answer.sandboxes.iter().all(|s| s.access_token.is_empty()));
    for (id, open) in ids.iter().zip([true, true, false]) {
        assert_eq!(reaches(&client, id, net.mirror, 8080).await, open, "{id}");
    }

    // A bad policy changes nothing; a request without labels is refused.
    let bad = labels_api
        .set_network_policy_by_labels(request(policy(&["tcp:10.0.0.0/33"]), &t1))
        .await
        .unwrap_err();
    assert_eq!(bad.code(), tonic::Code::InvalidArgument, "{bad}");
    assert!(reaches(&client, &ids[0], net.mirror, 8080).await);
    let empty = labels_api
        .set_network_policy_by_labels(request(policy(&["mirror"]), &Default::default()))
        .await
        .unwrap_err();
    assert_eq!(empty.code(), tonic::Code::InvalidArgument, "{empty}");

    // The SDK's label-wide method closes them again through the same call.
    let closed = client
        .set_network_policy_by_labels(t1, NetworkPolicy::default())
        .await
        .unwrap();
    let mut closed: Vec<String> = closed.into_iter().map(|s| s.id).collect();
    closed.sort();
    assert_eq!(closed, expected);
    assert!(!reaches(&client, &ids[0], net.mirror, 8080).await);
    let err = client
        .set_network_policy_by_labels(Default::default(), NetworkPolicy::default())
        .await
        .expect_err("a policy for every sandbox was accepted");
    assert!(err.to_string().contains("at least one label"), "{err}");
    for id in &ids {
        client.delete(id).await.unwrap();
    }
    daemon.stop(client).await;
}
