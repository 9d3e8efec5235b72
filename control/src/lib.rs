//! The DSec control plane: the store it keeps its state in, identity and access, nested
//! quotas, placement and the node watcher. See README.md for the layout.

pub mod store;

#[cfg(test)]
mod testing;
