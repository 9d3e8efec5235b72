use super::*;
use crate::devices::virtio::testing::*;
use crate::persist::Persist;
use vm_memory::Bytes;

fn control() -> Arc<BalloonControl> {
    Arc::new(BalloonControl::new(1))
}

fn pfn_bytes(pfns: &[u32]) -> Vec<u8> {
    pfns.iter().flat_map(|p| p.to_le_bytes()).collect()
}

/// Fills guest pages `first..first+n` with a non-zero byte.
fn dirty(mem: &GuestMemory, first: u64, n: u64) {
    for p in first..first + n {
        mem.write_slice(&[0xa5; PAGE_SIZE], GuestAddress(p << PFN_SHIFT))
            .unwrap();
    }
}

fn page_is_zero(mem: &GuestMemory, pfn: u64) -> bool {
    let mut page = [0u8; PAGE_SIZE];
    mem.read_slice(&mut page, GuestAddress(pfn << PFN_SHIFT))
        .unwrap();
    page.iter().all(|&b| b == 0)
}

#[test]
fn roles_follow_the_negotiated_features() {
    use Role::*;
    assert_eq!(roles(0), [Inflate, Deflate]);
    assert_eq!(roles(F_REPORTING), [Inflate, Deflate, Reporting]);
    assert_eq!(
        roles(F_STATS_VQ | F_REPORTING | F_DEFLATE_ON_OOM),
        [Inflate, Deflate, Stats, Reporting]
    );
}

#[test]
fn features_and_queues_follow_the_config() {
    let plain = Balloon::new(BalloonConfig::default(), 64);
    assert_eq!(plain.features(), VIRTIO_F_VERSION_1);
    assert_eq!(plain.queue_max_sizes().len(), 2);
    let full = Balloon::new(
        BalloonConfig {
            deflate_on_oom: true,
            stats_interval_s: 1,
            free_page_reporting: true,
        },
        64,
    );
    assert_eq!(
        full.features(),
        VIRTIO_F_VERSION_1 | F_STATS_VQ | F_DEFLATE_ON_OOM | F_REPORTING
    );
    assert_eq!(full.queue_max_sizes().len(), 4);
}

#[test]
fn inflate_drops_the_pages_and_skips_garbage_frames() {
    let good: Vec<u32> = (0x80..0x90).collect();
    let mut pfns = good.clone();
    pfns.extend([u32::MAX, (MEM_SIZE >> 12) as u32, 0x7f]);
    let data = pfn_bytes(&pfns);
    let descs = [desc(DATA, data.len() as u32, 0, 0)];
    let (mem, mut q) = hostile_queue(&input(&descs, &[0], &data));
    dirty(&mem, 0x7f, 0x11);
    let ctl = control();
    let mut h = BalloonQueues::new(0, ctl.clone(), None);
    assert!(h.process(Role::Inflate, &mut q, &mem));
    for p in good {
        assert!(page_is_zero(&mem, u64::from(p)), "page {p:#x} kept");
    }
    let c = ctl.status().counters;
    assert_eq!(c.inflated_pages, 17);
    assert_eq!(c.bad_pfns, 2);
}

#[test]
fn unreadable_and_odd_buffers_are_survived() {
    let descs = [
        desc(u64::MAX - 8, 64, 0, 0),
        desc(MEM_SIZE as u64 - 4, 64, 0, 0),
        desc(DATA, 6, 0, 0),
        desc(DATA, 4, F_WRITE, 0),
    ];
    let data = pfn_bytes(&[0x90, 0x91]);
    let (mem, mut q) = hostile_queue(&input(&descs, &[0, 1, 2, 3], &data));
    dirty(&mem, 0x90, 2);
    let ctl = control();
    let mut h = BalloonQueues::new(0, ctl.clone(), None);
    assert!(h.process(Role::Inflate, &mut q, &mem));
    let c = ctl.status().counters;
    assert_eq!(c.bad_chains, 2, "{c:?}");
    // The 6-byte buffer still carries one whole frame.
    assert_eq!(c.inflated_pages, 1);
    assert!(page_is_zero(&mem, 0x90));
    assert!(!page_is_zero(&mem, 0x91));
}

#[test]
fn deflate_counts_frames_without_touching_memory() {
    let data = pfn_bytes(&[0x80, 0x81, 0xdead_beef]);
    let descs = [desc(DATA, 12, 0, 0)];
    let (mem, mut q) = hostile_queue(&input(&descs, &[0], &data));
    dirty(&mem, 0x80, 2);
    let ctl = control();
    let mut h = BalloonQueues::new(0, ctl.clone(), None);
    assert!(h.process(Role::Deflate, &mut q, &mem));
    let c = ctl.status().counters;
    assert_eq!((c.deflated_pages, c.bad_pfns), (2, 1));
    assert!(!page_is_zero(&mem, 0x80));
}

#[test]
fn reported_ranges_are_dropped_and_bad_ranges_skipped() {
    let descs = [
        desc(0x80000, 0x8000, F_WRITE | F_NEXT, 1),
        desc(MEM_SIZE as u64 - 0x1000, 0x2000, F_WRITE | F_NEXT, 2),
        desc(0xa0000, 0x1000, F_WRITE, 0),
    ];
    let (mem, mut q) = hostile_queue(&input(&descs, &[0], &[]));
    dirty(&mem, 0x80, 8);
    dirty(&mem, 0xa0, 1);
    dirty(&mem, 0xff, 1);
    let ctl = control();
    let mut h = BalloonQueues::new(F_REPORTING, ctl.clone(), None);
    assert!(h.process(Role::Reporting, &mut q, &mem));
    for p in (0x80..0x88).chain([0xa0]) {
        assert!(page_is_zero(&mem, p), "page {p:#x} kept");
    }
    // The range running past the end of RAM is refused whole.
    assert!(!page_is_zero(&mem, 0xff));
    let c = ctl.status().counters;
    assert_eq!((c.reported_bytes, c.bad_pfns), (0x9000, 1));
}

fn stats_entry(tag: u16, v: u64) -> Vec<u8> {
    let mut e = tag.to_le_bytes().to_vec();
    e.extend_from_slice(&v.to_le_bytes());
    e
}

#[test]
fn stats_buffer_is_held_until_the_host_asks() {
    let mut data = stats_entry(4, 1234);
    data.extend(stats_entry(5, 1 << 30));
    data.extend(stats_entry(99, 7));
    let descs = [desc(DATA, data.len() as u32, 0, 0)];
    let (mem, mut q) = hostile_queue(&input(&descs, &[0], &data));
    let ctl = control();
    let mut h = BalloonQueues::new(F_STATS_VQ, ctl.clone(), Some(Duration::from_secs(1)));
    assert!(!h.process(Role::Stats, &mut q, &mem), "buffer must be held");
    let s = ctl.status();
    assert_eq!(s.stats["free_memory"], 1234);
    assert_eq!(s.stats["total_memory"], 1 << 30);
    assert_eq!(s.stats["tag_99"], 7);
    assert!(s.stats_age_ms.is_some());
    assert_eq!(ctl.state().stats_head, Some(0));
    assert!(h.request_stats(&mut q, &mem));
    assert!(!h.request_stats(&mut q, &mem), "nothing left to return");
    let used_idx: u16 = mem.read_obj(GuestAddress(0x2002)).unwrap();
    assert_eq!(used_idx, 1);
}

#[test]
fn target_and_actual_in_config_space() {
    let mut b = Balloon::new(BalloonConfig::default(), 64);
    let ctl = b.control();
    ctl.set_target_mib(16).unwrap();
    let err = ctl.set_target_mib(65).unwrap_err().to_string();
    assert!(err.contains("at most 64 MiB"), "{err}");
    let mut word = [0u8; 4];
    b.read_config(0, &mut word);
    assert_eq!(u32::from_le_bytes(word), 4096);
    b.write_config(4, &100u32.to_le_bytes());
    // The target is the host's: a guest write to it is ignored.
    b.write_config(0, &1u32.to_le_bytes());
    b.read_config(4, &mut word);
    assert_eq!(u32::from_le_bytes(word), 100);
    let s = ctl.status();
    assert_eq!(
        (s.target_pages, s.actual_pages, s.target_mib),
        (4096, 100, 16)
    );
}

#[test]
fn state_survives_save_and_restore() {
    let b = Balloon::new(BalloonConfig::default(), 64);
    b.control().set_target_mib(32).unwrap();
    lock(&b.control.inner).actual = 77;
    lock(&b.control.inner).stats.insert(4, 5);
    lock(&b.control.inner).stats_head = Some(3);
    let s = b.save();
    let json = serde_json::to_string(&s).unwrap();
    let back: BalloonState = serde_json::from_str(&json).unwrap();
    let r = Balloon::restore((BalloonConfig::default(), 64), &back).unwrap();
    assert_eq!(r.save(), s);
    assert_eq!(r.control().status().target_mib, 32);
    let err = Balloon::restore((BalloonConfig::default(), 16), &back)
        .err()
        .unwrap();
    assert!(err.to_string().contains("16 MiB"), "{err}");
}

#[test]
fn hostile_chains_never_panic() {
    let pfns = pfn_bytes(&[0x80, 0x81, u32::MAX]);
    let good = [
        input(&[desc(DATA, 12, 0, 0)], &[0], &pfns),
        input(
            &[
                desc(0x80000, 0x2000, F_WRITE | F_NEXT, 1),
                desc(DATA, 10, 0, 0),
            ],
            &[0],
            &stats_entry(4, 1),
        ),
    ];
    let ctl = control();
    for case in hostile_corpus(&good) {
        for role in [Role::Inflate, Role::Deflate, Role::Stats, Role::Reporting] {
            let (mem, mut q) = hostile_queue(&case);
            let mut h = BalloonQueues::new(F_STATS_VQ | F_REPORTING, ctl.clone(), None);
            h.process(role, &mut q, &mem);
            h.request_stats(&mut q, &mem);
        }
    }
}
