//! microVM taps. The jailed VMM joins an empty network namespace the edge made for the
//! sandbox and creates its tap there (as root, before it drops privileges); once the VM
//! runs, the tap moves to the host's namespace onto the bridge (an open tap keeps working
//! across the move, and goes with the VMM's last descriptor). The guest's `eth0` is set up
//! by the agent; the sandbox's rules are the same per-address chain containers get.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sched::{unshare, CloneFlags};

use super::{ip_batch, nft, NetError, Network, Policy};

/// What a microVM's network device is made of, decided before its VMM starts.
#[derive(Clone, Debug)]
pub struct TapPlan {
    pub addr: Ipv4Addr,
    pub tap: String,
    /// The guest's MAC: locally administered, from the address (unique on the bridge).
    pub mac: String,
    /// The empty network namespace the jailed VMM joins (a bind mount until attached).
    pub netns: PathBuf,
}

/// Taps are named this and the address in hex (veths: `dsv`).
pub(super) const TAP_PREFIX: &str = "dst";

pub(super) fn tap_name(addr: Ipv4Addr) -> String {
    format!("{TAP_PREFIX}{:08x}", u32::from(addr))
}

pub(super) fn mac_of(addr: Ipv4Addr) -> String {
    let [a, b, c, d] = addr.octets();
    format!("06:00:{a:02x}:{b:02x}:{c:02x}:{d:02x}")
}

impl Network {
    /// Takes an address and writes the sandbox's rules, and makes the namespace its VMM
    /// joins. Recorded in `sandbox_dir` first, so [`super::release`] frees it all. Blocking.
    pub fn prepare_tap(&self, sandbox_dir: &Path, policy: &Policy) -> Result<TapPlan, NetError> {
        let (addr, rules) = self.claim(sandbox_dir, policy)?;
        let netns = PathBuf::from(format!(
            "{}.netns",
            self.slots.join(addr.to_string()).display()
        ));
        let mut held = super::held(sandbox_dir)
            .ok_or_else(|| NetError::Setup("the sandbox's address record vanished".into()))?;
        held.netns = Some(netns.clone());
        super::write_held(sandbox_dir, &held)?;
        new_netns(&netns)?;
        nft::apply(rules)?;
        Ok(TapPlan {
            addr,
            tap: tap_name(addr),
            mac: mac_of(addr),
            netns,
        })
    }

    /// A new tap for a sandbox that keeps its address, rules and policy (a resume: its tap
    /// went with its ended VMM): a fresh namespace for its VMM, recorded first. Blocking.
    pub fn resume_tap(&self, sandbox_dir: &Path) -> Result<TapPlan, NetError> {
        let mut held = super::held(sandbox_dir)
            .ok_or_else(|| NetError::Setup("the sandbox has no address record".into()))?;
        let addr = held.addr;
        let netns = PathBuf::from(format!(
            "{}.netns",
            self.slots.join(addr.to_string()).display()
        ));
        held.netns = Some(netns.clone());
        super::write_held(sandbox_dir, &held)?;
        // A tap left by the ended VMM (a descriptor still open somewhere) would clash.
        let tap = tap_name(addr);
        if Path::new("/sys/class/net").join(&tap).exists() {
            ip_batch(&format!("link del {tap}\n"), None)?;
        }
        new_netns(&netns)?;
        Ok(TapPlan {
            addr,
            tap,
            mac: mac_of(addr),
            netns,
        })
    }

    /// Once the VMM has opened its tap: moves it onto the bridge (an isolated port, like a
    /// container's veth) and drops the namespace. Blocking.
    pub fn attach_tap(&self, plan: &TapPlan) -> Result<(), NetError> {
        let netns = std::fs::File::open(&plan.netns)
            .map_err(|e| NetError::Setup(format!("open {}: {e}", plan.netns.display())))?;
        let tap = &plan.tap;
        ip_batch(
            &format!("link set {tap} netns {}\n", std::process::id()),
            Some(&netns),
        )?;
        drop(netns);
        ip_batch(
            &format!(
                "link set {tap} master {bridge}\n\
                 link set {tap} type bridge_slave isolated on\n\
                 link set {tap} up\n",
                bridge = self.bridge
            ),
            None,
        )?;
        remove_netns(&plan.netns);
        Ok(())
    }

    /// The guest's address, default route and resolver (the agent sets them up in its
    /// refresh; the guest kernel has no `ip=` autoconfiguration).
    pub fn guest_ipv4(&self, addr: Ipv4Addr) -> crate::client::GuestIpv4 {
        crate::client::GuestIpv4 {
            address: addr,
            prefix_len: self.pool.1,
            gateway: self.gateway,
            nameserver: self.gateway,
        }
    }
}

/// A new, empty network namespace kept by a bind mount at `path`.
fn new_netns(path: &Path) -> Result<(), NetError> {
    std::fs::File::create(path)
        .map_err(|e| NetError::Setup(format!("create {}: {e}", path.display())))?;
    let target = path.to_path_buf();
    // unshare changes only the calling thread's namespace: a thread of its own, which ends.
    std::thread::spawn(move || -> Result<(), NetError> {
        unshare(CloneFlags::CLONE_NEWNET)
            .map_err(|e| NetError::Setup(format!("new network namespace: {e}")))?;
        mount(
            Some("/proc/thread-self/ns/net"),
            &target,
            None::<&str>,
            MsFlags::MS_BIND,
            None::<&str>,
        )
        .map_err(|e| {
            NetError::Setup(format!(
                "keep the network namespace at {}: {e}",
                target.display()
            ))
        })
    })
    .join()
    .unwrap_or_else(|_| Err(NetError::Setup("the namespace thread panicked".into())))
}

/// Unmounts and removes a namespace made by [`new_netns`] (gone already is fine).
pub(super) fn remove_netns(path: &Path) {
    let _ = umount2(path, MntFlags::MNT_DETACH);
    let _ = std::fs::remove_file(path);
}

/// The microVM backend's hook before a boot or restore: a tap for every microVM on a node
/// with a network whose guest has (or, restored, whose snapshot has) a network device.
pub async fn prepare_microvm(
    config: &crate::backend::EdgeConfig,
    sandbox_dir: &Path,
    policy: &Policy,
) -> crate::error::Result<Option<TapPlan>> {
    let Some(network) = config.network.clone() else {
        return Ok(None);
    };
    if config.jail.is_none() {
        return Err(NetError::Setup(
            "a microVM's tap needs a jailed VMM (the edge running as root)".into(),
        )
        .into());
    }
    let (dir, policy) = (sandbox_dir.to_path_buf(), policy.clone());
    let plan = tokio::task::spawn_blocking(move || network.prepare_tap(&dir, &policy))
        .await
        .map_err(|e| NetError::Setup(format!("network setup task failed: {e}")))??;
    Ok(Some(plan))
}

/// The hook once the microVM's agent answers: its tap onto the bridge, its `eth0` given the
/// sandbox's address, route and resolver through the agent's refresh (a restored guest's
/// MAC was set by the refresh that woke it).
pub async fn attach_microvm(
    config: &crate::backend::EdgeConfig,
    plan: &TapPlan,
    agent: &crate::client::AgentClient,
) -> crate::error::Result<()> {
    let Some(network) = config.network.clone() else {
        return Ok(());
    };
    let (net, moved) = (network.clone(), plan.clone());
    tokio::task::spawn_blocking(move || net.attach_tap(&moved))
        .await
        .map_err(|e| NetError::Setup(format!("network setup task failed: {e}")))??;
    let identity = crate::client::GuestIdentity {
        ipv4: Some(network.guest_ipv4(plan.addr)),
        ..Default::default()
    };
    match tokio::time::timeout(
        std::time::Duration::from_secs(10),
        agent.refresh(Vec::new(), identity),
    )
    .await
    {
        Ok(done) => done.map(|_| ()).map_err(|e| {
            NetError::Setup(format!("the guest could not configure its interface: {e}")).into()
        }),
        Err(_) => Err(NetError::Setup(
            "the guest did not configure its interface within 10 s".into(),
        )
        .into()),
    }
}

/// The network device override of a restore: the snapshot's device on the sandbox's tap,
/// with its MAC (the agent's refresh gives the guest the same one).
pub fn restore_override(plan: &TapPlan) -> dsec_vmm_api::config::NetConfig {
    dsec_vmm_api::config::NetConfig {
        tap: plan.tap.clone(),
        mac: Some(plan.mac.clone()),
    }
}

/// A file in a snapshot directory saying its VM has a network device (the VMM refuses a
/// net override for a snapshot without one).
const SNAPSHOT_NET_MARKER: &str = "dsec-net-device";

/// The network device a template is built with: a tap of its own in the jailed VMM's
/// private namespace, never attached (the snapshot only needs the device).
pub fn template_net_device() -> dsec_vmm_api::config::NetConfig {
    dsec_vmm_api::config::NetConfig {
        tap: format!("{TAP_PREFIX}template"),
        mac: None,
    }
}

/// Records in `snapshot` (a directory) that its VM has a network device.
pub fn mark_snapshot_net_device(snapshot: &Path) -> crate::error::Result<()> {
    let marker = snapshot.join(SNAPSHOT_NET_MARKER);
    std::fs::write(&marker, b"")
        .map_err(|e| crate::error::EdgeError::io(format!("write {}", marker.display()), e))
}

/// Whether `snapshot`'s VM has a network device (its restore needs a tap of its own).
pub fn snapshot_has_net_device(snapshot: &Path) -> bool {
    snapshot.join(SNAPSHOT_NET_MARKER).is_file()
}

/// The microVM backend's hook before a resume (pause to disk -> resume): a new tap for the
/// sandbox's address when it has one (its rules and policy stayed in the table).
pub async fn prepare_resume(
    config: &crate::backend::EdgeConfig,
    sandbox_dir: &Path,
) -> crate::error::Result<Option<TapPlan>> {
    let Some(network) = config.network.clone() else {
        return Ok(None);
    };
    if super::address(sandbox_dir).is_none() || config.jail.is_none() {
        return Ok(None);
    }
    let dir = sandbox_dir.to_path_buf();
    let plan = tokio::task::spawn_blocking(move || network.resume_tap(&dir))
        .await
        .map_err(|e| NetError::Setup(format!("network setup task failed: {e}")))??;
    Ok(Some(plan))
}

/// Drops the namespace of a tap whose VMM did not start (the tap went with it).
pub fn abandon_tap(plan: &TapPlan) {
    remove_netns(&plan.netns);
}

/// Marks `snapshot` (a directory the VMM just wrote) as having a network device when the
/// sandbox in `sandbox_dir` has one (an address on this node's network), so that a fork
/// child or a named restore of it gets a tap of its own.
pub fn mark_if_networked(sandbox_dir: &Path, snapshot: &Path) -> crate::error::Result<()> {
    if super::address(sandbox_dir).is_some() {
        mark_snapshot_net_device(snapshot)?;
    }
    Ok(())
}

/// The microVM backend's hook before a restore: a tap (address, rules, namespace) when
/// the snapshot has a network device and the node a network.
pub async fn prepare_restore(
    config: &crate::backend::EdgeConfig,
    sandbox_dir: &Path,
    snapshot: &Path,
    spec: &crate::backend::SandboxSpec,
) -> crate::error::Result<Option<TapPlan>> {
    if !snapshot_has_net_device(snapshot) {
        return Ok(None);
    }
    prepare_microvm(config, sandbox_dir, &spec.network_policy).await
}
