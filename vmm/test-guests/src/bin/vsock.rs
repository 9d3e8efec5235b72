//! Drives the virtio-mmio vsock device from CPL 3 (see `dsec_test_guests::vsock`).
//!
//! Sequence (the host side lives in vmm/tests/test_guests.rs):
//! 1. probe + initialise the device, check the CID against `expect_cid=`;
//! 2. guest-initiated: connect to host port 6000, send `hello from guest <cid>\n`, expect
//!    `hello from host\n`, close; connect to port 6001 (nobody listens) and expect RST;
//! 3. print `READY` and serve host-initiated connections until done:
//!    - port 5000 (bulk): the host sends a u64 length L and L bytes of pattern seed 1; the
//!      guest verifies every word, then answers u64 hash, u64 mismatches, u64 L2 and L2 bytes
//!      of pattern seed 2 (`bulk_out=`, default 100M). `bulk=0` skips this;
//!    - port 5001 (echo): everything received is sent back; `streams=` (default 16) such
//!      connections must complete.
//!
//! `layout=1` uses single-descriptor packets instead of header + data chains;
//! `guest_connect=0` skips step 2.
#![no_std]
#![no_main]
#![allow(clippy::needless_range_loop)]

use dsec_test_guests::vsock::{State, Vsock, NCONN};
use dsec_test_guests::{
    boot_info_or_finish, check, fail, finish, hash_word, param_num, pass, pattern_word, println,
    rdtsc, HASH_INIT,
};

/// Generous TSC budgets (the frequency is not calibrated; assume at least ~1 GHz).
const WAIT_CYCLES: u64 = 30_000_000_000;
/// How long a closed connection may wait for the host's RST.
const CLOSE_CYCLES: u64 = 5_000_000_000;
const TOTAL_CYCLES: u64 = 250_000_000_000;

const TAG_BULK: u32 = 1;
const TAG_ECHO: u32 = 2;

fn wait(v: &mut Vsock, done: impl FnMut(&Vsock) -> bool) -> bool {
    wait_cycles(v, WAIT_CYCLES, done)
}

fn wait_cycles(v: &mut Vsock, budget: u64, mut done: impl FnMut(&Vsock) -> bool) -> bool {
    let t0 = rdtsc();
    while !done(v) {
        if rdtsc() - t0 > budget {
            return false;
        }
        if !v.poll() {
            core::hint::spin_loop();
        }
    }
    true
}

/// Reads exactly `out.len()` bytes (or fails on timeout / reset).
fn read_exact(v: &mut Vsock, id: usize, out: &mut [u8]) -> bool {
    let mut got = 0;
    let t0 = rdtsc();
    while got < out.len() {
        let s = v.peek(id);
        let n = s.len().min(out.len() - got);
        out[got..got + n].copy_from_slice(&s[..n]);
        v.consume(id, n);
        got += n;
        if got == out.len() {
            break;
        }
        if v.conns[id].state != State::Established || rdtsc() - t0 > WAIT_CYCLES {
            return false;
        }
        v.poll();
    }
    true
}

fn guest_initiated(v: &mut Vsock) {
    let Some(id) = v.connect(6000) else {
        fail(
            "vsock-guest-connect",
            format_args!("no free connection slot"),
        );
        return;
    };
    let ok = wait(v, |v| v.conns[id].state != State::Connecting);
    if !check!(
        ok && v.conns[id].state == State::Established,
        "vsock-guest-connect",
        "state {:?} (timeout: {})",
        v.conns[id].state,
        !ok
    ) {
        v.forget(id);
        return;
    }
    let mut msg = [0u8; 64];
    let mut w = Cursor {
        buf: &mut msg,
        len: 0,
    };
    let _ = core::fmt::write(&mut w, format_args!("hello from guest {}\n", v.cid));
    let len = w.len;
    let sent = v.send(id, &msg[..len]);
    let mut reply = [0u8; 16];
    let got = sent == len && read_exact(v, id, &mut reply);
    check!(
        got && &reply == b"hello from host\n",
        "vsock-guest-exchange",
        "sent {}/{} bytes, reply {:?}",
        sent,
        len,
        core::str::from_utf8(&reply).unwrap_or("?")
    );
    // We shut down both directions; the host must finish with RST (Linux waits 8 s, then
    // resets on its own, which is what we do after CLOSE_CYCLES).
    v.close(id);
    let t0 = rdtsc();
    let closed = wait_cycles(v, CLOSE_CYCLES, |v| {
        matches!(v.conns[id].state, State::Free | State::Reset)
    });
    check!(
        closed,
        "vsock-guest-close",
        "no RST from the host {} M cycles after our SHUTDOWN(both); state {:?}",
        (rdtsc() - t0) / 1_000_000,
        v.conns[id].state
    );
    if !closed {
        v.abort(id);
    }
    v.forget(id);

    let Some(id) = v.connect(6001) else {
        fail(
            "vsock-connect-refused",
            format_args!("no free connection slot"),
        );
        return;
    };
    let done = wait(v, |v| v.conns[id].state != State::Connecting);
    check!(
        done && v.conns[id].state == State::Reset,
        "vsock-connect-refused",
        "port 6001 has no listener: want RST, state {:?} (timeout: {})",
        v.conns[id].state,
        !done
    );
    v.forget(id);
}

struct Cursor<'a> {
    buf: &'a mut [u8],
    len: usize,
}

impl core::fmt::Write for Cursor<'_> {
    fn write_str(&mut self, s: &str) -> core::fmt::Result {
        let n = s.len().min(self.buf.len() - self.len);
        self.buf[self.len..self.len + n].copy_from_slice(&s.as_bytes()[..n]);
        self.len += n;
        Ok(())
    }
}

#[derive(PartialEq, Eq, Clone, Copy, Debug)]
enum Phase {
    Len,
    Data,
    Reply,
    Send,
    Close,
    Done,
}

/// Port 5000: verify the host's stream, answer with the hash, then send our own stream.
struct Bulk {
    id: usize,
    phase: Phase,
    head: [u8; 8],
    head_fill: usize,
    want: u64,
    got: u64,
    acc: [u8; 8],
    acc_fill: usize,
    hash: u64,
    mismatches: u64,
    out_len: u64,
    sent: u64,
    t_rx: u64,
    t_tx: u64,
}

impl Bulk {
    fn new(id: usize, out_len: u64) -> Bulk {
        Bulk {
            id,
            phase: Phase::Len,
            head: [0; 8],
            head_fill: 0,
            want: 0,
            got: 0,
            acc: [0; 8],
            acc_fill: 0,
            hash: HASH_INIT,
            mismatches: 0,
            out_len,
            sent: 0,
            t_rx: rdtsc(),
            t_tx: 0,
        }
    }

    fn word(&mut self, w: u64) {
        let k = (self.got - self.acc_fill as u64) / 8;
        if w != pattern_word(1, k) {
            self.mismatches += 1;
        }
        self.hash = hash_word(self.hash, w);
    }

    /// Hashes and verifies `data` (a piece of the stream at offset `self.got`).
    fn absorb(&mut self, mut data: &[u8]) {
        while self.acc_fill != 0 && !data.is_empty() {
            self.acc[self.acc_fill] = data[0];
            self.acc_fill += 1;
            self.got += 1;
            data = &data[1..];
            if self.acc_fill == 8 {
                self.acc_fill = 0;
                let w = u64::from_le_bytes(self.acc);
                self.got -= 8;
                self.word(w);
                self.got += 8;
            }
        }
        let mut chunks = data.chunks_exact(8);
        let mut k = self.got / 8;
        for c in &mut chunks {
            let w = u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
            if w != pattern_word(1, k) {
                self.mismatches += 1;
            }
            self.hash = hash_word(self.hash, w);
            k += 1;
        }
        self.got = k * 8;
        for &b in chunks.remainder() {
            self.acc[self.acc_fill] = b;
            self.acc_fill += 1;
            self.got += 1;
        }
    }

    fn step(&mut self, v: &mut Vsock) {
        let id = self.id;
        loop {
            match self.phase {
                Phase::Len => {
                    let s = v.peek(id);
                    let n = s.len().min(8 - self.head_fill);
                    self.head[self.head_fill..self.head_fill + n].copy_from_slice(&s[..n]);
                    v.consume(id, n);
                    self.head_fill += n;
                    if self.head_fill < 8 {
                        return;
                    }
                    self.want = u64::from_le_bytes(self.head);
                    self.phase = Phase::Data;
                }
                Phase::Data => {
                    let s = v.peek(id);
                    let n = (s.len() as u64).min(self.want - self.got) as usize;
                    if n == 0 && self.got < self.want {
                        return;
                    }
                    self.absorb(&s[..n]);
                    v.consume(id, n);
                    if self.got == self.want {
                        if self.acc_fill != 0 {
                            // Zero-pad a final partial word.
                            self.acc[self.acc_fill..].fill(0);
                            let w = u64::from_le_bytes(self.acc);
                            self.got -= self.acc_fill as u64;
                            self.word(w);
                            self.got += self.acc_fill as u64;
                            self.acc_fill = 0;
                        }
                        self.t_rx = rdtsc() - self.t_rx;
                        self.phase = Phase::Reply;
                    }
                }
                Phase::Reply => {
                    let mut m = [0u8; 24];
                    m[..8].copy_from_slice(&self.hash.to_le_bytes());
                    m[8..16].copy_from_slice(&self.mismatches.to_le_bytes());
                    m[16..].copy_from_slice(&self.out_len.to_le_bytes());
                    // 24 bytes always fit: the host's buffer is far larger and still empty.
                    if v.conns[id].credit() < 24 {
                        return;
                    }
                    v.send(id, &m);
                    self.t_tx = rdtsc();
                    self.phase = Phase::Send;
                }
                Phase::Send => {
                    let mut buf = [0u8; 64 * 1024];
                    while self.sent < self.out_len {
                        let credit = v.conns[id].credit() as u64;
                        if credit == 0 || v.conns[id].state != State::Established {
                            v.stall(id);
                            return;
                        }
                        let off = self.sent % 8;
                        let n = (self.out_len - self.sent)
                            .min(buf.len() as u64 - 8)
                            .min(credit);
                        let k0 = self.sent / 8;
                        let words = (off + n).div_ceil(8) as usize;
                        for i in 0..words {
                            buf[i * 8..i * 8 + 8]
                                .copy_from_slice(&pattern_word(2, k0 + i as u64).to_le_bytes());
                        }
                        let s = v.send(id, &buf[off as usize..(off + n) as usize]);
                        self.sent += s as u64;
                        if (s as u64) < n {
                            return;
                        }
                    }
                    self.t_tx = rdtsc() - self.t_tx;
                    self.phase = Phase::Close;
                }
                Phase::Close => {
                    // The host closes once it has read everything.
                    if v.conns[id].peer_shutdown == 0 {
                        return;
                    }
                    v.close(id);
                    self.phase = Phase::Done;
                }
                Phase::Done => return,
            }
        }
    }
}

#[no_mangle]
pub extern "C" fn main(info_addr: u64, kind: u64) -> ! {
    let bi = boot_info_or_finish(info_addr, kind);
    let cmdline = bi.cmdline();
    let single = param_num(cmdline, "layout") == Some(1);
    let streams = param_num(cmdline, "streams").unwrap_or(16);
    let bulk_wanted = param_num(cmdline, "bulk").unwrap_or(1) != 0;
    let bulk_out = param_num(cmdline, "bulk_out").unwrap_or(100 << 20);

    if param_num(cmdline, "mask_irq").unwrap_or(1) != 0 {
        dsec_test_guests::ioapic_mask(5);
    }
    let mut v = match Vsock::init(single) {
        Ok(v) => v,
        Err(e) => {
            fail("vsock-probe", format_args!("{}", e));
            finish()
        }
    };
    pass("vsock-probe");
    if let Some(want) = param_num(cmdline, "expect_cid") {
        check!(
            v.cid == want,
            "vsock-cid",
            "config guest_cid {}, want {}",
            v.cid,
            want
        );
    }
    v.listen(5000);
    v.listen(5001);
    if param_num(cmdline, "guest_connect").unwrap_or(1) != 0 {
        guest_initiated(&mut v);
    }
    // The host starts its connections now, so its timings measure only the transfers.
    println!("READY");

    let mut bulk: Option<Bulk> = None;
    let mut bulk_done = !bulk_wanted;
    let (mut echo_done, mut echo_bytes) = (0u64, 0u64);
    let mut echoed = [0u64; NCONN];
    let t0 = rdtsc();
    let t_echo = rdtsc();
    loop {
        v.poll();
        for id in 0..NCONN {
            let c = v.conns[id];
            if c.state == State::Free {
                continue;
            }
            if c.is_new {
                v.conns[id].is_new = false;
                v.conns[id].tag = match c.local_port {
                    5000 => TAG_BULK,
                    5001 => TAG_ECHO,
                    _ => 0,
                };
                echoed[id] = 0;
                if c.local_port == 5000 {
                    if bulk.is_some() {
                        fail("vsock-bulk", format_args!("second connection to port 5000"));
                    }
                    bulk = Some(Bulk::new(id, bulk_out));
                }
            }
            let tag = v.conns[id].tag;
            if tag == TAG_BULK {
                if let Some(b) = bulk.as_mut() {
                    b.step(&mut v);
                    if b.phase == Phase::Done && !bulk_done {
                        bulk_done = true;
                        check!(
                            b.mismatches == 0 && b.got == b.want && b.want > 0,
                            "vsock-bulk-rx",
                            "{} of {} bytes, {} mismatched words",
                            b.got,
                            b.want,
                            b.mismatches
                        );
                        check!(
                            b.sent == b.out_len,
                            "vsock-bulk-tx",
                            "sent {} of {}",
                            b.sent,
                            b.out_len
                        );
                        println!(
                            "bulk: rx {} bytes hash {:#018x} in {} M cycles, tx {} bytes in {} M cycles",
                            b.got,
                            b.hash,
                            b.t_rx / 1_000_000,
                            b.sent,
                            b.t_tx / 1_000_000
                        );
                    }
                }
            } else if tag == TAG_ECHO {
                echoed[id] += v.echo(id) as u64;
            }
            // Finished connections: the peer reset, or it shut down and we have echoed all.
            let c = v.conns[id];
            let echo_finished = tag == TAG_ECHO
                && c.state == State::Established
                && c.peer_shutdown != 0
                && c.available() == 0;
            if c.state == State::Reset {
                v.forget(id);
                if tag == TAG_ECHO {
                    echo_done += 1;
                    echo_bytes += echoed[id];
                }
                if tag == TAG_BULK && !bulk_done {
                    bulk_done = true;
                    let phase = bulk.as_ref().map(|b| b.phase);
                    fail(
                        "vsock-bulk",
                        format_args!("connection reset in phase {:?}", phase),
                    );
                }
            } else if echo_finished {
                v.conns[id].tag = 0;
                echo_done += 1;
                echo_bytes += echoed[id];
                v.close(id);
            }
        }
        if bulk_done && echo_done >= streams {
            break;
        }
        if rdtsc() - t0 > TOTAL_CYCLES {
            fail(
                "vsock-timeout",
                format_args!(
                    "bulk done {}, {} of {} echo streams",
                    bulk_done, echo_done, streams
                ),
            );
            break;
        }
    }
    if streams > 0 {
        check!(
            echo_done == streams,
            "vsock-echo-streams",
            "{} of {} streams",
            echo_done,
            streams
        );
        println!(
            "echo: {} streams, {} bytes in {} M cycles",
            echo_done,
            echo_bytes,
            (rdtsc() - t_echo) / 1_000_000
        );
    }
    // Let the last RSTs reach the device.
    wait(&mut v, |v| {
        v.conns
            .iter()
            .all(|c| c.state == State::Free || c.state == State::Closing)
    });
    let s = v.stats;
    println!(
        "stats: rx {} tx {} notifies {} credit_updates {} credit_requests {} events {} rst_unknown {}",
        s.rx_packets, s.tx_packets, s.notifies, s.credit_updates_sent, s.credit_requests_sent, s.events, s.rsts_for_unknown
    );
    check!(
        s.credit_violations == 0,
        "vsock-peer-credit",
        "peer overran our credit {} times",
        s.credit_violations
    );
    check!(
        s.bad_packets == 0,
        "vsock-packets",
        "{} malformed or misaddressed packets",
        s.bad_packets
    );
    finish()
}
