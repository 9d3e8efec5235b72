//! A client of the in-sandbox agent over any byte stream (Unix socket, or vsock through the
//! VMM's `CONNECT <port>` Unix socket).

use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use dsec_api::agent::v1::agent_client::AgentClient as AgentRpc;
use dsec_api::agent::v1::files_client::FilesClient;
use dsec_api::agent::v1::process_client::ProcessClient;
use dsec_api::agent::v1::{
    exec_request, exec_response, write_file_request, ExecRequest, ExecStart, InfoRequest,
    InfoResponse, ReadFileRequest, ShutdownRequest, StdinEof, WriteFileHeader, WriteFileRequest,
};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};

use crate::error::{EdgeError, Result};

/// How to reach an agent.
#[derive(Clone, Debug)]
pub enum AgentAddr {
    /// The agent's own Unix socket (container path, tests).
    Unix(PathBuf),
    /// A Firecracker-style vsock Unix socket: write `CONNECT <port>\n`, read `OK ...\n`.
    VsockUds { uds: PathBuf, port: u32 },
}

/// Pauses between the tries of a vsock connection the guest refused (its agent's accept
/// queue full, or the guest busy resetting its transport): a moment later it answers.
const REFUSED_RETRY_PAUSES: [Duration; 3] = [
    Duration::from_millis(20),
    Duration::from_millis(100),
    Duration::from_millis(300),
];

impl AgentAddr {
    /// Opens a stream to the agent; with `retry_refused`, a vsock connection the guest
    /// refused is tried again after each of [`REFUSED_RETRY_PAUSES`] (not while waiting for a
    /// booting guest, whose refusals are expected and polled for by the caller).
    async fn open(&self, retry_refused: bool) -> io::Result<UnixStream> {
        match self {
            AgentAddr::Unix(path) => UnixStream::connect(path).await,
            AgentAddr::VsockUds { uds, port } => {
                let pauses = if retry_refused {
                    &REFUSED_RETRY_PAUSES[..]
                } else {
                    &[]
                };
                let mut pauses = pauses.iter();
                loop {
                    match vsock_connect(uds, *port).await {
                        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                            let Some(pause) = pauses.next() else {
                                return Err(e);
                            };
                            tracing::debug!(err = %e, "agent connection refused; trying again");
                            tokio::time::sleep(*pause).await;
                        }
                        other => return other,
                    }
                }
            }
        }
    }
}

/// Opens a stream to `port` in the guest through the VMM's vsock Unix socket.
pub async fn vsock_connect(uds: &Path, port: u32) -> io::Result<UnixStream> {
    let mut stream = UnixStream::connect(uds).await?;
    stream
        .write_all(format!("CONNECT {port}\n").as_bytes())
        .await?;
    // Read the reply byte by byte: anything after the newline already belongs to the agent.
    let mut line = Vec::with_capacity(16);
    let mut byte = [0u8; 1];
    loop {
        if stream.read(&mut byte).await? == 0 {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionRefused,
                format!("vsock: connection to port {port} closed during handshake (guest not listening yet?)"),
            ));
        }
        if byte[0] == b'\n' {
            break;
        }
        line.push(byte[0]);
        if line.len() > 64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "vsock: handshake reply too long",
            ));
        }
    }
    if !line.starts_with(b"OK ") {
        return Err(io::Error::new(
            io::ErrorKind::ConnectionRefused,
            format!(
                "vsock: CONNECT {port} answered {:?}",
                String::from_utf8_lossy(&line)
            ),
        ));
    }
    Ok(stream)
}

/// What to run.
#[derive(Clone, Debug, Default)]
pub struct ExecSpec {
    pub argv: Vec<String>,
    pub env: HashMap<String, String>,
    pub workdir: Option<String>,
    pub timeout: Option<Duration>,
}

impl ExecSpec {
    pub fn new<S: Into<String>>(argv: impl IntoIterator<Item = S>) -> Self {
        Self {
            argv: argv.into_iter().map(Into::into).collect(),
            ..Self::default()
        }
    }
}

/// How a command ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExecOutcome {
    pub code: Option<i32>,
    pub signal: Option<i32>,
    pub timed_out: bool,
}

impl ExecOutcome {
    /// Shell convention: the exit code, or 128 + signal number when killed.
    pub fn exit_code(&self) -> i32 {
        match (self.code, self.signal) {
            (Some(code), _) => code,
            (None, Some(signal)) => 128 + signal,
            (None, None) => 255,
        }
    }
}

/// Output of [`AgentClient::exec_collect`].
#[derive(Clone, Debug)]
pub struct CollectedExec {
    pub outcome: ExecOutcome,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

/// What a restored guest takes on besides fresh entropy and the clock (None: unchanged).
#[derive(Clone, Debug, Default)]
pub struct GuestIdentity {
    /// Its network interface's MAC ("06:00:0a:00:00:02").
    pub mac: Option<String>,
    /// Its hostname (the sandbox id).
    pub hostname: Option<String>,
    /// Its interface's address, default route and resolver (the sandbox's own).
    pub ipv4: Option<GuestIpv4>,
    /// The sandbox's environment, which every later exec and session starts with.
    pub env: Option<std::collections::BTreeMap<String, String>>,
}

/// What a refresh did.
#[derive(Clone, Copy, Debug)]
pub struct Refreshed {
    /// How far the guest clock was off (guest minus host).
    pub clock_skew: std::time::Duration,
    /// The agent took the sandbox's env.
    pub env_set: bool,
}

/// A guest interface's IPv4 setup.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GuestIpv4 {
    pub address: std::net::Ipv4Addr,
    pub prefix_len: u8,
    pub gateway: std::net::Ipv4Addr,
    pub nameserver: std::net::Ipv4Addr,
}

/// Typed access to the agent's services over one multiplexed connection.
#[derive(Clone)]
pub struct AgentClient {
    channel: Channel,
}

const STDIN_CHUNK: usize = 32 * 1024;

impl AgentClient {
    /// Connects once (a refusal is returned at once).
    pub async fn connect(addr: AgentAddr) -> Result<Self> {
        // The first connection fails fast (a booting guest is polled by the caller); the
        // channel's later reconnections retry a refusal briefly, as a lazy client's do.
        let first = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        let connector = tower::service_fn(move |_: tonic::codegen::http::Uri| {
            let addr = addr.clone();
            let retry = !first.swap(false, std::sync::atomic::Ordering::Relaxed);
            async move { addr.open(retry).await.map(TokioIo::new) }
        });
        // The URI is required by the HTTP/2 layer but never resolved: the connector decides.
        let channel = Endpoint::from_static("http://agent.dsec.invalid")
            .connect_with_connector(connector)
            .await
            .map_err(|e| EdgeError::Connect(error_chain(&e)))?;
        Ok(Self { channel })
    }

    /// A client that connects on first use (and reconnects after failures, a refused vsock
    /// connection retried briefly): for sandboxes that may be frozen, where a handshake now
    /// would hang.
    pub fn connect_lazy(addr: AgentAddr) -> Self {
        let connector = tower::service_fn(move |_: tonic::codegen::http::Uri| {
            let addr = addr.clone();
            async move { addr.open(true).await.map(TokioIo::new) }
        });
        let channel = Endpoint::from_static("http://agent.dsec.invalid")
            .connect_with_connector_lazy(connector);
        Self { channel }
    }

    /// The multiplexed connection, for the generated clients of services without a typed
    /// wrapper here (Sessions, the extra Files calls).
    pub fn channel(&self) -> Channel {
        self.channel.clone()
    }

    pub async fn info(&self) -> Result<InfoResponse> {
        AgentRpc::new(self.channel.clone())
            .info(InfoRequest {})
            .await
            .map(|r| r.into_inner())
            .map_err(|s| EdgeError::agent("info", s))
    }

    /// After a restore or fork: reseed the guest RNG with `entropy`, set its wall clock to
    /// the host's and give it `identity` (its network interface's MAC and IPv4 setup, its
    /// hostname). Returns
    /// how far the guest clock was off (guest minus host).
    pub async fn refresh(
        &self,
        entropy: Vec<u8>,
        identity: GuestIdentity,
    ) -> Result<std::time::Duration> {
        self.refresh_identity(entropy, identity)
            .await
            .map(|r| r.clock_skew)
    }

    /// [`refresh`](Self::refresh), also saying whether the agent took `identity.env` (one
    /// from before that field ignores it).
    pub async fn refresh_identity(
        &self,
        entropy: Vec<u8>,
        identity: GuestIdentity,
    ) -> Result<Refreshed> {
        let realtime_ns = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as i64)
            .unwrap_or(0);
        let response = AgentRpc::new(self.channel.clone())
            .refresh(dsec_api::agent::v1::RefreshRequest {
                entropy,
                realtime_ns,
                mac: identity.mac.unwrap_or_default(),
                hostname: identity.hostname.unwrap_or_default(),
                ipv4: identity.ipv4.map(|n| dsec_api::agent::v1::GuestIpv4 {
                    address: n.address.to_string(),
                    prefix_len: n.prefix_len.into(),
                    gateway: n.gateway.to_string(),
                    nameserver: n.nameserver.to_string(),
                }),
                env: identity.env.map(|vars| dsec_api::agent::v1::SandboxEnv {
                    vars: vars.into_iter().collect(),
                }),
            })
            .await
            .map_err(|s| EdgeError::agent("refresh", s))?
            .into_inner();
        Ok(Refreshed {
            clock_skew: std::time::Duration::from_nanos(response.clock_skew_ns.unsigned_abs()),
            env_set: response.env_set,
        })
    }

    pub async fn shutdown(&self) -> Result<()> {
        AgentRpc::new(self.channel.clone())
            .shutdown(ShutdownRequest {})
            .await
            .map(|_| ())
            .map_err(|s| EdgeError::agent("shutdown", s))
    }

    /// Runs a command, copying its output live into `stdout`/`stderr` and feeding `stdin`
    /// (if any) until EOF.
    pub async fn exec<I, O, E>(
        &self,
        spec: &ExecSpec,
        stdin: Option<I>,
        stdout: &mut O,
        stderr: &mut E,
    ) -> Result<ExecOutcome>
    where
        I: AsyncRead + Unpin + Send + 'static,
        O: AsyncWrite + Unpin,
        E: AsyncWrite + Unpin,
    {
        self.exec_with_signals(spec, stdin, stdout, stderr, None)
            .await
    }

    /// Like [`AgentClient::exec`]; signal numbers received on `signals` are sent to the
    /// command's process group while it runs.
    pub async fn exec_with_signals<I, O, E>(
        &self,
        spec: &ExecSpec,
        stdin: Option<I>,
        stdout: &mut O,
        stderr: &mut E,
        signals: Option<mpsc::Receiver<i32>>,
    ) -> Result<ExecOutcome>
    where
        I: AsyncRead + Unpin + Send + 'static,
        O: AsyncWrite + Unpin,
        E: AsyncWrite + Unpin,
    {
        if spec.argv.is_empty() {
            return Err(EdgeError::InvalidSpec("no command given".into()));
        }
        let (tx, rx) = mpsc::channel(4);
        let start = ExecStart {
            argv: spec.argv.clone(),
            env: spec.env.clone(),
            workdir: spec.workdir.clone().unwrap_or_default(),
            timeout_ms: spec
                .timeout
                .map(|t| t.as_millis().max(1) as u64)
                .unwrap_or(0),
            stdin: stdin.is_some(),
            pty: None,
        };
        tx.send(ExecRequest {
            kind: Some(exec_request::Kind::Start(start)),
        })
        .await
        .map_err(|_| EdgeError::Protocol("exec request stream closed".into()))?;
        let feeder = stdin.map(|input| tokio::spawn(feed_stdin(input, tx.clone())));
        let signaller = signals.map(|mut signals| {
            let tx = tx.clone();
            tokio::spawn(async move {
                while let Some(number) = signals.recv().await {
                    let message = ExecRequest {
                        kind: Some(exec_request::Kind::Signal(number)),
                    };
                    if tx.send(message).await.is_err() {
                        return;
                    }
                }
            })
        });
        drop(tx);

        let mut responses = ProcessClient::new(self.channel.clone())
            .exec(ReceiverStream::new(rx))
            .await
            .map_err(|s| EdgeError::agent("exec", s))?
            .into_inner();
        let result = loop {
            let message = match responses.message().await {
                Ok(Some(message)) => message,
                Ok(None) => {
                    break Err(EdgeError::Protocol(
                        "the agent ended the exec stream without an exit status".into(),
                    ))
                }
                Err(status) => break Err(EdgeError::agent("exec", status)),
            };
            match message.kind {
                Some(exec_response::Kind::Stdout(data)) => {
                    write_out(stdout, &data, "stdout").await?
                }
                Some(exec_response::Kind::Stderr(data)) => {
                    write_out(stderr, &data, "stderr").await?
                }
                Some(exec_response::Kind::Exit(exit)) => {
                    break Ok(ExecOutcome {
                        code: exit.code,
                        signal: exit.signal,
                        timed_out: exit.timed_out,
                    })
                }
                Some(exec_response::Kind::Started(_)) | None => {}
            }
        };
        for task in feeder.into_iter().chain(signaller) {
            task.abort();
        }
        result
    }

    /// Runs a command and collects its output in memory (tests, small commands).
    pub async fn exec_collect(
        &self,
        spec: &ExecSpec,
        stdin: Option<Vec<u8>>,
    ) -> Result<CollectedExec> {
        let mut stdout = Vec::new();
        let mut stderr = Vec::new();
        let outcome = self
            .exec(spec, stdin.map(io::Cursor::new), &mut stdout, &mut stderr)
            .await?;
        Ok(CollectedExec {
            outcome,
            stdout,
            stderr,
        })
    }

    pub async fn read_file(&self, path: &str) -> Result<Vec<u8>> {
        let mut stream = FilesClient::new(self.channel.clone())
            .read_file(ReadFileRequest { path: path.into() })
            .await
            .map_err(|s| EdgeError::agent("read file", s))?
            .into_inner();
        let mut data = Vec::new();
        while let Some(chunk) = stream
            .message()
            .await
            .map_err(|s| EdgeError::agent("read file", s))?
        {
            data.extend_from_slice(&chunk.data);
        }
        Ok(data)
    }

    /// Creates or truncates `path` with `mode` (0 = 0644) and writes `data`.
    pub async fn write_file(&self, path: &str, mode: u32, data: &[u8]) -> Result<u64> {
        let mut messages = vec![WriteFileRequest {
            kind: Some(write_file_request::Kind::Header(WriteFileHeader {
                path: path.into(),
                mode,
                create_parents: false,
            })),
        }];
        messages.extend(data.chunks(64 * 1024).map(|chunk| WriteFileRequest {
            kind: Some(write_file_request::Kind::Data(chunk.to_vec())),
        }));
        FilesClient::new(self.channel.clone())
            .write_file(tokio_stream::iter(messages))
            .await
            .map(|r| r.into_inner().bytes_written)
            .map_err(|s| EdgeError::agent("write file", s))
    }
}

async fn write_out<W: AsyncWrite + Unpin>(out: &mut W, data: &[u8], name: &str) -> Result<()> {
    out.write_all(data)
        .await
        .map_err(|e| EdgeError::io(format!("write {name}"), e))?;
    out.flush()
        .await
        .map_err(|e| EdgeError::io(format!("flush {name}"), e))
}

async fn feed_stdin<I: AsyncRead + Unpin>(mut input: I, tx: mpsc::Sender<ExecRequest>) {
    let mut buf = vec![0u8; STDIN_CHUNK];
    loop {
        let kind = match input.read(&mut buf).await {
            Ok(0) | Err(_) => exec_request::Kind::StdinEof(StdinEof {}),
            Ok(n) => exec_request::Kind::Stdin(buf[..n].to_vec()),
        };
        let eof = matches!(kind, exec_request::Kind::StdinEof(_));
        if tx.send(ExecRequest { kind: Some(kind) }).await.is_err() || eof {
            return;
        }
    }
}

/// Flattens an error and its sources into one line.
pub(crate) fn error_chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::UnixListener;

    /// A VMM vsock socket whose guest refuses the first `refusals` connections (the VMM
    /// closes them during the handshake) and accepts the next; how many it saw.
    fn refusing_vmm(uds: &Path, refusals: usize) -> tokio::task::JoinHandle<usize> {
        let listener = UnixListener::bind(uds).unwrap();
        tokio::spawn(async move {
            let mut seen = 0;
            loop {
                let (mut stream, _) = listener.accept().await.unwrap();
                seen += 1;
                let mut line = [0u8; 12];
                stream.read_exact(&mut line).await.unwrap();
                assert_eq!(&line, b"CONNECT 102\n");
                if seen > refusals {
                    stream.write_all(b"OK 1073741824\n").await.unwrap();
                    return seen;
                }
            }
        })
    }

    #[tokio::test]
    async fn a_refused_vsock_connection_is_retried_only_when_asked() {
        let dir = tempfile::tempdir().unwrap();
        let uds = dir.path().join("vsock");
        let addr = AgentAddr::VsockUds {
            uds: uds.clone(),
            port: 102,
        };
        let vmm = refusing_vmm(&uds, 2);
        addr.open(true).await.expect("the third try is accepted");
        assert_eq!(vmm.await.unwrap(), 3);

        std::fs::remove_file(&uds).unwrap();
        let vmm = refusing_vmm(&uds, 1);
        let refused = addr.open(false).await.unwrap_err();
        assert_eq!(refused.kind(), io::ErrorKind::ConnectionRefused);
        vmm.abort();

        // A guest that never listens: the tries end, with the refusal.
        std::fs::remove_file(&uds).unwrap();
        let vmm = refusing_vmm(&uds, usize::MAX);
        let started = std::time::Instant::now();
        let refused = addr.open(true).await.unwrap_err();
        assert_eq!(refused.kind(), io::ErrorKind::ConnectionRefused);
        assert!(started.elapsed() >= Duration::from_millis(400));
        vmm.abort();
    }
}
