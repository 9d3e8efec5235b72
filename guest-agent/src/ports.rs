//! The Ports service: TCP connections to servers on the sandbox's loopback (127.0.0.1, else
//! ::1), piped over a gRPC stream (the node's HTTP entry point and `dsec port-forward` ride on
//! it).

use std::time::Duration;

use dsec_api::agent::v1::ports_server::Ports;
use dsec_api::agent::v1::{
    port_request, port_response, PortConnected, PortEof, PortRequest, PortResponse,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

/// Largest data chunk a client may send (the gRPC decoder limit is set a little above it).
pub const MAX_CHUNK: usize = 1 << 20;
/// Chunks the agent sends: small enough to keep latency low, big enough for throughput.
const READ_CHUNK: usize = 64 << 10;
/// A loopback connect either succeeds or is refused at once; this only guards odd stacks.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves `dsec.agent.v1.Ports`.
pub struct PortsService;

/// Outcome of the client-to-sandbox direction.
enum Upstream {
    /// The client half-closed; the socket's write side was shut down.
    Closed,
    /// The client went away (stream error, cancelled call): tear everything down.
    Gone,
    /// The client broke the protocol: report this status.
    Failed(Status),
}

/// Client -> sandbox: writes data chunks until `eof` or the end of the request stream.
async fn upstream(mut inbound: Streaming<PortRequest>, mut socket: OwnedWriteHalf) -> Upstream {
    loop {
        match inbound.message().await {
            Ok(Some(PortRequest {
                kind: Some(port_request::Kind::Data(data)),
            })) => {
                if data.len() > MAX_CHUNK {
                    return Upstream::Failed(Status::invalid_argument(format!(
                        "data chunk of {} bytes: send at most {MAX_CHUNK} bytes per message",
                        data.len()
                    )));
                }
                if let Err(err) = socket.write_all(&data).await {
                    return Upstream::Failed(Status::aborted(format!(
                        "the server in the sandbox closed the connection: {err}"
                    )));
                }
            }
            Ok(Some(PortRequest {
                kind: Some(port_request::Kind::Eof(_)),
            }))
            | Ok(None) => {
                let _ = socket.shutdown().await;
                return Upstream::Closed;
            }
            Ok(Some(_)) => {
                return Upstream::Failed(Status::invalid_argument(
                    "only data and eof may follow `open` on a port stream",
                ))
            }
            Err(_) => return Upstream::Gone,
        }
    }
}

/// Pipes one connection until both directions are closed, the client goes away, or an error
/// ends it (sent as the stream's status).
async fn pipe(
    inbound: Streaming<PortRequest>,
    socket: TcpStream,
    tx: mpsc::Sender<Result<PortResponse, Status>>,
) {
    let (mut reader, writer) = socket.into_split();
    // Its own task: a server that stops reading while it writes must not stall our reads.
    let mut up = tokio::spawn(upstream(inbound, writer));
    let mut up_done = false;
    let mut down_open = true;
    let mut buf = vec![0u8; READ_CHUNK];
    let send = |kind| PortResponse { kind: Some(kind) };
    while down_open || !up_done {
        tokio::select! {
            read = reader.read(&mut buf), if down_open => match read {
                Ok(0) => {
                    down_open = false;
                    if tx.send(Ok(send(port_response::Kind::Eof(PortEof {})))).await.is_err() {
                        break;
                    }
                }
                Ok(n) => {
                    let data = send(port_response::Kind::Data(buf[..n].to_vec()));
                    if tx.send(Ok(data)).await.is_err() {
                        break;
                    }
                }
                Err(err) => {
                    let _ = tx
                        .send(Err(Status::aborted(format!(
                            "the connection in the sandbox failed: {err}"
                        ))))
                        .await;
                    break;
                }
            },
            result = &mut up, if !up_done => match result {
                Ok(Upstream::Closed) => up_done = true,
                Ok(Upstream::Failed(status)) => {
                    let _ = tx.send(Err(status)).await;
                    break;
                }
                Ok(Upstream::Gone) | Err(_) => break,
            },
            _ = tx.closed() => break,
        }
    }
    up.abort();
}

/// Connects to the port on IPv4 loopback, then IPv6 loopback: servers told to listen on
/// "localhost" bind either, depending on the runtime.
async fn connect(port: u16) -> Result<TcpStream, Status> {
    let mut refused = 0;
    for ip in ["127.0.0.1", "::1"] {
        match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect((ip, port))).await {
            Ok(Ok(socket)) => return Ok(socket),
            // No IPv6 on this loopback counts as nothing listening there.
            Ok(Err(err))
                if matches!(
                    err.kind(),
                    std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::AddrNotAvailable
                ) || matches!(
                    err.raw_os_error(),
                    Some(libc::EAFNOSUPPORT | libc::ENETUNREACH)
                ) =>
            {
                refused += 1
            }
            Ok(Err(err)) => {
                return Err(Status::unavailable(format!(
                    "cannot connect to {ip} port {port} in this sandbox: {err}"
                )))
            }
            Err(_) => {
                return Err(Status::unavailable(format!(
                    "connecting to {ip} port {port} in this sandbox timed out after {CONNECT_TIMEOUT:?}"
                )))
            }
        }
    }
    debug_assert_eq!(refused, 2);
    Err(Status::unavailable(format!(
        "nothing listens on port {port} in this sandbox (connections to 127.0.0.1:{port} and [::1]:{port} refused): start the server first"
    )))
}

#[tonic::async_trait]
impl Ports for PortsService {
    type OpenStream = ReceiverStream<Result<PortResponse, Status>>;

    async fn open(
        &self,
        request: Request<Streaming<PortRequest>>,
    ) -> Result<Response<Self::OpenStream>, Status> {
        let mut inbound = request.into_inner();
        let port = match inbound.message().await? {
            Some(PortRequest {
                kind: Some(port_request::Kind::Open(open)),
            }) => open.port,
            _ => {
                return Err(Status::invalid_argument(
                    "the first message of a port stream must be `open` (port)",
                ))
            }
        };
        let port = u16::try_from(port)
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| {
                Status::invalid_argument(format!("port {port} is not a TCP port: give 1-65535"))
            })?;
        let socket = connect(port).await?;
        let _ = socket.set_nodelay(true);
        let (tx, rx) = mpsc::channel(8);
        let _ = tx
            .send(Ok(PortResponse {
                kind: Some(port_response::Kind::Connected(PortConnected {})),
            }))
            .await;
        tokio::spawn(pipe(inbound, socket, tx));
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}
