//! PID 1 duties inside a VM: early mounts, loopback, hostname, poweroff.

use std::io::Write;
use std::net::Ipv4Addr;

use nix::mount::{mount, MsFlags};

use crate::{AgentError, Mode};

fn mount_fs(
    source: &str,
    target: &str,
    fstype: &str,
    flags: MsFlags,
    data: Option<&str>,
) -> Result<(), AgentError> {
    std::fs::create_dir_all(target)
        .map_err(|e| AgentError::Setup(format!("mkdir {target}: {e}")))?;
    match mount(Some(source), target, Some(fstype), flags, data) {
        Ok(()) | Err(nix::errno::Errno::EBUSY) => Ok(()),
        Err(err) => Err(AgentError::Setup(format!(
            "mount {fstype} on {target}: {err}"
        ))),
    }
}

/// Mounts what a VM init must provide. Mounts that already exist are kept.
pub fn mount_vm_filesystems() -> Result<(), AgentError> {
    let nodev = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    mount_fs("proc", "/proc", "proc", nodev, None)?;
    mount_fs("sysfs", "/sys", "sysfs", nodev, None)?;
    mount_fs(
        "devtmpfs",
        "/dev",
        "devtmpfs",
        MsFlags::MS_NOSUID,
        Some("mode=0755"),
    )?;
    mount_fs(
        "devpts",
        "/dev/pts",
        "devpts",
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("ptmxmode=0666,mode=0620"),
    )?;
    mount_fs(
        "tmpfs",
        "/dev/shm",
        "tmpfs",
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some("mode=1777"),
    )?;
    mount_fs(
        "tmpfs",
        "/tmp",
        "tmpfs",
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some("mode=1777"),
    )?;
    mount_fs(
        "tmpfs",
        "/run",
        "tmpfs",
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some("mode=0755"),
    )?;
    Ok(())
}

/// Brings the loopback interface up so services inside the sandbox can use localhost.
pub fn loopback_up() {
    if let Err(err) = set_loopback_up() {
        tracing::warn!(%err, "could not bring up lo");
    }
}

/// A datagram socket for interface ioctls.
fn ioctl_socket() -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::{FromRawFd, OwnedFd};
    // SAFETY: plain socket(2) call; the returned fd is checked and owned right away.
    let raw = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if raw < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `raw` is a fresh, valid fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

/// An interface request naming `name` (at most 15 bytes), everything else zero.
fn ifreq_for(name: &str) -> std::io::Result<libc::ifreq> {
    if name.is_empty() || name.len() >= libc::IFNAMSIZ {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("bad interface name {name:?}"),
        ));
    }
    // SAFETY: ifreq is plain old data; all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(name.bytes()) {
        *dst = src as libc::c_char;
    }
    Ok(req)
}

/// The guest's first network interface other than loopback (virtio-net: `eth0`).
pub fn first_ethernet() -> Option<String> {
    let mut names: Vec<String> = std::fs::read_dir("/sys/class/net")
        .ok()?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n != "lo")
        .collect();
    names.sort();
    names.into_iter().next()
}

/// Sets the hardware address of interface `name` (virtio-net allows this while it is up).
pub fn set_mac(name: &str, mac: [u8; 6]) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let sock = ioctl_socket()?;
    let mut req = ifreq_for(name)?;
    // SAFETY: writing the sockaddr member of the union; ifreq is plain old data.
    unsafe {
        req.ifr_ifru.ifru_hwaddr.sa_family = libc::ARPHRD_ETHER;
        for (dst, src) in req.ifr_ifru.ifru_hwaddr.sa_data.iter_mut().zip(mac) {
            *dst = src as libc::c_char;
        }
    }
    // SAFETY: SIOCSIFHWADDR only reads `req`.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFHWADDR, &req) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn set_loopback_up() -> std::io::Result<()> {
    link_up("lo")
}

/// An `AF_INET` socket address (what the interface and route ioctls take).
fn sockaddr_v4(addr: Ipv4Addr) -> libc::sockaddr {
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from(addr).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: sockaddr_in and sockaddr are both 16 bytes of plain old data; the kernel reads
    // the family to know which it is.
    unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
}

/// Gives interface `name` the address `addr/prefix_len` (replacing its primary IPv4
/// address, e.g. a snapshot parent's), brings it up, routes everything through `gateway`
/// and names `nameserver` in /etc/resolv.conf.
pub fn set_ipv4(
    name: &str,
    addr: Ipv4Addr,
    prefix_len: u8,
    gateway: Ipv4Addr,
    nameserver: Ipv4Addr,
) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let sock = ioctl_socket()?;
    let netmask = Ipv4Addr::from(
        u32::MAX
            .checked_shl(32 - u32::from(prefix_len))
            .unwrap_or(0),
    );
    for (op, value) in [(libc::SIOCSIFADDR, addr), (libc::SIOCSIFNETMASK, netmask)] {
        let mut req = ifreq_for(name)?;
        req.ifr_ifru.ifru_addr = sockaddr_v4(value);
        // SAFETY: both ioctls only read `req`, whose address member was just written.
        if unsafe { libc::ioctl(sock.as_raw_fd(), op, &req) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    link_up(name)?;
    // SAFETY: rtentry is plain old data; all-zero is a valid value.
    let mut route: libc::rtentry = unsafe { std::mem::zeroed() };
    route.rt_dst = sockaddr_v4(Ipv4Addr::UNSPECIFIED);
    route.rt_genmask = sockaddr_v4(Ipv4Addr::UNSPECIFIED);
    route.rt_gateway = sockaddr_v4(gateway);
    route.rt_flags = libc::RTF_UP | libc::RTF_GATEWAY;
    // SAFETY: SIOCADDRT only reads `route`, which names no device (the kernel picks the one
    // whose network holds the gateway).
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCADDRT, &route) } < 0 {
        let err = std::io::Error::last_os_error();
        // The same default route (a snapshot parent's on the same bridge) is fine.
        if err.raw_os_error() != Some(libc::EEXIST) {
            return Err(err);
        }
    }
    std::fs::write("/etc/resolv.conf", format!("nameserver {nameserver}\n"))
}

/// Sets `IFF_UP` (and running) on interface `name`.
fn link_up(name: &str) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let sock = ioctl_socket()?;
    let mut req = ifreq_for(name)?;
    // SAFETY: SIOCGIFFLAGS reads the flags of the interface named in `req` into `req`.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: after SIOCGIFFLAGS the union holds the flags field.
    unsafe { req.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short };
    // SAFETY: SIOCSIFFLAGS only reads `req`.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Announces readiness: exactly one line on the console in a VM (the boot benchmark waits
/// for it), a log line elsewhere.
pub fn announce_ready(mode: Mode) {
    if mode == Mode::Vm {
        if let Ok(mut console) = std::fs::OpenOptions::new().write(true).open("/dev/console") {
            let _ = console.write_all(b"dsec-agent ready\n");
            return;
        }
    }
    tracing::info!(mode = mode.as_str(), "dsec-agent ready");
}

/// Ends the sandbox. In a VM: kill everything, sync, reboot (the VMM exits on the i8042
/// reset the kernel does with `reboot=k`). Elsewhere the agent just exits; in a container
/// that takes the whole PID namespace down.
pub fn power_off(mode: Mode) -> ! {
    if mode == Mode::Vm {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(-1),
            nix::sys::signal::Signal::SIGKILL,
        );
        nix::unistd::sync();
        let err = nix::sys::reboot::reboot(nix::sys::reboot::RebootMode::RB_AUTOBOOT);
        tracing::error!(?err, "reboot failed");
    }
    std::process::exit(0)
}
