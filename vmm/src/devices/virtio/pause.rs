//! The pause handshake between the VMM and a device thread: the VMM asks, the thread parks
//! at a point where it touches no guest memory and publishes its live queue positions (for
//! the snapshot), then waits until it is resumed.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use virtio_queue::{Queue, QueueState};
use vmm_sys_util::eventfd::EventFd;

use crate::sync::lock;

/// How long a device thread may take to park.
pub const PAUSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a device could not be paused.
#[derive(Debug, thiserror::Error)]
pub enum PauseError {
    #[error("cannot wake the {device} device thread to pause it: {source}")]
    Wake {
        device: &'static str,
        source: std::io::Error,
    },
    #[error("the {device} device thread did not pause within {PAUSE_TIMEOUT:?}; it may be stuck on host I/O, retry or stop the VM")]
    Timeout { device: &'static str },
}

#[derive(Default)]
struct PauseState {
    requested: bool,
    parked: bool,
    queues: Vec<QueueState>,
}

/// One device thread's side of the handshake, shared with the VMM.
pub struct PauseHandshake {
    device: &'static str,
    state: Mutex<PauseState>,
    changed: Condvar,
    /// Wakes the device thread's event loop (register [`PauseHandshake::event_fd`]).
    wake: EventFd,
}

impl PauseHandshake {
    pub fn new(device: &'static str) -> std::io::Result<Self> {
        Ok(PauseHandshake {
            device,
            state: Mutex::new(PauseState::default()),
            changed: Condvar::new(),
            wake: EventFd::new(libc::EFD_NONBLOCK)?,
        })
    }

    /// VMM side: asks the thread to park and waits until it has.
    pub fn pause(&self) -> Result<(), PauseError> {
        self.request()?;
        self.wait_parked()
    }

    /// VMM side: asks the thread to park without waiting (several devices park at once).
    pub fn request(&self) -> Result<(), PauseError> {
        lock(&self.state).requested = true;
        self.wake.write(1).map_err(|source| PauseError::Wake {
            device: self.device,
            source,
        })?;
        Ok(())
    }

    /// VMM side: waits until the thread asked by [`PauseHandshake::request`] has parked.
    pub fn wait_parked(&self) -> Result<(), PauseError> {
        let guard = lock(&self.state);
        let (guard, _) = self
            .changed
            .wait_timeout_while(guard, PAUSE_TIMEOUT, |s| !s.parked)
            .unwrap_or_else(|e| e.into_inner());
        if guard.parked {
            Ok(())
        } else {
            Err(PauseError::Timeout {
                device: self.device,
            })
        }
    }

    /// VMM side: lets a parked thread go on (harmless if it is not parked).
    pub fn resume(&self) {
        lock(&self.state).requested = false;
        self.changed.notify_all();
    }

    /// Queue positions the parked thread published.
    pub fn queue_states(&self) -> Vec<QueueState> {
        lock(&self.state).queues.clone()
    }

    /// Device side: the descriptor to wait on for pause requests.
    pub fn event_fd(&self) -> RawFd {
        self.wake.as_raw_fd()
    }

    /// Device side, when [`PauseHandshake::event_fd`] is readable: parks until resumed if a
    /// pause is still wanted, publishing the positions of `queues` first.
    pub fn park<'a>(&self, queues: impl IntoIterator<Item = &'a Queue>) {
        let _ = self.wake.read();
        let mut state = lock(&self.state);
        if !state.requested {
            return;
        }
        state.queues = queues.into_iter().map(|q| q.state()).collect();
        state.parked = true;
        self.changed.notify_all();
        while state.requested {
            state = self.changed.wait(state).unwrap_or_else(|e| e.into_inner());
        }
        state.parked = false;
    }
}
