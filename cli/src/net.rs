//! `dsec net`: sandbox network policies.

use dsec_sdk::{Client, NetworkPolicy};
use serde_json::json;

use crate::node::{emit, NodeError};

#[derive(clap::Subcommand, Debug)]
pub enum NetCommand {
    /// Replace a running sandbox's network policy (nothing given: it reaches nothing). Takes
    /// effect for new connections at once and cuts open connections it denies.
    Set {
        id: String,
        /// Allowed: `[tcp:|udp:|icmp:]CIDR[:PORT[-PORT]]` rules and names of the node's
        /// policies (`dsec up --policies FILE`), e.g. `tcp:10.1.0.0/16:443 pypi-mirror`.
        #[arg(value_name = "RULE|NAME")]
        allow: Vec<String>,
        /// Denied (wins over allowed), same forms; repeatable.
        #[arg(long, value_name = "RULE|NAME")]
        deny: Vec<String>,
        /// Allow every destination (deny rules still win).
        #[arg(long)]
        internet: bool,
    },
}

pub async fn run(c: &Client, command: NetCommand, json_out: bool) -> Result<(), NodeError> {
    match command {
        NetCommand::Set {
            id,
            allow,
            deny,
            internet,
        } => {
            let policy = NetworkPolicy {
                allow_internet: internet,
                allow,
                deny,
            };
            let sandbox = c.set_network_policy(&id, policy).await?;
            let network = sandbox.network.unwrap_or_default();
            emit(
                json_out,
                json!({"id": sandbox.id, "allow_internet": network.allow_internet,
                       "allow": network.allow, "deny": network.deny}),
                || {
                    let list = |l: &[String]| {
                        if l.is_empty() {
                            "nothing".to_string()
                        } else {
                            l.join(" ")
                        }
                    };
                    println!(
                        "{}: allow {}{}; deny {}",
                        sandbox.id,
                        list(&network.allow),
                        if network.allow_internet {
                            " + internet"
                        } else {
                            ""
                        },
                        list(&network.deny)
                    )
                },
            );
            Ok(())
        }
    }
}
