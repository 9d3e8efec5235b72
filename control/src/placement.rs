//! Placement: which node gets a new sandbox.
//!
//! [`NodeRegistry`] keeps the nodes' own records in the store (each attached to the node's
//! lease, so a node that stops heartbeating disappears) and the operators' cordon / drain
//! flags beside them (which outlive the lease). [`Placer`] is one apiserver's in-memory view
//! of them: it filters (not cordoned or draining, backend, labels, free capacity), prefers
//! nodes that already hold the image unless they are all busy, picks the least loaded of
//! `k` random candidates (power of k choices), and counts its own in-flight and
//! recently accepted creates on top of the last heartbeat so that a burst spreads out
//! instead of landing on the node that looked emptiest. A node that refuses (its own
//! admission is final) is left out and the next choice is tried.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::keys;
use crate::now_ms;
use crate::resources::Resources;
use crate::sandbox_id::valid_node_name;
use crate::store::{from_json, to_json, LeaseId, Store, StoreError};

/// Candidates drawn per placement.
pub const DEFAULT_CHOICES: usize = 2;
/// Image holders are preferred while at least one of them is below this load.
const IMAGE_PREFERENCE_MAX_LOAD: f64 = 0.8;
/// An accepted create stops counting once a heartbeat newer than it arrives, or after this.
const RECENT_CREATE_TTL: Duration = Duration::from_secs(30);

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Backend {
    Container,
    Microvm,
    Fullvm,
    Fncall,
}

/// What a node says about itself when it registers and on every heartbeat.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRecord {
    pub name: String,
    /// Where the apiserver reaches the node's API (`host:port`).
    pub address: String,
    pub capacity: Resources,
    /// What the node's admission has handed out, as of `heartbeat_ms`.
    pub allocated: Resources,
    pub backends: BTreeSet<Backend>,
    pub images: BTreeSet<String>,
    pub labels: BTreeMap<String, String>,
    pub heartbeat_ms: u64,
    /// SHA-256 of the certificate the node called with (TLS clusters): what `dsec control
    /// node revoke` refuses.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cert_sha256: Option<String>,
}

/// What operators set on a node.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeAdmin {
    /// No new sandboxes; running ones stay.
    pub cordoned: bool,
    /// No new sandboxes, and running ones are to be moved off or ended.
    pub draining: bool,
}

impl NodeAdmin {
    pub fn schedulable(&self) -> bool {
        !self.cordoned && !self.draining
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PlacementError {
    #[error(
        "node name {0:?} is invalid: 1-8 of a-z, 0-9 and '-', not starting or ending with '-'"
    )]
    BadNodeName(String),
    #[error("no node can take a {backend:?} sandbox of {resources}{labels}: {why}")]
    NoNode {
        backend: Backend,
        resources: Resources,
        labels: String,
        why: String,
    },
    #[error("every node tried refused the sandbox: {0}")]
    AllRefused(String),
    #[error("node {0} is not registered: its lease expired or it never joined")]
    UnknownNode(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl PlacementError {
    pub fn code(&self) -> tonic::Code {
        use tonic::Code;
        match self {
            PlacementError::BadNodeName(_) => Code::InvalidArgument,
            PlacementError::NoNode { .. } | PlacementError::AllRefused(_) => {
                Code::ResourceExhausted
            }
            PlacementError::UnknownNode(_) => Code::NotFound,
            PlacementError::Store(e) => crate::store_code(e),
        }
    }
}

impl From<PlacementError> for tonic::Status {
    fn from(e: PlacementError) -> Self {
        tonic::Status::new(e.code(), e.to_string())
    }
}

/// Nodes and their operator flags in the store.
#[derive(Clone)]
pub struct NodeRegistry {
    store: Arc<dyn Store>,
}

impl std::fmt::Debug for NodeRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NodeRegistry")
    }
}

impl NodeRegistry {
    pub fn new(store: Arc<dyn Store>) -> Self {
        NodeRegistry { store }
    }

    /// Registers a node under a new lease of `ttl`; the node then calls
    /// [`NodeRegistry::heartbeat`] well within `ttl`.
    pub async fn register(
        &self,
        record: &NodeRecord,
        ttl: Duration,
    ) -> Result<LeaseId, PlacementError> {
        if !valid_node_name(&record.name) {
            return Err(PlacementError::BadNodeName(
                record.name.chars().take(40).collect(),
            ));
        }
        let lease = self.store.grant_lease(ttl).await?;
        self.store
            .put(&keys::node(&record.name), to_json(record), Some(lease))
            .await?;
        Ok(lease)
    }

    /// Renews the node's lease and publishes its current record.
    pub async fn heartbeat(
        &self,
        lease: LeaseId,
        record: &NodeRecord,
    ) -> Result<(), PlacementError> {
        self.store.keep_alive(lease).await?;
        self.store
            .put(&keys::node(&record.name), to_json(record), Some(lease))
            .await?;
        Ok(())
    }

    /// Leaves cleanly: the record goes at once.
    pub async fn deregister(&self, lease: LeaseId) -> Result<(), PlacementError> {
        Ok(self.store.revoke_lease(lease).await?)
    }

    /// Ends node `name`'s registration at once (its lease revoked, so its record goes and
    /// the watchers treat it as a vanished node), if it registered with the certificate
    /// `cert_sha256` (None: whatever it registered with). Returns the record it ended.
    pub async fn evict(
        &self,
        name: &str,
        cert_sha256: Option<&str>,
    ) -> Result<Option<NodeRecord>, PlacementError> {
        let Some(kv) = self.store.get(&keys::node(name)).await? else {
            return Ok(None);
        };
        let record: NodeRecord = from_json(&kv)?;
        if cert_sha256.is_some() && record.cert_sha256.as_deref() != cert_sha256 {
            return Ok(None);
        }
        match kv.lease {
            Some(lease) => match self.store.revoke_lease(lease).await {
                Ok(()) | Err(StoreError::LeaseNotFound(_)) => {}
                Err(e) => return Err(e.into()),
            },
            None => {
                self.store.delete(&kv.key).await?;
            }
        }
        Ok(Some(record))
    }

    pub async fn set_admin(&self, name: &str, admin: NodeAdmin) -> Result<(), PlacementError> {
        if !valid_node_name(name) {
            return Err(PlacementError::BadNodeName(name.chars().take(40).collect()));
        }
        self.store
            .put(&keys::node_admin(name), to_json(&admin), None)
            .await?;
        Ok(())
    }

    /// Every live node with its operator flags, in name order.
    pub async fn list(&self) -> Result<Vec<(NodeRecord, NodeAdmin)>, PlacementError> {
        let nodes = self.store.range(keys::NODES).await?;
        let admin = self.store.range(keys::NODE_ADMIN).await?;
        let mut flags = HashMap::new();
        for kv in &admin.kvs {
            let name = kv.key.trim_start_matches(keys::NODE_ADMIN).to_string();
            flags.insert(name, from_json::<NodeAdmin>(kv)?);
        }
        nodes
            .kvs
            .iter()
            .map(|kv| {
                let record: NodeRecord = from_json(kv)?;
                let admin = flags.get(&record.name).copied().unwrap_or_default();
                Ok((record, admin))
            })
            .collect()
    }
}

/// What a sandbox needs from its node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlacementRequest {
    pub resources: Resources,
    pub backend: Backend,
    pub image: Option<String>,
    /// Every one of these must be among the node's labels.
    pub labels: BTreeMap<String, String>,
}

/// How one attempt on a node ended.
#[derive(Debug)]
pub enum Attempt<T, E> {
    Placed(T),
    /// The node's own admission said no (full, image missing, going away): try another.
    Refused(String),
    /// Not the node's fault (bad request, quota): stop.
    Failed(E),
}

#[derive(Debug)]
struct NodeState {
    record: NodeRecord,
    admin: NodeAdmin,
    in_flight: Resources,
    /// Creates the node accepted after its last heartbeat: (accepted at, size).
    recent: Vec<(u64, Resources)>,
    recent_sum: Resources,
}

impl NodeState {
    fn committed(&self) -> Resources {
        self.record
            .allocated
            .plus(self.in_flight)
            .plus(self.recent_sum)
    }

    /// The dominant share of capacity in use (0.0 empty, 1.0 full).
    fn load(&self) -> f64 {
        let committed = self.committed();
        committed
            .named()
            .iter()
            .zip(self.record.capacity.named())
            .map(|((_, used), (_, capacity))| {
                if capacity == 0 {
                    0.0
                } else {
                    *used as f64 / capacity as f64
                }
            })
            .fold(0.0, f64::max)
    }

    /// Why this node cannot take the request, if it cannot.
    fn unfit(&self, request: &PlacementRequest) -> Option<&'static str> {
        if !self.admin.schedulable() {
            return Some("cordoned or draining");
        }
        if !self.record.backends.contains(&request.backend) {
            return Some("backend not offered");
        }
        if !request
            .labels
            .iter()
            .all(|(k, v)| self.record.labels.get(k) == Some(v))
        {
            return Some("labels do not match");
        }
        let free = self.record.capacity.minus(self.committed());
        if !request.resources.fits_in(&free) {
            return Some("not enough free capacity");
        }
        None
    }
}

#[derive(Debug)]
struct PlacerState {
    /// In name order, so that a seeded placer is reproducible.
    nodes: BTreeMap<String, NodeState>,
    /// The keys of `nodes`, in the same order: random candidates are drawn from it.
    names: Vec<String>,
    /// How many nodes hold each image (an image no node holds needs no preference scan).
    image_holders: HashMap<String, usize>,
    rng: fastrand::Rng,
}

impl PlacerState {
    fn count_images(&mut self, images: &BTreeSet<String>, added: bool) {
        for image in images {
            if added {
                *self.image_holders.entry(image.clone()).or_default() += 1;
            } else if let Some(count) = self.image_holders.get_mut(image) {
                *count -= 1;
                if *count == 0 {
                    self.image_holders.remove(image);
                }
            }
        }
    }

    fn rebuild_names(&mut self) {
        self.names = self.nodes.keys().cloned().collect();
    }
}

/// Random draws one pick makes before it falls back to scanning every node.
const SAMPLE_DRAWS: usize = 16;

/// One apiserver's view of the nodes, with its own in-flight creates; see the module doc.
#[derive(Debug)]
pub struct Placer {
    state: Mutex<PlacerState>,
    choices: usize,
}

/// A node chosen for one create; counts as in flight there until committed or dropped.
#[derive(Debug)]
pub struct Ticket<'a> {
    placer: &'a Placer,
    node: String,
    resources: Resources,
    done: bool,
}

impl Ticket<'_> {
    pub fn node(&self) -> &str {
        &self.node
    }

    /// The node accepted the sandbox: it counts until the node's next heartbeat reports it.
    pub fn commit(mut self) {
        self.done = true;
        let mut state = self.placer.lock();
        if let Some(node) = state.nodes.get_mut(&self.node) {
            node.in_flight = node.in_flight.minus(self.resources);
            node.recent.push((now_ms(), self.resources));
            node.recent_sum = node.recent_sum.plus(self.resources);
        }
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        if !self.done {
            let mut state = self.placer.lock();
            if let Some(node) = state.nodes.get_mut(&self.node) {
                node.in_flight = node.in_flight.minus(self.resources);
            }
        }
    }
}

impl Placer {
    pub fn new(choices: usize) -> Self {
        Self::with_seed(choices, fastrand::u64(..))
    }

    /// A placer with a fixed random sequence (tests, simulations).
    pub fn with_seed(choices: usize, seed: u64) -> Self {
        Placer {
            state: Mutex::new(PlacerState {
                nodes: BTreeMap::new(),
                names: Vec::new(),
                image_holders: HashMap::new(),
                rng: fastrand::Rng::with_seed(seed),
            }),
            choices: choices.max(1),
        }
    }

    fn lock(&self) -> MutexGuard<'_, PlacerState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A node registered or heartbeated: its report replaces what we knew, and creates it
    /// accepted before the report stop counting on top of it.
    pub fn update_node(&self, record: NodeRecord) {
        let mut guard = self.lock();
        let state = &mut *guard;
        let now = now_ms();
        let ttl = RECENT_CREATE_TTL.as_millis() as u64;
        match state.nodes.get_mut(&record.name) {
            Some(node) => {
                node.recent
                    .retain(|(at, _)| *at > record.heartbeat_ms && now < at + ttl);
                node.recent_sum = node
                    .recent
                    .iter()
                    .fold(Resources::ZERO, |sum, (_, r)| sum.plus(*r));
                if node.record.images != record.images {
                    let old = std::mem::take(&mut node.record.images);
                    let new = record.images.clone();
                    node.record = record;
                    state.count_images(&old, false);
                    state.count_images(&new, true);
                } else {
                    node.record = record;
                }
            }
            None => {
                let images = record.images.clone();
                state.nodes.insert(
                    record.name.clone(),
                    NodeState {
                        record,
                        admin: NodeAdmin::default(),
                        in_flight: Resources::ZERO,
                        recent: Vec::new(),
                        recent_sum: Resources::ZERO,
                    },
                );
                state.count_images(&images, true);
                state.rebuild_names();
            }
        }
    }

    pub fn set_admin(&self, name: &str, admin: NodeAdmin) {
        if let Some(node) = self.lock().nodes.get_mut(name) {
            node.admin = admin;
        }
    }

    /// A node's lease expired or it left.
    pub fn remove_node(&self, name: &str) {
        let mut state = self.lock();
        if let Some(node) = state.nodes.remove(name) {
            state.count_images(&node.record.images, false);
            state.rebuild_names();
        }
    }

    /// The operator flags this placer last saw for a node.
    pub fn admin(&self, node: &str) -> Option<NodeAdmin> {
        self.lock().nodes.get(node).map(|n| n.admin)
    }

    /// Every node this placer knows, with its address, in name order.
    pub fn nodes(&self) -> Vec<(String, String)> {
        self.lock()
            .nodes
            .iter()
            .map(|(name, n)| (name.clone(), n.record.address.clone()))
            .collect()
    }

    /// The node's address, for runtime calls routed by sandbox id.
    pub fn address(&self, node: &str) -> Result<String, PlacementError> {
        self.lock()
            .nodes
            .get(node)
            .map(|n| n.record.address.clone())
            .ok_or_else(|| PlacementError::UnknownNode(node.to_string()))
    }

    /// Chooses a node for `request`, leaving out `exclude`.
    pub fn pick(
        &self,
        request: &PlacementRequest,
        exclude: &[String],
    ) -> Result<Ticket<'_>, PlacementError> {
        let mut guard = self.lock();
        let state = &mut *guard;
        // No node holds the image: no preference to weigh, so k random fitting nodes are
        // drawn directly (the same choice as from the full list of fitting nodes, without
        // scanning it); too few found in a few draws (a full or filtered cluster) scans.
        let image_held = request
            .image
            .as_ref()
            .is_some_and(|image| state.image_holders.contains_key(image));
        if !image_held {
            if let Some(name) = self.draw(state, request, exclude) {
                if let Some(node) = state.nodes.get_mut(&name) {
                    node.in_flight = node.in_flight.plus(request.resources);
                }
                return Ok(Ticket {
                    placer: self,
                    node: name,
                    resources: request.resources,
                    done: false,
                });
            }
        }
        // Sized once: growing it node by node cost a few reallocations per create.
        let mut fit: Vec<(&String, f64, bool)> = Vec::with_capacity(state.nodes.len());
        let mut reasons: BTreeMap<&'static str, usize> = BTreeMap::new();
        for (name, node) in &state.nodes {
            if exclude.contains(name) {
                *reasons.entry("refused already").or_default() += 1;
                continue;
            }
            match node.unfit(request) {
                Some(why) => *reasons.entry(why).or_default() += 1,
                None => {
                    let has_image = request
                        .image
                        .as_ref()
                        .is_some_and(|image| node.record.images.contains(image));
                    fit.push((name, node.load(), has_image));
                }
            }
        }
        if fit.is_empty() {
            let why = if reasons.is_empty() {
                "no node is registered".to_string()
            } else {
                reasons
                    .iter()
                    .map(|(why, n)| format!("{n} {why}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            let labels = if request.labels.is_empty() {
                String::new()
            } else {
                format!(" with labels {:?}", request.labels)
            };
            return Err(PlacementError::NoNode {
                backend: request.backend,
                resources: request.resources,
                labels,
                why,
            });
        }
        let holders_have_room = fit
            .iter()
            .any(|(_, load, has)| *has && *load < IMAGE_PREFERENCE_MAX_LOAD);
        if holders_have_room {
            fit.retain(|(_, _, has)| *has);
        }
        // k distinct candidates (k is small: rejection sampling is cheap).
        let k = self.choices.min(fit.len());
        let mut drawn: Vec<usize> = Vec::with_capacity(k);
        while drawn.len() < k {
            let i = state.rng.usize(..fit.len());
            if !drawn.contains(&i) {
                drawn.push(i);
            }
        }
        let mut best: Option<(&String, f64)> = None;
        for i in drawn {
            let (name, load, _) = fit[i];
            if best.is_none_or(|(_, best_load)| load < best_load) {
                best = Some((name, load));
            }
        }
        let name = best
            .map(|(name, _)| name.clone())
            .expect("fit is not empty");
        if let Some(node) = state.nodes.get_mut(&name) {
            node.in_flight = node.in_flight.plus(request.resources);
        }
        Ok(Ticket {
            placer: self,
            node: name,
            resources: request.resources,
            done: false,
        })
    }

    /// Chooses one node for `count` creates of `request` together (it must fit all of them;
    /// chosen as [`Placer::pick`] chooses for their sum): one ticket per create, each
    /// counting one create in flight until committed or dropped.
    pub fn pick_many(
        &self,
        request: &PlacementRequest,
        count: usize,
        exclude: &[String],
    ) -> Result<Vec<Ticket<'_>>, PlacementError> {
        if count <= 1 {
            return self.pick(request, exclude).map(|ticket| vec![ticket]);
        }
        let together = PlacementRequest {
            resources: request.resources.times(count as u64),
            ..request.clone()
        };
        let mut whole = self.pick(&together, exclude)?;
        // The sum stays in flight, now held by one ticket per create.
        whole.done = true;
        Ok((0..count)
            .map(|_| Ticket {
                placer: self,
                node: whole.node.clone(),
                resources: request.resources,
                done: false,
            })
            .collect())
    }

    /// The least loaded of k distinct random fitting nodes, if a few draws find k.
    fn draw(
        &self,
        state: &mut PlacerState,
        request: &PlacementRequest,
        exclude: &[String],
    ) -> Option<String> {
        let count = state.names.len();
        let k = self.choices;
        if count < k {
            return None;
        }
        let mut drawn: Vec<usize> = Vec::with_capacity(SAMPLE_DRAWS);
        let mut best: Option<(usize, f64)> = None;
        let mut found = 0;
        for _ in 0..SAMPLE_DRAWS {
            let i = state.rng.usize(..count);
            if drawn.contains(&i) {
                continue;
            }
            drawn.push(i);
            let name = &state.names[i];
            if exclude.contains(name) {
                continue;
            }
            let node = state.nodes.get(name)?;
            if node.unfit(request).is_some() {
                continue;
            }
            let load = node.load();
            if best.is_none_or(|(_, best_load)| load < best_load) {
                best = Some((i, load));
            }
            found += 1;
            if found == k {
                return best.map(|(i, _)| state.names[i].clone());
            }
        }
        None
    }

    /// Places with retries: `attempt(node)` creates on that node; a refusal tries another
    /// node, up to `max_nodes` of them. Returns the attempt's result and the node.
    pub async fn place<T, E, F, Fut>(
        &self,
        request: &PlacementRequest,
        max_nodes: usize,
        mut attempt: F,
    ) -> Result<Result<(T, String), E>, PlacementError>
    where
        F: FnMut(String) -> Fut,
        Fut: Future<Output = Attempt<T, E>>,
    {
        let mut refused: Vec<String> = Vec::new();
        let mut reasons: Vec<String> = Vec::new();
        for _ in 0..max_nodes.max(1) {
            let ticket = match self.pick(request, &refused) {
                Ok(ticket) => ticket,
                Err(e) if refused.is_empty() => return Err(e),
                Err(_) => break,
            };
            let node = ticket.node().to_string();
            match attempt(node.clone()).await {
                Attempt::Placed(value) => {
                    ticket.commit();
                    return Ok(Ok((value, node)));
                }
                Attempt::Refused(why) => {
                    reasons.push(format!("{node}: {why}"));
                    refused.push(node);
                }
                Attempt::Failed(e) => return Ok(Err(e)),
            }
        }
        Err(PlacementError::AllRefused(reasons.join("; ")))
    }
}

#[cfg(test)]
mod tests;
