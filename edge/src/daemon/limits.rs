//! Bounds on every input of the public API. A request past one gets INVALID_ARGUMENT naming
//! the limit, so that no client can make replies too large for others (List) or store state
//! that breaks later calls (an environment that makes every exec fail with E2BIG).
//!
//! The exec bounds keep argv + environment far below the kernel's ARG_MAX (2 MiB with the
//! default 8 MiB stack) and every string below MAX_ARG_STRLEN (128 KiB).

use std::collections::HashMap;

use tonic::Status;

pub const MAX_LABELS: usize = 64;
pub const MAX_LABEL_KEY: usize = 63;
pub const MAX_LABEL_VALUE: usize = 256;

pub const MAX_ENV_VARS: usize = 256;
pub const MAX_ENV_KEY: usize = 256;
pub const MAX_ENV_VALUE: usize = 32 << 10;
/// Sum over the variables of `KEY=VALUE\0`, for the sandbox's env and for one exec's each.
pub const MAX_ENV_TOTAL: usize = 128 << 10;

pub const MAX_ARGS: usize = 4096;
/// One argument: below the kernel's MAX_ARG_STRLEN (128 KiB with its NUL).
pub const MAX_ARG: usize = (128 << 10) - 1;
/// Sum over the arguments of `ARG\0`.
pub const MAX_ARGV_TOTAL: usize = 256 << 10;

/// Command timeouts (exec, session commands): 7 days.
pub const MAX_TIMEOUT_MS: u64 = 7 * 24 * 3600 * 1000;
/// TTL and idle timeout of a sandbox: 365 days.
pub const MAX_LIFETIME_S: i64 = 365 * 24 * 3600;

/// Paths, working directories, shells.
pub const MAX_PATH: usize = 4096;
/// A session command (the shell reads it from its input, so no ARG_MAX applies).
pub const MAX_SESSION_COMMAND: usize = 1 << 20;
/// A session command's recorded output cap.
pub const MAX_OUTPUT_LIMIT: u64 = 64 << 20;
/// A Create request_id (a UUID is 36).
pub const MAX_REQUEST_ID: usize = 128;
/// Sandbox ids are `sb-` and 12 hex digits; anything much longer is not one.
pub const MAX_SANDBOX_ID: usize = 64;

/// Labels of Create, Fork and List's filter.
pub fn check_labels<'a>(
    what: &str,
    labels: impl ExactSizeIterator<Item = (&'a String, &'a String)>,
) -> Result<(), Status> {
    let n = labels.len();
    if n > MAX_LABELS {
        return Err(Status::invalid_argument(format!(
            "{what}: {n} labels, at most {MAX_LABELS} are allowed"
        )));
    }
    for (k, v) in labels {
        check_label_key(what, k)?;
        if v.len() > MAX_LABEL_VALUE {
            return Err(Status::invalid_argument(format!(
                "{what}: the value of label {k:?} is {} bytes, at most {MAX_LABEL_VALUE} are allowed",
                v.len()
            )));
        }
        if v.chars().any(char::is_control) {
            return Err(Status::invalid_argument(format!(
                "{what}: the value of label {k:?} contains control characters"
            )));
        }
    }
    Ok(())
}

fn check_label_key(what: &str, k: &str) -> Result<(), Status> {
    let ok_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '/');
    let ends_ok = k.starts_with(|c: char| c.is_ascii_alphanumeric())
        && k.ends_with(|c: char| c.is_ascii_alphanumeric());
    if k.is_empty() || k.len() > MAX_LABEL_KEY || !k.chars().all(ok_char) || !ends_ok {
        let shown: String = k.chars().take(80).collect();
        return Err(Status::invalid_argument(format!(
            "{what}: label key {shown:?} ({} bytes) is invalid: keys are 1 to {MAX_LABEL_KEY} bytes of A-Z a-z 0-9 . _ - /, starting and ending with a letter or digit",
            k.len()
        )));
    }
    Ok(())
}

/// An environment (the sandbox's, or one exec's or session's own).
pub fn check_env(what: &str, env: &HashMap<String, String>) -> Result<(), Status> {
    if env.len() > MAX_ENV_VARS {
        return Err(Status::invalid_argument(format!(
            "{what}: {} environment variables, at most {MAX_ENV_VARS} are allowed",
            env.len()
        )));
    }
    let mut total = 0usize;
    for (k, v) in env {
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
            let shown: String = k.chars().take(80).collect();
            return Err(Status::invalid_argument(format!(
                "{what}: environment variable {shown:?} is invalid: names must be non-empty without '=' or NUL, values without NUL"
            )));
        }
        if k.len() > MAX_ENV_KEY {
            return Err(Status::invalid_argument(format!(
                "{what}: an environment variable name is {} bytes, at most {MAX_ENV_KEY} are allowed",
                k.len()
            )));
        }
        if v.len() > MAX_ENV_VALUE {
            return Err(Status::invalid_argument(format!(
                "{what}: environment variable {k:?} is {} bytes, at most {MAX_ENV_VALUE} (32 KiB) are allowed per value; pass large data as a file",
                v.len()
            )));
        }
        total += k.len() + v.len() + 2;
    }
    if total > MAX_ENV_TOTAL {
        return Err(Status::invalid_argument(format!(
            "{what}: the environment is {total} bytes in all, at most {MAX_ENV_TOTAL} (128 KiB) are allowed; pass large data as a file"
        )));
    }
    Ok(())
}

/// An exec's argv.
pub fn check_argv(argv: &[String]) -> Result<(), Status> {
    if argv.is_empty() {
        return Err(Status::invalid_argument(
            "argv is empty: give the command to run",
        ));
    }
    if argv.len() > MAX_ARGS {
        return Err(Status::invalid_argument(format!(
            "argv has {} arguments, at most {MAX_ARGS} are allowed",
            argv.len()
        )));
    }
    let mut total = 0usize;
    for (i, arg) in argv.iter().enumerate() {
        if arg.contains('\0') {
            return Err(Status::invalid_argument(format!(
                "argv[{i}] contains a NUL byte"
            )));
        }
        if arg.len() > MAX_ARG {
            return Err(Status::invalid_argument(format!(
                "argv[{i}] is {} bytes, at most {MAX_ARG} are allowed per argument (the kernel's limit); pass large data on stdin or as a file",
                arg.len()
            )));
        }
        total += arg.len() + 1;
    }
    if total > MAX_ARGV_TOTAL {
        return Err(Status::invalid_argument(format!(
            "argv is {total} bytes in all, at most {MAX_ARGV_TOTAL} (256 KiB) are allowed; pass large data on stdin or as a file"
        )));
    }
    Ok(())
}

/// A command timeout in milliseconds (0: none).
pub fn check_timeout_ms(what: &str, ms: u64) -> Result<(), Status> {
    if ms > MAX_TIMEOUT_MS {
        let hint = if ms > i64::MAX as u64 {
            " (a negative timeout wrapped around?)"
        } else {
            ""
        };
        return Err(Status::invalid_argument(format!(
            "{what} {ms} is more than 7 days ({MAX_TIMEOUT_MS} ms){hint}: give milliseconds, 0 for no timeout"
        )));
    }
    Ok(())
}

/// A TTL or idle timeout in seconds (0: none).
pub fn check_lifetime_s(what: &str, s: i64) -> Result<(), Status> {
    if s < 0 {
        return Err(Status::invalid_argument(format!(
            "{what} must be >= 0 (0 means none), got {s}"
        )));
    }
    if s > MAX_LIFETIME_S {
        return Err(Status::invalid_argument(format!(
            "{what} {s} is more than 365 days ({MAX_LIFETIME_S} s): give seconds, 0 for none"
        )));
    }
    Ok(())
}

/// A string field bounded in bytes (paths, shells, working directories, commands).
pub fn check_len(what: &str, value: &[u8], max: usize) -> Result<(), Status> {
    if value.len() > max {
        return Err(Status::invalid_argument(format!(
            "{what} is {} bytes, at most {max} are allowed",
            value.len()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, String)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect()
    }

    #[test]
    fn label_keys_follow_the_charset() {
        for good in ["a", "app", "team.example/role", "A_b-9", &"k".repeat(63)] {
            let m = map(&[(good, String::new())]);
            check_labels("labels", m.iter()).unwrap_or_else(|e| panic!("{good}: {e}"));
        }
        for bad in ["", "-a", "a-", "a b", "é", "a=b", &"k".repeat(64)] {
            let m = map(&[(bad, String::new())]);
            let err = check_labels("labels", m.iter()).unwrap_err();
            assert!(err.message().contains("label key"), "{bad}: {err}");
        }
        let m = map(&[("k", "a\nb".into())]);
        assert!(check_labels("labels", m.iter()).is_err());
    }

    #[test]
    fn timeouts_past_the_limit_or_wrapped_are_refused() {
        check_timeout_ms("timeout_ms", MAX_TIMEOUT_MS).unwrap();
        let err = check_timeout_ms("timeout_ms", MAX_TIMEOUT_MS + 1).unwrap_err();
        assert!(err.message().contains("7 days"), "{err}");
        let err = check_timeout_ms("timeout_ms", (-1000i64) as u64).unwrap_err();
        assert!(err.message().contains("negative"), "{err}");
        check_lifetime_s("ttl_seconds", MAX_LIFETIME_S).unwrap();
        assert!(check_lifetime_s("ttl_seconds", MAX_LIFETIME_S + 1).is_err());
        assert!(check_lifetime_s("ttl_seconds", -1).is_err());
    }

    #[test]
    fn argv_bounds() {
        check_argv(&["a".repeat(MAX_ARG)]).unwrap();
        assert!(check_argv(&["a".repeat(MAX_ARG + 1)]).is_err());
        // 2 x 128 KiB - 2 bytes = MAX_ARGV_TOTAL exactly.
        check_argv(&["a".repeat(MAX_ARG), "b".repeat(MAX_ARG)]).unwrap();
        assert!(check_argv(&["a".repeat(MAX_ARG), "b".repeat(MAX_ARG), "c".into()]).is_err());
        assert!(check_argv(&vec!["x".to_string(); MAX_ARGS + 1]).is_err());
        assert!(check_argv(&[]).is_err());
    }
}
