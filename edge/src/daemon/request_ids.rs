//! Create idempotency: a Create repeating a request_id gets the sandbox the first made (or
//! waits for it, or gets its error); the same request_id with another spec is refused.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::error::NodeError;
use super::node::Node;
use super::record::Entry;

/// The outcome of a Create, as waiting retries see it: the sandbox id, or the error.
pub type CreateOutcome = Option<Result<String, Arc<NodeError>>>;

/// What the node knows about a Create request_id.
pub(super) enum RequestState {
    /// Being created; the receiver yields the outcome.
    InFlight {
        fingerprint: String,
        done: tokio::sync::watch::Receiver<CreateOutcome>,
    },
    /// Made this sandbox (which still exists).
    Done { fingerprint: String, id: String },
}

/// What a Create with a request_id has to do.
pub enum Claim {
    /// Nobody has this request_id: create, then report through the sender.
    Create(tokio::sync::watch::Sender<CreateOutcome>),
    /// An earlier attempt made this sandbox.
    Existing(Arc<Entry>),
    /// An earlier attempt is still running: wait for its outcome.
    Wait(tokio::sync::watch::Receiver<CreateOutcome>),
}

impl Node {
    pub(super) fn requests(&self) -> std::sync::MutexGuard<'_, HashMap<String, RequestState>> {
        self.requests.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Decides what a Create with `request_id` does: the sandbox an earlier attempt made, a
    /// wait for one in flight, or a new create. The same request_id with another spec is
    /// ALREADY_EXISTS.
    pub fn claim(&self, request_id: &str, fingerprint: &str) -> Result<Claim, NodeError> {
        let mismatch = |what: String| NodeError::RequestIdReused {
            request_id: request_id.to_string(),
            what,
        };
        let mut requests = self.requests();
        match requests.get(request_id) {
            // A create task that ended without reporting (it panicked): forget it.
            Some(RequestState::InFlight { done, .. }) if done.has_changed().is_err() => {
                requests.remove(request_id);
                self.claim_new(&mut requests, request_id, fingerprint)
            }
            Some(RequestState::InFlight {
                fingerprint: f,
                done,
            }) => {
                if f != fingerprint {
                    return Err(mismatch("still being created".to_string()));
                }
                Ok(Claim::Wait(done.clone()))
            }
            Some(RequestState::Done { fingerprint: f, id }) => {
                if let Some(entry) = self.lock().get(id).cloned() {
                    if f != fingerprint {
                        return Err(mismatch(format!("sandbox {id}")));
                    }
                    entry.claims.fetch_add(1, Ordering::Relaxed);
                    return Ok(Claim::Existing(entry));
                }
                // Deleted since: a retry creates afresh.
                requests.remove(request_id);
                self.claim_new(&mut requests, request_id, fingerprint)
            }
            None => self.claim_new(&mut requests, request_id, fingerprint),
        }
    }

    fn claim_new(
        &self,
        requests: &mut HashMap<String, RequestState>,
        request_id: &str,
        fingerprint: &str,
    ) -> Result<Claim, NodeError> {
        let (tx, rx) = tokio::sync::watch::channel(None);
        requests.insert(
            request_id.to_string(),
            RequestState::InFlight {
                fingerprint: fingerprint.to_string(),
                done: rx,
            },
        );
        Ok(Claim::Create(tx))
    }

    /// Records the outcome of a claimed Create and wakes the retries waiting for it. A failed
    /// attempt forgets the request_id (a retry may create afresh).
    pub fn finish_claim(
        &self,
        request_id: &str,
        fingerprint: &str,
        result: &Result<Arc<Entry>, Arc<NodeError>>,
        tx: tokio::sync::watch::Sender<CreateOutcome>,
    ) {
        let outcome = match result {
            Ok(entry) => {
                let id = entry.id();
                self.requests().insert(
                    request_id.to_string(),
                    RequestState::Done {
                        fingerprint: fingerprint.to_string(),
                        id: id.clone(),
                    },
                );
                Ok(id)
            }
            Err(err) => {
                self.requests().remove(request_id);
                Err(err.clone())
            }
        };
        let _ = tx.send(Some(outcome));
    }

    /// Forgets the request_id of deleted sandbox `id` (a retry then creates afresh).
    pub(super) fn forget_request(&self, request_id: &str, id: &str) {
        if request_id.is_empty() {
            return;
        }
        let mut requests = self.requests();
        if matches!(requests.get(request_id), Some(RequestState::Done { id: done, .. }) if done == id)
        {
            requests.remove(request_id);
        }
    }
}
