//! The node's nftables table (`inet <bridge>`), written as nftables JSON through libnftables
//! in this process (`libnft.rs`; `nft -j -f -` where the library is missing), one atomic
//! transaction per call. Layout:
//!
//! - `forward`: from the bridge, traffic to the pool (other sandboxes) and IPv6 are dropped,
//!   then `ip saddr vmap @sandboxes` jumps to the sandbox's own chain; unknown sources are
//!   dropped. Towards the bridge only replies (ct established/related) pass.
//! - `sb_<addr hex>`: deny set -> reject, allow set -> accept, then the addresses the DNS
//!   proxy resolved for its domain rules (`dns<k>_<addr hex>`, one set per protocol/port
//!   combination, elements that time out with the answers' TTLs; a connection they opened is
//!   marked and kept when its address times out), else reject (counted). Every packet a
//!   sandbox sends is checked, so a policy change applies to open connections too.
//! - `input`: nothing from the bridge reaches the node itself (API, metrics, entry point)
//!   but the DNS proxy (UDP and TCP 53 on the bridge address).
//! - `postrouting` (nat): the pool is masqueraded behind the node's uplink.
//!
//! A second table, `bridge <bridge>`, holds microVMs to their own addresses: a guest owns
//! its kernel and could send as another sandbox (and get that one's policy) or claim the
//! gateway's MAC. Frames from a tap (`dst*` ports) pass only as IPv4 or ARP whose port,
//! source MAC and source address are in `ports` (one element per sandbox, added with it).

use std::io::Write;
use std::net::Ipv4Addr;
use std::process::{Command, Stdio};

use serde_json::{json, Value};

use super::policy::{DomainSpec, Element, Proto};
use super::NetError;

const FAMILY: &str = "inet";

fn chain_name(addr: Ipv4Addr) -> String {
    format!("sb_{:08x}", u32::from(addr))
}

fn set_name(kind: &str, addr: Ipv4Addr) -> String {
    format!("{kind}_{:08x}", u32::from(addr))
}

/// The conntrack mark bit of connections a resolved domain let through.
const DNS_MARK: u32 = 0x0040_0000;

fn dns_set_name(k: usize, addr: Ipv4Addr) -> String {
    format!("dns{k}_{:08x}", u32::from(addr))
}

fn ct_mark() -> Value {
    json!({"ct": {"key": "mark"}})
}

fn meta(key: &str) -> Value {
    json!({"meta": {"key": key}})
}

fn ip(field: &str) -> Value {
    json!({"payload": {"protocol": "ip", "field": field}})
}

fn is(left: Value, right: Value) -> Value {
    json!({"match": {"op": "==", "left": left, "right": right}})
}

fn is_not(left: Value, right: Value) -> Value {
    json!({"match": {"op": "!=", "left": left, "right": right}})
}

fn prefix(net: Ipv4Addr, len: u8) -> Value {
    json!({"prefix": {"addr": net.to_string(), "len": len}})
}

fn rule(table: &str, chain: &str, expr: Vec<Value>) -> Value {
    json!({"add": {"rule": {"family": FAMILY, "table": table, "chain": chain, "expr": expr}}})
}

fn dport() -> Value {
    json!({"payload": {"protocol": "th", "field": "dport"}})
}

fn policy_key() -> Value {
    json!({"concat": [ip("daddr"), meta("l4proto"), dport()]})
}

/// What a domain rule's protocol and ports match.
fn spec_match(spec: &DomainSpec) -> Vec<Value> {
    let (proto, ports) = *spec;
    let mut out = Vec::new();
    let name = |p: Proto| match p {
        Proto::Tcp => "tcp",
        Proto::Udp => "udp",
        Proto::Icmp => "icmp",
    };
    match proto {
        Some(p) => out.push(is(meta("l4proto"), json!(name(p)))),
        None if ports != (0, 65535) => {
            out.push(is(meta("l4proto"), json!({"set": ["tcp", "udp"]})))
        }
        None => {}
    }
    if ports != (0, 65535) {
        out.push(is(dport(), json!({"range": [ports.0, ports.1]})));
    }
    out
}

fn element(e: &Element) -> Value {
    json!({"concat": [
        {"range": [Ipv4Addr::from(e.addrs.0).to_string(), Ipv4Addr::from(e.addrs.1).to_string()]},
        {"range": [e.protos.0, e.protos.1]},
        {"range": [e.ports.0, e.ports.1]},
    ]})
}

/// The whole table with no sandboxes in it, replacing whatever was there (atomically: the
/// old rules hold until the new ones do).
/// The `bridge` family table: frames from taps pass only from their own MAC and address.
fn port_table(table: &str) -> Vec<Value> {
    let t = json!({"family": "bridge", "name": table});
    let from_tap = is(
        meta("iifname"),
        json!(format!("{}*", super::tap::TAP_PREFIX)),
    );
    let ether = |field: &str| json!({"payload": {"protocol": "ether", "field": field}});
    let arp = |field: &str| json!({"payload": {"protocol": "arp", "field": field}});
    let not_own = |mac: Value, addr: Value| {
        json!({"match": {"op": "!=", "left": {"concat": [meta("iifname"), mac, addr]},
            "right": "@ports"}})
    };
    let rule = |expr: Vec<Value>| {
        let mut all = vec![from_tap.clone()];
        all.extend(expr);
        all.extend([json!({"counter": null}), json!({"drop": null})]);
        json!({"add": {"rule": {"family": "bridge", "table": table, "chain": "prerouting",
            "expr": all}}})
    };
    vec![
        json!({"add": {"table": t}}),
        json!({"delete": {"table": t}}),
        json!({"add": {"table": t}}),
        json!({"add": {"set": {"family": "bridge", "table": table, "name": "ports",
            "type": ["ifname", "ether_addr", "ipv4_addr"]}}}),
        json!({"add": {"chain": {"family": "bridge", "table": table, "name": "prerouting",
            "type": "filter", "hook": "prerouting", "prio": -200, "policy": "accept"}}}),
        rule(vec![
            is(ether("type"), json!("ip")),
            not_own(ether("saddr"), ip("saddr")),
        ]),
        rule(vec![
            is(ether("type"), json!("arp")),
            not_own(ether("saddr"), arp("saddr ip")),
        ]),
        rule(vec![
            is(ether("type"), json!("arp")),
            not_own(arp("saddr ether"), arp("saddr ip")),
        ]),
        rule(vec![json!({"match": {"op": "!=", "left": ether("type"),
            "right": {"set": ["ip", "arp"]}}})]),
    ]
}

/// The `ports` element of the sandbox at `addr` (its tap, should it be a microVM).
fn port_element(table: &str, addr: Ipv4Addr) -> Value {
    json!({"family": "bridge", "table": table, "name": "ports",
        "elem": [{"concat": [super::tap::tap_name(addr), super::tap::mac_of(addr), addr.to_string()]}]})
}

pub(super) fn base_table(table: &str, bridge: &str, pool: (Ipv4Addr, u8)) -> Vec<Value> {
    let t = json!({"family": FAMILY, "name": table});
    let gateway = super::gateway_of(pool);
    let base_chain = |name: &str, kind: &str, hook: &str, prio: i32| {
        json!({"add": {"chain": {"family": FAMILY, "table": table, "name": name,
            "type": kind, "hook": hook, "prio": prio, "policy": "accept"}}})
    };
    // A rule of `chain` for packets coming in from (or going out to) the bridge.
    let on_bridge = |chain: &str, dir: &str, rest: Vec<Value>| {
        let mut expr = vec![is(meta(dir), json!(bridge))];
        expr.extend(rest);
        rule(table, chain, expr)
    };
    let ct_replies = json!({"match": {"op": "in", "left": {"ct": {"key": "state"}},
        "right": ["established", "related"]}});
    let (counter, drop) = (json!({"counter": null}), json!({"drop": null}));
    let mut cmds = port_table(table);
    cmds.extend([
        json!({"add": {"table": t}}),
        json!({"delete": {"table": t}}),
        json!({"add": {"table": t}}),
        json!({"add": {"map": {"family": FAMILY, "table": table, "name": "sandboxes",
            "type": "ipv4_addr", "map": "verdict"}}}),
        base_chain("forward", "filter", "forward", 0),
        on_bridge(
            "forward",
            "iifname",
            vec![
                is(ip("daddr"), prefix(pool.0, pool.1)),
                counter.clone(),
                drop.clone(),
            ],
        ),
        on_bridge(
            "forward",
            "iifname",
            vec![is(meta("nfproto"), json!("ipv6")), drop.clone()],
        ),
        on_bridge(
            "forward",
            "iifname",
            vec![json!({"vmap": {"key": ip("saddr"), "data": "@sandboxes"}})],
        ),
        on_bridge("forward", "iifname", vec![drop.clone()]),
        on_bridge(
            "forward",
            "oifname",
            vec![ct_replies, json!({"accept": null})],
        ),
        on_bridge("forward", "oifname", vec![drop.clone()]),
        base_chain("input", "filter", "input", 0),
        // The DNS proxy on the bridge address: the one service of the node a sandbox reaches.
        on_bridge(
            "input",
            "iifname",
            vec![
                is(ip("daddr"), json!(gateway.to_string())),
                is(meta("l4proto"), json!({"set": ["udp", "tcp"]})),
                is(dport(), json!(53)),
                json!({"accept": null}),
            ],
        ),
        on_bridge("input", "iifname", vec![counter, drop]),
        base_chain("postrouting", "nat", "postrouting", 100),
        rule(
            table,
            "postrouting",
            vec![
                is(ip("saddr"), prefix(pool.0, pool.1)),
                is_not(meta("oifname"), json!(bridge)),
                json!({"masquerade": null}),
            ],
        ),
    ]);
    cmds
}

fn set_elements(op: &str, table: &str, name: &str, elements: &[Element]) -> Option<Value> {
    (!elements.is_empty()).then(|| {
        json!({op: {"element": {"family": FAMILY, "table": table, "name": name,
            "elem": elements.iter().map(element).collect::<Vec<_>>()}}})
    })
}

/// A sandbox's chain, its allow, deny and resolved-address sets, and its entry in the
/// `sandboxes` map.
pub(super) fn add_sandbox(
    table: &str,
    addr: Ipv4Addr,
    allow: &[Element],
    deny: &[Element],
    domains: &[DomainSpec],
) -> Vec<Value> {
    let chain = chain_name(addr);
    let mut cmds = replace_policy(table, addr, allow, deny, domains, 0);
    cmds.push(
        json!({"add": {"element": {"family": FAMILY, "table": table, "name": "sandboxes",
        "elem": [[addr.to_string(), {"jump": {"target": chain}}]]}}}),
    );
    cmds.push(json!({"add": {"element": port_element(table, addr)}}));
    cmds
}

/// A sandbox's chain and sets, (re)written: emptied first, so that a policy change or a
/// sandbox that had this address before leaves nothing of its own (resolved addresses the
/// new policy still allows are added back by the caller, in the same transaction). The
/// sandbox had `old_dns_sets` sets of resolved addresses; it gets one per domain spec.
pub(super) fn replace_policy(
    table: &str,
    addr: Ipv4Addr,
    allow: &[Element],
    deny: &[Element],
    domains: &[DomainSpec],
    old_dns_sets: usize,
) -> Vec<Value> {
    let chain = chain_name(addr);
    let (allow_set, deny_set) = (set_name("allow", addr), set_name("deny", addr));
    let mut cmds = Vec::new();
    // Flushed after "add": whatever a sandbox that had this address left (a release that
    // failed) must not become this one's policy.
    for name in [&allow_set, &deny_set] {
        cmds.push(
            json!({"add": {"set": {"family": FAMILY, "table": table, "name": name,
            "type": ["ipv4_addr", "inet_proto", "inet_service"], "flags": ["interval"]}}}),
        );
        cmds.push(json!({"flush": {"set": {"family": FAMILY, "table": table, "name": name}}}));
    }
    // Only as many as needed: every set costs a few ms in each create's transaction.
    for k in 0..domains.len() {
        let name = dns_set_name(k, addr);
        cmds.push(
            json!({"add": {"set": {"family": FAMILY, "table": table, "name": name,
            "type": "ipv4_addr", "flags": ["timeout"]}}}),
        );
        cmds.push(json!({"flush": {"set": {"family": FAMILY, "table": table, "name": name}}}));
    }
    cmds.extend(set_elements("add", table, &allow_set, allow));
    cmds.extend(set_elements("add", table, &deny_set, deny));
    cmds.push(json!({"add": {"chain": {"family": FAMILY, "table": table, "name": chain}}}));
    cmds.push(json!({"flush": {"chain": {"family": FAMILY, "table": table, "name": chain}}}));
    // Once the chain no longer names them.
    for k in domains.len()..old_dns_sets {
        cmds.push(json!({"delete": {"set": {"family": FAMILY, "table": table, "name": dns_set_name(k, addr)}}}));
    }
    let reject = |set: Option<&str>| {
        let mut tcp = Vec::new();
        let mut other = Vec::new();
        if let Some(set) = set {
            tcp.push(is(policy_key(), json!(format!("@{set}"))));
            other.push(is(policy_key(), json!(format!("@{set}"))));
        }
        // A reset ends the sandbox's side of a TCP connection at once (also one that a
        // policy change just denied); the rest get "administratively prohibited".
        tcp.extend([
            is(meta("l4proto"), json!("tcp")),
            json!({"counter": null}),
            json!({"reject": {"type": "tcp reset"}}),
        ]);
        other.extend([
            json!({"counter": null}),
            json!({"reject": {"type": "icmpx", "expr": "admin-prohibited"}}),
        ]);
        [rule(table, &chain, tcp), rule(table, &chain, other)]
    };
    cmds.extend(reject(Some(&deny_set)));
    cmds.push(rule(
        table,
        &chain,
        vec![
            is(policy_key(), json!(format!("@{allow_set}"))),
            json!({"accept": null}),
        ],
    ));
    if !domains.is_empty() {
        // A connection to a resolved address lives on when the address times out.
        cmds.push(rule(
            table,
            &chain,
            vec![
                is(json!({"&": [ct_mark(), DNS_MARK]}), json!(DNS_MARK)),
                json!({"accept": null}),
            ],
        ));
    }
    for (k, spec) in domains.iter().enumerate() {
        let mut expr = vec![is(
            ip("daddr"),
            json!(format!("@{}", dns_set_name(k, addr))),
        )];
        expr.extend(spec_match(spec));
        expr.push(json!({"mangle": {"key": ct_mark(), "value": {"|": [ct_mark(), DNS_MARK]}}}));
        expr.push(json!({"accept": null}));
        cmds.push(rule(table, &chain, expr));
    }
    cmds.extend(reject(None));
    cmds
}

/// Addresses the DNS proxy resolved: (set index, address, seconds until they time out).
pub(super) fn add_resolved(
    table: &str,
    addr: Ipv4Addr,
    resolved: &[(usize, Ipv4Addr, u32)],
) -> Vec<Value> {
    resolved
        .iter()
        .map(|(k, ip, timeout)| {
            json!({"add": {"element": {"family": FAMILY, "table": table,
                "name": dns_set_name(*k, addr),
                "elem": [{"elem": {"val": ip.to_string(), "timeout": timeout}}]}}})
        })
        .collect()
}

/// Removes a sandbox's map entry, chain and sets (in this order: each command of the list
/// may also be applied on its own).
pub(super) fn remove_sandbox(table: &str, addr: Ipv4Addr, dns_sets: usize) -> Vec<Value> {
    let chain = chain_name(addr);
    let mut cmds = vec![
        json!({"delete": {"element": {"family": FAMILY, "table": table, "name": "sandboxes",
            "elem": [addr.to_string()]}}}),
        json!({"flush": {"chain": {"family": FAMILY, "table": table, "name": chain}}}),
        json!({"delete": {"chain": {"family": FAMILY, "table": table, "name": chain}}}),
        json!({"delete": {"element": port_element(table, addr)}}),
    ];
    for kind in ["allow", "deny"] {
        cmds.push(json!({"delete": {"set": {"family": FAMILY, "table": table, "name": set_name(kind, addr)}}}));
    }
    for k in 0..dns_sets {
        cmds.push(json!({"delete": {"set": {"family": FAMILY, "table": table, "name": dns_set_name(k, addr)}}}));
    }
    cmds
}

/// Deletes the table (nothing of it left is fine).
pub(super) fn delete_table(table: &str) -> Vec<Value> {
    let mut cmds = Vec::new();
    for family in [FAMILY, "bridge"] {
        let t = json!({"family": family, "name": table});
        cmds.push(json!({"add": {"table": t}}));
        cmds.push(json!({"delete": {"table": t}}));
    }
    cmds
}

/// Packets each sandbox's chain rejected, by sandbox address (from the chains' counters).
pub(super) fn denied_packets(table: &str) -> Result<Vec<(Ipv4Addr, u64)>, NetError> {
    let list = json!({"nftables": [{"list": {"table": {"family": FAMILY, "name": table}}}]});
    let output = match super::libnft::run(&list.to_string()) {
        Some(result) => result
            .map_err(|detail| NetError::Tool {
                tool: "libnftables",
                detail,
            })?
            .into_bytes(),
        None => {
            Command::new("nft")
                .args(["-j", "list", "table", FAMILY, table])
                .stderr(Stdio::null())
                .output()
                .map_err(|e| NetError::Tool {
                    tool: "nft",
                    detail: e.to_string(),
                })?
                .stdout
        }
    };
    let listing: Value = serde_json::from_slice(&output).map_err(|e| NetError::Tool {
        tool: "nft",
        detail: format!("unreadable listing of table {table}: {e}"),
    })?;
    let mut denied: std::collections::BTreeMap<Ipv4Addr, u64> = Default::default();
    for item in listing["nftables"].as_array().into_iter().flatten() {
        let rule = &item["rule"];
        let Some(addr) = rule["chain"]
            .as_str()
            .and_then(|c| c.strip_prefix("sb_"))
            .and_then(|hex| u32::from_str_radix(hex, 16).ok())
            .map(Ipv4Addr::from)
        else {
            continue;
        };
        for expr in rule["expr"].as_array().into_iter().flatten() {
            if let Some(packets) = expr["counter"]["packets"].as_u64() {
                *denied.entry(addr).or_default() += packets;
            }
        }
    }
    Ok(denied.into_iter().collect())
}

/// Runs one transaction: in this process through libnftables, or through `nft -j -f -`
/// where the library cannot be loaded.
pub(super) fn apply(commands: Vec<Value>) -> Result<(), NetError> {
    let input = json!({"nftables": commands}).to_string();
    if let Some(result) = super::libnft::run(&input) {
        return result.map(drop).map_err(|detail| NetError::Tool {
            tool: "libnftables",
            detail: detail.trim().chars().take(2000).collect(),
        });
    }
    let mut child = Command::new("nft")
        .args(["-j", "-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| NetError::Tool {
            tool: "nft",
            detail: format!("cannot start it ({e}); install Debian's nftables package"),
        })?;
    // nft reads all of its input before it answers, so writing first cannot dead-lock.
    let written = child
        .stdin
        .take()
        .map(|mut stdin| stdin.write_all(input.as_bytes()));
    let output = child.wait_with_output().map_err(|e| NetError::Tool {
        tool: "nft",
        detail: e.to_string(),
    })?;
    if !output.status.success() || !matches!(written, Some(Ok(()))) {
        let stderr = String::from_utf8_lossy(&output.stderr);
        return Err(NetError::Tool {
            tool: "nft",
            detail: stderr.trim().chars().take(2000).collect(),
        });
    }
    Ok(())
}
