//! The agent as a plain process on a Unix socket, started per test and stopped on drop
//! (shared by the agent and session test binaries).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use dsec_edge::{AgentAddr, AgentClient};

pub struct Agent {
    pub child: Child,
    pub dir: PathBuf,
    pub client: AgentClient,
}

impl Agent {
    pub async fn start(name: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("dsec-agent-test-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let socket = dir.join("agent.sock");
        let child = Command::new(env!("CARGO_BIN_EXE_dsec-agent"))
            .arg("--listen")
            .arg(format!("unix:{}", socket.display()))
            .env("DSEC_AGENT_LOG", "warn")
            .stdin(Stdio::null())
            .spawn()
            .expect("start dsec-agent");
        match connect_within(&socket, Duration::from_secs(10)).await {
            Some(client) => Self { child, dir, client },
            None => {
                let mut child = child;
                let _ = child.kill();
                let _ = child.wait();
                panic!("agent did not answer on {}", socket.display());
            }
        }
    }
}

async fn connect_within(socket: &std::path::Path, timeout: Duration) -> Option<AgentClient> {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if socket.exists() {
            if let Ok(client) = AgentClient::connect(AgentAddr::Unix(socket.to_path_buf())).await {
                if client.info().await.is_ok() {
                    return Some(client);
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    None
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
