//! The Agent service: identity and shutdown.

use std::time::Duration;

use dsec_api::agent::v1::agent_server::Agent;
use dsec_api::agent::v1::{InfoRequest, InfoResponse, ShutdownRequest, ShutdownResponse};
use tonic::{Request, Response, Status};

use crate::Mode;

/// Serves `dsec.agent.v1.Agent`.
pub struct AgentService {
    pub mode: Mode,
}

/// Time since the kernel booted (in a container: the host's).
fn uptime_ms() -> u64 {
    std::fs::read_to_string("/proc/uptime")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<f64>().ok())
        .map(|secs| (secs * 1000.0) as u64)
        .unwrap_or(0)
}

#[tonic::async_trait]
impl Agent for AgentService {
    async fn info(&self, _: Request<InfoRequest>) -> Result<Response<InfoResponse>, Status> {
        let uname = nix::sys::utsname::uname()
            .map_err(|e| Status::internal(format!("uname failed: {e}")))?;
        Ok(Response::new(InfoResponse {
            agent_version: env!("CARGO_PKG_VERSION").to_string(),
            kernel_release: uname.release().to_string_lossy().into_owned(),
            uptime_ms: uptime_ms(),
            hostname: uname.nodename().to_string_lossy().into_owned(),
            mode: self.mode.as_str().to_string(),
        }))
    }

    async fn shutdown(
        &self,
        _: Request<ShutdownRequest>,
    ) -> Result<Response<ShutdownResponse>, Status> {
        let mode = self.mode;
        tokio::spawn(async move {
            // Let the response reach the client first.
            tokio::time::sleep(Duration::from_millis(20)).await;
            crate::init::power_off(mode);
        });
        Ok(Response::new(ShutdownResponse {}))
    }
}
