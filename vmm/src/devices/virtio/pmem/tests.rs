use super::*;
use crate::devices::virtio::testing::*;
use vm_memory::{Bytes, GuestAddress};

struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let d = std::env::temp_dir().join(format!("dsec-pmem-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        TempDir(d)
    }

    fn file(&self, name: &str, len: u64) -> PathBuf {
        let p = self.0.join(name);
        std::fs::File::create(&p).unwrap().set_len(len).unwrap();
        p
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn used(mem: &GuestMemory, i: u64) -> (u32, u32) {
    let id = mem.read_obj(GuestAddress(0x2000 + 4 + 8 * i)).unwrap();
    let len = mem.read_obj(GuestAddress(0x2000 + 4 + 8 * i + 4)).unwrap();
    (id, len)
}

/// A flush request at DATA (type) with its status at DATA + 16, head `head`.
fn request(kind: u32) -> Vec<u8> {
    let mut data = vec![0u8; 32];
    data[..4].copy_from_slice(&kind.to_le_bytes());
    data[16..20].copy_from_slice(&0xeeee_eeeeu32.to_le_bytes());
    input(
        &[desc(DATA, 4, F_NEXT, 1), desc(DATA + 16, 4, F_WRITE, 0)],
        &[0],
        &data,
    )
}

fn status(mem: &GuestMemory) -> u32 {
    mem.read_obj(GuestAddress(DATA + 16)).unwrap()
}

#[test]
fn flush_succeeds_on_writable_and_read_only_files() {
    let t = TempDir::new("flush");
    for read_only in [false, true] {
        let p = t.file(&format!("f{read_only}.img"), ALIGN);
        let b = Arc::new(Backing::open(&p, read_only, false, 1 << 32).unwrap());
        let (mem, mut q) = hostile_queue(&request(REQ_FLUSH));
        assert!(PmemQueue::new(b).process(&mut q, &mem));
        assert_eq!(used(&mem, 0), (0, 4));
        assert_eq!(status(&mem), RESP_OK, "read_only={read_only}");
    }
}

#[test]
fn unknown_types_and_short_requests_get_an_error_status() {
    let t = TempDir::new("bad");
    let b = Arc::new(Backing::open(&t.file("a.img", ALIGN), false, false, 1 << 32).unwrap());
    let (mem, mut q) = hostile_queue(&request(7));
    PmemQueue::new(b.clone()).process(&mut q, &mem);
    assert_eq!((used(&mem, 0).1, status(&mem)), (4, RESP_EIO));
    // Two readable bytes only: no type to read, but room for the status.
    let short = input(
        &[desc(DATA, 2, F_NEXT, 1), desc(DATA + 16, 4, F_WRITE, 0)],
        &[0],
        &[0; 32],
    );
    let (mem, mut q) = hostile_queue(&short);
    PmemQueue::new(b.clone()).process(&mut q, &mem);
    assert_eq!((used(&mem, 0).1, status(&mem)), (4, RESP_EIO));
    // No writable descriptor, one outside memory, one wrapping: nothing written, chain used.
    for d in [
        desc(DATA, 4, 0, 0),
        desc(MEM_SIZE as u64 - 2, 4, F_WRITE, 0),
        desc(u64::MAX - 1, 4, F_WRITE, 0),
    ] {
        let (mem, mut q) = hostile_queue(&input(&[d], &[0], &[]));
        assert!(PmemQueue::new(b.clone()).process(&mut q, &mem));
        assert_eq!(used(&mem, 0).1, 0);
    }
}

#[test]
fn hostile_chains_never_panic() {
    let t = TempDir::new("hostile");
    let b = Arc::new(Backing::open(&t.file("a.img", ALIGN), false, false, 1 << 32).unwrap());
    for case in hostile_corpus(&[request(REQ_FLUSH)]) {
        let (mem, mut q) = hostile_queue(&case);
        PmemQueue::new(b.clone()).process(&mut q, &mem);
    }
}

#[test]
fn bad_files_are_refused_with_the_reason() {
    let t = TempDir::new("open");
    let err = |p: &Path, ro: bool| {
        Backing::open(p, ro, false, 1 << 32)
            .err()
            .unwrap()
            .to_string()
    };
    let e = err(&t.0.join("missing.img"), true);
    assert!(
        e.contains("cannot open pmem file") && e.contains("missing.img"),
        "{e}"
    );
    let e = err(&t.file("empty.img", 0), true);
    assert!(e.contains("is empty"), "{e}");
    let e = err(&t.file("odd.img", ALIGN + 4096), true);
    assert!(
        e.contains("not a multiple of 2 MiB") && e.contains("truncate -s 4194304"),
        "{e}"
    );
    let e = err(&t.0, true);
    assert!(e.contains("not a regular file"), "{e}");
    // One writer locks the file; a second writer or a reader is refused, a shared one too.
    let p = t.file("locked.img", ALIGN);
    let first = Backing::open(&p, false, false, 1 << 32).unwrap();
    assert!(err(&p, false).contains("in use by another VM"));
    assert!(err(&p, true).contains("in use by another VM"));
    drop(first);
    // Read-only and shared mappings coexist.
    let a = Backing::open(&p, true, false, 1 << 32).unwrap();
    let b = Backing::open(&p, false, true, 1 << 32).unwrap();
    assert_eq!((a.size(), b.size()), (ALIGN, ALIGN));
}

#[test]
fn restore_refuses_a_changed_file() {
    let t = TempDir::new("changed");
    let p = t.file("a.img", ALIGN);
    let saved = Backing::open(&p, true, false, 1 << 32).unwrap().identity();
    Backing::open(&p, true, false, 1 << 32)
        .unwrap()
        .matches(&saved)
        .unwrap();
    // Same size, new inode (renamed over it, as an image rebuild would).
    std::fs::rename(t.file("b.img", ALIGN), &p).unwrap();
    let e = Backing::open(&p, true, false, 1 << 32)
        .unwrap()
        .matches(&saved)
        .unwrap_err();
    assert!(e.to_string().contains("another file"), "{e}");
    // Same inode, new size.
    let saved = Backing::open(&p, true, false, 1 << 32).unwrap().identity();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len(2 * ALIGN)
        .unwrap();
    let e = Backing::open(&p, true, false, 1 << 32)
        .unwrap()
        .matches(&saved)
        .unwrap_err();
    assert!(e.to_string().contains("bytes, the snapshot mapped"), "{e}");
    // A read-only file modified in place.
    let saved = Backing::open(&p, true, false, 1 << 32).unwrap().identity();
    std::thread::sleep(std::time::Duration::from_millis(20));
    use std::os::unix::fs::FileExt;
    std::fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .write_at(b"x", 0)
        .unwrap();
    let e = Backing::open(&p, true, false, 1 << 32)
        .unwrap()
        .matches(&saved)
        .unwrap_err();
    assert!(e.to_string().contains("modified"), "{e}");
}

#[test]
fn config_space_holds_start_and_size() {
    let t = TempDir::new("config");
    let d = Pmem::new(Backing::open(&t.file("a.img", 2 * ALIGN), true, false, 5 << 30).unwrap());
    let mut buf = [0u8; 8];
    d.read_config(0, &mut buf);
    assert_eq!(u64::from_le_bytes(buf), 5 << 30);
    d.read_config(8, &mut buf);
    assert_eq!(u64::from_le_bytes(buf), 2 * ALIGN);
    let mut four = [0u8; 4];
    d.read_config(12, &mut four);
    assert_eq!(four, [0; 4]);
    d.read_config(16, &mut four);
    assert_eq!(four, [0; 4]);
}

#[test]
fn window_starts_above_ram_and_the_mmio_hole() {
    assert_eq!(window_base(256 << 20), 4 << 30);
    assert_eq!(window_base(3 << 30), 4 << 30);
    // 4 GiB of RAM ends at 5 GiB (1 GiB moved above the hole).
    assert_eq!(window_base(4 << 30), 5 << 30);
    assert_eq!(window_base((4 << 30) + (1 << 20)), 6 << 30);
}
