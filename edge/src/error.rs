//! Errors of the edge library.

use std::path::PathBuf;
use std::time::Duration;

/// Everything that can go wrong creating, driving or destroying a sandbox.
#[derive(Debug, thiserror::Error)]
pub enum EdgeError {
    #[error("{what} not found at {path}: {hint}")]
    MissingArtifact {
        what: &'static str,
        path: PathBuf,
        hint: &'static str,
    },
    #[error("{what} binary `{name}` not found next to this executable, in $DSEC_HOME/bin or in PATH: {hint}")]
    MissingBinary {
        what: &'static str,
        name: &'static str,
        hint: &'static str,
    },
    #[error("image {name:?} is not installed for the {backend} backend ({path} missing): {hint}")]
    MissingImage {
        name: String,
        backend: &'static str,
        path: PathBuf,
        hint: &'static str,
    },
    #[error("cannot format the sandbox's writable disk {path} with mkfs.ext4: {detail} (mkfs.ext4 comes with e2fsprogs)")]
    FormatDisk { path: PathBuf, detail: String },
    #[error("sandbox network: {0}")]
    Network(#[from] crate::net::NetError),
    #[error("invalid sandbox request: {0}")]
    InvalidSpec(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the agent of sandbox {id} did not become ready within {timeout:?}{detail}")]
    AgentNotReady {
        id: String,
        timeout: Duration,
        detail: String,
    },
    #[error("sandbox {id} died while starting{detail}")]
    SandboxDied { id: String, detail: String },
    #[error("cannot connect to the agent: {0}")]
    Connect(String),
    #[error("{op}: {message} (agent status: {code:?})")]
    Agent {
        op: &'static str,
        code: tonic::Code,
        message: String,
    },
    #[error("{0}")]
    Protocol(String),
    #[error(transparent)]
    Vmm(#[from] dsec_vmm_api::ControlError),
    #[error("backend `{backend}` cannot run here: {reason}")]
    BackendUnavailable {
        backend: &'static str,
        reason: String,
    },
}

impl EdgeError {
    pub(crate) fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        Self::Io {
            what: what.into(),
            source,
        }
    }

    pub(crate) fn agent(op: &'static str, status: tonic::Status) -> Self {
        Self::Agent {
            op,
            code: status.code(),
            message: status.message().to_string(),
        }
    }

    /// The gRPC code when the agent refused the request.
    pub fn agent_code(&self) -> Option<tonic::Code> {
        match self {
            Self::Agent { code, .. } => Some(*code),
            _ => None,
        }
    }
}

pub type Result<T, E = EdgeError> = std::result::Result<T, E>;
