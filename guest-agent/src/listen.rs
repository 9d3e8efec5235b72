//! Listening sockets: a Unix socket (container path, tests) or AF_VSOCK (in a VM).

use std::future::Future;
use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::pin::Pin;
use std::str::FromStr;
use std::task::{Context, Poll};

use nix::sys::socket::{
    accept4, bind, getsockopt, listen, socket, sockopt, AddressFamily, Backlog, SockFlag, SockType,
    VsockAddr,
};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
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
    pub fn incoming(self) -> io::Result<ReceiverStream<io::Result<AgentStream>>> {
        let (tx, rx) = mpsc::channel(16);
        match self {
            Self::Unix(listener) => {
                let listener = tokio::net::UnixListener::from_std(listener)?;
                tokio::spawn(async move {
                    loop {
                        let accepted = listener.accept().await.map(|(stream, _)| AgentStream {
                            io: stream,
                            reset: None,
                        });
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

async fn accept_vsock(listener: &AsyncFd<OwnedFd>) -> io::Result<AgentStream> {
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
                return AgentStream::ending_on_error(fd);
            }
            Err(nix::errno::Errno::EAGAIN) => ready.clear_ready(),
            Err(nix::errno::Errno::EINTR) => {}
            Err(err) => return Err(err.into()),
        }
    }
}

/// Resolves to the socket's error once it has one.
type ResetWatch = Pin<Box<dyn Future<Output = io::Error> + Send>>;

/// One accepted connection to the agent.
///
/// A restored VM's guest resets its vsock connections (the VMM's transport reset: the host
/// ends of them did not survive the snapshot). Linux then polls such a socket as error and
/// writable, never readable, and tokio wakes a reader only on read readiness: an idle
/// connection waited forever, and every pause/resume cycle left one more socket in the guest
/// (its host port then refused by the guest). A vsock connection therefore carries a second
/// registration of its socket that waits for the error alone; a read that would wait
/// returns that error instead, and the server drops the connection.
pub struct AgentStream {
    io: UnixStream,
    reset: Option<ResetWatch>,
}

impl AgentStream {
    /// A connected socket whose read ends with the socket's error even when the socket
    /// never polls readable.
    fn ending_on_error(fd: OwnedFd) -> io::Result<Self> {
        let reset = watch_reset(&fd)?;
        Ok(AgentStream {
            io: UnixStream::from_std(std::os::unix::net::UnixStream::from(fd))?,
            reset: Some(reset),
        })
    }
}

/// Watches a duplicate of `fd` for a socket error (a separate epoll registration: the stream
/// itself keeps its own).
fn watch_reset(fd: &OwnedFd) -> io::Result<ResetWatch> {
    let dup = fd.try_clone()?;
    // SAFETY: the duplicate OwnedFd moves into the AsyncFd, so the descriptor stays open and
    // unchanged for the AsyncFd's whole lifetime.
    let watched = unsafe { AsyncFd::register_with_interest(dup, Interest::ERROR) }?;
    Ok(Box::pin(async move {
        loop {
            let mut guard = match watched.ready(Interest::ERROR).await {
                Ok(guard) => guard,
                Err(err) => return err,
            };
            let error = getsockopt(&watched.get_ref().as_fd(), sockopt::SocketError);
            match error {
                Ok(0) => guard.clear_ready(),
                Ok(code) => return io::Error::from_raw_os_error(code),
                Err(errno) => return errno.into(),
            }
        }
    }))
}

impl AsyncRead for AgentStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Pending => {}
            done => return done,
        }
        match this.reset.as_mut().map(|reset| reset.as_mut().poll(cx)) {
            Some(Poll::Ready(err)) => {
                this.reset = None;
                Poll::Ready(Err(err))
            }
            _ => Poll::Pending,
        }
    }
}

impl AsyncWrite for AgentStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for AgentStream {
    type ConnectInfo = ();

    fn connect_info(&self) -> Self::ConnectInfo {}
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::AsyncReadExt;

    use super::*;

    /// A socket that polls as error + writable and never readable, as a guest's vsock
    /// connection does after a transport reset: here a connected UDP socket whose datagram
    /// met a closed port (ICMP port unreachable). A read on it must end with the error;
    /// without the second registration it waits forever.
    #[tokio::test]
    async fn a_read_ends_on_an_error_that_never_polls_readable() {
        let closed = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let closed_addr = closed.local_addr().unwrap();
        drop(closed);
        let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        socket.connect(closed_addr).unwrap();
        socket.set_nonblocking(true).unwrap();
        let fd = OwnedFd::from(socket);
        let sender = fd.try_clone().unwrap();
        let mut stream = AgentStream::ending_on_error(fd).unwrap();
        let read = tokio::spawn(async move {
            let mut buf = [0u8; 16];
            stream.read(&mut buf).await
        });
        // Let the read wait first, then provoke the error.
        tokio::time::sleep(Duration::from_millis(50)).await;
        nix::unistd::write(&sender, b"x").unwrap();
        let result = tokio::time::timeout(Duration::from_secs(5), read)
            .await
            .expect("the read did not end on the socket's error")
            .unwrap();
        let err = result.expect_err("a read on a socket with an error must fail");
        assert_eq!(err.raw_os_error(), Some(libc::ECONNREFUSED), "{err}");
    }
}
