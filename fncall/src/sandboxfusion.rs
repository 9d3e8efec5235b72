//! SandboxFusion's HTTP API over the engine: `POST /run_code` with its request and response
//! shapes and status rules, `GET /v1/ping`. Plain HTTP/1.1 with keep-alive.
//!
//! Status rules: `Success` when every stage finished with exit code 0; `Failed` when a stage
//! ended otherwise (non-zero exit, signal, time limit); `SandboxError` when the call could
//! not be run at all (bad request, unknown language, no worker), with `message` saying why.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use serde::{Deserialize, Serialize};

use crate::engine::Engine;
use crate::error::FnCallError;
use crate::network::NetworkRules;
use crate::request::{CallRequest, CallResult, Language, StageResult, StageStatus};

/// Largest request body accepted (base64 files included).
const MAX_BODY: usize = crate::request::MAX_INPUT_BYTES * 3 / 2;

/// SandboxFusion's `RunCodeRequest`, plus `memory_limit_MB`, `network`, `network_policy` and
/// `image` (ours; SandboxFusion's own client never sends them and ignores what it does not know).
#[derive(Debug, Deserialize)]
pub struct RunCodeRequest {
    pub code: String,
    pub language: String,
    #[serde(default = "ten")]
    pub compile_timeout: f64,
    #[serde(default = "ten")]
    pub run_timeout: f64,
    #[serde(default)]
    pub stdin: Option<String>,
    /// Path -> base64 content (None: an empty file).
    #[serde(default)]
    pub files: BTreeMap<String, Option<String>>,
    #[serde(default)]
    pub fetch_files: Vec<String>,
    #[serde(default, rename = "memory_limit_MB")]
    pub memory_limit_mb: Option<u32>,
    #[serde(default)]
    pub network: bool,
    /// What a networked call may reach (implies `network`), as the gRPC API's:
    /// `{"allow_internet": bool, "allow": [RULE|NAME...], "deny": [...]}`.
    #[serde(default)]
    pub network_policy: Option<NetworkRules>,
    /// The FnCall image to run in (as `Fn.Run`'s `image`): a VM image such as `fncall-vm`
    /// runs the call in a microVM of its own. None: the engine's default image.
    #[serde(default)]
    pub image: Option<String>,
}

fn ten() -> f64 {
    10.0
}

#[derive(Debug, Serialize)]
pub struct CommandRunResult {
    pub status: &'static str,
    pub execution_time: Option<f64>,
    pub cpu_time: Option<f64>,
    pub return_code: Option<i32>,
    pub stdout: Option<String>,
    pub stderr: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct RunCodeResponse {
    pub status: &'static str,
    pub message: String,
    pub compile_result: Option<CommandRunResult>,
    pub run_result: Option<CommandRunResult>,
    pub executor_pod_name: Option<String>,
    pub files: BTreeMap<String, String>,
}

fn seconds(what: &str, value: f64) -> Result<Duration, FnCallError> {
    if !value.is_finite() || value <= 0.0 {
        return Err(FnCallError::InvalidRequest(format!(
            "{what} must be a positive number of seconds, not {value}"
        )));
    }
    Ok(Duration::from_secs_f64(value.min(1e6)))
}

impl RunCodeRequest {
    pub fn to_call(&self) -> Result<CallRequest, FnCallError> {
        let language = Language::parse(&self.language)?;
        let b64 = base64::engine::general_purpose::STANDARD;
        let mut call = CallRequest::new(language, self.code.clone());
        call.compile_timeout = seconds("compile_timeout", self.compile_timeout)?;
        call.run_timeout = seconds("run_timeout", self.run_timeout)?;
        call.stdin = self.stdin.clone().unwrap_or_default().into_bytes();
        for (name, content) in &self.files {
            let data = match content {
                Some(text) => b64.decode(text).map_err(|e| {
                    FnCallError::InvalidRequest(format!("file {name:?} is not valid base64: {e}"))
                })?,
                None => Vec::new(),
            };
            call.files.insert(name.clone(), data);
        }
        call.fetch_files = self.fetch_files.clone();
        if let Some(mib) = self.memory_limit_mb {
            call.memory_mib = mib;
        }
        call.network = self
            .network_policy
            .clone()
            .or_else(|| self.network.then(NetworkRules::default));
        Ok(call)
    }
}

fn stage(result: &StageResult) -> CommandRunResult {
    let text = |bytes: &[u8]| Some(String::from_utf8_lossy(bytes).into_owned());
    CommandRunResult {
        status: result.status.as_str(),
        execution_time: Some(result.duration.as_secs_f64()),
        cpu_time: None,
        return_code: match result.status {
            StageStatus::Finished => result.return_code(),
            _ => None,
        },
        stdout: text(&result.stdout),
        stderr: text(&result.stderr),
    }
}

/// The SandboxFusion answer for an engine result.
pub fn response(result: Result<CallResult, FnCallError>) -> RunCodeResponse {
    match result {
        Ok(result) => {
            let success = result.success();
            let mut message = String::new();
            if result.out_of_memory {
                message = "killed: over the memory limit".into();
            }
            if !result.file_errors.is_empty() {
                if !message.is_empty() {
                    message.push_str("; ");
                }
                message.push_str(&format!(
                    "files not fetched: {}",
                    result.file_errors.join(", ")
                ));
            }
            let b64 = base64::engine::general_purpose::STANDARD;
            RunCodeResponse {
                status: if success { "Success" } else { "Failed" },
                message,
                compile_result: result.compile.as_ref().map(stage),
                run_result: result.run.as_ref().map(stage),
                executor_pod_name: None,
                files: result
                    .files
                    .iter()
                    .map(|(k, v)| (k.clone(), b64.encode(v)))
                    .collect(),
            }
        }
        Err(err) => RunCodeResponse {
            status: "SandboxError",
            message: err.to_string(),
            compile_result: None,
            run_result: None,
            executor_pod_name: None,
            files: BTreeMap::new(),
        },
    }
}

/// Handles one SandboxFusion request body: never an HTTP error for a bad call, a
/// `SandboxError` naming what is wrong (as SandboxFusion's client expects).
pub async fn run_code(engine: &Engine, body: &[u8]) -> RunCodeResponse {
    let parsed: Result<RunCodeRequest, _> = serde_json::from_slice(body);
    let call = match parsed {
        Ok(request) => request.to_call().map(|call| (request.image, call)),
        Err(e) => Err(FnCallError::InvalidRequest(format!("request body: {e}"))),
    };
    match call {
        Ok((Some(image), call)) => response(engine.run_in(&image, &call).await),
        Ok((None, call)) => response(engine.run(&call).await),
        Err(err) => response(Err(err)),
    }
}

fn json_response(status: StatusCode, body: Vec<u8>) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .expect("a static response")
}

/// Routes one HTTP request; `None` for paths that are not ours.
pub async fn handle(engine: &Engine, request: Request<Incoming>) -> Response<Full<Bytes>> {
    match (request.method(), request.uri().path()) {
        (&Method::GET, "/v1/ping") | (&Method::GET, "/ping") => {
            json_response(StatusCode::OK, b"\"pong\"".to_vec())
        }
        (&Method::POST, "/run_code") => {
            let body = match Limited::new(request.into_body(), MAX_BODY).collect().await {
                Ok(body) => body.to_bytes(),
                Err(e) => {
                    let msg = serde_json::json!({"detail": format!("request body: {e} (at most {MAX_BODY} bytes)")});
                    return json_response(
                        StatusCode::PAYLOAD_TOO_LARGE,
                        msg.to_string().into_bytes(),
                    );
                }
            };
            let answer = run_code(engine, &body).await;
            json_response(
                StatusCode::OK,
                serde_json::to_vec(&answer).expect("responses serialize"),
            )
        }
        (_, path) => {
            let msg = serde_json::json!({"detail": format!("no route {path}: POST /run_code or GET /v1/ping")});
            json_response(StatusCode::NOT_FOUND, msg.to_string().into_bytes())
        }
    }
}

/// Serves the API on `listener` until the task is dropped.
pub async fn serve(listener: tokio::net::TcpListener, engine: Arc<Engine>) -> std::io::Result<()> {
    loop {
        let (stream, peer) = listener.accept().await?;
        let _ = stream.set_nodelay(true);
        serve_connection(stream, peer, Arc::clone(&engine));
    }
}

/// Serves one accepted connection in its own task.
pub fn serve_connection<S>(stream: S, peer: SocketAddr, engine: Arc<Engine>)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    tokio::spawn(async move {
        let service = hyper::service::service_fn(move |request| {
            let engine = Arc::clone(&engine);
            async move { Ok::<_, Infallible>(handle(&engine, request).await) }
        });
        let io = hyper_util::rt::TokioIo::new(stream);
        if let Err(err) = hyper::server::conn::http1::Builder::new()
            .keep_alive(true)
            .serve_connection(io, service)
            .await
        {
            tracing::debug!(%peer, %err, "SandboxFusion connection ended");
        }
    });
}

/// Whether an HTTP request head asks for one of this API's paths.
pub fn is_api_request(head: &[u8]) -> bool {
    let line = head.split(|&b| b == b'\n').next().unwrap_or_default();
    let mut parts = line.split(|&b| b == b' ');
    let (_method, path) = (parts.next(), parts.next().unwrap_or_default());
    let path = path.split(|&b| b == b'?').next().unwrap_or_default();
    matches!(path, b"/run_code" | b"/v1/ping" | b"/ping")
}

/// A stream whose first bytes were already read (a request head a router looked at):
/// they are read again first.
pub struct Replay<S> {
    prefix: Bytes,
    inner: S,
}

impl<S> Replay<S> {
    pub fn new(prefix: Vec<u8>, inner: S) -> Self {
        Self {
            prefix: Bytes::from(prefix),
            inner,
        }
    }
}

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Replay<S> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        if !self.prefix.is_empty() {
            let n = self.prefix.len().min(buf.remaining());
            let head = self.prefix.split_to(n);
            buf.put_slice(&head);
            return std::task::Poll::Ready(Ok(()));
        }
        std::pin::Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Replay<S> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        data: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.inner).poll_write(cx, data)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn network_fields_become_the_calls_rules() {
        let parse = |json: &str| {
            serde_json::from_str::<RunCodeRequest>(json)
                .map_err(|e| e.to_string())
                .and_then(|r| r.to_call().map_err(|e| e.to_string()))
                .map(|c| c.network)
        };
        let base = r#""code": "print(1)", "language": "python""#;
        assert_eq!(parse(&format!("{{{base}}}")).unwrap(), None);
        assert_eq!(
            parse(&format!(r#"{{{base}, "network": true}}"#)).unwrap(),
            Some(NetworkRules::default())
        );
        let rules = parse(&format!(
            r#"{{{base}, "network_policy": {{"allow": ["tcp:198.18.0.1:80"]}}}}"#
        ))
        .unwrap()
        .unwrap();
        assert_eq!(rules.allow, ["tcp:198.18.0.1:80"]);
        assert!(!rules.allow_internet && rules.deny.is_empty());
        assert!(parse(&format!(r#"{{{base}, "network_policy": {{"alow": []}}}}"#)).is_err());
    }

    #[test]
    fn api_paths_are_recognised() {
        assert!(is_api_request(
            b"POST /run_code HTTP/1.1\r\nHost: x\r\n\r\n"
        ));
        assert!(is_api_request(b"GET /v1/ping?x=1 HTTP/1.1\r\n\r\n"));
        assert!(!is_api_request(b"GET /run_codes HTTP/1.1\r\n\r\n"));
        assert!(!is_api_request(b"GET / HTTP/1.1\r\n\r\n"));
    }

    #[test]
    fn status_rules() {
        let finished = |code| StageResult {
            status: StageStatus::Finished,
            exit_code: Some(code),
            signal: None,
            stdout: b"out".to_vec(),
            stderr: Vec::new(),
            stdout_truncated: false,
            stderr_truncated: false,
            duration: Duration::from_millis(3),
        };
        let ok = CallResult {
            run: Some(finished(0)),
            ..CallResult::default()
        };
        assert_eq!(response(Ok(ok)).status, "Success");
        let failed = CallResult {
            run: Some(finished(1)),
            ..CallResult::default()
        };
        let answer = response(Ok(failed));
        assert_eq!(answer.status, "Failed");
        assert_eq!(answer.run_result.unwrap().return_code, Some(1));
        let compile_failed = CallResult {
            compile: Some(finished(1)),
            ..CallResult::default()
        };
        assert_eq!(response(Ok(compile_failed)).status, "Failed");
        let bad = response(Err(FnCallError::UnknownLanguage("cobol".into())));
        assert_eq!(bad.status, "SandboxError");
        assert!(bad.message.contains("cobol"));
    }
}
