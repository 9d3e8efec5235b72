//! Protobuf/gRPC definitions of the DSec runtime API (`dsec.agent.v1`), served by the
//! in-sandbox agent and used by the edge. Generated from `proto/agent.proto`.

/// The agent runtime API, version 1.
pub mod agent {
    /// Package `dsec.agent.v1`.
    #[allow(clippy::all, missing_docs)]
    pub mod v1 {
        tonic::include_proto!("dsec.agent.v1");
    }
}

/// AF_VSOCK port the agent listens on inside a VM.
pub const AGENT_VSOCK_PORT: u32 = 1024;
