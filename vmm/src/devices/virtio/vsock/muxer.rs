//! The vsock device thread: moves packets between the guest's queues and host Unix sockets.
//! One epoll loop serves the queue kicks, the listening socket and every connection.

use std::collections::{HashMap, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use crate::memory::GuestMemory;
use virtio_queue::{Queue, QueueT, Reader, Writer};
use vm_memory::bitmap::BitmapSlice;
use vm_memory::ByteValued;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use super::packet::*;
use crate::devices::virtio::pause::PauseHandshake;
use crate::devices::virtio::Interrupt;

/// Per-VM bounds that keep a hostile guest or host client from growing our memory.
#[derive(Clone, Copy, Debug)]
pub struct MuxerLimits {
    pub max_connections: usize,
    /// Receive buffer we advertise per connection (guest -> host bytes in flight).
    pub buf_alloc: u32,
    /// Host bytes buffered per connection while waiting for guest credit.
    pub host_buffer: usize,
}

impl Default for MuxerLimits {
    fn default() -> Self {
        MuxerLimits {
            max_connections: 1024,
            buf_alloc: 256 * 1024,
            host_buffer: 256 * 1024,
        }
    }
}

const TOKEN_RX: u64 = 0;
const TOKEN_TX: u64 = 1;
const TOKEN_LISTENER: u64 = 2;
const TOKEN_STOP: u64 = 3;
const TOKEN_PAUSE: u64 = 4;
const TOKEN_EVENT: u64 = 5;
/// How long host connections wait for the guest to take in a transport reset before they
/// are offered anyway (a guest that never refills its event queue).
const RESET_ACK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3);
const TOKEN_FD_BASE: u64 = 16;
/// virtio-vsock event id telling the guest every connection is gone (after a restore).
const EVENT_TRANSPORT_RESET: u32 = 0;

const HANDSHAKE_MAX: usize = 64;
pub(super) const FIRST_HOST_PORT: u32 = 1 << 30;

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
struct Key {
    host_port: u32,
    guest_port: u32,
}

#[derive(PartialEq, Eq, Debug)]
enum State {
    /// Host connected and sent CONNECT; the guest has not answered yet.
    AwaitingGuest,
    Established,
}

struct Conn {
    stream: UnixStream,
    state: State,
    to_host: VecDeque<u8>,
    fwd_cnt: u32,
    fwd_cnt_reported: u32,
    from_host: VecDeque<u8>,
    tx_cnt: u32,
    peer_buf_alloc: u32,
    peer_fwd_cnt: u32,
    control: VecDeque<(u16, u32)>,
    host_eof: bool,
    guest_done_sending: bool,
    shutdown_sent: bool,
    close_after_flush: bool,
    interest: EventSet,
    registered: bool,
}

impl Conn {
    fn new(stream: UnixStream, state: State) -> Self {
        Conn {
            stream,
            state,
            to_host: VecDeque::new(),
            fwd_cnt: 0,
            fwd_cnt_reported: 0,
            from_host: VecDeque::new(),
            tx_cnt: 0,
            peer_buf_alloc: 0,
            peer_fwd_cnt: 0,
            control: VecDeque::new(),
            host_eof: false,
            guest_done_sending: false,
            shutdown_sent: false,
            close_after_flush: false,
            interest: EventSet::empty(),
            registered: false,
        }
    }

    /// Bytes the guest can still take on this stream.
    fn peer_credit(&self) -> u32 {
        let in_flight = self.tx_cnt.wrapping_sub(self.peer_fwd_cnt);
        self.peer_buf_alloc.saturating_sub(in_flight)
    }

    fn queue_control(&mut self, op: u16, flags: u32) {
        if !self.control.iter().any(|&(o, _)| o == op) {
            self.control.push_back((op, flags));
        }
    }
}

enum Entry {
    Handshake(UnixStream, Vec<u8>),
    Conn(Key),
}

pub struct Muxer {
    guest_cid: u64,
    uds_path: PathBuf,
    listener: UnixListener,
    mem: GuestMemory,
    rx: Queue,
    tx: Queue,
    event: Queue,
    rx_evt: EventFd,
    tx_evt: EventFd,
    event_evt: EventFd,
    stop: EventFd,
    pause: Arc<PauseHandshake>,
    interrupt: Arc<Interrupt>,
    limits: MuxerLimits,
    epoll: Epoll,
    conns: HashMap<Key, Conn>,
    fds: HashMap<RawFd, Entry>,
    /// RSTs for packets that match no connection.
    orphan_rsts: VecDeque<Header>,
    /// The host port the next host connection gets; shared with the device, whose snapshot
    /// keeps it (see `VsockState::next_host_port`).
    next_host_port: Arc<AtomicU32>,
    rx_starved: bool,
    /// Set when a transport reset was announced and the guest has not yet handed back its
    /// event buffer: until then a connection request could reach the guest ahead of the
    /// reset, which would then kill it without a word to the host (Linux sends no RST for
    /// sockets it resets), so new host connections wait.
    reset_unacked_since: Option<std::time::Instant>,
}

impl Muxer {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        guest_cid: u64,
        uds_path: PathBuf,
        listener: UnixListener,
        mem: GuestMemory,
        [rx, tx, event]: [Queue; 3],
        rx_evt: EventFd,
        tx_evt: EventFd,
        event_evt: EventFd,
        stop: EventFd,
        pause: Arc<PauseHandshake>,
        interrupt: Arc<Interrupt>,
        limits: MuxerLimits,
    ) -> std::io::Result<Self> {
        let epoll = Epoll::new()?;
        for (fd, token) in [
            (rx_evt.as_raw_fd(), TOKEN_RX),
            (tx_evt.as_raw_fd(), TOKEN_TX),
            (event_evt.as_raw_fd(), TOKEN_EVENT),
            (listener.as_raw_fd(), TOKEN_LISTENER),
            (stop.as_raw_fd(), TOKEN_STOP),
            (pause.event_fd(), TOKEN_PAUSE),
        ] {
            epoll.ctl(
                ControlOperation::Add,
                fd,
                EpollEvent::new(EventSet::IN, token),
            )?;
        }
        Ok(Muxer {
            guest_cid,
            uds_path,
            listener,
            mem,
            rx,
            tx,
            event,
            rx_evt,
            tx_evt,
            event_evt,
            stop,
            pause,
            interrupt,
            limits,
            epoll,
            conns: HashMap::new(),
            fds: HashMap::new(),
            orphan_rsts: VecDeque::new(),
            next_host_port: Arc::new(AtomicU32::new(FIRST_HOST_PORT)),
            rx_starved: false,
            reset_unacked_since: None,
        })
    }

    /// Allocates host ports from `next` (the device's counter, carried across snapshots).
    pub fn with_host_ports(mut self, next: Arc<AtomicU32>) -> Self {
        self.next_host_port = next;
        self
    }

    pub fn run(&mut self) {
        let mut events = vec![EpollEvent::default(); 64];
        // The guest may have queued packets before we started listening for kicks.
        self.process_tx();
        loop {
            // While a reset is unacknowledged, wake up to give up waiting on it.
            let timeout_ms = if self.reset_unacked_since.is_some() {
                100
            } else {
                -1
            };
            let n = match self.epoll.wait(timeout_ms, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::error!("vsock epoll failed, device stops: {e}");
                    return;
                }
            };
            for event in &events[..n] {
                match event.data() {
                    TOKEN_STOP => {
                        let _ = self.stop.read();
                        return;
                    }
                    TOKEN_RX => {
                        let _ = self.rx_evt.read();
                        self.rx_starved = false;
                    }
                    TOKEN_TX => {
                        let _ = self.tx_evt.read();
                        self.process_tx();
                    }
                    TOKEN_EVENT => {
                        // The guest refilled its event queue: it has handled the reset.
                        let _ = self.event_evt.read();
                        self.reset_unacked_since = None;
                    }
                    TOKEN_LISTENER => self.accept(),
                    TOKEN_PAUSE => self.pause.park([&self.rx, &self.tx, &self.event]),
                    token => self.handle_fd((token - TOKEN_FD_BASE) as RawFd, event.event_set()),
                }
            }
            if self
                .reset_unacked_since
                .is_some_and(|t| t.elapsed() >= RESET_ACK_TIMEOUT)
            {
                tracing::warn!("guest did not acknowledge the vsock transport reset; going on");
                self.reset_unacked_since = None;
            }
            self.process_rx();
            self.update_interests();
        }
    }

    /// After a restore no host connection survived: tell the guest to drop its sockets.
    pub fn announce_transport_reset(&mut self) {
        let mem = self.mem.clone();
        let Some(chain) = self.event.pop_descriptor_chain(&mem) else {
            tracing::warn!("guest gave no vsock event buffer; cannot announce the reset");
            return;
        };
        let head = chain.head_index();
        let written = match Writer::new(&mem, chain) {
            Ok(mut w) => match w.write_all(&EVENT_TRANSPORT_RESET.to_le_bytes()) {
                Ok(()) => 4,
                Err(_) => 0,
            },
            Err(_) => 0,
        };
        if self.event.add_used(&mem, head, written).is_ok() {
            tracing::debug!(written, "announced vsock transport reset");
            self.reset_unacked_since = Some(std::time::Instant::now());
            self.interrupt.signal_used_queue();
        }
    }

    fn accept(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((stream, _)) => {
                    if self.conns.len() + self.fds.len() >= 2 * self.limits.max_connections
                        || stream.set_nonblocking(true).is_err()
                    {
                        continue; // dropped: too many connections
                    }
                    let fd = stream.as_raw_fd();
                    let event = EpollEvent::new(EventSet::IN, TOKEN_FD_BASE + fd as u64);
                    if self.epoll.ctl(ControlOperation::Add, fd, event).is_ok() {
                        self.fds.insert(fd, Entry::Handshake(stream, Vec::new()));
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) => {
                    tracing::warn!("vsock accept failed: {e}");
                    return;
                }
            }
        }
    }

    fn handle_fd(&mut self, fd: RawFd, events: EventSet) {
        match self.fds.get_mut(&fd) {
            Some(Entry::Handshake(..)) => self.read_handshake(fd),
            Some(Entry::Conn(key)) => {
                let key = *key;
                self.service_conn(key, events);
            }
            None => {}
        }
    }

    fn read_handshake(&mut self, fd: RawFd) {
        let Some(Entry::Handshake(stream, buf)) = self.fds.get_mut(&fd) else {
            return;
        };
        let mut chunk = [0u8; HANDSHAKE_MAX];
        let room = HANDSHAKE_MAX - buf.len();
        match stream.read(&mut chunk[..room]) {
            Ok(0) => return self.drop_fd(fd),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == ErrorKind::WouldBlock => return,
            Err(_) => return self.drop_fd(fd),
        }
        let Some(newline) = buf.iter().position(|&b| b == b'\n') else {
            if buf.len() >= HANDSHAKE_MAX {
                self.drop_fd(fd);
            }
            return;
        };
        let port = std::str::from_utf8(&buf[..newline])
            .ok()
            .and_then(|line| line.strip_prefix("CONNECT "))
            .and_then(|p| p.trim().parse::<u32>().ok());
        let rest = buf[newline + 1..].to_vec();
        let Some(guest_port) = port else {
            return self.drop_fd(fd);
        };
        if self.conns.len() >= self.limits.max_connections {
            return self.drop_fd(fd);
        }
        let Some(Entry::Handshake(stream, _)) = self.fds.remove(&fd) else {
            return;
        };
        let host_port = self.allocate_host_port(guest_port);
        let key = Key {
            host_port,
            guest_port,
        };
        let mut conn = Conn::new(stream, State::AwaitingGuest);
        conn.registered = true;
        conn.interest = EventSet::IN;
        conn.from_host.extend(rest);
        conn.queue_control(OP_REQUEST, 0);
        self.conns.insert(key, conn);
        self.fds.insert(fd, Entry::Conn(key));
    }

    fn allocate_host_port(&mut self, guest_port: u32) -> u32 {
        loop {
            // Only this thread allocates; the device reads the counter while the muxer is paused.
            // The counter never holds a port below the first (new, restore and wrap-around
            // all start it there).
            let port = self.next_host_port.load(Ordering::Relaxed);
            self.next_host_port
                .store(port.wrapping_add(1).max(FIRST_HOST_PORT), Ordering::Relaxed);
            let key = Key {
                host_port: port,
                guest_port,
            };
            if !self.conns.contains_key(&key) {
                return port;
            }
        }
    }

    fn drop_fd(&mut self, fd: RawFd) {
        let _ = self
            .epoll
            .ctl(ControlOperation::Delete, fd, EpollEvent::default());
        if let Some(Entry::Conn(key)) = self.fds.remove(&fd) {
            self.conns.remove(&key);
        }
    }

    fn remove_conn(&mut self, key: Key) {
        if let Some(conn) = self.conns.get(&key) {
            let fd = conn.stream.as_raw_fd();
            self.drop_fd(fd);
        }
    }

    /// Host socket readiness: read into the bounded buffer, flush what the guest sent.
    fn service_conn(&mut self, key: Key, events: EventSet) {
        let host_buffer = self.limits.host_buffer;
        let Some(conn) = self.conns.get_mut(&key) else {
            return;
        };
        if events.contains(EventSet::IN) || events.contains(EventSet::HANG_UP) {
            let mut chunk = [0u8; 64 * 1024];
            while !conn.host_eof && conn.from_host.len() < host_buffer {
                let room = (host_buffer - conn.from_host.len()).min(chunk.len());
                match conn.stream.read(&mut chunk[..room]) {
                    Ok(0) => conn.host_eof = true,
                    Ok(n) => conn.from_host.extend(&chunk[..n]),
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(_) => conn.host_eof = true,
                }
            }
        }
        if events.contains(EventSet::HANG_UP) || events.contains(EventSet::ERROR) {
            // The host side is gone both ways: nothing more can be delivered to it.
            conn.host_eof = true;
            conn.to_host.clear();
        }
        self.flush_to_host(key);
    }

    fn flush_to_host(&mut self, key: Key) {
        let threshold = self.limits.buf_alloc / 4;
        let Some(conn) = self.conns.get_mut(&key) else {
            return;
        };
        while !conn.to_host.is_empty() {
            let (front, _) = conn.to_host.as_slices();
            match conn.stream.write(front) {
                Ok(n) => {
                    conn.to_host.drain(..n);
                    conn.fwd_cnt = conn.fwd_cnt.wrapping_add(n as u32);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(_) => {
                    conn.to_host.clear();
                    conn.host_eof = true;
                    conn.queue_control(OP_RST, 0);
                    break;
                }
            }
        }
        if conn.fwd_cnt.wrapping_sub(conn.fwd_cnt_reported) >= threshold {
            conn.queue_control(OP_CREDIT_UPDATE, 0);
        }
        if conn.to_host.is_empty() {
            if conn.guest_done_sending {
                let _ = conn.stream.shutdown(std::net::Shutdown::Write);
            }
            if conn.close_after_flush && conn.control.is_empty() {
                self.remove_conn(key);
            }
        }
    }

    /// Consumes every packet the guest queued on the tx queue.
    pub(super) fn process_tx(&mut self) {
        let mut used_any = false;
        let mem = self.mem.clone();
        while let Some(chain) = self.tx.pop_descriptor_chain(&mem) {
            let head = chain.head_index();
            match Reader::new(&mem, chain) {
                Ok(mut reader) => self.handle_guest_packet(&mut reader),
                Err(e) => tracing::debug!("malformed vsock tx descriptor chain: {e:?}"),
            }
            if self.tx.add_used(&self.mem, head, 0).is_err() {
                tracing::warn!("vsock tx used ring is invalid");
                break;
            }
            used_any = true;
        }
        if used_any && self.tx.needs_notification(&self.mem).unwrap_or(true) {
            self.interrupt.signal_used_queue();
        }
    }

    fn handle_guest_packet<B: BitmapSlice>(&mut self, reader: &mut Reader<'_, B>) {
        let Ok(header) = reader.read_obj::<Header>() else {
            return; // shorter than a header: nothing to answer
        };
        let len = header.len as usize;
        if header.src_cid != self.guest_cid || header.dst_cid != HOST_CID {
            return; // spoofed addresses are dropped silently
        }
        let key = Key {
            host_port: header.dst_port,
            guest_port: header.src_port,
        };
        if header.type_ != TYPE_STREAM || len > MAX_PAYLOAD || len > reader.available_bytes() {
            if header.op != OP_RST {
                self.reset(key, header);
            }
            return;
        }
        if header.op == OP_REQUEST {
            return self.guest_connect(key, header);
        }
        let Some(conn) = self.conns.get_mut(&key) else {
            if header.op != OP_RST {
                self.orphan_rsts.push_back(reply_header(&header, OP_RST));
            }
            return;
        };
        conn.peer_buf_alloc = header.buf_alloc;
        conn.peer_fwd_cnt = header.fwd_cnt;
        match header.op {
            OP_RESPONSE if conn.state == State::AwaitingGuest => {
                conn.state = State::Established;
                let reply = format!("OK {}\n", key.host_port);
                if conn.stream.write_all(reply.as_bytes()).is_err() {
                    conn.queue_control(OP_RST, 0);
                }
            }
            OP_RW if conn.state == State::Established => {
                if conn.to_host.len() + len > self.limits.buf_alloc as usize {
                    // The guest ignored the credit we gave it.
                    tracing::debug!("guest overran vsock credit; resetting the stream");
                    conn.queue_control(OP_RST, 0);
                    conn.close_after_flush = true;
                    conn.to_host.clear();
                    return;
                }
                let mut buf = vec![0u8; len];
                if reader.read_exact(&mut buf).is_ok() {
                    conn.to_host.extend(buf);
                }
                self.flush_to_host(key);
            }
            OP_CREDIT_UPDATE => {}
            OP_CREDIT_REQUEST => conn.queue_control(OP_CREDIT_UPDATE, 0),
            OP_SHUTDOWN => {
                if header.flags & SHUTDOWN_SEND != 0 {
                    conn.guest_done_sending = true;
                }
                if header.flags & (SHUTDOWN_SEND | SHUTDOWN_RCV) == SHUTDOWN_SEND | SHUTDOWN_RCV {
                    conn.queue_control(OP_RST, 0);
                    conn.close_after_flush = true;
                }
                self.flush_to_host(key);
            }
            OP_RST => self.remove_conn(key),
            _ => self.reset(key, header),
        }
    }

    fn reset(&mut self, key: Key, header: Header) {
        match self.conns.get_mut(&key) {
            Some(conn) => {
                conn.queue_control(OP_RST, 0);
                conn.close_after_flush = true;
                conn.to_host.clear();
            }
            None => self.orphan_rsts.push_back(reply_header(&header, OP_RST)),
        }
    }

    fn guest_connect(&mut self, key: Key, header: Header) {
        if self.conns.contains_key(&key) || self.conns.len() >= self.limits.max_connections {
            return self.orphan_rsts.push_back(reply_header(&header, OP_RST));
        }
        let mut path = self.uds_path.clone().into_os_string();
        path.push(format!("_{}", key.host_port));
        let stream = match UnixStream::connect(&path) {
            Ok(s) if s.set_nonblocking(true).is_ok() => s,
            _ => return self.orphan_rsts.push_back(reply_header(&header, OP_RST)),
        };
        let fd = stream.as_raw_fd();
        let event = EpollEvent::new(EventSet::IN, TOKEN_FD_BASE + fd as u64);
        if self.epoll.ctl(ControlOperation::Add, fd, event).is_err() {
            return self.orphan_rsts.push_back(reply_header(&header, OP_RST));
        }
        let mut conn = Conn::new(stream, State::Established);
        conn.registered = true;
        conn.interest = EventSet::IN;
        conn.peer_buf_alloc = header.buf_alloc;
        conn.peer_fwd_cnt = header.fwd_cnt;
        conn.queue_control(OP_RESPONSE, 0);
        self.conns.insert(key, conn);
        self.fds.insert(fd, Entry::Conn(key));
    }

    /// Picks the next packet for the guest, if any: (key, op, flags, payload length).
    fn next_outgoing(&mut self, room: usize) -> Option<(Key, u16, u32, usize)> {
        let mut pick = None;
        let hold_requests = self.reset_unacked_since.is_some();
        for (key, conn) in &mut self.conns {
            if hold_requests && conn.state == State::AwaitingGuest {
                continue;
            }
            if let Some(&(op, flags)) = conn.control.front() {
                pick = Some((*key, op, flags, 0));
                break;
            }
            if conn.state != State::Established {
                continue;
            }
            let credit = conn.peer_credit() as usize;
            if !conn.from_host.is_empty() && credit > 0 {
                let n = conn.from_host.len().min(credit).min(room).min(MAX_PAYLOAD);
                if n > 0 {
                    pick = Some((*key, OP_RW, 0, n));
                    break;
                }
            }
            if conn.host_eof && conn.from_host.is_empty() && !conn.shutdown_sent {
                pick = Some((*key, OP_SHUTDOWN, SHUTDOWN_SEND | SHUTDOWN_RCV, 0));
                break;
            }
        }
        pick
    }

    /// Fills guest rx buffers with control packets and host data.
    pub(super) fn process_rx(&mut self) {
        let mut used_any = false;
        let mem = self.mem.clone();
        while !self.rx_starved {
            let has_orphan = !self.orphan_rsts.is_empty();
            // Peek whether anything is pending before taking a buffer from the guest.
            if !has_orphan && self.next_outgoing(MAX_PAYLOAD).is_none() {
                break;
            }
            let Some(chain) = self.rx.pop_descriptor_chain(&mem) else {
                self.rx_starved = true;
                break;
            };
            let head = chain.head_index();
            let mut writer = match Writer::new(&mem, chain) {
                Ok(w) if w.available_bytes() >= HEADER_SIZE => w,
                _ => {
                    // Unusable buffer: give it back empty.
                    let _ = self.rx.add_used(&self.mem, head, 0);
                    used_any = true;
                    continue;
                }
            };
            let written = if let Some(header) = self.orphan_rsts.pop_front() {
                let _ = writer.write_all(header.as_slice());
                HEADER_SIZE
            } else {
                let room = writer.available_bytes() - HEADER_SIZE;
                match self.next_outgoing(room) {
                    Some(pick) => self.write_packet(&mut writer, pick),
                    None => 0,
                }
            };
            if self.rx.add_used(&self.mem, head, written as u32).is_err() {
                tracing::warn!("vsock rx used ring is invalid");
                break;
            }
            used_any = true;
        }
        if used_any && self.rx.needs_notification(&self.mem).unwrap_or(true) {
            self.interrupt.signal_used_queue();
        }
    }

    fn write_packet<B: BitmapSlice>(
        &mut self,
        writer: &mut Writer<'_, B>,
        pick: (Key, u16, u32, usize),
    ) -> usize {
        let (key, op, flags, len) = pick;
        let guest_cid = self.guest_cid;
        let buf_alloc = self.limits.buf_alloc;
        let Some(conn) = self.conns.get_mut(&key) else {
            return 0;
        };
        let header = Header {
            src_cid: HOST_CID,
            dst_cid: guest_cid,
            src_port: key.host_port,
            dst_port: key.guest_port,
            len: len as u32,
            type_: TYPE_STREAM,
            op,
            flags,
            buf_alloc,
            fwd_cnt: conn.fwd_cnt,
        };
        conn.fwd_cnt_reported = conn.fwd_cnt;
        if writer.write_all(header.as_slice()).is_err() {
            return 0;
        }
        match op {
            OP_RW => {
                let payload: Vec<u8> = conn.from_host.drain(..len).collect();
                if writer.write_all(&payload).is_err() {
                    return 0;
                }
                conn.tx_cnt = conn.tx_cnt.wrapping_add(len as u32);
            }
            OP_SHUTDOWN => conn.shutdown_sent = true,
            _ => {
                conn.control.pop_front();
                if op == OP_RST {
                    self.remove_conn(key);
                }
            }
        }
        HEADER_SIZE + len
    }

    /// Reads only when there is room to buffer, writes only when there is data.
    fn update_interests(&mut self) {
        let host_buffer = self.limits.host_buffer;
        for conn in self.conns.values_mut() {
            let mut wanted = EventSet::empty();
            if !conn.host_eof && conn.from_host.len() < host_buffer {
                wanted |= EventSet::IN;
            }
            if !conn.to_host.is_empty() {
                wanted |= EventSet::OUT;
            }
            if conn.host_eof && conn.to_host.is_empty() {
                // Fully done with the host side: stop HUP events from spinning the loop.
                if conn.registered {
                    let fd = conn.stream.as_raw_fd();
                    let _ = self
                        .epoll
                        .ctl(ControlOperation::Delete, fd, EpollEvent::default());
                    conn.registered = false;
                }
                continue;
            }
            if wanted != conn.interest && conn.registered {
                let fd = conn.stream.as_raw_fd();
                let event = EpollEvent::new(wanted, TOKEN_FD_BASE + fd as u64);
                if self.epoll.ctl(ControlOperation::Modify, fd, event).is_ok() {
                    conn.interest = wanted;
                }
            }
        }
    }
}

/// A reply addressed back to the sender of `header`.
fn reply_header(header: &Header, op: u16) -> Header {
    Header {
        src_cid: header.dst_cid,
        dst_cid: header.src_cid,
        src_port: header.dst_port,
        dst_port: header.src_port,
        len: 0,
        type_: TYPE_STREAM,
        op,
        flags: 0,
        buf_alloc: 0,
        fwd_cnt: 0,
    }
}
