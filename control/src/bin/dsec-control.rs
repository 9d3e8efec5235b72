//! `dsec-control`: the apiserver of a DSec cluster (see control/README.md).

use clap::Parser;

#[derive(Parser, Debug)]
#[command(name = "dsec-control", version, about = "DSec control plane apiserver")]
struct Cli {
    #[command(subcommand)]
    command: dsec_control::command::ControlCommand,
}

fn main() -> std::process::ExitCode {
    dsec_control::command::run(Cli::parse().command)
}
