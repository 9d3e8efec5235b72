//! Integration tests that boot the in-tree test guests (`vmm/test-guests`) through the real
//! `dsec-vmm` binary and check what they report over the serial port, plus the VMM's handling
//! of bad input and repeated create/destroy.
//!
//! The guests do their work at CPL 3, so these run in seconds even on the software PVM
//! hypervisor. The guests are built once per test run with cargo (see `guests()`).
//! Every test takes `SERIAL` so they run one at a time: the leak check counts this
//! process's fds and threads, and the throughput figures are not skewed by other VMs.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{mpsc, Mutex, MutexGuard, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

const VMM: &str = env!("CARGO_BIN_EXE_dsec-vmm");
const GUEST_CID: u64 = 42;

static SERIAL: Mutex<()> = Mutex::new(());

fn serial_lock() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

// ---------------------------------------------------------------------------------------------
// Building the guests.

/// Builds the guest crate once and returns the directory holding the guest binaries.
fn guests() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("test-guests");
        // <target>/<profile>/dsec-vmm -> <target>/test-guests
        let target = Path::new(VMM)
            .parent()
            .and_then(Path::parent)
            .expect("dsec-vmm lives in <target>/<profile>")
            .join("test-guests");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        // Cargo reads test-guests/.cargo/config.toml (target flags, linker script) only when
        // run from that directory; flags from the outer build must not leak in.
        let out = Command::new(cargo)
            .current_dir(&crate_dir)
            .args(["build", "--release", "--target-dir"])
            .arg(&target)
            .env_remove("RUSTFLAGS")
            .env_remove("CARGO_ENCODED_RUSTFLAGS")
            .env_remove("CARGO_BUILD_RUSTFLAGS")
            .env_remove("CARGO_BUILD_TARGET")
            .env_remove("CARGO_TARGET_DIR")
            .output()
            .expect("run cargo to build the test guests");
        assert!(
            out.status.success(),
            "building the test guests failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        target.join("x86_64-unknown-linux-gnu").join("release")
    })
}

fn guest(name: &str) -> PathBuf {
    let p = guests().join(name);
    assert!(p.exists(), "guest binary {} missing", p.display());
    p
}

/// Writes a copy of `src` whose PT_NOTE headers are PT_NULL: without the PVH note the VMM
/// boots the same image through the Linux 64-bit boot protocol (ELF entry point).
fn without_pvh_note(src: &Path, dst: &Path) {
    let mut elf = std::fs::read(src).expect("read guest ELF");
    let u16_at = |b: &[u8], o: usize| u16::from_le_bytes([b[o], b[o + 1]]) as usize;
    let phoff = u64::from_le_bytes(elf[32..40].try_into().unwrap()) as usize;
    let phentsize = u16_at(&elf, 54);
    let phnum = u16_at(&elf, 56);
    let mut found = false;
    for i in 0..phnum {
        let o = phoff + i * phentsize;
        if elf[o..o + 4] == 4u32.to_le_bytes() {
            elf[o..o + 4].copy_from_slice(&0u32.to_le_bytes());
            found = true;
        }
    }
    assert!(found, "{} has no PT_NOTE", src.display());
    std::fs::write(dst, elf).expect("write ELF copy");
}

// ---------------------------------------------------------------------------------------------
// Scratch directories, running the VMM, parsing results.

struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "dsec-tg-{}-{}-{}",
            std::process::id(),
            name,
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create scratch dir");
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

#[derive(Debug)]
struct Run {
    status: ExitStatus,
    stdout: String,
    stderr: String,
    serial: String,
    elapsed: Duration,
}

impl Run {
    fn describe(&self) -> String {
        format!(
            "status {:?} after {:?}\n--- stderr ---\n{}\n--- serial ---\n{}",
            self.status, self.elapsed, self.stderr, self.serial
        )
    }

    /// Asserts a clean reset (exit 0) and that the guest reported no failure.
    fn assert_passed(&self) -> Vec<String> {
        assert_eq!(self.status.code(), Some(0), "{}", self.describe());
        let (oks, fails, done) = parse_results(&self.serial);
        assert!(
            fails.is_empty(),
            "guest checks failed: {fails:#?}\n{}",
            self.describe()
        );
        assert_eq!(
            done,
            Some((oks.len(), 0)),
            "missing or inconsistent DONE line\n{}",
            self.describe()
        );
        assert!(!oks.is_empty(), "guest ran no checks\n{}", self.describe());
        oks
    }
}

/// (ok check names, FAIL lines, DONE (ok, fail)).
fn parse_results(serial: &str) -> (Vec<String>, Vec<String>, Option<(usize, usize)>) {
    let mut oks = Vec::new();
    let mut fails = Vec::new();
    let mut done = None;
    for line in serial.lines() {
        if let Some(name) = line.strip_prefix("ok ") {
            oks.push(name.to_string());
        } else if line.starts_with("FAIL ") {
            fails.push(line.to_string());
        } else if let Some(rest) = line.strip_prefix("DONE ") {
            let mut it = rest.split(' ').map(|n| n.parse::<usize>().ok());
            if let (Some(Some(a)), Some(Some(b))) = (it.next(), it.next()) {
                done = Some((a, b));
            }
        }
    }
    (oks, fails, done)
}

/// A running dsec-vmm with its output collected by threads.
struct Vmm {
    child: std::process::Child,
    out: Option<thread::JoinHandle<(String, String)>>,
    serial_log: Option<PathBuf>,
    started: Instant,
}

impl Vmm {
    fn spawn(args: &[String], serial_log: &Path) -> Vmm {
        Self::spawn_with(args, Some(serial_log))
    }

    /// `serial_log: None` sends the console to the VMM's stdout instead.
    fn spawn_with(args: &[String], serial_log: Option<&Path>) -> Vmm {
        let mut cmd = Command::new(VMM);
        cmd.args(args);
        match serial_log {
            Some(log) => cmd.arg("--serial-log").arg(log),
            None => cmd.arg("--serial-stdout"),
        };
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn dsec-vmm");
        let mut so = child.stdout.take().unwrap();
        let mut se = child.stderr.take().unwrap();
        let out = thread::spawn(move || {
            let err = thread::spawn(move || {
                let mut s = String::new();
                let _ = se.read_to_string(&mut s);
                s
            });
            let mut o = String::new();
            let _ = so.read_to_string(&mut o);
            (o, err.join().unwrap_or_default())
        });
        Vmm {
            child,
            out: Some(out),
            serial_log: serial_log.map(Path::to_path_buf),
            started: Instant::now(),
        }
    }

    fn serial(&self) -> String {
        let bytes = self
            .serial_log
            .as_ref()
            .and_then(|p| std::fs::read(p).ok())
            .unwrap_or_default();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Waits until the serial log contains `needle` (panics on exit or timeout).
    fn wait_for_serial(&mut self, needle: &str, timeout: Duration) {
        let t0 = Instant::now();
        loop {
            if self.serial().contains(needle) {
                return;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "dsec-vmm exited ({status}) before printing {needle:?}:\n{}",
                    self.serial()
                );
            }
            if t0.elapsed() > timeout {
                panic!("no {needle:?} after {timeout:?}:\n{}", self.serial());
            }
            thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits for the VMM to exit; kills it (and panics) after `timeout`.
    fn wait(mut self, timeout: Duration) -> Run {
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("wait for dsec-vmm") {
                break status;
            }
            if self.started.elapsed() > timeout {
                let _ = self.child.kill();
                let _ = self.child.wait();
                let (_, stderr) = self.out.take().unwrap().join().unwrap_or_default();
                panic!(
                    "dsec-vmm still running after {timeout:?}; killed\n--- stderr ---\n{stderr}\n--- serial ---\n{}",
                    self.serial()
                );
            }
            thread::sleep(Duration::from_millis(5));
        };
        let elapsed = self.started.elapsed();
        let (stdout, stderr) = self.out.take().unwrap().join().unwrap_or_default();
        Run {
            status,
            stdout,
            stderr,
            serial: self.serial(),
            elapsed,
        }
    }
}

impl Drop for Vmm {
    fn drop(&mut self) {
        // Only reached with the child still running when a test panicked mid-way.
        if self.out.is_some() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

fn run_guest(scratch: &Scratch, kernel: &Path, extra: &[&str], timeout: Duration) -> Run {
    let mut a = vec!["--kernel".to_string(), kernel.display().to_string()];
    a.extend(args(extra));
    Vmm::spawn(&a, &scratch.path("serial.log")).wait(timeout)
}

// ---------------------------------------------------------------------------------------------
// The data pattern shared with the guests (vmm/test-guests/src/lib.rs).

fn pattern_word(seed: u64, k: u64) -> u64 {
    let mut z = seed
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .wrapping_add(k.wrapping_mul(0xd1b5_4a32_d192_ed03));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn hash_word(h: u64, w: u64) -> u64 {
    (h ^ w).wrapping_mul(0x0000_0100_0000_01b3)
}

const HASH_INIT: u64 = 0xcbf2_9ce4_8422_2325;

/// `len` bytes of pattern `seed` starting at byte 0.
fn pattern_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len + 8);
    for k in 0..len.div_ceil(8) as u64 {
        v.extend_from_slice(&pattern_word(seed, k).to_le_bytes());
    }
    v.truncate(len);
    v
}

// ---------------------------------------------------------------------------------------------
// Serial console, reset and crash.

const SERIAL_TEXT: &str = "dsec test guest: serial\n\
line 2: the quick brown fox jumps over the lazy dog 0123456789\n\
line 3: no newline yet... done\n";

#[test]
fn serial_guest_output_is_exact_in_log() {
    let _g = serial_lock();
    let s = Scratch::new("serial");
    let run = run_guest(&s, &guest("serial"), &[], Duration::from_secs(30));
    assert_eq!(run.status.code(), Some(0), "{}", run.describe());
    let want = format!("{SERIAL_TEXT}boot kind 1\nDONE 0 0\n");
    assert_eq!(run.serial, want, "serial log differs\n{}", run.describe());
    eprintln!("serial guest (PVH): {:?}", run.elapsed);
}

#[test]
fn serial_guest_output_on_stdout_via_linux64_entry() {
    let _g = serial_lock();
    let s = Scratch::new("serial64");
    let kernel = s.path("serial-nonote");
    without_pvh_note(&guest("serial"), &kernel);
    let a = args(&["--kernel", kernel.to_str().unwrap()]);
    let run = Vmm::spawn_with(&a, None).wait(Duration::from_secs(30));
    assert_eq!(
        run.status.code(),
        Some(0),
        "{}\nstdout: {}",
        run.describe(),
        run.stdout
    );
    // Boot kind 2 proves the image was entered through the 64-bit boot protocol.
    assert!(
        run.stdout
            .contains(&format!("{SERIAL_TEXT}boot kind 2\nDONE 0 0\n")),
        "stdout: {}",
        run.stdout
    );
}

#[test]
fn triple_fault_is_reported_as_crash() {
    let _g = serial_lock();
    let s = Scratch::new("triple");
    let run = run_guest(&s, &guest("triple-fault"), &[], Duration::from_secs(30));
    assert_eq!(run.status.code(), Some(3), "{}", run.describe());
    assert!(
        run.stderr.contains("triple fault"),
        "stderr does not say \"triple fault\"\n{}",
        run.describe()
    );
    assert!(
        run.serial.contains("about to triple fault"),
        "{}",
        run.describe()
    );
}

// ---------------------------------------------------------------------------------------------
// Boot protocol.

const INITRD_SEED: u64 = 7;

fn boot_proto(kind: &str, vcpus: u32, mem_mib: u64, initrd_len: Option<usize>, vsock: bool) {
    let _g = serial_lock();
    let s = Scratch::new("bootproto");
    let kernel = if kind == "pvh" {
        guest("boot-proto")
    } else {
        let k = s.path("boot-proto-nonote");
        without_pvh_note(&guest("boot-proto"), &k);
        k
    };
    let mut cmdline =
        format!("expect_boot={kind} expect_mem={mem_mib}M expect_vcpus={vcpus} token=t0k3n-{kind}");
    let mut a = vec![
        "--kernel".to_string(),
        kernel.display().to_string(),
        "--vcpus".into(),
        vcpus.to_string(),
        "--mem-mib".into(),
        mem_mib.to_string(),
    ];
    if let Some(len) = initrd_len {
        let path = s.path("initrd.img");
        std::fs::write(&path, pattern_bytes(INITRD_SEED, len)).unwrap();
        a.extend(["--initrd".into(), path.display().to_string()]);
        cmdline += &format!(" initrd_size={len} initrd_seed={INITRD_SEED}");
    }
    if vsock {
        a.extend(["--vsock-uds".into(), s.path("v.sock").display().to_string()]);
        cmdline += " expect_virtio_mmio=1";
    }
    a.extend(["--cmdline".into(), cmdline.clone()]);
    let run = Vmm::spawn(&a, &s.path("serial.log")).wait(Duration::from_secs(60));
    let oks = run.assert_passed();
    // The command line must arrive unchanged (the VMM may only append).
    let seen = run
        .serial
        .lines()
        .find_map(|l| l.strip_prefix("cmdline: "))
        .unwrap_or_default();
    assert!(
        seen.starts_with(&cmdline),
        "cmdline {seen:?} does not start with {cmdline:?}"
    );
    for must in [
        "entry-cs",
        "memmap-layout",
        "cmdline-addr",
        "mp-cpu-count",
        "vmm-gdt-code",
    ] {
        assert!(
            oks.iter().any(|o| o == must),
            "check {must} did not run\n{}",
            run.describe()
        );
    }
    if initrd_len.is_some() {
        assert!(
            oks.iter().any(|o| o == "initrd-content"),
            "{}",
            run.describe()
        );
    }
    if kind == "linux64" {
        assert!(
            oks.iter().any(|o| o == "boot-params-header"),
            "{}",
            run.describe()
        );
        assert!(
            oks.iter().any(|o| o == "vmm-page-tables-identity-1g"),
            "{}",
            run.describe()
        );
    }
    eprintln!(
        "boot-proto {kind}: {} checks in {:?}",
        oks.len(),
        run.elapsed
    );
}

#[test]
fn boot_protocol_pvh_with_initrd_and_vsock() {
    boot_proto("pvh", 2, 256, Some(1_000_003), true);
}

#[test]
fn boot_protocol_linux64_with_initrd() {
    boot_proto("linux64", 1, 128, Some(4096 * 3 + 17), false);
}

#[test]
fn boot_protocol_pvh_no_initrd_four_vcpus() {
    boot_proto("pvh", 4, 64, None, false);
}

#[test]
fn boot_protocol_linux64_large_memory() {
    boot_proto("linux64", 3, 3072, Some(64 << 20), false);
}

// ---------------------------------------------------------------------------------------------
// Memory.

fn memory(mem_mib: u64, timeout_s: u64) {
    let _g = serial_lock();
    let s = Scratch::new("memory");
    let cmdline = format!("expect_mem={mem_mib}M");
    let mib = mem_mib.to_string();
    let run = run_guest(
        &s,
        &guest("memory"),
        &["--mem-mib", &mib, "--cmdline", &cmdline],
        Duration::from_secs(timeout_s),
    );
    let oks = run.assert_passed();
    assert!(
        oks.iter().any(|o| o == "memory-pattern"),
        "{}",
        run.describe()
    );
    let tested = run
        .serial
        .lines()
        .find(|l| l.starts_with("tested"))
        .unwrap_or_default();
    eprintln!("memory {mem_mib} MiB: {tested}; {:?} total", run.elapsed);
}

#[test]
fn memory_pattern_256m() {
    memory(256, 60);
}

#[test]
fn memory_pattern_1g() {
    memory(1024, 120);
}

// ---------------------------------------------------------------------------------------------
// virtio-rng.

#[test]
fn rng_guest_gets_entropy_and_survives_hostile_buffers() {
    let _g = serial_lock();
    let s = Scratch::new("rng");
    // vsock takes slot 0, so the guest must find the rng in slot 1.
    let uds = s.path("v.sock").display().to_string();
    let run = run_guest(
        &s,
        &guest("rng"),
        &["--rng", "--vsock-uds", &uds, "--cmdline", "rng_rounds=256"],
        Duration::from_secs(60),
    );
    let oks = run.assert_passed();
    for must in ["rng-4k", "rng-capped", "rng-outside-ram", "rng-rounds"] {
        assert!(oks.iter().any(|o| o == must), "{must}\n{}", run.describe());
    }
    let line = run.serial.lines().find(|l| l.starts_with("rng:"));
    eprintln!("rng: {line:?}; {:?} total", run.elapsed);
}

// ---------------------------------------------------------------------------------------------
// virtio-balloon.

/// One request on a VMM control socket; the JSON reply.
fn api(sock: &Path, request: &str) -> serde_json::Value {
    let mut s = UnixStream::connect(sock).expect("connect to the control socket");
    s.write_all(format!("{request}\n").as_bytes()).unwrap();
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line).unwrap();
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("reply {line:?}: {e}"))
}

fn wait_for_path(p: &Path) {
    let t0 = Instant::now();
    while !p.exists() {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "{} never appeared",
            p.display()
        );
        thread::sleep(Duration::from_millis(10));
    }
}

/// VmRSS of process `pid` in MiB.
fn rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS in /proc/PID/status");
    kib / 1024.0
}

/// Waits until the balloon guest's statistics round counter (tag 99) reaches `n`.
fn wait_stats_rounds(sock: &Path, n: u64) {
    let t0 = Instant::now();
    loop {
        let r = api(sock, r#"{"op":"balloon"}"#);
        let got = r["stats"]["tag_99"].as_u64().unwrap_or(0);
        if got >= n {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "only {got} statistics rounds in 15 s: {r}"
        );
        thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn balloon_inflate_deflate_stats_reporting_and_snapshot() {
    let _g = serial_lock();
    let s = Scratch::new("balloon");
    let sock = s.path("api.sock");
    let a = args(&[
        "--kernel",
        &guest("balloon").display().to_string(),
        "--mem-mib",
        "256",
        "--balloon",
        "deflate-on-oom,stats=1,reporting",
        "--api-sock",
        &sock.display().to_string(),
        "--cmdline",
        "balloon_mode=full",
    ]);
    let mut vmm = Vmm::spawn(&a, &s.path("serial.log"));
    let pid = vmm.child.id();
    let long = Duration::from_secs(120);
    vmm.wait_for_serial("balloon: touched", long);
    wait_for_path(&sock);
    let touched = rss_mib(pid);
    let r = api(&sock, r#"{"op":"balloon","target_mib":100000}"#);
    assert_eq!(r["ok"], false, "{r}");
    assert!(
        r["error"].as_str().unwrap().contains("at most 256 MiB"),
        "{r}"
    );
    let r = api(&sock, r#"{"op":"balloon","target_mib":64}"#);
    assert_eq!(r["ok"], true, "{r}");
    assert_eq!(r["target_pages"], 16384, "{r}");

    vmm.wait_for_serial("balloon: inflated", long);
    let inflated = rss_mib(pid);
    eprintln!(
        "balloon: VMM RSS {touched:.1} MiB touched -> {inflated:.1} MiB after a 64 MiB inflate"
    );
    assert!(
        touched - inflated >= 56.0,
        "RSS fell only {:.1} MiB ({touched:.1} -> {inflated:.1})",
        touched - inflated
    );
    // The guest writes `actual` right after its last chain; give the write a moment.
    let t0 = Instant::now();
    let status = loop {
        let r = api(&sock, r#"{"op":"balloon"}"#);
        if r["actual_pages"] == 16384 || t0.elapsed() > Duration::from_secs(10) {
            break r;
        }
        thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status["actual_pages"], 16384, "{status}");
    assert_eq!(status["actual_mib"], 64, "{status}");
    assert!(
        status["inflated_pages"].as_u64().unwrap() >= 16384,
        "{status}"
    );
    // BAD holds 4 frames outside RAM twice over (16 bytes, then 6 bytes: one whole frame);
    // the outside-RAM and wrapping buffers are unreadable chains.
    assert!(status["bad_pfns"].as_u64().unwrap() >= 5, "{status}");
    assert!(status["bad_chains"].as_u64().unwrap() >= 2, "{status}");
    assert_eq!(status["stats"]["free_memory"], 12345, "{status}");
    assert_eq!(status["stats"]["total_memory"], 256u64 << 20, "{status}");

    // A snapshot taken now and restored elsewhere keeps the balloon.
    let snap = s.path("snap");
    let r = api(
        &sock,
        &format!(r#"{{"op":"snapshot","path":"{}"}}"#, snap.display()),
    );
    assert_eq!(r["ok"], true, "{r}");
    let sock2 = s.path("api2.sock");
    let restored = Vmm::spawn(
        &args(&[
            "--restore",
            &snap.display().to_string(),
            "--api-sock",
            &sock2.display().to_string(),
            "--paused",
        ]),
        &s.path("serial2.log"),
    );
    wait_for_path(&sock2);
    let r = api(&sock2, r#"{"op":"balloon"}"#);
    assert_eq!(
        (&r["target_pages"], &r["actual_pages"]),
        (&16384.into(), &16384.into()),
        "{r}"
    );
    assert_eq!(r["stats"]["free_memory"], 12345, "{r}");
    assert_eq!(r["inflated_pages"], status["inflated_pages"], "{r}");
    // The restored guest carries on as the driver: it deflates, reports and finishes there.
    let mut restored = restored;
    assert_eq!(api(&sock2, r#"{"op":"resume"}"#)["ok"], true);
    assert_eq!(
        api(&sock2, r#"{"op":"balloon","target_mib":0}"#)["ok"],
        true
    );
    restored.wait_for_serial("balloon: reported", long);
    let r = api(&sock2, r#"{"op":"balloon"}"#);
    assert_eq!(r["reported_bytes"], 32u64 << 20, "{r}");
    // Statistics polling goes on after the restore.
    wait_stats_rounds(&sock2, 2);
    api(&sock2, r#"{"op":"balloon","target_mib":1}"#);
    let run2 = restored.wait(long);
    assert!(run2.status.success(), "{}", run2.describe());
    // Dropped pages of a restored VM read as the snapshot file's contents, not zeroes (the
    // mapping is a private file mapping): that one check is expected to fail there.
    let (oks, fails, _) = parse_results(&run2.serial);
    assert!(
        fails.len() == 1 && fails[0].starts_with("FAIL balloon-reported-pages-zero"),
        "{}",
        run2.describe()
    );
    for must in ["balloon-deflate", "balloon-report", "balloon-done"] {
        assert!(oks.iter().any(|o| o == must), "{must}\n{}", run2.describe());
    }

    let r = api(&sock, r#"{"op":"balloon","target_mib":0}"#);
    assert_eq!(r["ok"], true, "{r}");
    vmm.wait_for_serial("balloon: reported", long);
    let reported = rss_mib(pid);
    eprintln!("balloon: VMM RSS {inflated:.1} MiB -> {reported:.1} MiB after deflate + 32 MiB free page report");
    assert!(
        inflated - reported >= 24.0,
        "RSS fell only {:.1} MiB after the report",
        inflated - reported
    );
    let status = api(&sock, r#"{"op":"balloon"}"#);
    assert_eq!(status["reported_bytes"], 32u64 << 20, "{status}");
    assert!(
        status["deflated_pages"].as_u64().unwrap() >= 16384,
        "{status}"
    );
    // The device keeps asking every second: the guest's round counter (tag 99) climbs.
    wait_stats_rounds(&sock, 2);
    // A 1 MiB target tells the guest to finish.
    let r = api(&sock, r#"{"op":"balloon","target_mib":1}"#);
    assert_eq!(r["ok"], true, "{r}");
    let run = vmm.wait(long);
    let oks = run.assert_passed();
    for must in [
        "balloon-features-negotiated",
        "balloon-hostile-inflate-returned",
        "balloon-deflated-pages-zero",
        "balloon-reported-pages-zero",
        "balloon-stats-rounds",
    ] {
        assert!(oks.iter().any(|o| o == must), "{must}\n{}", run.describe());
    }
    assert!(
        !run.stderr.contains("forbidden system call"),
        "{}",
        run.stderr
    );
}

#[test]
fn balloon_plain_negotiates_only_inflate_and_deflate() {
    let _g = serial_lock();
    let s = Scratch::new("balloon-plain");
    let run = run_guest(
        &s,
        &guest("balloon"),
        &[
            "--mem-mib",
            "128",
            "--balloon",
            "--cmdline",
            "balloon_mode=plain",
        ],
        Duration::from_secs(60),
    );
    let oks = run.assert_passed();
    for must in [
        "balloon-features-negotiated",
        "balloon-queue-count",
        "balloon-plain-inflate",
    ] {
        assert!(oks.iter().any(|o| o == must), "{must}\n{}", run.describe());
    }
    let err = vmm_error(&["--kernel", "/proc/self/exe", "--balloon", "stats=often"]);
    assert!(err.contains("stats=`often`"), "{err}");
    // A VM without a balloon says so on the control socket.
    let sock = s.path("api.sock");
    let vmm = Vmm::spawn(
        &args(&[
            "--kernel",
            &guest("serial").display().to_string(),
            "--paused",
            "--api-sock",
            &sock.display().to_string(),
        ]),
        &s.path("serial2.log"),
    );
    wait_for_path(&sock);
    let r = api(&sock, r#"{"op":"balloon","target_mib":8}"#);
    assert_eq!(r["ok"], false, "{r}");
    assert!(
        r["error"].as_str().unwrap().contains("no balloon device"),
        "{r}"
    );
    api(&sock, r#"{"op":"stop"}"#);
    let run = vmm.wait(Duration::from_secs(30));
    assert!(run.status.success(), "{}", run.describe());
}

// ---------------------------------------------------------------------------------------------
// virtio-blk.

fn allocated_bytes(p: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(p).unwrap().blocks() * 512
}

#[test]
fn block_two_disks_read_write_discard_and_bounds() {
    let _g = serial_lock();
    let s = Scratch::new("blk");
    // disk0: 64 MiB sparse, pattern seed 1 over its first 4 MiB; disk1: 1 MiB + 100 bytes
    // (capacity rounds down), pattern seed 2, read-only.
    let d0 = s.path("disk0.img");
    let f = std::fs::File::create(&d0).unwrap();
    f.set_len(64 << 20).unwrap();
    use std::os::unix::fs::FileExt;
    f.write_all_at(&pattern_bytes(1, 4 << 20), 0).unwrap();
    drop(f);
    let d1 = s.path("disk1.img");
    std::fs::write(&d1, pattern_bytes(2, (1 << 20) + 100)).unwrap();
    let before = allocated_bytes(&d0);
    let drive0 = d0.display().to_string();
    let drive1 = format!("{},ro", d1.display());
    let cmdline = format!(
        "cap0={} cap1={} seq_mib=32",
        (64 << 20) / 512,
        (1 << 20) / 512
    );
    let run = run_guest(
        &s,
        &guest("block"),
        &[
            "--drive",
            &drive0,
            "--drive",
            &drive1,
            "--rng",
            "--cmdline",
            &cmdline,
        ],
        Duration::from_secs(120),
    );
    let oks = run.assert_passed();
    for must in [
        "blk-write-readback",
        "blk-discard",
        "blk-zeroed-reads-zero",
        "blk-get-id",
    ] {
        assert!(oks.iter().any(|o| o == must), "{must}\n{}", run.describe());
    }
    // The guest's write landed at sector 2048; its discard freed host blocks.
    let disk = std::fs::read(&d0).unwrap();
    assert_eq!(
        &disk[1 << 20..(1 << 20) + 65536],
        &pattern_bytes(3, 65536)[..]
    );
    assert!(disk[2 << 20..3 << 20].iter().all(|&b| b == 0));
    let after = allocated_bytes(&d0);
    assert!(
        after < before,
        "discard did not punch a hole: {before} -> {after} bytes"
    );
    assert_eq!(
        std::fs::read(&d1).unwrap(),
        pattern_bytes(2, (1 << 20) + 100)
    );
    let line = run.serial.lines().find(|l| l.starts_with("blk:"));
    eprintln!(
        "blk: {line:?}; allocated {before} -> {after} bytes; {:?} total",
        run.elapsed
    );
}

#[test]
fn block_bad_drive_is_refused_with_the_field_named() {
    let _g = serial_lock();
    let s = Scratch::new("blkbad");
    let missing = s.path("missing.img").display().to_string();
    let err = vmm_error(&[
        "--kernel",
        &guest("serial").display().to_string(),
        "--drive",
        &missing,
    ]);
    assert!(
        err.contains("`drives`") && err.contains("missing.img"),
        "{err}"
    );
    // The same writable image twice: the second open finds the lock.
    let img = s.path("a.img");
    std::fs::write(&img, vec![0u8; 4096]).unwrap();
    let a = img.display().to_string();
    let err = vmm_error(&[
        "--kernel",
        &guest("serial").display().to_string(),
        "--drive",
        &a,
        "--drive",
        &a,
    ]);
    assert!(err.contains("in use by another VM"), "{err}");
}

// ---------------------------------------------------------------------------------------------
// virtio-net.

/// A network namespace holding a persistent tap with the host address 10.77.0.1/24;
/// removed (tap first) on drop.
struct NetNs {
    name: String,
    tap: String,
}

fn ip(args: &[&str]) -> bool {
    Command::new("ip")
        .args(args)
        .status()
        .is_ok_and(|s| s.success())
}

impl NetNs {
    fn new(tag: &str) -> Option<NetNs> {
        let ns = NetNs {
            name: format!("dsec-{tag}-{}", std::process::id()),
            tap: "dsectap0".into(),
        };
        let (n, t) = (ns.name.as_str(), ns.tap.as_str());
        let ok = ip(&["netns", "add", n])
            && ip(&["-n", n, "tuntap", "add", "dev", t, "mode", "tap"])
            && ip(&["-n", n, "addr", "add", "10.77.0.1/24", "dev", t])
            && ip(&["-n", n, "link", "set", t, "up"])
            && ip(&["-n", n, "link", "set", "lo", "up"]);
        ok.then_some(ns)
    }
}

/// Moves the calling thread (and the processes it spawns) into network namespace `name`.
fn enter_netns(name: &str) {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(format!("/var/run/netns/{name}")).unwrap();
    // SAFETY: setns on a namespace fd we own; it only changes this thread's namespace.
    let r = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
    assert_eq!(r, 0, "setns: {}", std::io::Error::last_os_error());
}

impl Drop for NetNs {
    fn drop(&mut self) {
        ip(&["-n", &self.name, "link", "del", &self.tap]);
        ip(&["netns", "del", &self.name]);
    }
}

#[test]
fn net_arp_icmp_and_udp_echo_through_a_tap() {
    let _g = serial_lock();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 || !Path::new("/dev/net/tun").exists() {
        eprintln!("skipped: needs root and /dev/net/tun");
        return;
    }
    let s = Scratch::new("net");
    let ns = NetNs::new("nt").expect("create netns + tap (needs root and iproute2)");
    // The test runs on its own thread: entering the namespace affects this thread and the
    // VMM it spawns only; the thread ends with the test.
    let (n, t) = (ns.name.clone(), ns.tap.clone());
    let serial = s.path("serial.log");
    let kernel = guest("net").display().to_string();
    let worker = thread::spawn(move || {
        enter_netns(&n);
        let net = format!("tap={t},mac=06:00:0a:4d:00:02");
        let a = args(&[
            "--kernel",
            &kernel,
            "--net",
            &net,
            "--cmdline",
            "udp_echo=4",
        ]);
        let mut vmm = Vmm::spawn(&a, &serial);
        vmm.wait_for_serial("READY", Duration::from_secs(60));
        let sock = std::net::UdpSocket::bind("10.77.0.1:0").unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let t0 = Instant::now();
        let mut echoed = 0;
        for i in 0..4u8 {
            let msg = vec![i; 100 + usize::from(i) * 300];
            sock.send_to(&msg, "10.77.0.2:7777").unwrap();
            let mut buf = [0u8; 2048];
            let (len, from) = sock.recv_from(&mut buf).expect("UDP echo from the guest");
            assert_eq!(from.to_string(), "10.77.0.2:7777");
            assert_eq!(&buf[..len], &msg[..]);
            echoed += 1;
        }
        (vmm.wait(Duration::from_secs(60)), echoed, t0.elapsed())
    });
    let (run, echoed, rtt) = worker.join().expect("net test thread");
    let oks = run.assert_passed();
    for must in ["net-arp", "net-icmp-echo", "net-udp-echo"] {
        assert!(oks.iter().any(|o| o == must), "{must}\n{}", run.describe());
    }
    assert!(
        run.serial.contains("mac: 06:00:0a:4d:00:02"),
        "{}",
        run.describe()
    );
    eprintln!(
        "net: {echoed} UDP echoes in {rtt:?}; {:?} total",
        run.elapsed
    );
    drop(ns);
}

// ---------------------------------------------------------------------------------------------
// vsock.

/// Connects from the host side: `CONNECT <port>\n`, expects `OK <host port>\n`.
fn vsock_connect(uds: &Path, port: u32) -> UnixStream {
    let mut s = UnixStream::connect(uds).expect("connect to the vsock socket");
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s.write_all(format!("CONNECT {port}\n").as_bytes()).unwrap();
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    while b[0] != b'\n' {
        s.read_exact(&mut b).expect("read the CONNECT reply");
        line.push(b[0]);
    }
    let line = String::from_utf8_lossy(&line);
    let port: Option<u32> = line.strip_prefix("OK ").and_then(|p| p.trim().parse().ok());
    assert!(port.is_some(), "CONNECT reply {line:?}");
    s
}

/// Port 5000: `len` bytes of pattern 1 to the guest, then its verdict and its own stream.
/// The data is generated and checked outside the timed sections (this is a debug build).
struct Bulk {
    h2g_secs: f64,
    g2h_secs: f64,
    g2h_bytes: u64,
    errors: Vec<String>,
}

fn vsock_bulk(uds: &Path, len: u64) -> Bulk {
    let data = pattern_bytes(1, len as usize);
    let want_hash = data.chunks_exact(8).fold(HASH_INIT, |h, c| {
        hash_word(h, u64::from_le_bytes(c.try_into().unwrap()))
    });
    let s = vsock_connect(uds, 5000);
    let mut w = s.try_clone().unwrap();
    let t0 = Instant::now();
    let writer = thread::spawn(move || {
        w.write_all(&len.to_le_bytes())?;
        w.write_all(&data)
    });
    let mut r = s;
    let mut errors = Vec::new();
    let mut verdict = [0u8; 24];
    if let Err(e) = r.read_exact(&mut verdict) {
        errors.push(format!("reading the guest's verdict: {e}"));
    }
    let h2g_secs = t0.elapsed().as_secs_f64();
    if let Err(e) = writer.join().expect("bulk writer") {
        errors.push(format!("sending to the guest: {e}"));
    }
    let word = |i: usize| u64::from_le_bytes(verdict[i * 8..i * 8 + 8].try_into().unwrap());
    if word(1) != 0 {
        errors.push(format!("guest saw {} mismatched words", word(1)));
    }
    if word(0) != want_hash {
        errors.push(format!("guest hash {:#x}, host {want_hash:#x}", word(0)));
    }
    let out_len = word(2);
    let mut back = vec![0u8; out_len.min(1 << 30) as usize];
    let t1 = Instant::now();
    if let Err(e) = r.read_exact(&mut back) {
        errors.push(format!("reading the guest's {out_len}-byte stream: {e}"));
    }
    let g2h_secs = t1.elapsed().as_secs_f64();
    if back != pattern_bytes(2, back.len()) {
        errors.push("the guest's stream differs from pattern 2".into());
    }
    // Closing tells the guest (SHUTDOWN) that the exchange is over.
    drop(r);
    Bulk {
        h2g_secs,
        g2h_secs,
        g2h_bytes: out_len,
        errors,
    }
}

/// Port 5001 echo: sends `len` bytes of pattern `seed` and checks they come back.
fn vsock_echo(uds: &Path, seed: u64, len: usize) -> Result<(), String> {
    let s = vsock_connect(uds, 5001);
    let mut w = s.try_clone().unwrap();
    let data = pattern_bytes(seed, len);
    let sent = data.clone();
    let writer = thread::spawn(move || w.write_all(&sent));
    let mut back = vec![0u8; len];
    let mut r = s;
    r.read_exact(&mut back)
        .map_err(|e| format!("stream {seed}: read: {e}"))?;
    writer
        .join()
        .map_err(|_| "writer panicked".to_string())?
        .map_err(|e| format!("stream {seed}: write: {e}"))?;
    if back != data {
        let at = back.iter().zip(&data).position(|(a, b)| a != b);
        return Err(format!("stream {seed}: echo differs at {at:?}"));
    }
    Ok(())
}

/// Listens on `<uds>_6000` for the guest's own connection and answers its greeting.
fn guest_port_listener(uds: &Path) -> mpsc::Receiver<Result<String, String>> {
    let mut path = uds.as_os_str().to_owned();
    path.push("_6000");
    let listener = UnixListener::bind(PathBuf::from(path)).expect("bind <uds>_6000");
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let result = (|| {
            let (s, _) = listener.accept().map_err(|e| e.to_string())?;
            s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
            let mut r = BufReader::new(s.try_clone().map_err(|e| e.to_string())?);
            let mut line = String::new();
            r.read_line(&mut line).map_err(|e| e.to_string())?;
            (&s).write_all(b"hello from host\n")
                .map_err(|e| e.to_string())?;
            // Wait for the guest to close its end.
            let mut rest = Vec::new();
            let _ = r.read_to_end(&mut rest);
            Ok(line)
        })();
        let _ = tx.send(result);
    });
    rx
}

fn vsock_scenario(bulk_mib: u64, streams: usize, stream_len: usize, layout: u32) {
    let _g = serial_lock();
    let s = Scratch::new("vsock");
    let uds = s.path("v.sock");
    let greeting = guest_port_listener(&uds);
    let cmdline = format!(
        "expect_cid={GUEST_CID} streams={streams} bulk={} bulk_out={bulk_mib}M layout={layout}",
        u8::from(bulk_mib > 0)
    );
    let a = vec![
        "--kernel".to_string(),
        guest("vsock").display().to_string(),
        "--mem-mib".into(),
        "256".into(),
        "--vsock-uds".into(),
        uds.display().to_string(),
        "--vsock-cid".into(),
        GUEST_CID.to_string(),
        "--cmdline".into(),
        cmdline,
    ];
    let mut vmm = Vmm::spawn(&a, &s.path("serial.log"));
    vmm.wait_for_serial("READY\n", Duration::from_secs(30));
    let t_ready = vmm.started.elapsed();

    // A port the guest does not listen on: the guest answers RST, the host sees EOF, no OK.
    let refused = {
        let mut s = UnixStream::connect(&uds).expect("connect to the vsock socket");
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        s.write_all(b"CONNECT 5999\n").unwrap();
        let mut reply = Vec::new();
        let r = s.read_to_end(&mut reply);
        (
            r.map_err(|e| e.to_string()),
            String::from_utf8_lossy(&reply).into_owned(),
        )
    };

    let bulk = (bulk_mib > 0).then(|| vsock_bulk(&uds, bulk_mib << 20));

    let t_echo = Instant::now();
    let workers: Vec<_> = (0..streams)
        .map(|i| {
            let uds = uds.clone();
            thread::spawn(move || vsock_echo(&uds, 100 + i as u64, stream_len))
        })
        .collect();
    let errors: Vec<String> = workers
        .into_iter()
        .filter_map(|h| {
            h.join()
                .unwrap_or_else(|_| Err("echo thread panicked".into()))
                .err()
        })
        .collect();
    let t_echo = t_echo.elapsed();

    let run = vmm.wait(Duration::from_secs(240));
    eprintln!(
        "vsock (layout {layout}): READY after {t_ready:?}, total {:?}",
        run.elapsed
    );
    if let Some(b) = &bulk {
        let mb = (bulk_mib << 20) as f64 / 1e6;
        let g2h = b.g2h_bytes as f64 / 1e6;
        eprintln!(
            "  bulk host->guest {mb:.0} MB in {:.2} s ({:.1} MB/s); guest->host {g2h:.0} MB in {:.2} s ({:.1} MB/s)",
            b.h2g_secs,
            mb / b.h2g_secs,
            b.g2h_secs,
            g2h / b.g2h_secs
        );
    }
    eprintln!(
        "  {streams} echo streams x {stream_len} bytes in {t_echo:?}; guest {}",
        run.serial
            .lines()
            .find(|l| l.starts_with("stats:"))
            .unwrap_or_default()
    );
    if let Some(b) = &bulk {
        assert!(
            b.errors.is_empty(),
            "bulk transfer: {:#?}\n{}",
            b.errors,
            run.describe()
        );
    }
    assert!(
        errors.is_empty(),
        "echo streams failed: {errors:#?}\n{}",
        run.describe()
    );
    assert!(
        matches!(&refused, (Ok(_), reply) if reply.is_empty()),
        "CONNECT to a port nobody listens on: {refused:?}"
    );
    let oks = run.assert_passed();
    let hello = greeting
        .recv_timeout(Duration::from_secs(5))
        .expect("the guest never connected to port 6000")
        .expect("guest-initiated connection");
    assert_eq!(hello, format!("hello from guest {GUEST_CID}\n"));
    for must in [
        "vsock-probe",
        "vsock-cid",
        "vsock-guest-exchange",
        "vsock-connect-refused",
        "vsock-bulk-rx",
        "vsock-echo-streams",
    ] {
        if must == "vsock-bulk-rx" && bulk.is_none() || must == "vsock-echo-streams" && streams == 0
        {
            continue;
        }
        assert!(
            oks.iter().any(|o| o == must),
            "check {must} did not run\n{}",
            run.describe()
        );
    }
}

#[test]
fn vsock_both_directions_100mb_and_16_streams() {
    vsock_scenario(100, 16, 1 << 20, 2);
}

#[test]
fn vsock_single_descriptor_layout() {
    vsock_scenario(8, 4, 256 << 10, 1);
}

// ---------------------------------------------------------------------------------------------
// virtio-pmem.

const PMEM_GO_FLUSH: u64 = 0x600d_f105_0000_0001;
const PMEM_GO_FINISH: u64 = 0x600d_f105_0000_0002;

/// A scratch directory on the target's file system, not /tmp: flush tests need a file system
/// with real writeback (tmpfs pages are always dirty).
fn disk_scratch(name: &str) -> Scratch {
    static N: AtomicU32 = AtomicU32::new(0);
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "dsec-tg-{}-{name}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create scratch dir");
    Scratch(dir)
}

/// Dirty KiB (shared + private) of `pid`'s mappings of `file`, from /proc/PID/smaps.
fn smaps_dirty_kib(pid: u32, file: &Path) -> u64 {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap();
    let name = file.display().to_string();
    let mut inside = false;
    let mut kib = 0;
    for line in smaps.lines() {
        let mut words = line.split_whitespace();
        let first = words.next().unwrap_or("");
        if first.contains('-') && !first.ends_with(':') {
            inside = line.ends_with(&name);
        } else if inside && (first == "Shared_Dirty:" || first == "Private_Dirty:") {
            kib += words
                .next()
                .and_then(|n| n.parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    kib
}

fn pwrite_u64(file: &Path, offset: u64, v: u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(file).unwrap();
    f.write_all_at(&v.to_le_bytes(), offset).unwrap();
}

/// One request on a control socket that must succeed.
fn api_ok(sock: &Path, request: &str) {
    let reply = api(sock, request);
    assert_eq!(reply["ok"], true, "{request} -> {reply}");
}

#[test]
fn pmem_read_only_window_reads_the_file_and_drops_guest_writes() {
    let _g = serial_lock();
    let s = Scratch::new("pmemro");
    let img = s.path("ro.img");
    let content = pattern_bytes(5, 4 << 20);
    std::fs::write(&img, &content).unwrap();
    let pmem = format!("{},ro", img.display());
    let run = run_guest(
        &s,
        &guest("pmem"),
        &["--pmem", &pmem, "--cmdline", "seed=5 size=4194304 mode=ro"],
        Duration::from_secs(120),
    );
    let oks = run.assert_passed();
    for must in [
        "pmem-config",
        "pmem-read-pattern",
        "pmem-ro-write-dropped",
        "pmem-flush-ro",
        "pmem-unknown-type",
        "pmem-no-status-buffer",
    ] {
        assert!(oks.iter().any(|o| o == must), "{must}\n{}", run.describe());
    }
    assert!(
        std::fs::read(&img).unwrap() == content,
        "read-only file changed"
    );
}

#[test]
fn pmem_flush_writes_back_what_the_guest_stored() {
    let _g = serial_lock();
    let s = disk_scratch("pmemrw");
    let img = s.path("rw.img");
    std::fs::write(&img, pattern_bytes(6, 2 << 20)).unwrap();
    let pmem = img.display().to_string();
    let a = args(&[
        "--kernel",
        &guest("pmem").display().to_string(),
        "--pmem",
        &pmem,
        "--cmdline",
        "seed=6 size=2097152 mode=rw",
    ]);
    let mut vmm = Vmm::spawn(&a, &s.path("serial.log"));
    vmm.wait_for_serial("pmem-written", Duration::from_secs(60));
    // The guest's 64 KiB of stores are dirty page-cache pages of the shared mapping.
    let dirty_before = smaps_dirty_kib(vmm.child.id(), &img);
    pwrite_u64(&img, 0x1000, PMEM_GO_FLUSH);
    vmm.wait_for_serial("pmem-flushed", Duration::from_secs(60));
    // The flush request wrote them back (fdatasync): nothing of the file is dirty any more.
    let dirty_after = smaps_dirty_kib(vmm.child.id(), &img);
    pwrite_u64(&img, 0x1000, PMEM_GO_FINISH);
    let run = vmm.wait(Duration::from_secs(60));
    let oks = run.assert_passed();
    assert!(oks.iter().any(|o| o == "pmem-flush"), "{}", run.describe());
    assert!(
        dirty_before >= 64,
        "only {dirty_before} KiB dirty after the guest's stores"
    );
    assert_eq!(
        dirty_after, 0,
        "still dirty after the flush ({dirty_before} KiB before)"
    );
    let file = std::fs::read(&img).unwrap();
    assert_eq!(
        &file[1 << 20..(1 << 20) + 65536],
        &pattern_bytes(7, 65536)[..]
    );
    assert_eq!(&file[..0x1000], &pattern_bytes(6, 0x1000)[..]);
    eprintln!("pmem: {dirty_before} KiB dirty before the flush, {dirty_after} after");
}

#[test]
fn pmem_snapshot_restore_remaps_the_file_and_refuses_a_changed_one() {
    let _g = serial_lock();
    let s = disk_scratch("pmemsnap");
    let img = s.path("rw.img");
    std::fs::write(&img, pattern_bytes(8, 2 << 20)).unwrap();
    let sock = s.path("api.sock");
    let a = args(&[
        "--kernel",
        &guest("pmem").display().to_string(),
        "--pmem",
        &img.display().to_string(),
        "--api-sock",
        &sock.display().to_string(),
        "--cmdline",
        "seed=8 size=2097152 mode=rw",
    ]);
    let mut vmm = Vmm::spawn(&a, &s.path("serial.log"));
    vmm.wait_for_serial("pmem-written", Duration::from_secs(60));
    let snap = s.path("snap");
    api_ok(
        &sock,
        &format!(r#"{{"op":"snapshot","path":"{}"}}"#, snap.display()),
    );
    api_ok(&sock, r#"{"op":"stop"}"#);
    let first = vmm.wait(Duration::from_secs(30));
    assert_eq!(first.status.code(), Some(0), "{}", first.describe());

    let restore = |serial: &str| {
        let sock2 = s.path(&format!("{serial}.sock"));
        let vmm = Vmm::spawn(
            &args(&[
                "--restore",
                &snap.display().to_string(),
                "--api-sock",
                &sock2.display().to_string(),
            ]),
            &s.path(serial),
        );
        (vmm, sock2)
    };
    // A same-size file renamed over the image (a rebuilt image) is refused.
    let keep = s.path("keep.img");
    std::fs::hard_link(&img, &keep).unwrap();
    let other = s.path("other.img");
    std::fs::write(&other, pattern_bytes(8, 2 << 20)).unwrap();
    std::fs::rename(&other, &img).unwrap();
    let (vmm, _) = restore("bad.log");
    let bad = vmm.wait(Duration::from_secs(30));
    assert_eq!(bad.status.code(), Some(1), "{}", bad.describe());
    assert!(
        bad.stderr.contains("changed since the snapshot") && bad.stderr.contains("rw.img"),
        "{}",
        bad.stderr
    );
    // The original file back: the restored guest sees it at the same window, its flush works.
    std::fs::rename(&keep, &img).unwrap();
    let (mut vmm, sock2) = restore("restored.log");
    wait_for_path(&sock2);
    api_ok(&sock2, r#"{"op":"resume"}"#);
    pwrite_u64(&img, 0x1000, PMEM_GO_FLUSH);
    vmm.wait_for_serial("pmem-flushed", Duration::from_secs(60));
    pwrite_u64(&img, 0x1000, PMEM_GO_FINISH);
    let run = vmm.wait(Duration::from_secs(60));
    assert_eq!(run.status.code(), Some(0), "{}", run.describe());
    let (oks, fails, done) = parse_results(&run.serial);
    assert!(fails.is_empty(), "{}", run.describe());
    assert!(
        oks.iter().any(|o| o == "pmem-flush") && oks.iter().any(|o| o == "pmem-host-checked"),
        "{}",
        run.describe()
    );
    assert!(matches!(done, Some((_, 0))), "{}", run.describe());
    let file = std::fs::read(&img).unwrap();
    assert_eq!(
        &file[1 << 20..(1 << 20) + 65536],
        &pattern_bytes(9, 65536)[..]
    );
}

#[test]
fn pmem_bad_files_are_refused_with_the_reason() {
    let _g = serial_lock();
    let s = Scratch::new("pmembad");
    let kernel = guest("serial").display().to_string();
    let err = |pmem: &str| vmm_error(&["--kernel", &kernel, "--pmem", pmem]);
    let missing = s.path("missing.img").display().to_string();
    let e = err(&format!("{missing},ro"));
    assert!(e.contains("`pmem`") && e.contains("missing.img"), "{e}");
    let empty = s.path("empty.img");
    std::fs::write(&empty, b"").unwrap();
    let e = err(&format!("{},ro", empty.display()));
    assert!(e.contains("is empty"), "{e}");
    let odd = s.path("odd.img");
    std::fs::write(&odd, vec![0u8; (2 << 20) + 512]).unwrap();
    let e = err(&odd.display().to_string());
    assert!(
        e.contains("not a multiple of 2 MiB") && e.contains("truncate -s 4194304"),
        "{e}"
    );
    let e = err(&format!("{},dax", odd.display()));
    assert!(e.contains("unknown pmem option"), "{e}");
    // One writable file twice: the second mapping finds the lock.
    let img = s.path("a.img");
    std::fs::write(&img, vec![0u8; 2 << 20]).unwrap();
    let a = img.display().to_string();
    let e = vmm_error(&["--kernel", &kernel, "--pmem", &a, "--pmem", &a]);
    assert!(e.contains("in use by another VM"), "{e}");
}

// ---------------------------------------------------------------------------------------------
// Bad input: each is refused with a message naming the problem.

fn vmm_error(a: &[&str]) -> String {
    let out = Command::new(VMM).args(a).output().expect("run dsec-vmm");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success(),
        "dsec-vmm {a:?} succeeded; stderr: {stderr}"
    );
    assert_ne!(out.status.code(), Some(0));
    stderr
}

#[test]
fn bad_input_missing_kernel() {
    let _g = serial_lock();
    let e = vmm_error(&["--kernel", "/nonexistent/dsec/vmlinux"]);
    assert!(
        e.contains("kernel") && e.contains("/nonexistent/dsec/vmlinux"),
        "{e}"
    );
}

#[test]
fn bad_input_kernel_is_random_bytes() {
    let _g = serial_lock();
    let s = Scratch::new("badkernel");
    let p = s.path("random.bin");
    let mut bytes = vec![0u8; 256 * 1024];
    let mut x = 0x1234_5678_9abc_def0u64;
    for b in bytes.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    std::fs::write(&p, bytes).unwrap();
    let e = vmm_error(&["--kernel", p.to_str().unwrap()]);
    assert!(
        e.contains("not a kernel") && e.contains("random.bin"),
        "{e}"
    );
}

#[test]
fn bad_input_more_memory_than_host() {
    let _g = serial_lock();
    let k = guest("serial");
    let e = vmm_error(&["--kernel", k.to_str().unwrap(), "--mem-mib", "100000000"]);
    assert!(e.contains("mem") && e.contains("100000000"), "{e}");
}

#[test]
fn bad_input_zero_vcpus() {
    let _g = serial_lock();
    let k = guest("serial");
    let e = vmm_error(&["--kernel", k.to_str().unwrap(), "--vcpus", "0"]);
    assert!(e.contains("vcpus"), "{e}");
}

// ---------------------------------------------------------------------------------------------
// Repeated create/destroy leaks nothing.

fn count_dir(p: &str) -> usize {
    std::fs::read_dir(p).map(|d| d.count()).unwrap_or(0)
}

/// dsec-vmm processes (including zombies) whose parent is this test process.
fn vmm_children() -> Vec<String> {
    let me = std::process::id().to_string();
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        // pid (comm) state ppid ...
        let Some(close) = stat.rfind(')') else {
            continue;
        };
        let comm = &stat[stat.find('(').map_or(0, |i| i + 1)..close];
        let mut rest = stat[close + 1..].split_whitespace();
        let state = rest.next().unwrap_or("");
        let ppid = rest.next().unwrap_or("");
        if ppid == me && comm.starts_with("dsec-vmm") {
            found.push(format!(
                "{} {comm} {state}",
                e.file_name().to_string_lossy()
            ));
        }
    }
    found
}

#[test]
fn repeated_create_destroy_leaks_nothing() {
    let _g = serial_lock();
    let kernel = guest("serial");
    let s = Scratch::new("repeat");
    let uds = s.path("v.sock");
    let run_once = |i: usize| {
        let log = s.path(&format!("serial-{i}.log"));
        let a = args(&[
            "--kernel",
            kernel.to_str().unwrap(),
            "--vsock-uds",
            uds.to_str().unwrap(),
        ]);
        let run = Vmm::spawn(&a, &log).wait(Duration::from_secs(30));
        assert_eq!(run.status.code(), Some(0), "run {i}: {}", run.describe());
        assert!(
            run.serial.ends_with("DONE 0 0\n"),
            "run {i}: {}",
            run.describe()
        );
        std::fs::remove_file(&log).unwrap();
    };
    // Warm up lazily created state (guest build, std's internals) before counting.
    run_once(0);
    let fds = count_dir("/proc/self/fd");
    let tasks = count_dir("/proc/self/task");
    let t0 = Instant::now();
    const RUNS: usize = 20;
    for i in 1..=RUNS {
        run_once(i);
    }
    let per_run = t0.elapsed() / RUNS as u32;
    assert_eq!(
        count_dir("/proc/self/fd"),
        fds,
        "fds leaked across {RUNS} VMs"
    );
    // Output-collecting threads are joined; allow a moment for them to be reaped.
    let t = Instant::now();
    while count_dir("/proc/self/task") > tasks && t.elapsed() < Duration::from_secs(2) {
        thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        count_dir("/proc/self/task"),
        tasks,
        "threads leaked across {RUNS} VMs"
    );
    let children = vmm_children();
    assert!(children.is_empty(), "dsec-vmm processes left: {children:?}");
    let left: Vec<_> = std::fs::read_dir(&s.0)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert!(left.is_empty(), "files left behind by the VMM: {left:?}");
    eprintln!("create/destroy: {per_run:?} per VM (serial guest, vsock device attached)");
}
