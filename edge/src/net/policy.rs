//! Network policies: what a sandbox may reach, parsed from the API's rule strings and the
//! operator's named policies, and compiled into non-overlapping nftables set elements.
//!
//! A rule is `[tcp:|udp:|icmp:]CIDR[:PORT[-PORT]]` (IPv4; a bare address is /32). Without a
//! protocol, a rule with ports means TCP and UDP, one without ports every protocol. A domain
//! rule is `[tcp:|udp:]NAME[:PORT[-PORT]]` with NAME exact (`pypi.example.org`) or a suffix
//! (`*.example.org`): the node's DNS proxy answers only such names and opens their answers'
//! addresses (see `dns.rs`). Any other entry (a letter first, no dot) names a policy of the
//! operator's file.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::Path;

/// Most rules one sandbox's policy may hold (allow + deny, after named policies are expanded).
pub const MAX_RULES: usize = 4096;
/// Most nftables elements a policy may compile to (overlapping rules split into pieces).
pub const MAX_ELEMENTS: usize = 65536;
/// Longest rule or policy name accepted.
pub const MAX_RULE_LEN: usize = 128;
/// Distinct protocol/port combinations among a policy's domain rules: the node's table has
/// this many sets of resolved addresses (and rules that look them up).
pub const MAX_DOMAIN_SPECS: usize = 8;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PolicyError {
    #[error("network rule {rule:?}: {why}; write [tcp:|udp:|icmp:]CIDR[:PORT[-PORT]], e.g. tcp:10.1.0.0/16:443")]
    BadRule { rule: String, why: String },
    #[error("unknown named network policy {name:?}: this node defines {known}; ask the operator to add it to the --policies file")]
    UnknownPolicy { name: String, known: String },
    #[error("network policy has {count} rules, at most {MAX_RULES} are allowed: use wider CIDRs or port ranges")]
    TooManyRules { count: usize },
    #[error("network policy compiles to more than {MAX_ELEMENTS} set elements (its rules overlap in many pieces): merge overlapping rules")]
    TooFragmented,
    #[error("network policy has {count} different protocol/port combinations among its domain rules, at most {MAX_DOMAIN_SPECS} are allowed: give domain rules the same port ranges")]
    TooManyDomainSpecs { count: usize },
    #[error("named policies file {path}: {why}; expected a JSON object {{\"NAME\": {{\"allow\": [RULE...], \"deny\": [RULE...]}}}}")]
    BadFile { path: String, why: String },
}

/// A transport protocol a rule names; None in [`Rule::proto`] means every protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Proto {
    Tcp,
    Udp,
    Icmp,
}

impl Proto {
    pub fn number(self) -> u8 {
        match self {
            Proto::Tcp => 6,
            Proto::Udp => 17,
            Proto::Icmp => 1,
        }
    }
}

/// One parsed rule: destination network, protocol (None: all), destination ports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rule {
    pub net: Ipv4Addr,
    pub prefix: u8,
    pub proto: Option<Proto>,
    /// Inclusive; (0, 65535) when the rule names no port.
    pub ports: (u16, u16),
}

impl Rule {
    /// Every address, protocol and port (what `allow_internet` means).
    pub const ANYWHERE: Rule = Rule {
        net: Ipv4Addr::UNSPECIFIED,
        prefix: 0,
        proto: None,
        ports: (0, 65535),
    };

    fn addr_range(&self) -> (u32, u32) {
        let start = u32::from(self.net) & !host_mask(self.prefix);
        (start, start | host_mask(self.prefix))
    }
}

fn bad_rule(text: &str, why: &str) -> PolicyError {
    PolicyError::BadRule {
        rule: text.chars().take(MAX_RULE_LEN).collect(),
        why: why.to_string(),
    }
}

/// A rule's protocol prefix and the rest, once its length is checked.
fn split_proto(text: &str) -> Result<(Option<Proto>, &str), PolicyError> {
    if text.len() > MAX_RULE_LEN {
        return Err(bad_rule(text, &format!("longer than {MAX_RULE_LEN} bytes")));
    }
    Ok(match text.split_once(':') {
        Some(("tcp", rest)) => (Some(Proto::Tcp), rest),
        Some(("udp", rest)) => (Some(Proto::Udp), rest),
        Some(("icmp", rest)) => (Some(Proto::Icmp), rest),
        _ => (None, text),
    })
}

impl std::str::FromStr for Rule {
    type Err = PolicyError;

    fn from_str(text: &str) -> Result<Self, PolicyError> {
        let bad = |why: &str| bad_rule(text, why);
        let (proto, rest) = split_proto(text)?;
        let (cidr, ports) = match rest.split_once(':') {
            Some((cidr, ports)) => (cidr, Some(ports)),
            None => (rest, None),
        };
        let (addr, prefix) = match cidr.split_once('/') {
            Some((addr, len)) => (
                addr,
                len.parse::<u8>()
                    .ok()
                    .filter(|l| *l <= 32)
                    .ok_or_else(|| bad(&format!("prefix length {len:?} is not 0-32")))?,
            ),
            None => (cidr, 32),
        };
        let net: Ipv4Addr = addr.parse().map_err(|_| {
            bad(&format!(
                "{addr:?} is not an IPv4 address (sandboxes have IPv4 only)"
            ))
        })?;
        let rule = Rule {
            net,
            prefix,
            proto,
            ports: (0, 65535),
        };
        if host_bits(net, prefix) {
            let masked = Ipv4Addr::from(u32::from(net) & !host_mask(prefix));
            return Err(bad(&format!(
                "{net}/{prefix} has host bits set (did you mean {masked}/{prefix}?)"
            )));
        }
        let Some(ports) = ports else {
            return Ok(rule);
        };
        let ports = parse_ports(proto, ports).map_err(|why| bad(&why))?;
        Ok(Rule { ports, ..rule })
    }
}

/// `PORT` or `LO-HI`, 1-65535, for TCP and UDP only.
fn parse_ports(proto: Option<Proto>, ports: &str) -> Result<(u16, u16), String> {
    if proto == Some(Proto::Icmp) {
        return Err("ICMP has no ports".into());
    }
    let port = |p: &str| {
        p.parse::<u32>()
            .ok()
            .filter(|p| (1..=65535).contains(p))
            .map(|p| p as u16)
            .ok_or_else(|| format!("port {p:?} is not 1-65535"))
    };
    let ports = match ports.split_once('-') {
        Some((lo, hi)) => (port(lo)?, port(hi)?),
        None => (port(ports)?, port(ports)?),
    };
    if ports.0 > ports.1 {
        return Err(format!("port range {}-{} is backwards", ports.0, ports.1));
    }
    Ok(ports)
}

/// A name a domain rule matches: exactly, or (`*.suffix`) any name below the suffix.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct DomainPattern {
    /// Lower case, no trailing dot.
    pub name: String,
    pub wildcard: bool,
}

impl DomainPattern {
    /// Whether `name` (lower case, no trailing dot) matches: the labels below a wildcard's
    /// suffix (what a tunnel would fill; "" for an exact match), else None.
    pub fn matches<'a>(&self, name: &'a str) -> Option<&'a str> {
        if self.wildcard {
            let below = name.strip_suffix(self.name.as_str())?.strip_suffix('.')?;
            (!below.is_empty()).then_some(below)
        } else {
            (name == self.name).then_some("")
        }
    }
}

impl std::fmt::Display for DomainPattern {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.wildcard {
            f.write_str("*.")?;
        }
        f.write_str(&self.name)
    }
}

/// Protocol (None: TCP and UDP with ports, else all) and destination ports a domain rule
/// opens on the addresses its names resolve to.
pub type DomainSpec = (Option<Proto>, (u16, u16));

/// `[tcp:|udp:]NAME[:PORT[-PORT]]`: the addresses NAME resolves to, on these ports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DomainRule {
    pub pattern: DomainPattern,
    pub proto: Option<Proto>,
    pub ports: (u16, u16),
}

impl DomainRule {
    pub fn spec(&self) -> DomainSpec {
        (self.proto, self.ports)
    }
}

/// Whether an entry is a domain rule: its host part has a dot and a letter or `*`.
fn is_domain(entry: &str) -> bool {
    let rest = ["tcp:", "udp:", "icmp:"]
        .iter()
        .find_map(|p| entry.strip_prefix(p))
        .unwrap_or(entry);
    let host = rest.split(':').next().unwrap_or("");
    host.contains('.') && host.contains(|c: char| c.is_ascii_alphabetic() || c == '*')
}

impl std::str::FromStr for DomainRule {
    type Err = PolicyError;

    fn from_str(text: &str) -> Result<Self, PolicyError> {
        let bad = |why: &str| bad_rule(text, why);
        let (proto, rest) = split_proto(text)?;
        if proto == Some(Proto::Icmp) {
            return Err(bad("domain rules are for TCP and UDP"));
        }
        let (host, ports) = match rest.split_once(':') {
            Some((host, ports)) => (host, Some(ports)),
            None => (rest, None),
        };
        let (wildcard, name) = match host.strip_prefix("*.") {
            Some(name) => (true, name),
            None => (false, host),
        };
        let name = name.to_ascii_lowercase();
        let labels: Vec<&str> = name.split('.').collect();
        let label_ok = |l: &&str| {
            (1..=63).contains(&l.len())
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        };
        if name.len() > 253 || labels.len() < 2 || !labels.iter().all(label_ok) {
            return Err(bad(&format!(
                "{host:?} is not a domain name (labels of letters, digits and -; `*.` only in front)"
            )));
        }
        let ports = match ports {
            Some(p) => parse_ports(proto, p).map_err(|why| bad(&why))?,
            None => (0, 65535),
        };
        Ok(DomainRule {
            pattern: DomainPattern { name, wildcard },
            proto,
            ports,
        })
    }
}

fn host_mask(prefix: u8) -> u32 {
    u32::MAX.checked_shr(u32::from(prefix)).unwrap_or(0)
}

fn host_bits(net: Ipv4Addr, prefix: u8) -> bool {
    u32::from(net) & host_mask(prefix) != 0
}

/// What a policy entry is: a rule, else (a letter first, no dot) the name of a policy.
fn is_name(entry: &str) -> bool {
    entry.starts_with(|c: char| c.is_ascii_alphabetic())
        && !entry.contains('.')
        && !["tcp:", "udp:", "icmp:"]
            .iter()
            .any(|p| entry.starts_with(p))
}

/// A policy as written: rule strings and policy names.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PolicyText {
    #[serde(default)]
    pub allow: Vec<String>,
    #[serde(default)]
    pub deny: Vec<String>,
}

/// A resolved policy: deny rules win over allow rules; nothing else is reachable.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Policy {
    pub allow: Vec<Rule>,
    pub deny: Vec<Rule>,
    /// Names the DNS proxy answers, and the ports their addresses are opened on.
    pub allow_domains: Vec<DomainRule>,
    /// Names the DNS proxy never answers (their ports do not matter).
    pub deny_domains: Vec<DomainPattern>,
}

impl Policy {
    pub fn is_empty(&self) -> bool {
        self.rule_count() == 0
    }

    fn rule_count(&self) -> usize {
        self.allow.len() + self.deny.len() + self.allow_domains.len() + self.deny_domains.len()
    }

    /// The distinct protocol/port combinations of the domain rules, in a stable order (a
    /// combination's index names its set of resolved addresses).
    pub fn domain_specs(&self) -> Vec<DomainSpec> {
        let mut specs: Vec<DomainSpec> = self.allow_domains.iter().map(DomainRule::spec).collect();
        specs.sort_unstable();
        specs.dedup();
        specs
    }

    /// Which sets of resolved addresses an answer for `name` goes to (indexes into
    /// [`Policy::domain_specs`]), each with the labels below the wildcard suffix the name
    /// matched through ("" for an exact match). Empty when a deny rule names it or no allow
    /// rule does.
    pub fn domain_verdict<'a>(&self, name: &'a str) -> Vec<(usize, &'a str)> {
        if self.deny_domains.iter().any(|d| d.matches(name).is_some()) {
            return Vec::new();
        }
        let specs = self.domain_specs();
        let mut out: Vec<(usize, &str)> = Vec::new();
        for rule in &self.allow_domains {
            if let Some(below) = rule.pattern.matches(name) {
                if let Some(k) = specs.iter().position(|s| *s == rule.spec()) {
                    out.push((k, below));
                }
            }
        }
        out
    }
}

/// One entry of a policy that is not a name.
enum Entry {
    Rule(Rule),
    Domain(DomainRule),
}

fn parse_entry(text: &str) -> Result<Entry, PolicyError> {
    if is_domain(text) {
        text.parse().map(Entry::Domain)
    } else {
        text.parse().map(Entry::Rule)
    }
}

fn push_entry(policy: &mut Policy, entry: Entry, deny: bool) {
    match (entry, deny) {
        (Entry::Rule(r), false) => policy.allow.push(r),
        (Entry::Rule(r), true) => policy.deny.push(r),
        (Entry::Domain(d), false) => policy.allow_domains.push(d),
        (Entry::Domain(d), true) => policy.deny_domains.push(d.pattern),
    }
}

/// The operator's named policies (`--policies FILE`).
#[derive(Clone, Debug, Default)]
pub struct NamedPolicies {
    policies: BTreeMap<String, Policy>,
}

impl NamedPolicies {
    /// Reads a JSON object of name -> {allow, deny}; names are letters, digits, `-`, `_`
    /// starting with a letter; their entries must be rules (no names inside names).
    pub fn load(path: &Path) -> Result<Self, PolicyError> {
        let bad = |why: String| PolicyError::BadFile {
            path: path.display().to_string(),
            why,
        };
        let text =
            std::fs::read_to_string(path).map_err(|e| bad(format!("cannot read it: {e}")))?;
        Self::parse(&text).map_err(|e| match e {
            PolicyError::BadFile { why, .. } => bad(why),
            other => bad(other.to_string()),
        })
    }

    pub fn parse(text: &str) -> Result<Self, PolicyError> {
        let bad = |why: String| PolicyError::BadFile {
            path: String::new(),
            why,
        };
        let raw: BTreeMap<String, PolicyText> =
            serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
        let mut policies = BTreeMap::new();
        for (name, text) in raw {
            if !is_name(&name)
                || name.len() > 63
                || !name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
            {
                return Err(bad(format!(
                    "policy name {name:?} must be 1-63 letters, digits, - or _, starting with a letter"
                )));
            }
            let mut policy = Policy::default();
            for (list, deny) in [(&text.allow, false), (&text.deny, true)] {
                for entry in list {
                    let entry =
                        parse_entry(entry).map_err(|e| bad(format!("policy {name:?}: {e}")))?;
                    push_entry(&mut policy, entry, deny);
                }
            }
            policies.insert(name, policy);
        }
        Ok(Self { policies })
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.policies.keys().map(String::as_str)
    }

    /// Resolves a policy as written: names expand to their rules (their deny rules too).
    pub fn resolve(&self, allow_internet: bool, text: &PolicyText) -> Result<Policy, PolicyError> {
        let mut policy = Policy::default();
        if allow_internet {
            policy.allow.push(Rule::ANYWHERE);
        }
        for (entries, deny) in [(&text.allow, false), (&text.deny, true)] {
            for entry in entries {
                if is_name(entry) {
                    let named = self.policies.get(entry).ok_or_else(|| {
                        let known: Vec<&str> = self.names().collect();
                        PolicyError::UnknownPolicy {
                            name: entry.chars().take(MAX_RULE_LEN).collect(),
                            known: if known.is_empty() {
                                "no named policies".into()
                            } else {
                                known.join(", ")
                            },
                        }
                    })?;
                    if deny {
                        // A named policy in the deny list denies what it would allow.
                        policy.deny.extend(&named.allow);
                        policy
                            .deny_domains
                            .extend(named.allow_domains.iter().map(|d| d.pattern.clone()));
                    } else {
                        policy.allow.extend(&named.allow);
                        policy.deny.extend(&named.deny);
                        policy
                            .allow_domains
                            .extend(named.allow_domains.iter().cloned());
                        policy
                            .deny_domains
                            .extend(named.deny_domains.iter().cloned());
                    }
                } else {
                    push_entry(&mut policy, parse_entry(entry)?, deny);
                }
                let count = policy.rule_count();
                if count > MAX_RULES {
                    return Err(PolicyError::TooManyRules {
                        count: entries.len().max(count),
                    });
                }
            }
        }
        let specs = policy.domain_specs().len();
        if specs > MAX_DOMAIN_SPECS {
            return Err(PolicyError::TooManyDomainSpecs { count: specs });
        }
        Ok(policy)
    }
}

/// One nftables set element: addresses x protocols x ports, all inclusive ranges.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Element {
    pub addrs: (u32, u32),
    pub protos: (u8, u8),
    pub ports: (u16, u16),
}

/// Addresses (first, last) and the disjoint port ranges allowed for all of them.
type Piece = (u64, u64, Vec<(u16, u16)>);

/// Protocol ranges that never overlap: TCP, UDP, ICMP and the protocols between them.
const PROTO_BUCKETS: [(u8, u8); 7] = [(0, 0), (1, 1), (2, 5), (6, 6), (7, 16), (17, 17), (18, 255)];

/// Compiles rules into non-overlapping elements (nftables refuses overlapping elements in a
/// set of concatenated ranges): per protocol bucket, a sweep over the address boundaries
/// unions the port ranges of the rules covering each address interval, and neighbouring
/// intervals with the same ports are merged.
pub fn compile(rules: &[Rule]) -> Result<Vec<Element>, PolicyError> {
    let mut out = Vec::new();
    for bucket in PROTO_BUCKETS {
        let covering: Vec<((u32, u32), (u16, u16))> = rules
            .iter()
            .filter(|r| match r.proto {
                None => true,
                Some(p) => p.number() == bucket.0 && bucket.0 == bucket.1,
            })
            .map(|r| {
                // Ports mean nothing to protocols other than TCP and UDP.
                let ports = if bucket == (6, 6) || bucket == (17, 17) {
                    r.ports
                } else {
                    (0, 65535)
                };
                (r.addr_range(), ports)
            })
            .collect();
        if covering.is_empty() {
            continue;
        }
        // Address boundaries as u64 so that the end of 255.255.255.255 fits.
        let mut bounds: Vec<u64> = covering
            .iter()
            .flat_map(|((lo, hi), _)| [u64::from(*lo), u64::from(*hi) + 1])
            .collect();
        bounds.sort_unstable();
        bounds.dedup();
        let mut previous: Option<Piece> = None;
        let flush = |piece: Option<Piece>, out: &mut Vec<Element>| {
            if let Some((lo, hi, ports)) = piece {
                for p in ports {
                    out.push(Element {
                        addrs: (lo as u32, hi as u32),
                        protos: bucket,
                        ports: p,
                    });
                }
            }
        };
        for pair in bounds.windows(2) {
            let (lo, hi) = (pair[0], pair[1] - 1);
            let mut ports: Vec<(u16, u16)> = covering
                .iter()
                .filter(|((a, b), _)| u64::from(*a) <= lo && hi <= u64::from(*b))
                .map(|(_, p)| *p)
                .collect();
            ports = merge_ranges(ports);
            match &mut previous {
                Some((_, prev_hi, prev_ports)) if *prev_hi + 1 == lo && *prev_ports == ports => {
                    *prev_hi = hi;
                }
                _ => {
                    flush(previous.take(), &mut out);
                    if !ports.is_empty() {
                        previous = Some((lo, hi, ports));
                    }
                }
            }
            if out.len() > MAX_ELEMENTS {
                return Err(PolicyError::TooFragmented);
            }
        }
        flush(previous.take(), &mut out);
        if out.len() > MAX_ELEMENTS {
            return Err(PolicyError::TooFragmented);
        }
    }
    Ok(out)
}

fn merge_ranges(mut ranges: Vec<(u16, u16)>) -> Vec<(u16, u16)> {
    ranges.sort_unstable();
    let mut merged: Vec<(u16, u16)> = Vec::with_capacity(ranges.len());
    for (lo, hi) in ranges {
        match merged.last_mut() {
            Some(last) if u32::from(lo) <= u32::from(last.1) + 1 => last.1 = last.1.max(hi),
            _ => merged.push((lo, hi)),
        }
    }
    merged
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(s: &str) -> Rule {
        s.parse().unwrap()
    }

    #[test]
    fn parses_rules() {
        assert_eq!(rule("10.0.0.0/8").addr_range(), (0x0a00_0000, 0x0aff_ffff));
        assert_eq!(rule("tcp:1.2.3.4:80").ports, (80, 80));
        assert_eq!(rule("udp:1.2.3.0/24:53-54").proto, Some(Proto::Udp));
        assert_eq!(rule("0.0.0.0/0").addr_range(), (0, u32::MAX));
        for bad in [
            "10.0.0.1/8",
            "10.0.0.0/33",
            "300.1.1.1",
            "tcp:1.2.3.4:0",
            "tcp:1.2.3.4:65536",
            "1.2.3.4:90-80",
            "icmp:1.2.3.4:5",
            "::1",
            "",
        ] {
            assert!(bad.parse::<Rule>().is_err(), "{bad} was accepted");
        }
        let err = "10.0.0.1/8".parse::<Rule>().unwrap_err().to_string();
        assert!(err.contains("did you mean 10.0.0.0/8"), "{err}");
    }

    #[test]
    fn domain_rules_parse_and_match() {
        let named = NamedPolicies::parse(
            r#"{"pypi": {"allow": ["tcp:pypi.org:443", "tcp:*.pythonhosted.org:443", "udp:ntp.test:123"]}}"#,
        )
        .unwrap();
        let text = PolicyText {
            allow: vec!["pypi".into(), "Mirror.Test:8000-8099".into()],
            deny: vec!["evil.pythonhosted.org".into()],
        };
        let policy = named.resolve(false, &text).unwrap();
        assert!(policy.allow.is_empty());
        assert_eq!(policy.allow_domains.len(), 4);
        // tcp:443 (two rules), udp:123 and the mirror's TCP+UDP range: three sets.
        assert_eq!(policy.domain_specs().len(), 3);
        assert_eq!(policy.domain_verdict("pypi.org").len(), 1);
        assert_eq!(
            policy.domain_verdict("files.pythonhosted.org"),
            vec![(
                policy
                    .domain_specs()
                    .iter()
                    .position(|s| *s == (Some(Proto::Tcp), (443, 443)))
                    .unwrap(),
                "files"
            )]
        );
        assert!(policy.domain_verdict("pythonhosted.org").is_empty());
        assert!(policy.domain_verdict("evil.pythonhosted.org").is_empty());
        assert!(policy.domain_verdict("xpypi.org").is_empty());
        assert_eq!(policy.domain_verdict("mirror.test").len(), 1);
        for bad in [
            "icmp:a.test",
            "tcp:a..test:1",
            "*.*.test",
            "tcp:a.test:0",
            "a_b.test",
        ] {
            assert!(
                matches!(parse_entry(bad), Err(PolicyError::BadRule { .. })),
                "{bad} was accepted"
            );
        }
        // A policy name has no dot; an address is not a domain.
        assert!(is_name("pypi") && !is_name("pypi.org"));
        assert!(!is_domain("10.0.0.0/8") && !is_domain("tcp:1.2.3.4:80"));
    }

    #[test]
    fn names_expand_and_unknown_names_are_refused() {
        let named = NamedPolicies::parse(
            r#"{"mirror": {"allow": ["tcp:198.18.1.2:8080"], "deny": ["198.18.1.3"]}}"#,
        )
        .unwrap();
        let text = PolicyText {
            allow: vec!["mirror".into(), "udp:1.1.1.1:53".into()],
            deny: vec![],
        };
        let policy = named.resolve(false, &text).unwrap();
        assert_eq!(policy.allow.len(), 2);
        assert_eq!(policy.deny, vec![rule("198.18.1.3")]);
        let unknown = PolicyText {
            allow: vec!["grading".into()],
            deny: vec![],
        };
        let err = named.resolve(false, &unknown).unwrap_err().to_string();
        assert!(
            err.contains("\"grading\"") && err.contains("mirror"),
            "{err}"
        );
        let huge = PolicyText {
            allow: (0..100_000)
                .map(|i| format!("10.{}.{}.0/24", i / 256 % 256, i % 256))
                .collect(),
            deny: vec![],
        };
        assert!(matches!(
            named.resolve(false, &huge),
            Err(PolicyError::TooManyRules { .. })
        ));
        assert!(NamedPolicies::parse(r#"{"1bad": {}}"#).is_err());
        assert!(NamedPolicies::parse(r#"{"x": {"allow": ["y"]}}"#).is_err());
    }

    #[test]
    fn compiled_elements_never_overlap_and_cover_the_rules() {
        let rules = [
            rule("10.0.0.0/8"),
            rule("tcp:10.1.2.3:80"),
            rule("tcp:10.1.0.0/16:1-1000"),
            rule("tcp:10.1.0.0/16:500-2000"),
            rule("udp:10.2.0.0/16:53"),
        ];
        let elements = compile(&rules).unwrap();
        for (i, a) in elements.iter().enumerate() {
            for b in &elements[i + 1..] {
                let overlap = |x: (u64, u64), y: (u64, u64)| x.0 <= y.1 && y.0 <= x.1;
                assert!(
                    !(overlap(
                        (a.addrs.0.into(), a.addrs.1.into()),
                        (b.addrs.0.into(), b.addrs.1.into())
                    ) && overlap(
                        (a.protos.0.into(), a.protos.1.into()),
                        (b.protos.0.into(), b.protos.1.into())
                    ) && overlap(
                        (a.ports.0.into(), a.ports.1.into()),
                        (b.ports.0.into(), b.ports.1.into())
                    )),
                    "{a:?} overlaps {b:?}"
                );
            }
        }
        // 10/8 covers everything else: one element per protocol bucket.
        assert_eq!(elements.len(), PROTO_BUCKETS.len());
        let tcp_only = compile(&[
            rule("tcp:10.1.0.0/16:1-1000"),
            rule("tcp:10.1.0.0/16:500-2000"),
        ])
        .unwrap();
        assert_eq!(
            tcp_only,
            vec![Element {
                addrs: (0x0a01_0000, 0x0a01_ffff),
                protos: (6, 6),
                ports: (1, 2000)
            }]
        );
        assert!(compile(&[]).unwrap().is_empty());
    }
}
