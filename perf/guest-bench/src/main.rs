//! `dsec-guest-bench`: the guest side of `dsec-perf devices`. Built static and put into the
//! benchmark initramfs, so both VMMs run the very same measurement code; also runs in the
//! rig's L1 as the TCP peer. Timing is the caller's CLOCK_MONOTONIC. Prints one
//! `key=value ...` line per measurement.
//!
//!   blk-seq DEV MIB            O_DIRECT 1 MiB sequential reads of the first MIB MiB
//!   blk-rand DEV COUNT         O_DIRECT 4 KiB reads at COUNT random aligned offsets
//!   tcp-send ADDR:PORT BYTES   send BYTES, half-close, wait for the peer's close
//!   tcp-fetch ADDR:PORT        read until the peer closes
//!   tcp-sink PORT              (peer) accept forever; read each connection to EOF, close
//!   tcp-source PORT BYTES      (peer) accept forever; write BYTES to each connection, close

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::fs::File;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::process::ExitCode;
use std::time::Instant;

const ALIGN: usize = 4096;

/// A zeroed buffer aligned for O_DIRECT.
struct AlignedBuf {
    ptr: *mut u8,
    layout: Layout,
}

impl AlignedBuf {
    fn new(len: usize) -> Self {
        let layout = Layout::from_size_align(len, ALIGN).expect("valid layout");
        // SAFETY: `layout` has a non-zero size (callers pass at least 4 KiB).
        let ptr = unsafe { alloc_zeroed(layout) };
        assert!(!ptr.is_null(), "out of memory");
        Self { ptr, layout }
    }

    fn as_mut(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` points at `layout.size()` initialised bytes owned by `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.layout.size()) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this very layout.
        unsafe { dealloc(self.ptr, self.layout) }
    }
}

fn open_direct(dev: &str) -> Result<File, String> {
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(dev)
        .map_err(|e| format!("open {dev} with O_DIRECT: {e}"))
}

fn mib_per_s(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0) / secs.max(1e-9)
}

fn blk_seq(dev: &str, mib: u64) -> Result<String, String> {
    let file = open_direct(dev)?;
    let mut buf = AlignedBuf::new(1 << 20);
    let start = Instant::now();
    for i in 0..mib {
        let n = file
            .read_at(buf.as_mut(), i << 20)
            .map_err(|e| format!("read {dev} at {} MiB: {e}", i))?;
        if n != 1 << 20 {
            return Err(format!(
                "{dev} is shorter than {mib} MiB (read {n} bytes at {i} MiB)"
            ));
        }
    }
    let secs = start.elapsed().as_secs_f64();
    Ok(format!(
        "blk_seq_mib_s={:.1} blk_seq_secs={secs:.3}",
        mib_per_s(mib << 20, secs)
    ))
}

fn blk_rand(dev: &str, count: u64) -> Result<String, String> {
    let file = open_direct(dev)?;
    let size = file
        .metadata()
        .ok()
        .filter(|m| m.len() > 0)
        .map(|m| m.len())
        .or_else(|| {
            // Block devices report length 0 in metadata: seek to the end instead.
            use std::io::Seek;
            let mut f = &file;
            f.seek(std::io::SeekFrom::End(0)).ok()
        })
        .filter(|&len| len >= ALIGN as u64)
        .ok_or_else(|| format!("cannot tell the size of {dev}"))?;
    let blocks = size / ALIGN as u64;
    let mut buf = AlignedBuf::new(ALIGN);
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    let start = Instant::now();
    for _ in 0..count {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let offset = (state % blocks) * ALIGN as u64;
        file.read_at(buf.as_mut(), offset)
            .map_err(|e| format!("read {dev} at {offset}: {e}"))?;
    }
    let secs = start.elapsed().as_secs_f64();
    Ok(format!(
        "blk_rand_iops={:.0} blk_rand_secs={secs:.3}",
        count as f64 / secs.max(1e-9)
    ))
}

fn tcp_send(addr: &str, bytes: u64) -> Result<String, String> {
    let chunk = vec![0x5au8; 256 * 1024];
    let start = Instant::now();
    let mut stream = TcpStream::connect(addr).map_err(|e| format!("connect {addr}: {e}"))?;
    let mut left = bytes;
    while left > 0 {
        let n = left.min(chunk.len() as u64) as usize;
        stream
            .write_all(&chunk[..n])
            .map_err(|e| format!("send to {addr}: {e}"))?;
        left -= n as u64;
    }
    stream
        .shutdown(Shutdown::Write)
        .map_err(|e| format!("half-close {addr}: {e}"))?;
    // The peer closes once it has read everything: only then has it all arrived.
    let mut rest = Vec::new();
    let _ = stream.read_to_end(&mut rest);
    let secs = start.elapsed().as_secs_f64();
    Ok(format!(
        "tcp_send_mib_s={:.1} tcp_send_secs={secs:.3}",
        mib_per_s(bytes, secs)
    ))
}

fn tcp_fetch(addr: &str) -> Result<String, String> {
    let mut buf = vec![0u8; 256 * 1024];
    let start = Instant::now();
    let mut stream = TcpStream::connect(addr).map_err(|e| format!("connect {addr}: {e}"))?;
    let mut total = 0u64;
    loop {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => total += n as u64,
            Err(e) => return Err(format!("receive from {addr}: {e}")),
        }
    }
    let secs = start.elapsed().as_secs_f64();
    Ok(format!(
        "tcp_fetch_mib_s={:.1} tcp_fetch_bytes={total} tcp_fetch_secs={secs:.3}",
        mib_per_s(total, secs)
    ))
}

fn listen(port: &str) -> Result<TcpListener, String> {
    TcpListener::bind(format!("0.0.0.0:{port}")).map_err(|e| format!("listen on {port}: {e}"))
}

fn tcp_sink(port: &str) -> Result<String, String> {
    let listener = listen(port)?;
    let mut buf = vec![0u8; 256 * 1024];
    for stream in listener.incoming().flatten() {
        let mut stream = stream;
        while matches!(stream.read(&mut buf), Ok(n) if n > 0) {}
        let _ = stream.shutdown(Shutdown::Both);
    }
    Ok(String::new())
}

fn tcp_source(port: &str, bytes: u64) -> Result<String, String> {
    let listener = listen(port)?;
    let chunk = vec![0xa5u8; 256 * 1024];
    for stream in listener.incoming().flatten() {
        let mut stream = stream;
        let mut left = bytes;
        while left > 0 {
            let n = left.min(chunk.len() as u64) as usize;
            if stream.write_all(&chunk[..n]).is_err() {
                break;
            }
            left -= n as u64;
        }
        let _ = stream.shutdown(Shutdown::Both);
    }
    Ok(String::new())
}

fn number(arg: Option<&String>, what: &str) -> Result<u64, String> {
    arg.ok_or_else(|| format!("missing {what}"))?
        .parse()
        .map_err(|e| format!("bad {what}: {e}"))
}

fn run(args: &[String]) -> Result<String, String> {
    let arg = |i: usize, what: &str| {
        args.get(i)
            .map(String::as_str)
            .ok_or_else(|| format!("missing {what}"))
    };
    match args.first().map(String::as_str) {
        Some("blk-seq") => blk_seq(arg(1, "DEV")?, number(args.get(2), "MIB")?),
        Some("blk-rand") => blk_rand(arg(1, "DEV")?, number(args.get(2), "COUNT")?),
        Some("tcp-send") => tcp_send(arg(1, "ADDR:PORT")?, number(args.get(2), "BYTES")?),
        Some("tcp-fetch") => tcp_fetch(arg(1, "ADDR:PORT")?),
        Some("tcp-sink") => tcp_sink(arg(1, "PORT")?),
        Some("tcp-source") => tcp_source(arg(1, "PORT")?, number(args.get(2), "BYTES")?),
        _ => Err("usage: dsec-guest-bench blk-seq DEV MIB | blk-rand DEV COUNT | tcp-send ADDR:PORT BYTES | tcp-fetch ADDR:PORT | tcp-sink PORT | tcp-source PORT BYTES".into()),
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(line) => {
            if !line.is_empty() {
                println!("{line}");
            }
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("dsec-guest-bench: {err}");
            ExitCode::FAILURE
        }
    }
}
