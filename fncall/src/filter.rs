//! The sandbox seccomp filter (dsec-confine's deny list, the same answers) as one BPF program
//! laid out as a binary search over the system call numbers, for calls whose processes each
//! install it (the call's init and the python stage: twice per call).
//!
//! Why: installing a filter makes the kernel run it for every system call number to build
//! its allow cache, with interrupts off. dsec-confine's programs (seccompiler) compare the
//! number against each denied call in turn, ~50 steps for every allowed number, and come as
//! two programs (clone3's answer differs): ~0.15 ms of CPU per install on a VM host, 8% of a
//! python call's CPU. Here every number is decided in at most ~10 steps, in one program.
//! The test below checks it answers exactly as dsec-confine's programs do.

use seccompiler::{sock_filter, BpfProgram};

const LD_W_ABS: u16 = 0x20;
const JMP_JA: u16 = 0x05;
const JMP_JEQ_K: u16 = 0x15;
const JMP_JGE_K: u16 = 0x35;
const JMP_JSET_K: u16 = 0x45;
const RET_K: u16 = 0x06;
/// Offsets in `struct seccomp_data`: nr, arch, the low half of args[0] (little endian).
const NR: u32 = 0;
const ARCH: u32 = 4;
const ARG0_LOW: u32 = 16;
const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;
/// x32 system calls (this bit set in the number): refused outright, no sandbox needs them.
const X32_SYSCALL_BIT: u32 = 0x4000_0000;
const RET_ALLOW: u32 = 0x7fff_0000;
const RET_KILL_PROCESS: u32 = 0x8000_0000;
const RET_ERRNO: u32 = 0x0005_0000;

/// Where a jump goes: an instruction of the search, or one of the shared answers at the end.
#[derive(Clone, Copy)]
enum Target {
    Next,
    At(usize),
    /// clone / unshare: refused if they ask for a new user namespace.
    UserNsCheck,
    Allow,
    Deny,
    NoSys,
    Kill,
}

struct Insn {
    code: u16,
    jt: Target,
    jf: Target,
    k: u32,
}

fn insn(code: u16, jt: Target, jf: Target, k: u32) -> Insn {
    Insn { code, jt, jf, k }
}

/// The sandbox filter as one program (see the module's note).
pub fn sandbox_program() -> BpfProgram {
    let mut keys: Vec<(u32, Target)> = dsec_confine::DENIED_SYSCALLS
        .iter()
        .map(|&nr| (nr as u32, Target::Deny))
        .collect();
    keys.push((libc::SYS_clone as u32, Target::UserNsCheck));
    keys.push((libc::SYS_unshare as u32, Target::UserNsCheck));
    keys.push((libc::SYS_clone3 as u32, Target::NoSys));
    keys.sort_by_key(|&(nr, _)| nr);
    keys.dedup_by_key(|&mut (nr, _)| nr);

    let mut code = vec![
        insn(LD_W_ABS, Target::Next, Target::Next, ARCH),
        insn(JMP_JEQ_K, Target::Next, Target::Kill, AUDIT_ARCH_X86_64),
        insn(LD_W_ABS, Target::Next, Target::Next, NR),
        insn(JMP_JGE_K, Target::Deny, Target::Next, X32_SYSCALL_BIT),
    ];
    search(&keys, &mut code);
    let tail = code.len();
    // The shared answers, in this order (every jump to them is forward).
    let user_ns_check = tail;
    code.push(insn(LD_W_ABS, Target::Next, Target::Next, ARG0_LOW));
    code.push(insn(
        JMP_JSET_K,
        Target::Deny,
        Target::Allow,
        libc::CLONE_NEWUSER as u32,
    ));
    let answers = [
        (Target::Allow, RET_ALLOW),
        (Target::Deny, RET_ERRNO | libc::EPERM as u32),
        (Target::NoSys, RET_ERRNO | libc::ENOSYS as u32),
        (Target::Kill, RET_KILL_PROCESS),
    ];
    let answer_at = |target: Target| -> Option<usize> {
        let n = match target {
            Target::UserNsCheck => return Some(user_ns_check),
            Target::Allow => 0,
            Target::Deny => 1,
            Target::NoSys => 2,
            Target::Kill => 3,
            Target::Next | Target::At(_) => return None,
        };
        Some(user_ns_check + 2 + n)
    };
    for (_, ret) in answers {
        code.push(insn(RET_K, Target::Next, Target::Next, ret));
    }
    let offset = |from: usize, target: Target| -> u32 {
        let to = match target {
            Target::Next => from + 1,
            Target::At(i) => i,
            other => answer_at(other).expect("an answer"),
        };
        assert!(to > from, "BPF jumps go forward only");
        (to - from - 1) as u32
    };
    code.iter()
        .enumerate()
        .map(|(i, ins)| {
            let (jt, jf, k) = match ins.code {
                JMP_JEQ_K | JMP_JGE_K | JMP_JSET_K => {
                    let jt = offset(i, ins.jt);
                    let jf = offset(i, ins.jf);
                    assert!(jt <= 255 && jf <= 255, "a conditional jump beyond 255");
                    (jt as u8, jf as u8, ins.k)
                }
                JMP_JA => (0, 0, offset(i, ins.jt)),
                _ => (0, 0, ins.k),
            };
            sock_filter {
                code: ins.code,
                jt,
                jf,
                k,
            }
        })
        .collect()
}

/// A binary search over `keys` (sorted numbers and their answers); numbers not in it are
/// allowed. The accumulator holds the number.
fn search(keys: &[(u32, Target)], code: &mut Vec<Insn>) {
    if keys.len() <= 3 {
        for (i, &(nr, answer)) in keys.iter().enumerate() {
            let otherwise = if i + 1 == keys.len() {
                Target::Allow
            } else {
                Target::Next
            };
            code.push(insn(JMP_JEQ_K, answer, otherwise, nr));
        }
        if keys.is_empty() {
            code.push(insn(JMP_JA, Target::Allow, Target::Next, 0));
        }
        return;
    }
    let mid = keys.len() / 2;
    let split = code.len();
    // Numbers >= keys[mid] go right (patched below), the rest fall through to the left half.
    code.push(insn(JMP_JGE_K, Target::Next, Target::Next, keys[mid].0));
    search(&keys[..mid], code);
    code[split].jt = Target::At(code.len());
    search(&keys[mid..], code);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs a classic BPF seccomp program on (nr, arch, args[0]); returns its answer and the
    /// number of instructions it ran.
    fn run(program: &[sock_filter], nr: u32, arch: u32, arg0: u64) -> (u32, usize) {
        let mut data = [0u8; 64];
        data[0..4].copy_from_slice(&nr.to_ne_bytes());
        data[4..8].copy_from_slice(&arch.to_ne_bytes());
        data[16..24].copy_from_slice(&arg0.to_ne_bytes());
        let (mut acc, mut pc, mut steps) = (0u32, 0usize, 0usize);
        loop {
            let ins = &program[pc];
            steps += 1;
            pc += 1;
            let jump = |taken: bool| (if taken { ins.jt } else { ins.jf }) as usize;
            match ins.code {
                LD_W_ABS => {
                    let at = ins.k as usize;
                    acc = u32::from_ne_bytes(data[at..at + 4].try_into().unwrap());
                }
                0x54 => acc &= ins.k,
                JMP_JA => pc += ins.k as usize,
                JMP_JEQ_K => pc += jump(acc == ins.k),
                0x25 => pc += jump(acc > ins.k),
                JMP_JGE_K => pc += jump(acc >= ins.k),
                JMP_JSET_K => pc += jump(acc & ins.k != 0),
                RET_K => return (ins.k, steps),
                other => panic!("opcode {other:#x} not interpreted by this test"),
            }
        }
    }

    /// What the kernel answers with several filters installed: the most restrictive action
    /// (ties: the filter installed last).
    fn kernel_answer(filters: &[BpfProgram], nr: u32, arch: u32, arg0: u64) -> u32 {
        let mut answer = RET_ALLOW;
        for filter in filters.iter().rev() {
            let (ret, _) = run(filter, nr, arch, arg0);
            if ((ret & 0xffff_0000) as i32) < ((answer & 0xffff_0000) as i32) {
                answer = ret;
            }
        }
        answer
    }

    #[test]
    fn answers_as_the_sandbox_filters_do_in_few_steps() {
        let reference = dsec_confine::sandbox_filters().unwrap();
        let ours = sandbox_program();
        let new_user = libc::CLONE_NEWUSER as u64;
        let new_ns = libc::CLONE_NEWNS as u64;
        for nr in 0..1024u32 {
            for arch in [AUDIT_ARCH_X86_64, 0x4000_0003] {
                for arg0 in [0, new_user, new_user | new_ns, new_ns, 0x11, u64::MAX] {
                    let want = kernel_answer(&reference, nr, arch, arg0);
                    let (got, steps) = run(&ours, nr, arch, arg0);
                    assert_eq!(got, want, "nr {nr} arch {arch:#x} arg0 {arg0:#x}");
                    assert!(steps <= 14, "nr {nr}: {steps} steps");
                }
            }
        }
        let eperm = RET_ERRNO | libc::EPERM as u32;
        assert_eq!(
            run(&ours, libc::SYS_mount as u32, AUDIT_ARCH_X86_64, 0).0,
            eperm
        );
        assert_eq!(
            run(&ours, X32_SYSCALL_BIT | 165, AUDIT_ARCH_X86_64, 0).0,
            eperm
        );
        let (enosys, _) = run(&ours, libc::SYS_clone3 as u32, AUDIT_ARCH_X86_64, 0);
        assert_eq!(enosys, RET_ERRNO | libc::ENOSYS as u32);
    }
}
