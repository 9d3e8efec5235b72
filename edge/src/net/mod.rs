//! Sandbox networking: a node bridge, an address pool, a veth pair per container sandbox
//! (`eth0` inside, its host end an isolated bridge port) or a tap per booted microVM
//! (`tap.rs`), NAT to the uplink, a default-deny policy per sandbox in the node's nftables
//! tables (see `nft.rs`), and a DNS proxy on the bridge address that resolves only the names
//! a sandbox's policy allows (see `dns.rs`).
//!
//! A container's links are made through our own rtnetlink requests (`link.rs`: no process
//! per create), rules through libnftables in this process (`libnft.rs`, in parallel; `nft -j
//! -f -` if the library is missing); the rarer paths (the bridge, taps, release) run `ip
//! -batch`. What a sandbox holds is recorded in its directory
//! (`net`), so [`release`] frees it from the directory alone: on delete, on a failed create,
//! and after a daemon crash.

pub mod policy;

mod conntrack;
mod dns;
mod libnft;
mod link;
mod nft;
mod pool;
mod tap;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

pub use policy::{NamedPolicies, Policy, PolicyError, PolicyText, Rule};
pub use pool::PooledNetns;
pub use tap::{
    abandon_tap, attach_microvm, mark_if_networked, mark_snapshot_net_device, prepare_microvm,
    prepare_restore, prepare_resume, restore_override, snapshot_has_net_device,
    template_net_device, TapPlan,
};

/// File in the sandbox directory naming its address, table and pool slot.
const RECORD: &str = "net";
/// Where each node bridge's address slots live (`<dir>/<bridge>/<addr>` -> sandbox dir).
const SLOTS_DIR: &str = "/run/dsec-net";

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("{tool} failed: {detail}")]
    Tool { tool: &'static str, detail: String },
    #[error("network setup: {0}")]
    Setup(String),
    #[error("all {0} addresses of the node's sandbox pool are in use: delete sandboxes or give a wider --net-pool")]
    PoolExhausted(u32),
    #[error(transparent)]
    Policy(#[from] PolicyError),
}

/// What the node's network is made of (daemon flags `--net-bridge`, `--net-pool`, `--policies`).
#[derive(Clone, Debug)]
pub struct NetConfig {
    /// Bridge name, also the nftables table's: 1-11 of a-z, 0-9, '_'.
    pub bridge: String,
    /// The pool; None picks a free 10.x.0.0/16 (not overlapping the host's routes).
    pub pool: Option<(Ipv4Addr, u8)>,
    pub policies: NamedPolicies,
    /// The upstream resolver the DNS proxy asks (port 53); None: the host's first IPv4
    /// nameserver. Sandboxes never reach it themselves: their resolver is the proxy.
    pub resolver: Option<Ipv4Addr>,
    /// Namespaces with their veth made ahead of container creates (`pool.rs`; 0: none).
    pub veth_pool: usize,
}

/// Parses `A.B.C.D/LEN` for `--net-pool` (8 <= LEN <= 28, no host bits).
pub fn parse_pool(text: &str) -> Result<(Ipv4Addr, u8), NetError> {
    let rule: Rule = text
        .parse()
        .map_err(|e: PolicyError| NetError::Setup(format!("--net-pool {text:?}: {e}")))?;
    if !(8..=28).contains(&rule.prefix) || !text.contains('/') || rule.proto.is_some() {
        return Err(NetError::Setup(format!(
            "--net-pool {text:?}: give a network A.B.C.D/LEN with LEN 8-28, e.g. 10.88.0.0/16"
        )));
    }
    Ok((rule.net, rule.prefix))
}

/// The node's sandbox network: bridge, pool and nftables table.
#[derive(Debug)]
pub struct Network {
    pub bridge: String,
    pub pool: (Ipv4Addr, u8),
    pub gateway: Ipv4Addr,
    pub policies: NamedPolicies,
    /// Where the DNS proxy forwards the names it answers.
    pub resolver: Option<SocketAddr>,
    slots: PathBuf,
    /// Each sandbox's policy, its elements and the names the proxy resolved for it, by
    /// address.
    sandboxes: Mutex<HashMap<Ipv4Addr, Named>>,
    /// Held through a policy change (computed from, then written over, a sandbox's elements).
    changing: Mutex<()>,
    /// The proxy's sockets until [`Network::serve_dns`] takes them.
    dns_socket: Mutex<Option<dns::Sockets>>,
    /// Namespaces with their veth made ahead of creates (`pool.rs`).
    veth_pool: Arc<pool::VethPool>,
}

/// What the DNS proxy knows of a sandbox.
#[derive(Debug, Default)]
struct Named {
    policy: Policy,
    /// The policy's elements in the node's sets (what a change or a release removes).
    entries: BTreeSet<nft::Entry>,
    /// Bumped by each policy change: an answer resolved under an older policy is not kept.
    generation: u64,
    /// In the node's `dns<k>` sets, until they time out.
    resolved: Vec<dns::Resolved>,
    /// Refused queries written to its event log in the current minute, and since when.
    logged: (u32, Option<Instant>),
    /// Refused queries not written (over the minute's budget).
    unlogged: u32,
}

/// What a sandbox holds, recorded in its directory.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Held {
    table: String,
    addr: Ipv4Addr,
    slot: PathBuf,
    /// A microVM's network namespace while its VMM starts (see `tap.rs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    netns: Option<PathBuf>,
}

/// The bridge's own address: the pool's first.
fn gateway_of(pool: (Ipv4Addr, u8)) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(pool.0) + 1)
}

/// The networks this process runs, so that [`release`] (which has only a sandbox's
/// directory) finds the elements a sandbox holds.
static NETWORKS: Mutex<Vec<Weak<Network>>> = Mutex::new(Vec::new());

fn running(table: &str) -> Option<Arc<Network>> {
    let networks = NETWORKS.lock().unwrap_or_else(|e| e.into_inner());
    networks
        .iter()
        .filter_map(Weak::upgrade)
        .find(|n| n.bridge == table)
}

fn veth_name(addr: Ipv4Addr) -> String {
    format!("dsv{:08x}", u32::from(addr))
}

impl Network {
    /// Creates (or takes over) the bridge, turns on forwarding and writes the table with
    /// no sandbox in it. Blocking.
    pub fn start(config: &NetConfig) -> Result<Arc<Self>, NetError> {
        let bridge = &config.bridge;
        if bridge.is_empty()
            || bridge.len() > 11
            || !bridge
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        {
            return Err(NetError::Setup(format!(
                "--net-bridge {bridge:?}: give 1-11 of a-z, 0-9 and _ (it also names the nftables table)"
            )));
        }
        let pool = match config.pool {
            Some(pool) => pool,
            None => free_pool()?,
        };
        let gateway = gateway_of(pool);
        if !Path::new("/sys/class/net").join(bridge).exists() {
            ip_batch(&format!("link add {bridge} type bridge\n"), None)?;
        }
        // No IPv6 on the bridge: a sandbox must not reach the node over link-local
        // addresses (the table drops IPv6 from the bridge as well).
        write_sysctl(&format!("net/ipv6/conf/{bridge}/disable_ipv6"), "1")?;
        // A fixed MAC (06:00 and the gateway's address): a bridge left to itself takes the
        // lowest MAC of its ports, so it would change as sandboxes come and go, and every
        // sandbox that cached the gateway's old MAC would be cut off until its ARP entry
        // expired (a fork's new tap did this to its parent). A set address stays.
        ip_batch(
            &format!(
                "link set {bridge} address {mac}\naddr replace {gateway}/{} dev {bridge}\nlink set {bridge} up\n",
                pool.1,
                mac = tap::mac_of(gateway),
            ),
            None,
        )?;
        remember_ip_forward(bridge)?;
        write_sysctl("net/ipv4/ip_forward", "1")?;
        nft::apply(nft::base_table(bridge, bridge, pool))?;
        let slots = Path::new(SLOTS_DIR).join(bridge);
        std::fs::create_dir_all(&slots)
            .map_err(|e| NetError::Setup(format!("create {}: {e}", slots.display())))?;
        let dns_socket = dns::bind(gateway).map_err(|e| {
            NetError::Setup(format!(
                "the DNS proxy cannot listen on {gateway}:53 ({e}): stop the resolver that holds port 53 on all addresses, or make it listen on specific ones"
            ))
        })?;
        match libnft::unavailable() {
            None => {
                tracing::info!(%bridge, pool = %format!("{}/{}", pool.0, pool.1), %gateway, "sandbox network up (rules through libnftables)")
            }
            Some(err) => {
                tracing::warn!(%bridge, pool = %format!("{}/{}", pool.0, pool.1), %gateway, %err, "sandbox network up; rules through the nft program, a process per change (install libnftables1 for faster creates)")
            }
        }
        let network = Arc::new(Self {
            bridge: bridge.clone(),
            pool,
            gateway,
            policies: config.policies.clone(),
            resolver: config
                .resolver
                .or_else(host_resolver)
                .map(|ip| SocketAddr::from((ip, 53))),
            slots,
            sandboxes: Mutex::default(),
            changing: Mutex::default(),
            dns_socket: Mutex::new(Some(dns_socket)),
            veth_pool: pool::VethPool::start(bridge.clone(), config.veth_pool),
        });
        let mut networks = NETWORKS.lock().unwrap_or_else(|e| e.into_inner());
        networks.retain(|n| n.strong_count() > 0);
        networks.push(Arc::downgrade(&network));
        Ok(network)
    }

    /// Starts the DNS proxy on the runtime this is called on (once; later calls do nothing).
    pub fn serve_dns(self: &Arc<Self>) {
        let socket = self
            .dns_socket
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(socket) = socket {
            tokio::spawn(dns::serve(self.clone(), socket));
        }
    }

    /// The policy of the sandbox at `addr` and its generation, if one is there.
    fn policy_of(&self, addr: Ipv4Addr) -> Option<(Policy, u64)> {
        let sandboxes = self.sandboxes.lock().unwrap_or_else(|e| e.into_inner());
        sandboxes
            .get(&addr)
            .map(|n| (n.policy.clone(), n.generation))
    }

    /// Records names the proxy resolved for `addr` under the policy of `generation`, and
    /// already added to the node's sets. Returns the (set, address) elements to remove
    /// again: those of a policy changed meanwhile, and the oldest beyond
    /// [`dns::MAX_REMEMBERED`] (what is not remembered could not be removed on release).
    fn remember(
        &self,
        addr: Ipv4Addr,
        generation: u64,
        resolved: Vec<dns::Resolved>,
    ) -> Vec<(usize, Ipv4Addr)> {
        let mut sandboxes = self.sandboxes.lock().unwrap_or_else(|e| e.into_inner());
        let key = |r: &dns::Resolved| (r.set, r.addr);
        let Some(named) = sandboxes.get_mut(&addr) else {
            return resolved.iter().map(key).collect();
        };
        if named.generation != generation {
            let kept: BTreeSet<_> = named.resolved.iter().map(key).collect();
            return resolved
                .iter()
                .map(key)
                .filter(|k| !kept.contains(k))
                .collect();
        }
        let now = Instant::now();
        named.resolved.retain(|r| {
            r.until > now
                && !resolved
                    .iter()
                    .any(|n| n.name == r.name && key(n) == key(r))
        });
        named.resolved.extend(resolved);
        let excess = named.resolved.len().saturating_sub(dns::MAX_REMEMBERED);
        let evicted: Vec<dns::Resolved> = named.resolved.drain(..excess).collect();
        let kept: BTreeSet<_> = named.resolved.iter().map(key).collect();
        evicted
            .iter()
            .map(key)
            .filter(|k| !kept.contains(k))
            .collect()
    }

    /// Writes a line about the sandbox at `addr` to its event log (found through its
    /// address slot), at most [`dns::MAX_LOG_LINES`] a minute; later ones are counted and
    /// the count written with the next minute's first line.
    fn log_refusal(&self, addr: Ipv4Addr, line: &str) {
        let skipped = {
            let mut sandboxes = self.sandboxes.lock().unwrap_or_else(|e| e.into_inner());
            let Some(named) = sandboxes.get_mut(&addr) else {
                return;
            };
            let now = Instant::now();
            let (count, since) = &mut named.logged;
            if since.is_none_or(|t| now.duration_since(t).as_secs() >= 60) {
                *count = 0;
                *since = Some(now);
            }
            if *count >= dns::MAX_LOG_LINES {
                named.unlogged += 1;
                return;
            }
            *count += 1;
            std::mem::take(&mut named.unlogged)
        };
        let Some(dir) = self.sandbox_dir(addr) else {
            return;
        };
        if skipped > 0 {
            crate::daemon::record::append_event(
                &dir,
                &format!("network: {skipped} more refused DNS queries were not logged"),
            );
        }
        crate::daemon::record::append_event(&dir, line);
    }

    /// Forgets the sandbox at `addr`: what it had in the node's sets.
    fn forget(&self, addr: Ipv4Addr) -> Option<Named> {
        let mut sandboxes = self.sandboxes.lock().unwrap_or_else(|e| e.into_inner());
        sandboxes.remove(&addr)
    }

    /// Resolves a policy as written (named policies expanded) and checks that it compiles.
    pub fn resolve(&self, allow_internet: bool, text: &PolicyText) -> Result<Policy, PolicyError> {
        let policy = self.policies.resolve(allow_internet, text)?;
        policy::compile(&policy.allow)?;
        policy::compile(&policy.deny)?;
        Ok(policy)
    }

    /// Takes an address for `sandbox_dir` (recorded there) and makes it the DNS proxy's
    /// with `policy`; returns it and the nft commands of its elements.
    fn claim(
        &self,
        sandbox_dir: &Path,
        policy: &Policy,
    ) -> Result<(Ipv4Addr, Vec<serde_json::Value>), NetError> {
        let entries = nft::entries(
            &policy::compile(&policy.allow)?,
            &policy::compile(&policy.deny)?,
            &policy.domain_specs(),
        );
        let addr = self.allocate(sandbox_dir)?;
        // A sandbox that had this address before and whose release failed left elements.
        if let Some(stale) = self.forget(addr) {
            remove_elements(&self.bridge, addr, Some(stale));
        }
        let rules = nft::add_sandbox(&self.bridge, addr, &entries);
        self.sandboxes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(
                addr,
                Named {
                    policy: policy.clone(),
                    entries,
                    ..Named::default()
                },
            );
        Ok((addr, rules))
    }

    /// A network namespace with its veth ready, for a container's agent to join (then
    /// [`Network::attach_pooled`]); None while the pool is empty.
    pub fn take_netns(&self) -> Option<PooledNetns> {
        self.veth_pool.take()
    }

    /// Gives the sandbox whose agent is `pid` (PID 1 of its network namespace) an address,
    /// `eth0` with a default route through the bridge, and its policy. Recorded in
    /// `sandbox_dir` first, so [`release`] frees whatever was made if anything fails. Blocking.
    pub fn attach(
        &self,
        sandbox_dir: &Path,
        pid: i32,
        policy: &Policy,
    ) -> Result<Ipv4Addr, NetError> {
        let netns = std::fs::File::open(format!("/proc/{pid}/ns/net")).map_err(|e| {
            NetError::Setup(format!("open the network namespace of pid {pid}: {e}"))
        })?;
        self.attach_links(sandbox_dir, Links::Make(netns), policy)
    }

    /// [`Network::attach`] for a sandbox whose agent joined `pooled`'s namespace: its veth
    /// is there already; its host end gets the address's name and comes up. Blocking.
    pub fn attach_pooled(
        &self,
        sandbox_dir: &Path,
        pooled: PooledNetns,
        policy: &Policy,
    ) -> Result<Ipv4Addr, NetError> {
        self.attach_links(sandbox_dir, Links::Pooled(pooled), policy)
    }

    fn attach_links(
        &self,
        sandbox_dir: &Path,
        links: Links,
        policy: &Policy,
    ) -> Result<Ipv4Addr, NetError> {
        let (addr, rules) = self.claim(sandbox_dir, policy)?;
        let veth = veth_name(addr);
        let bridge = &self.bridge;
        // Rules and links in parallel: until the map entry exists the bridge drops the
        // sandbox's packets anyway.
        let rules = std::thread::spawn(move || {
            let started = Instant::now();
            (nft::apply(rules), started.elapsed())
        });
        let started = Instant::now();
        let pooled = matches!(links, Links::Pooled(_));
        let (host, netns) = match links {
            Links::Pooled(mut pooled) => {
                let host = link::Rtnl::open()
                    .and_then(|mut rtnl| rtnl.rename_and_up(pooled.host_index, &veth))
                    .and_then(|()| {
                        let eth0 = pooled.eth0;
                        pooled.inside.add_address(eth0, addr, self.pool.1)?;
                        pooled.inside.add_default_route(eth0, self.gateway)
                    });
                (host, None)
            }
            Links::Make(netns) => {
                let host = link::Rtnl::open().and_then(|mut rtnl| {
                    rtnl.add_veth(&veth, link::index_of(bridge)?, "eth0", &netns)?;
                    rtnl.isolate(link::index_of(&veth)?, true)
                });
                (host, Some(netns))
            }
        };
        if pooled {
            self.veth_pool.refill();
        }
        let host_us = started.elapsed().as_micros() as u64;
        let inside = host.and_then(|()| match &netns {
            Some(netns) => link::configure_inside(netns, addr, self.pool.1, self.gateway),
            None => Ok(()),
        });
        let links_us = started.elapsed().as_micros() as u64;
        let (rules, rules_took) = rules.join().unwrap_or_else(|_| {
            (
                Err(NetError::Setup("the nft thread panicked".into())),
                Default::default(),
            )
        });
        // Where a create's network setup goes (the benchmark reads these).
        tracing::debug!(
            rules_us = rules_took.as_micros() as u64,
            host_links_us = host_us,
            links_us,
            pooled,
            "network setup parts"
        );
        inside.and(rules)?;
        Ok(addr)
    }

    /// Replaces a running sandbox's policy: new connections see it at once; connections it
    /// now denies are cut (the next packet the sandbox sends is rejected with a reset, and
    /// their conntrack entries go, so replies are dropped). One transaction of the elements
    /// that differ. Blocking.
    pub fn set_policy(&self, addr: Ipv4Addr, policy: &Policy) -> Result<(), NetError> {
        let entries = nft::entries(
            &policy::compile(&policy.allow)?,
            &policy::compile(&policy.deny)?,
            &policy.domain_specs(),
        );
        let asked = Instant::now();
        let _changing = self.changing.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let lock_us = now.duration_since(asked).as_micros() as u64;
        let old = {
            let mut sandboxes = self.sandboxes.lock().unwrap_or_else(|e| e.into_inner());
            let named = sandboxes.entry(addr).or_default();
            named.resolved.retain(|r| r.until > now);
            Named {
                policy: std::mem::replace(&mut named.policy, policy.clone()),
                entries: std::mem::replace(&mut named.entries, entries.clone()),
                generation: named.generation,
                resolved: std::mem::take(&mut named.resolved),
                ..Named::default()
            }
        };
        // Names resolved before stay open as long as the new policy allows them (in the
        // sets of the new policy's combinations).
        let kept: Vec<dns::Resolved> = old
            .resolved
            .iter()
            .flat_map(|r| {
                policy
                    .domain_verdict(&r.name)
                    .into_iter()
                    .map(|(set, _)| dns::Resolved { set, ..r.clone() })
            })
            .collect();
        let old_keys: BTreeSet<(usize, Ipv4Addr)> =
            old.resolved.iter().map(|r| (r.set, r.addr)).collect();
        let mut new_keys: BTreeMap<(usize, Ipv4Addr), Instant> = BTreeMap::new();
        for r in &kept {
            let until = new_keys.entry((r.set, r.addr)).or_insert(r.until);
            *until = (*until).max(r.until);
        }
        let gone: Vec<(usize, Ipv4Addr)> = old_keys
            .iter()
            .filter(|k| !new_keys.contains_key(k))
            .copied()
            .collect();
        let added: Vec<(usize, Ipv4Addr, u32)> = new_keys
            .iter()
            .filter(|(k, _)| !old_keys.contains(k))
            .map(|((set, ip), until)| {
                let left = until.saturating_duration_since(now).as_secs().max(1);
                (*set, *ip, left.min(u64::from(u32::MAX)) as u32)
            })
            .collect();
        let mut cmds = nft::change_policy(&self.bridge, addr, &old.entries, &entries);
        cmds.extend(nft::add_resolved(&self.bridge, addr, &added));
        let removals = nft::remove_resolved(&self.bridge, addr, &gone);
        let rules_started = Instant::now();
        let mut applied = nft::apply(cmds.iter().cloned().chain(removals.clone()).collect());
        if applied.is_err() && !removals.is_empty() {
            // A resolved address that timed out meanwhile cannot be deleted: each alone.
            for removal in removals {
                let _ = nft::apply(vec![removal]);
            }
            applied = nft::apply(cmds);
        }
        let mut sandboxes = self.sandboxes.lock().unwrap_or_else(|e| e.into_inner());
        let named = sandboxes.entry(addr).or_default();
        named.generation += 1;
        if let Err(err) = applied {
            named.policy = old.policy;
            named.entries = old.entries;
            named.resolved = old.resolved;
            return Err(err);
        }
        named.resolved = kept;
        drop(sandboxes);
        let rules_us = rules_started.elapsed().as_micros() as u64;
        let flush_started = Instant::now();
        flush_conntrack(addr);
        // Where a live change's time goes (the benchmark reads these).
        tracing::debug!(
            lock_us,
            rules_us,
            conntrack_us = flush_started.elapsed().as_micros() as u64,
            "policy change parts"
        );
        Ok(())
    }

    /// After a restart: the table again, with the adopted sandboxes' policies; veths on the
    /// bridge of sandboxes that are gone are removed. Blocking.
    pub fn adopt(&self, live: &[(Ipv4Addr, Policy)]) -> Result<(), NetError> {
        let mut cmds = nft::base_table(&self.bridge, &self.bridge, self.pool);
        for (addr, policy) in live {
            let entries = nft::entries(
                &policy::compile(&policy.allow)?,
                &policy::compile(&policy.deny)?,
                &policy.domain_specs(),
            );
            cmds.extend(nft::add_sandbox(&self.bridge, *addr, &entries));
            self.sandboxes
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(
                    *addr,
                    Named {
                        policy: policy.clone(),
                        entries,
                        ..Named::default()
                    },
                );
        }
        nft::apply(cmds)?;
        let keep: Vec<String> = live
            .iter()
            .flat_map(|(a, _)| [veth_name(*a), tap::tap_name(*a)])
            .collect();
        let mut batch = String::new();
        for entry in std::fs::read_dir("/sys/class/net")
            .into_iter()
            .flatten()
            .flatten()
        {
            let name = entry.file_name().to_string_lossy().into_owned();
            let on_bridge = std::fs::read_link(entry.path().join("master"))
                .is_ok_and(|m| m.file_name().is_some_and(|n| n == self.bridge.as_str()));
            if (name.starts_with("dsv") || name.starts_with("dst"))
                && !keep.contains(&name)
                && on_bridge
            {
                batch.push_str(&format!("link del {name}\n"));
            }
        }
        // A recreated bridge lost its ports: adopted sandboxes' host ends join it again.
        for name in &keep {
            if Path::new("/sys/class/net").join(name).exists() {
                batch.push_str(&format!("link set {name} master {}\n", self.bridge));
                batch.push_str(&format!("link set {name} type bridge_slave isolated on\n"));
            }
        }
        if !batch.is_empty() {
            ip_batch(&batch, None)?;
        }
        Ok(())
    }

    /// Frees the address slots whose holder's directory is gone: a holder that died between
    /// taking its slot and recording it there leaves nothing [`release`] can find. Blocking.
    pub fn free_orphan_slots(&self) -> usize {
        let mut freed = 0;
        for entry in std::fs::read_dir(&self.slots)
            .into_iter()
            .flatten()
            .flatten()
        {
            let path = entry.path();
            let orphan = std::fs::read_link(&path).is_ok_and(|holder| !holder.exists());
            if orphan && std::fs::remove_file(&path).is_ok() {
                freed += 1;
            }
        }
        freed
    }

    /// The directory of the sandbox holding `addr`, from its address slot.
    pub fn sandbox_dir(&self, addr: Ipv4Addr) -> Option<PathBuf> {
        std::fs::read_link(self.slots.join(addr.to_string())).ok()
    }

    /// Packets the policies rejected, per sandbox address. Blocking.
    pub fn denied_packets(&self) -> Result<Vec<(Ipv4Addr, u64)>, NetError> {
        nft::denied_packets(&self.bridge)
    }

    /// Removes the table and the bridge (a clean stop with no sandbox left). Blocking.
    pub fn stop(&self) {
        self.veth_pool.stop();
        if let Err(err) = nft::apply(nft::delete_table(&self.bridge)) {
            tracing::warn!(%err, "cannot remove the sandbox network's nftables table");
        }
        if let Err(err) = ip_batch(&format!("link del {}\n", self.bridge), None) {
            tracing::warn!(%err, "cannot remove the sandbox bridge");
        }
        let _ = std::fs::remove_dir(&self.slots);
        restore_ip_forward(&self.bridge);
    }

    /// Takes a free address of the pool for `sandbox_dir` (a symlink `<slots>/<addr>` ->
    /// the directory; one whose directory is gone is free again) and records it there.
    fn allocate(&self, sandbox_dir: &Path) -> Result<Ipv4Addr, NetError> {
        let first = u32::from(self.pool.0) + 2;
        let count = (1u32 << (32 - self.pool.1)) - 3;
        let start = random_u32() % count;
        for i in 0..count * 2 {
            let addr = Ipv4Addr::from(first + (start + i / 2) % count);
            let slot = self.slots.join(addr.to_string());
            match std::os::unix::fs::symlink(sandbox_dir, &slot) {
                Ok(()) => {
                    let held = Held {
                        table: self.bridge.clone(),
                        addr,
                        slot: slot.clone(),
                        netns: None,
                    };
                    if let Err(e) = write_held(sandbox_dir, &held) {
                        let _ = std::fs::remove_file(&slot);
                        return Err(e);
                    }
                    return Ok(addr);
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    if std::fs::read_link(&slot).is_ok_and(|t| !t.exists()) {
                        let _ = std::fs::remove_file(&slot);
                    }
                }
                Err(e) => {
                    return Err(NetError::Setup(format!(
                        "take address slot {}: {e}",
                        slot.display()
                    )))
                }
            }
        }
        Err(NetError::PoolExhausted(count))
    }
}

/// Where a sandbox's veth comes from.
enum Links {
    /// Made now, into the agent's own namespace.
    Make(std::fs::File),
    /// Made ahead, with the namespace the agent joined.
    Pooled(PooledNetns),
}

impl Drop for Network {
    fn drop(&mut self) {
        self.veth_pool.stop();
    }
}

/// The address recorded in a sandbox directory, if it has one.
pub fn address(sandbox_dir: &Path) -> Option<Ipv4Addr> {
    held(sandbox_dir).map(|h| h.addr)
}

fn held(sandbox_dir: &Path) -> Option<Held> {
    serde_json::from_slice(&std::fs::read(sandbox_dir.join(RECORD)).ok()?).ok()
}

fn write_held(sandbox_dir: &Path, held: &Held) -> Result<(), NetError> {
    let json = serde_json::to_vec(held).unwrap_or_default();
    std::fs::write(sandbox_dir.join(RECORD), json)
        .map_err(|e| NetError::Setup(format!("record the sandbox's address: {e}")))
}

/// The network namespace a microVM's jailed VMM joins, if its tap is being set up.
pub fn jail_netns(sandbox_dir: &Path) -> Option<PathBuf> {
    held(sandbox_dir)?.netns
}

/// Frees what the sandbox in `sandbox_dir` holds: its rules, its veth (gone with its
/// namespace, unless that is still alive) or tap (gone with its VMM), a microVM's
/// namespace, its conntrack entries and its address. Blocking.
pub fn release(sandbox_dir: &Path) {
    let Some(held) = held(sandbox_dir) else {
        return;
    };
    let named = running(&held.table).and_then(|n| n.forget(held.addr));
    remove_elements(&held.table, held.addr, named);
    for link in [veth_name(held.addr), tap::tap_name(held.addr)] {
        if Path::new("/sys/class/net").join(&link).exists() {
            let _ = ip_batch(&format!("link del {link}\n"), None);
        }
    }
    if let Some(netns) = &held.netns {
        tap::remove_netns(netns);
    }
    flush_conntrack(held.addr);
    if std::fs::read_link(&held.slot).is_ok_and(|t| t == sandbox_dir) {
        let _ = std::fs::remove_file(&held.slot);
    }
    let _ = std::fs::remove_file(sandbox_dir.join(RECORD));
}

/// Removes a sandbox's elements from the node's sets: what `named` says it has (a node that
/// does not know it, after a restart, rewrote the table without it), or its membership only.
fn remove_elements(table: &str, addr: Ipv4Addr, named: Option<Named>) {
    let named = named.unwrap_or_default();
    let mut cmds = nft::remove_sandbox(table, addr, &named.entries);
    let resolved: BTreeSet<(usize, Ipv4Addr)> =
        named.resolved.iter().map(|r| (r.set, r.addr)).collect();
    cmds.extend(nft::remove_resolved(
        table,
        addr,
        &resolved.into_iter().collect::<Vec<_>>(),
    ));
    if let Err(err) = nft::apply(cmds.clone()) {
        // One transaction fails as a whole (a part already gone, a resolved address timed
        // out): then each part alone.
        tracing::debug!(%err, %addr, "sandbox elements partly gone");
        for cmd in cmds {
            let _ = nft::apply(vec![cmd]);
        }
    }
}

/// Deletes the connection tracking entries of connections the address opened: in this
/// process (`conntrack.rs`), or through the `conntrack` program if that fails (a kernel
/// without ctnetlink's dump filter).
fn flush_conntrack(addr: Ipv4Addr) {
    match conntrack::delete_from(addr) {
        Ok(_) => {}
        Err(err) => {
            tracing::debug!(%err, %addr, "conntrack through netlink failed; running the conntrack program");
            // Exit status 1 with "0 flow entries" when there were none.
            let _ = Command::new("conntrack")
                .args(["-D", "-s", &addr.to_string()])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// Runs `ip -batch -` with `commands`, in the network namespace `netns` if given.
fn ip_batch(commands: &str, netns: Option<&std::fs::File>) -> Result<(), NetError> {
    let mut command = Command::new("ip");
    command
        .args(["-batch", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    if let Some(netns) = netns {
        let fd = netns.as_raw_fd();
        use std::os::unix::process::CommandExt;
        // SAFETY: runs in the forked child before exec; setns is a single system call on a
        // descriptor that stays open in the parent until the child has exec'd.
        unsafe {
            command.pre_exec(move || {
                if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    let mut child = command.spawn().map_err(|e| NetError::Tool {
        tool: "ip",
        detail: format!("cannot start it ({e}); install iproute2"),
    })?;
    if let Some(mut stdin) = child.stdin.take() {
        let _ = stdin.write_all(commands.as_bytes());
    }
    let output = child.wait_with_output().map_err(|e| NetError::Tool {
        tool: "ip",
        detail: e.to_string(),
    })?;
    if !output.status.success() {
        return Err(NetError::Tool {
            tool: "ip",
            detail: format!(
                "{} (commands: {})",
                String::from_utf8_lossy(&output.stderr).trim(),
                commands.trim().replace('\n', "; ")
            ),
        });
    }
    Ok(())
}

/// Where the host's ip_forward from before the first start of this bridge is kept (it
/// survives a daemon crash, so a later daemon does not take its own setting for the host's).
fn ip_forward_before(bridge: &str) -> PathBuf {
    Path::new(SLOTS_DIR).join(format!("{bridge}.ip_forward"))
}

fn remember_ip_forward(bridge: &str) -> Result<(), NetError> {
    let before = ip_forward_before(bridge);
    if before.exists() {
        return Ok(());
    }
    std::fs::create_dir_all(SLOTS_DIR)
        .map_err(|e| NetError::Setup(format!("create {SLOTS_DIR}: {e}")))?;
    with_ip_forward_lock(|| {
        // Another node's network on this host already set it: the host's own value is the
        // one that node recorded.
        let value = match other_ip_forward_records(bridge).first() {
            Some(other) => std::fs::read_to_string(other),
            None => std::fs::read_to_string("/proc/sys/net/ipv4/ip_forward"),
        }
        .map_err(|e| NetError::Setup(format!("read the host's net.ipv4.ip_forward: {e}")))?;
        std::fs::write(&before, value.trim())
            .map_err(|e| NetError::Setup(format!("record {}: {e}", before.display())))
    })
}

/// Puts the host's ip_forward back as it was before this bridge was first set up, unless
/// another node's network on this host still needs it (the last one to stop restores it).
fn restore_ip_forward(bridge: &str) {
    let before = ip_forward_before(bridge);
    with_ip_forward_lock(|| {
        let Ok(value) = std::fs::read_to_string(&before) else {
            return;
        };
        if !other_ip_forward_records(bridge).is_empty() {
            let _ = std::fs::remove_file(&before);
            return;
        }
        match write_sysctl("net/ipv4/ip_forward", value.trim()) {
            Ok(()) => drop(std::fs::remove_file(&before)),
            Err(err) => tracing::warn!(%err, "cannot restore the host's ip_forward"),
        }
    });
}

/// The ip_forward records of the other node bridges that still exist on this host (a record
/// whose bridge is gone belongs to a node that will not stop cleanly).
fn other_ip_forward_records(bridge: &str) -> Vec<PathBuf> {
    std::fs::read_dir(SLOTS_DIR)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name().to_string_lossy().into_owned();
            let other = name.strip_suffix(".ip_forward")?;
            (other != bridge && Path::new("/sys/class/net").join(other).exists())
                .then(|| entry.path())
        })
        .collect()
}

/// Runs `f` holding the host-wide lock on the ip_forward records (nodes on one host start
/// and stop their networks concurrently).
fn with_ip_forward_lock<T>(f: impl FnOnce() -> T) -> T {
    use std::os::fd::AsRawFd;
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(Path::new(SLOTS_DIR).join("ip_forward.lock"));
    if let Ok(file) = &lock {
        // SAFETY: flock(2) on a descriptor this function owns; released when it is closed.
        unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) };
    }
    f()
}

fn write_sysctl(name: &str, value: &str) -> Result<(), NetError> {
    let path = Path::new("/proc/sys").join(name);
    std::fs::write(&path, value)
        .map_err(|e| NetError::Setup(format!("write {value} to {}: {e}", path.display())))
}

/// The host's first IPv4 nameserver (the proxy runs in the host's namespace, so a
/// loopback resolver is fine).
fn host_resolver() -> Option<Ipv4Addr> {
    std::fs::read_to_string("/etc/resolv.conf")
        .ok()?
        .lines()
        .filter_map(|l| l.trim().strip_prefix("nameserver"))
        .find_map(|ip| ip.trim().parse::<Ipv4Addr>().ok())
}

/// The first 10.N.0.0/16 (N from 200 up) that no host route overlaps.
fn free_pool() -> Result<(Ipv4Addr, u8), NetError> {
    let routes = std::fs::read_to_string("/proc/net/route").unwrap_or_default();
    // Destination and mask are little-endian hex in columns 2 and 8.
    let taken: Vec<(u32, u32)> = routes
        .lines()
        .skip(1)
        .filter_map(|line| {
            let cols: Vec<&str> = line.split_whitespace().collect();
            let dest = u32::from_str_radix(cols.get(1)?, 16).ok()?.swap_bytes();
            let mask = u32::from_str_radix(cols.get(7)?, 16).ok()?.swap_bytes();
            (mask != 0).then_some((dest, mask))
        })
        .collect();
    for n in 200u32..=254 {
        let net = (10 << 24) | (n << 16);
        let mask = 0xffff_0000u32;
        if taken
            .iter()
            .all(|(dest, m)| (net & m) != (dest & m) && (dest & mask) != net)
        {
            return Ok((Ipv4Addr::from(net), 16));
        }
    }
    Err(NetError::Setup(
        "no free 10.200-254.0.0/16 for the sandbox pool: give one with --net-pool".into(),
    ))
}

fn random_u32() -> u32 {
    let mut buf = [0u8; 4];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        use std::io::Read;
        let _ = f.read_exact(&mut buf);
    }
    u32::from_ne_bytes(buf)
}
