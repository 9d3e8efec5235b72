//! `dsec fn`: one-shot code execution (FnCall) on the node, or in this process (`--local`,
//! `serve`).

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use dsec_api::v1::{FnRunRequest, FnRunResponse, FnStageResult, FnStageStatus};
use dsec_fncall::{Engine, EngineConfig, Language};
use serde_json::json;

#[derive(clap::Subcommand, Debug)]
pub enum FnCommand {
    /// Run code once in a fresh isolated process from a warm worker: `-c CODE --lang L`, or
    /// a file (language from its extension: .py .sh .cpp .js). Exits with the code's exit
    /// status (124 on a time limit; the compiler's status when compilation fails).
    Run {
        /// Source file (or use -c).
        file: Option<PathBuf>,
        /// The code itself.
        #[arg(short = 'c', long = "code", conflicts_with = "file")]
        code: Option<String>,
        /// python, bash, cpp or node (default: from the file's extension, else python).
        #[arg(long)]
        lang: Option<String>,
        /// File whose content is the code's stdin.
        #[arg(long, value_name = "PATH")]
        stdin_file: Option<PathBuf>,
        /// Run time limit in seconds.
        #[arg(long, default_value_t = 10.0)]
        timeout: f64,
        /// Compile time limit in seconds (C++).
        #[arg(long, default_value_t = 10.0)]
        compile_timeout: f64,
        /// Memory limit in MiB.
        #[arg(long, default_value_t = 512)]
        mem: u32,
        /// Run on the node's sandbox network (`dsec up --net-bridge`) reaching nothing but
        /// what --allow/--policy/--internet give (default: loopback only).
        #[arg(long)]
        network: bool,
        /// What a networked call may reach (implies --network): --allow RULE|NAME, --deny
        /// RULE|NAME, --internet, as for `dsec create`.
        #[command(flatten)]
        policy: crate::net::CreatePolicyArgs,
        /// A node policy (`dsec up --policies FILE`) the call may reach (implies --network);
        /// repeatable, the same as --allow NAME.
        #[arg(long = "policy", value_name = "NAME")]
        policies: Vec<String>,
        /// Image to run in (default: the node's, `fncall`); a VM FnCall image
        /// (images/fncall-vm) runs the call in a microVM restored for it.
        #[arg(long)]
        image: Option<String>,
        /// Run in this process (root; the image under $DSEC_HOME/images) instead of the node.
        #[arg(long)]
        local: bool,
    },
    /// Serve SandboxFusion's API (`POST /run_code`, `GET /v1/ping`) from workers in this
    /// process.
    Serve {
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: String,
        /// Python workers kept warm.
        #[arg(long, default_value_t = 6)]
        python_workers: usize,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum FnError {
    #[error("{0}")]
    Usage(String),
    #[error(transparent)]
    Sdk(#[from] dsec_sdk::Error),
    #[error(transparent)]
    Engine(#[from] dsec_fncall::FnCallError),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> FnError {
    let what = what.into();
    move |source| FnError::Io { what, source }
}

/// A local engine over `$DSEC_HOME/images`.
fn local_engine(python_workers: usize) -> Arc<Engine> {
    let home = dsec_edge::paths::Artifacts::home();
    let artifacts = dsec_edge::paths::Artifacts::under(&home);
    let factory = dsec_edge::daemon::fncall::factory(
        &artifacts,
        &std::env::temp_dir().join("dsec-fncall-vm"),
        // Jailed as the node jails them (the local engine runs as root).
        nix::unistd::geteuid()
            .is_root()
            .then_some(dsec_fncall::vm::VmJail {
                uid: dsec_edge::backend::JAIL_UID,
                gid: dsec_edge::backend::JAIL_GID,
            }),
        dsec_fncall::vm::DEFAULT_VM_POOL_SIZE,
    );
    let mut config = EngineConfig::default();
    config
        .pool_sizes
        .insert(Language::Python, python_workers.max(1));
    Arc::new(Engine::new(config, Arc::new(factory)))
}

pub async fn run(endpoint: &str, command: FnCommand, json_out: bool) -> Result<i32, FnError> {
    match command {
        FnCommand::Run {
            file,
            code,
            lang,
            stdin_file,
            timeout,
            compile_timeout,
            mem,
            network,
            policy,
            policies,
            image,
            local,
        } => {
            let (code, language) = match (code, file) {
                (Some(code), _) => (code, lang.unwrap_or_else(|| "python".into())),
                (None, Some(file)) => {
                    let code = std::fs::read_to_string(&file)
                        .map_err(io(format!("read {}", file.display())))?;
                    let language = match lang {
                        Some(lang) => lang,
                        None => Language::from_path(&file)?.as_str().to_string(),
                    };
                    (code, language)
                }
                (None, None) => {
                    return Err(FnError::Usage(
                        "give the code with -c CODE or a source file".into(),
                    ))
                }
            };
            let stdin = match stdin_file {
                Some(path) => {
                    std::fs::read(&path).map_err(io(format!("read {}", path.display())))?
                }
                None => Vec::new(),
            };
            let request = FnRunRequest {
                language,
                code,
                stdin,
                compile_timeout,
                run_timeout: timeout,
                memory_mib: mem,
                network_policy: policy.with_allowed(policies),
                network,
                image: image.unwrap_or_default(),
                ..FnRunRequest::default()
            };
            let response = if local {
                let engine = local_engine(1);
                let (image, call) = dsec_fncall::grpc::call_from_proto(&request)?;
                let image = if image.is_empty() {
                    engine.config().default_image.clone()
                } else {
                    image
                };
                dsec_fncall::grpc::response_to_proto(&engine.run_in(&image, &call).await?)
            } else {
                dsec_sdk::Client::connect(endpoint)
                    .await?
                    .run_code(request)
                    .await?
            };
            Ok(report(&response, json_out))
        }
        FnCommand::Serve {
            listen,
            python_workers,
        } => {
            let engine = local_engine(python_workers);
            engine.prewarm(&[Language::Python]).await?;
            let listener = tokio::net::TcpListener::bind(&listen)
                .await
                .map_err(io(format!("listen on {listen}")))?;
            let bound = listener.local_addr().map_err(io("local address"))?;
            println!("SandboxFusion API on http://{bound} (POST /run_code, GET /v1/ping)");
            tokio::select! {
                served = dsec_fncall::sandboxfusion::serve(listener, engine) => {
                    served.map_err(io("accept"))?;
                }
                _ = tokio::signal::ctrl_c() => {}
            }
            Ok(0)
        }
    }
}

fn stage_json(stage: &Option<FnStageResult>) -> serde_json::Value {
    let Some(s) = stage else {
        return serde_json::Value::Null;
    };
    json!({
        "status": status_name(s),
        "exit_code": s.exit_code,
        "signal": s.signal,
        "stdout": String::from_utf8_lossy(&s.stdout),
        "stderr": String::from_utf8_lossy(&s.stderr),
        "stdout_truncated": s.stdout_truncated,
        "stderr_truncated": s.stderr_truncated,
        "seconds": s.seconds,
    })
}

fn status_name(stage: &FnStageResult) -> &'static str {
    match FnStageStatus::try_from(stage.status) {
        Ok(FnStageStatus::Finished) => "Finished",
        Ok(FnStageStatus::TimeLimitExceeded) => "TimeLimitExceeded",
        _ => "Error",
    }
}

/// Prints the result; returns the exit code of `dsec fn run`.
fn report(response: &FnRunResponse, json_out: bool) -> i32 {
    let exit = |stage: &FnStageResult| match FnStageStatus::try_from(stage.status) {
        Ok(FnStageStatus::TimeLimitExceeded) => 124,
        Ok(FnStageStatus::Finished) => stage
            .exit_code
            .or(stage.signal.map(|s| 128 + s))
            .unwrap_or(1),
        _ => 127,
    };
    let code = match (&response.compile, &response.run) {
        (_, Some(run)) => exit(run),
        (Some(compile), None) => exit(compile).max(1),
        (None, None) => 1,
    };
    if json_out {
        println!(
            "{}",
            json!({
                "success": response.success,
                "compile": stage_json(&response.compile),
                "run": stage_json(&response.run),
                "out_of_memory": response.out_of_memory,
                "file_errors": response.file_errors,
                "total_seconds": response.total_seconds,
            })
        );
        return code;
    }
    let mut out = std::io::stdout().lock();
    let mut err = std::io::stderr().lock();
    if let Some(compile) = &response.compile {
        if !compile.stdout.is_empty() || response.run.is_none() {
            let _ = out.write_all(&compile.stdout);
            let _ = err.write_all(&compile.stderr);
        }
        if response.run.is_none() {
            let _ = writeln!(
                err,
                "dsec fn: compilation {} ({:.3}s)",
                status_name(compile),
                compile.seconds
            );
        }
    }
    if let Some(run) = &response.run {
        let _ = out.write_all(&run.stdout);
        let _ = err.write_all(&run.stderr);
        if run.stdout_truncated || run.stderr_truncated {
            let _ = writeln!(err, "dsec fn: output truncated at the node's cap");
        }
        if status_name(run) == "TimeLimitExceeded" {
            let _ = writeln!(
                err,
                "dsec fn: time limit exceeded after {:.3}s",
                run.seconds
            );
        }
    }
    if response.out_of_memory {
        let _ = writeln!(err, "dsec fn: killed, over the memory limit");
    }
    let _ = out.flush();
    code
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(clap::Parser)]
    struct Fn {
        #[command(subcommand)]
        command: FnCommand,
    }

    fn policy_of(args: &[&str]) -> Option<dsec_sdk::NetworkPolicy> {
        let parsed = Fn::try_parse_from(["fn", "run", "-c", "print(1)"].iter().chain(args))
            .unwrap_or_else(|e| panic!("{args:?}: {e}"));
        let FnCommand::Run {
            policy, policies, ..
        } = parsed.command
        else {
            panic!("not a run");
        };
        policy.with_allowed(policies)
    }

    #[test]
    fn network_flags_make_the_calls_policy() {
        assert_eq!(policy_of(&[]), None);
        assert_eq!(policy_of(&["--network"]), None, "--network alone: no rules");
        let policy = policy_of(&[
            "--allow",
            "tcp:10.0.0.0/8:443",
            "--allow",
            "tcp:pypi.org:443",
            "--deny",
            "tcp:10.0.0.1:443",
            "--policy",
            "mirror",
            "--internet",
        ])
        .expect("a policy");
        assert_eq!(
            policy.allow,
            ["tcp:10.0.0.0/8:443", "tcp:pypi.org:443", "mirror"]
        );
        assert_eq!(policy.deny, ["tcp:10.0.0.1:443"]);
        assert!(policy.allow_internet);
        assert_eq!(
            policy_of(&["--policy", "mirror"]).unwrap().allow,
            ["mirror"]
        );
    }
}
