//! Open TLS connections a server can close later: the apiserver closes a node's connections
//! when its certificate is revoked (the handshake check only guards new connections).

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, Waker};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_rustls::rustls::pki_types::CertificateDer;
use tokio_rustls::server::TlsStream;
use tonic::transport::server::Connected;

/// The connections [`super::accept_closable`] handed out that are still open.
#[derive(Debug, Default)]
pub struct Connections {
    open: Mutex<Vec<Weak<Conn>>>,
}

#[derive(Debug)]
struct Conn {
    /// The client's certificate (None: a token holder without one).
    peer: Option<CertificateDer<'static>>,
    closed: AtomicBool,
    /// The tasks waiting to read and to write, woken when the connection is closed.
    wakers: Mutex<[Option<Waker>; 2]>,
}

impl Conn {
    /// Registers the waiting task first, then looks at the flag: a close in between finds
    /// the waker or is seen here.
    fn closed_after_registering(&self, slot: usize, cx: &Context<'_>) -> bool {
        {
            let mut wakers = self.wakers.lock().unwrap_or_else(|e| e.into_inner());
            match &wakers[slot] {
                Some(waker) if waker.will_wake(cx.waker()) => {}
                _ => wakers[slot] = Some(cx.waker().clone()),
            }
        }
        self.closed.load(Ordering::SeqCst)
    }
}

impl Connections {
    pub fn new() -> Arc<Self> {
        Arc::new(Connections::default())
    }

    /// Starts tracking an accepted connection.
    pub fn track<S>(&self, stream: TlsStream<S>) -> Closable<TlsStream<S>> {
        let peer = stream
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|chain| chain.first())
            .map(|cert| cert.clone().into_owned());
        let conn = Arc::new(Conn {
            peer,
            closed: AtomicBool::new(false),
            wakers: Mutex::new([None, None]),
        });
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        // Forget connections that ended, so the list stays as long as what is open.
        open.retain(|c| c.strong_count() > 0);
        open.push(Arc::downgrade(&conn));
        Closable {
            inner: stream,
            conn,
        }
    }

    /// Closes every open connection whose client certificate `refused` says no to: its
    /// pending and later reads and writes fail, so the server drops it with its calls.
    /// Returns how many were closed.
    pub fn close_where(&self, refused: impl Fn(&CertificateDer<'_>) -> bool) -> usize {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        open.retain(|c| c.strong_count() > 0);
        let mut closed = 0;
        for conn in open.iter().filter_map(Weak::upgrade) {
            let Some(peer) = &conn.peer else { continue };
            if conn.closed.load(Ordering::SeqCst) || !refused(peer) {
                continue;
            }
            conn.closed.store(true, Ordering::SeqCst);
            let wakers =
                std::mem::take(&mut *conn.wakers.lock().unwrap_or_else(|e| e.into_inner()));
            wakers.into_iter().flatten().for_each(Waker::wake);
            closed += 1;
        }
        closed
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        let open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        open.iter().filter(|c| c.strong_count() > 0).count()
    }
}

/// A connection the server may close under its users (see [`Connections::close_where`]).
#[derive(Debug)]
pub struct Closable<S> {
    inner: S,
    conn: Arc<Conn>,
}

fn closed_error() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionAborted,
        "connection closed by the server: the peer's certificate was revoked",
    )
}

impl<S: AsyncRead + Unpin> AsyncRead for Closable<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.conn.closed_after_registering(0, cx) {
            return Poll::Ready(Err(closed_error()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Closable<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.conn.closed_after_registering(1, cx) {
            return Poll::Ready(Err(closed_error()));
        }
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.conn.closed.load(Ordering::SeqCst) {
            return Poll::Ready(Err(closed_error()));
        }
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl<S: Connected> Connected for Closable<S> {
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}
