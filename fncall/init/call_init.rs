//! A container worker's call init: pid 1 of one call's fresh pid namespace, forked by the
//! worker's init forker (this program started with `serve`, once per worker, by the zygote:
//! no exec per call, no copy of the interpreter). It makes the call's mount namespace
//! (tmpfs /tmp and /work, its /proc), installs the sandbox seccomp filter, reads the call's
//! request from the engine itself, writes its files, runs the stages (python: the stage the
//! zygote forked into this namespace ahead of the call; others: fork + exec here), enforces
//! the wall time and the output caps, fetches files as the call's uid and answers the engine.
//! Its exit takes every process of the call with it (the pid namespace dies).
//!
//! Built by fncall/build.rs with rustc alone (std only, statically linked: the image's libc
//! is not ours), embedded in the engine, and copied into each worker's /dev.
//!
//! argv: seccomp filters (hex, comma-separated), /tmp and /work size (KiB), their inodes,
//! the call uid, the language. fds: 0 requests (engine), 1 results (engine), 2 log, 3 the
//! zygote's SOCK_SEQPACKET socket; python only: 4 stdout, 5 stderr, 6 order (write ends and
//! read ends of the stage's pipes, as the init sees them), 7 stage failure, 8 stdin memfd.
//!
//! Zygote <-> init messages: "r" + the number of the init's descriptor of its root (mounts
//! ready) or "f" + why; zygote: "s" (stage forked:
//! pid 2 of this namespace) or "n" + why, "g" (the call's turn), "x" + the stage's wait
//! status (i32, big-endian) once the zygote reaped it.

use std::ffi::{c_char, c_int, c_long, c_ulong, c_void, CString};
use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::chown;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

extern "C" {
    fn prctl(option: c_int, arg2: c_ulong, arg3: c_ulong, arg4: c_ulong, arg5: c_ulong) -> c_int;
    fn unshare(flags: c_int) -> c_int;
    fn mount(
        src: *const c_char,
        target: *const c_char,
        fstype: *const c_char,
        flags: c_ulong,
        data: *const c_void,
    ) -> c_int;
    fn syscall(number: c_long, ...) -> c_long;
    fn poll(fds: *mut PollFd, nfds: c_ulong, timeout: c_int) -> c_int;
    fn kill(pid: c_int, sig: c_int) -> c_int;
    fn setrlimit(resource: c_int, limit: *const RLimit) -> c_int;
    fn setgroups(size: usize, list: *const u32) -> c_int;
    fn setresuid(r: u32, e: u32, s: u32) -> c_int;
    fn setresgid(r: u32, e: u32, s: u32) -> c_int;
    fn fcntl(fd: c_int, cmd: c_int, arg: c_int) -> c_int;
    fn memfd_create(name: *const c_char, flags: u32) -> c_int;
    fn recvmsg(fd: c_int, msg: *mut MsgHdr, flags: c_int) -> isize;
    fn send(fd: c_int, buf: *const c_void, len: usize, flags: c_int) -> isize;
    fn setns(fd: c_int, nstype: c_int) -> c_int;
    fn dup2(old: c_int, new: c_int) -> c_int;
}

#[repr(C)]
struct IoVec {
    base: *mut c_void,
    len: usize,
}

#[repr(C)]
struct MsgHdr {
    name: *mut c_void,
    name_len: u32,
    iov: *mut IoVec,
    iov_len: usize,
    control: *mut c_void,
    control_len: usize,
    flags: c_int,
}

#[repr(C)]
struct PollFd {
    fd: c_int,
    events: i16,
    revents: i16,
}

#[repr(C)]
struct RLimit {
    cur: u64,
    max: u64,
}

#[repr(C)]
struct SockFprog {
    len: u16,
    filter: *const u8,
}

const PR_SET_PDEATHSIG: c_int = 1;
const PR_SET_NAME: c_int = 15;
const PR_SET_SECCOMP: c_int = 22;
const PR_SET_NO_NEW_PRIVS: c_int = 38;
const SECCOMP_MODE_FILTER: c_ulong = 2;
const CLONE_NEWNS: c_int = 0x0002_0000;
const CLONE_NEWPID: c_int = 0x2000_0000;
const CLONE_PARENT: c_ulong = 0x0000_8000;
const SYS_CLONE: c_long = 56;
const MSG_CMSG_CLOEXEC: c_int = 0x4000_0000;
const MSG_NOSIGNAL: c_int = 0x4000;
const F_DUPFD_CLOEXEC: c_int = 1030;
/// Descriptors a spawn request hands over: the call's socket to the zygote, then (python)
/// the stage's stdout, stderr, order, failure ends and its stdin memfd.
const MAX_HANDED_FDS: usize = 6;
const MS_NOSUID: c_ulong = 2;
const MS_NODEV: c_ulong = 4;
const MS_NOEXEC: c_ulong = 8;
const SIGKILL: c_int = 9;
const SIGXCPU: c_int = 24;
const SIGCHLD: c_ulong = 17;
const POLLIN: i16 = 1;
const F_SETFD: c_int = 2;
const FD_CLOEXEC: c_int = 1;
// The same numbers on every architecture (the unified syscall table).
const SYS_PIDFD_SEND_SIGNAL: c_long = 424;
const SYS_PIDFD_OPEN: c_long = 434;
const SYS_CLOSE_RANGE: c_long = 436;
const RLIMIT_CPU: c_int = 0;
const RLIMIT_FSIZE: c_int = 1;
const RLIMIT_CORE: c_int = 4;
const RLIMIT_NPROC: c_int = 6;
const RLIMIT_NOFILE: c_int = 7;
/// Exit status when the engine closed the request pipe: the zygote ends too.
const EXIT_NO_MORE_CALLS: i32 = 3;
/// Bound on the request frame (the engine bounds what it sends far below this).
const MAX_REQUEST: usize = 64 << 20;
const ENV: [(&str, &str); 5] = [
    ("PATH", "/usr/local/bin:/usr/bin:/bin"),
    ("HOME", "/work"),
    ("LANG", "C.UTF-8"),
    ("TMPDIR", "/tmp"),
    ("PYTHONDONTWRITEBYTECODE", "1"),
];

type Res<T> = Result<T, String>;

fn os_err(what: &str) -> String {
    format!("{what}: {}", std::io::Error::last_os_error())
}

fn check(ret: c_int, what: &str) -> Res<()> {
    if ret < 0 {
        Err(os_err(what))
    } else {
        Ok(())
    }
}

fn cstr(s: &str) -> CString {
    CString::new(s).expect("no NUL in a constant")
}

fn main() {
    let mut args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("serve") {
        args.remove(1);
        // Returns in each forked call init only, its descriptors in place.
        serve_forks();
    }
    call_init(args)
}

/// The worker's init forker: spawned once per worker by the zygote (fd 3: its socket), it
/// forks each call's init instead of the zygote spawning a fresh one: an exec per call costs
/// the ELF load, its page faults and libc's start (CPUID probes of the cache sizes, which
/// trap to the hypervisor on a VM host), ~0.7 ms of CPU per call. Per request ("c" with the
/// call's descriptors): a fresh pid namespace, a fork whose parent is the zygote
/// (CLONE_PARENT: it reaps the init and learns its status as before), answered with "p" +
/// the init's pid or "e" + why. Returns in the forked init; exits once the zygote is gone.
fn serve_forks() {
    // SAFETY: prctl with integer arguments only.
    unsafe {
        prctl(PR_SET_PDEATHSIG, SIGKILL as c_ulong, 0, 0, 0);
        prctl(PR_SET_NAME, c"fncall-forker".as_ptr() as c_ulong, 0, 0, 0);
        syscall(SYS_CLOSE_RANGE, 4u32, u32::MAX, 0u32);
    }
    // Our own pid namespace, to go back to after each fork (a second unshare fails while
    // the first one's namespace is the children's).
    // SAFETY: pidfd_open of this process, integer arguments.
    let own_ns = unsafe { syscall(SYS_PIDFD_OPEN, std::process::id() as c_int, 0 as c_int) };
    if own_ns < 0 {
        std::process::exit(EXIT_NO_MORE_CALLS);
    }
    loop {
        let Some(fds) = receive_fds(3) else {
            std::process::exit(0);
        };
        // SAFETY: unshare, the raw clone (fork semantics: no CLONE_VM, no new stack; this
        // process has one thread) and setns with integer arguments.
        let pid = unsafe {
            if unshare(CLONE_NEWPID) < 0 {
                -1
            } else {
                let pid = syscall(
                    SYS_CLONE,
                    CLONE_PARENT | SIGCHLD,
                    0usize,
                    0usize,
                    0usize,
                    0usize,
                );
                if pid != 0 {
                    setns(own_ns as c_int, CLONE_NEWPID);
                }
                pid
            }
        };
        if pid == 0 {
            place_handed_fds(&fds);
            // Their numbers now name the placed descriptors (or nothing): not to be closed.
            std::mem::forget(fds);
            return;
        }
        let answer = if pid > 0 {
            format!("p{pid}")
        } else {
            os_err("e fork the call's init")
        };
        drop(fds);
        // SAFETY: send on the zygote's socket, from a buffer alive across the call.
        unsafe { send(3, answer.as_ptr().cast(), answer.len(), MSG_NOSIGNAL) };
    }
}

/// One spawn request's descriptors (SCM_RIGHTS), or None when the zygote is gone or sent
/// something else.
fn receive_fds(socket: c_int) -> Option<Vec<OwnedFd>> {
    let mut tag = [0u8; 16];
    let mut iov = IoVec {
        base: tag.as_mut_ptr().cast(),
        len: tag.len(),
    };
    // cmsghdr (16 bytes) + room for the descriptors, 8-aligned.
    let mut control = [0u64; 2 + MAX_HANDED_FDS.div_ceil(2)];
    let mut msg = MsgHdr {
        name: std::ptr::null_mut(),
        name_len: 0,
        iov: &mut iov,
        iov_len: 1,
        control: control.as_mut_ptr().cast(),
        control_len: std::mem::size_of_val(&control),
        flags: 0,
    };
    // SAFETY: every pointer in `msg` points into buffers alive across the call.
    let n = unsafe { recvmsg(socket, &mut msg, MSG_CMSG_CLOEXEC) };
    let mut fds = Vec::new();
    if msg.control_len >= 16 {
        let header_len = control[0] as usize;
        let level_type = control[1];
        // SOL_SOCKET (1), SCM_RIGHTS (1).
        if level_type == (1 | (1 << 32)) && header_len >= 16 && header_len <= msg.control_len {
            let count = (header_len - 16) / 4;
            // SAFETY: the kernel wrote `count` descriptors after the 16-byte header.
            let data = unsafe {
                std::slice::from_raw_parts(
                    control.as_ptr().cast::<u8>().add(16).cast::<c_int>(),
                    count,
                )
            };
            // SAFETY: descriptors the kernel just installed in this process, owned here.
            fds.extend(data.iter().map(|&fd| unsafe { OwnedFd::from_raw_fd(fd) }));
        }
    }
    if n <= 0 || tag[0] != b'c' || fds.is_empty() || msg.flags & 0x8 != 0 {
        // 0x8: MSG_CTRUNC, descriptors lost.
        return None;
    }
    Some(fds)
}

/// In a forked init: the handed descriptors become fds 3, 4, ... and nothing else of the
/// forker's stays open beyond 0-2.
fn place_handed_fds(fds: &[OwnedFd]) {
    // SAFETY: fcntl, dup2 and close_range on descriptors this process owns; moved above the
    // targets first so no dup2 overwrites a source.
    unsafe {
        let high: Vec<c_int> = fds
            .iter()
            .map(|fd| fcntl(fd.as_raw_fd(), F_DUPFD_CLOEXEC, 64))
            .collect();
        for (i, fd) in high.iter().enumerate() {
            dup2(*fd, 3 + i as c_int);
        }
        syscall(SYS_CLOSE_RANGE, 3 + high.len() as u32, u32::MAX, 0u32);
    }
}

/// A call's init: forked by the forker above (or spawned directly), pid 1 of the call's
/// pid namespace, the handed descriptors at 3 and up.
fn call_init(args: Vec<String>) {
    // SAFETY: prctl with integer arguments only.
    unsafe {
        prctl(PR_SET_PDEATHSIG, SIGKILL as c_ulong, 0, 0, 0);
        prctl(PR_SET_NAME, c"fncall-init".as_ptr() as c_ulong, 0, 0, 0);
    }
    let python = args.get(5).map(String::as_str) == Some("python");
    // Nothing inherited beyond what the header names (the zygote's own descriptors).
    let first_unused = if python { 9 } else { 4 };
    // SAFETY: closes descriptors this process does not use; nothing refers to them.
    unsafe {
        syscall(SYS_CLOSE_RANGE, first_unused as u32, u32::MAX, 0u32);
    }
    // SAFETY: fd 3 is the zygote's socket, handed over by the spawn and owned here alone.
    let mut zygote = unsafe { File::from_raw_fd(3) };
    // SAFETY: fcntl on a descriptor this process owns; the stages must not inherit it.
    unsafe { fcntl(3, F_SETFD, FD_CLOEXEC) };
    let mut setup = setup(&args);
    let message = match &setup {
        // With the descriptor of our root, which the zygote takes (pidfd_getfd) for the
        // python stage: setns alone would give it the namespace's first root, not ours.
        Ok(s) => format!("r{}", s.root.as_raw_fd()).into_bytes(),
        Err(e) => [b"f", e.as_bytes()].concat(),
    };
    if zygote.write_all(&message).is_err() {
        std::process::exit(EXIT_NO_MORE_CALLS);
    }
    if python && setup.is_ok() {
        setup = match receive(&mut zygote) {
            Some(m) if m.first() == Some(&b's') => setup.and_then(|s| s.with_python_stage()),
            Some(m) => Err(format!(
                "the python stage was not made: {}",
                String::from_utf8_lossy(m.get(1..).unwrap_or_default())
            )),
            None => std::process::exit(EXIT_NO_MORE_CALLS),
        };
    }
    // Our turn: the previous call's init is gone.
    if receive(&mut zygote).as_deref() != Some(b"g") {
        std::process::exit(EXIT_NO_MORE_CALLS);
    }
    let Some(body) = read_request() else {
        std::process::exit(EXIT_NO_MORE_CALLS);
    };
    let result = setup
        .and_then(|s| {
            let request = Request::parse(&body)?;
            drop(body);
            s.call(&request, &mut zygote)
        })
        .unwrap_or_else(|e| format!("{{\"error\":{}}}", json_str(&e)));
    let mut frame = Vec::with_capacity(result.len() + 5);
    frame.extend_from_slice(&(result.len() as u32 + 1).to_be_bytes());
    frame.push(b'R');
    frame.extend_from_slice(result.as_bytes());
    // SAFETY: fd 1 is the engine's result pipe, inherited from the zygote.
    let mut out = unsafe { File::from_raw_fd(1) };
    let _ = out.write_all(&frame);
    std::process::exit(0);
}

fn receive(zygote: &mut File) -> Option<Vec<u8>> {
    let mut buf = vec![0u8; 4096];
    match zygote.read(&mut buf) {
        Ok(0) | Err(_) => None,
        Ok(n) => {
            buf.truncate(n);
            Some(buf)
        }
    }
}

/// The next request frame from the engine (fd 0), or None once it closed the pipe.
fn read_request() -> Option<Vec<u8>> {
    // SAFETY: fd 0 is the engine's request pipe; only this process reads it now.
    let mut input = std::mem::ManuallyDrop::new(unsafe { File::from_raw_fd(0) });
    let mut header = [0u8; 4];
    input.read_exact(&mut header).ok()?;
    let size = u32::from_be_bytes(header) as usize;
    if size > MAX_REQUEST {
        return None;
    }
    let mut body = vec![0u8; size];
    input.read_exact(&mut body).ok()?;
    // Not to be inherited by the stages.
    // SAFETY: fcntl on fd 0, which this process holds.
    unsafe { fcntl(0, F_SETFD, FD_CLOEXEC) };
    Some(body)
}

struct Setup {
    uid: u32,
    /// This namespace's root, open until the call: the python stage chroots to it.
    root: File,
    stdin: File,
    python: Option<PythonStage>,
}

/// The python stage the zygote forked into this namespace, waiting for its order.
struct PythonStage {
    stdout: OwnedFd,
    stderr: OwnedFd,
    order: File,
    failure: File,
    pidfd: OwnedFd,
}

fn setup(args: &[String]) -> Res<Setup> {
    if std::process::id() != 1 {
        return Err("the call's init is not pid 1 of its own pid namespace".into());
    }
    let [_, filters, kib, inodes, uid, _language] = args else {
        return Err(format!("{} arguments, 6 expected", args.len()));
    };
    let uid: u32 = uid.parse().map_err(|_| format!("bad uid {uid:?}"))?;
    // SAFETY: plain system calls on NUL-terminated strings that live across them.
    unsafe {
        check(unshare(CLONE_NEWNS), "unshare the mount namespace")?;
        let data = cstr(&format!("size={kib}k,nr_inodes={inodes},mode=1777"));
        for target in [c"/tmp", c"/work"] {
            check(
                mount(
                    c"tmpfs".as_ptr(),
                    target.as_ptr(),
                    c"tmpfs".as_ptr(),
                    MS_NOSUID | MS_NODEV,
                    data.as_ptr().cast(),
                ),
                "mount a tmpfs",
            )?;
        }
        check(
            mount(
                c"proc".as_ptr(),
                c"/proc".as_ptr(),
                c"proc".as_ptr(),
                MS_NOSUID | MS_NODEV | MS_NOEXEC,
                std::ptr::null(),
            ),
            "mount /proc",
        )?;
    }
    let root = File::open("/").map_err(|e| format!("open /: {e}"))?;
    // The zygote is shielded from the OOM killer; the call is its first choice.
    std::fs::write("/proc/self/oom_score_adj", "1000")
        .map_err(|e| format!("oom_score_adj: {e}"))?;
    chown("/work", Some(uid), Some(uid)).map_err(|e| format!("chown /work: {e}"))?;
    // Nothing below mounts or enters a namespace: the init and what it forks are filtered.
    install_filters(filters)?;
    // SAFETY: memfd_create on a constant name.
    let fd = unsafe { memfd_create(c"stdin".as_ptr(), 0) };
    check(fd, "memfd_create")?;
    // SAFETY: a descriptor just made, owned here alone.
    let stdin = unsafe { File::from_raw_fd(fd) };
    Ok(Setup {
        uid,
        root,
        stdin,
        python: None,
    })
}

fn install_filters(hex: &str) -> Res<()> {
    for program in hex.split(',').filter(|p| !p.is_empty()) {
        let code = (0..program.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(program.get(i..i + 2).unwrap_or("zz"), 16))
            .collect::<Result<Vec<u8>, _>>()
            .map_err(|_| "bad seccomp filter hex".to_string())?;
        let prog = SockFprog {
            len: (code.len() / 8) as u16,
            filter: code.as_ptr(),
        };
        // SAFETY: `prog` points into `code`, alive across the call; the kernel copies it.
        let ret = unsafe {
            prctl(
                PR_SET_SECCOMP,
                SECCOMP_MODE_FILTER,
                &prog as *const SockFprog as c_ulong,
                0,
                0,
            )
        };
        check(ret, "seccomp")?;
    }
    Ok(())
}

impl Setup {
    fn with_python_stage(mut self) -> Res<Self> {
        // SAFETY: fds 4-8 are the stage's pipe ends and stdin, dup'ed here by the spawn and
        // owned by this process alone.
        let own = |fd| unsafe { OwnedFd::from_raw_fd(fd) };
        let (stdout, stderr, order, failure, stdin) = (own(4), own(5), own(6), own(7), own(8));
        // The first process of this namespace after its init: pid 2.
        // SAFETY: pidfd_open with integer arguments.
        let pidfd = unsafe { syscall(SYS_PIDFD_OPEN, 2 as c_int, 0 as c_int) } as c_int;
        check(pidfd, "pidfd_open of the python stage")?;
        for fd in [4, 5, 6, 7, 8, pidfd] {
            // SAFETY: fcntl on descriptors this process owns.
            unsafe { fcntl(fd, F_SETFD, FD_CLOEXEC) };
        }
        self.stdin = File::from(stdin);
        self.python = Some(PythonStage {
            stdout,
            stderr,
            order: File::from(order),
            failure: File::from(failure),
            // SAFETY: the descriptor pidfd_open just returned.
            pidfd: unsafe { OwnedFd::from_raw_fd(pidfd) },
        });
        Ok(self)
    }

    fn call(mut self, req: &Request, zygote: &mut File) -> Res<String> {
        if req.uid != self.uid {
            return Err(format!(
                "the request's uid {} is not this worker's {}",
                req.uid, self.uid
            ));
        }
        for (name, data) in &req.files {
            let path = inside_work(name)?;
            if let Some(dir) = std::path::Path::new(&path).parent() {
                std::fs::create_dir_all(dir).map_err(|e| format!("{name}: {e}"))?;
            }
            std::fs::write(&path, data).map_err(|e| format!("{name}: {e}"))?;
            chown(&path, Some(self.uid), Some(self.uid)).map_err(|e| format!("{name}: {e}"))?;
        }
        if !req.stdin.is_empty() {
            // Not a pipe: the whole input is there at once, and no writer can block.
            self.stdin
                .write_all(&req.stdin)
                .and_then(|_| self.stdin.rewind())
                .map_err(|e| format!("stdin: {e}"))?;
        }
        let main = format!("/work/{}", req.main);
        let mut compile = None;
        let run = match req.language.as_str() {
            "python" => {
                let stage = self
                    .python
                    .take()
                    .ok_or("no python stage was made for this call")?;
                run_python(req, stage, &main, zygote)
            }
            "bash" => Some(run_exec(
                req,
                &["/bin/bash", &req.main],
                &self.stdin,
                req.run_timeout,
            )),
            "node" => Some(run_exec(
                req,
                &["/usr/bin/node", &req.main],
                &self.stdin,
                req.run_timeout,
            )),
            "cpp" => {
                let argv = [
                    "/usr/bin/g++",
                    "-O2",
                    "-std=c++17",
                    "-o",
                    "/work/a.out",
                    &req.main,
                ];
                let empty = File::open("/dev/null").map_err(|e| format!("/dev/null: {e}"))?;
                let compiled = run_exec(req, &argv, &empty, req.compile_timeout);
                let ok = compiled.status == "Finished" && compiled.exit_code == Some(0);
                compile = Some(compiled);
                ok.then(|| run_exec(req, &["/work/a.out"], &self.stdin, req.run_timeout))
            }
            other => return Err(format!("language {other:?} has no runner")),
        };
        // Files to hand back, read as the call's uid (a symlink cannot reach more than it could).
        drop_privileges(self.uid)?;
        let mut budget = req.fetch_bytes;
        let mut files = Vec::new();
        let mut errors = Vec::new();
        for name in &req.fetch {
            let path = inside_work(name)?;
            let mut data = Vec::new();
            let read = File::open(&path)
                .and_then(|f| f.take(budget.saturating_add(1)).read_to_end(&mut data));
            match read {
                Err(e) => errors.push(format!("{name}: {}", io_reason(&e))),
                Ok(_) if data.len() as u64 > budget => errors.push(format!(
                    "{name}: over the {} bytes left for fetched files",
                    req.fetch_bytes
                )),
                Ok(_) => {
                    budget -= data.len() as u64;
                    files.push(format!("{}:\"{}\"", json_str(name), b64(&data)));
                }
            }
        }
        let stage_json = |s: &Option<StageOut>| s.as_ref().map_or("null".into(), StageOut::json);
        Ok(format!(
            "{{\"compile\":{},\"run\":{},\"files\":{{{}}},\"errors\":[{}]}}",
            stage_json(&compile),
            stage_json(&run),
            files.join(","),
            errors
                .iter()
                .map(|e| json_str(e))
                .collect::<Vec<_>>()
                .join(",")
        ))
    }
}

/// An OS error's reason alone, as python's `strerror` gives it.
fn io_reason(e: &std::io::Error) -> String {
    let text = e.to_string();
    match text.find(" (os error") {
        Some(end) => text[..end].to_string(),
        None => text,
    }
}

fn drop_privileges(uid: u32) -> Res<()> {
    // SAFETY: plain system calls with integer arguments.
    unsafe {
        check(setgroups(0, std::ptr::null()), "setgroups")?;
        check(setresgid(uid, uid, uid), "setresgid")?;
        check(setresuid(uid, uid, uid), "setresuid")?;
        check(prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")?;
    }
    Ok(())
}

fn inside_work(name: &str) -> Res<String> {
    // The engine checks names too (as std's path components: "a//b" and "a/./b" are a/b);
    // this runs as root, so check again.
    let parts: Vec<&str> = name
        .split('/')
        .filter(|part| !part.is_empty() && *part != ".")
        .collect();
    if name.starts_with('/') || parts.is_empty() || parts.contains(&"..") {
        return Err(format!("file name {name:?} leaves the working directory"));
    }
    Ok(format!("/work/{}", parts.join("/")))
}

/// What the engine sends: tagged records, each `tag, u32 big-endian length, bytes`.
struct Request {
    language: String,
    main: String,
    files: Vec<(String, Vec<u8>)>,
    fetch: Vec<String>,
    stdin: Vec<u8>,
    uid: u32,
    compile_timeout: Duration,
    run_timeout: Duration,
    /// The python stage's order (JSON: its limits), made by the engine.
    limits_json: String,
    limits: Limits,
    fetch_bytes: u64,
    output_bytes: usize,
}

#[derive(Clone, Copy)]
struct Limits {
    cpu_seconds: u64,
    file_bytes: u64,
    open_files: u64,
    processes: u64,
}

impl Request {
    fn parse(mut body: &[u8]) -> Res<Self> {
        let text =
            |b: &[u8]| String::from_utf8(b.to_vec()).map_err(|_| "non-UTF-8 text".to_string());
        let mut req = Request {
            language: String::new(),
            main: String::new(),
            files: Vec::new(),
            fetch: Vec::new(),
            stdin: Vec::new(),
            uid: u32::MAX,
            compile_timeout: Duration::ZERO,
            run_timeout: Duration::ZERO,
            limits_json: String::new(),
            limits: Limits {
                cpu_seconds: 1,
                file_bytes: 0,
                open_files: 0,
                processes: 0,
            },
            fetch_bytes: 0,
            output_bytes: 0,
        };
        let mut name = None;
        while !body.is_empty() {
            if body.len() < 5 {
                return Err("truncated request record".into());
            }
            let tag = body[0];
            let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
            let value = body.get(5..5 + len).ok_or("truncated request record")?;
            body = &body[5 + len..];
            match tag {
                b'L' => req.language = text(value)?,
                b'M' => req.main = text(value)?,
                b'N' => name = Some(text(value)?),
                b'D' => req.files.push((
                    name.take().ok_or("file data without a name")?,
                    value.to_vec(),
                )),
                b'F' => req.fetch.push(text(value)?),
                b'I' => req.stdin = value.to_vec(),
                b'J' => req.limits_json = text(value)?,
                b'T' => {
                    let numbers = text(value)?
                        .split(' ')
                        .map(|n| n.parse::<u64>())
                        .collect::<Result<Vec<u64>, _>>()
                        .map_err(|_| "bad numbers in the request".to_string())?;
                    let [uid, compile_ms, run_ms, cpu, processes, output, file, open, fetch] =
                        numbers[..]
                    else {
                        return Err("9 numbers expected in the request".into());
                    };
                    req.uid = uid as u32;
                    req.compile_timeout = Duration::from_millis(compile_ms);
                    req.run_timeout = Duration::from_millis(run_ms);
                    req.limits = Limits {
                        cpu_seconds: cpu.max(1),
                        file_bytes: file,
                        open_files: open,
                        processes,
                    };
                    req.output_bytes = output as usize;
                    req.fetch_bytes = fetch;
                }
                other => return Err(format!("unknown request record {other}")),
            }
        }
        Ok(req)
    }
}

fn set_limits(limits: Limits) -> std::io::Result<()> {
    let cpu = limits.cpu_seconds;
    for (resource, cur, max) in [
        (RLIMIT_CPU, cpu, cpu + 1),
        (RLIMIT_FSIZE, limits.file_bytes, limits.file_bytes),
        (RLIMIT_NOFILE, limits.open_files, limits.open_files),
        (RLIMIT_CORE, 0, 0),
        (RLIMIT_NPROC, limits.processes, limits.processes),
    ] {
        // SAFETY: setrlimit on a struct that lives across the call.
        if unsafe { setrlimit(resource, &RLimit { cur, max }) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

struct StageOut {
    time: Duration,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    stdout_truncated: bool,
    stderr_truncated: bool,
    exit_code: Option<i32>,
    signal: Option<i32>,
    status: &'static str,
}

impl StageOut {
    fn failed(message: String) -> Self {
        StageOut {
            time: Duration::ZERO,
            stdout: Vec::new(),
            stderr: message.into_bytes(),
            stdout_truncated: false,
            stderr_truncated: false,
            exit_code: None,
            signal: None,
            status: "Error",
        }
    }

    fn json(&self) -> String {
        let num = |v: Option<i32>| v.map_or("null".into(), |v| v.to_string());
        format!(
            "{{\"time\":{:.6},\"stdout\":\"{}\",\"stderr\":\"{}\",\"stdout_truncated\":{},\"stderr_truncated\":{},\"exit_code\":{},\"signal\":{},\"status\":\"{}\"}}",
            self.time.as_secs_f64(),
            b64(&self.stdout),
            b64(&self.stderr),
            self.stdout_truncated,
            self.stderr_truncated,
            num(self.exit_code),
            num(self.signal),
            self.status
        )
    }
}

/// A stage forked and exec'd here: the call's uid, its limits, /work as its directory.
fn run_exec(req: &Request, argv: &[&str], stdin: &File, timeout: Duration) -> StageOut {
    let spawned = (|| -> std::io::Result<_> {
        let (out_r, out_w) = pipe()?;
        let (err_r, err_w) = pipe()?;
        let limits = req.limits;
        let mut command = Command::new(argv[0]);
        command
            .args(&argv[1..])
            .env_clear()
            .envs(ENV)
            .current_dir("/work")
            .stdin(Stdio::from(stdin.try_clone()?))
            .stdout(Stdio::from(out_w))
            .stderr(Stdio::from(err_w))
            .uid(req.uid)
            .gid(req.uid);
        // SAFETY: only prctl and setrlimit between fork and exec: no allocation, no locks.
        unsafe {
            command.pre_exec(move || {
                if prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                set_limits(limits)
            });
        }
        let child = command.spawn()?;
        drop(command);
        Ok((child, out_r, err_r))
    })();
    let (mut child, out_r, err_r) = match spawned {
        Ok(s) => s,
        Err(e) => return StageOut::failed(format!("cannot start the stage: {e}")),
    };
    // SAFETY: pidfd_open with integer arguments, for our own child.
    let pidfd = unsafe { syscall(SYS_PIDFD_OPEN, child.id() as c_int, 0 as c_int) } as c_int;
    if pidfd < 0 {
        let _ = child.kill();
        let _ = child.wait();
        return StageOut::failed(os_err("pidfd_open"));
    }
    // SAFETY: the descriptor pidfd_open just returned.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd) };
    let mut out = supervise(req, &pidfd, out_r, err_r, timeout);
    let status = child.wait().ok();
    out.finish(
        status.and_then(|s| s.code()),
        status.and_then(|s| s.signal()),
    );
    out
}

/// The python stage made ahead: told its limits and file, then supervised; its wait status
/// comes from the zygote, its parent.
fn run_python(
    req: &Request,
    stage: PythonStage,
    main: &str,
    zygote: &mut File,
) -> Option<StageOut> {
    let PythonStage {
        stdout,
        stderr,
        mut order,
        mut failure,
        pidfd,
    } = stage;
    let message = format!("{{\"path\":{},{}}}", json_str(main), req.limits_json);
    let _ = order.write_all(message.as_bytes());
    drop(order);
    let mut out = supervise(req, &pidfd, stdout, stderr, req.run_timeout);
    let status = loop {
        match receive(zygote) {
            Some(m) if m.len() == 5 && m[0] == b'x' => {
                break Some(i32::from_be_bytes([m[1], m[2], m[3], m[4]]))
            }
            Some(_) => continue,
            None => break None,
        }
    };
    let (code, signal) = match status {
        Some(s) if s & 0x7f == 0 => (Some((s >> 8) & 0xff), None),
        Some(s) => (None, Some(s & 0x7f)),
        None => (None, Some(SIGKILL)),
    };
    out.finish(code, signal);
    let mut why = Vec::new();
    let _ = failure.read_to_end(&mut why);
    if !why.is_empty() {
        out.status = "Error";
        out.stderr = why;
    }
    Some(out)
}

impl StageOut {
    fn finish(&mut self, code: Option<i32>, signal: Option<i32>) {
        self.exit_code = code;
        self.signal = signal;
        if signal == Some(SIGXCPU) && self.status == "Finished" {
            self.status = "TimeLimitExceeded";
        }
    }
}

fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let (r, w) = std::io::pipe()?;
    Ok((r.into(), w.into()))
}

/// Collects a started stage's output up to the cap, killing it at the wall-time limit and,
/// once it is gone, everything it left behind.
fn supervise(
    req: &Request,
    pidfd: &OwnedFd,
    out_r: OwnedFd,
    err_r: OwnedFd,
    timeout: Duration,
) -> StageOut {
    let cap = req.output_bytes;
    let started = Instant::now();
    let deadline = started + timeout;
    // Per stream: the pipe while it is read, what was kept, whether it was cut.
    let mut streams = [
        (Some(File::from(out_r)), Vec::new(), false),
        (Some(File::from(err_r)), Vec::new(), false),
    ];
    let mut timed_out = false;
    let mut buf = vec![0u8; 65536];
    loop {
        let open: Vec<usize> = (0..2).filter(|&i| streams[i].0.is_some()).collect();
        if open.is_empty() {
            break;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            timed_out = true;
            break;
        }
        let mut fds: Vec<PollFd> = open
            .iter()
            .filter_map(|&i| streams[i].0.as_ref().map(|f| f.as_raw_fd()))
            .chain([pidfd.as_raw_fd()])
            .map(|fd| PollFd {
                fd,
                events: POLLIN,
                revents: 0,
            })
            .collect();
        let ms = left.as_millis().clamp(1, i32::MAX as u128) as c_int;
        // SAFETY: `fds` is a live array of `fds.len()` entries.
        let n = unsafe { poll(fds.as_mut_ptr(), fds.len() as c_ulong, ms) };
        if n < 0 {
            continue;
        }
        if fds.last().is_some_and(|p| p.revents != 0) {
            // The stage exited; what it left buffered is drained below.
            break;
        }
        for (k, &i) in open.iter().enumerate() {
            if fds[k].revents == 0 {
                continue;
            }
            let (pipe, kept, cut) = &mut streams[i];
            let got = pipe.as_mut().map_or(0, |f| f.read(&mut buf).unwrap_or(0));
            let room = cap - kept.len();
            kept.extend_from_slice(&buf[..got.min(room)]);
            // Over the cap: stop reading and close, the writer gets SIGPIPE / EPIPE.
            *cut = got > room;
            if got == 0 || *cut {
                *pipe = None;
            }
        }
    }
    if timed_out {
        // SAFETY: pidfd_send_signal on a pidfd this process holds.
        unsafe {
            syscall(
                SYS_PIDFD_SEND_SIGNAL,
                pidfd.as_raw_fd(),
                SIGKILL,
                0usize,
                0u32,
            )
        };
    }
    // Wait for the stage's end (its pidfd becomes readable) before the sweep below.
    let mut wait = [PollFd {
        fd: pidfd.as_raw_fd(),
        events: POLLIN,
        revents: 0,
    }];
    // SAFETY: a live one-entry array.
    unsafe { poll(wait.as_mut_ptr(), 1, -1) };
    let elapsed = started.elapsed();
    // Whatever the stage left behind (background processes) goes with it: we are pid 1.
    // SAFETY: kill(-1) from pid 1 of the call's namespace reaches only the call's processes.
    unsafe { kill(-1, SIGKILL) };
    for (pipe, kept, cut) in streams.iter_mut() {
        let Some(file) = pipe.take() else { continue };
        // Writers are gone: drain what is buffered, up to the cap.
        let mut file = file;
        loop {
            let got = file.read(&mut buf).unwrap_or(0);
            if got == 0 {
                break;
            }
            let room = cap - kept.len();
            kept.extend_from_slice(&buf[..got.min(room)]);
            if got > room {
                *cut = true;
                break;
            }
        }
    }
    let [(_, stdout, stdout_truncated), (_, stderr, stderr_truncated)] = streams;
    StageOut {
        time: elapsed,
        stdout,
        stderr,
        stdout_truncated,
        stderr_truncated,
        exit_code: None,
        signal: None,
        status: if timed_out {
            "TimeLimitExceeded"
        } else {
            "Finished"
        },
    }
}

fn json_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn b64(data: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let n = (chunk[0] as u32) << 16
            | (*chunk.get(1).unwrap_or(&0) as u32) << 8
            | *chunk.get(2).unwrap_or(&0) as u32;
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

// Compiled into the engine's unit tests too (fncall/src/lib.rs), where the engine's side of
// the format is at hand.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::container::{init_request, CallLimits};
    use crate::request::{CallRequest, Language};
    use base64::Engine as _;

    #[test]
    fn reads_the_request_the_engine_writes() {
        let mut call = CallRequest::new(Language::Cpp, String::from("int main() {}"));
        call.stdin = vec![0, 255, 10];
        call.files.insert("data/in.txt".into(), b"abc".to_vec());
        call.fetch_files = vec!["out.txt".into()];
        call.run_timeout = Duration::from_millis(2500);
        let limits = CallLimits::default();
        let req = Request::parse(&init_request(&call, 1234, &limits)).unwrap();
        assert_eq!(req.language, "cpp");
        assert_eq!(req.main, "main.cpp");
        assert_eq!(
            req.files,
            vec![
                ("main.cpp".to_string(), b"int main() {}".to_vec()),
                ("data/in.txt".to_string(), b"abc".to_vec())
            ]
        );
        assert_eq!(req.fetch, vec!["out.txt".to_string()]);
        assert_eq!(req.stdin, vec![0, 255, 10]);
        assert_eq!(req.uid, 1234);
        assert_eq!(req.run_timeout, Duration::from_millis(2500));
        assert_eq!(req.output_bytes as u64, limits.output_bytes);
        assert_eq!(req.fetch_bytes, limits.fetch_bytes);
        assert_eq!(req.limits.processes, u64::from(limits.processes));
        // The python stage's order is JSON once the init puts its path first.
        let order: serde_json::Value = serde_json::from_str(&format!(
            "{{\"path\":\"/work/main.py\",{}}}",
            req.limits_json
        ))
        .unwrap();
        assert_eq!(order["limits"]["file_bytes"], limits.file_bytes);
        assert!(order["cpu_seconds"].as_u64().unwrap() >= 3);
    }

    #[test]
    fn refuses_truncated_or_unknown_records() {
        assert!(Request::parse(b"L\0\0\0\x09py").is_err());
        assert!(Request::parse(b"Z\0\0\0\0").is_err());
        assert!(Request::parse(b"D\0\0\0\0").is_err());
        assert!(Request::parse(b"T\0\0\0\x031 2").is_err());
    }

    #[test]
    fn base64_and_json_strings_match_what_the_engine_parses() {
        let engine = base64::engine::general_purpose::STANDARD;
        for data in [&b""[..], b"a", b"ab", b"abc", b"abcd", &[0, 255, 128, 7, 9]] {
            assert_eq!(b64(data), engine.encode(data));
        }
        let text = "a \"quoted\" \\ line\nand\u{1}é";
        let parsed: String = serde_json::from_str(&json_str(text)).unwrap();
        assert_eq!(parsed, text);
    }

    #[test]
    fn file_names_stay_in_the_work_directory() {
        assert_eq!(inside_work("a/b.txt").unwrap(), "/work/a/b.txt");
        assert_eq!(inside_work("a//./b/").unwrap(), "/work/a/b");
        for bad in ["", ".", "/etc/passwd", "../x", "a/../../x", "a/.."] {
            assert!(inside_work(bad).is_err(), "{bad:?}");
        }
    }
}
