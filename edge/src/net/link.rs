//! The few rtnetlink requests a container's network needs, sent on our own netlink socket
//! instead of running `ip` (a process per create costs more than the whole setup should).
//! Each request asks for an acknowledgement and is checked before the next one.

use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use super::NetError;

// From linux/rtnetlink.h, linux/if_link.h, linux/veth.h, linux/if_addr.h.
const RTM_NEWLINK: u16 = 16;
const RTM_NEWADDR: u16 = 20;
const RTM_NEWROUTE: u16 = 24;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_EXCL: u16 = 0x200;
const NLM_F_CREATE: u16 = 0x400;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_DUMP: u16 = 0x300;
const IFLA_IFNAME: u16 = 3;
const IFLA_MASTER: u16 = 10;
const IFLA_LINKINFO: u16 = 18;
const IFLA_NET_NS_FD: u16 = 28;
const IFLA_INFO_KIND: u16 = 1;
const IFLA_INFO_DATA: u16 = 2;
const IFLA_INFO_SLAVE_KIND: u16 = 4;
const IFLA_INFO_SLAVE_DATA: u16 = 5;
const IFLA_BRPORT_ISOLATED: u16 = 33;
const VETH_INFO_PEER: u16 = 1;
const IFA_ADDRESS: u16 = 1;
const IFA_LOCAL: u16 = 2;
const RTA_GATEWAY: u16 = 5;
const RTA_OIF: u16 = 4;
const NLA_F_NESTED: u16 = 0x8000;
const IFF_UP: u32 = 0x1;
const RT_TABLE_MAIN: u8 = 254;
const RTPROT_BOOT: u8 = 3;
const RTN_UNICAST: u8 = 1;

/// A netlink socket (route, or netfilter for conntrack), in the network namespace of the
/// thread that opened it.
#[derive(Debug)]
pub(super) struct Rtnl {
    fd: OwnedFd,
    seq: u32,
}

/// One request being built: header, fixed part, attributes (nested ones by offset).
pub(super) struct Message {
    buf: Vec<u8>,
}

impl Message {
    /// A request the kernel acknowledges.
    pub(super) fn new(kind: u16, flags: u16, fixed: &[u8]) -> Self {
        Self::with_flags(kind, flags | NLM_F_ACK, fixed)
    }

    /// A dump request (its replies end with NLMSG_DONE).
    pub(super) fn dump(kind: u16, fixed: &[u8]) -> Self {
        Self::with_flags(kind, NLM_F_DUMP, fixed)
    }

    fn with_flags(kind: u16, flags: u16, fixed: &[u8]) -> Self {
        let mut buf = vec![0u8; 16];
        buf[4..6].copy_from_slice(&kind.to_ne_bytes());
        buf[6..8].copy_from_slice(&(flags | NLM_F_REQUEST).to_ne_bytes());
        buf.extend_from_slice(fixed);
        let mut msg = Message { buf };
        msg.align();
        msg
    }

    fn align(&mut self) {
        while !self.buf.len().is_multiple_of(4) {
            self.buf.push(0);
        }
    }

    pub(super) fn attr(&mut self, kind: u16, data: &[u8]) -> &mut Self {
        let len = (4 + data.len()) as u16;
        self.buf.extend_from_slice(&len.to_ne_bytes());
        self.buf.extend_from_slice(&kind.to_ne_bytes());
        self.buf.extend_from_slice(data);
        self.align();
        self
    }

    fn name(&mut self, kind: u16, name: &str) -> &mut Self {
        let mut data = name.as_bytes().to_vec();
        data.push(0);
        self.attr(kind, &data)
    }

    /// Starts a nested attribute; [`Message::end`] writes its length.
    pub(super) fn begin(&mut self, kind: u16) -> usize {
        let at = self.buf.len();
        self.attr(kind | NLA_F_NESTED, &[]);
        at
    }

    pub(super) fn end(&mut self, at: usize) {
        let len = (self.buf.len() - at) as u16;
        self.buf[at..at + 2].copy_from_slice(&len.to_ne_bytes());
    }

    /// Appends raw bytes (a nested fixed part, such as the veth peer's ifinfomsg).
    pub(super) fn raw(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
        self.align();
    }
}

/// struct ifinfomsg: family, type, index, flags, change.
fn ifinfo(index: i32, flags: u32, change: u32) -> [u8; 16] {
    let mut m = [0u8; 16];
    m[4..8].copy_from_slice(&index.to_ne_bytes());
    m[8..12].copy_from_slice(&flags.to_ne_bytes());
    m[12..16].copy_from_slice(&change.to_ne_bytes());
    m
}

fn failed(what: &str, e: io::Error) -> NetError {
    NetError::Setup(format!("netlink: {what}: {e}"))
}

impl Rtnl {
    /// Opens a route socket in the calling thread's network namespace.
    pub(super) fn open() -> Result<Self, NetError> {
        Self::open_protocol(libc::NETLINK_ROUTE, "open a route socket")
    }

    /// Opens a netfilter socket (conntrack) in the calling thread's network namespace.
    pub(super) fn open_netfilter() -> Result<Self, NetError> {
        Self::open_protocol(libc::NETLINK_NETFILTER, "open a netfilter socket")
    }

    fn open_protocol(protocol: i32, what: &str) -> Result<Self, NetError> {
        // SAFETY: plain socket(2); the descriptor is owned right below.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                protocol,
            )
        };
        if fd < 0 {
            return Err(failed(what, io::Error::last_os_error()));
        }
        // SAFETY: fd is a fresh descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Rtnl { fd, seq: 0 })
    }

    /// Sends `msg` and waits for its acknowledgement.
    fn call(&mut self, msg: Message, what: &str) -> Result<(), NetError> {
        self.exchange(msg, |_| {}).map_err(|e| failed(what, e))
    }

    /// Sends `msg`; hands the payload of each reply message to `each` until the
    /// acknowledgement (or a dump's end): the kernel's error, if it sent one.
    pub(super) fn exchange(
        &mut self,
        mut msg: Message,
        mut each: impl FnMut(&[u8]),
    ) -> Result<(), io::Error> {
        self.seq = self.seq.wrapping_add(1);
        let len = msg.buf.len() as u32;
        msg.buf[0..4].copy_from_slice(&len.to_ne_bytes());
        msg.buf[8..12].copy_from_slice(&self.seq.to_ne_bytes());
        // SAFETY: the buffer is valid for its length; the kernel is the default destination.
        let sent = unsafe {
            libc::send(
                self.fd.as_raw_fd(),
                msg.buf.as_ptr().cast(),
                msg.buf.len(),
                0,
            )
        };
        if sent < 0 {
            return Err(io::Error::last_os_error());
        }
        // As large as the kernel's biggest dump message batch (32 KiB), so none is cut.
        let mut reply = vec![0u8; 32 * 1024];
        loop {
            // SAFETY: receives into a buffer valid for its length.
            let got = unsafe {
                libc::recv(
                    self.fd.as_raw_fd(),
                    reply.as_mut_ptr().cast(),
                    reply.len(),
                    0,
                )
            };
            if got < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            let got = got as usize;
            let mut at = 0;
            while at + 16 <= got {
                let field = |o: usize| {
                    u32::from_ne_bytes(reply[at + o..at + o + 4].try_into().unwrap_or_default())
                };
                let (mlen, kind, seq) = (
                    field(0) as usize,
                    u16::from_ne_bytes([reply[at + 4], reply[at + 5]]),
                    field(8),
                );
                if mlen < 16 || at + mlen > got {
                    break;
                }
                if seq == self.seq {
                    if (kind == NLMSG_ERROR || kind == NLMSG_DONE) && mlen >= 20 {
                        let code = i32::from_ne_bytes(field(16).to_ne_bytes());
                        return if code == 0 {
                            Ok(())
                        } else {
                            Err(io::Error::from_raw_os_error(-code))
                        };
                    }
                    each(&reply[at + 16..at + mlen]);
                }
                at += (mlen + 3) & !3;
            }
        }
    }

    /// A veth pair: `host` (stopped, a port of the bridge `master`) here, `peer` in the
    /// network namespace `peer_ns`.
    pub(super) fn add_veth(
        &mut self,
        host: &str,
        master: u32,
        peer: &str,
        peer_ns: &std::fs::File,
    ) -> Result<(), NetError> {
        let mut msg = Message::new(RTM_NEWLINK, NLM_F_CREATE | NLM_F_EXCL, &ifinfo(0, 0, 0));
        msg.name(IFLA_IFNAME, host);
        msg.attr(IFLA_MASTER, &master.to_ne_bytes());
        let info = msg.begin(IFLA_LINKINFO);
        msg.name(IFLA_INFO_KIND, "veth");
        let data = msg.begin(IFLA_INFO_DATA);
        let peer_at = msg.begin(VETH_INFO_PEER);
        msg.raw(&ifinfo(0, 0, 0));
        msg.name(IFLA_IFNAME, peer);
        msg.attr(IFLA_NET_NS_FD, &peer_ns.as_raw_fd().to_ne_bytes());
        msg.end(peer_at);
        msg.end(data);
        msg.end(info);
        self.call(msg, &format!("create veth {host}"))
    }

    /// Makes the bridge port `index` isolated (no frames to other isolated ports), and up
    /// if `up`.
    pub(super) fn isolate(&mut self, index: u32, up: bool) -> Result<(), NetError> {
        let flags = if up { IFF_UP } else { 0 };
        let mut msg = Message::new(RTM_NEWLINK, 0, &ifinfo(index as i32, flags, IFF_UP));
        let info = msg.begin(IFLA_LINKINFO);
        msg.name(IFLA_INFO_SLAVE_KIND, "bridge");
        let data = msg.begin(IFLA_INFO_SLAVE_DATA);
        msg.attr(IFLA_BRPORT_ISOLATED, &[1]);
        msg.end(data);
        msg.end(info);
        self.call(msg, "isolate the bridge port")
    }

    /// Renames the stopped link `index` to `name` and brings it up (one request: the kernel
    /// renames before it changes the flags).
    pub(super) fn rename_and_up(&mut self, index: u32, name: &str) -> Result<(), NetError> {
        let mut msg = Message::new(RTM_NEWLINK, 0, &ifinfo(index as i32, IFF_UP, IFF_UP));
        msg.name(IFLA_IFNAME, name);
        self.call(msg, &format!("rename a pooled veth to {name}"))
    }

    pub(super) fn up(&mut self, index: u32) -> Result<(), NetError> {
        let msg = Message::new(RTM_NEWLINK, 0, &ifinfo(index as i32, IFF_UP, IFF_UP));
        self.call(msg, "set a link up")
    }

    pub(super) fn add_address(
        &mut self,
        index: u32,
        addr: Ipv4Addr,
        prefix: u8,
    ) -> Result<(), NetError> {
        // struct ifaddrmsg: family, prefixlen, flags, scope, index.
        let mut fixed = [0u8; 8];
        fixed[0] = libc::AF_INET as u8;
        fixed[1] = prefix;
        fixed[4..8].copy_from_slice(&index.to_ne_bytes());
        let mut msg = Message::new(RTM_NEWADDR, NLM_F_CREATE | NLM_F_EXCL, &fixed);
        msg.attr(IFA_LOCAL, &addr.octets());
        msg.attr(IFA_ADDRESS, &addr.octets());
        self.call(msg, &format!("add address {addr}/{prefix}"))
    }

    pub(super) fn add_default_route(
        &mut self,
        index: u32,
        gateway: Ipv4Addr,
    ) -> Result<(), NetError> {
        // struct rtmsg: family, dst_len, src_len, tos, table, protocol, scope, type, flags.
        let mut fixed = [0u8; 12];
        fixed[0] = libc::AF_INET as u8;
        fixed[4] = RT_TABLE_MAIN;
        fixed[5] = RTPROT_BOOT;
        fixed[7] = RTN_UNICAST;
        let mut msg = Message::new(RTM_NEWROUTE, NLM_F_CREATE | NLM_F_EXCL, &fixed);
        msg.attr(RTA_GATEWAY, &gateway.octets());
        msg.attr(RTA_OIF, &index.to_ne_bytes());
        self.call(msg, &format!("add the default route via {gateway}"))
    }
}

/// The index of the interface `name` in the calling thread's network namespace.
pub(super) fn index_of(name: &str) -> Result<u32, NetError> {
    let c = std::ffi::CString::new(name)
        .map_err(|_| NetError::Setup(format!("interface name {name:?} has a NUL")))?;
    // SAFETY: a valid NUL-terminated string.
    let index = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if index == 0 {
        return Err(failed(
            &format!("find interface {name}"),
            io::Error::last_os_error(),
        ));
    }
    Ok(index)
}

/// Inside the network namespace `netns` (from a short-lived thread that joins it: setns
/// changes only the calling thread): `lo` and `eth0` up, `addr/prefix` on `eth0`, and the
/// default route via `gateway`.
pub(super) fn configure_inside(
    netns: &std::fs::File,
    addr: Ipv4Addr,
    prefix: u8,
    gateway: Ipv4Addr,
) -> Result<(), NetError> {
    let (mut rtnl, eth0) = open_inside(netns)?;
    rtnl.add_address(eth0, addr, prefix)?;
    rtnl.add_default_route(eth0, gateway)
}

/// A route socket inside the network namespace `netns` (it stays there: a socket's
/// namespace is the one it was made in), with `lo` and `eth0` up; and `eth0`'s index.
pub(super) fn open_inside(netns: &std::fs::File) -> Result<(Rtnl, u32), NetError> {
    let ns = netns
        .try_clone()
        .map_err(|e| failed("duplicate the namespace descriptor", e))?;
    std::thread::spawn(move || {
        // SAFETY: setns on a descriptor this thread owns; the thread ends right after.
        if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(failed(
                "join the sandbox's network namespace",
                io::Error::last_os_error(),
            ));
        }
        let mut rtnl = Rtnl::open()?;
        rtnl.up(index_of("lo")?)?;
        let eth0 = index_of("eth0")?;
        rtnl.up(eth0)?;
        Ok((rtnl, eth0))
    })
    .join()
    .unwrap_or_else(|_| Err(NetError::Setup("the netlink thread panicked".into())))
}
