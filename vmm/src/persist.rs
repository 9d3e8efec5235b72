//! The one way state goes into a snapshot: every device (and the vCPU state) implements
//! [`Persist`] next to itself, in its folder's `persist.rs`; `snapshot::state` only
//! aggregates the typed states.

use serde::de::DeserializeOwned;
use serde::Serialize;

/// Something whose state goes into a snapshot.
pub trait Persist: Sized {
    type State: Serialize + DeserializeOwned;
    /// What restoring needs besides the state (memory, interrupt lines, sinks...).
    type Context;
    type Error: std::error::Error + Send + Sync + 'static;
    fn save(&self) -> Self::State;
    fn restore(context: Self::Context, state: &Self::State) -> Result<Self, Self::Error>;
}
