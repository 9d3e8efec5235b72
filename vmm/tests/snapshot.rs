//! Snapshot, restore, diff snapshots and fork, driven through the real `dsec-vmm` binary and
//! its control socket, with tiny guests assembled here (they boot through PVH: 32-bit, paging
//! off, so they reach the vsock device's config space at 0xd000_0100 directly).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const VMM: &str = env!("CARGO_BIN_EXE_dsec-vmm");
const COUNTER_ADDR: u64 = 0x30_0000;
const CID_COPY_ADDR: u64 = 0x30_0008;

/// Where the net guest copies its MAC (the 6 bytes of the net device's config space).
const MAC_COPY_ADDR: u64 = 0x30_0010;
/// The net device's config space when vsock (slot 0) and net are the only devices.
const NET_CONFIG_ADDR: u32 = 0xd000_1100;

/// 32-bit guest: forever { eax = vsock config guest_cid; [0x300008] = eax; [0x300000] += 1 }.
fn counter_guest_code() -> Vec<u8> {
    looping(&[copy_dword(0xd000_0100, CID_COPY_ADDR as u32)])
}

/// The counter guest that also copies its MAC from the net device's config space.
fn counter_with_mac_guest_code() -> Vec<u8> {
    looping(&[
        copy_dword(0xd000_0100, CID_COPY_ADDR as u32),
        copy_dword(NET_CONFIG_ADDR, MAC_COPY_ADDR as u32),
        copy_dword(NET_CONFIG_ADDR + 4, MAC_COPY_ADDR as u32 + 4),
    ])
}

/// `mov eax, [from]; mov [to], eax`.
fn copy_dword(from: u32, to: u32) -> Vec<u8> {
    let mut code = vec![0xa1];
    code.extend_from_slice(&from.to_le_bytes());
    code.push(0xa3);
    code.extend_from_slice(&to.to_le_bytes());
    code
}

/// `body; inc dword [counter]; jmp <start>`.
fn looping(body: &[Vec<u8>]) -> Vec<u8> {
    let mut code: Vec<u8> = body.concat();
    code.extend_from_slice(&[0xff, 0x05]);
    code.extend_from_slice(&(COUNTER_ADDR as u32).to_le_bytes()); // inc dword [counter]
    let back = i8::try_from(-(code.len() as i64 + 2)).expect("loop body fits a short jump");
    code.extend_from_slice(&[0xeb, back as u8]);
    code
}

/// A minimal ELF64 with one PT_LOAD at 2 MiB and a PVH entry note pointing at it.
fn pvh_elf(code: &[u8]) -> Vec<u8> {
    let load: u64 = 0x20_0000;
    let note: Vec<u8> = [4u32, 4, 18]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .chain(*b"Xen\0")
        .chain((load as u32).to_le_bytes())
        .collect();
    let phoff = 64u64;
    let note_off = phoff + 2 * 56;
    let code_off = (note_off + note.len() as u64 + 15) & !15;
    let mut e = Vec::new();
    e.extend_from_slice(b"\x7fELF\x02\x01\x01");
    e.resize(16, 0);
    e.extend_from_slice(&2u16.to_le_bytes()); // ET_EXEC
    e.extend_from_slice(&0x3eu16.to_le_bytes()); // x86-64
    e.extend_from_slice(&1u32.to_le_bytes());
    e.extend_from_slice(&load.to_le_bytes()); // entry
    e.extend_from_slice(&phoff.to_le_bytes());
    e.extend_from_slice(&0u64.to_le_bytes());
    e.extend_from_slice(&0u32.to_le_bytes());
    for v in [64u16, 56, 2, 64, 0, 0] {
        e.extend_from_slice(&v.to_le_bytes());
    }
    let phdr =
        |e: &mut Vec<u8>, kind: u32, flags: u32, off: u64, addr: u64, size: u64, align: u64| {
            e.extend_from_slice(&kind.to_le_bytes());
            e.extend_from_slice(&flags.to_le_bytes());
            for v in [off, addr, addr, size, size, align] {
                e.extend_from_slice(&v.to_le_bytes());
            }
        };
    phdr(&mut e, 1, 5, code_off, load, code.len() as u64, 0x1000);
    phdr(&mut e, 4, 4, note_off, 0, note.len() as u64, 4);
    e.extend_from_slice(&note);
    e.resize(code_off as usize, 0);
    e.extend_from_slice(code);
    e
}

struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("dsec-snap-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A dsec-vmm child that is killed if the test fails.
struct Vmm {
    child: Child,
    api: PathBuf,
}

impl Vmm {
    fn spawn(args: &[&str], api: &Path) -> Vmm {
        let child = Command::new(VMM)
            .args(args)
            .arg("--api-sock")
            .arg(api)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn dsec-vmm");
        let deadline = Instant::now() + Duration::from_secs(10);
        while !api.exists() {
            assert!(Instant::now() < deadline, "control socket never appeared");
            std::thread::sleep(Duration::from_millis(2));
        }
        Vmm {
            child,
            api: api.to_owned(),
        }
    }

    fn request(&mut self, req: serde_json::Value) -> serde_json::Value {
        // The socket file appears at bind(), a moment before listen(): retry briefly.
        let mut attempt = 0;
        let mut s = loop {
            match UnixStream::connect(&self.api) {
                Ok(s) => break s,
                Err(e) if attempt < 100 && e.kind() == std::io::ErrorKind::ConnectionRefused => {
                    attempt += 1;
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => panic!("{req}: control socket: {e}; {}", self.post_mortem()),
            }
        };
        s.write_all(format!("{req}\n").as_bytes()).unwrap();
        let mut line = String::new();
        BufReader::new(s).read_line(&mut line).unwrap();
        serde_json::from_str(&line).unwrap()
    }

    /// What became of the VMM process, for failure messages.
    fn post_mortem(&mut self) -> String {
        use std::io::Read;
        let status = self.child.try_wait();
        let mut stderr = String::new();
        if let Ok(Some(_)) = status {
            if let Some(pipe) = self.child.stderr.as_mut() {
                let _ = pipe.read_to_string(&mut stderr);
            }
        }
        format!("VMM status {status:?}, stderr: {stderr}")
    }

    fn ok(&mut self, req: serde_json::Value) -> serde_json::Value {
        let r = self.request(req.clone());
        assert_eq!(r["ok"], true, "{req} -> {r}");
        r
    }

    fn stop(mut self) {
        self.ok(serde_json::json!({"op": "stop"}));
        let status = self.child.wait().unwrap();
        assert!(status.success(), "dsec-vmm exited with {status}");
    }
}

impl Drop for Vmm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn read_u64(file: &Path, offset: u64) -> u64 {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open(file).unwrap();
    f.seek(SeekFrom::Start(offset)).unwrap();
    let mut b = [0u8; 8];
    f.read_exact(&mut b).unwrap();
    u64::from_le_bytes(b)
}

fn counter(snapshot: &Path) -> u64 {
    read_u64(&snapshot.join("memory"), COUNTER_ADDR) & 0xffff_ffff
}

fn boot_counter(s: &Scratch) -> Vmm {
    boot_guest(s, &counter_guest_code(), &[])
}

fn boot_guest(s: &Scratch, code: &[u8], extra: &[&str]) -> Vmm {
    let kernel = s.path("counter.elf");
    std::fs::write(&kernel, pvh_elf(code)).unwrap();
    let uds = s.path("vsock.sock");
    let mut args = vec![
        "--kernel",
        kernel.to_str().unwrap(),
        "--mem-mib",
        "32",
        "--vsock-uds",
        uds.to_str().unwrap(),
        "--vsock-cid",
        "7",
    ];
    args.extend_from_slice(extra);
    Vmm::spawn(&args, &s.path("api.sock"))
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    // Generous: under a loaded CI machine emulated guest code crawls, and every probe
    // here is a snapshot that pauses the guest.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(250));
    }
}

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
    let foreign = copy("foreign");
    let mut other = state.clone();
    other[8..12].copy_from_slice(&2u32.to_le_bytes());
    std::fs::write(foreign.join("state"), &other).unwrap();
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
        (foreign, "format version 2"),
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
    let base = s.path("base");
    wait_until("the guest to start counting", || {
        let _ = std::fs::remove_dir_all(&base);
        vm.ok(serde_json::json!({"op": "snapshot", "path": base}));
        counter(&base) > 0
    });
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
    let base = s.path("base");
    wait_until("the guest to start counting", || {
        let _ = std::fs::remove_dir_all(&base);
        vm.ok(serde_json::json!({"op": "snapshot", "path": base}));
        counter(&base) > 0
    });
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
