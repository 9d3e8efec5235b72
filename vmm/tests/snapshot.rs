//! Snapshot, restore, diff snapshots and fork, driven through the real `dsec-vmm` binary and
//! its control socket, with the tiny guests of `common`.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;

#[test]
fn restored_guest_continues_where_it_stopped() {
    let s = Scratch::new("continue");
    let mut vm = boot_counter(&s);
    let snap = s.path("snap");
    wait_until("the guest to start counting", || {
        let _ = std::fs::remove_dir_all(&snap);
        let r = vm.ok(serde_json::json!({"op": "snapshot", "path": snap}));
        assert_eq!(r["diff"], false);
        counter(&snap) > 0
    });
    vm.stop();
    let at_snapshot = counter(&snap);
    assert_eq!(
        read_u64(&snap.join("memory"), CID_COPY_ADDR) & 0xffff_ffff,
        7
    );

    // Restore paused: state must be exactly the snapshot's.
    let mut restored = Vmm::spawn(
        &["--restore", snap.to_str().unwrap(), "--paused"],
        &s.path("api2.sock"),
    );
    assert_eq!(
        restored.ok(serde_json::json!({"op": "status"}))["state"],
        "paused"
    );
    let same = s.path("same");
    restored.ok(serde_json::json!({"op": "snapshot", "path": same}));
    assert_eq!(
        counter(&same),
        at_snapshot,
        "a paused restore changed guest memory"
    );
    // Running, it keeps counting from there.
    restored.ok(serde_json::json!({"op": "resume"}));
    let later = s.path("later");
    wait_until("the restored guest to count on", || {
        let _ = std::fs::remove_dir_all(&later);
        restored.ok(serde_json::json!({"op": "snapshot", "path": later}));
        counter(&later) > at_snapshot + 10
    });
    restored.stop();
}

#[test]
fn live_snapshot_holds_the_memory_of_its_pause_while_the_guest_writes_on() {
    // 64 MiB rewritten by every sweep: far more than the guest's short pause could write.
    const PAGES: u32 = 16 * 1024;
    let s = Scratch::new("live");
    let mut vm = boot_sweeper(&s, PAGES);
    let mut short_pause = false;
    let mut last = 0;
    for i in 0..3 {
        let snap = s.path(&format!("live{i}"));
        let r = vm.ok(serde_json::json!({"op": "snapshot", "path": snap}));
        let (paused, complete) = (
            r["paused_ms"].as_f64().unwrap(),
            r["complete_ms"].as_f64().unwrap(),
        );
        eprintln!("live snapshot {i}: paused {paused:.2} ms, complete after {complete:.2} ms, {r}");
        assert!(r["pages_written"].as_u64().unwrap() >= u64::from(PAGES));
        // Its last dirty set is usually large (forked after the pre-copy); on a slow host
        // the guest may write little meanwhile.
        assert!(
            r["memory_mode"].as_str().unwrap().starts_with("precopy"),
            "{r}"
        );
        // Written while the guest swept on: every page still reads as at the pause.
        let counter = sweep_matches_registers(&snap, PAGES).unwrap();
        assert!(counter > last, "the guest did not run between snapshots");
        last = counter;
        short_pause |= paused * 2.0 < complete;
    }
    assert!(
        short_pause,
        "the guest stayed paused while its memory was written"
    );
    vm.stop();

    // The snapshot restores to exactly that memory, and the guest sweeps on from there.
    restores_exactly_and_sweeps_on(&s, &s.path("live2"), PAGES, last);
}

/// Boots a 128 MiB guest sweeping `pages` pages and waits until it has swept twice.
fn boot_sweeper(s: &Scratch, pages: u32) -> Vmm {
    let mut vm = boot_guest_with_memory(s, &sweeping_guest_code(pages), 128, &[]);
    let probe = s.path("probe");
    wait_until("the guest to finish two sweeps", || {
        let _ = std::fs::remove_dir_all(&probe);
        vm.ok(serde_json::json!({"op": "snapshot", "path": probe}));
        sweep_consistency(&probe.join("memory"), pages).unwrap() >= 2
    });
    vm
}

/// Restores a sweeping guest's snapshot paused, checks that its memory is exactly the
/// snapshot's, resumes it and waits until it has swept on consistently past `last`.
fn restores_exactly_and_sweeps_on(s: &Scratch, snap: &Path, pages: u32, last: u64) {
    let mut restored = Vmm::spawn(
        &["--restore", snap.to_str().unwrap(), "--paused"],
        &s.path("restored-api.sock"),
    );
    let same = s.path("same");
    restored.ok(serde_json::json!({"op": "snapshot", "path": same}));
    assert!(
        std::fs::read(snap.join("memory")).unwrap() == std::fs::read(same.join("memory")).unwrap(),
        "the restored memory differs from the snapshot's"
    );
    restored.ok(serde_json::json!({"op": "resume"}));
    let later = s.path("later");
    wait_until("the restored guest to sweep on consistently", || {
        let _ = std::fs::remove_dir_all(&later);
        restored.ok(serde_json::json!({"op": "snapshot", "path": later}));
        sweep_matches_registers(&later, pages).unwrap() > last + 1
    });
    restored.stop();
}

#[test]
fn precopied_snapshot_is_the_memory_of_its_pause_while_the_guest_writes_on() {
    // A few pages rewritten thousands of times a second: pre-copied while the guest runs,
    // then the last dirty pages written in the pause.
    const PAGES: u32 = 64;
    let s = Scratch::new("precopy");
    let mut vm = boot_sweeper(&s, PAGES);
    // Each snapshot must hold exactly the memory its vCPU state belongs to. Only those whose
    // guest wrote after the last pre-copy round test the final pass (on a loaded host the
    // vCPU may not run in that window): go on until three of them did.
    let (mut last, mut tested, mut i) = (0, 0, 0);
    wait_until(
        "three snapshots whose guest wrote during the pre-copy",
        || {
            let snap = s.path(&format!("pre{i}"));
            i += 1;
            let r = vm.ok(serde_json::json!({"op": "snapshot", "path": snap}));
            eprintln!("pre-copied snapshot {i}: {r}");
            assert_eq!(r["memory_mode"], "precopy", "{r}");
            let rounds = r["precopy_rounds"].as_array().unwrap();
            assert!(!rounds.is_empty() && rounds[0].as_u64().unwrap() > u64::from(PAGES));
            let counter = sweep_matches_registers(&snap, PAGES).unwrap();
            assert!(counter > last, "the guest did not run between snapshots");
            last = counter;
            if r["final_pages"].as_u64().unwrap() > 0 {
                tested += 1;
            }
            tested >= 3
        },
    );
    // The next diff starts at the pause: a diff taken with the guest paused, applied on the
    // last pre-copied snapshot, gives the memory of a full snapshot of the same instant.
    std::thread::sleep(Duration::from_millis(50));
    vm.ok(serde_json::json!({"op": "pause"}));
    let diff = s.path("diff");
    vm.ok(serde_json::json!({"op": "snapshot", "path": diff, "diff": true}));
    let reference = s.path("reference");
    vm.ok(serde_json::json!({"op": "snapshot", "path": reference}));
    vm.stop();
    let restored_dir = s.path("restored");
    let mut restored = Vmm::spawn(
        &["--restore", diff.to_str().unwrap(), "--paused"],
        &s.path("api2.sock"),
    );
    restored.ok(serde_json::json!({"op": "snapshot", "path": restored_dir}));
    restored.stop();
    assert!(
        std::fs::read(reference.join("memory")).unwrap()
            == std::fs::read(restored_dir.join("memory")).unwrap(),
        "the diff after a pre-copied snapshot missed pages"
    );

    // The pre-copied snapshot restores to exactly its memory and the guest sweeps on.
    restores_exactly_and_sweeps_on(&s, &s.path(&format!("pre{}", i - 1)), PAGES, last);
}

#[test]
fn diff_snapshot_chain_restores_identical_memory() {
    let s = Scratch::new("diff");
    let mut vm = boot_counter(&s);
    std::thread::sleep(Duration::from_millis(100));
    let full = s.path("full");
    vm.ok(serde_json::json!({"op": "snapshot", "path": full}));
    std::thread::sleep(Duration::from_millis(100));
    let diff1 = s.path("diff1");
    let r = vm.ok(serde_json::json!({"op": "snapshot", "path": diff1, "diff": true}));
    assert_eq!(r["diff"], true);
    assert!(
        r["pages_written"].as_u64().unwrap() < 8,
        "diff wrote too much: {r}"
    );
    std::thread::sleep(Duration::from_millis(100));
    // Pause, then take the diff and a full reference at the same instant.
    vm.ok(serde_json::json!({"op": "pause"}));
    let diff2 = s.path("diff2");
    vm.ok(serde_json::json!({"op": "snapshot", "path": diff2, "diff": true}));
    let reference = s.path("reference");
    vm.ok(serde_json::json!({"op": "snapshot", "path": reference}));
    vm.stop();
    assert!(counter(&diff2) > counter(&full));

    let mut restored = Vmm::spawn(
        &["--restore", diff2.to_str().unwrap(), "--paused"],
        &s.path("api2.sock"),
    );
    let out = s.path("out");
    restored.ok(serde_json::json!({"op": "snapshot", "path": out}));
    restored.stop();
    let a = std::fs::read(reference.join("memory")).unwrap();
    let b = std::fs::read(out.join("memory")).unwrap();
    assert_eq!(a.len(), b.len());
    assert!(
        a == b,
        "memory restored through the diff chain differs from the reference"
    );
}

/// A snapshot over the restore base holds only the pages the restored guest wrote (found in
/// the VMM's pagemap), and base + that diff is exactly the memory of its instant: also for
/// a VM itself restored from such a diff, whose applied pages count as written.
#[test]
fn snapshot_over_the_restore_base_holds_what_the_guest_wrote() {
    const PAGES: u32 = 64;
    let s = Scratch::new("over-base");
    let mut vm = boot_sweeper(&s, PAGES);
    let base = s.path("base");
    vm.ok(serde_json::json!({"op": "snapshot", "path": base}));
    // A booted VM maps no snapshot: refused by name.
    let r =
        vm.request(serde_json::json!({"op": "snapshot", "path": s.path("no"), "base": "../base"}));
    assert_eq!(r["ok"], false, "{r}");
    assert!(
        r["error"].as_str().unwrap().contains("restored by mapping"),
        "{r}"
    );
    let r = vm.request(serde_json::json!({"op": "snapshot", "path": s.path("no"), "diff": true, "base": "../base"}));
    assert!(r["error"].as_str().unwrap().contains("not both"), "{r}");
    vm.stop();
    let base_pages = std::fs::read(base.join("memory"))
        .unwrap()
        .chunks(4096)
        .filter(|p| p.iter().any(|b| *b != 0))
        .count() as u64;

    // Restored, the guest sweeps on; paused, its diff over the base and a full reference.
    let mut restored = Vmm::spawn(&["--restore", base.to_str().unwrap()], &s.path("api1.sock"));
    // Live (the guest runs on while a forked child writes): until it has rewritten its pages.
    let probe = s.path("probe");
    wait_until("the restored guest to sweep on", || {
        let _ = std::fs::remove_dir_all(&probe);
        let r =
            restored.ok(serde_json::json!({"op": "snapshot", "path": probe, "base": "../base"}));
        r["pages_written"].as_u64().unwrap() >= u64::from(PAGES)
    });
    restored.ok(serde_json::json!({"op": "pause"}));
    let d1 = s.path("d1");
    let r = restored.ok(serde_json::json!({"op": "snapshot", "path": d1, "base": "../base"}));
    assert_eq!(r["diff"], true, "{r}");
    let written = r["pages_written"].as_u64().unwrap();
    assert!(
        written >= u64::from(PAGES) && written < base_pages + 64,
        "{written} pages over a base of {base_pages} non-zero pages: {r}"
    );
    let reference = s.path("ref1");
    restored.ok(serde_json::json!({"op": "snapshot", "path": reference}));
    restored.stop();
    let d1_state = std::fs::read(d1.join("state")).unwrap();
    assert!(
        String::from_utf8_lossy(&d1_state).contains("\"parent\":\"../base\""),
        "the diff names its base as given"
    );
    let memory = |d: &Path| std::fs::read(d.join("memory")).unwrap();
    let out1 = restore_and_dump(&s, &d1, "out1");
    assert!(
        memory(&reference) == memory(&out1),
        "base + the diff over it is not the memory of its instant"
    );

    // A VM restored from that diff writes nothing more, yet its own snapshot over the base
    // must still hold every page the first diff brought.
    let mut again = Vmm::spawn(
        &["--restore", d1.to_str().unwrap(), "--paused"],
        &s.path("api2.sock"),
    );
    let d2 = s.path("d2");
    let r = again.ok(serde_json::json!({"op": "snapshot", "path": d2, "base": "../base"}));
    assert!(r["pages_written"].as_u64().unwrap() >= written, "{r}");
    again.stop();
    let out2 = restore_and_dump(&s, &d2, "out2");
    assert!(
        memory(&reference) == memory(&out2),
        "the second diff lost pages the first one had brought"
    );
    // Its base gone, the diff is refused with the path it looked for.
    std::fs::rename(&base, s.path("moved")).unwrap();
    let r = std::process::Command::new(env!("CARGO_BIN_EXE_dsec-vmm"))
        .args(["--restore", d2.to_str().unwrap(), "--paused", "--api-sock"])
        .arg(s.path("api-missing.sock"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(!r.status.success() && err.contains("base"), "{err}");
}

/// With --contained-chain (every restore the node makes) a diff's parent must lie inside the
/// snapshot's directory: a VMM wrote the state, and a parent it named elsewhere (another
/// sandbox's snapshot) would become this guest's memory.
#[test]
fn contained_chain_refuses_a_parent_outside_the_snapshot() {
    let s = Scratch::new("contained");
    let mut vm = boot_counter(&s);
    let base = snapshot_once_counting(&mut vm, &s, "base");
    vm.stop();
    let mut restored = Vmm::spawn(&["--restore", base.to_str().unwrap()], &s.path("api1.sock"));
    std::thread::sleep(Duration::from_millis(50));
    restored.ok(serde_json::json!({"op": "pause"}));
    let over = |vm: &mut Vmm, name: &str, base: &str| {
        let dir = s.path(name);
        vm.ok(serde_json::json!({"op": "snapshot", "path": dir, "base": base}));
        dir
    };
    let dotdot = over(&mut restored, "dotdot", "../base");
    let absolute = over(&mut restored, "absolute", base.to_str().unwrap());
    let inside = over(&mut restored, "inside", "base");
    restored.stop();
    std::fs::create_dir(inside.join("base")).unwrap();
    for f in ["state", "memory"] {
        std::fs::hard_link(base.join(f), inside.join("base").join(f)).unwrap();
    }
    for refused in [&dotdot, &absolute] {
        let out = Command::new(env!("CARGO_BIN_EXE_dsec-vmm"))
            .args([
                "--restore",
                refused.to_str().unwrap(),
                "--paused",
                "--contained-chain",
            ])
            .arg("--api-sock")
            .arg(s.path("refused.sock"))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains("not inside the snapshot's directory"),
            "{}: {err}",
            refused.display()
        );
    }
    // Without the flag the same chain restores (a user's own diff chains).
    restore_and_dump(&s, &dotdot, "dotdot-out");
    let mut contained = Vmm::spawn(
        &[
            "--restore",
            inside.to_str().unwrap(),
            "--paused",
            "--contained-chain",
        ],
        &s.path("api2.sock"),
    );
    let out = s.path("inside-out");
    contained.ok(serde_json::json!({"op": "snapshot", "path": out}));
    contained.stop();
    assert!(counter(&out) >= counter(&base));
}

/// Restores `snap` paused and writes a full snapshot of it into `name`.
fn restore_and_dump(s: &Scratch, snap: &Path, name: &str) -> PathBuf {
    let out = s.path(name);
    let api = s.path(&format!("{name}.sock"));
    let mut vm = Vmm::spawn(&["--restore", snap.to_str().unwrap(), "--paused"], &api);
    vm.ok(serde_json::json!({"op": "snapshot", "path": out}));
    vm.stop();
    out
}

#[test]
fn forks_get_their_own_identity_and_private_memory() {
    const CHILDREN: u64 = 20;
    let s = Scratch::new("fork");
    // The VMM creates each tap (and the kernel removes it when the VMM exits).
    let tag = std::process::id() % 10_000;
    let mut vm = boot_guest(
        &s,
        &counter_with_mac_guest_code(),
        &["--net", &format!("tap=dsfb{tag},mac=06:00:00:00:00:01")],
    );
    std::thread::sleep(Duration::from_millis(100));
    let base = s.path("base");
    vm.ok(serde_json::json!({"op": "snapshot", "path": base}));
    vm.stop();
    let base_memory = std::fs::read(base.join("memory")).unwrap();

    let mac = |i: u64| [0x06, 0, 0, 0, 1, i as u8];
    let mut children = Vec::new();
    for i in 0..CHILDREN {
        let uds = s.path(&format!("child{i}.vsock"));
        let cid = (100 + i).to_string();
        let m = mac(i);
        let net = format!(
            "tap=dsf{tag}c{i},mac={}",
            m.iter()
                .map(|b| format!("{b:02x}"))
                .collect::<Vec<_>>()
                .join(":")
        );
        let child = Vmm::spawn(
            &[
                "--restore",
                base.to_str().unwrap(),
                "--vsock-uds",
                uds.to_str().unwrap(),
                "--vsock-cid",
                &cid,
                "--net",
                &net,
            ],
            &s.path(&format!("child{i}.api")),
        );
        children.push((i, uds, child));
    }
    let mut seen = std::collections::HashSet::new();
    for (i, uds, mut child) in children {
        assert!(uds.exists(), "child {i} has no vsock socket of its own");
        let tap = format!("/sys/class/net/dsf{tag}c{i}");
        assert!(Path::new(&tap).exists(), "child {i} has no tap of its own");
        let snap = s.path(&format!("child{i}.snap"));
        let mut guest_mac = 0;
        wait_until("the child to see its own CID and MAC", || {
            let _ = std::fs::remove_dir_all(&snap);
            child.ok(serde_json::json!({"op": "snapshot", "path": snap}));
            guest_mac = read_u64(&snap.join("memory"), MAC_COPY_ADDR) & 0xffff_ffff_ffff;
            read_u64(&snap.join("memory"), CID_COPY_ADDR) & 0xffff_ffff == 100 + i
                && guest_mac.to_le_bytes()[..6] == mac(i)
        });
        assert!(seen.insert(guest_mac), "child {i} shares a MAC");
        child.stop();
        assert!(
            !Path::new(&tap).exists(),
            "child {i}'s tap outlived its VMM"
        );
    }
    // Children wrote to their copies only.
    assert!(std::fs::read(base.join("memory")).unwrap() == base_memory);
}

#[test]
fn damaged_snapshots_fail_cleanly() {
    let s = Scratch::new("damaged");
    let mut vm = boot_counter(&s);
    std::thread::sleep(Duration::from_millis(50));
    let good = s.path("good");
    vm.ok(serde_json::json!({"op": "snapshot", "path": good}));
    // An existing directory is never overwritten.
    let r = vm.request(serde_json::json!({"op": "snapshot", "path": good}));
    assert_eq!(r["ok"], false);
    assert!(
        r["error"].as_str().unwrap().contains("already exists"),
        "{r}"
    );
    vm.stop();

    let copy = |name: &str| {
        let dir = s.path(name);
        std::fs::create_dir_all(&dir).unwrap();
        for f in ["state", "memory"] {
            std::fs::copy(good.join(f), dir.join(f)).unwrap();
        }
        dir
    };
    let state = std::fs::read(good.join("state")).unwrap();
    let truncated = copy("truncated");
    std::fs::write(truncated.join("state"), &state[..state.len() / 2]).unwrap();
    let corrupted = copy("corrupted");
    let mut bad = state.clone();
    let mid = bad.len() / 2;
    bad[mid] ^= 0x01;
    std::fs::write(corrupted.join("state"), &bad).unwrap();
    // A snapshot of the previous format (untyped device states) is refused by name.
    let old_format = copy("old-format");
    let mut other = state.clone();
    other[8..12].copy_from_slice(&1u32.to_le_bytes());
    std::fs::write(old_format.join("state"), &other).unwrap();
    let no_memory = copy("no-memory");
    std::fs::remove_file(no_memory.join("memory")).unwrap();
    let short_memory = copy("short-memory");
    std::fs::OpenOptions::new()
        .write(true)
        .open(short_memory.join("memory"))
        .unwrap()
        .set_len(4096)
        .unwrap();

    // A net override needs a network device in the snapshot.
    let out = Command::new(VMM)
        .args(["--restore", good.to_str().unwrap(), "--net", "tap=dsfnone"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("no network device"), "{stderr}");
    let out = Command::new(VMM)
        .args(["--restore", good.to_str().unwrap(), "--net", "tap=a/b"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("net.tap"), "{stderr}");

    for (dir, expect) in [
        (truncated, "truncated"),
        (corrupted, "checksum"),
        (
            old_format,
            "format version 1; this dsec-vmm reads version 2 only",
        ),
        (no_memory, "memory"),
        (short_memory, "truncated"),
        (s.path("missing"), "cannot read snapshot"),
    ] {
        let out = Command::new(VMM)
            .arg("--restore")
            .arg(&dir)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{}: {stderr}", dir.display());
        assert!(
            stderr.contains(expect),
            "{}: expected '{expect}' in: {stderr}",
            dir.display()
        );
    }
}

#[test]
fn lazy_restore_serves_faults_and_prefetches_the_recorded_working_set() {
    let s = Scratch::new("lazy");
    let mut vm = boot_counter(&s);
    let base = snapshot_once_counting(&mut vm, &s, "base");
    vm.stop();
    let at_snapshot = counter(&base);

    // First lazy restore: pages arrive on demand; record what the guest touches.
    let mut first = Vmm::spawn(
        &[
            "--restore",
            base.to_str().unwrap(),
            "--lazy",
            "--record-working-set",
            "300",
        ],
        &s.path("api1.sock"),
    );
    wait_until("the working set to be recorded", || {
        base.join("working-set").exists()
    });
    let status = first.ok(serde_json::json!({"op": "status"}));
    let faults = status["lazy_faults"].as_u64().unwrap();
    assert!(
        faults >= 2,
        "a running guest must fault in its code and data: {status}"
    );
    let out = s.path("out1");
    first.ok(serde_json::json!({"op": "snapshot", "path": out}));
    first.stop();
    assert!(
        counter(&out) > at_snapshot,
        "lazily restored guest did not continue"
    );
    let recorded: Vec<u64> =
        serde_json::from_slice(&std::fs::read(base.join("working-set")).unwrap()).unwrap();
    assert!(recorded.contains(&(COUNTER_ADDR / 4096)), "{recorded:?}");

    // Second: the recorded pages are loaded before the guest asks for them.
    let mut second = Vmm::spawn(
        &[
            "--restore",
            base.to_str().unwrap(),
            "--lazy",
            "--prefetch",
            "--paused",
        ],
        &s.path("api2.sock"),
    );
    wait_until("the prefetch to finish", || {
        second.ok(serde_json::json!({"op": "status"}))["lazy_prefetched"].as_u64()
            == Some(recorded.len() as u64)
    });
    second.ok(serde_json::json!({"op": "resume"}));
    std::thread::sleep(Duration::from_millis(200));
    let status = second.ok(serde_json::json!({"op": "status"}));
    assert_eq!(
        status["lazy_faults"], 0,
        "prefetched pages faulted again: {status}"
    );
    let out = s.path("out2");
    second.ok(serde_json::json!({"op": "snapshot", "path": out}));
    second.stop();
    assert!(counter(&out) > at_snapshot, "prefetched guest did not run");
}

#[test]
fn full_disk_fails_the_snapshot_and_leaves_nothing() {
    let s = Scratch::new("full-disk");
    let small = s.path("small");
    std::fs::create_dir_all(&small).unwrap();
    // 16 KiB cannot hold the state file (~23 KiB) plus the touched pages.
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=16k", "dsec-test-full"])
        .arg(&small)
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(mounted, "this test needs root to mount a small tmpfs");
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(&self.0).status();
        }
    }
    let _unmount = Unmount(small.clone());
    let mut vm = boot_counter(&s);
    wait_until("the guest to start counting", || {
        let probe = s.path("probe");
        let _ = std::fs::remove_dir_all(&probe);
        vm.ok(serde_json::json!({"op": "snapshot", "path": probe}));
        counter(&probe) > 0
    });
    let dest = small.join("snap");
    let r = vm.request(serde_json::json!({"op": "snapshot", "path": dest}));
    assert_eq!(r["ok"], false, "{r}");
    let error = r["error"].as_str().unwrap();
    assert!(
        error.contains("disk full") || error.contains("No space"),
        "{error}"
    );
    // Nothing half-written remains, and the VM keeps running.
    assert_eq!(std::fs::read_dir(&small).unwrap().count(), 0);
    let after = s.path("after");
    vm.ok(serde_json::json!({"op": "snapshot", "path": after}));
    vm.stop();
}

#[test]
fn prewarmed_vmm_restores_on_request_and_refuses_a_mismatched_snapshot() {
    let s = Scratch::new("prewarm");
    let mut vm = boot_counter(&s);
    let base = snapshot_once_counting(&mut vm, &s, "base");
    vm.stop();
    let at_snapshot = counter(&base);

    // Wrong size: the shell has 64 MiB, the snapshot 32 MiB.
    let mut wrong = Vmm::spawn(
        &["--prewarm", "--mem-mib", "64", "--vcpus", "1"],
        &s.path("wrong.sock"),
    );
    let r = wrong.request(serde_json::json!({"op": "restore", "path": base}));
    assert_eq!(r["ok"], false, "{r}");
    assert!(
        r["error"]
            .as_str()
            .unwrap()
            .contains("prewarmed VM has 64 MiB"),
        "{r}"
    );
    let status = wrong.child.wait().unwrap();
    assert_eq!(status.code(), Some(1));

    for lazy in [false, true] {
        let api = s.path(&format!("shell-{lazy}.sock"));
        let mut shell = Vmm::spawn(&["--prewarm", "--mem-mib", "32", "--vcpus", "1"], &api);
        // Only a restore is accepted before the VM exists.
        let early = shell.request(serde_json::json!({"op": "status"}));
        assert_eq!(early["ok"], false, "{early}");
        let uds = s.path(&format!("shell-{lazy}.vsock"));
        let r = shell.ok(serde_json::json!({
            "op": "restore", "path": base, "vsock_uds": uds, "lazy": lazy
        }));
        assert!(r["restore_ms"].as_f64().unwrap() >= 0.0, "{r}");
        let out = s.path(&format!("out-{lazy}"));
        wait_until("the restored guest to count on", || {
            let _ = std::fs::remove_dir_all(&out);
            shell.ok(serde_json::json!({"op": "snapshot", "path": out}));
            counter(&out) > at_snapshot
        });
        assert!(
            uds.exists(),
            "the restore request's vsock socket was not used"
        );
        shell.stop();
    }
}

#[test]
fn a_paused_vm_whose_guest_never_exits_stops_promptly() {
    // The sweeper never leaves the guest on its own: a stop whose kick reaches the vCPU
    // thread before it enters KVM_RUN (here: while it is parked) must still end the VMM,
    // which reads each vCPU's KVM statistics (they wait for the vCPU's KVM lock) on its way out.
    // Timing-dependent: without the fix, 20 rounds hung in 2 runs of 2 here.
    const PAGES: u32 = 8;
    let s = Scratch::new("stop-paused");
    let mut vm = boot_sweeper(&s, PAGES);
    let snap = s.path("snap");
    vm.ok(serde_json::json!({"op": "snapshot", "path": snap}));
    vm.stop();
    for round in 0..20 {
        let mut restored = Vmm::spawn(
            &["--restore", snap.to_str().unwrap(), "--paused"],
            &s.path(&format!("api-{round}.sock")),
        );
        restored.ok(serde_json::json!({"op": "stop"}));
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        let status = loop {
            if let Some(status) = restored.child.try_wait().unwrap() {
                break status;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "round {round}: the stopped VMM is still running after 20 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        assert!(
            status.success(),
            "round {round}: dsec-vmm exited with {status}"
        );
    }
}

#[test]
fn status_reports_kvm_counters_while_the_guest_never_leaves_kvm_run() {
    // The sweeper only writes memory: its vCPU stays inside KVM_RUN, holding the vCPU's
    // lock, so a status that asked KVM for the stats file now would wait forever.
    let s = Scratch::new("kvm-stats");
    let vm = boot_sweeper(&s, 1024);
    let mut socket = std::os::unix::net::UnixStream::connect(&vm.api).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    use std::io::{BufRead, Write};
    socket.write_all(b"{\"op\":\"status\"}\n").unwrap();
    let mut line = String::new();
    std::io::BufReader::new(&socket)
        .read_line(&mut line)
        .expect("status must answer while the vCPU runs");
    // The control thread serves one connection at a time: close this one before the stop.
    drop(socket);
    let status: serde_json::Value = serde_json::from_str(&line).unwrap();
    assert_eq!(status["state"], "running", "{status}");
    let exits = status["kvm_vcpu_stats"]["exits"].as_u64();
    assert!(
        exits.is_some_and(|n| n > 0),
        "no KVM exit counter: {status}"
    );
    vm.stop();
}
