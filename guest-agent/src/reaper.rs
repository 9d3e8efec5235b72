//! Child reaping that works for PID 1.
//!
//! As PID 1 (or a subreaper) the agent inherits orphans and must reap them, but a blanket
//! `waitpid(-1)` would steal the exit status of commands that Exec is waiting for. So every
//! child Exec starts is registered here (under the same lock the reaper holds while reaping,
//! so a fast exit cannot slip between spawn and registration); the reaper hands those statuses
//! to their waiters and discards the rest.

use std::collections::HashMap;
use std::io;
use std::process::Command;
use std::sync::{Arc, Mutex};

use nix::errno::Errno;
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::oneshot;

/// Reaps all children on SIGCHLD and delivers statuses of registered ones.
#[derive(Default)]
pub struct Reaper {
    waiters: Mutex<HashMap<i32, oneshot::Sender<WaitStatus>>>,
}

impl Reaper {
    /// Starts the SIGCHLD-driven reaper task. Must be called inside a tokio runtime.
    pub fn start() -> io::Result<Arc<Self>> {
        let reaper = Arc::new(Self::default());
        let mut sigchld = signal(SignalKind::child())?;
        let task_reaper = reaper.clone();
        tokio::spawn(async move {
            loop {
                task_reaper.reap_exited();
                if sigchld.recv().await.is_none() {
                    break;
                }
            }
        });
        Ok(reaper)
    }

    /// Spawns `command` and returns its pid and a receiver for its exit status.
    pub fn spawn(&self, command: &mut Command) -> io::Result<(Pid, oneshot::Receiver<WaitStatus>)> {
        let mut waiters = self.waiters.lock().unwrap_or_else(|e| e.into_inner());
        // std waits for the child itself only when exec fails; holding the lock keeps the
        // reaper from racing that wait.
        let child = command.spawn()?;
        let pid = Pid::from_raw(child.id() as i32);
        let (tx, rx) = oneshot::channel();
        waiters.insert(pid.as_raw(), tx);
        Ok((pid, rx))
    }

    fn reap_exited(&self) {
        let mut waiters = self.waiters.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            match waitpid(None::<Pid>, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) | Err(Errno::ECHILD) => break,
                Ok(status) => {
                    if let Some(pid) = status.pid() {
                        if let Some(waiter) = waiters.remove(&pid.as_raw()) {
                            let _ = waiter.send(status);
                        } else {
                            tracing::debug!(pid = pid.as_raw(), "reaped orphan");
                        }
                    }
                }
                Err(Errno::EINTR) => continue,
                Err(err) => {
                    tracing::warn!(%err, "waitpid failed");
                    break;
                }
            }
        }
    }
}
