//! FnCall on the node: the `Fn` gRPC service and SandboxFusion's `POST /run_code` on the
//! HTTP entry point, both handing calls to one dsec-fncall engine (warm container workers
//! from `$DSEC_HOME/images/fncall`). See fncall/README.md.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use dsec_fncall::vm::{ByImageKind, VmCgroups, VmFactory, VmJail, VmSettings};
use dsec_fncall::{
    CallLimits, CallLink, CallNetwork, ContainerFactory, Engine, EngineConfig, FnCallError,
    Language, NetworkRules,
};

use super::cgroup::{self, Cgroups, Limits};
use super::node::Node;
use crate::backend::EdgeConfig;
use crate::net::{Network, Policy, PolicyText};
use crate::paths::Artifacts;

static ENGINE: OnceLock<Arc<Engine>> = OnceLock::new();

/// The node's engine, made on first use (by [`start`]). On a node with a sandbox network,
/// networked calls run in workers on it; the links of a previous daemon's workers are freed
/// first. VM workers' VMMs go in cgroups of their own under the node's.
fn engine(node: &Node) -> Arc<Engine> {
    engine_with(node, dsec_fncall::vm::DEFAULT_VM_POOL_SIZE)
}

fn engine_with(node: &Node, vm_pool_size: usize) -> Arc<Engine> {
    let edge = &node.edge;
    ENGINE
        .get_or_init(|| {
            let images = edge.artifacts.home.join("images");
            let mut container = ContainerFactory::new(images, CallLimits::default());
            if let Some(net) = &edge.network {
                // A dead daemon's workers died with it; their addresses and records did not.
                release_links(edge);
                container = container.with_network(Arc::new(WorkerNetwork {
                    net: Arc::clone(net),
                    dir: links_dir(edge),
                }));
            }
            let jail = edge.jail.as_ref().map(|j| VmJail {
                uid: j.uid,
                gid: j.gid,
            });
            let run_dir = edge.state_dir.with_file_name("fncall-vm");
            let cgroups: Arc<dyn VmCgroups> = Arc::new(NodeVmCgroups(node.cgroups.clone()));
            let factory = with_vm_workers(
                &edge.artifacts,
                &run_dir,
                container,
                jail,
                vm_pool_size,
                Some(cgroups),
            );
            Arc::new(Engine::new(EngineConfig::default(), Arc::new(factory)))
        })
        .clone()
}

/// The node's workers: container workers, and VM workers for images built by
/// images/fncall-vm (templates and per-call sockets under `vm_run_dir`), their VMMs jailed
/// as `jail` says (the node's microVM jail's uid), `vm_pool_size` prewarmed VMMs per VM pool.
pub fn factory(
    artifacts: &Artifacts,
    vm_run_dir: &Path,
    jail: Option<VmJail>,
    vm_pool_size: usize,
) -> ByImageKind {
    let container = ContainerFactory::new(artifacts.home.join("images"), CallLimits::default());
    with_vm_workers(artifacts, vm_run_dir, container, jail, vm_pool_size, None)
}

/// `container` beside VM workers for images built by images/fncall-vm.
fn with_vm_workers(
    artifacts: &Artifacts,
    vm_run_dir: &Path,
    container: ContainerFactory,
    jail: Option<VmJail>,
    vm_pool_size: usize,
    cgroups: Option<Arc<dyn VmCgroups>>,
) -> ByImageKind {
    let images = artifacts.home.join("images");
    let vm = VmFactory::new(
        VmSettings {
            images_dir: images.clone(),
            kernel: artifacts.kernel.clone(),
            vmm: crate::find_binary("dsec-vmm").unwrap_or_else(|| "dsec-vmm".into()),
            run_dir: vm_run_dir.to_path_buf(),
            mem_mib: 512,
            pool_size: vm_pool_size,
            jail,
            unsupported: crate::kvm::KvmStatus::detect().why_not_microvm(),
            cgroups,
        },
        CallLimits::default(),
    );
    ByImageKind {
        images_dir: images,
        container: Arc::new(container),
        vm: Arc::new(vm),
    }
}

/// VM workers' VMMs in the node's cgroups, each in a group of its own with a one-vCPU microVM
/// sandbox's limits (the adoption sweep of the next daemon removes a dead one's groups).
struct NodeVmCgroups(Cgroups);

impl VmCgroups for NodeVmCgroups {
    fn create(&self, name: &str, mem_mib: u64) -> Result<Vec<PathBuf>, String> {
        let limits = Limits::for_sandbox(crate::BackendKind::MicroVm, mem_mib, 0, 1, 0);
        let dirs = self.0.create(name, limits).map_err(|e| e.to_string())?;
        Ok(cgroup::procs_files(&dirs))
    }

    fn remove(&self, name: &str) {
        cgroup::remove(&self.0.dirs(name));
    }
}

/// Frees every networked worker's link recorded for this node (at start: a dead daemon's;
/// at a clean stop: this one's, whose workers die with it). Blocking.
pub fn release_links(edge: &EdgeConfig) {
    if edge.network.is_none() {
        return;
    }
    release_recorded(edge);
}

/// Frees every networked worker's link at a clean stop and refuses links after it, so a
/// pool refilling while the daemon stops cannot leave an address behind. Blocking.
pub fn release_links_at_stop(edge: &EdgeConfig) {
    if edge.network.is_none() {
        return;
    }
    let mut stopped = LINKS_STOPPED.lock().unwrap_or_else(|e| e.into_inner());
    *stopped = true;
    release_recorded(edge);
}

/// Set at a clean stop; held while a link is made, so no link is made after the release.
static LINKS_STOPPED: std::sync::Mutex<bool> = std::sync::Mutex::new(false);

fn release_recorded(edge: &EdgeConfig) {
    for entry in std::fs::read_dir(links_dir(edge))
        .into_iter()
        .flatten()
        .flatten()
    {
        crate::net::release(&entry.path());
        let _ = std::fs::remove_dir_all(entry.path());
    }
    // A worker killed between taking its address and recording it left a slot naming a
    // directory that is gone now.
    if let Some(net) = &edge.network {
        let freed = net.free_orphan_slots();
        if freed > 0 {
            tracing::info!(
                freed,
                "freed address slots of workers that died while taking them"
            );
        }
    }
}

/// Where networked workers' links are recorded (one directory each, what `net::release`
/// frees): beside the sandboxes' directories, not among them.
fn links_dir(edge: &EdgeConfig) -> PathBuf {
    edge.state_dir.with_file_name("fncall-net")
}

/// The node's sandbox network as FnCall workers use it.
struct WorkerNetwork {
    net: Arc<Network>,
    dir: PathBuf,
}

/// A call's rules as the node's policy (named policies expanded); INVALID_ARGUMENT-worthy
/// errors say what is wrong.
fn resolve(net: &Network, rules: &NetworkRules) -> dsec_fncall::Result<Policy> {
    let count = rules.allow.len() + rules.deny.len();
    if count > crate::net::policy::MAX_RULES {
        // Before parsing 100,000 strings.
        return Err(FnCallError::InvalidRequest(
            crate::net::PolicyError::TooManyRules { count }.to_string(),
        ));
    }
    let text = PolicyText {
        allow: rules.allow.clone(),
        deny: rules.deny.clone(),
    };
    net.resolve(rules.allow_internet, &text)
        .map_err(|e| FnCallError::InvalidRequest(format!("network policy: {e}")))
}

impl CallNetwork for WorkerNetwork {
    fn check(&self, rules: &NetworkRules) -> dsec_fncall::Result<()> {
        resolve(&self.net, rules).map(drop)
    }

    fn attach(&self, pid: u32) -> dsec_fncall::Result<Arc<dyn CallLink>> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let stopped = LINKS_STOPPED.lock().unwrap_or_else(|e| e.into_inner());
        if *stopped {
            return Err(FnCallError::CallNetwork("the node is stopping".into()));
        }
        let dir = self.dir.join(format!(
            "w{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let failed = |e: String| FnCallError::CallNetwork(e);
        std::fs::create_dir_all(&dir)
            .map_err(|e| failed(format!("create {}: {e}", dir.display())))?;
        let mut link = WorkerLink {
            net: Arc::clone(&self.net),
            dir,
            addr: Ipv4Addr::UNSPECIFIED,
        };
        // On failure the link is dropped: whatever was made is released.
        let pid = i32::try_from(pid).map_err(|_| failed(format!("pid {pid}")))?;
        link.addr = self
            .net
            .attach(&link.dir, pid, &Policy::default())
            .map_err(|e| failed(e.to_string()))?;
        tracing::debug!(addr = %link.addr, pid, "FnCall worker on the sandbox network");
        Ok(Arc::new(link))
    }

    fn nameserver(&self) -> Option<Ipv4Addr> {
        Some(self.net.gateway)
    }
}

/// A networked worker's address, veth and chain; released on drop.
struct WorkerLink {
    net: Arc<Network>,
    dir: PathBuf,
    addr: Ipv4Addr,
}

impl CallLink for WorkerLink {
    fn apply(&self, rules: &NetworkRules) -> dsec_fncall::Result<()> {
        let policy = if *rules == NetworkRules::default() {
            Policy::default()
        } else {
            resolve(&self.net, rules)?
        };
        self.net
            .set_policy(self.addr, &policy)
            .map_err(|e| FnCallError::CallNetwork(format!("apply the call's policy: {e}")))
    }
}

impl Drop for WorkerLink {
    fn drop(&mut self) {
        crate::net::release(&self.dir);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Makes the engine and warms the python pool in the background when the FnCall image is
/// installed (a node without it serves every call with an error naming the build command).
pub fn start(node: &Node, vm_pool_size: usize) -> Arc<Engine> {
    let engine = engine_with(node, vm_pool_size);
    let warm = Arc::clone(&engine);
    tokio::spawn(async move {
        if let Err(err) = warm.prewarm(&[Language::Python]).await {
            tracing::info!(%err, "FnCall python pool not warmed");
        }
    });
    engine
}

/// Serves a connection of the HTTP entry point whose first request is for the SandboxFusion
/// API (`head`: what the router already read of it).
pub async fn serve_http(node: &Node, socket: tokio::net::TcpStream, head: Vec<u8>) {
    let peer = socket
        .peer_addr()
        .unwrap_or_else(|_| std::net::SocketAddr::from(([0, 0, 0, 0], 0)));
    let stream = dsec_fncall::sandboxfusion::Replay::new(head, socket);
    dsec_fncall::sandboxfusion::serve_connection(stream, peer, engine(node));
}
