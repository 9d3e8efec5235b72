//! The sandbox's environment, given by the node through a refresh (a template-restored
//! guest was snapshotted before its sandbox existed): every Exec and Session starts with it,
//! and the request's own env is applied over it.

use std::collections::BTreeMap;
use std::sync::RwLock;

use tonic::Status;

/// Bounds on what a refresh may set (the node checks its creates' env more tightly).
const MAX_VARS: usize = 1024;
const MAX_BYTES: usize = 128 * 1024;

static SANDBOX_ENV: RwLock<BTreeMap<String, String>> = RwLock::new(BTreeMap::new());

/// Checks `vars` (names without '=' or NUL, values without NUL, within the bounds).
pub fn check(vars: &std::collections::HashMap<String, String>) -> Result<(), Status> {
    if vars.len() > MAX_VARS {
        return Err(Status::invalid_argument(format!(
            "env has {} variables; send at most {MAX_VARS}",
            vars.len()
        )));
    }
    let bytes: usize = vars.iter().map(|(k, v)| k.len() + v.len()).sum();
    if bytes > MAX_BYTES {
        return Err(Status::invalid_argument(format!(
            "env is {bytes} bytes; send at most {MAX_BYTES}"
        )));
    }
    if vars
        .iter()
        .any(|(k, v)| k.is_empty() || k.contains(['=', '\0']) || v.contains('\0'))
    {
        return Err(Status::invalid_argument(
            "env has an invalid name (empty, or containing '=' or NUL) or a value with NUL",
        ));
    }
    Ok(())
}

/// Replaces the sandbox's environment (checked first with [`check`]).
pub fn set(vars: std::collections::HashMap<String, String>) {
    *SANDBOX_ENV.write().unwrap_or_else(|e| e.into_inner()) = vars.into_iter().collect();
}

/// The sandbox's environment now.
pub fn current() -> BTreeMap<String, String> {
    SANDBOX_ENV
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .clone()
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    #[test]
    fn bad_envs_are_refused() {
        let one = |k: &str, v: &str| HashMap::from([(k.to_string(), v.to_string())]);
        assert!(super::check(&one("K", "v")).is_ok());
        for bad in [
            one("", "v"),
            one("A=B", "v"),
            one("K\0", "v"),
            one("K", "v\0"),
        ] {
            assert!(super::check(&bad).is_err(), "{bad:?}");
        }
        let many: HashMap<_, _> = (0..1025)
            .map(|i| (format!("K{i}"), String::new()))
            .collect();
        assert!(super::check(&many).is_err());
        assert!(super::check(&one("K", &"x".repeat(128 * 1024))).is_err());
    }
}
