//! The shape of a sandbox, as callers ask for it.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use crate::error::{EdgeError, Result};

/// Shape of a sandbox.
#[derive(Clone, Debug)]
pub struct SandboxSpec {
    pub vcpus: u32,
    pub mem_mib: u32,
    /// Guest kernel (microVM); default `$DSEC_HOME/kernel/vmlinux`.
    pub kernel: Option<PathBuf>,
    /// Initramfs (microVM); default `$DSEC_HOME/images/busybox/initramfs.cpio`.
    pub initrd: Option<PathBuf>,
    /// Extra kernel command line words appended to the defaults.
    pub extra_cmdline: Option<String>,
    /// Root directory of the container image; default `$DSEC_HOME/images/busybox/rootfs`.
    pub rootfs: Option<PathBuf>,
    /// How long the agent may take to answer after the sandbox starts.
    pub ready_timeout: Duration,
    /// Sandbox id; default: generated.
    pub id: Option<String>,
    /// Read-only root filesystem image (microVM): attached as the first virtio-blk disk, with a
    /// fresh sparse ext4 disk of `disk_mib` (default 1024) MiB as the second; the agent
    /// mounts them as an overlay and runs every command in it.
    pub root_disk: Option<PathBuf>,
    /// Writable disk in MiB: of a container a tmpfs in the container (None: unlimited, on the
    /// host under the sandbox directory); of a microVM with a root disk the sparse upper disk.
    pub disk_mib: Option<u32>,
    /// `cgroup.procs` files the sandbox's first process is written into right after it
    /// starts (everything it starts later inherits them).
    pub cgroup_procs: Vec<PathBuf>,
    /// What a container may reach when the node has a network (`EdgeConfig::network`);
    /// empty: nothing outside itself.
    pub network_policy: crate::net::Policy,
    /// microVM: the env its agent starts every exec and session with, given with its hostname
    /// (None: the agent keeps its own).
    pub guest_env: Option<std::collections::BTreeMap<String, String>>,
}

impl Default for SandboxSpec {
    fn default() -> Self {
        Self {
            vcpus: 1,
            mem_mib: 256,
            kernel: None,
            initrd: None,
            extra_cmdline: None,
            rootfs: None,
            ready_timeout: Duration::from_secs(30),
            id: None,
            root_disk: None,
            disk_mib: None,
            cgroup_procs: Vec::new(),
            network_policy: crate::net::Policy::default(),
            guest_env: None,
        }
    }
}

impl SandboxSpec {
    pub(crate) fn validate(&self) -> Result<()> {
        if self.vcpus == 0 {
            return Err(EdgeError::InvalidSpec("vcpus must be at least 1".into()));
        }
        if self.vcpus > 255 {
            return Err(EdgeError::InvalidSpec(format!(
                "{} vcpus is more than the 255 supported",
                self.vcpus
            )));
        }
        if self.mem_mib < 32 {
            return Err(EdgeError::InvalidSpec(format!(
                "{} MiB of memory is too little: a sandbox needs at least 32 MiB",
                self.mem_mib
            )));
        }
        let host_mib = host_memory_mib().unwrap_or(0);
        if host_mib > 0 && u64::from(self.mem_mib) > host_mib {
            return Err(EdgeError::InvalidSpec(format!(
                "{} MiB of memory is more than this host has ({host_mib} MiB)",
                self.mem_mib
            )));
        }
        Ok(())
    }
}

/// The host's memory in MiB (MemTotal), if /proc/meminfo says.
pub(crate) fn host_memory_mib() -> Option<u64> {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("MemTotal:"))?;
            line.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .map(|kib| kib / 1024)
}

/// Environment helper for callers: parses `K=V`.
pub fn parse_env_pair(pair: &str) -> Result<(String, String)> {
    match pair.split_once('=') {
        Some((key, value)) if !key.is_empty() => Ok((key.to_string(), value.to_string())),
        _ => Err(EdgeError::InvalidSpec(format!(
            "bad environment variable {pair:?}: expected KEY=VALUE with a non-empty KEY"
        ))),
    }
}

/// Collects `K=V` pairs into a map (later ones win).
pub fn parse_env(pairs: &[String]) -> Result<HashMap<String, String>> {
    pairs.iter().map(|p| parse_env_pair(p)).collect()
}
