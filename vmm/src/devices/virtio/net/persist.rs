//! virtio-net's snapshot state. The tap and the MAC are host identity, not guest state: a
//! restore takes them from its (possibly overridden) config, so a fork gets its own link.

use serde::{Deserialize, Serialize};

use super::Net;
use crate::persist::Persist;

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetState {
    /// The MAC the guest saw when the snapshot was taken (for diagnostics; a fork's own
    /// MAC replaces it and the agent tells the guest).
    pub mac: [u8; 6],
}

/// Restoring a network device cannot fail once its tap is open.
#[derive(Debug, thiserror::Error)]
#[error("unreachable: restoring virtio-net cannot fail")]
pub enum NetRestoreError {}

impl Persist for Net {
    type State = NetState;
    /// The opened tap and the MAC to give the guest.
    type Context = (std::fs::File, [u8; 6]);
    type Error = NetRestoreError;

    fn save(&self) -> NetState {
        NetState { mac: self.mac }
    }

    fn restore((tap, mac): Self::Context, _: &NetState) -> Result<Self, NetRestoreError> {
        Ok(Net::new(tap, mac))
    }
}
