//! Chronus: persistent shell sessions.
//!
//! Each session is one long-lived shell (its own process session). A command is written to
//! the shell's stdin wrapped as
//!
//! ```text
//! { COMMAND
//! } </dev/null 3>&-
//! printf 'TOKEN %d\n' "$?" >&3
//! ```
//!
//! so it runs in the shell itself (cd, export, functions persist), cannot read the rest of the
//! script from stdin, and cannot reach the status pipe (fd 3). The status line arrives on its
//! own pipe; the command's output (stdout and stderr on one pipe, in order) is read
//! continuously into a capture that keeps a head and a tail of bounded size, so a `yes` flood
//! costs CPU but never memory. A syntax error would make a non-interactive shell exit, so the
//! text is checked with `SHELL -n -c` first.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dsec_api::agent::v1::sessions_server::Sessions;
use dsec_api::agent::v1::{
    CloseSessionRequest, CloseSessionResponse, CommandResult, CreateSessionRequest,
    ListSessionsRequest, ListSessionsResponse, ReadOutputRequest, RunInSessionRequest, SessionInfo,
};
use nix::fcntl::OFlag;
use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::{pipe2, Pid};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::pipe;
use tokio::sync::watch;
use tonic::{Request, Response, Status};

use crate::confine::Confinement;
use crate::reaper::Reaper;

/// Default per-command output cap (head + tail).
pub const DEFAULT_OUTPUT_LIMIT: u64 = 1024 * 1024;
/// Largest cap a client may ask for.
const MAX_OUTPUT_LIMIT: u64 = 64 * 1024 * 1024;
/// Commands whose results are kept per session (older ones are forgotten).
const HISTORY: usize = 64;
/// Open sessions per agent.
const MAX_SESSIONS: usize = 256;
/// After a timeout killed the command's children, how long the shell may take to report.
const KILL_GRACE: Duration = Duration::from_secs(2);
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Output of one command: the first `limit/2` bytes, and the last `limit/2` bytes.
#[derive(Debug, Default)]
pub struct Capture {
    head: Vec<u8>,
    tail: VecDeque<u8>,
    half: usize,
    total: u64,
}

impl Capture {
    pub fn new(limit: u64) -> Self {
        let half = (limit.clamp(2, MAX_OUTPUT_LIMIT) / 2) as usize;
        Self {
            head: Vec::new(),
            tail: VecDeque::new(),
            half,
            total: 0,
        }
    }

    pub fn push(&mut self, mut data: &[u8]) {
        self.total += data.len() as u64;
        if self.head.len() < self.half {
            let n = (self.half - self.head.len()).min(data.len());
            self.head.extend_from_slice(&data[..n]);
            data = &data[n..];
        }
        if data.len() >= self.half {
            // Only the last `half` bytes of this chunk can survive.
            self.tail.clear();
            self.tail.extend(&data[data.len() - self.half..]);
        } else {
            let overflow = (self.tail.len() + data.len()).saturating_sub(self.half);
            self.tail.drain(..overflow);
            self.tail.extend(data);
        }
    }

    pub fn truncated(&self) -> bool {
        self.total > (self.head.len() + self.tail.len()) as u64
    }

    /// Head, then (when bytes were dropped) a marker line, then tail.
    pub fn render(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.head.len() + self.tail.len() + 64);
        out.extend_from_slice(&self.head);
        if self.truncated() {
            let dropped = self.total - (self.head.len() + self.tail.len()) as u64;
            out.extend_from_slice(
                format!("\n[dsec: output truncated, {dropped} bytes omitted]\n").as_bytes(),
            );
        }
        out.extend(self.tail.iter());
        out
    }
}

struct CommandRecord {
    id: u64,
    token: String,
    capture: Capture,
    done: bool,
    exit_code: Option<i32>,
    timed_out: bool,
    session_ended: bool,
    started: Instant,
    duration: Duration,
    done_tx: watch::Sender<bool>,
}

impl CommandRecord {
    fn result(&self, session_id: &str) -> CommandResult {
        CommandResult {
            session_id: session_id.to_string(),
            command_id: self.id,
            done: self.done,
            exit_code: self.exit_code,
            timed_out: self.timed_out,
            output: self.capture.render(),
            truncated: self.capture.truncated(),
            total_bytes: self.capture.total,
            duration_ms: if self.done {
                self.duration.as_millis() as u64
            } else {
                self.started.elapsed().as_millis() as u64
            },
            session_ended: self.session_ended,
        }
    }

    fn finish(&mut self, exit_code: Option<i32>, session_ended: bool) {
        self.done = true;
        self.exit_code = exit_code;
        self.session_ended = session_ended;
        self.duration = self.started.elapsed();
        self.done_tx.send_replace(true);
    }
}

#[derive(Default)]
struct SessionState {
    alive: bool,
    next_id: u64,
    /// The running command, if any.
    current: Option<u64>,
    commands: BTreeMap<u64, CommandRecord>,
}

struct Session {
    id: String,
    shell: String,
    shell_pid: Pid,
    stdin: tokio::sync::Mutex<Option<pipe::Sender>>,
    state: Mutex<SessionState>,
}

impl Session {
    fn lock(&self) -> std::sync::MutexGuard<'_, SessionState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn info(&self) -> SessionInfo {
        let state = self.lock();
        SessionInfo {
            session_id: self.id.clone(),
            shell_pid: self.shell_pid.as_raw() as u32,
            alive: state.alive,
            commands: state.next_id,
            busy: state.current.is_some(),
        }
    }
}

/// Serves `dsec.agent.v1.Sessions`.
pub struct SessionsService {
    reaper: Arc<Reaper>,
    confinement: Arc<Confinement>,
    sessions: Mutex<HashMap<String, Arc<Session>>>,
    counter: AtomicU64,
}

impl SessionsService {
    pub fn new(reaper: Arc<Reaper>, confinement: Arc<Confinement>) -> Self {
        Self {
            reaper,
            confinement,
            sessions: Mutex::new(HashMap::new()),
            counter: AtomicU64::new(1),
        }
    }

    fn get(&self, id: &str) -> Result<Arc<Session>, Status> {
        self.sessions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(id)
            .cloned()
            .ok_or_else(|| {
                Status::not_found(format!(
                    "no session {id:?} in this sandbox: create one with CreateSession"
                ))
            })
    }
}

fn io_internal(what: &str, err: impl std::fmt::Display) -> Status {
    Status::internal(format!("session: {what}: {err}"))
}

fn pipe_pair() -> Result<(OwnedFd, OwnedFd), Status> {
    pipe2(OFlag::O_CLOEXEC | OFlag::O_NONBLOCK).map_err(|e| io_internal("pipe", e))
}

fn set_blocking(fd: &OwnedFd) -> Result<(), Status> {
    let flags = nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_GETFL)
        .map_err(|e| io_internal("fcntl", e))?;
    let flags = OFlag::from_bits_truncate(flags) & !OFlag::O_NONBLOCK;
    nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_SETFL(flags))
        .map_err(|e| io_internal("fcntl", e))?;
    Ok(())
}

/// A random-enough token nobody inside the sandbox can predict before the command runs.
fn new_token() -> String {
    let mut bytes = [0u8; 16];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        use std::io::Read;
        let _ = f.read_exact(&mut bytes);
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!("DSEC{hex}{nanos:x}")
}

/// All descendants of `root` (not `root` itself), from /proc.
fn descendants(root: Pid) -> Vec<Pid> {
    let mut parent_of = HashMap::new();
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for entry in entries.flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                continue;
            };
            // The field after the parenthesised name: state, then ppid.
            if let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) {
                if let Some(ppid) = rest.split_whitespace().nth(1) {
                    if let Ok(ppid) = ppid.parse::<i32>() {
                        parent_of.insert(pid, ppid);
                    }
                }
            }
        }
    }
    let mut found = Vec::new();
    let mut frontier = vec![root.as_raw()];
    while let Some(p) = frontier.pop() {
        for (&child, &parent) in &parent_of {
            if parent == p && !found.contains(&Pid::from_raw(child)) {
                found.push(Pid::from_raw(child));
                frontier.push(child);
            }
        }
    }
    found
}

impl SessionsService {
    fn spawn_shell(&self, request: &CreateSessionRequest) -> Result<Arc<Session>, Status> {
        let shell = if request.shell.is_empty() {
            "/bin/sh".to_string()
        } else {
            request.shell.clone()
        };
        if shell.contains('\0') || request.workdir.contains('\0') {
            return Err(Status::invalid_argument(
                "shell or workdir contains a NUL byte",
            ));
        }
        if request
            .env
            .iter()
            .any(|(k, v)| k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0'))
        {
            return Err(Status::invalid_argument(
                "env has an invalid name (empty, or containing '=' or NUL) or a value with NUL",
            ));
        }
        let workdir = if request.workdir.is_empty() {
            "/"
        } else {
            request.workdir.as_str()
        };
        if !std::path::Path::new(workdir).is_dir() {
            return Err(Status::invalid_argument(format!(
                "workdir {workdir} is not an existing directory"
            )));
        }
        let (stdin_r, stdin_w) = pipe_pair()?;
        let (out_r, out_w) = pipe_pair()?;
        let (ctl_r, ctl_w) = pipe_pair()?;
        for fd in [&stdin_r, &out_w, &ctl_w] {
            set_blocking(fd)?;
        }
        let out_w2 = out_w.try_clone().map_err(|e| io_internal("dup", e))?;
        let ctl_raw = ctl_w.as_raw_fd();
        let mut command = Command::new(&shell);
        command
            .env_clear()
            .env("PATH", DEFAULT_PATH)
            .env("HOME", "/root")
            .env("TERM", "dumb")
            .envs(crate::sandbox_env::current())
            .envs(&request.env)
            .current_dir(workdir)
            .stdin(Stdio::from(stdin_r))
            .stdout(Stdio::from(out_w))
            .stderr(Stdio::from(out_w2));
        let confinement = self.confinement.clone();
        // SAFETY: between fork and exec only async-signal-safe syscalls run (setsid, dup2,
        // seccomp, prctl); `confinement` and `ctl_raw` were prepared before fork.
        unsafe {
            command.pre_exec(move || {
                nix::unistd::setsid().map_err(io::Error::from)?;
                if libc::dup2(ctl_raw, 3) < 0 {
                    return Err(io::Error::last_os_error());
                }
                confinement.apply()
            });
        }
        let (pid, status) = self
            .reaper
            .spawn(&mut command)
            .map_err(|err| match err.kind() {
                io::ErrorKind::NotFound => {
                    Status::not_found(format!("shell {shell} not found in the sandbox"))
                }
                _ => Status::failed_precondition(format!("cannot start shell {shell}: {err}")),
            })?;
        self.confinement.after_spawn(pid);
        drop(command);
        drop(ctl_w);
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        let session = Arc::new(Session {
            id: format!("s{n}"),
            shell,
            shell_pid: pid,
            stdin: tokio::sync::Mutex::new(Some(
                pipe::Sender::from_owned_fd(stdin_w).map_err(|e| io_internal("pipe", e))?,
            )),
            state: Mutex::new(SessionState {
                alive: true,
                ..SessionState::default()
            }),
        });
        let out = pipe::Receiver::from_owned_fd(out_r).map_err(|e| io_internal("pipe", e))?;
        let ctl = pipe::Receiver::from_owned_fd(ctl_r).map_err(|e| io_internal("pipe", e))?;
        tokio::spawn(read_session(session.clone(), out, ctl, status));
        Ok(session)
    }
}

/// Moves the shell's output into the running command's capture and completes commands when
/// their status line arrives (or the shell exits).
async fn read_session(
    session: Arc<Session>,
    mut out: pipe::Receiver,
    ctl: pipe::Receiver,
    mut shell_status: tokio::sync::oneshot::Receiver<nix::sys::wait::WaitStatus>,
) {
    let mut ctl = tokio::io::BufReader::new(ctl).lines();
    let mut buf = vec![0u8; 64 * 1024];
    let append = |session: &Session, data: &[u8]| {
        let mut state = session.lock();
        if let Some(id) = state.current {
            if let Some(record) = state.commands.get_mut(&id) {
                record.capture.push(data);
            }
        }
    };
    let drain = |session: &Session, out: &mut pipe::Receiver, buf: &mut [u8]| loop {
        match out.try_read(buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => append(session, &buf[..n]),
        }
    };
    let mut out_open = true;
    loop {
        tokio::select! {
            read = out.read(&mut buf), if out_open => match read {
                Ok(0) | Err(_) => out_open = false,
                Ok(n) => append(&session, &buf[..n]),
            },
            line = ctl.next_line() => match line {
                Ok(Some(line)) => {
                    // Everything the command wrote is in the pipe by now.
                    drain(&session, &mut out, &mut buf);
                    let mut state = session.lock();
                    let Some(id) = state.current else { continue };
                    let Some(record) = state.commands.get_mut(&id) else { continue };
                    let Some(code) = line.strip_prefix(record.token.as_str()) else {
                        tracing::debug!("ignoring a forged session status line");
                        continue;
                    };
                    let code = code.trim().parse::<i32>().ok();
                    record.finish(code, false);
                    state.current = None;
                }
                Ok(None) | Err(_) => {
                    // The shell is gone (or closed fd 3): wait for its exit below.
                    let status = (&mut shell_status).await.ok();
                    drain(&session, &mut out, &mut buf);
                    shell_exited(&session, status);
                    return;
                }
            },
            status = &mut shell_status => {
                drain(&session, &mut out, &mut buf);
                shell_exited(&session, status.ok());
                return;
            }
        }
    }
}

fn shell_exited(session: &Session, status: Option<nix::sys::wait::WaitStatus>) {
    let mut state = session.lock();
    state.alive = false;
    if let Some(id) = state.current.take() {
        if let Some(record) = state.commands.get_mut(&id) {
            let code = match status {
                Some(nix::sys::wait::WaitStatus::Exited(_, code)) => Some(code),
                Some(nix::sys::wait::WaitStatus::Signaled(_, sig, _)) => Some(128 + sig as i32),
                _ => None,
            };
            record.finish(code, true);
        }
    }
    // The shell's group may still hold background jobs; they die with the session.
    let _ = killpg(session.shell_pid, Signal::SIGKILL);
}

/// Runs `shell -n -c text`: None when the text parses, else the shell's complaint.
async fn syntax_error(reaper: &Reaper, shell: &str, text: &str) -> Result<Option<Vec<u8>>, Status> {
    let (err_r, err_w) = pipe_pair()?;
    set_blocking(&err_w)?;
    let mut command = Command::new(shell);
    command
        .args(["-n", "-c", text])
        .env_clear()
        .env("PATH", DEFAULT_PATH)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(err_w));
    let (_, status) = reaper
        .spawn(&mut command)
        .map_err(|e| io_internal("syntax check", e))?;
    drop(command);
    let mut err = pipe::Receiver::from_owned_fd(err_r).map_err(|e| io_internal("pipe", e))?;
    let mut message = Vec::new();
    let _ = (&mut err).take(64 * 1024).read_to_end(&mut message).await;
    match status.await {
        Ok(nix::sys::wait::WaitStatus::Exited(_, 0)) => Ok(None),
        _ => Ok(Some(message)),
    }
}

async fn wait_done(session: &Session, id: u64) -> Result<CommandResult, Status> {
    let mut done_rx = {
        let state = session.lock();
        let record = state.commands.get(&id).ok_or_else(|| forgotten(id))?;
        record.done_tx.subscribe()
    };
    let _ = done_rx.wait_for(|done| *done).await;
    let state = session.lock();
    state
        .commands
        .get(&id)
        .map(|r| r.result(&session.id))
        .ok_or_else(|| forgotten(id))
}

fn forgotten(id: u64) -> Status {
    Status::not_found(format!(
        "command {id} is unknown or too old (the last {HISTORY} commands are kept)"
    ))
}

/// Kills the command's processes on timeout, then the shell if it still does not report.
async fn enforce_timeout(session: Arc<Session>, id: u64, timeout: Duration) {
    let mut done_rx = {
        let state = session.lock();
        let Some(record) = state.commands.get(&id) else {
            return;
        };
        record.done_tx.subscribe()
    };
    if tokio::time::timeout(timeout, done_rx.wait_for(|d| *d))
        .await
        .is_ok()
    {
        return;
    }
    {
        let mut state = session.lock();
        if let Some(record) = state.commands.get_mut(&id) {
            record.timed_out = true;
        }
    }
    for pid in descendants(session.shell_pid) {
        let _ = kill(pid, Signal::SIGKILL);
    }
    if tokio::time::timeout(KILL_GRACE, done_rx.wait_for(|d| *d))
        .await
        .is_err()
    {
        // A shell builtin loop cannot be stopped without stopping the shell.
        tracing::info!(session = %session.id, "timeout: killing the session's shell");
        let _ = killpg(session.shell_pid, Signal::SIGKILL);
    }
}

#[tonic::async_trait]
impl Sessions for SessionsService {
    async fn create_session(
        &self,
        request: Request<CreateSessionRequest>,
    ) -> Result<Response<SessionInfo>, Status> {
        {
            let sessions = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
            if sessions.len() >= MAX_SESSIONS {
                return Err(Status::resource_exhausted(format!(
                    "{MAX_SESSIONS} sessions are open in this sandbox: close some first"
                )));
            }
        }
        let session = self.spawn_shell(request.get_ref())?;
        let info = session.info();
        self.sessions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(session.id.clone(), session);
        Ok(Response::new(info))
    }

    async fn run_in_session(
        &self,
        request: Request<RunInSessionRequest>,
    ) -> Result<Response<CommandResult>, Status> {
        let request = request.into_inner();
        let session = self.get(&request.session_id)?;
        if request.command.contains('\0') {
            return Err(Status::invalid_argument("command contains a NUL byte"));
        }
        if request.output_limit > MAX_OUTPUT_LIMIT {
            return Err(Status::invalid_argument(format!(
                "output_limit {} is above the maximum {MAX_OUTPUT_LIMIT}",
                request.output_limit
            )));
        }
        {
            let state = session.lock();
            if !state.alive {
                return Err(Status::failed_precondition(format!(
                    "session {} has ended (its shell exited): create a new one",
                    session.id
                )));
            }
            if let Some(current) = state.current {
                return Err(Status::failed_precondition(format!(
                    "session {} is busy with command {current}: wait for it (ReadOutput with wait) or use another session",
                    session.id
                )));
            }
        }
        let limit = if request.output_limit == 0 {
            DEFAULT_OUTPUT_LIMIT
        } else {
            request.output_limit
        };
        let syntax = syntax_error(&self.reaper, &session.shell, &request.command).await?;
        let token = new_token();
        let id = {
            let mut state = session.lock();
            if state.current.is_some() {
                return Err(Status::failed_precondition(format!(
                    "session {} is busy: another command just started",
                    session.id
                )));
            }
            state.next_id += 1;
            let id = state.next_id;
            let (done_tx, _) = watch::channel(false);
            let mut record = CommandRecord {
                id,
                token: token.clone(),
                capture: Capture::new(limit),
                done: false,
                exit_code: None,
                timed_out: false,
                session_ended: false,
                started: Instant::now(),
                duration: Duration::ZERO,
                done_tx,
            };
            if let Some(message) = &syntax {
                // Reported like the shell would (status 2), without losing the session.
                record.capture.push(message);
                record.finish(Some(2), false);
            } else {
                state.current = Some(id);
            }
            state.commands.insert(id, record);
            while state.commands.len() > HISTORY {
                let oldest = *state.commands.keys().next().unwrap_or(&id);
                state.commands.remove(&oldest);
            }
            id
        };
        if syntax.is_none() {
            let script = format!(
                "{{ {}\n}} </dev/null 3>&-\nprintf '{token} %d\\n' \"$?\" >&3\n",
                request.command
            );
            let mut stdin = session.stdin.lock().await;
            let written = match stdin.as_mut() {
                Some(pipe) => pipe.write_all(script.as_bytes()).await.is_ok(),
                None => false,
            };
            if !written {
                *stdin = None;
                let mut state = session.lock();
                state.current = None;
                if let Some(record) = state.commands.get_mut(&id) {
                    record.finish(None, true);
                }
                return Err(Status::failed_precondition(format!(
                    "session {} has ended (its shell stopped reading): create a new one",
                    session.id
                )));
            }
            if request.timeout_ms > 0 {
                tokio::spawn(enforce_timeout(
                    session.clone(),
                    id,
                    Duration::from_millis(request.timeout_ms),
                ));
            }
        }
        if request.wait {
            return wait_done(&session, id).await.map(Response::new);
        }
        let state = session.lock();
        let record = state.commands.get(&id).ok_or_else(|| forgotten(id))?;
        Ok(Response::new(record.result(&session.id)))
    }

    async fn read_output(
        &self,
        request: Request<ReadOutputRequest>,
    ) -> Result<Response<CommandResult>, Status> {
        let request = request.into_inner();
        let session = self.get(&request.session_id)?;
        let id = if request.command_id == 0 {
            let state = session.lock();
            *state.commands.keys().next_back().ok_or_else(|| {
                Status::not_found(format!("session {} has run no command yet", session.id))
            })?
        } else {
            request.command_id
        };
        if request.wait {
            return wait_done(&session, id).await.map(Response::new);
        }
        let state = session.lock();
        let record = state.commands.get(&id).ok_or_else(|| forgotten(id))?;
        Ok(Response::new(record.result(&session.id)))
    }

    async fn close_session(
        &self,
        request: Request<CloseSessionRequest>,
    ) -> Result<Response<CloseSessionResponse>, Status> {
        let id = request.into_inner().session_id;
        let session = self
            .sessions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id)
            .ok_or_else(|| Status::not_found(format!("no session {id:?} in this sandbox")))?;
        *session.stdin.lock().await = None;
        // The shell leads its own process group: this ends it and everything it started.
        let _ = killpg(session.shell_pid, Signal::SIGKILL);
        Ok(Response::new(CloseSessionResponse {}))
    }

    async fn list_sessions(
        &self,
        _: Request<ListSessionsRequest>,
    ) -> Result<Response<ListSessionsResponse>, Status> {
        let sessions = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
        let mut list: Vec<SessionInfo> = sessions.values().map(|s| s.info()).collect();
        list.sort_by(|a, b| a.session_id.cmp(&b.session_id));
        Ok(Response::new(ListSessionsResponse { sessions: list }))
    }
}

#[cfg(test)]
mod tests {
    use super::Capture;

    #[test]
    fn capture_keeps_head_and_tail() {
        let mut c = Capture::new(8);
        c.push(b"0123");
        c.push(b"456789abcdef");
        assert_eq!(c.total, 16);
        assert!(c.truncated());
        let out = c.render();
        assert!(out.starts_with(b"0123"));
        assert!(out.ends_with(b"cdef"));
        let mut small = Capture::new(100);
        small.push(b"hello");
        assert!(!small.truncated());
        assert_eq!(small.render(), b"hello");
    }

    #[test]
    fn capture_is_bounded_under_a_flood() {
        let mut c = Capture::new(1024);
        let chunk = vec![b'y'; 65536];
        for _ in 0..1000 {
            c.push(&chunk);
        }
        assert_eq!(c.total, 65_536_000);
        assert!(c.head.len() + c.tail.len() <= 1024);
    }
}
