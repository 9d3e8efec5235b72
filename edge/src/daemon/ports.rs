//! Reaching servers on a sandbox's loopback: the public `Ports` service and the daemon's HTTP
//! entry point, both riding on the agent's `Ports.Open` stream.
//!
//! The HTTP entry point reads only the request head (bounded), routes on its Host header
//! `PORT-SANDBOXID.<anything>`, then pipes the whole TCP connection to the sandbox port, so
//! keep-alive, streaming bodies and WebSocket upgrades work unchanged. Every later request on
//! a kept-alive connection goes to the same sandbox port as the first.
//!
//! Ports are private by default: a request must carry the sandbox's access token (header
//! `X-Dsec-Access-Token`, or the host `PORT-ID-TOKEN.<domain>`), compared in constant time,
//! unless the owner made the port public. Without it the answer is 401 whether or not the
//! sandbox exists.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use dsec_api::agent::v1 as agent;
use dsec_api::v1::{
    ports_server, PortRequest, PortResponse, PortUrl, PortUrlRequest, SetPortPublicRequest,
    SetPortPublicResponse,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;
use tonic::{Request, Response, Status, Streaming};

use super::node::Node;
use super::record::Entry;

/// Largest data chunk a client may send on a port stream (as the agent enforces).
pub const MAX_CHUNK: usize = 1 << 20;
/// Largest HTTP request head the entry point reads before routing.
pub const MAX_HEAD: usize = 16 << 10;
/// A client that has not sent its request head by then gets 408.
const HEAD_TIMEOUT: Duration = Duration::from_secs(30);
const READ_CHUNK: usize = 64 << 10;

/// A TCP port number, or INVALID_ARGUMENT naming the bad value.
pub fn check_port(port: u32) -> Result<u16, Status> {
    u16::try_from(port).ok().filter(|p| *p != 0).ok_or_else(|| {
        Status::invalid_argument(format!("port {port} is not a TCP port: give 1-65535"))
    })
}

/// The header that carries a sandbox's access token through the HTTP entry point.
pub const TOKEN_HEADER: &str = "X-Dsec-Access-Token";

/// Equality that takes the same time wherever the first difference is.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

/// Whether a request with `token` may reach `port` of the sandbox.
pub fn allowed(entry: &Entry, port: u16, token: Option<&str>) -> bool {
    let r = entry.record.lock().unwrap_or_else(|e| e.into_inner());
    if r.public_ports.contains(&port) {
        return true;
    }
    match token {
        Some(t) if !r.access_token.is_empty() => {
            constant_time_eq(t.as_bytes(), r.access_token.as_bytes())
        }
        _ => false,
    }
}

/// Agent errors in terms of the sandbox: the agent does not know its id.
fn port_status(id: &str, status: Status) -> Status {
    if status.code() == tonic::Code::Unavailable && status.message().starts_with("nothing listens")
    {
        return Status::unavailable(
            status
                .message()
                .replace("in this sandbox", &format!("in sandbox {id}")),
        );
    }
    super::status::agent_status(id, status)
}

/// An open connection to `port` in the sandbox: data goes in through the sender, comes out of
/// the stream (after the agent's `connected`).
pub async fn open_agent(
    node: &Node,
    id: &str,
    port: u16,
) -> Result<
    (
        mpsc::Sender<agent::PortRequest>,
        Streaming<agent::PortResponse>,
    ),
    Status,
> {
    let entry = node.running(id)?;
    node.metrics
        .port_connections_total
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let (tx, rx) = mpsc::channel(8);
    let open = agent::PortRequest {
        kind: Some(agent::port_request::Kind::Open(agent::PortOpen {
            port: u32::from(port),
        })),
    };
    let _ = tx.send(open).await;
    let mut client = agent::ports_client::PortsClient::new(entry.client.channel());
    let responses = client
        .open(ReceiverStream::new(rx))
        .await
        .map_err(|s| port_status(id, s))?
        .into_inner();
    Ok((tx, responses))
}

// ------------------------------------------------------------------ gRPC

/// Serves `dsec.v1.Ports`.
pub struct PortsService {
    pub node: Arc<Node>,
    /// Where the HTTP entry point listens, if it does.
    pub http: Option<SocketAddr>,
    /// Open needs the sandbox's access token (for private ports): set on the TCP API, not on
    /// the root-only Unix socket.
    pub require_token: bool,
}

/// `PORT-ID.localhost` (public port) or `PORT-ID-TOKEN.localhost`, the Host that routes to a
/// sandbox port.
pub fn host_for(id: &str, port: u16, token: Option<&str>) -> String {
    match token {
        Some(token) => format!("{port}-{id}-{token}.localhost"),
        None => format!("{port}-{id}.localhost"),
    }
}

#[tonic::async_trait]
impl ports_server::Ports for PortsService {
    type OpenStream = std::pin::Pin<
        Box<dyn tokio_stream::Stream<Item = Result<PortResponse, Status>> + Send + 'static>,
    >;

    async fn open(
        &self,
        request: Request<Streaming<PortRequest>>,
    ) -> Result<Response<Self::OpenStream>, Status> {
        use dsec_api::v1::port_request::Kind;
        let mut inbound = request.into_inner();
        let open = match inbound.message().await? {
            Some(PortRequest {
                kind: Some(Kind::Open(open)),
            }) => open,
            _ => {
                return Err(Status::invalid_argument(
                    "the first message of a port stream must be `open` (sandbox_id, port)",
                ))
            }
        };
        let port = check_port(open.port)?;
        let id = open.sandbox_id;
        if self.require_token {
            let entry = self.node.get(&id)?;
            let token = (!open.access_token.is_empty()).then_some(open.access_token.as_str());
            if !allowed(&entry, port, token) {
                return Err(Status::permission_denied(format!(
                    "port {port} of sandbox {id} is private: send the sandbox's access_token (from Create or Get) in PortOpen, or make the port public with Ports.SetPublic"
                )));
            }
        }
        let (tx, responses) = open_agent(&self.node, &id, port).await?;
        // The agent checks order and sizes. Ending this stream half-closes the agent's.
        tokio::spawn(async move {
            while let Ok(Some(message)) = inbound.message().await {
                if tx.send(port_input(message)).await.is_err() {
                    return;
                }
            }
        });
        let entry = self.node.get(&id)?;
        let stream = responses.map(move |item| {
            entry.touch();
            item.map_err(|s| port_status(&id, s))
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn url(&self, request: Request<PortUrlRequest>) -> Result<Response<PortUrl>, Status> {
        let r = request.into_inner();
        let port = check_port(r.port)?;
        let entry = self.node.get(&r.sandbox_id)?;
        let Some(address) = self.http else {
            return Err(Status::failed_precondition(
                "this node serves no HTTP entry point (dsec-edge runs with --http off): restart it with --http ADDR, or use Ports.Open / `dsec port-forward`",
            ));
        };
        let record = entry.record();
        let token = (!record.public_ports.contains(&port)).then_some(record.access_token);
        let host = host_for(&r.sandbox_id, port, token.as_deref());
        Ok(Response::new(PortUrl {
            url: format!("http://{host}:{}/", address.port()),
            host,
            address: address.to_string(),
            access_token: token.unwrap_or_default(),
        }))
    }

    async fn set_public(
        &self,
        request: Request<SetPortPublicRequest>,
    ) -> Result<Response<SetPortPublicResponse>, Status> {
        let r = request.into_inner();
        let port = check_port(r.port)?;
        let public_ports = self.node.set_port_public(&r.sandbox_id, port, r.public)?;
        Ok(Response::new(SetPortPublicResponse { public_ports }))
    }
}

// ------------------------------------------------------------------ HTTP entry point

/// Why a request could not be routed, and the HTTP answer it gets.
#[derive(Debug, thiserror::Error)]
enum RouteError {
    #[error("the request head is larger than {MAX_HEAD} bytes")]
    HeadTooLarge,
    #[error("no complete request head within {HEAD_TIMEOUT:?}")]
    HeadTimeout,
    #[error("the connection closed before a complete request head")]
    Closed,
    #[error("the request has no Host header: send Host: PORT-SANDBOXID.localhost")]
    NoHost,
    #[error("Host {0:?} does not name a sandbox port: use PORT-SANDBOXID.<domain>, e.g. 8080-sb-0123456789ab.localhost")]
    BadHost(String),
    #[error("this sandbox port is private (or there is no such sandbox): send the sandbox's access token in the header `{TOKEN_HEADER}: TOKEN`, or in the host name as PORT-SANDBOXID-TOKEN.<domain>; `dsec url SANDBOXID PORT` prints a URL that carries it, and the sandbox's owner can open the port to everyone with `dsec port-public SANDBOXID PORT`")]
    Unauthorized,
    #[error("{}", .0.message())]
    Sandbox(Status),
    #[error("the node already serves {0} HTTP connections to sandboxes: retry later")]
    TooMany(usize),
}

impl RouteError {
    fn http_status(&self) -> &'static str {
        match self {
            RouteError::HeadTooLarge => "431 Request Header Fields Too Large",
            RouteError::HeadTimeout => "408 Request Timeout",
            RouteError::Closed => "400 Bad Request",
            RouteError::NoHost | RouteError::BadHost(_) => "400 Bad Request",
            RouteError::Unauthorized => "401 Unauthorized",
            RouteError::TooMany(_) => "503 Service Unavailable",
            RouteError::Sandbox(status) => match status.code() {
                tonic::Code::NotFound => "404 Not Found",
                tonic::Code::InvalidArgument => "400 Bad Request",
                tonic::Code::FailedPrecondition => "503 Service Unavailable",
                _ => "502 Bad Gateway",
            },
        }
    }
}

/// Length of an access token in hex.
const TOKEN_HEX: usize = 32;

/// Port, sandbox id and access token (if any) from the first label of a Host value
/// (`8080-sb-0123.localhost:7080`, `8080-sb-0123-<32 hex>.localhost`).
fn route(host: &str) -> Result<(u16, String, Option<String>), RouteError> {
    let bad = || RouteError::BadHost(host.to_string());
    let label = host
        .split(['.', ':'])
        .next()
        .unwrap_or("")
        .to_ascii_lowercase();
    let (port, id) = label.split_once('-').ok_or_else(bad)?;
    let port: u32 = port.parse().map_err(|_| bad())?;
    if id.is_empty() {
        return Err(bad());
    }
    let port = check_port(port).map_err(RouteError::Sandbox)?;
    let (id, token) = match id.rsplit_once('-') {
        Some((id, token))
            if !id.is_empty()
                && token.len() == TOKEN_HEX
                && token.bytes().all(|b| b.is_ascii_hexdigit()) =>
        {
            (id, Some(token.to_string()))
        }
        _ => (id, None),
    };
    Ok((port, id.to_string(), token))
}

/// A header's value from a request head (`name` case-insensitive).
fn header(head: &[u8], name: &str) -> Option<String> {
    let text = String::from_utf8_lossy(head);
    text.split("\r\n").skip(1).find_map(|line| {
        let (n, value) = line.split_once(':')?;
        n.trim()
            .eq_ignore_ascii_case(name)
            .then(|| value.trim().to_string())
    })
}

/// The Host header's value from a request head.
fn host_header(head: &[u8]) -> Option<String> {
    header(head, "host")
}

/// Reads until the end of the request head; returns everything read (head and any body bytes
/// that came with it).
async fn read_head(socket: &mut TcpStream) -> Result<Vec<u8>, RouteError> {
    let mut buf = Vec::with_capacity(4096);
    let mut chunk = [0u8; 4096];
    loop {
        let n = socket
            .read(&mut chunk)
            .await
            .map_err(|_| RouteError::Closed)?;
        if n == 0 {
            return Err(RouteError::Closed);
        }
        // Only the new bytes (and the 3 before them) can complete the terminator.
        let from = buf.len().saturating_sub(3);
        buf.extend_from_slice(&chunk[..n]);
        if let Some(end) = buf[from..].windows(4).position(|w| w == b"\r\n\r\n") {
            if from + end + 4 > MAX_HEAD {
                return Err(RouteError::HeadTooLarge);
            }
            return Ok(buf);
        }
        if buf.len() > MAX_HEAD {
            return Err(RouteError::HeadTooLarge);
        }
    }
}

async fn respond_error(socket: &mut TcpStream, err: &RouteError) {
    let body = format!("dsec: {err}\n");
    let challenge = if matches!(err, RouteError::Unauthorized) {
        format!("WWW-Authenticate: {TOKEN_HEADER} realm=\"dsec sandbox port\"\r\n")
    } else {
        String::new()
    };
    let response = format!(
        "HTTP/1.1 {}\r\n{challenge}Content-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        err.http_status(),
        body.len()
    );
    let _ = socket.write_all(response.as_bytes()).await;
    let _ = socket.shutdown().await;
}

/// Pipes a TCP connection and an agent port stream until both directions are closed.
async fn pipe(
    socket: TcpStream,
    first: Vec<u8>,
    tx: mpsc::Sender<agent::PortRequest>,
    mut responses: Streaming<agent::PortResponse>,
    entry: &Entry,
) {
    use agent::port_request::Kind as Up;
    use agent::port_response::Kind as Down;
    let (mut reader, mut writer) = socket.into_split();
    let up = tokio::spawn(async move {
        let send = |kind| agent::PortRequest { kind: Some(kind) };
        if tx.send(send(Up::Data(first))).await.is_err() {
            return;
        }
        let mut buf = vec![0u8; READ_CHUNK];
        loop {
            match reader.read(&mut buf).await {
                Ok(0) => {
                    let _ = tx.send(send(Up::Eof(agent::PortEof {}))).await;
                    // Keep the request stream open: ending it would also be an eof, but an
                    // idle sender costs nothing and the response side decides the end.
                    tx.closed().await;
                    return;
                }
                Ok(n) => {
                    if tx.send(send(Up::Data(buf[..n].to_vec()))).await.is_err() {
                        return;
                    }
                }
                // A reset client: dropping the sender alone would look like a clean eof.
                Err(_) => return,
            }
        }
    });
    loop {
        match responses.message().await {
            Ok(Some(agent::PortResponse {
                kind: Some(Down::Data(data)),
            })) => {
                // A long-lived connection (a WebSocket) is activity for the idle timeout.
                entry.touch();
                if writer.write_all(&data).await.is_err() {
                    break;
                }
            }
            Ok(Some(agent::PortResponse {
                kind: Some(Down::Eof(_)),
            })) => {
                let _ = writer.shutdown().await;
            }
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => break,
        }
    }
    up.abort();
}

async fn serve_connection(node: Arc<Node>, mut socket: TcpStream) {
    let _ = socket.set_nodelay(true);
    let head = tokio::time::timeout(HEAD_TIMEOUT, read_head(&mut socket))
        .await
        .map_err(|_| RouteError::HeadTimeout)
        .and_then(|head| head);
    let head = match head {
        Ok(head) => head,
        Err(RouteError::Closed) => return,
        Err(err) => return respond_error(&mut socket, &err).await,
    };
    // SandboxFusion's API (`POST /run_code`) on a host that names no sandbox: FnCall.
    let names_sandbox = host_header(&head).is_some_and(|host| route(&host).is_ok());
    if !names_sandbox && dsec_fncall::sandboxfusion::is_api_request(&head) {
        return super::fncall::serve_http(&node, socket, head).await;
    }
    let routed = async {
        let host = host_header(&head).ok_or(RouteError::NoHost)?;
        let (port, id, host_token) = route(&host)?;
        let token = header(&head, TOKEN_HEADER)
            .map(|t| t.to_ascii_lowercase())
            .or(host_token);
        // Unknown sandbox and wrong token look the same to whoever has no token.
        let entry = node.get(&id).map_err(|_| RouteError::Unauthorized)?;
        if !allowed(&entry, port, token.as_deref()) {
            return Err(RouteError::Unauthorized);
        }
        let (tx, responses) = open_agent(&node, &id, port)
            .await
            .map_err(RouteError::Sandbox)?;
        Ok::<_, RouteError>((head, tx, responses, entry))
    }
    .await;
    match routed {
        Ok((head, tx, responses, entry)) => pipe(socket, head, tx, responses, &entry).await,
        Err(RouteError::Closed) => {}
        Err(err) => {
            tracing::debug!(%err, "HTTP entry: request not routed");
            respond_error(&mut socket, &err).await;
        }
    }
}

/// Serves the HTTP entry point until the process ends, at most `max_connections` at once.
pub async fn serve_http(node: Arc<Node>, listener: TcpListener, max_connections: usize) {
    let slots = Arc::new(tokio::sync::Semaphore::new(max_connections));
    loop {
        match listener.accept().await {
            Ok((mut socket, _)) => {
                let Ok(slot) = slots.clone().try_acquire_owned() else {
                    let err = RouteError::TooMany(max_connections);
                    tokio::spawn(async move { respond_error(&mut socket, &err).await });
                    continue;
                };
                let node = node.clone();
                tokio::spawn(async move {
                    serve_connection(node, socket).await;
                    drop(slot);
                });
            }
            Err(err) => {
                // EMFILE and the like: back off instead of spinning.
                tracing::warn!(%err, "HTTP entry: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// A client's port message after its open, as the agent takes it (data and EOF are the same
/// messages in both APIs; a second open goes on as an empty one, which the agent refuses).
fn port_input(message: dsec_api::v1::PortRequest) -> agent::PortRequest {
    use agent::port_request::Kind as ToAgent;
    use dsec_api::v1::port_request::Kind;
    agent::PortRequest {
        kind: message.kind.map(|kind| match kind {
            Kind::Open(_) => ToAgent::Open(agent::PortOpen::default()),
            Kind::Data(data) => ToAgent::Data(data),
            Kind::Eof(eof) => ToAgent::Eof(eof),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_route_to_port_and_sandbox() {
        assert_eq!(
            route("8080-sb-0123456789ab.localhost:7080").unwrap(),
            (8080, "sb-0123456789ab".to_string(), None)
        );
        assert_eq!(
            route("80-SB-AB.example.com").unwrap(),
            (80, "sb-ab".to_string(), None)
        );
        let token = "0123456789abcdef0123456789ABCDEF";
        assert_eq!(
            route(&format!("8080-sb-0123456789ab-{token}.localhost:7080")).unwrap(),
            (
                8080,
                "sb-0123456789ab".to_string(),
                Some(token.to_ascii_lowercase())
            )
        );
        // Not 32 hex digits: part of the id.
        assert_eq!(
            route("8080-sb-0123456789ab-xyz.localhost").unwrap(),
            (8080, "sb-0123456789ab-xyz".to_string(), None)
        );
        for bad in [
            "localhost:7080",
            "x-sb-1.localhost",
            "8080-.localhost",
            "",
            "8080",
        ] {
            assert!(matches!(route(bad), Err(RouteError::BadHost(_))), "{bad}");
        }
        for bad in ["0-sb-1.localhost", "70000-sb-1.localhost"] {
            assert!(matches!(route(bad), Err(RouteError::Sandbox(_))), "{bad}");
        }
    }

    #[test]
    fn host_header_is_found_case_insensitively() {
        let head = b"GET / HTTP/1.1\r\nUser-Agent: x\r\nhOsT:  8080-sb-1.localhost \r\n\r\n";
        assert_eq!(host_header(head).as_deref(), Some("8080-sb-1.localhost"));
        assert_eq!(host_header(b"GET / HTTP/1.1\r\n\r\n"), None);
        let head = b"GET / HTTP/1.1\r\nx-dsec-access-token: abc \r\n\r\n";
        assert_eq!(header(head, TOKEN_HEADER).as_deref(), Some("abc"));
    }

    #[test]
    fn tokens_compare_whole() {
        assert!(constant_time_eq(b"abcd", b"abcd"));
        assert!(!constant_time_eq(b"abcd", b"abce"));
        assert!(!constant_time_eq(b"abcd", b"abc"));
        assert!(!constant_time_eq(b"", b"a"));
    }
}
