//! FnCall on the node: the `Fn` gRPC service and SandboxFusion's `POST /run_code` on the
//! HTTP entry point, both handing calls to one dsec-fncall engine (warm container workers
//! from `$DSEC_HOME/images/fncall`). See fncall/README.md.

use std::path::Path;
use std::sync::{Arc, OnceLock};

use dsec_fncall::vm::{ByImageKind, VmFactory, VmJail, VmSettings};
use dsec_fncall::{CallLimits, ContainerFactory, Engine, EngineConfig, Language};

use crate::backend::EdgeConfig;
use crate::paths::Artifacts;

static ENGINE: OnceLock<Arc<Engine>> = OnceLock::new();

/// The node's engine, made on first use (by [`start`]).
pub fn engine(edge: &EdgeConfig) -> Arc<Engine> {
    engine_with(edge, dsec_fncall::vm::DEFAULT_VM_POOL_SIZE)
}

fn engine_with(edge: &EdgeConfig, vm_pool_size: usize) -> Arc<Engine> {
    ENGINE
        .get_or_init(|| {
            let jail = edge.jail.as_ref().map(|j| VmJail {
                uid: j.uid,
                gid: j.gid,
            });
            let run_dir = edge.state_dir.with_file_name("fncall-vm");
            let factory = factory(&edge.artifacts, &run_dir, jail, vm_pool_size);
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
    let images = artifacts.home.join("images");
    let container = ContainerFactory::new(images.clone(), CallLimits::default());
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
        },
        CallLimits::default(),
    );
    ByImageKind {
        images_dir: images,
        container: Arc::new(container),
        vm: Arc::new(vm),
    }
}

/// Makes the engine and warms the python pool in the background when the FnCall image is
/// installed (a node without it serves every call with an error naming the build command).
pub fn start(edge: &EdgeConfig, vm_pool_size: usize) -> Arc<Engine> {
    let engine = engine_with(edge, vm_pool_size);
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
pub async fn serve_http(edge: &EdgeConfig, socket: tokio::net::TcpStream, head: Vec<u8>) {
    let peer = socket
        .peer_addr()
        .unwrap_or_else(|_| std::net::SocketAddr::from(([0, 0, 0, 0], 0)));
    let stream = dsec_fncall::sandboxfusion::Replay::new(head, socket);
    dsec_fncall::sandboxfusion::serve_connection(stream, peer, engine(edge));
}
