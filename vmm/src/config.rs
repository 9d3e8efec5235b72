//! VM configuration: the types live in the contract crate (`dsec-vmm-api`), shared with the
//! programs that start VMMs; re-exported here so `crate::config::...` names them.

pub use dsec_vmm_api::config::*;
