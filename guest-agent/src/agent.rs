//! The Agent service: identity, refresh after restore, and shutdown.

use std::time::Duration;

use dsec_api::agent::v1::agent_server::Agent;
use std::net::Ipv4Addr;

use dsec_api::agent::v1::{
    GuestIpv4, InfoRequest, InfoResponse, RefreshRequest, RefreshResponse, ShutdownRequest,
    ShutdownResponse,
};
use tonic::{Request, Response, Status};

use crate::Mode;

/// Serves `dsec.agent.v1.Agent`.
pub struct AgentService {
    pub mode: Mode,
}

/// More than enough to reseed a CRNG; bounds what a caller can make us write.
const MAX_ENTROPY: usize = 4096;

/// `aa:bb:cc:dd:ee:ff` as a unicast, non-zero address.
fn parse_mac(text: &str) -> Option<[u8; 6]> {
    let mut mac = [0u8; 6];
    let mut parts = text.split(':');
    for byte in &mut mac {
        let part = parts.next()?;
        if part.len() != 2 {
            return None;
        }
        *byte = u8::from_str_radix(part, 16).ok()?;
    }
    (parts.next().is_none() && mac[0] & 1 == 0 && mac != [0; 6]).then_some(mac)
}

/// A hostname the kernel takes and resolvers accept: 1-64 bytes of letters, digits, '-' and
/// '.', not starting or ending with '-' or '.'.
fn valid_hostname(name: &str) -> bool {
    let edge_ok = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    (1..=64).contains(&name.len())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.')
        && edge_ok(name.chars().next())
        && edge_ok(name.chars().last())
}

/// A checked [`GuestIpv4`]: address, prefix length, gateway (inside the address's network)
/// and nameserver.
fn parse_ipv4(setup: &GuestIpv4) -> Result<(Ipv4Addr, u8, Ipv4Addr, Ipv4Addr), Status> {
    let field = |name: &str, text: &str| {
        text.parse::<Ipv4Addr>().map_err(|_| {
            Status::invalid_argument(format!(
                "ipv4.{name} {:?} is not a dotted-quad IPv4 address",
                text.chars().take(40).collect::<String>()
            ))
        })
    };
    let address = field("address", &setup.address)?;
    let gateway = field("gateway", &setup.gateway)?;
    let nameserver = field("nameserver", &setup.nameserver)?;
    let prefix_len = u8::try_from(setup.prefix_len)
        .ok()
        .filter(|p| (1..=32).contains(p))
        .ok_or_else(|| {
            Status::invalid_argument(format!("ipv4.prefix_len {} is not 1-32", setup.prefix_len))
        })?;
    let mask = u32::MAX << (32 - u32::from(prefix_len));
    if u32::from(address) & mask != u32::from(gateway) & mask || address == gateway {
        return Err(Status::invalid_argument(format!(
            "ipv4.gateway {gateway} is not another address in {address}/{prefix_len}"
        )));
    }
    Ok((address, prefix_len, gateway, nameserver))
}

/// Adds `entropy` to the input pool, credited (the host's getrandom output is full-entropy, and
/// a young guest's CRNG may not be initialised yet), then forces an immediate CRNG reseed, so
/// two forks of one snapshot diverge from their very next read.
fn reseed(entropy: &[u8]) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // RNDADDENTROPY = _IOW('R', 0x03, int[2]); RNDRESEEDCRNG = _IO('R', 0x07).
    const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
    const RNDRESEEDCRNG: libc::c_ulong = 0x5207;
    let urandom = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/urandom")?;
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
    let mut info: Vec<u8> = Vec::with_capacity(8 + entropy.len());
    info.extend_from_slice(&((entropy.len() * 8) as i32).to_ne_bytes());
    info.extend_from_slice(&(entropy.len() as i32).to_ne_bytes());
    info.extend_from_slice(entropy);
    // SAFETY: `info` is a complete rand_pool_info whose buf_size matches the bytes after its
    // header; the kernel only reads it. The result is checked.
    if unsafe { libc::ioctl(urandom.as_raw_fd(), RNDADDENTROPY as _, info.as_ptr()) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: an argument-less ioctl on a descriptor we own; the result is checked.
    if unsafe { libc::ioctl(urandom.as_raw_fd(), RNDRESEEDCRNG as _) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Time since the kernel booted (in a container: the host's).
fn uptime_ms() -> u64 {
    std::fs::read_to_string("/proc/uptime")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<f64>().ok())
        .map(|secs| (secs * 1000.0) as u64)
        .unwrap_or(0)
}

impl AgentService {
    /// The guest's network interface, which a refresh's `field` is about to change: only a
    /// VM's init owns one (a container or plain process shares its interfaces with others).
    fn owned_interface(&self, field: &str) -> Result<String, Status> {
        if self.mode != Mode::Vm {
            return Err(Status::failed_precondition(format!(
                "only an agent running as a VM's init owns the network interface; send no {field}"
            )));
        }
        crate::init::first_ethernet().ok_or_else(|| {
            Status::failed_precondition(format!(
                "{field} was given but the guest has no network interface"
            ))
        })
    }
}

#[tonic::async_trait]
impl Agent for AgentService {
    async fn info(&self, _: Request<InfoRequest>) -> Result<Response<InfoResponse>, Status> {
        let uname = nix::sys::utsname::uname()
            .map_err(|e| Status::internal(format!("uname failed: {e}")))?;
        Ok(Response::new(InfoResponse {
            agent_version: env!("CARGO_PKG_VERSION").to_string(),
            kernel_release: uname.release().to_string_lossy().into_owned(),
            uptime_ms: uptime_ms(),
            hostname: uname.nodename().to_string_lossy().into_owned(),
            mode: self.mode.as_str().to_string(),
        }))
    }

    async fn refresh(
        &self,
        request: Request<RefreshRequest>,
    ) -> Result<Response<RefreshResponse>, Status> {
        let mut request = request.into_inner();
        // Checked before anything changes, so a refused refresh changes nothing of this.
        if let Some(env) = &request.env {
            crate::sandbox_env::check(&env.vars)?;
        }
        if request.entropy.len() > MAX_ENTROPY {
            return Err(Status::invalid_argument(format!(
                "entropy is {} bytes; send at most {MAX_ENTROPY}",
                request.entropy.len()
            )));
        }
        if !request.entropy.is_empty() {
            reseed(&request.entropy)
                .map_err(|e| Status::internal(format!("cannot reseed the kernel RNG: {e}")))?;
        }
        let mac = match request.mac.as_str() {
            "" => None,
            text => Some(parse_mac(text).ok_or_else(|| {
                Status::invalid_argument(format!(
                    "mac {text:?} is not a unicast address like 06:00:0a:00:00:02"
                ))
            })?),
        };
        if let Some(mac) = mac {
            let name = self.owned_interface("mac")?;
            crate::init::set_mac(&name, mac)
                .map_err(|e| Status::internal(format!("cannot set the MAC of {name}: {e}")))?;
        }
        if let Some(ipv4) = &request.ipv4 {
            let setup = parse_ipv4(ipv4)?;
            let name = self.owned_interface("ipv4")?;
            crate::init::set_ipv4(&name, setup.0, setup.1, setup.2, setup.3)
                .map_err(|e| Status::internal(format!("cannot set up IPv4 on {name}: {e}")))?;
        }
        if !request.hostname.is_empty() {
            if !valid_hostname(&request.hostname) {
                return Err(Status::invalid_argument(format!(
                    "hostname {:?} is not 1-64 letters, digits, '-' or '.' (not at either end)",
                    request.hostname.chars().take(80).collect::<String>()
                )));
            }
            // A container's name is set at its launch; a plain process shares the host's.
            if self.mode != Mode::Vm {
                return Err(Status::failed_precondition(
                    "only an agent running as a VM's init owns the hostname; send none",
                ));
            }
            nix::unistd::sethostname(&request.hostname)
                .map_err(|e| Status::internal(format!("cannot set the hostname: {e}")))?;
        }
        let env_set = request.env.is_some();
        if let Some(env) = request.env.take() {
            crate::sandbox_env::set(env.vars);
        }
        let mut skew = 0;
        if request.realtime_ns > 0 {
            let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_REALTIME)
                .map_err(|e| Status::internal(format!("read the clock: {e}")))?;
            let guest_ns = now.tv_sec() as i64 * 1_000_000_000 + now.tv_nsec() as i64;
            skew = guest_ns - request.realtime_ns;
        }
        // Only a VM owns its clock: a container or plain process shares the host's.
        if request.realtime_ns > 0 && self.mode == Mode::Vm {
            let ts = nix::sys::time::TimeSpec::new(
                request.realtime_ns / 1_000_000_000,
                request.realtime_ns % 1_000_000_000,
            );
            nix::time::clock_settime(nix::time::ClockId::CLOCK_REALTIME, ts)
                .map_err(|e| Status::permission_denied(format!("cannot set the clock: {e}")))?;
        }
        Ok(Response::new(RefreshResponse {
            clock_skew_ns: skew,
            env_set,
        }))
    }

    async fn shutdown(
        &self,
        _: Request<ShutdownRequest>,
    ) -> Result<Response<ShutdownResponse>, Status> {
        let mode = self.mode;
        tokio::spawn(async move {
            // Let the response reach the client first.
            tokio::time::sleep(Duration::from_millis(20)).await;
            crate::init::power_off(mode);
        });
        Ok(Response::new(ShutdownResponse {}))
    }
}

#[cfg(test)]
mod tests {
    use super::{parse_ipv4, parse_mac, valid_hostname};
    use dsec_api::agent::v1::GuestIpv4;

    #[test]
    fn ipv4_setups_are_checked() {
        let setup = |address: &str, prefix_len, gateway: &str, nameserver: &str| GuestIpv4 {
            address: address.into(),
            prefix_len,
            gateway: gateway.into(),
            nameserver: nameserver.into(),
        };
        assert_eq!(
            parse_ipv4(&setup("10.200.0.5", 16, "10.200.0.1", "10.200.0.1")).unwrap(),
            (
                [10, 200, 0, 5].into(),
                16,
                [10, 200, 0, 1].into(),
                [10, 200, 0, 1].into()
            )
        );
        for bad in [
            setup("10.200.0.5", 0, "10.200.0.1", "10.200.0.1"),
            setup("10.200.0.5", 33, "10.200.0.1", "10.200.0.1"),
            setup("10.200.0.5/16", 16, "10.200.0.1", "10.200.0.1"),
            setup("10.200.0.5", 16, "10.201.0.1", "10.200.0.1"),
            setup("10.200.0.5", 16, "10.200.0.5", "10.200.0.1"),
            setup("10.200.0.5", 16, "10.200.0.1", "resolver"),
        ] {
            assert!(parse_ipv4(&bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn hostnames_are_checked() {
        for good in ["sb-1a2b", "a", "x.example", &"y".repeat(64)] {
            assert!(valid_hostname(good), "{good}");
        }
        for bad in ["", "-a", "a-", ".a", "a b", "a_b", "é", &"y".repeat(65)] {
            assert!(!valid_hostname(bad), "{bad}");
        }
    }

    #[test]
    fn macs_are_parsed_strictly() {
        assert_eq!(parse_mac("06:00:0a:00:00:02"), Some([6, 0, 10, 0, 0, 2]));
        for bad in [
            "",
            "06:00:0a:00:00",
            "06:00:0a:00:00:02:03",
            "07:00:00:00:00:01",
            "00:00:00:00:00:00",
            "6:00:0a:00:00:02",
            "zz:00:0a:00:00:02",
        ] {
            assert_eq!(parse_mac(bad), None, "{bad}");
        }
    }
}
