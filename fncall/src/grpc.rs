//! The `dsec.v1.Fn` gRPC service over the engine, and the conversions between its messages
//! and engine calls (used by the node daemon and the CLI's local mode).

use std::sync::Arc;
use std::time::Duration;

use dsec_api::v1 as api;
use tonic::{Request, Response, Status};

use crate::engine::Engine;
use crate::error::FnCallError;
use crate::network::NetworkRules;
use crate::request::{CallRequest, CallResult, Language, StageResult, StageStatus};

/// A message's call, and the image it names (empty: the engine's default).
pub fn call_from_proto(message: &api::FnRunRequest) -> Result<(String, CallRequest), FnCallError> {
    let language = Language::parse(&message.language)?;
    let seconds = |what: &str, s: f64| -> Result<Duration, FnCallError> {
        if s == 0.0 {
            return Ok(Duration::from_secs(10));
        }
        if !s.is_finite() || s < 0.0 {
            return Err(FnCallError::InvalidRequest(format!(
                "{what} must be a positive number of seconds, not {s}"
            )));
        }
        Ok(Duration::from_secs_f64(s.min(1e6)))
    };
    let mut call = CallRequest::new(language, message.code.clone());
    call.stdin = message.stdin.clone();
    call.files = message.files.clone().into_iter().collect();
    call.fetch_files = message.fetch_files.clone();
    call.compile_timeout = seconds("compile_timeout", message.compile_timeout)?;
    call.run_timeout = seconds("run_timeout", message.run_timeout)?;
    if message.memory_mib != 0 {
        call.memory_mib = message.memory_mib;
    }
    call.network = match &message.network_policy {
        Some(policy) => Some(NetworkRules {
            allow_internet: policy.allow_internet,
            allow: policy.allow.clone(),
            deny: policy.deny.clone(),
        }),
        None => message.network.then(NetworkRules::default),
    };
    call.validate()?;
    Ok((message.image.clone(), call))
}

fn stage_to_proto(stage: &StageResult) -> api::FnStageResult {
    api::FnStageResult {
        status: match stage.status {
            StageStatus::Finished => api::FnStageStatus::Finished,
            StageStatus::TimeLimitExceeded => api::FnStageStatus::TimeLimitExceeded,
            StageStatus::Error => api::FnStageStatus::Error,
        } as i32,
        exit_code: stage.exit_code,
        signal: stage.signal,
        stdout: stage.stdout.clone(),
        stderr: stage.stderr.clone(),
        stdout_truncated: stage.stdout_truncated,
        stderr_truncated: stage.stderr_truncated,
        seconds: stage.duration.as_secs_f64(),
    }
}

pub fn response_to_proto(result: &CallResult) -> api::FnRunResponse {
    let success = result.success();
    api::FnRunResponse {
        compile: result.compile.as_ref().map(stage_to_proto),
        run: result.run.as_ref().map(stage_to_proto),
        files: result.files.clone().into_iter().collect(),
        file_errors: result.file_errors.clone(),
        out_of_memory: result.out_of_memory,
        total_seconds: result.total.as_secs_f64(),
        success,
    }
}

/// The gRPC status for an engine error.
pub fn status(err: &FnCallError) -> Status {
    match err {
        FnCallError::UnknownLanguage(_) | FnCallError::InvalidRequest(_) => {
            Status::invalid_argument(err.to_string())
        }
        FnCallError::MissingImage { .. }
        | FnCallError::NoCallNetwork
        | FnCallError::NoVmSupport(_) => Status::failed_precondition(err.to_string()),
        FnCallError::Busy(_) => Status::resource_exhausted(err.to_string()),
        FnCallError::WorkerStart { .. }
        | FnCallError::WorkerLost(_)
        | FnCallError::CallNetwork(_) => Status::unavailable(err.to_string()),
    }
}

/// Calls per RunBatch.
pub const MAX_BATCH: usize = 1024;

async fn run_one(
    engine: &Engine,
    message: &api::FnRunRequest,
) -> Result<api::FnRunResponse, FnCallError> {
    let (image, call) = call_from_proto(message)?;
    let image = if image.is_empty() {
        engine.config().default_image.clone()
    } else {
        image
    };
    let result = engine.run_in(&image, &call).await?;
    Ok(response_to_proto(&result))
}

#[derive(Clone, Debug)]
pub struct FnService(pub Arc<Engine>);

#[tonic::async_trait]
impl api::fn_server::Fn for FnService {
    async fn run(
        &self,
        request: Request<api::FnRunRequest>,
    ) -> Result<Response<api::FnRunResponse>, Status> {
        run_one(&self.0, request.get_ref())
            .await
            .map(Response::new)
            .map_err(|e| status(&e))
    }

    async fn run_batch(
        &self,
        request: Request<api::FnRunBatchRequest>,
    ) -> Result<Response<api::FnRunBatchResponse>, Status> {
        let calls = &request.get_ref().calls;
        if calls.len() > MAX_BATCH {
            return Err(Status::invalid_argument(format!(
                "{} calls in one batch; at most {MAX_BATCH}",
                calls.len()
            )));
        }
        let engine = &self.0;
        let answers = crate::engine::join_all(calls.iter().map(|c| run_one(engine, c))).await;
        let results = answers
            .into_iter()
            .map(|answer| api::FnRunBatchItem {
                outcome: Some(match answer {
                    Ok(response) => api::fn_run_batch_item::Outcome::Response(response),
                    Err(err) => api::fn_run_batch_item::Outcome::Error(err.to_string()),
                }),
            })
            .collect();
        Ok(Response::new(api::FnRunBatchResponse { results }))
    }
}

/// The service with message limits fit for calls (code, stdin and files up to the engine's
/// bounds).
pub fn server(engine: Arc<Engine>) -> api::fn_server::FnServer<FnService> {
    api::fn_server::FnServer::new(FnService(engine))
        .max_decoding_message_size(crate::request::MAX_INPUT_BYTES + (1 << 20))
        .max_encoding_message_size(256 << 20)
}
