//! Protobuf/gRPC definitions of DSec: the public node API (`dsec.v1`, served by the edge
//! daemon, spoken by SDKs and the CLI) and the runtime API (`dsec.agent.v1`) served by the
//! in-sandbox agent. Generated from `proto/dsec.proto` and `proto/agent.proto`.

/// The agent runtime API, version 1.
pub mod agent {
    /// Package `dsec.agent.v1`.
    #[allow(clippy::all, missing_docs)]
    pub mod v1 {
        tonic::include_proto!("dsec.agent.v1");
    }
}

/// The public node API, version 1 (package `dsec.v1`).
#[allow(clippy::all, missing_docs)]
pub mod v1 {
    tonic::include_proto!("dsec.v1");
}

/// Re-encodes a message as another message type with the same wire layout (the public API
/// mirrors several agent messages field for field, e.g. `CommandResult`, `FileInfo`).
pub fn transcode<A: prost::Message, B: prost::Message + Default>(a: &A) -> B {
    B::decode(a.encode_to_vec().as_slice()).unwrap_or_default()
}

/// AF_VSOCK port the agent listens on inside a VM.
pub const AGENT_VSOCK_PORT: u32 = 1024;
