//! Networked calls: what the engine needs from the node's sandbox network. A networked worker's
//! namespace gets a link on the node's bridge when it starts (denying everything), each call's
//! policy is applied just before the call and taken back (deny all) after it, and the link is
//! released when the worker ends. The node daemon implements these traits over its
//! `net::Network` (edge/src/daemon/fncall.rs); an engine without one refuses networked calls.

use std::sync::Arc;

use crate::error::Result;

/// What a networked call may reach, as the caller wrote it: rules
/// (`[tcp:|udp:|icmp:]CIDR[:PORT[-PORT]]`) and names of the node's policies, as in a
/// sandbox's network policy. Empty: nothing.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NetworkRules {
    pub allow_internet: bool,
    pub allow: Vec<String>,
    pub deny: Vec<String>,
}

impl NetworkRules {
    /// Allows nothing (what a networked worker's link holds between calls).
    pub fn is_deny_all(&self) -> bool {
        !self.allow_internet && self.allow.is_empty()
    }
}

/// The node's sandbox network, as the engine's workers use it. Blocking calls.
pub trait CallNetwork: Send + Sync {
    /// Checks a call's rules (parse, named policies, bounds); the error says what is wrong.
    fn check(&self, rules: &NetworkRules) -> Result<()>;

    /// Puts the network namespace of process `pid` on the node's network, denying
    /// everything. The link is released when dropped.
    fn attach(&self, pid: u32) -> Result<Arc<dyn CallLink>>;

    /// The resolver networked workers' `/etc/resolv.conf` names (the node's DNS proxy, which
    /// answers a call the names its rules allow); None: the image's file.
    fn nameserver(&self) -> Option<std::net::Ipv4Addr> {
        None
    }
}

/// One worker's link on the node's network.
pub trait CallLink: Send + Sync {
    /// Replaces what the worker's namespace may reach (open connections it now denies are
    /// cut).
    fn apply(&self, rules: &NetworkRules) -> Result<()>;
}
