//! Listening sockets: a Unix socket (container path, tests) or AF_VSOCK (in a VM).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::str::FromStr;

use nix::sys::socket::{
    accept4, bind, listen, socket, AddressFamily, Backlog, SockFlag, SockType, VsockAddr,
};
use tokio::io::unix::AsyncFd;
use tokio::net::UnixStream;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::AgentError;

/// Where the agent listens: `unix:/path` or `vsock:PORT`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ListenAddr {
    Unix(PathBuf),
    Vsock(u32),
}

impl FromStr for ListenAddr {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(path) = s.strip_prefix("unix:") {
            if path.is_empty() {
                return Err("unix: needs a socket path, e.g. unix:/run/agent.sock".into());
            }
            Ok(Self::Unix(path.into()))
        } else if let Some(port) = s.strip_prefix("vsock:") {
            port.parse()
                .map(Self::Vsock)
                .map_err(|_| format!("vsock port {port:?} is not a number"))
        } else {
            Err(format!("{s:?}: expected unix:/path or vsock:PORT"))
        }
    }
}

/// A bound, listening socket, created before the tokio runtime (and before pivot_root).
pub enum BoundListener {
    Unix(std::os::unix::net::UnixListener),
    Vsock(OwnedFd),
}

impl BoundListener {
    pub fn bind(addr: &ListenAddr) -> Result<Self, AgentError> {
        match addr {
            ListenAddr::Unix(path) => {
                let _ = std::fs::remove_file(path);
                let listener = std::os::unix::net::UnixListener::bind(path).map_err(|e| {
                    AgentError::Listen(format!("bind unix socket {}: {e}", path.display()))
                })?;
                // Only the host side (root) may talk to the agent.
                std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
                    .map_err(|e| AgentError::Listen(format!("chmod {}: {e}", path.display())))?;
                listener
                    .set_nonblocking(true)
                    .map_err(|e| AgentError::Listen(format!("set nonblocking: {e}")))?;
                Ok(Self::Unix(listener))
            }
            ListenAddr::Vsock(port) => {
                let fd = socket(
                    AddressFamily::Vsock,
                    SockType::Stream,
                    SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
                    None,
                )
                .map_err(|e| {
                    AgentError::Listen(format!(
                        "create vsock socket (is virtio-vsock present?): {e}"
                    ))
                })?;
                bind(fd.as_raw_fd(), &VsockAddr::new(libc::VMADDR_CID_ANY, *port))
                    .map_err(|e| AgentError::Listen(format!("bind vsock port {port}: {e}")))?;
                listen(&fd, Backlog::new(128).unwrap_or(Backlog::MAXCONN))
                    .map_err(|e| AgentError::Listen(format!("listen on vsock port {port}: {e}")))?;
                Ok(Self::Vsock(fd))
            }
        }
    }

    /// A listening Unix socket inherited as descriptor `fd` (a container's: the edge binds
    /// it in the host's network namespace, so the sandbox's /proc/net/unix never lists it).
    pub fn inherited_unix(fd: i32) -> Result<Self, AgentError> {
        use nix::sys::socket::{getsockopt, sockopt};
        if fd < 3 {
            return Err(AgentError::Listen(format!(
                "listening descriptor {fd}: expected an inherited descriptor >= 3"
            )));
        }
        // SAFETY: the edge passed this descriptor to us and nothing else in this process
        // owns it.
        let owned = unsafe { OwnedFd::from_raw_fd(fd) };
        let listening = getsockopt(&owned, sockopt::AcceptConn)
            .map_err(|e| AgentError::Listen(format!("descriptor {fd} is not a socket: {e}")))?;
        if !listening {
            return Err(AgentError::Listen(format!(
                "descriptor {fd} is not a listening socket"
            )));
        }
        nix::fcntl::fcntl(
            &owned,
            nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
        )
        .map_err(|e| AgentError::Listen(format!("set close-on-exec on fd {fd}: {e}")))?;
        let listener = std::os::unix::net::UnixListener::from(owned);
        listener
            .set_nonblocking(true)
            .map_err(|e| AgentError::Listen(format!("set nonblocking: {e}")))?;
        Ok(Self::Unix(listener))
    }

    /// Turns the listener into a stream of accepted connections. Must run inside tokio.
    pub fn incoming(self) -> io::Result<ReceiverStream<io::Result<UnixStream>>> {
        let (tx, rx) = mpsc::channel(16);
        match self {
            Self::Unix(listener) => {
                let listener = tokio::net::UnixListener::from_std(listener)?;
                tokio::spawn(async move {
                    loop {
                        let accepted = listener.accept().await.map(|(stream, _)| stream);
                        if tx.send(accepted).await.is_err() {
                            return;
                        }
                    }
                });
            }
            Self::Vsock(fd) => {
                // SAFETY: the OwnedFd moves into the AsyncFd, so the descriptor stays open and
                // unchanged for the AsyncFd's whole lifetime.
                let listener = unsafe { AsyncFd::register(fd) }?;
                tokio::spawn(async move {
                    loop {
                        let accepted = accept_vsock(&listener).await;
                        if tx.send(accepted).await.is_err() {
                            return;
                        }
                    }
                });
            }
        }
        Ok(ReceiverStream::new(rx))
    }
}

async fn accept_vsock(listener: &AsyncFd<OwnedFd>) -> io::Result<UnixStream> {
    loop {
        let mut ready = listener.readable().await?;
        match accept4(
            listener.get_ref().as_raw_fd(),
            SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        ) {
            Ok(raw) => {
                // SAFETY: accept4 returned a fresh fd that nothing else owns.
                let fd = unsafe { OwnedFd::from_raw_fd(raw) };
                // A connected vsock stream supports the same read/write/shutdown calls as a
                // Unix stream; UnixStream is used only as the byte-stream wrapper tonic
                // already knows how to serve (its peer_addr lookups are allowed to fail).
                return UnixStream::from_std(std::os::unix::net::UnixStream::from(fd));
            }
            Err(nix::errno::Errno::EAGAIN) => ready.clear_ready(),
            Err(nix::errno::Errno::EINTR) => {}
            Err(err) => return Err(err.into()),
        }
    }
}
