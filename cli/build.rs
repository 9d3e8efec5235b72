//! Links `dsec` as a position-dependent executable. The CLI is started for every command,
//! and a PIE of this size has ~29k relative relocations: ld.so writes them into ~110 pages
//! of `.data.rel.ro`/`.got` at each start (each a copy-on-write fault), which cost a
//! `dsec --version` ~2x its time in an emulated L1 (perf/README.md, "Where a template
//! create's time goes"). Shared libraries and the stack, heap and mmap areas stay randomized.
fn main() {
    let target = std::env::var("TARGET").unwrap_or_default();
    if target.contains("linux") {
        println!("cargo:rustc-link-arg-bin=dsec=-no-pie");
    }
    println!("cargo:rerun-if-changed=build.rs");
}
