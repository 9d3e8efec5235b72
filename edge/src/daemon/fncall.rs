//! FnCall on the node: the `Fn` gRPC service and SandboxFusion's `POST /run_code` on the
//! HTTP entry point, both handing calls to one dsec-fncall engine (warm container workers
//! from `$DSEC_HOME/images/fncall`). See fncall/README.md.

use std::sync::{Arc, OnceLock};

use dsec_fncall::{CallLimits, ContainerFactory, Engine, EngineConfig, Language};

use crate::backend::EdgeConfig;

static ENGINE: OnceLock<Arc<Engine>> = OnceLock::new();

/// The node's engine, made on first use.
pub fn engine(edge: &EdgeConfig) -> Arc<Engine> {
    ENGINE
        .get_or_init(|| {
            let images = edge.artifacts.home.join("images");
            let factory = ContainerFactory::new(images, CallLimits::default());
            Arc::new(Engine::new(EngineConfig::default(), Arc::new(factory)))
        })
        .clone()
}

/// Makes the engine and warms the python pool in the background when the FnCall image is
/// installed (a node without it serves every call with an error naming the build command).
pub fn start(edge: &EdgeConfig) -> Arc<Engine> {
    let engine = engine(edge);
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
