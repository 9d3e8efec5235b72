//! One replica's copy of what authorization reads (tokens, principals, projects, role
//! bindings), listed once and kept fresh by prefix watches, so that a call is authorized
//! without a store round trip.
//!
//! Freshness: a change reaches every replica's copy when its watch delivers it (tested:
//! a revoked token is refused on two replicas within [`REVOCATION_BOUND`]). A copy whose
//! watch failed stops answering (callers read the store) until it has listed again.
//! Only positive answers are trusted from the copy: a token, project or binding it lacks is
//! looked up in the store, so that what another replica just created works at once.

use std::sync::Arc;
use std::time::Duration;

use super::{Principal, Project, RoleBinding, TokenRecord};
use crate::keys;
use crate::store::{Mirror, Store};

/// Within this time of a revocation committing, every replica with a live watch refuses the
/// token (the watch's delivery time; the test checks it).
pub const REVOCATION_BOUND: Duration = Duration::from_millis(500);

/// The authorization records of one replica; dropping it stops its watches.
pub struct IamCache {
    tokens: Arc<Mirror<TokenRecord>>,
    principals: Arc<Mirror<Principal>>,
    projects: Arc<Mirror<Project>>,
    bindings: Arc<Mirror<RoleBinding>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl std::fmt::Debug for IamCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("IamCache")
    }
}

impl Drop for IamCache {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

impl IamCache {
    /// Starts following the store (on the current tokio runtime).
    pub fn start(store: Arc<dyn Store>) -> Arc<Self> {
        let tokens = Mirror::new(keys::TOKENS);
        let principals = Mirror::new(keys::PRINCIPALS);
        let projects = Mirror::new(keys::PROJECTS);
        let bindings = Mirror::new(keys::BINDINGS);
        let tasks = vec![
            tokio::spawn(tokens.clone().follow(store.clone())),
            tokio::spawn(principals.clone().follow(store.clone())),
            tokio::spawn(projects.clone().follow(store.clone())),
            tokio::spawn(bindings.clone().follow(store)),
        ];
        Arc::new(IamCache {
            tokens,
            principals,
            projects,
            bindings,
            tasks,
        })
    }

    pub(super) fn token(&self, key: &str) -> Option<TokenRecord> {
        self.tokens.get(key)
    }

    pub(super) fn principal(&self, key: &str) -> Option<Principal> {
        self.principals.get(key)
    }

    pub(super) fn has_project(&self, key: &str) -> bool {
        self.projects.get(key).is_some()
    }

    pub(super) fn bindings_under(&self, prefix: &str) -> Option<Vec<RoleBinding>> {
        self.bindings.under(prefix)
    }

    /// Whether every part of the copy is current (tests wait for it).
    pub fn is_current(&self) -> bool {
        self.tokens.is_current()
            && self.principals.is_current()
            && self.projects.is_current()
            && self.bindings.is_current()
    }
}

#[cfg(test)]
mod tests;
