//! DSec's virtual machine monitor: one process per sandbox, built on the rust-vmm crates.
//!
//! [`vm::run`] builds a VM from a [`config::VmConfig`] (memory, vCPUs, serial, i8042,
//! CMOS, an MP table and a virtio-mmio vsock device), boots the kernel through PVH or the
//! Linux 64-bit protocol, and returns when the guest resets or crashes.

pub mod arch;
pub mod config;
pub mod control;
pub mod cow_writer;
pub mod devices;
pub mod exit;
pub mod jail;
pub mod kvm_stats;
pub mod memory;
pub mod pagemap;
pub mod persist;
pub mod seccomp;
pub mod snapshot;
pub mod sync;
pub mod teardown;
pub mod timing;
pub mod uffd;
pub mod vcpu;
pub mod vm;

pub use config::{SerialOutput, VmConfig, VsockConfig};
pub use vm::{run, LazyRestore, RestoreOverrides, RunReport, Vm, VmError, VmExitReason};
