//! virtio-rng's snapshot state: nothing beyond the transport's (entropy is never saved, so
//! a restored guest draws fresh bytes from the host).

use serde::{Deserialize, Serialize};

use super::Rng;
use crate::persist::Persist;

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RngState {}

/// Restoring an rng cannot fail.
#[derive(Debug, thiserror::Error)]
#[error("unreachable: restoring virtio-rng cannot fail")]
pub enum RngRestoreError {}

impl Persist for Rng {
    type State = RngState;
    type Context = ();
    type Error = RngRestoreError;

    fn save(&self) -> RngState {
        RngState {}
    }

    fn restore((): (), _: &RngState) -> Result<Self, RngRestoreError> {
        Ok(Rng::new())
    }
}
