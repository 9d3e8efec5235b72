//! Control socket: a Unix socket speaking one JSON object per line. The edge drives a running
//! VMM through it.
//!
//! Requests: `{"op":"status"}`, `{"op":"pause"}`, `{"op":"resume"}`,
//! `{"op":"snapshot","path":"/dir","diff":false}` (pauses a running VM for the snapshot and
//! resumes it after), `{"op":"stop"}`, `{"op":"balloon"[,"target_mib":N]}` (sets the balloon
//! target if given; replies with target, actual size, the guest's statistics and counters). Replies: `{"ok":true,...}` or `{"ok":false,"error":"..."}`.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Deserialize;
use serde_json::{json, Value};

use crate::config::NetConfig;
use crate::vm::{Vm, VmExitReason};

/// Longest request line we read; anything longer is refused (no unbounded buffering).
const MAX_REQUEST: u64 = 64 * 1024;

#[derive(Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
enum Request {
    Status,
    Pause,
    Resume,
    Snapshot {
        path: PathBuf,
        #[serde(default)]
        diff: bool,
    },
    Stop,
    Balloon {
        #[serde(default)]
        target_mib: Option<u64>,
    },
}

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

fn handle_client(vm: &Vm, stream: UnixStream) {
    let Ok(writer) = stream.try_clone() else {
        return;
    };
    let mut writer = writer;
    let mut reader = BufReader::new(std::io::Read::take(stream, u64::MAX));
    loop {
        let mut line = String::new();
        reader.get_mut().set_limit(MAX_REQUEST);
        match reader.read_line(&mut line) {
            Ok(0) => return,
            Ok(_) if !line.ends_with('\n') => {
                let _ = reply(&mut writer, &error("request line too long or unterminated"));
                return;
            }
            Ok(_) => {}
            Err(_) => return,
        }
        let request = serde_json::from_str::<Request>(line.trim());
        if let Ok(Request::Stop) = request {
            // Answer first: the process ends as soon as the exit is requested.
            let _ = reply(&mut writer, &json!({"ok": true}));
            vm.request_exit(VmExitReason::Stopped);
            return;
        }
        let response = match request {
            Ok(request) => execute(vm, request),
            Err(e) => error(&format!("bad request: {e}")),
        };
        if reply(&mut writer, &response).is_err() {
            return;
        }
    }
}

/// `stop` is answered before it is executed (see `handle_client`); kept total for safety.
fn unreachable_stop(vm: &Vm) -> Result<Value, String> {
    vm.request_exit(VmExitReason::Stopped);
    Ok(json!({}))
}

fn reply(w: &mut UnixStream, v: &Value) -> std::io::Result<()> {
    let mut bytes = serde_json::to_vec(v).unwrap_or_default();
    bytes.push(b'\n');
    w.write_all(&bytes)
}

fn error(message: &str) -> Value {
    json!({"ok": false, "error": message})
}

fn execute(vm: &Vm, request: Request) -> Value {
    let result: Result<Value, String> = match request {
        Request::Status => Ok(json!({
            "state": if vm.is_paused() { "paused" } else { "running" },
            "vcpus": vm.config().vcpus,
            "mem_mib": vm.config().mem_mib,
            "lazy_faults": vm.lazy_stats().map(|s| s.0),
            "lazy_prefetched": vm.lazy_stats().map(|s| s.1),
        })),
        Request::Pause => vm.pause().map(|_| json!({})).map_err(|e| e.to_string()),
        Request::Resume => {
            vm.resume();
            Ok(json!({}))
        }
        Request::Snapshot { path, diff } => {
            let was_running = !vm.is_paused();
            let started = std::time::Instant::now();
            let result = vm
                .pause()
                .and_then(|_| vm.snapshot(&path, diff))
                .map(|s| {
                    json!({
                        "pages_written": s.pages_written,
                        "diff": s.diff,
                        "paused_ms": started.elapsed().as_secs_f64() * 1e3,
                    })
                })
                .map_err(|e| e.to_string());
            if was_running {
                vm.resume();
            }
            result
        }
        Request::Stop => unreachable_stop(vm),
        Request::Balloon { target_mib } => match vm.balloon() {
            None => Err("this VM has no balloon device; start it with --balloon".into()),
            Some(b) => target_mib
                .map_or(Ok(()), |mib| b.set_target_mib(mib))
                .map_err(|e| e.to_string())
                .and_then(|()| serde_json::to_value(b.status()).map_err(|e| e.to_string())),
        },
    };
    match result {
        Ok(Value::Object(mut map)) => {
            map.insert("ok".into(), Value::Bool(true));
            Value::Object(map)
        }
        Ok(other) => json!({"ok": true, "result": other}),
        Err(e) => error(&e),
    }
}

/// What a prewarmed VMM is asked to restore (`{"op":"restore",...}`).
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub struct RestoreRequest {
    pub op: String,
    pub path: PathBuf,
    #[serde(default)]
    pub vsock_uds: Option<PathBuf>,
    #[serde(default)]
    pub vsock_cid: Option<u64>,
    /// `tap=NAME[,mac=MAC]` for the snapshot's network device.
    #[serde(default)]
    pub net: Option<NetConfig>,
    #[serde(default)]
    pub lazy: bool,
    #[serde(default)]
    pub prefetch: bool,
}

/// For a prewarmed VMM: waits on the control socket for one valid `restore` request and
/// returns it with the connection to answer on. Other requests get an error reply.
pub fn accept_restore(path: &Path) -> std::io::Result<(RestoreRequest, UnixStream, UnixListener)> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let _ = std::fs::remove_file(&tmp);
    let listener = UnixListener::bind(&tmp)?;
    std::fs::rename(&tmp, path)?;
    for stream in listener.incoming().flatten() {
        let Ok(mut writer) = stream.try_clone() else {
            continue;
        };
        let mut line = String::new();
        let mut reader = BufReader::new(std::io::Read::take(stream, MAX_REQUEST));
        if reader.read_line(&mut line).is_err() {
            continue;
        }
        match serde_json::from_str::<RestoreRequest>(line.trim()) {
            Ok(request) if request.op == "restore" => {
                // The same listener serves the normal control requests once the VM exists,
                // so the socket never disappears in between.
                return Ok((request, writer, listener));
            }
            Ok(_) => {
                let _ = reply(
                    &mut writer,
                    &error("this VMM is prewarmed: send a restore first"),
                );
            }
            Err(e) => {
                let _ = reply(&mut writer, &error(&format!("bad restore request: {e}")));
            }
        }
    }
    Err(std::io::Error::other("control socket closed"))
}

/// Answers the restore request of a prewarmed VMM.
pub fn answer_restore(mut stream: UnixStream, result: Result<f64, String>) {
    let v = match result {
        Ok(ms) => json!({"ok": true, "restore_ms": ms}),
        Err(e) => error(&e),
    };
    let _ = reply(&mut stream, &v);
}
