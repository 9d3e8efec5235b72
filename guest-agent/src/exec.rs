//! The Process service: Exec with live, separate stdout/stderr, stdin, signals and timeouts,
//! optionally on a pseudo-terminal (then stdout carries everything and resizes apply).

use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use dsec_api::agent::v1::process_server::Process;
use dsec_api::agent::v1::{
    exec_request, exec_response, ExecRequest, ExecResponse, ExecStart, ExecStarted, ExitStatus,
    PtyConfig, WindowSize,
};
use nix::fcntl::OFlag;
use nix::pty::PtyMaster;
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
/// Largest terminal side accepted (rows or cols): bigger is a client bug, not a screen.
pub const MAX_PTY_SIDE: u32 = 4096;
/// Longest TERM value accepted.
const MAX_TERM_LEN: usize = 128;
const DEFAULT_TERM: &str = "xterm";

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
    /// None with a PTY: everything arrives on `stdout`.
    stderr: Option<pipe::Receiver>,
    /// The PTY master, for resizes.
    pty: Option<Arc<PtyMaster>>,
}

/// Checks a terminal size from the client: each side 1..=MAX_PTY_SIDE.
fn window_size(what: &str, rows: u32, cols: u32) -> Result<libc::winsize, Status> {
    let side = 1..=MAX_PTY_SIDE;
    if !side.contains(&rows) || !side.contains(&cols) {
        return Err(Status::invalid_argument(format!(
            "{what}: {rows} rows x {cols} cols is out of range: rows and cols must be 1..={MAX_PTY_SIDE}"
        )));
    }
    Ok(libc::winsize {
        ws_row: rows as u16,
        ws_col: cols as u16,
        ws_xpixel: 0,
        ws_ypixel: 0,
    })
}

fn set_window_size(master: &PtyMaster, size: &libc::winsize) -> io::Result<()> {
    // SAFETY: TIOCSWINSZ reads one `winsize` from the valid pointer; the fd is a live PTY
    // master borrowed for the call.
    if unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCSWINSZ, size as *const _) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A PTY pair for one command: the master (non-blocking, close-on-exec) and the slave.
/// posix_openpt + O_CLOEXEC rather than openpty(3) so that no fd of it leaks into a command
/// spawned concurrently on another thread.
fn open_pty(config: &PtyConfig) -> Result<(PtyMaster, OwnedFd), Status> {
    let size = window_size("pty", config.rows, config.cols)?;
    let pty_err = |what: &str, err: nix::Error| {
        Status::failed_precondition(format!(
            "cannot allocate a pseudo-terminal ({what}: {err}): is devpts mounted on /dev/pts?"
        ))
    };
    let master = nix::pty::posix_openpt(OFlag::O_RDWR | OFlag::O_NOCTTY | OFlag::O_CLOEXEC)
        .map_err(|e| pty_err("open /dev/ptmx", e))?;
    nix::pty::grantpt(&master).map_err(|e| pty_err("grantpt", e))?;
    nix::pty::unlockpt(&master).map_err(|e| pty_err("unlockpt", e))?;
    let name = nix::pty::ptsname_r(&master).map_err(|e| pty_err("ptsname", e))?;
    let slave = nix::fcntl::open(
        name.as_str(),
        OFlag::O_RDWR | OFlag::O_NOCTTY | OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .map_err(|e| pty_err("open the slave", e))?;
    set_window_size(&master, &size).map_err(internal)?;
    let flags = nix::fcntl::fcntl(&master, nix::fcntl::FcntlArg::F_GETFL)
        .map_err(|e| internal(io::Error::from(e)))?;
    nix::fcntl::fcntl(
        &master,
        nix::fcntl::FcntlArg::F_SETFL(OFlag::from_bits_truncate(flags) | OFlag::O_NONBLOCK),
    )
    .map_err(|e| internal(io::Error::from(e)))?;
    Ok((master, slave))
}

fn check_term(term: &str) -> Result<&str, Status> {
    if term.is_empty() {
        return Ok(DEFAULT_TERM);
    }
    if term.len() > MAX_TERM_LEN || !term.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(Status::invalid_argument(format!(
            "pty term {term:?} is invalid: give at most {MAX_TERM_LEN} printable ASCII characters (e.g. xterm-256color)"
        )));
    }
    Ok(term)
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

    let term = match &start.pty {
        Some(pty) => Some(check_term(&pty.term)?),
        None => None,
    };
    let mut command = Command::new(program);
    command
        .args(&start.argv[1..])
        .env_clear()
        .env("PATH", DEFAULT_PATH)
        .env("HOME", "/root");
    if let Some(term) = term {
        command.env("TERM", term);
    }
    command
        .envs(crate::sandbox_env::current())
        .envs(&start.env)
        .current_dir(workdir);
    let (stdin, stdout, stderr, pty) = match &start.pty {
        None => {
            let (stdout_read, stdout_write) = nonblocking_pipe()?;
            let (stderr_read, stderr_write) = nonblocking_pipe()?;
            command
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
            (
                stdin,
                pipe::Receiver::from_owned_fd(stdout_read).map_err(internal)?,
                Some(pipe::Receiver::from_owned_fd(stderr_read).map_err(internal)?),
                None,
            )
        }
        Some(config) => {
            let (master, slave) = open_pty(config)?;
            let dup = |fd: &OwnedFd| fd.try_clone().map_err(internal);
            command
                .stdin(Stdio::from(dup(&slave)?))
                .stdout(Stdio::from(dup(&slave)?))
                .stderr(Stdio::from(slave));
            let master_dup = || master.as_fd().try_clone_to_owned().map_err(internal);
            // The master is a character device, not a FIFO: tokio's pipe types work on any
            // non-blocking fd, the check is only about pipes' semantics (EOF shows as EIO).
            let stdin = if start.stdin {
                Some(pipe::Sender::from_owned_fd_unchecked(master_dup()?).map_err(internal)?)
            } else {
                None
            };
            let stdout =
                pipe::Receiver::from_owned_fd_unchecked(master_dup()?).map_err(internal)?;
            (stdin, stdout, None, Some(Arc::new(master)))
        }
    };
    let with_pty = pty.is_some();
    let spawned = confinement.clone();
    // SAFETY: the closure runs between fork and exec and only makes raw syscalls (setsid,
    // ioctl, seccomp, prctl), which are async-signal-safe; it reads `confinement`, built
    // before fork. A new session makes the command a process-group leader, so a timeout can
    // kill the whole tree it starts; with a PTY, TIOCSCTTY makes the slave (already on fd 0
    // when pre_exec runs) its controlling terminal, so ^C reaches the foreground group. The
    // confinement (container mode) comes last: TIOCSCTTY needs no capability it drops.
    unsafe {
        command.pre_exec(move || {
            nix::unistd::setsid().map_err(io::Error::from)?;
            if with_pty && libc::ioctl(0, libc::TIOCSCTTY, 0) != 0 {
                return Err(io::Error::last_os_error());
            }
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
    spawned.after_spawn(pid);
    // The write ends given to the child were moved into `command`; drop it so our copies
    // close and EOF arrives when the command (and its children) exit.
    drop(command);
    Ok(RunningCommand {
        pid,
        status,
        stdin,
        stdout,
        stderr,
        pty,
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
        pty,
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
    let stderr_pump = stderr.map(|stderr| {
        tokio::spawn(pump(
            stderr,
            tx.clone(),
            exec_response::Kind::Stderr,
            drain_deadline,
        ))
    });
    let input = tokio::spawn(forward_input(inbound, stdin, pty, pid, tx.clone()));

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
    if let Some(stderr_pump) = stderr_pump {
        let _ = stderr_pump.await;
    }

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
                // A PTY master reads EIO once every slave fd is closed: its EOF.
                Err(err) if err.raw_os_error() == Some(libc::EIO) => return,
                Err(err) => {
                    tracing::debug!(%err, "output pipe read failed");
                    return;
                }
            },
            _ = wait_deadline(&mut drain_deadline) => return,
        };
        // Fill the chunk with what is already there: a PTY master hands out at most a few
        // KiB per read, and one message per read would make floods cost a message each.
        let mut n = n;
        while n < buf.len() {
            match pipe.try_read(&mut buf[n..]) {
                Ok(0) | Err(_) => break,
                Ok(more) => n += more,
            }
        }
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

/// Forwards stdin chunks, stdin EOF, signals and resizes from the client to the command.
async fn forward_input(
    mut inbound: Streaming<ExecRequest>,
    mut stdin: Option<pipe::Sender>,
    pty: Option<Arc<PtyMaster>>,
    pid: Pid,
    tx: ResponseTx,
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
            Some(exec_request::Kind::StdinEof(_)) => {
                // Closing our copy of a PTY master would not close the terminal: send the
                // EOF character (^D) instead, which ends input of a canonical-mode reader.
                if let (Some(pipe), Some(_)) = (stdin.as_mut(), &pty) {
                    let _ = pipe.write_all(&[4]).await;
                }
                stdin = None;
            }
            Some(exec_request::Kind::Resize(WindowSize { rows, cols })) => {
                let Some(master) = &pty else {
                    tracing::debug!("ignoring resize of a command without a pty");
                    continue;
                };
                let result = window_size("resize", rows, cols)
                    .and_then(|size| set_window_size(master, &size).map_err(internal));
                if let Err(status) = result {
                    // A bad size is a client bug: end the call and the command.
                    kill_group(pid, Signal::SIGKILL);
                    let _ = tx.send(Err(status)).await;
                    return;
                }
            }
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
