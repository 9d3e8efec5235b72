//! API tokens: `dsec_<16 hex id>_<64 hex secret>`. The id finds the record with one lookup;
//! only the SHA-256 of the secret is stored, so a leaked store does not leak tokens. The
//! secret is 256 random bits, so a fast hash is enough (no password stretching).

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::model::PrincipalId;
use super::IamError;

const PREFIX: &str = "dsec_";
const ID_HEX: usize = 16;
const SECRET_HEX: usize = 64;
pub const TOKEN_LEN: usize = PREFIX.len() + ID_HEX + 1 + SECRET_HEX;

/// What the store keeps of a token.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenRecord {
    pub id: String,
    pub principal: PrincipalId,
    /// Hex SHA-256 of the secret part.
    pub secret_sha256: String,
    pub description: String,
    pub created_ms: u64,
    pub expires_ms: Option<u64>,
    pub revoked_ms: Option<u64>,
}

/// A new token: `secret` is the whole token, shown to its owner once and never stored.
#[derive(Clone, PartialEq, Eq)]
pub struct IssuedToken {
    pub id: String,
    pub secret: String,
    pub record: TokenRecord,
}

impl std::fmt::Debug for IssuedToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IssuedToken")
            .field("id", &self.id)
            .field("secret", &"<hidden>")
            .finish()
    }
}

pub(crate) fn random_hex(bytes: usize) -> String {
    let mut buf = vec![0u8; bytes];
    getrandom::fill(&mut buf).expect("the OS random source failed");
    hex(&buf)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub(crate) fn sha256_hex(text: &str) -> String {
    hex(&Sha256::digest(text.as_bytes()))
}

/// A fresh (id, whole token, hash of its secret).
pub(crate) fn generate() -> (String, String, String) {
    let id = random_hex(ID_HEX / 2);
    let secret = random_hex(SECRET_HEX / 2);
    let token = format!("{PREFIX}{id}_{secret}");
    (id, token, sha256_hex(&secret))
}

/// The id and secret of a well-formed token.
pub(crate) fn parse(token: &str) -> Result<(&str, &str), IamError> {
    let is_hex = |s: &str| {
        s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    let rest = token.strip_prefix(PREFIX).ok_or(IamError::TokenMalformed)?;
    if token.len() != TOKEN_LEN {
        return Err(IamError::TokenMalformed);
    }
    let (id, secret) = rest.split_at(ID_HEX);
    let secret = secret.strip_prefix('_').ok_or(IamError::TokenMalformed)?;
    if !is_hex(id) || !is_hex(secret) {
        return Err(IamError::TokenMalformed);
    }
    Ok((id, secret))
}

/// Equal strings, in time that does not depend on where they differ.
pub(crate) fn constant_time_eq(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_tokens_parse_back_and_differ() {
        let (id, token, hash) = generate();
        let (parsed_id, secret) = parse(&token).unwrap();
        assert_eq!(parsed_id, id);
        assert_eq!(sha256_hex(secret), hash);
        assert!(!token.contains(&hash));
        assert_ne!(generate().1, token);
    }

    #[test]
    fn malformed_tokens_are_refused() {
        let (_, token, _) = generate();
        let long = format!("{token}0");
        let upper = token.to_uppercase();
        let no_sep = token.replacen('_', "", 2);
        let non_hex = format!("{}g", &token[..token.len() - 1]);
        for bad in [
            "",
            "dsec_",
            "Bearer x",
            &long,
            &upper,
            &no_sep,
            &non_hex,
            &token[1..],
        ] {
            assert!(
                matches!(parse(bad), Err(IamError::TokenMalformed)),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn constant_time_eq_compares_whole_strings() {
        assert!(constant_time_eq("abc", "abc"));
        assert!(!constant_time_eq("abc", "abd"));
        assert!(!constant_time_eq("abc", "ab"));
    }
}
