//! Shared by the VMM's integration tests: tiny guests assembled here (they boot through PVH:
//! 32-bit, paging off, so they reach device config space at 0xd000_0000 + slot * 0x1000
//! directly), a scratch directory and a `dsec-vmm` process driven over its control socket.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const VMM: &str = env!("CARGO_BIN_EXE_dsec-vmm");
pub const COUNTER_ADDR: u64 = 0x30_0000;
pub const CID_COPY_ADDR: u64 = 0x30_0008;

/// Where the net guest copies its MAC (the 6 bytes of the net device's config space).
pub const MAC_COPY_ADDR: u64 = 0x30_0010;
/// The net device's config space when vsock (slot 0) and net are the only devices.
pub const NET_CONFIG_ADDR: u32 = 0xd000_1100;

/// 32-bit guest: forever { eax = vsock config guest_cid; [0x300008] = eax; [0x300000] += 1 }.
pub fn counter_guest_code() -> Vec<u8> {
    looping(&[copy_dword(0xd000_0100, CID_COPY_ADDR as u32)])
}

/// The counter guest that also copies its MAC from the net device's config space.
pub fn counter_with_mac_guest_code() -> Vec<u8> {
    looping(&[
        copy_dword(0xd000_0100, CID_COPY_ADDR as u32),
        copy_dword(NET_CONFIG_ADDR, MAC_COPY_ADDR as u32),
        copy_dword(NET_CONFIG_ADDR + 4, MAC_COPY_ADDR as u32 + 4),
    ])
}

/// Where the sweeping guest's pages start (each page's first dword holds its sweep number).
pub const SWEEP_BASE: u32 = 0x40_0000;

/// 32-bit guest: forever { eax = [counter] + 1; for each of `pages` pages from SWEEP_BASE:
/// [page] = eax; [counter] = eax }. At any instant the pages hold counter + 1 up to where the
/// sweep is and counter after it: a snapshot mixing two instants breaks that.
pub fn sweeping_guest_code(pages: u32) -> Vec<u8> {
    let end = SWEEP_BASE + pages * 0x1000;
    let mut code = vec![0xa1]; // mov eax, [counter]
    code.extend_from_slice(&(COUNTER_ADDR as u32).to_le_bytes());
    code.push(0x40); // inc eax
    code.push(0xbb); // mov ebx, SWEEP_BASE
    code.extend_from_slice(&SWEEP_BASE.to_le_bytes());
    code.extend_from_slice(&[0x89, 0x03]); // sweep: mov [ebx], eax
    code.extend_from_slice(&[0x81, 0xc3, 0x00, 0x10, 0x00, 0x00]); // add ebx, 0x1000
    code.extend_from_slice(&[0x81, 0xfb]); // cmp ebx, end
    code.extend_from_slice(&end.to_le_bytes());
    code.extend_from_slice(&[0x72, 0xf0]); // jb sweep
    code.push(0xa3); // mov [counter], eax
    code.extend_from_slice(&(COUNTER_ADDR as u32).to_le_bytes());
    let back = i8::try_from(-(code.len() as i64 + 2)).expect("fits a short jump");
    code.extend_from_slice(&[0xeb, back as u8]); // jmp start
    code
}

/// Checks a sweeping guest's memory file: returns its counter, or what is inconsistent.
pub fn sweep_consistency(memory: &Path, pages: u32) -> Result<u64, String> {
    let bytes = std::fs::read(memory).unwrap();
    let dword = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
    let counter = dword(COUNTER_ADDR as usize);
    let mut ahead = true;
    for i in 0..pages as usize {
        let v = dword(SWEEP_BASE as usize + i * 0x1000);
        if ahead && v == counter.wrapping_add(1) {
            continue;
        }
        ahead = false;
        if v != counter {
            return Err(format!(
                "page {i} holds sweep {v}, the counter is {counter}: memory from two instants"
            ));
        }
    }
    Ok(counter.into())
}

/// vCPU 0's `(eax, ebx)` as saved in a snapshot's `state` (a 24-byte header, then JSON
/// whose `regs` is a hex string of `kvm_regs`' raw bytes: rax, rbx, ...).
pub fn saved_eax_ebx(snap: &Path) -> (u32, u32) {
    let bytes = std::fs::read(snap.join("state")).unwrap();
    let state: serde_json::Value = serde_json::from_slice(&bytes[24..]).unwrap();
    let hex = state["vcpus"][0]["regs"]
        .as_str()
        .expect("regs as a hex string");
    let regs: Vec<u8> = (0..hex.len() / 2)
        .map(|i| u8::from_str_radix(&hex[i * 2..i * 2 + 2], 16).unwrap())
        .collect();
    let reg = |i: usize| u32::from_le_bytes(regs[i * 8..i * 8 + 4].try_into().unwrap());
    (reg(0), reg(1))
}

/// Checks a sweeping guest's snapshot against its own vCPU: the memory must be that of the
/// instant its registers were read, exactly. With eax = counter + 1 the guest is sweeping
/// and the pages below ebx hold eax (ebx's own page too if it was just written); with eax =
/// counter no page is ahead. Returns the counter.
pub fn sweep_matches_registers(snap: &Path, pages: u32) -> Result<u64, String> {
    let counter = sweep_consistency(&snap.join("memory"), pages)?;
    let bytes = std::fs::read(snap.join("memory")).unwrap();
    let dword = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
    let ahead = (0..pages as usize)
        .take_while(|&i| dword(SWEEP_BASE as usize + i * 0x1000) != counter as u32)
        .count() as u32;
    let (eax, ebx) = saved_eax_ebx(snap);
    let end = SWEEP_BASE + pages * 0x1000;
    let at = |ebx: u32| (ebx.clamp(SWEEP_BASE, end) - SWEEP_BASE) / 0x1000;
    let ok = if eax == counter as u32 {
        ahead == 0
    } else if eax == counter as u32 + 1 {
        // Right after `inc eax`, ebx still holds the previous sweep's end.
        ahead == at(ebx) || ahead == at(ebx) + 1 || (ahead == 0 && ebx == end)
    } else {
        false
    };
    if ok {
        Ok(counter)
    } else {
        Err(format!(
            "memory holds counter {counter} with {ahead} pages ahead, the vCPU had eax {eax} \
             ebx {ebx:#x}: the memory is not that of the pause"
        ))
    }
}

/// `mov eax, [from]; mov [to], eax`.
pub fn copy_dword(from: u32, to: u32) -> Vec<u8> {
    let mut code = vec![0xa1];
    code.extend_from_slice(&from.to_le_bytes());
    code.push(0xa3);
    code.extend_from_slice(&to.to_le_bytes());
    code
}

/// `body; inc dword [counter]; jmp <start>`.
pub fn looping(body: &[Vec<u8>]) -> Vec<u8> {
    let mut code: Vec<u8> = body.concat();
    code.extend_from_slice(&[0xff, 0x05]);
    code.extend_from_slice(&(COUNTER_ADDR as u32).to_le_bytes()); // inc dword [counter]
    let back = i8::try_from(-(code.len() as i64 + 2)).expect("loop body fits a short jump");
    code.extend_from_slice(&[0xeb, back as u8]);
    code
}

/// A minimal ELF64 with one PT_LOAD at 2 MiB and a PVH entry note pointing at it.
pub fn pvh_elf(code: &[u8]) -> Vec<u8> {
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

pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("dsec-snap-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A dsec-vmm child that is killed if the test fails.
pub struct Vmm {
    pub child: Child,
    pub api: PathBuf,
}

impl Vmm {
    pub fn spawn(args: &[&str], api: &Path) -> Vmm {
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

    pub fn request(&mut self, req: serde_json::Value) -> serde_json::Value {
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
    pub fn post_mortem(&mut self) -> String {
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

    pub fn ok(&mut self, req: serde_json::Value) -> serde_json::Value {
        let r = self.request(req.clone());
        assert_eq!(r["ok"], true, "{req} -> {r}");
        r
    }

    pub fn stop(mut self) {
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

pub fn read_u64(file: &Path, offset: u64) -> u64 {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open(file).unwrap();
    f.seek(SeekFrom::Start(offset)).unwrap();
    let mut b = [0u8; 8];
    f.read_exact(&mut b).unwrap();
    u64::from_le_bytes(b)
}

pub fn counter(snapshot: &Path) -> u64 {
    read_u64(&snapshot.join("memory"), COUNTER_ADDR) & 0xffff_ffff
}

pub fn boot_counter(s: &Scratch) -> Vmm {
    boot_guest(s, &counter_guest_code(), &[])
}

/// A full snapshot of the counter guest `vm` into `name`, taken again until the guest has
/// started counting.
pub fn snapshot_once_counting(vm: &mut Vmm, s: &Scratch, name: &str) -> PathBuf {
    let snap = s.path(name);
    wait_until("the guest to start counting", || {
        let _ = std::fs::remove_dir_all(&snap);
        vm.ok(serde_json::json!({"op": "snapshot", "path": snap}));
        counter(&snap) > 0
    });
    snap
}

pub fn boot_guest(s: &Scratch, code: &[u8], extra: &[&str]) -> Vmm {
    boot_guest_with_memory(s, code, 32, extra)
}

pub fn boot_guest_with_memory(s: &Scratch, code: &[u8], mem_mib: u32, extra: &[&str]) -> Vmm {
    let mem_mib = mem_mib.to_string();
    let kernel = s.path("counter.elf");
    std::fs::write(&kernel, pvh_elf(code)).unwrap();
    let uds = s.path("vsock.sock");
    let mut args = vec![
        "--kernel",
        kernel.to_str().unwrap(),
        "--mem-mib",
        &mem_mib,
        "--vsock-uds",
        uds.to_str().unwrap(),
        "--vsock-cid",
        "7",
    ];
    args.extend_from_slice(extra);
    Vmm::spawn(&args, &s.path("api.sock"))
}

pub fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    // Generous: under a loaded CI machine emulated guest code crawls, and every probe
    // here is a snapshot that pauses the guest.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(250));
    }
}
