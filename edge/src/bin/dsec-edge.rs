//! `dsec-edge`: the DSec node daemon (same as `dsec up`).

use clap::Parser;

#[derive(Parser, Debug)]
#[command(
    name = "dsec-edge",
    version,
    about = "DSec node daemon: serves the dsec.v1 API and supervises sandboxes"
)]
struct Cli {
    #[command(flatten)]
    daemon: dsec_edge::daemon::DaemonArgs,
}

fn main() -> std::process::ExitCode {
    dsec_edge::daemon::main_with(Cli::parse().daemon)
}
