//! Control socket: a Unix socket speaking one JSON object per line; the edge drives a running
//! VMM through it. The requests and replies are the contract crate's
//! ([`dsec_vmm_api::control`]); this file serves them.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use dsec_vmm_api::control::{
    encode_reply, BalloonReply, Done, Request, RestoreReply, RestoreRequest, RunState,
    SnapshotReply, StatusReply, MAX_REQUEST,
};

use crate::vm::{SnapshotPages, Vm, VmExitReason};

/// Binds and listens on the control socket; [`serve_on`] starts answering it. Bound before a
/// jailed VMM drops its privileges: the socket's directory need not be writable by the
/// jail's uid.
pub fn bind(path: &Path) -> std::io::Result<UnixListener> {
    // Bind under a temporary name and rename: clients that wait for the path to appear
    // must never find a socket that is not listening yet.
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let _ = std::fs::remove_file(&tmp);
    let listener = UnixListener::bind(&tmp).map_err(|e| {
        std::io::Error::new(
            e.kind(),
            format!("bind control socket {}: {e}", path.display()),
        )
    })?;
    std::fs::rename(&tmp, path)?;
    Ok(listener)
}

/// Serves an already-bound control socket on a background thread.
pub fn serve_on(vm: Arc<Vm>, listener: UnixListener) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("control".into())
        .spawn(move || {
            crate::seccomp::install_or_exit(crate::seccomp::ThreadKind::Vmm);
            for stream in listener.incoming().flatten() {
                // One client at a time: requests are short and must not interleave.
                handle_client(&vm, stream);
            }
        })?;
    Ok(())
}

/// One request line, or why there is none (the connection ends after answering that).
enum Incoming {
    Request(Request),
    Bad(String),
    /// Longer than [`MAX_REQUEST`] or cut off: the rest of the stream cannot be trusted.
    Overlong,
    Closed,
}

fn read_request(reader: &mut BufReader<std::io::Take<UnixStream>>) -> Incoming {
    let mut line = String::new();
    reader.get_mut().set_limit(MAX_REQUEST);
    match reader.read_line(&mut line) {
        Ok(0) | Err(_) => Incoming::Closed,
        Ok(_) if !line.ends_with('\n') => Incoming::Overlong,
        Ok(_) => match serde_json::from_str::<Request>(line.trim()) {
            Ok(request) => Incoming::Request(request),
            Err(e) => Incoming::Bad(format!("bad request: {e}")),
        },
    }
}

const OVERLONG: &str = "request line too long or unterminated";

fn refusal(message: &str) -> Vec<u8> {
    encode_reply::<Done>(Err(message))
}

fn handle_client(vm: &Vm, stream: UnixStream) {
    let Ok(mut writer) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(std::io::Read::take(stream, MAX_REQUEST));
    loop {
        let response = match read_request(&mut reader) {
            Incoming::Closed => return,
            Incoming::Overlong => {
                let _ = writer.write_all(&refusal(OVERLONG));
                return;
            }
            Incoming::Bad(message) => {
                let _ = writer.write_all(&refusal(&message));
                continue;
            }
            Incoming::Request(Request::Stop) => {
                // Answer first: the process ends as soon as the exit is requested.
                let _ = writer.write_all(&encode_reply(Ok(&Done {})));
                vm.request_exit(VmExitReason::Stopped);
                return;
            }
            Incoming::Request(request) => execute(vm, request),
        };
        if writer.write_all(&response).is_err() {
            return;
        }
    }
}

/// The reply line of an op's outcome.
fn reply<T: serde::Serialize, E: std::fmt::Display>(result: Result<T, E>) -> Vec<u8> {
    match result {
        Ok(body) => encode_reply(Ok(&body)),
        Err(e) => refusal(&e.to_string()),
    }
}

fn execute(vm: &Vm, request: Request) -> Vec<u8> {
    match request {
        Request::Status => {
            let lazy = vm.lazy_stats();
            encode_reply(Ok(&StatusReply {
                state: if vm.is_paused() {
                    RunState::Paused
                } else {
                    RunState::Running
                },
                vcpus: vm.config().vcpus,
                mem_mib: vm.config().mem_mib,
                lazy_faults: lazy.map(|s| s.0),
                lazy_prefetched: lazy.map(|s| s.1),
                kvm_vcpu_stats: vm.kvm_vcpu_stats(),
            }))
        }
        Request::Pause => reply(vm.pause().map(|_| Done {})),
        Request::Resume => {
            vm.resume();
            encode_reply(Ok(&Done {}))
        }
        Request::Snapshot { path, diff, base } => {
            let pages =
                match (diff, base) {
                    (true, Some(_)) => return refusal(
                        "a snapshot is either a diff (`diff`) or over the base (`base`), not both",
                    ),
                    (true, None) => SnapshotPages::Diff,
                    (false, Some(base)) => SnapshotPages::OverBase(base),
                    (false, None) => SnapshotPages::Full,
                };
            if vm.is_paused() {
                // The guest stands still throughout anyway: write everything in place.
                let started = std::time::Instant::now();
                reply(vm.snapshot(&path, &pages).map(|s| {
                    let ms = started.elapsed().as_secs_f64() * 1e3;
                    SnapshotReply {
                        pages_written: s.pages_written,
                        diff: s.diff,
                        paused_ms: ms,
                        complete_ms: ms,
                        final_pages: s.pages_written,
                        ..Default::default()
                    }
                }))
            } else {
                reply(vm.snapshot_live(&path, &pages).map(|s| SnapshotReply {
                    pages_written: s.summary.pages_written,
                    diff: s.summary.diff,
                    paused_ms: s.paused.as_secs_f64() * 1e3,
                    complete_ms: s.complete.as_secs_f64() * 1e3,
                    memory_mode: s.mode,
                    pause_steps: s.steps,
                    precopy_rounds: s.precopy_rounds,
                    final_pages: s.final_pages,
                }))
            }
        }
        Request::Stop => {
            // Answered before it is executed (see `handle_client`); kept total for safety.
            vm.request_exit(VmExitReason::Stopped);
            encode_reply(Ok(&Done {}))
        }
        Request::Balloon { target_mib } => {
            match vm.balloon() {
                None => refusal("this VM has no balloon device; start it with --balloon"),
                Some(b) => reply(target_mib.map_or(Ok(()), |mib| b.set_target_mib(mib)).map(
                    |()| {
                        let s = b.status();
                        BalloonReply {
                            target_mib: s.target_mib,
                            target_pages: s.target_pages,
                            actual_mib: s.actual_mib,
                            actual_pages: s.actual_pages,
                            stats: s.stats,
                            stats_age_ms: s.stats_age_ms,
                            inflated_pages: s.counters.inflated_pages,
                            deflated_pages: s.counters.deflated_pages,
                            reported_bytes: s.counters.reported_bytes,
                            bad_pfns: s.counters.bad_pfns,
                            bad_chains: s.counters.bad_chains,
                        }
                    },
                )),
            }
        }
        Request::Restore(_) => {
            refusal("this VMM already runs a VM; `restore` is only for a --prewarm VMM")
        }
    }
}

/// For a prewarmed VMM: waits on the control socket for one valid `restore` request and
/// returns it with the connection to answer on. Other requests get an error reply.
pub fn accept_restore(path: &Path) -> std::io::Result<(RestoreRequest, UnixStream, UnixListener)> {
    let listener = bind(path)?;
    for stream in listener.incoming().flatten() {
        let Ok(mut writer) = stream.try_clone() else {
            continue;
        };
        let mut reader = BufReader::new(std::io::Read::take(stream, MAX_REQUEST));
        match read_request(&mut reader) {
            // The same listener serves the normal control requests once the VM exists, so
            // the socket never disappears in between.
            Incoming::Request(Request::Restore(request)) => return Ok((request, writer, listener)),
            Incoming::Request(_) => {
                let _ = writer.write_all(&refusal("this VMM is prewarmed: send a restore first"));
            }
            Incoming::Bad(message) => {
                let _ = writer.write_all(&refusal(&message));
            }
            Incoming::Overlong => {
                let _ = writer.write_all(&refusal(OVERLONG));
            }
            Incoming::Closed => {}
        }
    }
    Err(std::io::Error::other("control socket closed"))
}

/// Answers the restore request of a prewarmed VMM.
pub fn answer_restore<E: std::fmt::Display>(
    mut stream: UnixStream,
    result: Result<RestoreReply, E>,
) {
    let _ = stream.write_all(&reply(result));
}
