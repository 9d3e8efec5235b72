//! `dsec net`: sandbox network policies.

use dsec_sdk::{Client, NetworkPolicy};
use serde_json::json;

use crate::node::{emit, NodeError};

/// A policy as the command line gives it.
#[derive(clap::Args, Debug)]
pub struct PolicyArgs {
    /// Allowed: `[tcp:|udp:|icmp:]CIDR[:PORT[-PORT]]` rules, `[tcp:|udp:]NAME[:PORT[-PORT]]`
    /// domain rules (NAME or `*.suffix`) and names of the node's policies (`dsec up
    /// --policies FILE`), e.g. `tcp:10.1.0.0/16:443 tcp:pypi.org:443 pypi-mirror`.
    #[arg(value_name = "RULE|NAME")]
    allow: Vec<String>,
    /// Denied (wins over allowed), same forms; repeatable.
    #[arg(long, value_name = "RULE|NAME")]
    deny: Vec<String>,
    /// Allow every destination (deny rules still win).
    #[arg(long)]
    internet: bool,
}

/// A new sandbox's policy (`dsec create` / `dsec restore`): nothing given reaches nothing.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct CreatePolicyArgs {
    /// Allowed: a `[tcp:|udp:|icmp:]CIDR[:PORT[-PORT]]` rule, a `[tcp:|udp:]NAME[:PORT[-PORT]]`
    /// domain rule or the name of a node policy (`dsec up --policies FILE`); repeatable.
    #[arg(long = "allow", value_name = "RULE|NAME")]
    allow: Vec<String>,
    /// Denied (wins over allowed), same forms; repeatable.
    #[arg(long = "deny", value_name = "RULE|NAME")]
    deny: Vec<String>,
    /// Allow every destination (deny rules still win).
    #[arg(long = "internet")]
    internet: bool,
}

impl CreatePolicyArgs {
    /// The request's policy; None when nothing was given.
    pub fn policy(&self) -> Option<NetworkPolicy> {
        (self.internet || !self.allow.is_empty() || !self.deny.is_empty()).then(|| NetworkPolicy {
            allow_internet: self.internet,
            allow: self.allow.clone(),
            deny: self.deny.clone(),
        })
    }

    /// The policy with `names` (node policies) allowed too; None when nothing was given.
    pub fn with_allowed(mut self, names: Vec<String>) -> Option<NetworkPolicy> {
        self.allow.extend(names);
        self.policy()
    }
}

impl From<PolicyArgs> for NetworkPolicy {
    fn from(p: PolicyArgs) -> Self {
        NetworkPolicy {
            allow_internet: p.internet,
            allow: p.allow,
            deny: p.deny,
        }
    }
}

#[derive(clap::Subcommand, Debug)]
pub enum NetCommand {
    /// Replace a running sandbox's network policy (nothing given: it reaches nothing). Takes
    /// effect for new connections at once and cuts open connections it denies.
    Set {
        id: String,
        #[command(flatten)]
        policy: PolicyArgs,
    },
    /// Replace the network policy of every sandbox with all the given labels (one change
    /// per sandbox; sandboxes created meanwhile are not covered).
    SetByLabel {
        #[arg(long = "label", short = 'l', value_name = "K=V", required = true)]
        labels: Vec<String>,
        #[command(flatten)]
        policy: PolicyArgs,
    },
}

fn policy_line(sandbox: &dsec_sdk::Sandbox) -> String {
    let network = sandbox.network.clone().unwrap_or_default();
    let list = |l: &[String]| {
        if l.is_empty() {
            "nothing".to_string()
        } else {
            l.join(" ")
        }
    };
    format!(
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
}

fn policy_json(sandbox: &dsec_sdk::Sandbox) -> serde_json::Value {
    let network = sandbox.network.clone().unwrap_or_default();
    json!({"id": sandbox.id, "allow_internet": network.allow_internet,
           "allow": network.allow, "deny": network.deny})
}

pub async fn run(c: &Client, command: NetCommand, json_out: bool) -> Result<(), NodeError> {
    match command {
        NetCommand::Set { id, policy } => {
            let sandbox = c.set_network_policy(&id, policy.into()).await?;
            emit(json_out, policy_json(&sandbox), || {
                println!("{}", policy_line(&sandbox))
            });
            Ok(())
        }
        NetCommand::SetByLabel { labels, policy } => {
            let changed = c
                .set_network_policy_by_labels(crate::node::parse_labels(&labels)?, policy.into())
                .await?;
            emit(
                json_out,
                json!(changed.iter().map(policy_json).collect::<Vec<_>>()),
                || {
                    for sandbox in &changed {
                        println!("{}", policy_line(sandbox));
                    }
                    if changed.is_empty() {
                        println!("no sandbox has those labels");
                    }
                },
            );
            Ok(())
        }
    }
}
