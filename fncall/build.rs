//! Builds the container workers' call init (init/call_init.rs) with rustc alone: std only,
//! statically linked (it runs inside the image, whose libc is not the host's), optimised
//! even in debug builds (it runs once per call). The engine embeds the result.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let source = "init/call_init.rs";
    println!("cargo:rerun-if-changed={source}");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let rustc = std::env::var_os("RUSTC").expect("cargo sets RUSTC");
    let target = std::env::var("TARGET").expect("cargo sets TARGET");
    let status = Command::new(rustc)
        .args([
            "--edition",
            "2021",
            "--crate-type",
            "bin",
            "--crate-name",
            "fncall_init",
        ])
        .args(["--target", &target])
        .args([
            "-C",
            "opt-level=2",
            "-C",
            "panic=abort",
            "-C",
            "strip=symbols",
        ])
        .args(["-C", "target-feature=+crt-static"])
        .arg("-o")
        .arg(out.join("fncall-init"))
        .arg(source)
        .status()
        .expect("run rustc for the call init");
    assert!(status.success(), "building {source} failed");
}
