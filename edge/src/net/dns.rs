//! The node's DNS proxy: sandboxes' resolver (UDP and TCP 53 on the bridge address; TCP is
//! what resolvers fall back to, with the same answers). It answers a
//! sandbox only names its policy's domain rules allow (A records; AAAA gets an empty
//! answer, sandboxes have IPv4 only), forwards them to the node's upstream resolver as a
//! fresh query, and adds the answers' addresses to that sandbox's nftables sets for their
//! TTLs before it replies, so the connection that follows the lookup passes. Everything
//! else is REFUSED: names no rule allows, other record types (TXT, ...), and names whose
//! part below a `*.suffix` looks like a tunnel (long or many labels).

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::{DNSClass, RData, RecordType};

use super::{nft, Network};

/// Queries answered at once; more are dropped (the client retries).
const MAX_IN_FLIGHT: usize = 64;
/// Labels and the longest label a name may have below a wildcard's suffix: enough for
/// `files.mirror.example.org`, too little to carry data out in names.
const MAX_WILDCARD_LABELS: usize = 3;
const MAX_WILDCARD_LABEL_LEN: usize = 24;
/// Bounds of how long a resolved address stays open for new connections.
const MIN_TTL: u32 = 5;
const MAX_TTL: u32 = 24 * 3600;
/// How long the upstream resolver gets per try, and how many tries.
const UPSTREAM_TIMEOUT: Duration = Duration::from_millis(1500);
const UPSTREAM_TRIES: usize = 2;
/// Refused queries written to a sandbox's event log per minute (a sandbox must not fill
/// the node's disk through its log).
pub(super) const MAX_LOG_LINES: u32 = 30;
/// Resolved names remembered per sandbox (to keep them open across a policy change).
pub(super) const MAX_REMEMBERED: usize = 1024;

/// A name the proxy resolved for a sandbox, open in the node's set `dns<set>` until `until`.
#[derive(Clone, Debug)]
pub(super) struct Resolved {
    pub name: String,
    pub set: usize,
    pub addr: Ipv4Addr,
    pub until: Instant,
}

/// TCP connections served at once; more wait in the listen queue.
const MAX_TCP_CONNECTIONS: usize = 32;
/// Queries one TCP connection may ask, and how long it may stay idle between them.
const MAX_TCP_QUERIES: usize = 16;
const TCP_IDLE: Duration = Duration::from_secs(5);

/// The proxy's sockets on the bridge address.
#[derive(Debug)]
pub(super) struct Sockets {
    udp: std::net::UdpSocket,
    tcp: std::net::TcpListener,
}

/// Binds the proxy's sockets on the bridge address (blocking).
pub(super) fn bind(gateway: Ipv4Addr) -> std::io::Result<Sockets> {
    let udp = std::net::UdpSocket::bind((gateway, 53))?;
    udp.set_nonblocking(true)?;
    let tcp = std::net::TcpListener::bind((gateway, 53))?;
    tcp.set_nonblocking(true)?;
    Ok(Sockets { udp, tcp })
}

/// Serves queries over UDP and TCP until the runtime ends.
pub(super) async fn serve(net: Arc<Network>, sockets: Sockets) {
    tokio::spawn(serve_tcp(net.clone(), sockets.tcp));
    serve_udp(net, sockets.udp).await
}

/// DNS over TCP (RFC 7766 framing: a 2-byte length before each message): the same answers
/// as over UDP, at most [`MAX_TCP_QUERIES`] per connection.
async fn serve_tcp(net: Arc<Network>, listener: std::net::TcpListener) {
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(err) => {
            tracing::error!(%err, "the DNS proxy cannot use its TCP socket; sandboxes resolve over UDP only");
            return;
        }
    };
    let permits = Arc::new(tokio::sync::Semaphore::new(MAX_TCP_CONNECTIONS));
    loop {
        let Ok(permit) = permits.clone().acquire_owned().await else {
            return;
        };
        let (stream, from) = match listener.accept().await {
            Ok(r) => r,
            Err(err) => {
                tracing::warn!(%err, "DNS proxy accept");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let net = net.clone();
        tokio::spawn(async move {
            let _ = serve_connection(&net, stream, from).await;
            drop(permit);
        });
    }
}

async fn serve_connection(
    net: &Network,
    mut stream: tokio::net::TcpStream,
    from: SocketAddr,
) -> std::io::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let timed_out = || std::io::Error::from(std::io::ErrorKind::TimedOut);
    for _ in 0..MAX_TCP_QUERIES {
        let mut len = [0u8; 2];
        tokio::time::timeout(TCP_IDLE, stream.read_exact(&mut len))
            .await
            .map_err(|_| timed_out())??;
        let mut query = vec![0u8; usize::from(u16::from_be_bytes(len))];
        tokio::time::timeout(TCP_IDLE, stream.read_exact(&mut query))
            .await
            .map_err(|_| timed_out())??;
        let Some(reply) = answer(net, from, &query).await else {
            return Ok(());
        };
        let Ok(len) = u16::try_from(reply.len()) else {
            return Ok(());
        };
        let mut framed = Vec::with_capacity(reply.len() + 2);
        framed.extend_from_slice(&len.to_be_bytes());
        framed.extend_from_slice(&reply);
        stream.write_all(&framed).await?;
    }
    Ok(())
}

/// Serves queries over UDP until the runtime ends.
async fn serve_udp(net: Arc<Network>, socket: std::net::UdpSocket) {
    let socket = match tokio::net::UdpSocket::from_std(socket) {
        Ok(s) => Arc::new(s),
        Err(err) => {
            tracing::error!(%err, "the DNS proxy cannot use its socket; sandboxes resolve nothing");
            return;
        }
    };
    let permits = Arc::new(tokio::sync::Semaphore::new(MAX_IN_FLIGHT));
    let mut buf = vec![0u8; 4096];
    loop {
        let (len, from) = match socket.recv_from(&mut buf).await {
            Ok(r) => r,
            Err(err) => {
                tracing::warn!(%err, "DNS proxy receive");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            continue;
        };
        let (net, socket, query) = (net.clone(), socket.clone(), buf[..len].to_vec());
        tokio::spawn(async move {
            if let Some(reply) = answer(&net, from, &query).await {
                let _ = socket.send_to(&reply, from).await;
            }
            drop(permit);
        });
    }
}

fn reply_to(query: &Message, code: ResponseCode) -> Message {
    let mut reply = Message::error_msg(query.metadata.id, OpCode::Query, code);
    reply.metadata.recursion_desired = query.metadata.recursion_desired;
    reply.metadata.recursion_available = true;
    reply.queries = query.queries.clone();
    reply
}

/// Whether the labels below a wildcard suffix look like a name and not like data.
fn plausible_below(below: &str) -> bool {
    below.is_empty()
        || (below.split('.').count() <= MAX_WILDCARD_LABELS
            && below.split('.').all(|l| l.len() <= MAX_WILDCARD_LABEL_LEN))
}

/// The reply to one datagram from `from`; None for what is not a DNS query at all.
async fn answer(net: &Network, from: SocketAddr, datagram: &[u8]) -> Option<Vec<u8>> {
    let query = Message::from_vec(datagram).ok()?;
    if query.metadata.message_type != MessageType::Query {
        return None;
    }
    let SocketAddr::V4(from) = from else {
        return None;
    };
    let policy = net.policy_of(*from.ip());
    let (Some((policy, generation)), [question]) = (policy, query.queries.as_slice()) else {
        net.log_refusal(
            *from.ip(),
            "network: DNS query refused: not exactly one question",
        );
        return reply_to(&query, ResponseCode::Refused).to_vec().ok();
    };
    let name = question.name().to_ascii().to_ascii_lowercase();
    let name = name.trim_end_matches('.');
    let sets: Vec<usize> = policy
        .domain_verdict(name)
        .into_iter()
        .filter(|(_, below)| plausible_below(below))
        .map(|(k, _)| k)
        .collect();
    let wanted = question.query_type();
    if sets.is_empty()
        || query.metadata.op_code != OpCode::Query
        || question.query_class() != DNSClass::IN
        || !matches!(wanted, RecordType::A | RecordType::AAAA)
    {
        let why = if sets.is_empty() {
            "no domain rule of the policy allows the name (or a deny rule names it, or it is tunnel-shaped)"
        } else {
            "only A and AAAA queries of class IN are answered"
        };
        let shown: String = name.chars().take(80).collect();
        net.log_refusal(
            *from.ip(),
            &format!("network: DNS query {wanted} {shown:?} refused: {why}"),
        );
        return reply_to(&query, ResponseCode::Refused).to_vec().ok();
    }
    if wanted == RecordType::AAAA {
        return reply_to(&query, ResponseCode::NoError).to_vec().ok();
    }
    let Some(upstream) = net.resolver else {
        return reply_to(&query, ResponseCode::ServFail).to_vec().ok();
    };
    let Some(response) = ask_upstream(upstream, question).await else {
        return reply_to(&query, ResponseCode::ServFail).to_vec().ok();
    };
    let mut reply = reply_to(&query, response.metadata.response_code);
    let mut opened = Vec::new();
    for record in response.answers {
        match &record.data {
            RData::A(a) => {
                let ttl = record.ttl.clamp(MIN_TTL, MAX_TTL);
                opened.extend(sets.iter().map(|k| (*k, a.0, ttl)));
                reply.answers.push(record);
            }
            RData::CNAME(_) => reply.answers.push(record),
            _ => {}
        }
    }
    if !opened.is_empty() {
        let (table, addr, name) = (net.bridge.clone(), *from.ip(), name.to_string());
        let cmds = nft::add_resolved(&table, addr, &opened);
        let applied = tokio::task::spawn_blocking(move || nft::apply(cmds)).await;
        if !matches!(applied, Ok(Ok(()))) {
            tracing::warn!(sandbox_addr = %addr, name, ?applied, "cannot open the resolved addresses");
            return reply_to(&query, ResponseCode::ServFail).to_vec().ok();
        }
        let now = Instant::now();
        let stale = net.remember(
            addr,
            generation,
            opened
                .iter()
                .map(|(set, ip, ttl)| Resolved {
                    name: name.clone(),
                    set: *set,
                    addr: *ip,
                    until: now + Duration::from_secs(u64::from(*ttl)),
                })
                .collect(),
        );
        if !stale.is_empty() {
            // Each alone: one may have timed out already.
            let cmds = nft::remove_resolved(&table, addr, &stale);
            let _ = tokio::task::spawn_blocking(move || {
                for cmd in cmds {
                    let _ = nft::apply(vec![cmd]);
                }
            })
            .await;
        }
    }
    reply.to_vec().ok()
}

/// Asks the upstream resolver the question in a query of our own (a fresh id, no EDNS or
/// other options of the sandbox's).
async fn ask_upstream(upstream: SocketAddr, question: &Query) -> Option<Message> {
    let socket = tokio::net::UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))
        .await
        .ok()?;
    socket.connect(upstream).await.ok()?;
    let mut ask = Message::query();
    ask.metadata.recursion_desired = true;
    ask.add_query(question.clone());
    let id = ask.metadata.id;
    let bytes = ask.to_vec().ok()?;
    let mut buf = vec![0u8; 4096];
    for _ in 0..UPSTREAM_TRIES {
        socket.send(&bytes).await.ok()?;
        let deadline = tokio::time::Instant::now() + UPSTREAM_TIMEOUT;
        while let Ok(Ok(len)) = tokio::time::timeout_at(deadline, socket.recv(&mut buf)).await {
            match Message::from_vec(&buf[..len]) {
                Ok(m)
                    if m.metadata.id == id
                        && m.metadata.message_type == MessageType::Response
                        && m.queries.as_slice() == std::slice::from_ref(question) =>
                {
                    return Some(m)
                }
                _ => continue,
            }
        }
    }
    tracing::warn!(%upstream, name = %question.name(), "the upstream resolver did not answer");
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tunnel_shaped_names_are_not_plausible() {
        assert!(plausible_below(""));
        assert!(plausible_below("files"));
        assert!(plausible_below("a.b.c"));
        assert!(!plausible_below("a.b.c.d"));
        assert!(!plausible_below("mzxw6ytboi2dqnzrgq3tgnbvgy3dsnzy"));
    }
}
