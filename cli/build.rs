//! Links `dsec` with packed relative relocations (DT_RELR). The CLI is started for every
//! command, and a PIE of this size has ~29k relative relocations: applied one by one, ld.so's
//! work at each start cost a `dsec --version` ~2x its time in an emulated L1 (perf/README.md,
//! "Where a template create's time goes"). Packed, they take a fraction of the space and time,
//! and the binary stays position-independent: the daemon (`dsec up`, the same binary, which
//! parses hostile input as root) keeps its code and data randomized.
fn main() {
    let target = std::env::var("TARGET").unwrap_or_default();
    if target.contains("linux") {
        println!("cargo:rustc-link-arg-bin=dsec=-Wl,-z,pack-relative-relocs");
    }
    println!("cargo:rerun-if-changed=build.rs");
}
