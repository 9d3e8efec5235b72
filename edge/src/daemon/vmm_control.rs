//! The daemon's client of a VMM's control socket (pause, resume, snapshot): one JSON
//! request per connection, one JSON reply line.

use std::path::PathBuf;
use std::time::Duration;

use super::record::Record;

/// How long the VMM may take to answer (a snapshot of a large guest takes a while).
const CONTROL_TIMEOUT: Duration = Duration::from_secs(60);

/// Why a control request failed.
#[derive(Debug, thiserror::Error)]
pub enum VmmControlError {
    #[error("this sandbox's VMM has no control socket (a record of a VMM started without --api-sock): recreate the sandbox")]
    NoSocket,
    #[error("the VMM did not answer its control socket within {} s: it may be stuck; delete the sandbox", CONTROL_TIMEOUT.as_secs())]
    Timeout,
    #[error("VMM control socket {}: {source}", socket.display())]
    Io {
        socket: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("VMM control reply {reply:?}: {detail}")]
    BadReply { reply: String, detail: String },
    #[error("the VMM refused {request}: {reason}")]
    Refused { request: String, reason: String },
}

/// One request on the VMM's control socket.
pub async fn vmm_control(
    record: &Record,
    request: serde_json::Value,
) -> Result<serde_json::Value, VmmControlError> {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    let sock = record
        .handle
        .api_socket
        .clone()
        .ok_or(VmmControlError::NoSocket)?;
    let talk = async {
        let mut stream = tokio::net::UnixStream::connect(&sock).await?;
        let mut line = request.to_string();
        line.push('\n');
        stream.write_all(line.as_bytes()).await?;
        let mut reader = tokio::io::BufReader::new(stream);
        let mut reply = String::new();
        reader.read_line(&mut reply).await?;
        Ok::<_, std::io::Error>(reply)
    };
    let reply = tokio::time::timeout(CONTROL_TIMEOUT, talk)
        .await
        .map_err(|_| VmmControlError::Timeout)?
        .map_err(|source| VmmControlError::Io {
            socket: sock.clone(),
            source,
        })?;
    let value: serde_json::Value =
        serde_json::from_str(reply.trim()).map_err(|e| VmmControlError::BadReply {
            reply: reply.clone(),
            detail: e.to_string(),
        })?;
    if value["ok"].as_bool() == Some(true) {
        Ok(value)
    } else {
        Err(VmmControlError::Refused {
            request: request.to_string(),
            reason: value["error"]
                .as_str()
                .unwrap_or("no reason given")
                .to_string(),
        })
    }
}
