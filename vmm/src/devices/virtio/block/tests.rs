use std::io::Write as _;

use vm_memory::{Bytes, GuestAddress};

use super::*;
use crate::devices::virtio::testing::*;

const HDR: u64 = DATA;
const BUF: u64 = DATA + 0x1000;
const STATUS: u64 = DATA + 0x800;
const SEG: u64 = DATA + 0x900;

fn disk(len: u64, read_only: bool) -> (Arc<Disk>, File) {
    let mut f = tempfile();
    let pattern: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
    f.write_all(&pattern).unwrap();
    let reopened = f.try_clone().unwrap();
    (Arc::new(Disk::from_file(f, read_only).unwrap()), reopened)
}

fn tempfile() -> File {
    let path = std::env::temp_dir().join(format!(
        "dsec-blk-unit-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    std::fs::remove_file(&path).unwrap();
    f
}

fn hdr(kind: u32, sector: u64) -> Vec<u8> {
    let mut h = vec![0u8; 16];
    h[0..4].copy_from_slice(&kind.to_le_bytes());
    h[8..16].copy_from_slice(&sector.to_le_bytes());
    h
}

/// Runs one request: header, optional data descriptor, status; returns (status, used len).
fn request(
    disk: &Arc<Disk>,
    kind: u32,
    sector: u64,
    data: Option<(u32, bool)>,
    seg: Option<[u8; 16]>,
) -> (u8, u32, GuestMemory) {
    let mut descs = vec![desc(HDR, 16, F_NEXT, 1)];
    if let Some(s) = seg {
        descs.push(desc(SEG, s.len() as u32, F_NEXT, 2));
    } else if let Some((len, write)) = data {
        descs.push(desc(BUF, len, F_NEXT | if write { F_WRITE } else { 0 }, 2));
    }
    let n = descs.len() as u16;
    descs.push(desc(STATUS, 1, F_WRITE, 0));
    descs[usize::from(n) - 1] = {
        let mut d = descs[usize::from(n) - 1];
        d[14..16].copy_from_slice(&n.to_le_bytes());
        d
    };
    let mut data_area = vec![0u8; 0x1000 + 64 * 1024];
    data_area[..16].copy_from_slice(&hdr(kind, sector));
    data_area[0x800] = 0xee;
    if let Some(s) = seg {
        data_area[0x900..0x910].copy_from_slice(&s);
    }
    for (i, b) in data_area[0x1000..].iter_mut().enumerate() {
        *b = (i % 13) as u8;
    }
    let (mem, mut q) = hostile_queue(&input(&descs, &[0], &data_area));
    assert!(BlockQueue::new(disk.clone()).process(&mut q, &mem));
    let status: u8 = mem.read_obj(GuestAddress(STATUS)).unwrap();
    let used: u32 = mem.read_obj(GuestAddress(0x2000 + 4 + 4)).unwrap();
    (status, used, mem)
}

fn seg(sector: u64, count: u32, flags: u32) -> [u8; 16] {
    let mut s = [0u8; 16];
    s[..8].copy_from_slice(&sector.to_le_bytes());
    s[8..12].copy_from_slice(&count.to_le_bytes());
    s[12..].copy_from_slice(&flags.to_le_bytes());
    s
}

#[test]
fn read_write_roundtrip_and_bounds() {
    let (d, f) = disk(1 << 20, false);
    let (st, used, mem) = request(&d, T_IN, 2, Some((4096, true)), None);
    assert_eq!((st, used), (S_OK, 4097));
    let mut got = vec![0u8; 4096];
    mem.read_slice(&mut got, GuestAddress(BUF)).unwrap();
    let want: Vec<u8> = (1024..1024 + 4096u64)
        .map(|i| (i * 7 % 251) as u8)
        .collect();
    assert_eq!(got, want);

    let (st, used, _) = request(&d, T_OUT, 8, Some((1024, false)), None);
    assert_eq!((st, used), (S_OK, 1));
    let mut back = vec![0u8; 1024];
    f.read_exact_at(&mut back, 8 * 512).unwrap();
    assert!(back.iter().enumerate().all(|(i, &b)| b == (i % 13) as u8));

    // The last sector is fine, one past it is not; neither is a wrapping sector number.
    let last = (1 << 20) / 512 - 1;
    assert_eq!(request(&d, T_IN, last, Some((512, true)), None).0, S_OK);
    assert_eq!(request(&d, T_IN, last, Some((1024, true)), None).0, S_IOERR);
    assert_eq!(
        request(&d, T_IN, u64::MAX, Some((512, true)), None).0,
        S_IOERR
    );
    assert_eq!(
        request(&d, T_IN, u64::MAX / 512 + 1, Some((512, true)), None).0,
        S_IOERR
    );
    // Lengths that are not whole sectors.
    assert_eq!(request(&d, T_IN, 0, Some((100, true)), None).0, S_IOERR);
    assert_eq!(request(&d, T_OUT, 0, Some((513, false)), None).0, S_IOERR);
    assert_eq!(request(&d, 99, 0, None, None).0, S_UNSUPP);
    assert_eq!(request(&d, T_FLUSH, 0, None, None).0, S_OK);
    let (st, used, mem) = request(&d, T_GET_ID, 0, Some((20, true)), None);
    assert_eq!((st, used), (S_OK, 21));
    let mut id = [0u8; 9];
    mem.read_slice(&mut id, GuestAddress(BUF)).unwrap();
    assert_eq!(&id, b"test-disk");
}

#[test]
fn read_only_disk_refuses_writes() {
    let (d, f) = disk(64 * 1024, true);
    assert_eq!(request(&d, T_OUT, 0, Some((512, false)), None).0, S_IOERR);
    assert_eq!(
        request(&d, T_DISCARD, 0, None, Some(seg(0, 8, 0))).0,
        S_IOERR
    );
    assert_eq!(
        request(&d, T_WRITE_ZEROES, 0, None, Some(seg(0, 8, 1))).0,
        S_IOERR
    );
    let mut b = [0u8; 4];
    f.read_exact_at(&mut b, 0).unwrap();
    assert_eq!(b, [0, 7, 14, 21]);
}

#[test]
fn discard_and_write_zeroes() {
    let (d, f) = disk(1 << 20, false);
    assert_eq!(request(&d, T_DISCARD, 8, None, Some(seg(8, 16, 0))).0, S_OK);
    assert_eq!(
        request(&d, T_WRITE_ZEROES, 0, None, Some(seg(100, 1, 0))).0,
        S_OK
    );
    let mut b = vec![0u8; 16 * 512];
    f.read_exact_at(&mut b, 8 * 512).unwrap();
    assert!(b.iter().all(|&x| x == 0));
    f.read_exact_at(&mut b[..512], 100 * 512).unwrap();
    assert!(b[..512].iter().all(|&x| x == 0));
    // Out of range, too large, unknown flags, unmap on discard.
    let sectors = (1 << 20) / 512;
    assert_eq!(
        request(&d, T_DISCARD, 0, None, Some(seg(sectors - 1, 2, 0))).0,
        S_IOERR
    );
    assert_eq!(
        request(&d, T_DISCARD, 0, None, Some(seg(u64::MAX, 1, 0))).0,
        S_IOERR
    );
    assert_eq!(
        request(
            &d,
            T_DISCARD,
            0,
            None,
            Some(seg(0, MAX_ZERO_SECTORS + 1, 0))
        )
        .0,
        S_UNSUPP
    );
    assert_eq!(
        request(&d, T_WRITE_ZEROES, 0, None, Some(seg(0, 1, 6))).0,
        S_UNSUPP
    );
    assert_eq!(
        request(&d, T_DISCARD, 0, None, Some(seg(0, 1, 1))).0,
        S_UNSUPP
    );
}

#[test]
fn unaligned_request_at_the_end_of_memory_gets_ioerr() {
    // A read whose data descriptor is the last 8 bytes of guest memory.
    let f = tempfile();
    f.set_len(64 << 20).unwrap();
    let d = Arc::new(Disk::from_file(f, false).unwrap());
    let descs = [
        desc(HDR, 16, F_NEXT, 1),
        desc(0x10_0000 - 8, 8, F_NEXT | F_WRITE, 2),
        desc(STATUS, 1, F_WRITE, 0),
    ];
    let (mem, mut q) = hostile_queue(&input(&descs, &[0], &hdr(T_IN, 0)));
    BlockQueue::new(d.clone()).process(&mut q, &mem);
    // 8 bytes is not a sector multiple either way: IOERR, nothing written but the status.
    let status: u8 = mem.read_obj(GuestAddress(STATUS)).unwrap();
    assert_eq!(status, S_IOERR);
}

#[test]
fn hostile_chains_never_panic() {
    let (d, _f) = disk(1 << 20, false);
    let goods: Vec<Vec<u8>> = [T_IN, T_OUT, T_DISCARD, T_GET_ID]
        .iter()
        .map(|&k| {
            let descs = [
                desc(HDR, 16, F_NEXT, 1),
                desc(
                    BUF,
                    4096,
                    F_NEXT
                        | if k == T_IN || k == T_GET_ID {
                            F_WRITE
                        } else {
                            0
                        },
                    2,
                ),
                desc(STATUS, 1, F_WRITE, 0),
            ];
            let mut data = hdr(k, 3);
            data.resize(0x1000 + 4096, 0x5a);
            input(&descs, &[0], &data)
        })
        .collect();
    for case in hostile_corpus(&goods) {
        let (mem, mut q) = hostile_queue(&case);
        BlockQueue::new(d.clone()).process(&mut q, &mem);
    }
}

#[test]
fn reads_land_in_scattered_buffers_in_order_and_are_marked_dirty() {
    use vm_memory::bitmap::Bitmap;
    use vm_memory::GuestMemoryBackend;
    let (d, _f) = disk(1 << 20, false);
    // Header, three data buffers out of address order (512 + 1536 + 2048), status.
    let bufs = [(BUF + 0x3000, 512u32), (BUF, 1536), (BUF + 0x1800, 2048)];
    let mut descs = vec![desc(HDR, 16, F_NEXT, 1)];
    for (i, (addr, len)) in bufs.iter().enumerate() {
        descs.push(desc(*addr, *len, F_NEXT | F_WRITE, i as u16 + 2));
    }
    descs.push(desc(STATUS, 1, F_WRITE, 0));
    let mut data_area = vec![0u8; 0x1000 + 64 * 1024];
    data_area[..16].copy_from_slice(&hdr(T_IN, 3));
    let (mem, mut q) = hostile_queue(&input(&descs, &[0], &data_area));
    // Laying out the queue dirtied the buffers; only the device's writes count.
    mem.find_region(GuestAddress(BUF)).unwrap().bitmap().reset();
    assert!(BlockQueue::new(d).process(&mut q, &mem));
    let status: u8 = mem.read_obj(GuestAddress(STATUS)).unwrap();
    let used: u32 = mem.read_obj(GuestAddress(0x2000 + 4 + 4)).unwrap();
    assert_eq!((status, used), (S_OK, 4097));
    let mut got = Vec::new();
    for (addr, len) in bufs {
        let mut part = vec![0u8; len as usize];
        mem.read_slice(&mut part, GuestAddress(addr)).unwrap();
        got.extend(part);
    }
    let want: Vec<u8> = (3 * 512..3 * 512 + 4096u64)
        .map(|i| (i * 7 % 251) as u8)
        .collect();
    assert_eq!(got, want);
    let region = mem.find_region(GuestAddress(BUF)).unwrap();
    for (addr, len) in bufs {
        assert!(
            region.bitmap().dirty_at(addr as usize)
                && region
                    .bitmap()
                    .dirty_at((addr + u64::from(len) - 1) as usize),
            "buffer at {addr:#x} not marked dirty"
        );
    }
}
