//! The node's nftables table (`inet <bridge>`), written as nftables JSON through libnftables
//! in this process (`libnft.rs`; `nft -j -f -` where the library is missing), one atomic
//! transaction per call. Every rule and set is node-wide; a sandbox is only elements keyed
//! by its address, so a create's transaction costs the same however many sandboxes the
//! node holds (per-sandbox chains made each transaction slower as the table grew). Layout:
//!
//! - `forward`: from the bridge, traffic to the pool (other sandboxes) and IPv6 are dropped,
//!   the rest goes to `policy`. Towards the bridge only replies (ct established/related) pass.
//! - `policy`: sources not in `sandboxes` are dropped; then `deny` -> reject, `allow` ->
//!   accept (both `saddr . daddr . proto . dport` intervals), connections a resolved domain
//!   opened (ct mark) -> accept, and per domain-rule combination k: `dns<k>` (`saddr .
//!   resolved address`, elements that time out with the answers' TTLs) with `spec<k>`
//!   (`saddr . proto . dport`: the combination's protocols and ports for that sandbox) ->
//!   mark and accept; else reject. Rejections count in the sandbox's element of `denied`
//!   (a set with a counter per element). Every packet a sandbox sends is checked, so a policy
//!   change applies to open connections too.
//! - `input`: nothing from the bridge reaches the node itself (API, metrics, entry point)
//!   but the DNS proxy (UDP and TCP 53 on the bridge address).
//! - `postrouting` (nat): the pool is masqueraded behind the node's uplink.
//!
//! A second table, `bridge <bridge>`, holds microVMs to their own addresses: a guest owns
//! its kernel and could send as another sandbox (and get that one's policy) or claim the
//! gateway's MAC. Frames from a tap (`dst*` ports) pass only as IPv4 or ARP whose port,
//! source MAC and source address are in `ports` (one element per sandbox, added with it).

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::net::Ipv4Addr;
use std::process::{Command, Stdio};

use serde_json::{json, Value};

use super::policy::{DomainSpec, Element, MAX_DOMAIN_SPECS};
use super::NetError;

const FAMILY: &str = "inet";

/// The conntrack mark bit of connections a resolved domain let through.
const DNS_MARK: u32 = 0x0040_0000;

/// The chain every packet from a sandbox goes through.
const POLICY_CHAIN: &str = "policy";

fn dns_set(k: usize) -> String {
    format!("dns{k}")
}

fn spec_set(k: usize) -> String {
    format!("spec{k}")
}

/// One element a sandbox's policy puts in the node's sets (with the sandbox's address in
/// front).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Entry {
    Allow(Element),
    Deny(Element),
    /// Domain-rule combination k: protocols and ports its resolved addresses open.
    Spec(usize, (u8, u8), (u16, u16)),
}

impl Entry {
    fn set(&self) -> String {
        match self {
            Entry::Allow(_) => "allow".into(),
            Entry::Deny(_) => "deny".into(),
            Entry::Spec(k, ..) => spec_set(*k),
        }
    }

    fn elem(&self, addr: Ipv4Addr) -> Value {
        match self {
            Entry::Allow(e) | Entry::Deny(e) => json!({"concat": [
                addr.to_string(),
                {"range": [Ipv4Addr::from(e.addrs.0).to_string(), Ipv4Addr::from(e.addrs.1).to_string()]},
                {"range": [e.protos.0, e.protos.1]},
                {"range": [e.ports.0, e.ports.1]},
            ]}),
            Entry::Spec(_, protos, ports) => json!({"concat": [
                addr.to_string(),
                {"range": [protos.0, protos.1]},
                {"range": [ports.0, ports.1]},
            ]}),
        }
    }
}

/// A compiled policy's elements.
pub(super) fn entries(
    allow: &[Element],
    deny: &[Element],
    domains: &[DomainSpec],
) -> BTreeSet<Entry> {
    let mut out: BTreeSet<Entry> = allow.iter().copied().map(Entry::Allow).collect();
    out.extend(deny.iter().copied().map(Entry::Deny));
    for (k, (proto, ports)) in domains.iter().enumerate() {
        let protos = match proto {
            Some(p) => vec![(p.number(), p.number())],
            // Ports without a protocol mean TCP and UDP; neither means every protocol.
            None if *ports != (0, 65535) => vec![(6, 6), (17, 17)],
            None => vec![(0, 255)],
        };
        out.extend(protos.into_iter().map(|p| Entry::Spec(k, p, *ports)));
    }
    out
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

fn in_set(key: Vec<Value>, set: &str) -> Value {
    is(json!({"concat": key}), json!(format!("@{set}")))
}

/// `saddr . daddr . proto . dport`, the key of `allow` and `deny`.
fn policy_key() -> Vec<Value> {
    vec![ip("saddr"), ip("daddr"), meta("l4proto"), dport()]
}

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

/// The node-wide sets: membership, denied counters, policies, domain rules' resolved
/// addresses and their protocols and ports.
fn sets(table: &str) -> Vec<Value> {
    let set = |name: &str, kind: Value, extra: Value| {
        let mut set = json!({"family": FAMILY, "table": table, "name": name, "type": kind});
        if let (Some(set), Some(extra)) = (set.as_object_mut(), extra.as_object()) {
            set.extend(extra.clone());
        }
        json!({"add": {"set": set}})
    };
    let interval = json!({"flags": ["interval"]});
    let mut out = vec![
        set("sandboxes", json!("ipv4_addr"), json!({})),
        // A lookup that finds an element counts the packet in the element's counter.
        set(
            "denied",
            json!("ipv4_addr"),
            json!({"stmt": [{"counter": null}]}),
        ),
        set(
            "allow",
            json!(["ipv4_addr", "ipv4_addr", "inet_proto", "inet_service"]),
            interval.clone(),
        ),
        set(
            "deny",
            json!(["ipv4_addr", "ipv4_addr", "inet_proto", "inet_service"]),
            interval.clone(),
        ),
    ];
    for k in 0..MAX_DOMAIN_SPECS {
        out.push(set(
            &dns_set(k),
            json!(["ipv4_addr", "ipv4_addr"]),
            json!({"flags": ["timeout"]}),
        ));
        out.push(set(
            &spec_set(k),
            json!(["ipv4_addr", "inet_proto", "inet_service"]),
            interval.clone(),
        ));
    }
    out
}

/// The `policy` chain's rules (see the module's comment).
fn policy_rules(table: &str) -> Vec<Value> {
    let chain = POLICY_CHAIN;
    let counted = || is(ip("saddr"), json!("@denied"));
    // A reset ends the sandbox's side of a TCP connection at once (also one that a policy
    // change just denied); the rest get "administratively prohibited". The counting lookup
    // comes last, so only packets the rule rejects are counted.
    let reject = |mut tcp: Vec<Value>| {
        let mut other = tcp.clone();
        tcp.extend([
            is(meta("l4proto"), json!("tcp")),
            counted(),
            json!({"reject": {"type": "tcp reset"}}),
        ]);
        other.extend([
            counted(),
            json!({"reject": {"type": "icmpx", "expr": "admin-prohibited"}}),
        ]);
        [rule(table, chain, tcp), rule(table, chain, other)]
    };
    let mut out = vec![
        json!({"add": {"chain": {"family": FAMILY, "table": table, "name": chain}}}),
        rule(
            table,
            chain,
            vec![
                is_not(ip("saddr"), json!("@sandboxes")),
                json!({"drop": null}),
            ],
        ),
    ];
    out.extend(reject(vec![in_set(policy_key(), "deny")]));
    out.push(rule(
        table,
        chain,
        vec![in_set(policy_key(), "allow"), json!({"accept": null})],
    ));
    // A connection to a resolved address lives on when the address times out.
    out.push(rule(
        table,
        chain,
        vec![
            is(json!({"&": [ct_mark(), DNS_MARK]}), json!(DNS_MARK)),
            json!({"accept": null}),
        ],
    ));
    for k in 0..MAX_DOMAIN_SPECS {
        out.push(rule(
            table,
            chain,
            vec![
                in_set(vec![ip("saddr"), ip("daddr")], &dns_set(k)),
                in_set(vec![ip("saddr"), meta("l4proto"), dport()], &spec_set(k)),
                json!({"mangle": {"key": ct_mark(), "value": {"|": [ct_mark(), DNS_MARK]}}}),
                json!({"accept": null}),
            ],
        ));
    }
    out.extend(reject(Vec::new()));
    out.push(rule(table, chain, vec![json!({"drop": null})]));
    out
}

/// The whole table with no sandboxes in it, replacing whatever was there (atomically: the
/// old rules hold until the new ones do).
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
    ]);
    cmds.extend(sets(table));
    cmds.extend(policy_rules(table));
    cmds.extend([
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
            vec![json!({"jump": {"target": POLICY_CHAIN}})],
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

/// One command per set: `op` ("add" or "delete") the sandbox's `entries`.
fn entry_cmds<'a>(
    op: &str,
    table: &str,
    addr: Ipv4Addr,
    entries: impl Iterator<Item = &'a Entry>,
) -> Vec<Value> {
    let mut by_set: BTreeMap<String, Vec<Value>> = BTreeMap::new();
    for entry in entries {
        by_set
            .entry(entry.set())
            .or_default()
            .push(entry.elem(addr));
    }
    by_set
        .into_iter()
        .map(|(name, elem)| {
            json!({op: {"element": {"family": FAMILY, "table": table, "name": name, "elem": elem}}})
        })
        .collect()
}

fn own_element(op: &str, table: &str, set: &str, addr: Ipv4Addr) -> Value {
    json!({op: {"element": {"family": FAMILY, "table": table, "name": set,
        "elem": [addr.to_string()]}}})
}

/// A sandbox's elements: its policy's, its denied counter, its tap's port and (last, what
/// lets its packets in) its membership.
pub(super) fn add_sandbox(table: &str, addr: Ipv4Addr, policy: &BTreeSet<Entry>) -> Vec<Value> {
    let mut cmds = entry_cmds("add", table, addr, policy.iter());
    cmds.push(own_element("add", table, "denied", addr));
    cmds.push(json!({"add": {"element": port_element(table, addr)}}));
    cmds.push(own_element("add", table, "sandboxes", addr));
    cmds
}

/// Turns a sandbox's policy elements from `old` into `new` (only what differs).
pub(super) fn change_policy(
    table: &str,
    addr: Ipv4Addr,
    old: &BTreeSet<Entry>,
    new: &BTreeSet<Entry>,
) -> Vec<Value> {
    let mut cmds = entry_cmds("delete", table, addr, old.difference(new));
    cmds.extend(entry_cmds("add", table, addr, new.difference(old)));
    cmds
}

/// Addresses the DNS proxy resolved: (combination, address, seconds until they time out).
pub(super) fn add_resolved(
    table: &str,
    addr: Ipv4Addr,
    resolved: &[(usize, Ipv4Addr, u32)],
) -> Vec<Value> {
    resolved
        .iter()
        .map(|(k, ip, timeout)| {
            json!({"add": {"element": {"family": FAMILY, "table": table, "name": dns_set(*k),
                "elem": [{"elem": {"val": {"concat": [addr.to_string(), ip.to_string()]},
                    "timeout": timeout}}]}}})
        })
        .collect()
}

/// Removes resolved addresses, one command each (one that timed out meanwhile is gone
/// already, and its delete fails: the caller applies them one by one when the whole fails).
pub(super) fn remove_resolved(
    table: &str,
    addr: Ipv4Addr,
    resolved: &[(usize, Ipv4Addr)],
) -> Vec<Value> {
    resolved
        .iter()
        .map(|(k, ip)| {
            json!({"delete": {"element": {"family": FAMILY, "table": table, "name": dns_set(*k),
                "elem": [{"concat": [addr.to_string(), ip.to_string()]}]}}})
        })
        .collect()
}

/// Removes a sandbox's elements, its membership first (each command of the list may also be
/// applied on its own).
pub(super) fn remove_sandbox(table: &str, addr: Ipv4Addr, policy: &BTreeSet<Entry>) -> Vec<Value> {
    let mut cmds = vec![
        own_element("delete", table, "sandboxes", addr),
        own_element("delete", table, "denied", addr),
        json!({"delete": {"element": port_element(table, addr)}}),
    ];
    cmds.extend(entry_cmds("delete", table, addr, policy.iter()));
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

/// Packets each sandbox's policy rejected, by sandbox address (the counters of `denied`).
pub(super) fn denied_packets(table: &str) -> Result<Vec<(Ipv4Addr, u64)>, NetError> {
    let list = json!({"nftables": [{"list": {"set": {"family": FAMILY, "table": table, "name": "denied"}}}]});
    let output = match super::libnft::run(&list.to_string()) {
        Some(result) => result
            .map_err(|detail| NetError::Tool {
                tool: "libnftables",
                detail,
            })?
            .into_bytes(),
        None => {
            Command::new("nft")
                .args(["-j", "list", "set", FAMILY, table, "denied"])
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
        detail: format!("unreadable listing of set {table} denied: {e}"),
    })?;
    let mut denied = Vec::new();
    for item in listing["nftables"].as_array().into_iter().flatten() {
        for elem in item["set"]["elem"].as_array().into_iter().flatten() {
            let elem = &elem["elem"];
            if let (Some(addr), Some(packets)) = (
                elem["val"].as_str().and_then(|a| a.parse().ok()),
                elem["counter"]["packets"].as_u64(),
            ) {
                denied.push((addr, packets));
            }
        }
    }
    Ok(denied)
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
