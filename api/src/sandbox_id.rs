//! Sandbox ids that name their node: `sb-<node>-<12 random base32>`, e.g. `sb-n042-k3x9q2m7ab4c`.
//! Runtime calls (exec, files, ports, …) find the node from the id alone, so the apiserver
//! keeps no per-sandbox routing state.
//!
//! Bounds: node names are 1 to 8 of `a-z 0-9 -`, not starting or ending with `-`; the random
//! part is 12 of `a-z 2-7` (60 bits). An id is at most 24 characters, so that the node's HTTP
//! entry point label `PORT-ID-TOKEN` (5-digit port, 32-hex access token) still fits the DNS
//! limit of 63 characters per label.

use std::fmt;
use std::str::FromStr;

pub const MAX_NODE_NAME: usize = 8;
const RANDOM_LEN: usize = 12;
const PREFIX: &str = "sb-";
pub const MAX_ID_LEN: usize = PREFIX.len() + MAX_NODE_NAME + 1 + RANDOM_LEN;
const BASE32: &[u8; 32] = b"abcdefghijklmnopqrstuvwxyz234567";

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IdError {
    #[error("{0:?} is not a sandbox id: expected sb-<node>-<12 of a-z2-7>, at most {MAX_ID_LEN} characters")]
    Malformed(String),
    #[error("{0:?} is not a valid node name: 1-{MAX_NODE_NAME} of a-z, 0-9 and '-', not starting or ending with '-'")]
    BadNodeName(String),
}

impl IdError {
    pub fn code(&self) -> tonic::Code {
        tonic::Code::InvalidArgument
    }
}

/// 1 to 8 of `a-z 0-9 -`, not starting or ending with `-` (a project path segment that is
/// short enough).
pub fn valid_node_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NODE_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-')
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SandboxId(String);

impl SandboxId {
    /// A fresh id on `node`.
    pub fn new(node: &str) -> Result<Self, IdError> {
        if !valid_node_name(node) {
            return Err(IdError::BadNodeName(node.chars().take(40).collect()));
        }
        let mut bytes = [0u8; RANDOM_LEN];
        getrandom::fill(&mut bytes).expect("the OS random source failed");
        let random: String = bytes
            .iter()
            .map(|b| BASE32[(b & 31) as usize] as char)
            .collect();
        Ok(SandboxId(format!("{PREFIX}{node}-{random}")))
    }

    /// The node named by an id, if `text` is a cluster sandbox id.
    pub fn node_of(text: &str) -> Option<&str> {
        text.parse::<SandboxId>()
            .ok()
            .map(|_| &text[PREFIX.len()..text.len() - RANDOM_LEN - 1])
    }

    /// The node the sandbox lives on.
    pub fn node(&self) -> &str {
        &self.0[PREFIX.len()..self.0.len() - RANDOM_LEN - 1]
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for SandboxId {
    type Err = IdError;

    fn from_str(text: &str) -> Result<Self, IdError> {
        let bad = || IdError::Malformed(text.chars().take(40).collect());
        if text.len() > MAX_ID_LEN || !text.is_ascii() {
            return Err(bad());
        }
        let rest = text.strip_prefix(PREFIX).ok_or_else(bad)?;
        if rest.len() < RANDOM_LEN + 2 {
            return Err(bad());
        }
        let (node, random) = rest.split_at(rest.len() - RANDOM_LEN - 1);
        let random = random.strip_prefix('-').ok_or_else(bad)?;
        if !random.bytes().all(|b| BASE32.contains(&b)) || !valid_node_name(node) {
            return Err(bad());
        }
        Ok(SandboxId(text.to_string()))
    }
}

impl fmt::Display for SandboxId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_name_their_node_and_parse_back() {
        for node in ["n1", "node-159", "a", "12345678"] {
            let id = SandboxId::new(node).unwrap();
            assert_eq!(id.node(), node);
            let parsed: SandboxId = id.as_str().parse().unwrap();
            assert_eq!((parsed.node(), &parsed), (node, &id));
            assert!(id.as_str().len() <= MAX_ID_LEN);
        }
        assert_ne!(SandboxId::new("n1").unwrap(), SandboxId::new("n1").unwrap());
    }

    #[test]
    fn an_id_fits_the_http_entry_points_dns_label() {
        let id = SandboxId::new("node-159").unwrap();
        let label = format!("65535-{id}-{}", "f".repeat(32));
        assert!(label.len() <= 63, "{label}");
    }

    #[test]
    fn malformed_ids_and_node_names_are_refused() {
        let too_long = format!("sb-{}-abcdefghijkl", "n".repeat(9));
        for bad in [
            "",
            "sb-",
            "sb-n1",
            "sb--abcdefghijkl",
            "sb-n1-abcdefghijk",
            "sb-n1-abcdefghijklm",
            "sb-n1-ABCDEFGHIJKL",
            "sb-n1-abcdefghij18",
            "sb-n1_abcdefghijkl",
            "sb-N1-abcdefghijkl",
            "sb--n1-abcdefghijkl",
            "sb-n1--abcdefghijkl",
            "xx-n1-abcdefghijkl",
            "sb-n1-abcdefghijké",
            &too_long,
        ] {
            let e = bad.parse::<SandboxId>().unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{bad:?}");
        }
        for bad in ["", "nine-char", "-n1", "n1-", "N1", "n_1"] {
            assert!(SandboxId::new(bad).is_err(), "{bad:?}");
        }
        // Existing single-node ids are not cluster ids.
        assert!("sb-0123456789ab".parse::<SandboxId>().is_err());
    }
}
