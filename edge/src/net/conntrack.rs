//! Deleting the connection tracking entries of connections a sandbox opened, through
//! ctnetlink on our own socket: the kernel lists only the entries whose original source is
//! the sandbox's address (a dump filter, Linux 5.8+), and each is deleted by its tuple. The
//! `conntrack` program did the same at the cost of a process per policy change or delete
//! (10-50 ms on a loaded node, most of a live change's time).

use std::io;
use std::net::Ipv4Addr;

use super::link::{Message, Rtnl};
use super::NetError;

// From linux/netfilter/nfnetlink.h and nfnetlink_conntrack.h.
const NFNL_SUBSYS_CTNETLINK: u16 = 1;
const IPCTNL_MSG_CT_GET: u16 = 1;
const IPCTNL_MSG_CT_DELETE: u16 = 2;
const CTA_TUPLE_ORIG: u16 = 1;
const CTA_ZONE: u16 = 18;
const CTA_FILTER: u16 = 25;
const CTA_TUPLE_IP: u16 = 1;
const CTA_IP_V4_SRC: u16 = 1;
const CTA_FILTER_ORIG_FLAGS: u16 = 1;
const CTA_FILTER_FLAG_CTA_IP_SRC: u32 = 1;
/// The type bits of an attribute (without the nested and byte-order flags).
const NLA_TYPE_MASK: u16 = 0x3fff;
/// At most this many entries per call (a sandbox's own conntrack entries are bounded by the
/// node's table; this only caps one call's memory).
const MAX_ENTRIES: usize = 65_536;

/// struct nfgenmsg: family, version, resource id.
fn nfgen() -> [u8; 4] {
    [libc::AF_INET as u8, 0, 0, 0]
}

/// The attributes in `data`: (type, the whole attribute with its header, its payload).
fn attrs(data: &[u8]) -> impl Iterator<Item = (u16, &[u8], &[u8])> {
    let mut at = 0;
    std::iter::from_fn(move || {
        if at + 4 > data.len() {
            return None;
        }
        let len = u16::from_ne_bytes([data[at], data[at + 1]]) as usize;
        let kind = u16::from_ne_bytes([data[at + 2], data[at + 3]]) & NLA_TYPE_MASK;
        if len < 4 || at + len > data.len() {
            return None;
        }
        let item = (kind, &data[at..at + len], &data[at + 4..at + len]);
        at += (len + 3) & !3;
        Some(item)
    })
}

fn find(data: &[u8], kind: u16) -> Option<(&[u8], &[u8])> {
    attrs(data)
        .find(|(k, _, _)| *k == kind)
        .map(|(_, whole, payload)| (whole, payload))
}

/// Deletes the entries whose original source is `addr`; how many it deleted.
pub(super) fn delete_from(addr: Ipv4Addr) -> Result<usize, NetError> {
    let failed = |what: &str, e: io::Error| NetError::Setup(format!("conntrack: {what}: {e}"));
    let mut nl = Rtnl::open_netfilter()?;
    let mut dump = Message::dump((NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_GET, &nfgen());
    let filter = dump.begin(CTA_FILTER);
    dump.attr(
        CTA_FILTER_ORIG_FLAGS,
        &CTA_FILTER_FLAG_CTA_IP_SRC.to_ne_bytes(),
    );
    dump.end(filter);
    let tuple = dump.begin(CTA_TUPLE_ORIG);
    let ip = dump.begin(CTA_TUPLE_IP);
    dump.attr(CTA_IP_V4_SRC, &addr.octets());
    dump.end(ip);
    dump.end(tuple);
    // (the original tuple, the zone) of each entry, as the kernel wrote them.
    let mut entries: Vec<(Vec<u8>, Option<Vec<u8>>)> = Vec::new();
    nl.exchange(dump, |payload| {
        let Some(attributes) = payload.get(4..) else {
            return;
        };
        let Some((whole, tuple)) = find(attributes, CTA_TUPLE_ORIG) else {
            return;
        };
        // The kernel filtered by source already; checked again, as deleting is for good.
        let source = find(tuple, CTA_TUPLE_IP).and_then(|(_, ip)| find(ip, CTA_IP_V4_SRC));
        if source.is_none_or(|(_, src)| src != addr.octets()) || entries.len() >= MAX_ENTRIES {
            return;
        }
        let zone = find(attributes, CTA_ZONE).map(|(whole, _)| whole.to_vec());
        entries.push((whole.to_vec(), zone));
    })
    .map_err(|e| failed(&format!("list the entries of {addr}"), e))?;
    let mut deleted = 0;
    for (tuple, zone) in entries {
        let mut delete = Message::new(
            (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_DELETE,
            0,
            &nfgen(),
        );
        delete.raw(&tuple);
        if let Some(zone) = &zone {
            delete.raw(zone);
        }
        match nl.exchange(delete, |_| {}) {
            Ok(()) => deleted += 1,
            // Gone meanwhile (closed, timed out).
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) => return Err(failed(&format!("delete an entry of {addr}"), e)),
        }
    }
    Ok(deleted)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::UdpSocket;
    use std::process::{Command, Stdio};

    /// In a network namespace of its own (a thread that unshares it): conntrack on through an
    /// nftables rule, UDP "connections" from two loopback sources, then only the first
    /// source's entries go.
    #[test]
    fn deletes_only_the_given_source_entries() {
        std::thread::spawn(|| {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).expect("unshare (root?)");
            let mut nft = Command::new("nft")
                .args(["-f", "-"])
                .stdin(Stdio::piped())
                .spawn()
                .expect("nft");
            nft.stdin
                .take()
                .unwrap()
                .write_all(
                    b"table ip t {\n chain c {\n type filter hook output priority 0;\n ct state new accept\n }\n}\n",
                )
                .unwrap();
            assert!(nft.wait().unwrap().success());
            assert!(Command::new("ip")
                .args(["link", "set", "lo", "up"])
                .status()
                .unwrap()
                .success());
            let (a, b) = (Ipv4Addr::new(127, 0, 0, 5), Ipv4Addr::new(127, 0, 0, 6));
            for (source, port) in [(a, 9001), (a, 9002), (b, 9003)] {
                let socket = UdpSocket::bind((source, 0)).unwrap();
                socket.send_to(b"x", ("127.0.0.1", port)).unwrap();
            }
            assert_eq!(delete_from(a).unwrap(), 2);
            assert_eq!(delete_from(a).unwrap(), 0);
            assert_eq!(delete_from(b).unwrap(), 1);
        })
        .join()
        .unwrap();
    }
}
