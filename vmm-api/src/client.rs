//! A blocking client for a VMM's control socket: one connection per request, typed replies.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;

use crate::control::{
    decode_reply, BalloonReply, Done, ReplyError, Request, RestoreReply, RestoreRequest,
    SnapshotReply, StatusReply, MAX_REPLY,
};

/// What went wrong talking to a VMM's control socket.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("cannot connect to the VMM control socket {path}: {source}; is the VMM running?")]
    Connect {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("`{op}` on the VMM control socket {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the VMM did not answer `{op}` on {path} within {timeout:?}; it may be stuck (see its log) or the timeout too short")]
    Timeout {
        op: &'static str,
        path: PathBuf,
        timeout: Duration,
    },
    #[error("the VMM closed {path} without answering `{op}`; did it exit? (see its log)")]
    Closed { op: &'static str, path: PathBuf },
    #[error("the VMM's answer to `{op}` is longer than {MAX_REPLY} bytes or unterminated; are dsec-vmm and this program from the same build?")]
    ReplyTooLong { op: &'static str },
    #[error("the VMM refused `{op}`: {message}")]
    Refused { op: &'static str, message: String },
    #[error("`{op}`: {source}")]
    Malformed {
        op: &'static str,
        #[source]
        source: ReplyError,
    },
}

/// Talks to one VMM's control socket (`--api-sock`). Cheap to clone; every call opens its
/// own connection, so one client may be shared between threads.
#[derive(Clone, Debug)]
pub struct ControlClient {
    path: PathBuf,
    connect_timeout: Duration,
    reply_timeout: Duration,
}

/// How long a call waits for its reply by default (a snapshot of a large VM takes seconds).
pub const DEFAULT_REPLY_TIMEOUT: Duration = Duration::from_secs(60);

impl ControlClient {
    /// A client for the socket at `path`: connects at once (no waiting for the socket to
    /// appear) and waits up to [`DEFAULT_REPLY_TIMEOUT`] for each reply.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        ControlClient {
            path: path.into(),
            connect_timeout: Duration::ZERO,
            reply_timeout: DEFAULT_REPLY_TIMEOUT,
        }
    }

    /// Keep trying to connect for this long while the socket is missing or refuses (a VMM
    /// that is still starting binds it only once its VM is built).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Wait this long for each reply.
    pub fn reply_timeout(mut self, timeout: Duration) -> Self {
        self.reply_timeout = timeout;
        self
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn connect(&self) -> Result<UnixStream, ControlError> {
        let deadline = Instant::now() + self.connect_timeout;
        loop {
            match UnixStream::connect(&self.path) {
                Ok(stream) => return Ok(stream),
                Err(e)
                    if Instant::now() < deadline
                        && matches!(
                            e.kind(),
                            std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
                        ) =>
                {
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(source) => {
                    return Err(ControlError::Connect {
                        path: self.path.clone(),
                        source,
                    })
                }
            }
        }
    }

    /// Sends `request` and reads its reply as `T`.
    pub fn call<T: DeserializeOwned>(&self, request: &Request) -> Result<T, ControlError> {
        let op = request.op();
        let io = |source: std::io::Error| {
            if matches!(
                source.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) {
                ControlError::Timeout {
                    op,
                    path: self.path.clone(),
                    timeout: self.reply_timeout,
                }
            } else {
                ControlError::Io {
                    op,
                    path: self.path.clone(),
                    source,
                }
            }
        };
        let mut stream = self.connect()?;
        let timeout = Some(self.reply_timeout.max(Duration::from_millis(1)));
        stream.set_read_timeout(timeout).map_err(io)?;
        stream.set_write_timeout(timeout).map_err(io)?;
        let mut line = serde_json::to_vec(request).map_err(|e| ControlError::Io {
            op,
            path: self.path.clone(),
            source: e.into(),
        })?;
        line.push(b'\n');
        stream.write_all(&line).map_err(io)?;
        let mut reply = String::new();
        let read = BufReader::new(stream.take(MAX_REPLY + 1))
            .read_line(&mut reply)
            .map_err(io)?;
        if read == 0 {
            return Err(ControlError::Closed {
                op,
                path: self.path.clone(),
            });
        }
        if !reply.ends_with('\n') {
            return Err(ControlError::ReplyTooLong { op });
        }
        decode_reply(&reply).map_err(|e| match e {
            ReplyError::Refused(message) => ControlError::Refused { op, message },
            source => ControlError::Malformed { op, source },
        })
    }

    pub fn status(&self) -> Result<StatusReply, ControlError> {
        self.call(&Request::Status)
    }

    pub fn pause(&self) -> Result<(), ControlError> {
        self.call::<Done>(&Request::Pause).map(drop)
    }

    pub fn resume(&self) -> Result<(), ControlError> {
        self.call::<Done>(&Request::Resume).map(drop)
    }

    /// Snapshots the VM into the new directory `path` (absolute: the VMM may run elsewhere).
    pub fn snapshot(&self, path: &Path, diff: bool) -> Result<SnapshotReply, ControlError> {
        self.call(&Request::Snapshot {
            path: path.to_owned(),
            diff,
            base: None,
        })
    }

    /// Snapshots only the pages that differ from the full snapshot this restored VM maps,
    /// recording `base` as the parent (see [`Request::Snapshot`]).
    pub fn snapshot_over_base(
        &self,
        path: &Path,
        base: &Path,
    ) -> Result<SnapshotReply, ControlError> {
        self.call(&Request::Snapshot {
            path: path.to_owned(),
            diff: false,
            base: Some(base.to_owned()),
        })
    }

    /// Ends the VM; the VMM answers before it exits.
    pub fn stop(&self) -> Result<(), ControlError> {
        self.call::<Done>(&Request::Stop).map(drop)
    }

    /// Sets the balloon target (if given) and reads the balloon.
    pub fn balloon(&self, target_mib: Option<u64>) -> Result<BalloonReply, ControlError> {
        self.call(&Request::Balloon { target_mib })
    }

    /// Asks a prewarmed VMM to restore a snapshot.
    pub fn restore(&self, request: RestoreRequest) -> Result<RestoreReply, ControlError> {
        self.call(&Request::Restore(request))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::{encode_reply, MAX_REQUEST};
    use std::os::unix::net::UnixListener;

    /// A one-connection server answering with `reply(request line)`.
    fn serve(
        dir: &Path,
        reply: impl FnOnce(&str) -> Vec<u8> + Send + 'static,
    ) -> (ControlClient, std::thread::JoinHandle<()>) {
        let path = dir.join("api.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let server = std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let mut line = String::new();
            BufReader::new(stream.try_clone().unwrap().take(MAX_REQUEST))
                .read_line(&mut line)
                .unwrap();
            let mut stream = stream;
            let _ = stream.write_all(&reply(&line));
        });
        (ControlClient::new(path), server)
    }

    fn tempdir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("dsec-vmm-api-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_call_sends_one_line_and_reads_a_typed_reply() {
        let dir = tempdir("call");
        let (client, server) = serve(&dir, |line| {
            assert_eq!(
                line,
                "{\"op\":\"snapshot\",\"path\":\"/s\",\"diff\":true}\n"
            );
            encode_reply(Ok(&SnapshotReply {
                pages_written: 3,
                diff: true,
                paused_ms: 1.5,
                complete_ms: 9.0,
                ..Default::default()
            }))
        });
        let reply = client.snapshot(Path::new("/s"), true).unwrap();
        server.join().unwrap();
        assert_eq!(reply.pages_written, 3);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn refusals_silence_and_floods_are_typed_errors() {
        let dir = tempdir("errors");
        let (client, server) = serve(&dir, |_| encode_reply::<Done>(Err("not paused")));
        let err = client.resume().unwrap_err();
        server.join().unwrap();
        assert!(
            matches!(&err, ControlError::Refused { op: "resume", message } if message == "not paused"),
            "{err}"
        );
        std::fs::remove_file(dir.join("api.sock")).unwrap();

        let (client, server) = serve(&dir, |_| Vec::new());
        let err = client.status().unwrap_err();
        server.join().unwrap();
        assert!(matches!(err, ControlError::Closed { .. }), "{err}");
        std::fs::remove_file(dir.join("api.sock")).unwrap();

        let (client, server) = serve(&dir, |_| vec![b'x'; MAX_REPLY as usize + 10]);
        let err = client.status().unwrap_err();
        server.join().unwrap();
        assert!(matches!(err, ControlError::ReplyTooLong { .. }), "{err}");
        std::fs::remove_file(dir.join("api.sock")).unwrap();

        // A server that accepts but never answers.
        let path = dir.join("api.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let client = ControlClient::new(&path).reply_timeout(Duration::from_millis(50));
        let err = client.pause().unwrap_err();
        assert!(matches!(err, ControlError::Timeout { .. }), "{err}");
        drop(listener);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn connecting_waits_for_the_socket_only_when_asked() {
        let dir = tempdir("connect");
        let path = dir.join("api.sock");
        let err = ControlClient::new(&path).status().unwrap_err();
        assert!(
            matches!(&err, ControlError::Connect { .. }) && err.to_string().contains("running"),
            "{err}"
        );
        let late = {
            let path = path.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(30));
                let listener = UnixListener::bind(&path).unwrap();
                let (stream, _) = listener.accept().unwrap();
                let mut line = String::new();
                BufReader::new(stream.try_clone().unwrap())
                    .read_line(&mut line)
                    .unwrap();
                let mut stream = stream;
                stream.write_all(&encode_reply(Ok(&Done {}))).unwrap();
            })
        };
        ControlClient::new(&path)
            .connect_timeout(Duration::from_secs(5))
            .stop()
            .unwrap();
        late.join().unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
