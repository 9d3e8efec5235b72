//! The runtime services (Process, Files, Sessions): each call names a sandbox and is
//! proxied to its agent; the messages both APIs share pass through as they are.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use dsec_api::agent::v1 as agent;
use dsec_api::v1::*;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;
use tonic::{Request, Response, Status, Streaming};

use super::limits::{self, check_env, check_len};
use super::node::Node;

/// Paths arrive as bytes so that bad ones get a clear INVALID_ARGUMENT.
fn path_arg(what: &str, bytes: &[u8]) -> Result<String, Status> {
    let path = std::str::from_utf8(bytes).map_err(|e| {
        Status::invalid_argument(format!(
            "{what} is not valid UTF-8 (bad byte at offset {}): paths must be UTF-8 text",
            e.valid_up_to()
        ))
    })?;
    if path.is_empty() {
        return Err(Status::invalid_argument(format!("{what} is empty")));
    }
    check_len(what, bytes, limits::MAX_PATH)?;
    if path.contains('\0') {
        return Err(Status::invalid_argument(format!(
            "{what} contains a NUL byte"
        )));
    }
    if !path.starts_with('/') {
        return Err(Status::invalid_argument(format!(
            "{what} {path:?} is not absolute: give a path starting with '/'"
        )));
    }
    Ok(path.to_string())
}

// ------------------------------------------------------------------ Process

pub struct ProcessService(pub Arc<Node>);

#[tonic::async_trait]
impl process_server::Process for ProcessService {
    type ExecStream = std::pin::Pin<
        Box<dyn tokio_stream::Stream<Item = Result<ExecResponse, Status>> + Send + 'static>,
    >;

    async fn exec(
        &self,
        request: Request<Streaming<ExecRequest>>,
    ) -> Result<Response<Self::ExecStream>, Status> {
        let mut inbound = request.into_inner();
        let start = match inbound.message().await? {
            Some(ExecRequest {
                kind: Some(exec_request::Kind::Start(start)),
            }) => start,
            _ => {
                return Err(Status::invalid_argument(
                    "the first Exec message must be `start` (sandbox_id, argv...)",
                ))
            }
        };
        limits::check_argv(&start.argv)?;
        check_env("env of this exec", &start.env)?;
        limits::check_timeout_ms("timeout_ms", start.timeout_ms)?;
        check_len("workdir", start.workdir.as_bytes(), limits::MAX_PATH)?;
        let id = start.sandbox_id.clone();
        let entry = self.0.running(&id)?;
        self.0.metrics.execs_total.fetch_add(1, Ordering::Relaxed);
        let mut env = sandbox_env(&entry.record());
        env.extend(start.env);
        let first = agent::ExecRequest {
            kind: Some(agent::exec_request::Kind::Start(agent::ExecStart {
                argv: start.argv,
                env,
                workdir: start.workdir,
                timeout_ms: start.timeout_ms,
                stdin: start.stdin,
                // Sizes and TERM are checked by the agent (one rule for every backend).
                pty: start.pty,
            })),
        };
        let (tx, rx) = mpsc::channel(8);
        let _ = tx.send(first).await;
        tokio::spawn(async move {
            while let Ok(Some(message)) = inbound.message().await {
                if tx.send(exec_input(message)).await.is_err() {
                    return;
                }
            }
        });
        let mut client = agent::process_client::ProcessClient::new(entry.client.channel());
        let responses = client
            .exec(ReceiverStream::new(rx))
            .await
            .map_err(|s| self.0.agent_error(&entry, s))?
            .into_inner();
        let touch = entry.clone();
        let node = self.0.clone();
        let stream = responses.map(move |item| {
            touch.touch();
            // An agent that died mid-command: say why, not "h2 protocol error".
            item.map_err(|s| node.agent_error(&touch, s))
        });
        Ok(Response::new(Box::pin(stream)))
    }
}

// ------------------------------------------------------------------ Files

pub struct FilesService(pub Arc<Node>);

impl FilesService {
    fn files(
        &self,
        id: &str,
    ) -> Result<agent::files_client::FilesClient<tonic::transport::Channel>, Status> {
        let entry = self.0.running(id)?;
        Ok(agent::files_client::FilesClient::new(
            entry.client.channel(),
        ))
    }
}

#[tonic::async_trait]
impl files_server::Files for FilesService {
    type ReadStream = std::pin::Pin<
        Box<dyn tokio_stream::Stream<Item = Result<FileChunk, Status>> + Send + 'static>,
    >;

    async fn read(
        &self,
        request: Request<ReadFileRequest>,
    ) -> Result<Response<Self::ReadStream>, Status> {
        let r = request.into_inner();
        let path = path_arg("path", &r.path)?;
        let stream = self
            .files(&r.sandbox_id)?
            .read_file(agent::ReadFileRequest { path })
            .await
            .map_err(|s| self.0.call_error(&r.sandbox_id, s))?
            .into_inner()
            .map(|item| item.map(|c| FileChunk { data: c.data }));
        Ok(Response::new(Box::pin(stream)))
    }

    async fn write(
        &self,
        request: Request<Streaming<WriteFileRequest>>,
    ) -> Result<Response<WriteFileResponse>, Status> {
        let mut inbound = request.into_inner();
        let header = match inbound.message().await? {
            Some(WriteFileRequest {
                kind: Some(write_file_request::Kind::Header(h)),
            }) => h,
            _ => {
                return Err(Status::invalid_argument(
                    "the first Write message must be the header (sandbox_id, path, mode)",
                ))
            }
        };
        let path = path_arg("path", &header.path)?;
        let mut files = self.files(&header.sandbox_id)?;
        let (tx, rx) = mpsc::channel(4);
        let _ = tx
            .send(agent::WriteFileRequest {
                kind: Some(agent::write_file_request::Kind::Header(
                    agent::WriteFileHeader {
                        path,
                        mode: header.mode,
                        create_parents: header.create_parents,
                    },
                )),
            })
            .await;
        let forward = tokio::spawn(async move {
            loop {
                match inbound.message().await {
                    Ok(Some(WriteFileRequest {
                        kind: Some(write_file_request::Kind::Data(data)),
                    })) => {
                        let m = agent::WriteFileRequest {
                            kind: Some(agent::write_file_request::Kind::Data(data)),
                        };
                        if tx.send(m).await.is_err() {
                            return Ok(());
                        }
                    }
                    Ok(None) => return Ok(()),
                    Ok(Some(_)) => {
                        return Err(Status::invalid_argument(
                            "Write: only data chunks may follow the header",
                        ))
                    }
                    Err(status) => return Err(status),
                }
            }
        });
        let result = files.write_file(ReceiverStream::new(rx)).await;
        forward.abort();
        if let Ok(Err(status)) = forward.await {
            return Err(status);
        }
        let written = result?.into_inner().bytes_written;
        Ok(Response::new(WriteFileResponse {
            bytes_written: written,
        }))
    }

    async fn list(
        &self,
        request: Request<ListDirRequest>,
    ) -> Result<Response<ListDirResponse>, Status> {
        let r = request.into_inner();
        let path = path_arg("path", &r.path)?;
        let out = self
            .files(&r.sandbox_id)?
            .list_dir(agent::ListDirRequest { path })
            .await
            .map_err(|s| self.0.call_error(&r.sandbox_id, s))?
            .into_inner();
        Ok(Response::new(out))
    }

    async fn stat(&self, request: Request<StatRequest>) -> Result<Response<FileInfo>, Status> {
        let r = request.into_inner();
        let path = path_arg("path", &r.path)?;
        let out = self
            .files(&r.sandbox_id)?
            .stat(agent::StatRequest { path })
            .await
            .map_err(|s| self.0.call_error(&r.sandbox_id, s))?
            .into_inner();
        Ok(Response::new(out))
    }

    async fn mkdir(
        &self,
        request: Request<MkdirRequest>,
    ) -> Result<Response<MkdirResponse>, Status> {
        let r = request.into_inner();
        let path = path_arg("path", &r.path)?;
        self.files(&r.sandbox_id)?
            .mkdir(agent::MkdirRequest {
                path,
                parents: r.parents,
                mode: r.mode,
            })
            .await
            .map_err(|s| self.0.call_error(&r.sandbox_id, s))?;
        Ok(Response::new(MkdirResponse {}))
    }

    async fn remove(
        &self,
        request: Request<RemoveRequest>,
    ) -> Result<Response<RemoveResponse>, Status> {
        let r = request.into_inner();
        let path = path_arg("path", &r.path)?;
        self.files(&r.sandbox_id)?
            .remove(agent::RemoveRequest {
                path,
                recursive: r.recursive,
            })
            .await
            .map_err(|s| self.0.call_error(&r.sandbox_id, s))?;
        Ok(Response::new(RemoveResponse {}))
    }

    async fn rename(
        &self,
        request: Request<RenameRequest>,
    ) -> Result<Response<RenameResponse>, Status> {
        let r = request.into_inner();
        let from = path_arg("from", &r.from)?;
        let to = path_arg("to", &r.to)?;
        self.files(&r.sandbox_id)?
            .rename(agent::RenameRequest { from, to })
            .await
            .map_err(|s| self.0.call_error(&r.sandbox_id, s))?;
        Ok(Response::new(RenameResponse {}))
    }
}

// ------------------------------------------------------------------ Sessions

pub struct SessionsService(pub Arc<Node>);

impl SessionsService {
    fn sessions(
        &self,
        id: &str,
    ) -> Result<agent::sessions_client::SessionsClient<tonic::transport::Channel>, Status> {
        let entry = self.0.running(id)?;
        Ok(agent::sessions_client::SessionsClient::new(
            entry.client.channel(),
        ))
    }
}

#[tonic::async_trait]
impl sessions_server::Sessions for SessionsService {
    async fn create(
        &self,
        request: Request<CreateSessionRequest>,
    ) -> Result<Response<SessionInfo>, Status> {
        let r = request.into_inner();
        check_env("env of this session", &r.env)?;
        check_len("shell", r.shell.as_bytes(), limits::MAX_PATH)?;
        check_len("workdir", r.workdir.as_bytes(), limits::MAX_PATH)?;
        let entry = self.0.running(&r.sandbox_id)?;
        let mut env = sandbox_env(&entry.record());
        env.extend(r.env);
        let out = self
            .sessions(&r.sandbox_id)?
            .create_session(agent::CreateSessionRequest {
                shell: r.shell,
                env,
                workdir: r.workdir,
            })
            .await
            .map_err(|s| self.0.call_error(&r.sandbox_id, s))?
            .into_inner();
        Ok(Response::new(out))
    }

    async fn run(
        &self,
        request: Request<RunInSessionRequest>,
    ) -> Result<Response<CommandResult>, Status> {
        let r = request.into_inner();
        check_len("command", r.command.as_bytes(), limits::MAX_SESSION_COMMAND)?;
        limits::check_timeout_ms("timeout_ms", r.timeout_ms)?;
        if r.output_limit > limits::MAX_OUTPUT_LIMIT {
            return Err(Status::invalid_argument(format!(
                "output_limit {} is more than {} (64 MiB): give bytes, 0 for the default 1 MiB",
                r.output_limit,
                limits::MAX_OUTPUT_LIMIT
            )));
        }
        let out = self
            .sessions(&r.sandbox_id)?
            .run_in_session(agent::RunInSessionRequest {
                session_id: r.session_id,
                command: r.command,
                timeout_ms: r.timeout_ms,
                wait: r.wait,
                output_limit: r.output_limit,
            })
            .await
            .map_err(|s| self.0.call_error(&r.sandbox_id, s))?
            .into_inner();
        self.0.get(&r.sandbox_id).map(|e| e.touch()).ok();
        Ok(Response::new(out))
    }

    async fn read_output(
        &self,
        request: Request<ReadOutputRequest>,
    ) -> Result<Response<CommandResult>, Status> {
        let r = request.into_inner();
        let out = self
            .sessions(&r.sandbox_id)?
            .read_output(agent::ReadOutputRequest {
                session_id: r.session_id,
                command_id: r.command_id,
                wait: r.wait,
            })
            .await
            .map_err(|s| self.0.call_error(&r.sandbox_id, s))?
            .into_inner();
        Ok(Response::new(out))
    }

    async fn close(
        &self,
        request: Request<CloseSessionRequest>,
    ) -> Result<Response<CloseSessionResponse>, Status> {
        let r = request.into_inner();
        self.sessions(&r.sandbox_id)?
            .close_session(agent::CloseSessionRequest {
                session_id: r.session_id,
            })
            .await
            .map_err(|s| self.0.call_error(&r.sandbox_id, s))?;
        Ok(Response::new(CloseSessionResponse {}))
    }

    async fn list(
        &self,
        request: Request<ListSessionsRequest>,
    ) -> Result<Response<ListSessionsResponse>, Status> {
        let r = request.into_inner();
        let out = self
            .sessions(&r.sandbox_id)?
            .list_sessions(agent::ListSessionsRequest {})
            .await
            .map_err(|s| self.0.call_error(&r.sandbox_id, s))?
            .into_inner();
        Ok(Response::new(out))
    }
}

/// A client's exec message after its start, as the agent takes it: stdin, EOF, signals and
/// resizes are the same messages in both APIs; a second start goes on empty (the agent
/// refuses it).
fn exec_input(message: ExecRequest) -> agent::ExecRequest {
    use agent::exec_request::Kind as ToAgent;
    use exec_request::Kind;
    agent::ExecRequest {
        kind: message.kind.map(|kind| match kind {
            Kind::Start(_) => ToAgent::Start(agent::ExecStart::default()),
            Kind::Stdin(data) => ToAgent::Stdin(data),
            Kind::StdinEof(eof) => ToAgent::StdinEof(eof),
            Kind::Signal(signal) => ToAgent::Signal(signal),
            Kind::Resize(size) => ToAgent::Resize(size),
        }),
    }
}

/// What the node adds to an exec's or session's env: the sandbox's, unless its agent holds it.
fn sandbox_env(record: &super::record::Record) -> std::collections::HashMap<String, String> {
    if record.env_in_guest {
        return std::collections::HashMap::new();
    }
    record.env.clone().into_iter().collect()
}
