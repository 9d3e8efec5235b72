//! Drives virtio-net against the host kernel on the other end of a tap (see
//! vmm/tests/test_guests.rs): the guest is 10.77.0.2, the host 10.77.0.1. It resolves the host
//! with ARP, pings it (ICMP echo), prints READY, then answers ARP for its address and echoes
//! UDP datagrams back until `udp_echo=` (default 4) have been echoed.
#![no_std]
#![no_main]

use dsec_test_guests::virtio::{Device, Queue};
use dsec_test_guests::{boot_info_or_finish, check, fail, finish, param_num, pass, println, rdtsc};

const WAIT: u64 = 30_000_000_000;
const HDR: usize = 12;
const BUF: usize = 2048;
const NRX: usize = 16;
const ME: [u8; 4] = [10, 77, 0, 2];
const HOST: [u8; 4] = [10, 77, 0, 1];

static mut RXB: [[u8; BUF]; NRX] = [[0; BUF]; NRX];
static mut TXB: [u8; BUF] = [0; BUF];

struct Nic {
    rx: Queue,
    tx: Queue,
    head_to_buf: [u8; 64],
    mac: [u8; 6],
}

fn rxbuf(i: usize) -> u64 {
    // Address computation only (i < NRX).
    core::ptr::addr_of!(RXB) as u64 + (i * BUF) as u64
}

fn txbuf() -> &'static mut [u8; BUF] {
    // SAFETY: single-threaded guest; the device reads TXB only while a send is in flight and
    // `send` waits for it to complete before returning.
    unsafe { &mut *core::ptr::addr_of_mut!(TXB) }
}

fn csum(data: &[u8]) -> u16 {
    let mut sum = 0u32;
    for c in data.chunks(2) {
        let w = if c.len() == 2 {
            u16::from_be_bytes([c[0], c[1]])
        } else {
            u16::from(c[0]) << 8
        };
        sum += u32::from(w);
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

impl Nic {
    fn post(&mut self, i: usize) {
        let head = self.rx.submit(&[(rxbuf(i), BUF as u32, true)]);
        self.head_to_buf[usize::from(head)] = i as u8;
    }

    /// Sends `len` bytes of TXB after the (zero) virtio-net header.
    fn send(&mut self, len: usize) -> bool {
        txbuf()[..HDR].fill(0);
        let a = core::ptr::addr_of!(TXB) as u64;
        self.tx
            .call(&[(a, (HDR + len) as u32, false)], WAIT)
            .is_some()
    }

    /// Next received frame (without the header) handed to `f`; the buffer is re-posted.
    fn recv<R>(&mut self, mut f: impl FnMut(&[u8]) -> R) -> Option<R> {
        let (head, len) = self.rx.pop()?;
        let i = usize::from(self.head_to_buf[(head as usize) % 64]);
        let len = (len as usize).min(BUF);
        // SAFETY: the device finished writing buffer i (it is in the used ring).
        let frame = unsafe { dsec_test_guests::phys_slice(rxbuf(i), len) };
        let r = f(frame.get(HDR..).unwrap_or(&[]));
        self.post(i);
        self.rx.notify();
        Some(r)
    }

    fn eth(&self, dst: [u8; 6], ethertype: u16) {
        let t = &mut txbuf()[HDR..];
        t[0..6].copy_from_slice(&dst);
        t[6..12].copy_from_slice(&self.mac);
        t[12..14].copy_from_slice(&ethertype.to_be_bytes());
    }

    fn arp(&mut self, op: u16, dst_mac: [u8; 6], dst_ip: [u8; 4]) -> bool {
        let eth_dst = if op == 1 { [0xff; 6] } else { dst_mac };
        self.eth(eth_dst, 0x0806);
        let t = &mut txbuf()[HDR + 14..];
        t[0..8].copy_from_slice(&[0, 1, 8, 0, 6, 4, 0, op as u8]);
        t[8..14].copy_from_slice(&self.mac);
        t[14..18].copy_from_slice(&ME);
        t[18..24].copy_from_slice(&dst_mac);
        t[24..28].copy_from_slice(&dst_ip);
        self.send(14 + 28)
    }

    /// IPv4 header + payload already at HDR+14+20; fills the IP header and sends.
    fn ip(&mut self, dst_mac: [u8; 6], dst: [u8; 4], proto: u8, payload: usize) -> bool {
        self.eth(dst_mac, 0x0800);
        let t = &mut txbuf()[HDR + 14..];
        let total = (20 + payload) as u16;
        t[0..20].fill(0);
        t[0] = 0x45;
        t[2..4].copy_from_slice(&total.to_be_bytes());
        t[8] = 64;
        t[9] = proto;
        t[12..16].copy_from_slice(&ME);
        t[16..20].copy_from_slice(&dst);
        let c = csum(&t[0..20]);
        t[10..12].copy_from_slice(&c.to_be_bytes());
        self.send(14 + 20 + payload)
    }
}

#[derive(Clone, Copy)]
enum Frame {
    ArpReply([u8; 6], [u8; 4]),
    ArpRequest([u8; 6], [u8; 4], [u8; 4]),
    EchoReply(u16, u16),
    Udp([u8; 6], [u8; 4], u16, u16, usize),
    Other,
}

fn parse(f: &[u8], payload: &mut [u8; 1500]) -> Frame {
    if f.len() < 42 {
        return Frame::Other;
    }
    let src_mac: [u8; 6] = f[6..12].try_into().unwrap_or_default();
    let ethertype = u16::from_be_bytes([f[12], f[13]]);
    let p = &f[14..];
    if ethertype == 0x0806 {
        let sha: [u8; 6] = p[8..14].try_into().unwrap_or_default();
        let spa: [u8; 4] = p[14..18].try_into().unwrap_or_default();
        let tpa: [u8; 4] = p[24..28].try_into().unwrap_or_default();
        return match p[7] {
            2 => Frame::ArpReply(sha, spa),
            1 => Frame::ArpRequest(sha, spa, tpa),
            _ => Frame::Other,
        };
    }
    if ethertype != 0x0800 || p[9] == 0 || p[16..20] != ME {
        return Frame::Other;
    }
    let ihl = usize::from(p[0] & 0xf) * 4;
    let total = usize::from(u16::from_be_bytes([p[2], p[3]])).min(p.len());
    let l4 = &p[ihl.min(total)..total];
    let src: [u8; 4] = p[12..16].try_into().unwrap_or_default();
    match p[9] {
        1 if l4.len() >= 8 && l4[0] == 0 => Frame::EchoReply(
            u16::from_be_bytes([l4[4], l4[5]]),
            u16::from_be_bytes([l4[6], l4[7]]),
        ),
        17 if l4.len() >= 8 => {
            let n = (l4.len() - 8).min(1500);
            payload[..n].copy_from_slice(&l4[8..8 + n]);
            Frame::Udp(
                src_mac,
                src,
                u16::from_be_bytes([l4[0], l4[1]]),
                u16::from_be_bytes([l4[2], l4[3]]),
                n,
            )
        }
        _ => Frame::Other,
    }
}

#[no_mangle]
pub extern "C" fn main(info_addr: u64, kind: u64) -> ! {
    let bi = boot_info_or_finish(info_addr, kind);
    let cmdline = bi.cmdline();
    let Some(dev) = Device::find(1, 0) else {
        fail("net-probe", format_args!("no virtio-net device"));
        finish()
    };
    dsec_test_guests::ioapic_mask(dev.irq());
    if dev.begin(1 << 5).is_err() {
        fail("net-features", format_args!("status {:#x}", dev.status()));
        finish()
    }
    let (Some(rx), Some(tx)) = (dev.queue(0), dev.queue(1)) else {
        fail("net-queues", format_args!("missing queue"));
        finish()
    };
    let mut mac = [0u8; 6];
    for (i, m) in mac.iter_mut().enumerate() {
        *m = dev.read_config8(i as u64);
    }
    let mut nic = Nic {
        rx,
        tx,
        head_to_buf: [0; 64],
        mac,
    };
    for i in 0..NRX {
        nic.post(i);
    }
    dev.driver_ok();
    nic.rx.notify();
    pass("net-probe");
    println!(
        "mac: {:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
        mac[0], mac[1], mac[2], mac[3], mac[4], mac[5]
    );

    let mut payload = [0u8; 1500];
    // ARP for the host (retry: the tap may still be coming up).
    let mut host_mac = None;
    let t0 = rdtsc();
    let mut last = 0;
    while host_mac.is_none() && rdtsc() - t0 < WAIT {
        if last == 0 || rdtsc() - last > 1_000_000_000 {
            nic.arp(1, [0; 6], HOST);
            last = rdtsc();
        }
        if let Some(Frame::ArpReply(m, ip)) = nic.recv(|f| parse(f, &mut payload)) {
            if ip == HOST {
                host_mac = Some(m);
            }
        }
    }
    let Some(host_mac) = host_mac else {
        fail("net-arp", format_args!("no ARP reply from {:?}", HOST));
        finish()
    };
    pass("net-arp");

    // ICMP echo to the host kernel.
    let icmp = &mut txbuf()[HDR + 34..HDR + 34 + 64];
    icmp.fill(0x61);
    icmp[0..8].copy_from_slice(&[8, 0, 0, 0, 0x12, 0x34, 0, 1]);
    let c = csum(icmp);
    icmp[2..4].copy_from_slice(&c.to_be_bytes());
    nic.ip(host_mac, HOST, 1, 64);
    let t0 = rdtsc();
    let mut echoed = false;
    while !echoed && rdtsc() - t0 < WAIT {
        echoed = matches!(
            nic.recv(|f| parse(f, &mut payload)),
            Some(Frame::EchoReply(0x1234, 1))
        );
    }
    check!(echoed, "net-icmp-echo", "no echo reply from the host");
    println!("READY");

    let want = param_num(cmdline, "udp_echo").unwrap_or(4);
    let mut done = 0;
    let t0 = rdtsc();
    while done < want && rdtsc() - t0 < WAIT * 2 {
        match nic.recv(|f| parse(f, &mut payload)) {
            Some(Frame::ArpRequest(m, ip, tpa)) if tpa == ME => {
                nic.arp(2, m, ip);
            }
            Some(Frame::Udp(m, src, sport, dport, n)) => {
                let u = &mut txbuf()[HDR + 34..HDR + 34 + 8 + n];
                u[0..2].copy_from_slice(&dport.to_be_bytes());
                u[2..4].copy_from_slice(&sport.to_be_bytes());
                u[4..6].copy_from_slice(&((8 + n) as u16).to_be_bytes());
                u[6..8].fill(0); // no UDP checksum (optional over IPv4)
                u[8..].copy_from_slice(&payload[..n]);
                nic.ip(m, src, 17, 8 + n);
                done += 1;
            }
            _ => {}
        }
    }
    check!(
        done == want,
        "net-udp-echo",
        "{} of {} datagrams echoed",
        done,
        want
    );
    finish()
}
