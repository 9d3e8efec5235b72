//! vsock's snapshot state. Host connections do not survive a snapshot (the guest is told
//! with a transport reset when the device comes back), and the CID and socket path are the
//! VM's host identity, taken from the (possibly overridden) config on restore.

use serde::{Deserialize, Serialize};

use super::Vsock;
use crate::persist::Persist;

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VsockState {
    /// The CID the guest had when the snapshot was taken (a fork gets its own).
    pub guest_cid: u64,
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
        }
    }

    /// The transport tells the device it comes back from a snapshot (`prepare_restore`)
    /// when the guest had it running; nothing else to bring back.
    fn restore(device: Vsock, _: &VsockState) -> Result<Self, VsockRestoreError> {
        Ok(device)
    }
}
