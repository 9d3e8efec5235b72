//! Builds a queue whose descriptor table, avail ring and buffers come from arbitrary bytes: the
//! hostile-guest harness shared by the devices' unit tests and the fuzz targets (`vmm/fuzz`).

use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};

use crate::memory::GuestMemory;

/// Guest memory the harness uses (descriptor addresses beyond it are out of bounds).
pub const MEM_SIZE: usize = 1 << 20;
pub const QUEUE_SIZE: u16 = 16;
const DESC_TABLE: u64 = 0;
const AVAIL_RING: u64 = 0x1000;
const USED_RING: u64 = 0x2000;
/// Where the rest of the input lands (buffers that descriptors may point at).
pub const DATA: u64 = 0x3000;

/// A queue laid out from `input`: the first 256 bytes are the 16 descriptors (address,
/// length, flags and next are all guest-controlled), the next two bytes the avail index, the
/// next 32 bytes the avail ring entries, and everything after that is copied to [`DATA`].
pub fn hostile_queue(input: &[u8]) -> (GuestMemory, Queue) {
    let mem = crate::memory::anonymous(MEM_SIZE as u64).expect("map harness memory");
    let take = |from: usize, len: usize| -> Vec<u8> {
        let mut v = input.get(from..).unwrap_or(&[]).to_vec();
        v.resize(len, 0);
        v.truncate(len);
        v
    };
    let desc = take(0, 16 * usize::from(QUEUE_SIZE));
    mem.write_slice(&desc, GuestAddress(DESC_TABLE)).unwrap();
    let idx = take(256, 2);
    let ring = take(258, 2 * usize::from(QUEUE_SIZE));
    // avail: flags (0), idx, ring[]
    mem.write_slice(&[0, 0], GuestAddress(AVAIL_RING)).unwrap();
    mem.write_slice(&idx, GuestAddress(AVAIL_RING + 2)).unwrap();
    mem.write_slice(&ring, GuestAddress(AVAIL_RING + 4))
        .unwrap();
    let rest = input.get(290..).unwrap_or(&[]);
    let rest = &rest[..rest.len().min(MEM_SIZE - DATA as usize)];
    mem.write_slice(rest, GuestAddress(DATA)).unwrap();
    let mut q = Queue::new(QUEUE_SIZE).expect("queue");
    q.set_size(QUEUE_SIZE);
    q.set_desc_table_address(Some(DESC_TABLE as u32), Some(0));
    q.set_avail_ring_address(Some(AVAIL_RING as u32), Some(0));
    q.set_used_ring_address(Some(USED_RING as u32), Some(0));
    q.set_ready(true);
    (mem, q)
}

/// A well-formed descriptor as 16 bytes (for building inputs).
pub fn desc(addr: u64, len: u32, flags: u16, next: u16) -> [u8; 16] {
    let mut d = [0u8; 16];
    d[..8].copy_from_slice(&addr.to_le_bytes());
    d[8..12].copy_from_slice(&len.to_le_bytes());
    d[12..14].copy_from_slice(&flags.to_le_bytes());
    d[14..].copy_from_slice(&next.to_le_bytes());
    d
}

pub const F_NEXT: u16 = 1;
pub const F_WRITE: u16 = 2;

/// An input with `descs` as the table, `heads` published in the avail ring and `data` at
/// [`DATA`].
pub fn input(descs: &[[u8; 16]], heads: &[u16], data: &[u8]) -> Vec<u8> {
    let mut v = vec![0u8; 290];
    for (i, d) in descs.iter().take(usize::from(QUEUE_SIZE)).enumerate() {
        v[i * 16..i * 16 + 16].copy_from_slice(d);
    }
    v[256..258].copy_from_slice(&(heads.len() as u16).to_le_bytes());
    for (i, h) in heads.iter().take(usize::from(QUEUE_SIZE)).enumerate() {
        v[258 + 2 * i..260 + 2 * i].copy_from_slice(&h.to_le_bytes());
    }
    v.extend_from_slice(data);
    v
}

/// Deterministic pseudo-random bytes (splitmix64) for the hostile-input replay tests.
pub fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut s = seed;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Hostile variants of a well-formed input: random bytes, each byte of the table flipped,
/// lengths set to extremes, addresses pointed outside memory. Used by every device's test.
pub fn hostile_corpus(good: &[Vec<u8>]) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for seed in 0..200 {
        out.push(noise(seed, 290 + (seed as usize % 7) * 64));
    }
    for g in good {
        out.push(g.clone());
        for i in (0..290.min(g.len())).step_by(3) {
            for v in [0x00, 0xff, 0x80, 0x0f] {
                let mut m = g.clone();
                m[i] = v;
                out.push(m);
            }
        }
        for d in 0..usize::from(QUEUE_SIZE) {
            for len in [0u32, 1, 511, 513, u32::MAX, 0x8000_0000] {
                let mut m = g.clone();
                m[d * 16 + 8..d * 16 + 12].copy_from_slice(&len.to_le_bytes());
                out.push(m);
            }
            for addr in [u64::MAX, MEM_SIZE as u64 - 1, 1 << 40] {
                let mut m = g.clone();
                m[d * 16..d * 16 + 8].copy_from_slice(&addr.to_le_bytes());
                out.push(m);
            }
        }
    }
    out
}
