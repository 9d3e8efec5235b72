//! What can go wrong with a call, worded for the caller.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum FnCallError {
    #[error("unknown language {0:?}: use one of python, bash, cpp, node")]
    UnknownLanguage(String),
    #[error("invalid call: {0}")]
    InvalidRequest(String),
    #[error("FnCall image {image:?} not found at {path}: build it with `images/{image}/build.sh --install` (setup.sh does)")]
    MissingImage { image: String, path: PathBuf },
    #[error("cannot start a {language} worker: {detail}")]
    WorkerStart {
        language: &'static str,
        detail: String,
    },
    #[error("the worker running the call failed ({0}); it was replaced, retry the call")]
    WorkerLost(String),
    #[error("this node has no sandbox network for calls: calls with `network` set are refused (never run in the host's network namespace); drop `network` or use a sandbox (`dsec run`) on a node started with --net-bridge")]
    NoCallNetwork,
    #[error("this node cannot run VM workers ({0}); use a container image (the default `fncall`) or a node with hardware KVM")]
    NoVmSupport(String),
    #[error("cannot put a FnCall worker on the node's sandbox network ({0}); the call was not run: retry it, and check the node's log and `nft list table inet BRIDGE` if it keeps failing")]
    CallNetwork(String),
    #[error("no {0} worker became free in time: the node is overloaded, retry later")]
    Busy(&'static str),
}

pub type Result<T> = std::result::Result<T, FnCallError>;
