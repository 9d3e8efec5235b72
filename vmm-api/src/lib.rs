//! The contract between DSec's node and its VMM processes.
//!
//! - [`config`]: a VM's configuration ([`VmConfig`] and its devices) and its validation.
//! - [`launch`]: how a `dsec-vmm` process is started ([`VmmLaunch`]), rendered to argv and
//!   parsed back by the VMM itself.
//! - [`control`]: the control socket's typed requests and replies, and [`ControlClient`], a
//!   blocking client for it.
//!
//! Light on purpose (serde, clap, thiserror): the edge, the CLI and the benchmarks depend on
//! it without pulling in KVM.

pub mod client;
pub mod config;
pub mod control;
pub mod launch;

pub use client::{ControlClient, ControlError};
pub use config::{
    BalloonConfig, ConfigError, DriveConfig, NetConfig, PmemConfig, SerialOutput, VmConfig,
    VsockConfig,
};
pub use control::{Request, RestoreRequest};

/// A snapshot directory's guest memory file (beside its `state`).
pub const SNAPSHOT_MEMORY_FILE: &str = "memory";
/// A snapshot directory's state file (vCPUs, devices, memory layout, parent).
pub const SNAPSHOT_STATE_FILE: &str = "state";
pub use launch::{
    BootOverrides, Exposure, JailLaunch, LaunchError, LaunchMode, LazyLaunch, PrewarmLaunch,
    RestoreLaunch, SnapshotOverrides, VmmLaunch,
};
