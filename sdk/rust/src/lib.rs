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
use tonic::metadata::AsciiMetadataValue;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

/// Where the local node listens unless `DSEC_ENDPOINT` says otherwise.
pub const DEFAULT_TARGET: &str = "unix:/run/dsec/edge/edge.sock";

pub fn default_target() -> String {
    std::env::var("DSEC_ENDPOINT")
        .ok()
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| DEFAULT_TARGET.to_string())
}

/// What every call of a [`Client`] goes through: a channel (to one node, or balanced over an
/// apiserver's replicas) that adds the credentials.
pub type Transport = InterceptedService<Channel, Credentials>;

/// The API token and project sent with every call (`authorization: Bearer TOKEN`,
/// `x-dsec-project`); a lone node needs neither, an apiserver both. `https://` targets are
/// checked against the cluster CA in `ca_file`.
#[derive(Clone, Debug, Default)]
pub struct Credentials {
    token: Option<AsciiMetadataValue>,
    project: Option<AsciiMetadataValue>,
    project_name: String,
    ca_file: Option<PathBuf>,
}

impl Credentials {
    /// From `DSEC_TOKEN`, `DSEC_PROJECT` and `DSEC_CA_FILE` (each optional).
    pub fn from_env() -> Self {
        let var = |name| std::env::var(name).ok().filter(|v: &String| !v.is_empty());
        Self::new(var("DSEC_TOKEN").as_deref(), var("DSEC_PROJECT").as_deref())
            .with_ca_file(var("DSEC_CA_FILE").map(PathBuf::from))
    }

    /// Unprintable values are left out (the apiserver then says what is missing).
    pub fn new(token: Option<&str>, project: Option<&str>) -> Self {
        Credentials {
            token: token.and_then(|t| format!("Bearer {t}").parse().ok()),
            project: project.and_then(|p| p.parse().ok()),
            project_name: project.unwrap_or_default().to_string(),
            ca_file: None,
        }
    }

    /// The cluster CA (`ca.pem` from `dsec control init`) `https://` targets are checked
    /// against.
    pub fn with_ca_file(mut self, ca_file: Option<PathBuf>) -> Self {
        self.ca_file = ca_file;
        self
    }

    /// The endpoint of one `http://` or `https://` target (TLS checked against the CA file).
    pub fn endpoint(&self, target: &str) -> Result<Endpoint> {
        let err = |reason: String| Error::Connect {
            target: target.to_string(),
            reason,
        };
        let endpoint = Endpoint::from_shared(target.to_string()).map_err(|e| err(e.to_string()))?;
        if !target.starts_with("https://") {
            return Ok(endpoint);
        }
        let ca_file = self.ca_file.as_deref().ok_or_else(|| {
            err("an https:// target needs the cluster CA: set DSEC_CA_FILE (or --ca-file) to its ca.pem".into())
        })?;
        let tls = dsec_api::tls::client_with_ca(ca_file).map_err(|e| err(e.to_string()))?;
        endpoint
            .tls_config(tls)
            .map_err(|e| err(dsec_api::tls::error_chain(&e)))
    }

    /// The project Create and List name when the request names none.
    pub fn project(&self) -> &str {
        &self.project_name
    }
}

impl tonic::service::Interceptor for Credentials {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> std::result::Result<tonic::Request<()>, tonic::Status> {
        if let Some(token) = &self.token {
            request
                .metadata_mut()
                .insert("authorization", token.clone());
        }
        if let Some(project) = &self.project {
            request
                .metadata_mut()
                .insert("x-dsec-project", project.clone());
        }
        Ok(request)
    }
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
    #[error("{what}: {source}")]
    Local {
        what: String,
        #[source]
        source: std::io::Error,
    },
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

/// Output of [`Client::exec`] (all output) or of a streaming call such as
/// [`Client::exec_with`] (only the last bytes of each stream: see [`EXEC_TAIL_BYTES`]).
#[derive(Clone, Debug, Default)]
pub struct ExecOutput {
    /// Everything the command wrote ([`Client::exec`]), or its last bytes (streaming calls).
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    /// How many bytes the command wrote to each stream in all.
    pub stdout_bytes: u64,
    pub stderr_bytes: u64,
    pub code: Option<i32>,
    pub signal: Option<i32>,
    pub timed_out: bool,
}

/// How much of each stream [`Client::exec_with`] keeps in its result besides handing
/// everything to the callback: the last 64 KiB (an error message at the end survives).
pub const EXEC_TAIL_BYTES: usize = 64 << 10;

/// Stdin chunk size and file chunk size of the streaming calls (the node takes up to 32 MiB).
pub const STREAM_CHUNK: usize = 256 << 10;

impl ExecOutput {
    /// Shell convention: the exit code, or 128 + signal.
    pub fn exit_code(&self) -> i32 {
        self.code.or(self.signal.map(|s| 128 + s)).unwrap_or(255)
    }

    /// Whether `stdout` or `stderr` holds less than the command wrote.
    pub fn truncated(&self) -> bool {
        self.stdout.len() as u64 != self.stdout_bytes
            || self.stderr.len() as u64 != self.stderr_bytes
    }
}

/// Appends `data` to `buf`, keeping at most the last `keep` bytes (amortized: trims when
/// `buf` reaches twice `keep`, so memory stays below 2 x `keep`).
fn keep_tail(buf: &mut Vec<u8>, data: &[u8], keep: usize) {
    if keep == usize::MAX {
        buf.extend_from_slice(data);
        return;
    }
    if data.len() >= keep {
        buf.clear();
        buf.extend_from_slice(&data[data.len() - keep..]);
        return;
    }
    if buf.len() + data.len() > keep.saturating_mul(2) {
        let drop = buf.len() + data.len() - keep;
        buf.drain(..drop.min(buf.len()));
    }
    buf.extend_from_slice(data);
}

/// Feeds `reader` into an exec call as stdin chunks, then stdin EOF; stops quietly when
/// the call ends first. A local read error ends the call (the node kills the command).
async fn pump_stdin<R>(mut reader: R, tx: mpsc::Sender<ExecRequest>) -> std::io::Result<()>
where
    R: tokio::io::AsyncRead + Unpin,
{
    use tokio::io::AsyncReadExt;
    let mut buf = vec![0u8; STREAM_CHUNK];
    loop {
        let n = reader.read(&mut buf).await?;
        let kind = if n == 0 {
            exec_request::Kind::StdinEof(StdinEof {})
        } else {
            exec_request::Kind::Stdin(buf[..n].to_vec())
        };
        if tx.send(ExecRequest { kind: Some(kind) }).await.is_err() || n == 0 {
            return Ok(());
        }
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
                ExecEvent::Stdout(d) => {
                    out.stdout_bytes += d.len() as u64;
                    out.stdout.extend_from_slice(&d);
                }
                ExecEvent::Stderr(d) => {
                    out.stderr_bytes += d.len() as u64;
                    out.stderr.extend_from_slice(&d);
                }
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
    channel: Transport,
    /// Connected over TCP: port streams need the sandbox's access token there.
    tcp: bool,
    credentials: Credentials,
}

impl Client {
    /// `unix:/path/edge.sock` or `http(s)://host:port`, or several such addresses separated
    /// by commas (apiserver replicas: calls are spread over them and go on on the others when
    /// one fails). Credentials from `DSEC_TOKEN`, `DSEC_PROJECT` and `DSEC_CA_FILE`.
    pub async fn connect(target: &str) -> Result<Self> {
        Self::connect_with(target, Credentials::from_env()).await
    }

    /// [`Client::connect`] with explicit credentials.
    pub async fn connect_with(target: &str, credentials: Credentials) -> Result<Self> {
        let targets: Vec<&str> = target
            .split(',')
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .collect();
        if targets.len() > 1 {
            let mut endpoints = Vec::with_capacity(targets.len());
            for t in &targets {
                endpoints.push(credentials.endpoint(t)?);
            }
            return Ok(Self {
                channel: InterceptedService::new(
                    Channel::balance_list(endpoints.into_iter()),
                    credentials.clone(),
                ),
                tcp: true,
                credentials,
            });
        }
        let channel = Self::connect_one(target, &credentials).await?;
        Ok(Self {
            channel: InterceptedService::new(channel, credentials.clone()),
            tcp: !target.starts_with("unix:"),
            credentials,
        })
    }

    async fn connect_one(target: &str, credentials: &Credentials) -> Result<Channel> {
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
            credentials
                .endpoint(target)?
                .connect()
                .await
                .map_err(|e| err(dsec_api::tls::error_chain(&e)))?
        };
        Ok(channel)
    }

    fn sandboxes(&self) -> SandboxesClient<Transport> {
        SandboxesClient::new(self.channel.clone())
    }

    fn files(&self) -> FilesClient<Transport> {
        FilesClient::new(self.channel.clone()).max_decoding_message_size(32 << 20)
    }

    pub fn sessions(&self) -> SessionsClient<Transport> {
        SessionsClient::new(self.channel.clone())
    }

    /// Creates a sandbox. Without a `request_id` the SDK picks a fresh random one; the call is
    /// retried (with the same request_id, so the node never makes two sandboxes of it) when
    /// the node is unreachable, up to [`CREATE_ATTEMPTS`] times.
    pub async fn create(&self, mut request: CreateSandboxRequest) -> Result<Sandbox> {
        if request.request_id.is_empty() {
            request.request_id = new_request_id();
        }
        if request.project.is_empty() {
            request.project = self.credentials.project().to_string();
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

    /// Many creates in few calls (`CreateMany`, up to 256 per call; more are split): one
    /// result per request, in order; each fails or succeeds on its own as `create` would
    /// (e.g. over quota), and a call the server could not take at all (UNAVAILABLE) is sent
    /// again with the same request ids, so nothing is created twice.
    pub async fn create_many(
        &self,
        requests: Vec<CreateSandboxRequest>,
    ) -> Result<Vec<Result<Sandbox>>> {
        let mut results = Vec::with_capacity(requests.len());
        let mut requests = requests.into_iter().peekable();
        while requests.peek().is_some() {
            let chunk: Vec<CreateSandboxRequest> = requests
                .by_ref()
                .take(dsec_api::create_many::MAX_CREATES_PER_CALL)
                .map(|mut request| {
                    if request.request_id.is_empty() {
                        request.request_id = new_request_id();
                    }
                    request
                })
                .collect();
            let call = CreateSandboxesRequest {
                requests: chunk,
                project: self.credentials.project().to_string(),
            };
            let mut attempt = 1;
            let answer = loop {
                match self.sandboxes().create_many(call.clone()).await {
                    Ok(answer) => break answer.into_inner(),
                    Err(status)
                        if status.code() == tonic::Code::Unavailable
                            && attempt < CREATE_ATTEMPTS =>
                    {
                        tokio::time::sleep(std::time::Duration::from_millis(200 << attempt)).await;
                        attempt += 1;
                    }
                    Err(status) => return Err(status.into()),
                }
            };
            if answer.results.len() != call.requests.len() {
                return Err(tonic::Status::internal(format!(
                    "CreateMany answered {} results for {} requests: the server is broken",
                    answer.results.len(),
                    call.requests.len()
                ))
                .into());
            }
            results.extend(
                answer
                    .results
                    .into_iter()
                    .map(|r| r.into_result().map_err(Error::from)),
            );
        }
        Ok(results)
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
                    project: self.credentials.project().to_string(),
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

    /// Snapshot of a running microVM sandbox into a new directory on its node (`path` empty:
    /// the node picks one); returns the directory, which [`restore`](Self::restore) takes.
    pub async fn snapshot(&self, id: &str, path: &str, diff: bool) -> Result<String> {
        Ok(self
            .sandboxes()
            .snapshot(SnapshotSandboxRequest {
                sandbox_id: id.into(),
                path: path.into(),
                diff,
            })
            .await?
            .into_inner()
            .path)
    }

    /// A new sandbox restored from `snapshot` (a path [`snapshot`](Self::snapshot) returned on
    /// this node): its image and shape come from the snapshot, env, labels, TTL and ports from
    /// `request`, whose image and shape fields must be unset or equal to the snapshot's.
    pub async fn restore(&self, snapshot: &str, request: CreateSandboxRequest) -> Result<Sandbox> {
        self.create(CreateSandboxRequest {
            from_snapshot: snapshot.into(),
            ..request
        })
        .await
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

    /// Runs `argv` with optional stdin and collects all of its output (memory grows with
    /// what the command writes: stream big outputs with [`exec_with`](Self::exec_with)).
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
        self.exec_streaming(
            start,
            stdin.map(std::io::Cursor::new),
            usize::MAX,
            |_, _| {},
        )
        .await
    }

    /// Runs a command; `on_output(is_stderr, data)` sees all output as it arrives. The
    /// result keeps only the last [`EXEC_TAIL_BYTES`] of each stream (and the byte counts),
    /// so memory stays bounded however much the command writes.
    pub async fn exec_with(
        &self,
        start: ExecStart,
        stdin: Option<Vec<u8>>,
        on_output: impl FnMut(bool, &[u8]),
    ) -> Result<ExecOutput> {
        self.exec_streaming(
            start,
            stdin.map(std::io::Cursor::new),
            EXEC_TAIL_BYTES,
            on_output,
        )
        .await
    }

    /// The general form of [`exec`](Self::exec) and [`exec_with`](Self::exec_with): stdin
    /// is read from `stdin` in [`STREAM_CHUNK`] pieces as the command takes it (gRPC flow
    /// control holds the reader back, so a slow command does not make it pile up),
    /// `on_output` sees all output, and the result keeps the last `keep` bytes of each
    /// stream (`usize::MAX`: everything; 0: nothing but the counts). `start.stdin` is set
    /// when `stdin` is given. A local read error of `stdin` ends the call (the node kills the
    /// command) and is returned.
    pub async fn exec_streaming<R>(
        &self,
        mut start: ExecStart,
        stdin: Option<R>,
        keep: usize,
        mut on_output: impl FnMut(bool, &[u8]),
    ) -> Result<ExecOutput>
    where
        R: tokio::io::AsyncRead + Send + Unpin + 'static,
    {
        start.stdin |= stdin.is_some();
        let (tx, rx) = mpsc::channel(4);
        let _ = tx
            .send(ExecRequest {
                kind: Some(exec_request::Kind::Start(start)),
            })
            .await;
        let (failed_tx, mut failed_rx) = tokio::sync::oneshot::channel::<std::io::Error>();
        let mut watch_stdin = stdin.is_some();
        let feeder = match stdin {
            Some(reader) => Some(tokio::spawn(async move {
                if let Err(err) = pump_stdin(reader, tx.clone()).await {
                    let _ = failed_tx.send(err);
                    // Hold the request stream open: ending it would look like EOF.
                    tx.closed().await;
                }
            })),
            None => {
                drop(tx);
                None
            }
        };
        let result = async {
            let mut stream = ProcessClient::new(self.channel.clone())
                .exec(ReceiverStream::new(rx))
                .await?
                .into_inner();
            let mut out = ExecOutput::default();
            loop {
                let message = tokio::select! {
                    message = stream.message() => message?,
                    failed = &mut failed_rx, if watch_stdin => match failed {
                        Ok(source) => {
                            return Err(Error::Local {
                                what: "read the command's stdin".into(),
                                source,
                            })
                        }
                        // Stdin was fed to its end.
                        Err(_) => {
                            watch_stdin = false;
                            continue;
                        }
                    },
                };
                let Some(message) = message else {
                    return Err(Error::NoExit);
                };
                match message.kind {
                    Some(exec_response::Kind::Stdout(d)) => {
                        on_output(false, &d);
                        out.stdout_bytes += d.len() as u64;
                        keep_tail(&mut out.stdout, &d, keep);
                    }
                    Some(exec_response::Kind::Stderr(d)) => {
                        on_output(true, &d);
                        out.stderr_bytes += d.len() as u64;
                        keep_tail(&mut out.stderr, &d, keep);
                    }
                    Some(exec_response::Kind::Exit(e)) => {
                        for buf in [&mut out.stdout, &mut out.stderr] {
                            let extra = buf.len().saturating_sub(keep);
                            buf.drain(..extra);
                        }
                        out.code = e.code;
                        out.signal = e.signal;
                        out.timed_out = e.timed_out;
                        return Ok(out);
                    }
                    _ => {}
                }
            }
        }
        .await;
        if let Some(feeder) = feeder {
            feeder.abort();
        }
        result
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

    /// Replaces a running sandbox's network policy (`Network.SetNetworkPolicy`): new
    /// connections follow it at once, open connections it denies are cut.
    pub async fn set_network_policy(&self, id: &str, network: NetworkPolicy) -> Result<Sandbox> {
        Ok(
            dsec_api::v1::network_client::NetworkClient::new(self.channel.clone())
                .set_network_policy(SetNetworkPolicyRequest {
                    sandbox_id: id.into(),
                    network: Some(network),
                })
                .await?
                .into_inner(),
        )
    }

    /// Sets the network policy of every sandbox whose labels include all of `labels` (at
    /// least one): one `NetworkLabels.SetNetworkPolicyByLabels` (the node picks the sandboxes,
    /// checks the policy once, then applies it to each). Where that call is UNIMPLEMENTED
    /// (an apiserver that does not route it yet), a List and one `SetNetworkPolicy` per
    /// sandbox. Sandboxes deleted meanwhile are skipped; ones created meanwhile are not
    /// covered (create them with the policy). Returns those changed; a sandbox that could not
    /// take the policy is an error naming it.
    pub async fn set_network_policy_by_labels(
        &self,
        labels: std::collections::HashMap<String, String>,
        network: NetworkPolicy,
    ) -> Result<Vec<Sandbox>> {
        if labels.is_empty() {
            return Err(Error::Status(tonic::Status::invalid_argument(
                "set_network_policy_by_labels needs at least one label (use set_network_policy for one sandbox)",
            )));
        }
        let answer =
            dsec_api::v1::network_labels_client::NetworkLabelsClient::new(self.channel.clone())
                .set_network_policy_by_labels(dsec_api::v1::SetNetworkPolicyByLabelsRequest {
                    labels: labels.clone(),
                    network: Some(network.clone()),
                })
                .await;
        match answer {
            Ok(answer) => {
                let answer = answer.into_inner();
                if let Some(failed) = answer.failed.first() {
                    return Err(Error::Status(tonic::Status::failed_precondition(format!(
                        "{} of the labelled sandboxes could not take the policy (the others did), first {}: {}",
                        answer.failed.len(),
                        failed.sandbox_id,
                        failed.message
                    ))));
                }
                return Ok(answer.sandboxes);
            }
            Err(status) if status.code() == tonic::Code::Unimplemented => {}
            Err(status) => return Err(status.into()),
        }
        let mut changed = Vec::new();
        for sandbox in self.list(labels).await? {
            match self.set_network_policy(&sandbox.id, network.clone()).await {
                Ok(sandbox) => changed.push(sandbox),
                Err(e) if e.code() == Some(tonic::Code::NotFound) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(changed)
    }

    /// Runs code once in a warm FnCall worker of the node (`Fn.Run`): `language` is python,
    /// bash, cpp or node; the rest of `request` (stdin, files, timeouts, memory) as given.
    pub async fn run_code(&self, mut request: FnRunRequest) -> Result<FnRunResponse> {
        if request.language.is_empty() {
            request.language = "python".into();
        }
        Ok(self.fn_client().run(request).await?.into_inner())
    }

    /// Runs calls concurrently on the node (`Fn.RunBatch`); answers in the order given.
    pub async fn run_code_batch(&self, calls: Vec<FnRunRequest>) -> Result<Vec<FnRunBatchItem>> {
        Ok(self
            .fn_client()
            .run_batch(FnRunBatchRequest { calls })
            .await?
            .into_inner()
            .results)
    }

    fn fn_client(&self) -> dsec_api::v1::fn_client::FnClient<Transport> {
        // Results carry stdout, stderr and fetched files: above tonic's 4 MiB default.
        dsec_api::v1::fn_client::FnClient::new(self.channel.clone())
            .max_decoding_message_size(256 << 20)
            .max_encoding_message_size(64 << 20)
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

    /// A whole sandbox file in memory (see [`read_file_to`](Self::read_file_to) to stream).
    pub async fn read_file(&self, id: &str, path: &str) -> Result<Vec<u8>> {
        let mut data = Vec::new();
        self.read_file_to(id, path, &mut data).await?;
        Ok(data)
    }

    /// Streams a sandbox file into `writer` chunk by chunk as the node sends it (memory stays
    /// at a few chunks whatever the size); returns the bytes copied. The writer is flushed.
    pub async fn read_file_to<W>(&self, id: &str, path: &str, writer: &mut W) -> Result<u64>
    where
        W: tokio::io::AsyncWrite + Unpin + ?Sized,
    {
        use tokio::io::AsyncWriteExt;
        let mut stream = self
            .files()
            .read(ReadFileRequest {
                sandbox_id: id.into(),
                path: path.as_bytes().to_vec(),
            })
            .await?
            .into_inner();
        let local = |source| Error::Local {
            what: format!("write the local copy of {path}"),
            source,
        };
        let mut copied = 0u64;
        while let Some(chunk) = stream.message().await? {
            writer.write_all(&chunk.data).await.map_err(local)?;
            copied += chunk.data.len() as u64;
        }
        writer.flush().await.map_err(local)?;
        Ok(copied)
    }

    /// Copies a sandbox file to the local file `local` (created with mode 0644 less the
    /// umask, or truncated), streaming; returns the bytes copied.
    pub async fn read_file_to_path(
        &self,
        id: &str,
        path: &str,
        local: &std::path::Path,
    ) -> Result<u64> {
        let mut file = tokio::fs::File::create(local)
            .await
            .map_err(|source| Error::Local {
                what: format!("create {}", local.display()),
                source,
            })?;
        self.read_file_to(id, path, &mut file).await
    }

    /// Creates or truncates a sandbox file (and its parents) from bytes in memory; `mode` 0
    /// means 0644 (applied when the file is created, less the agent's umask).
    pub async fn write_file(&self, id: &str, path: &str, mode: u32, data: Vec<u8>) -> Result<u64> {
        self.write_file_from(id, path, mode, std::io::Cursor::new(data))
            .await
    }

    /// As [`write_file`](Self::write_file), streaming from `reader` in [`STREAM_CHUNK`]
    /// pieces as the node takes them (gRPC flow control holds the reader back). A local read
    /// error cancels the call and is returned; the sandbox file then holds what came before.
    pub async fn write_file_from<R>(
        &self,
        id: &str,
        path: &str,
        mode: u32,
        reader: R,
    ) -> Result<u64>
    where
        R: tokio::io::AsyncRead + Send + Unpin + 'static,
    {
        use tokio::io::AsyncReadExt;
        let (tx, rx) = mpsc::channel(4);
        let _ = tx
            .send(WriteFileRequest {
                kind: Some(write_file_request::Kind::Header(WriteFileHeader {
                    sandbox_id: id.into(),
                    path: path.as_bytes().to_vec(),
                    mode,
                    create_parents: true,
                })),
            })
            .await;
        let (failed_tx, mut failed_rx) = tokio::sync::oneshot::channel::<std::io::Error>();
        let feeder = tokio::spawn(async move {
            let mut reader = reader;
            let mut buf = vec![0u8; STREAM_CHUNK];
            loop {
                match reader.read(&mut buf).await {
                    Ok(0) => return,
                    Ok(n) => {
                        let m = WriteFileRequest {
                            kind: Some(write_file_request::Kind::Data(buf[..n].to_vec())),
                        };
                        if tx.send(m).await.is_err() {
                            return;
                        }
                    }
                    Err(err) => {
                        let _ = failed_tx.send(err);
                        // Ending the request stream would commit a short file as complete.
                        tx.closed().await;
                        return;
                    }
                }
            }
        });
        let mut files = self.files();
        let call = files.write(ReceiverStream::new(rx));
        let result = tokio::select! {
            biased;
            Ok(source) = &mut failed_rx => Err(Error::Local {
                what: format!("read the local data for {path}"),
                source,
            }),
            result = call => result.map(|r| r.into_inner().bytes_written).map_err(Error::from),
        };
        feeder.abort();
        result
    }

    /// A sandbox path's type, size, mode and symlink target (symlinks are not followed).
    pub async fn stat(&self, id: &str, path: &str) -> Result<FileInfo> {
        Ok(self
            .files()
            .stat(StatRequest {
                sandbox_id: id.into(),
                path: path.as_bytes().to_vec(),
            })
            .await?
            .into_inner())
    }

    /// The entries of a sandbox directory, sorted by name (symlinks are not followed).
    pub async fn list_dir(&self, id: &str, path: &str) -> Result<Vec<FileInfo>> {
        Ok(self
            .files()
            .list(ListDirRequest {
                sandbox_id: id.into(),
                path: path.as_bytes().to_vec(),
            })
            .await?
            .into_inner()
            .entries)
    }

    /// Creates a sandbox directory (`mode` 0: 0755, less the agent's umask); ALREADY_EXISTS
    /// when it exists (unless `parents`).
    pub async fn mkdir(&self, id: &str, path: &str, parents: bool, mode: u32) -> Result<()> {
        self.files()
            .mkdir(MkdirRequest {
                sandbox_id: id.into(),
                path: path.as_bytes().to_vec(),
                parents,
                mode,
            })
            .await?;
        Ok(())
    }

    /// Copies the local file `local` to a sandbox file, streaming; `mode` `None` takes the
    /// local file's permission bits. Returns the bytes copied.
    pub async fn write_file_from_path(
        &self,
        local: &std::path::Path,
        id: &str,
        path: &str,
        mode: Option<u32>,
    ) -> Result<u64> {
        use std::os::unix::fs::PermissionsExt;
        let err = |source| Error::Local {
            what: format!("read {}", local.display()),
            source,
        };
        let file = tokio::fs::File::open(local).await.map_err(err)?;
        let mode = match mode {
            Some(mode) => mode,
            None => file.metadata().await.map_err(err)?.permissions().mode() & 0o7777,
        };
        self.write_file_from(id, path, mode, file).await
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
