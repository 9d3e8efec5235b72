//! Servers inside sandboxes reached through a real dsec-edge daemon (container backend): the
//! Ports gRPC stream (via the Rust SDK), the daemon's HTTP entry point (with curl), and the
//! errors of both. Run as root: `cargo test -p dsec-edge --test ports`.

mod daemon;

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::process::Command;
use std::time::{Duration, Instant};

use daemon::Daemon;
use dsec_sdk::Client;

/// An HTTP/1.1 keep-alive server for one connection (run by `nc -e`): answers each request
/// with its number on the connection.
const KEEP_ALIVE_SERVER: &str = r#"#!/bin/sh
n=0
cr=$(printf '\r')
while read -r line; do
  while read -r h; do
    case "$h" in "$cr"|"") break ;; esac
  done
  n=$((n + 1))
  printf 'HTTP/1.1 200 OK\r\nContent-Length: 6\r\nContent-Type: text/plain\r\n\r\nreq %s\n' "$n"
done
"#;

/// Deterministic, incompressible-looking test data.
fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

async fn sh(client: &Client, id: &str, script: &str) {
    let out = client.exec(id, &["sh", "-c", script], None).await.unwrap();
    assert_eq!(
        out.exit_code(),
        0,
        "{script}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Starts busybox httpd on 127.0.0.1:8080 serving /www, and waits until it accepts.
async fn start_httpd(client: &Client, id: &str, index: &str, big: &[u8]) {
    client
        .write_file(id, "/www/index.html", 0o644, index.as_bytes().to_vec())
        .await
        .unwrap();
    client
        .write_file(id, "/www/big.bin", 0o644, big.to_vec())
        .await
        .unwrap();
    // Without -f httpd daemonizes, so the exec returns.
    sh(client, id, "busybox httpd -p 127.0.0.1:8080 -h /www").await;
    wait_listening(client, id, 8080).await;
}

async fn wait_listening(client: &Client, id: &str, port: u32) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match client.open_port(id, port).await {
            Ok(mut stream) => {
                stream.close_write().await.unwrap();
                let _ = stream.recv_to_end().await;
                return;
            }
            Err(err) if err.code() == Some(tonic::Code::Unavailable) => {
                assert!(
                    Instant::now() < deadline,
                    "port {port} never listened: {err}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(err) => panic!("open port {port}: {err}"),
        }
    }
}

/// The body of an HTTP/1.0 response (whose end is the connection's end).
fn body_of(response: &[u8]) -> &[u8] {
    let end = response
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("response has a head");
    &response[end + 4..]
}

async fn get_over_grpc(client: &Client, id: &str, path: &str) -> Vec<u8> {
    let mut stream = client.open_port(id, 8080).await.unwrap();
    let request = format!("GET {path} HTTP/1.0\r\nHost: sandbox\r\n\r\n");
    stream.send(request.as_bytes()).await.unwrap();
    stream.close_write().await.unwrap();
    let response = stream.recv_to_end().await.unwrap();
    assert!(
        response.starts_with(b"HTTP/1.0 200 OK") || response.starts_with(b"HTTP/1.1 200 OK"),
        "{}",
        String::from_utf8_lossy(&response[..response.len().min(200)])
    );
    body_of(&response).to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn servers_in_sandboxes_reached_over_grpc_and_http() {
    let (daemon, client) = Daemon::start("reach", &[]).await;
    let big = pattern(1 << 20, 7);
    let a = client.create(Default::default()).await.unwrap();
    let b = client.create(Default::default()).await.unwrap();
    let (tok_a, tok_b) = (a.access_token, b.access_token);
    let (a, b) = (a.id, b.id);
    start_httpd(&client, &a, "page of A\n", &big).await;
    start_httpd(&client, &b, "page of B\n", &big[..1000]).await;

    // (a) The gRPC stream: a page and a 1 MiB body, byte-exact.
    assert_eq!(
        get_over_grpc(&client, &a, "/index.html").await,
        b"page of A\n"
    );
    assert_eq!(
        get_over_grpc(&client, &b, "/index.html").await,
        b"page of B\n"
    );
    assert!(get_over_grpc(&client, &a, "/big.bin").await == big);

    // (b) The HTTP entry point with curl: routed by Host, two sandboxes on one port apart.
    let host_a = format!("8080-{a}-{tok_a}.localhost");
    let host_b = format!("8080-{b}-{tok_b}.localhost");
    assert_eq!(
        daemon.curl(&host_a, "/index.html", &[]),
        (200, b"page of A\n".to_vec())
    );
    assert_eq!(
        daemon.curl(&host_b, "/index.html", &[]),
        (200, b"page of B\n".to_vec())
    );
    let (code, body) = daemon.curl(&host_a, "/big.bin", &[]);
    assert_eq!(code, 200);
    assert!(body == big, "1 MiB body through the entry point differs");
    // A 1 MiB upload through the entry point neither hangs nor wedges it. busybox httpd may
    // answer a POST to a static file or close before reading all of it (curl then reports an
    // empty reply), so only a timeout counts as failure; the byte-exact upload path is the
    // echo test below.
    let upload = daemon.state.with_extension("upload");
    std::fs::write(&upload, &big).unwrap();
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "20", "-o", "/dev/null"])
        .args(["-H", &format!("Host: {host_a}")])
        .args(["--data-binary", &format!("@{}", upload.display())])
        .arg(format!("http://{}/index.html", daemon.http))
        .output()
        .unwrap();
    std::fs::remove_file(&upload).unwrap();
    assert_ne!(out.status.code(), Some(28), "1 MiB upload timed out");
    assert_eq!(
        daemon.curl(&host_a, "/index.html", &[]),
        (200, b"page of A\n".to_vec()),
        "the entry point stopped serving after an upload"
    );

    // The URL the node hands out works as-is (`*.localhost` resolves to 127.0.0.1).
    let url = client.port_url(&a, 8080).await.unwrap();
    assert_eq!(url.host, host_a);
    assert_eq!(url.address, daemon.http.to_string());
    assert_eq!(url.url, format!("http://{host_a}:{}/", daemon.http.port()));
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "20"])
        .arg(format!("{}index.html", url.url))
        .output()
        .unwrap();
    assert_eq!(
        out.stdout,
        b"page of A\n",
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Raw TCP both ways at once: an echo server gets 1 MiB and sends it back while we still
    // write (a pipe that blocks one way while the other is full would deadlock here).
    sh(
        &client,
        &a,
        "busybox nc -ll -p 9000 -e cat </dev/null >/dev/null 2>&1 &",
    )
    .await;
    wait_listening(&client, &a, 9000).await;
    let mut stream = client.open_port(&a, 9000).await.unwrap();
    stream.send(&big).await.unwrap();
    stream.close_write().await.unwrap();
    let echoed = stream.recv_to_end().await.unwrap();
    assert!(echoed == big, "echo returned {} bytes", echoed.len());

    // Keep-alive: a server that answers many requests on one connection (numbering them)
    // gets all of curl's requests over one piped connection.
    client
        .write_file(&a, "/ka.sh", 0o755, KEEP_ALIVE_SERVER.as_bytes().to_vec())
        .await
        .unwrap();
    sh(
        &client,
        &a,
        "busybox nc -ll -p 9001 -e /ka.sh </dev/null >/dev/null 2>&1 &",
    )
    .await;
    wait_listening(&client, &a, 9001).await;
    let url = format!("http://9001-{a}-{tok_a}.localhost:{}/", daemon.http.port());
    let out = Command::new("curl")
        .args(["-sS", "-v", "--max-time", "20"])
        .args([&url, &url, &url])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "req 1\nreq 2\nreq 3\n",
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("Re-using existing connection"));

    // The entry point pipes the whole connection: after the request head, later bytes (as a
    // WebSocket would send) reach the server and its answers come back on the same socket.
    let mut socket = std::net::TcpStream::connect(daemon.http).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let head = format!(
        "GET /ws HTTP/1.1\r\nHost: 9000-{a}-{tok_a}.localhost\r\nUpgrade: websocket\r\n\r\n"
    );
    socket.write_all(head.as_bytes()).unwrap();
    let mut echoed = vec![0u8; head.len()];
    socket.read_exact(&mut echoed).unwrap();
    assert_eq!(echoed, head.as_bytes());
    for round in 0..3 {
        let frame = format!("frame {round}");
        socket.write_all(frame.as_bytes()).unwrap();
        let mut back = vec![0u8; frame.len()];
        socket.read_exact(&mut back).unwrap();
        assert_eq!(back, frame.as_bytes());
    }
    socket.shutdown(std::net::Shutdown::Write).unwrap();
    let mut rest = Vec::new();
    socket.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty());

    // Every connection above was counted.
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "20"])
        .arg(format!("http://{}/metrics", daemon.metrics))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let count: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("dsec_port_connections_total "))
        .unwrap_or_else(|| panic!("no port metric in {text}"))
        .parse()
        .unwrap();
    assert!(count >= 12, "dsec_port_connections_total {count}");

    client.delete(&a).await.unwrap();
    client.delete(&b).await.unwrap();
    drop(daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_ports_and_sandboxes_get_clear_errors() {
    let (daemon, client) = Daemon::start("errors", &[]).await;
    let sb = client.create(Default::default()).await.unwrap();
    let (id, token) = (sb.id, sb.access_token);

    // Closed port: UNAVAILABLE naming port and sandbox; 502 with the same text over HTTP.
    let err = client.open_port(&id, 8081).await.unwrap_err();
    assert_eq!(err.code(), Some(tonic::Code::Unavailable), "{err}");
    assert!(
        err.to_string()
            .contains(&format!("nothing listens on port 8081 in sandbox {id}")),
        "{err}"
    );
    let (code, body) = daemon.curl(&format!("8081-{id}-{token}.localhost"), "/", &[]);
    assert_eq!(code, 502);
    assert!(
        String::from_utf8_lossy(&body).contains("nothing listens on port 8081"),
        "{}",
        String::from_utf8_lossy(&body)
    );

    // Unknown sandbox: NOT_FOUND over gRPC (root-only socket); over HTTP 401, the same as a
    // missing token, so that nobody without one learns which sandboxes exist.
    let err = client.open_port("sb-000000000000", 80).await.unwrap_err();
    assert_eq!(err.code(), Some(tonic::Code::NotFound), "{err}");
    let (code, body) = daemon.curl("80-sb-000000000000.localhost", "/", &[]);
    assert_eq!(code, 401);
    assert_eq!(
        (code, body),
        daemon.curl(&format!("80-{id}.localhost"), "/", &[])
    );
    let err = client.port_url("sb-000000000000", 80).await.unwrap_err();
    assert_eq!(err.code(), Some(tonic::Code::NotFound), "{err}");

    // Ports outside 1-65535: INVALID_ARGUMENT / 400.
    for port in [0, 65536, u32::MAX] {
        let err = client.open_port(&id, port).await.unwrap_err();
        assert_eq!(err.code(), Some(tonic::Code::InvalidArgument), "{err}");
        assert!(err.to_string().contains("give 1-65535"), "{err}");
        let err = client.port_url(&id, port).await.unwrap_err();
        assert_eq!(err.code(), Some(tonic::Code::InvalidArgument), "{err}");
    }
    let (code, _) = daemon.curl(&format!("0-{id}.localhost"), "/", &[]);
    assert_eq!(code, 400);

    // A Host that names no sandbox port, and no Host at all: 400 saying what to send.
    let (code, body) = daemon.curl("localhost", "/", &[]);
    assert_eq!(code, 400);
    assert!(String::from_utf8_lossy(&body).contains("PORT-SANDBOXID"));
    let mut socket = std::net::TcpStream::connect(daemon.http).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    socket.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
    let mut response = String::new();
    socket.read_to_string(&mut response).unwrap();
    assert!(response.starts_with("HTTP/1.1 400"), "{response}");
    assert!(response.contains("no Host header"), "{response}");

    // An oversized request head is cut off with 431, not buffered without end.
    let mut socket = std::net::TcpStream::connect(daemon.http).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let filler = format!(
        "GET / HTTP/1.1\r\nHost: 8080-{id}.localhost\r\nX-Filler: {}\r\n\r\n",
        "a".repeat(32 << 10)
    );
    let _ = socket.write_all(filler.as_bytes());
    let mut response = Vec::new();
    let _ = socket.read_to_end(&mut response);
    assert!(
        response.starts_with(b"HTTP/1.1 431"),
        "{}",
        String::from_utf8_lossy(&response)
    );

    // Paused: FAILED_PRECONDITION / 503; after resume the port is reachable again.
    sh(
        &client,
        &id,
        "busybox nc -ll -p 9000 -e cat </dev/null >/dev/null 2>&1 &",
    )
    .await;
    wait_listening(&client, &id, 9000).await;
    client.pause(&id).await.unwrap();
    let err = client.open_port(&id, 9000).await.unwrap_err();
    assert_eq!(err.code(), Some(tonic::Code::FailedPrecondition), "{err}");
    let (code, body) = daemon.curl(&format!("9000-{id}-{token}.localhost"), "/", &[]);
    assert_eq!(code, 503);
    assert!(String::from_utf8_lossy(&body).contains("paused"));
    client.resume(&id).await.unwrap();
    wait_listening(&client, &id, 9000).await;

    // Deleting the sandbox ends an open connection with an error instead of a hang.
    let mut stream = client.open_port(&id, 9000).await.unwrap();
    stream.send(b"ping").await.unwrap();
    assert_eq!(stream.recv().await.unwrap().unwrap(), b"ping");
    client.delete(&id).await.unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(20), stream.recv_to_end()).await;
    assert!(
        ended.is_ok(),
        "the stream hung after the sandbox was deleted"
    );
    drop(daemon);
}

#[test]
fn bad_http_flags_are_named() {
    for (args, expected) in [
        (
            ["--http", "nonsense"],
            "--http \"nonsense\": expected HOST:PORT or off",
        ),
        (
            ["--http-max-connections", "0"],
            "--http-max-connections must be at least 1",
        ),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_dsec-edge"))
            .args(args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    }
}

/// An address the operator gave that another process holds stops the start with an error
/// naming the flag (before, the daemon ran without it and requests reached the other one).
#[test]
fn an_http_address_in_use_stops_the_start() {
    let holder = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let busy = holder.local_addr().unwrap().to_string();
    let state = std::env::temp_dir().join(format!("dsec-edge-busy-{}", std::process::id()));
    for (flag, other) in [("--http", "--metrics"), ("--metrics", "--http")] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_dsec-edge"))
            .arg("--state-dir")
            .arg(&state)
            .args([flag, &busy, other, "off"])
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("{flag} {busy} (in use): the daemon kept running");
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let mut stderr = String::new();
        child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut stderr)
            .unwrap();
        assert!(!status.success(), "{flag} {busy}: {stderr}");
        assert!(
            stderr.contains(&format!("bind {flag} {busy}")) && stderr.contains("in use"),
            "{flag} {busy}: {stderr}"
        );
    }
    let _ = std::fs::remove_dir_all(&state);
}

/// Sends a request for an unknown sandbox on a fresh connection; returns the status line.
fn status_line(http: SocketAddr) -> String {
    let mut socket = std::net::TcpStream::connect(http).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    socket
        .write_all(b"GET / HTTP/1.1\r\nHost: 80-sb-000000000000.localhost\r\n\r\n")
        .unwrap();
    let mut response = String::new();
    let _ = socket.read_to_string(&mut response);
    response
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_connections_are_capped() {
    let (daemon, _client) = Daemon::start("cap", &["--http-max-connections", "2"]).await;
    // Two idle connections (no request head yet) hold both slots...
    let idle: Vec<_> = (0..2)
        .map(|_| std::net::TcpStream::connect(daemon.http).unwrap())
        .collect();
    // ...so the third is answered 503 at once instead of queueing.
    let response = status_line(daemon.http);
    assert!(response.starts_with("HTTP/1.1 503"), "{response}");
    assert!(
        response.contains("already serves 2 HTTP connections"),
        "{response}"
    );
    // A closed connection frees its slot.
    drop(idle);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let response = status_line(daemon.http);
        if response.starts_with("HTTP/1.1 401") {
            break;
        }
        assert!(Instant::now() < deadline, "slots never freed: {response}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandbox_ports_are_private_unless_made_public() {
    let api = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let (mut daemon, client) = Daemon::start("private", &["--listen", &api.to_string()]).await;
    let a = client.create(Default::default()).await.unwrap();
    let b = client
        .create(dsec_sdk::CreateSandboxRequest {
            public_ports: vec![8080],
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(a.access_token.len(), 32);
    assert_ne!(a.access_token, b.access_token);
    assert_eq!(b.public_ports, [8080]);
    // Get returns the token to the owner; List does not carry it.
    assert_eq!(
        client.get(&a.id).await.unwrap().access_token,
        a.access_token
    );
    let listed = client.list(Default::default()).await.unwrap();
    assert!(listed.iter().all(|s| s.access_token.is_empty()));
    start_httpd(&client, &a.id, "page of A\n", b"").await;
    start_httpd(&client, &b.id, "page of B\n", b"").await;
    let plain_a = format!("8080-{}.localhost", a.id);
    let header = |token: &str| format!("X-Dsec-Access-Token: {token}");

    // No token: 401 saying how to authenticate; the same for an unknown sandbox.
    let (code, body) = daemon.curl(&plain_a, "/index.html", &[]);
    assert_eq!(code, 401);
    let text = String::from_utf8_lossy(&body);
    assert!(
        text.contains("X-Dsec-Access-Token: TOKEN") && text.contains("dsec url"),
        "{text}"
    );
    assert_eq!(
        daemon.curl("8080-sb-000000000000.localhost", "/index.html", &[]),
        (code, body.clone())
    );
    // The token in the header or in the host name: served.
    let page_a = (200, b"page of A\n".to_vec());
    assert_eq!(
        daemon.curl(&plain_a, "/index.html", &["-H", &header(&a.access_token)]),
        page_a
    );
    let with_token = format!("8080-{}-{}.localhost", a.id, a.access_token);
    assert_eq!(daemon.curl(&with_token, "/index.html", &[]), page_a);
    // Another sandbox's token, or a wrong one: refused.
    assert_eq!(
        daemon
            .curl(&plain_a, "/index.html", &["-H", &header(&b.access_token)])
            .0,
        401
    );
    let wrong = format!("8080-{}-{}.localhost", a.id, b.access_token);
    assert_eq!(daemon.curl(&wrong, "/index.html", &[]).0, 401);
    // A public port needs none.
    let plain_b = format!("8080-{}.localhost", b.id);
    assert_eq!(
        daemon.curl(&plain_b, "/index.html", &[]),
        (200, b"page of B\n".to_vec())
    );
    // A local user who is not root: refused without the token, served on a public port.
    assert_eq!(daemon.curl_as("nobody", &plain_a, "/index.html").0, 401);
    assert_eq!(daemon.curl_as("nobody", &plain_b, "/index.html").0, 200);

    // Ports.Url hands out what works: the token in the host, none for a public port.
    let url = client.port_url(&a.id, 8080).await.unwrap();
    assert_eq!(url.host, with_token);
    assert_eq!(url.access_token, a.access_token);
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "20"])
        .arg(format!("{}index.html", url.url))
        .output()
        .unwrap();
    assert_eq!(out.stdout, b"page of A\n");
    assert_eq!(client.port_url(&b.id, 8080).await.unwrap().host, plain_b);

    // Public while running, and private again.
    assert_eq!(
        client.set_port_public(&a.id, 8080, true).await.unwrap(),
        [8080]
    );
    assert_eq!(daemon.curl(&plain_a, "/index.html", &[]), page_a);
    assert_eq!(daemon.curl_as("nobody", &plain_a, "/index.html").0, 200);
    assert!(client
        .set_port_public(&a.id, 8080, false)
        .await
        .unwrap()
        .is_empty());
    assert_eq!(daemon.curl(&plain_a, "/index.html", &[]).0, 401);

    // Ports.Open on the TCP API: private ports need the token; the SDK fetches it.
    let tcp = Client::connect(&format!("http://{api}")).await.unwrap();
    for token in ["", b.access_token.as_str()] {
        let err = tcp
            .open_port_with_token(&a.id, 8080, token)
            .await
            .unwrap_err();
        assert_eq!(err.code(), Some(tonic::Code::PermissionDenied), "{err}");
        assert!(err.to_string().contains("is private"), "{err}");
    }
    let mut stream = tcp.open_port(&a.id, 8080).await.unwrap();
    stream
        .send(b"GET /index.html HTTP/1.0\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    stream.close_write().await.unwrap();
    assert_eq!(
        body_of(&stream.recv_to_end().await.unwrap()),
        b"page of A\n"
    );
    let mut public = tcp.open_port_with_token(&b.id, 8080, "").await.unwrap();
    public.close_write().await.unwrap();
    let _ = public.recv_to_end().await;
    // On the root-only Unix socket no token is needed.
    let mut local = client.open_port_with_token(&a.id, 8080, "").await.unwrap();
    local.close_write().await.unwrap();
    let _ = local.recv_to_end().await;
    drop(tcp);

    // The token is in the root-only record, not in the daemon's log, and survives a restart.
    let meta = daemon.state.join("sandboxes").join(&a.id).join("meta.json");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&meta).unwrap().permissions().mode() & 0o777,
        0o600
    );
    daemon.kill9();
    drop(client);
    let client = daemon.restart().await;
    assert_eq!(daemon.curl(&with_token, "/index.html", &[]), page_a);
    assert_eq!(daemon.curl(&plain_a, "/index.html", &[]).0, 401);
    assert_eq!(
        client.get(&b.id).await.unwrap().public_ports,
        [8080],
        "public ports lost on restart"
    );
    assert!(!daemon.log().contains(&a.access_token), "token logged");
    drop(daemon);
}
