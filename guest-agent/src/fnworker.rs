//! The FnCall VM worker: on a worker VM's kernel command line `dsec.fnworker=PORT` asks the
//! agent (VM mode only) to start the image's worker program, which listens on vsock PORT for
//! the host (see fncall/src/vm/).

use std::process::{Command, Stdio};

/// The program a VM FnCall image carries (`images/fncall-vm/build.sh` puts it there).
pub const WORKER_SCRIPT: &str = "/usr/lib/dsec-fncall/guest_worker.py";
const PYTHON: &str = "/usr/bin/python3";

/// What the kernel command line asks for.
#[derive(Debug, PartialEq, Eq)]
pub struct FnWorker {
    /// The vsock port the worker listens on (not the agent's).
    pub port: u32,
}

/// `dsec.fnworker=PORT` from a kernel command line; None without it, an error for a port
/// that is not a number in 1025..=65535 other than the agent's.
pub fn from_cmdline(cmdline: &str) -> Option<Result<FnWorker, String>> {
    let value = cmdline
        .split_whitespace()
        .find_map(|word| word.strip_prefix("dsec.fnworker="))?;
    Some(match value.parse::<u32>() {
        Ok(port) if (1025..=65535).contains(&port) => Ok(FnWorker { port }),
        _ => Err(format!(
            "dsec.fnworker={value:?}: expected a vsock port in 1025..=65535 (1024 is the agent's)"
        )),
    })
}

impl FnWorker {
    /// Starts the worker with the console as its output; the agent's reaper reaps it.
    pub fn start(&self) -> std::io::Result<()> {
        Command::new(PYTHON)
            .arg("-I")
            .arg(WORKER_SCRIPT)
            .arg(self.port.to_string())
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .stdin(Stdio::null())
            .spawn()
            .map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_port_is_checked() {
        assert_eq!(from_cmdline("console=ttyS0 quiet"), None);
        assert_eq!(
            from_cmdline("quiet dsec.fnworker=1100"),
            Some(Ok(FnWorker { port: 1100 }))
        );
        for bad in ["1024", "0", "70000", "x", ""] {
            assert!(matches!(
                from_cmdline(&format!("dsec.fnworker={bad}")),
                Some(Err(_))
            ));
        }
    }
}
