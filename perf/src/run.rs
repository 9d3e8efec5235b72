//! Runs one VMM process and timestamps what it does, the same way for every contender.
//!
//! The child's stdout (its serial console) is a pipe created *before* the spawn, and a
//! reader thread is already blocked in `read()` on it when the clock starts, so the first
//! byte is timestamped as soon as the kernel wakes the reader. Another thread blocks in
//! `waitid(WNOWAIT)` so process exit is timestamped without polling and the pid stays
//! valid (unreaped) for a kill until the main thread reaps it. The harness itself does
//! nothing between the clock start and the spawn but `fork`/`exec`.

use std::ffi::OsString;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

/// What to run and when to stop.
#[derive(Debug, Clone)]
pub struct RunSpec {
    pub program: PathBuf,
    pub args: Vec<OsString>,
    /// The child's stderr goes here (diagnostics on failure).
    pub stderr_path: PathBuf,
    /// Kill the child after this long.
    pub timeout: Duration,
    /// A console line marker whose first appearance is timestamped.
    pub marker: Option<String>,
    /// Kill the child (SIGKILL) as soon as the marker is seen (a VM that never exits by
    /// itself, e.g. an agent waiting for work).
    pub kill_after_marker: bool,
    /// Readiness is this path appearing (polled every 200 us, e.g. a control socket) when
    /// there is no console marker to wait for; reported as the marker time.
    pub ready_path: Option<PathBuf>,
    /// The signal `kill_after_marker` sends: SIGKILL, or SIGTERM for a clean stop (a VMM
    /// then still writes its metrics).
    pub stop_signal: libc::c_int,
    /// How long to wait after the marker before that signal.
    pub stop_delay: Duration,
    /// SIGKILL the child should the harness die (PR_SET_PDEATHSIG). Makes the spawn a
    /// plain fork instead of posix_spawn, so timings include a fork of the harness.
    pub die_with_parent: bool,
}

/// Timestamps are offsets from the instant just before `spawn()`.
#[derive(Debug, Clone)]
pub struct RunResult {
    /// CLOCK_REALTIME ns just before spawn (to align with timestamps the VMM reports).
    pub spawn_realtime_ns: u64,
    pub first_byte: Option<Duration>,
    pub marker: Option<Duration>,
    pub exit: Option<Duration>,
    pub status: Option<ExitStatus>,
    pub timed_out: bool,
    pub killed_after_marker: bool,
    pub output: Vec<u8>,
    /// When each console line started arriving, for diagnostics.
    pub timeline: Vec<(Duration, String)>,
}

impl RunResult {
    pub fn output_tail(&self, max: usize) -> String {
        let s = String::from_utf8_lossy(&self.output);
        let start = s.len().saturating_sub(max);
        let start = (start..s.len())
            .find(|&i| s.is_char_boundary(i))
            .unwrap_or(s.len());
        s[start..].to_string()
    }
}

/// CLOCK_REALTIME in ns since the epoch (the clock `dsec-vmm` reports in).
pub fn realtime_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

enum Event {
    Marker(Instant),
    Exited(Instant),
    WaitFailed(std::io::Error),
}

struct ReaderOut {
    first_byte: Option<Instant>,
    marker: Option<Instant>,
    output: Vec<u8>,
    /// (when, output length before this read) for every read.
    chunks: Vec<(Instant, usize)>,
}

fn reader_thread(
    mut pipe: std::io::PipeReader,
    marker: Option<String>,
    tx: mpsc::Sender<Event>,
) -> ReaderOut {
    let mut out = ReaderOut {
        first_byte: None,
        marker: None,
        output: Vec::with_capacity(4096),
        chunks: Vec::new(),
    };
    let mut buf = [0u8; 4096];
    let mut marker_seen = false;
    loop {
        match pipe.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                let now = Instant::now();
                if out.first_byte.is_none() {
                    out.first_byte = Some(now);
                }
                let scan_from = out
                    .output
                    .len()
                    .saturating_sub(marker.as_ref().map_or(0, |m| m.len()));
                out.chunks.push((now, out.output.len()));
                out.output.extend_from_slice(&buf[..n]);
                if let (false, Some(m)) = (marker_seen, &marker) {
                    if find(&out.output[scan_from..], m.as_bytes()) {
                        marker_seen = true;
                        out.marker = Some(now);
                        let _ = tx.send(Event::Marker(now));
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        }
    }
    out
}

/// Splits the output into lines, each stamped with the read that brought its first byte.
fn timeline(output: &[u8], chunks: &[(Instant, usize)], t0: Instant) -> Vec<(Duration, String)> {
    let mut lines = Vec::new();
    let mut start = 0;
    while start < output.len() {
        let end = output[start..]
            .iter()
            .position(|&b| b == b'\n')
            .map_or(output.len(), |i| start + i + 1);
        let k = chunks.partition_point(|&(_, off)| off <= start);
        let when = chunks
            .get(k.wrapping_sub(1))
            .map_or(Duration::ZERO, |&(t, _)| t.saturating_duration_since(t0));
        let text = String::from_utf8_lossy(&output[start..end]);
        lines.push((when, text.trim_end().to_string()));
        start = end;
    }
    lines
}

fn find(hay: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && hay.windows(needle.len()).any(|w| w == needle)
}

/// Blocks until `pid` has exited, without reaping it.
fn wait_exited_nowait(pid: libc::pid_t) -> std::io::Result<()> {
    loop {
        // SAFETY: siginfo_t is plain data; zeroed is a valid value for waitid to fill.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: waitid with WNOWAIT only inspects our own child `pid` and writes `info`.
        let r = unsafe {
            libc::waitid(
                libc::P_PID,
                pid as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOWAIT,
            )
        };
        if r == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Spawns the child, timestamps first console byte, marker and exit; kills it on timeout.
pub fn run(spec: &RunSpec) -> std::io::Result<RunResult> {
    let (pipe_r, pipe_w) = std::io::pipe()?;
    let stderr = File::create(&spec.stderr_path)?;
    let (tx, rx) = mpsc::channel::<Event>();
    let reader = {
        let tx = tx.clone();
        let marker = spec.marker.clone();
        thread::Builder::new()
            .name("console-reader".into())
            .spawn(move || reader_thread(pipe_r, marker, tx))?
    };
    let mut cmd = Command::new(&spec.program);
    cmd.args(&spec.args)
        .stdin(Stdio::null())
        .stdout(Stdio::from(pipe_w))
        .stderr(Stdio::from(stderr));
    if spec.die_with_parent {
        use std::os::unix::process::CommandExt;
        // SAFETY: prctl is async-signal-safe and only changes the child between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }

    let spawn_realtime_ns = realtime_ns();
    let t0 = Instant::now();
    let spawned = cmd.spawn();
    // Close our copy of the pipe's write end so the reader sees EOF when the child is gone.
    drop(cmd);
    let mut child = match spawned {
        Ok(c) => c,
        Err(e) => {
            let _ = reader.join();
            return Err(e);
        }
    };
    let pid = child.id() as libc::pid_t;
    {
        let tx = tx.clone();
        thread::Builder::new()
            .name("exit-waiter".into())
            .spawn(move || {
                let ev = match wait_exited_nowait(pid) {
                    Ok(()) => Event::Exited(Instant::now()),
                    Err(e) => Event::WaitFailed(e),
                };
                let _ = tx.send(ev);
            })?;
    }
    let ready_done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    if let Some(path) = spec.ready_path.clone() {
        let (tx, done) = (tx.clone(), ready_done.clone());
        thread::Builder::new()
            .name("ready-poller".into())
            .spawn(move || {
                while !done.load(std::sync::atomic::Ordering::Relaxed) {
                    if path.exists() {
                        let _ = tx.send(Event::Marker(Instant::now()));
                        return;
                    }
                    thread::sleep(Duration::from_micros(200));
                }
            })?;
    }
    drop(tx);

    let deadline = t0 + spec.timeout;
    let mut marker_at = None;
    let mut exit_at = None;
    let mut timed_out = false;
    let mut killed_after_marker = false;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(Event::Marker(t)) => {
                marker_at = Some(t);
                if spec.kill_after_marker && !killed_after_marker {
                    killed_after_marker = true;
                    thread::sleep(spec.stop_delay);
                    // SAFETY: `pid` is our unreaped child (the waiter uses WNOWAIT).
                    unsafe { libc::kill(pid, spec.stop_signal) };
                }
            }
            Ok(Event::Exited(t)) => {
                exit_at = Some(t);
                break;
            }
            Ok(Event::WaitFailed(e)) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(e);
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if !timed_out {
                    timed_out = true;
                    let _ = child.kill();
                    // Still wait for the exit event (the kill makes it come promptly).
                    continue;
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
        if timed_out && Instant::now() > deadline + Duration::from_secs(10) {
            break;
        }
    }
    ready_done.store(true, std::sync::atomic::Ordering::Relaxed);
    let status = child.wait().ok();
    let out = reader.join().unwrap_or(ReaderOut {
        first_byte: None,
        marker: None,
        output: Vec::new(),
        chunks: Vec::new(),
    });
    // The exit can be reported before the reader's marker event: the reader's own record
    // of the marker is authoritative.
    let marker_at = marker_at.or(out.marker);
    let since = |t: Option<Instant>| t.map(|t| t.saturating_duration_since(t0));
    Ok(RunResult {
        spawn_realtime_ns,
        first_byte: since(out.first_byte),
        marker: since(marker_at),
        // A killed child's exit is the harness's doing, not the VMM's.
        exit: if timed_out || killed_after_marker {
            None
        } else {
            since(exit_at)
        },
        status,
        timed_out,
        killed_after_marker,
        timeline: timeline(&out.output, &out.chunks, t0),
        output: out.output,
    })
}

/// Reads a small text file, for diagnostics.
pub fn read_tail(path: &Path, max: usize) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let start = s.len().saturating_sub(max);
    let start = (start..s.len())
        .find(|&i| s.is_char_boundary(i))
        .unwrap_or(s.len());
    s[start..].trim().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

    /// A spec whose stderr file is removed when the test is done with it.
    struct Spec(RunSpec);

    impl std::ops::Deref for Spec {
        type Target = RunSpec;
        fn deref(&self) -> &RunSpec {
            &self.0
        }
    }

    impl std::ops::DerefMut for Spec {
        fn deref_mut(&mut self) -> &mut RunSpec {
            &mut self.0
        }
    }

    impl Drop for Spec {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0.stderr_path);
        }
    }

    fn spec(script: &str, marker: Option<&str>, kill: bool, timeout_ms: u64) -> Spec {
        Spec(RunSpec {
            program: "/bin/sh".into(),
            args: vec!["-c".into(), script.into()],
            stderr_path: std::env::temp_dir().join(format!(
                "dsec-perf-test-{}-{}.err",
                std::process::id(),
                NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            )),
            timeout: Duration::from_millis(timeout_ms),
            marker: marker.map(str::to_string),
            kill_after_marker: kill,
            ready_path: None,
            stop_signal: libc::SIGKILL,
            stop_delay: Duration::ZERO,
            die_with_parent: false,
        })
    }

    #[test]
    fn timestamps_are_ordered() {
        let r = run(&spec(
            "sleep 0.05; echo hello; echo READY; sleep 0.05",
            Some("READY"),
            false,
            5000,
        ))
        .unwrap();
        let (fb, m, ex) = (r.first_byte.unwrap(), r.marker.unwrap(), r.exit.unwrap());
        assert!(fb >= Duration::from_millis(40), "{fb:?}");
        assert!(fb <= m && m <= ex, "{fb:?} {m:?} {ex:?}");
        assert!(ex >= Duration::from_millis(90));
        assert!(r.status.unwrap().success());
        assert_eq!(String::from_utf8_lossy(&r.output), "hello\nREADY\n");
        assert_eq!(r.timeline.len(), 2);
        assert_eq!(r.timeline[1].1, "READY");
        assert!(r.timeline[0].0 >= Duration::from_millis(40));
    }

    #[test]
    fn marker_right_before_exit_is_kept() {
        for _ in 0..20 {
            let r = run(&spec("echo DONE", Some("DONE"), false, 5000)).unwrap();
            assert!(r.marker.is_some() && r.exit.is_some());
        }
    }

    #[test]
    fn kill_after_marker_stops_child() {
        let t = Instant::now();
        let r = run(&spec(
            "echo READY; exec sleep 30",
            Some("READY"),
            true,
            20_000,
        ))
        .unwrap();
        assert!(t.elapsed() < Duration::from_secs(5));
        assert!(r.killed_after_marker && r.marker.is_some() && r.exit.is_none());
    }

    #[test]
    fn ready_path_then_sigterm() {
        let dir = std::env::temp_dir().join(format!("dsec-perf-ready-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let flag = dir.join("up");
        let mut s = spec(
            &format!(
                "trap 'echo TERM; exit 7' TERM; sleep 0.05; touch {}; while :; do sleep 0.01; done",
                flag.display()
            ),
            None,
            true,
            10_000,
        );
        s.ready_path = Some(flag);
        s.stop_signal = libc::SIGTERM;
        s.stop_delay = Duration::from_millis(20);
        s.die_with_parent = true;
        let r = run(&s).unwrap();
        assert!(
            r.marker.unwrap() >= Duration::from_millis(40),
            "{:?}",
            r.marker
        );
        assert!(r.killed_after_marker && !r.timed_out);
        assert_eq!(r.status.unwrap().code(), Some(7), "trap ran: clean stop");
        assert_eq!(String::from_utf8_lossy(&r.output), "TERM\n");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn timeout_kills_child() {
        let r = run(&spec("exec sleep 30", None, false, 200)).unwrap();
        assert!(r.timed_out && r.exit.is_none() && r.first_byte.is_none());
    }

    #[test]
    fn marker_split_across_reads_is_found() {
        let r = run(&spec(
            "printf 'xxRE'; sleep 0.05; printf 'ADYyy\\n'",
            Some("READY"),
            false,
            5000,
        ))
        .unwrap();
        assert!(r.marker.unwrap() >= Duration::from_millis(40));
    }
}
