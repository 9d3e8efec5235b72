//! vsock's snapshot state. Host connections do not survive a snapshot (the guest is told
//! with a transport reset when the device comes back), and the CID and socket path are the
//! VM's host identity, taken from the (possibly overridden) config on restore. The host port
//! counter does survive: new connections never reuse a port the guest may still hold.

use std::sync::atomic::Ordering;

use serde::{Deserialize, Serialize};

use super::muxer::FIRST_HOST_PORT;
use super::Vsock;
use crate::persist::Persist;

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VsockState {
    /// The CID the guest had when the snapshot was taken (a fork gets its own).
    pub guest_cid: u64,
    /// The host port the next host connection gets (0 in snapshots from before it was kept:
    /// then the first port).
    #[serde(default)]
    pub next_host_port: u32,
}

/// Restoring vsock cannot fail once its socket is bound.
#[derive(Debug, thiserror::Error)]
#[error("unreachable: restoring vsock cannot fail")]
pub enum VsockRestoreError {}

impl Persist for Vsock {
    type State = VsockState;
    /// The device built from the restored VM's config (its socket already bound).
    type Context = Vsock;
    type Error = VsockRestoreError;

    fn save(&self) -> VsockState {
        VsockState {
            guest_cid: self.guest_cid,
            next_host_port: self.next_host_port.load(Ordering::Relaxed),
        }
    }

    /// The transport tells the device it comes back from a snapshot (`prepare_restore`)
    /// when the guest had it running; the host port counter goes on from the snapshot's.
    fn restore(device: Vsock, state: &VsockState) -> Result<Self, VsockRestoreError> {
        device
            .next_host_port
            .store(state.next_host_port.max(FIRST_HOST_PORT), Ordering::Relaxed);
        Ok(device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scratch directory for the devices' host sockets, removed when dropped.
    struct Scratch(std::path::PathBuf);

    impl Scratch {
        fn new(test: &str) -> Self {
            let dir =
                std::env::temp_dir().join(format!("dsec-vsock-{test}-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            Scratch(dir)
        }

        fn path(&self) -> &std::path::Path {
            &self.0
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn vsock(dir: &std::path::Path, name: &str) -> Vsock {
        Vsock::new(3, dir.join(name)).expect("bind a vsock socket in a temporary directory")
    }

    /// A restored VM's guest may still hold the snapshot's (reset) connections: the restored
    /// device must not hand their host ports out again.
    #[test]
    fn the_host_port_counter_survives_a_snapshot() {
        let dir = Scratch::new("ports");
        let original = vsock(dir.path(), "a.sock");
        original
            .next_host_port
            .store(FIRST_HOST_PORT + 5, Ordering::Relaxed);
        let state = original.save();
        assert_eq!(state.next_host_port, FIRST_HOST_PORT + 5);
        let restored = Vsock::restore(vsock(dir.path(), "b.sock"), &state).unwrap();
        assert_eq!(
            restored.next_host_port.load(Ordering::Relaxed),
            FIRST_HOST_PORT + 5
        );
    }

    /// Snapshots from before the counter was kept start at the first port.
    #[test]
    fn an_older_state_without_the_counter_starts_at_the_first_port() {
        let dir = Scratch::new("old-state");
        let state: VsockState = serde_json::from_str(r#"{"guest_cid":7}"#).unwrap();
        assert_eq!(state.next_host_port, 0);
        let restored = Vsock::restore(vsock(dir.path(), "c.sock"), &state).unwrap();
        assert_eq!(
            restored.next_host_port.load(Ordering::Relaxed),
            FIRST_HOST_PORT
        );
    }
}
