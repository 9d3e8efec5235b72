//! x86_64 platform: memory layout, boot protocols, CPU setup, MP table.

pub mod boot;
pub mod cpu;
pub mod layout;
pub mod mptable;
