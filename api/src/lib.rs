//! Protobuf/gRPC definitions of DSec: the public node API (`dsec.v1`, served by the edge
//! daemon, spoken by SDKs and the CLI) and the runtime API (`dsec.agent.v1`) served by the
//! in-sandbox agent. Generated from `proto/dsec.proto`, `proto/agent.proto` and
//! `proto/common.proto`, which holds the messages both share (in package `dsec.v1`); the
//! apiserver's admin services (`proto/admin.proto`, also `dsec.v1`) and its node-facing API
//! (`proto/node.proto`, `dsec.node.v1`); and the cluster's sandbox id format
//! ([`sandbox_id`]), which the node daemon and the control plane share.

/// The agent runtime API, version 1.
pub mod agent {
    /// Package `dsec.agent.v1`, plus the messages it shares with the public API (defined once
    /// in `common.proto`, package `dsec.v1`), so agent code names them here as well.
    #[allow(clippy::all, missing_docs)]
    pub mod v1 {
        tonic::include_proto!("dsec.agent.v1");
        pub use crate::v1::{
            exec_response, port_response, CloseSessionResponse, CommandResult, ExecResponse,
            ExecStarted, ExitStatus, FileChunk, FileInfo, FileType, ListDirResponse,
            ListSessionsResponse, MkdirResponse, PortConnected, PortEof, PortResponse, PtyConfig,
            RemoveResponse, RenameResponse, SessionInfo, StdinEof, WindowSize, WriteFileResponse,
        };
    }
}

/// The public node API, version 1 (package `dsec.v1`), including the messages it shares with
/// the agent API.
#[allow(clippy::all, missing_docs)]
pub mod v1 {
    tonic::include_proto!("dsec.v1");
}

/// The node-facing API of the apiserver (`dsec.node.v1`): register, heartbeat, leave.
pub mod node {
    #[allow(clippy::all, missing_docs)]
    pub mod v1 {
        tonic::include_proto!("dsec.node.v1");
    }
}

pub mod create_many;
pub mod sandbox_id;
#[cfg(feature = "tls")]
pub mod tls;

/// The label under which a node keeps the project a sandbox of the apiserver belongs to (set
/// by the apiserver on Create; a node's own clients cannot reach the apiserver's projects).
pub const PROJECT_LABEL: &str = "dsec.io/project";

/// AF_VSOCK port the agent listens on inside a VM.
pub const AGENT_VSOCK_PORT: u32 = 1024;
