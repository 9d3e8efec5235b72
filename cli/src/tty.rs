//! Interactive exec: `dsec exec -i/-t` and `dsec shell` on a terminal. With `-t` the
//! command runs on a pseudo-terminal in the sandbox and, with `-i` too, the local terminal
//! is switched to raw mode so every key (^C, ^Z, arrows) goes to the remote side.

use std::io::{IsTerminal, Write};
use std::os::fd::AsFd;

use dsec_sdk::{Client, ExecEvent, ExecStart, PtyConfig};
use nix::sys::termios::{self, SetArg, Termios};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::mpsc;

use crate::node::NodeError;

/// Shell for `dsec shell`: bash when the image has it, else sh, as a login shell.
pub const SHELL_SCRIPT: &str = "if [ -x /bin/bash ]; then exec /bin/bash -l; fi; exec /bin/sh -l";

/// Size used when the terminal does not report one (TIOCGWINSZ gives 0 x 0).
const FALLBACK_SIZE: (u32, u32) = (24, 80);

/// Puts the local terminal (stdin) in raw mode; restores the saved settings on drop, so
/// every way out of the command (exit, error, signal, panic unwinding) puts it back.
struct RawMode {
    saved: Termios,
}

impl RawMode {
    fn enter() -> Result<Self, NodeError> {
        let stdin = std::io::stdin();
        let saved = termios::tcgetattr(stdin.as_fd()).map_err(|e| NodeError::Io {
            what: "read the terminal settings of stdin".into(),
            source: e.into(),
        })?;
        let mut raw = saved.clone();
        termios::cfmakeraw(&mut raw);
        termios::tcsetattr(stdin.as_fd(), SetArg::TCSANOW, &raw).map_err(|e| NodeError::Io {
            what: "switch the terminal to raw mode".into(),
            source: e.into(),
        })?;
        Ok(Self { saved })
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        // TCSADRAIN: output already written keeps the raw settings it was written under.
        let _ = termios::tcsetattr(std::io::stdin().as_fd(), SetArg::TCSADRAIN, &self.saved);
    }
}

/// Rows and cols of the local terminal (stdin), if it reports a size.
fn window_size() -> Option<(u32, u32)> {
    let mut size = libc::winsize {
        ws_row: 0,
        ws_col: 0,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCGWINSZ writes one `winsize` into the valid, exclusively borrowed struct;
    // fd 0 is only read.
    let rc = unsafe { libc::ioctl(libc::STDIN_FILENO, libc::TIOCGWINSZ, &mut size) };
    (rc == 0 && size.ws_row > 0 && size.ws_col > 0)
        .then(|| (u32::from(size.ws_row), u32::from(size.ws_col)))
}

/// Reads stdin on a plain thread (a blocking read cannot be cancelled; the thread ends with
/// the process) and hands chunks over; `None` is EOF.
fn stdin_reader() -> mpsc::Receiver<Option<Vec<u8>>> {
    let (tx, rx) = mpsc::channel(16);
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 32 * 1024];
        loop {
            match nix::unistd::read(std::io::stdin().as_fd(), &mut buf) {
                Ok(0) => {
                    let _ = tx.blocking_send(None);
                    return;
                }
                Ok(n) => {
                    if tx.blocking_send(Some(buf[..n].to_vec())).is_err() {
                        return;
                    }
                }
                Err(nix::errno::Errno::EINTR) => continue,
                Err(_) => {
                    let _ = tx.blocking_send(None);
                    return;
                }
            }
        }
    });
    rx
}

/// Runs `argv` in sandbox `id`: `stdin` streams local stdin live, `tty` runs it on a
/// pseudo-terminal sized like the local one (which must be a terminal). Returns the
/// command's exit code (128 + N when killed by signal N).
pub async fn exec(
    c: &Client,
    id: &str,
    argv: Vec<String>,
    stdin: bool,
    tty: bool,
) -> Result<i32, NodeError> {
    let local_tty = std::io::stdin().is_terminal();
    if tty && !local_tty {
        return Err(NodeError::Usage(
            "-t needs a terminal on stdin, but stdin is a pipe or a file: run from a terminal, \
             or drop -t (-i streams stdin without a terminal)"
                .into(),
        ));
    }
    let pty = tty.then(|| {
        let (rows, cols) = window_size().unwrap_or(FALLBACK_SIZE);
        PtyConfig {
            rows,
            cols,
            term: std::env::var("TERM").unwrap_or_default(),
        }
    });
    let start = ExecStart {
        sandbox_id: id.into(),
        argv,
        stdin,
        pty,
        ..Default::default()
    };
    let mut session = c.exec_stream(start).await?;
    let input = session.input();
    // Raw only when keys are forwarded: with -t alone the local terminal keeps ^C for us.
    let _raw = if tty && stdin {
        Some(RawMode::enter()?)
    } else {
        None
    };
    let mut keys = stdin.then(stdin_reader);
    let signal_err = |e: std::io::Error| NodeError::Io {
        what: "install signal handlers".into(),
        source: e,
    };
    let mut winch = signal(SignalKind::window_change()).map_err(signal_err)?;
    let mut interrupt = signal(SignalKind::interrupt()).map_err(signal_err)?;
    let mut terminate = signal(SignalKind::terminate()).map_err(signal_err)?;
    let mut hangup = signal(SignalKind::hangup()).map_err(signal_err)?;
    let mut stdout = std::io::stdout();
    let mut stderr = std::io::stderr();
    loop {
        tokio::select! {
            event = session.next() => match event? {
                Some(ExecEvent::Stdout(data)) => {
                    let _ = stdout.write_all(&data);
                    let _ = stdout.flush();
                }
                Some(ExecEvent::Stderr(data)) => {
                    let _ = stderr.write_all(&data);
                }
                Some(ExecEvent::Exit(e)) => {
                    return Ok(e.code.or(e.signal.map(|s| 128 + s)).unwrap_or(255));
                }
                Some(ExecEvent::Started(_)) => {}
                None => return Err(dsec_sdk::Error::NoExit.into()),
            },
            chunk = async { keys.as_mut()?.recv().await }, if keys.is_some() => {
                let sent = match chunk.flatten() {
                    Some(data) => input.stdin(data).await,
                    None => {
                        keys = None;
                        input.close_stdin().await
                    }
                };
                // The command may have closed the call already: its exit comes next.
                if sent.is_err() {
                    keys = None;
                }
            },
            _ = winch.recv(), if tty => {
                if let Some((rows, cols)) = window_size() {
                    let _ = input.resize(rows, cols).await;
                }
            },
            // Without raw mode ^C reaches us: pass it on, the command decides.
            _ = interrupt.recv() => { let _ = input.signal(libc::SIGINT).await; },
            // Leaving returns through `_raw`, which restores the terminal.
            _ = terminate.recv() => return Ok(128 + libc::SIGTERM),
            _ = hangup.recv() => return Ok(128 + libc::SIGHUP),
        }
    }
}
