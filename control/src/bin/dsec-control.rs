//! `dsec-control`: the apiserver of a DSec cluster (see control/README.md).

use clap::Parser;

/// Many small short-lived allocations per call (requests, headers, records): mimalloc's
/// per-thread free lists cost less CPU here than glibc malloc (perf/README.md "cluster").
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser, Debug)]
#[command(name = "dsec-control", version, about = "DSec control plane apiserver")]
struct Cli {
    #[command(subcommand)]
    command: dsec_control::command::ControlCommand,
}

fn main() -> std::process::ExitCode {
    dsec_control::command::run(Cli::parse().command)
}
