//! The daemon's calls on a sandbox VMM's control socket: the typed contract's client
//! (`dsec_vmm_api`), run off the async threads with the daemon's timeout.

use std::time::Duration;

use dsec_vmm_api::control::{Done, SnapshotReply};
use dsec_vmm_api::{ControlClient, Request};
use serde::de::DeserializeOwned;

use super::error::NodeError;
use super::record::Record;
use crate::error::EdgeError;
use crate::microvm::control_call;

/// How long the VMM may take to answer (a snapshot of a large guest takes a while).
const CONTROL_TIMEOUT: Duration = Duration::from_secs(60);

async fn call<T: DeserializeOwned + Send + 'static>(
    record: &Record,
    request: Request,
) -> Result<T, NodeError> {
    let socket = record
        .handle
        .api_socket
        .clone()
        .ok_or(NodeError::FailedPrecondition(
            "this sandbox's VMM has no control socket (a record of a VMM started without \
             --api-sock): recreate the sandbox"
                .into(),
        ))?;
    let client = ControlClient::new(socket).reply_timeout(CONTROL_TIMEOUT);
    control_call(client, request).await.map_err(|e| match e {
        EdgeError::Vmm(e) => NodeError::Vmm(e),
        other => NodeError::Edge(other),
    })
}

pub async fn pause(record: &Record) -> Result<(), NodeError> {
    call::<Done>(record, Request::Pause).await.map(drop)
}

pub async fn resume(record: &Record) -> Result<(), NodeError> {
    call::<Done>(record, Request::Resume).await.map(drop)
}

/// Writes a snapshot into the new directory `path` (a running VM is paused meanwhile).
pub async fn snapshot(
    record: &Record,
    path: std::path::PathBuf,
    diff: bool,
) -> Result<SnapshotReply, NodeError> {
    call(
        record,
        Request::Snapshot {
            path,
            diff,
            base: None,
        },
    )
    .await
}

/// Writes only the pages that differ from the full snapshot the VM was restored from into
/// the new directory `path`, naming `base` (relative to `path`) as where that snapshot is.
pub async fn snapshot_over_base(
    record: &Record,
    path: std::path::PathBuf,
    base: std::path::PathBuf,
) -> Result<SnapshotReply, NodeError> {
    call(
        record,
        Request::Snapshot {
            path,
            diff: false,
            base: Some(base),
        },
    )
    .await
}
