//! The Process service: Exec with live, separate stdout/stderr, stdin, signals and timeouts.

use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use dsec_api::agent::v1::process_server::Process;
use dsec_api::agent::v1::{
    exec_request, exec_response, ExecRequest, ExecResponse, ExecStart, ExecStarted, ExitStatus,
};
use nix::fcntl::OFlag;
use nix::sys::signal::{killpg, Signal};
use nix::sys::wait::WaitStatus;
use nix::unistd::{pipe2, Pid};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::pipe;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::confine::Confinement;
use crate::reaper::Reaper;

/// Messages buffered per Exec before the command is slowed down (backpressure).
const RESPONSE_QUEUE: usize = 16;
/// Largest stdout/stderr chunk sent in one message.
const CHUNK_BYTES: usize = 32 * 1024;
/// After the command exits, how long its pipes may stay open (held by background children)
/// before the exit status is sent anyway.
const DRAIN_GRACE: Duration = Duration::from_millis(200);
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

type ResponseTx = mpsc::Sender<Result<ExecResponse, Status>>;

/// Serves `dsec.agent.v1.Process`.
pub struct ProcessService {
    reaper: Arc<Reaper>,
    /// Applied to every command before exec (capabilities and seccomp in containers).
    confinement: Arc<Confinement>,
}

impl ProcessService {
    pub fn new(reaper: Arc<Reaper>, confinement: Arc<Confinement>) -> Self {
        Self {
            reaper,
            confinement,
        }
    }
}

#[tonic::async_trait]
impl Process for ProcessService {
    type ExecStream = ReceiverStream<Result<ExecResponse, Status>>;

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
                    "the first Exec message must be `start` (argv, env, workdir...)",
                ))
            }
        };
        let running = spawn_command(&self.reaper, &start, self.confinement.clone())?;
        let (tx, rx) = mpsc::channel(RESPONSE_QUEUE);
        tokio::spawn(supervise(running, start, inbound, tx));
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

struct RunningCommand {
    pid: Pid,
    status: tokio::sync::oneshot::Receiver<WaitStatus>,
    stdin: Option<pipe::Sender>,
    stdout: pipe::Receiver,
    stderr: pipe::Receiver,
}

fn spawn_command(
    reaper: &Reaper,
    start: &ExecStart,
    confinement: Arc<Confinement>,
) -> Result<RunningCommand, Status> {
    let Some(program) = start.argv.first() else {
        return Err(Status::invalid_argument(
            "argv is empty: give the command to run",
        ));
    };
    if start.argv.iter().any(|a| a.contains('\0')) {
        return Err(Status::invalid_argument("argv contains a NUL byte"));
    }
    if start
        .env
        .keys()
        .any(|k| k.is_empty() || k.contains('=') || k.contains('\0'))
        || start.env.values().any(|v| v.contains('\0'))
    {
        return Err(Status::invalid_argument(
            "env has an invalid name (empty, or containing '=' or NUL) or a value with NUL",
        ));
    }
    let workdir = if start.workdir.is_empty() {
        "/"
    } else {
        start.workdir.as_str()
    };
    match std::fs::metadata(workdir) {
        Ok(meta) if meta.is_dir() => {}
        Ok(_) => {
            return Err(Status::invalid_argument(format!(
                "workdir {workdir} is not a directory"
            )))
        }
        Err(err) => return Err(crate::files::io_status("workdir", Path::new(workdir), &err)),
    }

    let (stdout_read, stdout_write) = nonblocking_pipe()?;
    let (stderr_read, stderr_write) = nonblocking_pipe()?;
    let mut command = Command::new(program);
    command
        .args(&start.argv[1..])
        .env_clear()
        .env("PATH", DEFAULT_PATH)
        .env("HOME", "/root")
        .envs(&start.env)
        .current_dir(workdir)
        .stdout(Stdio::from(blocking(stdout_write)?))
        .stderr(Stdio::from(blocking(stderr_write)?));
    let stdin = if start.stdin {
        let (stdin_read, stdin_write) = nonblocking_pipe()?;
        command.stdin(Stdio::from(blocking(stdin_read)?));
        Some(pipe::Sender::from_owned_fd(stdin_write).map_err(internal)?)
    } else {
        command.stdin(Stdio::null());
        None
    };
    // SAFETY: the closure runs between fork and exec and only makes raw syscalls (setsid,
    // seccomp, prctl), which are async-signal-safe; it reads `confinement`, built before
    // fork. A new session makes the command a process-group leader, so a timeout can kill
    // the whole tree it starts.
    unsafe {
        command.pre_exec(move || {
            nix::unistd::setsid().map_err(io::Error::from)?;
            confinement.apply()
        });
    }
    let (pid, status) = reaper.spawn(&mut command).map_err(|err| match err.kind() {
        io::ErrorKind::NotFound => Status::not_found(format!(
            "command not found: {program} (not in PATH {DEFAULT_PATH} or no such file)"
        )),
        io::ErrorKind::PermissionDenied => Status::permission_denied(format!(
            "cannot execute {program}: permission denied (is it executable?)"
        )),
        _ => Status::failed_precondition(format!("cannot start {program}: {err}")),
    })?;
    // The write ends given to the child were moved into `command`; drop it so our copies
    // close and EOF arrives when the command (and its children) exit.
    drop(command);
    Ok(RunningCommand {
        pid,
        status,
        stdin,
        stdout: pipe::Receiver::from_owned_fd(stdout_read).map_err(internal)?,
        stderr: pipe::Receiver::from_owned_fd(stderr_read).map_err(internal)?,
    })
}

fn nonblocking_pipe() -> Result<(OwnedFd, OwnedFd), Status> {
    pipe2(OFlag::O_CLOEXEC | OFlag::O_NONBLOCK).map_err(|e| internal(io::Error::from(e)))
}

/// The child's end of a pipe must be blocking: most programs do not expect EAGAIN.
fn blocking(fd: OwnedFd) -> Result<OwnedFd, Status> {
    let flags = nix::fcntl::fcntl(&fd, nix::fcntl::FcntlArg::F_GETFL)
        .map_err(|e| internal(io::Error::from(e)))?;
    let flags = OFlag::from_bits_truncate(flags) & !OFlag::O_NONBLOCK;
    nix::fcntl::fcntl(&fd, nix::fcntl::FcntlArg::F_SETFL(flags))
        .map_err(|e| internal(io::Error::from(e)))?;
    Ok(fd)
}

fn internal(err: io::Error) -> Status {
    Status::internal(format!("agent I/O error: {err}"))
}

fn kill_group(pid: Pid, signal: Signal) {
    if let Err(err) = killpg(pid, signal) {
        tracing::debug!(pid = pid.as_raw(), %err, "killpg failed");
    }
}

async fn supervise(
    running: RunningCommand,
    start: ExecStart,
    inbound: Streaming<ExecRequest>,
    tx: ResponseTx,
) {
    let RunningCommand {
        pid,
        mut status,
        stdin,
        stdout,
        stderr,
    } = running;
    let started = ExecResponse {
        kind: Some(exec_response::Kind::Started(ExecStarted {
            pid: pid.as_raw() as u32,
        })),
    };
    let _ = tx.send(Ok(started)).await;

    let (drain_deadline_tx, drain_deadline) = watch::channel(None);
    let stdout_pump = tokio::spawn(pump(
        stdout,
        tx.clone(),
        exec_response::Kind::Stdout,
        drain_deadline.clone(),
    ));
    let stderr_pump = tokio::spawn(pump(
        stderr,
        tx.clone(),
        exec_response::Kind::Stderr,
        drain_deadline,
    ));
    let input = tokio::spawn(forward_input(inbound, stdin, pid));

    let timeout = (start.timeout_ms > 0).then(|| Duration::from_millis(start.timeout_ms));
    let deadline = timeout.map(|t| Instant::now() + t);
    let mut timed_out = false;
    let wait_status = loop {
        tokio::select! {
            result = &mut status => break result.ok(),
            _ = sleep_until_opt(deadline), if !timed_out => {
                timed_out = true;
                kill_group(pid, Signal::SIGKILL);
            }
            _ = tx.closed() => {
                // The client went away: nobody will read the output; stop the command.
                kill_group(pid, Signal::SIGKILL);
                break (&mut status).await.ok();
            }
        }
    };
    input.abort();
    if timed_out {
        // Children that stayed in the group must not keep the pipes open.
        kill_group(pid, Signal::SIGKILL);
    }
    let _ = drain_deadline_tx.send(Some(Instant::now() + DRAIN_GRACE));
    let _ = stdout_pump.await;
    let _ = stderr_pump.await;

    let exit = match wait_status {
        Some(WaitStatus::Exited(_, code)) => ExitStatus {
            code: Some(code),
            signal: None,
            timed_out,
        },
        Some(WaitStatus::Signaled(_, signal, _)) => ExitStatus {
            code: None,
            signal: Some(signal as i32),
            timed_out,
        },
        other => {
            let _ = tx
                .send(Err(Status::internal(format!(
                    "lost the exit status of pid {pid}: {other:?}"
                ))))
                .await;
            return;
        }
    };
    let _ = tx
        .send(Ok(ExecResponse {
            kind: Some(exec_response::Kind::Exit(exit)),
        }))
        .await;
}

async fn sleep_until_opt(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

/// Copies one output pipe into the response stream until EOF, or until the drain deadline
/// (set when the command exits) passes while background children keep the pipe open.
async fn pump(
    mut pipe: pipe::Receiver,
    tx: ResponseTx,
    wrap: fn(Vec<u8>) -> exec_response::Kind,
    mut drain_deadline: watch::Receiver<Option<Instant>>,
) {
    let mut buf = vec![0u8; CHUNK_BYTES];
    loop {
        let n = tokio::select! {
            biased;
            read = pipe.read(&mut buf) => match read {
                Ok(0) => return,
                Ok(n) => n,
                Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
                Err(err) => {
                    tracing::debug!(%err, "output pipe read failed");
                    return;
                }
            },
            _ = wait_deadline(&mut drain_deadline) => return,
        };
        let message = ExecResponse {
            kind: Some(wrap(buf[..n].to_vec())),
        };
        if tx.send(Ok(message)).await.is_err() {
            return;
        }
        let deadline = *drain_deadline.borrow();
        if deadline.is_some_and(|d| Instant::now() > d) {
            return;
        }
    }
}

async fn wait_deadline(deadline: &mut watch::Receiver<Option<Instant>>) {
    let deadline: Option<Instant> = match deadline.wait_for(|d| d.is_some()).await {
        Ok(d) => *d,
        Err(_) => None,
    };
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        // The sender is gone without a deadline: only EOF ends the pump.
        None => std::future::pending().await,
    }
}

/// Forwards stdin chunks, stdin EOF and signals from the client to the command.
async fn forward_input(
    mut inbound: Streaming<ExecRequest>,
    mut stdin: Option<pipe::Sender>,
    pid: Pid,
) {
    loop {
        let message = match inbound.message().await {
            Ok(Some(message)) => message,
            // End of the client's stream (or a broken one) closes stdin.
            Ok(None) | Err(_) => return,
        };
        match message.kind {
            Some(exec_request::Kind::Stdin(data)) => {
                if let Some(pipe) = stdin.as_mut() {
                    if pipe.write_all(&data).await.is_err() {
                        // The command closed its stdin; drop further input.
                        stdin = None;
                    }
                }
            }
            Some(exec_request::Kind::StdinEof(_)) => stdin = None,
            Some(exec_request::Kind::Signal(number)) => match Signal::try_from(number) {
                Ok(signal) => kill_group(pid, signal),
                Err(_) => tracing::debug!(number, "ignoring invalid signal number"),
            },
            Some(exec_request::Kind::Start(_)) | None => {
                tracing::debug!("ignoring unexpected Exec message");
            }
        }
    }
}
