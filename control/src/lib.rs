//! The DSec control plane: the store it keeps its state in, identity and access, nested
//! quotas, placement and the node watcher. See README.md for the layout.

pub mod api;
pub mod command;
pub mod iam;
pub mod keys;
pub mod pki;
pub mod placement;
pub mod quota;
pub mod resources;
pub mod revocation;
pub mod sim;
pub use dsec_api::sandbox_id;
pub mod store;
pub mod watcher;

#[cfg(test)]
mod testing;

use store::StoreError;

/// Wall-clock milliseconds since the Unix epoch (token expiry, audit times, heartbeats).
pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The gRPC status code a store failure is answered with.
pub(crate) fn store_code(e: &StoreError) -> tonic::Code {
    match e {
        StoreError::Unavailable(_) => tonic::Code::Unavailable,
        StoreError::BadTtl(_) => tonic::Code::InvalidArgument,
        _ => tonic::Code::Internal,
    }
}
