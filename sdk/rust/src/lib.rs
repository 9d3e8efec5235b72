//! Rust client of the DSec node API (`dsec.v1`): create sandboxes, run commands, move files,
//! keep shell sessions, pause/resume/fork. All calls go through one multiplexed connection.
//!
//! ```no_run
//! # async fn demo() -> Result<(), dsec_sdk::Error> {
//! let client = dsec_sdk::Client::connect(&dsec_sdk::default_target()).await?;
//! let sb = client.create(dsec_sdk::CreateSandboxRequest::default()).await?;
//! let out = client.exec(&sb.id, &["echo", "hi"], None).await?;
//! assert_eq!(out.stdout, b"hi\n");
//! client.delete(&sb.id).await?;
//! # Ok(()) }
//! ```

use std::path::PathBuf;

use dsec_api::v1::files_client::FilesClient;
use dsec_api::v1::ports_client::PortsClient;
use dsec_api::v1::process_client::ProcessClient;
use dsec_api::v1::sandboxes_client::SandboxesClient;
use dsec_api::v1::sessions_client::SessionsClient;
pub use dsec_api::v1::*;
use hyper_util::rt::TokioIo;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};

/// Where the local node listens unless `DSEC_ENDPOINT` says otherwise.
pub const DEFAULT_TARGET: &str = "unix:/run/dsec/edge/edge.sock";

pub fn default_target() -> String {
    std::env::var("DSEC_ENDPOINT")
        .ok()
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| DEFAULT_TARGET.to_string())
}

/// How often [`Client::create`] tries when the node is unreachable.
pub const CREATE_ATTEMPTS: u32 = 3;

/// A random Create request_id (128 bits, hex).
pub fn new_request_id() -> String {
    use std::io::Read;
    let mut bytes = [0u8; 16];
    let random = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes));
    if random.is_err() {
        // No /dev/urandom: time, pid and a counter are unique enough for one client.
        static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        bytes[..8].copy_from_slice(&nanos.to_le_bytes());
        bytes[8..12].copy_from_slice(&std::process::id().to_le_bytes());
        bytes[12..].copy_from_slice(&(n as u32).to_le_bytes());
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Errors of the SDK.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot connect to the DSec node at {target}: {reason} (is `dsec up` running?)")]
    Connect { target: String, reason: String },
    #[error("{}: {}", .0.code(), .0.message())]
    Status(#[from] tonic::Status),
    #[error("the exec stream ended without an exit status")]
    NoExit,
    #[error("the port stream ended before the node confirmed the connection")]
    NoConnected,
    #[error("local socket error while piping a sandbox port: {0}")]
    Io(#[from] std::io::Error),
    #[error("the command's input stream is closed (the command ended or the call failed): read its output for the exit status or error")]
    InputClosed,
}

impl Error {
    /// The gRPC code when the node refused the call.
    pub fn code(&self) -> Option<tonic::Code> {
        match self {
            Error::Status(s) => Some(s.code()),
            _ => None,
        }
    }
}

pub type Result<T> = std::result::Result<T, Error>;

/// Output of [`Client::exec`].
#[derive(Clone, Debug, Default)]
pub struct ExecOutput {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub code: Option<i32>,
    pub signal: Option<i32>,
    pub timed_out: bool,
}

impl ExecOutput {
    /// Shell convention: the exit code, or 128 + signal.
    pub fn exit_code(&self) -> i32 {
        self.code.or(self.signal.map(|s| 128 + s)).unwrap_or(255)
    }
}

/// A pseudo-terminal request for [`ExecStart::pty`]: `rows` x `cols` (each 1..=4096, the
/// node answers INVALID_ARGUMENT otherwise) and TERM "xterm".
pub fn pty(rows: u32, cols: u32) -> PtyConfig {
    PtyConfig {
        rows,
        cols,
        term: String::new(),
    }
}

/// One event of a running command (see [`ExecSession::next`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExecEvent {
    /// Sent once, first: the command's pid inside the sandbox.
    Started(u32),
    /// Output; with a PTY all output is stdout.
    Stdout(Vec<u8>),
    Stderr(Vec<u8>),
    /// The last event.
    Exit(ExitStatus),
}

/// The input side of a running command; cheap to clone (e.g. into a task feeding stdin).
#[derive(Clone, Debug)]
pub struct ExecInput {
    tx: mpsc::Sender<ExecRequest>,
}

impl ExecInput {
    async fn send(&self, kind: exec_request::Kind) -> Result<()> {
        self.tx
            .send(ExecRequest { kind: Some(kind) })
            .await
            .map_err(|_| Error::InputClosed)
    }

    /// Bytes for the command's stdin (needs `ExecStart::stdin`). On a PTY, byte 0x03 is
    /// Ctrl-C: SIGINT for the foreground process group.
    pub async fn stdin(&self, data: impl Into<Vec<u8>>) -> Result<()> {
        self.send(exec_request::Kind::Stdin(data.into())).await
    }

    /// Ends stdin (on a PTY: sends the EOF character, ^D).
    pub async fn close_stdin(&self) -> Result<()> {
        self.send(exec_request::Kind::StdinEof(StdinEof {})).await
    }

    /// Sends a signal (e.g. 15 for SIGTERM) to the command's process group.
    pub async fn signal(&self, signal: i32) -> Result<()> {
        self.send(exec_request::Kind::Signal(signal)).await
    }

    /// New terminal size of a PTY command (the command gets SIGWINCH). Sizes outside
    /// 1..=4096 end the call with INVALID_ARGUMENT (seen on the output side).
    pub async fn resize(&self, rows: u32, cols: u32) -> Result<()> {
        self.send(exec_request::Kind::Resize(WindowSize { rows, cols }))
            .await
    }
}

/// A command started with [`Client::exec_stream`]. Dropping it ends the call, and the node
/// kills the command.
#[derive(Debug)]
pub struct ExecSession {
    input: ExecInput,
    output: tonic::Streaming<ExecResponse>,
}

impl ExecSession {
    /// A handle to the input side, to use from another task.
    pub fn input(&self) -> ExecInput {
        self.input.clone()
    }

    pub async fn stdin(&self, data: impl Into<Vec<u8>>) -> Result<()> {
        self.input.stdin(data).await
    }

    pub async fn close_stdin(&self) -> Result<()> {
        self.input.close_stdin().await
    }

    pub async fn signal(&self, signal: i32) -> Result<()> {
        self.input.signal(signal).await
    }

    pub async fn resize(&self, rows: u32, cols: u32) -> Result<()> {
        self.input.resize(rows, cols).await
    }

    /// The next event; `None` after the exit status. Errors of the call (e.g.
    /// INVALID_ARGUMENT for a bad resize) come here.
    pub async fn next(&mut self) -> Result<Option<ExecEvent>> {
        loop {
            let Some(message) = self.output.message().await? else {
                return Ok(None);
            };
            return Ok(Some(match message.kind {
                Some(exec_response::Kind::Started(s)) => ExecEvent::Started(s.pid),
                Some(exec_response::Kind::Stdout(d)) => ExecEvent::Stdout(d),
                Some(exec_response::Kind::Stderr(d)) => ExecEvent::Stderr(d),
                Some(exec_response::Kind::Exit(e)) => ExecEvent::Exit(e),
                None => continue,
            }));
        }
    }

    /// Reads to the end: all output collected (bounded only by what the command writes).
    pub async fn wait(mut self) -> Result<ExecOutput> {
        let mut out = ExecOutput::default();
        while let Some(event) = self.next().await? {
            match event {
                ExecEvent::Stdout(d) => out.stdout.extend_from_slice(&d),
                ExecEvent::Stderr(d) => out.stderr.extend_from_slice(&d),
                ExecEvent::Exit(e) => {
                    out.code = e.code;
                    out.signal = e.signal;
                    out.timed_out = e.timed_out;
                    return Ok(out);
                }
                ExecEvent::Started(_) => {}
            }
        }
        Err(Error::NoExit)
    }
}

/// A connection to one node.
#[derive(Clone, Debug)]
pub struct Client {
    channel: Channel,
    /// Connected over TCP: port streams need the sandbox's access token there.
    tcp: bool,
}

impl Client {
    /// `unix:/path/edge.sock` or `http://host:port`.
    pub async fn connect(target: &str) -> Result<Self> {
        let err = |reason: String| Error::Connect {
            target: target.to_string(),
            reason,
        };
        let channel = if let Some(path) = target.strip_prefix("unix:") {
            let path = PathBuf::from(path);
            let connector = tower::service_fn(move |_: tonic::codegen::http::Uri| {
                let path = path.clone();
                async move {
                    tokio::net::UnixStream::connect(path)
                        .await
                        .map(TokioIo::new)
                }
            });
            Endpoint::from_static("http://localhost")
                .connect_with_connector(connector)
                .await
                .map_err(|e| err(e.to_string()))?
        } else {
            Endpoint::from_shared(target.to_string())
                .map_err(|e| err(e.to_string()))?
                .connect()
                .await
                .map_err(|e| err(e.to_string()))?
        };
        Ok(Self {
            channel,
            tcp: !target.starts_with("unix:"),
        })
    }

    fn sandboxes(&self) -> SandboxesClient<Channel> {
        SandboxesClient::new(self.channel.clone())
    }

    fn files(&self) -> FilesClient<Channel> {
        FilesClient::new(self.channel.clone()).max_decoding_message_size(32 << 20)
    }

    pub fn sessions(&self) -> SessionsClient<Channel> {
        SessionsClient::new(self.channel.clone())
    }

    /// Creates a sandbox. Without a `request_id` the SDK picks a fresh random one; the call is
    /// retried (with the same request_id, so the node never makes two sandboxes of it) when
    /// the node is unreachable, up to [`CREATE_ATTEMPTS`] times.
    pub async fn create(&self, mut request: CreateSandboxRequest) -> Result<Sandbox> {
        if request.request_id.is_empty() {
            request.request_id = new_request_id();
        }
        let mut attempt = 1;
        loop {
            match self.sandboxes().create(request.clone()).await {
                Ok(sandbox) => return Ok(sandbox.into_inner()),
                Err(status)
                    if status.code() == tonic::Code::Unavailable && attempt < CREATE_ATTEMPTS =>
                {
                    tokio::time::sleep(std::time::Duration::from_millis(200 << attempt)).await;
                    attempt += 1;
                }
                Err(status) => return Err(status.into()),
            }
        }
    }

    pub async fn get(&self, id: &str) -> Result<Sandbox> {
        Ok(self
            .sandboxes()
            .get(GetSandboxRequest {
                sandbox_id: id.into(),
            })
            .await?
            .into_inner())
    }

    /// Every sandbox carrying all of `labels` (all when empty), in the order of their ids:
    /// pages through the node's List until its last page.
    pub async fn list(
        &self,
        labels: std::collections::HashMap<String, String>,
    ) -> Result<Vec<Sandbox>> {
        let mut all = Vec::new();
        let mut page_token = String::new();
        loop {
            let page = self
                .list_page(ListSandboxesRequest {
                    labels: labels.clone(),
                    page_size: 0,
                    page_token: page_token.clone(),
                })
                .await?;
            all.extend(page.sandboxes);
            // A token that does not advance would loop for ever: the node never sends one.
            if page.next_page_token.is_empty() || page.next_page_token == page_token {
                return Ok(all);
            }
            page_token = page.next_page_token;
        }
    }

    /// One page of List (`page_size` 0 means the node's default of 500, at most 1000).
    pub async fn list_page(&self, request: ListSandboxesRequest) -> Result<ListSandboxesResponse> {
        Ok(self.sandboxes().list(request).await?.into_inner())
    }

    pub async fn delete(&self, id: &str) -> Result<()> {
        self.sandboxes()
            .delete(DeleteSandboxRequest {
                sandbox_id: id.into(),
            })
            .await?;
        Ok(())
    }

    pub async fn pause(&self, id: &str) -> Result<Sandbox> {
        Ok(self
            .sandboxes()
            .pause(PauseSandboxRequest {
                sandbox_id: id.into(),
            })
            .await?
            .into_inner())
    }

    pub async fn resume(&self, id: &str) -> Result<Sandbox> {
        Ok(self
            .sandboxes()
            .resume(ResumeSandboxRequest {
                sandbox_id: id.into(),
            })
            .await?
            .into_inner())
    }

    pub async fn fork(&self, id: &str, count: i32) -> Result<Vec<Sandbox>> {
        Ok(self
            .sandboxes()
            .fork(ForkSandboxRequest {
                sandbox_id: id.into(),
                count,
                labels: Default::default(),
            })
            .await?
            .into_inner()
            .sandboxes)
    }

    pub async fn set_timeout(&self, id: &str, ttl_seconds: i64) -> Result<Sandbox> {
        Ok(self
            .sandboxes()
            .set_timeout(SetTimeoutRequest {
                sandbox_id: id.into(),
                ttl_seconds,
                idle_timeout_seconds: None,
            })
            .await?
            .into_inner())
    }

    pub async fn node_status(&self) -> Result<NodeStatusResponse> {
        Ok(self
            .sandboxes()
            .node_status(NodeStatusRequest {})
            .await?
            .into_inner())
    }

    /// All log chunks of a sandbox (with `follow`, until it is gone: `on_chunk` sees each).
    pub async fn logs(
        &self,
        id: &str,
        follow: bool,
        mut on_chunk: impl FnMut(LogChunk),
    ) -> Result<()> {
        let mut stream = self
            .sandboxes()
            .logs(LogsRequest {
                sandbox_id: id.into(),
                follow,
                tail_bytes: 0,
            })
            .await?
            .into_inner();
        while let Some(chunk) = stream.message().await? {
            on_chunk(chunk);
        }
        Ok(())
    }

    /// Runs `argv` with optional stdin and collects its output.
    pub async fn exec(
        &self,
        id: &str,
        argv: &[&str],
        stdin: Option<Vec<u8>>,
    ) -> Result<ExecOutput> {
        let start = ExecStart {
            sandbox_id: id.into(),
            argv: argv.iter().map(|s| s.to_string()).collect(),
            stdin: stdin.is_some(),
            ..Default::default()
        };
        self.exec_with(start, stdin, |_, _| {}).await
    }

    /// Runs a command; `on_output(is_stderr, data)` sees output as it arrives (it is also
    /// collected unless the caller only streams: collect is bounded by the caller's use).
    pub async fn exec_with(
        &self,
        start: ExecStart,
        stdin: Option<Vec<u8>>,
        mut on_output: impl FnMut(bool, &[u8]),
    ) -> Result<ExecOutput> {
        let (tx, rx) = mpsc::channel(8);
        let _ = tx
            .send(ExecRequest {
                kind: Some(exec_request::Kind::Start(start)),
            })
            .await;
        if let Some(data) = stdin {
            tokio::spawn(async move {
                for chunk in data.chunks(1 << 20) {
                    let m = ExecRequest {
                        kind: Some(exec_request::Kind::Stdin(chunk.to_vec())),
                    };
                    if tx.send(m).await.is_err() {
                        return;
                    }
                }
                let _ = tx
                    .send(ExecRequest {
                        kind: Some(exec_request::Kind::StdinEof(StdinEof {})),
                    })
                    .await;
            });
        } else {
            drop(tx);
        }
        let mut stream = ProcessClient::new(self.channel.clone())
            .exec(ReceiverStream::new(rx))
            .await?
            .into_inner();
        let mut out = ExecOutput::default();
        while let Some(message) = stream.message().await? {
            match message.kind {
                Some(exec_response::Kind::Stdout(d)) => {
                    on_output(false, &d);
                    out.stdout.extend_from_slice(&d);
                }
                Some(exec_response::Kind::Stderr(d)) => {
                    on_output(true, &d);
                    out.stderr.extend_from_slice(&d);
                }
                Some(exec_response::Kind::Exit(e)) => {
                    out.code = e.code;
                    out.signal = e.signal;
                    out.timed_out = e.timed_out;
                    return Ok(out);
                }
                _ => {}
            }
        }
        Err(Error::NoExit)
    }

    /// A TCP connection to 127.0.0.1:`port` inside the sandbox (a server an agent started
    /// there). Errors: NOT_FOUND (unknown sandbox), INVALID_ARGUMENT (port 0 or > 65535),
    /// FAILED_PRECONDITION (paused), UNAVAILABLE (nothing listens on the port).
    /// Over TCP the node wants the sandbox's access token for a private port: it is fetched
    /// with Get (use [`open_port_with_token`](Self::open_port_with_token) to pass it).
    pub async fn open_port(&self, id: &str, port: u32) -> Result<PortStream> {
        let token = if self.tcp {
            self.get(id).await?.access_token
        } else {
            String::new()
        };
        self.open_port_with_token(id, port, &token).await
    }

    /// [`open_port`](Self::open_port) with the sandbox's access token given (empty: none).
    pub async fn open_port_with_token(
        &self,
        id: &str,
        port: u32,
        access_token: &str,
    ) -> Result<PortStream> {
        let (tx, rx) = mpsc::channel(8);
        let _ = tx
            .send(PortRequest {
                kind: Some(port_request::Kind::Open(PortOpen {
                    sandbox_id: id.into(),
                    port,
                    access_token: access_token.into(),
                })),
            })
            .await;
        let mut rx_stream = PortsClient::new(self.channel.clone())
            .open(ReceiverStream::new(rx))
            .await?
            .into_inner();
        match rx_stream.message().await? {
            Some(PortResponse {
                kind: Some(port_response::Kind::Connected(_)),
            }) => Ok(PortStream {
                tx: Some(tx),
                rx: rx_stream,
                read_closed: false,
            }),
            _ => Err(Error::NoConnected),
        }
    }

    /// The URL of a sandbox port on the node's HTTP entry point
    /// (`http://8080-sb-0123456789ab-TOKEN.localhost:7080/`, without the token for a public
    /// port), with the Host header that routes to it. FAILED_PRECONDITION when the node
    /// serves no HTTP entry point.
    pub async fn port_url(&self, id: &str, port: u32) -> Result<PortUrl> {
        Ok(PortsClient::new(self.channel.clone())
            .url(PortUrlRequest {
                sandbox_id: id.into(),
                port,
            })
            .await?
            .into_inner())
    }

    /// Opens `port` of the sandbox to everyone (`public`) or makes it private again; returns
    /// the sandbox's public ports.
    pub async fn set_port_public(&self, id: &str, port: u32, public: bool) -> Result<Vec<u32>> {
        Ok(PortsClient::new(self.channel.clone())
            .set_public(SetPortPublicRequest {
                sandbox_id: id.into(),
                port,
                public,
            })
            .await?
            .into_inner()
            .public_ports)
    }

    /// Starts a command and returns a handle to drive it live: send stdin, signals and
    /// terminal resizes while reading its output. Set `start.pty` (see [`pty`]) to run it
    /// on a pseudo-terminal; set `start.stdin` to feed it input.
    pub async fn exec_stream(&self, start: ExecStart) -> Result<ExecSession> {
        let (tx, rx) = mpsc::channel(16);
        let _ = tx
            .send(ExecRequest {
                kind: Some(exec_request::Kind::Start(start)),
            })
            .await;
        let output = ProcessClient::new(self.channel.clone())
            .exec(ReceiverStream::new(rx))
            .await?
            .into_inner();
        Ok(ExecSession {
            input: ExecInput { tx },
            output,
        })
    }

    pub async fn read_file(&self, id: &str, path: &str) -> Result<Vec<u8>> {
        let mut stream = self
            .files()
            .read(ReadFileRequest {
                sandbox_id: id.into(),
                path: path.as_bytes().to_vec(),
            })
            .await?
            .into_inner();
        let mut data = Vec::new();
        while let Some(chunk) = stream.message().await? {
            data.extend_from_slice(&chunk.data);
        }
        Ok(data)
    }

    pub async fn write_file(&self, id: &str, path: &str, mode: u32, data: Vec<u8>) -> Result<u64> {
        let mut messages = vec![WriteFileRequest {
            kind: Some(write_file_request::Kind::Header(WriteFileHeader {
                sandbox_id: id.into(),
                path: path.as_bytes().to_vec(),
                mode,
                create_parents: true,
            })),
        }];
        messages.extend(data.chunks(1 << 20).map(|c| WriteFileRequest {
            kind: Some(write_file_request::Kind::Data(c.to_vec())),
        }));
        Ok(self
            .files()
            .write(tokio_stream::iter(messages))
            .await?
            .into_inner()
            .bytes_written)
    }
}

/// Largest data chunk a port stream carries per message (the node rejects bigger ones).
pub const PORT_MAX_CHUNK: usize = 1 << 20;

/// One TCP connection to a port inside a sandbox ([`Client::open_port`]). Bytes written with
/// [`send`](Self::send) reach the server; [`recv`](Self::recv) returns what it sends back.
#[derive(Debug)]
pub struct PortStream {
    tx: Option<mpsc::Sender<PortRequest>>,
    rx: tonic::Streaming<PortResponse>,
    read_closed: bool,
}

impl PortStream {
    /// Sends bytes to the server (split into chunks the node accepts).
    pub async fn send(&mut self, data: &[u8]) -> Result<()> {
        let tx = self.tx.as_ref().ok_or_else(|| {
            tonic::Status::failed_precondition("send after close_write: the write side is closed")
        })?;
        for chunk in data.chunks(PORT_MAX_CHUNK) {
            let m = PortRequest {
                kind: Some(port_request::Kind::Data(chunk.to_vec())),
            };
            if tx.send(m).await.is_err() {
                return Err(tonic::Status::unavailable("the port stream is closed").into());
            }
        }
        Ok(())
    }

    /// Half-close: the server reads EOF; its answer can still be received.
    pub async fn close_write(&mut self) -> Result<()> {
        if let Some(tx) = self.tx.take() {
            let _ = tx
                .send(PortRequest {
                    kind: Some(port_request::Kind::Eof(PortEof {})),
                })
                .await;
        }
        Ok(())
    }

    /// The next bytes from the server; `None` once it closed its side.
    pub async fn recv(&mut self) -> Result<Option<Vec<u8>>> {
        while !self.read_closed {
            match self.rx.message().await? {
                Some(PortResponse {
                    kind: Some(port_response::Kind::Data(data)),
                }) => return Ok(Some(data)),
                Some(PortResponse {
                    kind: Some(port_response::Kind::Eof(_)),
                })
                | None => self.read_closed = true,
                Some(_) => {}
            }
        }
        Ok(None)
    }

    /// Everything the server sends until it closes its side.
    pub async fn recv_to_end(&mut self) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        while let Some(data) = self.recv().await? {
            out.extend_from_slice(&data);
        }
        Ok(out)
    }

    /// Pipes a local TCP connection through this stream until both directions are closed
    /// (what `dsec port-forward` does for each connection).
    pub async fn pipe(mut self, socket: tokio::net::TcpStream) -> Result<()> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let _ = socket.set_nodelay(true);
        let (mut reader, mut writer) = socket.into_split();
        let tx = self.tx.take();
        // Its own task: a server that stops reading while it writes must not stall our reads.
        let up = tokio::spawn(async move {
            let Some(tx) = tx else { return };
            let mut buf = vec![0u8; 64 << 10];
            loop {
                let kind = match reader.read(&mut buf).await {
                    Ok(0) => port_request::Kind::Eof(PortEof {}),
                    Ok(n) => port_request::Kind::Data(buf[..n].to_vec()),
                    // A reset local client: end without eof; the response side ends too.
                    Err(_) => return,
                };
                let eof = matches!(kind, port_request::Kind::Eof(_));
                if tx.send(PortRequest { kind: Some(kind) }).await.is_err() || eof {
                    break;
                }
            }
            // Keep the request stream open until the node ends the connection.
            tx.closed().await;
        });
        let result = async {
            while let Some(data) = self.recv().await? {
                writer.write_all(&data).await?;
            }
            writer.shutdown().await?;
            // Drain to the end of the stream (the node ends it when both sides are closed).
            while self.rx.message().await?.is_some() {}
            Ok(())
        }
        .await;
        up.abort();
        result
    }
}
