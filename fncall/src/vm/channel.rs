//! The host end of a worker VM's vsock: the VMM's Unix socket (`CONNECT <port>` handshake)
//! and the length-prefixed frames the guest worker and the zygote speak.

use std::io;
use std::path::Path;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

/// The guest port the VM worker (`guest_worker.py`) listens on.
pub const WORKER_PORT: u32 = 1100;

/// Connects to `port` in the guest through the VMM's vsock socket at `uds`.
pub async fn connect(uds: &Path, port: u32) -> io::Result<UnixStream> {
    let mut stream = UnixStream::connect(uds).await?;
    stream
        .write_all(format!("CONNECT {port}\n").as_bytes())
        .await?;
    // "OK <host port>\n"; read byte by byte so no frame byte after it is consumed.
    let mut line = Vec::with_capacity(16);
    loop {
        let byte = stream.read_u8().await?;
        if byte == b'\n' {
            break;
        }
        line.push(byte);
        if line.len() > 64 {
            break;
        }
    }
    if !line.starts_with(b"OK ") {
        return Err(io::Error::new(
            io::ErrorKind::ConnectionRefused,
            format!(
                "vsock CONNECT {port} answered {:?}",
                String::from_utf8_lossy(&line)
            ),
        ));
    }
    Ok(stream)
}

/// A frame to the guest: 4-byte big-endian length, then the payload.
pub async fn send(stream: &mut UnixStream, payload: &[u8]) -> io::Result<()> {
    let size = u32::try_from(payload.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "frame over 4 GiB"))?;
    stream.write_u32(size).await?;
    stream.write_all(payload).await?;
    stream.flush().await
}

/// A frame from the guest: its kind byte and payload, at most `max` bytes (the guest is
/// not trusted with the host's memory).
pub async fn receive(stream: &mut UnixStream, max: usize) -> io::Result<(u8, Vec<u8>)> {
    let size = stream.read_u32().await? as usize;
    if size == 0 || size > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame of {size} bytes from the guest (at most {max})"),
        ));
    }
    let mut buf = vec![0u8; size];
    stream.read_exact(&mut buf).await?;
    let kind = buf.remove(0);
    Ok((kind, buf))
}
