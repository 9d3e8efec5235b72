//! The four resources that quotas and node capacity count.

use serde::{Deserialize, Serialize};

/// Sandboxes, vCPUs, memory and disk. In a quota limit, `u64::MAX` means unlimited.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Resources {
    pub sandboxes: u64,
    pub vcpus: u64,
    pub memory_mib: u64,
    pub disk_mib: u64,
}

impl Resources {
    pub const ZERO: Resources = Resources::new(0, 0, 0, 0);
    pub const UNLIMITED: Resources = Resources::new(u64::MAX, u64::MAX, u64::MAX, u64::MAX);

    pub const fn new(sandboxes: u64, vcpus: u64, memory_mib: u64, disk_mib: u64) -> Self {
        Resources {
            sandboxes,
            vcpus,
            memory_mib,
            disk_mib,
        }
    }

    /// One sandbox of this size.
    pub const fn sandbox(vcpus: u64, memory_mib: u64, disk_mib: u64) -> Self {
        Resources::new(1, vcpus, memory_mib, disk_mib)
    }

    /// (name, value) of each resource, in a fixed order.
    pub fn named(&self) -> [(&'static str, u64); 4] {
        [
            ("sandboxes", self.sandboxes),
            ("vcpus", self.vcpus),
            ("memory_mib", self.memory_mib),
            ("disk_mib", self.disk_mib),
        ]
    }

    fn zip(self, other: Resources, f: impl Fn(u64, u64) -> u64) -> Resources {
        Resources::new(
            f(self.sandboxes, other.sandboxes),
            f(self.vcpus, other.vcpus),
            f(self.memory_mib, other.memory_mib),
            f(self.disk_mib, other.disk_mib),
        )
    }

    pub fn plus(self, other: Resources) -> Resources {
        self.zip(other, u64::saturating_add)
    }

    /// `count` of this size.
    pub fn times(self, count: u64) -> Resources {
        Resources::new(
            self.sandboxes.saturating_mul(count),
            self.vcpus.saturating_mul(count),
            self.memory_mib.saturating_mul(count),
            self.disk_mib.saturating_mul(count),
        )
    }

    /// Subtracts, stopping at zero.
    pub fn minus(self, other: Resources) -> Resources {
        self.zip(other, u64::saturating_sub)
    }

    /// What is left of a limit after `spent`; an unlimited resource stays unlimited.
    pub fn left_after(self, spent: Resources) -> Resources {
        self.zip(spent, |limit, spent| {
            if limit == u64::MAX {
                limit
            } else {
                limit.saturating_sub(spent)
            }
        })
    }

    /// The first resource (name, asked, available) where `self` asks for more than `available`.
    pub fn first_excess(&self, available: &Resources) -> Option<(&'static str, u64, u64)> {
        self.named()
            .into_iter()
            .zip(available.named())
            .find(|((_, asked), (_, left))| asked > left)
            .map(|((name, asked), (_, left))| (name, asked, left))
    }

    pub fn fits_in(&self, available: &Resources) -> bool {
        self.first_excess(available).is_none()
    }
}

impl std::fmt::Display for Resources {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let show = |v: u64| {
            if v == u64::MAX {
                "unlimited".to_string()
            } else {
                v.to_string()
            }
        };
        write!(
            f,
            "{} sandboxes, {} vCPUs, {} MiB memory, {} MiB disk",
            show(self.sandboxes),
            show(self.vcpus),
            show(self.memory_mib),
            show(self.disk_mib)
        )
    }
}
