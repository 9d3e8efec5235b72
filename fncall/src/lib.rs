//! FnCall: one-shot code execution (python, bash, C++, node) from pools of warm workers,
//! each call isolated from the last. See README.md.

pub mod cgroup;
pub mod container;
pub mod engine;
pub mod error;
pub mod filter;
pub mod grpc;
pub mod network;
pub mod request;
pub mod sandboxfusion;
pub mod vm;
pub mod worker;

// The call init (a program of its own, see build.rs) compiled here too: its unit tests run
// against the engine's side of the request format, and lints see it.
#[cfg(test)]
#[allow(dead_code)]
#[path = "../init/call_init.rs"]
mod call_init;

pub use container::{CallLimits, ContainerFactory};
pub use engine::{Engine, EngineConfig};
pub use error::{FnCallError, Result};
pub use network::{CallLink, CallNetwork, NetworkRules};
pub use request::{CallRequest, CallResult, Language, StageResult, StageStatus};
pub use worker::{Outcome, PoolKey, Worker, WorkerFactory};
