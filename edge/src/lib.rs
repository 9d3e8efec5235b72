//! dsec-edge: sandbox lifecycle on one node. Backends (container, microVM), the agent
//! client, KVM detection and artifact lookup, and the node daemon (`daemon`).

pub mod backend;
mod cgroup_join;
pub mod client;
pub mod daemon;
pub mod error;
pub mod idpool;
pub mod images;
pub mod kvm;
pub mod microvm;
pub mod net;
pub mod paths;

pub use backend::{parse_env, BackendKind, EdgeConfig, Sandbox, SandboxSpec};
pub use client::{
    AgentAddr, AgentClient, CollectedExec, ExecOutcome, ExecSpec, GuestIdentity, GuestIpv4,
    Refreshed,
};
pub use error::{EdgeError, Result};
pub use kvm::KvmStatus;
pub use microvm::{MicroVm, MicroVmDir, SpawnOptions, StartingMicroVm};
pub use paths::{find_binary, Artifacts, ImagePaths};
